//! Fine-tuning a Hugging Face causal language model end to end: what `kolo train` runs for a
//! config with `[model] hf = "DIR"`, and what the `hf_finetune` example drives from its flags.
//!
//! ```toml
//! [model]
//! hf = "test-data/hf/llama-tiny"        # config.json, model.safetensors (or an index), tokenizer.json
//! [data]
//! shards = "data/llama-shards"          # token shards from `kolo data prepare --tokenizer DIR`
//! batch_size = 4                        # sequences per data-parallel replica and step
//! seq = 32                              # tokens per sequence
//! eval_fraction = 0.1                   # the shards' last windows, held out for evaluation
//! [mesh]                                # optional: tp, pp, sp, ep (MoE models; dp: the rest)
//! tp = 2
//! [pipeline]                            # with pp > 1
//! micro_batches = 2
//! [optim]                               # [optim], [ddp] and [train] as for kolo train
//! kind = "adamw"
//! lr = 1e-3
//! [train]
//! steps = 100
//! eval_every = 20
//! checkpoint_dir = "checkpoints/llama"
//! checkpoint_every = 50
//! [export]                              # optional: written at the end (kolo export --hf does it later)
//! dir = "out/llama-finetuned"
//! dtype = "bf16"
//! ```

use super::{load_causal_lm_parallel, CausalLm, SaveOptions};
use crate::options::{DdpConfig, OptimConfig, TrainConfig};
use crate::{Dist, Error, Mesh, Result, TrainOptions, Trainer};
use candle_core::{DType, Tensor};
use candle_nn::VarMap;
use kolo_comm::{BufMut, ReduceOp};
use kolo_train::config::{MeshConfig, PipeSchedule, PipelineConfig};
use std::path::{Path, PathBuf};

/// The checkpoint metadata key holding the model's `config.json`, so that `kolo export --hf`
/// needs only the checkpoint.
pub const CONFIG_META: &str = "hf.config";
/// The checkpoint metadata key holding the model directory the job started from, whose
/// tokenizer files an export copies.
pub const DIR_META: &str = "hf.dir";

/// The files beside a model's weights that an export carries over (tokenizer, generation).
const COMPANIONS: &[&str] =
    &["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt", "generation_config.json"];

/// Copies `from`'s tokenizer and generation files that exist into `to`.
fn copy_companions(from: &Path, to: &Path) -> Result<()> {
    for name in COMPANIONS {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, to.join(name)).map_err(|e| Error::io(&src, e))?;
        }
    }
    Ok(())
}

/// A fine-tuning job: the TOML of `kolo train --config` when `[model]` names `hf`.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct FineTuneConfig {
    /// `hf`: the model's directory.
    pub model: HfModel,
    /// The token windows and the held-out split.
    pub data: HfData,
    /// `tp`, `pp`, `sp`, `ep` (a model with experts: Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V2/V3; with tp, pp and sp too) and `dp`
    /// (else the rest of the world).
    pub mesh: Option<MeshConfig>,
    /// Micro-batches and schedule (`gpipe` or `1f1b`) when `mesh.pp` > 1.
    pub pipeline: Option<PipelineConfig>,
    /// As `kolo train`'s.
    #[serde(default)]
    pub optim: OptimConfig,
    /// As `kolo train`'s (ZeRO stage 0-3; 3 only without a mesh).
    #[serde(default)]
    pub ddp: DdpConfig,
    /// As `kolo train`'s: steps, logging, checkpoints; `eval_every` and `eval_batches` for the
    /// held-out split; `seed` for the data order.
    #[serde(default)]
    pub train: TrainConfig,
    /// Where to write the fine-tuned model at the end, as `transformers` reads it.
    pub export: Option<HfExport>,
}

/// `[model]` of a fine-tuning job.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct HfModel {
    /// The Hugging Face model directory.
    pub hf: PathBuf,
    /// DeepSeek-V3's balancing without an auxiliary loss: after every step's backward passes,
    /// each MoE layer's selection bias (`e_score_correction_bias`) moves by this much towards
    /// the experts that were given fewer than the mean of the step's tokens, over every rank
    /// (the paper's 0.001; 0, the default, leaves it, as `transformers` does). Only for a model
    /// with a selection bias.
    #[serde(default)]
    pub expert_bias_rate: f64,
    /// Decoder layers (0-based) whose activations are recomputed in backward instead of kept
    /// (activation checkpointing, `transformers`' `gradient_checkpointing`, for these layers:
    /// less memory for about one more forward of each; training unchanged). Default none.
    #[serde(default)]
    pub checkpoint_blocks: Vec<usize>,
}

/// `[data]` of a fine-tuning job: windows of `seq + 1` tokens.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct HfData {
    /// Token shards written by `kolo data prepare` with the model's tokenizer.
    pub shards: Option<PathBuf>,
    /// Instead, a text file whose bytes modulo the vocabulary are the tokens (a stand-in for a
    /// model without a tokenizer).
    pub text: Option<PathBuf>,
    /// Sequences per data-parallel replica and step.
    pub batch_size: usize,
    /// Tokens per sequence (each window holds one more, the last target).
    pub seq: usize,
    /// Fraction of the windows, the last ones, held out for evaluation (default 0.1; 0: none).
    #[serde(default = "default_eval_fraction")]
    pub eval_fraction: f64,
}

fn default_eval_fraction() -> f64 {
    0.1
}

/// `[export]` of a fine-tuning job.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct HfExport {
    /// The directory to write (`config.json`, the weights).
    pub dir: PathBuf,
    /// `f32` (default), `bf16` or `f16`.
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Largest weights file in bytes (default: one file).
    pub max_shard_size: Option<u64>,
}

fn default_dtype() -> String {
    "f32".into()
}

/// The dtype an export names: `f32`, `bf16` or `f16`.
pub fn export_dtype(name: &str) -> Result<DType> {
    match name {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        d => Err(Error::setting("export.dtype", format!("\"{d}\" is not f32, bf16 or f16"))),
    }
}

impl FineTuneConfig {
    /// Reads a fine-tuning job from TOML text (`path` names it in errors).
    pub fn from_toml_str(text: &str, path: &Path) -> Result<FineTuneConfig> {
        let cfg: FineTuneConfig = toml::from_str(text).map_err(|e| Error::file(path, e))?;
        cfg.check().map_err(|e| Error::file(path, e))?;
        Ok(cfg)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let d = &self.data;
        if d.shards.is_some() == d.text.is_some() {
            return Err("[data] needs one of shards (token shards from `kolo data prepare`) or text".into());
        }
        if d.batch_size == 0 || d.seq == 0 {
            return Err(format!("data.batch_size {} and data.seq {} must be positive", d.batch_size, d.seq));
        }
        if !(self.model.expert_bias_rate >= 0.0 && self.model.expert_bias_rate.is_finite()) {
            return Err(format!("model.expert_bias_rate {} is not a number >= 0", self.model.expert_bias_rate));
        }
        if !(0.0..1.0).contains(&d.eval_fraction) {
            return Err(format!("data.eval_fraction {} is not in [0, 1)", d.eval_fraction));
        }
        let (pp, micro) = (self.pp(), self.micro_batches());
        if pp > 1 && self.pipeline.as_ref().is_some_and(|p| p.schedule == PipeSchedule::TwoBw) && self.model.expert_bias_rate > 0.0 {
            return Err("model.expert_bias_rate with pipeline.schedule = \"2bw\" (a stream routes the next step's tokens before this step's update) is not supported".into());
        }
        if !d.batch_size.is_multiple_of(micro) {
            return Err(format!("data.batch_size {} is not a multiple of pipeline.micro_batches {micro}", d.batch_size));
        }
        if let Some(e) = &self.export {
            export_dtype(&e.dtype).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn pp(&self) -> usize {
        self.mesh.as_ref().and_then(|m| m.pp).unwrap_or(1)
    }

    fn micro_batches(&self) -> usize {
        match (self.pp(), &self.pipeline) {
            (1, _) => 1,
            (_, Some(p)) => p.micro_batches.max(1),
            (_, None) => 2,
        }
    }

    /// The trainer's options: the job's `[optim]`, `[ddp]` and `[train]`, and the
    /// micro-batches of a pipeline as gradient accumulation.
    pub(crate) fn train_options(&self) -> TrainOptions {
        let mut train = self.train.clone();
        if self.pp() > 1 {
            train.grad_accum = self.micro_batches() as u64;
        }
        let mut opts = TrainOptions { optim: self.optim.clone(), ddp: self.ddp.clone(), train, ..Default::default() };
        // The trainer counts `batch_size` per micro-step (its global batch, for throughput and
        // `optim.reference_batch`'s learning rate, is batch_size x replicas x grad_accum): a
        // pipeline's micro-batch.
        opts.data.batch_size = self.data.batch_size / self.micro_batches().max(1);
        opts.data.tokens_per_example = self.data.seq;
        opts
    }
}

/// The windows of a job's data: token shards or a text's bytes.
/// The windows `rows` of `windows` as a (rows, seq + 1) batch of token ids.
fn window_batch(windows: &Windows, rows: &[usize], seq: usize, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let ids: Vec<u32> = rows.iter().flat_map(|&w| windows.get(w, seq + 1)).collect();
    Tensor::from_vec(ids, (rows.len(), seq + 1), device)
}

enum Windows {
    Shards(crate::tokens::TokenShards),
    Text(Vec<u32>),
}

impl Windows {
    fn count(&self, len: usize) -> usize {
        match self {
            Windows::Shards(s) => s.windows(len),
            Windows::Text(t) => t.len() / len,
        }
    }
    fn get(&self, i: usize, len: usize) -> Vec<u32> {
        match self {
            Windows::Shards(s) => s.window(i, len),
            Windows::Text(t) => t[i * len..(i + 1) * len].to_vec(),
        }
    }
}

/// A fine-tuning job built on this rank: the model's part for the mesh, its trainer and data.
/// [`FineTune::run`] trains, evaluates and checkpoints; [`FineTune::export`] writes the model.
pub struct FineTune {
    cfg: FineTuneConfig,
    dist: Dist,
    mesh: Mesh,
    varmap: VarMap,
    model: CausalLm,
    trainer: Trainer,
    windows: Windows,
    /// Windows `0..train` train, `train..` are held out.
    train: usize,
    /// `model.expert_bias_rate` > 0: DeepSeek-V3's balancing, on its own communicator.
    balance: Option<crate::ep::ExpertBias>,
}

impl FineTune {
    /// Loads this rank's part of the model for the job's mesh (each rank reads only its pieces)
    /// and builds the trainer (ZeRO-3 over the model's blocks when `ddp.zero_stage = 3`).
    pub fn new(dist: &Dist, cfg: FineTuneConfig) -> Result<FineTune> {
        cfg.check().map_err(|e| Error::setting("fine-tuning job", e))?;
        dist.use_device(&cfg.train.device)?; // the model is loaded onto it
        let m = cfg.mesh.clone().unwrap_or(MeshConfig { tp: 1, pp: None, dp: None, sp: 1, ep: 1 });
        let (tp, pp, sp, ep) = (m.tp, m.pp.unwrap_or(1), m.sp, m.ep);
        let dp = m.dp.unwrap_or(dist.world_size() / (tp * pp * sp * ep).max(1));
        let mesh = Mesh::new(dist, &[("pp", pp), ("dp", dp), ("ep", ep), ("sp", sp), ("tp", tp)])?;
        // Mixed precision: the model in bf16/f16, the trainer's masters in f32.
        let (varmap, mut model) = load_causal_lm_parallel(&cfg.model.hf, &dist.device(), &mesh, cfg.train.precision.dtype())?;
        model.checkpoint_blocks(&cfg.model.checkpoint_blocks).map_err(|e| Error::setting("model.checkpoint_blocks", e))?;
        if ep > 1 && model.experts().is_none() {
            return Err(Error::setting(
                "mesh.ep",
                format!(
                    "expert parallelism over {ep} ranks is for models with experts (mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3); {} has none",
                    cfg.model.hf.display()
                ),
            ));
        }
        if cfg.ddp.deterministic && cfg.model.expert_bias_rate > 0.0 {
            let why = "ddp.deterministic sums each piece of a batch on its own, and model.expert_bias_rate moves the selection biases between the step's backward and its update: set one of them";
            return Err(Error::setting("ddp.deterministic", why));
        }
        if cfg.model.expert_bias_rate > 0.0 && !model.has_selection_bias() {
            return Err(Error::setting(
                "model.expert_bias_rate",
                format!(
                    "{}: the model has no selection bias to move (DeepSeek-V3's e_score_correction_bias; its model_type is {})",
                    cfg.model.hf.display(),
                    model.config_json()["model_type"]
                ),
            ));
        }
        let opts = cfg.train_options();
        // ZeRO-3: the blocks' values (this rank's pieces of them on a mesh) live as shards over
        // the data-parallel ranks, gathered into the model when used.
        let groups = model.block_prefixes();
        let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
        let trainer = if tp * pp * sp * ep > 1 && opts.ddp.zero_stage == 3 {
            Trainer::with_mesh_zero3_groups(&varmap, &mesh, opts, &groups)?
        } else if tp * pp * sp * ep > 1 {
            Trainer::with_mesh(&varmap, &mesh, opts)?
        } else if opts.ddp.zero_stage == 3 {
            Trainer::with_zero3_groups(&varmap, dist, opts, &groups)?
        } else {
            Trainer::new(&varmap, dist, opts)?
        };
        let vocab = model.vocab_size();
        let windows = match (&cfg.data.shards, &cfg.data.text) {
            (Some(dir), _) => {
                let s = crate::tokens::TokenShards::open(dir)?;
                s.check(None, vocab)?;
                Windows::Shards(s)
            }
            (None, Some(path)) => {
                let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
                Windows::Text(bytes.iter().map(|b| u32::from(*b) % vocab as u32).collect())
            }
            (None, None) => unreachable!("checked"),
        };
        let n = windows.count(cfg.data.seq + 1);
        let held = (n as f64 * cfg.data.eval_fraction).ceil() as usize;
        let train = n - held.min(n);
        let need = cfg.data.batch_size * dp * ep;
        if train < need {
            return Err(Error::setting(
                "data",
                format!("{n} windows of {} tokens leave {train} to train on, fewer than a global batch of {need}", cfg.data.seq + 1),
            ));
        }
        let rate = cfg.model.expert_bias_rate;
        let balance = (rate > 0.0).then(|| crate::ep::ExpertBias::new(&**dist.comm(), rate)).transpose()?;
        let mut ft = FineTune { cfg, dist: dist.clone(), mesh, varmap, model, trainer, windows, train, balance };
        let config = ft.model.config_json().to_string();
        ft.trainer.set_checkpoint_meta(CONFIG_META, &config)?;
        let from = std::fs::canonicalize(&ft.cfg.model.hf).unwrap_or_else(|_| ft.cfg.model.hf.clone());
        ft.trainer.set_checkpoint_meta(DIR_META, &from.display().to_string())?;
        Ok(ft)
    }

    /// This rank's part of the model.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// The trainer (for its step count, learning rate, checkpoints).
    pub fn trainer(&mut self) -> &mut Trainer {
        &mut self.trainer
    }

    /// The mesh the job runs on.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    /// The ranks that read their own windows (`dp x ep`: the members of an expert-parallel
    /// group hold different experts and train on different tokens), and this rank's index among
    /// them; the members of a tensor-parallel, pipeline or sequence-parallel group read the same.
    fn data_replicas(&self) -> (usize, usize) {
        let ep = self.mesh.size("ep");
        (self.mesh.size("dp") * ep, self.mesh.coord("dp") * ep + self.mesh.coord("ep"))
    }

    /// Trains `train.steps` steps (from the checkpoint `resume` when given: parameters,
    /// optimizer, step and the data position, at any world size), evaluating the held-out
    /// windows every `train.eval_every` steps and at the end; returns the last evaluation's
    /// mean loss (`None` without held-out windows).
    pub fn run(&mut self, resume: Option<&Path>) -> Result<Option<f64>> {
        self.run_until(resume, self.cfg.train.steps)
    }

    /// As [`FineTune::run`], stopping after `stop` steps in all as if interrupted (the
    /// checkpoints due by then are written).
    pub fn run_until(&mut self, resume: Option<&Path>, stop: u64) -> Result<Option<f64>> {
        if let Some(p) = resume {
            self.trainer.resume(p)?;
        }
        let (batch, seq, micro) = (self.cfg.data.batch_size, self.cfg.data.seq, self.cfg.micro_batches());
        // The members of a model-parallel group read the same windows; the replicas their own
        // (as kolo train deals them: contiguous slices of each global batch under
        // ddp.deterministic, a share of it under ddp.dynamic_batch_every).
        let mut sampler = self.trainer.sampler_of(self.train, batch)?;
        let pp = self.mesh.size("pp");
        let per_micro = batch / micro;
        let (steps, every) = (self.cfg.train.steps, self.cfg.train.eval_every);
        let schedule = match self.cfg.pipeline.as_ref().map(|p| p.schedule) {
            Some(PipeSchedule::GPipe) => crate::pp::Schedule::GPipe,
            // Streams drain at every evaluation.
            Some(PipeSchedule::TwoBw) => crate::pp::Schedule::TwoBw { batches: if every > 0 { every } else { steps.max(1) } as usize },
            _ => crate::pp::Schedule::OneFOneB,
        };
        let pipe = crate::pp::Pipeline::new(schedule, &self.model.stage_activation(per_micro, seq / self.mesh.size("sp")))?;
        let mut eval = None;
        // PipeDream-2BW asks for the next step's micro-batches before this step's update: the
        // batches are read ahead, by step.
        let mut ahead: std::collections::BTreeMap<u64, Tensor> = Default::default();
        while self.trainer.steps_done() < steps.min(stop) {
            let t = self.trainer.steps_done();
            let x = match ahead.remove(&t) {
                Some(x) => x,
                None => self.batch(&sampler.next_batch(), seq)?,
            };
            // Before the step: a checkpoint the step writes resumes with the next batch.
            self.trainer.set_data_position(sampler.position());
            let model = &self.model;
            // DeepSeek-V3: the selection biases move by the step's routing counts, before the
            // update (so that the step's checkpoint holds them).
            if self.balance.is_some() {
                model.forget_expert_load();
            }
            let bias = self.balance.as_ref();
            let balance = |t: &mut Trainer| match bias {
                Some(b) => model.update_expert_bias(b, t),
                None => Ok(()),
            };
            if let (true, crate::pp::Schedule::TwoBw { .. }) = (pp > 1, schedule) {
                let (windows, device) = (&self.windows, self.dist.device());
                let ahead = std::cell::RefCell::new(&mut ahead);
                let sampler = std::cell::RefCell::new(&mut sampler);
                let stage = |step: u64, mb: usize, input: Option<&Tensor>| {
                    let next = match step == t {
                        true => x.clone(),
                        false => {
                            let mut ahead = ahead.borrow_mut();
                            if let std::collections::btree_map::Entry::Vacant(e) = ahead.entry(step) {
                                e.insert(window_batch(windows, &sampler.borrow_mut().next_batch(), seq, &device)?);
                            }
                            ahead[&step].clone()
                        }
                    };
                    model.pipeline_stage(input, &next.narrow(0, mb * per_micro, per_micro)?)
                };
                pipe.step_stream(&mut self.trainer, stage)?;
            } else if pp > 1 {
                // Each stage runs its blocks on micro-batch `mb`; the last returns its loss.
                let stage = |mb, input: Option<&Tensor>| model.pipeline_stage(input, &x.narrow(0, mb * per_micro, per_micro)?);
                pipe.step_then(&mut self.trainer, stage, balance)?;
            } else if self.cfg.ddp.deterministic {
                // Each piece of ddp.deterministic_chunk sequences its own backward, summed exactly.
                self.trainer.step_pieces(|r| model.loss(&x.narrow(0, r.start, r.len())?))?;
            } else {
                self.trainer.step_then(|| model.loss(&x), balance)?;
            }
            let done = self.trainer.steps_done();
            if self.trainer.eval_due() {
                eval = self.evaluate()?;
                if let (Some(l), true) = (eval, self.dist.is_main()) {
                    kolo_base::eline!("step {done}/{steps} eval loss {l:.4} (perplexity {:.2})", l.exp());
                }
            }
        }
        if let (Some(b), true) = (pipe.bubble(), pp > 1 && self.mesh.coord("dp") == 0 && self.mesh.coord("tp") == 0) {
            let (k, m) = (pp as f64, micro as f64);
            kolo_base::eline!(
                "pipeline stage {}: bubble {:.1}% (GPipe/1F1B ideal {:.1}%)",
                self.mesh.coord("pp"),
                100.0 * b,
                100.0 * (k - 1.0) / (m + k - 1.0)
            );
        }
        Ok(eval)
    }

    /// The windows `rows` as a (rows, seq + 1) batch of token ids.
    fn batch(&self, rows: &[usize], seq: usize) -> Result<Tensor> {
        Ok(window_batch(&self.windows, rows, seq, &self.dist.device())?)
    }

    /// Collective over the job: the mean loss over `train.eval_batches` batches of the held-out
    /// windows (in order, dealt over the data-parallel replicas; a sequence-parallel group's
    /// chunks averaged; forward only, through the pipeline's stages in turn), `None` when
    /// nothing is held out.
    pub fn evaluate(&self) -> Result<Option<f64>> {
        let (batch, seq) = (self.cfg.data.batch_size, self.cfg.data.seq);
        let held = self.windows.count(seq + 1) - self.train;
        if held == 0 {
            return Ok(None);
        }
        let (dp, rank) = self.data_replicas();
        let batches = held.div_ceil(batch);
        let want = match self.cfg.train.eval_batches {
            0 => batches,
            n => n.min(batches),
        };
        // Every replica runs as many batches (some twice when they do not divide), so that the
        // collectives inside a split model's forward line up.
        let mine = want.div_ceil(dp);
        let mut sum = 0.0;
        for i in 0..mine {
            let b = (i * dp + rank) % batches;
            let rows: Vec<usize> = (b * batch..((b + 1) * batch).min(held)).map(|w| self.train + w).collect();
            sum += self.stage_loss(&self.batch(&rows, seq)?)?;
        }
        let mut v = [sum / mine as f64];
        // The mean over the last stage's ranks: its replicas (dp x sp); with experts dealt out,
        // every rank of the job, the earlier stages adding their 0 (the members of a
        // tensor-parallel group count once each, with the same loss).
        let pp = self.mesh.pp();
        let stages = pp.world_size().get();
        let (group, ranks) = match self.mesh.size("ep") {
            1 => (self.mesh.replicas(), self.mesh.replicas().world_size().get()),
            _ => (self.mesh.world(), self.mesh.world().world_size().get() / stages),
        };
        group.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
        // The last stage's mean is everyone's.
        pp.broadcast(BufMut::from(&mut v[..]), kolo_base::Rank(stages - 1))?;
        Ok(Some(v[0] / ranks as f64))
    }

    /// The loss of the windows `x` (rows, seq + 1) without a gradient: the whole model's, or
    /// through the pipeline's stages in turn (each stage's hidden states sent to the next);
    /// on the stages before the last it is 0.
    fn stage_loss(&self, x: &Tensor) -> Result<f64> {
        let pp = self.mesh.pp();
        let (k, s) = (pp.world_size().get(), pp.rank().get());
        if k == 1 {
            return Ok(f64::from(self.model.loss(x)?.to_scalar::<f32>()?));
        }
        let shape = self.model.stage_activation(x.dim(0)?, self.cfg.data.seq / self.mesh.size("sp"));
        let input = match s {
            0 => None,
            _ => {
                let mut h = vec![0f32; shape.iter().product()];
                pp.recv(BufMut::from(&mut h[..]), kolo_base::Rank(s - 1), 7)?;
                Some(Tensor::from_vec(h, shape, &self.dist.device())?.to_dtype(self.trainer.compute_dtype())?)
            }
        };
        let out = self.model.pipeline_stage(input.as_ref(), x)?;
        if s + 1 < k {
            let h = out.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            pp.send(kolo_comm::BufRef::from(&h[..]), kolo_base::Rank(s + 1), 7)?;
            return Ok(0.0);
        }
        Ok(f64::from(out.to_scalar::<f32>()?))
    }

    /// Collective: writes the whole fine-tuned model to `dir` as `transformers` reads it, with
    /// the model directory's tokenizer and generation files; ZeRO-3 shards and model-parallel
    /// pieces are gathered first. Under mixed precision the f32 master weights are written (in
    /// `opts.dtype`), not the model's rounded copy.
    pub fn export(&self, dir: &Path, opts: &SaveOptions) -> Result<()> {
        self.trainer.unshard()?;
        let masters = self.trainer.master_varmap(&self.varmap)?;
        let own = masters.as_ref().unwrap_or(&self.varmap);
        let split = self.mesh.size("tp") * self.mesh.size("pp") * self.mesh.size("ep") > 1;
        let whole = if split { self.mesh.whole_varmap(own)? } else { None };
        if self.dist.is_main() {
            self.model.save_pretrained_with(dir, whole.as_ref().unwrap_or(own), opts)?;
            copy_companions(&self.cfg.model.hf, dir)?;
        }
        self.dist.barrier()?;
        Ok(())
    }

    /// The `[export]` of the job, if it has one: where and how to write the model at the end.
    pub fn export_options(&self) -> Result<Option<(PathBuf, SaveOptions)>> {
        self.cfg
            .export
            .as_ref()
            .map(|e| Ok((e.dir.clone(), SaveOptions { dtype: export_dtype(&e.dtype)?, max_shard_size: e.max_shard_size })))
            .transpose()
    }
}

/// `kolo export --hf`: writes the model of a checkpoint that a fine-tuning job wrote (at any
/// world size and mesh: checkpoints hold whole tensors) to `out` as `transformers` reads it,
/// with the `config.json` the job stored in the checkpoint.
pub fn export_checkpoint(checkpoint: &Path, out: &Path, opts: &SaveOptions) -> Result<()> {
    let path = kolo_train::checkpointing::resolve_checkpoint(checkpoint)?;
    let ck = kolo_checkpoint::load_any(&path).map_err(kolo_train::TrainError::from)?;
    let config = ck.meta.get(CONFIG_META).ok_or_else(|| {
        Error::file(
            &path,
            format!("no `{CONFIG_META}` metadata: not a checkpoint of a Hugging Face fine-tuning job (kolo train with [model] hf)"),
        )
    })?;
    let config: serde_json::Value = serde_json::from_str(config).map_err(|e| Error::file(&path, format!("`{CONFIG_META}`: {e}")))?;
    let varmap = VarMap::new();
    {
        let mut vars = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
        for e in &ck.tensors {
            if let Some(name) = e.name.strip_prefix("model.") {
                let t = Tensor::from_slice(&e.data, e.shape.as_slice(), &candle_core::Device::Cpu)?;
                vars.insert(name.to_string(), candle_core::Var::from_tensor(&t)?);
            }
        }
    }
    if varmap.all_vars().is_empty() {
        return Err(Error::file(&path, "the checkpoint holds no model tensors"));
    }
    super::save_pretrained_with(out, &varmap, &config, opts)?;
    // The tokenizer of the model the job started from, when that directory is still there.
    match ck.meta.get(DIR_META).map(Path::new).filter(|d| d.is_dir()) {
        Some(from) => copy_companions(from, out),
        None => Ok(()),
    }
}
