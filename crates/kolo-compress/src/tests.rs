use super::*;
use kolo_base::Rng;

fn data(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.normal() as f32).collect()
}

#[test]
fn casts_round_trip_within_half_precision() {
    let x = data(1001, 1);
    let mut back = vec![0f32; x.len()];
    cast::from_f16(&cast::to_f16(&x), &mut back);
    assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() <= a.abs() * 1e-3 + 1e-7));
    cast::from_bf16(&cast::to_bf16(&x), &mut back);
    assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() <= a.abs() * 8e-3 + 1e-30));
}

#[test]
fn topk_keeps_the_largest_and_randk_is_unbiased_and_shared() {
    for n in [0usize, 1, 7, 1000] {
        let x = data(n, 2);
        let s = topk(&x, 0.1);
        assert_eq!(s.indices.len(), sparse::keep_count(n, 0.1));
        if n > 0 {
            let smallest_kept = s.values.iter().map(|v| v.abs()).fold(f32::INFINITY, f32::min);
            let dense = s.to_dense();
            let largest_dropped = x.iter().zip(&dense).filter(|(_, d)| **d == 0.0).map(|(v, _)| v.abs()).fold(0f32, f32::max);
            assert!(smallest_kept >= largest_dropped, "n {n}");
        }
    }
    // Every rank with the same seed picks the same positions.
    assert_eq!(sparse::randk_indices(100, 0.2, 9), sparse::randk_indices(100, 0.2, 9));
    // Unbiased: the mean over seeds approaches the input.
    let x = data(50, 3);
    let mut mean = vec![0f64; x.len()];
    let trials = 4000;
    for t in 0..trials {
        for (m, v) in mean.iter_mut().zip(randk(&x, 0.2, t).to_dense()) {
            *m += f64::from(v) / trials as f64;
        }
    }
    let err = mean.iter().zip(&x).map(|(m, v)| (m - f64::from(*v)).abs()).fold(0f64, f64::max);
    assert!(err < 0.25, "random-k mean error {err}");
}

#[test]
fn qsgd_is_unbiased_with_bounded_error() {
    let x = data(64, 4);
    let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
    let mut rng = Rng::new(5);
    let mut mean = vec![0f64; x.len()];
    let trials = 4000;
    let mut out = vec![0f32; x.len()];
    for _ in 0..trials {
        let q = qsgd::quantize(&x, 4, &mut rng);
        qsgd::dequantize(&q, &mut out);
        // Each value is off by at most one level.
        assert!(x.iter().zip(&out).all(|(a, b)| (a - b).abs() <= norm / 4.0 + 1e-5));
        mean.iter_mut().zip(&out).for_each(|(m, v)| *m += f64::from(*v) / trials as f64);
    }
    let err = mean.iter().zip(&x).map(|(m, v)| (m - f64::from(*v)).abs()).fold(0f64, f64::max);
    assert!(err < 0.05 * f64::from(norm), "QSGD mean error {err}");
    let zero = qsgd::quantize(&[0.0; 5], 4, &mut rng);
    qsgd::dequantize(&zero, &mut out[..5]);
    assert!(out[..5].iter().all(|v| *v == 0.0));
}

/// With error feedback, the sum of what was sent over many steps equals the sum of the
/// gradients up to the final residual, whatever the codec drops.
#[test]
fn error_feedback_preserves_the_sum_of_gradients() {
    let n = 40;
    let mut ef = ErrorFeedback::new(n);
    let (mut sent_sum, mut grad_sum) = (vec![0f32; n], vec![0f32; n]);
    for step in 0..50 {
        let g = data(n, 100 + step);
        grad_sum.iter_mut().zip(&g).for_each(|(s, v)| *s += v);
        let mut c = g.clone();
        ef.add_into(&mut c);
        let (bits, scale) = sign(&c);
        let mut sent = vec![0f32; n];
        unsign(&bits, scale, &mut sent);
        ef.keep(&c, &sent);
        sent_sum.iter_mut().zip(&sent).for_each(|(s, v)| *s += v);
    }
    for i in 0..n {
        assert!((sent_sum[i] + ef.residual()[i] - grad_sum[i]).abs() < 1e-3, "element {i}");
    }
}

#[test]
fn powersgd_at_full_rank_is_exact_and_low_rank_matrices_are_recovered() {
    let (rows, cols) = (6, 5);
    let m = data(rows * cols, 7);
    let r = cols; // full rank
    let mut q = data(cols * r, 8);
    let mut out = vec![0f32; rows * cols];
    powersgd::compress_local(&m, rows, cols, r, &mut q, &mut out);
    let err = m.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-4, "full-rank PowerSGD error {err}");
    // A rank-1 matrix is recovered exactly at rank 1.
    let (u, v) = (data(rows, 9), data(cols, 10));
    let m1: Vec<f32> = (0..rows * cols).map(|i| u[i / cols] * v[i % cols]).collect();
    let mut q1 = data(cols, 11);
    powersgd::compress_local(&m1, rows, cols, 1, &mut q1, &mut out);
    let err = m1.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-4, "rank-1 error {err}");
    assert!(powersgd::worth_it(256, 256, 4) && !powersgd::worth_it(4, 4, 4) && !powersgd::worth_it(1, 100, 1));
}

/// A sampled threshold keeps about k values (here within a factor of 2), every one of them at
/// least as large as every value it drops; short buffers are selected exactly.
#[test]
fn sampled_threshold_topk_keeps_about_k_of_the_largest() {
    let mut r = kolo_base::Rng::new(4);
    let x: Vec<f32> = (0..100_000).map(|_| r.normal() as f32).collect();
    let k = sparse::keep_count(x.len(), 0.01);
    let s = sparse::topk_sampled(&x, 0.01, 4096, 7);
    assert!(s.indices.len() >= k / 2 && s.indices.len() <= 2 * k, "{} kept for k = {k}", s.indices.len());
    let kept_min = s.values.iter().map(|v| v.abs()).fold(f32::INFINITY, f32::min);
    let mut kept = vec![false; x.len()];
    s.indices.iter().for_each(|&i| kept[i as usize] = true);
    let dropped_max = x.iter().enumerate().filter(|(i, _)| !kept[*i]).map(|(_, v)| v.abs()).fold(0f32, f32::max);
    assert!(kept_min >= dropped_max, "kept {kept_min} < dropped {dropped_max}");
    assert!(s.indices.windows(2).all(|w| w[0] < w[1]));
    let small: Vec<f32> = (0..100).map(|i| i as f32).collect();
    assert_eq!(sparse::topk_sampled(&small, 0.1, 4096, 1), sparse::topk(&small, 0.1));
}
