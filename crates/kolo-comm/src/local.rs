//! `LocalComm`: ranks are threads of one process. It is the reference every other backend is
//! tested against, so it is written to be obviously correct rather than fast: each collective
//! deposits every rank's contribution on a shared board and each rank computes its result from
//! all of them, reducing in rank order.

use crate::communicator::{validate, Fingerprint, DEFAULT_TIMEOUT};
use crate::reduce::{finish_avg, reduce_into};
use crate::{BufMut, BufRef, CommError, Communicator, OpKind, ReduceOp};
use kolo_base::{shard_range, DType, Deadline, Rank, WorldSize};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

struct Round {
    fps: Vec<Option<Fingerprint>>,
    data: Vec<Option<Arc<Vec<u8>>>>,
    readers_left: usize,
}

struct Letter {
    tag: u32,
    dtype: DType,
    bytes: Vec<u8>,
}

#[derive(Default)]
struct State {
    rounds: HashMap<u64, Round>,
    mail: HashMap<(usize, usize), VecDeque<Letter>>,
    gone: HashMap<usize, String>,
    groups: HashMap<(u64, Vec<usize>), Arc<Shared>>,
}

struct Shared {
    n: WorldSize,
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn new(n: WorldSize) -> Arc<Shared> {
        Arc::new(Shared { n, state: Mutex::new(State::default()), cv: Condvar::new() })
    }
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One rank of an in-process group. Create all ranks at once with [`LocalComm::create`] and move
/// each into its own thread. Dropping a rank counts as that rank leaving: peers still waiting on
/// it get [`CommError::PeerLost`].
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: Rank,
    seq: AtomicU64,
    timeout: Mutex<Duration>,
    broken: Mutex<Option<CommError>>,
}

impl LocalComm {
    pub fn create(n: WorldSize) -> Vec<LocalComm> {
        let shared = Shared::new(n);
        n.ranks().map(|r| LocalComm::member(shared.clone(), r)).collect()
    }

    fn member(shared: Arc<Shared>, rank: Rank) -> LocalComm {
        LocalComm { shared, rank, seq: AtomicU64::new(0), timeout: Mutex::new(DEFAULT_TIMEOUT), broken: Mutex::new(None) }
    }

    fn guard<T>(&self, f: impl FnOnce() -> Result<T, CommError>) -> Result<T, CommError> {
        if let Some(e) = self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Err(e.into_aborted(self.rank));
        }
        let r = f();
        if let Err(e) = &r {
            if e.is_fatal() {
                *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
            }
        }
        r
    }

    /// Deposits this rank's contribution to the next collective and returns everyone's.
    fn exchange(&self, fp: Fingerprint, data: Vec<u8>) -> Result<Vec<Arc<Vec<u8>>>, CommError> {
        let n = self.shared.n.get();
        let me = self.rank.get();
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let deadline = Deadline::after(self.timeout());
        let mut st = self.shared.lock();
        let round = st.rounds.entry(seq).or_insert_with(|| Round { fps: vec![None; n], data: vec![None; n], readers_left: n });
        round.fps[me] = Some(fp);
        round.data[me] = Some(Arc::new(data));
        self.shared.cv.notify_all();
        loop {
            let round = &st.rounds[&seq];
            let missing: Vec<Rank> = (0..n).filter(|r| round.data[*r].is_none()).map(Rank).collect();
            if missing.is_empty() {
                break;
            }
            if let Some(r) = missing.iter().find(|r| st.gone.contains_key(&r.get())) {
                return Err(CommError::PeerLost { op: fp.op, rank: self.rank, seq, peer: *r, reason: st.gone[&r.get()].clone() });
            }
            if deadline.expired() {
                return Err(CommError::Timeout { op: fp.op, rank: self.rank, seq, waited: deadline.budget(), missing });
            }
            st = self.shared.cv.wait_timeout(st, deadline.remaining()).unwrap_or_else(|p| p.into_inner()).0;
        }
        let round = st.rounds.get_mut(&seq).expect("round exists until all readers are done");
        for (peer, theirs) in round.fps.iter().enumerate() {
            let theirs = theirs.expect("all deposited");
            if theirs != fp {
                return Err(CommError::Mismatch {
                    op: fp.op,
                    rank: self.rank,
                    seq,
                    peer: Rank(peer),
                    ours: fp.to_string(),
                    theirs: theirs.to_string(),
                });
            }
        }
        let all: Vec<Arc<Vec<u8>>> = round.data.iter().map(|d| d.clone().expect("all deposited")).collect();
        round.readers_left -= 1;
        if round.readers_left == 0 {
            st.rounds.remove(&seq);
        }
        Ok(all)
    }

    fn reduce_all(all: &[Arc<Vec<u8>>], dtype: DType, op: ReduceOp) -> Vec<u8> {
        let mut acc = all[0].to_vec();
        for c in &all[1..] {
            reduce_into(dtype, op, &mut acc, c);
        }
        finish_avg(dtype, op, &mut acc, all.len());
        acc
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.gone.insert(self.rank.get(), "it left the group (its communicator was dropped)".into());
        self.shared.cv.notify_all();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> WorldSize {
        self.shared.n
    }
    fn backend(&self) -> &'static str {
        "local"
    }
    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        self.guard(|| {
            let fp = Fingerprint { op: OpKind::AllReduce, dtype: Some(buf.dtype()), count: buf.len() as u64, extra: op.code().into() };
            let all = self.exchange(fp, buf.bytes().to_vec())?;
            let r = Self::reduce_all(&all, buf.dtype(), op);
            buf.bytes_mut().copy_from_slice(&r);
            Ok(())
        })
    }

    fn reduce(&self, mut buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError> {
        validate::root(OpKind::Reduce, self.rank, self.shared.n, root)?;
        self.guard(|| {
            let extra = (root.get() as u64) << 8 | u64::from(op.code());
            let fp = Fingerprint { op: OpKind::Reduce, dtype: Some(buf.dtype()), count: buf.len() as u64, extra };
            let all = self.exchange(fp, buf.bytes().to_vec())?;
            if self.rank == root {
                let r = Self::reduce_all(&all, buf.dtype(), op);
                buf.bytes_mut().copy_from_slice(&r);
            }
            Ok(())
        })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: Rank) -> Result<(), CommError> {
        validate::root(OpKind::Broadcast, self.rank, self.shared.n, root)?;
        self.guard(|| {
            let fp =
                Fingerprint { op: OpKind::Broadcast, dtype: Some(buf.dtype()), count: buf.len() as u64, extra: (root.get() as u64) << 8 };
            let data = if self.rank == root { buf.bytes().to_vec() } else { Vec::new() };
            let all = self.exchange(fp, data)?;
            buf.bytes_mut().copy_from_slice(&all[root.get()]);
            Ok(())
        })
    }

    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        validate::all_gather(self.rank, self.shared.n, &input, &output)?;
        self.guard(|| {
            let fp = Fingerprint { op: OpKind::AllGather, dtype: Some(input.dtype()), count: output.len() as u64, extra: 0 };
            let all = self.exchange(fp, input.bytes().to_vec())?;
            let out: Vec<u8> = all.iter().flat_map(|c| c.iter().copied()).collect();
            output.bytes_mut().copy_from_slice(&out);
            Ok(())
        })
    }

    fn reduce_scatter(&self, input: BufRef<'_>, mut output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        validate::reduce_scatter(self.rank, self.shared.n, &input, &output)?;
        self.guard(|| {
            let fp =
                Fingerprint { op: OpKind::ReduceScatter, dtype: Some(input.dtype()), count: input.len() as u64, extra: op.code().into() };
            let all = self.exchange(fp, input.bytes().to_vec())?;
            let full = Self::reduce_all(&all, input.dtype(), op);
            let esz = input.dtype().size_bytes();
            let r = shard_range(input.len(), self.shared.n, self.rank);
            output.bytes_mut().copy_from_slice(&full[r.start * esz..r.end * esz]);
            Ok(())
        })
    }

    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], mut output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError> {
        validate::all_to_all(self.rank, self.shared.n, &input, send_counts, &output, recv_counts)?;
        self.guard(|| {
            let n = self.shared.n.get();
            let fp = Fingerprint { op: OpKind::AllToAll, dtype: Some(input.dtype()), count: 0, extra: 0 };
            // Contribution: the send counts, then the data.
            let mut data = Vec::with_capacity(8 * n + input.bytes().len());
            for c in send_counts {
                data.extend_from_slice(&(*c as u64).to_le_bytes());
            }
            data.extend_from_slice(input.bytes());
            let all = self.exchange(fp, data)?;
            let esz = input.dtype().size_bytes();
            let me = self.rank.get();
            let mut out_off = 0;
            for (src, contrib) in all.iter().enumerate() {
                let counts: Vec<usize> =
                    contrib[..8 * n].chunks(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize).collect();
                if counts[me] != recv_counts[src] {
                    return Err(CommError::Mismatch {
                        op: OpKind::AllToAll,
                        rank: self.rank,
                        seq: self.seq.load(Ordering::SeqCst) - 1,
                        peer: Rank(src),
                        ours: format!("recv_counts[{src}] = {}", recv_counts[src]),
                        theirs: format!("send_counts[{me}] = {}", counts[me]),
                    });
                }
                let off: usize = counts[..me].iter().sum::<usize>() * esz;
                let len = counts[me] * esz;
                output.bytes_mut()[out_off..out_off + len].copy_from_slice(&contrib[8 * n + off..8 * n + off + len]);
                out_off += len;
            }
            Ok(())
        })
    }

    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        validate::peer(OpKind::Send, self.rank, self.shared.n, peer)?;
        self.guard(|| {
            let mut st = self.shared.lock();
            if let Some(why) = st.gone.get(&peer.get()) {
                return Err(CommError::PeerLost { op: OpKind::Send, rank: self.rank, seq: 0, peer, reason: why.clone() });
            }
            st.mail.entry((self.rank.get(), peer.get())).or_default().push_back(Letter {
                tag,
                dtype: buf.dtype(),
                bytes: buf.bytes().to_vec(),
            });
            self.shared.cv.notify_all();
            Ok(())
        })
    }

    fn recv(&self, mut buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        validate::peer(OpKind::Recv, self.rank, self.shared.n, peer)?;
        self.guard(|| {
            let deadline = Deadline::after(self.timeout());
            let key = (peer.get(), self.rank.get());
            let mut st = self.shared.lock();
            let letter = loop {
                if let Some(l) = st.mail.get_mut(&key).and_then(|q| q.pop_front()) {
                    break l;
                }
                if let Some(why) = st.gone.get(&peer.get()) {
                    return Err(CommError::PeerLost { op: OpKind::Recv, rank: self.rank, seq: 0, peer, reason: why.clone() });
                }
                if deadline.expired() {
                    return Err(CommError::Timeout {
                        op: OpKind::Recv,
                        rank: self.rank,
                        seq: 0,
                        waited: deadline.budget(),
                        missing: vec![peer],
                    });
                }
                st = self.shared.cv.wait_timeout(st, deadline.remaining()).unwrap_or_else(|p| p.into_inner()).0;
            };
            if letter.tag != tag || letter.dtype != buf.dtype() || letter.bytes.len() != buf.bytes().len() {
                return Err(CommError::Mismatch {
                    op: OpKind::Recv,
                    rank: self.rank,
                    seq: 0,
                    peer,
                    ours: format!("recv(tag {tag}, {} x {})", buf.dtype(), buf.len()),
                    theirs: format!("send(tag {}, {} x {})", letter.tag, letter.dtype, letter.bytes.len() / letter.dtype.size_bytes()),
                });
            }
            buf.bytes_mut().copy_from_slice(&letter.bytes);
            Ok(())
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.guard(|| {
            self.exchange(Fingerprint { op: OpKind::Barrier, dtype: None, count: 0, extra: 0 }, Vec::new())?;
            Ok(())
        })
    }

    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        validate::group(self.rank, self.shared.n, ranks)?;
        self.guard(|| {
            let members: Vec<usize> = ranks.iter().map(|r| r.get()).collect();
            let hash = members.iter().fold(1469598103934665603u64, |h, r| (h ^ *r as u64).wrapping_mul(1099511628211));
            let fp = Fingerprint { op: OpKind::NewGroup, dtype: None, count: members.len() as u64, extra: hash };
            let seq = self.seq.load(Ordering::SeqCst);
            self.exchange(fp, Vec::new())?;
            let Some(pos) = members.iter().position(|r| *r == self.rank.get()) else { return Ok(None) };
            let n = WorldSize::new(members.len()).expect("validated non-empty");
            let shared = self.shared.lock().groups.entry((seq, members)).or_insert_with(|| Shared::new(n)).clone();
            let g = LocalComm::member(shared, Rank(pos));
            g.set_timeout(self.timeout());
            Ok(Some(Arc::new(g) as Arc<dyn Communicator>))
        })
    }
}
