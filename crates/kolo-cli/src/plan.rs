//! `kolo plan`: the parallelism planner's search, printed as a table of the best plans.

use kolo_plan::{
    estimate, parse_quantity, search, Cluster, Device, Estimate, Gpt, Link, Plan, Precision, Recompute, Schedule, Space, PRESETS,
};

#[derive(clap::Args)]
pub struct PlanArgs {
    /// The model family (only `gpt`: a decoder-only transformer, GPT-, Llama- or
    /// Mixtral-style by the shape flags or --hf).
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
    /// Plan the model of a Hugging Face directory: its config.json (GPT-2, GPT-NeoX, the Llama
    /// family, Mixtral's and Qwen3-MoE's experts, Gemma 3's text model beside its vision
    /// tower) gives the shape; --seq defaults to its
    /// max_position_embeddings, at most 4096. The shape flags override it.
    #[arg(long, value_name = "DIR", conflicts_with = "params")]
    hf: Option<std::path::PathBuf>,
    /// Key/value heads (grouped-query attention; default: --heads).
    #[arg(long)]
    kv_heads: Option<usize>,
    /// Width of a head (default d_model / heads).
    #[arg(long)]
    head_dim: Option<usize>,
    /// Width of the MLP, of each expert's with --experts (default 4 d_model).
    #[arg(long)]
    ffn: Option<usize>,
    /// A Llama-style block: a gated MLP (SwiGLU), RMS norms, no biases, rotary positions.
    #[arg(long)]
    gated: bool,
    /// The output layer is the token embedding.
    #[arg(long)]
    tied: bool,
    /// Experts per MLP (a mixture of experts; 1: dense), each token through --top-k of them.
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long)]
    top_k: Option<usize>,
    /// Devices in the job (whole nodes of the cluster, or part of one node).
    #[arg(long, required_unless_present_any = ["show_cluster", "nodes"], conflicts_with = "nodes")]
    devices: Option<usize>,
    /// Nodes in the job, each with the cluster's devices per node (instead of --devices).
    #[arg(long)]
    nodes: Option<usize>,
    /// The cluster: a preset (dgx-a100, dgx-h100, dgx-h200, this-machine), `measured` (this machine with
    /// its CPU measured now, about a second: one rank's threads) or a TOML file describing one
    /// (print a preset with --show-cluster to start from).
    #[arg(long, default_value = "dgx-a100")]
    cluster: String,
    /// Override the devices per node.
    #[arg(long)]
    devices_per_node: Option<usize>,
    /// Override the memory per device, e.g. 40GiB.
    #[arg(long)]
    device_memory: Option<String>,
    /// Override the intra-node bus bandwidth per device, e.g. 300GB (bytes/s) or 2400Gbps.
    #[arg(long)]
    intra_bandwidth: Option<String>,
    /// Override the inter-node bandwidth per device, e.g. 200Gbps.
    #[arg(long)]
    inter_bandwidth: Option<String>,
    /// Cost the data-parallel reduction after backward instead of overlapped with it
    /// (Megatron-LM 2021 did not overlap it).
    #[arg(long)]
    no_overlap_dp: bool,
    /// Whether the runtime's attention is fused, flash-style (its s x s scores never in memory,
    /// computed again in backward): the cluster's setting by default (the H100 and H200 presets
    /// yes, dgx-a100 and this machine no).
    #[arg(long, value_name = "BOOL")]
    fused_attention: Option<bool>,
    /// Recomputation the search may choose, comma-separated: none, selective (attention's core),
    /// full (activation checkpointing). Default: all three (selective only without fused attention).
    #[arg(long, value_delimiter = ',', default_value = "none,selective,full")]
    recompute: Vec<String>,
    /// ZeRO stages the search may choose, comma-separated (0: plain data parallelism).
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,3")]
    zero: Vec<u8>,
    /// Micro-batch sizes (sequences) the search may choose, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    micro: Vec<usize>,
    /// Pipeline schedules the search may choose, comma-separated: 1f1b, interleaved:V (V model
    /// chunks a device), 2bw (PipeDream-2BW: no bubble, weights one update stale; only when
    /// asked for).
    #[arg(long, value_delimiter = ',', default_value = "1f1b,interleaved:2,interleaved:4")]
    schedule: Vec<String>,
    /// Megatron sequence parallelism with tensor parallelism, comma-separated: false, true.
    #[arg(long, value_delimiter = ',', default_value = "false,true")]
    seq_parallel: Vec<bool>,
    /// Expert-parallel degrees the search may choose for a model with experts, comma-separated
    /// (each must divide the experts and dp: the experts are dealt out over ep of the dp replicas).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    ep: Vec<usize>,
    /// Context-parallel degrees (ring attention: each sequence split over cp ranks; Kolo's
    /// `[mesh] sp`), comma-separated; each must divide --seq.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    cp: Vec<usize>,
    /// Sequences per step given as tokens instead (divided by --seq; it must divide).
    #[arg(long, conflicts_with = "global_batch")]
    global_batch_tokens: Option<String>,
    /// Print the cluster description as TOML (a file for --cluster) and exit.
    #[arg(long)]
    show_cluster: bool,
    /// Sequences per training step.
    #[arg(long, default_value_t = 512)]
    global_batch: usize,
    /// bf16/f16 (mixed precision: 2-byte values, f32 master weights and Adam, the bf16 peak),
    /// fp8 (the matrix products at the device's FP8 peak, the rest as bf16; H100/H200) or f32
    /// (Kolo's default).
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// Plans to print.
    #[arg(long, default_value_t = 8)]
    top: usize,
    /// Cost one plan instead of searching: dp=2,tp=1,pp=1,zero=0,micro=8[,recompute=none|selective|full]
    /// [,schedule=1f1b|interleaved:V|2bw][,ep=E][,cp=C][,sp] (`ckpt` for recompute=full, `sp`
    /// for Megatron sequence parallelism; ep: the experts over E of the dp replicas; cp: each
    /// sequence over C ranks, dp x tp x pp x cp devices).
    #[arg(long)]
    evaluate: Option<String>,
    /// Write the plan as a job to run: DIR/train.toml (a `kolo train` config of Kolo's GPT, or
    /// with --hf the model's fine-tuning job, with the plan's [mesh], [pipeline], ZeRO stage,
    /// batch and activation checkpointing),
    /// DIR/launch.sh (`kolo launch` on one node: NODE_RANK, MASTER_ADDR, MASTER_PORT and
    /// KOLO_TOKEN_FILE from the environment) and DIR/job.sbatch (Slurm: every node at once).
    /// The fastest plan the job runs, or the --evaluate one.
    #[arg(long, value_name = "DIR")]
    emit: Option<std::path::PathBuf>,
    /// With --emit: the training text the config names (with --hf: a text, or a directory of
    /// token shards from `kolo data prepare --tokenizer DIR`).
    #[arg(long, default_value = "data/tinyshakespeare.txt")]
    data: String,
    /// With --emit: optimizer steps the config runs.
    #[arg(long, default_value_t = 1000)]
    steps: u64,
}

fn bandwidth_bytes(s: &str) -> anyhow::Result<f64> {
    let v = parse_quantity(s).map_err(anyhow::Error::msg)?;
    Ok(if s.trim_end().ends_with("bps") { v / 8.0 } else { v })
}

fn parse_plan(s: &str) -> anyhow::Result<Plan> {
    let mut p = Plan::new(1, 1, 1, 0, 1);
    for part in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
        match part {
            "ckpt" => p.recompute = Recompute::Full,
            "sp" => p.seq_parallel = true,
            _ => {}
        }
        if part == "ckpt" || part == "sp" {
            continue;
        }
        let (k, v) = part.split_once('=').ok_or_else(|| anyhow::anyhow!("--evaluate: `{part}` is not key=value"))?;
        if k == "recompute" {
            p.recompute = Recompute::parse(v).map_err(|e| anyhow::anyhow!("--evaluate: {e}"))?;
            continue;
        }
        if k == "schedule" {
            p.schedule = Schedule::parse(v).map_err(|e| anyhow::anyhow!("--evaluate: {e}"))?;
            continue;
        }
        let n: usize = v.parse().map_err(|_| anyhow::anyhow!("--evaluate: `{v}` is not a number"))?;
        match k {
            "dp" => p.dp = n,
            "tp" => p.tp = n,
            "pp" => p.pp = n,
            "zero" => p.zero = n as u8,
            "micro" => p.micro_batch = n,
            "ep" => p.ep = n,
            "cp" => p.cp = n,
            _ => anyhow::bail!("--evaluate: unknown key `{k}` (dp, tp, pp, zero, micro, ep, cp, recompute, schedule, ckpt, sp)"),
        }
    }
    Ok(p)
}

fn row(i: usize, p: &Plan, e: &Estimate) -> String {
    let gib = |b: f64| b / 1024f64.powi(3);
    let m = &e.memory;
    format!(
        "{i:>3}  dp {:>4} tp {:>2} pp {:>2}  ZeRO-{}  micro {:>3} x {:>4}{}{}  {:>9.4} s  {:>7.2} TFLOP/s  MFU {:>5.1}%  (compute {:.4} + bubble {:.4} + tp {:.4} + pp {:.4} + ep {:.4} + cp {:.4} + dp {:.4} + optimizer {:.4})  memory {:>8.3} GiB (params {:.3} + grads {:.3} + optimizer {:.3} + activations {:.3} + runtime {:.3})",
        p.dp,
        p.tp,
        p.pp,
        p.zero,
        p.micro_batch,
        e.micro_batches,
        match p.recompute {
            Recompute::None => "     ",
            Recompute::Selective => " sel ",
            Recompute::Full => " ckpt",
        },
        match (p.schedule, p.seq_parallel, p.ep, p.cp) {
            (Schedule::OneFOneB, false, 1, 1) => String::new(),
            (s, sp, ep, cp) => format!(
                " {}{}{}{}",
                if p.pp > 1 { s.name() } else { String::new() },
                if sp { " sp" } else { "" },
                if ep > 1 { format!(" ep {ep}") } else { String::new() },
                if cp > 1 { format!(" cp {cp}") } else { String::new() }
            ),
        },
        e.step_s,
        e.model_flops_per_device() / 1e12,
        e.mfu() * 100.0,
        e.compute_s,
        e.bubble_s,
        e.tp_s,
        e.pp_s,
        e.ep_s,
        e.cp_s,
        e.dp_exposed_s,
        e.optimizer_s,
        gib(e.memory()),
        gib(m.params),
        gib(m.grads),
        gib(m.optimizer),
        gib(m.activations),
        gib(m.runtime)
    )
}

/// A cluster file: the preset's fields, quantities with their units.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    devices_per_node: usize,
    #[serde(default = "one")]
    activation_factor: f64,
    #[serde(default)]
    param_copy_bytes: f64,
    #[serde(default = "yes")]
    overlap_dp: bool,
    #[serde(default)]
    fused_attention: bool,
    #[serde(default)]
    layer_overhead_us: f64,
    #[serde(default)]
    cores_per_node: usize,
    device: DeviceFile,
    intra: LinkFile,
    inter: LinkFile,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DeviceFile {
    name: String,
    memory: String,
    peak_f32: String,
    peak_16: String,
    /// Peak FP8 FLOP/s, where the device has FP8 tensor cores.
    peak_8: Option<String>,
    mem_bandwidth: String,
    /// Default: mem_bandwidth.
    update_bandwidth: Option<String>,
    gemm_efficiency: Vec<(f64, f64)>,
    /// The best MFU published for this device and where, e.g. [0.563, "Korthikanti et al. 2022"].
    published_mfu: Option<(f64, String)>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LinkFile {
    bandwidth: String,
    latency_us: f64,
}

fn one() -> f64 {
    1.0
}

fn yes() -> bool {
    true
}

fn quantity(what: &str, s: &str) -> anyhow::Result<f64> {
    parse_quantity(s).map_err(|e| anyhow::anyhow!("{what}: {e}"))
}

fn link(what: &str, l: &LinkFile) -> anyhow::Result<Link> {
    let bandwidth = bandwidth_bytes(&l.bandwidth).map_err(|e| anyhow::anyhow!("{what}.bandwidth: {e}"))?;
    if bandwidth <= 0.0 || l.latency_us < 0.0 {
        anyhow::bail!("{what}: bandwidth must be positive and latency_us not negative");
    }
    Ok(Link { bandwidth, latency: l.latency_us * 1e-6 })
}

fn load_cluster(path: &str) -> anyhow::Result<Cluster> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--cluster {path}: {e}"))?;
    let f: ClusterFile = toml::from_str(&text).map_err(|e| anyhow::anyhow!("--cluster {path}: {e}"))?;
    let d = &f.device;
    let pts = &d.gemm_efficiency;
    if pts.is_empty() || pts.windows(2).any(|w| w[0].0 >= w[1].0) || pts.iter().any(|&(n, e)| n < 1.0 || !(e > 0.0 && e <= 1.0)) {
        anyhow::bail!("--cluster {path}: device.gemm_efficiency must be [n, fraction] pairs, n ascending, fractions in (0, 1]");
    }
    if f.devices_per_node == 0 {
        anyhow::bail!("--cluster {path}: devices_per_node must be at least 1");
    }
    if !(f.activation_factor > 0.0 && f.param_copy_bytes >= 0.0 && f.layer_overhead_us >= 0.0) {
        anyhow::bail!("--cluster {path}: activation_factor must be positive, param_copy_bytes and layer_overhead_us not negative");
    }
    Ok(Cluster {
        device: Device {
            name: d.name.clone(),
            memory: quantity("device.memory", &d.memory)?,
            peak_f32: quantity("device.peak_f32", &d.peak_f32)?,
            peak_16: quantity("device.peak_16", &d.peak_16)?,
            peak_8: d.peak_8.as_deref().map(|p| quantity("device.peak_8", p)).transpose()?,
            mem_bandwidth: bandwidth_bytes(&d.mem_bandwidth)?,
            update_bandwidth: bandwidth_bytes(d.update_bandwidth.as_ref().unwrap_or(&d.mem_bandwidth))?,
            gemm_efficiency: pts.clone(),
            published_mfu: d.published_mfu.clone(),
        },
        devices_per_node: f.devices_per_node,
        nodes: 1,
        intra: link("intra", &f.intra)?,
        inter: link("inter", &f.inter)?,
        activation_factor: f.activation_factor,
        param_copy_bytes: f.param_copy_bytes,
        overlap_dp: f.overlap_dp,
        fused_attention: f.fused_attention,
        layer_overhead_s: f.layer_overhead_us * 1e-6,
        cores_per_node: f.cores_per_node,
    })
}

/// `c` as a cluster file.
fn cluster_toml(c: &Cluster) -> String {
    let d = &c.device;
    let pts: Vec<String> = d.gemm_efficiency.iter().map(|(n, e)| format!("[{n}, {e}]")).collect();
    format!(
        "# {} x {} per node\ndevices_per_node = {}\nactivation_factor = {}\nparam_copy_bytes = {}\noverlap_dp = {}\nfused_attention = {}\nlayer_overhead_us = {}\n# compute units the node's devices share (0: each its own)\ncores_per_node = {}\n\n[device]\nname = \"{}\"\nmemory = \"{}GiB\"\npeak_f32 = \"{}GFLOPS\"\npeak_16 = \"{}GFLOPS\"\n{}mem_bandwidth = \"{}GB\"\nupdate_bandwidth = \"{}GB\"\n# (n, fraction of peak) of square n x n x n GEMMs\ngemm_efficiency = [{}]\n{}\n[intra]\nbandwidth = \"{}GB\"\nlatency_us = {}\n\n[inter]\nbandwidth = \"{}GB\"\nlatency_us = {}\n",
        d.name,
        c.devices_per_node,
        c.devices_per_node,
        c.activation_factor,
        c.param_copy_bytes,
        c.overlap_dp,
        c.fused_attention,
        c.layer_overhead_s * 1e6,
        c.cores_per_node,
        d.name,
        d.memory / 1024f64.powi(3),
        d.peak_f32 / 1e9,
        d.peak_16 / 1e9,
        d.peak_8.map_or(String::new(), |p| format!("peak_8 = \"{}GFLOPS\"\n", p / 1e9)),
        d.mem_bandwidth / 1e9,
        d.update_bandwidth / 1e9,
        pts.join(", "),
        d.published_mfu.as_ref().map_or(String::new(), |(m, src)| format!("# the best MFU published on this device\npublished_mfu = [{m}, {src:?}]\n")),
        c.intra.bandwidth / 1e9,
        c.intra.latency * 1e6,
        c.inter.bandwidth / 1e9,
        c.inter.latency * 1e6
    )
}

pub fn run(mut a: PlanArgs) -> anyhow::Result<i32> {
    // A table for the terminal or a pipe: `kolo plan ... | head` ends quietly when the reader
    // stops, as other command-line tools do, instead of panicking on the broken pipe. (Only
    // here: the training commands keep SIGPIPE ignored, so that a dead peer's socket is an
    // error naming it.)
    // SAFETY: setting a signal's disposition to the default before any thread of ours writes.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    if a.model != "gpt" {
        anyhow::bail!("kolo plan models GPTs (--model gpt)");
    }
    let mut c = if a.cluster == "measured" {
        // This machine, its CPU measured now (the preset's links and runtime constants).
        let mut c = Cluster::preset("this-machine", 1).map_err(anyhow::Error::msg)?;
        c.device = kolo_train::autoplan::measure_device()?;
        c.cores_per_node = std::thread::available_parallelism().map_or(1, |n| n.get());
        c
    } else if PRESETS.contains(&a.cluster.as_str()) {
        Cluster::preset(&a.cluster, 1).map_err(anyhow::Error::msg)?
    } else if std::path::Path::new(&a.cluster).exists() {
        load_cluster(&a.cluster)?
    } else {
        anyhow::bail!("--cluster {}: neither a preset ({}, measured) nor a file", a.cluster, PRESETS.join(", "));
    };
    if let Some(n) = a.devices_per_node {
        anyhow::ensure!(n > 0, "--devices-per-node must be at least 1");
        c.devices_per_node = n;
    }
    if let Some(m) = &a.device_memory {
        c.device.memory = quantity("--device-memory", m)?;
    }
    if let Some(b) = &a.intra_bandwidth {
        c.intra.bandwidth = bandwidth_bytes(b)?;
    }
    if let Some(b) = &a.inter_bandwidth {
        c.inter.bandwidth = bandwidth_bytes(b)?;
    }
    c.overlap_dp &= !a.no_overlap_dp;
    c.fused_attention = a.fused_attention.unwrap_or(c.fused_attention);
    if a.show_cluster {
        print!("{}", cluster_toml(&c));
        return Ok(0);
    }
    let devices = match (a.devices, a.nodes) {
        (Some(d), _) => d,
        (None, Some(n)) => n * c.devices_per_node,
        (None, None) => unreachable!("clap requires --devices or --nodes without --show-cluster"),
    };
    if precision_is_fp8(&a.precision) && c.device.peak_8.is_none() {
        anyhow::bail!("--precision fp8: the {} has no FP8 rate (peak_8 in a cluster file gives one)", c.device.name);
    }
    let c = c.with_devices(devices).map_err(|e| anyhow::anyhow!("--devices {devices}: {e}"))?;
    let m = model(&a)?;
    if let Some(t) = &a.global_batch_tokens {
        let tokens = parse_quantity(t).map_err(|e| anyhow::anyhow!("--global-batch-tokens: {e}"))?;
        let sequences = tokens / m.seq as f64;
        if !(sequences >= 1.0 && sequences.fract() == 0.0) {
            anyhow::bail!("--global-batch-tokens {t}: {tokens} tokens are not whole sequences of {}", m.seq);
        }
        a.global_batch = sequences as usize;
    }
    let precision = Precision::parse(&a.precision).map_err(|e| anyhow::anyhow!("--precision: {e}"))?;
    let space = space(&a)?;
    if c.fused_attention && space.recompute == [Recompute::Selective] {
        anyhow::bail!(
            "--recompute selective: this cluster's attention is fused (its scores are never kept), so selective recomputation is none; pin none or full, or pass --fused-attention false"
        );
    }
    println!(
        "{}: {} layers, d_model {}, {} heads ({} key/value) of {}, MLP {}{}{}{}, seq {}, vocab {} = {} parameters ({} active); {} nodes x {} {} ({:.1} GiB, peak {:.1} TFLOP/s in {}), intra-node {:.1} GB/s, inter-node {:.1} GB/s per device; {} sequences per step",
        if m.gated { "Llama-style" } else { "GPT" },
        m.layers,
        m.d_model,
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.ffn,
        if m.gated { " gated" } else { "" },
        if m.experts > 1 { format!(" x {} experts (top {})", m.experts, m.top_k) } else { String::new() },
        if m.tied { ", tied embeddings" } else { "" },
        m.seq,
        m.vocab,
        count(m.params()),
        count(m.active_params()),
        c.nodes,
        c.devices_per_node,
        c.device.name,
        c.device.memory / 1024f64.powi(3),
        c.device.peak(precision) / 1e12,
        a.precision,
        c.intra.bandwidth / 1e9,
        c.inter.bandwidth / 1e9,
        a.global_batch
    );
    let memory = c.device.memory;
    if let Some(dir) = &a.emit {
        let (p, e) = match &a.evaluate {
            Some(spec) => {
                let p = parse_plan(spec)?;
                let e = estimate(&m, &c, &p, a.global_batch, precision)
                    .ok_or_else(|| anyhow::anyhow!("{spec}: not a plan for {} devices", c.devices()))?;
                (p, e)
            }
            None if a.hf.is_some() => {
                let plans = search(&m, &c, a.global_batch, precision, &space);
                match plans.into_iter().find(|(p, _)| hf_refuses(p, a.global_batch).is_none()) {
                    Some(pe) => pe,
                    None => anyhow::bail!("no plan that the fine-tuning job runs fits in {:.1} GiB per device", memory / 1024f64.powi(3)),
                }
            }
            None => match kolo_train::autoplan::runnable_plans(&m, &c, a.global_batch, precision).into_iter().next() {
                Some(pe) => pe,
                None => anyhow::bail!("no plan that Kolo's GPT runs fits in {:.1} GiB per device", memory / 1024f64.powi(3)),
            },
        };
        println!("{}", row(1, &p, &e));
        emit(dir, &a, &m, &c, &p, &e)?;
        println!("wrote {0}/train.toml, {0}/launch.sh and {0}/job.sbatch", dir.display());
        return Ok(0);
    }
    if let Some(spec) = &a.evaluate {
        let p = parse_plan(spec)?;
        match estimate(&m, &c, &p, a.global_batch, precision) {
            Some(e) => {
                println!("{}", row(1, &p, &e));
                if e.memory() > memory {
                    println!("     does not fit: {:.2} GiB > {:.2} GiB", e.memory() / 1024f64.powi(3), memory / 1024f64.powi(3));
                }
                return Ok(0);
            }
            None => anyhow::bail!(
                "{spec}: not a plan for {} devices (dp x tp x pp must equal them, tp divide the heads, micro divide the batch per replica)",
                c.devices()
            ),
        }
    }
    let plans = search(&m, &c, a.global_batch, precision, &space);
    if plans.is_empty() {
        println!("no plan fits in {:.1} GiB per device", memory / 1024f64.powi(3));
        return Ok(1);
    }
    println!("{} plans fit; the fastest:", plans.len());
    for (i, (p, e)) in plans.iter().take(a.top).enumerate() {
        println!("{}", row(i + 1, p, e));
    }
    if let (Some((best, source)), Some((_, e))) = (&c.device.published_mfu, plans.first()) {
        // (The published figures are bf16 ones; an fp8 plan's MFU is over the FP8 peak.)
        if e.mfu() > *best && precision != Precision::Fp8 {
            println!(
                "note: the fastest plan's predicted MFU, {:.1} %, is above the best published on this device, {:.1} % ({source}). The model costs the GEMMs at the device's efficiency curve, memory traffic and communication, and was within 2-11 % of Megatron-LM's runs with full recomputation; kernels and overheads it does not see (fused-kernel gaps, stragglers, the optimizer's launches) have kept published runs lower: take the published figure as the nearer bound.",
                e.mfu() * 100.0,
                best * 100.0
            );
        }
    }
    Ok(0)
}

fn precision_is_fp8(p: &str) -> bool {
    p == "fp8"
}

/// The plans `--recompute`, `--zero` and `--micro` let the search choose.
fn space(a: &PlanArgs) -> anyhow::Result<Space> {
    let recompute = a.recompute.iter().map(|r| Recompute::parse(r.trim())).collect::<Result<Vec<_>, _>>();
    let recompute = recompute.map_err(|e| anyhow::anyhow!("--recompute: {e}"))?;
    let schedules = a.schedule.iter().map(|s| Schedule::parse(s.trim())).collect::<Result<Vec<_>, _>>();
    let schedules = schedules.map_err(|e| anyhow::anyhow!("--schedule: {e}"))?;
    if let Some(z) = a.zero.iter().find(|z| **z > 3) {
        anyhow::bail!("--zero: stage {z} (0, 1, 2 or 3)");
    }
    if a.micro.contains(&0) {
        anyhow::bail!("--micro: a micro-batch of 0 sequences");
    }
    Ok(Space {
        zero_stages: a.zero.clone(),
        micro_batches: a.micro.clone(),
        recompute,
        schedules,
        seq_parallel: a.seq_parallel.clone(),
        ep: a.ep.clone(),
        cp: a.cp.clone(),
        ..Space::default()
    })
}

/// A parameter count as people write it: 1.3149 B, 124.440 M, 98304.
fn count(x: f64) -> String {
    match x {
        x if x >= 1e9 => format!("{:.4} B", x / 1e9),
        x if x >= 1e6 => format!("{:.3} M", x / 1e6),
        x => format!("{x:.0}"),
    }
}

/// The model to plan: a GPT-3 family shape by `--params`, a Hugging Face directory's by `--hf`,
/// or GPT-2 small's; then the shape flags.
fn model(a: &PlanArgs) -> anyhow::Result<Gpt> {
    let mut m = match (&a.params, &a.hf) {
        (Some(p), _) => Gpt::with_params(parse_quantity(p).map_err(anyhow::Error::msg)?),
        (None, Some(dir)) => hf_model(dir, a.seq)?,
        (None, None) => Gpt::gpt_style(12, 768, 12, 1024, 50257),
    };
    if a.hf.is_none() && (a.layers.is_some() || a.d_model.is_some() || a.heads.is_some()) {
        // A GPT-style shape of the given sizes: its head width, key/value heads and MLP follow.
        m = Gpt {
            tied: m.tied,
            ..Gpt::gpt_style(a.layers.unwrap_or(m.layers), a.d_model.unwrap_or(m.d_model), a.heads.unwrap_or(m.heads), m.seq, m.vocab)
        };
    }
    m.layers = a.layers.unwrap_or(m.layers);
    m.d_model = a.d_model.unwrap_or(m.d_model);
    m.heads = a.heads.unwrap_or(m.heads);
    m.seq = a.seq.unwrap_or(m.seq);
    m.vocab = a.vocab.unwrap_or(m.vocab);
    m.kv_heads = a.kv_heads.unwrap_or(m.kv_heads);
    m.head_dim = a.head_dim.unwrap_or(m.head_dim);
    m.ffn = a.ffn.unwrap_or(m.ffn);
    m.experts = a.experts.unwrap_or(m.experts);
    m.top_k = a.top_k.unwrap_or(if a.experts.is_some() { 2.min(m.experts) } else { m.top_k });
    if a.gated {
        (m.gated, m.learned_positions) = (true, false);
    }
    m.tied |= a.tied;
    let ok = m.layers > 0 && m.d_model > 0 && m.heads > 0 && m.kv_heads > 0 && m.heads.is_multiple_of(m.kv_heads);
    anyhow::ensure!(
        ok && m.head_dim > 0 && m.ffn > 0 && m.experts > 0 && (1..=m.experts).contains(&m.top_k),
        "the model's shape: {} heads over {} key/value heads, head width {}, MLP {}, top {} of {} experts (each positive, the heads a multiple of the key/value heads, top-k at most the experts)",
        m.heads,
        m.kv_heads,
        m.head_dim,
        m.ffn,
        m.top_k,
        m.experts
    );
    Ok(m)
}

/// The shape of the Hugging Face model whose `config.json` is in `dir`, at `seq` tokens (default
/// its context, at most 4096).
fn hf_model(dir: &std::path::Path, seq: Option<usize>) -> anyhow::Result<Gpt> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| anyhow::anyhow!("--hf {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--hf {}: not JSON: {e}", path.display()))?;
    // A Gemma 3 with a vision tower: its text model (what Kolo trains).
    let v = match v.get("model_type").and_then(|t| t.as_str()) {
        Some("gemma3") => v.get("text_config").cloned().unwrap_or(v),
        _ => v,
    };
    let get = |keys: &[&str]| keys.iter().find_map(|k| v.get(*k).and_then(serde_json::Value::as_u64)).map(|x| x as usize);
    let need = |keys: &[&str]| get(keys).ok_or_else(|| anyhow::anyhow!("--hf {}: no {}", path.display(), keys.join(" or ")));
    let flag = |k: &str| v.get(k).and_then(serde_json::Value::as_bool);
    let kind = v.get("model_type").and_then(|t| t.as_str()).unwrap_or("");
    let layers = need(&["num_hidden_layers", "n_layer"])?;
    let d_model = need(&["hidden_size", "n_embd"])?;
    let heads = need(&["num_attention_heads", "n_head"])?;
    let context = need(&["max_position_embeddings", "n_positions"])?;
    let vocab = need(&["vocab_size"])?;
    let mut m = Gpt::gpt_style(layers, d_model, heads, seq.unwrap_or(context.min(4096)), vocab);
    m.head_dim = get(&["head_dim"]).unwrap_or(d_model / heads.max(1));
    m.kv_heads = get(&["num_key_value_heads"]).unwrap_or(heads);
    match kind {
        "gpt2" => {
            m.ffn = get(&["n_inner"]).unwrap_or(4 * d_model);
            m.tied = true;
        }
        "gpt_neox" => {
            m.ffn = need(&["intermediate_size"])?;
            (m.tied, m.learned_positions) = (flag("tie_word_embeddings").unwrap_or(false), false);
        }
        _ if kolo::hf::FAMILY.contains(&kind) => {
            let qwen_moe = matches!(kind, "qwen2_moe" | "qwen3_moe" | "deepseek_v2" | "deepseek_v3");
            m.ffn = get(&["moe_intermediate_size"]).filter(|_| qwen_moe).map_or_else(|| need(&["intermediate_size"]), Ok)?;
            (m.gated, m.learned_positions, m.tied) = (true, false, flag("tie_word_embeddings").unwrap_or(false));
            if let Some(x) = get(&["num_local_experts", "num_experts", "n_routed_experts"]).filter(|_| qwen_moe || kind == "mixtral") {
                (m.experts, m.top_k) = (x, get(&["num_experts_per_tok"]).unwrap_or(2));
                // DeepSeek's shared experts: each of the routed width, every token through them
                // (its latent attention is costed as plain multi-head attention).
                if let Some(n) = get(&["n_shared_experts"]).filter(|n| kind.starts_with("deepseek") && *n > 0) {
                    (m.experts, m.top_k) = (m.experts + n, m.top_k + n);
                }
                // Qwen2-MoE's shared expert: as many more experts of the routed width, which
                // every token runs through (Qwen1.5-MoE's 5632 = 4 x 1408).
                if let Some(w) = get(&["shared_expert_intermediate_size"]).filter(|w| kind == "qwen2_moe" && *w > 0) {
                    let more = w.div_ceil(m.ffn.max(1));
                    (m.experts, m.top_k) = (m.experts + more, m.top_k + more);
                }
            }
        }
        t => anyhow::bail!("--hf {}: model_type \"{t}\" (gpt2, gpt_neox, {})", path.display(), kolo::hf::FAMILY.join(", ")),
    }
    Ok(m)
}

/// Writes plan `p` as a runnable job in `dir` (see `--emit`): Kolo's GPT, or the fine-tuning job
/// of the `--hf` model.
fn emit(dir: &std::path::Path, a: &PlanArgs, m: &Gpt, c: &Cluster, p: &Plan, e: &Estimate) -> anyhow::Result<()> {
    if precision_is_fp8(&a.precision) {
        anyhow::bail!("--emit: Kolo trains in f32, bf16 or f16; an fp8 plan is for a runtime with FP8 matrix products");
    }
    let (text, note) = match &a.hf {
        Some(hf) => (hf_job(hf, a, m, p, e)?, String::new()),
        None => (
            gpt_job(a, m, c, p, e)?,
            format!("# The planner costed a vocabulary of {}; Kolo's built-in GPT takes its vocabulary from the data.\n", m.vocab),
        ),
    };
    let (nodes, per_node) = (c.nodes, c.devices() / c.nodes.max(1));
    let summary = format!(
        "dp {} x tp {} x pp {}, ZeRO-{}, micro-batches of {}{}, on {nodes} node(s) x {per_node} {}: predicted {:.4} s/step, MFU {:.1}%, {:.2} GiB per device",
        p.dp,
        p.tp,
        p.pp,
        p.zero,
        p.micro_batch,
        match p.recompute {
            Recompute::None => "",
            Recompute::Selective => ", selective recomputation",
            Recompute::Full => ", activation checkpointing",
        },
        c.device.name,
        e.step_s,
        e.mfu() * 100.0,
        e.memory() / 1024f64.powi(3)
    );
    std::fs::create_dir_all(dir).map_err(|err| anyhow::anyhow!("{}: {err}", dir.display()))?;
    let write = |name: &str, text: String| -> anyhow::Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|err| anyhow::anyhow!("{}: {err}", path.display()))
    };
    write(
        "train.toml",
        format!("# kolo plan's choice: {summary}.\n{note}# Run: bash launch.sh (one node) or sbatch job.sbatch (Slurm).\n{text}"),
    )?;
    // One node: a free port unless MASTER_PORT says; several: the same port and token everywhere.
    let port = if nodes > 1 { "--master-port \"${MASTER_PORT:-29500}\"" } else { "${MASTER_PORT:+--master-port \"$MASTER_PORT\"}" };
    let token =
        if nodes > 1 { " --token-file \"${KOLO_TOKEN_FILE:?a multi-node job needs the same token file on every node}\"" } else { "" };
    write(
        "launch.sh",
        format!(
            "#!/usr/bin/env bash\n# kolo plan's choice: {summary}.\n# On each of the {nodes} node(s): NODE_RANK=i MASTER_ADDR=node-0-host [MASTER_PORT=29500] [KOLO_TOKEN_FILE=...] bash launch.sh\nset -euo pipefail\nexec \"${{KOLO:-kolo}}\" launch --nnodes {nodes} --node-rank \"${{NODE_RANK:-0}}\" --nproc-per-node {per_node} --master-addr \"${{MASTER_ADDR:-127.0.0.1}}\" {port}{token} -- \"${{KOLO:-kolo}}\" train --config \"$(dirname \"$0\")/train.toml\" \"$@\"\n"
        ),
    )?;
    write(
        "job.sbatch",
        format!(
            "#!/usr/bin/env bash\n# kolo plan's choice: {summary}.\n#SBATCH --job-name=kolo-plan\n#SBATCH --nodes={nodes}\n#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n{}set -euo pipefail\ncd \"${{SLURM_SUBMIT_DIR:-.}}\"\nexport MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\nexport MASTER_PORT=${{MASTER_PORT:-29500}}\n# One token for the whole job, on the shared file system.\nexport KOLO_TOKEN_FILE=${{KOLO_TOKEN_FILE:-$PWD/.kolo-token-$SLURM_JOB_ID}}\n[ -f \"$KOLO_TOKEN_FILE\" ] || (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' > \"$KOLO_TOKEN_FILE\")\nsrun --ntasks-per-node=1 bash -c 'NODE_RANK=$SLURM_NODEID exec bash {}/launch.sh'\n",
            if c.device.name.to_lowercase().contains("cpu") || per_node == 0 { String::new() } else { format!("#SBATCH --gpus-per-node={per_node}\n") },
            std::fs::canonicalize(dir).map_or(dir.display().to_string(), |p| p.display().to_string())
        ),
    )?;
    Ok(())
}

/// Plan `p` as a `kolo train` config of Kolo's GPT, read back before it is returned.
fn gpt_job(a: &PlanArgs, m: &Gpt, c: &Cluster, p: &Plan, e: &Estimate) -> anyhow::Result<String> {
    let precision = match a.precision.as_str() {
        "f32" => "f32",
        "f16" => "f16",
        _ => "bf16",
    };
    // The data path as the ranks will see it: absolute when it exists here.
    let data = std::fs::canonicalize(&a.data).map_or(a.data.clone(), |p| p.display().to_string());
    let base = format!(
        "[model]\nkind = \"gpt\"\nseq = {}\nd_model = {}\nn_head = {}\nn_layer = {}\n[data]\nkind = \"text\"\npath = {data:?}\nbatch_size = 1\n\
         [train]\nsteps = {}\nprecision = \"{precision}\"\n{}",
        m.seq,
        m.d_model,
        m.heads,
        m.layers,
        a.steps,
        // A GPU cluster's ranks each take the GPU of their local rank.
        if c.device.name.to_lowercase().contains("cpu") { "" } else { "device = \"cuda\"\n" }
    );
    let mut cfg = kolo_train::Config::parse(&base, "the emitted plan")?;
    kolo_train::autoplan::apply(&mut cfg, p, e, a.global_batch, m.layers)
        .map_err(|err| anyhow::anyhow!("this plan is not one Kolo's GPT runs: {err}"))?;
    // The config as a user would write it: the base and what the plan sets, nothing defaulted.
    let mut text = base.replace("batch_size = 1\n", &format!("batch_size = {}\n", cfg.data.batch_size));
    if !cfg.model.checkpoint_blocks.is_empty() {
        text = text.replace("[data]\n", &format!("checkpoint_blocks = {:?}\n[data]\n", cfg.model.checkpoint_blocks));
    }
    if cfg.train.grad_accum > 1 {
        text += &format!("grad_accum = {}\n", cfg.train.grad_accum);
    }
    text += &format!("[ddp]\nzero_stage = {}\n", cfg.ddp.zero_stage);
    if let Some(mesh) = &cfg.mesh {
        text += &format!("[mesh]\ndp = {}\ntp = {}\npp = {}\n", mesh.dp.unwrap_or(1), mesh.tp, mesh.pp.unwrap_or(1));
    }
    if let Some(pipe) = &cfg.pipeline {
        let schedule = if pipe.schedule == kolo_train::config::PipeSchedule::TwoBw { "2bw" } else { "1f1b" };
        text += &format!("[pipeline]\nmicro_batches = {}\nschedule = \"{schedule}\"\n", pipe.micro_batches);
    }
    // What is written must read back as the plan.
    let back = kolo_train::Config::parse(&text, "the emitted plan")?;
    let shape = |c: &kolo_train::Config| {
        let mesh = c.mesh.as_ref().map(|m| (m.dp, m.tp, m.pp));
        (
            c.data.batch_size,
            c.train.grad_accum,
            c.ddp.zero_stage,
            c.model.checkpoint_blocks.len(),
            mesh,
            c.pipeline.as_ref().map(|p| (p.micro_batches, p.schedule)),
        )
    };
    anyhow::ensure!(shape(&back) == shape(&cfg), "the emitted config does not read back as the plan");
    Ok(text)
}

/// Why plan `p` (for `global` sequences a step) is not one a Hugging Face fine-tuning job runs:
/// it has no recomputation, sequence parallelism or schedule but 1F1B, no accumulated
/// micro-batches outside a pipeline, experts dealt out only beside dp with ZeRO-0/1, and
/// ZeRO-3 only without a mesh.
fn hf_refuses(p: &Plan, global: usize) -> Option<String> {
    if p.recompute == Recompute::Selective {
        return Some("it recomputes attention's core alone (selective recomputation); the fine-tuning job checkpoints whole layers".into());
    }
    if p.seq_parallel {
        return Some("it uses Megatron sequence parallelism, which Kolo's tensor parallelism does not".into());
    }
    if p.pp > 1 && p.schedule != Schedule::OneFOneB {
        return Some(format!("its pipeline schedule is {}; the fine-tuning job runs 1f1b", p.schedule.name()));
    }
    if p.pp == 1 && p.micro_batch * p.dp != global {
        return Some(format!("it accumulates micro-batches of {} outside a pipeline", p.micro_batch));
    }
    if p.cp > 1 && p.tp * p.pp * p.ep > 1 {
        return Some("it splits the sequence beside tensor, pipeline or expert parallelism (the fine-tuning job runs dp x sp)".into());
    }
    if p.ep > 1 && p.tp * p.pp > 1 {
        return Some("it deals the experts out beside tensor or pipeline parallelism (the fine-tuning job runs dp x ep)".into());
    }
    if p.ep > 1 && p.zero >= 2 {
        return Some(format!(
            "ZeRO-{} with the experts dealt out (the parameters an expert-parallel group shares take ZeRO-0 or 1)",
            p.zero
        ));
    }
    None
}

/// Plan `p` as the fine-tuning job of the Hugging Face model in `hf` (`kolo train`'s `[model]
/// hf`): token shards (a directory) or a text (a file) from `--data`, the plan's batch, ZeRO
/// stage, activation checkpointing of every layer, `[mesh]` and `[pipeline]`; read back as a
/// job before it is returned.
fn hf_job(hf: &std::path::Path, a: &PlanArgs, m: &Gpt, p: &Plan, e: &Estimate) -> anyhow::Result<String> {
    if let Some(why) = hf_refuses(p, a.global_batch) {
        anyhow::bail!("this plan is not one the Hugging Face fine-tuning job runs: {why}");
    }
    let abs = |s: &std::path::Path| std::fs::canonicalize(s).map_or(s.display().to_string(), |p| p.display().to_string());
    let data = std::path::Path::new(&a.data);
    let source = if data.is_dir() { format!("shards = {:?}", abs(data)) } else { format!("text = {:?}", abs(data)) };
    let checkpointed = match p.recompute {
        Recompute::Full => format!("checkpoint_blocks = {:?}\n", (0..m.layers).collect::<Vec<_>>()),
        _ => String::new(),
    };
    let mut text = format!(
        "[model]\nhf = {:?}\n{checkpointed}[data]\n{source}\nbatch_size = {}\nseq = {}\n[train]\nsteps = {}\n[ddp]\nzero_stage = {}\n",
        abs(hf),
        a.global_batch / p.dp,
        m.seq,
        a.steps,
        p.zero
    );
    if p.tp * p.pp * p.ep * p.cp > 1 {
        // Kolo's mesh counts ep beside dp (the plan's dp replicas are dp / ep x ep), and calls
        // context parallelism sp.
        text += &format!("[mesh]\ndp = {}\ntp = {}\npp = {}\n", p.dp / p.ep, p.tp, p.pp);
        if p.ep > 1 {
            text += &format!("ep = {}\n", p.ep);
        }
        if p.cp > 1 {
            text += &format!("sp = {}\n", p.cp);
        }
    }
    if p.pp > 1 {
        text += &format!("[pipeline]\nmicro_batches = {}\nschedule = \"1f1b\"\n", e.micro_batches);
    }
    kolo::hf::FineTuneConfig::from_toml_str(&text, std::path::Path::new("the emitted plan"))?;
    Ok(text)
}
