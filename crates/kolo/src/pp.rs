//! Pipeline parallelism for your own candle model (GPipe and 1F1B, as torch's
//! `torch.distributed.pipelining` and DeepSpeed's `PipelineModule`, and PipeDream-2BW through
//! [`Pipeline::step_stream`]): the ranks along a
//! [`Mesh`]'s `pp` axis are stages; each builds only its own layers (the whole model's names
//! unchanged, [`stage_layers`] says which) and runs them in one closure, and [`Pipeline::step`]
//! moves every micro-batch's activations forward and their gradients back between stages in
//! the schedule's order, then steps the optimizer (DDP over each stage's `dp` group).
//!
//! ```no_run
//! # use candle_core::{Tensor, Module};
//! # fn main() -> kolo::Result<()> {
//! # let dist = kolo::init()?;
//! let mesh = kolo::Mesh::new(&dist, &[("pp", 2)])?;
//! let mine = kolo::pp::stage_layers(8, &mesh)?; // layers 0..4 on stage 0, 4..8 on stage 1
//! # let (varmap, layers, x, y) = (candle_nn::VarMap::new(), Vec::<candle_nn::Linear>::new(), Tensor::zeros((8, 16), candle_core::DType::F32, &dist.device())?, Tensor::zeros(8, candle_core::DType::U32, &dist.device())?);
//! // .. build layers `mine` through the VarMap's VarBuilder ..
//! let opts = kolo::TrainOptions::new().grad_accum(4); // 4 micro-batches per step
//! let mut trainer = kolo::Trainer::with_mesh(&varmap, &mesh, opts)?;
//! let pipe = kolo::pp::Pipeline::new(kolo::pp::Schedule::OneFOneB, &[2, 16])?; // activations (2, 16)
//! let out = pipe.step(&mut trainer, |mb, input| {
//!     // the first stage makes micro-batch `mb`'s input; the others receive it
//!     let mut h = match input { Some(h) => h.clone(), None => x.narrow(0, 2 * mb, 2)? };
//!     for l in &layers { h = l.forward(&h)?.relu()?; }
//!     // the last stage returns micro-batch `mb`'s loss
//!     if mine.end == 8 { candle_nn::loss::cross_entropy(&h, &y.narrow(0, 2 * mb, 2)?) } else { Ok(h) }
//! })?;
//! # let _ = out; Ok(()) }
//! ```
//!
//! The step's loss (the mean over its micro-batches) reaches every stage. Checkpoints hold the
//! whole model's tensors under their names: a pipeline's resumes in one process or over
//! another number of stages. Stages may hold [`crate::tp`]'s split layers (a `pp x dp x tp`
//! mesh); the clipping norm sums over every stage and piece. Each stage computes in its model's
//! dtype (mixed precision: bf16/f16 layers over f32 masters, activations and their gradients
//! travel between stages as f32, f16's loss scale carried by them); ZeRO-1/2 shard each
//! stage's optimizer state over its `dp` group, ZeRO-3 its layers' values
//! (`Trainer::with_mesh_zero3_groups`); local SGD averages each stage over its `dp` group
//! (without parameters tied across stages); a gradient codec compresses each rank's own
//! buckets.

use crate::{Error, Mesh, Result, StepOutput, Trainer};
use candle_core::{DType, Tensor, Var};
use kolo_comm::{BufMut, Communicator};
use kolo_pipe::StageWork;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

pub use kolo_pipe::schedule::partition;
pub use kolo_pipe::Schedule;

/// The layers `0..layers` of this rank's stage: contiguous ranges as even as the count allows
/// (where counts must differ, later stages take the extra layers: 3 layers in 2 stages are
/// `[0]` and `[1, 2]`). For stages balanced by cost, [`stage_layers_by`].
pub fn stage_layers(layers: usize, mesh: &Mesh) -> Result<Range<usize>> {
    let k = mesh.size("pp");
    if layers < k {
        return Err(Error::setting("mesh", format!("{layers} layers cannot be cut into {k} pipeline stages")));
    }
    Ok(partition(&vec![1.0; layers], k)[mesh.coord("pp")].clone())
}

/// The layers of this rank's stage when layer `i` costs `costs[i]` (time, or parameters):
/// contiguous ranges whose largest total is as small as it can be (kolo-pipe's
/// [`partition`]), so that no stage keeps the others waiting more than it must.
pub fn stage_layers_by(costs: &[f64], mesh: &Mesh) -> Result<Range<usize>> {
    let k = mesh.size("pp");
    if costs.len() < k {
        return Err(Error::setting("mesh", format!("{} layers cannot be cut into {k} pipeline stages", costs.len())));
    }
    if let Some(bad) = costs.iter().find(|c| !c.is_finite() || **c < 0.0) {
        return Err(Error::setting("mesh", format!("a layer's cost must be finite and not negative, not {bad}")));
    }
    Ok(partition(costs, k)[mesh.coord("pp")].clone())
}

/// How a pipeline runs a step: the schedule, and the shape of the activation one stage hands
/// the next for one micro-batch (the same for every micro-batch and stage boundary).
pub struct Pipeline {
    schedule: Schedule,
    shape: Vec<usize>,
    /// Keep only each micro-batch's input from its forward to its backward, and run the
    /// stage's forward again there.
    remat: bool,
    /// This stage's work, summed over the steps so far.
    time: std::sync::Mutex<Totals>,
    /// PipeDream-2BW: the open stream, and the stages' own group for the step's loss (the
    /// pipeline group carries the stream's activations).
    stream: std::sync::Mutex<(Option<Stream>, Option<Sync>)>,
    /// PipeDream-2BW carrying versions across streams: the trainer's cell of the weight version
    /// before the latest (its checkpoints write it, its resume reads it back).
    carried: Option<Carried>,
}

/// A weight version's number and its values (the model's variables').
pub(crate) type Version = (u64, Vec<Tensor>);

/// PipeDream-2BW's weight version before the latest, between streams: a trainer's, shared with
/// the pipeline that carries versions.
pub(crate) type Carried = std::sync::Arc<std::sync::Mutex<Option<Version>>>;

/// The stages' own group beside the pipeline group.
type Sync = Arc<dyn Communicator>;

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `try_lock`: a closure inside `step_stream` may print the pipeline it runs in.
        let in_flight = self.stream.try_lock().map(|s| s.0.is_some().to_string()).unwrap_or_else(|_| "running".into());
        write!(f, "Pipeline {{ schedule: {:?}, shape: {:?}, in_flight: {in_flight} }}", self.schedule, self.shape)
    }
}

impl Pipeline {
    /// A pipeline of `schedule` passing activations of `shape`: GPipe and 1F1B run through
    /// [`Pipeline::step`]; PipeDream-2BW (`Schedule::TwoBw { batches }`: streams that drain at
    /// every multiple of `batches` steps) through [`Pipeline::step_stream`].
    pub fn new(schedule: Schedule, shape: &[usize]) -> Result<Pipeline> {
        if matches!(schedule, Schedule::TwoBw { batches: 0 }) {
            return Err(Error::setting("pipeline.schedule", "PipeDream-2BW's streams need batches >= 1"));
        }
        Ok(Pipeline { schedule, shape: shape.to_vec(), remat: false, time: Default::default(), stream: Default::default(), carried: None })
    }

    /// PipeDream-2BW as `kolo train` runs it: a stream's end keeps the weight version before
    /// the latest, and the next stream's first batch runs on it, so that where streams end
    /// (evaluations, checkpoints, the trainer's `steps` or `batches`) changes when work
    /// happens, never what is computed. `trainer`'s checkpoints then hold that version too
    /// (`state.previous_weights.*`) and its resume reads it back, so a run stopped at a stream's
    /// end and resumed computes what the run that never stopped computes. Without it the next
    /// stream's first batch runs on the latest weights. Call it after [`Trainer::resume`].
    pub fn carrying_versions(mut self, trainer: &Trainer) -> Pipeline {
        let carried = trainer.carried_versions();
        let s = trainer.steps_done();
        let none = carried.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_none_or(|(v, _)| v + 1 != s);
        if s > 0 && none && trainer.rank() == 0 {
            kolo_base::eline!("the checkpoint holds no previous weight version (another strategy wrote it): batch {s} runs on version {s}");
        }
        self.carried = Some(carried);
        self
    }

    /// Carrying versions: the version before the latest, between streams (for a checkpoint).
    pub(crate) fn carried(&self) -> Option<Version> {
        self.carried.as_ref().and_then(|c| c.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    /// Re-materialization (GPipe's; activation checkpointing at the stage boundary): each
    /// stage keeps only a micro-batch's input from its forward to its backward and runs its
    /// closure again there, with a graph: less memory for one more forward. The closure must
    /// compute the same values when run again (no dropout drawn anew).
    pub fn rematerialize(mut self, on: bool) -> Pipeline {
        self.remat = on;
        self
    }

    /// This stage's work over the steps so far (busy and total time, bytes sent, most
    /// micro-batches alive at once): what `kolo train` reports.
    pub(crate) fn totals(&self) -> Totals {
        *self.time.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// PipeDream-2BW: whether a stream has batches in flight. Evaluate, save or change the
    /// model only when none has (a stream ends at the trainer's checkpoints and last step, and
    /// at every multiple of `batches` steps).
    pub fn in_flight(&self) -> bool {
        self.stream.lock().unwrap_or_else(|p| p.into_inner()).0.is_some()
    }

    /// The share of this stage's step time spent waiting rather than computing, over the steps
    /// so far (the pipeline bubble, with the communication's own time; GPipe and 1F1B's ideal
    /// is (stages - 1) / (micro-batches + stages - 1)).
    pub fn bubble(&self) -> Option<f64> {
        let t = self.totals();
        (t.total_ms > 0.0).then(|| 1.0 - t.busy_ms / t.total_ms)
    }

    /// Collective over the mesh: one optimizer step of `train.grad_accum` micro-batches.
    /// `stage(mb, input)` runs this stage's layers on micro-batch `mb`: the first stage gets
    /// `None` and makes the input itself; the others get the previous stage's activation; the
    /// last stage returns the micro-batch's loss (a scalar, the mean over its examples), the
    /// others an activation of the pipeline's shape. Each stage's gradients are accumulated
    /// over the micro-batches and reduced over its `dp` group; then the trainer steps.
    pub fn step(
        &self,
        trainer: &mut Trainer,
        stage: impl FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>,
    ) -> Result<StepOutput> {
        self.step_then(trainer, stage, |_| Ok(()))
    }

    /// As [`Pipeline::step`], running `before_update` on the trainer after the micro-batches'
    /// backward passes and before the update (as [`Trainer::step_then`]).
    pub fn step_then(
        &self,
        trainer: &mut Trainer,
        stage: impl FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>,
        before_update: impl FnOnce(&mut Trainer) -> Result<()>,
    ) -> Result<StepOutput> {
        if let Schedule::TwoBw { .. } = self.schedule {
            return Err(Error::usage(
                trainer.rank(),
                "Pipeline::step",
                "a PipeDream-2BW pipeline runs its steps with Pipeline::step_stream",
            ));
        }
        let Some((pp, m)) = trainer.pipeline() else {
            return Err(Error::usage(
                0,
                "Pipeline::step",
                "the trainer has no pipeline: create it with Trainer::with_mesh over a mesh whose pp axis is larger than 1",
            ));
        };
        let pp = pp.clone();
        let (s, k) = (pp.rank().get(), pp.world_size().get());
        let act_len = self.shape.iter().product();
        // The step's time counts from here: a stage's first backward may come after every
        // forward of the schedule and the wait for the next stage.
        trainer.mark_step_start();
        let mut work = Work {
            trainer,
            stage,
            shape: &self.shape,
            first: s == 0,
            last: s + 1 == k,
            m,
            remat: self.remat,
            saved: HashMap::new(),
            failure: None,
        };
        let run = kolo_pipe::run_stage(&*pp, self.schedule, m as usize, act_len, &mut work);
        if let Some(e) = work.failure.take() {
            return Err(e);
        }
        let report = run.map_err(|e| Error::usage(work.trainer.rank(), "Pipeline::step", e.to_string()))?;
        self.time.lock().unwrap_or_else(|p| p.into_inner()).add(&report);
        // The step's loss, from the last stage to every stage.
        let mut loss = [report.losses.iter().map(|l| f64::from(*l)).sum::<f64>() / m as f64];
        pp.broadcast(BufMut::from(&mut loss[..]), kolo_base::Rank(k - 1))?;
        work.trainer.set_step_loss(loss[0] as f32);
        before_update(work.trainer)?;
        work.trainer.update()
    }
}

/// PipeDream-2BW's open stream on this stage: the executor's run, and the weights.
struct Stream {
    run: kolo_pipe::StageRun,
    state: StreamState,
}

struct StreamState {
    /// The step of the stream's first batch.
    start: u64,
    /// Weight versions by number (the weights after that many steps), as the model's
    /// variables' values: the latest, and the one the batch in flight runs on.
    versions: std::collections::BTreeMap<u64, Vec<Tensor>>,
    /// The oldest version the stream's batches run on: its start's, or the one before when
    /// carried over from the previous stream.
    base: u64,
    /// The version the model's variables hold now.
    loaded: u64,
    /// The last stage: the sum of each batch's micro-batch losses.
    losses: HashMap<u64, f64>,
    /// The micro-batches forwarded and not yet backwarded, between calls ([`Work`]'s).
    saved: HashMap<usize, Saved>,
}

/// What a stage keeps of a micro-batch from its forward to its backward: its input variable
/// (not on the first stage), and its output with the graph (not when re-materializing).
type Saved = (Option<Var>, Option<Tensor>);

/// A stage's work summed over steps.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Totals {
    pub busy_ms: f64,
    pub total_ms: f64,
    pub bytes_sent: u64,
    /// Most micro-batches whose activations the stage held at once.
    pub max_live: usize,
}

impl Totals {
    fn add(&mut self, r: &kolo_pipe::StepReport) {
        self.busy_ms += r.busy_ms;
        self.total_ms += r.total_ms;
        self.bytes_sent += r.bytes_sent as u64;
        self.max_live = self.max_live.max(r.max_live);
    }
}

impl Pipeline {
    /// PipeDream-2BW (Narayanan et al. 2021; `kolo train`'s `pipeline.schedule = "2bw"`), for
    /// your own model. Collective over the mesh: one optimizer step, without a flush between
    /// steps: the batches flow through the stages as one 1F1B stream, batch t running forward
    /// and backward on the weights after step t - 1 while step t's update makes the next ones
    /// from the latest (W(t+1) = W(t) - step(grad f(W(t-1)))): two weight versions per stage, and
    /// no bubble between steps. The call returns after this stage's update of step t, with
    /// the next batch's first micro-batches possibly in flight; the next call goes on.
    /// `stage(step, mb, input)` is [`Pipeline::step`]'s closure with the step the micro-batch
    /// belongs to (this call's or the next one's: read that step's data). A stream ends at
    /// the trainer's next checkpoint, its last step, and every multiple of the schedule's
    /// `batches` steps (evaluate there); the next begins from the latest weights (its first
    /// batch runs on them). While a stream
    /// is open ([`Pipeline::in_flight`]) evaluate nothing and change no weight. Each stage
    /// keeps a copy of its variables per version (of its dtype; ZeRO-3, whose groups are
    /// emptied, is refused). Parameters tied across stages (an output layer tied to the
    /// embedding) have their gradients summed in the update as under 1F1B.
    pub fn step_stream(
        &self,
        trainer: &mut Trainer,
        mut stage: impl FnMut(u64, usize, Option<&Tensor>) -> candle_core::Result<Tensor>,
    ) -> Result<StepOutput> {
        let op = "Pipeline::step_stream";
        let Schedule::TwoBw { batches } = self.schedule else {
            return Err(Error::usage(
                trainer.rank(),
                op,
                format!("the pipeline's schedule is {:?}: run it with Pipeline::step", self.schedule),
            ));
        };
        let Some((pp, m)) = trainer.pipeline() else {
            return Err(Error::usage(
                trainer.rank(),
                op,
                "the trainer has no pipeline: create it with Trainer::with_mesh over a mesh whose pp axis is larger than 1",
            ));
        };
        let pp = pp.clone();
        let Some(vars) = trainer.compute_vars() else {
            return Err(Error::usage(
                trainer.rank(),
                op,
                "PipeDream-2BW keeps two versions of each stage's weights; ZeRO-3 empties them between uses",
            ));
        };
        let mut held = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let (open, sync) = &mut *held;
        if sync.is_none() {
            // Collective over the pipeline group, between streams.
            *sync = Some(kolo_comm::split(&*pp, Some(0), pp.rank().get() as u32)?.expect("every stage has a color"));
        }
        let sync = sync.clone().expect("made above");
        let (s, k) = (pp.rank().get(), pp.world_size().get());
        let mut st = match open.take() {
            Some(st) => st,
            None => {
                let start = trainer.steps_done();
                let n = trainer.steps_to_drain(batches as u64 - start % batches as u64);
                let now = vars.iter().map(|v| v.as_tensor().copy()).collect::<candle_core::Result<Vec<_>>>()?;
                let run = kolo_pipe::StageRun::new(&*pp, Schedule::TwoBw { batches: n as usize }, m as usize, self.shape.iter().product());
                let mut versions = std::collections::BTreeMap::from([(start, now)]);
                if let Some((v, values)) = self.carried().filter(|(v, _)| v + 1 == start) {
                    versions.insert(v, values);
                }
                let base = *versions.keys().next().expect("the start's version");
                let state = StreamState { start, versions, base, loaded: start, losses: HashMap::new(), saved: HashMap::new() };
                Stream { run, state }
            }
        };
        let (start, mu) = (st.state.start, m as usize);
        let inner = Work {
            trainer,
            stage: |mb: usize, input: Option<&Tensor>| stage(start + (mb / mu) as u64, mb % mu, input),
            shape: &self.shape,
            first: s == 0,
            last: s + 1 == k,
            m,
            remat: self.remat,
            saved: std::mem::take(&mut st.state.saved),
            failure: None,
        };
        let until = (inner.trainer.steps_done() - start) as usize;
        let mut work = StreamWork { inner, st: &mut st.state, vars, sync: &*sync, out: None };
        let ran = st.run.run(&*pp, &mut work, Some(until));
        work.st.saved = std::mem::take(&mut work.inner.saved);
        if let Some(e) = work.inner.failure.take() {
            return Err(e);
        }
        let done = ran.map_err(|e| Error::usage(work.inner.trainer.rank(), op, e.to_string()))?;
        let out = work
            .out
            .take()
            .ok_or_else(|| Error::usage(work.inner.trainer.rank(), op, format!("step {}: no update ran", start + until as u64)))?;
        if done {
            let report = st.run.finish(&*pp).map_err(|e| Error::usage(work.inner.trainer.rank(), op, e.to_string()))?;
            self.time.lock().unwrap_or_else(|p| p.into_inner()).add(&report);
            if let Some(c) = &self.carried {
                // The version before the latest, which the next stream's first batch runs on.
                let latest = *st.state.versions.keys().next_back().expect("a version");
                let before = latest.checked_sub(1).and_then(|v| st.state.versions.remove(&v).map(|t| (v, t)));
                *c.lock().unwrap_or_else(|p| p.into_inner()) = before;
            }
        } else {
            *open = Some(st);
        }
        Ok(out)
    }
}

/// One call's share of a PipeDream-2BW stream: [`Work`] on the weight version of each
/// micro-batch's batch, and the updates.
struct StreamWork<'s, 'a, F> {
    inner: Work<'a, F>,
    st: &'s mut StreamState,
    /// The model's variables, in the trainer's parameter order.
    vars: Vec<Var>,
    sync: &'s dyn Communicator,
    out: Option<StepOutput>,
}

impl<F: FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>> StreamWork<'_, '_, F> {
    /// The step of stream micro-batch `mb`.
    fn batch_of(&self, mb: usize) -> u64 {
        self.st.start + (mb as u64 / self.inner.m)
    }

    /// Puts weight version `v` into the model's variables.
    fn load(&mut self, v: u64) -> Result<()> {
        if self.st.loaded != v {
            let values = self.st.versions.get(&v).ok_or_else(|| {
                Error::usage(self.inner.trainer.rank(), "Pipeline::step_stream", format!("weight version {v} is not held on this stage"))
            })?;
            for (var, value) in self.vars.iter().zip(values) {
                var.set(value)?;
            }
            self.st.loaded = v;
        }
        Ok(())
    }

    /// Batch `t` runs on the weights after step t - 1 (the stream's first on those it began
    /// with, unless the version before them was carried over).
    fn version_of(&self, t: u64) -> u64 {
        t.saturating_sub(1).max(self.st.base)
    }

    fn update_inner(&mut self, b: usize) -> Result<()> {
        let t = self.st.start + b as u64;
        let latest = *self.st.versions.keys().next_back().unwrap_or(&t);
        self.load(latest)?;
        // The step's loss, from the last stage over the stages' own group.
        let mut loss = [self.st.losses.remove(&t).unwrap_or(0.0) / self.inner.m as f64];
        let k = self.sync.world_size().get();
        self.sync.broadcast(BufMut::from(&mut loss[..]), kolo_base::Rank(k - 1))?;
        self.inner.trainer.set_step_loss(loss[0] as f32);
        self.out = Some(self.inner.trainer.update()?);
        let now = self.vars.iter().map(|v| v.as_tensor().copy()).collect::<candle_core::Result<Vec<_>>>()?;
        self.st.versions.insert(t + 1, now);
        self.st.loaded = t + 1;
        // Batch t + 1 (in flight) runs on version t; older ones are done with.
        self.st.versions.retain(|&v, _| v >= t);
        Ok(())
    }
}

impl<F: FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>> StageWork for StreamWork<'_, '_, F> {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, String> {
        let t = self.batch_of(mb);
        let v = self.version_of(t);
        self.load(v).map_err(|e| self.inner.fail(e))?;
        let out = self.inner.forward(mb, input)?;
        if self.inner.last {
            *self.st.losses.entry(t).or_default() += f64::from(out[0]);
        }
        Ok(out)
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, String> {
        let v = self.version_of(self.batch_of(mb));
        self.load(v).map_err(|e| self.inner.fail(e))?;
        self.inner.backward(mb, grad)
    }
    fn update(&mut self, b: usize) -> std::result::Result<(), String> {
        self.update_inner(b).map_err(|e| self.inner.fail(e))
    }
}

/// One stage's part of a step: the user's closure, and each micro-batch's input variable and
/// output kept from its forward to its backward.
struct Work<'a, F> {
    trainer: &'a mut Trainer,
    stage: F,
    shape: &'a [usize],
    first: bool,
    last: bool,
    m: u64,
    remat: bool,
    saved: HashMap<usize, Saved>,
    /// The first error, kept whole (the executor carries text).
    failure: Option<Error>,
}

impl<F: FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>> Work<'_, F> {
    fn fail(&mut self, e: Error) -> String {
        let text = e.to_string();
        self.failure.get_or_insert(e);
        text
    }

    fn flat(t: &Tensor) -> Result<Vec<f32>> {
        Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn forward_inner(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>> {
        // Activations travel as f32; a mixed-precision stage takes them in its model's dtype.
        let x = match (input, self.first) {
            (Some(v), false) => {
                Some(Var::from_tensor(&Tensor::from_vec(v, self.shape, &kolo_tensor::device())?.to_dtype(self.trainer.compute_dtype())?)?)
            }
            _ => None,
        };
        let out = (self.stage)(mb, x.as_ref().map(|v| v.as_tensor()))?;
        let rank = self.trainer.rank();
        let value = if self.last {
            if out.elem_count() != 1 {
                return Err(Error::usage(
                    rank,
                    "Pipeline::step",
                    format!("the last stage returned a {:?} tensor; it returns the micro-batch's loss, a scalar", out.dims()),
                ));
            }
            Self::flat(&out)?
        } else {
            if out.dims() != self.shape {
                return Err(Error::usage(
                    rank,
                    "Pipeline::step",
                    format!(
                        "micro-batch {mb}: the stage returned an activation of shape {:?}; the pipeline passes {:?}",
                        out.dims(),
                        self.shape
                    ),
                ));
            }
            Self::flat(&out)?
        };
        // Re-materializing, the graph goes with `out` here and is built again in backward.
        self.saved.insert(mb, (x, (!self.remat).then_some(out)));
        Ok(value)
    }

    fn backward_inner(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>> {
        let (x, out) = self
            .saved
            .remove(&mb)
            .ok_or_else(|| Error::usage(self.trainer.rank(), "Pipeline::step", format!("micro-batch {mb} ran backward before forward")))?;
        let out = match out {
            Some(out) => out,
            // Re-materialization: the same forward again, from the same input variable.
            None => (self.stage)(mb, x.as_ref().map(|v| v.as_tensor()))?,
        };
        // The last stage starts from its loss (a mean over the step's micro-batches, times f16's
        // loss scale); the others from the gradient of their output, which carries both.
        let (loss, factor) = match grad {
            None => (out, self.trainer.loss_scale() / self.m as f64),
            Some(g) => ((out.to_dtype(DType::F32)? * Tensor::from_vec(g, self.shape, out.device())?)?.sum_all()?, 1.0),
        };
        let (_, captured) = self.trainer.backward_with(&loss, factor, x.as_ref())?;
        match (x, captured) {
            (None, _) => Ok(Vec::new()),
            (Some(_), Some(g)) => Self::flat(&g),
            // The loss did not depend on the input.
            (Some(x), None) => Ok(vec![0f32; x.elem_count()]),
        }
    }
}

impl<F: FnMut(usize, Option<&Tensor>) -> candle_core::Result<Tensor>> StageWork for Work<'_, F> {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, String> {
        self.forward_inner(mb, input).map_err(|e| self.fail(e))
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> std::result::Result<Vec<f32>, String> {
        self.backward_inner(mb, grad).map_err(|e| self.fail(e))
    }
}
