//! Where optimizer state (and a ZeRO master shard) lives: in memory, or offloaded to files
//! (ZeRO-Offload/Infinity's NVMe tier) through shared memory maps.
//!
//! An offloaded buffer is a file in the offload directory, mapped shared and unlinked at once
//! (nothing is left behind, even after a crash). The optimizer walks it in pieces; after each
//! piece it tells the kernel the pages are not needed (`MADV_DONTNEED`): they leave the
//! process's resident set and are written back to the file as the kernel sees fit, so the
//! resident memory of a step holds about one piece of state instead of all of it.

use memmap2::{MmapMut, MmapOptions, UncheckedAdvice};
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Where new buffers go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    #[default]
    Memory,
    /// Memory-mapped files in this directory.
    Disk(PathBuf),
}

/// A buffer of `f32` in memory or in a mapped file.
#[derive(Debug)]
pub enum Buffer {
    Ram(Vec<f32>),
    File { map: MmapMut, len: usize },
}

impl Buffer {
    /// `n` zeros at `place`; `tag` names the file (for error messages and `/proc/*/maps`).
    pub fn zeros(n: usize, place: &Placement, tag: &str) -> std::io::Result<Buffer> {
        let dir = match place {
            Placement::Disk(dir) if n > 0 => dir,
            _ => return Ok(Buffer::Ram(vec![0f32; n])),
        };
        std::fs::create_dir_all(dir)?;
        let path = unique(dir, tag);
        let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        let unlinked = std::fs::remove_file(&path);
        file.set_len((n * 4) as u64)?; // sparse: zeros cost no disk until written
                                       // SAFETY: the file is private to this process (created exclusively and unlinked), so
                                       // nobody else can change or truncate it under the mapping.
        let map = unsafe { MmapOptions::new().len(n * 4).map_mut(&file)? };
        unlinked?;
        Ok(Buffer::File { map, len: n })
    }

    pub fn is_offloaded(&self) -> bool {
        matches!(self, Buffer::File { .. })
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::Ram(v) => v.len(),
            Buffer::File { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn as_slice(&self) -> &[f32] {
        match self {
            Buffer::Ram(v) => v,
            // SAFETY: the mapping is page-aligned (so f32-aligned) and `len * 4` bytes long.
            Buffer::File { map, len } => unsafe { std::slice::from_raw_parts(map.as_ptr().cast::<f32>(), *len) },
        }
    }

    pub fn as_mut_slice(&mut self) -> &mut [f32] {
        match self {
            Buffer::Ram(v) => v,
            // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
            Buffer::File { map, len } => unsafe { std::slice::from_raw_parts_mut(map.as_mut_ptr().cast::<f32>(), *len) },
        }
    }

    /// Lets the kernel drop the whole pages inside `range` (elements) from memory; their
    /// contents stay in the file. No-op in memory.
    pub fn release(&mut self, range: Range<usize>) {
        let Buffer::File { map, .. } = self else { return };
        let page = page_size();
        let start = (range.start * 4).div_ceil(page) * page;
        let end = (range.end * 4) / page * page;
        if end > start {
            // SAFETY: a shared file mapping: dropped pages are read back from the page cache
            // or the file on the next access, so no data is lost, and `&mut self` guarantees
            // no slice of the mapping is borrowed during the call.
            let _ = unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start) };
        }
    }

    /// Releases everything (after a step).
    pub fn release_all(&mut self) {
        let n = self.len();
        self.release(0..n);
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

fn unique(dir: &Path, tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let clean: String = tag.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' }).collect();
    dir.join(format!("kolo-offload-{}-{}-{clean}.f32", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_buffers_keep_their_values_across_release_and_leave_no_file() {
        let dir = std::env::temp_dir().join(format!("kolo-offload-test-{}", std::process::id()));
        let place = Placement::Disk(dir.clone());
        let mut b = Buffer::zeros(300_000, &place, "m").unwrap();
        assert!(b.is_offloaded());
        assert!(b.as_slice().iter().all(|x| *x == 0.0));
        b.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| *x = i as f32);
        b.release(1000..200_000);
        b.release_all();
        assert!(b.as_slice().iter().enumerate().all(|(i, x)| *x == i as f32));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "the file is unlinked at once");
        assert!(!Buffer::zeros(0, &place, "empty").unwrap().is_offloaded());
        assert!(!Buffer::zeros(5, &Placement::Memory, "x").unwrap().is_offloaded());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
