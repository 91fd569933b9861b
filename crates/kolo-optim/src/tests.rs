use super::*;

#[test]
fn sgd_momentum_matches_torch_by_hand() {
    // torch: buf1 = g1; p1 = p0 - lr*buf1; buf2 = m*buf1 + g2; p2 = p1 - lr*buf2.
    let mut o = Optimizer::new(OptimizerSpec::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 }, 1);
    let mut p = [1.0f32];
    o.step(&mut p, &[0.5], 0.1);
    assert!((p[0] - 0.95).abs() < 1e-7);
    o.step(&mut p, &[0.5], 0.1);
    assert!((p[0] - (0.95 - 0.1 * (0.9 * 0.5 + 0.5))).abs() < 1e-7);
    let mut n = Optimizer::new(OptimizerSpec::Sgd { momentum: 0.9, nesterov: true, weight_decay: 0.0 }, 1);
    let mut q = [1.0f32];
    n.step(&mut q, &[0.5], 0.1);
    assert!((q[0] - (1.0 - 0.1 * (0.5 + 0.9 * 0.5))).abs() < 1e-7);
}

#[test]
fn adam_first_step_moves_by_lr() {
    // With bias correction the first Adam step is lr * sign(g) (up to eps).
    let mut o = Optimizer::new(OptimizerSpec::Adam { beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0, decoupled: false }, 2);
    let mut p = [0.0f32, 0.0];
    o.step(&mut p, &[3.0, -0.001], 0.01);
    assert!((p[0] + 0.01).abs() < 1e-6 && (p[1] - 0.01).abs() < 1e-5, "{p:?}");
    // AdamW decays the weight before the update.
    let mut w = Optimizer::new(OptimizerSpec::adamw(0.1), 1);
    let mut p = [1.0f32];
    w.step(&mut p, &[0.0], 0.5);
    assert!((p[0] - 0.95).abs() < 1e-6, "{p:?}");
}

#[test]
fn adagrad_and_state_round_trip() {
    let mut o = Optimizer::new(OptimizerSpec::Adagrad { eps: 1e-10, weight_decay: 0.0, lr_decay: 0.0 }, 1);
    let mut p = [0.0f32];
    o.step(&mut p, &[2.0], 0.1);
    assert!((p[0] + 0.1).abs() < 1e-6);
    let saved: Vec<(&str, Vec<f32>)> = o.state().into_iter().map(|(k, v)| (k, v.to_vec())).collect();
    let mut o2 = Optimizer::new(o.spec().clone(), 1);
    o2.load_state(o.steps(), &saved).unwrap();
    let (mut a, mut b) = ([1.0f32], [1.0f32]);
    o.step(&mut a, &[1.0], 0.1);
    o2.step(&mut b, &[1.0], 0.1);
    assert_eq!(a, b);
    assert!(o2.load_state(1, &[]).is_err());
}

#[test]
fn step_on_shards_equals_step_on_whole() {
    let spec = OptimizerSpec::adamw(0.01);
    let g: Vec<f32> = (0..10).map(|i| i as f32 - 4.5).collect();
    let mut whole: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
    let mut parts = whole.clone();
    let mut o = Optimizer::new(spec.clone(), 10);
    o.step(&mut whole, &g, 0.01);
    let (mut o1, mut o2) = (Optimizer::new(spec.clone(), 3), Optimizer::new(spec, 7));
    o1.step(&mut parts[..3], &g[..3], 0.01);
    o2.step(&mut parts[3..], &g[3..], 0.01);
    assert_eq!(whole, parts);
}

#[test]
fn clipping_and_schedules() {
    let mut g = vec![3.0f32, 4.0];
    let n = sum_of_squares(&g).sqrt();
    assert_eq!(n, 5.0);
    let f = clip_by_global_norm(&mut g, n, 1.0);
    assert!((sum_of_squares(&g).sqrt() - 1.0).abs() < 1e-5 && f < 1.0);
    assert_eq!(clip_by_global_norm(&mut g, 0.5, 1.0), 1.0);
    assert_eq!(lr_at(1.0, &Schedule::Constant, 4, 100, 0), 0.25);
    assert_eq!(lr_at(1.0, &Schedule::Constant, 4, 100, 3), 1.0);
    assert!((lr_at(1.0, &Schedule::Cosine { min_lr: 0.1 }, 0, 100, 100) - 0.1).abs() < 1e-6);
    assert!((lr_at(1.0, &Schedule::Cosine { min_lr: 0.0 }, 0, 100, 50) - 0.5).abs() < 1e-6);
    assert_eq!(lr_at(1.0, &Schedule::Step { every: 10, gamma: 0.5 }, 0, 100, 25), 0.25);
    assert_eq!(scaled_lr(0.1, 512, 256), 0.2);
}

/// A step applied in pieces (ZeRO shards, one parameter at a time) is the whole step, bitwise.
#[test]
fn piecewise_update_equals_whole_step() {
    let specs = [
        OptimizerSpec::Sgd { momentum: 0.9, nesterov: true, weight_decay: 0.01 },
        OptimizerSpec::adamw(0.1),
        OptimizerSpec::Adagrad { eps: 1e-10, weight_decay: 0.0, lr_decay: 0.01 },
    ];
    for spec in specs {
        let n = 23;
        let mut whole = Optimizer::new(spec.clone(), n);
        // Pieces, with the state offloaded to a file (released after every piece).
        let dir = std::env::temp_dir().join(format!("kolo-optim-test-{}", std::process::id()));
        let mut parts = Optimizer::with_placement(spec.clone(), n, &Placement::Disk(dir)).unwrap();
        assert_eq!(parts.is_offloaded(), !spec.state_names().is_empty());
        let mut p1: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut p2 = p1.clone();
        for step in 0..4 {
            let g: Vec<f32> = (0..n).map(|i| ((i + step) as f32 * 0.91).cos()).collect();
            whole.step(&mut p1, &g, 0.05);
            parts.begin_step();
            for r in [10..23, 0..3, 3..10] {
                parts.update(r.start, &mut p2[r.clone()], &g[r], 0.05);
            }
        }
        assert_eq!(p1, p2, "{spec:?}");
        assert_eq!(whole.state(), parts.state());
    }
}

/// Parameter groups: an optimizer whose spans give three ranges their own weight decay and
/// learning-rate factor equals three optimizers, one per range with those settings, whatever
/// pieces the update comes in (pieces that cross span boundaries included), for every rule.
#[test]
fn parameter_groups_equal_one_optimizer_per_group() {
    use crate::{Hyper, Optimizer, OptimizerSpec};
    let specs = [
        OptimizerSpec::Sgd { momentum: 0.9, nesterov: true, weight_decay: 0.3 },
        OptimizerSpec::adamw(0.3),
        OptimizerSpec::Adam { beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.3, decoupled: false },
        OptimizerSpec::Adagrad { eps: 1e-10, weight_decay: 0.3, lr_decay: 0.01 },
    ];
    let groups = [
        (0..7, Hyper { weight_decay: 0.0, lr_scale: 1.0 }),
        (7..8, Hyper { weight_decay: 0.3, lr_scale: 2.0 }),
        (8..23, Hyper { weight_decay: 0.1, lr_scale: 0.5 }),
    ];
    for spec in specs {
        let n = 23;
        let mut grouped = Optimizer::new(spec.clone(), n);
        grouped.set_groups(n, groups.to_vec()).unwrap();
        let mut alone: Vec<Optimizer> =
            groups.iter().map(|(r, h)| Optimizer::new(spec.with_weight_decay(h.weight_decay), r.len())).collect();
        let mut p1: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
        let (mut p2, start) = (p1.clone(), p1.clone());
        for step in 0..4 {
            let g: Vec<f32> = (0..n).map(|i| ((i + step) as f32 * 0.91).cos()).collect();
            grouped.begin_step();
            for r in [10..23, 0..3, 3..10] {
                grouped.update(r.start, &mut p1[r.clone()], &g[r], 0.05);
            }
            for ((r, h), o) in groups.iter().zip(&mut alone) {
                o.step(&mut p2[r.clone()], &g[r.clone()], 0.05 * h.lr_scale);
            }
        }
        assert_eq!(p1, p2, "{spec:?}");
        assert!(p1.iter().zip(&start).all(|(a, b)| a != b), "{spec:?}: an element did not move");
    }
    let mut o = Optimizer::new(OptimizerSpec::adamw(0.1), 5);
    assert!(o.set_groups(5, vec![(0..2, groups[0].1), (3..5, groups[0].1)]).unwrap_err().contains("does not continue at element 2"));
    assert!(o.set_groups(5, vec![(0..4, groups[0].1)]).unwrap_err().contains("cover 4 of 5"));
}
