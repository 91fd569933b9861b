//! Optimizers over flat `f32` buffers. Every rule is element-wise, so the same code updates a
//! whole model (DDP) or one rank's shard of it (ZeRO): pass the matching slices of parameters,
//! gradients and state.
//!
//! Semantics follow `torch.optim` (SGD with dampening 0, Adam with L2 weight decay, AdamW with
//! decoupled decay, Adagrad), so Kolo runs can be compared with PyTorch ones.

mod lr_schedule;
pub mod offload;
mod scaler;
pub use lr_schedule::{lr_at, scaled_lr, Schedule};
pub use offload::{Buffer, Placement};
pub use scaler::{has_non_finite, LossScaler};

#[derive(Clone, Debug, PartialEq)]
pub enum OptimizerSpec {
    Sgd {
        momentum: f32,
        nesterov: bool,
        weight_decay: f32,
    },
    /// `decoupled: true` is AdamW.
    Adam {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        decoupled: bool,
    },
    Adagrad {
        eps: f32,
        weight_decay: f32,
        lr_decay: f32,
    },
    /// A user's own rule ([`UpdateRule`]), with the weight decay it is given.
    Custom {
        rule: Custom,
        weight_decay: f32,
    },
}

/// A user's own optimizer: an element-wise update over flat `f32` buffers. Element-wise, so the
/// same rule updates the whole model (DDP), one rank's shard of it (ZeRO-1/2/3) or one
/// parameter group's part with its own weight decay and learning rate; its state buffers are
/// zero at the start, sharded like the parameters, and saved in checkpoints under its names.
///
/// ```
/// /// Lion (Chen et al., 2023): the sign of an interpolated momentum.
/// struct Lion { beta1: f32, beta2: f32 }
/// impl kolo_optim::UpdateRule for Lion {
///     fn describe(&self) -> String { format!("Lion(beta1={}, beta2={})", self.beta1, self.beta2) }
///     fn state_names(&self) -> &'static [&'static str] { &["exp_avg"] }
///     fn update(&self, _step: u64, lr: f32, wd: f32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
///         for ((p, g), m) in p.iter_mut().zip(g).zip(state[0].iter_mut()) {
///             let c = self.beta1 * *m + (1.0 - self.beta1) * g;
///             *p -= lr * (c.signum() * f32::from(c != 0.0) + wd * *p);
///             *m = self.beta2 * *m + (1.0 - self.beta2) * g;
///         }
///     }
/// }
/// ```
pub trait UpdateRule: Send + Sync {
    /// The rule and its hyperparameters, as checkpoints record it: a checkpoint written with
    /// another description is refused on resume.
    fn describe(&self) -> String;
    /// Names of the per-element state buffers it keeps (none: `&[]`).
    fn state_names(&self) -> &'static [&'static str];
    /// One step over some elements: `step` counts optimizer steps from 1; `lr` and
    /// `weight_decay` are the elements' group's; `state[k]` is buffer `k` for the same elements.
    fn update(&self, step: u64, lr: f32, weight_decay: f32, params: &mut [f32], grads: &[f32], state: &mut [&mut [f32]]);
}

/// A shared [`UpdateRule`] inside an [`OptimizerSpec`] (compared and printed by its
/// description).
#[derive(Clone)]
pub struct Custom(pub std::sync::Arc<dyn UpdateRule>);

impl std::fmt::Debug for Custom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

impl PartialEq for Custom {
    fn eq(&self, other: &Custom) -> bool {
        self.0.describe() == other.0.describe()
    }
}

/// The hyperparameters a parameter group sets for its elements (torch's `param_groups`):
/// its weight decay, and a factor on the learning rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub weight_decay: f32,
    pub lr_scale: f32,
}

impl OptimizerSpec {
    pub fn adamw(weight_decay: f32) -> OptimizerSpec {
        OptimizerSpec::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, decoupled: true }
    }

    /// The weight decay of this spec.
    pub fn weight_decay(&self) -> f32 {
        match *self {
            OptimizerSpec::Sgd { weight_decay, .. }
            | OptimizerSpec::Adam { weight_decay, .. }
            | OptimizerSpec::Adagrad { weight_decay, .. }
            | OptimizerSpec::Custom { weight_decay, .. } => weight_decay,
        }
    }

    /// This spec with another weight decay.
    pub fn with_weight_decay(&self, wd: f32) -> OptimizerSpec {
        let mut s = self.clone();
        match &mut s {
            OptimizerSpec::Sgd { weight_decay, .. }
            | OptimizerSpec::Adam { weight_decay, .. }
            | OptimizerSpec::Adagrad { weight_decay, .. }
            | OptimizerSpec::Custom { weight_decay, .. } => *weight_decay = wd,
        }
        s
    }

    /// Names of the per-element state buffers this optimizer keeps.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            OptimizerSpec::Sgd { momentum, .. } if *momentum != 0.0 => &["momentum"],
            OptimizerSpec::Sgd { .. } => &[],
            OptimizerSpec::Adam { .. } => &["exp_avg", "exp_avg_sq"],
            OptimizerSpec::Adagrad { .. } => &["sum"],
            OptimizerSpec::Custom { rule, .. } => rule.0.state_names(),
        }
    }
}

/// An optimizer over `n` scalars.
#[derive(Debug)]
pub struct Optimizer {
    spec: OptimizerSpec,
    /// Steps taken so far.
    steps: u64,
    state: Vec<Buffer>,
    /// Parameter groups: consecutive ranges of the optimizer's elements, in order, tiling them
    /// all, each with its hyperparameters (empty: the spec's for every element).
    spans: Vec<(std::ops::Range<usize>, Hyper)>,
}

impl Optimizer {
    pub fn new(spec: OptimizerSpec, n: usize) -> Optimizer {
        let state = spec.state_names().iter().map(|_| Buffer::Ram(vec![0f32; n])).collect();
        Optimizer { spec, steps: 0, state, spans: Vec::new() }
    }

    /// An optimizer whose state lives at `place` (offloaded to files with [`Placement::Disk`]:
    /// each [`Optimizer::update`] pages in the piece it needs and releases it afterwards).
    pub fn with_placement(spec: OptimizerSpec, n: usize, place: &Placement) -> std::io::Result<Optimizer> {
        let state = spec.state_names().iter().map(|name| Buffer::zeros(n, place, name)).collect::<std::io::Result<_>>()?;
        Ok(Optimizer { spec, steps: 0, state, spans: Vec::new() })
    }

    /// Gives ranges of the optimizer's `n` elements their own hyperparameters (parameter
    /// groups): `spans` must be consecutive, start at 0 and end at `n`. Adjacent spans with the
    /// same hyperparameters are merged.
    pub fn set_groups(&mut self, n: usize, spans: Vec<(std::ops::Range<usize>, Hyper)>) -> Result<(), String> {
        let mut at = 0;
        let mut merged: Vec<(std::ops::Range<usize>, Hyper)> = Vec::with_capacity(spans.len());
        for (r, h) in spans {
            if r.start != at || r.end < r.start {
                return Err(format!("parameter group span {r:?} does not continue at element {at}"));
            }
            at = r.end;
            match merged.last_mut() {
                Some((last, lh)) if *lh == h => last.end = r.end,
                _ if r.is_empty() => {}
                _ => merged.push((r, h)),
            }
        }
        if at != n {
            return Err(format!("parameter group spans cover {at} of {n} elements"));
        }
        self.spans = merged;
        Ok(())
    }

    /// Whether the state is offloaded to files.
    pub fn is_offloaded(&self) -> bool {
        self.state.iter().any(Buffer::is_offloaded)
    }

    /// Bytes of state kept in process memory (not counting offloaded state).
    pub fn resident_state_bytes(&self) -> usize {
        self.state.iter().filter(|b| !b.is_offloaded()).map(|b| b.len() * 4).sum()
    }

    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// `(name, buffer)` pairs, for checkpoints.
    pub fn state(&self) -> Vec<(&'static str, &[f32])> {
        self.spec.state_names().iter().copied().zip(self.state.iter().map(Buffer::as_slice)).collect()
    }

    /// Restores state saved by [`Optimizer::state`] and the step count.
    pub fn load_state(&mut self, steps: u64, buffers: &[(&str, Vec<f32>)]) -> Result<(), String> {
        let n = self.state.first().map_or(0, Buffer::len);
        for (i, name) in self.spec.state_names().iter().enumerate() {
            let (_, v) = buffers.iter().find(|(k, _)| k == name).ok_or_else(|| format!("optimizer state `{name}` is missing"))?;
            if v.len() != n {
                return Err(format!("optimizer state `{name}` has {} values, expected {n}", v.len()));
            }
            self.state[i].as_mut_slice().copy_from_slice(v);
            self.state[i].release_all();
        }
        self.steps = steps;
        Ok(())
    }

    /// One update of all `params` from `grads` with learning rate `lr`.
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], lr: f32) {
        self.begin_step();
        self.update(0, params, grads, lr);
    }

    /// Starts a step that is then applied piece by piece with [`Optimizer::update`] (each
    /// element exactly once per step), for parameters that are not one contiguous buffer.
    pub fn begin_step(&mut self) {
        self.steps += 1;
    }

    /// Updates the elements `offset..offset + params.len()` of the optimizer's range as part of
    /// the step begun by [`Optimizer::begin_step`].
    pub fn update(&mut self, offset: usize, params: &mut [f32], grads: &[f32], lr: f32) {
        assert_eq!(params.len(), grads.len(), "optimizer: params and grads differ in length");
        let n = params.len();
        let t = self.steps.max(1) as i32;
        let mut state: Vec<&mut [f32]> = self.state.iter_mut().map(|v| &mut v.as_mut_slice()[offset..offset + n]).collect();
        if self.spans.is_empty() {
            Self::apply(&self.spec, t, &mut state, params, grads, lr);
        } else {
            // Each parameter group's part of the range with its own decay and learning rate.
            let first = self.spans.partition_point(|(r, _)| r.end <= offset);
            for (r, h) in self.spans[first..].iter().take_while(|(r, _)| r.start < offset + n) {
                let a = r.start.max(offset) - offset;
                let b = r.end.min(offset + n) - offset;
                let mut part: Vec<&mut [f32]> = state.iter_mut().map(|s| &mut s[a..b]).collect();
                Self::apply(&self.spec.with_weight_decay(h.weight_decay), t, &mut part, &mut params[a..b], &grads[a..b], lr * h.lr_scale);
            }
        }
        drop(state);
        for b in &mut self.state {
            b.release(offset..offset + n);
        }
    }

    fn apply(spec: &OptimizerSpec, t: i32, state: &mut [&mut [f32]], params: &mut [f32], grads: &[f32], lr: f32) {
        match *spec {
            OptimizerSpec::Custom { ref rule, weight_decay } => rule.0.update(t as u64, lr, weight_decay, params, grads, state),
            OptimizerSpec::Sgd { momentum, nesterov, weight_decay } => {
                let first = t == 1;
                if momentum == 0.0 {
                    for (p, g) in params.iter_mut().zip(grads) {
                        *p -= lr * (g + weight_decay * *p);
                    }
                    return;
                }
                for ((p, g), b) in params.iter_mut().zip(grads).zip(state[0].iter_mut()) {
                    let d = g + weight_decay * *p;
                    *b = if first { d } else { momentum * *b + d };
                    let upd = if nesterov { d + momentum * *b } else { *b };
                    *p -= lr * upd;
                }
            }
            OptimizerSpec::Adam { beta1, beta2, eps, weight_decay, decoupled } => {
                let bc1 = 1.0 - beta1.powi(t);
                let bc2_sqrt = (1.0 - beta2.powi(t)).sqrt();
                let (m, v) = state.split_at_mut(1);
                let k = AdamStep { beta1, beta2, eps, bc2_sqrt, step_size: lr / bc1, decay: lr * weight_decay, weight_decay };
                if decoupled {
                    adamw_step(&k, params, grads, m[0], v[0]);
                } else {
                    adam_step(&k, params, grads, m[0], v[0]);
                }
            }
            OptimizerSpec::Adagrad { eps, weight_decay, lr_decay } => {
                let clr = lr / (1.0 + (t - 1) as f32 * lr_decay);
                for ((p, g), s) in params.iter_mut().zip(grads).zip(state[0].iter_mut()) {
                    let g = g + weight_decay * *p;
                    *s += g * g;
                    *p -= clr * g / (s.sqrt() + eps);
                }
            }
        }
    }
}

/// The constants of one Adam step.
struct AdamStep {
    beta1: f32,
    beta2: f32,
    eps: f32,
    bc2_sqrt: f32,
    step_size: f32,
    /// `lr * weight_decay` (AdamW's decoupled decay).
    decay: f32,
    weight_decay: f32,
}

// The Adam updates as indexed loops over equal-length slices, with the AdamW/Adam choice made
// outside the loop: they vectorise (sqrt and divide included). Written as a zip of four
// iterators with the choice inside, the update was scalar and 4.5 % of a GPT step.
kolo_base::simd_kernel! {
    fn adamw_step(k: &AdamStep, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            p[i] *= 1.0 - k.decay;
            m[i] = k.beta1 * m[i] + (1.0 - k.beta1) * g[i];
            v[i] = k.beta2 * v[i] + (1.0 - k.beta2) * g[i] * g[i];
            let denom = v[i].sqrt() / k.bc2_sqrt + k.eps;
            p[i] -= k.step_size * m[i] / denom;
        }
    }
}

kolo_base::simd_kernel! {
    fn adam_step(k: &AdamStep, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let n = p.len();
        let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
        for i in 0..n {
            let gi = g[i] + k.weight_decay * p[i];
            m[i] = k.beta1 * m[i] + (1.0 - k.beta1) * gi;
            v[i] = k.beta2 * v[i] + (1.0 - k.beta2) * gi * gi;
            let denom = v[i].sqrt() / k.bc2_sqrt + k.eps;
            p[i] -= k.step_size * m[i] / denom;
        }
    }
}

pub use kolo_base::sum_of_squares;

/// Scales `grads` so their global L2 norm is at most `max_norm`, given that norm. Returns the
/// factor applied (1.0 when no clipping was needed).
pub fn clip_by_global_norm(grads: &mut [f32], norm: f64, max_norm: f64) -> f32 {
    let f = clip_factor(norm, max_norm);
    if f != 1.0 {
        grads.iter_mut().for_each(|g| *g *= f);
    }
    f
}

/// The factor [`clip_by_global_norm`] scales by (torch's `max_norm / (norm + 1e-6)` when the
/// norm exceeds `max_norm`, else 1).
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    if norm > max_norm && norm != 0.0 {
        (max_norm / (norm + 1e-6)) as f32
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests;
