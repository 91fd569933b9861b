//! The data-parallel strategy: every replica holds the model (or, under tensor parallelism, its
//! group's split of it) and sees its own slice of the data; gradients are bucketed and
//! all-reduced while backward runs (DDP), or reduce-scattered to shards (ZeRO-1/2/3). Also
//! here, since they share the model, the buckets and the update: gradient accumulation, local
//! SGD, deterministic (fixed-point) summation and f16 training with a dynamic loss scale.

use crate::checkpointing::{load_checkpoint, save_checkpoint, PendingSave};
use crate::config::{Config, StepTables};
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::eval::{evaluate, sample_text};
use crate::setup::{spec_string, Data};
use crate::summary::{Eval, RunOptions, StateBytes};
use crate::update::Engine;
use crate::zero3::Zero3;
use crate::TrainError;
use kolo_base::Rng;
use kolo_comm::{BufMut, Communicator, ReduceOp, SumGroup};
use kolo_ddp::{Ddp, ShardPlan, Sharding};
use kolo_optim::{LossScaler, Optimizer};
use kolo_tensor::{build_model, Batch, Model, ModelSpec, ParamSet, ParamView, PlainView};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// All-reduces of the vocabulary-parallel embedding, head and cross-entropy per micro-step.
const VOCAB_PARALLEL_REDUCES: usize = 5;

pub struct DataParallel<'a> {
    t: StepTables<'a>,
    /// The data-parallel group.
    comm: Arc<dyn Communicator>,
    global_rank: usize,
    quiet: bool,
    model: Box<dyn Model>,
    spec: ModelSpec,
    /// The DDP engine, the optimizer and the step's state (the library's `Trainer` steps its
    /// own the same way).
    e: Engine,
    /// ZeRO-3 (FSDP-style, as the library's `Trainer`): the blocks' variables, emptied and
    /// gathered back into when the model reads them; and the engine's view of the parameters,
    /// in which the blocks are released (their values live as the engine's master shards).
    zero3: Option<(Zero3, ParamSet)>,
    eval_view: Box<dyn ParamView>,
    /// The model's parameters by variable id, where backward hands their gradients.
    ids: std::collections::HashMap<candle_core::TensorId, usize>,
    /// Tensor parallelism: the group (counting its all-reduces), its communicator, and which
    /// parameters are split over it.
    tp: Option<(Arc<SumGroup>, Arc<dyn Communicator>)>,
    tp_split: Option<Vec<bool>>,
    meta: BTreeMap<String, String>,
    numel: usize,
    inject_inf_at: Option<u64>,
}

impl<'a> DataParallel<'a> {
    /// Builds the model (split over `tp` when given), the DDP engine over the data-parallel
    /// group `comm` and the optimizer; broadcasts rank 0's parameters, or loads `resume`.
    pub fn new(
        cfg: &'a Config,
        comm: Arc<dyn Communicator>,
        tp: Option<Arc<dyn Communicator>>,
        global_rank: usize,
        data: &Data,
        resume: Option<&Path>,
        opts: &RunOptions,
    ) -> Result<(DataParallel<'a>, Start), TrainError> {
        let tc = &cfg.train;
        comm.set_timeout(cfg.ddp.timeout());
        let world = comm.world_size().get();
        let tp = tp.map(|c| (SumGroup::new(c.clone()), c));
        let spec = cfg.model_spec(data.vocab_size);
        let mut model = dp_model(cfg, &spec, tp.as_ref().map(|(g, _)| g.clone()))?;
        let tp_split = model.tensor_parallel_split();
        let sharding = cfg.sharding().map_err(TrainError::Config)?;
        let groups = if sharding == Sharding::Parameters { model.param_groups() } else { Vec::new() };
        let mut e = Engine::build(comm.clone(), &model.params().signature(), &cfg.ddp, &cfg.optim, cfg.optimizer(), sharding, groups)?;
        e.start(model.params(), &cfg.optim)?;
        let dtype = cfg.compute_dtype();
        e.scaler = (dtype == kolo_tensor::CandleDType::F16).then(LossScaler::new);
        let mut meta = checkpoint_meta(cfg, &spec, world, sharding.stage());
        if tp.is_none() {
            // The model by its parameters, as the library's Trainer names it: either continues
            // the other's checkpoints.
            let sig = crate::checkpointing::model_signature(&model.params().signature());
            meta.insert(crate::checkpointing::SIGNATURE_KEY.to_string(), sig);
        }
        // Resume: every rank reads the same file, so every rank continues identically.
        let start = match resume {
            Some(path) if tp.is_some() => {
                let mut flat = vec![0f32; model.params().numel()];
                let r = load_tensor_parallel(path, &*model, &spec, tc.seed, &mut flat, &mut e.opt, &meta)?;
                e.set_values(model.params(), &flat, r.loss_scale)?;
                Some((path.to_path_buf(), r))
            }
            Some(path) => {
                let (r, notes) = e.resume(path, model.params(), &meta, cfg.ddp.local_sgd.is_some())?;
                for note in notes.iter().filter(|_| global_rank == 0 && !opts.quiet) {
                    kolo_base::eline!("{note}");
                }
                Some((path.to_path_buf(), r))
            }
            None => None,
        };
        let zero3 = match sharding == Sharding::Parameters {
            true => Some(shard_groups(&mut *model, &e)?),
            false => None,
        };
        let numel = model.params().numel();
        if tc.grad_accum > 1 || cfg.ddp.skip_sync || cfg.ddp.local_sgd.is_some() || cfg.ddp.deterministic {
            e.local = vec![0f32; numel];
        }
        let eval_view: Box<dyn ParamView> =
            if dtype == kolo_tensor::CandleDType::F32 { Box::new(PlainView) } else { Box::new(kolo_tensor::CastView(dtype)) };
        if global_rank == 0 && !opts.quiet {
            announce(cfg, &*model, &spec, &e.ddp, e.zero.as_ref(), data);
        }
        let ids = crate::update::param_ids(model.params());
        let s = DataParallel {
            t: cfg.step_tables(),
            comm,
            global_rank,
            quiet: opts.quiet,
            model,
            spec,
            e,
            zero3,
            eval_view,
            ids,
            tp,
            tp_split,
            meta,
            numel,
            inject_inf_at: opts.inject_inf_at,
        };
        Ok((s, start))
    }

    /// The parameters as the engine updates and checkpoints them (under ZeRO-3 the blocks are
    /// released: their values are the master shards).
    fn params(&self) -> &ParamSet {
        engine_params(&self.zero3, &*self.model)
    }

    /// ZeRO-3: reports a gather that failed in a forward pass (outside a step no gather is
    /// prefetched, so the driver's own collectives find the communicator idle).
    fn settle(&self) -> Result<(), TrainError> {
        if let Some((z, _)) = &self.zero3 {
            z.take_error().map_err(|e| self.zero3_error(e))?;
        }
        Ok(())
    }

    fn zero3_error(&self, e: crate::zero3::Zero3Error) -> TrainError {
        TrainError::Other(format!("rank {}: {e}", self.global_rank))
    }

    /// Forward and backward of the step's micro-batches; only the last one communicates
    /// (`update::backward_routed`, bucket by bucket as backward produces gradients, the path
    /// the library's Trainer takes, ZeRO-3's groups too). Returns the mean loss.
    fn forward_backward(&mut self, step: u64, data: &mut Batches) -> Result<f64, TrainError> {
        let tc = self.t.train;
        let te = kolo_tensor::TensorError::from;
        let rank = self.comm.rank().get();
        let mut loss_sum = 0f64;
        for m in 0..tc.grad_accum {
            let batch = data.next_batch()?;
            // Under dynamic batch sizing a rank's mean loss weighs by its share of the batch.
            let scale = data.share() / tc.grad_accum as f64;
            // f16: backward runs on the loss times the loss scale; the step divides it out.
            let loss_scale = self.e.scaler.as_ref().map_or(1.0, LossScaler::scale);
            if let Some((z, _)) = &self.zero3 {
                z.set_prefetch(true);
            }
            if self.e.exact.is_some() {
                loss_sum += self.exact_pieces(&batch, (rank, step))? / tc.grad_accum as f64;
            } else {
                // As the library's Trainer::backward: the micro-step that communicates hands
                // each gradient to DDP's buckets as backward makes it final; the others keep
                // theirs local.
                let communicate = self.e.communicates(m + 1 == tc.grad_accum, step);
                let loss = (self.model.loss(&batch, &*self.eval_view)? * scale).map_err(te)?;
                loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
                let params = engine_params(&self.zero3, &*self.model);
                self.e.backward(&(loss * loss_scale).map_err(te)?, &self.ids, params, communicate, None)?;
            }
            self.settle()?;
        }
        Ok(loss_sum)
    }

    /// Deterministic mode, one micro-step: `batch` cut into pieces of `ddp.deterministic_chunk`
    /// examples, each piece's gradient (of its own mean loss) added to the step's exact sum.
    /// Returns the mean of the pieces' losses. `at` = (rank, step) for the error.
    fn exact_pieces(&mut self, batch: &Batch, at: (usize, u64)) -> Result<f64, TrainError> {
        let te = kolo_tensor::TensorError::from;
        let chunk = self.t.ddp.deterministic_chunk;
        let pieces = batch.chunks(chunk).ok_or_else(|| {
            TrainError::Config(format!("ddp.deterministic_chunk = {chunk} does not divide this rank's batch of {}", batch.len()))
        })?;
        let mut loss_sum = 0f64;
        for piece in &pieces {
            let loss = self.model.loss(piece, &*self.eval_view)?;
            loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
            self.e.backward_piece(&loss, &self.ids, engine_params(&self.zero3, &*self.model), at)?;
        }
        Ok(loss_sum / pieces.len() as f64)
    }

    /// The step's end (`Engine::update`: the buckets, a local step or deterministic mode's
    /// exact sum) and its record.
    fn end_step(&mut self, step: u64, lr: f32, out: &mut StepOut) -> Result<(), TrainError> {
        let group = self.tp.as_ref().map(|(g, _)| &**g as &dyn kolo_base::GroupSum);
        let checks = crate::update::Checks {
            comm: &*self.comm,
            clip: self.t.optim.clip_grad_norm,
            tp: self.tp_split.as_deref().zip(group),
            inject_inf: self.inject_inf_at == Some(step) && self.comm.rank().get() == 0,
            skip_nonfinite: self.t.train.on_nonfinite == crate::config::OnNonFinite::Skip,
        };
        // Deterministic mode: pieces in the whole step (micro-steps x the global batch / piece size).
        let global = self.t.batch_size * self.comm.world_size().get();
        let pieces = self.t.train.grad_accum as usize * global / self.t.ddp.deterministic_chunk.max(1);
        let local = self.e.is_local_step(step) && self.e.exact.is_none();
        let end = crate::update::StepEnd { step, lr, checks, pieces, sp: None };
        let stats = self.e.update(engine_params(&self.zero3, &*self.model), &end, &mut |_| Ok(()))?.stats;
        if let Some((z, _)) = &self.zero3 {
            // The shards changed: every gathered copy is stale.
            z.set_prefetch(false);
            z.release_all().map_err(|e| self.zero3_error(e))?;
        }
        if local {
            // A local step waits for nothing; local SGD's averaging is its traffic.
            out.rec.comm_bytes = self.t.ddp.local_sgd.is_some().then_some(stats.bytes);
            return Ok(());
        }
        out.comm_spans = stats.buckets.iter().enumerate().map(|(b, (s0, s1))| (format!("bucket {b}"), *s0, *s1)).collect();
        out.rec.wait_ms = Some(stats.wait.as_secs_f64() * 1e3);
        out.rec.hidden = Some(if self.e.exact.is_some() { 0.0 } else { stats.hidden_fraction() });
        out.rec.comm_bytes = Some(stats.bytes);
        Ok(())
    }

    /// The whole model's parameters on every rank.
    fn whole_params(&self) -> Result<Vec<f32>, TrainError> {
        if self.zero3.is_some() {
            let mut flat = vec![0f32; self.numel];
            let ranges = self.e.ddp.ranges();
            self.e.ddp.with_master(|m| {
                self.e.ddp.all_gather_everything(m, |i, v| {
                    flat[ranges[i].clone()].copy_from_slice(v);
                    Ok::<(), TrainError>(())
                })
            })?;
            return Ok(flat);
        }
        let local = self.model.params().to_flat()?;
        match (self.model.tensor_parallel_pieces(&local), &self.tp) {
            (Some(pieces), Some((_, tp))) => {
                // The whole model on every rank: the group's pieces summed.
                let mut full = pieces?;
                tp.all_reduce(BufMut::from(&mut full[..]), ReduceOp::Sum)?;
                Ok(full)
            }
            _ => Ok(local),
        }
    }

    /// Model states this rank held between steps: the parameters live in the model only
    /// (updated in place), the gradients in the DDP buckets (plain DDP, ZeRO-1) or this rank's
    /// shard of them (ZeRO-2/3), the optimizer state for the whole model or this rank's shard.
    fn states(&self) -> StateBytes {
        let bytes = |n: usize| n as u64 * 4;
        let params = self.params();
        let resident: usize = (0..params.len()).filter(|&i| params.is_resident(i)).map(|i| params.get(i).range.len()).sum();
        let grads = if matches!(self.e.ddp.sharding(), Sharding::Gradients | Sharding::Parameters) {
            self.e.ddp.grad_len()
        } else {
            self.e.ddp.plan().iter().map(|b| b.numel).sum()
        };
        StateBytes {
            params: bytes(resident),
            grads: bytes(grads + self.e.local.len()),
            optimizer: bytes(
                self.e.opt.state().iter().map(|(_, v)| v.len()).sum::<usize>() + self.e.master.len() + self.e.ddp.with_master(|m| m.len()),
            ),
            offloaded: self.e.opt.is_offloaded() || self.e.master.is_offloaded(),
        }
    }

    /// Tensor parallelism: the group assembles whole tensors (parameters and optimizer state)
    /// and its member 0 in each replica group writes them as plain DDP would, under the whole
    /// model's names, so the checkpoint continues at any tensor-parallel size or without one.
    fn save_tensor_parallel(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        let Some((_, tp)) = &self.tp else { unreachable!("called under tensor parallelism") };
        let whole = |local: &[f32]| -> Result<Vec<f32>, TrainError> {
            let mut full = self.model.tensor_parallel_pieces(local).ok_or_else(|| TrainError::Other("not a split model".into()))??;
            tp.all_reduce(BufMut::from(&mut full[..]), ReduceOp::Sum)?;
            Ok(full)
        };
        let values = whole(&self.model.params().to_flat()?)?;
        let states = self.e.opt.state().into_iter().map(|(name, v)| Ok((name, whole(v)?))).collect::<Result<Vec<_>, TrainError>>()?;
        if tp.rank().get() != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let ModelSpec::Gpt(gc) = &self.spec else { unreachable!("tensor parallelism splits the GPT") };
        let gpt = kolo_tensor::models::Gpt::new(gc.clone(), &mut Rng::new(self.t.train.seed))?;
        gpt.params().load(&values)?;
        let mut opt = Optimizer::new(self.t.optim.spec(), values.len());
        opt.load_state(self.e.opt.steps(), &states).map_err(TrainError::Other)?;
        let mut meta = self.meta.clone();
        meta.extend(at.meta);
        save_checkpoint(at.dir, at.step, gpt.params(), &[], &opt, None, &*self.comm, at.pos, &meta, Vec::new(), at.background, at.crash)
    }

    /// The tensor-parallel group's traffic per micro-step, on the lead rank.
    fn report_tensor_parallel(&self, steps_run: u64) {
        let (Some((g, _)), ModelSpec::Gpt(gc)) = (&self.tp, &self.spec) else { return };
        if self.global_rank != 0 || self.quiet {
            return;
        }
        let steps = steps_run.max(1) * self.t.train.grad_accum;
        let (calls, bytes) = g.traffic();
        let (calls, mb) = (calls as f64 / steps as f64, bytes as f64 / steps as f64 / 1e6);
        // Outside the blocks: the vocabulary-parallel embedding (1, forward), head (1, backward)
        // and cross-entropy (3: maxima, sums of exponentials, target logits).
        kolo_base::eline!(
            "tensor parallel: {calls:.1} all-reduces ({mb:.2} MB) per micro-step over {} ranks: {:.1} per block for {} blocks (Megatron: 2 in forward + 2 in backward) + {VOCAB_PARALLEL_REDUCES} for the vocabulary-parallel embedding, head and cross-entropy",
            kolo_base::GroupSum::size(&**g),
            (calls - VOCAB_PARALLEL_REDUCES as f64) / gc.n_layer as f64,
            gc.n_layer,
        );
    }
}

impl Strategy for DataParallel<'_> {
    fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        let loss = self.forward_backward(ctx.step, data)?;
        let mut out = StepOut { loss, backward_end: Some(Instant::now()), ..Default::default() };
        self.end_step(ctx.step, ctx.lr, &mut out)?;
        out.rec.skipped_steps = self.e.skipped_steps();
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        let settle = || self.settle();
        evaluate(&*self.model, &*self.eval_view, ds, &*self.comm, self.t.batch_size, max_batches, self.zero3.is_some(), &settle).map(Some)
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        // Under ZeRO-3 every rank samples (the same text: same seed), since each forward
        // gathers the blocks collectively.
        let ModelSpec::Gpt(g) = &self.spec else { return Ok(None) };
        if self.comm.rank().get() != 0 && self.zero3.is_none() {
            return Ok(None);
        }
        let tc = self.t.train;
        let settle = || self.settle();
        sample_text(&*self.model, &*self.eval_view, vocab, g.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &settle).map(Some)
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        if self.tp.is_some() {
            return self.save_tensor_parallel(at);
        }
        let mut meta = self.meta.clone();
        meta.extend(at.meta);
        let replica = self.e.replica(self.params(), self.t.ddp.local_sgd.is_some());
        replica.save(at.dir, at.step, at.pos, meta, at.background, at.crash)
    }

    fn finish(&mut self, steps_run: u64) -> Result<Finish, TrainError> {
        self.report_tensor_parallel(steps_run);
        let moe = crate::expert_parallel::reduce_load(self.model.take_moe_load(), &*self.comm)?;
        Ok(Finish {
            params: self.whole_params()?,
            states: self.states(),
            skipped_steps: self.e.skipped_steps(),
            loss_scale: self.e.scaler.as_ref().map(LossScaler::scale),
            moe,
            pipeline_bubble: None,
            ps: None,
        })
    }
}

/// The parameters as the engine sees them: the model's, or under ZeRO-3 those with the blocks
/// released (a function of the two fields, so that the engine can be borrowed beside it).
fn engine_params<'a>(zero3: &'a Option<(Zero3, ParamSet)>, model: &'a dyn Model) -> &'a ParamSet {
    zero3.as_ref().map_or_else(|| model.params(), |(_, p)| p)
}

/// ZeRO-3: the model's groups (the GPT's blocks), whose variables from now on hold their values
/// only while the model reads them (`crate::zero3`, FSDP-style, as the library's `Trainer`), and
/// the engine's view of the parameters with those groups released.
fn shard_groups(model: &mut dyn Model, e: &Engine) -> Result<(Zero3, ParamSet), TrainError> {
    let groups = model.param_groups();
    if groups.is_empty() || model.tensor_parallel_split().is_some() {
        return Err(TrainError::Config(
            "ddp.zero_stage = 3 shards the GPT's blocks: this model has none to shard (or is split over a tensor-parallel group)".into(),
        ));
    }
    // Checkpointed blocks read their variables again in backward (a gather) instead of keeping
    // a copy of their parameters through the step.
    model.reread_parameters();
    let params = model.params();
    let mut released = ParamSet::new();
    for p in params.iter() {
        released.adopt(&p.name, p.var.clone())?;
    }
    for &i in groups.iter().flatten() {
        released.release(i)?;
    }
    // Each group by the name prefix its parameters share (`blocks.3.`), for errors.
    let prefix = |g: &[usize]| {
        let first = &params.get(g[0]).name;
        let common =
            g.iter().map(|&i| first.bytes().zip(params.get(i).name.bytes()).take_while(|(a, b)| a == b).count()).min().unwrap_or(0);
        first[..first[..common].rfind('.').map_or(0, |d| d + 1)].to_string()
    };
    let prefixes: Vec<String> = groups.iter().map(|g| prefix(g)).collect();
    let prefixes: Vec<&str> = prefixes.iter().map(String::as_str).collect();
    let vars = groups.iter().map(|g| g.iter().map(|&i| (params.get(i).name.clone(), params.get(i).var.clone())).collect()).collect();
    let z = Zero3::new(e.ddp.gatherer(), &prefixes, vars, "ddp.zero_stage = 3").map_err(|e| TrainError::Config(e.to_string()))?;
    Ok((z, released))
}

/// The model the config names, its tensor-parallel split over `tp` when there is one, with the
/// configured activation checkpointing.
fn dp_model(cfg: &Config, spec: &ModelSpec, tp: Option<Arc<SumGroup>>) -> Result<Box<dyn Model>, TrainError> {
    let seed = cfg.train.seed;
    let mut model = match (tp, spec) {
        (Some(g), ModelSpec::Gpt(gc)) => {
            Box::new(kolo_tensor::models::Gpt::new_tensor_parallel(gc.clone(), &mut Rng::new(seed), g)?) as Box<dyn Model>
        }
        _ => build_model(spec, seed)?,
    };
    model.set_checkpointing(&cfg.model.checkpoint_blocks)?;
    Ok(model)
}

/// The start line of a data-parallel run.
fn announce(cfg: &Config, model: &dyn Model, spec: &ModelSpec, ddp: &Ddp, zero: Option<&ShardPlan>, data: &Data) {
    let (tc, world, numel) = (&cfg.train, ddp.comm().world_size().get(), model.params().numel());
    kolo_base::eline!(
        "kolo train: {} params, {} on {world} rank(s), global batch {} ({} x {world} ranks x {} micro-steps), {} buckets{}, data: {}, CPU kernels: {}, {} thread(s)",
        numel,
        spec_string(spec),
        crate::config::global_batch(cfg.data.batch_size, world, tc.grad_accum),
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
}

/// Tensor parallelism: loads a checkpoint of whole tensors (written at any tensor-parallel
/// size, or by any strategy) into a whole GPT and its optimizer, then takes this member's
/// pieces of the parameters (into `flat`) and of the optimizer state (into `opt`).
fn load_tensor_parallel(
    path: &Path,
    model: &dyn Model,
    spec: &ModelSpec,
    seed: u64,
    flat: &mut [f32],
    opt: &mut Optimizer,
    meta: &BTreeMap<String, String>,
) -> Result<crate::checkpointing::Resumed, TrainError> {
    let ModelSpec::Gpt(gc) = spec else { unreachable!("tensor parallelism splits the GPT") };
    let whole = kolo_tensor::models::Gpt::new(gc.clone(), &mut Rng::new(seed))?;
    let mut full = vec![0f32; whole.params().numel()];
    let mut whole_opt = Optimizer::new(opt.spec().clone(), full.len());
    let ranges: Vec<_> = whole.params().iter().map(|p| p.range.clone()).collect();
    let r = load_checkpoint(path, whole.params(), &mut full, &mut whole_opt, None, &ranges, meta)?;
    let local =
        |v: &[f32]| model.tensor_parallel_local(v).ok_or_else(|| TrainError::Other("not a split model".into()))?.map_err(TrainError::from);
    flat.copy_from_slice(&local(&full)?);
    let states = whole_opt.state().into_iter().map(|(name, v)| Ok((name, local(v)?))).collect::<Result<Vec<_>, TrainError>>()?;
    opt.load_state(whole_opt.steps(), &states).map_err(TrainError::Other)?;
    Ok(r)
}
