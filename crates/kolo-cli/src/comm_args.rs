//! Communicator flags shared by the subcommands that join a job.

use kolo_base::ByteSize;
use kolo_collectives::{AlgorithmChoice, Bootstrapped, HostCommConfig, Transport, Tuning};
use std::sync::Arc;
use std::time::Duration;

/// A tuning file read when the flags are parsed (so a bad file fails before joining the job).
#[derive(Clone, Debug)]
pub struct TuningFile(pub Arc<Tuning>);

fn tuning_file(path: &str) -> Result<TuningFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    Ok(TuningFile(Arc::new(Tuning::parse(&text, path)?)))
}

pub use kolo::dist::Backend;

#[derive(clap::Args, Clone, Debug)]
pub struct CommArgs {
    /// Communication backend: auto, builtin, mpi or nccl.
    #[arg(long, default_value = "auto")]
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
    /// Seconds a peer's heartbeats may stop before a collective stalled on it fails, naming it
    /// (stopped process, dead host, cut network); 0 turns heartbeats off [default: 10, or
    /// ddp.liveness_secs for train].
    #[arg(long)]
    pub liveness: Option<f64>,
    /// Microseconds to busy-poll without progress before blocking.
    #[arg(long, default_value_t = 200)]
    pub spin_us: u64,
    /// Bytes per direction of each shared-memory ring.
    #[arg(long, default_value = "1MiB")]
    pub shm_ring: ByteSize,
    /// SO_SNDBUF/SO_RCVBUF of TCP links (0: kernel autotuning).
    #[arg(long, default_value = "0")]
    pub tcp_buffer: ByteSize,
    /// A ring step over TCP sends at most this many bytes ahead of what it has received, so
    /// the data in flight stays in cache (0: unpaced).
    #[arg(long, default_value = "128KiB")]
    pub tcp_pace: ByteSize,
    /// A large ring all-reduce runs in pieces of (ranks x this) bytes, each finished while it
    /// is still in cache (0: the whole buffer at once).
    #[arg(long, default_value = "512KiB")]
    pub ring_piece: ByteSize,
    /// All-reduce crossovers measured on this machine (`kolo bench collectives --tune FILE`):
    /// with --algo auto, a table for the job's world size and links picks the algorithm by
    /// size; the built-in thresholds otherwise. Every rank must read the same file.
    #[arg(long, value_name = "FILE", value_parser = tuning_file)]
    pub tuning: Option<TuningFile>,
}

impl CommArgs {
    pub fn config(&self) -> HostCommConfig {
        HostCommConfig {
            transport: self.transport,
            all_reduce: self.algorithm,
            timeout: kolo::dist::timeout_of(self.timeout.unwrap_or(300.0)),
            spin: Duration::from_micros(self.spin_us),
            liveness: kolo::dist::seconds(self.liveness.unwrap_or(10.0)),
            shm_ring: self.shm_ring,
            tcp_buffer: self.tcp_buffer,
            tcp_pace: self.tcp_pace,
            ring_piece: self.ring_piece,
            tuning: self.tuning.as_ref().map(|t| t.0.clone()),
            ..HostCommConfig::default()
        }
    }

    /// Joins the job on the chosen backend (see [`Backend`]).
    pub fn join_any(&self) -> anyhow::Result<kolo::Dist> {
        Ok(kolo::init_with(&kolo::InitOptions { backend: self.backend, comm: self.config() })?)
    }

    /// Joins the job this process was launched into (or runs alone) over the built-in transport.
    pub fn join(&self) -> anyhow::Result<Bootstrapped> {
        Ok(kolo::dist::join_builtin(self.config())?)
    }
}
