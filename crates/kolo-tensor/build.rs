//! Refuses, before anything else compiles, a build whose candle-core is not Kolo's patched one:
//! a crate that depends on `kolo` without the `[patch.crates-io]` lines would otherwise build
//! upstream candle for minutes and then fail with `no method named backward_with_hook`.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEP_KOLO_CANDLE_PATCH_VERSION");
    if std::env::var_os("DEP_KOLO_CANDLE_PATCH_VERSION").is_some() {
        return;
    }
    // The vendored crates sit two levels above this crate in Kolo's repository (a path or git
    // dependency checks out the whole repository).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let root = root.canonicalize().unwrap_or(root);
    let vendor = root.join("vendor");
    eprintln!(
        "kolo needs Kolo's patched candle, but this build uses candle-core from crates.io.\n\
         Add these lines to the root Cargo.toml of your workspace (vendor/PATCHES.md lists the changes):\n\n\
         [patch.crates-io]\n\
         candle-core = {{ path = \"{core}\" }}\n\
         candle-nn = {{ path = \"{nn}\" }}\n\n\
         or, when kolo is a git dependency, the same repository:\n\n\
         [patch.crates-io]\n\
         candle-core = {{ git = \"<the git URL of your kolo dependency>\" }}\n\
         candle-nn = {{ git = \"<the git URL of your kolo dependency>\" }}\n",
        core = vendor.join("candle-core").display(),
        nn = vendor.join("candle-nn").display(),
    );
    std::process::exit(1);
}
