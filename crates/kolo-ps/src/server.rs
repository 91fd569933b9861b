//! A parameter server (`kolo ps serve`): holds the key ranges the ring gives it, applies pushed
//! gradients with the job's optimizer, answers pulls as the consistency model allows, and
//! replicates every write down the range's chain before acknowledging it.
//!
//! Locking: one mutex per range; a write is applied and forwarded to the next chain member
//! while that mutex is held, so every member applies the same writes in the same order and ends
//! bit-identical. A reconfiguration (new membership epoch) visits each range under its mutex:
//! hands the range to new chain members, then stamps it with the new epoch. Requests carry the
//! sender's epoch and are refused (`WrongEpoch`) unless the range has the same one, so no write
//! lands on a server that is about to hand the range over.

use crate::coord::name_of;
use crate::net::{Conn, ConnState, Listener};
use crate::wire::{Keys, Membership, RangeState, Req, Resp, ServerStats};
use crate::{Consistency, JobSpec, PsError, Ring};
use kolo_optim::Optimizer;
use kolo_rendezvous::JobToken;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A range handed over to another server is stamped with this epoch: waiters on it give up.
const RETIRED: u64 = u64::MAX;
/// How long a request from a newer epoch waits for this server to catch up.
const CATCH_UP: Duration = Duration::from_secs(2);
/// Key lists remembered per connection before the cache is cleared.
const MAX_KEY_LISTS: usize = 4096;

pub struct ServerOptions {
    /// Address to listen on (port 0: any).
    pub listen: String,
    /// The coordinator's address.
    pub coordinator: String,
    pub token: JobToken,
    /// Deadline of every wait (pulls held back by the consistency model, ranges not yet
    /// received, peers and the coordinator).
    pub timeout: Duration,
    pub heartbeat: Duration,
    /// Fault injection for tests: refuse this many incoming range hand-overs. 0 in use.
    pub refuse_transfers: u32,
    /// Fault injection for tests: on a change from a membership it knew, wait this long
    /// between taking the new epoch and handing ranges on (a slow server; requests at the new
    /// epoch arrive meanwhile). Zero in use.
    pub reconfigure_delay: Duration,
}

struct RangeData {
    epoch: u64,
    values: Vec<f32>,
    opt: Optimizer,
    clocks: Vec<u64>,
    pending: Vec<Option<Vec<f32>>>,
    /// Sandblaster's named vectors (0 is `values`).
    vectors: BTreeMap<u32, Vec<f32>>,
    /// The number of the last vector operation applied (retries of it are not applied again).
    vec_seq: u64,
    /// When the first push of each recent step reached this range (the straggler measure:
    /// how long after it the others' pushes arrive).
    first_push: BTreeMap<u64, Instant>,
    /// By worker: the last step whose push was timed (a retry is not timed twice).
    timed: Vec<Option<u64>>,
}

type Slot = Arc<(Mutex<RangeData>, Condvar)>;

struct View {
    membership: Membership,
    ring: Ring,
}

struct Shared {
    id: AtomicU32,
    token: JobToken,
    timeout: Duration,
    job: Mutex<Option<JobSpec>>,
    ranges: Mutex<HashMap<u32, Slot>>,
    /// The last checkpoint restore applied to each range (a retried `Restore` is not applied
    /// twice: it would drop the pushes made since).
    restores: Mutex<HashMap<u32, u64>>,
    appeared: Condvar,
    view: Mutex<View>,
    epoch: AtomicU64,
    peers: Mutex<HashMap<u32, Arc<Mutex<Option<Conn>>>>>,
    stats: Mutex<ServerStats>,
    stop: AtomicBool,
    /// Ranges this server still holds only because handing them on failed, and the servers
    /// that must still receive them; retried every heartbeat, never dropped before.
    stranded: Mutex<BTreeMap<u32, Vec<u32>>>,
    /// Incoming hand-overs still to refuse (fault injection).
    refuse_transfers: AtomicU32,
    reconfigure_delay: Duration,
    /// Ranges handed on to another server (sent and acknowledged).
    hand_overs: AtomicU64,
    /// Ranges that came to this server in a membership change that removed every server of
    /// their previous chain: nobody can hand them over, and requests for them fail at once
    /// with this reason instead of waiting for the deadline.
    lost: Mutex<HashMap<u32, String>>,
    /// Ranges this server should hold but does not yet, and every server that could still hand
    /// each over (gathered over consecutive membership changes).
    awaited: Mutex<HashMap<u32, BTreeSet<u32>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub struct Server {
    listener: Listener,
    shared: Arc<Shared>,
    beat: Option<JoinHandle<Result<(), PsError>>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.listener.kill();
        if let Some(h) = self.beat.take() {
            let _ = h.join();
        }
    }
}

impl Server {
    /// Listens, registers with the coordinator and starts heartbeating.
    pub fn start(o: ServerOptions) -> Result<Server, PsError> {
        let shared = Arc::new(Shared {
            id: AtomicU32::new(u32::MAX),
            token: o.token.clone(),
            timeout: o.timeout,
            job: Mutex::new(None),
            ranges: Mutex::new(HashMap::new()),
            restores: Mutex::new(HashMap::new()),
            appeared: Condvar::new(),
            view: Mutex::new(View {
                membership: Membership {
                    epoch: 0,
                    servers: Vec::new(),
                    shutdown: false,
                    dead_workers: Vec::new(),
                    dead_servers: Vec::new(),
                },
                ring: Ring::new(&[]),
            }),
            epoch: AtomicU64::new(0),
            peers: Mutex::new(HashMap::new()),
            stats: Mutex::new(ServerStats::default()),
            stop: AtomicBool::new(false),
            stranded: Mutex::new(BTreeMap::new()),
            lost: Mutex::new(HashMap::new()),
            awaited: Mutex::new(HashMap::new()),
            refuse_transfers: AtomicU32::new(o.refuse_transfers),
            reconfigure_delay: o.reconfigure_delay,
            hand_overs: AtomicU64::new(0),
        });
        let handler = {
            let shared = shared.clone();
            Arc::new(move |cs: &mut ConnState, req: Req, bytes: usize| {
                lock(&shared.stats).bytes_in += bytes as u64;
                let r = handle(&shared, cs, req);
                if let Resp::Values { values, .. } = &r {
                    lock(&shared.stats).bytes_out += values.len() as u64 * 4;
                }
                r
            })
        };
        let listener = Listener::start(&o.listen, o.token.clone(), "ps-server", handler)
            .map_err(|e| PsError::Io(format!("listening on {}: {e}", o.listen)))?;
        let mut coord = Conn::connect(&o.coordinator, &o.token, o.timeout)?;
        let (id, m) = match coord.call(&Req::Register { addr: listener.addr.to_string() })? {
            Resp::Registered { id, membership } => (id, membership),
            other => return Err(PsError::Protocol(format!("coordinator answered Register with {other:?}"))),
        };
        shared.id.store(id, Ordering::SeqCst);
        reconfigure(&shared, m);
        let beat = {
            let shared = shared.clone();
            let (addr, hb) = (o.coordinator.clone(), o.heartbeat);
            std::thread::Builder::new()
                .name("kolo-ps-heartbeat".into())
                .spawn(move || heartbeat(&shared, coord, &addr, hb))
                .map_err(|e| PsError::Io(e.to_string()))?
        };
        Ok(Server { listener, shared, beat: Some(beat) })
    }

    pub fn id(&self) -> u32 {
        self.shared.id.load(Ordering::SeqCst)
    }

    pub fn addr(&self) -> SocketAddr {
        self.listener.addr
    }

    pub fn stats(&self) -> ServerStats {
        stats_now(&self.shared)
    }

    /// How many ranges this server has handed on to another (membership changes).
    pub fn hand_overs(&self) -> u64 {
        self.shared.hand_overs.load(Ordering::SeqCst)
    }

    /// Blocks until the coordinator shuts the job down or removes this server; returns why.
    pub fn wait(mut self) -> Result<(), PsError> {
        let r = self.beat.take().map_or(Ok(()), |h| h.join().unwrap_or_else(|_| Err(PsError::Server("heartbeat thread panicked".into()))));
        self.listener.kill();
        r
    }

    /// Stops at once, cutting every connection: to its peers this is a crash.
    pub fn kill(self) {
        drop(self);
    }
}

fn heartbeat(shared: &Arc<Shared>, mut coord: Conn, addr: &str, every: Duration) -> Result<(), PsError> {
    let me = shared.id.load(Ordering::SeqCst);
    let mut silent_since: Option<Instant> = None;
    // Reconfigurations (which wait for range locks and hand ranges over) run on their own
    // thread, in order, so that heartbeats continue meanwhile.
    let (tx, rx) = std::sync::mpsc::channel::<Membership>();
    let reconfigurer = {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("kolo-ps-reconfigure".into())
            .spawn(move || loop {
                match rx.recv_timeout(every) {
                    Ok(m) => reconfigure(&shared, m),
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => retry_stranded(&shared),
                    Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return,
                }
            })
            .map_err(|e| PsError::Io(e.to_string()))?
    };
    let mut seen = shared.epoch.load(Ordering::SeqCst);
    let r = beat_loop(shared, &mut coord, addr, every, me, &mut silent_since, &mut seen, &tx);
    drop(tx);
    let _ = reconfigurer.join();
    r
}

#[allow(clippy::too_many_arguments)]
fn beat_loop(
    shared: &Shared,
    coord: &mut Conn,
    addr: &str,
    every: Duration,
    me: u32,
    silent_since: &mut Option<Instant>,
    seen: &mut u64,
    tx: &std::sync::mpsc::Sender<Membership>,
) -> Result<(), PsError> {
    while !shared.stop.load(Ordering::SeqCst) {
        std::thread::sleep(every);
        match coord.call(&Req::Heartbeat { server: me }) {
            Ok(Resp::Membership(m)) => {
                *silent_since = None;
                if m.shutdown {
                    shared.stop.store(true, Ordering::SeqCst);
                    return Ok(());
                }
                let m = if m.epoch < *seen && !m.shutdown {
                    // The coordinator restarted: tell it what this server knows.
                    let known = lock(&shared.view).membership.clone();
                    match coord.call(&Req::Rejoin { server: me, known }) {
                        Ok(Resp::Membership(m)) => m,
                        Ok(other) => return Err(PsError::Protocol(format!("coordinator answered Rejoin with {other:?}"))),
                        Err(_) => continue,
                    }
                } else {
                    m
                };
                let listed = m.servers.iter().any(|(id, _)| *id == me);
                let declared_dead = m.dead_servers.contains(&me);
                if m.epoch < *seen {
                    continue; // still recovering: keep the last membership
                }
                if m.epoch > *seen {
                    *seen = m.epoch;
                    let _ = tx.send(m);
                }
                if !listed {
                    shared.stop.store(true, Ordering::SeqCst);
                    return Err(PsError::Server(if declared_dead {
                        format!(
                            "server {me} was declared dead after missing its heartbeats (stopped or cut off): the job went on without it, \
                             its ranges' replicas took over, and its own copies of those, stale now, were not handed on"
                        )
                    } else {
                        format!("server {me} was removed from the job; its ranges were handed on")
                    }));
                }
            }
            Ok(other) => return Err(PsError::Protocol(format!("coordinator answered a heartbeat with {other:?}"))),
            Err(e) => {
                let since = *silent_since.get_or_insert_with(Instant::now);
                if since.elapsed() > shared.timeout {
                    shared.stop.store(true, Ordering::SeqCst);
                    return Err(PsError::Timeout {
                        what: format!("server {me}: the coordinator at {addr}"),
                        secs: shared.timeout.as_secs_f64(),
                        detail: e.to_string(),
                    });
                }
                if let Ok(c) = Conn::connect(addr, &shared.token, Duration::from_secs(1)) {
                    *coord = c;
                }
            }
        }
    }
    Ok(())
}

/// Applies a new membership: every range this server is the first surviving holder of goes to
/// the chain members that did not hold it; ranges no longer on this server's chains are dropped.
fn reconfigure(shared: &Shared, m: Membership) {
    let me = shared.id.load(Ordering::SeqCst);
    let ids: Vec<u32> = m.servers.iter().map(|(id, _)| *id).collect();
    let new_ring = Ring::new(&ids);
    let (old_ring, epoch, next) = {
        let mut v = lock(&shared.view);
        if m.epoch <= v.membership.epoch && v.membership.epoch != 0 {
            return;
        }
        let next = m.epoch == v.membership.epoch + 1 && !v.membership.servers.is_empty();
        let old = std::mem::replace(&mut v.ring, new_ring.clone());
        v.membership = m.clone();
        (old, m.epoch, next)
    };
    shared.epoch.store(epoch, Ordering::SeqCst);
    if next && !shared.reconfigure_delay.is_zero() {
        std::thread::sleep(shared.reconfigure_delay);
    }
    let Some(job) = lock(&shared.job).clone() else { return };
    if m.dead_servers.contains(&me) {
        // Declared dead while alive (stopped, or cut off from the coordinator): where another
        // member of a range's chain survived, it handed the range on and the job went on
        // without this server, so the copy here is older than theirs: handing it on would
        // overwrite a newer replica (#34 item 4). It is retired. A range this server alone
        // held (no replica) went nowhere meanwhile (its new holder reports it lost): this copy
        // is the only one, and is handed on below as a live server's would be.
        retire_stale(shared, &job, &old_ring, &ids);
    }
    {
        // A range that belongs here but has not arrived waits for a hand-over from the servers
        // that held it: from its previous chain, gathered over consecutive changes (across
        // skipped epochs it may have moved through a server this one never heard of, so the
        // record starts over). When all of them are dead, nobody can send it: it is lost.
        let held = lock(&shared.ranges);
        let mut awaited = lock(&shared.awaited);
        let mut lost = lock(&shared.lost);
        if !next {
            awaited.clear();
        }
        let mut newly = Vec::new();
        awaited.retain(|r, _| !held.contains_key(r));
        for r in (0..job.ranges()).filter(|r| !held.contains_key(r) && new_ring.chain(*r, job.replication).contains(&me)) {
            let from = awaited.entry(r).or_default();
            if next {
                from.extend(old_ring.chain(r, job.replication).into_iter().filter(|s| *s != me));
            }
            // Gone means declared dead: a server removed on request is alive and hands its
            // ranges on (declaring them lost failed the requests that reached the new holder
            // before the hand-over did).
            let gone = |s: &u32| !ids.contains(s) && m.dead_servers.contains(s);
            if next && !from.is_empty() && from.iter().all(gone) && !lost.contains_key(&r) {
                let names: Vec<String> = from.iter().map(|s| s.to_string()).collect();
                let why = format!(
                    "range {r} lost: server(s) {} (its whole chain at replication {}) are gone; restart the job from a checkpoint, with more replication to survive this",
                    names.join(" and "),
                    job.replication
                );
                newly.push(r);
                lost.insert(r, why);
            }
        }
        if let Some(first) = newly.first() {
            let more = if newly.len() > 1 { format!(" (and {} more range(s) the same way)", newly.len() - 1) } else { String::new() };
            kolo_base::eline!("kolo ps server {me}: {}{more}", lost[first]);
        }
    }
    let slots: Vec<(u32, Slot)> = lock(&shared.ranges).iter().map(|(r, s)| (*r, s.clone())).collect();
    let mut dropped = Vec::new();
    for (r, slot) in slots {
        let mut d = lock(&slot.0);
        if d.epoch >= epoch && d.epoch != RETIRED {
            // Created (Init) or installed (hand-over, restore) at this epoch once the epoch was
            // taken above: placed by the new chains already. Handing it on as if the old ring
            // held it would send a Transfer to the head that may be forwarding this very range
            // here with its own copy locked, each waiting for the other until the timeouts (a
            // worker's init failed so, with 3 servers joining as the job started).
            continue;
        }
        let old_chain = old_ring.chain(r, job.replication);
        let new_chain = new_ring.chain(r, job.replication);
        let sender = old_chain.iter().copied().find(|s| ids.contains(s) || *s == me);
        // A range stranded here by an earlier failed hand-over goes to every member of its new
        // chain: this server may hold its only copy.
        let stranded = lock(&shared.stranded).remove(&r).is_some();
        let mut failed = Vec::new();
        if stranded || sender == Some(me) || (sender.is_none() && new_chain.contains(&me)) {
            for to in new_chain.iter().copied().filter(|s| *s != me && (stranded || !old_chain.contains(s))) {
                if let Err(e) = hand_over(shared, &job, epoch, r, &d, to) {
                    kolo_base::eline!("kolo ps server {me}: handing range {r} to server {to} failed: {e}; keeping it and retrying");
                    failed.push(to);
                }
            }
        }
        if new_chain.contains(&me) {
            d.epoch = epoch;
        } else {
            d.epoch = RETIRED;
            if failed.is_empty() {
                dropped.push(r);
            }
        }
        if !failed.is_empty() {
            lock(&shared.stranded).insert(r, failed);
        }
        slot.1.notify_all();
    }
    let mut map = lock(&shared.ranges);
    for r in dropped {
        map.remove(&r);
    }
}

/// Retires the ranges this server holds whose previous chain (`old`) has a member among the
/// servers `alive` other than this one, handing none on: waiters give up, requests are refused
/// with `WrongEpoch`.
fn retire_stale(shared: &Shared, job: &JobSpec, old: &Ring, alive: &[u32]) {
    let me = shared.id.load(Ordering::SeqCst);
    let stale: Vec<(u32, Slot)> = {
        let mut map = lock(&shared.ranges);
        let rs: Vec<u32> =
            map.keys().copied().filter(|r| old.chain(*r, job.replication).iter().any(|s| *s != me && alive.contains(s))).collect();
        rs.into_iter().map(|r| (r, map.remove(&r).expect("listed"))).collect()
    };
    for (r, slot) in &stale {
        lock(&slot.0).epoch = RETIRED;
        slot.1.notify_all();
        lock(&shared.stranded).remove(r);
    }
    if !stale.is_empty() {
        kolo_base::eline!(
            "kolo ps server {me}: declared dead; {} range(s) its replicas took over retired here, not handed on (stale)",
            stale.len()
        );
    }
}

/// Sends range `r`'s whole state (`d`) to server `to` as a `Transfer` at `epoch`.
fn hand_over(shared: &Shared, job: &JobSpec, epoch: u64, r: u32, d: &RangeData, to: u32) -> Result<(), PsError> {
    let state = RangeState {
        values: d.values.clone(),
        opt_steps: d.opt.steps(),
        opt_state: d.opt.state().into_iter().map(|(_, v)| v.to_vec()).collect(),
        clocks: d.clocks.clone(),
        pending: d.pending.clone(),
        vectors: d.vectors.iter().map(|(id, v)| (*id, v.clone())).collect(),
        vec_seq: d.vec_seq,
    };
    forward(shared, to, &Req::Transfer { job: job.clone(), epoch, range: r, state })?;
    shared.hand_overs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

/// Retries the hand-overs that failed (ranges kept here meanwhile, not served): to the
/// targets still on the range's chain, at the current epoch. A range handed to every target
/// is dropped here if this server is not on its chain.
fn retry_stranded(shared: &Shared) {
    let pending = std::mem::take(&mut *lock(&shared.stranded));
    if pending.is_empty() {
        return;
    }
    let Some(job) = lock(&shared.job).clone() else { return };
    let me = shared.id.load(Ordering::SeqCst);
    let (ring, epoch) = (lock(&shared.view).ring.clone(), shared.epoch.load(Ordering::SeqCst));
    for (r, targets) in pending {
        let Some(slot) = lock(&shared.ranges).get(&r).cloned() else { continue };
        let chain = ring.chain(r, job.replication);
        let d = lock(&slot.0);
        let left: Vec<u32> =
            targets.into_iter().filter(|to| chain.contains(to) && hand_over(shared, &job, epoch, r, &d, *to).is_err()).collect();
        drop(d);
        if !left.is_empty() {
            lock(&shared.stranded).insert(r, left);
        } else if !chain.contains(&me) {
            lock(&shared.ranges).remove(&r);
            kolo_base::eline!("kolo ps server {me}: range {r} handed on after a retry");
        }
    }
}

/// Sends `req` to server `to` and waits for its acknowledgement.
fn forward(shared: &Shared, to: u32, req: &Req) -> Result<(), PsError> {
    let addr = lock(&shared.view)
        .membership
        .servers
        .iter()
        .find(|(id, _)| *id == to)
        .map(|(_, a)| a.clone())
        .ok_or_else(|| PsError::Server(format!("server {to} is not a member")))?;
    let cell = lock(&shared.peers).entry(to).or_default().clone();
    let mut conn = lock(&cell);
    for attempt in 0..2 {
        if conn.is_none() {
            // A chain member that refuses connections is down: fail now, and let the
            // coordinator's new membership route around it.
            *conn = Some(Conn::connect_once(&addr, &shared.token, shared.timeout)?);
        }
        let c = conn.as_mut().expect("connected");
        match c.call(req) {
            Ok(Resp::Ok { .. }) => return Ok(()),
            Ok(other) => return Err(PsError::Server(format!("server {to} answered {} with {other:?}", name_of(req)))),
            Err(e) => {
                *conn = None;
                if attempt == 1 {
                    return Err(e);
                }
            }
        }
    }
    unreachable!()
}

fn err(e: impl Into<String>) -> Resp {
    Resp::Error(e.into())
}

/// The next member after this server on `range`'s chain, if any.
fn successor(shared: &Shared, job: &JobSpec, range: u32) -> Option<u32> {
    let me = shared.id.load(Ordering::SeqCst);
    let chain = lock(&shared.view).ring.chain(range, job.replication);
    let at = chain.iter().position(|s| *s == me)?;
    chain.get(at + 1).copied()
}

/// Waits (up to the deadline) for `range` to arrive on this server: only while the range
/// belongs here in the current membership and the request is not from an older epoch (a range
/// handed on never comes back; the sender must ask the coordinator).
fn wait_range(shared: &Shared, range: u32, epoch: u64) -> Result<Slot, Resp> {
    let deadline = Instant::now() + shared.timeout;
    let me = shared.id.load(Ordering::SeqCst);
    let mut map = lock(&shared.ranges);
    loop {
        if let Some(s) = map.get(&range) {
            return Ok(s.clone());
        }
        if let Some(why) = lock(&shared.lost).get(&range) {
            return Err(err(format!("server {me}: {why}")));
        }
        let current = shared.epoch.load(Ordering::SeqCst);
        if epoch < current {
            return Err(Resp::WrongEpoch { current });
        }
        if epoch == current {
            if let Some(job) = lock(&shared.job).as_ref() {
                if !lock(&shared.view).ring.chain(range, job.replication).contains(&me) {
                    return Err(Resp::WrongEpoch { current });
                }
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || shared.stop.load(Ordering::SeqCst) {
            return Err(err(format!(
                "server {me}: range {range} never arrived (no Init or hand-over within {:.1} s)",
                shared.timeout.as_secs_f64()
            )));
        }
        map = shared.appeared.wait_timeout(map, left.min(Duration::from_millis(50))).unwrap_or_else(|p| p.into_inner()).0;
    }
}

fn resolve_keys(cs: &mut ConnState, shared: &Shared, keys: Keys) -> Result<Option<Arc<Vec<u32>>>, Resp> {
    match keys {
        Keys::All => Ok(None),
        Keys::List { id, keys } => {
            if cs.key_lists.len() >= MAX_KEY_LISTS {
                cs.key_lists.clear();
            }
            let k = Arc::new(keys);
            cs.key_lists.insert(id, k.clone());
            lock(&shared.stats).cached_key_lists = cs.key_lists.len() as u64;
            Ok(Some(k))
        }
        Keys::Cached { id } => match cs.key_lists.get(&id) {
            Some(k) => {
                lock(&shared.stats).key_bytes_saved += k.len() as u64 * 4;
                Ok(Some(k.clone()))
            }
            None => Err(Resp::UnknownKeys),
        },
    }
}

fn check_keys(keys: &Option<Arc<Vec<u32>>>, n: usize, values: Option<usize>) -> Result<(), String> {
    if let Some(k) = keys {
        if let Some(bad) = k.iter().find(|&&i| i as usize >= n) {
            return Err(format!("key offset {bad} is outside the range's {n} values"));
        }
        if k.windows(2).any(|w| w[0] >= w[1]) {
            return Err("key offsets must be sorted and distinct".into());
        }
    }
    if let Some(v) = values {
        let want = keys.as_ref().map_or(n, |k| k.len());
        if v != want {
            return Err(format!("{v} values for {want} keys"));
        }
    }
    Ok(())
}

/// Waits (briefly) until this range is at the request's epoch: a request from a sender that
/// already knows a newer membership waits for this server's heartbeat to bring it, and for
/// the reconfiguration to reach the range. Refuses requests from an older epoch.
fn settle<'a>(shared: &Shared, slot: &'a Slot, mut d: MutexGuard<'a, RangeData>, epoch: u64) -> Result<MutexGuard<'a, RangeData>, Resp> {
    let deadline = Instant::now() + CATCH_UP;
    loop {
        let current = shared.epoch.load(Ordering::SeqCst);
        if d.epoch == epoch && current == epoch {
            return Ok(d);
        }
        if d.epoch == RETIRED || d.epoch > epoch || current > epoch || Instant::now() > deadline {
            return Err(Resp::WrongEpoch { current });
        }
        d = slot.1.wait_timeout(d, Duration::from_millis(20)).unwrap_or_else(|p| p.into_inner()).0;
    }
}

fn job_of(shared: &Shared) -> Result<JobSpec, Resp> {
    lock(&shared.job).clone().ok_or_else(|| err("no job yet: a worker must Init the ranges first"))
}

fn set_job(shared: &Shared, job: &JobSpec) -> Result<(), Resp> {
    let mut j = lock(&shared.job);
    match &*j {
        None => {
            *j = Some(job.clone());
            Ok(())
        }
        Some(have) if have == job => Ok(()),
        Some(have) => Err(err(format!("job mismatch: this server serves {have:?}, the request is for {job:?}"))),
    }
}

fn handle(shared: &Shared, cs: &mut ConnState, req: Req) -> Resp {
    match handle_inner(shared, cs, req) {
        Ok(r) | Err(r) => r,
    }
}

fn handle_inner(shared: &Shared, cs: &mut ConnState, req: Req) -> Result<Resp, Resp> {
    let me = shared.id.load(Ordering::SeqCst);
    match req {
        Req::Stats => Ok(Resp::Stats(Box::new(stats_now(shared)))),
        Req::Init { job, epoch, range, values, fwd } => {
            set_job(shared, &job)?;
            if range >= job.ranges() || values.len() != job.span(range).len() {
                return Err(err(format!(
                    "Init of range {range} with {} values does not fit the job ({} ranges of {})",
                    values.len(),
                    job.ranges(),
                    job.chunk
                )));
            }
            if let Some(current) = catch_up(shared, epoch) {
                return Ok(Resp::WrongEpoch { current });
            }
            let existing = lock(&shared.ranges).get(&range).cloned();
            let slot = match existing {
                Some(s) => s,
                None => {
                    let n = values.len();
                    let d = RangeData {
                        epoch,
                        values: values.clone(),
                        opt: Optimizer::new(job.optimizer.clone(), n),
                        clocks: vec![0; job.workers as usize],
                        pending: vec![None; job.workers as usize],
                        vectors: BTreeMap::new(),
                        vec_seq: 0,
                        first_push: BTreeMap::new(),
                        timed: vec![None; job.workers as usize],
                    };
                    let s: Slot = Arc::new((Mutex::new(d), Condvar::new()));
                    lock(&shared.ranges).entry(range).or_insert(s).clone()
                }
            };
            lock(&shared.lost).remove(&range); // initialised again: no longer lost
            shared.appeared.notify_all();
            let _d = lock(&slot.0);
            if let Some(next) = successor(shared, &job, range) {
                forward(shared, next, &Req::Init { job, epoch, range, values, fwd: true })
                    .map_err(|e| err(format!("server {me}: replicating Init of range {range}: {e}")))?;
            }
            let _ = fwd;
            Ok(Resp::Ok { duplicate: false })
        }
        Req::Transfer { job, epoch, range, state } => {
            if shared.refuse_transfers.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
                return Err(err(format!("refusing the hand-over of range {range} (fault injection)")));
            }
            if let Some(why) = stale_hand_over(shared, epoch, range, &state) {
                return Err(err(format!("server {me}: {why}")));
            }
            install(shared, &job, epoch, range, state, "hand-over")?;
            Ok(Resp::Ok { duplicate: false })
        }
        Req::Restore { job, epoch, range, state, id } => {
            // The chain is the one of the request's epoch (a server that has not caught up
            // would leave the replicas out).
            if let Some(current) = catch_up(shared, epoch) {
                return Ok(Resp::WrongEpoch { current });
            }
            if lock(&shared.restores).get(&range) == Some(&id) {
                return Ok(Resp::Ok { duplicate: true });
            }
            // Down the chain first, as pushes: no pull reads a state the replicas lack.
            if let Some(next) = successor(shared, &job, range) {
                forward(shared, next, &Req::Restore { job: job.clone(), epoch, range, state: state.clone(), id })
                    .map_err(|e| err(format!("server {me}: replicating the restore of range {range}: {e}")))?;
            }
            install(shared, &job, epoch, range, state, "restore")?;
            lock(&shared.restores).insert(range, id);
            Ok(Resp::Ok { duplicate: false })
        }
        Req::Snapshot { epoch, range, clock } => {
            let slot = wait_range(shared, range, epoch)?;
            let job = job_of(shared)?;
            let d = settle(shared, &slot, lock(&slot.0), epoch)?;
            let late = |need: u64, d: &RangeData| {
                format!(
                    "snapshot of range {range} for step {clock}: step {need} of every worker did not arrive; behind: {}",
                    behind(job.consistency, &d.clocks, &d.pending, need).join(", ")
                )
            };
            let Some(d) = wait_for_step(shared, &slot, d, &job, epoch, clock, &late)? else {
                return Ok(Resp::WrongEpoch { current: shared.epoch.load(Ordering::SeqCst) });
            };
            let names = job.optimizer.state_names();
            let opt = d.opt.state();
            let opt_state = names.iter().map(|n| opt.iter().find(|(m, _)| m == n).map_or_else(Vec::new, |(_, v)| v.to_vec())).collect();
            // BSP: gradients already pushed for later steps are not part of the state at
            // `clock`. Otherwise every worker's own clock (nobody waits for a step).
            let bsp = job.consistency == Consistency::Bsp;
            Ok(Resp::State(Box::new(RangeState {
                values: d.values.clone(),
                opt_steps: d.opt.steps(),
                opt_state,
                clocks: d.clocks.iter().map(|c| if bsp { (*c).min(clock) } else { *c }).collect(),
                pending: vec![None; d.clocks.len()],
                vectors: d.vectors.iter().map(|(id, v)| (*id, v.clone())).collect(),
                vec_seq: d.vec_seq,
            })))
        }
        Req::Push { epoch, range, worker, clock, lr, keys, values, fwd } => {
            let slot = wait_range(shared, range, epoch)?;
            let job = job_of(shared)?;
            let keys = resolve_keys(cs, shared, keys)?;
            let mut d = settle(shared, &slot, lock(&slot.0), epoch)?;
            if worker >= job.workers {
                return Err(err(format!("push from worker {worker}, but the job has {} workers", job.workers)));
            }
            check_keys(&keys, d.values.len(), Some(values.len())).map_err(|e| err(format!("push to range {range}: {e}")))?;
            let w = worker as usize;
            let duplicate = clock < d.clocks[w] || (job.consistency == Consistency::Bsp && clock == d.clocks[w] && d.pending[w].is_some());
            if !duplicate && job.consistency == Consistency::Bsp && clock > d.clocks[w] {
                return Err(err(format!(
                    "worker {worker} pushed step {clock} to range {range}, which expects its step {} (BSP: one push per step, in order)",
                    d.clocks[w]
                )));
            }
            // Replicate first, apply after: a write becomes visible here (pulls read the head)
            // only once the rest of the chain holds it, so no pull observes a write that is
            // not acknowledged (#19). A failed forward leaves this server unchanged; the
            // worker's retry is applied here then, and dropped as a duplicate downstream.
            if let Some(next) = successor(shared, &job, range) {
                let keys = match &keys {
                    None => Keys::All,
                    Some(k) => Keys::List { id: 0, keys: k.to_vec() },
                };
                let req = Req::Push { epoch, range, worker, clock, lr, keys, values: values.clone(), fwd: true };
                forward(shared, next, &req)
                    .map_err(|e| err(format!("server {me}: replicating worker {worker}'s step {clock} of range {range}: {e}")))?;
            }
            if !fwd {
                // Stale pushes too: with backup workers the late worker's push of a step that
                // went on without it is dropped, and it is the straggler.
                note_arrival(shared, &mut d, w, clock);
            }
            if !duplicate {
                let dense = match &keys {
                    None => values.clone(),
                    Some(k) => {
                        let mut g = vec![0f32; d.values.len()];
                        for (i, v) in k.iter().zip(&values) {
                            g[*i as usize] = *v;
                        }
                        g
                    }
                };
                let skipped = apply(&mut d, &job, w, clock, lr, dense);
                lock(&shared.stats).skipped += skipped;
            }
            slot.1.notify_all();
            let mut s = lock(&shared.stats);
            s.pushes += 1;
            s.duplicates += duplicate as u64;
            Ok(Resp::Ok { duplicate })
        }
        Req::Pull { epoch, range, worker, clock, keys } => {
            let slot = wait_range(shared, range, epoch)?;
            let job = job_of(shared)?;
            let keys = resolve_keys(cs, shared, keys)?;
            let d = settle(shared, &slot, lock(&slot.0), epoch)?;
            let late = |need: u64, d: &RangeData| {
                format!(
                    "worker {worker}'s pull of range {range} for step {clock} waited {:.1} s for step {need} of every worker ({:?}); behind: {}",
                    shared.timeout.as_secs_f64(),
                    job.consistency,
                    behind(job.consistency, &d.clocks, &d.pending, need).join(", ")
                )
            };
            let Some(d) = wait_for_step(shared, &slot, d, &job, epoch, clock, &late)? else {
                return Ok(Resp::WrongEpoch { current: shared.epoch.load(Ordering::SeqCst) });
            };
            check_keys(&keys, d.values.len(), None).map_err(|e| err(format!("pull of range {range}: {e}")))?;
            let min = d.clocks.iter().copied().min().unwrap_or(0);
            let values = match &keys {
                None => d.values.clone(),
                Some(k) => k.iter().map(|i| d.values[*i as usize]).collect(),
            };
            let mut s = lock(&shared.stats);
            s.pulls += 1;
            s.max_lead = s.max_lead.max(clock.saturating_sub(min));
            Ok(Resp::Values { min_clock: min, values })
        }
        Req::Vector { epoch, range, id, values } => {
            let slot = wait_range(shared, range, epoch)?;
            let job = job_of(shared)?;
            let mut d = settle(shared, &slot, lock(&slot.0), epoch)?;
            match values {
                None => Ok(Resp::Values { min_clock: 0, values: vector(&d, id).to_vec() }),
                Some(v) => {
                    if v.len() != d.values.len() {
                        return Err(err(format!("vector {id} of range {range}: {} values for {}", v.len(), d.values.len())));
                    }
                    if id == 0 {
                        d.values.copy_from_slice(&v);
                    } else {
                        d.vectors.insert(id, v.clone());
                    }
                    if let Some(next) = successor(shared, &job, range) {
                        forward(shared, next, &Req::Vector { epoch, range, id, values: Some(v) }).map_err(|e| err(e.to_string()))?;
                    }
                    Ok(Resp::Ok { duplicate: false })
                }
            }
        }
        Req::Axpby { epoch, range, seq, dst, a, src, b } => {
            let slot = wait_range(shared, range, epoch)?;
            let job = job_of(shared)?;
            let mut d = settle(shared, &slot, lock(&slot.0), epoch)?;
            // Replicated first (as a push); a number already applied is a retry.
            if let Some(next) = successor(shared, &job, range) {
                forward(shared, next, &Req::Axpby { epoch, range, seq, dst, a, src, b }).map_err(|e| err(e.to_string()))?;
            }
            let duplicate = seq <= d.vec_seq;
            if !duplicate {
                let s = vector(&d, src).to_vec();
                let out = if dst == 0 { &mut d.values } else { d.vectors.entry(dst).or_insert_with(|| vec![0f32; s.len()]) };
                for (o, x) in out.iter_mut().zip(&s) {
                    *o = (a * f64::from(*o) + b * f64::from(*x)) as f32;
                }
                d.vec_seq = seq;
            }
            Ok(Resp::Ok { duplicate })
        }
        Req::Dot { epoch, range, x, y } => {
            let slot = wait_range(shared, range, epoch)?;
            let d = settle(shared, &slot, lock(&slot.0), epoch)?;
            Ok(Resp::Scalar(vector(&d, x).iter().zip(vector(&d, y)).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()))
        }
        other => Err(err(format!("a parameter server does not serve {}", name_of(&other)))),
    }
}

/// Vector `id` of a range (0: the parameters); a vector never written reads as zeros.
fn vector(d: &RangeData, id: u32) -> &[f32] {
    static EMPTY: [f32; 0] = [];
    if id == 0 {
        &d.values
    } else {
        d.vectors.get(&id).map_or(&EMPTY[..], |v| &v[..])
    }
}

/// The counters, with the ranges held and how long each worker has been behind right now.
fn stats_now(shared: &Shared) -> ServerStats {
    let mut s = lock(&shared.stats).clone();
    let slots: Vec<Slot> = lock(&shared.ranges).values().cloned().collect();
    s.ranges = slots.len() as u64;
    let now = Instant::now();
    for slot in slots {
        let d = lock(&slot.0);
        s.worker_behind_ms.resize(s.worker_behind_ms.len().max(d.clocks.len()), 0.0);
        // Another worker pushed the step this one has yet to push: behind since then.
        for w in 0..d.clocks.len() {
            // The first step it has not pushed here (with backup workers its clock moves on
            // without its pushes; BSP holds a pushed gradient in `pending` until the step is
            // complete: neither clock says it).
            let next = d.timed.get(w).copied().flatten().map_or(0, |t| t + 1);
            if let Some(first) = d.first_push.get(&next) {
                let ms = now.duration_since(*first).as_secs_f64() * 1e3;
                s.worker_behind_ms[w] = s.worker_behind_ms[w].max(ms);
            }
        }
    }
    s
}

/// Steps whose first push a range remembers (the latest ones): a late push of a step that BSP
/// with backup workers completed without it, while the others ran on, still finds its step.
const REMEMBERED_STEPS: usize = 256;

/// Worker `w`'s push of step `clock` reached this range (at its chain's head): adds how long
/// after the step's first push it came to the worker's lag (the straggler measure in
/// [`ServerStats`]), once per worker and step (a retry is not timed again). The first pushes
/// of the latest [`REMEMBERED_STEPS`] steps are kept.
fn note_arrival(shared: &Shared, d: &mut RangeData, w: usize, clock: u64) {
    if d.timed.len() < d.clocks.len() {
        d.timed.resize(d.clocks.len(), None);
    }
    if d.timed[w].is_some_and(|t| t >= clock) {
        return;
    }
    d.timed[w] = Some(clock);
    let now = Instant::now();
    let first = *d.first_push.entry(clock).or_insert(now);
    let lag = now.duration_since(first).as_secs_f64() * 1e3;
    let mut s = lock(&shared.stats);
    if s.worker_lag_ms.len() < d.clocks.len() {
        s.worker_lag_ms.resize(d.clocks.len(), 0.0);
        s.worker_pushes.resize(d.clocks.len(), 0);
    }
    s.worker_lag_ms[w] += lag;
    s.worker_pushes[w] += 1;
    drop(s);
    while d.first_push.len() > REMEMBERED_STEPS {
        d.first_push.pop_first();
    }
}

/// Applies worker `w`'s gradient for `clock`. BSP keeps it until every worker's is in (all but
/// `backup` of them with backup workers), then applies their mean (summed in worker order, so
/// every chain member computes the same bits) and moves every worker's clock on: a late push of
/// that step is then recognised as stale and dropped. The other models apply it at once.
/// Returns how many workers' gradients the step went without.
/// The workers a wait for step `need` is waiting on, for its error. Under BSP every worker's
/// clock is the last step applied, so the ones named are those whose push of the step being
/// assembled has not arrived (the others' are held in `pending`); otherwise those whose clock
/// is below `need`.
fn behind(consistency: Consistency, clocks: &[u64], pending: &[Option<Vec<f32>>], need: u64) -> Vec<String> {
    let held = |w: usize| consistency == Consistency::Bsp && pending.get(w).is_some_and(Option::is_some);
    clocks
        .iter()
        .enumerate()
        .filter(|&(w, c)| *c < need && !held(w))
        .map(|(w, c)| match consistency {
            Consistency::Bsp => format!("worker {w} (its push of step {c} has not arrived)"),
            _ => format!("worker {w} at step {c}"),
        })
        .collect()
}

fn apply(d: &mut RangeData, job: &JobSpec, w: usize, clock: u64, lr: f32, grad: Vec<f32>) -> u64 {
    let RangeData { values, opt, clocks, pending, .. } = d;
    match job.consistency {
        Consistency::Bsp => {
            pending[w] = Some(grad);
            let have = pending.iter().filter(|p| p.is_some()).count();
            if have >= (job.workers - job.backup) as usize {
                let mut it = pending.iter_mut().filter_map(|p| p.take());
                let mut sum = it.next().expect("at least one gradient");
                for g in it {
                    sum.iter_mut().zip(&g).for_each(|(s, x)| *s += x);
                }
                if have > 1 {
                    let n = have as f32;
                    sum.iter_mut().for_each(|s| *s /= n);
                }
                opt.step(values, &sum, lr);
                let next = clocks.iter().copied().max().unwrap_or(0).max(clock) + 1;
                clocks.iter_mut().for_each(|c| *c = next);
                return (job.workers as usize - have) as u64;
            }
            0
        }
        Consistency::Bounded(_) | Consistency::Async => {
            opt.step(values, &grad, lr);
            clocks[w] = clock + 1;
            0
        }
    }
}

/// Why a hand-over of `range` at `epoch` must not replace the copy held here, if it must not:
/// this copy is at the same epoch and ahead of it for some worker (a later step, or the same
/// step with the push held), or in its vector operations. Only one server hands a range on per
/// epoch, so such a hand-over comes from a server whose copy went stale meanwhile.
fn stale_hand_over(shared: &Shared, epoch: u64, range: u32, state: &RangeState) -> Option<String> {
    let slot = lock(&shared.ranges).get(&range).cloned()?;
    let d = lock(&slot.0);
    if d.epoch != epoch || state.clocks.len() != d.clocks.len() {
        return None;
    }
    let held = |p: Option<&Option<Vec<f32>>>| p.is_some_and(|p| p.is_some());
    let behind = (0..d.clocks.len()).find(|&w| (state.clocks[w], held(state.pending.get(w))) < (d.clocks[w], held(d.pending.get(w))));
    if behind.is_none() && state.vec_seq >= d.vec_seq {
        return None;
    }
    Some(format!(
        "refusing a stale hand-over of range {range} at epoch {epoch}: it is at steps {:?} (vector operation {}), the copy here at {:?} ({})",
        state.clocks, state.vec_seq, d.clocks, d.vec_seq
    ))
}

/// Puts `state` in place of range `range` (a hand-over or a checkpoint's restore), retiring the
/// old copy so that requests waiting on it look again.
fn install(shared: &Shared, job: &JobSpec, epoch: u64, range: u32, state: RangeState, what: &str) -> Result<(), Resp> {
    set_job(shared, job)?;
    let n = job.span(range).len();
    if range >= job.ranges()
        || state.values.len() != n
        || state.clocks.len() != job.workers as usize
        || state.vectors.iter().any(|(_, v)| v.len() != n)
    {
        return Err(err(format!("{what} of range {range} does not fit the job")));
    }
    let mut opt = Optimizer::new(job.optimizer.clone(), n);
    let names = job.optimizer.state_names();
    let bufs: Vec<(&str, Vec<f32>)> = names.iter().copied().zip(state.opt_state).collect();
    opt.load_state(state.opt_steps, &bufs).map_err(|e| err(format!("{what} of range {range}: {e}")))?;
    let mut pending = state.pending;
    pending.resize(job.workers as usize, None);
    let vectors = state.vectors.into_iter().collect();
    // A restored or handed-over range: each worker has pushed the steps before its clock.
    let timed = state.clocks.iter().map(|c| c.checked_sub(1)).collect();
    let d = RangeData {
        epoch,
        values: state.values,
        opt,
        clocks: state.clocks,
        pending,
        vectors,
        vec_seq: state.vec_seq,
        first_push: BTreeMap::new(),
        timed,
    };
    let old = lock(&shared.ranges).insert(range, Arc::new((Mutex::new(d), Condvar::new())));
    if let Some(old) = old {
        lock(&old.0).epoch = RETIRED;
        old.1.notify_all();
    }
    shared.appeared.notify_all();
    Ok(())
}

/// Waits until every worker's clock on the range reaches what a pull for step `clock` needs
/// under the job's consistency model (the servers' deadline at most; `late` says what was
/// missing). `None`: the range moved to another epoch meanwhile.
fn wait_for_step<'a>(
    shared: &Shared,
    slot: &'a Slot,
    mut d: std::sync::MutexGuard<'a, RangeData>,
    job: &JobSpec,
    epoch: u64,
    clock: u64,
    late: &dyn Fn(u64, &RangeData) -> String,
) -> Result<Option<std::sync::MutexGuard<'a, RangeData>>, Resp> {
    let deadline = Instant::now() + shared.timeout;
    loop {
        if d.epoch != epoch {
            return Ok(None);
        }
        let min = d.clocks.iter().copied().min().unwrap_or(0);
        match job.consistency.needs(clock) {
            Some(need) if min < need => {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.stop.load(Ordering::SeqCst) {
                    return Err(err(late(need, &d)));
                }
                d = slot.1.wait_timeout(d, left.min(Duration::from_millis(200))).unwrap_or_else(|p| p.into_inner()).0;
            }
            _ => return Ok(Some(d)),
        }
    }
}

/// Waits (a moment at most) until this server has caught up to membership `epoch`, so that
/// the chain it forwards along is that epoch's. `Some(current)`: it is at another epoch.
fn catch_up(shared: &Shared, epoch: u64) -> Option<u64> {
    let deadline = Instant::now() + CATCH_UP;
    while shared.epoch.load(Ordering::SeqCst) < epoch && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let current = shared.epoch.load(Ordering::SeqCst);
    (current != epoch).then_some(current)
}

#[cfg(test)]
mod wait_tests {
    use super::behind;
    use crate::Consistency;

    /// Under BSP every clock is the last step applied: the workers named are those whose push of
    /// the step being assembled is missing, not every worker at that clock.
    #[test]
    fn a_late_wait_names_the_workers_whose_push_is_missing() {
        let pending = vec![Some(vec![0.5]), Some(vec![0.25]), None];
        assert_eq!(behind(Consistency::Bsp, &[9, 9, 9], &pending, 10), vec!["worker 2 (its push of step 9 has not arrived)"]);
        assert!(behind(Consistency::Bsp, &[10, 10, 10], &[None, None, None], 10).is_empty());
        // Bounded delay and async: whoever's clock is behind.
        assert_eq!(behind(Consistency::Bounded(2), &[7, 5, 6], &[None, None, None], 7), vec!["worker 1 at step 5", "worker 2 at step 6"]);
    }
}
