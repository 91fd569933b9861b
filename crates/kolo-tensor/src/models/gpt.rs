use super::{normal, Input, Model};
use crate::ops::{layer_norm, linear};
use crate::{ParamSet, ParamView, Result, TensorError};
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor, Var};
use kolo_base::Rng;
use std::sync::Arc;

/// nanoGPT-style decoder: token + learned position embedding, pre-norm blocks with causal
/// self-attention and a GELU MLP (x4), final norm, untied head. No dropout.
#[derive(Clone, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub seq: usize,
    pub d_model: usize,
    pub n_head: usize,
    pub n_layer: usize,
    /// Mixture of experts: every block's MLP replaced by a gated set of expert MLPs.
    pub moe: Option<super::moe::MoeConfig>,
}

impl GptConfig {
    /// The benchmark shape of `peerbench_models.py` (3,225,665 parameters).
    pub fn bench() -> GptConfig {
        GptConfig { vocab: 65, seq: 128, d_model: 256, n_head: 4, n_layer: 4, moe: None }
    }
}

#[derive(Clone)]
struct Block {
    ln1: (usize, usize),
    qkv: (usize, usize),
    proj: (usize, usize),
    ln2: (usize, usize),
    ffn: Ffn,
}

/// A block's feed-forward part.
#[derive(Clone)]
enum Ffn {
    Dense {
        fc: (usize, usize),
        fc_out: (usize, usize),
    },
    /// The gate's weight and this rank's experts (fc weight, fc bias, fc_out weight, fc_out bias).
    Moe {
        gate: usize,
        experts: Vec<[usize; 4]>,
    },
}

impl Block {
    /// The block's parameters in the order [`block_forward`] takes them (a MoE block: the
    /// attention half, then the gate, then each local expert's four).
    fn ids(&self) -> Vec<usize> {
        let [a, b, c, d] = [self.ln1, self.qkv, self.proj, self.ln2];
        let mut v = vec![a.0, a.1, b.0, b.1, c.0, c.1, d.0, d.1];
        match &self.ffn {
            Ffn::Dense { fc, fc_out } => v.extend([fc.0, fc.1, fc_out.0, fc_out.1]),
            Ffn::Moe { gate, experts } => {
                v.push(*gate);
                v.extend(experts.iter().flatten());
            }
        }
        v
    }

    fn is_moe(&self) -> bool {
        matches!(self.ffn, Ffn::Moe { .. })
    }
}

pub struct Gpt {
    cfg: GptConfig,
    params: ParamSet,
    wte: usize,
    wpe: usize,
    blocks: Vec<Block>,
    ln_f: (usize, usize),
    head: (usize, usize),
    /// Blocks whose activations are recomputed in backward instead of stored.
    checkpointed: Vec<bool>,
    /// Tensor parallelism: the group, each parameter's cut, and for each local value its index
    /// in the whole model's flat layout.
    tp: Option<TensorParallel>,
    /// Sequence parallelism: this rank holds one chunk of every sequence; attention runs over the ring.
    sp: Option<Arc<dyn kolo_base::RingShift>>,
    /// Expert parallelism: the group the experts are dealt over.
    ep: Option<ExpertParallel>,
    /// MoE routing counts since the last [`Model::take_moe_load`].
    moe_load: std::sync::Mutex<super::moe::MoeLoad>,
}

#[derive(Clone)]
struct ExpertParallel {
    group: Arc<dyn kolo_base::Exchange>,
    /// For each local value, its index in the whole model's flat layout.
    map: super::IndexRuns,
    /// Per local parameter: whether it belongs to an expert.
    expert: Vec<bool>,
    full_len: usize,
}

#[derive(Clone)]
struct TensorParallel {
    group: Arc<dyn kolo_base::GroupSum>,
    cuts: Vec<super::tp::Cut>,
    map: super::IndexRuns,
    full_len: usize,
}

/// q, k and v of `hdn` (b, t, c) as (b, h, t, d) each, through the fused (3c', c) projection
/// `qw`, `qb` (c' = c for a whole model, a tensor-parallel member's share otherwise).
pub(crate) fn qkv_heads(hdn: &Tensor, qw: &Tensor, qb: &Tensor, h: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = hdn.dims3()?;
    let cl = qw.dim(0)? / 3;
    // Project q, k and v separately through row slices of the fused qkv weight: the
    // backward of slicing a weight is weight-sized, slicing the (b, t, 3c) activation
    // would pad and add activation-sized zeros three times per block.
    let heads = |k: usize| -> Result<Tensor> {
        let y = linear(hdn, &qw.narrow(0, k * cl, cl)?, &qb.narrow(0, k * cl, cl)?)?;
        Ok(y.reshape((b, t, h, cl / h))?.transpose(1, 2)?.contiguous()?)
    };
    Ok((heads(0)?, heads(1)?, heads(2)?))
}

/// Causal self-attention of `h` heads over `hdn` (b, t, c) with the fused projection `qw`
/// (3c', c), `qb`: the (b, t, c') head outputs side by side. f32 on the CPU runs
/// [`crate::dense::causal_attention`] on the one (b, t, 3c') projection (heads and transposes
/// addressed in place); elsewhere candle's ops on per-head copies.
pub(crate) fn self_attention(hdn: &Tensor, qw: &Tensor, qb: &Tensor, h: usize) -> Result<Tensor> {
    if [hdn, qw, qb].iter().all(|t| crate::dense::applies(t)) {
        return Ok(crate::dense::causal_attention(&linear(hdn, qw, qb)?, h)?);
    }
    let (b, t, _) = hdn.dims3()?;
    let cl = qw.dim(0)? / 3;
    let scale = 1.0 / ((cl / h) as f64).sqrt();
    let (q, k, v) = qkv_heads(hdn, qw, qb, h)?;
    let y = crate::fused::causal_softmax(&q.matmul(&k.t()?)?, scale)?.matmul(&v)?;
    Ok(y.transpose(1, 2)?.contiguous()?.reshape((b, t, cl))?)
}

/// One pre-norm transformer block on `x` (b, t, c) with parameters `p` (see [`Block::ids`]).
fn block_forward(x: &Tensor, p: &[Tensor], h: usize) -> Result<Tensor> {
    block_forward_with(x, p, h, None)
}

/// The block, with attention over a sequence-parallel ring when `ring` is given.
fn block_forward_with(x: &Tensor, p: &[Tensor], h: usize, ring: Option<&Arc<dyn kolo_base::RingShift>>) -> Result<Tensor> {
    let (b, t, c) = x.dims3()?;
    let d = c / h;
    let scale = 1.0 / (d as f64).sqrt();
    let hdn = layer_norm(x, &p[0], &p[1], 1e-5)?;
    let y = match ring {
        Some(r) => {
            // Mixed precision: bf16/f16 queries, keys and values widened to f32 for the ring
            // (its blocks travel and its running softmax sums in f32, as flash attention's
            // does), the output rounded back once.
            let (q, k, v) = qkv_heads(&hdn, &p[2], &p[3], h)?;
            let dtype = q.dtype();
            let f32 = |t: Tensor| t.to_dtype(DType::F32);
            let y = f32(q)?.apply_op3(&f32(k)?, &f32(v)?, super::ring::RingAttention::new(r.clone(), scale as f32))?;
            y.to_dtype(dtype)?.transpose(1, 2)?.contiguous()?.reshape((b, t, c))?
        }
        None => self_attention(&hdn, &p[2], &p[3], h)?,
    };
    let x = (x + linear(&y, &p[4], &p[5])?)?;
    let hdn = layer_norm(&x, &p[6], &p[7], 1e-5)?;
    Ok((&x + linear(&crate::fused::gelu_erf(&linear(&hdn, &p[8], &p[9])?)?, &p[10], &p[11])?)?)
}

/// A block whose MLP is a mixture of experts: `p` holds the attention half (8), the gate, then
/// four per local expert. Returns the output and the auxiliary loss.
fn block_forward_moe(
    x: &Tensor,
    p: &[Tensor],
    h: usize,
    cfg: &super::moe::MoeConfig,
    ex: Option<&Arc<dyn kolo_base::Exchange>>,
    load: Option<&std::sync::Mutex<super::moe::MoeLoad>>,
) -> Result<(Tensor, Tensor)> {
    let hdn = layer_norm(x, &p[0], &p[1], 1e-5)?;
    let y = self_attention(&hdn, &p[2], &p[3], h)?;
    let x = (x + linear(&y, &p[4], &p[5])?)?;
    let hdn = layer_norm(&x, &p[6], &p[7], 1e-5)?;
    let experts: Vec<[Tensor; 4]> = p[9..].chunks(4).map(|e| [e[0].clone(), e[1].clone(), e[2].clone(), e[3].clone()]).collect();
    let (m, aux, routing) = super::moe::moe_forward(&hdn, &p[8], &experts, cfg, ex)?;
    if let Some(load) = load {
        load.lock().unwrap_or_else(|e| e.into_inner()).add(&routing);
    }
    Ok(((&x + m)?, aux))
}

/// Activation checkpointing of one block as a differentiable op on `(x, the block's parameters
/// as the view gave them, joined)`: forward runs the block without recording a graph (nothing
/// inside is kept), backward runs it again with a graph and differentiates it. Both read the
/// parameters' values from the variables themselves (cast as the view casts them; backward's
/// graph has them as its leaves, so neither makes a copy of them); the joined input holds no values (`crate::checkpoint::join_vars`) and carries the packed
/// gradient back to whatever the view attached (gradient hooks, or the GradStore). No copy of
/// the block's parameters lives from forward to backward, not one per micro-batch in flight.
struct CheckpointedBlock {
    /// Heads of this rank (its share of them under tensor parallelism).
    n_head: usize,
    /// Tensor parallelism: the block is this member's pieces, its operators summing over the
    /// group (the recomputation in backward runs the same all-reduces again, every member
    /// recomputing the same block at the same point).
    tp: Option<Arc<dyn kolo_base::GroupSum>>,
    /// Sequence parallelism: the block's attention runs over this ring of sequence chunks (its
    /// recomputation passes the keys and values around again, every member at the same point).
    ring: Option<Arc<dyn kolo_base::RingShift>>,
    /// The block's variables and the dtype the model computes them in, which forward and
    /// backward pack (under ZeRO-3 that read gathers them).
    reread: Reread,
    /// A block whose MLP is a mixture of experts: its routing, its experts' exchange (expert
    /// parallelism: the recomputation's all-to-alls run again, every member at the same point)
    /// and where the forward counts its routing (backward's run counts nothing). Its output is
    /// the hidden states flattened with the auxiliary loss after them.
    moe: Option<MoeBlock>,
    /// The dtype the model computes in (its parameters' views'; the input's).
    dtype: DType,
}

struct MoeBlock {
    cfg: super::moe::MoeConfig,
    ex: Option<Arc<dyn kolo_base::Exchange>>,
    load: Option<Arc<std::sync::Mutex<super::moe::MoeLoad>>>,
}

/// The block's variables (the model's own, read where they are: no copy is made).
struct Reread {
    vars: Vec<Tensor>,
}

/// A contiguous CPU tensor over (a copy of) an op's input, in its dtype (f32, bf16 or f16).
fn cpu_tensor(storage: &CpuStorage, layout: &Layout) -> candle_core::Result<Tensor> {
    if !layout.is_contiguous() {
        return Err(candle_core::Error::Msg("kolo-checkpointed-block: inputs must be contiguous".into()));
    }
    let (s, n, shape) = (layout.start_offset(), layout.shape().elem_count(), layout.shape());
    match storage {
        CpuStorage::F32(v) => Tensor::from_slice(&v[s..s + n], shape, &Device::Cpu),
        CpuStorage::BF16(v) => Tensor::from_slice(&v[s..s + n], shape, &Device::Cpu),
        CpuStorage::F16(v) => Tensor::from_slice(&v[s..s + n], shape, &Device::Cpu),
        _ => Err(candle_core::Error::Msg("kolo-checkpointed-block: inputs in f32, bf16 or f16 only".into())),
    }
}

fn msg(e: TensorError) -> candle_core::Error {
    candle_core::Error::Msg(format!("kolo-checkpointed-block: {e}"))
}

impl CustomOp2 for CheckpointedBlock {
    fn name(&self) -> &'static str {
        "kolo-checkpointed-block"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let x = cpu_tensor(s1, l1)?;
        // The variables' values, detached: forward records no graph (under ZeRO-3 this read
        // gathers them).
        let p: Vec<Tensor> = self.reread.vars.iter().map(Tensor::detach).collect();
        let y = self.run(&x, &p, true).map_err(msg)?;
        crate::checkpoint::owned_cpu(&y)
    }

    fn bwd(&self, x: &Tensor, _joined: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        // The variables again (under ZeRO-3 this read gathers them), as the recomputation's leaves.
        let (gx, gp) = recompute(x, &self.reread.vars, &|x, p| self.run(x, p, false), grad)?;
        Ok((gx, Some(gp)))
    }
}

impl CheckpointedBlock {
    /// The block on `x` with the parameters `p`; a mixture of experts' output joined with its
    /// auxiliary loss, its routing counted when `count`.
    ///
    /// The parameters arrive in f32 (packed, or backward's variables) and are cast to the
    /// model's compute dtype first, as the model's view casts them: the block computes in bf16
    /// or f16 as it would without checkpointing, and their gradients come back through the cast.
    fn run(&self, x: &Tensor, p: &[Tensor], count: bool) -> Result<Tensor> {
        let p: Vec<Tensor> = p.iter().map(|t| t.to_dtype(self.dtype)).collect::<candle_core::Result<_>>()?;
        let Some(m) = &self.moe else { return run_block(x, &p, self.n_head, (self.tp.as_ref(), self.ring.as_ref())) };
        let load = m.load.as_deref().filter(|_| count);
        let (y, aux) = block_forward_moe(x, &p, self.n_head, &m.cfg, m.ex.as_ref(), load)?;
        // In f32 (exact for the hidden states of any dtype; the auxiliary loss is f32).
        Ok(Tensor::cat(&[&y.flatten_all()?.to_dtype(DType::F32)?, &aux.to_dtype(DType::F32)?.reshape(1)?], 0)?)
    }
}

/// How a dense block is split: over a tensor-parallel group, or a ring of sequence chunks.
type BlockSplit<'a> = (Option<&'a Arc<dyn kolo_base::GroupSum>>, Option<&'a Arc<dyn kolo_base::RingShift>>);

/// A dense block: whole, this member's pieces of it under tensor parallelism over `tp`, or
/// this member's chunk of each sequence with its attention over the `ring`.
fn run_block(x: &Tensor, p: &[Tensor], n_head: usize, (tp, ring): BlockSplit<'_>) -> Result<Tensor> {
    match (tp, ring) {
        (Some(group), _) => super::tp::block_forward_tp(x, p, n_head, group),
        (None, ring) => block_forward_with(x, p, n_head, ring),
    }
}

/// The backward of a block from its input `x`, the model's variables and the gradient of its
/// output: the block (`run`) runs again with a graph whose leaves are those variables
/// themselves (no copy of them is made; this backward is the recomputation's own, apart from
/// the one running around it), and their gradients come back packed in f32.
fn recompute(
    x: &Tensor,
    vars: &[Tensor],
    run: &dyn Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
    grad: &Tensor,
) -> candle_core::Result<(Option<Tensor>, Tensor)> {
    let xv = Var::from_tensor(&x.detach())?;
    let y = run(xv.as_tensor(), vars).map_err(msg)?;
    let g = (y * grad.detach())?.sum_all()?.backward()?;
    let flat = vars
        .iter()
        .map(|v| {
            let gv = g.get(v).ok_or_else(|| candle_core::Error::Msg("kolo block recompute: a parameter got no gradient".into()))?;
            gv.to_dtype(DType::F32)?.flatten_all()
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok((g.get(xv.as_tensor()).cloned(), Tensor::cat(&flat, 0)?))
}

impl Gpt {
    pub fn new(cfg: GptConfig, rng: &mut Rng) -> Result<Gpt> {
        let c = cfg.d_model;
        if cfg.n_head == 0 || !c.is_multiple_of(cfg.n_head) {
            return Err(TensorError::Input(format!("d_model {c} is not divisible by n_head {}", cfg.n_head)));
        }
        let mut p = ParamSet::new();
        let std = 0.02;
        let lin = |p: &mut ParamSet, name: &str, out: usize, inp: usize, rng: &mut Rng| -> Result<(usize, usize)> {
            Ok((
                p.add(&format!("{name}.weight"), &[out, inp], normal(rng, out * inp, std))?,
                p.add(&format!("{name}.bias"), &[out], vec![0.0; out])?,
            ))
        };
        let ln = |p: &mut ParamSet, name: &str| -> Result<(usize, usize)> {
            Ok((p.add(&format!("{name}.weight"), &[c], vec![1.0; c])?, p.add(&format!("{name}.bias"), &[c], vec![0.0; c])?))
        };
        let wte = p.add("wte.weight", &[cfg.vocab, c], normal(rng, cfg.vocab * c, std))?;
        let wpe = p.add("wpe.weight", &[cfg.seq, c], normal(rng, cfg.seq * c, std))?;
        if let Some(m) = &cfg.moe {
            m.check().map_err(TensorError::Input)?;
        }
        let mut blocks = Vec::new();
        for i in 0..cfg.n_layer {
            let b = format!("blocks.{i}");
            let ln1 = ln(&mut p, &format!("{b}.ln1"))?;
            let qkv = lin(&mut p, &format!("{b}.attn.qkv"), 3 * c, c, rng)?;
            let proj = lin(&mut p, &format!("{b}.attn.proj"), c, c, rng)?;
            let ln2 = ln(&mut p, &format!("{b}.ln2"))?;
            let ffn = match &cfg.moe {
                None => Ffn::Dense {
                    fc: lin(&mut p, &format!("{b}.fc"), 4 * c, c, rng)?,
                    fc_out: lin(&mut p, &format!("{b}.fc_out"), c, 4 * c, rng)?,
                },
                Some(m) => {
                    let gate = p.add(&format!("{b}.moe.gate.weight"), &[m.experts, c], normal(rng, m.experts * c, std))?;
                    let mut experts = Vec::with_capacity(m.experts);
                    for x in 0..m.experts {
                        let (w1, b1) = lin(&mut p, &format!("{b}.moe.experts.{x}.fc"), 4 * c, c, rng)?;
                        let (w2, b2) = lin(&mut p, &format!("{b}.moe.experts.{x}.fc_out"), c, 4 * c, rng)?;
                        experts.push([w1, b1, w2, b2]);
                    }
                    Ffn::Moe { gate, experts }
                }
            };
            blocks.push(Block { ln1, qkv, proj, ln2, ffn });
        }
        let ln_f = ln(&mut p, "ln_f")?;
        let head = lin(&mut p, "head", cfg.vocab, c, rng)?;
        let checkpointed = vec![false; cfg.n_layer];
        Ok(Gpt { cfg, params: p, wte, wpe, blocks, ln_f, head, checkpointed, tp: None, sp: None, ep: None, moe_load: Default::default() })
    }

    /// This member's piece of the model under Megatron tensor parallelism over `group`: the
    /// same initial values as [`Gpt::new`] with the same generator, cut so that each member
    /// holds n_head / size heads and 4 d_model / size MLP features of every block.
    pub fn new_tensor_parallel(cfg: GptConfig, rng: &mut Rng, group: Arc<dyn kolo_base::GroupSum>) -> Result<Gpt> {
        if cfg.moe.is_some() {
            return Err(TensorError::Input(
                "tensor parallelism of a mixture-of-experts GPT is not supported (use expert parallelism)".into(),
            ));
        }
        let full = Gpt::new(cfg, rng)?;
        let (r, n) = (group.rank(), group.size());
        if n == 0 || !full.cfg.n_head.is_multiple_of(n) {
            return Err(TensorError::Input(format!("{} attention heads do not split over {n} tensor-parallel ranks", full.cfg.n_head)));
        }
        let mut cuts = vec![super::tp::Cut::Whole; full.params.len()];
        for b in &full.blocks {
            for (i, cut) in b.ids().iter().zip(super::tp::BLOCK_CUTS) {
                cuts[*i] = cut;
            }
        }
        // Vocabulary-parallel embedding and head.
        for i in [full.wte, full.head.0, full.head.1] {
            cuts[i] = super::tp::Cut::Vocab;
        }
        if full.cfg.vocab < n {
            return Err(TensorError::Input(format!("a vocabulary of {} does not split over {n} tensor-parallel ranks", full.cfg.vocab)));
        }
        let (params, map) = super::tp::shard_params(&full.params, &cuts, r, n)?;
        let full_len = full.params.numel();
        Ok(Gpt { params, tp: Some(TensorParallel { group, cuts, map, full_len }), ..full })
    }

    /// Sequence parallelism over `ring`: from now on the model takes chunk `ring.rank()` of
    /// every sequence (positions `rank * t ..`), and attention passes keys and values around the
    /// ring. Parameters stay whole (replicated on every member).
    pub fn set_sequence_parallel(&mut self, ring: Arc<dyn kolo_base::RingShift>) -> Result<()> {
        if self.tp.is_some() || self.checkpointed.iter().any(|c| *c) || self.cfg.moe.is_some() {
            return Err(TensorError::Input(
                "sequence parallelism does not combine with tensor parallelism, ZeRO-3, activation checkpointing or mixture of experts yet"
                    .into(),
            ));
        }
        self.sp = Some(ring);
        Ok(())
    }

    /// Under tensor parallelism: writes this member's values into `out` (the whole model's flat
    /// layout, `full_len` long): its pieces of the cut parameters, and the replicated ones on
    /// member 0 only, so that a sum over the group assembles the whole model.
    pub fn tp_pieces_into(&self, local: &[f32], out: &mut [f32]) -> Result<()> {
        let Some(tp) = &self.tp else { return Err(TensorError::Input("not a tensor-parallel model".into())) };
        for (i, p) in self.params.iter().enumerate() {
            if tp.cuts[i] == super::tp::Cut::Whole && tp.group.rank() != 0 {
                continue;
            }
            tp.map.scatter(local, p.range.clone(), out);
        }
        Ok(())
    }

    /// Values in the whole (unsplit) model: differs from `params().numel()` under tensor or expert parallelism.
    pub fn full_numel(&self) -> usize {
        match (&self.tp, &self.ep) {
            (Some(t), _) => t.full_len,
            (_, Some(e)) => e.full_len,
            _ => self.params.numel(),
        }
    }

    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// A copy with its own parameters holding the same values (a new weight version for
    /// PipeDream-2BW: the old one stays intact for the micro-batches still using it).
    pub fn fork(&self) -> Result<Gpt> {
        let values = self.params.to_flat()?;
        let mut params = ParamSet::new();
        for p in self.params.iter() {
            params.add(&p.name, &p.shape, values[p.range.clone()].to_vec())?;
        }
        Ok(Gpt {
            cfg: self.cfg.clone(),
            params,
            wte: self.wte,
            wpe: self.wpe,
            blocks: self.blocks.clone(),
            ln_f: self.ln_f,
            head: self.head,
            checkpointed: self.checkpointed.clone(),
            tp: self.tp.clone(),
            sp: self.sp.clone(),
            ep: self.ep.clone(),
            moe_load: Default::default(),
        })
    }
}

impl Gpt {
    fn set_checkpointing_blocks(&mut self, blocks: &[usize]) -> Result<()> {
        if let Some(bad) = blocks.iter().find(|&&i| i >= self.cfg.n_layer) {
            return Err(TensorError::Input(format!(
                "activation checkpointing: block {bad} does not exist (the model has {} blocks)",
                self.cfg.n_layer
            )));
        }
        self.checkpointed = (0..self.cfg.n_layer).map(|i| blocks.contains(&i)).collect();
        Ok(())
    }
}

impl Model for Gpt {
    fn params(&self) -> &ParamSet {
        &self.params
    }

    fn set_checkpointing(&mut self, blocks: &[usize]) -> Result<()> {
        self.set_checkpointing_blocks(blocks)
    }

    fn tensor_parallel_splits(&self) -> Option<Vec<Option<super::tp::Split>>> {
        let tp = self.tp.as_ref()?;
        let (r, n) = (tp.group.rank(), tp.group.size());
        // The whole shapes: the piece's with its cut dimension made whole again.
        let whole = |i: usize, cut: super::tp::Cut| -> Vec<usize> {
            let mut shape = self.params.get(i).shape.clone();
            match cut {
                super::tp::Cut::Whole => {}
                super::tp::Cut::Vocab => shape[0] = self.cfg.vocab,
                super::tp::Cut::Rows { .. } => shape[0] *= n,
                super::tp::Cut::Cols => shape[1] *= n,
            }
            shape
        };
        Some(tp.cuts.iter().enumerate().map(|(i, &cut)| super::tp::split_of_cut(&whole(i, cut), cut, r, n)).collect())
    }

    fn tensor_parallel_pieces(&self, local: &[f32]) -> Option<Result<Vec<f32>>> {
        self.tp.as_ref()?;
        let mut out = vec![0f32; self.full_numel()];
        Some(self.tp_pieces_into(local, &mut out).map(|_| out))
    }

    fn tensor_parallel_local(&self, full: &[f32]) -> Option<Result<Vec<f32>>> {
        let tp = self.tp.as_ref()?;
        if full.len() != tp.full_len {
            return Some(Err(TensorError::Input(format!("{} values for a model of {}", full.len(), tp.full_len))));
        }
        Some(Ok(tp.map.gather(full)))
    }

    fn param_groups(&self) -> Vec<Vec<usize>> {
        self.blocks.iter().map(|b| b.ids().to_vec()).collect()
    }

    fn forward(&self, input: &Input, view: &dyn ParamView) -> Result<Tensor> {
        let logits = self.forward_aux(input, view, None)?;
        match &self.tp {
            Some(tp) => super::tp::gather_logits(&logits, self.cfg.vocab, &*tp.group),
            None => Ok(logits),
        }
    }

    /// Cross-entropy plus the MoE blocks' auxiliary load-balancing losses.
    fn loss(&self, batch: &super::Batch, view: &dyn ParamView) -> Result<Tensor> {
        let mut aux = Vec::new();
        let logits = self.forward_aux(&batch.input, view, Some(&mut aux))?;
        let mut loss = self.logits_loss(&logits, &batch.targets)?;
        for a in aux {
            loss = (loss + a)?;
        }
        Ok(loss)
    }

    fn take_moe_load(&self) -> Option<super::moe::MoeLoad> {
        self.cfg.moe.as_ref()?;
        Some(std::mem::take(&mut *self.moe_load.lock().unwrap_or_else(|e| e.into_inner())))
    }

    fn expert_params(&self) -> Option<Vec<bool>> {
        Some(self.ep.as_ref()?.expert.clone())
    }
}

impl Gpt {
    fn forward_aux(&self, input: &Input, view: &dyn ParamView, aux: Option<&mut Vec<Tensor>>) -> Result<Tensor> {
        let Input::Tokens { ids, b, t } = input else {
            return Err(TensorError::Input("the GPT takes token sequences".into()));
        };
        self.forward_layers_aux(StageInput::Tokens { ids, b: *b, t: *t }, 0..self.layers(), view, aux)
    }

    /// Mean cross-entropy of the head's output from [`Gpt::forward_layers`] (under tensor
    /// parallelism this member's vocabulary range of the logits) against `targets`.
    pub fn logits_loss(&self, logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
        match &self.tp {
            Some(tp) => super::tp::vocab_parallel_cross_entropy(
                logits,
                targets,
                super::tp::vocab_range(self.cfg.vocab, tp.group.size(), tp.group.rank()),
                &tp.group,
            ),
            None => super::targets_loss(logits, targets),
        }
    }

    /// This member's part of a mixture-of-experts GPT under expert parallelism over `group`:
    /// the same initial values as [`Gpt::new`] with the same generator, keeping every expert
    /// of the group's member `group.rank()` (experts / size consecutive ones per MoE block) and
    /// every parameter outside the experts.
    pub fn new_expert_parallel(cfg: GptConfig, rng: &mut Rng, group: Arc<dyn kolo_base::Exchange>) -> Result<Gpt> {
        let Some(m) = cfg.moe.clone() else {
            return Err(TensorError::Input("expert parallelism needs a mixture-of-experts GPT (model.experts)".into()));
        };
        let (r, n) = (group.rank(), group.size());
        if n == 0 || !m.experts.is_multiple_of(n) {
            return Err(TensorError::Input(format!("{} experts do not split evenly over {n} expert-parallel ranks", m.experts)));
        }
        let el = m.experts / n;
        let full = Gpt::new(cfg, rng)?;
        let values = full.params.to_flat()?;
        // Which of the whole model's parameters this member keeps.
        let mut keep = vec![true; full.params.len()];
        for b in &full.blocks {
            if let Ffn::Moe { experts, .. } = &b.ffn {
                for (x, ids) in experts.iter().enumerate() {
                    if x / el != r {
                        ids.iter().for_each(|&i| keep[i] = false);
                    }
                }
            }
        }
        let mut is_expert = vec![false; full.params.len()];
        for b in &full.blocks {
            if let Ffn::Moe { experts, .. } = &b.ffn {
                experts.iter().flatten().for_each(|&i| is_expert[i] = true);
            }
        }
        let mut params = ParamSet::new();
        let mut new_id = vec![usize::MAX; full.params.len()];
        let (mut map, mut expert) = (super::IndexRuns::default(), Vec::new());
        for (i, p) in full.params.iter().enumerate() {
            if keep[i] {
                new_id[i] = params.add(&p.name, &p.shape, values[p.range.clone()].to_vec())?;
                map.extend(p.range.clone());
                expert.push(is_expert[i]);
            }
        }
        let id = |i: usize| new_id[i];
        let pair = |(a, b): (usize, usize)| (id(a), id(b));
        let blocks = full
            .blocks
            .iter()
            .map(|b| Block {
                ln1: pair(b.ln1),
                qkv: pair(b.qkv),
                proj: pair(b.proj),
                ln2: pair(b.ln2),
                ffn: match &b.ffn {
                    Ffn::Dense { fc, fc_out } => Ffn::Dense { fc: pair(*fc), fc_out: pair(*fc_out) },
                    Ffn::Moe { gate, experts } => {
                        Ffn::Moe { gate: id(*gate), experts: experts[r * el..(r + 1) * el].iter().map(|e| e.map(id)).collect() }
                    }
                },
            })
            .collect();
        let full_len = full.params.numel();
        Ok(Gpt {
            wte: id(full.wte),
            wpe: id(full.wpe),
            ln_f: pair(full.ln_f),
            head: pair(full.head),
            blocks,
            params,
            ep: Some(ExpertParallel { group, map, expert, full_len }),
            cfg: full.cfg,
            checkpointed: full.checkpointed,
            tp: None,
            sp: None,
            moe_load: Default::default(),
        })
    }

    /// Under expert parallelism: this rank's values (its shared parameters and its experts)
    /// taken from the whole model's flat layout `full` (the inverse of [`Gpt::ep_pieces_into`]:
    /// a checkpoint of whole tensors loaded into an expert-parallel model).
    pub fn ep_local_from(&self, full: &[f32]) -> Result<Vec<f32>> {
        let Some(ep) = &self.ep else { return Err(TensorError::Input("not an expert-parallel model".into())) };
        if full.len() != ep.full_len {
            return Err(TensorError::Input(format!("{} values for a model of {}", full.len(), ep.full_len)));
        }
        Ok(ep.map.gather(full))
    }

    /// Under expert parallelism: writes `local` (this member's values) into `out`, the whole
    /// model's flat layout: its experts when `experts`, the parameters outside the experts when
    /// `shared`, so that a sum over the ranks that write each part assembles the whole model.
    pub fn ep_pieces_into(&self, local: &[f32], out: &mut [f32], experts: bool, shared: bool) -> Result<()> {
        let Some(ep) = &self.ep else { return Err(TensorError::Input("not an expert-parallel model".into())) };
        for (i, p) in self.params.iter().enumerate() {
            if (ep.expert[i] && experts) || (!ep.expert[i] && shared) {
                ep.map.scatter(local, p.range.clone(), out);
            }
        }
        Ok(())
    }
}

/// Where a pipeline stage of the GPT starts: token ids (the first stage) or the hidden states
/// (b, t, d_model) the previous stage produced.
pub enum StageInput<'a> {
    Tokens { ids: &'a [u32], b: usize, t: usize },
    Hidden(Tensor),
}

impl Gpt {
    /// Layers a pipeline may cut between: 0 is the token and position embedding, 1..=n_layer the
    /// blocks, n_layer + 1 the final norm and the head.
    pub fn layers(&self) -> usize {
        self.cfg.n_layer + 2
    }

    /// The parameters (indices into [`Model::params`]) of layer `l`.
    pub fn layer_params(&self, l: usize) -> Vec<usize> {
        match l {
            0 => vec![self.wte, self.wpe],
            l if l <= self.cfg.n_layer => self.blocks[l - 1].ids().to_vec(),
            _ => vec![self.ln_f.0, self.ln_f.1, self.head.0, self.head.1],
        }
    }

    /// A pipeline stage's model: frees the values of every parameter outside `layers` (their
    /// names, shapes and ranges stay; reading one is an error), so a stage holds its own
    /// layers only.
    pub fn keep_layers(&mut self, layers: std::ops::Range<usize>) -> Result<()> {
        let own: std::collections::HashSet<usize> = layers.flat_map(|l| self.layer_params(l)).collect();
        for i in 0..self.params.len() {
            if !own.contains(&i) {
                self.params.release(i)?;
            }
        }
        Ok(())
    }

    /// Multiply-adds per token of each layer: what the stage planner balances.
    pub fn layer_costs(&self) -> Vec<f64> {
        let (c, t, v) = (self.cfg.d_model as f64, self.cfg.seq as f64, self.cfg.vocab as f64);
        let block = 12.0 * c * c + 2.0 * t * c;
        std::iter::once(c).chain(std::iter::repeat_n(block, self.cfg.n_layer)).chain(std::iter::once(c * v + c)).collect()
    }

    /// Runs layers `layers` (see [`Gpt::layers`]): from token ids when the range starts at 0,
    /// else from hidden states; returns hidden states (b, t, d_model), or the logits
    /// (b * t, vocab) when the range ends with the head.
    pub fn forward_layers(&self, input: StageInput<'_>, layers: std::ops::Range<usize>, view: &dyn ParamView) -> Result<Tensor> {
        self.forward_layers_aux(input, layers, view, None)
    }

    /// [`Gpt::forward_layers`]; when training (`aux` given) each MoE block's auxiliary loss is
    /// pushed onto `aux` and its routing counted.
    fn forward_layers_aux(
        &self,
        input: StageInput<'_>,
        layers: std::ops::Range<usize>,
        view: &dyn ParamView,
        mut aux: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        if layers.is_empty() || layers.end > self.layers() {
            return Err(TensorError::Input(format!("layers {layers:?} of a GPT with {} layers", self.layers())));
        }
        let c = self.cfg.d_model;
        let h = self.cfg.n_head;
        let g = |i: usize| view.get(&self.params, i);
        let pair = |(w, bias): (usize, usize)| -> Result<(Tensor, Tensor)> { Ok((g(w)?, g(bias)?)) };
        let mut x = match (input, layers.start) {
            (StageInput::Tokens { ids, b, t }, 0) => {
                // Under sequence parallelism `t` is this rank's chunk, at positions rank * t ..
                let offset = self.sp.as_ref().map_or(0, |r| r.rank() * t);
                if t == 0 || offset + t > self.cfg.seq {
                    return Err(TensorError::Input(format!("sequence positions {offset}..{} are not in 0..{}", offset + t, self.cfg.seq)));
                }
                if ids.len() != b * t {
                    return Err(TensorError::Input(format!("{} token ids for {b} sequences of {t}", ids.len())));
                }
                if let Some(bad) = ids.iter().find(|i| **i as usize >= self.cfg.vocab) {
                    return Err(TensorError::Input(format!("token id {bad} is outside the vocabulary of {}", self.cfg.vocab)));
                }
                let tok = match &self.tp {
                    Some(tp) => super::tp::embed(
                        ids,
                        &g(self.wte)?,
                        super::tp::vocab_range(self.cfg.vocab, tp.group.size(), tp.group.rank()),
                        &tp.group,
                    )?,
                    None => {
                        let w = g(self.wte)?;
                        let ids = Tensor::from_slice(ids, b * t, w.device())?;
                        w.index_select(&ids, 0)?
                    }
                }
                .reshape((b, t, c))?;
                let pos = g(self.wpe)?.narrow(0, offset, t)?;
                tok.broadcast_add(&pos)?
            }
            (StageInput::Hidden(x), s) if s > 0 => {
                let (_, _, d) = x.dims3()?;
                if d != c {
                    return Err(TensorError::Input(format!("hidden states of width {d}, the model's is {c}")));
                }
                x
            }
            (StageInput::Tokens { .. }, s) => return Err(TensorError::Input(format!("layer {s} takes hidden states, not tokens"))),
            (StageInput::Hidden(_), _) => return Err(TensorError::Input("layer 0 (the embedding) takes token ids".into())),
        };
        let (b, t, _) = x.dims3()?;
        for (i, (blk, &ckpt)) in self.blocks.iter().zip(&self.checkpointed).enumerate() {
            if !layers.contains(&(i + 1)) {
                continue;
            }
            let moe = self.cfg.moe.as_ref().filter(|_| blk.is_moe());
            if let (Some(m), false) = (moe, ckpt) {
                let p: Vec<Tensor> = blk.ids().iter().map(|&i| g(i)).collect::<Result<_>>()?;
                let (y, a) = block_forward_moe(&x, &p, h, m, self.ep.as_ref().map(|e| &e.group), aux.is_some().then_some(&self.moe_load))?;
                x = y;
                if let Some(v) = aux.as_deref_mut() {
                    v.push(a);
                }
                continue;
            }
            let p: Vec<Tensor> = blk.ids().iter().map(|&i| g(i)).collect::<Result<_>>()?;
            let tp = self.tp.as_ref().map(|t| &t.group);
            if let (Some(group), false) = (tp, ckpt) {
                x = super::tp::block_forward_tp(&x, &p, h / group.size(), group)?;
                continue;
            }
            if let (Some(ring), false) = (&self.sp, ckpt) {
                x = block_forward_with(&x, &p, h, Some(ring))?;
                continue;
            }
            x = if ckpt {
                let joined = crate::checkpoint::join_vars(&p, x.device())?;
                let dt = x.dtype();
                let vars: Vec<Tensor> = blk.ids().iter().map(|&i| self.params.get(i).var.as_tensor().clone()).collect();
                let reread = Reread { vars };
                let heads = h / tp.map_or(1, |g| g.size());
                // Training counts a mixture of experts' routing (here, apart: the op is 'static).
                let load = aux.is_some().then(|| Arc::new(std::sync::Mutex::new(super::moe::MoeLoad::default())));
                let moe_block = moe.map(|m| MoeBlock { cfg: m.clone(), ex: self.ep.as_ref().map(|e| e.group.clone()), load: load.clone() });
                let dtype = p.first().map_or(dt, Tensor::dtype);
                let op = CheckpointedBlock { n_head: heads, tp: tp.cloned(), ring: self.sp.clone(), reread, moe: moe_block, dtype };
                let mut y = x.to_dtype(dtype)?.contiguous()?.apply_op2(&joined, op)?;
                if moe.is_some() {
                    // The hidden states, then the auxiliary loss.
                    let n = b * t * self.cfg.d_model;
                    if let Some(v) = aux.as_deref_mut() {
                        v.push(y.narrow(0, n, 1)?.reshape(())?);
                    }
                    if let Some(l) = load {
                        let l = std::mem::take(&mut *l.lock().unwrap_or_else(|e| e.into_inner()));
                        self.moe_load.lock().unwrap_or_else(|e| e.into_inner()).absorb(l);
                    }
                    y = y.narrow(0, 0, n)?.reshape((b, t, self.cfg.d_model))?;
                }
                y.to_dtype(dt)?
            } else {
                block_forward(&x, &p, h)?
            };
        }
        if layers.end < self.layers() {
            return Ok(x);
        }
        let (lw, lb) = pair(self.ln_f)?;
        let x = layer_norm(&x, &lw, &lb, 1e-5)?;
        let (hw, hb) = pair(self.head)?;
        if let Some(tp) = &self.tp {
            // Vocabulary-parallel head: this member's logits only (f before it).
            let x = x.contiguous()?.apply_op1(super::tp::CopyToGroup(tp.group.clone()))?;
            let v = hw.dim(0)?;
            return Ok(linear(&x, &hw, &hb)?.reshape((b * t, v))?);
        }
        Ok(linear(&x, &hw, &hb)?.reshape((b * t, self.cfg.vocab))?)
    }
}
