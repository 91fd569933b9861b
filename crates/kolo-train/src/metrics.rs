//! Training metrics per rank, served in Prometheus's text exposition format (version 0.0.4)
//! by a small HTTP endpoint (`[train] metrics_port`): step, loss, step time, throughput,
//! gradient bytes and wait, skipped steps, heap and peak RSS.
//!
//! Hand-written rather than `metrics-exporter-prometheus`: that exporter brings an async HTTP
//! stack (tokio, hyper) into a static binary for one plain-text GET; this is a listener thread
//! and lock-free gauges.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// One value, stored as f64 bits.
#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub fn add(&self, v: f64) {
        let _ = self.0.fetch_update(Relaxed, Relaxed, |b| Some((f64::from_bits(b) + v).to_bits()));
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

/// The metrics of one rank.
#[derive(Default)]
pub struct Metrics {
    pub rank: usize,
    pub step: Gauge,
    pub loss: Gauge,
    pub step_seconds: Gauge,
    pub samples_per_second: Gauge,
    pub comm_bytes_total: Gauge,
    pub comm_wait_seconds_total: Gauge,
    pub skipped_steps_total: Gauge,
    pub heap_bytes: Gauge,
    pub peak_rss_bytes: Gauge,
    pub straggler_rank: Gauge,
    pub straggler_lag_seconds: Gauge,
}

impl Metrics {
    pub fn new(rank: usize) -> Arc<Metrics> {
        Arc::new(Metrics { rank, ..Default::default() })
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let items: [(&str, &str, &str, &Gauge); 11] = [
            ("kolo_step", "gauge", "Optimizer steps done.", &self.step),
            ("kolo_loss", "gauge", "Training loss averaged over ranks at the last logged step.", &self.loss),
            ("kolo_step_seconds", "gauge", "Wall time of the last step on this rank.", &self.step_seconds),
            ("kolo_samples_per_second", "gauge", "Global training throughput over the last log window.", &self.samples_per_second),
            ("kolo_comm_bytes_total", "counter", "Bytes this rank handed to gradient collectives.", &self.comm_bytes_total),
            (
                "kolo_comm_wait_seconds_total",
                "counter",
                "Time waiting for gradient collectives after backward.",
                &self.comm_wait_seconds_total,
            ),
            ("kolo_skipped_steps_total", "counter", "Steps skipped because f16 gradients overflowed.", &self.skipped_steps_total),
            ("kolo_heap_bytes", "gauge", "Live heap bytes after the last step (counting allocator).", &self.heap_bytes),
            ("kolo_peak_rss_bytes", "gauge", "Peak resident set size of the process.", &self.peak_rss_bytes),
            ("kolo_straggler_rank", "gauge", "The rank with the slowest own work per step over the last log window.", &self.straggler_rank),
            (
                "kolo_straggler_lag_seconds",
                "gauge",
                "How far that rank's own work per step is behind the median rank's.",
                &self.straggler_lag_seconds,
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, g) in items {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{rank=\"{}\"}} {}\n", self.rank, g.get()));
        }
        out
    }
}

/// Scrapes answered at once; more connections are closed (an idle or slow client holds one
/// handler for at most [`REQUEST_DEADLINE`]).
const MAX_SCRAPES: usize = 16;
/// The whole request (request line and headers) must arrive within this.
const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);

/// Serves `metrics` at `http://addr/metrics` on a background thread until the returned guard
/// is dropped. Each scrape runs on its own short-lived thread under a total read deadline, so
/// idle or trickling connections cannot delay the others (issue #19: ten idle connections
/// delayed a scrape by 19 s when they were served one after another).
pub fn serve(metrics: Arc<Metrics>, addr: &str) -> std::io::Result<Server> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let thread = std::thread::Builder::new().name("kolo-metrics".into()).spawn(move || {
        while !s.load(Relaxed) {
            match listener.accept() {
                Ok((conn, _)) => {
                    if active.load(Relaxed) >= MAX_SCRAPES {
                        continue; // closed by the drop
                    }
                    active.fetch_add(1, Relaxed);
                    let (metrics, active2) = (metrics.clone(), active.clone());
                    let spawned = std::thread::Builder::new().name("kolo-scrape".into()).spawn(move || {
                        answer(conn, &metrics);
                        active2.fetch_sub(1, Relaxed);
                    });
                    if spawned.is_err() {
                        active.fetch_sub(1, Relaxed);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(std::time::Duration::from_millis(20)),
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
    })?;
    Ok(Server { addr: local, stop, thread: Some(thread) })
}

/// Reads one request within [`REQUEST_DEADLINE`] (in total, however slowly it trickles) and
/// answers it.
fn answer(conn: std::net::TcpStream, metrics: &Metrics) {
    let deadline = std::time::Instant::now() + REQUEST_DEADLINE;
    let _ = conn.set_nonblocking(false);
    let mut r = BufReader::new(&conn);
    let mut read_line = |buf: &mut String| -> Option<usize> {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        r.read_line(buf).ok()
    };
    let mut line = String::new();
    if read_line(&mut line).is_none() {
        return;
    }
    // Drain the headers.
    let mut h = String::new();
    while read_line(&mut h).is_some_and(|n| n > 2) {
        if h.len() > 64 * 1024 {
            return;
        }
        h.clear();
    }
    let ok = line.starts_with("GET /metrics ") || line.starts_with("GET / ");
    let (status, body) = if ok { ("200 OK", metrics.render()) } else { ("404 Not Found", "try /metrics\n".to_string()) };
    let _ = conn.set_write_timeout(Some(REQUEST_DEADLINE));
    let mut w = &conn;
    let _ = write!(
        w,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// A running endpoint; stops when dropped.
pub struct Server {
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        s
    }

    /// Idle connections do not delay a scrape: ten connections that send nothing are open
    /// while a real scrape is answered at once (#19: they were served one by one, each holding
    /// the endpoint for its read timeout).
    #[test]
    fn idle_connections_do_not_delay_a_scrape() {
        let m = Metrics::new(0);
        let server = serve(m, "127.0.0.1:0").unwrap();
        let idle: Vec<std::net::TcpStream> = (0..10).map(|_| std::net::TcpStream::connect(server.addr).unwrap()).collect();
        std::thread::sleep(std::time::Duration::from_millis(100));
        let t = std::time::Instant::now();
        let resp = get(server.addr, "/metrics");
        assert!(resp.starts_with("HTTP/1.1 200 OK"), "{resp}");
        assert!(t.elapsed() < std::time::Duration::from_millis(1500), "{:?}", t.elapsed());
        drop(idle);
    }

    /// The endpoint answers over real TCP in the exposition format: HELP and TYPE lines, then
    /// `name{rank="N"} value` samples that parse as numbers.
    #[test]
    fn endpoint_serves_the_exposition_format() {
        let m = Metrics::new(3);
        m.step.set(7.0);
        m.loss.set(1.25);
        m.comm_bytes_total.add(1e6);
        m.comm_bytes_total.add(5e5);
        let server = serve(m.clone(), "127.0.0.1:0").unwrap();
        let resp = get(server.addr, "/metrics");
        assert!(resp.starts_with("HTTP/1.1 200 OK\r\n") && resp.contains("text/plain; version=0.0.4"), "{resp}");
        let body = resp.split("\r\n\r\n").nth(1).unwrap();
        let mut samples = 0;
        for line in body.lines() {
            if line.starts_with('#') {
                assert!(line.starts_with("# HELP kolo_") || line.starts_with("# TYPE kolo_"), "{line}");
                continue;
            }
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.ends_with("{rank=\"3\"}"), "{line}");
            value.parse::<f64>().unwrap();
            samples += 1;
        }
        assert_eq!(samples, 11);
        assert!(body.contains("kolo_step{rank=\"3\"} 7\n") && body.contains("kolo_comm_bytes_total{rank=\"3\"} 1500000\n"), "{body}");
        assert!(get(server.addr, "/nope").starts_with("HTTP/1.1 404"));
        drop(server);
    }
}
