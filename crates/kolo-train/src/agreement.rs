//! Every rank must train the same job (issue #19: ranks started with a different `n_head`,
//! optimizer or learning rate used to train to the end, rc = 0, while their replicas diverged).
//!
//! The config is flattened to `section.field = value` lines ([`settings`], pure), leaving out
//! what may differ per rank (where it reads, writes and listens). At start-up the ranks compare a
//! hash of the lines; on a difference rank 0 broadcasts its lines, every rank finds its first
//! differing field, the ranks all-gather those, and every rank fails naming each differing rank
//! and field with both values.

use crate::config::Config;
use crate::TrainError;
use kolo_comm::{BufMut, BufRef, Communicator, ReduceOp};

/// Settings that may differ between ranks: local paths, ports, the device, progress display,
/// the deadline and `[fed]`/`[ps]` addresses.
const PER_RANK: &[&str] = &[
    "data.path",
    "data.prefetch",
    "optim.offload_dir",
    "train.json_log",
    "train.checkpoint_dir",
    "train.tensorboard_dir",
    "train.timeline_dir",
    "train.metrics_port",
    "train.metrics_addr",
    "train.progress",
    "train.device",
    "ddp.timeout_secs",
    "ddp.liveness_secs",
    "ps.coordinator",
];

/// The settings every rank must share, as sorted `(field, value)` pairs.
pub fn settings(cfg: &Config) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let value = serde_json::to_value(cfg).expect("the config serialises");
    flatten("", &value, &mut out);
    out.retain(|(k, _)| !PER_RANK.contains(&k.as_str()) && !k.starts_with("fed."));
    out.sort();
    out
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, x, out);
            }
        }
        // f32 settings arrive as f64: print those that are exact f32 values the way the file
        // wrote them (0.01, not 0.009999999776482582).
        serde_json::Value::Number(x) if x.as_f64().is_some_and(|f| !x.is_i64() && !x.is_u64() && f64::from(f as f32) == f) => {
            out.push((prefix.to_string(), format!("{}", x.as_f64().unwrap_or_default() as f32)))
        }
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

fn text(s: &[(String, String)]) -> String {
    s.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
}

/// The index of the first setting of `mine` that differs from `lead`'s (same sorted keys, or
/// a key one side lacks), `None` when they agree.
pub fn first_difference(mine: &[(String, String)], lead: &[(String, String)]) -> Option<usize> {
    (0..mine.len().max(lead.len())).find(|&i| mine.get(i) != lead.get(i))
}

/// Checks across `comm` that every rank has the same settings; collective (every rank calls
/// it). The error names every rank that differs from rank 0 and the first field where it does.
pub fn check_same_job(cfg: &Config, comm: &dyn Communicator) -> Result<(), TrainError> {
    let (rank, n) = (comm.rank().get(), comm.world_size().get());
    if n == 1 {
        return Ok(());
    }
    let mine = settings(cfg);
    let body = text(&mine);
    let h = (body.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)) >> 1) as i64;
    let mut v = [h, -h];
    comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Max)?;
    if v == [h, -h] {
        return Ok(());
    }
    // Somebody differs: compare with rank 0's settings.
    let mut len = [body.len() as i64];
    comm.broadcast(BufMut::from(&mut len[..]), kolo_base::Rank(0))?;
    let mut lead_bytes = if rank == 0 { body.clone().into_bytes() } else { vec![0u8; len[0].max(0) as usize] };
    comm.broadcast(BufMut::from(&mut lead_bytes[..]), kolo_base::Rank(0))?;
    let lead: Vec<(String, String)> = String::from_utf8_lossy(&lead_bytes)
        .lines()
        .filter_map(|l| l.split_once(" = ").map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
    let at = [first_difference(&mine, &lead).map_or(-1, |i| i as i64)];
    let mut all = vec![0i64; n];
    comm.all_gather(BufRef::from(&at[..]), BufMut::from(&mut all[..]))?;
    // Every rank describes every differing rank by field; rank r's own value is known only to
    // rank r, so each names its own and the others by the field alone.
    let show = |s: &[(String, String)], i: usize| s.get(i).map_or("(missing)".to_string(), |(k, v)| format!("{k} = {v}"));
    let mut lines = Vec::new();
    for (r, &i) in all.iter().enumerate().filter(|(_, i)| **i >= 0) {
        let i = i as usize;
        let field = lead.get(i).or(mine.get(i)).map_or("?", |(k, _)| k.as_str());
        if r == rank {
            lines.push(format!("this rank ({r}) has {}, rank 0 has {}", show(&mine, i), show(&lead, i)));
        } else {
            lines.push(format!("rank {r} differs from rank 0 first at `{field}` (rank 0 has {})", show(&lead, i)));
        }
    }
    Err(TrainError::Config(format!("the ranks were started with different settings: {}", lines.join("; "))))
}

/// What a rank starts from, as the ranks compare it: -1 fresh, the step of a `step-N`
/// checkpoint, or -2 for a checkpoint whose name carries no step.
fn start_code(resume: Option<&std::path::Path>) -> i64 {
    let Some(p) = resume else { return -1 };
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let num = name.strip_prefix("step-").map(|n| n.strip_suffix(".safetensors").unwrap_or(n));
    num.and_then(|n| n.parse::<i64>().ok()).unwrap_or(-2)
}

/// Every rank starts from the same point (issue #34: `--resume` given to one rank only failed
/// later as `collective mismatch: barrier #26 ... all_reduce #26`): the ranks all-gather where
/// they start and, if they differ, every rank fails naming each rank's start.
pub fn check_same_start(resume: Option<&std::path::Path>, comm: &dyn Communicator) -> Result<(), TrainError> {
    let (rank, n) = (comm.rank().get(), comm.world_size().get());
    if n == 1 {
        return Ok(());
    }
    let mine = [start_code(resume)];
    let mut all = vec![0i64; n];
    comm.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut all[..]))?;
    if all.iter().all(|s| *s == all[0]) {
        return Ok(());
    }
    let say = |s: i64| match s {
        -1 => "starts fresh".to_string(),
        -2 => "resumes from a checkpoint".to_string(),
        s => format!("resumes from step {s}"),
    };
    let each: Vec<String> = all.iter().enumerate().map(|(r, s)| format!("rank {r} {}", say(*s))).collect();
    let here = resume.map_or(String::new(), |p| format!(" ({})", p.display()));
    Err(TrainError::Config(format!(
        "the ranks start from different points: {}; this rank ({rank}) {}{here}. Give every rank the same --resume",
        each.join(", "),
        say(mine[0])
    )))
}

/// A fingerprint of the data a rank trains and evaluates on: the splits' sizes, the
/// vocabulary size and the contents of up to 64 examples spread over each split (FNV-1a).
pub fn data_fingerprint(data: &crate::setup::Data) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(&(data.vocab_size as u64).to_le_bytes());
    for ds in [&data.train, &data.eval] {
        let n = ds.len();
        eat(&(n as u64).to_le_bytes());
        let idx: Vec<usize> = (0..n.min(64)).map(|k| k * n / n.min(64)).collect();
        if idx.is_empty() {
            continue;
        }
        let b = ds.batch(&idx);
        match &b.input {
            kolo_tensor::Input::Images { data, .. } => data.iter().for_each(|x| eat(&x.to_bits().to_le_bytes())),
            kolo_tensor::Input::Tokens { ids, .. } => ids.iter().for_each(|x| eat(&x.to_le_bytes())),
        }
        b.targets.iter().for_each(|t| eat(&t.to_le_bytes()));
    }
    h
}

/// Every rank reads the same data (issue #34: `data.path` may differ per rank, and a rank
/// reading a corpus with shifted ids of the same vocabulary size trained silently): the ranks
/// all-gather [`data_fingerprint`] and, if they differ, every rank fails naming the ranks whose
/// data is not rank 0's. Synthetic data (`kind`) is generated per rank and not compared.
pub fn check_same_data(kind: crate::config::DataKind, data: &crate::setup::Data, comm: &dyn Communicator) -> Result<(), TrainError> {
    let n = comm.world_size().get();
    if n == 1 || kind == crate::config::DataKind::Synthetic {
        return Ok(());
    }
    let mine = [data_fingerprint(data) as i64];
    let mut all = vec![0i64; n];
    comm.all_gather(BufRef::from(&mine[..]), BufMut::from(&mut all[..]))?;
    let other: Vec<String> = all.iter().enumerate().filter(|(_, f)| **f != all[0]).map(|(r, _)| format!("rank {r}")).collect();
    if other.is_empty() {
        return Ok(());
    }
    Err(TrainError::Data(format!(
        "{} read other data than rank 0 (the contents of data.path differ; this rank ({}) has {} training examples, fingerprint {:016x}): every rank must read the same corpus",
        other.join(", "),
        comm.rank().get(),
        data.train.len(),
        mine[0] as u64
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_leave_out_per_rank_fields_and_find_the_first_difference() {
        let base = "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"a\"\nbatch_size = 8\n";
        let a = Config::parse(base, "a").unwrap();
        let b = Config::parse(&base.replace("path = \"a\"", "path = \"b\""), "b").unwrap();
        assert_eq!(settings(&a), settings(&b), "data.path may differ");
        let c = Config::parse(&format!("{base}[optim]\nlr = 0.01\n"), "c").unwrap();
        let i = first_difference(&settings(&c), &settings(&a)).unwrap();
        assert_eq!(settings(&a)[i].0, "optim.lr");
        let d = Config::parse(&base.replace("hidden = [32]", "hidden = [64]"), "d").unwrap();
        assert_eq!(settings(&a)[first_difference(&settings(&d), &settings(&a)).unwrap()].0, "model.hidden");
        assert!(settings(&a).iter().any(|(k, _)| k == "optim.kind") && !settings(&a).iter().any(|(k, _)| k == "train.json_log"));
    }
}
