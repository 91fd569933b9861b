use super::{normal, Input, Model};
use crate::ops::{layer_norm, linear};
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::{Device, Tensor};
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

pub struct Gpt {
    cfg: GptConfig,
    params: ParamSet,
    wte: usize,
    wpe: usize,
    blocks: Vec<Block>,
    ln_f: (usize, usize),
    head: (usize, usize),
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
        Ok(Gpt { cfg, params: p, wte, wpe, blocks, ln_f, head })
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamSet {
        &self.params
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
        let d = c / h;
        let g = |i: usize| view.get(&self.params, i);
        let pair = |(w, bias): (usize, usize)| -> Result<(Tensor, Tensor)> { Ok((g(w)?, g(bias)?)) };
        let ids_t = Tensor::from_slice(ids, b * t, &Device::Cpu)?;
        let tok = g(self.wte)?.index_select(&ids_t, 0)?.reshape((b, t, c))?;
        let pos = g(self.wpe)?.narrow(0, 0, t)?;
        let mut x = tok.broadcast_add(&pos)?;
        let scale = 1.0 / (d as f64).sqrt();
        for blk in &self.blocks {
            let (lw, lb) = pair(blk.ln1)?;
            let hdn = layer_norm(&x, &lw, &lb, 1e-5)?;
            let (qw, qb) = pair(blk.qkv)?;
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
            let (pw, pb) = pair(blk.proj)?;
            x = (x + linear(&y, &pw, &pb)?)?;
            let (lw, lb) = pair(blk.ln2)?;
            let hdn = layer_norm(&x, &lw, &lb, 1e-5)?;
            let (fw, fb) = pair(blk.fc)?;
            let (ow, ob) = pair(blk.fc_out)?;
            x = (x + linear(&crate::fused::gelu_erf(&linear(&hdn, &fw, &fb)?)?, &ow, &ob)?)?;
        }
        let (lw, lb) = pair(self.ln_f)?;
        let x = layer_norm(&x, &lw, &lb, 1e-5)?;
        let (hw, hb) = pair(self.head)?;
        Ok(linear(&x, &hw, &hb)?.reshape((b * t, self.cfg.vocab))?)
    }
}
