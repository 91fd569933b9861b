//! The training driver (issue #16): one loop owns what every strategy shares (the batches and
//! the sampler position, the learning-rate schedule and its batch scaling, the test hooks, the
//! reports, metrics, TensorBoard and JSON logs, the timeline, evaluation, checkpoints and their
//! background writes, the final sample and the summary). A [`Strategy`] does only what differs:
//! one optimizer step's forward, backward, communication and update; evaluation and sampling
//! with its model pieces; writing its state into a checkpoint; handing back the whole model.
//!
//! A strategy is built (its groups, model pieces and optimizer, and the resumed state when there
//! is a checkpoint to continue from) by its own constructor; [`drive`] then runs it to the end.
//! The strategies on the driver: the data-parallel one (DDP, ZeRO-1/2/3, tensor and sequence
//! parallelism, scheduled communication, local SGD, deterministic and mixed-precision
//! training: the library's `Trainer` over the built-in model, `kolo::builtin`, handed to
//! [`crate::run::run`]; expert parallelism and the GPipe and 1F1B pipelines too, over
//! `kolo::pp`, PipeDream-2BW's stream of batches between drain points,
//! [`StepCtx::drain_at`]) and `ps_worker` (parameter-server workers, [`Job::Alone`]).

use crate::cadence::{eval_due, Cadence, Window};
use crate::checkpointing::{PendingSave, Resumed};
use crate::config::{DataConfig, DdpConfig, TrainConfig};
use crate::data::{CharVocab, Dataset};
use crate::report::{Reporter, StepRecord};
use crate::sampler::{Position, Sampler};
use crate::setup::{Data, Setup};
use crate::summary::{peak_rss, Eval, HeapReport, RunOptions, StateBytes, Summary};
use crate::TrainError;
use kolo_comm::Communicator;
use kolo_tensor::Batch;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What a strategy is told for one optimizer step.
pub struct StepCtx {
    /// The step (0-based, counted from the start of the run, not of this process).
    pub step: u64,
    /// Its learning rate (schedule, warm-up and batch scaling applied).
    pub lr: f32,
    /// The next step count (> `step`) at which the driver needs nothing in flight: an
    /// evaluation, a checkpoint, a batch re-split or the end of the run. A strategy that
    /// overlaps steps (PipeDream-2BW) drains by then.
    pub drain_at: u64,
}

/// What one optimizer step measured.
#[derive(Default)]
pub struct StepOut {
    /// This rank's loss for the step (the mean over its micro-batches), before the driver
    /// averages it over [`Strategy::comm`].
    pub loss: f64,
    /// Waiting, bytes and hidden fraction of the exchange, steps skipped so far; the driver
    /// fills in the step's time.
    pub rec: StepRecord,
    /// When forward and backward ended (the rest of the step waited and updated).
    pub backward_end: Option<Instant>,
    /// Collectives to draw on the timeline's communication thread: name, start, end.
    pub comm_spans: Vec<(String, Instant, Instant)>,
    /// Appended to the step's log line (e.g. the pipeline's bubble).
    pub note: String,
}

/// What a strategy hands back at the end of a run.
pub struct Finish {
    /// The whole model's parameters (flat), the same on every rank.
    pub params: Vec<f32>,
    /// Model states this rank held between steps.
    pub states: StateBytes,
    /// f16: steps skipped for overflow, and the final loss scale.
    pub skipped_steps: u64,
    pub loss_scale: Option<f64>,
    /// Mixture of experts: tokens routed per expert, summed over every rank.
    pub moe: Option<kolo_tensor::models::MoeLoad>,
    /// Pipelines: the mean measured bubble (idle share of the stages).
    pub pipeline_bubble: Option<f64>,
    /// Parameter-server workers: what this worker pushed and pulled.
    pub ps: Option<crate::PushStats>,
}

/// A checkpoint to write.
pub struct SaveAt<'a> {
    pub dir: &'a Path,
    /// Steps done.
    pub step: u64,
    /// The sampler's position after the last batch of that step.
    pub pos: Position,
    /// The driver's own state (the dynamic batch split); the strategy adds its own.
    pub meta: BTreeMap<String, String>,
    /// Write on a background thread while training goes on.
    pub background: bool,
    /// Test hook: abort after this rank's shard is written, before the commit.
    pub crash: bool,
}

impl SaveAt<'_> {
    /// Writes a model every rank of `comm` holds whole, with its optimizer (rank 0 writes; the
    /// checkpoint is plain DDP's): `meta` is the strategy's, the driver's is added.
    pub fn replicated(
        self,
        meta: &BTreeMap<String, String>,
        params: &kolo_tensor::ParamSet,
        opt: &kolo_optim::Optimizer,
        comm: &dyn Communicator,
    ) -> Result<PendingSave, TrainError> {
        let mut meta = meta.clone();
        meta.extend(self.meta);
        let (dir, step, pos) = (self.dir, self.step, self.pos);
        crate::checkpointing::save_checkpoint(dir, step, params, &[], opt, None, comm, pos, &meta, Vec::new(), self.background, self.crash)
    }
}

/// One way of training a model on many ranks. Every method is called on every rank at the
/// same points of the run, so each may use collectives.
pub trait Strategy {
    /// The ranks over which the step's loss, evaluation sums and the straggler are taken (the
    /// data-parallel group, or every rank when each rank sees its own slice of the data).
    fn comm(&self) -> &dyn Communicator;
    /// This rank's data-parallel replica and the number of replicas: how the data is split.
    /// By default `comm`'s rank and size (each rank its own replica).
    fn replica(&self) -> (usize, usize) {
        (self.comm().rank().get(), self.comm().world_size().get())
    }
    /// One optimizer step: forward and backward over the micro-batches it takes from `data`,
    /// the exchange and the update.
    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError>;
    /// Loss (and accuracy) over at most `max_batches` batches of `ds` (0: all of it); `None`
    /// on ranks that do not hold the result.
    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError>;
    /// Text generated from the model (the config's length and temperature), where this rank
    /// produces it.
    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError>;
    /// A straggler seen from outside the ranks' own timings, at the end of each log window:
    /// the rank, how many milliseconds it trails the median rank, and what was measured.
    /// Parameter-server workers share no communicator, so the servers tell (when each worker's
    /// pushes arrive).
    fn straggler(&mut self) -> Result<Option<(usize, f64, String)>, TrainError> {
        Ok(None)
    }
    /// Writes the strategy's state: parameters, optimizer and its own loop state.
    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError>;
    /// The end of the run, after `steps_run` steps in this process.
    fn finish(&mut self, steps_run: u64) -> Result<Finish, TrainError>;
}

/// The training batches of one replica: prefetched on a background thread, or (dynamic batch
/// sizing) this rank's share of each global batch.
pub struct Batches {
    train: Arc<dyn Dataset>,
    source: Source,
    pos: Position,
    rank: usize,
    /// Test hook: milliseconds of sleep per example handed out (a slower device).
    slow_ms_per_example: Option<f64>,
}

enum Source {
    Prefetched(Receiver<(Position, Batch)>),
    Dynamic { sampler: Sampler, split: crate::sampler::Shares },
}

impl Batches {
    /// Batches of replica `rank` of `replicas` from position `pos`. `split`: the per-rank
    /// shares a resumed run was written with (dynamic batch sizing).
    fn new(
        (dc, seed, ddp): (&DataConfig, u64, &DdpConfig),
        train: Arc<dyn Dataset>,
        (rank, replicas): (usize, usize),
        pos: Position,
        split: Option<Vec<usize>>,
    ) -> Result<Batches, TrainError> {
        let scfg = crate::setup::replica_sampler(dc, seed, train.len(), rank, replicas);
        let batch = dc.batch_size;
        // Dynamic batch sizing: every rank walks the global batches itself and takes its share;
        // the shares change during the run, so nothing is prefetched. A resumed run continues
        // with the split it was written with.
        let shares = (ddp.dynamic_batch_every > 0).then(|| {
            let split = crate::sampler::resumed_split(split.as_deref(), batch, replicas).unwrap_or_else(|| vec![batch; replicas]);
            Arc::new(std::sync::Mutex::new(split))
        });
        let sampler = Sampler::for_replica(scfg, pos, ddp.deterministic, shares.as_ref()).map_err(TrainError::Data)?;
        let source = match shares {
            Some(split) => Source::Dynamic { sampler, split },
            None => Source::Prefetched(crate::setup::prefetch(train.clone(), sampler, dc.prefetch)),
        };
        Ok(Batches { train, source, pos, rank, slow_ms_per_example: None })
    }

    /// This rank's next batch.
    pub fn next_batch(&mut self) -> Result<Batch, TrainError> {
        let (pos, batch) = match &mut self.source {
            Source::Prefetched(rx) => rx.recv().map_err(|_| TrainError::Other("the prefetch thread stopped".into()))?,
            Source::Dynamic { sampler, .. } => {
                let idx = sampler.next_batch();
                (sampler.position(), self.train.batch(&idx))
            }
        };
        self.pos = pos;
        if let Some(ms) = self.slow_ms_per_example {
            std::thread::sleep(Duration::from_secs_f64(ms * batch.len() as f64 / 1e3));
        }
        Ok(batch)
    }

    /// This rank's share of the global batch relative to an equal share (its examples times
    /// the replicas over the global batch): its mean loss weighs by it. 1 unless the shares are
    /// uneven.
    pub fn share(&self) -> f64 {
        self.split().map_or(1.0, |s| s[self.rank] as f64 * s.len() as f64 / s.iter().sum::<usize>() as f64)
    }

    /// The per-replica shares of each global batch, when every rank slices global batches.
    pub fn split(&self) -> Option<Vec<usize>> {
        match &self.source {
            Source::Dynamic { split, .. } => Some(split.lock().unwrap_or_else(|p| p.into_inner()).clone()),
            Source::Prefetched(_) => None,
        }
    }

    /// The sampler position after the last batch handed out.
    pub fn position(&self) -> Position {
        self.pos
    }

    /// Dynamic batch sizing at the end of a window: every rank's time per example over it, and
    /// the new split from them (on every rank of `comm`).
    fn resplit(&mut self, window: usize, report: &Reporter, comm: &dyn Communicator, done: u64) -> Result<(), TrainError> {
        let Source::Dynamic { split, .. } = &self.source else { return Ok(()) };
        crate::sampler::replan(split, self.rank, window, report, comm, done)
    }
}

/// Where a run starts: the resumed checkpoint (its path and state) or step 0.
pub type Start = Option<(PathBuf, Resumed)>;

/// The processes of a run, as the driver sees them.
#[derive(Clone, Copy)]
pub enum Job<'a> {
    /// Every rank of the run, on one communicator (the timeline's files are merged over it).
    Ranks(&'a dyn Communicator),
    /// A process that shares no communicator with the others (a parameter-server worker: one
    /// that dies must not stop the rest), by its number. It writes its own timeline file.
    Alone(usize),
}

impl Job<'_> {
    fn rank(&self) -> usize {
        match self {
            Job::Ranks(c) => c.rank().get(),
            Job::Alone(r) => *r,
        }
    }
}

/// Runs `s` from `start` to the end of the run (or `opts.stop_after`). `job`: the processes of
/// the run; `heap_before`: live heap bytes after the
/// data was loaded, before the model existed.
pub fn drive(
    cfg: &Setup,
    opts: &RunOptions,
    job: Job<'_>,
    data: &Data,
    heap_before: Option<usize>,
    s: &mut dyn Strategy,
    start: Start,
) -> Result<Summary, TrainError> {
    let tc = &cfg.train;
    let global_rank = job.rank();
    let replica = s.replica();
    let global_batch = cfg.global_batch(replica.1);
    let (first, pos, split) = match start {
        Some((path, r)) => {
            if global_rank == 0 && !opts.quiet {
                kolo_base::eline!("resumed from {} at step {}", path.display(), r.step);
            }
            (r.step, r.pos, r.batch_split)
        }
        None => (0, Position::default(), None),
    };
    let mut batches = Batches::new((&cfg.data, tc.seed, &cfg.ddp), data.train.clone(), replica, pos, split)?;
    batches.slow_ms_per_example = opts.slow_per_example.filter(|s| s.0 == global_rank).map(|s| s.1);
    let report = Reporter::for_train(tc, cfg.tokens_per_example, global_rank, opts.quiet, global_batch, first)?;
    let mut cadence = Cadence::new(report);
    let mut timeline = tc.timeline_dir.as_ref().map(|_| crate::timeline::Timeline::new(global_rank));
    let end = opts.stop_after.map_or(tc.steps, |s| s.min(tc.steps));
    let mut checkpoint: Option<PathBuf> = None;
    kolo_base::alloc::reset_peak();
    let mut heap_after = None;
    for step in first..end {
        let t0 = Instant::now();
        test_hooks(opts, global_rank, step);
        let lr = cfg.optim.lr_of_step(global_batch, tc.steps, step);
        let out = s.step(&StepCtx { step, lr, drain_at: drain_point(tc, cfg.ddp.dynamic_batch_every, step, end) }, &mut batches)?;
        if let Some(tl) = timeline.as_mut() {
            record_spans(tl, step, t0, &out);
        }
        heap_after = kolo_base::alloc::stats();
        let done = step + 1;
        cadence.record(done, StepRecord { step_ms: t0.elapsed().as_secs_f64() * 1e3, ..out.rec });
        if cfg.ddp.dynamic_batch_every > 0 && done.is_multiple_of(cfg.ddp.dynamic_batch_every) {
            batches.resplit(cfg.ddp.dynamic_batch_every as usize, &cadence.report, s.comm(), done)?;
        }
        match cadence.end_window(s.comm(), done, end, out.loss, lr, batches.pos.epoch, &out.note, tc)? {
            Window::Diverged(why) => return Err(TrainError::Data(why)),
            Window::Logged => {
                if let Some((rank, lag, what)) = s.straggler()? {
                    cadence.report.straggler_seen(done, rank, lag, &what);
                }
            }
            Window::Open => {}
        }
        // The last step's evaluation is the final one, after the loop.
        if eval_due(tc, done) && done != end {
            if let Some(e) = s.evaluate(&*data.eval, tc.eval_batches)? {
                cadence.report.eval(done, &e, false);
            }
        }
        if let Some((dir, previous)) = cadence.checkpoint_due(tc, done, end)? {
            checkpoint = previous.or(checkpoint);
            let background = tc.checkpoint_background && opts.crash_during_save.is_none();
            let split = batches.split().filter(|_| cfg.ddp.dynamic_batch_every > 0);
            let meta = crate::checkpointing::loop_state_meta(None, split.as_deref());
            let crash = opts.crash_during_save == Some(done);
            let p = s.save(SaveAt { dir: &dir, step: done, pos: batches.position(), meta, background, crash })?;
            cadence.saving(done, p, background);
        }
    }
    if let Some((path, background)) = cadence.settle()? {
        checkpoint = Some(path);
        if background {
            // Every rank's writer has finished (and rank 0 committed) before anyone reports done.
            s.comm().barrier()?;
        }
    }
    if let (Some(tl), Some(d)) = (&timeline, &tc.timeline_dir) {
        write_timeline(tl, Path::new(d), job, global_rank == 0 && !opts.quiet)?;
    }
    let mut report = cadence.report;
    report.finish();
    let (eval, sample) =
        if end == tc.steps { final_eval(tc, data, s, &mut report, global_rank == 0 && !opts.quiet)? } else { (None, None) };
    let f = s.finish(end - first)?;
    Ok(Summary {
        steps_done: end,
        last_loss: report.last_loss,
        eval,
        // A pipeline hides its communication except in the bubble.
        hidden_fraction: f.pipeline_bubble.map_or(report.hidden_fraction(), |b| 1.0 - b),
        step_ms: std::mem::take(&mut report.step_ms),
        comm_wait_ms: std::mem::take(&mut report.wait_ms),
        comm_bytes: std::mem::take(&mut report.comm_bytes),
        straggler: report.straggler,
        params: f.params,
        sample,
        checkpoint,
        states: f.states,
        peak_rss: peak_rss(),
        heap: HeapReport::between(heap_before, heap_after),
        skipped_steps: f.skipped_steps,
        loss_scale: f.loss_scale,
        ps: f.ps,
        pipeline_bubble: f.pipeline_bubble,
        moe: f.moe,
        batch_split: batches.split(),
    })
}

/// The first step count after `step` at which the driver evaluates, checkpoints, re-splits the
/// batch (every `resplit_every` steps, `ddp.dynamic_batch_every`) or ends (`end`).
pub fn drain_point(tc: &TrainConfig, resplit_every: u64, step: u64, end: u64) -> u64 {
    let next = |every: u64| step.checked_div(every).map_or(end, |q| (q + 1) * every);
    let checkpoint_every = if tc.checkpoint_dir.is_some() { tc.checkpoint_every } else { 0 };
    [next(tc.eval_every), next(checkpoint_every), next(resplit_every), end].into_iter().min().unwrap_or(end)
}

/// The end of a complete run: the final evaluation (the whole test set for images, 10k for
/// MNIST; text validation sets have a window at every position, so `eval_batches` bounds them)
/// and, for text, a sample.
fn final_eval(
    tc: &TrainConfig,
    data: &Data,
    s: &mut dyn Strategy,
    report: &mut Reporter,
    say: bool,
) -> Result<(Option<Eval>, Option<String>), TrainError> {
    let end = tc.steps;
    let limit = if data.vocab.is_some() { tc.eval_batches } else { 0 };
    let eval = s.evaluate(&*data.eval, limit)?;
    if let Some(e) = &eval {
        report.eval(end, e, true);
    }
    let mut sample = None;
    if let Some(v) = data.vocab.as_ref().filter(|_| tc.sample_chars > 0) {
        sample = s.sample(v)?;
        if let Some(text) = sample.as_ref().filter(|_| say) {
            kolo_base::eline!("{}", crate::eval::sample_block(tc, text));
        }
    }
    Ok((eval, sample))
}

/// The test hooks at the start of a step: a straggler's sleep, a rank that dies.
fn test_hooks(opts: &RunOptions, rank: usize, step: u64) {
    if let Some((_, ms)) = opts.slow_rank.filter(|s| s.0 == rank) {
        std::thread::sleep(Duration::from_millis(ms));
    }
    if opts.die_at == Some((rank, step)) {
        kolo_base::eline!("rank {rank}: killing itself (SIGKILL) at step {step} as asked (--kill-at)");
        // SAFETY: kill(2) on this process.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

/// A step on the timeline: its collectives on the communication thread; forward and backward,
/// then waiting and the update, on the compute thread (the whole step when the strategy does
/// not tell when backward ended).
pub fn record_spans(tl: &mut crate::timeline::Timeline, step: u64, t0: Instant, out: &StepOut) {
    use crate::timeline::{COMM, COMPUTE};
    let args = || serde_json::json!({ "step": step });
    for (name, a, b) in &out.comm_spans {
        tl.span(name, "comm", COMM, *a, *b, args());
    }
    let now = Instant::now();
    match out.backward_end {
        Some(be) => {
            tl.span("forward + backward", "compute", COMPUTE, t0, be, args());
            tl.span("wait + update", "compute", COMPUTE, be, now, args());
        }
        None => tl.span("step", "compute", COMPUTE, t0, now, args()),
    }
}

/// Every rank writes its trace file into `dir`; rank 0 merges them into `trace.json` (a process
/// alone only writes its own: `kolo ps run` merges the workers' files when they are done).
pub fn write_timeline(tl: &crate::timeline::Timeline, dir: &Path, job: Job<'_>, say: bool) -> Result<(), TrainError> {
    let io = |e: std::io::Error| TrainError::Other(format!("train.timeline_dir {}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    tl.write(&dir.join(format!("trace-rank{}.json", job.rank()))).map_err(io)?;
    let Job::Ranks(job) = job else { return Ok(()) };
    let (rank, world) = (job.rank().get(), job.world_size().get());
    job.barrier()?;
    if rank == 0 {
        let files: Vec<PathBuf> = (0..world).map(|r| dir.join(format!("trace-rank{r}.json"))).collect();
        crate::timeline::merge(&files, &dir.join("trace.json")).map_err(io)?;
        if say {
            kolo_base::eline!("timeline: {} (open in https://ui.perfetto.dev)", dir.join("trace.json").display());
        }
    }
    Ok(())
}
