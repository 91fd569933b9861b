//! Kolo's training loop: one readable function ([`trainer::run`]) that wires the config, the
//! data, the model adapter, DDP, the optimizer and checkpoints together.

pub mod agreement;
pub mod autoplan;
pub mod checkpointing;
pub mod config;
pub mod data;
pub mod ep;
pub mod fed;
pub mod impala;
pub mod local_sgd;
pub mod sampler;
pub mod trainer;
pub mod update;

pub use config::Config;
pub mod metrics;
pub mod pipeline;
pub mod plot;
pub mod ps_worker;
pub mod report;
pub mod scheduled_ddp;
pub mod sp;
pub mod tensorboard;
pub mod timeline;
pub use trainer::{peak_rss, run, Eval, HeapReport, RunOptions, StateBytes, Summary};

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
    #[error(transparent)]
    Ps(#[from] kolo_ps::PsError),
    #[error("{0}")]
    Other(String),
}
