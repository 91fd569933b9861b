//! Shared-memory links for ranks on the same host: one mapping per pair of ranks holding two
//! single-producer single-consumer byte rings (one per direction).
//!
//! ```text
//! ring:  [ head: u64 (writer) | pad ][ tail: u64 (reader) | pad ][ closed | pad ][ data: capacity bytes ]
//! ```
//! `head` and `tail` only grow; `head - tail` bytes are readable. The writer publishes data with a
//! release store of `head`, the reader frees space with a release store of `tail`. Each side caches
//! the other's counter and re-reads it only when it runs out, so the cache line holding it moves
//! between cores once per refill instead of once per copy.
//!
//! The mapping lives in a file under /dev/shm (mode 0600) that the lower rank creates and unlinks
//! as soon as the peer has mapped it, so nothing is left behind when a process dies. The peer's
//! counters are read from memory it can write: each read is bound-checked against ours (the
//! peer can neither have read what we never wrote nor published more than the ring holds), so a
//! corrupt or hostile peer gets an error, never an out-of-bounds copy. The TCP connection the
//! pair already has stays open as a liveness channel: it carries no data, so it becoming readable
//! or closed means the peer is gone.

use std::fs::OpenOptions;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU64, Ordering};

const LINE: usize = 128;
const RING_HEADER: usize = 3 * LINE;

/// The ring size actually used for a requested one: whole cache lines, so that the second
/// ring's header (after the first ring's data) stays aligned for its atomics.
pub(crate) fn ring_capacity(requested: usize) -> usize {
    requested.max(LINE).div_ceil(LINE) * LINE
}

pub(crate) fn region_len(capacity: usize) -> usize {
    let capacity = ring_capacity(capacity);
    2 * (RING_HEADER + capacity)
}

struct Ring {
    base: *mut u8,
    capacity: usize,
    /// Our cached copy of the other side's counter.
    cached: u64,
    /// Our own counter (we are its only writer).
    mine: u64,
}

impl Ring {
    fn head(&self) -> &AtomicU64 {
        // SAFETY: `base` points at a live, 128-aligned ring header inside the mapping, which
        // outlives this Ring; AtomicU64 has the same layout as u64.
        unsafe { &*(self.base as *const AtomicU64) }
    }
    fn tail(&self) -> &AtomicU64 {
        // SAFETY: as above, one cache line further.
        unsafe { &*(self.base.add(LINE) as *const AtomicU64) }
    }
    fn closed(&self) -> &AtomicU64 {
        // SAFETY: as above.
        unsafe { &*(self.base.add(2 * LINE) as *const AtomicU64) }
    }
    fn data(&self) -> *mut u8 {
        // SAFETY: the data area follows the header inside the mapping.
        unsafe { self.base.add(RING_HEADER) }
    }

    /// The reader's `tail`, checked: within the last `capacity` bytes we wrote.
    fn peer_tail(&self) -> io::Result<u64> {
        let t = self.tail().load(Ordering::Acquire);
        if t > self.mine || self.mine - t > self.capacity as u64 {
            return Err(corrupt(format!("the peer's read counter is {t}, this side has written {}", self.mine)));
        }
        Ok(t)
    }

    /// The writer's `head`, checked: at most `capacity` bytes ahead of what we read.
    fn peer_head(&self) -> io::Result<u64> {
        let h = self.head().load(Ordering::Acquire);
        if h < self.mine || h - self.mine > self.capacity as u64 {
            return Err(corrupt(format!("the peer's write counter is {h}, this side has read {}", self.mine)));
        }
        Ok(h)
    }

    /// Writer: copies as much of `src` as fits; returns bytes written.
    fn push(&mut self, src: &[u8]) -> io::Result<usize> {
        let cap = self.capacity as u64;
        let mut free = cap - (self.mine - self.cached);
        if free < src.len() as u64 {
            self.cached = self.peer_tail()?;
            free = cap - (self.mine - self.cached);
        }
        let n = (free as usize).min(src.len());
        if n == 0 {
            return Ok(0);
        }
        let pos = (self.mine % cap) as usize;
        let first = n.min(self.capacity - pos);
        // SAFETY: [pos, pos+first) and [0, n-first) lie inside the data area; the reader does not
        // touch bytes between tail and tail+capacity that are past head, which is where we write.
        unsafe {
            crate::copy::copy(self.data().add(pos), src.as_ptr(), first);
            crate::copy::copy(self.data(), src.as_ptr().add(first), n - first);
        }
        self.mine += n as u64;
        self.head().store(self.mine, Ordering::Release);
        Ok(n)
    }

    /// Reader: copies up to `dst.len()` available bytes; returns bytes read.
    fn pop(&mut self, dst: &mut [u8]) -> io::Result<usize> {
        let cap = self.capacity as u64;
        let mut avail = self.cached - self.mine;
        if avail < dst.len() as u64 {
            self.cached = self.peer_head()?;
            avail = self.cached - self.mine;
        }
        let n = (avail as usize).min(dst.len());
        if n == 0 {
            return Ok(0);
        }
        let pos = (self.mine % cap) as usize;
        let first = n.min(self.capacity - pos);
        // SAFETY: the bytes [tail, tail+n) were published by the writer's release store of head,
        // which our acquire load observed; the writer will not overwrite them until we advance tail.
        unsafe {
            crate::copy::copy(dst.as_mut_ptr(), self.data().add(pos), first);
            crate::copy::copy(dst.as_mut_ptr().add(first), self.data(), n - first);
        }
        self.mine += n as u64;
        self.tail().store(self.mine, Ordering::Release);
        Ok(n)
    }
}

impl Ring {
    /// Reader: folds up to `dst.len()` bytes (whole elements only) straight from the ring into
    /// `dst` with `f(dst_chunk, ring_chunk)`, without an intermediate copy. A partial element at
    /// the end of the published data stays in the ring until the rest arrives.
    fn pop_fold(&mut self, dst: &mut [u8], esz: usize, f: &mut dyn FnMut(&mut [u8], &[u8])) -> io::Result<usize> {
        let cap = self.capacity as u64;
        self.cached = self.peer_head()?;
        let mut done = 0;
        while done < dst.len() {
            let avail = (self.cached - self.mine) as usize;
            if avail < esz {
                break;
            }
            let pos = (self.mine % cap) as usize;
            let contiguous = avail.min(self.capacity - pos).min(dst.len() - done);
            let whole = contiguous / esz * esz;
            if whole > 0 {
                // SAFETY: [pos, pos+whole) was published by the writer (acquire load above) and
                // lies inside the data area; the writer does not touch it until tail moves.
                let src = unsafe { std::slice::from_raw_parts(self.data().add(pos), whole) };
                f(&mut dst[done..done + whole], src);
                done += whole;
                self.mine += whole as u64;
            } else {
                // One element straddles the end of the ring: assemble it from both parts.
                let mut tmp = [0u8; 8];
                let first = self.capacity - pos;
                // SAFETY: `esz <= avail` bytes are published; the two parts are in bounds.
                unsafe {
                    std::ptr::copy_nonoverlapping(self.data().add(pos), tmp.as_mut_ptr(), first);
                    std::ptr::copy_nonoverlapping(self.data(), tmp.as_mut_ptr().add(first), esz - first);
                }
                f(&mut dst[done..done + esz], &tmp[..esz]);
                done += esz;
                self.mine += esz as u64;
            }
        }
        if done > 0 {
            self.tail().store(self.mine, Ordering::Release);
        }
        Ok(done)
    }
}

fn corrupt(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("shared-memory ring corrupted: {what}"))
}

pub(crate) struct ShmLink {
    _map: memmap2::MmapMut,
    tx: Ring,
    rx: Ring,
    liveness: TcpStream,
}

// SAFETY: the raw pointers point into `_map`, which the link owns; a link is used by one thread
// at a time (the communicator's lock), and cross-process sharing is synchronised by the atomics.
unsafe impl Send for ShmLink {}

impl ShmLink {
    /// Creates the mapping file (exclusive) and maps it. `lower` is true on the rank that created
    /// it; it writes into ring 0 and reads ring 1.
    pub fn create(path: &str, capacity: usize) -> io::Result<memmap2::MmapMut> {
        let f = OpenOptions::new().read(true).write(true).create_new(true).mode(0o600).open(path)?;
        f.set_len(region_len(capacity) as u64)?;
        // SAFETY: the file is ours and sized above; the mapping is shared with exactly one peer
        // through the ring protocol.
        unsafe { memmap2::MmapMut::map_mut(&f) }
    }

    pub fn open(path: &str, capacity: usize) -> io::Result<memmap2::MmapMut> {
        let f = OpenOptions::new().read(true).write(true).open(path)?;
        if f.metadata()?.len() != region_len(capacity) as u64 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "shared-memory file has the wrong size"));
        }
        // SAFETY: as in create.
        unsafe { memmap2::MmapMut::map_mut(&f) }
    }

    pub fn new(mut map: memmap2::MmapMut, capacity: usize, lower: bool, liveness: TcpStream) -> io::Result<ShmLink> {
        liveness.set_nonblocking(true)?;
        let capacity = ring_capacity(capacity);
        if map.len() < region_len(capacity) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "shared-memory mapping is too small"));
        }
        let base = map.as_mut_ptr();
        let ring = |i: usize| Ring {
            // SAFETY: both rings lie inside the mapping (region_len).
            base: unsafe { base.add(i * (RING_HEADER + capacity)) },
            capacity,
            cached: 0,
            mine: 0,
        };
        let (tx, rx) = if lower { (ring(0), ring(1)) } else { (ring(1), ring(0)) };
        Ok(ShmLink { _map: map, tx, rx, liveness })
    }

    pub fn write_some(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        self.check_open()?;
        let n = self.tx.push(a)?;
        if n < a.len() {
            return Ok(n);
        }
        Ok(n + self.tx.push(b)?)
    }

    pub fn read_some(&mut self, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
        let n = self.rx.pop(a)?;
        let n = if n < a.len() { n } else { n + self.rx.pop(b)? };
        if n == 0 {
            self.check_open()?;
        }
        Ok(n)
    }

    /// Folds arriving payload bytes straight into `dst` (see `Ring::pop_fold`).
    pub fn read_fold(&mut self, dst: &mut [u8], esz: usize, f: &mut dyn FnMut(&mut [u8], &[u8])) -> io::Result<usize> {
        let n = self.rx.pop_fold(dst, esz, f)?;
        if n == 0 {
            self.check_open()?;
        }
        Ok(n)
    }

    fn check_open(&self) -> io::Result<()> {
        if self.rx.closed().load(Ordering::Acquire) != 0 || self.tx.closed().load(Ordering::Acquire) != 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the shared-memory link"));
        }
        Ok(())
    }

    pub fn liveness_fd(&self) -> RawFd {
        self.liveness.as_raw_fd()
    }

    pub fn shutdown(&self) {
        self.tx.closed().store(1, Ordering::Release);
        let _ = self.liveness.shutdown(std::net::Shutdown::Both);
    }
}
