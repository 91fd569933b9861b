use super::*;
use kolo_base::Rng;

/// On-policy (rho = c = 1) V-trace is the n-step bootstrapped return, and the advantage is the
/// one-step TD error against it.
#[test]
fn on_policy_vtrace_is_the_n_step_return() {
    let (r, v, g) = ([1.0, 2.0, 3.0], [0.5, 0.25, 0.75], 0.9);
    let t = vtrace(&[0.0; 3], &[g; 3], &r, &v, 4.0, 1.0, 1.0);
    let want2 = 3.0 + g * 4.0;
    let want1 = 2.0 + g * want2;
    let want0 = 1.0 + g * want1;
    for (a, b) in t.vs.iter().zip([want0, want1, want2]) {
        assert!((a - b).abs() < 1e-12, "{:?}", t.vs);
    }
    assert!((t.advantages[0] - (1.0 + g * want1 - 0.5)).abs() < 1e-12);
}

/// A hand-computed off-policy case: pi/mu = 2 (clipped to rho_bar = 1 but c_bar = 1 too) at step
/// 0 and 0.5 at step 1, an episode end at step 1 (its discount 0 cuts the bootstrap).
#[test]
fn off_policy_vtrace_matches_its_definition_by_hand() {
    let log_rhos = [2f64.ln(), 0.5f64.ln()];
    let (r, v, d) = ([1.0, 1.0], [0.2, 0.4], [0.9, 0.0]);
    let t = vtrace(&log_rhos, &d, &r, &v, 10.0, 1.0, 1.0);
    // rho = [1, 0.5], c = [1, 0.5].
    let delta1 = 0.5 * (1.0 + 0.0 * 10.0 - 0.4);
    let v1 = 0.4 + delta1;
    let delta0 = 1.0 * (1.0 + 0.9 * 0.4 - 0.2);
    let v0 = 0.2 + delta0 + 0.9 * 1.0 * (v1 - 0.4);
    assert!((t.vs[1] - v1).abs() < 1e-12 && (t.vs[0] - v0).abs() < 1e-12, "{:?}", t.vs);
    assert_eq!(t.rhos, vec![1.0, 0.5]);
    assert!((t.advantages[0] - (1.0 + 0.9 * v1 - 0.2)).abs() < 1e-12);
    assert!((t.advantages[1] - 0.5 * (1.0 - 0.4)).abs() < 1e-12);
    // A truncation level above the ratio keeps it: rho_bar = 4 makes rho_0 = 2.
    let wide = vtrace(&log_rhos, &d, &r, &v, 10.0, 4.0, 1.0);
    assert_eq!(wide.rhos[0], 2.0);
}

#[test]
fn cartpole_follows_gyms_dynamics_and_ends() {
    let mut e = CartPole::default();
    let mut rng = Rng::new(1);
    let o = e.reset(&mut rng);
    assert!(o.iter().all(|v| v.abs() <= 0.05));
    // Always pushing right tips the pole over well before 200 steps.
    let mut steps = 0;
    loop {
        steps += 1;
        if e.step(1).2 {
            break;
        }
    }
    assert!((8..60).contains(&steps), "{steps}");
    let mut g = GridWorld::new(3);
    g.reset(&mut rng);
    let path = [1, 1, 3, 3];
    let mut total = 0.0;
    for (i, a) in path.iter().enumerate() {
        let (_, r, done) = g.step(*a);
        total += r;
        assert_eq!(done, i == 3);
    }
    assert!((total - 0.97).abs() < 1e-6);
}

#[test]
fn flat_mlp_and_sampling() {
    // 2 -> 2 (ReLU) -> 1: weights and biases in kolo_tensor's layout.
    let p = [1.0, 0.0, 0.0, -1.0, 0.5, 0.5, 2.0, 3.0, 0.25];
    let y = policy::mlp_eval(&p, &[2, 2, 1], &[1.0, 2.0]);
    // hidden = relu([1 + 0.5, -2 + 0.5]) = [1.5, 0]; out = 2*1.5 + 3*0 + 0.25.
    assert_eq!(y, vec![3.25]);
    let mut rng = Rng::new(3);
    let mut counts = [0; 2];
    for _ in 0..10_000 {
        let (a, lp) = policy::sample(&[0.0, 2f32.ln()], &mut rng);
        counts[a] += 1;
        assert!((lp - if a == 0 { (1.0f32 / 3.0).ln() } else { (2.0f32 / 3.0).ln() }).abs() < 1e-5);
    }
    assert!((counts[1] as f64 / 10_000.0 - 2.0 / 3.0).abs() < 0.02, "{counts:?}");
}
