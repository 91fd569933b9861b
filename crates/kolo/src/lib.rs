//! Kolo as a library: distributed data-parallel training of your own candle model.
//!
//! ```no_run
//! use candle_nn::{Module, VarBuilder, VarMap};
//! # fn main() -> anyhow::Result<()> {
//! let dist = kolo::init()?; // from `kolo launch`, torchrun, Slurm or mpirun variables
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dist.device());
//! let model = candle_nn::linear(784, 10, vb.pp("fc"))?;
//! let mut trainer = kolo::Trainer::new(&varmap, &dist, kolo::TrainOptions::default())?;
//! let (x, y) = (candle_core::Tensor::zeros((8, 784), candle_core::DType::F32, &dist.device())?,
//!               candle_core::Tensor::zeros(8, candle_core::DType::U32, &dist.device())?);
//! let out = trainer.step(|| candle_nn::loss::cross_entropy(&model.forward(&x)?, &y))?;
//! println!("loss {}", dist.mean(out.loss as f64)?);
//! trainer.save("checkpoints")?;
//! # Ok(()) }
//! ```
//!
//! Cargo features (none by default: DDP and ZeRO-1/2/3 over TCP and shared memory): `hf`
//! (Hugging Face checkpoints and tokenizers, token shards), `ps`, `fed`, `rl`, `mpi`, `nccl`,
//! `cuda`. The `kolo` command is the `kolo-cli` package, a user of this library.
//!
//! Build it against Kolo's vendored candle (its `[patch.crates-io]` entries): the trainer
//! needs the gradient-ready hook of `vendor/candle-core`, and `vendor/candle-nn` makes the
//! fused softmax, layer norm, RMS norm and rotary kernels pass gradients.

#![warn(missing_docs)]

pub mod builtin;
pub mod data;
pub mod dist;
pub mod ep;
mod error;
#[cfg(feature = "hf")]
pub mod hf;
mod mesh;
pub mod options;
pub mod pp;
#[cfg(feature = "ps")]
mod ps_worker;
mod scheduled;
pub mod sp;
#[cfg(feature = "hf")]
pub mod tokens;
pub mod tp;
mod trainer;
pub mod zero3;

/// Federated averaging: rounds, secure aggregation, and the server and clients of `kolo fed`
/// (the `fed` feature).
#[cfg(feature = "fed")]
pub use kolo_fed as fed;
/// The parameter server: sharded servers, workers' push and pull, consistency models, Hogwild
/// (the `ps` feature).
#[cfg(feature = "ps")]
pub use kolo_ps as ps;
/// Reinforcement learning: environments, V-trace, IMPALA's actors and learner (the `rl`
/// feature).
#[cfg(feature = "rl")]
pub use kolo_rl as rl;

/// The candle this Kolo is built with (use it to avoid a second copy in your build).
pub use candle_core;
/// The candle-nn this Kolo is built with.
pub use candle_nn;
pub use dist::{init, init_with, Dist, InitOptions};
pub use error::{Error, Result};
/// A user's own optimizer ([`TrainOptions::update_rule`]).
pub use kolo_optim::UpdateRule;
/// Activation checkpointing of one block of your model (`torch.utils.checkpoint`): its
/// intermediate activations are dropped after the forward and recomputed in backward. Works
/// under every strategy the trainer runs (DDP, ZeRO-1/2/3, pipelines, tensor and sequence
/// parallelism): the block's variables are found by walking its graph and receive their
/// gradients as without it.
///
/// ```
/// use candle_nn::{linear, Module, VarBuilder, VarMap};
/// # fn main() -> candle_core::Result<()> {
/// let vm = VarMap::new();
/// let vb = VarBuilder::from_varmap(&vm, candle_core::DType::F32, &candle_core::Device::Cpu);
/// let (fc1, fc2) = (linear(16, 64, vb.pp("fc1"))?, linear(64, 16, vb.pp("fc2"))?);
/// let x = candle_core::Tensor::randn(0f32, 1.0, (4, 16), &candle_core::Device::Cpu)?;
/// // The block owns (clones of) its layers: candle-nn layers are cheap to clone.
/// let y = kolo::checkpoint(&x, move |x| x + fc2.forward(&fc1.forward(x)?.gelu()?)?)?;
/// let grads = y.sum_all()?.backward()?;
/// assert!(vm.all_vars().iter().all(|v| grads.get(v.as_tensor()).is_some()));
/// # Ok(()) }
/// ```
pub use kolo_tensor::checkpoint::checkpoint;
/// [`checkpoint`] of a block with several outputs, each of which may carry a gradient back (a
/// mixture-of-experts layer's output, gate probabilities and auxiliary loss).
pub use kolo_tensor::checkpoint::checkpoint_many;
/// An evaluation's result, as [`Trainer::log_eval`] logs it.
pub use kolo_train::summary::Eval;
pub use mesh::Mesh;
pub use options::{DataOptions, TrainOptions};
#[cfg(feature = "ps")]
pub use ps_worker::{PsJoin, PsWorker};
pub use trainer::{StepOutput, Trainer};

#[cfg(test)]
mod tests;
