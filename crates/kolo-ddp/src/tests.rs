use super::*;

#[test]
fn plan_reverses_and_caps() {
    let p = bucket_plan(&[10, 20, 30, 40], 60, 60);
    assert_eq!(p, vec![Bucket { params: vec![3], numel: 40 }, Bucket { params: vec![2, 1, 0], numel: 60 }]);
    // A parameter above the cap gets a bucket of its own.
    let p = bucket_plan(&[5, 100, 5], 10, 10);
    assert_eq!(p.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![2], vec![1], vec![0]]);
    // Everything fits: one bucket.
    assert_eq!(bucket_plan(&[1, 2, 3], 1000, 1000).len(), 1);
    assert!(bucket_plan(&[], 10, 10).is_empty());
    // Every parameter exactly once.
    let p = bucket_plan(&[3, 1, 4, 1, 5, 9, 2, 6], 7, 7);
    let mut all: Vec<usize> = p.iter().flat_map(|b| b.params.clone()).collect();
    all.sort();
    assert_eq!(all, (0..8).collect::<Vec<_>>());
    assert!(p.iter().all(|b| b.numel <= 9));
    // A small first bucket, then large ones.
    let p = bucket_plan(&[4, 4, 4, 4, 4], 4, 100);
    assert_eq!(p.iter().map(|b| b.params.clone()).collect::<Vec<_>>(), vec![vec![4], vec![3, 2, 1, 0]]);
}

mod sparse_all_reduce {
    use crate::codecs::{BucketCodec, TopK};
    use crate::sparse_ar::{merge, sparse_all_reduce};
    use kolo_base::{Rng, WorldSize};
    use kolo_comm::LocalComm;
    use kolo_compress::sparse::Sparse;
    use kolo_compress::ErrorFeedback;
    use kolo_testkit::run_ranks;

    fn random_sparse(len: usize, k: usize, seed: u64) -> Sparse {
        let mut r = Rng::new(seed);
        let mut idx: Vec<u32> = (0..k).map(|_| r.below(len as u64) as u32).collect();
        idx.sort_unstable();
        idx.dedup();
        let values = idx.iter().map(|_| (r.below(200) as f32) - 100.0).collect();
        Sparse { len, indices: idx, values }
    }

    #[test]
    fn merging_sums_shared_indices_in_order() {
        let a = Sparse { len: 10, indices: vec![1, 4, 7], values: vec![1.0, 2.0, 3.0] };
        let b = Sparse { len: 10, indices: vec![0, 4, 9], values: vec![5.0, 6.0, 7.0] };
        let m = merge(&a, &b);
        assert_eq!((m.indices, m.values), (vec![0, 1, 4, 7, 9], vec![5.0, 1.0, 8.0, 3.0, 7.0]));
        assert_eq!(merge(&a, &Sparse { len: 10, indices: vec![], values: vec![] }), a);
    }

    /// Every world size 1..=6 (powers of two and not), overlapping and empty index sets: every
    /// rank ends with the dense sum (small integers: exact); with a power-of-two world a rank
    /// sends no more pairs than an all-gather would send it.
    #[test]
    fn sparse_all_reduce_is_the_dense_sum_on_every_rank() {
        for p in 1..=6usize {
            for (len, k) in [(1000, 50), (97, 97), (13, 0), (5000, 3)] {
                let inputs: Vec<Sparse> = (0..p).map(|r| random_sparse(len, k, 31 * p as u64 + r as u64)).collect();
                let mut want = vec![0f32; len];
                inputs.iter().for_each(|s| s.add_into(&mut want));
                let got = run_ranks(LocalComm::create(WorldSize::new(p).unwrap()), |r, c| sparse_all_reduce(&c, &inputs[r]).unwrap());
                for (r, (s, sent)) in got.iter().enumerate() {
                    assert_eq!(s.to_dense(), want, "p {p} len {len} k {k} rank {r}");
                    assert!(s.indices.windows(2).all(|w| w[0] < w[1]));
                    // Powers of two: at most (p - 1) k pairs (what an all-gather sends every rank),
                    // plus an 8-byte length per exchange; otherwise the folding adds up to 2 p k.
                    let kk = inputs.iter().map(|s| s.indices.len()).max().unwrap();
                    let bound = if p.is_power_of_two() { (p - 1) * kk * 8 } else { 2 * p * kk * 8 } + 8 * 2 * p;
                    assert!(*sent <= bound, "p {p}: rank {r} sent {sent} bytes (bound {bound})");
                }
            }
        }
    }

    /// The top-k codec with the sparse all-reduce computes what the all-gather version does.
    #[test]
    fn topk_over_the_sparse_all_reduce_equals_the_all_gather_version() {
        let p = 4;
        let grads: Vec<Vec<f32>> = (0..p)
            .map(|r| {
                let mut g = Rng::new(r as u64 + 9);
                (0..2000).map(|_| g.normal() as f32).collect()
            })
            .collect();
        let run = |sparse: bool| {
            run_ranks(LocalComm::create(WorldSize::new(p).unwrap()), |r, c| {
                let mut codec = TopK { fraction: 0.05, sampled: false, sparse_all_reduce: sparse, step: 0, ef: ErrorFeedback::new(2000) };
                let mut buf = grads[r].clone();
                let sent = codec.all_reduce(&c, &mut buf).unwrap();
                (buf, sent)
            })
        };
        let (dense, sparse) = (run(false), run(true));
        for r in 0..p {
            let d = dense[r].0.iter().zip(&sparse[r].0).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 1e-6, "rank {r}: {d}");
        }
        // An all-gather sends every rank (p - 1) k pairs (the codec reports its own k pairs).
        assert!(sparse[0].1 <= dense[0].1 * (p - 1) + 8 * 2 * p, "{} vs {} x {}", sparse[0].1, dense[0].1, p - 1);
    }
}

/// The deterministic mode's sum: the same bits whatever the order of the pieces and however
/// they are split over "ranks" (partial sums whose lanes are added as i64, as the all-reduce
/// does), and within one f32 rounding of the f64 sum. Float sums of the same pieces in other
/// orders do differ (the inputs are chosen so), or this test would prove nothing.
#[test]
fn exact_sum_is_independent_of_order_and_split() {
    use crate::exact::ExactSum;
    let (n_pieces, len) = (12, 257);
    let mut r = kolo_base::Rng::new(11);
    let pieces: Vec<Vec<f32>> =
        (0..n_pieces).map(|_| (0..len).map(|_| (r.normal() * 10f64.powi((r.below(9) as i32) - 6)) as f32).collect()).collect();
    let result = |order: &[usize], world: usize| -> Vec<f32> {
        // Rank q sums pieces order[q*per..(q+1)*per]; the lanes of all ranks are then added
        // (wrapping, as an i64 all-reduce would, in rank order reversed).
        let per = n_pieces / world;
        let mut total = ExactSum::new(len);
        for q in (0..world).rev() {
            let mut s = ExactSum::new(len);
            for &k in &order[q * per..(q + 1) * per] {
                s.add(&pieces[k]).unwrap();
            }
            total.lanes_mut().iter_mut().zip(s.lanes_mut().iter()).for_each(|(a, b)| *a = a.wrapping_add(*b));
        }
        let mut out = vec![0f32; len];
        total.mean_into(n_pieces, &mut out);
        out
    };
    let forward: Vec<usize> = (0..n_pieces).collect();
    let want = result(&forward, 1);
    let mut shuffled = forward.clone();
    for (world, seed) in [(1, 1), (2, 2), (3, 3), (4, 4), (6, 5), (12, 6)] {
        kolo_base::Rng::new(seed).shuffle(&mut shuffled);
        let got = result(&shuffled, world);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "world {world}: bits differ");
    }
    // Against the f64 mean: within one f32 rounding (plus the 2^-64 truncations).
    for i in 0..len {
        let m = pieces.iter().map(|p| f64::from(p[i])).sum::<f64>() / n_pieces as f64;
        assert!((f64::from(want[i]) - m).abs() <= m.abs() * 6e-8 + 1e-18, "element {i}: {} vs {m}", want[i]);
    }
    // The inputs do make float order matter: summing in f32 forwards and backwards differs.
    let f32_sum = |o: &mut dyn Iterator<Item = usize>| -> Vec<f32> {
        let mut s = vec![0f32; len];
        o.for_each(|k| s.iter_mut().zip(&pieces[k]).for_each(|(a, b)| *a += b));
        s
    };
    assert_ne!(f32_sum(&mut (0..n_pieces)), f32_sum(&mut (0..n_pieces).rev()));
    // What it cannot represent is refused, and nothing is added.
    let mut s = ExactSum::new(3);
    for bad in [f32::NAN, f32::INFINITY, -16_777_216.0] {
        assert_eq!(s.add(&[1.0, bad, 2.0]).unwrap_err().idx, 1);
    }
    s.add(&[1.0, -2.5, 16_777_215.0]).unwrap();
    let mut out = [0f32; 3];
    s.mean_into(1, &mut out);
    assert_eq!(out, [1.0, -2.5, 16_777_215.0]);
    // The fixed-point rounding of single values: exact above 2^-40, truncated towards zero
    // below, subnormals included, signs symmetric.
    for v in [1.5f32, -3.0e-7, 7.0e-13, -1.0e-30, f32::MIN_POSITIVE, 1.0e-40, 0.0, -0.0] {
        let mut s = ExactSum::new(1);
        s.add(&[v]).unwrap();
        let mut out = [0f32];
        s.mean_into(1, &mut out);
        let want = ((f64::from(v) * 2f64.powi(64)).trunc() * 2f64.powi(-64)) as f32;
        assert_eq!(out[0], want, "{v:e}");
    }
}
