//! What a training run is given beyond its config ([`RunOptions`]) and what it reports: its
//! [`Summary`], evaluations ([`Eval`]) and memory ([`StateBytes`], [`HeapReport`], [`peak_rss`]).

use std::path::PathBuf;

/// How to run, beyond the config file.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Resume from this checkpoint file, or the newest checkpoint in this directory.
    pub resume: Option<PathBuf>,
    /// Stop (as if interrupted) after this many steps in total; used to test resumption.
    pub stop_after: Option<u64>,
    /// No progress bar or log lines (tests).
    pub quiet: bool,
    /// Test hook: make rank 0's gradients non-finite at this step (0-based), as an f16
    /// overflow would.
    pub inject_inf_at: Option<u64>,
    /// Test hook: `(rank, ms)` makes that rank sleep this long in every step (a straggler).
    pub slow_rank: Option<(usize, u64)>,
    /// Test hook: `(rank, ms)` makes that rank sleep this long per example of its batch in
    /// every step (a slower device: its delay scales with its share of the work).
    pub slow_per_example: Option<(usize, f64)>,
    /// Test hook: abort the process in the middle of saving the checkpoint of this step (after
    /// this rank's shard is written, before the checkpoint is committed), as a crash would.
    pub crash_during_save: Option<u64>,
    /// Test hook: `(rank, step)` makes that rank vanish at the start of that step, as a crash
    /// would (DDP: it SIGKILLs itself; parameter-server workers: the worker stops talking).
    pub die_at: Option<(usize, u64)>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Eval {
    pub loss: f64,
    /// Classification accuracy (image models).
    pub accuracy: Option<f64>,
    pub examples: usize,
}

#[derive(Clone, Debug)]
pub struct Summary {
    pub steps_done: u64,
    /// Mean training loss over all ranks at the last step.
    pub last_loss: f64,
    pub eval: Option<Eval>,
    /// Wall time of each step on this rank, milliseconds.
    pub step_ms: Vec<f64>,
    /// Time spent waiting for gradient all-reduces after backward, per step, milliseconds.
    pub comm_wait_ms: Vec<f64>,
    /// Bytes this rank handed to the gradient collectives, per synchronised step.
    pub comm_bytes: Vec<usize>,
    /// The last straggler detected: the rank whose own work per step was slowest, and how many
    /// milliseconds it was behind the median rank.
    pub straggler: Option<(usize, f64)>,
    /// Mean fraction of all-reduce time hidden behind backward.
    pub hidden_fraction: f64,
    /// Final parameters (flat).
    pub params: Vec<f32>,
    pub sample: Option<String>,
    pub checkpoint: Option<PathBuf>,
    /// Bytes of model states this rank holds between steps.
    pub states: StateBytes,
    /// Peak resident memory of this process (VmHWM), bytes, where the OS reports it.
    pub peak_rss: Option<u64>,
    /// Live heap bytes measured by Kolo's counting allocator, when the binary installed it.
    pub heap: Option<HeapReport>,
    /// f16 training: steps skipped because a gradient overflowed, and the final loss scale.
    pub skipped_steps: u64,
    pub loss_scale: Option<f64>,
    /// Parameter-server runs: what this worker pushed and pulled.
    pub ps: Option<crate::PushStats>,
    /// Pipeline runs: the mean measured bubble (idle share of the stages).
    pub pipeline_bubble: Option<f64>,
    /// Mixture-of-experts runs: tokens routed per expert over the run, summed over every rank.
    pub moe: Option<kolo_tensor::models::MoeLoad>,
    /// Dynamic batch sizing: each rank's share of the global batch at the end.
    pub batch_split: Option<Vec<usize>>,
}

/// Live heap bytes at three points of a run (see `kolo_base::alloc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapReport {
    /// After the data is loaded, before the model exists.
    pub before_model: usize,
    /// After the last step: what stays alive between steps (model states and caches).
    pub between_steps: usize,
    /// The high-water mark over the steps (states plus activations and other transients).
    pub peak: usize,
}

impl HeapReport {
    /// From the live heap before the model and the allocator's statistics after the steps.
    pub fn between(before_model: Option<usize>, after: Option<kolo_base::alloc::HeapStats>) -> Option<HeapReport> {
        Some(HeapReport { before_model: before_model?, between_steps: after?.live, peak: after?.peak })
    }
}

/// Model states held by one rank between steps, by what they are (the ZeRO paper's split).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// The model's parameters (f32).
    pub params: u64,
    /// Gradient buffers kept across steps: the DDP buckets (plain DDP, ZeRO-1), this rank's
    /// gradient shard (ZeRO-2), the no-sync accumulator when accumulating.
    pub grads: u64,
    /// Optimizer state, plus under ZeRO this rank's master copy of its parameter shard.
    pub optimizer: u64,
    /// The optimizer bytes live in memory-mapped files, not in the heap.
    pub offloaded: bool,
}

impl StateBytes {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer
    }
}

/// Peak resident set size of this process (`VmHWM` in /proc/self/status), bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Keeps the memory training frees inside the process, once per process (unless `KOLO_HEAP`
/// is `system`). A step allocates and frees the same large activation and gradient tensors
/// again and again; glibc hands every block of 128 KiB to 32 MiB back to the kernel with
/// `munmap` and maps it afresh, so each step page-faulted its whole working set in again (16 %
/// of a GPT-2 124M step on the CPU). With no `mmap` for blocks and no trimming, freed blocks
/// are reused; resident memory stays at its peak, as under torch's caching allocators. Called
/// by [`run`](crate::run::run) and by the `kolo` library's trainer.
pub fn retain_freed_memory() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("KOLO_HEAP").is_some_and(|v| v == "system") {
            return;
        }
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only changes glibc's thresholds; any value is valid.
        unsafe {
            libc::mallopt(libc::M_MMAP_MAX, 0);
            libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        }
    });
}
