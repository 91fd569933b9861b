//! `kolo launch`: runs `nproc` copies of a program on this node as ranks of one job.
//!
//! Each child gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `MASTER_ADDR`, `MASTER_PORT` (as torchrun sets them) and `KOLO_JOB_TOKEN`. With several
//! ranks per host and no `RAYON_NUM_THREADS` in the launcher's environment, each rank gets
//! `RAYON_NUM_THREADS` = cores / ranks ([`threads_per_rank`]; torchrun does the same with
//! `OMP_NUM_THREADS`): every rank's thread pool sized for the whole machine oversubscribes it. Output lines are
//! prefixed with `[rank N]`. SIGINT/SIGTERM are forwarded. When a rank fails, the others get
//! `grace` to notice and exit on their own (their communicators fail fast when a peer dies),
//! then SIGTERM, then SIGKILL; the launcher exits non-zero with a summary of who failed and how.
//! With [`LaunchConfig::keep_going`] (a parameter-server job, whose workers share no
//! communicator and take over a dead worker's data shard) the others run on to their own end.
//!
//! Which rank failed *first* is not knowable from exit order alone: when a rank exits, its
//! sockets close before its parent is told, so a survivor can notice, fail and be reaped first.
//! As torchelastic does with its error files, every rank gets `KOLO_ERROR_FILE`; a failing rank
//! records its error there (see [`error_file`]), including the peer it lost if that is why it
//! failed. The summary names the root cause: the earliest failure not caused by losing a rank
//! that itself failed.
//!
//! Elastic jobs ([`launch_elastic`], `--min-nodes`): on one host each rank counts as a node.
//! When ranks die, the survivors are stopped and the job starts again as a new round with the
//! surviving number of ranks (a fresh rendezvous: new port, ranks renumbered), as long as at
//! least `min` remain and restarts are left; every rank sees `KOLO_RESTART_COUNT` (the round)
//! and resumes from the latest checkpoint itself.

pub mod error_file;

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
    /// Bind each rank to its own cores ([`core_sets`]), as Open MPI binds to cores by default.
    /// Off by default: on this 2-core machine a bound DDP rank's communication thread shares
    /// its one core with the compute thread (GPT step +2%); the collectives benchmark binds
    /// (run-to-run spread of a 2-rank all-reduce from 2x to 2%).
    pub bind: bool,
    /// A failed rank does not stop the others: they run to their own end (a parameter-server
    /// job's workers share no communicator, and a survivor takes over a dead worker's data
    /// shard). The outcome still names the failure.
    pub keep_going: bool,
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
            bind: false,
            keep_going: false,
        }
    }
}

/// The CPUs this process may run on (its affinity mask: a cgroup or `taskset` narrows it).
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is valid; sched_getaffinity fills it for this process.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize).filter(|c| unsafe { libc::CPU_ISSET(*c, &set) }).collect()
}

/// The cores each of `ranks` local ranks is bound to: the `allowed` CPUs cut into consecutive
/// equal sets (the remainder left to whoever needs it), as Open MPI's default `--bind-to core`
/// with `--map-by slot:PE=k`. A rank that keeps its core does not lose its cache to migrations
/// or share a core with a peer it is waiting for. `None` (no binding) when the ranks outnumber
/// the CPUs: Open MPI does not bind oversubscribed runs either.
pub fn core_sets(allowed: &[usize], ranks: usize) -> Option<Vec<Vec<usize>>> {
    if ranks == 0 || ranks > allowed.len() {
        return None;
    }
    let per = allowed.len() / ranks;
    Some((0..ranks).map(|r| allowed[r * per..(r + 1) * per].to_vec()).collect())
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
    /// What the rank recorded in its error file, if it failed and wrote one.
    pub error: Option<error_file::RankError>,
}

#[derive(Clone, Debug)]
pub struct Outcome {
    pub ranks: Vec<RankReport>,
    /// The rank whose failure brought the job down (see the module docs), if any.
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
        if let Some(f) = self.first_failure {
            let r = self.ranks.iter().find(|r| r.rank == f).expect("reported");
            let hung = if r.end == RankEnd::Stopped { " (the other ranks were waiting for it: hung?)" } else { "" };
            s.push_str(&format!(
                "kolo launch: job failed: rank {} (pid {}) {} after {:.1}s{}{hung}\n",
                r.rank,
                r.pid,
                r.describe(),
                r.elapsed.as_secs_f64(),
                r.error_line()
            ));
        } else if let Some(sig) = self.interrupted_by {
            s.push_str(&format!("kolo launch: interrupted by signal {sig} ({}); stopped all ranks\n", signal_name(sig)));
        }
        s + &self.rank_lines()
    }

    /// One line per rank: how it ended, and the first line of its error.
    pub fn rank_lines(&self) -> String {
        self.ranks.iter().map(|r| format!("  rank {:>3} pid {:>7}: {}{}\n", r.rank, r.pid, r.describe(), r.error_line())).collect()
    }
}

impl RankReport {
    /// How the rank ended, in words.
    pub fn describe(&self) -> String {
        match &self.end {
            RankEnd::Exited(0) => "exited normally".to_string(),
            RankEnd::Exited(c) => format!("exited with status {c}"),
            RankEnd::Signalled(sig) => format!("was killed by signal {sig} ({})", signal_name(*sig)),
            RankEnd::Stopped => "was stopped by the launcher".to_string(),
        }
    }

    /// ": " and the first line of the error the rank recorded, if any.
    fn error_line(&self) -> String {
        self.error.as_ref().map(|e| format!(": {}", e.first_line())).unwrap_or_default()
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

/// A listening socket on a free port of `addr`, for rank 0's store: handed to rank 0 open
/// (`KOLO_STORE_FD`), so that no other process can take the port between its choice and
/// rank 0's bind (an outgoing connection's ephemeral port, another job's free port).
fn store_listener(addr: &str) -> Result<(std::net::TcpListener, u16), LaunchError> {
    let l = std::net::TcpListener::bind((addr, 0)).map_err(|e| LaunchError::Config(format!("cannot find a free port on {addr}: {e}")))?;
    let port = l.local_addr().map_err(|e| LaunchError::Config(e.to_string()))?.port();
    Ok((l, port))
}

fn pump<R: Read + Send + 'static, W: Write + Send + 'static>(
    src: R,
    mut dst: impl FnMut() -> W + Send + 'static,
    prefix: String,
) -> std::thread::JoinHandle<()> {
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

/// Elastic restarts: the fewest ranks to go on with, how many restarts, the pause before each.
#[derive(Clone, Debug)]
pub struct Elastic {
    pub min: usize,
    pub max_restarts: u32,
    pub backoff: Duration,
}

/// What an elastic launcher does after a round ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// The job is over (succeeded, interrupted, or failed with no way on).
    Stop(Option<String>),
    /// Start another round with this many ranks; `dead` lists the ranks lost.
    Restart { ranks: usize, dead: Vec<usize> },
}

/// The ranks of a failed round that died by themselves: killed by a signal the launcher did
/// not send, or the root cause; ranks that only lost a peer, or were stopped, survive.
pub fn dead_ranks(out: &Outcome) -> Vec<usize> {
    let mut dead: Vec<usize> = out.ranks.iter().filter(|r| matches!(r.end, RankEnd::Signalled(_))).map(|r| r.rank).collect();
    if let Some(f) = out.first_failure {
        if !dead.contains(&f) {
            dead.push(f);
        }
    }
    dead.sort_unstable();
    dead
}

/// Plans the next round of an elastic job after `round` (0-based) ended with `out`.
pub fn next_round(out: &Outcome, ranks: usize, round: u32, e: &Elastic) -> Next {
    if out.success() || out.interrupted_by.is_some() {
        return Next::Stop(None);
    }
    let dead = dead_ranks(out);
    let left = ranks.saturating_sub(dead.len());
    if left < e.min {
        return Next::Stop(Some(format!(
            "kolo launch: {} of {ranks} ranks died ({dead:?}); {left} left, below --min-nodes {}",
            dead.len(),
            e.min
        )));
    }
    if round >= e.max_restarts {
        return Next::Stop(Some(format!("kolo launch: ranks {dead:?} died and all {} restarts (--max-restarts) are used", e.max_restarts)));
    }
    Next::Restart { ranks: left, dead }
}

/// Runs an elastic job on this node: rounds of [`launch`] until one succeeds, is interrupted,
/// or [`next_round`] says stop. Returns the last round's outcome and the rounds run.
pub fn launch_elastic(cfg: &LaunchConfig, e: &Elastic) -> Result<(Outcome, u32), LaunchError> {
    if cfg.nnodes != 1 {
        return Err(LaunchError::Config("elastic jobs (--min-nodes) run on one host for now: each rank counts as a node".into()));
    }
    if e.min == 0 || e.min > cfg.nproc_per_node {
        return Err(LaunchError::Config(format!("--min-nodes {} must be between 1 and the {} ranks started", e.min, cfg.nproc_per_node)));
    }
    let mut ranks = cfg.nproc_per_node;
    let mut round = 0;
    loop {
        let mut c = cfg.clone();
        c.nproc_per_node = ranks;
        c.master_port = None;
        c.env.push(("KOLO_RESTART_COUNT".into(), round.to_string()));
        c.env.push(("KOLO_ELASTIC".into(), "1".into()));
        let out = launch(&c)?;
        match next_round(&out, ranks, round, e) {
            Next::Stop(why) => {
                if let Some(w) = why {
                    eprintln!("{w}");
                }
                return Ok((out, round));
            }
            Next::Restart { ranks: left, dead } => {
                let t = Instant::now();
                eprint!("{}", out.summary());
                eprintln!(
                    "kolo launch: elastic: rank(s) {dead:?} lost; restarting on {left} ranks (round {}) in {:.1}s",
                    round + 1,
                    e.backoff.as_secs_f64()
                );
                std::thread::sleep(e.backoff.saturating_sub(t.elapsed()));
                ranks = left;
                round += 1;
            }
        }
    }
}

/// The rank that brought the job down, given the failed ranks in the order they were reaped:
/// the first one that did not fail merely because it lost a peer that failed too. A rank that
/// lost a peer which is still fine (or was only stopped by the launcher) counts as a cause.
pub fn root_cause(failed_in_order: &[&RankReport]) -> Option<usize> {
    // Every rank that says why it failed blames the same rank: that one (also when it did not
    // fail by itself but hung and was stopped by the launcher).
    let blamed: Vec<usize> = failed_in_order.iter().filter_map(|r| r.error.as_ref().and_then(|e| e.lost_rank)).collect();
    let explained = failed_in_order.iter().filter(|r| r.error.is_some()).count();
    if let Some(&x) = blamed.first() {
        if blamed.len() == explained && blamed.iter().all(|&b| b == x) && failed_in_order.iter().any(|r| r.rank == x) {
            return Some(x);
        }
    }
    let failed = |rank: usize| failed_in_order.iter().any(|r| r.rank == rank && r.end != RankEnd::Stopped);
    failed_in_order
        .iter()
        .find(|r| !r.error.as_ref().and_then(|e| e.lost_rank).is_some_and(|lost| lost != r.rank && failed(lost)))
        .or(failed_in_order.first())
        .map(|r| r.rank)
}

/// The `RAYON_NUM_THREADS` to give each of `local_ranks` ranks on a host with `cores` cores:
/// `None` when the launcher's own environment already sets it (`set`; the ranks inherit it) or
/// there is one rank, else the cores shared out evenly (at least 1).
pub fn threads_per_rank(set: Option<&std::ffi::OsStr>, cores: usize, local_ranks: usize) -> Option<usize> {
    if set.is_some() || local_ranks <= 1 {
        return None;
    }
    Some((cores / local_ranks).max(1))
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
    let (listener, port) = match (cfg.master_port, multi) {
        (Some(p), _) => (None, p),
        (None, false) => store_listener(&cfg.master_addr).map(|(l, p)| (Some(l), p))?,
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
    let errors = error_file::ErrorDir::create()
        .map_err(|e| LaunchError::Config(format!("cannot create a directory for the ranks' error files: {e}")))?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = threads_per_rank(std::env::var_os("RAYON_NUM_THREADS").as_deref(), cores, cfg.nproc_per_node);
    if let Some(t) = threads {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "kolo launch: RAYON_NUM_THREADS is not set; each rank gets RAYON_NUM_THREADS={t} ({cores} cores / {} ranks on this host). Set it to choose another value.",
                cfg.nproc_per_node
            )
        });
    }
    let cores_of = if cfg.bind { core_sets(&allowed_cpus(), cfg.nproc_per_node) } else { None };
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
            .env(error_file::ENV, errors.path_for(rank))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: signals reach the rank and everything it started.
            .process_group(0);
        if let Some(t) = threads {
            cmd.env("RAYON_NUM_THREADS", t.to_string());
        }
        if let Some(cpus) = cores_of.as_ref().map(|c| c[local].clone()) {
            // SAFETY: an all-zero cpu_set_t is a valid empty set; CPU_SET on indices below
            // CPU_SETSIZE (allowed_cpus only returns those).
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            for c in &cpus {
                unsafe { libc::CPU_SET(*c, &mut set) };
            }
            cmd.env("KOLO_CPUS", cpus.iter().map(usize::to_string).collect::<Vec<_>>().join(","));
            // SAFETY: sched_setaffinity is async-signal-safe; the set was built before fork.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if let (Some(l), 0) = (&listener, rank) {
            use std::os::fd::AsRawFd;
            let fd = l.as_raw_fd();
            cmd.env(kolo_rendezvous::STORE_FD, fd.to_string());
            // SAFETY: fcntl is async-signal-safe; it clears close-on-exec on rank 0's copy of
            // the listener only (the child's descriptor table), so the program inherits it.
            unsafe {
                cmd.pre_exec(move || match libc::fcntl(fd, libc::F_SETFD, 0) {
                    -1 => Err(std::io::Error::last_os_error()),
                    _ => Ok(()),
                });
            }
        }
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
    // Rank 0 holds the store's socket now; a copy here would keep its port answering (queueing
    // connections no one accepts) after rank 0 died.
    drop(listener);

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
    let mut failed_in_order = Vec::new();
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
            let error = if failed { error_file::read(&errors.path_for(*rank)) } else { None };
            done[i] = Some(RankReport { rank: *rank, pid: pids[i], end, elapsed: at.duration_since(*started), error });
            if failed {
                failed_in_order.push(i);
                if stop_at.is_none() && interrupted_by.is_none() && !cfg.keep_going {
                    stop_at = Some((Instant::now() + cfg.grace, libc::SIGTERM));
                }
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
    let ranks: Vec<RankReport> = done.into_iter().map(|d| d.expect("all done")).collect();
    let first_failure = if interrupted_by.is_some() {
        None
    } else {
        let order: Vec<&RankReport> = failed_in_order.iter().map(|&i| &ranks[i]).collect();
        root_cause(&order)
    };
    Ok(Outcome { ranks, first_failure, interrupted_by })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rank: usize, end: RankEnd, lost_rank: Option<usize>) -> RankReport {
        let error = lost_rank.map(|l| error_file::RankError { lost_rank: Some(l), message: format!("lost rank {l}") });
        RankReport { rank, pid: 100 + rank as u32, end, elapsed: Duration::ZERO, error }
    }

    #[test]
    fn ranks_share_the_cores_unless_the_thread_count_is_set() {
        use std::ffi::OsStr;
        assert_eq!(threads_per_rank(None, 16, 4), Some(4));
        assert_eq!(threads_per_rank(None, 2, 2), Some(1));
        assert_eq!(threads_per_rank(None, 7, 2), Some(3));
        assert_eq!(threads_per_rank(None, 2, 4), Some(1), "more ranks than cores: one thread each");
        assert_eq!(threads_per_rank(None, 16, 1), None, "one rank keeps rayon's default");
        assert_eq!(threads_per_rank(Some(OsStr::new("3")), 16, 4), None, "the user's value is inherited");
    }

    #[test]
    fn bound_ranks_get_disjoint_consecutive_cores_unless_oversubscribed() {
        assert_eq!(core_sets(&[0, 1], 2), Some(vec![vec![0], vec![1]]));
        assert_eq!(core_sets(&[0, 1, 2, 3, 4, 5, 6], 2), Some(vec![vec![0, 1, 2], vec![3, 4, 5]]), "the remainder is left free");
        assert_eq!(core_sets(&[4, 5, 8, 9], 2), Some(vec![vec![4, 5], vec![8, 9]]), "within the launcher's own mask");
        assert_eq!(core_sets(&[0, 1], 4), None, "more ranks than cores: nobody is bound");
        assert_eq!(core_sets(&[0, 1], 0), None);
    }

    #[test]
    fn elastic_rounds_go_on_with_the_survivors_while_enough_remain() {
        let e = Elastic { min: 3, max_restarts: 2, backoff: Duration::ZERO };
        let ok = |ranks: Vec<RankReport>, first: Option<usize>| Outcome { ranks, first_failure: first, interrupted_by: None };
        // Rank 2 SIGKILLed; the others lost it or were stopped.
        let out = ok(
            vec![
                report(0, RankEnd::Exited(1), Some(2)),
                report(1, RankEnd::Stopped, None),
                report(2, RankEnd::Signalled(9), None),
                report(3, RankEnd::Exited(1), Some(2)),
            ],
            Some(2),
        );
        assert_eq!(dead_ranks(&out), vec![2]);
        assert_eq!(next_round(&out, 4, 0, &e), Next::Restart { ranks: 3, dead: vec![2] });
        // Restarts used up, or too few left.
        assert!(matches!(next_round(&out, 4, 2, &e), Next::Stop(Some(m)) if m.contains("restarts")));
        let two_dead = ok(
            vec![
                report(0, RankEnd::Signalled(9), None),
                report(1, RankEnd::Exited(1), Some(0)),
                report(2, RankEnd::Signalled(9), None),
                report(3, RankEnd::Stopped, None),
            ],
            Some(0),
        );
        assert!(matches!(next_round(&two_dead, 4, 0, &e), Next::Stop(Some(m)) if m.contains("below --min-nodes 3")));
        // A rank that exits with an error by itself is dead too; success stops.
        let crashed = ok(
            vec![
                report(0, RankEnd::Exited(3), None),
                report(1, RankEnd::Exited(1), Some(0)),
                report(2, RankEnd::Stopped, None),
                report(3, RankEnd::Stopped, None),
            ],
            Some(0),
        );
        assert_eq!(next_round(&crashed, 4, 1, &e), Next::Restart { ranks: 3, dead: vec![0] });
        assert_eq!(next_round(&ok(vec![report(0, RankEnd::Exited(0), None)], None), 1, 0, &e), Next::Stop(None));
    }

    #[test]
    fn root_cause_skips_survivors_that_only_lost_a_failed_peer() {
        let r2 = report(2, RankEnd::Exited(1), Some(1));
        let r1 = report(1, RankEnd::Exited(3), None);
        let r0 = report(0, RankEnd::Exited(1), Some(1));
        assert_eq!(root_cause(&[&r2, &r1, &r0]), Some(1));
        assert_eq!(root_cause(&[&r1, &r2, &r0]), Some(1));
        // Everyone who says why blames rank 1, which never failed by itself but was stopped by
        // the launcher (it hung, and they timed out waiting for it): rank 1 is the cause.
        let s1 = report(1, RankEnd::Stopped, None);
        assert_eq!(root_cause(&[&r2, &r0, &s1]), Some(1));
        // Blame that disagrees falls back to the first failure that is not a consequence.
        let r0_other = report(0, RankEnd::Exited(1), Some(3));
        assert_eq!(root_cause(&[&r2, &r0_other, &s1]), Some(2));
        // Everyone blames someone else: fall back to the first reaped.
        let a = report(0, RankEnd::Exited(1), Some(1));
        let b = report(1, RankEnd::Exited(1), Some(0));
        assert_eq!(root_cause(&[&b, &a]), Some(1));
        assert_eq!(root_cause(&[]), None);
        let k = report(3, RankEnd::Signalled(9), None);
        assert_eq!(root_cause(&[&r2, &k]), Some(2), "rank 2 lost rank 1, which did not fail");
    }
}
