//! Runs one stage's schedule over the pipeline's communicator (rank = stage).
//!
//! Every send is fused with the receive the stage needs next (`send_recv`), as Megatron batches
//! its p2p ops: a stage that has just produced an activation for the next stage and needs a
//! gradient from it exchanges both in one call, so neighbours never block on each other's sends.

use crate::schedule::{ops, Op, Schedule};
use kolo_base::Rank;
use kolo_comm::{BufMut, BufRef, Communicator};
use std::time::Instant;

/// The computation of one stage, tensor-free: activations and gradients are flat f32 buffers.
pub trait StageWork {
    /// Forward pass of micro-batch `mb`. `input` is the previous stage's output (`None` on the
    /// first stage). Returns this stage's output (the last stage returns its loss, one value).
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String>;
    /// Backward pass of micro-batch `mb`. `grad` is the gradient of its output (`None` on the
    /// last stage, which starts from its loss). Returns the gradient of its input (the first
    /// stage returns an empty vector).
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String>;
    /// PipeDream-2BW: batch `t`'s gradients are complete on this stage; apply them. Called
    /// with nothing left unsent, so it may run collectives (the data-parallel average).
    fn update(&mut self, _t: usize) -> Result<(), String> {
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PipeError {
    #[error(transparent)]
    Comm(#[from] kolo_comm::CommError),
    #[error("pipeline stage {stage}, {op:?}: {msg}")]
    Stage { stage: usize, op: Op, msg: String },
}

/// What one stage did during a step.
#[derive(Clone, Debug, Default)]
pub struct StepReport {
    /// Wall time of the step on this stage, and the part spent computing.
    pub total_ms: f64,
    pub busy_ms: f64,
    /// Most micro-batches whose activations this stage held at once.
    pub max_live: usize,
    /// The last stage: the loss of each micro-batch.
    pub losses: Vec<f32>,
    pub bytes_sent: usize,
    /// (op, start ms, end ms) from the step's start, for timelines.
    pub spans: Vec<(Op, f64, f64)>,
    /// PipeDream-2BW: when each weight update finished (ms from the start).
    pub updates: Vec<f64>,
}

const fn act_tag(mb: usize) -> u32 {
    (mb as u32) << 1
}
const fn grad_tag(mb: usize) -> u32 {
    ((mb as u32) << 1) | 1
}

/// Runs stage `comm.rank()` of a `comm.world_size()`-stage pipeline for `m` micro-batches;
/// activations between stages hold `act_len` values.
pub fn run_stage(
    comm: &dyn Communicator,
    schedule: Schedule,
    m: usize,
    act_len: usize,
    work: &mut dyn StageWork,
) -> Result<StepReport, PipeError> {
    let mut run = StageRun::new(comm, schedule, m, act_len);
    run.run(comm, work, None)?;
    run.finish(comm)
}

/// One stage's plan being run, resumably: [`StageRun::run`] executes ops up to an update and
/// returns; the next call goes on from there. PipeDream-2BW hands control back to the training
/// driver after each optimizer step this way, with the next batch's micro-batches still in
/// flight. Between calls nothing is unsent (an update is entered with the outbox empty), so the
/// caller may run collectives on other communicators.
pub struct StageRun {
    plan: Vec<Op>,
    next: usize,
    act_len: usize,
    t0: Instant,
    live: usize,
    /// An output waiting to be sent: (data, peer, tag).
    outbox: Option<(Vec<f32>, usize, u32)>,
    report: StepReport,
}

impl StageRun {
    /// Stage `comm.rank()`'s plan of `schedule` for `m` micro-batches (activations of
    /// `act_len` values), not started.
    pub fn new(comm: &dyn Communicator, schedule: Schedule, m: usize, act_len: usize) -> StageRun {
        let plan = ops(schedule, comm.world_size().get(), comm.rank().get(), m);
        StageRun { plan, next: 0, act_len, t0: Instant::now(), live: 0, outbox: None, report: StepReport::default() }
    }

    /// Whether every op of the plan has run.
    pub fn is_done(&self) -> bool {
        self.next == self.plan.len()
    }

    /// What the stage did so far (its `total_ms` is set by [`StageRun::finish`]).
    pub fn report(&self) -> &StepReport {
        &self.report
    }

    /// Runs ops on `comm` (the pipeline group this run was made for) until `Op::Update(until)`
    /// has run, or to the end of the plan when `until` is `None`. Returns whether the plan is
    /// done.
    pub fn run(&mut self, comm: &dyn Communicator, work: &mut dyn StageWork, until: Option<usize>) -> Result<bool, PipeError> {
        let k = comm.world_size().get();
        let s = comm.rank().get();
        let act_len = self.act_len;
        let t0 = self.t0;
        let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
        while let Some(&op) = self.plan.get(self.next) {
            self.next += 1;
            let report = &mut self.report;
            if let Op::Update(t) = op {
                if let Some((data, to, tag)) = self.outbox.take() {
                    comm.send(BufRef::from(&data[..]), Rank(to), tag)?;
                    report.bytes_sent += data.len() * 4;
                }
                let start = Instant::now();
                work.update(t).map_err(|msg| PipeError::Stage { stage: s, op, msg })?;
                let end = Instant::now();
                report.busy_ms += end.duration_since(start).as_secs_f64() * 1e3;
                report.spans.push((op, ms(start), ms(end)));
                report.updates.push(ms(end));
                if until == Some(t) {
                    return Ok(self.is_done());
                }
                continue;
            }
            // What this op needs from a neighbour.
            let need = match op {
                Op::Forward(i) if s > 0 => Some((s - 1, act_tag(i))),
                Op::Backward(i) if s + 1 < k => Some((s + 1, grad_tag(i))),
                _ => None,
            };
            let received = match (self.outbox.take(), need) {
                (Some((data, to, tag)), Some((from, rtag))) => {
                    let mut buf = vec![0f32; act_len];
                    comm.send_recv(BufRef::from(&data[..]), Rank(to), tag, BufMut::from(&mut buf[..]), Rank(from), rtag)?;
                    report.bytes_sent += data.len() * 4;
                    Some(buf)
                }
                (Some((data, to, tag)), None) => {
                    comm.send(BufRef::from(&data[..]), Rank(to), tag)?;
                    report.bytes_sent += data.len() * 4;
                    None
                }
                (None, Some((from, rtag))) => {
                    let mut buf = vec![0f32; act_len];
                    comm.recv(BufMut::from(&mut buf[..]), Rank(from), rtag)?;
                    Some(buf)
                }
                (None, None) => None,
            };
            let start = Instant::now();
            let fail = |msg: String| PipeError::Stage { stage: s, op, msg };
            match op {
                Op::Forward(i) => {
                    let out = work.forward(i, received).map_err(fail)?;
                    self.live += 1;
                    report.max_live = report.max_live.max(self.live);
                    if s + 1 < k {
                        if out.len() != act_len {
                            return Err(fail(format!("produced {} values, the pipeline passes {act_len}", out.len())));
                        }
                        self.outbox = Some((out, s + 1, act_tag(i)));
                    } else {
                        report.losses.push(out.first().copied().unwrap_or(f32::NAN));
                    }
                }
                Op::Backward(i) => {
                    let g = work.backward(i, received).map_err(fail)?;
                    self.live -= 1;
                    if s > 0 {
                        if g.len() != act_len {
                            return Err(fail(format!("produced an input gradient of {} values, expected {act_len}", g.len())));
                        }
                        self.outbox = Some((g, s - 1, grad_tag(i)));
                    }
                }
                Op::Update(_) => unreachable!("handled above"),
            }
            let end = Instant::now();
            report.busy_ms += end.duration_since(start).as_secs_f64() * 1e3;
            report.spans.push((op, ms(start), ms(end)));
        }
        match until {
            Some(t) => Err(PipeError::Stage {
                stage: s,
                op: Op::Update(t),
                msg: "the plan ended before this update (it holds fewer batches)".into(),
            }),
            None => Ok(true),
        }
    }

    /// Sends what is left and returns the report (`total_ms` from [`StageRun::new`]).
    pub fn finish(mut self, comm: &dyn Communicator) -> Result<StepReport, PipeError> {
        if let Some((data, to, tag)) = self.outbox.take() {
            comm.send(BufRef::from(&data[..]), Rank(to), tag)?;
            self.report.bytes_sent += data.len() * 4;
        }
        self.report.total_ms = self.t0.elapsed().as_secs_f64() * 1e3;
        Ok(self.report)
    }
}
