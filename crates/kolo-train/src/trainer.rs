//! The training loop. Read top to bottom: set up data, model, DDP and optimizer; maybe resume;
//! then for each step run the micro-steps (only the last one communicates), clip, update,
//! log, evaluate and checkpoint; finally evaluate and, for text models, generate a sample.

pub use crate::checkpointing::newest_checkpoint;
use crate::checkpointing::{load_checkpoint, loop_state_meta, resolve_checkpoint, save_checkpoint, PendingSave};
use crate::config::{Config, DataKind};
use crate::data::{text_split, CharVocab, Dataset, Mnist, Synthetic};
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::TrainError;
use kolo_base::Rng;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_ddp::{Ddp, DdpConfig, ShardPlan, Sharding};
use kolo_optim::{clip_factor, lr_at, scaled_lr, sum_of_squares, Buffer, LossScaler, Optimizer};
use kolo_tensor::ops::{argmax_rows, softmax_last};
use kolo_tensor::{build_model, Batch, HookedView, Input, Model, ModelSpec, PlainView};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How to run, beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Resume from this checkpoint file, or the newest checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// Stop (as if interrupted) after this many steps in total; used to test resumption.
    pub stop_after: Option<u64>,
    /// No progress bar or log lines (tests).
    pub quiet: bool,
    /// Test hook: make rank 0's gradients non-finite at this step (0-based), as an f16
    /// overflow would.
    pub inject_inf_at: Option<u64>,
    /// Test hook: `(rank, ms)` makes that rank sleep this long in every step (a straggler).
    pub slow_rank: Option<(usize, u64)>,
    /// Test hook: `(rank, ms)` makes that rank sleep this long per example of its batch in
    /// every step (a slower device: its delay scales with its share of the work).
    pub slow_per_example: Option<(usize, f64)>,
    /// Test hook: abort the process in the middle of saving the checkpoint of this step (after
    /// this rank's shard is written, before the checkpoint is committed), as a crash would.
    pub crash_during_save: Option<u64>,
    /// Test hook: `(rank, step)` makes that rank vanish at the start of that step, as a crash
    /// would (DDP: it SIGKILLs itself; parameter-server workers: the worker stops talking).
    pub die_at: Option<(usize, u64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Eval {
    pub loss: f64,
    /// Classification accuracy (image models).
    pub accuracy: Option<f64>,
    pub examples: usize,
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub steps_done: u64,
    /// Mean training loss over all ranks at the last step.
    pub last_loss: f64,
    pub eval: Option<Eval>,
    /// Wall time of each step on this rank, milliseconds.
    pub step_ms: Vec<f64>,
    /// Time spent waiting for gradient all-reduces after backward, per step, milliseconds.
    pub comm_wait_ms: Vec<f64>,
    /// Bytes this rank handed to the gradient collectives, per synchronised step.
    pub comm_bytes: Vec<usize>,
    /// The last straggler detected: the rank whose own work per step was slowest, and how many
    /// milliseconds it was behind the median rank.
    pub straggler: Option<(usize, f64)>,
    /// Mean fraction of all-reduce time hidden behind backward.
    pub hidden_fraction: f64,
    /// Final parameters (flat).
    pub params: Vec<f32>,
    pub sample: Option<String>,
    pub checkpoint: Option<PathBuf>,
    /// Bytes of model states this rank holds between steps.
    pub states: StateBytes,
    /// Peak resident memory of this process (VmHWM), bytes, where the OS reports it.
    pub peak_rss: Option<u64>,
    /// Live heap bytes measured by Kolo's counting allocator, when the binary installed it.
    pub heap: Option<HeapReport>,
    /// f16 training: steps skipped because a gradient overflowed, and the final loss scale.
    pub skipped_steps: u64,
    pub loss_scale: Option<f64>,
    /// Parameter-server runs: what this worker pushed and pulled.
    pub ps: Option<kolo_ps::PushStats>,
    /// Pipeline runs: the mean measured bubble (idle share of the stages).
    pub pipeline_bubble: Option<f64>,
    /// Mixture-of-experts runs: tokens routed per expert over the run, summed over every rank.
    pub moe: Option<kolo_tensor::models::MoeLoad>,
    /// Dynamic batch sizing: each rank's share of the global batch at the end.
    pub batch_split: Option<Vec<usize>>,
}

/// What the GPT loops with a model of their own (pipeline, sequence and expert parallel) share
/// at the start: the config's deadline on each of their groups, the data of replica
/// `data_rank`, the live heap before the model and the GPT's shape.
pub(crate) fn gpt_loop_start(
    cfg: &Config,
    groups: &[&dyn Communicator],
    data_rank: usize,
) -> Result<(Data, Option<usize>, kolo_tensor::models::GptConfig), TrainError> {
    let timeout = Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    for g in groups {
        g.set_timeout(timeout);
    }
    let data = load_data(cfg, data_rank)?;
    let heap_before = kolo_base::alloc::stats().map(|h| h.live);
    let ModelSpec::Gpt(gcfg) = cfg.model_spec(data.vocab_size) else {
        return Err(TrainError::Config("this parallel mode trains the GPT (model.kind = \"gpt\")".into()));
    };
    Ok((data, heap_before, gcfg))
}

/// Prints on the lead rank only.
pub(crate) fn lead_say(lead: bool) -> impl Fn(&str) {
    move |m: &str| {
        if lead {
            kolo_base::eline!("{m}");
        }
    }
}

/// One optimizer step of every parameter of `params` (whole flat layout) with `grads`.
pub(crate) fn optimizer_step(params: &kolo_tensor::ParamSet, opt: &mut Optimizer, grads: &[f32], lr: f32) -> Result<(), TrainError> {
    opt.begin_step();
    for i in 0..params.len() {
        let r = params.get(i).range.clone();
        params.update_one(i, &mut |p| opt.update(r.start, p, &grads[r.clone()], lr))?;
    }
    Ok(())
}

/// The end of a run whose own model copy is split or chunked (sequence and expert
/// parallelism): rank 0 (`lead_eval`) evaluates a whole GPT rebuilt from `flat`, and the summary
/// reports this rank's `numel` values of parameters, gradients and optimizer state.
#[allow(clippy::too_many_arguments)]
pub(crate) fn finish_whole_gpt(
    cfg: &Config,
    gcfg: &kolo_tensor::models::GptConfig,
    data: &Data,
    say: &dyn Fn(&str),
    lead_eval: bool,
    end: u64,
    report: &mut crate::report::Reporter,
    flat: Vec<f32>,
    numel: usize,
    opt: &Optimizer,
    heap: (Option<usize>, Option<kolo_base::alloc::HeapStats>),
    moe: Option<kolo_tensor::models::MoeLoad>,
) -> Result<Summary, TrainError> {
    let (mut eval, mut sample) = (None, None);
    if lead_eval && end == cfg.train.steps {
        // Whole sequences, with an unsplit copy of the model.
        let (e, s) = evaluate_whole_gpt(cfg, gcfg, &flat, data, say)?;
        eval = Some(e);
        sample = s;
    }
    Ok(Summary {
        steps_done: end,
        last_loss: report.last_loss,
        eval,
        step_ms: std::mem::take(&mut report.step_ms),
        comm_wait_ms: Vec::new(),
        comm_bytes: std::mem::take(&mut report.comm_bytes),
        straggler: report.straggler,
        hidden_fraction: 0.0,
        params: flat,
        sample,
        checkpoint: None,
        states: StateBytes {
            params: numel as u64 * 4,
            grads: numel as u64 * 4,
            optimizer: opt.state().iter().map(|(_, v)| v.len() as u64 * 4).sum(),
            offloaded: false,
        },
        peak_rss: peak_rss(),
        heap: HeapReport::between(heap.0, heap.1),
        skipped_steps: 0,
        loss_scale: None,
        ps: None,
        pipeline_bubble: None,
        moe,
        batch_split: None,
    })
}

/// Live heap bytes at three points of a run (see `kolo_base::alloc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapReport {
    /// After the data is loaded, before the model exists.
    pub before_model: usize,
    /// After the last step: what stays alive between steps (model states and caches).
    pub between_steps: usize,
    /// The high-water mark over the steps (states plus activations and other transients).
    pub peak: usize,
}

impl HeapReport {
    /// From the live heap before the model and the allocator's statistics after the steps.
    pub fn between(before_model: Option<usize>, after: Option<kolo_base::alloc::HeapStats>) -> Option<HeapReport> {
        Some(HeapReport { before_model: before_model?, between_steps: after?.live, peak: after?.peak })
    }
}

/// The batches of data-parallel replica `dp_rank` of `dp_size`, from the batch after the first
/// `batches_done` (prefetched). Synthetic data is already per replica: it is not sharded again.
pub fn replica_batches(
    cfg: &Config,
    train: Arc<dyn Dataset>,
    dp_rank: usize,
    dp_size: usize,
    batches_done: u64,
) -> Result<Receiver<(Position, Batch)>, TrainError> {
    let (world, rank) = if cfg.data.kind == DataKind::Synthetic { (1, 0) } else { (dp_size, dp_rank) };
    let scfg = SamplerConfig {
        len: train.len(),
        world,
        rank,
        batch: cfg.data.batch_size,
        seed: cfg.train.seed,
        shuffle: cfg.data.shuffle,
        drop_last: cfg.data.drop_last,
    };
    let bpe = scfg.batches_per_epoch().max(1);
    let sampler = Sampler::new(scfg, Position { epoch: batches_done / bpe, batch: batches_done % bpe }).map_err(TrainError::Data)?;
    Ok(prefetch(train, sampler, cfg.data.prefetch))
}

/// Model states held by one rank between steps, by what they are (the ZeRO paper's split).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// The model's parameters (f32).
    pub params: u64,
    /// Gradient buffers kept across steps: the DDP buckets (plain DDP, ZeRO-1), this rank's
    /// gradient shard (ZeRO-2), the no-sync accumulator when accumulating.
    pub grads: u64,
    /// Optimizer state, plus under ZeRO this rank's master copy of its parameter shard.
    pub optimizer: u64,
    /// The optimizer bytes live in memory-mapped files, not in the heap.
    pub offloaded: bool,
}

impl StateBytes {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// Peak resident set size of this process (`VmHWM` in /proc/self/status), bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// A run's datasets, as `[data]` describes them.
pub struct Data {
    pub train: Arc<dyn Dataset>,
    pub eval: Arc<dyn Dataset>,
    pub vocab: Option<CharVocab>,
    pub vocab_size: usize,
}

/// Loads `[data]` (rank `rank` of the run, for synthetic data).
pub fn load_data(cfg: &Config, rank: usize) -> Result<Data, TrainError> {
    let d = &cfg.data;
    match d.kind {
        DataKind::Mnist => {
            let dir = PathBuf::from(d.path.as_deref().unwrap_or_default());
            if !dir.is_dir() {
                return Err(TrainError::Data(format!(
                    "MNIST directory {} not found (set data.path to a directory with the four idx(.gz) files; the repository ships a subset in test-data/mnist)",
                    dir.display()
                )));
            }
            Ok(Data {
                train: Arc::new(Mnist::load(&dir, "train")?),
                eval: Arc::new(Mnist::load(&dir, "t10k")?),
                vocab: None,
                vocab_size: 10,
            })
        }
        DataKind::Text => {
            let path = d.path.as_deref().unwrap_or_default();
            let seq = cfg.model.seq.unwrap_or(128);
            let text = std::fs::read(path).map_err(|e| {
                TrainError::Data(format!(
                    "text corpus {path}: {e} (set data.path or --data; the repository ships data/tinyshakespeare.txt)"
                ))
            })?;
            let name = path.to_string();
            let vocab = CharVocab::from_text(&text);
            let (train, eval) = text_split(&text, &vocab, seq.min(text.len() / 4).max(1), d.train_fraction, &name)?;
            Ok(Data { train: Arc::new(train), eval: Arc::new(eval), vocab_size: vocab.len(), vocab: Some(vocab) })
        }
        DataKind::Synthetic => {
            let n = d.synthetic_examples.unwrap_or(d.batch_size);
            let seed = 1234 + rank as u64;
            let ds: Arc<dyn Dataset> = match cfg.model.kind {
                crate::config::ModelKind::Gpt => Arc::new(Synthetic::tokens(n, cfg.model.seq.unwrap_or(128), 65, seed)),
                _ => Arc::new(Synthetic::images(n, seed)),
            };
            let vocab_size = if cfg.model.kind == crate::config::ModelKind::Gpt { 65 } else { 10 };
            Ok(Data { train: ds.clone(), eval: ds, vocab: None, vocab_size })
        }
    }
}

/// Prepares batches on a background thread, each with the sampler position after it.
fn prefetch(ds: Arc<dyn Dataset>, mut sampler: Sampler, depth: usize) -> Receiver<(Position, Batch)> {
    let (tx, rx) = sync_channel(depth.max(1));
    std::thread::Builder::new()
        .name("kolo-prefetch".into())
        .spawn(move || loop {
            let idx = sampler.next_batch();
            let b = ds.batch(&idx);
            if tx.send((sampler.position(), b)).is_err() {
                return;
            }
        })
        .expect("spawning the prefetch thread");
    rx
}

pub(crate) fn spec_string(spec: &ModelSpec) -> String {
    format!("{spec:?}")
}

/// Loss (mean per example) and accuracy over this rank's share of the evaluation set, combined
/// across ranks.
/// With `lockstep` (ZeRO-3, where every forward gathers parameters collectively) every rank
/// runs as many forward passes as rank 0, the one with the most examples, repeating its last
/// batch without counting it, and `settle` runs after every forward (it completes the gathers
/// a forward leaves in flight, before this function's own collective).
#[allow(clippy::too_many_arguments)]
pub(crate) fn evaluate(
    model: &dyn Model,
    view: &dyn kolo_tensor::ParamView,
    ds: &dyn Dataset,
    comm: &dyn Communicator,
    batch: usize,
    max_batches: usize,
    lockstep: bool,
    settle: &dyn Fn() -> Result<(), TrainError>,
) -> Result<Eval, TrainError> {
    let (r, n) = (comm.rank().get(), comm.world_size().get());
    let share = |r: usize| {
        let mine: Vec<usize> = (r..ds.len()).step_by(n).collect();
        let limit = if max_batches == 0 { mine.len() } else { (max_batches * batch).min(mine.len()) };
        (mine, limit)
    };
    let (mine, limit) = share(r);
    let rounds = if lockstep { share(0).1.div_ceil(batch.max(1)) } else { 0 };
    let (mut loss_sum, mut correct, mut count) = (0f64, 0f64, 0f64);
    let mut is_class = false;
    let chunks: Vec<&[usize]> = mine[..limit].chunks(batch.max(1)).collect();
    for extra in chunks.len()..rounds {
        let filler = chunks.last().copied().unwrap_or(&mine[..mine.len().min(1)]);
        if filler.is_empty() {
            return Err(TrainError::Data(format!("rank {r}: no evaluation example to keep in step with rank 0 (round {extra})")));
        }
        model.forward(&ds.batch(filler).input, view)?;
        settle()?;
    }
    for chunk in chunks {
        let b = ds.batch(chunk);
        let logits = model.forward(&b.input, view)?;
        if lockstep {
            settle()?;
        }
        let t =
            kolo_tensor::Tensor::from_slice(&b.targets, b.targets.len(), &kolo_tensor::device()).map_err(kolo_tensor::TensorError::from)?;
        let l = kolo_tensor::ops::cross_entropy(&logits, &t)?.to_scalar::<f32>().map_err(kolo_tensor::TensorError::from)?;
        loss_sum += f64::from(l) * chunk.len() as f64;
        count += chunk.len() as f64;
        if let Input::Images { .. } = b.input {
            is_class = true;
            let pred = argmax_rows(&logits)?;
            correct += pred.iter().zip(&b.targets).filter(|(p, t)| p == t).count() as f64;
        }
    }
    let mut v = [loss_sum, correct, count];
    comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
    let examples = v[2] as usize;
    Ok(Eval { loss: v[0] / v[2].max(1.0), accuracy: is_class.then(|| v[1] / v[2].max(1.0)), examples })
}

/// The final evaluation (and, for text, a sample) of a whole GPT rebuilt in this process from
/// `flat`: for the parallel modes whose own copy is split (pipeline stages, sequence chunks).
pub(crate) fn evaluate_whole_gpt(
    cfg: &Config,
    gcfg: &kolo_tensor::models::GptConfig,
    flat: &[f32],
    data: &Data,
    say: &dyn Fn(&str),
) -> Result<(Eval, Option<String>), TrainError> {
    let tc = &cfg.train;
    let whole = kolo_tensor::models::Gpt::new(gcfg.clone(), &mut Rng::new(tc.seed))?;
    whole.params().load(flat)?;
    let local = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0);
    let e = evaluate(&whole, &PlainView, &*data.eval, &local, cfg.data.batch_size, tc.eval_batches, false, &|| Ok(()))?;
    say(&format!("final eval on {} examples: loss {:.4}", e.examples, e.loss));
    let sample = match (&data.vocab, tc.sample_chars > 0) {
        (Some(v), true) => {
            let s = sample_text(&whole, &PlainView, v, gcfg.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(()))?;
            say(&format!("--- sample ({} chars, temperature {}) ---\n{s}\n---", tc.sample_chars, tc.sample_temperature));
            Some(s)
        }
        _ => None,
    };
    Ok((e, sample))
}

/// Generates `n` characters from a text model, starting from a newline.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sample_text(
    model: &dyn Model,
    view: &dyn kolo_tensor::ParamView,
    vocab: &CharVocab,
    seq: usize,
    n: usize,
    temperature: f32,
    seed: u64,
    settle: &dyn Fn() -> Result<(), TrainError>,
) -> Result<String, TrainError> {
    let mut rng = Rng::new(seed ^ 0x5A5A);
    let start = vocab.encode(b"\n").unwrap_or_else(|_| vec![0]);
    let mut ids: Vec<u32> = start;
    for _ in 0..n {
        let ctx: Vec<u32> = ids[ids.len().saturating_sub(seq)..].to_vec();
        let t = ctx.len();
        let logits = model.forward(&Input::Tokens { ids: ctx, b: 1, t }, view)?;
        settle()?;
        let last = logits.narrow(0, t - 1, 1).map_err(kolo_tensor::TensorError::from)?;
        let scaled = (last / f64::from(temperature.max(1e-3))).map_err(kolo_tensor::TensorError::from)?;
        let probs: Vec<f32> = softmax_last(&scaled)?
            .flatten_all()
            .map_err(kolo_tensor::TensorError::from)?
            .to_vec1()
            .map_err(kolo_tensor::TensorError::from)?;
        let u = rng.next_f64() as f32;
        let mut acc = 0f32;
        let next = probs.iter().position(|p| {
            acc += p;
            acc >= u
        });
        ids.push(next.unwrap_or(probs.len() - 1) as u32);
    }
    Ok(vocab.decode(&ids[1..]))
}

/// All-reduces of the vocabulary-parallel embedding, head and cross-entropy per micro-step.
const VOCAB_PARALLEL_REDUCES: usize = 5;

/// A tensor-parallel group as the model adapter sees it, counting its all-reduces.
struct CommGroup {
    comm: Arc<dyn Communicator>,
    calls: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

impl kolo_base::GroupSum for CommGroup {
    fn rank(&self) -> usize {
        self.comm.rank().get()
    }
    fn size(&self) -> usize {
        self.comm.world_size().get()
    }
    fn sum(&self, buf: &mut [f32]) -> Result<(), String> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.bytes.fetch_add(buf.len() as u64 * 4, std::sync::atomic::Ordering::Relaxed);
        self.comm.all_reduce(BufMut::from(buf), ReduceOp::Sum).map_err(|e| e.to_string())
    }
}

pub fn run(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions) -> Result<Summary, TrainError> {
    let global_rank = comm.rank().get();
    // Before anything else: every rank was started with the same job.
    crate::agreement::check_same_job(cfg, &*comm)?;
    if cfg.train.device != "cpu" {
        // `cuda` alone: one GPU per local rank (as torchrun's LOCAL_RANK convention).
        let name = match cfg.train.device.as_str() {
            "cuda" => format!("cuda:{}", std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0)),
            d => d.to_string(),
        };
        let dev = kolo_tensor::parse_device(&name).map_err(|e| TrainError::Config(format!("train.device: {e}")))?;
        kolo_tensor::set_device(dev);
    }
    // The mesh: pipeline stages (pp) of data-parallel replicas (dp) of tensor-parallel groups
    // (tp, consecutive ranks). DDP, data and evaluation run over the dp group; the model's
    // blocks are split over the tp group; stages talk over the pp group.
    let mesh = cfg.mesh_for(comm.world_size().get()).map_err(TrainError::Config)?;
    if let (Some(which), Some(_)) = (cfg.separate_loop(), &opts.resume) {
        return Err(TrainError::Config(format!(
            "resuming (--resume, elastic restarts) is not supported with {which} yet: it writes no checkpoints"
        )));
    }
    if mesh.ep > 1 {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("rep", mesh.dp / mesh.ep), ("ep", mesh.ep)])?;
        let g = |a: &str| m.group(a).expect("axis").clone();
        return crate::ep::run_expert_parallel(cfg, &*comm, g("ep"), g("rep"), opts);
    }
    if mesh.sp > 1 {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("dp", mesh.dp), ("sp", mesh.sp)])?;
        let sp = m.group("sp").expect("axis").clone();
        return crate::sp::run_sequence_parallel(cfg, &*comm, sp, m.coord("dp").expect("axis"), mesh.dp, opts);
    }
    if cfg.ddp.schedule.is_some() {
        return crate::scheduled_ddp::run_scheduled(cfg, comm, opts);
    }
    let (comm, tp_comm, pp_comm) = if mesh.tp > 1 || cfg.pipeline.is_some() {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("pp", mesh.pp), ("dp", mesh.dp), ("tp", mesh.tp)])?;
        let g = |a: &str| m.group(a).expect("axis").clone();
        (g("dp"), (mesh.tp > 1).then(|| g("tp")), Some(g("pp")))
    } else {
        (comm, None, None)
    };
    let tp_size = mesh.tp;
    let tp_group = tp_comm.as_ref().map(|c| Arc::new(CommGroup { comm: c.clone(), calls: Default::default(), bytes: Default::default() }));
    if let (Some(_), Some(pp)) = (&cfg.pipeline, &pp_comm) {
        let tp: Option<Arc<dyn kolo_base::GroupSum>> = tp_group.clone().map(|g| g as Arc<dyn kolo_base::GroupSum>);
        return crate::pipeline::run_pipeline(cfg, &**pp, &*comm, tp, global_rank, opts);
    }
    let rank = comm.rank().get();
    let world = comm.world_size().get();
    let lead = global_rank == 0 && !opts.quiet;
    let say = |m: &str| {
        if lead {
            kolo_base::eline!("{m}");
        }
    };
    let tc = &cfg.train;
    if tc.strategy == crate::config::Strategy::Ps {
        return Err(TrainError::Config("train.strategy = \"ps\" trains through parameter servers: run it with `kolo ps run` (or `kolo train` with KOLO_PS_COORDINATOR set)".into()));
    }
    let timeout = Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    comm.set_timeout(timeout);

    // Data, model, DDP, optimizer.
    let data = load_data(cfg, rank)?;
    let heap_before_model = kolo_base::alloc::stats().map(|h| h.live);
    let spec = cfg.model_spec(data.vocab_size);
    let mut model = match (&tp_group, &spec) {
        (Some(tp), ModelSpec::Gpt(g)) => {
            Box::new(kolo_tensor::models::Gpt::new_tensor_parallel(g.clone(), &mut Rng::new(tc.seed), tp.clone())?) as Box<dyn Model>
        }
        _ => build_model(&spec, tc.seed)?,
    };
    model.set_checkpointing(&cfg.model.checkpoint_blocks)?;
    let tp_split = model.tensor_parallel_split();
    let sharding = cfg.sharding().map_err(TrainError::Config)?;
    let groups = if sharding == Sharding::Parameters { model.param_groups() } else { Vec::new() };
    let (compression, compression_warmup) = cfg.compression().map_err(TrainError::Config)?;
    let ddp_cfg = DdpConfig {
        bucket_cap: cfg.bucket_cap().map_err(TrainError::Config)?,
        first_bucket_cap: cfg.first_bucket_cap().map_err(TrainError::Config)?,
        timeout,
        sharding,
        groups,
        compression,
        compression_warmup,
    };
    let ddp = Ddp::new(comm.clone(), &model.params().signature(), ddp_cfg)?;
    // `flat` is needed only until the model holds its starting values (broadcast, resume).
    let mut flat = model.params().to_flat()?;
    ddp.broadcast_params(&mut flat)?;
    // Under ZeRO the optimizer (and its state) covers this rank's shard only.
    let zero: Option<ShardPlan> = (sharding != Sharding::None).then(|| ddp.shard_plan().clone());
    let place = cfg.placement();
    let offload_err = |e: std::io::Error| {
        TrainError::Config(format!("optim.offload_dir {:?}: {e}", cfg.optim.offload_dir.as_deref().unwrap_or_default()))
    };
    let mut opt = Optimizer::with_placement(cfg.optimizer(), zero.as_ref().map_or(flat.len(), |z| z.len), &place).map_err(offload_err)?;
    let global_batch = cfg.data.batch_size * world * tc.grad_accum as usize;
    let base_lr = match cfg.optim.reference_batch {
        Some(r) => scaled_lr(cfg.optim.lr, global_batch, r),
        None => cfg.optim.lr,
    };
    let mut meta = BTreeMap::new();
    meta.insert("kolo.model".to_string(), spec_string(&spec));
    meta.insert("kolo.optimizer".to_string(), format!("{:?}", cfg.optimizer()));
    meta.insert("kolo.world_size".to_string(), world.to_string());
    meta.insert("kolo.batch_size".to_string(), cfg.data.batch_size.to_string());
    meta.insert("kolo.seed".to_string(), tc.seed.to_string());
    meta.insert("kolo.zero_stage".to_string(), sharding.stage().to_string());

    // Resume: every rank reads the same file, so every rank continues identically.
    let mut start = 0;
    let mut pos = Position::default();
    let (mut resumed_scale, mut resumed_split) = (None, None);
    if let Some(p) = &opts.resume {
        let path = resolve_checkpoint(p)?;
        let r = load_checkpoint(&path, model.params(), &mut flat, &mut opt, zero.as_ref(), ddp.ranges(), &meta)?;
        start = r.step;
        pos = r.pos;
        (resumed_scale, resumed_split) = (r.loss_scale, r.batch_split);
        say(&format!("resumed from {} at step {start}", path.display()));
    }
    model.params().load(&flat)?;
    // ZeRO: this rank's master copy of its shard of the parameters.
    // Under ZeRO-3 the DDP engine holds it: the model gathers its blocks from it.
    let zero3 = sharding == Sharding::Parameters;
    let mut master = Buffer::zeros(if zero3 { 0 } else { zero.as_ref().map_or(0, |z| z.len) }, &place, "master").map_err(offload_err)?;
    if let Some(z) = &zero {
        if zero3 {
            let mut m = vec![0f32; z.len];
            z.gather(ddp.ranges(), &flat, &mut m);
            ddp.set_master(m);
            model.shard_groups(ddp.gatherer())?;
        } else {
            z.gather(ddp.ranges(), &flat, master.as_mut_slice());
            master.release_all();
        }
    }
    let numel = flat.len();
    drop(flat);

    // Synthetic data is already per rank (seeded by rank): it is not sharded again.
    let (s_world, s_rank) = if cfg.data.kind == DataKind::Synthetic { (1, 0) } else { (world, rank) };
    let sampler = Sampler::new(
        SamplerConfig {
            len: data.train.len(),
            world: s_world,
            rank: s_rank,
            batch: cfg.data.batch_size,
            seed: tc.seed,
            shuffle: cfg.data.shuffle,
            drop_last: cfg.data.drop_last,
        },
        pos,
    )
    .map_err(TrainError::Data)?;
    // Dynamic batch sizing: every rank walks the global batches itself and takes its share;
    // the shares change during the run, so nothing is prefetched.
    // Deterministic mode takes the same contiguous slices (equal shares, never re-split): a
    // piece of the global batch then holds the same examples at every world size.
    let mut dynamic = (cfg.ddp.dynamic_batch_every > 0 || cfg.ddp.deterministic)
        .then(|| -> Result<DynamicBatch, TrainError> {
            let global = SamplerConfig { world: 1, rank: 0, batch: cfg.data.batch_size * world, ..sampler.config().clone() };
            // A resumed run continues with the split it was written with (at the same world
            // size and global batch; otherwise from equal shares).
            let equal = vec![cfg.data.batch_size; world];
            let split = match resumed_split.take() {
                Some(s)
                    if s.len() == world && s.iter().sum::<usize>() == cfg.data.batch_size * world && cfg.ddp.dynamic_batch_every > 0 =>
                {
                    s
                }
                _ => equal,
            };
            Ok(DynamicBatch { sampler: Sampler::new(global, pos).map_err(TrainError::Data)?, split })
        })
        .transpose()?;
    let batches = if dynamic.is_some() { None } else { Some(prefetch(data.train.clone(), sampler, cfg.data.prefetch)) };
    say(&format!(
        "kolo train: {} params, {} on {world} rank(s), global batch {global_batch} ({} x {world} ranks x {} micro-steps), {} buckets{}, data: {}, CPU kernels: {}, {} thread(s)",
        model.params().numel(),
        spec_string(&spec),
        cfg.data.batch_size,
        tc.grad_accum,
        ddp.plan().len(),
        match &zero {
            Some(z) => format!(", ZeRO-{} (optimizer state for {} of {numel} values on this rank)", sharding.stage(), z.len),
            None => String::new(),
        },
        data.train.describe(),
        kolo_base::simd::capability().name(),
        kolo_tensor::compute_threads()
    ));

    let mut report = crate::report::Reporter::new(cfg, global_rank, opts.quiet, global_batch, start)?;

    // Model states per rank: the parameters live in the model only (updated in place), the
    // gradients in the DDP buckets (plain DDP, ZeRO-1) or this rank's shard of them (ZeRO-2),
    // the optimizer state for the whole model or this rank's shard.
    // Local gradients of no-sync micro-steps, only when there are any.
    let mut micro = if tc.grad_accum > 1 || cfg.ddp.skip_sync || cfg.ddp.local_sgd.is_some() || cfg.ddp.deterministic {
        vec![0f32; numel]
    } else {
        Vec::new()
    };
    // Deterministic mode: the exact (fixed-point) sum of this rank's pieces' gradients.
    let mut exact = cfg.ddp.deterministic.then(|| kolo_ddp::exact::ExactSum::new(numel));
    // Mixed precision: the compute dtype, and for f16 a dynamic loss scale.
    let dtype = cfg.compute_dtype();
    let mut scaler = (dtype == kolo_tensor::CandleDType::F16).then(LossScaler::new);
    if let (Some(s), Some(state)) = (scaler.as_mut(), resumed_scale) {
        s.restore(state);
    }
    let eval_view: Box<dyn kolo_tensor::ParamView> =
        if dtype == kolo_tensor::CandleDType::F32 { Box::new(PlainView) } else { Box::new(kolo_tensor::CastView(dtype)) };
    let hooked = HookedView { sink: ddp.sink(), dtype };
    let mut timeline = tc.timeline_dir.as_ref().map(|_| crate::timeline::Timeline::new(rank));
    let mut eval = None;
    let mut checkpoint = None;
    let mut saving: Option<PendingSave> = None;
    // ZeRO-3: completes the gathers a forward pass leaves in flight (the last block prefetches
    // itself for a backward), so that the trainer's own collectives find the communicator idle.
    let settle = || -> Result<(), TrainError> {
        if zero3 {
            ddp.drop_prefetched()?;
        }
        Ok(())
    };
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    kolo_base::alloc::reset_peak();
    let mut heap_after_steps = None;
    for step in start..end {
        let t0 = Instant::now();
        let mut rec = crate::report::StepRecord::default();
        if let Some((r, ms)) = opts.slow_rank {
            if r == rank {
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        if opts.die_at == Some((rank, step)) {
            kolo_base::eline!("rank {rank}: killing itself (SIGKILL) at step {step} as asked (--kill-at)");
            // SAFETY: kill(2) on this process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        let lr = lr_at(base_lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        // Local SGD after its synchronous warm-up: no gradient exchange, periodic averaging.
        let local_step = crate::local_sgd::is_local(cfg.ddp.local_sgd.as_ref(), step);
        let mut loss_sum = 0f64;
        for m in 0..tc.grad_accum {
            let (p, batch) = match (&mut dynamic, &batches) {
                (Some(d), _) => d.next(&*data.train, rank),
                (None, Some(b)) => b.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?,
                (None, None) => unreachable!("one source of batches"),
            };
            pos = p;
            // Under dynamic batch sizing a rank's mean loss weighs by its share of the batch.
            let share = dynamic.as_ref().map_or(1.0, |d| d.split[rank] as f64 * world as f64 / d.split.iter().sum::<usize>() as f64);
            if let Some((_, ms)) = opts.slow_per_example.filter(|s| s.0 == rank) {
                std::thread::sleep(Duration::from_secs_f64(ms * batch.len() as f64 / 1e3));
            }
            let scale = share / tc.grad_accum as f64;
            // f16: backward runs on the loss times the loss scale; the step divides it out.
            let loss_scale = scaler.as_ref().map_or(1.0, LossScaler::scale);
            let te = kolo_tensor::TensorError::from;
            if let Some(exact) = exact.as_mut() {
                loss_sum += exact_pieces(&*model, &batch, &*eval_view, cfg.ddp.deterministic_chunk, &mut micro, exact, (rank, step))?
                    / tc.grad_accum as f64;
            } else if m + 1 < tc.grad_accum || cfg.ddp.skip_sync || local_step {
                // No-sync micro-step: gradients stay local.
                let loss = (model.loss(&batch, &*eval_view)? * scale).map_err(te)?;
                loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
                let g = (loss * loss_scale).map_err(te)?.backward().map_err(te)?;
                model.params().grads_into(&g, &mut micro)?;
                ddp.accumulate(&micro);
            } else {
                ddp.begin_backward();
                let loss = (model.loss(&batch, &hooked)? * scale).map_err(te)?;
                loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
                (loss * loss_scale).map_err(te)?.backward().map_err(te)?;
            }
        }
        let backward_end = Instant::now();
        let params = model.params();
        let ranges = ddp.ranges();
        let clip = |norm: f64| cfg.optim.clip_grad_norm.map_or(1.0, |max| clip_factor(norm, max));
        if let Some(exact) = exact.as_mut() {
            // Pieces in the whole step: micro-steps x the global batch / piece size.
            let global: usize = dynamic.as_ref().map_or(0, |d| d.split.iter().sum());
            let (bytes, wait) = exact_all_reduce(&*comm, exact, tc.grad_accum as usize * global / cfg.ddp.deterministic_chunk, &mut micro)?;
            if let Some(max) = cfg.optim.clip_grad_norm {
                // The same gradient on every rank, summed in a fixed order: the same factor.
                let f = clip_factor(sum_of_squares(&micro).sqrt(), max);
                micro.iter_mut().for_each(|g| *g *= f);
            }
            opt.begin_step();
            match &zero {
                None => {
                    for (i, r) in ranges.iter().enumerate() {
                        params.update_one(i, &mut |v| opt.update(r.start, v, &micro[r.clone()], lr))?;
                    }
                }
                Some(plan) => {
                    // ZeRO-1/2: every rank has the whole reduced gradient; it updates its shard.
                    for seg in &plan.segments {
                        let at = seg.shard_offset..seg.shard_offset + seg.within.len();
                        let g = &micro[ranges[seg.param].clone()][seg.within.clone()];
                        opt.update(at.start, &mut master.as_mut_slice()[at.clone()], g, lr);
                        master.release(at);
                    }
                    ddp.all_gather_params(master.as_slice(), |i: usize, v: &[f32]| params.load_one(i, v).map_err(TrainError::from))?;
                    master.release_all();
                }
            }
            rec.wait_ms = Some(wait.as_secs_f64() * 1e3);
            rec.hidden = Some(0.0);
            rec.comm_bytes = Some(bytes);
        } else if cfg.ddp.skip_sync || local_step {
            // Local SGD (or the no-sync benchmark mode): the local gradients are used as they are.
            ddp.take_accumulated(&mut micro);
            if cfg.optim.clip_grad_norm.is_some() {
                let f = clip(sum_of_squares(&micro).sqrt());
                micro.iter_mut().for_each(|g| *g *= f);
            }
            opt.begin_step();
            for (i, r) in ranges.iter().enumerate() {
                params.update_one(i, &mut |v| opt.update(r.start, v, &micro[r.clone()], lr))?;
            }
            if let Some(l) = cfg.ddp.local_sgd.as_ref().filter(|_| local_step) {
                rec.comm_bytes = Some(crate::local_sgd::after_update(l, step, params, &*comm)?);
            }
        } else {
            // Checks (f16: every rank agrees whether any gradient overflowed; such a step is
            // skipped), unscales and clips the gradients; returns whether to apply the step.
            // `sharded`: each rank has a piece, so the norm is a sum over ranks.
            let inject = opts.inject_inf_at == Some(step) && rank == 0;
            let mut prepare = |g: &mut kolo_ddp::BucketGrads<'_>, sharded: bool| -> Result<bool, TrainError> {
                if inject {
                    g.scale(f32::INFINITY); // test hook: an overflow on one rank
                }
                let inv = scaler.as_ref().map_or(1.0, |s| 1.0 / s.scale());
                if cfg.optim.clip_grad_norm.is_none() && scaler.is_none() {
                    return Ok(true);
                }
                let mut sq = [match (&tp_split, &tp_group) {
                    // Tensor parallelism: split parameters summed over the group, replicated
                    // ones counted once (member 0).
                    (Some(split), Some(tg)) if cfg.optim.clip_grad_norm.is_some() => {
                        let mut v = [(0..split.len())
                            .filter(|&i| split[i] || kolo_base::GroupSum::rank(&**tg) == 0)
                            .map(|i| kolo_base::sum_of_squares(g.param(i)))
                            .sum::<f64>() as f32];
                        kolo_base::GroupSum::sum(&**tg, &mut v).map_err(TrainError::Other)?;
                        f64::from(v[0])
                    }
                    _ => g.sum_of_squares(),
                }];
                if sharded && cfg.optim.clip_grad_norm.is_some() {
                    comm.all_reduce(BufMut::from(&mut sq[..]), ReduceOp::Sum)?;
                }
                if let Some(s) = scaler.as_mut() {
                    let mut bad = [u8::from(!sq[0].is_finite())];
                    comm.all_reduce(BufMut::from(&mut bad[..]), ReduceOp::Max)?;
                    if !s.update(bad[0] == 1) {
                        return Ok(false);
                    }
                }
                let f = f64::from(clip(sq[0].sqrt() * inv)) * inv;
                if f != 1.0 {
                    g.scale(f as f32);
                }
                Ok(true)
            };
            // Host waits for the last buckets here; everything before overlapped with backward.
            let (stats, _) = crate::update::apply_update(&ddp, params, &mut opt, zero.as_ref(), &mut master, lr, &mut prepare)?;
            if let Some(tl) = timeline.as_mut() {
                for (b, (s0, s1)) in stats.buckets.iter().enumerate() {
                    tl.span(&format!("bucket {b}"), "comm", crate::timeline::COMM, *s0, *s1, serde_json::json!({"step": step}));
                }
            }
            rec.wait_ms = Some(stats.wait.as_secs_f64() * 1e3);
            rec.hidden = Some(stats.hidden_fraction());
            rec.comm_bytes = Some(stats.bytes);
        }
        if let Some(tl) = timeline.as_mut() {
            let now = Instant::now();
            tl.span("forward + backward", "compute", crate::timeline::COMPUTE, t0, backward_end, serde_json::json!({"step": step}));
            tl.span("wait + update", "compute", crate::timeline::COMPUTE, backward_end, now, serde_json::json!({"step": step}));
        }
        heap_after_steps = kolo_base::alloc::stats();
        let skipped_steps = scaler.as_ref().map_or(0, LossScaler::skipped);
        report.record(step, crate::report::StepRecord { step_ms: t0.elapsed().as_secs_f64() * 1e3, skipped_steps, ..rec });

        let done = step + 1;
        if let Some(d) = dynamic.as_mut().filter(|_| cfg.ddp.dynamic_batch_every > 0 && done % cfg.ddp.dynamic_batch_every == 0) {
            // Time per example over the window, every rank's; the new split from it.
            let n = cfg.ddp.dynamic_batch_every as usize;
            let own = &report.compute_ms[report.compute_ms.len().saturating_sub(n)..];
            let mine = [own.iter().sum::<f64>() / own.len().max(1) as f64 / d.split[rank].max(1) as f64];
            let mut all = vec![0f64; world];
            comm.all_gather(kolo_comm::BufRef::from(&mine[..]), BufMut::from(&mut all))?;
            let next = crate::sampler::plan_split(d.split.iter().sum(), &all, 1);
            if next != d.split {
                report.log(&format!(
                    "step {done}: dynamic batch: per-rank batches {:?} -> {next:?} (ms per example {:?})",
                    d.split,
                    all.iter().map(|t| (t * 1000.0).round() / 1000.0).collect::<Vec<_>>()
                ));
                d.split = next;
            }
        }
        if report.is_log_step(done, end) {
            report.window(&*comm, done, loss_sum, lr, pos.epoch, "")?;
        }
        if tc.eval_every > 0 && done % tc.eval_every == 0 && done != end {
            let e = evaluate(&*model, &*eval_view, &*data.eval, &*comm, cfg.data.batch_size, tc.eval_batches, zero3, &settle)?;
            report.eval(done, &e, false);
        }
        if let Some(dir) = &tc.checkpoint_dir {
            if (tc.checkpoint_every > 0 && done % tc.checkpoint_every == 0) || done == end {
                if let Some(prev) = saving.take() {
                    checkpoint = Some(prev.wait()?);
                }
                let bg = tc.checkpoint_background && opts.crash_during_save.is_none();
                let crash = opts.crash_during_save == Some(done);
                let mut meta = meta.clone();
                meta.extend(loop_state_meta(
                    scaler.as_ref(),
                    dynamic.as_ref().filter(|_| cfg.ddp.dynamic_batch_every > 0).map(|d| &d.split[..]),
                ));
                let p = if zero3 {
                    ddp.with_master(|m| {
                        save_checkpoint(Path::new(dir), done, model.params(), m, &opt, zero.as_ref(), &*comm, pos, &meta, bg, crash)
                    })?
                } else {
                    save_checkpoint(
                        Path::new(dir),
                        done,
                        model.params(),
                        master.as_slice(),
                        &opt,
                        zero.as_ref(),
                        &*comm,
                        pos,
                        &meta,
                        bg,
                        crash,
                    )?
                };
                report.log(&format!(
                    "step {done}: checkpoint {}{}",
                    p.target.display(),
                    if bg { " (writing in the background)" } else { "" }
                ));
                saving = Some(p);
            }
        }
    }
    if let Some(prev) = saving.take() {
        let background = prev.thread.is_some();
        checkpoint = Some(prev.wait()?);
        if background {
            // Every rank's writer has finished (and rank 0 committed) before anyone reports done.
            comm.barrier()?;
        }
    }
    if let (Some(tl), Some(d)) = (&timeline, &tc.timeline_dir) {
        let dir = Path::new(d);
        let io = |e: std::io::Error| TrainError::Other(format!("train.timeline_dir {d}: {e}"));
        std::fs::create_dir_all(dir).map_err(io)?;
        tl.write(&dir.join(format!("trace-rank{rank}.json"))).map_err(io)?;
        comm.barrier()?;
        if rank == 0 {
            let files: Vec<PathBuf> = (0..world).map(|r| dir.join(format!("trace-rank{r}.json"))).collect();
            crate::timeline::merge(&files, &dir.join("trace.json")).map_err(io)?;
            say(&format!("timeline: {} (open in https://ui.perfetto.dev)", dir.join("trace.json").display()));
        }
    }
    report.finish();
    if let (Some(g), ModelSpec::Gpt(gc)) = (&tp_group, &spec) {
        let steps = (end - start).max(1) * tc.grad_accum;
        let calls = g.calls.load(std::sync::atomic::Ordering::Relaxed) as f64 / steps as f64;
        let mb = g.bytes.load(std::sync::atomic::Ordering::Relaxed) as f64 / steps as f64 / 1e6;
        // Outside the blocks: the vocabulary-parallel embedding (1, forward), head (1, backward)
        // and cross-entropy (3: maxima, sums of exponentials, target logits).
        say(&format!(
            "tensor parallel: {calls:.1} all-reduces ({mb:.2} MB) per micro-step over {} ranks: {:.1} per block for {} blocks (Megatron: 2 in forward + 2 in backward) + {VOCAB_PARALLEL_REDUCES} for the vocabulary-parallel embedding, head and cross-entropy",
            tp_size,
            (calls - VOCAB_PARALLEL_REDUCES as f64) / gc.n_layer as f64,
            gc.n_layer,
        ));
    }
    if end == tc.steps {
        // The final evaluation covers the whole test set for images (10k for MNIST); text
        // validation sets have a window at every position, so `eval_batches` bounds them.
        let limit = if data.vocab.is_some() { tc.eval_batches } else { 0 };
        let e = evaluate(&*model, &*eval_view, &*data.eval, &*comm, cfg.data.batch_size, limit, zero3, &settle)?;
        report.eval(end, &e, true);
        eval = Some(e);
    }
    let sample = match (&data.vocab, &spec) {
        // Under ZeRO-3 every rank samples (the same text: same seed), since each forward
        // gathers the blocks collectively.
        (Some(v), ModelSpec::Gpt(g)) if (rank == 0 || zero3) && end == tc.steps && tc.sample_chars > 0 => {
            let s = sample_text(&*model, &*eval_view, v, g.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &settle)?;
            say(&format!("--- sample ({} chars, temperature {}) ---\n{s}\n---", tc.sample_chars, tc.sample_temperature));
            Some(s)
        }
        _ => None,
    };
    let bytes = |n: usize| n as u64 * 4;
    let resident: usize =
        (0..model.params().len()).filter(|&i| model.params().is_resident(i)).map(|i| model.params().get(i).range.len()).sum();
    let states = StateBytes {
        params: bytes(resident),
        grads: bytes(
            if matches!(sharding, Sharding::Gradients | Sharding::Parameters) {
                ddp.grad_len()
            } else {
                ddp.plan().iter().map(|b| b.numel).sum()
            } + micro.len(),
        ),
        optimizer: bytes(opt.state().iter().map(|(_, v)| v.len()).sum::<usize>() + master.len() + ddp.with_master(|m| m.len())),
        offloaded: opt.is_offloaded() || master.is_offloaded(),
    };
    let moe = crate::ep::reduce_load(model.take_moe_load(), &*comm)?;
    Ok(Summary {
        steps_done: end,
        last_loss: report.last_loss,
        eval,
        hidden_fraction: report.hidden_fraction(),
        step_ms: std::mem::take(&mut report.step_ms),
        comm_wait_ms: std::mem::take(&mut report.wait_ms),
        comm_bytes: std::mem::take(&mut report.comm_bytes),
        straggler: report.straggler,
        params: if zero3 {
            let mut flat = vec![0f32; numel];
            let ranges = ddp.ranges();
            ddp.with_master(|m| {
                ddp.all_gather_everything(m, |i, v| {
                    flat[ranges[i].clone()].copy_from_slice(v);
                    Ok::<(), TrainError>(())
                })
            })?;
            flat
        } else {
            let local = model.params().to_flat()?;
            match (model.tensor_parallel_pieces(&local), &tp_comm) {
                (Some(pieces), Some(tp)) => {
                    // The whole model on every rank: the group's pieces summed.
                    let mut full = pieces?;
                    tp.all_reduce(BufMut::from(&mut full[..]), ReduceOp::Sum)?;
                    full
                }
                _ => local,
            }
        },
        states,
        peak_rss: peak_rss(),
        skipped_steps: scaler.as_ref().map_or(0, LossScaler::skipped),
        loss_scale: scaler.as_ref().map(LossScaler::scale),
        heap: HeapReport::between(heap_before_model, heap_after_steps),
        sample,
        checkpoint,
        ps: None,
        pipeline_bubble: None,
        moe,
        batch_split: dynamic.map(|d| d.split),
    })
}

/// Deterministic mode, one micro-step: `batch` cut into pieces of `chunk` examples, each
/// piece's gradient (of its own mean loss) added to `exact`. Returns the mean of the pieces'
/// losses. `at` = (rank, step) for the error.
fn exact_pieces(
    model: &dyn Model,
    batch: &Batch,
    view: &dyn kolo_tensor::ParamView,
    chunk: usize,
    grad: &mut [f32],
    exact: &mut kolo_ddp::exact::ExactSum,
    at: (usize, u64),
) -> Result<f64, TrainError> {
    let te = kolo_tensor::TensorError::from;
    let pieces = batch.chunks(chunk).ok_or_else(|| {
        TrainError::Config(format!("ddp.deterministic_chunk = {chunk} does not divide this rank's batch of {}", batch.len()))
    })?;
    let mut loss_sum = 0f64;
    for piece in &pieces {
        let loss = model.loss(piece, view)?;
        loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
        let g = loss.backward().map_err(te)?;
        model.params().grads_into(&g, grad)?;
        exact.add(grad).map_err(|e| {
            TrainError::Other(format!(
                "rank {}, step {}: gradient element {} is {} (ddp.deterministic sums gradients below 2^24 in magnitude; the run has diverged)",
                at.0, at.1, e.idx, e.value
            ))
        })?;
    }
    Ok(loss_sum / pieces.len() as f64)
}

/// Deterministic mode, the exchange: every rank's exact sum added as integers (an `i64` sum
/// all-reduce of two lanes per element, so any order gives the same bits), divided by the
/// number of pieces in the global step, into `grad`. Clears `exact`. Returns the bytes sent
/// and the time spent.
fn exact_all_reduce(
    comm: &dyn Communicator,
    exact: &mut kolo_ddp::exact::ExactSum,
    pieces: usize,
    grad: &mut [f32],
) -> Result<(usize, Duration), TrainError> {
    let t = Instant::now();
    let lanes = exact.lanes_mut();
    comm.all_reduce(BufMut::from(&mut *lanes), ReduceOp::Sum)?;
    let bytes = lanes.len() * 8;
    exact.mean_into(pieces.max(1), grad);
    exact.clear();
    Ok((bytes, t.elapsed()))
}

/// Dynamic batch sizing: the global batches in order, and each rank's current share.
struct DynamicBatch {
    sampler: Sampler,
    split: Vec<usize>,
}

impl DynamicBatch {
    /// Rank `rank`'s slice of the next global batch: the ranks' shares in rank order.
    fn next(&mut self, ds: &dyn Dataset, rank: usize) -> (Position, Batch) {
        let idx = self.sampler.next_batch();
        let from: usize = self.split[..rank].iter().sum();
        (self.sampler.position(), ds.batch(&idx[from..from + self.split[rank]]))
    }
}
