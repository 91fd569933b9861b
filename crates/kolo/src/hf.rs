//! Hugging Face checkpoints in and out: a directory with `config.json` and `model.safetensors`,
//! as `transformers`' `save_pretrained` writes it.
//!
//! [`Gpt2`] is GPT-2 (`GPT2LMHeadModel`) written with candle-nn over a `VarMap` whose names
//! are Hugging Face's (`transformer.h.0.attn.c_attn.weight`, ...), so it trains under
//! [`Trainer`](crate::Trainer) like any user model, [`load_weights`] fills it from a checkpoint and
//! [`save_pretrained`] writes whole, shaped tensors under those names back out, with the
//! `format = pt` metadata `transformers` requires.

use crate::{Error, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{embedding, layer_norm, Embedding, LayerNorm, LayerNormConfig, VarBuilder, VarMap};
use std::collections::HashMap;
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
fn next_token_loss(ids: &Tensor, forward: impl Fn(&Tensor) -> candle_core::Result<Tensor>) -> candle_core::Result<Tensor> {
    let t = ids.dim(1)?;
    let logits = forward(&ids.narrow(1, 0, t - 1)?)?;
    let v = logits.dim(D::Minus1)?;
    candle_nn::loss::cross_entropy(&logits.reshape(((), v))?, &ids.narrow(1, 1, t - 1)?.flatten_all()?)
}

/// Builds a GPT-2 from `dir` (`config.json`, `model.safetensors`) into a new VarMap on `device`.
pub fn load_gpt2(dir: &Path, device: &Device) -> Result<(VarMap, Gpt2)> {
    let cfg = Gpt2Config::load(dir)?;
    let varmap = VarMap::new();
    let model = Gpt2::new(&cfg, VarBuilder::from_varmap(&varmap, DType::F32, device))?;
    load_weights(&varmap, &dir.join("model.safetensors"))?;
    Ok((varmap, model))
}

/// Sets every variable of `varmap` from the safetensors file at `path`, by name (a name may
/// also appear in the file without the VarMap's first component, as older checkpoints store
/// `h.0....` for `transformer.h.0....`), converted to the variable's dtype. Every variable must
/// be there with its shape; the file's other tensors (buffers, a tied output projection) are
/// ignored.
pub fn load_weights(varmap: &VarMap, path: &Path) -> Result<()> {
    // Mapped, and read one tensor at a time: a rank holding pieces of a split model never
    // holds the whole checkpoint.
    // SAFETY: the file is mapped read-only and must not change while it is read, as for
    // candle's own `VarBuilder::from_mmaped_safetensors`.
    let file = unsafe { candle_core::safetensors::MmapedSafetensors::new(path) }.map_err(|e| Error::file(path, e))?;
    let vars = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort();
    for name in names {
        let var = &vars[name];
        let short = name.split_once('.').map_or(name.as_str(), |(_, rest)| rest);
        // Split over a tensor-parallel group: only this rank's piece of the tensor is read.
        let t = match crate::tp::read_for(&file, name, var)? {
            Some(t) => t,
            None => crate::tp::read_for(&file, short, var)?
                .ok_or_else(|| Error::file(path, format!("no tensor `{name}` (the model has {} parameters)", vars.len())))?,
        };
        if t.dims() != var.dims() {
            return Err(Error::file(path, format!("tensor `{name}` has shape {:?}, the model's is {:?}", t.dims(), var.dims())));
        }
        var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
    }
    Ok(())
}

/// Writes `dir/config.json` and `dir/model.safetensors` (every variable of `varmap` whole,
/// under its name, f32, with `format = pt` metadata), as `save_pretrained` does; each file is
/// written to a temporary name and renamed, so a reader never sees half a file.
pub fn save_pretrained(dir: &Path, varmap: &VarMap, config: &impl serde::Serialize) -> Result<()> {
    let vars = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(vars.len());
    for (name, var) in vars.iter() {
        let v = var.as_tensor().to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        tensors.push((name.clone(), var.dims().to_vec(), v.iter().flat_map(|x| x.to_le_bytes()).collect()));
    }
    drop(vars);
    write_pretrained(dir, tensors, config)
}

/// Writes `model.safetensors` (whole f32 tensors, `format = pt`) and `config.json`, each
/// atomically.
fn write_pretrained(dir: &Path, mut tensors: Vec<(String, Vec<usize>, Vec<u8>)>, config: &impl serde::Serialize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let views = tensors
        .iter()
        .map(|(n, s, d)| Ok((n.as_str(), safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| Error::file(dir.join("model.safetensors"), e))?;
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let write = |name: &str, bytes: &[u8]| -> Result<()> {
        let (tmp, path) = (dir.join(format!(".{name}.tmp")), dir.join(name));
        std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        Ok(())
    };
    write("model.safetensors", &safetensors::serialize(views, Some(meta)).map_err(|e| Error::file(dir.join("model.safetensors"), e))?)?;
    write("config.json", serde_json::to_string_pretty(config).map_err(|e| Error::file(dir.join("config.json"), e))?.as_bytes())?;
    Ok(())
}

/// `config.json` of a Llama-style model (`LlamaForCausalLM`): RMSNorm, rotary position
/// embeddings, a SwiGLU MLP and grouped-query attention.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention; default: as many as query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Width of a head (default hidden_size / num_attention_heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Epsilon of the RMS norms.
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// Longest sequence the rotary tables cover.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// The MLP's gate activation (`silu`).
    #[serde(default = "default_silu")]
    pub hidden_act: String,
    /// Whether the output projection is the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Every other field of the file (rotary parameters among them), written back unchanged.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_max_positions() -> usize {
    2048
}
fn default_silu() -> String {
    "silu".into()
}

impl LlamaConfig {
    /// Reads `dir/config.json` and refuses options this implementation does not have.
    pub fn load(dir: &Path) -> Result<LlamaConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let c: LlamaConfig = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not a Llama config: {e}")))?;
        c.check().map_err(|e| Error::file(&path, e))?;
        Ok(c)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let get = |k: &str| self.other.get(k).filter(|v| !v.is_null());
        if let Some(t) = get("model_type").and_then(|v| v.as_str()).filter(|t| *t != "llama") {
            return Err(format!("model_type \"{t}\" is not llama"));
        }
        for k in ["attention_bias", "mlp_bias"] {
            if get(k).and_then(serde_json::Value::as_bool).unwrap_or(false) {
                return Err(format!("unsupported Llama option {k} = true"));
            }
        }
        if get("rope_scaling").is_some() {
            return Err("unsupported Llama option rope_scaling (only the default rotary embedding)".to_string());
        }
        if let Some(t) = get("rope_parameters").and_then(|p| p.get("rope_type")).and_then(|t| t.as_str()).filter(|t| *t != "default") {
            return Err(format!("unsupported rope_type \"{t}\" (only \"default\")"));
        }
        if self.hidden_act != "silu" {
            return Err(format!("unsupported hidden_act \"{}\" (silu)", self.hidden_act));
        }
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        if h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return Err(format!("num_attention_heads {h} is not a multiple of num_key_value_heads {kv}"));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!("head_dim {} is odd (rotary embeddings rotate pairs)", self.head_dim()));
        }
        Ok(())
    }

    /// Each block's share of a forward pass, for cutting pipeline stages: its multiply-adds per
    /// token (projections and MLP), the last block also the output layer's (hidden x
    /// vocabulary, as much as several blocks at a large vocabulary). The embedding's lookup
    /// costs next to nothing.
    pub fn block_costs(&self) -> Vec<f64> {
        let (e, hd, inter) = (self.hidden_size as f64, self.head_dim() as f64, self.intermediate_size as f64);
        let (h, kv) = (self.num_attention_heads as f64, self.kv_heads() as f64);
        let block = e * hd * (2.0 * h + 2.0 * kv) + 3.0 * e * inter;
        let mut costs = vec![block; self.num_hidden_layers];
        if let Some(last) = costs.last_mut() {
            *last += e * self.vocab_size as f64;
        }
        costs
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rotary base: `rope_parameters.rope_theta` (transformers 5), else `rope_theta`, else 10000.
    pub fn rope_theta(&self) -> f64 {
        let get = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_f64);
        get(self.other.get("rope_parameters").and_then(|p| p.get("rope_theta"))).or(get(self.other.get("rope_theta"))).unwrap_or(10_000.0)
    }
}

/// A linear layer of a block: candle-nn's, or one split over a tensor-parallel group.
type Layer = Box<dyn Module + Send + Sync>;

struct LlamaBlock {
    input_norm: candle_nn::RmsNorm,
    q: Layer,
    k: Layer,
    v: Layer,
    o: Layer,
    post_norm: candle_nn::RmsNorm,
    gate: Layer,
    up: Layer,
    down: Layer,
    /// Query and key/value heads on this rank (all of them, or this member's share).
    heads: (usize, usize),
}

impl LlamaBlock {
    /// `x` (batch, seq, hidden) through grouped-query attention with rotary embeddings (`cos`,
    /// `sin` cut to the sequence) and the SwiGLU MLP, each with its residual.
    fn forward(
        &self,
        x: &Tensor,
        (cos, sin, mask): (&Tensor, &Tensor, &Tensor),
        cfg: &LlamaConfig,
        sp: Option<&crate::sp::SequenceParallel>,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let ((h, kv), hd) = (self.heads, cfg.head_dim());
        let a = self.input_norm.forward(x)?;
        let heads = |l: &Layer, n: usize| l.forward(&a)?.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
        let q = candle_nn::rotary_emb::rope(&heads(&self.q, h)?, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&heads(&self.k, kv)?, cos, sin)?;
        let v = heads(&self.v, kv)?;
        // Grouped-query attention: query head j reads key/value head j / (h / kv).
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            if kv == h {
                return Ok(x);
            }
            x.unsqueeze(2)?.expand((b, kv, h / kv, t, hd))?.reshape((b, h, t, hd))
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let y = match sp {
            // Sequence parallelism: this chunk's queries over every earlier chunk's keys.
            Some(sp) => crate::sp::ring_attention(&q, &k, &v, sp)?,
            None => {
                let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(mask)?;
                candle_nn::ops::softmax_last_dim(&att)?.matmul(&v)?
            }
        };
        let y = y.transpose(1, 2)?.reshape((b, t, h * hd))?;
        let x = (x + self.o.forward(&y)?)?;
        let f = self.post_norm.forward(&x)?;
        x + self.down.forward(&(self.gate.forward(&f)?.silu()? * self.up.forward(&f)?)?)?
    }
}

/// A Llama-style causal language model with Hugging Face's parameter names
/// (`model.layers.0.self_attn.q_proj.weight`, ...).
pub struct Llama {
    cfg: LlamaConfig,
    /// The blocks this rank holds (all of them, or a pipeline stage's).
    layers: std::ops::Range<usize>,
    /// On the first stage.
    embed: Option<LlamaEmbedding>,
    blocks: Vec<LlamaBlock>,
    /// On the last stage.
    norm: Option<candle_nn::RmsNorm>,
    lm_head: Option<Layer>,
    /// The tensor-parallel group the model is split over (`None`: whole).
    tp: Option<crate::tp::TensorParallel>,
    /// The sequence-parallel group whose chunks of every sequence this model runs on.
    sp: Option<crate::sp::SequenceParallel>,
    /// Rotary tables, (max_position_embeddings, head_dim / 2).
    cos: Tensor,
    sin: Tensor,
}

/// The token embedding: candle-nn's, or split by vocabulary over a tensor-parallel group.
enum LlamaEmbedding {
    Whole(Embedding),
    Split(crate::tp::VocabParallelEmbedding),
}

impl Llama {
    /// Builds the model's variables through `vb`.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, None, 0..cfg.num_hidden_layers)
    }

    /// Builds this rank's part of the model for `mesh`: the blocks of its pipeline stage (cut by
    /// [`LlamaConfig::block_costs`] with `kolo::pp::stage_layers_by`; [`Llama::new_stage`]), split over its `tp` group, running on
    /// its `sp` chunk of every sequence (attention by `kolo::sp::ring_attention`, rotary
    /// positions from the chunk's offset). Train it with `Trainer::with_mesh`:
    /// [`Llama::loss`], or [`Llama::pipeline_stage`] in a pipeline.
    pub fn new_parallel(cfg: &LlamaConfig, vb: VarBuilder, mesh: &crate::Mesh) -> candle_core::Result<Llama> {
        let layers = crate::pp::stage_layers_by(&cfg.block_costs(), mesh).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut m = Self::build(cfg, vb, Some(mesh.tp()), layers)?;
        m.sp = (mesh.sp().size() > 1).then(|| mesh.sp().clone());
        Ok(m)
    }

    /// Builds the model split over the tensor-parallel group `tp` (Megatron-LM's layout): each
    /// member holds its share of the query and key/value heads (q, k and v column-parallel,
    /// the output projection row-parallel), of the MLP (gate and up column-, down
    /// row-parallel) and of the vocabulary (embedding and output layer); the norms are whole.
    /// The heads, key/value heads and MLP width must be multiples of the group's size. Its
    /// variables keep Hugging Face's names; [`load_weights`] fills each member's pieces from a
    /// checkpoint, and `Mesh::whole_varmap` puts them together for [`save_pretrained`].
    /// Train it with `Trainer::with_mesh`.
    pub fn new_split(cfg: &LlamaConfig, vb: VarBuilder, tp: &crate::tp::TensorParallel) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, Some(tp), 0..cfg.num_hidden_layers)
    }

    /// Builds one pipeline stage of the model (`kolo::pp`): the blocks `layers` (their Hugging
    /// Face names unchanged), the embedding on the first stage and the final norm and output
    /// layer on the last, split over `tp` when given (as [`Llama::new_split`]). Run it with
    /// [`Llama::pipeline_stage`]. An output layer tied to the embedding cannot span stages yet.
    pub fn new_stage(
        cfg: &LlamaConfig,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
    ) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, tp, layers)
    }

    fn build(
        cfg: &LlamaConfig,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
    ) -> candle_core::Result<Llama> {
        use crate::tp::{ColumnParallelLinear as Col, RowParallelLinear as Row};
        use candle_nn::{linear_no_bias as lin, rms_norm};
        let (e, hd, h, kv) = (cfg.hidden_size, cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let tp = tp.filter(|t| t.size() > 1);
        let p = tp.map_or(1, |t| t.size());
        let (inter, n) = (cfg.intermediate_size, cfg.num_hidden_layers);
        if !h.is_multiple_of(p) || !kv.is_multiple_of(p) || !inter.is_multiple_of(p) {
            candle_core::bail!(
                "Llama over {p} tensor-parallel ranks: num_attention_heads {h}, num_key_value_heads {kv} and intermediate_size {inter} must each be a multiple of {p}"
            );
        }
        if layers.start >= layers.end || layers.end > n {
            candle_core::bail!("pipeline stage of layers {layers:?}: the model has {n}");
        }
        if cfg.tie_word_embeddings && (layers.start != 0 || layers.end != n) {
            candle_core::bail!("tie_word_embeddings = true across pipeline stages (the embedding on the first, the output layer on the last) is not supported yet");
        }
        let col = |i: usize, o: usize, vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Col::new(i, o, false, vb, t)?),
                None => Box::new(lin(i, o, vb)?),
            })
        };
        let row = |i: usize, o: usize, vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Row::new(i, o, false, vb, t)?),
                None => Box::new(lin(i, o, vb)?),
            })
        };
        let m = vb.pp("model");
        let (first, last) = (layers.start == 0, layers.end == cfg.num_hidden_layers);
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let b = m.pp(format!("layers.{i}"));
            let (a, f) = (b.pp("self_attn"), b.pp("mlp"));
            blocks.push(LlamaBlock {
                input_norm: rms_norm(e, cfg.rms_norm_eps, b.pp("input_layernorm"))?,
                q: col(e, h * hd, a.pp("q_proj"))?,
                k: col(e, kv * hd, a.pp("k_proj"))?,
                v: col(e, kv * hd, a.pp("v_proj"))?,
                o: row(h * hd, e, a.pp("o_proj"))?,
                post_norm: rms_norm(e, cfg.rms_norm_eps, b.pp("post_attention_layernorm"))?,
                gate: col(e, cfg.intermediate_size, f.pp("gate_proj"))?,
                up: col(e, cfg.intermediate_size, f.pp("up_proj"))?,
                down: row(cfg.intermediate_size, e, f.pp("down_proj"))?,
                heads: (h / p, kv / p),
            });
        }
        let lm_head: Option<Layer> = match (cfg.tie_word_embeddings || !last, tp) {
            (true, _) => None,
            (false, Some(t)) => Some(Box::new(Col::lm_head(e, cfg.vocab_size, vb.pp("lm_head"), t)?)),
            (false, None) => Some(Box::new(lin(e, cfg.vocab_size, vb.pp("lm_head"))?)),
        };
        let embed = match tp {
            _ if !first => None,
            Some(t) => Some(LlamaEmbedding::Split(crate::tp::VocabParallelEmbedding::new(cfg.vocab_size, e, m.pp("embed_tokens"), t)?)),
            None => Some(LlamaEmbedding::Whole(embedding(cfg.vocab_size, e, m.pp("embed_tokens"))?)),
        };
        let (n, half) = (cfg.max_position_embeddings, hd / 2);
        let theta = cfg.rope_theta();
        let angles: Vec<f64> = (0..n).flat_map(|p| (0..half).map(move |i| p as f64 / theta.powf(2.0 * i as f64 / hd as f64))).collect();
        let table = |f: fn(f64) -> f64| Tensor::from_vec(angles.iter().map(|a| f(*a) as f32).collect::<Vec<_>>(), (n, half), vb.device());
        Ok(Llama {
            cfg: cfg.clone(),
            layers,
            embed,
            blocks,
            norm: if last { Some(rms_norm(e, cfg.rms_norm_eps, m.pp("norm"))?) } else { None },
            lm_head,
            tp: tp.cloned(),
            sp: None,
            cos: table(f64::cos)?,
            sin: table(f64::sin)?,
        })
    }

    /// The name prefix of each block this rank holds (`model.layers.{i}.`), in forward order:
    /// the ZeRO-3 groups.
    pub fn block_prefixes(&self) -> Vec<String> {
        self.layers.clone().map(|i| format!("model.layers.{i}.")).collect()
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq). Split over a tensor-parallel
    /// group, every member gets the whole logits (a collective; not differentiable: train
    /// with [`Llama::loss`], or [`Llama::local_logits`] and `kolo::tp::vocab_parallel_cross_entropy`).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.local_logits(ids)?;
        match &self.tp {
            Some(t) => crate::tp::gather_vocab(&logits, self.cfg.vocab_size, t),
            None => Ok(logits),
        }
    }

    /// Logits (batch, seq, this rank's vocabulary range: all of it when the model is whole).
    pub fn local_logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        if self.layers != (0..self.cfg.num_hidden_layers) {
            candle_core::bail!("this rank holds the pipeline stage of layers {:?}: run it with Llama::pipeline_stage", self.layers);
        }
        if self.sp.is_some() {
            candle_core::bail!("a sequence-parallel model runs on its chunk of each sequence: train and evaluate with Llama::loss");
        }
        self.head(&self.blocks(&self.embed(ids)?)?)
    }

    /// The first stage's token embedding of `ids` (batch, seq).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match &self.embed {
            Some(LlamaEmbedding::Whole(e)) => e.forward(ids),
            Some(LlamaEmbedding::Split(e)) => e.forward(ids),
            None => candle_core::bail!("the embedding is on the first pipeline stage, not layers {:?}", self.layers),
        }
    }

    /// This rank's blocks on the hidden states `x` (batch, seq or this rank's chunk of it,
    /// hidden).
    fn blocks(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        // A sequence-parallel chunk's positions start at its offset.
        let from = self.sp.as_ref().map_or(0, |sp| sp.rank() * t);
        if from + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {} tokens is longer than max_position_embeddings {}",
                from + t,
                self.cfg.max_position_embeddings
            );
        }
        let (cos, sin) = (self.cos.narrow(0, from, t)?.contiguous()?, self.sin.narrow(0, from, t)?.contiguous()?);
        let mask: Vec<f32> = (0..t * t).map(|i| if i % t > i / t { f32::NEG_INFINITY } else { 0.0 }).collect();
        let mask = Tensor::from_vec(mask, (t, t), x.device())?;
        let mut x = x.clone();
        for blk in &self.blocks {
            x = blk.forward(&x, (&cos, &sin, &mask), &self.cfg, self.sp.as_ref())?;
        }
        Ok(x)
    }

    /// The last stage's final norm and output layer: logits of this rank's vocabulary range.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let Some(norm) = &self.norm else {
            candle_core::bail!("the output layer is on the last pipeline stage, not layers {:?}", self.layers);
        };
        let x = norm.forward(x)?;
        match (&self.lm_head, &self.embed) {
            (Some(l), _) => l.forward(&x),
            (None, Some(LlamaEmbedding::Whole(e))) => x.broadcast_matmul(&e.embeddings().t()?),
            (None, Some(LlamaEmbedding::Split(e))) => e.tied_logits(&x),
            (None, None) => candle_core::bail!("a tied output layer without its embedding"),
        }
    }

    /// This rank's pipeline stage (`kolo::pp::Pipeline::step`'s closure) on the micro-batch
    /// `windows` (batch, seq + 1) of token ids: the first stage embeds `windows[:, ..seq]`, the
    /// others take the previous stage's hidden states `input` (batch, seq, hidden); the last
    /// stage returns the mean next-token cross-entropy against `windows[:, 1..]`
    /// (vocabulary-parallel when split), the others their hidden states.
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        let t = windows.dim(1)? - 1;
        // Sequence parallelism: this rank's chunk of the inputs and of the targets.
        let chunk = |x: Tensor| match &self.sp {
            Some(sp) => sp.chunk(&x, 1),
            None => Ok(x),
        };
        let x = match input {
            Some(x) => x.clone(),
            None => self.embed(&chunk(windows.narrow(1, 0, t)?)?)?,
        };
        let x = self.blocks(&x)?;
        if self.norm.is_none() {
            return Ok(x);
        }
        let logits = self.head(&x)?;
        let targets = chunk(windows.narrow(1, 1, t)?)?;
        match &self.tp {
            Some(tp) => crate::tp::vocab_parallel_cross_entropy(&logits, &targets, self.cfg.vocab_size, tp),
            None => candle_nn::loss::cross_entropy(&logits.reshape(((), self.cfg.vocab_size))?, &targets.flatten_all()?),
        }
    }

    /// Mean next-token cross-entropy of `ids` (batch, seq); split over a tensor-parallel group,
    /// Megatron's vocabulary-parallel cross-entropy (the logits are never gathered); over a
    /// sequence-parallel group, the mean over this rank's chunk.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.pipeline_stage(None, ids)
    }
}

/// Builds a Llama-style model from `dir` (`config.json`, `model.safetensors`) into a new VarMap.
pub fn load_llama(dir: &Path, device: &Device) -> Result<(VarMap, Llama)> {
    load_llama_split(dir, device, None)
}

/// As [`load_llama`], split over `tp` when given ([`Llama::new_split`]): each rank keeps its
/// pieces of the checkpoint's tensors.
fn load_llama_split(dir: &Path, device: &Device, tp: Option<&crate::tp::TensorParallel>) -> Result<(VarMap, Llama)> {
    load_llama_stage(dir, device, tp, None)
}

/// As [`load_llama_split`], or this rank's part of the model for `mesh` when given
/// ([`Llama::new_parallel`]).
fn load_llama_stage(
    dir: &Path,
    device: &Device,
    tp: Option<&crate::tp::TensorParallel>,
    mesh: Option<&crate::Mesh>,
) -> Result<(VarMap, Llama)> {
    let cfg = LlamaConfig::load(dir)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
    let model = match mesh {
        Some(m) => Llama::new_parallel(&cfg, vb, m),
        None => Llama::new_stage(&cfg, vb, tp, 0..cfg.num_hidden_layers),
    }
    .map_err(|e| Error::file(dir.join("config.json"), e))?;
    load_weights(&varmap, &dir.join("model.safetensors"))?;
    Ok((varmap, model))
}

/// A Hugging Face causal language model Kolo can load: chosen by `config.json`'s `model_type`.
pub enum CausalLm {
    /// `gpt2`.
    Gpt2(Gpt2),
    /// `llama`.
    Llama(Llama),
}

impl CausalLm {
    /// Logits (batch, seq, vocab) for token ids (batch, seq).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::Gpt2(m) => m.forward(ids),
            CausalLm::Llama(m) => m.forward(ids),
        }
    }
    /// Mean next-token cross-entropy of `ids` (batch, seq).
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::Gpt2(m) => m.loss(ids),
            CausalLm::Llama(m) => m.loss(ids),
        }
    }
    /// Width of the hidden states between blocks (what a pipeline stage hands the next).
    pub fn hidden_size(&self) -> usize {
        match self {
            CausalLm::Gpt2(m) => m.config().n_embd,
            CausalLm::Llama(m) => m.config().hidden_size,
        }
    }
    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            CausalLm::Gpt2(m) => m.config().vocab_size,
            CausalLm::Llama(m) => m.config().vocab_size,
        }
    }
    /// Writes the model as `save_pretrained` does ([`save_pretrained`] with its config).
    pub fn save_pretrained(&self, dir: &Path, varmap: &VarMap) -> Result<()> {
        match self {
            CausalLm::Gpt2(m) => save_pretrained(dir, varmap, m.config()),
            CausalLm::Llama(m) => save_pretrained(dir, varmap, m.config()),
        }
    }
    /// This rank's pipeline stage on the micro-batch `windows` ([`Llama::pipeline_stage`]).
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::Gpt2(_) => candle_core::bail!("GPT-2 in pipeline stages is not supported yet (a Llama is)"),
            CausalLm::Llama(m) => m.pipeline_stage(input, windows),
        }
    }
    /// The ZeRO-3 groups of the model's blocks, in forward order.
    pub fn block_prefixes(&self) -> Vec<String> {
        match self {
            CausalLm::Gpt2(m) => m.block_prefixes(),
            CausalLm::Llama(m) => m.block_prefixes(),
        }
    }
}

/// Loads this rank's part of the causal language model in `dir` for `mesh`
/// ([`Llama::new_parallel`]: a Llama's blocks of this rank's pipeline stage, split over the
/// mesh's `tp` group, on its `sp` chunk of each sequence); each rank reads only its pieces of
/// the checkpoint. GPT-2 takes none of these yet. Train it with `Trainer::with_mesh`, a pipeline's stages with
/// [`CausalLm::pipeline_stage`]; `Mesh::whole_varmap` puts it together for an export.
pub fn load_causal_lm_parallel(dir: &Path, device: &Device, mesh: &crate::Mesh) -> Result<(VarMap, CausalLm)> {
    let tp = (mesh.tp().size() > 1).then(|| mesh.tp());
    if mesh.size("pp") == 1 && mesh.size("sp") == 1 {
        return load_causal_lm_split(dir, device, tp);
    }
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
    match v.get("model_type").and_then(|t| t.as_str()) {
        Some("llama") => load_llama_stage(dir, device, tp, Some(mesh)).map(|(v, m)| (v, CausalLm::Llama(m))),
        t => Err(Error::file(&path, format!("model_type {t:?} in pipeline stages or sequence chunks is not supported yet (a Llama is)"))),
    }
}

/// Loads the causal language model in `dir` (GPT-2 or Llama, by `config.json`'s `model_type`)
/// into a new VarMap on `device`.
pub fn load_causal_lm(dir: &Path, device: &Device) -> Result<(VarMap, CausalLm)> {
    load_causal_lm_split(dir, device, None)
}

/// As [`load_causal_lm`], split over the tensor-parallel group `tp` when it has more than one
/// rank (a Llama, [`Llama::new_split`]; GPT-2 is not split yet): each rank keeps its pieces.
/// Train it with `Trainer::with_mesh`; `Mesh::whole_varmap` gathers it for an export.
pub fn load_causal_lm_split(dir: &Path, device: &Device, tp: Option<&crate::tp::TensorParallel>) -> Result<(VarMap, CausalLm)> {
    let tp = tp.filter(|t| t.size() > 1);
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
    match v.get("model_type").and_then(|t| t.as_str()) {
        Some("gpt2") if tp.is_some() => {
            Err(Error::file(&path, "GPT-2 under tensor parallelism is not supported yet (a Llama is; GPT-2 trains under DDP and ZeRO)"))
        }
        Some("gpt2") => load_gpt2(dir, device).map(|(v, m)| (v, CausalLm::Gpt2(m))),
        Some("llama") => load_llama_split(dir, device, tp).map(|(v, m)| (v, CausalLm::Llama(m))),
        Some(t) => Err(Error::file(&path, format!("model_type \"{t}\" is not supported (gpt2, llama)"))),
        None => Err(Error::file(&path, "no model_type")),
    }
}
