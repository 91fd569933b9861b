//! Parameter groups (torch's `param_groups`): each parameter's weight decay and learning-rate
//! factor, from `[optim] groups` (first match by name wins) and the default that parameters of
//! fewer than two dimensions (biases, norm scales) are not decayed (`optim.decay_1d = false`), as
//! nanoGPT, Hugging Face's Trainer and Megatron do. Planned per parameter (pure), then laid over
//! the optimizer's elements: the flat layout (DDP) or this rank's shard vector (ZeRO).

use crate::config::OptimConfig;
use kolo_ddp::ShardPlan;
use kolo_optim::{Hyper, Optimizer};
use std::ops::Range;

/// Each parameter's hyperparameters, for parameters `sig` (`(name, shape)` in the trainer's
/// order). Every group must match at least one parameter ([`check_matches`]).
pub fn plan_hypers(sig: &[(String, Vec<usize>)], o: &OptimConfig) -> Result<Vec<Hyper>, String> {
    check_matches(sig, o)?;
    Ok(hypers(sig, o))
}

/// The group of the parameter `name`: the first whose patterns one is part of the name.
fn group_of(name: &str, o: &OptimConfig) -> Option<usize> {
    o.groups.iter().position(|g| g.patterns.iter().any(|p| name.contains(p.as_str())))
}

/// Every group matches at least one of the whole model's parameters `sig` (a rank holding part
/// of the model, a pipeline stage, may hold none of a group's).
pub fn check_matches(sig: &[(String, Vec<usize>)], o: &OptimConfig) -> Result<(), String> {
    let mut used = vec![false; o.groups.len()];
    for (name, _) in sig {
        if let Some(g) = group_of(name, o) {
            used[g] = true;
        }
    }
    match used.iter().position(|u| !u) {
        Some(g) => Err(format!("optim.groups[{g}] (match {:?}) matches no parameter", o.groups[g].patterns)),
        None => Ok(()),
    }
}

/// [`plan_hypers`] without the check: a part of the model's parameters.
fn hypers(sig: &[(String, Vec<usize>)], o: &OptimConfig) -> Vec<Hyper> {
    let hyper = |(name, shape): &(String, Vec<usize>)| match group_of(name, o) {
        Some(g) => {
            let grp = &o.groups[g];
            Hyper { weight_decay: grp.weight_decay.unwrap_or(o.weight_decay), lr_scale: grp.lr_scale }
        }
        None => Hyper { weight_decay: if shape.len() < 2 && !o.decay_1d { 0.0 } else { o.weight_decay }, lr_scale: 1.0 },
    };
    sig.iter().map(hyper).collect()
}

/// The spans of the optimizer's elements: parameter `i` at `ranges[i]` of the flat layout, or
/// under ZeRO at its segments of this rank's shard vector.
pub fn spans(hypers: &[Hyper], ranges: &[Range<usize>], zero: Option<&ShardPlan>) -> Vec<(Range<usize>, Hyper)> {
    let mut out: Vec<(Range<usize>, Hyper)> = match zero {
        None => ranges.iter().zip(hypers).map(|(r, h)| (r.clone(), *h)).collect(),
        Some(z) => z.segments.iter().map(|s| (s.shard_offset..s.shard_offset + s.within.len(), hypers[s.param])).collect(),
    };
    out.sort_by_key(|(r, _)| r.start);
    out
}

/// Gives `opt` (over the flat layout, or this rank's shard with `zero`) the parameter groups
/// of parameters `sig` at `ranges` (this rank's part of the model: whether every group matches
/// a parameter is [`check_matches`]' over the whole model). Nothing changes where every
/// parameter has the spec's decay and no learning-rate factor.
pub fn apply(
    opt: &mut Optimizer,
    sig: &[(String, Vec<usize>)],
    ranges: &[Range<usize>],
    zero: Option<&ShardPlan>,
    o: &OptimConfig,
) -> Result<(), String> {
    let hypers = hypers(sig, o);
    let plain = Hyper { weight_decay: o.weight_decay, lr_scale: 1.0 };
    if hypers.iter().all(|h| *h == plain) {
        return Ok(());
    }
    let n = zero.map_or_else(|| ranges.last().map_or(0, |r| r.end), |z| z.len);
    opt.set_groups(n, spans(&hypers, ranges, zero))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ParamGroupConfig;
    use kolo_base::{Rank, WorldSize};

    fn sig() -> Vec<(String, Vec<usize>)> {
        [
            ("emb.weight", vec![5, 4]),
            ("h.0.fc.weight", vec![4, 4]),
            ("h.0.fc.bias", vec![4]),
            ("h.0.ln.weight", vec![4]),
            ("head.weight", vec![3, 4]),
        ]
        .iter()
        .map(|(n, s)| (n.to_string(), s.clone()))
        .collect()
    }

    #[test]
    fn vectors_are_not_decayed_and_groups_match_by_name_first_wins() {
        let mut o = OptimConfig { weight_decay: 0.1, ..Default::default() };
        let wd = |h: &[Hyper]| h.iter().map(|h| h.weight_decay).collect::<Vec<_>>();
        assert_eq!(wd(&plan_hypers(&sig(), &o).unwrap()), [0.1, 0.1, 0.0, 0.0, 0.1]);
        o.decay_1d = true;
        assert_eq!(wd(&plan_hypers(&sig(), &o).unwrap()), [0.1; 5]);
        o.decay_1d = false;
        o.groups = vec![
            ParamGroupConfig { patterns: vec!["emb".into()], weight_decay: Some(0.0), lr_scale: 0.5 },
            ParamGroupConfig { patterns: vec!["h.0.".into(), "head".into()], weight_decay: None, lr_scale: 2.0 },
        ];
        let h = plan_hypers(&sig(), &o).unwrap();
        assert_eq!(wd(&h), [0.0, 0.1, 0.1, 0.1, 0.1], "a group's decay applies to its vectors too");
        assert_eq!(h.iter().map(|h| h.lr_scale).collect::<Vec<_>>(), [0.5, 2.0, 2.0, 2.0, 2.0]);
        o.groups.push(ParamGroupConfig { patterns: vec!["nothing".into()], weight_decay: None, lr_scale: 1.0 });
        assert!(plan_hypers(&sig(), &o).unwrap_err().contains("optim.groups[2] (match [\"nothing\"]) matches no parameter"));
    }

    #[test]
    fn spans_tile_the_flat_layout_and_every_zero_shard() {
        let o = OptimConfig { weight_decay: 0.1, ..Default::default() };
        let s = sig();
        let numels: Vec<usize> = s.iter().map(|(_, sh)| sh.iter().product()).collect();
        let mut ranges = Vec::new();
        let mut at = 0;
        for n in &numels {
            ranges.push(at..at + n);
            at += n;
        }
        let h = plan_hypers(&s, &o).unwrap();
        let mut opt = Optimizer::new(o.spec(), at);
        apply(&mut opt, &s, &ranges, None, &o).unwrap();
        let buckets = kolo_ddp::bucket_plan(&numels, 40, 40);
        for world in 1..=3 {
            let mut seen = vec![None; at];
            for rank in 0..world {
                let z = ShardPlan::new(&numels, &buckets, WorldSize::new(world).unwrap(), Rank(rank));
                let mut opt = Optimizer::new(o.spec(), z.len);
                apply(&mut opt, &s, &ranges, Some(&z), &o).unwrap();
                for seg in &z.segments {
                    for e in seg.within.clone() {
                        assert!(seen[ranges[seg.param].start + e].replace(h[seg.param]).is_none(), "an element in two shards");
                    }
                }
            }
            assert!(seen.iter().all(|x| x.is_some()), "world {world}: an element in no shard");
        }
    }
}
