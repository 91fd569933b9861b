//! Dynamic loss scaling for f16 training (torch's `GradScaler`): the loss is multiplied by
//! `scale` before backward so small gradients survive f16; gradients are divided by it before
//! the update. A step whose gradients contain inf or NaN (on any rank) is skipped and the scale
//! halves; after `growth_interval` good steps in a row it doubles.

#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: u64,
    good_steps: u64,
    skipped: u64,
}

impl LossScaler {
    /// torch's defaults: initial scale 2^16, x2 every 2000 good steps, x0.5 on overflow.
    pub fn new() -> LossScaler {
        LossScaler::with(65536.0, 2.0, 0.5, 2000)
    }

    pub fn with(init: f64, growth_factor: f64, backoff_factor: f64, growth_interval: u64) -> LossScaler {
        LossScaler { scale: init, growth_factor, backoff_factor, growth_interval: growth_interval.max(1), good_steps: 0, skipped: 0 }
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped so far because of inf/NaN gradients.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// What a checkpoint keeps: (scale, good steps in a row, skipped steps).
    pub fn state(&self) -> (f64, u64, u64) {
        (self.scale, self.good_steps, self.skipped)
    }

    /// Continues from a checkpoint's [`LossScaler::state`].
    pub fn restore(&mut self, (scale, good_steps, skipped): (f64, u64, u64)) {
        self.scale = scale;
        self.good_steps = good_steps % self.growth_interval;
        self.skipped = skipped;
    }

    /// Records the outcome of a step (`found_inf` must be the same on every rank); returns
    /// whether the optimizer may apply it.
    pub fn update(&mut self, found_inf: bool) -> bool {
        if found_inf {
            self.scale = (self.scale * self.backoff_factor).max(f64::MIN_POSITIVE);
            self.good_steps = 0;
            self.skipped += 1;
            return false;
        }
        self.good_steps += 1;
        if self.good_steps == self.growth_interval {
            self.scale *= self.growth_factor;
            self.good_steps = 0;
        }
        true
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new()
    }
}

/// Whether any value is inf or NaN.
pub fn has_non_finite(v: &[f32]) -> bool {
    v.iter().any(|x| !x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_and_backs_off_then_good_steps_grow() {
        let mut s = LossScaler::with(1024.0, 2.0, 0.5, 3);
        assert!(!s.update(true));
        assert_eq!((s.scale(), s.skipped()), (512.0, 1));
        assert!(s.update(false) && s.update(false));
        assert_eq!(s.scale(), 512.0);
        assert!(s.update(false));
        assert_eq!(s.scale(), 1024.0, "grows after 3 good steps in a row");
        assert!(s.update(false) && s.update(false));
        assert!(!s.update(true), "an overflow resets the run of good steps");
        assert_eq!((s.scale(), s.skipped()), (512.0, 2));
        assert!(has_non_finite(&[1.0, f32::NAN]) && has_non_finite(&[f32::NEG_INFINITY]) && !has_non_finite(&[0.0, 3.0]));
    }
}
