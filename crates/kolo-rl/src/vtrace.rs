//! V-trace (Espeholt et al. 2018, section 4.1): n-step value targets for a trajectory generated
//! by a behaviour policy mu, corrected towards the target policy pi with truncated importance
//! weights rho_t = min(rho_bar, pi/mu) and c_t = min(c_bar, pi/mu):
//!
//! v_s = V(x_s) + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t (r_t + gamma V(x_{t+1}) - V(x_t)),
//!
//! computed backwards as v_s = V(x_s) + delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1})), with
//! gamma_s = 0 where the episode ended at step s. The policy gradient's advantage at s is
//! rho_s (r_s + gamma_s v_{s+1} - V(x_s)).

/// Targets and advantages for one trajectory.
#[derive(Clone, Debug, PartialEq)]
pub struct VTrace {
    pub vs: Vec<f64>,
    pub advantages: Vec<f64>,
    /// The clipped importance weights rho_t.
    pub rhos: Vec<f64>,
}

/// `log_rhos[t]` = log pi(a_t|x_t) - log mu(a_t|x_t); `discounts[t]` = gamma, or 0 where step t
/// ended the episode; `values[t]` = V(x_t) for t < n; `bootstrap` = V(x_n).
pub fn vtrace(log_rhos: &[f64], discounts: &[f64], rewards: &[f64], values: &[f64], bootstrap: f64, rho_bar: f64, c_bar: f64) -> VTrace {
    let n = rewards.len();
    assert!(log_rhos.len() == n && discounts.len() == n && values.len() == n, "one value per step");
    let ratio: Vec<f64> = log_rhos.iter().map(|l| l.exp()).collect();
    let rhos: Vec<f64> = ratio.iter().map(|r| r.min(rho_bar)).collect();
    let cs: Vec<f64> = ratio.iter().map(|r| r.min(c_bar)).collect();
    let next_value = |t: usize| if t + 1 < n { values[t + 1] } else { bootstrap };
    let mut vs = vec![0f64; n];
    let mut acc = 0.0; // v_{s+1} - V(x_{s+1})
    for s in (0..n).rev() {
        let delta = rhos[s] * (rewards[s] + discounts[s] * next_value(s) - values[s]);
        acc = delta + discounts[s] * cs[s] * acc;
        vs[s] = values[s] + acc;
    }
    let advantages =
        (0..n).map(|s| rhos[s] * (rewards[s] + discounts[s] * if s + 1 < n { vs[s + 1] } else { bootstrap } - values[s])).collect();
    VTrace { vs, advantages, rhos }
}
