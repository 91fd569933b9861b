//! Kolo's built-in backend: [`HostComm`] runs collectives between processes over TCP and, for
//! ranks on the same host, shared-memory rings.
//!
//! * `frame`: the checked 40-byte header in front of every message.
//! * `link`, `shm`: non-blocking byte pipes to one peer (TCP socket, shared-memory ring pair).
//! * `engine`: drives many transfers at once, reducing data as it arrives; deadlines everywhere.
//! * `algo`: ring, recursive doubling, binomial tree, pairwise all-to-all, dissemination barrier.
//! * `connect`: listens, authenticates and connects a group's full mesh through the store.
//! * [`bootstrap`]: from a [`LaunchEnv`](kolo_rendezvous::LaunchEnv) to a ready communicator.
//! * [`tuning`]: all-reduce crossovers measured on the machine, which `Auto` follows.

mod algo;
mod bootstrap;
mod comm;
mod connect;
pub mod copy;
mod engine;
pub mod frame;
mod link;
mod liveness;
pub mod recorder;
pub(crate) mod shm;
pub mod tuning;

pub use algo::Algorithm;
pub use bootstrap::{bootstrap, Bootstrapped};
pub use comm::{AlgorithmChoice, HostComm, HostCommConfig, Transport};
pub use connect::default_host_id;
pub use tuning::{LinkKind, TuneTable, Tuning};

#[cfg(test)]
mod tests;
