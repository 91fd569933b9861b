//! Collective algorithms over the progress engine. One file per algorithm family; each function
//! takes an [`Exec`] (the links plus who/what/when for headers and errors) and plain byte buffers.

pub(crate) mod doubling;
pub(crate) mod halving;
pub(crate) mod pairwise;
pub(crate) mod ring;
pub(crate) mod tree;

use crate::engine::{drive, drive_paced, Dir, OpCtx, Xfer};
use crate::frame::Header;
use crate::link::Link;
use kolo_base::{even_split, DType, WorldSize};
use kolo_comm::CommError;
use std::ops::Range;

/// Bytes of the window a reducing receive lands in before being folded into its destination.
pub(crate) const REDUCE_WINDOW: usize = 256 << 10;

/// Algorithm codes carried in every header, so ranks that chose differently notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Algorithm {
    P2p = 0,
    Ring = 1,
    RecursiveDoubling = 2,
    Tree = 3,
    Pairwise = 4,
    Dissemination = 5,
    Hierarchical = 6,
    HalvingDoubling = 7,
}

impl Algorithm {
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::P2p => "p2p",
            Algorithm::Ring => "ring",
            Algorithm::RecursiveDoubling => "doubling",
            Algorithm::Tree => "tree",
            Algorithm::Pairwise => "pairwise",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::HalvingDoubling => "halving",
        }
    }
}

pub(crate) struct Exec<'c> {
    pub links: &'c mut [Option<Link>],
    pub ctx: OpCtx,
    pub rank: usize,
    pub n: usize,
    pub alg: Algorithm,
    pub live: Option<&'c crate::liveness::Liveness>,
    /// Bytes of each rank's segment in one piece of a ring all-reduce (0: the whole buffer in
    /// one piece); see `ring::all_reduce`.
    pub ring_piece: usize,
}

impl Exec<'_> {
    pub fn header(&self, step: u32, dtype: Option<DType>, len: usize) -> Header {
        let (red, root) = (self.ctx.red, self.ctx.root);
        Header { op: self.ctx.op, dtype, alg: self.alg as u8, seq: self.ctx.seq, step, tag: 0, len: len as u64, red, root }
    }

    pub fn send<'a>(&self, peer: usize, step: u32, dtype: Option<DType>, data: &'a [u8]) -> Xfer<'a> {
        Xfer::new(peer, self.header(step, dtype, data.len()), Dir::Send(data))
    }

    pub fn recv<'a>(&self, peer: usize, step: u32, dtype: Option<DType>, dst: &'a mut [u8]) -> Xfer<'a> {
        Xfer::new(peer, self.header(step, dtype, dst.len()), Dir::Recv(dst))
    }

    pub fn recv_reduce<'a>(
        &self,
        peer: usize,
        step: u32,
        dtype: DType,
        op: kolo_comm::ReduceOp,
        tmp: &'a mut [u8],
        dst: &'a mut [u8],
    ) -> Xfer<'a> {
        let h = self.header(step, Some(dtype), dst.len());
        let w = tmp.len().min(dst.len().div_ceil(8) * 8).max(8);
        Xfer::new(peer, h, Dir::RecvReduce { tmp: &mut tmp[..w], dst, op, dtype })
    }

    pub fn run(&mut self, xfers: &mut [Xfer<'_>]) -> Result<(), CommError> {
        drive(self.links, xfers, &self.ctx, self.live)
    }

    /// Runs one ring step, `[send to the right, receive from the left]`, paced over TCP.
    pub fn run_ring_step(&mut self, xfers: &mut [Xfer<'_>; 2]) -> Result<(), CommError> {
        drive_paced(self.links, xfers, &self.ctx, self.live)
    }

    pub fn world(&self) -> WorldSize {
        WorldSize::new(self.n).expect("n >= 1")
    }
}

/// Byte ranges of the `n` segments of a buffer of `len` elements of `esz` bytes.
pub(crate) fn byte_segments(len: usize, n: WorldSize, esz: usize) -> Vec<Range<usize>> {
    even_split(len, n).map(|r| r.start * esz..r.end * esz).collect()
}

/// Borrows `a` for reading and `b` for writing out of one buffer; the ranges must not overlap.
pub(crate) fn split_rw(buf: &mut [u8], a: Range<usize>, b: Range<usize>) -> (&[u8], &mut [u8]) {
    assert!(a.end <= b.start || b.end <= a.start || a.is_empty() || b.is_empty(), "overlapping ranges {a:?} {b:?}");
    if a.is_empty() {
        return (&[], &mut buf[b]);
    }
    if b.is_empty() {
        return (&buf[a], &mut []);
    }
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

/// Folding a non-power-of-two world into the largest power of two `p <= n` (as MPICH does):
/// among the first `2 * (n - p)` ranks, each even rank hands its data to the next odd rank and
/// sits out. Returns this rank's virtual rank in `0..p`, or `None` if it sits out.
pub(crate) fn fold_in(
    e: &mut Exec<'_>,
    buf: &mut [u8],
    dtype: DType,
    op: kolo_comm::ReduceOp,
    tmp: &mut [u8],
) -> Result<Option<usize>, CommError> {
    let (n, r) = (e.n, e.rank);
    let rem = n - largest_pow2(n);
    if r >= 2 * rem {
        return Ok(Some(r - rem));
    }
    if r % 2 == 0 {
        e.run(&mut [e.send(r + 1, 0, Some(dtype), buf)])?;
        Ok(None)
    } else {
        e.run(&mut [e.recv_reduce(r - 1, 0, dtype, op, tmp, buf)])?;
        Ok(Some(r / 2))
    }
}

/// The inverse of [`fold_in`]: odd ranks hand the result back to the even rank that sat out.
pub(crate) fn fold_out(e: &mut Exec<'_>, buf: &mut [u8], dtype: DType) -> Result<(), CommError> {
    let (n, r) = (e.n, e.rank);
    let rem = n - largest_pow2(n);
    const LAST: u32 = 64;
    if r < 2 * rem {
        if r % 2 == 1 {
            e.run(&mut [e.send(r - 1, LAST, Some(dtype), buf)])?;
        } else {
            e.run(&mut [e.recv(r + 1, LAST, Some(dtype), buf)])?;
        }
    }
    Ok(())
}

pub(crate) fn largest_pow2(n: usize) -> usize {
    1usize << (usize::BITS - 1 - n.leading_zeros())
}

/// The real rank of virtual rank `v` after [`fold_in`].
pub(crate) fn unfold_rank(n: usize, v: usize) -> usize {
    let rem = n - largest_pow2(n);
    if v < rem {
        v * 2 + 1
    } else {
        v + rem
    }
}
