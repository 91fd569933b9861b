//! `Checked`: a debug wrapper that, before every collective, all-gathers a sequence-numbered
//! fingerprint (op, dtype, element count, root/reduce op) and compares it across ranks. A rank
//! that calls a different collective, or the same one with other arguments, gets
//! [`CommError::Mismatch`] naming both calls instead of a hang or corrupted data.

use crate::communicator::Fingerprint;
use crate::{BufMut, BufRef, CommError, Communicator, OpKind, ReduceOp};
use kolo_base::{Rank, WorldSize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

pub struct Checked {
    inner: Arc<dyn Communicator>,
    seq: AtomicU64,
}

impl Checked {
    pub fn new(inner: Arc<dyn Communicator>) -> Checked {
        Checked { inner, seq: AtomicU64::new(0) }
    }

    fn check(&self, fp: Fingerprint) -> Result<(), CommError> {
        let n = self.inner.world_size().get();
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let w = fp.to_words();
        let mine = [w[0], w[1], w[2], w[3], seq as i64];
        let mut all = vec![0i64; 5 * n];
        self.inner.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut all[..]))?;
        for (peer, theirs) in all.chunks(5).enumerate() {
            if theirs != mine {
                let desc = Fingerprint::from_words(theirs)
                    .map(|f| format!("{f} as call #{}", theirs[4]))
                    .unwrap_or_else(|| format!("an unknown call {theirs:?}"));
                return Err(CommError::Mismatch {
                    op: fp.op,
                    rank: self.inner.rank(),
                    seq,
                    peer: Rank(peer),
                    ours: format!("{fp} as call #{seq}"),
                    theirs: desc,
                });
            }
        }
        Ok(())
    }
}

impl Communicator for Checked {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }
    fn world_size(&self) -> WorldSize {
        self.inner.world_size()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.check(Fingerprint { op: OpKind::AllReduce, dtype: Some(buf.dtype()), count: buf.len() as u64, extra: op.code().into() })?;
        self.inner.all_reduce(buf, op)
    }
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError> {
        let extra = (root.get() as u64) << 8 | u64::from(op.code());
        self.check(Fingerprint { op: OpKind::Reduce, dtype: Some(buf.dtype()), count: buf.len() as u64, extra })?;
        self.inner.reduce(buf, op, root)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: Rank) -> Result<(), CommError> {
        self.check(Fingerprint {
            op: OpKind::Broadcast,
            dtype: Some(buf.dtype()),
            count: buf.len() as u64,
            extra: (root.get() as u64) << 8,
        })?;
        self.inner.broadcast(buf, root)
    }
    fn all_gather(&self, input: BufRef<'_>, output: BufMut<'_>) -> Result<(), CommError> {
        self.check(Fingerprint { op: OpKind::AllGather, dtype: Some(input.dtype()), count: output.len() as u64, extra: 0 })?;
        self.inner.all_gather(input, output)
    }
    fn reduce_scatter(&self, input: BufRef<'_>, output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.check(Fingerprint {
            op: OpKind::ReduceScatter,
            dtype: Some(input.dtype()),
            count: input.len() as u64,
            extra: op.code().into(),
        })?;
        self.inner.reduce_scatter(input, output, op)
    }
    fn reduce_scatter_in_place(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.check(Fingerprint { op: OpKind::ReduceScatter, dtype: Some(buf.dtype()), count: buf.len() as u64, extra: op.code().into() })?;
        self.inner.reduce_scatter_in_place(buf, op)
    }
    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError> {
        self.check(Fingerprint { op: OpKind::AllToAll, dtype: Some(input.dtype()), count: 0, extra: 0 })?;
        self.inner.all_to_all(input, send_counts, output, recv_counts)
    }
    /// Point-to-point calls involve two ranks only; they are passed through (the backends check
    /// tag, dtype and length of every message themselves).
    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        self.inner.send(buf, peer, tag)
    }
    fn recv(&self, buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        self.inner.recv(buf, peer, tag)
    }
    fn send_recv(&self, send: BufRef<'_>, to: Rank, send_tag: u32, recv: BufMut<'_>, from: Rank, recv_tag: u32) -> Result<(), CommError> {
        self.inner.send_recv(send, to, send_tag, recv, from, recv_tag)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.check(Fingerprint { op: OpKind::Barrier, dtype: None, count: 0, extra: 0 })?;
        self.inner.barrier()
    }
    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        self.check(Fingerprint { op: OpKind::NewGroup, dtype: None, count: ranks.len() as u64, extra: 0 })?;
        Ok(self.inner.new_group(ranks)?.map(|g| Arc::new(Checked::new(g)) as Arc<dyn Communicator>))
    }
}
