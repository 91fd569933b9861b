//! What `kolo train`'s pipelines of the GPT (`[pipeline]`: GPipe, 1F1B, PipeDream-2BW) share
//! with the library's `kolo::pp`, which runs them (`kolo::builtin`'s pipeline strategy, a
//! trainer per stage): a batch cut into micro-batches, the end-of-run bubble line, and the
//! checkpoint names of PipeDream-2BW's previous weight version.

use crate::TrainError;
use kolo_tensor::{Batch, Input};

/// Splits a batch of sequences into `m` micro-batches of equal size.
pub fn split_batch(batch: &Batch, m: usize) -> Result<Vec<Batch>, TrainError> {
    let Input::Tokens { b, .. } = &batch.input else {
        return Err(TrainError::Config("pipeline parallelism takes token sequences".into()));
    };
    if m == 0 || b % m != 0 {
        return Err(TrainError::Config(format!("a batch of {b} sequences does not split into {m} micro-batches")));
    }
    batch.chunks(b / m).ok_or_else(|| TrainError::Config(format!("a batch of {b} sequences does not split into {m} micro-batches")))
}

/// The line at the end of a pipeline run: measured and theoretical bubble, activations kept.
pub fn bubble_line(bubble: f64, theory: f64, two_bw: bool, peak_live: usize) -> String {
    format!(
        "pipeline: mean bubble {:.1}% measured, {:.1}% in theory ((K-1)/(M+K-1){}); at most {peak_live} micro-batch(es) of activations alive on stage 0",
        bubble * 100.0,
        theory * 100.0,
        if two_bw { ", M = every micro-batch between evaluations and checkpoints: no flush between batches" } else { "" },
    )
}

/// Checkpoint name prefix of PipeDream-2BW's previous weight version (whole tensors under the
/// model's parameter names): the version the first batch after a resume runs on.
pub const PREVIOUS_WEIGHTS: &str = "state.previous_weights.";
