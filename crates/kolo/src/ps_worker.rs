//! A parameter-server worker for a user's candle model (`[train] strategy = "ps"`, as `kolo
//! train` runs one for its built-in models): every step pulls the parameters from the servers
//! into the model's variables, runs the user's forward and backward, and pushes the gradient;
//! the servers apply the optimizer (Li et al., OSDI 2014; Dean et al.'s Downpour SGD under
//! `ps.consistency = "async"`). Under BSP the result is DDP's.
//!
//! The pieces are `kolo train`'s: the connection and job description
//! (`kolo_train::ps_worker::connect`), the learning-rate schedule, the sampler, the report and
//! the micro-step backward (`update::backward_routed`). A job is started by `kolo ps run
//! --exec -- <your program>`: a coordinator, `ps.servers` server processes and the workers.

use crate::trainer::{adopt, checkpoint_meta, publish, replica_sampler, reporter, route_error, scalar_loss};
use crate::{Error, Result, StepOutput, TrainOptions};
use candle_core::{DType, Tensor, TensorId};
use candle_nn::VarMap;
use kolo_comm::{Communicator, LocalComm};
use kolo_optim::Optimizer;

use kolo_rendezvous::JobToken;
use kolo_tensor::ParamSet;
use kolo_train::cadence::{Cadence, Window};
use kolo_train::checkpointing::{load_checkpoint, resolve_checkpoint, save_checkpoint, PendingSave};
use kolo_train::config::{PsConsistency, Strategy};
use kolo_train::ps_worker::Exchange;
use kolo_train::report::StepRecord;
use kolo_train::sampler::Position;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Which worker of which parameter-server job this process is.
#[derive(Clone, Debug)]
pub struct PsJoin {
    /// This worker (its data shard).
    pub worker: usize,
    /// The number of workers.
    pub workers: usize,
    /// The coordinator, `host:port`.
    pub coordinator: String,
    /// The job's secret token.
    pub token: JobToken,
    /// The servers the job starts (`ps.servers` otherwise): a worker waits for them to join.
    pub servers: Option<u32>,
    /// This process trains the shard of dead worker `worker`, taken over by a survivor
    /// ([`PsWorker::take_over_dead_workers`]): it starts from that worker's clock, does not
    /// seed the servers and reports nothing.
    pub taken_over: bool,
}

impl PsJoin {
    /// From the variables `kolo ps run` sets: `RANK`, `WORLD_SIZE`, `KOLO_PS_COORDINATOR`
    /// (unless `coordinator` is given: `[ps] coordinator`), `KOLO_JOB_TOKEN` and
    /// `KOLO_PS_SERVERS`.
    pub fn from_env(coordinator: Option<&str>) -> Result<PsJoin> {
        let var = |k: &str| std::env::var(k).ok();
        let num = |k: &str, d: usize| var(k).map_or(Ok(d), |v| v.parse().map_err(|_| Error::Join(format!("{k}={v} is not a number"))));
        let coordinator = coordinator.map(str::to_string).or_else(|| var("KOLO_PS_COORDINATOR")).ok_or_else(|| {
            Error::Join("a parameter-server worker needs the job's coordinator: start it with `kolo ps run --exec`, or set [ps] coordinator / KOLO_PS_COORDINATOR".into())
        })?;
        let token =
            var("KOLO_JOB_TOKEN").ok_or_else(|| Error::Join("KOLO_JOB_TOKEN is not set (the parameter-server job's token)".into()))?;
        let token = JobToken::from_hex(&token).map_err(|e| Error::Join(format!("KOLO_JOB_TOKEN: {e}")))?;
        let servers = var("KOLO_PS_SERVERS")
            .map(|v| v.parse().map_err(|_| Error::Join(format!("KOLO_PS_SERVERS={v} is not a number"))))
            .transpose()?;
        Ok(PsJoin { worker: num("RANK", 0)?, workers: num("WORLD_SIZE", 1)?, coordinator, token, servers, taken_over: false })
    }
}

/// A worker of a parameter-server job training a candle model held in a `VarMap`: the
/// counterpart of [`crate::Trainer`] for `strategy = "ps"`. Each [`PsWorker::step`] is one
/// micro-step of `train.grad_accum`; the one that completes an accumulation pulls (every
/// `ps.fetch_every` steps under async), clips this worker's gradient and pushes it (every
/// `ps.push_every` steps under async). Call [`PsWorker::finish`] after the last step: it pulls
/// the final parameters into the model. Checkpoints (`train.checkpoint_dir` and
/// `checkpoint_every`, or [`PsWorker::save`]) are `kolo train`'s for parameter servers: worker
/// 0 writes the servers' parameters and optimizer state as a data-parallel checkpoint with
/// every worker's clock; [`PsWorker::resume`] puts them on fresh servers, and the library's
/// `Trainer` (or `kolo train`) continues them too. A worker that dies is declared dead by the
/// coordinator; with [`PsWorker::take_over_dead_workers`] a survivor trains its data shard to
/// the end (under BSP the job ends bitwise where it would have).
pub struct PsWorker {
    /// The pull, the pushes and their buffers (`kolo train`'s workers' own).
    x: Exchange,
    params: ParamSet,
    ids: HashMap<TensorId, usize>,
    model_vars: Vec<candle_core::Var>,
    compute: DType,
    opts: TrainOptions,
    me: (usize, usize),
    coordinator: String,
    token: JobToken,
    /// One micro-step's gradient.
    micro_grad: Vec<f32>,
    micro: u64,
    steps: u64,
    step_loss: f64,
    step_start: Option<Instant>,
    waited: Duration,
    cadence: Cadence,
    /// The checkpoints' metadata (the library `Trainer`'s, for `workers` replicas), and where
    /// the user's sampler is.
    meta: BTreeMap<String, String>,
    data_pos: Position,
    /// The workers share no communicator: each one's log windows are its own.
    alone: Box<dyn Communicator>,
    finished: bool,
    /// The final pull is done (at the last step under async and bounded delay, before its
    /// checkpoint; else in [`PsWorker::finish`]).
    settled: bool,
    /// The watch for dead workers whose shards this worker trains, joined by [`PsWorker::finish`].
    adoption: Option<kolo_train::ps_worker::Adoption>,
}

impl PsWorker {
    /// Joins the parameter-server job this process was started in ([`PsJoin::from_env`]).
    pub fn join(varmap: &VarMap, opts: TrainOptions) -> Result<PsWorker> {
        let me = PsJoin::from_env(opts.ps.coordinator.as_deref())?;
        PsWorker::connect(varmap, opts, me)
    }

    /// Connects as worker `me.worker` of `me.workers` and adopts the VarMap's variables (as
    /// [`crate::Trainer::new`] does). Worker 0's values seed the servers; every worker starts
    /// from the servers' values at its first pull.
    pub fn connect(varmap: &VarMap, mut opts: TrainOptions, me: PsJoin) -> Result<PsWorker> {
        opts.check()?;
        if let Some(n) = me.servers {
            opts.ps.servers = n;
        }
        let refuse = |setting: &str, why: &str| Err(Error::setting(setting, why));
        if opts.train.strategy != Strategy::Ps {
            return refuse("train.strategy", "kolo::PsWorker trains a parameter-server job: set [train] strategy = \"ps\"");
        }
        if opts.rule.is_some() {
            return refuse(
                "optim",
                "the servers apply the optimizer: a rule of your own (TrainOptions::update_rule) is code they do not have",
            );
        }
        if opts.train.device != "cpu" {
            return refuse("train.device", "kolo::PsWorker trains on the CPU (the servers hold the parameters in host memory)");
        }
        let (params, ids, model_vars, compute) = adopt(varmap, me.worker, opts.train.precision, &opts.train.device)?;
        let numel = params.numel();
        let me_pair = (me.worker, me.workers);
        let mut client = kolo_train::ps_worker::connect(&opts.ps, opts.optim.spec(), &me.coordinator, &me.token, numel, me_pair)?;
        if me.worker == 0 && !me.taken_over {
            client.init(&params.to_flat()?)?;
        }
        let mut x = Exchange::new(client, &opts.ps, numel);
        // A dead worker's shard goes on from its clock, silently (the survivor's reports are its own).
        let steps = if me.taken_over { x.take_over(opts.train.steps)? } else { 0 };
        let cadence = Cadence::new(match me.taken_over {
            true => silent_reporter(&opts, me.worker, me.workers, steps)?,
            false => reporter(&opts, me.worker, me.workers, 0)?,
        });
        let meta = checkpoint_meta(&params.signature(), &opts, me.workers, 0, compute);
        let alone = Box::new(LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0));
        Ok(PsWorker {
            x,
            params,
            ids,
            model_vars,
            compute,
            me: me_pair,
            coordinator: me.coordinator,
            token: me.token,
            micro_grad: vec![0f32; numel],
            micro: 0,
            steps,
            step_loss: 0.0,
            step_start: None,
            waited: Duration::ZERO,
            cadence,
            meta,
            data_pos: Position::default(),
            alone,
            finished: false,
            settled: false,
            adoption: None,
            opts,
        })
    }

    /// Trains the data shard of every worker that dies from now on and that the coordinator
    /// grants this worker (one survivor per dead worker), each on a thread of its own, from the
    /// dead worker's clock to `train.steps`: `train` gets the dead worker's [`PsJoin`] (its
    /// `worker`, `taken_over` set) and trains it as this program trains its own worker: builds
    /// the model, [`PsWorker::connect`]s with that join, steps until
    /// [`PsWorker::steps_done`] reaches `train.steps` on [`PsWorker::sampler`]'s batches, and
    /// calls [`PsWorker::finish`]. Its model must be a model of its own (a second `VarMap`):
    /// the pulls write into it. [`PsWorker::finish`] on this worker waits for those threads.
    /// Under `kolo ps run` the other workers run on when one dies, and the job succeeds once
    /// every dead worker's shard was trained.
    pub fn take_over_dead_workers<F, E>(&mut self, train: F) -> Result<()>
    where
        F: Fn(PsJoin) -> std::result::Result<(), E> + Send + Sync + 'static,
        E: std::fmt::Display,
    {
        if self.adoption.is_some() {
            return Err(Error::usage(self.me.0, "PsWorker::take_over_dead_workers", "this worker already takes over dead workers' shards"));
        }
        let (rank, workers) = self.me;
        let join = PsJoin {
            worker: rank,
            workers,
            coordinator: self.coordinator.clone(),
            token: self.token.clone(),
            servers: Some(self.opts.ps.servers),
            taken_over: true,
        };
        let take_over: kolo_train::ps_worker::TakeOver = std::sync::Arc::new(move |dead| {
            train(PsJoin { worker: dead, ..join.clone() })
                .map_err(|e| kolo_train::TrainError::Other(format!("worker {rank}, training dead worker {dead}'s shard: {e}")))
        });
        self.adoption = Some(kolo_train::ps_worker::Adoption::start(&self.coordinator, &self.token, self.me, take_over)?);
        Ok(())
    }

    /// This worker's sampler of `len` examples: its shard, as [`crate::Trainer::sampler`] deals
    /// a data-parallel replica's (`[data] batch_size`, `train.seed`).
    pub fn sampler(&self, len: usize) -> Result<crate::data::Sampler> {
        // From this worker's own step (a resumed worker continues from its clock).
        let from = replica_sampler(&self.opts, len, self.me, Position::default(), None)?.config().position_after(self.steps * self.accum());
        replica_sampler(&self.opts, len, self.me, from, None)
    }

    /// Records where the sampler is, for the checkpoints worker 0 writes (a `Trainer` that
    /// continues them starts its sampler there). Call it before [`PsWorker::step`].
    pub fn set_data_position(&mut self, p: Position) {
        self.data_pos = p;
    }

    fn accum(&self) -> u64 {
        self.opts.train.grad_accum.max(1)
    }

    /// Writes a checkpoint of the servers' state after the steps done (worker 0; on the others
    /// it writes nothing): their parameters and optimizer state, as a data-parallel checkpoint
    /// of `workers` replicas with every worker's clock (under BSP the state after every
    /// worker's push of those steps; async: each range as it is). Returns the step directory.
    pub fn save(&mut self, dir: impl AsRef<Path>) -> Result<PathBuf> {
        Ok(self.write_checkpoint(dir.as_ref())?.target)
    }

    fn write_checkpoint(&mut self, dir: &Path) -> Result<PendingSave> {
        let target = dir.join(format!("step-{:08}", self.steps));
        if self.me.0 != 0 {
            return Ok(PendingSave { target, thread: None });
        }
        let snap = self.x.client.snapshot(self.steps)?;
        self.params.load(&snap.values)?;
        publish(&self.params, &self.model_vars, self.compute)?;
        let spec = self.opts.optim.spec();
        let mut opt = Optimizer::new(spec.clone(), snap.values.len());
        let bufs: Vec<(&str, Vec<f32>)> = spec.state_names().iter().copied().zip(snap.opt_state).collect();
        opt.load_state(snap.opt_steps, &bufs).map_err(kolo_train::TrainError::Data)?;
        let mut meta = self.meta.clone();
        meta.insert(kolo_train::ps_worker::CLOCKS_KEY.into(), snap.clocks.iter().map(u64::to_string).collect::<Vec<_>>().join(","));
        Ok(save_checkpoint(dir, self.steps, &self.params, &[], &opt, None, &*self.alone, self.data_pos, &meta, Vec::new(), false, false)?)
    }

    /// Continues from checkpoint `path` (this job's, or a data-parallel one of the same model
    /// and optimizer): worker 0 puts its parameters and optimizer state on the servers with
    /// every worker's clock (`kolo.ps_clocks`; another strategy's: its step); each worker
    /// continues from its own clock (its step; [`PsWorker::sampler`] starts there). Call it on
    /// every worker, before the first step. Returns this worker's step.
    pub fn resume(&mut self, path: impl AsRef<Path>) -> Result<u64> {
        let path = resolve_checkpoint(path.as_ref())?;
        let ranges: Vec<_> = self.params.iter().map(|p| p.range.clone()).collect();
        let mut opt = Optimizer::new(self.opts.optim.spec(), self.x.flat.len());
        let r = load_checkpoint(&path, &self.params, &mut self.x.flat, &mut opt, None, &ranges, &self.meta)?;
        self.params.load(&self.x.flat)?;
        publish(&self.params, &self.model_vars, self.compute)?;
        let push_every = if self.is_async() { self.opts.ps.push_every.max(1) } else { 1 };
        let clocks = kolo_train::ps_worker::resumed_clocks(&path, &r, self.me.1, push_every)?;
        if self.me.0 == 0 {
            let state: Vec<Vec<f32>> = opt.state().into_iter().map(|(_, v)| v.to_vec()).collect();
            self.x.client.restore(&clocks, &self.x.flat, opt.steps(), &state)?;
        }
        self.x.pushes = clocks[self.me.0];
        self.steps = (self.x.pushes * push_every).min(self.opts.train.steps);
        self.data_pos = r.pos;
        // The report restarts at the resumed step.
        let mut before = std::mem::replace(&mut self.cadence, Cadence::new(reporter(&self.opts, self.me.0, self.me.1, self.steps)?));
        before.settle()?;
        Ok(self.steps)
    }

    /// The learning rate of the next push (warm-up, then the schedule over `train.steps`).
    pub fn lr(&self) -> f32 {
        let global = kolo_train::config::global_batch(self.opts.data.batch_size, self.me.1, self.opts.train.grad_accum);
        self.opts.optim.lr_of_step(global, self.opts.train.steps, self.steps)
    }

    /// This worker's index (its data shard) and the number of workers.
    pub fn worker(&self) -> (usize, usize) {
        self.me
    }

    /// Optimizer steps this worker has done.
    pub fn steps_done(&self) -> u64 {
        self.steps
    }

    fn is_async(&self) -> bool {
        self.opts.ps.consistency == PsConsistency::Async
    }

    /// One micro-step: the first of a step pulls, `loss` runs (the forward pass, on the pulled
    /// parameters), its gradient is added to the step's, and the last micro-step of
    /// `train.grad_accum` clips and pushes it.
    pub fn step(&mut self, loss: impl FnOnce() -> candle_core::Result<Tensor>) -> Result<StepOutput> {
        let (rank, accum) = (self.me.0, self.opts.train.grad_accum.max(1));
        if self.micro == 0 {
            self.step_start = Some(Instant::now());
            if let Some((t0, t1)) = self.x.pull_if_due(self.steps)? {
                self.params.load(&self.x.flat)?;
                publish(&self.params, &self.model_vars, self.compute)?;
                self.waited += t1 - t0;
            }
        }
        let loss = loss()?;
        let value = scalar_loss(rank, "PsWorker::step", &loss)?;
        let route = kolo_train::update::GradRoute::Local(&self.params, &mut self.micro_grad);
        kolo_train::update::backward_routed(&(loss * (1.0 / accum as f64))?, &self.ids, route, None)
            .map_err(|e| route_error(rank, "PsWorker::step", e))?;
        self.x.grads.iter_mut().zip(&self.micro_grad).for_each(|(a, g)| *a += g);
        self.step_loss += f64::from(value) / accum as f64;
        self.micro += 1;
        let lr = self.lr();
        if self.micro < accum {
            return Ok(StepOutput { loss: value, stepped: false, lr, grad_norm: None, comm: None, skipped: false });
        }
        let pushed = self.x.push_step(self.steps, lr, self.opts.optim.clip_grad_norm)?;
        if let Some((t0, t1)) = pushed.span {
            self.waited += t1 - t0;
        }
        self.micro = 0;
        self.steps += 1;
        let waited = std::mem::take(&mut self.waited);
        let rec = StepRecord {
            step_ms: self.step_start.take().map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3),
            wait_ms: Some(waited.as_secs_f64() * 1e3),
            comm_bytes: Some(pushed.bytes as usize),
            // Pulls and pushes block the step: nothing of them is hidden.
            hidden: Some(0.0),
            skipped_steps: 0,
        };
        let (done, end) = (self.steps, self.opts.train.steps);
        self.cadence.record(done, rec);
        let step_loss = std::mem::take(&mut self.step_loss);
        if let Window::Diverged(why) = self.cadence.end_window(&*self.alone, done, end, step_loss, lr, 0, "", &self.opts.train)? {
            return Err(Error::usage(rank, "PsWorker::step", why));
        }
        if done == end {
            self.cadence.report.finish();
        }
        if done == end && self.opts.ps.consistency != PsConsistency::Bsp {
            // The last step's checkpoint holds every worker's last push (finish's wait).
            self.settle()?;
        }
        if let Some((dir, _)) = self.cadence.checkpoint_due(&self.opts.train, done, end)? {
            let p = self.write_checkpoint(&dir)?;
            self.cadence.saving(done, p, false);
            self.cadence.settle()?;
        }
        Ok(StepOutput { loss: value, stepped: true, lr, grad_norm: pushed.norm, comm: Some((waited, 0.0)), skipped: false })
    }

    /// After the last step: pulls the final parameters into the model (under BSP every
    /// worker's last push applied; async: what the servers hold now) and tells the coordinator
    /// this worker is done. Returns them, flat. With [`PsWorker::take_over_dead_workers`] it
    /// watches for dead workers until the pull is done (one that dies in the last steps is taken
    /// over too; under async and bounded delay it first waits for every worker's last push, as
    /// BSP's pull does),
    /// then waits for the shards this worker trains.
    pub fn finish(&mut self) -> Result<Vec<f32>> {
        self.settle()?;
        self.params.load(&self.x.flat)?;
        publish(&self.params, &self.model_vars, self.compute)?;
        if !self.finished {
            self.finished = true;
            let _ = kolo_ps::coord::worker_done(&self.coordinator, &self.token, self.me.0 as u32, Duration::from_secs(5));
        }
        Ok(self.x.flat.clone())
    }
}

impl PsWorker {
    /// The final pull ([`PsWorker::finish`]'s), once: with the watch for dead workers, every
    /// worker's last push applied (async too); without it, under async, what the servers hold.
    fn settle(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.settled, true) {
            return Ok(());
        }
        match self.adoption.take() {
            Some(mut a) => {
                let shards = a.final_pull(&mut self.x, self.steps, self.me.0)?;
                if !shards.is_empty() {
                    kolo_base::eline!("worker {}: also trained the shard(s) of dead worker(s) {shards:?}", self.me.0);
                }
            }
            None => {
                let clock = self.x.final_clock(self.steps);
                self.x.client.pull(clock, &mut self.x.flat)?;
            }
        }
        Ok(())
    }
}

/// The report of a shard taken over: its windows kept for the checkpoints' cadence, nothing
/// printed or written (the dead worker's log files are its own).
fn silent_reporter(o: &TrainOptions, worker: usize, workers: usize, start: u64) -> Result<kolo_train::report::Reporter> {
    let tc = kolo_train::config::TrainConfig { json_log: None, tensorboard_dir: None, timeline_dir: None, ..o.train.clone() };
    let global = kolo_train::config::global_batch(o.data.batch_size, workers, o.train.grad_accum);
    Ok(kolo_train::report::Reporter::for_train(&tc, o.data.tokens_per_example.max(1), worker, true, global, start)?)
}
