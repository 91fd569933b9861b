//! The actors' policy: an MLP (ReLU hidden layers) whose output holds the action logits and
//! then the value, evaluated on flat parameters in `kolo_tensor::models::Mlp`'s layout (per
//! layer a weight of out x in values, row-major, then out biases).

use kolo_base::Rng;

/// Layer sizes: input, hidden..., output.
pub fn mlp_eval(params: &[f32], sizes: &[usize], x: &[f32]) -> Vec<f32> {
    let mut h = x.to_vec();
    let mut at = 0;
    for (i, w) in sizes.windows(2).enumerate() {
        let (inp, out) = (w[0], w[1]);
        let (wt, b) = (&params[at..at + out * inp], &params[at + out * inp..at + out * inp + out]);
        at += out * inp + out;
        let mut y: Vec<f32> = (0..out).map(|o| b[o] + wt[o * inp..(o + 1) * inp].iter().zip(&h).map(|(a, c)| a * c).sum::<f32>()).collect();
        if i + 2 < sizes.len() {
            y.iter_mut().for_each(|v| *v = v.max(0.0));
        }
        h = y;
    }
    h
}

/// Samples an action from `logits`; returns it and its log-probability.
pub fn sample(logits: &[f32], rng: &mut Rng) -> (usize, f32) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f64> = logits.iter().map(|&l| f64::from(l - max).exp()).collect();
    let sum: f64 = exp.iter().sum();
    let mut u = rng.next_f64() * sum;
    let mut a = exp.len() - 1;
    for (i, e) in exp.iter().enumerate() {
        if u < *e {
            a = i;
            break;
        }
        u -= e;
    }
    (a, (exp[a] / sum).ln() as f32)
}
