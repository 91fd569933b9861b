//! Test harness shared by the backends.
//!
//! * [`run_ranks`]: runs one closure per rank on its own thread and returns their results
//!   (a panicking rank fails the test with its rank in the message).
//! * [`conformance`]: every collective, on every dtype, for the given element counts, checked
//!   against the reference semantics computed locally from the deterministic inputs of all ranks.
//!   Inputs are small integers, so every summation order gives the same bits and results are
//!   compared exactly.

use kolo_base::{shard_range, DType, Rank};
use kolo_comm::reduce::{finish_avg, reduce_into};
use kolo_comm::{bf16, f16, BufMut, BufRef, Communicator, Element, ReduceOp};
use std::sync::Arc;

/// Runs `f(rank_idx, comm)` for every communicator on its own thread.
pub fn run_ranks<C, R, F>(comms: Vec<C>, f: F) -> Vec<R>
where
    C: Send,
    R: Send,
    F: Fn(usize, C) -> R + Sync,
{
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let f = &f;
                std::thread::Builder::new().name(format!("rank-{i}")).spawn_scoped(s, move || f(i, c)).expect("spawn rank thread")
            })
            .collect();
        hs.into_iter()
            .enumerate()
            .map(|(i, h)| h.join().unwrap_or_else(|_| panic!("rank {i} panicked")))
            .collect()
    })
}

/// The input of `rank` at element `i`: small integers so any summation order is exact.
pub fn value<T: Element>(op: ReduceOp, rank: usize, i: usize) -> T {
    let v = match (op, T::DTYPE) {
        (ReduceOp::Product, _) => ((rank + i) % 4) as i64,
        (_, DType::U8) => ((rank * 7 + i * 3) % 11) as i64,
        _ => ((rank * 7 + i * 3) % 11) as i64 - 5,
    };
    T::from_i64(v)
}

pub fn input<T: Element>(op: ReduceOp, rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| value::<T>(op, rank, i)).collect()
}

/// The reduction of every rank's input, in rank order.
pub fn expected_reduction<T: Element>(op: ReduceOp, n: usize, len: usize) -> Vec<T> {
    let mut acc = input::<T>(op, 0, len);
    for r in 1..n {
        let other = input::<T>(op, r, len);
        reduce_into(T::DTYPE, op, BufMut::from(&mut acc).bytes_mut(), BufRef::from(&other).bytes());
    }
    finish_avg(T::DTYPE, op, BufMut::from(&mut acc).bytes_mut(), n);
    acc
}

fn check<T: Element>(what: &str, comm: &dyn Communicator, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "rank {}: {what}: length", comm.rank());
    if let Some(i) = (0..got.len()).find(|i| got[*i] != want[*i]) {
        panic!("rank {} ({}): {what}: element {i} is {:?}, expected {:?}", comm.rank(), comm.backend(), got[i], want[i]);
    }
}

fn suite<T: Element>(comm: &dyn Communicator, len: usize) {
    let n = comm.world_size().get();
    let me = comm.rank().get();
    let d = T::DTYPE;
    for op in ReduceOp::ALL {
        let mut buf = input::<T>(op, me, len);
        comm.all_reduce(BufMut::from(&mut buf), op).unwrap();
        check(&format!("all_reduce {op} {d} x {len}"), comm, &buf, &expected_reduction::<T>(op, n, len));
    }
    let op = ReduceOp::Sum;
    let root = len % n;
    let mut buf = input::<T>(op, me, len);
    comm.reduce(BufMut::from(&mut buf), op, Rank(root)).unwrap();
    let want = if me == root { expected_reduction::<T>(op, n, len) } else { input::<T>(op, me, len) };
    check(&format!("reduce to {root} {d} x {len}"), comm, &buf, &want);

    let root = (len + 1) % n;
    let mut buf = if me == root { input::<T>(op, me, len) } else { vec![T::default(); len] };
    comm.broadcast(BufMut::from(&mut buf), Rank(root)).unwrap();
    check(&format!("broadcast from {root} {d} x {len}"), comm, &buf, &input::<T>(op, root, len));

    // all_gather: rank r contributes its shard of the full input of rank r.
    let ws = comm.world_size();
    let mine = input::<T>(op, me, len)[shard_range(len, ws, Rank(me))].to_vec();
    let mut out = vec![T::default(); len];
    comm.all_gather(BufRef::from(&mine), BufMut::from(&mut out)).unwrap();
    let want: Vec<T> = (0..n).flat_map(|r| input::<T>(op, r, len)[shard_range(len, ws, Rank(r))].to_vec()).collect();
    check(&format!("all_gather {d} x {len}"), comm, &out, &want);

    for op in [ReduceOp::Sum, ReduceOp::Max] {
        let inp = input::<T>(op, me, len);
        let r = shard_range(len, ws, Rank(me));
        let mut out = vec![T::default(); r.len()];
        comm.reduce_scatter(BufRef::from(&inp), BufMut::from(&mut out), op).unwrap();
        check(&format!("reduce_scatter {op} {d} x {len}"), comm, &out, &expected_reduction::<T>(op, n, len)[r.clone()]);
        let mut buf = inp.clone();
        comm.reduce_scatter_in_place(BufMut::from(&mut buf), op).unwrap();
        check(&format!("reduce_scatter_in_place {op} {d} x {len}"), comm, &buf[r.clone()], &expected_reduction::<T>(op, n, len)[r]);
    }

    // all_to_all with uneven splits: rank i sends (i + j + len) % 3 elements to rank j.
    let count = |i: usize, j: usize| (i + j + len) % 3;
    let send_counts: Vec<usize> = (0..n).map(|j| count(me, j)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|j| count(j, me)).collect();
    let inp = input::<T>(op, me, send_counts.iter().sum());
    let mut out = vec![T::default(); recv_counts.iter().sum()];
    comm.all_to_all(BufRef::from(&inp), &send_counts, BufMut::from(&mut out), &recv_counts).unwrap();
    let want: Vec<T> = (0..n)
        .flat_map(|src| {
            let off: usize = (0..me).map(|j| count(src, j)).sum();
            input::<T>(op, src, off + count(src, me))[off..].to_vec()
        })
        .collect();
    check(&format!("all_to_all {d}"), comm, &out, &want);

    // send/recv around the ring; even ranks send first so large messages cannot deadlock.
    if n > 1 {
        let next = Rank((me + 1) % n);
        let prev = Rank((me + n - 1) % n);
        let mine = input::<T>(op, me, len);
        let mut got = vec![T::default(); len];
        if me % 2 == 0 {
            comm.send(BufRef::from(&mine), next, 7).unwrap();
            comm.recv(BufMut::from(&mut got), prev, 7).unwrap();
        } else {
            comm.recv(BufMut::from(&mut got), prev, 7).unwrap();
            comm.send(BufRef::from(&mine), next, 7).unwrap();
        }
        check(&format!("recv from {prev} {d} x {len}"), comm, &got, &input::<T>(op, prev.get(), len));
        // Everyone sends to the next rank and receives from the previous one at once.
        let mut got = vec![T::default(); len];
        comm.send_recv(BufRef::from(&mine), next, 9, BufMut::from(&mut got), prev, 9).unwrap();
        check(&format!("send_recv from {prev} {d} x {len}"), comm, &got, &input::<T>(op, prev.get(), len));
    }
    comm.barrier().unwrap();
}

/// Runs every collective on every dtype for each element count in `lens`.
pub fn conformance(comm: &dyn Communicator, lens: &[usize]) {
    for &len in lens {
        suite::<f32>(comm, len);
        suite::<f64>(comm, len);
        suite::<f16>(comm, len);
        suite::<bf16>(comm, len);
        suite::<i32>(comm, len);
        suite::<i64>(comm, len);
        suite::<u8>(comm, len);
    }
}

/// Element counts every backend is tested on: empty, one, primes, and sizes not divisible by
/// any small world size, up to a few pipeline chunks.
pub const ODD_LENS: &[usize] = &[0, 1, 2, 3, 7, 13, 97, 1009, 65_537];

pub type DynComm = Arc<dyn Communicator>;
