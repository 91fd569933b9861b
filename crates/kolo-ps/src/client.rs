//! A worker's connection to the parameter servers: range push and pull over the whole table.
//!
//! Every request for a range goes to the head of its chain in the client's view of the
//! membership. Requests to one server are pipelined (all sent, then all answers read). A
//! refused request (`WrongEpoch`), a lost connection or a dead server sends the client to the
//! coordinator for a newer membership and the request is retried there; servers drop
//! duplicates by the range's vector clock, so a retried push is applied once.

use crate::filter::Filter;
use crate::net::Conn;
use crate::wire::{Keys, Membership, RangeState, Req, Resp, ServerStats};
use crate::{mix, Consistency, JobSpec, PsError, Ring};
use kolo_rendezvous::JobToken;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub struct ClientOptions {
    pub coordinator: String,
    pub token: JobToken,
    pub job: JobSpec,
    /// This worker's id (its data shard), `0..job.workers`.
    pub worker: u32,
    /// Servers to wait for before the first request.
    pub min_servers: u32,
    /// Deadline of every request, retries included.
    pub timeout: Duration,
    /// Heartbeat to the coordinator every this often (None: no heartbeat).
    pub heartbeat: Option<Duration>,
}

/// What this worker sent and received.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PushStats {
    /// Gradient values the pushes covered, and those actually sent (after filters).
    pub values_total: u64,
    pub values_sent: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Requests sent again after a refusal or failure (failover, epoch changes).
    pub retries: u64,
    /// Largest `clock - slowest worker's clock` a pull was answered with.
    pub max_lead: u64,
}

/// The worker id of an observer client.
pub const OBSERVER: u32 = u32::MAX;

struct ServerConn {
    conn: Conn,
    sent_lists: HashSet<u64>,
}

/// The whole table's state at one step ([`PsClient::snapshot`]).
pub struct Snapshot {
    pub values: Vec<f32>,
    /// Optimizer steps taken.
    pub opt_steps: u64,
    /// The optimizer's state vectors, in `JobSpec::optimizer`'s state order.
    pub opt_state: Vec<Vec<f32>>,
    /// By worker: the steps (pushes) it had applied everywhere (the fewest over the ranges).
    /// Under BSP every worker's is the snapshot's step.
    pub clocks: Vec<u64>,
}

pub struct PsClient {
    o: ClientOptions,
    coord: Conn,
    membership: Membership,
    ring: Ring,
    conns: HashMap<u32, ServerConn>,
    stats: PushStats,
    /// The number of the last vector operation this client issued.
    vec_seq: u64,
    beat: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
}

/// What one push carries for one range.
struct Item {
    range: u32,
    keys: Option<(u64, Arc<Vec<u32>>)>,
    values: Vec<f32>,
}

fn key_list_id(keys: &[u32]) -> u64 {
    keys.iter().fold(mix(keys.len() as u64), |h, k| mix(h ^ u64::from(*k)))
}

impl PsClient {
    /// A read-only client for another worker group (evaluation, monitoring): pulls never wait
    /// for any clock, and the servers refuse its pushes (it is no worker of the job).
    pub fn observer(mut o: ClientOptions) -> Result<PsClient, PsError> {
        o.worker = OBSERVER;
        o.heartbeat = None;
        PsClient::connect(o)
    }

    pub fn connect(o: ClientOptions) -> Result<PsClient, PsError> {
        o.job.validate()?;
        if o.worker >= o.job.workers && o.worker != OBSERVER {
            return Err(PsError::Config(format!("worker {} of a job with {} workers", o.worker, o.job.workers)));
        }
        let mut coord = Conn::connect(&o.coordinator, &o.token, o.timeout)?;
        let deadline = Instant::now() + o.timeout;
        let membership = loop {
            match coord.call(&Req::Membership { min_servers: o.min_servers, after_epoch: 0 })? {
                Resp::Membership(m) if m.servers.len() >= o.min_servers.max(1) as usize => break m,
                Resp::Membership(m) if m.shutdown => return Err(PsError::Server("the job is shutting down".into())),
                Resp::Membership(m) => {
                    if Instant::now() > deadline {
                        return Err(PsError::Timeout {
                            what: format!("worker {}: waiting for {} parameter servers", o.worker, o.min_servers),
                            secs: o.timeout.as_secs_f64(),
                            detail: format!("{} registered", m.servers.len()),
                        });
                    }
                }
                other => return Err(PsError::Protocol(format!("coordinator answered Membership with {other:?}"))),
            }
        };
        let beat = match o.heartbeat {
            Some(every) => {
                let stop = Arc::new(AtomicBool::new(false));
                let (addr, token, worker, s) = (o.coordinator.clone(), o.token.clone(), o.worker, stop.clone());
                let h = std::thread::Builder::new()
                    .name("kolo-ps-worker-beat".into())
                    .spawn(move || {
                        let mut c: Option<Conn> = None;
                        while !s.load(Ordering::SeqCst) {
                            if c.is_none() {
                                c = Conn::connect(&addr, &token, Duration::from_secs(1)).ok();
                            }
                            if let Some(conn) = c.as_mut() {
                                if conn.call(&Req::WorkerBeat { worker }).is_err() {
                                    c = None;
                                }
                            }
                            std::thread::sleep(every);
                        }
                    })
                    .map_err(|e| PsError::Io(e.to_string()))?;
                Some((stop, h))
            }
            None => None,
        };
        let ring = Ring::new(&membership.servers.iter().map(|(id, _)| *id).collect::<Vec<_>>());
        Ok(PsClient { o, coord, membership, ring, conns: HashMap::new(), stats: PushStats::default(), vec_seq: 0, beat })
    }

    pub fn job(&self) -> &JobSpec {
        &self.o.job
    }
    pub fn worker(&self) -> u32 {
        self.o.worker
    }

    /// The job's number of workers.
    pub fn workers(&self) -> u32 {
        self.o.job.workers
    }
    pub fn stats(&self) -> &PushStats {
        &self.stats
    }
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Creates every range with `values` (the first worker to do so wins; the others' are ignored).
    pub fn init(&mut self, values: &[f32]) -> Result<(), PsError> {
        self.check_len(values.len(), "init")?;
        let job = self.o.job.clone();
        let mut todo: Vec<u32> = (0..job.ranges()).collect();
        self.rounds(
            "init",
            &mut todo,
            &mut |range, epoch, _| Req::Init { job: job.clone(), epoch, range, values: values[job.span(range)].to_vec(), fwd: false },
            &mut |_, r| match r {
                Resp::Ok { .. } => Ok(()),
                other => Err(other),
            },
        )
    }

    /// The whole table's state as a pull for step `clock` sees it (BSP: every worker's steps
    /// before `clock` applied), for a checkpoint: the values, the optimizer's step count and its
    /// state vectors (in `JobSpec::optimizer`'s state order), each over the whole table, and
    /// each worker's clock. Without BSP the workers never stop together: each range is read as
    /// it is when its request arrives (a fuzzy snapshot, as asynchronous parameter servers
    /// checkpoint), its optimizer step count is the fewest over the ranges, and a worker's
    /// clock is the fewest steps it had applied on any range (a push that reached only some
    /// ranges is redone after a restore).
    pub fn snapshot(&mut self, clock: u64) -> Result<Snapshot, PsError> {
        let job = self.o.job.clone();
        let n = job.len as usize;
        let names = job.optimizer.state_names().len();
        let bsp = job.consistency == crate::Consistency::Bsp;
        let (mut values, mut opt_state, mut steps) = (vec![0f32; n], vec![vec![0f32; n]; names], None);
        let mut clocks = vec![u64::MAX; job.workers as usize];
        let mut todo: Vec<u32> = (0..job.ranges()).collect();
        let mut problem = None;
        self.rounds("snapshot", &mut todo, &mut |range, epoch, _| Req::Snapshot { epoch, range, clock }, &mut |range, r| match r {
            Resp::State(st) if st.values.len() == job.span(range).len() && st.opt_state.len() == names => {
                let span = job.span(range);
                values[span.clone()].copy_from_slice(&st.values);
                for (all, part) in opt_state.iter_mut().zip(&st.opt_state) {
                    if part.len() == span.len() {
                        all[span.clone()].copy_from_slice(part);
                    } else {
                        problem.get_or_insert(format!("range {range}'s optimizer state has {} values, not {}", part.len(), span.len()));
                    }
                }
                let first = *steps.get_or_insert(st.opt_steps);
                if bsp && first != st.opt_steps {
                    problem.get_or_insert(format!("range {range} has taken {} optimizer steps, range 0 {first}", st.opt_steps));
                }
                steps = Some(first.min(st.opt_steps));
                if st.clocks.len() == clocks.len() {
                    clocks.iter_mut().zip(&st.clocks).for_each(|(c, r)| *c = (*c).min(*r));
                } else {
                    problem.get_or_insert(format!("range {range} has clocks of {} workers, not {}", st.clocks.len(), clocks.len()));
                }
                Ok(())
            }
            other => Err(other),
        })?;
        if let Some(p) = problem {
            return Err(PsError::Protocol(format!("snapshot for step {clock}: {p}")));
        }
        clocks.iter_mut().filter(|c| **c == u64::MAX).for_each(|c| *c = 0);
        Ok(Snapshot { values, opt_steps: steps.unwrap_or(0), opt_state, clocks })
    }

    /// Replaces every range's state with a checkpoint's (the inverse of
    /// [`PsClient::snapshot`]): worker w has pushed `clocks[w]` steps, none is pending.
    pub fn restore(&mut self, clocks: &[u64], values: &[f32], opt_steps: u64, opt_state: &[Vec<f32>]) -> Result<(), PsError> {
        self.check_len(values.len(), "restore")?;
        let job = self.o.job.clone();
        if clocks.len() != job.workers as usize {
            return Err(PsError::Config(format!("restore: clocks of {} workers for a job of {}", clocks.len(), job.workers)));
        }
        let clock = clocks.iter().copied().max().unwrap_or(0);
        if opt_state.len() != job.optimizer.state_names().len() || opt_state.iter().any(|v| v.len() != values.len()) {
            return Err(PsError::Config(format!(
                "restore: {} optimizer state vectors of {:?} values, but the servers' optimizer keeps {} of {}",
                opt_state.len(),
                opt_state.iter().map(Vec::len).collect::<Vec<_>>(),
                job.optimizer.state_names().len(),
                values.len()
            )));
        }
        let workers = job.workers as usize;
        // One id for the whole restore: a retry of a range the servers already restored (its
        // answer lost) must not wipe what was pushed since.
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let id = mix(now ^ mix(u64::from(std::process::id()) << 32 | u64::from(self.o.worker)) ^ clock);
        let mut todo: Vec<u32> = (0..job.ranges()).collect();
        self.rounds(
            "restore",
            &mut todo,
            &mut |range, epoch, _| {
                let span = job.span(range);
                let state = RangeState {
                    values: values[span.clone()].to_vec(),
                    opt_steps,
                    opt_state: opt_state.iter().map(|v| v[span.clone()].to_vec()).collect(),
                    clocks: clocks.to_vec(),
                    pending: vec![None; workers],
                    vectors: Vec::new(),
                    vec_seq: 0,
                };
                Req::Restore { job: job.clone(), epoch, range, state, id }
            },
            &mut |_, r| match r {
                Resp::Ok { .. } => Ok(()),
                other => Err(other),
            },
        )
    }

    /// Pushes this worker's gradient for step `clock` (the whole table), each range through
    /// `filter` if given.
    pub fn push(&mut self, clock: u64, lr: f32, grads: &[f32], mut filter: Option<&mut dyn Filter>) -> Result<(), PsError> {
        self.check_len(grads.len(), "push")?;
        let job = self.o.job.clone();
        let mut items = BTreeMap::new();
        for range in 0..job.ranges() {
            let span = job.span(range);
            let mut values = grads[span.clone()].to_vec();
            self.stats.values_total += values.len() as u64;
            let keys = match filter.as_deref_mut() {
                Some(f) => f.select(range, &mut values).map(|k| (key_list_id(&k), Arc::new(k))),
                None => None,
            };
            self.stats.values_sent += values.len() as u64;
            items.insert(range, Item { range, keys, values });
        }
        let mut todo: Vec<u32> = items.keys().copied().collect();
        let worker = self.o.worker;
        self.rounds(
            "push",
            &mut todo,
            &mut |range, epoch, sent| {
                let it = &items[&range];
                let keys = match &it.keys {
                    None => Keys::All,
                    Some((id, _)) if sent.contains(id) => Keys::Cached { id: *id },
                    Some((id, k)) => {
                        sent.insert(*id);
                        Keys::List { id: *id, keys: k.to_vec() }
                    }
                };
                debug_assert_eq!(it.range, range);
                Req::Push { epoch, range, worker, clock, lr, keys, values: it.values.clone(), fwd: false }
            },
            &mut |_, r| match r {
                Resp::Ok { .. } => Ok(()),
                other => Err(other),
            },
        )
    }

    /// Pulls the whole table into `out` for a worker about to compute step `clock`, waiting as
    /// the consistency model demands. Returns the slowest worker's clock seen.
    pub fn pull(&mut self, clock: u64, out: &mut [f32]) -> Result<u64, PsError> {
        self.check_len(out.len(), "pull")?;
        // An observer reads whatever the servers hold now.
        let clock = if self.o.worker == OBSERVER { 0 } else { clock };
        let job = self.o.job.clone();
        let worker = self.o.worker;
        let mut todo: Vec<u32> = (0..job.ranges()).collect();
        let mut slowest = u64::MAX;
        let mut violation = None;
        self.rounds("pull", &mut todo, &mut |range, epoch, _| Req::Pull { epoch, range, worker, clock, keys: Keys::All }, &mut |range, r| match r {
            Resp::Values { min_clock, values } if values.len() == job.span(range).len() => {
                out[job.span(range)].copy_from_slice(&values);
                slowest = slowest.min(min_clock);
                if let Some(need) = job.consistency.needs(clock) {
                    if min_clock < need {
                        violation = Some(format!("range {range} answered a pull for step {clock} while the slowest worker is at step {min_clock} (needs {need}, {:?})", job.consistency));
                    }
                }
                Ok(())
            }
            other => Err(other),
        })?;
        if let Some(v) = violation {
            return Err(PsError::Server(format!("consistency violated: {v}")));
        }
        let slowest = if slowest == u64::MAX { clock } else { slowest };
        self.stats.max_lead = self.stats.max_lead.max(clock.saturating_sub(slowest));
        if let Consistency::Bounded(tau) = job.consistency {
            assert!(
                clock.saturating_sub(slowest) <= tau,
                "bounded delay violated: step {clock} computed with the slowest worker at {slowest} (tau {tau})"
            );
        }
        Ok(slowest)
    }

    /// The slowest worker's clock: the pushes every range has applied from every worker, read
    /// without the values (an empty key list per range) and without waiting for any clock. A
    /// worker at the end of an async run waits on it for the others' last pushes.
    pub fn slowest_clock(&mut self) -> Result<u64, PsError> {
        let (ranges, worker) = (self.o.job.ranges(), self.o.worker);
        let id = key_list_id(&[]);
        let mut todo: Vec<u32> = (0..ranges).collect();
        let mut slowest = u64::MAX;
        let probe = &mut |range, epoch, _: &mut HashSet<u64>| Req::Pull {
            epoch,
            range,
            worker,
            clock: 0,
            keys: Keys::List { id, keys: Vec::new() },
        };
        self.rounds("clock", &mut todo, probe, &mut |_, r| match r {
            Resp::Values { min_clock, values } if values.is_empty() => {
                slowest = slowest.min(min_clock);
                Ok(())
            }
            other => Err(other),
        })?;
        Ok(if slowest == u64::MAX { 0 } else { slowest })
    }

    /// The deadline of every request, retries included (`ps.timeout_secs`).
    pub fn timeout(&self) -> Duration {
        self.o.timeout
    }

    /// Every server's counters, by server id.
    pub fn server_stats(&mut self) -> Result<Vec<(u32, ServerStats)>, PsError> {
        let ids: Vec<u32> = self.membership.servers.iter().map(|(id, _)| *id).collect();
        ids.into_iter().map(|id| Ok((id, self.stats_of(id)?))).collect()
    }

    /// The counters of the servers that answer: a server that fails is left out and its
    /// connection dropped (training's own requests reconnect or fail over), so that a
    /// monitoring read never stops a worker that a dead server does not stop.
    pub fn reachable_server_stats(&mut self) -> Vec<(u32, ServerStats)> {
        let ids: Vec<u32> = self.membership.servers.iter().map(|(id, _)| *id).collect();
        let mut out = Vec::new();
        for id in ids {
            match self.stats_of(id) {
                Ok(s) => out.push((id, s)),
                Err(_) => {
                    self.conns.remove(&id);
                }
            }
        }
        out
    }

    fn stats_of(&mut self, id: u32) -> Result<ServerStats, PsError> {
        match self.conn(id)?.conn.call(&Req::Stats)? {
            Resp::Stats(s) => Ok(*s),
            other => Err(PsError::Protocol(format!("server {id} answered Stats with {other:?}"))),
        }
    }

    /// Sandblaster: `dst = a * dst + b * src` on every range (vector 0 is the parameters).
    /// Applied once per range even when a request is retried: the operation carries a number
    /// (microseconds since the Unix epoch, strictly increasing on this client, so a restarted
    /// driver continues above its predecessor), and a range skips numbers it has applied.
    /// One driver issues a job's vector operations.
    pub fn axpby(&mut self, dst: u32, a: f64, src: u32, b: f64) -> Result<(), PsError> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64);
        self.vec_seq = now.max(self.vec_seq + 1);
        let seq = self.vec_seq;
        let mut todo: Vec<u32> = (0..self.o.job.ranges()).collect();
        self.rounds("axpby", &mut todo, &mut |range, epoch, _| Req::Axpby { epoch, range, seq, dst, a, src, b }, &mut |_, r| match r {
            Resp::Ok { .. } => Ok(()),
            other => Err(other),
        })
    }

    /// Sandblaster: the dot product of two vectors, each server summing its ranges.
    pub fn dot(&mut self, x: u32, y: u32) -> Result<f64, PsError> {
        let mut todo: Vec<u32> = (0..self.o.job.ranges()).collect();
        let mut parts = BTreeMap::new();
        self.rounds("dot", &mut todo, &mut |range, epoch, _| Req::Dot { epoch, range, x, y }, &mut |range, r| match r {
            Resp::Scalar(v) => {
                parts.insert(range, v);
                Ok(())
            }
            other => Err(other),
        })?;
        // Summed in range order: the same result whichever servers hold the ranges.
        Ok(parts.values().sum())
    }

    /// Writes (`Some`) or reads vector `id` of the whole table.
    pub fn vector(&mut self, id: u32, write: Option<&[f32]>, out: &mut [f32]) -> Result<(), PsError> {
        let job = self.o.job.clone();
        let mut todo: Vec<u32> = (0..job.ranges()).collect();
        self.rounds(
            "vector",
            &mut todo,
            &mut |range, epoch, _| Req::Vector { epoch, range, id, values: write.map(|w| w[job.span(range)].to_vec()) },
            &mut |range, r| match r {
                Resp::Ok { .. } => Ok(()),
                Resp::Values { values, .. } if values.len() == job.span(range).len() => {
                    out[job.span(range)].copy_from_slice(&values);
                    Ok(())
                }
                Resp::Values { values, .. } if values.is_empty() => {
                    out[job.span(range)].fill(0.0);
                    Ok(())
                }
                other => Err(other),
            },
        )
    }

    fn check_len(&self, n: usize, what: &str) -> Result<(), PsError> {
        if n as u64 != self.o.job.len {
            return Err(PsError::Config(format!("worker {}: {what} of {n} values, but the table has {}", self.o.worker, self.o.job.len)));
        }
        Ok(())
    }

    fn conn(&mut self, id: u32) -> Result<&mut ServerConn, PsError> {
        if !self.conns.contains_key(&id) {
            let addr = self
                .membership
                .servers
                .iter()
                .find(|(s, _)| *s == id)
                .map(|(_, a)| a.clone())
                .ok_or_else(|| PsError::Server(format!("server {id} is not a member")))?;
            // A member has registered, so it listens: a refused connection means it is down.
            // Fail at once and let the caller refresh the membership (the coordinator drops a
            // dead server after its missed heartbeats) instead of redialling the dead address
            // for the whole deadline (#19: every run failed after a server was killed).
            // Pulls may wait up to the servers' deadline: give the socket a little more.
            let conn = Conn::connect_once(&addr, &self.o.token, self.o.timeout + Duration::from_secs(5))?;
            self.conns.insert(id, ServerConn { conn, sent_lists: HashSet::new() });
        }
        Ok(self.conns.get_mut(&id).expect("inserted"))
    }

    /// Asks the coordinator for a membership newer than `after` (or the current one).
    fn refresh(&mut self, after: Option<u64>) -> Result<(), PsError> {
        let req = Req::Membership { min_servers: 1, after_epoch: after.unwrap_or(0) };
        let m = match self.coord.call(&req) {
            Ok(Resp::Membership(m)) => m,
            _ => {
                self.coord = Conn::connect(&self.o.coordinator, &self.o.token, self.o.timeout)?;
                match self.coord.call(&req)? {
                    Resp::Membership(m) => m,
                    other => return Err(PsError::Protocol(format!("coordinator answered Membership with {other:?}"))),
                }
            }
        };
        if m.epoch != self.membership.epoch {
            let ids: Vec<u32> = m.servers.iter().map(|(id, _)| *id).collect();
            self.conns.retain(|id, _| ids.contains(id));
            self.ring = Ring::new(&ids);
            self.membership = m;
        }
        Ok(())
    }

    /// Sends one request per range in `todo` to its chain head, pipelined per server, and
    /// retries refused or failed ones until the deadline.
    fn rounds(
        &mut self,
        what: &str,
        todo: &mut Vec<u32>,
        build: &mut dyn FnMut(u32, u64, &mut HashSet<u64>) -> Req,
        done: &mut dyn FnMut(u32, Resp) -> Result<(), Resp>,
    ) -> Result<(), PsError> {
        let deadline = Instant::now() + self.o.timeout;
        let mut last_problem = String::new();
        let mut first = true;
        let mut next_warning = Instant::now() + Duration::from_secs(2);
        while !todo.is_empty() {
            if !first {
                self.stats.retries += todo.len() as u64;
                if Instant::now() > next_warning {
                    kolo_base::eline!(
                        "kolo ps worker {}: {what} of {} range(s) still retrying at epoch {}: {last_problem}",
                        self.o.worker,
                        todo.len(),
                        self.membership.epoch
                    );
                    next_warning += Duration::from_secs(2);
                }
                if Instant::now() > deadline {
                    return Err(PsError::Timeout {
                        what: format!("worker {}: {what} of {} range(s)", self.o.worker, todo.len()),
                        secs: self.o.timeout.as_secs_f64(),
                        detail: last_problem,
                    });
                }
            }
            first = false;
            if self.membership.servers.is_empty() {
                self.refresh(Some(self.membership.epoch))?;
                continue;
            }
            let epoch = self.membership.epoch;
            let mut by_server: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
            for &r in todo.iter() {
                let head = self.ring.chain(r, 0)[0];
                by_server.entry(head).or_default().push(r);
            }
            let mut retry = Vec::new();
            let mut refresh: Option<u64> = None;
            let mut later = false;
            let mut sent: Vec<(u32, Vec<u32>)> = Vec::new();
            for (server, ranges) in by_server {
                let sc = match self.conn(server) {
                    Ok(c) => c,
                    Err(e) => {
                        last_problem = format!("server {server}: {e}");
                        refresh = Some(epoch);
                        retry.extend(ranges);
                        continue;
                    }
                };
                let mut ok = Vec::new();
                let before = sc.conn.bytes_out;
                for (i, &r) in ranges.iter().enumerate() {
                    let req = build(r, epoch, &mut sc.sent_lists);
                    if let Err(e) = sc.conn.send(&req) {
                        last_problem = format!("server {server}: {e}");
                        refresh = Some(epoch);
                        retry.extend(&ranges[i..]);
                        break;
                    }
                    ok.push(r);
                }
                let wrote = sc.conn.bytes_out - before;
                self.stats.bytes_out += wrote;
                sent.push((server, ok));
            }
            for (server, ranges) in sent {
                for (i, &r) in ranges.iter().enumerate() {
                    let Some(sc) = self.conns.get_mut(&server) else {
                        retry.extend(&ranges[i..]);
                        break;
                    };
                    let before = sc.conn.bytes_in;
                    let got = sc.conn.recv();
                    self.stats.bytes_in += sc.conn.bytes_in - before;
                    let resp = match got {
                        Ok(resp) => resp,
                        Err(e) => {
                            last_problem = format!("server {server}: {e}");
                            self.conns.remove(&server);
                            refresh = Some(epoch);
                            retry.extend(&ranges[i..]);
                            break;
                        }
                    };
                    match done(r, resp) {
                        Ok(()) => {}
                        Err(Resp::WrongEpoch { current }) if current > epoch => {
                            last_problem = format!("server {server} is at epoch {current}, this worker at {epoch}");
                            refresh = Some(refresh.map_or(epoch, |x| x.max(epoch)));
                            retry.push(r);
                        }
                        Err(Resp::WrongEpoch { current }) => {
                            last_problem = format!("server {server} is still at epoch {current} (this worker: {epoch})");
                            later = true;
                            retry.push(r);
                        }
                        Err(Resp::UnknownKeys) => {
                            if let Some(sc) = self.conns.get_mut(&server) {
                                sc.sent_lists.clear();
                            }
                            retry.push(r);
                        }
                        Err(Resp::Error(e)) if e.contains("replicating") => {
                            // A chain member is unreachable or behind: retry soon, with the
                            // newest membership (the coordinator drops dead servers).
                            last_problem = e;
                            later = true;
                            retry.push(r);
                        }
                        Err(Resp::Error(e)) => return Err(PsError::Server(e)),
                        Err(other) => {
                            return Err(PsError::Protocol(format!("server {server} answered {what} of range {r} with {other:?}")))
                        }
                    }
                }
            }
            if let Some(after) = refresh {
                self.refresh(Some(after))?;
            } else if later {
                std::thread::sleep(Duration::from_millis(20));
                self.refresh(None)?;
            }
            *todo = retry;
        }
        Ok(())
    }
}

impl Drop for PsClient {
    fn drop(&mut self) {
        if let Some((stop, h)) = self.beat.take() {
            stop.store(true, Ordering::SeqCst);
            let _ = h.join();
        }
    }
}
