//! Copies into and out of the shared-memory rings that do not depend on how the two buffers are
//! aligned.
//!
//! glibc's `memcpy` copies 4 KiB ... 1 MiB with `rep movsb` on CPUs that advertise fast string
//! moves, and on AMD Zen (the CI machine's EPYC) `rep movsb` runs at 3.5 GB/s instead of 40-57
//! whenever the destination sits 1-15 bytes past the source modulo 4096 (its stores alias the
//! loads just issued; glibc 2.36, 64 KiB copies: 3.5 GB/s at 4, 8 and 12 bytes, 41-55 at 20,
//! 72 or 1032). A ring's data area is page-aligned and its position moves by every 40-byte frame
//! header, so some messages met a user's buffer at such an offset and a 64 KiB all-reduce took
//! 35-69 us instead of 7 (issue #37's "doubling cliff": whichever algorithm ran, some sizes in
//! some runs, depending on where the buffers happened to lie). The loop below moves 32-byte
//! unaligned vectors (AVX2 where the CPU has it, else SSE2, part of every x86-64), which run at
//! memcpy's best rate at every offset; other architectures keep `copy_nonoverlapping`.

/// `dst.copy_from_slice(src)` without the alignment cliff (see the module's documentation).
pub fn copy_slice(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_slice: lengths differ");
    // SAFETY: equal lengths; a `&mut` and a `&` slice never overlap.
    unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) }
}

/// Offsets (destination - source, modulo 4096) below which the vector loop copies instead of
/// `memcpy` (the cliff is 1-15 bytes on the EPYC measured; 0 is fast, and harmless here).
const ALIASED: usize = 64;

/// Copies `n` bytes from `src` to `dst`.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `n` bytes, the two
/// ranges disjoint.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        // Only where the destination trails the source by a little within a page: elsewhere
        // the C library's copy is as fast or faster.
        if n >= 256 && (dst as usize).wrapping_sub(src as usize) % 4096 < ALIASED {
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: AVX2 is present; the caller's contract covers the ranges.
                return unsafe { copy_avx2(dst, src, n) };
            }
            // SAFETY: SSE2 is part of x86-64; the caller's contract covers the ranges.
            return unsafe { copy_sse2(dst, src, n) };
        }
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, n) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn copy_avx2(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_storeu_si256};
    let mut i = 0;
    while i + 128 <= n {
        // SAFETY: [i, i + 128) is inside both ranges; unaligned loads and stores.
        unsafe {
            let a = _mm256_loadu_si256(src.add(i).cast::<__m256i>());
            let b = _mm256_loadu_si256(src.add(i + 32).cast::<__m256i>());
            let c = _mm256_loadu_si256(src.add(i + 64).cast::<__m256i>());
            let d = _mm256_loadu_si256(src.add(i + 96).cast::<__m256i>());
            _mm256_storeu_si256(dst.add(i).cast::<__m256i>(), a);
            _mm256_storeu_si256(dst.add(i + 32).cast::<__m256i>(), b);
            _mm256_storeu_si256(dst.add(i + 64).cast::<__m256i>(), c);
            _mm256_storeu_si256(dst.add(i + 96).cast::<__m256i>(), d);
        }
        i += 128;
    }
    // SAFETY: the tail, under 128 bytes (memcpy copies it without `rep movsb`).
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) }
}

#[cfg(target_arch = "x86_64")]
unsafe fn copy_sse2(dst: *mut u8, src: *const u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let mut i = 0;
    while i + 64 <= n {
        // SAFETY: [i, i + 64) is inside both ranges; unaligned loads and stores.
        unsafe {
            let a = _mm_loadu_si128(src.add(i).cast::<__m128i>());
            let b = _mm_loadu_si128(src.add(i + 16).cast::<__m128i>());
            let c = _mm_loadu_si128(src.add(i + 32).cast::<__m128i>());
            let d = _mm_loadu_si128(src.add(i + 48).cast::<__m128i>());
            _mm_storeu_si128(dst.add(i).cast::<__m128i>(), a);
            _mm_storeu_si128(dst.add(i + 16).cast::<__m128i>(), b);
            _mm_storeu_si128(dst.add(i + 32).cast::<__m128i>(), c);
            _mm_storeu_si128(dst.add(i + 48).cast::<__m128i>(), d);
        }
        i += 64;
    }
    // SAFETY: the tail, under 64 bytes.
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) }
}

#[cfg(test)]
mod tests {
    /// Every length around the vector widths, at every relative offset modulo 64, copies exactly
    /// the bytes asked for and nothing past them.
    #[test]
    fn copies_exactly_at_every_offset() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in [0, 1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000, 4096, 4097] {
            for so in 0..8 {
                for doff in 0..64 {
                    let mut dst = vec![0xAAu8; n + 200];
                    // SAFETY: both ranges are inside their vectors and disjoint.
                    unsafe { super::copy(dst.as_mut_ptr().add(doff), src.as_ptr().add(so), n) };
                    assert_eq!(&dst[doff..doff + n], &src[so..so + n], "n {n}, offsets {so}/{doff}");
                    assert!(dst[..doff].iter().chain(&dst[doff + n..]).all(|&b| b == 0xAA), "n {n}: wrote outside");
                }
            }
        }
    }
}
