//! Kernels compiled twice, for AVX2 + FMA and for the baseline x86-64 the binary targets, with
//! the choice made at run time ([`simd_kernel!`](crate::simd_kernel)). The release binary must
//! run on any x86-64, so it cannot assume AVX2; loops written to vectorise run 4 lanes wide on
//! the baseline (SSE2) and 8 with AVX2. No fast-math: the two builds compute the same IEEE
//! operations in the same order (Rust never contracts a multiply and an add into an FMA on its
//! own), so their results are bitwise equal.

/// Whether this CPU has AVX2 and FMA (detected once).
#[cfg(target_arch = "x86_64")]
pub fn have_avx2_fma() -> bool {
    static HAVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAVE.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
}

/// Whether this CPU has the AVX-512 foundation (with AVX2 and FMA; detected once).
#[cfg(target_arch = "x86_64")]
pub fn have_avx512() -> bool {
    static HAVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAVE.get_or_init(|| have_avx2_fma() && std::is_x86_feature_detected!("avx512f"))
}

/// Defines `fn name(args)` whose body is compiled three times: for AVX-512, for AVX2 + FMA and
/// for the baseline x86-64, the widest the CPU has chosen at run time.
#[macro_export]
macro_rules! simd_kernel {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($a: $t),*) {
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
                if $crate::simd::have_avx512() {
                    // SAFETY: the CPU has the features `wide` is compiled for.
                    return unsafe { wide($($a),*) };
                }
                if $crate::simd::have_avx2_fma() {
                    // SAFETY: the CPU has the features `fast` is compiled for.
                    return unsafe { fast($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}
