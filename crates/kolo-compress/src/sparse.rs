//! Sparsification: a few (index, value) pairs instead of the whole buffer.

use kolo_base::Rng;

/// `values[i]` belongs at `indices[i]` of a buffer of `len` values.
#[derive(Clone, Debug, PartialEq)]
pub struct Sparse {
    pub len: usize,
    pub indices: Vec<u32>,
    pub values: Vec<f32>,
}

impl Sparse {
    /// Adds the pairs into a dense buffer (summing what several ranks sent).
    pub fn add_into(&self, out: &mut [f32]) {
        for (i, v) in self.indices.iter().zip(&self.values) {
            out[*i as usize] += v;
        }
    }

    pub fn to_dense(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len];
        self.add_into(&mut out);
        out
    }

    /// Bytes on the wire (u32 index + f32 value per pair).
    pub fn wire_bytes(&self) -> usize {
        self.indices.len() * 8
    }
}

/// How many values a fraction keeps (at least one of a non-empty buffer).
pub fn keep_count(len: usize, fraction: f64) -> usize {
    if len == 0 {
        return 0;
    }
    ((len as f64 * fraction).ceil() as usize).clamp(1, len)
}

/// The `fraction` of values with the largest magnitudes (exact selection, ties by position).
pub fn topk(x: &[f32], fraction: f64) -> Sparse {
    let k = keep_count(x.len(), fraction);
    let mut idx: Vec<u32> = (0..x.len() as u32).collect();
    if k < x.len() {
        idx.select_nth_unstable_by(k, |a, b| x[*b as usize].abs().total_cmp(&x[*a as usize].abs()).then(a.cmp(b)));
        idx.truncate(k);
    }
    idx.sort_unstable();
    Sparse { len: x.len(), values: idx.iter().map(|i| x[*i as usize]).collect(), indices: idx }
}

/// Top-k by a sampled threshold (Deep Gradient Compression, Lin et al. 2018): the magnitude at
/// the `fraction` quantile of `sample` randomly chosen values is the threshold and every value at
/// or above it is kept — about k of them, without selecting over the whole buffer. When more than
/// twice k pass, the exact top k of those are kept. Buffers no longer than `sample` are exact.
pub fn topk_sampled(x: &[f32], fraction: f64, sample: usize, seed: u64) -> Sparse {
    let k = keep_count(x.len(), fraction);
    if x.len() <= sample.max(1) {
        return topk(x, fraction);
    }
    let mut rng = Rng::new(seed);
    let mut mags: Vec<f32> = (0..sample).map(|_| x[rng.below(x.len() as u64) as usize].abs()).collect();
    let at = keep_count(sample, fraction) - 1;
    mags.select_nth_unstable_by(at, |a, b| b.total_cmp(a));
    let threshold = mags[at];
    let mut idx: Vec<u32> = (0..x.len() as u32).filter(|&i| x[i as usize].abs() >= threshold).collect();
    if idx.len() > 2 * k {
        idx.select_nth_unstable_by(k, |a, b| x[*b as usize].abs().total_cmp(&x[*a as usize].abs()).then(a.cmp(b)));
        idx.truncate(k);
        idx.sort_unstable();
    }
    Sparse { len: x.len(), values: idx.iter().map(|i| x[*i as usize]).collect(), indices: idx }
}

/// `fraction` of the positions chosen at random from `seed` (the same on every rank that uses
/// the same seed), values scaled by len/k so that the result is unbiased.
pub fn randk(x: &[f32], fraction: f64, seed: u64) -> Sparse {
    let idx = randk_indices(x.len(), fraction, seed);
    let scale = if idx.is_empty() { 0.0 } else { x.len() as f32 / idx.len() as f32 };
    Sparse { len: x.len(), values: idx.iter().map(|i| x[*i as usize] * scale).collect(), indices: idx }
}

/// The positions [`randk`] picks for this seed, ascending.
pub fn randk_indices(len: usize, fraction: f64, seed: u64) -> Vec<u32> {
    let k = keep_count(len, fraction);
    let mut all: Vec<u32> = (0..len as u32).collect();
    let mut rng = Rng::new(seed);
    // Partial Fisher-Yates: the first k places end up a uniform random k-subset.
    for i in 0..k {
        let j = i + rng.below((len - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(k);
    all.sort_unstable();
    all
}
