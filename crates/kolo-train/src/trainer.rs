//! The entry point of training ([`run`]: picks the strategy the config names and hands it to
//! the driver, `crate::driver`) and what every loop shares: the datasets, evaluation, sampling
//! and the summary of a run.

pub use crate::checkpointing::newest_checkpoint;
use crate::checkpointing::resolve_checkpoint;
use crate::config::{Config, DataKind};
use crate::data::{text_split, CharVocab, Dataset, Mnist, Synthetic};
use crate::driver::Strategy;
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::TrainError;
use kolo_base::Rng;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_optim::Optimizer;
use kolo_tensor::ops::{argmax_rows, softmax_last};
use kolo_tensor::{Batch, Input, Model, ModelSpec, PlainView};
use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

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
    pub ps: Option<crate::PushStats>,
    /// Pipeline runs: the mean measured bubble (idle share of the stages).
    pub pipeline_bubble: Option<f64>,
    /// Mixture-of-experts runs: tokens routed per expert over the run, summed over every rank.
    pub moe: Option<kolo_tensor::models::MoeLoad>,
    /// Dynamic batch sizing: each rank's share of the global batch at the end.
    pub batch_split: Option<Vec<usize>>,
}

/// The config's deadline on each of a GPT strategy's `groups`, and the GPT's shape.
pub(crate) fn gpt_config(cfg: &Config, groups: &[&dyn Communicator], data: &Data) -> Result<kolo_tensor::models::GptConfig, TrainError> {
    let timeout = Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    for g in groups {
        g.set_timeout(timeout);
    }
    let ModelSpec::Gpt(gcfg) = cfg.model_spec(data.vocab_size) else {
        return Err(TrainError::Config("this parallel mode trains the GPT (model.kind = \"gpt\")".into()));
    };
    Ok(gcfg)
}

/// The optimizer over `numel` values, its state where `optim.offload_dir` puts it.
pub(crate) fn optimizer_for(cfg: &Config, numel: usize) -> Result<Optimizer, TrainError> {
    Optimizer::with_placement(cfg.optimizer(), numel, &cfg.placement())
        .map_err(|e| TrainError::Config(format!("optim.offload_dir {:?}: {e}", cfg.optim.offload_dir.as_deref().unwrap_or_default())))
}

/// Model states of a rank holding the whole model, its gradient and optimizer state.
pub(crate) fn replicated_states(numel: usize, opt: &Optimizer) -> StateBytes {
    StateBytes {
        params: numel as u64 * 4,
        grads: numel as u64 * 4,
        optimizer: opt.state().iter().map(|(_, v)| v.len() as u64 * 4).sum(),
        offloaded: opt.is_offloaded(),
    }
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
    let scfg = replica_sampler(cfg, train.len(), dp_rank, dp_size);
    let pos = position_after(&scfg, batches_done);
    let sampler = Sampler::new(scfg, pos).map_err(TrainError::Data)?;
    Ok(crate::driver::prefetch(train, sampler, cfg.data.prefetch))
}

/// The sampler position after `batches_done` batches of `scfg`.
fn position_after(scfg: &SamplerConfig, batches_done: u64) -> Position {
    let bpe = scfg.batches_per_epoch().max(1);
    Position { epoch: batches_done / bpe, batch: batches_done % bpe }
}

/// The sampler position of data-parallel replica `rank` of `world` over `len` training
/// examples after `batches_done` batches.
#[cfg(feature = "ps")]
pub(crate) fn replica_position(cfg: &Config, len: usize, rank: usize, world: usize, batches_done: u64) -> Position {
    position_after(&replica_sampler(cfg, len, rank, world), batches_done)
}

/// The sampler of data-parallel replica `rank` of `world` over `len` examples (synthetic data
/// is already per replica: it is not sharded again).
fn replica_sampler(cfg: &Config, len: usize, rank: usize, world: usize) -> SamplerConfig {
    let (world, rank) = if cfg.data.kind == DataKind::Synthetic { (1, 0) } else { (world, rank) };
    SamplerConfig {
        len,
        world,
        rank,
        batch: cfg.data.batch_size,
        seed: cfg.train.seed,
        shuffle: cfg.data.shuffle,
        drop_last: cfg.data.drop_last,
    }
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

/// Keeps the memory training frees inside the process, once per process (unless `KOLO_HEAP`
/// is `system`). A step allocates and frees the same large activation and gradient tensors
/// again and again; glibc hands every block of 128 KiB to 32 MiB back to the kernel with
/// `munmap` and maps it afresh, so each step page-faulted its whole working set in again (16 %
/// of a GPT-2 124M step on the CPU). With no `mmap` for blocks and no trimming, freed blocks
/// are reused; resident memory stays at its peak, as under torch's caching allocators. Called
/// by [`run`] and by the `kolo` library's trainer.
pub fn retain_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("KOLO_HEAP").is_some_and(|v| v == "system") {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes glibc's thresholds; any value is valid.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        }
    });
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

/// The config's model holding `params` (flat, as a [`Summary`] has them) evaluated in this
/// process on the config's whole evaluation set (text: `train.eval_batches` batches).
pub fn evaluate_params(cfg: &Config, params: &[f32]) -> Result<Eval, TrainError> {
    let data = load_data(cfg, 0)?;
    let model = kolo_tensor::build_model(&cfg.model_spec(data.vocab_size), cfg.train.seed)?;
    model.params().load(params)?;
    let alone = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0);
    let limit = if data.vocab.is_some() { cfg.train.eval_batches } else { 0 };
    evaluate(&*model, &PlainView, &*data.eval, &alone, cfg.data.batch_size, limit, false, &|| Ok(()))
}

/// A whole GPT in this process holding `flat`.
fn whole_gpt(cfg: &Config, gcfg: &kolo_tensor::models::GptConfig, flat: &[f32]) -> Result<kolo_tensor::models::Gpt, TrainError> {
    let whole = kolo_tensor::models::Gpt::new(gcfg.clone(), &mut Rng::new(cfg.train.seed))?;
    whole.params().load(flat)?;
    Ok(whole)
}

/// Loss over at most `max_batches` batches of `ds` of a whole GPT holding `flat`, in this
/// process alone (the strategies whose own model is split or chunked evaluate on one rank).
pub(crate) fn evaluate_alone(
    cfg: &Config,
    gcfg: &kolo_tensor::models::GptConfig,
    flat: &[f32],
    ds: &dyn Dataset,
    max_batches: usize,
) -> Result<Eval, TrainError> {
    let whole = whole_gpt(cfg, gcfg, flat)?;
    let local = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0);
    evaluate(&whole, &PlainView, ds, &local, cfg.data.batch_size, max_batches, false, &|| Ok(()))
}

/// A sample (the config's length and temperature) of a whole GPT holding `flat`.
pub(crate) fn sample_alone(
    cfg: &Config,
    gcfg: &kolo_tensor::models::GptConfig,
    flat: &[f32],
    vocab: &CharVocab,
) -> Result<String, TrainError> {
    let whole = whole_gpt(cfg, gcfg, flat)?;
    let tc = &cfg.train;
    sample_text(&whole, &PlainView, vocab, gcfg.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(()))
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

/// Trains `cfg` on this rank of `comm`: picks the strategy the config names (data parallel,
/// with ZeRO and tensor parallelism; scheduled DDP; sequence or expert parallel; GPipe, 1F1B or
/// PipeDream-2BW pipelines) and runs it on the driver to the end.
pub fn run(cfg: &Config, comm: Arc<dyn Communicator>, opts: &RunOptions) -> Result<Summary, TrainError> {
    let global_rank = comm.rank().get();
    retain_freed_memory();
    // Before anything else: every rank was started with the same job.
    crate::agreement::check_same_job(cfg, &*comm)?;
    select_device(cfg)?;
    // The mesh: pipeline stages (pp) of data-parallel replicas (dp) of tensor-parallel groups
    // (tp, consecutive ranks). DDP, data and evaluation run over the dp group; the model's
    // blocks are split over the tp group; stages talk over the pp group.
    let mesh = cfg.mesh_for(comm.world_size().get()).map_err(TrainError::Config)?;
    if cfg.train.strategy == crate::config::Strategy::Ps {
        return Err(TrainError::Config("train.strategy = \"ps\" trains through parameter servers: run it with `kolo ps run` (or `kolo train` with KOLO_PS_COORDINATOR set)".into()));
    }
    let resume = opts.resume.as_deref().map(resolve_checkpoint).transpose()?;
    let resume = resume.as_deref();
    if cfg.ddp.schedule.is_some() {
        return crate::scheduled_ddp::run_scheduled(cfg, comm, opts, resume);
    }
    // Loads the data of replica `data_rank`, builds the strategy and drives it.
    let start = |data_rank: usize| -> Result<(Data, Option<usize>), TrainError> {
        let data = load_data(cfg, data_rank)?;
        let heap_before = kolo_base::alloc::stats().map(|h| h.live);
        Ok((data, heap_before))
    };
    let drive = |data: &Data, heap, s: &mut dyn Strategy, from| {
        crate::driver::drive(cfg, opts, crate::driver::Job::Ranks(&*comm), data, heap, s, from)
    };
    if mesh.ep > 1 {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("rep", mesh.dp / mesh.ep), ("ep", mesh.ep)])?;
        let g = |a: &str| m.group(a).expect("axis").clone();
        let (data, heap) = start(global_rank)?;
        let (mut s, from) = crate::expert_parallel::ExpertParallel::new(cfg, comm.clone(), g("ep"), g("rep"), &data, resume, opts)?;
        return drive(&data, heap, &mut s, from);
    }
    if mesh.sp > 1 {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("dp", mesh.dp), ("sp", mesh.sp)])?;
        let (sp, dp_rank) = (m.group("sp").expect("axis").clone(), m.coord("dp").expect("axis"));
        let (data, heap) = start(dp_rank)?;
        let (mut s, from) =
            crate::sequence_parallel::SequenceParallel::new(cfg, comm.clone(), sp, (dp_rank, mesh.dp), &data, resume, opts)?;
        return drive(&data, heap, &mut s, from);
    }
    let (dp, tp, pp) = if mesh.tp > 1 || cfg.pipeline.is_some() {
        let m = kolo_comm::DeviceMesh::new(&*comm, &[("pp", mesh.pp), ("dp", mesh.dp), ("tp", mesh.tp)])?;
        let g = |a: &str| m.group(a).expect("axis").clone();
        (g("dp"), (mesh.tp > 1).then(|| g("tp")), Some(g("pp")))
    } else {
        (comm.clone(), None, None)
    };
    if let (Some(pc), Some(pp)) = (&cfg.pipeline, &pp) {
        let tp = tp.map(|c| crate::data_parallel::CommGroup::new(c) as Arc<dyn kolo_base::GroupSum>);
        let (data, heap) = start(dp.rank().get())?;
        let groups = crate::pipeline::StageGroups { pp: &**pp, dp: &*dp, tp, global_rank };
        let stage = crate::pipeline::build_resumed(cfg, groups, &data, resume, opts)?;
        if pc.schedule == crate::config::PipeSchedule::TwoBw {
            let (mut s, from) = crate::pipedream_2bw::TwoBw::new(stage)?;
            return drive(&data, heap, &mut s, from);
        }
        let (mut s, from) = crate::pipeline::Flushed::new(stage);
        return drive(&data, heap, &mut s, from);
    }
    let (data, heap) = start(dp.rank().get())?;
    let (mut s, from) = crate::data_parallel::DataParallel::new(cfg, dp, tp, global_rank, &data, resume, opts)?;
    drive(&data, heap, &mut s, from)
}

/// `train.device`: `cuda` alone is one GPU per local rank (torchrun's LOCAL_RANK convention).
fn select_device(cfg: &Config) -> Result<(), TrainError> {
    if cfg.train.device == "cpu" {
        return Ok(());
    }
    let name = match cfg.train.device.as_str() {
        "cuda" => format!("cuda:{}", std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0)),
        d => d.to_string(),
    };
    let dev = kolo_tensor::parse_device(&name).map_err(|e| TrainError::Config(format!("train.device: {e}")))?;
    kolo_tensor::set_device(dev);
    Ok(())
}
