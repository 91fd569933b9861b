//! The entry point of `kolo train`'s training: [`run`] picks the strategy the config names and
//! hands it to the one training loop, `crate::driver`.

pub use crate::checkpointing::newest_checkpoint;
use crate::checkpointing::resolve_checkpoint;
use crate::config::Config;
use crate::driver::{Start, Strategy};
use crate::setup::{load_data, Data, Setup};
use crate::summary::{retain_freed_memory, RunOptions, Summary};
use crate::TrainError;
use kolo_comm::Communicator;
use std::path::Path;
use std::sync::Arc;

/// Builds the strategy of a run (data parallelism with ZeRO and `ddp.schedule`, tensor,
/// sequence and expert parallelism, GPipe, 1F1B and PipeDream-2BW pipelines): from
/// the config resolved for the job, every rank of the job, this replica's data, the checkpoint to continue from and
/// the run's options, the strategy and where it starts. It is the library's: `kolo::builtin`,
/// the built-in models trained by `kolo::Trainer`, as a user's model is.
pub type TrainerBuilder =
    dyn Fn(&Setup, Arc<dyn Communicator>, &Data, Option<&Path>, &RunOptions) -> Result<(Box<dyn Strategy>, Start), TrainError>;

/// Trains `cfg` on this rank of `comm`: builds the strategy the config names (`trainer`
/// builds it) and runs it on the driver to the end.
/// `kolo::builtin::run` passes the library's strategies.
pub fn run(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions, trainer: &TrainerBuilder) -> Result<Summary, TrainError> {
    let global_rank = comm.rank().get();
    retain_freed_memory();
    // Before anything else: every rank was started with the same job.
    crate::agreement::check_same_job(cfg, &*comm)?;
    select_device(&cfg.train.device)?;
    // The mesh: pipeline stages (pp) of data-parallel replicas (dp) of tensor-parallel groups
    // (tp, consecutive ranks). DDP, data and evaluation run over the dp group; the model's
    // blocks are split over the tp group; stages talk over the pp group.
    let mesh = cfg.mesh_for(comm.world_size().get()).map_err(TrainError::Config)?;
    if cfg.train.strategy == crate::config::Strategy::Ps {
        return Err(TrainError::Config("train.strategy = \"ps\" trains through parameter servers: run it with `kolo ps run` (or `kolo train` with KOLO_PS_COORDINATOR set)".into()));
    }
    let resume = opts.resume.as_deref().map(resolve_checkpoint).transpose()?;
    let resume = resume.as_deref();
    crate::agreement::check_same_start(resume, &*comm)?;
    // Loads the data of replica `data_rank`, builds the strategy and drives it.
    let start = |data_rank: usize| -> Result<(Data, Option<usize>), TrainError> {
        let data = load_data(cfg, data_rank)?;
        crate::agreement::check_same_data(cfg.data.kind, &data, &*comm)?;
        let heap_before = kolo_base::alloc::stats().map(|h| h.live);
        Ok((data, heap_before))
    };
    // Replicas (dp; each member of an expert-parallel group one) of sequence chunks (sp) of
    // tensor-parallel groups (tp, consecutive ranks), in each pipeline stage (pp, slowest).
    let (data, heap) = start((global_rank / (mesh.tp * mesh.sp)) % mesh.dp)?;
    // From here on the strategy and the driver see the config's typed parts, resolved once.
    let setup = Setup::new(cfg, mesh, &data)?;
    let (mut s, from) = trainer(&setup, comm.clone(), &data, resume, opts)?;
    crate::driver::drive(&setup, opts, crate::driver::Job::Ranks(&*comm), &data, heap, &mut *s, from)
}

/// `train.device`: `cuda` alone is one GPU per local rank (torchrun's LOCAL_RANK convention).
fn select_device(device: &str) -> Result<(), TrainError> {
    if device == "cpu" {
        return Ok(());
    }
    let local_rank = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
    kolo_tensor::select_device(device, local_rank).map_err(|e| TrainError::Config(format!("train.device: {e}")))?;
    Ok(())
}
