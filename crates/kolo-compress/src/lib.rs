//! Gradient compression codecs, as pure functions over flat `f32` buffers (no tensor library,
//! no communication): a strategy encodes, exchanges the encoded form, and decodes. Methods that
//! lose information are meant to be used with [`ErrorFeedback`], which carries what a step did
//! not send into the next one so that, summed over steps, nothing is lost.
//!
//! * [`cast`]: f16 / bf16 (2 bytes per value).
//! * [`topk`] (largest magnitudes, exact) and [`randk`] (random positions from a seed shared by
//!   all ranks, so every rank picks the same ones and the values can be summed densely).
//! * [`qsgd`]: stochastic s-level quantization, unbiased.
//! * [`sign`]: 1 bit per value and one scale (signSGD with the mean magnitude).
//! * [`powersgd`]: rank-r factors P, Q of a matrix, with orthogonalisation.

pub mod cast;
pub mod powersgd;
pub mod qsgd;
pub mod sparse;
pub use sparse::{randk, topk, Sparse};

/// What a lossy codec did not send this step, added back before the next one.
#[derive(Clone, Debug, Default)]
pub struct ErrorFeedback {
    residual: Vec<f32>,
}

impl ErrorFeedback {
    pub fn new(n: usize) -> ErrorFeedback {
        ErrorFeedback { residual: vec![0f32; n] }
    }

    /// Adds the carried residual into `grad` (in place): the value to compress this step.
    pub fn add_into(&self, grad: &mut [f32]) {
        assert_eq!(grad.len(), self.residual.len(), "error feedback: length changed");
        grad.iter_mut().zip(&self.residual).for_each(|(g, r)| *g += r);
    }

    /// Records what was actually sent for `corrected` (the output of [`ErrorFeedback::add_into`]):
    /// the difference is carried to the next step.
    pub fn keep(&mut self, corrected: &[f32], sent: &[f32]) {
        self.residual.iter_mut().zip(corrected.iter().zip(sent)).for_each(|(r, (c, s))| *r = c - s);
    }

    pub fn residual(&self) -> &[f32] {
        &self.residual
    }

    /// Replaces the residual (a resumed run); the length must be the current one.
    pub fn set_residual(&mut self, r: &[f32]) -> Result<(), String> {
        if r.len() != self.residual.len() {
            return Err(format!("an error-feedback residual of {} values, this bucket has {}", r.len(), self.residual.len()));
        }
        self.residual.copy_from_slice(r);
        Ok(())
    }
}

/// Scaled sign compression (signSGD with magnitude): each value becomes ±scale with
/// scale = mean |x| (1 bit per value plus one f32). Returns the packed signs and the scale.
pub fn sign(x: &[f32]) -> (Vec<u8>, f32) {
    let scale = if x.is_empty() { 0.0 } else { (x.iter().map(|v| f64::from(v.abs())).sum::<f64>() / x.len() as f64) as f32 };
    let mut bits = vec![0u8; x.len().div_ceil(8)];
    for (i, v) in x.iter().enumerate() {
        if *v < 0.0 {
            bits[i / 8] |= 1 << (i % 8);
        }
    }
    (bits, scale)
}

/// Decodes [`sign`] into `out`.
pub fn unsign(bits: &[u8], scale: f32, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = if bits[i / 8] >> (i % 8) & 1 == 1 { -scale } else { scale };
    }
}

#[cfg(test)]
mod tests;
