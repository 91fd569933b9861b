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
//!
//! On the driver ([`ScheduledDdp`]): a step returns when backward ends, its exchange and
//! updates still running; evaluation, sampling, checkpoints and the end first wait until every
//! parameter has the updates of every step begun (`ScheduledDdp::settle`). The optimizer
//! state and the parameters are then the same as plain DDP's, so checkpoints are plain DDP's
//! (rank 0 writes them) and continue under either.

use crate::checkpointing::{load_checkpoint, PendingSave};
use crate::config::Config;
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, Batches, Finish, SaveAt, StepCtx, StepOut, Strategy};
use crate::eval::{evaluate, sample_text};
use crate::setup::{lead_say, load_data, optimizer_for, spec_string};
use crate::summary::{replicated_states, Eval, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::GradSink;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::comm_schedule::{chunk_params, chunk_plan, param_chunks, pick_round};
use kolo_optim::Optimizer;
use kolo_tensor::{build_model, HookedView, Model, ModelSpec, ParamSet, ParamView, PlainView};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct State {
    /// This step's gradients, flat (written by the hooks, read by the scheduler).
    grads: Vec<f32>,
    /// Which parameters' gradients of the current step have arrived.
    arrived: Vec<bool>,
    /// Updates applied to each parameter (= steps whose update it has).
    updated: Vec<u64>,
    /// Steps the training thread has begun, and the learning rate of the last one.
    began: u64,
    lr: f32,
    /// The scheduler's failure, for the training thread to report.
    error: Option<String>,
    /// The training thread is gone: the scheduler stops at its next wait.
    stop: bool,
    /// Seconds the scheduler spent in gradient collectives, and the training thread waiting
    /// for updates, since the last step was recorded.
    comm_s: f64,
    wait_s: f64,
    /// The scheduler's collectives since the last step was recorded (for the timeline).
    spans: Vec<(String, Instant, Instant)>,
}

struct Sched {
    state: Mutex<State>,
    /// The optimizer: the scheduler's while a step runs, the training thread's once settled.
    opt: Mutex<Optimizer>,
    cv: Condvar,
    ranges: Vec<Range<usize>>,
    timeout: Duration,
    rank: usize,
}

impl Sched {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn opt(&self) -> std::sync::MutexGuard<'_, Optimizer> {
        self.opt.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until `ready(state)`, a failure, or the deadline (`what` names the wait).
    fn wait<'a>(
        &'a self,
        mut g: std::sync::MutexGuard<'a, State>,
        deadline: Option<Duration>,
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
            let left = match deadline {
                Some(d) => d.checked_sub(start.elapsed()).ok_or_else(|| {
                    format!("rank {}: scheduled DDP: {} did not happen within {:.1} s", self.rank, what(), d.as_secs_f64())
                })?,
                None => Duration::from_secs(1),
            };
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
            .wait(g, Some(self.sched.timeout), &|| format!("the update of parameter {i} for step {need}"), |s| s.updated[i] >= need)
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

/// The scheduler thread: steps `start..end`; each begins when the training thread starts its
/// forward pass (so evaluation and checkpoints between steps take as long as they need) and
/// runs rounds until every chunk is reduced and every parameter updated.
fn schedule_loop(
    sched: &Sched,
    comm: &dyn Communicator,
    params: &ParamSet,
    (chunk, credit): (usize, usize),
    steps: Range<u64>,
) -> Result<(), String> {
    let numel = sched.ranges.last().map_or(0, |r| r.end);
    let plan = chunk_plan(numel, chunk);
    let pchunks = param_chunks(&sched.ranges, chunk);
    let cparams = chunk_params(&pchunks, plan.len());
    let n = comm.world_size().get() as f32;
    let mut packed = Vec::with_capacity(credit.max(chunk));
    let mut reduced = vec![0f32; numel];
    for step in steps {
        // No deadline here: the training thread's own waits and collectives have theirs, and
        // it sets `stop` when it leaves.
        let lr = sched.wait(sched.lock(), None, &|| String::new(), |s| s.began > step)?.lr;
        let mut done = vec![false; plan.len()];
        let mut left = plan.len();
        let mut updated = vec![false; sched.ranges.len()];
        sched.opt().begin_step();
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
                let all_local = local.iter().all(|&v| v == 1);
                let _g = sched.wait(sched.lock(), Some(sched.timeout), &|| format!("a gradient of step {step}"), |s| {
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
            {
                let mut g = sched.lock();
                g.comm_s += t.elapsed().as_secs_f64();
                g.spans.push((format!("all_reduce {} chunk(s)", round.len()), t, Instant::now()));
            }
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
            let mut opt = sched.opt();
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

/// Scheduled DDP on the driver: the training thread's steps, the scheduler thread beside them.
pub struct ScheduledDdp<'a, 's> {
    cfg: &'a Config,
    comm: Arc<dyn Communicator>,
    model: &'a dyn Model,
    spec: ModelSpec,
    sched: Arc<Sched>,
    worker: Option<std::thread::ScopedJoinHandle<'s, Result<(), String>>>,
    meta: BTreeMap<String, String>,
    /// Steps this process has started (the first one's hidden fraction includes the start).
    started: u64,
}

/// Trains with scheduled DDP on this rank of `comm`, from `resume` when given.
pub fn run_scheduled(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions, resume: Option<&Path>) -> Result<Summary, TrainError> {
    let (rank, world) = (comm.rank().get(), comm.world_size().get());
    let tc = &cfg.train;
    let (chunk, credit) =
        cfg.comm_schedule().map_err(TrainError::Config)?.ok_or_else(|| TrainError::Config("ddp.schedule is not set".into()))?;
    let timeout = Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    comm.set_timeout(timeout);
    let data = load_data(cfg, rank)?;
    let heap_before = kolo_base::alloc::stats().map(|h| h.live);
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, tc.seed)?;
    let mut flat = model.params().to_flat()?;
    let numel = flat.len();
    let mut opt = optimizer_for(cfg, numel)?;
    let ranges: Vec<Range<usize>> = model.params().iter().map(|p| p.range.clone()).collect();
    crate::param_groups::apply(&mut opt, &model.params().signature(), &ranges, None, &cfg.optim).map_err(TrainError::Config)?;
    let meta = checkpoint_meta(cfg, &spec, world, 0);
    // Same start everywhere: rank 0's values, as plain DDP, or the checkpoint every rank reads.
    let start = match resume {
        Some(path) => Some((path.to_path_buf(), load_checkpoint(path, model.params(), &mut flat, &mut opt, None, &ranges, &meta)?)),
        None => {
            comm.broadcast(BufMut::from(&mut flat[..]), kolo_base::Rank(0))?;
            None
        }
    };
    model.params().load(&flat)?;
    drop(flat);
    let first = start.as_ref().map_or(0, |s| s.1.step);
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let sched_comm = comm
        .new_group(&(0..world).map(kolo_base::Rank).collect::<Vec<_>>())?
        .ok_or_else(|| TrainError::Other("the scheduler's group left this rank out".into()))?;
    sched_comm.set_timeout(timeout);
    lead_say(rank == 0 && !opts.quiet)(&format!(
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
            updated: vec![first; ranges.len()],
            began: first,
            lr: 0.0,
            error: None,
            stop: false,
            comm_s: 0.0,
            wait_s: 0.0,
            spans: Vec::new(),
        }),
        opt: Mutex::new(opt),
        cv: Condvar::new(),
        ranges,
        timeout,
        rank,
    });
    let params = model.params();
    std::thread::scope(|sc| {
        let worker = {
            let (sched, comm) = (&*sched, &*sched_comm);
            sc.spawn(move || {
                let r = schedule_loop(sched, comm, params, (chunk, credit), first..end);
                if let Err(e) = &r {
                    sched.lock().error.get_or_insert_with(|| e.clone());
                    sched.cv.notify_all();
                }
                r
            })
        };
        // Stops the scheduler thread however the driver ends (normally or on an error).
        let _stop = StopOnDrop(&sched);
        let mut s =
            ScheduledDdp { cfg, comm: comm.clone(), model: &*model, spec, sched: sched.clone(), worker: Some(worker), meta, started: 0 };
        crate::driver::drive(cfg, opts, crate::driver::Job::Ranks(&*comm), &data, heap_before, &mut s, start)
    })
}

impl ScheduledDdp<'_, '_> {
    /// Waits until every parameter has the update of every step begun so far (before the model
    /// is read whole: evaluation, sampling, checkpoints, the end).
    fn settle(&self) -> Result<(), TrainError> {
        let g = self.sched.lock();
        let began = g.began;
        let g = self
            .sched
            .wait(g, Some(self.sched.timeout), &|| format!("the update of step {began}"), |s| s.updated.iter().all(|&u| u >= s.began));
        drop(g.map_err(TrainError::Other)?);
        Ok(())
    }
}

impl Strategy for ScheduledDdp<'_, '_> {
    fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        let te = kolo_tensor::TensorError::from;
        let batch = data.next_batch()?;
        {
            let mut g = self.sched.lock();
            (g.began, g.lr) = (ctx.step + 1, ctx.lr);
        }
        self.sched.cv.notify_all();
        let view = AwaitView { sched: self.sched.clone(), hooked: HookedView::new(Arc::new(Hooks(self.sched.clone()))), need: ctx.step };
        let loss = self.model.loss(&batch, &view)?;
        let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
        loss.backward().map_err(te)?;
        let mut out = StepOut { loss: local_loss, backward_end: Some(Instant::now()), ..Default::default() };
        out.rec.comm_bytes = Some(self.sched.ranges.last().map_or(0, |r| r.end) * 4);
        // This step's forward waited for the previous step's updates; the communication it did
        // not wait for was hidden (not counted on the first step, which includes the start).
        let mut g = self.sched.lock();
        out.rec.wait_ms = Some(g.wait_s * 1e3);
        if g.comm_s > 0.0 && self.started > 0 {
            out.rec.hidden = Some((1.0 - g.wait_s / g.comm_s).clamp(0.0, 1.0));
        }
        (g.comm_s, g.wait_s) = (0.0, 0.0);
        out.comm_spans = std::mem::take(&mut g.spans);
        self.started += 1;
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        self.settle()?;
        evaluate(self.model, &PlainView, ds, &*self.comm, self.cfg.data.batch_size, max_batches, false, &|| Ok(())).map(Some)
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        self.settle()?;
        let ModelSpec::Gpt(g) = &self.spec else { return Ok(None) };
        if self.comm.rank().get() != 0 {
            return Ok(None);
        }
        let tc = &self.cfg.train;
        sample_text(self.model, &PlainView, vocab, g.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(())).map(Some)
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        self.settle()?;
        let opt = self.sched.opt();
        at.replicated(&self.meta, self.model.params(), &opt, &*self.comm)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        self.settle()?;
        let worker = self.worker.take().ok_or_else(|| TrainError::Other("scheduled DDP finished twice".into()))?;
        worker.join().map_err(|_| TrainError::Other("the scheduler thread panicked".into()))?.map_err(TrainError::Other)?;
        let params = self.model.params().to_flat()?;
        let opt = self.sched.opt();
        // The hooks' gradient buffer and the scheduler's reduced copy: two gradients' worth.
        let states = StateBytes { grads: params.len() as u64 * 8, ..replicated_states(params.len(), &opt) };
        Ok(Finish { params, states, skipped_steps: 0, loss_scale: None, moe: None, pipeline_bubble: None, ps: None })
    }
}
