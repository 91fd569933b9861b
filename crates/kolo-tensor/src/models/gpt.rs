use super::{normal, Input, Model};
use crate::ops::{layer_norm, linear};
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Storage, Tensor, Var};
use kolo_base::Rng;

/// nanoGPT-style decoder: token + learned position embedding, pre-norm blocks with causal
/// self-attention and a GELU MLP (x4), final norm, untied head. No dropout.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub seq: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_layer: usize,
}

impl GptConfig {
    /// The benchmark shape of `peerbench_models.py` (3,225,665 parameters).
    pub fn bench() -> GptConfig {
        GptConfig { vocab: 65, seq: 128, d_model: 256, n_head: 4, n_layer: 4 }
    }
}

struct Block {
    ln1: (usize, usize),
    qkv: (usize, usize),
    proj: (usize, usize),
    ln2: (usize, usize),
    fc: (usize, usize),
    fc_out: (usize, usize),
}

impl Block {
    /// The block's parameters in the order [`block_forward`] takes them.
    fn ids(&self) -> [usize; 12] {
        let [a, b, c, d, e, f] = [self.ln1, self.qkv, self.proj, self.ln2, self.fc, self.fc_out];
        [a.0, a.1, b.0, b.1, c.0, c.1, d.0, d.1, e.0, e.1, f.0, f.1]
    }
}

pub struct Gpt {
    cfg: GptConfig,
    params: ParamSet,
    wte: usize,
    wpe: usize,
    blocks: Vec<Block>,
    ln_f: (usize, usize),
    head: (usize, usize),
    /// Blocks whose activations are recomputed in backward instead of stored.
    checkpointed: Vec<bool>,
}

/// One pre-norm transformer block on `x` (b, t, c) with parameters `p` (see [`Block::ids`]).
fn block_forward(x: &Tensor, p: &[Tensor], h: usize) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let d = c / h;
    let scale = 1.0 / (d as f64).sqrt();
    let hdn = layer_norm(x, &p[0], &p[1], 1e-5)?;
    let (qw, qb) = (&p[2], &p[3]);
    // Project q, k and v separately through row slices of the fused qkv weight: the
    // backward of slicing a weight is weight-sized, slicing the (b, t, 3c) activation
    // would pad and add activation-sized zeros three times per block.
    let heads = |k: usize| -> Result<Tensor> {
        let y = linear(&hdn, &qw.narrow(0, k * c, c)?, &qb.narrow(0, k * c, c)?)?;
        Ok(y.reshape((b, t, h, d))?.transpose(1, 2)?.contiguous()?)
    };
    let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
    let att = crate::fused::causal_softmax(&q.matmul(&k.t()?.contiguous()?)?, scale)?;
    let y = att.matmul(&v)?.transpose(1, 2)?.contiguous()?.reshape((b, t, c))?;
    let x = (x + linear(&y, &p[4], &p[5])?)?;
    let hdn = layer_norm(&x, &p[6], &p[7], 1e-5)?;
    Ok((&x + linear(&crate::fused::gelu_erf(&linear(&hdn, &p[8], &p[9])?)?, &p[10], &p[11])?)?)
}

/// Activation checkpointing of one block as a differentiable op on `(x, packed parameters)`:
/// forward runs the block without recording a graph (nothing inside is kept), backward runs it
/// again with a graph and differentiates it. The parameters arrive packed in one tensor (a
/// `cat` of the block's parameters as the view gave them), so their gradients flow back through
/// the `cat` to whatever the view attached (gradient hooks, or the GradStore).
struct CheckpointedBlock {
    n_head: usize,
    shapes: Vec<Vec<usize>>,
}

fn unpack(packed: &Tensor, shapes: &[Vec<usize>]) -> Result<Vec<Tensor>> {
    let mut off = 0;
    shapes
        .iter()
        .map(|s| {
            let n: usize = s.iter().product();
            let t = packed.narrow(0, off, n)?.reshape(s.as_slice())?;
            off += n;
            Ok(t)
        })
        .collect()
}

fn cpu_tensor(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Tensor> {
    let CpuStorage::F32(v) = storage else {
        return Err(candle_core::Error::Msg("kolo-checkpointed-block: f32 only".into()));
    };
    if !layout.is_contiguous() {
        return Err(candle_core::Error::Msg("kolo-checkpointed-block: inputs must be contiguous".into()));
    }
    let s = layout.start_offset();
    Tensor::from_slice(&v[s..s + layout.shape().elem_count()], layout.shape(), &Device::Cpu)
}

fn msg(e: TensorError) -> candle_core::Error {
    candle_core::Error::Msg(format!("kolo-checkpointed-block: {e}"))
}

impl CustomOp2 for CheckpointedBlock {
    fn name(&self) -> &'static str {
        "kolo-checkpointed-block"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = cpu_tensor(s1, l1)?;
        let packed = cpu_tensor(s2, l2)?;
        let y = block_forward(&x, &unpack(&packed, &self.shapes).map_err(msg)?, self.n_head).map_err(msg)?.contiguous()?;
        let (st, layout) = y.storage_and_layout();
        let Storage::Cpu(cpu) = &*st else {
            return Err(candle_core::Error::Msg("kolo-checkpointed-block: CPU only".into()));
        };
        let out = if layout.start_offset() == 0 && cpu.as_slice::<f32>()?.len() == layout.shape().elem_count() {
            cpu.clone()
        } else {
            let s = layout.start_offset();
            CpuStorage::F32(cpu.as_slice::<f32>()?[s..s + layout.shape().elem_count()].to_vec())
        };
        Ok((out, layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, packed: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let xv = Var::from_tensor(&x.detach())?;
        let pv = Var::from_tensor(&packed.detach())?;
        let y = block_forward(xv.as_tensor(), &unpack(pv.as_tensor(), &self.shapes).map_err(msg)?, self.n_head).map_err(msg)?;
        let g = (y * grad.detach())?.sum_all()?.backward()?;
        Ok((g.get(xv.as_tensor()).cloned(), g.get(pv.as_tensor()).cloned()))
    }
}

impl Gpt {
    pub fn new(cfg: GptConfig, rng: &mut Rng) -> Result<Gpt> {
        let c = cfg.d_model;
        if cfg.n_head == 0 || c % cfg.n_head != 0 {
            return Err(TensorError::Input(format!("d_model {c} is not divisible by n_head {}", cfg.n_head)));
        }
        let mut p = ParamSet::new();
        let std = 0.02;
        let lin = |p: &mut ParamSet, name: &str, out: usize, inp: usize, rng: &mut Rng| -> Result<(usize, usize)> {
            Ok((p.add(&format!("{name}.weight"), &[out, inp], normal(rng, out * inp, std))?, p.add(&format!("{name}.bias"), &[out], vec![0.0; out])?))
        };
        let ln = |p: &mut ParamSet, name: &str| -> Result<(usize, usize)> {
            Ok((p.add(&format!("{name}.weight"), &[c], vec![1.0; c])?, p.add(&format!("{name}.bias"), &[c], vec![0.0; c])?))
        };
        let wte = p.add("wte.weight", &[cfg.vocab, c], normal(rng, cfg.vocab * c, std))?;
        let wpe = p.add("wpe.weight", &[cfg.seq, c], normal(rng, cfg.seq * c, std))?;
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layer {
            let b = format!("blocks.{i}");
            blocks.push(Block {
                ln1: ln(&mut p, &format!("{b}.ln1"))?,
                qkv: lin(&mut p, &format!("{b}.attn.qkv"), 3 * c, c, rng)?,
                proj: lin(&mut p, &format!("{b}.attn.proj"), c, c, rng)?,
                ln2: ln(&mut p, &format!("{b}.ln2"))?,
                fc: lin(&mut p, &format!("{b}.fc"), 4 * c, c, rng)?,
                fc_out: lin(&mut p, &format!("{b}.fc_out"), c, 4 * c, rng)?,
            });
        }
        let ln_f = ln(&mut p, "ln_f")?;
        let head = lin(&mut p, "head", cfg.vocab, c, rng)?;
        let checkpointed = vec![false; cfg.n_layer];
        Ok(Gpt { cfg, params: p, wte, wpe, blocks, ln_f, head, checkpointed })
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }
}

impl Gpt {
    fn set_checkpointing_blocks(&mut self, blocks: &[usize]) -> Result<()> {
        if let Some(bad) = blocks.iter().find(|&&i| i >= self.cfg.n_layer) {
            return Err(TensorError::Input(format!("activation checkpointing: block {bad} does not exist (the model has {} blocks)", self.cfg.n_layer)));
        }
        self.checkpointed = (0..self.cfg.n_layer).map(|i| blocks.contains(&i)).collect();
        Ok(())
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    fn set_checkpointing(&mut self, blocks: &[usize]) -> Result<()> {
        self.set_checkpointing_blocks(blocks)
    }

    fn forward(&self, input: &Input, view: &dyn ParamView) -> Result<Tensor> {
        let Input::Tokens { ids, b, t } = input else {
            return Err(TensorError::Input("the GPT takes token sequences".into()));
        };
        let (b, t) = (*b, *t);
        if t == 0 || t > self.cfg.seq {
            return Err(TensorError::Input(format!("sequence length {t} is not in 1..={}", self.cfg.seq)));
        }
        if let Some(bad) = ids.iter().find(|i| **i as usize >= self.cfg.vocab) {
            return Err(TensorError::Input(format!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab)));
        }
        let c = self.cfg.d_model;
        let h = self.cfg.n_head;
        let g = |i: usize| view.get(&self.params, i);
        let pair = |(w, bias): (usize, usize)| -> Result<(Tensor, Tensor)> { Ok((g(w)?, g(bias)?)) };
        let ids_t = Tensor::from_slice(ids, b * t, &Device::Cpu)?;
        let tok = g(self.wte)?.index_select(&ids_t, 0)?.reshape((b, t, c))?;
        let pos = g(self.wpe)?.narrow(0, 0, t)?;
        let mut x = tok.broadcast_add(&pos)?;
        for (blk, &ckpt) in self.blocks.iter().zip(&self.checkpointed) {
            let p: Vec<Tensor> = blk.ids().iter().map(|&i| g(i)).collect::<Result<_>>()?;
            x = if ckpt {
                let flat: Vec<Tensor> = p.iter().map(|t| t.flatten_all()).collect::<candle_core::Result<_>>()?;
                let packed = Tensor::cat(&flat, 0)?;
                let shapes = p.iter().map(|t| t.dims().to_vec()).collect();
                x.contiguous()?.apply_op2(&packed, CheckpointedBlock { n_head: h, shapes })?
            } else {
                block_forward(&x, &p, h)?
            };
        }
        let (lw, lb) = pair(self.ln_f)?;
        let x = layer_norm(&x, &lw, &lb, 1e-5)?;
        let (hw, hb) = pair(self.head)?;
        Ok(linear(&x, &hw, &hb)?.reshape((b * t, self.cfg.vocab))?)
    }
}
