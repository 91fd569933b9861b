//! The flight recorder: the last collectives of a communicator (what, which sequence number,
//! when, how long, how it ended), kept outside the communicator's main lock so that it can be
//! read while a collective hangs — on failure, or on demand (`SIGUSR1` in the `kolo` binary).

use kolo_comm::OpKind;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Instant, SystemTime};

/// Entries kept per communicator.
pub const CAPACITY: usize = 64;

#[derive(Clone, Debug)]
pub struct Entry {
    pub seq: u64,
    pub op: OpKind,
    pub algorithm: &'static str,
    pub bytes: usize,
    pub started: Instant,
    pub wall: SystemTime,
    /// `None` while in progress.
    pub outcome: Option<Result<std::time::Duration, String>>,
}

#[derive(Default)]
pub struct Recorder {
    entries: Mutex<VecDeque<Entry>>,
}

impl Recorder {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn start(&self, seq: u64, op: OpKind, algorithm: &'static str, bytes: usize) {
        let mut e = self.lock();
        if e.len() == CAPACITY {
            e.pop_front();
        }
        e.push_back(Entry { seq, op, algorithm, bytes, started: Instant::now(), wall: SystemTime::now(), outcome: None });
    }

    pub fn finish(&self, seq: u64, outcome: Result<(), String>) {
        let mut e = self.lock();
        if let Some(x) = e.iter_mut().rev().find(|x| x.seq == seq && x.outcome.is_none()) {
            x.outcome = Some(outcome.map(|_| x.started.elapsed()));
        }
    }

    pub fn entries(&self) -> Vec<Entry> {
        self.lock().iter().cloned().collect()
    }

    /// A readable dump, oldest first, the one in progress (if any) marked.
    pub fn dump(&self, header: &str) -> String {
        let mut s = format!("{header}: last {} collectives, oldest first\n", self.lock().len());
        for e in self.entries() {
            let t = e.wall.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
            let how = match &e.outcome {
                None => format!("IN PROGRESS for {:.3}s", e.started.elapsed().as_secs_f64()),
                Some(Ok(d)) => format!("ok in {:.3} ms", d.as_secs_f64() * 1e3),
                Some(Err(m)) => format!("FAILED: {m}"),
            };
            s.push_str(&format!("  #{:<6} {:<14} {:<12} {:>12} B  t={t:.3}  {how}\n", e.seq, format!("{}", e.op), e.algorithm, e.bytes));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_entries_and_marks_the_one_in_progress() {
        let r = Recorder::default();
        for seq in 0..(CAPACITY as u64 + 5) {
            r.start(seq, OpKind::AllReduce, "ring", 1024);
            r.finish(seq, Ok(()));
        }
        r.start(999, OpKind::Barrier, "doubling", 0);
        let e = r.entries();
        assert_eq!(e.len(), CAPACITY);
        assert_eq!(e[0].seq, 6, "the oldest were dropped");
        let d = r.dump("rank 0");
        assert!(d.contains("#999") && d.contains("IN PROGRESS"), "{d}");
        r.finish(999, Err("lost rank 1".into()));
        assert!(r.dump("rank 0").contains("FAILED: lost rank 1"));
    }
}
