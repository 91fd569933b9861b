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
    /// Loads a `tokenizer.json`, or the one in a model directory.
    pub fn load(path: &Path) -> Result<Tok> {
        let file = path.join("tokenizer.json");
        let path = if path.is_dir() { file.as_path() } else { path };
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

/// Tokenizes `sources` and writes shards of at most `shard_tokens` tokens into `out`, in source
/// order (each document ends with the tokenizer's `<|endoftext|>` when it has one; an empty
/// document adds nothing); `progress` is called with the sources done so far. Memory does not
/// grow with the input (issue #34: one 50 MB line took 8.4 GB): files are read in blocks of
/// [`PIECE`] bytes cut after a newline where there is one, [`BATCH`] pieces are tokenized in
/// parallel at a time, and shards are written as they fill. Each shard is written to a
/// temporary name and renamed; `manifest.json` comes last.
pub fn prepare(tok: &Tok, sources: &[Source], out: &Path, shard_tokens: usize, progress: &(dyn Fn(usize) + Sync)) -> Result<Prepared> {
    if shard_tokens == 0 {
        return Err(Error::setting("--shard-tokens", "a shard holds at least one token"));
    }
    refuse_earlier_shards(out)?;
    let mut w = ShardWriter::new(tok, out, shard_tokens);
    let eot = tok.tokenizer.token_to_id("<|endoftext|>");
    let mut batch: Vec<Piece> = Vec::with_capacity(BATCH);
    let mut documents = 0usize;
    let mut flush = |batch: &mut Vec<Piece>, w: &mut ShardWriter, s: &Source| -> Result<()> {
        let texts: Vec<&str> = batch.iter().filter_map(|p| if let Piece::Text(t) = p { Some(t.as_str()) } else { None }).collect();
        let ids: Vec<Vec<u32>> = texts
            .par_iter()
            .map(|t| tok.tokenizer.encode(*t, false).map(|e| e.get_ids().to_vec()))
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| Error::file(source_path(s), format!("tokenizing: {e}")))?;
        let mut next = ids.into_iter();
        for p in batch.drain(..) {
            match p {
                Piece::Text(_) => w.push(&next.next().unwrap_or_default())?,
                Piece::End => {
                    documents += 1;
                    w.push(eot.as_slice())?;
                }
            }
        }
        Ok(())
    };
    for (n, s) in sources.iter().enumerate() {
        pieces(s, &mut |p| {
            batch.push(p);
            if batch.len() >= BATCH {
                flush(&mut batch, &mut w, s)?;
            }
            Ok(())
        })?;
        flush(&mut batch, &mut w, s)?;
        progress(n + 1);
    }
    w.finish(documents)
}

/// Bytes of text tokenized as one piece.
pub const PIECE: usize = 256 * 1024;
/// Pieces tokenized in parallel at a time.
pub const BATCH: usize = 16;

/// A document's text, a piece at a time, and its end.
enum Piece {
    Text(String),
    End,
}

/// Hands `emit` the pieces of every non-empty document of `s`, in order.
fn pieces(s: &Source, emit: &mut dyn FnMut(Piece) -> Result<()>) -> Result<()> {
    use std::io::{BufRead, Read};
    match s {
        Source::Text(p) => {
            let f = std::fs::File::open(p).map_err(|e| Error::io(p, e))?;
            let mut r = std::io::BufReader::with_capacity(PIECE, f);
            let (mut carry, mut any) = (Vec::new(), false);
            loop {
                let mut block = std::mem::take(&mut carry);
                let got = (&mut r).take(PIECE as u64).read_to_end(&mut block).map_err(|e| Error::io(p, e))?;
                let last = got == 0;
                // Cut after the last newline, else before a UTF-8 sequence's first byte.
                let cut = if last {
                    block.len()
                } else {
                    match block.iter().rposition(|b| *b == b'\n') {
                        Some(i) => i + 1,
                        None => block.iter().rposition(|b| (*b & 0xC0) != 0x80).filter(|i| *i > 0).unwrap_or(block.len()),
                    }
                };
                carry = block.split_off(cut);
                if !block.is_empty() {
                    let text = String::from_utf8(block).map_err(|e| Error::file(p, format!("not UTF-8 text: {e}")))?;
                    any = true;
                    emit(Piece::Text(text))?;
                }
                if last {
                    break;
                }
            }
            if any {
                emit(Piece::End)?;
            }
        }
        Source::JsonLines { path, field } => {
            let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
            for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
                let line = line.map_err(|e| Error::file(path, format!("line {}: {e}", i + 1)))?;
                if line.trim().is_empty() {
                    continue;
                }
                let v: serde_json::Value =
                    serde_json::from_str(&line).map_err(|e| Error::file(path, format!("line {}: not a JSON line: {e}", i + 1)))?;
                let Some(serde_json::Value::String(text)) = v.get(field) else {
                    return Err(Error::file(path, format!("line {}: no string field `{field}`", i + 1)));
                };
                if text.is_empty() {
                    continue;
                }
                let mut rest = text.as_str();
                while !rest.is_empty() {
                    let mut cut = rest.len().min(PIECE);
                    while !rest.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    emit(Piece::Text(rest[..cut].to_string()))?;
                    rest = &rest[cut..];
                }
                emit(Piece::End)?;
            }
        }
    }
    Ok(())
}

/// Refuses an output directory that holds the shards of an earlier prepare.
fn refuse_earlier_shards(out: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
    let earlier: Vec<String> = entries
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n == MANIFEST || (n.starts_with("shard-") && n.ends_with(".bin")) || n.starts_with(".shard-"))
        .collect();
    if earlier.is_empty() {
        return Ok(());
    }
    let reason = format!(
        "holds the shards of an earlier prepare ({} files, {}): choose an empty directory or remove them",
        earlier.len(),
        earlier.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
    );
    Err(Error::file(out, reason))
}

/// Shards written as tokens arrive, and the manifest at the end.
struct ShardWriter<'a> {
    tok: &'a Tok,
    out: &'a Path,
    shard_tokens: usize,
    bytes_per_token: u32,
    buf: Vec<u32>,
    shards: Vec<PathBuf>,
    listed: Vec<ManifestShard>,
    tokens: u64,
}

impl<'a> ShardWriter<'a> {
    fn new(tok: &'a Tok, out: &'a Path, shard_tokens: usize) -> ShardWriter<'a> {
        let bytes_per_token = if tok.vocab_size() <= 1 << 16 { 2 } else { 4 };
        let buf = Vec::with_capacity(shard_tokens.min(1 << 24));
        ShardWriter { tok, out, shard_tokens, bytes_per_token, buf, shards: Vec::new(), listed: Vec::new(), tokens: 0 }
    }

    fn push(&mut self, ids: &[u32]) -> Result<()> {
        for &t in ids {
            self.buf.push(t);
            self.tokens += 1;
            if self.buf.len() == self.shard_tokens {
                self.write()?;
            }
        }
        Ok(())
    }

    /// Writes the buffered tokens as the next shard.
    fn write(&mut self) -> Result<()> {
        if self.shards.is_empty() {
            std::fs::create_dir_all(self.out).map_err(|e| Error::io(self.out, e))?;
        }
        let (bpt, n) = (self.bytes_per_token, self.shards.len());
        let path = self.out.join(format!("shard-{n:05}.bin"));
        let tmp = self.out.join(format!(".shard-{n:05}.tmp"));
        let h = ShardHeader {
            bytes_per_token: bpt,
            tokens: self.buf.len() as u64,
            vocab_size: self.tok.vocab_size() as u64,
            tokenizer: self.tok.fingerprint,
        };
        let buf = &self.buf;
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
                if bpt == 2 {
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
        self.listed.push(ManifestShard { file: format!("shard-{n:05}.bin"), tokens: self.buf.len() as u64, sha256 });
        self.shards.push(path);
        self.buf.clear();
        Ok(())
    }

    /// Writes the last shard and the manifest.
    fn finish(mut self, documents: usize) -> Result<Prepared> {
        if self.tokens == 0 {
            return Err(Error::file(self.out, "the inputs hold no text: no token shards written"));
        }
        if !self.buf.is_empty() {
            self.write()?;
        }
        let manifest = Manifest {
            format: MANIFEST_FORMAT.into(),
            version: VERSION,
            tokenizer: format!("{:016x}", self.tok.fingerprint),
            vocab_size: self.tok.vocab_size() as u64,
            tokens: self.tokens,
            documents,
            shards: std::mem::take(&mut self.listed),
        };
        let text = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::file(self.out.join(MANIFEST), e))?;
        write_durably(&self.out.join(".manifest.json.tmp"), &self.out.join(MANIFEST), &text)?;
        Ok(Prepared { shards: self.shards, tokens: self.tokens, documents })
    }
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
