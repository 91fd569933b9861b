//! Hugging Face checkpoints in and out: a directory with `config.json` and `model.safetensors`
//! (or the shards `model.safetensors.index.json` names), as `transformers`' `save_pretrained`
//! writes it.
//!
//! The models are written with candle-nn over a `VarMap` whose names are Hugging Face's
//! (`model.layers.0.self_attn.q_proj.weight`, ...), so they train under
//! [`Trainer`](crate::Trainer) like any user model: [`Gpt2`] (`gpt2`), [`GptNeox`]
//! (`gpt_neox`) and [`Llama`] for the Llama family ([`FAMILY`]: `llama` with Llama 3's, YaRN and
//! LongRoPE rotary scaling, `mistral`, `mixtral` (its experts through [`crate::ep::MoeLayer`]),
//! `qwen2`, `qwen2_moe` (with its shared expert), `qwen3`, `qwen3_moe`, `deepseek_v2`, `deepseek_v3` (latent attention), `gemma`, `gemma2`, `gemma3_text`, `phi3`), which also splits over a [`crate::Mesh`].
//! [`load_causal_lm`] picks one by `config.json`'s `model_type`, refusing by name what changes
//! the arithmetic and is not implemented; [`save_pretrained_with`] writes whole, shaped tensors
//! under those names back out, with the `format = pt` metadata `transformers` requires.
//! [`FineTune`] is `kolo train`'s job for a config whose `[model]` names `hf`.

mod files;
pub mod finetune;
mod gpt2;
mod llama;
mod neox;

pub use files::{load_weights, save_pretrained, save_pretrained_with, LoadReport, SaveOptions};
pub use finetune::{export_checkpoint, FineTune, FineTuneConfig};
pub use gpt2::{load_gpt2, Gpt2, Gpt2Config};
use llama::load_llama_stage;
pub use llama::{load_llama, Llama, LlamaConfig, Rope, FAMILY};
pub use neox::{load_neox, GptNeox, NeoxConfig};

/// `config.json` keys of every architecture that leave a training step's arithmetic unchanged:
/// bookkeeping, generation defaults, and dropout (Kolo trains without it).
pub(crate) const HARMLESS_KEYS: &[&str] = &[
    "_name_or_path",
    "architectures",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "attention_dropout",
    "pretraining_tp",
    "id2label",
    "label2id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tie_word_embeddings",
    "max_length",
    "tokenizer_class",
    "prefix",
    "sep_token_id",
    "decoder_start_token_id",
];

use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarMap;
use std::path::Path;

/// A Hugging Face causal language model Kolo can load: chosen by `config.json`'s `model_type`.
pub enum CausalLm {
    /// `gpt2`.
    Gpt2(Gpt2),
    /// `llama`, `mistral`, `mixtral`, `qwen2`, `qwen2_moe`, `qwen3`, `qwen3_moe`, `deepseek_v2`, `deepseek_v3`, `gemma`, `gemma2`, `gemma3_text`, `phi3` ([`FAMILY`]).
    Llama(Llama),
    /// `gpt_neox`.
    GptNeox(GptNeox),
}

impl CausalLm {
    /// Logits (batch, seq, vocab) for token ids (batch, seq).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::Gpt2(m) => m.forward(ids),
            CausalLm::Llama(m) => m.forward(ids),
            CausalLm::GptNeox(m) => m.forward(ids),
        }
    }
    /// Mean next-token cross-entropy of `ids` (batch, seq).
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::Gpt2(m) => m.loss(ids),
            CausalLm::Llama(m) => m.loss(ids),
            CausalLm::GptNeox(m) => m.loss(ids),
        }
    }
    /// Activation checkpointing of the blocks `layers` (0-based over the whole model):
    /// [`Llama::checkpoint_blocks`], [`Gpt2::checkpoint_blocks`], [`GptNeox::checkpoint_blocks`].
    pub fn checkpoint_blocks(&mut self, layers: &[usize]) -> std::result::Result<(), String> {
        match self {
            CausalLm::Gpt2(m) => m.checkpoint_blocks(layers),
            CausalLm::Llama(m) => m.checkpoint_blocks(layers),
            CausalLm::GptNeox(m) => m.checkpoint_blocks(layers),
        }
    }
    /// Width of the hidden states between blocks (what a pipeline stage hands the next).
    pub fn hidden_size(&self) -> usize {
        match self {
            CausalLm::Gpt2(m) => m.config().n_embd,
            CausalLm::Llama(m) => m.config().hidden_size,
            CausalLm::GptNeox(m) => m.config().hidden_size,
        }
    }
    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        match self {
            CausalLm::Gpt2(m) => m.config().vocab_size,
            CausalLm::Llama(m) => m.config().vocab_size,
            CausalLm::GptNeox(m) => m.config().vocab_size,
        }
    }
    /// Writes the model as `save_pretrained` does ([`save_pretrained`] with its config).
    pub fn save_pretrained(&self, dir: &Path, varmap: &VarMap) -> Result<()> {
        self.save_pretrained_with(dir, varmap, &SaveOptions::default())
    }
    /// Writes the model as [`save_pretrained_with`] does: a dtype, shards of a largest size.
    pub fn save_pretrained_with(&self, dir: &Path, varmap: &VarMap, opts: &SaveOptions) -> Result<()> {
        save_pretrained_with(dir, varmap, &self.config_json(), opts)
    }
    /// The model's `config.json`, as an export writes it (every field of the file it was
    /// loaded from).
    pub fn config_json(&self) -> serde_json::Value {
        match self {
            CausalLm::Gpt2(m) => serde_json::to_value(m.config()),
            CausalLm::Llama(m) => serde_json::to_value(m.config()),
            CausalLm::GptNeox(m) => serde_json::to_value(m.config()),
        }
        .expect("a config serializes")
    }
    /// What loading the checkpoint left unused: tensors no parameter took, `config.json` keys
    /// not read (the loaders also print it when it is not empty, as `transformers` does).
    pub fn load_report(&self) -> &LoadReport {
        match self {
            CausalLm::Gpt2(m) => m.load_report(),
            CausalLm::Llama(m) => m.load_report(),
            CausalLm::GptNeox(m) => m.load_report(),
        }
    }
    /// This rank's pipeline stage on the micro-batch `windows` ([`Llama::pipeline_stage`]).
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            CausalLm::GptNeox(m) => m.pipeline_stage(input, windows),
            CausalLm::Gpt2(m) => m.pipeline_stage(input, windows),
            CausalLm::Llama(m) => m.pipeline_stage(input, windows),
        }
    }
    /// The shape of the activation this rank's pipeline stage hands the next for a micro-batch
    /// of `rows` sequences (or their sequence-parallel chunks) of `t` tokens: the hidden states
    /// (rows, t, hidden), or ([`Llama::stage_activation`]) with a load-balancing loss over the
    /// stages, those flattened and followed by the routing so far.
    pub fn stage_activation(&self, rows: usize, t: usize) -> Vec<usize> {
        match self {
            CausalLm::Llama(m) => m.stage_activation(rows, t),
            CausalLm::Gpt2(_) | CausalLm::GptNeox(_) => vec![rows, t, self.hidden_size()],
        }
    }
    /// Whether the experts are chosen with a selection bias ([`Llama::has_selection_bias`]).
    pub fn has_selection_bias(&self) -> bool {
        matches!(self, CausalLm::Llama(m) if m.has_selection_bias())
    }
    /// [`Llama::update_expert_bias`]; nothing for a model without a selection bias.
    pub fn update_expert_bias(&self, balance: &crate::ep::ExpertBias, trainer: &mut crate::Trainer) -> Result<()> {
        match self {
            CausalLm::Llama(m) => m.update_expert_bias(balance, trainer),
            CausalLm::Gpt2(_) | CausalLm::GptNeox(_) => Ok(()),
        }
    }
    /// [`Llama::forget_expert_load`].
    pub fn forget_expert_load(&self) {
        if let CausalLm::Llama(m) = self {
            m.forget_expert_load();
        }
    }
    /// Experts per mixture-of-experts layer (Mixtral's and Qwen3-MoE's `num_local_experts`); `None` for a model
    /// without experts.
    pub fn experts(&self) -> Option<usize> {
        match self {
            CausalLm::Llama(m) => m.config().experts().map(|(r, _)| r.experts),
            CausalLm::Gpt2(_) | CausalLm::GptNeox(_) => None,
        }
    }
    /// The ZeRO-3 groups of the model's blocks, in forward order.
    pub fn block_prefixes(&self) -> Vec<String> {
        match self {
            CausalLm::Gpt2(m) => m.block_prefixes(),
            CausalLm::Llama(m) => m.block_prefixes(),
            CausalLm::GptNeox(m) => m.block_prefixes(),
        }
    }
}

/// The additive causal mask (t, t) of attention in `dtype`: query i sees key j <= i (with a
/// `window` w, only j > i - w), 0 where it sees and minus infinity elsewhere.
pub(super) fn causal_mask(t: usize, window: Option<usize>, device: &Device, dtype: DType) -> candle_core::Result<Tensor> {
    let seen = |q: usize, k: usize| k <= q && window.is_none_or(|w| k + w > q);
    let mask: Vec<f32> = (0..t * t).map(|i| if seen(i / t, i % t) { 0.0 } else { f32::NEG_INFINITY }).collect();
    Tensor::from_vec(mask, (t, t), device)?.to_dtype(dtype)
}

/// Softmax over the last dimension of attention scores, in f32 whatever their dtype (as
/// `transformers`' eager attention: `softmax(.., dtype=torch.float32).to(query.dtype)`).
pub(super) fn softmax_f32(scores: &Tensor) -> candle_core::Result<Tensor> {
    match scores.dtype() {
        DType::F32 => candle_nn::ops::softmax_last_dim(scores),
        d => candle_nn::ops::softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(d),
    }
}

/// A part of a model as a function of tensors.
pub(super) type Part<'a> = &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>;

/// One architecture's parts of a pipeline stage, for [`run_stage`].
pub(super) struct StageParts<'a> {
    /// The first stage's embedding of token ids.
    pub embed: Part<'a>,
    /// This rank's blocks on hidden states.
    pub blocks: Part<'a>,
    /// The last stage's final norm and output layer (`None` on the other stages).
    pub head: Option<Part<'a>>,
    /// This rank's part of a sequence (its sequence-parallel chunk; the identity without one).
    pub chunk: &'a dyn Fn(Tensor) -> candle_core::Result<Tensor>,
    pub vocab: usize,
    pub tp: Option<&'a crate::tp::TensorParallel>,
}

/// A pipeline stage of a causal language model on the micro-batch `windows` (batch, seq + 1)
/// of token ids, the same for every architecture: the first stage embeds `windows[:, ..seq]`,
/// the others take the previous stage's hidden states `input`; the last stage returns the mean
/// next-token cross-entropy against `windows[:, 1..]` (vocabulary-parallel over `tp`), the
/// others their hidden states.
pub(super) fn run_stage(parts: StageParts<'_>, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
    let t = windows.dim(1)? - 1;
    let x = match input {
        Some(x) => x.clone(),
        None => (parts.embed)(&(parts.chunk)(windows.narrow(1, 0, t)?)?)?,
    };
    let x = (parts.blocks)(&x)?;
    let Some(head) = parts.head else { return Ok(x) };
    let logits = head(&x)?;
    let targets = (parts.chunk)(windows.narrow(1, 1, t)?)?;
    // The loss in f32 whatever the model's dtype (as `transformers` upcasts the logits).
    match parts.tp {
        Some(tp) => crate::tp::vocab_parallel_cross_entropy(&logits, &targets, parts.vocab, tp),
        None => candle_nn::loss::cross_entropy(&logits.reshape(((), parts.vocab))?.to_dtype(DType::F32)?, &targets.flatten_all()?),
    }
}

/// Loads this rank's part of the causal language model in `dir` for `mesh`, its parameters in
/// `dtype` (f32; bf16 or f16 for mixed precision, `train.precision`: the trainer keeps f32
/// masters)
/// ([`Llama::new_parallel`]: a Llama-style model's blocks of this rank's pipeline stage, split
/// over the mesh's `tp` group, on its `sp` chunk of each sequence, Mixtral's experts dealt out
/// over its `ep` group; [`Gpt2::new_parallel`]: the same without experts;
/// [`GptNeox::new_parallel`]: without `sp` either); each rank reads only its pieces of the
/// checkpoint. Train it with `Trainer::with_mesh`,
/// a pipeline's stages with [`CausalLm::pipeline_stage`]; `Mesh::whole_varmap` puts it together
/// for an export.
pub fn load_causal_lm_parallel(dir: &Path, device: &Device, mesh: &crate::Mesh, dtype: DType) -> Result<(VarMap, CausalLm)> {
    let staged = mesh.size("pp") > 1 || mesh.size("sp") > 1 || mesh.size("ep") > 1;
    load(dir, device, Some(mesh.tp()), staged.then_some(mesh), dtype)
}

/// Loads the causal language model in `dir` (by `config.json`'s `model_type`: `gpt2`, or the
/// Llama-style ones of [`FAMILY`]) into a new VarMap on `device`. The weights are
/// `model.safetensors` or the shards `model.safetensors.index.json` names. What the checkpoint
/// holds that the model does not read is printed and kept ([`CausalLm::load_report`]).
pub fn load_causal_lm(dir: &Path, device: &Device) -> Result<(VarMap, CausalLm)> {
    load(dir, device, None, None, DType::F32)
}

/// As [`load_causal_lm`], split over the tensor-parallel group `tp` when it has more than one
/// rank ([`Llama::new_split`], [`Gpt2::new_stage`], [`GptNeox::new_split`]): each rank keeps
/// its pieces. Train it with `Trainer::with_mesh`; `Mesh::whole_varmap` gathers it for an export.
pub fn load_causal_lm_split(dir: &Path, device: &Device, tp: Option<&crate::tp::TensorParallel>) -> Result<(VarMap, CausalLm)> {
    load(dir, device, tp, None, DType::F32)
}

/// The loaders' one path: `mesh` when the model is cut into pipeline stages or sequence chunks.
fn load(
    dir: &Path,
    device: &Device,
    tp: Option<&crate::tp::TensorParallel>,
    mesh: Option<&crate::Mesh>,
    dtype: DType,
) -> Result<(VarMap, CausalLm)> {
    let tp = tp.filter(|t| t.size() > 1);
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
    let (varmap, model) = match v.get("model_type").and_then(|t| t.as_str()) {
        Some("gpt2") => gpt2::load_gpt2_stage(dir, device, tp, mesh, dtype).map(|(v, m)| (v, CausalLm::Gpt2(m)))?,
        Some("gpt_neox") => neox::load_neox_stage(dir, device, tp, mesh, dtype).map(|(v, m)| (v, CausalLm::GptNeox(m)))?,
        // Gemma 3 with a vision tower: its text model.
        Some(t) if llama::FAMILY.contains(&t) || t == "gemma3" => {
            load_llama_stage(dir, device, tp, mesh, dtype).map(|(v, m)| (v, CausalLm::Llama(m)))?
        }
        Some(t) => {
            return Err(Error::file(
                &path,
                format!("model_type \"{t}\" is not supported (gpt2, gpt_neox, {}, gemma3)", llama::FAMILY.join(", ")),
            ))
        }
        None => return Err(Error::file(&path, "no model_type")),
    };
    if !model.load_report().is_empty() {
        eprintln!("kolo::hf: {}: {}", dir.display(), model.load_report());
    }
    Ok((varmap, model))
}

/// Which of a rank's blocks `layers` (0-based over the whole model of `n` layers) names, for
/// a rank holding `held`: `checkpoint_blocks` of the Hugging Face models.
pub(crate) fn checkpointed(layers: &[usize], held: std::ops::Range<usize>, n: usize) -> std::result::Result<Vec<bool>, String> {
    if let Some(i) = layers.iter().find(|&&i| i >= n) {
        return Err(format!("checkpoint_blocks: layer {i} of a model of {n} layers"));
    }
    Ok(held.map(|i| layers.contains(&i)).collect())
}

/// `blocks` in order on `x`, each through `forward(block, x, ctx)`; those `checkpointed`
/// marks through [`crate::checkpoint`] (the block and `ctx` shared with its closure, which
/// backward runs again).
pub(crate) fn run_blocks<B, C>(
    blocks: &[std::sync::Arc<B>],
    checkpointed: &[bool],
    x: &Tensor,
    ctx: C,
    forward: fn(&B, &Tensor, &C) -> candle_core::Result<Tensor>,
) -> candle_core::Result<Tensor>
where
    B: Send + Sync + 'static,
    C: Send + Sync + 'static,
{
    let ctx = std::sync::Arc::new(ctx);
    let mut x = x.clone();
    for (blk, &ckpt) in blocks.iter().zip(checkpointed) {
        x = match ckpt {
            true => {
                let (blk, ctx) = (blk.clone(), ctx.clone());
                crate::checkpoint(&x, move |x| forward(&blk, x, &ctx))?
            }
            false => forward(blk, &x, &ctx)?,
        };
    }
    Ok(x)
}
