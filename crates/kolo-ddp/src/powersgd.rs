//! PowerSGD gradient compression for DDP buckets (torch's `powerSGD_hook`): each matrix
//! parameter large enough to gain is sent as rank-r factors, the rest (biases, norms, small
//! matrices) is all-reduced as it is, in the same message. Q is warm-started from the previous
//! step and starts from a seed of the parameter's name, the same on every rank and however the
//! model is bucketed or cut into pipeline stages; the compression error is fed back per rank.

use kolo_base::Rng;
use kolo_comm::{BufMut, CommError, Communicator, ReduceOp};
use kolo_compress::powersgd::{matmul, matmul_t, orthonormalize, reconstruct, worth_it};

/// One parameter of a bucket: where it is in the bucket buffer, its matrix shape, and a seed of
/// its own (of its name: [`name_seed`]).
#[derive(Clone, Debug)]
pub struct Slot {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub seed: u64,
}

/// A parameter's seed: FNV-1a of its name. A parameter keeps its name in every bucket plan
/// and pipeline stage, so its compression starts alike there.
pub fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The state of one bucket: per compressed parameter its Q (cols x r) and error residual.
#[derive(Debug)]
pub struct BucketState {
    rank: usize,
    slots: Vec<Slot>,
    compressed: Vec<bool>,
    q: Vec<Vec<f32>>,
    error: Vec<Vec<f32>>,
}

impl BucketState {
    /// `slots` in bucket order. Each compressed parameter's first Q is drawn from its own seed:
    /// a parameter is compressed alike whichever bucket holds it.
    pub fn new(slots: Vec<Slot>, rank: usize) -> BucketState {
        let compressed: Vec<bool> = slots.iter().map(|s| worth_it(s.rows, s.cols, rank)).collect();
        let q = slots
            .iter()
            .zip(&compressed)
            .map(|(s, c)| {
                let mut rng = Rng::new(0x9057_5DD0 ^ s.seed);
                if *c {
                    (0..s.cols * rank).map(|_| rng.normal() as f32).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let error = slots.iter().zip(&compressed).map(|(s, c)| if *c { vec![0f32; s.rows * s.cols] } else { Vec::new() }).collect();
        BucketState { rank, slots, compressed, q, error }
    }

    /// Values this bucket puts on the wire per step (P and Q factors plus uncompressed values).
    pub fn payload(&self) -> usize {
        let r = self.rank;
        self.slots.iter().zip(&self.compressed).map(|(s, c)| if *c { (s.rows + s.cols) * r } else { s.rows * s.cols }).sum()
    }

    /// The warm-start factors Q and the error residuals of the compressed parameters, in slot
    /// order.
    pub fn state(&self) -> Vec<f32> {
        self.q.iter().chain(&self.error).flatten().copied().collect()
    }

    /// Restores [`BucketState::state`].
    pub fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        let want: usize = self.q.iter().chain(&self.error).map(Vec::len).sum();
        if state.len() != want {
            return Err(format!("PowerSGD state of {} values, this bucket's factors and residuals have {want}", state.len()));
        }
        let mut at = 0;
        for v in self.q.iter_mut().chain(self.error.iter_mut()) {
            let n = v.len();
            v.copy_from_slice(&state[at..at + n]);
            at += n;
        }
        Ok(())
    }

    /// Averages `buf` across ranks through the low-rank approximation (in place). Returns the
    /// bytes this rank handed to the all-reduces.
    pub fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        let r = self.rank;
        // Round 1: P = M Q for compressed matrices, followed by everything uncompressed.
        let mut first = Vec::new();
        let mut ms: Vec<Vec<f32>> = Vec::with_capacity(self.slots.len());
        for (i, s) in self.slots.iter().enumerate() {
            let n = s.rows * s.cols;
            if self.compressed[i] {
                let mut m = buf[s.offset..s.offset + n].to_vec();
                m.iter_mut().zip(&self.error[i]).for_each(|(m, e)| *m += e);
                let mut p = vec![0f32; s.rows * r];
                matmul(&m, s.rows, s.cols, &self.q[i], r, &mut p);
                first.extend_from_slice(&p);
                ms.push(m);
            } else {
                ms.push(Vec::new());
            }
        }
        let p_len = first.len();
        for (i, s) in self.slots.iter().enumerate() {
            if !self.compressed[i] {
                first.extend_from_slice(&buf[s.offset..s.offset + s.rows * s.cols]);
            }
        }
        c.all_reduce(BufMut::from(&mut first), ReduceOp::Avg)?;
        let mut bytes = first.len() * 4;
        // Uncompressed values are final.
        let mut at = p_len;
        for (i, s) in self.slots.iter().enumerate() {
            if !self.compressed[i] {
                let n = s.rows * s.cols;
                buf[s.offset..s.offset + n].copy_from_slice(&first[at..at + n]);
                at += n;
            }
        }
        if p_len == 0 {
            return Ok(bytes);
        }
        // A rank's gradient overflowed (f16's loss scale; the sum carries it to every rank, so
        // all decide alike): the step will be skipped. Its approximation stays non-finite and
        // the factors and residuals stay as they were: an infinite residual would poison every
        // later step.
        if first.iter().any(|v| !v.is_finite()) {
            for (i, s) in self.slots.iter().enumerate() {
                if self.compressed[i] {
                    buf[s.offset..s.offset + s.rows * s.cols].fill(f32::NAN);
                }
            }
            return Ok(bytes);
        }
        // Round 2: orthonormalise each P, Q = Mᵀ P, all-reduce the Qs.
        let mut second = Vec::new();
        let mut at = 0;
        let mut ps = Vec::new();
        for (i, s) in self.slots.iter().enumerate() {
            if !self.compressed[i] {
                continue;
            }
            let mut p = first[at..at + s.rows * r].to_vec();
            at += s.rows * r;
            orthonormalize(&mut p, s.rows, r);
            matmul_t(&ms[i], s.rows, s.cols, &p, r, &mut self.q[i]);
            second.extend_from_slice(&self.q[i]);
            ps.push((i, p));
        }
        c.all_reduce(BufMut::from(&mut second), ReduceOp::Avg)?;
        bytes += second.len() * 4;
        // M̂ = P Qᵀ; the error is what this rank's M had beyond it.
        let mut at = 0;
        for (i, p) in ps {
            let s = &self.slots[i];
            let n = s.rows * s.cols;
            self.q[i].copy_from_slice(&second[at..at + s.cols * r]);
            at += s.cols * r;
            let out = &mut buf[s.offset..s.offset + n];
            reconstruct(&p, s.rows, &self.q[i], s.cols, r, out);
            self.error[i].iter_mut().zip(ms[i].iter().zip(out.iter())).for_each(|(e, (m, a))| *e = m - a);
        }
        Ok(bytes)
    }
}
