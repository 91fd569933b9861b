//! Tokenizers and token shards: text files, directories and JSON lines tokenized in parallel
//! into memory-mapped shards, read back as training windows without loading them whole.
//!
//! A shard is nanoGPT's flat layout (token ids, little-endian u16 when the vocabulary fits,
//! else u32) behind a 64-byte header: magic `KOLOTOK1`, format version (u32), bytes per token
//! (u32), tokens (u64), vocabulary size (u64), a fingerprint of the tokenizer (u64, FNV-1a of
//! its `tokenizer.json`), zeros. A directory of shards (`shard-00000.bin`, ...) written by one
//! [`prepare`] shares one tokenizer and ends with `manifest.json`, written last (the shards,
//! their token counts and SHA-256, the tokenizer): [`TokenShards::open`] reads only a directory
//! whose manifest is complete and whose shards match it, so an interrupted `prepare` or a stale
//! shard is refused instead of trained on.

use crate::{Error, Result};
use rayon::prelude::*;
use std::io::Write;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

const MAGIC: &[u8; 8] = b"KOLOTOK1";
const VERSION: u32 = 1;
/// Bytes before the first token.
pub const HEADER: usize = 64;

/// The file [`prepare`] writes last, naming the shards it wrote.
pub const MANIFEST: &str = "manifest.json";
const MANIFEST_FORMAT: &str = "kolo-token-shards";

/// `manifest.json`: the shards of one [`prepare`], in order.
#[derive(serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    /// FNV-1a of the tokenizer's `tokenizer.json`, hexadecimal.
    tokenizer: String,
    vocab_size: u64,
    tokens: u64,
    documents: usize,
    shards: Vec<ManifestShard>,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct ManifestShard {
    file: String,
    tokens: u64,
    sha256: String,
}

/// What a shard's header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardHeader {
    /// 2 (u16) or 4 (u32).
    pub bytes_per_token: u32,
    /// Tokens in the shard.
    pub tokens: u64,
    /// The tokenizer's vocabulary size (ids are below it).
    pub vocab_size: u64,
    /// FNV-1a of the tokenizer's `tokenizer.json`.
    pub tokenizer: u64,
}

impl ShardHeader {
    fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&self.bytes_per_token.to_le_bytes());
        h[16..24].copy_from_slice(&self.tokens.to_le_bytes());
        h[24..32].copy_from_slice(&self.vocab_size.to_le_bytes());
        h[32..40].copy_from_slice(&self.tokenizer.to_le_bytes());
        h
    }

    /// Parses and checks a header against the file's length.
    fn decode(b: &[u8], len: u64, path: &Path) -> Result<ShardHeader> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if b.len() < HEADER || &b[..8] != MAGIC {
            return Err(Error::file(path, "not a Kolo token shard (no KOLOTOK1 header)".to_string()));
        }
        if u32_at(8) != VERSION {
            return Err(Error::file(path, format!("token shard format {} (this Kolo reads {VERSION})", u32_at(8))));
        }
        let h = ShardHeader { bytes_per_token: u32_at(12), tokens: u64_at(16), vocab_size: u64_at(24), tokenizer: u64_at(32) };
        if !matches!(h.bytes_per_token, 2 | 4) {
            return Err(Error::file(path, format!("{} bytes per token (2 or 4)", h.bytes_per_token)));
        }
        let want = h.tokens.checked_mul(u64::from(h.bytes_per_token)).and_then(|n| n.checked_add(HEADER as u64));
        if want != Some(len) {
            return Err(Error::file(path, format!("the header says {} tokens but the file has {len} bytes", h.tokens)));
        }
        Ok(h)
    }
}

/// FNV-1a of bytes: the tokenizer's fingerprint.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

/// A tokenizer with the fingerprint its shards carry.
pub struct Tok {
    /// The tokenizer (Hugging Face `tokenizers`).
    pub tokenizer: Tokenizer,
    /// FNV-1a of its `tokenizer.json`.
    pub fingerprint: u64,
}

impl Tok {
    /// Loads a `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Tok> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        let tokenizer = Tokenizer::from_bytes(&bytes).map_err(|e| Error::file(path, e))?;
        Ok(Tok { tokenizer, fingerprint: fingerprint(&bytes) })
    }

    /// Tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2's kind: every byte is a token, merges on top) of
/// `vocab_size` tokens on `files`, with `<|endoftext|>` as its one special token, and writes it
/// to `out` (`tokenizer.json`).
pub fn train_bpe(files: &[PathBuf], vocab_size: usize, out: &Path) -> Result<Tok> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{AddedToken, TokenizerBuilder};
    if vocab_size < 257 {
        let reason = format!("a byte-level BPE needs a vocabulary of at least 257 tokens (256 bytes and <|endoftext|>), not {vocab_size}");
        return Err(Error::setting("--train-bpe", reason));
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build();
    let mut tok = TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default()))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .map_err(|e| Error::file(out, format!("building the BPE tokenizer: {e}")))?;
    let names = files.iter().map(|f| f.to_string_lossy().into_owned()).collect();
    tok.train_from_files(&mut trainer, names).map_err(|e| Error::file(out, format!("training the BPE tokenizer: {e}")))?;
    if let Some(d) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
    }
    tok.save(out, false).map_err(|e| Error::file(out, e))?;
    Tok::load(out)
}

/// The file a source reads.
fn source_path(s: &Source) -> &Path {
    match s {
        Source::Text(p) | Source::JsonLines { path: p, .. } => p,
    }
}

/// Where `prepare` reads text: whole files, or one field of each JSON line.
#[derive(Clone, Debug)]
pub enum Source {
    /// Each file is one document.
    Text(PathBuf),
    /// Each line is a JSON object; the document is its string field `field`.
    JsonLines {
        /// The file.
        path: PathBuf,
        /// The field holding the text.
        field: String,
    },
}

/// The sources under `inputs`: files as they are, directories walked (sorted, hidden entries
/// skipped); `.jsonl` files read as JSON lines when `field` is given.
pub fn sources(inputs: &[PathBuf], field: Option<&str>) -> Result<Vec<Source>> {
    fn walk(p: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
        if p.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
                .map_err(|e| Error::io(p, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|e| !e.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
                .collect();
            entries.sort();
            for e in entries {
                walk(&e, out)?;
            }
        } else if p.is_file() {
            out.push(p.to_path_buf());
        } else {
            return Err(Error::file(p, "no such file or directory".to_string()));
        }
        Ok(())
    }
    let mut files = Vec::new();
    for i in inputs {
        walk(i, &mut files)?;
    }
    Ok(files
        .into_iter()
        .map(|f| match field {
            Some(field) if f.extension().is_some_and(|e| e == "jsonl") => Source::JsonLines { path: f, field: field.to_string() },
            _ => Source::Text(f),
        })
        .collect())
}

/// The documents of one source.
fn documents(s: &Source) -> Result<Vec<String>> {
    match s {
        Source::Text(p) => Ok(vec![std::fs::read_to_string(p).map_err(|e| Error::file(p, format!("not UTF-8 text: {e}")))?]),
        Source::JsonLines { path, field } => {
            let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
            text.lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
                .map(|(i, l)| {
                    let v: serde_json::Value =
                        serde_json::from_str(l).map_err(|e| Error::file(path, format!("line {}: not a JSON line: {e}", i + 1)))?;
                    match v.get(field) {
                        Some(serde_json::Value::String(s)) => Ok(s.clone()),
                        _ => Err(Error::file(path, format!("line {}: no string field `{field}`", i + 1))),
                    }
                })
                .collect()
        }
    }
}

/// What [`prepare`] wrote.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The shard files, in order.
    pub shards: Vec<PathBuf>,
    /// Tokens written.
    pub tokens: u64,
    /// Documents tokenized.
    pub documents: usize,
}

/// Tokenizes `sources` in parallel (a thread pool over the sources; each document ends with the
/// tokenizer's `<|endoftext|>` when it has one) and writes shards of at most `shard_tokens`
/// tokens into `out`, in source order; `progress` is called with the sources done so far. Each
/// shard is written to a temporary name and renamed.
pub fn prepare(tok: &Tok, sources: &[Source], out: &Path, shard_tokens: usize, progress: &(dyn Fn(usize) + Sync)) -> Result<Prepared> {
    if shard_tokens == 0 {
        return Err(Error::setting("--shard-tokens", "a shard holds at least one token"));
    }
    let vocab = tok.vocab_size();
    let eot = tok.tokenizer.token_to_id("<|endoftext|>");
    let done = std::sync::atomic::AtomicUsize::new(0);
    let per_source: Vec<(Vec<u32>, usize)> = sources
        .par_iter()
        .map(|s| -> Result<(Vec<u32>, usize)> {
            // An empty document adds nothing, not even its end-of-text token.
            let docs: Vec<String> = documents(s)?.into_iter().filter(|d| !d.is_empty()).collect();
            let mut ids = Vec::new();
            for d in &docs {
                let e = tok.tokenizer.encode(d.as_str(), false).map_err(|e| Error::file(source_path(s), format!("tokenizing: {e}")))?;
                ids.extend_from_slice(e.get_ids());
                ids.extend(eot);
            }
            progress(done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1);
            Ok((ids, docs.len()))
        })
        .collect::<Result<_>>()?;
    let tokens: u64 = per_source.iter().map(|(ids, _)| ids.len() as u64).sum();
    if tokens == 0 {
        return Err(Error::file(out, "the inputs hold no text: no token shards written"));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let earlier: Vec<String> = std::fs::read_dir(out)
        .map_err(|e| Error::io(out, e))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n == MANIFEST || (n.starts_with("shard-") && n.ends_with(".bin")) || n.starts_with(".shard-"))
        .collect();
    if !earlier.is_empty() {
        let reason = format!(
            "holds the shards of an earlier prepare ({} files, {}): choose an empty directory or remove them",
            earlier.len(),
            earlier.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        );
        return Err(Error::file(out, reason));
    }
    let bytes_per_token: u32 = if vocab <= 1 << 16 { 2 } else { 4 };
    let all = per_source.iter().flat_map(|(ids, _)| ids.iter().copied());
    let (mut shards, mut listed) = (Vec::new(), Vec::new());
    let mut buf: Vec<u32> = Vec::with_capacity(shard_tokens.min(1 << 24));
    let mut write = |buf: &mut Vec<u32>| -> Result<()> {
        let path = out.join(format!("shard-{:05}.bin", shards.len()));
        let tmp = out.join(format!(".shard-{:05}.tmp", shards.len()));
        let h = ShardHeader { bytes_per_token, tokens: buf.len() as u64, vocab_size: vocab as u64, tokenizer: tok.fingerprint };
        // Streamed to the file and the hash together.
        let written = || -> std::io::Result<String> {
            use sha2::Digest;
            let mut hash = sha2::Sha256::new();
            let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
            let mut put = |b: &[u8]| -> std::io::Result<()> {
                hash.update(b);
                f.write_all(b)
            };
            put(&h.encode())?;
            for &t in buf.iter() {
                if bytes_per_token == 2 {
                    put(&(t as u16).to_le_bytes())?;
                } else {
                    put(&t.to_le_bytes())?;
                }
            }
            f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
            Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
        };
        let sha256 = written().map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        let file = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        listed.push(ManifestShard { file, tokens: buf.len() as u64, sha256 });
        shards.push(path);
        buf.clear();
        Ok(())
    };
    for t in all {
        buf.push(t);
        if buf.len() == shard_tokens {
            write(&mut buf)?;
        }
    }
    if !buf.is_empty() {
        write(&mut buf)?;
    }
    let documents = per_source.iter().map(|(_, d)| d).sum();
    let manifest = Manifest {
        format: MANIFEST_FORMAT.into(),
        version: VERSION,
        tokenizer: format!("{:016x}", tok.fingerprint),
        vocab_size: vocab as u64,
        tokens,
        documents,
        shards: listed,
    };
    let text = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::file(out.join(MANIFEST), e))?;
    write_durably(&out.join(".manifest.json.tmp"), &out.join(MANIFEST), &text)?;
    Ok(Prepared { shards, tokens, documents })
}

/// Writes `bytes` to `tmp`, syncs it and renames it to `path`.
fn write_durably(tmp: &Path, path: &Path, bytes: &[u8]) -> Result<()> {
    let written = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    written().map_err(|e| Error::io(tmp, e))?;
    std::fs::rename(tmp, path).map_err(|e| Error::io(path, e))
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A directory of token shards, memory-mapped: training windows are read where they lie.
pub struct TokenShards {
    dir: PathBuf,
    maps: Vec<(memmap2::Mmap, ShardHeader)>,
    header: ShardHeader,
}

impl TokenShards {
    /// Maps the shards `dir/manifest.json` lists, after checking each against it (its length,
    /// header and SHA-256). A directory without a complete manifest (an interrupted or older
    /// `prepare`) is refused; shards it does not list are not read.
    pub fn open(dir: &Path) -> Result<TokenShards> {
        let mpath = dir.join(MANIFEST);
        let meta = std::fs::metadata(&mpath).map_err(|e| {
            let why = format!(
                "no {MANIFEST} ({e}): not a complete `kolo data prepare` output (interrupted, or by an older Kolo); prepare it again"
            );
            Error::file(dir, why)
        })?;
        if !meta.is_file() || meta.len() > 64 << 20 {
            return Err(Error::file(&mpath, "not a manifest (not a regular file of at most 64 MiB)"));
        }
        let text = std::fs::read(&mpath).map_err(|e| Error::io(&mpath, e))?;
        let m: Manifest = serde_json::from_slice(&text).map_err(|e| Error::file(&mpath, e))?;
        if m.format != MANIFEST_FORMAT || m.version != VERSION || m.shards.is_empty() {
            let why = format!(
                "format {} version {} with {} shards (this Kolo reads {MANIFEST_FORMAT} version {VERSION})",
                m.format,
                m.version,
                m.shards.len()
            );
            return Err(Error::file(&mpath, why));
        }
        let mut maps = Vec::with_capacity(m.shards.len());
        for s in &m.shards {
            if s.file.contains('/') || s.file.contains('\\') || s.file.starts_with('.') {
                return Err(Error::file(&mpath, format!("shard name `{}` is not a file of the directory", s.file)));
            }
            let f = dir.join(&s.file);
            let file = std::fs::File::open(&f).map_err(|e| Error::io(&f, e))?;
            // SAFETY: shards are written once, to a temporary name, and renamed; nothing
            // writes to a shard file after that.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&f, e))?;
            let h = ShardHeader::decode(&map[..map.len().min(HEADER)], map.len() as u64, &f)?;
            let fits = h.tokens == s.tokens && format!("{:016x}", h.tokenizer) == m.tokenizer && h.vocab_size == m.vocab_size;
            if !fits {
                let reason = format!(
                    "made with another tokenizer or holding other tokens than {MANIFEST} lists (fingerprint {:016x}, vocabulary {}, {} tokens; listed: {}, {}, {})",
                    h.tokenizer, h.vocab_size, h.tokens, m.tokenizer, m.vocab_size, s.tokens
                );
                return Err(Error::file(&f, reason));
            }
            if sha256_hex(&map) != s.sha256 {
                return Err(Error::file(&f, format!("its SHA-256 is not the one {MANIFEST} lists: the shard changed after prepare")));
            }
            maps.push((map, h));
        }
        let header = maps[0].1;
        Ok(TokenShards { dir: dir.to_path_buf(), maps, header })
    }

    /// The first shard's header (every shard shares tokenizer and vocabulary).
    pub fn header(&self) -> ShardHeader {
        self.header
    }

    /// Tokens in all shards.
    pub fn tokens(&self) -> u64 {
        self.maps.iter().map(|(_, h)| h.tokens).sum()
    }

    /// Refuses shards whose tokenizer is not `tok` or whose ids do not fit a model embedding
    /// `model_vocab` tokens.
    pub fn check(&self, tok: Option<&Tok>, model_vocab: usize) -> Result<()> {
        if let Some(t) = tok.filter(|t| t.fingerprint != self.header.tokenizer) {
            let reason = format!(
                "the shards were made with another tokenizer (fingerprint {:016x}; this tokenizer's is {:016x})",
                self.header.tokenizer, t.fingerprint
            );
            return Err(Error::file(&self.dir, reason));
        }
        if self.header.vocab_size > model_vocab as u64 {
            let reason = format!("the shards' tokenizer has {} tokens but the model embeds {model_vocab}", self.header.vocab_size);
            return Err(Error::file(&self.dir, reason));
        }
        Ok(())
    }

    /// Windows of `len` tokens: consecutive, non-overlapping, never across a shard's end.
    pub fn windows(&self, len: usize) -> usize {
        self.maps.iter().map(|(_, h)| h.tokens as usize / len.max(1)).sum()
    }

    /// The tokens of window `i` of length `len`, read from the mapped shard.
    pub fn window(&self, i: usize, len: usize) -> Vec<u32> {
        let mut i = i;
        for (map, h) in &self.maps {
            let n = h.tokens as usize / len.max(1);
            if i < n {
                let bpt = h.bytes_per_token as usize;
                let at = HEADER + i * len * bpt;
                let b = &map[at..at + len * bpt];
                return if bpt == 2 {
                    b.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect()
                } else {
                    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
                };
            }
            i -= n;
        }
        panic!("window {i} of length {len} is past the shards' {} windows", self.windows(len));
    }
}
