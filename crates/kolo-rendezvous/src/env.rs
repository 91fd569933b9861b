//! Discovery of rank, world size and rendezvous address from launcher environment variables.
//!
//! Understood, in this order: Kolo's own launcher and torchrun (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`), Slurm (`SLURM_PROCID`,
//! `SLURM_NTASKS`, `SLURM_LOCALID`, …) and Open MPI (`OMPI_COMM_WORLD_*`). The job token comes
//! from `KOLO_JOB_TOKEN` (hex) or the file named by `KOLO_JOB_TOKEN_FILE`; an elastic job's
//! round from `KOLO_RESTART_COUNT` (`kolo launch --min-nodes`) or `TORCHELASTIC_RESTART_COUNT`
//! (torchrun).

use crate::JobToken;
use std::collections::HashMap;
use std::fmt;

pub const DEFAULT_MASTER_PORT: u16 = 29500;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// `kolo launch` or torchrun.
    Torchrun,
    Slurm,
    OpenMpi,
}

impl fmt::Display for EnvSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EnvSource::Torchrun => "torchrun-style variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)",
            EnvSource::Slurm => "Slurm (SLURM_PROCID, SLURM_NTASKS)",
            EnvSource::OpenMpi => "Open MPI (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)",
        })
    }
}

/// The variable naming the listening socket `kolo launch` hands to rank 0 ([`LaunchEnv::store_fd`]).
pub const STORE_FD: &str = "KOLO_STORE_FD";

/// Where this process sits in the job and how to reach the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    pub token: Option<JobToken>,
    pub source: EnvSource,
    /// How many times an elastic launcher restarted the job (0: the first start).
    pub restart_count: usize,
    /// `KOLO_STORE_FD`: a listening socket on `MASTER_PORT` that `kolo launch` bound and handed
    /// to rank 0, which hosts the store on it (no window between choosing the port and binding
    /// it, in which another process could take it).
    pub store_fd: Option<i32>,
}

impl LaunchEnv {
    pub fn store_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

fn num(vars: &HashMap<String, String>, key: &str) -> Result<Option<usize>, String> {
    match vars.get(key) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| format!("{key}={v:?} is not a non-negative integer")),
    }
}

fn need(vars: &HashMap<String, String>, key: &str, why: &str) -> Result<usize, String> {
    num(vars, key)?.ok_or_else(|| format!("{key} is not set ({why})"))
}

/// Reads the variables of a launcher. `Ok(None)` when none of the known launchers set anything
/// (a plain single-process run).
pub fn discover<I, K, V>(vars: I) -> Result<Option<LaunchEnv>, String>
where
    I: IntoIterator<Item = (K, V)>,
    K: Into<String>,
    V: Into<String>,
{
    let vars: HashMap<String, String> = vars.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
    let (source, rank, world_size, local_rank, local_world_size) = if vars.contains_key("RANK") || vars.contains_key("WORLD_SIZE") {
        let rank = need(&vars, "RANK", "WORLD_SIZE is set")?;
        let ws = need(&vars, "WORLD_SIZE", "RANK is set")?;
        let lr = num(&vars, "LOCAL_RANK")?.unwrap_or(rank);
        let lws = num(&vars, "LOCAL_WORLD_SIZE")?.unwrap_or(ws);
        (EnvSource::Torchrun, rank, ws, lr, lws)
    } else if vars.contains_key("SLURM_PROCID") {
        let rank = need(&vars, "SLURM_PROCID", "Slurm")?;
        let ws = need(&vars, "SLURM_NTASKS", "SLURM_PROCID is set")?;
        let lr = num(&vars, "SLURM_LOCALID")?.unwrap_or(0);
        let nodes = num(&vars, "SLURM_NNODES")?.unwrap_or(1).max(1);
        // SLURM_NTASKS_PER_NODE may look like "4" or "4(x2)"; fall back to an even split.
        let lws = vars
            .get("SLURM_NTASKS_PER_NODE")
            .and_then(|v| v.split('(').next().and_then(|n| n.trim().parse::<usize>().ok()))
            .unwrap_or(ws.div_ceil(nodes));
        (EnvSource::Slurm, rank, ws, lr, lws)
    } else if vars.contains_key("OMPI_COMM_WORLD_RANK") {
        let rank = need(&vars, "OMPI_COMM_WORLD_RANK", "Open MPI")?;
        let ws = need(&vars, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set")?;
        let lr = num(&vars, "OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
        let lws = num(&vars, "OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(ws);
        (EnvSource::OpenMpi, rank, ws, lr, lws)
    } else {
        return Ok(None);
    };
    if world_size == 0 {
        return Err(format!("{source}: the world size is 0"));
    }
    if rank >= world_size {
        return Err(format!("{source}: rank {rank} is not below the world size {world_size}"));
    }
    if local_world_size == 0 || local_rank >= local_world_size {
        return Err(format!("{source}: local rank {local_rank} is not below the local world size {local_world_size}"));
    }
    let master_addr = vars
        .get("MASTER_ADDR")
        .cloned()
        .or_else(|| (source == EnvSource::Slurm).then(|| vars.get("SLURM_LAUNCH_NODE_IPADDR").cloned()).flatten())
        .or_else(|| (local_world_size == world_size).then(|| "127.0.0.1".to_string()))
        .ok_or_else(|| format!("{source}: MASTER_ADDR is not set and the job spans several hosts; set it to rank 0's host"))?;
    let master_port = match vars.get("MASTER_PORT") {
        Some(p) => p.trim().parse::<u16>().map_err(|_| format!("MASTER_PORT={p:?} is not a port number"))?,
        None => match (source, num(&vars, "SLURM_JOB_ID")?) {
            // Every rank of a Slurm job derives the same port from the job id.
            (EnvSource::Slurm, Some(id)) => 20000 + (id % 20000) as u16,
            _ => DEFAULT_MASTER_PORT,
        },
    };
    let token = match (vars.get("KOLO_JOB_TOKEN"), vars.get("KOLO_JOB_TOKEN_FILE")) {
        (Some(t), _) => Some(JobToken::from_hex(t).map_err(|e| format!("KOLO_JOB_TOKEN: {e}"))?),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("KOLO_JOB_TOKEN_FILE={path}: {e}"))?;
            Some(JobToken::from_hex(&text).map_err(|e| format!("KOLO_JOB_TOKEN_FILE={path}: {e}"))?)
        }
        (None, None) => None,
    };
    let restart_count = num(&vars, "KOLO_RESTART_COUNT")?.or(num(&vars, "TORCHELASTIC_RESTART_COUNT")?).unwrap_or(0);
    let store_fd =
        num(&vars, STORE_FD)?.map(|fd| i32::try_from(fd).map_err(|_| format!("{STORE_FD}={fd} is not a file descriptor"))).transpose()?;
    Ok(Some(LaunchEnv { rank, world_size, local_rank, local_world_size, master_addr, master_port, token, source, restart_count, store_fd }))
}
