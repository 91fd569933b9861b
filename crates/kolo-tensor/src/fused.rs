//! Fused operators with hand-written backward passes over contiguous f32 slices.
//!
//! candle builds bias adds, layer norm, masked softmax and GELU (the GPT's), RMS norm, SwiGLU's
//! `silu(gate) * up` and rotary embeddings (Llama's) out of many small ops, and their backward
//! passes reduce over leading dimensions with strided loops; together they cost more than the
//! matmuls in a GPT step and a fifth of a Llama's. Each op here does one pass forward and one or two passes
//! backward, row by row. `tests.rs` checks each against the composite candle formulation.
//! Half-precision inputs (mixed-precision training) are computed in f32 and cast back, as
//! autocast does for norms and softmax.
//!
//! These kernels are CPU code: on another device (candle's CUDA backend) each op falls back to
//! its composite candle formulation, whose kernels and backward candle provides.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Shape, Tensor};
use kolo_base::simd_kernel;

type CResult<T> = candle_core::Result<T>;

pub(crate) fn err(m: &str) -> candle_core::Error {
    candle_core::Error::Msg(m.to_string())
}

pub(crate) fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> CResult<&'a [f32]> {
    let CpuStorage::F32(v) = s else { return Err(err("fused ops take f32")) };
    let (a, b) = l.contiguous_offsets().ok_or_else(|| err("fused ops take contiguous tensors"))?;
    Ok(&v[a..b])
}

/// Runs `f` on a tensor's contiguous f32 data.
pub(crate) fn with_data<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> CResult<R> {
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cpu(c) = &*s else { return Err(err("fused ops run on the CPU")) };
    Ok(f(slice(c, l)?))
}

/// A vector of `n` f32 for a kernel to overwrite: every element must be written before it is
/// read (candle's CPU backend allocates its outputs the same way). Zeroing them first was a
/// memset of every activation, 4 % of a GPT step.
// The lint forbids exactly this trade; candle's CPU backend makes the same one for its outputs.
#[allow(clippy::uninit_vec)]
pub(crate) fn uninit(n: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(n);
    // SAFETY: as candle's own CPU outputs (`alloc_uninit`): f32 needs no drop, and callers
    // write every element before anything reads it.
    unsafe { v.set_len(n) };
    v
}

pub(crate) fn last_dim(l: &Layout) -> usize {
    *l.shape().dims().last().unwrap_or(&1)
}

/// `y + b` with `b` broadcast over the rows of `y` (last dimension = len(b)).
struct BiasAdd;

simd_kernel! {
    /// `out = y + b` with `b` added to every row of `y`.
    fn bias_add_fwd(y: &[f32], b: &[f32], out: &mut [f32]) {
        for (row, o) in y.chunks_exact(b.len()).zip(out.chunks_exact_mut(b.len())) {
            for j in 0..b.len() {
                o[j] = row[j] + b[j];
            }
        }
    }
}

simd_kernel! {
    /// `acc += ` the sum of the rows of `g` (rows of `acc.len()`).
    pub(crate) fn column_sums(g: &[f32], acc: &mut [f32]) {
        for row in g.chunks_exact(acc.len()) {
            for j in 0..acc.len() {
                acc[j] += row[j];
            }
        }
    }
}

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
        let mut out = uninit(y.len());
        bias_add_fwd(y, b, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(&self, _y: &Tensor, b: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let c = b.elem_count();
        let db = with_data(grad, |g| {
            let mut acc = vec![0f32; c];
            column_sums(g, &mut acc);
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

/// Layer norm over the last dimension with affine gamma, beta; with a tensor-parallel group,
/// its output also goes through Megatron's f (the gradient arriving in backward is summed over
/// the group first), without f's copy of the output.
struct LayerNorm {
    eps: f32,
    group: Option<std::sync::Arc<dyn kolo_base::GroupSum>>,
}

/// Sum of `f(i)` for i in 0..n, in 8 independent lanes (so that it vectorises; a single running
/// sum is a serial chain the compiler must keep in order), the lanes added at the end.
#[inline(always)]
fn lanes_sum(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let full = n - n % 8;
    let mut i = 0;
    while i < full {
        for (l, a) in acc.iter_mut().enumerate() {
            *a += f(i + l);
        }
        i += 8;
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for j in full..n {
        s += f(j);
    }
    s
}

#[inline(always)]
fn row_stats(x: &[f32], eps: f32) -> (f32, f32) {
    let c = x.len() as f32;
    let mean = lanes_sum(x.len(), |i| x[i]) / c;
    let var = lanes_sum(x.len(), |i| (x[i] - mean) * (x[i] - mean)) / c;
    (mean, 1.0 / (var + eps).sqrt())
}

simd_kernel! {
    /// Layer norm of each row of `x` (rows of `g.len()`), affine `g`, `b`.
    fn layer_norm_fwd(x: &[f32], g: &[f32], b: &[f32], eps: f32, out: &mut [f32]) {
        let c = g.len();
        for (row, o) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
            let (mean, rstd) = row_stats(row, eps);
            for j in 0..c {
                o[j] = (row[j] - mean) * rstd * g[j] + b[j];
            }
        }
    }
}

simd_kernel! {
    /// Layer norm backward: `dx` per row, `dg`/`db` accumulated over rows; `xhat` is scratch.
    fn layer_norm_bwd(xd: &[f32], dy: &[f32], gamma: &[f32], eps: f32, dx: &mut [f32], dg: &mut [f32], db: &mut [f32], xhat: &mut [f32]) {
        let c = gamma.len();
        for ((xr, dyr), dxr) in xd.chunks_exact(c).zip(dy.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
            let (mean, rstd) = row_stats(xr, eps);
            for j in 0..c {
                xhat[j] = (xr[j] - mean) * rstd;
                dg[j] += dyr[j] * xhat[j];
                db[j] += dyr[j];
            }
            let m1 = lanes_sum(c, |j| dyr[j] * gamma[j]) / c as f32;
            let m2 = lanes_sum(c, |j| dyr[j] * gamma[j] * xhat[j]) / c as f32;
            for j in 0..c {
                dxr[j] = rstd * (dyr[j] * gamma[j] - m1 - xhat[j] * m2);
            }
        }
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "kolo-layer-norm"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, g, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let c = g.len();
        if last_dim(l1) != c || b.len() != c {
            return Err(err("layer norm: gamma/beta length differs from the last dimension"));
        }
        let mut out = uninit(x.len());
        layer_norm_fwd(x, g, b, self.eps, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        g: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let c = g.elem_count();
        let gamma = with_data(g, |s| s.to_vec())?;
        let xs = x.contiguous()?;
        let gs = match &self.group {
            Some(group) => crate::models::tp::summed(&**group, grad)?,
            None => grad.contiguous()?,
        };
        let (dx, dg, db) = with_data(&xs, |xd| {
            with_data(&gs, |dy| {
                let mut dx = uninit(xd.len());
                let mut dg = vec![0f32; c];
                let mut db = vec![0f32; c];
                let mut xhat = vec![0f32; c];
                layer_norm_bwd(xd, dy, &gamma, self.eps, &mut dx, &mut dg, &mut db, &mut xhat);
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
    x.contiguous()?.apply_op3_arc(
        &gamma.contiguous()?,
        &beta.contiguous()?,
        std::sync::Arc::new(Box::new(LayerNorm { eps: eps as f32, group: None })),
    )
}

/// Megatron's f applied to [`layer_norm`]'s output, as one operation (f32 on the CPU): the
/// same values, and in backward the same sum of the incoming gradient over `group` before the
/// norm's own backward, without keeping f's copy of the normalised activations. Other devices
/// and dtypes: the norm, then f ([`crate::models::tp::CopyToGroup`]).
pub fn layer_norm_copied(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f64,
    group: &std::sync::Arc<dyn kolo_base::GroupSum>,
) -> CResult<Tensor> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 {
        return layer_norm(x, gamma, beta, eps)?.contiguous()?.apply_op1(crate::models::tp::CopyToGroup(group.clone()));
    }
    let op = LayerNorm { eps: eps as f32, group: Some(group.clone()) };
    x.contiguous()?.apply_op3_arc(&gamma.contiguous()?, &beta.contiguous()?, std::sync::Arc::new(Box::new(op)))
}

/// `x + y + b` (`b` broadcast over the rows), summed in that order (`x + (y + b)`) as one
/// operation on f32 CPU tensors: a residual connection around a row-parallel layer whose bias is
/// added after the group's sum, keeping one output in the graph instead of two.
struct ResidualBiasAdd;

simd_kernel! {
    /// `out = x + (y + b)` with `b` added to every row.
    fn residual_bias_add_fwd(x: &[f32], y: &[f32], b: &[f32], out: &mut [f32]) {
        let c = b.len();
        for ((xr, yr), o) in x.chunks_exact(c).zip(y.chunks_exact(c)).zip(out.chunks_exact_mut(c)) {
            for j in 0..c {
                o[j] = xr[j] + (yr[j] + b[j]);
            }
        }
    }
}

impl CustomOp3 for ResidualBiasAdd {
    fn name(&self) -> &'static str {
        "kolo-residual-bias-add"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, y, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        if l1.shape() != l2.shape() || last_dim(l1) != b.len() {
            return Err(err("residual bias add: shapes differ"));
        }
        let mut out = uninit(x.len());
        residual_bias_add_fwd(x, y, b, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(
        &self,
        _x: &Tensor,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let db = with_data(grad, |g| {
            let mut acc = vec![0f32; b.elem_count()];
            column_sums(g, &mut acc);
            acc
        })?;
        Ok((Some(grad.clone()), Some(grad.clone()), Some(Tensor::from_vec(db, b.shape(), &Device::Cpu)?)))
    }
}

/// `x + (y + b)`, `b` broadcast over the rows of `y`: one fused operation (one output in the
/// graph) for f32 on the CPU, candle's two otherwise.
pub fn residual_bias_add(x: &Tensor, y: &Tensor, b: &Tensor) -> CResult<Tensor> {
    if !x.device().is_cpu() || [x, y, b].iter().any(|t| t.dtype() != DType::F32) {
        return x + y.broadcast_add(b)?;
    }
    x.contiguous()?.apply_op3_arc(&y.contiguous()?, &b.contiguous()?, std::sync::Arc::new(Box::new(ResidualBiasAdd)))
}

/// Softmax over the last dimension of `scale * x` where row `r` (query position `r % t` of a
/// (…, t, t) score tensor) only sees columns `0..=r % t`: scaled, causally masked attention
/// probabilities in one pass.
struct CausalSoftmax {
    scale: f32,
}

simd_kernel! {
    /// Rows of `t` (row r sees columns 0..=r % t): scaled, causally masked softmax.
    pub(crate) fn causal_softmax_fwd(x: &[f32], t: usize, scale: f32, out: &mut [f32]) {
        for (r, (xr, yr)) in x.chunks_exact(t).zip(out.chunks_exact_mut(t)).enumerate() {
            let q = r % t + 1;
            let mut lanes = [f32::NEG_INFINITY; 8];
            let full = q - q % 8;
            for c in xr[..full].chunks_exact(8) {
                for (a, v) in lanes.iter_mut().zip(c) {
                    *a = a.max(*v);
                }
            }
            let m = xr[full..q].iter().chain(&lanes).fold(f32::NEG_INFINITY, |a, v| a.max(*v)) * scale;
            for k in 0..q {
                yr[k] = exp_f32(xr[k] * scale - m);
            }
            let inv = 1.0 / lanes_sum(q, |k| yr[k]);
            yr[..q].iter_mut().for_each(|v| *v *= inv);
            yr[q..].fill(0.0);
        }
    }
}

simd_kernel! {
    /// Backward of [`causal_softmax_fwd`] from its output `y`.
    pub(crate) fn causal_softmax_bwd(y: &[f32], dy: &[f32], t: usize, scale: f32, dx: &mut [f32]) {
        for (r, ((yr, dyr), dxr)) in y.chunks_exact(t).zip(dy.chunks_exact(t)).zip(dx.chunks_exact_mut(t)).enumerate() {
            let q = r % t + 1;
            let dot = lanes_sum(q, |k| yr[k] * dyr[k]);
            for k in 0..q {
                dxr[k] = scale * yr[k] * (dyr[k] - dot);
            }
            dxr[q..].fill(0.0);
        }
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "kolo-causal-softmax"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = slice(s, l)?;
        let t = last_dim(l);
        let mut out = uninit(x.len());
        causal_softmax_fwd(x, t, self.scale, &mut out);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
    fn bwd(&self, _x: &Tensor, res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let t = *res.dims().last().unwrap_or(&1);
        let dx = with_data(res, |y| {
            with_data(grad, |dy| {
                let mut dx = uninit(y.len());
                causal_softmax_bwd(y, dy, t, self.scale, &mut dx);
                dx
            })
        })??;
        Ok(Some(Tensor::from_vec(dx, res.shape(), &Device::Cpu)?))
    }
}

pub fn causal_softmax(scores: &Tensor, scale: f64) -> CResult<Tensor> {
    if !scores.device().is_cpu() {
        let t = scores.dim(candle_core::D::Minus1)?;
        let mask =
            crate::ops::causal_mask_on(t, scores.device()).map_err(|e| candle_core::Error::Msg(e.to_string()))?.to_dtype(scores.dtype())?;
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
    let kf = x * std::f32::consts::LOG2_E + MAGIC;
    let k = kf - MAGIC;
    let r = x - k * 0.693_359_4 - k * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let y = p * r * r + r + 1.0;
    // 2^k from k's bits in kf, in integer lanes (a float-to-int `as` saturates, which does
    // not vectorise).
    let ki = (kf.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    y * f32::from_bits((ki.wrapping_add(127) as u32) << 23)
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

simd_kernel! {
    /// `out = gelu(x)`.
    fn gelu_fwd(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            let (erf, _) = erf_and_gauss(v);
            *o = 0.5 * v * (1.0 + erf);
        }
    }
}

simd_kernel! {
    /// `out = dy * gelu'(x)`.
    fn gelu_bwd(x: &[f32], dy: &[f32], out: &mut [f32]) {
        for ((o, &v), &d) in out.iter_mut().zip(x).zip(dy) {
            let (erf, e) = erf_and_gauss(v);
            *o = d * (0.5 * (1.0 + erf) + v * INV_SQRT_2PI * e);
        }
    }
}

impl CustomOp1 for GeluErf {
    fn name(&self) -> &'static str {
        "kolo-gelu-erf"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let x = slice(s, l)?;
        let mut out = uninit(x.len());
        gelu_fwd(x, &mut out);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let dx = with_data(x, |xs| {
            with_data(grad, |dy| {
                let mut dx = uninit(xs.len());
                gelu_bwd(xs, dy, &mut dx);
                dx
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

/// RMS norm over the last dimension, scaled by a weight (Llama's `RMSNorm`:
/// `w * x / sqrt(mean(x^2) + eps)`).
/// With a tensor-parallel group, Megatron's f folded in as for [`LayerNorm`].
struct RmsNorm {
    eps: f32,
    group: Option<std::sync::Arc<dyn kolo_base::GroupSum>>,
}

/// `1 / sqrt(mean(x^2) + eps)` of one row.
#[inline(always)]
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    1.0 / (lanes_sum(x.len(), |i| x[i] * x[i]) / x.len() as f32 + eps).sqrt()
}

simd_kernel! {
    /// RMS norm of each row of `x` (rows of `w.len()`), scaled by `w`.
    fn rms_norm_fwd(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let c = w.len();
        for (row, o) in x.chunks_exact(c).zip(out.chunks_exact_mut(c)) {
            let r = rms_inv(row, eps);
            for j in 0..c {
                o[j] = row[j] * r * w[j];
            }
        }
    }
}

simd_kernel! {
    /// RMS norm backward: `dx` per row, `dw` accumulated over the rows in order.
    fn rms_norm_bwd(x: &[f32], dy: &[f32], w: &[f32], eps: f32, dx: &mut [f32], dw: &mut [f32]) {
        let c = w.len();
        for ((xr, dyr), dxr) in x.chunks_exact(c).zip(dy.chunks_exact(c)).zip(dx.chunks_exact_mut(c)) {
            let r = rms_inv(xr, eps);
            // d/dx_j of sum_k dy_k w_k x_k r = r dy_j w_j - x_j r^3 mean_k(dy_k w_k x_k).
            let k = lanes_sum(c, |j| dyr[j] * w[j] * xr[j]) / c as f32 * r * r * r;
            for j in 0..c {
                dw[j] += dyr[j] * xr[j] * r;
                dxr[j] = r * dyr[j] * w[j] - xr[j] * k;
            }
        }
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "kolo-rms-norm"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (x, w) = (slice(s1, l1)?, slice(s2, l2)?);
        if last_dim(l1) != w.len() {
            return Err(err("rms norm: the weight's length differs from the last dimension"));
        }
        let mut out = uninit(x.len());
        rms_norm_fwd(x, w, self.eps, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let weight = with_data(w, |s| s.to_vec())?;
        let grad = match &self.group {
            Some(group) => &crate::models::tp::summed(&**group, grad)?,
            None => grad,
        };
        let (dx, dw) = with_data(x, |xd| {
            with_data(grad, |dy| {
                let mut dx = uninit(xd.len());
                let mut dw = vec![0f32; weight.len()];
                rms_norm_bwd(xd, dy, &weight, self.eps, &mut dx, &mut dw);
                (dx, dw)
            })
        })??;
        Ok((Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?), Some(Tensor::from_vec(dw, w.shape(), &Device::Cpu)?)))
    }
}

/// Llama's RMS norm of `x` over its last dimension, scaled by `w`. In f32 one fused pass each
/// way; in bf16/f16 as `transformers` computes it: normalised in f32, rounded to the input's
/// dtype, then multiplied by the weight in that dtype. Off the CPU, candle's composite ops.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> CResult<Tensor> {
    let dt = x.dtype();
    if !x.device().is_cpu() || !matches!(dt, DType::F32 | DType::BF16 | DType::F16) {
        let x32 = x.to_dtype(DType::F32)?;
        let ms = x32.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
        return x32.broadcast_div(&(ms + eps)?.sqrt()?)?.to_dtype(dt)?.broadcast_mul(w);
    }
    if dt != DType::F32 {
        let ones = Tensor::ones(w.elem_count(), DType::F32, &Device::Cpu)?;
        return rms_norm(&x.to_dtype(DType::F32)?, &ones, eps)?.to_dtype(dt)?.broadcast_mul(w);
    }
    let op = RmsNorm { eps: eps as f32, group: None };
    x.contiguous()?.apply_op2_arc(&w.to_dtype(DType::F32)?.contiguous()?, std::sync::Arc::new(Box::new(op)))
}

/// Megatron's f applied to [`rms_norm`]'s output as one operation (f32 on the CPU), as
/// [`layer_norm_copied`] for the layer norm. Otherwise the norm, then f.
pub fn rms_norm_copied(x: &Tensor, w: &Tensor, eps: f64, group: &std::sync::Arc<dyn kolo_base::GroupSum>) -> CResult<Tensor> {
    if !x.device().is_cpu() || x.dtype() != DType::F32 {
        return rms_norm(x, w, eps)?.contiguous()?.apply_op1(crate::models::tp::CopyToGroup(group.clone()));
    }
    let op = RmsNorm { eps: eps as f32, group: Some(group.clone()) };
    x.contiguous()?.apply_op2_arc(&w.to_dtype(DType::F32)?.contiguous()?, std::sync::Arc::new(Box::new(op)))
}

/// SwiGLU's product `silu(gate) * up` (the gated MLP of Llama, Mistral, Qwen).
struct SiluMul;

/// The logistic function through [`exp_f32`] (vectorises; `1 / (1 + e^-x)`).
#[inline(always)]
fn sigmoid_f32(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

simd_kernel! {
    /// `out = silu(g) * u`.
    fn silu_mul_fwd(g: &[f32], u: &[f32], out: &mut [f32]) {
        for ((o, &a), &b) in out.iter_mut().zip(g).zip(u) {
            *o = a * sigmoid_f32(a) * b;
        }
    }
}

simd_kernel! {
    /// Backward of [`silu_mul_fwd`]: `dg = dy u s (1 + g (1 - s))`, `du = dy g s` (s = sigmoid(g)).
    fn silu_mul_bwd(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
        for i in 0..g.len() {
            let s = sigmoid_f32(g[i]);
            dg[i] = dy[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
            du[i] = dy[i] * g[i] * s;
        }
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "kolo-silu-mul"
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> CResult<(CpuStorage, Shape)> {
        let (g, u) = (slice(s1, l1)?, slice(s2, l2)?);
        if l1.shape() != l2.shape() {
            return Err(err("silu_mul: the gate and the up projection differ in shape"));
        }
        let mut out = uninit(g.len());
        silu_mul_fwd(g, u, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(&self, g: &Tensor, u: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<(Option<Tensor>, Option<Tensor>)> {
        let (dg, du) = with_data(g, |gs| {
            with_data(u, |us| {
                with_data(grad, |dy| {
                    let (mut dg, mut du) = (uninit(gs.len()), uninit(gs.len()));
                    silu_mul_bwd(gs, us, dy, &mut dg, &mut du);
                    (dg, du)
                })
            })
        })???;
        Ok((Some(Tensor::from_vec(dg, g.shape(), &Device::Cpu)?), Some(Tensor::from_vec(du, u.shape(), &Device::Cpu)?)))
    }
}

/// `silu(gate) * up` in one pass each way for f32 on the CPU; candle's ops otherwise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> CResult<Tensor> {
    if !gate.device().is_cpu() || gate.dtype() != DType::F32 || up.dtype() != DType::F32 {
        return gate.silu()? * up;
    }
    gate.contiguous()?.apply_op2_arc(&up.contiguous()?, std::sync::Arc::new(Box::new(SiluMul)))
}

/// Rotary position embedding in `rotate_half`'s layout (the first half of each head's
/// dimensions paired with the second): `x * cos + rotate_half(x) * sin` over (.., t, d) with
/// `cos`, `sin` of (t, d / 2).
struct Rope;

simd_kernel! {
    /// Rows of `2 h` (`h = cos.len() / t`), row r at position `r % t`, rotated by `sign * angle`.
    fn rope_rows(x: &[f32], cos: &[f32], sin: &[f32], t: usize, sign: f32, out: &mut [f32]) {
        let h = cos.len() / t;
        for (r, (xr, o)) in x.chunks_exact(2 * h).zip(out.chunks_exact_mut(2 * h)).enumerate() {
            let p = (r % t) * h;
            let (c, s) = (&cos[p..p + h], &sin[p..p + h]);
            let (a, b) = xr.split_at(h);
            let (oa, ob) = o.split_at_mut(h);
            for i in 0..h {
                oa[i] = a[i] * c[i] - b[i] * (sign * s[i]);
                ob[i] = b[i] * c[i] + a[i] * (sign * s[i]);
            }
        }
    }
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "kolo-rope"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> CResult<(CpuStorage, Shape)> {
        let (x, c, s) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let dims = l1.shape().dims();
        let t = dims.len().checked_sub(2).map(|i| dims[i]).ok_or_else(|| err("rope: x needs (.., t, d)"))?;
        if c.len() != s.len() || c.len() * 2 != t * last_dim(l1) {
            return Err(err("rope: cos and sin must be (t, d / 2) for x of (.., t, d)"));
        }
        let mut out = uninit(x.len());
        rope_rows(x, c, s, t, 1.0, &mut out);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }
    fn bwd(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // A rotation's transpose is the rotation by the opposite angle.
        let t = x.dim(x.rank() - 2)?;
        let dx = with_data(cos, |c| {
            with_data(sin, |s| {
                with_data(grad, |dy| {
                    let mut dx = uninit(dy.len());
                    rope_rows(dy, c, s, t, -1.0, &mut dx);
                    dx
                })
            })
        })???;
        Ok((Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?), None, None))
    }
}

/// The rotary embedding (`rotate_half`'s layout: `x * cos + rotate_half(x) * sin`) on `x`
/// (.., t, d) with tables `cos`, `sin` (t, d / 2) as constants: one pass each
/// way for f32 on the CPU. `None` where it does not apply (another dtype or device, tables that
/// need a gradient): the caller's composite ops then.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<CResult<Tensor>> {
    let all_f32 = [x, cos, sin].iter().all(|t| t.dtype() == DType::F32);
    if !x.device().is_cpu() || !all_f32 || cos.track_op() || sin.track_op() || x.rank() < 2 {
        return None;
    }
    Some((|| x.contiguous()?.apply_op3_arc(&cos.contiguous()?, &sin.contiguous()?, std::sync::Arc::new(Box::new(Rope))))())
}
