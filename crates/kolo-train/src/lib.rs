//! Kolo's training: [`run::run`] picks the strategy a config names and hands it to the one
//! training loop, [`driver`]; each strategy (the pipelines, and the data-parallel one that
//! `run` is given, tensor, sequence and expert parallelism included: the `kolo` library's
//! `Trainer`, `kolo::builtin`) implements [`driver::Strategy`].

pub mod agreement;
pub mod autoplan;
pub mod cadence;
pub mod checkpointing;
pub mod config;
pub mod data;
pub mod driver;
pub mod eval;
pub mod local_sgd;
pub mod sampler;
pub mod update;
pub mod zero3;

pub use config::Config;

/// A parameter-server worker's push statistics (its run's [`Summary::ps`]); nothing can be
/// one in a build without the `ps` feature.
#[cfg(feature = "ps")]
pub use kolo_ps::PushStats;
/// A parameter-server worker's push statistics: none in a build without the `ps` feature.
#[cfg(not(feature = "ps"))]
pub type PushStats = std::convert::Infallible;
pub mod metrics;
pub mod param_groups;
pub mod pipeline;
#[cfg(feature = "ps")]
pub mod ps_worker;
pub mod report;
pub mod run;
pub mod scheduled_ddp;
pub mod setup;
pub mod summary;
pub mod tensorboard;
pub mod timeline;
pub use run::run;
pub use summary::{peak_rss, Eval, HeapReport, RunOptions, StateBytes, Summary};

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("config error: {0}")]
    Config(String),
    #[error("data error: {0}")]
    Data(String),
    #[error(transparent)]
    Tensor(#[from] kolo_tensor::TensorError),
    #[error(transparent)]
    Ddp(#[from] kolo_ddp::DdpError),
    #[error(transparent)]
    Comm(#[from] kolo_comm::CommError),
    #[error(transparent)]
    Checkpoint(#[from] kolo_checkpoint::CheckpointError),
    #[cfg(feature = "ps")]
    #[error(transparent)]
    Ps(#[from] kolo_ps::PsError),
    #[error("{0}")]
    Other(String),
}
