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

    /// Each block's share of a forward pass, for cutting pipeline stages: its multiply-adds per
    /// token (attention's projections and the MLP), the last block also the output layer's.
    pub fn block_costs(&self) -> Vec<f64> {
        let (e, inner) = (self.n_embd as f64, self.n_inner.unwrap_or(4 * self.n_embd) as f64);
        let mut costs = vec![4.0 * e * e + 2.0 * e * inner; self.n_layer];
        if let Some(last) = costs.last_mut() {
            *last += e * self.vocab_size as f64;
        }
        costs
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
}

impl Module for Conv1d {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_matmul(&self.weight)?.broadcast_add(&self.bias)
    }
}

type Layer = Box<dyn Module + Send + Sync>;

/// How the blocks attend: whole sequences under the causal mask, or this rank's chunks over a
/// sequence-parallel ring.
enum Attention {
    Masked(Tensor),
    Ring(crate::sp::SequenceParallel),
}

struct Block {
    ln_1: LayerNorm,
    c_attn: Layer,
    attn_proj: Layer,
    ln_2: LayerNorm,
    c_fc: Layer,
    mlp_proj: Layer,
    /// Heads on this rank (all of them, or this member's share).
    heads: usize,
}

impl Block {
    /// `x` (batch, seq, n_embd) through attention and the MLP, each with its residual.
    /// Under sequence parallelism `x` is this rank's chunk of every sequence.
    fn forward(&self, x: &Tensor, attention: &Attention, cfg: &Gpt2Config) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let (nh, hd) = (self.heads, cfg.n_embd / cfg.n_head);
        let w = nh * hd;
        let scale = if cfg.scale_attn_weights { 1.0 / (hd as f64).sqrt() } else { 1.0 };
        let qkv = self.c_attn.forward(&self.ln_1.forward(x)?)?;
        let heads = |i: usize| qkv.narrow(D::Minus1, i * w, w)?.reshape((b, t, nh, hd))?.transpose(1, 2)?.contiguous();
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let y = match attention {
            Attention::Ring(sp) => super::llama::ring_attention_scaled(&q, &k, &v, scale, sp)?,
            Attention::Masked(mask) => {
                let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
                super::softmax_f32(&att)?.matmul(&v)?
            }
        };
        let y = y.transpose(1, 2)?.reshape((b, t, w))?;
        let x = (x + self.attn_proj.forward(&y)?)?;
        let h = self.c_fc.forward(&self.ln_2.forward(&x)?)?;
        let h = if cfg.activation_function == "gelu" { h.gelu_erf()? } else { h.gelu()? };
        x + self.mlp_proj.forward(&h)?
    }
}

/// The token embedding: candle-nn's, or split by vocabulary over a tensor-parallel group.
enum Gpt2Embedding {
    Whole(Embedding),
    Split(crate::tp::VocabParallelEmbedding),
}

/// GPT-2 with Hugging Face's parameter names (`GPT2LMHeadModel`), dropout left out: whole, or
/// this rank's part of it (a pipeline stage's blocks, split over a tensor-parallel group).
pub struct Gpt2 {
    cfg: Gpt2Config,
    /// The blocks this rank holds (all of them, or a pipeline stage's).
    layers: std::ops::Range<usize>,
    /// On the first stage, and (the tied output layer) on the last.
    wte: Option<Gpt2Embedding>,
    /// On the first stage.
    wpe: Option<Embedding>,
    /// (Shared with the closures of checkpointed blocks, which backward runs again.)
    blocks: Vec<std::sync::Arc<Block>>,
    /// Whether each block this rank holds is checkpointed ([`Gpt2::checkpoint_blocks`]).
    checkpointed: Vec<bool>,
    /// On the last stage.
    ln_f: Option<LayerNorm>,
    /// The tensor-parallel group the model is split over (`None`: whole).
    tp: Option<crate::tp::TensorParallel>,
    /// The sequence-parallel group whose chunks of every sequence this rank runs on (`None`:
    /// whole sequences).
    sp: Option<crate::sp::SequenceParallel>,
    /// What loading left unused (empty for a model not loaded from files).
    report: LoadReport,
}

impl Gpt2 {
    /// Builds the model's variables through `vb` (under `transformer.`), randomly initialised
    /// as `transformers` does (normal 0.02, layer norms 1 and 0).
    pub fn new(cfg: &Gpt2Config, vb: VarBuilder) -> candle_core::Result<Gpt2> {
        Self::new_stage(cfg, vb, None, 0..cfg.n_layer)
    }

    /// Builds this rank's part of the model for `mesh`: the blocks of its pipeline stage (cut
    /// by [`Gpt2Config::block_costs`]), split over its `tp` group ([`Gpt2::new_stage`]), on its
    /// `sp` chunk of every sequence (attention by `kolo::sp::ring_attention`, the learned
    /// positions from the chunk's offset). Train it with `Trainer::with_mesh`: [`Gpt2::loss`],
    /// or [`Gpt2::pipeline_stage`] in a pipeline.
    pub fn new_parallel(cfg: &Gpt2Config, vb: VarBuilder, mesh: &crate::Mesh) -> candle_core::Result<Gpt2> {
        let layers = crate::pp::stage_layers_by(&cfg.block_costs(), mesh).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut m = Self::new_stage(cfg, vb, Some(mesh.tp()), layers)?;
        m.sp = (mesh.sp().size() > 1).then(|| mesh.sp().clone());
        Ok(m)
    }

    /// Builds one pipeline stage of the model (`kolo::pp`): the blocks `layers` (their Hugging
    /// Face names unchanged), the embeddings on the first stage and the final norm on the last,
    /// split over `tp` when given (Megatron's layout: `c_attn` column-parallel by sections, so
    /// each member holds its heads' q, k and v; `attn.c_proj` row-parallel; the MLP's `c_fc`
    /// column- and `c_proj` row-parallel, all cut from the `Conv1D` layout's (in, out) tensors;
    /// the token embedding by vocabulary; `wpe` and the layer norms whole). The output layer is
    /// the token embedding: the last stage holds a copy of it, which the trainer keeps equal to
    /// the first stage's (their gradients summed). The heads and the MLP width must be
    /// multiples of the group's size.
    pub fn new_stage(
        cfg: &Gpt2Config,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
    ) -> candle_core::Result<Gpt2> {
        use crate::tp::{ColumnParallelLinear as Col, RowParallelLinear as Row};
        let vb = vb.pp("transformer");
        let tp = tp.filter(|t| t.size() > 1);
        let p = tp.map_or(1, |t| t.size());
        let (e, inner, n) = (cfg.n_embd, cfg.n_inner.unwrap_or(4 * cfg.n_embd), cfg.n_layer);
        if !cfg.n_head.is_multiple_of(p) || !inner.is_multiple_of(p) {
            candle_core::bail!(
                "GPT-2 over {p} tensor-parallel ranks: n_head {} and the MLP width {inner} must each be a multiple of {p}",
                cfg.n_head
            );
        }
        if layers.start >= layers.end || layers.end > n {
            candle_core::bail!("pipeline stage of layers {layers:?}: the model has {n}");
        }
        let col = |sections: &[usize], vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Col::conv1d(e, sections, vb, t)?),
                None => Box::new(Conv1d::new(e, sections.iter().sum(), vb)?),
            })
        };
        let row = |i: usize, vb: VarBuilder| -> candle_core::Result<Layer> {
            Ok(match tp {
                Some(t) => Box::new(Row::conv1d(i, e, vb, t)?),
                None => Box::new(Conv1d::new(i, e, vb)?),
            })
        };
        let ln = |vb: VarBuilder| layer_norm(e, LayerNormConfig { eps: cfg.layer_norm_epsilon, ..Default::default() }, vb);
        let (first, last) = (layers.start == 0, layers.end == n);
        let mut blocks = Vec::with_capacity(layers.len());
        for i in layers.clone() {
            let b = vb.pp(format!("h.{i}"));
            blocks.push(std::sync::Arc::new(Block {
                ln_1: ln(b.pp("ln_1"))?,
                c_attn: col(&[e, e, e], b.pp("attn.c_attn"))?,
                attn_proj: row(e, b.pp("attn.c_proj"))?,
                ln_2: ln(b.pp("ln_2"))?,
                c_fc: col(&[inner], b.pp("mlp.c_fc"))?,
                mlp_proj: row(inner, b.pp("mlp.c_proj"))?,
                heads: cfg.n_head / p,
            }));
        }
        let wte = match tp {
            _ if !(first || last) => None,
            Some(t) => Some(Gpt2Embedding::Split(crate::tp::VocabParallelEmbedding::new(cfg.vocab_size, e, vb.pp("wte"), t)?)),
            None => Some(Gpt2Embedding::Whole(embedding(cfg.vocab_size, e, vb.pp("wte"))?)),
        };
        Ok(Gpt2 {
            cfg: cfg.clone(),
            layers,
            wte,
            wpe: if first { Some(embedding(cfg.n_positions, e, vb.pp("wpe"))?) } else { None },
            checkpointed: vec![false; blocks.len()],
            blocks,
            ln_f: if last { Some(ln(vb.pp("ln_f"))?) } else { None },
            tp: tp.cloned(),
            sp: None,
            report: LoadReport::default(),
        })
    }

    /// The name prefix of each block this rank holds (`transformer.h.{i}.`), in forward order:
    /// the ZeRO-3 groups for [`crate::Trainer::with_zero3_groups`].
    pub fn block_prefixes(&self) -> Vec<String> {
        self.layers.clone().map(|i| format!("transformer.h.{i}.")).collect()
    }

    /// Activation checkpointing (`transformers`' `gradient_checkpointing_enable`, for the
    /// chosen layers): the blocks `layers` (0-based over the whole model; a pipeline stage
    /// takes those it holds) keep only their input from forward to backward and run again
    /// there ([`crate::checkpoint`]). Training is unchanged, bitwise; memory falls by a
    /// block's activations for one more forward of it. Every rank of a tensor- or
    /// sequence-parallel group must choose the same layers.
    pub fn checkpoint_blocks(&mut self, layers: &[usize]) -> std::result::Result<(), String> {
        self.checkpointed = super::checkpointed(layers, self.layers.clone(), self.cfg.n_layer)?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &Gpt2Config {
        &self.cfg
    }

    /// What loading the checkpoint left unused (tensors, `config.json` keys).
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Whether the checkpoint tensor `name` belongs to a part of the model another pipeline
    /// stage holds, or is not a parameter (the tied output layer, old attention-mask buffers).
    fn elsewhere(&self, name: &str) -> bool {
        if name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") || name == "lm_head.weight" {
            return true;
        }
        let name = name.strip_prefix("transformer.").unwrap_or(name);
        if let Some(i) = name.strip_prefix("h.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok()) {
            return !self.layers.contains(&i);
        }
        match name {
            "wte.weight" => self.wte.is_none(),
            "wpe.weight" => self.wpe.is_none(),
            "ln_f.weight" | "ln_f.bias" => self.ln_f.is_none(),
            _ => false,
        }
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq). Split over a tensor-parallel
    /// group, every member gets the whole logits (a collective; train with [`Gpt2::loss`]).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        if self.layers != (0..self.cfg.n_layer) {
            candle_core::bail!("this rank holds the pipeline stage of layers {:?}: run it with Gpt2::pipeline_stage", self.layers);
        }
        if self.sp.is_some() {
            candle_core::bail!("a sequence-parallel model runs on its chunk of each sequence: train and evaluate with Gpt2::loss");
        }
        let logits = self.head(&self.blocks(&self.embed(ids)?)?)?;
        match &self.tp {
            Some(t) => crate::tp::gather_vocab(&logits, self.cfg.vocab_size, t),
            None => Ok(logits),
        }
    }

    /// The first stage's token and position embeddings of `ids` (batch, seq; under sequence
    /// parallelism this rank's chunk, whose positions start at its offset).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let t = ids.dim(1)?;
        let from = self.sp.as_ref().map_or(0, |sp| sp.rank() * t);
        if from + t > self.cfg.n_positions {
            candle_core::bail!("sequence of {} tokens is longer than n_positions {}", from + t, self.cfg.n_positions);
        }
        let (Some(wte), Some(wpe)) = (&self.wte, &self.wpe) else {
            candle_core::bail!("the embeddings are on the first pipeline stage, not layers {:?}", self.layers);
        };
        let pos = Tensor::arange(from as u32, (from + t) as u32, ids.device())?;
        let tokens = match wte {
            Gpt2Embedding::Whole(e) => e.forward(ids)?,
            Gpt2Embedding::Split(e) => e.forward(ids)?,
        };
        tokens.broadcast_add(&wpe.forward(&pos)?)
    }

    /// This rank's blocks on the hidden states `x` (batch, seq, n_embd).
    fn blocks(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        // Attention: over the ring on sequence chunks (causal by chunk order), else masked.
        let attention = match &self.sp {
            Some(sp) => Attention::Ring(sp.clone()),
            None => Attention::Masked(super::causal_mask(t, None, x.device(), x.dtype())?),
        };
        let forward: fn(&Block, &Tensor, &(Attention, Gpt2Config)) -> candle_core::Result<Tensor> = |b, x, (a, cfg)| b.forward(x, a, cfg);
        super::run_blocks(&self.blocks, &self.checkpointed, x, (attention, self.cfg.clone()), forward)
    }

    /// The last stage's final norm and the tied output layer: logits of this rank's vocabulary
    /// range.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (Some(ln_f), Some(wte)) = (&self.ln_f, &self.wte) else {
            candle_core::bail!("the output layer is on the last pipeline stage, not layers {:?}", self.layers);
        };
        let x = ln_f.forward(x)?;
        match wte {
            Gpt2Embedding::Whole(e) => x.broadcast_matmul(&e.embeddings().t()?),
            Gpt2Embedding::Split(e) => e.tied_logits(&x),
        }
    }

    /// This rank's pipeline stage (`kolo::pp::Pipeline::step`'s closure) on the micro-batch
    /// `windows` (batch, seq + 1) of token ids: the first stage embeds `windows[:, ..seq]`, the
    /// others take the previous stage's hidden states `input` (batch, seq, n_embd); the last
    /// stage returns the mean next-token cross-entropy against `windows[:, 1..]`
    /// (vocabulary-parallel when split), the others their hidden states.
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        let head = |x: &Tensor| self.head(x);
        // Sequence parallelism: this rank's chunk of the inputs and of the targets.
        let chunk = |x: Tensor| match &self.sp {
            Some(sp) => sp.chunk(&x, 1),
            None => Ok(x),
        };
        let parts = super::StageParts {
            embed: &|ids| self.embed(ids),
            blocks: &|x| self.blocks(x),
            head: self.ln_f.as_ref().map(|_| &head as super::Part<'_>),
            chunk: &chunk,
            vocab: self.cfg.vocab_size,
            tp: self.tp.as_ref(),
        };
        super::run_stage(parts, input, windows)
    }

    /// Mean next-token cross-entropy of `ids` (batch, seq): position i predicts token i + 1;
    /// split over a tensor-parallel group, the vocabulary-parallel cross-entropy.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.pipeline_stage(None, ids)
    }
}

/// Builds a GPT-2 from `dir` (`config.json`, `model.safetensors`) into a new VarMap on `device`.
pub fn load_gpt2(dir: &Path, device: &Device) -> Result<(VarMap, Gpt2)> {
    load_gpt2_stage(dir, device, None, None, DType::F32)
}

/// Builds this rank's part of the GPT-2 in `dir`: split over `tp` when given, or its part for
/// `mesh` ([`Gpt2::new_parallel`]); each rank reads only its pieces of the checkpoint.
pub(super) fn load_gpt2_stage(
    dir: &Path,
    device: &Device,
    tp: Option<&crate::tp::TensorParallel>,
    mesh: Option<&crate::Mesh>,
    dtype: DType,
) -> Result<(VarMap, Gpt2)> {
    let cfg = Gpt2Config::load(dir)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let mut model = match mesh {
        Some(m) => Gpt2::new_parallel(&cfg, vb, m),
        None => Gpt2::new_stage(&cfg, vb, tp, 0..cfg.n_layer),
    }
    .map_err(|e| Error::file(dir.join("config.json"), e))?;
    let unused_tensors = Weights::open(dir)?.fill(&varmap, &|n| model.elsewhere(n))?;
    model.report = LoadReport { unused_tensors, unknown_keys: cfg.unknown_keys() };
    Ok((varmap, model))
}
