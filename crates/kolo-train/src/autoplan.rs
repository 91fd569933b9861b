//! `kolo train --plan auto`: the planner's cost model (kolo-plan) picks the mesh, ZeRO stage,
//! micro-batches and activation checkpointing for this world size among the combinations Kolo
//! runs, and rewrites the config accordingly.

use crate::config::{Config, MeshConfig, ModelKind, PipeSchedule, PipelineConfig};
use crate::TrainError;
use kolo_plan::{search, Cluster, Estimate, Gpt, Plan, Precision, Recompute, Schedule, Space};

/// This machine's CPU as the planner sees it, measured now (about a second) by the kernels a
/// rank runs: candle's f32 matrix product of n x n x n at n = 64 ... 512 (each rate's best of
/// three 50 ms runs; the peak is the best rate, the efficiency curve each size's share of it) and
/// `a + b` over 32 MB as the memory-bound operations' bandwidth, Kolo's AdamW step over 4 Mi
/// parameters as the optimizer's. The `this-machine` preset's
/// figures (another machine's, 2026-11-24) are only the fallback. With several ranks on the
/// machine, run it on every rank at once (they share the cores as training will) and average.
pub fn measure_device() -> Result<kolo_plan::Device, TrainError> {
    use candle_core::{Device, Tensor};
    let te = |e: candle_core::Error| TrainError::Config(format!("measuring this machine: {e}"));
    let best = |f: &dyn Fn() -> candle_core::Result<()>| -> candle_core::Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let (t, mut reps) = (std::time::Instant::now(), 0u32);
            while reps == 0 || t.elapsed().as_secs_f64() < 0.05 {
                f()?;
                reps += 1;
            }
            best = best.min(t.elapsed().as_secs_f64() / f64::from(reps));
        }
        Ok(best)
    };
    let mut rates = Vec::new();
    for n in [64usize, 128, 256, 512] {
        let a = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu).map_err(te)?;
        let b = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu).map_err(te)?;
        let s = best(&|| a.matmul(&b).map(|_| ())).map_err(te)?;
        rates.push((n as f64, 2.0 * (n as f64).powi(3) / s));
    }
    let len = 8usize << 20;
    let a = Tensor::randn(0f32, 1.0, (len / 1024, 1024), &Device::Cpu).map_err(te)?;
    let s = best(&|| (&a + &a).map(|_| ())).map_err(te)?;
    // Kolo's AdamW over 4 Mi parameters in place (its optimizer's step).
    let n = 4usize << 20;
    let opt = std::sync::Mutex::new(kolo_optim::Optimizer::new(kolo_optim::OptimizerSpec::adamw(0.1), n));
    let (p, g) = (std::sync::Mutex::new(vec![0.5f32; n]), vec![1e-3f32; n]);
    let step = || -> candle_core::Result<()> {
        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
        opt.lock().unwrap_or_else(|e| e.into_inner()).step(&mut p, &g, 1e-4);
        Ok(())
    };
    let update = best(&step).map_err(te)?;
    let peak = rates.iter().map(|r| r.1).fold(0.0, f64::max);
    let mut d = Cluster::preset("this-machine", 1).map_err(TrainError::Config)?.device;
    if !(peak.is_finite() && peak > 0.0 && s > 0.0 && update > 0.0) {
        return Ok(d);
    }
    d.name = "CPU (measured at start, candle f32)".into();
    (d.peak_f32, d.peak_16, d.mem_bandwidth) = (peak, peak, 12.0 * len as f64 / s);
    d.update_bandwidth = kolo_plan::optimizer_bytes(kolo_plan::Precision::F32) * n as f64 / update;
    d.gemm_efficiency = rates.iter().map(|&(n, r)| (n, r / peak)).collect();
    // Beyond the largest size measured the rate stays the peak.
    d.gemm_efficiency.push((4096.0, 1.0));
    Ok(d)
}

/// Chooses a plan for `world` ranks of `memory` bytes each on this machine (its CPU as `device`
/// describes it, [`measure_device`]) and writes it into `cfg`; returns a line describing it. The
/// global batch stays data.batch_size x world.
pub fn apply_plan(cfg: &mut Config, world: usize, memory: f64, device: &kolo_plan::Device) -> Result<String, TrainError> {
    if cfg.model.kind != ModelKind::Gpt || cfg.model.experts.is_some() || cfg.mesh.is_some() || cfg.pipeline.is_some() {
        return Ok(format!(
            "plan auto: data parallelism on {world} ranks (the planner plans dense GPTs without a [mesh] or [pipeline] of their own)"
        ));
    }
    let md = &cfg.model;
    let m =
        Gpt::gpt_style(md.n_layer.unwrap_or(4), md.d_model.unwrap_or(256), md.n_head.unwrap_or(4), md.seq.unwrap_or(128), text_vocab(cfg));
    // This machine (the `this-machine` preset's links and runtime constants, the CPU as
    // measured), the world's ranks on one host over loopback.
    let mut c = Cluster::preset("this-machine", 1).map_err(TrainError::Config)?;
    c.device = device.clone();
    (c.devices_per_node, c.device.memory) = (world, memory);
    c.cores_per_node = std::thread::available_parallelism().map_or(1, |n| n.get());
    let global = cfg.data.batch_size * world;
    let Some((p, e)) = runnable_plans(&m, &c, global, Precision::F32).into_iter().next() else {
        return Err(TrainError::Config(format!(
            "plan auto: no plan for this GPT fits in {:.2} GiB per rank on {world} ranks",
            memory / 1024f64.powi(3)
        )));
    };
    apply(cfg, &p, &e, global, m.layers)?;
    let accumulates = p.pp == 1 && p.micro_batch * p.dp < global;
    Ok(format!(
        "plan auto: dp {} x tp {} x pp {}, ZeRO-{}, {} sequences per replica{}{}{}, vocabulary {}; predicted {:.1} ms/step, {:.1} MB per rank (of {:.1} MB) on {} GFLOP/s per rank at its best, {:.1} GB/s",
        p.dp,
        p.tp,
        p.pp,
        p.zero,
        global / p.dp,
        if p.pp > 1 { format!(" in {} micro-batches", e.micro_batches) } else { String::new() },
        if accumulates { format!(" ({} accumulated micro-batches of {})", e.micro_batches, p.micro_batch) } else { String::new() },
        if p.recompute == Recompute::Full { ", activation checkpointing" } else { "" },
        m.vocab,
        e.step_s * 1e3,
        e.memory() / 1e6,
        memory / 1e6,
        (c.device.peak_f32 / 1e9).round(),
        c.device.mem_bandwidth / 1e9
    ))
}

/// The vocabulary the GPT will have: the distinct bytes of its text (the character vocabulary
/// the text data builds), or 256 when the text cannot be read here.
fn text_vocab(cfg: &Config) -> usize {
    let text = (cfg.data.kind == crate::config::DataKind::Text).then_some(cfg.data.path.as_ref()).flatten();
    text.and_then(|p| std::fs::read(p).ok()).map_or(256, |t| crate::data::CharVocab::from_text(&t).len().max(1))
}

/// The plans the planner's search finds for `m` on `c` that Kolo's GPT can run and its cost
/// model was checked against on runs it was not fitted to, fastest first: ZeRO-1/2 beside
/// tensor or pipeline parallelism (not both at once; within 10 % of time and 19 % of memory on
/// 4 ranks, docs/benchmarks.md session 38), activation checkpointing (full, not selective
/// recomputation) beside tensor or pipeline parallelism, not both (memory within 15 %,
/// session 39), ZeRO-3 with every block checkpointed and without gradient accumulation, alone
/// or beside tensor or pipeline parallelism, not both (within 22 % of time and 17 % of memory
/// on 4 ranks, session 40), no more stages than layers.
pub fn runnable_plans(m: &Gpt, c: &Cluster, global: usize, precision: Precision) -> Vec<(Plan, Estimate)> {
    let space = Space {
        zero_with_model_parallel: true,
        recompute: vec![Recompute::None, Recompute::Full],
        schedules: vec![Schedule::OneFOneB],
        seq_parallel: vec![false],
        ep: vec![1],
        cp: vec![1],
        ..Space::default()
    };
    let checkpoint = |p: &Plan| p.recompute == Recompute::Full;
    let accumulates = |p: &Plan| p.pp == 1 && p.micro_batch * p.dp < global;
    search(m, c, global, precision, &space)
        .into_iter()
        .filter(|(p, _)| {
            let beside_tp_and_pp = (p.zero > 0 || checkpoint(p)) && p.tp > 1 && p.pp > 1;
            !beside_tp_and_pp && (p.zero != 3 || (checkpoint(p) && !accumulates(p))) && p.pp <= m.layers
        })
        .collect()
}

/// Writes plan `p` (estimated as `e`, for a global batch of `global` sequences of a GPT of
/// `layers` blocks) into `cfg`: batch per replica or accumulated micro-batches, ZeRO stage,
/// `[mesh]`, `[pipeline]` (1F1B) and activation checkpointing; the result is checked.
pub fn apply(cfg: &mut Config, p: &Plan, e: &Estimate, global: usize, layers: usize) -> Result<(), TrainError> {
    let accumulates = |p: &Plan| p.pp == 1 && p.micro_batch * p.dp < global;
    cfg.data.batch_size = global / p.dp;
    if accumulates(p) {
        cfg.data.batch_size = p.micro_batch;
        cfg.train.grad_accum = e.micro_batches as u64;
    }
    cfg.ddp.zero_stage = p.zero;
    if p.tp * p.pp > 1 {
        cfg.mesh = Some(MeshConfig { tp: p.tp, pp: Some(p.pp), dp: Some(p.dp), sp: 1, ep: 1 });
    }
    if p.seq_parallel {
        return Err(TrainError::Config(
            "Megatron sequence parallelism: Kolo's tensor parallelism keeps the norms' activations whole".into(),
        ));
    }
    if p.ep > 1 {
        return Err(TrainError::Config(format!("expert parallelism (ep {}): Kolo's built-in GPT here has no experts to deal out", p.ep)));
    }
    if p.cp > 1 {
        return Err(TrainError::Config(format!(
            "context parallelism (cp {}): Kolo's GPT runs ring attention as its own strategy ([mesh] sp), not beside this plan's",
            p.cp
        )));
    }
    if p.pp > 1 {
        let schedule = match p.schedule {
            Schedule::OneFOneB => PipeSchedule::OneFOneB,
            Schedule::TwoBw => PipeSchedule::TwoBw,
            Schedule::Interleaved(v) => {
                return Err(TrainError::Config(format!(
                    "the interleaved schedule ({v} chunks a rank): Kolo's pipeline runs gpipe, 1f1b or 2bw"
                )))
            }
        };
        cfg.pipeline = Some(PipelineConfig { micro_batches: e.micro_batches, schedule, rematerialize: false });
    }
    match p.recompute {
        Recompute::Full => cfg.model.checkpoint_blocks = (0..layers).collect(),
        Recompute::Selective => {
            return Err(TrainError::Config(
                "selective recomputation: Kolo's GPT recomputes whole blocks (checkpoint_blocks) or nothing".into(),
            ))
        }
        _ => {}
    }
    cfg.check()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset() -> kolo_plan::Device {
        Cluster::preset("this-machine", 1).unwrap().device
    }

    /// The measured CPU: a peak between 1 GFLOP/s and 10 TFLOP/s (a core of any CPU of the
    /// last decade, with all its threads), an efficiency curve ascending in size within (0, 1]
    /// reaching 1, and memory-bound and optimizer rates between 0.1 and 1000 GB/s.
    #[test]
    fn this_machine_is_measured() {
        let d = measure_device().unwrap();
        assert!(d.name.contains("measured"), "{}", d.name);
        assert!(d.peak_f32 > 1e9 && d.peak_f32 < 1e13, "{}", d.peak_f32);
        assert!(d.mem_bandwidth > 1e8 && d.mem_bandwidth < 1e12, "{}", d.mem_bandwidth);
        assert!(d.update_bandwidth > 1e8 && d.update_bandwidth < 1e12, "{}", d.update_bandwidth);
        assert!(d.update_bandwidth != Cluster::preset("this-machine", 1).unwrap().device.update_bandwidth, "the preset's, not measured");
        assert!(d.gemm_efficiency.windows(2).all(|w| w[0].0 < w[1].0));
        assert!(d.gemm_efficiency.iter().all(|&(_, e)| e > 0.0 && e <= 1.0) && d.gemm_efficiency.iter().any(|&(_, e)| e == 1.0));
    }

    fn gpt() -> Config {
        Config::parse(
            "[model]\nkind = \"gpt\"\nseq = 128\nd_model = 256\nn_head = 4\nn_layer = 4\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n",
            "t",
        )
        .unwrap()
    }

    /// On 4 ranks `--plan auto` may shard (ZeRO-1/2/3) and checkpoint beside tensor or pipeline
    /// parallelism, never beside both; ZeRO-3 only with every block checkpointed.
    #[test]
    fn auto_plans_shard_beside_model_parallelism() {
        let m = Gpt::gpt_style(4, 256, 4, 128, 65);
        let mut c = Cluster::preset("this-machine", 1).unwrap();
        (c.devices_per_node, c.device.memory) = (4, 4e9);
        let plans = runnable_plans(&m, &c, 16, Precision::F32);
        let has = |f: &dyn Fn(&Plan) -> bool| plans.iter().any(|(p, _)| f(p));
        assert!(has(&|p| p.zero > 0 && p.pp > 1) && has(&|p| p.zero > 0 && p.tp > 1), "ZeRO beside tp and pp");
        assert!(!has(&|p| (p.zero > 0 || p.recompute == Recompute::Full) && p.tp > 1 && p.pp > 1));
        assert!(has(&|p| p.zero == 3 && p.pp > 1) && has(&|p| p.zero == 3 && p.tp > 1), "ZeRO-3 beside tp and pp");
        assert!(!has(&|p| p.zero == 3 && p.recompute != Recompute::Full));
        let ck = |p: &Plan| p.recompute == Recompute::Full;
        assert!(has(&|p| ck(p) && p.tp > 1) && has(&|p| ck(p) && p.pp > 1), "checkpointing beside tp and beside pp");
        assert!(has(&|p| p.zero == 3) && has(&|p| p.recompute == Recompute::Full), "both still beside plain data parallelism");
        // Each is a config kolo train accepts.
        for (p, e) in plans.iter().filter(|(p, _)| (p.zero > 0 || p.recompute == Recompute::Full) && p.tp * p.pp > 1) {
            apply(&mut gpt(), p, e, 16, m.layers).unwrap_or_else(|e| panic!("{p:?}: {e}"));
        }
    }

    /// Plenty of memory: plain DDP. Tight memory: smaller micro-batches accumulated, model states
    /// sharded (ZeRO) or the model split; the
    /// rewritten config is valid and keeps the global batch. Too little: a clear error.
    #[test]
    fn auto_plans_follow_the_memory() {
        let mut c = gpt();
        let line = apply_plan(&mut c, 2, 2e9, &preset()).unwrap();
        assert_eq!((c.ddp.zero_stage, c.data.batch_size * c.train.grad_accum as usize), (0, 8), "{line}");
        assert!(c.mesh.is_none() && line.contains("dp 2 x tp 1 x pp 1"));
        let mut c = gpt();
        let line = apply_plan(&mut c, 2, 90e6, &preset()).unwrap();
        assert!(
            c.ddp.zero_stage > 0 || c.mesh.is_some() || c.train.grad_accum > 1,
            "90 MB cannot hold DDP at 8 sequences per rank (~225 MB): {line}"
        );
        let (dp, tp, pp) = c.mesh.as_ref().map_or((2, 1, 1), |m| (m.dp.unwrap(), m.tp, m.pp.unwrap()));
        assert_eq!(c.data.batch_size * dp * c.train.grad_accum as usize, 16, "the global batch stays 16: {line}");
        assert_eq!(dp * tp * pp, 2);
        assert!(apply_plan(&mut gpt(), 2, 1e6, &preset()).unwrap_err().to_string().contains("no plan"));
        // A text GPT is planned with its corpus's vocabulary (the shipped one: 65 characters).
        let corpus = format!("{}/../../data/tinyshakespeare.txt", env!("CARGO_MANIFEST_DIR"));
        let mut text = Config::parse(
            &format!("[model]\nkind = \"gpt\"\nseq = 128\nd_model = 256\nn_head = 4\nn_layer = 4\n[data]\nkind = \"text\"\npath = {corpus:?}\nbatch_size = 8\n"),
            "t",
        )
        .unwrap();
        assert!(apply_plan(&mut text, 2, 2e9, &preset()).unwrap().contains(", vocabulary 65;"));
        assert!(apply_plan(&mut gpt(), 2, 2e9, &preset()).unwrap().contains(", vocabulary 256;"));
        let mut mlp = Config::parse("[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 8\n", "t").unwrap();
        assert!(apply_plan(&mut mlp, 2, 1e9, &preset()).unwrap().contains("data parallelism"));
    }
}
