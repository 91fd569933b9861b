//! `kolo plan`: the parallelism planner's search, printed as a table of the best plans.

use kolo_plan::{estimate, parse_quantity, search, Cluster, Estimate, Gpt, Plan, Space};

#[derive(clap::Args)]
pub struct PlanArgs {
    /// The model family (only `gpt`).
    #[arg(long, default_value = "gpt")]
    model: String,
    /// Parameters, e.g. 1.3B or 125M: picks the GPT-3 family shape nearest to it (2048-token
    /// context, 50,257-token vocabulary). Or give the shape with --layers/--d-model/...
    #[arg(long)]
    params: Option<String>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    d_model: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    seq: Option<usize>,
    #[arg(long)]
    vocab: Option<usize>,
    /// Devices in the job.
    #[arg(long)]
    devices: usize,
    /// Memory per device, e.g. 80GiB.
    #[arg(long, default_value = "80GiB")]
    device_memory: String,
    /// Link bandwidth per device, e.g. 100Gbps (bits/s) or 12.5GB (bytes/s).
    #[arg(long, default_value = "100Gbps")]
    bandwidth: String,
    /// Latency per message, microseconds.
    #[arg(long, default_value_t = 5.0)]
    latency_us: f64,
    /// Achieved compute per device, e.g. 150TFLOPS.
    #[arg(long, default_value = "150TFLOPS")]
    flops: String,
    /// Sequences per training step.
    #[arg(long, default_value_t = 512)]
    global_batch: usize,
    /// Activation precision: bf16 or f32.
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// Use Kolo-on-CPU's measured runtime constants (activation factor 1.8, gradient-hook copies).
    #[arg(long)]
    kolo_cpu: bool,
    /// Plans to print.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Cost one plan instead of searching: dp=2,tp=1,pp=1,zero=0,micro=8[,ckpt].
    #[arg(long)]
    evaluate: Option<String>,
}

fn bandwidth_bytes(s: &str) -> anyhow::Result<f64> {
    let v = parse_quantity(s).map_err(anyhow::Error::msg)?;
    Ok(if s.trim_end().ends_with("bps") { v / 8.0 } else { v })
}

fn parse_plan(s: &str) -> anyhow::Result<Plan> {
    let mut p = Plan { dp: 1, tp: 1, pp: 1, zero: 0, micro_batch: 1, checkpoint: false };
    for part in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        if part == "ckpt" {
            p.checkpoint = true;
            continue;
        }
        let (k, v) = part.split_once('=').ok_or_else(|| anyhow::anyhow!("--evaluate: `{part}` is not key=value"))?;
        let n: usize = v.parse().map_err(|_| anyhow::anyhow!("--evaluate: `{v}` is not a number"))?;
        match k {
            "dp" => p.dp = n,
            "tp" => p.tp = n,
            "pp" => p.pp = n,
            "zero" => p.zero = n as u8,
            "micro" => p.micro_batch = n,
            _ => anyhow::bail!("--evaluate: unknown key `{k}` (dp, tp, pp, zero, micro, ckpt)"),
        }
    }
    Ok(p)
}

fn row(i: usize, p: &Plan, e: &Estimate) -> String {
    let gib = |b: f64| b / 1024f64.powi(3);
    format!(
        "{i:>3}  dp {:>3} tp {:>2} pp {:>2}  ZeRO-{}  micro {:>3} x {:>3}{}  {:>9.4} s  (compute {:.4} + bubble {:.4} + tp {:.4} + pp {:.4} + dp {:.4})  memory {:>8.3} GiB (states {:.3} + activations {:.3})",
        p.dp,
        p.tp,
        p.pp,
        p.zero,
        p.micro_batch,
        e.micro_batches,
        if p.checkpoint { " ckpt" } else { "     " },
        e.step_s,
        e.compute_s,
        e.bubble_s,
        e.tp_s,
        e.pp_s,
        e.dp_exposed_s,
        gib(e.memory()),
        gib(e.states),
        gib(e.activations)
    )
}

pub fn run(a: PlanArgs) -> anyhow::Result<i32> {
    if a.model != "gpt" {
        anyhow::bail!("kolo plan models GPTs (--model gpt)");
    }
    let mut m = match &a.params {
        Some(p) => Gpt::with_params(parse_quantity(p).map_err(anyhow::Error::msg)?),
        None => Gpt { layers: 12, d_model: 768, heads: 12, seq: 1024, vocab: 50257 },
    };
    m.layers = a.layers.unwrap_or(m.layers);
    m.d_model = a.d_model.unwrap_or(m.d_model);
    m.heads = a.heads.unwrap_or(m.heads);
    m.seq = a.seq.unwrap_or(m.seq);
    m.vocab = a.vocab.unwrap_or(m.vocab);
    let value_bytes = match a.precision.as_str() {
        "bf16" | "f16" => 2.0,
        "f32" => 4.0,
        p => anyhow::bail!("--precision {p}: bf16, f16 or f32"),
    };
    let (activation_factor, param_copy_bytes) =
        if a.kolo_cpu { (Cluster::KOLO_CPU_ACTIVATIONS, Cluster::KOLO_PARAM_COPY) } else { (1.0, 0.0) };
    let c = Cluster {
        devices: a.devices,
        memory: parse_quantity(&a.device_memory).map_err(anyhow::Error::msg)?,
        flops: parse_quantity(&a.flops).map_err(anyhow::Error::msg)?,
        bandwidth: bandwidth_bytes(&a.bandwidth)?,
        latency: a.latency_us * 1e-6,
        activation_factor,
        param_copy_bytes,
    };
    println!(
        "GPT: {} layers, d_model {}, {} heads, seq {}, vocab {} = {:.3} B parameters; {} devices of {:.1} GiB, {:.0} TFLOP/s, {:.2} GB/s, {} us; {} sequences per step",
        m.layers,
        m.d_model,
        m.heads,
        m.seq,
        m.vocab,
        m.params() / 1e9,
        c.devices,
        c.memory / 1024f64.powi(3),
        c.flops / 1e12,
        c.bandwidth / 1e9,
        a.latency_us,
        a.global_batch
    );
    if let Some(spec) = &a.evaluate {
        let p = parse_plan(spec)?;
        match estimate(&m, &c, &p, a.global_batch, value_bytes) {
            Some(e) => {
                println!("{}", row(1, &p, &e));
                if e.memory() > c.memory {
                    println!("     does not fit: {:.2} GiB > {:.2} GiB", e.memory() / 1024f64.powi(3), c.memory / 1024f64.powi(3));
                }
                return Ok(0);
            }
            None => anyhow::bail!(
                "{spec}: not a plan for {} devices (dp x tp x pp must equal them, tp divide the heads, micro divide the batch per replica)",
                c.devices
            ),
        }
    }
    let plans = search(&m, &c, a.global_batch, value_bytes, &Space::default());
    if plans.is_empty() {
        println!("no plan fits in {:.1} GiB per device", c.memory / 1024f64.powi(3));
        return Ok(1);
    }
    println!("{} plans fit; the fastest:", plans.len());
    for (i, (p, e)) in plans.iter().take(a.top).enumerate() {
        println!("{}", row(i + 1, p, e));
    }
    Ok(0)
}
