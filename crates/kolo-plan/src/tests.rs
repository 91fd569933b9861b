use super::*;

fn bench_gpt() -> Gpt {
    Gpt { layers: 4, d_model: 256, heads: 4, seq: 128, vocab: 65 }
}

#[test]
fn parameter_counts_match_the_models() {
    assert_eq!(bench_gpt().params(), 3_225_665.0, "Kolo's benchmark GPT");
    let g = Gpt::with_params(1.3e9);
    assert_eq!((g.layers, g.d_model), (24, 2048));
    assert!((g.params() / 1.3e9 - 1.0).abs() < 0.1, "{}", g.params());
    assert_eq!(Gpt::with_params(175e9).layers, 96);
}

#[test]
fn model_states_follow_the_zero_formulas() {
    // Kolo's measured GPT-m (25.35 M parameters) model states: DDP 408.3 MB, ZeRO-1 on 2 ranks
    // 357.6 MB, ZeRO-2 on 4 ranks 205.5 MB (docs/benchmarks.md): within 15% (in fact 1%).
    let phi = 25.35e6;
    for (zero, dp, measured) in [(0u8, 2usize, 408.3e6), (1, 2, 357.6e6), (2, 2, 306.9e6), (1, 4, 281.6e6), (2, 4, 205.5e6)] {
        let p = state_bytes(phi, zero, dp);
        assert!((p / measured - 1.0).abs() < 0.15, "ZeRO-{zero} on {dp}: predicted {p}, measured {measured}");
    }
    assert_eq!(state_bytes(1e6, 3, 4), 4e6);
    // ZeRO-3 on 2 and 4 ranks: 206.1 and 104.7 MB measured (plus 0.5 MB of resident embeddings).
    for (dp, measured) in [(2usize, 206.1e6), (4, 104.7e6)] {
        let p = state_bytes(phi, 3, dp);
        assert!((p / measured - 1.0).abs() < 0.15, "ZeRO-3 on {dp}: predicted {p}, measured {measured}");
    }
}

/// Peak memory with activations, Kolo's runtime constants: GPT-m (8 x 512, batch 8 x 128) DDP
/// peak heap 1172 MB measured; the benchmark GPT in one process 243.4 MB (51.6 states + 191.8).
#[test]
fn peak_memory_predictions_match_kolos_measurements() {
    let c = |devices| Cluster {
        devices,
        memory: 1e12,
        flops: 67e9,
        bandwidth: 1.5e9,
        latency: 20e-6,
        activation_factor: Cluster::KOLO_CPU_ACTIVATIONS,
        param_copy_bytes: Cluster::KOLO_PARAM_COPY,
    };
    let gptm = Gpt { layers: 8, d_model: 512, heads: 8, seq: 128, vocab: 65 };
    let e = estimate(&gptm, &c(2), &Plan { dp: 2, tp: 1, pp: 1, zero: 0, micro_batch: 8, checkpoint: false }, 16, 4.0).unwrap();
    assert!((e.memory() / 1172.2e6 - 1.0).abs() < 0.15, "GPT-m DDP peak {} MB", e.memory() / 1e6);
    let e = estimate(&bench_gpt(), &c(1), &Plan { dp: 1, tp: 1, pp: 1, zero: 0, micro_batch: 8, checkpoint: false }, 8, 4.0).unwrap();
    assert!((e.memory() / 243.4e6 - 1.0).abs() < 0.15, "GPT peak {} MB", e.memory() / 1e6);
}

#[test]
fn estimates_add_up_and_respect_the_constraints() {
    let m = bench_gpt();
    let c =
        Cluster { devices: 4, memory: 8e9, flops: 67e9, bandwidth: 1.5e9, latency: 20e-6, activation_factor: 1.0, param_copy_bytes: 0.0 };
    let plan = |dp, tp, pp, micro_batch| Plan { dp, tp, pp, zero: 0, micro_batch, checkpoint: false };
    let ddp = estimate(&m, &c, &plan(4, 1, 1, 4), 16, 4.0).unwrap();
    assert_eq!((ddp.tp_s, ddp.pp_s, ddp.bubble_s), (0.0, 0.0, 0.0));
    assert!((ddp.step_s - (ddp.compute_s + ddp.dp_exposed_s)).abs() < 1e-12);
    let pipe = estimate(&m, &c, &plan(1, 1, 4, 2), 16, 4.0).unwrap();
    assert_eq!(pipe.micro_batches, 8);
    assert!((pipe.bubble_s / pipe.compute_s - 3.0 / 8.0).abs() < 1e-12, "(pp - 1) / m");
    let tp = estimate(&m, &c, &plan(1, 4, 1, 16), 16, 4.0).unwrap();
    assert!(tp.tp_s > 0.0 && tp.activations < ddp.activations * 4.0);
    // Not a plan: sizes that do not multiply to the devices, heads that do not split, batches
    // that do not divide.
    assert!(estimate(&m, &c, &plan(2, 1, 1, 4), 16, 4.0).is_none());
    assert!(estimate(&m, &Cluster { devices: 3, ..c }, &plan(1, 3, 1, 4), 12, 4.0).is_none(), "3 does not divide 4 heads");
    assert!(estimate(&m, &c, &plan(4, 1, 1, 3), 16, 4.0).is_none());
    // Checkpointing trades a third more compute for less activation memory.
    let ck = estimate(&m, &c, &Plan { checkpoint: true, ..plan(4, 1, 1, 4) }, 16, 4.0).unwrap();
    assert!((ck.compute_s / ddp.compute_s - 4.0 / 3.0).abs() < 1e-12 && ck.activations < ddp.activations / 3.0);
}

/// A 1.3 B GPT on 64 80-GiB devices fits as plain DDP only with help (16 bytes per parameter =
/// 20.8 GB of states, activations of 2048-token sequences): the search returns only plans that
/// fit, fastest first; with small devices every plan shards something.
#[test]
fn search_returns_fitting_plans_fastest_first() {
    let m = Gpt::with_params(1.3e9);
    let big = Cluster {
        devices: 64,
        memory: 80.0 * 1024f64.powi(3),
        flops: 150e12,
        bandwidth: 12.5e9,
        latency: 5e-6,
        activation_factor: 1.0,
        param_copy_bytes: 0.0,
    };
    let plans = search(&m, &big, 512, 2.0, &Space::default());
    assert!(!plans.is_empty());
    assert!(plans.windows(2).all(|w| w[0].1.step_s <= w[1].1.step_s));
    assert!(plans.iter().all(|(_, e)| e.memory() <= big.memory));
    let small = Cluster { memory: 16.0 * 1024f64.powi(3), ..big };
    let tight = search(&m, &small, 512, 2.0, &Space::default());
    assert!(!tight.is_empty());
    assert!(tight.iter().all(|(p, _)| p.zero > 0 || p.tp * p.pp > 1), "16 GiB cannot hold 21 GB of states unsharded");
    let none = search(&m, &Cluster { memory: 1e9, ..big }, 512, 2.0, &Space::default());
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
