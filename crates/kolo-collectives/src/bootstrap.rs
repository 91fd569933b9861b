//! From launcher variables to a connected communicator: rank 0 hosts the store, everyone
//! authenticates to it, checks that all agree on the world size, and connects the mesh.

use crate::{HostComm, HostCommConfig};
use kolo_base::{Deadline, Rank, WorldSize};
use kolo_comm::{CommError, OpKind};
use kolo_rendezvous::{abandon_join, store_barrier, JobToken, LaunchEnv, MemoryStore, Store, TcpStore, TcpStoreServer, JOIN_BARRIER};
use std::net::{IpAddr, ToSocketAddrs, UdpSocket};
use std::sync::Arc;

pub struct Bootstrapped {
    pub comm: Arc<HostComm>,
    /// Local rank and size on this host (from the launcher).
    pub local_rank: usize,
    pub local_world_size: usize,
}

fn setup(rank: usize, what: String) -> CommError {
    CommError::Setup { op: OpKind::Setup, rank: Rank(rank), what }
}

/// This host's address on the route to `master` (no packet is sent: connecting a UDP socket only
/// picks the route).
fn local_ip_towards(master: &str) -> Option<IpAddr> {
    let target = (master, 9).to_socket_addrs().ok()?.next()?;
    if target.ip().is_loopback() {
        return Some(target.ip());
    }
    let bind = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let s = UdpSocket::bind(bind).ok()?;
    s.connect(target).ok()?;
    Some(s.local_addr().ok()?.ip())
}

/// Joins the job described by `env` (or runs alone when `env` is `None`).
pub fn bootstrap(env: Option<&LaunchEnv>, mut cfg: HostCommConfig) -> Result<Bootstrapped, CommError> {
    let Some(env) = env else {
        let comm = HostComm::connect(Arc::new(MemoryStore::new()), JobToken::generate(), "w", Rank(0), WorldSize::new(1).expect("1"), cfg)?;
        return Ok(Bootstrapped { comm: Arc::new(comm), local_rank: 0, local_world_size: 1 });
    };
    let rank = env.rank;
    let n = WorldSize::new(env.world_size).ok_or_else(|| setup(rank, "world size 0".into()))?;
    let token = match (&env.token, n.get()) {
        (Some(t), _) => t.clone(),
        (None, 1) => JobToken::generate(),
        (None, _) => {
            return Err(setup(
                rank,
                "no job token: start ranks with `kolo launch`, or give every rank the same KOLO_JOB_TOKEN (hex) or KOLO_JOB_TOKEN_FILE"
                    .into(),
            ))
        }
    };
    let deadline = Deadline::after(cfg.timeout);
    let addr = env.store_addr();
    let server = if rank == 0 {
        let s = TcpStoreServer::start(addr.as_str(), token.clone())
            .map_err(|e| setup(rank, format!("rank 0 cannot host the store on {addr}: {e} (is MASTER_PORT in use?)")))?;
        Some(Arc::new(s))
    } else {
        None
    };
    let store: Arc<dyn Store> =
        Arc::new(TcpStore::connect(&addr, &token, deadline).map_err(|e| setup(rank, format!("joining the job's store: {e}")))?);
    if rank == 0 {
        store.set("kolo/world_size", n.get().to_string().as_bytes()).map_err(|e| setup(rank, e.to_string()))?;
    }
    let theirs = store.get("kolo/world_size", deadline).map_err(|e| setup(rank, e.to_string()))?;
    let theirs = String::from_utf8_lossy(&theirs).into_owned();
    // A mismatch found here is left in the store before failing, so every other rank fails
    // with the same reason at once instead of at its deadline.
    if theirs != n.get().to_string() {
        let why = format!("rank {rank} was started with world size {n} but rank 0 says {theirs}");
        abandon_join(&*store, &why);
        return Err(setup(rank, format!("this rank was started with world size {n} but rank 0 says {theirs}")));
    }
    if store.add(&format!("kolo/rank/{rank}"), 1).map_err(|e| setup(rank, e.to_string()))? > 1 {
        let why = format!("rank {rank} joined twice: two processes were given the same RANK");
        abandon_join(&*store, &why);
        return Err(setup(rank, why));
    }
    store_barrier(&*store, JOIN_BARRIER, n.get(), deadline).map_err(|e| setup(rank, format!("waiting for all {n} ranks to join: {e}")))?;
    if cfg.advertise_ip.is_loopback() {
        if let Some(ip) = local_ip_towards(&env.master_addr) {
            cfg.advertise_ip = ip;
        }
    }
    // Rank 0 hosts the job's store (its heartbeats' silence is its own).
    let comm = HostComm::connect_with_server(store, token, "w", Rank(rank), n, cfg, server, Some(0))?;
    Ok(Bootstrapped { comm: Arc::new(comm), local_rank: env.local_rank, local_world_size: env.local_world_size })
}
