//! The `kolo` binary: a thin shell over the libraries.

mod bench;
mod comm_args;
mod data_cmd;
mod fed;
mod plan;
mod plot;
mod ps;
mod selftest;
mod train;

use clap::{Parser, Subcommand};

/// candle allocates a fresh buffer for every op. By default glibc serves large ones with mmap and
/// returns them with munmap, so every step faults in (and the kernel zeroes) the same memory
/// again: a fifth of a GPT step went to `clear_page`. Keeping freed memory in the heap removes
/// that (GPT bench step 646 -> 589 ms, see docs/benchmarks.md).
#[global_allocator]
static ALLOC: kolo_base::alloc::CountingAlloc = kolo_base::alloc::CountingAlloc;

fn keep_freed_memory() {
    // SAFETY: mallopt only tunes the allocator; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TOP_PAD, 64 << 20);
    }
}
use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "kolo", version, about = "Distributed training for Rust: launcher, collectives, benchmarks.")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run N copies of a program on this node as ranks of one job (like torchrun).
    ///
    /// Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    /// KOLO_JOB_TOKEN and KOLO_ERROR_FILE. Output lines are prefixed with the rank. If a rank
    /// fails, the others are stopped and the launcher exits non-zero with a summary naming the
    /// rank that caused it (not the survivors that lost it) and every rank's error. With several
    /// ranks and no RAYON_NUM_THREADS set, each rank gets RAYON_NUM_THREADS = cores / ranks.
    Launch(LaunchArgs),
    /// Train a model from a TOML config, alone or under `kolo launch` (DDP and ZeRO; pipeline (GPipe, 1F1B, 2BW),
    /// tensor, sequence and expert parallelism per `[mesh]`; parameter servers with `strategy = "ps"`).
    /// A config whose `[model]` names a Hugging Face directory (`hf = "DIR"`) fine-tunes that model
    /// on token shards (see examples/hf_llama.toml).
    Train(Box<train::TrainArgs>),
    /// Data preparation: `kolo data prepare` tokenizes text into token shards.
    #[command(subcommand)]
    Data(data_cmd::DataCmd),
    /// Parameter servers: `kolo ps run` starts a whole job here; `serve`, `coordinator`,
    /// `eval`, `remove` and `shutdown` for jobs across machines.
    #[command(subcommand)]
    Ps(ps::PsCmd),
    /// Plan the parallelism of a GPT on a cluster (a preset or a TOML file): searches dp x tp x
    /// pp x ZeRO x micro-batch x activation checkpointing with a cost model (GEMMs at their
    /// measured efficiency, memory-bound work, collectives on intra- or inter-node links,
    /// memory per precision, pipeline bubble) and prints the fastest plans that fit, with
    /// TFLOP/s per device, MFU and memory per device.
    Plan(Box<plan::PlanArgs>),
    /// IMPALA: actors (threads, or processes with --processes) run CartPole (or a grid world) with the newest policy they have and
    /// never wait; the learner batches their trajectories and corrects the policy lag with
    /// V-trace. Stops when the mean return of 100 episodes reaches the target.
    Impala {
        /// cartpole or grid.
        #[arg(long, default_value = "cartpole")]
        env: String,
        #[arg(long, default_value_t = 2)]
        actors: usize,
        /// Stop after learning from this many environment steps.
        #[arg(long, default_value_t = 2_000_000)]
        max_steps: u64,
        /// Run to --max-steps even after the target is reached (throughput measurements).
        #[arg(long)]
        no_stop: bool,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 1e-3)]
        lr: f32,
        /// Trajectories per learner step.
        #[arg(long, default_value_t = 8)]
        batch: usize,
        /// Run the actors as separate processes talking to the learner over TCP (authenticated
        /// with a job token) instead of threads.
        #[arg(long)]
        processes: bool,
        /// Internal: run as actor process ID of the learner at ADDR.
        #[arg(long, hide = true)]
        actor_of: Option<String>,
        #[arg(long, hide = true, default_value_t = 0)]
        actor_id: usize,
    },
    /// Federated averaging on MNIST: `kolo fed run` (a whole job here), `serve`, `client`.
    #[command(subcommand)]
    Fed(fed::FedCmd),
    /// Render a run's loss and throughput curves (one line per rank) to PNG files, from the
    /// TensorBoard event files and JSON-lines logs found under RUN_DIR.
    Plot {
        run_dir: PathBuf,
        /// Where to write loss.png and throughput.png (default: RUN_DIR).
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Write the model of a checkpoint to a directory `transformers` loads: `--hf OUT` for a
    /// checkpoint of a Hugging Face fine-tuning job (`kolo train` with `[model] hf = DIR`),
    /// written at any world size and mesh.
    Export {
        /// The directory to write (config.json and the weights).
        #[arg(long, value_name = "OUT")]
        hf: PathBuf,
        /// A checkpoint directory (`step-N`), or a directory of them (the newest complete one).
        checkpoint: PathBuf,
        /// The weights' dtype: f32, bf16 or f16 (config.json says which).
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Largest weights file in bytes: above it, shards and model.safetensors.index.json.
        #[arg(long)]
        max_shard_size: Option<u64>,
    },
    /// List a checkpoint's metadata, files, tensors, shapes and shards, and verify its checksums.
    Inspect {
        /// A checkpoint directory (or a single-file checkpoint).
        checkpoint: PathBuf,
    },
    /// Benchmarks (collectives like nccl-tests, loopback and memory limits, parameter servers,
    /// Hogwild, Sandblaster L-BFGS, the flight recorder's cost).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Collective stress loop with fault injection, for Kolo's own failure tests.
    #[command(hide = true)]
    Selftest(selftest::SelftestArgs),
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// Ranks to start on this node.
    #[arg(short = 'n', long = "nproc-per-node", default_value_t = 1)]
    nproc_per_node: usize,
    /// Nodes in the job.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, where rank 0 hosts the rendezvous store.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store (default: a free port, bound by the launcher and handed to
    /// rank 0 already listening, as KOLO_STORE_FD; required with --nnodes > 1).
    #[arg(long)]
    master_port: Option<u16>,
    /// File holding the job token in hex (required with --nnodes > 1; default: a fresh random token).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Seconds the other ranks get to exit on their own after one fails, before SIGTERM.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Elastic job: when ranks die, restart on the survivors (a new rendezvous round; ranks
    /// resume from their latest checkpoint) while at least this many remain. On one host each
    /// rank counts as a node. Default: not elastic (the job stops, naming the dead rank).
    #[arg(long)]
    min_nodes: Option<usize>,
    /// Elastic job: the most ranks (nodes) it may run with; -n must not exceed it. Nodes
    /// joining a running job are not supported yet.
    #[arg(long)]
    max_nodes: Option<usize>,
    /// Elastic job: restarts allowed before giving up.
    #[arg(long, default_value_t = 3)]
    max_restarts: u32,
    /// Elastic job: seconds to wait before each restart.
    #[arg(long, default_value_t = 1.0)]
    restart_backoff: f64,
    /// Bind each rank to its own share of this process's CPUs (as Open MPI binds to cores),
    /// unless the ranks outnumber them; each rank sees its CPUs in KOLO_CPUS. Off by default:
    /// a rank's compute and communication threads then share its cores.
    #[arg(long)]
    bind_cores: bool,
    /// The program and its arguments.
    #[arg(last = true, required = true)]
    program: Vec<OsString>,
}

fn launch(a: LaunchArgs) -> anyhow::Result<i32> {
    let token = match &a.token_file {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("--token-file {}: {e}", p.display()))?;
            Some(kolo_rendezvous::JobToken::from_hex(&text).map_err(|e| anyhow::anyhow!("--token-file {}: {e}", p.display()))?)
        }
        None => match std::env::var("KOLO_JOB_TOKEN") {
            Ok(t) => Some(kolo_rendezvous::JobToken::from_hex(&t).map_err(|e| anyhow::anyhow!("KOLO_JOB_TOKEN: {e}"))?),
            Err(_) => None,
        },
    };
    let cfg = kolo_launch::LaunchConfig {
        nproc_per_node: a.nproc_per_node,
        nnodes: a.nnodes,
        node_rank: a.node_rank,
        master_addr: a.master_addr,
        master_port: a.master_port,
        token,
        program: a.program,
        grace: Duration::from_secs_f64(a.grace.max(0.0)),
        env: Vec::new(),
        bind: a.bind_cores,
        keep_going: false,
    };
    if let Some(max) = a.max_nodes {
        if a.nproc_per_node > max {
            anyhow::bail!("-n {} exceeds --max-nodes {max}", a.nproc_per_node);
        }
    }
    let out = match a.min_nodes {
        Some(min) => {
            let e =
                kolo_launch::Elastic { min, max_restarts: a.max_restarts, backoff: Duration::from_secs_f64(a.restart_backoff.max(0.0)) };
            let (out, rounds) = kolo_launch::launch_elastic(&cfg, &e)?;
            if out.success() && rounds > 0 {
                kolo_base::eline!("kolo launch: elastic job finished after {rounds} restart(s) on {} ranks", out.ranks.len());
            }
            out
        }
        None => kolo_launch::launch(&cfg)?,
    };
    if !out.success() {
        eprint!("{}", out.summary());
    }
    Ok(out.exit_code())
}

fn inspect(path: &std::path::Path) -> anyhow::Result<i32> {
    let text = kolo_checkpoint::sharded::describe(path)?;
    print!("{text}");
    Ok(if text.contains("DOES NOT LOAD") { 1 } else { 0 })
}

/// The peer whose loss made this run fail, if that is what happened (for the launcher's summary).
fn lost_peer(e: &anyhow::Error) -> Option<usize> {
    e.chain().find_map(|c| {
        let comm = c.downcast_ref::<kolo_comm::CommError>().or_else(|| match c.downcast_ref::<kolo_train::TrainError>() {
            Some(kolo_train::TrainError::Comm(e)) => Some(e),
            Some(kolo_train::TrainError::Ddp(kolo_ddp::DdpError::Comm(e))) => Some(e),
            _ => None,
        });
        comm.and_then(|e| e.lost_peer()).map(|r| r.get())
    })
}

#[allow(clippy::too_many_arguments)]
fn impala(
    env: &str,
    actors: usize,
    max_steps: u64,
    no_stop: bool,
    seed: u64,
    lr: f32,
    batch: usize,
    processes: bool,
    actor_of: Option<String>,
    actor_id: usize,
) -> anyhow::Result<i32> {
    use kolo_rl::impala::{EnvKind, ImpalaConfig};
    let kind = match env {
        "cartpole" => EnvKind::CartPole,
        "grid" => EnvKind::Grid,
        e => anyhow::bail!("--env {e}: cartpole or grid"),
    };
    let cfg = ImpalaConfig {
        env: kind,
        max_env_steps: max_steps,
        target: (!no_stop).then(|| kind.solved()),
        seed,
        lr,
        batch,
        ..ImpalaConfig::cartpole(actors)
    };
    if let Some(addr) = actor_of {
        let token = kolo_rendezvous::JobToken::from_hex(
            &std::env::var("KOLO_JOB_TOKEN").map_err(|_| anyhow::anyhow!("KOLO_JOB_TOKEN is not set"))?,
        )
        .map_err(|e| anyhow::anyhow!("KOLO_JOB_TOKEN: {e}"))?;
        let steps = kolo_rl::impala::actor_process(&cfg, &addr, &token, actor_id)?;
        // One write, so that lines of several actor processes do not interleave.
        let line = format!("actor {actor_id}: {steps} environment steps\n");
        std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes())?;
        return Ok(0);
    }
    let token = kolo_rendezvous::JobToken::generate();
    let mut children: Vec<std::process::Child> = Vec::new();
    let exe = std::env::current_exe()?;
    let mut spawn = |addr: &str| -> Result<(), kolo_rl::impala::ImpalaError> {
        for id in 0..actors {
            let child = std::process::Command::new(&exe)
                .args(["impala", "--env", env, "--seed", &seed.to_string(), "--actor-of", addr, "--actor-id", &id.to_string()])
                .env("KOLO_JOB_TOKEN", token.to_hex())
                .stdin(std::process::Stdio::null())
                .spawn()
                .map_err(|e| kolo_rl::impala::ImpalaError::Failed(format!("starting actor {id}: {e}")))?;
            children.push(child);
        }
        Ok(())
    };
    let remote = processes.then(|| kolo_rl::impala::RemoteActors { listen: "127.0.0.1:0", token: token.clone(), spawn: &mut spawn });
    let t0 = std::time::Instant::now();
    let r = kolo_rl::impala::run_with(&cfg, remote, &mut |steps, mean| {
        kolo_base::eline!("{:>7.1} s  {steps:>9} env steps  mean return (100 episodes) {mean:.1}", t0.elapsed().as_secs_f64())
    })?;
    kolo_base::eline!(
        "done: {} env steps taken ({:.0}/s with {actors} actors), {} learned from in {} learner steps, {} episodes, mean return {:.1}{}; policy lag mean {:.2}, max {} updates; {} trajectories dropped by a full queue",
        r.env_steps,
        r.env_steps_per_s,
        r.learned_steps,
        r.learner_steps,
        r.episodes,
        r.mean_return,
        r.solved_at.map_or(String::new(), |s| format!(", solved at {s} env steps")),
        r.mean_lag,
        r.max_lag,
        r.dropped
    );
    for mut c in children {
        let _ = c.wait();
    }
    Ok(if r.solved_at.is_some() || no_stop { 0 } else { 1 })
}

/// Under a launcher that runs several ranks on this host (`LOCAL_WORLD_SIZE` > 1: torchrun's
/// convention, which `kolo launch` also follows) but left `RAYON_NUM_THREADS` unset, takes
/// this rank's share of the cores, as `kolo launch` would have given it.
fn share_cores_between_local_ranks() {
    let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(t) = local.and_then(|n| kolo_launch::threads_per_rank(std::env::var_os("RAYON_NUM_THREADS").as_deref(), cores, n)) {
        // First thing in main, before any thread exists (candle and rayon read it later).
        std::env::set_var("RAYON_NUM_THREADS", t.to_string());
    }
}

fn main() {
    share_cores_between_local_ranks();
    keep_freed_memory();
    kolo_base::alloc::CountingAlloc::mark_installed();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("KOLO_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = kolo_base::simd::requested() {
        kolo_base::eline!("error: {e}");
        std::process::exit(2);
    }
    let r = match cli.cmd {
        Cmd::Launch(a) => launch(a),
        Cmd::Train(t) => train::run(*t),
        Cmd::Ps(p) => ps::run(p),
        Cmd::Data(d) => data_cmd::run(d),
        Cmd::Fed(f) => fed::run(f),
        Cmd::Plan(p) => plan::run(*p),
        Cmd::Impala { env, actors, max_steps, no_stop, seed, lr, batch, processes, actor_of, actor_id } => {
            impala(&env, actors, max_steps, no_stop, seed, lr, batch, processes, actor_of, actor_id)
        }
        Cmd::Bench(b) => bench::run(b),
        Cmd::Selftest(s) => selftest::run(s),
        Cmd::Inspect { checkpoint } => inspect(&checkpoint),
        Cmd::Export { hf, checkpoint, dtype, max_shard_size } => (|| {
            let opts = kolo::hf::SaveOptions { dtype: kolo::hf::finetune::export_dtype(&dtype)?, max_shard_size };
            kolo::hf::export_checkpoint(&checkpoint, &hf, &opts)?;
            println!("exported {} to {} ({dtype})", checkpoint.display(), hf.display());
            Ok(0)
        })(),
        Cmd::Plot { run_dir, out } => (|| {
            let out = out.unwrap_or_else(|| run_dir.clone());
            for (path, lines) in plot::plot_run(&run_dir, &out).map_err(anyhow::Error::msg)? {
                println!("{}: {lines}", path.display());
            }
            Ok(0)
        })(),
    };
    match r {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            kolo_base::eline!("error: {e:#}");
            kolo_launch::error_file::record(&format!("{e:#}"), lost_peer(&e));
            std::process::exit(1);
        }
    }
}
