//! Engine-level tests: what a rank does with bytes that are not what it expects.

use crate::engine::{drive, Dir, OpCtx, Xfer};
use crate::frame::{Header, HEADER_LEN};
use crate::link::{Link, TcpLink};
use kolo_base::{DType, Deadline, Rank};
use kolo_comm::{CommError, OpKind, ReduceOp};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

fn pair() -> (TcpStream, Link) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, Link::Tcp(TcpLink::new(b, 0).unwrap()))
}

fn ctx() -> OpCtx {
    OpCtx {
        op: OpKind::AllReduce,
        rank: Rank(0),
        seq: 3,
        deadline: Deadline::after(Duration::from_secs(5)),
        spin: Duration::from_micros(50),
        pure_spin: Duration::from_micros(20),
        red: Some(ReduceOp::Sum),
        root: None,
        pace: 0,
    }
}

fn expect(len: usize) -> Header {
    Header {
        op: OpKind::AllReduce,
        dtype: Some(DType::F32),
        alg: 1,
        seq: 3,
        step: 0,
        tag: 0,
        len: len as u64,
        red: Some(ReduceOp::Sum),
        root: None,
    }
}

fn recv_with(bytes: &[u8], close: bool) -> CommError {
    let (mut peer, link) = pair();
    peer.write_all(bytes).unwrap();
    if close {
        drop(peer);
    } else {
        std::mem::forget(peer);
    }
    let mut links = vec![None, Some(link)];
    let mut dst = vec![0u8; 16];
    let mut tmp = vec![0u8; 64];
    let mut x = [Xfer::new(1, expect(16), Dir::RecvReduce { tmp: &mut tmp, dst: &mut dst, op: ReduceOp::Sum, dtype: DType::F32 })];
    drive(&mut links, &mut x, &ctx(), None).unwrap_err()
}

#[test]
fn garbage_header_is_a_protocol_error() {
    let e = recv_with(&[0xAB; HEADER_LEN + 16], false);
    assert!(matches!(e, CommError::Protocol { peer: Rank(1), .. }), "{e}");
    assert!(e.to_string().contains("bad magic"), "{e}");
}

#[test]
fn corrupted_header_is_caught_by_its_checksum() {
    let mut h = expect(16).encode();
    h[20] ^= 1; // flip a bit of the tag
    let mut bytes = h.to_vec();
    bytes.extend_from_slice(&[0; 16]);
    let e = recv_with(&bytes, false);
    assert!(e.to_string().contains("checksum"), "{e}");
}

#[test]
fn different_collective_is_a_mismatch_naming_both() {
    let other = Header { op: OpKind::Broadcast, ..expect(16) };
    let mut bytes = other.encode().to_vec();
    bytes.extend_from_slice(&[0; 16]);
    let e = recv_with(&bytes, false);
    assert!(matches!(e, CommError::Mismatch { .. }), "{e}");
    let m = e.to_string();
    assert!(m.contains("expected all_reduce sum #3") && m.contains("sent broadcast sum #3"), "{m}");
}

#[test]
fn truncated_message_then_close_is_peer_lost() {
    let mut bytes = expect(16).encode().to_vec();
    bytes.extend_from_slice(&[0; 7]);
    let e = recv_with(&bytes, true);
    assert!(matches!(e, CommError::PeerLost { peer: Rank(1), .. }), "{e}");
}

/// A peer that trickles its message (a byte every 20 ms, 64 bytes of payload: 1.3 s) cannot
/// stretch the receive past its 300 ms deadline: the deadline is the operation's, not a read's.
/// The spin interval is set longer than the gaps, so the engine never goes idle: a deadline
/// checked only when idle (as before) let the trickle run to the end.
#[test]
fn a_trickling_peer_times_out_at_the_deadline() {
    let (mut peer, link) = pair();
    let mut bytes = expect(64).encode().to_vec();
    bytes.extend_from_slice(&[0; 64]);
    let trickle = std::thread::spawn(move || {
        for b in bytes {
            if peer.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let mut links = vec![None, Some(link)];
    let mut dst = vec![0u8; 64];
    let c = OpCtx { deadline: Deadline::after(Duration::from_millis(300)), spin: Duration::from_secs(10), ..ctx() };
    let t0 = std::time::Instant::now();
    let mut x = [Xfer::new(1, expect(64), Dir::Recv(&mut dst))];
    let e = drive(&mut links, &mut x, &c, None).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(&e, CommError::Timeout { missing, .. } if missing == &vec![Rank(1)]), "{e}");
    assert!(took < Duration::from_millis(900), "timed out after {took:?}");
    drop(links);
    trickle.join().unwrap();
}

#[test]
fn silence_times_out_naming_the_peer() {
    let (peer, link) = pair();
    let mut links = vec![None, Some(link)];
    let mut dst = vec![0u8; 4];
    let c = OpCtx { deadline: Deadline::after(Duration::from_millis(100)), ..ctx() };
    let mut x = [Xfer::new(1, expect(4), Dir::Recv(&mut dst))];
    let e = drive(&mut links, &mut x, &c, None).unwrap_err();
    assert!(matches!(&e, CommError::Timeout { missing, .. } if missing == &vec![Rank(1)]), "{e}");
    drop(peer);
}

#[test]
fn shm_fold_handles_elements_split_across_the_ring_end() {
    use crate::shm::ShmLink;
    let path = format!("/dev/shm/kolo-test-fold-{}", std::process::id());
    let _ = std::fs::remove_file(&path);
    let (ma, mb) = (ShmLink::create(&path, 128).unwrap(), ShmLink::open(&path, 128).unwrap());
    std::fs::remove_file(&path).unwrap();
    let (s1, l) = pair();
    let Link::Tcp(t) = l else { unreachable!() };
    let mut a = ShmLink::new(ma, 128, true, s1).unwrap();
    let mut b = ShmLink::new(mb, 128, false, t.stream).unwrap();
    // Move the ring position to 124, so the next 8-byte element straddles the end (128).
    let mut sink = vec![0u8; 124];
    assert_eq!(a.write_some(&[7u8; 124], &[]).unwrap(), 124);
    assert_eq!(b.read_some(&mut sink, &mut []).unwrap(), 124);
    let vals: Vec<u8> = [1.5f64, 2.5].iter().flat_map(|v| v.to_le_bytes()).collect();
    // Publish 12 bytes first: one whole element (straddling) and half of the next.
    assert_eq!(a.write_some(&vals[..12], &[]).unwrap(), 12);
    let mut dst: Vec<u8> = [10.0f64, 20.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut add = |d: &mut [u8], s: &[u8]| kolo_comm::reduce::reduce_into(DType::F64, ReduceOp::Sum, d, s);
    assert_eq!(b.read_fold(&mut dst, 8, &mut add).unwrap(), 8, "only the whole element is taken");
    assert_eq!(a.write_some(&vals[12..], &[]).unwrap(), 4);
    assert_eq!(b.read_fold(&mut dst[8..], 8, &mut add).unwrap(), 8);
    let got: Vec<f64> = dst.chunks(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(got, vec![11.5, 22.5]);
}

/// A shared-memory peer that writes impossible counters into the mapping (issue #19) gets an
/// error on both sides of the ring, never an out-of-bounds copy; the segment is private to the
/// user (mode 0600).
#[test]
fn corrupt_shared_memory_counters_are_refused() {
    use crate::shm::ShmLink;
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::temp_dir().join(format!("kolo-shm-test-{}", std::process::id()));
    let path = path.to_str().unwrap();
    let _ = std::fs::remove_file(path);
    let cap = 4096;
    let map_a = ShmLink::create(path, cap).unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().permissions().mode() & 0o777, 0o600);
    let map_b = ShmLink::open(path, cap).unwrap();
    // A third view of the same memory plays the corrupt peer.
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    // SAFETY: a test-only view of the file the two links share.
    let mut evil = unsafe { memmap2::MmapMut::map_mut(&f) }.unwrap();
    std::fs::remove_file(path).unwrap();
    let (live_a, live_b) = pair_of_streams();
    let mut a = ShmLink::new(map_a, cap, true, live_a).unwrap();
    let mut b = ShmLink::new(map_b, cap, false, live_b).unwrap();
    assert_eq!(a.write_some(&[7u8; 100], &[]).unwrap(), 100);
    let mut got = [0u8; 100];
    assert_eq!(b.read_some(&mut got, &mut []).unwrap(), 100);
    // Ring 0 (a writes, b reads): head at byte 0, tail at byte 128.
    let set = |m: &mut memmap2::MmapMut, at: usize, v: u64| m[at..at + 8].copy_from_slice(&v.to_ne_bytes());
    set(&mut evil, 0, u64::MAX / 2); // "published" far more than the ring holds
    let e = b.read_some(&mut [0u8; 64], &mut []).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("write counter"), "{e}");
    let e = b.read_fold(&mut [0u8; 64], 4, &mut |_, _| {}).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    set(&mut evil, 128, 1 << 40); // "read" what was never written
    let e = a.write_some(&[1u8; 8192], &[]).unwrap_err();
    assert!(e.to_string().contains("read counter"), "{e}");
}

fn pair_of_streams() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Every TCP link probes an idle peer (a vanished host is found in about 10 s, not at the
/// collective deadline): the options are read back from the link's socket. (Dropping packets
/// on loopback to watch the probes fail needs a firewall this machine does not have.)
#[test]
fn tcp_links_detect_vanished_peers() {
    let (_a, link) = pair();
    for (level, opt, want) in crate::link::KEEPALIVE {
        let mut v: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt on the link's own socket into a c_int of the given length.
        let rc = unsafe { libc::getsockopt(link.fd(), level, opt, (&mut v as *mut libc::c_int).cast(), &mut len) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(v, want, "option {opt} at level {level}");
    }
}

/// A wait spins without yielding only while every rank of this host can have a core: more
/// ranks than cores, and it yields from the start (the peer it waits for needs the core).
#[test]
fn waits_yield_at_once_when_a_host_is_oversubscribed() {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let host = |h: &str, n: usize| vec![h.to_string(); n];
    assert_eq!(crate::comm::pure_spin_for(&host("a", 1), 0), Duration::from_micros(20));
    assert_eq!(crate::comm::pure_spin_for(&host("a", cores), cores - 1), Duration::from_micros(20));
    assert_eq!(crate::comm::pure_spin_for(&host("a", cores + 1), 0), Duration::ZERO);
    // Ranks on other hosts do not count against this one's cores.
    let mut spread = host("a", cores);
    spread.extend(host("b", cores));
    assert_eq!(crate::comm::pure_spin_for(&spread, 0), Duration::from_micros(20));
    assert_eq!(crate::comm::pure_spin_for(&spread, cores), Duration::from_micros(20));
}
