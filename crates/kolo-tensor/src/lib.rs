//! Kolo's model-math adapter over candle.
//!
//! Strategies see parameters and gradients as flat `f32` buffers (the layout of [`ParamSet`]);
//! candle stays behind this crate. Models fetch their parameters through a [`ParamView`], which
//! lets a strategy splice a gradient hook between each parameter and its uses: the hook's
//! backward runs as soon as that parameter's gradient is complete, which is how DDP starts
//! all-reducing a bucket while backward is still running (candle has no per-parameter hooks).
//!
//! Candle ops known to drop gradients (`candle_nn::LayerNorm`, `RmsNorm`, the fused softmax and
//! norm ops) are not used; [`ops`] builds norms and softmax from differentiable primitives, and
//! a test checks that every trainable variable of every model receives a gradient.

mod error;
pub mod fused;
pub mod models;
pub mod ops;
mod params;
pub mod stage;

pub use candle_core::{DType as CandleDType, Device, Tensor};
pub use error::TensorError;
pub use models::{build_model, Batch, Input, Model, ModelSpec};
pub use stage::GptStage;
pub use params::{copy_f32, CastView, GradSink, HookedView, Param, ParamSet, ParamView, PlainView};


pub type Result<T> = std::result::Result<T, TensorError>;

#[cfg(test)]
mod tests;
