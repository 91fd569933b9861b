//! Heartbeats through the job's store, so that a collective stuck on a peer that is gone without
//! a FIN (its process stopped, its host down, the network to it cut) fails within seconds, naming
//! that peer, instead of at the collective deadline (issue #19).
//!
//! Each rank of a group bumps its counter `kolo/alive/{group}/{rank}` in the store every beat.
//! TCP keepalive cannot do this job: it probes only links with nothing unacknowledged in flight,
//! and in a collective cut mid-transfer both ends usually have data in flight (the kernel then
//! retransmits for about 15 minutes). `TCP_USER_TIMEOUT` would also close links whose receiver is
//! merely busy (a rank evaluating while its peer's send buffer is full).
//!
//! Only a rank whose collective has made no progress for a beat looks at the others' counters
//! (one store read per rank and beat): a rank whose counter stays still for the whole liveness
//! window is reported. A rank that is only slow (a long evaluation, a straggler) keeps beating
//! and is left to the collective deadline and its hang diagnosis. A rank whose own heartbeat the
//! store does not answer for the window is cut off from the store's host (rank 0 of the job) and
//! says so.

use kolo_rendezvous::Store;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const NONE: u64 = u64::MAX;

/// What a stalled collective learns from the heartbeats: the peer to blame (`None`: the one it
/// waits on) and why.
pub(crate) type Verdict = (Option<usize>, String);

/// The shared state between a communicator's engine and its heartbeat thread.
pub(crate) struct Liveness {
    start: Instant,
    window: Duration,
    /// Milliseconds since `start` of the in-flight collective's last progress; `NONE` when no
    /// collective is running.
    stalled_since: AtomicU64,
    /// When the heartbeat now in the store's hands was sent; `NONE` between beats.
    beat_sent: AtomicU64,
    verdict: Mutex<Option<Verdict>>,
    /// The member hosting the store: to blame when the store stops answering.
    store_host: Option<usize>,
    _stop: Sender<()>,
}

fn key(group: &str, rank: usize) -> String {
    format!("kolo/alive/{group}/{rank}")
}

impl Liveness {
    /// Starts the heartbeat thread of `rank` in a group of `n`. `window` is how long a peer may
    /// stay silent; the thread beats 4 times per window (at most once a second) and ends when the
    /// returned value is dropped. `store_host` is the member whose process hosts the store (the
    /// job's rank 0), if it is one: a store that stops answering is that member stopped.
    pub fn start(store: Arc<dyn Store>, group: &str, rank: usize, n: usize, window: Duration, store_host: Option<usize>) -> Arc<Liveness> {
        let (stop, stopped) = mpsc::channel::<()>();
        let live = Arc::new(Liveness {
            start: Instant::now(),
            window,
            stalled_since: AtomicU64::new(NONE),
            beat_sent: AtomicU64::new(NONE),
            verdict: Mutex::new(None),
            store_host: store_host.filter(|&h| h != rank && h < n),
            _stop: stop,
        });
        let beat = (window / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let weak = Arc::downgrade(&live);
        let group = group.to_string();
        let spawned = std::thread::Builder::new().name(format!("kolo-alive-r{rank}")).spawn(move || {
            // Its own connection: beats must not queue behind this rank's long store waits
            // (a sub-group's set-up waiting for its peers' addresses), or they would stop.
            let store = store.second_connection().unwrap_or(store);
            // Per peer: the counter last read and when it last changed (while this rank stalls).
            let mut seen: Vec<Option<(i64, Instant)>> = vec![None; n];
            loop {
                match stopped.recv_timeout(beat) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(live) = weak.upgrade() else { return };
                live.beat_sent.store(live.now(), Ordering::Relaxed);
                let ours = store.add(&key(&group, rank), 1);
                live.beat_sent.store(NONE, Ordering::Relaxed);
                if let Err(e) = ours {
                    // A closed connection is rank 0's process gone (after failing first, as a
                    // rank that saw the same silence a moment earlier does); anything else is a
                    // store this rank cannot reach.
                    let why = if e.to_string().contains("closed the connection") {
                        format!("no progress, and the job's store closed its connection ({e}): rank 0, its host, has exited (it may have failed first: see its error)")
                    } else {
                        format!("this rank cannot reach the job's store ({e}): its host may be cut off from rank 0's")
                    };
                    live.set(None, why);
                    continue;
                }
                if !live.stalled_for(beat) {
                    seen.iter_mut().for_each(|s| *s = None);
                    continue;
                }
                let now = Instant::now();
                let mut silent = Vec::new();
                for (r, s) in seen.iter_mut().enumerate().filter(|(r, _)| *r != rank) {
                    let Ok(v) = store.add(&key(&group, r), 0) else { break };
                    match s {
                        Some((last, since)) if *last == v => {
                            if now.duration_since(*since) >= window {
                                silent.push(r);
                            }
                        }
                        _ => *s = Some((v, now)),
                    }
                }
                // Named by the peer field only: a two-level collective renumbers that into its
                // parent group's ranks, which a list in the text would escape.
                if let Some(&first) = silent.first() {
                    let others = match silent.len() - 1 {
                        0 => String::new(),
                        k => format!(" (nor did {k} other rank(s))"),
                    };
                    live.set(
                        Some(first),
                        format!(
                            "it sent no heartbeat for {window:?}{others}: stopped or hung process, dead host, or the network to it cut"
                        ),
                    );
                }
            }
        });
        // Without the thread the communicator still works: stalls end at the collective deadline.
        drop(spawned);
        live
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn stalled_for(&self, d: Duration) -> bool {
        let s = self.stalled_since.load(Ordering::Relaxed);
        s != NONE && self.now().saturating_sub(s) >= d.as_millis() as u64
    }

    fn set(&self, peer: Option<usize>, why: String) {
        let mut v = self.verdict.lock().unwrap_or_else(|p| p.into_inner());
        v.get_or_insert((peer, why));
    }

    /// The engine made progress (or started a collective).
    pub fn progress(&self) {
        self.stalled_since.store(self.now(), Ordering::Relaxed);
    }

    /// The collective ended: forget this stall's evidence.
    pub fn finished(&self) {
        self.stalled_since.store(NONE, Ordering::Relaxed);
        *self.verdict.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Why the stalled collective should give up now, if the heartbeats say so. Only once it has
    /// itself seen no progress for the liveness window.
    pub fn verdict(&self) -> Option<Verdict> {
        if !self.stalled_for(self.window) {
            return None;
        }
        if let Some(v) = self.verdict.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Some(v);
        }
        let sent = self.beat_sent.load(Ordering::Relaxed);
        if sent != NONE && self.now().saturating_sub(sent) >= self.window.as_millis() as u64 {
            // The store's host is a member: its process stopped (or its host went silent), and
            // it is the one to blame, not the peer this collective happens to wait on.
            return Some((
                self.store_host,
                format!("the job's store has not answered this rank's heartbeat for {:?}: its host (rank 0's process) is stopped, dead or cut off from this rank", self.window),
            ));
        }
        None
    }
}
