//! `kolo launch`: runs `nproc` copies of a program on this node as ranks of one job.
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT` (as torchrun sets them) and `KOLO_JOB_TOKEN`. Output lines are
//! prefixed with `[rank N]`. SIGINT/SIGTERM are forwarded. When a rank fails, the others get
//! `grace` to notice and exit on their own (their communicators fail fast when a peer dies),
//! then SIGTERM, then SIGKILL; the launcher exits non-zero with a summary of who failed and how.

use kolo_rendezvous::JobToken;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("kolo launch: {0}")]
    Config(String),
    #[error("kolo launch: cannot start rank {rank} (`{program}`): {source}")]
    Spawn { rank: usize, program: String, source: std::io::Error },
}

#[derive(Clone, Debug)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// `None`: pick a free port (single-node jobs only).
    pub master_port: Option<u16>,
    /// `None`: generate one (single-node jobs only; multi-node jobs must share one).
    pub token: Option<JobToken>,
    pub program: Vec<OsString>,
    /// How long other ranks may take to exit by themselves after one failed.
    pub grace: Duration,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            token: None,
            program: Vec::new(),
            grace: Duration::from_secs(5),
            env: Vec::new(),
        }
    }
}

/// How one rank ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankEnd {
    Exited(i32),
    Signalled(i32),
    /// Stopped by the launcher after another rank failed or on a forwarded signal.
    Stopped,
}

#[derive(Clone, Debug)]
pub struct RankReport {
    pub rank: usize,
    pub pid: u32,
    pub end: RankEnd,
    pub elapsed: Duration,
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub ranks: Vec<RankReport>,
    /// The first rank to fail, if any.
    pub first_failure: Option<usize>,
    /// A signal the launcher received and forwarded.
    pub interrupted_by: Option<i32>,
}

impl Outcome {
    pub fn success(&self) -> bool {
        self.first_failure.is_none() && self.interrupted_by.is_none()
    }

    /// The launcher's exit code: 0, the first failing rank's code, or 128+signal.
    pub fn exit_code(&self) -> i32 {
        if let Some(sig) = self.interrupted_by {
            return 128 + sig;
        }
        match self.first_failure.map(|i| &self.ranks.iter().find(|r| r.rank == i).expect("reported").end) {
            None => 0,
            Some(RankEnd::Exited(c)) => *c,
            Some(RankEnd::Signalled(s)) => 128 + s,
            Some(RankEnd::Stopped) => 1,
        }
    }

    pub fn summary(&self) -> String {
        let mut s = String::new();
        let describe = |r: &RankReport| match &r.end {
            RankEnd::Exited(0) => "exited normally".to_string(),
            RankEnd::Exited(c) => format!("exited with status {c}"),
            RankEnd::Signalled(sig) => format!("was killed by signal {sig} ({})", signal_name(*sig)),
            RankEnd::Stopped => "was stopped by the launcher".to_string(),
        };
        if let Some(f) = self.first_failure {
            let r = self.ranks.iter().find(|r| r.rank == f).expect("reported");
            s.push_str(&format!(
                "kolo launch: job failed: rank {} (pid {}) {} after {:.1}s\n",
                r.rank,
                r.pid,
                describe(r),
                r.elapsed.as_secs_f64()
            ));
        } else if let Some(sig) = self.interrupted_by {
            s.push_str(&format!("kolo launch: interrupted by signal {sig} ({}); stopped all ranks\n", signal_name(sig)));
        }
        for r in &self.ranks {
            s.push_str(&format!("  rank {:>3} pid {:>7}: {}\n", r.rank, r.pid, describe(r)));
        }
        s
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGHUP => "SIGHUP",
        _ => "signal",
    }
}

static RECEIVED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    RECEIVED.store(sig, Ordering::SeqCst);
}

fn install_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn free_port(addr: &str) -> Result<u16, LaunchError> {
    let l = std::net::TcpListener::bind((addr, 0)).map_err(|e| LaunchError::Config(format!("cannot find a free port on {addr}: {e}")))?;
    Ok(l.local_addr().map_err(|e| LaunchError::Config(e.to_string()))?.port())
}

fn pump<R: Read + Send + 'static, W: Write + Send + 'static>(src: R, mut dst: impl FnMut() -> W + Send + 'static, prefix: String) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    let mut w = dst();
                    let _ = write!(w, "{prefix}{}", text);
                    if !text.ends_with('\n') {
                        let _ = writeln!(w);
                    }
                }
            }
        }
    })
}

fn signal_all(children: &[(usize, Child, Instant)], done: &[Option<RankReport>], sig: i32) {
    for ((_, c, _), d) in children.iter().zip(done) {
        if d.is_none() {
            // SAFETY: plain kill(2) on a process group we created (negative pid).
            unsafe {
                libc::kill(-(c.id() as i32), sig);
            }
        }
    }
}

fn end_of(status: ExitStatus) -> RankEnd {
    match (status.code(), status.signal()) {
        (Some(c), _) => RankEnd::Exited(c),
        (None, Some(s)) => RankEnd::Signalled(s),
        _ => RankEnd::Exited(-1),
    }
}

/// Runs the job to completion.
pub fn launch(cfg: &LaunchConfig) -> Result<Outcome, LaunchError> {
    if cfg.program.is_empty() {
        return Err(LaunchError::Config("no program given (usage: kolo launch -n N -- PROGRAM ARGS...)".into()));
    }
    if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
        return Err(LaunchError::Config("--nproc-per-node and --nnodes must be at least 1".into()));
    }
    if cfg.node_rank >= cfg.nnodes {
        return Err(LaunchError::Config(format!("--node-rank {} is not below --nnodes {}", cfg.node_rank, cfg.nnodes)));
    }
    let multi = cfg.nnodes > 1;
    let port = match (cfg.master_port, multi) {
        (Some(p), _) => p,
        (None, false) => free_port(&cfg.master_addr)?,
        (None, true) => return Err(LaunchError::Config("a multi-node job needs --master-port (the same on every node)".into())),
    };
    let token = match (&cfg.token, multi) {
        (Some(t), _) => t.clone(),
        (None, false) => JobToken::generate(),
        (None, true) => {
            return Err(LaunchError::Config(
                "a multi-node job needs a shared secret: pass the same --token-file (or KOLO_JOB_TOKEN) on every node".into(),
            ))
        }
    };
    let world = cfg.nproc_per_node * cfg.nnodes;
    install_handlers();
    let mut children: Vec<(usize, Child, Instant)> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let mut cmd = Command::new(&cfg.program[0]);
        cmd.args(&cfg.program[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", cfg.nproc_per_node.to_string())
            .env("GROUP_RANK", cfg.node_rank.to_string())
            .env("MASTER_ADDR", &cfg.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env("KOLO_JOB_TOKEN", token.to_hex())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: signals reach the rank and everything it started.
            .process_group(0);
        for (k, v) in &cfg.env {
            cmd.env(k, v);
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => {
                let done: Vec<Option<RankReport>> = children.iter().map(|_| None).collect();
                signal_all(&children, &done, libc::SIGKILL);
                return Err(LaunchError::Spawn { rank, program: cfg.program[0].to_string_lossy().into_owned(), source });
            }
        };
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        pumps.push(pump(out, std::io::stdout, format!("[rank {rank}] ")));
        pumps.push(pump(err, std::io::stderr, format!("[rank {rank}] ")));
        children.push((rank, child, Instant::now()));
    }

    // One waiter thread per rank reports exits in the order they happen, so the first failure
    // is the rank that failed first, not the first one a polling sweep happens to look at.
    let (tx, rx) = std::sync::mpsc::channel::<(usize, ExitStatus, Instant)>();
    let mut pids = Vec::new();
    for (i, (_, child, _)) in children.iter_mut().enumerate() {
        pids.push(child.id());
        let pid = child.id() as libc::pid_t;
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut status = 0;
            // SAFETY: waitpid on our own child; the Child handle is never waited on elsewhere.
            let r = unsafe { libc::waitpid(pid, &mut status, 0) };
            let st = if r == pid { ExitStatus::from_raw(status) } else { ExitStatus::from_raw(1 << 8) };
            let _ = tx.send((i, st, Instant::now()));
        });
    }
    drop(tx);
    let mut done: Vec<Option<RankReport>> = children.iter().map(|_| None).collect();
    let mut first_failure = None;
    let mut interrupted_by = None;
    let mut stop_at: Option<(Instant, i32)> = None; // when to send the next signal
    let mut stopping = false;
    while done.iter().any(Option::is_none) {
        if let Ok((i, status, at)) = rx.recv_timeout(Duration::from_millis(10)) {
            let (rank, _, started) = &children[i];
            let end = if stopping && matches!(end_of(status), RankEnd::Signalled(s) if s == libc::SIGTERM || s == libc::SIGKILL) {
                RankEnd::Stopped
            } else {
                end_of(status)
            };
            let failed = end != RankEnd::Exited(0);
            done[i] = Some(RankReport { rank: *rank, pid: pids[i], end, elapsed: at.duration_since(*started) });
            if failed && first_failure.is_none() && interrupted_by.is_none() {
                first_failure = Some(*rank);
                stop_at = Some((Instant::now() + cfg.grace, libc::SIGTERM));
            }
            continue;
        }
        let sig = RECEIVED.swap(0, Ordering::SeqCst);
        if sig != 0 {
            interrupted_by.get_or_insert(sig);
            stopping = true;
            signal_all(&children, &done, sig);
            stop_at = Some((Instant::now() + cfg.grace, libc::SIGKILL));
        }
        if let Some((when, sig)) = stop_at {
            if Instant::now() >= when {
                stopping = true;
                signal_all(&children, &done, sig);
                stop_at = (sig == libc::SIGTERM).then(|| (Instant::now() + Duration::from_secs(3), libc::SIGKILL));
            }
        }
    }
    for p in pumps {
        let _ = p.join();
    }
    let ranks = done.into_iter().map(|d| d.expect("all done")).collect();
    Ok(Outcome { ranks, first_failure, interrupted_by })
}
