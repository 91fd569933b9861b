//! Multi-rank tests of the host backend: ranks are threads with real sockets and real shared
//! memory; `process.rs` covers separate processes.

use kolo_base::{Rank, WorldSize};
use kolo_collectives::{AlgorithmChoice, HostComm, HostCommConfig, Transport};
use kolo_comm::{BufMut, BufRef, Checked, CommError, Communicator, ReduceOp};
use kolo_rendezvous::{JobToken, MemoryStore, Store};
use kolo_testkit::{conformance, run_ranks, ODD_LENS};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod frame;

fn group(n: usize, cfg: HostCommConfig) -> Vec<HostComm> {
    group_with(n, |_| cfg.clone())
}

/// A group whose ranks may have different configurations (e.g. fake host ids).
fn group_with(n: usize, cfg: impl Fn(usize) -> HostCommConfig + Sync) -> Vec<HostComm> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let token = JobToken::generate();
    let slots: Vec<usize> = (0..n).collect();
    run_ranks(slots, |r, _| HostComm::connect(store.clone(), token.clone(), "t", Rank(r), WorldSize::new(n).unwrap(), cfg(r)).unwrap())
}

fn cfg(transport: Transport, alg: AlgorithmChoice) -> HostCommConfig {
    HostCommConfig { transport, all_reduce: alg, timeout: Duration::from_secs(60), ..HostCommConfig::default() }
}

fn conformance_for(transport: Transport, alg: AlgorithmChoice) {
    for n in 1..=4 {
        let comms = group(n, cfg(transport, alg));
        if n > 1 {
            let shm = comms[0].shm_peers().len();
            assert_eq!(shm, if transport == Transport::Tcp { 0 } else { n - 1 }, "{transport:?}");
        }
        run_ranks(comms, |_, c| conformance(&c, ODD_LENS));
    }
}

#[test]
fn tcp_ring_conformance() {
    conformance_for(Transport::Tcp, AlgorithmChoice::Ring);
}

#[test]
fn tcp_doubling_conformance() {
    conformance_for(Transport::Tcp, AlgorithmChoice::RecursiveDoubling);
}

#[test]
fn tcp_tree_conformance() {
    conformance_for(Transport::Tcp, AlgorithmChoice::Tree);
}

#[test]
fn tcp_halving_doubling_conformance() {
    conformance_for(Transport::Tcp, AlgorithmChoice::HalvingDoubling);
    // 5, 6 and 7 ranks exercise the fold of non-power-of-two worlds.
    for n in [5, 6, 7] {
        run_ranks(group(n, cfg(Transport::Tcp, AlgorithmChoice::HalvingDoubling)), |_, c| conformance(&c, &[0, 1, 13, 1009]));
    }
}

#[test]
fn hierarchical_all_reduce_and_all_gather_across_fake_hosts() {
    // Hosts a,a,b,b (even: reduce-scatter / all-reduce / all-gather) and a,a,b (leaders only).
    // All-gathers go in two levels (across hosts by local index, then within hosts) on even
    // hosts wherever the shard layouts line up (a,a,b,b always; a,b,a,b,c,c for some lengths),
    // and through the ring otherwise (a,a,b): the matrix checks every length either way.
    for hosts in [&["a", "a", "b", "b"][..], &["a", "a", "b"], &["a", "b", "a", "b", "c", "c"]] {
        let comms = group_with(hosts.len(), |r| HostCommConfig {
            host_id: Some(hosts[r].to_string()),
            ..cfg(Transport::Auto, AlgorithmChoice::Hierarchical)
        });
        let same_host = hosts.iter().filter(|h| **h == hosts[0]).count() - 1;
        assert_eq!(comms[0].shm_peers().len(), same_host);
        run_ranks(comms, |_, c| conformance(&c, &[0, 1, 7, 97, 65_537]));
    }
}

#[test]
fn shm_auto_conformance() {
    conformance_for(Transport::Shm, AlgorithmChoice::Auto);
}

#[test]
fn shm_ring_conformance_with_tiny_ring() {
    // A ring smaller than one message, of odd size, forces wrap-around, back-pressure and
    // elements split across the end of the ring on every transfer.
    let c = HostCommConfig { shm_ring: kolo_base::ByteSize(4099), ..cfg(Transport::Shm, AlgorithmChoice::Ring) };
    for n in [2, 3] {
        run_ranks(group(n, c.clone()), |_, c| conformance(&c, &[0, 1, 13, 65_537]));
    }
}

#[test]
fn ring_all_reduce_in_pieces_and_paced_conformance() {
    // Pieces of a few elements per rank (24 bytes: 3 f64, 12 f16, not a whole number of i64 for
    // 3 ranks' rounding) make every length above a few elements run in many pieces, the last one
    // short; a pace of 1001 bytes (no whole number of elements of any width but u8) holds every
    // TCP send back behind its receive many times per step, splitting elements.
    let pieces = HostCommConfig { ring_piece: kolo_base::ByteSize(24), ..cfg(Transport::Tcp, AlgorithmChoice::Ring) };
    let paced = HostCommConfig { tcp_pace: kolo_base::ByteSize(1001), ring_piece: kolo_base::ByteSize(0), ..pieces.clone() };
    for n in [2, 3, 4] {
        run_ranks(group(n, pieces.clone()), |_, c| conformance(&c, &[0, 1, 13, 97, 1009]));
        run_ranks(group(n, paced.clone()), |_, c| conformance(&c, &[0, 13, 1009, 65_537]));
    }
    // Shared memory is not paced, but runs in pieces too.
    let shm = HostCommConfig { transport: Transport::Shm, ..pieces };
    run_ranks(group(3, shm), |_, c| conformance(&c, &[0, 1, 13, 1009]));
}

#[test]
fn large_buffers_round_trip_bitwise() {
    // 3 M floats: several MiB per segment, far beyond socket buffers and the shm ring.
    for transport in [Transport::Tcp, Transport::Shm] {
        run_ranks(group(2, cfg(transport, AlgorithmChoice::Auto)), |r, c| {
            let len = 3_000_017;
            let mut v: Vec<f32> = (0..len).map(|i| ((i * 7 + r * 13) % 101) as f32 * 0.25).collect();
            c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
            for (i, x) in v.iter().enumerate() {
                let want = ((i * 7) % 101) as f32 * 0.25 + ((i * 7 + 13) % 101) as f32 * 0.25;
                assert_eq!(*x, want, "element {i}");
            }
        });
    }
}

#[test]
fn sub_groups_over_host_backend() {
    run_ranks(group(4, cfg(Transport::Auto, AlgorithmChoice::Auto)), |r, c| {
        let g = kolo_comm::split(&c, Some((r % 2) as u32), r as u32).unwrap().unwrap();
        assert_eq!(g.world_size().get(), 2);
        conformance(&*g, &[0, 5, 97]);
        let mesh = kolo_comm::DeviceMesh::new(&c, &[("dp", 2), ("tp", 2)]).unwrap();
        let mut v = vec![r as i32];
        mesh.group("tp").unwrap().all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
        assert_eq!(v[0], if r < 2 { 1 } else { 5 });
    });
}

#[test]
fn mismatched_collective_is_reported_not_hung() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let errs = run_ranks(group(2, cfg(transport, AlgorithmChoice::Auto)), |r, c| {
            let mut v = vec![0f32; 10 + r];
            let e = c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err();
            // The communicator stays failed.
            let again = c.barrier().unwrap_err();
            (e, again)
        });
        for (e, again) in errs {
            let msg = e.to_string();
            assert!(matches!(e, CommError::Mismatch { .. } | CommError::PeerLost { .. }), "{msg}");
            assert!(matches!(again, CommError::Aborted { .. }), "{again}");
        }
    }
}

/// A named case of a mismatch test: what each rank does, returning its error.
type Case<'a> = (&'a str, &'a (dyn Fn(usize, &HostComm) -> CommError + Sync));

/// Ranks that call the same collective with a different reduce op or root, or exchange a
/// message as different dtypes of the same byte length, fail with a mismatch naming both sides
/// (issue #19: the header carried neither, so Sum on one rank and Max on another mixed
/// silently). Every rank fails; the first message to arrive decides which one names which.
#[test]
fn reduce_op_root_and_p2p_dtype_mismatches_are_caught() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let cases: [Case<'_>; 3] = [
            ("sum", &|r, c| {
                let mut v = vec![1f32; 64];
                c.all_reduce(BufMut::from(&mut v), if r == 0 { ReduceOp::Sum } else { ReduceOp::Max }).unwrap_err()
            }),
            ("reduce_scatter", &|r, c| {
                let mut v = vec![1f32; 64];
                c.reduce_scatter_in_place(BufMut::from(&mut v), if r == 0 { ReduceOp::Avg } else { ReduceOp::Sum }).unwrap_err()
            }),
            ("i32", &|r, c| {
                if r == 0 {
                    // The send completes; the receiver's failure reaches the sender next.
                    c.send(BufRef::from(&[1f32; 4][..]), Rank(1), 7).err().or_else(|| c.barrier().err()).expect("an error")
                } else {
                    let mut v = [0i32; 4];
                    c.recv(BufMut::from(&mut v[..]), Rank(0), 7).unwrap_err()
                }
            }),
        ];
        for (what, case) in cases {
            let errs = run_ranks(group(2, cfg(transport, AlgorithmChoice::Auto)), |r, c| case(r, &c));
            let named = errs.iter().any(|e| matches!(e, CommError::Mismatch { .. }) && e.to_string().contains(what));
            assert!(named, "{transport:?} {what}: {:?}", errs.iter().map(|e| e.to_string()).collect::<Vec<_>>());
            assert!(errs.iter().all(|e| matches!(e, CommError::Mismatch { .. } | CommError::PeerLost { .. })), "{errs:?}");
        }
        // A different root: with 3 ranks somebody receives from a sender that named another
        // root. (With 2, both would think they are the root and only send; the stray message
        // then fails the next collective instead.)
        let errs = run_ranks(group(3, cfg(transport, AlgorithmChoice::Auto)), |r, c| {
            let mut v = vec![1f32; 64];
            let e = c.broadcast(BufMut::from(&mut v), Rank(usize::from(r == 2))).err();
            e.or_else(|| c.barrier().err()).expect("a mismatch somewhere")
        });
        assert!(errs.iter().any(|e| matches!(e, CommError::Mismatch { .. }) && e.to_string().contains("root")), "{transport:?}: {errs:?}");
    }
}

#[test]
fn checked_wrapper_names_both_calls() {
    let errs = run_ranks(group(3, cfg(Transport::Tcp, AlgorithmChoice::Auto)), |r, c| {
        let c = Checked::new(Arc::new(c));
        let mut v = vec![0f32; 4];
        if r == 2 {
            c.broadcast(BufMut::from(&mut v), Rank(0)).unwrap_err()
        } else {
            c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err()
        }
    });
    let msg = errs[0].to_string();
    assert!(msg.contains("rank 2 called broadcast(f32 x 4, root 0)"), "{msg}");
}

#[test]
fn dead_peer_fails_every_survivor_quickly() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let comms = group(4, cfg(transport, AlgorithmChoice::Ring));
        let t0 = Instant::now();
        let errs = run_ranks(comms, |r, c| {
            let mut v = vec![1f32; 1 << 20];
            c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap();
            if r == 1 {
                drop(c); // rank 1 dies between collectives
                return None;
            }
            Some(c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err())
        });
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        for e in errs.into_iter().flatten() {
            assert!(matches!(e, CommError::PeerLost { .. }), "{transport:?}: {e}");
        }
    }
}

/// A rank lost in a two-level all-reduce is named in the group's own numbering, with the
/// group's sequence number, by every survivor: the ones that lose it inside a sub-group (its
/// host's group, its cross-host group, where it has another rank number) and the ones that
/// only see a survivor give up (issue #19: a cut host was named by its cross-group rank).
#[test]
fn a_rank_lost_in_a_two_level_all_reduce_is_named_in_the_groups_numbering() {
    let hosts = ["a", "a", "b", "b"];
    let comms = group_with(4, |r| HostCommConfig {
        host_id: Some(hosts[r].to_string()),
        timeout: Duration::from_secs(20),
        ..cfg(Transport::Auto, AlgorithmChoice::Hierarchical)
    });
    let errs = run_ranks(comms, |r, c| {
        let mut v = vec![1.0f32; 1000];
        c.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum).unwrap();
        assert_eq!(v[999], 4.0);
        if r == 3 {
            return None; // leaves: its links close
        }
        Some(c.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum).unwrap_err().to_string())
    });
    for (r, e) in errs.iter().enumerate().take(3) {
        let e = e.as_ref().unwrap();
        // The first all-reduce (#0) set up the sub-groups with collectives of its own.
        assert!(e.starts_with(&format!("rank {r}: all_reduce #")) && e.contains("rank 3"), "{e}");
        // Ranks 1 and 2 lose rank 3 directly; it is rank 1 of both sub-groups they share.
        assert!(r == 0 || e.contains("lost rank 3:"), "{e}");
    }
}

#[test]
fn timeout_names_the_missing_rank() {
    let c = HostCommConfig { timeout: Duration::from_millis(300), ..cfg(Transport::Tcp, AlgorithmChoice::Auto) };
    let errs = run_ranks(group(3, c), |r, c| {
        if r == 2 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let mut v = vec![1u8; 4];
        Some(c.all_reduce(BufMut::from(&mut v), ReduceOp::Sum).unwrap_err())
    });
    let joined: Vec<String> = errs.into_iter().flatten().map(|e| e.to_string()).collect();
    assert!(joined.iter().any(|m| m.contains("timed out") && m.contains("[2]")), "{joined:?}");
}

#[test]
fn wrong_token_cannot_join_a_group() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let c = HostCommConfig { timeout: Duration::from_secs(2), ..cfg(Transport::Tcp, AlgorithmChoice::Auto) };
    let n = WorldSize::new(2).unwrap();
    let good = JobToken::generate();
    let results = run_ranks(vec![good.clone(), JobToken::generate()], |r, tok| {
        HostComm::connect(store.clone(), tok, "t", Rank(r), n, c.clone()).map(|_| ())
    });
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    let msg = format!("{:?}", results[1]);
    assert!(msg.contains("token") || msg.contains("rank 0"), "{msg}");
}

#[test]
fn p2p_tag_mismatch_is_detected() {
    let errs = run_ranks(group(2, cfg(Transport::Tcp, AlgorithmChoice::Auto)), |r, c| {
        let v = [1i64, 2, 3];
        let mut got = [0i64; 3];
        if r == 0 {
            c.send(BufRef::from(&v[..]), Rank(1), 5).map(|_| ()).err()
        } else {
            c.recv(BufMut::from(&mut got[..]), Rank(0), 6).err()
        }
    });
    let e = errs[1].as_ref().expect("receiver must fail");
    assert!(e.to_string().contains("tag 5") && e.to_string().contains("tag 6"), "{e}");
}

/// Two ranks send each other 16 MiB at once: more than the shared-memory ring and the socket
/// buffers hold, so plain blocking sends would wait on each other; `send_recv` drives both.
#[test]
fn send_recv_exchanges_large_buffers_both_ways() {
    for transport in [Transport::Tcp, Transport::Shm] {
        let comms = group(2, cfg(transport, AlgorithmChoice::Auto));
        run_ranks(comms, |r, c| {
            let n = 4 << 20;
            let mine: Vec<f32> = (0..n).map(|i| (i + r * 7) as f32).collect();
            let mut got = vec![0f32; n];
            let peer = Rank(1 - r);
            c.send_recv(BufRef::from(&mine[..]), peer, 3, BufMut::from(&mut got[..]), peer, 3).unwrap();
            assert!(got.iter().enumerate().all(|(i, v)| *v == (i + (1 - r) * 7) as f32));
        });
    }
}

/// A tuning table for the group's world size and link kind decides `Auto`'s algorithm by size
/// (the flight recorder names the one each all-reduce ran); other worlds, other link kinds and
/// an explicit algorithm ignore it; the results stay exact (integer-valued sums).
#[test]
fn a_tuning_table_picks_auto_s_algorithm() {
    use kolo_collectives::{Algorithm, LinkKind, TuneTable, Tuning};
    let mut t = Tuning::default();
    t.insert(TuneTable { world: 3, links: LinkKind::Shm, rows: vec![(65536, Algorithm::Tree), (1 << 20, Algorithm::Ring)] }).unwrap();
    t.insert(TuneTable { world: 2, links: LinkKind::Shm, rows: vec![(1 << 20, Algorithm::Tree)] }).unwrap();
    let tuning = Some(Arc::new(t));
    // The algorithm of the last all-reduce in each rank's flight record, and the sum's check.
    let run = |n: usize, transport, alg, floats: usize, tuning: Option<Arc<Tuning>>| -> Vec<String> {
        let comms = group(n, HostCommConfig { tuning, ..cfg(transport, alg) });
        run_ranks(comms, |r, c| {
            let mut v: Vec<f32> = (0..floats).map(|i| ((i * 7 + r * 13) % 97) as f32).collect();
            c.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum).unwrap();
            let want = |i: usize| (0..n).map(|q| ((i * 7 + q * 13) % 97) as f32).sum::<f32>();
            assert!(v.iter().enumerate().all(|(i, x)| *x == want(i)), "rank {r}: a wrong sum");
            let record = c.flight_record();
            let last = record.lines().rfind(|l| l.contains("all_reduce")).unwrap_or_default().to_string();
            ["doubling", "halving", "ring", "tree"].into_iter().find(|a| last.contains(a)).unwrap_or("?").to_string()
        })
    };
    let all = |v: Vec<String>, want: &str| assert!(v.iter().all(|a| a == want), "{v:?}, expected {want}");
    all(run(3, Transport::Shm, AlgorithmChoice::Auto, 16384, tuning.clone()), "tree");
    all(run(3, Transport::Shm, AlgorithmChoice::Auto, 32768, tuning.clone()), "ring");
    all(run(3, Transport::Shm, AlgorithmChoice::Auto, 16384, None), "doubling");
    all(run(3, Transport::Tcp, AlgorithmChoice::Auto, 16384, tuning.clone()), "doubling");
    all(run(2, Transport::Shm, AlgorithmChoice::Auto, 32768, tuning.clone()), "tree");
    all(run(4, Transport::Shm, AlgorithmChoice::Auto, 16384, tuning.clone()), "doubling");
    all(run(3, Transport::Shm, AlgorithmChoice::Ring, 16384, tuning), "ring");
}

/// Members that read different tuning tables (or one none) could choose different algorithms
/// for one all-reduce: the group refuses to form, naming the rank that differs.
#[test]
fn ranks_with_different_tuning_tables_refuse_to_connect() {
    use kolo_collectives::{Algorithm, LinkKind, TuneTable, Tuning};
    let mut t = Tuning::default();
    t.insert(TuneTable { world: 2, links: LinkKind::Shm, rows: vec![(1 << 20, Algorithm::Tree)] }).unwrap();
    let digest = t.digest();
    let tuning = Arc::new(t);
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let token = JobToken::generate();
    let errs = run_ranks(vec![0usize, 1], |r, _| {
        let c = HostCommConfig { tuning: (r == 0).then(|| tuning.clone()), ..cfg(Transport::Shm, AlgorithmChoice::Auto) };
        HostComm::connect(store.clone(), token.clone(), "t", Rank(r), WorldSize::new(2).unwrap(), c).err().map(|e| e.to_string())
    });
    let want = format!("rank 0 has tuning table {digest} and rank 1 no tuning table: every rank must read the same --tuning file");
    assert!(errs[1].as_deref().is_some_and(|e| e.contains(&want)), "{errs:?}");
    assert!(errs[0].as_deref().is_some_and(|e| e.contains("rank 1 has no tuning table and rank 0 tuning table")), "{errs:?}");
}
