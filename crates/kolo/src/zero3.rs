//! ZeRO-3 for a user's candle model: the parameter groups the user names (by name prefix, one
//! per block) live only as shards spread over the ranks. A block's values exist whole only
//! while [`Zero3::block`] computes with them: gathered before its forward and freed after it,
//! gathered again for its backward, which recomputes the block (as an activation-checkpointed
//! block does), and the block's gradient goes straight to the reduce-scatter.
//!
//! candle-nn's layers own their weight tensors, so a sharded block cannot be a layer the model
//! keeps: the user's model runs the block as a function of its parameters instead (building
//! candle-nn layers from them inside is cheap), and the [`crate::Trainer`] takes the group's
//! variables out of the `VarMap`, so that no whole copy stays alive.

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Shape, Tensor, Var};
use kolo_base::ParamGather;
use std::collections::BTreeMap;
use std::sync::Arc;

/// A block's computation: its parameters by their `VarMap` names, and the block's input.
pub type BlockFn = dyn Fn(&BTreeMap<String, Tensor>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// The parameter indices (in the trainer's order of `names`) of each group: the parameters
/// whose names start with the group's prefix. Every prefix must match, and no parameter may
/// fall in two groups.
pub fn plan_groups(names: &[String], prefixes: &[&str]) -> Result<Vec<Vec<usize>>, String> {
    let mut owner: Vec<Option<usize>> = vec![None; names.len()];
    let mut groups = Vec::with_capacity(prefixes.len());
    for (g, prefix) in prefixes.iter().enumerate() {
        let members: Vec<usize> = (0..names.len()).filter(|&i| names[i].starts_with(prefix)).collect();
        if members.is_empty() {
            return Err(format!("ZeRO-3 group \"{prefix}\" matches no parameter of the VarMap"));
        }
        for &i in &members {
            if let Some(other) = owner[i].replace(g) {
                return Err(format!("parameter `{}` is in ZeRO-3 groups \"{}\" and \"{prefix}\"", names[i], prefixes[other]));
            }
        }
        groups.push(members);
    }
    Ok(groups)
}

/// One sharded group: its prefix and its parameters' names and shapes, in packing order.
#[derive(Clone, Debug)]
struct Group {
    prefix: String,
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
}

/// The handle a model runs its sharded blocks through ([`crate::Trainer::zero3`]). Every rank
/// must run the same blocks in the same order (each gather is a collective).
pub struct Zero3 {
    gather: Arc<dyn ParamGather>,
    groups: Vec<Group>,
    /// A one-value variable every block also reads, so that candle records the block (and
    /// calls its backward) even when its input tracks no gradient, as a model's first block's
    /// input does. It never receives a gradient.
    anchor: Var,
}

impl Zero3 {
    pub(crate) fn new(gather: Arc<dyn ParamGather>, prefixes: &[&str], sig: &[(String, Vec<usize>)], plan: &[Vec<usize>]) -> Zero3 {
        let groups = prefixes
            .iter()
            .zip(plan)
            .map(|(p, ids)| Group {
                prefix: p.to_string(),
                names: ids.iter().map(|&i| sig[i].0.clone()).collect(),
                shapes: ids.iter().map(|&i| sig[i].1.clone()).collect(),
            })
            .collect();
        let anchor = Var::zeros(1, candle_core::DType::F32, &Device::Cpu).expect("a one-value CPU variable");
        Zero3 { gather, groups, anchor }
    }

    /// The group prefixes, in the order given to the trainer (the forward order: a block's
    /// forward prefetches the next group, its backward the previous one).
    pub fn groups(&self) -> Vec<String> {
        self.groups.iter().map(|g| g.prefix.clone()).collect()
    }

    /// Runs the block of group `prefix` on `x` (an f32 CPU tensor): `f` receives the group's
    /// whole parameters by name. Collective. `f` runs again in backward, so it must compute
    /// the same thing both times (no dropout of its own).
    pub fn block(
        &self,
        prefix: &str,
        x: &Tensor,
        f: impl Fn(&BTreeMap<String, Tensor>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    ) -> candle_core::Result<Tensor> {
        let Some(group) = self.groups.iter().position(|g| g.prefix == prefix) else {
            candle_core::bail!("no ZeRO-3 group \"{prefix}\" (the trainer's groups: {:?})", self.groups())
        };
        if !x.device().is_cpu() || x.dtype() != candle_core::DType::F32 {
            candle_core::bail!("ZeRO-3 block \"{prefix}\": the input must be an f32 CPU tensor, not {:?} on {:?}", x.dtype(), x.device())
        }
        let op = BlockOp {
            group,
            info: self.groups[group].clone(),
            gather: self.gather.clone(),
            next: (group + 1 < self.groups.len()).then_some(group + 1),
            prev: group.checked_sub(1),
            f: Arc::new(f),
        };
        x.contiguous()?.apply_op2_arc(self.anchor.as_tensor(), Arc::new(Box::new(op)))
    }
}

struct BlockOp {
    group: usize,
    info: Group,
    gather: Arc<dyn ParamGather>,
    next: Option<usize>,
    prev: Option<usize>,
    f: Arc<BlockFn>,
}

impl BlockOp {
    /// The group's whole values, as variables by name (one copy out of the gathered buffer).
    fn params(&self) -> candle_core::Result<BTreeMap<String, Var>> {
        let full = self
            .gather
            .gather(self.group)
            .map_err(|e| candle_core::Error::Msg(format!("ZeRO-3 gather of group \"{}\": {e}", self.info.prefix)))?;
        let mut at = 0;
        let mut out = BTreeMap::new();
        for (name, shape) in self.info.names.iter().zip(&self.info.shapes) {
            let n: usize = shape.iter().product();
            out.insert(name.clone(), Var::from_slice(&full[at..at + n], shape.as_slice(), &Device::Cpu)?);
            at += n;
        }
        Ok(out)
    }
}

impl CustomOp2 for BlockOp {
    fn name(&self) -> &'static str {
        "kolo-user-zero3-block"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(v) = storage else { candle_core::bail!("ZeRO-3 block \"{}\": f32 inputs only", self.info.prefix) };
        let (a, b) = layout.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("ZeRO-3 block: strided input".into()))?;
        let x = Tensor::from_slice(&v[a..b], layout.shape(), &Device::Cpu)?;
        if let Some(g) = self.next {
            self.gather.prefetch(g);
        }
        // The parameters as variables, as in the backward's recomputation: candle-nn's fused
        // kernels (which run on untracked inputs) differ from its differentiable compositions
        // in the last bits, and the recomputed forward must be this forward.
        let params: BTreeMap<String, Tensor> = self.params()?.into_iter().map(|(k, v)| (k, v.as_tensor().clone())).collect();
        let y = (self.f)(&params, &x)?.detach().to_dtype(candle_core::DType::F32)?.contiguous()?;
        let shape = y.shape().clone();
        Ok((CpuStorage::F32(y.flatten_all()?.to_vec1::<f32>()?), shape))
    }

    fn bwd(&self, x: &Tensor, _anchor: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let wants_x = x.track_op();
        if let Some(g) = self.prev {
            self.gather.prefetch(g);
        }
        // Recompute the block with its inputs and parameters as variables, then differentiate.
        let x = Var::from_tensor(&x.detach())?;
        let params = self.params()?;
        let tensors: BTreeMap<String, Tensor> = params.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
        let y = (self.f)(&tensors, x.as_tensor())?.to_dtype(candle_core::DType::F32)?;
        let grads = (y * grad.detach())?.sum_all()?.backward()?;
        let mut packed = Vec::with_capacity(self.info.shapes.iter().map(|s| s.iter().product::<usize>()).sum());
        for name in &self.info.names {
            let v = &params[name];
            match grads.get(v.as_tensor()) {
                Some(g) => packed.extend(g.flatten_all()?.to_vec1::<f32>()?),
                None => packed.extend(std::iter::repeat_n(0f32, v.elem_count())),
            }
        }
        drop(tensors);
        drop(params);
        self.gather.group_grad_ready(self.group, &packed);
        let gx = match grads.get(x.as_tensor()) {
            Some(g) if wants_x => Some(g.clone()),
            None if wants_x => Some(x.as_tensor().zeros_like()?),
            _ => None,
        };
        Ok((gx, None))
    }
}

#[cfg(test)]
mod tests {
    use super::plan_groups;

    #[test]
    fn groups_are_the_parameters_under_each_prefix() {
        let names: Vec<String> =
            ["emb.weight", "h.0.fc.bias", "h.0.fc.weight", "h.1.fc.bias", "h.1.fc.weight", "h.10.fc.weight", "head.weight"]
                .iter()
                .map(|s| s.to_string())
                .collect();
        assert_eq!(plan_groups(&names, &["h.0.", "h.1."]).unwrap(), vec![vec![1, 2], vec![3, 4]]);
        assert_eq!(plan_groups(&names, &[]).unwrap(), Vec::<Vec<usize>>::new());
        let e = plan_groups(&names, &["h.2."]).unwrap_err();
        assert!(e.contains("\"h.2.\" matches no parameter"), "{e}");
        let e = plan_groups(&names, &["h.1", "h.10."]).unwrap_err();
        assert!(e.contains("`h.10.fc.weight` is in ZeRO-3 groups \"h.1\" and \"h.10.\""), "{e}");
    }
}
