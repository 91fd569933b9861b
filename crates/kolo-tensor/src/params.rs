use crate::{Result, TensorError};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, DType, Device, InplaceOp1, Layout, Shape, Storage, Tensor, Var};
pub use kolo_base::GradSink;
use std::ops::Range;
use std::sync::Arc;

/// One trainable tensor and where it sits in the flat buffer.
pub struct Param {
    pub name: String,
    pub var: Var,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
}

/// The trainable parameters of a model, in registration order, with their flat layout: parameter
/// `i` occupies `range` of every flat buffer (values, gradients, optimizer state).
#[derive(Default)]
pub struct ParamSet {
    params: Vec<Param>,
    numel: usize,
    /// Parameters on a GPU: their values also live here, flat, on the host (the optimizers'
    /// master copy, as ZeRO-Offload keeps it): updates land here and reach the device in one
    /// copy before the next read through a [`ParamView`], instead of a round trip per tensor.
    host: Option<std::sync::Mutex<Vec<f32>>>,
    /// The host copy has updates the device has not seen.
    stale: std::sync::atomic::AtomicBool,
}

/// Copies a candle tensor's f32 values into `out` (which must have exactly its element count).
pub fn copy_f32(t: &Tensor, out: &mut [f32]) -> Result<()> {
    let t = if t.is_contiguous() { t.clone() } else { t.contiguous()? };
    if !t.device().is_cpu() {
        let v = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        if out.len() != v.len() {
            return Err(TensorError::Input(format!("copy_f32: tensor has {} elements, buffer {}", v.len(), out.len())));
        }
        out.copy_from_slice(&v);
        return Ok(());
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(TensorError::Input("only CPU tensors can be flattened".into()));
    };
    let s = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    let n = layout.shape().elem_count();
    if out.len() != n {
        return Err(TensorError::Input(format!("copy_f32: tensor has {n} elements, buffer {}", out.len())));
    }
    out.copy_from_slice(&s[start..start + n]);
    Ok(())
}

/// Runs `f` on a tensor's values as f32 without a copy where it is a contiguous f32 CPU tensor
/// (a gradient handed to DDP), else on a converted copy.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = if t.dtype() == DType::F32 { t.clone() } else { t.to_dtype(DType::F32)? };
    let t = if t.is_contiguous() { t } else { t.contiguous()? };
    if !t.device().is_cpu() {
        return Ok(f(&t.flatten_all()?.to_vec1::<f32>()?));
    }
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(TensorError::Input("a CPU tensor without CPU storage".into()));
    };
    let s = cpu.as_slice::<f32>()?;
    let start = layout.start_offset();
    Ok(f(&s[start..start + layout.shape().elem_count()]))
}

/// A closure over a parameter's values.
type Edit<'a> = &'a mut dyn FnMut(&mut [f32]);

/// Runs a closure on a contiguous f32 tensor's values, in place.
struct InPlace<'a>(std::cell::RefCell<Edit<'a>>);

impl InplaceOp1 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "kolo-in-place"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let CpuStorage::F32(v) = storage else {
            return Err(candle_core::Error::Msg("kolo-in-place: not an f32 tensor".into()));
        };
        if !layout.is_contiguous() {
            return Err(candle_core::Error::Msg("kolo-in-place: parameter is not contiguous".into()));
        }
        let s = layout.start_offset();
        (self.0.borrow_mut())(&mut v[s..s + layout.shape().elem_count()]);
        Ok(())
    }
}

/// Runs `f` on a contiguous f32 CPU variable's values, in place (the tensors sharing its storage
/// see the change).
pub fn edit_f32(var: &Var, f: Edit<'_>) -> Result<()> {
    var.as_tensor().inplace_op1(&InPlace(std::cell::RefCell::new(f)))?;
    Ok(())
}

impl ParamSet {
    pub fn new() -> ParamSet {
        ParamSet::default()
    }

    /// Registers a parameter with initial values; returns its index.
    pub fn add(&mut self, name: &str, shape: &[usize], init: Vec<f32>) -> Result<usize> {
        let n: usize = shape.iter().product();
        if init.len() != n {
            return Err(TensorError::Shape { name: name.into(), what: format!("{} initial values for shape {shape:?}", init.len()) });
        }
        let device = crate::device();
        if !device.is_cpu() {
            let h = self.host.get_or_insert_with(Default::default);
            h.get_mut().unwrap_or_else(|p| p.into_inner()).extend_from_slice(&init);
        }
        let var = Var::from_vec(init, shape, &device)?;
        let range = self.numel..self.numel + n;
        self.numel += n;
        self.params.push(Param { name: name.to_string(), var, shape: shape.to_vec(), range });
        Ok(self.params.len() - 1)
    }

    /// Registers an existing variable (a candle model's own parameter, from its `VarMap`): an
    /// f32, contiguous tensor. On the CPU, updates write into its storage in place, so the
    /// model sees them. On a GPU, as for [`ParamSet::add`], the optimizer steps a flat host
    /// copy and [`ParamSet::sync_device`] writes it into the variable. Every parameter of a set
    /// lives on the same device.
    pub fn adopt(&mut self, name: &str, var: Var) -> Result<usize> {
        let bad = |what: &str| Err(TensorError::Input(format!("parameter `{name}`: {what}")));
        if var.dtype() != DType::F32 {
            return bad(&format!("is {:?}; Kolo trains f32 parameters (compute in bf16/f16 by casting in the model)", var.dtype()));
        }
        if !var.is_contiguous() {
            return bad("is not contiguous");
        }
        let gpu = !var.device().is_cpu();
        if !self.params.is_empty() && gpu != self.host.is_some() {
            let first = &self.params[0];
            return bad(&format!(
                "is on {:?}, `{}` on {:?}: a model trains on one device (build it with one VarBuilder device)",
                var.device().location(),
                first.name,
                first.var.device().location()
            ));
        }
        if gpu {
            let values = var.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            let h = self.host.get_or_insert_with(Default::default);
            h.get_mut().unwrap_or_else(|p| p.into_inner()).extend_from_slice(&values);
        }
        let shape = var.dims().to_vec();
        let n = var.elem_count();
        let range = self.numel..self.numel + n;
        self.numel += n;
        self.params.push(Param { name: name.to_string(), var, shape, range });
        Ok(self.params.len() - 1)
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }
    /// Total number of scalars.
    pub fn numel(&self) -> usize {
        self.numel
    }
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }
    pub fn get(&self, i: usize) -> &Param {
        &self.params[i]
    }

    /// Current values, flat.
    pub fn flatten(&self, out: &mut [f32]) -> Result<()> {
        if let Some(h) = &self.host {
            out.copy_from_slice(&h.lock().unwrap_or_else(|p| p.into_inner()));
            return Ok(());
        }
        for p in &self.params {
            copy_f32(p.var.as_tensor(), &mut out[p.range.clone()])?;
        }
        Ok(())
    }

    pub fn to_flat(&self) -> Result<Vec<f32>> {
        let mut v = vec![0f32; self.numel];
        self.flatten(&mut v)?;
        Ok(v)
    }

    /// Writes flat values back into the parameters, in place (no reallocation).
    pub fn load(&self, flat: &[f32]) -> Result<()> {
        if flat.len() != self.numel {
            return Err(TensorError::Input(format!("load: {} values for {} parameters", flat.len(), self.numel)));
        }
        for i in 0..self.params.len() {
            self.load_one(i, &flat[self.params[i].range.clone()])?;
        }
        Ok(())
    }

    /// Overwrites parameter `i` in place.
    pub fn load_one(&self, i: usize, values: &[f32]) -> Result<()> {
        let p = &self.params[i];
        if values.len() != p.range.len() {
            return Err(TensorError::Input(format!("load: {} values for `{}` of {}", values.len(), p.name, p.range.len())));
        }
        self.update_one(i, &mut |v: &mut [f32]| v.copy_from_slice(values))
    }

    /// Runs `f` on parameter `i`'s values in place (an optimizer step straight on the model's
    /// storage, without a flat copy).
    pub fn update_one(&self, i: usize, f: &mut dyn FnMut(&mut [f32])) -> Result<()> {
        if let Some(h) = &self.host {
            f(&mut h.lock().unwrap_or_else(|p| p.into_inner())[self.params[i].range.clone()]);
            self.stale.store(true, std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        edit_f32(&self.params[i].var, f)
    }

    /// Brings the device's parameters up to date with the host copy (GPU parameters only): one
    /// host-to-device copy of everything, then a device copy into each parameter's storage.
    /// Every [`ParamView`] calls it before handing out a parameter.
    pub fn sync_device(&self) -> Result<()> {
        let Some(h) = &self.host else { return Ok(()) };
        if !self.stale.swap(false, std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let h = h.lock().unwrap_or_else(|p| p.into_inner());
        let Some(first) = self.params.first() else { return Ok(()) };
        let flat = Tensor::from_slice(&h[..], h.len(), first.var.device())?;
        for p in &self.params {
            p.var.set(&flat.narrow(0, p.range.start, p.range.len())?.reshape(p.shape.as_slice())?)?;
        }
        Ok(())
    }

    /// Gradients from a backward pass, flat. Every parameter must have one.
    pub fn grads_into(&self, grads: &GradStore, out: &mut [f32]) -> Result<()> {
        for p in &self.params {
            let g = grads.get(p.var.as_tensor()).ok_or_else(|| TensorError::MissingGrad { name: p.name.clone() })?;
            copy_f32(g, &mut out[p.range.clone()])?;
        }
        Ok(())
    }

    /// Adds the gradients of parameters `ids` into `out` (the flat layout); each must have one.
    pub fn add_grads(&self, grads: &GradStore, ids: &[usize], out: &mut [f32]) -> Result<()> {
        let mut tmp = Vec::new();
        for &i in ids {
            let p = &self.params[i];
            let g = grads.get(p.var.as_tensor()).ok_or_else(|| TensorError::MissingGrad { name: p.name.clone() })?;
            tmp.resize(p.range.len(), 0.0);
            copy_f32(g, &mut tmp)?;
            out[p.range.clone()].iter_mut().zip(&tmp).for_each(|(o, g)| *o += g);
        }
        Ok(())
    }

    /// Frees parameter `i`'s values (ZeRO-3: its values then live sharded across ranks and are
    /// gathered on use). Its name, shape and range stay; reading or loading it is an error.
    pub fn release(&mut self, i: usize) -> Result<()> {
        self.params[i].var = Var::from_vec(Vec::<f32>::new(), 0, &Device::Cpu)?;
        Ok(())
    }

    /// Whether parameter `i` holds its values (see [`ParamSet::release`]).
    pub fn is_resident(&self, i: usize) -> bool {
        self.params[i].var.elem_count() == self.params[i].range.len()
    }

    /// `(name, shape)` of every parameter, for cross-rank and checkpoint compatibility checks.
    pub fn signature(&self) -> Vec<(String, Vec<usize>)> {
        self.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect()
    }
}

/// How a model reads its parameters during a forward pass.
pub trait ParamView {
    fn get(&self, params: &ParamSet, i: usize) -> Result<Tensor>;
}

/// The parameters themselves: gradients land in the `GradStore` of `backward()`.
pub struct PlainView;

impl ParamView for PlainView {
    fn get(&self, params: &ParamSet, i: usize) -> Result<Tensor> {
        params.sync_device()?;
        Ok(params.get(i).var.as_tensor().clone())
    }
}

/// Wraps every parameter in an identity op whose backward hands the gradient to `sink` (and
/// only to it: the GradStore that `backward` returns holds no parameter gradients).
pub struct HookedView {
    pub sink: Arc<dyn GradSink>,
    /// The dtype the model computes in: f32, or bf16/f16 for mixed precision (the parameters
    /// stay f32; the hook hands out a half-precision copy and widens the gradient back).
    pub dtype: DType,
}

impl HookedView {
    pub fn new(sink: Arc<dyn GradSink>) -> HookedView {
        HookedView { sink, dtype: DType::F32 }
    }
}

/// The parameters cast to a compute dtype (mixed-precision evaluation; gradients flow back to
/// the f32 parameters through the cast).
pub struct CastView(pub DType);

impl ParamView for CastView {
    fn get(&self, params: &ParamSet, i: usize) -> Result<Tensor> {
        params.sync_device()?;
        Ok(params.get(i).var.as_tensor().to_dtype(self.0)?)
    }
}

/// How a model of f32 parameters computing in `dtype` reads them: as they are in f32, else
/// cast where used ([`CastView`], torch's autocast).
pub fn view_for(dtype: DType) -> Box<dyn ParamView> {
    match dtype {
        DType::F32 => Box::new(PlainView),
        dtype => Box::new(CastView(dtype)),
    }
}

struct GradHook {
    idx: usize,
    sink: Arc<dyn GradSink>,
    dtype: DType,
}

impl CustomOp1 for GradHook {
    fn name(&self) -> &'static str {
        "kolo-grad-hook"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        // Identity. Parameters are contiguous from offset 0, so the storage can be shared as is.
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            return Err(candle_core::Error::Msg("kolo-grad-hook: parameter must be contiguous".into()));
        }
        let v = storage.as_slice::<f32>()?;
        let out = match self.dtype {
            DType::BF16 => CpuStorage::BF16(v.iter().map(|x| half::bf16::from_f32(*x)).collect()),
            DType::F16 => CpuStorage::F16(v.iter().map(|x| half::f16::from_f32(*x)).collect()),
            _ => storage.clone(),
        };
        Ok((out, layout.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &candle_core::CudaStorage, layout: &Layout) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            return Err(candle_core::Error::Msg("kolo-grad-hook: parameter must be contiguous".into()));
        }
        let out = match self.dtype {
            DType::F32 => storage.try_clone(layout)?,
            d => storage.to_dtype(layout, d)?,
        };
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        // A half-precision gradient is widened for the sink; a GPU one comes to the host for
        // Kolo's buckets (the copy waits for it).
        with_f32(grad, |g| self.sink.grad_ready(self.idx, g)).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        // The sink has the gradient. Returning none keeps candle from also accumulating it into
        // the parameter's slot of the GradStore (a zeros + add of every parameter, and a copy
        // of all gradients alive until backward ends): peak gradient memory stays at what
        // backward has in flight.
        Ok(None)
    }
}

impl ParamView for HookedView {
    fn get(&self, params: &ParamSet, i: usize) -> Result<Tensor> {
        params.sync_device()?;
        Ok(params.get(i).var.as_tensor().apply_op1(GradHook { idx: i, sink: self.sink.clone(), dtype: self.dtype })?)
    }
}
