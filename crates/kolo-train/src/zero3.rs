//! ZeRO-3 for an unchanged candle model, as torch's FSDP does it: the parameter groups the user
//! names (by name prefix, one per block) live as shards spread over the ranks, and the model's
//! own variables hold their whole values only while they are used.
//!
//! Each sharded variable's storage is emptied and given a hook (the vendored candle-core's
//! `Tensor::set_storage_hook`) that runs before any operation reads it, through the variable
//! or any view of it. The hook gathers the variable's whole group into the variables' storage
//! (one all-gather of the group's bucket), so candle-nn and candle-transformers layers that
//! keep their weights compute with the right values without a line changed. Groups are freed
//! again least recently used first, so at most [`KEEP`] groups are whole at once: a forward
//! pass gathers each block as it reaches it, backward gathers it again when it needs the
//! weights for a gradient (candle keeps the activations: there is no recomputation), and the
//! optimizer step, which changes the shards, frees every group.
//!
//! Gathers are collectives: every rank must read the sharded variables in the same order,
//! which holds when every rank runs the same model code on the training thread. A sharded
//! variable read from another thread, or by one rank only, fails the gather at its deadline.

use candle_core::{CpuStorage, DType, Storage, Var};
use kolo_base::ParamGather;
use std::sync::{Arc, Mutex, MutexGuard};

/// How many groups may be whole at once (the one in use and the one before it: a block's
/// forward often reads the next block's first weight while the previous block's output is
/// still being combined, as FSDP's default limit of two all-gathers in flight).
pub const KEEP: usize = 2;

/// The parameter indices (in the trainer's order of `names`) of each group: the parameters
/// whose names start with the group's prefix. Every prefix must match, and no parameter may
/// fall in two groups.
pub fn plan_groups(names: &[String], prefixes: &[&str]) -> std::result::Result<Vec<Vec<usize>>, String> {
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

/// The groups whose whole values to free when `current` has just been gathered: the least
/// recently used resident groups beyond the `keep` most recent, `current` among those kept.
/// `used[g]` is `None` for a group that is not whole, else when it was last read.
pub fn plan_eviction(used: &[Option<u64>], current: usize, keep: usize) -> Vec<usize> {
    let mut resident: Vec<(u64, usize)> =
        used.iter().enumerate().filter(|&(g, u)| g != current && u.is_some()).map(|(g, u)| (u.unwrap_or(0), g)).collect();
    resident.sort_unstable();
    let n_free = (resident.len() + 1).saturating_sub(keep.max(1));
    resident.into_iter().take(n_free).map(|(_, g)| g).collect()
}

/// A ZeRO-3 failure: the operation (the call that set up the groups, a gather or a release)
/// and why. Callers add the rank (`kolo::Error::Usage`, `kolo train`'s error).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Zero3Error {
    /// The call that failed (`ZeRO-3 gather`, `ZeRO-3 release`, or the caller's set-up).
    pub op: &'static str,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for Zero3Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.op, self.reason)
    }
}

type Result<T> = std::result::Result<T, Zero3Error>;

/// One sharded group: its prefix, the model's variables in packing order, and which of them
/// hold their whole values now.
struct Group {
    prefix: String,
    names: Vec<String>,
    vars: Vec<Var>,
    whole: Vec<bool>,
    /// When the group was last read (`None`: not whole).
    used: Option<u64>,
}

struct State {
    groups: Vec<Group>,
    clock: u64,
    /// The group gathered last (the direction of the pass: a larger group is forward).
    last: Option<usize>,
    /// Prefetch the neighbour of each gathered group (only inside a training step, whose update
    /// completes the gathers left in flight before anything else uses the communicator).
    prefetch: bool,
    /// Every group stays whole until the next [`Zero3::release_all`] (the library's `Trainer::unshard`).
    pinned: bool,
    /// The first failed gather, reported by the trainer.
    error: Option<String>,
    /// Gathers done (prefetched or not), for tests and reports.
    gathers: u64,
}

struct Inner {
    gather: Arc<dyn ParamGather>,
    state: Mutex<State>,
}

/// The sharded groups of a model under ZeRO-3 (the library's `Trainer`'s: a user's model, `kolo
/// train`'s GPT).
pub struct Zero3 {
    inner: Arc<Inner>,
}

impl Zero3 {
    /// Takes over the model's variables of each group (`groups[g]`: the names and variables of
    /// group `g` in packing order, under `prefixes[g]`): their storage is freed and filled on
    /// use. `call` names the caller in errors.
    pub fn new(gather: Arc<dyn ParamGather>, prefixes: &[&str], groups: Vec<Vec<(String, Var)>>, call: &'static str) -> Result<Zero3> {
        let mut state = State { groups: Vec::new(), clock: 0, last: None, prefetch: false, pinned: false, error: None, gathers: 0 };
        for (prefix, members) in prefixes.iter().zip(groups) {
            for (name, v) in &members {
                let float = matches!(v.dtype(), DType::F32 | DType::BF16 | DType::F16);
                if !v.device().is_cpu() || !float || !v.is_contiguous() || v.layout().start_offset() != 0 {
                    return Err(Zero3Error {
                        op: call,
                        reason: format!("group \"{prefix}\": parameter `{name}` is not a contiguous f32, bf16 or f16 CPU variable"),
                    });
                }
            }
            let n = members.len();
            let (names, vars) = members.into_iter().unzip();
            state.groups.push(Group { prefix: prefix.to_string(), names, vars, whole: vec![true; n], used: Some(0) });
        }
        let inner = Arc::new(Inner { gather, state: Mutex::new(state) });
        let z = Zero3 { inner };
        let st = z.inner.lock();
        for (g, group) in st.groups.iter().enumerate() {
            for (v, var) in group.vars.iter().enumerate() {
                let weak = Arc::downgrade(&z.inner);
                var.set_storage_hook(Some(Arc::new(move || {
                    if let Some(inner) = weak.upgrade() {
                        inner.ensure(g, v)
                    }
                })));
            }
        }
        drop(st);
        z.release_all()?;
        Ok(z)
    }

    /// Frees every group's whole values (after the optimizer step changed the shards, or a
    /// resume). Nothing may be reading a sharded variable.
    pub fn release_all(&self) -> Result<()> {
        let mut st = self.inner.lock();
        for g in 0..st.groups.len() {
            if !release(&mut st.groups[g]) {
                let reason = format!("group \"{}\": a variable is still being read and cannot be freed", st.groups[g].prefix);
                return Err(Zero3Error { op: "ZeRO-3 release", reason });
            }
        }
        st.last = None;
        st.pinned = false;
        Ok(())
    }

    /// Gathers every group and keeps them all whole until [`Zero3::release_all`]. Collective.
    pub fn gather_all(&self) -> Result<()> {
        let n = {
            let mut st = self.inner.lock();
            st.pinned = true;
            st.groups.len()
        };
        for g in 0..n {
            let n_vars = self.inner.lock().groups[g].vars.len();
            for v in 0..n_vars {
                self.inner.ensure(g, v);
            }
        }
        self.take_error()
    }

    /// Whether gathers may prefetch the next group (inside a training step).
    pub fn set_prefetch(&self, on: bool) {
        self.inner.lock().prefetch = on;
    }

    /// The first gather that failed since the last call (a hook cannot fail the operation
    /// that triggered it; its variables were filled with NaN instead).
    pub fn take_error(&self) -> Result<()> {
        match self.inner.lock().error.take() {
            Some(e) => Err(Zero3Error {
                op: "ZeRO-3 gather",
                reason: format!(
                    "{e} (a group is gathered, collectively, when the model first reads one of its variables: every rank must run the same forward and backward passes, evaluation and sampling included)"
                ),
            }),
            None => Ok(()),
        }
    }

    /// Gathers done so far, and how many groups are whole now.
    pub fn stats(&self) -> (u64, usize) {
        let st = self.inner.lock();
        (st.gathers, st.groups.iter().filter(|g| g.used.is_some()).count())
    }
}

impl Drop for Zero3 {
    fn drop(&mut self) {
        // Whole variables keep their values and lose their hooks. An empty one can no longer be
        // gathered: should the model read it, its hook says so once and fills it with NaN (an
        // empty storage must never be read: candle's kernels index it unchecked).
        for g in &self.inner.lock().groups {
            for ((name, v), whole) in g.names.iter().zip(&g.vars).zip(&g.whole) {
                if *whole {
                    v.set_storage_hook(None);
                    continue;
                }
                let (name, var) = (name.clone(), v.clone());
                v.set_storage_hook(Some(Arc::new(move || {
                    kolo_base::eline!(
                        "kolo: ZeRO-3 parameter `{name}` was read after its ZeRO-3 trainer was dropped; its values lived as shards and are gone, so it reads as NaN (call Trainer::unshard before dropping a library Trainer)"
                    );
                    let nan = vec![f32::NAN; var.elem_count()];
                    if var.replace_storage(Storage::Cpu(storage_in(var.dtype(), nan))).is_ok() {
                        var.set_storage_hook(None);
                    }
                })));
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The storage hook of variable `v` of group `g`: gathers the group if that variable is
    /// not whole, prefetches the neighbour in the pass's direction, and frees the groups
    /// beyond [`KEEP`].
    fn ensure(&self, g: usize, v: usize) {
        let mut st = self.lock();
        st.clock += 1;
        let now = st.clock;
        if st.groups[g].whole[v] {
            st.groups[g].used = Some(now);
            return;
        }
        let forward = st.last.is_none_or(|l| g >= l);
        st.last = Some(g);
        st.gathers += 1;
        let got = self.gather.gather(g);
        let group = &mut st.groups[g];
        let failure = fill(group, got.as_deref().map_err(String::clone));
        if let Err(e) = failure {
            let e = format!("group \"{}\": {e}", group.prefix);
            st.error.get_or_insert(e);
        }
        st.groups[g].used = Some(now);
        if st.prefetch && st.error.is_none() {
            let next = if forward { g + 1 } else { g.wrapping_sub(1) };
            if next < st.groups.len() && st.groups[next].used.is_none() {
                self.gather.prefetch(next);
            }
        }
        if !st.pinned {
            let used: Vec<Option<u64>> = st.groups.iter().map(|g| g.used).collect();
            for victim in plan_eviction(&used, g, KEEP) {
                // A variable still being read (an operation holding it while it reads another
                // group's) stays whole: it holds the right values until the next update.
                release(&mut st.groups[victim]);
            }
        }
    }
}

/// Fills the group's variables that are not whole from `full` (the group's packed values), or
/// with NaN when the gather failed (the operation that triggered it must read something; the
/// trainer reports the error before any update).
fn fill(group: &mut Group, full: std::result::Result<&[f32], String>) -> std::result::Result<(), String> {
    let total: usize = group.vars.iter().map(|v| v.elem_count()).sum();
    let (values, failure) = match full {
        Ok(f) if f.len() == total => (Some(f), Ok(())),
        Ok(f) => (None, Err(format!("{} values gathered for {total}", f.len()))),
        Err(e) => (None, Err(e)),
    };
    let mut at = 0;
    for (var, whole) in group.vars.iter().zip(group.whole.iter_mut()) {
        let n = var.elem_count();
        if !*whole {
            let v = values.map_or_else(|| vec![f32::NAN; n], |f| f[at..at + n].to_vec());
            if let Err(e) = var.replace_storage(Storage::Cpu(storage_in(var.dtype(), v))) {
                return Err(e.to_string());
            }
            *whole = true;
        }
        at += n;
    }
    failure
}

/// The f32 values `v` in a variable of `dtype`: a mixed-precision model's bf16/f16 variables
/// are filled with their f32 masters rounded once, as the trainer publishes them.
fn storage_in(dtype: DType, v: Vec<f32>) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// Frees the group's whole values; `false` if a variable was being read (it stays whole).
fn release(group: &mut Group) -> bool {
    let mut all = true;
    for (var, whole) in group.vars.iter().zip(group.whole.iter_mut()) {
        if *whole {
            match var.try_release_storage() {
                Ok(true) => *whole = false,
                _ => all = false,
            }
        }
    }
    if all {
        group.used = None;
    }
    all
}

#[cfg(test)]
mod tests {
    use super::{plan_eviction, plan_groups};

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

    #[test]
    fn the_least_recently_used_groups_beyond_keep_are_freed() {
        // Groups 0, 2 and 3 whole (3 most recent), 1 just gathered.
        let used = [Some(5), None, Some(7), Some(9)];
        assert_eq!(plan_eviction(&used, 1, 2), vec![0, 2]);
        assert_eq!(plan_eviction(&used, 1, 3), vec![0]);
        assert_eq!(plan_eviction(&used, 1, 4), Vec::<usize>::new());
        // keep 0 or 1: only the current group stays.
        assert_eq!(plan_eviction(&used, 1, 0), vec![0, 2, 3]);
        assert_eq!(plan_eviction(&[None, None], 0, 2), Vec::<usize>::new());
        // The current group's own entry never counts against it.
        assert_eq!(plan_eviction(&[Some(1), Some(2)], 0, 1), vec![1]);
    }
}
