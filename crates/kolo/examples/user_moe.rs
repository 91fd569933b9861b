//! Your own candle model with a mixture-of-experts layer on a `dp x ep` mesh: an MNIST MLP
//! 784 -> H, then a residual MoE layer of E SwiGLU experts (Mixtral's expert, your own module)
//! with a top-k gate, then H -> 10. The experts are dealt out over the `ep` group (each rank
//! builds only its own); tokens (here: images) travel to their experts and back by
//! all-to-all; every rank of the mesh reads its own batches.
//!
//!   kolo launch -n 2 -- target/release/examples/user_moe --ep 2            (2 experts per rank)
//!   kolo launch -n 4 -- target/release/examples/user_moe --dp 2 --ep 2     (dp 2 x ep 2)
//!
//! Flags: --dp D (1), --ep P (ranks / D), --experts E (4), --top-k K (2), --capacity F
//! (E / K: no token dropped), --aux W (weight of the load-balancing loss, 0.01), --steps N
//! (200), --batch B per optimizer step over all ranks (64), --hidden H (64), --optim adamw|sgd,
//! --lr (1e-3), --clip C (none), --zero S (0 or 1), --init FILE (start from whole weights in a
//! safetensors file), --save-init FILE (write the whole initial weights there and stop; one
//! process), --stop-at K (stop after step K), --resume DIR (a checkpoint of any dp x ep, or of one
//! process), --data DIR (test-data/mnist), --out DIR (checkpoints/user_moe).
use anyhow::Result;
use candle_core::{DType, Module, Tensor};
use candle_nn::{linear, linear_no_bias, loss::cross_entropy, VarBuilder, VarMap};
use kolo::data::{Dataset, Mnist};
use kolo::ep::{MoeConfig, MoeLayer};

/// Mixtral's expert: `w2(silu(w1 x) * w3 x)`.
pub struct SwiGlu {
    w1: candle_nn::Linear,
    w2: candle_nn::Linear,
    w3: candle_nn::Linear,
}

impl SwiGlu {
    pub fn new(hidden: usize, inner: usize, vb: VarBuilder) -> candle_core::Result<SwiGlu> {
        Ok(SwiGlu {
            w1: linear_no_bias(hidden, inner, vb.pp("w1"))?,
            w2: linear_no_bias(inner, hidden, vb.pp("w2"))?,
            w3: linear_no_bias(hidden, inner, vb.pp("w3"))?,
        })
    }
}

impl Module for SwiGlu {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.w2.forward(&(candle_nn::ops::silu(&self.w1.forward(x)?)? * self.w3.forward(x)?)?)
    }
}

/// The model: `fc1`, the MoE layer `moe` (`moe.gate`, `moe.experts.{j}`), `fc2`.
pub struct MoeMlp {
    fc1: candle_nn::Linear,
    moe: MoeLayer<SwiGlu>,
    fc2: candle_nn::Linear,
}

impl MoeMlp {
    /// Logits and the load-balancing loss.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let h = self.fc1.forward(x)?.relu()?;
        let (m, aux) = self.moe.forward(&h)?;
        Ok((self.fc2.forward(&(h + m)?)?, aux))
    }
}

/// Trains as the flags say; returns where the last checkpoint went.
pub fn train(args: &[String]) -> Result<std::path::PathBuf> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch, hidden): (u64, usize, usize) =
        (arg("--steps", "200").parse()?, arg("--batch", "64").parse()?, arg("--hidden", "64").parse()?);
    let dist = kolo::init()?;
    dist.device().set_seed(0)?;
    let dp: usize = arg("--dp", "1").parse()?;
    let ep: usize = arg("--ep", &(dist.world_size() / dp.max(1)).to_string()).parse()?;
    let mesh = kolo::Mesh::new(&dist, &[("dp", dp), ("ep", ep)])?;
    let (experts, top_k): (usize, usize) = (arg("--experts", "4").parse()?, arg("--top-k", "2").parse()?);
    let cfg = MoeConfig {
        experts,
        top_k,
        renormalize: top_k > 1,
        capacity_factor: arg("--capacity", &(experts as f64 / top_k as f64).to_string()).parse()?,
        aux_weight: arg("--aux", "0.01").parse()?,
        scoring: Default::default(),
        groups: None,
    };
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dist.device());
    let group = mesh.ep();
    let model = MoeMlp {
        fc1: linear(784, hidden, vb.pp("fc1"))?,
        moe: MoeLayer::new(hidden, cfg, vb.pp("moe"), Some(&group), |vb| SwiGlu::new(hidden, hidden / 2, vb))?,
        fc2: linear(hidden, 10, vb.pp("fc2"))?,
    };
    let save_init = arg("--save-init", "");
    if !save_init.is_empty() {
        varmap.save(&save_init)?; // one process: every expert
        return Ok(save_init.into());
    }
    let init = arg("--init", "");
    if !init.is_empty() {
        kolo::tp::load_safetensors(&varmap, &[&init])?; // each rank reads its experts
    }
    let replicas = dp * ep;
    let mut opts = kolo::TrainOptions::new()
        .optimizer(arg("--optim", "adamw").parse().map_err(anyhow::Error::msg)?, arg("--lr", "1e-3").parse()?)
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .log_every(50)
        .batch(batch / replicas, 1);
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
    // Every rank is a replica with its own batches: the expert-parallel members too.
    let mut sampler = trainer.sampler(train.len())?;
    let stop_at: u64 = arg("--stop-at", "0").parse()?;
    while trainer.steps_done() < steps {
        let (x, y) = kolo::data::mnist_tensors(&train, &sampler.next_batch(), &dist.device())?;
        trainer.set_data_position(sampler.position()); // before the step, whose checkpoint carries it
        trainer.step(|| {
            let (logits, aux) = model.forward(&x)?;
            cross_entropy(&logits, &y)? + aux
        })?;
        if trainer.steps_done() == stop_at {
            break;
        }
    }
    let saved = trainer.save(arg("--out", "checkpoints/user_moe"))?; // whole tensors, every expert
    if dist.is_main() {
        let load = model.moe.take_load();
        println!(
            "{mesh:?}: {} steps; rank 0 routed {} assignments, {} dropped, load CV {:.3}; checkpoint {}",
            trainer.steps_done(),
            load.assigned,
            load.dropped,
            load.cv(),
            saved.display()
        );
    }
    Ok(saved)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    train(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
