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

pub mod checkpoint;
pub mod dense;
mod error;
pub mod fused;
pub mod models;
pub mod ops;
mod params;

pub use candle_core::{DType as CandleDType, Device, Tensor};
pub use error::TensorError;
pub use models::{build_model, Batch, Input, Model, ModelSpec};
pub use params::{copy_f32, edit_f32, view_for, with_f32, CastView, GradSink, HookedView, Param, ParamSet, ParamView, PlainView};

pub type Result<T> = std::result::Result<T, TensorError>;

static DEVICE: std::sync::RwLock<Option<Device>> = std::sync::RwLock::new(None);

/// The device new parameters and model inputs are placed on: the CPU unless [`set_device`]
/// chose another (a process trains on one device; gradients and optimizer state still meet
/// Kolo's communication and optimizers as flat host buffers).
pub fn device() -> Device {
    DEVICE.read().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or(Device::Cpu)
}

/// Threads the CPU matrix products and element-wise ops use (`RAYON_NUM_THREADS`, else the
/// cores this process may run on).
pub fn compute_threads() -> usize {
    candle_core::utils::get_num_threads()
}

/// Places models built from now on on `d`.
pub fn set_device(d: Device) {
    *DEVICE.write().unwrap_or_else(|p| p.into_inner()) = Some(d);
}

/// The device named `cpu`, `cuda` or `cuda:N` (candle's CUDA backend: a `--features cuda`
/// build, which needs the CUDA toolkit to compile).
pub fn parse_device(name: &str) -> Result<Device> {
    let ordinal = match name {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        n => match n.strip_prefix("cuda:").and_then(|o| o.parse::<usize>().ok()) {
            Some(o) => o,
            None => return Err(TensorError::Input(format!("device `{name}`: expected cpu, cuda or cuda:N"))),
        },
    };
    if !cfg!(feature = "cuda") {
        return Err(TensorError::Input(format!(
            "device `{name}`: this kolo was built without CUDA (rebuild with `--features cuda`: needs the CUDA toolkit's nvcc)"
        )));
    }
    Device::new_cuda(ordinal).map_err(|e| TensorError::Input(format!("device `{name}`: {e}")))
}

/// Chooses the device this process trains on, by name as `[train] device` spells it, and
/// returns it: `cpu`, `cuda:N`, or `cuda` alone for GPU `local_rank` (one GPU per rank of a
/// node, torchrun's `LOCAL_RANK` convention). Models built from now on are placed on it.
pub fn select_device(name: &str, local_rank: usize) -> Result<Device> {
    let name = if name == "cuda" { format!("cuda:{local_rank}") } else { name.to_string() };
    let dev = parse_device(&name)?;
    set_device(dev.clone());
    Ok(dev)
}

#[cfg(test)]
mod tests;
