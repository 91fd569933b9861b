//! Datasets and the distributed sampler, for user training loops.

pub use kolo_train::data::{Dataset, Mnist};
pub use kolo_train::sampler::{Position, Sampler, SamplerConfig};

/// The MNIST examples at `idx` as tensors on `device`: images (n, 784) f32 (normalised pixels)
/// and labels (n) u32.
pub fn mnist_tensors(
    data: &Mnist,
    idx: &[usize],
    device: &candle_core::Device,
) -> candle_core::Result<(candle_core::Tensor, candle_core::Tensor)> {
    let x: Vec<f32> = idx.iter().flat_map(|&i| data.image(i).iter().copied()).collect();
    let y: Vec<u32> = idx.iter().map(|&i| u32::from(data.labels()[i])).collect();
    Ok((candle_core::Tensor::from_vec(x, (idx.len(), 784), device)?, candle_core::Tensor::from_vec(y, idx.len(), device)?))
}
