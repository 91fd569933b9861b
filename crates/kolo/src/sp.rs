//! Sequence parallelism for your own candle model (ring attention; Megatron's context
//! parallelism): the ranks along a [`crate::Mesh`]'s `sp` axis each hold one contiguous chunk
//! of every sequence, and every layer but attention runs on the chunk alone. Causal attention
//! of a chunk's queries needs the keys and values of its own and every earlier chunk:
//! [`ring_attention`] passes the key/value blocks around the group and folds each visible one
//! in with a running softmax (as flash attention does); backward passes them around again with
//! their gradients. Activation memory per rank falls with the group's size.
//!
//! ```no_run
//! # use candle_core::Tensor;
//! # fn main() -> kolo::Result<()> {
//! # let dist = kolo::init()?;
//! let mesh = kolo::Mesh::new(&dist, &[("sp", dist.world_size())])?;
//! let sp = mesh.sp();
//! # let ids = Tensor::zeros((2, 64), candle_core::DType::U32, &dist.device())?;
//! let mine = sp.chunk(&ids, 1)?; // (2, 64 / sp) tokens, from position sp.offset(64)
//! # let (q, k, v) = (Tensor::zeros((2, 4, 32, 16), candle_core::DType::F32, &dist.device())?,
//! #     Tensor::zeros((2, 4, 32, 16), candle_core::DType::F32, &dist.device())?,
//! #     Tensor::zeros((2, 4, 32, 16), candle_core::DType::F32, &dist.device())?);
//! // .. embed `mine`, rotate q and k by their global positions ..
//! let y = kolo::sp::ring_attention(&q, &k, &v, sp)?; // (batch, heads, chunk, head dim)
//! # let _ = (mine, y); Ok(()) }
//! ```
//!
//! The ranks of a sequence-parallel group hold the same parameters: `Trainer::with_mesh`
//! averages gradients over `dp x sp`, so the loss each rank returns is the mean over its chunk.

use candle_core::Tensor;
use kolo_comm::{Communicator, Ring};
use kolo_tensor::models::ring::RingAttention;
use std::sync::Arc;

/// A sequence-parallel group ([`crate::Mesh::sp`]): its members hold consecutive chunks of
/// every sequence, member `r` the `r`-th.
#[derive(Clone)]
pub struct SequenceParallel {
    ring: Arc<Ring>,
}

impl std::fmt::Debug for SequenceParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SequenceParallel {{ rank: {}, size: {} }}", self.rank(), self.size())
    }
}

impl SequenceParallel {
    /// The group of `comm`'s ranks.
    pub fn new(comm: Arc<dyn Communicator>) -> SequenceParallel {
        SequenceParallel { ring: Arc::new(Ring(comm)) }
    }
    /// This rank's index in the group: which chunk it holds.
    pub fn rank(&self) -> usize {
        self.ring.0.rank().get()
    }
    /// The group's size: the chunks of a sequence.
    pub fn size(&self) -> usize {
        self.ring.0.world_size().get()
    }
    /// The group's communicator.
    pub(crate) fn comm(&self) -> &Arc<dyn Communicator> {
        &self.ring.0
    }
    /// This member's chunk of `t` along `dim` (a sequence dimension that must split evenly).
    pub fn chunk(&self, t: &Tensor, dim: usize) -> candle_core::Result<Tensor> {
        let (n, p) = (t.dim(dim)?, self.size());
        if !n.is_multiple_of(p) {
            candle_core::bail!("a sequence of {n} does not split into {p} equal sequence-parallel chunks");
        }
        t.narrow(dim, self.rank() * (n / p), n / p)
    }
    /// Collective over the group: `v` summed element by element over every member (counts
    /// each member gathered over its own chunk; no gradient).
    pub fn sum(&self, v: &mut [f32]) -> candle_core::Result<()> {
        self.ring
            .0
            .all_reduce(kolo_comm::BufMut::from(v), kolo_comm::ReduceOp::Sum)
            .map_err(|e| candle_core::Error::Msg(format!("sequence-parallel sum: {e}")))
    }
    /// Where this member's chunk of a sequence of `len` starts (its first position).
    pub fn offset(&self, len: usize) -> usize {
        self.rank() * (len / self.size())
    }
}

/// Causal attention of this member's queries over the keys and values of its own and every
/// earlier member's chunk: `q`, `k` and `v` are (batch, heads, chunk, head dim) (key and value
/// heads repeated to the query heads), scaled by 1 / sqrt(head dim). Computed in f32 (bf16 and
/// f16 inputs are widened, the output rounded back to their dtype once, as flash attention
/// accumulates). Collective over the group, in forward and backward.
pub fn ring_attention(q: &Tensor, k: &Tensor, v: &Tensor, sp: &SequenceParallel) -> candle_core::Result<Tensor> {
    let d = q.dim(3)?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        candle_core::bail!("ring_attention: q {:?}, k {:?} and v {:?} must have one shape", q.dims(), k.dims(), v.dims());
    }
    let scale = 1.0 / (d as f32).sqrt();
    let f32 = |t: &Tensor| t.to_dtype(candle_core::DType::F32)?.contiguous();
    f32(q)?.apply_op3(&f32(k)?, &f32(v)?, RingAttention::new(sp.ring.clone(), scale))?.to_dtype(q.dtype())
}
