//! The NCCL backend end to end through `kolo-nccl-check`. With a GPU (and libnccl on
//! LD_LIBRARY_PATH) the collective matrix, the GPU-buffer collectives and the deadline run for
//! real; without one (CI) the same binary must stop with an error that says what is missing,
//! never a panic or a hang.
#![cfg(feature = "nccl")]

use std::process::Command;
use std::time::{Duration, Instant};

fn check(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_kolo-nccl-check"))
        .args(args)
        .env("KOLO_TIMEOUT_MS", "3000")
        .output()
        .expect("run kolo-nccl-check");
    (o.status.success(), format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

fn gpu() -> bool {
    kolo_nccl::cuda_device_count() > 0 && kolo_nccl::nccl_version().is_ok()
}

#[test]
fn collective_matrix_on_the_gpu_or_a_clear_error_without_one() {
    let t = Instant::now();
    let (ok, text) = check(&["check"]);
    assert!(t.elapsed() < Duration::from_secs(300), "{text}");
    if gpu() {
        assert!(ok, "{text}");
        assert!(
            text.contains("host-API collective matrix passed")
                && text.contains("GPU-buffer collectives passed")
                && text.contains("nccl check ok"),
            "{text}"
        );
    } else {
        assert!(!ok, "{text}");
        assert!(!text.contains("panicked"), "a missing GPU or NCCL must not panic: {text}");
        assert!(text.contains("rank 0: setup:"), "the error names the rank and the step: {text}");
        assert!(text.contains("NCCL") || text.contains("CUDA"), "the error names what is missing: {text}");
    }
}

#[test]
fn the_library_reports_what_it_finds() {
    // Without a driver there are no devices (not a crash); the version needs libnccl.
    let n = kolo_nccl::cuda_device_count();
    match kolo_nccl::nccl_version() {
        Ok((major, minor, _)) => assert!(major == 2 && minor >= 18, "NCCL {major}.{minor}: ncclCommSplit needs 2.18+"),
        Err(e) => assert!(e.to_string().contains("LD_LIBRARY_PATH"), "{e} (devices: {n})"),
    }
}
