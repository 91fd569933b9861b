//! `kolo ps`: the parameter-server roles (coordinator, server) and `kolo ps run`, which starts a
//! whole job on this machine.

use kolo_ps::server::ServerOptions;
use kolo_ps::{Coordinator, Server};
use kolo_rendezvous::JobToken;
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum PsCmd {
    /// Start a job on this machine: a coordinator (in this process), SERVERS `kolo ps serve`
    /// processes and WORKERS `kolo train` ranks (under `kolo launch`), then shut the servers
    /// down when the workers are done. The config must say `[train] strategy = "ps"`. With
    /// --exec the workers are a program of yours (`kolo::PsWorker`) instead. A worker that dies
    /// does not stop the others: after --dead-after a survivor trains its data shard from its
    /// last step, and the job succeeds when every dead worker's shard was taken over. At the end
    /// the workers wait for every worker's last push (under async too), each wait giving up
    /// after ps.timeout_secs without progress: keep --dead-after below it.
    Run(RunArgs),
    /// A parameter server: registers with the coordinator, serves the key ranges the ring gives
    /// it, replicates writes down each range's chain, and exits when the job shuts down.
    Serve(ServeArgs),
    /// The coordinator of a multi-machine job: membership, epochs and heartbeats.
    Coordinator(CoordinatorArgs),
    /// An evaluation worker group: reads the servers' current parameters every few seconds
    /// (no clock, no push) and evaluates them on the test set, until the job shuts down.
    Eval(EvalArgs),
    /// Remove a server from a running job: its ranges move to the others first.
    Remove {
        #[arg(long)]
        coordinator: String,
        /// The server's id (printed when it joined).
        #[arg(long)]
        server: u32,
    },
    /// Tell every server of a job to exit.
    Shutdown {
        #[arg(long)]
        coordinator: String,
    },
}

#[derive(clap::Args)]
pub struct RunArgs {
    /// Worker processes (logical workers = data shards).
    #[arg(short = 'n', long, default_value_t = 2)]
    workers: usize,
    /// Server processes.
    #[arg(long, default_value_t = 1)]
    servers: usize,
    /// Seconds of silence after which the coordinator declares a server or worker dead (long
    /// enough that a busy machine's scheduling delays are not mistaken for deaths).
    #[arg(long, default_value_t = 10.0)]
    dead_after: f64,
    /// The training config (`[train] strategy = "ps"`); optional with --exec.
    #[arg(long, required_unless_present = "exec")]
    config: Option<PathBuf>,
    /// The arguments after `--` are the worker program and its arguments (a program that
    /// trains with `kolo::PsWorker`, which reads RANK, WORLD_SIZE, KOLO_PS_COORDINATOR and
    /// KOLO_JOB_TOKEN), instead of more `kolo train` arguments.
    #[arg(long)]
    exec: bool,
    /// Also run an evaluation worker group that evaluates the servers' parameters every this
    /// many seconds while training runs.
    #[arg(long)]
    eval_every: Option<f64>,
    /// More `kolo train` arguments (e.g. --steps 100 --data PATH), or with --exec the worker
    /// program and its arguments.
    #[arg(last = true)]
    train_args: Vec<OsString>,
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// The training config of the job.
    #[arg(long)]
    config: PathBuf,
    /// The coordinator (default: KOLO_PS_COORDINATOR or the config's [ps] coordinator).
    #[arg(long)]
    coordinator: Option<String>,
    /// Training workers of the job.
    #[arg(long)]
    workers: usize,
    /// Seconds between evaluations.
    #[arg(long, default_value_t = 5.0)]
    every: f64,
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The coordinator, host:port.
    #[arg(long)]
    coordinator: String,
    /// Address to listen on (port 0: any free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Deadline of waits (held-back pulls, hand-overs, peers), seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Heartbeat interval, milliseconds.
    #[arg(long, default_value_t = 500)]
    heartbeat_ms: u64,
}

#[derive(clap::Args)]
pub struct CoordinatorArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:29600")]
    listen: String,
    /// Seconds of silence after which a server or worker is declared dead.
    #[arg(long, default_value_t = 3.0)]
    dead_after: f64,
}

/// The job token: `KOLO_JOB_TOKEN` (hex), as every Kolo process reads it.
fn token() -> anyhow::Result<JobToken> {
    let t = std::env::var("KOLO_JOB_TOKEN").map_err(|_| {
        anyhow::anyhow!(
            "KOLO_JOB_TOKEN is not set: every process of a parameter-server job needs the job's token (hex); `kolo ps run` sets it"
        )
    })?;
    JobToken::from_hex(&t).map_err(|e| anyhow::anyhow!("KOLO_JOB_TOKEN: {e}"))
}

pub fn run(cmd: PsCmd) -> anyhow::Result<i32> {
    match cmd {
        PsCmd::Serve(a) => {
            let s = Server::start(ServerOptions {
                listen: a.listen,
                coordinator: a.coordinator,
                token: token()?,
                timeout: Duration::from_secs_f64(a.timeout),
                heartbeat: Duration::from_millis(a.heartbeat_ms.max(1)),
                refuse_transfers: 0,
                reconfigure_delay: std::time::Duration::ZERO,
            })?;
            kolo_base::eline!("kolo ps server {} listening on {}", s.id(), s.addr());
            s.wait()?;
            Ok(0)
        }
        PsCmd::Coordinator(a) => {
            let token = match std::env::var("KOLO_JOB_TOKEN") {
                Ok(_) => token()?,
                Err(_) => {
                    let t = JobToken::generate();
                    kolo_base::eline!("KOLO_JOB_TOKEN={} (give it to every server and worker)", t.to_hex());
                    t
                }
            };
            let c = Coordinator::start(&a.listen, token, Duration::from_secs_f64(a.dead_after))?;
            kolo_base::eline!("kolo ps coordinator listening on {}", c.addr());
            while !c.membership().shutdown {
                std::thread::sleep(Duration::from_millis(200));
            }
            // Give the servers a heartbeat to hear it.
            std::thread::sleep(Duration::from_secs(2));
            Ok(0)
        }
        PsCmd::Remove { coordinator, server } => {
            let m = kolo_ps::coord::remove_server(&coordinator, &token()?, server, Duration::from_secs(30))?;
            kolo_base::eline!("server {server} removed; membership epoch {}: {:?}", m.epoch, m.servers);
            Ok(0)
        }
        PsCmd::Shutdown { coordinator } => {
            kolo_ps::coord::shutdown(&coordinator, &token()?, Duration::from_secs(30))?;
            Ok(0)
        }
        PsCmd::Run(a) => run_job(a),
        PsCmd::Eval(a) => {
            let cfg = kolo_train::Config::load(&a.config)?;
            let coordinator = a
                .coordinator
                .or_else(|| cfg.ps.coordinator.clone())
                .or_else(|| std::env::var("KOLO_PS_COORDINATOR").ok())
                .ok_or_else(|| anyhow::anyhow!("kolo ps eval needs --coordinator (or KOLO_PS_COORDINATOR)"))?;
            let token = token()?;
            let (addr, tok) = (coordinator.clone(), token.clone());
            let stop = move || kolo_ps::coord::membership(&addr, &tok, Duration::from_secs(5)).map_or(true, |m| m.shutdown);
            let evals = kolo_train::ps_worker::run_ps_eval(
                &cfg,
                &coordinator,
                &token,
                a.workers,
                Duration::from_secs_f64(a.every.max(0.05)),
                &stop,
                false,
            )?;
            kolo_base::eline!("[eval group] {} evaluations", evals.len());
            Ok(0)
        }
    }
}

fn run_job(a: RunArgs) -> anyhow::Result<i32> {
    if a.servers == 0 || a.workers == 0 {
        anyhow::bail!("kolo ps run needs at least one server and one worker");
    }
    let cfg = a.config.as_ref().map(|p| kolo_train::Config::load(p)).transpose()?;
    if let (Some(cfg), Some(path)) = (&cfg, &a.config) {
        if cfg.train.strategy != kolo_train::config::Strategy::Ps {
            anyhow::bail!("{}: kolo ps run trains through parameter servers; set [train] strategy = \"ps\"", path.display());
        }
    }
    if a.exec && a.train_args.is_empty() {
        anyhow::bail!("kolo ps run --exec needs the worker program after `--`");
    }
    if a.exec && a.eval_every.is_some() {
        anyhow::bail!("kolo ps run --eval-every evaluates kolo train's built-in model: not with --exec");
    }
    let token = match std::env::var("KOLO_JOB_TOKEN") {
        Ok(_) => token()?,
        Err(_) => JobToken::generate(),
    };
    let coord = Coordinator::start("127.0.0.1:0", token.clone(), Duration::from_secs_f64(a.dead_after))?;
    let addr = coord.addr().to_string();
    let exe = std::env::current_exe()?;
    let mut servers: Vec<Child> = Vec::new();
    for _ in 0..a.servers {
        let child = Command::new(&exe)
            .args(["ps", "serve", "--coordinator", &addr])
            .env("KOLO_JOB_TOKEN", token.to_hex())
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting a server ({}): {e}", exe.display()))?;
        servers.push(child);
    }
    let evaluator = match a.eval_every {
        Some(every) => Some(
            Command::new(&exe)
                .args([
                    "ps",
                    "eval",
                    "--coordinator",
                    &addr,
                    "--workers",
                    &a.workers.to_string(),
                    "--every",
                    &every.to_string(),
                    "--config",
                ])
                .arg(a.config.as_ref().expect("--config without --exec"))
                .env("KOLO_JOB_TOKEN", token.to_hex())
                .stdin(Stdio::null())
                .spawn()
                .map_err(|e| anyhow::anyhow!("starting the evaluation group: {e}"))?,
        ),
        None => None,
    };
    let program: Vec<OsString> = match (a.exec, a.config) {
        (true, _) => a.train_args,
        (false, Some(config)) => {
            let mut p = vec![exe.into_os_string(), "train".into(), "--config".into(), config.into_os_string()];
            p.extend(a.train_args);
            p
        }
        (false, None) => anyhow::bail!("kolo ps run needs --config (or --exec)"),
    };
    let launch = kolo_launch::LaunchConfig {
        nproc_per_node: a.workers,
        token: Some(token.clone()),
        program,
        env: vec![("KOLO_PS_COORDINATOR".into(), addr.clone()), ("KOLO_PS_SERVERS".into(), a.servers.to_string())],
        // A dead worker's shard is taken over by a survivor: the others run on.
        keep_going: true,
        ..kolo_launch::LaunchConfig::default()
    };
    let out = kolo_launch::launch(&launch);
    let adopted = coord.adopted();
    coord.shutdown();
    if let Some(mut e) = evaluator {
        let _ = e.wait();
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for s in servers.iter_mut() {
        loop {
            match s.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    let _ = s.kill();
                    let _ = s.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
    let out = out?;
    let mut code = out.exit_code();
    if !out.success() {
        match out.interrupted_by.is_none().then(|| shards_taken_over(&out.ranks, &adopted)).flatten() {
            Some(taken) => {
                for (dead, by) in taken {
                    let r = out.ranks.iter().find(|r| r.rank == dead).expect("a failed rank");
                    kolo_base::eline!("kolo ps run: worker {dead} {}; worker {by} trained its data shard to the end", r.describe());
                }
                eprint!("{}", out.rank_lines());
                kolo_base::eline!("kolo ps run: the job completed: every data shard was trained");
                code = 0;
            }
            None => {
                eprint!("{}", out.summary());
                let failed =
                    out.ranks.iter().filter(|r| r.end != kolo_launch::RankEnd::Exited(0) && r.end != kolo_launch::RankEnd::Stopped);
                for r in failed.filter(|r| out.interrupted_by.is_none() && !adopted.contains_key(&(r.rank as u32))) {
                    kolo_base::eline!(
                        "kolo ps run: no worker took over worker {}'s data shard: the others stopped waiting for it (ps.timeout_secs) before the coordinator declared it dead (--dead-after {} s of silence), or the workers do not take shards over (a program of yours: PsWorker::take_over_dead_workers)",
                        r.rank,
                        a.dead_after
                    );
                }
            }
        }
    }
    if let Some(dir) = cfg.as_ref().and_then(|c| c.train.timeline_dir.as_ref()) {
        // Workers share no communicator, so each wrote its own trace; merge those that exist.
        let dir = PathBuf::from(dir);
        let files: Vec<PathBuf> = (0..a.workers).map(|w| dir.join(format!("trace-rank{w}.json"))).filter(|p| p.exists()).collect();
        if !files.is_empty() {
            let merged = dir.join("trace.json");
            kolo_train::timeline::merge(&files, &merged).map_err(|e| anyhow::anyhow!("train.timeline_dir {}: {e}", dir.display()))?;
            kolo_base::eline!("timeline: {} (open in https://ui.perfetto.dev)", merged.display());
        }
    }
    Ok(code)
}

/// Whether a parameter-server job whose workers `ranks` ended trained every data shard anyway:
/// each failed worker's shard taken over (`adopted`: dead worker -> the worker that trained
/// it) by a worker that ended well. Returns (dead, adopter) for each failed worker.
fn shards_taken_over(ranks: &[kolo_launch::RankReport], adopted: &BTreeMap<u32, u32>) -> Option<Vec<(usize, u32)>> {
    let ok = |w: usize| ranks.iter().any(|r| r.rank == w && r.end == kolo_launch::RankEnd::Exited(0));
    ranks
        .iter()
        .filter(|r| r.end != kolo_launch::RankEnd::Exited(0))
        .map(|r| adopted.get(&(r.rank as u32)).filter(|&&by| ok(by as usize)).map(|&by| (r.rank, by)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kolo_launch::{RankEnd, RankReport};

    #[test]
    fn a_job_with_a_dead_worker_succeeds_only_when_a_surviving_worker_trained_its_shard() {
        let rank = |rank: usize, end: RankEnd| RankReport { rank, pid: 1, end, elapsed: Duration::ZERO, error: None };
        let ranks = [rank(0, RankEnd::Exited(0)), rank(1, RankEnd::Exited(0)), rank(2, RankEnd::Exited(1))];
        assert_eq!(shards_taken_over(&ranks, &BTreeMap::from([(2, 0)])), Some(vec![(2, 0)]));
        // Nobody took it over, or the adopter failed too.
        assert_eq!(shards_taken_over(&ranks, &BTreeMap::new()), None);
        let two_dead = [rank(0, RankEnd::Signalled(9)), rank(1, RankEnd::Exited(0)), rank(2, RankEnd::Exited(1))];
        assert_eq!(shards_taken_over(&two_dead, &BTreeMap::from([(2, 0)])), None);
        assert_eq!(shards_taken_over(&two_dead, &BTreeMap::from([(2, 0), (0, 1)])), None, "worker 0 died with worker 2's shard");
        assert_eq!(shards_taken_over(&two_dead, &BTreeMap::from([(2, 1), (0, 1)])), Some(vec![(0, 1), (2, 1)]));
        assert_eq!(shards_taken_over(&ranks[..2], &BTreeMap::new()), Some(vec![]));
    }
}
