//! `kolo fed`: federated averaging on MNIST — the server, a client, and `kolo fed run`, which
//! starts a whole job on this machine (the server in this process, the clients as processes).

use kolo_rendezvous::JobToken;
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum FedCmd {
    /// Start a job on this machine: the server in this process and `[fed] clients` client
    /// processes (under `kolo launch`, each its own shard), until the last round.
    Run {
        /// The config (`[fed]`, an MNIST model and data).
        #[arg(long)]
        config: PathBuf,
        /// Client processes (default: `[fed] clients`).
        #[arg(short = 'n', long)]
        clients: Option<usize>,
    },
    /// The server: waits for the `[fed] clients` clients to join, then samples clients each
    /// round, averages their updates weighted by their example counts, evaluates the model on
    /// the test set after each round.
    Serve {
        #[arg(long)]
        config: PathBuf,
        /// Address to listen on.
        #[arg(long, default_value = "0.0.0.0:29600")]
        listen: String,
    },
    /// A client: trains on its own shard of the training set when sampled and sends only the
    /// change of the model.
    Client {
        #[arg(long)]
        config: PathBuf,
        /// The server's address.
        #[arg(long)]
        server: String,
        /// This client's shard, 0..[fed] clients (default: RANK).
        #[arg(long)]
        client: Option<usize>,
    },
    /// Write client identities for secure aggregation against a server that substitutes keys:
    /// `client-{i}.key` (one per client, mode 0600: give each client its own) and `roster.txt`
    /// (every client and the server). Name the directory in `[fed] identities`.
    Keygen {
        /// Clients of the job (ids 0..N).
        #[arg(long)]
        clients: u32,
        /// A directory that does not hold identities yet.
        #[arg(long)]
        out: PathBuf,
    },
}

/// `[fed] identities` from KOLO_FED_IDENTITIES when set (`kolo fed run` hands its fresh set to
/// the processes it starts this way).
fn load(config: &std::path::Path) -> anyhow::Result<kolo_train::Config> {
    let mut cfg = kolo_train::Config::load(config)?;
    if let (Some(f), Ok(d)) = (cfg.fed.as_mut(), std::env::var("KOLO_FED_IDENTITIES")) {
        f.identities = Some(d);
    }
    Ok(cfg)
}

fn token() -> anyhow::Result<JobToken> {
    let hex =
        std::env::var("KOLO_JOB_TOKEN").map_err(|_| anyhow::anyhow!("KOLO_JOB_TOKEN is not set (the federated job's secret, hex)"))?;
    JobToken::from_hex(&hex).map_err(|e| anyhow::anyhow!("KOLO_JOB_TOKEN: {e}"))
}

fn say(m: &str) {
    kolo_base::eline!("{m}");
}

pub fn run(cmd: FedCmd) -> anyhow::Result<i32> {
    match cmd {
        FedCmd::Keygen { clients, out } => {
            kolo_fed::identity::generate(&out, clients).map_err(anyhow::Error::msg)?;
            say(&format!(
                "kolo fed: identities of clients 0..{clients} in {} (roster.txt for everyone, client-N.key for client N alone)",
                out.display()
            ));
            Ok(0)
        }
        FedCmd::Serve { config, listen } => {
            let cfg = load(&config)?;
            let expect = cfg.fed.as_ref().map_or(1, |f| f.clients);
            let s = kolo_fed::job::serve(&cfg, &listen, token()?, expect, |a| kolo_base::eline!("kolo fed: listening on {a}"), &say)?;
            summary(&s);
            Ok(0)
        }
        FedCmd::Client { config, server, client } => {
            let cfg = load(&config)?;
            let index = match client {
                Some(c) => c,
                None => std::env::var("RANK")
                    .ok()
                    .and_then(|r| r.parse().ok())
                    .ok_or_else(|| anyhow::anyhow!("kolo fed client needs --client (or RANK)"))?,
            };
            let r = kolo_fed::job::client(&cfg, &server, &token()?, index, false)?;
            kolo_base::eline!(
                "client {index}: trained in {} round(s) on {} examples; sent {:.2} MB, received {:.2} MB",
                r.rounds_trained,
                r.shard.len(),
                r.bytes_out as f64 / 1e6,
                r.bytes_in as f64 / 1e6
            );
            Ok(0)
        }
        FedCmd::Run { config, clients } => {
            let mut cfg = load(&config)?;
            let f = cfg.fed.as_mut().ok_or_else(|| anyhow::anyhow!("{}: no [fed] section", config.display()))?;
            // A secure job that names no identities gets a fresh set for this run.
            let fresh =
                (f.secure && f.identities.is_none()).then(|| std::env::temp_dir().join(format!("kolo-fed-ids-{}", std::process::id())));
            if let Some(d) = &fresh {
                let _ = std::fs::remove_dir_all(d);
                kolo_fed::identity::generate(d, f.clients as u32).map_err(anyhow::Error::msg)?;
                f.identities = Some(d.display().to_string());
            }
            let f = cfg.fed.as_ref().expect("checked above");
            let n = clients.unwrap_or(f.clients);
            if n > f.clients {
                anyhow::bail!("{n} client processes for a job split into {} shards ([fed] clients)", f.clients);
            }
            let token = match std::env::var("KOLO_JOB_TOKEN") {
                Ok(_) => token()?,
                Err(_) => JobToken::generate(),
            };
            let (tx, rx) = std::sync::mpsc::channel();
            let (cfg2, tok) = (cfg.clone(), token.clone());
            let server = std::thread::spawn(move || {
                kolo_fed::job::serve(&cfg2, "127.0.0.1:0", tok, n, |a| tx.send(a.to_string()).expect("main waits"), &say)
            });
            let addr = match rx.recv() {
                Ok(a) => a,
                Err(_) => {
                    return Err(server
                        .join()
                        .map_err(|_| anyhow::anyhow!("the server thread panicked"))?
                        .err()
                        .map_or_else(|| anyhow::anyhow!("the server stopped"), anyhow::Error::from))
                }
            };
            let exe = std::env::current_exe()?;
            let program: Vec<OsString> = vec![
                exe.into_os_string(),
                "fed".into(),
                "client".into(),
                "--config".into(),
                config.into_os_string(),
                "--server".into(),
                addr.into(),
            ];
            let env = fresh.iter().map(|d| ("KOLO_FED_IDENTITIES".to_string(), d.display().to_string())).collect();
            let launch =
                kolo_launch::LaunchConfig { nproc_per_node: n, token: Some(token), program, env, ..kolo_launch::LaunchConfig::default() };
            let out = kolo_launch::launch(&launch);
            if let Some(d) = &fresh {
                let _ = std::fs::remove_dir_all(d);
            }
            let out = out?;
            if !out.success() {
                // The launcher stopped every client: the server would only wait out its join
                // deadline for them.
                eprint!("{}", out.summary());
                return Ok(out.exit_code());
            }
            let s = server.join().map_err(|_| anyhow::anyhow!("the server thread panicked"))??;
            summary(&s);
            Ok(out.exit_code())
        }
    }
}

fn summary(s: &kolo_fed::job::FedSummary) {
    if let Some(e) = s.evals.last() {
        let late: usize = s.rounds.iter().map(|r| r.late.len()).sum();
        kolo_base::eline!(
            "done: {} rounds, final test loss {:.4}, accuracy {:.2}%; {late} late client update(s) left out",
            s.rounds.len(),
            e.loss,
            e.accuracy.unwrap_or(0.0) * 100.0
        );
    }
}
