//! Your own candle model on a `pp x dp x tp` mesh: an MLP on MNIST whose first layer is
//! column-parallel and second row-parallel over the `tp` group (Megatron-style tensor
//! parallelism: one all-reduce forward, one backward), whose three layers are cut into
//! pipeline stages over the `pp` group (GPipe or 1F1B over micro-batches), and which is
//! replicated over the `dp` group (DDP).
//!
//!   kolo launch -n 2 -- target/release/examples/user_mesh --tp 2             (tensor parallel)
//!   kolo launch -n 4 -- target/release/examples/user_mesh --dp 2 --tp 2     (dp 2 x tp 2)
//!   kolo launch -n 3 -- target/release/examples/user_mesh --pp 3            (3 pipeline stages)
//!
//! Flags: --pp P (1), --dp D (1), --tp T (ranks / P / D), --micro M micro-batches per step
//! (pipelines; 2), --schedule gpipe|1f1b, --steps N (200), --batch B per optimizer step over
//! all ranks (64; each data-parallel replica takes B / D), --hidden H (256),
//! --optim adamw|sgd, --lr (1e-3), --clip C (none), --init FILE (start from whole weights in
//! a safetensors file), --save-init FILE (write the whole initial weights there and stop),
//! --compression fp16|bf16 (the data-parallel all-reduce in 2 bytes), --local-sgd N (local SGD:
//! the replicas' models averaged every N steps), --zero S (0; 3 shards each of this stage's layers over the data-parallel group), --precision f32|bf16|f16 (f32: mixed precision builds the model in bf16 or
//! f16 over f32 masters; the loss is taken in f32), --plain yes (one process, candle-nn's own layers: the reference), --stop-at K,
//! --resume DIR, --data DIR (test-data/mnist), --out DIR (checkpoints/user_mesh),
//! --slow-rank R (that rank's forward takes 30 ms longer: a straggler for the log to name),
//! --schedule 2bw (PipeDream-2BW, `Pipeline::step_stream`) with --stream N (steps per stream;
//! the whole run) and --carry yes (the version before the latest carried across streams:
//! `Pipeline::carrying_versions`), --two-bw N (one process: 2BW's updates by hand in streams of N, the
//! reference),
//! --resume-only R (only that rank resumes: a mistake the trainer must name).
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_nn::{linear, loss::cross_entropy, Module, VarBuilder, VarMap};
use kolo::data::{Dataset, Mnist, Sampler};
use kolo::pp::partition;
use kolo::tp::{ColumnParallelLinear, RowParallelLinear};

/// The layers of the MLP 784 -> H -> H -> 10 that this rank's pipeline stage holds: the
/// first two split over the tensor-parallel group, or (`--plain`) candle-nn's own.
pub struct Mlp {
    layers: Vec<(usize, Box<dyn Module>)>,
}

const LAYERS: usize = 3;

impl Mlp {
    pub fn new(vb: VarBuilder, hidden: usize, mesh: &kolo::Mesh, plain: bool) -> Result<Mlp> {
        let mut layers: Vec<(usize, Box<dyn Module>)> = Vec::new();
        for i in kolo::pp::stage_layers(LAYERS, mesh)? {
            let vb = vb.pp(format!("fc{}", i + 1));
            let l: Box<dyn Module> = match (i, plain) {
                (0, false) => Box::new(ColumnParallelLinear::new(784, hidden, true, vb, mesh.tp())?),
                (1, false) => Box::new(RowParallelLinear::new(hidden, hidden, true, vb, mesh.tp())?),
                (0, true) => Box::new(linear(784, hidden, vb)?),
                (1, true) => Box::new(linear(hidden, hidden, vb)?),
                _ => Box::new(linear(hidden, 10, vb)?),
            };
            layers.push((i, l));
        }
        Ok(Mlp { layers })
    }

    /// The indices of this stage's layers.
    pub fn layer_ids(&self) -> Vec<usize> {
        self.layers.iter().map(|(i, _)| *i).collect()
    }

    /// Whether this stage ends with the model's output.
    pub fn is_last(&self) -> bool {
        self.layers.last().is_some_and(|(i, _)| i + 1 == LAYERS)
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in &self.layers {
            h = l.forward(&h)?;
            if i + 1 < LAYERS {
                h = h.relu()?;
            }
        }
        Ok(h)
    }
}

/// Trains as the flags say; returns where the last checkpoint went.
pub fn train(args: &[String]) -> Result<std::path::PathBuf> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch, hidden): (u64, usize, usize) =
        (arg("--steps", "200").parse()?, arg("--batch", "64").parse()?, arg("--hidden", "256").parse()?);
    let dist = kolo::init()?;
    dist.device().set_seed(0)?;
    let (pp, dp): (usize, usize) = (arg("--pp", "1").parse()?, arg("--dp", "1").parse()?);
    let tp: usize = arg("--tp", &(dist.world_size() / (pp * dp).max(1)).to_string()).parse()?;
    let plain = arg("--plain", "no") == "yes";
    let mesh = kolo::Mesh::new(&dist, &[("pp", pp), ("dp", dp), ("tp", tp)])?;
    let precision: kolo::options::Precision = arg("--precision", "f32").parse().map_err(anyhow::Error::msg)?;
    let dtype = precision.dtype();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &dist.device());
    let model = Mlp::new(vb, hidden, &mesh, plain)?;
    let save_init = arg("--save-init", "");
    if !save_init.is_empty() {
        varmap.save(&save_init)?; // one process, --plain: the whole initial weights
        return Ok(save_init.into());
    }
    let init = arg("--init", "");
    if !init.is_empty() {
        kolo::tp::load_safetensors(&varmap, &[&init])?; // each rank reads its pieces
    }
    let micro: usize = if pp > 1 { arg("--micro", "2").parse()? } else { 1 };
    let mut opts = kolo::TrainOptions::new()
        .optimizer(arg("--optim", "adamw").parse().map_err(anyhow::Error::msg)?, arg("--lr", "1e-3").parse()?)
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .precision(precision)
        .grad_accum(micro as u64)
        .log_every(50)
        .batch(batch / dp, 1);
    if let Ok(c) = arg("--clip", "none").parse() {
        opts = opts.clip_grad_norm(c);
    }
    if args.iter().any(|a| a == "--local-sgd") {
        // Each data-parallel replica steps alone; the replicas' models are averaged every N steps.
        let c = format!("[ddp]\nlocal_sgd = {{ every = {} }}\n", arg("--local-sgd", "4"));
        opts.ddp.local_sgd = kolo::TrainOptions::from_toml_str(&c)?.ddp.local_sgd;
    }
    if args.iter().any(|a| a == "--compression") {
        // The data-parallel all-reduce in 2 bytes a value (torch's fp16_compress_hook).
        let c = format!("[ddp]\ncompression = {{ method = \"{}\", warmup_steps = 0 }}\n", arg("--compression", "fp16"));
        opts.ddp.compression = kolo::TrainOptions::from_toml_str(&c)?.ddp.compression;
    }
    let mut trainer = if arg("--zero", "0") == "3" {
        // ZeRO-3 (FSDP) over the data-parallel group: this stage's layers, each a group.
        let groups: Vec<String> = kolo::pp::stage_layers(LAYERS, &mesh)?.map(|i| format!("fc{}.", i + 1)).collect();
        kolo::Trainer::with_mesh_zero3_groups(&varmap, &mesh, opts, &groups.iter().map(String::as_str).collect::<Vec<_>>())?
    } else {
        kolo::Trainer::with_mesh(&varmap, &mesh, opts)?
    };
    let resume = arg("--resume", "");
    // --resume-only R: a mistake on purpose, only rank R resumes (the trainer refuses it).
    let only = arg("--resume-only", "none").parse::<usize>().ok();
    if !resume.is_empty() && only.is_none_or(|r| r == dist.rank()) {
        trainer.resume(&resume)?;
    }
    // PipeDream-2BW: streams of at most --stream steps (and to the end of the run).
    let stream: usize = arg("--stream", "1000000").parse()?;
    let schedule = match arg("--schedule", "1f1b").as_str() {
        "gpipe" => kolo::pp::Schedule::GPipe,
        "2bw" => kolo::pp::Schedule::TwoBw { batches: stream },
        _ => kolo::pp::Schedule::OneFOneB,
    };
    let per_micro = batch / dp / micro;
    // Between stages travel (micro-batch, features): the first layer's output is split over
    // the tensor-parallel group (column-parallel), the second's whole. Every stage boundary
    // must carry the first one's shape (a mismatch is an error naming both shapes).
    let first_stage_end = if pp > 1 { partition(&[1.0; LAYERS], pp)[0].end } else { LAYERS };
    let width = if first_stage_end == 1 && !plain { hidden / tp } else { hidden };
    let mut pipe = kolo::pp::Pipeline::new(schedule, &[per_micro, width])?;
    if arg("--carry", "no") == "yes" {
        // 2BW: a stream's end keeps the version before the latest for the next stream's first
        // batch (and the trainer's checkpoints write it): streams change nothing computed.
        pipe = pipe.carrying_versions(&trainer);
    }
    let data = arg("--data", "test-data/mnist");
    let train = Mnist::load(data.as_ref(), "train")?;
    // The stages and the members of a tensor-parallel group read the same batches; the
    // replicas their own.
    let mut sampler = trainer.sampler(train.len())?;
    let (out, stop_at) = (arg("--out", "checkpoints/user_mesh"), arg("--stop-at", "0").parse::<u64>()?);
    let slow = arg("--slow-rank", "none").parse::<usize>().ok() == Some(dist.rank());
    let lag = || {
        if slow {
            std::thread::sleep(std::time::Duration::from_millis(30));
        }
    };
    if pp > 1 && matches!(schedule, kolo::pp::Schedule::TwoBw { .. }) {
        // The stream asks for the next step's micro-batches before this step's update: the
        // batches are read ahead, by step. This step's is read before the call, so that the
        // data position a checkpoint (at a stream's end) carries is after it.
        let ahead = std::cell::RefCell::new(std::collections::BTreeMap::new());
        let read = |t: u64, sampler: &mut Sampler| -> candle_core::Result<(Tensor, Tensor)> {
            let mut ahead = ahead.borrow_mut();
            if let std::collections::btree_map::Entry::Vacant(e) = ahead.entry(t) {
                let (x, y) = kolo::data::mnist_tensors(&train, &sampler.next_batch(), &dist.device()).map_err(candle_core::Error::wrap)?;
                e.insert((x.to_dtype(dtype)?, y));
            }
            Ok(ahead[&t].clone())
        };
        let sampler = std::cell::RefCell::new(sampler);
        while trainer.steps_done() < steps {
            let t = trainer.steps_done();
            read(t, &mut sampler.borrow_mut())?;
            trainer.set_data_position(sampler.borrow().position());
            pipe.step_stream(&mut trainer, |step, mb, input| {
                let (x, y) = read(step, &mut sampler.borrow_mut())?;
                let h = match input {
                    Some(h) => model.forward(h)?,
                    None => model.forward(&x.narrow(0, mb * per_micro, per_micro)?)?,
                };
                match model.is_last() {
                    true => cross_entropy(&h.to_dtype(DType::F32)?, &y.narrow(0, mb * per_micro, per_micro)?),
                    false => Ok(h),
                }
            })?;
            ahead.borrow_mut().remove(&t);
            if trainer.steps_done() == stop_at {
                break;
            }
        }
        return finish(&mut trainer, &mesh, &dist, &out, pipe.bubble().map(|b| (b, model.layer_ids())));
    }
    // --two-bw N: one process computing PipeDream-2BW's updates by hand (the reference): in
    // streams of N steps, step t's gradient on the weights before step t - 1's update (the
    // stream's first on the latest), applied to the latest weights.
    let two_bw = arg("--two-bw", "0").parse::<u64>()?;
    let vars: Vec<candle_core::Var> = {
        let data = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
        data.values().cloned().collect()
    };
    let mut previous: Option<Vec<Tensor>> = None;
    while trainer.steps_done() < steps {
        let (x, y) = kolo::data::mnist_tensors(&train, &sampler.next_batch(), &dist.device())?;
        if two_bw > 0 && pp == 1 {
            let t = trainer.steps_done();
            if t.is_multiple_of(two_bw) {
                previous = None;
            }
            let latest: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().copy()).collect::<candle_core::Result<_>>()?;
            for (v, p) in vars.iter().zip(previous.iter().flatten()) {
                v.set(p)?;
            }
            trainer.backward(&cross_entropy(&model.forward(&x.to_dtype(dtype)?)?.to_dtype(DType::F32)?, &y)?)?;
            for (v, l) in vars.iter().zip(&latest) {
                trainer.set_param(v, l)?;
            }
            trainer.update()?;
            previous = Some(latest);
            continue;
        }
        let x = x.to_dtype(dtype)?;
        trainer.set_data_position(sampler.position()); // before the step, whose checkpoint carries it
        if pp > 1 {
            pipe.step(&mut trainer, |mb, input| {
                let h = match input {
                    Some(h) => model.forward(h)?,
                    None => model.forward(&x.narrow(0, mb * per_micro, per_micro)?)?,
                };
                if model.is_last() {
                    cross_entropy(&h.to_dtype(DType::F32)?, &y.narrow(0, mb * per_micro, per_micro)?)
                } else {
                    Ok(h)
                }
            })?;
        } else {
            trainer.step(|| {
                lag();
                cross_entropy(&model.forward(&x)?.to_dtype(DType::F32)?, &y)
            })?;
        }
        if trainer.steps_done() == stop_at {
            break;
        }
    }
    finish(&mut trainer, &mesh, &dist, &out, pipe.bubble().map(|b| (b, model.layer_ids())))
}

/// Writes the last checkpoint; returns where it went.
fn finish(
    trainer: &mut kolo::Trainer,
    mesh: &kolo::Mesh,
    dist: &kolo::Dist,
    out: &str,
    bubble: Option<(f64, Vec<usize>)>,
) -> Result<std::path::PathBuf> {
    if let (Some((b, layers)), 0, 0) = (bubble, mesh.coord("dp"), mesh.coord("tp")) {
        println!("pipeline stage {} (layers {layers:?}): bubble {:.1}% of its step time", mesh.coord("pp"), 100.0 * b);
    }
    let saved = trainer.save(out)?; // whole tensors, loadable in one process
    if dist.is_main() {
        let (calls, bytes) = mesh.tp().traffic();
        println!(
            "{mesh:?}: {} steps; tensor-parallel all-reduces {calls} ({:.2} MB); checkpoint {}",
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
