//! Recursive doubling all-reduce: log2(n) rounds, each exchanging the whole buffer with one
//! partner. Latency-optimal for small buffers. A world size that is not a power of two first
//! folds the extra ranks into partners and hands them the result at the end (as MPICH does).

use super::Exec;
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
    let (n, r) = (e.n, e.rank);
    let p = 1usize << (usize::BITS - 1 - n.leading_zeros()); // largest power of two <= n
    let rem = n - p;
    let len = buf.len();
    let tmp = recv_scratch.get(super::REDUCE_WINDOW);
    let mut step = 0u32;
    // Fold: among the first 2*rem ranks, even ones hand their data to the next odd one.
    let vrank: Option<usize> = if r < 2 * rem {
        if r % 2 == 0 {
            e.run(&mut [e.send(r + 1, step, Some(dtype), buf)])?;
            None
        } else {
            e.run(&mut [e.recv_reduce(r - 1, step, dtype, op, tmp, buf)])?;
            Some(r / 2)
        }
    } else {
        Some(r - rem)
    };
    step += 1;
    if let Some(v) = vrank {
        let mut mask = 1;
        while mask < p {
            let pv = v ^ mask;
            let partner = if pv < rem { pv * 2 + 1 } else { pv + rem };
            // The send must see this round's input while the receive folds into `buf`.
            let snap = send_scratch.get(len);
            snap.copy_from_slice(buf);
            let mut x = [e.send(partner, step, Some(dtype), snap), e.recv_reduce(partner, step, dtype, op, tmp, buf)];
            e.run(&mut x)?;
            mask <<= 1;
            step += 1;
        }
    }
    // Unfold: odd ranks hand the result back to their even partner.
    let last = 64;
    if r < 2 * rem {
        if r % 2 == 1 {
            e.run(&mut [e.send(r - 1, last, Some(dtype), buf)])?;
        } else {
            e.run(&mut [e.recv(r + 1, last, Some(dtype), buf)])?;
        }
    }
    finish_avg(dtype, op, buf, n);
    Ok(())
}
