//! Per-rank error files: how a failing rank tells the launcher why it failed.
//!
//! The launcher sets [`ENV`] to a fresh path for every rank. A rank that fails calls [`record`]
//! (the `kolo` binary does so for every error it exits with). The file is small text:
//!
//! ```text
//! lost_rank: 1
//! rank 0: all_reduce #4: lost rank 1: its connection closed
//! ```
//!
//! `lost_rank` is `-` unless the rank failed because it lost that peer. Files are written to a
//! temporary name and renamed, so the launcher never reads half of one; anything unreadable or
//! malformed is ignored (the file is a hint for the summary, never trusted for control).

use std::path::{Path, PathBuf};

/// The variable holding this rank's error file path.
pub const ENV: &str = "KOLO_ERROR_FILE";

/// Longest message kept (a summary line, not a log).
const MAX_MESSAGE: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankError {
    /// The peer whose loss made this rank fail.
    pub lost_rank: Option<usize>,
    pub message: String,
}

impl RankError {
    pub fn first_line(&self) -> &str {
        self.message.lines().next().unwrap_or("")
    }
}

/// Writes this process's error file if the launcher asked for one; silently does nothing
/// otherwise, and ignores I/O errors (the process is failing already; its stderr has the error).
pub fn record(message: &str, lost_rank: Option<usize>) {
    let Some(path) = std::env::var_os(ENV) else { return };
    let path = PathBuf::from(path);
    let mut message = message.to_string();
    if message.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
    }
    let text = format!("lost_rank: {}\n{message}\n", lost_rank.map_or("-".to_string(), |r| r.to_string()));
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, &path);
    }
}

/// Reads an error file; `None` if it is missing or not in the format [`record`] writes.
pub fn read(path: &Path) -> Option<RankError> {
    let text = std::fs::read(path).ok()?;
    parse(&String::from_utf8_lossy(&text[..text.len().min(MAX_MESSAGE + 64)]))
}

fn parse(text: &str) -> Option<RankError> {
    let (head, message) = text.split_once('\n')?;
    let lost = head.strip_prefix("lost_rank: ")?;
    let lost_rank = if lost == "-" { None } else { Some(lost.parse().ok()?) };
    Some(RankError { lost_rank, message: message.trim_end().to_string() })
}

/// A private directory for one job's error files, removed when dropped.
pub struct ErrorDir {
    dir: PathBuf,
}

impl ErrorDir {
    pub fn create() -> std::io::Result<ErrorDir> {
        let base = std::env::temp_dir();
        for attempt in 0..100u32 {
            let dir = base.join(format!("kolo-launch-{}-{attempt}", std::process::id()));
            match std::fs::create_dir(&dir) {
                Ok(()) => return Ok(ErrorDir { dir }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("no free name for a kolo-launch-* directory"))
    }

    pub fn path_for(&self, rank: usize) -> PathBuf {
        self.dir.join(format!("rank-{rank}.err"))
    }
}

impl Drop for ErrorDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_accepts_what_record_writes_and_rejects_the_rest() {
        assert_eq!(
            parse("lost_rank: 3\nrank 0: lost rank 3\n"),
            Some(RankError { lost_rank: Some(3), message: "rank 0: lost rank 3".into() })
        );
        assert_eq!(parse("lost_rank: -\nbad config\nsecond line\n").unwrap().first_line(), "bad config");
        assert_eq!(parse("lost_rank: x\nm"), None);
        assert_eq!(parse("garbage"), None);
        assert_eq!(parse(""), None);
    }
}
