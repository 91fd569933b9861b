use super::*;
use kolo_base::WorldSize;
use kolo_comm::{Communicator, LocalComm};
use kolo_testkit::run_ranks;
use proptest::prelude::*;

#[test]
fn partition_minimises_the_slowest_stage() {
    assert_eq!(partition(&[1.0, 1.0, 1.0, 1.0], 2), vec![0..2, 2..4]);
    assert_eq!(partition(&[4.0, 1.0, 1.0, 1.0, 1.0], 2), vec![0..1, 1..5]);
    assert_eq!(partition(&[1.0, 2.0, 3.0, 4.0, 5.0], 3), vec![0..3, 3..4, 4..5]);
    assert_eq!(partition(&[1.0; 3], 3), vec![0..1, 1..2, 2..3]);
    assert_eq!(partition(&[5.0], 1), vec![0..1]);
}

fn brute_best(costs: &[f64], k: usize) -> f64 {
    // Every way to place k - 1 cuts.
    fn go(costs: &[f64], k: usize, start: usize) -> f64 {
        if k == 1 {
            return costs[start..].iter().sum();
        }
        (start + 1..=costs.len() - (k - 1))
            .map(|c| costs[start..c].iter().sum::<f64>().max(go(costs, k - 1, c)))
            .fold(f64::INFINITY, f64::min)
    }
    go(costs, k, 0)
}

proptest! {
    #[test]
    fn partition_is_contiguous_complete_and_optimal(costs in proptest::collection::vec(1u32..20, 1..9), k in 1usize..5) {
        let costs: Vec<f64> = costs.into_iter().map(f64::from).collect();
        prop_assume!(k <= costs.len());
        let p = partition(&costs, k);
        prop_assert_eq!(p.len(), k);
        prop_assert_eq!(p[0].start, 0);
        prop_assert_eq!(p[k - 1].end, costs.len());
        for w in p.windows(2) {
            prop_assert_eq!(w[0].end, w[1].start);
        }
        prop_assert!(p.iter().all(|r| !r.is_empty()));
        let worst = p.iter().map(|r| costs[r.clone()].iter().sum::<f64>()).fold(0.0, f64::max);
        prop_assert!((worst - brute_best(&costs, k)).abs() < 1e-9);
    }

    #[test]
    fn schedules_are_complete_ordered_and_deadlock_free(k in 1usize..7, m in 1usize..17) {
        for sched in [Schedule::GPipe, Schedule::OneFOneB] {
            for s in 0..k {
                let v = ops(sched, k, s, m);
                prop_assert_eq!(v.len(), 2 * m);
                for i in 0..m {
                    let f = v.iter().position(|o| *o == Op::Forward(i));
                    let b = v.iter().position(|o| *o == Op::Backward(i));
                    prop_assert!(f.is_some() && b.is_some() && f < b, "{:?} stage {} micro-batch {}: {:?}", sched, s, i, v);
                }
                let bound = match sched { Schedule::GPipe => m, Schedule::OneFOneB | Schedule::TwoBw { .. } => (k - s).min(m) };
                prop_assert!(max_in_flight(&v) <= bound, "{:?} stage {}: {} in flight > {}", sched, s, max_in_flight(&v), bound);
            }
            // Cross-stage dependencies hold in the simulated run, which never deadlocks.
            let sim = simulate(sched, k, m, 1.0, 2.0).unwrap();
            for s in 0..k {
                for &(op, start, _) in &sim.timeline[s] {
                    let dep = match op {
                        Op::Forward(i) if s > 0 => sim.timeline[s - 1].iter().find(|(o, ..)| *o == Op::Forward(i)).map(|x| x.2),
                        Op::Backward(i) if s + 1 < k => sim.timeline[s + 1].iter().find(|(o, ..)| *o == Op::Backward(i)).map(|x| x.2),
                        Op::Backward(i) => sim.timeline[s].iter().find(|(o, ..)| *o == Op::Forward(i)).map(|x| x.2),
                        _ => Some(0.0),
                    };
                    prop_assert!(start >= dep.unwrap() - 1e-12);
                }
            }
        }
    }
}

#[test]
fn simulated_bubble_equals_the_theory() {
    for k in [1, 2, 4] {
        for m in [1, 2, 4, 8, 16] {
            for sched in [Schedule::GPipe, Schedule::OneFOneB] {
                let sim = simulate(sched, k, m, 1.0, 2.0).unwrap();
                let want = theoretical_bubble(k, m);
                assert!((sim.bubble - want).abs() < 1e-9, "{sched:?} k={k} m={m}: simulated {} vs (k-1)/(m+k-1) = {want}", sim.bubble);
            }
        }
    }
    // 1F1B keeps at most k - s micro-batches alive; GPipe all m.
    assert_eq!(max_in_flight(&ops(Schedule::OneFOneB, 4, 0, 16)), 4);
    assert_eq!(max_in_flight(&ops(Schedule::OneFOneB, 4, 3, 16)), 1);
    assert_eq!(max_in_flight(&ops(Schedule::GPipe, 4, 0, 16)), 16);
}

/// A chain of element-wise scalings: stage s computes y = w_s * x on `n` values, the last
/// stage's loss is the sum of its output. The gradient reaching stage s is the product of the
/// later weights: exact in f32 for powers of two.
struct Scale {
    w: f32,
    n: usize,
    first: bool,
    last: bool,
    inputs: std::collections::HashMap<usize, Vec<f32>>,
    grad_w: f32,
}

impl StageWork for Scale {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let x = if self.first { (0..self.n).map(|i| ((mb * self.n + i) % 7) as f32).collect() } else { input.ok_or("no input")? };
        let y: Vec<f32> = x.iter().map(|v| v * self.w).collect();
        self.inputs.insert(mb, x);
        Ok(if self.last { vec![y.iter().sum()] } else { y })
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        let x = self.inputs.remove(&mb).ok_or("backward before forward")?;
        let g = if self.last { vec![1.0; self.n] } else { grad.ok_or("no gradient")? };
        self.grad_w += x.iter().zip(&g).map(|(a, b)| a * b).sum::<f32>();
        Ok(if self.first { Vec::new() } else { g.iter().map(|v| v * self.w).collect() })
    }
}

#[test]
fn executed_pipelines_compute_the_chain_rule_exactly() {
    let n = 1000;
    for k in [1usize, 2, 3, 4] {
        for sched in [Schedule::GPipe, Schedule::OneFOneB] {
            let m = 5;
            let ws = [2.0f32, 0.5, 4.0, 0.25];
            let out = run_ranks(LocalComm::create(WorldSize::new(k).unwrap()), |s, c| {
                let mut w = Scale { w: ws[s], n, first: s == 0, last: s + 1 == k, inputs: Default::default(), grad_w: 0.0 };
                let r = run_stage(&c, sched, m, n, &mut w).unwrap();
                (w.grad_w, r)
            });
            let prod: f32 = ws[..k].iter().product();
            let total_x: f32 = (0..m * n).map(|i| (i % 7) as f32).sum();
            // Loss = prod * sum(x); d loss / d w_s = (prod / w_s) * sum(x).
            let last = &out[k - 1].1;
            assert_eq!(last.losses.len(), m);
            assert_eq!(last.losses.iter().sum::<f32>(), prod * total_x);
            for s in 0..k {
                assert_eq!(out[s].0, prod / ws[s] * total_x, "{sched:?} k={k} stage {s}");
                let bound = if sched == Schedule::OneFOneB { (k - s).min(m) } else { m };
                assert!(out[s].1.max_live <= bound);
            }
        }
    }
}

proptest! {
    /// PipeDream-2BW: no flush between batches; each batch's update follows its last backward
    /// on the stage; every micro-batch runs on a weight version the stage already has (m >= K
    /// - 1), and at most two versions are needed at once; activations in flight stay <= K - s;
    /// the continuous stream deadlocks nowhere and its bubble shrinks with the batches.
    #[test]
    fn two_bw_plans_keep_weight_versions_consistent(k in 1usize..6, extra in 0usize..4, batches in 1usize..5) {
        let m = (k.max(2) - 1) + extra;
        for s in 0..k {
            let plan = ops(Schedule::TwoBw { batches }, k, s, m);
            let at = |o: Op| plan.iter().position(|x| *x == o);
            for mb in 0..m * batches {
                let (f, b) = (at(Op::Forward(mb)).unwrap(), at(Op::Backward(mb)).unwrap());
                prop_assert!(f < b);
                let t = mb / m;
                prop_assert!(b < at(Op::Update(t)).unwrap(), "the update of batch {} waits for micro-batch {}", t, mb);
                let v = weight_version(mb, m);
                if v > 0 {
                    prop_assert!(at(Op::Update(v - 1)).unwrap() < f, "k {} s {} m {}: micro-batch {} needs version {} before its forward", k, s, m, mb, v);
                }
                // Double buffering: when it runs backward, its version is at most one behind.
                let updates_before = plan[..b].iter().filter(|o| matches!(o, Op::Update(_))).count();
                prop_assert!(updates_before <= v + 1, "micro-batch {} backward sees {} updates, runs on version {}", mb, updates_before, v);
            }
            prop_assert_eq!(plan.iter().filter(|o| matches!(o, Op::Update(_))).count(), batches);
            prop_assert!(max_in_flight(&plan) <= k - s);
        }
        let sim = simulate(Schedule::TwoBw { batches }, k, m, 1.0, 2.0).unwrap();
        let flushed = theoretical_bubble(k, m);
        let streamed = theoretical_bubble(k, m * batches);
        prop_assert!((sim.bubble - streamed).abs() < 1e-9, "2BW bubble {} vs (K-1)/(M*batches+K-1) = {}", sim.bubble, streamed);
        prop_assert!(sim.bubble <= flushed + 1e-12);
    }
}

/// [`Scale`] with PipeDream-2BW's updates: each records the batch and the weight gradient
/// accumulated so far.
struct Updating(Scale, Vec<(usize, f32)>);

impl StageWork for Updating {
    fn forward(&mut self, mb: usize, input: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.forward(mb, input)
    }
    fn backward(&mut self, mb: usize, grad: Option<Vec<f32>>) -> Result<Vec<f32>, String> {
        self.0.backward(mb, grad)
    }
    fn update(&mut self, t: usize) -> Result<(), String> {
        self.1.push((t, self.0.grad_w));
        Ok(())
    }
}

/// A 2BW stream run in pieces (stopped after every update, with a collective on a second group
/// in between, as the training driver does between optimizer steps) does what one run does:
/// the same updates with the same gradients, the same losses and bytes.
#[test]
fn a_stage_run_stopped_at_every_update_equals_one_run() {
    let n = 64;
    let ws = [2.0f32, 0.5, 4.0, 0.25];
    for k in [1usize, 2, 3, 4] {
        let (m, batches) = (k.max(2), 3);
        let out = run_ranks(LocalComm::create(WorldSize::new(k).unwrap()), |s, c| {
            let scale = || Scale { w: ws[s], n, first: s == 0, last: s + 1 == k, inputs: Default::default(), grad_w: 0.0 };
            let mut whole = Updating(scale(), Vec::new());
            let one = run_stage(&c, Schedule::TwoBw { batches }, m, n, &mut whole).unwrap();
            let all: Vec<kolo_base::Rank> = (0..k).map(kolo_base::Rank).collect();
            let sync = c.new_group(&all).unwrap().unwrap();
            let mut pieces = Updating(scale(), Vec::new());
            let mut run = StageRun::new(&c, Schedule::TwoBw { batches }, m, n);
            for t in 0..batches {
                assert!(!run.is_done());
                let done = run.run(&c, &mut pieces, Some(t)).unwrap();
                assert_eq!(done, t + 1 == batches);
                assert_eq!(pieces.1.last().map(|u| u.0), Some(t));
                let mut v = [s as f32];
                sync.all_reduce(kolo_comm::BufMut::from(&mut v[..]), kolo_comm::ReduceOp::Sum).unwrap();
                assert_eq!(v[0], (k * (k - 1) / 2) as f32);
            }
            let err = run.run(&c, &mut pieces, Some(batches)).unwrap_err().to_string();
            assert!(err.contains("the plan ended before this update"), "{err}");
            let piecewise = run.finish(&c).unwrap();
            (whole.1, pieces.1, one, piecewise)
        });
        for (s, (whole, pieces, one, piecewise)) in out.iter().enumerate() {
            assert_eq!(whole.len(), batches, "k {k} stage {s}");
            assert_eq!(whole, pieces, "k {k} stage {s}: the updates and their gradients");
            assert_eq!(one.losses, piecewise.losses);
            assert_eq!(one.bytes_sent, piecewise.bytes_sent);
            assert_eq!(one.max_live, piecewise.max_live);
        }
    }
}
