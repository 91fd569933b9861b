//! Recursive doubling all-reduce: log2(n) rounds, each exchanging the whole buffer with one
//! partner. Latency-optimal for small buffers. A world size that is not a power of two first
//! folds the extra ranks into partners and hands them the result at the end (as MPICH does).

use super::{fold_in, fold_out, largest_pow2, unfold_rank, Exec};
use kolo_base::DType;
use kolo_comm::reduce::finish_avg;
use kolo_comm::{CommError, ReduceOp, Scratch};

pub(crate) fn all_reduce(
    e: &mut Exec<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    send_scratch: &mut Scratch,
    recv_scratch: &mut Scratch,
) -> Result<(), CommError> {
    let n = e.n;
    let p = largest_pow2(n);
    let len = buf.len();
    let tmp = recv_scratch.get(super::REDUCE_WINDOW);
    if let Some(v) = fold_in(e, buf, dtype, op, tmp)? {
        let mut mask = 1;
        let mut step = 1u32;
        while mask < p {
            let partner = unfold_rank(n, v ^ mask);
            // The send must see this round's input while the receive folds into `buf`.
            let snap = send_scratch.get(len);
            crate::copy::copy_slice(snap, buf);
            let mut x = [e.send(partner, step, Some(dtype), snap), e.recv_reduce(partner, step, dtype, op, tmp, buf)];
            e.run(&mut x)?;
            mask <<= 1;
            step += 1;
        }
    }
    fold_out(e, buf, dtype)?;
    finish_avg(dtype, op, buf, n);
    Ok(())
}
