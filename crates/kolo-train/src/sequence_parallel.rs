//! Sequence-parallel training of the GPT (`[mesh] sp = P`): the ranks of a sequence-parallel
//! group read the same sequences and each computes one contiguous chunk of every sequence;
//! attention passes key/value blocks around the group's ring. Parameters are replicated: each
//! rank's loss is the mean over its chunk, so averaging the gradients over every rank (all
//! chunks of all data-parallel replicas) gives the gradient of the whole batch's mean loss.
//! Every rank holds the whole model and optimizer state, so checkpoints are DDP's (rank 0
//! writes them) and continue under DDP, or under another sequence split, as well.

use crate::checkpointing::{load_checkpoint, PendingSave};
use crate::config::{Config, StepTables};
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::setup::{optimizer_step, Data};
use crate::summary::{Eval, RunOptions};
use crate::TrainError;
use kolo_base::Rng;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_optim::{clip_factor, sum_of_squares, Optimizer};
use kolo_tensor::models::{Gpt, GptConfig};
use kolo_tensor::{Batch, Input, Model, ModelSpec, PlainView};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// Chunk `r` of `n` of every sequence of a batch (tokens and targets).
pub fn sequence_chunk(batch: &Batch, r: usize, n: usize) -> Result<Batch, TrainError> {
    let Input::Tokens { ids, b, t } = &batch.input else {
        return Err(TrainError::Config("sequence parallelism takes token sequences".into()));
    };
    if n == 0 || t % n != 0 {
        return Err(TrainError::Config(format!("sequences of {t} tokens do not split into {n} equal chunks (mesh.sp)")));
    }
    let c = t / n;
    let pick = |v: &[u32]| -> Vec<u32> { (0..*b).flat_map(|s| v[s * t + r * c..s * t + (r + 1) * c].iter().copied()).collect() };
    Ok(Batch { input: Input::Tokens { ids: pick(ids), b: *b, t: c }, targets: pick(&batch.targets) })
}

pub struct SequenceParallel<'a> {
    t: StepTables<'a>,
    /// Every rank of the job: gradients are averaged over all of them.
    comm: Arc<dyn Communicator>,
    gcfg: GptConfig,
    gpt: Gpt,
    opt: Optimizer,
    grads: Vec<f32>,
    /// This rank's place in its sequence-parallel group, and the group's size.
    chunk: (usize, usize),
    /// This rank's data-parallel replica, and the number of replicas.
    replica: (usize, usize),
    meta: BTreeMap<String, String>,
}

impl<'a> SequenceParallel<'a> {
    /// `comm`: every rank of the job; `sp`: this rank's sequence-parallel group; `replica`:
    /// its data-parallel replica and their number.
    pub fn new(
        cfg: &'a Config,
        comm: Arc<dyn Communicator>,
        sp: Arc<dyn Communicator>,
        replica: (usize, usize),
        data: &Data,
        resume: Option<&Path>,
        opts: &RunOptions,
    ) -> Result<(SequenceParallel<'a>, Start), TrainError> {
        let gcfg = crate::setup::gpt_config(cfg, &[&*comm, &*sp], data)?;
        let chunk = (sp.rank().get(), sp.world_size().get());
        let mut gpt = Gpt::new(gcfg.clone(), &mut Rng::new(cfg.train.seed))?;
        gpt.set_sequence_parallel(Arc::new(kolo_comm::Ring(sp)))?;
        let numel = gpt.params().numel();
        let mut opt = crate::setup::optimizer_for(&cfg.optim, numel)?;
        let meta = checkpoint_meta(cfg, &ModelSpec::Gpt(gcfg.clone()), replica.1, 0);
        let start = match resume {
            Some(path) => {
                // Every rank reads the same file: the replicas stay identical.
                let mut flat = vec![0f32; numel];
                let ranges: Vec<_> = gpt.params().iter().map(|p| p.range.clone()).collect();
                let r = load_checkpoint(path, gpt.params(), &mut flat, &mut opt, None, &ranges, &meta)?;
                gpt.params().load(&flat)?;
                Some((path.to_path_buf(), r))
            }
            None => None,
        };
        if comm.rank().get() == 0 && !opts.quiet {
            kolo_base::eline!(
                "kolo train (sequence parallel): GPT {numel} params, sequences of {} split into {} chunks of {} (ring attention) x {} data-parallel replicas",
                gcfg.seq,
                chunk.1,
                gcfg.seq / chunk.1,
                replica.1,
            );
        }
        let s = SequenceParallel { t: cfg.step_tables(), comm, gcfg, gpt, opt, grads: vec![0f32; numel], chunk, replica, meta };
        Ok((s, start))
    }
}

impl Strategy for SequenceParallel<'_> {
    fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    fn replica(&self) -> (usize, usize) {
        self.replica
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        let te = kolo_tensor::TensorError::from;
        let chunk = sequence_chunk(&data.next_batch()?, self.chunk.0, self.chunk.1)?;
        let loss = self.gpt.loss(&chunk, &PlainView)?;
        let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
        let g = loss.backward().map_err(te)?;
        self.gpt.params().grads_into(&g, &mut self.grads)?;
        let backward_end = Instant::now();
        self.comm.all_reduce(BufMut::from(&mut self.grads[..]), ReduceOp::Avg)?;
        let reduced = Instant::now();
        if let Some(max) = self.t.optim.clip_grad_norm {
            let f = clip_factor(sum_of_squares(&self.grads).sqrt(), max);
            self.grads.iter_mut().for_each(|x| *x *= f);
        }
        optimizer_step(self.gpt.params(), &mut self.opt, &self.grads, ctx.lr)?;
        let mut out = StepOut { loss: local_loss, backward_end: Some(backward_end), ..Default::default() };
        out.rec.wait_ms = Some((reduced - backward_end).as_secs_f64() * 1e3);
        out.rec.comm_bytes = Some(self.grads.len() * 4);
        out.comm_spans.push(("all_reduce gradients".into(), backward_end, reduced));
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        // Whole sequences, with an unsplit copy of the model, on rank 0.
        let lead = self.comm.rank().get() == 0;
        lead.then(|| crate::eval::evaluate_alone(self.t.batch_size, &self.gcfg, &self.gpt.params().to_flat()?, ds, max_batches)).transpose()
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        let lead = self.comm.rank().get() == 0;
        lead.then(|| crate::eval::sample_alone(self.t.train, &self.gcfg, &self.gpt.params().to_flat()?, vocab)).transpose()
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        at.replicated(&self.meta, self.gpt.params(), &self.opt, &*self.comm)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        let params = self.gpt.params().to_flat()?;
        Ok(Finish {
            states: crate::summary::replicated_states(params.len(), &self.opt),
            params,
            skipped_steps: 0,
            loss_scale: None,
            moe: None,
            pipeline_bubble: None,
            ps: None,
        })
    }
}
