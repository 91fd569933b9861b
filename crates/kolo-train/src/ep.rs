//! Expert-parallel training of a mixture-of-experts GPT (`[model] experts = E`, `[mesh] ep = P`):
//! every rank is a data-parallel replica with its own data shard; within each group of P
//! consecutive ranks the experts of every MoE block are dealt out E / P per rank, and tokens go
//! to their expert's rank and back with all-to-all (see `kolo_tensor::models::moe`). Gradients of
//! the parameters outside the experts are averaged over every rank; an expert's gradient already
//! sums the contributions of all tokens its group routed to it, so it is summed over the groups
//! (ranks holding the same experts) and divided by the world size: the mean over every rank's
//! loss, as DDP with every expert on every rank computes it.

use crate::trainer::{finish_whole_gpt, gpt_loop_start, lead_say, optimizer_step, replica_batches, RunOptions, Summary};
use crate::TrainError;
use kolo_base::{Exchange, Rng};
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};
use kolo_optim::{clip_factor, lr_at, sum_of_squares, Optimizer};
use kolo_tensor::models::{Gpt, MoeLoad};
use kolo_tensor::{Model, PlainView};
use std::sync::Arc;
use std::time::Instant;

/// A communicator as the expert-parallel exchange.
pub struct CommExchange(pub Arc<dyn Communicator>);

impl Exchange for CommExchange {
    fn rank(&self) -> usize {
        self.0.rank().get()
    }
    fn size(&self) -> usize {
        self.0.world_size().get()
    }
    fn all_to_all(&self, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize]) -> Result<(), String> {
        self.0.all_to_all(BufRef::from(send), send_counts, BufMut::from(recv), recv_counts).map_err(|e| e.to_string())
    }
}

/// Sums routing counts over `comm` (every rank's tokens).
pub(crate) fn reduce_load(load: Option<MoeLoad>, comm: &dyn Communicator) -> Result<Option<MoeLoad>, TrainError> {
    let Some(l) = load else { return Ok(None) };
    let mut v: Vec<f64> = l.load.iter().map(|&x| x as f64).chain([l.dropped as f64, l.assigned as f64]).collect();
    comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
    let n = l.load.len();
    Ok(Some(MoeLoad { load: v[..n].iter().map(|&x| x as u64).collect(), dropped: v[n] as u64, assigned: v[n + 1] as u64 }))
}

/// `comm`: every rank; `ep`: this rank's expert-parallel group; `rep`: the ranks holding the
/// same experts as this one (one per expert-parallel group).
pub fn run_expert_parallel(
    cfg: &crate::config::Config,
    comm: &dyn Communicator,
    ep: Arc<dyn Communicator>,
    rep: Arc<dyn Communicator>,
    opts: &RunOptions,
) -> Result<Summary, TrainError> {
    let (rank, world) = (comm.rank().get(), comm.world_size().get());
    let say = lead_say(rank == 0 && !opts.quiet);
    let tc = &cfg.train;
    let (data, heap_before, gcfg) = gpt_loop_start(cfg, &[comm, &*ep, &*rep], rank)?;
    let ep_size = ep.world_size().get();
    let gpt = Gpt::new_expert_parallel(gcfg.clone(), &mut Rng::new(tc.seed), Arc::new(CommExchange(ep)))?;
    let expert = gpt.expert_params().expect("an expert-parallel model");
    let numel = gpt.params().numel();
    let mut opt = Optimizer::new(cfg.optimizer(), numel);
    let experts = gcfg.moe.as_ref().map_or(0, |m| m.experts);
    say(&format!(
        "kolo train (expert parallel): MoE GPT {} params ({numel} on each rank), {experts} experts per block dealt over {ep_size} ranks ({} each) x {} groups, top-{} routing",
        gpt.full_numel(),
        experts / ep_size,
        world / ep_size,
        gcfg.moe.as_ref().map_or(0, |m| m.top_k)
    ));
    // The flat ranges of the parameters outside the experts, and of this rank's experts.
    let (mut shared, mut mine) = (Vec::new(), Vec::new());
    for (i, p) in gpt.params().iter().enumerate() {
        if expert[i] { &mut mine } else { &mut shared }.push(p.range.clone());
    }
    let gather = |g: &[f32], rs: &[std::ops::Range<usize>]| -> Vec<f32> { rs.iter().flat_map(|r| g[r.clone()].iter().copied()).collect() };
    let scatter = |v: &[f32], rs: &[std::ops::Range<usize>], g: &mut [f32]| {
        let mut o = 0;
        for r in rs {
            g[r.clone()].copy_from_slice(&v[o..o + r.len()]);
            o += r.len();
        }
    };
    let batches = replica_batches(cfg, data.train.clone(), rank, world, 0)?;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let te = kolo_tensor::TensorError::from;
    let mut grads = vec![0f32; numel];
    let mut report = crate::report::Reporter::new(cfg, comm.rank().get(), opts.quiet, cfg.data.batch_size * world, 0)?;
    kolo_base::alloc::reset_peak();
    let mut heap_after = None;
    for step in 0..end {
        let t0 = Instant::now();
        let lr = lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        let (pos, batch) = batches.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?;
        let loss = gpt.loss(&batch, &PlainView)?;
        let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
        let g = loss.backward().map_err(te)?;
        gpt.params().grads_into(&g, &mut grads)?;
        drop((g, loss));
        let mut s = gather(&grads, &shared);
        comm.all_reduce(BufMut::from(&mut s[..]), ReduceOp::Avg)?;
        scatter(&s, &shared, &mut grads);
        let mut e = gather(&grads, &mine);
        rep.all_reduce(BufMut::from(&mut e[..]), ReduceOp::Sum)?;
        e.iter_mut().for_each(|x| *x /= world as f32);
        scatter(&e, &mine, &mut grads);
        if let Some(max) = cfg.optim.clip_grad_norm {
            // Shared parameters counted once, every expert once (its replicas share the sum).
            let own_shared = if rank == 0 { sum_of_squares(&s) } else { 0.0 };
            let own_experts = if rep.rank().get() == 0 { sum_of_squares(&e) } else { 0.0 };
            let mut sq = [own_shared + own_experts];
            comm.all_reduce(BufMut::from(&mut sq[..]), ReduceOp::Sum)?;
            let f = clip_factor(sq[0].sqrt(), max);
            grads.iter_mut().for_each(|x| *x *= f);
        }
        optimizer_step(gpt.params(), &mut opt, &grads, lr)?;
        heap_after = kolo_base::alloc::stats();
        let step_ms = t0.elapsed().as_secs_f64() * 1e3;
        report.record(step, crate::report::StepRecord { step_ms, comm_bytes: Some((s.len() + e.len()) * 4), ..Default::default() });
        let done = step + 1;
        if report.is_log_step(done, end) {
            report.window(comm, done, local_loss, lr, pos.epoch, "")?;
        }
    }
    report.finish();
    let moe = reduce_load(gpt.take_moe_load(), comm)?;
    // The whole model on every rank: each expert written by its first holder, the rest by rank 0.
    let mut flat = vec![0f32; gpt.full_numel()];
    gpt.ep_pieces_into(&gpt.params().to_flat()?, &mut flat, rep.rank().get() == 0, rank == 0)?;
    comm.all_reduce(BufMut::from(&mut flat[..]), ReduceOp::Sum)?;
    finish_whole_gpt(cfg, &gcfg, &data, &say, rank == 0, end, &mut report, flat, numel, &opt, (heap_before, heap_after), moe)
}
