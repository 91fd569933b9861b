//! The coordinator (Li et al.'s "scheduler"): hands out server ids, keeps the membership and its
//! epoch, and tracks liveness by heartbeat. A server silent for `dead_after` is dropped (new
//! epoch: its ranges fail over to their replicas); a registering server is added (new epoch:
//! ranges move to it). Workers heartbeat too; silent ones are listed as dead so that another
//! worker can take over their data shard.
//!
//! The coordinator keeps no state on disk. A restarted one (same address and token) recovers
//! the membership from the servers: a server that hears an older epoch than it has seen sends
//! `Rejoin` with the membership it knows, which the coordinator takes whole at the same epoch,
//! so no range moves; servers that do not heartbeat within `dead_after` then fail over as
//! usual. Workers re-register by their heartbeats. While it is down, training goes on (data
//! requests go to the servers); only membership changes wait for it.

use crate::net::{ConnState, Listener};
use crate::wire::{Membership, Req, Resp};
use kolo_rendezvous::JobToken;
use std::collections::BTreeMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Longest a `Membership` request waits on the coordinator; clients loop for longer deadlines.
const MAX_WAIT: Duration = Duration::from_secs(5);

#[derive(Default)]
struct State {
    next_id: u32,
    epoch: u64,
    servers: BTreeMap<u32, (String, Instant)>,
    workers: BTreeMap<u32, Instant>,
    dead_workers: Vec<u32>,
    /// Servers declared dead for silence (see [`Membership::dead_servers`]).
    dead_servers: Vec<u32>,
    /// Dead workers whose shard another worker took over, and by whom.
    adopted: BTreeMap<u32, u32>,
    finished: Vec<u32>,
    shutdown: bool,
}

impl State {
    fn membership(&self) -> Membership {
        Membership {
            epoch: self.epoch,
            servers: self.servers.iter().map(|(id, (a, _))| (*id, a.clone())).collect(),
            shutdown: self.shutdown,
            dead_workers: self.dead_workers.clone(),
            dead_servers: self.dead_servers.clone(),
        }
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

pub struct Coordinator {
    listener: Listener,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    monitor: Option<JoinHandle<()>>,
}

impl Coordinator {
    /// Listens on `addr`; servers and workers silent for `dead_after` are declared dead.
    pub fn start(addr: &str, token: JobToken, dead_after: Duration) -> io::Result<Coordinator> {
        let shared = Arc::new(Shared { state: Mutex::new(State::default()), changed: Condvar::new() });
        let handler = {
            let shared = shared.clone();
            Arc::new(move |_: &mut ConnState, req: Req, _: usize| handle(&shared, req))
        };
        let listener = Listener::start(addr, token, "ps-coordinator", handler)?;
        let stop = Arc::new(AtomicBool::new(false));
        let monitor = {
            let (shared, stop) = (shared.clone(), stop.clone());
            std::thread::Builder::new().name("kolo-ps-monitor".into()).spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                    let mut s = shared.state.lock().unwrap_or_else(|p| p.into_inner());
                    let now = Instant::now();
                    let dead: Vec<u32> = s.servers.iter().filter(|(_, (_, t))| now - *t > dead_after).map(|(id, _)| *id).collect();
                    for id in &dead {
                        let (addr, _) = s.servers.remove(id).expect("listed");
                        s.dead_servers.push(*id);
                        kolo_base::eline!(
                            "kolo ps coordinator: server {id} ({addr}) missed its heartbeats for {:.1} s: removed, its ranges fail over",
                            dead_after.as_secs_f64()
                        );
                    }
                    let lost: Vec<u32> = s.workers.iter().filter(|(_, t)| now - **t > dead_after).map(|(w, _)| *w).collect();
                    for w in &lost {
                        s.workers.remove(w);
                        s.dead_workers.push(*w);
                        kolo_base::eline!(
                            "kolo ps coordinator: worker {w} missed its heartbeats: its data shard is free for another worker"
                        );
                    }
                    // The epoch numbers server memberships only: a lost worker moves no range.
                    if !dead.is_empty() {
                        s.epoch += 1;
                    }
                    if !dead.is_empty() || !lost.is_empty() {
                        shared.changed.notify_all();
                    }
                }
            })?
        };
        Ok(Coordinator { listener, shared, stop, monitor: Some(monitor) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.listener.addr
    }

    pub fn membership(&self) -> Membership {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).membership()
    }

    /// The dead workers whose data shard another worker took over, and by whom.
    pub fn adopted(&self) -> BTreeMap<u32, u32> {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).adopted.clone()
    }

    /// Tells every server (at its next heartbeat) to exit.
    pub fn shutdown(&self) {
        let mut s = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        s.shutdown = true;
        self.shared.changed.notify_all();
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.monitor.take() {
            let _ = h.join();
        }
        self.listener.kill();
    }
}

fn handle(shared: &Shared, req: Req) -> Resp {
    let mut s = shared.state.lock().unwrap_or_else(|p| p.into_inner());
    match req {
        Req::Register { addr } => {
            let id = s.next_id;
            s.next_id += 1;
            s.servers.insert(id, (addr.clone(), Instant::now()));
            s.epoch += 1;
            kolo_base::eline!("kolo ps coordinator: server {id} joined at {addr} (epoch {})", s.epoch);
            shared.changed.notify_all();
            Resp::Registered { id, membership: s.membership() }
        }
        Req::Heartbeat { server } => match s.servers.get_mut(&server) {
            Some((_, t)) => {
                *t = Instant::now();
                Resp::Membership(s.membership())
            }
            // Declared dead (or removed): the membership no longer lists it, which tells it so.
            None => Resp::Membership(s.membership()),
        },
        Req::WorkerBeat { worker } => {
            if !s.finished.contains(&worker) {
                s.workers.insert(worker, Instant::now());
            }
            s.dead_workers.retain(|w| *w != worker);
            Resp::Membership(s.membership())
        }
        Req::WorkerDone { worker } => {
            s.workers.remove(&worker);
            s.finished.push(worker);
            s.dead_workers.retain(|w| *w != worker);
            Resp::Ok { duplicate: false }
        }
        Req::Adopt { worker, by } => {
            if s.dead_workers.contains(&worker) && !s.adopted.contains_key(&worker) {
                s.adopted.insert(worker, by);
                s.dead_workers.retain(|w| *w != worker);
                kolo_base::eline!("kolo ps coordinator: worker {by} takes over dead worker {worker}'s data shard");
                Resp::Ok { duplicate: false }
            } else {
                Resp::Ok { duplicate: true }
            }
        }
        Req::Membership { min_servers, after_epoch } => {
            let deadline = Instant::now() + MAX_WAIT;
            while (s.servers.len() < min_servers as usize || s.epoch <= after_epoch) && !s.shutdown {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                s = shared.changed.wait_timeout(s, left).unwrap_or_else(|p| p.into_inner()).0;
            }
            Resp::Membership(s.membership())
        }
        Req::Remove { server } => {
            if s.servers.remove(&server).is_some() {
                s.epoch += 1;
                kolo_base::eline!("kolo ps coordinator: server {server} removed on request (epoch {}); its ranges move", s.epoch);
                shared.changed.notify_all();
            }
            Resp::Membership(s.membership())
        }
        Req::Rejoin { server, known } => {
            // A restarted coordinator learns the membership from its servers: the first report
            // of a newer epoch than its own is taken whole (same epoch, so nobody reconfigures
            // and no range moves); every listed server then has `dead_after` to heartbeat,
            // and one that died meanwhile fails over as usual.
            if known.epoch > s.epoch && known.servers.iter().any(|(id, _)| *id == server) {
                let now = Instant::now();
                s.epoch = known.epoch;
                s.servers = known.servers.iter().map(|(id, a)| (*id, (a.clone(), now))).collect();
                s.next_id = s.next_id.max(known.servers.iter().map(|(id, _)| id + 1).max().unwrap_or(0));
                kolo_base::eline!(
                    "kolo ps coordinator: recovered the membership of epoch {} ({} servers) from server {server}",
                    s.epoch,
                    s.servers.len()
                );
                shared.changed.notify_all();
            }
            if let Some((_, t)) = s.servers.get_mut(&server) {
                *t = Instant::now();
            }
            Resp::Membership(s.membership())
        }
        Req::Shutdown => {
            s.shutdown = true;
            shared.changed.notify_all();
            Resp::Ok { duplicate: false }
        }
        other => Resp::Error(format!("the coordinator does not serve {}", name_of(&other))),
    }
}

pub(crate) fn name_of(r: &Req) -> &'static str {
    match r {
        Req::Init { .. } => "Init",
        Req::Push { .. } => "Push",
        Req::Pull { .. } => "Pull",
        Req::Transfer { .. } => "Transfer",
        Req::Snapshot { .. } => "Snapshot",
        Req::Restore { .. } => "Restore",
        Req::Stats => "Stats",
        Req::Axpby { .. } => "Axpby",
        Req::Dot { .. } => "Dot",
        Req::Vector { .. } => "Vector",
        Req::Register { .. } => "Register",
        Req::Heartbeat { .. } => "Heartbeat",
        Req::Membership { .. } => "Membership",
        Req::WorkerBeat { .. } => "WorkerBeat",
        Req::Remove { .. } => "Remove",
        Req::Shutdown => "Shutdown",
        Req::Adopt { .. } => "Adopt",
        Req::WorkerDone { .. } => "WorkerDone",
        Req::Rejoin { .. } => "Rejoin",
    }
}

/// Asks the coordinator at `addr` to remove server `id` (it hands its ranges on and exits).
pub fn remove_server(addr: &str, token: &JobToken, id: u32, timeout: Duration) -> Result<Membership, crate::PsError> {
    let mut c = crate::net::Conn::connect(addr, token, timeout)?;
    match c.call(&Req::Remove { server: id })? {
        Resp::Membership(m) => Ok(m),
        other => Err(crate::PsError::Protocol(format!("coordinator answered Remove with {other:?}"))),
    }
}

/// Asks the coordinator at `addr` to shut the job down (every server exits at its next heartbeat).
pub fn shutdown(addr: &str, token: &JobToken, timeout: Duration) -> Result<(), crate::PsError> {
    let mut c = crate::net::Conn::connect(addr, token, timeout)?;
    c.call(&Req::Shutdown)?;
    Ok(())
}

/// The coordinator's current membership (servers, and workers it considers dead).
pub fn membership(addr: &str, token: &JobToken, timeout: Duration) -> Result<Membership, crate::PsError> {
    let mut c = crate::net::Conn::connect(addr, token, timeout)?;
    match c.call(&Req::Membership { min_servers: 0, after_epoch: 0 })? {
        Resp::Membership(m) => Ok(m),
        other => Err(crate::PsError::Protocol(format!("coordinator answered Membership with {other:?}"))),
    }
}

/// Claims dead worker `worker`'s shard for worker `by`; true when granted (one claimant wins).
pub fn adopt(addr: &str, token: &JobToken, worker: u32, by: u32, timeout: Duration) -> Result<bool, crate::PsError> {
    let mut c = crate::net::Conn::connect(addr, token, timeout)?;
    match c.call(&Req::Adopt { worker, by })? {
        Resp::Ok { duplicate } => Ok(!duplicate),
        other => Err(crate::PsError::Protocol(format!("coordinator answered Adopt with {other:?}"))),
    }
}

/// Tells the coordinator that worker `worker` finished (its silence is not a death).
pub fn worker_done(addr: &str, token: &JobToken, worker: u32, timeout: Duration) -> Result<(), crate::PsError> {
    let mut c = crate::net::Conn::connect(addr, token, timeout)?;
    c.call(&Req::WorkerDone { worker })?;
    Ok(())
}
