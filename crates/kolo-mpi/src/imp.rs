//! The backend proper (feature `mpi`).

use kolo_base::{shard_range, DType, Rank, WorldSize};
use kolo_comm::communicator::validate;
use kolo_comm::reduce::finish_avg;
use kolo_comm::{bf16, f16, BufMut, BufRef, CommError, Communicator, OpKind, ReduceOp};
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Equivalence, Root, Source};
use mpi::Threading;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

/// The MPI environment: finalised at process exit (after `main` returns).
static UNIVERSE: OnceLock<Mutex<Option<UniverseCell>>> = OnceLock::new();
/// Every live communicator, for the watchdog.
static LIVE: Mutex<Vec<Weak<Inner>>> = Mutex::new(Vec::new());

struct UniverseCell(Universe);
// SAFETY: the universe is only touched under the mutex: once to make the world communicator
// and once at exit to finalise; MPI was initialised with MPI_THREAD_MULTIPLE.
unsafe impl Send for UniverseCell {}

extern "C" fn finalize_at_exit() {
    if let Some(m) = UNIVERSE.get() {
        if let Ok(mut g) = m.lock() {
            drop(g.take()); // MPI_Finalize
        }
    }
}

fn setup_err(what: String) -> CommError {
    CommError::Setup { op: OpKind::Setup, rank: Rank(0), what }
}

pub fn world(timeout: Duration) -> Result<Arc<dyn Communicator>, CommError> {
    let cell = UNIVERSE.get_or_init(|| {
        let u = mpi::initialize_with_threading(Threading::Multiple);
        // SAFETY: registering a plain extern "C" function.
        unsafe {
            libc::atexit(finalize_at_exit);
        }
        Mutex::new(u.map(|(u, level)| {
            if level < Threading::Multiple {
                kolo_base::eline!(
                    "kolo mpi: the MPI library grants {level:?} threading, not Multiple: Kolo's background communication may misbehave"
                );
            }
            UniverseCell(u)
        }))
    });
    let g = cell.lock().map_err(|_| setup_err("MPI environment lock poisoned".into()))?;
    let u = g.as_ref().ok_or_else(|| setup_err("MPI could not be initialised (or was initialised twice)".into()))?;
    let world = u.0.world();
    start_watchdog();
    Ok(MpiComm::wrap(world, timeout))
}

/// One MPI communicator: the operation in flight (for the watchdog) and the deadline.
struct Inner {
    comm: SimpleCommunicator,
    rank: usize,
    size: usize,
    timeout_ms: AtomicU64,
    seq: AtomicU64,
    in_flight: Mutex<Option<(OpKind, u64, Instant)>>,
}

// SAFETY: MPI was initialised with MPI_THREAD_MULTIPLE; the communicator handle is immutable.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

pub struct MpiComm(Arc<Inner>);

impl MpiComm {
    fn wrap(comm: SimpleCommunicator, timeout: Duration) -> Arc<dyn Communicator> {
        let inner = Arc::new(Inner {
            rank: comm.rank() as usize,
            size: comm.size() as usize,
            comm,
            timeout_ms: AtomicU64::new(timeout.as_millis().max(1) as u64),
            seq: AtomicU64::new(0),
            in_flight: Mutex::new(None),
        });
        LIVE.lock().unwrap_or_else(|p| p.into_inner()).push(Arc::downgrade(&inner));
        Arc::new(MpiComm(inner))
    }

    /// Runs `f` as operation `op`, visible to the watchdog while it runs.
    fn run<R>(&self, op: OpKind, f: impl FnOnce(&SimpleCommunicator) -> Result<R, CommError>) -> Result<R, CommError> {
        let seq = self.0.seq.fetch_add(1, Ordering::Relaxed);
        *self.0.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = Some((op, seq, Instant::now()));
        let r = f(&self.0.comm);
        *self.0.in_flight.lock().unwrap_or_else(|p| p.into_inner()) = None;
        r
    }

    fn bad(&self, op: OpKind, what: String) -> CommError {
        CommError::InvalidArgument { op, rank: Rank(self.0.rank), what }
    }
}

/// Aborts the job when an operation outlives its deadline (MPI calls cannot be cancelled).
fn start_watchdog() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("kolo-mpi-watchdog".into())
            .spawn(|| loop {
                std::thread::sleep(Duration::from_millis(100));
                let live: Vec<Arc<Inner>> = LIVE.lock().unwrap_or_else(|p| p.into_inner()).iter().filter_map(Weak::upgrade).collect();
                for c in live {
                    let late = *c.in_flight.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some((op, seq, since)) = late {
                        let limit = Duration::from_millis(c.timeout_ms.load(Ordering::Relaxed));
                        if since.elapsed() > limit {
                            kolo_base::eline!(
                                "kolo mpi: rank {} of {}: {op} #{seq} did not complete within {:.1} s (a rank never called it, or died); MPI cannot cancel it: aborting the job",
                                c.rank,
                                c.size,
                                limit.as_secs_f64()
                            );
                            c.comm.abort(70);
                        }
                    }
                }
            })
            .expect("spawning the MPI watchdog");
    });
}

fn system_op(op: ReduceOp) -> SystemOperation {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => SystemOperation::sum(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::Product => SystemOperation::product(),
    }
}

/// Little-endian bytes to values and back (buffers need not be aligned).
trait Wire: Sized + Copy + Default + Equivalence {
    const SIZE: usize;
    fn read(b: &[u8]) -> Self;
    fn write(self, b: &mut [u8]);
}

macro_rules! wire {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn read(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("element size"))
            }
            fn write(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
        }
    )*};
}
wire!(f32, f64, i32, i64, u8);

fn to_vec<T: Wire>(b: &[u8]) -> Vec<T> {
    b.chunks_exact(T::SIZE).map(T::read).collect()
}

fn write_back<T: Wire>(v: &[T], b: &mut [u8]) {
    for (x, c) in v.iter().zip(b.chunks_exact_mut(T::SIZE)) {
        x.write(c);
    }
}

/// How a reduction sees a buffer: typed values (half precision widened to f32).
enum Values {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

impl Values {
    fn from_bytes(d: DType, b: &[u8]) -> Values {
        match d {
            DType::F32 => Values::F32(to_vec(b)),
            DType::F64 => Values::F64(to_vec(b)),
            DType::I32 => Values::I32(to_vec(b)),
            DType::I64 => Values::I64(to_vec(b)),
            DType::U8 => Values::U8(b.to_vec()),
            DType::F16 => Values::F32(b.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
            DType::BF16 => Values::F32(b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect()),
        }
    }

    fn zeros_like(&self) -> Values {
        match self {
            Values::F32(v) => Values::F32(vec![0.0; v.len()]),
            Values::F64(v) => Values::F64(vec![0.0; v.len()]),
            Values::I32(v) => Values::I32(vec![0; v.len()]),
            Values::I64(v) => Values::I64(vec![0; v.len()]),
            Values::U8(v) => Values::U8(vec![0; v.len()]),
        }
    }

    fn write(&self, d: DType, b: &mut [u8]) {
        match (self, d) {
            (Values::F32(v), DType::F16) => {
                v.iter().zip(b.chunks_exact_mut(2)).for_each(|(x, c)| c.copy_from_slice(&f16::from_f32(*x).to_le_bytes()))
            }
            (Values::F32(v), DType::BF16) => {
                v.iter().zip(b.chunks_exact_mut(2)).for_each(|(x, c)| c.copy_from_slice(&bf16::from_f32(*x).to_le_bytes()))
            }
            (Values::F32(v), _) => write_back(v, b),
            (Values::F64(v), _) => write_back(v, b),
            (Values::I32(v), _) => write_back(v, b),
            (Values::I64(v), _) => write_back(v, b),
            (Values::U8(v), _) => b.copy_from_slice(v),
        }
    }
}

macro_rules! on_values {
    ($a:expr, $b:expr, |$x:ident, $y:ident| $body:expr) => {
        match ($a, $b) {
            (Values::F32($x), Values::F32($y)) => $body,
            (Values::F64($x), Values::F64($y)) => $body,
            (Values::I32($x), Values::I32($y)) => $body,
            (Values::I64($x), Values::I64($y)) => $body,
            (Values::U8($x), Values::U8($y)) => $body,
            _ => unreachable!("same kind"),
        }
    };
}

fn i32_counts(op: OpKind, rank: usize, v: impl Iterator<Item = usize>) -> Result<(Vec<i32>, Vec<i32>), CommError> {
    let counts: Vec<i32> = v
        .map(|c| {
            i32::try_from(c).map_err(|_| CommError::InvalidArgument {
                op,
                rank: Rank(rank),
                what: format!("{c} bytes exceed MPI's 2^31 count"),
            })
        })
        .collect::<Result<_, _>>()?;
    let displs = counts
        .iter()
        .scan(0i32, |s, c| {
            let d = *s;
            *s += c;
            Some(d)
        })
        .collect();
    Ok((counts, displs))
}

impl Communicator for MpiComm {
    fn rank(&self) -> Rank {
        Rank(self.0.rank)
    }
    fn world_size(&self) -> WorldSize {
        WorldSize::new(self.0.size).expect("MPI communicators are not empty")
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        // Every rank passes the same length; MPI rejects two empty (equal, dangling) buffers.
        if buf.is_empty() {
            return Ok(());
        }
        let d = buf.dtype();
        let send = Values::from_bytes(d, buf.bytes());
        let mut recv = send.zeros_like();
        self.run(OpKind::AllReduce, |c| {
            on_values!(&send, &mut recv, |s, r| c.all_reduce_into(&s[..], &mut r[..], system_op(op)));
            Ok(())
        })?;
        recv.write(d, buf.bytes_mut());
        finish_avg(d, op, buf.bytes_mut(), self.0.size);
        Ok(())
    }

    fn reduce(&self, mut buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError> {
        if root.get() >= self.0.size {
            return Err(self.bad(OpKind::Reduce, format!("root {root} of {} ranks", self.0.size)));
        }
        if buf.is_empty() {
            return Ok(());
        }
        let d = buf.dtype();
        let send = Values::from_bytes(d, buf.bytes());
        let mut recv = send.zeros_like();
        let me = root.get() == self.0.rank;
        self.run(OpKind::Reduce, |c| {
            let p = c.process_at_rank(root.get() as i32);
            if me {
                on_values!(&send, &mut recv, |s, r| p.reduce_into_root(&s[..], &mut r[..], system_op(op)));
            } else {
                match &send {
                    Values::F32(s) => p.reduce_into(&s[..], system_op(op)),
                    Values::F64(s) => p.reduce_into(&s[..], system_op(op)),
                    Values::I32(s) => p.reduce_into(&s[..], system_op(op)),
                    Values::I64(s) => p.reduce_into(&s[..], system_op(op)),
                    Values::U8(s) => p.reduce_into(&s[..], system_op(op)),
                }
            }
            Ok(())
        })?;
        if me {
            recv.write(d, buf.bytes_mut());
            finish_avg(d, op, buf.bytes_mut(), self.0.size);
        }
        Ok(())
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: Rank) -> Result<(), CommError> {
        if root.get() >= self.0.size {
            return Err(self.bad(OpKind::Broadcast, format!("root {root} of {} ranks", self.0.size)));
        }
        if buf.is_empty() {
            return Ok(());
        }
        self.run(OpKind::Broadcast, |c| {
            c.process_at_rank(root.get() as i32).broadcast_into(buf.bytes_mut());
            Ok(())
        })
    }

    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        let (n, esz, len) = (self.0.size, output.dtype().size_bytes(), output.len());
        let ws = self.world_size();
        validate::all_gather(self.rank(), ws, &input, &output)?;
        if len == 0 {
            return Ok(());
        }
        let (counts, displs) = i32_counts(OpKind::AllGather, self.0.rank, (0..n).map(|r| shard_range(len, ws, Rank(r)).len() * esz))?;
        let spare = [0u8; 1];
        self.run(OpKind::AllGather, |c| {
            let mut part = PartitionMut::new(output.bytes_mut(), &counts[..], &displs[..]);
            // An empty shard still needs a pointer of its own.
            let send: &[u8] = if input.is_empty() { &spare[..0] } else { input.bytes() };
            c.all_gather_varcount_into(send, &mut part);
            Ok(())
        })
    }

    fn reduce_scatter(&self, input: BufRef<'_>, mut output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        validate::reduce_scatter(self.rank(), self.world_size(), &input, &output)?;
        let own = shard_range(input.len(), self.world_size(), self.rank());
        // An all-reduce, then this rank's shard.
        if input.is_empty() {
            return Ok(());
        }
        let mut whole = input.bytes().to_vec();
        self.all_reduce(BufMut::from_bytes(input.dtype(), &mut whole).expect("whole elements"), op)?;
        let esz = input.dtype().size_bytes();
        output.bytes_mut().copy_from_slice(&whole[own.start * esz..own.end * esz]);
        Ok(())
    }

    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], mut output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError> {
        let (n, esz) = (self.0.size, input.dtype().size_bytes());
        if send_counts.len() != n
            || recv_counts.len() != n
            || send_counts.iter().sum::<usize>() != input.len()
            || recv_counts.iter().sum::<usize>() != output.len()
        {
            return Err(self.bad(
                OpKind::AllToAll,
                format!("counts {send_counts:?} / {recv_counts:?} for buffers of {} / {} on {n} ranks", input.len(), output.len()),
            ));
        }
        let (sc, sd) = i32_counts(OpKind::AllToAll, self.0.rank, send_counts.iter().map(|c| c * esz))?;
        let (rc, rd) = i32_counts(OpKind::AllToAll, self.0.rank, recv_counts.iter().map(|c| c * esz))?;
        // Empty buffers get pointers of their own (MPI rejects equal send and receive pointers).
        let (spare_in, mut spare_out) = ([0u8; 1], [0u8; 1]);
        let in_bytes: &[u8] = if input.is_empty() { &spare_in[..] } else { input.bytes() };
        let out_bytes: &mut [u8] = if output.is_empty() { &mut spare_out[..] } else { output.bytes_mut() };
        self.run(OpKind::AllToAll, |c| {
            let send = Partition::new(in_bytes, &sc[..], &sd[..]);
            let mut recv = PartitionMut::new(out_bytes, &rc[..], &rd[..]);
            c.all_to_all_varcount_into(&send, &mut recv);
            Ok(())
        })
    }

    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        if peer.get() >= self.0.size {
            return Err(self.bad(OpKind::Send, format!("peer {peer} of {} ranks", self.0.size)));
        }
        self.run(OpKind::Send, |c| {
            c.process_at_rank(peer.get() as i32).send_with_tag(buf.bytes(), tag as i32);
            Ok(())
        })
    }

    fn recv(&self, mut buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        if peer.get() >= self.0.size {
            return Err(self.bad(OpKind::Recv, format!("peer {peer} of {} ranks", self.0.size)));
        }
        let want = buf.bytes().len();
        let (rank, seq) = (Rank(self.0.rank), self.0.seq.load(Ordering::Relaxed));
        self.run(OpKind::Recv, |c| {
            let st = c.process_at_rank(peer.get() as i32).receive_into_with_tag(buf.bytes_mut(), tag as i32);
            let got = st.count(u8::equivalent_datatype()) as usize;
            if got != want {
                return Err(CommError::Protocol {
                    op: OpKind::Recv,
                    rank,
                    seq,
                    peer,
                    what: format!("{got} bytes with tag {tag}, expected {want}"),
                });
            }
            Ok(())
        })
    }

    fn send_recv(
        &self,
        send: BufRef<'_>,
        to: Rank,
        send_tag: u32,
        mut recv: BufMut<'_>,
        from: Rank,
        recv_tag: u32,
    ) -> Result<(), CommError> {
        if to.get() >= self.0.size || from.get() >= self.0.size {
            return Err(self.bad(OpKind::Send, format!("peers {to} / {from} of {} ranks", self.0.size)));
        }
        let want = recv.bytes().len();
        let (rank, seq) = (Rank(self.0.rank), self.0.seq.load(Ordering::Relaxed));
        self.run(OpKind::Send, |c| {
            let st = mpi::point_to_point::send_receive_into_with_tags(
                send.bytes(),
                &c.process_at_rank(to.get() as i32),
                send_tag as i32,
                recv.bytes_mut(),
                &c.process_at_rank(from.get() as i32),
                recv_tag as i32,
            );
            let got = st.count(u8::equivalent_datatype()) as usize;
            if got != want {
                return Err(CommError::Protocol {
                    op: OpKind::Recv,
                    rank,
                    seq,
                    peer: from,
                    what: format!("{got} bytes with tag {recv_tag}, expected {want}"),
                });
            }
            Ok(())
        })
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.run(OpKind::Barrier, |c| {
            c.barrier();
            Ok(())
        })
    }

    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        kolo_comm::communicator::validate::group(self.rank(), self.world_size(), ranks)?;
        // Every rank must pass the same list: compare a hash of it.
        let hash = ranks.iter().fold(1469598103934665603u64, |h, r| (h ^ r.get() as u64).wrapping_mul(1099511628211)) as i64;
        let mut v = [hash, -hash];
        self.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Max)?;
        if v[0] != hash || v[1] != -hash {
            return Err(CommError::Mismatch {
                op: OpKind::NewGroup,
                rank: self.rank(),
                seq: self.0.seq.load(Ordering::Relaxed),
                peer: self.rank(),
                ours: format!("new_group({ranks:?})"),
                theirs: "a different rank list on some rank".into(),
            });
        }
        let pos = ranks.iter().position(|r| r.get() == self.0.rank);
        let color = if pos.is_some() { Color::with_value(0) } else { Color::undefined() };
        let sub = self.run(OpKind::NewGroup, |c| Ok(c.split_by_color_with_key(color, pos.unwrap_or(0) as i32)))?;
        let timeout = self.timeout();
        Ok(sub.map(|s| MpiComm::wrap(s, timeout)))
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.0.timeout_ms.load(Ordering::Relaxed))
    }
    fn set_timeout(&self, timeout: Duration) {
        self.0.timeout_ms.store(timeout.as_millis().max(1) as u64, Ordering::Relaxed);
    }
}
