//! What every strategy builds from the config: the datasets ([`load_data`]), each replica's
//! batches and sampler position, the optimizer, the GPT's shape.

use crate::config::{Config, DataConfig, DataKind};
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
