//! `kolo train`'s GPipe and 1F1B pipelines of the built-in GPT, as a user's pipeline runs:
//! the ranks are a [`Mesh`] of `pp` stages of `dp` replicas of `tp` pieces; each stage builds
//! the GPT (its blocks split over `tp` under tensor parallelism), hands its own layers'
//! variables to a [`Trainer`] and steps it through [`crate::pp::Pipeline::step`], the
//! stage's closure running its layers on each micro-batch. The trainer averages each stage's
//! gradients over its replicas, clips by the norm over every stage and piece, steps the
//! stage's optimizer and writes each stage's layers as whole tensors under the model's names
//! (a checkpoint continues under any strategy). PipeDream-2BW runs the same stages through
//! [`Pipeline::step_stream`], carrying the weight version before the latest across the
//! driver's drain points (evaluations, checkpoints: a drain changes when work happens, never
//! what is computed) and into checkpoints (`state.previous_weights.*`), so a resumed run
//! continues bitwise.

use super::{announce_pipeline, driven_trainer, evaluate_whole, model_vars, sample_whole, train_error, whole_signature, zero3_prefixes};
use crate::pp::{Pipeline, Schedule};
use crate::{Dist, Mesh, TrainOptions, Trainer};
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_tensor::models::{Gpt, GptConfig, StageInput};
use kolo_tensor::{Batch, CandleDType, Input, Model, ModelSpec};
use kolo_train::checkpointing::PendingSave;
use kolo_train::config::PipeSchedule;
use kolo_train::data::{CharVocab, Dataset};
use kolo_train::driver::{Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use kolo_train::setup::Setup;
use kolo_train::summary::{Eval, RunOptions};
use kolo_train::TrainError;
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

/// One stage of a pipeline of the built-in GPT (GPipe, 1F1B or PipeDream-2BW) and the
/// trainer of its layers.
pub(super) struct Pipelined {
    trainer: Trainer,
    gpt: Gpt,
    gcfg: GptConfig,
    pipe: Pipeline,
    /// This stage's layers (0: the embedding, 1..=n_layer the blocks, then the head), and
    /// their parameters (indices in the model's order).
    layers: Range<usize>,
    own: Vec<usize>,
    /// Micro-batches per step (`train.grad_accum` batches of `per_batch` each), and per batch.
    m: usize,
    per_batch: usize,
    /// PipeDream-2BW: each step's micro-batches read so far (the stream reads the next
    /// step's while this one's update is pending), streams ended and steps run in them.
    two_bw: Option<TwoBwState>,
    mesh: Mesh,
    /// The whole model's names and shapes, as one process lays them out.
    whole: Vec<(String, Vec<usize>)>,
    /// Each step's bubble over the stages, and the stage's totals before the step.
    bubbles: Vec<f64>,
    before: crate::pp::Totals,
    train: kolo_train::config::TrainConfig,
    batch_size: usize,
    /// The dtype the stage computes in: its f32 parameters are cast where used (bf16, f16).
    compute: CandleDType,
    global_rank: usize,
    quiet: bool,
}

impl Pipelined {
    pub(super) fn new(
        cfg: &Setup,
        comm: Arc<dyn Communicator>,
        resume: Option<&Path>,
        run: &RunOptions,
    ) -> crate::Result<(Pipelined, Start)> {
        let pc = cfg.pipeline.as_ref().expect("called for [pipeline] configs");
        let global_rank = comm.rank().get();
        let size = cfg.mesh;
        let ModelSpec::Gpt(gcfg) = cfg.spec.clone() else {
            return Err(TrainError::Config("[pipeline] cuts the GPT's layers into stages; model.kind must be \"gpt\"".into()).into());
        };
        let dist = Dist::of_comm(comm);
        let mesh = Mesh::new(&dist, &[("pp", size.pp), ("dp", size.dp), ("tp", size.tp)])?;
        let rng = || kolo_base::Rng::new(cfg.train.seed);
        let tp = (size.tp > 1).then(|| kolo_comm::SumGroup::new(mesh.tp().comm().clone()));
        let mut gpt = match &tp {
            Some(g) => Gpt::new_tensor_parallel(gcfg.clone(), &mut rng(), g.clone())?,
            None => Gpt::new(gcfg.clone(), &mut rng())?,
        };
        let k = size.pp;
        if k > gpt.layers() {
            return Err(TrainError::Config(format!(
                "{k} pipeline stages for a GPT with {} layers (embedding, {} blocks, head)",
                gpt.layers(),
                gcfg.n_layer
            ))
            .into());
        }
        let layers = crate::pp::stage_layers_by(&gpt.layer_costs(), &mesh)?;
        let schedule = match pc.schedule {
            PipeSchedule::GPipe => Schedule::GPipe,
            PipeSchedule::OneFOneB => Schedule::OneFOneB,
            // One stream could cover the run; the driver's drain points end it sooner.
            PipeSchedule::TwoBw => Schedule::TwoBw { batches: cfg.train.steps.max(1) as usize },
        };
        let m = pc.micro_batches;
        let two_bw = matches!(schedule, Schedule::TwoBw { .. });
        if two_bw && m + 1 < k {
            return Err(TrainError::Config(format!("PipeDream-2BW needs at least stages - 1 = {} micro-batches per batch (pipeline.micro_batches = {m}): a batch's weight version must exist before its first forward", k - 1)).into());
        }
        // The stage's own layers' variables, in the model's order; under ZeRO-3 its blocks.
        let own: Vec<usize> = layers.clone().flat_map(|l| gpt.layer_params(l)).collect();
        let holder = format!("pipeline stage {} (layers {layers:?}) holds", mesh.coord("pp"));
        let groups = zero3_prefixes(cfg, &gpt, &own, &holder)?;
        // `model.checkpoint_blocks` of this stage recompute their activations in backward
        // (under ZeRO-3 reading their gathered values again, as the data-parallel model does).
        gpt.set_checkpointing(&cfg.checkpoint_blocks)?;
        let mut opts = TrainOptions::from_setup(cfg)?;
        // A step is `m` micro-batches of batch_size / m sequences on every stage, for each of
        // `train.grad_accum` batches (the micro-batches of one flush).
        let accum = cfg.train.grad_accum.max(1) as usize;
        opts.train.grad_accum = (m * accum) as u64;
        opts.data.batch_size = cfg.data.batch_size / m;
        let spec = ModelSpec::Gpt(gcfg.clone());
        let vars = (model_vars(&gpt, &own)?, Err(&mesh));
        let mut trainer = driven_trainer(cfg, vars, opts, &groups, size.dp, run.inject_inf_at)?;
        // f16: the last stage's losses are scaled, the scale carried back by the gradients
        // between stages; a step that overflows on any stage is skipped on every one.
        if cfg.compute == CandleDType::F16 {
            trainer.scale_losses();
        }
        let shape = [cfg.data.batch_size / m, gcfg.seq, gcfg.d_model];
        let mut pipe = Pipeline::new(schedule, &shape)?.rematerialize(pc.rematerialize);
        let start = match resume {
            Some(path) => Some(trainer.resume_state(path)?),
            None => None,
        };
        if two_bw {
            pipe = pipe.carrying_versions(&trainer);
        }
        if global_rank == 0 && !run.quiet {
            let plan = kolo_pipe::partition(&gpt.layer_costs(), k);
            announce_pipeline(&gpt, &gcfg, &plan, (size.dp, size.tp), (m * accum, cfg.data.batch_size / m), schedule);
        }
        let whole = whole_signature(&gpt, &spec, tp.is_some(), cfg.train.seed)?;
        // The other stages' layers were only built to draw the same initial values.
        gpt.keep_layers(layers.clone())?;
        let s = Pipelined {
            trainer,
            gpt,
            gcfg,
            pipe,
            layers,
            own,
            m: m * accum,
            per_batch: m,
            two_bw: two_bw.then(TwoBwState::default),
            mesh,
            whole,
            bubbles: Vec::new(),
            before: Default::default(),
            train: cfg.train.clone(),
            batch_size: cfg.data.batch_size,
            compute: cfg.compute,
            global_rank,
            quiet: run.quiet,
        };
        Ok((s, start))
    }

    /// Collective over the pipeline group: the share of the stages' time spent idle, from each
    /// stage's `busy` and `total` milliseconds (the longest stage's time is the step's).
    fn bubble(&self, busy_ms: f64, total_ms: f64) -> Result<f64, TrainError> {
        let pp = self.mesh.pp();
        let (stage, k) = (pp.rank().get(), pp.world_size().get());
        let mut t = vec![0f64; 2 * k];
        t[2 * stage] = busy_ms;
        t[2 * stage + 1] = total_ms;
        pp.all_reduce(BufMut::from(&mut t[..]), ReduceOp::Sum)?;
        let span = (0..k).map(|s| t[2 * s + 1]).fold(0.0, f64::max);
        let busy: f64 = (0..k).map(|s| t[2 * s]).sum();
        Ok(if span > 0.0 { 1.0 - busy / (k as f64 * span) } else { 0.0 })
    }
}

impl Strategy for Pipelined {
    /// The stage's replicas: the step's loss is averaged over them (every stage holds its
    /// pipeline's).
    fn comm(&self) -> &dyn Communicator {
        &**self.mesh.replicas()
    }

    fn replica(&self) -> (usize, usize) {
        (self.mesh.coord("dp"), self.mesh.size("dp"))
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        if self.two_bw.is_some() {
            return self.step_stream(ctx, data);
        }
        // `train.grad_accum` batches, each cut into `per_batch` micro-batches: one flush.
        let mut micro = Vec::with_capacity(self.m);
        for _ in 0..self.m / self.per_batch {
            micro.extend(kolo_train::pipeline::split_batch(&data.next_batch()?, self.per_batch)?);
        }
        let (gpt, layers, compute) = (&self.gpt, self.layers.clone(), self.compute);
        let stage = |mb: usize, input: Option<&candle_core::Tensor>| run_layers((gpt, compute), layers.clone(), &micro[mb], input);
        let out = self.pipe.step(&mut self.trainer, stage);
        // A failed ZeRO-3 gather is the cause of whatever the step met.
        self.trainer.zero3_failure().map_err(train_error)?;
        out.map_err(train_error)?;
        let k = self.mesh.size("pp");
        let mut out = self.take_step(String::new())?;
        let now = self.pipe.totals();
        let bubble = self.bubble(now.busy_ms - self.before.busy_ms, now.total_ms - self.before.total_ms)?;
        self.bubbles.push(bubble);
        out.rec.comm_bytes = Some(out.rec.comm_bytes.unwrap_or(0) + (now.bytes_sent - self.before.bytes_sent) as usize);
        self.before = now;
        out.note = format!(", bubble {:.1}% (theory {:.1}%)", bubble * 100.0, kolo_pipe::theoretical_bubble(k, self.m) * 100.0);
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        self.drained("evaluating")?;
        let lead = self.global_rank == 0;
        evaluate_whole(&self.trainer, &self.whole, lead, (&self.gcfg, self.batch_size, self.compute), ds, max_batches)
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        self.drained("sampling")?;
        sample_whole(&self.trainer, &self.whole, self.global_rank == 0, (&self.gcfg, &self.train, self.compute), vocab)
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        self.drained("checkpointing")?;
        // (PipeDream-2BW: the trainer writes the version the next batch runs on beside the
        // latest.)
        self.trainer.save_at(at).map_err(train_error)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        self.drained("finishing")?;
        self.trainer.settle("kolo train's end").map_err(train_error)?;
        let (k, m) = (self.mesh.size("pp"), self.m);
        let (bubble, theory) = match &self.two_bw {
            None => {
                let bubble = if self.bubbles.is_empty() { 0.0 } else { self.bubbles.iter().sum::<f64>() / self.bubbles.len() as f64 };
                (bubble, kolo_pipe::theoretical_bubble(k, m))
            }
            Some(t) => {
                let now = self.pipe.totals();
                // Each stream fills and drains the pipeline once: (K-1) idle slots per stream.
                let idle = (t.streams as usize * (k - 1)) as f64;
                let theory = match t.streams {
                    0 | 1 => kolo_pipe::theoretical_bubble(k, m * t.batches as usize),
                    _ => idle / (m as f64 * t.batches as f64 + idle),
                };
                (self.bubble(now.busy_ms, now.total_ms)?, theory)
            }
        };
        if self.global_rank == 0 && !self.quiet {
            let line = kolo_train::pipeline::bubble_line(bubble, theory, self.two_bw.is_some(), self.pipe.totals().max_live);
            kolo_base::eline!("{line}");
        }
        let mut states = self.trainer.state_bytes();
        let (params, own) = (self.gpt.params(), &self.own);
        // Values of other stages' layers the model still holds (none: `Gpt::keep_layers`), and
        // PipeDream-2BW's second version of the stage's own.
        let others = (0..params.len()).filter(|i| !own.contains(i) && params.is_resident(*i)).map(|i| params.get(i).range.len());
        states.params += others.sum::<usize>() as u64 * 4;
        if self.two_bw.is_some() {
            states.params += own.iter().map(|&i| params.get(i).range.len()).sum::<usize>() as u64 * 4;
        }
        let e = self.trainer.engine();
        Ok(Finish {
            params: self.trainer.whole_params(&self.whole).map_err(train_error)?,
            states,
            skipped_steps: e.skipped_steps(),
            loss_scale: e.scaler.as_ref().map(kolo_optim::LossScaler::scale),
            moe: None,
            pipeline_bubble: Some(bubble),
            ps: None,
        })
    }
}

/// PipeDream-2BW's stream on this stage, between the driver's steps.
#[derive(Default)]
struct TwoBwState {
    /// Each step's micro-batches, read when the stream first reaches the step.
    micro: BTreeMap<u64, Vec<Batch>>,
    /// Streams ended, and the steps they ran.
    streams: u64,
    batches: u64,
    /// The step the open stream began at.
    began: Option<u64>,
}

impl Pipelined {
    /// PipeDream-2BW's step: the stream runs to this step's update (the next step's first
    /// micro-batches may be in flight after it); it ends at the driver's next drain point.
    fn step_stream(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        self.trainer.driven_mut().drain_at = Some(ctx.drain_at);
        let t = self.two_bw.as_mut().expect("called under PipeDream-2BW");
        // Steps before this one have had their updates: their micro-batches are done with.
        t.micro.retain(|&step, _| step >= ctx.step);
        let began = *t.began.get_or_insert(ctx.step);
        let (gpt, layers, m, compute) = (&self.gpt, self.layers.clone(), self.per_batch, self.compute);
        let micro = &mut t.micro;
        let msg = |e: TrainError| candle_core::Error::Msg(e.to_string());
        let stage = |step: u64, mb: usize, input: Option<&candle_core::Tensor>| {
            if let std::collections::btree_map::Entry::Vacant(e) = micro.entry(step) {
                // The stream reaches each step once, in order: its batch is the driver's next.
                let batch = data.next_batch().map_err(msg)?;
                e.insert(kolo_train::pipeline::split_batch(&batch, m).map_err(msg)?);
            }
            run_layers((gpt, compute), layers.clone(), &micro[&step][mb], input)
        };
        self.pipe.step_stream(&mut self.trainer, stage).map_err(train_error)?;
        self.trainer.driven_mut().drain_at = None;
        if !self.pipe.in_flight() {
            let t = self.two_bw.as_mut().expect("called under PipeDream-2BW");
            t.streams += 1;
            t.batches += ctx.step + 1 - began;
            t.began = None;
        }
        self.take_step(format!(" (weights version {}, gradient from version {})", ctx.step + 1, ctx.step.saturating_sub(1)))
    }

    /// The trainer's last step: when its backward ended, its loss, record and collectives.
    fn take_step(&mut self, note: String) -> Result<StepOut, TrainError> {
        let backward_end = self.trainer.backward_end();
        let (loss, rec, comm_spans) =
            self.trainer.driven_mut().last.take().ok_or_else(|| TrainError::Other("the trainer's step did not end".into()))?;
        Ok(StepOut { loss, rec, backward_end, comm_spans, note })
    }

    /// Evaluation, checkpoints and the end come between PipeDream-2BW's streams (at the
    /// driver's drain points); anything else is a bug of the caller.
    fn drained(&self, what: &str) -> Result<(), TrainError> {
        match (self.pipe.in_flight(), self.two_bw.as_ref().and_then(|t| t.began)) {
            (true, Some(began)) => Err(TrainError::Other(format!(
                "PipeDream-2BW: {what} while the stream started at step {began} still has batches in flight"
            ))),
            _ => Ok(()),
        }
    }
}

/// This stage's layers of `gpt` on micro-batch `batch`, computing in `compute` (under mixed
/// precision its f32 parameters are cast where used): from its tokens on the first stage,
/// else from `input` (which arrives in f32) cast to `compute`; the last stage returns the
/// micro-batch's mean loss.
fn run_layers(
    (gpt, compute): (&Gpt, CandleDType),
    layers: Range<usize>,
    batch: &Batch,
    input: Option<&candle_core::Tensor>,
) -> candle_core::Result<candle_core::Tensor> {
    let candle = |e: kolo_tensor::TensorError| candle_core::Error::Msg(e.to_string());
    let last = layers.end == gpt.layers();
    let x = match (input, &batch.input) {
        (Some(h), _) => StageInput::Hidden(h.to_dtype(compute)?),
        (None, Input::Tokens { ids, b, t }) => StageInput::Tokens { ids, b: *b, t: *t },
        (None, Input::Images { .. }) => return Err(candle_core::Error::Msg("a GPT stage takes token sequences".into())),
    };
    let out = gpt.forward_layers(x, layers, &*kolo_tensor::view_for(compute)).map_err(candle)?;
    match last {
        true => gpt.logits_loss(&out, &batch.targets).map_err(candle),
        false => Ok(out),
    }
}
