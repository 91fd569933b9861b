//! The automatic parallelism planner (Alpa-style search over a cost model, without Alpa's ILP):
//! for a GPT on a set of identical devices, every way to split the devices into data (dp),
//! tensor (tp) and pipeline (pp) parallel groups, with each ZeRO stage, micro-batch size and
//! with or without activation checkpointing, is costed by [`estimate`]; [`search`] returns the
//! plans that fit in memory, fastest first.
//!
//! The cost model, per training step of `global_batch` sequences:
//! - **compute**: Narayanan et al.'s FLOPs for a GPT, 72 B s L h^2 (1 + s / 6h + V / 12hL)
//!   (forward and backward; x 4/3 with activation checkpointing, which runs the forward twice),
//!   divided over the devices at the device's achieved FLOP rate;
//! - **pipeline bubble**: the compute stretched by (pp - 1) / m for m micro-batches (1F1B);
//! - **communication**, alpha-beta per collective (ring algorithms): all-reduce
//!   2(p-1) alpha + 2 (p-1)/p n / beta; all-gather and reduce-scatter half of it; point to point
//!   alpha + n / beta. Tensor parallelism: 4 all-reduces of b s h values per layer and
//!   micro-batch (2 forward, 2 backward, Megatron); pipeline: one activation and one gradient
//!   of b s h values per micro-batch and stage boundary; data parallelism: one all-reduce of the
//!   stage's gradients (ZeRO-1/2: reduce-scatter + all-gather, the same volume; ZeRO-3: 1.5x),
//!   of which the part longer than the backward pass is exposed (buckets overlap backward);
//! - **memory** per device: model states (f32 parameters, f32 gradients, Adam's two moments:
//!   16 bytes per parameter; ZeRO-1 8 + 12/dp, ZeRO-2 4 + 16/dp, ZeRO-3 16/dp plus one gathered
//!   layer), divided over tp x pp; activations per layer and micro-batch
//!   s b h (34 + 5 a s / h) x (value bytes / 2) / tp (Korthikanti et al.), for the layers of a
//!   stage and the micro-batches in flight on the first stage (min(pp, m)); with checkpointing
//!   only each layer's input is kept, plus one layer's full activations. Two runtime constants
//!   scale this for an implementation ([`Cluster::activation_factor`], per-parameter copies).

/// A GPT's shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpt {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub seq: usize,
    pub vocab: usize,
}

impl Gpt {
    /// Parameters: per block 12 h^2 + 13 h, embeddings (V + s) h, final norm and head V h + V + 2h.
    pub fn params(&self) -> f64 {
        let (l, h, s, v) = (self.layers as f64, self.d_model as f64, self.seq as f64, self.vocab as f64);
        l * (12.0 * h * h + 13.0 * h) + (v + s) * h + 2.0 * h + v * h + v
    }

    /// The GPT-3 family shape (Brown et al., table 2.1) nearest to `params` parameters, with a
    /// 2048-token context and GPT-2's 50,257-token vocabulary.
    pub fn with_params(params: f64) -> Gpt {
        const FAMILY: [(usize, usize, usize); 8] = [
            (12, 768, 12),
            (24, 1024, 16),
            (24, 1536, 16),
            (24, 2048, 16),
            (32, 2560, 32),
            (32, 4096, 32),
            (40, 5140, 40),
            (96, 12288, 96),
        ];
        let shapes = FAMILY.iter().map(|&(layers, d_model, heads)| Gpt { layers, d_model, heads, seq: 2048, vocab: 50257 });
        shapes
            .min_by(|a, b| (a.params().ln() - params.ln()).abs().total_cmp(&(b.params().ln() - params.ln()).abs()))
            .expect("non-empty family")
    }

    /// FLOPs of forward and backward for `sequences` sequences (Narayanan et al., eq. 3).
    pub fn step_flops(&self, sequences: f64) -> f64 {
        let (l, h, s, v) = (self.layers as f64, self.d_model as f64, self.seq as f64, self.vocab as f64);
        72.0 * sequences * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l))
    }
}

/// The devices and their links.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cluster {
    pub devices: usize,
    /// Bytes of memory per device.
    pub memory: f64,
    /// Achieved FLOP/s per device on this model's matmuls.
    pub flops: f64,
    /// Bytes/s per device link (one direction).
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
    /// The runtime's activation memory relative to Megatron's formula (1.0 for a fused GPU
    /// implementation; Kolo on candle's CPU backend keeps about 1.8x, measured).
    pub activation_factor: f64,
    /// Bytes the runtime copies per resident parameter during a step (Kolo's gradient hooks:
    /// 4, one f32 copy of every parameter in forward).
    pub param_copy_bytes: f64,
}

impl Cluster {
    /// Kolo on this kind of CPU: activation factor and hook copies measured (docs/benchmarks.md).
    pub const KOLO_CPU_ACTIVATIONS: f64 = 1.8;
    pub const KOLO_PARAM_COPY: f64 = 4.0;
}

/// One way to run the job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    /// ZeRO stage over the data-parallel group (0 = plain DDP).
    pub zero: u8,
    /// Sequences per micro-batch (per data-parallel replica).
    pub micro_batch: usize,
    pub checkpoint: bool,
}

/// What [`estimate`] predicts for a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub step_s: f64,
    pub compute_s: f64,
    pub bubble_s: f64,
    pub tp_s: f64,
    pub pp_s: f64,
    /// Data-parallel gradient communication not hidden behind backward.
    pub dp_exposed_s: f64,
    /// Bytes per device: model states and activations.
    pub states: f64,
    pub activations: f64,
    pub micro_batches: usize,
}

impl Estimate {
    pub fn memory(&self) -> f64 {
        self.states + self.activations
    }
}

/// Ring all-reduce of `bytes` over `p` ranks.
pub fn all_reduce_s(bytes: f64, p: usize, c: &Cluster) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    2.0 * (p - 1.0) * c.latency + 2.0 * (p - 1.0) / p * bytes / c.bandwidth
}

/// Model-state bytes per device for `params` parameters held by this device (f32 training).
pub fn state_bytes(params: f64, zero: u8, dp: usize) -> f64 {
    let d = dp.max(1) as f64;
    match zero {
        0 => 16.0 * params,
        1 => 8.0 * params + 12.0 * params / d,
        2 => 4.0 * params + 16.0 * params / d,
        _ => 16.0 * params / d,
    }
}

/// Activation bytes of one layer for one micro-batch of `b` sequences (values of `value_bytes`).
pub fn layer_activation_bytes(m: &Gpt, b: usize, tp: usize, value_bytes: f64) -> f64 {
    let (s, h, a) = (m.seq as f64, m.d_model as f64, m.heads as f64);
    s * b as f64 * h * (34.0 + 5.0 * a * s / h) * (value_bytes / 2.0) / tp.max(1) as f64
}

/// The cost of `plan` for `global_batch` sequences per step (`value_bytes`: 4 for f32).
pub fn estimate(m: &Gpt, c: &Cluster, plan: &Plan, global_batch: usize, value_bytes: f64) -> Option<Estimate> {
    let Plan { dp, tp, pp, zero, micro_batch, checkpoint } = *plan;
    if dp * tp * pp != c.devices || micro_batch == 0 || pp > m.layers || !m.heads.is_multiple_of(tp) || !global_batch.is_multiple_of(dp) {
        return None;
    }
    let per_replica = global_batch / dp;
    if !per_replica.is_multiple_of(micro_batch) {
        return None;
    }
    let mb = per_replica / micro_batch;
    let (s, h) = (m.seq as f64, m.d_model as f64);
    let flops = m.step_flops(global_batch as f64) * if checkpoint { 4.0 / 3.0 } else { 1.0 };
    let compute_s = flops / (c.devices as f64 * c.flops);
    let bubble_s = compute_s * (pp as f64 - 1.0) / mb as f64;
    let act_values = micro_batch as f64 * s * h;
    let layers_per_stage = (m.layers as f64 / pp as f64).ceil();
    let tp_s = 4.0 * layers_per_stage * mb as f64 * all_reduce_s(act_values * value_bytes, tp, c);
    let pp_s = if pp > 1 { 2.0 * mb as f64 * (c.latency + act_values * value_bytes / tp as f64 / c.bandwidth) } else { 0.0 };
    let stage_params = m.params() / (tp * pp) as f64;
    let volume = if zero >= 3 { 1.5 } else { 1.0 };
    let dp_s = volume * all_reduce_s(stage_params * 4.0, dp, c);
    // Buckets overlap backward (about 2/3 of the compute); only the rest is exposed.
    let dp_exposed_s = (dp_s - compute_s * 2.0 / 3.0).max(dp_s * 0.1);
    let states = state_bytes(stage_params, zero, dp) + if zero >= 3 { 16.0 * 12.0 * h * h / tp as f64 } else { 0.0 };
    let in_flight = pp.min(mb) as f64;
    let per_layer = layer_activation_bytes(m, micro_batch, tp, value_bytes);
    let per_layer = per_layer * c.activation_factor;
    let copies = if zero >= 3 { 0.0 } else { stage_params * c.param_copy_bytes };
    let activations = copies
        + if checkpoint {
            layers_per_stage * in_flight * act_values * value_bytes / tp as f64 + per_layer
        } else {
            layers_per_stage * in_flight * per_layer
        };
    Some(Estimate {
        step_s: compute_s + bubble_s + tp_s + pp_s + dp_exposed_s,
        compute_s,
        bubble_s,
        tp_s,
        pp_s,
        dp_exposed_s,
        states,
        activations,
        micro_batches: mb,
    })
}

/// Which plans to consider.
#[derive(Clone, Debug)]
pub struct Space {
    pub zero_stages: Vec<u8>,
    pub micro_batches: Vec<usize>,
    pub checkpoint: Vec<bool>,
    /// Whether ZeRO may combine with tp or pp (Kolo's own runs: not yet).
    pub zero_with_model_parallel: bool,
}

impl Default for Space {
    fn default() -> Space {
        Space {
            zero_stages: vec![0, 1, 2, 3],
            micro_batches: vec![1, 2, 4, 8, 16, 32],
            checkpoint: vec![false, true],
            zero_with_model_parallel: true,
        }
    }
}

/// Every plan of `space` that fits in the devices' memory, fastest first.
pub fn search(m: &Gpt, c: &Cluster, global_batch: usize, value_bytes: f64, space: &Space) -> Vec<(Plan, Estimate)> {
    let mut out = Vec::new();
    let n = c.devices;
    for tp in (1..=n).filter(|t| n.is_multiple_of(*t)) {
        for pp in (1..=n / tp).filter(|p| (n / tp).is_multiple_of(*p)) {
            let dp = n / (tp * pp);
            for &zero in &space.zero_stages {
                if zero > 0 && (dp == 1 || (!space.zero_with_model_parallel && tp * pp > 1)) {
                    continue;
                }
                for &micro_batch in &space.micro_batches {
                    for &checkpoint in &space.checkpoint {
                        let plan = Plan { dp, tp, pp, zero, micro_batch, checkpoint };
                        if let Some(e) = estimate(m, c, &plan, global_batch, value_bytes) {
                            if e.memory() <= c.memory {
                                out.push((plan, e));
                            }
                        }
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
    out
}

/// Parses sizes like "80GiB", "24GB", "512MiB", "1.3B", "125M", "100Gbps" into a number (bytes,
/// counts or bits/s as written).
pub fn parse_quantity(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t.find(|ch: char| !(ch.is_ascii_digit() || ch == '.' || ch == 'e' || ch == '-')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| format!("`{s}` is not a number with a unit"))?;
    let mult = match unit.trim() {
        "" => 1.0,
        "K" | "k" | "KB" | "kB" => 1e3,
        "M" | "MB" => 1e6,
        "G" | "B" | "GB" => 1e9,
        "T" | "TB" => 1e12,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" => 1024f64.powi(4),
        "bps" => 1.0,
        "Kbps" => 1e3,
        "Mbps" => 1e6,
        "Gbps" => 1e9,
        "Tbps" => 1e12,
        "TFLOPS" | "TFLOP/s" => 1e12,
        "GFLOPS" | "GFLOP/s" => 1e9,
        u => return Err(format!("`{s}`: unknown unit `{u}`")),
    };
    Ok(v * mult)
}

#[cfg(test)]
mod tests;
