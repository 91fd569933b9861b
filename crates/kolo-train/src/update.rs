//! The data-parallel update: after backward, wait for the gradient buckets, let the caller
//! check, unscale and clip them, and step the optimizer, on the whole model (DDP) or on this
//! rank's shard (ZeRO-1/2/3), then gather the updated shards back into the model. The CLI's
//! loop and the library's [`Trainer`](../../kolo/struct.Trainer.html) share it.

use crate::TrainError;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::{BucketGrads, Ddp, ShardPlan, Sharding, SyncStats};
use kolo_optim::{clip_factor, Buffer, LossScaler, Optimizer};
use kolo_tensor::ParamSet;

/// Looks at the reduced gradients before the step (the whole gradient, or with `sharded` this
/// rank's pieces only): scales them in place for unscaling and clipping; `false` skips the step
/// (an f16 overflow).
pub type Prepare<'a> = &'a mut dyn FnMut(&mut BucketGrads<'_>, bool) -> Result<bool, TrainError>;

/// Waits for this step's buckets and applies the optimizer step. `zero` is this rank's shard
/// plan under ZeRO and `master` its master copy of the shard (ZeRO-1/2; under ZeRO-3 the DDP
/// engine holds it). Returns the communication timings and whether the step was applied.
pub fn apply_update(
    ddp: &Ddp,
    params: &ParamSet,
    opt: &mut Optimizer,
    zero: Option<&ShardPlan>,
    master: &mut Buffer,
    lr: f32,
    prepare: Prepare<'_>,
) -> Result<(SyncStats, bool), TrainError> {
    let sharding = ddp.sharding();
    let zero3 = sharding == Sharding::Parameters;
    let (stats, applied) = match (zero, sharding) {
        (None, _) => {
            let (stats, mut g) = ddp.finish_buckets()?;
            // Gradients are identical on every rank after the all-reduce: the local norm is global.
            let apply = prepare(&mut g, false)?;
            if apply {
                opt.begin_step();
                for (i, r) in ddp.ranges().iter().enumerate() {
                    params.update_one(i, &mut |v| opt.update(r.start, v, g.param(i), lr))?;
                }
            }
            (stats, apply)
        }
        (Some(plan), Sharding::OptimizerState) => {
            // ZeRO-1: all-reduced gradients (the same on every rank, so is the norm); this rank
            // updates its shard only.
            let (stats, mut g) = ddp.finish_buckets()?;
            let apply = prepare(&mut g, false)?;
            if apply {
                opt.begin_step();
                for seg in &plan.segments {
                    let at = seg.shard_offset..seg.shard_offset + seg.within.len();
                    opt.update(at.start, &mut master.as_mut_slice()[at.clone()], &g.param(seg.param)[seg.within.clone()], lr);
                    master.release(at);
                }
            }
            (stats, apply)
        }
        (Some(plan), _) => {
            // ZeRO-2/3: this rank only ever received its pieces of the gradients.
            let (stats, mut g) = ddp.finish_shard()?;
            let apply = prepare(&mut g, true)?;
            if apply {
                opt.begin_step();
                let pieces = plan.pieces.iter().map(|p| (p.bucket, p.shard_offset..p.shard_offset + p.in_bucket.len()));
                let mut step = |b: usize, at: std::ops::Range<usize>, m: &mut [f32]| opt.update(at.start, &mut m[at], g.piece(b), lr);
                if zero3 {
                    ddp.with_master(|m| pieces.for_each(|(b, at)| step(b, at, m)));
                } else {
                    for (b, at) in pieces {
                        step(b, at.clone(), master.as_mut_slice());
                        master.release(at);
                    }
                }
            }
            (stats, apply)
        }
    };
    if zero3 {
        // Gathers started before this update hold old values.
        ddp.drop_prefetched()?;
    }
    if zero.is_some() && applied {
        // Everyone gathers everyone's updated shard straight into the model (under ZeRO-3 only
        // the parameters outside the sharded groups).
        let load = |i: usize, v: &[f32]| params.load_one(i, v).map_err(TrainError::from);
        if zero3 {
            ddp.with_master(|m| ddp.all_gather_params(m, load))?;
        } else {
            ddp.all_gather_params(master.as_slice(), load)?;
        }
        master.release_all();
    }
    Ok((stats, applied))
}

/// What happens to the reduced gradients before the optimizer step, for the CLI's loop and
/// the library's `Trainer` alike: f16's loss scale divided out (and a step whose gradients
/// overflowed on any rank skipped on every rank), then clipping to a global norm.
pub struct GradPrep<'a> {
    /// The data-parallel group (sums of a sharded norm, the overflow flag).
    pub comm: &'a dyn Communicator,
    /// `optim.clip_grad_norm`.
    pub clip: Option<f64>,
    /// f16's dynamic loss scale.
    pub scaler: Option<&'a mut LossScaler>,
    /// Tensor parallelism: which parameters are split over the group (their squares are summed
    /// over it; the replicated ones counted once, by member 0), and the group.
    pub tp: Option<(&'a [bool], &'a dyn kolo_base::GroupSum)>,
    /// Test hook: this rank's gradients overflow.
    pub inject_inf: bool,
    /// `train.on_nonfinite = "skip"`: a step whose gradients hold a NaN or an infinity on any
    /// rank is skipped on every rank.
    pub skip_nonfinite: bool,
    /// The global gradient norm (before clipping, unscaled) of the last step, when clipping.
    pub norm: Option<f64>,
}

impl GradPrep<'_> {
    /// Unscales, checks and clips `g` (with `sharded`, this rank's pieces only, so the norm is
    /// a sum over the ranks). `false`: skip the step (an f16 overflow).
    pub fn run(&mut self, g: &mut BucketGrads<'_>, sharded: bool) -> Result<bool, TrainError> {
        if self.inject_inf {
            g.scale(f32::INFINITY);
        }
        if self.clip.is_none() && self.scaler.is_none() && !self.skip_nonfinite {
            return Ok(true);
        }
        let inv = self.scaler.as_ref().map_or(1.0, |s| 1.0 / s.scale());
        let mut sq = [match self.tp {
            Some((split, group)) if self.clip.is_some() => {
                let mut v = [(0..split.len())
                    .filter(|&i| split[i] || group.rank() == 0)
                    .map(|i| kolo_base::sum_of_squares(g.param_part(i)))
                    .sum::<f64>() as f32];
                group.sum(&mut v).map_err(TrainError::Other)?;
                f64::from(v[0])
            }
            _ => g.sum_of_squares(),
        }];
        if sharded && self.clip.is_some() {
            self.comm.all_reduce(BufMut::from(&mut sq[..]), ReduceOp::Sum)?;
        }
        if self.scaler.is_some() || self.skip_nonfinite {
            // Every rank skips, or none does (a tensor-parallel group's members too: each
            // looked at its own pieces).
            let mut bad = [u8::from(!sq[0].is_finite())];
            self.comm.all_reduce(BufMut::from(&mut bad[..]), ReduceOp::Max)?;
            if let Some((_, group)) = self.tp.filter(|_| self.clip.is_none()) {
                let mut any = [f32::from(bad[0])];
                group.sum(&mut any).map_err(TrainError::Other)?;
                bad[0] = u8::from(any[0] > 0.0);
            }
            let skip = match self.scaler.as_mut() {
                Some(s) => !s.update(bad[0] == 1),
                None => bad[0] == 1,
            };
            if skip {
                return Ok(false);
            }
        }
        let norm = sq[0].sqrt() * inv;
        self.norm = self.clip.map(|_| norm);
        let f = f64::from(self.clip.map_or(1.0, |max| clip_factor(norm, max))) * inv;
        if f != 1.0 {
            g.scale(f as f32);
        }
        Ok(true)
    }
}

/// A local step (local SGD, or no exchange at all): this rank's own accumulated gradient, taken
/// from the engine into `grads`, clipped by its own norm, updates its own model. Returns that
/// norm when clipping. With `group` (a model split over ranks: which parameters are split, and
/// the ranks of one replica) the norm is the replica's, as [`GradPrep`]'s; with `sp` (a
/// sequence-parallel group, whose members hold the chunks of the same sequences) the gradients
/// are averaged over it first.
#[allow(clippy::too_many_arguments)]
pub fn apply_local(
    ddp: &Ddp,
    params: &ParamSet,
    opt: &mut Optimizer,
    grads: &mut [f32],
    clip: Option<f64>,
    group: Option<(&[bool], &dyn kolo_base::GroupSum)>,
    sp: Option<&dyn Communicator>,
    lr: f32,
) -> Result<Option<f64>, TrainError> {
    ddp.take_accumulated(grads);
    if let Some(sp) = sp {
        sp.all_reduce(BufMut::from(&mut grads[..]), ReduceOp::Avg)?;
    }
    let mut norm = None;
    if let Some(max) = clip {
        let n = match group {
            Some((split, group)) => {
                let mine = ddp.ranges().iter().enumerate().filter(|&(i, _)| split[i] || group.rank() == 0);
                let mut v = [mine.map(|(_, r)| kolo_base::sum_of_squares(&grads[r.clone()])).sum::<f64>() as f32];
                group.sum(&mut v).map_err(TrainError::Other)?;
                f64::from(v[0]).sqrt()
            }
            None => kolo_base::sum_of_squares(grads).sqrt(),
        };
        norm = Some(n);
        let f = clip_factor(n, max);
        grads.iter_mut().for_each(|g| *g *= f);
    }
    opt.begin_step();
    for (i, r) in ddp.ranges().iter().enumerate() {
        params.update_one(i, &mut |v| opt.update(r.start, v, &grads[r.clone()], lr))?;
    }
    Ok(norm)
}
