//! GPT-2 (`GPT2LMHeadModel`) with Hugging Face's parameter names.

use super::files::{LoadReport, Weights};
use crate::{Error, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{embedding, layer_norm, Embedding, LayerNorm, LayerNormConfig, VarBuilder, VarMap};
use std::path::Path;

/// `config.json` of a GPT-2 model (the fields Kolo reads; others are kept and written back).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct Gpt2Config {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Longest sequence (positions embedded).
    pub n_positions: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block.
    pub n_head: usize,
    /// Width of the MLP (default 4 x n_embd).
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// `gelu_new` (GPT-2's tanh approximation), `gelu_pytorch_tanh` or `gelu`.
    #[serde(default = "default_activation")]
    pub activation_function: String,
    /// Epsilon of the layer norms.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// Whether the output projection is the token embedding (GPT-2: yes).
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
    /// Divide attention scores by sqrt(head size) (GPT-2: yes).
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Every other field of the file, written back unchanged.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_activation() -> String {
    "gelu_new".into()
}
fn default_eps() -> f64 {
    1e-5
}
fn yes() -> bool {
    true
}

impl Gpt2Config {
    /// Reads `dir/config.json` and refuses options this implementation does not have.
    pub fn load(dir: &Path) -> Result<Gpt2Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let c: Gpt2Config = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not a GPT-2 config: {e}")))?;
        c.check().map_err(|e| Error::file(&path, e))?;
        Ok(c)
    }

    /// `config.json` keys this implementation neither reads nor knows to leave the arithmetic
    /// unchanged (dropout among the latter: Kolo trains without it), for the load report.
    pub fn unknown_keys(&self) -> Vec<String> {
        const READ: &[&str] = &[
            "model_type",
            "n_ctx",
            "scale_attn_by_inverse_layer_idx",
            "reorder_and_upcast_attn",
            "add_cross_attention",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
            "summary_type",
            "summary_use_proj",
            "summary_activation",
            "summary_proj_to_labels",
            "summary_first_dropout",
            "task_specific_params",
        ];
        self.other.keys().filter(|k| !READ.contains(&k.as_str()) && !super::HARMLESS_KEYS.contains(&k.as_str())).cloned().collect()
    }

    fn check(&self) -> std::result::Result<(), String> {
        let flag = |k: &str| self.other.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
        if let Some(t) = self.other.get("model_type").and_then(|v| v.as_str()).filter(|t| *t != "gpt2") {
            return Err(format!("model_type \"{t}\" is not gpt2"));
        }
        for k in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"] {
            if flag(k) {
                return Err(format!("unsupported GPT-2 option {k} = true"));
            }
        }
        if !["gelu_new", "gelu_pytorch_tanh", "gelu"].contains(&self.activation_function.as_str()) {
            return Err(format!("unsupported activation_function \"{}\" (gelu_new, gelu_pytorch_tanh or gelu)", self.activation_function));
        }
        if !self.tie_word_embeddings {
            return Err("unsupported tie_word_embeddings = false (GPT-2's output projection is its token embedding)".to_string());
        }
        if self.n_head == 0 || !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!("n_embd {} is not a multiple of n_head {}", self.n_embd, self.n_head));
        }
        Ok(())
    }
}

/// HF's `Conv1D`: `x @ weight + bias` with `weight` of shape (in, out).
struct Conv1d {
    weight: Tensor,
    bias: Tensor,
}

impl Conv1d {
    fn new(inp: usize, out: usize, vb: VarBuilder) -> candle_core::Result<Conv1d> {
        let init = candle_nn::Init::Randn { mean: 0.0, stdev: 0.02 };
        Ok(Conv1d {
            weight: vb.get_with_hints((inp, out), "weight", init)?,
            bias: vb.get_with_hints(out, "bias", candle_nn::Init::Const(0.0))?,
        })
    }
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_matmul(&self.weight)?.broadcast_add(&self.bias)
    }
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Conv1d,
    attn_proj: Conv1d,
    ln_2: LayerNorm,
    c_fc: Conv1d,
    mlp_proj: Conv1d,
}

impl Block {
    /// `x` (batch, seq, n_embd) through attention and the MLP, each with its residual.
    fn forward(&self, x: &Tensor, mask: &Tensor, cfg: &Gpt2Config) -> candle_core::Result<Tensor> {
        let (b, t, e) = x.dims3()?;
        let nh = cfg.n_head;
        let hd = e / nh;
        let scale = if cfg.scale_attn_weights { 1.0 / (hd as f64).sqrt() } else { 1.0 };
        let qkv = self.c_attn.forward(&self.ln_1.forward(x)?)?;
        let heads = |i: usize| qkv.narrow(D::Minus1, i * e, e)?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax_last_dim(&att)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, e))?;
        let x = (x + self.attn_proj.forward(&y)?)?;
        let h = self.c_fc.forward(&self.ln_2.forward(&x)?)?;
        let h = if cfg.activation_function == "gelu" { h.gelu_erf()? } else { h.gelu()? };
        x + self.mlp_proj.forward(&h)?
    }
}

/// GPT-2 with Hugging Face's parameter names (`GPT2LMHeadModel`), dropout left out.
pub struct Gpt2 {
    cfg: Gpt2Config,
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// What loading left unused (empty for a model not loaded from files).
    report: LoadReport,
}

impl Gpt2 {
    /// Builds the model's variables through `vb` (under `transformer.`), randomly initialised
    /// as `transformers` does (normal 0.02, layer norms 1 and 0).
    pub fn new(cfg: &Gpt2Config, vb: VarBuilder) -> candle_core::Result<Gpt2> {
        let vb = vb.pp("transformer");
        let (e, inner) = (cfg.n_embd, cfg.n_inner.unwrap_or(4 * cfg.n_embd));
        let ln = |vb: VarBuilder| layer_norm(e, LayerNormConfig { eps: cfg.layer_norm_epsilon, ..Default::default() }, vb);
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let b = vb.pp(format!("h.{i}"));
            blocks.push(Block {
                ln_1: ln(b.pp("ln_1"))?,
                c_attn: Conv1d::new(e, 3 * e, b.pp("attn.c_attn"))?,
                attn_proj: Conv1d::new(e, e, b.pp("attn.c_proj"))?,
                ln_2: ln(b.pp("ln_2"))?,
                c_fc: Conv1d::new(e, inner, b.pp("mlp.c_fc"))?,
                mlp_proj: Conv1d::new(inner, e, b.pp("mlp.c_proj"))?,
            });
        }
        Ok(Gpt2 {
            cfg: cfg.clone(),
            wte: embedding(cfg.vocab_size, e, vb.pp("wte"))?,
            wpe: embedding(cfg.n_positions, e, vb.pp("wpe"))?,
            blocks,
            ln_f: ln(vb.pp("ln_f"))?,
            report: LoadReport::default(),
        })
    }

    /// The name prefix of each block (`transformer.h.{i}.`), in forward order: the ZeRO-3
    /// groups for [`crate::Trainer::with_zero3_groups`].
    pub fn block_prefixes(&self) -> Vec<String> {
        (0..self.cfg.n_layer).map(|i| format!("transformer.h.{i}.")).collect()
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// What loading the checkpoint left unused (tensors, `config.json` keys).
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let (_, t) = ids.dims2()?;
        if t > self.cfg.n_positions {
            candle_core::bail!("sequence of {t} tokens is longer than n_positions {}", self.cfg.n_positions);
        }
        let pos = Tensor::arange(0u32, t as u32, ids.device())?;
        let mut x = self.wte.forward(ids)?.broadcast_add(&self.wpe.forward(&pos)?)?;
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), ids.device())?.to_dtype(x.dtype())?;
        for blk in &self.blocks {
            x = blk.forward(&x, &mask, &self.cfg)?;
        }
        self.ln_f.forward(&x)?.broadcast_matmul(&self.wte.embeddings().t()?)
    }

    /// Mean next-token cross-entropy of `ids` (batch, seq): position i predicts token i + 1.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        next_token_loss(ids, |x| self.forward(x))
    }
}

/// Mean cross-entropy of predicting token i + 1 of each row of `ids` (batch, seq) from the
/// logits `forward` gives for tokens 0..seq - 1.
pub(super) fn next_token_loss(ids: &Tensor, forward: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> candle_core::Result<Tensor> {
    let t = ids.dim(1)?;
    let logits = forward(&ids.narrow(1, 0, t - 1)?)?;
    let v = logits.dim(D::Minus1)?;
    candle_nn::loss::cross_entropy(&logits.reshape(((), v))?, &ids.narrow(1, 1, t - 1)?.flatten_all()?)
}

/// Builds a GPT-2 from `dir` (`config.json`, `model.safetensors`) into a new VarMap on `device`.
pub fn load_gpt2(dir: &Path, device: &Device) -> Result<(VarMap, Gpt2)> {
    let cfg = Gpt2Config::load(dir)?;
    let varmap = VarMap::new();
    let mut model = Gpt2::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    // Older checkpoints keep the attention mask as buffers, and the output projection is tied.
    let buffer = |n: &str| n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") || n == "lm_head.weight";
    let unused_tensors = Weights::open(dir)?.fill(&varmap, &buffer)?;
    model.report = LoadReport { unused_tensors, unknown_keys: cfg.unknown_keys() };
    Ok((varmap, model))
}
