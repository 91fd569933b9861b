//! Pipeline-parallel training of the GPT (`[pipeline]`): rank s of the pipeline group is stage s.
//! The planner cuts the layers (embedding, blocks, head) into stages of balanced cost; each
//! batch is split into micro-batches that flow through the stages by the chosen schedule (GPipe
//! or 1F1B, flushed every batch; PipeDream-2BW, never flushed); each stage accumulates its own
//! parameters' gradients over the micro-batches, averages them over its data-parallel replicas
//! and steps its own optimizer. Under tensor parallelism a stage's blocks are split over its
//! tensor-parallel group. At the end the whole model is assembled on every rank.
//!
//! GPipe and 1F1B flush every batch, so they are a [`Strategy`] on the driver ([`Flushed`]):
//! checkpoints (each stage writes its own layers, whole tensors under the model's names, so a
//! checkpoint continues under any strategy), evaluation, timelines and the rest come from
//! there. PipeDream-2BW is one stream of micro-batches over the whole run: it runs its own loop
//! ([`run_two_bw_pipeline`]).

use crate::checkpointing::{load_checkpoint, save_checkpoint, PendingSave};
use crate::config::{Config, PipeSchedule};
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::trainer::{
    evaluate_whole_gpt, gpt_loop_start, lead_say, peak_rss, replica_batches, Data, Eval, RunOptions, StateBytes, Summary,
};
use crate::TrainError;
use kolo_base::{GroupSum, Rng};
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::{Segment, ShardPlan};
use kolo_optim::{clip_factor, lr_at, Optimizer};
use kolo_pipe::{partition, run_stage, theoretical_bubble, weight_version, Schedule, StageWork};
use kolo_tensor::models::{Gpt, GptConfig};
use kolo_tensor::{Batch, GptStage, Input, Model, ModelSpec};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

struct Work(GptStage);

impl StageWork for Work {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.forward(mb, input).map_err(|e| e.to_string())
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.backward(mb, grad).map_err(|e| e.to_string())
    }
}

/// Splits a batch of sequences into `m` micro-batches of equal size.
pub fn split_batch(batch: &Batch, m: usize) -> Result<Vec<Batch>, TrainError> {
    let Input::Tokens { b, .. } = &batch.input else {
        return Err(TrainError::Config("pipeline parallelism takes token sequences".into()));
    };
    if m == 0 || b % m != 0 {
        return Err(TrainError::Config(format!("a batch of {b} sequences does not split into {m} micro-batches")));
    }
    batch.chunks(b / m).ok_or_else(|| TrainError::Config(format!("a batch of {b} sequences does not split into {m} micro-batches")))
}

/// What every stage of a pipeline run shares: its layers, its parameters and their flat
/// ranges, the groups, and the optimizer of its own parameters.
struct StageSetup<'a> {
    cfg: &'a Config,
    comm: &'a dyn Communicator,
    /// PipeDream-2BW: a second communicator over the pipeline's ranks for the agreement at
    /// each update, so that it never falls between the activations still streaming on `comm`.
    sync: Option<Arc<dyn Communicator>>,
    dp: &'a dyn Communicator,
    tp: Option<Arc<dyn GroupSum>>,
    layers: std::ops::Range<usize>,
    own: Vec<usize>,
    ranges: Vec<std::ops::Range<usize>>,
    opt: Optimizer,
    m: usize,
    /// Keep only each micro-batch's stage input; recompute in backward.
    remat: bool,
}

impl StageSetup<'_> {
    /// Averages this stage's gradients over its data-parallel replicas.
    fn average(&self, grads: &mut [f32]) -> Result<(), TrainError> {
        if self.dp.world_size().get() == 1 {
            return Ok(());
        }
        let mut packed: Vec<f32> = self.ranges.iter().flat_map(|r| grads[r.clone()].iter().copied()).collect();
        self.dp.all_reduce(BufMut::from(&mut packed[..]), ReduceOp::Avg)?;
        let mut at = 0;
        for r in &self.ranges {
            grads[r.clone()].copy_from_slice(&packed[at..at + r.len()]);
            at += r.len();
        }
        Ok(())
    }

    /// Over the pipeline group: the clipping factor of the global gradient norm, and the batch
    /// loss (`loss_sum`: the last stage's micro-batch losses) averaged over the replicas.
    fn clip_and_loss(&self, gpt: &Gpt, grads: &[f32], loss_sum: f64) -> Result<(f32, f64), TrainError> {
        let mut v = [0f64, loss_sum];
        if self.cfg.optim.clip_grad_norm.is_some() {
            // Split parameters summed over the tensor-parallel group, replicated ones once.
            let split = gpt.tensor_parallel_split();
            let counted = |i: usize| split.as_ref().is_none_or(|s| s[i] || self.tp.as_ref().is_some_and(|g| g.rank() == 0));
            let mut sq = [self
                .own
                .iter()
                .zip(&self.ranges)
                .filter(|(i, _)| counted(**i))
                .map(|(_, r)| kolo_optim::sum_of_squares(&grads[r.clone()]))
                .sum::<f64>() as f32];
            if let Some(g) = &self.tp {
                g.sum(&mut sq).map_err(TrainError::Other)?;
            }
            v[0] = f64::from(sq[0]);
        }
        self.sync.as_deref().unwrap_or(self.comm).all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
        let mut l = [v[1]];
        self.dp.all_reduce(BufMut::from(&mut l[..]), ReduceOp::Avg)?;
        Ok((self.cfg.optim.clip_grad_norm.map_or(1.0, |max| clip_factor(v[0].sqrt(), max)), l[0]))
    }

    /// One optimizer step of this stage's parameters of `gpt` with `grads` scaled by `f`.
    fn step(&mut self, gpt: &Gpt, grads: &[f32], f: f32, lr: f32) -> Result<(), TrainError> {
        self.opt.begin_step();
        let mut at = 0;
        for (&i, r) in self.own.iter().zip(&self.ranges) {
            let g: Vec<f32> = grads[r.clone()].iter().map(|x| x * f).collect();
            let opt = &mut self.opt;
            gpt.params().update_one(i, &mut |p| opt.update(at, p, &g, lr))?;
            at += r.len();
        }
        Ok(())
    }

    /// The idle share of the stages over `total_ms` given this stage's `busy_ms`.
    fn bubble(&self, busy_ms: f64, total_ms: f64) -> Result<f64, TrainError> {
        let (stage, k) = (self.comm.rank().get(), self.comm.world_size().get());
        let mut t = vec![0f64; 2 * k];
        t[2 * stage] = busy_ms;
        t[2 * stage + 1] = total_ms;
        self.comm.all_reduce(BufMut::from(&mut t[..]), ReduceOp::Sum)?;
        let span = (0..k).map(|s| t[2 * s + 1]).fold(0.0, f64::max);
        let busy: f64 = (0..k).map(|s| t[2 * s]).sum();
        Ok(if span > 0.0 { 1.0 - busy / (k as f64 * span) } else { 0.0 })
    }

    /// The whole model on every rank: each stage contributes its own layers' values (under
    /// tensor parallelism first put together within the tensor-parallel group).
    fn assemble(&self, gpt: &Gpt) -> Result<Vec<f32>, TrainError> {
        let mut mine = vec![0f32; gpt.params().numel()];
        let values = gpt.params().to_flat()?;
        for r in &self.ranges {
            mine[r.clone()].copy_from_slice(&values[r.clone()]);
        }
        let mut flat = match (&self.tp, gpt.tensor_parallel_pieces(&mine)) {
            (Some(g), Some(pieces)) => {
                let mut full = pieces?;
                g.sum(&mut full).map_err(TrainError::Other)?;
                full
            }
            _ => mine,
        };
        self.comm.all_reduce(BufMut::from(&mut flat[..]), ReduceOp::Sum)?;
        Ok(flat)
    }
}

/// Builds this stage of a pipeline over `comm` (rank = stage) with data-parallel group `dp`
/// and tensor-parallel group `tp`: the GPT, the plan's layers for this stage, their parameters
/// and their optimizer. `batches`: the run's batches (2BW's one stream covers them all).
fn build_stage<'a>(
    cfg: &'a Config,
    comm: &'a dyn Communicator,
    dp: &'a dyn Communicator,
    tp: Option<Arc<dyn GroupSum>>,
    gcfg: &GptConfig,
    batches: u64,
    lead: bool,
) -> Result<(Gpt, StageSetup<'a>, Schedule), TrainError> {
    let pc = cfg.pipeline.as_ref().expect("called for [pipeline] configs");
    let (stage, k) = (comm.rank().get(), comm.world_size().get());
    let gpt = match &tp {
        Some(g) => Gpt::new_tensor_parallel(gcfg.clone(), &mut Rng::new(cfg.train.seed), g.clone())?,
        None => Gpt::new(gcfg.clone(), &mut Rng::new(cfg.train.seed))?,
    };
    if k > gpt.layers() {
        return Err(TrainError::Config(format!(
            "{k} pipeline stages for a GPT with {} layers (embedding, {} blocks, head)",
            gpt.layers(),
            gcfg.n_layer
        )));
    }
    let plan = partition(&gpt.layer_costs(), k);
    let layers = plan[stage].clone();
    let m = pc.micro_batches;
    let schedule = match pc.schedule {
        PipeSchedule::GPipe => Schedule::GPipe,
        PipeSchedule::OneFOneB => Schedule::OneFOneB,
        PipeSchedule::TwoBw => Schedule::TwoBw { batches: batches as usize },
    };
    if matches!(schedule, Schedule::TwoBw { .. }) && m + 1 < k {
        return Err(TrainError::Config(format!("PipeDream-2BW needs at least stages - 1 = {} micro-batches per batch (pipeline.micro_batches = {m}): a batch's weight version must exist before its first forward", k - 1)));
    }
    let own: Vec<usize> = layers.clone().flat_map(|l| gpt.layer_params(l)).collect();
    let ranges: Vec<std::ops::Range<usize>> = own.iter().map(|&i| gpt.params().get(i).range.clone()).collect();
    let own_len: usize = ranges.iter().map(|r| r.len()).sum();
    let opt = crate::trainer::optimizer_for(cfg, own_len)?;
    if lead {
        kolo_base::eline!(
            "kolo train (pipeline): GPT {} params in {k} stages {:?} (layers: 0 = embedding, 1..={} blocks, {} = head) x {} data-parallel replicas x {} tensor-parallel ranks, {m} micro-batches of {}, {:?}; theoretical bubble {:.1}%",
            gpt.full_numel(),
            plan,
            gcfg.n_layer,
            gcfg.n_layer + 1,
            dp.world_size().get(),
            tp.as_ref().map_or(1, |g| g.size()),
            cfg.data.batch_size / m,
            schedule,
            theoretical_bubble(k, if matches!(schedule, Schedule::TwoBw { .. }) { m * batches as usize } else { m }) * 100.0
        );
    }
    let sync = match schedule {
        Schedule::TwoBw { .. } => {
            let all: Vec<kolo_base::Rank> = (0..k).map(kolo_base::Rank).collect();
            let g = comm.new_group(&all)?.expect("every stage is a member");
            g.set_timeout(comm.timeout());
            Some(g)
        }
        _ => None,
    };
    let setup = StageSetup { cfg, comm, sync, dp, tp, layers, own, ranges, opt, m, remat: pc.rematerialize };
    Ok((gpt, setup, schedule))
}

impl StageSetup<'_> {
    /// The line at the end of a run: measured and theoretical bubble, activations kept.
    fn say_bubble(&self, bubble: f64, theory: f64, two_bw: bool, peak_live: usize, lead: bool) {
        if lead {
            kolo_base::eline!(
                "pipeline: mean bubble {:.1}% measured, {:.1}% in theory ((K-1)/(M+K-1){}); at most {peak_live} micro-batch(es) of activations alive on stage 0",
                bubble * 100.0,
                theory * 100.0,
                if two_bw { ", M = every micro-batch of the run: no flush" } else { "" },
            );
        }
    }

    /// Model states of this stage: its own parameters and optimizer state, and the gradient of
    /// the whole model it accumulates into.
    fn states(&self, gpt: &Gpt) -> StateBytes {
        StateBytes {
            params: self.ranges.iter().map(|r| r.len() as u64 * 4).sum(),
            grads: gpt.params().numel() as u64 * 4,
            optimizer: self.opt.state().iter().map(|(_, v)| v.len() as u64 * 4).sum(),
            offloaded: self.opt.is_offloaded(),
        }
    }

    /// This stage's parameters as a shard plan (whole parameters, packed in stage order): the
    /// layout of its optimizer state, for checkpoints.
    fn shard_plan(&self) -> ShardPlan {
        self.plan_of(&self.ranges)
    }

    /// This stage's parameters, of the flat `ranges` (in stage order), as a shard plan.
    fn plan_of(&self, ranges: &[std::ops::Range<usize>]) -> ShardPlan {
        let mut at = 0;
        let segments = self
            .own
            .iter()
            .zip(ranges)
            .map(|(&param, r)| {
                let s = Segment { param, within: 0..r.len(), shard_offset: at };
                at += r.len();
                s
            })
            .collect();
        ShardPlan { world: self.comm.world_size(), rank: self.comm.rank(), pieces: Vec::new(), segments, len: at }
    }

    /// Under tensor parallelism: the whole (unsplit) model and the flat ranges of this stage's
    /// parameters in it (checkpoints hold whole tensors under the whole model's names).
    fn whole_model(&self, gcfg: &GptConfig, gpt: &Gpt) -> Result<(Gpt, Vec<std::ops::Range<usize>>), TrainError> {
        let whole = Gpt::new(gcfg.clone(), &mut Rng::new(self.cfg.train.seed))?;
        let mut ranges = Vec::with_capacity(self.own.len());
        for &i in &self.own {
            let (w, l) = (whole.params().get(i), gpt.params().get(i));
            if w.name != l.name {
                return Err(TrainError::Other(format!("parameter {i} is {} in the whole model and {} in the split one", w.name, l.name)));
            }
            ranges.push(w.range.clone());
        }
        Ok((whole, ranges))
    }
}

/// Packs `ranges` of `flat` in order.
fn pack(flat: &[f32], ranges: &[std::ops::Range<usize>]) -> Vec<f32> {
    ranges.iter().flat_map(|r| flat[r.clone()].iter().copied()).collect()
}

/// The inverse of [`pack`]: `packed` spread over `ranges` of a zeroed vector of `len` values.
fn unpack(packed: &[f32], ranges: &[std::ops::Range<usize>], len: usize) -> Vec<f32> {
    let mut out = vec![0f32; len];
    let mut at = 0;
    for r in ranges {
        out[r.clone()].copy_from_slice(&packed[at..at + r.len()]);
        at += r.len();
    }
    out
}

/// PipeDream-2BW (`pipeline.schedule = "2bw"`): `comm` is the pipeline group (rank = stage),
/// `dp` the data-parallel group of this stage's replicas, `tp` the tensor-parallel group (if
/// any).
pub fn run_two_bw_pipeline(
    cfg: &Config,
    comm: &dyn Communicator,
    dp: &dyn Communicator,
    tp: Option<Arc<dyn GroupSum>>,
    global_rank: usize,
    opts: &RunOptions,
) -> Result<Summary, TrainError> {
    let (dp_rank, dp_size) = (dp.rank().get(), dp.world_size().get());
    let say = lead_say(global_rank == 0 && !opts.quiet);
    let tc = &cfg.train;
    let (data, heap_before_model, gcfg) = gpt_loop_start(cfg, &[comm, dp], dp_rank)?;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let (gpt, mut setup, _) = build_stage(cfg, comm, dp, tp, &gcfg, end, global_rank == 0 && !opts.quiet)?;
    // Every stage of a replica reads the same batches (the first uses the tokens, the last the
    // targets); replicas read disjoint shards. Synthetic data is already per replica.
    let batches = replica_batches(cfg, data.train.clone(), dp_rank, dp_size, 0)?;
    kolo_base::alloc::reset_peak();
    let mut report = crate::report::Reporter::new(cfg, global_rank, opts.quiet, cfg.data.batch_size * dp_size, 0)?;
    let run = run_two_bw(&mut setup, Arc::new(gpt), &batches, end, &mut report)?;
    report.finish();
    let flat = setup.assemble(&run.gpt)?;
    let mut eval = None;
    let mut sample = None;
    if global_rank == 0 && end == tc.steps {
        let (e, s) = evaluate_whole_gpt(cfg, &gcfg, &flat, &data, &say)?;
        eval = Some(e);
        sample = s;
    }
    setup.say_bubble(run.bubble, run.theory, true, run.peak_live, global_rank == 0 && !opts.quiet);
    Ok(Summary {
        steps_done: end,
        last_loss: run.last_loss,
        eval,
        step_ms: run.step_ms,
        comm_wait_ms: Vec::new(),
        comm_bytes: run.comm_bytes,
        straggler: report.straggler,
        hidden_fraction: 1.0 - run.bubble,
        params: flat,
        sample,
        checkpoint: None,
        states: setup.states(&run.gpt),
        peak_rss: peak_rss(),
        heap: crate::trainer::HeapReport::between(heap_before_model, run.heap_after),
        skipped_steps: 0,
        loss_scale: None,
        ps: None,
        pipeline_bubble: Some(run.bubble),
        moe: None,
        batch_split: None,
    })
}

/// GPipe and 1F1B on the driver: every batch's micro-batches through the pipeline, a flush,
/// then each stage's step. Between steps nothing is in flight, so the driver's collectives run
/// on the pipeline group (every stage holds the same loss after `clip_and_loss`).
pub struct Flushed<'a> {
    setup: StageSetup<'a>,
    gpt: Arc<Gpt>,
    gcfg: GptConfig,
    schedule: Schedule,
    global_rank: usize,
    quiet: bool,
    bubbles: Vec<f64>,
    peak_live: usize,
    meta: std::collections::BTreeMap<String, String>,
}

impl<'a> Flushed<'a> {
    /// `comm`: the pipeline group (rank = stage); `dp`: this stage's data-parallel replicas;
    /// `tp`: its tensor-parallel group, if any. Loads `resume` (every stage reads the whole
    /// model and takes its own layers' optimizer state).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &'a Config,
        comm: &'a dyn Communicator,
        dp: &'a dyn Communicator,
        tp: Option<Arc<dyn GroupSum>>,
        global_rank: usize,
        data: &Data,
        resume: Option<&Path>,
        opts: &RunOptions,
    ) -> Result<(Flushed<'a>, Start), TrainError> {
        let gcfg = crate::trainer::gpt_config(cfg, &[comm, dp], data)?;
        let lead = global_rank == 0 && !opts.quiet;
        let (gpt, mut setup, schedule) = build_stage(cfg, comm, dp, tp, &gcfg, cfg.train.steps, lead)?;
        let meta = checkpoint_meta(cfg, &ModelSpec::Gpt(gcfg.clone()), dp.world_size().get(), 0);
        let start = match resume {
            Some(path) if setup.tp.is_some() => {
                Some((path.to_path_buf(), load_tensor_parallel_stage(path, &mut setup, &gcfg, &gpt, &meta)?))
            }
            Some(path) => {
                let mut flat = vec![0f32; gpt.params().numel()];
                let all: Vec<_> = gpt.params().iter().map(|p| p.range.clone()).collect();
                let plan = setup.shard_plan();
                let r = load_checkpoint(path, gpt.params(), &mut flat, &mut setup.opt, Some(&plan), &all, &meta)?;
                gpt.params().load(&flat)?;
                Some((path.to_path_buf(), r))
            }
            None => None,
        };
        let s =
            Flushed { setup, gpt: Arc::new(gpt), gcfg, schedule, global_rank, quiet: opts.quiet, bubbles: Vec::new(), peak_live: 0, meta };
        Ok((s, start))
    }
}

impl Flushed<'_> {
    /// Under tensor parallelism each tensor-parallel group puts its stage's layers (values and
    /// optimizer state) together into whole tensors, and its first member writes them as the
    /// stage's shard of the whole model.
    fn save_tensor_parallel(
        &self,
        at: SaveAt<'_>,
        tp: &dyn GroupSum,
        meta: &std::collections::BTreeMap<String, String>,
    ) -> Result<PendingSave, TrainError> {
        let setup = &self.setup;
        let (whole, ranges) = setup.whole_model(&self.gcfg, &self.gpt)?;
        let local_len = self.gpt.params().numel();
        // Packed stage values in the split layout -> packed values in the whole one.
        let put_together = |packed: &[f32]| -> Result<Vec<f32>, TrainError> {
            let mine = unpack(packed, &setup.ranges, local_len);
            let mut full = self.gpt.tensor_parallel_pieces(&mine).ok_or_else(|| TrainError::Other("not a split model".into()))??;
            tp.sum(&mut full).map_err(TrainError::Other)?;
            Ok(pack(&full, &ranges))
        };
        let master = put_together(&pack(&self.gpt.params().to_flat()?, &setup.ranges))?;
        let states = setup.opt.state().into_iter().map(|(name, v)| Ok((name, put_together(v)?))).collect::<Result<Vec<_>, TrainError>>()?;
        if tp.rank() != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let mut opt = Optimizer::new(setup.cfg.optimizer(), master.len());
        opt.load_state(setup.opt.steps(), &states).map_err(TrainError::Other)?;
        let plan = setup.plan_of(&ranges);
        save_checkpoint(
            at.dir,
            at.step,
            whole.params(),
            &master,
            &opt,
            Some(&plan),
            setup.comm,
            at.pos,
            meta,
            Vec::new(),
            at.background,
            at.crash,
        )
    }
}

/// Loads this stage's layers and their optimizer state from a checkpoint of whole tensors into
/// a tensor-parallel stage (the inverse of `Flushed::save_tensor_parallel`).
fn load_tensor_parallel_stage(
    path: &Path,
    setup: &mut StageSetup<'_>,
    gcfg: &GptConfig,
    gpt: &Gpt,
    meta: &std::collections::BTreeMap<String, String>,
) -> Result<crate::checkpointing::Resumed, TrainError> {
    let (whole, ranges) = setup.whole_model(gcfg, gpt)?;
    let mut full = vec![0f32; whole.params().numel()];
    let plan = setup.plan_of(&ranges);
    let mut whole_opt = Optimizer::new(setup.cfg.optimizer(), plan.len);
    let all: Vec<_> = whole.params().iter().map(|p| p.range.clone()).collect();
    let r = load_checkpoint(path, whole.params(), &mut full, &mut whole_opt, Some(&plan), &all, meta)?;
    let local =
        |v: &[f32]| gpt.tensor_parallel_local(v).ok_or_else(|| TrainError::Other("not a split model".into()))?.map_err(TrainError::from);
    gpt.params().load(&local(&full)?)?;
    let states = whole_opt
        .state()
        .into_iter()
        .map(|(name, v)| Ok((name, pack(&local(&unpack(v, &ranges, full.len()))?, &setup.ranges))))
        .collect::<Result<Vec<_>, TrainError>>()?;
    setup.opt.load_state(whole_opt.steps(), &states).map_err(TrainError::Other)?;
    Ok(r)
}

impl Strategy for Flushed<'_> {
    fn comm(&self) -> &dyn Communicator {
        self.setup.comm
    }

    fn replica(&self) -> (usize, usize) {
        (self.setup.dp.rank().get(), self.setup.dp.world_size().get())
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut crate::driver::Batches) -> Result<StepOut, TrainError> {
        let setup = &mut self.setup;
        let (k, m) = (setup.comm.world_size().get(), setup.m);
        let batch = data.next_batch()?;
        let mut work = Work(GptStage::new(self.gpt.clone(), setup.layers.clone(), split_batch(&batch, m)?).rematerialize(setup.remat));
        let act_len = work.0.act_len()?;
        let stage = run_stage(setup.comm, self.schedule, m, act_len, &mut work).map_err(|e| TrainError::Other(e.to_string()))?;
        let mut grads = std::mem::take(&mut work.0.grads);
        drop(work);
        let backward_end = Instant::now();
        self.peak_live = self.peak_live.max(stage.max_live);
        setup.average(&mut grads)?;
        let (f, loss) = setup.clip_and_loss(&self.gpt, &grads, stage.losses.iter().map(|l| f64::from(*l)).sum())?;
        setup.step(&self.gpt, &grads, f, ctx.lr)?;
        let bubble = setup.bubble(stage.busy_ms, stage.total_ms)?;
        self.bubbles.push(bubble);
        let mut out = StepOut { loss, backward_end: Some(backward_end), ..Default::default() };
        out.rec.comm_bytes = Some(stage.bytes_sent);
        out.note = format!(", bubble {:.1}% (theory {:.1}%)", bubble * 100.0, theoretical_bubble(k, m) * 100.0);
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        let flat = self.setup.assemble(&self.gpt)?;
        (self.global_rank == 0).then(|| crate::trainer::evaluate_alone(self.setup.cfg, &self.gcfg, &flat, ds, max_batches)).transpose()
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        let flat = self.setup.assemble(&self.gpt)?;
        (self.global_rank == 0).then(|| crate::trainer::sample_alone(self.setup.cfg, &self.gcfg, &flat, vocab)).transpose()
    }

    fn save(&mut self, mut at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        // The first replica's stages write their own layers (each a shard of whole tensors);
        // the other replicas hold the same values.
        if self.setup.dp.rank().get() != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let mut meta = self.meta.clone();
        meta.extend(std::mem::take(&mut at.meta));
        if let Some(tp) = self.setup.tp.clone() {
            return self.save_tensor_parallel(at, &*tp, &meta);
        }
        let plan = self.setup.shard_plan();
        let values = self.gpt.params().to_flat()?;
        let master: Vec<f32> = self.setup.ranges.iter().flat_map(|r| values[r.clone()].iter().copied()).collect();
        let (params, opt, comm) = (self.gpt.params(), &self.setup.opt, self.setup.comm);
        save_checkpoint(at.dir, at.step, params, &master, opt, Some(&plan), comm, at.pos, &meta, Vec::new(), at.background, at.crash)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        let bubble = if self.bubbles.is_empty() { 0.0 } else { self.bubbles.iter().sum::<f64>() / self.bubbles.len() as f64 };
        let (k, m) = (self.setup.comm.world_size().get(), self.setup.m);
        self.setup.say_bubble(bubble, theoretical_bubble(k, m), false, self.peak_live, self.global_rank == 0 && !self.quiet);
        Ok(Finish {
            params: self.setup.assemble(&self.gpt)?,
            states: self.setup.states(&self.gpt),
            skipped_steps: 0,
            loss_scale: None,
            moe: None,
            pipeline_bubble: Some(bubble),
            ps: None,
        })
    }
}

/// What a pipeline run's steps produced.
struct PipeRun {
    /// The final weights.
    gpt: Arc<Gpt>,
    last_loss: f64,
    step_ms: Vec<f64>,
    comm_bytes: Vec<usize>,
    bubble: f64,
    theory: f64,
    peak_live: usize,
    heap_after: Option<kolo_base::alloc::HeapStats>,
}

type Batches = std::sync::mpsc::Receiver<(crate::sampler::Position, Batch)>;

/// PipeDream-2BW's stage work: batch t runs on weight version max(t - 1, 0); its update makes
/// version t + 1 from version t and batch t's gradient (W(t+1) = W(t) - step(grad f(W(t-1)))).
/// A version is a separate copy of the weights, dropped when no micro-batch uses it any more:
/// two stay alive (double buffering).
struct TwoBw<'s, 'a> {
    setup: &'s mut StageSetup<'a>,
    versions: std::collections::BTreeMap<usize, Arc<Gpt>>,
    latest: usize,
    /// Batches in flight on this stage: their micro-batches and accumulated gradients.
    stages: std::collections::HashMap<usize, GptStage>,
    batches: &'s Batches,
    /// The last stage: the sum of each batch's micro-batch losses.
    losses: std::collections::HashMap<usize, f64>,
    last_loss: f64,
    steps: u64,
    /// Metrics, TensorBoard, JSON lines and the log, one record per update; its windows' loss
    /// average and straggler exchange run on the agreement group (`setup.sync`).
    report: &'s mut crate::report::Reporter,
    last_update: Instant,
    /// The learning rate before the schedule (`optim.reference_batch` applied).
    base_lr: f32,
    epoch: u64,
}

impl StageWork for TwoBw<'_, '_> {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let m = self.setup.m;
        let t = mb / m;
        if !self.stages.contains_key(&t) {
            let v = weight_version(mb, m);
            let gpt = self
                .versions
                .get(&v)
                .ok_or_else(|| format!("batch {t} needs weight version {v}, which this stage has not made yet"))?
                .clone();
            let (pos, batch) = self.batches.recv().map_err(|_| "the prefetch thread stopped".to_string())?;
            self.epoch = pos.epoch;
            let micro = split_batch(&batch, m).map_err(|e| e.to_string())?;
            self.stages.insert(t, GptStage::new(gpt, self.setup.layers.clone(), micro).rematerialize(self.setup.remat));
        }
        let out = self.stages.get_mut(&t).expect("inserted").forward(mb % m, input).map_err(|e| e.to_string())?;
        if self.setup.layers.end == self.versions[&self.latest].layers() {
            *self.losses.entry(t).or_default() += f64::from(out[0]);
        }
        Ok(out)
    }

    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let m = self.setup.m;
        let stage = self.stages.get_mut(&(mb / m)).ok_or_else(|| format!("backward of micro-batch {mb} before its forward"))?;
        stage.backward(mb % m, grad).map_err(|e| e.to_string())
    }

    fn update(&mut self, t: usize) -> Result<(), String> {
        let mut stage = self.stages.remove(&t).ok_or_else(|| format!("update of batch {t}, which did not run here"))?;
        let mut grads = std::mem::take(&mut stage.grads);
        drop(stage);
        let e = |e: TrainError| e.to_string();
        self.setup.average(&mut grads).map_err(e)?;
        let current = self.versions[&self.latest].clone();
        let (f, loss) = self.setup.clip_and_loss(&current, &grads, self.losses.remove(&t).unwrap_or(0.0)).map_err(e)?;
        self.last_loss = loss;
        let cfg = self.setup.cfg;
        let lr = lr_at(self.base_lr, &cfg.schedule(), cfg.optim.warmup_steps, cfg.train.steps, t as u64);
        let next = Arc::new(current.fork().map_err(|e| e.to_string())?);
        self.setup.step(&next, &grads, f, lr).map_err(e)?;
        self.latest = t + 1;
        self.versions.insert(t + 1, next);
        // Batch t + 1 (in flight) runs on version t; older ones are done with.
        self.versions.retain(|&v, _| v + 1 > t);
        let done = t as u64 + 1;
        let now = Instant::now();
        let step_ms = now.duration_since(self.last_update).as_secs_f64() * 1e3;
        self.last_update = now;
        self.report.record(t as u64, crate::report::StepRecord { step_ms, ..Default::default() });
        if self.report.is_log_step(done, self.steps) {
            let sync = self.setup.sync.as_deref().ok_or("2BW runs with its agreement group")?;
            let extra = format!(" (weights version {}, gradient from version {})", t + 1, t.saturating_sub(1));
            self.report.window(sync, done, loss, lr, self.epoch, &extra).map_err(e)?;
        }
        Ok(())
    }
}

/// PipeDream-2BW: the whole run is one 1F1B stream without flushes; each stage updates its
/// weights after its last backward of a batch.
fn run_two_bw(
    setup: &mut StageSetup<'_>,
    gpt: Arc<Gpt>,
    batches: &Batches,
    end: u64,
    report: &mut crate::report::Reporter,
) -> Result<PipeRun, TrainError> {
    let cfg = setup.cfg;
    let global_batch = cfg.data.batch_size * setup.dp.world_size().get();
    let base_lr = cfg.optim.reference_batch.map_or(cfg.optim.lr, |r| kolo_optim::scaled_lr(cfg.optim.lr, global_batch, r));
    let (k, m) = (setup.comm.world_size().get(), setup.m);
    let act_len = {
        // Hidden states per micro-batch: sequences per micro-batch x tokens x width.
        let c = gpt.config();
        cfg_micro(setup.cfg, m) * c.seq * c.d_model
    };
    let mut work = TwoBw {
        setup,
        versions: [(0, gpt)].into_iter().collect(),
        latest: 0,
        stages: Default::default(),
        batches,
        losses: Default::default(),
        last_loss: f64::NAN,
        steps: end,
        report,
        last_update: Instant::now(),
        base_lr,
        epoch: 0,
    };
    let report = if end == 0 {
        Default::default()
    } else {
        run_stage(work.setup.comm, Schedule::TwoBw { batches: end as usize }, m, act_len, &mut work)
            .map_err(|e| TrainError::Other(e.to_string()))?
    };
    let heap_after = kolo_base::alloc::stats();
    let gpt = work.versions.remove(&work.latest).expect("the latest version is kept");
    let last_loss = work.last_loss;
    let bubble = work.setup.bubble(report.busy_ms, report.total_ms)?;
    // Step time: between consecutive updates on this stage (the first from the start).
    let mut step_ms = Vec::with_capacity(report.updates.len());
    let mut prev = 0.0;
    for &u in &report.updates {
        step_ms.push(u - prev);
        prev = u;
    }
    let per_step = report.bytes_sent / (end as usize).max(1);
    Ok(PipeRun {
        gpt,
        last_loss,
        step_ms,
        comm_bytes: vec![per_step; end as usize],
        bubble,
        theory: theoretical_bubble(k, m * end as usize),
        peak_live: report.max_live,
        heap_after,
    })
}

/// Sequences per micro-batch.
fn cfg_micro(cfg: &Config, m: usize) -> usize {
    cfg.data.batch_size / m
}
