//! GPT-NeoX (`GPTNeoXForCausalLM`: Pythia, GPT-NeoX-20B) with Hugging Face's parameter names:
//! layer norms with biases, one `query_key_value` projection laid out head by head, rotary
//! embeddings on part of each head, and the attention and the MLP reading the same input
//! (`use_parallel_residual`).

use super::files::{LoadReport, Weights};
use super::llama::{attend, rotate};
use crate::{Error, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, layer_norm, linear, linear_no_bias, Embedding, LayerNorm, LayerNormConfig, VarBuilder, VarMap};

/// A linear layer: candle-nn's, or one split over a tensor-parallel group.
type Layer = Box<dyn Module + Send + Sync>;
use std::path::Path;

/// `config.json` of a GPT-NeoX model (the fields Kolo reads; others are kept and written back).
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct NeoxConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Epsilon of the layer norms.
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    /// Longest sequence the rotary tables cover.
    pub max_position_embeddings: usize,
    /// The MLP's activation (`gelu`, or the tanh approximation `gelu_new`, `gelu_pytorch_tanh`).
    #[serde(default = "default_gelu")]
    pub hidden_act: String,
    /// Attention and MLP both read the block's input, and both outputs join the residual.
    #[serde(default = "yes")]
    pub use_parallel_residual: bool,
    /// Whether the output projection is the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Every other field of the file (rotary parameters among them), written back unchanged.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-5
}
fn default_gelu() -> String {
    "gelu".into()
}
fn yes() -> bool {
    true
}

impl NeoxConfig {
    /// Reads `dir/config.json` and refuses options this implementation does not have.
    pub fn load(dir: &Path) -> Result<NeoxConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let c: NeoxConfig = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not a GPT-NeoX config: {e}")))?;
        c.check().map_err(|e| Error::file(&path, e))?;
        Ok(c)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let get = |k: &str| self.other.get(k).filter(|v| !v.is_null());
        if let Some(t) = get("model_type").and_then(|v| v.as_str()).filter(|t| *t != "gpt_neox") {
            return Err(format!("model_type \"{t}\" is not gpt_neox"));
        }
        if get("attention_bias").and_then(serde_json::Value::as_bool) == Some(false) {
            return Err("attention_bias = false is not supported (GPT-NeoX's attention projections carry biases)".into());
        }
        if let Some(t) = self.rope().get("rope_type").and_then(|t| t.as_str()).filter(|t| *t != "default") {
            return Err(format!("unsupported rope_type \"{t}\" (default)"));
        }
        if !["gelu", "gelu_new", "gelu_pytorch_tanh"].contains(&self.hidden_act.as_str()) {
            return Err(format!("unsupported hidden_act \"{}\" (gelu, gelu_new, gelu_pytorch_tanh)", self.hidden_act));
        }
        let h = self.num_attention_heads;
        if h == 0 || !self.hidden_size.is_multiple_of(h) {
            return Err(format!("hidden_size {} is not a multiple of num_attention_heads {h}", self.hidden_size));
        }
        let r = self.rotary_dim();
        if r == 0 || !r.is_multiple_of(2) {
            return Err(format!("rotary dimension {r} (head size x partial_rotary_factor) is not a positive even number"));
        }
        Ok(())
    }

    /// The rotary parameters: `rope_parameters` (transformers 5), else the top-level fields of
    /// older files (`rotary_pct`, `rotary_emb_base`).
    fn rope(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut p = self.other.get("rope_parameters").and_then(|p| p.as_object()).cloned().unwrap_or_default();
        for (old, new) in [("rotary_pct", "partial_rotary_factor"), ("rotary_emb_base", "rope_theta"), ("rope_theta", "rope_theta")] {
            if let (Some(v), false) = (self.other.get(old), p.contains_key(new)) {
                p.insert(new.into(), v.clone());
            }
        }
        p
    }

    /// Each block's share of a forward pass, for cutting pipeline stages: its multiply-adds per
    /// token (attention's projections and the MLP), the last block also the output layer's.
    pub fn block_costs(&self) -> Vec<f64> {
        let (e, inter) = (self.hidden_size as f64, self.intermediate_size as f64);
        let mut costs = vec![4.0 * e * e + 2.0 * e * inter; self.num_hidden_layers];
        if let Some(last) = costs.last_mut() {
            *last += e * self.vocab_size as f64;
        }
        costs
    }

    /// Width of a head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Dimensions of a head that rotate (GPT-NeoX's default: a quarter).
    pub fn rotary_dim(&self) -> usize {
        let f = self.rope().get("partial_rotary_factor").and_then(serde_json::Value::as_f64).unwrap_or(0.25);
        (self.head_dim() as f64 * f) as usize
    }

    /// `config.json` keys this implementation neither reads nor knows to leave the arithmetic
    /// unchanged, for the load report.
    pub fn unknown_keys(&self) -> Vec<String> {
        const READ: &[&str] = &[
            "model_type",
            "rope_parameters",
            "rotary_pct",
            "rotary_emb_base",
            "rope_theta",
            "attention_bias",
            "hidden_dropout",
            "classifier_dropout",
            "is_decoder",
            "use_cache",
        ];
        self.other.keys().filter(|k| !READ.contains(&k.as_str()) && !super::HARMLESS_KEYS.contains(&k.as_str())).cloned().collect()
    }
}

struct NeoxBlock {
    input_norm: LayerNorm,
    qkv: Layer,
    dense: Layer,
    post_norm: LayerNorm,
    up: Layer,
    down: Layer,
    /// Heads on this rank (all of them, or this member's share).
    heads: usize,
}

impl NeoxBlock {
    fn forward(&self, x: &Tensor, (cos, sin, mask): (&Tensor, &Tensor, &Tensor), cfg: &NeoxConfig) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (h, hd) = (self.heads, cfg.head_dim());
        // Laid out head by head: each head's q, k and v side by side.
        let qkv = self.qkv.forward(&self.input_norm.forward(x)?)?.reshape((b, t, h, 3 * hd))?.transpose(1, 2)?;
        let part = |i: usize| qkv.narrow(3, i * hd, hd)?.contiguous();
        let (q, k, v) = (rotate(part(0)?, cos, sin)?, rotate(part(1)?, cos, sin)?, part(2)?);
        let y = attend(&q, &k, &v, mask)?.transpose(1, 2)?.reshape((b, t, h * hd))?;
        let attn = self.dense.forward(&y)?;
        let mlp = |x: &Tensor| -> candle_core::Result<Tensor> {
            let u = self.up.forward(&self.post_norm.forward(x)?)?;
            let u = if cfg.hidden_act == "gelu" { u.gelu_erf()? } else { u.gelu()? };
            self.down.forward(&u)
        };
        if cfg.use_parallel_residual {
            (x + &attn)? + mlp(x)?
        } else {
            let x = (x + attn)?;
            &x + mlp(&x)?
        }
    }
}

/// GPT-NeoX with Hugging Face's parameter names (`gpt_neox.layers.0.attention.query_key_value.weight`,
/// ...), dropout left out.
pub struct GptNeox {
    cfg: NeoxConfig,
    /// The blocks this rank holds (all of them, or a pipeline stage's).
    layers: std::ops::Range<usize>,
    /// On the first stage (and, tied as the output layer, on the last).
    embed: Option<NeoxEmbedding>,
    /// (Shared with the closures of checkpointed blocks, which backward runs again.)
    blocks: Vec<std::sync::Arc<NeoxBlock>>,
    /// Whether each block this rank holds is checkpointed ([`GptNeox::checkpoint_blocks`]).
    checkpointed: Vec<bool>,
    /// On the last stage.
    norm: Option<LayerNorm>,
    /// On the last stage, unless tied to the embedding.
    lm_head: Option<Layer>,
    /// The tensor-parallel group the model is split over (`None`: whole).
    tp: Option<crate::tp::TensorParallel>,
    cos: Tensor,
    sin: Tensor,
    report: LoadReport,
}

/// The token embedding: candle-nn's, or split by vocabulary over a tensor-parallel group.
enum NeoxEmbedding {
    Whole(Embedding),
    Split(crate::tp::VocabParallelEmbedding),
}

impl GptNeox {
    /// Builds the model's variables through `vb`.
    pub fn new(cfg: &NeoxConfig, vb: VarBuilder) -> candle_core::Result<GptNeox> {
        Self::new_split(cfg, vb, None)
    }

    /// Builds this rank's part of the model for `mesh`: the blocks of its pipeline stage (cut
    /// by [`NeoxConfig::block_costs`]), split over its `tp` group ([`GptNeox::new_stage`]).
    /// GPT-NeoX does not run on sequence chunks (`sp`). Train it with `Trainer::with_mesh`:
    /// [`GptNeox::loss`], or [`GptNeox::pipeline_stage`] in a pipeline.
    pub fn new_parallel(cfg: &NeoxConfig, vb: VarBuilder, mesh: &crate::Mesh) -> candle_core::Result<GptNeox> {
        if mesh.sp().size() > 1 {
            candle_core::bail!("GPT-NeoX over {} sequence-parallel ranks is not supported (a Llama-style model is)", mesh.sp().size());
        }
        let layers = crate::pp::stage_layers_by(&cfg.block_costs(), mesh).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Self::new_stage(cfg, vb, Some(mesh.tp()), layers)
    }

    /// Builds the model split over the tensor-parallel group `tp` when given (Megatron's layout):
    /// `query_key_value` column-parallel (its rows are laid out head by head, so each member's
    /// rows are its heads' q, k and v), `dense` row-parallel, the MLP's `dense_h_to_4h` column-
    /// and `dense_4h_to_h` row-parallel, the embedding and `embed_out` by vocabulary; the layer
    /// norms whole. The heads and MLP width must be multiples of the group's size.
    pub fn new_split(cfg: &NeoxConfig, vb: VarBuilder, tp: Option<&crate::tp::TensorParallel>) -> candle_core::Result<GptNeox> {
        Self::new_stage(cfg, vb, tp, 0..cfg.num_hidden_layers)
    }

    /// Builds one pipeline stage of the model (`kolo::pp`): the blocks `layers` (their Hugging
    /// Face names unchanged), the embedding on the first stage and the final norm and output
    /// layer on the last (a tied output layer: a copy of the embedding there, kept equal to the
    /// first stage's by the trainer), split over `tp` when given ([`GptNeox::new_split`]).
    pub fn new_stage(
        cfg: &NeoxConfig,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
    ) -> candle_core::Result<GptNeox> {
        use crate::tp::{ColumnParallelLinear as Col, RowParallelLinear as Row};
        let tp = tp.filter(|t| t.size() > 1);
        let p = tp.map_or(1, |t| t.size());
        let (e, inter, h) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads);
        if !h.is_multiple_of(p) || !inter.is_multiple_of(p) {
            candle_core::bail!(
                "GPT-NeoX over {p} tensor-parallel ranks: num_attention_heads {h} and intermediate_size {inter} must each be a multiple of {p}"
            );
        }
        if layers.start >= layers.end || layers.end > cfg.num_hidden_layers {
            candle_core::bail!("pipeline stage of layers {layers:?}: the model has {}", cfg.num_hidden_layers);
        }
        let (first, last) = (layers.start == 0, layers.end == cfg.num_hidden_layers);
        let col = |i: usize, o: usize, vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Col::new(i, o, true, vb, t)?),
                None => Box::new(linear(i, o, vb)?),
            })
        };
        let row = |i: usize, o: usize, vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Row::new(i, o, true, vb, t)?),
                None => Box::new(linear(i, o, vb)?),
            })
        };
        let ln = |vb: VarBuilder| layer_norm(e, LayerNormConfig { eps: cfg.layer_norm_eps, ..Default::default() }, vb);
        let m = vb.pp("gpt_neox");
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let b = m.pp(format!("layers.{i}"));
            blocks.push(std::sync::Arc::new(NeoxBlock {
                input_norm: ln(b.pp("input_layernorm"))?,
                qkv: col(e, 3 * e, b.pp("attention.query_key_value"))?,
                dense: row(e, e, b.pp("attention.dense"))?,
                post_norm: ln(b.pp("post_attention_layernorm"))?,
                up: col(e, inter, b.pp("mlp.dense_h_to_4h"))?,
                down: row(inter, e, b.pp("mlp.dense_4h_to_h"))?,
                heads: h / p,
            }));
        }
        let (n, r) = (cfg.max_position_embeddings, cfg.rotary_dim());
        let theta = cfg.rope().get("rope_theta").and_then(serde_json::Value::as_f64).unwrap_or(10_000.0);
        let angles: Vec<f64> = (0..n).flat_map(|p| (0..r / 2).map(move |i| p as f64 / theta.powf(2.0 * i as f64 / r as f64))).collect();
        let table = |f: fn(f64) -> f64| {
            Tensor::from_vec(angles.iter().map(|a| f(*a) as f32).collect::<Vec<_>>(), (n, r / 2), vb.device())?.to_dtype(vb.dtype())
        };
        Ok(GptNeox {
            cfg: cfg.clone(),
            layers,
            embed: match tp {
                _ if !(first || last && cfg.tie_word_embeddings) => None,
                Some(t) => Some(NeoxEmbedding::Split(crate::tp::VocabParallelEmbedding::new(cfg.vocab_size, e, m.pp("embed_in"), t)?)),
                None => Some(NeoxEmbedding::Whole(embedding(cfg.vocab_size, e, m.pp("embed_in"))?)),
            },
            checkpointed: vec![false; blocks.len()],
            blocks,
            norm: if last { Some(ln(m.pp("final_layer_norm"))?) } else { None },
            lm_head: match (cfg.tie_word_embeddings || !last, tp) {
                (true, _) => None,
                (false, Some(t)) => Some(Box::new(Col::lm_head(e, cfg.vocab_size, vb.pp("embed_out"), t)?)),
                (false, None) => Some(Box::new(linear_no_bias(e, cfg.vocab_size, vb.pp("embed_out"))?)),
            },
            tp: tp.cloned(),
            cos: table(f64::cos)?,
            sin: table(f64::sin)?,
            report: LoadReport::default(),
        })
    }

    /// Activation checkpointing (`transformers`' `gradient_checkpointing_enable`, for the
    /// chosen layers): the blocks `layers` (0-based over the whole model; a pipeline stage
    /// takes those it holds) keep only their input from forward to backward and run again
    /// there ([`crate::checkpoint`]). Training is unchanged, bitwise; memory falls by a
    /// block's activations for one more forward of it. Every rank of a tensor- or
    /// sequence-parallel group must choose the same layers.
    pub fn checkpoint_blocks(&mut self, layers: &[usize]) -> std::result::Result<(), String> {
        self.checkpointed = super::checkpointed(layers, self.layers.clone(), self.cfg.num_hidden_layers)?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &NeoxConfig {
        &self.cfg
    }

    /// What loading the checkpoint left unused (tensors, `config.json` keys).
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// The name prefix of each block this rank holds (`gpt_neox.layers.{i}.`), in forward
    /// order: the ZeRO-3 groups.
    pub fn block_prefixes(&self) -> Vec<String> {
        self.layers.clone().map(|i| format!("gpt_neox.layers.{i}.")).collect()
    }

    /// Whether the checkpoint tensor `name` belongs to a part of the model another pipeline
    /// stage holds, or is not a parameter (a tied output layer, the rotary tables).
    fn elsewhere(&self, name: &str) -> bool {
        let last = self.layers.end == self.cfg.num_hidden_layers;
        if name.ends_with(".rotary_emb.inv_freq") || (self.cfg.tie_word_embeddings && name == "embed_out.weight") {
            return true;
        }
        if let Some(i) = name.strip_prefix("gpt_neox.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok()) {
            return !self.layers.contains(&i);
        }
        match name {
            "gpt_neox.embed_in.weight" => self.embed.is_none(),
            "gpt_neox.final_layer_norm.weight" | "gpt_neox.final_layer_norm.bias" | "embed_out.weight" => !last,
            _ => false,
        }
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq). Split over a tensor-parallel
    /// group, every member gets the whole logits (a collective; train with [`GptNeox::loss`]).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        if self.layers != (0..self.cfg.num_hidden_layers) {
            candle_core::bail!("this rank holds the pipeline stage of layers {:?}: run it with GptNeox::pipeline_stage", self.layers);
        }
        let logits = self.head(&self.blocks(&self.embed(ids)?)?)?;
        match &self.tp {
            Some(t) => crate::tp::gather_vocab(&logits, self.cfg.vocab_size, t),
            None => Ok(logits),
        }
    }

    /// The first stage's token embedding of `ids` (batch, seq).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match &self.embed {
            _ if self.layers.start != 0 => candle_core::bail!("the embedding is on the first pipeline stage, not layers {:?}", self.layers),
            Some(NeoxEmbedding::Whole(e)) => e.forward(ids),
            Some(NeoxEmbedding::Split(e)) => e.forward(ids),
            None => candle_core::bail!("no embedding on the first stage"),
        }
    }

    /// This rank's blocks on the hidden states `x` (batch, seq, hidden).
    fn blocks(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        if t > self.cfg.max_position_embeddings {
            candle_core::bail!("sequence of {t} tokens is longer than max_position_embeddings {}", self.cfg.max_position_embeddings);
        }
        let (cos, sin) = (self.cos.narrow(0, 0, t)?.contiguous()?, self.sin.narrow(0, 0, t)?.contiguous()?);
        let mask = super::causal_mask(t, None, x.device(), x.dtype())?;
        type Ctx = (Tensor, Tensor, Tensor, NeoxConfig);
        let forward: fn(&NeoxBlock, &Tensor, &Ctx) -> candle_core::Result<Tensor> =
            |b, x, (cos, sin, mask, cfg)| b.forward(x, (cos, sin, mask), cfg);
        super::run_blocks(&self.blocks, &self.checkpointed, x, (cos, sin, mask, self.cfg.clone()), forward)
    }

    /// The last stage's final norm and output layer: logits of this rank's vocabulary range.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let Some(norm) = &self.norm else {
            candle_core::bail!("the output layer is on the last pipeline stage, not layers {:?}", self.layers);
        };
        let x = norm.forward(x)?;
        match (&self.lm_head, &self.embed) {
            (Some(l), _) => l.forward(&x),
            (None, Some(NeoxEmbedding::Whole(e))) => x.broadcast_matmul(&e.embeddings().t()?),
            (None, Some(NeoxEmbedding::Split(e))) => e.tied_logits(&x),
            (None, None) => candle_core::bail!("a tied output layer without its embedding"),
        }
    }

    /// This rank's pipeline stage (`kolo::pp::Pipeline::step`'s closure) on the micro-batch
    /// `windows` (batch, seq + 1) of token ids: the first stage embeds `windows[:, ..seq]`, the
    /// others take the previous stage's hidden states `input` (batch, seq, hidden); the last
    /// stage returns the mean next-token cross-entropy against `windows[:, 1..]`
    /// (vocabulary-parallel when split), the others their hidden states.
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        let head = |x: &Tensor| self.head(x);
        let parts = super::StageParts {
            embed: &|ids| self.embed(ids),
            blocks: &|x| self.blocks(x),
            head: self.norm.as_ref().map(|_| &head as super::Part<'_>),
            chunk: &Ok,
            vocab: self.cfg.vocab_size,
            tp: self.tp.as_ref(),
        };
        super::run_stage(parts, input, windows)
    }

    /// Mean next-token cross-entropy of `ids` (batch, seq); split over a tensor-parallel group,
    /// the vocabulary-parallel cross-entropy (the logits are never gathered).
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.pipeline_stage(None, ids)
    }
}

/// Builds a GPT-NeoX from `dir` into a new VarMap on `device` (its output layer is
/// `embed_out.weight`, as checkpoints and `transformers` name it).
pub fn load_neox(dir: &Path, device: &Device) -> Result<(VarMap, GptNeox)> {
    load_neox_stage(dir, device, None, None, DType::F32)
}

/// As [`load_neox`], split over `tp` when given ([`GptNeox::new_split`]), or this rank's part
/// for `mesh` ([`GptNeox::new_parallel`]): each rank reads only its pieces of the checkpoint.
pub(super) fn load_neox_stage(
    dir: &Path,
    device: &Device,
    tp: Option<&crate::tp::TensorParallel>,
    mesh: Option<&crate::Mesh>,
    dtype: DType,
) -> Result<(VarMap, GptNeox)> {
    let cfg = NeoxConfig::load(dir)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let mut model = match mesh {
        Some(m) => GptNeox::new_parallel(&cfg, vb, m),
        None => GptNeox::new_split(&cfg, vb, tp),
    }
    .map_err(|e| Error::file(dir.join("config.json"), e))?;
    let unused_tensors = Weights::open(dir)?.fill(&varmap, &|n| model.elsewhere(n))?;
    model.report = LoadReport { unused_tensors, unknown_keys: cfg.unknown_keys() };
    Ok((varmap, model))
}
