//! Sequence-parallel training of the GPT (`[mesh] sp = P`): the ranks of a sequence-parallel
//! group read the same sequences and each computes one contiguous chunk of every sequence;
//! attention passes key/value blocks around the group's ring. Parameters are replicated: each
//! rank's loss is the mean over its chunk, so averaging the gradients over every rank (all
//! chunks of all data-parallel replicas) gives the gradient of the whole batch's mean loss.

use crate::trainer::{finish_whole_gpt, gpt_loop_start, lead_say, optimizer_step, replica_batches, RunOptions, Summary};
use crate::TrainError;
use kolo_base::{Rank, RingShift, Rng};
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};
use kolo_optim::{clip_factor, lr_at, sum_of_squares, Optimizer};
use kolo_tensor::models::Gpt;
use kolo_tensor::{Batch, Input, Model, PlainView};
use std::sync::Arc;
use std::time::Instant;

/// The sequence-parallel group as a ring.
struct CommRing(Arc<dyn Communicator>);

const RING_TAG: u32 = 0x5E9;

impl RingShift for CommRing {
    fn rank(&self) -> usize {
        self.0.rank().get()
    }
    fn size(&self) -> usize {
        self.0.world_size().get()
    }
    fn shift(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String> {
        let (r, n) = (self.rank(), self.size());
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.0
            .send_recv(BufRef::from(send), Rank((r + 1) % n), RING_TAG, BufMut::from(recv), Rank((r + n - 1) % n), RING_TAG)
            .map_err(|e| e.to_string())
    }
}

/// Chunk `r` of `n` of every sequence of a batch (tokens and targets).
pub fn sequence_chunk(batch: &Batch, r: usize, n: usize) -> Result<Batch, TrainError> {
    let Input::Tokens { ids, b, t } = &batch.input else {
        return Err(TrainError::Config("sequence parallelism takes token sequences".into()));
    };
    if n == 0 || t % n != 0 {
        return Err(TrainError::Config(format!("sequences of {t} tokens do not split into {n} equal chunks (mesh.sp)")));
    }
    let c = t / n;
    let pick = |v: &[u32]| -> Vec<u32> { (0..*b).flat_map(|s| v[s * t + r * c..s * t + (r + 1) * c].iter().copied()).collect() };
    Ok(Batch { input: Input::Tokens { ids: pick(ids), b: *b, t: c }, targets: pick(&batch.targets) })
}

/// `comm`: every rank of the job (gradients are averaged over all of them); `sp`: this rank's
/// sequence-parallel group; `(dp_rank, dp_size)`: its data-parallel replica.
pub fn run_sequence_parallel(
    cfg: &crate::config::Config,
    comm: &dyn Communicator,
    sp: Arc<dyn Communicator>,
    dp_rank: usize,
    dp_size: usize,
    opts: &RunOptions,
) -> Result<Summary, TrainError> {
    let global_rank = comm.rank().get();
    let say = lead_say(global_rank == 0 && !opts.quiet);
    let tc = &cfg.train;
    let (data, heap_before, gcfg) = gpt_loop_start(cfg, &[comm, &*sp], dp_rank)?;
    let (sp_rank, sp_size) = (sp.rank().get(), sp.world_size().get());
    let mut gpt = Gpt::new(gcfg.clone(), &mut Rng::new(tc.seed))?;
    gpt.set_sequence_parallel(Arc::new(CommRing(sp)))?;
    let numel = gpt.params().numel();
    let mut opt = Optimizer::new(cfg.optimizer(), numel);
    say(&format!(
        "kolo train (sequence parallel): GPT {numel} params, sequences of {} split into {sp_size} chunks of {} (ring attention) x {dp_size} data-parallel replicas",
        gcfg.seq,
        gcfg.seq / sp_size,
    ));
    let batches = replica_batches(cfg, data.train.clone(), dp_rank, dp_size, 0)?;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let te = kolo_tensor::TensorError::from;
    let mut grads = vec![0f32; numel];
    let mut report = crate::report::Reporter::new(cfg, comm.rank().get(), opts.quiet, cfg.data.batch_size * dp_size, 0)?;
    kolo_base::alloc::reset_peak();
    let mut heap_after = None;
    for step in 0..end {
        let t0 = Instant::now();
        let lr = lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        let (pos, batch) = batches.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?;
        let chunk = sequence_chunk(&batch, sp_rank, sp_size)?;
        let loss = gpt.loss(&chunk, &PlainView)?;
        let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
        let g = loss.backward().map_err(te)?;
        gpt.params().grads_into(&g, &mut grads)?;
        comm.all_reduce(BufMut::from(&mut grads[..]), ReduceOp::Avg)?;
        if let Some(max) = cfg.optim.clip_grad_norm {
            let f = clip_factor(sum_of_squares(&grads).sqrt(), max);
            grads.iter_mut().for_each(|x| *x *= f);
        }
        optimizer_step(gpt.params(), &mut opt, &grads, lr)?;
        heap_after = kolo_base::alloc::stats();
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        report.record(step, crate::report::StepRecord { step_ms, comm_bytes: Some(numel * 4), ..Default::default() });
        let done = step + 1;
        if report.is_log_step(done, end) {
            report.window(comm, done, local_loss, lr, pos.epoch, "")?;
        }
    }
    report.finish();
    let flat = gpt.params().to_flat()?;
    finish_whole_gpt(cfg, &gcfg, &data, &say, global_rank == 0, end, &mut report, flat, numel, &opt, (heap_before, heap_after), None)
}
