//! The MPI backend under a real `mpirun` (Open MPI), when this crate is built with `--features
//! mpi` (CI installs Open MPI and runs it; without the feature there is nothing to test).
#![cfg(feature = "mpi")]

use std::process::Command;

fn mpirun(n: usize, program: &str, args: &[&str]) -> std::process::Output {
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-n", &n.to_string(), program])
        .args(args)
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .expect("mpirun (apt-get install openmpi-bin libopenmpi-dev)")
}

#[test]
fn mpi_backend_passes_the_collective_matrix() {
    for n in [1, 2, 3, 4] {
        let o = mpirun(n, env!("CARGO_BIN_EXE_kolo-mpi-conformance"), &[]);
        let text = format!("{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "{n} ranks: {text}");
        assert_eq!(text.matches("mpi conformance ok").count(), n, "{text}");
    }
}
