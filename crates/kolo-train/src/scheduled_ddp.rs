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
//! The library's `Trainer` runs it (`kolo::scheduled`, for a user's model and `kolo train`'s
//! built-in ones): a step returns when backward ends, its exchange and updates still running;
//! every read of a parameter (the next forward, an evaluation, a checkpoint) waits for that
//! parameter's update. The optimizer state and the parameters are then the same as plain
//! DDP's, so checkpoints are plain DDP's (rank 0 writes them) and continue under either.

use crate::TrainError;
use kolo_base::GradSink;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::comm_schedule::{chunk_params, chunk_plan, param_chunks, pick_round};
use kolo_optim::Optimizer;
use kolo_tensor::ParamSet;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct State {
    /// This step's gradients, flat (written by the hooks, read by the scheduler).
    grads: Vec<f32>,
    /// Which parameters' gradients of the current step have arrived.
    arrived: Vec<bool>,
    /// Which parameters' gradients backward delivered in the current step (a parameter the
    /// loss does not reach gets none: [`Scheduler::end_backward`] names it).
    got: Vec<bool>,
    /// Updates applied to each parameter (= steps whose update it has).
    updated: Vec<u64>,
    /// Steps the training thread has begun, and the learning rate of each begun step the
    /// scheduler has not started (`kolo train` begins step t+1 before the scheduler may have
    /// woken for step t: one shared rate gave step t the next step's).
    began: u64,
    lrs: BTreeMap<u64, f32>,
    /// The step the scheduler runs next (= steps whose rounds it has finished).
    next: u64,
    /// The scheduler's failure, for the training thread to report.
    error: Option<String>,
    /// The training thread is gone: the scheduler stops at its next wait.
    stop: bool,
    /// Seconds the scheduler spent in gradient collectives, and the training thread waiting
    /// for updates, since the last step was recorded.
    comm_s: f64,
    wait_s: f64,
    /// The scheduler's collectives since the last step was recorded (for the timeline).
    spans: Spans,
    /// Steps whose times were taken (the first one's communication includes the start).
    timed: u64,
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

/// Named collectives with when each started and ended (a step's, for the timeline).
pub type Spans = Vec<(String, Instant, Instant)>;

/// One step's communication as the training thread saw it.
pub struct StepTimes {
    /// Seconds the training thread waited for updates.
    pub wait_s: f64,
    /// Seconds the scheduler spent in gradient collectives.
    pub comm_s: f64,
    /// Whether the hidden part counts: not on the first step, whose communication includes the
    /// start (both `kolo train` and the library report it as none hidden).
    pub counted: bool,
    /// The scheduler's collectives (for the timeline).
    pub spans: Spans,
}

impl StepTimes {
    /// Seconds of communication the training thread did not wait for.
    pub fn hidden_s(&self) -> f64 {
        if self.counted {
            (self.comm_s - self.wait_s).max(0.0)
        } else {
            0.0
        }
    }

    /// The hidden part as a fraction of the communication (none on an uncounted step).
    pub fn hidden_fraction(&self) -> Option<f64> {
        (self.comm_s > 0.0 && self.counted).then(|| (self.hidden_s() / self.comm_s).clamp(0.0, 1.0))
    }
}

struct Hooks(Arc<Sched>);

impl GradSink for Hooks {
    fn grad_ready(&self, idx: usize, grad: &[f32]) {
        let mut g = self.0.lock();
        let r = self.0.ranges[idx].clone();
        g.grads[r].copy_from_slice(grad);
        g.arrived[idx] = true;
        g.got[idx] = true;
        drop(g);
        self.0.cv.notify_all();
    }
}

thread_local! {
    /// Set on the scheduler thread: its own writes to the variables wait for nothing.
    static ON_SCHEDULER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a scheduler's (whose updates a parameter's read hook lets by).
pub fn on_scheduler_thread() -> bool {
    ON_SCHEDULER.with(std::cell::Cell::get)
}

/// Scheduled DDP's exchange for one rank, beside the training thread of the library's
/// `kolo::Trainer` (a user's candle model, `kolo train`'s built-in ones):
/// the scheduler thread on a group of all ranks of its own, which reduces each step's gradients
/// in prioritised chunks and updates each parameter (its variable, in place) as soon as its
/// chunks are reduced. The training thread begins each step ([`Scheduler::begin`]), hands its
/// gradients over as backward makes them ([`Scheduler::sink`]) and waits for a parameter's
/// update before it reads it ([`Scheduler::await_update`]).
pub struct Scheduler {
    sched: Arc<Sched>,
    names: Vec<String>,
    hooks: Arc<Hooks>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl Scheduler {
    /// Collective over `comm` (its group of all ranks is made here): starts the scheduler for
    /// `params` (f32 variables on the CPU), whose values every rank already holds alike, with
    /// `opt` (the parameters' flat layout), `(chunk, credit)` in f32 elements
    /// ([`crate::Config::comm_schedule`]), from step `first`, every wait bounded by `timeout`.
    pub fn start(
        comm: &dyn Communicator,
        params: &ParamSet,
        opt: Optimizer,
        (chunk, credit): (usize, usize),
        first: u64,
        timeout: Duration,
    ) -> Result<Scheduler, TrainError> {
        let (rank, world) = (comm.rank().get(), comm.world_size().get());
        let group = comm
            .new_group(&(0..world).map(kolo_base::Rank).collect::<Vec<_>>())?
            .ok_or_else(|| TrainError::Other("the scheduler's group left this rank out".into()))?;
        group.set_timeout(timeout);
        let ranges: Vec<Range<usize>> = params.iter().map(|p| p.range.clone()).collect();
        let vars: Vec<candle_core::Var> = params.iter().map(|p| p.var.clone()).collect();
        let numel = params.numel();
        let sched = Arc::new(Sched {
            state: Mutex::new(State {
                grads: vec![0f32; numel],
                arrived: vec![false; ranges.len()],
                got: vec![false; ranges.len()],
                updated: vec![first; ranges.len()],
                began: first,
                lrs: BTreeMap::new(),
                next: first,
                error: None,
                stop: false,
                comm_s: 0.0,
                wait_s: 0.0,
                spans: Vec::new(),
                timed: 0,
            }),
            opt: Mutex::new(opt),
            cv: Condvar::new(),
            ranges,
            timeout,
            rank,
        });
        let s = sched.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kolo-schedule-{rank}"))
            .spawn(move || {
                ON_SCHEDULER.with(|f| f.set(true));
                let r = schedule_loop(&s, &*group, &vars, (chunk, credit));
                if let Err(e) = &r {
                    s.lock().error.get_or_insert_with(|| e.clone());
                    s.cv.notify_all();
                }
                r
            })
            .map_err(|e| TrainError::Other(format!("rank {rank}: could not start the scheduler thread: {e}")))?;
        let names = params.iter().map(|p| p.name.clone()).collect();
        Ok(Scheduler { hooks: Arc::new(Hooks(sched.clone())), sched, names, thread: Some(thread) })
    }

    /// Step `step` (0-based) begins with learning rate `lr`: the scheduler takes its gradients.
    pub fn begin(&self, step: u64, lr: f32) {
        {
            let mut g = self.sched.lock();
            g.began = step + 1;
            g.lrs.insert(step, lr);
            g.got.iter_mut().for_each(|x| *x = false);
        }
        self.sched.cv.notify_all();
    }

    /// Backward of the step begun has returned: a parameter it gave no gradient is an error
    /// naming it (DDP's own), not a wait for a gradient that never comes.
    pub fn end_backward(&self) -> Result<(), String> {
        let g = self.sched.lock();
        let names: Vec<&str> = (0..g.got.len()).filter(|&p| !g.got[p]).map(|p| self.names[p].as_str()).collect();
        if names.is_empty() {
            return Ok(());
        }
        Err(format!(
            "rank {}: parameter(s) {names:?} received no gradient in this backward pass; every parameter must take part in the loss",
            self.sched.rank
        ))
    }

    /// Where backward hands each parameter's gradient (by its index) as it becomes final.
    pub fn sink(&self) -> &dyn GradSink {
        &*self.hooks
    }

    /// Waits until parameter `i` has `need` updates (forward of step `need` reads it), or fails
    /// at the deadline or with the scheduler's error.
    pub fn await_update(&self, i: usize, need: u64) -> Result<(), String> {
        let t = Instant::now();
        let g = self.sched.lock();
        let mut g = self
            .sched
            .wait(g, Some(self.sched.timeout), &|| format!("the update of parameter {i} for step {need}"), |s| s.updated[i] >= need)?;
        g.wait_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Waits until every parameter has the update of every step begun so far (before the model
    /// is read whole: evaluation, checkpoints, the end).
    pub fn settle(&self) -> Result<(), String> {
        let g = self.sched.lock();
        let began = g.began;
        let ready = |s: &State| s.next >= s.began && s.updated.iter().all(|&u| u >= s.began);
        drop(self.sched.wait(g, Some(self.sched.timeout), &|| format!("the update of step {began}"), ready)?);
        Ok(())
    }

    /// After [`Scheduler::settle`]: the run goes on from step `step` (a checkpoint resumed).
    pub fn restart_at(&self, step: u64) {
        let mut g = self.sched.lock();
        g.updated.iter_mut().for_each(|u| *u = step);
        (g.began, g.next) = (step, step);
        g.lrs.clear();
    }

    /// The scheduler's failure, if it failed.
    pub fn error(&self) -> Option<String> {
        self.sched.lock().error.clone()
    }

    /// A step's times, since the last call (see [`StepTimes`]).
    pub fn take_times(&self) -> StepTimes {
        let mut g = self.sched.lock();
        let out = StepTimes { wait_s: g.wait_s, comm_s: g.comm_s, counted: g.timed > 0, spans: std::mem::take(&mut g.spans) };
        (g.comm_s, g.wait_s) = (0.0, 0.0);
        g.timed += 1;
        out
    }

    /// The optimizer (its state and steps): the scheduler's while a step's updates run, so
    /// settle first to read a step's result.
    pub fn opt(&self) -> std::sync::MutexGuard<'_, Optimizer> {
        self.sched.opt()
    }

    /// The gradients' buffers it keeps (the hooks' and the reduced copy), in bytes.
    pub fn grad_bytes(&self) -> u64 {
        self.sched.ranges.last().map_or(0, |r| r.end) as u64 * 8
    }

    fn stop_and_join(&mut self) -> Result<(), String> {
        self.sched.lock().stop = true;
        self.sched.cv.notify_all();
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| "the scheduler thread panicked".to_string())?,
            None => Ok(()),
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// The scheduler thread, until it is stopped: each step begins when the training thread begins
/// it (so evaluation and checkpoints between steps take as long as they need) and runs rounds
/// until every chunk is reduced and every parameter (`vars`, in the layout's order) updated.
fn schedule_loop(sched: &Sched, comm: &dyn Communicator, vars: &[candle_core::Var], (chunk, credit): (usize, usize)) -> Result<(), String> {
    let numel = sched.ranges.last().map_or(0, |r| r.end);
    let plan = chunk_plan(numel, chunk);
    let pchunks = param_chunks(&sched.ranges, chunk);
    let cparams = chunk_params(&pchunks, plan.len());
    let n = comm.world_size().get() as f32;
    let mut packed = Vec::with_capacity(credit.max(chunk));
    let mut reduced = vec![0f32; numel];
    loop {
        // No deadline here: the training thread's own waits and collectives have theirs, and
        // it sets `stop` when it leaves.
        let (step, lr) = match sched.wait(sched.lock(), None, &|| String::new(), |s| s.began > s.next) {
            Ok(mut g) => {
                let step = g.next;
                let lr =
                    g.lrs.remove(&step).ok_or_else(|| format!("rank {}: scheduled DDP: no learning rate for step {step}", sched.rank))?;
                (step, lr)
            }
            Err(_) if sched.lock().stop => return Ok(()),
            Err(e) => return Err(e),
        };
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
                kolo_tensor::edit_f32(&vars[p], &mut |v| opt.update(r.start, v, &reduced[r.clone()], lr)).map_err(|e| e.to_string())?;
                let mut g = sched.lock();
                g.arrived[p] = false;
                g.updated[p] = step + 1;
                drop(g);
                sched.cv.notify_all();
            }
        }
        sched.lock().next = step + 1;
        sched.cv.notify_all();
    }
}
