//! The stages of `kolo train`'s PipeDream-2BW pipeline of the GPT (`[pipeline] schedule =
//! "2bw"`, `crate::pipedream_2bw`): rank s of the pipeline group is stage s. The planner cuts
//! the layers (embedding, blocks, head) into stages of balanced cost; each batch is split into
//! micro-batches that flow through the stages; each stage accumulates its own parameters'
//! gradients over the micro-batches, averages them over its data-parallel replicas and steps
//! its own optimizer. Under tensor parallelism a stage's blocks are split over its
//! tensor-parallel group. Each stage writes its own layers into checkpoints, whole tensors
//! under the model's names, so a checkpoint continues under any strategy. At the end the whole
//! model is assembled on every rank.
//!
//! GPipe and 1F1B are the library's (`kolo::builtin`'s pipeline, over `kolo::pp`); this stage
//! setup is what is left to move there with PipeDream-2BW.

use crate::checkpointing::{load_checkpoint, save_checkpoint, PendingSave, Resumed};
use crate::config::{Config, StepTables};
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, SaveAt, Start};
use crate::setup::Data;
use crate::summary::{Eval, RunOptions, StateBytes};
use crate::TrainError;
use kolo_base::{GroupSum, Rng};
use kolo_checkpoint::Piece;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::{Segment, ShardPlan};
use kolo_optim::{clip_factor, Optimizer};
use kolo_pipe::{partition, theoretical_bubble, Schedule};
use kolo_tensor::models::{Gpt, GptConfig};
use kolo_tensor::{Batch, Input, Model, ModelSpec};
use std::path::Path;
use std::sync::Arc;

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
pub(crate) struct StageSetup<'a> {
    /// The tables the stage reads while it trains.
    pub t: StepTables<'a>,
    pub comm: &'a dyn Communicator,
    /// PipeDream-2BW: a second communicator over the pipeline's ranks for the agreement at
    /// each update, so that it never falls between the activations still streaming on `comm`.
    pub sync: Option<Arc<dyn Communicator>>,
    pub dp: &'a dyn Communicator,
    pub tp: Option<Arc<dyn GroupSum>>,
    pub layers: std::ops::Range<usize>,
    pub own: Vec<usize>,
    pub ranges: Vec<std::ops::Range<usize>>,
    pub opt: Optimizer,
    pub m: usize,
    /// Keep only each micro-batch's stage input; recompute in backward.
    pub remat: bool,
}

impl StageSetup<'_> {
    /// Averages this stage's gradients over its data-parallel replicas.
    pub(crate) fn average(&self, grads: &mut [f32]) -> Result<(), TrainError> {
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
    pub(crate) fn clip_and_loss(&self, gpt: &Gpt, grads: &[f32], loss_sum: f64) -> Result<(f32, f64), TrainError> {
        let mut v = [0f64, loss_sum];
        if self.t.optim.clip_grad_norm.is_some() {
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
        Ok((self.t.optim.clip_grad_norm.map_or(1.0, |max| clip_factor(v[0].sqrt(), max)), l[0]))
    }

    /// One optimizer step of this stage's parameters of `gpt` with `grads` scaled by `f`.
    pub(crate) fn step(&mut self, gpt: &Gpt, grads: &[f32], f: f32, lr: f32) -> Result<(), TrainError> {
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
    pub(crate) fn bubble(&self, busy_ms: f64, total_ms: f64) -> Result<f64, TrainError> {
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
    pub(crate) fn assemble(&self, gpt: &Gpt) -> Result<Vec<f32>, TrainError> {
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

/// Builds this stage of a PipeDream-2BW pipeline over `comm` (rank = stage) with data-parallel
/// group `dp` and tensor-parallel group `tp`: the GPT, the plan's layers for this stage, their
/// parameters and their optimizer. `batches`: the run's batches (one stream could cover them
/// all: the theoretical bubble).
fn build_stage<'a>(
    cfg: &'a Config,
    comm: &'a dyn Communicator,
    dp: &'a dyn Communicator,
    tp: Option<Arc<dyn GroupSum>>,
    gcfg: &GptConfig,
    batches: u64,
    lead: bool,
) -> Result<(Gpt, StageSetup<'a>), TrainError> {
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
    let schedule = Schedule::TwoBw { batches: batches as usize };
    if m + 1 < k {
        return Err(TrainError::Config(format!("PipeDream-2BW needs at least stages - 1 = {} micro-batches per batch (pipeline.micro_batches = {m}): a batch's weight version must exist before its first forward", k - 1)));
    }
    let own: Vec<usize> = layers.clone().flat_map(|l| gpt.layer_params(l)).collect();
    let ranges: Vec<std::ops::Range<usize>> = own.iter().map(|&i| gpt.params().get(i).range.clone()).collect();
    let own_len: usize = ranges.iter().map(|r| r.len()).sum();
    let opt = crate::setup::optimizer_for(&cfg.optim, own_len)?;
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
            theoretical_bubble(k, m * batches as usize) * 100.0
        );
    }
    let all: Vec<kolo_base::Rank> = (0..k).map(kolo_base::Rank).collect();
    let sync = comm.new_group(&all)?.expect("every stage is a member");
    sync.set_timeout(comm.timeout());
    let setup = StageSetup { t: cfg.step_tables(), comm, sync: Some(sync), dp, tp, layers, own, ranges, opt, m, remat: pc.rematerialize };
    Ok((gpt, setup))
}

/// The line at the end of a pipeline run: measured and theoretical bubble, activations kept.
pub fn bubble_line(bubble: f64, theory: f64, two_bw: bool, peak_live: usize) -> String {
    format!(
        "pipeline: mean bubble {:.1}% measured, {:.1}% in theory ((K-1)/(M+K-1){}); at most {peak_live} micro-batch(es) of activations alive on stage 0",
        bubble * 100.0,
        theory * 100.0,
        if two_bw { ", M = every micro-batch between evaluations and checkpoints: no flush between batches" } else { "" },
    )
}

impl StageSetup<'_> {
    /// Model states of this stage: the model's values (a stage builds every layer and trains
    /// its own; `versions` copies under PipeDream-2BW), its own layers' optimizer state, and the
    /// gradient of the whole model it accumulates into.
    pub(crate) fn states(&self, gpt: &Gpt, versions: u64) -> StateBytes {
        StateBytes {
            params: gpt.params().numel() as u64 * 4 * versions,
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
        let whole = Gpt::new(gcfg.clone(), &mut Rng::new(self.t.train.seed))?;
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

/// Checkpoint name prefix of PipeDream-2BW's previous weight version (whole tensors under the
/// model's parameter names): the version the first batch after a resume runs on.
pub(crate) const PREVIOUS_WEIGHTS: &str = "state.previous_weights.";

/// A pipeline stage ready to train: its model, setup, schedule, checkpoint metadata and where
/// it starts; `previous`: the checkpoint's previous weight version of this stage's layers
/// (PipeDream-2BW writes it; `None` when resuming from a checkpoint without one), in the
/// model's flat layout.
pub(crate) struct BuiltStage<'a> {
    pub gpt: Gpt,
    pub setup: StageSetup<'a>,
    pub gcfg: GptConfig,
    pub meta: std::collections::BTreeMap<String, String>,
    pub start: Start,
    pub previous: Option<Vec<f32>>,
    /// This rank in the whole job, and whether it keeps quiet.
    pub global_rank: usize,
    pub quiet: bool,
}

/// The groups of a pipeline rank.
pub struct StageGroups<'a> {
    /// The pipeline group (rank = stage).
    pub pp: &'a dyn Communicator,
    /// This stage's data-parallel replicas.
    pub dp: &'a dyn Communicator,
    /// Its tensor-parallel group, if any.
    pub tp: Option<Arc<dyn GroupSum>>,
    /// This rank in the whole job.
    pub global_rank: usize,
}

/// Builds this rank's stage and loads `resume` (every stage reads the whole model and takes
/// its own layers' optimizer state).
pub(crate) fn build_resumed<'a>(
    cfg: &'a Config,
    groups: StageGroups<'a>,
    data: &Data,
    resume: Option<&Path>,
    opts: &RunOptions,
) -> Result<BuiltStage<'a>, TrainError> {
    let StageGroups { pp: comm, dp, tp, global_rank } = groups;
    let gcfg = crate::setup::gpt_config(cfg, &[comm, dp], data)?;
    let lead = global_rank == 0 && !opts.quiet;
    let (gpt, mut setup) = build_stage(cfg, comm, dp, tp, &gcfg, cfg.train.steps, lead)?;
    let meta = checkpoint_meta(cfg, &ModelSpec::Gpt(gcfg.clone()), dp.world_size().get(), 0);
    let (start, previous) = match resume {
        Some(path) => {
            let (r, previous) = setup.load(path, &gcfg, &gpt, &meta)?;
            (Some((path.to_path_buf(), r)), previous)
        }
        None => (None, None),
    };
    Ok(BuiltStage { gpt, setup, gcfg, meta, start, previous, global_rank, quiet: opts.quiet })
}

/// A 2BW checkpoint's previous weight version: `flat` (the loaded model, in the layout
/// `params` and `ranges` describe) with this stage's parameters (`own`, at `ranges`) replaced
/// by the checkpoint's; `None` when it holds none (a flushed strategy wrote it).
fn previous_version(
    r: &Resumed,
    params: &kolo_tensor::ParamSet,
    own: &[usize],
    ranges: &[std::ops::Range<usize>],
    flat: &[f32],
) -> Result<Option<Vec<f32>>, TrainError> {
    let mut prev = flat.to_vec();
    for (&i, range) in own.iter().zip(ranges) {
        let name = &params.get(i).name;
        let Some(v) = r.strategy_state.get(&format!("{PREVIOUS_WEIGHTS}{name}")) else { return Ok(None) };
        if v.len() != range.len() {
            return Err(TrainError::Data(format!(
                "checkpoint: the previous weight version of `{name}` has {} values, the model {}",
                v.len(),
                range.len()
            )));
        }
        prev[range.clone()].copy_from_slice(v);
    }
    Ok(Some(prev))
}

impl StageSetup<'_> {
    /// Loads a checkpoint into this stage: the model (`gpt`, every layer) and its own layers'
    /// optimizer state; returns it with the previous weight version, if it has one.
    fn load(
        &mut self,
        path: &Path,
        gcfg: &GptConfig,
        gpt: &Gpt,
        meta: &std::collections::BTreeMap<String, String>,
    ) -> Result<(Resumed, Option<Vec<f32>>), TrainError> {
        if self.tp.is_some() {
            return load_tensor_parallel_stage(path, self, gcfg, gpt, meta);
        }
        let mut flat = vec![0f32; gpt.params().numel()];
        let all: Vec<_> = gpt.params().iter().map(|p| p.range.clone()).collect();
        let plan = self.shard_plan();
        let r = load_checkpoint(path, gpt.params(), &mut flat, &mut self.opt, Some(&plan), &all, meta)?;
        gpt.params().load(&flat)?;
        let previous = previous_version(&r, gpt.params(), &self.own, &self.ranges, &flat)?;
        Ok((r, previous))
    }

    /// This stage's parameters of `params` (their values `packed` in stage order, at `ranges`)
    /// as checkpoint pieces of the previous weight version.
    fn previous_pieces(&self, params: &kolo_tensor::ParamSet, ranges: &[std::ops::Range<usize>], packed: &[f32]) -> Vec<Piece> {
        let mut at = 0;
        self.own
            .iter()
            .zip(ranges)
            .map(|(&i, r)| {
                let p = params.get(i);
                let data = packed[at..at + r.len()].to_vec();
                at += r.len();
                Piece { name: format!("{PREVIOUS_WEIGHTS}{}", p.name), shape: p.shape.clone(), offset: 0, data }
            })
            .collect()
    }

    /// Writes this stage's layers of `gpt` (and of `previous`, PipeDream-2BW's older weight
    /// version) with their optimizer state: the first replica's stages each write their own
    /// layers as a shard of whole tensors; the other replicas hold the same values.
    pub(crate) fn save_stage(
        &self,
        mut at: SaveAt<'_>,
        gcfg: &GptConfig,
        gpt: &Gpt,
        meta: &std::collections::BTreeMap<String, String>,
        previous: Option<&Gpt>,
    ) -> Result<PendingSave, TrainError> {
        if self.dp.rank().get() != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let mut meta = meta.clone();
        meta.extend(std::mem::take(&mut at.meta));
        if let Some(tp) = self.tp.clone() {
            return self.save_tensor_parallel(at, &*tp, gcfg, gpt, &meta, previous);
        }
        let plan = self.shard_plan();
        let master = pack(&gpt.params().to_flat()?, &self.ranges);
        let own = match previous {
            Some(p) => self.previous_pieces(gpt.params(), &self.ranges, &pack(&p.params().to_flat()?, &self.ranges)),
            None => Vec::new(),
        };
        let (params, opt, comm) = (gpt.params(), &self.opt, self.comm);
        save_checkpoint(at.dir, at.step, params, &master, opt, Some(&plan), comm, at.pos, &meta, own, at.background, at.crash)
    }

    /// Under tensor parallelism each tensor-parallel group puts its stage's layers (values and
    /// optimizer state) together into whole tensors, and its first member writes them as the
    /// stage's shard of the whole model.
    fn save_tensor_parallel(
        &self,
        at: SaveAt<'_>,
        tp: &dyn GroupSum,
        gcfg: &GptConfig,
        gpt: &Gpt,
        meta: &std::collections::BTreeMap<String, String>,
        previous: Option<&Gpt>,
    ) -> Result<PendingSave, TrainError> {
        let (whole, ranges) = self.whole_model(gcfg, gpt)?;
        let local_len = gpt.params().numel();
        // Packed stage values in the split layout -> packed values in the whole one.
        let put_together = |packed: &[f32]| -> Result<Vec<f32>, TrainError> {
            let mine = unpack(packed, &self.ranges, local_len);
            let mut full = gpt.tensor_parallel_pieces(&mine).ok_or_else(|| TrainError::Other("not a split model".into()))??;
            tp.sum(&mut full).map_err(TrainError::Other)?;
            Ok(pack(&full, &ranges))
        };
        let master = put_together(&pack(&gpt.params().to_flat()?, &self.ranges))?;
        let states = self.opt.state().into_iter().map(|(name, v)| Ok((name, put_together(v)?))).collect::<Result<Vec<_>, TrainError>>()?;
        let own = match previous {
            Some(p) => self.previous_pieces(whole.params(), &ranges, &put_together(&pack(&p.params().to_flat()?, &self.ranges))?),
            None => Vec::new(),
        };
        if tp.rank() != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let mut opt = Optimizer::new(self.t.optim.spec(), master.len());
        opt.load_state(self.opt.steps(), &states).map_err(TrainError::Other)?;
        let plan = self.plan_of(&ranges);
        save_checkpoint(at.dir, at.step, whole.params(), &master, &opt, Some(&plan), self.comm, at.pos, meta, own, at.background, at.crash)
    }

    /// Loss (and accuracy) of the whole model `gpt` over `ds`, on global rank 0.
    pub(crate) fn evaluate(
        &self,
        gcfg: &GptConfig,
        gpt: &Gpt,
        first: bool,
        ds: &dyn Dataset,
        max: usize,
    ) -> Result<Option<Eval>, TrainError> {
        let flat = self.assemble(gpt)?;
        first.then(|| crate::eval::evaluate_alone(self.t.batch_size, gcfg, &flat, ds, max)).transpose()
    }

    /// Text from the whole model `gpt`, on global rank 0.
    pub(crate) fn sample(&self, gcfg: &GptConfig, gpt: &Gpt, first: bool, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        let flat = self.assemble(gpt)?;
        first.then(|| crate::eval::sample_alone(self.t.train, gcfg, &flat, vocab)).transpose()
    }
}

/// Loads this stage's layers and their optimizer state from a checkpoint of whole tensors into
/// a tensor-parallel stage (the inverse of `StageSetup::save_tensor_parallel`), with the
/// previous weight version if it has one.
fn load_tensor_parallel_stage(
    path: &Path,
    setup: &mut StageSetup<'_>,
    gcfg: &GptConfig,
    gpt: &Gpt,
    meta: &std::collections::BTreeMap<String, String>,
) -> Result<(Resumed, Option<Vec<f32>>), TrainError> {
    let (whole, ranges) = setup.whole_model(gcfg, gpt)?;
    let mut full = vec![0f32; whole.params().numel()];
    let plan = setup.plan_of(&ranges);
    let mut whole_opt = Optimizer::new(setup.t.optim.spec(), plan.len);
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
    let previous = previous_version(&r, whole.params(), &setup.own, &ranges, &full)?.map(|p| local(&p)).transpose()?;
    Ok((r, previous))
}
