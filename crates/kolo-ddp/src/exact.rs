//! Gradient sums that do not depend on the order of addition (`[ddp] deterministic = true`).
//!
//! Floating-point addition is not associative, so an all-reduce over 2 ranks and one over 3
//! ranks sum the same gradients in different orders and get different bits. Here every
//! gradient piece is first rounded to a fixed-point integer (units of 2^-64, in an `i128`)
//! and the integers are added: integer addition is associative, so every order, every split
//! over ranks and every reduction algorithm gives the same sum. The rounding of a piece
//! depends only on that piece, never on who adds it. Pure: no communication here; the trainer
//! sums the [`lanes`](ExactSum::to_lanes) of all ranks with an `i64` all-reduce.
//!
//! Range and precision: a piece's magnitude must stay below 2^24 (larger values are refused,
//! they mean the run has diverged); values are exact down to 2^-40 and lose low bits below
//! that (values under 2^-64 vanish), far finer than the f32 sum they replace for any
//! realistic gradient.

/// Fractional bits of the fixed-point representation.
pub const FRAC_BITS: i32 = 64;
/// Largest magnitude of one gradient value the sum accepts.
pub const MAX_MAGNITUDE: f32 = 16_777_216.0; // 2^24
/// Bits of the low lane; the high lane holds the rest (see [`ExactSum::to_lanes`]).
const LO_BITS: u32 = 50;

/// One fixed-point accumulator per gradient element.
#[derive(Clone, Debug)]
pub struct ExactSum {
    acc: Vec<i128>,
}

/// A value [`ExactSum::add`] cannot represent: its index and the value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutOfRange {
    pub idx: usize,
    pub value: f32,
}

impl ExactSum {
    pub fn new(len: usize) -> ExactSum {
        ExactSum { acc: vec![0; len] }
    }

    pub fn len(&self) -> usize {
        self.acc.len()
    }

    pub fn is_empty(&self) -> bool {
        self.acc.is_empty()
    }

    /// Starts a new sum.
    pub fn clear(&mut self) {
        self.acc.iter_mut().for_each(|a| *a = 0);
    }

    /// Adds `g` (one piece's gradient, as long as the sum) exactly. A non-finite value or one
    /// of magnitude 2^24 or more is refused and nothing is added.
    pub fn add(&mut self, g: &[f32]) -> Result<(), OutOfRange> {
        assert_eq!(g.len(), self.acc.len(), "ExactSum::add: length");
        if let Some(idx) = g.iter().position(|v| !(v.abs() < MAX_MAGNITUDE)) {
            return Err(OutOfRange { idx, value: g[idx] });
        }
        let unit = 2f64.powi(FRAC_BITS);
        for (a, v) in self.acc.iter_mut().zip(g) {
            // Exact in f64 (a 24-bit mantissa times a power of two); the cast truncates only
            // the bits below 2^-64, the same way wherever this piece is added.
            *a += (f64::from(*v) * unit) as i128;
        }
        Ok(())
    }

    /// Splits every accumulator into two `i64` lanes, low `LO_BITS` bits and the rest, so
    /// that an `i64` sum all-reduce of the lanes of up to 2^13 ranks, each holding up to 2^25
    /// pieces, neither overflows nor depends on the order; [`ExactSum::from_lanes`] joins them.
    pub fn to_lanes(&self, hi: &mut [i64], lo: &mut [i64]) {
        assert!(hi.len() == self.acc.len() && lo.len() == self.acc.len(), "ExactSum::to_lanes: length");
        let mask = (1i128 << LO_BITS) - 1;
        for ((a, h), l) in self.acc.iter().zip(hi.iter_mut()).zip(lo.iter_mut()) {
            *h = (a >> LO_BITS) as i64;
            *l = (a & mask) as i64;
        }
    }

    /// The summed lanes back as f32 values, each divided by `count` (the number of pieces, for
    /// a mean); the one rounding to f32 happens here, identically on every rank.
    pub fn from_lanes(hi: &[i64], lo: &[i64], count: usize, out: &mut [f32]) {
        assert!(hi.len() == out.len() && lo.len() == out.len(), "ExactSum::from_lanes: length");
        let unit = 2f64.powi(-FRAC_BITS);
        for ((h, l), o) in hi.iter().zip(lo).zip(out.iter_mut()) {
            let v = (i128::from(*h) << LO_BITS) + i128::from(*l);
            *o = ((v as f64 * unit) / count as f64) as f32;
        }
    }
}
