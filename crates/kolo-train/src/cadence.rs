//! What both training loops do after an optimizer step, written once: `kolo train`'s driver
//! and the library's `Trainer` record the step, end each log window with the step's loss
//! averaged over the ranks (a run whose loss stopped being finite is stopped), and write the
//! periodic and final checkpoints with at most one in flight.

use crate::checkpointing::{due, saved_line, PendingSave};
use crate::config::TrainConfig;
use crate::report::{Reporter, StepRecord};
use crate::TrainError;
use kolo_comm::Communicator;
use std::path::PathBuf;

/// Whether an evaluation is due after `done` optimizer steps: every `tc.eval_every` steps
/// (0: never) and after the last one (`tc.steps`), as `kolo train` evaluates (the last one is
/// its final evaluation).
pub fn eval_due(tc: &TrainConfig, done: u64) -> bool {
    done > 0 && ((tc.eval_every > 0 && done.is_multiple_of(tc.eval_every)) || done == tc.steps)
}

/// The reports and checkpoints of one run.
pub struct Cadence {
    pub report: Reporter,
    /// The checkpoint being written (in the background, or written and not yet waited for).
    saving: Option<PendingSave>,
}

/// How [`Cadence::end_window`] ended a step.
#[derive(Debug, PartialEq)]
pub enum Window {
    /// Not the end of a log window.
    Open,
    /// The window was logged.
    Logged,
    /// The window was logged and the loss averaged over the ranks is not finite: the run
    /// must stop, for this reason (the same on every rank).
    Diverged(String),
}

impl Cadence {
    pub fn new(report: Reporter) -> Cadence {
        Cadence { report, saving: None }
    }

    /// Records the step that made `done` steps.
    pub fn record(&mut self, done: u64, rec: StepRecord) {
        self.report.record(done - 1, rec);
    }

    /// After `done` steps of `end`: at the end of a log window, logs it with `loss` (this
    /// rank's loss of the last step, the mean over its micro-batches) averaged over `comm`'s
    /// ranks, the learning rate, the data's `epoch` and `note`. Collective at the end of a
    /// window (every rank of `comm` calls at the same steps).
    #[allow(clippy::too_many_arguments)]
    pub fn end_window(
        &mut self,
        comm: &dyn Communicator,
        done: u64,
        end: u64,
        loss: f64,
        lr: f32,
        epoch: u64,
        note: &str,
        tc: &TrainConfig,
    ) -> Result<Window, TrainError> {
        if !self.report.is_log_step(done, end) {
            return Ok(Window::Open);
        }
        self.report.window(comm, done, loss, lr, epoch, note)?;
        Ok(self.report.diverged(done, tc).map_or(Window::Logged, Window::Diverged))
    }

    /// Whether a checkpoint is due after `done` steps of `end` (`tc.checkpoint_every`, and the
    /// last step): its directory, once the one in flight is written; also where that one went.
    pub fn checkpoint_due(&mut self, tc: &TrainConfig, done: u64, end: u64) -> Result<Option<(PathBuf, Option<PathBuf>)>, TrainError> {
        let Some(dir) = due(tc, done, end) else { return Ok(None) };
        let previous = self.saving.take().map(PendingSave::wait).transpose()?;
        Ok(Some((PathBuf::from(dir), previous)))
    }

    /// The checkpoint of step `done` the caller started after [`Cadence::checkpoint_due`]
    /// (`background`: written while the next steps run): its line is logged and it stays in
    /// flight until the next one is due or [`Cadence::settle`].
    pub fn saving(&mut self, done: u64, p: PendingSave, background: bool) {
        self.report.log(&saved_line(done, &p.target, background));
        self.saving = Some(p);
    }

    /// Waits for the checkpoint in flight, if any: where it went, and whether it was written
    /// in the background.
    pub fn settle(&mut self) -> Result<Option<(PathBuf, bool)>, TrainError> {
        let Some(p) = self.saving.take() else { return Ok(None) };
        let background = p.thread.is_some();
        Ok(Some((p.wait()?, background)))
    }
}
