//! Communicator flags shared by the subcommands that join a job.

use kolo_base::ByteSize;
use kolo_collectives::{bootstrap, AlgorithmChoice, Bootstrapped, HostComm, HostCommConfig, Transport};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Which library carries the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// MPI when this kolo was built with it (`--features mpi`) and mpirun started it, else builtin.
    Auto,
    /// Kolo's own transport (TCP and shared memory).
    Builtin,
    /// The MPI library (needs a `--features mpi` build and an MPI launcher).
    Mpi,
    /// NVIDIA's NCCL on GPUs (needs a `--features nccl` build, a GPU per rank and libnccl at
    /// run time); the ranks meet over the built-in transport first to share NCCL's id.
    Nccl,
}

/// A joined job: the communicator, and the built-in transport's own handle when that is the backend.
pub struct Joined {
    pub comm: Arc<dyn kolo_comm::Communicator>,
    pub host: Option<Arc<HostComm>>,
}

#[derive(clap::Args, Clone, Debug)]
pub struct CommArgs {
    /// Communication backend: auto, builtin, mpi or nccl.
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: Backend,
    /// Links between ranks on one host: auto (shared memory), tcp, shm.
    #[arg(long, default_value = "auto")]
    pub transport: Transport,
    /// all_reduce algorithm: auto (by size, world and hosts), ring, doubling, halving
    /// (Rabenseifner), tree, hierarchical.
    #[arg(long = "algo", default_value = "auto")]
    pub algorithm: AlgorithmChoice,
    /// Deadline of every collective, in seconds [default: 300, or ddp.timeout_secs for train].
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Microseconds to busy-poll without progress before blocking.
    #[arg(long, default_value_t = 200)]
    pub spin_us: u64,
    /// Bytes per direction of each shared-memory ring.
    #[arg(long, default_value = "1MiB")]
    pub shm_ring: ByteSize,
    /// SO_SNDBUF/SO_RCVBUF of TCP links (0: kernel autotuning).
    #[arg(long, default_value = "0")]
    pub tcp_buffer: ByteSize,
}

impl CommArgs {
    pub fn config(&self) -> HostCommConfig {
        HostCommConfig {
            transport: self.transport,
            all_reduce: self.algorithm,
            timeout: Duration::from_secs_f64(self.timeout.unwrap_or(300.0).max(0.001)),
            spin: Duration::from_micros(self.spin_us),
            shm_ring: self.shm_ring,
            tcp_buffer: self.tcp_buffer,
            ..HostCommConfig::default()
        }
    }

    /// Joins the job on the chosen backend (see [`Backend`]).
    pub fn join_any(&self) -> anyhow::Result<Joined> {
        let mpi = match self.backend {
            Backend::Mpi => true,
            Backend::Builtin => false,
            Backend::Nccl => {
                let b = self.join()?;
                let comm = kolo_nccl::connect(&*b.comm, kolo_nccl::default_device(), self.config().timeout)?;
                return Ok(Joined { comm, host: None });
            }
            Backend::Auto => kolo_mpi::AVAILABLE && kolo_mpi::launched_by_mpi(),
        };
        if mpi {
            let comm = kolo_mpi::world(self.config().timeout)?;
            return Ok(Joined { comm, host: None });
        }
        let b = self.join()?;
        Ok(Joined { comm: b.comm.clone(), host: Some(b.comm) })
    }

    /// Joins the job this process was launched into (or runs alone). From then on `SIGUSR1`
    /// prints the communicator's flight recorder (its last collectives, the one in progress
    /// marked) to stderr, also while a collective hangs.
    pub fn join(&self) -> anyhow::Result<Bootstrapped> {
        let env = kolo_rendezvous::discover(std::env::vars()).map_err(|e| anyhow::anyhow!(e))?;
        let b = bootstrap(env.as_ref(), self.config())?;
        dump_on_sigusr1(Arc::downgrade(&b.comm));
        Ok(b)
    }
}

static DUMP_REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    DUMP_REQUESTED.store(true, Ordering::SeqCst);
}

/// Installs the `SIGUSR1` handler (it only sets a flag) and a thread that prints the flight
/// recorder when the flag is set; the thread ends with the communicator.
fn dump_on_sigusr1(comm: Weak<HostComm>) {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut());
    }
    let _ = std::thread::Builder::new().name("kolo-sigusr1".into()).spawn(move || loop {
        std::thread::sleep(Duration::from_millis(50));
        let Some(c) = comm.upgrade() else { return };
        if DUMP_REQUESTED.swap(false, Ordering::SeqCst) {
            eprint!("{}", c.flight_record());
        }
    });
}
