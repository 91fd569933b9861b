use std::fmt;
use std::str::FromStr;

/// A number of bytes. Parses `4096`, `4K`, `4KiB`, `25MB`, `1G` (binary multiples: K = 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn b(n: u64) -> ByteSize {
        ByteSize(n)
    }
    pub const fn kib(n: u64) -> ByteSize {
        ByteSize(n << 10)
    }
    pub const fn mib(n: u64) -> ByteSize {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> ByteSize {
        ByteSize(n << 30)
    }
    pub fn bytes(self) -> u64 {
        self.0
    }
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
        for (name, unit) in UNITS {
            if self.0 >= unit && self.0.is_multiple_of(unit) {
                return write!(f, "{} {name}", self.0 / unit);
            }
        }
        for (name, unit) in UNITS {
            if self.0 >= unit {
                return write!(f, "{:.2} {name}", self.0 as f64 / unit as f64);
            }
        }
        write!(f, "{} B", self.0)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseByteSizeError(pub String);

impl fmt::Display for ParseByteSizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid byte size `{}` (examples: 4096, 4K, 25MiB, 1G)", self.0)
    }
}

impl std::error::Error for ParseByteSizeError {}

impl FromStr for ByteSize {
    type Err = ParseByteSizeError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseByteSizeError(s.to_string());
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num.parse().map_err(|_| err())?;
        let shift = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 0,
            "k" | "kb" | "kib" => 10,
            "m" | "mb" | "mib" => 20,
            "g" | "gb" | "gib" => 30,
            _ => return Err(err()),
        };
        n.checked_mul(1u64 << shift).map(ByteSize).ok_or_else(err)
    }
}
