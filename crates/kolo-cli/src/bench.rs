//! `kolo bench`: collective throughput like nccl-tests (time, algbw, busbw, correctness per
//! size), and the machine limits to compare against (loopback TCP both ways at once, memcpy).

use crate::comm_args::CommArgs;
use kolo_base::{ByteSize, DType, Rank};
use kolo_comm::{bf16, f16, BufMut, BufRef, Communicator, Element, ReduceOp};
use serde_json::json;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Collective bandwidth and latency per message size (run under `kolo launch`, or pass -n).
    ///
    /// Sizes follow nccl-tests: the all-reduced/broadcast buffer, the all-gather output, the
    /// reduce-scatter input, the all-to-all input per rank. algbw = size / time; busbw = algbw x
    /// 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all), 1 (broadcast).
    /// time = max over ranks of the mean time of back-to-back ops, median over trials.
    Collectives(CollArgs),
    /// Loopback TCP carrying data both directions at once, and single-thread memcpy: the limits
    /// the TCP and shared-memory transports work against.
    ///
    /// The bytes move in several ways: two blocking threads per end, and one non-blocking thread
    /// per end (as Kolo's engine) with at most 64 KiB ... 1 MiB or unlimited in flight; from and
    /// into 1 MiB buffers reused (in cache: the kernel's own limit) or whole buffers of SIZE
    /// touched once (what a collective of that size moves). The bound printed is half the best
    /// aggregate.
    Loopback(LoopArgs),
    /// Parameter-server push and pull throughput: a coordinator and SERVERS servers in this
    /// process (real TCP), one worker pushing and pulling the whole table, against the
    /// loopback TCP figure of this machine.
    Ps(PsArgs),
    /// Hogwild vs SGD under a lock vs one thread: sparse logistic regression on UCI wine
    /// (pairwise-crossed one-hot features), updates/s and held-out quality.
    Hogwild {
        /// The wine CSV (shipped in test-data/tabular/).
        #[arg(long, default_value = "test-data/tabular/winequality-red.csv")]
        data: std::path::PathBuf,
        #[arg(long, default_value_t = 20)]
        epochs: usize,
    },
    /// The flight recorder's cost per collective: recording the start and the end of N ops
    /// into a communicator's ring of the last 64.
    Recorder {
        #[arg(long, default_value_t = 1_000_000)]
        ops: u64,
    },
    /// Compute of one device as the planner models it: candle's f32 matmul (GFLOP/s of square
    /// GEMMs per size, the planner's efficiency curve) and elementwise throughput (GB/s moved
    /// by a + b, the planner's memory-bound rate). Threads: RAYON_NUM_THREADS.
    Compute {
        /// Square GEMM sizes.
        #[arg(long, value_delimiter = ',', default_values_t = [64usize, 128, 256, 512, 1024, 2048])]
        sizes: Vec<usize>,
        /// Peak FLOP/s to print efficiencies against, e.g. 166GFLOPS.
        #[arg(long)]
        peak: Option<String>,
        /// Trials per size (the best is reported).
        #[arg(long, default_value_t = 5)]
        trials: usize,
    },
    /// Sandblaster L-BFGS on the parameter servers with one slowed worker: time per iteration
    /// with and without backup tasks, against no slowed worker.
    Sandblaster {
        /// The UCI wine-quality CSV (a header row; quality is the last column).
        #[arg(long, default_value = "test-data/tabular/winequality-red.csv")]
        data: std::path::PathBuf,
        /// Delay of the slowed worker per portion, milliseconds.
        #[arg(long, default_value_t = 50)]
        slow_ms: u64,
        /// L-BFGS iterations per run.
        #[arg(long, default_value_t = 20)]
        iterations: usize,
    },
}

#[derive(clap::Args)]
pub struct PsArgs {
    #[arg(long, default_value_t = 1)]
    servers: usize,
    /// Values (f32 keys) in the table.
    #[arg(long, default_value_t = 16 << 20)]
    values: u64,
    /// Values per key range.
    #[arg(long, default_value_t = 65536)]
    chunk: u32,
    #[arg(long, default_value_t = 0)]
    replication: u32,
    /// Push+pull rounds (the median is reported).
    #[arg(long, default_value_t = 5)]
    trials: usize,
}

#[derive(clap::Args)]
pub struct CollArgs {
    #[command(flatten)]
    comm: CommArgs,
    /// all_reduce, all_gather, reduce_scatter, broadcast, all_to_all
    #[arg(long, default_value = "all_reduce")]
    op: String,
    #[arg(long, default_value = "f32")]
    dtype: DType,
    #[arg(long, default_value = "4KiB")]
    min: ByteSize,
    #[arg(long, default_value = "256MiB")]
    max: ByteSize,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 4)]
    factor: u64,
    /// Trials per size (median reported).
    #[arg(long, default_value_t = 5)]
    trials: usize,
    /// Target seconds per trial (sets the number of back-to-back ops).
    #[arg(long, default_value_t = 0.2)]
    trial_secs: f64,
    /// Print one JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// Start this many local ranks (when not already under a launcher).
    #[arg(short = 'n', long = "nproc", default_value_t = 1)]
    nproc: usize,
    /// Measure the all-reduce algorithms (doubling, halving, ring, tree) at each size, in turn
    /// within every trial, and write their crossovers for this world size and link kind into
    /// FILE (other tables in it kept): a size takes the fastest algorithm unless the built-in
    /// choice is within 5 % of it. Pass the file to a job with --tuning FILE. E.g. `kolo bench
    /// collectives -n 2 --min 1KiB --max 16MiB --factor 2 --tune tuning.toml`.
    #[arg(long, value_name = "FILE")]
    tune: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
pub struct LoopArgs {
    /// Bytes each direction carries per trial.
    #[arg(long, default_value = "256MiB")]
    size: ByteSize,
    #[arg(long, default_value_t = 5)]
    trials: usize,
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: BenchCmd) -> anyhow::Result<i32> {
    match cmd {
        BenchCmd::Collectives(a) => collectives(a),
        BenchCmd::Loopback(a) => loopback(a),
        BenchCmd::Ps(a) => ps_bench(a),
        BenchCmd::Hogwild { data, epochs } => hogwild_bench(&data, epochs),
        BenchCmd::Recorder { ops } => {
            let r = kolo_collectives::recorder::Recorder::default();
            let t = std::time::Instant::now();
            for seq in 0..ops {
                r.start(seq, kolo_comm::OpKind::AllReduce, "ring", 4096);
                r.finish(seq, Ok(()));
            }
            let ns = t.elapsed().as_secs_f64() * 1e9 / ops.max(1) as f64;
            println!("flight recorder: {ns:.0} ns per collective (start + finish, {ops} ops)");
            Ok(0)
        }
        BenchCmd::Sandblaster { data, slow_ms, iterations } => sandblaster_bench(&data, slow_ms, iterations),
        BenchCmd::Compute { sizes, peak, trials } => compute_bench(&sizes, peak.as_deref(), trials),
    }
}

/// Best-of-`trials` seconds of `f`, each trial repeating it until 0.2 s have passed.
fn best_secs(trials: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut best = f64::INFINITY;
    for _ in 0..trials.max(1) {
        let (t, mut reps) = (std::time::Instant::now(), 0u32);
        while reps == 0 || t.elapsed().as_secs_f64() < 0.2 {
            f()?;
            reps += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    Ok(best)
}

fn compute_bench(sizes: &[usize], peak: Option<&str>, trials: usize) -> anyhow::Result<i32> {
    use candle_core::{Device, Tensor};
    let peak = peak.map(kolo_plan::parse_quantity).transpose().map_err(anyhow::Error::msg)?;
    let dev = Device::Cpu;
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into());
    println!("# candle f32 on the CPU, {} cores, threads {threads}, load {}", num_cpus(), loadavg());
    println!("{:>6} {:>12} {:>10}", "n", "GFLOP/s", "of peak");
    for &n in sizes {
        let a = Tensor::randn(0f32, 1.0, (n, n), &dev)?;
        let b = Tensor::randn(0f32, 1.0, (n, n), &dev)?;
        let s = best_secs(trials, || {
            a.matmul(&b)?;
            Ok(())
        })?;
        let flops = 2.0 * (n as f64).powi(3) / s;
        let of = peak.map(|p| format!("{:.3}", flops / p)).unwrap_or_else(|| "-".into());
        println!("{n:>6} {:>12.2} {of:>10}", flops / 1e9);
    }
    // Memory-bound operations of a transformer layer, as GB/s of f32 read and written.
    let len = 16 << 20;
    let a = Tensor::randn(0f32, 1.0, (len / 1024, 1024), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (len / 1024, 1024), &dev)?;
    type Op<'a> = (&'a str, f64, Box<dyn Fn() -> candle_core::Result<Tensor> + 'a>);
    let ops: Vec<Op> = vec![
        ("a + b", 12.0, Box::new(|| &a + &b)),
        ("a * 2", 8.0, Box::new(|| &a * 2.0)),
        ("gelu(a)", 8.0, Box::new(|| a.gelu())),
        ("exp(a)", 8.0, Box::new(|| a.exp())),
        ("softmax(a, -1)", 8.0, Box::new(|| candle_nn::ops::softmax_last_dim(&a))),
        ("a.t().contiguous()", 8.0, Box::new(|| a.t()?.contiguous())),
        ("sum(a, -1)", 4.0, Box::new(|| a.sum_keepdim(1))),
    ];
    let mut rates = Vec::new();
    for (name, bytes_per_value, op) in &ops {
        let s = best_secs(trials, || {
            op()?;
            Ok(())
        })?;
        let rate = bytes_per_value * len as f64 / s / 1e9;
        rates.push(rate);
        println!("{name:<20} {rate:>8.2} GB/s");
    }
    let harmonic = rates.len() as f64 / rates.iter().map(|r| 1.0 / r).sum::<f64>();
    println!("memory-bound rate (harmonic mean of the above): {harmonic:.2} GB/s");
    Ok(0)
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

fn relaunch_self(n: usize) -> anyhow::Result<i32> {
    let exe = std::env::current_exe()?;
    let mut args: Vec<std::ffi::OsString> = vec![exe.into()];
    // Drop -n/--nproc and its value; the children run as ranks.
    let mut it = std::env::args_os().skip(1).peekable();
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        if s == "-n" || s == "--nproc" {
            it.next();
        } else if !s.starts_with("--nproc=") {
            args.push(a);
        }
    }
    // Bound to cores, as Open MPI's ranks are by default: the comparison is like for like, and
    // a 2-rank all-reduce no longer varies 2x between runs with where the kernel put the ranks.
    let cfg = kolo_launch::LaunchConfig { nproc_per_node: n, program: args, bind: true, ..Default::default() };
    let out = kolo_launch::launch(&cfg)?;
    if !out.success() {
        eprint!("{}", out.summary());
    }
    Ok(out.exit_code())
}

fn busbw_factor(op: &str, n: usize) -> f64 {
    let n = n as f64;
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "broadcast" => 1.0,
        _ => (n - 1.0) / n,
    }
}

struct Row {
    bytes: usize,
    count: usize,
    iters: usize,
    times_us: Vec<f64>,
    ok: bool,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// The slowest rank's value.
fn max_over_ranks(comm: &dyn Communicator, x: f64) -> anyhow::Result<f64> {
    let mut v = [x];
    comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Max)?;
    Ok(v[0])
}

fn pattern<T: Element>(rank: usize, i: usize) -> T {
    T::from_i64(((i % 13) + rank) as i64)
}

/// Runs `op` once on patterned data and checks the result exactly.
fn check<T: Element>(comm: &dyn Communicator, op: &str, count: usize) -> anyhow::Result<bool> {
    let n = comm.world_size();
    let me = comm.rank().get();
    let nn = n.get();
    Ok(match op {
        "all_reduce" => {
            let mut v: Vec<T> = (0..count).map(|i| pattern(me, i)).collect();
            comm.all_reduce(BufMut::from(&mut v), ReduceOp::Sum)?;
            (0..count).all(|i| v[i] == T::from_i64((nn * (i % 13) + nn * (nn - 1) / 2) as i64))
        }
        "broadcast" => {
            let mut v: Vec<T> = (0..count).map(|i| if me == 0 { pattern(0, i) } else { T::default() }).collect();
            comm.broadcast(BufMut::from(&mut v), Rank(0))?;
            (0..count).all(|i| v[i] == pattern(0, i))
        }
        "all_gather" => {
            let r = kolo_base::shard_range(count, n, Rank(me));
            let inp: Vec<T> = r.clone().map(|i| pattern(me, i)).collect();
            let mut out = vec![T::default(); count];
            comm.all_gather(BufRef::from(&inp), BufMut::from(&mut out))?;
            (0..nn).all(|owner| kolo_base::shard_range(count, n, Rank(owner)).all(|i| out[i] == pattern(owner, i)))
        }
        "reduce_scatter" => {
            let inp: Vec<T> = (0..count).map(|i| pattern(me, i)).collect();
            let r = kolo_base::shard_range(count, n, Rank(me));
            let mut out = vec![T::default(); r.len()];
            comm.reduce_scatter(BufRef::from(&inp), BufMut::from(&mut out), ReduceOp::Sum)?;
            r.enumerate().all(|(k, i)| out[k] == T::from_i64((nn * (i % 13) + nn * (nn - 1) / 2) as i64))
        }
        "all_to_all" => {
            let per = count / nn;
            let counts = vec![per; nn];
            let inp: Vec<T> = (0..per * nn).map(|i| T::from_i64(((i / per.max(1)) * 3 + me) as i64 % 64)).collect();
            let mut out = vec![T::default(); per * nn];
            comm.all_to_all(BufRef::from(&inp), &counts, BufMut::from(&mut out), &counts)?;
            (0..per * nn).all(|i| out[i] == T::from_i64((me * 3 + i / per.max(1)) as i64 % 64))
        }
        other => anyhow::bail!("unknown op `{other}` (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all)"),
    })
}

/// One timed op on zeroed buffers (sums of zeros stay zero, so repeated ops stay finite).
struct Bufs<T> {
    a: Vec<T>,
    b: Vec<T>,
    counts: Vec<usize>,
}

fn make_bufs<T: Element>(comm: &dyn Communicator, op: &str, count: usize) -> Bufs<T> {
    let n = comm.world_size();
    let shard = kolo_base::shard_range(count, n, comm.rank()).len();
    let per = count / n.get();
    match op {
        "all_gather" => Bufs { a: vec![T::default(); shard], b: vec![T::default(); count], counts: vec![] },
        "reduce_scatter" => Bufs { a: vec![T::default(); count], b: vec![T::default(); shard], counts: vec![] },
        "all_to_all" => Bufs { a: vec![T::default(); per * n.get()], b: vec![T::default(); per * n.get()], counts: vec![per; n.get()] },
        _ => Bufs { a: vec![T::default(); count], b: vec![], counts: vec![] },
    }
}

fn once<T: Element>(comm: &dyn Communicator, op: &str, b: &mut Bufs<T>) -> anyhow::Result<()> {
    match op {
        "all_reduce" => comm.all_reduce(BufMut::from(&mut b.a), ReduceOp::Sum)?,
        "broadcast" => comm.broadcast(BufMut::from(&mut b.a), Rank(0))?,
        "all_gather" => comm.all_gather(BufRef::from(&b.a), BufMut::from(&mut b.b))?,
        "reduce_scatter" => comm.reduce_scatter(BufRef::from(&b.a), BufMut::from(&mut b.b), ReduceOp::Sum)?,
        "all_to_all" => comm.all_to_all(BufRef::from(&b.a), &b.counts, BufMut::from(&mut b.b), &b.counts)?,
        other => anyhow::bail!("unknown op `{other}`"),
    }
    Ok(())
}

/// Times `op` as nccl-tests do: a warm-up, one timed call to size the trials, then `trials`
/// trials of back-to-back calls lasting about `trial_secs`; returns the calls per trial and each
/// trial's seconds per call on the slowest rank.
fn timed_trials(
    comm: &dyn Communicator,
    trial_secs: f64,
    trials: usize,
    mut op: impl FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<(usize, Vec<f64>)> {
    op()?; // warm-up
    comm.barrier()?;
    let t = Instant::now();
    op()?;
    let one = max_over_ranks(comm, t.elapsed().as_secs_f64())?;
    let iters = ((trial_secs / one.max(1e-7)).ceil() as usize).clamp(3, 100_000);
    let mut times = Vec::with_capacity(trials);
    for _ in 0..trials {
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            op()?;
        }
        times.push(max_over_ranks(comm, t.elapsed().as_secs_f64() / iters as f64)?);
    }
    Ok((iters, times))
}

fn measure<T: Element>(comm: &dyn Communicator, a: &CollArgs, bytes: usize) -> anyhow::Result<Row> {
    let count = bytes / T::DTYPE.size_bytes();
    let ok = check::<T>(comm, &a.op, count)?;
    let mut bufs = make_bufs::<T>(comm, &a.op, count);
    let (iters, times) = timed_trials(comm, a.trial_secs, a.trials, || once(comm, &a.op, &mut bufs))?;
    Ok(Row { bytes, count, iters, times_us: times.iter().map(|t| t * 1e6).collect(), ok })
}

/// Seconds of one all-reduce of `v` (f32) with `alg`: one trial of [`timed_trials`].
fn time_all_reduce(
    host: &kolo_collectives::HostComm,
    alg: kolo_collectives::Algorithm,
    v: &mut [f32],
    trial_secs: f64,
) -> anyhow::Result<f64> {
    let op = || host.all_reduce_using(BufMut::from(&mut *v), ReduceOp::Sum, alg).map_err(anyhow::Error::from);
    Ok(timed_trials(host, trial_secs, 1, op)?.1[0])
}

/// `kolo bench collectives --tune FILE`: see [`CollArgs::tune`].
fn tune(host: &kolo_collectives::HostComm, a: &CollArgs, path: &std::path::Path) -> anyhow::Result<i32> {
    use kolo_collectives::{Algorithm, TuneTable, Tuning};
    let comm: &dyn Communicator = host;
    let (n, me) = (comm.world_size().get(), comm.rank().get());
    anyhow::ensure!(n > 1, "--tune needs at least 2 ranks (-n 2, or under kolo launch)");
    anyhow::ensure!(host.hosts().iter().all(|h| *h == host.hosts()[0]), "--tune measures the ranks of one host");
    let links = host.link_kind().ok_or_else(|| anyhow::anyhow!("--tune: the ranks' links are mixed (shared memory and TCP)"))?;
    // Read (and so check) the file before measuring.
    let mut tuning = match std::fs::read_to_string(path) {
        Ok(text) => Tuning::parse(&text, &path.display().to_string()).map_err(anyhow::Error::msg)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Tuning::default(),
        Err(e) => anyhow::bail!("{}: {e}", path.display()),
    };
    let algs = [Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Ring, Algorithm::Tree];
    if me == 0 {
        println!("# kolo bench collectives --tune: all_reduce f32 on {n} ranks over {}, {} trials of ~{}s per algorithm and size, the algorithms in turn within each trial; load {}", links.name(), a.trials, a.trial_secs, loadavg());
        println!(
            "{:>12} {}  {:>9}  {:>9}",
            "bytes",
            algs.map(|x| format!("{:>10}", format!("{}_us", x.name()))).join(" "),
            "built-in",
            "chosen"
        );
    }
    let mut measured = Vec::new();
    let mut size = a.min.as_usize().max(4);
    while size <= a.max.as_usize() {
        let mut v = vec![0f32; size / 4];
        let mut times = vec![Vec::new(); algs.len()];
        for _ in 0..a.trials.max(1) {
            for (i, &alg) in algs.iter().enumerate() {
                times[i].push(time_all_reduce(host, alg, &mut v, a.trial_secs)?);
            }
        }
        let row: Vec<(Algorithm, f64)> = algs.iter().zip(times.iter_mut()).map(|(&alg, t)| (alg, median(t))).collect();
        measured.push(((size / 4 * 4) as u64, row));
        size = size.saturating_mul(a.factor.max(2) as usize);
    }
    let builtin = |bytes: u64| host.builtin_all_reduce(bytes as usize);
    let table = TuneTable::from_measurements(n, links, &measured, builtin, 0.05).map_err(anyhow::Error::msg)?;
    if me == 0 {
        for (bytes, row) in &measured {
            let us: Vec<String> = row.iter().map(|(_, s)| format!("{:>10.2}", s * 1e6)).collect();
            println!("{bytes:>12} {}  {:>9}  {:>9}", us.join(" "), builtin(*bytes).name(), table.pick(*bytes).name());
        }
        tuning.insert(table).map_err(anyhow::Error::msg)?;
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|m| m.trim().to_string()))
            .unwrap_or_else(|| "unknown CPU".into());
        let when = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let header = format!(
            "Written by `kolo bench collectives --tune` on {} ({cpu}, {} cores) at unix time {when}.\nEach table: buffers up to `bytes` use `algo`; beyond the last row, its algorithm.\nRead by kolo train / kolo bench collectives --tuning FILE (every rank the same file).",
            kolo_collectives::default_host_id().split('#').next().unwrap_or("this host"),
            num_cpus()
        );
        let tmp = path.with_extension("toml.tmp");
        std::fs::write(&tmp, tuning.to_toml(&header)).map_err(|e| anyhow::anyhow!("{}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        println!("wrote the {n}-rank {} table to {}", links.name(), path.display());
    }
    comm.barrier()?;
    Ok(0)
}

fn collectives(a: CollArgs) -> anyhow::Result<i32> {
    let under_launcher = kolo_rendezvous::discover(std::env::vars()).map_err(|e| anyhow::anyhow!(e))?.is_some();
    if !under_launcher && a.nproc > 1 {
        return relaunch_self(a.nproc);
    }
    let b = a.comm.join_any()?;
    if let Some(path) = &a.tune {
        let host = b.host().ok_or_else(|| anyhow::anyhow!("--tune measures the built-in backend's algorithms (--backend builtin)"))?;
        return tune(host, &a, path);
    }
    let comm: &dyn Communicator = &**b.comm();
    let n = comm.world_size().get();
    let me = comm.rank().get();
    let shm = b.host().map_or(0, |h| h.shm_peers().len());
    let links = match b.host() {
        _ if n == 1 => "none".to_string(),
        Some(_) => format!("{} shm + {} tcp peers per rank", shm, n - 1 - shm),
        None => format!("the {} library", comm.backend()),
    };
    if me == 0 && !a.json {
        let tuned = if b.host().is_some_and(|h| h.tuned()) { " following the tuning table for this world and links" } else { "" };
        println!(
            "# kolo bench collectives: {} {} on {} rank(s), transport {:?} ({links}), algorithm {:?}{tuned}",
            a.op, a.dtype, n, a.comm.transport, a.comm.algorithm
        );
        println!("# {} trials of back-to-back ops (~{}s each); time = median over trials of the slowest rank", a.trials, a.trial_secs);
        println!(
            "{:>12} {:>11} {:>7} {:>12} {:>22} {:>11} {:>11}  check",
            "bytes", "count", "iters", "time_us", "[min..max]", "algbw_GB/s", "busbw_GB/s"
        );
    }
    let esz = a.dtype.size_bytes();
    let mut size = a.min.as_usize().max(esz);
    let mut all_ok = true;
    while size <= a.max.as_usize() {
        // Whole elements, and for all_to_all a whole number per rank.
        let unit = if a.op == "all_to_all" { esz * n } else { esz };
        let bytes = size / unit * unit;
        let row = match a.dtype {
            DType::F32 => measure::<f32>(comm, &a, bytes)?,
            DType::F64 => measure::<f64>(comm, &a, bytes)?,
            DType::F16 => measure::<f16>(comm, &a, bytes)?,
            DType::BF16 => measure::<bf16>(comm, &a, bytes)?,
            DType::I32 => measure::<i32>(comm, &a, bytes)?,
            DType::I64 => measure::<i64>(comm, &a, bytes)?,
            DType::U8 => measure::<u8>(comm, &a, bytes)?,
        };
        // Every rank must agree the result was right.
        let mut ok = [u8::from(row.ok)];
        comm.all_reduce(BufMut::from(&mut ok[..]), ReduceOp::Min)?;
        let ok = ok[0] == 1;
        all_ok &= ok;
        let mut t = row.times_us.clone();
        let med = median(&mut t);
        let (lo, hi) = (t[0], t[t.len() - 1]);
        let algbw = row.bytes as f64 / (med * 1e-6) / 1e9;
        let busbw = algbw * busbw_factor(&a.op, n);
        if me == 0 {
            if a.json {
                println!(
                    "{}",
                    json!({"bench": "kolo_collective", "op": a.op, "dtype": a.dtype.name(), "world": n,
                        "transport": format!("{:?}", a.comm.transport).to_lowercase(), "algorithm": format!("{:?}", a.comm.algorithm).to_lowercase(),
                        "shm_peers": shm, "bytes": row.bytes, "count": row.count, "iters": row.iters, "trials": row.times_us.len(),
                        "lat_us": {"median": med, "min": lo, "max": hi}, "algbw_GBps": algbw, "busbw_GBps": busbw, "correct": ok})
                );
            } else {
                println!(
                    "{:>12} {:>11} {:>7} {:>12.2} {:>22} {:>11.3} {:>11.3}  {}",
                    row.bytes,
                    row.count,
                    row.iters,
                    med,
                    format!("[{lo:.2}..{hi:.2}]"),
                    algbw,
                    busbw,
                    if ok { "ok" } else { "WRONG" }
                );
            }
            let _ = std::io::stdout().flush();
        }
        size = size.saturating_mul(a.factor.max(2) as usize);
    }
    Ok(if all_ok { 0 } else { 2 })
}

/// How one loopback trial moves its bytes (see [`loopback`]).
#[derive(Clone, Copy, Debug)]
enum LoopMode {
    /// A sending and a receiving thread per end, blocking calls of up to 1 MiB.
    Threads,
    /// One thread per end alternating non-blocking sends and receives, as Kolo's engine does,
    /// sending at most this many bytes ahead of what it has received (`usize::MAX`: unpaced).
    Window(usize),
}

/// Two ends of a loopback TCP connection, each sending `size` bytes and receiving `size` bytes
/// at the same time (what a 2-rank ring step does). `whole`: each end sends from and receives
/// into buffers of `size` bytes, touched once, as a collective of that size must; otherwise
/// from and into 1 MiB buffers reused, which stay in cache.
fn loopback_trial(size: usize, mode: LoopMode, whole: bool) -> anyhow::Result<Duration> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let a = std::net::TcpStream::connect(l.local_addr()?)?;
    let (b, _) = l.accept()?;
    let span = if whole { size.max(1) } else { 1 << 20 };
    // Filled with a non-zero byte (zeroed memory would be mapped lazily), so every page is
    // mapped before the clock starts.
    let buf = |v: u8| vec![v; span];
    let (src, mut dst) = ([buf(1), buf(1)], [buf(2), buf(2)]);
    // The next call's range: `at` bytes done, at most `most` more.
    let next = |at: usize, most: usize| {
        let off = at % span;
        off..off + (size - at).min(span - off).min(most).min(1 << 20)
    };
    let end = |s: std::net::TcpStream, src: &[u8], dst: &mut [u8]| -> std::io::Result<()> {
        s.set_nodelay(true)?;
        let closed = || std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed");
        match mode {
            LoopMode::Threads => std::thread::scope(|sc| {
                let mut w = &s;
                let sender = sc.spawn(move || {
                    let mut sent = 0;
                    while sent < size {
                        let r = next(sent, usize::MAX);
                        w.write_all(&src[r.clone()])?;
                        sent += r.len();
                    }
                    Ok::<_, std::io::Error>(())
                });
                let mut got = 0;
                while got < size {
                    match (&s).read(&mut dst[next(got, usize::MAX)])? {
                        0 => return Err(closed()),
                        k => got += k,
                    }
                }
                sender.join().expect("sender thread")
            }),
            LoopMode::Window(win) => {
                s.set_nonblocking(true)?;
                let (mut sent, mut got) = (0, 0);
                let again = |e: &std::io::Error| e.kind() == std::io::ErrorKind::WouldBlock;
                while sent < size || got < size {
                    let ahead = got.saturating_add(win).saturating_sub(sent);
                    if sent < size && ahead > 0 {
                        match (&s).write(&src[next(sent, ahead)]) {
                            Ok(k) => sent += k,
                            Err(e) if again(&e) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    if got < size {
                        match (&s).read(&mut dst[next(got, usize::MAX)]) {
                            Ok(0) => return Err(closed()),
                            Ok(k) => got += k,
                            Err(e) if again(&e) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                Ok(())
            }
        }
    };
    let ([sa, sb], [da, db]) = (&src, &mut dst);
    let t = Instant::now();
    std::thread::scope(|sc| {
        let h = sc.spawn(|| end(a, sa, da));
        end(b, sb, db)?;
        h.join().expect("loopback thread")
    })?;
    Ok(t.elapsed())
}

/// The windows `kolo bench loopback` tries, `usize::MAX` being unpaced.
const LOOP_WINDOWS: [usize; 5] = [64 << 10, 128 << 10, 256 << 10, 1 << 20, usize::MAX];

fn loopback(a: LoopArgs) -> anyhow::Result<i32> {
    let size = a.size.as_usize();
    let mut modes = vec![LoopMode::Threads];
    modes.extend(LOOP_WINDOWS.map(LoopMode::Window));
    let label = |m: LoopMode| match m {
        LoopMode::Threads => "2 threads per end, blocking".to_string(),
        LoopMode::Window(usize::MAX) => "1 thread per end, non-blocking, unpaced".to_string(),
        LoopMode::Window(w) => format!("1 thread per end, non-blocking, window {}", ByteSize(w as u64)),
    };
    if !a.json {
        println!("loopback TCP, both directions at once, {} each way, median of {} trials (GB/s aggregate [min..max]):", a.size, a.trials);
        println!("{:<48} {:>22} {:>22}", "", "1 MiB buffers (cached)", "whole buffers");
    }
    let mut rows = Vec::new();
    let mut best = [0.0f64; 2];
    for m in modes {
        let mut cols = Vec::new();
        for (i, whole) in [false, true].into_iter().enumerate() {
            let mut agg = Vec::new();
            for _ in 0..a.trials.max(1) {
                agg.push(2.0 * size as f64 / loopback_trial(size, m, whole)?.as_secs_f64() / 1e9);
            }
            let med = median(&mut agg);
            best[i] = best[i].max(med);
            cols.push((med, agg[0], agg[agg.len() - 1]));
        }
        if !a.json {
            let cell = |(m, lo, hi): (f64, f64, f64)| format!("{m:.2} [{lo:.2}..{hi:.2}]");
            println!("{:<48} {:>22} {:>22}", label(m), cell(cols[0]), cell(cols[1]));
        }
        rows.push(json!({"mode": label(m), "cached_GBps": cols[0].0, "whole_GBps": cols[1].0}));
    }
    let mut cp = Vec::new();
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    for _ in 0..a.trials {
        let t = Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
        cp.push(size as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let cp_m = median(&mut cp);
    if a.json {
        println!(
            "{}",
            json!({"bench": "kolo_loopback", "bytes_each_way": size, "trials": a.trials, "modes": rows,
            "ring2_busbw_bound_GBps": best[0] / 2.0, "ring2_busbw_whole_GBps": best[1] / 2.0,
            "memcpy_GBps": {"median": cp_m, "min": cp[0], "max": cp[cp.len()-1]}})
        );
    } else {
        println!(
            "  => bound on 2-rank all_reduce busbw over TCP: {:.2} GB/s (half the best aggregate); {:.2} moving whole buffers",
            best[0] / 2.0,
            best[1] / 2.0
        );
        println!("memcpy, 1 thread, {}: {:.2} GB/s [{:.2}..{:.2}]", a.size, cp_m, cp[0], cp[cp.len() - 1]);
        copy_by_offset();
    }
    Ok(0)
}

/// 64 KiB copies at (destination - source) offsets modulo 4096, best of 2000: the C library's
/// memcpy against the copy the shared-memory rings use (`kolo_collectives::copy`), which shows
/// whether this CPU has the `rep movsb` aliasing cliff (AMD Zen: 1-15 bytes).
fn copy_by_offset() {
    let n = 64 << 10;
    let src: Vec<u8> = (0..n + 8192).map(|i| i as u8).collect();
    let mut dst = vec![0u8; n + 8192];
    let base = |p: *const u8| (4096 - p as usize % 4096) % 4096;
    let (s0, d0) = (base(src.as_ptr()), base(dst.as_ptr()));
    let rate = |f: &mut dyn FnMut(&mut [u8], &[u8]), off: usize, dst: &mut Vec<u8>| {
        let mut best = f64::INFINITY;
        for _ in 0..2000 {
            let t = Instant::now();
            f(&mut dst[d0 + off..d0 + off + n], &src[s0..s0 + n]);
            std::hint::black_box(&mut *dst);
            best = best.min(t.elapsed().as_secs_f64());
        }
        n as f64 / best / 1e9
    };
    let offsets = [0usize, 4, 8, 12, 16, 20, 40, 72, 1032, 4092];
    let mut libc_row = String::new();
    let mut kolo_row = String::new();
    for off in offsets {
        libc_row += &format!(" {:>6.1}", rate(&mut |d, s| d.copy_from_slice(s), off, &mut dst));
        kolo_row += &format!(" {:>6.1}", rate(&mut |d, s| kolo_collectives::copy::copy_slice(d, s), off, &mut dst));
    }
    println!("64 KiB copies, GB/s by (dst - src) mod 4096: {}", offsets.map(|o| format!("{o:>6}")).join(" "));
    println!("  {:<39}{libc_row}", "the C library's memcpy");
    println!("  {:<39}{kolo_row}", "the shared-memory rings' copy");
}

fn ps_bench(a: PsArgs) -> anyhow::Result<i32> {
    use kolo_ps::client::ClientOptions;
    use kolo_ps::server::ServerOptions;
    let token = kolo_rendezvous::JobToken::generate();
    let coord = kolo_ps::Coordinator::start("127.0.0.1:0", token.clone(), Duration::from_secs(10))?;
    let servers: Vec<kolo_ps::Server> = (0..a.servers.max(1))
        .map(|_| {
            kolo_ps::Server::start(ServerOptions {
                listen: "127.0.0.1:0".into(),
                coordinator: coord.addr().to_string(),
                token: token.clone(),
                timeout: Duration::from_secs(120),
                heartbeat: Duration::from_millis(500),
                refuse_transfers: 0,
                reconfigure_delay: std::time::Duration::ZERO,
            })
        })
        .collect::<Result<_, _>>()?;
    let job = kolo_ps::JobSpec {
        len: a.values,
        chunk: a.chunk,
        workers: 1,
        replication: a.replication,
        backup: 0,
        consistency: kolo_ps::Consistency::Async,
        optimizer: kolo_optim::OptimizerSpec::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 },
    };
    let mut c = kolo_ps::PsClient::connect(ClientOptions {
        coordinator: coord.addr().to_string(),
        token,
        job,
        worker: 0,
        min_servers: servers.len() as u32,
        timeout: Duration::from_secs(120),
        heartbeat: None,
    })?;
    let n = a.values as usize;
    let mut x = vec![0.5f32; n];
    c.init(&x)?;
    let g = vec![1e-3f32; n];
    let (mut push, mut pull) = (Vec::new(), Vec::new());
    for t in 0..a.trials.max(1) as u64 {
        let s = Instant::now();
        c.push(t, 0.1, &g, None)?;
        push.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        c.pull(t + 1, &mut x)?;
        pull.push(s.elapsed().as_secs_f64());
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (tp, tl) = (med(&mut push), med(&mut pull));
    let bytes = n as f64 * 4.0;
    let size = (n * 4).max(1 << 20);
    // The faster of the two ways `kolo bench loopback` found best on this machine.
    let lb = loopback_trial(size, LoopMode::Threads, false)?.min(loopback_trial(size, LoopMode::Window(128 << 10), false)?);
    let one_way = size as f64 / lb.as_secs_f64() / 1e9;
    println!(
        "# kolo bench ps: {} values ({:.1} MB), ranges of {}, {} server(s), replication {}",
        n,
        bytes / 1e6,
        a.chunk,
        servers.len(),
        a.replication
    );
    println!("{:>6} {:>12} {:>14} {:>10}", "op", "time (ms)", "Mkeys/s", "GB/s");
    println!("{:>6} {:>12.2} {:>14.1} {:>10.3}", "push", tp * 1e3, n as f64 / tp / 1e6, bytes / tp / 1e9);
    println!("{:>6} {:>12.2} {:>14.1} {:>10.3}", "pull", tl * 1e3, n as f64 / tl / 1e6, bytes / tl / 1e9);
    println!("loopback TCP on this machine: {one_way:.3} GB/s per direction (both directions loaded, {} MB)", size / 1_000_000);
    drop(c);
    drop(servers);
    Ok(0)
}

fn hogwild_bench(path: &std::path::Path, epochs: usize) -> anyhow::Result<i32> {
    use kolo_ps::hogwild::{evaluate, train_logistic, HogwildConfig, Mode, SparseSet};
    let data = kolo_train::data::wine_sparse(path, 8).map_err(|e| anyhow::anyhow!(e))?;
    let split = |test: bool| SparseSet {
        dim: data.dim,
        examples: data.examples.iter().enumerate().filter(|(i, _)| (i % 5 == 0) == test).map(|(_, e)| e.clone()).collect(),
    };
    let (train, test) = (split(false), split(true));
    println!(
        "# kolo bench hogwild: wine, {} coordinates, 66 active per example, {} train / {} held out, {epochs} epochs, {} cores",
        data.dim + 1,
        train.examples.len(),
        test.examples.len(),
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!("{:>8} {:>8} {:>14} {:>16} {:>10}", "mode", "threads", "updates/s", "held-out loss", "accuracy");
    for (mode, threads) in [(Mode::Locked, 1), (Mode::Locked, 2), (Mode::Hogwild, 2), (Mode::Locked, 4), (Mode::Hogwild, 4)] {
        let r = train_logistic(&train, &HogwildConfig { threads, epochs, lr: 0.02, l2: 1e-3, seed: 3, mode });
        let (l, a) = evaluate(&test, &r.weights);
        println!("{:>8} {:>8} {:>14.0} {:>16.4} {:>9.1}%", format!("{mode:?}"), threads, r.updates as f64 / r.seconds, l, a * 100.0);
    }
    Ok(0)
}

fn sandblaster_bench(path: &std::path::Path, slow_ms: u64, iterations: usize) -> anyhow::Result<i32> {
    use kolo_ps::lbfgs::{minimize, LbfgsConfig, Logistic, Objective};
    let data = kolo_train::data::wine_sparse(path, 4).map_err(|e| anyhow::anyhow!(e))?;
    let obj = std::sync::Arc::new(Logistic { data, l2: 1e-2, portions: 16 });
    let dim = obj.dim();
    println!("# kolo bench sandblaster: L2 logistic regression on wine ({dim} values), 16 portions, 3 worker threads, 2 servers, {iterations} iterations");
    println!("{:>34} {:>10} {:>12} {:>14} {:>10}", "case", "seconds", "evaluations", "ms/evaluation", "loss");
    for (name, slow, backup) in [
        ("no slowed worker", 0, true),
        ("one worker +{slow_ms} ms/portion, backups", slow_ms, true),
        ("one worker +{slow_ms} ms/portion, no backups", slow_ms, false),
    ] {
        let token = kolo_rendezvous::JobToken::generate();
        let coord = kolo_ps::Coordinator::start("127.0.0.1:0", token.clone(), Duration::from_secs(10))?;
        let servers: Vec<kolo_ps::Server> = (0..2)
            .map(|_| {
                kolo_ps::Server::start(kolo_ps::server::ServerOptions {
                    listen: "127.0.0.1:0".into(),
                    coordinator: coord.addr().to_string(),
                    token: token.clone(),
                    timeout: Duration::from_secs(60),
                    heartbeat: Duration::from_millis(500),
                    refuse_transfers: 0,
                    reconfigure_delay: std::time::Duration::ZERO,
                })
            })
            .collect::<Result<_, _>>()?;
        let job = kolo_ps::JobSpec {
            len: dim as u64,
            chunk: 500,
            workers: 4,
            replication: 0,
            backup: 0,
            consistency: kolo_ps::Consistency::Async,
            optimizer: kolo_optim::OptimizerSpec::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 },
        };
        let connect = |w: u32| {
            kolo_ps::PsClient::connect(kolo_ps::client::ClientOptions {
                coordinator: coord.addr().to_string(),
                token: token.clone(),
                job: job.clone(),
                worker: w,
                min_servers: 2,
                timeout: Duration::from_secs(60),
                heartbeat: None,
            })
        };
        let mut c = connect(3)?;
        c.init(&vec![0.0; dim])?;
        let workers = (0..3).map(connect).collect::<Result<Vec<_>, _>>()?;
        let cfg =
            LbfgsConfig { history: 5, iterations, tolerance: 0.0, backup_tasks: backup, worker_delay: vec![Duration::from_millis(slow)] };
        let t = Instant::now();
        let r = minimize(obj.clone(), c, workers, &cfg)?;
        let secs = t.elapsed().as_secs_f64();
        println!(
            "{:>34} {:>10.2} {:>12} {:>14.1} {:>10.6}",
            name.replace("{slow_ms}", &slow_ms.to_string()),
            secs,
            r.evaluations,
            secs * 1e3 / r.evaluations as f64,
            r.loss.last().copied().unwrap_or(f64::NAN)
        );
        drop(servers);
    }
    Ok(0)
}
