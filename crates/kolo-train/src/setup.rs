//! What every strategy builds from the config: the datasets ([`load_data`]), the config
//! resolved once into the typed parts the strategies and the driver receive ([`Setup`]), each
//! replica's batches and sampler position, the optimizer, the GPT's shape.

use crate::config::{Config, DataConfig, DataKind, DdpConfig, Mesh, OptimConfig, PipelineConfig, PsConfig, StepTables, TrainConfig};
use crate::data::{text_split, CharVocab, Dataset, Mnist, Synthetic};
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::TrainError;
use kolo_optim::Optimizer;
use kolo_tensor::{Batch, ModelSpec};
use std::path::PathBuf;
use std::sync::mpsc::sync_channel;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

/// Prints on the lead rank only.
#[cfg(feature = "ps")]
pub(crate) fn lead_say(lead: bool) -> impl Fn(&str) {
    move |m: &str| {
        if lead {
            kolo_base::eline!("{m}");
        }
    }
}

/// One optimizer step of every parameter of `params` (whole flat layout) with `grads`.
pub fn optimizer_step(params: &kolo_tensor::ParamSet, opt: &mut Optimizer, grads: &[f32], lr: f32) -> Result<(), TrainError> {
    opt.begin_step();
    for i in 0..params.len() {
        let r = params.get(i).range.clone();
        params.update_one(i, &mut |p| opt.update(r.start, p, &grads[r.clone()], lr))?;
    }
    Ok(())
}

/// The batches of data-parallel replica `dp_rank` of `dp_size`, from the batch after the first
/// `batches_done` (prefetched). Synthetic data is already per replica: it is not sharded again.
pub fn replica_batches(
    data: &DataConfig,
    seed: u64,
    train: Arc<dyn Dataset>,
    dp_rank: usize,
    dp_size: usize,
    batches_done: u64,
) -> Result<Receiver<(Position, Batch)>, TrainError> {
    let scfg = replica_sampler(data, seed, train.len(), dp_rank, dp_size);
    let pos = scfg.position_after(batches_done);
    let sampler = Sampler::new(scfg, pos).map_err(TrainError::Data)?;
    Ok(prefetch(train, sampler, data.prefetch))
}

/// Prepares batches on a background thread, each with the sampler position after it.
pub(crate) fn prefetch(ds: Arc<dyn Dataset>, mut sampler: Sampler, depth: usize) -> Receiver<(Position, Batch)> {
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

/// The sampler position of data-parallel replica `rank` of `world` over `len` training
/// examples after `batches_done` batches.
#[cfg(feature = "ps")]
pub(crate) fn replica_position(data: &DataConfig, seed: u64, len: usize, rank: usize, world: usize, batches_done: u64) -> Position {
    replica_sampler(data, seed, len, rank, world).position_after(batches_done)
}

/// The sampler of data-parallel replica `rank` of `world` over `len` examples (synthetic data
/// is already per replica, seeded by rank: it is not sharded again).
pub(crate) fn replica_sampler(data: &DataConfig, seed: u64, len: usize, rank: usize, world: usize) -> SamplerConfig {
    let (world, rank) = if data.kind == DataKind::Synthetic { (1, 0) } else { (world, rank) };
    SamplerConfig { len, world, rank, batch: data.batch_size, seed, shuffle: data.shuffle, drop_last: data.drop_last }
}

/// A `kolo train` config resolved once, for the job's mesh and data: the typed parts each
/// strategy and the driver receive, never the whole [`Config`] (its `[fed]` table and the
/// planner's knobs belong to other commands). What only the world size and the data decide
/// is settled here, with its error, before any strategy is built: the mesh, the model's shape
/// with the data's vocabulary, `ddp.schedule`'s sizes, the compute dtype.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Ranks per axis: pipeline stages, data-parallel replicas, tensor-parallel pieces,
    /// sequence chunks, expert groups.
    pub mesh: Mesh,
    /// The model to build, with the data's vocabulary.
    pub spec: ModelSpec,
    /// `model.checkpoint_blocks`: the GPT blocks whose activations backward recomputes.
    pub checkpoint_blocks: Vec<usize>,
    /// `ddp.schedule` as (chunk, credit) in f32 elements, when set.
    pub comm_schedule: Option<(usize, usize)>,
    /// The dtype the model computes in (`train.precision`).
    pub compute: kolo_tensor::CandleDType,
    /// Tokens in one example, for throughput (the GPT's window; 1 for the image models).
    pub tokens_per_example: usize,
    pub data: DataConfig,
    pub train: TrainConfig,
    pub optim: OptimConfig,
    pub ddp: DdpConfig,
    pub pipeline: Option<PipelineConfig>,
    pub ps: PsConfig,
}

impl Setup {
    /// Resolves `cfg` for `mesh` (`Config::mesh_for` of the world size) and the loaded `data`.
    pub fn new(cfg: &Config, mesh: Mesh, data: &Data) -> Result<Setup, TrainError> {
        Ok(Setup {
            mesh,
            spec: cfg.model_spec(data.vocab_size),
            checkpoint_blocks: cfg.model.checkpoint_blocks.clone(),
            comm_schedule: cfg.comm_schedule().map_err(TrainError::Config)?,
            compute: cfg.compute_dtype(),
            tokens_per_example: cfg.tokens_per_example(),
            data: cfg.data.clone(),
            train: cfg.train.clone(),
            optim: cfg.optim.clone(),
            ddp: cfg.ddp.clone(),
            pipeline: cfg.pipeline.clone(),
            ps: cfg.ps.clone(),
        })
    }

    /// The tables a strategy reads while it trains.
    pub fn step_tables(&self) -> StepTables<'_> {
        StepTables { train: &self.train, optim: &self.optim, ddp: &self.ddp, batch_size: self.data.batch_size }
    }

    /// The global batch over `replicas` data-parallel replicas (with `train.grad_accum`).
    pub fn global_batch(&self, replicas: usize) -> usize {
        crate::config::global_batch(self.data.batch_size, replicas, self.train.grad_accum)
    }

    /// The checkpoint metadata every strategy writes and checks on load: a checkpoint continues
    /// under any strategy whose model, optimizer and data split agree (`replicas`: the sampler's
    /// world, whose change rescales the data position).
    pub fn checkpoint_meta(&self, replicas: usize, zero_stage: u8) -> std::collections::BTreeMap<String, String> {
        let model = spec_string(&self.spec);
        let mut meta = crate::checkpointing::base_meta(model, &self.optim.spec(), replicas, self.data.batch_size, zero_stage);
        meta.insert("kolo.seed".into(), self.train.seed.to_string());
        meta
    }
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
    // Before a dataset or batch of that size exists (a failed allocation aborts).
    let fits = |vocab: usize| cfg.check_batch_memory(vocab, kolo_base::mem_available()).map_err(TrainError::Config);
    match d.kind {
        DataKind::Mnist => {
            fits(10)?;
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
            fits(vocab.len())?;
            let (train, eval) = text_split(&text, &vocab, seq.min(text.len() / 4).max(1), d.train_fraction, &name)?;
            Ok(Data { train: Arc::new(train), eval: Arc::new(eval), vocab_size: vocab.len(), vocab: Some(vocab) })
        }
        DataKind::Synthetic => {
            fits(if cfg.model.kind == crate::config::ModelKind::Gpt { 65 } else { 10 })?;
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

pub fn spec_string(spec: &ModelSpec) -> String {
    format!("{spec:?}")
}
