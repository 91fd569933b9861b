//! A worker of a parameter-server job (`[train] strategy = "ps"`): pull the parameters, compute
//! a gradient on this worker's data shard, push it; the servers apply the optimizer.
//!
//! Clocks: under BSP and bounded delay a worker pulls for step t and pushes step t, so the
//! servers' vector clocks count steps. Under async (Downpour) it pulls every `fetch_every` steps
//! and pushes the gradients accumulated over `push_every` steps; clocks count pushes.

use crate::config::{Config, DataKind, PsConsistency};
use crate::sampler::{Position, Sampler, SamplerConfig};
use crate::trainer::{evaluate, load_data, peak_rss, prefetch, sample_text, spec_string, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::WorldSize;
use kolo_comm::LocalComm;
use kolo_optim::{clip_factor, lr_at, scaled_lr, sum_of_squares};
use kolo_ps::client::ClientOptions;
use kolo_ps::{JobSpec, PsClient, SignificantlyModified};
use kolo_rendezvous::JobToken;
use kolo_tensor::{build_model, ModelSpec, PlainView};
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
            eprintln!("{m}");
        }
    };
    let tc = &cfg.train;
    let pc = &cfg.ps;
    let data = load_data(cfg, rank, &say)?;
    let spec = cfg.model_spec(data.vocab_size);
    let model = build_model(&spec, tc.seed)?;
    let numel = model.params().numel();
    let job = JobSpec { len: numel as u64, chunk: pc.chunk, workers: world as u32, replication: pc.replication, consistency: pc.consistency(), optimizer: cfg.optimizer() };
    let coordinator = pc.coordinator.clone().unwrap_or_else(|| w.coordinator.clone());
    let mut client = PsClient::connect(ClientOptions {
        coordinator: coordinator.clone(),
        token: w.token.clone(),
        job,
        worker: rank as u32,
        min_servers: pc.servers,
        timeout: Duration::from_secs_f64(pc.timeout_secs),
        heartbeat: Some(Duration::from_millis(500)),
    })?;
    let mut flat = model.params().to_flat()?;
    if rank == 0 {
        // Every worker builds the same initial model from the seed; worker 0's copy seeds the servers.
        client.init(&flat)?;
    }
    let (s_world, s_rank) = if cfg.data.kind == DataKind::Synthetic { (1, 0) } else { (world, rank) };
    let sampler = Sampler::new(
        SamplerConfig { len: data.train.len(), world: s_world, rank: s_rank, batch: cfg.data.batch_size, seed: tc.seed, shuffle: cfg.data.shuffle, drop_last: cfg.data.drop_last },
        Position::default(),
    )
    .map_err(TrainError::Data)?;
    let batches = prefetch(data.train.clone(), sampler, cfg.data.prefetch);
    let global_batch = cfg.data.batch_size * world * tc.grad_accum as usize;
    let base_lr = cfg.optim.reference_batch.map_or(cfg.optim.lr, |r| scaled_lr(cfg.optim.lr, global_batch, r));
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
    let is_async = pc.consistency == PsConsistency::Async;
    let mut filter = (pc.filter_threshold > 0.0).then(|| SignificantlyModified::new(pc.filter_threshold));
    let (mut grads, mut micro, mut acc) = (vec![0f32; numel], vec![0f32; numel], vec![0f32; numel]);
    let (mut step_ms, mut wait_ms, mut comm_bytes) = (Vec::new(), Vec::new(), Vec::new());
    let mut pushes = 0u64;
    let mut last_loss = f64::NAN;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let te = kolo_tensor::TensorError::from;
    for step in 0..end {
        let t0 = Instant::now();
        if let Some((r, ms)) = opts.slow_rank {
            if r == rank {
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        let lr = lr_at(base_lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        let mut waited = Duration::ZERO;
        if !is_async || step % pc.fetch_every == 0 {
            let t = Instant::now();
            client.pull(if is_async { pushes } else { step }, &mut flat)?;
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
            client.push(if is_async { pushes } else { step }, lr, &acc, filter.as_mut().map(|f| f as &mut dyn kolo_ps::Filter))?;
            waited += t.elapsed();
            pushes += 1;
            acc.fill(0.0);
        }
        comm_bytes.push((client.stats().bytes_out - before) as usize);
        last_loss = loss_sum;
        step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        wait_ms.push(waited.as_secs_f64() * 1e3);
        let done = step + 1;
        if tc.log_every > 0 && (done % tc.log_every == 0 || done == end) {
            say(&format!(
                "step {done}/{} loss {last_loss:.4} lr {lr:.3e} | {:.1} ms/step, {:.1} ms of it in push/pull | lead over the slowest worker up to {} step(s)",
                tc.steps,
                step_ms.last().copied().unwrap_or(0.0),
                wait_ms.last().copied().unwrap_or(0.0),
                client.stats().max_lead
            ));
        }
    }
    // The final parameters: every push of every worker applied (BSP), or whatever the servers
    // hold when this worker is done (bounded delay waits for the slowest within τ; async none).
    client.pull(if is_async { pushes } else { end }, &mut flat)?;
    model.params().load(&flat)?;
    let mut eval = None;
    let mut sample = None;
    if rank == 0 && end == tc.steps {
        let local = LocalComm::create(WorldSize::new(1).expect("1 > 0")).remove(0);
        let limit = if data.vocab.is_some() { tc.eval_batches } else { 0 };
        let e = evaluate(&*model, &PlainView, &*data.eval, &local, cfg.data.batch_size, limit, false, &|| Ok(()))?;
        say(&format!("final eval on {} examples: loss {:.4}{}", e.examples, e.loss, e.accuracy.map_or(String::new(), |a| format!(", accuracy {:.2}%", a * 100.0))));
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
    if let Some(f) = &filter {
        say(&format!("significantly-modified filter: sent {} of {} gradient values ({:.1}% saved)", stats.values_sent, stats.values_total, f.saved() * 100.0));
    }
    Ok(Summary {
        steps_done: end,
        last_loss,
        eval,
        step_ms,
        comm_wait_ms: wait_ms,
        comm_bytes,
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
    })
}
