//! A worker of a parameter-server job (`[train] strategy = "ps"`): pull the parameters, compute
//! a gradient on this worker's data shard, push it; the servers apply the optimizer.
//!
//! Clocks: under BSP and bounded delay a worker pulls for step t and pushes step t, so the
//! servers' vector clocks count steps. Under async (Downpour) it pulls every `fetch_every` steps
//! and pushes the gradients accumulated over `push_every` steps; clocks count pushes.
//!
//! A worker whose heartbeats stop is declared dead by the coordinator; one surviving worker
//! claims its data shard and trains it on a second thread from the dead worker's clock (its
//! last, possibly half-acknowledged push is resent: the servers drop duplicates). Under BSP the
//! result is bit-identical to a run in which nobody died.

use crate::config::{Config, PsConsistency};
use crate::data::Dataset;
use crate::trainer::{evaluate, load_data, peak_rss, replica_batches, sample_text, spec_string, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::WorldSize;
use kolo_comm::LocalComm;
use kolo_optim::{clip_factor, lr_at, scaled_lr, sum_of_squares};
use kolo_ps::client::ClientOptions;
use kolo_ps::{JobSpec, PsClient, SignificantlyModified};
use kolo_rendezvous::JobToken;
use kolo_tensor::{build_model, Model, ModelSpec, PlainView};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Who this worker is and where the job's coordinator listens.
pub struct PsWorker {
    pub worker: usize,
    pub workers: usize,
    pub coordinator: String,
    pub token: JobToken,
}

pub fn run_ps(cfg: &Config, w: &PsWorker, opts: &RunOptions) -> Result<Summary, TrainError> {
    let (rank, world) = (w.worker, w.workers);
    let lead = rank == 0 && !opts.quiet;
    let say = |m: &str| {
        if lead {
            kolo_base::eline!("{m}");
        }
    };
    let tc = &cfg.train;
    let pc = &cfg.ps;
    let data = load_data(cfg, rank)?;
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, tc.seed)?;
    let numel = model.params().numel();
    let coordinator = pc.coordinator.clone().unwrap_or_else(|| w.coordinator.clone());
    let mut client = connect(cfg, &coordinator, &w.token, numel, rank, world)?;
    if rank == 0 {
        // Every worker builds the same initial model from the seed; worker 0's copy seeds the servers.
        client.init(&model.params().to_flat()?)?;
    }
    say(&format!(
        "kolo train (parameter servers at {coordinator}, {} server(s) so far): {numel} params, {} on {world} worker(s), {:?}{}, ranges of {} values, replication {}, data: {}",
        client.membership().servers.len(),
        spec_string(&spec),
        pc.consistency(),
        if pc.consistency == PsConsistency::Async { format!(" (pull every {} steps, push every {})", pc.fetch_every, pc.push_every) } else { String::new() },
        pc.chunk,
        pc.replication,
        data.train.describe()
    ));
    if client.membership().servers.len() <= pc.replication as usize {
        say(&format!("warning: ps.replication = {} needs {} servers to keep that many copies; with {} server(s) each range has {} copy/copies until more servers join", pc.replication, pc.replication + 1, client.membership().servers.len(), client.membership().servers.len()));
    }
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));

    // Adoption: take over the shards of workers the coordinator declares dead.
    let done = Arc::new(AtomicBool::new(false));
    let adopted: Arc<Mutex<Vec<Adopted>>> = Arc::default();
    let watcher = {
        let (done, adopted, cfg, spec, train, coordinator, token) =
            (done.clone(), adopted.clone(), cfg.clone(), spec.clone(), data.train.clone(), coordinator.clone(), w.token.clone());
        let opts = RunOptions { quiet: opts.quiet, ..RunOptions::default() };
        std::thread::Builder::new()
            .name("kolo-ps-adopt".into())
            .spawn(move || {
                while !done.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(200));
                    let Ok(m) = kolo_ps::coord::membership(&coordinator, &token, Duration::from_secs(5)) else { continue };
                    for dead in m.dead_workers {
                        if dead as usize >= world || dead as usize == rank || done.load(Ordering::SeqCst) {
                            continue;
                        }
                        if let Ok(true) = kolo_ps::coord::adopt(&coordinator, &token, dead, rank as u32, Duration::from_secs(5)) {
                            kolo_base::eline!("worker {rank}: worker {dead} is dead; training its data shard from its last step");
                            let (cfg, spec, train, coordinator, token, opts) =
                                (cfg.clone(), spec.clone(), train.clone(), coordinator.clone(), token.clone(), opts.clone());
                            let h = std::thread::spawn(move || {
                                adopt_shard(&cfg, &spec, train, &coordinator, &token, dead as usize, world, end, &opts)
                            });
                            adopted.lock().unwrap_or_else(|p| p.into_inner()).push((dead as usize, h));
                        }
                    }
                }
            })
            .map_err(|e| TrainError::Other(e.to_string()))?
    };
    let out = train_loop(cfg, &*model, &mut client, data.train.clone(), rank, world, 0, end, opts, &say);
    done.store(true, Ordering::SeqCst);
    let _ = watcher.join();
    let out = out?;
    let mut adopted_shards = Vec::new();
    for (shard, h) in adopted.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
        h.join().map_err(|_| TrainError::Other(format!("worker {rank}: the thread training worker {shard}'s shard panicked")))??;
        adopted_shards.push(shard);
    }
    let is_async = pc.consistency == PsConsistency::Async;
    // The final parameters: every push of every worker applied (BSP), or whatever the servers
    // hold when this worker is done (bounded delay waits for the slowest within τ; async none).
    let mut flat = vec![0f32; numel];
    client.pull(if is_async { out.pushes } else { end }, &mut flat)?;
    model.params().load(&flat)?;
    let mut eval = None;
    let mut sample = None;
    if rank == 0 && end == tc.steps {
        let local = LocalComm::create(WorldSize::new(1).expect("1 > 0")).remove(0);
        let limit = if data.vocab.is_some() { tc.eval_batches } else { 0 };
        let e = evaluate(&*model, &PlainView, &*data.eval, &local, cfg.data.batch_size, limit, false, &|| Ok(()))?;
        say(&format!(
            "final eval on {} examples: loss {:.4}{}",
            e.examples,
            e.loss,
            e.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))
        ));
        eval = Some(e);
        if let (Some(v), ModelSpec::Gpt(g)) = (&data.vocab, &spec) {
            if tc.sample_chars > 0 {
                let s = sample_text(&*model, &PlainView, v, g.seq, tc.sample_chars, tc.sample_temperature, tc.seed, &|| Ok(()))?;
                say(&format!("--- sample ({} chars, temperature {}) ---\n{s}\n---", tc.sample_chars, tc.sample_temperature));
                sample = Some(s);
            }
        }
    }
    let stats = client.stats().clone();
    if stats.values_sent < stats.values_total {
        say(&format!(
            "significantly-modified filter: sent {} of {} gradient values ({:.1}% saved)",
            stats.values_sent,
            stats.values_total,
            100.0 * (1.0 - stats.values_sent as f64 / stats.values_total.max(1) as f64)
        ));
    }
    if !adopted_shards.is_empty() {
        kolo_base::eline!("worker {rank}: also trained the shard(s) of dead worker(s) {adopted_shards:?}");
    }
    let _ = kolo_ps::coord::worker_done(&coordinator, &w.token, rank as u32, Duration::from_secs(5));
    Ok(Summary {
        steps_done: end,
        last_loss: out.last_loss,
        eval,
        step_ms: out.step_ms,
        comm_wait_ms: out.wait_ms,
        comm_bytes: out.comm_bytes,
        straggler: None,
        hidden_fraction: 0.0,
        params: flat,
        sample,
        checkpoint: None,
        states: StateBytes { params: numel as u64 * 4, grads: 3 * numel as u64 * 4, optimizer: 0, offloaded: false },
        peak_rss: peak_rss(),
        heap: None,
        skipped_steps: 0,
        loss_scale: None,
        ps: Some(stats),
        pipeline_bubble: None,
        moe: None,
        batch_split: None,
    })
}

/// A dead worker's shard being trained on another thread of this worker.
type Adopted = (usize, JoinHandle<Result<u64, TrainError>>);

fn connect(cfg: &Config, coordinator: &str, token: &JobToken, numel: usize, worker: usize, workers: usize) -> Result<PsClient, TrainError> {
    let pc = &cfg.ps;
    let job = JobSpec {
        len: numel as u64,
        chunk: pc.chunk,
        workers: workers as u32,
        replication: pc.replication,
        backup: pc.backup_workers,
        consistency: pc.consistency(),
        optimizer: cfg.optimizer(),
    };
    Ok(PsClient::connect(ClientOptions {
        coordinator: coordinator.to_string(),
        token: token.clone(),
        job,
        worker: worker as u32,
        min_servers: pc.servers,
        timeout: Duration::from_secs_f64(pc.timeout_secs),
        heartbeat: Some(Duration::from_millis(250)),
    })?)
}

/// Trains dead worker `shard`'s data shard from its clock to `end` (a survivor's second thread).
#[allow(clippy::too_many_arguments)]
fn adopt_shard(
    cfg: &Config,
    spec: &ModelSpec,
    train: Arc<dyn Dataset>,
    coordinator: &str,
    token: &JobToken,
    shard: usize,
    workers: usize,
    end: u64,
    opts: &RunOptions,
) -> Result<u64, TrainError> {
    let model = build_model(spec, cfg.train.seed)?;
    let numel = model.params().numel();
    let mut client = connect(cfg, coordinator, token, numel, shard, workers)?;
    // The dead worker is the slowest: its clock is the slowest clock the servers report.
    let clock = client.pull(0, &mut vec![0f32; numel])?;
    let start = if cfg.ps.consistency == PsConsistency::Async { clock * cfg.ps.push_every } else { clock };
    let out = train_loop(cfg, &*model, &mut client, train, shard, workers, start.min(end), end, opts, &|_| {})?;
    let _ = kolo_ps::coord::worker_done(coordinator, token, shard as u32, Duration::from_secs(5));
    Ok(out.pushes)
}

struct LoopOut {
    step_ms: Vec<f64>,
    wait_ms: Vec<f64>,
    comm_bytes: Vec<usize>,
    last_loss: f64,
    pushes: u64,
}

/// Steps `start..end` of logical worker `shard`: pull, gradient on the shard's batches, push.
#[allow(clippy::too_many_arguments)]
fn train_loop(
    cfg: &Config,
    model: &dyn Model,
    client: &mut PsClient,
    train: Arc<dyn Dataset>,
    shard: usize,
    workers: usize,
    start: u64,
    end: u64,
    opts: &RunOptions,
    say: &dyn Fn(&str),
) -> Result<LoopOut, TrainError> {
    let tc = &cfg.train;
    let pc = &cfg.ps;
    let numel = model.params().numel();
    let batches = replica_batches(cfg, train, shard, workers, start * tc.grad_accum)?;
    let global_batch = cfg.data.batch_size * workers * tc.grad_accum as usize;
    let base_lr = cfg.optim.reference_batch.map_or(cfg.optim.lr, |r| scaled_lr(cfg.optim.lr, global_batch, r));
    let is_async = pc.consistency == PsConsistency::Async;
    let mut filter = (pc.filter_threshold > 0.0).then(|| SignificantlyModified::new(pc.filter_threshold));
    let mut flat = vec![0f32; numel];
    let (mut grads, mut micro, mut acc) = (vec![0f32; numel], vec![0f32; numel], vec![0f32; numel]);
    let mut out = LoopOut {
        step_ms: Vec::new(),
        wait_ms: Vec::new(),
        comm_bytes: Vec::new(),
        last_loss: f64::NAN,
        pushes: if is_async { start / pc.push_every } else { start },
    };
    let te = kolo_tensor::TensorError::from;
    for step in start..end {
        if opts.die_at == Some((shard, step)) {
            // Test hook: this worker vanishes (no goodbye; its heartbeats stop with its client).
            return Err(TrainError::Other(format!("worker {shard} died at step {step} (test hook)")));
        }
        let t0 = Instant::now();
        if let Some((r, ms)) = opts.slow_rank {
            if r == shard {
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        let lr = lr_at(base_lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        let mut waited = Duration::ZERO;
        if !is_async || step % pc.fetch_every == 0 {
            let t = Instant::now();
            client.pull(if is_async { out.pushes } else { step }, &mut flat)?;
            model.params().load(&flat)?;
            waited += t.elapsed();
        }
        grads.fill(0.0);
        let mut loss_sum = 0f64;
        for _ in 0..tc.grad_accum {
            let (_, batch) = batches.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?;
            let loss = (model.loss(&batch, &PlainView)? * (1.0 / tc.grad_accum as f64)).map_err(te)?;
            loss_sum += f64::from(loss.to_scalar::<f32>().map_err(te)?);
            let g = loss.backward().map_err(te)?;
            model.params().grads_into(&g, &mut micro)?;
            grads.iter_mut().zip(&micro).for_each(|(a, b)| *a += b);
        }
        if let Some(max) = cfg.optim.clip_grad_norm {
            // Each worker clips the gradient it pushes (the servers never see a global one).
            let f = clip_factor(sum_of_squares(&grads).sqrt(), max);
            grads.iter_mut().for_each(|g| *g *= f);
        }
        acc.iter_mut().zip(&grads).for_each(|(a, g)| *a += g);
        let before = client.stats().bytes_out;
        if !is_async || (step + 1) % pc.push_every == 0 {
            let t = Instant::now();
            client.push(if is_async { out.pushes } else { step }, lr, &acc, filter.as_mut().map(|f| f as &mut dyn kolo_ps::Filter))?;
            waited += t.elapsed();
            out.pushes += 1;
            acc.fill(0.0);
        }
        out.comm_bytes.push((client.stats().bytes_out - before) as usize);
        out.last_loss = loss_sum;
        out.step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        out.wait_ms.push(waited.as_secs_f64() * 1e3);
        let done = step + 1;
        if tc.log_every > 0 && (done % tc.log_every == 0 || done == end) {
            say(&format!(
                "step {done}/{} loss {:.4} lr {lr:.3e} | {:.1} ms/step, {:.1} ms of it in push/pull | lead over the slowest worker up to {} step(s)",
                tc.steps,
                out.last_loss,
                out.step_ms.last().copied().unwrap_or(0.0),
                out.wait_ms.last().copied().unwrap_or(0.0),
                client.stats().max_lead
            ));
        }
    }
    Ok(out)
}

/// Another worker group on the same servers: every `every`, pull the current parameters (no
/// clock, no push) and evaluate them on the test set, until `stop` says the job is over (then
/// once more). Returns (seconds since start, evaluation) per round.
pub fn run_ps_eval(
    cfg: &Config,
    coordinator: &str,
    token: &JobToken,
    workers: usize,
    every: Duration,
    stop: &dyn Fn() -> bool,
    quiet: bool,
) -> Result<Vec<(f64, crate::trainer::Eval)>, TrainError> {
    let say = |m: &str| {
        if !quiet {
            kolo_base::eline!("{m}");
        }
    };
    let data = load_data(cfg, 0)?;
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, cfg.train.seed)?;
    let numel = model.params().numel();
    let pc = &cfg.ps;
    let job = JobSpec {
        len: numel as u64,
        chunk: pc.chunk,
        workers: workers as u32,
        replication: pc.replication,
        backup: pc.backup_workers,
        consistency: pc.consistency(),
        optimizer: cfg.optimizer(),
    };
    let mut client = PsClient::observer(ClientOptions {
        coordinator: coordinator.to_string(),
        token: token.clone(),
        job,
        worker: 0,
        min_servers: pc.servers,
        timeout: Duration::from_secs_f64(pc.timeout_secs),
        heartbeat: None,
    })?;
    let local = LocalComm::create(WorldSize::new(1).expect("1 > 0")).remove(0);
    let limit = if data.vocab.is_some() { cfg.train.eval_batches } else { 0 };
    let t0 = Instant::now();
    let mut out = Vec::new();
    let mut flat = vec![0f32; numel];
    loop {
        let last = stop();
        match client.pull(0, &mut flat) {
            Ok(_) => {
                model.params().load(&flat)?;
                let e = evaluate(&*model, &PlainView, &*data.eval, &local, cfg.data.batch_size, limit, false, &|| Ok(()))?;
                let secs = t0.elapsed().as_secs_f64();
                say(&format!(
                    "[eval group] {secs:.1} s: loss {:.4}{}",
                    e.loss,
                    e.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))
                ));
                out.push((secs, e));
            }
            // Before worker 0 has initialised the ranges there is nothing to read yet.
            Err(kolo_ps::PsError::Server(m)) if m.contains("never arrived") || m.contains("no job yet") => {}
            Err(e) => return Err(e.into()),
        }
        if last {
            return Ok(out);
        }
        let wake = Instant::now() + every;
        while Instant::now() < wake && !stop() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
