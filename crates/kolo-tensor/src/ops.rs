//! Differentiable building blocks made only of candle primitives that propagate gradients.

use crate::Result;
use candle_core::{DType, Device, Tensor, D};

/// `x @ w^T + b` for `x` of shape (..., in), `w` (out, in), `b` (out).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    if [x, w, b].iter().all(|t| crate::dense::applies(t)) {
        return Ok(crate::dense::linear(x, w, b)?);
    }
    linear_composite(x, w, b)
}

/// [`linear`] from candle primitives: the reference the fused one is tested against, and the
/// formulation on other devices and dtypes.
pub fn linear_composite(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(crate::fused::bias_add(&times_transposed(x, w)?, b)?)
}

/// `x` (`(.., k)`) times `w` transposed (`w`: `(n, k)`) as one matrix product over all of `x`'s
/// rows: `(.., n)`. A linear layer without its bias.
pub fn times_transposed(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let k = *dims.last().ok_or_else(|| candle_core::Error::Msg("a linear layer's input has no dimensions".into()))?;
    let rows = dims[..dims.len() - 1].iter().product::<usize>();
    let y = x.reshape((rows, k))?.matmul(&w.t()?)?;
    let mut out = dims;
    *out.last_mut().expect("not empty") = w.dim(0)?;
    y.reshape(out)
}

/// Layer norm over the last dimension (fused forward and backward; candle's own drops gradients).
pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(crate::fused::layer_norm(x, gamma, beta, eps)?)
}

/// Layer norm from candle primitives: the reference the fused one is tested against.
pub fn layer_norm_composite(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xhat = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(xhat.broadcast_mul(gamma)?.broadcast_add(beta)?)
}

/// Softmax over the last dimension, from primitives.
pub fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    let s = e.sum_keepdim(D::Minus1)?;
    Ok(e.broadcast_div(&s)?)
}

/// Log-softmax over the last dimension (shifted by the detached row maximum).
pub fn log_softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// Mean cross-entropy of `logits` (N, C) against class ids `targets` (N, u32).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    // Always in f32 (mixed precision computes the loss at full precision).
    let logp = log_softmax_last(&logits.to_dtype(candle_core::DType::F32)?)?;
    let picked = logp.gather(&targets.unsqueeze(1)?, 1)?;
    Ok(picked.mean_all()?.neg()?)
}

/// Additive causal mask (t, t): 0 on and below the diagonal, a large negative number above.
pub fn causal_mask(t: usize) -> Result<Tensor> {
    causal_mask_on(t, &Device::Cpu)
}

/// [`causal_mask`] on `device`.
pub fn causal_mask_on(t: usize, device: &Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { -1e9 } else { 0.0 }).collect();
    Ok(Tensor::from_vec(v, (t, t), device)?)
}

/// Index of the largest logit per row.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_dtype(DType::U32)?.to_vec1::<u32>()?)
}
