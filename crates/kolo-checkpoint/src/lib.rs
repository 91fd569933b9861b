//! Checkpoint files are plain safetensors (readable by Python's `safetensors`, by candle, …)
//! with Kolo's bookkeeping in the string metadata:
//!
//! * `kolo.sha256`: SHA-256 over every tensor's name, dtype, shape and bytes in name order. It
//!   is verified on load, so a truncated or bit-flipped file is an error, not silent garbage.
//! * any caller metadata (step, RNG state, data position, model spec, …).
//!
//! Training checkpoints are directories of such files, one per rank, with a manifest that lets
//! them reload at any world size ([`sharded`]).
//!
//! Writes are atomic: a temporary file in the same directory is written and fsynced, renamed
//! over the target, and the directory is fsynced. A crash leaves either the old or the new file.

use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub mod sharded;
pub use sharded::{load_any, Piece};

pub const CHECKSUM_KEY: &str = "kolo.sha256";

#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("checkpoint {path} is corrupt: {what}")]
    Corrupt { path: PathBuf, what: String },
    #[error("checkpoint {path}: {what}")]
    Incompatible { path: PathBuf, what: String },
}

/// One named f32 tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// What a checkpoint holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Checkpoint {
    pub tensors: Vec<Entry>,
    pub meta: BTreeMap<String, String>,
}

impl Checkpoint {
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.tensors.iter().find(|e| e.name == name)
    }

    /// A metadata value, or an error naming the missing key.
    pub fn meta(&self, path: &Path, key: &str) -> Result<&str, CheckpointError> {
        self.meta.get(key).map(String::as_str).ok_or_else(|| CheckpointError::Incompatible {
            path: path.to_path_buf(),
            what: format!("metadata `{key}` is missing (not a Kolo training checkpoint?)"),
        })
    }
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn checksum<'a>(items: impl Iterator<Item = (&'a str, &'a [usize], &'a [u8])>) -> String {
    let mut items: Vec<_> = items.collect();
    items.sort_by(|a, b| a.0.cmp(b.0));
    let mut h = Sha256::new();
    for (name, shape, data) in items {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(b"F32");
        h.update((shape.len() as u64).to_le_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update((data.len() as u64).to_le_bytes());
        h.update(data);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes `ckpt` to `path` atomically.
pub fn save(path: &Path, ckpt: &Checkpoint) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> =
        ckpt.tensors.iter().map(|e| (e.name.clone(), e.shape.clone(), to_bytes(&e.data))).collect();
    for (name, shape, data) in &bytes {
        if shape.iter().product::<usize>() * 4 != data.len() {
            return Err(CheckpointError::Incompatible {
                path: path.into(),
                what: format!("tensor `{name}`: shape {shape:?} does not match its data"),
            });
        }
    }
    let mut meta: HashMap<String, String> = ckpt.meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    meta.insert(CHECKSUM_KEY.into(), checksum(bytes.iter().map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))));
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, d)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), d)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()
        .map_err(|e| CheckpointError::Incompatible { path: path.into(), what: e.to_string() })?;
    let blob =
        safetensors::serialize(views, Some(meta)).map_err(|e| CheckpointError::Incompatible { path: path.into(), what: e.to_string() })?;

    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into()),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&blob)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

/// Reads and verifies a checkpoint written by [`save`].
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    load_verified(path).map(|(c, _)| c)
}

/// [`load`], also returning the verified checksum.
pub(crate) fn load_verified(path: &Path) -> Result<(Checkpoint, String), CheckpointError> {
    let blob = read_regular(path)?;
    verify_blob(path, &blob)
}

/// The bytes of the regular file at `path`, no more than its size when opened. Anything else
/// (a device such as `/dev/zero`, a FIFO, a socket, a directory) is refused before it is opened:
/// reading one would never end or would block (issue #34).
pub(crate) fn read_regular(path: &Path) -> Result<Vec<u8>, CheckpointError> {
    use std::io::Read;
    let io = |source| CheckpointError::Io { path: path.to_path_buf(), source };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        let what = format!("not a regular file ({:?}); a checkpoint is a file or a directory of them", meta.file_type());
        return Err(CheckpointError::Corrupt { path: path.to_path_buf(), what });
    }
    let f = std::fs::File::open(path).map_err(io)?;
    let mut blob = Vec::with_capacity(meta.len() as usize);
    f.take(meta.len()).read_to_end(&mut blob).map_err(io)?;
    Ok(blob)
}

/// Parses and verifies the bytes of a checkpoint file (`path` names it in errors). The bytes
/// are untrusted: any content gives a checkpoint or an error, never a panic.
fn verify_blob(path: &Path, blob: &[u8]) -> Result<(Checkpoint, String), CheckpointError> {
    let corrupt = |what: String| CheckpointError::Corrupt { path: path.to_path_buf(), what };
    let st = SafeTensors::deserialize(blob).map_err(|e| corrupt(format!("not a readable safetensors file: {e}")))?;
    let (_, header) = SafeTensors::read_metadata(blob).map_err(|e| corrupt(e.to_string()))?;
    let meta: BTreeMap<String, String> = header.metadata().clone().unwrap_or_default().into_iter().collect();
    let want = meta.get(CHECKSUM_KEY).ok_or_else(|| corrupt(format!("no `{CHECKSUM_KEY}` metadata (not written by Kolo)")))?;
    let tensors = st.tensors();
    for (name, t) in &tensors {
        if t.dtype() != Dtype::F32 {
            return Err(CheckpointError::Incompatible {
                path: path.into(),
                what: format!("tensor `{name}` is {:?}; Kolo reads f32", t.dtype()),
            });
        }
    }
    let got = checksum(tensors.iter().map(|(n, t)| (n.as_str(), t.shape(), t.data())));
    if &got != want {
        // The stored value is untrusted text: cut it by characters, not bytes.
        let stored: String = want.chars().take(12).collect();
        return Err(corrupt(format!("checksum mismatch (stored {stored}…, computed {}…)", &got[..12])));
    }
    let mut entries: Vec<Entry> = tensors
        .into_iter()
        .map(|(name, t)| Entry {
            name,
            shape: t.shape().to_vec(),
            data: t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        })
        .collect();
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    let mut meta = meta;
    let sum = meta.remove(CHECKSUM_KEY).unwrap_or_default();
    Ok((Checkpoint { tensors: entries, meta }, sum))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Checkpoint {
        let mut meta = BTreeMap::new();
        meta.insert("step".into(), "7".into());
        Checkpoint {
            tensors: vec![
                Entry { name: "b".into(), shape: vec![2], data: vec![1.0, -2.5] },
                Entry { name: "a.weight".into(), shape: vec![2, 3], data: (0..6).map(|i| i as f32 * 0.5).collect() },
            ],
            meta,
        }
    }

    /// A crafted file whose checksum metadata is not ASCII (issue #19: the error message cut
    /// it at byte 12, inside a character, and panicked).
    #[test]
    fn a_non_ascii_stored_checksum_is_an_error() {
        let data: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &data).unwrap();
        // One ASCII byte first: byte 12 then falls inside a two-byte character.
        let meta = std::collections::HashMap::from([(CHECKSUM_KEY.to_string(), format!("a{}", "é".repeat(20)))]);
        let blob = safetensors::serialize([("x", view)], Some(meta)).unwrap();
        let e = verify_blob(Path::new("crafted"), &blob).unwrap_err().to_string();
        assert!(e.contains("checksum mismatch (stored aééééééééééé…"), "{e}");
    }

    proptest::proptest! {
        /// Checkpoint files are untrusted: a valid one with a byte of its header (the length or
        /// the JSON) or its data changed, cut short or grown loads or fails, never panics.
        #[test]
        fn mutated_checkpoint_files_never_panic(pos in proptest::prelude::any::<usize>(), byte in proptest::prelude::any::<u8>(), cut in proptest::prelude::any::<usize>(), mode in 0u8..3) {
            let dir = std::env::temp_dir().join(format!("kolo-ckpt-fuzz-{}", std::process::id()));
            let path = dir.join(format!("c-{pos}-{byte}-{cut}-{mode}.safetensors"));
            save(&path, &sample()).unwrap();
            let mut blob = std::fs::read(&path).unwrap();
            let _ = std::fs::remove_file(&path);
            let header = 8 + u64::from_le_bytes(blob[..8].try_into().unwrap()) as usize;
            match mode {
                0 => { let i = pos % header; blob[i] = byte; }
                1 => { let i = pos % blob.len(); blob[i] = byte; blob.truncate(cut % (blob.len() + 1)); }
                _ => blob.extend(std::iter::repeat_n(byte, cut % 64)),
            }
            let _ = verify_blob(&path, &blob);
        }
    }

    #[test]
    fn round_trip_atomic_and_verified() {
        let dir = std::env::temp_dir().join(format!("kolo-ckpt-{}", std::process::id()));
        let path = dir.join("c.safetensors");
        save(&path, &sample()).unwrap();
        let back = load(&path).unwrap();
        assert_eq!(back.meta.get("step").unwrap(), "7");
        assert_eq!(back.get("b").unwrap().data, vec![1.0, -2.5]);
        assert_eq!(back.get("a.weight").unwrap().shape, vec![2, 3]);
        // No temporary files are left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);

        // Every single flipped byte in the data region is caught.
        let blob = std::fs::read(&path).unwrap();
        for i in [blob.len() - 1, blob.len() - 13, blob.len() - 30] {
            let mut bad = blob.clone();
            bad[i] ^= 0x40;
            std::fs::write(&path, &bad).unwrap();
            let e = load(&path).unwrap_err();
            assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e}");
        }
        // Truncation and garbage too.
        std::fs::write(&path, &blob[..blob.len() / 2]).unwrap();
        assert!(matches!(load(&path).unwrap_err(), CheckpointError::Corrupt { .. }));
        std::fs::write(&path, b"not a checkpoint").unwrap();
        assert!(matches!(load(&path).unwrap_err(), CheckpointError::Corrupt { .. }));
        assert!(matches!(load(&dir.join("missing")).unwrap_err(), CheckpointError::Io { .. }));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
