//! Checkpoints of a data-parallel run: every rank writes its pieces (the whole model from
//! rank 0 under DDP, each rank's shard under ZeRO) and rank 0 commits the directory; loading
//! assembles whole tensors, so a checkpoint reloads at any world size and ZeRO stage.

use crate::sampler::Position;
use crate::TrainError;
use kolo_checkpoint::Piece;
use kolo_comm::Communicator;
use kolo_ddp::ShardPlan;
use kolo_optim::{LossScaler, Optimizer};
use kolo_tensor::ParamSet;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The newest checkpoint in a directory of them (`step-*` directories with a manifest, or
/// older single-file `step-*.safetensors`), or the path itself when it is one checkpoint.
/// The newest complete checkpoint in directory `dir`, if there is one (elastic restarts).
pub fn newest_checkpoint(dir: &Path) -> Option<PathBuf> {
    dir.is_dir().then(|| resolve_checkpoint(dir).ok()).flatten()
}

pub fn resolve_checkpoint(p: &Path) -> Result<PathBuf, TrainError> {
    if !p.is_dir() || p.join(kolo_checkpoint::sharded::MANIFEST).exists() {
        return Ok(p.to_path_buf());
    }
    let step_of = |f: &Path| -> Option<u64> {
        let name = f.file_name()?.to_string_lossy().into_owned();
        let num = name.strip_prefix("step-")?;
        let num = num.strip_suffix(".safetensors").unwrap_or(num);
        let complete = f.join(kolo_checkpoint::sharded::MANIFEST).is_file() || (f.is_file() && name.ends_with(".safetensors"));
        complete.then(|| num.parse().ok()).flatten()
    };
    std::fs::read_dir(p)
        .map_err(|e| TrainError::Data(format!("{}: {e}", p.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|f| step_of(&f).map(|s| (s, f)))
        .max()
        .map(|(_, f)| f)
        .ok_or_else(|| TrainError::Data(format!("no complete checkpoint (step-*) in {}", p.display())))
}

/// A checkpoint being written on a background thread.
pub struct PendingSave {
    pub target: PathBuf,
    /// `None` when it was written synchronously.
    pub thread: Option<std::thread::JoinHandle<Result<(), kolo_checkpoint::CheckpointError>>>,
}

impl PendingSave {
    pub fn wait(self) -> Result<PathBuf, TrainError> {
        match self.thread.map(|t| t.join()) {
            None => Ok(self.target),
            Some(Ok(r)) => r.map(|_| self.target).map_err(TrainError::from),
            Some(Err(_)) => Err(TrainError::Other(format!("the background writer of {} panicked", self.target.display()))),
        }
    }
}

/// Collective: every rank writes its pieces (the whole model from rank 0 for plain DDP, each
/// rank's shard under ZeRO), then rank 0 commits the checkpoint directory. `master` is this
/// rank's shard of the parameters under ZeRO (unused otherwise). With `background`, the pieces
/// are copied and written by a thread (rank 0's thread commits once every shard file is there)
/// while training continues. `own`: this rank's own state (named `state.rank{r}.…`, such as a
/// codec's residuals); when any rank has some, every rank writes a shard.
#[allow(clippy::too_many_arguments)]
pub fn save_checkpoint(
    dir: &Path,
    step: u64,
    params: &ParamSet,
    master: &[f32],
    opt: &Optimizer,
    zero: Option<&ShardPlan>,
    comm: &dyn Communicator,
    pos: Position,
    meta_base: &BTreeMap<String, String>,
    own: Vec<Piece>,
    background: bool,
    crash: bool,
) -> Result<PendingSave, TrainError> {
    let (rank, world) = (comm.rank().get(), comm.world_size().get());
    let target = dir.join(format!("step-{step:08}"));
    if rank == 0 {
        std::fs::create_dir_all(dir).map_err(|source| kolo_checkpoint::CheckpointError::Io { path: dir.to_path_buf(), source })?;
        kolo_checkpoint::sharded::begin(&target)?;
    }
    comm.barrier()?;
    let list: Vec<_> = params.iter().collect();
    let mut pieces = Vec::new();
    match zero {
        None if rank == 0 => {
            let flat = params.to_flat()?;
            for p in &list {
                pieces.push(Piece {
                    name: format!("model.{}", p.name),
                    shape: p.shape.clone(),
                    offset: 0,
                    data: flat[p.range.clone()].to_vec(),
                });
                for (state, buf) in opt.state() {
                    pieces.push(Piece {
                        name: format!("optim.{state}.{}", p.name),
                        shape: p.shape.clone(),
                        offset: 0,
                        data: buf[p.range.clone()].to_vec(),
                    });
                }
            }
        }
        None => {}
        Some(plan) => {
            for seg in &plan.segments {
                let p = &list[seg.param];
                let at = seg.shard_offset;
                pieces.push(Piece {
                    name: format!("model.{}", p.name),
                    shape: p.shape.clone(),
                    offset: seg.within.start,
                    data: master[at..at + seg.within.len()].to_vec(),
                });
                for (state, buf) in opt.state() {
                    let data = buf[seg.shard_offset..seg.shard_offset + seg.within.len()].to_vec();
                    pieces.push(Piece {
                        name: format!("optim.{state}.{}", p.name),
                        shape: p.shape.clone(),
                        offset: seg.within.start,
                        data,
                    });
                }
            }
        }
    }
    let every_rank = {
        let mut any = [u8::from(!own.is_empty())];
        comm.all_reduce(kolo_comm::BufMut::from(&mut any[..]), kolo_comm::ReduceOp::Max)?;
        any[0] == 1
    };
    pieces.extend(own);
    refuse_non_finite(&pieces, step, &target, comm)?;
    let writers = if zero.is_some() || every_rank { world } else { 1 };
    let mut meta = meta_base.clone();
    meta.insert("kolo.step".into(), step.to_string());
    meta.insert("kolo.optimizer_steps".into(), opt.steps().to_string());
    meta.insert("kolo.data_epoch".into(), pos.epoch.to_string());
    meta.insert("kolo.data_batch".into(), pos.batch.to_string());
    if background {
        let (t, timeout) = (target.clone(), comm.timeout());
        let thread = std::thread::Builder::new()
            .name("kolo-checkpoint".into())
            .spawn(move || {
                if rank < writers {
                    kolo_checkpoint::sharded::write_shard(&t, rank, writers, &pieces)?;
                }
                drop(pieces);
                if rank == 0 {
                    kolo_checkpoint::sharded::commit_when_complete(&t, writers, &meta, timeout)?;
                }
                Ok(())
            })
            .map_err(|e| TrainError::Other(format!("cannot start the checkpoint writer: {e}")))?;
        return Ok(PendingSave { target, thread: Some(thread) });
    }
    if rank < writers {
        kolo_checkpoint::sharded::write_shard(&target, rank, writers, &pieces)?;
    }
    if crash {
        kolo_base::eline!("rank {rank}: crashing in the middle of saving {} (test hook)", target.display());
        std::process::abort();
    }
    // Commit only once every rank's shard is on disk; nobody runs ahead before the commit.
    comm.barrier()?;
    if rank == 0 {
        kolo_checkpoint::sharded::commit(&target, &meta)?;
    }
    comm.barrier()?;
    Ok(PendingSave { target, thread: None })
}

/// Fails every rank, before anything is written, when a value of the checkpoint is NaN or
/// infinite on any rank (issue #34: a diverged GPT's checkpoints were committed with 1,859,139 of
/// 1,859,907 values non-finite, and an elastic restart would have resumed from them). The
/// staging directory is removed, so the newest complete checkpoint stays the one to resume.
fn refuse_non_finite(pieces: &[Piece], step: u64, target: &Path, comm: &dyn Communicator) -> Result<(), TrainError> {
    let mine = pieces.iter().map(|p| p.data.iter().filter(|v| !v.is_finite()).count()).sum::<usize>();
    let first = pieces.iter().find(|p| p.data.iter().any(|v| !v.is_finite())).map(|p| p.name.clone());
    let mut counts = [mine as f64, pieces.iter().map(|p| p.data.len()).sum::<usize>() as f64];
    comm.all_reduce(kolo_comm::BufMut::from(&mut counts[..]), kolo_comm::ReduceOp::Sum)?;
    if counts[0] == 0.0 {
        return Ok(());
    }
    if comm.rank().get() == 0 {
        let _ = std::fs::remove_dir_all(kolo_checkpoint::sharded::staging_dir(target));
    }
    let here = first.map_or(String::new(), |n| format!("; on this rank first in `{n}`"));
    Err(TrainError::Data(format!(
        "step {step}: {} of the {} values to checkpoint are NaN or infinite{here}: the run diverged, and {} is not written (the newest complete checkpoint is the one to resume)",
        counts[0] as u64,
        counts[1] as u64,
        target.display()
    )))
}

pub struct Resumed {
    pub step: u64,
    pub pos: Position,
    /// f16: the loss scaler's (scale, good steps, skipped steps).
    pub loss_scale: Option<(f64, u64, u64)>,
    /// Dynamic batch sizing: the per-rank shares of the global batch when it was written.
    pub batch_split: Option<Vec<usize>>,
    /// The number of data-parallel replicas that wrote it.
    pub world_size: u64,
    /// The strategies' own state (`state.…` tensors: a rank's codec residuals or local-SGD
    /// model `state.rank{r}.…`, PipeDream-2BW's previous weight version), by name.
    pub strategy_state: BTreeMap<String, Vec<f32>>,
    /// The metadata it was written with.
    pub meta: BTreeMap<String, String>,
}

/// Metadata key of the DDP engine's synchronised steps (the compression warm-up counter).
const DDP_SYNCS_KEY: &str = "kolo.ddp_syncs";

/// The DDP engine's compression state as this rank's checkpoint pieces (each bucket codec's
/// residuals, factors, counters: `state.rank{r}.codec{b}`) and its metadata (the warm-up
/// counter, the same on every rank).
pub fn compression_pieces(ddp: &kolo_ddp::Ddp, rank: usize) -> Result<(Vec<Piece>, BTreeMap<String, String>), TrainError> {
    compression_pieces_of(ddp, &format!("rank{rank}"))
}

/// [`compression_pieces`] under `state.{owner}.codec{b}` (a mesh's rank names its replica and
/// its place in the replica).
pub fn compression_pieces_of(ddp: &kolo_ddp::Ddp, owner: &str) -> Result<(Vec<Piece>, BTreeMap<String, String>), TrainError> {
    let (syncs, states) = ddp.compression_state()?;
    let pieces = states
        .into_iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(b, v)| Piece { name: format!("state.{owner}.codec{b}"), shape: vec![v.len()], offset: 0, data: v })
        .collect();
    Ok((pieces, codec_meta(syncs)))
}

/// The checkpoint metadata of the codec state: how many gradient exchanges it has seen.
pub fn codec_meta(syncs: u64) -> BTreeMap<String, String> {
    BTreeMap::from([(DDP_SYNCS_KEY.to_string(), syncs.to_string())])
}

/// Restores [`compression_pieces`] on rank `rank` of `world`. Residuals and factors are each
/// rank's own: at another world size they cannot be assigned, so compression restarts from
/// zero state (the warm-up counter is kept) and the returned note says so.
pub fn restore_compression(ddp: &kolo_ddp::Ddp, r: &Resumed, rank: usize, world: usize) -> Result<Option<String>, TrainError> {
    let other = (r.world_size != world as u64).then(|| format!("{} ranks", r.world_size));
    restore_compression_of(ddp, r, &format!("rank{rank}"), other.as_deref(), world)
}

/// [`restore_compression`] from `state.{owner}.codec{b}`; `other`: the layout the checkpoint was
/// written by when it is not this run's (the state then restarts from zero, and the note says so).
pub fn restore_compression_of(
    ddp: &kolo_ddp::Ddp,
    r: &Resumed,
    owner: &str,
    other: Option<&str>,
    world: usize,
) -> Result<Option<String>, TrainError> {
    let syncs = match r.meta.get(DDP_SYNCS_KEY) {
        Some(v) => {
            v.parse::<u64>().map_err(|_| TrainError::Data(format!("checkpoint metadata `{DDP_SYNCS_KEY}` = {v:?} is not a number")))?
        }
        None => r.step,
    };
    let buckets = ddp.plan().len();
    if let Some(other) = other {
        ddp.restore_compression_state(syncs, &vec![Vec::new(); buckets]).ok();
        let had = r.strategy_state.keys().any(|k| k.contains(".codec"));
        return Ok(had.then(|| {
            format!("the compression state (error-feedback residuals, PowerSGD factors) was written by {other} and restarts from zero on {world}")
        }));
    }
    let states: Vec<Vec<f32>> =
        (0..buckets).map(|b| r.strategy_state.get(&format!("state.{owner}.codec{b}")).cloned().unwrap_or_default()).collect();
    ddp.restore_compression_state(syncs, &states)?;
    Ok(None)
}

/// Metadata keys of the loop's own state (beyond parameters, optimizer and data position).
const LOSS_SCALE_KEY: &str = "kolo.loss_scale";
const BATCH_SPLIT_KEY: &str = "kolo.batch_split";

/// The loop state a checkpoint carries in its metadata: the f16 loss scaler and the dynamic
/// batch split (issue #16: without them a resumed run was not the uninterrupted one).
pub fn loop_state_meta(scaler: Option<&LossScaler>, split: Option<&[usize]>) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    if let Some(s) = scaler {
        let (scale, good, skipped) = s.state();
        m.insert(LOSS_SCALE_KEY.to_string(), format!("{scale:e},{good},{skipped}"));
    }
    if let Some(split) = split {
        m.insert(BATCH_SPLIT_KEY.to_string(), split.iter().map(usize::to_string).collect::<Vec<_>>().join(","));
    }
    m
}

/// The metadata key of [`model_signature`].
pub const SIGNATURE_KEY: &str = "kolo.signature";

/// The metadata every checkpoint carries and its loaders compare, `kolo train`'s and the
/// library's alike: the model (`kolo.model`), the optimizer, the data split's world (`replicas`:
/// a change rescales the data position), the examples per replica and micro-step, and the ZeRO
/// stage. Each writer adds its own keys (the seed; the model's signature and precision).
pub fn base_meta(
    model: String,
    optimizer: &kolo_optim::OptimizerSpec,
    replicas: usize,
    batch_size: usize,
    zero_stage: u8,
) -> BTreeMap<String, String> {
    [
        ("kolo.model", model),
        ("kolo.optimizer", format!("{optimizer:?}")),
        ("kolo.world_size", replicas.to_string()),
        ("kolo.batch_size", batch_size.to_string()),
        ("kolo.zero_stage", zero_stage.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// A short text that changes with any parameter's name or shape and not with their order:
/// the same for a model whichever loop wrote the checkpoint (`kolo train` lays the built-in
/// models out as they are built, the library's `Trainer` by name).
pub fn model_signature(sig: &[(String, Vec<usize>)]) -> String {
    let mut sorted: Vec<&(String, Vec<usize>)> = sig.iter().collect();
    sorted.sort();
    signature_text(sorted)
}

/// `N tensors, M values, fnv1a H` of `sig` in the order given (FNV-1a over each
/// `name[shape];`): [`model_signature`] sorts first, the library's `kolo.model` does not.
pub fn signature_text<'a>(sig: impl IntoIterator<Item = &'a (String, Vec<usize>)>) -> String {
    let (mut h, mut tensors, mut numel) = (0xcbf2_9ce4_8422_2325u64, 0, 0usize);
    for (n, s) in sig {
        for b in format!("{n}{s:?};").bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        tensors += 1;
        numel += s.iter().product::<usize>();
    }
    format!("{tensors} tensors, {numel} values, fnv1a {h:016x}")
}

/// Loads a checkpoint written at any world size and ZeRO stage: whole tensors are assembled,
/// then this rank takes the parameters (all of them) and its optimizer state (all of it, or its
/// shard under ZeRO).
pub fn load_checkpoint(
    path: &Path,
    params: &ParamSet,
    flat: &mut [f32],
    opt: &mut Optimizer,
    zero: Option<&ShardPlan>,
    ranges: &[std::ops::Range<usize>],
    meta_base: &BTreeMap<String, String>,
) -> Result<Resumed, TrainError> {
    let ck = kolo_checkpoint::load_any(path)?;
    let incompatible =
        |what: String| TrainError::Checkpoint(kolo_checkpoint::CheckpointError::Incompatible { path: path.to_path_buf(), what });
    // Where both sides name the model by its parameters, that decides: a checkpoint of a
    // built-in model continues in the library's Trainer and the other way round.
    if let (Some(theirs), Some(ours)) = (ck.meta.get(SIGNATURE_KEY), meta_base.get(SIGNATURE_KEY)) {
        if theirs != ours {
            let model = ck.meta(path, "kolo.model")?;
            return Err(incompatible(format!(
                "it was written for kolo.model = {model} ({theirs}), this run has {} ({ours})",
                meta_base["kolo.model"]
            )));
        }
    }
    for key in ["kolo.model", "kolo.optimizer"] {
        if key == "kolo.model" && ck.meta.contains_key(SIGNATURE_KEY) && meta_base.contains_key(SIGNATURE_KEY) {
            continue;
        }
        let theirs = ck.meta(path, key)?;
        if theirs != meta_base[key] {
            return Err(incompatible(format!("it was written for {key} = {theirs}, this run has {}", meta_base[key])));
        }
    }
    let num = |key: &str| -> Result<u64, TrainError> {
        ck.meta(path, key)?.parse::<u64>().map_err(|_| incompatible(format!("metadata `{key}` is not a number")))
    };
    let mut states: Vec<(&str, Vec<f32>)> = opt.spec().state_names().iter().map(|s| (*s, vec![0f32; flat.len()])).collect();
    for p in params.iter() {
        let e = ck.get(&format!("model.{}", p.name)).ok_or_else(|| incompatible(format!("parameter `{}` is missing", p.name)))?;
        if e.shape != p.shape || e.data.len() != p.range.len() {
            return Err(incompatible(format!("parameter `{}` has shape {:?}, the model has {:?}", p.name, e.shape, p.shape)));
        }
        flat[p.range.clone()].copy_from_slice(&e.data);
        for (state, buf) in states.iter_mut() {
            let e = ck
                .get(&format!("optim.{state}.{}", p.name))
                .ok_or_else(|| incompatible(format!("optimizer state `{state}` of `{}` is missing", p.name)))?;
            // Checked like the parameter itself: a mismatched length must not reach the copy.
            if e.shape != p.shape || e.data.len() != p.range.len() {
                return Err(incompatible(format!(
                    "optimizer state `{state}` of `{}` has shape {:?}, the model has {:?}",
                    p.name, e.shape, p.shape
                )));
            }
            buf[p.range.clone()].copy_from_slice(&e.data);
        }
    }
    if let Some(plan) = zero {
        for (_, buf) in states.iter_mut() {
            let mut mine = vec![0f32; plan.len];
            plan.gather(ranges, buf, &mut mine);
            *buf = mine;
        }
    }
    opt.load_state(num("kolo.optimizer_steps")?, &states).map_err(incompatible)?;
    let mut pos = Position { epoch: num("kolo.data_epoch")?, batch: num("kolo.data_batch")? };
    // At another world size or batch size, continue after the same number of examples of the epoch.
    let (w0, b0) = (num("kolo.world_size")?, num("kolo.batch_size")?);
    let (w1, b1): (u64, u64) = (meta_base["kolo.world_size"].parse().unwrap_or(w0), meta_base["kolo.batch_size"].parse().unwrap_or(b0));
    if (w0, b0) != (w1, b1) {
        pos.batch = pos.batch * w0 * b0 / (w1 * b1).max(1);
    }
    let parse_err = |key: &str| incompatible(format!("metadata `{key}` is malformed"));
    let loss_scale = match ck.meta.get(LOSS_SCALE_KEY) {
        Some(v) => {
            let f: Vec<&str> = v.split(',').collect();
            match (
                f.first().and_then(|x| x.parse::<f64>().ok()),
                f.get(1).and_then(|x| x.parse().ok()),
                f.get(2).and_then(|x| x.parse().ok()),
            ) {
                (Some(scale), Some(good), Some(skipped)) if f.len() == 3 && scale.is_finite() && scale > 0.0 => {
                    Some((scale, good, skipped))
                }
                _ => return Err(parse_err(LOSS_SCALE_KEY)),
            }
        }
        None => None,
    };
    let batch_split = match ck.meta.get(BATCH_SPLIT_KEY) {
        Some(v) => Some(v.split(',').map(|x| x.parse::<usize>().map_err(|_| parse_err(BATCH_SPLIT_KEY))).collect::<Result<Vec<_>, _>>()?),
        None => None,
    };
    let strategy_state = ck.tensors.iter().filter(|e| e.name.starts_with("state.")).map(|e| (e.name.clone(), e.data.clone())).collect();
    Ok(Resumed { step: num("kolo.step")?, pos, loss_scale, batch_split, world_size: w0, strategy_state, meta: ck.meta.clone() })
}

/// The directory of the checkpoint due after step `done` of `end` (`train.checkpoint_every`
/// steps, and the last step), if one is due: the cadence of `kolo train`'s driver and the
/// library's trainer.
pub fn due(tc: &crate::config::TrainConfig, done: u64, end: u64) -> Option<&str> {
    tc.checkpoint_dir.as_deref().filter(|_| (tc.checkpoint_every > 0 && done.is_multiple_of(tc.checkpoint_every)) || done == end)
}

/// The log line of a checkpoint written after step `done`.
pub fn saved_line(done: u64, target: &Path, background: bool) -> String {
    format!("step {done}: checkpoint {}{}", target.display(), if background { " (writing in the background)" } else { "" })
}
