//! QSGD (Alistarh et al. 2017): each value becomes sign · norm · l/s with the level l in 0..=s
//! drawn so that the expectation is the value itself (unbiased). On the wire: one f32 norm and
//! one byte per value (sign and level, s ≤ 127).

use kolo_base::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct Quantized {
    pub norm: f32,
    pub levels: u8,
    /// Level in the low 7 bits, sign in the top bit.
    pub codes: Vec<u8>,
}

/// Quantizes `x` to `levels` (1..=127) levels with randomness from `rng`.
pub fn quantize(x: &[f32], levels: u8, rng: &mut Rng) -> Quantized {
    assert!((1..=127).contains(&levels), "qsgd: levels must be 1..=127");
    let norm = x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>().sqrt() as f32;
    let s = f64::from(levels);
    let codes = x
        .iter()
        .map(|v| {
            if norm == 0.0 {
                return 0;
            }
            let r = f64::from(v.abs()) / f64::from(norm) * s; // in [0, s]
            let low = r.floor();
            let level = if rng.next_f64() < r - low { low + 1.0 } else { low }.min(s) as u8;
            level | if *v < 0.0 { 0x80 } else { 0 }
        })
        .collect();
    Quantized { norm, levels, codes }
}

pub fn dequantize(q: &Quantized, out: &mut [f32]) {
    let step = q.norm / f32::from(q.levels);
    for (o, c) in out.iter_mut().zip(&q.codes) {
        let mag = f32::from(c & 0x7f) * step;
        *o = if c & 0x80 != 0 { -mag } else { mag };
    }
}
