//! Kernels compiled three times, for AVX-512, for AVX2 + FMA and for the baseline x86-64 the
//! binary targets, with the choice made at run time ([`simd_kernel!`](crate::simd_kernel)). The
//! release binary must run on any x86-64, so it cannot assume AVX2; loops written to vectorise
//! run 4 lanes wide on the baseline (SSE2), 8 with AVX2 and 16 with AVX-512. No fast-math: every
//! tier computes the same IEEE operations in the same order (Rust never contracts a multiply
//! and an add into an FMA on its own, and reductions keep their explicit lanes), so their
//! results are bitwise equal. `KOLO_CPU_CAPABILITY=baseline|avx2|avx512` lowers the tier (as
//! torch's `ATEN_CPU_CAPABILITY` does), to compare tiers or to rule them out.

/// The widest instruction set a kernel may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Capability {
    Baseline,
    Avx2,
    Avx512,
}

/// The environment variable that lowers [`capability`].
pub const CAPABILITY_ENV: &str = "KOLO_CPU_CAPABILITY";

impl Capability {
    pub fn name(self) -> &'static str {
        match self {
            Capability::Baseline => "baseline",
            Capability::Avx2 => "avx2",
            Capability::Avx512 => "avx512",
        }
    }

    /// Parses `baseline`, `avx2` (with FMA) or `avx512`.
    pub fn parse(s: &str) -> Result<Capability, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "baseline" | "default" => Ok(Capability::Baseline),
            "avx2" => Ok(Capability::Avx2),
            "avx512" => Ok(Capability::Avx512),
            other => Err(format!("{CAPABILITY_ENV}={other:?}: expected baseline, avx2 or avx512")),
        }
    }
}

/// What this CPU has.
pub fn detected() -> Capability {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            if std::is_x86_feature_detected!("avx512f") {
                return Capability::Avx512;
            }
            return Capability::Avx2;
        }
    }
    Capability::Baseline
}

/// The tier `KOLO_CPU_CAPABILITY` asks for: `Ok(None)` when unset, an error naming the
/// accepted values for anything else.
pub fn requested() -> Result<Option<Capability>, String> {
    match std::env::var(CAPABILITY_ENV) {
        Ok(v) => Capability::parse(&v).map(Some),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("{CAPABILITY_ENV}: {e}")),
    }
}

/// The tier kernels use (decided once): what the CPU has, lowered to `KOLO_CPU_CAPABILITY`
/// when that is set; never above what the CPU has. An unparsable value is ignored here (the
/// `kolo` binary refuses it at start-up).
pub fn capability() -> Capability {
    static CAP: std::sync::OnceLock<Capability> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        let have = detected();
        match requested() {
            Ok(Some(want)) => want.min(have),
            _ => have,
        }
    })
}

/// Whether kernels may use AVX2 and FMA.
pub fn have_avx2_fma() -> bool {
    capability() >= Capability::Avx2
}

/// Whether kernels may use AVX-512F (with AVX2 and FMA).
pub fn have_avx512() -> bool {
    capability() >= Capability::Avx512
}

/// Defines `fn name(args)` whose body is compiled for AVX-512, for AVX2 + FMA and for the
/// baseline x86-64, the widest [`capability`] allows chosen at run time.
#[macro_export]
macro_rules! simd_kernel {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($a:ident: $t:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        // Kernels take their slices one by one (a struct would hide which are written).
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($a: $t),*) {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($a: $t),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn wide($($a: $t),*) {
                    body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn fast($($a: $t),*) {
                    body($($a),*)
                }
                if $crate::simd::have_avx512() {
                    // SAFETY: the CPU has the features `wide` is compiled for (capability()
                    // never exceeds what was detected).
                    return unsafe { wide($($a),*) };
                }
                if $crate::simd::have_avx2_fma() {
                    // SAFETY: as above, for `fast`.
                    return unsafe { fast($($a),*) };
                }
            }
            body($($a),*)
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capabilities_parse_order_and_never_exceed_the_cpu() {
        assert_eq!(Capability::parse("AVX2"), Ok(Capability::Avx2));
        assert_eq!(Capability::parse(" avx512 "), Ok(Capability::Avx512));
        assert_eq!(Capability::parse("baseline"), Ok(Capability::Baseline));
        let e = Capability::parse("sse9").unwrap_err();
        assert!(e.contains(CAPABILITY_ENV) && e.contains("avx2"), "{e}");
        assert!(Capability::Baseline < Capability::Avx2 && Capability::Avx2 < Capability::Avx512);
        assert!(capability() <= detected());
        for c in [Capability::Baseline, Capability::Avx2, Capability::Avx512] {
            assert_eq!(Capability::parse(c.name()), Ok(c));
        }
    }
}
