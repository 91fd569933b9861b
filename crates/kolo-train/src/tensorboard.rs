//! TensorBoard event files (scalars), written without TensorFlow: a TFRecord stream of
//! `Event` protocol buffers. Each record is `len: u64 LE, masked_crc32c(len): u32, data,
//! masked_crc32c(data): u32`; an `Event` here carries `wall_time` (field 1, double), `step`
//! (2, int64) and either `file_version` (3, string, the first record) or a `Summary` (5) with
//! one `Value { tag (1), simple_value (2, float) }`. [`read_scalars`] parses them back, checking
//! every CRC, so the tests need no TensorBoard.

use std::io::Write;
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli), bitwise-reflected, table-driven.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let t = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, b| t[((c ^ u32::from(*b)) & 0xff) as usize] ^ (c >> 8))
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn event(wall: f64, step: i64, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut e = vec![0x09]; // field 1, 64-bit
    e.extend_from_slice(&wall.to_le_bytes());
    e.push(0x10); // field 2, varint
    varint(step as u64, &mut e);
    body(&mut e);
    e
}

pub struct EventWriter {
    file: std::io::BufWriter<std::fs::File>,
    pub path: PathBuf,
}

impl EventWriter {
    /// A new event file in `dir` (created if needed).
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let path = dir.join(format!("events.out.tfevents.{}.kolo.{}", now.as_secs(), std::process::id()));
        let mut w = EventWriter { file: std::io::BufWriter::new(std::fs::File::create(&path)?), path };
        let first = event(now.as_secs_f64(), 0, |e| {
            let v = b"brain.Event:2";
            e.push(0x1a); // field 3, length-delimited
            varint(v.len() as u64, e);
            e.extend_from_slice(v);
        });
        w.record(&first)?;
        w.file.flush()?;
        Ok(w)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked(data).to_le_bytes())
    }

    /// One scalar point; written through at once (a crashed run keeps what it logged).
    pub fn scalar(&mut self, tag: &str, step: u64, value: f32) -> std::io::Result<()> {
        let wall = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs_f64();
        let mut val = vec![0x0a]; // Value.tag
        varint(tag.len() as u64, &mut val);
        val.extend_from_slice(tag.as_bytes());
        val.push(0x15); // Value.simple_value, 32-bit
        val.extend_from_slice(&value.to_le_bytes());
        let mut summary = vec![0x0a]; // Summary.value
        varint(val.len() as u64, &mut summary);
        summary.extend_from_slice(&val);
        let e = event(wall, step as i64, |e| {
            e.push(0x2a); // Event.summary, field 5
            varint(summary.len() as u64, e);
            e.extend_from_slice(&summary);
        });
        self.record(&e)?;
        self.file.flush()
    }
}

/// One protobuf field: number, wire type, varint or fixed value (or length), and its bytes.
type Field<'a> = (u64, u8, u64, &'a [u8]);

/// A minimal protobuf field walker.
fn fields(mut b: &[u8]) -> Result<Vec<Field<'_>>, String> {
    let mut out = Vec::new();
    let take_varint = |b: &mut &[u8]| -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&x, rest) = b.split_first().ok_or("truncated varint")?;
            *b = rest;
            v |= u64::from(x & 0x7f) << shift;
            if x & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint too long".into())
    };
    while !b.is_empty() {
        let key = take_varint(&mut b)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        match wire {
            0 => {
                let v = take_varint(&mut b)?;
                out.push((field, wire, v, &b[..0]));
            }
            1 | 5 => {
                let n = if wire == 1 { 8 } else { 4 };
                let (x, rest) = b.split_at_checked(n).ok_or("truncated fixed field")?;
                let mut v = [0u8; 8];
                v[..n].copy_from_slice(x);
                out.push((field, wire, u64::from_le_bytes(v), x));
                b = rest;
            }
            2 => {
                let n = take_varint(&mut b)? as usize;
                let (x, rest) = b.split_at_checked(n).ok_or("truncated bytes field")?;
                out.push((field, wire, n as u64, x));
                b = rest;
            }
            w => return Err(format!("unsupported wire type {w}")),
        }
    }
    Ok(out)
}

/// Reads an event file back: every record's CRCs checked; returns `(tag, step, value)` of its
/// scalars, and fails on anything malformed.
pub fn read_scalars(path: &Path) -> Result<Vec<(String, i64, f32)>, String> {
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_scalars(&data).map_err(|e| format!("{}: {e}", path.display()))
}

/// [`read_scalars`] on the bytes of an event file (untrusted: never panics).
pub fn parse_scalars(data: &[u8]) -> Result<Vec<(String, i64, f32)>, String> {
    let mut b = data;
    let mut out = Vec::new();
    let mut first = true;
    while !b.is_empty() {
        let (head, rest) = b.split_at_checked(12).ok_or("truncated record header")?;
        let len_bytes = &head[..8];
        if masked(len_bytes) != u32::from_le_bytes(head[8..12].try_into().expect("4 bytes")) {
            return Err("length CRC mismatch".into());
        }
        // The length is only CRC-protected, and a crafted file can carry a valid CRC.
        let n = usize::try_from(u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"))).map_err(|_| "record length too large")?;
        let (rec, rest) = rest.split_at_checked(n.checked_add(4).ok_or("record length too large")?).ok_or("truncated record")?;
        let (body, crc) = rec.split_at(n);
        if masked(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err("data CRC mismatch".into());
        }
        b = rest;
        let f = fields(body)?;
        let step = f.iter().find(|x| x.0 == 2).map_or(0, |x| x.2 as i64);
        if first {
            if !f.iter().any(|x| x.0 == 3 && x.3 == b"brain.Event:2") {
                return Err("the first event is not the file version".into());
            }
            first = false;
            continue;
        }
        for s in f.iter().filter(|x| x.0 == 5) {
            for v in fields(s.3)?.iter().filter(|x| x.0 == 1) {
                let vf = fields(v.3)?;
                let tag = vf.iter().find(|x| x.0 == 1).map(|x| String::from_utf8_lossy(x.3).into_owned()).ok_or("value without tag")?;
                let val = vf.iter().find(|x| x.0 == 2).map(|x| f32::from_bits(x.2 as u32)).ok_or("value without simple_value")?;
                out.push((tag, step, val));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A valid event file with a few scalars, as bytes, and its records' (start, body length).
    fn valid_file() -> (Vec<u8>, Vec<(usize, usize)>) {
        // A directory per call: tests (and proptest cases) run in parallel.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kolo-tb-fuzz-{}-{call}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        for step in 1..4 {
            w.scalar("train/loss", step, 1.0 / step as f32).unwrap();
        }
        drop(w);
        let file = std::fs::read_dir(&dir).unwrap().next().unwrap().unwrap().path();
        let data = std::fs::read(&file).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let (mut at, mut recs) = (0, Vec::new());
        while at < data.len() {
            let n = u64::from_le_bytes(data[at..at + 8].try_into().unwrap()) as usize;
            recs.push((at, n));
            at += 12 + n + 4;
        }
        (data, recs)
    }

    /// Rewrites record `r`'s CRCs after a mutation so the parser behind them is exercised.
    fn fix_crcs(data: &mut [u8], at: usize) {
        let n = u64::from_le_bytes(data[at..at + 8].try_into().unwrap()) as usize;
        let c = masked(&data[at..at + 8]);
        data[at + 8..at + 12].copy_from_slice(&c.to_le_bytes());
        if let Some(body) = data.get(at + 12..at + 12 + n) {
            let c = masked(body);
            data[at + 12 + n..at + 16 + n].copy_from_slice(&c.to_le_bytes());
        }
    }

    /// The lengths that overflowed `n + 4`, each with a valid length CRC (#19).
    #[test]
    fn record_lengths_at_the_top_of_the_range_are_errors() {
        let (data, recs) = valid_file();
        for len in [u64::MAX, u64::MAX - 3, u64::MAX - 4] {
            let mut d = data.clone();
            let at = recs[1].0;
            d[at..at + 8].copy_from_slice(&len.to_le_bytes());
            let c = masked(&d[at..at + 8]);
            d[at + 8..at + 12].copy_from_slice(&c.to_le_bytes());
            let e = parse_scalars(&d).unwrap_err();
            assert!(e.contains("record length") || e.contains("truncated"), "{len}: {e}");
        }
    }

    proptest! {
        /// Event files are untrusted (issue #19: a crafted length with a valid CRC overflowed):
        /// valid files mutated inside their records, CRCs recomputed, or given any length,
        /// parse or fail, never panic.
        #[test]
        fn mutated_event_files_never_panic(rec in 0usize..4, pos in any::<usize>(), byte in any::<u8>(), len in any::<u64>(), cut in any::<usize>(), kind in 0u8..3) {
            let (mut data, recs) = valid_file();
            prop_assert_eq!(parse_scalars(&data).unwrap().len(), 3);
            let (at, n) = recs[rec % recs.len()];
            match kind {
                0 => {
                    data[at + 12 + pos % n] = byte;
                    fix_crcs(&mut data, at);
                }
                1 => {
                    data[at..at + 8].copy_from_slice(&len.to_le_bytes());
                    let c = masked(&data[at..at + 8]);
                    data[at + 8..at + 12].copy_from_slice(&c.to_le_bytes());
                }
                _ => data.truncate(cut % (data.len() + 1)),
            }
            let _ = parse_scalars(&data);
        }
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC-32C check value of "123456789" (RFC 3720 / iSCSI).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn scalars_round_trip_and_corruption_is_caught() {
        let dir = std::env::temp_dir().join(format!("kolo-tb-{}", std::process::id()));
        let mut w = EventWriter::create(&dir).unwrap();
        w.scalar("train/loss", 10, 2.5).unwrap();
        w.scalar("train/loss", 20, 1.25).unwrap();
        w.scalar("eval/accuracy", 20, 0.9).unwrap();
        let got = read_scalars(&w.path).unwrap();
        assert_eq!(got, vec![("train/loss".into(), 10, 2.5), ("train/loss".into(), 20, 1.25), ("eval/accuracy".into(), 20, 0.9)]);
        let mut bytes = std::fs::read(&w.path).unwrap();
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        std::fs::write(&w.path, &bytes).unwrap();
        assert!(read_scalars(&w.path).unwrap_err().contains("CRC"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
