//! Gradient sums that do not depend on the order of addition (`[ddp] deterministic = true`).
//!
//! Floating-point addition is not associative, so an all-reduce over 2 ranks and one over 3
//! ranks sum the same gradients in different orders and get different bits. Here every
//! gradient piece is first rounded to a fixed-point integer (units of 2^-64) and the integers
//! are added: integer addition is associative, so every order, every split over ranks and
//! every reduction algorithm gives the same sum. The rounding of a piece depends only on that
//! piece, never on who adds it. Pure: no communication here; the trainer sums the
//! [`lanes`](ExactSum::lanes_mut) of all ranks with an `i64` sum all-reduce.
//!
//! Representation: value = hi * 2^50 + lo, two `i64` lanes per element (all `hi` first, then
//! all `lo`, so one all-reduce covers both). Locally `lo` is kept in [0, 2^50) by carrying into
//! `hi` on every add, so the lanes of up to 2^13 ranks add without overflow; the split between
//! the lanes after the all-reduce depends on the world size, the value they encode does not, and
//! [`ExactSum::mean_into`] normalises before it converts.
//!
//! Range and precision: a value's magnitude must stay below 2^24 (larger ones are refused; they
//! mean the run has diverged); values are exact down to 2^-40 and lose low bits below that
//! (values under 2^-64 vanish), far finer than the f32 sum they replace for any realistic
//! gradient.

/// Fractional bits of the fixed-point representation.
pub const FRAC_BITS: i32 = 64;
/// Largest magnitude of one gradient value the sum accepts.
pub const MAX_MAGNITUDE: f32 = 16_777_216.0; // 2^24
/// Bits of the low lane.
const LO_BITS: u32 = 50;
const LO_MASK: i64 = (1 << LO_BITS) - 1;

/// One fixed-point accumulator (two lanes) per gradient element.
#[derive(Clone, Debug)]
pub struct ExactSum {
    /// `hi` of every element, then `lo` of every element.
    lanes: Vec<i64>,
}

/// A value [`ExactSum::add`] cannot represent: its index and the value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OutOfRange {
    pub idx: usize,
    pub value: f32,
}

/// `v * 2^64` truncated towards zero, from the bits of `v` (|v| < 2^24, finite): the mantissa
/// shifted by the exponent, so no float rounding and no slow float-to-i128 conversion.
#[inline(always)]
fn fixed(v: f32) -> i128 {
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xff) as i32;
    let mant = i128::from(bits & 0x7f_ffff | (u32::from(exp != 0) << 23));
    // v = mant * 2^(max(exp, 1) - 150); times 2^64.
    let shift = exp.max(1) - 150 + FRAC_BITS;
    let mag = if shift >= 0 {
        mant << shift
    } else if shift > -128 {
        mant >> -shift
    } else {
        0
    };
    if bits >> 31 == 1 {
        -mag
    } else {
        mag
    }
}

impl ExactSum {
    pub fn new(len: usize) -> ExactSum {
        ExactSum { lanes: vec![0; 2 * len] }
    }

    /// Elements (not lanes).
    pub fn len(&self) -> usize {
        self.lanes.len() / 2
    }

    pub fn is_empty(&self) -> bool {
        self.lanes.is_empty()
    }

    /// Starts a new sum.
    pub fn clear(&mut self) {
        self.lanes.iter_mut().for_each(|a| *a = 0);
    }

    /// Adds `g` (one piece's gradient, as long as the sum) exactly. A non-finite value or one
    /// of magnitude 2^24 or more is refused and nothing is added.
    pub fn add(&mut self, g: &[f32]) -> Result<(), OutOfRange> {
        let n = self.len();
        assert_eq!(g.len(), n, "ExactSum::add: length");
        if let Some(idx) = g.iter().position(|v| !v.is_finite() || v.abs() >= MAX_MAGNITUDE) {
            return Err(OutOfRange { idx, value: g[idx] });
        }
        let (hi, lo) = self.lanes.split_at_mut(n);
        for ((h, l), v) in hi.iter_mut().zip(lo.iter_mut()).zip(g) {
            let x = fixed(*v);
            // x < 2^88 in magnitude: its high part fits an i64; the low part joins `lo` and
            // the carry moves to `hi`, keeping lo in [0, 2^50).
            let t = *l + (x as i64 & LO_MASK);
            *h += (x >> LO_BITS) as i64 + (t >> LO_BITS);
            *l = t & LO_MASK;
        }
        Ok(())
    }

    /// The lanes, for an `i64` sum all-reduce across ranks in place.
    pub fn lanes_mut(&mut self) -> &mut [i64] {
        &mut self.lanes
    }

    /// The (summed) value of every element divided by `count` (the number of pieces, for a
    /// mean) into `out`: normalised, converted to f64 with one correct rounding, divided, and
    /// rounded to f32, identically on every rank.
    pub fn mean_into(&self, count: usize, out: &mut [f32]) {
        let n = self.len();
        assert_eq!(out.len(), n, "ExactSum::mean_into: length");
        let (hi, lo) = self.lanes.split_at(n);
        let (lo_unit, unit) = (2f64.powi(LO_BITS as i32 - FRAC_BITS), 2f64.powi(-FRAC_BITS));
        for ((h, l), o) in hi.iter().zip(lo).zip(out.iter_mut()) {
            // The canonical split (lo in [0, 2^50)); then h * 2^50 is exact in f64 (|h| < 2^53)
            // and so is l, so their sum rounds once: the correctly rounded value.
            let (h, l) = (h + (l >> LO_BITS), l & LO_MASK);
            let v = h as f64 * lo_unit + l as f64 * unit;
            *o = (v / count as f64) as f32;
        }
    }
}
