//! The automatic parallelism planner (Alpa-style search over a cost model, without Alpa's ILP):
//! for a decoder-only transformer ([`Gpt`]: GPT-, Llama- or Mixtral-style) on a cluster ([`Cluster`]: devices per node, intra- and inter-node links, peak
//! FLOP/s per precision, memory, measured GEMM efficiency), every way to split the devices
//! into data (dp), tensor (tp) and pipeline (pp) parallel groups, with each ZeRO stage,
//! micro-batch size and recomputation (none, selective, full: [`Recompute`]), is costed by [`estimate`];
//! [`search`] returns the plans that fit in memory, fastest first.
//!
//! The cost model, per training step of `global_batch` sequences, on one device:
//! - **compute**, per layer and micro-batch of b sequences: the dense GEMMs (24 b s h^2 / t
//!   FLOPs forward GPT-style; projections with grouped-query attention's narrower k and v, and
//!   a gated MLP's three matrices of its width for each of the top-k experts otherwise), attention's score and value GEMMs (4 b s^2 h / t) and the logits
//!   (2 b s h V / t), each at the device's peak times its measured efficiency for the GEMM's
//!   size ([`Device::efficiency`]); the memory-bound operations move the layer's activations
//!   (Korthikanti et al.'s s b h (10 + 24/t + 5 a s / (h t)) values, without sequence
//!   parallelism) twice at the device's memory
//!   bandwidth ([`LayerTime`]). Backward costs twice forward; activation checkpointing runs
//!   forward again, selective recomputation attention's core; a runtime with fused attention
//!   ([`Cluster::fused_attention`]) never moves the scores through memory and computes them
//!   again in backward;
//!   a runtime of flat gradient buffers (Kolo's DDP) also adds each accumulated micro-batch's
//!   gradients but the last into the accumulation buffer (12 bytes a parameter at the
//!   memory-bound rate);
//! - **pipeline** ([`Schedule`]): (m + pp - 1) slots of the slowest stage (the last: its layers
//!   and the logits) for m micro-batches under 1F1B, the bubble being the pp - 1 extra slots;
//!   (pp - 1) / v of them interleaved over v chunks (v times the stage-to-stage traffic); none
//!   under PipeDream-2BW (a second version of the stage's weights kept instead);
//! - **communication**, alpha-beta per collective on the link its group runs on
//!   ([`Cluster::group_link`]; ranks ordered tp, then dp, then pp, as Megatron-LM does): tensor
//!   parallelism 2 all-reduces of b s h values per layer forward, 2 backward, 2 more when
//!   recomputing; pipeline one activation and one gradient of b s h / t values per slot and
//!   stage boundary, and a tied embedding's gradients summed between the first and the last
//!   stage; data parallelism one all-reduce of the stage's gradients (ZeRO-1/2:
//!   reduce-scatter + all-gather, the same volume, the all-gather after the optimizer step;
//!   ZeRO-3: 1.5x for every micro-batch, which gathers the parameters twice and reduce-scatters
//!   its gradients), overlapped with backward when [`Cluster::overlap_dp`] (ZeRO-3's with the
//!   whole compute; ZeRO-1/2's all-gather never);
//! - **memory** per device ([`state_bytes`]): parameters, gradients and optimizer states per
//!   precision and ZeRO stage, for the largest stage's parameters over tp (whole layers per
//!   stage, the embeddings on the first, the output layer on the last); activations of the
//!   layers of a stage for the micro-batches in flight on the first stage (min(pp, m)), or one
//!   micro-batch and the loss's logits on the last ([`logits_bytes`]), whichever is more; with
//!   checkpointing only each layer's input is kept, plus one layer's full activations; without
//!   the scores under selective recomputation or fused attention ([`scores_bytes`]); with
//!   Megatron's sequence parallelism the whole-kept part split over tp too. Two
//!   runtime constants scale this for an implementation ([`Cluster::activation_factor`],
//!   per-parameter copies).
//!
//! - **experts** ([`Plan::ep`]): a stage's expert matrices dealt out over ep of the dp
//!   replicas (their states sharded by ZeRO over the dp / ep replicas that hold the same
//!   experts, their gradients reduced over those), two all-to-alls of the micro-batch's tokens
//!   x top-k rows per MoE layer forward and two backward;
//! - **optimizer**: Adam's update of the device's parameters (its shard under ZeRO), memory-bound
//!   ([`optimizer_bytes`] at [`Device::update_bandwidth`]).
//!
//! Reported: step time, model TFLOP/s per device (the FLOPs the model needs, 72 B s L h^2
//! (1 + s / 6h + V / 12hL), Narayanan et al.), hardware TFLOP/s (with the recomputation, as
//! Megatron-LM reports), MFU (model FLOP/s over peak) and memory per device broken down.

mod cluster;
pub use cluster::{Cluster, Device, Link, Precision, PRESETS};

/// A decoder-only transformer's shape: GPT-style (learned positions, layer norms, biases, a
/// 4h GELU MLP) by [`Gpt::gpt_style`], and Llama-, Mistral- and Mixtral-style ones by its fields
/// (grouped-query attention, a gated MLP of any width, tied embeddings, a mixture of experts).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpt {
    pub layers: usize,
    pub d_model: usize,
    /// Query heads.
    pub heads: usize,
    pub seq: usize,
    pub vocab: usize,
    /// Key/value heads (grouped-query attention; `heads` for multi-head attention).
    pub kv_heads: usize,
    /// Width of a head (d_model / heads in GPT; wider in Gemma and Qwen3).
    pub head_dim: usize,
    /// Width of the MLP (of each expert's MLP): 4 d_model in GPT.
    pub ffn: usize,
    /// A Llama-style block: a gated MLP (SwiGLU: gate, up and down), RMS norms, no biases
    /// (GPT-style: two matrices with biases, layer norms).
    pub gated: bool,
    /// The output layer is the token embedding (no matrix of its own).
    pub tied: bool,
    /// Learned position embeddings (GPT's; rotary embeddings have no parameters).
    pub learned_positions: bool,
    /// Experts per MLP (1: a dense MLP) and the experts each token runs through.
    pub experts: usize,
    pub top_k: usize,
}

impl Gpt {
    /// A GPT-style shape (Kolo's built-in GPT, GPT-2/3, Megatron-LM's): multi-head attention,
    /// a 4h MLP, learned positions, an output layer of its own with a bias.
    pub fn gpt_style(layers: usize, d_model: usize, heads: usize, seq: usize, vocab: usize) -> Gpt {
        Gpt {
            layers,
            d_model,
            heads,
            seq,
            vocab,
            kv_heads: heads,
            head_dim: d_model / heads.max(1),
            ffn: 4 * d_model,
            gated: false,
            tied: false,
            learned_positions: true,
            experts: 1,
            top_k: 1,
        }
    }

    /// The widths of the queries and of the keys (each of keys and values), over d_model:
    /// (1, 1) GPT-style.
    fn widths(&self) -> (f64, f64) {
        let h = self.d_model.max(1) as f64;
        ((self.heads * self.head_dim) as f64 / h, (self.kv_heads * self.head_dim) as f64 / h)
    }

    /// Matrices of the MLP (3 gated, 2 not).
    fn mlp_matrices(&self) -> f64 {
        if self.gated {
            3.0
        } else {
            2.0
        }
    }

    /// Parameters: per block the attention's projections (q and o h x heads x head_dim each, k
    /// and v h x kv_heads x head_dim each), the MLP's matrices (h x ffn each, per expert) and a router (h x experts)
    /// when there are experts, biases (GPT-style: q, k, v, o, and the MLP's) and norms (2h
    /// layer norms, h RMS norms, each); embeddings V h (and s h learned positions); the
    /// output layer V h (and GPT's V bias) unless tied; the final norm. GPT-style: per block
    /// 12 h^2 + 13 h, embeddings (V + s) h, final norm and head V h + V + 2h.
    pub fn params(&self) -> f64 {
        self.layers as f64 * self.block_params() + self.embedding_params() + self.head_params()
    }

    /// One block's parameters: its matrices, router, biases and norms.
    pub fn block_params(&self) -> f64 {
        let (h, f) = (self.d_model as f64, self.ffn as f64);
        let (x, (q, k)) = (self.experts.max(1) as f64, self.widths());
        let router = if self.experts > 1 { h * x } else { 0.0 };
        let biases = if self.gated { 0.0 } else { h * (q + 2.0 * k + 1.0) + (f + h) * x };
        self.block_matrices() + router + biases + 2.0 * self.norm_params()
    }

    /// One norm's parameters (a layer norm's scale and bias, an RMS norm's scale).
    fn norm_params(&self) -> f64 {
        if self.gated {
            self.d_model as f64
        } else {
            2.0 * self.d_model as f64
        }
    }

    /// The token embedding (and learned positions): the first pipeline stage's.
    pub fn embedding_params(&self) -> f64 {
        let (h, s, v) = (self.d_model as f64, self.seq as f64, self.vocab as f64);
        v * h + if self.learned_positions { s * h } else { 0.0 }
    }

    /// The final norm and the output layer unless tied: the last pipeline stage's.
    pub fn head_params(&self) -> f64 {
        let (h, v) = (self.d_model as f64, self.vocab as f64);
        self.norm_params() + if self.tied { 0.0 } else { v * h + if self.gated { 0.0 } else { v } }
    }

    /// Parameters of the largest of `pp` pipeline stages of whole layers (ceil(L / pp) blocks
    /// on every stage, as Kolo and Megatron-LM cut them): the first adds the embeddings, the
    /// last the final norm and output layer, and a copy of the embedding when it is tied and
    /// the stages are several (Megatron-LM keeps one on each end and all-reduces their
    /// gradients).
    pub fn largest_stage_params(&self, pp: usize) -> f64 {
        if pp <= 1 {
            return self.params();
        }
        let blocks = (self.layers as f64 / pp as f64).ceil() * self.block_params();
        let tied_copy = if self.tied { self.vocab as f64 * self.d_model as f64 } else { 0.0 };
        (blocks + self.embedding_params()).max(blocks + self.head_params() + tied_copy)
    }

    /// One block's weight matrices: the attention's projections and every expert's MLP
    /// matrices (GPT-style 12 h^2).
    pub fn block_matrices(&self) -> f64 {
        let (h, f, (q, k)) = (self.d_model as f64, self.ffn as f64, self.widths());
        2.0 * h * h * (q + k) + self.mlp_matrices() * h * f * self.experts.max(1) as f64
    }

    /// One block's expert parameters (every expert's MLP matrices and biases; 0 for a dense
    /// MLP): what expert parallelism deals out.
    pub fn expert_block_params(&self) -> f64 {
        if self.experts <= 1 {
            return 0.0;
        }
        let (h, f) = (self.d_model as f64, self.ffn as f64);
        let per_expert = self.mlp_matrices() * h * f + if self.gated { 0.0 } else { f + h };
        per_expert * self.experts as f64
    }

    /// Parameters a token runs through: [`Gpt::params`] less the experts it does not use.
    pub fn active_params(&self) -> f64 {
        let idle = self.experts.saturating_sub(self.top_k) as f64;
        let per_expert =
            self.mlp_matrices() * self.d_model as f64 * self.ffn as f64 + if self.gated { 0.0 } else { (self.ffn + self.d_model) as f64 };
        self.params() - self.layers as f64 * idle * per_expert
    }

    /// Forward FLOPs per token of one block's matrix products outside attention's scores:
    /// the projections and the MLP's matrices for the top-k experts, and the router.
    /// GPT-style: 24 h^2.
    fn dense_flops_per_token(&self) -> f64 {
        let (h, f, (q, k)) = (self.d_model as f64, self.ffn as f64, self.widths());
        let router = if self.experts > 1 { 2.0 * h * self.experts as f64 } else { 0.0 };
        4.0 * h * h * (q + k) + 2.0 * self.mlp_matrices() * h * f * self.top_k.max(1) as f64 + router
    }

    /// Forward FLOPs per token of attention's scores and values over `s` positions: 4 s x
    /// heads x head_dim (4 s h GPT-style).
    fn attention_flops_per_token(&self) -> f64 {
        4.0 * self.seq as f64 * (self.heads * self.head_dim) as f64
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
        let shapes = FAMILY.iter().map(|&(layers, d_model, heads)| Gpt::gpt_style(layers, d_model, heads, 2048, 50257));
        shapes
            .min_by(|a, b| (a.params().ln() - params.ln()).abs().total_cmp(&(b.params().ln() - params.ln()).abs()))
            .expect("non-empty family")
    }

    /// FLOPs of forward and backward for `sequences` sequences: three times the forward's
    /// matrix products, per token each block's projections, MLP and router and attention's
    /// scores and values (4 s h), and the logits (2 h V). GPT-style this is Narayanan et al.'s
    /// eq. 3, 72 B s L h^2 (1 + s / 6h + V / 12hL).
    pub fn step_flops(&self, sequences: f64) -> f64 {
        let (l, h, s, v) = (self.layers as f64, self.d_model as f64, self.seq as f64, self.vocab as f64);
        3.0 * sequences * s * (l * (self.dense_flops_per_token() + self.attention_flops_per_token()) + 2.0 * h * v)
    }

    /// FLOPs activation checkpointing adds: the blocks' forward once more (the logits are not
    /// recomputed), so that GPT-style step + recompute is Narayanan et al.'s 96 B s L h^2 (1 +
    /// s / 6h + V / 16hL).
    pub fn recompute_flops(&self, sequences: f64) -> f64 {
        let (l, s) = (self.layers as f64, self.seq as f64);
        sequences * s * l * (self.dense_flops_per_token() + self.attention_flops_per_token())
    }

    /// FLOPs selective recomputation adds: attention's score and value products once more.
    pub fn selective_recompute_flops(&self, sequences: f64) -> f64 {
        sequences * self.seq as f64 * self.layers as f64 * self.attention_flops_per_token()
    }

    /// One block's activations per token and hidden value, in 2-byte values (Korthikanti et
    /// al.'s accounting): (kept whole on every tensor-parallel rank without sequence
    /// parallelism: the norms' inputs 4, the attention's and the MLP's inputs 2 each, the
    /// dropout masks 2; split over the group: q and the output projection's input 2 each, k and
    /// v 2 each (times their widths over d_model), and the MLP's inner activations, 4 ffn/h (gated
    /// 8 ffn/h) times the experts a token visits). GPT-style: (10, 24), the paper's s b h (10 +
    /// 24/t).
    fn activation_terms(&self) -> (f64, f64) {
        let (h, f, (q, k)) = (self.d_model as f64, self.ffn as f64, self.widths());
        let inner = if self.gated { 8.0 } else { 4.0 } * f / h * self.top_k.max(1) as f64;
        (10.0, 4.0 * q + 4.0 * k + inner)
    }
}

/// What backward computes again instead of keeping from forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Every activation kept.
    None,
    /// Korthikanti et al.'s selective recomputation: attention's core (scores, softmax, the
    /// product with the values) runs again in backward, so its s x s scores are never kept.
    /// The same as `None` for a runtime with fused attention, which never keeps them.
    Selective,
    /// Activation checkpointing: each layer keeps only its input and runs forward again.
    Full,
}

impl Recompute {
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// `none`, `selective` or `full`.
    pub fn parse(s: &str) -> Result<Recompute, String> {
        match s {
            "none" => Ok(Recompute::None),
            "selective" => Ok(Recompute::Selective),
            "full" => Ok(Recompute::Full),
            r => Err(format!("recomputation `{r}`: none, selective or full")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// How pipeline stages take turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Schedule {
    /// One forward, one backward (PipeDream-Flush, Megatron-LM's default): a bubble of pp - 1
    /// slots a step; the first stage keeps min(pp, m) micro-batches.
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B with `v` model chunks per device (layers divisible by pp
    /// x v, micro-batches by pp): the bubble shrinks v times, the activations sent between stages
    /// grow v times, and the first stage keeps 1 + (pp - 1) / (pp v) times 1F1B's activations.
    Interleaved(usize),
    /// PipeDream-2BW: no flush between steps, so no bubble once the pipeline is full; each
    /// stage keeps a second version of its weights (a gradient is computed on the weights one
    /// update behind those it is applied to).
    TwoBw,
}

impl Schedule {
    /// `1f1b`, `interleaved:V` or `2bw`.
    pub fn parse(s: &str) -> Result<Schedule, String> {
        match s {
            "1f1b" => Ok(Schedule::OneFOneB),
            "2bw" => Ok(Schedule::TwoBw),
            _ => match s.strip_prefix("interleaved:").map(str::parse::<usize>) {
                Some(Ok(v)) if v >= 2 => Ok(Schedule::Interleaved(v)),
                _ => Err(format!("pipeline schedule `{s}`: 1f1b, interleaved:V (V >= 2 chunks a device) or 2bw")),
            },
        }
    }

    pub fn name(self) -> String {
        match self {
            Schedule::OneFOneB => "1f1b".into(),
            Schedule::Interleaved(v) => format!("interleaved:{v}"),
            Schedule::TwoBw => "2bw".into(),
        }
    }
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
    pub recompute: Recompute,
    /// The pipeline's schedule (1F1B without stages).
    pub schedule: Schedule,
    /// Expert parallelism: the experts dealt out over `ep` of the `dp` data-parallel replicas
    /// (which still take their own batches, as in Kolo's mesh, DeepSpeed-MoE and Megatron);
    /// each MoE layer sends its tokens to their experts' ranks and back (an all-to-all each way,
    /// forward and backward). 1: every rank holds every expert.
    pub ep: usize,
    /// Context parallelism (Kolo's `sp`: ring attention): each sequence's tokens split over
    /// `cp` ranks, which pass the keys and values around a ring in every attention layer and
    /// share the parameters (their gradients reduced over dp x cp). Devices are dp x tp x pp x cp.
    pub cp: usize,
    /// Megatron's sequence parallelism over the tensor-parallel group: the norms' and dropouts'
    /// activations split by the sequence too (all-gather and reduce-scatter in place of each
    /// all-reduce, the same volume). Only with tp > 1.
    pub seq_parallel: bool,
}

impl Plan {
    /// dp x tp x pp with ZeRO-`zero`, micro-batches of `micro_batch` sequences, no
    /// recomputation, 1F1B, no sequence parallelism.
    pub fn new(dp: usize, tp: usize, pp: usize, zero: u8, micro_batch: usize) -> Plan {
        Plan { dp, tp, pp, zero, micro_batch, recompute: Recompute::None, schedule: Schedule::OneFOneB, ep: 1, cp: 1, seq_parallel: false }
    }
}

/// Bytes per device, by what holds them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    pub params: f64,
    pub grads: f64,
    /// Optimizer states, with the f32 master copy where there is one.
    pub optimizer: f64,
    pub activations: f64,
    /// The runtime's own copies (Kolo's gradient hooks).
    pub runtime: f64,
}

impl Memory {
    /// Parameters, gradients and optimizer states.
    pub fn states(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }

    pub fn total(&self) -> f64 {
        self.states() + self.activations + self.runtime
    }
}

/// What [`estimate`] predicts for a plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub step_s: f64,
    /// Forward, backward and recomputation of the m micro-batches on the slowest stage (and, for
    /// a runtime of flat gradient buffers, adding each micro-batch's gradients to the others').
    pub compute_s: f64,
    pub bubble_s: f64,
    pub tp_s: f64,
    pub pp_s: f64,
    /// Expert parallelism's all-to-alls.
    pub ep_s: f64,
    /// Context parallelism's keys and values passed around the ring.
    pub cp_s: f64,
    /// Data-parallel gradient communication not hidden behind backward.
    pub dp_exposed_s: f64,
    /// Adam's update of the parameters this device updates (its ZeRO shard under ZeRO-1/2/3):
    /// memory-bound, [`optimizer_bytes`] a parameter.
    pub optimizer_s: f64,
    pub memory: Memory,
    pub micro_batches: usize,
    /// The model's FLOPs per step (no recomputation), over all devices.
    pub model_flops: f64,
    /// FLOPs executed per step, recomputation included.
    pub hardware_flops: f64,
    /// Devices and their peak FLOP/s in the plan's precision.
    pub devices: usize,
    pub peak: f64,
}

impl Estimate {
    /// Bytes per device.
    pub fn memory(&self) -> f64 {
        self.memory.total()
    }

    /// Model FLOP/s per device.
    pub fn model_flops_per_device(&self) -> f64 {
        self.model_flops / self.step_s / self.devices as f64
    }

    /// Executed FLOP/s per device (what Megatron-LM reports).
    pub fn hardware_flops_per_device(&self) -> f64 {
        self.hardware_flops / self.step_s / self.devices as f64
    }

    /// Model FLOPs utilisation: model FLOP/s over the devices' peak.
    pub fn mfu(&self) -> f64 {
        self.model_flops_per_device() / self.peak
    }
}

/// Ring all-reduce of `bytes` over `p` ranks on `link`.
pub fn all_reduce_s(bytes: f64, p: usize, link: Link) -> f64 {
    if p <= 1 {
        return 0.0;
    }
    let p = p as f64;
    2.0 * (p - 1.0) * link.latency + 2.0 * (p - 1.0) / p * bytes / link.bandwidth
}

/// Model-state bytes per device for `params` parameters held by this device, as (parameters,
/// gradients, optimizer states).
/// - f32 (Kolo): 4 + 4 + 8 (Adam's moments); ZeRO-1 shards moments and an f32 master copy
///   (4 + 4 + 12/dp), ZeRO-2 also the gradients (4 + 16/dp), ZeRO-3 everything (16/dp).
/// - mixed precision (the ZeRO paper, K = 12): 2 + 2 + 12; ZeRO-1 2 + 2 + 12/dp, ZeRO-2
///   2 + 14/dp, ZeRO-3 16/dp.
pub fn state_bytes(params: f64, zero: u8, dp: usize, precision: Precision) -> (f64, f64, f64) {
    let d = dp.max(1) as f64;
    let v = precision.value_bytes();
    let (optim, sharded_optim) = match precision {
        Precision::F32 => (8.0, 12.0),
        Precision::Mixed | Precision::Fp8 => (12.0, 12.0),
    };
    let (p, g, o) = match zero {
        0 => (v, v, optim),
        1 => (v, v, sharded_optim / d),
        2 => (v, v / d, sharded_optim / d),
        _ => (v / d, v / d, optim / d),
    };
    (p * params, g * params, o * params)
}

/// Bytes Adam's update moves per parameter: it reads the f32 parameter, gradient and two
/// moments and writes the parameter and the moments (28 bytes); in mixed precision it also
/// writes the 2-byte copy forward uses (30).
pub fn optimizer_bytes(precision: Precision) -> f64 {
    match precision {
        Precision::F32 => 28.0,
        Precision::Mixed | Precision::Fp8 => 30.0,
    }
}

/// Activation bytes of one layer for one micro-batch of `b` sequences (values of `value_bytes`)
/// on one rank of a `tp`-way group without sequence parallelism (Korthikanti et al. 2022, eq. 2:
/// `s b h (10 + 24/t + 5 a s / (h t))` in 2-byte values for a GPT-style block; the 24 is
/// [`Gpt`]'s attention and MLP terms for other shapes): the layer norms' and dropouts'
/// activations stay whole on every rank, as in Kolo's tensor parallelism and the published runs
/// this is checked against (Megatron-LM 2021, BLOOM, MT-NLG).
pub fn layer_activation_bytes(m: &Gpt, b: usize, tp: usize, value_bytes: f64) -> f64 {
    let (s, h, a, t) = (m.seq as f64, m.d_model as f64, m.heads as f64, tp.max(1) as f64);
    let (whole, split) = m.activation_terms();
    s * b as f64 * h * (whole + split / t + 5.0 * a * s / (h * t)) * (value_bytes / 2.0)
}

/// The part of [`layer_activation_bytes`] that is attention's s x s scores (the softmax's input
/// and output and the dropout mask: `s b h 5 a s / (h t)`), which selective recomputation and
/// fused attention do not keep.
pub fn scores_bytes(m: &Gpt, b: usize, tp: usize, value_bytes: f64) -> f64 {
    let (s, a, t) = (m.seq as f64, m.heads as f64, tp.max(1) as f64);
    s * b as f64 * 5.0 * a * s / t * (value_bytes / 2.0)
}

/// Bytes the loss keeps on the last stage for one micro-batch: the logits (`s b V / t` values)
/// and the f32 softmax cross-entropy keeps for backward (Korthikanti et al.'s 4 s b V / t).
pub fn logits_bytes(m: &Gpt, b: usize, tp: usize, value_bytes: f64) -> f64 {
    (m.seq * b) as f64 * m.vocab as f64 / tp.max(1) as f64 * (value_bytes + 4.0)
}

/// As [`layer_activation_bytes`] with Megatron's sequence parallelism (eq. 4: `s b h (34 +
/// 5 a s / h) / t`): the layer norms' and dropouts' activations are split over the group too.
pub fn layer_activation_bytes_sp(m: &Gpt, b: usize, tp: usize, value_bytes: f64) -> f64 {
    let (s, h, a) = (m.seq as f64, m.d_model as f64, m.heads as f64);
    let (whole, split) = m.activation_terms();
    s * b as f64 * h * (whole + split + 5.0 * a * s / h) * (value_bytes / 2.0) / tp.max(1) as f64
}

/// Seconds of one layer for a micro-batch of `b` sequences on one device of a tp-way group:
/// GEMMs at their measured efficiency, memory-bound operations (moving the layer's activations
/// twice) at the memory bandwidth.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerTime {
    /// The projections' and MLP's GEMMs.
    pub dense: f64,
    /// Attention's score and value GEMMs.
    pub attention: f64,
    /// Memory-bound operations on everything but the scores.
    pub memory: f64,
    /// Memory-bound operations on the scores (softmax, mask, dropout): none when fused.
    pub scores: f64,
    /// The runtime's fixed cost per layer ([`Cluster::layer_overhead_s`]).
    pub overhead: f64,
}

impl LayerTime {
    /// With `seq_parallel`, the activations kept whole on every tensor-parallel rank are split
    /// too ([`layer_activation_bytes_sp`]); with context parallelism over `cp` ranks, this rank
    /// has s / cp of each sequence's tokens, whose queries meet all s keys.
    pub fn new(m: &Gpt, c: &Cluster, b: usize, tp: usize, cp: usize, seq_parallel: bool, precision: Precision) -> LayerTime {
        let (d, vb) = (&c.device, precision.value_bytes());
        let (s, h, t, cp) = (m.seq as f64, m.d_model as f64, tp as f64, cp.max(1) as f64);
        let tokens = b as f64 * s / cp;
        let dense = d.gemm_s(m.dense_flops_per_token() * tokens / t, (tokens, 3.0 * h / t, h), precision);
        let attention = d.gemm_s(tokens * m.attention_flops_per_token() / t, (s / cp, s, m.head_dim as f64), precision);
        let scores = if c.fused_attention { 0.0 } else { scores_bytes(m, b, tp, vb) / cp };
        let rest = (layer_bytes(m, b, tp, seq_parallel, vb) - scores_bytes(m, b, tp, vb)) / cp;
        let (memory, scores) = (2.0 * rest / d.mem_bandwidth, 2.0 * scores / d.mem_bandwidth);
        LayerTime { dense, attention, memory, scores, overhead: c.layer_overhead_s }
    }

    pub fn forward(&self) -> f64 {
        self.dense + self.attention + self.memory + self.scores + self.overhead
    }

    /// Forward, backward (twice forward; fused attention's backward computes the scores again,
    /// half its forward GEMMs more) and what `recompute` runs again.
    pub fn step(&self, recompute: Recompute, fused_attention: bool) -> f64 {
        let flash = if fused_attention { 0.5 * self.attention } else { 0.0 };
        let again = match recompute {
            Recompute::None => 0.0,
            Recompute::Selective if fused_attention => 0.0,
            Recompute::Selective => self.attention + self.scores,
            Recompute::Full => self.forward(),
        };
        3.0 * self.forward() + flash + again
    }
}

/// [`layer_activation_bytes`], or [`layer_activation_bytes_sp`] with sequence parallelism.
fn layer_bytes(m: &Gpt, b: usize, tp: usize, seq_parallel: bool, value_bytes: f64) -> f64 {
    if seq_parallel {
        layer_activation_bytes_sp(m, b, tp, value_bytes)
    } else {
        layer_activation_bytes(m, b, tp, value_bytes)
    }
}

/// Seconds of the logits' forward for `b` sequences (s / cp tokens of each) on one device of a
/// tp-way group.
pub fn logits_forward_s(m: &Gpt, d: &Device, b: usize, tp: usize, cp: usize, precision: Precision) -> f64 {
    let (s, h, v, t) = (m.seq as f64, m.d_model as f64, m.vocab as f64, tp as f64);
    let tokens = b as f64 * s / cp.max(1) as f64;
    d.gemm_s(2.0 * tokens * h * v / t, (tokens, v / t, h), precision)
}

/// The cost of `plan` for `global_batch` sequences per step.
pub fn estimate(m: &Gpt, c: &Cluster, plan: &Plan, global_batch: usize, precision: Precision) -> Option<Estimate> {
    let Plan { dp, tp, pp, zero, micro_batch, recompute, schedule, ep, cp, seq_parallel } = *plan;
    let devices = c.devices();
    let splits = m.heads.is_multiple_of(tp) && m.kv_heads.is_multiple_of(tp);
    if c.device.peak(precision) <= 0.0
        || cp == 0
        || !m.seq.is_multiple_of(cp)
        || dp * tp * pp * cp != devices
        || micro_batch == 0
        || pp > m.layers
        || !splits
        || !global_batch.is_multiple_of(dp)
    {
        return None;
    }
    let experts_split = ep == 1 || (m.experts > 1 && m.experts.is_multiple_of(ep) && dp.is_multiple_of(ep));
    if ep == 0 || !experts_split {
        return None;
    }
    let per_replica = global_batch / dp;
    if !per_replica.is_multiple_of(micro_batch) || (seq_parallel && tp == 1) || (schedule != Schedule::OneFOneB && pp == 1) {
        return None;
    }
    let mb = per_replica / micro_batch;
    // Interleaving needs whole chunks of layers on every device and whole rounds of pp
    // micro-batches.
    let chunks = match schedule {
        Schedule::Interleaved(v) if v < 2 || !m.layers.is_multiple_of(pp * v) || !mb.is_multiple_of(pp) => return None,
        Schedule::Interleaved(v) => v,
        _ => 1,
    };
    let vb = precision.value_bytes();
    let (s, h) = (m.seq as f64, m.d_model as f64);
    let layers_per_stage = (m.layers as f64 / pp as f64).ceil();
    let act_values = micro_batch as f64 * s / cp as f64 * h;
    // The ranks that hold the same parameters: the data-parallel replicas and, within each,
    // the context-parallel ones (ranks ordered tp, cp, dp, pp).
    let replicas = dp * cp;

    // One micro-batch on the last (slowest) stage: forward, backward (2x), recomputation.
    let checkpoint = recompute == Recompute::Full;
    let layer = LayerTime::new(m, c, micro_batch, tp, cp, seq_parallel, precision).step(recompute, c.fused_attention);
    let slot_compute = layers_per_stage * layer + 3.0 * logits_forward_s(m, &c.device, micro_batch, tp, cp, precision);
    let tp_link = c.group_link(tp, 1);
    let all_reduces = if checkpoint { 6.0 } else { 4.0 };
    let slot_tp = layers_per_stage * all_reduces * all_reduce_s(act_values * vb, tp, tp_link);
    let pp_link = c.group_link(pp, tp * replicas);
    let slot_pp = if pp > 1 { 2.0 * chunks as f64 * (pp_link.latency + act_values * vb / tp as f64 / pp_link.bandwidth) } else { 0.0 };
    // A stage's expert parameters, dealt out over ep; the rest replicated over dp.
    let stage_experts = layers_per_stage * m.expert_block_params() / tp as f64;
    let stage_params = m.largest_stage_params(pp) / tp as f64 - stage_experts * (1.0 - 1.0 / ep as f64);
    let (own_experts, dense_params) = (stage_experts / ep as f64, stage_params - stage_experts / ep as f64);
    // Gradient accumulation in a runtime that keeps gradients in flat f32 buffers (Kolo's DDP:
    // `param_copy_bytes` > 0) adds every micro-batch's but the last into the accumulation
    // buffer: the gradient read and the buffer read and written, 12 bytes a parameter at the
    // memory-bound rate. A pipeline's stages accumulate inside the executor (not costed: Kolo's
    // pipeline runs are within 7 % without it).
    let flat = c.param_copy_bytes > 0.0 && pp == 1;
    let accumulate = if flat { (mb - 1) as f64 * 12.0 * stage_params / c.device.mem_bandwidth } else { 0.0 };
    let compute_s = mb as f64 * slot_compute + accumulate;
    let bubble_slots = match schedule {
        Schedule::OneFOneB => (pp - 1) as f64,
        Schedule::Interleaved(v) => (pp - 1) as f64 / v as f64,
        Schedule::TwoBw => 0.0,
    };
    let bubble_s = bubble_slots * slot_compute;
    // Ranks sharing cores: a rank's bubble runs the others (see `Cluster::cores_per_node`).
    let oversubscribed = c.cores_per_node > 0 && c.devices_per_node > c.cores_per_node;
    let slots = mb as f64 + bubble_slots;
    let tp_s = slots * slot_tp;
    // A tied embedding lives on the first and the last stage; their two gradients are summed
    // after backward (Megatron-LM's embedding all-reduce), across the pipeline's span.
    let tied_s = if m.tied && pp > 1 {
        all_reduce_s(m.vocab as f64 * h / tp as f64 * vb, 2, c.group_link(2, (pp - 1) * tp * replicas))
    } else {
        0.0
    };
    let pp_s = slots * slot_pp + tied_s;
    // Ring attention: every layer passes this rank's keys and values (s / cp tokens of the
    // key/value heads) cp - 1 steps around the ring forward; backward passes them again with
    // their gradients (twice), recomputation once more. Not overlapped with the attention.
    let cp_s = if cp > 1 {
        let link = c.group_link(cp, tp);
        let kv = 2.0 * act_values * (m.kv_heads * m.head_dim) as f64 / h * vb / tp as f64;
        let forward = (cp - 1) as f64 * (link.latency + kv / link.bandwidth);
        mb as f64 * layers_per_stage * if checkpoint { 4.0 } else { 3.0 } * forward
    } else {
        0.0
    };
    // Each MoE layer's tokens go to their experts' ranks and come back: two all-to-alls forward,
    // two backward, two more recomputing; each carries the micro-batch's tokens x top-k rows.
    let ep_s = if ep > 1 {
        let link = c.group_link(ep, tp * cp);
        let bytes = act_values * m.top_k.max(1) as f64 * vb / tp as f64;
        let one = (ep - 1) as f64 * link.latency + bytes * (ep - 1) as f64 / ep as f64 / link.bandwidth;
        mb as f64 * layers_per_stage * if checkpoint { 6.0 } else { 4.0 } * one
    } else {
        0.0
    };

    // ZeRO-3 keeps no whole parameters nor gradients between micro-batches: each one gathers
    // the parameters for forward and again for backward and reduce-scatters its gradients
    // (1.5 all-reduces' volume a micro-batch, as DeepSpeed's stage 3 does with accumulation).
    let volume = if zero >= 3 { 1.5 * mb as f64 } else { 1.0 };
    // The experts' gradients are reduced over the dp / ep replicas that hold the same experts.
    let expert_reduce =
        if own_experts > 0.0 { all_reduce_s(own_experts * vb, replicas / ep, c.group_link(replicas / ep, tp * ep)) } else { 0.0 };
    let dp_s = volume * (all_reduce_s(dense_params * vb, replicas, c.group_link(replicas, tp)) + expert_reduce);
    // Buckets overlap backward (2/3 of the compute); at least the last bucket is exposed.
    // ZeRO-1/2's all-gather of the updated shards (half the volume) follows the optimizer step
    // and overlaps nothing; ZeRO-3's gathers are prefetched during forward and backward (all of
    // the compute).
    let after_step = if zero == 1 || zero == 2 { dp_s / 2.0 } else { 0.0 };
    let overlapped = dp_s - after_step;
    let window = if zero >= 3 { compute_s } else { compute_s * 2.0 / 3.0 };
    let exposed = if c.overlap_dp { (overlapped - window).max(overlapped * 0.1) } else { overlapped };
    let dp_exposed_s = exposed + after_step;

    let updated = if zero >= 1 { dense_params / replicas as f64 + own_experts / (replicas / ep) as f64 } else { stage_params };
    let optimizer_s = updated * optimizer_bytes(precision) / c.device.update_bandwidth;
    let (dense, experts) = (state_bytes(dense_params, zero, replicas, precision), state_bytes(own_experts, zero, replicas / ep, precision));
    // A runtime with flat gradient buffers (Kolo's) accumulating micro-batches (a pipeline's,
    // or gradient accumulation) keeps the whole stage's f32 gradient in an accumulator beside
    // the buckets (under ZeRO-3 too: FSDP's `no_sync`), between steps as well.
    let accumulator = if c.param_copy_bytes > 0.0 && mb > 1 { 4.0 * stage_params } else { 0.0 };
    let (params, grads, optimizer) = (dense.0 + experts.0, dense.1 + experts.1 + accumulator, dense.2 + experts.2);
    // ZeRO-3: a layer's gathered parameters and gradients, two layers at a time (prefetch).
    let gathered_layer = if zero >= 3 { 4.0 * vb * m.block_matrices() / tp as f64 } else { 0.0 };
    // The first stage keeps the most micro-batches (min(pp, m)); the last keeps one and the
    // loss's logits.
    let scores = scores_bytes(m, micro_batch, tp, vb) * c.activation_factor / cp as f64;
    let full = layer_bytes(m, micro_batch, tp, seq_parallel, vb) * c.activation_factor / cp as f64;
    let whole_layer = if c.fused_attention { full - scores } else { full };
    let kept_layer = match recompute {
        Recompute::None => whole_layer,
        Recompute::Selective => full - scores,
        Recompute::Full => act_values * vb,
    };
    // Backward of a checkpointed layer holds the layer run again and, as it goes, the gradients
    // of those activations: two layers' worth (without checkpointing the gradients of one
    // layer's activations sit beside every layer's kept activations, which `activation_factor`
    // was measured with).
    let rerun = if checkpoint { 2.0 * whole_layer } else { 0.0 };
    let stage_activations = |in_flight: f64| layers_per_stage * in_flight * kept_layer + rerun;
    let last = stage_activations(1.0) + logits_bytes(m, micro_batch, tp, vb) / cp as f64;
    let interleaving = if chunks > 1 { 1.0 + (pp - 1) as f64 / (pp * chunks) as f64 } else { 1.0 };
    let activations = if pp == 1 { last } else { stage_activations(pp.min(mb) as f64 * interleaving).max(last) };
    // PipeDream-2BW keeps the weights of the previous update beside the current ones.
    let second_version = if schedule == Schedule::TwoBw { stage_params * vb } else { 0.0 };
    let runtime = gathered_layer + second_version + if zero >= 3 { 0.0 } else { stage_params * c.param_copy_bytes };
    let model_flops = m.step_flops(global_batch as f64);
    let recompute = match recompute {
        Recompute::None => 0.0,
        Recompute::Selective if c.fused_attention => 0.0,
        Recompute::Selective => m.selective_recompute_flops(global_batch as f64),
        Recompute::Full => m.recompute_flops(global_batch as f64),
    };
    Some(Estimate {
        step_s: compute_s + if oversubscribed { 0.0 } else { bubble_s } + tp_s + pp_s + ep_s + cp_s + dp_exposed_s + optimizer_s,
        compute_s,
        bubble_s,
        tp_s,
        pp_s,
        ep_s,
        cp_s,
        dp_exposed_s,
        optimizer_s,
        memory: Memory { params, grads, optimizer, activations, runtime },
        micro_batches: mb,
        model_flops,
        hardware_flops: model_flops + recompute,
        devices,
        peak: c.device.peak(precision),
    })
}

/// Which plans to consider.
#[derive(Clone, Debug)]
pub struct Space {
    pub zero_stages: Vec<u8>,
    pub micro_batches: Vec<usize>,
    /// Selective recomputation is skipped on a runtime with fused attention (where it is `None`).
    pub recompute: Vec<Recompute>,
    /// Pipeline schedules (with pp > 1). The default leaves PipeDream-2BW out: it trains on
    /// weights one update stale, which a user asks for.
    pub schedules: Vec<Schedule>,
    /// Sequence parallelism off and on (with tp > 1).
    pub seq_parallel: Vec<bool>,
    /// Expert-parallel degrees (for a model with experts; each dividing dp and the experts).
    pub ep: Vec<usize>,
    /// Context-parallel degrees (each dividing the sequence).
    pub cp: Vec<usize>,
    /// Whether ZeRO may combine with tp or pp (Kolo's own runs: not yet).
    pub zero_with_model_parallel: bool,
}

impl Default for Space {
    fn default() -> Space {
        Space {
            zero_stages: vec![0, 1, 2, 3],
            micro_batches: vec![1, 2, 4, 8, 16, 32],
            recompute: Recompute::ALL.to_vec(),
            schedules: vec![Schedule::OneFOneB, Schedule::Interleaved(2), Schedule::Interleaved(4)],
            seq_parallel: vec![false, true],
            ep: vec![1, 2, 4, 8, 16, 32, 64],
            cp: vec![1, 2, 4, 8],
            zero_with_model_parallel: true,
        }
    }
}

/// Every plan of `space` that fits in the devices' memory, fastest first.
pub fn search(m: &Gpt, c: &Cluster, global_batch: usize, precision: Precision, space: &Space) -> Vec<(Plan, Estimate)> {
    let mut out = Vec::new();
    for plan in candidates(m, c.devices(), space) {
        if plan.recompute == Recompute::Selective && c.fused_attention {
            continue;
        }
        if let Some(e) = estimate(m, c, &plan, global_batch, precision) {
            if e.memory() <= c.device.memory {
                out.push((plan, e));
            }
        }
    }
    out.sort_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s));
    out
}

/// The plans of `space` for `n` devices: every cp x tp x pp x dp split, and for each the ZeRO
/// stages (with more than one replica), micro-batches, recomputations, schedules (with
/// stages), sequence parallelism (with tp) and expert-parallel degrees (for experts).
fn candidates(m: &Gpt, n: usize, space: &Space) -> Vec<Plan> {
    let divides = |a: usize| move |d: &usize| a.is_multiple_of(*d);
    let mut shapes = Vec::new();
    for cp in space.cp.iter().copied().filter(|c| *c > 0).filter(divides(n)) {
        for tp in (1..=n / cp).filter(divides(n / cp)) {
            for pp in (1..=n / (cp * tp)).filter(divides(n / (cp * tp))) {
                shapes.push((n / (cp * tp * pp), tp, pp, cp));
            }
        }
    }
    let mut plans = Vec::new();
    for (dp, tp, pp, cp) in shapes {
        let zeros = space.zero_stages.iter().filter(|&&z| z == 0 || (dp * cp > 1 && (space.zero_with_model_parallel || tp * pp == 1)));
        let schedules: &[Schedule] = if pp > 1 { &space.schedules } else { &[Schedule::OneFOneB] };
        let sps: &[bool] = if tp > 1 { &space.seq_parallel } else { &[false] };
        let eps: &[usize] = if m.experts > 1 { &space.ep } else { &[1] };
        for &zero in zeros {
            for &micro_batch in &space.micro_batches {
                for &recompute in &space.recompute {
                    for &schedule in schedules {
                        for &seq_parallel in sps {
                            for &ep in eps {
                                plans.push(Plan { dp, tp, pp, zero, micro_batch, recompute, schedule, ep, cp, seq_parallel });
                            }
                        }
                    }
                }
            }
        }
    }
    plans
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
