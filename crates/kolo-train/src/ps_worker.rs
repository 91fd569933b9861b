//! A worker of a parameter-server job (`[train] strategy = "ps"`): pull the parameters, compute
//! a gradient on this worker's data shard, push it; the servers apply the optimizer.
//!
//! Clocks: under BSP and bounded delay a worker pulls for step t and pushes step t, so the
//! servers' vector clocks count steps. Under async (Downpour) it pulls every `fetch_every` steps
//! and pushes the gradients accumulated over `push_every` steps; clocks count pushes.
//!
//! A worker whose heartbeats stop is declared dead by the coordinator; one surviving worker
//! claims its data shard and trains it on a second thread from the dead worker's clock (its
//! last, possibly half-acknowledged push is resent: the servers drop duplicates). Under BSP the
//! result is bit-identical to a run in which nobody died.

use crate::checkpointing::{load_checkpoint, resolve_checkpoint, save_checkpoint, PendingSave, Resumed};
use crate::config::{Config, PsConsistency, StepTables};
use crate::data::{CharVocab, Dataset};
use crate::driver::{Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::eval::{evaluate, sample_text};
use crate::setup::{lead_say, load_data, replica_batches, spec_string, Data, Setup};
use crate::summary::{Eval, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::WorldSize;
use kolo_comm::{Communicator, LocalComm};
use kolo_optim::{clip_factor, sum_of_squares, Optimizer};
use kolo_ps::client::ClientOptions;
use kolo_ps::{JobSpec, PsClient, SignificantlyModified};
use kolo_rendezvous::JobToken;
use kolo_tensor::{build_model, Batch, Model, ModelSpec, PlainView};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Who this worker is and where the job's coordinator listens.
pub struct PsWorker {
    pub worker: usize,
    pub workers: usize,
    pub coordinator: String,
    pub token: JobToken,
}

/// A parameter-server worker on the driver: every step pulls, computes the gradient of this
/// worker's batches and pushes it. Workers share no communicator (one that dies must not stop
/// the others): the driver's log windows average this worker's own loss, and worker 0
/// evaluates (mid-run: the parameters it last pulled; at the end: the final ones).
pub struct PsStrategy<'a> {
    t: StepTables<'a>,
    /// A communicator of this worker alone.
    alone: Box<dyn Communicator>,
    me: (usize, usize),
    spec: ModelSpec,
    w: Worker,
    coordinator: String,
    token: JobToken,
    /// Test hook: this worker vanishes at this step (returns an error; no goodbye).
    die_at: Option<u64>,
    end: u64,
    /// The checkpoint metadata (worker 0 writes the servers' state as a data-parallel
    /// checkpoint of `workers` replicas).
    meta: std::collections::BTreeMap<String, String>,
    /// Adoption of dead workers' shards, stopped and joined before the final pull.
    adoption: Adoption,
    adopted_shards: Vec<usize>,
    /// The final parameters were pulled (every worker's last push applied, under BSP).
    settled: bool,
    quiet: bool,
    /// The servers' straggler measure at the last log window, summed over the servers: by
    /// worker, milliseconds its pushes came after a step's first, and pushes.
    lag_seen: (Vec<f64>, Vec<u64>),
}

/// The straggler of a window from the servers' view, by worker: the cumulative lag (ms after a
/// step's first push) and push counts now and at the window's start, and how long each has been
/// behind right now. A worker's lag is the larger of its mean lag per push in the window and how
/// long it is behind now (a worker too slow to push at all in the window still trails); the
/// straggler is the worker with the largest, by how far it is above the (lower) median
/// worker's. Workers with neither (done, or dead) are left out; fewer than two left, nobody is
/// named.
pub fn window_straggler(lag: &[f64], pushes: &[u64], lag0: &[f64], pushes0: &[u64], behind: &[f64]) -> Option<(usize, f64)> {
    let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
    let mean: Vec<(usize, f64)> = (0..lag.len().min(pushes.len()))
        .filter_map(|w| {
            let n = pushes[w].saturating_sub(pushes0.get(w).copied().unwrap_or(0));
            let mean = (n > 0).then(|| (at(lag, w) - at(lag0, w)) / n as f64);
            let now = Some(at(behind, w)).filter(|b| *b > 0.0);
            match (mean, now) {
                (None, None) => None,
                (m, b) => Some((w, m.unwrap_or(0.0).max(b.unwrap_or(0.0)))),
            }
        })
        .collect();
    if mean.len() < 2 {
        return None;
    }
    let (slow, max) = mean.iter().copied().fold((0, f64::MIN), |a, (w, v)| if v > a.1 { (w, v) } else { a });
    let mut sorted: Vec<f64> = mean.iter().map(|m| m.1).collect();
    sorted.sort_by(f64::total_cmp);
    Some((slow, max - sorted[(sorted.len() - 1) / 2]))
}

/// Checkpoint metadata: each worker's clock (pushes applied) when the servers' state was read.
pub const CLOCKS_KEY: &str = "kolo.ps_clocks";

/// Trains this parameter-server worker to the end of the run (the driver's loop, without
/// checkpoints: the state lives on the servers).
pub fn run_ps(cfg: &Config, w: &PsWorker, opts: &RunOptions) -> Result<Summary, TrainError> {
    let data = load_data(cfg, w.worker)?;
    let heap_before = kolo_base::alloc::stats().map(|h| h.live);
    let setup = Setup::new(cfg, cfg.mesh_for(w.workers).map_err(TrainError::Config)?, &data)?;
    let (mut s, start) = PsStrategy::new(&setup, w, &data, opts)?;
    // The worker's death hook is the strategy's (an error, so that in-process tests survive).
    let opts = RunOptions { die_at: None, ..opts.clone() };
    crate::driver::drive(&setup, &opts, crate::driver::Job::Alone(w.worker), &data, heap_before, &mut s, start)
}

impl<'a> PsStrategy<'a> {
    fn new(cfg: &'a Setup, w: &PsWorker, data: &Data, opts: &RunOptions) -> Result<(PsStrategy<'a>, Start), TrainError> {
        let (rank, world) = (w.worker, w.workers);
        let say = lead_say(rank == 0 && !opts.quiet);
        let (tc, pc) = (&cfg.train, &cfg.ps);
        let spec = cfg.spec.clone();
        let coordinator = pc.coordinator.clone().unwrap_or_else(|| w.coordinator.clone());
        let mut worker = Worker::connect(cfg, &coordinator, &w.token, rank, world)?;
        let numel = worker.x.flat.len();
        let meta = cfg.checkpoint_meta(world, 0);
        let start = match &opts.resume {
            Some(p) => Some(worker.resume(cfg, &resolve_checkpoint(p)?, &meta, rank == 0, data.train.len())?),
            None => None,
        };
        if rank == 0 && start.is_none() {
            // Every worker builds the same initial model from the seed; worker 0's copy seeds the servers.
            worker.x.client.init(&worker.model.params().to_flat()?)?;
        }
        let servers = worker.x.client.membership().servers.len();
        say(&format!(
            "kolo train (parameter servers at {coordinator}, {servers} server(s) so far): {numel} params, {} on {world} worker(s), {:?}{}, ranges of {} values, replication {}, data: {}",
            spec_string(&spec),
            pc.consistency(),
            if pc.consistency == PsConsistency::Async { format!(" (pull every {} steps, push every {})", pc.fetch_every, pc.push_every) } else { String::new() },
            pc.chunk,
            pc.replication,
            data.train.describe()
        ));
        if servers <= pc.replication as usize {
            say(&format!("warning: ps.replication = {} needs {} servers to keep that many copies; with {servers} server(s) each range has {servers} copy/copies until more servers join", pc.replication, pc.replication + 1));
        }
        let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
        let take_over: TakeOver = {
            let (cfg, train, coordinator, token) = (cfg.clone(), data.train.clone(), coordinator.clone(), w.token.clone());
            Arc::new(move |dead| adopt_shard(&cfg, train.clone(), &coordinator, &token, dead, world, end))
        };
        let adoption = Adoption::start(&coordinator, &w.token, (rank, world), take_over)?;
        let s = PsStrategy {
            t: cfg.step_tables(),
            alone: Box::new(LocalComm::create(WorldSize::new(1).expect("1 > 0")).remove(0)),
            quiet: opts.quiet,
            me: (rank, world),
            spec,
            w: worker,
            coordinator,
            token: w.token.clone(),
            die_at: opts.die_at.filter(|d| d.0 == rank).map(|d| d.1),
            end,
            adoption,
            adopted_shards: Vec::new(),
            settled: false,
            lag_seen: (Vec::new(), Vec::new()),
            meta,
        };
        Ok((s, start))
    }

    /// At the end of the run: stops adopting, waits for the adopted shards, then pulls the final
    /// parameters (BSP: every push of every worker applied; bounded delay: within τ of the
    /// slowest; async: whatever the servers hold when this worker is done).
    fn settle(&mut self) -> Result<(), TrainError> {
        if self.settled {
            return Ok(());
        }
        self.adopted_shards = self.adoption.final_pull(&mut self.w.x, self.end, self.me.0)?;
        self.w.model.params().load(&self.w.x.flat)?;
        self.settled = true;
        Ok(())
    }

    /// Whether the run's steps are all done (evaluation then reads the final parameters).
    fn at_end(&self, steps_done: u64) -> bool {
        steps_done >= self.end
    }
}

impl Strategy for PsStrategy<'_> {
    fn comm(&self) -> &dyn Communicator {
        &*self.alone
    }

    fn replica(&self) -> (usize, usize) {
        self.me
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        if self.die_at == Some(ctx.step) {
            // Test hook: this worker vanishes (no goodbye; its heartbeats stop with its client).
            return Err(TrainError::Other(format!("worker {} died at step {} (test hook)", self.me.0, ctx.step)));
        }
        let mut out = self.w.step(self.t, ctx, &mut || data.next_batch())?;
        out.note = format!(
            " | {:.1} ms in push/pull | lead over the slowest worker up to {} step(s)",
            out.rec.wait_ms.unwrap_or(0.0),
            self.w.x.client.stats().max_lead
        );
        Ok(out)
    }

    /// The worker whose pushes reached the servers latest after each step's first push, over
    /// the window since the last call, and its lag behind the median worker's. Servers that do
    /// not answer are left out (a killed server must not stop the worker that survives it).
    fn straggler(&mut self) -> Result<Option<(usize, f64, String)>, TrainError> {
        let n = self.me.1;
        let (mut lag, mut pushes, mut behind) = (vec![0f64; n], vec![0u64; n], vec![0f64; n]);
        for (_, s) in self.w.x.client.reachable_server_stats() {
            for (w, (l, p)) in s.worker_lag_ms.iter().zip(&s.worker_pushes).enumerate().take(n) {
                lag[w] += l;
                pushes[w] += p;
            }
            for (w, b) in s.worker_behind_ms.iter().enumerate().take(n) {
                behind[w] = behind[w].max(*b);
            }
        }
        let (lag0, pushes0) = std::mem::replace(&mut self.lag_seen, (lag.clone(), pushes.clone()));
        Ok(window_straggler(&lag, &pushes, &lag0, &pushes0, &behind)
            .map(|(w, ms)| (w, ms, format!("worker {w}'s pushes reach the servers {ms:.1} ms after the median worker's"))))
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        let steps_done = self.w.steps_done;
        if self.at_end(steps_done) {
            self.settle()?;
        }
        if self.me.0 != 0 {
            return Ok(None);
        }
        evaluate(&*self.w.model, &PlainView, ds, &*self.alone, self.t.batch_size, max_batches, false, &|| Ok(())).map(Some)
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        self.settle()?;
        let ModelSpec::Gpt(g) = &self.spec else { return Ok(None) };
        if self.me.0 != 0 {
            return Ok(None);
        }
        let tc = self.t.train;
        sample_text(&*self.w.model, &PlainView, vocab, g.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(())).map(Some)
    }

    /// Worker 0 reads the servers' state once every worker has finished `at.step` steps (BSP;
    /// asynchronous workers never stop together: then as each range is when asked) and writes
    /// it as a data-parallel checkpoint: the whole model and optimizer state, the data
    /// position, `workers` replicas, and each worker's clock (`kolo.ps_clocks`: where each
    /// resumes). It resumes under the parameter servers (on fresh servers too) or under
    /// DDP/ZeRO. The other workers write nothing. The run's last checkpoint under async and
    /// bounded delay follows the final pull: every worker's last push is in it (a run stopped early keeps
    /// the fuzzy one).
    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        if self.w.x.consistency != PsConsistency::Bsp && at.step == self.t.train.steps {
            self.settle()?;
        }
        if self.me.0 != 0 {
            return Ok(PendingSave { target: at.dir.join(format!("step-{:08}", at.step)), thread: None });
        }
        let snap = self.w.x.client.snapshot(at.step)?;
        let params = self.w.model.params();
        params.load(&snap.values)?;
        let spec = self.t.optim.spec();
        let mut opt = Optimizer::new(spec.clone(), snap.values.len());
        let bufs: Vec<(&str, Vec<f32>)> = spec.state_names().iter().copied().zip(snap.opt_state).collect();
        opt.load_state(snap.opt_steps, &bufs).map_err(TrainError::Data)?;
        let mut meta = self.meta.clone();
        meta.extend(at.meta);
        meta.insert(CLOCKS_KEY.into(), snap.clocks.iter().map(u64::to_string).collect::<Vec<_>>().join(","));
        save_checkpoint(at.dir, at.step, params, &[], &opt, None, &*self.alone, at.pos, &meta, Vec::new(), at.background, at.crash)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        self.settle()?;
        let rank = self.me.0;
        let say = lead_say(rank == 0 && !self.quiet);
        let stats = self.w.x.client.stats().clone();
        if stats.values_sent < stats.values_total {
            say(&format!(
                "significantly-modified filter: sent {} of {} gradient values ({:.1}% saved)",
                stats.values_sent,
                stats.values_total,
                100.0 * (1.0 - stats.values_sent as f64 / stats.values_total.max(1) as f64)
            ));
        }
        if !self.adopted_shards.is_empty() {
            kolo_base::eline!("worker {rank}: also trained the shard(s) of dead worker(s) {:?}", self.adopted_shards);
        }
        let _ = kolo_ps::coord::worker_done(&self.coordinator, &self.token, rank as u32, Duration::from_secs(5));
        let numel = self.w.x.flat.len() as u64;
        Ok(Finish {
            params: self.w.x.flat.clone(),
            // The pulled parameters, and the gradient, micro-batch and accumulation buffers.
            states: StateBytes { params: numel * 4, grads: 3 * numel * 4, optimizer: 0, offloaded: false },
            skipped_steps: 0,
            loss_scale: None,
            moe: None,
            pipeline_bubble: None,
            ps: Some(stats),
        })
    }
}

/// What a worker does with a dead worker's shard it was granted: trains it to the end (on a
/// thread of its own).
pub type TakeOver = Arc<dyn Fn(usize) -> Result<(), TrainError> + Send + Sync>;

/// Adoption of dead workers' data shards (`kolo train`'s workers and `kolo::PsWorker`): a
/// thread asks the coordinator for dead workers every 200 ms and, for each one the coordinator
/// grants this worker, runs [`TakeOver`] on a new thread, until [`Adoption::finish`].
pub struct Adoption {
    done: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    taken: Arc<Mutex<Vec<Taken>>>,
    /// A shard taken over failed (its thread's error is [`Adoption::finish`]'s).
    failed: Arc<AtomicBool>,
}

/// A dead worker's shard being trained on a thread of this worker.
type Taken = (usize, JoinHandle<Result<(), TrainError>>);

impl Adoption {
    /// Starts watching for dead workers of the `world` workers on behalf of worker `rank`.
    pub fn start(coordinator: &str, token: &JobToken, (rank, world): (usize, usize), take_over: TakeOver) -> Result<Adoption, TrainError> {
        let (done, taken, failed): (Arc<AtomicBool>, Arc<Mutex<Vec<_>>>, Arc<AtomicBool>) = Default::default();
        let (stop, list, coordinator, token) = (done.clone(), taken.clone(), coordinator.to_string(), token.clone());
        let failing = failed.clone();
        let watcher = std::thread::Builder::new()
            .name("kolo-ps-adopt".into())
            .spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(200));
                    let Ok(m) = kolo_ps::coord::membership(&coordinator, &token, Duration::from_secs(5)) else { continue };
                    for dead in m.dead_workers.into_iter().map(|d| d as usize) {
                        if dead >= world || dead == rank || stop.load(Ordering::SeqCst) {
                            continue;
                        }
                        if let Ok(true) = kolo_ps::coord::adopt(&coordinator, &token, dead as u32, rank as u32, Duration::from_secs(5)) {
                            kolo_base::eline!("worker {rank}: worker {dead} is dead; training its data shard from its last step");
                            let (f, failing) = (take_over.clone(), failing.clone());
                            let h = std::thread::spawn(move || {
                                let r = f(dead);
                                failing.fetch_or(r.is_err(), Ordering::SeqCst);
                                r
                            });
                            list.lock().unwrap_or_else(|p| p.into_inner()).push((dead, h));
                        }
                    }
                }
            })
            .map_err(|e| TrainError::Other(e.to_string()))?;
        Ok(Adoption { done, watcher: Some(watcher), taken, failed })
    }

    /// The final pull of a worker that trained `end` steps into `x.flat`, with every push of
    /// every worker applied, and with the watch still running: a worker that dies in the last
    /// steps is taken over too. Under BSP the pull waits for the last pushes; under async (whose
    /// pulls wait for nobody) and bounded delay (for the slowest within τ),
    /// it waits first for every worker's last push ([`kolo_ps::PsClient::slowest_clock`]). Then
    /// [`Adoption::finish`]. Returns the workers whose shards this one trained; a failed
    /// take-over is the error before a failed pull or wait (it explains it).
    pub fn final_pull(&mut self, x: &mut Exchange, end: u64, rank: usize) -> Result<Vec<usize>, TrainError> {
        let clock = x.final_clock(end);
        let waited = if x.consistency == PsConsistency::Bsp { Ok(()) } else { self.await_last_pushes(x, rank) };
        let pulled = waited.and_then(|()| Ok(x.client.pull(clock, &mut x.flat)?));
        let taken = self.finish(rank)?;
        pulled?;
        Ok(taken)
    }

    /// Async or bounded delay, at the end of this worker's run: waits until every worker's last
    /// push (each makes as many as this one, `x.pushes`) has reached every range, whether the worker made
    /// it or a survivor that took its shard over did. Stops waiting when a take-over failed
    /// ([`Adoption::finish`] reports it); fails, naming the workers behind, when the slowest
    /// worker's pushes do not advance within the servers' deadline (`ps.timeout_secs`).
    fn await_last_pushes(&self, x: &mut Exchange, rank: usize) -> Result<(), TrainError> {
        let (last, deadline) = (x.pushes, x.client.timeout());
        let (mut slowest, mut since) = (x.client.slowest_clock()?, Instant::now());
        while slowest < last && !self.failed.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(100));
            let now = x.client.slowest_clock()?;
            if now > slowest {
                (slowest, since) = (now, Instant::now());
            } else if since.elapsed() > deadline {
                let mut behind = std::collections::BTreeSet::new();
                for (_, s) in x.client.reachable_server_stats() {
                    behind.extend(s.worker_behind_ms.iter().enumerate().filter(|(_, ms)| **ms > 0.0).map(|(w, _)| w));
                }
                return Err(TrainError::Other(format!(
                    "worker {rank}: at the end of the run, the slowest worker stayed at {slowest} of its {last} pushes for {:.0} s (ps.timeout_secs); behind: {}. A dead worker's shard is taken over once the coordinator declares it dead (kolo ps run --dead-after)",
                    deadline.as_secs_f64(),
                    if behind.is_empty() { "not known (no server answered)".to_string() } else { behind.iter().map(|w| format!("worker {w}")).collect::<Vec<_>>().join(", ") }
                )));
            }
        }
        Ok(())
    }

    /// Stops watching and waits for every shard taken over to be trained to the end. Returns
    /// their workers; the first that failed is the error.
    pub fn finish(&mut self, rank: usize) -> Result<Vec<usize>, TrainError> {
        self.done.store(true, Ordering::SeqCst);
        if let Some(h) = self.watcher.take() {
            let _ = h.join();
        }
        let mut shards = Vec::new();
        for (shard, h) in self.taken.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            h.join().map_err(|_| TrainError::Other(format!("worker {rank}: the thread training worker {shard}'s shard panicked")))??;
            shards.push(shard);
        }
        Ok(shards)
    }
}

impl Drop for Adoption {
    fn drop(&mut self) {
        self.done.store(true, Ordering::SeqCst);
    }
}

/// A worker's side of a step of a parameter-server job, for `kolo train`'s workers and the
/// library's `kolo::PsWorker`: the pull before the step's first micro-batch and, once the
/// step's gradient is in `grads`, the worker's own clipping, the accumulation of the steps
/// between pushes and the push.
pub struct Exchange {
    pub client: PsClient,
    filter: Option<SignificantlyModified>,
    /// The pulled parameters; the step's gradient; the gradients not pushed yet (Downpour
    /// pushes every `push_every` steps).
    pub flat: Vec<f32>,
    pub grads: Vec<f32>,
    acc: Vec<f32>,
    /// Pushes made (the clock under async).
    pub pushes: u64,
    /// BSP: a pull for step t waits for every worker's push of step t - 1 (the final pull too).
    consistency: PsConsistency,
    fetch_every: u64,
    push_every: u64,
}

/// What [`Exchange::push_step`] did: the gradient's norm before clipping, and the push's span
/// and bytes when it pushed.
pub struct Pushed {
    pub norm: Option<f64>,
    pub span: Option<(Instant, Instant)>,
    pub bytes: u64,
}

impl Exchange {
    pub fn new(client: PsClient, pc: &crate::config::PsConfig, numel: usize) -> Exchange {
        Exchange {
            client,
            filter: (pc.filter_threshold > 0.0).then(|| SignificantlyModified::new(pc.filter_threshold)),
            flat: vec![0f32; numel],
            grads: vec![0f32; numel],
            acc: vec![0f32; numel],
            pushes: 0,
            consistency: pc.consistency,
            fetch_every: pc.fetch_every.max(1),
            push_every: pc.push_every.max(1),
        }
    }

    /// Before step `step`: pulls into `flat` when one is due (every step; under async every
    /// `fetch_every` steps, at the push clock), and clears `grads`. Returns the pull's span.
    pub fn pull_if_due(&mut self, step: u64) -> Result<Option<(Instant, Instant)>, TrainError> {
        self.grads.fill(0.0);
        if self.is_async() && !step.is_multiple_of(self.fetch_every) {
            return Ok(None);
        }
        let t = Instant::now();
        self.client.pull(if self.is_async() { self.pushes } else { step }, &mut self.flat)?;
        Ok(Some((t, Instant::now())))
    }

    /// After step `step`'s gradient is in `grads`: clipped to `clip` by its own norm (the
    /// servers never see a global one), added to what is not pushed yet, and pushed with `lr`
    /// when due (every step; under async every `push_every` steps).
    pub fn push_step(&mut self, step: u64, lr: f32, clip: Option<f64>) -> Result<Pushed, TrainError> {
        let norm = clip.map(|max| {
            let n = sum_of_squares(&self.grads).sqrt();
            let f = clip_factor(n, max);
            self.grads.iter_mut().for_each(|g| *g *= f);
            n
        });
        self.acc.iter_mut().zip(&self.grads).for_each(|(a, g)| *a += g);
        let mut out = Pushed { norm, span: None, bytes: 0 };
        if !self.is_async() || (step + 1).is_multiple_of(self.push_every) {
            let (t, before) = (Instant::now(), self.client.stats().bytes_out);
            let clock = if self.is_async() { self.pushes } else { step };
            let filter = self.filter.as_mut().map(|f| f as &mut dyn kolo_ps::Filter);
            self.client.push(clock, lr, &self.acc, filter)?;
            (out.span, out.bytes) = (Some((t, Instant::now())), self.client.stats().bytes_out - before);
            self.pushes += 1;
            self.acc.fill(0.0);
        }
        Ok(out)
    }

    /// The clock of the final pull after `end` steps: every worker's last push under BSP, this
    /// worker's pushes under async.
    /// A dead worker's shard taken over: continues from its clock, the slowest clock the servers
    /// report (a dead worker is the slowest). Returns the step to start at (at most `end`).
    pub fn take_over(&mut self, end: u64) -> Result<u64, TrainError> {
        let clock = self.client.pull(0, &mut vec![0f32; self.flat.len()])?;
        let start = (if self.is_async() { clock * self.push_every } else { clock }).min(end);
        self.pushes = if self.is_async() { start / self.push_every } else { start };
        Ok(start)
    }

    /// Async consistency: pulls every `fetch_every` steps and pushes every `push_every`, at
    /// the push clock, waiting for nobody.
    fn is_async(&self) -> bool {
        self.consistency == PsConsistency::Async
    }

    pub fn final_clock(&self, end: u64) -> u64 {
        if self.is_async() {
            self.pushes
        } else {
            end
        }
    }
}

/// One logical worker's model, its exchange with the servers, and its steps.
struct Worker {
    model: Box<dyn Model>,
    x: Exchange,
    /// One micro-batch's gradient.
    micro: Vec<f32>,
    steps_done: u64,
}

impl Worker {
    /// Builds the model and connects as logical worker `worker` of `workers`.
    fn connect(cfg: &Setup, coordinator: &str, token: &JobToken, worker: usize, workers: usize) -> Result<Worker, TrainError> {
        let model = build_model(&cfg.spec, cfg.train.seed)?;
        let numel = model.params().numel();
        let client = connect(&cfg.ps, cfg.optim.spec(), coordinator, token, numel, (worker, workers))?;
        Ok(Worker { model, x: Exchange::new(client, &cfg.ps, numel), micro: vec![0f32; numel], steps_done: 0 })
    }

    /// Loads checkpoint `path` (any strategy's, of this model and optimizer); `restore`
    /// (worker 0) puts its parameters and optimizer state on the servers with every worker's
    /// clock (the checkpoint's `kolo.ps_clocks`, or its step for every worker). This worker
    /// continues from its own clock: its step and data position.
    fn resume(
        &mut self,
        cfg: &Setup,
        path: &std::path::Path,
        meta: &std::collections::BTreeMap<String, String>,
        restore: bool,
        train_len: usize,
    ) -> Result<(std::path::PathBuf, Resumed), TrainError> {
        let params = self.model.params();
        let ranges: Vec<_> = params.iter().map(|p| p.range.clone()).collect();
        let mut opt = Optimizer::new(cfg.optim.spec(), self.x.flat.len());
        let mut r = load_checkpoint(path, params, &mut self.x.flat, &mut opt, None, &ranges, meta)?;
        params.load(&self.x.flat)?;
        let (worker, workers) = (self.x.client.worker() as usize, self.x.client.workers() as usize);
        let push_every = if cfg.ps.consistency == PsConsistency::Async { cfg.ps.push_every.max(1) } else { 1 };
        let clocks = resumed_clocks(path, &r, workers, push_every)?;
        if restore {
            let state: Vec<Vec<f32>> = opt.state().into_iter().map(|(_, v)| v.to_vec()).collect();
            self.x.client.restore(&clocks, &self.x.flat, opt.steps(), &state)?;
        }
        let mine = clocks[worker];
        let step = (mine * push_every).min(cfg.train.steps);
        if step != r.step {
            // Its own position in its shard: `step` steps of grad_accum batches.
            r.pos = crate::setup::replica_position(&cfg.data, cfg.train.seed, train_len, worker, workers, step * cfg.train.grad_accum);
            r.step = step;
        }
        (self.x.pushes, self.steps_done) = (mine, step);
        Ok((path.to_path_buf(), r))
    }

    /// Step `ctx.step`: pull (every `fetch_every` steps under async), the gradient over
    /// `grad_accum` batches from `next`, clipping, push (every `push_every` steps under async).
    fn step(
        &mut self,
        t: StepTables<'_>,
        ctx: &StepCtx,
        next: &mut dyn FnMut() -> Result<Batch, TrainError>,
    ) -> Result<StepOut, TrainError> {
        let tc = t.train;
        let te = kolo_tensor::TensorError::from;
        let mut out = StepOut::default();
        let mut waited = Duration::ZERO;
        if let Some((t0, t1)) = self.x.pull_if_due(ctx.step)? {
            self.model.params().load(&self.x.flat)?;
            waited += t1 - t0;
            out.comm_spans.push(("pull".into(), t0, t1));
        }
        let mut loss_sum = 0f64;
        for _ in 0..tc.grad_accum {
            let batch = next()?;
            let loss = (self.model.loss(&batch, &PlainView)? * (1.0 / tc.grad_accum as f64)).map_err(te)?;
            loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
            let g = loss.backward().map_err(te)?;
            self.model.params().grads_into(&g, &mut self.micro)?;
            self.x.grads.iter_mut().zip(&self.micro).for_each(|(a, b)| *a += b);
        }
        out.backward_end = Some(Instant::now());
        let pushed = self.x.push_step(ctx.step, ctx.lr, t.optim.clip_grad_norm)?;
        if let Some((t0, t1)) = pushed.span {
            waited += t1 - t0;
            out.comm_spans.push(("push".into(), t0, t1));
        }
        self.steps_done = ctx.step + 1;
        out.loss = loss_sum;
        out.rec.comm_bytes = Some(pushed.bytes as usize);
        out.rec.wait_ms = Some(waited.as_secs_f64() * 1e3);
        // Pulls and pushes block the step: nothing of them is hidden.
        out.rec.hidden = Some(0.0);
        Ok(out)
    }
}

/// Every worker's clock (pushes applied) to restore from checkpoint `r` at `path`: its
/// `kolo.ps_clocks`, each worker continuing from the slowest one's at another number of
/// workers; a checkpoint of another strategy gives every worker its step (over `push_every`).
pub fn resumed_clocks(path: &std::path::Path, r: &Resumed, workers: usize, push_every: u64) -> Result<Vec<u64>, TrainError> {
    Ok(match r.meta.get(CLOCKS_KEY) {
        Some(v) => {
            let c: Vec<u64> = v.split(',').map(str::parse).collect::<Result<_, _>>().map_err(|_| {
                TrainError::Data(format!("{}: checkpoint metadata `{CLOCKS_KEY}` = {v:?} is not a list of numbers", path.display()))
            })?;
            if c.len() == workers {
                c
            } else {
                vec![c.iter().copied().min().unwrap_or(0); workers]
            }
        }
        None => vec![r.step / push_every.max(1); workers],
    })
}

/// Connects as worker `me` = (worker, workers) of the job `pc` describes (`optimizer`: the
/// servers' update of the `numel` values), heartbeating: `kolo train`'s workers and the
/// library's `kolo::PsWorker`.
pub fn connect(
    pc: &crate::config::PsConfig,
    optimizer: kolo_optim::OptimizerSpec,
    coordinator: &str,
    token: &JobToken,
    numel: usize,
    me: (usize, usize),
) -> Result<PsClient, TrainError> {
    Ok(PsClient::connect(client_options(pc, optimizer, coordinator, token, numel, me, Some(Duration::from_millis(250))))?)
}

/// How a worker (or, without heartbeats, an observer) of this job connects.
fn client_options(
    pc: &crate::config::PsConfig,
    optimizer: kolo_optim::OptimizerSpec,
    coordinator: &str,
    token: &JobToken,
    numel: usize,
    (worker, workers): (usize, usize),
    heartbeat: Option<Duration>,
) -> ClientOptions {
    let job = JobSpec {
        len: numel as u64,
        chunk: pc.chunk,
        workers: workers as u32,
        replication: pc.replication,
        backup: pc.backup_workers,
        consistency: pc.consistency(),
        optimizer,
    };
    ClientOptions {
        coordinator: coordinator.to_string(),
        token: token.clone(),
        job,
        worker: worker as u32,
        min_servers: pc.servers,
        timeout: Duration::from_secs_f64(pc.timeout_secs),
        heartbeat,
    }
}

/// Trains dead worker `shard`'s data shard from its clock to `end` (a survivor's second thread,
/// silent: the driver's reports are this worker's own shard's).
fn adopt_shard(
    cfg: &Setup,
    train: Arc<dyn Dataset>,
    coordinator: &str,
    token: &JobToken,
    shard: usize,
    workers: usize,
    end: u64,
) -> Result<(), TrainError> {
    let mut w = Worker::connect(cfg, coordinator, token, shard, workers)?;
    let start = w.x.take_over(end)?;
    let tc = &cfg.train;
    let batches = replica_batches(&cfg.data, tc.seed, train, shard, workers, start * tc.grad_accum)?;
    let global_batch = cfg.global_batch(workers);
    for step in start..end {
        let lr = cfg.optim.lr_of_step(global_batch, tc.steps, step);
        let mut next = || batches.recv().map(|b| b.1).map_err(|_| TrainError::Other("the prefetch thread stopped".into()));
        w.step(cfg.step_tables(), &StepCtx { step, lr, drain_at: end }, &mut next)?;
    }
    let _ = kolo_ps::coord::worker_done(coordinator, token, shard as u32, Duration::from_secs(5));
    Ok(())
}

/// Another worker group on the same servers: every `every`, pull the current parameters (no
/// clock, no push) and evaluate them on the test set, until `stop` says the job is over (then
/// once more). Returns (seconds since start, evaluation) per round.
pub fn run_ps_eval(
    cfg: &Config,
    coordinator: &str,
    token: &JobToken,
    workers: usize,
    every: Duration,
    stop: &dyn Fn() -> bool,
    quiet: bool,
) -> Result<Vec<(f64, crate::summary::Eval)>, TrainError> {
    let say = |m: &str| {
        if !quiet {
            kolo_base::eline!("{m}");
        }
    };
    let data = load_data(cfg, 0)?;
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, cfg.train.seed)?;
    let numel = model.params().numel();
    let mut client = PsClient::observer(client_options(&cfg.ps, cfg.optimizer(), coordinator, token, numel, (0, workers), None))?;
    let local = LocalComm::create(WorldSize::new(1).expect("1 > 0")).remove(0);
    let limit = if data.vocab.is_some() { cfg.train.eval_batches } else { 0 };
    let t0 = Instant::now();
    let mut out = Vec::new();
    let mut flat = vec![0f32; numel];
    loop {
        let last = stop();
        match client.pull(0, &mut flat) {
            Ok(_) => {
                model.params().load(&flat)?;
                let e = evaluate(&*model, &PlainView, &*data.eval, &local, cfg.data.batch_size, limit, false, &|| Ok(()))?;
                let secs = t0.elapsed().as_secs_f64();
                say(&format!(
                    "[eval group] {secs:.1} s: loss {:.4}{}",
                    e.loss,
                    e.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))
                ));
                out.push((secs, e));
            }
            // Before worker 0 has initialised the ranges there is nothing to read yet.
            Err(kolo_ps::PsError::Server(m)) if m.contains("never arrived") || m.contains("no job yet") => {}
            Err(e) => return Err(e.into()),
        }
        if last {
            return Ok(out);
        }
        let wake = Instant::now() + every;
        while Instant::now() < wake && !stop() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
