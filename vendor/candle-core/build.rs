// Kolo: marks this candle-core as the one with Kolo's changes (vendor/PATCHES.md). Through
// `links = "kolo_candle_patch"` the mark reaches the build scripts of the crates that depend on
// candle-core directly as DEP_KOLO_CANDLE_PATCH_VERSION; kolo-tensor's refuses a build without it.
fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:version=1");
}
