//! Mixture-of-experts feed-forward layer (Switch Transformer / GShard) with expert parallelism.
//!
//! A learned gate (a linear map d_model -> experts, softmax) picks each token's top-k experts
//! (k = 1: Switch, the gate probability scales the expert's output; k = 2: GShard, the two
//! probabilities renormalised to sum to one). Each expert takes at most `capacity` tokens of a
//! group (the tokens one rank routes in one step): capacity = ceil(factor x tokens x k / experts);
//! first choices are placed before any second choice, in token order, and assignments beyond
//! the capacity are dropped (the token's residual passes the layer unchanged for that share).
//! The auxiliary load-balancing loss is Switch's: weight x experts x sum_e f_e P_e, with f_e the
//! fraction of tokens whose first choice is e and P_e the mean gate probability of e.
//!
//! Under expert parallelism the experts are dealt out in equal consecutive runs over the group;
//! the tokens routed to an expert travel to its rank with an all-to-all, are transformed there
//! and come back with a second all-to-all. Both exchanges are differentiable (their backward is
//! the reverse exchange), so the gradients of remote tokens reach the expert that saw them.

use crate::{Result, TensorError};
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};
use kolo_base::Exchange;
use std::sync::Arc;

/// The MoE layer's shape and routing rules.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer.
    pub experts: usize,
    /// Experts per token (at most `experts`).
    pub top_k: usize,
    /// Whether a token's top-k gate probabilities are divided by their sum before they weigh
    /// the experts' outputs (GShard, Mixtral, Qwen3-MoE's `norm_topk_prob`); without, the
    /// probabilities weigh them as they are (Switch with k = 1, Qwen2-MoE).
    pub renormalize: bool,
    /// Capacity factor: each expert takes up to ceil(factor x tokens x k / experts) tokens.
    pub capacity_factor: f64,
    /// Weight of the auxiliary load-balancing loss (0: none).
    pub aux_weight: f64,
    /// How the gate scores the experts (softmax, or DeepSeek-V3's sigmoid).
    pub scoring: Scoring,
    /// DeepSeek's group-limited routing: the experts in `groups` equal consecutive groups, a
    /// token's top k taken within its best `top_groups` groups only (`None`: among them all).
    pub groups: Option<ExpertGroups>,
}

/// How a gate scores the experts and picks a token's top k.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Scoring {
    /// A softmax over the experts; the top k by probability, which weighs each (Switch,
    /// GShard, Mixtral, the Qwens, DeepSeek-V2). A group's score is its best expert's.
    #[default]
    Softmax,
    /// DeepSeek-V3's: a sigmoid per expert; the top k by sigmoid plus a per-expert selection
    /// bias (its `e_score_correction_bias`, which gradients do not train), weighted by the
    /// sigmoids themselves. A group's score is the sum of its best two (biased) scores.
    Sigmoid,
}

/// Group-limited routing ([`MoeConfig::groups`]): `n_group` and `topk_group` in DeepSeek's
/// configs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertGroups {
    pub groups: usize,
    pub top_groups: usize,
}

impl MoeConfig {
    /// At least one expert, k of 1 to the experts, a positive capacity factor and a weight that
    /// is not negative.
    pub fn check(&self) -> std::result::Result<(), String> {
        let positive = self.capacity_factor.is_finite() && self.capacity_factor > 0.0;
        let weight_ok = self.aux_weight.is_finite() && self.aux_weight >= 0.0;
        if self.experts == 0 || self.top_k == 0 || self.top_k > self.experts || !positive || !weight_ok {
            return Err(format!(
                "mixture of experts: experts must be at least 1, top_k from 1 to experts, capacity_factor > 0, aux_loss_weight >= 0 (got experts {}, top_k {}, capacity_factor {}, aux_loss_weight {})",
                self.experts, self.top_k, self.capacity_factor, self.aux_weight
            ));
        }
        if let Some(g) = self.groups {
            let per = if g.groups > 0 && self.experts.is_multiple_of(g.groups) { self.experts / g.groups } else { 0 };
            let least = if self.scoring == Scoring::Sigmoid { 2 } else { 1 };
            if per < least || g.top_groups == 0 || g.top_groups > g.groups || g.top_groups * per < self.top_k {
                return Err(format!(
                    "mixture of experts: {} experts in {} groups, the best {} of them, top {}: the groups must split the experts evenly (at least {least} each), and the chosen groups hold at least top_k experts",
                    self.experts, g.groups, g.top_groups, self.top_k
                ));
            }
        }
        Ok(())
    }
}

/// Per-expert tokens a group of `tokens` tokens may send to one expert.
pub fn capacity(tokens: usize, experts: usize, k: usize, factor: f64) -> usize {
    if tokens == 0 {
        return 0;
    }
    ((factor * (tokens * k) as f64 / experts as f64).ceil() as usize).max(1)
}

/// Where one layer sends a group's tokens: the routing plan (pure).
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Each token's choices, best first (`k` per token).
    pub choices: Vec<usize>,
    /// Kept (token, expert) assignments, ordered by expert, then by arrival at that expert.
    pub kept: Vec<(usize, usize)>,
    /// Tokens kept per expert.
    pub counts: Vec<usize>,
    /// Assignments dropped because their expert was full.
    pub dropped: usize,
}

/// Routes `n` tokens given their gate probabilities `probs` (n x e, row-major): each token's
/// top-`k` experts (ties to the lower index), first choices of every token placed before any
/// second choice, each expert taking at most `cap` tokens.
pub fn route(probs: &[f32], n: usize, e: usize, k: usize, cap: usize) -> Routing {
    route_within(probs, None, None, n, e, k, cap)
}

/// [`route`] choosing by `scores` plus a per-expert selection `bias` (DeepSeek-V3's), and with
/// `groups` only among the experts of each token's best groups (a group scored by its best
/// score, or with `groups.1` by the sum of its best two: DeepSeek-V2's and V3's rules).
pub fn route_within(
    scores: &[f32],
    bias: Option<&[f32]>,
    groups: Option<(ExpertGroups, bool)>,
    n: usize,
    e: usize,
    k: usize,
    cap: usize,
) -> Routing {
    let mut choices = Vec::with_capacity(n * k);
    for t in 0..n {
        let mut row = scores[t * e..(t + 1) * e].to_vec();
        if let Some(b) = bias {
            row.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        let best = |idx: &mut Vec<usize>, row: &[f32]| idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let mut allowed = vec![true; e];
        if let Some((g, top_two)) = groups {
            let per = e / g.groups.max(1);
            let group_score: Vec<f32> = (0..g.groups)
                .map(|j| {
                    let mut v: Vec<f32> = row[j * per..(j + 1) * per].to_vec();
                    v.sort_by(|a, b| b.total_cmp(a));
                    if top_two {
                        v.iter().take(2).sum()
                    } else {
                        v[0]
                    }
                })
                .collect();
            let mut order: Vec<usize> = (0..g.groups).collect();
            best(&mut order, &group_score);
            allowed = vec![false; e];
            for &j in &order[..g.top_groups.min(g.groups)] {
                allowed[j * per..(j + 1) * per].iter_mut().for_each(|a| *a = true);
            }
        }
        let mut order: Vec<usize> = (0..e).filter(|&x| allowed[x]).collect();
        best(&mut order, &row);
        choices.extend_from_slice(&order[..k.min(order.len())]);
    }
    let k = k.min(e);
    let mut per_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    let mut dropped = 0;
    for j in 0..k {
        for t in 0..n {
            let x = choices[t * k + j];
            if per_expert[x].len() < cap {
                per_expert[x].push(t);
            } else {
                dropped += 1;
            }
        }
    }
    let counts = per_expert.iter().map(Vec::len).collect();
    let kept = per_expert.iter().enumerate().flat_map(|(x, ts)| ts.iter().map(move |&t| (t, x))).collect();
    Routing { choices, kept, counts, dropped }
}

/// Switch's auxiliary loss for given first-choice fractions `f` and mean probabilities `p`.
pub fn aux_loss_value(f: &[f64], p: &[f64], weight: f64) -> f64 {
    weight * f.len() as f64 * f.iter().zip(p).map(|(a, b)| a * b).sum::<f64>()
}

/// Coefficient of variation (standard deviation / mean) of expert loads.
pub fn load_cv(load: &[u64]) -> f64 {
    if load.is_empty() {
        return 0.0;
    }
    let n = load.len() as f64;
    let mean = load.iter().sum::<u64>() as f64 / n;
    if mean == 0.0 {
        return 0.0;
    }
    let var = load.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
    var.sqrt() / mean
}

/// Routing counts summed over steps (and, once reduced, over ranks).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeLoad {
    /// Assignments kept per expert, over every MoE layer.
    pub load: Vec<u64>,
    /// Assignments dropped by the capacity limit.
    pub dropped: u64,
    /// Assignments made (tokens x k, every layer).
    pub assigned: u64,
}

impl MoeLoad {
    pub fn add(&mut self, r: &Routing) {
        if self.load.len() < r.counts.len() {
            self.load.resize(r.counts.len(), 0);
        }
        for (l, c) in self.load.iter_mut().zip(&r.counts) {
            *l += *c as u64;
        }
        self.dropped += r.dropped as u64;
        self.assigned += (r.kept.len() + r.dropped) as u64;
    }
    /// Adds another count's (a checkpointed layer's, counted apart).
    pub fn absorb(&mut self, o: MoeLoad) {
        if self.load.len() < o.load.len() {
            self.load.resize(o.load.len(), 0);
        }
        for (l, c) in self.load.iter_mut().zip(&o.load) {
            *l += c;
        }
        self.dropped += o.dropped;
        self.assigned += o.assigned;
    }
    pub fn cv(&self) -> f64 {
        load_cv(&self.load)
    }
    pub fn dropped_fraction(&self) -> f64 {
        if self.assigned == 0 {
            0.0
        } else {
            self.dropped as f64 / self.assigned as f64
        }
    }
}

/// The all-to-all of rows of width `width` as a differentiable op: forward sends `send[d]` rows
/// to member d and receives `recv[s]` rows from member s; backward is the reverse exchange.
struct AllToAllRows {
    ex: Arc<dyn Exchange>,
    send: Vec<usize>,
    recv: Vec<usize>,
    width: usize,
}

fn cmsg(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("expert-parallel all-to-all: {e}"))
}

fn exchange_rows(ex: &dyn Exchange, data: &[f32], send: &[usize], recv: &[usize], width: usize) -> candle_core::Result<Vec<f32>> {
    let sc: Vec<usize> = send.iter().map(|r| r * width).collect();
    let rc: Vec<usize> = recv.iter().map(|r| r * width).collect();
    let mut out = vec![0f32; rc.iter().sum()];
    ex.all_to_all(data, &sc, &mut out, &rc).map_err(cmsg)?;
    Ok(out)
}

impl CustomOp1 for AllToAllRows {
    fn name(&self) -> &'static str {
        "kolo-moe-all-to-all"
    }
    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        // bf16/f16 rows travel as f32 (exact both ways).
        let (data, dtype) = super::tp::storage_vec(storage, layout)?;
        let out = exchange_rows(&*self.ex, &data, &self.send, &self.recv, self.width)?;
        let rows = self.recv.iter().sum::<usize>();
        Ok((super::tp::storage_of(out, dtype), Shape::from((rows, self.width))))
    }
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let g = grad.contiguous()?.flatten_all()?.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?;
        let back = exchange_rows(&*self.ex, &g, &self.recv, &self.send, self.width)?;
        let rows = self.send.iter().sum::<usize>();
        Ok(Some(Tensor::from_vec(back, (rows, self.width), grad.device())?.to_dtype(grad.dtype())?))
    }
}

fn u32s(v: impl IntoIterator<Item = usize>, device: &Device) -> Result<Tensor> {
    let v: Vec<u32> = v.into_iter().map(|x| x as u32).collect();
    let n = v.len();
    Ok(Tensor::from_vec(v, n, device)?)
}

/// The MoE feed-forward of one block on `hdn` (b, t, c): `gate` (experts, c) and this rank's
/// experts `local` (each fc weight, fc bias, fc_out weight, fc_out bias): the built-in GPT's
/// experts through [`moe_layer`]. Returns the layer's output (b, t, c), its auxiliary loss (a
/// scalar, already weighted) and the routing.
pub(crate) fn moe_forward(
    hdn: &Tensor,
    gate: &Tensor,
    local: &[[Tensor; 4]],
    cfg: &MoeConfig,
    ex: Option<&Arc<dyn Exchange>>,
) -> Result<(Tensor, Tensor, Routing)> {
    let (b, t, c) = hdn.dims3()?;
    let expert = |l: usize, x: &Tensor| -> Result<Tensor> {
        let ps = &local[l];
        let h = crate::fused::gelu_erf(&crate::ops::linear(x, &ps[0], &ps[1])?)?;
        crate::ops::linear(&h, &ps[2], &ps[3])
    };
    let m = moe_layer(&hdn.reshape((b * t, c))?, gate, None, local.len(), &expert, cfg, ex)?;
    Ok((m.out.reshape((b, t, c))?, m.aux, m.routing))
}

/// One mixture-of-experts layer on the tokens `x` (n, c), the routing group of this rank:
/// `gate` (experts, c) scores them ([`MoeConfig::scoring`]; with `bias` added for the choice
/// only), each token goes to its top-k experts within their capacity ([`route_within`]), `local` experts live on this rank (the whole layer's experts dealt out
/// in equal consecutive runs over the exchange's members; all of them without one) and
/// `expert(l, rows)` applies this rank's `l`-th expert to the rows sent to it (from every member,
/// through a differentiable all-to-all), and the outputs come back weighted by the gate.
/// Returns the output (n, c), the auxiliary load-balancing loss (a scalar, already weighted),
/// the routing and the gate's probabilities.
pub fn moe_layer(
    x: &Tensor,
    gate: &Tensor,
    bias: Option<&[f32]>,
    local: usize,
    expert: &dyn Fn(usize, &Tensor) -> Result<Tensor>,
    cfg: &MoeConfig,
    ex: Option<&Arc<dyn Exchange>>,
) -> Result<MoeOut> {
    let (n, c) = x.dims2()?;
    let e = cfg.experts;
    let k = cfg.top_k;
    let device = x.device().clone();
    // The gate's probabilities in f32 whatever the tokens' dtype (as Mixtral's router in
    // `transformers`); the combine weights are rounded to the tokens' dtype.
    let logits = x.matmul(&gate.t()?)?.to_dtype(DType::F32)?;
    let probs = match cfg.scoring {
        Scoring::Softmax => crate::ops::softmax_last(&logits)?,
        Scoring::Sigmoid => (logits.neg()?.exp()? + 1.0)?.recip()?,
    };
    let flat_probs = probs.flatten_all()?;
    let pv = flat_probs.to_vec1::<f32>()?;
    let groups = cfg.groups.map(|g| (g, cfg.scoring == Scoring::Sigmoid));
    let routing = route_within(&pv, bias, groups, n, e, k, capacity(n, e, k, cfg.capacity_factor));
    let tokens = u32s(routing.kept.iter().map(|&(tok, _)| tok), &device)?;
    // Combine weights: the gate probability of each kept assignment (renormalised: divided by
    // the sum over the token's top-k).
    let mut w = flat_probs.index_select(&u32s(routing.kept.iter().map(|&(tok, x)| tok * e + x), &device)?, 0)?;
    if cfg.renormalize {
        let top = flat_probs
            .index_select(&u32s(routing.choices.iter().enumerate().map(|(i, &x)| (i / k) * e + x), &device)?, 0)?
            .reshape((n, k))?
            .sum(1)?;
        // DeepSeek-V3 adds 1e-20 to the sum of its sigmoids (a softmax's top k is never 0).
        let top = if cfg.scoring == Scoring::Sigmoid { (top + 1e-20)? } else { top };
        w = (w / top.index_select(&tokens, 0)?)?;
    }
    let dispatched = x.index_select(&tokens, 0)?;
    let p = ex.map_or(1, |g| g.size());
    let el = e / p;
    if local != el {
        return Err(TensorError::Input(format!("{local} local experts, expected {el} ({e} over {p} ranks)")));
    }
    // Rows per (source, local expert) this rank receives.
    let (recv, per_source): (Tensor, Vec<Vec<usize>>) = match ex {
        Some(g) if p > 1 => {
            let counts: Vec<f32> = routing.counts.iter().map(|&x| x as f32).collect();
            let mut rc = vec![0f32; e];
            g.all_to_all(&counts, &vec![el; p], &mut rc, &vec![el; p])
                .map_err(|m| TensorError::Input(format!("expert-parallel count exchange: {m}")))?;
            let per: Vec<Vec<usize>> = rc.chunks(el).map(|ch| ch.iter().map(|&x| x as usize).collect()).collect();
            let send: Vec<usize> = routing.counts.chunks(el).map(|ch| ch.iter().sum()).collect();
            let recv_rows: Vec<usize> = per.iter().map(|v| v.iter().sum()).collect();
            let op = AllToAllRows { ex: g.clone(), send, recv: recv_rows, width: c };
            (dispatched.contiguous()?.apply_op1(op)?, per)
        }
        _ => (dispatched, vec![routing.counts.clone()]),
    };
    // Rows of each local expert in the received buffer (grouped by source, then expert).
    let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); el];
    let mut off = 0;
    for src in &per_source {
        for (l, &cnt) in src.iter().enumerate() {
            rows_of[l].extend(off..off + cnt);
            off += cnt;
        }
    }
    let mut outs = Vec::with_capacity(el);
    for (l, rows) in rows_of.iter().enumerate() {
        let xl = if p == 1 {
            recv.narrow(0, rows.first().copied().unwrap_or(0), rows.len())?
        } else {
            recv.index_select(&u32s(rows.iter().copied(), &device)?, 0)?
        };
        outs.push(expert(l, &xl)?);
    }
    let mut y = Tensor::cat(&outs, 0)?;
    if p > 1 {
        // Back to the received order.
        let mut inverse = vec![0usize; off];
        for (pos, &row) in rows_of.iter().flatten().enumerate() {
            inverse[row] = pos;
        }
        y = y.index_select(&u32s(inverse, &device)?, 0)?;
    }
    let back = match ex {
        Some(g) if p > 1 => {
            let recv_rows: Vec<usize> = per_source.iter().map(|v| v.iter().sum()).collect();
            let send: Vec<usize> = routing.counts.chunks(el).map(|ch| ch.iter().sum()).collect();
            y.contiguous()?.apply_op1(AllToAllRows { ex: g.clone(), send: recv_rows, recv: send, width: c })?
        }
        _ => y,
    };
    let weighted = back.broadcast_mul(&w.unsqueeze(1)?.to_dtype(x.dtype())?)?;
    let out = Tensor::zeros((n, c), x.dtype(), &device)?.index_add(&tokens, &weighted, 0)?;
    // Auxiliary load-balancing loss.
    let mut f = vec![0f32; e];
    for tok in 0..n {
        f[routing.choices[tok * k]] += 1.0 / n as f32;
    }
    let f = Tensor::from_vec(f, e, &device)?;
    let aux = (probs.mean(0)?.mul(&f)?.sum_all()? * (cfg.aux_weight * e as f64))?;
    Ok(MoeOut { out, aux, routing, probs })
}

/// What [`moe_layer`] returns.
pub struct MoeOut {
    /// The layer's output (n, c).
    pub out: Tensor,
    /// Switch's auxiliary load-balancing loss, times `aux_weight` (a scalar).
    pub aux: Tensor,
    /// Which experts each token chose, and which of those assignments were kept.
    pub routing: Routing,
    /// The gate's softmax over the experts (n, experts), differentiable: for a model's own
    /// auxiliary losses (Mixtral's is over every layer's tokens at once).
    pub probs: Tensor,
}
