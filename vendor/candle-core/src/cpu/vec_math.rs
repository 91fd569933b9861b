//! Kolo: f32 `exp`, `tanh` and GELU (both forms, and their derivatives) written without
//! calls or data-dependent branches, so that loops over them vectorise; each loop is compiled
//! for AVX-512 and AVX2 and picked at run time. libm's scalar `tanhf`/`expf`/`powf` made GELU and
//! its composite backward about 15 % of a GPT-2 training step on the CPU.
//!
//! Accuracy: `exp` relative error about 1e-7 (Cephes' polynomial), 0 below the smallest normal
//! result (no denormals) and +inf above the largest; `tanh` within 2e-7 absolute (Cephes'
//! polynomial below 0.625, the exponential form above); the normal CDF in GELU within 3e-7
//! relative (Numerical Recipes' `erfcc`). NaN in gives NaN out.

/// `e^x`.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let c = x.clamp(-87.336_55, 88.722_83);
    // Round c / ln 2 to the nearest integer with the 1.5 * 2^23 trick (no `floor` call).
    const MAGIC: f32 = 12_582_912.0;
    let kf = c * std::f32::consts::LOG2_E + MAGIC;
    let k = kf - MAGIC;
    let r = c - k * 0.693_359_4 - k * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let y = p * r * r + r + 1.0;
    // 2^k (k in [-126, 128]) as two normal powers of two, from k's bits in kf (a float-to-int
    // `as` saturates, which does not vectorise).
    let ki = (kf.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let k1 = ki >> 1;
    let k2 = ki - k1;
    let two = |e: i32| f32::from_bits((e.wrapping_add(127) as u32) << 23);
    let e = y * two(k1) * two(k2);
    let e = if x < -87.336_55 { 0.0 } else { e };
    if x > 88.722_83 {
        f32::INFINITY
    } else {
        e
    }
}

/// `tanh(x)`.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let a = x.abs();
    let z = x * x;
    let small = ((((-5.704_988_7e-3 * z + 2.063_908_9e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1) * z
        - 3.333_328_2e-1)
        * z
        * x
        + x;
    let large = 1.0 - 2.0 / (exp(2.0 * a.min(44.0)) + 1.0);
    let large = if x < 0.0 { -large } else { large };
    let t = if a < 0.625 { small } else { large };
    if x.is_nan() {
        x
    } else {
        t
    }
}

/// The standard normal CDF `Phi(x) = erfc(-x / sqrt 2) / 2`, from Numerical Recipes' `erfcc`
/// (fractional error below 1.2e-7 in erfc): accurate relative to Phi in the lower tail too,
/// where `(1 + erf) / 2` loses every digit to cancellation.
#[inline(always)]
fn normal_cdf(x: f32) -> f32 {
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06 + t * (0.278_868_07 + t * (-1.135_204 + t * (1.488_515_9 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let half_erfc = 0.5 * t * exp(-z * z + poly);
    if x < 0.0 {
        half_erfc
    } else {
        1.0 - half_erfc
    }
}

/// `(sigma, 1 - sigma)` for `sigma = 1 / (1 + e)`, each without cancellation (`e` may be 0 or
/// infinite).
#[inline(always)]
fn sigmoid_pair(e: f32) -> (f32, f32) {
    (1.0 / (1.0 + e), 1.0 / (1.0 + 1.0 / e))
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;
const INV_SQRT_2PI: f32 = 0.398_942_3;

macro_rules! dispatched {
    ($(#[$m:meta])* pub fn $name:ident($($a:ident: $t:ty),*) $body:block) => {
        $(#[$m])*
        pub fn $name($($a: $t),*) {
            #[inline(always)]
            fn body($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn wide($($a: $t),*) {
                    body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($a: $t),*) {
                    body($($a),*)
                }
                let f = super::features::get();
                if f.avx512f {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($a),*) };
                }
                if f.avx2 && f.fma {
                    // SAFETY: as above, for `fast`.
                    return unsafe { fast($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}

dispatched! {
    /// `ys = e^xs`.
    pub fn exp_vec(xs: &[f32], ys: &mut [f32]) {
        for (y, &x) in ys.iter_mut().zip(xs) {
            *y = exp(x);
        }
    }
}

dispatched! {
    /// `ys = tanh(xs)`.
    pub fn tanh_vec(xs: &[f32], ys: &mut [f32]) {
        for (y, &x) in ys.iter_mut().zip(xs) {
            *y = tanh(x);
        }
    }
}

dispatched! {
    /// `ys = gelu(xs)`, the tanh approximation (candle's `gelu`, GPT-2's `gelu_new`).
    pub fn gelu_tanh_vec(xs: &[f32], ys: &mut [f32]) {
        for (y, &x) in ys.iter_mut().zip(xs) {
            // 0.5 (1 + tanh u) = sigmoid(2u): no cancellation in the lower tail.
            let (s, _) = sigmoid_pair(exp(-2.0 * SQRT_2_OVER_PI * x * (1.0 + GELU_CUBIC * x * x)));
            *y = x * s;
        }
    }
}

dispatched! {
    /// `ys = dys * gelu'(xs)` for the tanh approximation.
    pub fn gelu_tanh_grad_vec(xs: &[f32], dys: &[f32], ys: &mut [f32]) {
        for ((y, &x), &dy) in ys.iter_mut().zip(xs).zip(dys) {
            // With s = sigmoid(2u): gelu' = s + x s (1 - s) 2u'.
            let (s, one_minus_s) = sigmoid_pair(exp(-2.0 * SQRT_2_OVER_PI * x * (1.0 + GELU_CUBIC * x * x)));
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
            *y = dy * (s + 2.0 * x * s * one_minus_s * du);
        }
    }
}

dispatched! {
    /// `ys = gelu(xs)`, the exact form `x * Phi(x)` (candle's `gelu_erf`).
    pub fn gelu_erf_vec(xs: &[f32], ys: &mut [f32]) {
        for (y, &x) in ys.iter_mut().zip(xs) {
            *y = x * normal_cdf(x);
        }
    }
}

dispatched! {
    /// `ys = dys * gelu'(xs)` for the exact form.
    pub fn gelu_erf_grad_vec(xs: &[f32], dys: &[f32], ys: &mut [f32]) {
        for ((y, &x), &dy) in ys.iter_mut().zip(xs).zip(dys) {
            *y = dy * (normal_cdf(x) + x * INV_SQRT_2PI * exp(-0.5 * x * x));
        }
    }
}

dispatched! {
    /// `ys = scale * e^(xs - shift)` (softmax rows and their gradients).
    pub fn exp_shifted_vec(xs: &[f32], shift: f32, scale: f32, ys: &mut [f32]) {
        for (y, &x) in ys.iter_mut().zip(xs) {
            *y = scale * exp(x - shift);
        }
    }
}

dispatched! {
    /// Adds `xs` into sixteen interleaved lanes (`lanes[i % 16] += xs[i]`): a sum in a fixed
    /// order that vectorises.
    pub fn sum_into_lanes(xs: &[f32], lanes: &mut [f32]) {
        let lanes: &mut [f32; 16] = lanes.try_into().expect("sixteen lanes");
        let mut chunks = xs.chunks_exact(16);
        for c in &mut chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += x;
            }
        }
        for (l, &x) in lanes.iter_mut().zip(chunks.remainder()) {
            *l += x;
        }
    }
}

/// The sum of `xs`, in sixteen lanes (see [`sum_into_lanes`]).
pub fn sum(xs: &[f32]) -> f32 {
    let mut lanes = [0f32; 16];
    sum_into_lanes(xs, &mut lanes);
    lanes.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> Vec<f32> {
        let mut v: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.01).collect();
        v.extend([0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6, 50.0, -50.0, 88.0, 88.7, -87.0, -87.3, -100.0, 100.0]);
        v
    }

    #[test]
    fn exp_tanh_and_the_normal_cdf_match_libm() {
        for x in grid() {
            let e = exp(x);
            let want = x.exp();
            if want >= f32::MIN_POSITIVE && want.is_finite() {
                assert!(((e - want) / want).abs() < 3e-7, "exp({x}) = {e}, libm {want}");
            }
            assert!((tanh(x) - x.tanh()).abs() < 2e-7, "tanh({x}) = {}, libm {}", tanh(x), x.tanh());
            if x.abs() < 1e-3 {
                assert!(((tanh(x) - x.tanh()) / x.tanh().max(1e-30)).abs() < 1e-6 || x == 0.0, "tanh({x}) relative");
            }
            let phi = 0.5 * (1.0 + crate::cpu::erf::erf_f64(x as f64 * std::f64::consts::FRAC_1_SQRT_2));
            let got = normal_cdf(x) as f64;
            assert!((got - phi).abs() <= 3e-7 * phi.max(1e-30) || (got - phi).abs() < 1e-7, "Phi({x}) = {got}, {phi}");
        }
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-90.0), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan() && tanh(f32::NAN).is_nan());
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
    }

    /// Each derivative kernel against a central finite difference (in f64) of its forward.
    #[test]
    fn gelu_grads_match_finite_differences() {
        let tanh_form = |x: f64| 0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh());
        let xs: Vec<f32> = (-600..=600).map(|i| i as f32 * 0.01).collect();
        let ones = vec![1.0f32; xs.len()];
        let (mut fwd, mut grad) = (vec![0.0; xs.len()], vec![0.0; xs.len()]);
        gelu_tanh_vec(&xs, &mut fwd);
        gelu_tanh_grad_vec(&xs, &ones, &mut grad);
        for ((&x, &f), &g) in xs.iter().zip(&fwd).zip(&grad) {
            let h = 1e-4;
            let x64 = x as f64;
            let fd = (tanh_form(x64 + h) - tanh_form(x64 - h)) / (2.0 * h);
            assert!((f as f64 - tanh_form(x64)).abs() < 1e-6, "gelu_tanh({x})");
            assert!((g as f64 - fd).abs() < 1e-5, "gelu_tanh'({x}) = {g}, finite difference {fd}");
        }
        let erf_form = |x: f64| 0.5 * x * (1.0 + crate::cpu::erf::erf_f64(x / std::f64::consts::SQRT_2));
        gelu_erf_vec(&xs, &mut fwd);
        gelu_erf_grad_vec(&xs, &ones, &mut grad);
        for ((&x, &f), &g) in xs.iter().zip(&fwd).zip(&grad) {
            let h = 1e-4;
            let x64 = x as f64;
            let fd = (erf_form(x64 + h) - erf_form(x64 - h)) / (2.0 * h);
            assert!((f as f64 - erf_form(x64)).abs() < 1e-6, "gelu_erf({x})");
            assert!((g as f64 - fd).abs() < 1e-5, "gelu_erf'({x}) = {g}, finite difference {fd}");
        }
    }
}
