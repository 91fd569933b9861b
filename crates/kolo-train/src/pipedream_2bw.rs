//! PipeDream-2BW on the training driver (`pipeline.schedule = "2bw"`): the batches flow through
//! the stages as one 1F1B stream without flushes; batch t runs forward and backward on weight
//! version max(t - 1, 0), and its update makes version t + 1 from version t and batch t's
//! gradient (W(t+1) = W(t) - step(grad f(W(t-1)))). Two versions stay alive (double buffering).
//!
//! The stream is run resumably ([`kolo_pipe::StageRun`]): each [`Strategy::step`] runs it up
//! to that step's update and hands control back to the driver with the next batch's
//! micro-batches in flight. A stream ends at the driver's next drain point
//! ([`StepCtx::drain_at`]: an evaluation, a checkpoint, the end) and the next starts from the
//! two versions then alive, so a drain changes when work happens, never what is computed: a run
//! with checkpoints computes what one without them does, and a checkpoint (the latest version,
//! the previous one under `state.previous_weights.*`, the optimizer state, the data
//! position) resumes bitwise.
//!
//! While a stream is open the driver's collectives run on the stages' agreement group
//! (`StageSetup::sync`), never on the pipeline group that carries the activations.

use crate::checkpointing::PendingSave;
use crate::data::{CharVocab, Dataset};
use crate::driver::{Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::pipeline::{split_batch, BuiltStage, StageSetup};
use crate::summary::Eval;
use crate::TrainError;
use kolo_comm::Communicator;
use kolo_pipe::{theoretical_bubble, Schedule, StageRun, StageWork};
use kolo_tensor::models::{Gpt, GptConfig};
use kolo_tensor::{GptStage, Model};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

/// PipeDream-2BW as a [`Strategy`]: this rank's stage, its weight versions and the open stream.
pub struct TwoBw<'a> {
    setup: StageSetup<'a>,
    gcfg: GptConfig,
    /// Weight versions by number (version v: the weights after v updates).
    versions: BTreeMap<u64, Arc<Gpt>>,
    latest: u64,
    /// Batches in flight on this stage, by step: their micro-batches and gradients.
    stages: HashMap<u64, GptStage>,
    /// The last stage: the sum of each batch's micro-batch losses.
    losses: HashMap<u64, f64>,
    /// The open stream and the step it started at.
    stream: Option<(u64, StageRun)>,
    /// Values of one micro-batch's activations between stages.
    act_len: usize,
    /// Over the finished streams: busy and wall milliseconds of this stage, batches, streams.
    busy_ms: f64,
    total_ms: f64,
    batches: u64,
    streams: u64,
    peak_live: usize,
    global_rank: usize,
    quiet: bool,
    meta: BTreeMap<String, String>,
}

impl<'a> TwoBw<'a> {
    /// PipeDream-2BW on a stage `pipeline::build_resumed` made, with the weight versions of
    /// where it starts: the latest and the previous (a checkpoint without one, written by a
    /// flushed strategy, gives the latest for both).
    pub(crate) fn new(b: BuiltStage<'a>) -> Result<(TwoBw<'a>, Start), TrainError> {
        let (global_rank, quiet) = (b.global_rank, b.quiet);
        let c = b.gpt.config();
        let act_len = b.setup.t.batch_size / b.setup.m * c.seq * c.d_model;
        let latest = b.start.as_ref().map_or(0, |(_, r)| r.step);
        let gpt = Arc::new(b.gpt);
        let mut versions = BTreeMap::from([(latest, gpt.clone())]);
        if latest > 0 {
            let previous = gpt.fork()?;
            if let Some(v) = &b.previous {
                previous.params().load(v)?;
            } else if global_rank == 0 && !quiet {
                kolo_base::eline!(
                    "the checkpoint holds no previous weight version (a flushed strategy wrote it): batch {latest} runs on version {latest}"
                );
            }
            versions.insert(latest - 1, Arc::new(previous));
        }
        let s = TwoBw {
            setup: b.setup,
            gcfg: b.gcfg,
            versions,
            latest,
            stages: HashMap::new(),
            losses: HashMap::new(),
            stream: None,
            act_len,
            busy_ms: 0.0,
            total_ms: 0.0,
            batches: 0,
            streams: 0,
            peak_live: 0,
            global_rank,
            quiet,
            meta: b.meta,
        };
        Ok((s, b.start))
    }

    /// The weights of the latest update.
    fn current(&self) -> Arc<Gpt> {
        self.versions[&self.latest].clone()
    }

    /// Evaluation, checkpoints and the end happen between streams (at the driver's drain
    /// points); anything else is a bug of the caller.
    fn drained(&self, what: &str) -> Result<(), TrainError> {
        match &self.stream {
            Some((start, _)) => Err(TrainError::Other(format!(
                "PipeDream-2BW: {what} while the stream started at step {start} still has batches in flight"
            ))),
            None => Ok(()),
        }
    }
}

/// One step's share of the stream: the stage work of the batches it touches.
struct StreamWork<'s, 'a, 'd> {
    st: &'s mut TwoBw<'a>,
    data: &'d mut Batches,
    /// The step the stream started at (its micro-batch numbers count from there).
    start: u64,
    ctx: &'s StepCtx,
    /// The step's loss and when its update began.
    out: Option<(f64, Instant)>,
}

impl StreamWork<'_, '_, '_> {
    /// The step of stream micro-batch `mb`, and its number within that batch.
    fn batch_of(&self, mb: usize) -> (u64, usize) {
        let m = self.st.setup.m;
        (self.start + (mb / m) as u64, mb % m)
    }
}

impl StageWork for StreamWork<'_, '_, '_> {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let (t, i) = self.batch_of(mb);
        let st = &mut *self.st;
        if !st.stages.contains_key(&t) {
            let v = t.saturating_sub(1);
            let gpt =
                st.versions.get(&v).ok_or_else(|| format!("batch {t} needs weight version {v}, which this stage does not hold"))?.clone();
            let batch = self.data.next_batch().map_err(|e| e.to_string())?;
            let micro = split_batch(&batch, st.setup.m).map_err(|e| e.to_string())?;
            st.stages.insert(t, GptStage::new(gpt, st.setup.layers.clone(), micro).rematerialize(st.setup.remat));
        }
        let out = st.stages.get_mut(&t).expect("inserted above").forward(i, input).map_err(|e| e.to_string())?;
        if st.setup.layers.end == st.versions[&st.latest].layers() {
            *st.losses.entry(t).or_default() += f64::from(out[0]);
        }
        Ok(out)
    }

    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let (t, i) = self.batch_of(mb);
        let stage = self.st.stages.get_mut(&t).ok_or_else(|| format!("backward of batch {t} before its forward"))?;
        stage.backward(i, grad).map_err(|e| e.to_string())
    }

    fn update(&mut self, b: usize) -> Result<(), String> {
        let t = self.start + b as u64;
        if t != self.ctx.step {
            return Err(format!("the update of batch {t} came during step {}", self.ctx.step));
        }
        let began = Instant::now();
        let st = &mut *self.st;
        let mut stage = st.stages.remove(&t).ok_or_else(|| format!("update of batch {t}, which did not run here"))?;
        let mut grads = std::mem::take(&mut stage.grads);
        drop(stage);
        let e = |e: TrainError| e.to_string();
        st.setup.average(&mut grads).map_err(e)?;
        let current = st.current();
        let (f, loss) = st.setup.clip_and_loss(&current, &grads, st.losses.remove(&t).unwrap_or(0.0)).map_err(e)?;
        let next = Arc::new(current.fork().map_err(|e| e.to_string())?);
        st.setup.step(&next, &grads, f, self.ctx.lr).map_err(e)?;
        st.latest = t + 1;
        st.versions.insert(t + 1, next);
        // Batch t + 1 (in flight) runs on version t; older ones are done with.
        st.versions.retain(|&v, _| v >= t);
        self.out = Some((loss, began));
        Ok(())
    }
}

impl Strategy for TwoBw<'_> {
    /// The stages' agreement group: the pipeline group carries the stream's activations.
    fn comm(&self) -> &dyn Communicator {
        self.setup.sync.as_deref().unwrap_or(self.setup.comm)
    }

    fn replica(&self) -> (usize, usize) {
        (self.setup.dp.rank().get(), self.setup.dp.world_size().get())
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        let comm = self.setup.comm;
        let (start, mut run) = match self.stream.take() {
            Some(open) => open,
            None => {
                let batches = (ctx.drain_at - ctx.step) as usize;
                (ctx.step, StageRun::new(comm, Schedule::TwoBw { batches }, self.setup.m, self.act_len))
            }
        };
        let sent_before = run.report().bytes_sent;
        let mut work = StreamWork { st: self, data, start, ctx, out: None };
        let done = run.run(comm, &mut work, Some((ctx.step - start) as usize)).map_err(|e| TrainError::Other(e.to_string()))?;
        let (loss, update_began) = work.out.take().ok_or_else(|| TrainError::Other(format!("step {}: no update ran", ctx.step)))?;
        let sent = run.report().bytes_sent - sent_before;
        if done {
            let r = run.finish(comm).map_err(|e| TrainError::Other(e.to_string()))?;
            self.busy_ms += r.busy_ms;
            self.total_ms += r.total_ms;
            self.batches += ctx.step + 1 - start;
            self.streams += 1;
            self.peak_live = self.peak_live.max(r.max_live);
        } else {
            self.stream = Some((start, run));
        }
        let mut out = StepOut { loss, backward_end: Some(update_began), ..Default::default() };
        out.rec.comm_bytes = Some(sent);
        out.note = format!(" (weights version {}, gradient from version {})", ctx.step + 1, ctx.step.saturating_sub(1));
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        self.drained("evaluating")?;
        self.setup.evaluate(&self.gcfg, &self.current(), self.global_rank == 0, ds, max_batches)
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        self.drained("sampling")?;
        self.setup.sample(&self.gcfg, &self.current(), self.global_rank == 0, vocab)
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        self.drained("checkpointing")?;
        let previous = self.latest.checked_sub(1).and_then(|v| self.versions.get(&v)).cloned();
        self.setup.save_stage(at, &self.gcfg, &self.current(), &self.meta, previous.as_deref())
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        self.drained("finishing")?;
        let bubble = self.setup.bubble(self.busy_ms, self.total_ms)?;
        // Each stream fills and drains the pipeline once: (K-1) idle slots per stream.
        let (k, m) = (self.setup.comm.world_size().get(), self.setup.m);
        let theory = if self.streams <= 1 {
            theoretical_bubble(k, m * self.batches as usize)
        } else {
            let idle = (self.streams as usize * (k - 1)) as f64;
            idle / (m as f64 * self.batches as f64 + idle)
        };
        if self.global_rank == 0 && !self.quiet {
            kolo_base::eline!("{}", crate::pipeline::bubble_line(bubble, theory, true, self.peak_live));
        }
        let current = self.current();
        Ok(Finish {
            params: self.setup.assemble(&current)?,
            states: self.setup.states(&current, self.versions.len() as u64),
            skipped_steps: 0,
            loss_scale: None,
            moe: None,
            pipeline_bubble: Some(bubble),
            ps: None,
        })
    }
}
