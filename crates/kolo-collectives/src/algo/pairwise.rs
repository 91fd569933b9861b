//! All-to-all by pairwise exchange (step s: send to r+s, receive from r-s) and the
//! dissemination barrier (round k: signal r+2^k, wait for r-2^k).

use super::Exec;
use kolo_base::DType;
use kolo_comm::CommError;
use std::ops::Range;

pub(crate) fn all_to_all(
    e: &mut Exec<'_>,
    input: &[u8],
    send: &[Range<usize>],
    output: &mut [u8],
    recv: &[Range<usize>],
    dtype: DType,
) -> Result<(), CommError> {
    let (n, r) = (e.n, e.rank);
    crate::copy::copy_slice(&mut output[recv[r].clone()], &input[send[r].clone()]);
    for s in 1..n {
        let to = (r + s) % n;
        let from = (r + n - s) % n;
        let mut x = [
            e.send(to, s as u32, Some(dtype), &input[send[to].clone()]),
            e.recv(from, s as u32, Some(dtype), &mut output[recv[from].clone()]),
        ];
        e.run(&mut x)?;
    }
    Ok(())
}

pub(crate) fn barrier(e: &mut Exec<'_>) -> Result<(), CommError> {
    let (n, r) = (e.n, e.rank);
    let mut dist = 1;
    let mut step = 0;
    while dist < n {
        let mut x = [e.send((r + dist) % n, step, None, &[]), e.recv((r + n - dist) % n, step, None, &mut [])];
        e.run(&mut x)?;
        dist <<= 1;
        step += 1;
    }
    Ok(())
}
