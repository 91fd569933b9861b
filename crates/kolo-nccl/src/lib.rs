//! Kolo's NCCL backend (feature `nccl`): the `Communicator` API implemented on NVIDIA's NCCL,
//! and the same collectives on GPU buffers (`NcclComm::all_reduce_device`, ...), so that
//! Kolo's strategies run over NCCL unchanged and GPU training moves gradients without the host.
//!
//! Everything CUDA is loaded at run time (cudarc's dynamic loading of `libcuda` and
//! `libnccl`): the crate builds, and a Kolo binary starts, without the CUDA toolkit; a machine
//! without a GPU or without NCCL gets a clear error from [`connect`], never a crash.
//!
//! Setup follows torch.distributed's NCCL process group: the ranks already share a bootstrap
//! communicator (Kolo's TCP transport, which checked the job's token); rank 0 creates the NCCL
//! unique id and broadcasts it over that, then every rank calls `ncclCommInitRank` on its GPU.
//! NCCL calls only enqueue work on a CUDA stream; like torch's watchdog, Kolo then polls the
//! stream and NCCL's asynchronous error until the operation's deadline, and past it aborts the
//! communicator (`ncclCommAbort`) and returns an error naming the rank and the operation.

use kolo_base::Rank;
use kolo_comm::{CommError, Communicator, OpKind};
use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "nccl")]
mod imp;
/// cudarc, as this crate sees it (device buffers and streams for the `*_device` collectives).
#[cfg(feature = "nccl")]
pub use cudarc;
#[cfg(feature = "nccl")]
pub use imp::{cuda_device_count, nccl_version, NcclComm, NcclElem};

/// Whether this build has the NCCL backend.
pub const AVAILABLE: bool = cfg!(feature = "nccl");

/// The GPU a rank uses when none is named: `KOLO_CUDA_DEVICE`, else `LOCAL_RANK` (set by `kolo
/// launch` and torchrun), else 0 — taken modulo the number of GPUs by [`connect`].
pub fn default_device() -> usize {
    ["KOLO_CUDA_DEVICE", "LOCAL_RANK"].iter().find_map(|k| std::env::var(k).ok()?.parse().ok()).unwrap_or(0)
}

/// Makes an NCCL communicator over the same ranks as `boot` (collective over `boot`): rank 0
/// creates the unique id and broadcasts it; every rank initialises on GPU `device` (modulo the
/// GPUs this process sees). Every operation of the result has `timeout` as its deadline.
pub fn connect(boot: &dyn Communicator, device: usize, timeout: Duration) -> Result<Arc<dyn Communicator>, CommError> {
    #[cfg(feature = "nccl")]
    {
        Ok(imp::NcclComm::connect(boot, device, timeout)?)
    }
    #[cfg(not(feature = "nccl"))]
    {
        let _ = (device, timeout);
        Err(setup_error(
            boot.rank(),
            "this kolo was built without the NCCL backend: rebuild with `cargo build --release -p kolo-cli --features nccl` (no CUDA toolkit needed to build; a GPU, its driver and libnccl.so.2 to run), or use the built-in transport".into(),
        ))
    }
}

/// The error every failure to set NCCL up becomes.
pub(crate) fn setup_error(rank: Rank, what: String) -> CommError {
    CommError::Setup { op: OpKind::Setup, rank, what }
}
