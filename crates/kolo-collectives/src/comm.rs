use crate::algo::{doubling, halving, pairwise, ring, tree, Algorithm, Exec};
use crate::connect::connect_group;
use crate::engine::{drive, Dir, OpCtx, Xfer};
use crate::frame::Header;
use crate::link::Link;
use crate::liveness::Liveness;
use kolo_base::{shard_range, ByteSize, DType, Deadline, Rank, WorldSize};
use kolo_comm::communicator::validate;
use kolo_comm::{BufMut, BufRef, CommError, Communicator, OpKind, ReduceOp, Scratch, DEFAULT_TIMEOUT};
use kolo_rendezvous::{JobToken, Store, TcpStoreServer};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// Which links a group uses between ranks on the same host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// Shared memory between ranks on one host, TCP across hosts.
    Auto,
    Tcp,
    /// Shared memory only (every rank on one host).
    Shm,
}

impl std::str::FromStr for Transport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Transport::Auto),
            "tcp" => Ok(Transport::Tcp),
            "shm" => Ok(Transport::Shm),
            _ => Err(format!("unknown transport `{s}` (auto, tcp, shm)")),
        }
    }
}

/// How `all_reduce` picks its algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AlgorithmChoice {
    /// By message size and world size (see [`HostComm::pick_all_reduce`]).
    Auto,
    Ring,
    RecursiveDoubling,
    /// Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather.
    HalvingDoubling,
    Tree,
    /// Two levels when ranks share hosts: within each host, across hosts, within each host.
    Hierarchical,
}

impl std::str::FromStr for AlgorithmChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(AlgorithmChoice::Auto),
            "ring" => Ok(AlgorithmChoice::Ring),
            "doubling" | "recursive-doubling" => Ok(AlgorithmChoice::RecursiveDoubling),
            "halving" | "rabenseifner" => Ok(AlgorithmChoice::HalvingDoubling),
            "tree" => Ok(AlgorithmChoice::Tree),
            "hierarchical" => Ok(AlgorithmChoice::Hierarchical),
            _ => Err(format!("unknown algorithm `{s}` (auto, ring, doubling, halving, tree, hierarchical)")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct HostCommConfig {
    /// Deadline of every collective.
    pub timeout: Duration,
    pub transport: Transport,
    pub all_reduce: AlgorithmChoice,
    /// Buffers up to this size use recursive doubling under `Auto` (without a tuning table
    /// that covers the group).
    pub small_message: ByteSize,
    /// Buffers up to this size use Rabenseifner's halving-doubling under `Auto` (more than 2
    /// ranks); larger ones the ring.
    pub medium_message: ByteSize,
    /// Busy-poll this long without progress before blocking.
    pub spin: Duration,
    /// Address peers connect to (this host's address as seen from the others).
    pub advertise_ip: IpAddr,
    /// Ranks with the same host id share memory. Defaults to hostname + boot id.
    pub host_id: Option<String>,
    /// Bytes per direction of each shared-memory ring.
    pub shm_ring: ByteSize,
    /// SO_SNDBUF/SO_RCVBUF of TCP links (0: the kernel's autotuning).
    pub tcp_buffer: ByteSize,
    /// A ring step over TCP sends at most this far ahead of what it has received, so the bytes
    /// in flight stay in cache (0: unpaced). See `engine.rs`.
    pub tcp_pace: ByteSize,
    /// A ring all-reduce of a large buffer runs in pieces of `ranks x ring_piece` bytes, each
    /// reduced and gathered while it is still in cache (0: whole). See `algo/ring.rs`.
    pub ring_piece: ByteSize,
    pub shm_dir: String,
    /// A collective that makes no progress fails, naming the peer, once that peer's heartbeats
    /// through the store have stopped for this long (see `liveness.rs`); zero turns heartbeats
    /// off and leaves every stall to `timeout`.
    pub liveness: Duration,
    /// Crossovers measured on this machine (`kolo bench collectives --tune`): `Auto` follows a
    /// table for the group's world size and link kind, the thresholds above otherwise. Every
    /// member must hold the same tables (checked when the group connects).
    pub tuning: Option<Arc<crate::tuning::Tuning>>,
}

impl Default for HostCommConfig {
    fn default() -> Self {
        HostCommConfig {
            timeout: DEFAULT_TIMEOUT,
            transport: Transport::Auto,
            all_reduce: AlgorithmChoice::Auto,
            small_message: ByteSize::kib(64),
            medium_message: ByteSize::mib(1),
            spin: Duration::from_micros(200),
            advertise_ip: IpAddr::V4(Ipv4Addr::LOCALHOST),
            host_id: None,
            shm_ring: ByteSize::mib(1),
            tcp_buffer: ByteSize(0),
            tcp_pace: ByteSize::kib(128),
            ring_piece: ByteSize::kib(512),
            shm_dir: "/dev/shm".into(),
            liveness: Duration::from_secs(10),
            tuning: None,
        }
    }
}

struct Core {
    links: Vec<Option<Link>>,
    seq: u64,
    sent: Vec<u64>,
    received: Vec<u64>,
    groups_made: u64,
    broken: Option<CommError>,
    scratch: [Scratch; 2],
    big: Scratch,
}

/// A process group over TCP and shared memory. Thread-safe: calls are serialised by an internal
/// lock, so concurrent callers must still agree on one order across ranks (use
/// [`kolo_comm::AsyncComm`] to issue from one queue).
pub struct HostComm {
    rank: Rank,
    n: WorldSize,
    core: Mutex<Core>,
    timeout: Mutex<Duration>,
    store: Arc<dyn Store>,
    token: JobToken,
    group: String,
    cfg: HostCommConfig,
    hosts: Vec<String>,
    hier: Mutex<Option<Arc<Hier>>>,
    /// The shard buffer of the hierarchical all-reduce, reused across calls.
    hier_scratch: Mutex<Scratch>,
    /// The last collectives, readable while one hangs.
    recorder: crate::recorder::Recorder,
    /// Heartbeats (none alone, or with `cfg.liveness` zero).
    live: Option<Arc<Liveness>>,
    /// Part of a parent group's two-level collectives (see `make_group`).
    internal: bool,
    /// The member whose process hosts the job's store (the job's rank 0), in this group's
    /// numbering; `None` when it is not a member or not known (a store the caller brought).
    store_host: Option<usize>,
    /// How long a wait busy-polls before it yields the core each round: none when this host
    /// runs more ranks than it has cores (the peer being waited for needs the core), as Open
    /// MPI's `mpi_yield_when_idle` does for oversubscribed runs.
    pure_spin: Duration,
    /// Every peer over shared memory, or every peer over TCP (what a tuning table is keyed by).
    link_kind: Option<crate::tuning::LinkKind>,
    _server: Option<Arc<TcpStoreServer>>,
}

/// Sub-groups of the two-level all-reduce.
struct Hier {
    /// The ranks on this rank's host.
    local: Arc<dyn Communicator>,
    /// The ranks with this rank's local index on every host (only leaders when hosts differ in
    /// size).
    cross: Option<Arc<dyn Communicator>>,
    /// Every host has the same number of ranks: use reduce-scatter / all-reduce / all-gather.
    even: bool,
    /// This group's rank of each member of `local` and of `cross`, in their rank order: their
    /// errors are reported in this group's numbering (issue #19: a cut host was named by its
    /// rank in the cross-host group).
    local_members: Vec<Rank>,
    cross_members: Vec<Rank>,
}

impl Hier {
    /// Renumbers an error of the sub-group whose members are `members` into the parent's
    /// collective `op` #`seq` at parent rank `rank`.
    fn lift<'a>(&'a self, members: &'a [Rank], op: OpKind, rank: Rank, seq: u64) -> impl Fn(CommError) -> CommError + 'a {
        move |e| e.in_parent(op, rank, seq, &|r: Rank| members.get(r.get()).copied().unwrap_or(r))
    }
}

/// The pure busy-poll before a wait yields: 20 µs, or none when the ranks of `rank`'s host (in
/// `hosts`) outnumber its cores.
pub(crate) fn pure_spin_for(hosts: &[String], rank: usize) -> Duration {
    let here = hosts.iter().filter(|h| **h == hosts[rank]).count();
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if here > cores {
        Duration::ZERO
    } else {
        Duration::from_micros(20)
    }
}

impl HostComm {
    /// Connects rank `rank` of an `n`-rank group whose members all call this with the same
    /// `group` key on the same store.
    pub fn connect(
        store: Arc<dyn Store>,
        token: JobToken,
        group: &str,
        rank: Rank,
        n: WorldSize,
        cfg: HostCommConfig,
    ) -> Result<HostComm, CommError> {
        Self::connect_with_server(store, token, group, rank, n, cfg, None, None)
    }

    /// As [`HostComm::connect`], keeping the store's server alive with the communicator (on the
    /// rank that hosts it) and knowing which member hosts it (`store_host`, for the heartbeats).
    #[allow(clippy::too_many_arguments)] // crate-internal: connect's six plus the store's two facts
    pub(crate) fn connect_with_server(
        store: Arc<dyn Store>,
        token: JobToken,
        group: &str,
        rank: Rank,
        n: WorldSize,
        cfg: HostCommConfig,
        server: Option<Arc<TcpStoreServer>>,
        store_host: Option<usize>,
    ) -> Result<HostComm, CommError> {
        if !n.contains(rank) {
            return Err(CommError::Setup { op: OpKind::Setup, rank, what: format!("rank {rank} is not below the world size {n}") });
        }
        let deadline = Deadline::after(cfg.timeout);
        let c = connect_group(&*store, &token, group, rank.get(), n.get(), &cfg, deadline)?;
        let live = (n.get() > 1 && !cfg.liveness.is_zero())
            .then(|| Liveness::start(store.clone(), group, rank.get(), n.get(), cfg.liveness, store_host));
        let pure_spin = pure_spin_for(&c.hosts, rank.get());
        let shm = c.links.iter().filter(|l| l.as_ref().is_some_and(Link::is_shm)).count();
        let link_kind = match shm {
            s if s + 1 == n.get() => Some(crate::tuning::LinkKind::Shm),
            0 => Some(crate::tuning::LinkKind::Tcp),
            _ => None,
        };
        let core = Core {
            links: c.links,
            seq: 0,
            sent: vec![0; n.get()],
            received: vec![0; n.get()],
            groups_made: 0,
            broken: None,
            scratch: Default::default(),
            big: Scratch::default(),
        };
        let comm = HostComm {
            rank,
            n,
            core: Mutex::new(core),
            timeout: Mutex::new(cfg.timeout),
            store,
            token,
            group: group.to_string(),
            hosts: c.hosts,
            hier: Mutex::new(None),
            hier_scratch: Mutex::new(Scratch::default()),
            recorder: Default::default(),
            live,
            internal: false,
            store_host,
            pure_spin,
            link_kind,
            cfg,
            _server: server,
        };
        // Nobody returns before everyone is connected (and has consumed setup messages).
        comm.barrier()?;
        Ok(comm)
    }

    /// The host id of every rank (equal ids share memory).
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// Which peers are reached over shared memory.
    pub fn shm_peers(&self) -> Vec<Rank> {
        let core = self.lock();
        core.links.iter().enumerate().filter(|(_, l)| l.as_ref().is_some_and(Link::is_shm)).map(|(i, _)| Rank(i)).collect()
    }

    /// The algorithm `Auto` picks: a tuning table's that covers this group (one host, every
    /// peer over the same kind of link, its world size), else recursive doubling for small
    /// buffers (latency-bound), Rabenseifner's halving for medium ones on more than 2 ranks,
    /// two levels across hosts, the ring for large ones (bandwidth-bound).
    pub fn pick_all_reduce(&self, bytes: usize) -> Algorithm {
        let tuned = match (&self.cfg.tuning, self.link_kind) {
            (Some(t), Some(links)) if self.cfg.all_reduce == AlgorithmChoice::Auto && !self.multi_host() => {
                t.pick(self.n.get(), links, bytes as u64)
            }
            _ => None,
        };
        if let Some(alg) = tuned {
            return alg;
        }
        self.builtin_all_reduce(bytes)
    }

    /// The algorithm the configured choice and the built-in thresholds give, without a tuning
    /// table (what a table's rows are measured against).
    pub fn builtin_all_reduce(&self, bytes: usize) -> Algorithm {
        match self.cfg.all_reduce {
            AlgorithmChoice::Ring => Algorithm::Ring,
            AlgorithmChoice::RecursiveDoubling => Algorithm::RecursiveDoubling,
            AlgorithmChoice::Tree => Algorithm::Tree,
            AlgorithmChoice::HalvingDoubling => Algorithm::HalvingDoubling,
            AlgorithmChoice::Hierarchical if self.multi_host() => Algorithm::Hierarchical,
            AlgorithmChoice::Hierarchical => Algorithm::Ring,
            AlgorithmChoice::Auto if bytes as u64 <= self.cfg.small_message.bytes() => Algorithm::RecursiveDoubling,
            AlgorithmChoice::Auto if self.multi_host() => Algorithm::Hierarchical,
            AlgorithmChoice::Auto if bytes as u64 <= self.cfg.medium_message.bytes() && self.n.get() > 2 => Algorithm::HalvingDoubling,
            AlgorithmChoice::Auto => Algorithm::Ring,
        }
    }

    /// Several hosts, and at least one with more than one rank.
    fn multi_host(&self) -> bool {
        let mut distinct: Vec<&String> = self.hosts.iter().collect();
        distinct.sort();
        distinct.dedup();
        distinct.len() > 1 && distinct.len() < self.hosts.len()
    }

    /// Host of each rank as a small index, and each rank's index within its host.
    fn host_layout(&self) -> (Vec<usize>, Vec<usize>) {
        let mut order: Vec<&String> = Vec::new();
        let mut host_of = Vec::with_capacity(self.hosts.len());
        let mut local_idx = Vec::with_capacity(self.hosts.len());
        let mut counts: Vec<usize> = Vec::new();
        for h in &self.hosts {
            let i = order.iter().position(|o| *o == h).unwrap_or_else(|| {
                order.push(h);
                counts.push(0);
                order.len() - 1
            });
            host_of.push(i);
            local_idx.push(counts[i]);
            counts[i] += 1;
        }
        (host_of, local_idx)
    }

    /// Creates the two-level groups on first use. Every rank reaches this in the same
    /// collective (the choice depends only on data all ranks share), so creation stays collective.
    fn hier(&self) -> Result<Arc<Hier>, CommError> {
        if let Some(h) = self.hier.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return Ok(h);
        }
        let (host_of, local_idx) = self.host_layout();
        let n_hosts = host_of.iter().max().map_or(0, |m| m + 1);
        let (mut local, mut local_members, mut cross_members) = (None, Vec::new(), Vec::new());
        for h in 0..n_hosts {
            let ranks: Vec<Rank> = (0..self.n.get()).filter(|r| host_of[*r] == h).map(Rank).collect();
            if let Some(g) = self.make_group(&ranks, true)? {
                local = Some(g);
                local_members = ranks;
            }
        }
        let sizes: Vec<usize> = (0..n_hosts).map(|h| host_of.iter().filter(|x| **x == h).count()).collect();
        let even = sizes.iter().all(|s| *s == sizes[0]);
        let max_local = sizes.iter().copied().max().unwrap_or(1);
        let mut cross = None;
        for i in 0..if even { max_local } else { 1 } {
            let ranks: Vec<Rank> = (0..self.n.get()).filter(|r| local_idx[*r] == i).map(Rank).collect();
            if let Some(g) = self.make_group(&ranks, true)? {
                cross = Some(g);
                cross_members = ranks;
            }
        }
        let h = Arc::new(Hier { local: local.expect("every rank is on a host"), cross, even, local_members, cross_members });
        *self.hier.lock().unwrap_or_else(|p| p.into_inner()) = Some(h.clone());
        Ok(h)
    }

    /// Two-level all-reduce: reduce within each host (shared memory), all-reduce across hosts
    /// (TCP) on 1/local_size of the data per rank, gather within each host.
    fn hierarchical_all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let h = self.hier()?;
        let bytes = buf.bytes().len();
        self.as_own(OpKind::AllReduce, bytes, |seq| self.two_level_all_reduce(&h, buf, op, seq))
    }

    /// Runs a two-level collective as one of this group's: numbered, in the flight recorder,
    /// breaking this group when it fails. `f` gets the sequence number for its errors.
    fn as_own<T>(&self, op: OpKind, bytes: usize, f: impl FnOnce(u64) -> Result<T, CommError>) -> Result<T, CommError> {
        let seq = {
            let mut core = self.lock();
            if let Some(e) = &core.broken {
                return Err(e.clone().into_aborted(self.rank));
            }
            core.seq += 1;
            core.seq - 1
        };
        self.recorder.start(seq, op, Algorithm::Hierarchical.name(), bytes);
        let r = f(seq).map_err(|e| self.explain(e));
        self.recorder.finish(seq, r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        if let Err(e) = &r {
            self.break_with(&mut self.lock(), e.clone());
        }
        r
    }

    fn two_level_all_reduce(&self, h: &Hier, mut buf: BufMut<'_>, op: ReduceOp, seq: u64) -> Result<(), CommError> {
        let (local, cross) =
            (h.lift(&h.local_members, OpKind::AllReduce, self.rank, seq), h.lift(&h.cross_members, OpKind::AllReduce, self.rank, seq));
        let dtype = buf.dtype();
        let inner_op = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let len = buf.len();
        if h.even {
            let local_n = h.local.world_size();
            let shard = shard_range(len, local_n, h.local.rank());
            let mut scratch = self.hier_scratch.lock().unwrap_or_else(|p| p.into_inner());
            let mut out = BufMut::from_bytes(dtype, scratch.get(shard.len() * dtype.size_bytes())).expect("whole elements");
            h.local.reduce_scatter(buf.as_ref(), out.reborrow(), inner_op).map_err(&local)?;
            h.cross.as_ref().expect("every rank has a cross group").all_reduce(out.reborrow(), inner_op).map_err(&cross)?;
            h.local.all_gather(out.as_ref(), buf.reborrow()).map_err(&local)?;
        } else {
            h.local.reduce(buf.reborrow(), inner_op, Rank(0)).map_err(&local)?;
            if let Some(c) = &h.cross {
                c.all_reduce(buf.reborrow(), inner_op).map_err(&cross)?;
            }
            h.local.broadcast(buf.reborrow(), Rank(0)).map_err(&local)?;
        }
        kolo_comm::reduce::finish_avg(dtype, op, buf.bytes_mut(), self.n.get());
        Ok(())
    }

    /// Whether an all-gather of `bytes` goes in two levels: ranks on several hosts, and the
    /// all-reduce choice is `hierarchical`, or `auto` above the small-message size.
    fn gathers_hierarchically(&self, bytes: usize) -> bool {
        self.multi_host()
            && match self.cfg.all_reduce {
                AlgorithmChoice::Hierarchical => true,
                AlgorithmChoice::Auto => bytes as u64 > self.cfg.small_message.bytes(),
                _ => false,
            }
    }

    /// Two-level all-gather for hosts with equal numbers of ranks: the ranks with the same local
    /// index gather their shards across hosts (each host sends 1/local_size of the data over
    /// each cross link, instead of all of it through one ring), then each host gathers those
    /// blocks over shared memory, and the blocks are put in global rank order. Returns false,
    /// having moved nothing, where the layouts do not line up (uneven hosts): the caller then
    /// uses the ring. The decision depends only on the host layout and the length, which every
    /// rank shares, so all ranks take the same path.
    fn hierarchical_all_gather(&self, input: &BufRef<'_>, output: BufMut<'_>) -> Result<bool, CommError> {
        let h = self.hier()?;
        if h.cross.is_none() || !h.even {
            return Ok(false);
        }
        let bytes = output.bytes().len();
        self.as_own(OpKind::AllGather, bytes, |seq| self.two_level_all_gather(&h, input, output, seq))
    }

    fn two_level_all_gather(&self, h: &Hier, input: &BufRef<'_>, mut output: BufMut<'_>, seq: u64) -> Result<bool, CommError> {
        let cross = h.cross.as_ref().expect("checked by the caller");
        let (lift_local, lift_cross) =
            (h.lift(&h.local_members, OpKind::AllGather, self.rank, seq), h.lift(&h.cross_members, OpKind::AllGather, self.rank, seq));
        let (n, len) = (self.n.get(), output.len());
        let (_, local_idx) = self.host_layout();
        let k = h.local.world_size().get();
        let hosts = n / k;
        let dtype = output.dtype();
        let esz = dtype.size_bytes();
        // Members of each cross group (local index i) in rank order, their shard lengths, and
        // the block each group gathers.
        let members: Vec<Vec<usize>> = (0..k).map(|i| (0..n).filter(|r| local_idx[*r] == i).collect()).collect();
        let shard_len = |r: usize| shard_range(len, self.n, Rank(r)).len();
        let block: Vec<usize> = members.iter().map(|m| m.iter().map(|&r| shard_len(r)).sum()).collect();
        let cross_n = WorldSize::new(hosts).expect("at least one host");
        let local_n = WorldSize::new(k).expect("at least one rank per host");
        let lines_up = members
            .iter()
            .zip(&block)
            .all(|(m, &b)| m.iter().enumerate().all(|(j, &r)| shard_range(b, cross_n, Rank(j)).len() == shard_len(r)))
            && block.iter().enumerate().all(|(i, &b)| shard_range(len, local_n, Rank(i)).len() == b);
        if !lines_up {
            return Ok(false);
        }
        let i = local_idx[self.rank.get()];
        let mut mine = vec![0u8; block[i] * esz];
        cross
            .all_gather(
                BufRef::from_bytes(input.dtype(), input.bytes()).expect("whole elements"),
                BufMut::from_bytes(dtype, &mut mine).expect("whole elements"),
            )
            .map_err(lift_cross)?;
        let mut local_major = vec![0u8; len * esz];
        h.local
            .all_gather(
                BufRef::from_bytes(dtype, &mine).expect("whole elements"),
                BufMut::from_bytes(dtype, &mut local_major).expect("whole elements"),
            )
            .map_err(lift_local)?;
        // Local-major (local index, then host) to global rank order.
        let out = output.bytes_mut();
        let mut at = 0;
        for m in &members {
            for &r in m {
                let sh = shard_range(len, self.n, Rank(r));
                crate::copy::copy_slice(&mut out[sh.start * esz..sh.end * esz], &local_major[at..at + sh.len() * esz]);
                at += sh.len() * esz;
            }
        }
        Ok(true)
    }

    /// All-reduce with `alg`, whatever the configured choice (every member must pass the same):
    /// what `kolo bench collectives --tune` times each algorithm with.
    pub fn all_reduce_using(&self, buf: BufMut<'_>, op: ReduceOp, alg: Algorithm) -> Result<(), CommError> {
        self.all_reduce_with(buf, op, alg)
    }

    /// Whether `Auto` follows a tuning table here (one covers this group).
    pub fn tuned(&self) -> bool {
        self.cfg.all_reduce == AlgorithmChoice::Auto
            && !self.multi_host()
            && self.link_kind.is_some_and(|l| self.cfg.tuning.as_ref().is_some_and(|t| t.pick(self.n.get(), l, 0).is_some()))
    }

    /// How this group's peers are linked, if all alike.
    pub fn link_kind(&self) -> Option<crate::tuning::LinkKind> {
        self.link_kind
    }

    /// All-reduce with a given algorithm (internal collectives pin theirs, so that setting up
    /// the hierarchical groups cannot recurse into them).
    fn all_reduce_with(&self, mut buf: BufMut<'_>, op: ReduceOp, alg: Algorithm) -> Result<(), CommError> {
        if self.n.get() == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        if alg == Algorithm::Hierarchical {
            return self.hierarchical_all_reduce(buf, op);
        }
        let bytes = buf.bytes_mut();
        self.run((OpKind::AllReduce, Some(op), None), alg, bytes.len(), |e, s, big| match alg {
            Algorithm::Ring => ring::all_reduce(e, bytes, dtype, op, big),
            Algorithm::HalvingDoubling => halving::all_reduce(e, bytes, dtype, op, big),
            Algorithm::Tree => {
                tree::reduce(e, bytes, dtype, op, 0, big)?;
                kolo_comm::reduce::finish_avg(dtype, op, bytes, e.n);
                tree::broadcast(e, bytes, dtype, 0, 32)
            }
            _ => {
                let [a, b] = s;
                doubling::all_reduce(e, bytes, dtype, op, a, b)
            }
        })
    }

    /// Hang diagnosis after a timeout in collective `seq`: every rank that times out in this
    /// group says so in the store (with the collective it is stuck in); after a short wait, the
    /// ranks that did not are the ones that never arrived anywhere (hung, or busy outside
    /// communication). A rank stuck one collective behind, waiting for the same culprit, is not
    /// blamed (issue #19: keys per sequence number named it). A group times out at most once (it
    /// is broken after), so one key per rank suffices. `None` if the store cannot be reached.
    fn not_arrived(&self, seq: u64) -> Option<Vec<Rank>> {
        let key = |r: usize| format!("kolo/diag/{}/{r}", self.group);
        self.store.set(&key(self.rank.get()), format!("waiting in collective #{seq}").as_bytes()).ok()?;
        let until = std::time::Instant::now() + Duration::from_millis(1500);
        // This rank has arrived. The store may stop answering part-way (its host, rank 0, gives
        // up at about the same time): then the last complete look stands, or, without one, the
        // engine's own view.
        let mut seen = vec![false; self.n.get()];
        seen[self.rank.get()] = true;
        let mut looked = false;
        loop {
            for r in 0..self.n.get() {
                if seen[r] {
                    continue;
                }
                match self.store.check(&key(r)) {
                    Ok(present) => seen[r] = present,
                    Err(_) if looked => return Some((0..self.n.get()).filter(|&r| !seen[r]).map(Rank).collect()),
                    Err(_) => return None,
                }
            }
            looked = true;
            let absent: Vec<Rank> = (0..self.n.get()).filter(|&r| !seen[r]).map(Rank).collect();
            if absent.is_empty() || std::time::Instant::now() >= until {
                return Some(absent);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The flight recorder's dump: the last collectives of this communicator, the one in
    /// progress marked. Safe to call while a collective hangs.
    pub fn flight_record(&self) -> String {
        self.recorder.dump(&format!("rank {} flight recorder ({} ranks, group {:?})", self.rank, self.n, self.group))
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs one collective: checks the broken flag, numbers it, and breaks the communicator
    /// (closing every link so peers learn at once) if it fails.
    fn run<T>(
        &self,
        (op, red, root): (OpKind, Option<ReduceOp>, Option<Rank>),
        alg: Algorithm,
        bytes: usize,
        f: impl FnOnce(&mut Exec<'_>, &mut [Scratch; 2], &mut Scratch) -> Result<T, CommError>,
    ) -> Result<T, CommError> {
        let mut core = self.lock();
        if let Some(e) = &core.broken {
            return Err(e.clone().into_aborted(self.rank));
        }
        let seq = core.seq;
        core.seq += 1;
        self.recorder.start(seq, op, alg.name(), bytes);
        let root = root.map(|r| r.get() as u32);
        let ctx = OpCtx {
            op,
            rank: self.rank,
            seq,
            deadline: Deadline::after(self.timeout()),
            spin: self.cfg.spin,
            pure_spin: self.pure_spin,
            red,
            root,
            pace: self.cfg.tcp_pace.as_usize(),
        };
        let Core { links, scratch, big, .. } = &mut *core;
        let ring_piece = self.cfg.ring_piece.as_usize();
        let mut exec = Exec { links, ctx, rank: self.rank.get(), n: self.n.get(), alg, live: self.live.as_deref(), ring_piece };
        let mut r = f(&mut exec, scratch, big);
        if let Err(CommError::Timeout { missing, .. }) = &mut r {
            // A rank one hop away may only be waiting itself: ask every rank where it is.
            if let Some(absent) = self.not_arrived(seq) {
                if !absent.is_empty() {
                    *missing = absent;
                }
            }
        }
        let r = r.map_err(|e| self.explain(e));
        self.recorder.finish(seq, r.as_ref().map(|_| ()).map_err(|e| e.to_string()));
        if let Err(e) = &r {
            self.break_with(&mut core, e.clone());
        }
        r
    }

    /// A sub-group of this one. `internal` groups carry out parts of this group's own
    /// collectives (the two-level ones): their errors are explained and published by this group,
    /// in its numbering.
    fn make_group(&self, ranks: &[Rank], internal: bool) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        validate::group(self.rank, self.n, ranks)?;
        // Every rank must pass the same list: agree on a hash of it first.
        let hash = ranks.iter().fold(1469598103934665603u64, |h, r| (h ^ r.get() as u64).wrapping_mul(1099511628211)) as i64;
        let mut v = [hash, -hash];
        self.all_reduce_with(BufMut::from(&mut v[..]), ReduceOp::Max, Algorithm::RecursiveDoubling)?;
        if v[0] != hash || v[1] != -hash {
            let e = CommError::Mismatch {
                op: OpKind::NewGroup,
                rank: self.rank,
                seq: self.lock().seq,
                peer: self.rank,
                ours: format!("new_group({ranks:?})"),
                theirs: "a different rank list on some rank".into(),
            };
            self.break_with(&mut self.lock(), e.clone());
            return Err(e);
        }
        let k = {
            let mut core = self.lock();
            core.groups_made += 1;
            core.groups_made
        };
        let Some(pos) = ranks.iter().position(|r| *r == self.rank) else { return Ok(None) };
        let key = format!("{}.{k}", self.group);
        let mut cfg = self.cfg.clone();
        cfg.timeout = self.timeout();
        let n = WorldSize::new(ranks.len()).expect("validated non-empty");
        let host = self.store_host.and_then(|h| ranks.iter().position(|r| r.get() == h));
        let mut g =
            HostComm::connect_with_server(self.store.clone(), self.token.clone(), &key, Rank(pos), n, cfg, self._server.clone(), host)?;
        g.internal = internal;
        Ok(Some(Arc::new(g)))
    }

    fn cause_key(&self, rank: Rank) -> String {
        format!("kolo/cause/{}/{rank}", self.group)
    }

    /// A peer that closed its links on purpose failed first, and left its reason in the store
    /// (see [`HostComm::break_with`]): a survivor names that root cause, not only the peer that
    /// left (issue #19: a rank whose neighbour gave up on a cut host blamed the neighbour).
    fn explain(&self, e: CommError) -> CommError {
        if self.internal {
            return e;
        }
        match e {
            CommError::PeerLost { op, rank, seq, peer, reason }
                if [crate::engine::CLOSED, "Broken pipe", "Connection reset"].iter().any(|c| reason.contains(c)) =>
            {
                let cause = self.store.get(&self.cause_key(peer), Deadline::after(Duration::from_millis(300)));
                let reason = match cause {
                    Ok(c) => format!("{reason}; it had failed first: {}", String::from_utf8_lossy(&c)),
                    // The store went with its host: the peer most likely left because of it.
                    Err(e) if e.to_string().contains("closed the connection") && self.store_host.is_some_and(|h| h != peer.get()) => {
                        format!("{reason}; its reason is lost with the job's store, whose host, rank 0's process, has exited: rank 0 most likely failed first")
                    }
                    Err(_) => reason,
                };
                CommError::PeerLost { op, rank, seq, peer, reason }
            }
            e => e,
        }
    }

    /// Marks this communicator unusable after a fatal error: the reason goes to the store first
    /// (for the peers that will see the links close; waiting 200 ms at most), then every link
    /// is shut.
    fn break_with(&self, core: &mut Core, e: CommError) {
        if e.is_fatal() && core.broken.is_none() {
            if self.n.get() > 1 && !self.internal {
                // At most a moment: a rank cut off from the store must not wait on it here.
                let (store, key, why) = (self.store.clone(), self.cause_key(self.rank), e.to_string());
                let (tx, rx) = std::sync::mpsc::channel();
                let _ = std::thread::Builder::new().name("kolo-cause".into()).spawn(move || {
                    let _ = tx.send(store.set(&key, why.as_bytes()));
                });
                let _ = rx.recv_timeout(Duration::from_millis(200));
            }
            for l in core.links.iter().flatten() {
                l.shutdown();
            }
            core.broken = Some(e);
        }
    }

    fn p2p(&self, op: OpKind, peer: Rank, tag: u32, dtype: DType, dir: Dir<'_>) -> Result<(), CommError> {
        self.p2p_many(op, vec![(peer, tag, dtype, dir)])
    }

    /// Point-to-point transfers driven together (each a send or a receive, to or from any peer).
    fn p2p_many(&self, op: OpKind, items: Vec<(Rank, u32, DType, Dir<'_>)>) -> Result<(), CommError> {
        let mut core = self.lock();
        if let Some(e) = &core.broken {
            return Err(e.clone().into_aborted(self.rank));
        }
        let mut done = Vec::with_capacity(items.len());
        let mut xfers = Vec::with_capacity(items.len());
        let mut first_seq = None;
        for (peer, tag, dtype, dir) in items {
            let p = peer.get();
            let (len, seq, is_send) = match &dir {
                Dir::Send(d) => (d.len(), core.sent[p], true),
                Dir::Recv(d) => (d.len(), core.received[p], false),
                Dir::RecvReduce { .. } => unreachable!("p2p never reduces"),
            };
            first_seq.get_or_insert(seq);
            let header = Header {
                op: OpKind::Send,
                dtype: Some(dtype),
                alg: Algorithm::P2p as u8,
                seq,
                step: 0,
                tag,
                len: len as u64,
                red: None,
                root: None,
            };
            xfers.push(Xfer::new(p, header, dir));
            done.push((p, is_send));
        }
        let deadline = Deadline::after(self.timeout());
        let ctx = OpCtx {
            op,
            rank: self.rank,
            seq: first_seq.unwrap_or(0),
            deadline,
            spin: self.cfg.spin,
            pure_spin: self.pure_spin,
            red: None,
            root: None,
            pace: 0,
        };
        match drive(&mut core.links, &mut xfers, &ctx, self.live.as_deref()) {
            Ok(()) => {
                for (p, is_send) in done {
                    if is_send {
                        core.sent[p] += 1;
                    } else {
                        core.received[p] += 1;
                    }
                }
                Ok(())
            }
            Err(e) => {
                let e = self.explain(e);
                self.break_with(&mut core, e.clone());
                Err(e)
            }
        }
    }
}

impl Communicator for HostComm {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> WorldSize {
        self.n
    }
    fn backend(&self) -> &'static str {
        "host"
    }
    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let alg = self.pick_all_reduce(buf.bytes().len());
        self.all_reduce_with(buf, op, alg)
    }

    fn reduce(&self, mut buf: BufMut<'_>, op: ReduceOp, root: Rank) -> Result<(), CommError> {
        validate::root(OpKind::Reduce, self.rank, self.n, root)?;
        if self.n.get() == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let is_root = root == self.rank;
        let bytes = buf.bytes_mut();
        self.run((OpKind::Reduce, Some(op), Some(root)), Algorithm::Tree, bytes.len(), |e, s, _| {
            let [a, b] = s;
            if is_root {
                tree::reduce(e, bytes, dtype, op, root.get(), b)?;
                kolo_comm::reduce::finish_avg(dtype, op, bytes, e.n);
                Ok(())
            } else {
                // Non-roots keep their input: partial sums go to scratch.
                let acc = a.get(bytes.len());
                crate::copy::copy_slice(acc, bytes);
                tree::reduce(e, acc, dtype, op, root.get(), b)
            }
        })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: Rank) -> Result<(), CommError> {
        validate::root(OpKind::Broadcast, self.rank, self.n, root)?;
        if self.n.get() == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let bytes = buf.bytes_mut();
        self.run((OpKind::Broadcast, None, Some(root)), Algorithm::Tree, bytes.len(), |e, _, _| {
            tree::broadcast(e, bytes, dtype, root.get(), 0)
        })
    }

    fn all_gather(&self, input: BufRef<'_>, mut output: BufMut<'_>) -> Result<(), CommError> {
        validate::all_gather(self.rank, self.n, &input, &output)?;
        let dtype = input.dtype();
        let esz = dtype.size_bytes();
        let own = shard_range(output.len(), self.n, self.rank);
        crate::copy::copy_slice(&mut output.bytes_mut()[own.start * esz..own.end * esz], input.bytes());
        if self.n.get() == 1 {
            return Ok(());
        }
        if self.gathers_hierarchically(output.bytes().len()) && self.hierarchical_all_gather(&input, output.reborrow())? {
            return Ok(());
        }
        let bytes = output.bytes_mut();
        self.run((OpKind::AllGather, None, None), Algorithm::Ring, bytes.len(), |e, _, _| ring::all_gather(e, bytes, dtype))
    }

    fn reduce_scatter(&self, input: BufRef<'_>, mut output: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        validate::reduce_scatter(self.rank, self.n, &input, &output)?;
        let dtype = input.dtype();
        if self.n.get() == 1 {
            crate::copy::copy_slice(output.bytes_mut(), input.bytes());
            return Ok(());
        }
        let esz = dtype.size_bytes();
        let own = shard_range(input.len(), self.n, self.rank);
        let out = output.bytes_mut();
        self.run((OpKind::ReduceScatter, Some(op), None), Algorithm::Ring, input.bytes().len(), |e, s, big| {
            let acc = big.get(input.bytes().len());
            crate::copy::copy_slice(acc, input.bytes());
            ring::reduce_scatter(e, acc, dtype, op, &mut s[0])?;
            let mine = &mut acc[own.start * esz..own.end * esz];
            kolo_comm::reduce::finish_avg(dtype, op, mine, e.n);
            crate::copy::copy_slice(out, mine);
            Ok(())
        })
    }

    fn reduce_scatter_in_place(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<(), CommError> {
        let dtype = buf.dtype();
        if self.n.get() == 1 {
            return Ok(());
        }
        let esz = dtype.size_bytes();
        let own = shard_range(buf.len(), self.n, self.rank);
        let bytes = buf.bytes_mut();
        self.run((OpKind::ReduceScatter, Some(op), None), Algorithm::Ring, bytes.len(), |e, s, _| {
            ring::reduce_scatter(e, bytes, dtype, op, &mut s[0])?;
            kolo_comm::reduce::finish_avg(dtype, op, &mut bytes[own.start * esz..own.end * esz], e.n);
            Ok(())
        })
    }

    fn all_to_all(&self, input: BufRef<'_>, send_counts: &[usize], mut output: BufMut<'_>, recv_counts: &[usize]) -> Result<(), CommError> {
        validate::all_to_all(self.rank, self.n, &input, send_counts, &output, recv_counts)?;
        let dtype = input.dtype();
        let esz = dtype.size_bytes();
        let ranges = |counts: &[usize]| {
            let mut off = 0;
            counts
                .iter()
                .map(|c| {
                    let r = off * esz..(off + c) * esz;
                    off += c;
                    r
                })
                .collect::<Vec<_>>()
        };
        let (send, recv) = (ranges(send_counts), ranges(recv_counts));
        let out = output.bytes_mut();
        if self.n.get() == 1 {
            crate::copy::copy_slice(out, input.bytes());
            return Ok(());
        }
        self.run((OpKind::AllToAll, None, None), Algorithm::Pairwise, input.bytes().len(), |e, _, _| {
            pairwise::all_to_all(e, input.bytes(), &send, out, &recv, dtype)
        })
    }

    fn send(&self, buf: BufRef<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        validate::peer(OpKind::Send, self.rank, self.n, peer)?;
        self.p2p(OpKind::Send, peer, tag, buf.dtype(), Dir::Send(buf.bytes()))
    }

    fn recv(&self, mut buf: BufMut<'_>, peer: Rank, tag: u32) -> Result<(), CommError> {
        validate::peer(OpKind::Recv, self.rank, self.n, peer)?;
        self.p2p(OpKind::Recv, peer, tag, buf.dtype(), Dir::Recv(buf.bytes_mut()))
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
        validate::peer(OpKind::Send, self.rank, self.n, to)?;
        validate::peer(OpKind::Recv, self.rank, self.n, from)?;
        self.p2p_many(
            OpKind::Send,
            vec![(to, send_tag, send.dtype(), Dir::Send(send.bytes())), (from, recv_tag, recv.dtype(), Dir::Recv(recv.bytes_mut()))],
        )
    }

    fn barrier(&self) -> Result<(), CommError> {
        if self.n.get() == 1 {
            return Ok(());
        }
        self.run((OpKind::Barrier, None, None), Algorithm::Dissemination, 0, |e, _, _| pairwise::barrier(e))
    }

    fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Communicator>>, CommError> {
        self.make_group(ranks, false)
    }
}
