//! The data-parallel update: after backward, wait for the gradient buckets, let the caller
//! check, unscale and clip them, and step the optimizer, on the whole model (DDP) or on this
//! rank's shard (ZeRO-1/2/3), then gather the updated shards back into the model. The CLI's
//! loop and the library's [`Trainer`](../../kolo/struct.Trainer.html) share it.

use crate::TrainError;
use kolo_ddp::{BucketGrads, Ddp, ShardPlan, Sharding, SyncStats};
use kolo_optim::{Buffer, Optimizer};
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
