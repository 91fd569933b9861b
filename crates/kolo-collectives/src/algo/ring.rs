//! Ring algorithms: bandwidth-optimal for large buffers. Every rank sends and receives
//! `(n-1)/n` of the buffer per phase, and each step's send overlaps its receive; received data
//! is reduced as it arrives.
//!
//! The reduction of segment `k` always travels the ring in the same order, and the all-gather
//! phase copies the finished segments, so every rank ends with bit-identical results.

use super::{byte_segments, split_rw, Exec};
use kolo_base::DType;
use kolo_comm::reduce::finish_avg;
use kolo_comm::{CommError, ReduceOp, Scratch};

fn left(e: &Exec<'_>) -> usize {
    (e.rank + e.n - 1) % e.n
}
fn right(e: &Exec<'_>) -> usize {
    (e.rank + 1) % e.n
}

/// Reduce-scatter phase in place over `buf`. `shift` picks which segment each rank ends up owning:
/// rank r owns segment `(r + 1 + shift) mod n`.
fn reduce_scatter_phase(
    e: &mut Exec<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    shift: usize,
    scratch: &mut Scratch,
    step0: u32,
) -> Result<(), CommError> {
    let n = e.n;
    let segs = byte_segments(buf.len() / dtype.size_bytes(), e.world(), dtype.size_bytes());
    let tmp = scratch.get(super::REDUCE_WINDOW);
    let (l, r) = (left(e), right(e));
    for s in 0..n - 1 {
        let send_seg = (e.rank + 2 * n - s + shift) % n;
        let recv_seg = (e.rank + 2 * n - s - 1 + shift) % n;
        let (out, inp) = split_rw(buf, segs[send_seg].clone(), segs[recv_seg].clone());
        let step = step0 + s as u32;
        let mut x = [e.send(r, step, Some(dtype), out), e.recv_reduce(l, step, dtype, op, tmp, inp)];
        e.run(&mut x)?;
    }
    Ok(())
}

/// All-gather phase in place: rank r starts owning segment `(r + 1 + shift) mod n`.
fn all_gather_phase(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType, shift: usize, step0: u32) -> Result<(), CommError> {
    let n = e.n;
    let segs = byte_segments(buf.len() / dtype.size_bytes(), e.world(), dtype.size_bytes());
    let (l, r) = (left(e), right(e));
    for s in 0..n - 1 {
        let send_seg = (e.rank + 1 + 2 * n - s + shift) % n;
        let recv_seg = (e.rank + 2 * n - s + shift) % n;
        let (out, inp) = split_rw(buf, segs[send_seg].clone(), segs[recv_seg].clone());
        let step = step0 + s as u32;
        let mut x = [e.send(r, step, Some(dtype), out), e.recv(l, step, Some(dtype), inp)];
        e.run(&mut x)?;
    }
    Ok(())
}

pub(crate) fn all_reduce(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, scratch: &mut Scratch) -> Result<(), CommError> {
    let n = e.n;
    reduce_scatter_phase(e, buf, dtype, op, 0, scratch, 0)?;
    // Average the one finished segment before it is copied around.
    let segs = byte_segments(buf.len() / dtype.size_bytes(), e.world(), dtype.size_bytes());
    let own = segs[(e.rank + 1) % n].clone();
    finish_avg(dtype, op, &mut buf[own], n);
    all_gather_phase(e, buf, dtype, 0, (n - 1) as u32)
}

/// `output` has the full length; this rank's shard is already in place.
pub(crate) fn all_gather(e: &mut Exec<'_>, output: &mut [u8], dtype: DType) -> Result<(), CommError> {
    // Rank r owns segment r: shift = n - 1.
    all_gather_phase(e, output, dtype, e.n - 1, 0)
}

/// `acc` is a copy of the input that is reduced in place; this rank's shard of it ends up final.
pub(crate) fn reduce_scatter(e: &mut Exec<'_>, acc: &mut [u8], dtype: DType, op: ReduceOp, scratch: &mut Scratch) -> Result<(), CommError> {
    // Rank r ends owning segment r: shift = n - 1.
    reduce_scatter_phase(e, acc, dtype, op, e.n - 1, scratch, 0)
}
