//! Tensor parallelism for your own candle model: Megatron-LM's layers as candle modules
//! (torchtitan's `ColwiseParallel` and `RowwiseParallel`), built from a `VarBuilder` like
//! `candle_nn::linear`, each holding only this rank's piece of the whole weight.
//!
//! A column-parallel layer splits the output features: the input is whole on every member
//! (Megatron's f operator: identity forward, all-reduce of the input's gradient backward) and
//! the output stays split. A row-parallel layer splits the input features: it takes that split
//! output, and its partial products are summed over the group (the g operator: all-reduce
//! forward, identity backward). A column-parallel layer followed by a row-parallel one (an MLP,
//! or attention with its heads split) costs one all-reduce forward and one backward.
//!
//! ```no_run
//! use candle_nn::{Module, VarBuilder, VarMap};
//! use kolo::tp::{ColumnParallelLinear, RowParallelLinear};
//! # fn main() -> kolo::Result<()> {
//! let dist = kolo::init()?;
//! let mesh = kolo::Mesh::new(&dist, &[("dp", 1), ("tp", dist.world_size())])?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dist.device());
//! let up = ColumnParallelLinear::new(784, 256, true, vb.pp("fc1"), mesh.tp())?;
//! let down = RowParallelLinear::new(256, 10, true, vb.pp("fc2"), mesh.tp())?;
//! let mut trainer = kolo::Trainer::with_mesh(&varmap, &mesh, kolo::TrainOptions::default())?;
//! # let (x, y) = (candle_core::Tensor::zeros((8, 784), candle_core::DType::F32, &dist.device())?,
//! #               candle_core::Tensor::zeros(8, candle_core::DType::U32, &dist.device())?);
//! trainer.step(|| candle_nn::loss::cross_entropy(&down.forward(&up.forward(&x)?.relu()?)?, &y))?;
//! # Ok(()) }
//! ```
//!
//! The variables keep the whole model's names; Kolo remembers how each was cut
//! ([`split_of`]), so [`load_safetensors`] fills them from a file of whole tensors (a Hugging
//! Face checkpoint, or a one-process run's `VarMap::save`) and the trainer's checkpoints hold
//! whole tensors that load in one process or at another tensor-parallel size.
//!
//! Computation in f32 on the CPU so far.

use crate::{Error, Result};
use candle_core::{Module, Tensor, TensorId};
use candle_nn::{Init, VarBuilder, VarMap};
use kolo_base::GroupSum;
use kolo_comm::{Communicator, SumGroup};
use kolo_tensor::models::tp::{
    column_parallel, embed, gather_logits, row_parallel, vocab_parallel_cross_entropy as vocab_ce, vocab_range, CopyToGroup,
    GatherFromGroup, ScatterToGroup,
};
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// A tensor-parallel group ([`crate::Mesh::tp`]): the ranks that each hold one piece of every
/// split layer and see the same batches.
#[derive(Clone)]
pub struct TensorParallel {
    group: Arc<SumGroup>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorParallel {{ rank: {}, size: {} }}", self.rank(), self.size())
    }
}

impl TensorParallel {
    /// The group of `comm`'s ranks.
    pub fn new(comm: Arc<dyn Communicator>) -> TensorParallel {
        TensorParallel { group: SumGroup::new(comm) }
    }
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.comm().rank().get()
    }
    /// The group's size.
    pub fn size(&self) -> usize {
        self.group.comm().world_size().get()
    }
    /// The group's communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        self.group.comm()
    }
    /// All-reduces the layers made so far, and their bytes (activations forward, their
    /// gradients backward).
    pub fn traffic(&self) -> (u64, u64) {
        self.group.traffic()
    }
    pub(crate) fn sum(&self) -> Arc<dyn GroupSum> {
        self.group.clone()
    }
}

/// How a variable was cut from the whole tensor: the whole shape, and the ranges of dimension
/// `dim` this rank holds, in order (one range; one per section of a fused layer, as Phi-3's
/// q, k and v rows in one `qkv_proj`). Recorded by this module's layers, or by
/// [`mark_split`] for a piece made another way.
pub use kolo_tensor::models::tp::Split;

/// The split variables of this process, by id (a variable's id outlives no process).
static SPLITS: Mutex<Option<HashMap<TensorId, Split>>> = Mutex::new(None);

fn remember(t: &Tensor, s: Split) {
    SPLITS.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(HashMap::new).insert(t.id(), s);
}

/// Records `new` as cut the way `like` is (a copy of a split variable in another dtype).
pub(crate) fn remember_like(new: &Tensor, like: &Tensor) {
    if let Some(s) = split_of(like) {
        remember(new, s);
    }
}

/// Records that the variable `t` is this rank's piece `split` of a whole tensor, as this
/// module's layers record their own: for a model whose split layers are not `kolo::tp`'s (your
/// own layer, or Kolo's built-in GPT made by `kolo_tensor::models::Gpt::new_tensor_parallel`,
/// whose `Model::tensor_parallel_splits` says how each parameter was cut). Then
/// [`crate::Trainer::with_mesh`] treats `t` as the tensor-parallel layers' variables: the
/// clipping norm sums its pieces over the group, and checkpoints hold the whole tensor.
/// Refuses a `t` that is not a variable, or whose shape is not the split's piece.
pub fn mark_split(t: &Tensor, split: Split) -> Result<()> {
    let bad = |why: String| Err(Error::Tensor(kolo_tensor::TensorError::Input(format!("kolo::tp::mark_split: {why}"))));
    if !t.is_variable() {
        return bad("a split is recorded for a variable (a VarMap's), not for a computed tensor".into());
    }
    let dim_ok = split.dim < split.whole.len() && split.ranges.iter().all(|r| r.start <= r.end && r.end <= split.whole[split.dim]);
    if !dim_ok || t.dims() != split.piece_shape() {
        return bad(format!(
            "a variable of shape {:?} is not the piece {:?} of {:?} along dimension {}",
            t.dims(),
            split.ranges,
            split.whole,
            split.dim
        ));
    }
    remember(t, split);
    Ok(())
}

/// How `t` was cut, when it is a variable made by one of this module's layers or given to
/// [`mark_split`].
pub fn split_of(t: &Tensor) -> Option<Split> {
    SPLITS.lock().unwrap_or_else(|p| p.into_inner()).as_ref().and_then(|m| m.get(&t.id()).cloned())
}

/// This rank's piece of `name` under `vb`: a new (or the VarMap's) variable of the piece's
/// shape, or the piece cut from a whole tensor where `vb` reads a file.
fn piece(vb: &VarBuilder, name: &str, whole: &[usize], dim: usize, range: Range<usize>, init: Init) -> candle_core::Result<Tensor> {
    pieces(vb, name, whole, dim, vec![range], init)
}

/// As [`piece`], the piece made of several `ranges` of `dim`, one after the other.
fn pieces(vb: &VarBuilder, name: &str, whole: &[usize], dim: usize, ranges: Vec<Range<usize>>, init: Init) -> candle_core::Result<Tensor> {
    if let Ok(t) = vb.get_unchecked(name) {
        if t.dims() == whole {
            let parts = ranges.iter().map(|r| t.narrow(dim, r.start, r.len())).collect::<candle_core::Result<Vec<_>>>()?;
            return Tensor::cat(&parts, dim);
        }
    }
    let mut shape = whole.to_vec();
    shape[dim] = ranges.iter().map(|r| r.len()).sum();
    let t = vb.get_with_hints(shape, name, init)?;
    if t.is_variable() {
        remember(&t, Split { whole: whole.to_vec(), dim, ranges });
    }
    Ok(t)
}

/// candle-nn's initialisation of a linear layer's weight (Kaiming normal), from the whole
/// layer's fan-in: the pieces of one whole layer are drawn from the same distribution.
fn weight_init(in_dim: usize) -> Init {
    Init::Randn { mean: 0.0, stdev: (2.0 / in_dim.max(1) as f64).sqrt() }
}

/// candle-nn's initialisation of a linear layer's bias.
fn bias_init(in_dim: usize) -> Init {
    let bound = 1.0 / (in_dim.max(1) as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// The range of `n` that member `r` of `p` holds, when `n` splits evenly.
fn even(what: &str, layer: &str, n: usize, tp: &TensorParallel) -> candle_core::Result<Range<usize>> {
    let p = tp.size();
    if !n.is_multiple_of(p) {
        candle_core::bail!("{layer} `{what}`: {n} does not split into {p} equal tensor-parallel parts");
    }
    let k = n / p;
    Ok(tp.rank() * k..(tp.rank() + 1) * k)
}

/// This member's range of each of `sections` (output features laid end to end), in order.
fn section_ranges(vb: &VarBuilder, sections: &[usize], tp: &TensorParallel) -> candle_core::Result<Vec<Range<usize>>> {
    let (p, r) = (tp.size(), tp.rank());
    let mut ranges = Vec::with_capacity(sections.len());
    let mut at = 0;
    for &s in sections {
        if !s.is_multiple_of(p) {
            candle_core::bail!("{}: a section of {s} output features cannot be split over {p} ranks", vb.prefix());
        }
        ranges.push(at + r * s / p..at + (r + 1) * s / p);
        at += s;
    }
    Ok(ranges)
}

/// A linear layer whose output features are split over the group (Megatron's
/// `ColumnParallelLinear`): weight `(out / tp, in)`, bias `out / tp`. Its input is whole; its
/// output is this member's features, or all of them with [`ColumnParallelLinear::gathered`].
///
/// Several layers reading the same input (attention's q, k and v; SwiGLU's gate and up) should
/// share one `f` (Megatron applies it once per block section): build them
/// [`ColumnParallelLinear::input_copied`] and hand each the output of [`copy_to_group`] on the
/// input (or, after a norm, of [`rms_norm_copied`] / [`layer_norm_copied`], which save `f`'s
/// copy too). Otherwise each applies its own: a copy of the input kept per layer for backward and
/// an all-reduce of the input's gradient per layer instead of one.
///
/// ```no_run
/// # fn demo(x: &candle_core::Tensor, vb: candle_nn::VarBuilder, tp: &kolo::tp::TensorParallel) -> candle_core::Result<()> {
/// use candle_core::Module;
/// use kolo::tp::{copy_to_group, ColumnParallelLinear};
/// let q = ColumnParallelLinear::new(256, 256, false, vb.pp("q_proj"), tp)?.input_copied();
/// let k = ColumnParallelLinear::new(256, 128, false, vb.pp("k_proj"), tp)?.input_copied();
/// let x = copy_to_group(x, Some(tp))?; // one f for both
/// let (q, k) = (q.forward(&x)?, k.forward(&x)?);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ColumnParallelLinear {
    inner: candle_nn::Linear,
    tp: TensorParallel,
    gather: bool,
    /// The input is already `f`'s output ([`copy_to_group`]).
    copied: bool,
    /// Whether every member holds as many features (an uneven vocabulary split does not).
    even: bool,
}

impl ColumnParallelLinear {
    /// `inner` (this member's piece) over `tp`, applying its own `f`, its output not gathered.
    fn of(inner: candle_nn::Linear, tp: &TensorParallel, even: bool) -> Self {
        ColumnParallelLinear { inner, tp: tp.clone(), gather: false, even, copied: false }
    }

    /// The layer `in_dim -> out_dim` (`out_dim` must be a multiple of the group's size) with
    /// its variables `weight` and `bias` under `vb`, initialised as `candle_nn::linear`'s.
    pub fn new(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let range = even(&vb.prefix(), "ColumnParallelLinear", out_dim, tp)?;
        let w = piece(&vb, "weight", &[out_dim, in_dim], 0, range.clone(), weight_init(in_dim))?;
        let b = if bias { Some(piece(&vb, "bias", &[out_dim], 0, range, bias_init(in_dim))?) } else { None };
        Ok(Self::of(candle_nn::Linear::new(w, b), tp, true))
    }

    /// A fused layer `in_dim -> sum(sections)` whose output features are `sections` laid end to
    /// end (Phi-3's `qkv_proj`: q, k and v; its `gate_up_proj`: gate and up), each split over
    /// the group: this member's output is its share of every section, in order. Each section
    /// must be a multiple of the group's size.
    pub fn sections(in_dim: usize, sections: &[usize], bias: bool, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let ranges = section_ranges(&vb, sections, tp)?;
        let at = sections.iter().sum();
        let w = pieces(&vb, "weight", &[at, in_dim], 0, ranges.clone(), weight_init(in_dim))?;
        let b = if bias { Some(pieces(&vb, "bias", &[at], 0, ranges, bias_init(in_dim))?) } else { None };
        Ok(Self::of(candle_nn::Linear::new(w, b), tp, true))
    }

    /// As [`ColumnParallelLinear::sections`] for a layer stored in Hugging Face's `Conv1D`
    /// layout (GPT-2's `c_attn` with sections q, k and v, its `c_fc` with one): weight
    /// `(in, out)`, so the piece is cut along dimension 1 of the stored tensor, and a bias.
    pub fn conv1d(in_dim: usize, sections: &[usize], vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let ranges = section_ranges(&vb, sections, tp)?;
        let at = sections.iter().sum();
        let w = pieces(&vb, "weight", &[in_dim, at], 1, ranges.clone(), weight_init(in_dim))?;
        let b = pieces(&vb, "bias", &[at], 0, ranges, bias_init(in_dim))?;
        Ok(Self::of(candle_nn::Linear::new(w.t()?, Some(b)), tp, true))
    }

    /// A language model's output layer `in_dim -> vocab`, without bias, its vocabulary split
    /// as [`VocabParallelEmbedding`] splits it (any size): its output is this member's range of
    /// the logits, for [`vocab_parallel_cross_entropy`] or [`gather_vocab`].
    pub fn lm_head(in_dim: usize, vocab: usize, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let range = vocab_range(vocab, tp.size(), tp.rank());
        let w = piece(&vb, "weight", &[vocab, in_dim], 0, range, weight_init(in_dim))?;
        let even = vocab.is_multiple_of(tp.size());
        Ok(Self::of(candle_nn::Linear::new(w, None), tp, even))
    }

    /// The same layer taking an input that is already Megatron's `f` output ([`copy_to_group`],
    /// applied once for several layers that read the same tensor): it applies none of its own.
    pub fn input_copied(mut self) -> Self {
        self.copied = true;
        self
    }

    /// The same layer returning every member's output features (an all-gather forward, this
    /// member's slice of the gradient backward), as Megatron's `gather_output = True`.
    pub fn gathered(mut self) -> Self {
        self.gather = true;
        self
    }

    /// This member's piece of the weight.
    pub fn weight(&self) -> &Tensor {
        self.inner.weight()
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.tp.size() == 1 {
            return self.inner.forward(x);
        }
        let y = column_parallel(x, self.inner.weight(), self.inner.bias(), self.copied, &self.tp.sum())?;
        if self.gather {
            if !self.even {
                candle_core::bail!("ColumnParallelLinear::gathered: the members hold unequal numbers of features (use gather_vocab)");
            }
            return y.contiguous()?.apply_op1(GatherFromGroup(self.tp.sum()));
        }
        Ok(y)
    }
}

/// Megatron's `f` on `x`, a tensor every member holds whole that feeds this member's share of
/// the work: the same `x` forward, its gradient summed over the group backward (so a
/// parameter every member holds whole before it gets every member's part of the gradient).
/// Only split layers may read its output (a layer every member holds whole would have its
/// identical gradient summed `tp` times); the identity without a group or with one member.
pub fn copy_to_group(x: &Tensor, tp: Option<&TensorParallel>) -> candle_core::Result<Tensor> {
    match tp.filter(|t| t.size() > 1) {
        Some(t) => x.contiguous()?.apply_op1(CopyToGroup(t.sum())),
        None => Ok(x.clone()),
    }
}

/// RMS norm of `x` over its last dimension, scaled by `weight`, then Megatron's `f`
/// ([`copy_to_group`]) as one operation: for a norm whose output feeds only split layers built
/// [`ColumnParallelLinear::input_copied`] (a Llama block's q/k/v, or gate and up). The same
/// values and gradients as the norm followed by `copy_to_group`, without the copy of the
/// normed activations that backward would keep (f32 on the CPU; elsewhere the two steps).
/// Without a group, or with one member, the plain norm.
pub fn rms_norm_copied(x: &Tensor, weight: &Tensor, eps: f64, tp: Option<&TensorParallel>) -> candle_core::Result<Tensor> {
    match tp.filter(|t| t.size() > 1) {
        Some(t) => kolo_tensor::fused::rms_norm_copied(x, weight, eps, &t.sum()),
        None => kolo_tensor::fused::rms_norm(x, weight, eps),
    }
}

/// Layer norm (affine `gamma`, `beta`) followed by Megatron's `f` as one operation, as
/// [`rms_norm_copied`] for the RMS norm (a GPT-2 block's norms before its split layers).
pub fn layer_norm_copied(x: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f64, tp: Option<&TensorParallel>) -> candle_core::Result<Tensor> {
    match tp.filter(|t| t.size() > 1) {
        Some(t) => kolo_tensor::fused::layer_norm_copied(x, gamma, beta, eps, &t.sum()),
        None => kolo_tensor::fused::layer_norm(x, gamma, beta, eps),
    }
}

/// A linear layer whose input features are split over the group (Megatron's
/// `RowParallelLinear`): weight `(out, in / tp)`, the bias whole (added once, after the sum).
/// Its input is this member's features (a [`ColumnParallelLinear`]'s output), or the whole
/// input with [`RowParallelLinear::whole_input`]; its output is whole on every member.
#[derive(Clone, Debug)]
pub struct RowParallelLinear {
    weight: candle_nn::Linear,
    bias: Option<Tensor>,
    tp: TensorParallel,
    scatter: bool,
}

impl RowParallelLinear {
    /// The layer `in_dim -> out_dim` (`in_dim` must be a multiple of the group's size) with
    /// its variables `weight` and `bias` under `vb`, initialised as `candle_nn::linear`'s.
    pub fn new(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let range = even(&vb.prefix(), "RowParallelLinear", in_dim, tp)?;
        let w = piece(&vb, "weight", &[out_dim, in_dim], 1, range, weight_init(in_dim))?;
        let bias = if bias { Some(vb.get_with_hints(out_dim, "bias", bias_init(in_dim))?) } else { None };
        Ok(RowParallelLinear { weight: candle_nn::Linear::new(w, None), bias, tp: tp.clone(), scatter: false })
    }

    /// As [`RowParallelLinear::new`] for a layer stored in Hugging Face's `Conv1D` layout
    /// (GPT-2's `c_proj`s): weight `(in, out)`, cut along dimension 0, and a bias.
    pub fn conv1d(in_dim: usize, out_dim: usize, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let range = even(&vb.prefix(), "RowParallelLinear", in_dim, tp)?;
        let w = piece(&vb, "weight", &[in_dim, out_dim], 0, range, weight_init(in_dim))?;
        let bias = Some(vb.get_with_hints(out_dim, "bias", bias_init(in_dim))?);
        Ok(RowParallelLinear { weight: candle_nn::Linear::new(w.t()?, None), bias, tp: tp.clone(), scatter: false })
    }

    /// The same layer taking the whole input, of which it keeps this member's features
    /// (Megatron's `input_is_parallel = False`).
    pub fn whole_input(mut self) -> Self {
        self.scatter = true;
        self
    }

    /// This member's piece of the weight.
    pub fn weight(&self) -> &Tensor {
        self.weight.weight()
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.tp.size() == 1 {
            let y = self.weight.forward(x)?;
            return match &self.bias {
                Some(b) => y.broadcast_add(b),
                None => Ok(y),
            };
        }
        let x = if self.scatter { x.contiguous()?.apply_op1(ScatterToGroup(self.tp.sum()))? } else { x.clone() };
        // g in place: no copy of the partial product kept for backward.
        row_parallel(&x, self.weight.weight(), self.bias.as_ref(), None, &self.tp.sum())
    }
}

/// A token embedding whose vocabulary is split over the group (Megatron's
/// `VocabParallelEmbedding`): each member holds a contiguous range of the rows (the first
/// `vocab % tp` members one more), looks up the ids in its range and the rows are summed over
/// the group. Takes ids of any shape; returns them with a last dimension of `hidden`.
#[derive(Clone, Debug)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    range: Range<usize>,
    hidden: usize,
    tp: TensorParallel,
}

impl VocabParallelEmbedding {
    /// The embedding of `vocab` ids into `hidden` features with its variable `weight` under
    /// `vb`, initialised as `candle_nn::embedding`'s.
    pub fn new(vocab: usize, hidden: usize, vb: VarBuilder, tp: &TensorParallel) -> candle_core::Result<Self> {
        let range = vocab_range(vocab, tp.size(), tp.rank());
        let weight = piece(&vb, "weight", &[vocab, hidden], 0, range.clone(), Init::Randn { mean: 0.0, stdev: 1.0 })?;
        Ok(VocabParallelEmbedding { weight, range, hidden, tp: tp.clone() })
    }

    /// The ids whose rows this member holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The output layer tied to this embedding (`tie_word_embeddings`): this member's range of
    /// the logits, `x` times its rows transposed (the input's gradient summed over the group).
    pub fn tied_logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if self.tp.size() == 1 { x.clone() } else { x.contiguous()?.apply_op1(CopyToGroup(self.tp.sum()))? };
        x.broadcast_matmul(&self.weight.t()?)
    }
}

/// The whole logits `(.., vocab)` on every member from each member's range `(.., range)`
/// (evaluation, generation; not differentiable). Collective over `tp`.
pub fn gather_vocab(logits: &Tensor, vocab: usize, tp: &TensorParallel) -> candle_core::Result<Tensor> {
    if tp.size() == 1 {
        return Ok(logits.clone());
    }
    let width = logits.dims().last().copied().unwrap_or(0);
    let whole = gather_logits(&logits.reshape(((), width))?, vocab, &*tp.sum())
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?
        .to_dtype(logits.dtype())?;
    let mut shape = logits.dims().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = vocab;
    }
    whole.reshape(shape)
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let flat = ids.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
        let e = embed(&flat, &self.weight, self.range.clone(), &self.tp.sum()).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut shape = ids.dims().to_vec();
        shape.push(self.hidden);
        e.reshape(shape)
    }
}

/// The mean cross-entropy of logits whose vocabulary is split over the group (a
/// [`ColumnParallelLinear`] head's output: `(.., vocab / tp)`, this member's range of the
/// `vocab` classes) against `targets` (class ids, one per row of `logits`), equal on every
/// member, without gathering the logits (Megatron's `vocab_parallel_cross_entropy`: three small
/// all-reduces of per-row values).
pub fn vocab_parallel_cross_entropy(logits: &Tensor, targets: &Tensor, vocab: usize, tp: &TensorParallel) -> candle_core::Result<Tensor> {
    let width = logits.dims().last().copied().unwrap_or(0);
    let range = vocab_range(vocab, tp.size(), tp.rank());
    if width != range.len() {
        candle_core::bail!(
            "vocab_parallel_cross_entropy: logits of width {width}, but member {} of {} holds {} of the {vocab} classes",
            tp.rank(),
            tp.size(),
            range.len()
        );
    }
    let rows = logits.reshape(((), width))?;
    let t = targets.flatten_all()?.to_dtype(candle_core::DType::U32)?.to_vec1::<u32>()?;
    if let Some(bad) = t.iter().find(|&&c| c as usize >= vocab) {
        candle_core::bail!("vocab_parallel_cross_entropy: target {bad} is outside the vocabulary of {vocab}");
    }
    vocab_ce(&rows, &t, range, &tp.sum()).map_err(|e| candle_core::Error::Msg(e.to_string()))
}

/// The tensor `name` of mapped safetensors files, read for `var`: only this rank's piece of it
/// (the bytes of its slice, nothing else) when `var` is split and the file holds it whole.
/// `None` when the files lack it.
pub(crate) fn read_for(
    st: &candle_core::safetensors::MmapedSafetensors,
    name: &str,
    var: &candle_core::Var,
) -> candle_core::Result<Option<Tensor>> {
    use safetensors::slice::TensorIndexer;
    use std::ops::Bound;
    let Ok(view) = st.get(name) else { return Ok(None) };
    let Some(s) = split_of(var.as_tensor()).filter(|s| view.shape() == s.whole) else {
        return st.load(name, var.device()).map(Some);
    };
    let one = std::num::NonZeroUsize::MIN;
    let dtype = match view.dtype() {
        safetensors::Dtype::F32 => candle_core::DType::F32,
        safetensors::Dtype::F16 => candle_core::DType::F16,
        safetensors::Dtype::BF16 => candle_core::DType::BF16,
        safetensors::Dtype::F64 => candle_core::DType::F64,
        d => candle_core::bail!("`{name}`: a {d:?} tensor cannot fill a parameter"),
    };
    // Each range's slice read on its own, then laid end to end along the cut dimension.
    let mut parts = Vec::with_capacity(s.ranges.len());
    for r in &s.ranges {
        let index: Vec<TensorIndexer> = (0..s.whole.len())
            .map(|d| match d == s.dim {
                true => TensorIndexer::Narrow(Bound::Included(r.start), Bound::Excluded(r.end), one),
                false => TensorIndexer::Narrow(Bound::Unbounded, Bound::Unbounded, one),
            })
            .collect();
        let chunks = view.sliced_data(&index).map_err(|e| candle_core::Error::Msg(format!("`{name}`: {e:?}")))?;
        let bytes: Vec<u8> = chunks.flat_map(|c| c.iter().copied()).collect();
        let mut shape = s.whole.clone();
        shape[s.dim] = r.len();
        parts.push(Tensor::from_raw_buffer(&bytes, dtype, &shape, var.device())?);
    }
    Tensor::cat(&parts, s.dim).map(Some)
}

/// Collective over `tp`: on member 0, a VarMap of whole tensors under the same names (the
/// split variables put together from every member's piece, reduced to it; the others copied);
/// `None` on the other members. `Mesh::whole_varmap` adds the other pipeline stages'.
pub(crate) fn whole_varmap(varmap: &VarMap, tp: &TensorParallel) -> Result<Option<VarMap>> {
    let mut vars: Vec<(String, candle_core::Var)> =
        varmap.data().lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let lead = tp.rank() == 0;
    let out = VarMap::new();
    for (name, var) in vars {
        let t = match split_of(var.as_tensor()).filter(|s| !s.is_whole()) {
            Some(s) => {
                let mut whole = vec![0f32; s.whole.iter().product()];
                let local = var.as_tensor().to_dtype(candle_core::DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                s.whole_indices().zip(&local).for_each(|(k, v)| whole[k] = *v);
                tp.comm().reduce(kolo_comm::BufMut::from(&mut whole[..]), kolo_comm::ReduceOp::Sum, kolo_base::Rank(0))?;
                if !lead {
                    continue;
                }
                Tensor::from_vec(whole, s.whole.clone(), var.device())?.to_dtype(var.dtype())?
            }
            None if lead => var.as_tensor().copy()?,
            None => continue,
        };
        out.data().lock().unwrap_or_else(|p| p.into_inner()).insert(name, candle_core::Var::from_tensor(&t)?);
    }
    Ok(lead.then_some(out))
}

/// Fills every variable of `varmap` from safetensors `files` of whole tensors under the same
/// names (a Hugging Face checkpoint, a `VarMap::save`): this rank's piece of a split variable,
/// the whole tensor of the others, converted to the variable's dtype. Fails naming the
/// variables the files lack or hold in another shape. Returns how many were filled.
pub fn load_safetensors(varmap: &VarMap, files: &[impl AsRef<Path>]) -> Result<usize> {
    let first = files.first().map(|f| f.as_ref().to_path_buf()).unwrap_or_default();
    // SAFETY: the files are mapped read-only and must not change while they are read, as for
    // candle's own `VarBuilder::from_mmaped_safetensors`.
    let st = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files) }.map_err(|e| Error::file(&first, e))?;
    let vars: Vec<(String, candle_core::Var)> =
        varmap.data().lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    let mut missing = Vec::new();
    for (name, var) in &vars {
        let Some(t) = read_for(&st, name, var)? else {
            missing.push(name.clone());
            continue;
        };
        if t.dims() != var.dims() {
            return Err(Error::file(&first, format!("`{name}` is {:?} in the files, the model's variable is {:?}", t.dims(), var.dims())));
        }
        var.set(&t.to_dtype(var.dtype())?)?;
    }
    if !missing.is_empty() {
        missing.sort();
        return Err(Error::file(&first, format!("lacks {} of the model's variables: {}", missing.len(), missing.join(", "))));
    }
    Ok(vars.len())
}

/// The trainer's view of a model split over ranks, by tensor parallelism (its variables cut
/// into pieces) or pipeline stages (each stage holding its own variables): the whole model's
/// layout, which checkpoints hold under the model's names, and where this rank's parameters lie
/// in it.
pub(crate) struct WholeLayout {
    /// Per local parameter (the trainer's order): how it is cut, `None` when held whole.
    splits: Vec<Option<Split>>,
    /// Per local parameter: where it starts in the whole model's flat layout, and its local range.
    at: Vec<(usize, Range<usize>)>,
    /// Per local parameter: its name.
    names: Vec<String>,
    /// The whole model's parameters, `(name, shape)`, in the order one process would have them.
    pub(crate) signature: Vec<(String, Vec<usize>)>,
    pub(crate) numel: usize,
    /// The groups the whole model is spread over: tensor parallelism, then the groups whose
    /// members hold different parameters (an expert-parallel group's experts, then the
    /// pipeline's stages), innermost first.
    tp: Option<TensorParallel>,
    levels: Vec<Level>,
    /// Per local parameter: a copy of a parameter another member of one of the levels holds
    /// too and owns (checkpoints, the norm and exports take that one).
    copies: Vec<bool>,
}

/// One group of [`WholeLayout`] whose members hold different parameters.
struct Level {
    comm: Arc<dyn Communicator>,
    /// The level's group times the data-parallel replicas of each member (`pp x dp x sp` for
    /// the pipeline), where ZeRO's shards of a tied parameter are summed when the members
    /// hold different parts of it.
    wide: Option<Arc<dyn Communicator>>,
    /// Under ZeRO-2/3, whether the members' shards of the tied parameters differ (the tied
    /// gradients then sum whole over `wide`): fixed by the layout, agreed on at the first step.
    shards_differ: std::sync::OnceLock<bool>,
    /// Per local parameter: a copy here of a parameter an earlier member owns.
    copies: Vec<bool>,
    /// The parameters several members hold (tied across stages; held by every member of an
    /// expert-parallel group), the same list on every member: `(name, elements of this rank's
    /// piece)`, and where this rank holds each (its local index).
    tied: Vec<(String, usize, Option<usize>)>,
}

/// A level's group, and its members' replicas together when known ([`Level::wide`]).
pub(crate) type StageGroup = (Arc<dyn Communicator>, Option<Arc<dyn Communicator>>);

/// A layout's error as the update's.
fn train_err(e: Error) -> kolo_train::TrainError {
    match e {
        Error::Comm(c) => kolo_train::TrainError::Comm(c),
        e => kolo_train::TrainError::Other(e.to_string()),
    }
}

impl WholeLayout {
    /// The layout of `params`, given each parameter's variable id (`ids`: id to index) and
    /// the order one process keeps parameters in (`order`: a sort key of a name). A variable
    /// made by a layer of a group of one is not split. Over `stages` (groups whose members hold
    /// different parameters, innermost first: an expert-parallel group, then the pipeline, each
    /// with its members' replicas together when known), collective: the members' parameters
    /// together, each name once.
    pub(crate) fn new(
        params: &kolo_tensor::ParamSet,
        ids: &HashMap<TensorId, usize>,
        tp: Option<TensorParallel>,
        stages: Vec<StageGroup>,
        order: impl Fn(&str) -> Vec<(String, u64)>,
    ) -> Result<WholeLayout> {
        let mut splits = vec![None; params.len()];
        for (id, &i) in ids {
            let s = SPLITS.lock().unwrap_or_else(|p| p.into_inner()).as_ref().and_then(|m| m.get(id).cloned());
            splits[i] = s.filter(|s| !s.is_whole());
        }
        let mine: Vec<(String, Vec<usize>)> = params
            .iter()
            .zip(&splits)
            .map(|(p, s)| (p.name.clone(), s.as_ref().map_or_else(|| p.shape.clone(), |s| s.whole.clone())))
            .collect();
        let local_numel: HashMap<&str, usize> = params.iter().map(|p| (p.name.as_str(), p.range.len())).collect();
        let mut signature = mine;
        let mut levels = Vec::new();
        let mut copies = vec![false; params.len()];
        for (comm, wide) in stages {
            // A name this rank does not hold (another member's, one level in) counts whole.
            let pieces: Vec<usize> =
                signature.iter().map(|(n, s)| local_numel.get(n.as_str()).copied().unwrap_or(s.iter().product())).collect();
            let (next, owners) = stages_signature(&*comm, &signature, &pieces)?;
            let me = comm.rank().get();
            let here: Vec<bool> = params.iter().map(|p| owners.iter().any(|(n, owner, _)| *n == p.name && *owner != me)).collect();
            copies.iter_mut().zip(&here).for_each(|(c, h)| *c |= *h);
            let tied = owners.into_iter().map(|(n, _, len)| (n.clone(), len, params.iter().position(|p| p.name == n))).collect();
            levels.push(Level { comm, wide, shards_differ: std::sync::OnceLock::new(), copies: here, tied });
            signature = next;
        }
        signature.sort_by_cached_key(|(n, _)| order(n));
        let mut offset = HashMap::new();
        let mut numel = 0;
        for (name, shape) in &signature {
            offset.insert(name.clone(), numel);
            numel += shape.iter().product::<usize>();
        }
        let at = params.iter().map(|p| (offset[&p.name], p.range.clone())).collect();
        let names = params.iter().map(|p| p.name.clone()).collect();
        Ok(WholeLayout { splits, at, names, signature, numel, tp, levels, copies })
    }

    /// Parameters tied across pipeline stages, or held by every member of an expert-parallel
    /// group (the same on every member).
    pub(crate) fn has_tied(&self) -> bool {
        self.levels.iter().any(|l| !l.tied.is_empty())
    }

    /// Collective over `level`'s group: every member holding a tied parameter gets the sum of
    /// their values of `get(i)` (each member's part of its gradient), through `set(i, sum)`.
    fn sum_tied(level: &Level, mut get: impl FnMut(usize) -> Vec<f32>, mut set: impl FnMut(usize, &[f32]) -> Result<()>) -> Result<()> {
        if level.tied.is_empty() {
            return Ok(());
        }
        let mut buf = vec![0f32; level.tied.iter().map(|(_, n, _)| n).sum()];
        let mut at = 0;
        for (_, n, local) in &level.tied {
            if let Some(i) = local {
                buf[at..at + n].copy_from_slice(&get(*i));
            }
            at += n;
        }
        level.comm.all_reduce(kolo_comm::BufMut::from(&mut buf[..]), kolo_comm::ReduceOp::Sum)?;
        let mut at = 0;
        for (_, n, local) in &level.tied {
            if let Some(i) = local {
                set(*i, &buf[at..at + n])?;
            }
            at += n;
        }
        Ok(())
    }

    /// Collective over each level's group: a tied parameter's gradient becomes the sum of every
    /// member's part (Megatron's embedding all-reduce over the pipeline; the parameters every
    /// member of an expert-parallel group holds), the same on each. Under ZeRO-2/3 (this rank's
    /// pieces only) members holding the same part of each tied parameter (the members of an
    /// expert-parallel group: their layouts match) sum their parts over the level's group;
    /// pipeline stages that cut a tied embedding into different shards (their sizes differ)
    /// sum it whole over every stage's replicas, each rank adding its part and zeros elsewhere
    /// (on each stage every element is in exactly one replica's shard).
    /// [`WholeLayout::reduce_tied`] of a local step's whole gradient `grads` (each parameter
    /// at its range).
    pub(crate) fn reduce_tied_flat(
        &self,
        grads: &mut [f32],
        ranges: &[std::ops::Range<usize>],
    ) -> std::result::Result<(), kolo_train::TrainError> {
        let grads = std::cell::RefCell::new(grads);
        for level in self.levels.iter().filter(|l| !l.tied.is_empty()) {
            Self::sum_tied(
                level,
                |i| grads.borrow()[ranges[i].clone()].to_vec(),
                |i, v| {
                    grads.borrow_mut()[ranges[i].clone()].copy_from_slice(v);
                    Ok(())
                },
            )
            .map_err(train_err)?;
        }
        Ok(())
    }

    pub(crate) fn reduce_tied(&self, grads: &mut kolo_ddp::BucketGrads<'_>) -> std::result::Result<(), kolo_train::TrainError> {
        for level in self.levels.iter().filter(|l| !l.tied.is_empty()) {
            if grads.whole() {
                let grads = std::cell::RefCell::new(&mut *grads);
                Self::sum_tied(
                    level,
                    |i| grads.borrow_mut().param_part_mut(i).1.to_vec(),
                    |i, v| {
                        grads.borrow_mut().param_part_mut(i).1.copy_from_slice(v);
                        Ok(())
                    },
                )
                .map_err(train_err)?;
                continue;
            }
            // This rank's part of each tied parameter: (start in the parameter, length).
            let parts: Vec<(usize, usize)> = level
                .tied
                .iter()
                .map(|(_, _, local)| {
                    local.map_or((0, 0), |i| {
                        let (at, v) = grads.param_part_mut(i);
                        (at, v.len())
                    })
                })
                .collect();
            let differ = match level.shards_differ.get() {
                Some(d) => *d,
                None => {
                    let d = Self::shards_differ(level, &parts)?;
                    *level.shards_differ.get_or_init(|| d)
                }
            };
            if differ {
                match &level.wide {
                    Some(wide) => Self::sum_tied_whole(level, wide, &parts, grads)?,
                    None => {
                        return Err(kolo_train::TrainError::Config(
                            "ZeRO-2/3 with a parameter several members of a group hold whose shards differ between them (and no group of their replicas to sum it over) is not supported: use ZeRO-1".into(),
                        ))
                    }
                }
                continue;
            }
            let mut buf: Vec<f32> = Vec::with_capacity(parts.iter().map(|p| p.1).sum());
            for (_, _, local) in &level.tied {
                if let Some(i) = local {
                    buf.extend_from_slice(grads.param_part_mut(*i).1);
                }
            }
            level.comm.all_reduce(kolo_comm::BufMut::from(&mut buf[..]), kolo_comm::ReduceOp::Sum)?;
            let mut at = 0;
            for (_, _, local) in &level.tied {
                if let Some(i) = local {
                    let part = grads.param_part_mut(*i).1;
                    let n = part.len();
                    part.copy_from_slice(&buf[at..at + n]);
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// Collective over `level`'s group (and its `wide` group): whether any member holds other
    /// parts (`parts`: start and length of this rank's shard of each tied parameter) than the
    /// others; with `wide`, any in any replica, so that every rank takes the same way.
    fn shards_differ(level: &Level, parts: &[(usize, usize)]) -> std::result::Result<bool, kolo_train::TrainError> {
        let mine: Vec<i64> = parts.iter().flat_map(|&(a, n)| [a as i64, n as i64]).collect();
        let (mut hi, mut lo) = (mine.clone(), mine.iter().map(|x| -x).collect::<Vec<i64>>());
        level.comm.all_reduce(kolo_comm::BufMut::from(&mut hi[..]), kolo_comm::ReduceOp::Max)?;
        level.comm.all_reduce(kolo_comm::BufMut::from(&mut lo[..]), kolo_comm::ReduceOp::Max)?;
        let differ = hi != mine || lo.iter().zip(&mine).any(|(l, m)| -l != *m);
        let Some(wide) = &level.wide else { return Ok(differ) };
        let mut any = [u8::from(differ)];
        wide.all_reduce(kolo_comm::BufMut::from(&mut any[..]), kolo_comm::ReduceOp::Max)?;
        Ok(any[0] > 0)
    }

    /// Collective over `wide` (the level's members and their replicas): each tied parameter's
    /// gradient summed whole, every rank adding its part (`parts`: start and length in the
    /// parameter) at its place and zeros elsewhere, then taking its part of the sum back.
    fn sum_tied_whole(
        level: &Level,
        wide: &Arc<dyn Communicator>,
        parts: &[(usize, usize)],
        grads: &mut kolo_ddp::BucketGrads<'_>,
    ) -> std::result::Result<(), kolo_train::TrainError> {
        let mut buf = vec![0f32; level.tied.iter().map(|(_, n, _)| n).sum()];
        let mut at = 0;
        for ((_, n, local), &(start, len)) in level.tied.iter().zip(parts) {
            if let Some(i) = local {
                buf[at + start..at + start + len].copy_from_slice(grads.param_part_mut(*i).1);
            }
            at += n;
        }
        wide.all_reduce(kolo_comm::BufMut::from(&mut buf[..]), kolo_comm::ReduceOp::Sum)?;
        let mut at = 0;
        for ((_, n, local), &(start, len)) in level.tied.iter().zip(parts) {
            if let Some(i) = local {
                grads.param_part_mut(*i).1.copy_from_slice(&buf[at + start..at + start + len]);
            }
            at += n;
        }
        Ok(())
    }

    /// Collective over the pipeline group: each copy of a tied parameter takes the value its
    /// owner (the first stage holding it) has.
    pub(crate) fn init_tied(&self, params: &kolo_tensor::ParamSet) -> Result<()> {
        let at = &self.at;
        for level in &self.levels {
            let flat = params.to_flat()?;
            let copies = &level.copies;
            Self::sum_tied(
                level,
                |i| if copies[i] { vec![0.0; at[i].1.len()] } else { flat[at[i].1.clone()].to_vec() },
                |i, v| Ok(params.load_one(i, v)?),
            )?;
        }
        Ok(())
    }

    /// A parameter of this rank that is split over a tensor-parallel group.
    pub(crate) fn any_split(&self) -> Option<&str> {
        self.splits.iter().zip(&self.names).find(|(s, _)| s.is_some()).map(|(_, n)| n.as_str())
    }

    /// Per parameter: whether this rank counts its square in the norm summed over the
    /// model-parallel group: its tensor-parallel pieces, and its parameters held whole when it is
    /// member 0 of its tensor-parallel group (each stage's own parameters count on its stage).
    pub(crate) fn split_flags(&self) -> Vec<bool> {
        let lead = self.tp.as_ref().is_none_or(|t| t.rank() == 0);
        self.splits.iter().zip(&self.copies).map(|(s, copy)| (s.is_some() || lead) && !copy).collect()
    }

    /// Collective over the groups: the whole model's values from every rank's `local` values
    /// (in the trainer's flat layout): each rank places its pieces (member 0 of a
    /// tensor-parallel group its whole parameters), and the groups sum.
    pub(crate) fn gather(&self, local: &[f32]) -> Result<Vec<f32>> {
        let mut whole = vec![0f32; self.numel];
        let lead = self.tp.as_ref().is_none_or(|t| t.rank() == 0);
        for (((start, range), split), copy) in self.at.iter().zip(&self.splits).zip(&self.copies) {
            if *copy {
                continue; // the owner's stage places it
            }
            let v = &local[range.clone()];
            match split {
                Some(s) => s.whole_indices().zip(v).for_each(|(k, x)| whole[start + k] = *x),
                None if lead => whole[*start..start + v.len()].copy_from_slice(v),
                None => {}
            }
        }
        for comm in self.tp.as_ref().map(|t| t.comm()).into_iter().chain(self.levels.iter().map(|l| &l.comm)) {
            comm.all_reduce(kolo_comm::BufMut::from(&mut whole[..]), kolo_comm::ReduceOp::Sum)?;
        }
        Ok(whole)
    }

    /// Whether this rank writes the whole model (member 0 of its tensor-parallel group, on
    /// the first stage).
    pub(crate) fn writes(&self) -> bool {
        self.tp.as_ref().is_none_or(|t| t.rank() == 0) && self.levels.iter().all(|l| l.comm.rank().get() == 0)
    }

    /// This rank's values (the trainer's flat layout) of the whole model's `whole`.
    pub(crate) fn local(&self, whole: &[f32]) -> Vec<f32> {
        let mut out = vec![0f32; self.at.last().map_or(0, |(_, r)| r.end)];
        for ((start, range), split) in self.at.iter().zip(&self.splits) {
            match split {
                Some(s) => out[range.clone()].iter_mut().zip(s.whole_indices()).for_each(|(x, k)| *x = whole[start + k]),
                None => out[range.clone()].copy_from_slice(&whole[*start..start + range.len()]),
            }
        }
        out
    }

    /// The whole model as parameters of their whole shapes holding `whole`.
    pub(crate) fn param_set(&self, whole: &[f32]) -> Result<kolo_tensor::ParamSet> {
        let mut ps = kolo_tensor::ParamSet::new();
        let mut at = 0;
        for (name, shape) in &self.signature {
            let n: usize = shape.iter().product();
            ps.add(name, shape, whole[at..at + n].to_vec())?;
            at += n;
        }
        Ok(ps)
    }

    /// Collective over the tensor-parallel group: member 0's values of the parameters every
    /// member holds whole (norms, row-parallel biases, unsplit layers) become everyone's, as
    /// DDP's first broadcast does.
    pub(crate) fn broadcast_whole(&self, params: &kolo_tensor::ParamSet) -> Result<()> {
        let Some(tp) = &self.tp else { return Ok(()) };
        let whole: Vec<usize> = (0..params.len()).filter(|&i| self.splits[i].is_none()).collect();
        let flat = params.to_flat()?;
        let mut buf: Vec<f32> = whole.iter().flat_map(|&i| flat[self.at[i].1.clone()].iter().copied()).collect();
        tp.comm().broadcast(kolo_comm::BufMut::from(&mut buf[..]), kolo_base::Rank(0))?;
        let mut at = 0;
        for &i in &whole {
            let n = self.at[i].1.len();
            params.load_one(i, &buf[at..at + n])?;
            at += n;
        }
        Ok(())
    }
}

/// The tied parameters of [`stages_signature`]: `(name, owner stage, elements of a piece)`.
type Tied = Vec<(String, usize, usize)>;
/// The whole model's parameters, `(name, whole shape)`.
type Signature = Vec<(String, Vec<usize>)>;

/// Collective over the pipeline group: every stage's parameters `(name, whole shape)`, each
/// name once, and those several stages hold (tied, as an output layer that is the embedding):
/// the first stage holding one owns it. A name on several stages must have the same shape and
/// piece on each.
fn stages_signature(pp: &dyn Communicator, mine: &[(String, Vec<usize>)], local: &[usize]) -> Result<(Signature, Tied)> {
    let text: String = mine
        .iter()
        .zip(local)
        .map(|((n, s), k)| format!("{n}\t{}\t{k}\n", s.iter().map(usize::to_string).collect::<Vec<_>>().join(",")))
        .collect();
    let k = pp.world_size().get();
    let mut lens = vec![0i64; k];
    pp.all_gather(kolo_comm::BufRef::from(&[text.len() as i64][..]), kolo_comm::BufMut::from(&mut lens[..]))?;
    let max = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut padded = text.into_bytes();
    padded.resize(max, 0);
    let mut all = vec![0u8; max * k];
    pp.all_gather(kolo_comm::BufRef::from(&padded[..]), kolo_comm::BufMut::from(&mut all[..]))?;
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    let mut owner: HashMap<String, (usize, Vec<usize>, usize)> = HashMap::new();
    let mut tied: Tied = Vec::new();
    for (stage, chunk) in all.chunks(max.max(1)).take(k).enumerate() {
        let text = String::from_utf8_lossy(&chunk[..lens[stage].max(0) as usize]).into_owned();
        for line in text.lines() {
            let mut fields = line.split('\t');
            let (name, dims, piece) = (fields.next().unwrap_or(""), fields.next().unwrap_or(""), fields.next().unwrap_or("0"));
            let shape: Vec<usize> = dims.split(',').filter(|d| !d.is_empty()).map(|d| d.parse().unwrap_or(0)).collect();
            let piece: usize = piece.parse().unwrap_or(0);
            match owner.get(name) {
                Some((first, s, p)) if *s == shape && *p == piece => {
                    // Tied: one parameter, the first stage's, with copies on later ones.
                    if !tied.iter().any(|(n, _, _)| n == name) {
                        tied.push((name.to_string(), *first, piece));
                    }
                }
                Some((first, s, _)) => {
                    return Err(Error::usage(
                        pp.rank().get(),
                        "Trainer::with_mesh",
                        format!("`{name}` is a parameter of pipeline stages {first} ({s:?}) and {stage} ({shape:?}): a parameter two stages share (tied) must be the same there"),
                    ))
                }
                None => {
                    owner.insert(name.to_string(), (stage, shape.clone(), piece));
                    out.push((name.to_string(), shape));
                }
            }
        }
    }
    tied.sort();
    Ok((out, tied))
}

#[cfg(test)]
mod tests {
    use super::Split;

    /// The piece's elements map to the whole tensor's: rows 2..4 of a 5 x 3 matrix, columns
    /// 1..3 of a 2 x 4 one, the middle of a 2 x 3 x 2 block along its middle dimension.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one range: the usual split
    fn a_piece_maps_to_its_place_in_the_whole_tensor() {
        let rows = Split { whole: vec![5, 3], dim: 0, ranges: vec![2..4] };
        assert_eq!(rows.whole_indices().collect::<Vec<_>>(), [6, 7, 8, 9, 10, 11]);
        let cols = Split { whole: vec![2, 4], dim: 1, ranges: vec![1..3] };
        assert_eq!(cols.whole_indices().collect::<Vec<_>>(), [1, 2, 5, 6]);
        let mid = Split { whole: vec![2, 3, 2], dim: 1, ranges: vec![1..2] };
        assert_eq!(mid.whole_indices().collect::<Vec<_>>(), [2, 3, 8, 9]);
        let empty = Split { whole: vec![0, 4], dim: 1, ranges: vec![0..2] };
        // A fused layer's rows in three sections of 2, member 1 of 2: the second row of each.
        let fused = Split { whole: vec![6, 2], dim: 0, ranges: vec![1..2, 3..4, 5..6] };
        assert_eq!(fused.whole_indices().collect::<Vec<_>>(), [2, 3, 6, 7, 10, 11]);
        assert!(!fused.is_whole() && fused.len() == 3);
        assert_eq!(empty.whole_indices().count(), 0);
    }

    /// `mark_split` records a variable's split for the trainer (`split_of` returns it), and
    /// refuses a computed tensor and a variable whose shape is not the split's piece, naming
    /// both shapes.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one range: the usual split
    fn mark_split_records_a_variables_piece_and_refuses_what_does_not_fit() {
        use candle_core::{Device, Var};
        let split = Split { whole: vec![6, 2], dim: 0, ranges: vec![1..2, 3..4, 5..6] };
        let var = Var::zeros((3, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(super::split_of(var.as_tensor()), None);
        super::mark_split(var.as_tensor(), split.clone()).unwrap();
        assert_eq!(super::split_of(var.as_tensor()), Some(split.clone()));
        let wrong = Var::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap();
        let e = super::mark_split(wrong.as_tensor(), split.clone()).unwrap_err().to_string();
        assert!(e.contains("a variable of shape [2, 2] is not the piece [1..2, 3..4, 5..6] of [6, 2] along dimension 0"), "{e}");
        let beyond = Split { whole: vec![2, 2], dim: 0, ranges: vec![1..3] };
        assert!(super::mark_split(wrong.as_tensor(), beyond).is_err(), "a range past the whole tensor");
        let computed = (var.as_tensor() + 1.0).unwrap();
        let e = super::mark_split(&computed, split).unwrap_err().to_string();
        assert!(e.contains("not for a computed tensor"), "{e}");
    }

    /// A mesh that does not cover the job, or names an axis a user's model cannot be split
    /// along yet, is a one-line error naming the numbers.
    #[test]
    fn a_mesh_must_cover_the_job_with_known_axes() {
        let dist = crate::init().unwrap();
        let e = crate::Mesh::new(&dist, &[("dp", 2), ("tp", 2)]).unwrap_err().to_string();
        assert_eq!(e, "mesh: pp 1 x dp 2 x ep 1 x sp 1 x tp 2 = 4 ranks, but the job has 1");
        let e = crate::Mesh::new(&dist, &[("cp", 1)]).unwrap_err().to_string();
        assert!(e.starts_with("mesh: axis `cp`: a user's model is split along `pp`, `dp`, `ep`, `sp` and `tp`"), "{e}");
        let e = crate::Mesh::new(&dist, &[("tp", 1), ("dp", 1)]).unwrap_err().to_string();
        assert!(e.contains("in the order pp, dp, ep, sp, tp"), "{e}");
        let m = crate::Mesh::new(&dist, &[("tp", 1)]).unwrap();
        assert_eq!((m.size("dp"), m.size("tp"), m.tp().size(), m.dp().world_size().get()), (1, 1, 1, 1));
    }
}
