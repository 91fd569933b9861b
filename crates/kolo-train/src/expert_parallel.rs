//! Expert-parallel training of a mixture-of-experts GPT (`[model] experts = E`, `[mesh] ep = P`):
//! every rank is a data-parallel replica with its own data shard; within each group of P
//! consecutive ranks the experts of every MoE block are dealt out E / P per rank, and tokens go
//! to their expert's rank and back with all-to-all (see `kolo_tensor::models::moe`). Gradients of
//! the parameters outside the experts are averaged over every rank; an expert's gradient already
//! sums the contributions of all tokens its group routed to it, so it is summed over the groups
//! (ranks holding the same experts) and divided by the world size: the mean over every rank's
//! loss, as DDP with every expert on every rank computes it.

use crate::checkpointing::{load_checkpoint, save_checkpoint, PendingSave};
use crate::config::{Config, StepTables};
use crate::data::{CharVocab, Dataset};
use crate::driver::{checkpoint_meta, Batches, Finish, SaveAt, Start, StepCtx, StepOut, Strategy};
use crate::setup::{optimizer_step, Data};
use crate::summary::{Eval, RunOptions};
use crate::TrainError;
use kolo_base::{Exchange, Rng};
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};
use kolo_optim::{clip_factor, sum_of_squares, Optimizer};
use kolo_tensor::models::{Gpt, GptConfig, MoeLoad};
use kolo_tensor::{Model, ModelSpec, PlainView};
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// A communicator as the expert-parallel exchange.
pub struct CommExchange(pub Arc<dyn Communicator>);

impl Exchange for CommExchange {
    fn rank(&self) -> usize {
        self.0.rank().get()
    }
    fn size(&self) -> usize {
        self.0.world_size().get()
    }
    fn all_to_all(&self, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize]) -> Result<(), String> {
        self.0.all_to_all(BufRef::from(send), send_counts, BufMut::from(recv), recv_counts).map_err(|e| e.to_string())
    }
}

/// Sums routing counts over `comm` (every rank's tokens).
pub fn reduce_load(load: Option<MoeLoad>, comm: &dyn Communicator) -> Result<Option<MoeLoad>, TrainError> {
    let Some(l) = load else { return Ok(None) };
    let mut v: Vec<f64> = l.load.iter().map(|&x| x as f64).chain([l.dropped as f64, l.assigned as f64]).collect();
    comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum)?;
    let n = l.load.len();
    Ok(Some(MoeLoad { load: v[..n].iter().map(|&x| x as u64).collect(), dropped: v[n] as u64, assigned: v[n + 1] as u64 }))
}

pub struct ExpertParallel<'a> {
    t: StepTables<'a>,
    /// Every rank: each is a data-parallel replica with its own data shard.
    comm: Arc<dyn Communicator>,
    /// The ranks holding the same experts as this one (one per expert-parallel group).
    rep: Arc<dyn Communicator>,
    gcfg: GptConfig,
    gpt: Gpt,
    opt: Optimizer,
    grads: Vec<f32>,
    /// The flat ranges of the parameters outside the experts, and of this rank's experts.
    shared: Vec<Range<usize>>,
    mine: Vec<Range<usize>>,
    meta: std::collections::BTreeMap<String, String>,
}

impl<'a> ExpertParallel<'a> {
    /// `comm`: every rank; `ep`: this rank's expert-parallel group; `rep`: the ranks holding
    /// the same experts as this one.
    pub fn new(
        cfg: &'a Config,
        comm: Arc<dyn Communicator>,
        ep: Arc<dyn Communicator>,
        rep: Arc<dyn Communicator>,
        data: &Data,
        resume: Option<&Path>,
        opts: &RunOptions,
    ) -> Result<(ExpertParallel<'a>, Start), TrainError> {
        let (rank, world) = (comm.rank().get(), comm.world_size().get());
        let gcfg = crate::setup::gpt_config(cfg, &[&*comm, &*ep, &*rep], data)?;
        let ep_size = ep.world_size().get();
        let gpt = Gpt::new_expert_parallel(gcfg.clone(), &mut Rng::new(cfg.train.seed), Arc::new(CommExchange(ep)))?;
        let expert = gpt.expert_params().expect("an expert-parallel model");
        let numel = gpt.params().numel();
        let mut opt = crate::setup::optimizer_for(&cfg.optim, numel)?;
        let meta = checkpoint_meta(cfg, &ModelSpec::Gpt(gcfg.clone()), world, 0);
        let start = match resume {
            Some(path) => {
                // Whole tensors into a whole model, then this rank's shared parameters and experts.
                let whole = Gpt::new(gcfg.clone(), &mut Rng::new(cfg.train.seed))?;
                let mut full = vec![0f32; whole.params().numel()];
                let mut whole_opt = Optimizer::new(cfg.optimizer(), full.len());
                let ranges: Vec<_> = whole.params().iter().map(|p| p.range.clone()).collect();
                let r = load_checkpoint(path, whole.params(), &mut full, &mut whole_opt, None, &ranges, &meta)?;
                gpt.params().load(&gpt.ep_local_from(&full)?)?;
                let states = whole_opt
                    .state()
                    .into_iter()
                    .map(|(name, v)| Ok((name, gpt.ep_local_from(v)?)))
                    .collect::<Result<Vec<_>, TrainError>>()?;
                opt.load_state(whole_opt.steps(), &states).map_err(TrainError::Other)?;
                Some((path.to_path_buf(), r))
            }
            None => None,
        };
        if rank == 0 && !opts.quiet {
            let experts = gcfg.moe.as_ref().map_or(0, |m| m.experts);
            kolo_base::eline!(
                "kolo train (expert parallel): MoE GPT {} params ({numel} on each rank), {experts} experts per block dealt over {ep_size} ranks ({} each) x {} groups, top-{} routing",
                gpt.full_numel(),
                experts / ep_size,
                world / ep_size,
                gcfg.moe.as_ref().map_or(0, |m| m.top_k)
            );
        }
        let (mut shared, mut mine) = (Vec::new(), Vec::new());
        for (i, p) in gpt.params().iter().enumerate() {
            if expert[i] { &mut mine } else { &mut shared }.push(p.range.clone());
        }
        let s = ExpertParallel { t: cfg.step_tables(), comm, rep, gcfg, gpt, opt, grads: vec![0f32; numel], shared, mine, meta };
        Ok((s, start))
    }

    /// The whole model on every rank (collective): each expert written by its first holder, the
    /// rest by rank 0.
    fn whole_params(&self) -> Result<Vec<f32>, TrainError> {
        self.whole(&self.gpt.params().to_flat()?)
    }

    /// Values in this rank's layout (parameters, or an optimizer state buffer) assembled into
    /// the whole model's layout on every rank (collective).
    fn whole(&self, local: &[f32]) -> Result<Vec<f32>, TrainError> {
        let mut flat = vec![0f32; self.gpt.full_numel()];
        self.gpt.ep_pieces_into(local, &mut flat, self.rep.rank().get() == 0, self.comm.rank().get() == 0)?;
        self.comm.all_reduce(BufMut::from(&mut flat[..]), ReduceOp::Sum)?;
        Ok(flat)
    }
}

fn gather(g: &[f32], rs: &[Range<usize>]) -> Vec<f32> {
    rs.iter().flat_map(|r| g[r.clone()].iter().copied()).collect()
}

fn scatter(v: &[f32], rs: &[Range<usize>], g: &mut [f32]) {
    let mut o = 0;
    for r in rs {
        g[r.clone()].copy_from_slice(&v[o..o + r.len()]);
        o += r.len();
    }
}

impl Strategy for ExpertParallel<'_> {
    fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    fn step(&mut self, ctx: &StepCtx, data: &mut Batches) -> Result<StepOut, TrainError> {
        let te = kolo_tensor::TensorError::from;
        let (rank, world) = self.replica();
        let batch = data.next_batch()?;
        let loss = self.gpt.loss(&batch, &PlainView)?;
        let local_loss = f64::from(loss.to_scalar::<f32>().map_err(te)?);
        let g = loss.backward().map_err(te)?;
        self.gpt.params().grads_into(&g, &mut self.grads)?;
        drop((g, loss));
        let backward_end = Instant::now();
        let mut s = gather(&self.grads, &self.shared);
        self.comm.all_reduce(BufMut::from(&mut s[..]), ReduceOp::Avg)?;
        scatter(&s, &self.shared, &mut self.grads);
        let mut e = gather(&self.grads, &self.mine);
        self.rep.all_reduce(BufMut::from(&mut e[..]), ReduceOp::Sum)?;
        e.iter_mut().for_each(|x| *x /= world as f32);
        scatter(&e, &self.mine, &mut self.grads);
        let reduced = Instant::now();
        if let Some(max) = self.t.optim.clip_grad_norm {
            // Shared parameters counted once, every expert once (its replicas share the sum).
            let own_shared = if rank == 0 { sum_of_squares(&s) } else { 0.0 };
            let own_experts = if self.rep.rank().get() == 0 { sum_of_squares(&e) } else { 0.0 };
            let mut sq = [own_shared + own_experts];
            self.comm.all_reduce(BufMut::from(&mut sq[..]), ReduceOp::Sum)?;
            let f = clip_factor(sq[0].sqrt(), max);
            self.grads.iter_mut().for_each(|x| *x *= f);
        }
        optimizer_step(self.gpt.params(), &mut self.opt, &self.grads, ctx.lr)?;
        let mut out = StepOut { loss: local_loss, backward_end: Some(backward_end), ..Default::default() };
        out.rec.wait_ms = Some((reduced - backward_end).as_secs_f64() * 1e3);
        out.rec.comm_bytes = Some((s.len() + e.len()) * 4);
        out.comm_spans.push(("all_reduce gradients".into(), backward_end, reduced));
        Ok(out)
    }

    fn evaluate(&mut self, ds: &dyn Dataset, max_batches: usize) -> Result<Option<Eval>, TrainError> {
        // Whole sequences, with every expert, on rank 0.
        let flat = self.whole_params()?;
        let lead = self.comm.rank().get() == 0;
        lead.then(|| crate::eval::evaluate_alone(self.t.batch_size, &self.gcfg, &flat, ds, max_batches)).transpose()
    }

    fn sample(&mut self, vocab: &CharVocab) -> Result<Option<String>, TrainError> {
        let flat = self.whole_params()?;
        let lead = self.comm.rank().get() == 0;
        lead.then(|| crate::eval::sample_alone(self.t.train, &self.gcfg, &flat, vocab)).transpose()
    }

    fn save(&mut self, at: SaveAt<'_>) -> Result<PendingSave, TrainError> {
        // Every rank assembles the whole model and optimizer state; rank 0 writes them as DDP
        // would, so the checkpoint continues under DDP or another expert-parallel size.
        let values = self.whole_params()?;
        let states = self.opt.state().into_iter().map(|(name, v)| Ok((name, self.whole(v)?))).collect::<Result<Vec<_>, TrainError>>()?;
        let whole = Gpt::new(self.gcfg.clone(), &mut Rng::new(self.t.train.seed))?;
        whole.params().load(&values)?;
        let mut opt = Optimizer::new(self.t.optim.spec(), values.len());
        opt.load_state(self.opt.steps(), &states).map_err(TrainError::Other)?;
        let mut meta = self.meta.clone();
        meta.extend(at.meta);
        save_checkpoint(at.dir, at.step, whole.params(), &[], &opt, None, &*self.comm, at.pos, &meta, Vec::new(), at.background, at.crash)
    }

    fn finish(&mut self, _steps_run: u64) -> Result<Finish, TrainError> {
        let moe = reduce_load(self.gpt.take_moe_load(), &*self.comm)?;
        let states = crate::summary::replicated_states(self.grads.len(), &self.opt);
        Ok(Finish { params: self.whole_params()?, states, skipped_steps: 0, loss_scale: None, moe, pipeline_bubble: None, ps: None })
    }
}
