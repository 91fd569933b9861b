//! Bucket plans (pure): which parameters travel together, in the order backward finishes them.

/// A bucket: parameters (indices into the model's parameter list) in the order their gradients
/// complete, packed back to back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub params: Vec<usize>,
    pub numel: usize,
}

/// Groups parameters, last-registered first (the order backward finishes them), into buckets of
/// at most `cap_elems` elements (`first_cap_elems` for the first one); a parameter larger than
/// the cap gets a bucket of its own.
pub fn bucket_plan(numels: &[usize], first_cap_elems: usize, cap_elems: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut cur = Bucket { params: Vec::new(), numel: 0 };
    for i in (0..numels.len()).rev() {
        let cap = if out.is_empty() { first_cap_elems } else { cap_elems };
        if !cur.params.is_empty() && cur.numel + numels[i] > cap {
            out.push(std::mem::replace(&mut cur, Bucket { params: Vec::new(), numel: 0 }));
        }
        cur.params.push(i);
        cur.numel += numels[i];
    }
    if !cur.params.is_empty() {
        out.push(cur);
    }
    out
}

/// ZeRO-3's plan: parameters outside `groups` in ordinary buckets (last first), then one bucket
/// per group, its parameters in the group's order. Returns the plan and each group's bucket.
pub fn grouped_plan(
    numels: &[usize],
    groups: &[Vec<usize>],
    (first_cap, cap): (usize, usize),
) -> Result<(Vec<Bucket>, Vec<usize>), String> {
    let mut in_group = vec![false; numels.len()];
    for g in groups {
        for &p in g {
            if p >= numels.len() || std::mem::replace(&mut in_group[p], true) {
                return Err(format!("parameter group lists parameter {p} twice or out of range ({} parameters)", numels.len()));
            }
        }
    }
    let rest: Vec<usize> = (0..numels.len()).filter(|&p| !in_group[p]).collect();
    let rest_numels: Vec<usize> = rest.iter().map(|&p| numels[p]).collect();
    let mut plan: Vec<Bucket> = bucket_plan(&rest_numels, first_cap, cap)
        .into_iter()
        .map(|b| Bucket { params: b.params.iter().map(|&i| rest[i]).collect(), numel: b.numel })
        .collect();
    let mut group_bucket = Vec::with_capacity(groups.len());
    for g in groups {
        group_bucket.push(plan.len());
        plan.push(Bucket { params: g.clone(), numel: g.iter().map(|&p| numels[p]).sum() });
    }
    Ok((plan, group_bucket))
}
