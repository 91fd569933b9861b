//! Ring algorithms: bandwidth-optimal for large buffers. Every rank sends and receives
//! `(n-1)/n` of the buffer per phase, and each step's send overlaps its receive; received data
//! is reduced as it arrives.
//!
//! The reduction of segment `k` always travels the ring in the same order, and the all-gather
//! phase copies the finished segments, so every rank ends with bit-identical results.
//!
//! A large all-reduce runs in pieces of `n x ring_piece` bytes, one after the other: a piece's
//! segments are reduced, then sent on and gathered while they are still in cache. Whole, a
//! 256 MiB buffer goes to memory and back at every step. 2 ranks at 256 MiB on the CI machine:
//! paced TCP 3.0 GB/s busbw whole, 3.2-3.4 in 1 MiB pieces; shared memory 3.9 and 5.1-5.5.
//! How a buffer is cut depends only on its length, the world and the setting, so results stay
//! deterministic and identical on every rank; the order in which an element's contributions are
//! added depends on which piece and segment it falls in, as it did on the segment before.

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
        e.run_ring_step(&mut x)?;
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
        e.run_ring_step(&mut x)?;
    }
    Ok(())
}

pub(crate) fn all_reduce(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, scratch: &mut Scratch) -> Result<(), CommError> {
    let steps = 2 * (e.n - 1);
    for (i, piece) in pieces(buf.len(), dtype.size_bytes(), e.n, e.ring_piece).into_iter().enumerate() {
        // Steps are numbered across pieces, so a rank a piece ahead or behind is a mismatch
        // (wrapping past 2^32 steps, the same on every rank).
        let step0 = (i * steps) as u32;
        all_reduce_piece(e, &mut buf[piece], dtype, op, scratch, step0)?;
    }
    Ok(())
}

/// The byte ranges a ring all-reduce of `len` bytes of `esz`-byte elements over `n` ranks runs
/// in, one after the other: pieces of `n x piece` bytes (rounded down to whole elements, at
/// least one per rank), the last one shorter. `piece == 0`, or a buffer of at most two pieces,
/// runs whole.
#[allow(clippy::single_range_in_vec_init)] // one piece: a list holding one range is meant
pub(crate) fn pieces(len: usize, esz: usize, n: usize, piece: usize) -> Vec<std::ops::Range<usize>> {
    // Saturating: any setting is accepted, a huge one meaning "whole".
    let size = (n.saturating_mul(piece) / esz).max(n) * esz;
    if piece == 0 || len <= size.saturating_mul(2) {
        return vec![0..len];
    }
    (0..len).step_by(size).map(|a| a..(a + size).min(len)).collect()
}

fn all_reduce_piece(
    e: &mut Exec<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    scratch: &mut Scratch,
    step0: u32,
) -> Result<(), CommError> {
    let n = e.n;
    reduce_scatter_phase(e, buf, dtype, op, 0, scratch, step0)?;
    // Average the one finished segment before it is copied around.
    let segs = byte_segments(buf.len() / dtype.size_bytes(), e.world(), dtype.size_bytes());
    let own = segs[(e.rank + 1) % n].clone();
    finish_avg(dtype, op, &mut buf[own], n);
    all_gather_phase(e, buf, dtype, 0, step0 + (n - 1) as u32)
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

#[cfg(test)]
#[allow(clippy::single_range_in_vec_init)] // one piece: a list holding one range is meant
mod tests {
    use super::pieces;

    #[test]
    fn pieces_cover_the_buffer_in_order_on_element_bounds() {
        // (len, esz, n, piece) -> the expected cuts.
        assert_eq!(pieces(0, 4, 2, 16), vec![0..0]);
        assert_eq!(pieces(100, 4, 2, 0), vec![0..100]);
        // At most two pieces' worth runs whole.
        assert_eq!(pieces(64, 4, 2, 16), vec![0..64]);
        assert_eq!(pieces(68, 4, 2, 16), vec![0..32, 32..64, 64..68]);
        // A piece is n x piece bytes, rounded down to whole elements: 3 x 10 = 30 -> 28 for f32.
        assert_eq!(pieces(100, 4, 3, 10), vec![0..28, 28..56, 56..84, 84..100]);
        // ... and never less than one element per rank.
        assert_eq!(pieces(40, 8, 2, 1), vec![0..16, 16..32, 32..40]);
        // A setting too large to multiply runs whole instead of overflowing.
        assert_eq!(pieces(100, 4, 3, usize::MAX), vec![0..100]);
        for (len, esz, n, piece) in [(1_000_003 * 4, 4, 3, 4099), (65_537 * 2, 2, 4, 512), (97 * 8, 8, 2, 24)] {
            let p = pieces(len, esz, n, piece);
            assert_eq!(p[0].start, 0);
            assert_eq!(p.last().unwrap().end, len);
            for w in p.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].len(), p[0].len(), "all but the last piece have one size");
            }
            assert!(p.iter().all(|r| r.start % esz == 0 && !r.is_empty()));
        }
    }
}
