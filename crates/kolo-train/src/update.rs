//! The data-parallel update: after backward, wait for the gradient buckets, let the caller
//! check, unscale and clip them, and step the optimizer, on the whole model (DDP) or on this
//! rank's shard (ZeRO-1/2/3), then gather the updated shards back into the model. The CLI's
//! loop and the library's [`Trainer`](../../kolo/struct.Trainer.html) share it.

use crate::TrainError;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::{BucketGrads, Ddp, ShardPlan, Sharding, SyncStats};
use kolo_optim::{clip_factor, Buffer, LossScaler, Optimizer};
use kolo_tensor::ParamSet;

/// Where [`backward_routed`] hands each parameter's gradient.
pub enum GradRoute<'a> {
    /// DDP's buckets (`Ddp::sink`), each gradient as backward makes it final: the micro-step
    /// that communicates (a full bucket's all-reduce overlaps the rest of backward).
    Buckets(&'a dyn kolo_base::GradSink),
    /// This flat buffer, at each parameter's range of `ParamSet` (zero where none arrives): a micro-step
    /// that keeps its gradients local (accumulation, a local SGD step).
    Local(&'a ParamSet, &'a mut [f32]),
}

/// Why [`backward_routed`] failed.
#[derive(Debug)]
pub enum RouteError {
    /// A variable that is not a parameter received a gradient (its shape): Kolo would neither
    /// synchronise nor update it.
    Outside(Vec<usize>),
    Backward(candle_core::Error),
    /// Deterministic mode: a gradient beyond the exact sum's range (see [`add_piece`]).
    Diverged(TrainError),
}

impl From<RouteError> for TrainError {
    fn from(e: RouteError) -> TrainError {
        TrainError::Tensor(match e {
            RouteError::Outside(dims) => {
                kolo_tensor::TensorError::Input(format!("a variable of shape {dims:?} that is not a parameter received a gradient"))
            }
            RouteError::Backward(e) => e.into(),
            RouteError::Diverged(e) => return e,
        })
    }
}

/// Backward of `loss`, each variable's gradient handed on as the reverse walk makes it final
/// (`Tensor::backward_with_hook`: every op that reads the variable is differentiated by then)
/// to `route`, by `ids` (a variable's id to its parameter index; a parameter read several times
/// arrives once, summed). The gradient of `capture` (a pipeline stage's input, not a
/// parameter) is returned instead. A half-precision gradient is widened to f32, a GPU one
/// copied to the host. The library's `Trainer`'s (a user's model and `kolo train`'s).
pub fn backward_routed(
    loss: &kolo_tensor::Tensor,
    ids: &std::collections::HashMap<candle_core::TensorId, usize>,
    route: GradRoute<'_>,
    capture: Option<candle_core::TensorId>,
) -> Result<Option<kolo_tensor::Tensor>, RouteError> {
    let mut route = route;
    // Local: which parameters received a gradient (the others are zeroed after the walk).
    let mut got = match &route {
        GradRoute::Local(params, _) => vec![false; params.len()],
        GradRoute::Buckets(_) => Vec::new(),
    };
    let (mut outside, mut captured) = (None, None);
    let done = loss.backward_with_hook(&mut |var, grad| {
        if Some(var.id()) == capture {
            captured = Some(grad);
            return Ok(());
        }
        let Some(&i) = ids.get(&var.id()) else {
            outside.get_or_insert(var.dims().to_vec());
            return Err(candle_core::Error::Msg("kolo: gradient of a variable that is not a parameter".into()));
        };
        let deliver = |g: &[f32]| match &mut route {
            GradRoute::Buckets(sink) => sink.grad_ready(i, g),
            GradRoute::Local(params, buf) => {
                buf[params.get(i).range.clone()].copy_from_slice(g);
                got[i] = true;
            }
        };
        kolo_tensor::with_f32(&grad, deliver).map_err(|e| candle_core::Error::Msg(e.to_string()))
    });
    match (done, outside) {
        (_, Some(dims)) => Err(RouteError::Outside(dims)),
        (Err(e), None) => Err(RouteError::Backward(e)),
        (Ok(_), None) => {
            // A parameter the loss does not reach gets no gradient: zero, not the last step's.
            if let GradRoute::Local(params, buf) = route {
                for i in got.iter().enumerate().filter(|(_, g)| !**g).map(|(i, _)| i) {
                    buf[params.get(i).range.clone()].fill(0.0);
                }
            }
            Ok(captured)
        }
    }
}

/// The data-parallel engine, the optimizer and the state of a replica's step (the library's
/// `Trainer`'s, which is `kolo train`'s data-parallel strategy too), built from the `[ddp]` and
/// `[optim]` tables, and stepped one way: [`Engine::backward`] for every micro-step
/// ([`Engine::backward_piece`] for each piece in deterministic mode), then [`Engine::update`],
/// which ends the step as its settings say: the buckets' exchange, a local step (local SGD,
/// `skip_sync`) or deterministic mode's exact sum.
pub struct Engine {
    pub ddp: Ddp,
    /// ZeRO-1/2/3: this rank's shard plan.
    pub zero: Option<ShardPlan>,
    /// The optimizer over the whole model, or over this rank's shard under ZeRO, with the
    /// parameter groups' weight decay and learning-rate scales.
    pub opt: Optimizer,
    /// ZeRO-1/2: this rank's master copy of its shard (see [`Engine::set_master`]; under
    /// ZeRO-3 the DDP engine holds it); empty otherwise.
    pub master: Buffer,
    /// Gradients of a micro-step that keeps them local (accumulation, local SGD, a piece in
    /// deterministic mode), in the flat layout; empty when no micro-step does.
    pub local: Vec<f32>,
    /// `ddp.deterministic`: the exact (fixed-point) sum of this rank's pieces' gradients.
    pub exact: Option<kolo_ddp::exact::ExactSum>,
    /// f16: the dynamic loss scale (torch's `GradScaler`).
    pub scaler: Option<LossScaler>,
    /// `train.on_nonfinite = "skip"`: the steps skipped so far.
    pub nonfinite_skipped: u64,
    /// `ddp.skip_sync` and `ddp.local_sgd`: which steps exchange no gradient.
    skip_sync: bool,
    local_sgd: Option<crate::config::LocalSgdConfig>,
}

/// What the reduced gradients are checked and scaled by before an [`Engine::update`].
#[derive(Clone, Copy)]
pub struct Checks<'a> {
    /// The data-parallel group (sums of a sharded norm, the overflow flag).
    pub comm: &'a dyn Communicator,
    /// `optim.clip_grad_norm`.
    pub clip: Option<f64>,
    /// Tensor parallelism: which parameters are split over the group (their squares are summed
    /// over it; the replicated ones counted once, by member 0), and the group.
    pub tp: Option<(&'a [bool], &'a dyn kolo_base::GroupSum)>,
    /// Test hook: this rank's gradients overflow.
    pub inject_inf: bool,
    /// `train.on_nonfinite = "skip"`: a step whose gradients hold a NaN or an infinity on any
    /// rank is skipped on every rank.
    pub skip_nonfinite: bool,
}

/// How a step ends ([`Engine::update`]).
pub struct StepEnd<'a> {
    /// The optimizer step (0-based: the steps done before it) and its learning rate.
    pub step: u64,
    pub lr: f32,
    pub checks: Checks<'a>,
    /// Deterministic mode: the pieces of the whole step over every rank.
    pub pieces: usize,
    /// A local step's gradient (this rank's, in the trainer's flat layout with each parameter's
    /// range) made its replica's before the update, on a mesh: averaged over a
    /// sequence-parallel group (its members hold chunks of the same sequences), the parameters
    /// several members hold summed over them and scaled as the buckets' are (expert
    /// parallelism, parameters tied across pipeline stages).
    pub local_grads: Option<&'a LocalGrads<'a>>,
}

/// See [`StepEnd::local_grads`].
pub type LocalGrads<'a> = dyn Fn(&mut [f32], &[std::ops::Range<usize>]) -> Result<(), TrainError> + 'a;

/// What an [`Engine::update`] did.
pub struct Updated {
    pub stats: SyncStats,
    /// Whether the exchange ran beside backward (the buckets'), so that `stats`' hidden
    /// fraction means something; a local or exact step's exchange follows backward.
    pub overlapped: bool,
    /// Whether the optimizer stepped (not when f16's gradients overflowed, or a non-finite
    /// gradient was skipped).
    pub applied: bool,
    /// The global gradient norm before clipping, when clipping.
    pub norm: Option<f64>,
}

impl Updated {
    /// The step as the reports show it (`step_ms` left for the caller): the wait for the
    /// exchange, its bytes and the share of it hidden behind backward (none of an exchange that
    /// followed backward). A `local` step waits for nothing; local SGD's averaging (`local_sgd`)
    /// is its traffic. `skipped_steps`: f16's overflows so far.
    pub fn record(&self, local: bool, local_sgd: bool, skipped_steps: u64) -> crate::report::StepRecord {
        let s = &self.stats;
        match local {
            true => crate::report::StepRecord { comm_bytes: local_sgd.then_some(s.bytes), skipped_steps, ..Default::default() },
            false => crate::report::StepRecord {
                step_ms: 0.0,
                wait_ms: Some(s.wait.as_secs_f64() * 1e3),
                comm_bytes: Some(s.bytes),
                hidden: Some(if self.overlapped { s.hidden_fraction() } else { 0.0 }),
                skipped_steps,
            },
        }
    }
}

/// Why an [`Engine`] could not be built.
#[derive(Debug)]
pub enum EngineError {
    /// A setting (its name) and what is wrong with it.
    Setting(&'static str, String),
    /// `optim.offload_dir` (the directory) could not hold the optimizer's state.
    Offload(String, std::io::Error),
    Ddp(kolo_ddp::DdpError),
}

impl From<EngineError> for TrainError {
    fn from(e: EngineError) -> TrainError {
        match e {
            EngineError::Setting(_, reason) => TrainError::Config(reason),
            EngineError::Offload(dir, e) => TrainError::Config(format!("optim.offload_dir {dir:?}: {e}")),
            EngineError::Ddp(e) => TrainError::Ddp(e),
        }
    }
}

impl Engine {
    /// The DDP engine over `comm` for parameters of `signature` (rank 0's signature checked
    /// on every rank) with `ddp`'s buckets, deadline and gradient codec, sharded as `sharding`
    /// (ZeRO-3: the parameter groups `groups`), and the optimizer `spec` with `optim`'s
    /// parameter groups and placement. Collective.
    pub fn build(
        comm: std::sync::Arc<dyn Communicator>,
        signature: &[(String, Vec<usize>)],
        ddp: &crate::config::DdpConfig,
        optim: &crate::config::OptimConfig,
        spec: kolo_optim::OptimizerSpec,
        sharding: Sharding,
        groups: Vec<Vec<usize>>,
    ) -> Result<Engine, EngineError> {
        let setting = |name: &'static str| move |reason: String| EngineError::Setting(name, reason);
        let timeout = ddp.timeout();
        comm.set_timeout(timeout);
        let (compression, compression_warmup) = ddp.compression().map_err(setting("ddp.compression"))?;
        let cfg = kolo_ddp::DdpConfig {
            bucket_cap: ddp.bucket_cap().map_err(setting("ddp.bucket_cap"))?,
            first_bucket_cap: ddp.first_bucket_cap().map_err(setting("ddp.first_bucket_cap"))?,
            timeout,
            sharding,
            groups,
            compression,
            compression_warmup,
        };
        let engine = Ddp::new(comm, signature, cfg).map_err(EngineError::Ddp)?;
        let zero = (sharding != Sharding::None).then(|| engine.shard_plan().clone());
        let numel: usize = signature.iter().map(|(_, shape)| shape.iter().product::<usize>()).sum();
        let offload = |e| EngineError::Offload(optim.offload_dir.clone().unwrap_or_default(), e);
        let mut opt = Optimizer::with_placement(spec, zero.as_ref().map_or(numel, |z| z.len), &optim.placement()).map_err(offload)?;
        crate::param_groups::apply(&mut opt, signature, engine.ranges(), zero.as_ref(), optim).map_err(setting("optim.groups"))?;
        let exact = ddp.deterministic.then(|| kolo_ddp::exact::ExactSum::new(numel));
        let master = Buffer::zeros(0, &kolo_optim::Placement::Memory, "master").map_err(offload)?;
        let (skip_sync, local_sgd) = (ddp.skip_sync, ddp.local_sgd.clone());
        Ok(Engine { ddp: engine, zero, opt, master, local: Vec::new(), exact, scaler: None, nonfinite_skipped: 0, skip_sync, local_sgd })
    }

    /// Collective: `params` take rank 0's values on every rank, and ZeRO's master shard is cut
    /// from them ([`Engine::set_master`]).
    pub fn start(&mut self, params: &ParamSet, optim: &crate::config::OptimConfig) -> Result<(), TrainError> {
        let mut flat = params.to_flat()?;
        self.ddp.broadcast_params(&mut flat)?;
        params.load(&flat)?;
        Ok(self.set_master(&flat, optim)?)
    }

    /// A checkpoint's values `flat` (the whole flat layout) and f16 `loss_scale` taken on: into
    /// the parameters that are resident (not a ZeRO-3 group's, whose shard is the master),
    /// the loss scaler and ZeRO's master shard.
    pub fn set_values(&mut self, params: &ParamSet, flat: &[f32], loss_scale: Option<(f64, u64, u64)>) -> Result<(), TrainError> {
        for i in (0..params.len()).filter(|&i| params.is_resident(i)) {
            params.load_one(i, &flat[self.ddp.ranges()[i].clone()])?;
        }
        if let (Some(s), Some(state)) = (self.scaler.as_mut(), loss_scale) {
            s.restore(state);
        }
        self.place_master(flat);
        Ok(())
    }

    /// [`Engine::load`] then [`Engine::set_values`]: this rank continues a data-parallel
    /// checkpoint. Returns what was read and the notes for the log.
    pub fn resume(
        &mut self,
        path: &std::path::Path,
        params: &ParamSet,
        meta: &std::collections::BTreeMap<String, String>,
        local_sgd: bool,
    ) -> Result<(crate::checkpointing::Resumed, Vec<String>), TrainError> {
        let mut flat = vec![0f32; params.numel()];
        let (r, notes) = self.load(path, params, &mut flat, meta, local_sgd)?;
        self.set_values(params, &flat, r.loss_scale)?;
        Ok((r, notes))
    }

    /// ZeRO-1/2: this rank's master copy of its shard of the whole model's values `flat`, where
    /// `optim.offload_dir` puts it. ZeRO-3: `ddp` keeps the shard (the buffer stays empty).
    pub fn set_master(&mut self, flat: &[f32], optim: &crate::config::OptimConfig) -> Result<(), EngineError> {
        let zero3 = self.ddp.sharding() == Sharding::Parameters;
        let len = if zero3 { 0 } else { self.zero.as_ref().map_or(0, |z| z.len) };
        self.master = Buffer::zeros(len, &optim.placement(), "master")
            .map_err(|e| EngineError::Offload(optim.offload_dir.clone().unwrap_or_default(), e))?;
        self.place_master(flat);
        Ok(())
    }

    /// [`Engine::set_master`]'s values written again (a resume): this rank's shard of `flat`
    /// into the master buffer (ZeRO-1/2) or into `ddp` (ZeRO-3).
    pub fn place_master(&mut self, flat: &[f32]) {
        let Some(z) = &self.zero else { return };
        if self.ddp.sharding() == Sharding::Parameters {
            let mut m = vec![0f32; z.len];
            z.gather(self.ddp.ranges(), flat, &mut m);
            self.ddp.set_master(m);
        } else {
            z.gather(self.ddp.ranges(), flat, self.master.as_mut_slice());
            self.master.release_all();
        }
    }

    /// Backward of one micro-step's `loss` (already scaled for accumulation and f16's loss
    /// scale): with `communicate` each gradient goes to DDP's buckets as backward makes it
    /// final (their all-reduces overlap the rest of backward), otherwise into the local
    /// accumulator. Returns the gradient of `capture` (see [`backward_routed`]).
    pub fn backward(
        &mut self,
        loss: &kolo_tensor::Tensor,
        ids: &std::collections::HashMap<candle_core::TensorId, usize>,
        params: &ParamSet,
        communicate: bool,
        capture: Option<candle_core::TensorId>,
    ) -> Result<Option<kolo_tensor::Tensor>, RouteError> {
        if communicate {
            self.ddp.begin_backward();
            return backward_routed(loss, ids, GradRoute::Buckets(&*self.ddp.sink()), capture);
        }
        self.local.resize(params.numel(), 0.0);
        let captured = backward_routed(loss, ids, GradRoute::Local(params, &mut self.local), capture)?;
        self.ddp.accumulate(&self.local);
        Ok(captured)
    }

    /// Deterministic mode, one piece of a micro-batch: the gradient of its own mean `loss`
    /// added exactly to the step's sum. `at` = (rank, step) for the error.
    pub fn backward_piece(
        &mut self,
        loss: &kolo_tensor::Tensor,
        ids: &std::collections::HashMap<candle_core::TensorId, usize>,
        params: &ParamSet,
        at: (usize, u64),
    ) -> Result<(), RouteError> {
        self.local.resize(params.numel(), 0.0);
        backward_routed(loss, ids, GradRoute::Local(params, &mut self.local), None)?;
        let exact = self.exact.get_or_insert_with(|| kolo_ddp::exact::ExactSum::new(params.numel()));
        add_piece(exact, &self.local, at).map_err(RouteError::Diverged)
    }

    /// Whether optimizer step `step` (0-based) exchanges no gradient: every step under
    /// `ddp.skip_sync` (a benchmark mode), a local SGD step past its warm-up.
    pub fn is_local_step(&self, step: u64) -> bool {
        self.skip_sync || crate::local_sgd::is_local(self.local_sgd.as_ref(), step)
    }

    /// Whether the last micro-step of optimizer step `step` hands its gradients to the buckets
    /// (the others, and a local step's, are accumulated locally).
    pub fn communicates(&self, last_micro: bool, step: u64) -> bool {
        last_micro && !self.is_local_step(step) && self.exact.is_none()
    }

    /// The end of an optimizer step, after its micro-steps' backward. Deterministic mode: every
    /// rank's pieces summed exactly, clipped and applied. A local step: this rank's accumulated
    /// gradient, clipped by its own norm (the replica's under `checks.tp`), updates its own
    /// model, and local SGD averages the models when due. Otherwise the buckets: waits for them,
    /// checks, unscales and clips the gradients (`extra` first sees them, on a mesh), steps the
    /// optimizer on the model or this rank's shard, and gathers the shards back. Collective.
    pub fn update(
        &mut self,
        params: &ParamSet,
        end: &StepEnd<'_>,
        extra: &mut dyn FnMut(&mut BucketGrads<'_>) -> Result<(), TrainError>,
    ) -> Result<Updated, TrainError> {
        let (step, lr, clip) = (end.step, end.lr, end.checks.clip);
        let stats = |wait: std::time::Duration, bytes: usize| SyncStats { wait, comm: wait, bytes, ..Default::default() };
        if self.exact.is_some() {
            let s = self.exact_update(params, end.pieces, clip, lr)?;
            return Ok(Updated { stats: stats(s.wait, s.bytes), overlapped: false, applied: true, norm: s.norm });
        }
        if self.is_local_step(step) {
            let norm = self.local_update(params, clip, end.checks.tp, end.local_grads, lr)?;
            let t = std::time::Instant::now();
            let bytes = match self.local_sgd.as_ref() {
                Some(l) if crate::local_sgd::is_local(Some(l), step) => {
                    crate::local_sgd::after_update(l, step, params, &**self.ddp.comm())?
                }
                _ => 0,
            };
            return Ok(Updated { stats: stats(t.elapsed(), bytes), overlapped: false, applied: true, norm });
        }
        self.bucket_update(params, lr, end.checks, extra)
    }

    /// [`Engine::update`] of a step whose last micro-step communicated.
    fn bucket_update(
        &mut self,
        params: &ParamSet,
        lr: f32,
        checks: Checks<'_>,
        extra: &mut dyn FnMut(&mut BucketGrads<'_>) -> Result<(), TrainError>,
    ) -> Result<Updated, TrainError> {
        let mut prep = GradPrep { checks, scaler: self.scaler.as_mut(), norm: None };
        let mut prepare = |g: &mut BucketGrads<'_>, sharded: bool| {
            extra(g)?;
            prep.run(g, sharded)
        };
        let (stats, applied) = apply_update(&self.ddp, params, &mut self.opt, self.zero.as_ref(), &mut self.master, lr, &mut prepare)?;
        let norm = prep.norm;
        // f16's scaler counts its own skipped steps.
        if !applied && self.scaler.is_none() {
            self.nonfinite_skipped += 1;
        }
        Ok(Updated { stats, overlapped: true, applied, norm })
    }

    /// A local step (see [`apply_local`]): this rank's accumulated gradient updates its own
    /// model. Returns the norm when clipping.
    fn local_update(
        &mut self,
        params: &ParamSet,
        clip: Option<f64>,
        group: Option<(&[bool], &dyn kolo_base::GroupSum)>,
        local_grads: Option<&LocalGrads<'_>>,
        lr: f32,
    ) -> Result<Option<f64>, TrainError> {
        self.local.resize(params.numel(), 0.0);
        apply_local(&self.ddp, params, &mut self.opt, &mut self.local, clip, group, local_grads, lr)
    }

    /// Deterministic mode's exchange and update (see [`apply_exact`]) over `pieces` pieces in
    /// the whole step.
    fn exact_update(&mut self, params: &ParamSet, pieces: usize, clip: Option<f64>, lr: f32) -> Result<ExactStats, TrainError> {
        self.local.resize(params.numel(), 0.0);
        let Some(exact) = self.exact.as_mut() else { return Ok(ExactStats { bytes: 0, wait: Default::default(), norm: None }) };
        let comm = self.ddp.comm().clone();
        apply_exact(
            &*comm,
            exact,
            pieces,
            &self.ddp,
            self.zero.as_ref(),
            params,
            &mut self.opt,
            &mut self.master,
            &mut self.local,
            clip,
            lr,
        )
    }

    /// Loads a data-parallel checkpoint (written by [`Replica::save`], at any world size or
    /// ZeRO stage) into this rank: the model's values into `flat` (the whole flat layout of
    /// `params`), the optimizer's state (this rank's shard under ZeRO), the gradient codec's
    /// state, and under local SGD (`local_sgd`) this rank's own model and optimizer state.
    /// Without local SGD every replica starts from the checkpoint's model, even one written
    /// under local SGD (DDP needs its replicas equal). Returns what was read and the notes for
    /// the log.
    pub fn load(
        &mut self,
        path: &std::path::Path,
        params: &ParamSet,
        flat: &mut [f32],
        meta: &std::collections::BTreeMap<String, String>,
        local_sgd: bool,
    ) -> Result<(crate::checkpointing::Resumed, Vec<String>), TrainError> {
        let ddp = &self.ddp;
        let r = crate::checkpointing::load_checkpoint(path, params, flat, &mut self.opt, self.zero.as_ref(), ddp.ranges(), meta)?;
        let (rank, world) = (ddp.comm().rank().get(), ddp.comm().world_size().get());
        let mut notes = vec![crate::checkpointing::restore_compression(ddp, &r, rank, world)?];
        if local_sgd {
            notes.push(crate::local_sgd::restore_local_model(&r, flat, &mut self.opt, rank, world)?);
        }
        Ok((r, notes.into_iter().flatten().collect()))
    }

    /// Steps skipped so far: f16's overflows and `train.on_nonfinite = "skip"`'s.
    pub fn skipped_steps(&self) -> u64 {
        self.scaler.as_ref().map_or(0, LossScaler::skipped) + self.nonfinite_skipped
    }

    /// What a checkpoint holds of this rank, for `params` (see [`Replica::save`]).
    /// Model states this rank holds between steps: the parameters of `params` it keeps (the
    /// model's, updated in place; under ZeRO-3 the groups live as shards), the gradients in the
    /// DDP buckets (plain DDP, ZeRO-1) or this rank's shard of them (ZeRO-2/3) and the no-sync
    /// accumulator, the optimizer state for the whole model or this rank's shard (with ZeRO's
    /// master shard).
    pub fn state_bytes(&self, params: &ParamSet) -> crate::summary::StateBytes {
        let bytes = |n: usize| n as u64 * 4;
        let resident: usize = (0..params.len()).filter(|&i| params.is_resident(i)).map(|i| params.get(i).range.len()).sum();
        let grads = match self.ddp.sharding() {
            Sharding::Gradients | Sharding::Parameters => self.ddp.grad_len(),
            _ => self.ddp.plan().iter().map(|b| b.numel).sum(),
        };
        let optimizer =
            self.opt.state().iter().map(|(_, v)| v.len()).sum::<usize>() + self.master.len() + self.ddp.with_master(|m| m.len());
        crate::summary::StateBytes {
            params: bytes(resident),
            grads: bytes(grads + self.local.len()),
            optimizer: bytes(optimizer),
            offloaded: self.opt.is_offloaded() || self.master.is_offloaded(),
        }
    }

    pub fn replica<'a>(&'a self, params: &'a ParamSet, local_sgd: bool) -> Replica<'a> {
        Replica {
            ddp: &self.ddp,
            params,
            opt: &self.opt,
            zero: self.zero.as_ref(),
            master: &self.master,
            scaler: self.scaler.as_ref(),
            local_sgd,
        }
    }
}

/// What a data-parallel checkpoint holds of one rank (plain DDP: the whole model from rank 0;
/// ZeRO: this rank's shard, from `master` or, under ZeRO-3, from the engine), as the library's
/// `Trainer` writes it.
pub struct Replica<'a> {
    pub ddp: &'a Ddp,
    pub params: &'a ParamSet,
    pub opt: &'a Optimizer,
    pub zero: Option<&'a ShardPlan>,
    /// ZeRO-1/2's master shard.
    pub master: &'a Buffer,
    /// f16's loss scale.
    pub scaler: Option<&'a LossScaler>,
    /// Local SGD: each rank's own model and optimizer state go in too.
    pub local_sgd: bool,
}

impl Replica<'_> {
    /// Writes the checkpoint of step `step` under `dir` (collective over the data-parallel
    /// group): `meta` plus the loss scale and the gradient codec's state, each rank's own codec
    /// state and (local SGD) model, the sampler's `pos`; in the background with `background`.
    /// `crash`: a test's crash in the middle of the write.
    pub fn save(
        &self,
        dir: &std::path::Path,
        step: u64,
        pos: crate::sampler::Position,
        mut meta: std::collections::BTreeMap<String, String>,
        background: bool,
        crash: bool,
    ) -> Result<crate::checkpointing::PendingSave, TrainError> {
        let comm = self.ddp.comm();
        let rank = comm.rank().get();
        let (mut own, codec_meta) = crate::checkpointing::compression_pieces(self.ddp, rank)?;
        meta.extend(codec_meta);
        meta.extend(crate::checkpointing::loop_state_meta(self.scaler, None));
        if self.local_sgd {
            own.extend(crate::local_sgd::local_model_pieces(self.params, self.opt, rank)?);
        }
        let save = |master: &[f32]| {
            crate::checkpointing::save_checkpoint(
                dir,
                step,
                self.params,
                master,
                self.opt,
                self.zero,
                &**comm,
                pos,
                &meta,
                own,
                background,
                crash,
            )
        };
        // ZeRO-3: this rank's master shard is held by the DDP engine.
        if self.ddp.sharding() == Sharding::Parameters {
            self.ddp.with_master(|m| save(m))
        } else {
            save(self.master.as_slice())
        }
    }
}

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

/// What happens to the reduced gradients before the optimizer step ([`Engine::update`]): f16's
/// loss scale divided out (and a step whose gradients overflowed on any rank skipped on every
/// rank), then clipping to a global norm.
struct GradPrep<'a> {
    checks: Checks<'a>,
    /// f16's dynamic loss scale.
    scaler: Option<&'a mut LossScaler>,
    /// The global gradient norm (before clipping, unscaled) of the last step, when clipping.
    norm: Option<f64>,
}

impl GradPrep<'_> {
    /// Unscales, checks and clips `g` (with `sharded`, this rank's pieces only, so the norm is
    /// a sum over the ranks). `false`: skip the step (an f16 overflow).
    fn run(&mut self, g: &mut BucketGrads<'_>, sharded: bool) -> Result<bool, TrainError> {
        let Checks { comm, clip, tp, inject_inf, skip_nonfinite } = self.checks;
        if inject_inf {
            g.scale(f32::INFINITY);
        }
        if clip.is_none() && self.scaler.is_none() && !skip_nonfinite {
            return Ok(true);
        }
        let inv = self.scaler.as_ref().map_or(1.0, |s| 1.0 / s.scale());
        let mut sq = [match tp {
            Some((split, group)) if clip.is_some() => {
                let mut v = [(0..split.len())
                    .filter(|&i| split[i] || group.rank() == 0)
                    .map(|i| kolo_base::sum_of_squares(g.param_part(i)))
                    .sum::<f64>() as f32];
                group.sum(&mut v).map_err(TrainError::Other)?;
                f64::from(v[0])
            }
            _ => g.sum_of_squares(),
        }];
        if sharded && clip.is_some() {
            comm.all_reduce(BufMut::from(&mut sq[..]), ReduceOp::Sum)?;
        }
        if self.scaler.is_some() || skip_nonfinite {
            // Every rank skips, or none does (a tensor-parallel group's members too: each
            // looked at its own pieces).
            let mut bad = [u8::from(!sq[0].is_finite())];
            comm.all_reduce(BufMut::from(&mut bad[..]), ReduceOp::Max)?;
            if let Some((_, group)) = tp.filter(|_| clip.is_none()) {
                let mut any = [f32::from(bad[0])];
                group.sum(&mut any).map_err(TrainError::Other)?;
                bad[0] = u8::from(any[0] > 0.0);
            }
            let skip = match self.scaler.as_mut() {
                Some(s) => !s.update(bad[0] == 1),
                None => bad[0] == 1,
            };
            if skip {
                return Ok(false);
            }
        }
        let norm = sq[0].sqrt() * inv;
        self.norm = clip.map(|_| norm);
        let f = f64::from(clip.map_or(1.0, |max| clip_factor(norm, max))) * inv;
        if f != 1.0 {
            g.scale(f as f32);
        }
        Ok(true)
    }
}

/// A local step (local SGD, or no exchange at all): this rank's own accumulated gradient, taken
/// from the engine into `grads`, clipped by its own norm, updates its own model. Returns that
/// norm when clipping. With `group` (a model split over ranks: which parameters are split, and
/// the ranks of one replica) the norm is the replica's, as [`Engine::update`]'s; `local_grads`
/// first makes the gradient the replica's ([`StepEnd::local_grads`]).
#[allow(clippy::too_many_arguments)]
pub fn apply_local(
    ddp: &Ddp,
    params: &ParamSet,
    opt: &mut Optimizer,
    grads: &mut [f32],
    clip: Option<f64>,
    group: Option<(&[bool], &dyn kolo_base::GroupSum)>,
    local_grads: Option<&LocalGrads<'_>>,
    lr: f32,
) -> Result<Option<f64>, TrainError> {
    ddp.take_accumulated(grads);
    if let Some(f) = local_grads {
        f(grads, ddp.ranges())?;
    }
    let mut norm = None;
    if let Some(max) = clip {
        let n = match group {
            Some((split, group)) => {
                let mine = ddp.ranges().iter().enumerate().filter(|&(i, _)| split[i] || group.rank() == 0);
                let mut v = [mine.map(|(_, r)| kolo_base::sum_of_squares(&grads[r.clone()])).sum::<f64>() as f32];
                group.sum(&mut v).map_err(TrainError::Other)?;
                f64::from(v[0]).sqrt()
            }
            None => kolo_base::sum_of_squares(grads).sqrt(),
        };
        norm = Some(n);
        let f = clip_factor(n, max);
        grads.iter_mut().for_each(|g| *g *= f);
    }
    opt.begin_step();
    for (i, r) in ddp.ranges().iter().enumerate() {
        params.update_one(i, &mut |v| opt.update(r.start, v, &grads[r.clone()], lr))?;
    }
    Ok(norm)
}

/// Deterministic mode (`ddp.deterministic`), one piece of a micro-batch: its gradient `grad`
/// (of the piece's own mean loss) added exactly to `exact`. `at` = (rank, step) name a value
/// beyond the fixed-point range (a diverged run).
pub fn add_piece(exact: &mut kolo_ddp::exact::ExactSum, grad: &[f32], at: (usize, u64)) -> Result<(), TrainError> {
    exact.add(grad).map_err(|e| {
        TrainError::Other(format!(
            "rank {}, step {}: gradient element {} is {} (ddp.deterministic sums gradients below 2^24 in magnitude; the run has diverged)",
            at.0, at.1, e.idx, e.value
        ))
    })
}

/// What [`apply_exact`] sent and waited for, and the gradient's norm before clipping.
pub struct ExactStats {
    pub bytes: usize,
    pub wait: std::time::Duration,
    pub norm: Option<f64>,
}

/// Deterministic mode's exchange and update, once every piece of the step is in `exact`:
/// every rank's exact sum added as integers (an `i64` sum all-reduce of two lanes per element,
/// so any order gives the same bits), divided by `pieces` (the step's pieces over all ranks)
/// into `grads`, clipped by its norm (the same on every rank), then the optimizer step on the
/// model, or under ZeRO-1/2 on this rank's master shard, whose new values every rank
/// gathers. Clears `exact`.
#[allow(clippy::too_many_arguments)]
pub fn apply_exact(
    comm: &dyn Communicator,
    exact: &mut kolo_ddp::exact::ExactSum,
    pieces: usize,
    ddp: &Ddp,
    zero: Option<&ShardPlan>,
    params: &ParamSet,
    opt: &mut Optimizer,
    master: &mut Buffer,
    grads: &mut [f32],
    clip: Option<f64>,
    lr: f32,
) -> Result<ExactStats, TrainError> {
    let t = std::time::Instant::now();
    let lanes = exact.lanes_mut();
    comm.all_reduce(BufMut::from(&mut *lanes), ReduceOp::Sum)?;
    let bytes = lanes.len() * 8;
    exact.mean_into(pieces.max(1), grads);
    exact.clear();
    let wait = t.elapsed();
    let norm = clip.map(|max| {
        let n = kolo_base::sum_of_squares(grads).sqrt();
        let f = clip_factor(n, max);
        grads.iter_mut().for_each(|g| *g *= f);
        n
    });
    let ranges = ddp.ranges();
    opt.begin_step();
    match zero {
        None => {
            for (i, r) in ranges.iter().enumerate() {
                params.update_one(i, &mut |v| opt.update(r.start, v, &grads[r.clone()], lr))?;
            }
        }
        Some(plan) => {
            // ZeRO-1/2: every rank has the whole reduced gradient; it updates its shard.
            for seg in &plan.segments {
                let at = seg.shard_offset..seg.shard_offset + seg.within.len();
                let g = &grads[ranges[seg.param].clone()][seg.within.clone()];
                opt.update(at.start, &mut master.as_mut_slice()[at.clone()], g, lr);
                master.release(at);
            }
            ddp.all_gather_params(master.as_slice(), |i: usize, v: &[f32]| params.load_one(i, v).map_err(TrainError::from))?;
            master.release_all();
        }
    }
    Ok(ExactStats { bytes, wait, norm })
}
