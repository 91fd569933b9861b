//! Checkpoint files as `transformers` reads and writes them: one `model.safetensors`, or shards
//! named by `model.safetensors.index.json`; `config.json` beside them.

use crate::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::DType;
use candle_nn::VarMap;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The index `transformers` writes beside the shards of a checkpoint saved in several files.
pub const INDEX: &str = "model.safetensors.index.json";
/// The one file of a checkpoint saved whole.
pub const SINGLE: &str = "model.safetensors";

/// What loading a checkpoint left unused, like the report `transformers` prints: tensors of the
/// files that no parameter took, and `config.json` keys the implementation neither reads nor
/// knows to leave the model's arithmetic unchanged. (A key that changes the arithmetic and is
/// not implemented is refused, never reported.)
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Tensors no parameter took (not counting those the architecture leaves out on purpose:
    /// buffers, a tied output projection, the parts other pipeline stages hold).
    pub unused_tensors: Vec<String>,
    /// `config.json` keys not read.
    pub unknown_keys: Vec<String>,
}

impl LoadReport {
    /// Nothing was left unused.
    pub fn is_empty(&self) -> bool {
        self.unused_tensors.is_empty() && self.unknown_keys.is_empty()
    }
}

impl std::fmt::Display for LoadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            let mut s = v.iter().take(8).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
            if v.len() > 8 {
                s += &format!(" and {} more", v.len() - 8);
            }
            s
        };
        let mut parts = Vec::new();
        if !self.unused_tensors.is_empty() {
            parts.push(format!("{} unused tensors: {}", self.unused_tensors.len(), list(&self.unused_tensors)));
        }
        if !self.unknown_keys.is_empty() {
            parts.push(format!("config keys not read: {}", list(&self.unknown_keys)));
        }
        if parts.is_empty() {
            return write!(f, "every tensor and config key used");
        }
        write!(f, "{}", parts.join("; "))
    }
}

/// A checkpoint's tensors, mapped (never read whole): one file, or the shards of an index.
pub(crate) struct Weights {
    /// Each file, mapped, with its path.
    files: Vec<(PathBuf, MmapedSafetensors)>,
    /// Each tensor's file (an index into `files`).
    map: BTreeMap<String, usize>,
    /// What the checkpoint's names put before the model's (`language_model.` for the text
    /// model of a Gemma 3 with a vision tower); empty for most.
    prefix: String,
}

impl Weights {
    /// Opens `path`: a directory (its `model.safetensors`, else its `model.safetensors.index.json`
    /// and the shards it names), an index file, or one safetensors file. A shard the index names
    /// that is missing, or a tensor missing from the shard the index puts it in, is an error
    /// naming the file and the tensor.
    pub(crate) fn open(path: &Path) -> Result<Weights> {
        let path = if path.is_dir() {
            match (path.join(SINGLE), path.join(INDEX)) {
                (single, _) if single.is_file() => single,
                (_, index) if index.is_file() => index,
                _ => return Err(Error::file(path, format!("no {SINGLE} or {INDEX} in the directory"))),
            }
        } else {
            path.to_path_buf()
        };
        if !path.to_string_lossy().ends_with(".index.json") {
            // SAFETY: the file is mapped read-only and must not change while it is read, as for
            // candle's own `VarBuilder::from_mmaped_safetensors`.
            let file = unsafe { MmapedSafetensors::new(&path) }.map_err(|e| Error::file(&path, e))?;
            let map = file.tensors().into_iter().map(|(n, _)| (n, 0)).collect();
            return Ok(Weights { files: vec![(path, file)], map, prefix: String::new() });
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
        let Some(entries) = index.get("weight_map").and_then(|m| m.as_object()) else {
            return Err(Error::file(&path, "no \"weight_map\" object"));
        };
        let dir = path.parent().unwrap_or(Path::new("."));
        let mut wanted: BTreeMap<String, PathBuf> = BTreeMap::new();
        for (name, file) in entries {
            let Some(file) = file.as_str().filter(|f| !f.contains('/') && !f.contains('\\') && !f.is_empty()) else {
                return Err(Error::file(&path, format!("weight_map[\"{name}\"] is not a file name in the directory: {file}")));
            };
            wanted.insert(name.clone(), dir.join(file));
        }
        let mut shards: Vec<&PathBuf> = wanted.values().collect();
        shards.sort();
        shards.dedup();
        let mut files = Vec::with_capacity(shards.len());
        for shard in shards {
            if !shard.is_file() {
                let mut held = wanted.iter().filter(|(_, p)| *p == shard).map(|(n, _)| n);
                let (first, more) = (held.next().expect("named"), held.count());
                return Err(Error::file(
                    &path,
                    format!("shard {} (holding `{first}` and {more} more tensors) is missing", shard.display()),
                ));
            }
            // SAFETY: as above, for every shard.
            let file = unsafe { MmapedSafetensors::new(shard) }.map_err(|e| Error::file(shard, e))?;
            files.push((shard.clone(), file));
        }
        let mut map = BTreeMap::new();
        for (name, shard) in &wanted {
            let i = files.iter().position(|(p, _)| p == shard).expect("opened");
            if files[i].1.get(name).is_err() {
                return Err(Error::file(shard, format!("no tensor `{name}`, which {INDEX} puts in this file")));
            }
            map.insert(name.clone(), i);
        }
        Ok(Weights { files, map, prefix: String::new() })
    }

    /// Every tensor's name.
    pub(crate) fn names(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    /// The same files, for a model whose variables are the tensors named `prefix` + their name.
    pub(crate) fn under(mut self, prefix: &str) -> Weights {
        self.prefix = prefix.to_string();
        self
    }

    /// Sets every variable of `varmap` by name (see [`load_weights`]); returns the tensors no
    /// variable took and `elsewhere` does not claim.
    pub(crate) fn fill(&self, varmap: &VarMap, elsewhere: &dyn Fn(&str) -> bool) -> Result<Vec<String>> {
        let vars = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        let mut used = std::collections::HashSet::new();
        for name in names {
            let var = &vars[name];
            let short = name.split_once('.').map_or(name.as_str(), |(_, rest)| rest);
            let full = format!("{}{name}", self.prefix);
            let key = if self.map.contains_key(&full) { full } else { format!("{}{short}", self.prefix) };
            let key = key.as_str();
            let Some(&i) = self.map.get(key) else {
                let where_ = match self.files.as_slice() {
                    [(one, _)] => one.clone(),
                    _ => self.files.first().and_then(|(p, _)| p.parent()).map_or(PathBuf::from(INDEX), |d| d.join(INDEX)),
                };
                return Err(Error::file(where_, format!("no tensor `{}{name}` (the model has {} parameters)", self.prefix, vars.len())));
            };
            let (file, st) = (&self.files[i].0, &self.files[i].1);
            let view = st.get(key).map_err(|e| Error::file(file, e))?;
            if !matches!(
                view.dtype(),
                safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16 | safetensors::Dtype::F64
            ) {
                return Err(Error::file(file, format!("tensor `{key}` is {:?}, not a floating-point parameter", view.dtype())));
            }
            // Split over a tensor-parallel group: only this rank's piece of the tensor is read.
            let t = crate::tp::read_for(st, key, var).map_err(|e| Error::file(file, e))?.expect("listed tensor");
            if t.dims() != var.dims() {
                return Err(Error::file(file, format!("tensor `{name}` has shape {:?}, the model's is {:?}", t.dims(), var.dims())));
            }
            var.set(&t.to_dtype(var.dtype())?.to_device(var.device())?)?;
            used.insert(key.to_string());
        }
        Ok(self.map.keys().filter(|n| !used.contains(n.as_str()) && !elsewhere(n)).cloned().collect())
    }
}

/// Sets every variable of `varmap` from the checkpoint at `path` (a directory with
/// `model.safetensors` or `model.safetensors.index.json` and its shards, or one of those
/// files), by name (a name may also appear without the VarMap's first component, as older
/// checkpoints store `h.0....` for `transformer.h.0....`), converted to the variable's dtype;
/// a variable split over a tensor-parallel group reads only its slice. Every variable must be
/// there with its shape. Returns the report of the tensors no variable took.
pub fn load_weights(varmap: &VarMap, path: &Path) -> Result<LoadReport> {
    let unused_tensors = Weights::open(path)?.fill(varmap, &|_| false)?;
    Ok(LoadReport { unused_tensors, unknown_keys: Vec::new() })
}

/// How [`save_pretrained_with`] writes a checkpoint.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// The tensors' dtype in the files (`F32`, `BF16` or `F16`), also stated as `config.json`'s
    /// `dtype`, like `save_pretrained(torch_dtype=...)`. Default `F32`.
    pub dtype: DType,
    /// Largest file in bytes: above it the tensors are cut into `model-0000i-of-0000n.safetensors`
    /// with `model.safetensors.index.json` (a tensor larger than this gets a file of its own), as
    /// `save_pretrained(max_shard_size=...)`. Default: one file.
    pub max_shard_size: Option<u64>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions { dtype: DType::F32, max_shard_size: None }
    }
}

/// Writes `dir/config.json` and `dir/model.safetensors` (every variable of `varmap` whole,
/// under its name, f32, with `format = pt` metadata), as `save_pretrained` does
/// ([`save_pretrained_with`] with the default options).
pub fn save_pretrained(dir: &Path, varmap: &VarMap, config: &impl serde::Serialize) -> Result<()> {
    save_pretrained_with(dir, varmap, config, &SaveOptions::default())
}

/// Writes `dir/config.json` and the model's tensors as [`SaveOptions`] says: every variable of
/// `varmap` whole, under its name, with `format = pt` metadata; `config.json` states the dtype
/// written. Each file is written to a temporary name and renamed, the index (or the single
/// file) after the shards; files of an earlier save that this one does not write are removed.
pub fn save_pretrained_with(dir: &Path, varmap: &VarMap, config: &impl serde::Serialize, opts: &SaveOptions) -> Result<()> {
    let (dtype_name, width) = match opts.dtype {
        DType::F32 => ("float32", 4),
        DType::BF16 => ("bfloat16", 2),
        DType::F16 => ("float16", 2),
        d => return Err(Error::file(dir, format!("cannot save a checkpoint in {d:?} (f32, bf16 or f16)"))),
    };
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let vars: Vec<(String, candle_core::Var)> = {
        let map = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = map.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        v.sort_by_cached_key(|(n, _)| natural_key(n));
        v
    };
    let sizes: Vec<u64> = vars.iter().map(|(_, v)| (v.elem_count() * width) as u64).collect();
    let shards = plan_shards(&sizes, opts.max_shard_size);
    let n = shards.len();
    let name_of = |i: usize| if n == 1 { SINGLE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", i + 1) };
    let mut weight_map = serde_json::Map::new();
    for (i, range) in shards.iter().enumerate() {
        let mut tensors = Vec::with_capacity(range.len());
        for (name, var) in &vars[range.clone()] {
            let t = var.as_tensor().to_dtype(opts.dtype)?.flatten_all()?;
            let bytes: Vec<u8> = match opts.dtype {
                DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
                DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            tensors.push((name.as_str(), var.dims().to_vec(), bytes));
            weight_map.insert(name.clone(), name_of(i).into());
        }
        let st_dtype = match opts.dtype {
            DType::F32 => safetensors::Dtype::F32,
            DType::BF16 => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F16,
        };
        let path = dir.join(name_of(i));
        let views = tensors
            .iter()
            .map(|(n, s, d)| Ok((*n, safetensors::tensor::TensorView::new(st_dtype, s.clone(), d)?)))
            .collect::<std::result::Result<Vec<_>, safetensors::SafeTensorError>>()
            .map_err(|e| Error::file(&path, e))?;
        let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
        write_atomic(&path, &safetensors::serialize(views, Some(meta)).map_err(|e| Error::file(&path, e))?)?;
    }
    if n > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": sizes.iter().sum::<u64>() },
            "weight_map": weight_map,
        });
        write_atomic(&dir.join(INDEX), serde_json::to_string_pretty(&index).expect("JSON").as_bytes())?;
    }
    let mut config = serde_json::to_value(config).map_err(|e| Error::file(dir.join("config.json"), e))?;
    if let Some(c) = config.as_object_mut() {
        // transformers 5 reads `dtype`, 4 `torch_dtype`: both state what was written.
        if c.contains_key("torch_dtype") {
            c.insert("torch_dtype".into(), dtype_name.into());
        }
        c.insert("dtype".into(), dtype_name.into());
    }
    let config_path = dir.join("config.json");
    write_atomic(&config_path, serde_json::to_string_pretty(&config).map_err(|e| Error::file(&config_path, e))?.as_bytes())?;
    // What an earlier save left that this one did not write would be read in its place.
    let written: Vec<String> = (0..n).map(name_of).chain((n > 1).then(|| INDEX.to_string())).collect();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let ours =
            name == SINGLE || name == INDEX || (name.starts_with("model-") && name.ends_with(".safetensors") && name.contains("-of-"));
        if ours && !written.contains(&name) {
            std::fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        }
    }
    Ok(())
}

/// Cuts tensors of `sizes` bytes, in order, into files of at most `max` bytes each (a tensor
/// larger than `max` alone in its file), as `transformers` does: one range per file.
pub(crate) fn plan_shards(sizes: &[u64], max: Option<u64>) -> Vec<std::ops::Range<usize>> {
    #[allow(clippy::single_range_in_vec_init)] // one file holding every tensor
    let Some(max) = max
    else {
        return vec![0..sizes.len()];
    };
    let (mut out, mut start, mut bytes) = (Vec::new(), 0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes + s > max {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += s;
    }
    out.push(start..sizes.len());
    out
}

/// Sorts `model.layers.10.x` after `model.layers.2.x`.
fn natural_key(name: &str) -> Vec<(u64, String)> {
    name.split('.').map(|p| p.parse::<u64>().map_or((u64::MAX, p.to_string()), |n| (n, String::new()))).collect()
}

/// Writes `path` through a temporary file and a rename, so a reader never sees half a file.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_cut_before_the_tensor_that_would_overflow() {
        assert_eq!(plan_shards(&[4, 4, 4], None), vec![0..3]);
        assert_eq!(plan_shards(&[4, 4, 4], Some(8)), vec![0..2, 2..3]);
        assert_eq!(plan_shards(&[4, 4, 4], Some(7)), vec![0..1, 1..2, 2..3]);
        // A tensor above the limit gets a file of its own.
        assert_eq!(plan_shards(&[2, 20, 2, 2], Some(5)), vec![0..1, 1..2, 2..4]);
        assert_eq!(plan_shards(&[], Some(5)), vec![0..0]);
        let mut names = vec!["model.layers.10.w", "model.layers.2.w", "lm_head.weight", "model.layers.2.a"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["lm_head.weight", "model.layers.2.a", "model.layers.2.w", "model.layers.10.w"]);
    }
}
