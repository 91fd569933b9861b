//! Vocabulary shared by every Kolo layer. No dependencies, no IO.
//!
//! Rank-like values are newtypes so that a rank can never be passed where a world size (or an
//! element count) is expected; units live in types (`ByteSize`, `Deadline`).

use std::fmt;
use std::time::{Duration, Instant};

pub mod alloc;
mod bytesize;
mod rng;
pub mod simd;
pub use bytesize::{ByteSize, ParseByteSizeError};
pub use rng::Rng;

/// Index of a process inside a group, `0..world_size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Rank(pub usize);

impl Rank {
    pub const ZERO: Rank = Rank(0);
    pub fn get(self) -> usize {
        self.0
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Number of processes in a group; always at least 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorldSize(usize);

impl WorldSize {
    /// Returns `None` for 0: a group always has at least one member.
    pub fn new(n: usize) -> Option<WorldSize> {
        (n > 0).then_some(WorldSize(n))
    }
    pub fn get(self) -> usize {
        self.0
    }
    /// True if `rank` is a member of a group of this size.
    pub fn contains(self, rank: Rank) -> bool {
        rank.0 < self.0
    }
    pub fn ranks(self) -> impl Iterator<Item = Rank> {
        (0..self.0).map(Rank)
    }
}

impl fmt::Display for WorldSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Element types that Kolo moves and reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    F32 = 1,
    F64 = 2,
    F16 = 3,
    BF16 = 4,
    I32 = 5,
    I64 = 6,
    U8 = 7,
}

impl DType {
    pub const ALL: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];

    pub fn size_bytes(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::F16 | DType::BF16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Wire code, the inverse of [`DType::from_code`].
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| d.code() == code)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype `{s}` (expected one of f32, f64, f16, bf16, i32, i64, u8)"))
    }
}

/// A point in time by which a blocking call must return.
///
/// Every blocking wait in Kolo takes one; there is deliberately no "wait forever".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    pub fn after(budget: Duration) -> Deadline {
        // Saturate far-future budgets instead of panicking on Instant overflow.
        let now = Instant::now();
        let at = now.checked_add(budget).unwrap_or(now + Duration::from_secs(86_400 * 365));
        Deadline { at, budget }
    }

    /// Time left, zero once expired.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    pub fn expired(&self) -> bool {
        Instant::now() >= self.at
    }

    /// The budget this deadline was created with (for error messages).
    pub fn budget(&self) -> Duration {
        self.budget
    }

    pub fn instant(&self) -> Instant {
        self.at
    }
}

/// Splits `len` elements into `n` contiguous parts whose sizes differ by at most one; the first
/// `len % n` parts get the extra element. This is the one shard layout used by reduce-scatter,
/// all-gather, ring segments and ZeRO partitions, so every layer agrees on who owns what.
pub fn even_split(len: usize, n: WorldSize) -> impl Iterator<Item = std::ops::Range<usize>> + Clone {
    let n = n.get();
    let base = len / n;
    let extra = len % n;
    (0..n).map(move |i| {
        let start = i * base + i.min(extra);
        let size = base + usize::from(i < extra);
        start..start + size
    })
}

/// The part of [`even_split`] that `rank` owns.
pub fn shard_range(len: usize, n: WorldSize, rank: Rank) -> std::ops::Range<usize> {
    let base = len / n.get();
    let extra = len % n.get();
    let i = rank.0;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

/// Receives each parameter's complete gradient during a backward pass. Defined here, free of any
/// tensor library, so that strategies (DDP, ZeRO) can implement it and model adapters can call it.
pub trait GradSink: Send + Sync {
    /// Called once per parameter per backward pass, in the order backward completes them.
    fn grad_ready(&self, param_idx: usize, grad: &[f32]);
}

/// Sum of squares, accumulated in f64 (pass per-shard sums through an all-reduce for a global
/// norm). Shared by the optimizers' clipping and the strategies' gradient buffers.
pub fn sum_of_squares(v: &[f32]) -> f64 {
    // Eight interleaved f64 lanes, so the loop vectorises (one serial f64 sum was bound by the
    // add's latency: 4 % of a GPT-2 124M step for the clipping norm); the order is fixed, so
    // the result is the same on every run and rank.
    let mut lanes = [0f64; 8];
    sum_of_squares_lanes(v, &mut lanes);
    lanes.iter().sum()
}

crate::simd_kernel! {
    fn sum_of_squares_lanes(v: &[f32], lanes: &mut [f64]) {
        let lanes: &mut [f64; 8] = lanes.try_into().expect("eight lanes");
        let mut chunks = v.chunks_exact(8);
        for c in &mut chunks {
            for (l, x) in lanes.iter_mut().zip(c) {
                *l += f64::from(*x) * f64::from(*x);
            }
        }
        for (l, x) in lanes.iter_mut().zip(chunks.remainder()) {
            *l += f64::from(*x) * f64::from(*x);
        }
    }
}

/// Parameters sharded across ranks and materialised group by group (ZeRO-3): the model's
/// variables of a group are filled with its full values when the model first reads one of
/// them, and freed again after (`kolo_train::zero3`); their gradients travel as any
/// parameter's. Tensor-free, like [`GradSink`].
pub trait ParamGather: Send + Sync {
    /// The full values of group `group`, packed in the group's parameter order. Blocks until
    /// they are gathered (or fails, naming why).
    fn gather(&self, group: usize) -> Result<Vec<f32>, String>;
    /// Starts gathering `group` now, to be collected by the next [`ParamGather::gather`] of it.
    fn prefetch(&self, group: usize);
}

/// Summing f32 buffers across a group of ranks (a tensor-parallel group), for model adapters
/// that must not know the communicator: Megatron's f operator all-reduces gradients in
/// backward, its g operator activations in forward. Tensor-free, like [`GradSink`].
pub trait GroupSum: Send + Sync {
    /// This rank's index in the group and the group's size.
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Replaces `buf` with the element-wise sum of every member's `buf`.
    fn sum(&self, buf: &mut [f32]) -> Result<(), String>;
}

/// Passing buffers around a ring of ranks (sequence parallelism: ring attention moves key/value
/// blocks rank to rank), for model adapters that must not know the communicator.
pub trait RingShift: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `send` to the next member ((rank + 1) mod size) and receives the previous member's
    /// buffer of the same length into `recv`, at once.
    fn shift(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String>;
}

/// All-to-all exchange over a group (expert parallelism: tokens travel to the rank that holds
/// their expert and back), for model adapters that must not know the communicator.
pub trait Exchange: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Sends `send[..]` cut in consecutive pieces of `send_counts[d]` values to member `d`, and
    /// receives `recv_counts[s]` values from member `s` into consecutive pieces of `recv`.
    fn all_to_all(&self, send: &[f32], send_counts: &[usize], recv: &mut [f32], recv_counts: &[usize]) -> Result<(), String>;
}

#[cfg(test)]
mod tests;

/// `eprintln!` in one write: the line is formatted first and handed to stderr whole, so the
/// lines of processes sharing one stderr (`kolo ps run`'s coordinator, servers and workers, a
/// launcher's children) do not interleave mid-line. Std's `eprintln!` writes each piece of the
/// format separately: a coordinator's "server 1 joined at ..." came out split around another
/// process's line.
#[macro_export]
macro_rules! eline {
    ($($arg:tt)+) => {{
        use ::std::io::Write as _;
        let mut line = ::std::format!($($arg)+);
        line.push('\n');
        let _ = ::std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

/// The memory the kernel could give this process now without swapping (`MemAvailable` of
/// `/proc/meminfo`), in bytes; `None` where that file does not say.
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
