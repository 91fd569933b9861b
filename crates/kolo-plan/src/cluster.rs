//! What the planner knows of the hardware: a device (memory, peak FLOP/s per precision, memory
//! bandwidth, measured GEMM efficiency per size), the links inside a node and between nodes,
//! and presets for DGX A100 / H100 nodes and for this CPU machine.

/// The arithmetic a job trains in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 everywhere (Kolo's default): 4-byte parameters, gradients and activations, Adam's
    /// two f32 moments; under ZeRO-1/2 the optimizer's shard also holds an f32 master copy.
    F32,
    /// bf16/f16 compute with f32 master weights (the ZeRO paper's mixed precision): 2-byte
    /// parameters, gradients and activations, 12 bytes of optimizer state per parameter
    /// (master copy, momentum, variance).
    Mixed,
    /// FP8 matrix products (Transformer Engine's recipe) on top of [`Precision::Mixed`]: the
    /// GEMMs at the device's FP8 peak, activations, gradients and states as in mixed precision.
    Fp8,
}

impl Precision {
    /// Bytes per activation, parameter and gradient value.
    pub fn value_bytes(self) -> f64 {
        match self {
            Precision::F32 => 4.0,
            Precision::Mixed | Precision::Fp8 => 2.0,
        }
    }

    /// `f32`, or `bf16`/`f16`/`mixed`.
    pub fn parse(s: &str) -> Result<Precision, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" | "f16" | "mixed" => Ok(Precision::Mixed),
            "fp8" => Ok(Precision::Fp8),
            p => Err(format!("precision `{p}`: f32, bf16/f16 (mixed precision) or fp8")),
        }
    }
}

/// One accelerator (or one CPU rank).
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    pub name: String,
    /// Bytes of memory.
    pub memory: f64,
    /// Peak dense FLOP/s in f32 and in bf16/f16 (tensor cores where there are any).
    pub peak_f32: f64,
    pub peak_16: f64,
    /// Peak dense FP8 FLOP/s, where the device has FP8 tensor cores.
    pub peak_8: Option<f64>,
    /// Bytes/s the memory-bound operations (norms, softmax, activations, dropout) move.
    pub mem_bandwidth: f64,
    /// Bytes/s the optimizer's in-place update streams through its flat buffers (parameters,
    /// gradients, moments). A GPU's fused Adam runs at the memory bandwidth; on a CPU, where
    /// `mem_bandwidth` is candle's allocating operations' rate, a vectorised loop over buffers
    /// the caches partly hold runs several times faster.
    pub update_bandwidth: f64,
    /// Measured GEMM efficiency: (n, fraction of peak) for square n x n x n GEMMs, n ascending.
    /// Other shapes are costed as the square GEMM of equal work (n = cbrt(M N K)),
    /// interpolated in log n and clamped at both ends.
    pub gemm_efficiency: Vec<(f64, f64)>,
    /// The best model FLOPs utilisation published for a training run on this device, and where
    /// (`kolo plan` says so when its pick predicts more).
    pub published_mfu: Option<(f64, String)>,
}

impl Device {
    /// Peak FLOP/s in `p`.
    pub fn peak(&self, p: Precision) -> f64 {
        match p {
            Precision::F32 => self.peak_f32,
            Precision::Mixed => self.peak_16,
            // A device without FP8 has no FP8 rate: plans in fp8 are not plans there.
            Precision::Fp8 => self.peak_8.unwrap_or(0.0),
        }
    }

    /// Fraction of peak an M x K by K x N GEMM reaches.
    pub fn efficiency(&self, m: f64, n: f64, k: f64) -> f64 {
        let size = (m * n * k).cbrt().max(1.0);
        let pts = &self.gemm_efficiency;
        match pts.iter().position(|&(s, _)| s >= size) {
            None => pts.last().map_or(1.0, |p| p.1),
            Some(0) => pts[0].1,
            Some(i) => {
                let ((s0, e0), (s1, e1)) = (pts[i - 1], pts[i]);
                let f = (size.ln() - s0.ln()) / (s1.ln() - s0.ln());
                e0 + f * (e1 - e0)
            }
        }
    }

    /// Seconds for `flops` of M x K by K x N GEMMs in `p`.
    pub fn gemm_s(&self, flops: f64, (m, n, k): (f64, f64, f64), p: Precision) -> f64 {
        flops / (self.peak(p) * self.efficiency(m, n, k))
    }
}

/// A link's achieved bus bandwidth (nccl-tests' busbw: a ring all-reduce of n bytes over p
/// ranks takes 2 (p-1)/p n / bandwidth) and its latency per message.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// Bytes/s per device.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
}

/// The job's devices: `nodes` x `devices_per_node` identical devices, linked by `intra` inside
/// a node (NVLink, shared memory) and by `inter` between nodes (`inter.bandwidth` is each
/// device's own network share: a DGX node has one NIC per GPU).
#[derive(Clone, Debug, PartialEq)]
pub struct Cluster {
    pub device: Device,
    pub devices_per_node: usize,
    pub nodes: usize,
    pub intra: Link,
    pub inter: Link,
    /// The runtime's activation memory relative to Megatron's formula (1.0 for a fused GPU
    /// implementation; Kolo's GPT on candle's CPU backend keeps about 1.07x, measured).
    pub activation_factor: f64,
    /// Bytes the runtime copies per resident parameter during a step (Kolo's gradient hooks:
    /// 4, one f32 copy of every parameter in forward).
    pub param_copy_bytes: f64,
    /// Whether the data-parallel gradient reduction overlaps backward (Kolo's buckets, PyTorch
    /// DDP) or runs after it (Megatron-LM 2021).
    pub overlap_dp: bool,
    /// Whether the runtime's attention is fused, flash-style (FlashAttention, PyTorch's SDPA,
    /// Transformer Engine): the s x s scores never reach memory, neither kept for backward nor
    /// moved by a softmax kernel, and backward computes them again (5 matrix products of
    /// attention's against the 4 of an unfused backward). Not so for Megatron-LM 2021, BLOOM,
    /// MT-NLG or Kolo's CPU runtime.
    pub fused_attention: bool,
    /// Seconds a layer's forward costs beyond its GEMMs and memory traffic: the kernels an
    /// eager runtime runs besides (norms in f32, rotary embeddings, casts), and launches where
    /// kernels are too short to hide them. Backward counts twice, recomputation once more. 0 in the presets
    /// (Megatron-LM's fused kernels at the published runs' sizes; Kolo's CPU runtime); fitted
    /// for a runtime from one run (docs/benchmarks.md: transformers on torch eager, 0.53 ms on
    /// an H200).
    pub layer_overhead_s: f64,
    /// Compute units a node's devices share (a CPU's cores; 0: every device its own, as GPUs).
    /// With more ranks on a node than cores, a rank idle in the pipeline's bubble leaves its core
    /// to the ranks it shares it with, so the bubble costs the node nothing; the device's rates
    /// are then those measured with every rank running at once.
    pub cores_per_node: usize,
}

/// A100-SXM4 80 GB: bf16 dense peak 312 TFLOP/s (at the 1410 MHz boost clock), f32 19.5;
/// HBM2e 2.04 TB/s. GEMM efficiencies are typical cuBLAS bf16 results for square sizes (up to
/// 87% of peak at n = 8192) scaled to the clock sustained under the 400 W limit in long runs
/// (1305 MHz, 0.926 of boost). Not measured by Kolo: there is no A100 here.
fn a100() -> Device {
    Device {
        name: "A100-SXM4-80GB".into(),
        memory: 80.0 * GIB,
        peak_f32: 19.5e12,
        peak_16: 312e12,
        peak_8: None,
        mem_bandwidth: 2.039e12,
        update_bandwidth: 2.039e12,
        gemm_efficiency: [(256.0, 0.04), (512.0, 0.20), (1024.0, 0.50), (2048.0, 0.72), (4096.0, 0.81), (8192.0, 0.87)]
            .map(|(n, e)| (n, e * 1305.0 / 1410.0))
            .to_vec(),
        published_mfu: Some((
            0.563,
            "Korthikanti et al. 2022, GPT-3 175B on A100s with selective recomputation and sequence parallelism".into(),
        )),
    }
}

/// H100-SXM5 80 GB: bf16 dense peak 989 TFLOP/s, f32 67; HBM3 3.35 TB/s. GEMM efficiencies
/// are typical cuBLAS bf16 results (not measured by Kolo yet).
fn h100() -> Device {
    Device {
        name: "H100-SXM5-80GB".into(),
        memory: 80.0 * GIB,
        peak_f32: 67e12,
        peak_16: 989e12,
        peak_8: Some(1979e12),
        mem_bandwidth: 3.35e12,
        update_bandwidth: 3.35e12,
        gemm_efficiency: vec![(256.0, 0.02), (512.0, 0.10), (1024.0, 0.30), (2048.0, 0.55), (4096.0, 0.68), (8192.0, 0.74)],
        published_mfu: Some((0.43, "Llama 3 405B on 16k H100s (Meta 2024: 38-43 % BF16 MFU)".into())),
    }
}

/// H200-SXM 141 GB: the H100's compute (and so its GEMM curve) with HBM3e of 141 GB (about
/// 140 GiB usable) at 4.8 TB/s.
fn h200() -> Device {
    Device { name: "H200-SXM-141GB".into(), memory: 140.0 * GIB, mem_bandwidth: 4.8e12, update_bandwidth: 4.8e12, ..h100() }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// The presets [`Cluster::preset`] knows.
pub const PRESETS: [&str; 4] = ["dgx-a100", "dgx-h100", "dgx-h200", "this-machine"];

impl Cluster {
    /// Kolo on this kind of CPU: activation factor and hook copies measured (docs/benchmarks.md:
    /// the one-process benchmark GPT keeps 1.07x Megatron's activation formula).
    pub const KOLO_CPU_ACTIVATIONS: f64 = 1.07;
    pub const KOLO_PARAM_COPY: f64 = 4.0;

    /// Devices in the job.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// A preset of `nodes` nodes:
    /// - `dgx-a100`: 8 A100-80GB per node; NVLink 3 through NVSwitch, 230 GB/s all-reduce
    ///   busbw (nccl-tests on a DGX A100); 8 HDR InfiniBand NICs of 200 Gb/s, one per GPU,
    ///   23 GB/s each achieved.
    ///   Unfused attention (the published A100 runs it is checked against kept their scores).
    /// - `dgx-h100`: 8 H100-80GB per node; NVLink 4, 360 GB/s busbw; 8 NDR NICs of 400 Gb/s;
    ///   fused (flash) attention, as every H100 training stack runs it.
    /// - `dgx-h200`: the same with H200s (141 GB, 4.8 TB/s).
    /// - `this-machine`: the 2-core CI machine, one rank per core: candle's f32 GEMM measured
    ///   by `kolo bench compute` with one thread (peak = the best GEMM rate, 220 GFLOP/s),
    ///   memory-bound operations 8.3 GB/s (a + b, measured alike), loopback TCP between
    ///   ranks 1.5 GB/s; Kolo's CPU runtime constants. Nodes beyond one are other machines of its kind on a 10 Gb/s network.
    pub fn preset(name: &str, nodes: usize) -> Result<Cluster, String> {
        let nodes = nodes.max(1);
        let gpu = |device, intra: f64, nic: f64, fused_attention| Cluster {
            device,
            devices_per_node: 8,
            nodes,
            intra: Link { bandwidth: intra, latency: 10e-6 },
            inter: Link { bandwidth: nic, latency: 15e-6 },
            activation_factor: 1.0,
            param_copy_bytes: 0.0,
            overlap_dp: true,
            fused_attention,
            layer_overhead_s: 0.0,
            cores_per_node: 0,
        };
        match name {
            "dgx-a100" => Ok(gpu(a100(), 230e9, 23e9, false)),
            "dgx-h100" => Ok(gpu(h100(), 360e9, 45e9, true)),
            "dgx-h200" => Ok(gpu(h200(), 360e9, 45e9, true)),
            "this-machine" => Ok(Cluster {
                device: Device {
                    name: "CPU core (candle f32)".into(),
                    memory: 4.0 * GIB,
                    peak_f32: 220e9,
                    peak_16: 220e9,
                    peak_8: None,
                    // kolo bench compute: a + b moves 8.3 GB/s on one core (candle's other
                    // memory-bound operations range from 0.5, gelu, to 29, a row sum).
                    mem_bandwidth: 8.3e9,
                    // Kolo's AdamW over 3.2 M parameters, one thread: 1.7-1.8 ms a step, 50-52
                    // GB/s at 28 bytes a parameter (AMD EPYC CI machine, 2026-11-26).
                    update_bandwidth: 50e9,
                    // kolo bench compute (RAYON_NUM_THREADS=1), 2026-11-24: 170, 201, 221, 215,
                    // 215, 219 GFLOP/s at n = 64 ... 2048.
                    gemm_efficiency: vec![(64.0, 0.77), (128.0, 0.91), (256.0, 1.0), (2048.0, 1.0)],
                    published_mfu: None,
                },
                devices_per_node: 2,
                nodes,
                intra: Link { bandwidth: 1.5e9, latency: 20e-6 },
                inter: Link { bandwidth: 1.1e9, latency: 50e-6 },
                activation_factor: Cluster::KOLO_CPU_ACTIVATIONS,
                param_copy_bytes: Cluster::KOLO_PARAM_COPY,
                overlap_dp: true,
                fused_attention: false,
                layer_overhead_s: 0.0,
                cores_per_node: 2,
            }),
            other => Err(format!("cluster preset `{other}`: one of {}", PRESETS.join(", "))),
        }
    }

    /// The same cluster with `devices` devices: one node of them when they fit in one, else
    /// whole nodes.
    pub fn with_devices(mut self, devices: usize) -> Result<Cluster, String> {
        if devices == 0 {
            return Err("a cluster of 0 devices".into());
        }
        if devices <= self.devices_per_node {
            (self.nodes, self.devices_per_node) = (1, devices);
        } else if devices.is_multiple_of(self.devices_per_node) {
            self.nodes = devices / self.devices_per_node;
        } else {
            return Err(format!("{devices} devices are not whole nodes of {} ({})", self.devices_per_node, self.device.name));
        }
        Ok(self)
    }

    /// The link a collective over `p` ranks, `stride` apart in the rank order, runs on, and
    /// its bus bandwidth: inside a node when the group fits in one; across nodes at the
    /// network share of the group's members in a node (each device has its own NIC), capped by
    /// the intra-node link.
    pub fn group_link(&self, p: usize, stride: usize) -> Link {
        let span = p.saturating_sub(1) * stride + 1;
        if span <= self.devices_per_node {
            return self.intra;
        }
        let per_node = (self.devices_per_node / stride.max(1)).clamp(1, p);
        Link { bandwidth: (per_node as f64 * self.inter.bandwidth).min(self.intra.bandwidth), latency: self.inter.latency }
    }
}
