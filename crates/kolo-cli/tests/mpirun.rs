//! The MPI backend under `mpirun` (with `--features mpi`): a test target of its own, so that
//! building it with the feature rebuilds only the `kolo` binary and this file, not the
//! process-level suite in `tests/it`. Without the feature it holds no test.
#![cfg(feature = "mpi")]

use std::process::{Command, Output};

const KOLO: &str = env!("CARGO_BIN_EXE_kolo");

fn text(o: &Output) -> String {
    format!("status {:?}\n--- stdout\n{}\n--- stderr\n{}", o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// With `--features mpi`: `mpirun -n 2 kolo train` runs DDP over the MPI library unchanged, and
/// `kolo bench collectives` checks every size over it.
#[test]
fn mpirun_trains_and_benchmarks_over_the_mpi_backend() {
    let dir = std::env::temp_dir().join(format!("kolo-mpi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = kolo_testkit::files::mnist_dir();
    let cfg = dir.join("mlp.toml");
    std::fs::write(&cfg, format!("[model]\nkind = \"mlp\"\nhidden = [64]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[train]\nsteps = 40\nlog_every = 20\neval_batches = 20\n", data.display())).unwrap();
    let mpirun = |args: &[&str]| {
        // Containers often forbid the cross-memory attach Open MPI's shared memory prefers.
        Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-n", "2", KOLO])
            .args(args)
            .env("RAYON_NUM_THREADS", "1")
            .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
            .output()
            .expect("mpirun")
    };
    let o = mpirun(&["train", "--config", cfg.to_str().unwrap()]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("collectives over mpi (2 ranks)") && t.contains("done: 40 steps"), "{t}");
    let o = mpirun(&[
        "bench",
        "collectives",
        "--op",
        "all_gather",
        "--dtype",
        "bf16",
        "--min",
        "4KiB",
        "--max",
        "1MiB",
        "--factor",
        "16",
        "--trials",
        "1",
        "--trial-secs",
        "0.005",
    ]);
    let t = text(&o);
    assert!(o.status.success() && !t.contains("WRONG") && t.contains("the mpi library"), "{t}");
    std::fs::remove_dir_all(&dir).unwrap();
}
