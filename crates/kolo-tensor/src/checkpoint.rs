//! Activation checkpointing for any candle code, as `torch.utils.checkpoint` does it: a block
//! runs forward without keeping what it computed inside, and runs again in backward, with a
//! graph, to differentiate it. Less memory (one input kept per block instead of every
//! intermediate) for about one more forward pass.
//!
//! The block is a closure over the model's own layers; its parameters are found, not named:
//! the forward's graph is walked for the variables it read (candle's `sorted_nodes`), and
//! their gradients reach them through the op's second input, a chain of stand-ins joined from
//! the variables that holds no values (`join_vars`), so everything a trainer hangs on a
//! variable (DDP's gradient hooks, ZeRO-3's gathers) sees them as without checkpointing;
//! backward reads the variables themselves.

use candle_core::{
    backend::{BackendDevice, BackendStorage},
    CpuStorage, CustomOp2, DType, Layout, Shape, Storage, Tensor, Var,
};
use std::sync::{Arc, Mutex};

/// A block: what [`checkpoint`] runs, once forward and once more in backward.
type Block = dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// `block(x)`, its intermediate activations dropped after the forward and recomputed in
/// backward (activation checkpointing). The gradients of `x` and of every variable `block`
/// reads are those of `block(x)` without checkpointing: bitwise, unless a variable is also
/// used outside the block (its contributions are then added in another order).
///
/// `block` must compute the same values when run again: no dropout drawn anew, no state
/// changed by the forward (a key/value cache: clear it, or keep the block without one). Every
/// rank of a tensor- or sequence-parallel group must checkpoint the same blocks, since their
/// collectives run again in backward. A tensor the block captures from outside and that
/// needs a gradient should be its input `x` instead: a captured one gets its gradient, but
/// backward walks its graph again to give it.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// let (w1, w2) = (Var::randn(0f32, 0.3, (8, 32), &Device::Cpu)?, Var::randn(0f32, 0.2, (32, 8), &Device::Cpu)?);
/// let x = Tensor::randn(0f32, 1.0, (4, 8), &Device::Cpu)?;
/// let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
/// // The variables are found by walking the forward's graph: nothing to list.
/// let y = kolo_tensor::checkpoint::checkpoint(&x, move |x| (x + x.matmul(&a)?.gelu()?.matmul(&b)?))?;
/// let grads = y.sum_all()?.backward()?;
/// assert!(grads.get(w1.as_tensor()).is_some() && grads.get(w2.as_tensor()).is_some());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn checkpoint<F>(x: &Tensor, block: F) -> candle_core::Result<Tensor>
where
    F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
{
    checkpoint_op(x, Arc::new(block))
}

/// [`checkpoint`] of a block with several outputs (a mixture-of-experts layer's output, its
/// gate's probabilities and its auxiliary loss), each of which may carry a gradient back. They
/// travel joined in one tensor (in their dtype, or f32 when they differ) and are cut apart.
pub fn checkpoint_many<F>(x: &Tensor, block: F) -> candle_core::Result<Vec<Tensor>>
where
    F: Fn(&Tensor) -> candle_core::Result<Vec<Tensor>> + Send + Sync + 'static,
{
    // The outputs' shapes and dtypes, as the last run of the block gave them.
    let meta: Arc<Mutex<Outputs>> = Default::default();
    let seen = meta.clone();
    let joined = checkpoint_op(
        x,
        Arc::new(move |x: &Tensor| {
            let ys = block(x)?;
            let m: Outputs = ys.iter().map(|y| (y.dims().to_vec(), y.dtype())).collect();
            let mut last = seen.lock().unwrap_or_else(|p| p.into_inner());
            if !last.is_empty() && *last != m {
                candle_core::bail!("kolo checkpoint: the block ran again to outputs {m:?}, after {:?}", *last);
            }
            *last = m;
            join(&ys)
        }),
    )?;
    let meta = meta.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut off = 0;
    meta.iter()
        .map(|(dims, dtype)| {
            let n: usize = dims.iter().product();
            let y = joined.narrow(0, off, n)?.reshape(dims.as_slice())?.to_dtype(*dtype);
            off += n;
            y
        })
        .collect()
}

/// A CPU tensor's values as a storage of its own, in its dtype (a custom op's result): one copy,
/// of exactly its elements (its storage may hold more, or hold them strided).
pub(crate) fn owned_cpu(t: &Tensor) -> candle_core::Result<(CpuStorage, Shape)> {
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(c) = &*s else { candle_core::bail!("kolo checkpoint: the block's output is not on the CPU") };
    // SAFETY: `copy_strided_src` writes every element of the new storage.
    let mut dst = unsafe { candle_core::cpu_backend::CpuDevice.alloc_uninit(l.shape(), t.dtype())? };
    c.copy_strided_src(&mut dst, 0, l)?;
    Ok((dst, l.shape().clone()))
}

/// Each output's shape and dtype.
type Outputs = Vec<(Vec<usize>, DType)>;

/// Tensors flattened and concatenated, in their dtype if they share one, else in f32 (exact
/// for f32, bf16 and f16 values, so their gradients come back bitwise).
fn join(ys: &[Tensor]) -> candle_core::Result<Tensor> {
    let Some(first) = ys.first() else { candle_core::bail!("kolo checkpoint: a block without outputs") };
    let dtype = if ys.iter().all(|y| y.dtype() == first.dtype()) { first.dtype() } else { DType::F32 };
    let flat: Vec<Tensor> = ys.iter().map(|y| y.flatten_all()?.to_dtype(dtype)).collect::<candle_core::Result<_>>()?;
    Tensor::cat(&flat, 0)
}

fn checkpoint_op(x: &Tensor, block: Arc<Block>) -> candle_core::Result<Tensor> {
    let y = block(&x.detach())?;
    let vars: Vec<Tensor> = y.sorted_nodes().into_iter().filter(|n| n.is_variable()).cloned().collect();
    let out = y.detach();
    // The graph of the forward (every intermediate) goes here.
    drop(y);
    if vars.is_empty() && !x.track_op() {
        return Ok(out);
    }
    let joined = join_vars(&vars, x.device())?;
    let op = Checkpointed { block, vars, out: Mutex::new(Some(out)) };
    x.apply_op2(&joined, op)
}

/// The variables as the op's second input, without a copy of their values: a chain of
/// [`Stand`] and [`Join`] nodes whose outputs have the variables' total length and no storage
/// (nothing reads them), and whose backward cuts the op's packed gradient back into each
/// variable's (in its shape and dtype). An empty tensor without any variable.
pub(crate) fn join_vars(vars: &[Tensor], device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let Some(first) = vars.first() else { return Tensor::zeros(0, DType::F32, device) };
    let mut acc = first.apply_op1(Stand)?;
    for v in &vars[1..] {
        acc = acc.apply_op2(v, Join { left: acc.elem_count() })?;
    }
    Ok(acc)
}

/// The storage of a stand-in: none (nothing reads it).
fn empty_cpu() -> CpuStorage {
    CpuStorage::F32(Vec::new())
}

/// One variable as a stand-in of its length ([`join_vars`]).
struct Stand;

impl candle_core::CustomOp1 for Stand {
    fn name(&self) -> &'static str {
        "kolo-checkpoint-stand"
    }

    fn cpu_fwd(&self, _: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((empty_cpu(), Shape::from(l.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((s.device().zeros_impl(&Shape::from(0), DType::F32)?, Shape::from(l.shape().elem_count())))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.reshape(arg.dims())?.to_dtype(arg.dtype())?))
    }
}

/// The stand-in of the variables so far (`left` elements) followed by one more variable's.
struct Join {
    left: usize,
}

impl CustomOp2 for Join {
    fn name(&self) -> &'static str {
        "kolo-checkpoint-join"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Ok((empty_cpu(), Shape::from(self.left + l2.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((s1.device().zeros_impl(&Shape::from(0), DType::F32)?, Shape::from(self.left + l2.shape().elem_count())))
    }

    fn bwd(&self, _: &Tensor, v: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mine = grad.narrow(0, self.left, v.elem_count())?.reshape(v.dims())?.to_dtype(v.dtype())?;
        Ok((Some(grad.narrow(0, 0, self.left)?), Some(mine)))
    }
}

struct Checkpointed {
    block: Arc<Block>,
    /// The variables the forward read, in the order they are joined.
    vars: Vec<Tensor>,
    /// The forward's output, handed to candle once as the op's result.
    out: Mutex<Option<Tensor>>,
}

impl Checkpointed {
    /// The forward's output, which `block` computed before the op was applied.
    fn take_out(&self) -> candle_core::Result<Tensor> {
        let out = self.out.lock().unwrap_or_else(|p| p.into_inner()).take();
        out.ok_or_else(|| candle_core::Error::Msg("kolo checkpoint: the op ran forward twice".into()))
    }
}

impl CustomOp2 for Checkpointed {
    fn name(&self) -> &'static str {
        "kolo-checkpoint"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        owned_cpu(&self.take_out()?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = self.take_out()?;
        let (s, l) = out.storage_and_layout();
        let Storage::Cuda(c) = &*s else { candle_core::bail!("kolo checkpoint: the block's output is not on the GPU") };
        // SAFETY: `copy_strided_src` writes every element of the new storage.
        let mut dst = unsafe { c.device().alloc_uninit(l.shape(), out.dtype())? };
        c.copy_strided_src(&mut dst, 0, l)?;
        Ok((dst, l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _joined: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let xv = Var::from_tensor(&x.detach())?;
        let y = (self.block)(xv.as_tensor())?;
        if y.dims() != grad.dims() {
            candle_core::bail!("kolo checkpoint: the block ran again to a {:?} output, after {:?} forward", y.dims(), grad.dims());
        }
        let known = |id| id == xv.as_tensor().id() || self.vars.iter().any(|v| v.id() == id);
        if let Some(other) = y.sorted_nodes().into_iter().find(|n| n.is_variable() && !known(n.id())) {
            candle_core::bail!(
                "kolo checkpoint: run again in backward, the block read a variable (of shape {:?}) its forward did not; a checkpointed block must compute the same thing twice",
                other.dims()
            );
        }
        let g = (y * grad.detach())?.sum_all()?.backward()?;
        let parts: Vec<Tensor> = self
            .vars
            .iter()
            .map(|v| match g.get(v) {
                Some(gv) => gv.flatten_all()?.to_dtype(DType::F32),
                None => Tensor::zeros(v.elem_count(), DType::F32, v.device()),
            })
            .collect::<candle_core::Result<_>>()?;
        let gx = x.track_op().then(|| g.get(xv.as_tensor()).cloned()).flatten();
        let gp = if parts.is_empty() { None } else { Some(Tensor::cat(&parts, 0)?) };
        Ok((gx, gp))
    }
}
