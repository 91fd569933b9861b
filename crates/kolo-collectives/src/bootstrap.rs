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

/// The listening socket `kolo launch` bound on `port` and handed to rank 0 as descriptor `fd`
/// (`KOLO_STORE_FD`); refused unless it is a TCP listener on that port.
fn handed_over(fd: i32, port: u16) -> std::io::Result<std::net::TcpListener> {
    use std::os::fd::FromRawFd;
    let mut kind: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `kind`; an fd that is not a socket fails.
    let rc = unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_ACCEPTCONN, (&mut kind as *mut libc::c_int).cast(), &mut len) };
    if rc != 0 || kind == 0 {
        return Err(std::io::Error::other(format!("KOLO_STORE_FD={fd} is not a listening socket")));
    }
    // SAFETY: `fd` is a listening socket this process inherited and nothing else owns.
    let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
    match l.local_addr()?.port() {
        p if p == port => Ok(l),
        p => Err(std::io::Error::other(format!("KOLO_STORE_FD={fd} listens on port {p}, not MASTER_PORT {port}"))),
    }
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
        let s = match env.store_fd {
            Some(fd) => handed_over(fd, env.master_port).and_then(|l| TcpStoreServer::start_on(l, token.clone())),
            None => TcpStoreServer::start(addr.as_str(), token.clone()),
        };
        let s = s.map_err(|e| setup(rank, format!("rank 0 cannot host the store on {addr}: {e} (is MASTER_PORT in use?)")))?;
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

#[cfg(test)]
mod tests {
    use std::os::fd::{AsRawFd, IntoRawFd};

    /// Rank 0 takes the launcher's socket only when it is a TCP listener on MASTER_PORT; any
    /// other descriptor is refused, naming it.
    #[test]
    fn a_handed_over_store_socket_must_listen_on_master_port() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // SAFETY: dup of a descriptor this test owns; each copy is owned by what it is given to.
        let dup = || unsafe { libc::dup(l.as_raw_fd()) };
        let got = super::handed_over(dup(), port).unwrap();
        assert_eq!(got.local_addr().unwrap().port(), port);
        let e = super::handed_over(dup(), port.wrapping_add(1)).unwrap_err().to_string();
        assert!(e.contains(&format!("listens on port {port}, not MASTER_PORT")), "{e}");
        let file = std::fs::File::open("/proc/self/status").unwrap().into_raw_fd();
        let e = super::handed_over(file, port).unwrap_err().to_string();
        assert!(e.contains("is not a listening socket"), "{e}");
        // SAFETY: the file's descriptor was handed to nothing that owns it.
        unsafe { libc::close(file) };
        let connected = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap().into_raw_fd();
        let e = super::handed_over(connected, port).unwrap_err().to_string();
        assert!(e.contains("is not a listening socket"), "{e}");
        // SAFETY: as above.
        unsafe { libc::close(connected) };
    }
}
