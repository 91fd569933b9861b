//! `ddp.schedule` (ByteScheduler) for a user's candle model: `kolo train`'s scheduler
//! ([`kolo_train::scheduled_ddp::Scheduler`]) beside the user's training thread. Backward hands
//! each gradient to it; it reduces them in prioritised chunks, first layers first, and updates
//! each parameter's variable as soon as its chunks are reduced, while the trainer's step has
//! already returned. The next forward pass must not read a parameter before that update: each
//! variable's storage gets a hook (the vendored candle-core's `Tensor::set_storage_hook`, as
//! ZeRO-3's) that waits for it, on whatever reads it (the model's forward, the user's own
//! evaluation, a save), so the model needs no change. The scheduler's own writes pass.
//!
//! The optimizer is the scheduler's while steps run; the trainer takes it back when it settles
//! (every begun step's update applied) before a checkpoint, a resume or a write to a parameter.

use crate::{Error, Result};
use kolo_comm::Communicator;
use kolo_optim::Optimizer;
use kolo_tensor::ParamSet;
use kolo_train::scheduled_ddp::{on_scheduler_thread, Scheduler};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub(crate) struct Scheduled {
    sched: Arc<Scheduler>,
    /// The variables carrying the hooks (kept alive while the hooks are registered).
    vars: Vec<candle_core::Var>,
    /// Updates a read of a parameter waits for: the trainer's steps done.
    need: Arc<AtomicU64>,
    /// A hook's failed wait (a hook cannot fail the read it precedes).
    hook_error: Arc<Mutex<Option<String>>>,
    /// The optimizer is the scheduler's (lent at a step's backward, back when settled).
    lent: bool,
    rank: usize,
}

impl Scheduled {
    /// Collective: starts the scheduler for `params` (the model's own f32 variables, alike on
    /// every rank) from step 0 and hooks their reads. The scheduler holds an empty optimizer of
    /// `opt`'s kind until the first step lends it the real one.
    pub(crate) fn start(
        comm: &dyn Communicator,
        params: &ParamSet,
        opt: &Optimizer,
        plan: (usize, usize),
        timeout: Duration,
    ) -> Result<Scheduled> {
        let rank = comm.rank().get();
        let empty = Optimizer::new(opt.spec().clone(), 0);
        let sched = Arc::new(Scheduler::start(comm, params, empty, plan, 0, timeout)?);
        let need = Arc::new(AtomicU64::new(0));
        let hook_error: Arc<Mutex<Option<String>>> = Arc::default();
        let vars: Vec<candle_core::Var> = params.iter().map(|p| p.var.clone()).collect();
        for (i, v) in vars.iter().enumerate() {
            let (sched, need, error) = (sched.clone(), need.clone(), hook_error.clone());
            v.as_tensor().set_storage_hook(Some(Arc::new(move || {
                if on_scheduler_thread() {
                    return;
                }
                if let Err(e) = sched.await_update(i, need.load(Ordering::SeqCst)) {
                    error.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                }
            })));
        }
        Ok(Scheduled { sched, vars, need, hook_error, lent: false, rank })
    }

    /// A step's backward begins: the scheduler takes the optimizer (if it has not got it) and
    /// the step. Returns where backward hands the gradients.
    pub(crate) fn begin(&mut self, opt: &mut Optimizer, step: u64, lr: f32) -> Result<&dyn kolo_base::GradSink> {
        self.check("Trainer::backward")?;
        if !self.lent {
            std::mem::swap(opt, &mut *self.sched.opt());
            self.lent = true;
        }
        self.sched.begin(step, lr);
        Ok(self.sched.sink())
    }

    /// Backward has returned: a parameter it gave no gradient is named (as DDP names it).
    pub(crate) fn end_backward(&self) -> Result<()> {
        self.sched.end_backward().map_err(|e| Error::usage(self.rank, "Trainer::backward", e))
    }

    /// The step is done on the trainer's side (`steps` now): reads wait for its updates. The
    /// step's times: waits for updates, communication, and the scheduler's collectives.
    pub(crate) fn end_step(&mut self, steps: u64, bytes: usize) -> Result<(kolo_ddp::SyncStats, kolo_train::scheduled_ddp::Spans)> {
        self.need.store(steps, Ordering::SeqCst);
        self.check("Trainer::update")?;
        let t = self.sched.take_times();
        let secs = Duration::from_secs_f64;
        let stats =
            kolo_ddp::SyncStats { buckets: Vec::new(), wait: secs(t.wait_s), hidden: secs(t.hidden_s()), comm: secs(t.comm_s), bytes };
        Ok((stats, t.spans))
    }

    /// Waits until every begun step's update is applied and takes the optimizer back.
    pub(crate) fn settle(&mut self, opt: &mut Optimizer, op: &'static str) -> Result<()> {
        self.sched.settle().map_err(|e| Error::usage(self.rank, op, e))?;
        self.check(op)?;
        if self.lent {
            std::mem::swap(opt, &mut *self.sched.opt());
            self.lent = false;
        }
        Ok(())
    }

    /// After [`Scheduled::settle`]: the run continues from step `step` (a checkpoint resumed).
    pub(crate) fn restart_at(&mut self, step: u64) {
        self.sched.restart_at(step);
        self.need.store(step, Ordering::SeqCst);
    }

    /// The gradient buffers the scheduler keeps (the hooks' and the reduced copy), in bytes.
    pub(crate) fn grad_bytes(&self) -> u64 {
        self.sched.grad_bytes()
    }

    /// The scheduler's failure or a hook's, as an error of `op`.
    fn check(&self, op: &'static str) -> Result<()> {
        let hook = self.hook_error.lock().unwrap_or_else(|p| p.into_inner()).take();
        match hook.or_else(|| self.sched.error()) {
            Some(e) => Err(Error::usage(self.rank, op, format!("scheduled DDP (ddp.schedule): {e}"))),
            None => Ok(()),
        }
    }
}

impl Drop for Scheduled {
    fn drop(&mut self) {
        // The hooks go first (they hold the scheduler); dropping the last handle stops it.
        for v in &self.vars {
            v.as_tensor().set_storage_hook(None);
        }
    }
}
