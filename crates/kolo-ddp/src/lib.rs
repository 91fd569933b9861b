//! Distributed data parallelism, as torch's `DistributedDataParallel` does it:
//!
//! 1. [`Ddp::new`] checks that every rank built the same model (names and shapes) and
//!    [`Ddp::broadcast_params`] makes rank 0's initial values everyone's.
//! 2. [`bucket_plan`] (pure) groups parameters in the order backward completes them (last layer
//!    first) into buckets of about `bucket_cap` bytes.
//! 3. During backward, the model adapter hands each finished gradient to the [`GradSink`] this
//!    crate provides; when a bucket is full it is all-reduced (averaged) on the communication
//!    thread while backward continues with earlier layers.
//! 4. [`Ddp::finish`] waits for the buckets and writes the averaged gradients into the flat
//!    gradient buffer; its [`SyncStats`] tell how much of the communication was hidden.
//!
//! ZeRO (stages 1 and 2, [`Sharding`]): each rank owns one piece of every bucket ([`ShardPlan`])
//! and keeps optimizer state only for it. Stage 1 all-reduces gradients as DDP does and each rank
//! updates its piece; stage 2 reduce-scatters each bucket during backward, so a rank only ever
//! receives its own piece of the averaged gradients. After the update,
//! [`Ddp::all_gather_params`] brings every rank's updated piece to everyone.
//!
//! Gradient accumulation: for micro-steps that should not communicate, run backward without the
//! hook and add the gradients with [`Ddp::accumulate`]; the next hooked backward folds them in.
//! The crate knows no tensor library: it sees flat `f32` buffers only.

mod bucket;
pub mod codecs;
pub mod comm_schedule;
pub mod exact;
pub mod powersgd;
pub mod sparse_ar;
pub use codecs::{BucketCodec, CodecFactory};
pub mod shard;
mod zero;
pub use bucket::{bucket_plan, grouped_plan, Bucket};
pub use shard::{Segment, ShardPlan};

use kolo_base::{ByteSize, Deadline, GradSink, Rank};
use kolo_comm::{AsyncComm, BufMut, CommError, Communicator, OpKind, Pending, ReduceOp};
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error("rank {rank}: model differs from rank 0's: {what}")]
    ModelMismatch { rank: Rank, what: String },
    #[error("rank {rank}: parameter(s) {names:?} received no gradient in this backward pass; every parameter must take part in the loss")]
    MissingGrads { rank: Rank, names: Vec<String> },
    #[error("rank {rank}: {what}")]
    Usage { rank: Rank, what: String },
}

/// Values a piece of [`Ddp::broadcast_params`] holds (16 MB of f32).
pub const BROADCAST_PIECE: usize = 1 << 22;

/// ZeRO-2/3: reduce-scatters a backward pass may have queued before it waits for the oldest
/// (`Shared::bound_scatters`).
pub const MAX_SCATTERS_IN_FLIGHT: usize = 2;

#[derive(Clone, Debug)]
pub struct DdpConfig {
    /// Target bucket size (torch's default: 25 MiB).
    pub bucket_cap: ByteSize,
    /// Cap of the first bucket (the last layers' gradients), small so that communication starts
    /// early in backward (torch's `first_bucket_bytes_cap`, 1 MiB).
    pub first_bucket_cap: ByteSize,
    /// Deadline for waiting on the buckets after backward.
    pub timeout: Duration,
    /// Plain DDP or a ZeRO stage.
    pub sharding: Sharding,
    /// ZeRO-3: the parameter groups (indices, in packing order) that are sharded and gathered
    /// one at a time; each is one bucket. Other parameters are bucketed as usual.
    pub groups: Vec<Vec<usize>>,
    /// Gradient compression (plain DDP only).
    pub compression: Compression,
    /// Synchronised steps before compression starts.
    pub compression_warmup: u64,
}

/// How gradients are compressed on the wire (after `DdpConfig::compression_warmup`
/// uncompressed steps, like torch's `start_powerSGD_iter`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Compression {
    #[default]
    None,
    /// All-reduce in f16 or bf16.
    Half { bf16: bool },
    /// The `fraction` largest values per rank, with error feedback: selected exactly or by a
    /// sampled threshold, exchanged by all-gather or by a sparse all-reduce.
    TopK { fraction: f64, sampled: bool, sparse_all_reduce: bool },
    /// `fraction` of the positions, the same on every rank, with error feedback.
    RandK { fraction: f64 },
    /// QSGD with `levels` levels (unbiased).
    Qsgd { levels: u8 },
    /// 1 bit per value and a scale, with error feedback.
    Sign,
    /// PowerSGD with rank-`rank` factors, error feedback and warm-started Q.
    PowerSgd { rank: usize },
    /// A user codec per bucket.
    Custom(CodecFactory),
}

/// What is sharded across the data-parallel ranks (DeepSpeed's `zero_stage`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharding {
    /// Plain DDP: every rank holds everything; gradients are all-reduced.
    #[default]
    None,
    /// ZeRO-1: optimizer state sharded; gradients all-reduced, each rank updates its piece.
    OptimizerState,
    /// ZeRO-2: optimizer state and gradients sharded; buckets are reduce-scattered.
    Gradients,
    /// ZeRO-3: parameters sharded too. The model's parameter groups ([`DdpConfig::groups`])
    /// are not resident: each is gathered when used ([`kolo_base::ParamGather`]).
    Parameters,
}

impl Sharding {
    pub fn from_stage(stage: u8) -> Option<Sharding> {
        match stage {
            0 => Some(Sharding::None),
            1 => Some(Sharding::OptimizerState),
            2 => Some(Sharding::Gradients),
            3 => Some(Sharding::Parameters),
            _ => None,
        }
    }

    pub fn stage(self) -> u8 {
        match self {
            Sharding::None => 0,
            Sharding::OptimizerState => 1,
            Sharding::Gradients => 2,
            Sharding::Parameters => 3,
        }
    }
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap: ByteSize::mib(25),
            first_bucket_cap: ByteSize::mib(1),
            timeout: kolo_comm::DEFAULT_TIMEOUT,
            sharding: Sharding::None,
            groups: Vec::new(),
            compression: Compression::None,
            compression_warmup: 0,
        }
    }
}

/// Timing of one synchronised backward pass.
#[derive(Clone, Debug, Default)]
pub struct SyncStats {
    /// Per bucket: when its all-reduce started and ended on the communication thread.
    pub buckets: Vec<(Instant, Instant)>,
    /// How long `finish` waited after backward returned.
    pub wait: Duration,
    /// Communication time that ran while backward was still going.
    pub hidden: Duration,
    /// Total communication time.
    pub comm: Duration,
    /// Bytes this rank handed to the gradient collectives (after compression).
    pub bytes: usize,
}

impl SyncStats {
    /// Fraction of communication time overlapped with backward (0..=1).
    pub fn hidden_fraction(&self) -> f64 {
        if self.comm.is_zero() {
            return 1.0;
        }
        self.hidden.as_secs_f64() / self.comm.as_secs_f64()
    }
}

/// A bucket buffer back from the communication thread, with this rank's reduced piece when
/// the bucket was reduce-scattered, and when the collective started and ended.
type Timed = (Option<Vec<f32>>, Option<Vec<f32>>, Instant, Instant, Sent);

/// What a bucket's collective put on the wire, and the compression state it used (returned so
/// the next step continues from it).
struct Sent {
    bytes: usize,
    codec: Option<Box<dyn BucketCodec>>,
}

struct Inner {
    /// Reusable bucket buffers (taken while in flight; under ZeRO-2 freed after the reduce-scatter).
    buffers: Vec<Option<Vec<f32>>>,
    /// ZeRO-2: this rank's reduced piece of each bucket (taken while in flight).
    pieces: Vec<Option<Vec<f32>>>,
    /// Compression state per bucket (taken while in flight).
    codecs: Vec<Option<Box<dyn BucketCodec>>>,
    /// Synchronised backward passes finished so far (for the compression warm-up).
    syncs: u64,
    remaining: Vec<usize>,
    inflight: Vec<Option<Pending<Timed>>>,
    /// Locally accumulated gradients of no-sync micro-steps, if any.
    accum: Option<Vec<f32>>,
    /// [`Ddp::set_no_sync`]: hooked gradients go to `accum` instead of the buckets.
    no_sync: bool,
    seen: Vec<bool>,
    backward_started: Option<Instant>,
    /// The order in which buckets are submitted, the same on every rank (as torch's reducer
    /// launches buckets in order): the plan's until the first synchronised backward ends, then
    /// the order in which rank 0's buckets filled in that pass ([`Ddp::finish`] learns it).
    /// A bucket that fills before the ones ahead of it waits for them: a model whose backward
    /// order depends on the data (experts that no token reached) fills buckets in another
    /// order on each rank, and collectives started in fill order would pair different buckets.
    order: Vec<usize>,
    /// Whether `order` is rank 0's learned order yet.
    order_learned: bool,
    /// How many buckets of `order` are submitted in this pass.
    next: usize,
    /// Buckets whose gradients are complete in this pass (submitted or waiting their turn).
    complete: Vec<bool>,
    /// The buckets in the order they filled in this pass.
    filled: Vec<usize>,
    /// Reduce-scattered buckets submitted in this pass whose result nobody has waited for yet,
    /// oldest first ([`MAX_SCATTERS_IN_FLIGHT`]).
    unwaited: std::collections::VecDeque<usize>,
}

/// A ZeRO-3 gather's result: the bucket's whole values, or why the ranks' gathers differed.
type Gathered = Result<Vec<f32>, String>;

struct Shared {
    comm: AsyncComm,
    plan: Vec<Bucket>,
    /// For parameter i: (bucket, offset inside the bucket).
    slot: Vec<(usize, usize)>,
    ranges: Vec<Range<usize>>,
    /// Values in the model's flat layout (the end of the last range).
    numel: usize,
    /// This rank's pieces of the buckets (used when sharding).
    shard: ShardPlan,
    reduce_scatter: bool,
    /// ZeRO-3: the bucket of each parameter group.
    group_bucket: Vec<usize>,
    /// ZeRO-3: this rank's master shard (shard-vector layout), the source of every gather.
    master: Mutex<Vec<f32>>,
    /// ZeRO-3: gathers started ahead of use, by bucket.
    prefetched: Mutex<std::collections::HashMap<usize, Pending<Gathered>>>,
    timeout: Duration,
    /// Synchronised steps before compression starts.
    warmup: u64,
    inner: Mutex<Inner>,
}

/// The DDP engine for one model on one rank.
pub struct Ddp {
    shared: Arc<Shared>,
    names: Vec<String>,
    cfg: DdpConfig,
    rank: Rank,
}

fn signature_text(sig: &[(String, Vec<usize>)]) -> String {
    sig.iter().map(|(n, s)| format!("{n}{s:?}")).collect::<Vec<_>>().join(";")
}

impl Ddp {
    /// Collective: checks that every rank has the same parameters (names and shapes, in order).
    /// `signature` lists `(name, shape)` in the flat-buffer order.
    pub fn new(comm: Arc<dyn Communicator>, signature: &[(String, Vec<usize>)], cfg: DdpConfig) -> Result<Ddp, DdpError> {
        let rank = comm.rank();
        // Rank 0's signature goes to everyone; each rank reports the first difference.
        let mine = signature_text(signature).into_bytes();
        let mut len = [mine.len() as i64];
        comm.broadcast(BufMut::from(&mut len[..]), Rank(0))?;
        let mut theirs = if rank == Rank(0) { mine.clone() } else { vec![0u8; len[0] as usize] };
        comm.broadcast(BufMut::from(&mut theirs), Rank(0))?;
        let ok = theirs == mine;
        let mut all_ok = [u8::from(ok)];
        comm.all_reduce(BufMut::from(&mut all_ok[..]), ReduceOp::Min)?;
        if !ok {
            let theirs = String::from_utf8_lossy(&theirs).into_owned();
            let a: Vec<&str> = theirs.split(';').collect();
            let b: Vec<String> = signature.iter().map(|(n, s)| format!("{n}{s:?}")).collect();
            let i = (0..a.len().max(b.len())).find(|i| a.get(*i).copied() != b.get(*i).map(String::as_str)).unwrap_or(0);
            return Err(DdpError::ModelMismatch {
                rank,
                what: format!(
                    "parameter #{i}: rank 0 has {}, this rank has {} ({} vs {} parameters)",
                    a.get(i).unwrap_or(&"nothing"),
                    b.get(i).map_or("nothing", String::as_str),
                    a.len(),
                    b.len()
                ),
            });
        }
        if all_ok[0] == 0 {
            return Err(DdpError::ModelMismatch { rank, what: "another rank's model differs from rank 0's (see its error)".into() });
        }
        let numels: Vec<usize> = signature.iter().map(|(_, s)| s.iter().product()).collect();
        let mut ranges = Vec::with_capacity(numels.len());
        let mut off = 0;
        for n in &numels {
            ranges.push(off..off + n);
            off += n;
        }
        let caps = ((cfg.first_bucket_cap.as_usize() / 4).max(1), (cfg.bucket_cap.as_usize() / 4).max(1));
        let (plan, group_bucket) = if cfg.sharding == Sharding::Parameters {
            grouped_plan(&numels, &cfg.groups, caps).map_err(|what| DdpError::Usage { rank, what })?
        } else {
            (bucket_plan(&numels, caps.0, caps.1), Vec::new())
        };
        let mut slot = vec![(0, 0); numels.len()];
        for (b, bucket) in plan.iter().enumerate() {
            let mut o = 0;
            for &p in &bucket.params {
                slot[p] = (b, o);
                o += numels[p];
            }
        }
        let codecs: Vec<Option<Box<dyn BucketCodec>>> = if cfg.compression == Compression::None {
            plan.iter().map(|_| None).collect()
        } else {
            // ZeRO-1 all-reduces its buckets as DDP does; ZeRO-2/3 reduce-scatter them, which
            // the casts do in half precision and a user codec may ([`BucketCodec::reduce_scatter`]).
            let scatters = matches!(cfg.sharding, Sharding::Gradients | Sharding::Parameters);
            if scatters && !matches!(cfg.compression, Compression::Half { .. } | Compression::Custom(_)) {
                return Err(DdpError::Usage {
                    rank,
                    what: "ZeRO-2/3 reduce-scatter their gradients: compress them with fp16 or bf16 (the other codecs need the whole bucket on every rank)".into(),
                });
            }
            if matches!(cfg.compression, Compression::PowerSgd { rank: 0 } | Compression::Qsgd { levels: 0 | 128.. }) {
                return Err(DdpError::Usage {
                    rank,
                    what: format!("{:?}: PowerSGD needs a rank of at least 1, QSGD 1..=127 levels", cfg.compression),
                });
            }
            plan.iter()
                .enumerate()
                .map(|(b, bucket)| {
                    let slots: Vec<powersgd::Slot> = bucket
                        .params
                        .iter()
                        .map(|&p| {
                            let shape = &signature[p].1;
                            let rows = if shape.len() >= 2 { shape[0] } else { 1 };
                            let seed = powersgd::name_seed(&signature[p].0);
                            powersgd::Slot { offset: slot[p].1, rows, cols: numels[p] / rows.max(1), seed }
                        })
                        .collect();
                    let ef = || kolo_compress::ErrorFeedback::new(bucket.numel);
                    let codec: Box<dyn BucketCodec> = match &cfg.compression {
                        Compression::None => unreachable!("handled above"),
                        Compression::Half { bf16 } => Box::new(codecs::Half { bf16: *bf16 }),
                        Compression::TopK { fraction, sampled, sparse_all_reduce } => Box::new(codecs::TopK {
                            fraction: *fraction,
                            sampled: *sampled,
                            sparse_all_reduce: *sparse_all_reduce,
                            step: 0,
                            ef: ef(),
                        }),
                        Compression::RandK { fraction } => {
                            Box::new(codecs::RandK { fraction: *fraction, seed: b as u64, step: 0, ef: ef() })
                        }
                        Compression::Qsgd { levels } => Box::new(codecs::Qsgd {
                            levels: *levels,
                            rng: kolo_base::Rng::new(0xC0DE ^ ((rank.get() as u64) << 32) ^ b as u64),
                        }),
                        Compression::Sign => Box::new(codecs::Sign { ef: ef() }),
                        Compression::PowerSgd { rank: r } => Box::new(powersgd::BucketState::new(slots, *r)),
                        Compression::Custom(f) => (f.0)(b, &slots),
                    };
                    Some(codec)
                })
                .collect()
        };
        let warmup = cfg.compression_warmup;
        let inner = Inner {
            buffers: plan.iter().map(|_| None).collect(),
            pieces: plan.iter().map(|_| None).collect(),
            codecs,
            syncs: 0,
            remaining: plan.iter().map(|b| b.params.len()).collect(),
            inflight: plan.iter().map(|_| None).collect(),
            accum: None,
            no_sync: false,
            seen: vec![false; numels.len()],
            backward_started: None,
            order: (0..plan.len()).collect(),
            order_learned: false,
            next: 0,
            complete: vec![false; plan.len()],
            filled: Vec::new(),
            unwaited: std::collections::VecDeque::new(),
        };
        let shard = ShardPlan::new(&numels, &plan, comm.world_size(), rank);
        let reduce_scatter = matches!(cfg.sharding, Sharding::Gradients | Sharding::Parameters);
        let shared = Arc::new(Shared {
            comm: AsyncComm::new(comm),
            plan,
            slot,
            numel: ranges.iter().map(|r| r.end).max().unwrap_or(0),
            ranges,
            shard,
            reduce_scatter,
            group_bucket,
            master: Mutex::new(Vec::new()),
            prefetched: Mutex::new(std::collections::HashMap::new()),
            timeout: cfg.timeout,
            warmup,
            inner: Mutex::new(inner),
        });
        Ok(Ddp { shared, names: signature.iter().map(|(n, _)| n.clone()).collect(), cfg, rank })
    }

    pub fn plan(&self) -> &[Bucket] {
        &self.shared.plan
    }

    /// This rank's shard (meaningful for every [`Sharding`]; used by ZeRO).
    pub fn shard_plan(&self) -> &ShardPlan {
        &self.shared.shard
    }

    /// Every parameter's range in the flat layout.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.shared.ranges
    }

    pub fn sharding(&self) -> Sharding {
        self.cfg.sharding
    }

    /// Length of the gradient buffer [`Ddp::finish`] fills: the whole model, or this rank's
    /// shard under ZeRO-2.
    pub fn grad_len(&self) -> usize {
        if self.shared.reduce_scatter {
            self.shared.shard.len
        } else {
            self.shared.ranges.last().map_or(0, |r| r.end)
        }
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        self.shared.comm.comm()
    }

    /// Makes rank 0's parameter values everyone's (collective), in pieces of at most
    /// [`BROADCAST_PIECE`] values: the transient copies the communication thread takes stay that
    /// small instead of two more copies of the whole model.
    pub fn broadcast_params(&self, flat: &mut [f32]) -> Result<(), DdpError> {
        let d = Deadline::after(self.cfg.timeout);
        for piece in flat.chunks_mut(BROADCAST_PIECE) {
            let got = self.shared.comm.broadcast(piece.to_vec(), Rank(0)).wait(d)?;
            piece.copy_from_slice(&got);
        }
        Ok(())
    }

    /// The sink to hand to the model adapter's hooked parameter view.
    pub fn sink(&self) -> Arc<dyn GradSink> {
        self.shared.clone()
    }

    /// Adds the gradients of a no-sync micro-step to the local accumulator.
    pub fn accumulate(&self, grads: &[f32]) {
        let mut inner = self.shared.lock();
        match &mut inner.accum {
            Some(a) => a.iter_mut().zip(grads).for_each(|(a, g)| *a += g),
            None => inner.accum = Some(grads.to_vec()),
        }
    }

    /// While on, gradients the hook delivers ([`GradSink::grad_ready`]) are added to the local
    /// accumulator instead of their buckets (torch FSDP's `no_sync()`): for a model whose
    /// gradients only reach the hook, as ZeRO-3's gathered blocks do. The next hooked backward
    /// with it off folds them in.
    pub fn set_no_sync(&self, on: bool) {
        self.shared.lock().no_sync = on;
    }

    /// Moves the locally accumulated gradients into `grads` without communicating (benchmarks
    /// that measure a step without synchronisation).
    pub fn take_accumulated(&self, grads: &mut [f32]) {
        match self.shared.lock().accum.take() {
            Some(a) => grads.copy_from_slice(&a),
            None => grads.iter_mut().for_each(|g| *g = 0.0),
        }
    }

    /// The compression state between steps, for a checkpoint: the synchronised steps so far
    /// (the warm-up counter) and each bucket's codec state ([`BucketCodec::state`]; empty
    /// without compression). Call it between steps, when no bucket is in flight.
    pub fn compression_state(&self) -> Result<(u64, Vec<Vec<f32>>), DdpError> {
        let inner = self.shared.lock();
        let states = inner
            .codecs
            .iter()
            .enumerate()
            .map(|(b, c)| match c {
                Some(c) => Ok(c.state()),
                None if self.cfg.compression == Compression::None => Ok(Vec::new()),
                None => Err(DdpError::Usage { rank: self.rank, what: format!("bucket {b}'s codec is in flight") }),
            })
            .collect::<Result<_, _>>()?;
        Ok((inner.syncs, states))
    }

    /// Restores [`Ddp::compression_state`] as this rank wrote it (the same world size and bucket
    /// plan); an error names the bucket whose state does not fit.
    pub fn restore_compression_state(&self, syncs: u64, states: &[Vec<f32>]) -> Result<(), DdpError> {
        let mut inner = self.shared.lock();
        if states.len() != inner.codecs.len() {
            return Err(DdpError::Usage {
                rank: self.rank,
                what: format!(
                    "compression state for {} buckets, this run has {} (ddp.bucket_cap changed?)",
                    states.len(),
                    inner.codecs.len()
                ),
            });
        }
        for (b, (c, s)) in inner.codecs.iter_mut().zip(states).enumerate() {
            if let Some(c) = c {
                c.load_state(s).map_err(|e| DdpError::Usage { rank: self.rank, what: format!("bucket {b}'s compression state: {e}") })?;
            }
        }
        inner.syncs = syncs;
        Ok(())
    }

    /// Marks the start of a synchronised backward pass (for the overlap statistics).
    pub fn begin_backward(&self) {
        self.shared.lock().backward_started = Some(Instant::now());
    }

    /// Waits for every bucket and writes the averaged gradients into `grads`: the flat layout
    /// of the whole model, or under ZeRO-2 this rank's shard vector ([`Ddp::grad_len`]).
    pub fn finish(&self, grads: &mut [f32]) -> Result<SyncStats, DdpError> {
        if grads.len() != self.grad_len() {
            return Err(DdpError::Usage {
                rank: self.rank,
                what: format!("finish: gradient buffer has {} values, expected {}", grads.len(), self.grad_len()),
            });
        }
        let (stats, done) = self.wait_buckets()?;
        let mut inner = self.shared.lock();
        for (b, (buf, piece)) in done.into_iter().enumerate() {
            if let Some(piece) = piece {
                let at = self.shared.shard.pieces[b].shard_offset;
                grads[at..at + piece.len()].copy_from_slice(&piece);
                inner.pieces[b] = Some(piece);
            }
            if let Some(buf) = buf {
                for &pi in &self.shared.plan[b].params {
                    let (_, off) = self.shared.slot[pi];
                    let r = self.shared.ranges[pi].clone();
                    grads[r.clone()].copy_from_slice(&buf[off..off + r.len()]);
                }
                inner.buffers[b] = Some(buf);
            }
        }
        Ok(stats)
    }

    /// Like [`Ddp::finish`] for all-reduced gradients (plain DDP, ZeRO-1), without copying
    /// them out: the averaged gradients stay in the bucket buffers, read through the returned
    /// [`BucketGrads`], which hands the buffers back when dropped.
    pub fn finish_buckets(&self) -> Result<(SyncStats, BucketGrads<'_>), DdpError> {
        if self.shared.reduce_scatter {
            return Err(DdpError::Usage {
                rank: self.rank,
                what: "finish_buckets: under ZeRO-2 gradients are reduce-scattered; use finish".into(),
            });
        }
        let (stats, done) = self.wait_buckets()?;
        Ok((
            stats,
            BucketGrads {
                ddp: self,
                bufs: done.into_iter().map(|(b, _)| b.expect("all-reduced buckets come back")).collect(),
                pieces: false,
            },
        ))
    }

    /// Waits for every bucket's collective: per bucket its buffer and, when reduce-scattered,
    /// this rank's piece.
    #[allow(clippy::type_complexity)]
    fn wait_buckets(&self) -> Result<(SyncStats, Vec<(Option<Vec<f32>>, Option<Vec<f32>>)>), DdpError> {
        let backward_end = Instant::now();
        let (pendings, learn, started) = {
            let mut inner = self.shared.lock();
            let missing: Vec<String> = inner.seen.iter().enumerate().filter(|(_, s)| !**s).map(|(i, _)| self.names[i].clone()).collect();
            if !missing.is_empty() {
                // Buckets that did fill are in flight on every rank; drain them so the
                // communicator stays consistent before reporting.
                let pend: Vec<_> = inner.inflight.iter_mut().filter_map(Option::take).collect();
                inner.unwaited.clear();
                drop(inner);
                let d = Deadline::after(self.cfg.timeout);
                for p in pend {
                    let _ = p.wait(d);
                }
                return Err(DdpError::MissingGrads { rank: self.rank, names: missing });
            }
            let pend: Vec<_> = inner.inflight.iter_mut().map(|p| p.take()).collect();
            inner.seen.iter_mut().for_each(|s| *s = false);
            inner.accum = None;
            for (b, bucket) in self.shared.plan.iter().enumerate() {
                inner.remaining[b] = bucket.params.len();
            }
            inner.syncs += 1;
            inner.next = 0;
            inner.unwaited.clear();
            inner.complete.iter_mut().for_each(|c| *c = false);
            let filled = std::mem::take(&mut inner.filled);
            // After the first pass: rank 0's fill order, every rank's from now on.
            let learn = (!std::mem::replace(&mut inner.order_learned, true)).then(|| self.shared.broadcast_order(filled));
            (pend, learn, inner.backward_started.take().unwrap_or(backward_end))
        };
        let d = Deadline::after(self.cfg.timeout);
        let mut stats = SyncStats::default();
        let mut out = Vec::with_capacity(pendings.len());
        for (b, p) in pendings.into_iter().enumerate() {
            let p = p.ok_or_else(|| DdpError::Usage { rank: self.rank, what: format!("bucket {b} was never submitted") })?;
            let (buf, piece, s, e, sent) = p.wait(d)?;
            stats.bytes += sent.bytes;
            if let Some(codec) = sent.codec {
                self.shared.lock().codecs[b] = Some(codec);
            }
            stats.comm += e.duration_since(s);
            let hidden_end = e.min(backward_end);
            if hidden_end > s.max(started) {
                stats.hidden += hidden_end.duration_since(s.max(started));
            }
            stats.buckets.push((s, e));
            out.push((buf, piece));
        }
        if let Some(order) = learn {
            let order = order.wait(d)?;
            let nb = self.shared.plan.len();
            // Rank 0's order must name every bucket once (a rank whose buckets did not all fill
            // failed above, on every rank).
            let mut seen = vec![false; nb];
            let valid =
                order.len() == nb && order.iter().all(|&b| b >= 0 && (b as usize) < nb && !std::mem::replace(&mut seen[b as usize], true));
            if !valid {
                return Err(DdpError::Usage {
                    rank: self.rank,
                    what: format!("rank 0's bucket order {order:?} does not list the {nb} buckets once each"),
                });
            }
            self.shared.lock().order = order.into_iter().map(|b| b as usize).collect();
        }
        stats.wait = backward_end.elapsed();
        Ok((stats, out))
    }
}

/// Averaged gradients where the collectives left them: whole buckets
/// ([`Ddp::finish_buckets`]) or this rank's piece of each ([`Ddp::finish_shard`]).
pub struct BucketGrads<'a> {
    ddp: &'a Ddp,
    bufs: Vec<Vec<f32>>,
    pieces: bool,
}

impl BucketGrads<'_> {
    /// Parameter `i`'s gradient (whole buckets only).
    pub fn param(&self, i: usize) -> &[f32] {
        assert!(!self.pieces, "BucketGrads::param: only this rank's pieces are here");
        let (b, off) = self.ddp.shared.slot[i];
        &self.bufs[b][off..off + self.ddp.shared.ranges[i].len()]
    }

    /// Parameter `i`'s gradient, to change (whole buckets only).
    pub fn param_mut(&mut self, i: usize) -> &mut [f32] {
        assert!(!self.pieces, "BucketGrads::param_mut: only this rank's pieces are here");
        let (b, off) = self.ddp.shared.slot[i];
        let n = self.ddp.shared.ranges[i].len();
        &mut self.bufs[b][off..off + n]
    }

    /// Whether whole buckets are here (not only this rank's ZeRO-2 pieces).
    pub fn whole(&self) -> bool {
        !self.pieces
    }

    /// ZeRO-2/3: the part of parameter `i`'s gradient in this rank's piece of its bucket: where
    /// that part starts within the parameter, and its values (empty when the piece holds none
    /// of it). With whole buckets, all of it from 0.
    pub fn param_part_mut(&mut self, i: usize) -> (usize, &mut [f32]) {
        let (b, at, range) = self.part(i);
        (at, &mut self.bufs[b][range])
    }

    /// [`BucketGrads::param_part_mut`]'s values, to read (the gradient norm of ZeRO-2/3 on a
    /// mesh sums each rank's parts).
    pub fn param_part(&self, i: usize) -> &[f32] {
        let (b, _, range) = self.part(i);
        &self.bufs[b][range]
    }

    /// Where parameter `i`'s part is: its bucket, the part's start within the parameter, and
    /// its range in the bucket's buffer here.
    fn part(&self, i: usize) -> (usize, usize, std::ops::Range<usize>) {
        let (b, off) = self.ddp.shared.slot[i];
        let n = self.ddp.shared.ranges[i].len();
        if !self.pieces {
            return (b, 0, off..off + n);
        }
        let own = &self.ddp.shared.shard.pieces[b].in_bucket;
        let (lo, hi) = (own.start.max(off), own.end.min(off + n));
        if lo >= hi {
            return (b, 0, 0..0);
        }
        (b, lo - off, lo - own.start..hi - own.start)
    }

    /// This rank's piece of bucket `b` (ZeRO-2), the gradients of `ShardPlan::pieces[b]`.
    pub fn piece(&self, b: usize) -> &[f32] {
        assert!(self.pieces, "BucketGrads::piece: these are whole buckets");
        &self.bufs[b]
    }

    /// Sum of squares of all gradients (f64).
    pub fn sum_of_squares(&self) -> f64 {
        self.bufs.iter().map(|b| kolo_base::sum_of_squares(b)).sum()
    }

    /// Multiplies every gradient by `f` (clipping).
    pub fn scale(&mut self, f: f32) {
        self.bufs.iter_mut().flat_map(|b| b.iter_mut()).for_each(|x| *x *= f);
    }
}

impl Drop for BucketGrads<'_> {
    fn drop(&mut self) {
        let mut inner = self.ddp.shared.lock();
        for (b, buf) in std::mem::take(&mut self.bufs).into_iter().enumerate() {
            if self.pieces {
                inner.pieces[b] = Some(buf);
            } else {
                inner.buffers[b] = Some(buf);
            }
        }
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl GradSink for Shared {
    fn grad_ready(&self, idx: usize, grad: &[f32]) {
        let mut inner = self.lock();
        let (b, off) = self.slot[idx];
        let range = self.ranges[idx].clone();
        if inner.no_sync {
            self.accumulate_into(&mut inner, range, grad);
            return;
        }
        let Inner { buffers, accum, remaining, seen, complete, .. } = &mut *inner;
        if complete[b] {
            return; // a second gradient for a parameter of a bucket already complete
        }
        if buffers[b].is_none() {
            // Allocated on first use: ZeRO-2 frees each bucket once it is reduce-scattered.
            buffers[b] = Some(vec![0f32; self.plan[b].numel]);
        }
        let Some(buf) = buffers[b].as_mut() else { return };
        let dst = &mut buf[off..off + grad.len()];
        match accum {
            Some(a) => dst.iter_mut().zip(grad).zip(&a[range]).for_each(|((d, g), a)| *d = g + a),
            None => dst.copy_from_slice(grad),
        }
        if !std::mem::replace(&mut seen[idx], true) {
            remaining[b] -= 1;
        }
        if remaining[b] == 0 {
            self.bucket_complete(&mut inner, b);
        }
    }
}

impl Shared {
    /// Bucket `b`'s gradient is complete (in `buffers[b]`): submits it, and every bucket after
    /// it in `order` that was waiting for it, in `order`.
    fn bucket_complete(&self, inner: &mut Inner, b: usize) {
        inner.complete[b] = true;
        inner.filled.push(b);
        while inner.next < inner.order.len() && inner.complete[inner.order[inner.next]] {
            let b = inner.order[inner.next];
            inner.next += 1;
            let Inner { buffers, pieces, codecs, syncs, inflight, .. } = &mut *inner;
            let buf = buffers[b].take().expect("a complete bucket holds its gradient");
            let codec = if *syncs >= self.warmup { codecs[b].take() } else { None };
            inflight[b] = Some(self.submit_bucket(b, buf, pieces, codec));
            if self.reduce_scatter {
                inner.unwaited.push_back(b);
                self.bound_scatters(inner);
            }
        }
    }

    /// ZeRO-2/3: backward waits for the oldest reduce-scatters until at most
    /// [`MAX_SCATTERS_IN_FLIGHT`] are queued, as DeepSpeed's ZeRO-2 double-buffers its buckets: a
    /// bucket's whole gradient lives until its reduce-scatter has run, and a backward faster than
    /// the network would otherwise hold the whole model's gradient in them at once (ZeRO-3's peak
    /// 580 MB above its model states on a 78 M model over 2 ranks). Every rank submits the same
    /// buckets in the same order, so the oldest one completes on each. Its result is kept for
    /// [`Ddp::finish`], which reports a failure.
    fn bound_scatters(&self, inner: &mut Inner) {
        while inner.unwaited.len() > MAX_SCATTERS_IN_FLIGHT {
            let Some(old) = inner.unwaited.pop_front() else { break };
            if let Some(p) = inner.inflight[old].take() {
                let rank = self.comm.comm().rank();
                inner.inflight[old] = Some(Pending::ready(OpKind::ReduceScatter, rank, p.wait(Deadline::after(self.timeout))));
            }
        }
    }

    /// Rank 0's `filled` order, broadcast to every rank (queued behind the pass's buckets).
    fn broadcast_order(&self, filled: Vec<usize>) -> Pending<Vec<i64>> {
        let mut order: Vec<i64> = filled.into_iter().map(|b| b as i64).collect();
        order.resize(self.plan.len(), -1);
        self.comm.submit(OpKind::Broadcast, move |c| {
            c.broadcast(BufMut::from(&mut order[..]), Rank(0))?;
            Ok(order)
        })
    }

    /// A no-sync micro-step's gradient of the flat range `range`, added to the local
    /// accumulator ([`Ddp::set_no_sync`]).
    fn accumulate_into(&self, inner: &mut Inner, range: Range<usize>, grad: &[f32]) {
        let a = inner.accum.get_or_insert_with(|| vec![0f32; self.numel]);
        a[range].iter_mut().zip(grad).for_each(|(a, g)| *a += g);
    }

    /// Queues bucket `b`'s collective: all-reduce, or in-place reduce-scatter keeping this
    /// rank's piece.
    fn submit_bucket(
        &self,
        b: usize,
        buf: Vec<f32>,
        pieces: &mut [Option<Vec<f32>>],
        codec: Option<Box<dyn BucketCodec>>,
    ) -> Pending<Timed> {
        {
            if self.reduce_scatter {
                let own = self.shard.pieces[b].in_bucket.clone();
                let mut piece = pieces[b].take().unwrap_or_else(|| vec![0f32; own.len()]);
                self.comm.submit(OpKind::ReduceScatter, move |c| {
                    let s = Instant::now();
                    // In place: the bucket is its own working space; only this rank's piece
                    // is kept and the bucket buffer is freed here.
                    let mut buf = buf;
                    let (bytes, codec) = match codec {
                        Some(mut codec) => match codec.reduce_scatter(c, &mut buf, own.clone()) {
                            Some(bytes) => (bytes?, Some(codec)),
                            None => {
                                return Err(CommError::InvalidArgument {
                                    op: OpKind::ReduceScatter,
                                    rank: c.rank(),
                                    what: "ZeRO-2/3: this gradient codec cannot reduce-scatter (BucketCodec::reduce_scatter)".into(),
                                })
                            }
                        },
                        None => {
                            c.reduce_scatter_in_place(BufMut::from(&mut buf), ReduceOp::Avg)?;
                            (buf.len() * 4, None)
                        }
                    };
                    piece.copy_from_slice(&buf[own]);
                    Ok((None, Some(piece), s, Instant::now(), Sent { bytes, codec }))
                })
            } else if let Some(mut codec) = codec {
                // Compressed (after the warm-up): the codec does the exchange.
                self.comm.submit(OpKind::AllReduce, move |c| {
                    let s = Instant::now();
                    let mut buf = buf;
                    let bytes = codec.all_reduce(c, &mut buf)?;
                    Ok((Some(buf), None, s, Instant::now(), Sent { bytes, codec: Some(codec) }))
                })
            } else {
                self.comm.submit(OpKind::AllReduce, move |c| {
                    let s = Instant::now();
                    let mut buf = buf;
                    c.all_reduce(BufMut::from(&mut buf), ReduceOp::Avg)?;
                    let bytes = buf.len() * 4;
                    Ok((Some(buf), None, s, Instant::now(), Sent { bytes, codec: None }))
                })
            }
        }
    }
}

#[cfg(test)]
mod tests;
