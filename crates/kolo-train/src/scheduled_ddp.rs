//! DDP with scheduled communication (`[ddp] schedule`, ByteScheduler): the gradient goes in
//! chunks, first layers first, and each parameter is updated as soon as its gradient is
//! reduced, so the next forward pass overlaps the communication of the layers behind it.
//!
//! Two threads per rank. The training thread runs forward and backward; a parameter view makes
//! forward wait for each parameter's update of the previous step, and gradient hooks hand each
//! gradient over as backward produces it. The scheduler thread, on a communicator of its own
//! (a group of all ranks, so that it never interleaves with the training thread's collectives),
//! repeats rounds: agree with the other ranks on the chunks every rank has ready (an all-reduce
//! of one flag per chunk), reduce the highest-priority of those up to the credit in one
//! all-reduce, and update every parameter whose chunks are now all reduced. The plans are
//! `kolo_ddp::schedule`.
//!
//! One gradient buffer suffices: forward of step t+1 needs every parameter updated with step
//! t's gradient, so backward t+1 (which overwrites it) starts only after step t's last chunk.

use crate::config::Config;
use crate::trainer::{evaluate, lead_say, load_data, replica_batches, spec_string, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::GradSink;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::comm_schedule::{chunk_params, chunk_plan, param_chunks, pick_round};
use kolo_optim::{lr_at, Optimizer};
use kolo_tensor::{build_model, HookedView, ParamSet, ParamView, PlainView};
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct State {
    /// This step's gradients, flat (written by the hooks, read by the scheduler).
    grads: Vec<f32>,
    /// Which parameters' gradients of the current step have arrived.
    arrived: Vec<bool>,
    /// Updates applied to each parameter (= steps whose update it has).
    updated: Vec<u64>,
    /// The scheduler's failure, for the training thread to report.
    error: Option<String>,
    /// The training thread is gone: the scheduler stops at its next wait.
    stop: bool,
    /// Seconds the scheduler spent in gradient collectives, and the training thread waiting
    /// for updates, since the last step was recorded.
    comm_s: f64,
    wait_s: f64,
}

struct Sched {
    state: Mutex<State>,
    cv: Condvar,
    ranges: Vec<Range<usize>>,
    timeout: Duration,
    rank: usize,
}

impl Sched {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready(state)`, a failure, or the deadline (`what` names the wait).
    fn wait<'a>(
        &'a self,
        mut g: std::sync::MutexGuard<'a, State>,
        what: &dyn Fn() -> String,
        ready: impl Fn(&State) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, State>, String> {
        let start = Instant::now();
        while !ready(&g) {
            if let Some(e) = &g.error {
                return Err(e.clone());
            }
            if g.stop {
                return Err("stopped".into());
            }
            let left = self.timeout.checked_sub(start.elapsed()).ok_or_else(|| {
                format!("rank {}: scheduled DDP: {} did not happen within {:.1} s", self.rank, what(), self.timeout.as_secs_f64())
            })?;
            g = self.cv.wait_timeout(g, left.min(Duration::from_millis(200))).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(g)
    }
}

struct Hooks(Arc<Sched>);

impl GradSink for Hooks {
    fn grad_ready(&self, idx: usize, grad: &[f32]) {
        let mut g = self.0.lock();
        let r = self.0.ranges[idx].clone();
        g.grads[r].copy_from_slice(grad);
        g.arrived[idx] = true;
        drop(g);
        self.0.cv.notify_all();
    }
}

/// Hands out parameter `i` once it has `need` updates; gradients go to the scheduler.
struct AwaitView {
    sched: Arc<Sched>,
    hooked: HookedView,
    need: u64,
}

impl ParamView for AwaitView {
    fn get(&self, params: &ParamSet, i: usize) -> kolo_tensor::Result<kolo_tensor::Tensor> {
        let t = Instant::now();
        let g = self.sched.lock();
        let need = self.need;
        let mut g = self
            .sched
            .wait(g, &|| format!("the update of parameter {i} for step {need}"), |s| s.updated[i] >= need)
            .map_err(kolo_tensor::TensorError::Input)?;
        g.wait_s += t.elapsed().as_secs_f64();
        drop(g);
        self.hooked.get(params, i)
    }
}

/// Stops the scheduler thread when the training thread leaves (normally or on an error).
struct StopOnDrop<'a>(&'a Sched);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.cv.notify_all();
    }
}

/// The scheduler thread: steps `start..end`, rounds until every chunk is reduced and every
/// parameter updated. Returns the bytes it reduced per step.
#[allow(clippy::too_many_arguments)]
fn schedule_loop(
    sched: &Sched,
    comm: &dyn Communicator,
    params: &ParamSet,
    opt: &mut Optimizer,
    cfg: &Config,
    (chunk, credit): (usize, usize),
    start: u64,
    end: u64,
) -> Result<(), String> {
    let numel = sched.ranges.last().map_or(0, |r| r.end);
    let plan = chunk_plan(numel, chunk);
    let pchunks = param_chunks(&sched.ranges, chunk);
    let cparams = chunk_params(&pchunks, plan.len());
    let n = comm.world_size().get() as f32;
    let mut packed = Vec::with_capacity(credit.max(chunk));
    let mut reduced = vec![0f32; numel];
    for step in start..end {
        let lr = lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, cfg.train.steps, step);
        let mut done = vec![false; plan.len()];
        let mut left = plan.len();
        let mut updated = vec![false; sched.ranges.len()];
        opt.begin_step();
        while left > 0 {
            // This rank's ready chunks (reduced ones count as ready everywhere).
            let local: Vec<u8> = {
                let g = sched.lock();
                (0..plan.len()).map(|c| u8::from(done[c] || cparams[c].iter().all(|&p| g.arrived[p]))).collect()
            };
            let mut common = local.clone();
            comm.all_reduce(BufMut::from(&mut common[..]), ReduceOp::Min).map_err(|e| e.to_string())?;
            let common: Vec<bool> = common.iter().map(|&v| v == 1).collect();
            let round = pick_round(&common, &done, &plan, credit);
            if round.is_empty() {
                // Nothing ready on every rank: wait for this rank's backward to produce more
                // (a rank with everything ready goes straight back to the agreement, where it
                // waits for the others inside the collective).
                let g = sched.lock();
                let all_local = local.iter().all(|&v| v == 1);
                let _g = sched.wait(g, &|| format!("a gradient of step {step}"), |s| {
                    all_local || (0..plan.len()).any(|c| local[c] == 0 && cparams[c].iter().all(|&p| s.arrived[p]))
                })?;
                continue;
            }
            packed.clear();
            {
                let g = sched.lock();
                for &c in &round {
                    packed.extend_from_slice(&g.grads[plan[c].clone()]);
                }
            }
            let t = Instant::now();
            comm.all_reduce(BufMut::from(&mut packed[..]), ReduceOp::Sum).map_err(|e| e.to_string())?;
            sched.lock().comm_s += t.elapsed().as_secs_f64();
            let mut off = 0;
            for &c in &round {
                let r = plan[c].clone();
                // The mean, as plain DDP's average: the sum over ranks divided by their number.
                reduced[r.clone()].iter_mut().zip(&packed[off..off + r.len()]).for_each(|(d, s)| *d = s / n);
                off += r.len();
                done[c] = true;
                left -= 1;
            }
            // Every parameter whose chunks are all reduced is updated now.
            let mut newly = Vec::new();
            for &c in &round {
                for &p in &cparams[c] {
                    if !updated[p] && pchunks[p].clone().all(|k| done[k]) {
                        updated[p] = true;
                        newly.push(p);
                    }
                }
            }
            newly.sort_unstable();
            for p in newly {
                let r = sched.ranges[p].clone();
                params.update_one(p, &mut |v| opt.update(r.start, v, &reduced[r.clone()], lr)).map_err(|e| e.to_string())?;
                let mut g = sched.lock();
                g.arrived[p] = false;
                g.updated[p] = step + 1;
                drop(g);
                sched.cv.notify_all();
            }
        }
    }
    Ok(())
}

pub fn run_scheduled(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions) -> Result<Summary, TrainError> {
    let (rank, world) = (comm.rank().get(), comm.world_size().get());
    let say = lead_say(rank == 0 && !opts.quiet);
    let tc = &cfg.train;
    let (chunk, credit) =
        cfg.comm_schedule().map_err(TrainError::Config)?.ok_or_else(|| TrainError::Config("ddp.schedule is not set".into()))?;
    let timeout = Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    comm.set_timeout(timeout);
    let data = load_data(cfg, rank)?;
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, tc.seed)?;
    // Same start everywhere (rank 0's values), as plain DDP.
    let mut flat = model.params().to_flat()?;
    comm.broadcast(BufMut::from(&mut flat[..]), kolo_base::Rank(0))?;
    model.params().load(&flat)?;
    let numel = flat.len();
    drop(flat);
    let ranges: Vec<Range<usize>> = model.params().iter().map(|p| p.range.clone()).collect();
    let sched_comm = comm
        .new_group(&(0..world).map(kolo_base::Rank).collect::<Vec<_>>())?
        .ok_or_else(|| TrainError::Other("the scheduler's group left this rank out".into()))?;
    sched_comm.set_timeout(timeout);
    let mut opt = Optimizer::new(cfg.optimizer(), numel);
    say(&format!(
        "kolo train (scheduled DDP): {numel} params, {} on {world} rank(s), {} chunks of {} KiB, credit {} KiB, data: {}",
        spec_string(&spec),
        numel.div_ceil(chunk),
        chunk * 4 / 1024,
        credit * 4 / 1024,
        data.train.describe()
    ));
    let sched = Arc::new(Sched {
        state: Mutex::new(State {
            grads: vec![0f32; numel],
            arrived: vec![false; ranges.len()],
            updated: vec![0; ranges.len()],
            error: None,
            stop: false,
            comm_s: 0.0,
            wait_s: 0.0,
        }),
        cv: Condvar::new(),
        ranges,
        timeout,
        rank,
    });
    let batches = replica_batches(cfg, data.train.clone(), rank, world, 0)?;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let te = kolo_tensor::TensorError::from;
    // The reporter's collectives run on `comm`, never on the scheduler's own group.
    let mut report = crate::report::Reporter::new(cfg, rank, opts.quiet, cfg.data.batch_size * world, 0)?;
    let params = model.params();
    std::thread::scope(|s| -> Result<(), TrainError> {
        let worker = {
            let (sched, opt) = (&*sched, &mut opt);
            let comm = &*sched_comm;
            s.spawn(move || {
                let r = schedule_loop(sched, comm, params, opt, cfg, (chunk, credit), 0, end);
                if let Err(e) = &r {
                    sched.lock().error.get_or_insert_with(|| e.clone());
                    sched.cv.notify_all();
                }
                r
            })
        };
        let stop = StopOnDrop(&sched);
        let mut t_prev = Instant::now();
        for step in 0..end {
            let (pos, batch) = batches.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?;
            let view = AwaitView { sched: sched.clone(), hooked: HookedView::new(Arc::new(Hooks(sched.clone()))), need: step };
            let loss = model.loss(&batch, &view)?;
            let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
            loss.backward().map_err(te)?;
            let now = Instant::now();
            let mut rec = crate::report::StepRecord {
                step_ms: (now - t_prev).as_secs_f64() * 1e3,
                comm_bytes: Some(numel * 4),
                ..Default::default()
            };
            t_prev = now;
            {
                // Communication of the previous step that forward did not wait for was hidden.
                let mut g = sched.lock();
                rec.wait_ms = Some(g.wait_s * 1e3);
                if g.comm_s > 0.0 {
                    rec.hidden = Some((1.0 - g.wait_s / g.comm_s).clamp(0.0, 1.0));
                }
                (g.comm_s, g.wait_s) = (0.0, 0.0);
            }
            report.record(step, rec);
            let done = step + 1;
            if report.is_log_step(done, end) {
                let lr = kolo_optim::lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
                report.window(&*comm, done, local_loss, lr, pos.epoch, "")?;
            }
        }
        // The last step's updates.
        let g = sched.lock();
        let r = sched.wait(g, &|| format!("the last update (step {end})"), |st| st.updated.iter().all(|&u| u >= end));
        drop(r.map_err(TrainError::Other)?);
        drop(stop);
        report.finish();
        worker.join().map_err(|_| TrainError::Other("the scheduler thread panicked".into()))?.map_err(TrainError::Other)
    })?;
    let mut eval = None;
    if end == tc.steps {
        let limit = if data.vocab.is_some() { tc.eval_batches } else { 0 };
        let e = evaluate(&*model, &PlainView, &*data.eval, &*comm, cfg.data.batch_size, limit, false, &|| Ok(()))?;
        report.eval(end, &e, true);
        eval = Some(e);
    }
    Ok(Summary {
        steps_done: end,
        last_loss: report.last_loss,
        eval,
        step_ms: std::mem::take(&mut report.step_ms),
        comm_wait_ms: std::mem::take(&mut report.wait_ms),
        comm_bytes: std::mem::take(&mut report.comm_bytes),
        straggler: report.straggler,
        // The second half: the first steps include the scheduler's start.
        hidden_fraction: {
            let h = &report.hidden;
            h.iter().skip(h.len() / 2).sum::<f64>() / (h.len() - h.len() / 2).max(1) as f64
        },
        params: model.params().to_flat()?,
        sample: None,
        checkpoint: None,
        states: StateBytes {
            params: numel as u64 * 4,
            grads: numel as u64 * 8,
            optimizer: opt.state().iter().map(|(_, v)| v.len() as u64 * 4).sum(),
            offloaded: false,
        },
        peak_rss: crate::trainer::peak_rss(),
        heap: None,
        skipped_steps: 0,
        loss_scale: None,
        ps: None,
        pipeline_bubble: None,
        moe: None,
        batch_split: None,
    })
}
