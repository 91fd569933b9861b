//! Multi-rank tests of the reference backend and the wrappers.

use kolo_base::{Deadline, Rank, WorldSize};
use kolo_comm::{split, AsyncComm, BufMut, BufRef, Checked, CommError, Communicator, DeviceMesh, LocalComm, ReduceOp};
use kolo_testkit::{conformance, run_ranks, ODD_LENS};
use std::sync::Arc;
use std::time::Duration;

fn world(n: usize) -> Vec<LocalComm> {
    LocalComm::create(WorldSize::new(n).unwrap())
}

#[test]
fn local_conformance_world_1_to_4() {
    for n in 1..=4 {
        run_ranks(world(n), |_, c| conformance(&c, ODD_LENS));
    }
}

#[test]
fn checked_passes_matching_calls_and_reports_mismatch() {
    run_ranks(world(3), |_, c| {
        let c = Checked::new(Arc::new(c));
        conformance(&c, &[0, 5]);
    });
    let errs = run_ranks(world(2), |r, c| {
        let c = Checked::new(Arc::new(c));
        let mut v = vec![1f32; 4 + r];
        c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err()
    });
    for e in errs {
        let msg = e.to_string();
        assert!(matches!(e, CommError::Mismatch { .. }), "{msg}");
        assert!(msg.contains("all_reduce(f32 x 4") && msg.contains("all_reduce(f32 x 5"), "{msg}");
    }
}

#[test]
fn local_detects_mismatch_without_wrapper() {
    let errs = run_ranks(world(2), |r, c| {
        let mut v = vec![0f32; 3];
        if r == 0 {
            c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err()
        } else {
            c.broadcast(BufMut::from(&mut v), Rank(0)).unwrap_err()
        }
    });
    assert!(errs.iter().all(|e| matches!(e, CommError::Mismatch { .. })), "{errs:?}");
}

#[test]
fn departed_rank_gives_peer_lost_then_aborted() {
    let errs = run_ranks(world(3), |r, c| {
        c.set_timeout(Duration::from_secs(20));
        if r == 2 {
            drop(c);
            return None;
        }
        let mut v = vec![1f32; 8];
        let first = c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err();
        let second = c.barrier().unwrap_err();
        Some((first, second))
    });
    for (first, second) in errs.into_iter().flatten() {
        assert!(matches!(first, CommError::PeerLost { peer: Rank(2), .. }), "{first}");
        assert!(matches!(second, CommError::Aborted { .. }), "{second}");
    }
}

#[test]
fn timeout_names_missing_rank() {
    let errs = run_ranks(world(2), |r, c| {
        c.set_timeout(Duration::from_millis(200));
        if r == 0 {
            let mut v = vec![0u8; 1];
            let e = c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err();
            Some(e)
        } else {
            std::thread::sleep(Duration::from_millis(600));
            None
        }
    });
    let e = errs[0].as_ref().unwrap();
    assert!(matches!(e, CommError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("rank(s) [1]"), "{e}");
}

#[test]
fn invalid_arguments_are_rejected_without_breaking_the_communicator() {
    run_ranks(world(2), |r, c| {
        let mut out = vec![0f32; 5];
        let bad = vec![0f32; 4];
        let e = c.all_gather(BufRef::from(&bad), BufMut::from(&mut out)).unwrap_err();
        assert!(matches!(e, CommError::InvalidArgument { .. }), "{e}");
        let e = c.broadcast(BufMut::from(&mut out), Rank(9)).unwrap_err();
        assert!(e.to_string().contains("root 9"), "{e}");
        let e = c.send(BufRef::from(&bad), Rank(r), 0).unwrap_err();
        assert!(e.to_string().contains("itself"), "{e}");
        c.barrier().unwrap();
    });
}

#[test]
fn split_and_mesh_groups_work() {
    run_ranks(world(4), |r, c| {
        // Even and odd ranks, ordered by descending key.
        let g = split(&c, Some((r % 2) as u32), (10 - r) as u32).unwrap().unwrap();
        assert_eq!(g.world_size().get(), 2);
        assert_eq!(g.rank().get(), if r < 2 { 1 } else { 0 });
        let mut v = vec![r as i32];
        g.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
        assert_eq!(v[0], if r % 2 == 0 { 2 } else { 4 });
        conformance(&*g, &[0, 7]);
        assert!(split(&c, None, 0).unwrap().is_none());

        let mesh = DeviceMesh::new(&c, &[("dp", 2), ("tp", 2)]).unwrap();
        assert_eq!(mesh.coord("dp").unwrap(), r / 2);
        assert_eq!(mesh.coord("tp").unwrap(), r % 2);
        let mut v = vec![r as i64];
        mesh.group("tp").unwrap().all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
        assert_eq!(v[0], if r < 2 { 1 } else { 5 });
        let mut v = vec![r as i64];
        mesh.group("dp").unwrap().all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
        assert_eq!(v[0], if r % 2 == 0 { 2 } else { 4 });
        assert!(DeviceMesh::new(&c, &[("dp", 3)]).is_err());
    });
}

#[test]
fn async_comm_overlaps_and_keeps_order() {
    run_ranks(world(2), |r, c| {
        let a = AsyncComm::new(Arc::new(c));
        let p1 = a.all_reduce(vec![r as f32; 10], ReduceOp::Sum);
        let p2 = a.all_reduce(vec![1i64; 3], ReduceOp::Sum);
        let p3 = a.broadcast(vec![r as u8; 2], Rank(1));
        let d = Deadline::after(Duration::from_secs(10));
        assert_eq!(p1.wait(d).unwrap(), vec![1.0; 10]);
        assert_eq!(p2.wait(d).unwrap(), vec![2; 3]);
        assert_eq!(p3.wait(d).unwrap(), vec![1; 2]);
        a.flush(d).unwrap();
    });
}
