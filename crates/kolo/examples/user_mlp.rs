//! Your own candle model under Kolo's DDP: an MLP written with candle-nn, trained on MNIST.
//!
//!   cargo run --release --example user_mlp
//!   kolo launch -n 2 -- target/release/examples/user_mlp        (2 processes, DDP over TCP/shm)
//!
//! Flags: --steps N (300), --batch B per rank (32), --hidden H (128), --lr (1e-3), --optim adamw|sgd|lion (Lion: an optimizer of this file, `kolo::UpdateRule`),
//! --zero 0|1|2, --precision f32|bf16|f16 (the model's dtype; f32 masters), --seed S (0),
//! --init FILE (start from these weights, a safetensors file as `VarMap::save` writes),
//! --device cpu|cuda|cuda:N (cuda: a `--features cuda` build; `cuda` is each rank's own GPU),
//! --eval-every N (0: the test set after the last step only), --data DIR (test-data/mnist),
//! --comm-schedule CHUNK,CREDIT (scheduled communication, e.g. 256KiB,1MiB: each parameter
//! updated as soon as its gradient is reduced, under the next forward), --out DIR (checkpoints/user_mlp),
//! --checkpoints DIR and --every N (a checkpoint every N steps; a job an elastic launcher restarted,
//! `kolo launch --min-nodes`, continues from the newest), --resume DIR, --fail-at R:N (rank R
//! fails at step N of the first start, as a crash would), --checkpoint yes (the two hidden
//! layers as one block through `kolo::checkpoint`: their activations recomputed in backward).
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_nn::{linear, loss::cross_entropy, Linear, Module, VarBuilder, VarMap};
use kolo::data::{Dataset, Mnist};

pub struct Mlp(Linear, Linear, Linear);

/// The model: 784 -> hidden -> hidden -> 10, ReLU between.
pub fn mlp(vb: VarBuilder, hidden: usize) -> candle_core::Result<Mlp> {
    Ok(Mlp(linear(784, hidden, vb.pp("fc1"))?, linear(hidden, hidden, vb.pp("fc2"))?, linear(hidden, 10, vb.pp("fc3"))?))
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.2.forward(&self.1.forward(&self.0.forward(x)?.relu()?)?.relu()?)
    }
}

/// The model on `x`; with `checkpoint` its hidden layers run as one checkpointed block
/// (`kolo::checkpoint`: nothing inside kept for backward, which runs them again; the block owns
/// clones of its layers, and its variables are found from its graph).
pub fn forward(model: &Mlp, x: &Tensor, checkpoint: bool) -> candle_core::Result<Tensor> {
    if !checkpoint {
        return model.forward(x);
    }
    let (fc1, fc2) = (model.0.clone(), model.1.clone());
    let h = kolo::checkpoint(x, move |x| fc2.forward(&fc1.forward(x)?.relu()?)?.relu())?;
    model.2.forward(&h)
}

/// Lion (Chen et al., 2023), an optimizer Kolo does not ship: the sign of an interpolation of
/// the momentum and the gradient. Element-wise over flat buffers, so ZeRO shards its state.
struct Lion {
    beta1: f32,
    beta2: f32,
}

impl kolo::UpdateRule for Lion {
    fn describe(&self) -> String {
        format!("Lion(beta1={}, beta2={})", self.beta1, self.beta2)
    }
    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg"]
    }
    fn update(&self, _step: u64, lr: f32, wd: f32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
        for ((p, g), m) in p.iter_mut().zip(g).zip(state[0].iter_mut()) {
            let c = self.beta1 * *m + (1.0 - self.beta1) * g;
            let sign = if c > 0.0 {
                1.0
            } else if c < 0.0 {
                -1.0
            } else {
                0.0
            };
            *p -= lr * (sign + wd * *p);
            *m = self.beta2 * *m + (1.0 - self.beta2) * g;
        }
    }
}

/// The examples at `idx` as (images, labels) tensors, the images in `dtype`.
fn tensors(data: &Mnist, idx: &[usize], dist: &kolo::Dist, dtype: DType) -> Result<(Tensor, Tensor)> {
    let (x, y) = kolo::data::mnist_tensors(data, idx, &dist.device())?;
    Ok((x.to_dtype(dtype)?, y))
}

pub fn train(args: &[String]) -> Result<Vec<f32>> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch): (u64, usize) = (arg("--steps", "300").parse()?, arg("--batch", "32").parse()?);
    let dist = kolo::init()?;
    let device = arg("--device", "cpu");
    dist.use_device(&device)?.set_seed(arg("--seed", "0").parse()?)?; // the same initial weights in every run
    let varmap = VarMap::new();
    let precision = arg("--precision", "f32");
    let dtype = match precision.as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    };
    let vb = VarBuilder::from_varmap(&varmap, dtype, &dist.device());
    let h: usize = arg("--hidden", "128").parse()?;
    let model = mlp(vb, h)?;
    if let Some(init) = args.iter().skip_while(|a| *a != "--init").nth(1) {
        // Onto the model's device, in its dtype.
        let weights = candle_core::safetensors::load(init, &dist.device())?;
        for (name, var) in varmap.data().lock().unwrap().iter() {
            let w = weights.get(name).ok_or_else(|| anyhow::anyhow!("{init} holds no `{name}`"))?;
            var.set(&w.to_dtype(var.dtype())?)?;
        }
    }
    let (optim, lr) = (arg("--optim", "adamw"), arg("--lr", "1e-3").parse()?);
    let mut opts = kolo::TrainOptions::new()
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .log_every(50)
        .precision(precision.parse().map_err(anyhow::Error::msg)?)
        .device(device)
        .batch(batch, 1)
        .eval_every(arg("--eval-every", "0").parse()?);
    if let Some(plan) = args.iter().skip_while(|a| *a != "--comm-schedule").nth(1) {
        // Scheduled communication: "CHUNK,CREDIT", e.g. "256KiB,1MiB".
        let (chunk, credit) = plan.split_once(',').unwrap_or((plan, "1MiB"));
        opts = opts.scheduled_comm(chunk, credit);
    }
    opts = match optim.as_str() {
        "lion" => opts.lr(lr).update_rule(Lion { beta1: 0.9, beta2: 0.99 }),
        kind => opts.optimizer(kind.parse().map_err(anyhow::Error::msg)?, lr),
    };
    if let Some(dir) = args.iter().skip_while(|a| *a != "--checkpoints").nth(1) {
        opts = opts.checkpoints(dir.clone(), arg("--every", "100").parse()?);
    }
    let mut trainer = kolo::Trainer::new(&varmap, &dist, opts)?;
    if let Some(dir) = args.iter().skip_while(|a| *a != "--resume").nth(1) {
        trainer.resume(dir)?;
    } else if dist.restart_count() > 0 {
        // Restarted on the survivors of a failure: from the newest checkpoint, resharded.
        if let (Some(step), true) = (trainer.resume_newest()?, dist.is_main()) {
            println!("restart {} on {} ranks: resumed from step {step}", dist.restart_count(), dist.world_size());
        }
    }
    let fail_at = args.iter().skip_while(|a| *a != "--fail-at").nth(1).and_then(|v| v.split_once(':'));
    let fail_at: Option<(usize, u64)> = fail_at.map(|(r, n)| Ok::<_, anyhow::Error>((r.parse()?, n.parse()?))).transpose()?;
    let data = arg("--data", "test-data/mnist");
    let (train, test) = (Mnist::load(data.as_ref(), "train")?, Mnist::load(data.as_ref(), "t10k")?);
    // Each rank its share of the images, reshuffled every epoch from `train.seed`.
    let mut sampler = trainer.sampler(train.len())?;
    let mut eval = None;
    let checkpoint = arg("--checkpoint", "no") == "yes";
    while trainer.steps_done() < steps {
        if dist.restart_count() == 0 && fail_at == Some((dist.rank(), trainer.steps_done())) {
            anyhow::bail!("rank {} fails at step {} (--fail-at)", dist.rank(), trainer.steps_done());
        }
        let (x, y) = tensors(&train, &sampler.next_batch(), &dist, dtype)?;
        // The loss in f32 (as torch's autocast does); logs every 50 steps: loss, samples/s, ms/step.
        trainer.step(|| cross_entropy(&forward(&model, &x, checkpoint)?.to_dtype(DType::F32)?, &y))?;
        if trainer.eval_due() {
            let e = evaluate(&model, &test, &dist, dtype)?;
            trainer.log_eval(&e); // kolo train's log line, and eval/loss, eval/accuracy in TensorBoard
            eval = Some(e);
        }
    }
    let saved = trainer.save(arg("--out", "checkpoints/user_mlp"))?; // collective: every rank
    if let (Some(e), true) = (eval, dist.is_main()) {
        let accuracy = 100.0 * e.accuracy.unwrap_or(0.0);
        println!("test accuracy {accuracy:.2}% on {} images; checkpoint {}", e.examples, saved.display());
    }
    Ok(trainer.flat_params()?)
}

/// Collective: the loss and accuracy over the test set, each rank scoring every `world`-th
/// image from its rank, the sums added over the ranks.
fn evaluate(model: &Mlp, test: &Mnist, dist: &kolo::Dist, dtype: DType) -> Result<kolo::Eval> {
    let mine: Vec<usize> = (dist.rank()..test.len()).step_by(dist.world_size()).collect();
    let (x, y) = tensors(test, &mine, dist, dtype)?;
    let logits = model.forward(&x)?.to_dtype(DType::F32)?;
    let right = logits.argmax(1)?.eq(&y)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
    let loss = cross_entropy(&logits, &y)?.to_scalar::<f32>()?;
    let mut sums = [f64::from(loss) * mine.len() as f64, f64::from(right), mine.len() as f64];
    dist.sum(&mut sums)?;
    Ok(kolo::Eval { loss: sums[0] / sums[2], accuracy: Some(sums[1] / sums[2]), examples: sums[2] as usize })
}

#[allow(dead_code)]
fn main() -> Result<()> {
    train(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
