//! Joining a job: the communicator of this process, from the environment that `kolo launch`,
//! torchrun, Slurm or mpirun set (or a world of one when nothing is set).

use crate::{Error, Result};
use kolo_collectives::{bootstrap, Bootstrapped, HostComm, HostCommConfig};
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Which library carries the collectives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// MPI when this kolo was built with it (`--features mpi`) and mpirun started it, else builtin.
    #[default]
    Auto,
    /// Kolo's own transport (TCP and shared memory).
    Builtin,
    /// The MPI library (needs a `--features mpi` build and an MPI launcher).
    Mpi,
    /// NVIDIA's NCCL on GPUs (needs a `--features nccl` build, a GPU per rank and libnccl at
    /// run time); the ranks meet over the built-in transport first to share NCCL's id.
    Nccl,
}

impl std::str::FromStr for Backend {
    type Err = String;
    /// `auto`, `builtin`, `mpi` or `nccl`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Backend::Auto),
            "builtin" => Ok(Backend::Builtin),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            _ => Err(format!("unknown backend `{s}`: expected auto, builtin, mpi or nccl")),
        }
    }
}

/// How [`init_with`] joins the job.
#[derive(Clone, Debug, Default)]
pub struct InitOptions {
    /// The library that carries the collectives.
    pub backend: Backend,
    /// The built-in transport's settings (deadline of every collective, links, algorithms).
    pub comm: HostCommConfig,
}

/// This process's place in the job and its communicator (torch's process group).
#[derive(Clone)]
pub struct Dist {
    comm: Arc<dyn Communicator>,
    host: Option<Arc<HostComm>>,
    local_rank: usize,
    local_world_size: usize,
    /// How many times an elastic launcher restarted the job.
    restart_count: usize,
    /// The deadline of every collective and the heartbeat liveness the communicator was
    /// started with (`None`: made elsewhere, as the crate's in-process test groups).
    pub(crate) deadlines: Option<Deadlines>,
}

/// A communicator's deadlines: every collective's timeout, and how long a peer's heartbeats
/// may stop before a collective stalled on it fails (`ddp.timeout_secs`, `ddp.liveness_secs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Deadlines {
    pub timeout: Duration,
    pub liveness: Duration,
}

impl Deadlines {
    fn of(c: &HostCommConfig) -> Deadlines {
        Deadlines { timeout: c.timeout, liveness: c.liveness }
    }
}

/// Seconds from a setting or flag as a duration: negative or NaN is 0, beyond 10^6 s (infinity
/// too) is 10^6 s, so no value panics. A collective's deadline is at least 1 ms.
pub fn seconds(v: f64) -> Duration {
    Duration::from_secs_f64(if v >= 0.0 { v.min(1e6) } else { 0.0 })
}

/// The deadline of every collective from `ddp.timeout_secs` (or `--timeout`).
pub fn timeout_of(secs: f64) -> Duration {
    seconds(secs).max(Duration::from_millis(1))
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dist {{ rank: {}, world_size: {}, local_rank: {} }}", self.rank(), self.world_size(), self.local_rank)
    }
}

impl Dist {
    /// A rank of the job on `comm`, a communicator made elsewhere (`kolo train`'s; threads as
    /// ranks in the crate's tests): no host transport of its own, no deadlines to check.
    pub(crate) fn of_comm(comm: Arc<dyn Communicator>) -> Dist {
        let (local_rank, local_world_size) = (comm.rank().get(), comm.world_size().get());
        Dist { comm, host: None, local_rank, local_world_size, restart_count: 0, deadlines: None }
    }
}

impl Dist {
    /// How many times an elastic launcher has restarted the job (`kolo launch --min-nodes`, or
    /// torchrun's): 0 at the first start. A restarted job continues from its checkpoints
    /// ([`crate::Trainer::resume_newest`]), as `kolo train` does.
    pub fn restart_count(&self) -> usize {
        self.restart_count
    }

    /// This process's rank, 0-based.
    pub fn rank(&self) -> usize {
        self.comm.rank().get()
    }
    /// Processes in the job.
    pub fn world_size(&self) -> usize {
        self.comm.world_size().get()
    }
    /// Rank among the processes on this host.
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }
    /// Processes on this host.
    pub fn local_world_size(&self) -> usize {
        self.local_world_size
    }
    /// Whether this is rank 0 (the one that logs and writes single-writer files).
    pub fn is_main(&self) -> bool {
        self.rank() == 0
    }
    /// The communicator, for collectives of the user's own (`kolo_comm::Communicator`).
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
    /// The built-in transport's handle when that is the backend (its flight recorder).
    pub fn host(&self) -> Option<&Arc<HostComm>> {
        self.host.as_ref()
    }
    /// The device this process trains on: the CPU, unless [`Dist::use_device`] chose another.
    pub fn device(&self) -> candle_core::Device {
        kolo_tensor::device()
    }
    /// Chooses the device this process trains on (torch's `torch.cuda.set_device`), named as
    /// `[train] device` names it: `cpu`, `cuda:N`, or `cuda` for the GPU of this rank's
    /// [`Dist::local_rank`]. Build the model with the device it returns (or [`Dist::device`]
    /// from then on) and set the same name in `TrainOptions::device`. A GPU needs a build with
    /// the `cuda` feature; the model's parameters, its forward and backward stay on the GPU,
    /// and each gradient comes to the host for the collectives and the optimizer, as in `kolo
    /// train --device cuda`.
    pub fn use_device(&self, name: &str) -> Result<candle_core::Device> {
        kolo_tensor::select_device(name, self.local_rank).map_err(|e| Error::usage(self.rank(), "Dist::use_device", e.to_string()))
    }
    /// Collective: waits until every rank has called it.
    pub fn barrier(&self) -> Result<(), kolo_comm::CommError> {
        self.comm.barrier()
    }
    /// Collective: the mean of `v` over the ranks (a loss for logging).
    pub fn mean(&self, v: f64) -> Result<f64, kolo_comm::CommError> {
        let mut b = [v];
        self.sum(&mut b)?;
        Ok(b[0] / self.world_size() as f64)
    }

    /// Collective: `values` summed element-wise over the ranks, in place (an evaluation's
    /// loss sum, right answers and example count).
    pub fn sum(&self, values: &mut [f64]) -> Result<(), kolo_comm::CommError> {
        self.comm.all_reduce(BufMut::from(values), ReduceOp::Sum)
    }

    /// Collective: every rank's `t` concatenated along the first dimension in rank order (as
    /// torch's `all_gather` followed by `cat`, or accelerate's `gather_for_metrics` without its
    /// de-duplication): predictions and labels of an evaluation split over the ranks. Ranks may
    /// hold different numbers of rows (a last, shorter batch); the other dimensions and the
    /// dtype must agree. A scalar counts as one row. The result is on `t`'s device.
    pub fn all_gather(&self, t: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let t = if t.rank() == 0 { t.reshape(1)? } else { t.clone() };
        let (rows, rest) = (t.dim(0)?, t.dims()[1..].to_vec());
        let (bytes, row_bytes) =
            (tensor_bytes(&t.flatten_all()?, self.rank())?, t.dtype().size_in_bytes() * rest.iter().product::<usize>());
        // Every rank's row count, dtype and row shape first: a mismatch fails every rank alike.
        let (n, rank) = (self.world_size(), self.rank());
        let mine = [rows as i64, dtype_code(t.dtype()), shape_code(&rest)];
        let mut all = vec![0i64; 3 * n];
        self.comm.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut all[..]))?;
        for (r, d) in all.chunks(3).enumerate() {
            if d[1] != mine[1] || d[2] != mine[2] {
                return Err(Error::usage(
                    rank,
                    "Dist::all_gather",
                    format!("a {:?} tensor with rows of shape {rest:?}, but rank {r} holds another dtype or row shape", t.dtype()),
                ));
            }
        }
        let max = all.chunks(3).map(|d| d[0] as usize).max().unwrap_or(0);
        let mut padded = bytes;
        padded.resize(max * row_bytes, 0);
        let mut out = vec![0u8; n * max * row_bytes];
        self.comm.all_gather(BufRef::from(&padded[..]), BufMut::from(&mut out[..]))?;
        let mut joined = Vec::with_capacity(out.len());
        for (r, d) in all.chunks(3).enumerate() {
            let at = r * max * row_bytes;
            joined.extend_from_slice(&out[at..at + d[0] as usize * row_bytes]);
        }
        let total: usize = all.chunks(3).map(|d| d[0] as usize).sum();
        let mut shape = vec![total];
        shape.extend(rest);
        Ok(candle_core::Tensor::from_raw_buffer(&joined, t.dtype(), &shape, t.device())?)
    }
}

/// Joins the job this process was started in, as [`init_with`] with the defaults: MPI when
/// mpirun started it and this kolo has MPI, else the built-in transport; a 300 s deadline on
/// every collective.
pub fn init() -> Result<Dist> {
    init_with(&InitOptions::default())
}

/// Joins the job on the chosen backend. Without launcher variables the process is a world of
/// one. From then on `SIGUSR1` prints the built-in communicator's flight recorder (its last
/// collectives, the one in progress marked) to stderr, also while a collective hangs.
pub fn init_with(o: &InitOptions) -> Result<Dist> {
    let timeout = o.comm.timeout;
    let deadlines = Some(Deadlines::of(&o.comm));
    let env = kolo_rendezvous::discover(std::env::vars()).map_err(|e| Error::Join(e.to_string()))?;
    let restart_count = env.as_ref().map_or(0, |e| e.restart_count);
    let mpi = match o.backend {
        Backend::Mpi => true,
        Backend::Builtin => false,
        Backend::Nccl => {
            let b = join_builtin(o.comm.clone())?;
            let comm = kolo_nccl::connect(&*b.comm, kolo_nccl::default_device(), timeout)?;
            return Ok(Dist { comm, host: None, local_rank: b.local_rank, local_world_size: b.local_world_size, restart_count, deadlines });
        }
        Backend::Auto => kolo_mpi::AVAILABLE && kolo_mpi::launched_by_mpi(),
    };
    if mpi {
        let comm = kolo_mpi::world(timeout)?;
        let (local_rank, local_world_size) = env.map_or((0, 1), |e| (e.local_rank, e.local_world_size));
        return Ok(Dist { comm, host: None, local_rank, local_world_size, restart_count, deadlines });
    }
    let b = join_builtin(o.comm.clone())?;
    let (comm, host) = (b.comm.clone(), Some(b.comm));
    Ok(Dist { comm, host, local_rank: b.local_rank, local_world_size: b.local_world_size, restart_count, deadlines })
}

/// Joins over the built-in transport.
pub fn join_builtin(cfg: HostCommConfig) -> Result<Bootstrapped> {
    let env = kolo_rendezvous::discover(std::env::vars()).map_err(|e| Error::Join(e.to_string()))?;
    let b = bootstrap(env.as_ref(), cfg)?;
    dump_on_sigusr1(Arc::downgrade(&b.comm));
    Ok(b)
}

static DUMP_REQUESTED: AtomicBool = AtomicBool::new(false);
static DUMP_INSTALLED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    DUMP_REQUESTED.store(true, Ordering::SeqCst);
}

/// Installs the `SIGUSR1` handler (it only sets a flag) and a thread that prints the flight
/// recorder when the flag is set; the thread ends with the communicator.
fn dump_on_sigusr1(comm: Weak<HostComm>) {
    if DUMP_INSTALLED.swap(true, Ordering::SeqCst) {
        return;
    }
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
    let _ = std::thread::Builder::new().name("kolo-sigusr1".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(c) = comm.upgrade() else {
            DUMP_INSTALLED.store(false, Ordering::SeqCst);
            return;
        };
        if DUMP_REQUESTED.swap(false, Ordering::SeqCst) {
            eprint!("{}", c.flight_record());
        }
    });
}

/// A contiguous CPU copy of `t`'s values as bytes (little-endian, as candle stores them).
fn tensor_bytes(t: &candle_core::Tensor, rank: usize) -> Result<Vec<u8>> {
    use candle_core::DType;
    let t = t.to_device(&candle_core::Device::Cpu)?;
    fn le<T: Copy>(v: Vec<T>, f: impl Fn(T) -> Vec<u8>) -> Vec<u8> {
        v.into_iter().flat_map(f).collect()
    }
    Ok(match t.dtype() {
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => le(t.to_vec1::<u32>()?, |x| x.to_le_bytes().to_vec()),
        DType::I64 => le(t.to_vec1::<i64>()?, |x| x.to_le_bytes().to_vec()),
        DType::F32 => le(t.to_vec1::<f32>()?, |x| x.to_le_bytes().to_vec()),
        DType::F64 => le(t.to_vec1::<f64>()?, |x| x.to_le_bytes().to_vec()),
        DType::BF16 => le(t.to_vec1::<half::bf16>()?, |x| x.to_le_bytes().to_vec()),
        DType::F16 => le(t.to_vec1::<half::f16>()?, |x| x.to_le_bytes().to_vec()),
        d => {
            let reason = format!("tensors of {d:?} are not supported (u8, u32, i64, f16, bf16, f32, f64)");
            return Err(Error::usage(rank, "Dist::all_gather", reason));
        }
    })
}

/// A number for each dtype (compared across ranks).
fn dtype_code(d: candle_core::DType) -> i64 {
    d.as_str().bytes().fold(0i64, |h, b| h.wrapping_mul(131).wrapping_add(i64::from(b)))
}

/// A number for a row shape (compared across ranks).
fn shape_code(dims: &[usize]) -> i64 {
    dims.iter().fold(dims.len() as i64, |h, &d| h.wrapping_mul(1_000_003).wrapping_add(d as i64))
}
