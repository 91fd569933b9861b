//! Datasets: MNIST from its idx(.gz) files, character-level text corpora, and fixed synthetic
//! batches (for benchmarks that must not measure data loading).

use crate::TrainError;
use flate2::read::GzDecoder;
use kolo_tensor::{Batch, Input};
use std::io::Read;
use std::path::{Path, PathBuf};

/// A dataset addressable by example index.
pub trait Dataset: Send + Sync {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The examples at `idx`, as one batch.
    fn batch(&self, idx: &[usize]) -> Batch;
    /// A one-line description for logs.
    fn describe(&self) -> String;
}

fn read_maybe_gz(path: &Path) -> Result<Vec<u8>, TrainError> {
    let raw = std::fs::read(path).map_err(|e| TrainError::Data(format!("{}: {e}", path.display())))?;
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        GzDecoder::new(&raw[..]).read_to_end(&mut out).map_err(|e| TrainError::Data(format!("{}: bad gzip: {e}", path.display())))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

fn be_u32(b: &[u8], at: usize, path: &Path) -> Result<usize, TrainError> {
    b.get(at..at + 4)
        .map(|s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]) as usize)
        .ok_or_else(|| TrainError::Data(format!("{}: truncated idx header", path.display())))
}

/// Finds `name` or `name.gz` in `dir`.
fn find(dir: &Path, name: &str) -> Result<PathBuf, TrainError> {
    for cand in [dir.join(format!("{name}.gz")), dir.join(name)] {
        if cand.exists() {
            return Ok(cand);
        }
    }
    Err(TrainError::Data(format!("MNIST file {name}(.gz) not found in {}", dir.display())))
}

/// MNIST images (normalised like torchvision: (x/255 - 0.1307) / 0.3081) and labels.
pub struct Mnist {
    images: Vec<f32>,
    labels: Vec<u8>,
    split: &'static str,
}

impl Mnist {
    /// `split` is "train" or "t10k".
    pub fn load(dir: &Path, split: &'static str) -> Result<Mnist, TrainError> {
        let ip = find(dir, &format!("{split}-images-idx3-ubyte"))?;
        let lp = find(dir, &format!("{split}-labels-idx1-ubyte"))?;
        let ib = read_maybe_gz(&ip)?;
        let lb = read_maybe_gz(&lp)?;
        if be_u32(&ib, 0, &ip)? != 0x803 || be_u32(&lb, 0, &lp)? != 0x801 {
            return Err(TrainError::Data(format!("{} / {}: not MNIST idx files (bad magic)", ip.display(), lp.display())));
        }
        let (n, rows, cols) = (be_u32(&ib, 4, &ip)?, be_u32(&ib, 8, &ip)?, be_u32(&ib, 12, &ip)?);
        let nl = be_u32(&lb, 4, &lp)?;
        if (rows, cols) != (28, 28) || n != nl || ib.len() != 16 + n * 784 || lb.len() != 8 + n {
            return Err(TrainError::Data(format!("{}: inconsistent sizes ({n} images {rows}x{cols}, {nl} labels)", ip.display())));
        }
        let images = ib[16..].iter().map(|p| (*p as f32 / 255.0 - 0.1307) / 0.3081).collect();
        let labels = lb[8..].to_vec();
        if let Some(bad) = labels.iter().find(|l| **l > 9) {
            return Err(TrainError::Data(format!("{}: label {bad} out of range", lp.display())));
        }
        Ok(Mnist { images, labels, split })
    }
}

impl Mnist {
    /// Every example's label.
    pub fn labels(&self) -> &[u8] {
        &self.labels
    }
    /// Example `i`'s normalised pixels.
    pub fn image(&self, i: usize) -> &[f32] {
        &self.images[i * 784..(i + 1) * 784]
    }
}

impl Dataset for Mnist {
    fn len(&self) -> usize {
        self.labels.len()
    }
    fn batch(&self, idx: &[usize]) -> Batch {
        let mut data = Vec::with_capacity(idx.len() * 784);
        for &i in idx {
            data.extend_from_slice(&self.images[i * 784..(i + 1) * 784]);
        }
        Batch {
            input: Input::Images { data, n: idx.len(), c: 1, h: 28, w: 28 },
            targets: idx.iter().map(|&i| u32::from(self.labels[i])).collect(),
        }
    }
    fn describe(&self) -> String {
        format!("MNIST {} ({} images)", self.split, self.len())
    }
}

/// Character vocabulary: the sorted distinct bytes of a corpus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharVocab {
    pub chars: Vec<u8>,
}

impl CharVocab {
    pub fn from_text(text: &[u8]) -> CharVocab {
        let mut seen = [false; 256];
        text.iter().for_each(|b| seen[*b as usize] = true);
        CharVocab { chars: (0..=255u8).filter(|b| seen[*b as usize]).collect() }
    }
    pub fn len(&self) -> usize {
        self.chars.len()
    }
    pub fn is_empty(&self) -> bool {
        self.chars.is_empty()
    }
    pub fn encode(&self, text: &[u8]) -> Result<Vec<u32>, TrainError> {
        let mut map = [u32::MAX; 256];
        self.chars.iter().enumerate().for_each(|(i, c)| map[*c as usize] = i as u32);
        text.iter()
            .map(|b| match map[*b as usize] {
                u32::MAX => Err(TrainError::Data(format!("character {:?} is not in the vocabulary", *b as char))),
                i => Ok(i),
            })
            .collect()
    }
    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|i| self.chars.get(*i as usize).copied().unwrap_or(b'?') as char).collect()
    }
}

/// Windows of `seq` tokens of a corpus; example `i` starts at token `i` and its targets are the
/// next tokens.
pub struct TextWindows {
    tokens: Vec<u32>,
    seq: usize,
    name: String,
}

impl TextWindows {
    pub fn new(tokens: Vec<u32>, seq: usize, name: String) -> Result<TextWindows, TrainError> {
        if tokens.len() <= seq + 1 {
            return Err(TrainError::Data(format!("{name}: {} tokens is too short for sequences of {seq}", tokens.len())));
        }
        Ok(TextWindows { tokens, seq, name })
    }
}

impl Dataset for TextWindows {
    fn len(&self) -> usize {
        self.tokens.len() - self.seq - 1
    }
    fn batch(&self, idx: &[usize]) -> Batch {
        let t = self.seq;
        let mut ids = Vec::with_capacity(idx.len() * t);
        let mut targets = Vec::with_capacity(idx.len() * t);
        for &i in idx {
            ids.extend_from_slice(&self.tokens[i..i + t]);
            targets.extend_from_slice(&self.tokens[i + 1..i + t + 1]);
        }
        Batch { input: Input::Tokens { ids, b: idx.len(), t }, targets }
    }
    fn describe(&self) -> String {
        format!("{} ({} tokens, windows of {})", self.name, self.tokens.len(), self.seq)
    }
}

/// Splits a text into (train, validation) windows: the first `train_fraction` of the characters
/// and the rest, as nanoGPT does.
pub fn text_split(
    text: &[u8],
    vocab: &CharVocab,
    seq: usize,
    train_fraction: f64,
    name: &str,
) -> Result<(TextWindows, TextWindows), TrainError> {
    let tokens = vocab.encode(text)?;
    let cut = ((tokens.len() as f64) * train_fraction) as usize;
    Ok((
        TextWindows::new(tokens[..cut].to_vec(), seq, format!("{name} train"))?,
        TextWindows::new(tokens[cut..].to_vec(), seq, format!("{name} validation"))?,
    ))
}

/// Fixed random examples, generated once per rank (like the peers' benchmark data).
pub struct Synthetic {
    batch: Batch,
    n: usize,
}

impl Synthetic {
    pub fn images(n: usize, seed: u64) -> Synthetic {
        Synthetic { batch: Batch::random_images(n, seed), n }
    }

    pub fn tokens(n: usize, seq: usize, vocab: usize, seed: u64) -> Synthetic {
        Synthetic { batch: Batch::random_tokens(n, seq, vocab, seed), n }
    }
}

impl Dataset for Synthetic {
    fn len(&self) -> usize {
        self.n
    }
    fn batch(&self, idx: &[usize]) -> Batch {
        match &self.batch.input {
            Input::Images { data, .. } => {
                let mut d = Vec::with_capacity(idx.len() * 784);
                idx.iter().for_each(|i| d.extend_from_slice(&data[i * 784..(i + 1) * 784]));
                Batch {
                    input: Input::Images { data: d, n: idx.len(), c: 1, h: 28, w: 28 },
                    targets: idx.iter().map(|i| self.batch.targets[*i]).collect(),
                }
            }
            Input::Tokens { ids, t, .. } => {
                let t = *t;
                let mut x = Vec::with_capacity(idx.len() * t);
                let mut y = Vec::with_capacity(idx.len() * t);
                for &i in idx {
                    x.extend_from_slice(&ids[i * t..(i + 1) * t]);
                    y.extend_from_slice(&self.batch.targets[i * t..(i + 1) * t]);
                }
                Batch { input: Input::Tokens { ids: x, b: idx.len(), t }, targets: y }
            }
        }
    }
    fn describe(&self) -> String {
        format!("synthetic fixed data ({} examples)", self.n)
    }
}

#[cfg(feature = "ps")]
/// UCI Wine Quality (red) as a sparse binary problem for Hogwild: is the quality at least 6?
/// Each of the 11 features is cut into `bins` quantile bins (one-hot), and every pair of
/// features contributes the one-hot cross of their bins: 11 + 55 active coordinates out of
/// `11 * bins + 55 * bins^2`.
pub fn wine_sparse(path: &Path, bins: usize) -> Result<kolo_ps::hogwild::SparseSet, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut rows: Vec<Vec<f64>> = Vec::new();
    for (n, line) in text.lines().enumerate().skip(1) {
        let row: Vec<f64> = line
            .split(',')
            .map(|f| f.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        if row.len() != 12 {
            return Err(format!("{}:{}: {} columns, expected 12", path.display(), n + 1, row.len()));
        }
        rows.push(row);
    }
    let bins = bins.max(1);
    let nf = 11;
    // Quantile edges per feature.
    let edges: Vec<Vec<f64>> = (0..nf)
        .map(|f| {
            let mut v: Vec<f64> = rows.iter().map(|r| r[f]).collect();
            v.sort_by(f64::total_cmp);
            (1..bins).map(|b| v[b * v.len() / bins]).collect()
        })
        .collect();
    let bin = |f: usize, x: f64| edges[f].partition_point(|e| *e <= x);
    let pairs: Vec<(usize, usize)> = (0..nf).flat_map(|a| (a + 1..nf).map(move |b| (a, b))).collect();
    let dim = nf * bins + pairs.len() * bins * bins;
    let examples = rows
        .iter()
        .map(|r| {
            let b: Vec<usize> = (0..nf).map(|f| bin(f, r[f])).collect();
            let mut idx: Vec<u32> = (0..nf).map(|f| (f * bins + b[f]) as u32).collect();
            idx.extend(pairs.iter().enumerate().map(|(p, &(x, y))| (nf * bins + p * bins * bins + b[x] * bins + b[y]) as u32));
            let val = vec![1.0; idx.len()];
            kolo_ps::hogwild::SparseExample { idx, val, label: f32::from(r[11] >= 6.0) }
        })
        .collect();
    Ok(kolo_ps::hogwild::SparseSet { dim, examples })
}
