//! Matrix-product operators with hand-written backward passes, calling `gemm` directly with
//! strided operands.
//!
//! Built from candle primitives, `x @ w^T` differentiates into `(x^T @ dy)^T`, whose transpose
//! candle then copies element by element into a contiguous gradient, and attention over heads
//! needs a transposed, contiguous copy of q, k, v and y forward and of every gradient backward.
//! `gemm` reads and writes any row and column strides, so these operators address heads and
//! transposes in place: [`linear`] is one product forward (bias preloaded into the output) and
//! two backward; [`causal_attention`] works on the fused (b, t, 3c) q|k|v projection and
//! returns the (b, t, c) concatenated heads, keeping the attention probabilities for backward.
//! `tests.rs` checks both against the composite candle formulation.
//!
//! CPU and f32 only: on another device or dtype the callers use the composite formulation.

use crate::fused::{causal_softmax_bwd, causal_softmax_fwd, column_sums, err, last_dim, slice, uninit, with_data};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, Device, Layout, Shape, Tensor};
use gemm::Parallelism;
use std::sync::{Arc, Mutex};

type CResult<T> = candle_core::Result<T>;

/// Whether `t` takes the operators of this module (f32 on the CPU).
pub fn applies(t: &Tensor) -> bool {
    t.device().is_cpu() && t.dtype() == candle_core::DType::F32
}

/// A strided (rows x cols) matrix inside `data`, starting at `off`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    fn new(data: &'a [f32], off: usize, rs: usize, cs: usize) -> Self {
        View { data, off, rs, cs }
    }
}

/// Whether a (rows x cols) matrix at `off` with strides `rs`, `cs` lies inside `len` elements.
fn fits(len: usize, off: usize, rs: usize, cs: usize, rows: usize, cols: usize) -> bool {
    rows == 0 || cols == 0 || off + (rows - 1) * rs + (cols - 1) * cs < len
}

fn parallelism() -> Parallelism {
    // The same rule as candle's own matmul (RAYON_NUM_THREADS, else the core count), read once:
    // attention makes hundreds of small products per step.
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    match *THREADS.get_or_init(candle_core::utils::get_num_threads) {
        n if n > 1 => Parallelism::Rayon(n),
        _ => Parallelism::None,
    }
}

/// `dst = a @ b`, or `dst += a @ b` with `accumulate`, for `a` (m x k), `b` (k x n) and the
/// (m x n) destination at `d_off` of `dst` with row stride `d_rs` (columns adjacent).
#[allow(clippy::too_many_arguments)]
fn matmul(m: usize, n: usize, k: usize, dst: &mut [f32], d_off: usize, d_rs: usize, accumulate: bool, a: View, b: View) {
    assert!(fits(dst.len(), d_off, d_rs, 1, m, n), "matmul destination out of bounds");
    assert!(fits(a.data.len(), a.off, a.rs, a.cs, m, k), "matmul lhs out of bounds");
    assert!(fits(b.data.len(), b.off, b.rs, b.cs, k, n), "matmul rhs out of bounds");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[d_off + r * d_rs..][..n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: every element gemm reads or writes lies inside the slices (checked above), the
    // destination does not alias the operands (a `&mut` and two `&`), and strides are in
    // elements as gemm expects.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(d_off),
            1,
            d_rs as isize,
            accumulate,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

/// Rows per block of the weight gradient's inner products.
const ROW_BLOCK: usize = 256;

/// `x @ w^T + b` for `x` (..., in), `w` (out, in), `b` (out).
struct Linear;

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        "kolo-linear"
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
        let (x, w, b) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let inp = last_dim(l1);
        let out = b.len();
        if l2.dims() != [out, inp] {
            return Err(err(&format!("linear: weight {:?} does not map {inp} inputs to {out} outputs", l2.dims())));
        }
        let rows: usize = l1.dims()[..l1.dims().len().saturating_sub(1)].iter().product();
        let mut y = uninit(rows * out);
        for row in y.chunks_exact_mut(out.max(1)) {
            row.copy_from_slice(b);
        }
        matmul(rows, out, inp, &mut y, 0, out, true, View::new(x, 0, inp, 1), View::new(w, 0, 1, inp));
        let mut dims = l1.dims().to_vec();
        *dims.last_mut().ok_or_else(|| err("linear: scalar input"))? = out;
        Ok((CpuStorage::F32(y), Shape::from(dims)))
    }
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> CResult<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (out, inp) = w.dims2()?;
        let rows: usize = x.dims()[..x.rank().saturating_sub(1)].iter().product();
        let (dx, dw, db) = with_data(grad, |dy| {
            with_data(x, |xs| {
                with_data(w, |ws| {
                    let mut dx = uninit(rows * inp);
                    matmul(rows, inp, out, &mut dx, 0, inp, false, View::new(dy, 0, out, 1), View::new(ws, 0, inp, 1));
                    // dW = dY^T X summed over the rows in blocks of ROW_BLOCK (gemm ran
                    // these long inner products ~10 % below its rate on the other two).
                    let mut dw = uninit(out * inp);
                    let mut r0 = 0;
                    loop {
                        let r1 = (r0 + ROW_BLOCK).min(rows);
                        matmul(
                            out,
                            inp,
                            r1 - r0,
                            &mut dw,
                            0,
                            inp,
                            r0 > 0,
                            View::new(dy, r0 * out, 1, out),
                            View::new(xs, r0 * inp, inp, 1),
                        );
                        r0 = r1;
                        if r0 >= rows {
                            break;
                        }
                    }
                    let mut db = vec![0f32; out];
                    column_sums(dy, &mut db);
                    (dx, dw, db)
                })
            })
        })???;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?),
            Some(Tensor::from_vec(dw, w.shape(), &Device::Cpu)?),
            Some(Tensor::from_vec(db, b.shape(), &Device::Cpu)?),
        ))
    }
}

/// `x @ w^T + b` (f32 on the CPU; see [`applies`]).
pub fn linear(x: &Tensor, w: &Tensor, b: &Tensor) -> CResult<Tensor> {
    x.contiguous()?.apply_op3_arc(&w.contiguous()?, &b.contiguous()?, Arc::new(Box::new(Linear)))
}

/// Causal self-attention of `heads` heads on a (b, t, 3c) tensor holding q, k, v side by side
/// (head `i` in columns `i*d..(i+1)*d` of each); returns (b, t, c) with the heads side by side.
struct CausalAttention {
    heads: usize,
    scale: f32,
    /// The (b, heads, t, t) attention probabilities of the forward pass, for backward.
    probs: Mutex<Vec<f32>>,
}

impl CausalAttention {
    /// (b, t, c, d) of a (b, t, 3c) input.
    fn dims(&self, dims: &[usize]) -> CResult<(usize, usize, usize, usize)> {
        let &[b, t, c3] = dims else { return Err(err("causal attention takes a (batch, time, 3 * channels) tensor")) };
        let c = c3 / 3;
        if c3 % 3 != 0 || self.heads == 0 || c % self.heads != 0 {
            return Err(err(&format!("causal attention: {c3} columns do not split into q, k, v of {} heads", self.heads)));
        }
        Ok((b, t, c, c / self.heads))
    }
}

impl CustomOp1 for CausalAttention {
    fn name(&self) -> &'static str {
        "kolo-causal-attention"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> CResult<(CpuStorage, Shape)> {
        let qkv = slice(s, l)?;
        let (b, t, c, d) = self.dims(l.dims())?;
        let (h, c3, tt) = (self.heads, 3 * c, t * t);
        let mut y = uninit(b * t * c);
        let mut probs = uninit(b * h * tt);
        let mut scores = uninit(tt);
        for bi in 0..b {
            let base = bi * t * c3;
            for hi in 0..h {
                let p = &mut probs[(bi * h + hi) * tt..][..tt];
                // scores = q k^T (k^T read in place: row stride 1, column stride 3c)
                matmul(t, t, d, &mut scores, 0, t, false, View::new(qkv, base + hi * d, c3, 1), View::new(qkv, base + c + hi * d, 1, c3));
                causal_softmax_fwd(&scores, t, self.scale, p);
                // y_head = probs v, written into this head's columns of y
                matmul(t, d, t, &mut y, bi * t * c + hi * d, c, false, View::new(p, 0, t, 1), View::new(qkv, base + 2 * c + hi * d, c3, 1));
            }
        }
        *self.probs.lock().unwrap_or_else(|e| e.into_inner()) = probs;
        Ok((CpuStorage::F32(y), Shape::from((b, t, c))))
    }
    fn bwd(&self, qkv_t: &Tensor, _res: &Tensor, grad: &Tensor) -> CResult<Option<Tensor>> {
        let (b, t, c, d) = self.dims(qkv_t.dims())?;
        let (h, c3, tt) = (self.heads, 3 * c, t * t);
        let probs = self.probs.lock().unwrap_or_else(|e| e.into_inner());
        if probs.len() != b * h * tt {
            return Err(err("causal attention: backward without its forward pass"));
        }
        let dqkv = with_data(grad, |dy| {
            with_data(qkv_t, |qkv| {
                let mut dqkv = uninit(b * t * c3);
                let (mut dp, mut ds) = (uninit(tt), uninit(tt));
                for bi in 0..b {
                    let base = bi * t * c3;
                    let ybase = bi * t * c;
                    for hi in 0..h {
                        let p = &probs[(bi * h + hi) * tt..][..tt];
                        let (q, k, v) = (base + hi * d, base + c + hi * d, base + 2 * c + hi * d);
                        // dP = dy v^T; dS = softmax backward (scale included)
                        matmul(t, t, d, &mut dp, 0, t, false, View::new(dy, ybase + hi * d, c, 1), View::new(qkv, v, 1, c3));
                        causal_softmax_bwd(p, &dp, t, self.scale, &mut ds);
                        // dq = dS k, dk = dS^T q, dv = P^T dy
                        matmul(t, d, t, &mut dqkv, q, c3, false, View::new(&ds, 0, t, 1), View::new(qkv, k, c3, 1));
                        matmul(t, d, t, &mut dqkv, k, c3, false, View::new(&ds, 0, 1, t), View::new(qkv, q, c3, 1));
                        matmul(t, d, t, &mut dqkv, v, c3, false, View::new(p, 0, 1, t), View::new(dy, ybase + hi * d, c, 1));
                    }
                }
                dqkv
            })
        })??;
        Ok(Some(Tensor::from_vec(dqkv, qkv_t.shape(), &Device::Cpu)?))
    }
}

/// Causal self-attention with `heads` heads over `qkv` (b, t, 3c), the q, k and v projections
/// side by side; returns the (b, t, c) head outputs side by side (f32 on the CPU; see
/// [`applies`]). Equals `softmax(q k^T / sqrt(d) + causal mask) v` per head.
pub fn causal_attention(qkv: &Tensor, heads: usize) -> CResult<Tensor> {
    let c3 = qkv.dim(candle_core::D::Minus1)?;
    let d = c3 / 3 / heads.max(1);
    let scale = (1.0 / (d.max(1) as f64).sqrt()) as f32;
    let op = CausalAttention { heads, scale, probs: Mutex::new(Vec::new()) };
    qkv.contiguous()?.apply_op1_arc(Arc::new(Box::new(op)))
}
