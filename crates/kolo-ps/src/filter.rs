//! Message filters (Li et al. §3.6): a worker-side hook that may shrink what a push sends.
//!
//! [`SignificantlyModified`] sends only the entries whose accumulated change exceeds a
//! threshold; the rest stay in a residual and are added to the next push (so nothing is lost,
//! only delayed, like error feedback).

use std::collections::HashMap;

/// Decides what part of a range's gradient a push sends.
pub trait Filter: Send {
    /// May rewrite `values` (the range's gradient) to the entries to send and return their
    /// offsets within the range (sorted, distinct); `None` sends the whole range unchanged.
    fn select(&mut self, range: u32, values: &mut Vec<f32>) -> Option<Vec<u32>>;
    /// Values seen and values sent so far.
    fn counts(&self) -> (u64, u64);
}

pub struct SignificantlyModified {
    threshold: f32,
    residual: HashMap<u32, Vec<f32>>,
    seen: u64,
    sent: u64,
}

impl SignificantlyModified {
    pub fn new(threshold: f32) -> SignificantlyModified {
        SignificantlyModified { threshold, residual: HashMap::new(), seen: 0, sent: 0 }
    }

    /// Fraction of the values that were not sent.
    pub fn saved(&self) -> f64 {
        if self.seen == 0 {
            0.0
        } else {
            1.0 - self.sent as f64 / self.seen as f64
        }
    }
}

impl Filter for SignificantlyModified {
    fn select(&mut self, range: u32, values: &mut Vec<f32>) -> Option<Vec<u32>> {
        let r = self.residual.entry(range).or_insert_with(|| vec![0f32; values.len()]);
        if r.len() != values.len() {
            *r = vec![0f32; values.len()];
        }
        let mut keys = Vec::new();
        let mut out = Vec::new();
        for (i, (v, acc)) in values.iter().zip(r.iter_mut()).enumerate() {
            *acc += v;
            if acc.abs() > self.threshold {
                keys.push(i as u32);
                out.push(*acc);
                *acc = 0.0;
            }
        }
        self.seen += values.len() as u64;
        self.sent += out.len() as u64;
        *values = out;
        Some(keys)
    }

    fn counts(&self) -> (u64, u64) {
        (self.seen, self.sent)
    }
}
