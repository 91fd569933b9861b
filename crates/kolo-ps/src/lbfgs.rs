//! Sandblaster L-BFGS (Dean et al., 2012): a coordinator runs L-BFGS whose vectors (parameters,
//! gradients, the history pairs, the search direction) live on the parameter servers; every
//! vector operation of the two-loop recursion and the line search is a server-side `dot` or
//! `axpby` over the servers' ranges, so no full vector passes through the coordinator except the
//! summed gradient.
//!
//! The gradient work is cut into many small portions handed to workers one at a time: a faster
//! worker simply takes more. When no portion is left to hand out, idle workers get copies of the
//! portions still running (backup tasks); the first result of each portion wins and the others
//! are discarded, so one slow worker does not hold up the step.
//!
//! Here the workers are threads of the coordinator's process (each with its own connection to
//! the servers); portion results are summed by the coordinator in portion order, so the result
//! does not depend on which worker computed what.

use crate::{PsClient, PsError};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A differentiable objective over portions of the data: the sum over portions is the total.
pub trait Objective: Send + Sync {
    fn dim(&self) -> usize;
    fn portions(&self) -> usize;
    /// Loss and gradient of portion `p` at `x`, added into `grad`.
    fn eval(&self, p: usize, x: &[f32], grad: &mut [f32]) -> f64;
}

/// Server-side vector ids.
const X: u32 = 0;
const G: u32 = 1;
const D: u32 = 2;
const Q: u32 = 3;
const XT: u32 = 4;
const GT: u32 = 5;
const S0: u32 = 100;
const Y0: u32 = 200;

#[derive(Clone, Debug)]
pub struct LbfgsConfig {
    pub history: usize,
    pub iterations: usize,
    /// Stop when the gradient norm falls below this.
    pub tolerance: f64,
    /// Hand idle workers copies of portions still running.
    pub backup_tasks: bool,
    /// Test hook: per worker, a delay added to every portion it computes.
    pub worker_delay: Vec<Duration>,
}

#[derive(Clone, Debug, Default)]
pub struct LbfgsReport {
    pub x: Vec<f32>,
    pub loss: Vec<f64>,
    /// Objective evaluations (each = every portion once).
    pub evaluations: usize,
    /// Portion results computed by each worker and accepted.
    pub accepted_by_worker: Vec<usize>,
    /// Duplicate results thrown away (backup tasks that lost the race).
    pub discarded: usize,
    /// Evaluations that completed while some worker was still computing a copy.
    pub finished_with_stragglers: usize,
}

#[derive(Default)]
struct Round {
    id: u64,
    vector: u32,
    pending: VecDeque<usize>,
    running: Vec<usize>,
    done: Vec<Option<(f64, Vec<f32>)>>,
    busy: usize,
    stop: bool,
}

struct Pool {
    state: Mutex<(Round, LbfgsReport)>,
    cv: Condvar,
}

/// Runs Sandblaster L-BFGS from the servers' current vector 0 with one worker thread per
/// client in `workers`, the coordinator's own client being `coord`.
pub fn minimize(obj: Arc<dyn Objective>, mut coord: PsClient, workers: Vec<PsClient>, cfg: &LbfgsConfig) -> Result<LbfgsReport, PsError> {
    let n = obj.dim();
    let pool = Arc::new(Pool {
        state: Mutex::new((Round::default(), LbfgsReport { accepted_by_worker: vec![0; workers.len()], ..Default::default() })),
        cv: Condvar::new(),
    });
    let handles: Vec<_> = workers
        .into_iter()
        .enumerate()
        .map(|(w, client)| {
            let (pool, obj) = (pool.clone(), obj.clone());
            let delay = cfg.worker_delay.get(w).copied().unwrap_or_default();
            let backup = cfg.backup_tasks;
            std::thread::spawn(move || worker(w, client, &*obj, &pool, delay, backup))
        })
        .collect();
    let result = drive(&*obj, &mut coord, &pool, cfg, n);
    {
        let mut st = pool.state.lock().unwrap_or_else(|p| p.into_inner());
        st.0.stop = true;
        pool.cv.notify_all();
    }
    for h in handles {
        h.join().map_err(|_| PsError::Server("a Sandblaster worker panicked".into()))??;
    }
    let (x, loss, evaluations) = result?;
    let mut report = pool.state.lock().unwrap_or_else(|p| p.into_inner()).1.clone();
    report.x = x;
    report.loss = loss;
    report.evaluations = evaluations;
    Ok(report)
}

fn worker(w: usize, mut client: PsClient, obj: &dyn Objective, pool: &Pool, delay: Duration, backup: bool) -> Result<(), PsError> {
    let n = obj.dim();
    let mut x = vec![0f32; n];
    let mut have: Option<(u64, u32)> = None;
    loop {
        let (round, vector, p) = {
            let mut st = pool.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                let r = &mut st.0;
                if r.stop {
                    return Ok(());
                }
                if let Some(p) = r.pending.pop_front() {
                    r.running[p] += 1;
                    r.busy += 1;
                    break (r.id, r.vector, p);
                }
                // Nothing new: copy the unfinished portion with the fewest copies running.
                let dup = if backup {
                    (0..r.done.len()).filter(|p| r.done[*p].is_none() && r.running[*p] > 0).min_by_key(|p| r.running[*p])
                } else {
                    None
                };
                if let Some(p) = dup.filter(|p| r.running[*p] < 2) {
                    r.running[p] += 1;
                    r.busy += 1;
                    break (r.id, r.vector, p);
                }
                st = pool.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        if have != Some((round, vector)) {
            client.vector(vector, None, &mut x)?;
            have = Some((round, vector));
        }
        std::thread::sleep(delay);
        let mut g = vec![0f32; n];
        let loss = obj.eval(p, &x, &mut g);
        let mut st = pool.state.lock().unwrap_or_else(|p| p.into_inner());
        let (r, rep) = &mut *st;
        r.busy -= 1;
        // A copy that finishes after its round was collected is simply late.
        if r.id == round && p < r.done.len() {
            r.running[p] -= 1;
            if r.done[p].is_none() {
                r.done[p] = Some((loss, g));
                rep.accepted_by_worker[w] += 1;
            } else {
                rep.discarded += 1;
            }
        } else {
            rep.discarded += 1;
        }
        pool.cv.notify_all();
    }
}

/// Loss and gradient at server vector `vector`, computed by the workers.
fn evaluate(obj: &dyn Objective, pool: &Pool, vector: u32, id: u64) -> (f64, Vec<f32>) {
    let portions = obj.portions();
    let mut st = pool.state.lock().unwrap_or_else(|p| p.into_inner());
    // `busy` carries over: copies from the previous round may still be running (and will be discarded).
    let busy = st.0.busy;
    st.0 =
        Round { id, vector, pending: (0..portions).collect(), running: vec![0; portions], done: vec![None; portions], busy, stop: false };
    pool.cv.notify_all();
    while st.0.done.iter().any(Option::is_none) {
        st = pool.cv.wait(st).unwrap_or_else(|p| p.into_inner());
    }
    if st.0.busy > 0 {
        st.1.finished_with_stragglers += 1;
    }
    let done = std::mem::take(&mut st.0.done);
    st.0.pending.clear();
    drop(st);
    let mut g = vec![0f32; obj.dim()];
    let mut loss = 0f64;
    for (l, pg) in done.into_iter().flatten() {
        loss += l;
        g.iter_mut().zip(&pg).for_each(|(a, b)| *a += b);
    }
    (loss, g)
}

fn drive(obj: &dyn Objective, c: &mut PsClient, pool: &Pool, cfg: &LbfgsConfig, n: usize) -> Result<(Vec<f32>, Vec<f64>, usize), PsError> {
    let mut evals = 0u64;
    let mut eval_at = |c: &mut PsClient, v: u32, into: u32| -> Result<(f64, Vec<f32>), PsError> {
        evals += 1;
        let (l, g) = evaluate(obj, pool, v, evals);
        c.vector(into, Some(&g), &mut [])?;
        Ok((l, g))
    };
    let (mut f, _) = eval_at(c, X, G)?;
    let mut losses = vec![f];
    let mut pairs: VecDeque<(u32, u32, f64)> = VecDeque::new(); // (s id, y id, rho)
    let mut slot = 0u32;
    for _ in 0..cfg.iterations {
        if c.dot(G, G)?.sqrt() < cfg.tolerance {
            break;
        }
        // Two-loop recursion, every vector operation on the servers.
        c.axpby(Q, 0.0, G, 1.0)?;
        let mut alphas = Vec::with_capacity(pairs.len());
        for &(s, y, rho) in pairs.iter().rev() {
            let a = rho * c.dot(s, Q)?;
            c.axpby(Q, 1.0, y, -a)?;
            alphas.push(a);
        }
        if let Some(&(s, y, _)) = pairs.back() {
            let gamma = c.dot(s, y)? / c.dot(y, y)?;
            c.axpby(Q, gamma, Q, 0.0)?;
        }
        for (&(s, y, rho), a) in pairs.iter().zip(alphas.iter().rev()) {
            let b = rho * c.dot(y, Q)?;
            c.axpby(Q, 1.0, s, a - b)?;
        }
        c.axpby(D, 0.0, Q, -1.0)?;
        let mut gd = c.dot(G, D)?;
        if gd >= 0.0 {
            // Not a descent direction (bad curvature): restart from steepest descent.
            pairs.clear();
            c.axpby(D, 0.0, G, -1.0)?;
            gd = c.dot(G, D)?;
        }
        // Backtracking line search (Armijo), trial points on the servers.
        let mut t = if pairs.is_empty() { 1.0 / c.dot(G, G)?.sqrt().max(1.0) } else { 1.0 };
        let (f_new, t_ok) = loop {
            c.axpby(XT, 0.0, X, 1.0)?;
            c.axpby(XT, 1.0, D, t)?;
            let (ft, _) = eval_at(c, XT, GT)?;
            if ft <= f + 1e-4 * t * gd || t < 1e-10 {
                break (ft, t);
            }
            t *= 0.5;
        };
        let _ = t_ok;
        let (s, y) = if pairs.len() == cfg.history.max(1) {
            let (s, y, _) = pairs.pop_front().expect("full");
            (s, y)
        } else {
            slot += 1;
            (S0 + slot, Y0 + slot)
        };
        c.axpby(s, 0.0, XT, 1.0)?;
        c.axpby(s, 1.0, X, -1.0)?;
        c.axpby(y, 0.0, GT, 1.0)?;
        c.axpby(y, 1.0, G, -1.0)?;
        let sy = c.dot(s, y)?;
        c.axpby(X, 0.0, XT, 1.0)?;
        c.axpby(G, 0.0, GT, 1.0)?;
        if sy > 1e-12 {
            pairs.push_back((s, y, 1.0 / sy));
        }
        f = f_new;
        losses.push(f);
    }
    let mut x = vec![0f32; n];
    c.vector(X, None, &mut x)?;
    Ok((x, losses, evals as usize))
}

/// The same L-BFGS in one process on plain vectors (the reference for tests).
pub fn minimize_local(obj: &dyn Objective, x0: &[f32], cfg: &LbfgsConfig) -> (Vec<f32>, Vec<f64>) {
    let n = obj.dim();
    let eval = |x: &[f32]| {
        let mut g = vec![0f32; n];
        let mut l = 0.0;
        for p in 0..obj.portions() {
            let mut pg = vec![0f32; n];
            l += obj.eval(p, x, &mut pg);
            g.iter_mut().zip(&pg).for_each(|(a, b)| *a += b);
        }
        (l, g)
    };
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum::<f64>();
    let axpby = |dst: &mut Vec<f32>, a: f64, src: &[f32], b: f64| {
        dst.iter_mut().zip(src).for_each(|(o, x)| *o = (a * f64::from(*o) + b * f64::from(*x)) as f32)
    };
    let mut x = x0.to_vec();
    let (mut f, mut g) = eval(&x);
    let mut losses = vec![f];
    let mut pairs: VecDeque<(Vec<f32>, Vec<f32>, f64)> = VecDeque::new();
    for _ in 0..cfg.iterations {
        if dot(&g, &g).sqrt() < cfg.tolerance {
            break;
        }
        let mut q = g.clone();
        let mut alphas = Vec::new();
        for (s, y, rho) in pairs.iter().rev() {
            let a = rho * dot(s, &q);
            axpby(&mut q, 1.0, y, -a);
            alphas.push(a);
        }
        if let Some((s, y, _)) = pairs.back() {
            let gamma = dot(s, y) / dot(y, y);
            let qc = q.clone();
            axpby(&mut q, gamma, &qc, 0.0);
        }
        for ((s, y, rho), a) in pairs.iter().zip(alphas.iter().rev()) {
            let b = rho * dot(y, &q);
            axpby(&mut q, 1.0, s, a - b);
        }
        let mut d = vec![0f32; n];
        axpby(&mut d, 0.0, &q, -1.0);
        let mut gd = dot(&g, &d);
        if gd >= 0.0 {
            pairs.clear();
            axpby(&mut d, 0.0, &g, -1.0);
            gd = dot(&g, &d);
        }
        let mut t = if pairs.is_empty() { 1.0 / dot(&g, &g).sqrt().max(1.0) } else { 1.0 };
        let (xt, ft, gt) = loop {
            let mut xt = x.clone();
            axpby(&mut xt, 1.0, &d, t);
            let (ft, gt) = eval(&xt);
            if ft <= f + 1e-4 * t * gd || t < 1e-10 {
                break (xt, ft, gt);
            }
            t *= 0.5;
        };
        let mut s = xt.clone();
        axpby(&mut s, 1.0, &x, -1.0);
        let mut y = gt.clone();
        axpby(&mut y, 1.0, &g, -1.0);
        let sy = dot(&s, &y);
        if pairs.len() == cfg.history.max(1) {
            pairs.pop_front();
        }
        if sy > 1e-12 {
            pairs.push_back((s, y, 1.0 / sy));
        }
        x = xt;
        g = gt;
        f = ft;
        losses.push(f);
    }
    (x, losses)
}

/// L2-regularised logistic regression over a sparse set, cut into `portions` pieces:
/// mean log loss + l2/2 |w|^2 (weights for `dim` coordinates and a bias).
pub struct Logistic {
    pub data: crate::hogwild::SparseSet,
    pub l2: f32,
    pub portions: usize,
}

impl Objective for Logistic {
    fn dim(&self) -> usize {
        self.data.dim + 1
    }
    fn portions(&self) -> usize {
        self.portions
    }
    fn eval(&self, p: usize, x: &[f32], grad: &mut [f32]) -> f64 {
        let n = self.data.examples.len();
        let per = n.div_ceil(self.portions.max(1));
        let bias = self.data.dim;
        let inv = 1.0 / n as f32;
        let mut loss = 0f64;
        for e in self.data.examples.iter().skip(p * per).take(per) {
            let z = x[bias] + e.idx.iter().zip(&e.val).map(|(i, v)| x[*i as usize] * v).sum::<f32>();
            // log(1 + exp(-y z)) with y in {-1, 1}, computed stably.
            let yz = f64::from(if e.label > 0.5 { z } else { -z });
            loss += if yz > 0.0 { (-yz).exp().ln_1p() } else { -yz + yz.exp().ln_1p() } / n as f64;
            let g = (1.0 / (1.0 + (-z).exp()) - e.label) * inv;
            for (i, v) in e.idx.iter().zip(&e.val) {
                grad[*i as usize] += g * v;
            }
            grad[bias] += g;
        }
        if p == 0 {
            for (g, w) in grad.iter_mut().zip(x).take(bias) {
                *g += self.l2 * w;
                loss += 0.5 * f64::from(self.l2) * f64::from(*w) * f64::from(*w);
            }
        }
        loss
    }
}
