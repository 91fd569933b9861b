//! A `Link` is a byte pipe to one peer with non-blocking, vectored reads and writes. The progress
//! engine drives many links at once; links never block and never allocate.

use crate::shm::ShmLink;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};

pub(crate) enum Link {
    Tcp(TcpLink),
    Shm(ShmLink),
}

impl Link {
    /// Writes from `a` then `b`; returns bytes taken (0 if the link is full).
    pub fn write_some(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(t) => t.write_some(a, b),
            Link::Shm(s) => s.write_some(a, b),
        }
    }

    /// Reads into `a` then `b`; returns bytes read (0 if nothing is there yet). End of stream is
    /// an `UnexpectedEof` error: a peer never closes a link in the middle of a job.
    pub fn read_some(&mut self, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(t) => t.read_some(a, b),
            Link::Shm(s) => s.read_some(a, b),
        }
    }

    /// The socket to poll: the data socket for TCP, the companion (liveness) socket for shm.
    pub fn fd(&self) -> RawFd {
        match self {
            Link::Tcp(t) => t.fd,
            Link::Shm(s) => s.liveness_fd(),
        }
    }

    pub fn is_shm(&self) -> bool {
        matches!(self, Link::Shm(_))
    }

    /// Closes the connection so that the peer notices at once (used when a communicator breaks,
    /// to spread the failure instead of letting peers wait for their deadline).
    pub fn shutdown(&self) {
        match self {
            Link::Tcp(t) => {
                let _ = t.stream.shutdown(std::net::Shutdown::Both);
            }
            Link::Shm(s) => s.shutdown(),
        }
    }
}

pub(crate) struct TcpLink {
    pub stream: TcpStream,
    fd: RawFd,
}

/// Dead-peer detection below the collective deadline, for a peer whose host vanished or whose
/// network was cut (no FIN, no RST): an idle link is probed after 5 s of silence, every 1 s,
/// and fails after 5 unanswered probes (about 10 s), so the next collective on it fails at once
/// naming the peer. A peer that is alive but slow (stopped, swapping) keeps answering probes at
/// the kernel level: that is left to the collective deadline and its hang diagnosis. Not set:
/// TCP_USER_TIMEOUT, which also closes a connection whose receiver's window stays full that
/// long (a straggler that is not reading yet), and would fail healthy jobs.
pub(crate) const KEEPALIVE: [(libc::c_int, libc::c_int, libc::c_int); 4] = [
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 5),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 1),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 5),
];

fn set_int_option(fd: RawFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> io::Result<()> {
    // SAFETY: setsockopt on our own socket with a valid int option value.
    let rc = unsafe {
        libc::setsockopt(fd, level, opt, (&v as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t)
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads of at least this many bytes turn on TCP_QUICKACK (small ones keep the delayed ACK:
/// one syscall less per message where latency, not the window, bounds the time).
const QUICKACK_AFTER: usize = 32 << 10;

impl TcpLink {
    pub fn new(stream: TcpStream, buffer: usize) -> io::Result<TcpLink> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        let fd = stream.as_raw_fd();
        if buffer > 0 {
            for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
                // A size the kernel refuses keeps its default: not worth failing the job.
                let _ = set_int_option(fd, libc::SOL_SOCKET, opt, buffer as libc::c_int);
            }
        }
        for (level, opt, v) in KEEPALIVE {
            set_int_option(fd, level, opt, v)?;
        }
        Ok(TcpLink { stream, fd })
    }

    pub fn write_some(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        if a.is_empty() && b.is_empty() {
            return Ok(0);
        }
        let iov = [
            libc::iovec { iov_base: a.as_ptr() as *mut _, iov_len: a.len() },
            libc::iovec { iov_base: b.as_ptr() as *mut _, iov_len: b.len() },
        ];
        // SAFETY: a zeroed msghdr is valid; it points at two iovecs that live across the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut _;
        msg.msg_iovlen = 2;
        loop {
            // SAFETY: fd is an open socket owned by `stream`; msg is valid for the call.
            let n = unsafe { libc::sendmsg(self.fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => return Ok(0),
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
    }

    pub fn read_some(&mut self, a: &mut [u8], b: &mut [u8]) -> io::Result<usize> {
        if a.is_empty() && b.is_empty() {
            return Ok(0);
        }
        let iov = [
            libc::iovec { iov_base: a.as_mut_ptr().cast(), iov_len: a.len() },
            libc::iovec { iov_base: b.as_mut_ptr().cast(), iov_len: b.len() },
        ];
        // SAFETY: as in write_some; the iovecs point at writable buffers that outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_ptr() as *mut _;
        msg.msg_iovlen = 2;
        loop {
            // SAFETY: see above.
            let n = unsafe { libc::recvmsg(self.fd, &mut msg, libc::MSG_DONTWAIT) };
            if n > 0 {
                if n as usize >= QUICKACK_AFTER {
                    // Acknowledge at once: a bulk sender's window opens without waiting for
                    // the delayed ACK (Linux clears the flag again on its own).
                    let _ = set_int_option(self.fd, libc::IPPROTO_TCP, libc::TCP_QUICKACK, 1);
                }
                return Ok(n as usize);
            }
            if n == 0 {
                return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection"));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => return Ok(0),
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
    }
}
