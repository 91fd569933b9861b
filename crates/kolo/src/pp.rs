//! Pipeline parallelism for your own candle model (GPipe and 1F1B, as torch's
//! `torch.distributed.pipelining` and DeepSpeed's `PipelineModule`): the ranks along a
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
//! (`Trainer::with_mesh_zero3_groups`); local SGD and compression other than fp16/bf16 are
//! refused with a pipeline so far.

use crate::{Error, Mesh, Result, StepOutput, Trainer};
use candle_core::{DType, Tensor, Var};
use kolo_comm::BufMut;
use kolo_pipe::StageWork;
use std::collections::HashMap;
use std::ops::Range;

pub use kolo_pipe::schedule::partition;
pub use kolo_pipe::Schedule;

/// The layers `0..layers` of this rank's stage: contiguous ranges as even as the count allows
/// (earlier stages take the remainder). For stages balanced by cost, cut with [`partition`].
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
#[derive(Debug)]
pub struct Pipeline {
    schedule: Schedule,
    shape: Vec<usize>,
    /// This stage's busy and total milliseconds, summed over the steps so far.
    time: std::sync::Mutex<(f64, f64)>,
}

impl Pipeline {
    /// A pipeline of `schedule` (GPipe or 1F1B) passing activations of `shape`.
    pub fn new(schedule: Schedule, shape: &[usize]) -> Result<Pipeline> {
        if matches!(schedule, Schedule::TwoBw { .. }) {
            return Err(Error::setting("pipeline.schedule", "PipeDream-2BW is kolo train's built-in GPT's so far (GPipe and 1F1B here)"));
        }
        Ok(Pipeline { schedule, shape: shape.to_vec(), time: Default::default() })
    }

    /// The share of this stage's step time spent waiting rather than computing, over the steps
    /// so far (the pipeline bubble, with the communication's own time; GPipe and 1F1B's ideal
    /// is (stages - 1) / (micro-batches + stages - 1)).
    pub fn bubble(&self) -> Option<f64> {
        let (busy, total) = *self.time.lock().unwrap_or_else(|p| p.into_inner());
        (total > 0.0).then(|| 1.0 - busy / total)
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
        let mut work =
            Work { trainer, stage, shape: &self.shape, first: s == 0, last: s + 1 == k, m, saved: HashMap::new(), failure: None };
        let run = kolo_pipe::run_stage(&*pp, self.schedule, m as usize, act_len, &mut work);
        if let Some(e) = work.failure.take() {
            return Err(e);
        }
        let report = run.map_err(|e| Error::usage(work.trainer.rank(), "Pipeline::step", e.to_string()))?;
        {
            let mut t = self.time.lock().unwrap_or_else(|p| p.into_inner());
            t.0 += report.busy_ms;
            t.1 += report.total_ms;
        }
        // The step's loss, from the last stage to every stage.
        let mut loss = [report.losses.iter().map(|l| f64::from(*l)).sum::<f64>() / m as f64];
        pp.broadcast(BufMut::from(&mut loss[..]), kolo_base::Rank(k - 1))?;
        work.trainer.set_step_loss(loss[0] as f32);
        before_update(work.trainer)?;
        work.trainer.update()
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
    saved: HashMap<usize, (Option<Var>, Tensor)>,
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
        self.saved.insert(mb, (x, out));
        Ok(value)
    }

    fn backward_inner(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>> {
        let (x, out) = self
            .saved
            .remove(&mb)
            .ok_or_else(|| Error::usage(self.trainer.rank(), "Pipeline::step", format!("micro-batch {mb} ran backward before forward")))?;
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
