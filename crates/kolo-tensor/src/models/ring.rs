//! Ring self-attention (sequence parallelism): each member of the ring holds one contiguous
//! chunk of every sequence. Causal attention of its queries needs the keys and values of its own
//! and all earlier chunks: the key/value blocks travel around the ring, and each member folds
//! every visible block into its output with a numerically stable running softmax (running
//! maximum and sum, as flash attention does). Backward passes the blocks around again, each
//! carrying the gradient of its keys and values, which arrives back at its owner after a full turn.

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};
use kolo_base::RingShift;
use std::sync::{Arc, Mutex};

/// `attention(q, k, v)` over the ring for tensors of shape (b, h, t_chunk, d).
pub struct RingAttention {
    pub ring: Arc<dyn RingShift>,
    pub scale: f32,
    /// The forward's log-sum-exp per query row, kept for the backward.
    lse: Mutex<Vec<f32>>,
}

impl RingAttention {
    pub fn new(ring: Arc<dyn RingShift>, scale: f32) -> RingAttention {
        RingAttention { ring, scale, lse: Mutex::new(Vec::new()) }
    }
}

fn vec_of(s: &CpuStorage, l: &Layout) -> candle_core::Result<Vec<f32>> {
    let CpuStorage::F32(v) = s else {
        return Err(candle_core::Error::Msg("ring attention: f32 only".into()));
    };
    if !l.is_contiguous() {
        return Err(candle_core::Error::Msg("ring attention: inputs must be contiguous".into()));
    }
    let o = l.start_offset();
    Ok(v[o..o + l.shape().elem_count()].to_vec())
}

fn err(e: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("ring attention: {e}"))
}

/// Query row i of the chunk `me` sees key j of chunk `src`: earlier chunks entirely, its own
/// causally, later ones not at all.
fn visible(me: usize, src: usize, i: usize, j: usize) -> bool {
    src < me || (src == me && j <= i)
}

impl CustomOp3 for RingAttention {
    fn name(&self) -> &'static str {
        "kolo-ring-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = l1.shape().dims4()?;
        let (q, mut k, mut v) = (vec_of(s1, l1)?, vec_of(s2, l2)?, vec_of(s3, l3)?);
        let (me, n) = (self.ring.rank(), self.ring.size());
        let rows = b * h * t;
        let mut out = vec![0f32; rows * d];
        let mut m = vec![f32::NEG_INFINITY; rows];
        let mut l = vec![0f32; rows];
        let mut kv = vec![0f32; 2 * k.len()];
        for step in 0..n {
            let src = (me + n - step) % n;
            if src <= me {
                for bh in 0..b * h {
                    for i in 0..t {
                        let row = bh * t + i;
                        let qi = &q[row * d..(row + 1) * d];
                        // Scores of this block, then one online-softmax update.
                        let mut scores = Vec::with_capacity(t);
                        let mut block_max = f32::NEG_INFINITY;
                        for j in 0..t {
                            if visible(me, src, i, j) {
                                let kj = &k[(bh * t + j) * d..(bh * t + j + 1) * d];
                                let s = qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f32>() * self.scale;
                                block_max = block_max.max(s);
                                scores.push((j, s));
                            }
                        }
                        if scores.is_empty() {
                            continue;
                        }
                        let new_m = m[row].max(block_max);
                        let carry = if m[row] == f32::NEG_INFINITY { 0.0 } else { (m[row] - new_m).exp() };
                        l[row] *= carry;
                        let o = &mut out[row * d..(row + 1) * d];
                        o.iter_mut().for_each(|x| *x *= carry);
                        for (j, s) in scores {
                            let p = (s - new_m).exp();
                            l[row] += p;
                            let vj = &v[(bh * t + j) * d..(bh * t + j + 1) * d];
                            o.iter_mut().zip(vj).for_each(|(x, y)| *x += p * y);
                        }
                        m[row] = new_m;
                    }
                }
            }
            if step + 1 < n {
                let send: Vec<f32> = k.iter().chain(v.iter()).copied().collect();
                self.ring.shift(&send, &mut kv).map_err(err)?;
                let half = k.len();
                k.copy_from_slice(&kv[..half]);
                v.copy_from_slice(&kv[half..]);
            }
        }
        for row in 0..rows {
            let inv = 1.0 / l[row];
            out[row * d..(row + 1) * d].iter_mut().for_each(|x| *x *= inv);
        }
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = (0..rows).map(|r| m[r] + l[r].ln()).collect();
        Ok((CpuStorage::F32(out), Shape::from((b, h, t, d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (b, h, t, d) = q.dims4()?;
        let flat = |x: &Tensor| -> candle_core::Result<Vec<f32>> { x.contiguous()?.flatten_all()?.to_vec1::<f32>() };
        let (qv, o, dout) = (flat(q)?, flat(res)?, flat(grad)?);
        let (mut kb, mut vb) = (flat(k)?, flat(v)?);
        let lse = self.lse.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (me, n) = (self.ring.rank(), self.ring.size());
        let rows = b * h * t;
        if lse.len() != rows {
            return Err(candle_core::Error::Msg("ring attention: backward without its forward".into()));
        }
        // D_i = dO_i . O_i
        let dsum: Vec<f32> =
            (0..rows).map(|r| dout[r * d..(r + 1) * d].iter().zip(&o[r * d..(r + 1) * d]).map(|(a, c)| a * c).sum()).collect();
        let mut dq = vec![0f32; qv.len()];
        let (mut dk, mut dv) = (vec![0f32; kb.len()], vec![0f32; vb.len()]);
        let len = kb.len();
        let mut buf = vec![0f32; 4 * len];
        for step in 0..n {
            let src = (me + n - step) % n;
            if src <= me {
                for bh in 0..b * h {
                    for i in 0..t {
                        let row = bh * t + i;
                        let qi = &qv[row * d..(row + 1) * d];
                        let doi = &dout[row * d..(row + 1) * d];
                        for j in 0..t {
                            if !visible(me, src, i, j) {
                                continue;
                            }
                            let col = bh * t + j;
                            let kj = &kb[col * d..(col + 1) * d];
                            let vj = &vb[col * d..(col + 1) * d];
                            let s = qi.iter().zip(kj).map(|(a, c)| a * c).sum::<f32>() * self.scale;
                            let p = (s - lse[row]).exp();
                            let dp = doi.iter().zip(vj).map(|(a, c)| a * c).sum::<f32>();
                            let ds = p * (dp - dsum[row]) * self.scale;
                            for x in 0..d {
                                dv[col * d + x] += p * doi[x];
                                dq[row * d + x] += ds * kj[x];
                                dk[col * d + x] += ds * qi[x];
                            }
                        }
                    }
                }
            }
            // Every block, with its gradients so far, moves on; after n moves each is home.
            let send: Vec<f32> = kb.iter().chain(&vb).chain(&dk).chain(&dv).copied().collect();
            self.ring.shift(&send, &mut buf).map_err(err)?;
            kb.copy_from_slice(&buf[..len]);
            vb.copy_from_slice(&buf[len..2 * len]);
            dk.copy_from_slice(&buf[2 * len..3 * len]);
            dv.copy_from_slice(&buf[3 * len..]);
        }
        let shape = (b, h, t, d);
        let dev = q.device();
        Ok((Some(Tensor::from_vec(dq, shape, dev)?), Some(Tensor::from_vec(dk, shape, dev)?), Some(Tensor::from_vec(dv, shape, dev)?)))
    }
}
