//! [`Trainer`]: data-parallel training of any candle model whose parameters live in a
//! `candle_nn::VarMap` (DDP, bucketed and overlapped with backward, ZeRO-1/2, or ZeRO-3 for
//! the parameter groups named by prefix, gathered into the unchanged model's variables when
//! used: [`crate::zero3`]), in f32 or mixed precision (a bf16/f16 model with f32 master
//! weights).
//!
//! The model stays the user's: the trainer adopts the VarMap's variables (their storage is
//! updated in place, so the model sees every step) and drives one step from a loss closure.
//! Gradients reach DDP's buckets during backward through candle's gradient-ready hook
//! (`Tensor::backward_with_hook` in Kolo's vendored candle-core): a bucket starts its all-reduce
//! as soon as its last gradient is final, while backward continues with earlier layers.

use crate::{Dist, Error, Result, TrainOptions};
use candle_core::{DType, Tensor, TensorId};
use candle_nn::VarMap;
use kolo_comm::Communicator;
use kolo_ddp::{BucketGrads, Sharding};
use kolo_optim::{LossScaler, Optimizer};
use kolo_tensor::ParamSet;
use kolo_train::cadence::{Cadence, Window};
use kolo_train::checkpointing::{load_checkpoint, loop_state_meta, resolve_checkpoint, save_checkpoint, PendingSave};
use kolo_train::config::{DdpConfig as DdpSettings, Precision, Strategy};
use kolo_train::driver::{record_spans, write_timeline, Job, StepOut};
use kolo_train::report::{Reporter, StepRecord};
use kolo_train::sampler::Position;
use kolo_train::scheduled_ddp::Spans;
use kolo_train::timeline::Timeline;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one [`Trainer::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutput {
    /// This rank's loss on its micro-batch (before the division for accumulation); average it
    /// over ranks with [`Dist::mean`] for logging.
    pub loss: f32,
    /// Whether this call ended an optimizer step (the last micro-step of an accumulation).
    pub stepped: bool,
    /// The learning rate of the optimizer step this call belongs to.
    pub lr: f32,
    /// The global gradient norm before clipping, when this call stepped and clipping is on.
    pub grad_norm: Option<f64>,
    /// When this call stepped: how long the update waited for the gradient buckets after
    /// backward returned, and the share of the communication time that overlapped backward.
    pub comm: Option<(Duration, f64)>,
    /// `train.precision = "f16"`: this step's gradients overflowed at the current loss scale,
    /// so the optimizer skipped it (on every rank) and the scale was lowered.
    pub skipped: bool,
}

/// Data-parallel training of a candle model held in a `VarMap` (torch's
/// `DistributedDataParallel` plus the optimizer, or DeepSpeed's engine with ZeRO-1/2).
pub struct Trainer {
    comm: Arc<dyn Communicator>,
    /// The parameters the optimizer updates: the model's own f32 variables, or (mixed
    /// precision) f32 master copies of its bf16/f16 ones.
    params: ParamSet,
    /// Mixed precision: the model's own bf16/f16 variables, in `params` order, rewritten from
    /// the masters after every update (empty in f32).
    model_vars: Vec<candle_core::Var>,
    /// The dtype the model's variables (and so its computation) are in.
    compute: DType,
    /// ZeRO-3: the sharded groups, filled into the model's variables on use (their master
    /// shard lives in `ddp`).
    zero3: Option<crate::zero3::Zero3>,
    /// Variable id to parameter index.
    ids: HashMap<TensorId, usize>,
    /// The DDP engine, the optimizer and the step's state (`kolo train`'s data-parallel
    /// strategy steps its own the same way).
    e: kolo_train::update::Engine,
    opts: TrainOptions,
    /// Optimizer steps done.
    steps: u64,
    /// Micro-steps done in the current accumulation.
    micro: u64,
    /// `ddp.dynamic_batch_every`: every replica's share of each global batch (the sampler's
    /// too), re-planned from the ranks' speeds.
    shares: Option<kolo_train::sampler::Shares>,
    meta: BTreeMap<String, String>,
    /// Where the user's sampler is, saved with every checkpoint (see [`Trainer::set_data_position`]).
    data_pos: Position,
    /// Logs, progress bar, metrics, TensorBoard and JSON lines (recreated on resume), and the
    /// checkpoint in flight (`train.checkpoint_background`): `kolo train`'s own.
    cadence: Option<Cadence>,
    /// When the current optimizer step's first micro-step began.
    step_start: Option<Instant>,
    /// When the last backward ended, and its loss.
    backward_end: Option<Instant>,
    last_loss: f32,
    /// This rank's loss of the current optimizer step: the mean of its micro-steps' (the log's).
    step_loss: f64,
    /// `train.timeline_dir`: this rank's spans, written (and merged by rank 0) at the last step.
    timeline: Option<Timeline>,
    /// This process's rank in the job (the data-parallel group's may differ).
    rank: usize,
    /// Tensor or pipeline parallelism: how the model is spread over ranks.
    spread: Option<Spread>,
    /// Every rank of the job, and whether they agreed on the step they started from.
    world: Arc<dyn Communicator>,
    start_agreed: bool,
    /// PipeDream-2BW carrying versions ([`crate::pp::Pipeline::carrying_versions`]): the weight
    /// version before the latest between streams, which checkpoints write beside the latest
    /// when it is the one the next step runs on, and a resume reads back.
    carried: crate::pp::Carried,
    /// Replicas reading their own batches (the global batch, the checkpoint's world size), and
    /// which of them this rank is.
    data_replicas: usize,
    data_replica: usize,
    /// The sequence-parallel group: a local SGD step averages its members' gradients.
    sp: Option<Arc<dyn Communicator>>,
    /// `ddp.schedule`: the scheduler that reduces and applies each step's gradients after the
    /// step has returned (the model's reads wait for their parameter's update).
    scheduled: Option<crate::scheduled::Scheduled>,
    /// Stepped by `kolo train`'s driver ([`crate::builtin`]), which owns the batches, the
    /// reports, the evaluations and the checkpoints' cadence: the trainer keeps no cadence or
    /// timeline of its own, and its last step is read back (`last_step`).
    driven: Option<Driven>,
}

/// What `kolo train`'s driver hands a trainer it steps, and reads back.
#[derive(Default)]
pub(crate) struct Driven {
    /// Dynamic batch sizing: this replica's share of the global batch relative to an equal
    /// one (the driver's batches re-split it), by which its mean loss weighs.
    pub(crate) share: f64,
    /// Test hook: rank 0's gradients of this step are made infinite (`--inject-inf-at`).
    pub(crate) inject_inf_at: Option<u64>,
    /// The last optimizer step: this rank's loss (the mean of its micro-steps'), its record
    /// and its collectives for the timeline.
    pub(crate) last: Option<(f64, StepRecord, Spans)>,
    /// PipeDream-2BW: the step after which the driver evaluates, checkpoints or stops (a
    /// stream drains there); `None` outside a stream's step.
    pub(crate) drain_at: Option<u64>,
}

/// Where a trainer runs: its data-parallel group, this process's rank in the job, and the
/// tensor-parallel group when the model is split over one.
struct Place {
    comm: Arc<dyn Communicator>,
    rank: usize,
    tp: Option<crate::tp::TensorParallel>,
    pp: Option<Arc<dyn Communicator>>,
    /// With `pp`: every stage's replicas (`Mesh::stage_replicas`).
    stage_replicas: Option<Arc<dyn Communicator>>,
    /// The expert-parallel group, when the model's experts are dealt out over one.
    ep: Option<Arc<dyn Communicator>>,
    /// The ranks of one replica (every stage and piece), when there are several.
    model: Option<Arc<dyn Communicator>>,
    /// The sequence-parallel group (the chunks of the same sequences), when there is one.
    sp: Option<Arc<dyn Communicator>>,
    world: Arc<dyn Communicator>,
    /// Replicas reading their own batches (a mesh's `dp`; its `sp` ranks share theirs), and
    /// which of them this rank is.
    data_replicas: usize,
    data_replica: usize,
    /// The deadlines the job's communicator was started with.
    deadlines: Option<crate::dist::Deadlines>,
}

impl Place {
    fn of(dist: &Dist) -> Place {
        let data_replicas = dist.world_size();
        let comm = dist.comm().clone();
        Place {
            comm: comm.clone(),
            rank: dist.rank(),
            tp: None,
            pp: None,
            stage_replicas: None,
            ep: None,
            model: None,
            sp: None,
            world: comm,
            data_replicas,
            data_replica: dist.rank(),
            deadlines: dist.deadlines,
        }
    }
}

/// A model spread over ranks beyond data parallelism: split by tensor parallelism, or cut
/// into pipeline stages.
struct Spread {
    layout: crate::tp::WholeLayout,
    /// The group whose sum of squares makes the clipping norm (tp or pp), and per parameter
    /// whether its square counts on every member (else once, on member 0).
    norm: (Arc<dyn kolo_base::GroupSum>, Vec<bool>),
    /// The pipeline group, when the model is cut into stages.
    pp: Option<Arc<dyn Communicator>>,
    /// The expert-parallel group's size (1: none): its members are data-parallel replicas
    /// whose shared parameters' gradients the layout sums (as a tied parameter's over
    /// stages), so every gradient is divided by it.
    ep: usize,
    /// Every rank of the job (the end of a checkpoint).
    world: Arc<dyn Communicator>,
    /// The ranks of one replica (every stage and piece): the codec state goes to its writer.
    model: Arc<dyn Communicator>,
}

/// A ZeRO-3 constructor (`call`) needs `ddp.zero_stage = 3` and at least one group.
fn zero3_call(call: &str, opts: &TrainOptions, groups: &[&str]) -> Result<()> {
    if opts.ddp.zero_stage != 3 || groups.is_empty() {
        return Err(Error::setting(
            "ddp.zero_stage",
            format!("{call} needs ddp.zero_stage = 3 and at least one group (got stage {}, {} groups)", opts.ddp.zero_stage, groups.len()),
        ));
    }
    Ok(())
}

/// Orders names as a person would: digit runs compare as numbers (`layers.2` before
/// `layers.10`), so the flat layout follows the model's layers and DDP's buckets, filled from
/// the end of that layout, follow backward.
fn natural_key(name: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            let mut n = c.to_digit(10).unwrap_or(0) as u64;
            while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                n = n.saturating_mul(10).saturating_add(u64::from(d));
                chars.next();
            }
            out.push((std::mem::take(&mut text), n));
        } else {
            text.push(c);
        }
    }
    out.push((text, u64::MAX));
    out
}

impl Trainer {
    /// Collective: adopts the VarMap's variables (every rank must have built the same model:
    /// names and shapes are compared), makes rank 0's initial values everyone's, and sets up
    /// DDP or ZeRO-1/2 and the optimizer.
    pub fn new(varmap: &VarMap, dist: &Dist, opts: TrainOptions) -> Result<Trainer> {
        Self::build(varmap_vars(varmap, dist.rank())?, Place::of(dist), opts, &[], None)
    }

    /// Collective: as [`Trainer::new`] for a model split by [`crate::tp`]'s layers over
    /// `mesh`'s `tp` group, cut into [`crate::pp`]'s stages, or run on [`crate::sp`]'s sequence
    /// chunks: DDP runs over the ranks holding the same parameters (`dp x sp`),
    /// the gradient norm that clipping uses sums the split pieces over the `tp` group, and
    /// checkpoints hold whole tensors (they resume at any `dp x tp`, or in one process without
    /// the mesh). Over an `ep` group ([`crate::ep`]'s experts dealt out; with `tp`, `pp` and `sp`
    /// too) each member is a data-parallel replica for the parameters they all hold and keeps its
    /// own experts, whose gradients already sum every member's tokens. The parameters every
    /// member holds whole start as member 0's. ZeRO-1/2 shard the optimizer state over the
    /// data-parallel group. Mixed precision (`train.precision = "bf16"` or `"f16"`, the model
    /// built in that dtype) works on every axis: the layers' collectives move and sum f32 and
    /// round once to the model's dtype, the masters are f32, and f16's overflow check skips a
    /// step on every rank of the mesh or none. ZeRO-3 takes its groups
    /// ([`Trainer::with_mesh_zero3_groups`]); gradient compression works, codecs with per-rank
    /// state (PowerSGD, top-k) checkpointing each rank's state, and so does local SGD (each
    /// replica's own model in the checkpoint).
    pub fn with_mesh(varmap: &VarMap, mesh: &crate::Mesh, opts: TrainOptions) -> Result<Trainer> {
        Self::build(varmap_vars(varmap, mesh.rank())?, Self::mesh_place(mesh, &opts, false)?, opts, &[], None)
    }

    /// Collective: as [`Trainer::with_mesh`] under ZeRO-3 (`ddp.zero_stage = 3`: FSDP beside
    /// tensor parallelism, torchtitan's 2D): each rank's parameters whose names start with one
    /// of `groups` (its blocks' prefixes; under `tp` these hold its pieces) are sharded over its
    /// data-parallel group and gathered into the model's variables when read, as
    /// [`Trainer::with_zero3_groups`] does without a mesh. The gradient norm, checkpoints (whole
    /// tensors) and resumes work as under ZeRO-1/2; a pipeline's micro-batches accumulate (whole
    /// gradients until the last micro-batch, as torch FSDP's `no_sync()`); every axis of the mesh
    /// takes it.
    pub fn with_mesh_zero3_groups(varmap: &VarMap, mesh: &crate::Mesh, opts: TrainOptions, groups: &[&str]) -> Result<Trainer> {
        zero3_call("Trainer::with_mesh_zero3_groups", &opts, groups)?;
        Self::build(varmap_vars(varmap, mesh.rank())?, Self::mesh_place(mesh, &opts, true)?, opts, groups, None)
    }

    /// Where a mesh puts this rank's model, and the combinations refused so far.
    fn mesh_place(mesh: &crate::Mesh, opts: &TrainOptions, zero3_groups: bool) -> Result<Place> {
        let tp = (mesh.tp().size() > 1).then(|| mesh.tp().clone());
        let pp = (mesh.size("pp") > 1).then(|| mesh.pp().clone());
        let ep = (mesh.size("ep") > 1).then(|| mesh.ep_comm().clone());
        if opts.ddp.zero_stage == 3 && !zero3_groups && (tp.is_some() || pp.is_some() || ep.is_some() || mesh.size("sp") > 1) {
            return Err(Error::setting(
                "ddp.zero_stage",
                "3 on a mesh shards this rank's parameter groups named by prefix: create the trainer with Trainer::with_mesh_zero3_groups(&varmap, &mesh, opts, &[\"layers.0.\", ..])",
            ));
        }
        let model = (tp.is_some() || pp.is_some() || ep.is_some()).then(|| mesh.model_parallel().clone());
        // The members of an expert-parallel group read their own batches.
        let (comm, world, data_replicas) = (mesh.replicas().clone(), mesh.world().clone(), mesh.size("dp") * mesh.size("ep"));
        let stage_replicas = pp.as_ref().and(mesh.stage_replicas().cloned());
        let sp = (mesh.size("sp") > 1).then(|| mesh.sp().comm().clone());
        let data_replica = mesh.coord("dp") * mesh.size("ep") + mesh.coord("ep");
        let deadlines = mesh.deadlines;
        Ok(Place { comm, rank: mesh.rank(), tp, pp, stage_replicas, ep, model, sp, world, data_replicas, data_replica, deadlines })
    }

    /// Collective: as [`Trainer::new`] under ZeRO-3 (`ddp.zero_stage = 3`, torch's FSDP): the
    /// parameters whose names start with one of `groups` (a block's prefix, such as
    /// `"model.layers.3."`, listed in forward order) are sharded over the ranks. The model
    /// stays as it is: each group's whole values are gathered into its own variables when an
    /// operation first reads one of them (forward, and backward where a gradient needs the
    /// weights), and freed again once two later groups were used, or at the optimizer step. The
    /// other parameters are trained as under ZeRO-2.
    ///
    /// Reading a sharded variable is a collective: every rank must run the same model code,
    /// on the training thread. Outside [`Trainer::step`] (evaluation, export), call it on every
    /// rank too, or gather the whole model first with [`Trainer::unshard`].
    pub fn with_zero3_groups(varmap: &VarMap, dist: &Dist, opts: TrainOptions, groups: &[&str]) -> Result<Trainer> {
        zero3_call("Trainer::with_zero3_groups", &opts, groups)?;
        Self::build(varmap_vars(varmap, dist.rank())?, Place::of(dist), opts, groups, None)
    }

    /// `kolo train`'s trainer of a built-in model ([`crate::builtin`]): its variables in the
    /// model's own order (backward's reverse, which DDP's buckets follow), on a mesh when
    /// given, stepped by the driver.
    pub(crate) fn driven(
        vars: Vec<(String, candle_core::Var)>,
        on: std::result::Result<&Dist, &crate::Mesh>,
        opts: TrainOptions,
        groups: &[&str],
        inject_inf_at: Option<u64>,
    ) -> Result<Trainer> {
        let driven = Some(Driven { share: 1.0, inject_inf_at, last: None, drain_at: None });
        match on {
            Ok(dist) => Self::build(vars, Place::of(dist), opts, groups, driven),
            Err(mesh) => {
                let place = Self::mesh_place(mesh, &opts, !groups.is_empty())?;
                Self::build(vars, place, opts, groups, driven)
            }
        }
    }

    fn build(
        vars: Vec<(String, candle_core::Var)>,
        place: Place,
        opts: TrainOptions,
        groups: &[&str],
        driven: Option<Driven>,
    ) -> Result<Trainer> {
        check_place(&opts, &place, groups)?;
        kolo_train::summary::retain_freed_memory();
        let (rank, mut place) = (place.rank, place);
        if opts.ddp.check_collectives {
            // Every collective of the data-parallel group fingerprinted and compared across its
            // ranks first (kolo train's `ddp.check_collectives`): a mismatch fails naming both.
            place.comm = Arc::new(kolo_comm::Checked::new(place.comm.clone()));
        }
        let (comm, world, data_replicas, data_replica) = (place.comm.clone(), place.world.clone(), place.data_replicas, place.data_replica);
        let place_sp = place.sp.clone();
        let (mut params, ids, model_vars, compute) = adopt_vars(vars, rank, opts.train.precision, &opts.train.device)?;
        let (spread, whole_signature) = spread(&place, &params, &ids)?;
        kolo_train::param_groups::check_matches(&whole_signature, &opts.optim).map_err(|e| Error::setting("optim.groups", e))?;
        let sharding = Sharding::from_stage(opts.ddp.zero_stage).unwrap_or_default();
        let names: Vec<String> = params.iter().map(|p| p.name.clone()).collect();
        let plan = crate::zero3::plan_groups(&names, groups).map_err(|e| Error::usage(rank, "Trainer::with_zero3_groups", e))?;
        let signature = params.signature();
        let mut engine = kolo_train::update::Engine::build(
            comm.clone(),
            &signature,
            &opts.ddp,
            &opts.optim,
            opts.optimizer_spec(),
            sharding,
            plan.clone(),
        )?;
        engine.start(&params, &opts.optim)?;
        publish(&params, &model_vars, compute)?;
        let sharded = !plan.is_empty();
        let zero3 = if sharded {
            // The groups live as shards from now on: the model's own variables are emptied and
            // refilled on use; the trainer keeps no handle on their values.
            // Mixed precision: the model's bf16/f16 variables are gathered into (the f32 masters
            // live as the shards alone).
            let var = |i: usize| if model_vars.is_empty() { params.get(i).var.clone() } else { model_vars[i].clone() };
            let vars = plan.iter().map(|g| g.iter().map(|&i| (names[i].clone(), var(i))).collect()).collect();
            for &i in plan.iter().flatten() {
                params.release(i)?;
            }
            Some(crate::zero3::Zero3::new(engine.ddp.gatherer(), groups, vars, rank)?)
        } else {
            None
        };
        let meta = checkpoint_meta(&whole_signature, &opts, data_replicas, sharding.stage(), compute);
        let scheduled = match opts.as_train_config()?.comm_schedule().map_err(|e| Error::setting("ddp.schedule", e))? {
            Some(plan) => {
                let timeout = opts.ddp.timeout();
                Some(crate::scheduled::Scheduled::start(&*comm, &params, &engine.opt, plan, timeout)?)
            }
            None => None,
        };
        engine.scaler = (compute == DType::F16).then(LossScaler::new);
        // Driven, the driver's batches keep the split (and hand the trainer its share).
        let dynamic = opts.ddp.dynamic_batch_every > 0 && driven.is_none();
        let shares = dynamic.then(|| Arc::new(std::sync::Mutex::new(vec![opts.data.batch_size; data_replicas])));
        let cadence = match driven {
            None => Some(Cadence::new(reporter(&opts, rank, data_replicas, 0)?)),
            Some(_) => None,
        };
        let timeline = opts.train.timeline_dir.as_ref().filter(|_| driven.is_none()).map(|_| Timeline::new(rank));
        Ok(Trainer {
            comm,
            params,
            zero3,
            model_vars,
            compute,
            ids,
            e: engine,
            steps: 0,
            micro: 0,
            shares,
            meta,
            data_pos: Position::default(),
            cadence,
            step_start: None,
            backward_end: None,
            last_loss: 0.0,
            step_loss: 0.0,
            timeline,
            rank,
            spread,
            world,
            start_agreed: false,
            carried: Default::default(),
            data_replicas,
            data_replica,
            sp: place_sp,
            scheduled,
            opts,
            driven,
        })
    }

    /// One micro-step in one call: runs `loss` (the forward pass; it must return a scalar),
    /// then [`Trainer::backward`] on it, and on the micro-step that completes an accumulation
    /// [`Trainer::update`]. Collective on the micro-steps that step.
    pub fn step(&mut self, loss: impl FnOnce() -> candle_core::Result<Tensor>) -> Result<StepOutput> {
        if self.scheduled.is_some() {
            // The step's time includes its forward pass (and its waits for updates).
            self.step_start.get_or_insert_with(Instant::now);
            self.backward(&loss()?)?;
            return self.update();
        }
        self.step_then(loss, |_| Ok(()))
    }

    /// As [`Trainer::step`], running `before_update` on the trainer between the last micro-step's
    /// backward and the update (where [`Trainer::set_param`] and [`Trainer::add_to_param`]
    /// change what the update starts from and the step's checkpoint holds).
    pub fn step_then(
        &mut self,
        loss: impl FnOnce() -> candle_core::Result<Tensor>,
        before_update: impl FnOnce(&mut Trainer) -> Result<()>,
    ) -> Result<StepOutput> {
        if self.scheduled.is_some() {
            return Err(Error::usage(
                self.rank,
                "Trainer::step_then",
                "under ddp.schedule each parameter is updated as soon as its gradient is reduced, after the step returns: there is no moment between backward and the update",
            ));
        }
        self.step_start.get_or_insert_with(Instant::now);
        if let Some(z) = &self.zero3 {
            z.take_error()?;
            z.set_prefetch(true);
        }
        let loss = loss();
        if let Some(z) = &self.zero3 {
            z.take_error()?;
        }
        let value = self.backward(&loss?)?;
        if self.micro < self.opts.train.grad_accum.max(1) {
            return Ok(StepOutput { loss: value, stepped: false, lr: self.lr(), grad_norm: None, comm: None, skipped: false });
        }
        before_update(self)?;
        self.update()
    }

    /// One micro-step whose micro-batch (`[data] batch_size` examples) is cut into pieces:
    /// `loss(range)` is the mean loss of examples `range` of it. Under `ddp.deterministic` each
    /// piece of `ddp.deterministic_chunk` examples gets its own backward, and its gradient is
    /// summed in fixed point with every other piece of every rank, so the parameters come out
    /// bitwise the same at any world size for the same global batch (`kolo train`'s
    /// deterministic mode); otherwise the micro-batch is one piece and this is
    /// [`Trainer::step`]. Collective on the micro-steps that step.
    pub fn step_pieces(&mut self, mut loss: impl FnMut(std::ops::Range<usize>) -> candle_core::Result<Tensor>) -> Result<StepOutput> {
        let batch = self.opts.data.batch_size;
        if batch == 0 {
            return Err(Error::setting("data.batch_size", "Trainer::step_pieces cuts [data] batch_size examples into pieces: set it"));
        }
        if self.e.exact.is_none() {
            return self.step(|| loss(0..batch));
        }
        let (rank, accum, chunk) = (self.rank, self.opts.train.grad_accum.max(1), self.opts.ddp.deterministic_chunk);
        self.step_start.get_or_insert_with(Instant::now);
        let mut sum = 0f64;
        for start in (0..batch).step_by(chunk) {
            let piece = loss(start..start + chunk)?;
            sum += f64::from(scalar_loss(rank, "Trainer::step_pieces", &piece)?);
            // Each piece's own gradient, then added exactly.
            self.e
                .backward_piece(&piece, &self.ids, &self.params, (rank, self.steps))
                .map_err(|e| route_error(rank, "Trainer::step_pieces", e))?;
        }
        let value = (sum / (batch / chunk) as f64) as f32;
        self.backward_end = Some(Instant::now());
        self.micro += 1;
        self.step_loss += f64::from(value) / accum as f64;
        self.last_loss = value;
        if self.micro < accum {
            return Ok(StepOutput { loss: value, stepped: false, lr: self.lr(), grad_norm: None, comm: None, skipped: false });
        }
        self.update()
    }

    /// Backward of one micro-step's loss (a float scalar), as torch's `loss.backward()` under
    /// DDP: the gradients go to DDP's buckets as they become final on the micro-step that
    /// completes an accumulation (collective: they are reduced while backward runs), and are
    /// accumulated locally on the others. Returns the loss value. After `train.grad_accum`
    /// calls, call [`Trainer::update`].
    pub fn backward(&mut self, loss: &Tensor) -> Result<f32> {
        let accum = self.opts.train.grad_accum.max(1);
        // Dynamic batch sizing: a rank's mean loss weighs by its share of the global batch.
        let share = self.share();
        // f16: backward runs on the loss times the loss scale; the update divides it out.
        let factor = self.e.scaler.as_ref().map_or(1.0, LossScaler::scale) * share / accum as f64;
        let (value, _) = self.backward_with(loss, factor, None)?;
        self.step_loss += f64::from(value) * share / accum as f64;
        self.last_loss = value;
        Ok(value)
    }

    /// Dynamic batch sizing: this replica's share of the global batch relative to an equal
    /// share (1 otherwise), by which its mean loss weighs.
    fn share(&self) -> f64 {
        if let Some(d) = &self.driven {
            return d.share;
        }
        let Some(s) = &self.shares else { return 1.0 };
        let s = s.lock().unwrap_or_else(|p| p.into_inner());
        s[self.data_replica] as f64 * s.len() as f64 / s.iter().sum::<usize>().max(1) as f64
    }

    /// [`Trainer::backward`] of `loss` times `factor`, without the loss's bookkeeping; the
    /// gradient of `capture` (a stage's input, outside the VarMap) is returned instead of
    /// refused. A pipeline stage's backward ([`crate::pp`]).
    pub(crate) fn backward_with(
        &mut self,
        loss: &Tensor,
        factor: f64,
        capture: Option<&candle_core::Var>,
    ) -> Result<(f32, Option<Tensor>)> {
        let rank = self.comm.rank().get();
        let accum = self.opts.train.grad_accum.max(1);
        if self.micro >= accum {
            return Err(Error::usage(
                rank,
                "Trainer::backward",
                format!("called again after {} micro-steps with train.grad_accum = {accum}: call Trainer::update first", self.micro),
            ));
        }
        if self.e.exact.is_some() {
            return Err(Error::usage(
                rank,
                "Trainer::backward",
                "ddp.deterministic sums the gradients of pieces of each micro-batch: train with Trainer::step_pieces",
            ));
        }
        // The last micro-step hands its gradients to the buckets, unless the step is local
        // (local SGD past its warm-up, skip_sync: the models are averaged instead, or not at all).
        let communicate = self.e.communicates(self.micro + 1 == accum, self.steps);
        self.step_start.get_or_insert_with(Instant::now);
        if let Some(z) = &self.zero3 {
            z.take_error()?;
            z.set_prefetch(true);
        }
        let value = scalar_loss(rank, "Trainer::backward", loss)?;
        let scaled = if factor != 1.0 { (loss * factor)? } else { loss.clone() };
        let capture_id = capture.map(|v| v.as_tensor().id());
        let lr = self.lr();
        let captured = match self.scheduled.as_mut() {
            // Scheduled communication: the scheduler's own buckets.
            Some(s) => {
                let route = kolo_train::update::GradRoute::Buckets(s.begin(&mut self.e.opt, self.steps, lr)?);
                let captured = kolo_train::update::backward_routed(&scaled, &self.ids, route, capture_id);
                if captured.is_ok() {
                    // A parameter backward gave no gradient is named (as DDP names it).
                    s.end_backward()?;
                }
                captured
            }
            None => self.e.backward(&scaled, &self.ids, &self.params, communicate, capture_id),
        }
        .map_err(|e| route_error(rank, "Trainer::backward", e))?;
        if let Some(z) = &self.zero3 {
            z.take_error()?;
        }
        self.backward_end = Some(Instant::now());
        self.micro += 1;
        Ok((value, captured))
    }

    /// This process's rank in the job.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// The dtype the model computes in (bf16/f16 under mixed precision).
    pub(crate) fn compute_dtype(&self) -> DType {
        self.compute
    }

    /// f16's current loss scale (1 otherwise): what a backward multiplies the loss by.
    pub(crate) fn loss_scale(&self) -> f64 {
        self.e.scaler.as_ref().map_or(1.0, LossScaler::scale)
    }

    /// Pipeline parallelism ([`crate::pp`]): the pipeline group, and micro-batches per step.
    pub(crate) fn pipeline(&self) -> Option<(&Arc<dyn Communicator>, u64)> {
        self.spread.as_ref().and_then(|s| s.pp.as_ref()).map(|pp| (pp, self.opts.train.grad_accum.max(1)))
    }

    /// PipeDream-2BW: how many steps from now a stream may run before it must drain: to the
    /// next checkpoint due or the last step, at most `most`.
    /// Driven by `kolo train`, to the driver's next drain point.
    pub(crate) fn steps_to_drain(&self, most: u64) -> u64 {
        let (done, end) = (self.steps, self.opts.train.steps);
        if let Some(at) = self.driven.as_ref().and_then(|d| d.drain_at) {
            return at.saturating_sub(done).clamp(1, most.max(1));
        }
        (1..=most).find(|n| done + n == end || kolo_train::checkpointing::due(&self.opts.train, done + n, end).is_some()).unwrap_or(most)
    }

    /// The variables the model computes with (its bf16/f16 ones under mixed precision), in
    /// parameter order; `None` under ZeRO-3, whose groups are emptied between uses.
    pub(crate) fn compute_vars(&self) -> Option<Vec<candle_core::Var>> {
        match (&self.zero3, self.model_vars.is_empty()) {
            (Some(_), _) => None,
            (None, true) => Some((0..self.params.len()).map(|i| self.params.get(i).var.clone()).collect()),
            (None, false) => Some(self.model_vars.clone()),
        }
    }

    /// Pipeline parallelism: the step's loss (the mean over its micro-batches, from the last
    /// stage), for the step's output and the log.
    pub(crate) fn set_step_loss(&mut self, loss: f32) {
        self.step_loss = f64::from(loss);
        self.last_loss = loss;
    }

    /// The optimizer step after `train.grad_accum` calls of [`Trainer::backward`], as torch's
    /// `optimizer.step()`: waits for the reduced gradients, unscales and clips them, updates
    /// (this rank's shard under ZeRO, then gathers), and logs and checkpoints as configured.
    /// Collective.
    pub fn update(&mut self) -> Result<StepOutput> {
        let accum = self.opts.train.grad_accum.max(1);
        if self.micro != accum {
            return Err(Error::usage(
                self.comm.rank().get(),
                "Trainer::update",
                format!("called after {} of train.grad_accum = {accum} backward calls", self.micro),
            ));
        }
        let lr = self.lr();
        let value = self.last_loss;
        let t0 = self.step_start.unwrap_or_else(Instant::now);
        let backward_end = self.backward_end.unwrap_or_else(Instant::now);
        let local = self.e.is_local_step(self.steps) && self.e.exact.is_none() && self.scheduled.is_none();
        let (u, spans) = match self.scheduled.as_mut() {
            Some(s) => {
                // The step's exchange and updates run on: reads of a parameter wait for its update.
                let (stats, spans) = s.end_step(self.steps + 1, self.params.numel() * 4)?;
                (kolo_train::update::Updated { stats, overlapped: true, applied: true, norm: None }, Some(spans))
            }
            None => (self.end_step(accum, lr)?, None),
        };
        self.micro = 0;
        self.steps += 1;
        self.step_start = None;
        // A carried weight version the steps have passed is of no use (a run that does not
        // carry versions resumed from a checkpoint of one that did).
        let mut carried = self.carried.lock().unwrap_or_else(|p| p.into_inner());
        if carried.as_ref().is_some_and(|(v, _)| v + 1 < self.steps) {
            *carried = None;
        }
        drop(carried);
        self.agree_on_start()?;
        let rec = u.record(local, self.opts.ddp.local_sgd.is_some(), self.e.skipped_steps());
        self.after_step(t0, backward_end, rec, &u.stats, spans, lr)?;
        let comm = Some((u.stats.wait, if u.overlapped { u.stats.hidden_fraction() } else { 0.0 }));
        Ok(StepOutput { loss: value, stepped: true, lr, grad_norm: u.norm, comm, skipped: !u.applied })
    }

    /// [`Trainer::update`] without scheduled communication: the engine ends the step (the
    /// buckets, a local step or deterministic mode's exact sum), the model's own variables take
    /// the new values, and ZeRO-3's gathered copies are dropped.
    fn end_step(&mut self, accum: u64, lr: f32) -> Result<kolo_train::update::Updated> {
        let checks = kolo_train::update::Checks {
            comm: &*self.comm,
            clip: self.opts.optim.clip_grad_norm,
            // On a mesh the norm sums every piece and stage of this replica.
            tp: self.spread.as_ref().map(|s| (&s.norm.1[..], &*s.norm.0)),
            inject_inf: self.driven.as_ref().is_some_and(|d| d.inject_inf_at == Some(self.steps)) && self.comm.rank().get() == 0,
            skip_nonfinite: self.opts.train.on_nonfinite == kolo_train::config::OnNonFinite::Skip,
        };
        // Parameters tied across pipeline stages: each stage's part of their gradient summed.
        let tied = self.spread.as_ref().map(|s| &s.layout).filter(|l| l.has_tied());
        // Expert parallelism: the shared parameters' gradients were summed over the group's
        // replicas, the experts' hold every member's tokens: both are the group's size times the
        // mean over the job's replicas.
        let ep = self.spread.as_ref().map_or(1, |s| s.ep);
        let mut extra = |g: &mut BucketGrads<'_>| {
            if let Some(layout) = tied {
                layout.reduce_tied(g)?;
            }
            if ep > 1 {
                g.scale(1.0 / ep as f32);
            }
            Ok(())
        };
        // Deterministic mode: the pieces of the whole step over every replica.
        let per_micro = self.opts.data.batch_size / self.opts.ddp.deterministic_chunk.max(1);
        let pieces = accum as usize * per_micro * self.data_replicas;
        // A local step (local SGD) on a mesh: this rank's gradient made its replica's as the
        // buckets' exchange makes it.
        let sp = self.sp.as_deref();
        let local = |g: &mut [f32], ranges: &[std::ops::Range<usize>]| -> std::result::Result<(), kolo_train::TrainError> {
            if let Some(sp) = sp {
                sp.all_reduce(kolo_comm::BufMut::from(&mut g[..]), kolo_comm::ReduceOp::Avg)?;
            }
            if let Some(layout) = tied {
                layout.reduce_tied_flat(g, ranges)?;
            }
            if ep > 1 {
                g.iter_mut().for_each(|x| *x /= ep as f32);
            }
            Ok(())
        };
        let local_grads = (sp.is_some() || tied.is_some() || ep > 1).then_some(&local as &kolo_train::update::LocalGrads<'_>);
        let end = kolo_train::update::StepEnd { step: self.steps, lr, checks, pieces, local_grads };
        let u = self.e.update(&self.params, &end, &mut extra)?;
        if u.applied {
            publish(&self.params, &self.model_vars, self.compute)?;
        }
        if let Some(z) = &self.zero3 {
            // The shards changed: every gathered copy is stale.
            z.set_prefetch(false);
            z.release_all()?;
        }
        Ok(u)
    }

    /// Collective over the job, after the first step of a run (and of a resume), before any
    /// report or checkpoint: every rank began at the same step. A rank that resumed a
    /// checkpoint the others did not (or another one) would otherwise train on silently, its
    /// model apart from theirs.
    fn agree_on_start(&mut self) -> Result<()> {
        if self.start_agreed {
            return Ok(());
        }
        let mine = [self.steps as i64 - 1];
        let mut all = vec![0i64; self.world.world_size().get()];
        self.world.all_gather(kolo_comm::BufRef::from(&mine[..]), kolo_comm::BufMut::from(&mut all[..]))?;
        if let Some((r, s)) = all.iter().enumerate().find(|(_, s)| **s != mine[0]) {
            return Err(Error::usage(
                self.rank,
                "Trainer::update",
                format!(
                    "rank {r} started at step {s}, this rank at step {}: call Trainer::resume with the same checkpoint on every rank, or on none",
                    mine[0]
                ),
            ));
        }
        self.start_agreed = true;
        Ok(())
    }

    /// After an optimizer step: the report (and, at log steps, the collective window: every
    /// rank reaches the same steps), and the periodic and final checkpoints.
    fn after_step(
        &mut self,
        t0: Instant,
        backward_end: Instant,
        rec: StepRecord,
        stats: &kolo_ddp::SyncStats,
        spans: Option<Spans>,
        lr: f32,
    ) -> Result<()> {
        let (done, end) = (self.steps, self.opts.train.steps);
        let loss = std::mem::take(&mut self.step_loss);
        let buckets = || stats.buckets.iter().enumerate().map(|(b, (s0, s1))| (format!("bucket {b}"), *s0, *s1)).collect();
        let comm_spans = spans.unwrap_or_else(buckets);
        if let Some(d) = self.driven.as_mut() {
            // The driver times, reports, draws and checkpoints the step.
            d.last = Some((loss, rec, comm_spans));
            return Ok(());
        }
        if let Some(tl) = self.timeline.as_mut() {
            let out = StepOut { backward_end: Some(backward_end), comm_spans, ..Default::default() };
            record_spans(tl, done - 1, t0, &out);
        }
        let Some(c) = self.cadence.as_mut() else { return Ok(()) };
        c.record(done, StepRecord { step_ms: t0.elapsed().as_secs_f64() * 1e3, ..rec });
        if let (Some(shares), every) = (&self.shares, self.opts.ddp.dynamic_batch_every) {
            if done.is_multiple_of(every) {
                kolo_train::sampler::replan(shares, self.data_replica, every as usize, &c.report, &*self.comm, done)?;
            }
        }
        if let Window::Diverged(why) = c.end_window(&*self.comm, done, end, loss, lr, 0, "", &self.opts.train)? {
            return Err(Error::usage(self.comm.rank().get(), "Trainer::update", why));
        }
        if done == end {
            c.report.finish();
        }
        if let Some((dir, _)) = c.checkpoint_due(&self.opts.train, done, end)? {
            self.settle_scheduled("Trainer::update")?;
            // The last step's checkpoint is written before the call returns.
            let background = self.opts.train.checkpoint_background && done != end;
            let p = self.write_checkpoint(&dir, background, BTreeMap::new(), false)?;
            let c = self.cadence.as_mut().expect("the cadence is there");
            c.saving(done, p, background);
            if !background {
                c.settle()?;
            }
        }
        if done == end {
            if let (Some(tl), Some(dir)) = (&self.timeline, &self.opts.train.timeline_dir) {
                write_timeline(tl, Path::new(dir), Job::Ranks(&*self.comm), self.comm.rank().get() == 0)?;
            }
        }
        Ok(())
    }

    /// Stores `value` under `key` in the metadata of every checkpoint this trainer writes from
    /// now on (`kolo inspect` lists it): what a later reader needs beside the tensors, such as the
    /// model's configuration (`kolo export --hf` reads a fine-tuning job's). Keys beginning with
    /// `kolo.` are the trainer's own and are refused.
    pub fn set_checkpoint_meta(&mut self, key: &str, value: &str) -> Result<()> {
        if key.starts_with("kolo.") {
            return Err(Error::Usage {
                rank: self.comm.rank().get(),
                op: "Trainer::set_checkpoint_meta",
                reason: format!("`{key}`: keys beginning with `kolo.` are the trainer's own"),
            });
        }
        self.meta.insert(key.to_string(), value.to_string());
        Ok(())
    }

    /// Records where the data sampler is (`kolo::data::Sampler::position`), so that the next
    /// checkpoint carries it and a resumed run continues with the next batch, also in the
    /// middle of a token shard. Call it after drawing a step's batch and before
    /// [`Trainer::step`]: the checkpoints of `checkpoint_every` are written inside the step.
    pub fn set_data_position(&mut self, p: Position) {
        self.data_pos = p;
    }

    /// The sampler position of the resumed checkpoint (or the last one set): start the
    /// sampler there (`Sampler::new(cfg, trainer.data_position())`). At another world size it
    /// is rescaled to the same number of examples of the epoch.
    pub fn data_position(&self) -> Position {
        self.data_pos
    }

    /// The distributed sampler of this rank's share of `len` examples, as `kolo train` deals
    /// its data: `[data] batch_size` examples per micro-step, over the trainer's data-parallel
    /// replicas (a mesh's `dp x ep`: the stages, tensor-parallel pieces and sequence chunks of a
    /// replica read the same batches), reshuffled every epoch from `train.seed`
    /// (`data.shuffle`, `data.drop_last`), starting at [`Trainer::data_position`] (where a
    /// resumed checkpoint left off).
    pub fn sampler(&self, len: usize) -> Result<crate::data::Sampler> {
        replica_sampler(&self.opts, len, (self.data_replica, self.data_replicas), self.data_pos, self.shares.as_ref())
    }

    /// As [`Trainer::sampler`], dealing `batch` examples per step (a pipeline's micro-batches
    /// together: the fine-tuning job's batches).
    #[cfg(feature = "hf")]
    pub(crate) fn sampler_of(&self, len: usize, batch: usize) -> Result<crate::data::Sampler> {
        let mut o = self.opts.clone();
        o.data.batch_size = batch;
        replica_sampler(&o, len, (self.data_replica, self.data_replicas), self.data_pos, self.shares.as_ref())
    }

    /// Whether the call that just returned ended an optimizer step after which an evaluation
    /// is due: every `train.eval_every` steps and after the last (`train.steps`), the steps at
    /// which `kolo train` evaluates. Evaluate (over `train.eval_batches` batches, say) and
    /// hand the result to [`Trainer::log_eval`].
    pub fn eval_due(&self) -> bool {
        self.micro == 0 && kolo_train::cadence::eval_due(&self.opts.train, self.steps)
    }

    /// Logs an evaluation of the model after the current step as `kolo train` logs its own
    /// (the line, and `eval/loss` and `eval/accuracy` in TensorBoard): `e` is the result over
    /// every rank (`loss` the mean per example), so rank 0's call is the one that counts. After
    /// the last step it is the final evaluation.
    pub fn log_eval(&mut self, e: &crate::Eval) {
        let last = self.steps == self.opts.train.steps;
        if let Some(c) = self.cadence.as_mut() {
            c.report.eval(self.steps, e, last);
        }
    }

    /// Starts the current step's clock now unless it runs already (the step's first
    /// `backward` starts it otherwise): a pipeline's step begins with its forwards.
    pub(crate) fn mark_step_start(&mut self) {
        self.step_start.get_or_insert_with(Instant::now);
    }

    /// Text sampling as `kolo train`'s at the end of a text model's run: `train.sample_chars`
    /// tokens after `start`, each drawn from the softmax of the logits over
    /// `train.sample_temperature`, seeded by `train.seed`. `next_logits(context)` runs the
    /// user's model on the last `context_len` tokens so far and returns the logits of the last
    /// position (vocabulary values, any leading dimensions of size 1). Returns the drawn
    /// tokens; decode them with the user's tokenizer and log them with [`Trainer::log_sample`].
    /// Under ZeRO-3 call it on every rank (each forward pass gathers the model's groups
    /// collectively; the ranks draw the same tokens): a rank sampling alone fails here, naming
    /// the gather.
    pub fn sample(
        &self,
        start: &[u32],
        context_len: usize,
        mut next_logits: impl FnMut(&[u32]) -> candle_core::Result<Tensor>,
    ) -> Result<Vec<u32>> {
        let tc = &self.opts.train;
        let mut next = |ctx: &[u32]| next_logits(ctx).map_err(|e| kolo_train::TrainError::Data(format!("text sampling: {e}")));
        let ids = kolo_train::eval::sample_ids(start, tc.sample_chars, context_len, tc.sample_temperature, tc.seed, &mut next);
        // A gather that failed filled its group with NaN: that is the cause to report.
        if let Some(z) = &self.zero3 {
            z.take_error()?;
        }
        Ok(ids?)
    }

    /// Logs a sample (from [`Trainer::sample`], decoded) as `kolo train` does, on rank 0.
    pub fn log_sample(&self, text: &str) {
        if self.rank == 0 {
            kolo_base::eline!("{}", kolo_train::eval::sample_block(&self.opts.train, text));
        }
    }

    /// The learning rate of the next optimizer step (warm-up, then the schedule).
    pub fn lr(&self) -> f32 {
        let global = kolo_train::config::global_batch(self.opts.data.batch_size, self.data_replicas, self.opts.train.grad_accum);
        self.opts.optim.lr_of_step(global, self.opts.train.steps, self.steps)
    }

    /// Optimizer steps done (restored by [`Trainer::resume`]).
    pub fn steps_done(&self) -> u64 {
        self.steps
    }

    /// The parameters in the trainer's order: `(name, shape)`.
    pub fn signature(&self) -> Vec<(String, Vec<usize>)> {
        self.params.signature()
    }

    /// All parameters, flat, in [`Trainer::signature`] order. Under ZeRO-3 this is a
    /// collective (the sharded groups are gathered).
    pub fn flat_params(&self) -> Result<Vec<f32>> {
        if self.zero3.is_none() {
            return Ok(self.params.to_flat()?);
        }
        let mut flat = vec![0f32; self.params.numel()];
        let ranges = self.e.ddp.ranges();
        self.e.ddp.with_master(|m| {
            self.e.ddp.all_gather_everything(m, |i, v| {
                flat[ranges[i].clone()].copy_from_slice(v);
                Ok::<(), kolo_ddp::DdpError>(())
            })
        })?;
        Ok(flat)
    }

    /// Mixed precision (`train.precision` bf16 or f16): collective under ZeRO-3; a VarMap of the
    /// f32 master weights under the names of `varmap` (the model's own, in its compute dtype),
    /// each cut over tensor parallelism as the model's variable is, so that
    /// [`crate::Mesh::whole_varmap`] puts them together. An export from it holds the weights
    /// the optimizer keeps, as torch FSDP's mixed-precision `state_dict` does, not their
    /// rounding. `None` when the model computes in f32 (its variables are the masters).
    pub fn master_varmap(&self, varmap: &VarMap) -> Result<Option<VarMap>> {
        if self.compute == DType::F32 {
            return Ok(None);
        }
        let flat = self.flat_params()?;
        let ranges = self.e.ddp.ranges();
        let masters = VarMap::new();
        {
            let own = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
            let mut out = masters.data().lock().unwrap_or_else(|p| p.into_inner());
            for (i, p) in self.params.iter().enumerate() {
                let t = Tensor::from_slice(&flat[ranges[i].clone()], p.shape.as_slice(), &kolo_tensor::device())?;
                let v = candle_core::Var::from_tensor(&t)?;
                if let Some(model) = own.get(&p.name) {
                    crate::tp::remember_like(v.as_tensor(), model.as_tensor());
                }
                out.insert(p.name.clone(), v);
            }
        }
        Ok(Some(masters))
    }

    /// Sets the value of the model's variable `var` outside the optimizer (torch's `with
    /// torch.no_grad(): p.copy_(value)`), wherever the trainer keeps it: the variable itself,
    /// the f32 master of a mixed-precision model (the variable gets its rounding), this rank's
    /// ZeRO-1/2 master shard, or ZeRO-3's shard (and the gathered copy when its group is whole).
    /// The optimizer's state is left as it is. Not collective, but every rank holding the
    /// parameter must set it to the same value, or the replicas part. Call it between steps, or
    /// between [`Trainer::backward`] and [`Trainer::update`] (the update then starts from the
    /// new value, and the checkpoint that step writes holds it): a tied copy refreshed, a
    /// weight projected.
    pub fn set_param(&mut self, var: &candle_core::Var, value: &Tensor) -> Result<()> {
        self.write_param("Trainer::set_param", var, value, false)
    }

    /// As [`Trainer::set_param`], adding `delta` to the parameter's value where the trainer keeps
    /// it (the f32 master under mixed precision, so that steps below the model dtype's
    /// resolution add up): a selection bias moved by the step's routing counts (DeepSeek-V3's).
    /// A ZeRO-3 group gathered at the time is released, to be gathered again from the shards
    /// when next read.
    pub fn add_to_param(&mut self, var: &candle_core::Var, delta: &Tensor) -> Result<()> {
        self.write_param("Trainer::add_to_param", var, delta, true)
    }

    fn write_param(&mut self, op: &'static str, var: &candle_core::Var, value: &Tensor, add: bool) -> Result<()> {
        self.settle_scheduled(op)?;
        let Some(&i) = self.ids.get(&var.as_tensor().id()) else {
            return Err(Error::usage(self.rank, op, "the variable is not one of this trainer's parameters (a VarMap variable it adopted)"));
        };
        let p = self.params.get(i);
        if value.dims() != p.shape.as_slice() {
            return Err(Error::usage(self.rank, op, format!("`{}` is {:?}; the value is {:?}", p.name, p.shape, value.dims())));
        }
        let values = value.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let apply = |dst: &mut [f32], src: &[f32]| match add {
            true => dst.iter_mut().zip(src).for_each(|(d, s)| *d += s),
            false => dst.copy_from_slice(src),
        };
        if let Some(z) = &self.e.zero {
            let write = |m: &mut [f32]| {
                for s in z.segments.iter().filter(|s| s.param == i) {
                    apply(&mut m[s.shard_offset..s.shard_offset + s.within.len()], &values[s.within.clone()]);
                }
            };
            if self.zero3.is_some() {
                self.e.ddp.with_master(write);
            } else {
                write(self.e.master.as_mut_slice());
                for s in z.segments.iter().filter(|s| s.param == i) {
                    self.e.master.release(s.shard_offset..s.shard_offset + s.within.len());
                }
            }
        }
        if self.params.is_resident(i) {
            self.params.update_one(i, &mut |v| apply(v, &values))?;
            self.params.sync_device()?;
            if let Some(v) = self.model_vars.get(i) {
                v.set(&self.params.get(i).var.as_tensor().to_dtype(self.compute)?)?;
            }
        } else if var.elem_count() == values.len() {
            // ZeRO-3 with the group gathered now: the copy set as a gather would fill it, or,
            // for a sum the copy's rounding cannot hold, dropped to be gathered again.
            match (add, &self.zero3) {
                (false, _) => var.set(&value.to_dtype(var.dtype())?)?,
                (true, Some(z)) => z.release_all()?,
                (true, None) => {}
            }
        }
        Ok(())
    }

    /// ZeRO-3: collective; gathers every sharded group into the model's variables and keeps
    /// them whole until the next optimizer step (so the model can be read freely: an export
    /// on rank 0, evaluation on some ranks, or use after the trainer is dropped). Nothing
    /// under other stages.
    pub fn unshard(&self) -> Result<()> {
        match &self.zero3 {
            Some(z) => z.gather_all(),
            None => Ok(()),
        }
    }

    /// ZeRO-3: the group gathers done so far, and how many groups hold whole values now
    /// (`(0, 0)` under other stages).
    pub fn zero3_stats(&self) -> (u64, usize) {
        self.zero3.as_ref().map_or((0, 0), |z| z.stats())
    }

    /// DDP's buckets: parameter indices (into [`Trainer::signature`]) per bucket, in the order
    /// they are communicated.
    pub fn buckets(&self) -> Vec<Vec<usize>> {
        self.e.ddp.plan().iter().map(|b| b.params.clone()).collect()
    }

    /// Collective: writes a checkpoint of the parameters and optimizer state as
    /// `dir/step-NNNNNNNN` (each rank its shard under ZeRO; rank 0 commits it atomically once
    /// every shard is on disk). It reloads at any world size and ZeRO stage.
    pub fn save(&mut self, dir: impl AsRef<Path>) -> Result<PathBuf> {
        if self.micro != 0 {
            return Err(Error::usage(
                self.comm.rank().get(),
                "Trainer::save",
                format!("{} micro-steps of an accumulation are pending; save after the step that completes it", self.micro),
            ));
        }
        // A ZeRO-3 gather that failed since the step (in the user's evaluation, say) is the
        // cause of whatever the checkpoint's collectives would meet.
        if let Some(z) = &self.zero3 {
            z.take_error()?;
        }
        // A background write of `checkpoint_every` ends first (its commit is the older step).
        if let Some(c) = self.cadence.as_mut() {
            c.settle()?;
        }
        self.settle_scheduled("Trainer::save")?;
        Ok(self.write_checkpoint(dir.as_ref(), false, BTreeMap::new(), false)?.wait()?)
    }

    /// `ddp.schedule`: waits until every begun step's update is applied, and takes the
    /// optimizer back from the scheduler (before the optimizer or a whole model is read).
    fn settle_scheduled(&mut self, op: &'static str) -> Result<()> {
        match self.scheduled.as_mut() {
            Some(s) => s.settle(&mut self.e.opt, op),
            None => Ok(()),
        }
    }

    /// Starts writing a checkpoint (on a thread of its own with `background`; the values are
    /// copied first, so training may go on). `extra`: metadata beside the trainer's; `crash`:
    /// the test hook that aborts after this rank's shard is written.
    fn write_checkpoint(&self, dir: &Path, background: bool, extra: BTreeMap<String, String>, crash: bool) -> Result<PendingSave> {
        self.write_checkpoint_with(Write { dir, background, extra, crash })
    }

    /// [`Trainer::write_checkpoint`] of a [`Write`].
    fn write_checkpoint_with(&self, w: Write<'_>) -> Result<PendingSave> {
        if let Some(s) = &self.spread {
            return self.write_whole(s, w);
        }
        let Write { dir, background, extra, crash } = w;
        let replica = self.e.replica(&self.params, self.opts.ddp.local_sgd.is_some());
        let mut meta = self.meta.clone();
        let split = self.shares.as_ref().map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).clone());
        meta.extend(kolo_train::checkpointing::loop_state_meta(None, split.as_deref()));
        meta.extend(extra);
        Ok(replica.save(dir, self.steps, self.data_pos, meta, background, crash)?)
    }

    /// Tensor parallelism: the group assembles whole tensors (parameters and optimizer state)
    /// and its member 0 in each data-parallel replica writes them as DDP would, under the
    /// model's names; the others wait for it unless the write is in the background.
    fn write_whole(&self, s: &Spread, w: Write<'_>) -> Result<PendingSave> {
        let Write { dir, background, extra, crash } = w;
        let (codec, codec_meta) = self.replica_codec_state(s)?;
        // PipeDream-2BW carrying versions: the version the next step runs on, beside the latest.
        let previous = self.carried.lock().unwrap_or_else(|p| p.into_inner()).clone().filter(|(v, _)| v + 1 == self.steps);
        let previous = previous.map(|(_, values)| s.layout.gather(&self.flat_of(&values)?)).transpose()?;
        // ZeRO-3: this rank's pieces gathered from the data-parallel group's shards first.
        let values = s.layout.gather(&self.flat_params()?)?;
        let mut states = Vec::new();
        for (name, v) in self.e.opt.state() {
            states.push((name, s.layout.gather(&self.unshard_state(v)?)?));
        }
        let mut saved = PendingSave { target: dir.join(format!("step-{:08}", self.steps)), thread: None };
        if s.layout.writes() {
            let whole = s.layout.param_set(&values)?;
            let mut opt = Optimizer::new(self.e.opt.spec().clone(), values.len());
            opt.load_state(self.e.opt.steps(), &states).map_err(|e| Error::usage(self.rank, "Trainer::save", e))?;
            let mut meta = self.meta.clone();
            meta.extend(loop_state_meta(self.e.scaler.as_ref(), None));
            meta.extend(codec_meta);
            meta.extend(extra);
            let (comm, pos) = (&*self.comm, self.data_pos);
            // Local SGD: each replica's own whole model and optimizer state beside replica 0's.
            let mut own = match self.opts.ddp.local_sgd {
                Some(_) => kolo_train::local_sgd::local_model_pieces(&whole, &opt, comm.rank().get())?,
                None => Vec::new(),
            };
            own.extend(codec);
            // The replicas hold the same versions: the first one writes it.
            if let Some(p) = previous.as_ref().filter(|_| comm.rank().get() == 0) {
                own.extend(whole.iter().map(|w| kolo_checkpoint::Piece {
                    name: format!("{}{}", kolo_train::pipeline::PREVIOUS_WEIGHTS, w.name),
                    shape: w.shape.clone(),
                    offset: 0,
                    data: p[w.range.clone()].to_vec(),
                }));
            }
            saved = save_checkpoint(dir, self.steps, &whole, &[], &opt, None, comm, pos, &meta, own, background, crash)?;
        }
        if !background {
            saved = PendingSave { target: saved.wait()?, thread: None };
            s.world.barrier()?;
        }
        Ok(saved)
    }

    /// ZeRO-1/2: collective over the data-parallel group; an optimizer state buffer of this
    /// rank's shard spread over the trainer's flat layout, every rank's shard in place (each
    /// element lives on one rank, so a sum puts them together). Without ZeRO, `v` as it is.
    fn unshard_state(&self, v: &[f32]) -> Result<Vec<f32>> {
        let Some(z) = &self.e.zero else { return Ok(v.to_vec()) };
        let mut flat = vec![0f32; self.params.numel()];
        z.scatter(self.e.ddp.ranges(), v, &mut flat);
        self.comm.all_reduce(kolo_comm::BufMut::from(&mut flat[..]), kolo_comm::ReduceOp::Sum)?;
        Ok(flat)
    }

    /// ZeRO-1/2: this rank's shard of a state buffer in the trainer's flat layout.
    fn shard_state(&self, flat: Vec<f32>) -> Vec<f32> {
        let Some(z) = &self.e.zero else { return flat };
        let mut shard = vec![0f32; z.len];
        z.gather(self.e.ddp.ranges(), &flat, &mut shard);
        shard
    }

    /// Gradient compression on a mesh: every rank's codec state (error-feedback residuals,
    /// PowerSGD factors: its own buckets') gathered to its replica's writer, named
    /// `state.rank{replica}.model{place}.codec{bucket}`, and the metadata (the codec's sync count,
    /// the replica's size). Collective over the replica's ranks; nothing without a codec state.
    fn replica_codec_state(&self, s: &Spread) -> Result<(Vec<kolo_checkpoint::Piece>, BTreeMap<String, String>)> {
        let (syncs, states) = self.e.ddp.compression_state()?;
        let mut meta = kolo_train::checkpointing::codec_meta(syncs);
        let m = &*s.model;
        let size = m.world_size().get();
        meta.insert(CODEC_MESH_KEY.to_string(), size.to_string());
        // What each rank's state fits: its parameters' pieces and its buckets.
        let mine = [self.codec_layout_hash()];
        let mut layouts = vec![0i64; size];
        m.all_gather(kolo_comm::BufRef::from(&mine[..]), kolo_comm::BufMut::from(&mut layouts[..]))?;
        for (r, h) in layouts.iter().enumerate() {
            meta.insert(format!("{CODEC_LAYOUT_KEY}.model{r}"), h.to_string());
        }
        // Buckets and their lengths, then the values, each padded to the longest rank's.
        let mut most = [states.len() as i64];
        m.all_reduce(kolo_comm::BufMut::from(&mut most[..]), kolo_comm::ReduceOp::Max)?;
        let mut lens = states.iter().map(|v| v.len() as i64).collect::<Vec<_>>();
        lens.resize(most[0] as usize, 0);
        let mut all_lens = vec![0i64; lens.len() * size];
        m.all_gather(kolo_comm::BufRef::from(&lens[..]), kolo_comm::BufMut::from(&mut all_lens[..]))?;
        let widest = all_lens.chunks(lens.len().max(1)).map(|l| l.iter().sum::<i64>()).max().unwrap_or(0) as usize;
        if widest == 0 {
            return Ok((Vec::new(), meta));
        }
        let mut mine: Vec<f32> = states.concat();
        mine.resize(widest, 0.0);
        let mut all = vec![0f32; widest * size];
        m.all_gather(kolo_comm::BufRef::from(&mine[..]), kolo_comm::BufMut::from(&mut all[..]))?;
        let replica = self.comm.rank().get();
        let mut pieces = Vec::new();
        for (r, (lens, data)) in all_lens.chunks(lens.len().max(1)).zip(all.chunks(widest)).enumerate() {
            let mut at = 0;
            for (b, &len) in lens.iter().enumerate() {
                let len = len as usize;
                if len > 0 {
                    let name = format!("state.rank{replica}.model{r}.codec{b}");
                    pieces.push(kolo_checkpoint::Piece { name, shape: vec![len], offset: 0, data: data[at..at + len].to_vec() });
                }
                at += len;
            }
        }
        Ok((pieces, meta))
    }

    /// A hash of what this rank's codec state is laid out by: its parameters (names, the
    /// shapes of its pieces) and its gradient buckets.
    fn codec_layout_hash(&self) -> i64 {
        let mut sig = self.params.signature();
        sig.extend(self.e.ddp.plan().iter().enumerate().map(|(b, k)| (format!("bucket{b}"), vec![k.numel])));
        fingerprint_hash(&sig)
    }

    /// Tensor parallelism: reads a checkpoint of whole tensors into this member's pieces
    /// (`flat`, the trainer's layout) and optimizer state.
    fn load_whole(&mut self, path: &Path, flat: &mut Vec<f32>) -> Result<kolo_train::checkpointing::Resumed> {
        let t = self.spread.as_ref().expect("called for a spread model");
        let whole = t.layout.param_set(&vec![0f32; t.layout.numel])?;
        let mut full = vec![0f32; t.layout.numel];
        let mut opt = Optimizer::new(self.e.opt.spec().clone(), full.len());
        let ranges: Vec<_> = whole.iter().map(|p| p.range.clone()).collect();
        let r = load_checkpoint(path, &whole, &mut full, &mut opt, None, &ranges, &self.meta)?;
        if self.opts.ddp.local_sgd.is_some() {
            // Local SGD: this replica's own whole model and optimizer state (by its index in
            // the data-parallel group), cut into this member's pieces below.
            let (dp, world) = (self.comm.rank().get(), self.comm.world_size().get());
            if let Some(note) = kolo_train::local_sgd::restore_local_model(&r, &mut full, &mut opt, dp, world)? {
                if self.rank == 0 {
                    kolo_base::eline!("{note}");
                }
            }
        }
        *flat = t.layout.local(&full);
        let states: Vec<(&str, Vec<f32>)> = opt.state().into_iter().map(|(n, v)| (n, self.shard_state(t.layout.local(v)))).collect();
        self.e.opt.load_state(opt.steps(), &states).map_err(|e| Error::usage(self.rank, "Trainer::resume", e))?;
        Ok(r)
    }

    /// On a mesh: this rank's codec state by its replica and its place in the replica, when the
    /// checkpoint's replicas were laid out as this run's (a note says why not otherwise).
    fn restore_spread_codec(&self, r: &kolo_train::checkpointing::Resumed) -> Result<Option<String>> {
        let s = self.spread.as_ref().expect("called for a spread model");
        let (rank, world) = (self.comm.rank().get(), self.comm.world_size().get());
        let size = s.model.world_size().get();
        let layout = r.meta.get(&format!("{CODEC_LAYOUT_KEY}.model{}", s.model.rank().get()));
        let other = match (r.world_size == world as u64, r.meta.get(CODEC_MESH_KEY)) {
            (false, _) => Some(format!("{} replicas", r.world_size)),
            (true, Some(m)) if *m != size.to_string() => Some(format!("replicas of {m} ranks")),
            (true, Some(_)) if layout != Some(&self.codec_layout_hash().to_string()) => {
                Some("another cut of the model over the replica's ranks".to_string())
            }
            _ => None,
        };
        let owner = format!("rank{rank}.model{}", s.model.rank().get());
        Ok(kolo_train::checkpointing::restore_compression_of(&self.e.ddp, r, &owner, other.as_deref(), world)?)
    }

    /// Continues from the newest complete checkpoint under `train.checkpoint_dir`, as
    /// [`Trainer::resume`] at whatever world size the job now has; `None` (nothing changed)
    /// when there is no such directory or no complete checkpoint in it. This is what a job
    /// restarted by an elastic launcher does ([`crate::Dist::restart_count`] above 0: `kolo
    /// launch --min-nodes` started the survivors again), as `kolo train` does: at most the
    /// steps since the last checkpoint are lost. Call it on every rank before the first step.
    pub fn resume_newest(&mut self) -> Result<Option<u64>> {
        let Some(dir) = self.opts.train.checkpoint_dir.clone() else { return Ok(None) };
        match kolo_train::checkpointing::newest_checkpoint(Path::new(&dir)) {
            Some(p) => self.resume(p).map(Some),
            None => Ok(None),
        }
    }

    /// Loads a checkpoint written by [`Trainer::save`] (a `step-*` directory, or the directory
    /// holding them: the newest complete one is taken) at any world size or ZeRO stage, and
    /// continues from its step. Every rank reads the same files. Returns the step.
    pub fn resume(&mut self, path: impl AsRef<Path>) -> Result<u64> {
        Ok(self.resume_state(path.as_ref())?.1.step)
    }

    /// [`Trainer::resume`], returning the checkpoint's directory and what it held.
    pub(crate) fn resume_state(&mut self, path: &Path) -> Result<(PathBuf, kolo_train::checkpointing::Resumed)> {
        self.settle_scheduled("Trainer::resume")?;
        let path = resolve_checkpoint(path)?;
        let (r, notes) = match &self.spread {
            Some(_) => {
                let mut flat = vec![0f32; self.params.numel()];
                let r = self.load_whole(&path, &mut flat)?;
                let note = self.restore_spread_codec(&r)?;
                self.e.set_values(&self.params, &flat, r.loss_scale)?;
                (r, note.into_iter().collect())
            }
            None => self.e.resume(&path, &self.params, &self.meta, self.opts.ddp.local_sgd.is_some())?,
        };
        for note in notes.iter().filter(|_| self.rank == 0) {
            kolo_base::eline!("{note}");
        }
        publish(&self.params, &self.model_vars, self.compute)?;
        if let Some(z) = &self.zero3 {
            z.release_all()?;
        }
        let split = kolo_train::sampler::resumed_split(r.batch_split.as_deref(), self.opts.data.batch_size, self.data_replicas);
        if let (Some(shares), Some(split)) = (&self.shares, split) {
            *shares.lock().unwrap_or_else(|p| p.into_inner()) = split;
        }
        self.steps = r.step;
        if let Some(s) = self.scheduled.as_mut() {
            s.restart_at(r.step);
        }
        self.data_pos = r.pos;
        // PipeDream-2BW carrying versions: the version the first step after the checkpoint
        // runs on, when it holds one (ZeRO-3 keeps no versions: 2BW refuses it).
        let previous = match self.zero3 {
            None if r.step > 0 => self.previous_of(&r)?.map(|values| (r.step - 1, values)),
            _ => None,
        };
        *self.carried.lock().unwrap_or_else(|p| p.into_inner()) = previous;
        self.micro = 0;
        self.start_agreed = false;
        self.step_start = None;
        self.step_loss = 0.0;
        // The report restarts at the resumed step (its endpoint and files are reopened).
        if let Some(mut c) = self.cadence.take() {
            c.settle()?;
        }
        if self.driven.is_none() {
            self.cadence = Some(Cadence::new(reporter(&self.opts, self.rank, self.data_replicas, r.step)?));
        }
        Ok((path, r))
    }
}

/// What `kolo train`'s driver reads and sets of the trainer it steps ([`crate::builtin`]).
impl Trainer {
    /// The driver's hand on the step: the replica's share of the batch, the test hooks, the
    /// last step's record.
    pub(crate) fn driven_mut(&mut self) -> &mut Driven {
        self.driven.get_or_insert_with(Driven::default)
    }

    /// Whether parameter groups are sharded (ZeRO-3): reading them is collective.
    pub(crate) fn is_zero3(&self) -> bool {
        self.zero3.is_some()
    }

    /// When the last backward ended.
    pub(crate) fn backward_end(&self) -> Option<Instant> {
        self.backward_end
    }

    /// Before the model and the optimizer are read whole (`op`): a ZeRO-3 gather that failed,
    /// and under `ddp.schedule` every begun step's update applied, the optimizer taken back.
    pub(crate) fn settle(&mut self, op: &'static str) -> Result<()> {
        self.zero3_failure()?;
        self.settle_scheduled(op)
    }

    /// ZeRO-3: a gather that failed since the last look (in a forward pass), as its error.
    pub(crate) fn zero3_failure(&self) -> Result<()> {
        match &self.zero3 {
            Some(z) => Ok(z.take_error()?),
            None => Ok(()),
        }
    }

    /// The engine (DDP's plan and ZeRO's shard, for the run's first line).
    pub(crate) fn engine(&self) -> &kolo_train::update::Engine {
        &self.e
    }

    /// f16 computed by the model itself from f32 parameters (kolo train's casts, torch's
    /// autocast): the loss is scaled as the trainer scales an f16 model's.
    pub(crate) fn scale_losses(&mut self) {
        self.e.scaler.get_or_insert_with(LossScaler::new);
    }

    /// The checkpoints' metadata other than the model's signature: `meta`.
    pub(crate) fn replace_meta(&mut self, meta: BTreeMap<String, String>) {
        let key = kolo_train::checkpointing::SIGNATURE_KEY;
        let signature = self.meta.remove(key);
        self.meta = meta;
        self.meta.extend(signature.map(|s| (key.to_string(), s)));
    }

    /// Collective: the whole model's parameters on every rank (a split model's pieces put
    /// together, ZeRO-3's groups gathered), in the order of `signature` (the whole model's
    /// names and shapes, as one process lays them out).
    pub(crate) fn whole_params(&self, signature: &[(String, Vec<usize>)]) -> Result<Vec<f32>> {
        let flat = self.flat_params()?;
        let Some(s) = &self.spread else { return Ok(flat) };
        let whole = s.layout.gather(&flat)?;
        let mut at = HashMap::new();
        let mut start = 0;
        for (name, shape) in &s.layout.signature {
            let n: usize = shape.iter().product();
            at.insert(name.as_str(), (start..start + n, shape));
            start += n;
        }
        let mut out = Vec::with_capacity(whole.len());
        for (name, shape) in signature {
            match at.get(name.as_str()) {
                Some((range, have)) if *have == shape => out.extend_from_slice(&whole[range.clone()]),
                _ => {
                    return Err(Error::usage(
                        self.rank,
                        "Trainer::whole_params",
                        format!("the model has no parameter `{name}` of shape {shape:?}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Starts writing the checkpoint the driver asks for.
    pub(crate) fn save_at(&mut self, at: kolo_train::driver::SaveAt<'_>) -> Result<PendingSave> {
        self.settle("Trainer::save")?;
        self.data_pos = at.pos;
        self.write_checkpoint_with(Write { dir: at.dir, background: at.background, extra: at.meta, crash: at.crash })
    }

    /// PipeDream-2BW: this trainer's cell of the weight version before the latest.
    pub(crate) fn carried_versions(&self) -> crate::pp::Carried {
        self.carried.clone()
    }

    /// Values of the trainer's parameters (in its order) as its flat f32 layout.
    fn flat_of(&self, values: &[Tensor]) -> Result<Vec<f32>> {
        let mut flat = vec![0f32; self.params.numel()];
        for (i, v) in values.iter().enumerate() {
            let r = self.params.get(i).range.clone();
            flat[r].copy_from_slice(&v.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        Ok(flat)
    }

    /// PipeDream-2BW: the previous weight version a resumed checkpoint holds
    /// (`state.previous_weights.{name}` of the whole model), as this rank's parameters' values
    /// in the trainer's order; `None` when it holds none (another strategy wrote it).
    pub(crate) fn previous_of(&self, r: &kolo_train::checkpointing::Resumed) -> Result<Option<Vec<Tensor>>> {
        let Some(s) = &self.spread else { return Ok(None) };
        let mut whole = Vec::with_capacity(s.layout.numel);
        for (name, _) in &s.layout.signature {
            match r.strategy_state.get(&format!("{}{name}", kolo_train::pipeline::PREVIOUS_WEIGHTS)) {
                Some(v) => whole.extend_from_slice(v),
                None => return Ok(None),
            }
        }
        if whole.len() != s.layout.numel {
            return Err(Error::usage(self.rank, "Trainer::resume", "the checkpoint's previous weight version does not fit the model"));
        }
        let local = s.layout.local(&whole);
        let vars = self.compute_vars().ok_or_else(|| Error::usage(self.rank, "Trainer::resume", "ZeRO-3 keeps no weight versions"))?;
        let mut out = Vec::with_capacity(vars.len());
        for (i, var) in vars.iter().enumerate() {
            let r = self.params.get(i).range.clone();
            out.push(Tensor::from_slice(&local[r], var.shape(), var.device())?.to_dtype(var.dtype())?);
        }
        Ok(Some(out))
    }

    /// Model states this rank holds between steps (under `ddp.schedule` with the scheduler's
    /// gradient buffers).
    pub(crate) fn state_bytes(&self) -> kolo_train::summary::StateBytes {
        let mut b = self.e.state_bytes(&self.params);
        b.grads += self.scheduled.as_ref().map_or(0, |s| s.grad_bytes());
        b
    }
}

/// A checkpoint to write: where, in the background or not, metadata beside the trainer's, and
/// the crash test hook. (PipeDream-2BW's previous weight version comes from the trainer's
/// carried cell, written as whole tensors under `state.previous_weights.{name}`.)
struct Write<'a> {
    dir: &'a Path,
    background: bool,
    extra: BTreeMap<String, String>,
    crash: bool,
}

/// Checkpoint metadata: the ranks of one replica whose codec states a mesh's checkpoint holds.
const CODEC_MESH_KEY: &str = "kolo.codec_replica_ranks";
/// Checkpoint metadata: per rank of a replica (`.model{r}`), the layout its codec state fits.
const CODEC_LAYOUT_KEY: &str = "kolo.codec_layout";

/// The VarMap's variables in natural name order as the trainer's parameters (f32 masters of a
/// bf16/f16 model), their ids, the model's own variables of a mixed-precision model, and the
/// dtype the model computes in.
pub(crate) type Adopted = (ParamSet, HashMap<TensorId, usize>, Vec<candle_core::Var>, DType);

#[cfg(feature = "ps")]
pub(crate) fn adopt(varmap: &VarMap, rank: usize, precision: Precision, device: &str) -> Result<Adopted> {
    adopt_vars(varmap_vars(varmap, rank)?, rank, precision, device)
}

/// The VarMap's variables in natural name order (not empty).
fn varmap_vars(varmap: &VarMap, rank: usize) -> Result<Vec<(String, candle_core::Var)>> {
    let mut vars: Vec<(String, candle_core::Var)> =
        varmap.data().lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    if vars.is_empty() {
        return Err(Error::usage(
            rank,
            "Trainer::new",
            "the VarMap holds no parameters: build the model through VarBuilder::from_varmap(&varmap, ..) before creating the Trainer",
        ));
    }
    vars.sort_by_cached_key(|(n, _)| natural_key(n));
    Ok(vars)
}

/// `vars`, in their order, as the trainer's parameters (see [`adopt`]).
fn adopt_vars(vars: Vec<(String, candle_core::Var)>, rank: usize, precision: Precision, device: &str) -> Result<Adopted> {
    let compute = precision.dtype();
    let mut params = ParamSet::new();
    let mut ids = HashMap::new();
    let mut model_vars = Vec::new();
    for (name, var) in vars {
        if !on_device(device, var.device().location()) {
            return Err(Error::setting(
                "train.device",
                format!(
                    "is \"{device}\", but the model's parameter `{name}` is on {:?}: build the model on the device that dist.use_device(\"{device}\") returns, or set train.device to where the model is",
                    var.device().location()
                ),
            ));
        }
        if var.dtype() != compute {
            return Err(Error::usage(
                rank,
                "Trainer::new",
                format!(
                    "parameter `{name}` is {:?}, but train.precision = {:?} trains a model built in {compute:?}: build it with VarBuilder::from_varmap(&varmap, DType::{compute:?}, ..){}",
                    var.dtype(),
                    precision,
                    if compute == DType::F32 { " or set train.precision to the model's dtype" } else { "" }
                ),
            ));
        }
        ids.insert(var.as_tensor().id(), params.len());
        if compute == DType::F32 {
            params.adopt(&name, var)?;
        } else {
            // Mixed precision, as DeepSpeed's bf16/fp16 modes: the optimizer steps f32
            // masters; the model computes with their bf16/f16 copies.
            params.adopt(&name, candle_core::Var::from_tensor(&var.as_tensor().to_dtype(DType::F32)?)?)?;
            model_vars.push(var);
        }
    }
    Ok((params, ids, model_vars, compute))
}

/// Whether a parameter at `loc` is on `train.device`: `cpu`, `cuda` (any GPU: each rank
/// chose its own with `Dist::use_device`) or `cuda:N`.
fn on_device(device: &str, loc: candle_core::DeviceLocation) -> bool {
    use candle_core::DeviceLocation as L;
    match (device, loc) {
        ("cpu", L::Cpu) => true,
        ("cuda", L::Cuda { .. }) => true,
        (d, L::Cuda { gpu_id }) => d.strip_prefix("cuda:").and_then(|n| n.parse::<usize>().ok()) == Some(gpu_id),
        _ => false,
    }
}

/// After the parameters changed: a GPU model's variables get the host values the optimizer
/// stepped, and under mixed precision the model's bf16/f16 variables are rewritten from the
/// f32 masters (in f32 on the CPU nothing is left to do: the model's variables are the
/// parameters). ZeRO-3's sharded groups are left out:
/// their masters live as shards, gathered and rounded into the model's variables when read.
pub(crate) fn publish(params: &ParamSet, model_vars: &[candle_core::Var], compute: DType) -> Result<()> {
    params.sync_device()?;
    for (i, v) in model_vars.iter().enumerate().filter(|(i, _)| params.is_resident(*i)) {
        v.set(&params.get(i).var.as_tensor().to_dtype(compute)?)?;
    }
    Ok(())
}

/// Replica `rank` of `replicas`'s sampler over `len` examples from `pos`, as `kolo train` deals
/// its data (see [`Trainer::sampler`]).
pub(crate) fn replica_sampler(
    o: &TrainOptions,
    len: usize,
    (rank, replicas): (usize, usize),
    pos: Position,
    shares: Option<&kolo_train::sampler::Shares>,
) -> Result<crate::data::Sampler> {
    let d = &o.data;
    if d.batch_size == 0 {
        return Err(Error::setting("data.batch_size", "the sampler needs the examples per rank and micro-step: set [data] batch_size"));
    }
    let cfg = crate::data::SamplerConfig {
        len,
        world: replicas,
        rank,
        batch: d.batch_size,
        seed: o.train.seed,
        shuffle: d.shuffle,
        drop_last: d.drop_last,
    };
    // As kolo train deals them: contiguous slices in deterministic mode, a share of each global
    // batch under dynamic batch sizing.
    crate::data::Sampler::for_replica(cfg, pos, o.ddp.deterministic, shares).map_err(|e| Error::setting("data", e))
}

/// The options' checks (`kolo train`'s rules) and what this place cannot run: parameter
/// servers (the `PsWorker`'s), a communicator started with other deadlines, ZeRO-3 without
/// groups, and on a split model deterministic mode, dynamic batches or a GPU.
fn check_place(opts: &TrainOptions, place: &Place, groups: &[&str]) -> Result<()> {
    opts.check()?;
    if opts.train.strategy == Strategy::Ps {
        return Err(Error::setting(
            "train.strategy",
            "\"ps\" trains through parameter servers: train with kolo::PsWorker::join(&varmap, opts), under `kolo ps run --exec`",
        ));
    }
    check_deadlines(&opts.ddp, place.deadlines)?;
    if opts.ddp.zero_stage == 3 && groups.is_empty() {
        return Err(Error::setting(
            "ddp.zero_stage",
            "3 shards parameter groups named by prefix: create the trainer with Trainer::with_zero3_groups(&varmap, &dist, opts, &[\"layers.0.\", ..])",
        ));
    }
    let model_parallel = place.tp.is_some() || place.pp.is_some() || place.sp.is_some() || place.ep.is_some();
    if opts.ddp.deterministic && model_parallel {
        return Err(Error::setting("ddp.deterministic", kolo_train::config::DETERMINISTIC_LIMITS));
    }
    if opts.ddp.dynamic_batch_every > 0 && (model_parallel || opts.data.batch_size == 0) {
        let why = match model_parallel {
            true => kolo_train::config::DYNAMIC_BATCH_LIMITS,
            false => "needs [data] batch_size: the global batch it splits is batch_size x ranks",
        };
        return Err(Error::setting("ddp.dynamic_batch_every", why));
    }
    if opts.ddp.schedule.is_some() && (model_parallel || !groups.is_empty() || opts.train.device != "cpu") {
        return Err(Error::setting("ddp.schedule", "runs plain f32 DDP on the CPU: no [mesh], ZeRO-3 groups or GPU"));
    }
    if opts.train.device != "cpu" && model_parallel {
        return Err(Error::setting("train.device", kolo_train::config::gpu_refusal(&opts.train.device)));
    }
    Ok(())
}

/// The value of a micro-step's loss, which must be a float scalar (`op` names the call).
pub(crate) fn scalar_loss(rank: usize, op: &'static str, loss: &Tensor) -> Result<f32> {
    if loss.elem_count() != 1 || !loss.dtype().is_float() {
        return Err(Error::usage(
            rank,
            op,
            format!(
                "the loss is a {:?} tensor of shape {:?}; backward needs a float scalar (for example `.mean_all()`)",
                loss.dtype(),
                loss.dims()
            ),
        ));
    }
    Ok(loss.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?[0])
}

/// A routed backward's failure, for the call `op`.
pub(crate) fn route_error(rank: usize, op: &'static str, e: kolo_train::update::RouteError) -> Error {
    match e {
        kolo_train::update::RouteError::Outside(dims) => Error::usage(
            rank,
            op,
            format!(
                "a variable of shape {dims:?} outside the VarMap given to the Trainer received a gradient; Kolo would neither synchronise nor update it (create every parameter through the VarMap's VarBuilder, or detach it)"
            ),
        ),
        kolo_train::update::RouteError::Backward(e) => e.into(),
        kolo_train::update::RouteError::Diverged(e) => e.into(),
    }
}

/// `ddp.timeout_secs` and `ddp.liveness_secs` belong to the communicator, which exists before
/// the trainer: they must be the ones it was started with (not checked for a communicator made
/// elsewhere).
fn check_deadlines(d: &DdpSettings, started: Option<crate::dist::Deadlines>) -> Result<()> {
    let Some(have) = started else { return Ok(()) };
    let settings = [
        ("ddp.timeout_secs", d.timeout_secs, crate::dist::timeout_of(d.timeout_secs), have.timeout),
        ("ddp.liveness_secs", d.liveness_secs, crate::dist::seconds(d.liveness_secs), have.liveness),
    ];
    match settings.into_iter().find(|(_, _, want, have)| want != have) {
        None => Ok(()),
        Some((setting, secs, _, have)) => Err(Error::setting(
            setting,
            format!(
                "{secs} s, but this rank's communicator was started with {} s: start it with kolo::init_with(&opts.init_options())",
                have.as_secs_f64()
            ),
        )),
    }
}

/// The run's reporter: examples per optimizer step over all ranks from `[data] batch_size`.
pub(crate) fn reporter(o: &TrainOptions, rank: usize, world: usize, start: u64) -> Result<Reporter> {
    let global = kolo_train::config::global_batch(o.data.batch_size, world, o.train.grad_accum);
    Ok(Reporter::for_train(&o.train, o.data.tokens_per_example.max(1), rank, false, global, start)?)
}

/// Tensor and pipeline parallelism's setup, collective over their groups: the whole model's
/// layout (over pipeline stages: every stage's parameters), refusals of what is not supported
/// yet, a check that every member of a tensor-parallel group splits the same whole model, and
/// member 0's values of the parameters every member holds whole made everyone's. Without
/// either, a split model is refused (DDP would sum different pieces). Returns the state and
/// the whole model's signature (the checkpoints' model).
fn spread(place: &Place, params: &ParamSet, ids: &HashMap<TensorId, usize>) -> Result<(Option<Spread>, Signature)> {
    // An expert-parallel group is laid out as pipeline stages are: each member holds its own
    // experts, and the parameters every member holds are tied (gradients summed, checkpoints
    // and the norm taking member 0's).
    // Over pipeline stages the layout reduces tied parameters and assembles checkpoints on a
    // group of its own: the pipeline group carries activations, which PipeDream-2BW's stream
    // keeps in flight across an update.
    let stages_own = match &place.pp {
        Some(p) => Some(kolo_comm::split(&**p, Some(0), p.rank().get() as u32)?.expect("every stage has a color")),
        None => None,
    };
    let stages = place.ep.iter().map(|e| (e.clone(), None)).chain(stages_own.map(|p| (p, place.stage_replicas.clone()))).collect();
    let layout = crate::tp::WholeLayout::new(params, ids, place.tp.clone(), stages, natural_key)?;
    let signature = layout.signature.clone();
    if place.tp.is_none() && place.pp.is_none() && place.ep.is_none() {
        if let Some(name) = layout.any_split() {
            return Err(Error::usage(
                place.rank,
                "Trainer::new",
                format!("`{name}` is split by kolo::tp layers over a tensor-parallel group: create the trainer with Trainer::with_mesh(&varmap, &mesh, opts) (plain DDP would sum different pieces)"),
            ));
        }
        return Ok((None, signature));
    }
    if let Some(tp) = &place.tp {
        let mine = [fingerprint_hash(&signature)];
        let mut all = vec![0i64; tp.size()];
        tp.comm().all_gather(kolo_comm::BufRef::from(&mine[..]), kolo_comm::BufMut::from(&mut all[..]))?;
        if let Some(other) = all.iter().position(|h| *h != mine[0]) {
            return Err(Error::usage(
                place.rank,
                "Trainer::with_mesh",
                format!(
                    "tensor-parallel member {other} splits another model ({}; names and whole shapes differ)",
                    model_fingerprint(&signature)
                ),
            ));
        }
        layout.broadcast_whole(params)?;
    }
    if layout.has_tied() {
        // Each stage's copy starts from the first stage's values (under ZeRO-2/3 the stages
        // must shard a tied parameter alike: `WholeLayout::reduce_tied` checks it).
        layout.init_tied(params)?;
    }
    // The clipping norm: every piece and stage of a replica, summed over its ranks.
    let model = place.model.clone().expect("a model-parallel group with tp, pp or ep");
    let norm: (Arc<dyn kolo_base::GroupSum>, Vec<bool>) = (kolo_comm::SumGroup::new(model.clone()), layout.split_flags());
    let ep = place.ep.as_ref().map_or(1, |e| e.world_size().get());
    Ok((Some(Spread { layout, norm, pp: place.pp.clone(), ep, world: place.world.clone(), model }), signature))
}

/// Parameters as `(name, shape)`.
type Signature = Vec<(String, Vec<usize>)>;

/// [`model_fingerprint`]'s hash as one number (to compare across ranks).
fn fingerprint_hash(sig: &[(String, Vec<usize>)]) -> i64 {
    let text = model_fingerprint(sig);
    (text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)) >> 1) as i64
}

/// A short text that changes with any parameter's name or shape (checkpoint compatibility).
/// What every checkpoint of the library's writes and checks on load: the model (its parameters'
/// names and shapes), the optimizer, the data's replicas and per-rank batch (a resume at another
/// world size rescales the sampler's position by examples), the ZeRO stage and the precision.
pub(crate) fn checkpoint_meta(
    signature: &[(String, Vec<usize>)],
    opts: &TrainOptions,
    replicas: usize,
    zero_stage: u8,
    compute: DType,
) -> BTreeMap<String, String> {
    let batch = opts.data.batch_size.max(1);
    let mut meta = kolo_train::checkpointing::base_meta(model_fingerprint(signature), &opts.optimizer_spec(), replicas, batch, zero_stage);
    meta.insert(kolo_train::checkpointing::SIGNATURE_KEY.to_string(), kolo_train::checkpointing::model_signature(signature));
    meta.insert("kolo.precision".to_string(), format!("{compute:?}"));
    meta
}

fn model_fingerprint(sig: &[(String, Vec<usize>)]) -> String {
    format!("varmap: {}", kolo_train::checkpointing::signature_text(sig))
}

#[cfg(test)]
mod tests {
    use super::natural_key;

    /// The library's `kolo.model` of existing checkpoints keeps its text (its loader compares
    /// it where a checkpoint has no `kolo.signature`); the value is FNV-1a computed apart.
    #[test]
    fn the_model_fingerprint_keeps_its_text() {
        let sig = [("a".to_string(), vec![2, 3]), ("b".to_string(), vec![5])];
        assert_eq!(super::model_fingerprint(&sig), "varmap: 2 tensors, 11 values, fnv1a 001bf0402f6ae3fc");
        // The signature does not depend on the order, the fingerprint does.
        let swapped = [sig[1].clone(), sig[0].clone()];
        assert_eq!(kolo_train::checkpointing::model_signature(&sig), kolo_train::checkpointing::model_signature(&swapped));
        assert_ne!(super::model_fingerprint(&sig), super::model_fingerprint(&swapped));
    }

    #[test]
    fn names_sort_by_their_numbers() {
        let mut v = vec!["layers.10.w", "layers.2.w", "head", "layers.2.b", "emb"];
        v.sort_by_cached_key(|n| natural_key(n));
        assert_eq!(v, ["emb", "head", "layers.2.b", "layers.2.w", "layers.10.w"]);
    }
}
