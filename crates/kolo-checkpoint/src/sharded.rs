//! Sharded checkpoints that reload at any world size.
//!
//! A checkpoint is a directory:
//!
//! ```text
//! step-00000010/
//!   manifest.json                       every tensor's global shape and where its pieces are
//!   shard-00000-of-00004.safetensors    rank 0's pieces (keys `name@offset`, 1-D)
//!   …
//! ```
//!
//! Each rank writes the pieces it owns (any element ranges of the flattened tensors) with
//! [`write_shard`]; each shard file is an ordinary checksummed Kolo safetensors file. Then one
//! rank calls [`commit`], which reads the shard headers, checks that the pieces tile every tensor
//! exactly once, writes the manifest and renames the staging directory into place. Until that
//! rename nothing is visible under the final name, so a job killed mid-save leaves the previous
//! checkpoint as the latest one. [`load_dir`] assembles whole tensors from whatever pieces
//! exist, so the reader may use any world size and any sharding.

use crate::{load_verified, save, Checkpoint, CheckpointError, Entry};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
const FORMAT: &str = "kolo-sharded-checkpoint";
const VERSION: u32 = 1;
const SHAPE_PREFIX: &str = "kolo.shape.";

/// A piece of one tensor: elements `offset..offset + data.len()` of its row-major flattening.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<usize>,
    pub offset: usize,
    pub data: Vec<f32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub meta: BTreeMap<String, String>,
    pub files: Vec<FileInfo>,
    pub tensors: Vec<TensorInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileInfo {
    pub name: String,
    /// The file's `kolo.sha256` (over its tensors), checked again on load.
    pub sha256: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorInfo {
    pub name: String,
    pub shape: Vec<usize>,
    pub shards: Vec<ShardInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardInfo {
    /// Index into `files`.
    pub file: usize,
    pub offset: usize,
    pub len: usize,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// Where shards are written before [`commit`] makes them visible as `target`.
pub fn staging_dir(target: &Path) -> PathBuf {
    let name = target.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    target.with_file_name(format!(".{name}.partial"))
}

/// One rank, before anyone writes: removes what a killed earlier attempt left and creates the
/// staging directory.
pub fn begin(target: &Path) -> Result<(), CheckpointError> {
    let staging = staging_dir(target);
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io_err(&staging))?;
    }
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))
}

pub fn shard_file_name(index: usize, count: usize) -> String {
    format!("shard-{index:05}-of-{count:05}.safetensors")
}

/// Writes one rank's pieces into the staging directory of `target` (after [`begin`]).
pub fn write_shard(target: &Path, index: usize, count: usize, pieces: &[Piece]) -> Result<PathBuf, CheckpointError> {
    let path = staging_dir(target).join(shard_file_name(index, count));
    let mut meta = BTreeMap::new();
    let mut tensors = Vec::with_capacity(pieces.len());
    for p in pieces {
        let numel: usize = p.shape.iter().product();
        if p.offset + p.data.len() > numel || p.name.contains('@') {
            return Err(CheckpointError::Incompatible {
                path,
                what: format!(
                    "piece `{}` at {} with {} values does not fit shape {:?} (or its name has an `@`)",
                    p.name,
                    p.offset,
                    p.data.len(),
                    p.shape
                ),
            });
        }
        meta.insert(format!("{SHAPE_PREFIX}{}", p.name), shape_text(&p.shape));
        tensors.push(Entry { name: format!("{}@{}", p.name, p.offset), shape: vec![p.data.len()], data: p.data.clone() });
    }
    save(&path, &Checkpoint { tensors, meta })?;
    Ok(path)
}

fn shape_text(shape: &[usize]) -> String {
    shape.iter().map(usize::to_string).collect::<Vec<_>>().join("x")
}

fn parse_shape(s: &str) -> Option<Vec<usize>> {
    if s.is_empty() {
        return Some(Vec::new());
    }
    s.split('x').map(|d| d.parse().ok()).collect()
}

/// `(key, length)` of each tensor in a shard file, and the file's metadata.
type Header = (Vec<(String, usize)>, BTreeMap<String, String>);

/// Reads only a shard file's header.
fn read_header(path: &Path) -> Result<Header, CheckpointError> {
    let corrupt = |what: String| CheckpointError::Corrupt { path: path.to_path_buf(), what };
    let mut f = std::fs::File::open(path).map_err(io_err(path))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|e| corrupt(format!("cannot read the header length: {e}")))?;
    let n = u64::from_le_bytes(n);
    if n > 100 << 20 {
        return Err(corrupt(format!("header of {n} bytes")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| corrupt(format!("truncated header: {e}")))?;
    let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| corrupt(format!("header is not JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| corrupt("header is not a JSON object".into()))?;
    let mut keys = Vec::new();
    let mut meta = BTreeMap::new();
    for (k, v) in obj {
        if k == "__metadata__" {
            for (mk, mv) in v.as_object().into_iter().flatten() {
                meta.insert(mk.clone(), mv.as_str().unwrap_or_default().to_string());
            }
            continue;
        }
        let shape = v.get("shape").and_then(|s| s.as_array()).ok_or_else(|| corrupt(format!("tensor `{k}` has no shape")))?;
        let len = shape
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .product::<Option<usize>>()
            .ok_or_else(|| corrupt(format!("tensor `{k}`: bad shape")))?;
        keys.push((k.clone(), len));
    }
    Ok((keys, meta))
}

/// One rank, after every rank's [`write_shard`] returned: checks the pieces, writes the
/// manifest with `meta`, and atomically renames the staging directory to `target`.
pub fn commit(target: &Path, meta: &BTreeMap<String, String>) -> Result<PathBuf, CheckpointError> {
    let staging = staging_dir(target);
    let mut names: Vec<String> = std::fs::read_dir(&staging)
        .map_err(io_err(&staging))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("shard-") && n.ends_with(".safetensors"))
        .collect();
    names.sort();
    let mut files = Vec::new();
    let mut tensors: BTreeMap<String, TensorInfo> = BTreeMap::new();
    for (fi, name) in names.iter().enumerate() {
        let path = staging.join(name);
        let (keys, fmeta) = read_header(&path)?;
        let sha256 = fmeta.get(crate::CHECKSUM_KEY).cloned().unwrap_or_default();
        files.push(FileInfo { name: name.clone(), sha256 });
        for (key, len) in keys {
            let bad = |what: String| CheckpointError::Corrupt { path: path.clone(), what };
            let (tname, off) = key.rsplit_once('@').ok_or_else(|| bad(format!("key `{key}` is not `name@offset`")))?;
            let offset: usize = off.parse().map_err(|_| bad(format!("key `{key}`: bad offset")))?;
            let shape = fmeta
                .get(&format!("{SHAPE_PREFIX}{tname}"))
                .and_then(|s| parse_shape(s))
                .ok_or_else(|| bad(format!("no shape for `{tname}`")))?;
            let t = tensors.entry(tname.to_string()).or_insert_with(|| TensorInfo {
                name: tname.to_string(),
                shape: shape.clone(),
                shards: Vec::new(),
            });
            if t.shape != shape {
                return Err(bad(format!("`{tname}` has shape {:?} here and {:?} in another shard", shape, t.shape)));
            }
            t.shards.push(ShardInfo { file: fi, offset, len });
        }
    }
    let mut manifest =
        Manifest { format: FORMAT.into(), version: VERSION, meta: meta.clone(), files, tensors: tensors.into_values().collect() };
    for t in &mut manifest.tensors {
        t.shards.sort_by_key(|s| s.offset);
    }
    check_tiling(&staging, &manifest)?;
    let json =
        serde_json::to_vec_pretty(&manifest).map_err(|e| CheckpointError::Incompatible { path: staging.clone(), what: e.to_string() })?;
    let mpath = staging.join(MANIFEST);
    write_synced(&mpath, &json).map_err(io_err(&mpath))?;
    std::fs::File::open(&staging).and_then(|d| d.sync_all()).map_err(io_err(&staging))?;
    if target.exists() {
        // Re-saving the same step (a rerun): the old copy goes, the staged one replaces it.
        std::fs::remove_dir_all(target).map_err(io_err(target))?;
    }
    std::fs::rename(&staging, target).map_err(io_err(target))?;
    let parent = target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io_err(parent))?;
    Ok(target.to_path_buf())
}

/// [`commit`] once `writers` shard files are in the staging directory (each appears only when
/// complete, by rename), waiting up to `timeout`: the committing rank's half of a save that runs
/// in the background, without a barrier.
pub fn commit_when_complete(
    target: &Path,
    writers: usize,
    meta: &BTreeMap<String, String>,
    timeout: std::time::Duration,
) -> Result<PathBuf, CheckpointError> {
    let staging = staging_dir(target);
    let until = std::time::Instant::now() + timeout;
    loop {
        let have = std::fs::read_dir(&staging)
            .map_err(io_err(&staging))?
            .filter_map(|e| e.ok())
            .filter(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                n.starts_with("shard-") && n.ends_with(".safetensors")
            })
            .count();
        if have >= writers {
            return commit(target, meta);
        }
        if std::time::Instant::now() >= until {
            return Err(CheckpointError::Incompatible {
                path: staging,
                what: format!("only {have} of {writers} shard files were written within {timeout:?}; the checkpoint is not committed"),
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// Elements of a tensor of `shape`, `None` on overflow (the manifest is untrusted).
fn numel_of(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d))
}

/// Every tensor's shards cover `0..numel` exactly once.
fn check_tiling(dir: &Path, m: &Manifest) -> Result<(), CheckpointError> {
    for t in &m.tensors {
        let corrupt = |what: String| CheckpointError::Corrupt { path: dir.to_path_buf(), what };
        let numel = numel_of(&t.shape).ok_or_else(|| corrupt(format!("tensor `{}`: shape {:?} overflows", t.name, t.shape)))?;
        let mut at = 0usize;
        for s in &t.shards {
            if s.offset != at {
                let what = if s.offset < at { "overlap" } else { "a gap" };
                return Err(CheckpointError::Corrupt {
                    path: dir.to_path_buf(),
                    what: format!("tensor `{}`: {what} at element {at} (next piece starts at {})", t.name, s.offset),
                });
            }
            at = at.checked_add(s.len).ok_or_else(|| corrupt(format!("tensor `{}`: piece lengths overflow", t.name)))?;
        }
        if at != numel {
            return Err(CheckpointError::Corrupt {
                path: dir.to_path_buf(),
                what: format!("tensor `{}` {:?}: pieces cover {at} of {numel} elements", t.name, t.shape),
            });
        }
    }
    Ok(())
}

pub fn read_manifest(dir: &Path) -> Result<Manifest, CheckpointError> {
    let path = dir.join(MANIFEST);
    let bytes = crate::read_regular(&path)?;
    let m: Manifest =
        serde_json::from_slice(&bytes).map_err(|e| CheckpointError::Corrupt { path: path.clone(), what: format!("manifest: {e}") })?;
    if m.format != FORMAT || m.version != VERSION {
        return Err(CheckpointError::Incompatible {
            path,
            what: format!("format {} version {} (this Kolo reads {FORMAT} version {VERSION})", m.format, m.version),
        });
    }
    // File names come from the manifest: they must name files in this directory.
    if let Some(f) = m.files.iter().find(|f| f.name.is_empty() || f.name.contains(['/', '\\']) || f.name.starts_with('.')) {
        return Err(CheckpointError::Corrupt { path, what: format!("file name {:?} is not a file of this directory", f.name) });
    }
    for t in &m.tensors {
        if let Some(s) = t.shards.iter().find(|s| s.file >= m.files.len()) {
            return Err(CheckpointError::Corrupt {
                path,
                what: format!("tensor `{}` names file #{} of {}", t.name, s.file, m.files.len()),
            });
        }
    }
    check_tiling(dir, &m)?;
    Ok(m)
}

/// Loads a sharded checkpoint directory as whole tensors, verifying every shard file's checksum
/// and that the pieces tile every tensor.
pub fn load_dir(dir: &Path) -> Result<Checkpoint, CheckpointError> {
    let m = read_manifest(dir)?;
    // Allocate only what the files on disk can hold: a manifest claiming more (tampered, or
    // hostile) is refused before any memory is reserved for it.
    let claimed = m.tensors.iter().try_fold(0usize, |n, t| numel_of(&t.shape).and_then(|k| n.checked_add(k)));
    let on_disk: u64 = m.files.iter().map(|f| std::fs::metadata(dir.join(&f.name)).map_or(0, |md| md.len())).sum();
    match claimed {
        Some(n) if (n as u64).saturating_mul(4) <= on_disk => {}
        _ => {
            return Err(CheckpointError::Corrupt {
                path: dir.join(MANIFEST),
                what: format!(
                    "the manifest claims {} values; its shard files hold at most {}",
                    claimed.map_or("too many".into(), |n| n.to_string()),
                    on_disk / 4
                ),
            })
        }
    }
    let mut whole: Vec<Entry> = m
        .tensors
        .iter()
        .map(|t| Entry { name: t.name.clone(), shape: t.shape.clone(), data: vec![0f32; t.shape.iter().product()] })
        .collect();
    let index: BTreeMap<&str, usize> = m.tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
    for (fi, f) in m.files.iter().enumerate() {
        let path = dir.join(&f.name);
        let (ck, sha) = load_verified(&path)?;
        if sha != f.sha256 {
            return Err(CheckpointError::Corrupt {
                path,
                what: "its checksum differs from the manifest's (a file from another checkpoint?)".into(),
            });
        }
        for e in ck.tensors {
            let bad = |what: String| CheckpointError::Corrupt { path: path.clone(), what };
            let (tname, off) = e.name.rsplit_once('@').ok_or_else(|| bad(format!("key `{}` is not `name@offset`", e.name)))?;
            let offset: usize = off.parse().map_err(|_| bad(format!("key `{}`: bad offset", e.name)))?;
            let ti = *index.get(tname).ok_or_else(|| bad(format!("`{tname}` is not in the manifest")))?;
            let listed = m.tensors[ti].shards.iter().any(|s| s.file == fi && s.offset == offset && s.len == e.data.len());
            if !listed {
                return Err(bad(format!("piece `{}` ({} values) is not in the manifest", e.name, e.data.len())));
            }
            whole[ti].data[offset..offset + e.data.len()].copy_from_slice(&e.data);
        }
        // Every piece the manifest lists for this file must have been there.
        let want = m.tensors.iter().flat_map(|t| t.shards.iter()).filter(|s| s.file == fi).count();
        let (keys, _) = read_header(&path)?;
        if keys.len() != want {
            return Err(CheckpointError::Corrupt { path, what: format!("{} pieces, the manifest lists {want}", keys.len()) });
        }
    }
    Ok(Checkpoint { tensors: whole, meta: m.meta })
}

/// Loads either layout: a sharded directory or a single-file checkpoint.
pub fn load_any(path: &Path) -> Result<Checkpoint, CheckpointError> {
    if path.is_dir() {
        load_dir(path)
    } else {
        crate::load(path)
    }
}

/// A human-readable listing (`kolo inspect`): metadata, files, tensors with shapes and shards.
/// `""` when every value is finite, else how many are NaN or infinite and in which tensors (a
/// diverged run's checkpoint verifies, but must not be mistaken for a usable one).
fn non_finite_note(ck: &Checkpoint) -> String {
    let bad: Vec<(&str, usize)> =
        ck.tensors.iter().map(|t| (t.name.as_str(), t.data.iter().filter(|v| !v.is_finite()).count())).filter(|(_, n)| *n > 0).collect();
    if bad.is_empty() {
        return String::new();
    }
    let total: usize = bad.iter().map(|(_, n)| n).sum();
    let names: Vec<String> = bad.iter().take(3).map(|(t, n)| format!("`{t}` {n}")).collect();
    let more = if bad.len() > 3 { format!(" and {} more tensors", bad.len() - 3) } else { String::new() };
    format!(", but {total} values are NaN or infinite: {}{more}", names.join(", "))
}

pub fn describe(path: &Path) -> Result<String, CheckpointError> {
    use std::fmt::Write;
    let mut s = String::new();
    if !path.is_dir() {
        let (ck, sha) = load_verified(path)?;
        let _ = writeln!(s, "{} (single file, sha256 {sha}, verified{})", path.display(), non_finite_note(&ck));
        for (k, v) in &ck.meta {
            let _ = writeln!(s, "  meta {k} = {v}");
        }
        for e in &ck.tensors {
            let _ = writeln!(s, "  {:<48} {:>14} f32 {:>12} values", e.name, format!("{:?}", e.shape), e.data.len());
        }
        return Ok(s);
    }
    let m = read_manifest(path)?;
    // Verify every file too: inspecting should tell whether the checkpoint would load.
    let verdict = match load_dir(path) {
        Ok(ck) => format!("verified{}", non_finite_note(&ck)),
        Err(e) => format!("DOES NOT LOAD: {e}"),
    };
    let total: usize = m.tensors.iter().map(|t| t.shape.iter().product::<usize>()).sum();
    let _ = writeln!(
        s,
        "{} ({} {}, {} files, {} tensors, {total} values, {verdict})",
        path.display(),
        m.format,
        m.version,
        m.files.len(),
        m.tensors.len()
    );
    for (k, v) in &m.meta {
        let _ = writeln!(s, "  meta {k} = {v}");
    }
    for f in &m.files {
        let _ = writeln!(s, "  file {} sha256 {}", f.name, f.sha256);
    }
    for t in &m.tensors {
        let shards: Vec<String> = t.shards.iter().map(|x| format!("#{}[{}..{})", x.file, x.offset, x.offset + x.len)).collect();
        let _ = writeln!(s, "  {:<48} {:>14} f32 {} shard(s): {}", t.name, format!("{:?}", t.shape), t.shards.len(), shards.join(" "));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {

    /// `kolo inspect` says when a checkpoint verifies but holds NaN or infinite values (issue
    /// #34: a diverged run's checkpoint was reported as `verified` only).
    #[test]
    fn describe_counts_non_finite_values() {
        let dir = std::env::temp_dir().join(format!("kolo-ckpt-nan-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let entry = |name: &str, data: Vec<f32>| Entry { name: name.into(), shape: vec![data.len()], data };
        let good = dir.join("good.safetensors");
        save(&good, &Checkpoint { tensors: vec![entry("w", vec![1.0, 2.0])], meta: Default::default() }).unwrap();
        assert!(describe(&good).unwrap().contains("verified)"), "{}", describe(&good).unwrap());
        let bad = dir.join("bad.safetensors");
        let tensors = vec![entry("w", vec![1.0, f32::NAN, f32::INFINITY]), entry("b", vec![f32::NAN])];
        save(&bad, &Checkpoint { tensors, meta: Default::default() }).unwrap();
        let d = describe(&bad).unwrap();
        assert!(d.contains("verified, but 3 values are NaN or infinite: `w` 2, `b` 1") || d.contains("`b` 1, `w` 2"), "{d}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// What is not a regular file is refused at once by name (issue #34: `kolo inspect
    /// /dev/zero` read 7.1 GB in 8 s; a FIFO hung it): a device, a FIFO with no writer, and a
    /// manifest that is a FIFO. Each call runs on a thread and must answer within 10 s.
    #[test]
    fn devices_and_fifos_are_refused_without_reading() {
        let dir = std::env::temp_dir().join(format!("kolo-ckpt-special-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("ck")).unwrap();
        let fifo = dir.join("fifo");
        for p in [fifo.clone(), dir.join("ck").join(MANIFEST)] {
            let ok = std::process::Command::new("mkfifo").arg(&p).status().unwrap().success();
            assert!(ok, "mkfifo {}", p.display());
        }
        for (p, dir_form) in [(PathBuf::from("/dev/zero"), false), (fifo, false), (dir.join("ck"), true)] {
            let (tx, rx) = std::sync::mpsc::channel();
            let q = p.clone();
            std::thread::spawn(move || tx.send(describe(&q).map_err(|e| e.to_string())).unwrap());
            let got = rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap_or_else(|_| panic!("{}: no answer in 10 s", p.display()));
            let e = got.expect_err("a special file described as a checkpoint");
            assert!(e.contains("not a regular file"), "{}: {e}", p.display());
            assert_eq!(dir_form, e.contains(MANIFEST), "{}: {e}", p.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kolo-sharded-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// Tensor `a` [2, 5] and `b` [7] split across `n` writers at odd boundaries.
    fn write_all(target: &Path, n: usize) -> (Vec<f32>, Vec<f32>) {
        let a: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..7).map(|i| -(i as f32)).collect();
        begin(target).unwrap();
        for r in 0..n {
            let ra = kolo_like_split(10, n, r);
            let rb = kolo_like_split(7, n, r);
            let mut pieces = Vec::new();
            if !ra.is_empty() {
                pieces.push(Piece { name: "a".into(), shape: vec![2, 5], offset: ra.start, data: a[ra].to_vec() });
            }
            if !rb.is_empty() {
                pieces.push(Piece { name: "b".into(), shape: vec![7], offset: rb.start, data: b[rb].to_vec() });
            }
            write_shard(target, r, n, &pieces).unwrap();
        }
        (a, b)
    }

    fn kolo_like_split(len: usize, n: usize, r: usize) -> std::ops::Range<usize> {
        let (base, extra) = (len / n, len % n);
        let start = r * base + r.min(extra);
        start..start + base + usize::from(r < extra)
    }

    #[test]
    fn pieces_from_any_number_of_writers_load_whole() {
        let dir = tmp("whole");
        for n in [1, 2, 3, 4, 9] {
            let target = dir.join(format!("step-{n}"));
            let (a, b) = write_all(&target, n);
            let mut meta = BTreeMap::new();
            meta.insert("kolo.step".to_string(), n.to_string());
            commit(&target, &meta).unwrap();
            assert!(!staging_dir(&target).exists());
            let ck = load_any(&target).unwrap();
            assert_eq!(ck.get("a").unwrap().data, a);
            assert_eq!(ck.get("a").unwrap().shape, vec![2, 5]);
            assert_eq!(ck.get("b").unwrap().data, b);
            assert_eq!(ck.meta["kolo.step"], n.to_string());
            let text = describe(&target).unwrap();
            assert!(text.contains("verified") && text.contains("[2, 5]") && text.contains(&format!("{n} files")), "{text}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn background_commit_waits_for_every_shard_file_with_a_deadline() {
        let dir = tmp("bg");
        let target = dir.join("step-1");
        write_all(&target, 3);
        std::fs::remove_file(staging_dir(&target).join(shard_file_name(2, 3))).unwrap();
        let short = std::time::Duration::from_millis(30);
        let e = commit_when_complete(&target, 3, &BTreeMap::new(), short).unwrap_err();
        assert!(e.to_string().contains("only 2 of 3 shard files"), "{e}");
        assert!(!target.exists());
        let t = target.clone();
        let late = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            write_shard(
                &t,
                2,
                3,
                &[
                    Piece { name: "a".into(), shape: vec![2, 5], offset: 7, data: vec![7.0, 8.0, 9.0] },
                    Piece { name: "b".into(), shape: vec![7], offset: 5, data: vec![-5.0, -6.0] },
                ],
            )
            .unwrap();
        });
        commit_when_complete(&target, 3, &BTreeMap::new(), std::time::Duration::from_secs(10)).unwrap();
        late.join().unwrap();
        assert_eq!(load_any(&target).unwrap().get("a").unwrap().data[9], 9.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn incomplete_tampered_or_mixed_checkpoints_are_refused() {
        let dir = tmp("bad");
        let target = dir.join("step-1");
        // Not committed: nothing is visible under the final name.
        write_all(&target, 3);
        assert!(!target.exists());
        assert!(matches!(load_any(&target), Err(CheckpointError::Io { .. })));
        // A missing piece is caught at commit.
        std::fs::remove_file(staging_dir(&target).join(shard_file_name(1, 3))).unwrap();
        let e = commit(&target, &BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("a gap at element 4"), "{e}");
        // Committed, then a shard file deleted, corrupted or swapped for another checkpoint's.
        write_all(&target, 3);
        commit(&target, &BTreeMap::new()).unwrap();
        let other = dir.join("step-2");
        write_all(&other, 3);
        // Same layout, different values in one file.
        let f1 = shard_file_name(1, 3);
        write_shard(
            &other,
            1,
            3,
            &[
                Piece { name: "a".into(), shape: vec![2, 5], offset: 4, data: vec![9.0; 3] },
                Piece { name: "b".into(), shape: vec![7], offset: 3, data: vec![9.0; 2] },
            ],
        )
        .unwrap();
        commit(&other, &BTreeMap::new()).unwrap();
        let good = std::fs::read(target.join(&f1)).unwrap();
        std::fs::copy(other.join(&f1), target.join(&f1)).unwrap();
        let e = load_any(&target).unwrap_err();
        assert!(e.to_string().contains("differs from the manifest"), "{e}");
        let mut flipped = good.clone();
        let last = flipped.len() - 2;
        flipped[last] ^= 1;
        std::fs::write(target.join(&f1), &flipped).unwrap();
        assert!(matches!(load_any(&target).unwrap_err(), CheckpointError::Corrupt { .. }));
        std::fs::remove_file(target.join(&f1)).unwrap();
        assert!(matches!(load_any(&target).unwrap_err(), CheckpointError::Io { .. }));
        assert!(describe(&target).is_ok_and(|t| t.contains("DOES NOT LOAD")));
        std::fs::write(target.join(&f1), &good).unwrap();
        load_any(&target).unwrap();
        // A manifest edited to overlap or to claim a bogus file.
        let m = std::fs::read_to_string(target.join(MANIFEST)).unwrap();
        std::fs::write(target.join(MANIFEST), m.replace("\"offset\": 4", "\"offset\": 3")).unwrap();
        let e = load_any(&target).unwrap_err();
        assert!(e.to_string().contains("overlap"), "{e}");
        std::fs::write(target.join(MANIFEST), b"{\"format\": 1}").unwrap();
        assert!(matches!(load_any(&target).unwrap_err(), CheckpointError::Corrupt { .. }));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The manifest is untrusted (issue #19): a shape whose product overflows, a tensor larger
    /// than the files on disk (it would have been allocated before anything was verified) and
    /// a file name outside the directory are each refused, without a panic or an allocation.
    #[test]
    fn a_manifest_claiming_too_much_or_outside_files_is_refused() {
        let dir = tmp("hostile");
        let target = dir.join("step-1");
        write_all(&target, 1);
        commit(&target, &BTreeMap::new()).unwrap();
        let good = std::fs::read_to_string(target.join(MANIFEST)).unwrap();
        let m: Manifest = serde_json::from_str(&good).unwrap();
        let edit = |f: &dyn Fn(&mut Manifest)| {
            let mut x = m.clone();
            f(&mut x);
            std::fs::write(target.join(MANIFEST), serde_json::to_string(&x).unwrap()).unwrap();
            load_any(&target).unwrap_err().to_string()
        };
        let huge = 1usize << 40;
        let e = edit(&|x| {
            x.tensors[1].shape = vec![huge];
            x.tensors[1].shards[0].len = huge;
        });
        assert!(e.contains("the manifest claims") && e.contains("shard files hold at most"), "{e}");
        let e = edit(&|x| x.tensors[0].shape = vec![huge, huge]);
        assert!(e.contains("overflows"), "{e}");
        let e = edit(&|x| x.files[0].name = "../../etc/passwd".into());
        assert!(e.contains("not a file of this directory"), "{e}");
        std::fs::write(target.join(MANIFEST), &good).unwrap();
        load_any(&target).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
