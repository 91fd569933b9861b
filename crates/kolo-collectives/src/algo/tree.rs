//! Binomial trees rooted at any rank: `reduce` gathers partial results up the tree, `broadcast`
//! sends down it. Each takes ceil(log2 n) rounds.

use super::Exec;
use kolo_base::DType;
use kolo_comm::{CommError, ReduceOp, Scratch};

/// Reduces into `acc` on the root. `acc` is this rank's contribution (a scratch copy on
/// non-roots, which it overwrites with partial results).
pub(crate) fn reduce(
    e: &mut Exec<'_>,
    acc: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    root: usize,
    scratch: &mut Scratch,
) -> Result<(), CommError> {
    let n = e.n;
    let vr = (e.rank + n - root) % n;
    let tmp = scratch.get(super::REDUCE_WINDOW);
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            let parent = (vr - mask + root) % n;
            e.run(&mut [e.send(parent, mask.trailing_zeros(), Some(dtype), acc)])?;
            break;
        }
        if vr + mask < n {
            let child = (vr + mask + root) % n;
            e.run(&mut [e.recv_reduce(child, mask.trailing_zeros(), dtype, op, tmp, acc)])?;
        }
        mask <<= 1;
    }
    Ok(())
}

pub(crate) fn broadcast(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType, root: usize, step0: u32) -> Result<(), CommError> {
    let n = e.n;
    let vr = (e.rank + n - root) % n;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            let parent = (vr - mask + root) % n;
            e.run(&mut [e.recv(parent, step0 + mask.trailing_zeros(), Some(dtype), buf)])?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            let child = (vr + mask + root) % n;
            e.run(&mut [e.send(child, step0 + mask.trailing_zeros(), Some(dtype), buf)])?;
        }
        mask >>= 1;
    }
    Ok(())
}
