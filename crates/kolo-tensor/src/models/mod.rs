//! The reference models. Shapes match `../shared/bench/peers/peerbench_models.py`.

mod cnn;
mod gpt;
mod mlp;
pub mod moe;
pub mod ring;
pub mod tp;

pub use cnn::Cnn;
pub use gpt::{Gpt, GptConfig, StageInput};
pub use mlp::Mlp;
pub use moe::{MoeConfig, MoeLoad};

use crate::ops::cross_entropy;
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::Tensor;
use kolo_base::Rng;

/// Where each value of a piece of a model (a tensor- or expert-parallel member's parameters, in
/// their flat order) lives in the whole model's flat layout: runs of consecutive indices, so that
/// the map costs a few words per row or tensor instead of eight bytes per parameter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct IndexRuns {
    /// (local start, whole-model start, length), in local order.
    runs: Vec<(usize, usize, usize)>,
    len: usize,
}

impl IndexRuns {
    /// Appends the whole-model indices of the next local values.
    pub(crate) fn extend(&mut self, whole: impl IntoIterator<Item = usize>) {
        for k in whole {
            match self.runs.last_mut() {
                Some((_, start, n)) if *start + *n == k => *n += 1,
                _ => self.runs.push((self.len, k, 1)),
            }
            self.len += 1;
        }
    }

    /// The local values taken from the whole model's flat layout `whole`.
    pub(crate) fn gather(&self, whole: &[f32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.len);
        for &(_, start, n) in &self.runs {
            out.extend_from_slice(&whole[start..start + n]);
        }
        out
    }

    /// Writes the local values `local[range]` to their places in `out` (the whole layout).
    pub(crate) fn scatter(&self, local: &[f32], range: std::ops::Range<usize>, out: &mut [f32]) {
        // The first run that ends after `range.start`.
        let first = self.runs.partition_point(|&(l, _, n)| l + n <= range.start);
        for &(l, w, n) in &self.runs[first..] {
            if l >= range.end {
                break;
            }
            let (a, b) = (l.max(range.start), (l + n).min(range.end));
            out[w + a - l..w + b - l].copy_from_slice(&local[a..b]);
        }
    }
}

/// A model's input batch.
#[derive(Clone, Debug)]
pub enum Input {
    /// `n` images of `c x h x w` floats, row-major.
    Images { data: Vec<f32>, n: usize, c: usize, h: usize, w: usize },
    /// `b` sequences of `t` token ids.
    Tokens { ids: Vec<u32>, b: usize, t: usize },
}

/// Inputs and one class id per example (per token for sequences).
#[derive(Clone, Debug)]
pub struct Batch {
    pub input: Input,
    pub targets: Vec<u32>,
}

impl Batch {
    /// `n` random 28x28 one-channel images (standard normal pixels) with random labels of 10
    /// classes, from `seed`: the synthetic benchmark data and the tests' batches.
    pub fn random_images(n: usize, seed: u64) -> Batch {
        let mut r = Rng::new(seed);
        Batch {
            input: Input::Images { data: (0..n * 784).map(|_| r.normal() as f32).collect(), n, c: 1, h: 28, w: 28 },
            targets: (0..n).map(|_| r.below(10) as u32).collect(),
        }
    }

    /// `b` random sequences of `t` token ids below `vocab` with random next-token targets,
    /// from `seed`.
    pub fn random_tokens(b: usize, t: usize, vocab: usize, seed: u64) -> Batch {
        let mut r = Rng::new(seed);
        Batch {
            input: Input::Tokens { ids: (0..b * t).map(|_| r.below(vocab as u64) as u32).collect(), b, t },
            targets: (0..b * t).map(|_| r.below(vocab as u64) as u32).collect(),
        }
    }

    /// Examples in the batch (images or sequences).
    pub fn len(&self) -> usize {
        match &self.input {
            Input::Images { n, .. } => *n,
            Input::Tokens { b, .. } => *b,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The batch cut into consecutive pieces of `per` examples, in order; `None` when `per` is
    /// 0 or does not divide the batch.
    pub fn chunks(&self, per: usize) -> Option<Vec<Batch>> {
        if per == 0 || !self.len().is_multiple_of(per) {
            return None;
        }
        let n = self.len() / per;
        let cut = |v: &[u32], i: usize, w: usize| v[i * per * w..(i + 1) * per * w].to_vec();
        Some(match &self.input {
            Input::Images { data, c, h, w, .. } => {
                let px = c * h * w;
                (0..n)
                    .map(|i| Batch {
                        input: Input::Images { data: data[i * per * px..(i + 1) * per * px].to_vec(), n: per, c: *c, h: *h, w: *w },
                        targets: cut(&self.targets, i, 1),
                    })
                    .collect()
            }
            Input::Tokens { ids, t, .. } => (0..n)
                .map(|i| Batch { input: Input::Tokens { ids: cut(ids, i, *t), b: per, t: *t }, targets: cut(&self.targets, i, *t) })
                .collect(),
        })
    }
}

pub trait Model: Send {
    fn params(&self) -> &ParamSet;
    /// Logits: (n, classes) for images, (b * t, vocab) for tokens.
    fn forward(&self, input: &Input, view: &dyn ParamView) -> Result<Tensor>;

    /// Groups of parameters that ZeRO-3 may shard and gather one at a time (the GPT's blocks),
    /// each in packing order: `kolo train` gathers a group into the model's variables when the
    /// model first reads one of them (`kolo_train::zero3`).
    fn param_groups(&self) -> Vec<Vec<usize>> {
        Vec::new()
    }

    /// Recompute these blocks' activations in backward instead of keeping them (activation
    /// checkpointing). Models without blocks accept only an empty list.
    fn set_checkpointing(&mut self, blocks: &[usize]) -> Result<()> {
        if blocks.is_empty() {
            Ok(())
        } else {
            Err(TensorError::Input("activation checkpointing applies to the GPT's blocks only".into()))
        }
    }

    /// Under tensor parallelism: this member's values `local` placed in the whole model's flat
    /// layout (replicated parameters from member 0 only), so a sum over the group assembles the
    /// whole model. `None` for models that are not split.
    fn tensor_parallel_pieces(&self, _local: &[f32]) -> Option<Result<Vec<f32>>> {
        None
    }

    /// Under tensor parallelism: this member's values taken from the whole model's flat layout
    /// `full` (the inverse of [`Model::tensor_parallel_pieces`]: a checkpoint of whole tensors
    /// loaded into a split model). `None` for models that are not split.
    fn tensor_parallel_local(&self, _full: &[f32]) -> Option<Result<Vec<f32>>> {
        None
    }

    /// Under tensor parallelism: per parameter, how this member's piece was cut from the whole
    /// tensor (`None` for a parameter every member holds whole). `None` for models that are
    /// not split. What `kolo::tp::mark_split` takes, to train the model through the library.
    fn tensor_parallel_splits(&self) -> Option<Vec<Option<tp::Split>>> {
        None
    }

    /// Under tensor parallelism: per parameter, whether it is split across the group (its
    /// pieces differ by member) rather than replicated. `None` for models that are not split.
    fn tensor_parallel_split(&self) -> Option<Vec<bool>> {
        Some(self.tensor_parallel_splits()?.iter().map(Option::is_some).collect())
    }

    /// Mean cross-entropy over the batch (plus auxiliary losses the model defines: the MoE
    /// GPT's load-balancing loss).
    fn loss(&self, batch: &Batch, view: &dyn ParamView) -> Result<Tensor> {
        targets_loss(&self.forward(&batch.input, view)?, &batch.targets)
    }

    /// Mixture of experts: the routing counts since the last call (then reset). `None` for
    /// models without experts.
    fn take_moe_load(&self) -> Option<MoeLoad> {
        None
    }

    /// Under expert parallelism: per parameter, whether it belongs to one of this rank's
    /// experts (not replicated). `None` for models that are not split by experts.
    fn expert_params(&self) -> Option<Vec<bool>> {
        None
    }
}

/// Mean cross-entropy of `logits` (n, classes) against one class id per row.
pub(crate) fn targets_loss(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let n = logits.dim(0)?;
    if targets.len() != n {
        return Err(TensorError::Input(format!("{} targets for {n} outputs", targets.len())));
    }
    let t = Tensor::from_slice(targets, n, &crate::device())?;
    cross_entropy(logits, &t)
}

/// Which model to build, with its shape.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSpec {
    Mlp { input: usize, hidden: Vec<usize>, classes: usize },
    Cnn { channels: (usize, usize), classes: usize },
    Gpt(GptConfig),
}

pub fn build_model(spec: &ModelSpec, seed: u64) -> Result<Box<dyn Model>> {
    let mut rng = Rng::new(seed);
    Ok(match spec {
        ModelSpec::Mlp { input, hidden, classes } => Box::new(Mlp::new(*input, hidden, *classes, &mut rng)?),
        ModelSpec::Cnn { channels, classes } => Box::new(Cnn::new(channels.0, channels.1, *classes, &mut rng)?),
        ModelSpec::Gpt(c) => Box::new(Gpt::new(c.clone(), &mut rng)?),
    })
}

/// torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias.
pub(crate) fn uniform_fan_in(rng: &mut Rng, n: usize, fan_in: usize) -> Vec<f32> {
    let bound = 1.0 / (fan_in as f64).sqrt();
    (0..n).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect()
}

pub(crate) fn normal(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n).map(|_| (rng.normal() * std) as f32).collect()
}
