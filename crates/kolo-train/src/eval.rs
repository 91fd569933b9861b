//! Evaluation of the built-in models (loss and accuracy over the evaluation split, combined
//! across ranks) and text sampling from the GPT.

use crate::config::Config;
use crate::data::{CharVocab, Dataset};
use crate::setup::load_data;
use crate::summary::Eval;
use crate::TrainError;
use kolo_base::Rng;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_tensor::ops::{argmax_rows, softmax_last};
use kolo_tensor::{Input, Model, PlainView};

/// Loss (mean per example) and accuracy over this rank's share of the evaluation set, combined
/// across ranks.
/// With `lockstep` (ZeRO-3, where every forward gathers parameters collectively) every rank
/// runs as many forward passes as rank 0, the one with the most examples, repeating its last
/// batch without counting it, and `settle` runs after every forward (it completes the gathers
/// a forward leaves in flight, before this function's own collective).
#[allow(clippy::too_many_arguments)]
pub fn evaluate(
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

/// The config's model holding `params` (flat, as a [`Summary`](crate::Summary) has them) evaluated in this
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
