//! Kolo's parameter server (Li et al., OSDI 2014; Dean et al., NIPS 2012), tensor-free like the
//! other strategies: it serves one table of `f32` values, keyed by their offset in the flat
//! parameter layout, cut into fixed-size key ranges.
//!
//! - [`server`]: `kolo ps serve`. Each range lives on a chain of servers picked on a
//!   consistent-hashing [`Ring`]; pushes go to the chain's head, are applied (server-side SGD,
//!   Adagrad or Adam) and forwarded down the chain, and are acknowledged only once the tail has
//!   them. Pulls wait as the job's [`Consistency`] demands, by the range's vector clock.
//! - [`coord`]: the coordinator. Servers register and heartbeat; a server that misses its
//!   deadline is dropped from the membership (a new epoch) and its ranges fail over to their
//!   replicas; a new server joins the same way and ranges move to it.
//! - [`client`]: a worker's view: range push and pull over the whole table, key caching,
//!   [`filter`]s, retries across epochs.
//! - [`hogwild`] and [`lbfgs`]: lock-free shared-memory SGD and Sandblaster L-BFGS.

pub mod client;
pub mod codec;
pub mod coord;
pub mod filter;
pub mod hogwild;
pub mod lbfgs;
pub mod net;
pub mod server;
pub mod wire;

pub use client::{PsClient, PushStats};
pub use coord::Coordinator;
pub use filter::{Filter, SignificantlyModified};
pub use server::Server;

use kolo_optim::OptimizerSpec;
use std::ops::Range;

#[derive(Debug, thiserror::Error)]
pub enum PsError {
    #[error("parameter server protocol error: {0}")]
    Protocol(String),
    #[error("{0}")]
    Io(String),
    #[error("{what}: no answer within {secs:.1} s ({detail})")]
    Timeout { what: String, secs: f64, detail: String },
    #[error("parameter server: {0}")]
    Server(String),
    #[error("parameter server job: {0}")]
    Config(String),
}

impl From<kolo_rendezvous::StoreError> for PsError {
    fn from(e: kolo_rendezvous::StoreError) -> PsError {
        PsError::Io(e.to_string())
    }
}

/// When a worker may read parameters (the consistency models of Li et al.).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consistency {
    /// Sequential / bulk synchronous: the pushes of all workers for step t are aggregated
    /// (mean, summed in worker order) and applied once before anyone pulls for step t+1.
    /// Same result as synchronous DDP.
    Bsp,
    /// Bounded delay (stale-synchronous): every push is applied on arrival; a worker about to
    /// compute step t waits until the slowest worker has pushed step t - τ.
    Bounded(u64),
    /// Eventual (Downpour SGD): pushes applied on arrival, pulls never wait.
    Async,
}

impl Consistency {
    /// The slowest worker's clock a pull for `clock` needs, if it must wait at all.
    pub fn needs(self, clock: u64) -> Option<u64> {
        match self {
            Consistency::Bsp => Some(clock),
            Consistency::Bounded(t) => Some(clock.saturating_sub(t)),
            Consistency::Async => None,
        }
    }
}

/// What every server of a job must agree on; set by the first `Init` and checked on every later one.
#[derive(Clone, Debug, PartialEq)]
pub struct JobSpec {
    /// Values in the table (the model's parameter count).
    pub len: u64,
    /// Values per key range.
    pub chunk: u32,
    /// Logical workers (data shards); vector clocks have one entry per worker.
    pub workers: u32,
    /// Copies of each range beyond the head of its chain.
    pub replication: u32,
    /// BSP with backup workers: a step is applied once all but this many workers pushed it
    /// (the mean of those gradients); the late pushes of that step are dropped and counted.
    pub backup: u32,
    pub consistency: Consistency,
    pub optimizer: OptimizerSpec,
}

impl JobSpec {
    pub fn validate(&self) -> Result<(), PsError> {
        if self.chunk == 0 {
            return Err(PsError::Config("chunk must be at least 1".into()));
        }
        if matches!(self.optimizer, kolo_optim::OptimizerSpec::Custom { .. }) {
            return Err(PsError::Config(format!(
                "the optimizer {:?} is a user's update rule: parameter servers run only Kolo's optimizers (sgd, adam, adamw, adagrad)",
                self.optimizer
            )));
        }
        if self.workers == 0 || self.workers > 65_536 {
            return Err(PsError::Config(format!("{} workers (1..=65536)", self.workers)));
        }
        if self.len > (u32::MAX as u64) * self.chunk as u64 {
            return Err(PsError::Config(format!("{} values need more than 2^32 ranges of {}", self.len, self.chunk)));
        }
        if self.backup >= self.workers {
            return Err(PsError::Config(format!(
                "{} backup workers of {} (a step needs at least one gradient)",
                self.backup, self.workers
            )));
        }
        if self.replication > 16 {
            return Err(PsError::Config(format!("replication {} (at most 16)", self.replication)));
        }
        Ok(())
    }

    /// Number of key ranges.
    pub fn ranges(&self) -> u32 {
        self.len.div_ceil(self.chunk as u64) as u32
    }

    /// Offsets of range `r` in the table.
    pub fn span(&self, r: u32) -> Range<usize> {
        let start = r as u64 * self.chunk as u64;
        start as usize..(start + self.chunk as u64).min(self.len) as usize
    }
}

/// Consistent hashing: each server owns `VNODES` points on a 64-bit ring; a range belongs to
/// the first server clockwise from its hash, and its replicas to the next distinct ones.
/// Adding or removing a server moves only the ranges next to its points.
#[derive(Clone, Debug)]
pub struct Ring {
    points: Vec<(u64, u32)>,
    servers: usize,
}

const VNODES: u64 = 64;

/// splitmix64: the same hash in every process (std's hasher is randomly seeded).
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Ring {
    pub fn new(servers: &[u32]) -> Ring {
        let mut points: Vec<(u64, u32)> = servers.iter().flat_map(|&s| (0..VNODES).map(move |v| (mix(mix(s as u64 + 1) ^ v), s))).collect();
        points.sort_unstable();
        let mut ids = servers.to_vec();
        ids.sort_unstable();
        ids.dedup();
        Ring { points, servers: ids.len() }
    }

    /// The chain of range `range`: head first, then up to `replicas` distinct successors.
    pub fn chain(&self, range: u32, replicas: u32) -> Vec<u32> {
        let want = (replicas as usize + 1).min(self.servers);
        let mut out = Vec::with_capacity(want);
        if want == 0 {
            return out;
        }
        let h = mix(0x5eed_0000_0000_0000 ^ range as u64);
        let start = self.points.partition_point(|&(p, _)| p < h);
        for i in 0..self.points.len() {
            let s = self.points[(start + i) % self.points.len()].1;
            if !out.contains(&s) {
                out.push(s);
                if out.len() == want {
                    break;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
