//! Where the tests' data lives, and what a test does when an external tool is missing.
//!
//! Tests read only what the repository ships (`data/`, `test-data/`): a fresh clone with the
//! Rust toolchain runs the whole suite. A test that needs a tool CI can install (Python's
//! `safetensors`, Open MPI) calls [`tool_missing`] instead of silently passing.

use std::path::PathBuf;

/// The repository root: two levels above this crate's manifest, or, for a test binary copied
/// to another machine (the GPU checks of `bench/gpu/run.sh`), the directory it runs in.
pub fn repo_root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    if built.join("test-data").is_dir() {
        built
    } else {
        PathBuf::from(".")
    }
}

/// The MNIST subset (10,000 training and 2,000 test images) in `test-data/mnist`.
pub fn mnist_dir() -> PathBuf {
    repo_root().join("test-data/mnist")
}

/// Tiny Shakespeare, the main job's corpus, in `data/tinyshakespeare.txt`.
pub fn shakespeare() -> PathBuf {
    repo_root().join("data/tinyshakespeare.txt")
}

/// The variable that turns a missing external tool from a note into a failure (`.ci/run` sets
/// it, so CI cannot pass with a check that never ran).
pub const STRICT_VAR: &str = "KOLO_TEST_STRICT";

/// Reports that `what` is missing so the calling test cannot do its check: under
/// `KOLO_TEST_STRICT=1` this fails the test; otherwise it prints why the check did not run and
/// the caller returns.
pub fn tool_missing(what: &str) {
    if std::env::var(STRICT_VAR).is_ok_and(|v| v == "1") {
        panic!("{what} is missing and {STRICT_VAR}=1: this check must run here (install it)");
    }
    kolo_base::eline!("SKIPPED: {what} is missing; this check did not run (set {STRICT_VAR}=1 to make that a failure)");
}

/// The UCI red wine quality table (1,599 rows) in `test-data/tabular/winequality-red.csv`.
pub fn wine_csv() -> PathBuf {
    repo_root().join("test-data/tabular/winequality-red.csv")
}

/// A small GPT-2 saved by `transformers` (`save_pretrained`) and its logits on fixed tokens,
/// in `test-data/hf/gpt2-tiny` (made by `test-data/hf/make_gpt2_reference.py`).
pub fn hf_gpt2_tiny() -> PathBuf {
    repo_root().join("test-data/hf/gpt2-tiny")
}

/// A small Llama-style model (RMSNorm, rotary, SwiGLU, grouped-query attention) saved by
/// `transformers`, with its logits, in `test-data/hf/llama-tiny` (`make_llama_reference.py`).
pub fn hf_llama_tiny() -> PathBuf {
    repo_root().join("test-data/hf/llama-tiny")
}

/// A tiny model of another architecture (`qwen2`, `mistral`, `llama3`, `gemma`, `phi3`, `neox`)
/// saved by `transformers`, with its logits, in `test-data/hf/{arch}-tiny`
/// (`make_family_reference.py`, which says what each exercises).
pub fn hf_tiny(arch: &str) -> PathBuf {
    repo_root().join(format!("test-data/hf/{arch}-tiny"))
}
