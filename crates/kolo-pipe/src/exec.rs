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
    let k = comm.world_size().get();
    let s = comm.rank().get();
    let plan = ops(schedule, k, s, m);
    let t0 = Instant::now();
    let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
    let mut report = StepReport::default();
    let mut live = 0usize;
    // An output waiting to be sent: (data, peer, tag).
    let mut outbox: Option<(Vec<f32>, usize, u32)> = None;
    for &op in &plan {
        if let Op::Update(t) = op {
            if let Some((data, to, tag)) = outbox.take() {
                comm.send(BufRef::from(&data[..]), Rank(to), tag)?;
                report.bytes_sent += data.len() * 4;
            }
            let start = Instant::now();
            work.update(t).map_err(|msg| PipeError::Stage { stage: s, op, msg })?;
            let end = Instant::now();
            report.busy_ms += end.duration_since(start).as_secs_f64() * 1e3;
            report.spans.push((op, ms(start), ms(end)));
            report.updates.push(ms(end));
            continue;
        }
        // What this op needs from a neighbour.
        let need = match op {
            Op::Forward(i) if s > 0 => Some((s - 1, act_tag(i))),
            Op::Backward(i) if s + 1 < k => Some((s + 1, grad_tag(i))),
            _ => None,
        };
        let received = match (outbox.take(), need) {
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
                live += 1;
                report.max_live = report.max_live.max(live);
                if s + 1 < k {
                    if out.len() != act_len {
                        return Err(PipeError::Stage {
                            stage: s,
                            op,
                            msg: format!("produced {} values, the pipeline passes {act_len}", out.len()),
                        });
                    }
                    outbox = Some((out, s + 1, act_tag(i)));
                } else {
                    report.losses.push(out.first().copied().unwrap_or(f32::NAN));
                }
            }
            Op::Backward(i) => {
                let g = work.backward(i, received).map_err(fail)?;
                live -= 1;
                if s > 0 {
                    if g.len() != act_len {
                        return Err(PipeError::Stage {
                            stage: s,
                            op,
                            msg: format!("produced an input gradient of {} values, expected {act_len}", g.len()),
                        });
                    }
                    outbox = Some((g, s - 1, grad_tag(i)));
                }
            }
            Op::Update(_) => unreachable!("handled above"),
        }
        let end = Instant::now();
        report.busy_ms += end.duration_since(start).as_secs_f64() * 1e3;
        report.spans.push((op, ms(start), ms(end)));
    }
    if let Some((data, to, tag)) = outbox {
        comm.send(BufRef::from(&data[..]), Rank(to), tag)?;
        report.bytes_sent += data.len() * 4;
    }
    report.total_ms = ms(Instant::now());
    Ok(report)
}
