//! Your own candle model trained through parameter servers (`[train] strategy = "ps"`): the
//! MLP of `user_mlp`, each worker on its shard of MNIST, the servers applying SGD.
//!
//!   cargo build --release -p kolo-cli && cargo build --release -p kolo --features ps --example user_ps
//!   target/release/kolo ps run -n 2 --servers 1 --exec -- target/release/examples/user_ps
//!
//! Flags: --steps N (200), --batch B per worker (32), --hidden H (128), --optim sgd|adam|adamw|..
//! (sgd; the servers run it), --lr (0.1),
//! --consistency bsp|async (bsp: every step waits for every worker's push, as DDP),
//! --checkpoints DIR and --every N (worker 0 writes the servers' state every N steps),
//! --resume DIR (onto fresh servers), --stop-at N (stop there, as if interrupted),
//! --fail-at W:N (worker W fails at step N, as a crash would: a survivor trains its shard),
//! --data DIR (test-data/mnist), --out FILE (worker 0 writes the final model there).
use anyhow::Result;
use candle_core::{DType, Device};
use candle_nn::{loss::cross_entropy, Module, VarBuilder, VarMap};
use kolo::data::{Dataset, Mnist};

#[path = "user_mlp.rs"]
#[allow(dead_code)]
mod user_mlp;

/// Trains this worker; returns the final parameters (flat) it pulled from the servers.
pub fn train(args: &[String]) -> Result<Vec<f32>> {
    train_worker(args, None)
}

/// Trains this process's worker, or with `taken` the shard of a dead worker this one took over
/// (the same code, on a model of its own).
fn train_worker(args: &[String], taken: Option<kolo::PsJoin>) -> Result<Vec<f32>> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch): (u64, usize) = (arg("--steps", "200").parse()?, arg("--batch", "32").parse()?);
    let device = Device::Cpu;
    device.set_seed(0)?; // every worker builds the same model; worker 0's values seed the servers
    let varmap = VarMap::new();
    let model = user_mlp::mlp(VarBuilder::from_varmap(&varmap, DType::F32, &device), arg("--hidden", "128").parse()?)?;
    let mut opts = kolo::TrainOptions::new()
        .optimizer(arg("--optim", "sgd").parse().map_err(anyhow::Error::msg)?, arg("--lr", "0.1").parse()?)
        .strategy(kolo::options::Strategy::Ps)
        .steps(steps)
        .batch(batch, 1)
        .log_every(50);
    if arg("--consistency", "bsp") == "async" {
        opts.ps.consistency = kolo::options::PsConsistency::Async;
    }
    if let Some(dir) = args.iter().skip_while(|a| *a != "--checkpoints").nth(1) {
        opts = opts.checkpoints(dir.clone(), arg("--every", "50").parse()?);
    }
    let mut worker = match taken.clone() {
        // RANK, WORLD_SIZE, the coordinator and the job's token, as `kolo ps run` sets them.
        None => kolo::PsWorker::join(&varmap, opts)?,
        Some(dead) => kolo::PsWorker::connect(&varmap, opts, dead)?, // from the dead worker's clock
    };
    if taken.is_none() {
        if let Some(dir) = args.iter().skip_while(|a| *a != "--resume").nth(1) {
            worker.resume(dir)?; // every worker; worker 0 restores the servers
        }
        // Should a worker die, this one may be granted its data shard: trained on another thread.
        let args = args.to_vec();
        worker.take_over_dead_workers(move |dead| train_worker(&args, Some(dead)).map(drop))?;
    }
    let fail_at = args.iter().skip_while(|a| *a != "--fail-at").nth(1).and_then(|v| v.split_once(':'));
    let fail_at: Option<(usize, u64)> = fail_at.map(|(w, n)| Ok::<_, anyhow::Error>((w.parse()?, n.parse()?))).transpose()?;
    let train = Mnist::load(arg("--data", "test-data/mnist").as_ref(), "train")?;
    let mut sampler = worker.sampler(train.len())?;
    let stop: u64 = arg("--stop-at", &steps.to_string()).parse()?;
    while worker.steps_done() < steps.min(stop) {
        if taken.is_none() && fail_at == Some((worker.worker().0, worker.steps_done())) {
            anyhow::bail!("worker {} fails at step {} (--fail-at)", worker.worker().0, worker.steps_done());
        }
        let (x, y) = kolo::data::mnist_tensors(&train, &sampler.next_batch(), &device)?;
        worker.set_data_position(sampler.position()); // for the checkpoints the step writes
        worker.step(|| cross_entropy(&model.forward(&x)?, &y))?; // pull, forward, backward, push
    }
    if stop < steps {
        return Ok(Vec::new()); // interrupted: the checkpoints written so far hold the run
    }
    let flat = worker.finish()?; // the servers' final values, into the model
    if worker.worker().0 == 0 {
        let out = arg("--out", "checkpoints/user_ps.safetensors");
        if let Some(dir) = std::path::Path::new(&out).parent() {
            std::fs::create_dir_all(dir)?;
        }
        varmap.save(&out)?;
        println!("worker 0: {} steps, model written to {out}", worker.steps_done());
    }
    Ok(flat)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    train(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
