//! Hogwild! (Niu et al., 2011): several threads run SGD on one shared parameter vector with no
//! lock at all. On sparse problems two threads rarely touch the same coordinate, so the
//! occasional lost update costs little and the threads never wait for each other.
//!
//! The weights are `AtomicU32` holding f32 bits, read and written with relaxed loads and stores
//! (no compare-and-swap): exactly Hogwild's racy read-modify-write, without undefined behaviour.
//! [`Mode::Locked`] runs the same SGD with one mutex around each example's update, for
//! comparison.

use kolo_base::Rng;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// One example of a sparse binary problem: `val[k]` at coordinate `idx[k]`, label 0 or 1.
#[derive(Clone, Debug)]
pub struct SparseExample {
    pub idx: Vec<u32>,
    pub val: Vec<f32>,
    pub label: f32,
}

#[derive(Clone, Debug)]
pub struct SparseSet {
    pub dim: usize,
    pub examples: Vec<SparseExample>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Hogwild,
    Locked,
}

#[derive(Clone, Debug)]
pub struct HogwildConfig {
    pub threads: usize,
    pub epochs: usize,
    pub lr: f32,
    /// L2 penalty applied to the coordinates an example touches (sparse regularisation).
    pub l2: f32,
    pub seed: u64,
    pub mode: Mode,
}

#[derive(Clone, Debug)]
pub struct HogwildReport {
    pub weights: Vec<f32>,
    /// Log loss on the training set after each epoch.
    pub epoch_loss: Vec<f64>,
    pub updates: u64,
    pub seconds: f64,
}

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// Mean log loss and accuracy of logistic regression with weights `w` (the last is the bias).
pub fn evaluate(data: &SparseSet, w: &[f32]) -> (f64, f64) {
    let mut loss = 0f64;
    let mut right = 0usize;
    for e in &data.examples {
        let z = w[data.dim] + e.idx.iter().zip(&e.val).map(|(i, v)| w[*i as usize] * v).sum::<f32>();
        let p = f64::from(sigmoid(z)).clamp(1e-12, 1.0 - 1e-12);
        loss -= if e.label > 0.5 { p.ln() } else { (1.0 - p).ln() };
        right += usize::from((p > 0.5) == (e.label > 0.5));
    }
    let n = data.examples.len().max(1) as f64;
    (loss / n, right as f64 / n)
}

/// Trains logistic regression (weights for `dim` coordinates and a bias) with `cfg.threads`
/// threads started once, each sweeping its own shard of a per-epoch shuffle; the threads meet
/// at a barrier after every epoch (where the first one records the training loss, outside the
/// timed work).
pub fn train_logistic(data: &SparseSet, cfg: &HogwildConfig) -> HogwildReport {
    let dim = data.dim;
    let shared: Vec<AtomicU32> = (0..=dim).map(|_| AtomicU32::new(0f32.to_bits())).collect();
    let locked = Mutex::new(vec![0f32; dim + 1]);
    let updates = AtomicU64::new(0);
    let threads = cfg.threads.max(1);
    let mut rng = Rng::new(cfg.seed);
    let orders: Vec<Vec<usize>> = (0..cfg.epochs)
        .map(|_| {
            let mut o: Vec<usize> = (0..data.examples.len()).collect();
            rng.shuffle(&mut o);
            o
        })
        .collect();
    let barrier = std::sync::Barrier::new(threads);
    let epoch_loss = Mutex::new(Vec::new());
    let eval_secs = Mutex::new(0f64);
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (shared, locked, updates, orders, barrier, epoch_loss, eval_secs) =
                (&shared, &locked, &updates, &orders, &barrier, &epoch_loss, &eval_secs);
            s.spawn(move || {
                for order in orders {
                    let per = order.len().div_ceil(threads).max(1);
                    for &k in order.iter().skip(t * per).take(per) {
                        let e = &data.examples[k];
                        match cfg.mode {
                            Mode::Hogwild => {
                                let get = |i: usize| f32::from_bits(shared[i].load(Ordering::Relaxed));
                                let z = get(dim) + e.idx.iter().zip(&e.val).map(|(i, v)| get(*i as usize) * v).sum::<f32>();
                                let g = sigmoid(z) - e.label;
                                for (i, v) in e.idx.iter().zip(&e.val) {
                                    let i = *i as usize;
                                    let w = get(i);
                                    shared[i].store((w - cfg.lr * (g * v + cfg.l2 * w)).to_bits(), Ordering::Relaxed);
                                }
                                shared[dim].store((get(dim) - cfg.lr * g).to_bits(), Ordering::Relaxed);
                            }
                            Mode::Locked => {
                                let mut w = locked.lock().unwrap_or_else(|p| p.into_inner());
                                let z = w[dim] + e.idx.iter().zip(&e.val).map(|(i, v)| w[*i as usize] * v).sum::<f32>();
                                let g = sigmoid(z) - e.label;
                                for (i, v) in e.idx.iter().zip(&e.val) {
                                    let i = *i as usize;
                                    w[i] -= cfg.lr * (g * v + cfg.l2 * w[i]);
                                }
                                w[dim] -= cfg.lr * g;
                            }
                        }
                        updates.fetch_add(1, Ordering::Relaxed);
                    }
                    if barrier.wait().is_leader() {
                        let t = Instant::now();
                        let w = weights(cfg.mode, shared, locked);
                        epoch_loss.lock().unwrap_or_else(|p| p.into_inner()).push(evaluate(data, &w).0);
                        *eval_secs.lock().unwrap_or_else(|p| p.into_inner()) += t.elapsed().as_secs_f64();
                    }
                    barrier.wait();
                }
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64() - eval_secs.into_inner().unwrap_or_else(|p| p.into_inner());
    HogwildReport {
        weights: weights(cfg.mode, &shared, &locked),
        epoch_loss: epoch_loss.into_inner().unwrap_or_else(|p| p.into_inner()),
        updates: updates.load(Ordering::Relaxed),
        seconds,
    }
}

fn weights(mode: Mode, shared: &[AtomicU32], locked: &Mutex<Vec<f32>>) -> Vec<f32> {
    match mode {
        Mode::Hogwild => shared.iter().map(|a| f32::from_bits(a.load(Ordering::Relaxed))).collect(),
        Mode::Locked => locked.lock().unwrap_or_else(|p| p.into_inner()).clone(),
    }
}
