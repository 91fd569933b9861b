//! Test harness shared by the backends.
//!
//! * [`run_ranks`]: runs one closure per rank on its own thread and returns their results
//!   (a panicking rank fails the test with its rank in the message).
//! * [`conformance`]: every collective, on every dtype, for the given element counts, checked
//!   against reference semantics computed locally from the deterministic inputs of all ranks.
//!   Float inputs are random (so summation orders differ in their bits) and reductions are
//!   compared with an independent f64 reference within the rounding bound of n additions in the
//!   dtype; every rank must also hold bitwise the same all-reduce result. Integer inputs are
//!   small, compared exactly. Data movement (gather, broadcast, all-to-all, send) is exact.
//! * [`files`]: the data the repository ships for tests, and [`files::tool_missing`].

pub mod files;

/// The largest absolute difference between two equally long vectors (parameters or logits of
/// two runs that should agree); panics on different lengths, which would hide a difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "the two vectors differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
}

use kolo_base::{shard_range, DType, Rank};
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
        hs.into_iter().enumerate().map(|(i, h)| h.join().unwrap_or_else(|_| panic!("rank {i} panicked"))).collect()
    })
}

fn is_float(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// Unit roundoff of a float dtype (half the distance from 1 to the next value).
fn unit_roundoff(d: DType) -> f64 {
    match d {
        DType::F64 => f64::EPSILON / 2.0,
        DType::F32 => f64::from(f32::EPSILON) / 2.0,
        DType::F16 => 2f64.powi(-11),
        DType::BF16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The input of `rank` at element `i`. Floats: random, uniform in [-8, 8) (in [0.5, 2) for
/// products, so they neither vanish nor overflow), rounded to the dtype. Integers: small, so
/// every reduction is exact.
pub fn value<T: Element>(op: ReduceOp, rank: usize, i: usize) -> T {
    if is_float(T::DTYPE) {
        let u = (mix(mix(rank as u64 + 1) ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ op as u64) >> 11) as f64 / (1u64 << 53) as f64;
        return T::from_f64(if op == ReduceOp::Product { 0.5 + 1.5 * u } else { 16.0 * u - 8.0 });
    }
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

/// The reduction of every rank's input at each element, computed in f64 independently of the
/// backends' kernels, and the largest error a correct reduction in `T` may have there: (n + 1)
/// roundings of a partial result bounded by the sum of magnitudes (products: of the product).
/// Zero for integers, min and max (exact).
pub fn reference<T: Element>(op: ReduceOp, n: usize, len: usize) -> Vec<(f64, f64)> {
    let ins: Vec<Vec<f64>> = (0..n).map(|r| input::<T>(op, r, len).into_iter().map(Element::to_f64).collect()).collect();
    let u = unit_roundoff(T::DTYPE);
    (0..len)
        .map(|i| {
            let xs = ins.iter().map(|v| v[i]);
            let abs: f64 = ins.iter().map(|v| v[i].abs()).sum();
            let steps = (n + 1) as f64;
            match op {
                ReduceOp::Sum => (xs.sum(), steps * u * abs),
                ReduceOp::Avg => (xs.sum::<f64>() / n as f64, steps * u * abs / n as f64),
                ReduceOp::Min => (xs.fold(f64::INFINITY, f64::min), 0.0),
                ReduceOp::Max => (xs.fold(f64::NEG_INFINITY, f64::max), 0.0),
                ReduceOp::Product => {
                    let p: f64 = xs.product();
                    (p, steps * u * p.abs())
                }
            }
        })
        .collect()
}

fn check<T: Element>(what: &str, comm: &dyn Communicator, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "rank {}: {what}: length", comm.rank());
    if let Some(i) = (0..got.len()).find(|i| got[*i] != want[*i]) {
        panic!("rank {} ({}): {what}: element {i} is {:?}, expected {:?}", comm.rank(), comm.backend(), got[i], want[i]);
    }
}

/// `got` against the reference values: integers exactly (after the dtype's rounding), floats
/// within each element's bound.
fn check_reduced<T: Element>(what: &str, comm: &dyn Communicator, got: &[T], want: &[(f64, f64)]) {
    assert_eq!(got.len(), want.len(), "rank {}: {what}: length", comm.rank());
    for (i, (g, &(w, bound))) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        let ok = if is_float(T::DTYPE) { (g - w).abs() <= bound } else { g == T::from_f64(w).to_f64() };
        assert!(ok, "rank {} ({}): {what}: element {i} is {g}, reference {w} (allowed error {bound:e})", comm.rank(), comm.backend());
    }
}

fn suite<T: Element>(comm: &dyn Communicator, len: usize) {
    let n = comm.world_size().get();
    let me = comm.rank().get();
    let d = T::DTYPE;
    for op in ReduceOp::ALL {
        let mut buf = input::<T>(op, me, len);
        comm.all_reduce(BufMut::from(&mut buf), op).unwrap();
        let what = format!("all_reduce {op} {d} x {len}");
        check_reduced(&what, comm, &buf, &reference::<T>(op, n, len));
        // Every rank holds the same bits (rank 0's result, broadcast, must equal this rank's).
        let mut first = buf.clone();
        comm.broadcast(BufMut::from(&mut first), Rank(0)).unwrap();
        check(&format!("{what}: same result on every rank"), comm, &buf, &first);
    }
    let op = ReduceOp::Sum;
    let root = len % n;
    let mut buf = input::<T>(op, me, len);
    comm.reduce(BufMut::from(&mut buf), op, Rank(root)).unwrap();
    if me == root {
        check_reduced(&format!("reduce to {root} {d} x {len}"), comm, &buf, &reference::<T>(op, n, len));
    } else {
        check(&format!("reduce to {root} {d} x {len}: non-root buffer"), comm, &buf, &input::<T>(op, me, len));
    }

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
        let want = reference::<T>(op, n, len);
        check_reduced(&format!("reduce_scatter {op} {d} x {len}"), comm, &out, &want[r.clone()]);
        let mut buf = inp.clone();
        comm.reduce_scatter_in_place(BufMut::from(&mut buf), op).unwrap();
        check_reduced(&format!("reduce_scatter_in_place {op} {d} x {len}"), comm, &buf[r.clone()], &want[r]);
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
        if me.is_multiple_of(2) {
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
