//! Kolo's MPI backend (feature `mpi`): the `Communicator` API implemented on the MPI library
//! (Open MPI through the `mpi` crate), so that `mpirun -n N kolo train ...` runs Kolo's
//! strategies over MPI's collectives. Without the feature this crate builds to a backend that
//! refuses with the instructions to enable it: a Kolo binary never needs MPI to start.
//!
//! Data-moving operations (broadcast, all-gather, all-to-all, point to point) move bytes;
//! reductions use MPI's typed reductions (f16 and bf16 through f32). `reduce_scatter` is an
//! all-reduce followed by taking this rank's shard. MPI cannot cancel a blocked call, so the
//! deadline of every operation is kept by a watchdog that, once it passes, prints which
//! operation of which rank waited and aborts the job (`MPI_Abort`): never a silent hang.

use kolo_comm::{CommError, Communicator};
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "mpi")]
mod imp;

/// Whether this build has the MPI backend.
pub const AVAILABLE: bool = cfg!(feature = "mpi");

/// Whether an MPI launcher (mpirun, or srun with PMI) started this process.
pub fn launched_by_mpi() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"].iter().any(|k| std::env::var_os(k).is_some())
}

/// Initialises MPI (once per process, with full thread support) and returns the world
/// communicator with the given deadline per operation. MPI is finalised when the process exits.
pub fn world(timeout: Duration) -> Result<Arc<dyn Communicator>, CommError> {
    #[cfg(feature = "mpi")]
    {
        imp::world(timeout)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = timeout;
        Err(CommError::Setup {
            op: kolo_comm::OpKind::Setup,
            rank: kolo_base::Rank(0),
            what: "this kolo was built without the MPI backend: rebuild with `cargo build --release -p kolo-cli --features mpi` (needs libopenmpi-dev and libclang-dev), or use the built-in transport".into(),
        })
    }
}
