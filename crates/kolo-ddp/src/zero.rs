//! ZeRO's side of the engine: the gradient shard (stage 2), the all-gather of the updated
//! shards into the model (stages 1-3), and stage 3's master shard, gathers and prefetches.
//! The shard layout itself is the pure plan in [`crate::shard`].

use crate::{BucketGrads, Ddp, DdpError, Shared, SyncStats};
use kolo_base::{Deadline, ParamGather};
use kolo_comm::{BufMut, BufRef, OpKind, Pending};
use std::sync::Arc;

impl Ddp {
    /// Collective (ZeRO): every rank contributes its updated `shard` (its shard-vector layout)
    /// and receives everyone's: `write(i, values)` gets each parameter's complete new values.
    /// Buckets are gathered one after another on the communication thread while earlier ones
    /// are written out.
    pub fn all_gather_params<E: From<DdpError>>(&self, shard: &[f32], write: impl FnMut(usize, &[f32]) -> Result<(), E>) -> Result<(), E> {
        // Under ZeRO-3 the parameter groups stay sharded: they are gathered when used.
        let buckets: Vec<usize> = (0..self.shared.plan.len()).filter(|b| !self.shared.group_bucket.contains(b)).collect();
        self.gather_buckets(&buckets, shard, write)
    }

    /// [`Ddp::all_gather_params`] of every bucket, ZeRO-3's groups included (the whole model,
    /// for a summary or an export).
    pub fn all_gather_everything<E: From<DdpError>>(
        &self,
        shard: &[f32],
        write: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let buckets: Vec<usize> = (0..self.shared.plan.len()).collect();
        self.gather_buckets(&buckets, shard, write)
    }

    /// ZeRO-3: the handle the model gathers its parameter groups through.
    pub fn gatherer(&self) -> Arc<dyn ParamGather> {
        self.shared.clone()
    }

    /// ZeRO-3: sets this rank's master shard (shard-vector layout), the source of gathers.
    pub fn set_master(&self, values: Vec<f32>) {
        *self.shared.master.lock().unwrap_or_else(|p| p.into_inner()) = values;
    }

    /// ZeRO-3: runs `f` on this rank's master shard (the optimizer step, a checkpoint).
    pub fn with_master<R>(&self, f: impl FnOnce(&mut [f32]) -> R) -> R {
        f(&mut self.shared.master.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// ZeRO-3: completes and discards gathers started ahead of use (their values are stale once
    /// the master shard changes). Every rank calls it at the same point.
    pub fn drop_prefetched(&self) -> Result<(), DdpError> {
        let pending: Vec<_> = self.shared.prefetched.lock().unwrap_or_else(|p| p.into_inner()).drain().collect();
        let d = Deadline::after(self.cfg.timeout);
        for (_, p) in pending {
            p.wait(d)?.map_err(|what| DdpError::Usage { rank: self.rank, what })?;
        }
        Ok(())
    }

    fn gather_buckets<E: From<DdpError>>(
        &self,
        buckets: &[usize],
        shard: &[f32],
        mut write: impl FnMut(usize, &[f32]) -> Result<(), E>,
    ) -> Result<(), E> {
        let sh = &self.shared;
        if shard.len() != sh.shard.len {
            return Err(DdpError::Usage {
                rank: self.rank,
                what: format!("all_gather_params: shard has {} values, the plan {}", shard.len(), sh.shard.len),
            }
            .into());
        }
        let d = Deadline::after(self.cfg.timeout);
        // Two buckets in flight: one gathering while the previous one is written out. The
        // output buffers are the gradient buckets when they are kept (DDP, ZeRO-1), else fresh.
        let submit = |b: usize| -> Pending<(usize, Vec<f32>)> {
            let piece = &sh.shard.pieces[b];
            let mine = shard[piece.shard_offset..piece.shard_offset + piece.in_bucket.len()].to_vec();
            let numel = sh.plan[b].numel;
            let out = sh.lock().buffers[b].take();
            sh.comm.submit(OpKind::AllGather, move |c| {
                let mut out = out.unwrap_or_else(|| vec![0f32; numel]);
                c.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut out))?;
                Ok((b, out))
            })
        };
        let nb = buckets.len();
        let mut window: std::collections::VecDeque<Pending<(usize, Vec<f32>)>> = buckets[..nb.min(2)].iter().map(|&b| submit(b)).collect();
        let mut next = window.len();
        let mut failed: Option<E> = None;
        while let Some(p) = window.pop_front() {
            let got = p.wait(d).map_err(DdpError::from);
            if next < nb && got.is_ok() {
                window.push_back(submit(buckets[next]));
                next += 1;
            }
            let (b, buf) = match got {
                Ok(x) => x,
                Err(e) => {
                    failed.get_or_insert(e.into());
                    continue; // drain what is in flight on every rank
                }
            };
            if failed.is_none() {
                for &pi in &sh.plan[b].params {
                    let (_, off) = sh.slot[pi];
                    if let Err(e) = write(pi, &buf[off..off + sh.ranges[pi].len()]) {
                        failed = Some(e);
                        break;
                    }
                }
            }
            if !sh.reduce_scatter {
                sh.lock().buffers[b] = Some(buf);
            }
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if next < nb {
            return Err(DdpError::Usage { rank: self.rank, what: format!("all_gather_params stopped after {next} of {nb} buckets") }.into());
        }
        Ok(())
    }

    /// Like [`Ddp::finish`] under ZeRO-2, without copying: this rank's averaged gradient
    /// pieces stay where the reduce-scatter left them, one per bucket
    /// ([`BucketGrads::piece`]), until the returned value is dropped.
    pub fn finish_shard(&self) -> Result<(SyncStats, BucketGrads<'_>), DdpError> {
        if !self.shared.reduce_scatter {
            return Err(DdpError::Usage {
                rank: self.rank,
                what: "finish_shard: gradients are all-reduced, not sharded; use finish_buckets".into(),
            });
        }
        let (stats, done) = self.wait_buckets()?;
        Ok((
            stats,
            BucketGrads {
                ddp: self,
                bufs: done.into_iter().map(|(_, p)| p.expect("reduce-scattered buckets come back")).collect(),
                pieces: true,
            },
        ))
    }
}

impl Shared {
    /// Queues the all-gather of bucket `b` from this rank's master piece. Each rank's piece
    /// carries the bucket it gathers (one more value): gathers are started by the model's reads,
    /// and ranks whose reads differ would otherwise fill a group with another group of the same
    /// size (identical blocks), silently. The result names the rank that gathered another.
    fn submit_gather(&self, b: usize) -> Pending<crate::Gathered> {
        let piece = &self.shard.pieces[b];
        let mut mine = Vec::with_capacity(piece.in_bucket.len() + 1);
        mine.extend_from_slice(
            &self.master.lock().unwrap_or_else(|p| p.into_inner())[piece.shard_offset..piece.shard_offset + piece.in_bucket.len()],
        );
        mine.push(b as f32);
        let numel = self.plan[b].numel;
        self.comm.submit(OpKind::AllGather, move |c| {
            let world = c.world_size();
            // Every piece one longer: each rank's shard of numel + world is its shard of numel
            // and its tag (`even_split`).
            let mut out = vec![0f32; numel + world.get()];
            c.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut out))?;
            let (mut at, mut other) = (0, None);
            for (r, range) in kolo_base::even_split(numel + world.get(), world).enumerate() {
                let tag = out[range.end - 1];
                if tag != b as f32 && other.is_none() {
                    other = Some((r, tag));
                }
                out.copy_within(range.start..range.end - 1, at);
                at += range.len() - 1;
            }
            out.truncate(numel);
            Ok(match other {
                None => Ok(out),
                Some((r, tag)) => Err(format!(
                    "this rank gathered parameter bucket {b} while rank {r} gathered bucket {tag}: the ranks read the model's ZeRO-3 groups in different orders (its reads depend on the data)"
                )),
            })
        })
    }
}

impl ParamGather for Shared {
    fn gather(&self, group: usize) -> Result<Vec<f32>, String> {
        let b = *self.group_bucket.get(group).ok_or_else(|| format!("no parameter group {group}"))?;
        let pending = self.prefetched.lock().unwrap_or_else(|p| p.into_inner()).remove(&b);
        let p = pending.unwrap_or_else(|| self.submit_gather(b));
        p.wait(Deadline::after(self.timeout)).map_err(|e| e.to_string())?
    }

    fn prefetch(&self, group: usize) {
        let Some(&b) = self.group_bucket.get(group) else { return };
        let mut m = self.prefetched.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(b).or_insert_with(|| self.submit_gather(b));
    }
}
