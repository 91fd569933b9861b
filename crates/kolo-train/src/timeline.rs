//! A timeline of training in Chrome's trace-event format (opens in Perfetto or
//! chrome://tracing): per rank (`pid`), the compute of each step, each gradient bucket's
//! collective on the communication thread, and the update. Times are wall-clock microseconds,
//! so the files of ranks on one host line up; rank 0 merges them into one trace.

use std::path::Path;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub struct Timeline {
    rank: usize,
    origin: Instant,
    origin_us: f64,
    events: Vec<serde_json::Value>,
}

/// Threads of a rank in the trace.
pub const COMPUTE: u32 = 0;
pub const COMM: u32 = 1;

impl Timeline {
    pub fn new(rank: usize) -> Timeline {
        let origin_us = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_secs_f64() * 1e6;
        let mut t = Timeline { rank, origin: Instant::now(), origin_us, events: Vec::new() };
        for (tid, name) in [(COMPUTE, "compute"), (COMM, "communication")] {
            t.events.push(serde_json::json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}}));
        }
        t.events.push(serde_json::json!({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": format!("rank {rank}")}}));
        t
    }

    fn us(&self, t: Instant) -> f64 {
        self.origin_us + t.saturating_duration_since(self.origin).as_secs_f64() * 1e6
    }

    /// A complete span on thread `tid`.
    pub fn span(&mut self, name: &str, cat: &str, tid: u32, start: Instant, end: Instant, args: serde_json::Value) {
        let ts = self.us(start);
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        self.events.push(
            serde_json::json!({"ph": "X", "name": name, "cat": cat, "pid": self.rank, "tid": tid, "ts": ts, "dur": dur, "args": args}),
        );
    }

    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let doc = serde_json::json!({"traceEvents": self.events, "displayTimeUnit": "ms"});
        std::fs::write(path, serde_json::to_vec(&doc).map_err(std::io::Error::other)?)
    }
}

/// Merges per-rank trace files into one.
pub fn merge(inputs: &[std::path::PathBuf], out: &Path) -> std::io::Result<()> {
    let mut all = Vec::new();
    for p in inputs {
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(p)?).map_err(std::io::Error::other)?;
        if let Some(ev) = v.get("traceEvents").and_then(|e| e.as_array()) {
            all.extend(ev.iter().cloned());
        }
    }
    let doc = serde_json::json!({"traceEvents": all, "displayTimeUnit": "ms"});
    std::fs::write(out, serde_json::to_vec(&doc).map_err(std::io::Error::other)?)
}
