//! Pipeline plans as data: how to cut the layers into stages, and in which order each stage runs
//! the forward and backward passes of the micro-batches. Pure functions, unit- and
//! property-tested; the executor only follows them.

use std::ops::Range;

/// One unit of a stage's work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Forward(usize),
    Backward(usize),
    /// PipeDream-2BW: batch `t`'s gradients are complete on this stage; apply them (a new
    /// weight version).
    Update(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// GPipe: every micro-batch's forward, then every backward (gradients accumulate); a stage
    /// holds the activations of all M micro-batches.
    GPipe,
    /// 1F1B (PipeDream-Flush): K - s - 1 warm-up forwards, then alternate one forward and one
    /// backward, then drain; a stage holds at most K - s micro-batches' activations.
    OneFOneB,
    /// PipeDream-2BW: 1F1B over the micro-batches of `batches` consecutive batches without a
    /// flush between them; after the last backward of batch t a stage updates its weights
    /// (`Op::Update(t)`), and micro-batch numbers run on across batches (batch t holds
    /// t*m .. (t+1)*m). Batch t runs forward and backward on weight version max(t - 1, 0):
    /// two versions live at once (double buffering); needs m >= K - 1 so the version exists.
    TwoBw { batches: usize },
}

/// Cuts `costs` (one per layer, in order) into `k` contiguous non-empty stages minimising the
/// most expensive stage (ties: the earliest cut). Needs `1 <= k <= costs.len()`.
pub fn partition(costs: &[f64], k: usize) -> Vec<Range<usize>> {
    let n = costs.len();
    assert!(k >= 1 && k <= n, "partition {n} layers into {k} stages");
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |s, c| {
            *s += c;
            Some(*s)
        }))
        .collect();
    let sum = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[j][i]: the smallest possible maximum stage cost for the first i layers in j stages.
    let mut best = vec![vec![f64::INFINITY; n + 1]; k + 1];
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    best[0][0] = 0.0;
    for j in 1..=k {
        for i in j..=n {
            for p in (j - 1)..i {
                let v = best[j - 1][p].max(sum(p, i));
                if v < best[j][i] {
                    best[j][i] = v;
                    cut[j][i] = p;
                }
            }
        }
    }
    let mut out = Vec::with_capacity(k);
    let mut i = n;
    for j in (1..=k).rev() {
        let p = cut[j][i];
        out.push(p..i);
        i = p;
    }
    out.reverse();
    out
}

/// Stage `s`'s ops for `m` micro-batches in a `k`-stage pipeline.
pub fn ops(schedule: Schedule, k: usize, s: usize, m: usize) -> Vec<Op> {
    assert!(s < k);
    match schedule {
        Schedule::GPipe => (0..m).map(Op::Forward).chain((0..m).map(Op::Backward)).collect(),
        Schedule::OneFOneB => one_f_one_b(k, s, m),
        Schedule::TwoBw { batches } => {
            let mut v = Vec::with_capacity(batches * (2 * m + 1));
            for op in one_f_one_b(k, s, m * batches) {
                v.push(op);
                if let Op::Backward(i) = op {
                    if (i + 1) % m == 0 {
                        v.push(Op::Update(i / m));
                    }
                }
            }
            v
        }
    }
}

fn one_f_one_b(k: usize, s: usize, m: usize) -> Vec<Op> {
    let warmup = (k - s - 1).min(m);
    let mut v: Vec<Op> = (0..warmup).map(Op::Forward).collect();
    for i in 0..m - warmup {
        v.push(Op::Forward(warmup + i));
        v.push(Op::Backward(i));
    }
    v.extend((m - warmup..m).map(Op::Backward));
    v
}

/// PipeDream-2BW: the weight version micro-batch `mb` (numbered across batches of `m`) runs on.
pub fn weight_version(mb: usize, m: usize) -> usize {
    (mb / m).saturating_sub(1)
}

/// The most micro-batches whose activations a stage holds at once (forwarded, not yet backwarded).
pub fn max_in_flight(ops: &[Op]) -> usize {
    let mut live = 0usize;
    let mut most = 0;
    for op in ops {
        match op {
            Op::Forward(_) => {
                live += 1;
                most = most.max(live);
            }
            Op::Backward(_) => live = live.saturating_sub(1),
            Op::Update(_) => {}
        }
    }
    most
}

/// When each op ran in a simulated step, and the resulting bubble.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// Per stage: (op, start, end).
    pub timeline: Vec<Vec<(Op, f64, f64)>>,
    pub makespan: f64,
    /// Idle fraction of the stages over the step: 1 - busy / (k * makespan).
    pub bubble: f64,
}

/// Runs the schedule with forward time `f` and backward time `b` per micro-batch and stage (no
/// communication time): every op starts when its stage is free and its input is ready (the
/// previous stage's forward, the next stage's backward). `Err` if the schedule deadlocks.
pub fn simulate(schedule: Schedule, k: usize, m: usize, f: f64, b: f64) -> Result<Simulation, String> {
    let plans: Vec<Vec<Op>> =
        (0..k).map(|s| ops(schedule, k, s, m).into_iter().filter(|o| !matches!(o, Op::Update(_))).collect()).collect();
    // Micro-batches in the whole plan (2BW runs several batches in one plan).
    let m = plans[0].iter().filter(|o| matches!(o, Op::Forward(_))).count();
    let mut next = vec![0usize; k];
    let mut free = vec![0f64; k];
    let mut fwd_end = vec![vec![None::<f64>; m]; k];
    let mut bwd_end = vec![vec![None::<f64>; m]; k];
    let mut timeline = vec![Vec::new(); k];
    loop {
        let mut progressed = false;
        for s in 0..k {
            let Some(&op) = plans[s].get(next[s]) else { continue };
            let ready = match op {
                Op::Forward(i) => {
                    if s == 0 {
                        Some(0.0)
                    } else {
                        fwd_end[s - 1][i]
                    }
                }
                Op::Backward(i) => {
                    if s + 1 == k {
                        fwd_end[s][i]
                    } else {
                        bwd_end[s + 1][i]
                    }
                }
                Op::Update(_) => unreachable!("filtered out"),
            };
            let Some(ready) = ready else { continue };
            let start = free[s].max(ready);
            let end = start + if matches!(op, Op::Forward(_)) { f } else { b };
            match op {
                Op::Forward(i) => fwd_end[s][i] = Some(end),
                Op::Backward(i) => bwd_end[s][i] = Some(end),
                Op::Update(_) => {}
            }
            free[s] = end;
            timeline[s].push((op, start, end));
            next[s] += 1;
            progressed = true;
        }
        if (0..k).all(|s| next[s] == plans[s].len()) {
            break;
        }
        if !progressed {
            return Err(format!(
                "{schedule:?} with {k} stages and {m} micro-batches deadlocks: stages wait at ops {:?}",
                (0..k).map(|s| plans[s].get(next[s])).collect::<Vec<_>>()
            ));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy = k as f64 * m as f64 * (f + b);
    let bubble = if makespan > 0.0 { 1.0 - busy / (k as f64 * makespan) } else { 0.0 };
    Ok(Simulation { timeline, makespan, bubble })
}

/// GPipe's (and 1F1B's) theoretical bubble fraction, (k - 1) / (m + k - 1).
pub fn theoretical_bubble(k: usize, m: usize) -> f64 {
    (k as f64 - 1.0) / (m + k - 1) as f64
}
