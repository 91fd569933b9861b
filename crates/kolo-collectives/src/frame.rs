//! The header in front of every message on a link.
//!
//! ```text
//!  0      4   5    6     7     8        16      20      24       32    33        36       40
//!  | KOLM | v | op | dt  | alg | seq u64 | step  | tag   | len u64 | red | root u24 | check |
//! ```
//! Little-endian. `check` is an FNV-1a hash of the first 36 bytes, so a torn or garbage header is
//! caught before any field is trusted. `len` is bounded by [`MAX_MESSAGE`]. The receiver knows what
//! it expects (the same collective on every rank) and compares: a different op, reduce op, root,
//! dtype, sequence number or length is reported as a mismatched collective, not silently
//! consumed (`red` is 0 for collectives that do not reduce, `root` is the root + 1, 0 for none).

use kolo_base::DType;
use kolo_comm::{OpKind, ReduceOp};

pub const HEADER_LEN: usize = 40;
const MAGIC: [u8; 4] = *b"KOLM";
const VERSION: u8 = 2;
/// Largest root a header carries (24 bits, minus the "none" code).
const MAX_ROOT: u32 = (1 << 24) - 2;
/// Largest payload one message may announce (16 GiB); bigger buffers are split by algorithms.
pub const MAX_MESSAGE: u64 = 16 << 30;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub op: OpKind,
    /// `None` for messages without elements (barrier, setup).
    pub dtype: Option<DType>,
    /// Algorithm code, so ranks that picked different algorithms notice.
    pub alg: u8,
    /// Collective sequence number (per group), or per-pair message number for send/recv.
    pub seq: u64,
    /// Step of the algorithm this message belongs to.
    pub step: u32,
    pub tag: u32,
    /// Payload bytes that follow.
    pub len: u64,
    /// How a reducing collective combines (`None` for the others).
    pub red: Option<ReduceOp>,
    /// The root of a rooted collective (reduce, broadcast).
    pub root: Option<u32>,
}

fn fnv(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c9dc5u32, |h, b| (h ^ u32::from(*b)).wrapping_mul(0x01000193))
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.op.code();
        b[6] = self.dtype.map_or(0, DType::code);
        b[7] = self.alg;
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..20].copy_from_slice(&self.step.to_le_bytes());
        b[20..24].copy_from_slice(&self.tag.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32] = self.red.map_or(0, ReduceOp::code);
        let root = self.root.map_or(0, |r| r.min(MAX_ROOT) + 1);
        b[33..36].copy_from_slice(&root.to_le_bytes()[..3]);
        let c = fnv(&b[..36]);
        b[36..40].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Parses untrusted bytes. Never panics; every field is checked.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, String> {
        if b[0..4] != MAGIC {
            return Err(format!("bad magic {:02x?} (not a Kolo message, or the stream lost its framing)", &b[0..4]));
        }
        let check = u32::from_le_bytes([b[36], b[37], b[38], b[39]]);
        if check != fnv(&b[..36]) {
            return Err("header checksum mismatch (corrupted header)".into());
        }
        if b[4] != VERSION {
            return Err(format!("wire version {} (this build speaks {VERSION})", b[4]));
        }
        let op = OpKind::from_code(b[5]).ok_or_else(|| format!("unknown op code {}", b[5]))?;
        let dtype = match b[6] {
            0 => None,
            c => Some(DType::from_code(c).ok_or_else(|| format!("unknown dtype code {c}"))?),
        };
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let len = u64_at(24);
        if len > MAX_MESSAGE {
            return Err(format!("announced payload of {len} bytes exceeds the {MAX_MESSAGE}-byte limit"));
        }
        let red = match b[32] {
            0 => None,
            c => Some(ReduceOp::from_code(c).ok_or_else(|| format!("unknown reduce op code {c}"))?),
        };
        let root = match u32::from_le_bytes([b[33], b[34], b[35], 0]) {
            0 => None,
            r => Some(r - 1),
        };
        Ok(Header { op, dtype, alg: b[7], seq: u64_at(8), step: u32_at(16), tag: u32_at(20), len, red, root })
    }

    pub fn describe(&self) -> String {
        let dt = self.dtype.map_or(String::new(), |d| format!(" {d}"));
        let red = self.red.map_or(String::new(), |r| format!(" {r}"));
        let root = self.root.map_or(String::new(), |r| format!(", root {r}"));
        format!(
            "{}{red} #{} (step {}, tag {},{dt} {} bytes, algorithm {}{root})",
            self.op, self.seq, self.step, self.tag, self.len, self.alg
        )
    }
}
