use super::*;

fn bench_gpt() -> Gpt {
    Gpt::gpt_style(4, 256, 4, 128, 65)
}

fn this_machine(devices: usize) -> Cluster {
    Cluster::preset("this-machine", 1).unwrap().with_devices(devices).unwrap()
}

/// One node of 4 ranks sharing its 2 cores (`kolo plan --devices 4 --devices-per-node 4`), the
/// CPU as 4 concurrent `kolo plan --cluster measured` processes timed it: per rank its GEMM
/// peak and efficiency curve, the memory-bound rate and Kolo's AdamW rate.
fn four_ranks_on_two_cores(peak_f32: f64, mem_bandwidth: f64, update_bandwidth: f64, gemm_efficiency: Vec<(f64, f64)>) -> Cluster {
    let mut c = this_machine(2);
    c.devices_per_node = 4;
    (c.device.peak_f32, c.device.mem_bandwidth, c.device.update_bandwidth) = (peak_f32, mem_bandwidth, update_bandwidth);
    c.device.gemm_efficiency = gemm_efficiency;
    c
}

#[test]
fn parameter_counts_match_the_models() {
    assert_eq!(bench_gpt().params(), 3_225_665.0, "Kolo's benchmark GPT");
    let g = Gpt::with_params(1.3e9);
    assert_eq!((g.layers, g.d_model), (24, 2048));
    assert!((g.params() / 1.3e9 - 1.0).abs() < 0.1, "{}", g.params());
    assert_eq!(Gpt::with_params(175e9).layers, 96);
    // Step + recomputation is Narayanan et al.'s 96 B s l h^2 (1 + s/6h + V/16lh).
    let m = Gpt::gpt_style(96, 12288, 96, 2048, 51200);
    let (l, h, s, v) = (96.0, 12288.0, 2048.0, 51200.0);
    let paper = 96.0 * 1536.0 * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
    assert!(((m.step_flops(1536.0) + m.recompute_flops(1536.0)) / paper - 1.0).abs() < 1e-12);
}

#[test]
fn model_states_follow_the_zero_formulas() {
    // Kolo's measured GPT-m (25.35 M parameters) model states: DDP 408.3 MB, ZeRO-1 on 2 ranks
    // 357.6 MB, ZeRO-2 on 4 ranks 205.5 MB (docs/benchmarks.md): within 15% (in fact 1%).
    let phi = 25.35e6;
    let total = |zero, dp, p| {
        let (a, b, c) = state_bytes(phi, zero, dp, p);
        a + b + c
    };
    for (zero, dp, measured) in [(0u8, 2usize, 408.3e6), (1, 2, 357.6e6), (2, 2, 306.9e6), (1, 4, 281.6e6), (2, 4, 205.5e6)] {
        let p = total(zero, dp, Precision::F32);
        assert!((p / measured - 1.0).abs() < 0.15, "ZeRO-{zero} on {dp}: predicted {p}, measured {measured}");
    }
    assert_eq!(state_bytes(1e6, 3, 4, Precision::F32), (1e6, 1e6, 2e6));
    // ZeRO-3 on 2 and 4 ranks: 206.1 and 104.7 MB measured (plus 0.5 MB of resident embeddings).
    for (dp, measured) in [(2usize, 206.1e6), (4, 104.7e6)] {
        let p = total(3, dp, Precision::F32);
        assert!((p / measured - 1.0).abs() < 0.15, "ZeRO-3 on {dp}: predicted {p}, measured {measured}");
    }
}

/// The ZeRO paper (Rajbhandari et al. 2020), Table 1: model-state memory per device in GB for
/// mixed-precision Adam (K = 12) at 7.5 B, 128 B and 1 T parameters on 1 ... 1024 devices,
/// baseline / P_os / P_os+g / P_os+g+p. Within 10% (the paper rounds).
#[test]
fn model_states_match_the_zero_paper() {
    #[rustfmt::skip]
    const TABLE: [(usize, [f64; 12]); 6] = [
        (1,    [120.0, 120.0, 120.0, 120.0,  2048.0, 2048.0, 2048.0, 2048.0,  16000.0, 16000.0, 16000.0, 16000.0]),
        (4,    [120.0, 52.5,  41.3,  30.0,   2048.0, 896.0,  704.0,  512.0,   16000.0, 7000.0,  5500.0,  4000.0]),
        (16,   [120.0, 35.6,  21.6,  7.5,    2048.0, 608.0,  368.0,  128.0,   16000.0, 4750.0,  2875.0,  1000.0]),
        (64,   [120.0, 31.4,  16.6,  1.88,   2048.0, 536.0,  284.0,  32.0,    16000.0, 4187.0,  2218.0,  250.0]),
        (256,  [120.0, 30.4,  15.4,  0.47,   2048.0, 518.0,  259.0,  8.0,     16000.0, 4046.0,  2054.0,  62.5]),
        (1024, [120.0, 30.1,  15.1,  0.12,   2048.0, 513.0,  257.0,  2.0,     16000.0, 4011.0,  2013.0,  15.6]),
    ];
    for (dp, row) in TABLE {
        for (i, paper) in row.into_iter().enumerate() {
            let (psi, zero) = ([7.5e9, 128e9, 1e12][i / 4], (i % 4) as u8);
            let (a, b, c) = state_bytes(psi, zero, dp, Precision::Mixed);
            let gb = (a + b + c) / 1e9;
            assert!((gb / paper - 1.0).abs() < 0.10, "{psi:e} parameters, ZeRO-{zero} on {dp}: {gb:.2} GB, the paper {paper}");
        }
    }
    // The f32 accounting Kolo trains with is larger: 61 / 32 GB at 7.5 B on 64 devices.
    let (a, b, c) = state_bytes(7.5e9, 1, 64, Precision::F32);
    assert!(((a + b + c) / 1e9 - 61.4).abs() < 0.1);
}

/// heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU.
type MegatronRow = (usize, usize, usize, usize, usize, usize, usize, f64);

/// Megatron-LM on A100s (Narayanan et al. 2021, Table 1): model shape, tp, pp, GPUs, batch,
/// measured TFLOP/s per GPU (executed FLOPs, with the recomputation). Vocabulary 51,200,
/// sequence 2048, activation recomputation, no overlap of the data-parallel all-reduce.
#[rustfmt::skip]
const MEGATRON_TABLE_1: [MegatronRow; 10] = [
    // heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s
    (24,  2304,  24,  1, 1,  32,   512,  137.0),
    (32,  3072,  30,  2, 1,  64,   512,  138.0),
    (32,  4096,  36,  4, 1,  128,  512,  142.0),
    (48,  6144,  40,  8, 1,  256,  1024, 135.0),
    (64,  8192,  48,  8, 2,  512,  1536, 138.0),
    (80,  10240, 60,  8, 4,  1024, 1792, 140.0),
    (96,  12288, 80,  8, 8,  1536, 2304, 148.0),
    (128, 16384, 96,  8, 16, 1920, 2160, 155.0),
    (128, 20480, 105, 8, 35, 2520, 2520, 163.0),
    (160, 25600, 128, 8, 64, 3072, 3072, 163.0),
];

/// The best micro-batch for the paper's tp x pp x dp with recomputation.
fn megatron_row(heads: usize, d_model: usize, layers: usize, tp: usize, pp: usize, gpus: usize, batch: usize) -> (Plan, Estimate) {
    let m = Gpt::gpt_style(layers, d_model, heads, 2048, 51200);
    let c = Cluster { overlap_dp: false, ..Cluster::preset("dgx-a100", gpus / 8).unwrap() };
    let dp = gpus / (tp * pp);
    [1, 2, 4, 8]
        .into_iter()
        .filter_map(|micro_batch| {
            let plan = Plan { recompute: Recompute::Full, ..Plan::new(dp, tp, pp, 0, micro_batch) };
            estimate(&m, &c, &plan, batch, Precision::Mixed).filter(|e| e.memory() <= c.device.memory).map(|e| (plan, e))
        })
        .min_by(|a, b| a.1.step_s.total_cmp(&b.1.step_s))
        .expect("a micro-batch fits")
}

#[test]
fn throughput_matches_megatron_lm_table_1() {
    let mut worst: f64 = 0.0;
    for (heads, d_model, layers, tp, pp, gpus, batch, measured) in MEGATRON_TABLE_1 {
        let (plan, e) = megatron_row(heads, d_model, layers, tp, pp, gpus, batch);
        let tflops = e.hardware_flops_per_device() / 1e12;
        let residual = tflops / measured - 1.0;
        eprintln!(
            "h {d_model:>5} t {tp} p {pp:>2} micro {}: {tflops:6.1} TFLOP/s vs {measured} ({:+.1}%), MFU {:.1}%, {:.1} GiB",
            plan.micro_batch,
            residual * 100.0,
            e.mfu() * 100.0,
            e.memory() / 1024f64.powi(3)
        );
        worst = worst.max(residual.abs());
    }
    assert!(worst < 0.15, "worst residual {:.1}%", worst * 100.0);
}

/// Kolo's own runs of the benchmark GPT (bench/gpt.toml, 16 x 128 tokens per step) on this
/// machine, `bash bench/planner.sh` on 2026-11-24 (docs/benchmarks.md): step time (ms, second
/// half of 8 steps) and rank 0's peak heap (MB), against the `this-machine` preset, whose
/// constants are hardware measurements (GEMM and a + b rates) except the activation factor
/// (from the one-process peak). Every step within 15%; peak memory within 10% for one
/// process, DDP and ZeRO-1/2 (ZeRO-3, tp and pp keep buffers the model does not count).
#[test]
fn predictions_match_kolo_runs_on_this_machine() {
    let m = bench_gpt();
    #[rustfmt::skip]
    let runs: [(&str, usize, Plan, f64, Option<f64>); 7] = [
        ("1 process", 1, Plan::new(1, 1, 1, 0, 16), 288.3, Some(262.5)),
        ("DDP", 2, Plan::new(2, 1, 1, 0, 8), 156.3, Some(165.1)),
        ("ZeRO-1", 2, Plan::new(2, 1, 1, 1, 8), 160.2, Some(158.7)),
        ("ZeRO-2", 2, Plan::new(2, 1, 1, 2, 8), 161.9, Some(165.0)),
        ("ZeRO-3", 2, Plan { recompute: Recompute::Full, ..Plan::new(2, 1, 1, 3, 8) }, 209.9, None),
        ("tp 2", 2, Plan::new(1, 2, 1, 0, 16), 203.7, None),
        ("pp 2", 2, Plan::new(1, 1, 2, 0, 2), 175.7, None),
    ];
    for (name, devices, plan, ms, mb) in runs {
        let e = estimate(&m, &this_machine(devices), &plan, 16, Precision::F32).unwrap();
        let step = e.step_s * 1e3;
        assert!((step / ms - 1.0).abs() < 0.15, "{name}: predicted {step:.1} ms, measured {ms}");
        if let Some(mb) = mb {
            let mem = e.memory() / 1e6;
            assert!((mem / mb - 1.0).abs() < 0.10, "{name}: predicted {mem:.1} MB, measured {mb}");
        }
    }
}

#[test]
fn estimates_add_up_and_respect_the_constraints() {
    let m = bench_gpt();
    let c = Cluster { activation_factor: 1.0, param_copy_bytes: 0.0, ..Cluster::preset("dgx-a100", 1).unwrap().with_devices(4).unwrap() };
    let plan = |dp, tp, pp, micro_batch| Plan::new(dp, tp, pp, 0, micro_batch);
    let f32 = Precision::F32;
    let ddp = estimate(&m, &c, &plan(4, 1, 1, 4), 16, f32).unwrap();
    assert_eq!((ddp.tp_s, ddp.pp_s, ddp.bubble_s), (0.0, 0.0, 0.0));
    assert!((ddp.step_s - (ddp.compute_s + ddp.dp_exposed_s + ddp.optimizer_s)).abs() < 1e-12);
    let pipe = estimate(&m, &c, &plan(1, 1, 4, 2), 16, f32).unwrap();
    assert_eq!(pipe.micro_batches, 8);
    assert!((pipe.bubble_s / pipe.compute_s - 3.0 / 8.0).abs() < 1e-12, "(pp - 1) / m");
    let tp = estimate(&m, &c, &plan(1, 4, 1, 16), 16, f32).unwrap();
    assert!(tp.tp_s > 0.0 && tp.memory.activations < ddp.memory.activations * 4.0);
    // Not a plan: sizes that do not multiply to the devices, heads that do not split, batches
    // that do not divide.
    assert!(estimate(&m, &c, &plan(2, 1, 1, 4), 16, f32).is_none());
    let three = c.clone().with_devices(3).unwrap();
    assert!(estimate(&m, &three, &plan(1, 3, 1, 4), 12, f32).is_none(), "3 does not divide 4 heads");
    assert!(estimate(&m, &c, &plan(4, 1, 1, 3), 16, f32).is_none());
    // Checkpointing trades a third more compute for less activation memory: 4 blocks keep
    // their inputs, and backward holds one block run again and its gradients (Kolo's 4-block
    // GPT on 2 ranks measured 13.9 MB of transient heap against 27.6).
    let ck = estimate(&m, &c, &Plan { recompute: Recompute::Full, ..plan(4, 1, 1, 4) }, 16, f32).unwrap();
    assert!(ck.compute_s > ddp.compute_s * 1.2 && ck.memory.activations < ddp.memory.activations * 0.6);
    assert!(ck.hardware_flops > ck.model_flops && ck.model_flops == ddp.model_flops);
    // Mixed precision halves the layers' activations (the loss keeps f32 values) and runs at
    // the bf16 peak.
    let mixed = estimate(&m, &c, &plan(4, 1, 1, 4), 16, Precision::Mixed).unwrap();
    let layers = |e: &Estimate, p: Precision| e.memory.activations - logits_bytes(&m, 4, 1, p.value_bytes());
    assert!((layers(&mixed, Precision::Mixed) / layers(&ddp, f32) - 0.5).abs() < 1e-12);
    assert!(mixed.compute_s < ddp.compute_s / 4.0, "bf16 tensor cores vs f32");
}

/// Tensor parallelism inside a node runs on NVLink, across nodes on the network: 16-way tp on
/// 8-GPU nodes costs several times the 8-way tp's communication.
#[test]
fn links_follow_the_node_boundaries() {
    let c = Cluster::preset("dgx-a100", 4).unwrap();
    assert_eq!(c.group_link(8, 1), c.intra);
    assert_eq!(c.group_link(16, 1).bandwidth, c.intra.bandwidth.min(8.0 * c.inter.bandwidth));
    // One member per node (dp over tp = 8): the device's own NIC.
    assert_eq!(c.group_link(4, 8).bandwidth, c.inter.bandwidth);
    assert_eq!(c.group_link(2, 2), c.intra);
    let m = Gpt::gpt_style(32, 8192, 64, 2048, 51200);
    let plan = |tp| Plan { recompute: Recompute::Full, ..Plan::new(32 / tp, tp, 1, 1, 1) };
    let t8 = estimate(&m, &c, &plan(8), 64, Precision::Mixed).unwrap();
    let t16 = estimate(&m, &c, &plan(16), 64, Precision::Mixed).unwrap();
    assert!(t16.tp_s > 3.0 * t8.tp_s, "tp 16 {} s vs tp 8 {} s", t16.tp_s, t8.tp_s);
    assert!(Cluster::preset("dgx-a100", 1).unwrap().with_devices(12).is_err(), "12 GPUs are not whole 8-GPU nodes");
    assert!(Cluster::preset("tpu-v9", 1).is_err());
}

/// GPT-3 175B on 1024 A100s with a batch of 1536: Megatron-LM trained it at about 140 TFLOP/s
/// per GPU (31.5 s per step) with t = 8. The search keeps tensor parallelism inside the node;
/// its step is 17% shorter than measured (the model is optimistic on Megatron-LM by 6-13% on
/// Table 1, more here), within 20%.
#[test]
fn gpt3_175b_on_1024_a100s() {
    let m = Gpt::gpt_style(96, 12288, 96, 2048, 51200);
    let c = Cluster { overlap_dp: false, ..Cluster::preset("dgx-a100", 128).unwrap() };
    let space = Space {
        zero_stages: vec![0],
        micro_batches: vec![1, 2, 4],
        recompute: vec![Recompute::Full],
        schedules: vec![Schedule::OneFOneB],
        seq_parallel: vec![false],
        ..Space::default()
    };
    let plans = search(&m, &c, 1536, Precision::Mixed, &space);
    let (best, e) = plans[0];
    assert!(best.tp <= 8, "tensor parallelism across nodes: {best:?}");
    let step = e.step_s;
    assert!((step / 31.5 - 1.0).abs() < 0.20, "{best:?}: {step:.1} s/step, {:.0} TFLOP/s", e.hardware_flops_per_device() / 1e12);
}

/// A 1.3 B GPT on 64 80-GiB devices: the search returns only plans that fit, fastest first;
/// with small devices every plan shards something.
#[test]
fn search_returns_fitting_plans_fastest_first() {
    let m = Gpt::with_params(1.3e9);
    let big = Cluster::preset("dgx-a100", 8).unwrap();
    let plans = search(&m, &big, 512, Precision::Mixed, &Space::default());
    assert!(!plans.is_empty());
    assert!(plans.windows(2).all(|w| w[0].1.step_s <= w[1].1.step_s));
    assert!(plans.iter().all(|(_, e)| e.memory() <= big.device.memory));
    let mut small = big.clone();
    small.device.memory = 16.0 * 1024f64.powi(3);
    let tight = search(&m, &small, 512, Precision::F32, &Space::default());
    assert!(!tight.is_empty());
    assert!(tight.iter().all(|(p, _)| p.zero > 0 || p.tp * p.pp > 1), "16 GiB cannot hold 21 GB of f32 states unsharded");
    small.device.memory = 1e9;
    let none = search(&m, &small, 512, Precision::F32, &Space::default());
    assert!(none.iter().all(|(_, e)| e.memory() <= 1e9));
}

#[test]
fn quantities_parse_with_their_units() {
    assert_eq!(parse_quantity("80GiB").unwrap(), 80.0 * 1024f64.powi(3));
    assert_eq!(parse_quantity("1.3B").unwrap(), 1.3e9);
    assert_eq!(parse_quantity("100Gbps").unwrap(), 100e9);
    assert_eq!(parse_quantity("125M").unwrap(), 125e6);
    assert_eq!(parse_quantity("150TFLOPS").unwrap(), 150e12);
    assert!(parse_quantity("lots").is_err());
    assert!(parse_quantity("3 parsecs").is_err());
}

/// The activations of a layer without sequence parallelism (what Kolo's tensor parallelism and
/// the published runs do) keep the layer norms' and dropouts' share whole on every rank: the
/// same as with it at t = 1, 1.26x of it for BLOOM-176B's layer at its t = 4 and 1.71x for
/// MT-NLG 530B's at t = 8 (issue #37: the planner used the sequence-parallel formula for them).
#[test]
fn activations_without_sequence_parallelism_keep_the_norms_whole() {
    let bloom = Gpt::gpt_style(70, 14336, 112, 2048, 250880);
    let mtnlg = Gpt::gpt_style(105, 20480, 128, 2048, 51200);
    let ratio = |m: &Gpt, t| layer_activation_bytes(m, 1, t, 2.0) / layer_activation_bytes_sp(m, 1, t, 2.0);
    assert!((ratio(&bloom, 1) - 1.0).abs() < 1e-12);
    assert!((ratio(&bloom, 4) - 1.26).abs() < 0.01, "{}", ratio(&bloom, 4));
    assert!((ratio(&mtnlg, 8) - 1.71).abs() < 0.01, "{}", ratio(&mtnlg, 8));
    // Korthikanti et al.'s eq. 2 for MT-NLG's layer at t = 8, one sequence, 2-byte values:
    // s b h (10 + 24/8 + 5 a s / (8 h)) = 2048 x 20480 x (13 + 8).
    let want = 2048.0 * 20480.0 * 21.0;
    assert!((layer_activation_bytes(&mtnlg, 1, 8, 2.0) - want).abs() < 1.0);
}

/// A Llama-style shape (`gated`, no biases, rotary positions).
#[allow(clippy::too_many_arguments)]
fn llama(layers: usize, h: usize, heads: usize, kv: usize, ffn: usize, vocab: usize, tied: bool, experts: (usize, usize)) -> Gpt {
    Gpt {
        kv_heads: kv,
        ffn,
        gated: true,
        tied,
        learned_positions: false,
        experts: experts.0,
        top_k: experts.1,
        ..Gpt::gpt_style(layers, h, heads, 4096, vocab)
    }
}

/// The model description counts the parameters of published models it was not written from
/// (their model cards' or `transformers`' counts): Llama-2-7B (multi-head, SwiGLU 11008,
/// untied) 6.738 B, Mistral-7B (8 key/value heads, 14336) 7.242 B, Mixtral-8x7B 46.70 B with
/// 12.88 B active (2 of 8 experts), SmolLM-135M (tied, 3 of 9 key/value heads) 134.5 M, and
/// GPT-2 (tied, learned positions, biases) 124.4 M; within 0.1 %. A GPT-style shape keeps
/// Narayanan et al.'s FLOPs formula exactly, and a Llama's training FLOPs are 6 x its
/// non-embedding parameters per token plus attention's and the logits' (Kaplan et al.).
#[test]
fn the_model_description_counts_published_models() {
    let cases = [
        ("Llama-2-7B", llama(32, 4096, 32, 32, 11008, 32000, false, (1, 1)), 6.738e9),
        ("Mistral-7B", llama(32, 4096, 32, 8, 14336, 32000, false, (1, 1)), 7.2417e9),
        ("Mixtral-8x7B", llama(32, 4096, 32, 8, 14336, 32000, false, (8, 2)), 46.7028e9),
        ("SmolLM-135M", llama(30, 576, 9, 3, 1536, 49152, true, (1, 1)), 134.515e6),
        ("GPT-2", Gpt { tied: true, ..Gpt::gpt_style(12, 768, 12, 1024, 50257) }, 124.44e6),
    ];
    for (name, m, want) in cases {
        let got = m.params();
        assert!((got / want - 1.0).abs() < 1e-3, "{name}: {got:.4e} parameters, published {want:.4e}");
    }
    let mixtral = cases[2].1;
    assert!((mixtral.active_params() / 12.879e9 - 1.0).abs() < 1e-3, "Mixtral active {:.4e}", mixtral.active_params());
    let g = Gpt::gpt_style(24, 2048, 16, 2048, 51200);
    let (b, l, h, s, v) = (8.0, 24.0, 2048.0, 2048.0, 51200.0);
    let narayanan = 72.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
    assert!((g.step_flops(8.0) / narayanan - 1.0).abs() < 1e-12);
    let m = cases[1].1;
    // Less the embedding, the output layer and every norm (they do no matrix products).
    let non_embedding = m.params() - 2.0 * 32000.0 * 4096.0 - 4096.0 - 32.0 * 2.0 * 4096.0;
    let kaplan = 6.0 * non_embedding + 12.0 * 32.0 * 4096.0 * 4096.0 + 6.0 * 4096.0 * 32000.0;
    let per_token = m.step_flops(1.0) / 4096.0;
    assert!((per_token / kaplan - 1.0).abs() < 1e-12, "{per_token:.6e} vs {kaplan:.6e}");
}

/// Grouped-query attention and a gated MLP change the activations by the widths they have:
/// Mistral-7B's k and v are a quarter of q, its MLP 3.5 h wide and gated; per layer, token and
/// hidden value (2-byte values, no tensor parallelism) 10 + 2 + 2 + 2 x 0.25 x 2 + 8 x 3.5 = 43
/// against GPT's 34, and a Mixtral token visiting 2 experts keeps its MLP's twice.
#[test]
fn activations_follow_the_attention_and_mlp_widths() {
    let m = llama(32, 4096, 32, 8, 14336, 32000, false, (1, 1));
    let per = |m: &Gpt| layer_activation_bytes(m, 1, 1, 2.0) / (4096.0 * 4096.0) - 5.0 * 32.0 * 4096.0 / 4096.0;
    assert!((per(&m) - 43.0).abs() < 1e-9, "{}", per(&m));
    let gpt = Gpt::gpt_style(32, 4096, 32, 4096, 32000);
    assert!((per(&gpt) - 34.0).abs() < 1e-9, "{}", per(&gpt));
    let mixtral = Gpt { experts: 8, top_k: 2, ..m };
    assert!((per(&mixtral) - 43.0 - 28.0).abs() < 1e-9, "{}", per(&mixtral));
}

/// Kolo's runs of the 4 x 256 GPT (sequence 128, vocabulary 65, 16 sequences per step) on 2
/// ranks of this machine on 2026-11-26 17:38-17:41 (docs/benchmarks.md, session 21), against
/// the CPU as `kolo plan --cluster measured` timed it at 17:44 (111 GFLOP/s at best, 5.5 GB/s):
/// nothing here was fitted to them. Every step time within the 25 %, and the 8
/// accumulated micro-batches of 1 (325 ms) are costed slower than one batch of 8 (278 ms), as
/// they run: each accumulated micro-batch adds its gradients through Kolo's flat buffer.
#[test]
fn measured_machine_predicts_runs_it_was_not_fitted_to() {
    let mut c = this_machine(2);
    c.device.peak_f32 = 111e9;
    c.device.mem_bandwidth = 5.5e9;
    c.device.gemm_efficiency = vec![(64.0, 0.875), (128.0, 0.97), (256.0, 1.0), (4096.0, 1.0)];
    let m = bench_gpt();
    let plan = |dp, tp, pp, micro_batch| Plan::new(dp, tp, pp, 0, micro_batch);
    let runs = [
        ("dp 2", plan(2, 1, 1, 8), 278.0),
        ("dp 2, 8 x 1", plan(2, 1, 1, 1), 325.0),
        ("tp 2", plan(1, 2, 1, 16), 280.0),
        ("pp 2", plan(1, 1, 2, 8), 399.0),
    ];
    let mut step = Vec::new();
    for (name, p, ms) in runs {
        let predicted = estimate(&m, &c, &p, 16, Precision::F32).unwrap().step_s * 1e3;
        eprintln!("{name}: predicted {predicted:.1} ms, measured {ms}");
        assert!((predicted / ms - 1.0).abs() < 0.25, "{name}: predicted {predicted:.1} ms, measured {ms}");
        step.push(predicted);
    }
    assert!(step[1] > step[0] * 1.05, "8 micro-batches of 1 ({:.1} ms) costed as fast as one batch of 8 ({:.1} ms)", step[1], step[0]);
}

/// ZeRO beside pipeline and tensor parallelism, as `--plan auto` now plans it: Kolo's runs of
/// the same GPT on 4 ranks of a 2-core Intel Xeon guest on 2026-11-28 22:39-22:41
/// (docs/benchmarks.md, session 38), against the CPU as 4 concurrent `kolo plan --cluster
/// measured` timed it just before (93.7 GFLOP/s at best, 4.17 GB/s, Kolo's AdamW at 12.7 GB/s
/// per rank): nothing here was fitted to them. Step time and memory (the peak heap per rank
/// Kolo reports) within 25 %: dp 2 x pp 2 under ZeRO-1 (2 micro-batches of 4) and dp 2 x tp 2
/// under ZeRO-2.
#[test]
fn zero_beside_model_parallelism_predicts_runs_it_was_not_fitted_to() {
    let gemm = vec![(64.0, 0.122), (128.0, 0.441), (256.0, 0.923), (512.0, 1.0), (4096.0, 1.0)];
    let c = four_ranks_on_two_cores(93.7e9, 4.17e9, 12.7e9, gemm);
    let m = bench_gpt();
    let runs = [
        ("dp 2 x pp 2, ZeRO-1", Plan::new(2, 1, 2, 1, 4), (198.3, 205.5), 96.8e6),
        ("dp 2 x tp 2, ZeRO-2", Plan::new(2, 2, 1, 2, 8), (209.1, 213.4), 107.4e6),
    ];
    for (name, p, (a, b), heap) in runs {
        let e = estimate(&m, &c, &p, 16, Precision::F32).unwrap();
        let ms = (a + b) / 2.0;
        let predicted = e.step_s * 1e3;
        assert!((predicted / ms - 1.0).abs() < 0.25, "{name}: predicted {predicted:.1} ms, measured {ms}");
        assert!((e.memory() / heap - 1.0).abs() < 0.25, "{name}: predicted {:.1} MB, measured {:.1} MB", e.memory() / 1e6, heap / 1e6);
    }
}

/// ZeRO-3 with every block checkpointed beside pipeline or tensor parallelism, as `--plan auto`
/// now plans it: Kolo's runs on 4 ranks of the 2-core Intel Xeon guest on 2026-11-29 (session
/// 40, docs/benchmarks.md) of two shapes, the benchmark GPT (4 x 256, seq 128) and session 39's
/// held-out one (6 x 384, 6 heads, seq 64), 16 sequences a step in f32 with AdamW, against the
/// CPU as 4 concurrent `kolo plan --cluster measured` timed it (the mean of three: 94.2 GFLOP/s
/// at best, 3.43 GB/s, AdamW 12.80 GB/s; a fourth measured before the others began, 180.2):
/// nothing here was fitted to them. Step time (two runs each) and peak heap within 25 %: the
/// largest errors are the pipeline's of the larger shape (time -22 %, memory -17 %), as the
/// ZeRO-2 plan with checkpointing beside a pipeline that `--plan auto` offered before (-19 %,
/// -21 % on the same shape).
#[test]
fn zero3_beside_model_parallelism_predicts_runs_it_was_not_fitted_to() {
    let gemm = vec![(64.0, 0.820), (128.0, 0.973), (256.0, 0.900), (512.0, 0.991), (4096.0, 1.0)];
    let c = four_ranks_on_two_cores(94.2e9, 3.43e9, 12.80e9, gemm);
    let ck = |p: Plan| Plan { recompute: Recompute::Full, ..p };
    let held_out = Gpt::gpt_style(6, 384, 6, 64, 65);
    let runs = [
        ("bench GPT, dp 2 x pp 2", bench_gpt(), ck(Plan::new(2, 1, 2, 3, 4)), (264.8, 244.7), 63.0e6),
        ("bench GPT, dp 2 x tp 2", bench_gpt(), ck(Plan::new(2, 2, 1, 3, 8)), (276.3, 286.2), 56.7e6),
        ("6 x 384, dp 2 x pp 2", held_out, ck(Plan::new(2, 1, 2, 3, 4)), (463.8, 467.1), 134.1e6),
        ("6 x 384, dp 2 x tp 2", held_out, ck(Plan::new(2, 2, 1, 3, 8)), (452.5, 453.0), 91.0e6),
    ];
    for (name, m, p, (a, b), heap) in runs {
        let e = estimate(&m, &c, &p, 16, Precision::F32).unwrap();
        let predicted = e.step_s * 1e3;
        eprintln!("{name}: predicted {predicted:.1} ms, {:.1} MB; measured {a} / {b} ms, {:.1} MB", e.memory() / 1e6, heap / 1e6);
        for ms in [a, b] {
            assert!((predicted / ms - 1.0).abs() < 0.25, "{name}: predicted {predicted:.1} ms, measured {ms}");
        }
        assert!((e.memory() / heap - 1.0).abs() < 0.25, "{name}: predicted {:.1} MB, measured {:.1} MB", e.memory() / 1e6, heap / 1e6);
    }
}

/// Selective recomputation drops the s x s scores from the kept activations and runs
/// attention's core again: between keeping everything and recomputing whole layers in time,
/// at the memory of everything but the scores. With fused attention the scores are never kept
/// (selective is the same as none, and the search does not offer it), backward computes them
/// again, and nothing moves them through memory.
#[test]
fn selective_recomputation_and_fused_attention_drop_the_scores() {
    let m = Gpt::gpt_style(24, 2048, 16, 2048, 50257);
    let unfused = Cluster::preset("dgx-a100", 1).unwrap().with_devices(1).unwrap();
    let plan = |recompute| Plan { recompute, ..Plan::new(1, 1, 1, 0, 2) };
    let at = |c: &Cluster, r| estimate(&m, c, &plan(r), 2, Precision::Mixed).unwrap();
    let (none, sel, full) = (at(&unfused, Recompute::None), at(&unfused, Recompute::Selective), at(&unfused, Recompute::Full));
    let scores = 24.0 * scores_bytes(&m, 2, 1, 2.0);
    assert!((none.memory.activations - sel.memory.activations - scores).abs() < 1.0, "selective keeps all but the scores");
    assert!(full.memory.activations < sel.memory.activations);
    assert!(none.step_s < sel.step_s && sel.step_s < full.step_s, "{} {} {}", none.step_s, sel.step_s, full.step_s);
    assert!(sel.hardware_flops > none.hardware_flops && sel.hardware_flops < full.hardware_flops);
    let fused = Cluster { fused_attention: true, ..unfused.clone() };
    let (f_none, f_sel) = (at(&fused, Recompute::None), at(&fused, Recompute::Selective));
    assert_eq!(f_none, f_sel);
    assert_eq!(f_none.memory.activations, sel.memory.activations);
    // Backward's extra score products cost less than the scores' memory traffic saved here.
    let layer = LayerTime::new(&m, &unfused, 2, 1, 1, false, Precision::Mixed);
    let fused_layer = LayerTime::new(&m, &fused, 2, 1, 1, false, Precision::Mixed);
    assert_eq!(fused_layer.scores, 0.0);
    let gap = layer.step(Recompute::None, false) - fused_layer.step(Recompute::None, true);
    assert!((gap - (3.0 * layer.scores - 0.5 * layer.attention)).abs() < 1e-12);
    let space = Space::default();
    assert!(search(&m, &fused, 8, Precision::Mixed, &space).iter().all(|(p, _)| p.recompute != Recompute::Selective));
    assert!(search(&m, &unfused, 8, Precision::Mixed, &space).iter().any(|(p, _)| p.recompute == Recompute::Selective));
}

/// Pipeline stages hold whole layers, the embeddings on the first and the output layer on the
/// last (a tied embedding on both); the last stage also keeps the loss's logits.
#[test]
fn stages_hold_their_embeddings_and_the_last_the_logits() {
    let llama =
        Gpt { kv_heads: 8, head_dim: 128, ffn: 11008, gated: true, learned_positions: false, ..Gpt::gpt_style(32, 4096, 32, 4096, 32000) };
    assert_eq!(llama.largest_stage_params(1), llama.params());
    let blocks = 16.0 * llama.block_params();
    assert_eq!(llama.largest_stage_params(2), blocks + llama.head_params(), "the head and final norm outweigh the embedding");
    assert_eq!(llama.head_params() - llama.embedding_params(), 4096.0, "untied: the same matrix and the final norm");
    let tied = Gpt { tied: true, ..llama };
    assert_eq!(tied.largest_stage_params(2), blocks + tied.embedding_params() + tied.head_params());
    let three = llama.largest_stage_params(3);
    assert_eq!(three, 11.0 * llama.block_params() + llama.head_params(), "ceil(32 / 3) = 11 blocks");
    // The memory of a pipeline of 2 on 2 devices: the largest stage's states.
    let c = Cluster::preset("dgx-a100", 1).unwrap().with_devices(2).unwrap();
    let e = estimate(&llama, &c, &Plan { recompute: Recompute::Full, ..Plan::new(1, 1, 2, 0, 1) }, 8, Precision::Mixed).unwrap();
    assert!((e.memory.params - 2.0 * llama.largest_stage_params(2)).abs() < 1.0);
    // One micro-batch on one device: its layers and the f32 logits of 4096 tokens x 32000.
    let one = Cluster::preset("dgx-a100", 1).unwrap().with_devices(1).unwrap();
    let e = estimate(&llama, &one, &Plan::new(1, 1, 1, 0, 1), 1, Precision::Mixed).unwrap();
    let want = 32.0 * layer_activation_bytes(&llama, 1, 1, 2.0) + 4096.0 * 32000.0 * 6.0;
    assert!((e.memory.activations - want).abs() < 1.0, "{} vs {want}", e.memory.activations);
}

/// Adam's update is costed on the parameters a device updates (its ZeRO shard), and ZeRO-1/2's
/// all-gather of the updated shards follows the step without overlap.
#[test]
fn the_optimizer_step_and_the_zero_all_gather_are_costed() {
    let m = Gpt::with_params(1.3e9);
    let c = Cluster::preset("dgx-a100", 1).unwrap();
    let plan = |zero| Plan::new(8, 1, 1, zero, 4);
    let at = |zero| estimate(&m, &c, &plan(zero), 64, Precision::Mixed).unwrap();
    let (ddp, z1) = (at(0), at(1));
    assert!((ddp.optimizer_s - m.params() * 30.0 / c.device.update_bandwidth).abs() < 1e-12);
    assert!((z1.optimizer_s - ddp.optimizer_s / 8.0).abs() < 1e-12);
    let all_reduce = all_reduce_s(m.params() * 2.0, 8, c.intra);
    assert!((z1.dp_exposed_s - (0.1 * all_reduce / 2.0 + all_reduce / 2.0)).abs() < 1e-9, "{} vs {all_reduce}", z1.dp_exposed_s);
    assert!((ddp.dp_exposed_s - 0.1 * all_reduce).abs() < 1e-9);
}

/// Transformers' Llama under torch eager on one H200 (bf16 autocast, SDPA, fused AdamW,
/// sequence 2048; `python bench/gpu/planner_check.py llama`, session 22): the `dgx-h200` preset
/// with the runtime's two constants (activation factor 1.664, 531 us a layer) fitted to ONE of
/// these runs, Llama-3.2-1B at micro-batch 4, predicts the others, shapes it was not fitted to
/// (Qwen2.5-0.5B's 14 heads over 2 key/value heads and 152 k vocabulary, Llama-3.2-3B, full
/// recomputation, other micro-batches): step time within 10 %, peak memory within 20 %
/// (docs/benchmarks.md).
#[test]
fn llama_shapes_on_an_h200_follow_one_calibration_run() {
    let llama = |layers, d_model, heads, kv_heads, ffn, vocab| Gpt {
        kv_heads,
        head_dim: d_model / heads,
        ffn,
        gated: true,
        tied: true,
        learned_positions: false,
        ..Gpt::gpt_style(layers, d_model, heads, 2048, vocab)
    };
    let c =
        Cluster { activation_factor: 1.664, layer_overhead_s: 531e-6, ..Cluster::preset("dgx-h200", 1).unwrap().with_devices(1).unwrap() };
    let (l1, qwen, l3) = (llama(16, 2048, 32, 8, 8192, 128256), llama(24, 896, 14, 2, 4864, 151936), llama(28, 3072, 24, 8, 8192, 128256));
    #[rustfmt::skip]
    let runs = [
        // (model, micro-batch, recomputation, measured s/step, measured peak GiB)
        (l1, 4, Recompute::None, 0.18325, 43.84), // the calibration run
        (l1, 2, Recompute::None, 0.10364, 30.01),
        (qwen, 4, Recompute::None, 0.11484, 32.65),
        (qwen, 8, Recompute::None, 0.20948, 58.78),
        (l3, 1, Recompute::None, 0.15877, 53.60),
        (l3, 2, Recompute::None, 0.24604, 65.24),
        (l1, 4, Recompute::Full, 0.22119, 27.26),
        (l1, 8, Recompute::Full, 0.41706, 40.16),
    ];
    for (i, (m, b, recompute, step, peak)) in runs.into_iter().enumerate() {
        let e = estimate(&m, &c, &Plan { recompute, ..Plan::new(1, 1, 1, 0, b) }, b, Precision::Mixed).unwrap();
        let (t, mem) = (e.step_s / step - 1.0, e.memory() / 1024f64.powi(3) / peak - 1.0);
        eprintln!("{} layers x {}, micro {b}, {recompute:?}: step {:+.1} %, memory {:+.1} %", m.layers, m.d_model, 100.0 * t, 100.0 * mem);
        let bound = if i == 0 { 0.005 } else { 0.10 };
        assert!(t.abs() < bound, "run {i}: predicted {:.4} s, measured {step}", e.step_s);
        assert!(
            mem.abs() < if i == 0 { 0.005 } else { 0.20 },
            "run {i}: predicted {:.2} GiB, measured {peak}",
            e.memory() / 1024f64.powi(3)
        );
    }
}

/// Interleaving v chunks per device cuts the bubble v times, sends v times the activations
/// between stages and keeps 1 + (pp - 1) / (pp v) times 1F1B's activations on the first stage;
/// PipeDream-2BW has no bubble and keeps a second version of the stage's weights; Megatron's
/// sequence parallelism splits the activations kept whole on every tensor-parallel rank.
#[test]
fn schedules_and_sequence_parallelism_are_costed() {
    let m = Gpt::gpt_style(32, 4096, 32, 2048, 51200);
    let c = Cluster::preset("dgx-a100", 2).unwrap();
    let base = Plan { recompute: Recompute::Full, ..Plan::new(2, 2, 4, 0, 1) };
    let at = |p: Plan| estimate(&m, &c, &p, 64, Precision::Mixed).unwrap();
    let one = at(base);
    let two = at(Plan { schedule: Schedule::Interleaved(2), ..base });
    assert!((two.bubble_s - one.bubble_s / 2.0).abs() < 1e-12, "{} vs {}", two.bubble_s, one.bubble_s);
    let slot_pp = |e: &Estimate| e.pp_s / (e.micro_batches as f64 + e.bubble_s / (e.compute_s / e.micro_batches as f64));
    assert!((slot_pp(&two) / slot_pp(&one) - 2.0).abs() < 1e-9, "twice the stage-to-stage traffic a slot");
    let layer_in = 8.0 * 2048.0 * 4096.0 * 2.0; // the stage's layers' kept inputs a micro-batch
    let kept = |e: &Estimate| e.memory.activations - 2.0 * layer_activation_bytes(&m, 1, 2, 2.0);
    assert!((kept(&one) - 4.0 * layer_in).abs() < 1.0, "1F1B: 4 micro-batches in flight");
    assert!((kept(&two) - 4.0 * (1.0 + 3.0 / 8.0) * layer_in).abs() < 1.0, "interleaved: 1 + (p - 1) / (p v) times");
    assert!(
        estimate(&m, &c, &Plan { schedule: Schedule::Interleaved(3), ..base }, 64, Precision::Mixed).is_none(),
        "32 layers in 12 chunks"
    );
    assert!(
        estimate(&m, &c, &Plan { schedule: Schedule::Interleaved(2), ..base }, 12, Precision::Mixed).is_none(),
        "6 micro-batches in rounds of 4"
    );
    let bw = at(Plan { schedule: Schedule::TwoBw, ..base });
    assert_eq!(bw.bubble_s, 0.0);
    assert!((bw.memory.runtime - one.memory.runtime - 2.0 * m.largest_stage_params(4) / 2.0).abs() < 1.0);
    assert!(
        estimate(&m, &c, &Plan { schedule: Schedule::TwoBw, ..Plan::new(16, 1, 1, 0, 1) }, 64, Precision::Mixed).is_none(),
        "no stages"
    );
    // Sequence parallelism: Korthikanti's s b h (34 + 5 a s / h) / t against (10 + 24 / t + ...).
    let keep_all = Plan { recompute: Recompute::None, ..base };
    let (plain, sp) = (at(keep_all), at(Plan { seq_parallel: true, ..keep_all }));
    let per_layer = layer_activation_bytes(&m, 1, 2, 2.0) - layer_activation_bytes_sp(&m, 1, 2, 2.0);
    assert!((plain.memory.activations - sp.memory.activations - 8.0 * 4.0 * per_layer).abs() < 1.0);
    assert!(sp.compute_s < plain.compute_s, "less memory traffic");
    assert!(estimate(&m, &c, &Plan { seq_parallel: true, ..Plan::new(16, 1, 1, 0, 1) }, 64, Precision::Mixed).is_none(), "no tp");
    for s in ["1f1b", "interleaved:2", "2bw"] {
        assert_eq!(Schedule::parse(s).unwrap().name(), s);
    }
    assert!(Schedule::parse("interleaved:1").is_err() && Schedule::parse("zb").is_err());
}

/// Expert parallelism deals a stage's experts out over ep of the dp replicas: each holds 1/ep
/// of them (their states sharded over the dp / ep replicas that share them), pays two
/// all-to-alls of its tokens x top-k rows per MoE layer each way, and reduces the experts'
/// gradients over dp / ep replicas only. Degrees that split neither the experts nor dp, or a
/// dense model, are not plans.
#[test]
fn expert_parallelism_deals_the_experts_out() {
    let mixtral = Gpt {
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        gated: true,
        learned_positions: false,
        experts: 8,
        top_k: 2,
        ..Gpt::gpt_style(32, 4096, 32, 4096, 32000)
    };
    let c = Cluster::preset("dgx-a100", 8).unwrap();
    let at = |ep, zero| estimate(&mixtral, &c, &Plan { ep, ..Plan::new(64, 1, 1, zero, 1) }, 64, Precision::Mixed);
    let (one, eight) = (at(1, 0).unwrap(), at(8, 0).unwrap());
    let experts = 32.0 * mixtral.expert_block_params();
    assert!((one.memory.params / 2.0 - mixtral.params()).abs() < 1.0);
    assert!((eight.memory.params / 2.0 - (mixtral.params() - experts * 7.0 / 8.0)).abs() < 1.0, "1/8 of the experts each");
    assert_eq!(one.ep_s, 0.0);
    let link = c.group_link(8, 1);
    let a2a = 7.0 * link.latency + 4096.0 * 4096.0 * 2.0 * 2.0 * 7.0 / 8.0 / link.bandwidth;
    assert!((eight.ep_s - 32.0 * 4.0 * a2a).abs() < 1e-9, "{} vs {}", eight.ep_s, 32.0 * 4.0 * a2a);
    assert!(eight.dp_exposed_s < one.dp_exposed_s, "the experts' gradients go to 8 replicas, not 64");
    // ZeRO-1 shards the experts' states over the 8 replicas that share them.
    let z1 = at(8, 1).unwrap();
    let (dense, own) = (mixtral.params() - experts, experts / 8.0);
    assert!((z1.memory.optimizer - (12.0 * dense / 64.0 + 12.0 * own / 8.0)).abs() < 1.0);
    assert!(at(3, 0).is_none() && at(128, 0).is_none(), "3 does not split 8 experts; 128 is more than dp");
    let dense_model = Gpt { experts: 1, top_k: 1, ..mixtral };
    assert!(estimate(&dense_model, &c, &Plan { ep: 2, ..Plan::new(64, 1, 1, 0, 1) }, 64, Precision::Mixed).is_none());
    // On two nodes (747 GB of model states in all), the search finds plans that deal the
    // experts out, and every plan that fits shards something.
    let nodes = Cluster::preset("dgx-a100", 2).unwrap();
    let plans = search(&mixtral, &nodes, 64, Precision::Mixed, &Space::default());
    assert!(plans.iter().any(|(p, _)| p.ep > 1), "no expert-parallel plan fits");
    assert!(plans.iter().all(|(p, _)| p.ep > 1 || p.zero > 0 || p.tp * p.pp > 1));
}

/// Context parallelism (ring attention) splits each sequence over cp ranks: a rank keeps and
/// computes for s / cp tokens (whose queries meet all s keys), passes its keys and values cp - 1
/// steps around the ring in every layer (three times with backward), and shares the
/// parameters with its ring, so ZeRO shards and gradients span dp x cp. A sequence that does not
/// split, or devices that are not dp x tp x pp x cp, are not plans.
#[test]
fn context_parallelism_splits_the_sequence() {
    let llama = Gpt {
        kv_heads: 8,
        head_dim: 128,
        ffn: 14336,
        gated: true,
        learned_positions: false,
        ..Gpt::gpt_style(32, 4096, 32, 32768, 128256)
    };
    let one = Cluster::preset("dgx-a100", 1).unwrap().with_devices(1).unwrap();
    let eight = Cluster::preset("dgx-a100", 1).unwrap();
    let alone = estimate(&llama, &one, &Plan::new(1, 1, 1, 0, 1), 1, Precision::Mixed).unwrap();
    let ring = estimate(&llama, &eight, &Plan { cp: 8, ..Plan::new(1, 1, 1, 0, 1) }, 1, Precision::Mixed).unwrap();
    assert!((ring.memory.activations - alone.memory.activations / 8.0).abs() < 1.0, "an eighth of the tokens' activations");
    assert!(ring.compute_s < alone.compute_s / 7.0 && ring.compute_s > alone.compute_s / 9.0, "{} vs {}", ring.compute_s, alone.compute_s);
    let link = eight.group_link(8, 1);
    let kv = 2.0 * 4096.0 * 1024.0 * 2.0; // keys and values of 4096 tokens x 1024, bf16
    let want = 32.0 * 3.0 * 7.0 * (link.latency + kv / link.bandwidth);
    assert!((ring.cp_s - want).abs() < 1e-9, "{} vs {want}", ring.cp_s);
    assert_eq!(alone.cp_s, 0.0);
    // ZeRO-1 over the 8 ranks of the ring: the optimizer states an eighth each.
    let z1 = estimate(&llama, &eight, &Plan { cp: 8, ..Plan::new(1, 1, 1, 1, 1) }, 1, Precision::Mixed).unwrap();
    assert!((z1.memory.optimizer - 12.0 * llama.params() / 8.0).abs() < 1.0);
    let odd = Gpt { seq: 32769, ..llama };
    assert!(estimate(&odd, &eight, &Plan { cp: 8, ..Plan::new(1, 1, 1, 0, 1) }, 1, Precision::Mixed).is_none());
    assert!(estimate(&llama, &eight, &Plan { cp: 4, ..Plan::new(1, 1, 1, 0, 1) }, 1, Precision::Mixed).is_none(), "4 of 8 devices");
    // A long sequence that fits no single device: the search splits it.
    let plans = search(&llama, &eight, 8, Precision::Mixed, &Space { cp: vec![1, 2, 4, 8], ..Space::default() });
    assert!(plans.iter().any(|(p, _)| p.cp > 1), "no context-parallel plan fits");
}

/// Kolo's runs of the 4 x 256 GPT (16 sequences a step) on 4 ranks of this 2-core machine,
/// 2026-11-26 20:52-20:54 (docs/benchmarks.md, session 22), against the CPU as 4 concurrent
/// `kolo plan --cluster measured` timed it at 20:51 (55.3 GFLOP/s and 2.81 GB/s per rank,
/// Kolo's AdamW 26 GB/s): every step time within the 25 %. The pipeline's bubble costs
/// nothing here: a stage waiting in it leaves its core to the ranks sharing it
/// (`Cluster::cores_per_node`; that rule came from this pp run, which without it is predicted
/// 440 ms against 267-287 measured).
#[test]
fn four_ranks_on_two_cores_follow_the_measured_machine() {
    let gemm = vec![(64.0, 0.891), (128.0, 0.991), (256.0, 0.995), (512.0, 1.0), (4096.0, 1.0)];
    let c = four_ranks_on_two_cores(55.31e9, 2.807e9, 26.14e9, gemm);
    let m = bench_gpt();
    let runs = [
        ("dp 4", Plan::new(4, 1, 1, 0, 4), &[260.9, 266.9, 313.3][..]),
        ("dp 2 x tp 2", Plan::new(2, 2, 1, 0, 8), &[299.5, 274.2]),
        ("dp 2 x pp 2", Plan::new(2, 1, 2, 0, 4), &[286.9, 267.3]),
        ("tp 4", Plan::new(1, 4, 1, 0, 16), &[315.4, 348.4]),
    ];
    for (name, p, measured) in runs {
        let predicted = estimate(&m, &c, &p, 16, Precision::F32).unwrap().step_s * 1e3;
        eprintln!("{name}: predicted {predicted:.1} ms, measured {measured:?}");
        for ms in measured {
            assert!((predicted / ms - 1.0).abs() < 0.25, "{name}: predicted {predicted:.1} ms, measured {ms}");
        }
    }
    let alone = Cluster { cores_per_node: 0, ..c };
    let piped = estimate(&m, &alone, &Plan::new(2, 1, 2, 0, 4), 16, Precision::F32).unwrap().step_s * 1e3;
    assert!(piped / 287.0 > 1.4, "with a core each, the bubble is paid: {piped:.1} ms");
}

/// FP8 runs the matrix products at the device's FP8 peak and keeps everything else as mixed
/// precision does; a device without FP8 has no fp8 plans.
#[test]
fn fp8_is_planned_where_the_device_has_it() {
    let m = Gpt::with_params(6.7e9);
    let h100 = Cluster::preset("dgx-h100", 2).unwrap();
    let plan = Plan::new(16, 1, 1, 1, 4);
    let (bf16, fp8) =
        (estimate(&m, &h100, &plan, 512, Precision::Mixed).unwrap(), estimate(&m, &h100, &plan, 512, Precision::Fp8).unwrap());
    assert!(fp8.compute_s < bf16.compute_s * 0.75, "{} vs {}", fp8.compute_s, bf16.compute_s);
    assert_eq!(fp8.memory, bf16.memory);
    assert_eq!(fp8.peak, 1979e12);
    assert_eq!(Precision::parse("fp8"), Ok(Precision::Fp8));
    let a100 = Cluster::preset("dgx-a100", 2).unwrap();
    assert!(estimate(&m, &a100, &plan, 512, Precision::Fp8).is_none());
    assert!(search(&m, &a100, 512, Precision::Fp8, &Space::default()).is_empty());
}

/// A tied embedding's two copies (first and last stage) have their gradients summed after
/// backward: one all-reduce of V x h values between the two ends of the pipeline.
#[test]
fn tied_embeddings_are_reduced_between_the_end_stages() {
    let untied = Gpt { gated: true, learned_positions: false, ..Gpt::gpt_style(32, 4096, 32, 4096, 128256) };
    let tied = Gpt { tied: true, ..untied };
    let c = Cluster::preset("dgx-a100", 2).unwrap();
    let plan = Plan { recompute: Recompute::Full, ..Plan::new(2, 1, 8, 1, 1) };
    let at = |m: &Gpt| estimate(m, &c, &plan, 64, Precision::Mixed).unwrap();
    let want = all_reduce_s(128256.0 * 4096.0 * 2.0, 2, c.group_link(2, 7 * 2));
    assert!((at(&tied).pp_s - at(&untied).pp_s - want).abs() < 1e-12, "{} vs {want}", at(&tied).pp_s - at(&untied).pp_s);
    let one_stage = Plan::new(16, 1, 1, 1, 1);
    assert_eq!(estimate(&tied, &c, &one_stage, 64, Precision::Mixed).unwrap().pp_s, 0.0);
}

/// The memory of activation checkpointing beside tensor and pipeline parallelism, checked on
/// runs the model was not fitted to (session 39, docs/benchmarks.md): a GPT of 6 layers,
/// d_model 384, 6 heads, seq 64, 16 sequences a step in f32 with AdamW, `kolo train` on 2 and
/// 4 ranks, rank 0's peak heap (the `kolo` binary's counting allocator). Within 25 % each; the
/// model's two terms that made these fit (a checkpointed layer's backward holds the layer run
/// again and the gradients of its activations: two layers; an accumulating runtime's f32
/// gradient accumulator beside its buckets) describe Kolo's runtime, they were not fitted.
/// Before them checkpointing beside tp or pp was undercounted by 40-47 % (session 38). The
/// heaps are session 40's, since checkpointed blocks read their variables in place (7-14 MB
/// less than session 39's); ZeRO-3 beside a pipeline, -17 % now, -25 % before, is still left
/// out of `--plan auto`.
#[test]
fn checkpointing_beside_model_parallelism_predicts_the_memory_of_runs_it_was_not_fitted_to() {
    let m = Gpt::gpt_style(6, 384, 6, 64, 65);
    let ck = |p: Plan| Plan { recompute: Recompute::Full, ..p };
    let runs = [
        ("tp 2", Plan::new(1, 2, 1, 0, 16), 224.1e6),
        ("pp 2", Plan::new(1, 1, 2, 0, 4), 186.1e6),
        ("tp 2, checkpointing", ck(Plan::new(1, 2, 1, 0, 16)), 144.7e6),
        ("pp 2, checkpointing", ck(Plan::new(1, 1, 2, 0, 4)), 160.9e6),
        ("dp 2 x tp 2, checkpointing", ck(Plan::new(2, 2, 1, 0, 8)), 119.8e6),
        ("dp 2, checkpointing", ck(Plan::new(2, 1, 1, 0, 8)), 215.2e6),
        ("dp 2, ZeRO-3, checkpointing", ck(Plan::new(2, 1, 1, 3, 8)), 158.0e6),
        ("dp 2 x pp 2, ZeRO-3, checkpointing", ck(Plan::new(2, 1, 2, 3, 4)), 134.1e6),
    ];
    for (name, p, heap) in runs {
        let c = this_machine(p.dp * p.tp * p.pp);
        let e = estimate(&m, &c, &p, 16, Precision::F32).unwrap();
        let err = e.memory() / heap - 1.0;
        assert!(err.abs() < 0.25, "{name}: predicted {:.1} MB, measured {:.1} MB", e.memory() / 1e6, heap / 1e6);
    }
}
