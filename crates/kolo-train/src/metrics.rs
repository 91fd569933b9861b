//! Training metrics per rank, served in the OpenMetrics text format (which Prometheus scrapes)
//! by a small HTTP endpoint (`[train] metrics_port`): step, loss, step time, throughput,
//! gradient bytes and wait, skipped steps, heap, peak RSS and the straggler.
//!
//! The registry and its text encoding are `prometheus-client`'s. The endpoint is hand-written:
//! the crate has no server, and `metrics-exporter-prometheus` brings an async HTTP stack
//! (tokio, hyper) into a static binary for one plain-text GET; this is a listener thread with a
//! bound on concurrent scrapes and a read deadline per request.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// A gauge of f64 values.
pub type F64Gauge = Gauge<f64, AtomicU64>;
/// A monotonic f64 counter (exposed with the `_total` suffix).
pub type F64Counter = Counter<f64, AtomicU64>;

/// The metrics of one rank (every series labelled `rank`).
pub struct Metrics {
    pub rank: usize,
    pub step: F64Gauge,
    pub loss: F64Gauge,
    pub step_seconds: F64Gauge,
    pub samples_per_second: F64Gauge,
    pub comm_bytes: F64Counter,
    pub comm_wait_seconds: F64Counter,
    pub skipped_steps: F64Counter,
    pub heap_bytes: F64Gauge,
    pub peak_rss_bytes: F64Gauge,
    pub straggler_rank: F64Gauge,
    pub straggler_lag_seconds: F64Gauge,
    registry: Registry,
}

impl Metrics {
    pub fn new(rank: usize) -> Arc<Metrics> {
        let mut registry = Registry::with_labels([("rank".into(), rank.to_string().into())].into_iter());
        let g = |registry: &mut Registry, name: &str, help: &str| {
            let m = F64Gauge::default();
            registry.register(name, help, m.clone());
            m
        };
        let c = |registry: &mut Registry, name: &str, help: &str| {
            let m = F64Counter::default();
            registry.register(name, help, m.clone());
            m
        };
        let r = &mut registry;
        let m = Metrics {
            rank,
            step: g(r, "kolo_step", "Optimizer steps done"),
            loss: g(r, "kolo_loss", "Training loss averaged over ranks at the last logged step"),
            step_seconds: g(r, "kolo_step_seconds", "Wall time of the last step on this rank"),
            samples_per_second: g(r, "kolo_samples_per_second", "Global training throughput over the last log window"),
            comm_bytes: c(r, "kolo_comm_bytes", "Bytes this rank handed to gradient collectives"),
            comm_wait_seconds: c(r, "kolo_comm_wait_seconds", "Time waiting for gradient collectives after backward"),
            skipped_steps: c(r, "kolo_skipped_steps", "Steps skipped because f16 gradients overflowed"),
            heap_bytes: g(r, "kolo_heap_bytes", "Live heap bytes after the last step (counting allocator)"),
            peak_rss_bytes: g(r, "kolo_peak_rss_bytes", "Peak resident set size of the process"),
            straggler_rank: g(r, "kolo_straggler_rank", "The rank with the slowest own work per step over the last log window"),
            straggler_lag_seconds: g(r, "kolo_straggler_lag_seconds", "How far that rank's own work per step is behind the median rank's"),
            registry,
        };
        Arc::new(m)
    }

    /// Raises `counter` to `total` (a running total counted elsewhere, such as the loss
    /// scaler's skipped steps); a counter never goes down.
    pub fn raise_to(counter: &F64Counter, total: f64) {
        let now = counter.get();
        if total > now {
            counter.inc_by(total - now);
        }
    }

    /// The exposition text (OpenMetrics).
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String does not fail");
        out
    }
}

/// The exposition format's content type.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Scrapes answered at once. A connection beyond them evicts the oldest one still sending its
/// request (an idle or trickling client); a scrape whose request arrives takes microseconds, so
/// trickling clients cannot keep real scrapes out. Handlers never exceed twice this.
const MAX_SCRAPES: usize = 16;
/// The whole request (request line and headers) must arrive within this.
const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(2);
/// The most a request (request line and headers) may hold; more is not read.
const MAX_REQUEST: u64 = 16 * 1024;

/// The connections still sending their request, oldest first, by handler number.
type Pending = Arc<std::sync::Mutex<std::collections::VecDeque<(u64, std::net::TcpStream)>>>;

/// Serves `metrics` at `http://addr/metrics` on a background thread until the returned guard
/// is dropped. Each scrape runs on its own short-lived thread under a total read deadline and a
/// size limit, so idle, trickling or flooding connections cannot delay the others or grow the
/// process (issues #19 and #34: ten idle connections delayed a scrape by 19 s; one connection
/// sending 1.5 GB without a newline grew rank 0 by 1.5 GB).
pub fn serve(metrics: Arc<Metrics>, addr: &str) -> std::io::Result<Server> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let active = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let pending: Pending = Arc::default();
    let thread = std::thread::Builder::new().name("kolo-metrics".into()).spawn(move || {
        let mut next_id = 0u64;
        while !s.load(Relaxed) {
            match listener.accept() {
                Ok((conn, _)) => {
                    if active.load(Relaxed) >= MAX_SCRAPES {
                        // Evict the oldest connection still sending its request.
                        let oldest = pending.lock().unwrap_or_else(|p| p.into_inner()).pop_front();
                        if let Some((_, c)) = oldest {
                            let _ = c.shutdown(std::net::Shutdown::Both);
                        }
                    }
                    if active.load(Relaxed) >= 2 * MAX_SCRAPES {
                        continue; // closed by the drop
                    }
                    let (id, watch) = (next_id, conn.try_clone());
                    next_id += 1;
                    if let Ok(w) = watch {
                        pending.lock().unwrap_or_else(|p| p.into_inner()).push_back((id, w));
                    }
                    active.fetch_add(1, Relaxed);
                    let (metrics, active2, pending2) = (metrics.clone(), active.clone(), pending.clone());
                    let spawned = std::thread::Builder::new().name("kolo-scrape".into()).spawn(move || {
                        let done_reading = || pending2.lock().unwrap_or_else(|p| p.into_inner()).retain(|(i, _)| *i != id);
                        answer(conn, &metrics, &done_reading);
                        done_reading();
                        active2.fetch_sub(1, Relaxed);
                    });
                    if spawned.is_err() {
                        active.fetch_sub(1, Relaxed);
                        pending.lock().unwrap_or_else(|p| p.into_inner()).retain(|(i, _)| *i != id);
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
/// [`MAX_REQUEST`] bytes, tells `done_reading`, and answers it.
fn answer(conn: std::net::TcpStream, metrics: &Metrics, done_reading: &dyn Fn()) {
    let deadline = std::time::Instant::now() + REQUEST_DEADLINE;
    let _ = conn.set_nonblocking(false);
    let mut r = BufReader::new(Read::take(&conn, MAX_REQUEST));
    let mut read_line = |buf: &mut String| -> Option<usize> {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || conn.set_read_timeout(Some(left)).is_err() {
            return None;
        }
        r.read_line(buf).ok().filter(|n| *n > 0 && buf.ends_with('\n'))
    };
    let mut line = String::new();
    if read_line(&mut line).is_none() {
        return;
    }
    // Drain the headers, up to the blank line.
    let mut h = String::new();
    loop {
        match read_line(&mut h) {
            Some(n) if n > 2 => h.clear(),
            Some(_) => break,
            None => return, // cut short, too long or too slow: no answer
        }
    }
    done_reading();
    let ok = line.starts_with("GET /metrics ") || line.starts_with("GET / ");
    let (status, body) = if ok { ("200 OK", metrics.render()) } else { ("404 Not Found", "try /metrics\n".to_string()) };
    let _ = conn.set_write_timeout(Some(REQUEST_DEADLINE));
    let mut w = &conn;
    let _ =
        write!(w, "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
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

    /// Trickling clients cannot keep scrapes out (issue #34: 16 connections sending a byte a
    /// second made every scrape fail): with every handler taken by one, a scrape evicts the
    /// oldest and is answered.
    #[test]
    fn trickling_connections_do_not_keep_a_scrape_out() {
        let server = serve(Metrics::new(0), "127.0.0.1:0").unwrap();
        let trickle: Vec<std::net::TcpStream> = (0..2 * MAX_SCRAPES)
            .map(|_| {
                let mut c = std::net::TcpStream::connect(server.addr).unwrap();
                c.write_all(b"G").unwrap();
                c
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        for _ in 0..3 {
            let resp = get(server.addr, "/metrics");
            assert!(resp.starts_with("HTTP/1.1 200 OK"), "a scrape was refused: {resp:?}");
        }
        drop(trickle);
    }

    /// A request that never ends its line is read no further than [`MAX_REQUEST`] bytes (issue
    /// #34: 1.5 GB without a newline grew the process by as much): the server stops reading and
    /// closes, so the sender's writes fail long before 64 MiB.
    #[test]
    fn an_endless_request_line_is_cut_off() {
        let server = serve(Metrics::new(0), "127.0.0.1:0").unwrap();
        let mut c = std::net::TcpStream::connect(server.addr).unwrap();
        c.set_write_timeout(Some(std::time::Duration::from_secs(10))).unwrap();
        let chunk = vec![b'a'; 1 << 20];
        let mut sent = 0usize;
        while sent < 64 << 20 {
            match c.write(&chunk) {
                Ok(n) => sent += n,
                Err(_) => break,
            }
        }
        assert!(sent < 64 << 20, "the server read {sent} bytes of one request line");
    }

    /// The endpoint answers over real TCP in the OpenMetrics format: HELP and TYPE lines, then
    /// `name{rank="N"} value` samples that parse as numbers, counters with `_total`, `# EOF`.
    #[test]
    fn endpoint_serves_the_exposition_format() {
        let m = Metrics::new(3);
        m.step.set(7.0);
        m.loss.set(1.25);
        m.comm_bytes.inc_by(1e6);
        m.comm_bytes.inc_by(5e5);
        Metrics::raise_to(&m.skipped_steps, 2.0);
        Metrics::raise_to(&m.skipped_steps, 1.0);
        let server = serve(m.clone(), "127.0.0.1:0").unwrap();
        let resp = get(server.addr, "/metrics");
        assert!(resp.starts_with("HTTP/1.1 200 OK\r\n") && resp.contains(CONTENT_TYPE), "{resp}");
        let body = resp.split("\r\n\r\n").nth(1).unwrap();
        assert!(body.ends_with("# EOF\n"), "{body}");
        let mut samples = 0;
        for line in body.lines() {
            if line.starts_with('#') {
                assert!(line.starts_with("# HELP kolo_") || line.starts_with("# TYPE kolo_") || line == "# EOF", "{line}");
                continue;
            }
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.ends_with("{rank=\"3\"}"), "{line}");
            value.parse::<f64>().unwrap();
            samples += 1;
        }
        assert_eq!(samples, 11);
        assert!(body.contains("# HELP kolo_step Optimizer steps done.\n"), "{body}");
        for want in
            ["kolo_step{rank=\"3\"} 7.0\n", "kolo_comm_bytes_total{rank=\"3\"} 1500000.0\n", "kolo_skipped_steps_total{rank=\"3\"} 2.0\n"]
        {
            assert!(body.contains(want), "{want}: {body}");
        }
        assert!(get(server.addr, "/nope").starts_with("HTTP/1.1 404"));
        drop(server);
    }
}
