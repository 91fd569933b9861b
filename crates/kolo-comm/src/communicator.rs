use crate::{BufMut, BufRef, CommError, OpKind, ReduceOp};
use kolo_base::{shard_range, DType, Rank, WorldSize};
use std::sync::Arc;
use std::time::Duration;

/// Default deadline of one collective. Generous, because a collective can legitimately wait for a
/// slow rank's compute; lower it for tests and interactive runs.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// A group of ranks that can run collectives together. Backends are leaves: strategies take
/// `&dyn Communicator`, never a concrete backend.
///
/// Every call is blocking and bounded by the communicator's timeout. Collectives must be called by
/// every rank of the group in the same order with matching arguments; backends detect mismatches
/// they can see and report them as [`CommError::Mismatch`] (wrap with [`crate::Checked`] to check
/// every call). After a fatal error the communicator stays failed ([`CommError::Aborted`]).
///
/// Shard layout: `all_gather` and `reduce_scatter` split a buffer of `L` elements with
/// [`kolo_base::even_split`], so `L` need not be divisible by the world size.
pub trait Communicator: Send + Sync {
    fn rank(&self) -> Rank;
    fn world_size(&self) -> WorldSize;
    /// Short backend name for messages ("tcp", "local", …).
    fn backend(&self) -> &'static str;

    /// In place: every rank ends with the element-wise reduction of all ranks' buffers.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError>;
    /// The reduction lands in `root`'s buffer; other ranks' buffers are left unchanged.
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError>;
    /// `root`'s buffer is copied to every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: Rank) -> Result<(), CommError>;
    /// `output` has `L` elements; `input` is this rank's shard of it (`shard_range(L, n, rank)`).
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), CommError>;
    /// `input` has `L` elements; `output` receives this rank's shard of their reduction.
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError>;
    /// `reduce_scatter` that uses `buf` (the whole input) as its working space instead of a
    /// copy (MPI's `MPI_IN_PLACE`): afterwards this rank's shard of `buf` (`shard_range`)
    /// holds the reduced values and the rest of `buf` is unspecified. Peers may call either form.
    fn reduce_scatter_in_place(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let own = shard_range(buf.len(), self.world_size(), self.rank());
        let esz = buf.dtype().size_bytes();
        let mut out = vec![0u8; own.len() * esz];
        let input = buf.as_ref();
        self.reduce_scatter(input, BufMut::from_bytes(input.dtype(), &mut out).expect("whole elements"), op)?;
        buf.bytes_mut()[own.start * esz..own.end * esz].copy_from_slice(&out);
        Ok(())
    }
    /// Rank i sends `send_counts[j]` elements (consecutive in `input`) to rank j and receives
    /// `recv_counts[j]` elements from rank j into consecutive places of `output`.
    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError>;
    /// Point-to-point. Messages between a pair are delivered in order; `tag` and length must match.
    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError>;
    fn recv(&self, buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError>;
    /// Sends `send` to `to` and receives `recv` from `from` at the same time (MPI_Sendrecv), so
    /// that two ranks sending to each other never wait on each other's send (pipeline stages
    /// pass activations one way and gradients the other). This default sends, then receives:
    /// right for backends whose sends are buffered; backends that may block in a send override it.
    fn send_recv(&self, send: BufRef<'_>, to: Rank, send_tag: u32, recv: BufMut<'_>, from: Rank, recv_tag: u32) -> Result<(), CommError> {
        self.send(send, to, send_tag)?;
        self.recv(recv, from, recv_tag)
    }
    fn barrier(&self) -> Result<(), CommError>;

    /// Collective over this group: every rank calls it with the same `ranks`. Members get a
    /// communicator in which `ranks[i]` has rank `i`; the others get `None`.
    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError>;

    fn timeout(&self) -> Duration;
    fn set_timeout(&self, timeout: Duration);
}

/// Splits `comm` like `MPI_Comm_split`: ranks with the same `color` form a group, ordered by
/// `(key, rank)`; `color = None` opts out. Collective over `comm`.
pub fn split(comm: &dyn Communicator, color: Option<u32>, key: u32) -> Result<Option<Arc<dyn Communicator>>, CommError> {
    let n = comm.world_size().get();
    let me = [color.map_or(-1, i64::from), i64::from(key)];
    let mut all = vec![0i64; 2 * n];
    comm.all_gather(BufRef::from(&me[..]), BufMut::from(&mut all[..]))?;
    let mut colors: Vec<i64> = all.chunks(2).map(|c| c[0]).filter(|c| *c >= 0).collect();
    colors.sort_unstable();
    colors.dedup();
    let mut mine = None;
    for c in colors {
        let mut members: Vec<(i64, usize)> = all.chunks(2).enumerate().filter(|(_, v)| v[0] == c).map(|(r, v)| (v[1], r)).collect();
        members.sort_unstable();
        let ranks: Vec<Rank> = members.into_iter().map(|(_, r)| Rank(r)).collect();
        if let Some(g) = comm.new_group(&ranks)? {
            mine = Some(g);
        }
    }
    Ok(mine)
}

/// Argument checks shared by every backend, so that all of them reject the same calls with the
/// same messages.
pub mod validate {
    use super::*;

    fn bad(op: OpKind, rank: Rank, what: String) -> CommError {
        CommError::InvalidArgument { op, rank, what }
    }

    pub fn root(op: OpKind, rank: Rank, n: WorldSize, root: Rank) -> Result<(), CommError> {
        if n.contains(root) {
            Ok(())
        } else {
            Err(bad(op, rank, format!("root {root} is not in a group of {n}")))
        }
    }

    pub fn peer(op: OpKind, rank: Rank, n: WorldSize, peer: Rank) -> Result<(), CommError> {
        if !n.contains(peer) {
            Err(bad(op, rank, format!("peer {peer} is not in a group of {n}")))
        } else if peer == rank {
            Err(bad(op, rank, "a rank cannot send to or receive from itself".into()))
        } else {
            Ok(())
        }
    }

    fn same_dtype(op: OpKind, rank: Rank, a: DType, b: DType) -> Result<(), CommError> {
        if a == b {
            Ok(())
        } else {
            Err(bad(op, rank, format!("input is {a} but output is {b}")))
        }
    }

    /// Members of a new group: non-empty, in range, no duplicates.
    pub fn group(rank: Rank, n: WorldSize, ranks: &[Rank]) -> Result<(), CommError> {
        let op = OpKind::NewGroup;
        if ranks.is_empty() {
            return Err(bad(op, rank, "a group needs at least one rank".into()));
        }
        let mut seen = vec![false; n.get()];
        for r in ranks {
            if !n.contains(*r) {
                return Err(bad(op, rank, format!("rank {r} is not in the parent group of {n}")));
            }
            if std::mem::replace(&mut seen[r.get()], true) {
                return Err(bad(op, rank, format!("rank {r} is listed twice")));
            }
        }
        Ok(())
    }

    pub fn all_gather(rank: Rank, n: WorldSize, input: &BufRef<'_>, output: &BufMut<'_>) -> Result<(), CommError> {
        same_dtype(OpKind::AllGather, rank, input.dtype(), output.dtype())?;
        let want = shard_range(output.len(), n, rank).len();
        if input.len() != want {
            return Err(bad(
                OpKind::AllGather,
                rank,
                format!("input has {} elements but this rank's shard of a {}-element output is {want}", input.len(), output.len()),
            ));
        }
        Ok(())
    }

    pub fn reduce_scatter(rank: Rank, n: WorldSize, input: &BufRef<'_>, output: &BufMut<'_>) -> Result<(), CommError> {
        same_dtype(OpKind::ReduceScatter, rank, input.dtype(), output.dtype())?;
        let want = shard_range(input.len(), n, rank).len();
        if output.len() != want {
            return Err(bad(
                OpKind::ReduceScatter,
                rank,
                format!("output has {} elements but this rank's shard of a {}-element input is {want}", output.len(), input.len()),
            ));
        }
        Ok(())
    }

    pub fn all_to_all(
        rank: Rank,
        n: WorldSize,
        input: &BufRef<'_>,
        send_counts: &[usize],
        output: &BufMut<'_>,
        recv_counts: &[usize],
    ) -> Result<(), CommError> {
        let op = OpKind::AllToAll;
        same_dtype(op, rank, input.dtype(), output.dtype())?;
        if send_counts.len() != n.get() || recv_counts.len() != n.get() {
            return Err(bad(op, rank, format!("send_counts and recv_counts need {n} entries each")));
        }
        if send_counts.iter().sum::<usize>() != input.len() {
            return Err(bad(
                op,
                rank,
                format!("send_counts add up to {} but input has {}", send_counts.iter().sum::<usize>(), input.len()),
            ));
        }
        if recv_counts.iter().sum::<usize>() != output.len() {
            return Err(bad(
                op,
                rank,
                format!("recv_counts add up to {} but output has {}", recv_counts.iter().sum::<usize>(), output.len()),
            ));
        }
        if send_counts[rank.get()] != recv_counts[rank.get()] {
            return Err(bad(op, rank, "send_counts[rank] must equal recv_counts[rank]".into()));
        }
        Ok(())
    }
}

/// A compact description of one call, compared across ranks to catch mismatched collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub op: OpKind,
    pub dtype: Option<DType>,
    /// Elements (the full length `L` for all_gather and reduce_scatter).
    pub count: u64,
    /// Root, reduce op, or other op-specific value that all ranks must agree on.
    pub extra: u64,
}

impl Fingerprint {
    pub fn to_words(self) -> [i64; 4] {
        [i64::from(self.op.code()), self.dtype.map_or(0, |d| i64::from(d.code())), self.count as i64, self.extra as i64]
    }

    pub fn from_words(w: &[i64]) -> Option<Fingerprint> {
        let op = OpKind::from_code(u8::try_from(w.first().copied()?).ok()?)?;
        let dtype = match *w.get(1)? {
            0 => None,
            c => Some(DType::from_code(u8::try_from(c).ok()?)?),
        };
        Some(Fingerprint { op, dtype, count: *w.get(2)? as u64, extra: *w.get(3)? as u64 })
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.dtype {
            Some(d) => write!(f, "{}({} x {}", self.op, d, self.count)?,
            None => write!(f, "{}(", self.op)?,
        }
        match self.op {
            OpKind::Reduce | OpKind::Broadcast => write!(f, ", root {}", self.extra >> 8)?,
            _ => {}
        }
        f.write_str(")")
    }
}
