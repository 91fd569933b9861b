//! Pipeline-parallel training of the GPT (`[pipeline]`): rank s of the pipeline group is stage s.
//! The planner cuts the layers (embedding, blocks, head) into stages of balanced cost; each
//! batch is split into micro-batches that flow through the stages by the chosen schedule (GPipe
//! or 1F1B); each stage accumulates its own parameters' gradients over the micro-batches, averages
//! them over its data-parallel replicas and steps its own optimizer. Under tensor parallelism a
//! stage's blocks are split over its tensor-parallel group. At the end the whole model is
//! assembled on every rank.

use crate::config::{Config, PipeSchedule};
use crate::trainer::{replica_batches, evaluate_whole_gpt, load_data, peak_rss, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_base::{GroupSum, Rng};
use std::sync::Arc;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_optim::{clip_factor, lr_at, Optimizer};
use kolo_pipe::{partition, run_stage, theoretical_bubble, Schedule, StageWork};
use kolo_tensor::models::Gpt;
use kolo_tensor::{Batch, GptStage, Input, Model, ModelSpec};
use std::time::Instant;

struct Work<'a>(GptStage<'a>);

impl StageWork for Work<'_> {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.forward(mb, input).map_err(|e| e.to_string())
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.backward(mb, grad).map_err(|e| e.to_string())
    }
}

/// Splits a batch of sequences into `m` micro-batches of equal size.
pub fn split_batch(batch: &Batch, m: usize) -> Result<Vec<Batch>, TrainError> {
    let Input::Tokens { ids, b, t } = &batch.input else {
        return Err(TrainError::Config("pipeline parallelism takes token sequences".into()));
    };
    if m == 0 || b % m != 0 {
        return Err(TrainError::Config(format!("a batch of {b} sequences does not split into {m} micro-batches")));
    }
    let per = b / m;
    Ok((0..m)
        .map(|i| Batch { input: Input::Tokens { ids: ids[i * per * t..(i + 1) * per * t].to_vec(), b: per, t: *t }, targets: batch.targets[i * per * t..(i + 1) * per * t].to_vec() })
        .collect())
}

/// `comm` is the pipeline group (rank = stage), `dp` the data-parallel group of this stage's
/// replicas, `tp` the tensor-parallel group (if any).
pub fn run_pipeline(cfg: &Config, comm: &dyn Communicator, dp: &dyn Communicator, tp: Option<Arc<dyn GroupSum>>, global_rank: usize, opts: &RunOptions) -> Result<Summary, TrainError> {
    let pc = cfg.pipeline.as_ref().expect("called for [pipeline] configs");
    let (stage, k) = (comm.rank().get(), comm.world_size().get());
    let (dp_rank, dp_size) = (dp.rank().get(), dp.world_size().get());
    let lead = global_rank == 0 && !opts.quiet;
    let say = |m: &str| {
        if lead {
            eprintln!("{m}");
        }
    };
    let tc = &cfg.train;
    let timeout = std::time::Duration::from_secs_f64(cfg.ddp.timeout_secs.max(0.001));
    comm.set_timeout(timeout);
    dp.set_timeout(timeout);
    let data = load_data(cfg, dp_rank, &say)?;
    let heap_before_model = kolo_base::alloc::stats().map(|h| h.live);
    let ModelSpec::Gpt(gcfg) = cfg.model_spec(data.vocab_size) else { unreachable!("validated: gpt") };
    let gpt = match &tp {
        Some(g) => Gpt::new_tensor_parallel(gcfg.clone(), &mut Rng::new(tc.seed), g.clone())?,
        None => Gpt::new(gcfg.clone(), &mut Rng::new(tc.seed))?,
    };
    if k > gpt.layers() {
        return Err(TrainError::Config(format!("{k} pipeline stages for a GPT with {} layers (embedding, {} blocks, head)", gpt.layers(), gcfg.n_layer)));
    }
    let plan = partition(&gpt.layer_costs(), k);
    let layers = plan[stage].clone();
    let schedule = match pc.schedule {
        PipeSchedule::GPipe => Schedule::GPipe,
        PipeSchedule::OneFOneB => Schedule::OneFOneB,
    };
    let m = pc.micro_batches;
    let own: Vec<usize> = layers.clone().flat_map(|l| gpt.layer_params(l)).collect();
    let ranges: Vec<std::ops::Range<usize>> = own.iter().map(|&i| gpt.params().get(i).range.clone()).collect();
    let own_len: usize = ranges.iter().map(|r| r.len()).sum();
    let mut opt = Optimizer::new(cfg.optimizer(), own_len);
    say(&format!(
        "kolo train (pipeline): GPT {} params in {k} stages {:?} (layers: 0 = embedding, 1..={} blocks, {} = head) x {dp_size} data-parallel replicas x {} tensor-parallel ranks, {m} micro-batches of {}, {:?}; theoretical bubble {:.1}%",
        gpt.full_numel(),
        plan,
        gcfg.n_layer,
        gcfg.n_layer + 1,
        tp.as_ref().map_or(1, |g| g.size()),
        cfg.data.batch_size / m,
        schedule,
        theoretical_bubble(k, m) * 100.0
    ));
    // Every stage of a replica reads the same batches (the first uses the tokens, the last the
    // targets); replicas read disjoint shards. Synthetic data is already per replica.
    let batches = replica_batches(cfg, data.train.clone(), dp_rank, dp_size, 0)?;
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let (mut step_ms, mut comm_bytes) = (Vec::new(), Vec::new());
    let mut last_loss = f64::NAN;
    let mut bubbles = Vec::new();
    let mut peak_live = 0;
    kolo_base::alloc::reset_peak();
    let mut heap_after_steps = None;
    for step in 0..end {
        let t0 = Instant::now();
        let lr = lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, tc.steps, step);
        let (_, batch) = batches.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?;
        let mut work = Work(GptStage::new(&gpt, layers.clone(), split_batch(&batch, m)?));
        let act_len = work.0.act_len()?;
        let report = run_stage(comm, schedule, m, act_len, &mut work).map_err(|e| TrainError::Other(e.to_string()))?;
        let mut grads = work.0.grads;
        peak_live = peak_live.max(report.max_live);
        if dp_size > 1 {
            // This stage's gradients, averaged over its data-parallel replicas.
            let mut packed: Vec<f32> = ranges.iter().flat_map(|r| grads[r.clone()].iter().copied()).collect();
            dp.all_reduce(BufMut::from(&mut packed[..]), ReduceOp::Avg)?;
            let mut at = 0;
            for r in &ranges {
                grads[r.clone()].copy_from_slice(&packed[at..at + r.len()]);
                at += r.len();
            }
        }
        // Global gradient norm (clipping) and the loss (known to the last stage) for everyone.
        let mut v = [0f64, report.losses.iter().map(|l| f64::from(*l)).sum()];
        if cfg.optim.clip_grad_norm.is_some() {
            // Split parameters summed over the tensor-parallel group, replicated ones once.
            let split = gpt.tensor_parallel_split();
            let counted = |i: usize| split.as_ref().is_none_or(|s| s[i] || tp.as_ref().is_some_and(|g| g.rank() == 0));
            let mut sq = [own.iter().zip(&ranges).filter(|(i, _)| counted(**i)).map(|(_, r)| kolo_optim::sum_of_squares(&grads[r.clone()])).sum::<f64>() as f32];
            if let Some(g) = &tp {
                g.sum(&mut sq).map_err(TrainError::Other)?;
            }
            v[0] = f64::from(sq[0]);
        }
        comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
        let mut l = [v[1]];
        dp.all_reduce(BufMut::from(&mut l[..]), ReduceOp::Avg)?;
        last_loss = l[0];
        let f = cfg.optim.clip_grad_norm.map_or(1.0, |max| clip_factor(v[0].sqrt(), max));
        opt.begin_step();
        let mut at = 0;
        for (&i, r) in own.iter().zip(&ranges) {
            let g: Vec<f32> = grads[r.clone()].iter().map(|x| x * f).collect();
            gpt.params().update_one(i, &mut |p| opt.update(at, p, &g, lr))?;
            at += r.len();
        }
        // Measured bubble: idle share of the stages over the step.
        let mut t = vec![0f64; 2 * k];
        t[2 * stage] = report.busy_ms;
        t[2 * stage + 1] = report.total_ms;
        comm.all_reduce(BufMut::from(&mut t[..]), ReduceOp::Sum)?;
        let span = (0..k).map(|s| t[2 * s + 1]).fold(0.0, f64::max);
        let busy: f64 = (0..k).map(|s| t[2 * s]).sum();
        bubbles.push(if span > 0.0 { 1.0 - busy / (k as f64 * span) } else { 0.0 });
        comm_bytes.push(report.bytes_sent);
        step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        heap_after_steps = kolo_base::alloc::stats();
        let done = step + 1;
        if tc.log_every > 0 && (done % tc.log_every == 0 || done == end) {
            say(&format!("step {done}/{} loss {last_loss:.4} | {:.1} ms/step, bubble {:.1}% (theory {:.1}%)", tc.steps, step_ms.last().unwrap_or(&0.0), bubbles.last().unwrap_or(&0.0) * 100.0, theoretical_bubble(k, m) * 100.0));
        }
    }
    // Assemble the whole model on every rank: each stage contributes its own layers' values
    // (under tensor parallelism first put together within the tensor-parallel group).
    let mut mine = vec![0f32; gpt.params().numel()];
    let values = gpt.params().to_flat()?;
    for r in &ranges {
        mine[r.clone()].copy_from_slice(&values[r.clone()]);
    }
    let mut flat = match (&tp, gpt.tensor_parallel_pieces(&mine)) {
        (Some(g), Some(pieces)) => {
            let mut full = pieces?;
            g.sum(&mut full).map_err(TrainError::Other)?;
            full
        }
        _ => mine,
    };
    comm.all_reduce(BufMut::from(&mut flat[..]), ReduceOp::Sum)?;
    let mut eval = None;
    let mut sample = None;
    if global_rank == 0 && end == tc.steps {
        let (e, s) = evaluate_whole_gpt(cfg, &gcfg, &flat, &data, &say)?;
        eval = Some(e);
        sample = s;
    }
    let mean_bubble = if bubbles.is_empty() { 0.0 } else { bubbles.iter().sum::<f64>() / bubbles.len() as f64 };
    say(&format!("pipeline: mean bubble {:.1}% measured, {:.1}% in theory ((K-1)/(M+K-1)); at most {peak_live} micro-batch(es) of activations alive on stage 0", mean_bubble * 100.0, theoretical_bubble(k, m) * 100.0));
    Ok(Summary {
        steps_done: end,
        last_loss,
        eval,
        step_ms,
        comm_wait_ms: Vec::new(),
        comm_bytes,
        straggler: None,
        hidden_fraction: 1.0 - mean_bubble,
        params: flat,
        sample,
        checkpoint: None,
        states: StateBytes { params: own_len as u64 * 4, grads: gpt.params().numel() as u64 * 4, optimizer: opt.state().iter().map(|(_, v)| v.len() as u64 * 4).sum(), offloaded: false },
        peak_rss: peak_rss(),
        heap: crate::trainer::HeapReport::between(heap_before_model, heap_after_steps),
        skipped_steps: 0,
        loss_scale: None,
        ps: None,
        pipeline_bubble: Some(mean_bubble),
        moe: None,
    })
}

