//! `kolo train`: joins the job (if launched) and runs the training loop.

use crate::comm_args::CommArgs;
use kolo_comm::{Checked, Communicator};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The TOML config (see examples/ and kolo-train's config docs).
    #[arg(long)]
    config: PathBuf,
    /// Resume from a checkpoint (written at any world size and ZeRO stage), or from the newest
    /// complete checkpoint in a directory of them.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Override ddp.zero_stage: 0 = DDP, 1 = optimizer state sharded, 2 = gradients too,
    /// 3 = parameters too (GPT blocks gathered on use).
    #[arg(long)]
    zero_stage: Option<u8>,
    /// Override optim.offload_dir: keep optimizer state in memory-mapped files there.
    #[arg(long)]
    offload_dir: Option<String>,
    /// Override data.path.
    #[arg(long)]
    data: Option<String>,
    /// Override train.device: cpu, cuda or cuda:N (candle's CUDA backend; a `--features cuda`
    /// build).
    #[arg(long)]
    device: Option<String>,
    /// Override train.steps.
    #[arg(long)]
    steps: Option<u64>,
    /// Stop after this many steps in total, as if interrupted (checkpoints are still written).
    #[arg(long, hide = true)]
    stop_after: Option<u64>,
    /// Abort in the middle of saving this step's checkpoint (Kolo's crash tests).
    #[arg(long, hide = true)]
    crash_during_save: Option<u64>,
    /// RANK:MS makes that rank sleep MS milliseconds every step (a straggler, for benchmarks).
    #[arg(long, hide = true, value_parser = parse_slow_rank)]
    slow_rank: Option<(usize, u64)>,
    /// RANK:STEP makes that rank SIGKILL itself at that step, in the first round of a job only
    /// (elastic-training tests and benchmarks); a parameter-server worker fails there instead.
    #[arg(long, hide = true, value_parser = parse_slow_rank)]
    kill_at: Option<(usize, u64)>,
    /// RANK:MS makes that rank sleep MS milliseconds per example of its batch every step (a
    /// slower device, for dynamic batch sizing).
    #[arg(long, hide = true, value_parser = parse_slow_per_example)]
    slow_per_example: Option<(usize, f64)>,
    /// `auto`: the planner picks dp x tp x pp, the ZeRO stage, micro-batches and activation
    /// checkpointing for this world size (GPT configs without their own [mesh]/[pipeline]), on
    /// this machine's CPU as every rank measures it at start (about a second, averaged over the
    /// ranks).
    #[arg(long)]
    plan: Option<String>,
    /// Memory per rank for --plan auto, e.g. 2GiB (default: this machine's memory / ranks).
    #[arg(long)]
    device_memory: Option<String>,
    #[command(flatten)]
    comm: CommArgs,
}

/// `kolo train` of a config whose `[model]` names a Hugging Face model directory (`hf`): the
/// library's fine-tuning job (`kolo::hf::FineTune`) on this rank, its checkpoints resumable at
/// any world size (`--resume`, or the newest one after an elastic restart) and exported with
/// `kolo export --hf`.
fn run_hf(a: &TrainArgs, text: &str) -> anyhow::Result<i32> {
    let mut cfg = kolo::hf::FineTuneConfig::from_toml_str(text, &a.config)?;
    let refused = [
        (a.plan.is_some(), "--plan"),
        (a.offload_dir.is_some(), "--offload-dir"),
        (a.data.is_some(), "--data (set data.shards)"),
        (a.device.as_deref().is_some_and(|d| d != "cpu"), "--device other than cpu"),
        (a.kill_at.is_some() || a.slow_rank.is_some() || a.slow_per_example.is_some() || a.crash_during_save.is_some(), "fault injection"),
    ];
    if let Some((_, flag)) = refused.iter().find(|(on, _)| *on) {
        anyhow::bail!("{flag} is not supported for a Hugging Face model ([model] hf) yet");
    }
    if let Some(s) = a.steps {
        cfg.train.steps = s;
    }
    if let Some(z) = a.zero_stage {
        cfg.ddp.zero_stage = z;
    }
    let steps = a.stop_after.map_or(cfg.train.steps, |s| s.min(cfg.train.steps));
    // One deadline for setup and every collective: --timeout if given, else the config's (the
    // trainer checks that its communicator has the config's).
    cfg.ddp.timeout_secs = a.comm.timeout.unwrap_or(cfg.ddp.timeout_secs);
    cfg.ddp.liveness_secs = a.comm.liveness.unwrap_or(cfg.ddp.liveness_secs);
    let mut comm_args = a.comm.clone();
    comm_args.timeout = Some(cfg.ddp.timeout_secs);
    comm_args.liveness = Some(cfg.ddp.liveness_secs);
    let dist = comm_args.join_any()?;
    let round = restart_round()?;
    let resume = a.resume.clone().or_else(|| {
        let dir = cfg.train.checkpoint_dir.as_ref().filter(|_| round > 0)?;
        let p = kolo_train::run::newest_checkpoint(std::path::Path::new(dir))?;
        if dist.is_main() {
            kolo_base::eline!("elastic restart {round} on {} ranks: resuming from {}", dist.world_size(), p.display());
        }
        Some(p)
    });
    let total = cfg.train.steps;
    let heap_before = kolo_base::alloc::stats().map(|h| h.live);
    let mut ft = kolo::hf::FineTune::new(&dist, cfg)?;
    ft.run_until(resume.as_deref(), steps)?;
    // As the built-in models' summary: the live heap before the model, after the steps, and its peak.
    if let (true, Some(h)) = (dist.is_main(), kolo_train::summary::HeapReport::between(heap_before, kolo_base::alloc::stats())) {
        print_heap(&h);
    }
    if steps == total {
        if let Some((dir, opts)) = ft.export_options()? {
            ft.export(&dir, &opts)?;
            if dist.is_main() {
                kolo_base::eline!("exported {} ({:?})", dir.display(), opts.dtype);
            }
        }
    }
    Ok(0)
}

/// MemTotal from /proc/meminfo, bytes.
fn machine_memory() -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/meminfo").map_err(|e| anyhow::anyhow!("/proc/meminfo: {e} (pass --device-memory)"))?;
    let kb: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no MemTotal in /proc/meminfo (pass --device-memory)"))?;
    Ok(kb * 1024.0)
}

fn parse_slow_per_example(s: &str) -> Result<(usize, f64), String> {
    let (r, ms) = s.split_once(':').ok_or("expected RANK:MS")?;
    Ok((r.parse().map_err(|_| "RANK is not a number")?, ms.parse().map_err(|_| "MS is not a number")?))
}

fn parse_slow_rank(s: &str) -> Result<(usize, u64), String> {
    let (r, ms) = s.split_once(':').ok_or("expected RANK:MS")?;
    Ok((r.parse().map_err(|_| "RANK is not a number")?, ms.parse().map_err(|_| "MS is not a number")?))
}

pub fn run(a: TrainArgs) -> anyhow::Result<i32> {
    let text = std::fs::read_to_string(&a.config).map_err(|e| anyhow::anyhow!("{}: {e}", a.config.display()))?;
    if toml::from_str::<toml::Value>(&text).ok().and_then(|v| v.get("model")?.get("hf").cloned()).is_some() {
        return run_hf(&a, &text);
    }
    let mut cfg = load_config(&a)?;
    if cfg.train.strategy == kolo_train::config::Strategy::Ps {
        let opts = kolo_train::RunOptions {
            stop_after: a.stop_after,
            slow_rank: a.slow_rank,
            die_at: a.kill_at,
            resume: a.resume.clone(),
            ..Default::default()
        };
        return run_ps(&cfg, opts);
    }
    let mut comm_args = a.comm.clone();
    comm_args.timeout = Some(cfg.ddp.timeout_secs);
    comm_args.liveness = Some(cfg.ddp.liveness_secs);
    let boot = comm_args.join_any()?;
    match a.plan.as_deref() {
        None => {}
        Some("auto") => {
            let world = boot.comm().world_size().get();
            let memory = match &a.device_memory {
                Some(m) => kolo_plan::parse_quantity(m).map_err(anyhow::Error::msg)?,
                None => machine_memory()? / world as f64,
            };
            let device = measured_device(&**boot.comm())?;
            let line = kolo_train::autoplan::apply_plan(&mut cfg, world, memory, &device)?;
            if boot.comm().rank().get() == 0 {
                kolo_base::eline!("{line}");
            }
        }
        Some(p) => anyhow::bail!("--plan {p}: only `auto` is known"),
    }
    let comm: Arc<dyn Communicator> =
        if cfg.ddp.check_collectives { Arc::new(Checked::new(boot.comm().clone())) } else { boot.comm().clone() };
    if boot.host().is_none() && boot.comm().rank().get() == 0 {
        kolo_base::eline!("kolo train: collectives over {} ({} ranks)", boot.comm().backend(), boot.comm().world_size().get());
    }
    // An elastic restart (kolo launch --min-nodes) resumes from the newest checkpoint.
    let round = restart_round()?;
    let mut resume = a.resume.clone();
    if round > 0 && resume.is_none() {
        let lead = boot.comm().rank().get() == 0;
        match cfg.train.checkpoint_dir.as_ref().and_then(|d| kolo_train::run::newest_checkpoint(std::path::Path::new(d))) {
            Some(p) => {
                if lead {
                    kolo_base::eline!("elastic restart {round} on {} ranks: resuming from {}", boot.comm().world_size().get(), p.display());
                }
                resume = Some(p);
            }
            None if lead => kolo_base::eline!(
                "elastic restart {round}: no checkpoint to resume from (set train.checkpoint_dir and checkpoint_every); starting over"
            ),
            None => {}
        }
    }
    let die_at = a.kill_at.filter(|_| round == 0);
    let opts = kolo_train::RunOptions {
        resume,
        stop_after: a.stop_after,
        quiet: false,
        inject_inf_at: None,
        crash_during_save: a.crash_during_save,
        slow_rank: a.slow_rank,
        die_at,
        slow_per_example: a.slow_per_example,
    };
    // The built-in models' data-parallel strategy is the library's Trainer (`kolo::builtin`).
    let s = kolo::builtin::run(&cfg, comm, &opts).inspect_err(|e| {
        // A communication failure: show what this rank's communicator did last.
        if matches!(e, kolo_train::TrainError::Comm(_) | kolo_train::TrainError::Ddp(kolo_ddp::DdpError::Comm(_))) {
            if let Some(h) = boot.host() {
                eprint!("{}", h.flight_record());
            }
        }
    })?;
    if boot.comm().rank().get() == 0 {
        report(&cfg, &s);
    }
    Ok(0)
}

/// The config file with the command line's overrides, validated together.
fn load_config(a: &TrainArgs) -> anyhow::Result<kolo_train::Config> {
    let mut cfg = kolo_train::Config::load(&a.config)?;
    if let Some(d) = a.data.clone() {
        cfg.data.path = Some(d);
    }
    if let Some(d) = &a.device {
        cfg.train.device = d.clone();
    }
    if let Some(s) = a.steps {
        cfg.train.steps = s;
    }
    if let Some(d) = a.offload_dir.clone() {
        cfg.optim.offload_dir = Some(d);
    }
    if let Some(z) = a.zero_stage {
        cfg.ddp.zero_stage = z;
    }
    // One deadline for setup and every collective: --timeout if given, else the config's.
    if let Some(t) = a.comm.timeout {
        cfg.ddp.timeout_secs = t;
    }
    if let Some(l) = a.comm.liveness {
        cfg.ddp.liveness_secs = l;
    }
    // The overrides go through the file's validation: a combination the file would refuse is
    // refused here too, naming the flags.
    cfg.check().map_err(|e| {
        anyhow::anyhow!(
            "{} with the command-line overrides (--data, --device, --steps, --offload-dir, --zero-stage, --timeout, --liveness): {e}",
            a.config.display()
        )
    })?;
    Ok(cfg)
}

/// The lead rank's closing lines: steps, loss, step time and overlap, experts, traffic, memory.
fn report(cfg: &kolo_train::Config, s: &kolo_train::Summary) {
    let n = s.step_ms.len();
    let tail = &s.step_ms[n.saturating_sub(n / 2).min(n)..];
    let mean = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
    let overlap = match s.pipeline_bubble {
        Some(b) => format!("pipeline bubble {:.1}%", b * 100.0),
        None if cfg.ddp.schedule.is_some() => {
            let w = &s.comm_wait_ms[s.comm_wait_ms.len() / 2..];
            format!(
                "{:.0}% of gradient communication hidden behind compute (forward waited {:.1} ms/step for updates)",
                s.hidden_fraction * 100.0,
                w.iter().sum::<f64>() / w.len().max(1) as f64
            )
        }
        None => format!("{:.0}% of gradient all-reduce hidden behind backward", s.hidden_fraction * 100.0),
    };
    kolo_base::eline!("done: {} steps, last loss {:.4}, {:.1} ms/step (second half), {overlap}", s.steps_done, s.last_loss, mean);
    if let Some(m) = &s.moe {
        kolo_base::eline!(
            "experts: tokens routed per expert {:?} (coefficient of variation {:.3}), {:.2}% of assignments dropped by the capacity",
            m.load,
            m.cv(),
            m.dropped_fraction() * 100.0
        );
    }
    let mb = |b: u64| b as f64 / 1e6;
    if let Some(bytes) = s.comm_bytes.last() {
        let what = if s.pipeline_bubble.is_some() { "activations and their gradients sent by rank 0" } else { "gradient traffic" };
        kolo_base::eline!("{what}: {:.3} MB per step per rank (last step)", *bytes as f64 / 1e6);
    }
    kolo_base::eline!(
        "memory per rank: model states {:.1} MB (params {:.1} + grads {:.1} + optimizer {:.1}{}), peak RSS {}",
        mb(s.states.total()),
        mb(s.states.params),
        mb(s.states.grads),
        mb(s.states.optimizer),
        if s.states.offloaded { " offloaded to files" } else { "" },
        s.peak_rss.map_or("unknown".to_string(), |b| format!("{:.1} MB", mb(b)))
    );
    if let Some(h) = s.heap {
        print_heap(&h);
    }
}

/// The heap line of a run's summary (the `kolo` binary counts its allocations).
fn print_heap(h: &kolo_train::summary::HeapReport) {
    let mb = |b: usize| b as f64 / 1e6;
    kolo_base::eline!(
        "heap per rank: {:.1} MB before the model, {:.1} MB between steps (+{:.1} MB: model states and caches), peak {:.1} MB (+{:.1} MB transient)",
        mb(h.before_model),
        mb(h.between_steps),
        mb(h.between_steps.saturating_sub(h.before_model)),
        mb(h.peak),
        mb(h.peak.saturating_sub(h.between_steps))
    );
}

/// A parameter-server worker: RANK / WORLD_SIZE say which data shard, KOLO_PS_COORDINATOR (or
/// `[ps] coordinator`) where the job's coordinator listens.
/// How many times an elastic launcher restarted this job (`kolo launch --min-nodes`, or
/// torchrun's), as the library's `Dist::restart_count` reads it.
fn restart_round() -> anyhow::Result<usize> {
    Ok(kolo_rendezvous::discover(std::env::vars()).map_err(anyhow::Error::msg)?.map_or(0, |e| e.restart_count))
}

/// `opts` carries `--stop-after`, `--resume` and the fault injection (`--kill-at`: that worker
/// fails at that step, and a survivor takes over its data shard).
fn run_ps(cfg: &kolo_train::Config, opts: kolo_train::RunOptions) -> anyhow::Result<i32> {
    let var = |k: &str| std::env::var(k).ok();
    let num = |k: &str, d: usize| -> anyhow::Result<usize> {
        var(k).map_or(Ok(d), |v| v.parse().map_err(|_| anyhow::anyhow!("{k}={v} is not a number")))
    };
    let (worker, workers) = (num("RANK", 0)?, num("WORLD_SIZE", 1)?);
    let coordinator = cfg.ps.coordinator.clone().or_else(|| var("KOLO_PS_COORDINATOR")).ok_or_else(|| {
        anyhow::anyhow!(
            "train.strategy = \"ps\" needs a coordinator: start the job with `kolo ps run`, or set [ps] coordinator / KOLO_PS_COORDINATOR"
        )
    })?;
    let token = kolo_rendezvous::JobToken::from_hex(
        &var("KOLO_JOB_TOKEN").ok_or_else(|| anyhow::anyhow!("KOLO_JOB_TOKEN is not set (the parameter-server job's token)"))?,
    )
    .map_err(|e| anyhow::anyhow!("KOLO_JOB_TOKEN: {e}"))?;
    let mut cfg = cfg.clone();
    if let Some(n) = var("KOLO_PS_SERVERS").and_then(|v| v.parse().ok()) {
        cfg.ps.servers = n;
    }
    let me = kolo_train::ps_worker::PsWorker { worker, workers, coordinator, token };
    let s = kolo_train::ps_worker::run_ps(&cfg, &me, &opts)?;
    if worker == 0 {
        let n = s.step_ms.len();
        let tail = &s.step_ms[n.saturating_sub(n / 2).min(n)..];
        let mean = tail.iter().sum::<f64>() / tail.len().max(1) as f64;
        let st = s.ps.unwrap_or_default();
        kolo_base::eline!(
            "done: {} steps, last loss {:.4}, {:.1} ms/step (second half); worker 0 pushed {:.2} MB, pulled {:.2} MB, {} retried requests, lead over the slowest worker up to {} step(s)",
            s.steps_done,
            s.last_loss,
            mean,
            st.bytes_out as f64 / 1e6,
            st.bytes_in as f64 / 1e6,
            st.retries,
            st.max_lead
        );
    }
    Ok(0)
}

/// This machine's CPU for the planner: measured by every rank at once (they share the cores as
/// training will), the figures averaged over the ranks so that every rank plans the same.
fn measured_device(comm: &dyn Communicator) -> anyhow::Result<kolo_plan::Device> {
    let mut d = kolo_train::autoplan::measure_device()?;
    let mut v: Vec<f64> =
        [d.peak_f32, d.mem_bandwidth, d.update_bandwidth].into_iter().chain(d.gemm_efficiency.iter().map(|e| e.1)).collect();
    comm.all_reduce(kolo_comm::BufMut::from(&mut v[..]), kolo_comm::ReduceOp::Sum)?;
    let n = comm.world_size().get() as f64;
    (d.peak_f32, d.mem_bandwidth, d.update_bandwidth) = (v[0] / n, v[1] / n, v[2] / n);
    d.peak_16 = d.peak_f32;
    for (e, s) in d.gemm_efficiency.iter_mut().zip(&v[3..]) {
        e.1 = s / n;
    }
    Ok(d)
}
