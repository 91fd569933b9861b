//! The round server. A driver thread runs the rounds: it waits for `min_clients` to join,
//! samples each round's cohort, opens the round, waits until every member's update arrived or
//! the round's deadline passed, and averages what arrived weighted by example counts. With
//! secure aggregation the server only ever sees masked updates, whose masks cancel in the sum;
//! if a member of a secure round misses the deadline its partners' masks cannot cancel, so the
//! round is run again (a new attempt, new masks) with the members that answered.

use crate::secure::{unmask_sum, MIN_COHORT};
use crate::wire::{Fed, Req, Resp, Update};
use crate::FedSpec;
use kolo_base::Rng;
use kolo_ps::net::{ConnState, HandlerOf, Listener};
use kolo_ps::PsError;
use kolo_rendezvous::JobToken;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What happened in one round.
#[derive(Clone, Debug, PartialEq)]
pub struct RoundReport {
    pub round: u32,
    /// Attempts it took (secure rounds repeat without members that missed the deadline).
    pub attempts: u32,
    /// The clients sampled first.
    pub cohort: Vec<u32>,
    /// The clients whose updates were averaged.
    pub used: Vec<u32>,
    /// Sampled clients that missed a deadline in this round.
    pub late: Vec<u32>,
    pub examples: u64,
    pub secs: f64,
}

struct Client {
    public: Option<[u8; 32]>,
    /// Its identity's signature of `public` (jobs with a roster).
    sig: Option<[u8; 64]>,
}

#[derive(Default)]
struct State {
    global: Vec<f32>,
    /// Joined clients by id.
    clients: BTreeMap<u32, Client>,
    round: u32,
    attempt: u32,
    cohort: Vec<u32>,
    open: bool,
    updates: BTreeMap<u32, (u64, Update)>,
    done: bool,
    rounds_done: u32,
    failed: Option<String>,
    /// Clients that have the final model and said goodbye.
    told_done: std::collections::BTreeSet<u32>,
}

struct Shared {
    spec: FedSpec,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

pub struct FedServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    _listener: Listener,
    driver: Option<std::thread::JoinHandle<Result<Vec<RoundReport>, PsError>>>,
}

/// Called after every round with its report and the new global model (evaluation, logging).
pub type OnRound = Box<dyn FnMut(&RoundReport, &[f32]) + Send>;

impl FedServer {
    /// Listens on `addr` and starts the rounds from `initial` (the model's flat parameters).
    pub fn start(addr: &str, token: JobToken, spec: FedSpec, initial: Vec<f32>, on_round: OnRound) -> Result<FedServer, PsError> {
        spec.check()?;
        if initial.len() != spec.numel {
            return Err(PsError::Config(format!("initial model of {} values, spec says {}", initial.len(), spec.numel)));
        }
        let shared = Arc::new(Shared { spec, state: Mutex::new(State { global: initial, ..Default::default() }), cv: Condvar::new() });
        let handler: HandlerOf<Fed> = {
            let shared = shared.clone();
            Arc::new(move |conn: &mut ConnState, req: Req, _bytes: usize| handle(&shared, conn, req))
        };
        let listener = Listener::start_with::<Fed>(addr, token, "fed", handler)
            .map_err(|e| PsError::Io(format!("federated server on {addr}: {e}")))?;
        let driver = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("kolo-fed-rounds".into())
                .spawn(move || drive(&shared, on_round))
                .map_err(|e| PsError::Io(e.to_string()))?
        };
        Ok(FedServer { addr: listener.addr, shared, _listener: listener, driver: Some(driver) })
    }

    /// Waits for the last round; returns every round's report and the final model.
    pub fn wait(mut self) -> Result<(Vec<RoundReport>, Vec<f32>), PsError> {
        let reports =
            self.driver.take().expect("waited once").join().map_err(|_| PsError::Server("the round driver panicked".into()))??;
        // Every client that joined collects the final model and says goodbye before the
        // listener closes (or 5 s pass: a client that died does not hold the server).
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut st = self.shared.lock();
        while st.told_done.len() < st.clients.len() && Instant::now() < deadline {
            st = self.shared.cv.wait_timeout(st, Duration::from_millis(50)).unwrap_or_else(|p| p.into_inner()).0;
        }
        drop(st);
        Ok((reports, self.shared.lock().global.clone()))
    }
}

/// Answers one request on a connection. A connection acts for the client it joined as, and
/// only for it: another id on it is refused.
fn handle(shared: &Shared, conn: &mut ConnState, req: Req) -> Resp {
    let spec = &shared.spec;
    let claimed = match &req {
        Req::Join { .. } => None,
        Req::Poll { id } | Req::Bye { id } | Req::Update { id, .. } => Some(*id),
    };
    match (claimed, conn.client) {
        (None, Some(bound)) => return Resp::Error(format!("this connection already joined as client {bound}")),
        (Some(id), bound) if bound != Some(id) => {
            return Resp::Error(match bound {
                Some(b) => format!("client {id}: this connection joined as client {b}"),
                None => format!("client {id}: join on this connection first"),
            })
        }
        _ => {}
    }
    match req {
        Req::Join { examples, public, id, sig } => {
            if spec.secure && public.is_none() {
                return Resp::Error("this job uses secure aggregation: join with a public key".into());
            }
            if let Some(roster) = &spec.roster {
                let (Some(i), Some(k), Some(s)) = (id, public, sig) else {
                    return Resp::Error(
                        "this job has a roster of client identities: join with an id, a public key and its signature".into(),
                    );
                };
                if let Err(e) = roster.verify(i, &k, &s) {
                    return Resp::Error(format!("join refused: {e}"));
                }
            }
            if examples == 0 || examples > MAX_CLIENT_EXAMPLES {
                return Resp::Error(format!("a client needs between 1 and {MAX_CLIENT_EXAMPLES} training examples, not {examples}"));
            }
            let mut st = shared.lock();
            let id = match id {
                Some(i) if st.clients.contains_key(&i) => return Resp::Error(format!("client id {i} has already joined")),
                Some(i) => i,
                None => (0..).find(|i| !st.clients.contains_key(i)).expect("a free id"),
            };
            st.clients.insert(id, Client { public, sig });
            conn.client = Some(id);
            shared.cv.notify_all();
            Resp::Joined { id, numel: spec.numel as u64, secure: spec.secure }
        }
        Req::Poll { id } => {
            let deadline = Instant::now() + Duration::from_secs(1);
            let mut st = shared.lock();
            if !st.clients.contains_key(&id) {
                return Resp::Error(format!("client {id} never joined"));
            }
            loop {
                if let Some(f) = &st.failed {
                    return Resp::Error(f.clone());
                }
                if st.done {
                    return Resp::Done { rounds: st.rounds_done, params: st.global.clone() };
                }
                if st.open && st.cohort.contains(&id) && !st.updates.contains_key(&id) {
                    let cohort = if spec.secure {
                        st.cohort.iter().map(|&c| (c, st.clients[&c].public.expect("checked at join"))).collect()
                    } else {
                        Vec::new()
                    };
                    let sigs = match &spec.roster {
                        Some(_) if spec.secure => st.cohort.iter().map(|&c| st.clients[&c].sig.expect("checked at join")).collect(),
                        _ => Vec::new(),
                    };
                    return Resp::Train { round: st.round, attempt: st.attempt, params: st.global.clone(), cohort, sigs };
                }
                let now = Instant::now();
                if now >= deadline {
                    return Resp::Wait;
                }
                st = shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        Req::Bye { id } => {
            let mut st = shared.lock();
            st.told_done.insert(id);
            shared.cv.notify_all();
            Resp::Ack { taken: true, why: String::new() }
        }
        Req::Update { id, round, attempt, examples, update } => {
            let mut st = shared.lock();
            if !st.open || round != st.round || attempt != st.attempt || !st.cohort.contains(&id) {
                return Resp::Ack {
                    taken: false,
                    why: format!(
                        "round {round} attempt {attempt} is not open for client {id} (the server is at round {} attempt {})",
                        st.round, st.attempt
                    ),
                };
            }
            let len = match &update {
                Update::Plain(v) if !spec.secure => v.len(),
                Update::Masked(v) if spec.secure => v.len(),
                _ => {
                    return Resp::Error(format!(
                        "client {id}: a {} update in a job {} secure aggregation",
                        if spec.secure { "plain" } else { "masked" },
                        if spec.secure { "with" } else { "without" }
                    ))
                }
            };
            if len != spec.numel || examples == 0 || examples > MAX_CLIENT_EXAMPLES {
                return Resp::Error(format!(
                    "client {id}: an update of {len} values from {examples} examples (the model has {})",
                    spec.numel
                ));
            }
            st.updates.insert(id, (examples, update));
            shared.cv.notify_all();
            Resp::Ack { taken: true, why: String::new() }
        }
    }
}

/// Runs every round; the state's `done` is set at the end (or `failed` on an error).
fn drive(shared: &Shared, mut on_round: OnRound) -> Result<Vec<RoundReport>, PsError> {
    let r = drive_rounds(shared, &mut on_round);
    let mut st = shared.lock();
    match &r {
        Ok(_) => st.done = true,
        Err(e) => st.failed = Some(e.to_string()),
    }
    shared.cv.notify_all();
    r
}

fn drive_rounds(shared: &Shared, on_round: &mut OnRound) -> Result<Vec<RoundReport>, PsError> {
    let spec = &shared.spec;
    let join_deadline = Instant::now() + spec.join_timeout;
    {
        let mut st = shared.lock();
        while st.clients.len() < spec.min_clients {
            let now = Instant::now();
            if now >= join_deadline {
                return Err(PsError::Timeout {
                    what: format!("waiting for {} clients to join", spec.min_clients),
                    secs: spec.join_timeout.as_secs_f64(),
                    detail: format!("{} joined", st.clients.len()),
                });
            }
            st = shared.cv.wait_timeout(st, join_deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }
    let mut rng = Rng::new(spec.seed);
    let mut reports = Vec::new();
    for round in 0..spec.rounds {
        let t0 = Instant::now();
        let mut pool: Vec<u32> = shared.lock().clients.keys().copied().collect();
        rng.shuffle(&mut pool);
        let mut cohort: Vec<u32> = pool[..spec.clients_per_round.min(pool.len())].to_vec();
        cohort.sort_unstable();
        let first = cohort.clone();
        let mut late = Vec::new();
        let mut attempt = 0;
        let (used, examples) = loop {
            let updates = run_attempt(shared, round, attempt, &cohort);
            let answered: Vec<u32> = updates.keys().copied().collect();
            for c in &cohort {
                if !answered.contains(c) && !late.contains(c) {
                    late.push(*c);
                }
            }
            let complete = answered.len() == cohort.len();
            if !answered.is_empty() && (complete || !spec.secure) {
                let examples = apply(shared, &updates);
                break (answered, examples);
            }
            attempt += 1;
            if attempt > spec.max_attempts {
                return Err(PsError::Timeout {
                    what: format!("round {round}"),
                    secs: spec.deadline.as_secs_f64() * attempt as f64,
                    detail: format!("no complete set of updates in {attempt} attempts (late: {late:?})"),
                });
            }
            // A secure round goes on with the members that answered (as many as a client
            // masks for); otherwise with a fresh sample.
            cohort = if spec.secure && answered.len() >= MIN_COHORT {
                answered
            } else {
                rng.shuffle(&mut pool);
                let mut c = pool[..spec.clients_per_round.min(pool.len())].to_vec();
                c.sort_unstable();
                c
            };
        };
        let report = RoundReport { round, attempts: attempt + 1, cohort: first, used, late, examples, secs: t0.elapsed().as_secs_f64() };
        let global = {
            let mut st = shared.lock();
            st.rounds_done = round + 1;
            st.global.clone()
        };
        on_round(&report, &global);
        reports.push(report);
    }
    Ok(reports)
}

/// Opens `(round, attempt)` for `cohort` and collects updates until all arrived or the deadline.
fn run_attempt(shared: &Shared, round: u32, attempt: u32, cohort: &[u32]) -> BTreeMap<u32, (u64, Update)> {
    let deadline = Instant::now() + shared.spec.deadline;
    let mut st = shared.lock();
    st.round = round;
    st.attempt = attempt;
    st.cohort = cohort.to_vec();
    st.updates.clear();
    st.open = true;
    shared.cv.notify_all();
    while st.updates.len() < cohort.len() {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        st = shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
    }
    st.open = false;
    std::mem::take(&mut st.updates)
}

/// The most examples one client may claim (2^40): client-supplied counts are summed, and with
/// this bound no cohort of up to 2^23 clients overflows the u64 sum (issue #19).
pub const MAX_CLIENT_EXAMPLES: u64 = 1 << 40;

/// FedAvg: the global model moves by the example-weighted mean of the updates. Returns the
/// examples behind them.
fn apply(shared: &Shared, updates: &BTreeMap<u32, (u64, Update)>) -> u64 {
    // Counts are bounded at the door (MAX_CLIENT_EXAMPLES); saturate anyway rather than panic.
    let total: u64 = updates.values().fold(0u64, |t, (n, _)| t.saturating_add(*n));
    let mut st = shared.lock();
    let numel = st.global.len();
    let mut sum = vec![0f64; numel];
    let masked: Vec<&[u64]> = updates.values().filter_map(|(_, u)| if let Update::Masked(v) = u { Some(&v[..]) } else { None }).collect();
    if !masked.is_empty() {
        // Each masked update is n_i x delta_i: the masks cancel in the sum.
        sum = unmask_sum(&masked);
    } else {
        for (n, u) in updates.values() {
            if let Update::Plain(v) = u {
                for (s, x) in sum.iter_mut().zip(v) {
                    *s += *n as f64 * f64::from(*x);
                }
            }
        }
    }
    for (g, s) in st.global.iter_mut().zip(&sum) {
        *g += (s / total as f64) as f32;
    }
    total
}
