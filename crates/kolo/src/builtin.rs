//! `kolo train`'s built-in models (kolo-tensor's MLP, CNN and GPT) trained by the library's
//! [`Trainer`], as a user's own model is: the data-parallel strategy of `kolo train` (DDP,
//! ZeRO-1/2/3, tensor, sequence and expert parallelism, scheduled communication, local SGD, gradient compression,
//! deterministic and mixed-precision training) is this trainer stepped by the driver (`kolo_train::driver`),
//! which owns the batches, the learning rate's schedule, the reports, evaluations and
//! checkpoints, as it does for the other strategies. GPipe and 1F1B pipelines are a trainer per
//! stage stepped through [`crate::pp::Pipeline`] (`pipeline.rs`), as a user's are.
//!
//! The model stays kolo-tensor's: its variables are handed to the trainer in the model's own
//! order (backward's reverse, which DDP's buckets follow); under mixed precision the model
//! keeps f32 parameters and casts each where it is used (`CastView`, torch's autocast), so it
//! is f32 to the trainer; ZeRO-3 gathers the GPT's blocks into its variables when read.

mod pipeline;

use crate::{Dist, Mesh, TrainOptions, Trainer};
use kolo_comm::{Communicator, SumGroup};
use kolo_tensor::{CandleDType, Model, ModelSpec, ParamView};
use kolo_train::checkpointing::PendingSave;
use kolo_train::config::{Config, Precision};
use kolo_train::data::{CharVocab, Dataset};
use kolo_train::driver::{Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use kolo_train::setup::{Data, Setup};
use kolo_train::summary::{Eval, RunOptions, Summary};
use kolo_train::TrainError;
use std::path::Path;
use std::sync::Arc;

/// Trains `cfg` on this rank of `comm` as `kolo train` does: the strategy the config names,
/// run by the driver; the data-parallel one (with tensor parallelism when `[mesh] tp` is set)
/// is [`BuiltinModel`], the library's [`Trainer`] over the built-in model, and so are the
/// GPipe and 1F1B pipelines' stages.
pub fn run(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions) -> Result<Summary, TrainError> {
    kolo_train::run::run(cfg, comm, opts, &BuiltinModel::build)
}

/// A built-in model and the [`Trainer`] that trains it: `kolo train`'s data-parallel strategy.
pub struct BuiltinModel {
    trainer: Trainer,
    model: Box<dyn Model>,
    /// How the model reads its f32 parameters: as they are, or cast to bf16/f16 (`compute`)
    /// where used.
    view: Box<dyn ParamView>,
    compute: CandleDType,
    spec: ModelSpec,
    /// The ranks holding the same parameters: the data-parallel group, with the sequence
    /// chunks' ranks under sequence parallelism (the step's loss and evaluation sums are taken
    /// over it).
    dp: Arc<dyn Communicator>,
    /// This rank's data-parallel replica and their number (the driver deals batches by it).
    replica: (usize, usize),
    /// Sequence parallelism: this rank's chunk of every sequence, and the number of chunks.
    chunk: Option<(usize, usize)>,
    /// Expert parallelism: the model's experts are dealt out over a group (so it evaluates
    /// and samples whole on rank 0, as under sequence parallelism).
    experts_apart: bool,
    /// Tensor parallelism: the group the model's blocks are split over (counting its traffic).
    tp: Option<Arc<SumGroup>>,
    /// Kept for the mesh's groups (the trainer holds their communicators).
    _mesh: Option<Mesh>,
    /// The whole model's parameters (names and shapes) as one process lays them out: what
    /// evaluation alone, sampling alone and the end gather into.
    whole: Vec<(String, Vec<usize>)>,
    train: kolo_train::config::TrainConfig,
    batch_size: usize,
    deterministic_chunk: Option<usize>,
    global_rank: usize,
    quiet: bool,
}

impl BuiltinModel {
    /// The strategy for `kolo_train::run::run`: builds the model the config names (split
    /// over `[mesh] tp`'s groups when set; this rank's stage of a GPipe or 1F1B pipeline), its
    /// trainer over `comm`'s ranks, and resumes `resume` when given.
    pub fn build(
        cfg: &Setup,
        comm: Arc<dyn Communicator>,
        data: &Data,
        resume: Option<&Path>,
        run: &RunOptions,
    ) -> Result<(Box<dyn Strategy>, Start), TrainError> {
        if cfg.pipeline.is_some() {
            let (s, start) = pipeline::Pipelined::new(cfg, comm, resume, run).map_err(train_error)?;
            return Ok((Box::new(s), start));
        }
        let (s, start) = Self::new(cfg, comm, data, resume, run).map_err(train_error)?;
        Ok((Box::new(s), start))
    }

    fn new(
        cfg: &Setup,
        comm: Arc<dyn Communicator>,
        data: &Data,
        resume: Option<&Path>,
        run: &RunOptions,
    ) -> crate::Result<(BuiltinModel, Start)> {
        comm.set_timeout(cfg.ddp.timeout());
        let global_rank = comm.rank().get();
        let size = cfg.mesh;
        let dist = Dist::of_comm(comm.clone());
        // Replicas (dp) of expert-parallel groups (ep: each member its own replica too) of
        // sequence chunks (sp) of tensor-parallel groups (tp, consecutive ranks).
        let mesh = match (size.ep, size.sp, size.tp) {
            (1, 1, 1) => None,
            (ep, sp, tp) => Some(Mesh::new(&dist, &[("dp", size.dp / ep), ("ep", ep), ("sp", sp), ("tp", tp)])?),
        };
        // The ranks whose losses make the step's (every data replica and sequence chunk of one
        // tensor-parallel piece: the parameters' replicas, or every rank under expert parallelism).
        let dp = match &mesh {
            Some(m) if size.ep == 1 => m.replicas().clone(),
            _ => comm.clone(),
        };
        let replica = match &mesh {
            Some(m) => (m.coord("dp") * m.size("ep") + m.coord("ep"), m.size("dp") * m.size("ep")),
            None => (global_rank, comm.world_size().get()),
        };
        let ep = mesh.as_ref().filter(|_| size.ep > 1).map(|m| m.ep());
        let tp = mesh.as_ref().filter(|_| size.tp > 1).map(|m| SumGroup::new(m.tp().comm().clone()));
        let sp = mesh.as_ref().filter(|_| size.sp > 1).map(|m| m.sp().comm().clone());
        let chunk = sp.as_ref().map(|c| (c.rank().get(), c.world_size().get()));
        let spec = cfg.spec.clone();
        let model = dp_model(cfg, &spec, (tp.clone(), sp, ep.map(|e| e.exchange())))?;
        // ZeRO-3: the GPT's blocks (under tensor parallelism this rank's pieces of them),
        // gathered into its variables when read (checkpointed blocks read them again in
        // backward).
        let all: Vec<usize> = (0..model.params().len()).collect();
        let groups = zero3_prefixes(cfg, &*model, &all, "this model has")?;
        let vars = model_vars(&*model, &all)?;
        let opts = TrainOptions::from_setup(cfg)?;
        let on = match &mesh {
            Some(m) => Err(m),
            None => Ok(&dist),
        };
        let mut trainer = driven_trainer(cfg, (vars, on), opts, &groups, replica.1, run.inject_inf_at)?;
        let compute = cfg.compute;
        if compute == CandleDType::F16 {
            trainer.scale_losses();
        }
        let start = match resume {
            Some(path) => Some(trainer.resume_state(path)?),
            None => None,
        };
        let view = kolo_tensor::view_for(compute);
        if global_rank == 0 && !run.quiet {
            let e = trainer.engine();
            announce(cfg, &*model, &spec, (&e.ddp, e.zero.as_ref()), (chunk, size.ep), data)?;
        }
        let deterministic_chunk = cfg.ddp.deterministic.then_some(cfg.ddp.deterministic_chunk);
        let whole = whole_signature(&*model, &spec, tp.is_some() || size.ep > 1, cfg.train.seed)?;
        let s = BuiltinModel {
            trainer,
            model,
            view,
            compute,
            spec,
            dp,
            replica,
            chunk,
            experts_apart: size.ep > 1,
            tp,
            _mesh: mesh,
            whole,
            train: cfg.train.clone(),
            batch_size: cfg.data.batch_size,
            deterministic_chunk,
            global_rank,
            quiet: run.quiet,
        };
        Ok((s, start))
    }

    /// ZeRO-3: a gather that failed in a forward pass, as the driver's error.
    fn settle(&self) -> Result<(), TrainError> {
        self.trainer.zero3_failure().map_err(train_error)
    }

    /// One micro-step: the micro-batch's loss (under `ddp.deterministic` each piece's), its
    /// backward, and on the last micro-step the update.
    fn micro_step(&mut self, data: &mut Batches) -> Result<(), TrainError> {
        let batch = match self.chunk {
            // Every rank of a replica reads its batch, and computes its chunk of each sequence.
            Some((r, n)) => sequence_chunk(&data.next_batch()?, r, n)?,
            None => data.next_batch()?,
        };
        // Dynamic batch sizing: this rank's mean loss weighs by its share of the global batch.
        self.trainer.driven_mut().share = data.share();
        let pieces = match self.deterministic_chunk {
            Some(chunk) => batch.chunks(chunk).ok_or_else(|| {
                TrainError::Config(format!("ddp.deterministic_chunk = {chunk} does not divide this rank's batch of {}", batch.len()))
            })?,
            None => Vec::new(),
        };
        let (model, view) = (&*self.model, &*self.view);
        let candle = |e: kolo_tensor::TensorError| candle_core::Error::Msg(e.to_string());
        let loss = |r: std::ops::Range<usize>| match pieces.is_empty() {
            true => model.loss(&batch, view).map_err(candle),
            false => model.loss(&pieces[r.start / r.len().max(1)], view).map_err(candle),
        };
        let out = self.trainer.step_pieces(loss);
        // A failed ZeRO-3 gather is the cause of whatever the step met.
        self.settle()?;
        out.map(|_| ()).map_err(train_error)
    }
}

impl Strategy for BuiltinModel {
    fn comm(&self) -> &dyn Communicator {
        &*self.dp
    }

    fn replica(&self) -> (usize, usize) {
        self.replica
    }

    fn step(&mut self, _ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        for _ in 0..self.train.grad_accum.max(1) {
            self.micro_step(data)?;
        }
        let backward_end = self.trainer.backward_end();
        let (loss, rec, comm_spans) =
            self.trainer.driven_mut().last.take().ok_or_else(|| TrainError::Other("the trainer's step did not end".into()))?;
        Ok(StepOut { loss, rec, backward_end, comm_spans, note: String::new() })
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        if let (true, ModelSpec::Gpt(gc)) = (self.alone(), &self.spec) {
            // Whole sequences, with an unsplit copy of the model (every expert), on rank 0.
            let lead = self.global_rank == 0;
            return evaluate_whole(&self.trainer, &self.whole, lead, (gc, self.batch_size, self.compute), ds, max_batches);
        }
        let zero3 = self.trainer.is_zero3();
        let settle = || self.settle();
        let e = kolo_train::eval::evaluate(&*self.model, &*self.view, ds, &*self.dp, self.batch_size, max_batches, zero3, &settle)?;
        Ok(Some(e))
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        // Under ZeRO-3 every rank samples (the same text: same seed), since each forward
        // gathers the blocks collectively.
        let ModelSpec::Gpt(g) = &self.spec else { return Ok(None) };
        if self.alone() {
            return sample_whole(&self.trainer, &self.whole, self.global_rank == 0, (g, &self.train, self.compute), vocab);
        }
        if self.dp.rank().get() != 0 && !self.trainer.is_zero3() {
            return Ok(None);
        }
        let tc = &self.train;
        let settle = || self.settle();
        let (chars, temperature) = (tc.sample_chars, tc.sample_temperature);
        kolo_train::eval::sample_text(&*self.model, &*self.view, vocab, g.seq, chars, temperature, tc.seed, &settle).map(Some)
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        self.trainer.save_at(at).map_err(train_error)
    }

    fn finish(&mut self, steps_run: u64) -> Result<Finish, TrainError> {
        self.trainer.settle("kolo train's end").map_err(train_error)?;
        if let (Some(g), ModelSpec::Gpt(gc)) = (&self.tp, &self.spec) {
            if self.global_rank == 0 && !self.quiet {
                report_tensor_parallel(g, gc, steps_run * self.train.grad_accum);
            }
        }
        let moe = reduce_load(self.model.take_moe_load(), &*self.dp)?;
        let e = self.trainer.engine();
        Ok(Finish {
            params: self.trainer.whole_params(&self.whole).map_err(train_error)?,
            states: self.trainer.state_bytes(),
            skipped_steps: e.skipped_steps(),
            loss_scale: e.scaler.as_ref().map(kolo_optim::LossScaler::scale),
            moe,
            pipeline_bubble: None,
            ps: None,
        })
    }
}

impl BuiltinModel {
    /// Whether the model evaluates and samples as an unsplit copy on rank 0: its sequences
    /// are cut into chunks, or its experts dealt out.
    fn alone(&self) -> bool {
        self.chunk.is_some() || self.experts_apart
    }
}

/// The whole model's parameters as one process lays them out (a tensor- or expert-parallel
/// GPT's pieces, `split`, are laid out otherwise: their layout is an unsplit GPT's).
fn whole_signature(model: &dyn Model, spec: &ModelSpec, split: bool, seed: u64) -> Result<Vec<(String, Vec<usize>)>, TrainError> {
    match (split, spec) {
        (true, ModelSpec::Gpt(gc)) => {
            let whole = kolo_tensor::models::Gpt::new(gc.clone(), &mut kolo_base::Rng::new(seed))?;
            Ok(whole.params().signature())
        }
        _ => Ok(model.params().signature()),
    }
}

/// Collective: the whole model put together from its pieces (stages, tensor-parallel pieces,
/// experts), evaluated in one process on the `lead` rank (whole sequences, every expert),
/// computing in the run's `compute` dtype.
fn evaluate_whole(
    trainer: &Trainer,
    whole: &[(String, Vec<usize>)],
    lead: bool,
    (gc, batch, compute): (&kolo_tensor::models::GptConfig, usize, CandleDType),
    ds: &dyn Dataset,
    max_batches: usize,
) -> Result<Option<Eval>, TrainError> {
    let flat = trainer.whole_params(whole).map_err(train_error)?;
    lead.then(|| kolo_train::eval::evaluate_alone((batch, compute), gc, &flat, ds, max_batches)).transpose()
}

/// Collective: text from the whole model put together from its pieces, on the `lead` rank,
/// computing in `compute`.
fn sample_whole(
    trainer: &Trainer,
    whole: &[(String, Vec<usize>)],
    lead: bool,
    (gc, tc, compute): (&kolo_tensor::models::GptConfig, &kolo_train::config::TrainConfig, CandleDType),
    vocab: &CharVocab,
) -> Result<Option<String>, TrainError> {
    let flat = trainer.whole_params(whole).map_err(train_error)?;
    lead.then(|| kolo_train::eval::sample_alone((tc, compute), gc, &flat, vocab)).transpose()
}

/// The variables of `model`'s parameters `which` (indices, in the model's order) for its
/// trainer, each piece of a tensor-parallel model marked with how it was cut.
fn model_vars(model: &dyn Model, which: &[usize]) -> crate::Result<Vec<(String, candle_core::Var)>> {
    let splits = model.tensor_parallel_splits().unwrap_or_else(|| vec![None; model.params().len()]);
    let mut vars = Vec::with_capacity(which.len());
    for &i in which {
        let p = model.params().get(i);
        if let Some(split) = splits[i].clone() {
            crate::tp::mark_split(p.var.as_tensor(), split)?;
        }
        vars.push((p.name.clone(), p.var.clone()));
    }
    Ok(vars)
}

/// Under `ddp.zero_stage = 3`: the model's blocks among the parameters `own` (under tensor
/// parallelism this rank's pieces of them), by name prefix, which the trainer gathers into
/// their variables when read; `holder` names who holds none, in the error. Empty otherwise.
fn zero3_prefixes(cfg: &Setup, model: &dyn Model, own: &[usize], holder: &str) -> Result<Vec<String>, TrainError> {
    if cfg.ddp.zero_stage != 3 {
        return Ok(Vec::new());
    }
    let groups: Vec<Vec<usize>> = model.param_groups().into_iter().filter(|g| g.iter().all(|i| own.contains(i))).collect();
    if groups.is_empty() {
        return Err(TrainError::Config(format!("ddp.zero_stage = 3 shards the GPT's blocks: {holder} none to shard")));
    }
    Ok(group_prefixes(model.params(), &groups))
}

/// The trainer `kolo train` steps over `vars` (a model's, in its order) on `on`, with ZeRO-3's
/// `groups`: the driver writes its checkpoints (with the config's metadata for `replicas`) and
/// the timeline, and checks the job's collectives on its own communicator.
fn driven_trainer(
    cfg: &Setup,
    (vars, on): (Vec<(String, candle_core::Var)>, Result<&Dist, &Mesh>),
    mut opts: TrainOptions,
    groups: &[String],
    replicas: usize,
    inject_inf_at: Option<u64>,
) -> crate::Result<Trainer> {
    opts.ddp.check_collectives = false;
    // The model casts its f32 parameters where it uses them (`compute`): f32 to the trainer.
    opts.train.precision = Precision::F32;
    let groups: Vec<&str> = groups.iter().map(String::as_str).collect();
    let mut trainer = Trainer::driven(vars, on, opts, &groups, inject_inf_at)?;
    let stage = kolo_ddp::Sharding::from_stage(cfg.ddp.zero_stage).unwrap_or_default().stage();
    trainer.replace_meta(cfg.checkpoint_meta(replicas, stage));
    Ok(trainer)
}

/// The library's error as the driver's: its own kinds kept (a collective's failure stays one,
/// for the flight recorder), the rest as text.
fn train_error(e: crate::Error) -> TrainError {
    match e {
        crate::Error::Train(e) => e,
        crate::Error::Comm(e) => TrainError::Comm(e),
        crate::Error::Ddp(e) => TrainError::Ddp(e),
        crate::Error::Tensor(e) => TrainError::Tensor(e),
        crate::Error::Setting { setting, reason } => TrainError::Config(format!("{setting}: {reason}")),
        e => TrainError::Other(e.to_string()),
    }
}

/// All-reduces of the vocabulary-parallel embedding, head and cross-entropy per micro-step.
const VOCAB_PARALLEL_REDUCES: usize = 5;

/// Each of a model's parameter groups (`Model::param_groups`) by the name prefix its
/// parameters share, up to a dot (`blocks.3.`).
fn group_prefixes(params: &kolo_tensor::ParamSet, groups: &[Vec<usize>]) -> Vec<String> {
    let prefix = |g: &[usize]| {
        let first = &params.get(g[0]).name;
        let common =
            g.iter().map(|&i| first.bytes().zip(params.get(i).name.bytes()).take_while(|(a, b)| a == b).count()).min().unwrap_or(0);
        first[..first[..common].rfind('.').map_or(0, |d| d + 1)].to_string()
    };
    groups.iter().map(|g| prefix(g)).collect()
}

/// The groups a built-in GPT is split over: tensor parallelism, the sequence chunks' ring,
/// expert parallelism's exchange.
type Splits = (Option<Arc<SumGroup>>, Option<Arc<dyn Communicator>>, Option<Arc<dyn kolo_base::Exchange>>);

/// The model the config names, its tensor-parallel split over `tp` when there is one, its
/// attention over the sequence chunks of `sp` (a ring), or its experts dealt out over `ep`,
/// with the configured activation checkpointing.
fn dp_model(cfg: &Setup, spec: &ModelSpec, (tp, sp, ep): Splits) -> Result<Box<dyn Model>, TrainError> {
    let seed = cfg.train.seed;
    let rng = || kolo_base::Rng::new(seed);
    let mut model = match (tp, sp, ep, spec) {
        (Some(g), _, _, ModelSpec::Gpt(gc)) => {
            Box::new(kolo_tensor::models::Gpt::new_tensor_parallel(gc.clone(), &mut rng(), g)?) as Box<dyn Model>
        }
        (None, Some(ring), _, ModelSpec::Gpt(gc)) => {
            let mut gpt = kolo_tensor::models::Gpt::new(gc.clone(), &mut rng())?;
            gpt.set_sequence_parallel(Arc::new(kolo_comm::Ring(ring)))?;
            Box::new(gpt)
        }
        (None, None, Some(ex), ModelSpec::Gpt(gc)) => Box::new(kolo_tensor::models::Gpt::new_expert_parallel(gc.clone(), &mut rng(), ex)?),
        _ => kolo_tensor::build_model(spec, seed)?,
    };
    model.set_checkpointing(&cfg.checkpoint_blocks)?;
    Ok(model)
}

/// The start line of a data-parallel run.
fn announce(
    cfg: &Setup,
    model: &dyn Model,
    spec: &ModelSpec,
    (ddp, zero): (&kolo_ddp::Ddp, Option<&kolo_ddp::ShardPlan>),
    (chunk, ep): (Option<(usize, usize)>, usize),
    data: &Data,
) -> Result<(), TrainError> {
    let (tc, world, numel) = (&cfg.train, ddp.comm().world_size().get(), model.params().numel());
    if let (true, ModelSpec::Gpt(gc), Some(moe)) = (ep > 1, spec, spec_moe(spec)) {
        let whole = kolo_tensor::models::Gpt::new(gc.clone(), &mut kolo_base::Rng::new(tc.seed))?.params().numel();
        kolo_base::eline!(
            "kolo train (expert parallel): MoE GPT {whole} params ({numel} on each rank), {} experts per block dealt over {ep} ranks ({} each) x {} groups, top-{} routing",
            moe.experts,
            moe.experts / ep,
            world,
            moe.top_k
        );
        return Ok(());
    }
    if let (Some((_, n)), ModelSpec::Gpt(gc)) = (chunk, spec) {
        kolo_base::eline!(
            "kolo train (sequence parallel): GPT {numel} params, sequences of {} split into {n} chunks of {} (ring attention) x {} data-parallel replicas",
            gc.seq,
            gc.seq / n,
            world / n,
        );
        return Ok(());
    }
    if let Some((chunk, credit)) = cfg.comm_schedule {
        kolo_base::eline!(
            "kolo train (scheduled DDP): {numel} params, {} on {world} rank(s), {} chunks of {} KiB, credit {} KiB, data: {}",
            kolo_train::setup::spec_string(spec),
            numel.div_ceil(chunk),
            chunk * 4 / 1024,
            credit * 4 / 1024,
            data.train.describe()
        );
        return Ok(());
    }
    kolo_base::eline!(
        "kolo train: {} params, {} on {world} rank(s), global batch {} ({} x {world} ranks x {} micro-steps), {} buckets{}, data: {}, CPU kernels: {}, {} thread(s)",
        numel,
        kolo_train::setup::spec_string(spec),
        cfg.global_batch(world),
        cfg.data.batch_size,
        tc.grad_accum,
        ddp.plan().len(),
        match zero {
            Some(z) => format!(", ZeRO-{} (optimizer state for {} of {numel} values on this rank)", ddp.sharding().stage(), z.len),
            None => String::new(),
        },
        data.train.describe(),
        kolo_base::simd::capability().name(),
        kolo_tensor::compute_threads()
    );
    Ok(())
}

/// The start line of a pipeline run: the stages' layers (`plan`), the replicas and pieces,
/// the micro-batches and the schedule.
fn announce_pipeline(
    gpt: &kolo_tensor::models::Gpt,
    gc: &kolo_tensor::models::GptConfig,
    plan: &[std::ops::Range<usize>],
    (dp, tp): (usize, usize),
    (m, micro): (usize, usize),
    schedule: crate::pp::Schedule,
) {
    // PipeDream-2BW's stream could carry every step's micro-batches without a flush.
    let in_flight = match schedule {
        crate::pp::Schedule::TwoBw { batches } => m * batches,
        _ => m,
    };
    kolo_base::eline!(
        "kolo train (pipeline): GPT {} params in {} stages {plan:?} (layers: 0 = embedding, 1..={} blocks, {} = head) x {dp} data-parallel replicas x {tp} tensor-parallel ranks, {m} micro-batches of {micro}, {schedule:?}; theoretical bubble {:.1}%",
        gpt.full_numel(),
        plan.len(),
        gc.n_layer,
        gc.n_layer + 1,
        kolo_pipe::theoretical_bubble(plan.len(), in_flight) * 100.0
    );
}

/// The tensor-parallel group `g`'s traffic per micro-step over `micro_steps` of a GPT split by
/// it: its all-reduces per block (Megatron's 4) and those of the vocabulary-parallel ends.
fn report_tensor_parallel(g: &SumGroup, gc: &kolo_tensor::models::GptConfig, micro_steps: u64) {
    let steps = micro_steps.max(1);
    let (calls, bytes) = g.traffic();
    let (calls, mb) = (calls as f64 / steps as f64, bytes as f64 / steps as f64 / 1e6);
    // Outside the blocks: the vocabulary-parallel embedding (1, forward), head (1, backward)
    // and cross-entropy (3: maxima, sums of exponentials, target logits).
    kolo_base::eline!(
        "tensor parallel: {calls:.1} all-reduces ({mb:.2} MB) per micro-step over {} ranks: {:.1} per block for {} blocks (Megatron: 2 in forward + 2 in backward) + {VOCAB_PARALLEL_REDUCES} for the vocabulary-parallel embedding, head and cross-entropy",
        kolo_base::GroupSum::size(g),
        (calls - VOCAB_PARALLEL_REDUCES as f64) / gc.n_layer as f64,
        gc.n_layer,
    );
}

/// Chunk `r` of `n` of every sequence of a batch (tokens and targets).
fn sequence_chunk(batch: &kolo_tensor::Batch, r: usize, n: usize) -> Result<kolo_tensor::Batch, TrainError> {
    let kolo_tensor::Input::Tokens { ids, b, t } = &batch.input else {
        return Err(TrainError::Config("sequence parallelism takes token sequences".into()));
    };
    if n == 0 || t % n != 0 {
        return Err(TrainError::Config(format!("sequences of {t} tokens do not split into {n} equal chunks (mesh.sp)")));
    }
    let c = t / n;
    let pick = |v: &[u32]| -> Vec<u32> { (0..*b).flat_map(|s| v[s * t + r * c..s * t + (r + 1) * c].iter().copied()).collect() };
    Ok(kolo_tensor::Batch { input: kolo_tensor::Input::Tokens { ids: pick(ids), b: *b, t: c }, targets: pick(&batch.targets) })
}

/// A mixture-of-experts GPT's experts.
fn spec_moe(spec: &ModelSpec) -> Option<&kolo_tensor::models::moe::MoeConfig> {
    match spec {
        ModelSpec::Gpt(gc) => gc.moe.as_ref(),
        _ => None,
    }
}

/// Sums routing counts over `comm` (every rank's tokens).
fn reduce_load(
    load: Option<kolo_tensor::models::MoeLoad>,
    comm: &dyn Communicator,
) -> Result<Option<kolo_tensor::models::MoeLoad>, TrainError> {
    let Some(l) = load else { return Ok(None) };
    let mut v: Vec<f64> = l.load.iter().map(|&x| x as f64).chain([l.dropped as f64, l.assigned as f64]).collect();
    comm.all_reduce(kolo_comm::BufMut::from(&mut v[..]), kolo_comm::ReduceOp::Sum)?;
    let n = l.load.len();
    Ok(Some(kolo_tensor::models::MoeLoad {
        load: v[..n].iter().map(|&x| x as u64).collect(),
        dropped: v[n] as u64,
        assigned: v[n + 1] as u64,
    }))
}
