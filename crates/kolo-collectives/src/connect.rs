//! Setting up a group's links: every rank listens, publishes its address and host in the store,
//! connects to every lower rank and accepts every higher one. Each connection runs the job-token
//! handshake bound to `(group, from, to)` before it is used. Pairs on the same host then upgrade
//! to shared memory when the configuration allows.

use crate::link::{Link, TcpLink};
use crate::shm::{region_len, ShmLink};
use crate::{HostCommConfig, Transport};
use kolo_base::{Deadline, Rank};
use kolo_comm::{CommError, OpKind};
use kolo_rendezvous::auth::{client_handshake, server_handshake};
use kolo_rendezvous::{JobToken, Store};
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

fn setup_err(rank: usize, what: String) -> CommError {
    CommError::Setup { op: OpKind::Setup, rank: Rank(rank), what }
}

fn purpose(group: &str, from: usize, to: usize) -> String {
    format!("link/{group}/{from}->{to}")
}

/// The default host identity: ranks with equal ids may use shared memory with each other.
/// `KOLO_HOST_ID` overrides it (several "hosts" on one machine, for tests and benchmarks of the
/// hierarchical algorithms, or containers whose hostnames differ but share /dev/shm).
pub fn default_host_id() -> String {
    if let Some(h) = std::env::var("KOLO_HOST_ID").ok().filter(|h| !h.is_empty()) {
        return h;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}#{}", host.trim(), boot.trim())
}

pub(crate) struct Connected {
    pub links: Vec<Option<Link>>,
    pub hosts: Vec<String>,
}

pub(crate) fn connect_group(
    store: &dyn Store,
    token: &JobToken,
    group: &str,
    rank: usize,
    n: usize,
    cfg: &HostCommConfig,
    deadline: Deadline,
) -> Result<Connected, CommError> {
    let err = |what: String| setup_err(rank, what);
    let ip: IpAddr = cfg.advertise_ip;
    let listener = TcpListener::bind((ip, 0)).map_err(|e| err(format!("cannot listen on {ip}: {e}")))?;
    let addr = listener.local_addr().map_err(|e| err(e.to_string()))?;
    let host = cfg.host_id.clone().unwrap_or_else(default_host_id);
    let key = |r: usize| format!("{group}/peer/{r}");
    // Each member's record: its address, its tuning table's digest ("-": none), its host id.
    let tuning = cfg.tuning.as_ref().map_or_else(|| "-".to_string(), |t| t.digest());
    store.set(&key(rank), format!("{addr} {tuning} {host}").as_bytes()).map_err(|e| err(e.to_string()))?;

    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let (lower, higher): (Vec<usize>, Vec<usize>) = (0..n).filter(|r| *r != rank).partition(|r| *r < rank);
    let accepted = std::thread::scope(|s| {
        let acceptor = s.spawn(|| accept_higher(&listener, token, group, rank, n, higher.len(), deadline));
        let mut out = Vec::new();
        for &peer in &lower {
            let rec = store.get(&key(peer), deadline).map_err(|e| err(format!("waiting for rank {peer} to publish its address: {e}")))?;
            let rec = String::from_utf8_lossy(&rec).into_owned();
            let peer_addr: SocketAddr = rec
                .split(' ')
                .next()
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| err(format!("rank {peer} published a bad address `{rec}`")))?;
            out.push((
                peer,
                dial(peer_addr, token, &purpose(group, rank, peer), deadline)
                    .map_err(|e| err(format!("connecting to rank {peer} at {peer_addr}: {e}")))?,
            ));
        }
        let higher_streams = acceptor.join().map_err(|_| err("acceptor thread panicked".into()))??;
        out.extend(higher_streams);
        Ok::<_, CommError>(out)
    })?;
    for (peer, s) in accepted {
        streams[peer] = Some(s);
    }

    let mut hosts = Vec::with_capacity(n);
    for r in 0..n {
        let rec = store.get(&key(r), deadline).map_err(|e| err(e.to_string()))?;
        let rec = String::from_utf8_lossy(&rec).into_owned();
        let mut fields = rec.splitn(3, ' ').skip(1);
        let (theirs, host) = (fields.next().unwrap_or_default(), fields.next().unwrap_or_default());
        // Members that follow different tuning tables could pick different algorithms for the
        // same all-reduce: refuse at once, naming who differs.
        if theirs != tuning {
            let name = |d: &str| if d == "-" { "no tuning table".to_string() } else { format!("tuning table {d}") };
            return Err(err(format!(
                "rank {r} has {} and rank {rank} {}: every rank must read the same --tuning file",
                name(theirs),
                name(&tuning)
            )));
        }
        hosts.push(host.to_string());
    }

    let mut links: Vec<Option<Link>> = (0..n).map(|_| None).collect();
    let shm_peers: Vec<usize> = match cfg.transport {
        Transport::Tcp => Vec::new(),
        Transport::Auto | Transport::Shm => (0..n).filter(|p| *p != rank && hosts[*p] == hosts[rank]).collect(),
    };
    if cfg.transport == Transport::Shm && shm_peers.len() != n - 1 {
        return Err(err("transport `shm` needs every rank on one host; use `auto` for mixed jobs".into()));
    }
    let mut shm = upgrade_shm(store, group, rank, &shm_peers, &mut streams, cfg, deadline)?;
    for (peer, s) in streams.into_iter().enumerate() {
        let Some(s) = s else { continue };
        links[peer] = Some(match shm.remove(&peer) {
            Some(map) => Link::Shm(ShmLink::new(map, cfg.shm_ring.as_usize(), rank < peer, s).map_err(|e| err(e.to_string()))?),
            None => Link::Tcp(TcpLink::new(s, cfg.tcp_buffer.as_usize()).map_err(|e| err(e.to_string()))?),
        });
    }
    Ok(Connected { links, hosts })
}

fn dial(addr: SocketAddr, token: &JobToken, purpose: &str, deadline: Deadline) -> Result<TcpStream, String> {
    loop {
        match TcpStream::connect_timeout(&addr, deadline.remaining().max(Duration::from_millis(1))) {
            Ok(mut s) => {
                let t = Some(deadline.remaining().max(Duration::from_millis(1)));
                s.set_read_timeout(t).map_err(|e| e.to_string())?;
                s.set_write_timeout(t).map_err(|e| e.to_string())?;
                s.set_nodelay(true).map_err(|e| e.to_string())?;
                client_handshake(&mut s, token, purpose, &addr.to_string()).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if deadline.expired() => return Err(format!("gave up after {:?}: {e}", deadline.budget())),
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

fn accept_higher(
    listener: &TcpListener,
    token: &JobToken,
    group: &str,
    rank: usize,
    n: usize,
    expected: usize,
    deadline: Deadline,
) -> Result<Vec<(usize, TcpStream)>, CommError> {
    listener.set_nonblocking(true).map_err(|e| setup_err(rank, e.to_string()))?;
    let mut got: Vec<(usize, TcpStream)> = Vec::new();
    let mut seen = HashSet::new();
    while got.len() < expected {
        match listener.accept() {
            Ok((mut s, from_addr)) => {
                let _ = s.set_nonblocking(false);
                let t = Some(Duration::from_secs(10).min(deadline.remaining().max(Duration::from_millis(1))));
                let _ = s.set_read_timeout(t);
                let _ = s.set_write_timeout(t);
                let _ = s.set_nodelay(true);
                // Strangers and wrong tokens are refused and logged; they do not fail the job.
                match server_handshake(&mut s, token, None, &from_addr.to_string()) {
                    Ok(p) => {
                        let peer = p
                            .strip_prefix(&format!("link/{group}/"))
                            .and_then(|rest| rest.split_once("->"))
                            .and_then(|(f, t)| Some((f.parse::<usize>().ok()?, t.parse::<usize>().ok()?)));
                        match peer {
                            Some((from, to)) if to == rank && from > rank && from < n && seen.insert(from) => got.push((from, s)),
                            _ => kolo_base::eline!("kolo rank {rank}: refused link from {from_addr}: unexpected purpose `{p}`"),
                        }
                    }
                    Err(e) => kolo_base::eline!("kolo rank {rank}: refused connection from {from_addr}: {e}"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if deadline.expired() {
                    let missing: Vec<usize> = (rank + 1..n).filter(|r| !seen.contains(r)).collect();
                    return Err(CommError::Timeout {
                        op: OpKind::Setup,
                        rank: Rank(rank),
                        seq: 0,
                        waited: deadline.budget(),
                        missing: missing.into_iter().map(Rank).collect(),
                    });
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(setup_err(rank, format!("accept failed: {e}"))),
        }
    }
    Ok(got)
}

/// Creates (for higher peers) or opens (for lower peers) one mapping per same-host pair. The
/// file name travels through the authenticated store; the creator unlinks it once the peer has
/// mapped it.
fn upgrade_shm(
    store: &dyn Store,
    group: &str,
    rank: usize,
    peers: &[usize],
    _streams: &mut [Option<TcpStream>],
    cfg: &HostCommConfig,
    deadline: Deadline,
) -> Result<std::collections::HashMap<usize, memmap2::MmapMut>, CommError> {
    let err = |what: String| setup_err(rank, what);
    let cap = cfg.shm_ring.as_usize();
    let mut maps = std::collections::HashMap::new();
    let mut created: Vec<(usize, String)> = Vec::new();
    let mut nonce = [0u8; 8];
    getrandom::getrandom(&mut nonce).map_err(|e| err(e.to_string()))?;
    let nonce = u64::from_le_bytes(nonce);
    let pair_key = |a: usize, b: usize| format!("{group}/shm/{a}-{b}");
    for &p in peers.iter().filter(|p| **p > rank) {
        let safe_group: String = group.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
        let path = format!("{}/kolo-{safe_group}-{rank}-{p}-{nonce:016x}", cfg.shm_dir);
        match ShmLink::create(&path, cap) {
            Ok(map) => {
                store.set(&pair_key(rank, p), path.as_bytes()).map_err(|e| err(e.to_string()))?;
                maps.insert(p, map);
                created.push((p, path));
            }
            Err(e) => {
                if cfg.transport == Transport::Shm {
                    return Err(err(format!("cannot create shared memory {path} ({} bytes): {e}", region_len(cap))));
                }
                tracing::warn!("rank {rank}: shared memory with rank {p} unavailable ({e}); using TCP");
                store.set(&pair_key(rank, p), b"").map_err(|e| err(e.to_string()))?;
            }
        }
    }
    for &p in peers.iter().filter(|p| **p < rank) {
        let path = store.get(&pair_key(p, rank), deadline).map_err(|e| err(e.to_string()))?;
        let path = String::from_utf8_lossy(&path).into_owned();
        let ok = if path.is_empty() {
            false
        } else {
            match ShmLink::open(&path, cap) {
                Ok(map) => {
                    maps.insert(p, map);
                    true
                }
                Err(e) => {
                    tracing::warn!("rank {rank}: cannot open shared memory {path} from rank {p} ({e}); using TCP");
                    false
                }
            }
        };
        store.set(&format!("{}/ack", pair_key(p, rank)), if ok { b"1" } else { b"0" }).map_err(|e| err(e.to_string()))?;
    }
    for (p, path) in created {
        let ack = store.get(&format!("{}/ack", pair_key(rank, p)), deadline);
        let _ = std::fs::remove_file(&path);
        match ack {
            Ok(v) if v == b"1" => {}
            Ok(_) => {
                maps.remove(&p);
            }
            Err(e) => return Err(err(format!("rank {p} did not map shared memory: {e}"))),
        }
    }
    Ok(maps)
}
