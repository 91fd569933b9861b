//! Megatron-LM tensor parallelism for the GPT's blocks: attention heads split across the
//! group (q, k and v column-parallel, the output projection row-parallel), the MLP split
//! column-then-row, so each block needs one all-reduce in forward (the g operator after each
//! row-parallel layer) and one in backward (the f operator before each column-parallel one).
//! Layer norms, biases of row-parallel layers, embeddings and head stay replicated: their
//! gradients come out identical on every member.

use crate::{ParamSet, Result, TensorError};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};
use kolo_base::GroupSum;
use std::sync::Arc;

fn storage_vec(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Vec<f32>> {
    let CpuStorage::F32(v) = storage else {
        return Err(candle_core::Error::Msg("kolo tensor parallel: f32 only".into()));
    };
    if !layout.is_contiguous() {
        return Err(candle_core::Error::Msg("kolo tensor parallel: inputs must be contiguous".into()));
    }
    let s = layout.start_offset();
    Ok(v[s..s + layout.shape().elem_count()].to_vec())
}

fn summed(group: &dyn GroupSum, t: &Tensor) -> candle_core::Result<Tensor> {
    let mut v = t.flatten_all()?.to_vec1::<f32>()?;
    group.sum(&mut v).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")))?;
    Tensor::from_vec(v, t.shape(), t.device())
}

/// f: identity forward, all-reduce of the gradient backward (before a column-parallel layer).
pub(crate) struct CopyToGroup(pub Arc<dyn GroupSum>);
/// g: all-reduce forward, identity backward (after a row-parallel layer).
pub(crate) struct ReduceFromGroup(pub Arc<dyn GroupSum>);

impl CustomOp1 for CopyToGroup {
    fn name(&self) -> &'static str {
        "kolo-tp-f"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(storage_vec(storage, layout)?), layout.shape().clone()))
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
        let mut v = storage_vec(storage, layout)?;
        self.0.sum(&mut v).map_err(|e| candle_core::Error::Msg(format!("tensor-parallel all-reduce: {e}")))?;
        Ok((CpuStorage::F32(v), layout.shape().clone()))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.clone()))
    }
}

/// How one parameter is cut across the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cut {
    Whole,
    /// Rows (output features) of a weight, or entries of a bias, in `parts` equal pieces per
    /// block of `block` rows (qkv: three blocks, q, k and v, each split by heads).
    Rows { blocks: usize },
    /// Columns (input features) of a weight.
    Cols,
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
        Cut::Rows { blocks } => {
            let per_block = rows / blocks;
            if !per_block.is_multiple_of(p) {
                return Err(TensorError::Input(format!("{per_block} rows per block do not split into {p} tensor-parallel parts")));
            }
            let local = per_block / p;
            (0..blocks).flat_map(|b| (b * per_block + r * local..b * per_block + (r + 1) * local).flat_map(move |row| row * cols..(row + 1) * cols)).collect()
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
pub(crate) fn piece_shape(shape: &[usize], cut: Cut, p: usize) -> Vec<usize> {
    match (cut, shape) {
        (Cut::Rows { .. }, [n]) => vec![n / p],
        (Cut::Rows { .. }, [n, m]) => vec![n / p, *m],
        (Cut::Cols, [n, m]) => vec![*n, m / p],
        _ => shape.to_vec(),
    }
}

/// Rebuilds `full` (a whole model's `ParamSet`) as member `r`'s tensor-parallel piece, given
/// each parameter's cut; returns the pieces and, for each local element, its index in the
/// full model's flat layout.
pub(crate) fn shard_params(full: &ParamSet, cuts: &[Cut], r: usize, p: usize) -> Result<(ParamSet, Vec<usize>)> {
    let values = full.to_flat()?;
    let mut local = ParamSet::new();
    let mut map = Vec::new();
    for (i, param) in full.iter().enumerate() {
        let idx = piece(&param.shape, cuts[i], r, p)?;
        let v: Vec<f32> = idx.iter().map(|&k| values[param.range.start + k]).collect();
        local.add(&param.name, &piece_shape(&param.shape, cuts[i], p), v)?;
        map.extend(idx.iter().map(|&k| param.range.start + k));
    }
    Ok((local, map))
}

/// One pre-norm block with this member's pieces `p` of the parameters and `h` local heads.
pub(crate) fn block_forward_tp(x: &Tensor, p: &[Tensor], h: usize, group: &Arc<dyn GroupSum>) -> Result<Tensor> {
    use crate::ops::{layer_norm, linear};
    let (b, t, _) = x.dims3()?;
    let cl = p[2].dim(0)? / 3; // local q (= k = v) width
    let d = cl / h;
    let scale = 1.0 / (d as f64).sqrt();
    let f = |t: &Tensor| -> Result<Tensor> { Ok(t.contiguous()?.apply_op1(CopyToGroup(group.clone()))?) };
    let g = |t: &Tensor| -> Result<Tensor> { Ok(t.contiguous()?.apply_op1(ReduceFromGroup(group.clone()))?) };
    let no_bias = |w: &Tensor, x: &Tensor| -> Result<Tensor> {
        let (b, t, i) = x.dims3()?;
        Ok(x.reshape((b * t, i))?.matmul(&w.t()?)?.reshape((b, t, w.dim(0)?))?)
    };
    let hdn = f(&layer_norm(x, &p[0], &p[1], 1e-5)?)?;
    let (qw, qb) = (&p[2], &p[3]);
    let heads = |k: usize| -> Result<Tensor> {
        let y = linear(&hdn, &qw.narrow(0, k * cl, cl)?, &qb.narrow(0, k * cl, cl)?)?;
        Ok(y.reshape((b, t, h, d))?.transpose(1, 2)?.contiguous()?)
    };
    let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
    let att = crate::fused::causal_softmax(&q.matmul(&k.t()?.contiguous()?)?, scale)?;
    let y = att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, cl))?;
    let x = (x + g(&no_bias(&p[4], &y)?)?.broadcast_add(&p[5])?)?;
    let hdn = f(&layer_norm(&x, &p[6], &p[7], 1e-5)?)?;
    let m = crate::fused::gelu_erf(&linear(&hdn, &p[8], &p[9])?)?;
    Ok((&x + g(&no_bias(&p[10], &m)?)?.broadcast_add(&p[11])?)?)
}
