//! Your own candle model split over ranks (Megatron-style tensor parallelism) and replicated
//! (DDP) in one mesh: an MLP on MNIST whose first layer is column-parallel and whose second is
//! row-parallel (one all-reduce forward, one backward), the last layer whole on every rank.
//!
//!   kolo launch -n 2 -- target/release/examples/user_tp                  (tp 2)
//!   kolo launch -n 4 -- target/release/examples/user_tp --dp 2 --tp 2    (dp 2 x tp 2)
//!
//! Flags: --dp D (1), --tp T (ranks / D), --steps N (200), --batch B per optimizer step over
//! all ranks (64; each data-parallel replica takes B / D), --hidden H (256), --optim adamw|sgd,
//! --lr (1e-3), --clip C (none), --init FILE (start from whole weights in a safetensors
//! file), --save-init FILE (write the whole initial weights there and stop), --plain yes (one
//! process, candle-nn's own layers: the reference), --stop-at K, --resume DIR,
//! --data DIR (test-data/mnist), --out DIR (checkpoints/user_tp).
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_nn::{linear, loss::cross_entropy, Linear, Module, VarBuilder, VarMap};
use kolo::data::{Dataset, Mnist, Sampler, SamplerConfig};
use kolo::tp::{ColumnParallelLinear, RowParallelLinear};

/// The MLP with its first two layers split over the tensor-parallel group, or (`--plain`)
/// candle-nn's layers under the same names.
pub struct Mlp {
    fc1: Box<dyn Module>,
    fc2: Box<dyn Module>,
    fc3: Linear,
}

impl Mlp {
    pub fn new(vb: VarBuilder, hidden: usize, mesh: Option<&kolo::Mesh>) -> candle_core::Result<Mlp> {
        let (fc1, fc2): (Box<dyn Module>, Box<dyn Module>) = match mesh {
            Some(m) => (
                Box::new(ColumnParallelLinear::new(784, hidden, true, vb.pp("fc1"), m.tp())?),
                Box::new(RowParallelLinear::new(hidden, hidden, true, vb.pp("fc2"), m.tp())?),
            ),
            None => (Box::new(linear(784, hidden, vb.pp("fc1"))?), Box::new(linear(hidden, hidden, vb.pp("fc2"))?)),
        };
        Ok(Mlp { fc1, fc2, fc3: linear(hidden, 10, vb.pp("fc3"))? })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.fc3.forward(&self.fc2.forward(&self.fc1.forward(x)?.relu()?)?.relu()?)
    }
}

/// The examples at `idx` as (images, labels) tensors.
fn tensors(data: &Mnist, idx: &[usize]) -> Result<(Tensor, Tensor)> {
    let x: Vec<f32> = idx.iter().flat_map(|&i| data.image(i).iter().copied()).collect();
    let y: Vec<u32> = idx.iter().map(|&i| u32::from(data.labels()[i])).collect();
    let dev = kolo::candle_core::Device::Cpu;
    Ok((Tensor::from_vec(x, (idx.len(), 784), &dev)?, Tensor::from_vec(y, idx.len(), &dev)?))
}

/// Trains as the flags say; returns where the last checkpoint went.
pub fn train(args: &[String]) -> Result<std::path::PathBuf> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch, hidden): (u64, usize, usize) =
        (arg("--steps", "200").parse()?, arg("--batch", "64").parse()?, arg("--hidden", "256").parse()?);
    let dist = kolo::init()?;
    dist.device().set_seed(0)?;
    let dp: usize = arg("--dp", "1").parse()?;
    let tp: usize = arg("--tp", &(dist.world_size() / dp.max(1)).to_string()).parse()?;
    let plain = arg("--plain", "no") == "yes";
    let mesh = kolo::Mesh::new(&dist, &[("dp", dp), ("tp", tp)])?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dist.device());
    let model = Mlp::new(vb, hidden, (!plain).then_some(&mesh))?;
    let save_init = arg("--save-init", "");
    if !save_init.is_empty() {
        varmap.save(&save_init)?; // one process, --plain: the whole initial weights
        return Ok(save_init.into());
    }
    let init = arg("--init", "");
    if !init.is_empty() {
        kolo::tp::load_safetensors(&varmap, &[&init])?; // each rank reads its pieces
    }
    let mut opts = kolo::TrainOptions::new()
        .optimizer(arg("--optim", "adamw").parse().map_err(anyhow::Error::msg)?, arg("--lr", "1e-3").parse()?)
        .steps(steps)
        .log_every(50)
        .batch(batch / dp, 1);
    if let Ok(c) = arg("--clip", "none").parse() {
        opts = opts.clip_grad_norm(c);
    }
    let mut trainer = kolo::Trainer::with_mesh(&varmap, &mesh, opts)?;
    let resume = arg("--resume", "");
    if !resume.is_empty() {
        trainer.resume(&resume)?;
    }
    let data = arg("--data", "test-data/mnist");
    let train = Mnist::load(data.as_ref(), "train")?;
    // The members of a tensor-parallel group read the same batches; the replicas their own.
    let cfg = SamplerConfig {
        len: train.len(),
        world: mesh.size("dp"),
        rank: mesh.coord("dp"),
        batch: batch / dp,
        seed: 0,
        shuffle: true,
        drop_last: true,
    };
    let mut sampler = Sampler::new(cfg, trainer.data_position()).map_err(anyhow::Error::msg)?;
    let (out, stop_at) = (arg("--out", "checkpoints/user_tp"), arg("--stop-at", "0").parse::<u64>()?);
    while trainer.steps_done() < steps {
        let (x, y) = tensors(&train, &sampler.next_batch())?;
        trainer.step(|| cross_entropy(&model.forward(&x)?, &y))?;
        trainer.set_data_position(sampler.position());
        if trainer.steps_done() == stop_at {
            break;
        }
    }
    let saved = trainer.save(&out)?; // whole tensors, loadable in one process
    if dist.is_main() {
        let (calls, bytes) = mesh.tp().traffic();
        println!(
            "dp {} x tp {}: {} steps; tensor-parallel all-reduces {calls} ({:.2} MB); checkpoint {}",
            mesh.size("dp"),
            mesh.size("tp"),
            trainer.steps_done(),
            bytes as f64 / 1e6,
            saved.display()
        );
    }
    Ok(saved)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    train(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
