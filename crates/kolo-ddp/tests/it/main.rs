//! DDP over the reference communicator: buckets all-reduced from the gradient sink.

use kolo_base::{ByteSize, WorldSize};
use kolo_comm::{Communicator, LocalComm};
use kolo_ddp::{Ddp, DdpConfig, DdpError, Sharding};
use kolo_testkit::run_ranks;
use std::sync::Arc;

fn sig(shapes: &[&[usize]]) -> Vec<(String, Vec<usize>)> {
    shapes.iter().enumerate().map(|(i, s)| (format!("p{i}"), s.to_vec())).collect()
}

#[test]
fn buckets_average_gradients_across_ranks() {
    let comms = LocalComm::create(WorldSize::new(3).unwrap());
    run_ranks(comms, |r, c| {
        let s = sig(&[&[2, 3], &[4], &[5]]);
        let cfg = DdpConfig { bucket_cap: ByteSize(4 * 9), first_bucket_cap: ByteSize(4 * 9), ..Default::default() };
        let ddp = Ddp::new(Arc::new(c), &s, cfg).unwrap();
        assert_eq!(ddp.plan().len(), 2);
        let mut params: Vec<f32> = (0..15).map(|i| (i * (r + 1)) as f32).collect();
        ddp.broadcast_params(&mut params).unwrap();
        assert_eq!(params, (0..15).map(|i| i as f32).collect::<Vec<_>>());
        for step in 0..3 {
            // One no-sync micro-step, then a synchronised one.
            let g: Vec<f32> = (0..15).map(|i| (i + r + step) as f32).collect();
            ddp.accumulate(&g);
            ddp.begin_backward();
            let sink = ddp.sink();
            for p in [2usize, 1, 0] {
                let range = [0..6, 6..10, 10..15][p].clone();
                sink.grad_ready(p, &g[range]);
            }
            let mut out = vec![0f32; 15];
            let stats = ddp.finish(&mut out).unwrap();
            assert_eq!(stats.buckets.len(), 2);
            // mean over ranks of 2 * (i + r + step) = 2 * (i + 1 + step)
            let want: Vec<f32> = (0..15).map(|i| 2.0 * (i + 1 + step) as f32).collect();
            assert_eq!(out, want, "step {step}");
        }
    });
}

/// Buckets that fill in another order on each rank (a model whose backward order depends on
/// the data: experts that no token reached this step) are still reduced bucket with bucket:
/// six buckets of the same size (a mismatch of sizes would be caught; one of equal sizes would
/// silently add one bucket's gradient to another's) filled in an order that differs by rank
/// and by step, on 3 ranks, all-reduced and reduce-scattered (ZeRO-2), give the mean of each
/// parameter's gradient at every step: the first step in the plan's order, the later ones in
/// the order rank 0's buckets filled in the first.
#[test]
fn buckets_that_fill_in_another_order_on_each_rank_are_reduced_with_their_own() {
    let (params, len) = (6usize, 5usize);
    let shapes: Vec<Vec<usize>> = vec![vec![len]; params];
    let s: Vec<(String, Vec<usize>)> = shapes.iter().enumerate().map(|(i, s)| (format!("p{i}"), s.clone())).collect();
    for sharding in [Sharding::None, Sharding::Gradients] {
        run_ranks(LocalComm::create(WorldSize::new(3).unwrap()), |r, c| {
            // One parameter per bucket.
            let cap = ByteSize(4 * len as u64);
            let cfg = DdpConfig { bucket_cap: cap, first_bucket_cap: cap, sharding, ..Default::default() };
            let ddp = Ddp::new(Arc::new(c), &s, cfg).unwrap();
            assert_eq!(ddp.plan().len(), params);
            for step in 0..4usize {
                let g: Vec<f32> = (0..params * len).map(|i| (1000 * r + 10 * i + step) as f32).collect();
                ddp.begin_backward();
                // A rotation of the parameters that differs by rank and step.
                for k in 0..params {
                    let p = (k + 2 * r + step) % params;
                    ddp.sink().grad_ready(p, &g[p * len..(p + 1) * len]);
                }
                let mut out = vec![0f32; ddp.grad_len()];
                ddp.finish(&mut out).unwrap();
                // The mean over ranks 0, 1, 2 of 1000 r + 10 i + step.
                let mean: Vec<f32> = (0..params * len).map(|i| (1000 + 10 * i + step) as f32).collect();
                let mine = match sharding {
                    Sharding::Gradients => {
                        let plan = ddp.shard_plan().clone();
                        let mut want = vec![0f32; plan.len];
                        plan.gather(ddp.ranges(), &mean, &mut want);
                        assert_eq!(out, want, "{sharding:?}, rank {r}, step {step}: this rank's pieces");
                        continue;
                    }
                    _ => out,
                };
                assert_eq!(mine, mean, "{sharding:?}, rank {r}, step {step}");
            }
        });
    }
}

/// ZeRO-2/3's backward queues at most `MAX_SCATTERS_IN_FLIGHT` reduce-scatters, so a backward
/// faster than the network does not hold every bucket's whole gradient at once: rank 0 hands
/// its ten buckets' gradients at once, rank 1 one every 20 ms. Rank 0's hand-over of bucket i
/// returns only once bucket i - 2 is reduced, which needs rank 1's: before rank 1 hands bucket
/// j, rank 0 has returned from at most j + 2 hand-overs. (Unbounded, rank 0 returns from all ten
/// during rank 1's first pause.) The gradients are the ranks' mean as without the bound.
#[test]
fn zero_backward_waits_for_the_oldest_reduce_scatters() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (params, len) = (10usize, 8usize);
    assert_eq!(kolo_ddp::MAX_SCATTERS_IN_FLIGHT, 2);
    let s: Vec<(String, Vec<usize>)> = (0..params).map(|i| (format!("p{i}"), vec![len])).collect();
    let returned = AtomicUsize::new(0);
    run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| {
        // One parameter per bucket; the plan's order is the parameters' reversed (backward's).
        let cap = ByteSize(4 * len as u64);
        let cfg = DdpConfig { bucket_cap: cap, first_bucket_cap: cap, sharding: Sharding::Gradients, ..Default::default() };
        let ddp = Ddp::new(Arc::new(c), &s, cfg).unwrap();
        let g: Vec<f32> = (0..params * len).map(|i| (100 * r + i) as f32).collect();
        ddp.begin_backward();
        for (j, p) in (0..params).rev().enumerate() {
            if r == 1 {
                std::thread::sleep(std::time::Duration::from_millis(20));
                let ahead = returned.load(Ordering::SeqCst);
                assert!(ahead <= j + 2, "before rank 1's bucket {j}, rank 0 returned from {ahead} hand-overs");
            }
            ddp.sink().grad_ready(p, &g[p * len..(p + 1) * len]);
            if r == 0 {
                returned.fetch_add(1, Ordering::SeqCst);
            }
        }
        let mut out = vec![0f32; ddp.grad_len()];
        ddp.finish(&mut out).unwrap();
        let mean: Vec<f32> = (0..params * len).map(|i| (50 + i) as f32).collect();
        let plan = ddp.shard_plan().clone();
        let mut want = vec![0f32; plan.len];
        plan.gather(ddp.ranges(), &mean, &mut want);
        assert_eq!(out, want, "rank {r}: this rank's pieces of the mean");
    });
}

#[test]
fn model_mismatch_is_named() {
    let comms = LocalComm::create(WorldSize::new(2).unwrap());
    let errs = run_ranks(comms, |r, c| {
        let s = if r == 0 { sig(&[&[2, 3], &[4]]) } else { sig(&[&[2, 3], &[5]]) };
        Ddp::new(Arc::new(c) as Arc<dyn Communicator>, &s, DdpConfig::default()).err().unwrap()
    });
    let msg = errs[1].to_string();
    assert!(matches!(errs[1], DdpError::ModelMismatch { .. }), "{msg}");
    assert!(msg.contains("parameter #1: rank 0 has p1[4], this rank has p1[5]"), "{msg}");
    assert!(errs[0].to_string().contains("another rank"), "{}", errs[0]);
}

#[test]
fn missing_gradient_is_reported() {
    let comms = LocalComm::create(WorldSize::new(2).unwrap());
    run_ranks(comms, |_, c| {
        let ddp = Ddp::new(
            Arc::new(c),
            &sig(&[&[3], &[3]]),
            DdpConfig { bucket_cap: ByteSize(12), first_bucket_cap: ByteSize(12), ..Default::default() },
        )
        .unwrap();
        ddp.sink().grad_ready(1, &[1.0, 2.0, 3.0]);
        let e = ddp.finish(&mut [0f32; 6]).unwrap_err();
        assert!(e.to_string().contains("[\"p0\"]"), "{e}");
    });
}

/// ZeRO-2: each rank receives exactly its piece of the averaged gradients; after each rank
/// updates its piece, `all_gather_params` gives every rank the whole updated model. Odd sizes,
/// 1..=4 ranks, several bucket layouts.
#[test]
fn zero_reduce_scatter_and_gather_round_trip() {
    let shapes: [&[usize]; 5] = [&[3, 5], &[1], &[7], &[0], &[2, 11]];
    let numels: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let total: usize = numels.iter().sum();
    let starts: Vec<usize> = numels
        .iter()
        .scan(0, |a, n| {
            *a += n;
            Some(*a - n)
        })
        .collect();
    for n in 1..=4 {
        for (sharding, cap) in [(Sharding::Gradients, 4 * 9), (Sharding::Gradients, 4 * 1000), (Sharding::OptimizerState, 4 * 9)] {
            run_ranks(LocalComm::create(WorldSize::new(n).unwrap()), |r, c| {
                let cfg = DdpConfig { bucket_cap: ByteSize(cap), first_bucket_cap: ByteSize(cap), sharding, ..Default::default() };
                let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
                let plan = ddp.shard_plan().clone();
                let g: Vec<f32> = (0..total).map(|i| (i * (r + 1)) as f32).collect();
                ddp.begin_backward();
                for p in (0..shapes.len()).rev() {
                    ddp.sink().grad_ready(p, &g[starts[p]..starts[p] + numels[p]]);
                }
                let mut out = vec![0f32; ddp.grad_len()];
                ddp.finish(&mut out).unwrap();
                // mean over ranks of i * (r + 1) = i * (n + 1) / 2
                let mean: Vec<f32> = (0..total).map(|i| i as f32 * (n + 1) as f32 / 2.0).collect();
                let mut want = vec![0f32; plan.len];
                plan.gather(ddp.ranges(), &mean, &mut want);
                let mine = if sharding == Sharding::Gradients {
                    out.clone()
                } else {
                    assert_eq!(out, mean);
                    let mut s = vec![0f32; plan.len];
                    plan.gather(ddp.ranges(), &out, &mut s);
                    s
                };
                assert_eq!(mine, want, "{n} ranks, {sharding:?}, rank {r}");
                // "Update" the piece (negate), then gather everyone's.
                let updated: Vec<f32> = mine.iter().map(|x| -x).collect();
                let mut flat = vec![f32::NAN; total];
                ddp.all_gather_params(&updated, |i, v| {
                    let r = ddp.ranges()[i].clone();
                    flat[r].copy_from_slice(v);
                    Ok::<(), DdpError>(())
                })
                .unwrap();
                assert_eq!(flat, mean.iter().map(|x| -x).collect::<Vec<_>>());
            });
        }
    }
}

/// PowerSGD on DDP buckets: uncompressed during the warm-up; afterwards it sends the factors
/// only, recovers an average of rank at most r exactly, and small and 1-D parameters go as
/// they are.
/// A step whose gradient overflowed on one rank (f16's loss scale; the trainer skips it) leaves
/// PowerSGD's factors and residuals as they were: its output is non-finite on every rank, and
/// the steps after it are bitwise those of a run that never saw it. (Before, the overflow's
/// infinity stayed in the residual and every later step came out NaN.)
#[test]
fn a_powersgd_step_that_overflowed_leaves_the_factors_and_residuals_as_they_were() {
    let shapes: [&[usize]; 2] = [&[12, 10], &[10]];
    let total = 130;
    let runs: Vec<Vec<Vec<f32>>> = [false, true]
        .iter()
        .map(|&overflow| {
            run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| {
                let cfg =
                    DdpConfig { compression: kolo_ddp::Compression::PowerSgd { rank: 2 }, compression_warmup: 0, ..Default::default() };
                let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
                let mut outs = Vec::new();
                for step in 0..4 {
                    let mut g: Vec<f32> = (0..total).map(|i| ((i * 7 + r * 13 + step * 5) % 11) as f32 - 5.0).collect();
                    if overflow && step == 1 && r == 1 {
                        g[37] = f32::INFINITY;
                    } else if !overflow && step == 1 {
                        continue; // the run that never saw the step
                    }
                    ddp.begin_backward();
                    ddp.sink().grad_ready(1, &g[120..]);
                    ddp.sink().grad_ready(0, &g[..120]);
                    let mut out = vec![0f32; total];
                    ddp.finish(&mut out).unwrap();
                    if overflow && step == 1 {
                        assert!(out[..120].iter().all(|v| !v.is_finite()), "rank {r}: the overflowed step's approximation");
                        continue;
                    }
                    outs.push(out);
                }
                outs
            })
            .remove(0)
        })
        .collect();
    assert_eq!(runs[0].len(), 3);
    assert!(runs[1].iter().flatten().all(|v| v.is_finite()), "a step after the overflow came out non-finite");
    assert_eq!(runs[0], runs[1], "the steps after the overflow differ from a run without it");
}

#[test]
fn powersgd_buckets_send_factors_and_recover_low_rank_averages() {
    let shapes: [&[usize]; 3] = [&[12, 10], &[10], &[5, 3]];
    let numels: Vec<usize> = shapes.iter().map(|s| s.iter().product()).collect();
    let starts: Vec<usize> = numels
        .iter()
        .scan(0, |a, n| {
            *a += n;
            Some(*a - n)
        })
        .collect();
    let total: usize = numels.iter().sum();
    for exact in [true, false] {
        let rank = 2;
        let n = 3;
        run_ranks(LocalComm::create(WorldSize::new(n).unwrap()), |r, c| {
            let cfg = DdpConfig { compression: kolo_ddp::Compression::PowerSgd { rank }, compression_warmup: 1, ..Default::default() };
            let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
            for step in 0..3 {
                // Rank-1 gradients for the 12x10 matrix when `exact`, arbitrary otherwise.
                let val = |q: usize, i: usize| {
                    if exact && i < 120 {
                        ((i / 10) as f32 - 5.5) * ((i % 10) as f32 - 4.0) * (q + step + 1) as f32 * 0.1
                    } else {
                        ((i * 7 + q * 13 + step) % 11) as f32 - 5.0
                    }
                };
                let g: Vec<f32> = (0..total).map(|i| val(r, i)).collect();
                ddp.begin_backward();
                for p in (0..shapes.len()).rev() {
                    ddp.sink().grad_ready(p, &g[starts[p]..starts[p] + numels[p]]);
                }
                let mut out = vec![0f32; total];
                let stats = ddp.finish(&mut out).unwrap();
                let mean: Vec<f32> = (0..total).map(|i| (0..n).map(|q| val(q, i)).sum::<f32>() / n as f32).collect();
                let err = out.iter().zip(&mean).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                if step == 0 {
                    assert_eq!(stats.bytes, total * 4, "warm-up step is uncompressed");
                    assert!(err < 1e-5);
                } else if exact {
                    assert!(err < 1e-3, "a rank-1 average through rank-2 factors: error {err}");
                } else {
                    // 12x10 at rank 2 sends (12 + 10) * 2 values; 10 and 5x3 go as they are.
                    assert_eq!(stats.bytes, ((12 + 10) * 2 + 10 + 15) * 4, "low rank payload");
                    // The 1-D and small parameters are exact.
                    let tail = &out[120..];
                    assert!(tail.iter().zip(&mean[120..]).all(|(a, b)| (a - b).abs() < 1e-5));
                }
            }
        });
    }
    // ZeRO-2/3 reduce-scatter: PowerSGD, which needs the whole bucket, is refused there.
    let e = run_ranks(LocalComm::create(WorldSize::new(1).unwrap()), |_, c| {
        let cfg =
            DdpConfig { compression: kolo_ddp::Compression::PowerSgd { rank: 1 }, sharding: Sharding::Gradients, ..Default::default() };
        Ddp::new(Arc::new(c), &sig(&shapes), cfg).err().unwrap()
    });
    assert!(e[0].to_string().contains("ZeRO-2/3 reduce-scatter their gradients: compress them with fp16 or bf16"), "{}", e[0]);
}

/// PowerSGD compresses a matrix alike whichever bucket holds it (the pipeline stage of
/// `kolo train` holds other buckets than DDP of the whole model): three matrices on 2 ranks,
/// bucketed one per bucket and all in one, give bitwise the same averages over 3 steps (each
/// matrix's first Q is drawn from its name's seed; drawn in turn from one generator per bucket
/// they differ).
#[test]
fn powersgd_compresses_a_matrix_alike_in_any_bucket() {
    let shapes: [&[usize]; 3] = [&[12, 10], &[9, 7], &[16, 6]];
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let run = |cap: u64| {
        run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| {
            let cfg = DdpConfig {
                bucket_cap: ByteSize(cap),
                first_bucket_cap: ByteSize(cap),
                compression: kolo_ddp::Compression::PowerSgd { rank: 1 },
                ..Default::default()
            };
            let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
            let mut outs = Vec::new();
            for step in 0..3usize {
                let g: Vec<f32> = (0..total).map(|i| (((i * 37 + r * 11 + step * 5) % 29) as f32 - 14.0) / 7.0).collect();
                ddp.begin_backward();
                let ranges = ddp.ranges().to_vec();
                for p in (0..shapes.len()).rev() {
                    ddp.sink().grad_ready(p, &g[ranges[p].clone()]);
                }
                let mut out = vec![0f32; total];
                ddp.finish(&mut out).unwrap();
                outs.push(out);
            }
            outs
        })
    };
    let (apart, together) = (run(4), run(1 << 20));
    assert_eq!(apart[0], apart[1], "both ranks hold the average");
    assert_eq!(apart, together, "one bucket per matrix against all in one");
}

/// Every codec averages buckets across 3 ranks: exactly in f16-representable values for the
/// casts, approximately for the lossy ones, and with error feedback the sum over steps of what
/// was applied tracks the sum of the true averages. A user codec plugs in through the factory.
///
/// The gradients have a drift that does not cancel over the steps (`drift`, so a codec that
/// sends zeros is off by ~100 %) and a per-rank offset that cancels only across ranks (`skew`,
/// so a codec that skips the exchange and applies its own gradient is off too). Three broken
/// codecs are run through the same check and must fail it (issue #18: the check could not fail).
#[test]
fn every_codec_averages_buckets_and_user_codecs_plug_in() {
    use kolo_ddp::{BucketCodec, CodecFactory, Compression};
    /// A user codec: `scale` times the true average, or (scale 0) nothing at all, or (local)
    /// this rank's own gradient without any exchange.
    struct Broken {
        scale: f32,
        local: bool,
    }
    impl BucketCodec for Broken {
        fn all_reduce(&mut self, c: &dyn Communicator, buf: &mut [f32]) -> Result<usize, kolo_comm::CommError> {
            if !self.local {
                c.all_reduce(kolo_comm::BufMut::from(&mut *buf), kolo_comm::ReduceOp::Avg)?;
            }
            buf.iter_mut().for_each(|v| *v *= self.scale);
            Ok(buf.len() * 4)
        }
    }
    let user = |scale: f32, local: bool| {
        Compression::Custom(CodecFactory(Arc::new(move |_, _| Box::new(Broken { scale, local }) as Box<dyn BucketCodec>)))
    };
    let shapes: [&[usize]; 2] = [&[16, 8], &[8]];
    let total = 136;
    let n = 3;
    let drift = |i: usize| ((i * 13 % 9) as f32 - 4.0) / 4.0;
    let skew = |q: usize, i: usize| (q as f32 - 1.0) * (((i * 7) % 5) as f32 - 2.0);
    let noise = |q: usize, i: usize, step: usize| (((i * 31 + q * 17 + step * 7) % 23) as f32 - 11.0) / 11.0;
    let grad = move |q: usize, i: usize, step: usize| drift(i) + skew(q, i) + noise(q, i, step);
    // Relative error of the summed applied updates over 30 steps against `want` times the sum of
    // the true averages, normalised by how far the true averages moved in total.
    let error = move |method: Compression, want: f64| {
        run_ranks(LocalComm::create(WorldSize::new(n).unwrap()), move |r, c| {
            let cfg = DdpConfig { compression: method.clone(), ..Default::default() };
            let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
            let (mut applied, mut truth, mut moved) = (vec![0f64; total], vec![0f64; total], 0f64);
            for step in 0..30 {
                let g: Vec<f32> = (0..total).map(|i| grad(r, i, step)).collect();
                ddp.begin_backward();
                ddp.sink().grad_ready(1, &g[128..]);
                ddp.sink().grad_ready(0, &g[..128]);
                let mut out = vec![0f32; total];
                ddp.finish(&mut out).unwrap();
                for i in 0..total {
                    applied[i] += f64::from(out[i]);
                    let avg = (0..n).map(|q| f64::from(grad(q, i, step))).sum::<f64>() / n as f64;
                    truth[i] += avg;
                    moved += avg.abs();
                }
            }
            applied.iter().zip(&truth).map(|(a, t)| (a - want * t).abs()).sum::<f64>() / moved
        })[0]
    };
    let cases = [
        (Compression::Half { bf16: false }, 1e-3),
        (Compression::Half { bf16: true }, 5e-3),
        (Compression::TopK { fraction: 0.25, sampled: false, sparse_all_reduce: false }, 0.08),
        (Compression::TopK { fraction: 0.25, sampled: true, sparse_all_reduce: true }, 0.08),
        (Compression::RandK { fraction: 0.25 }, 0.2),
        (Compression::Qsgd { levels: 16 }, 0.1),
        (Compression::Sign, 0.1),
        (user(2.0, false), 1e-5),
    ];
    for (method, tol) in cases {
        // The user codec doubles every average: compare with twice the truth.
        let want = if matches!(method, Compression::Custom(_)) { 2.0 } else { 1.0 };
        let e = error(method.clone(), want);
        eprintln!("{method:?}: relative error {e:.4} (tolerance {tol})");
        assert!(e < tol, "{method:?}: relative error of the summed updates {e}");
    }
    // The check itself can fail: zeros, half the average, and no exchange are each caught by the
    // loosest tolerance above.
    for (what, broken) in [("zeros", user(0.0, false)), ("half", user(0.5, false)), ("no exchange", user(1.0, true))] {
        let e = error(broken, 1.0);
        eprintln!("broken codec ({what}): relative error {e:.4}");
        assert!(e > 0.3, "a codec that sends {what} must fail the check: error {e}");
    }
}

/// ZeRO-3's gathers, started by the model's reads: ranks that gather the groups in one order
/// get each group's whole values (odd sizes: 7 and 7 values over 3 ranks, not divisible); ranks
/// whose reads differ (one gathers group 0 while another gathers group 1, of the same size)
/// fail, naming the other rank and both buckets, instead of filling one group with the other's
/// values.
#[test]
fn zero3_gathers_in_another_order_on_another_rank_fail_naming_both_groups() {
    let shapes: [&[usize]; 2] = [&[7], &[7]];
    for swapped in [false, true] {
        let results = run_ranks(LocalComm::create(WorldSize::new(3).unwrap()), |r, c| {
            let cfg = DdpConfig { sharding: Sharding::Parameters, groups: vec![vec![0], vec![1]], ..Default::default() };
            let ddp = Ddp::new(Arc::new(c), &sig(&shapes), cfg).unwrap();
            let whole: Vec<f32> = (0..14).map(|i| i as f32 + 0.5).collect();
            let mut master = vec![0f32; ddp.shard_plan().len];
            ddp.shard_plan().clone().gather(ddp.ranges(), &whole, &mut master);
            ddp.set_master(master);
            let g = ddp.gatherer();
            let order = if swapped && r == 2 { [1, 0] } else { [0, 1] };
            order.map(|group| g.gather(group))
        });
        for (r, got) in results.iter().enumerate() {
            if !swapped {
                assert_eq!(got[0].as_deref().unwrap(), (0..7).map(|i| i as f32 + 0.5).collect::<Vec<_>>().as_slice(), "rank {r}, group 0");
                assert_eq!(got[1].as_deref().unwrap(), (7..14).map(|i| i as f32 + 0.5).collect::<Vec<_>>().as_slice(), "rank {r}, group 1");
                continue;
            }
            let e = got[0].as_ref().expect_err("group orders differ");
            assert!(e.contains("while rank") && e.contains("gathered bucket") && e.contains("different orders"), "rank {r}: {e}");
        }
    }
}
