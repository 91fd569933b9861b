//! Gradient compression on DDP buckets: the [`BucketCodec`] hook (one instance per bucket,
//! owning its state) and Kolo's codecs built on `kolo-compress`. A user codec is a
//! [`CodecFactory`] in [`crate::Compression::Custom`].

use crate::powersgd::Slot;
use kolo_base::Rng;
use kolo_comm::{BufMut, BufRef, CommError, Communicator, Element, ReduceOp};
use kolo_compress::{cast, qsgd, sign, sparse, unsign, ErrorFeedback};
use std::sync::Arc;

/// Averages one bucket's gradients across ranks through some encoding. Runs on the
/// communication thread; every rank's instance for a bucket is called once per synchronised
/// step, in the same order.
pub trait BucketCodec: Send {
    /// Replaces `buf` by (an approximation of) its average over the ranks of `c`; returns the
    /// bytes this rank handed to collectives.
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError>;

    /// ZeRO-2/3 (torch FSDP's `reduce_dtype`): reduce-scatters `buf`, averaged over the ranks
    /// of `c`, so that `buf[own]` (this rank's piece, `shard_range`) holds (an approximation
    /// of) its average; returns the bytes handed to collectives. `None` (the default): the
    /// codec needs the whole bucket on every rank and does not run beside ZeRO-2/3.
    fn reduce_scatter(&mut self, c: &dyn Communicator, buf: &mut [f32], own: std::ops::Range<usize>) -> Option<Result<usize, CommError>> {
        let _ = (c, buf, own);
        None
    }

    /// What this codec carries from one step to the next (error-feedback residuals,
    /// warm-started factors, step counters, random state) as values for a checkpoint, so that a
    /// resumed run continues as the uninterrupted one. Empty (the default) for a stateless
    /// codec; a user codec with state implements both methods.
    fn state(&self) -> Vec<f32> {
        Vec::new()
    }

    /// Restores what [`BucketCodec::state`] returned on this rank at the same world size and
    /// bucket plan; an error names what does not fit.
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        if state.is_empty() {
            Ok(())
        } else {
            Err(format!("{} values of state for a codec that keeps none", state.len()))
        }
    }
}

/// A counter as four exact 16-bit pieces (f32 holds integers up to 2^24 exactly).
fn push_u64(out: &mut Vec<f32>, x: u64) {
    out.extend((0..4).map(|i| ((x >> (16 * i)) & 0xFFFF) as f32));
}

/// The counter [`push_u64`] wrote at the front of `v`, and the rest.
fn take_u64(v: &[f32]) -> Result<(u64, &[f32]), String> {
    if v.len() < 4 || v[..4].iter().any(|x| !(0.0..65536.0).contains(x) || x.fract() != 0.0) {
        return Err("a malformed counter in the codec state".into());
    }
    Ok(((0..4).map(|i| (v[i] as u64) << (16 * i)).sum(), &v[4..]))
}

/// State of a codec with a step counter and error feedback: the counter, then the residual.
fn counter_and_residual(step: u64, ef: &ErrorFeedback) -> Vec<f32> {
    let mut v = Vec::with_capacity(4 + ef.residual().len());
    push_u64(&mut v, step);
    v.extend_from_slice(ef.residual());
    v
}

fn load_counter_and_residual(state: &[f32], step: &mut u64, ef: &mut ErrorFeedback) -> Result<(), String> {
    let (s, rest) = take_u64(state)?;
    ef.set_residual(rest)?;
    *step = s;
    Ok(())
}

/// A function making the codec of bucket `b` from its parameters' slots.
pub type MakeCodec = dyn Fn(usize, &[Slot]) -> Box<dyn BucketCodec> + Send + Sync;

/// Makes the codec of bucket `b` given its parameters' slots (offset and matrix shape).
#[derive(Clone)]
pub struct CodecFactory(pub Arc<MakeCodec>);

impl std::fmt::Debug for CodecFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CodecFactory(..)")
    }
}

impl PartialEq for CodecFactory {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl BucketCodec for crate::powersgd::BucketState {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        crate::powersgd::BucketState::all_reduce(self, c, buf)
    }
    fn state(&self) -> Vec<f32> {
        crate::powersgd::BucketState::state(self)
    }
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        crate::powersgd::BucketState::load_state(self, state)
    }
}

/// All-reduce in f16 or bf16 (2 bytes per value), averaged in that precision.
pub struct Half {
    pub bf16: bool,
}

impl BucketCodec for Half {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        if self.bf16 {
            let mut h = cast::to_bf16(buf);
            c.all_reduce(BufMut::from(&mut h), ReduceOp::Avg)?;
            cast::from_bf16(&h, buf);
        } else {
            let mut h = cast::to_f16(buf);
            c.all_reduce(BufMut::from(&mut h), ReduceOp::Avg)?;
            cast::from_f16(&h, buf);
        }
        Ok(buf.len() * 2)
    }

    /// The bucket reduce-scattered in f16 or bf16, summed and averaged in that precision as
    /// [`Half::all_reduce`] does it, this rank's piece widened back.
    fn reduce_scatter(&mut self, c: &dyn Communicator, buf: &mut [f32], own: std::ops::Range<usize>) -> Option<Result<usize, CommError>> {
        let done = if self.bf16 {
            let mut h = cast::to_bf16(buf);
            c.reduce_scatter_in_place(BufMut::from(&mut h), ReduceOp::Avg).map(|()| cast::from_bf16(&h[own.clone()], &mut buf[own]))
        } else {
            let mut h = cast::to_f16(buf);
            c.reduce_scatter_in_place(BufMut::from(&mut h), ReduceOp::Avg).map(|()| cast::from_f16(&h[own.clone()], &mut buf[own]))
        };
        Some(done.map(|()| buf.len() * 2))
    }
}

/// Every rank's `mine` (all the same length), rank after rank.
fn gather_all<T: Element>(c: &dyn Communicator, mine: &[T]) -> Result<Vec<T>, CommError> {
    let mut all = vec![T::default(); mine.len() * c.world_size().get()];
    c.all_gather(BufRef::from(mine), BufMut::from(&mut all))?;
    Ok(all)
}

/// Top-k with error feedback: every rank selects its k largest (index, value) pairs (exactly, or
/// above a threshold estimated from a sample) and the pairs are summed: all-gathered, or by the
/// sparse all-reduce (SparCML), which sends shared indices once.
pub struct TopK {
    pub fraction: f64,
    pub sampled: bool,
    pub sparse_all_reduce: bool,
    pub step: u64,
    pub ef: ErrorFeedback,
}

/// Values a sampled threshold looks at.
const THRESHOLD_SAMPLE: usize = 4096;

impl BucketCodec for TopK {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        let n = c.world_size().get();
        self.ef.add_into(buf);
        let s = if self.sampled {
            self.step += 1;
            sparse::topk_sampled(
                buf,
                self.fraction,
                THRESHOLD_SAMPLE,
                self.step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ c.rank().get() as u64,
            )
        } else {
            sparse::topk(buf, self.fraction)
        };
        self.ef.keep(buf, &s.to_dense());
        if self.sparse_all_reduce {
            let (sum, sent) = crate::sparse_ar::sparse_all_reduce(c, &s)?;
            buf.iter_mut().for_each(|v| *v = 0.0);
            for (i, v) in sum.indices.iter().zip(&sum.values) {
                buf[*i as usize] = v / n as f32;
            }
            return Ok(sent);
        }
        let mut idx: Vec<i32> = s.indices.iter().map(|i| *i as i32).collect();
        let mut values = s.values;
        let mut k = idx.len();
        let mut extra = 0;
        if self.sampled {
            // A sampled threshold selects a different count on each rank; the all-gather
            // needs one length: pad to the largest with zeros (index 0 gains nothing).
            let mut most = [k as i64];
            c.all_reduce(BufMut::from(&mut most[..]), ReduceOp::Max)?;
            k = most[0] as usize;
            idx.resize(k, 0);
            values.resize(k, 0.0);
            extra = 8;
        }
        let all_idx = gather_all(c, &idx)?;
        let all_val = gather_all(c, &values)?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        for (i, v) in all_idx.iter().zip(&all_val) {
            buf[*i as usize] += v / n as f32;
        }
        Ok(k * 8 + extra)
    }
    fn state(&self) -> Vec<f32> {
        counter_and_residual(self.step, &self.ef)
    }
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        load_counter_and_residual(state, &mut self.step, &mut self.ef)
    }
}

/// Random-k with error feedback: the same k positions on every rank (seeded by bucket and
/// step), so the k values are simply all-reduced.
pub struct RandK {
    pub fraction: f64,
    pub seed: u64,
    pub step: u64,
    pub ef: ErrorFeedback,
}

impl BucketCodec for RandK {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        self.ef.add_into(buf);
        let idx = sparse::randk_indices(buf.len(), self.fraction, self.seed ^ self.step.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.step += 1;
        let mut vals: Vec<f32> = idx.iter().map(|i| buf[*i as usize]).collect();
        let mut sent = vec![0f32; buf.len()];
        idx.iter().zip(&vals).for_each(|(i, v)| sent[*i as usize] = *v);
        self.ef.keep(buf, &sent);
        c.all_reduce(BufMut::from(&mut vals), ReduceOp::Avg)?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        idx.iter().zip(&vals).for_each(|(i, v)| buf[*i as usize] = *v);
        Ok(vals.len() * 4)
    }
    fn state(&self) -> Vec<f32> {
        counter_and_residual(self.step, &self.ef)
    }
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        load_counter_and_residual(state, &mut self.step, &mut self.ef)
    }
}

/// QSGD (unbiased, no error feedback): every rank sends one byte per value and its norm.
pub struct Qsgd {
    pub levels: u8,
    pub rng: Rng,
}

impl BucketCodec for Qsgd {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        let n = c.world_size().get();
        let q = qsgd::quantize(buf, self.levels, &mut self.rng);
        let codes = gather_all(c, &q.codes)?;
        let norms = gather_all(c, &[q.norm])?;
        let mut part = vec![0f32; buf.len()];
        buf.iter_mut().for_each(|v| *v = 0.0);
        for r in 0..n {
            let qr = qsgd::Quantized { norm: norms[r], levels: self.levels, codes: codes[r * part.len()..(r + 1) * part.len()].to_vec() };
            qsgd::dequantize(&qr, &mut part);
            buf.iter_mut().zip(&part).for_each(|(b, p)| *b += p / n as f32);
        }
        Ok(buf.len() + 4)
    }
    fn state(&self) -> Vec<f32> {
        let mut v = Vec::new();
        push_u64(&mut v, self.rng.state());
        v
    }
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        match take_u64(state)? {
            (s, []) => {
                self.rng = Rng::from_state(s);
                Ok(())
            }
            (_, rest) => Err(format!("{} values after QSGD's random state", rest.len())),
        }
    }
}

/// Scaled sign with error feedback: one bit per value and one scale per rank.
pub struct Sign {
    pub ef: ErrorFeedback,
}

impl BucketCodec for Sign {
    fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, CommError> {
        let n = c.world_size().get();
        self.ef.add_into(buf);
        let (bits, scale) = sign(buf);
        let mut sent = vec![0f32; buf.len()];
        unsign(&bits, scale, &mut sent);
        self.ef.keep(buf, &sent);
        let all_bits = gather_all(c, &bits)?;
        let scales = gather_all(c, &[scale])?;
        buf.iter_mut().for_each(|v| *v = 0.0);
        for r in 0..n {
            unsign(&all_bits[r * bits.len()..(r + 1) * bits.len()], scales[r], &mut sent);
            buf.iter_mut().zip(&sent).for_each(|(b, s)| *b += s / n as f32);
        }
        Ok(bits.len() + 4)
    }
    fn state(&self) -> Vec<f32> {
        self.ef.residual().to_vec()
    }
    fn load_state(&mut self, state: &[f32]) -> Result<(), String> {
        self.ef.set_residual(state)
    }
}
