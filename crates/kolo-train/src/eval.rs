//! Evaluation of the built-in models (loss and accuracy over the evaluation split, combined
//! across ranks) and text sampling from the GPT.

use crate::config::{Config, TrainConfig};
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

/// A whole GPT in this process holding `flat` (every parameter: the initialisation's draw is
/// overwritten).
fn whole_gpt(gcfg: &kolo_tensor::models::GptConfig, flat: &[f32]) -> Result<kolo_tensor::models::Gpt, TrainError> {
    let whole = kolo_tensor::models::Gpt::new(gcfg.clone(), &mut Rng::new(0))?;
    whole.params().load(flat)?;
    Ok(whole)
}

/// Loss over at most `max_batches` batches of `ds` of a whole GPT holding `flat`, computing
/// in `compute` (the run's precision), in this process alone (the strategies whose own model
/// is split or chunked evaluate on one rank).
pub fn evaluate_alone(
    (batch_size, compute): (usize, kolo_tensor::CandleDType),
    gcfg: &kolo_tensor::models::GptConfig,
    flat: &[f32],
    ds: &dyn Dataset,
    max_batches: usize,
) -> Result<Eval, TrainError> {
    let whole = whole_gpt(gcfg, flat)?;
    let local = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0);
    evaluate(&whole, &*kolo_tensor::view_for(compute), ds, &local, batch_size, max_batches, false, &|| Ok(()))
}

/// A sample (`[train]`'s length, temperature and seed) of a whole GPT holding `flat`,
/// computing in `compute`.
pub fn sample_alone(
    (tc, compute): (&TrainConfig, kolo_tensor::CandleDType),
    gcfg: &kolo_tensor::models::GptConfig,
    flat: &[f32],
    vocab: &CharVocab,
) -> Result<String, TrainError> {
    let whole = whole_gpt(gcfg, flat)?;
    sample_text(&whole, &*kolo_tensor::view_for(compute), vocab, gcfg.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(()))
}

/// Generates `n` characters from a text model, starting from a newline ([`sample_ids`] with the
/// model's forward pass).
#[allow(clippy::too_many_arguments)]
pub fn sample_text(
    model: &dyn Model,
    view: &dyn kolo_tensor::ParamView,
    vocab: &CharVocab,
    seq: usize,
    n: usize,
    temperature: f32,
    seed: u64,
    settle: &dyn Fn() -> Result<(), TrainError>,
) -> Result<String, TrainError> {
    let start = vocab.encode(b"\n").unwrap_or_else(|_| vec![0]);
    let ids = sample_ids(&start, n, seq, temperature, seed, &mut |ctx| {
        let t = ctx.len();
        let logits = model.forward(&Input::Tokens { ids: ctx.to_vec(), b: 1, t }, view)?;
        settle()?;
        Ok(logits.narrow(0, t - 1, 1).map_err(kolo_tensor::TensorError::from)?)
    })?;
    Ok(vocab.decode(&ids))
}

/// How a sample is logged (`kolo train`'s and the library's `Trainer::log_sample`).
pub fn sample_block(tc: &crate::config::TrainConfig, text: &str) -> String {
    format!("--- sample ({} chars, temperature {}) ---\n{text}\n---", tc.sample_chars, tc.sample_temperature)
}

/// Text sampling from a causal model, `kolo train`'s and the library's (`kolo::Trainer::sample`):
/// `n` tokens after `start`, each drawn from the softmax of `next_logits(context) / temperature`
/// (the logits of the context's last position; the context is the last `seq` tokens so far),
/// with one uniform draw per token from `seed`'s generator (logits of any float dtype, drawn
/// from in f32). Returns the drawn tokens.
pub fn sample_ids(
    start: &[u32],
    n: usize,
    seq: usize,
    temperature: f32,
    seed: u64,
    next_logits: &mut dyn FnMut(&[u32]) -> Result<kolo_tensor::Tensor, TrainError>,
) -> Result<Vec<u32>, TrainError> {
    let mut rng = Rng::new(seed ^ 0x5A5A);
    let mut ids: Vec<u32> = start.to_vec();
    for _ in 0..n {
        let ctx = &ids[ids.len().saturating_sub(seq.max(1))..];
        // A bf16/f16 model's logits (mixed precision) are drawn from in f32.
        let last = next_logits(ctx)?.to_dtype(candle_core::DType::F32).map_err(kolo_tensor::TensorError::from)?;
        let scaled = (last / f64::from(temperature.max(1e-3))).map_err(kolo_tensor::TensorError::from)?;
        let probs: Vec<f32> = softmax_last(&scaled)?
            .flatten_all()
            .map_err(kolo_tensor::TensorError::from)?
            .to_vec1()
            .map_err(kolo_tensor::TensorError::from)?;
        if probs.is_empty() {
            return Err(TrainError::Data("text sampling: the model returned no logits for the next token".into()));
        }
        let u = rng.next_f64() as f32;
        let mut acc = 0f32;
        let next = probs.iter().position(|p| {
            acc += p;
            acc >= u
        });
        ids.push(next.unwrap_or(probs.len() - 1) as u32);
    }
    Ok(ids.split_off(start.len()))
}

#[cfg(test)]
mod tests {
    use super::sample_ids;
    use candle_core::{Device, Tensor};

    /// Each token is drawn from the logits of the last `seq` tokens so far: at a temperature
    /// near 0 the likeliest one (here always the last token plus one), at 1 spread over the
    /// vocabulary and reproducible from the seed.
    #[test]
    fn sampling_draws_from_the_context_by_temperature_and_seed() {
        let mut contexts = Vec::new();
        let mut next_of_last = |ctx: &[u32]| {
            contexts.push(ctx.to_vec());
            let mut v = vec![0f32; 5];
            v[((ctx[ctx.len() - 1] + 1) % 5) as usize] = 10.0;
            Ok(Tensor::new(v, &Device::Cpu).unwrap().unsqueeze(0).unwrap())
        };
        let ids = sample_ids(&[0], 7, 3, 0.01, 7, &mut next_of_last).unwrap();
        assert_eq!(ids, vec![1, 2, 3, 4, 0, 1, 2]);
        assert_eq!(contexts[..4], [vec![0], vec![0, 1], vec![0, 1, 2], vec![1, 2, 3]]);
        let mut flat = |_: &[u32]| Ok(Tensor::zeros(5, candle_core::DType::F32, &Device::Cpu).unwrap());
        let a = sample_ids(&[0], 200, 4, 1.0, 3, &mut flat).unwrap();
        assert_eq!(a, sample_ids(&[0], 200, 4, 1.0, 3, &mut flat).unwrap());
        assert_ne!(a, sample_ids(&[0], 200, 4, 1.0, 4, &mut flat).unwrap());
        assert!((0..5).all(|t| a.iter().filter(|x| **x == t).count() > 20), "{a:?}");
    }

    /// A mixed-precision model's logits (bf16, f16) are drawn from as their f32 values are:
    /// `kolo train` with `train.precision = "bf16"` failed here at the end of a GPT's run.
    #[test]
    fn half_precision_logits_draw_what_their_f32_values_draw() {
        let logits = |dtype: candle_core::DType| {
            move |ctx: &[u32]| {
                let v: Vec<f32> = (0..7).map(|i| ((i as u32 * 3 + ctx[ctx.len() - 1]) % 7) as f32 * 0.5).collect();
                Ok(Tensor::new(v, &Device::Cpu).unwrap().unsqueeze(0).unwrap().to_dtype(dtype).unwrap())
            }
        };
        let f32_ids = sample_ids(&[0], 50, 4, 0.8, 11, &mut logits(candle_core::DType::F32)).unwrap();
        for dtype in [candle_core::DType::BF16, candle_core::DType::F16] {
            assert_eq!(sample_ids(&[0], 50, 4, 0.8, 11, &mut logits(dtype)).unwrap(), f32_ids, "{dtype:?}");
        }
    }
}
