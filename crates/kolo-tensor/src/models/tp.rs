//! Megatron-LM tensor parallelism for the GPT's blocks: attention heads split across the
//! group (q, k and v column-parallel, the output projection row-parallel), the MLP split
//! column-then-row, so each block needs one all-reduce in forward (the g operator after each
//! row-parallel layer) and one in backward (the f operator before each column-parallel one).
//! Layer norms and biases of row-parallel layers stay replicated: their gradients come out
//! identical on every member. The vocabulary is split too (Megatron's vocabulary-parallel
//! embedding and cross-entropy): each member holds a contiguous range of the token embedding's
//! rows and of the head's outputs; the embedding is summed over the group (a token's row lives
//! on one member), the head's logits stay split and the cross-entropy combines the members'
//! maxima, sums of exponentials and target logits with three small all-reduces.

use crate::{ParamSet, Result, TensorError};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use kolo_base::GroupSum;
use std::sync::Arc;

/// A contiguous f32, bf16 or f16 input's values in f32 (mixed precision: the collectives move
/// and sum f32, and each result is rounded to the input's dtype once), and that dtype.
pub(crate) fn storage_vec(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(Vec<f32>, DType)> {
    if !layout.is_contiguous() {
        return Err(candle_core::Error::Msg("kolo tensor parallel: inputs must be contiguous".into()));
    }
    let r = layout.start_offset()..layout.start_offset() + layout.shape().elem_count();
    Ok(match storage {
        CpuStorage::F32(v) => (v[r].to_vec(), DType::F32),
        CpuStorage::BF16(v) => (v[r].iter().map(|x| x.to_f32()).collect(), DType::BF16),
        CpuStorage::F16(v) => (v[r].iter().map(|x| x.to_f32()).collect(), DType::F16),
        other => {
            return Err(candle_core::Error::Msg(format!(
                "kolo tensor parallel: f32, bf16 or f16, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            )))
        }
    })
}

/// `v` as a storage of `dtype` (f32, bf16 or f16, as [`storage_vec`] read it).
pub(crate) fn storage_of(v: Vec<f32>, dtype: DType) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

pub(crate) fn summed(group: &dyn GroupSum, t: &Tensor) -> candle_core::Result<Tensor> {
    let mut v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    group.sum(&mut v).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")))?;
    Tensor::from_vec(v, t.shape(), t.device())?.to_dtype(t.dtype())
}

/// g summed in place ([`reduce_in_place`]).
struct ReduceInPlace(Arc<dyn GroupSum>);

impl candle_core::InplaceOp1 for ReduceInPlace {
    fn name(&self) -> &'static str {
        "kolo-tp-g-in-place"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((a, b)) = layout.contiguous_offsets() else {
            return Err(candle_core::Error::Msg("kolo tensor parallel: inputs must be contiguous".into()));
        };
        let sum = |v: &mut [f32]| self.0.sum(v).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")));
        // As `ReduceFromGroup`: summed in f32, a half-precision result rounded once.
        fn widened<T: Copy>(
            v: &mut [T],
            to: fn(T) -> f32,
            back: fn(f32) -> T,
            sum: impl Fn(&mut [f32]) -> candle_core::Result<()>,
        ) -> candle_core::Result<()> {
            let mut f: Vec<f32> = v.iter().map(|x| to(*x)).collect();
            sum(&mut f)?;
            v.iter_mut().zip(f).for_each(|(o, x)| *o = back(x));
            Ok(())
        }
        match storage {
            CpuStorage::F32(v) => sum(&mut v[a..b]),
            CpuStorage::BF16(v) => widened(&mut v[a..b], half::bf16::to_f32, half::bf16::from_f32, sum),
            CpuStorage::F16(v) => widened(&mut v[a..b], half::f16::to_f32, half::f16::from_f32, sum),
            other => Err(candle_core::Error::Msg(format!(
                "kolo tensor parallel: f32, bf16 or f16, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ))),
        }
    }
}

/// Megatron's g on a row-parallel product's fresh output `y`: summed over the group in place,
/// so `y` keeps its place in the graph (g's backward is the identity) and backward keeps no
/// second copy of the partial product ([`ReduceFromGroup`] keeps its input alive). Only for a
/// tensor nothing has read yet: whatever read it before sees the sum afterwards. The same bits
/// as [`ReduceFromGroup`].
pub fn reduce_in_place(y: &Tensor, group: &Arc<dyn GroupSum>) -> candle_core::Result<Tensor> {
    let y = y.contiguous()?;
    y.inplace_op1(&ReduceInPlace(group.clone()))?;
    Ok(y)
}

/// Megatron's column-parallel linear layer on `x`, whole on every member: `f` on `x` (identity
/// forward, its gradient summed over the group backward) unless `copied` says `x` already is
/// `f`'s output (a norm with `f` folded in, or one `f` for several layers that read it), then
/// `x` times this member's rows `w` of the weight, plus its piece `b` of the bias. The output is
/// this member's share of the features. `kolo::tp::ColumnParallelLinear` and the built-in GPT's
/// blocks both run it.
pub fn column_parallel(x: &Tensor, w: &Tensor, b: Option<&Tensor>, copied: bool, group: &Arc<dyn GroupSum>) -> candle_core::Result<Tensor> {
    let x = if copied || group.size() == 1 { x.clone() } else { x.contiguous()?.apply_op1(CopyToGroup(group.clone()))? };
    match b {
        Some(b) => crate::ops::linear(&x, w, b).map_err(|e| candle_core::Error::Msg(e.to_string())),
        None => crate::ops::times_transposed(&x, w),
    }
}

/// Megatron's row-parallel linear layer on `x`, this member's share of the input features
/// (`(.., in / tp)`): the partial product with this member's columns `w` (`(out, in / tp)`) of
/// the weight, summed over the group in place (`g`, [`reduce_in_place`]), then the whole bias
/// `b`, added once after the sum, and the `residual` where given (`residual + (y + b)` as one
/// operation, [`crate::fused::residual_bias_add`]). The output is whole on every member.
/// `kolo::tp::RowParallelLinear` and the built-in GPT's blocks both run it.
pub fn row_parallel(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    residual: Option<&Tensor>,
    group: &Arc<dyn GroupSum>,
) -> candle_core::Result<Tensor> {
    let partial = crate::ops::times_transposed(x, w)?;
    let y = if group.size() == 1 { partial } else { reduce_in_place(&partial, group)? };
    match (residual, b) {
        (Some(r), Some(b)) => crate::fused::residual_bias_add(r, &y, b),
        (Some(r), None) => r + y,
        (None, Some(b)) => y.broadcast_add(b),
        (None, None) => Ok(y),
    }
}

/// f: identity forward, all-reduce of the gradient backward (before a column-parallel layer).
pub struct CopyToGroup(pub Arc<dyn GroupSum>);
/// g: all-reduce forward, identity backward (after a row-parallel layer).
pub struct ReduceFromGroup(pub Arc<dyn GroupSum>);

impl CustomOp1 for CopyToGroup {
    fn name(&self) -> &'static str {
        "kolo-tp-f"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (v, dtype) = storage_vec(storage, layout)?;
        Ok((storage_of(v, dtype), layout.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(summed(&*self.0, grad)?))
    }
}

impl CustomOp1 for ReduceFromGroup {
    fn name(&self) -> &'static str {
        "kolo-tp-g"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (mut v, dtype) = storage_vec(storage, layout)?;
        self.0.sum(&mut v).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")))?;
        Ok((storage_of(v, dtype), layout.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// The last dimension `k` of a contiguous input and the number of rows before it.
fn rows_and_width(layout: &Layout) -> candle_core::Result<(usize, usize)> {
    let k = layout.shape().dims().last().copied().unwrap_or(1);
    Ok((layout.shape().elem_count().checked_div(k).unwrap_or(0), k))
}

/// All-gather along the last dimension: forward concatenates the members' `(.., k)` in member
/// order into `(.., k p)`; backward keeps this member's slice of the gradient (Megatron's
/// `gather_from_tensor_model_parallel_region`).
pub struct GatherFromGroup(pub Arc<dyn GroupSum>);
/// Forward keeps this member's slice of the last dimension (which must split evenly); backward
/// gathers the members' gradients (Megatron's `scatter_to_tensor_model_parallel_region`).
pub struct ScatterToGroup(pub Arc<dyn GroupSum>);

impl CustomOp1 for GatherFromGroup {
    fn name(&self) -> &'static str {
        "kolo-tp-gather"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (v, dtype) = storage_vec(storage, layout)?;
        let ((rows, k), (r, p)) = (rows_and_width(layout)?, (self.0.rank(), self.0.size()));
        let mut out = vec![0f32; rows * k * p];
        for (i, row) in v.chunks_exact(k.max(1)).enumerate().take(rows) {
            out[i * k * p + r * k..i * k * p + (r + 1) * k].copy_from_slice(row);
        }
        self.0.sum(&mut out).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-gather: {e}")))?;
        let mut dims = layout.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last *= p;
        }
        Ok((storage_of(out, dtype), Shape::from(dims)))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let d = grad.rank().saturating_sub(1);
        let k = grad.dim(d)? / self.0.size();
        Ok(Some(grad.narrow(d, self.0.rank() * k, k)?.contiguous()?))
    }
}

impl CustomOp1 for ScatterToGroup {
    fn name(&self) -> &'static str {
        "kolo-tp-scatter"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (v, dtype) = storage_vec(storage, layout)?;
        let ((rows, width), (r, p)) = (rows_and_width(layout)?, (self.0.rank(), self.0.size()));
        if !width.is_multiple_of(p) {
            candle_core::bail!("kolo tensor parallel: a last dimension of {width} does not split into {p} equal parts");
        }
        let k = width / p;
        let out: Vec<f32> = (0..rows).flat_map(|i| v[i * width + r * k..i * width + (r + 1) * k].iter().copied()).collect();
        let mut dims = layout.shape().dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = k;
        }
        Ok((storage_of(out, dtype), Shape::from(dims)))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1(GatherFromGroup(self.0.clone()))?))
    }
}

/// How one parameter is cut across the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    Whole,
    /// Rows (output features) of a weight, or entries of a bias, in `parts` equal pieces per
    /// block of `block` rows (qkv: three blocks, q, k and v, each split by heads).
    Rows {
        blocks: usize,
    },
    /// Columns (input features) of a weight.
    Cols,
    /// Rows of a vocabulary-sized tensor (token embedding, head weight and bias) in contiguous
    /// ranges of [`vocab_range`] (the vocabulary need not divide evenly).
    Vocab,
}

/// How a tensor-parallel variable was cut from the whole tensor: the whole shape, and the
/// ranges of dimension `dim` this member holds, in order (one range; one per section of a fused
/// layer, as the GPT's q, k and v rows in one projection).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// The whole tensor's shape.
    pub whole: Vec<usize>,
    /// The dimension that is cut.
    pub dim: usize,
    /// The ranges along `dim` this member's piece holds, one after the other.
    pub ranges: Vec<std::ops::Range<usize>>,
}

impl Split {
    /// The piece's length along `dim`.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum()
    }

    /// Whether the piece holds nothing along `dim`.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the piece is the whole tensor.
    pub fn is_whole(&self) -> bool {
        self.len() == self.whole[self.dim]
    }

    /// The piece's shape: the whole shape with `dim` cut to [`Split::len`].
    pub fn piece_shape(&self) -> Vec<usize> {
        let mut shape = self.whole.clone();
        shape[self.dim] = self.len();
        shape
    }

    /// For each element of the piece (row-major), its index in the whole tensor (row-major).
    pub fn whole_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let outer: usize = self.whole[..self.dim].iter().product();
        let inner: usize = self.whole[self.dim + 1..].iter().product();
        let n = self.whole[self.dim];
        (0..outer).flat_map(move |o| {
            self.ranges.iter().flat_map(move |r| r.clone().flat_map(move |j| (0..inner).map(move |i| (o * n + j) * inner + i)))
        })
    }
}

/// Member `r`'s piece of a tensor of the whole `shape` cut `cut` over `p` members, as a
/// [`Split`] (`None` for a whole one): the same elements as [`piece`].
#[allow(clippy::single_range_in_vec_init)] // one range: the usual split
pub(crate) fn split_of_cut(shape: &[usize], cut: Cut, r: usize, p: usize) -> Option<Split> {
    let rows = shape.first().copied().unwrap_or(1);
    let (dim, ranges) = match cut {
        Cut::Whole => return None,
        Cut::Vocab => (0, vec![vocab_range(rows, p, r)]),
        Cut::Rows { blocks } => {
            let per_block = rows / blocks;
            let local = per_block / p;
            (0, (0..blocks).map(|b| b * per_block + r * local..b * per_block + (r + 1) * local).collect())
        }
        Cut::Cols => {
            let local = shape.get(1).copied().unwrap_or(1) / p;
            (1, vec![r * local..(r + 1) * local])
        }
    };
    Some(Split { whole: shape.to_vec(), dim, ranges })
}

/// Member `r`'s range of a vocabulary of `v` split over `p`: the first `v % p` members hold
/// one entry more.
pub fn vocab_range(v: usize, p: usize, r: usize) -> std::ops::Range<usize> {
    let (base, extra) = (v / p, v % p);
    let start = r * base + r.min(extra);
    start..start + base + usize::from(r < extra)
}

/// The cut of each of a block's 12 parameters (see `Block::ids`).
pub(crate) const BLOCK_CUTS: [Cut; 12] = [
    Cut::Whole,
    Cut::Whole, // ln1
    Cut::Rows { blocks: 3 },
    Cut::Rows { blocks: 3 }, // qkv
    Cut::Cols,
    Cut::Whole, // proj (its bias is added once, after the all-reduce)
    Cut::Whole,
    Cut::Whole, // ln2
    Cut::Rows { blocks: 1 },
    Cut::Rows { blocks: 1 }, // fc
    Cut::Cols,
    Cut::Whole, // fc_out
];

/// Flat indices (into the full tensor, row-major) of member `r`'s piece of a tensor of `shape`
/// cut `cut` in `p` parts.
pub(crate) fn piece(shape: &[usize], cut: Cut, r: usize, p: usize) -> Result<Vec<usize>> {
    let (rows, cols) = match shape {
        [n] => (*n, 1),
        [n, m] => (*n, *m),
        _ => return Err(TensorError::Input(format!("tensor parallelism cuts vectors and matrices, not {shape:?}"))),
    };
    Ok(match cut {
        Cut::Whole => (0..rows * cols).collect(),
        Cut::Vocab => vocab_range(rows, p, r).flat_map(|row| row * cols..(row + 1) * cols).collect(),
        Cut::Rows { blocks } => {
            let per_block = rows / blocks;
            if !per_block.is_multiple_of(p) {
                return Err(TensorError::Input(format!("{per_block} rows per block do not split into {p} tensor-parallel parts")));
            }
            let local = per_block / p;
            (0..blocks)
                .flat_map(|b| {
                    (b * per_block + r * local..b * per_block + (r + 1) * local).flat_map(move |row| row * cols..(row + 1) * cols)
                })
                .collect()
        }
        Cut::Cols => {
            if !cols.is_multiple_of(p) {
                return Err(TensorError::Input(format!("{cols} columns do not split into {p} tensor-parallel parts")));
            }
            let local = cols / p;
            (0..rows).flat_map(|row| row * cols + r * local..row * cols + (r + 1) * local).collect()
        }
    })
}

/// The local shape of a piece.
pub(crate) fn piece_shape(shape: &[usize], cut: Cut, r: usize, p: usize) -> Vec<usize> {
    match (cut, shape) {
        (Cut::Vocab, [n]) => vec![vocab_range(*n, p, r).len()],
        (Cut::Vocab, [n, m]) => vec![vocab_range(*n, p, r).len(), *m],
        (Cut::Rows { .. }, [n]) => vec![n / p],
        (Cut::Rows { .. }, [n, m]) => vec![n / p, *m],
        (Cut::Cols, [n, m]) => vec![*n, m / p],
        _ => shape.to_vec(),
    }
}

/// Rebuilds `full` (a whole model's `ParamSet`) as member `r`'s tensor-parallel piece, given
/// each parameter's cut; returns the pieces and, for each local element, its index in the
/// full model's flat layout.
pub(crate) fn shard_params(full: &ParamSet, cuts: &[Cut], r: usize, p: usize) -> Result<(ParamSet, super::IndexRuns)> {
    let values = full.to_flat()?;
    let mut local = ParamSet::new();
    let mut map = super::IndexRuns::default();
    for (i, param) in full.iter().enumerate() {
        let idx = piece(&param.shape, cuts[i], r, p)?;
        let v: Vec<f32> = idx.iter().map(|&k| values[param.range.start + k]).collect();
        local.add(&param.name, &piece_shape(&param.shape, cuts[i], r, p), v)?;
        map.extend(idx.iter().map(|&k| param.range.start + k));
    }
    Ok((local, map))
}

/// One pre-norm block with this member's pieces `p` of the parameters and `h` local heads.
pub(crate) fn block_forward_tp(x: &Tensor, p: &[Tensor], h: usize, group: &Arc<dyn GroupSum>) -> Result<Tensor> {
    use crate::fused::layer_norm_copied;
    // The layers of `kolo::tp`, as functions of this member's pieces: each norm's output goes
    // through f as part of the norm (f's backward sum, no copy), so the column-parallel
    // layers after it apply none (the q, k and v projection, column-parallel by its weight's
    // rows, is fused into the attention); the row-parallel ones add their bias and the
    // residual after g in one operation.
    let hdn = layer_norm_copied(x, &p[0], &p[1], 1e-5, group)?;
    let y = super::gpt::self_attention(&hdn, &p[2], &p[3], h)?;
    let x = row_parallel(&y, &p[4], Some(&p[5]), Some(x), group)?;
    let hdn = layer_norm_copied(&x, &p[6], &p[7], 1e-5, group)?;
    let m = crate::fused::gelu_erf(&column_parallel(&hdn, &p[8], Some(&p[9]), true, group)?)?;
    Ok(row_parallel(&m, &p[10], Some(&p[11]), Some(&x), group)?)
}

fn group_err(e: String) -> TensorError {
    TensorError::Input(format!("tensor-parallel all-reduce: {e}"))
}

/// The vocabulary-parallel token embedding: rows of `wte` (this member's `range` of the
/// vocabulary) for the ids in range, zeros for the others, summed over the group (g). Returns
/// (n, c) for the n ids.
pub fn embed(ids: &[u32], wte: &Tensor, range: std::ops::Range<usize>, group: &Arc<dyn GroupSum>) -> Result<Tensor> {
    let n = ids.len();
    let local: Vec<u32> = ids.iter().map(|&i| if range.contains(&(i as usize)) { (i as usize - range.start) as u32 } else { 0 }).collect();
    let mask: Vec<f32> = ids.iter().map(|&i| if range.contains(&(i as usize)) { 1.0 } else { 0.0 }).collect();
    let rows = wte.index_select(&Tensor::from_vec(local, n, wte.device())?, 0)?;
    let e = rows.broadcast_mul(&Tensor::from_vec(mask, (n, 1), wte.device())?.to_dtype(wte.dtype())?)?;
    // A fresh product nothing has read: summed in place, backward keeps no second copy.
    Ok(reduce_in_place(&e, group)?)
}

/// One value per row of every member, gathered with a sum: member r fills column r.
fn gather_rows(vals: &[f32], group: &dyn GroupSum) -> Result<Vec<f32>> {
    let (r, p, n) = (group.rank(), group.size(), vals.len());
    let mut buf = vec![0f32; n * p];
    for (i, v) in vals.iter().enumerate() {
        buf[i * p + r] = *v;
    }
    group.sum(&mut buf).map_err(group_err)?;
    Ok(buf)
}

/// Mean cross-entropy of logits split by vocabulary (`logits`: (n, this member's range)) against
/// `targets`, identical on every member: the global row maximum (constant), the sum of
/// exponentials and the target logit are each summed over the group; backward of each sum is
/// the identity, so every member's logits get their part of the gradient.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &[u32],
    range: std::ops::Range<usize>,
    group: &Arc<dyn GroupSum>,
) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if targets.len() != n {
        return Err(TensorError::Input(format!("{} targets for {n} outputs", targets.len())));
    }
    let logits = logits.to_dtype(candle_core::DType::F32)?;
    let local_max = logits.max_keepdim(1)?.flatten_all()?.to_vec1::<f32>()?;
    let all = gather_rows(&local_max, &**group)?;
    let p = group.size();
    let m: Vec<f32> = all.chunks(p).map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
    let m = Tensor::from_vec(m, (n, 1), logits.device())?;
    let shifted = logits.broadcast_sub(&m)?;
    let g = |t: Tensor| -> Result<Tensor> { Ok(t.contiguous()?.apply_op1(ReduceFromGroup(group.clone()))?) };
    let sum_exp = g(shifted.exp()?.sum_keepdim(1)?)?;
    let idx: Vec<u32> =
        targets.iter().map(|&t| if range.contains(&(t as usize)) { (t as usize - range.start) as u32 } else { 0 }).collect();
    let mask: Vec<f32> = targets.iter().map(|&t| if range.contains(&(t as usize)) { 1.0 } else { 0.0 }).collect();
    let picked =
        shifted.gather(&Tensor::from_vec(idx, (n, 1), logits.device())?, 1)?.mul(&Tensor::from_vec(mask, (n, 1), logits.device())?)?;
    let target = g(picked)?;
    Ok((sum_exp.log()? - target)?.mean_all()?)
}

/// The whole logits (n, v) from every member's vocabulary range (evaluation and sampling; not
/// differentiable).
pub fn gather_logits(logits: &Tensor, v: usize, group: &dyn GroupSum) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    let range = vocab_range(v, group.size(), group.rank());
    let local = logits.to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let w = range.len();
    let mut full = vec![0f32; n * v];
    for i in 0..n {
        full[i * v + range.start..i * v + range.end].copy_from_slice(&local[i * w..(i + 1) * w]);
    }
    group.sum(&mut full).map_err(group_err)?;
    Ok(Tensor::from_vec(full, (n, v), logits.device())?)
}
