//! IMPALA (Espeholt et al., 2018): actor threads run environments with the newest policy they
//! have (possibly some updates old), unroll `unroll` steps at a time and hand the trajectories
//! to the learner without ever waiting for it (a full queue drops the trajectory and counts
//! it); the learner batches trajectories, corrects for the policy lag with V-trace, and
//! publishes new parameters that actors pick up at their next unroll.
//!
//! The policy is one MLP whose output holds the action logits and the value. Actors evaluate it
//! on the flat parameters (kolo-rl, no tensors); the learner computes the loss and its gradient
//! with kolo-tensor: -rho_s log pi(a_s|x_s) A_s + (baseline / 2) (v_s - V(x_s))^2 - entropy.

use crate::{policy, vtrace, CartPole, Env, GridWorld};
use kolo_base::Rng;
use kolo_optim::{clip_factor, Optimizer, OptimizerSpec};
use kolo_tensor::models::Mlp;
use kolo_tensor::{Input, Model, PlainView, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, RwLock};
use std::time::Instant;

/// Why an IMPALA run failed.
#[derive(Debug, thiserror::Error)]
pub enum ImpalaError {
    /// A setting that cannot run.
    #[error("impala: {0}")]
    Config(String),
    /// An actor or the learner failed (names which and why).
    #[error("{0}")]
    Failed(String),
    /// The learner's tensors.
    #[error(transparent)]
    Tensor(#[from] kolo_tensor::TensorError),
    /// The channel between actors and the learner.
    #[error(transparent)]
    Ps(#[from] kolo_ps::PsError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EnvKind {
    CartPole,
    /// A 5 x 5 grid world.
    Grid,
}

impl EnvKind {
    fn make(self) -> Box<dyn Env> {
        match self {
            EnvKind::CartPole => Box::new(CartPole::default()),
            EnvKind::Grid => Box::new(GridWorld::new(5)),
        }
    }
    /// The mean return over 100 episodes that counts as solved.
    pub fn solved(self) -> f64 {
        match self {
            EnvKind::CartPole => CartPole::SOLVED,
            // The shortest path takes 8 steps: 1 - 7 x 0.01.
            EnvKind::Grid => 0.9,
        }
    }
}

#[derive(Clone, Debug)]
pub struct ImpalaConfig {
    pub env: EnvKind,
    pub actors: usize,
    /// Steps per trajectory.
    pub unroll: usize,
    /// Trajectories per learner step.
    pub batch: usize,
    pub hidden: Vec<usize>,
    pub lr: f32,
    pub gamma: f64,
    pub entropy: f64,
    pub baseline: f64,
    pub rho_bar: f64,
    pub c_bar: f64,
    pub clip_norm: f64,
    /// Stop after the learner has learned from this many environment steps.
    pub max_env_steps: u64,
    /// Stop once the mean return of the last 100 episodes reaches this (None: run to the end).
    pub target: Option<f64>,
    /// Trajectories the queue holds; actors drop (and count) what does not fit.
    pub queue: usize,
    pub seed: u64,
}

impl ImpalaConfig {
    pub fn cartpole(actors: usize) -> ImpalaConfig {
        ImpalaConfig {
            env: EnvKind::CartPole,
            actors,
            unroll: 20,
            batch: 8,
            hidden: vec![64],
            lr: 1e-3,
            gamma: 0.99,
            entropy: 0.01,
            baseline: 0.5,
            rho_bar: 1.0,
            c_bar: 1.0,
            clip_norm: 40.0,
            max_env_steps: 1_000_000,
            target: Some(CartPole::SOLVED),
            queue: 16,
            seed: 1,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug)]
pub struct ImpalaReport {
    /// Environment steps the actors took.
    pub env_steps: u64,
    /// Environment steps in the trajectories the learner learned from.
    pub learned_steps: u64,
    pub learner_steps: u64,
    pub episodes: u64,
    /// Mean return of the last 100 episodes at the end.
    pub mean_return: f64,
    /// Learned-from environment steps when the target was first reached.
    pub solved_at: Option<u64>,
    pub secs: f64,
    pub env_steps_per_s: f64,
    /// Trajectories the actors dropped because the learner's queue was full.
    pub dropped: u64,
    /// Trajectories the learner refused as malformed (see `Trajectory::check`).
    pub rejected: u64,
    /// The largest number of updates a trajectory's policy was behind the learner's.
    pub max_lag: u64,
    /// Mean policy lag (updates) over the trajectories learned from.
    pub mean_lag: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Trajectory {
    /// unroll + 1 observations.
    obs: Vec<f32>,
    actions: Vec<usize>,
    rewards: Vec<f32>,
    dones: Vec<bool>,
    behaviour_logp: Vec<f32>,
    version: u64,
    /// Returns of episodes that ended in this unroll.
    finished: Vec<f32>,
}

impl Trajectory {
    /// Whether the learner can use this trajectory (it may come from another process: issue
    /// #19, a bad action index or a future version panicked the learner): `unroll` steps,
    /// `unroll + 1` observations of `obs_len` finite values, actions below `n_actions`, finite
    /// rewards and log-probabilities, a version no newer than the learner's `newest`.
    pub fn check(&self, unroll: usize, obs_len: usize, n_actions: usize, newest: u64) -> Result<(), String> {
        if self.actions.len() != unroll || self.rewards.len() != unroll || self.dones.len() != unroll || self.behaviour_logp.len() != unroll
        {
            return Err(format!("{} steps, the unroll is {unroll}", self.actions.len()));
        }
        if self.obs.len() != (unroll + 1) * obs_len {
            return Err(format!(
                "{} observation values, expected {} ({} of {obs_len})",
                self.obs.len(),
                (unroll + 1) * obs_len,
                unroll + 1
            ));
        }
        if let Some(a) = self.actions.iter().find(|&&a| a >= n_actions) {
            return Err(format!("action {a} of {n_actions}"));
        }
        if self.version > newest {
            return Err(format!("policy version {} is newer than the learner's {newest}", self.version));
        }
        let finite = |v: &[f32]| v.iter().all(|x| x.is_finite());
        if !finite(&self.obs) || !finite(&self.rewards) || !finite(&self.behaviour_logp) || !finite(&self.finished) {
            return Err("a non-finite observation, reward, log-probability or return".into());
        }
        Ok(())
    }
}

/// The published policy: its version (learner steps) and flat parameters.
type Published = Arc<RwLock<Arc<(u64, Vec<f32>)>>>;

/// An actor's environment and where it is in its episode.
struct Unroller {
    env: Box<dyn Env>,
    rng: Rng,
    obs: Vec<f32>,
    ret: f32,
    sizes: Vec<usize>,
    unroll: usize,
}

impl Unroller {
    fn new(cfg: &ImpalaConfig, id: usize, sizes: Vec<usize>) -> Unroller {
        let mut env = cfg.env.make();
        let mut rng = Rng::new(cfg.seed.wrapping_mul(1_000_003).wrapping_add(id as u64 + 1));
        let obs = env.reset(&mut rng);
        Unroller { env, rng, obs, ret: 0.0, sizes, unroll: cfg.unroll }
    }

    /// `unroll` steps with the policy `params` of `version`.
    fn run(&mut self, params: &[f32], version: u64) -> Trajectory {
        let a = self.env.actions();
        let mut t = Trajectory {
            obs: Vec::with_capacity((self.unroll + 1) * self.obs.len()),
            actions: Vec::new(),
            rewards: Vec::new(),
            dones: Vec::new(),
            behaviour_logp: Vec::new(),
            version,
            finished: Vec::new(),
        };
        for _ in 0..self.unroll {
            t.obs.extend_from_slice(&self.obs);
            let out = policy::mlp_eval(params, &self.sizes, &self.obs);
            let (action, logp) = policy::sample(&out[..a], &mut self.rng);
            let (next, r, done) = self.env.step(action);
            self.ret += r;
            t.actions.push(action);
            t.rewards.push(r);
            t.dones.push(done);
            t.behaviour_logp.push(logp);
            self.obs = if done {
                t.finished.push(self.ret);
                self.ret = 0.0;
                self.env.reset(&mut self.rng)
            } else {
                next
            };
        }
        t.obs.extend_from_slice(&self.obs);
        t
    }
}

/// Hands a trajectory to the learner's queue without waiting: a full queue drops it (counted).
fn offer(out: &SyncSender<Trajectory>, t: Trajectory, dropped: &AtomicU64) -> bool {
    match out.try_send(t) {
        Ok(()) => true,
        Err(TrySendError::Full(_)) => {
            dropped.fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(TrySendError::Disconnected(_)) => false,
    }
}

#[allow(clippy::too_many_arguments)]
fn actor(
    cfg: ImpalaConfig,
    id: usize,
    sizes: Vec<usize>,
    policy_params: Published,
    out: SyncSender<Trajectory>,
    stop: Arc<AtomicBool>,
    steps: Arc<AtomicU64>,
    dropped: Arc<AtomicU64>,
) {
    let mut u = Unroller::new(&cfg, id, sizes);
    while !stop.load(Ordering::Relaxed) {
        // The newest policy there is; never waits for a new one.
        let snapshot = policy_params.read().unwrap_or_else(|p| p.into_inner()).clone();
        let t = u.run(&snapshot.1, snapshot.0);
        steps.fetch_add(cfg.unroll as u64, Ordering::Relaxed);
        if !offer(&out, t, &dropped) {
            return;
        }
    }
}

/// What an actor process sends the learner.
#[derive(Clone, Debug, PartialEq)]
pub enum ActorReq {
    /// The first message: the current policy, please.
    Hello,
    /// A trajectory made with policy version `t.version`.
    Trajectory(Trajectory),
}

/// What the learner answers.
#[derive(Clone, Debug, PartialEq)]
pub enum LearnerResp {
    /// A newer policy.
    Params {
        version: u64,
        params: Vec<f32>,
    },
    /// Taken (or dropped by a full queue); the actor's policy is still the newest.
    Ack,
    /// The run is over.
    Stop,
    Error(String),
}

impl ActorReq {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = kolo_ps::codec::Writer::default();
        match self {
            ActorReq::Hello => {
                w.u8(1);
            }
            ActorReq::Trajectory(t) => {
                w.u8(2)
                    .u64(t.version)
                    .f32s(&t.obs)
                    .u32s(&t.actions.iter().map(|&a| a as u32).collect::<Vec<_>>())
                    .f32s(&t.rewards)
                    .f32s(&t.behaviour_logp)
                    .f32s(&t.finished);
                w.u64(t.dones.len() as u64);
                for d in &t.dones {
                    w.u8(u8::from(*d));
                }
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<ActorReq, kolo_ps::PsError> {
        let mut r = kolo_ps::codec::Reader::new(b);
        let req = match r.u8()? {
            1 => ActorReq::Hello,
            2 => {
                let version = r.u64()?;
                let obs = r.f32s()?;
                let actions: Vec<usize> = r.u32s()?.into_iter().map(|a| a as usize).collect();
                let (rewards, behaviour_logp, finished) = (r.f32s()?, r.f32s()?, r.f32s()?);
                let n = r.u64()? as usize;
                if n != actions.len() || rewards.len() != n || behaviour_logp.len() != n {
                    return Err(kolo_ps::PsError::Protocol(format!(
                        "a trajectory of {n} steps with {} actions, {} rewards, {} log-probabilities",
                        actions.len(),
                        rewards.len(),
                        behaviour_logp.len()
                    )));
                }
                let dones = (0..n).map(|_| Ok(r.u8()? != 0)).collect::<Result<_, kolo_ps::PsError>>()?;
                ActorReq::Trajectory(Trajectory { obs, actions, rewards, dones, behaviour_logp, version, finished })
            }
            t => return Err(kolo_ps::PsError::Protocol(format!("unknown actor message tag {t}"))),
        };
        r.end()?;
        Ok(req)
    }
}

impl LearnerResp {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = kolo_ps::codec::Writer::default();
        match self {
            LearnerResp::Params { version, params } => {
                w.u8(1).u64(*version).f32s(params);
            }
            LearnerResp::Ack => {
                w.u8(2);
            }
            LearnerResp::Stop => {
                w.u8(3);
            }
            LearnerResp::Error(m) => {
                w.u8(4).str(m);
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<LearnerResp, kolo_ps::PsError> {
        let mut r = kolo_ps::codec::Reader::new(b);
        let resp = match r.u8()? {
            1 => LearnerResp::Params { version: r.u64()?, params: r.f32s()? },
            2 => LearnerResp::Ack,
            3 => LearnerResp::Stop,
            4 => LearnerResp::Error(r.str()?),
            t => return Err(kolo_ps::PsError::Protocol(format!("unknown learner answer tag {t}"))),
        };
        r.end()?;
        Ok(resp)
    }
}

kolo_ps::protocol!(
    /// Actor processes and the learner (handshake purpose "impala").
    ImpalaProtocol, "impala", ActorReq, LearnerResp, LearnerResp::Error
);

/// An actor process: connects to the learner at `addr`, unrolls with the newest policy it has
/// and sends each trajectory; a newer policy comes back with the answer. Never waits for the
/// learner beyond the round trip. Returns the environment steps it took.
pub fn actor_process(cfg: &ImpalaConfig, addr: &str, token: &kolo_rendezvous::JobToken, id: usize) -> Result<u64, ImpalaError> {
    let e = |e: kolo_ps::PsError| ImpalaError::Failed(format!("actor {id}: {e}"));
    let mut conn = kolo_ps::net::Channel::<ImpalaProtocol>::connect(addr, token, std::time::Duration::from_secs(30)).map_err(e)?;
    let probe = cfg.env.make();
    let mut sizes = vec![probe.obs_len()];
    sizes.extend(&cfg.hidden);
    sizes.push(probe.actions() + 1);
    let mut u = Unroller::new(cfg, id, sizes);
    let (mut version, mut params) = match conn.call(&ActorReq::Hello).map_err(e)? {
        LearnerResp::Params { version, params } => (version, params),
        LearnerResp::Stop => return Ok(0),
        other => return Err(ImpalaError::Failed(format!("actor {id}: the learner answered {other:?}"))),
    };
    let mut steps = 0;
    loop {
        let t = u.run(&params, version);
        steps += cfg.unroll as u64;
        match conn.call(&ActorReq::Trajectory(t)).map_err(e)? {
            LearnerResp::Params { version: v, params: p } => {
                version = v;
                params = p;
            }
            LearnerResp::Ack => {}
            LearnerResp::Stop => return Ok(steps),
            LearnerResp::Error(m) => return Err(ImpalaError::Failed(format!("actor {id}: the learner refused: {m}"))),
        }
    }
}

/// Actors in other processes: the learner listens on `listen` for them (job token `token`) and
/// calls `spawn` with its address once it does.
pub struct RemoteActors<'a> {
    pub listen: &'a str,
    pub token: kolo_rendezvous::JobToken,
    pub spawn: &'a mut dyn FnMut(&str) -> Result<(), ImpalaError>,
}

/// Runs IMPALA until `max_env_steps` learned from or the target; `on_progress` sees (learned
/// env steps, mean return). Actors are threads of this process.
pub fn run(cfg: &ImpalaConfig, on_progress: &mut dyn FnMut(u64, f64)) -> Result<ImpalaReport, ImpalaError> {
    run_with(cfg, None, on_progress)
}

/// [`run`], with the actors in other processes when `remote` is given.
pub fn run_with(
    cfg: &ImpalaConfig,
    remote: Option<RemoteActors<'_>>,
    on_progress: &mut dyn FnMut(u64, f64),
) -> Result<ImpalaReport, ImpalaError> {
    if cfg.actors == 0 || cfg.unroll == 0 || cfg.batch == 0 {
        return Err(ImpalaError::Config("impala: actors, unroll and batch must be at least 1".into()));
    }
    let probe = cfg.env.make();
    let (obs_len, a) = (probe.obs_len(), probe.actions());
    let mut sizes = vec![obs_len];
    sizes.extend(&cfg.hidden);
    sizes.push(a + 1);
    let model = Mlp::new(obs_len, &cfg.hidden, a + 1, &mut Rng::new(cfg.seed))?;
    let numel = model.params().numel();
    let published: Published = Arc::new(RwLock::new(Arc::new((0, model.params().to_flat()?))));
    let (tx, rx): (SyncSender<Trajectory>, Receiver<Trajectory>) = sync_channel(cfg.queue.max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let (steps, dropped) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let listener = match remote {
        Some(r) => Some(serve_actors(r, cfg.unroll, &tx, &published, &stop, &steps, &dropped)?),
        None => None,
    };
    let local_actors = if listener.is_some() { 0 } else { cfg.actors };
    let actors: Vec<_> = (0..local_actors)
        .map(|id| {
            let (c, s, p, o, st, n, d) =
                (cfg.clone(), sizes.clone(), published.clone(), tx.clone(), stop.clone(), steps.clone(), dropped.clone());
            std::thread::Builder::new()
                .name(format!("kolo-actor-{id}"))
                .spawn(move || actor(c, id, s, p, o, st, n, d))
                .expect("spawning an actor")
        })
        .collect();
    drop(tx);
    let mut opt = Optimizer::new(OptimizerSpec::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false }, numel);
    let t0 = Instant::now();
    let (mut learner_steps, mut solved_at, mut rejected) = (0u64, None, 0u64);
    let mut seen = Seen::default();
    let te = kolo_tensor::TensorError::from;
    let mut grads = vec![0f32; numel];
    let result = (|| -> Result<(), ImpalaError> {
        loop {
            let batch = next_batch(cfg, &rx, (obs_len, a), learner_steps, &mut rejected)?;
            seen.note(&batch, learner_steps);
            let loss = vtrace_loss(cfg, &model, &batch, obs_len, a)?;
            let g = loss.backward().map_err(te)?;
            model.params().grads_into(&g, &mut grads)?;
            let f = clip_factor(kolo_base::sum_of_squares(&grads).sqrt(), cfg.clip_norm);
            grads.iter_mut().for_each(|g| *g *= f);
            opt.begin_step();
            for i in 0..model.params().len() {
                let r = model.params().get(i).range.clone();
                model.params().update_one(i, &mut |p| opt.update(r.start, p, &grads[r.clone()], cfg.lr))?;
            }
            learner_steps += 1;
            *published.write().unwrap_or_else(|p| p.into_inner()) = Arc::new((learner_steps, model.params().to_flat()?));
            let learned = learner_steps * (cfg.batch * cfg.unroll) as u64;
            let m = seen.mean_return();
            if learner_steps.is_multiple_of(50) {
                on_progress(learned, m);
            }
            if let Some(target) = cfg.target {
                if seen.recent.len() == 100 && m >= target && solved_at.is_none() {
                    solved_at = Some(learned);
                    return Ok(());
                }
            }
            if learned >= cfg.max_env_steps {
                return Ok(());
            }
        }
    })();
    stop.store(true, Ordering::Relaxed);
    // Actor processes hear Stop on their next message; give them a moment, then close.
    if listener.is_some() {
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    drop(listener);
    drop(rx);
    for h in actors {
        let _ = h.join();
    }
    result?;
    let secs = t0.elapsed().as_secs_f64();
    let env_steps = steps.load(Ordering::Relaxed);
    Ok(ImpalaReport {
        env_steps,
        learned_steps: learner_steps * (cfg.batch * cfg.unroll) as u64,
        learner_steps,
        episodes: seen.episodes,
        mean_return: seen.mean_return(),
        solved_at,
        secs,
        env_steps_per_s: env_steps as f64 / secs.max(1e-9),
        dropped: dropped.load(Ordering::Relaxed),
        rejected,
        max_lag: seen.max_lag,
        mean_lag: seen.lag_sum as f64 / seen.lag_n.max(1) as f64,
    })
}

/// The learner's next batch of well-formed trajectories (malformed ones dropped and counted).
fn next_batch(
    cfg: &ImpalaConfig,
    rx: &Receiver<Trajectory>,
    (obs_len, a): (usize, usize),
    learner_steps: u64,
    rejected: &mut u64,
) -> Result<Vec<Trajectory>, ImpalaError> {
    let mut batch = Vec::with_capacity(cfg.batch);
    while batch.len() < cfg.batch {
        // A deadline: actor processes that all died must not hang the learner.
        let t = rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .map_err(|e| ImpalaError::Failed(format!("no trajectory from any actor for 60 s ({e}): every actor stopped?")))?;
        // One broken or hostile actor must not stop the learner: drop and count.
        if let Err(why) = t.check(cfg.unroll, obs_len, a, learner_steps) {
            *rejected += 1;
            if rejected.is_power_of_two() {
                kolo_base::eline!("impala learner: dropped a malformed trajectory ({why}); {rejected} so far");
            }
            continue;
        }
        batch.push(t);
    }
    Ok(batch)
}

/// What the learner has seen: finished episodes (the last 100 returns) and the policy lag of
/// the trajectories (learner steps between the acting parameters and the learning ones).
#[derive(Default)]
struct Seen {
    episodes: u64,
    recent: std::collections::VecDeque<f32>,
    max_lag: u64,
    lag_sum: u64,
    lag_n: u64,
}

impl Seen {
    fn note(&mut self, batch: &[Trajectory], learner_steps: u64) {
        for t in batch {
            for r in &t.finished {
                self.episodes += 1;
                self.recent.push_back(*r);
                if self.recent.len() > 100 {
                    self.recent.pop_front();
                }
            }
            let lag = learner_steps - t.version;
            self.max_lag = self.max_lag.max(lag);
            self.lag_sum += lag;
            self.lag_n += 1;
        }
    }

    /// The mean return of the last (up to 100) episodes.
    fn mean_return(&self) -> f64 {
        if self.recent.is_empty() {
            0.0
        } else {
            self.recent.iter().map(|&x| f64::from(x)).sum::<f64>() / self.recent.len() as f64
        }
    }
}

/// The learner's end of actor processes: each trajectory goes into the queue (dropped and
/// counted when it is full), each reply carries the newest parameters unless the actor has them.
fn serve_actors(
    r: RemoteActors<'_>,
    unroll: usize,
    tx: &SyncSender<Trajectory>,
    published: &Published,
    stop: &Arc<AtomicBool>,
    steps: &Arc<AtomicU64>,
    dropped: &Arc<AtomicU64>,
) -> Result<kolo_ps::net::Listener, ImpalaError> {
    let (tx, published, stop, steps, dropped) = (tx.clone(), published.clone(), stop.clone(), steps.clone(), dropped.clone());
    let handler: kolo_ps::net::HandlerOf<ImpalaProtocol> = Arc::new(move |_: &mut kolo_ps::net::ConnState, req: ActorReq, _| {
        if stop.load(Ordering::Relaxed) {
            return LearnerResp::Stop;
        }
        let have = match req {
            ActorReq::Hello => None,
            ActorReq::Trajectory(t) => {
                if t.actions.len() != unroll {
                    return LearnerResp::Error(format!("a trajectory of {} steps, the learner unrolls {unroll}", t.actions.len()));
                }
                steps.fetch_add(unroll as u64, Ordering::Relaxed);
                let v = t.version;
                offer(&tx, t, &dropped);
                Some(v)
            }
        };
        let latest = published.read().unwrap_or_else(|p| p.into_inner()).clone();
        if have == Some(latest.0) {
            LearnerResp::Ack
        } else {
            LearnerResp::Params { version: latest.0, params: latest.1.clone() }
        }
    });
    let l = kolo_ps::net::Listener::start_with::<ImpalaProtocol>(r.listen, r.token, "impala", handler)
        .map_err(|e| ImpalaError::Failed(format!("impala learner on {}: {e}", r.listen)))?;
    (r.spawn)(&l.addr.to_string())?;
    Ok(l)
}

/// The learner's loss on a batch of trajectories: V-trace policy gradient, value regression
/// to the V-trace targets (weighted by `baseline`) and an entropy bonus.
fn vtrace_loss(cfg: &ImpalaConfig, model: &Mlp, batch: &[Trajectory], obs_len: usize, a: usize) -> Result<Tensor, ImpalaError> {
    let te = kolo_tensor::TensorError::from;
    // Forward all observations (with the bootstrap ones) at once.
    let rows = cfg.batch * (cfg.unroll + 1);
    let data: Vec<f32> = batch.iter().flat_map(|t| t.obs.iter().copied()).collect();
    let out = model.forward(&Input::Images { data, n: rows, c: 1, h: 1, w: obs_len }, &PlainView)?;
    let logits = out.narrow(1, 0, a).map_err(te)?.contiguous().map_err(te)?;
    let values = out.narrow(1, a, 1).map_err(te)?.squeeze(1).map_err(te)?.contiguous().map_err(te)?;
    let log_probs = kolo_tensor::ops::log_softmax_last(&logits)?;
    let lp_host: Vec<f32> = log_probs.flatten_all().map_err(te)?.to_vec1().map_err(te)?;
    let v_host: Vec<f32> = values.to_vec1().map_err(te)?;
    // V-trace targets and advantages per trajectory (constants for the gradient).
    let (mut idx, mut vs, mut adv, mut rows_used) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (b, t) in batch.iter().enumerate() {
        let base = b * (cfg.unroll + 1);
        let target: Vec<f64> = (0..cfg.unroll).map(|s| f64::from(lp_host[(base + s) * a + t.actions[s]])).collect();
        let log_rhos: Vec<f64> = target.iter().zip(&t.behaviour_logp).map(|(p, m)| p - f64::from(*m)).collect();
        let discounts: Vec<f64> = t.dones.iter().map(|&d| if d { 0.0 } else { cfg.gamma }).collect();
        let rewards: Vec<f64> = t.rewards.iter().map(|&r| f64::from(r)).collect();
        let v: Vec<f64> = (0..cfg.unroll).map(|s| f64::from(v_host[base + s])).collect();
        let vt = vtrace(&log_rhos, &discounts, &rewards, &v, f64::from(v_host[base + cfg.unroll]), cfg.rho_bar, cfg.c_bar);
        for s in 0..cfg.unroll {
            idx.push(((base + s) * a + t.actions[s]) as u32);
            rows_used.push((base + s) as u32);
            vs.push(vt.vs[s] as f32);
            adv.push(vt.advantages[s] as f32);
        }
    }
    let n = idx.len();
    let dev = kolo_tensor::Device::Cpu;
    let picked = log_probs.flatten_all().map_err(te)?.index_select(&Tensor::from_vec(idx, n, &dev).map_err(te)?, 0).map_err(te)?;
    let rows_t = Tensor::from_vec(rows_used, n, &dev).map_err(te)?;
    let v_used = values.index_select(&rows_t, 0).map_err(te)?;
    let adv_t = Tensor::from_vec(adv, n, &dev).map_err(te)?;
    let vs_t = Tensor::from_vec(vs, n, &dev).map_err(te)?;
    let pg = (picked * &adv_t).map_err(te)?.mean_all().map_err(te)?.neg().map_err(te)?;
    let value_loss = ((v_used - vs_t).map_err(te)?.sqr().map_err(te)?.mean_all().map_err(te)? * (0.5 * cfg.baseline)).map_err(te)?;
    let lp_rows = log_probs.index_select(&rows_t, 0).map_err(te)?;
    let entropy = (lp_rows.exp().map_err(te)? * &lp_rows).map_err(te)?.sum(1).map_err(te)?.mean_all().map_err(te)?.neg().map_err(te)?;
    let loss = ((pg + value_loss).map_err(te)? - (entropy * cfg.entropy).map_err(te)?).map_err(te)?;
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// Actor messages come from other processes: valid ones mutated (a byte changed, cut
        /// short, or grown) decode or fail, never panic (issue #19).
        #[test]
        fn mutated_actor_messages_never_panic(which in 0usize..3, pos in proptest::prelude::any::<usize>(), byte in proptest::prelude::any::<u8>(), cut in proptest::prelude::any::<usize>(), mode in 0u8..3) {
            let t = Trajectory { obs: vec![0.5; 9], actions: vec![0, 1], rewards: vec![1.0; 2], dones: vec![false, true], behaviour_logp: vec![-0.7; 2], version: 3, finished: vec![2.0] };
            let msgs = [ActorReq::Hello.encode(), ActorReq::Trajectory(t).encode(), LearnerResp::Params { version: 4, params: vec![0.25; 6] }.encode()];
            let mut b = msgs[which].clone();
            match mode {
                0 => { let i = pos % b.len(); b[i] = byte; }
                1 => b.truncate(cut % (b.len() + 1)),
                _ => b.extend(std::iter::repeat_n(byte, cut % 16)),
            }
            let _ = ActorReq::decode(&b);
            let _ = LearnerResp::decode(&b);
        }
    }

    #[test]
    fn malformed_trajectories_are_refused_with_the_reason() {
        let good = Trajectory {
            obs: vec![0.5; 3 * 4],
            actions: vec![0, 1],
            rewards: vec![1.0; 2],
            dones: vec![false, true],
            behaviour_logp: vec![-0.7; 2],
            version: 3,
            finished: vec![2.0],
        };
        assert_eq!(good.check(2, 4, 2, 3), Ok(()));
        let bad = |f: &dyn Fn(&mut Trajectory)| {
            let mut t = good.clone();
            f(&mut t);
            t.check(2, 4, 2, 3).unwrap_err()
        };
        assert!(bad(&|t| t.actions[1] = 7).contains("action 7 of 2"));
        assert!(bad(&|t| t.version = 4).contains("newer than the learner's 3"));
        assert!(bad(&|t| t.obs.pop().map_or((), |_| ())).contains("observation values"));
        assert!(bad(&|t| t.actions.push(0)).contains("the unroll is 2"));
        assert!(bad(&|t| t.rewards[0] = f32::NAN).contains("non-finite"));
    }

    /// Actor messages survive the wire; truncated or inconsistent ones are errors, never panics.
    #[test]
    fn actor_messages_round_trip_and_garbage_is_refused() {
        let t = Trajectory {
            obs: vec![0.5; 12],
            actions: vec![0, 1],
            rewards: vec![1.0, 1.0],
            dones: vec![false, true],
            behaviour_logp: vec![-0.7, -0.6],
            version: 9,
            finished: vec![17.0],
        };
        for m in [ActorReq::Hello, ActorReq::Trajectory(t.clone())] {
            let b = m.encode();
            assert_eq!(ActorReq::decode(&b).unwrap(), m);
            for cut in 0..b.len() {
                assert!(ActorReq::decode(&b[..cut]).is_err());
            }
        }
        for m in [
            LearnerResp::Params { version: 3, params: vec![1.0, 2.0] },
            LearnerResp::Ack,
            LearnerResp::Stop,
            LearnerResp::Error("x".into()),
        ] {
            assert_eq!(LearnerResp::decode(&m.encode()).unwrap(), m);
        }
        let mut bad = t;
        bad.rewards.pop();
        assert!(ActorReq::decode(&ActorReq::Trajectory(bad).encode()).is_err(), "step counts must agree");
    }
}
