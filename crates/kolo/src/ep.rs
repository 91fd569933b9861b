//! Expert parallelism for your own candle model: a mixture-of-experts layer ([`MoeLayer`]) whose
//! experts are your own candle modules, dealt out over an expert-parallel group
//! ([`ExpertParallel`]). A learned gate scores each token (softmax over the experts) and sends it
//! to its top-k experts within their capacity (Switch with k = 1, GShard and Mixtral with k = 2:
//! the two probabilities renormalised); the tokens travel to the rank holding their expert and
//! back with two all-to-alls, both differentiable, so an expert's gradient sums every token any
//! member routed to it. The layer also returns Switch's auxiliary load-balancing loss.
//!
//! ```no_run
//! # use candle_core::{Module, Tensor};
//! # use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> kolo::Result<()> {
//! let dist = kolo::init()?;
//! let ep = kolo::ep::ExpertParallel::new(dist.comm().clone()); // 8 experts over every rank
//! let cfg = kolo::ep::MoeConfig { experts: 8, top_k: 2, renormalize: true, capacity_factor: 4.0, aux_weight: 0.01, scoring: Default::default(), groups: None };
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &dist.device());
//! // Any module per expert; this rank builds only its own (`experts.{j}.` for j in its run).
//! let moe = kolo::ep::MoeLayer::new(64, cfg, vb.pp("moe"), Some(&ep), |vb| candle_nn::linear(64, 64, vb))?;
//! # let x = Tensor::zeros((2, 16, 64), candle_core::DType::F32, &dist.device())?;
//! let (y, aux_loss) = moe.forward(&x)?; // y has x's shape; add aux_loss to the loss
//! # let _ = (y, aux_loss); Ok(()) }
//! ```
//!
//! Capacity: each expert takes at most `ceil(capacity_factor x tokens x top_k / experts)` of the
//! tokens one rank routes in one call; assignments beyond it are dropped (that share of the token
//! passes the layer as zero, its residual unchanged). `capacity_factor >= experts / top_k` never
//! drops a token (Mixtral's dropless routing).

use candle_core::{Module, Tensor};
use candle_nn::VarBuilder;
use kolo_base::Exchange;
use kolo_comm::Communicator;
pub use kolo_tensor::models::moe::{ExpertGroups, MoeConfig, MoeLoad, Routing, Scoring};
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// A communicator as the expert-parallel exchange.
struct CommExchange(Arc<dyn Communicator>);

impl Exchange for CommExchange {
    fn rank(&self) -> usize {
        self.0.rank().get()
    }
    fn size(&self) -> usize {
        self.0.world_size().get()
    }
    fn all_to_all(&self, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize]) -> Result<(), String> {
        use kolo_comm::{BufMut, BufRef};
        self.0.all_to_all(BufRef::from(send), send_counts, BufMut::from(recv), recv_counts).map_err(|e| e.to_string())
    }
}

/// An expert-parallel group: its members each hold an equal, consecutive run of every MoE
/// layer's experts, member `r` the `r`-th run.
#[derive(Clone)]
pub struct ExpertParallel {
    ex: Arc<dyn Exchange>,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExpertParallel {{ rank: {}, size: {} }}", self.rank(), self.size())
    }
}

impl ExpertParallel {
    /// The group of `comm`'s ranks.
    pub fn new(comm: Arc<dyn Communicator>) -> ExpertParallel {
        ExpertParallel { ex: Arc::new(CommExchange(comm)) }
    }
    /// The group's all-to-all exchange (what kolo-tensor's expert-parallel GPT,
    /// `Gpt::new_expert_parallel`, sends its tokens through).
    pub fn exchange(&self) -> Arc<dyn Exchange> {
        self.ex.clone()
    }
    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.ex.rank()
    }
    /// The group's size.
    pub fn size(&self) -> usize {
        self.ex.size()
    }
    /// The experts member `rank` holds of a layer of `experts` (which must split evenly).
    pub fn experts_of(&self, experts: usize, rank: usize) -> candle_core::Result<Range<usize>> {
        let p = self.size();
        if experts == 0 || !experts.is_multiple_of(p) {
            candle_core::bail!("{experts} experts cannot be dealt out evenly over {p} expert-parallel ranks");
        }
        let k = experts / p;
        Ok(rank * k..(rank + 1) * k)
    }
}

/// What [`MoeLayer::forward_routed`] returns.
pub struct MoeForward {
    /// The layer's output (the input's shape).
    pub output: Tensor,
    /// As [`MoeLayer::forward`]'s auxiliary loss: add it to the loss.
    pub aux: Tensor,
    /// The gate's softmax over the experts (tokens, experts), differentiable.
    pub probs: Tensor,
    /// Each token's `top_k` chosen experts, best first (tokens x top_k, row-major), before the
    /// capacity drops any.
    pub choices: Vec<usize>,
}

/// A mixture-of-experts layer (see the [module](self)): the gate `gate.weight` (experts, hidden)
/// and this rank's experts `experts.{j}.` under the `VarBuilder` it was built from (Mixtral's
/// `block_sparse_moe` names with Mixtral's experts).
pub struct MoeLayer<E> {
    gate: candle_nn::Linear,
    /// [`Scoring::Sigmoid`]'s selection bias (`gate.e_score_correction_bias`): read, never
    /// trained (its gradient is zero).
    bias: Option<Tensor>,
    experts: Vec<E>,
    held: Range<usize>,
    cfg: MoeConfig,
    ep: Option<ExpertParallel>,
    load: Mutex<MoeLoad>,
    /// The sequence-parallel group whose members route the chunks of the same sequences.
    sp: Option<crate::sp::SequenceParallel>,
}

impl<E: Module> MoeLayer<E> {
    /// The layer on `hidden` features: the gate, and the experts this rank holds (all of them
    /// without `ep`), each built by `expert` from its own `VarBuilder` (`experts.{j}`, `j` the
    /// expert's index in the whole layer). `cfg.experts` must split evenly over `ep`.
    pub fn new(
        hidden: usize,
        cfg: MoeConfig,
        vb: VarBuilder,
        ep: Option<&ExpertParallel>,
        expert: impl Fn(VarBuilder) -> candle_core::Result<E>,
    ) -> candle_core::Result<Self> {
        cfg.check().map_err(candle_core::Error::Msg)?;
        let held = match ep {
            Some(g) => g.experts_of(cfg.experts, g.rank())?,
            None => 0..cfg.experts,
        };
        let gate = candle_nn::linear_no_bias(hidden, cfg.experts, vb.pp("gate"))?;
        let bias = match cfg.scoring {
            Scoring::Sigmoid => Some(vb.pp("gate").get_with_hints(cfg.experts, "e_score_correction_bias", candle_nn::Init::Const(0.0))?),
            Scoring::Softmax => None,
        };
        let experts = held.clone().map(|j| expert(vb.pp("experts").pp(j))).collect::<candle_core::Result<Vec<E>>>()?;
        Ok(MoeLayer { gate, bias, experts, held, cfg, ep: ep.cloned(), load: Mutex::new(MoeLoad::default()), sp: None })
    }

    /// The layer on a sequence-parallel group's chunks of the same sequences
    /// ([`crate::sp::SequenceParallel::chunk`]): the auxiliary loss is the whole sequences',
    /// its first-choice counts summed over the group (constants; collective in every forward),
    /// each member's term its own gate probabilities against them, times the group's size, so
    /// that the members' mean (the trainer averages their gradients) is the whole loss. Without
    /// it each member's loss would be its chunk's, another function of the tokens.
    pub fn over_sequence(mut self, sp: &crate::sp::SequenceParallel) -> Self {
        self.sp = (sp.size() > 1).then(|| sp.clone());
        self
    }

    /// The experts this rank holds (their indices in the whole layer).
    pub fn held(&self) -> Range<usize> {
        self.held.clone()
    }

    /// The routing rules.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The layer on `x` (..., hidden): every token through its experts, weighted by the gate.
    /// Returns the output (`x`'s shape) and the auxiliary load-balancing loss (a scalar, already
    /// times `aux_weight`; add it to the loss). The experts no token reached this call take
    /// part through the output, with gradients of zeros (the trainer wants a gradient for every
    /// parameter). Collective over the expert-parallel group: every member calls it the same
    /// number of times.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
        let r = self.forward_routed(x)?;
        Ok((r.output, r.aux))
    }

    /// As [`MoeLayer::forward`], also returning the gate's probabilities and each token's
    /// choices: for a model whose auxiliary loss is its own (Mixtral's, over every layer's
    /// tokens at once).
    pub fn forward_routed(&self, x: &Tensor) -> candle_core::Result<MoeForward> {
        let dims = x.dims().to_vec();
        let hidden = *dims.last().unwrap_or(&0);
        let flat = x.reshape(((), hidden))?;
        let idle = std::cell::RefCell::new(Vec::new());
        let expert = |l: usize, rows: &Tensor| -> kolo_tensor::Result<Tensor> {
            if rows.dim(0)? == 0 {
                // Not run on no rows: candle's backward through an empty product can leave a
                // weight without a gradient.
                idle.borrow_mut().push(l);
                return Ok(rows.clone());
            }
            Ok(self.experts[l].forward(rows)?)
        };
        let ex = self.ep.as_ref().map(|g| &g.ex);
        let bias = self.bias.as_ref().map(|b| b.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()).transpose()?;
        let m = kolo_tensor::models::moe::moe_layer(&flat, self.gate.weight(), bias.as_deref(), self.experts.len(), &expert, &self.cfg, ex)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let mut aux = match &self.sp {
            Some(sp) => self.sequence_aux(sp, &m.probs, &m.routing.choices)?,
            None => m.aux,
        };
        if let Some(b) = &self.bias {
            // The selection bias is a parameter of the VarMap (so that it loads and exports)
            // but not trained: a gradient of zeros (candle skips a product with the constant 0).
            let zero = Tensor::zeros((), b.dtype(), b.device())?;
            aux = (&aux + b.sum_all()?.mul(&zero)?.to_dtype(aux.dtype())?)?;
        }
        // An expert no token reached this time still takes part, with a gradient of zeros (the
        // trainer, as torch's DDP, wants every parameter's gradient each step): its output on
        // one row of zeros, times 0, is added to the layer's output. There, not in the loss:
        // backward then reads its weights with the other experts' (the layer's ZeRO-3 group is
        // gathered once, at the same point on every rank, whichever experts its tokens reached).
        let mut output = m.out;
        for l in idle.into_inner() {
            let dummy = self.experts[l].forward(&Tensor::zeros((1, hidden), flat.dtype(), flat.device())?)?;
            // Times a zero tensor: candle's backward skips a multiplication by the constant 0.
            let zero = Tensor::zeros((), dummy.dtype(), dummy.device())?;
            let keep = dummy.sum_all()?.mul(&zero)?.to_dtype(output.dtype())?;
            output = output.broadcast_add(&keep)?;
        }
        self.load.lock().unwrap_or_else(|p| p.into_inner()).add(&m.routing);
        Ok(MoeForward { output: output.reshape(dims)?, aux, probs: m.probs, choices: m.routing.choices })
    }

    /// Switch's auxiliary loss over the whole sequences a sequence-parallel group holds the
    /// chunks of ([`MoeLayer::over_sequence`]).
    fn sequence_aux(&self, sp: &crate::sp::SequenceParallel, probs: &Tensor, choices: &[usize]) -> candle_core::Result<Tensor> {
        let (n, e) = probs.dims2()?;
        let k = self.cfg.top_k;
        let mut counts = vec![0f32; e + 1];
        for tok in 0..n {
            counts[choices[tok * k]] += 1.0;
        }
        counts[e] = n as f32;
        sp.sum(&mut counts)?;
        let tokens = f64::from(counts.pop().unwrap_or(0.0));
        if tokens == 0.0 {
            return probs.sum_all()?.affine(0.0, 0.0);
        }
        let first = Tensor::from_vec(counts, e, probs.device())?.to_dtype(probs.dtype())?;
        probs.sum(0)?.mul(&first)?.sum_all()? * (self.cfg.aux_weight * e as f64 * sp.size() as f64 / (tokens * tokens))
    }

    /// The routing counts since the last call (assignments kept per expert of the whole layer,
    /// dropped by the capacity, made): this rank's tokens only.
    pub fn take_load(&self) -> MoeLoad {
        std::mem::take(&mut *self.load.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `f()` without its routing counted in [`MoeLayer::take_load`]: the layer run again by
    /// activation checkpointing's backward, whose tokens the first run counted.
    #[cfg(feature = "hf")]
    pub(crate) fn unrecorded<T>(&self, f: impl FnOnce() -> T) -> T {
        let saved = self.take_load();
        let out = f();
        *self.load.lock().unwrap_or_else(|p| p.into_inner()) = saved;
        out
    }

    /// [`Scoring::Sigmoid`]'s selection bias (`gate.e_score_correction_bias`), the variable
    /// [`ExpertBias::update`] moves; `None` with softmax scoring.
    pub fn selection_bias(&self) -> Option<candle_core::Var> {
        self.bias.as_ref().and_then(|b| candle_core::Var::from_tensor(b).ok())
    }
}

/// DeepSeek-V3's balancing without an auxiliary loss (Megatron-Core's
/// `moe_router_enable_expert_bias`): the change to each expert's selection bias after a step
/// whose routing kept `counts[e]` assignments for expert `e` (summed over every rank routing
/// tokens through the layer): `+rate` for an expert below the mean count, `-rate` above it, 0
/// at it. Pure.
pub fn expert_bias_step(counts: &[f64], rate: f64) -> Vec<f64> {
    let mean = counts.iter().sum::<f64>() / counts.len().max(1) as f64;
    counts
        .iter()
        .map(|&c| {
            if c < mean {
                rate
            } else if c > mean {
                -rate
            } else {
                0.0
            }
        })
        .collect()
}

/// DeepSeek-V3's balancing without an auxiliary loss over a job: moves MoE layers' selection
/// biases by [`expert_bias_step`] from the counts their routing kept since the last update
/// ([`MoeLayer::take_load`]), summed over every rank. It counts on a communicator of its own,
/// split from the job's, because the trainer's gradient buckets may still be in flight on
/// theirs when it runs (after the step's backward passes, before the update).
pub struct ExpertBias {
    comm: Arc<dyn Communicator>,
    rate: f64,
}

impl ExpertBias {
    /// Collective over `world` (every rank of the job): the balancing at `rate` (DeepSeek-V3's
    /// 0.001) with its own communicator.
    pub fn new(world: &dyn Communicator, rate: f64) -> crate::Result<ExpertBias> {
        if !(rate > 0.0 && rate.is_finite()) {
            return Err(crate::Error::setting("expert_bias_rate", format!("{rate} is not a number > 0")));
        }
        let comm = kolo_comm::split(world, Some(0), world.rank().get() as u32)?.expect("every rank has a color");
        Ok(ExpertBias { comm, rate })
    }

    /// Collective over the job: every rank calls it after the step's backward passes and before
    /// [`crate::Trainer::update`] (as [`crate::Trainer::step_then`]'s `before_update`).
    /// `layers` pairs each of this rank's MoE layers that has a selection bias with its index
    /// among the `total` such layers of the whole model (pipeline stages fill their own
    /// layers' rows; members of a tensor-parallel group, which route the same tokens, only
    /// scale every count alike, which leaves the signs). The biases change through
    /// [`crate::Trainer::add_to_param`], so that checkpoints, ZeRO shards and f32 masters hold
    /// them.
    pub fn update<E: Module>(&self, layers: &[(usize, &MoeLayer<E>)], total: usize, trainer: &mut crate::Trainer) -> crate::Result<()> {
        let rank = self.comm.rank().get();
        let experts = layers.first().map_or(0, |(_, l)| l.cfg.experts);
        let mut width = [experts as i64];
        self.comm.all_reduce(kolo_comm::BufMut::from(&mut width[..]), kolo_comm::ReduceOp::Max)?;
        let e = width[0] as usize;
        let mut counts = vec![0f64; total * e];
        for &(i, layer) in layers {
            let load = layer.take_load().load;
            if i >= total || layer.cfg.experts != e || layer.bias.is_none() {
                return Err(crate::Error::usage(
                    rank,
                    "ExpertBias::update",
                    format!(
                        "layer {i} of {total}: {} experts (the model's layers have {e}), selection bias {}",
                        layer.cfg.experts,
                        layer.bias.is_some()
                    ),
                ));
            }
            for (c, l) in counts[i * e..(i + 1) * e].iter_mut().zip(load) {
                *c = l as f64;
            }
        }
        self.comm.all_reduce(kolo_comm::BufMut::from(&mut counts[..]), kolo_comm::ReduceOp::Sum)?;
        for &(i, layer) in layers {
            let Some(var) = layer.selection_bias() else { continue };
            let delta: Vec<f32> = expert_bias_step(&counts[i * e..(i + 1) * e], self.rate).into_iter().map(|d| d as f32).collect();
            trainer.add_to_param(&var, &Tensor::from_vec(delta, e, var.device())?)?;
        }
        Ok(())
    }
}
