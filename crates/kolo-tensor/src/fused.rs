//! Fused operators with hand-written backward passes over contiguous f32 slices.
//!
//! candle builds bias adds, layer norm, masked softmax and GELU out of many small ops, and their
//! backward passes reduce over leading dimensions with strided loops; together they cost more
//! than the matmuls in a GPT step. Each op here does one pass forward and one or two passes
//! backward, row by row. `tests.rs` checks each against the composite candle formulation.
//! Half-precision inputs (mixed-precision training) are computed in f32 and cast back, as
//! autocast does for norms and softmax.
//!
//! These kernels are CPU code: on another device (candle's CUDA backend) each op falls back to
//! its composite candle formulation, whose kernels and backward candle provides.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Tensor};

type CResult<T> = candle_core::Result<T>;

fn err(m: &str) -> candle_core::Error {
    candle_core::Error::Msg(m.to_string())
}

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else { return Err(err("fused ops take f32")) };
    let (a, b) = l.contiguous_offsets().ok_or_else(|| err("fused ops take contiguous tensors"))?;
    Ok(&v[a..b])
}

/// Runs `f` on a tensor's contiguous f32 data.
fn with_data<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> CResult<R> {
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cpu(c) = &*s else { return Err(err("fused ops run on the CPU")) };
    Ok(f(slice(c, l)?))
}

fn last_dim(l: &Layout) -> usize {
    *l.shape().dims().last().unwrap_or(&1)
}

/// `y + b` with `b` broadcast over the rows of `y` (last dimension = len(b)).
struct BiasAdd;

impl CustomOp2 for BiasAdd {
    fn name(&self) -> &'static str {
        "kolo-bias-add"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (y, b) = (slice(s1, l1)?, slice(s2, l2)?);
        let c = b.len();
        if last_dim(l1) != c {
            return Err(err("bias length differs from the last dimension"));
        }
        let mut out = Vec::with_capacity(y.len());
        for row in y.chunks_exact(c) {
            out.extend(row.iter().zip(b).map(|(a, b)| a + b));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(&self, _y: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let c = b.elem_count();
        let db = with_data(grad, |g| {
            let mut acc = vec![0f32; c];
            for row in g.chunks_exact(c) {
                acc.iter_mut().zip(row).for_each(|(a, x)| *a += x);
            }
            acc
        })?;
        Ok((Some(grad.clone()), Some(Tensor::from_vec(db, b.shape(), &Device::Cpu)?)))
    }
}

/// `f` on f32 copies of `ts`, its result cast back to `ts[0]`'s dtype (identity for f32).
fn in_f32<const N: usize>(ts: [&Tensor; N], f: impl FnOnce([Tensor; N]) -> CResult<Tensor>) -> Option<CResult<Tensor>> {
    let dt = ts[0].dtype();
    if dt == DType::F32 {
        return None;
    }
    let run = || -> CResult<Tensor> {
        let mut v = Vec::with_capacity(N);
        for t in ts {
            v.push(t.to_dtype(DType::F32)?);
        }
        let arr: [Tensor; N] = v.try_into().map_err(|_| err("in_f32: arity"))?;
        f(arr)?.to_dtype(dt)
    };
    Some(run())
}

pub fn bias_add(y: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if !y.device().is_cpu() {
        return y.broadcast_add(b);
    }
    if let Some(r) = in_f32([y, b], |[y, b]| bias_add(&y, &b)) {
        return r;
    }
    y.contiguous()?.apply_op2_arc(&b.contiguous()?, std::sync::Arc::new(Box::new(BiasAdd)))
}

/// Layer norm over the last dimension with affine gamma, beta.
struct LayerNorm {
    eps: f32,
}

fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let c = x.len() as f32;
    let mean = x.iter().sum::<f32>() / c;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c;
    (mean, 1.0 / (var + eps).sqrt())
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "kolo-layer-norm"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (x, g, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let c = g.len();
        if last_dim(l1) != c || b.len() != c {
            return Err(err("layer norm: gamma/beta length differs from the last dimension"));
        }
        let mut out = Vec::with_capacity(x.len());
        for row in x.chunks_exact(c) {
            let (mean, rstd) = row_stats(row, self.eps);
            out.extend(row.iter().zip(g).zip(b).map(|((v, g), b)| (v - mean) * rstd * g + b));
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, g: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = g.elem_count();
        let gamma = with_data(g, |s| s.to_vec())?;
        let xs = x.contiguous()?;
        let gs = grad.contiguous()?;
        let (dx, dg, db) = with_data(&xs, |xd| {
            with_data(&gs, |dy| {
                let mut dx = vec![0f32; xd.len()];
                let mut dg = vec![0f32; c];
                let mut db = vec![0f32; c];
                let mut xhat = vec![0f32; c];
                for ((xr, dyr), dxr) in xd.chunks_exact(c).zip(dy.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
                    let (mean, rstd) = row_stats(xr, self.eps);
                    let (mut m1, mut m2) = (0f32, 0f32);
                    for j in 0..c {
                        xhat[j] = (xr[j] - mean) * rstd;
                        let dxh = dyr[j] * gamma[j];
                        m1 += dxh;
                        m2 += dxh * xhat[j];
                        dg[j] += dyr[j] * xhat[j];
                        db[j] += dyr[j];
                    }
                    let (m1, m2) = (m1 / c as f32, m2 / c as f32);
                    for j in 0..c {
                        dxr[j] = rstd * (dyr[j] * gamma[j] - m1 - xhat[j] * m2);
                    }
                }
                (dx, dg, db)
            })
        })??;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?),
            Some(Tensor::from_vec(dg, g.shape(), &Device::Cpu)?),
            Some(Tensor::from_vec(db, b.shape(), &Device::Cpu)?),
        ))
    }
}

pub fn layer_norm(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64) -> CResult<Tensor> {
    if !x.device().is_cpu() {
        return crate::ops::layer_norm_composite(x, gamma, beta, eps).map_err(|e| candle_core::Error::Msg(e.to_string()));
    }
    if let Some(r) = in_f32([x, gamma, beta], |[x, g, b]| layer_norm(&x, &g, &b, eps)) {
        return r;
    }
    x.contiguous()?.apply_op3_arc(&gamma.contiguous()?, &beta.contiguous()?, std::sync::Arc::new(Box::new(LayerNorm { eps: eps as f32 })))
}

/// Softmax over the last dimension of `scale * x` where row `r` (query position `r % t` of a
/// (…, t, t) score tensor) only sees columns `0..=r % t`: scaled, causally masked attention
/// probabilities in one pass.
struct CausalSoftmax {
    scale: f32,
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "kolo-causal-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = slice(s, l)?;
        let t = last_dim(l);
        let mut out = vec![0f32; x.len()];
        for (r, (xr, yr)) in x.chunks_exact(t).zip(out.chunks_exact_mut(t)).enumerate() {
            let q = r % t;
            let m = xr[..=q].iter().fold(f32::NEG_INFINITY, |a, v| a.max(*v)) * self.scale;
            let mut sum = 0f32;
            for k in 0..=q {
                let e = (xr[k] * self.scale - m).exp();
                yr[k] = e;
                sum += e;
            }
            let inv = 1.0 / sum;
            yr[..=q].iter_mut().for_each(|v| *v *= inv);
        }
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let t = *res.dims().last().unwrap_or(&1);
        let dx = with_data(res, |y| {
            with_data(grad, |dy| {
                let mut dx = vec![0f32; y.len()];
                for (r, ((yr, dyr), dxr)) in y.chunks_exact(t).zip(dy.chunks_exact(t)).zip(dx.chunks_exact_mut(t)).enumerate() {
                    let q = r % t;
                    let dot: f32 = (0..=q).map(|k| yr[k] * dyr[k]).sum();
                    for k in 0..=q {
                        dxr[k] = self.scale * yr[k] * (dyr[k] - dot);
                    }
                }
                dx
            })
        })??;
        Ok(Some(Tensor::from_vec(dx, res.shape(), &Device::Cpu)?))
    }
}

pub fn causal_softmax(scores: &Tensor, scale: f64) -> CResult<Tensor> {
    if !scores.device().is_cpu() {
        let t = scores.dim(candle_core::D::Minus1)?;
        let mask = crate::ops::causal_mask_on(t, scores.device()).map_err(|e| candle_core::Error::Msg(e.to_string()))?.to_dtype(scores.dtype())?;
        return crate::ops::softmax_last(&(scores * scale)?.broadcast_add(&mask)?).map_err(|e| candle_core::Error::Msg(e.to_string()));
    }
    if let Some(r) = in_f32([scores], |[s]| causal_softmax(&s, scale)) {
        return r;
    }
    scores.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(CausalSoftmax { scale: scale as f32 })))
}

/// GELU with the exact (erf) form, as torch's default.
struct GeluErf;

const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `e^x` for f32 (Cephes' polynomial, relative error ~1e-7), written without calls or branches
/// so that loops over it vectorise; libm's scalar `expf`/`erff` made GELU 11 % of a GPT step.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // Round x / ln 2 to the nearest integer with the 1.5 * 2^23 trick (no `floor` call).
    const MAGIC: f32 = 12_582_912.0;
    let k = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = x - k * 0.693_359_4 - k * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * r * r + r + 1.0;
    y * f32::from_bits(((k as i32 + 127) as u32) << 23)
}

/// `(erf(x / sqrt 2), exp(-x^2 / 2))`: the normal CDF's erf and the shared exponential, from
/// Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7).
#[inline(always)]
fn erf_and_gauss(x: f32) -> (f32, f32) {
    let z = (x * SQRT_HALF).abs();
    let e = exp_f32(-0.5 * x * x);
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = ((((1.061_405_4 * t - 1.453_152) * t + 1.421_413_7) * t - 0.284_496_72) * t + 0.254_829_6) * t;
    let erf = 1.0 - poly * e;
    (if x < 0.0 { -erf } else { erf }, e)
}

impl CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "kolo-gelu-erf"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = slice(s, l)?;
        let out = x
            .iter()
            .map(|&v| {
                let (erf, _) = erf_and_gauss(v);
                0.5 * v * (1.0 + erf)
            })
            .collect();
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let dx = with_data(x, |xs| {
            with_data(grad, |dy| {
                xs.iter()
                    .zip(dy)
                    .map(|(&v, &d)| {
                        let (erf, e) = erf_and_gauss(v);
                        d * (0.5 * (1.0 + erf) + v * INV_SQRT_2PI * e)
                    })
                    .collect::<Vec<f32>>()
            })
        })??;
        Ok(Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?))
    }
}

pub fn gelu_erf(x: &Tensor) -> CResult<Tensor> {
    if !x.device().is_cpu() {
        return x.gelu_erf();
    }
    if let Some(r) = in_f32([x], |[x]| gelu_erf(&x)) {
        return r;
    }
    x.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(GeluErf)))
}
