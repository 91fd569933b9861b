//! Connections in their authentication handshake, shared by every Kolo listener (the store, the
//! parameter servers, federated averaging, IMPALA's learner): a bounded number at once, the
//! oldest evicted when a new one arrives at the bound, and one deadline for a whole handshake.
//! Issue #34: 70 connections sending a byte every 5 s kept a rank from joining for ~98 s (the
//! deadline was per read, and new connections were turned away while they held every slot).

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The connections in their handshake, oldest first, and how many there are.
pub struct Handshakes {
    limit: usize,
    count: AtomicUsize,
    pending: Mutex<VecDeque<(u64, TcpStream)>>,
}

impl Handshakes {
    /// At most `limit` handshakes before the oldest is evicted for a new one; never more than
    /// twice `limit` at once (evicted ones may take a moment to end).
    pub fn new(limit: usize) -> Handshakes {
        Handshakes { limit, count: AtomicUsize::new(0), pending: Mutex::new(VecDeque::new()) }
    }

    /// Admits connection `id` (a copy of its stream is kept to evict it): at the limit the oldest
    /// handshake is cut first. `false`: too many are still ending; close this one.
    pub fn admit(&self, id: u64, stream: &TcpStream) -> bool {
        if self.count.load(Ordering::SeqCst) >= self.limit {
            let oldest = self.lock().pop_front();
            if let Some((_, c)) = oldest {
                let _ = c.shutdown(Shutdown::Both);
            }
        }
        if self.count.load(Ordering::SeqCst) >= 2 * self.limit {
            return false;
        }
        if let Ok(c) = stream.try_clone() {
            self.lock().push_back((id, c));
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// The handshake of connection `id` ended, either way (call it exactly once per admitted
    /// connection).
    pub fn done(&self, id: u64) {
        self.lock().retain(|(i, _)| *i != id);
        self.count.fetch_sub(1, Ordering::SeqCst);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, TcpStream)>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A stream whose reads share one deadline: each read may take only what is left of it.
pub struct WholeDeadline<'a> {
    stream: &'a mut TcpStream,
    deadline: Instant,
    budget: Duration,
}

impl<'a> WholeDeadline<'a> {
    /// Reads of `stream` that must all be done within `budget` from now.
    pub fn new(stream: &'a mut TcpStream, budget: Duration) -> WholeDeadline<'a> {
        WholeDeadline { stream, deadline: Instant::now() + budget, budget }
    }
}

impl Read for WholeDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, format!("the handshake took longer than {:?}", self.budget)));
        }
        self.stream.set_read_timeout(Some(left))?;
        self.stream.read(buf)
    }
}

impl Write for WholeDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}
