//! Rabenseifner's all-reduce: reduce-scatter by recursive halving, then all-gather by recursive
//! doubling. Each rank sends about 2(p-1)/p of the buffer in 2 log2(p) steps: the ring's volume
//! with logarithmic latency, the best choice for medium buffers. World sizes that are not a
//! power of two fold the extra ranks in first, as recursive doubling does.

use super::{byte_segments, fold_in, fold_out, largest_pow2, split_rw, unfold_rank, Exec};
use kolo_base::{DType, WorldSize};
use kolo_comm::reduce::finish_avg;
use kolo_comm::{CommError, ReduceOp, Scratch};

pub(crate) fn all_reduce(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, scratch: &mut Scratch) -> Result<(), CommError> {
    let n = e.n;
    let p = largest_pow2(n);
    let tmp = scratch.get(super::REDUCE_WINDOW);
    let esz = dtype.size_bytes();
    let vrank = fold_in(e, buf, dtype, op, tmp)?;
    let real = |v: usize| unfold_rank(n, v);
    if let Some(v) = vrank {
        let segs = byte_segments(buf.len() / esz, WorldSize::new(p).expect("p >= 1"), esz);
        let span = |lo: usize, hi: usize| segs[lo].start..segs[hi - 1].end;
        // Halving: keep the half of [lo, hi) that contains v, send the other half.
        let (mut lo, mut hi) = (0usize, p);
        let mut step = 1u32;
        let mut mask = p >> 1;
        while mask > 0 {
            let partner = real(v ^ mask);
            let mid = lo + (hi - lo) / 2;
            let (keep, give) = if v & mask == 0 { ((lo, mid), (mid, hi)) } else { ((mid, hi), (lo, mid)) };
            let (out, inp) = split_rw(buf, span(give.0, give.1), span(keep.0, keep.1));
            let mut x = [e.send(partner, step, Some(dtype), out), e.recv_reduce(partner, step, dtype, op, tmp, inp)];
            e.run(&mut x)?;
            (lo, hi) = keep;
            mask >>= 1;
            step += 1;
        }
        // Now [lo, hi) == [v, v+1) is final here.
        finish_avg(dtype, op, &mut buf[span(lo, hi)], n);
        // Doubling: exchange owned ranges with partners at growing distance.
        let mut mask = 1;
        while mask < p {
            let partner = real(v ^ mask);
            let size = hi - lo;
            let (plo, phi) = if v & mask == 0 { (hi, hi + size) } else { (lo - size, lo) };
            let (out, inp) = split_rw(buf, span(lo, hi), span(plo, phi));
            let mut x = [e.send(partner, step, Some(dtype), out), e.recv(partner, step, Some(dtype), inp)];
            e.run(&mut x)?;
            (lo, hi) = (lo.min(plo), hi.max(phi));
            mask <<= 1;
            step += 1;
        }
    }
    fold_out(e, buf, dtype)?;
    Ok(())
}
