/// Learning-rate decay after warm-up.
#[derive(Clone, Debug, PartialEq)]
pub enum Schedule {
    Constant,
    /// Cosine from the base rate down to `min_lr` at the last step.
    Cosine {
        min_lr: f32,
    },
    /// Multiply by `gamma` every `every` steps.
    Step {
        every: u64,
        gamma: f32,
    },
}

/// The learning rate for `step` (0-based) of `total`: linear warm-up over `warmup` steps from
/// `base / warmup` to `base`, then the schedule.
pub fn lr_at(base: f32, schedule: &Schedule, warmup: u64, total: u64, step: u64) -> f32 {
    if step < warmup {
        return base * (step + 1) as f32 / warmup as f32;
    }
    let s = step - warmup;
    match *schedule {
        Schedule::Constant => base,
        Schedule::Cosine { min_lr } => {
            let span = total.saturating_sub(warmup).max(1);
            let frac = (s as f64 / span as f64).min(1.0);
            min_lr + (base - min_lr) * (0.5 * (1.0 + (std::f64::consts::PI * frac).cos())) as f32
        }
        Schedule::Step { every, gamma } => base * gamma.powi((s / every.max(1)) as i32),
    }
}

/// The linear scaling rule (Goyal et al. 2017): a rate tuned for `reference_batch` scaled to
/// `global_batch`.
pub fn scaled_lr(base: f32, global_batch: usize, reference_batch: usize) -> f32 {
    base * global_batch as f32 / reference_batch.max(1) as f32
}
