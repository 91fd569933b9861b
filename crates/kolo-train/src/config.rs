//! The training configuration (`kolo train --config FILE.toml`). Every field is documented here;
//! unknown fields are rejected, and fields that do not apply to the chosen model or data kind
//! are reported instead of being silently ignored.

use crate::TrainError;
use kolo_base::ByteSize;
use kolo_optim::{OptimizerSpec, Schedule};
use kolo_tensor::models::GptConfig;
use kolo_tensor::ModelSpec;
use serde::{Deserialize, Serialize};

#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub model: ModelConfig,
    pub data: DataConfig,
    #[serde(default)]
    pub optim: OptimConfig,
    #[serde(default)]
    pub train: TrainConfig,
    #[serde(default)]
    pub ddp: DdpConfig,
    #[serde(default)]
    pub ps: PsConfig,
    /// Pipeline parallelism (gpt): every rank is a stage. Default: off.
    pub pipeline: Option<PipelineConfig>,
    /// The device mesh, e.g. `mesh = { dp = 2, tp = 2, pp = 1 }` (3D parallelism): ranks laid
    /// out pp x dp x tp with tp varying fastest (tensor-parallel peers are consecutive ranks).
    pub mesh: Option<MeshConfig>,
    /// Federated averaging (`kolo fed run|serve|client`). Default: off.
    pub fed: Option<FedConfig>,
}

/// The tables a strategy reads after it is built ([`Setup::step_tables`](crate::setup::Setup::step_tables)).
#[derive(Clone, Copy)]
pub struct StepTables<'a> {
    pub train: &'a TrainConfig,
    pub optim: &'a OptimConfig,
    pub ddp: &'a DdpConfig,
    /// `[data] batch_size`: each rank's micro-batch.
    pub batch_size: usize,
}

/// `[fed]`: federated averaging over MNIST clients.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct FedConfig {
    /// Rounds of training.
    pub rounds: u32,
    /// Clients in the job: the training set is split into this many shards, one per client.
    #[serde(default = "fed_clients")]
    pub clients: usize,
    /// Clients sampled per round (default: all of them).
    pub clients_per_round: Option<usize>,
    /// Epochs each sampled client trains on its own shard per round (E). Default 1.
    #[serde(default = "one")]
    pub local_epochs: usize,
    /// Seconds a round waits for its clients' updates; late ones are left out. Default 60.
    #[serde(default = "fed_deadline")]
    pub round_deadline_secs: f64,
    /// Secure aggregation: clients mask their updates pairwise; the server sees only the sum.
    #[serde(default)]
    pub secure: bool,
    /// How the training set is split: `iid` (a random shard each) or `labels` (non-IID: each
    /// client holds `labels_per_client` sorted-by-label shards, as McMahan et al.). Default labels.
    #[serde(default)]
    pub split: FedSplit,
    /// Non-IID split: shards (mostly one digit each) per client. Default 2.
    #[serde(default = "two")]
    pub labels_per_client: usize,
    /// At most this many examples per client (default: the whole shard).
    pub examples_per_client: Option<usize>,
    /// Client identities (`kolo fed keygen --out DIR`): the server reads `DIR/roster.txt`,
    /// client i `DIR/client-{i}.key` and the roster; each client's masking key is then signed,
    /// and a client masks only for cohorts whose every key its member signed (secure
    /// aggregation against a server that substitutes keys). `kolo fed run` makes a fresh set
    /// for a secure job that names none. Default: none.
    pub identities: Option<String>,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum FedSplit {
    Iid,
    #[default]
    Labels,
}

fn fed_clients() -> usize {
    10
}

fn fed_deadline() -> f64 {
    60.0
}

fn two() -> usize {
    2
}

/// `[mesh]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct MeshConfig {
    /// Tensor-parallel group size: each GPT block's heads and MLP split over this many ranks
    /// (Megatron). Divides the head count. Default 1.
    #[serde(default = "one")]
    pub tp: usize,
    /// Pipeline stages (needs `[pipeline]`). Default: with `[pipeline]`, world / (dp x tp); else 1.
    pub pp: Option<usize>,
    /// Data-parallel replicas. Default: whatever remains of the world size.
    pub dp: Option<usize>,
    /// Sequence parallelism: every sequence split into this many contiguous chunks, one per rank
    /// of a group, attention over a ring (GPT; not combined with tp or pp yet). Default 1.
    #[serde(default = "one")]
    pub sp: usize,
    /// Expert parallelism: the experts of every MoE block dealt over groups of this many
    /// consecutive data-parallel ranks, tokens sent to their expert's rank with all-to-all.
    /// Divides dp and model.experts. Default 1 (every rank holds every expert).
    #[serde(default = "one")]
    pub ep: usize,
}

/// The mesh a run uses: (dp, tp, pp), their product the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mesh {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub sp: usize,
    pub ep: usize,
}

/// `[pipeline]`: the GPT's layers (embedding, blocks, head) cut into one stage per rank by a
/// planner that balances their cost; each batch runs as `micro_batches` micro-batches.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Micro-batches per batch (data.batch_size must be a multiple).
    pub micro_batches: usize,
    /// `gpipe` (all forwards, then all backwards), `1f1b` (PipeDream-Flush; default) or `2bw`
    /// (PipeDream-2BW: no flush, double-buffered weights; needs micro_batches >= stages - 1).
    #[serde(default = "one_f_one_b")]
    pub schedule: PipeSchedule,
    /// Re-materialization: each stage keeps only its input activation per micro-batch and runs
    /// its forward again in backward (less activation memory for one more forward). Default false.
    #[serde(default)]
    pub rematerialize: bool,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeSchedule {
    #[serde(rename = "gpipe")]
    GPipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// PipeDream-2BW: no flush between batches, double-buffered weights (batch t's gradient
    /// is computed on the weights of one update before the ones it is applied to).
    #[serde(rename = "2bw")]
    TwoBw,
}

fn one_f_one_b() -> PipeSchedule {
    PipeSchedule::OneFOneB
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Fully connected ReLU network on flattened 28x28 images.
    Mlp,
    /// Two conv+pool layers and a linear head on 1x28x28 images.
    Cnn,
    /// Character-level decoder-only transformer.
    Gpt,
}

/// `[model]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// `mlp`, `cnn` or `gpt`.
    pub kind: ModelKind,
    /// mlp: hidden layer widths (default [512, 512], the benchmark shape 784-512-512-10).
    pub hidden: Option<Vec<usize>>,
    /// cnn: output channels of the two conv layers (default [16, 32]).
    pub channels: Option<[usize; 2]>,
    /// gpt: context length in characters (default 128).
    pub seq: Option<usize>,
    /// gpt: embedding width (default 256).
    pub d_model: Option<usize>,
    /// gpt: attention heads (default 4).
    pub n_head: Option<usize>,
    /// gpt: transformer blocks (default 4).
    pub n_layer: Option<usize>,
    /// gpt: blocks (0-based) whose activations are recomputed in backward instead of kept
    /// (activation checkpointing: less memory for about one more forward pass). Default none.
    #[serde(default)]
    pub checkpoint_blocks: Vec<usize>,
    /// gpt: mixture of experts — every block's MLP becomes this many expert MLPs behind a
    /// learned gate (Switch/GShard). Default none (dense MLPs).
    pub experts: Option<usize>,
    /// gpt with experts: experts per token, 1 (Switch) to `experts`; above 1 their gate
    /// probabilities are renormalised over the top k (GShard). Default 1.
    #[serde(default = "one")]
    pub top_k: usize,
    /// gpt with experts: each expert takes at most ceil(factor x tokens x top_k / experts) of
    /// one rank's tokens per step; the rest are dropped (counted). Default 1.25.
    #[serde(default = "capacity_default")]
    pub capacity_factor: f64,
    /// gpt with experts: weight of the auxiliary load-balancing loss. Default 0.01.
    #[serde(default = "aux_default")]
    pub aux_loss_weight: f64,
}

fn capacity_default() -> f64 {
    1.25
}

fn aux_default() -> f64 {
    0.01
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// MNIST idx(.gz) files in `path` (train-* for training, t10k-* for evaluation).
    Mnist,
    /// A plain-text corpus at `path`, character-level; the first `train_fraction` trains.
    Text,
    /// Fixed random examples per rank (benchmarks: no data loading in the measurement).
    Synthetic,
}

/// `[data]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub kind: DataKind,
    /// Directory (mnist) or file (text). Relative paths are relative to the working directory.
    /// If it does not exist, text runs fall back to a small built-in corpus and say so loudly.
    pub path: Option<String>,
    /// Examples per rank per micro-step (the global batch is this x ranks x grad_accum).
    pub batch_size: usize,
    /// text: fraction of the corpus used for training (default 0.9, as nanoGPT).
    #[serde(default = "default_train_fraction")]
    pub train_fraction: f64,
    /// Drop the tail of each epoch that does not fill a global batch (default true).
    #[serde(default = "yes")]
    pub drop_last: bool,
    /// Reshuffle every epoch from the seed (default true).
    #[serde(default = "yes")]
    pub shuffle: bool,
    /// Batches prepared ahead by a background thread (default 2; 0 = load inline).
    #[serde(default = "default_prefetch")]
    pub prefetch: usize,
    /// synthetic: examples per rank (default: one batch).
    pub synthetic_examples: Option<usize>,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OptimKind {
    Sgd,
    Adam,
    #[default]
    Adamw,
    Adagrad,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    #[default]
    Constant,
    Cosine,
    Step,
}

/// `[optim]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// `sgd`, `adam`, `adamw` (default) or `adagrad`.
    pub kind: OptimKind,
    /// Base learning rate (default 1e-3).
    pub lr: f32,
    /// L2 (sgd, adam, adagrad) or decoupled (adamw) weight decay (default 0), for parameters
    /// of two or more dimensions and those of `groups` that do not set their own.
    pub weight_decay: f32,
    /// Decay parameters of fewer than two dimensions (biases, norm scales) too (default false:
    /// they are not decayed, as nanoGPT, Hugging Face's Trainer and Megatron leave them).
    pub decay_1d: bool,
    /// Parameter groups, as torch's `param_groups`: `groups = [{ match = ["embed"],
    /// weight_decay = 0.0, lr_scale = 0.5 }]`. A parameter belongs to the first group with a
    /// `match` string contained in its name; the others follow `weight_decay` and `decay_1d`.
    /// Under DDP and ZeRO (the library's `Trainer` and `kolo train`), scheduled DDP and tensor
    /// parallelism; other strategies refuse groups.
    pub groups: Vec<ParamGroupConfig>,
    /// sgd: momentum (default 0).
    pub momentum: f32,
    /// sgd: Nesterov momentum (default false).
    pub nesterov: bool,
    /// adam/adamw: (default 0.9, 0.999, 1e-8); adagrad uses `eps` too (default 1e-10 there).
    pub beta1: f32,
    pub beta2: f32,
    pub eps: Option<f32>,
    /// Clip gradients to this global L2 norm (default: no clipping).
    pub clip_grad_norm: Option<f64>,
    /// `constant` (default), `cosine` (to `min_lr`) or `step` (x `step_gamma` every `step_every`).
    pub schedule: ScheduleKind,
    /// Linear warm-up steps (default 0).
    pub warmup_steps: u64,
    pub min_lr: f32,
    pub step_every: u64,
    pub step_gamma: f32,
    /// Linear scaling rule: `lr` is tuned for this global batch and is scaled to the actual one.
    pub reference_batch: Option<usize>,
    /// Offload the optimizer state (and under ZeRO the master copy of this rank's parameter
    /// shard) to memory-mapped files in this directory, streamed through memory piece by
    /// piece during the update (ZeRO-Offload's NVMe tier). Default: kept in memory.
    pub offload_dir: Option<String>,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            kind: OptimKind::Adamw,
            lr: 1e-3,
            weight_decay: 0.0,
            decay_1d: false,
            groups: Vec::new(),
            momentum: 0.0,
            nesterov: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: None,
            clip_grad_norm: None,
            schedule: ScheduleKind::Constant,
            warmup_steps: 0,
            min_lr: 0.0,
            step_every: 1000,
            step_gamma: 0.1,
            reference_batch: None,
            offload_dir: None,
        }
    }
}

/// `"sgd".parse::<OptimKind>()` and the like: the names the config file uses.
macro_rules! from_str_as_in_the_file {
    ($($t:ty),*) => {$(
        impl std::str::FromStr for $t {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|e| format!("{s:?}: {e}"))
            }
        }
    )*};
}
from_str_as_in_the_file!(OptimKind, ScheduleKind, Precision);

/// What `ddp.dynamic_batch_every` runs with, for `kolo train` and the library alike.
pub const DYNAMIC_BATCH_LIMITS: &str = "ddp.dynamic_batch_every needs train.grad_accum = 1, real data (mnist or text), plain data parallelism (no [mesh], [pipeline], local SGD, skip_sync or parameter servers)";

/// What `ddp.deterministic` runs with, for `kolo train` and the library alike.
pub const DETERMINISTIC_LIMITS: &str = "ddp.deterministic runs DDP or ZeRO-1/2 on real data (mnist or text) on the CPU in f32 or bf16: no zero_stage 3, compression, local_sgd, skip_sync, dynamic_batch_every, schedule, f16, [mesh], [pipeline] or ps";

/// One entry of `[optim] groups`.
#[derive(Deserialize, Serialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ParamGroupConfig {
    /// Strings a parameter's name contains to belong to the group (at least one).
    #[serde(rename = "match")]
    pub patterns: Vec<String>,
    /// The group's weight decay (default `optim.weight_decay`, for vectors too).
    #[serde(default)]
    pub weight_decay: Option<f32>,
    /// A factor on the learning rate (default 1).
    #[serde(default = "unit_scale")]
    pub lr_scale: f32,
}

fn unit_scale() -> f32 {
    1.0
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// The dtype a model trained at this precision is built in (its masters stay f32).
    pub fn dtype(self) -> candle_core::DType {
        match self {
            Precision::F32 => candle_core::DType::F32,
            Precision::Bf16 => candle_core::DType::BF16,
            Precision::F16 => candle_core::DType::F16,
        }
    }
}

/// `[train]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps (default 100).
    pub steps: u64,
    /// Micro-steps per optimizer step; only the last communicates (default 1).
    pub grad_accum: u64,
    /// Seed of model initialisation and data order (default 0).
    pub seed: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    /// Batches per periodic evaluation, per rank (default 20; 0 = the whole evaluation set).
    /// The final evaluation covers the whole test set for image data and this many batches
    /// for text.
    pub eval_batches: usize,
    /// Print / log every this many steps (default 10).
    pub log_every: u64,
    /// Per-rank JSON-lines log file; `{rank}` is replaced by the rank.
    pub json_log: Option<String>,
    /// Directory for checkpoints (default: none written).
    pub checkpoint_dir: Option<String>,
    /// Write a checkpoint every this many steps (0: only at the end, when a directory is set).
    pub checkpoint_every: u64,
    /// Write checkpoints on a background thread while training continues (like torch's
    /// `async_save`): the step only copies this rank's pieces; the next checkpoint, and the end
    /// of the run, wait for the previous one. Default false.
    pub checkpoint_background: bool,
    /// Compute precision: `f32` (default), `bf16` or `f16` (mixed precision: f32 parameters,
    /// optimizer and loss; half-precision matmuls and activations; f16 adds dynamic loss
    /// scaling, skipping steps whose gradients overflow).
    pub precision: Precision,
    /// Serve Prometheus metrics at http://`metrics_addr`:(`metrics_port` + rank)/metrics
    /// (0: any free port, printed). Default: off.
    pub metrics_port: Option<u16>,
    /// Address the metrics endpoints bind (default 127.0.0.1).
    pub metrics_addr: String,
    /// Write TensorBoard event files (scalars: loss, lr, step time, throughput, gradient bytes,
    /// eval) under this directory, one run per rank (`rank0/`, `rank1/`, ...). Default: off.
    pub tensorboard_dir: Option<String>,
    /// Write a Chrome trace-event timeline (compute, each bucket's collective, update) per rank
    /// into this directory, merged by rank 0 into `trace.json` at the end. Default: off.
    pub timeline_dir: Option<String>,
    /// gpt: characters to generate at the end (default 200).
    pub sample_chars: usize,
    /// gpt: sampling temperature (default 0.8).
    pub sample_temperature: f32,
    /// Show a progress bar on rank 0 (default true; off when stderr is not a terminal).
    pub progress: bool,
    /// Where the model computes: `cpu` (default), `cuda` or `cuda:N` (candle's CUDA backend,
    /// a `--features cuda` build; with several ranks each takes GPU `local rank % GPUs` when
    /// `cuda` names none). Gradients reach DDP and the optimizers as flat host buffers. Plain
    /// DDP and ZeRO-1/2 only: no tp/sp/pp/ep, ZeRO-3, activation checkpointing or `ps` yet.
    pub device: String,
    /// `ddp` (default: all-reduce, ZeRO; see `[ddp]`) or `ps` (parameter servers; see `[ps]`,
    /// start with `kolo ps run`).
    pub strategy: Strategy,
    /// What a step whose gradients hold a NaN or an infinity does: `stop` (default: the run
    /// stops at the next log step whose loss, averaged over the ranks, is not finite) or
    /// `skip` (every rank skips the step, leaving the parameters and optimizer state alone,
    /// and training goes on; the skipped steps are counted, as f16's overflows are).
    pub on_nonfinite: OnNonFinite,
}

/// `[train] on_nonfinite`.
#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnNonFinite {
    #[default]
    Stop,
    Skip,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    #[default]
    Ddp,
    Ps,
}

/// `[ps]`: training through parameter servers (`[train] strategy = "ps"`). The servers apply
/// `[optim]`'s optimizer to the pushed gradients; the learning rate and its schedule travel
/// with each push.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct PsConfig {
    /// `bsp` (every worker's step t applied, as one mean, before anyone computes t+1: the same
    /// result as DDP), `bounded` (a worker may run `staleness` steps ahead of the slowest) or
    /// `async` (Downpour SGD: no waiting). Default `bsp`.
    pub consistency: PsConsistency,
    /// bounded: the largest lead over the slowest worker, in steps (default 4).
    pub staleness: u64,
    /// async: pull fresh parameters every this many steps (Downpour's n_fetch, default 1).
    pub fetch_every: u64,
    /// async: push the gradients accumulated over this many steps (Downpour's n_push, default 1).
    pub push_every: u64,
    /// Copies of each key range beyond the first (chain replication; default 0).
    pub replication: u32,
    /// Values per key range (default 65536).
    pub chunk: u32,
    /// Send only gradient entries whose accumulated value exceeds this (the significantly-modified
    /// filter; the rest wait in a residual). Default 0: off.
    pub filter_threshold: f32,
    /// The coordinator, `host:port` (default: `KOLO_PS_COORDINATOR`, set by `kolo ps run`).
    pub coordinator: Option<String>,
    /// Servers to wait for before starting (default 1).
    pub servers: u32,
    /// Deadline of every push and pull, seconds, retries and failover included (default 60).
    pub timeout_secs: f64,
    /// bsp: backup workers — each step is applied once all but this many workers pushed it
    /// (the mean of those gradients); stragglers' late gradients are dropped. Default 0.
    pub backup_workers: u32,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PsConsistency {
    Bsp,
    Bounded,
    Async,
}

impl Default for PsConfig {
    fn default() -> Self {
        PsConfig {
            consistency: PsConsistency::Bsp,
            staleness: 4,
            fetch_every: 1,
            push_every: 1,
            replication: 0,
            chunk: 65536,
            filter_threshold: 0.0,
            coordinator: None,
            servers: 1,
            timeout_secs: 60.0,
            backup_workers: 0,
        }
    }
}

#[cfg(feature = "ps")]
impl PsConfig {
    pub fn consistency(&self) -> kolo_ps::Consistency {
        match self.consistency {
            PsConsistency::Bsp => kolo_ps::Consistency::Bsp,
            PsConsistency::Bounded => kolo_ps::Consistency::Bounded(self.staleness),
            PsConsistency::Async => kolo_ps::Consistency::Async,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 100,
            grad_accum: 1,
            seed: 0,
            eval_every: 0,
            eval_batches: 20,
            log_every: 10,
            json_log: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            checkpoint_background: false,
            precision: Precision::F32,
            metrics_port: None,
            metrics_addr: "127.0.0.1".into(),
            tensorboard_dir: None,
            timeline_dir: None,
            sample_chars: 200,
            sample_temperature: 0.8,
            progress: true,
            device: "cpu".into(),
            strategy: Strategy::Ddp,
            on_nonfinite: OnNonFinite::Stop,
        }
    }
}

/// `[ddp]`
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields, default)]
pub struct DdpConfig {
    /// Gradient bucket size (default "25MiB", as torch).
    pub bucket_cap: String,
    /// Size of the first bucket, which backward fills first (default "1MiB", as torch).
    pub first_bucket_cap: String,
    /// Deadline of every collective, seconds (default 300).
    pub timeout_secs: f64,
    /// A collective stalled on a peer whose heartbeats through the store stopped this long
    /// (stopped process, dead host, cut network) fails at once naming it, before the deadline;
    /// a peer that is only slow keeps beating. 0 turns heartbeats off. Default 10.
    pub liveness_secs: f64,
    /// Compare a fingerprint of every collective across ranks (debug; default false).
    pub check_collectives: bool,
    /// Benchmarks only: never all-reduce gradients (each rank trains on its own), to measure
    /// the step time without communication (torch's `no_sync` on every step). Default false.
    pub skip_sync: bool,
    /// ZeRO stage (DeepSpeed's `zero_stage`): 0 = plain DDP; 1 = optimizer state sharded
    /// across ranks; 2 = gradients sharded too (reduce-scattered during backward); 3 =
    /// parameters sharded too (GPT: each block's variables filled by an all-gather when the
    /// model first reads them, the next block prefetched, at most two blocks whole at once,
    /// gathered again for backward, as torch's FSDP; activations are kept unless
    /// `model.checkpoint_blocks` recomputes them). Default 0.
    pub zero_stage: u8,
    /// Gradient compression, e.g. `{ method = "powersgd", rank = 4, warmup_steps = 10 }`
    /// (ZeRO-2/3, which reduce-scatter: fp16 and bf16, as torch FSDP's `reduce_dtype`; over each
    /// stage's replicas beside a pipeline: fp16, bf16 and PowerSGD; beside tensor
    /// parallelism: fp16 and bf16). Default: none.
    pub compression: Option<CompressionConfig>,
    /// Local SGD: after `warmup_steps` synchronous steps, every rank steps on its own
    /// gradients and the models are averaged every `every` steps (post-local SGD), e.g.
    /// `{ every = 8, warmup_steps = 100 }`. Plain DDP only. Default: off.
    pub local_sgd: Option<LocalSgdConfig>,
    /// Dynamic batch sizing: every this many steps the ranks compare their time per example
    /// and re-split the global batch (data.batch_size x ranks) in proportion to their speed,
    /// so that a slower rank gets fewer examples and all finish together; each rank's loss is
    /// weighted by its share, so the gradient stays the mean over the global batch. 0 = off.
    pub dynamic_batch_every: u64,
    /// Scheduled communication (ByteScheduler), e.g. `{ chunk = "256KiB", credit = "1MiB" }`:
    /// gradients go in chunks of `chunk` bytes, the first layers' first, up to `credit` bytes
    /// per collective; each parameter is updated as soon as its gradient is reduced and the
    /// next forward starts on it while the rest is still on the wire. Plain f32 DDP without
    /// gradient clipping, accumulation or checkpoints (the update cannot wait for a global
    /// norm). Default: off.
    pub schedule: Option<ScheduleConfig>,
    /// Deterministic reduction: DDP and ZeRO-1/2 give bitwise the same parameters at every
    /// world size for the same global batch (data.batch_size x ranks). Each rank's batch is cut
    /// into pieces of `deterministic_chunk` examples, contiguous in the global batch; every
    /// piece's gradient is rounded to fixed point and the pieces are summed as integers
    /// (associative), so neither the world size nor the reduction order changes a bit. Costs a
    /// backward pass per piece and 4x the bytes of an f32 all-reduce, without overlap (see
    /// docs/benchmarks.md). Real data, f32 or bf16, CPU, no mesh, pipeline, compression, local
    /// SGD, scheduling or dynamic batches. Default false.
    pub deterministic: bool,
    /// Examples per piece under `deterministic` (default 1). Runs are bitwise alike across
    /// world sizes whose per-rank batch is a multiple of it; larger pieces are faster.
    pub deterministic_chunk: usize,
}

#[derive(Deserialize, Serialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Partition size (default "256KiB").
    #[serde(default = "default_chunk")]
    pub chunk: String,
    /// Bytes reduced per round and collective (default "1MiB"): larger rounds spend fewer
    /// agreements and calls, smaller ones let a high-priority chunk go sooner.
    #[serde(default = "default_credit")]
    pub credit: String,
}

fn default_chunk() -> String {
    "256KiB".into()
}

fn default_credit() -> String {
    "1MiB".into()
}

#[derive(Deserialize, Serialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LocalSgdConfig {
    pub every: u64,
    #[serde(default)]
    pub warmup_steps: u64,
}

#[derive(Deserialize, Serialize, Debug, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CompressionConfig {
    /// `powersgd` (matrices as rank-`rank` factors), `fp16`/`bf16` (2-byte all-reduce), `topk`
    /// / `randk` (a `fraction` of the values), `qsgd` (`levels` levels, unbiased), `sign`
    /// (1 bit per value and a scale). topk, randk, sign and powersgd carry error feedback.
    pub method: CompressionMethod,
    /// PowerSGD rank (default 1).
    #[serde(default = "one")]
    pub rank: usize,
    /// topk / randk: fraction of values sent (default 0.01).
    #[serde(default = "one_percent")]
    pub fraction: f64,
    /// qsgd: quantization levels, 1..=127 (default 16).
    #[serde(default = "sixteen")]
    pub levels: u8,
    /// Uncompressed steps first (torch's `start_powerSGD_iter`, default 10).
    #[serde(default = "ten")]
    pub warmup_steps: u64,
    /// topk: `exact` selection (default) or a `sampled` threshold (Deep Gradient Compression).
    #[serde(default)]
    pub threshold: TopkThreshold,
    /// topk: `allgather` every rank's pairs (default) or `sparse`: a sparse all-reduce
    /// (recursive doubling that merges pairs, SparCML).
    #[serde(default)]
    pub exchange: TopkExchange,
}

impl CompressionConfig {
    /// `method` with the file's defaults for the rest (rank 1, fraction 0.01, 16 levels, 10
    /// uncompressed steps first, exact top-k gathered): change a field with `..` syntax.
    pub fn new(method: CompressionMethod) -> CompressionConfig {
        CompressionConfig {
            method,
            rank: one(),
            fraction: one_percent(),
            levels: sixteen(),
            warmup_steps: ten(),
            threshold: TopkThreshold::default(),
            exchange: TopkExchange::default(),
        }
    }
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum TopkThreshold {
    #[default]
    Exact,
    Sampled,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum TopkExchange {
    #[default]
    Allgather,
    Sparse,
}

#[derive(Deserialize, Serialize, Debug, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CompressionMethod {
    Powersgd,
    Fp16,
    Bf16,
    Topk,
    Randk,
    Qsgd,
    Sign,
}

fn one() -> usize {
    1
}
fn ten() -> u64 {
    10
}
fn one_percent() -> f64 {
    0.01
}
fn sixteen() -> u8 {
    16
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap: "25MiB".into(),
            first_bucket_cap: "1MiB".into(),
            timeout_secs: 300.0,
            liveness_secs: 10.0,
            check_collectives: false,
            skip_sync: false,
            zero_stage: 0,
            compression: None,
            local_sgd: None,
            dynamic_batch_every: 0,
            schedule: None,
            deterministic: false,
            deterministic_chunk: 1,
        }
    }
}

fn yes() -> bool {
    true
}
fn default_train_fraction() -> f64 {
    0.9
}
fn default_prefetch() -> usize {
    2
}

impl Config {
    pub fn parse(text: &str, origin: &str) -> Result<Config, TrainError> {
        let c: Config = toml::from_str(text).map_err(|e| TrainError::Config(format!("{origin}: {e}")))?;
        c.validate().map_err(|e| TrainError::Config(format!("{origin}: {e}")))?;
        Ok(c)
    }

    pub fn load(path: &std::path::Path) -> Result<Config, TrainError> {
        let text = std::fs::read_to_string(path).map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Checks the whole config again (after a program changed it).
    pub fn check(&self) -> Result<(), TrainError> {
        self.validate().map_err(TrainError::Config)
    }

    fn validate(&self) -> Result<(), String> {
        self.validate_model_and_data()?;
        self.validate_numbers()?;
        self.validate_device_and_ddp()?;
        self.validate_ddp_modes()?;
        self.validate_experts_and_mesh()?;
        self.validate_pipeline_and_ps()?;
        self.validate_loops()?;
        Ok(())
    }

    /// The model's fields against its kind, the data, steps and shapes.
    fn validate_model_and_data(&self) -> Result<(), String> {
        let m = &self.model;
        let not_for =
            |field: &str, set: bool, kinds: &str| if set { Err(format!("model.{field} applies to kind = {kinds} only")) } else { Ok(()) };
        not_for("hidden", m.hidden.is_some() && m.kind != ModelKind::Mlp, "\"mlp\"")?;
        not_for("channels", m.channels.is_some() && m.kind != ModelKind::Cnn, "\"cnn\"")?;
        let gpt_fields = m.seq.is_some() || m.d_model.is_some() || m.n_head.is_some() || m.n_layer.is_some();
        not_for("seq/d_model/n_head/n_layer", gpt_fields && m.kind != ModelKind::Gpt, "\"gpt\"")?;
        not_for("checkpoint_blocks", !m.checkpoint_blocks.is_empty() && m.kind != ModelKind::Gpt, "\"gpt\"")?;
        match (m.kind, self.data.kind) {
            (ModelKind::Gpt, DataKind::Mnist) => return Err("a gpt model needs data.kind = \"text\" or \"synthetic\"".into()),
            (ModelKind::Mlp | ModelKind::Cnn, DataKind::Text) => {
                return Err("mlp and cnn models need data.kind = \"mnist\" or \"synthetic\"".into())
            }
            _ => {}
        }
        if self.data.kind != DataKind::Synthetic && self.data.path.is_none() {
            return Err("data.path is required for mnist and text data".into());
        }
        if self.data.batch_size == 0 {
            return Err("data.batch_size must be at least 1".into());
        }
        if !(self.data.train_fraction > 0.0 && self.data.train_fraction < 1.0) {
            return Err("data.train_fraction must be between 0 and 1".into());
        }
        if self.train.grad_accum == 0 || self.train.steps == 0 {
            return Err("train.steps and train.grad_accum must be at least 1".into());
        }
        if let Some(h) = &m.hidden {
            if h.contains(&0) {
                return Err("model.hidden widths must be positive".into());
            }
        }
        for (name, v) in [("model.seq", m.seq), ("model.d_model", m.d_model), ("model.n_head", m.n_head), ("model.n_layer", m.n_layer)] {
            if v == Some(0) {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if let (Some(d), Some(h)) = (m.d_model, m.n_head) {
            if h == 0 || d % h != 0 {
                return Err(format!("model.d_model {d} must be divisible by model.n_head {h}"));
            }
        }
        Ok(())
    }

    /// Numbers in range: the learning rate and the optimizer's, the deadline, the sampling temperature.
    fn validate_numbers(&self) -> Result<(), String> {
        if !(self.optim.lr > 0.0 && self.optim.lr.is_finite()) {
            return Err("optim.lr must be a positive number".into());
        }
        // Numbers that would silently train wrongly (a negative clip norm ascends, beta2 = 1
        // never updates the second moment, an infinite deadline never fires): issue #19.
        let o = &self.optim;
        let finite_at_least = |v: f64, min: f64| v.is_finite() && v >= min;
        for (name, ok) in [
            ("optim.weight_decay", finite_at_least(f64::from(o.weight_decay), 0.0)),
            ("optim.momentum", finite_at_least(f64::from(o.momentum), 0.0) && o.momentum < 1.0),
            ("optim.beta1", finite_at_least(f64::from(o.beta1), 0.0) && o.beta1 < 1.0),
            ("optim.beta2", finite_at_least(f64::from(o.beta2), 0.0) && o.beta2 < 1.0),
            ("optim.eps", o.eps.is_none_or(|e| e.is_finite() && e > 0.0)),
            ("optim.clip_grad_norm", o.clip_grad_norm.is_none_or(|c| c.is_finite() && c > 0.0)),
            ("optim.min_lr", finite_at_least(f64::from(o.min_lr), 0.0) && o.min_lr <= o.lr),
            ("optim.step_gamma", o.step_gamma.is_finite() && o.step_gamma > 0.0),
            ("ddp.timeout_secs", self.ddp.timeout_secs.is_finite() && self.ddp.timeout_secs > 0.0 && self.ddp.timeout_secs <= 1e6),
            ("ddp.liveness_secs", finite_at_least(self.ddp.liveness_secs, 0.0) && self.ddp.liveness_secs <= 1e6),
            ("train.sample_temperature", self.train.sample_temperature.is_finite() && self.train.sample_temperature > 0.0),
        ] {
            if !ok {
                return Err(format!(
                    "{name} is out of range (weight_decay >= 0; momentum, beta1, beta2 in [0, 1); eps, clip_grad_norm, step_gamma, sample_temperature > 0; 0 <= min_lr <= lr; 0 < timeout_secs <= 1e6, 0 <= liveness_secs <= 1e6, all finite)"
                ));
            }
        }
        Ok(())
    }

    /// The device, DDP's buckets and compression, local SGD, and federated settings.
    fn validate_device_and_ddp(&self) -> Result<(), String> {
        if self.train.device != "cpu" {
            let mesh = self.mesh.as_ref();
            if mesh.is_some_and(|m| m.tp > 1 || m.sp > 1 || m.ep > 1 || m.pp.is_some_and(|p| p > 1))
                || self.pipeline.is_some()
                || self.ddp.zero_stage == 3
                || !self.model.checkpoint_blocks.is_empty()
                || self.train.strategy != Strategy::Ddp
            {
                return Err(gpu_refusal(&self.train.device));
            }
        }
        self.bucket_cap()?;
        self.first_bucket_cap()?;
        self.compression()?;
        if let Some(l) = &self.ddp.local_sgd {
            if l.every == 0 || self.ddp.zero_stage != 0 || self.ddp.compression.is_some() {
                return Err("ddp.local_sgd needs every >= 1, ddp.zero_stage = 0 and no ddp.compression".into());
            }
        }
        if (self.ddp.local_sgd.is_some() || self.ddp.skip_sync) && self.train.precision == Precision::F16 {
            return Err(
                "train.precision = \"f16\" (loss scaling) does not combine with ddp.local_sgd or ddp.skip_sync yet; use bf16".into()
            );
        }
        if let Some(f) = &self.fed {
            if self.data.kind != DataKind::Mnist || self.model.kind == ModelKind::Gpt {
                return Err("[fed] trains the MNIST models (data.kind = \"mnist\", model mlp or cnn)".into());
            }
            if f.rounds == 0
                || f.clients == 0
                || f.local_epochs == 0
                || f.labels_per_client == 0
                || f.clients_per_round == Some(0)
                || f.round_deadline_secs.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
            {
                return Err("fed: rounds, clients, local_epochs, labels_per_client and clients_per_round must be at least 1, round_deadline_secs positive".into());
            }
            if f.secure && f.clients_per_round.unwrap_or(f.clients) < 2 {
                return Err("fed.secure needs at least 2 clients per round".into());
            }
        }
        Ok(())
    }

    /// What scheduled communication, deterministic mode and dynamic batch sizing run with.
    fn validate_ddp_modes(&self) -> Result<(), String> {
        if self.ddp.schedule.is_some() {
            self.comm_schedule()?;
            let m = self.mesh.as_ref();
            if self.ddp.zero_stage != 0
                || self.ddp.compression.is_some()
                || self.ddp.local_sgd.is_some()
                || self.ddp.skip_sync
                || self.ddp.dynamic_batch_every > 0
                || self.optim.clip_grad_norm.is_some()
                || self.train.grad_accum != 1
                || self.train.precision != Precision::F32
                || self.train.strategy != Strategy::Ddp
                || self.pipeline.is_some()
                || !self.model.checkpoint_blocks.is_empty()
                || m.is_some_and(|m| m.tp > 1 || m.sp > 1 || m.ep > 1 || m.pp.is_some_and(|p| p > 1))
                || self.train.device != "cpu"
            {
                return Err("ddp.schedule runs plain f32 DDP on the CPU: no zero_stage, compression, local_sgd, skip_sync, dynamic_batch_every, optim.clip_grad_norm, grad_accum > 1, mixed precision, mesh, pipeline, activation checkpointing or ps (each parameter is updated as soon as its own gradient is reduced)".into());
            }
        }
        if self.ddp.deterministic {
            let m = self.mesh.as_ref();
            if self.ddp.zero_stage > 2
                || self.ddp.compression.is_some()
                || self.ddp.local_sgd.is_some()
                || self.ddp.skip_sync
                || self.ddp.dynamic_batch_every > 0
                || self.ddp.schedule.is_some()
                || self.data.kind == DataKind::Synthetic
                || self.train.precision == Precision::F16
                || self.train.strategy != Strategy::Ddp
                || self.pipeline.is_some()
                || m.is_some_and(|m| m.tp > 1 || m.sp > 1 || m.ep > 1 || m.pp.is_some_and(|p| p > 1))
                || self.train.device != "cpu"
            {
                return Err(DETERMINISTIC_LIMITS.into());
            }
            if self.ddp.deterministic_chunk == 0 || !self.data.batch_size.is_multiple_of(self.ddp.deterministic_chunk) {
                return Err(format!(
                    "ddp.deterministic_chunk = {} must divide data.batch_size = {} (each rank's batch is cut into whole pieces)",
                    self.ddp.deterministic_chunk, self.data.batch_size
                ));
            }
        }
        if self.ddp.dynamic_batch_every > 0
            && (self.train.grad_accum != 1
                || self.ddp.skip_sync
                || self.ddp.local_sgd.is_some()
                || self.data.kind == DataKind::Synthetic
                || self.mesh.is_some()
                || self.pipeline.is_some()
                || self.train.strategy != Strategy::Ddp)
        {
            return Err(DYNAMIC_BATCH_LIMITS.into());
        }
        Ok(())
    }

    /// Mixture of experts and the mesh (expert, sequence, pipeline and tensor parallelism).
    fn validate_experts_and_mesh(&self) -> Result<(), String> {
        if let Some(x) = self.model.experts {
            let md = &self.model;
            if md.kind != ModelKind::Gpt {
                return Err("model.experts (mixture of experts) replaces the GPT's MLPs; model.kind must be \"gpt\"".into());
            }
            kolo_tensor::models::MoeConfig {
                experts: x,
                top_k: md.top_k,
                renormalize: md.top_k > 1,
                capacity_factor: md.capacity_factor,
                aux_weight: md.aux_loss_weight,
                scoring: Default::default(),
                groups: None,
            }
            .check()
            .map_err(|e| format!("model: {e}"))?;
            let m = self.mesh.clone().unwrap_or(MeshConfig { tp: 1, pp: None, dp: None, sp: 1, ep: 1 });
            if m.tp > 1
                || m.sp > 1
                || m.pp.is_some_and(|p| p > 1)
                || self.pipeline.is_some()
                || self.ddp.zero_stage == 3
                || self.train.strategy != Strategy::Ddp
            {
                return Err("model.experts trains with data and expert parallelism (mesh.dp, mesh.ep), without tp, sp, pipelines, ZeRO-3 or parameter servers (yet)".into());
            }
            if !x.is_multiple_of(m.ep) {
                return Err(format!("model.experts ({x}) must be a multiple of mesh.ep ({})", m.ep));
            }
        }
        if let Some(m) = &self.mesh {
            if m.tp == 0 || m.sp == 0 || m.ep == 0 || m.pp == Some(0) || m.dp == Some(0) {
                return Err("mesh.dp, mesh.tp, mesh.pp, mesh.sp and mesh.ep must be at least 1".into());
            }
            if m.ep > 1 {
                if self.model.experts.is_none() {
                    return Err("mesh.ep > 1 deals the experts of a mixture-of-experts GPT over ranks: set model.experts".into());
                }
                if self.ddp.compression.is_some() {
                    return Err(
                        "mesh.ep > 1 runs without compression (yet; ZeRO-1/2, grad_accum, local SGD and parameter groups work)".into()
                    );
                }
            }
            if m.sp > 1 {
                if self.model.kind != ModelKind::Gpt || m.tp > 1 || self.pipeline.is_some() {
                    return Err("mesh.sp splits the GPT's sequences (model.kind = \"gpt\", without tp or [pipeline] for now)".into());
                }
                if self.ddp.compression.is_some() || self.train.strategy != Strategy::Ddp {
                    return Err("mesh.sp > 1 runs without compression or parameter servers (yet; ZeRO-1/2/3, grad_accum, local SGD, activation checkpointing and bf16/f16 work)".into());
                }
            }
            if m.tp > 1 {
                self.codecs_beside("mesh.tp compresses each piece's gradients", false)?;
            }
            if m.pp.is_some_and(|p| p > 1) && self.pipeline.is_none() {
                return Err("mesh.pp > 1 needs a [pipeline] section (micro_batches, schedule)".into());
            }
            if m.tp > 1 {
                if self.model.kind != ModelKind::Gpt {
                    return Err("mesh.tp splits the GPT's blocks (model.kind = \"gpt\")".into());
                }
                // ZeRO-1/2/3 shard over the data-parallel group (ZeRO-3: each rank's pieces of
                // the blocks, torchtitan's FSDP + TP); bf16/f16 cast where used (Megatron's
                // mixed precision).
                if self.train.strategy != Strategy::Ddp {
                    return Err("mesh.tp > 1 runs without parameter servers".into());
                }
            }
        }
        Ok(())
    }

    /// Model parallelism compresses its gradients with the codecs whose result does not depend
    /// on how the model is cut: the casts, and beside pipelines PowerSGD (each matrix is
    /// compressed on its own, from a seed of its name, whichever stage holds it). The others
    /// select or scale over a whole bucket, whose contents the cut changes, and have no
    /// reference to test against; PowerSGD of a tensor-parallel piece is not the whole matrix's.
    fn codecs_beside(&self, who: &str, powersgd: bool) -> Result<(), String> {
        let fits = |m: &CompressionMethod| {
            matches!(m, CompressionMethod::Fp16 | CompressionMethod::Bf16) || (powersgd && *m == CompressionMethod::Powersgd)
        };
        match self.ddp.compression.as_ref().filter(|c| !fits(&c.method)) {
            Some(c) => Err(format!("{who} with fp16 or bf16{} only (yet), not {:?}", if powersgd { " or PowerSGD" } else { "" }, c.method)),
            None => Ok(()),
        }
    }

    /// Pipelines and parameter servers.
    fn validate_pipeline_and_ps(&self) -> Result<(), String> {
        if let Some(p) = &self.pipeline {
            if self.model.kind != ModelKind::Gpt {
                return Err("[pipeline] cuts the GPT's layers into stages; model.kind must be \"gpt\"".into());
            }
            if p.micro_batches == 0 || !self.data.batch_size.is_multiple_of(p.micro_batches) {
                return Err(format!("pipeline.micro_batches ({}) must divide data.batch_size ({})", p.micro_batches, self.data.batch_size));
            }
            if p.schedule == PipeSchedule::TwoBw && self.ddp.zero_stage == 3 {
                return Err("PipeDream-2BW keeps two versions of each stage's weights: ZeRO-3 empties them between uses (ddp.zero_stage 1 or 2; GPipe and 1F1B take 3)".into());
            }
            if p.schedule == PipeSchedule::TwoBw && self.ddp.local_sgd.is_some() {
                return Err("PipeDream-2BW averages every step: no ddp.local_sgd (GPipe and 1F1B take it)".into());
            }
            if p.schedule == PipeSchedule::TwoBw && self.train.precision == Precision::F16 {
                return Err("PipeDream-2BW never flushes, so it cannot skip an f16 step that overflowed: train.precision = \"bf16\" (GPipe and 1F1B take f16)".into());
            }
            self.codecs_beside("[pipeline] compresses each stage's gradients", true)?;
            if p.schedule == PipeSchedule::TwoBw && self.train.grad_accum != 1 {
                return Err("PipeDream-2BW streams one batch per step: train.grad_accum = 1 (raise pipeline.micro_batches; GPipe and 1F1B accumulate)".into());
            }
            if self.train.strategy != Strategy::Ddp {
                return Err("[pipeline] runs without parameter servers".into());
            }
        }
        if self.train.strategy == Strategy::Ps {
            let p = &self.ps;
            if p.fetch_every == 0
                || p.push_every == 0
                || p.chunk == 0
                || p.servers == 0
                || p.timeout_secs.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater)
                || p.filter_threshold.is_nan()
                || p.filter_threshold < 0.0
            {
                return Err("ps: fetch_every, push_every, chunk and servers must be at least 1, timeout_secs positive, filter_threshold not negative".into());
            }
            if p.backup_workers > 0 && p.consistency != PsConsistency::Bsp {
                return Err("ps.backup_workers needs ps.consistency = \"bsp\"".into());
            }
            if (p.fetch_every != 1 || p.push_every != 1) && p.consistency != PsConsistency::Async {
                return Err("ps.fetch_every / ps.push_every (Downpour) need ps.consistency = \"async\"".into());
            }
            if self.ddp.zero_stage != 0
                || self.ddp.compression.is_some()
                || self.ddp.local_sgd.is_some()
                || self.train.precision != Precision::F32
                || self.optim.offload_dir.is_some()
            {
                return Err("train.strategy = \"ps\" trains in f32 without [ddp] options (zero_stage, compression, local_sgd) and keeps its state, the optimizer's included, on the servers (no optim.offload_dir)".into());
            }
        }
        Ok(())
    }

    /// What the loops not on the driver lack (refused, never ignored), and skip_sync under ZeRO.
    fn validate_loops(&self) -> Result<(), String> {
        for (i, g) in self.optim.groups.iter().enumerate() {
            let bad_wd = g.weight_decay.is_some_and(|w| !(w.is_finite() && w >= 0.0));
            if g.patterns.is_empty() || g.patterns.iter().any(String::is_empty) || bad_wd || !(g.lr_scale.is_finite() && g.lr_scale >= 0.0)
            {
                return Err(format!(
                    "optim.groups[{i}]: match needs at least one non-empty string; weight_decay and lr_scale are finite and >= 0"
                ));
            }
        }
        let m = self.mesh.clone().unwrap_or(MeshConfig { tp: 1, pp: None, dp: None, sp: 1, ep: 1 });
        let grouped = self.train.strategy == Strategy::Ddp && self.fed.is_none();
        if !grouped && self.optim.non_uniform() {
            return Err("optim.groups, and optim.weight_decay without decay_1d = true, need DDP, ZeRO, scheduled DDP, tensor, sequence or expert parallelism or pipelines: parameter servers and federated averaging apply one weight decay to every parameter (set optim.decay_1d = true for that)".into());
        }
        let plain = grouped
            && m.sp == 1
            && m.ep == 1
            && self.pipeline.is_none()
            && self.ddp.schedule.is_none()
            && !self.ddp.deterministic
            && self.ddp.local_sgd.is_none()
            && !self.ddp.skip_sync;
        if self.train.on_nonfinite == OnNonFinite::Skip && !plain {
            return Err("train.on_nonfinite = \"skip\" needs the data-parallel loop (DDP, ZeRO, tensor parallelism): deterministic mode, local SGD, skip_sync, scheduled DDP, pipelines, sequence and expert parallelism, parameter servers and federated averaging stop on a non-finite loss".into());
        }
        if self.sharding()? != kolo_ddp::Sharding::None && self.ddp.skip_sync {
            return Err("ddp.skip_sync (a benchmark mode without gradient exchange) needs ddp.zero_stage = 0".into());
        }
        Ok(())
    }

    pub fn bucket_cap(&self) -> Result<ByteSize, String> {
        self.ddp.bucket_cap()
    }

    pub fn first_bucket_cap(&self) -> Result<ByteSize, String> {
        self.ddp.first_bucket_cap()
    }

    /// The gradient codec and its warm-up steps.
    pub fn compression(&self) -> Result<(kolo_ddp::Compression, u64), String> {
        self.ddp.compression()
    }

    pub fn sharding(&self) -> Result<kolo_ddp::Sharding, String> {
        let s = self.ddp.zero_stage;
        let sharding = kolo_ddp::Sharding::from_stage(s).ok_or_else(|| format!("ddp.zero_stage must be 0, 1, 2 or 3, not {s}"))?;
        if sharding == kolo_ddp::Sharding::Parameters && self.model.kind != ModelKind::Gpt {
            return Err("ddp.zero_stage = 3 shards the GPT's blocks; use 0, 1 or 2 for mlp and cnn".into());
        }
        Ok(sharding)
    }

    /// The (dp, tp, pp) mesh for `world` ranks.
    pub fn mesh_for(&self, world: usize) -> Result<Mesh, String> {
        let m = self.mesh.clone().unwrap_or(MeshConfig { tp: 1, pp: None, dp: None, sp: 1, ep: 1 });
        let (tp, sp) = (m.tp, m.sp);
        let pp = match (m.pp, &self.pipeline, m.dp) {
            (Some(p), _, _) => p,
            (None, Some(_), Some(dp)) => world / (dp * tp).max(1),
            (None, Some(_), None) => world / tp.max(1),
            (None, None, _) => 1,
        };
        let dp = m.dp.unwrap_or(world / (tp * pp * sp).max(1));
        if dp * tp * pp * sp != world || dp == 0 || pp == 0 {
            return Err(format!("mesh dp {dp} x tp {tp} x pp {pp} x sp {sp} does not make {world} ranks"));
        }
        if m.ep == 0 || !dp.is_multiple_of(m.ep) {
            return Err(format!("mesh.ep {} does not divide the {dp} data-parallel ranks", m.ep));
        }
        Ok(Mesh { dp, tp, pp, sp, ep: m.ep })
    }

    /// `ddp.schedule` as (chunk, credit) in f32 elements, when set.
    pub fn comm_schedule(&self) -> Result<Option<(usize, usize)>, String> {
        let Some(s) = &self.ddp.schedule else { return Ok(None) };
        let chunk = s.chunk.parse::<ByteSize>().map_err(|e| format!("ddp.schedule.chunk: {e}"))?.as_usize() / 4;
        let credit = s.credit.parse::<ByteSize>().map_err(|e| format!("ddp.schedule.credit: {e}"))?.as_usize() / 4;
        if chunk == 0 || credit == 0 {
            return Err("ddp.schedule: chunk and credit must be at least 4 bytes".into());
        }
        Ok(Some((chunk, credit)))
    }

    /// The model to build; `vocab` comes from the data for text models.
    pub fn model_spec(&self, vocab: usize) -> ModelSpec {
        let m = &self.model;
        match m.kind {
            ModelKind::Mlp => ModelSpec::Mlp { input: 784, hidden: m.hidden.clone().unwrap_or(vec![512, 512]), classes: 10 },
            ModelKind::Cnn => {
                let c = m.channels.unwrap_or([16, 32]);
                ModelSpec::Cnn { channels: (c[0], c[1]), classes: 10 }
            }
            ModelKind::Gpt => ModelSpec::Gpt(GptConfig {
                vocab,
                seq: m.seq.unwrap_or(128),
                d_model: m.d_model.unwrap_or(256),
                n_head: m.n_head.unwrap_or(4),
                n_layer: m.n_layer.unwrap_or(4),
                moe: m.experts.map(|experts| kolo_tensor::models::MoeConfig {
                    experts,
                    top_k: m.top_k,
                    renormalize: m.top_k > 1,
                    capacity_factor: m.capacity_factor,
                    aux_weight: m.aux_loss_weight,
                    scoring: Default::default(),
                    groups: None,
                }),
            }),
        }
    }

    /// Bytes one rank's micro-batch of `data.batch_size` examples certainly needs: its input,
    /// the activations backward keeps and the logits (a lower bound; the model, its
    /// gradients and the optimizer's state come on top).
    pub fn batch_memory_floor(&self, vocab: usize) -> u64 {
        let per_example = match self.model_spec(vocab) {
            ModelSpec::Mlp { input, hidden, classes } => input + hidden.iter().sum::<usize>() + classes,
            ModelSpec::Cnn { classes, .. } => 784 + classes,
            ModelSpec::Gpt(g) => g.seq * (g.d_model * (g.n_layer + 1) + g.vocab),
        };
        (self.data.batch_size as u64).saturating_mul(per_example as u64).saturating_mul(4)
    }

    /// Refuses a batch whose [`Config::batch_memory_floor`] exceeds the memory this machine has
    /// available (`available`, bytes), before anything that size is allocated: an allocation
    /// that fails aborts the process.
    pub fn check_batch_memory(&self, vocab: usize, available: Option<u64>) -> Result<(), String> {
        let (need, Some(have)) = (self.batch_memory_floor(vocab), available) else { return Ok(()) };
        if need <= have {
            return Ok(());
        }
        let gb = |b: u64| b as f64 / 1e9;
        Err(format!(
            "data.batch_size = {}: one micro-batch needs at least {:.1} GB (its input, activations and logits) but this machine has {:.1} GB available: lower data.batch_size (train.grad_accum keeps the examples per step)",
            self.data.batch_size,
            gb(need),
            gb(have)
        ))
    }

    pub fn optimizer(&self) -> OptimizerSpec {
        self.optim.spec()
    }

    /// Tokens in one example, for throughput: the GPT's window, 1 for the image and tabular
    /// models.
    pub fn tokens_per_example(&self) -> usize {
        match self.model.kind {
            ModelKind::Gpt => self.model.seq.unwrap_or(128),
            _ => 1,
        }
    }

    /// The dtype the model computes in.
    pub fn compute_dtype(&self) -> kolo_tensor::CandleDType {
        match self.train.precision {
            Precision::F32 => kolo_tensor::CandleDType::F32,
            Precision::Bf16 => kolo_tensor::CandleDType::BF16,
            Precision::F16 => kolo_tensor::CandleDType::F16,
        }
    }

    /// Where optimizer state goes.
    pub fn placement(&self) -> kolo_optim::Placement {
        self.optim.placement()
    }

    pub fn schedule(&self) -> Schedule {
        self.optim.schedule()
    }
}

impl OptimConfig {
    /// Where the optimizer's state (and ZeRO's master shard) lives: memory, or files under
    /// `offload_dir`.
    pub fn placement(&self) -> kolo_optim::Placement {
        match &self.offload_dir {
            Some(d) => kolo_optim::Placement::Disk(d.into()),
            None => kolo_optim::Placement::Memory,
        }
    }

    /// Whether some parameter gets other hyperparameters than the spec's (strategies without
    /// parameter groups refuse such settings).
    pub fn non_uniform(&self) -> bool {
        !self.groups.is_empty() || (self.weight_decay != 0.0 && !self.decay_1d)
    }

    /// The base learning rate for a global batch of `global_batch` examples per optimizer step:
    /// `lr`, scaled by the linear scaling rule when `reference_batch` is set (the CLI's loops
    /// and the library's `Trainer` alike).
    pub fn base_lr(&self, global_batch: usize) -> f32 {
        self.reference_batch.map_or(self.lr, |r| kolo_optim::scaled_lr(self.lr, global_batch, r))
    }

    /// The learning rate of optimizer step `step` (0-based) of a run of `total` steps whose
    /// global batch is `global_batch` examples: the base rate ([`OptimConfig::base_lr`]),
    /// warmed up over `warmup_steps`, then the schedule. Every loop's learning rate.
    pub fn lr_of_step(&self, global_batch: usize, total: u64, step: u64) -> f32 {
        kolo_optim::lr_at(self.base_lr(global_batch), &self.schedule(), self.warmup_steps, total, step)
    }

    /// The learning-rate schedule after warm-up.
    pub fn schedule(&self) -> Schedule {
        match self.schedule {
            ScheduleKind::Constant => Schedule::Constant,
            ScheduleKind::Cosine => Schedule::Cosine { min_lr: self.min_lr },
            ScheduleKind::Step => Schedule::Step { every: self.step_every, gamma: self.step_gamma },
        }
    }

    /// The optimizer these settings describe.
    pub fn spec(&self) -> OptimizerSpec {
        let o = self;
        match o.kind {
            OptimKind::Sgd => OptimizerSpec::Sgd { momentum: o.momentum, nesterov: o.nesterov, weight_decay: o.weight_decay },
            OptimKind::Adam | OptimKind::Adamw => OptimizerSpec::Adam {
                beta1: o.beta1,
                beta2: o.beta2,
                eps: o.eps.unwrap_or(1e-8),
                weight_decay: o.weight_decay,
                decoupled: o.kind == OptimKind::Adamw,
            },
            OptimKind::Adagrad => OptimizerSpec::Adagrad { eps: o.eps.unwrap_or(1e-10), weight_decay: o.weight_decay, lr_decay: 0.0 },
        }
    }
}

/// Why a GPU run of a model-parallel, ZeRO-3 or parameter-server job is refused (`kolo train`
/// and the library say the same).
pub fn gpu_refusal(device: &str) -> String {
    format!(
        "train.device = \"{device}\" supports plain DDP and ZeRO-1/2 only (no mesh tp/sp/pp/ep, [pipeline], zero_stage 3, checkpoint_blocks or strategy ps yet)"
    )
}

/// Examples per optimizer step over the job: `per_replica` examples per micro-batch on each
/// of `replicas` data-parallel replicas, `grad_accum` micro-batches a step.
pub fn global_batch(per_replica: usize, replicas: usize, grad_accum: u64) -> usize {
    per_replica * replicas * grad_accum.max(1) as usize
}

impl DdpConfig {
    /// The deadline of every collective (`timeout_secs`, at least a millisecond).
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_secs.max(0.001))
    }

    pub fn bucket_cap(&self) -> Result<ByteSize, String> {
        positive_size("ddp.bucket_cap", &self.bucket_cap)
    }

    pub fn first_bucket_cap(&self) -> Result<ByteSize, String> {
        positive_size("ddp.first_bucket_cap", &self.first_bucket_cap)
    }

    /// The gradient codec and its warm-up steps.
    pub fn compression(&self) -> Result<(kolo_ddp::Compression, u64), String> {
        use kolo_ddp::Compression as C;
        let Some(c) = &self.compression else { return Ok((C::None, 0)) };
        if self.zero_stage >= 2 && !matches!(c.method, CompressionMethod::Fp16 | CompressionMethod::Bf16) {
            return Err(format!(
                "ddp.zero_stage = {} reduce-scatters the gradients: ddp.compression with fp16 or bf16 there (torch FSDP's reduce_dtype), not {:?}; ZeRO-1 takes every codec",
                self.zero_stage, c.method
            ));
        }
        if !(c.fraction > 0.0 && c.fraction <= 1.0) || c.rank == 0 || !(1..=127).contains(&c.levels) {
            return Err("ddp.compression: fraction must be in (0, 1], rank at least 1, levels 1..=127".into());
        }
        let m = match c.method {
            CompressionMethod::Powersgd => C::PowerSgd { rank: c.rank },
            CompressionMethod::Fp16 => C::Half { bf16: false },
            CompressionMethod::Bf16 => C::Half { bf16: true },
            CompressionMethod::Topk => C::TopK {
                fraction: c.fraction,
                sampled: c.threshold == TopkThreshold::Sampled,
                sparse_all_reduce: c.exchange == TopkExchange::Sparse,
            },
            CompressionMethod::Randk => C::RandK { fraction: c.fraction },
            CompressionMethod::Qsgd => C::Qsgd { levels: c.levels },
            CompressionMethod::Sign => C::Sign,
        };
        Ok((m, c.warmup_steps))
    }
}

/// A byte size of at least one byte (a bucket of 0 bytes would hold no gradient).
fn positive_size(setting: &str, text: &str) -> Result<ByteSize, String> {
    let size = text.parse::<ByteSize>().map_err(|e| format!("{setting}: {e}"))?;
    if size.bytes() == 0 {
        return Err(format!("{setting}: \"{text}\" is empty; a bucket holds at least one byte"));
    }
    Ok(size)
}
