//! ZeRO-3 for an unchanged candle model, as torch's FSDP does it: the parameter groups the user
//! names (by name prefix, one per block) live as shards spread over the ranks, and the model's
//! own variables hold their whole values only while they are used. The mechanism is
//! `kolo_train::zero3`'s (the error type and the pure plans); see there.

use crate::{Error, Result};
use candle_core::Var;
use kolo_base::ParamGather;
pub use kolo_train::zero3::{plan_eviction, plan_groups, KEEP};
use std::sync::Arc;

/// The sharded groups of a [`crate::Trainer`], whose errors name this rank.
pub(crate) struct Zero3 {
    inner: kolo_train::zero3::Zero3,
    rank: usize,
}

impl Zero3 {
    pub(crate) fn new(gather: Arc<dyn ParamGather>, prefixes: &[&str], groups: Vec<Vec<(String, Var)>>, rank: usize) -> Result<Zero3> {
        let inner = kolo_train::zero3::Zero3::new(gather, prefixes, groups, "Trainer::with_zero3_groups");
        Ok(Zero3 { inner: inner.map_err(|e| Error::usage(rank, e.op, e.reason))?, rank })
    }

    fn named<T>(&self, r: std::result::Result<T, kolo_train::zero3::Zero3Error>) -> Result<T> {
        r.map_err(|e| Error::usage(self.rank, e.op, e.reason))
    }

    /// See `kolo_train::zero3::Zero3::release_all`.
    pub(crate) fn release_all(&self) -> Result<()> {
        self.named(self.inner.release_all())
    }

    /// See `kolo_train::zero3::Zero3::gather_all`.
    pub(crate) fn gather_all(&self) -> Result<()> {
        self.named(self.inner.gather_all())
    }

    /// See `kolo_train::zero3::Zero3::take_error`.
    pub(crate) fn take_error(&self) -> Result<()> {
        self.named(self.inner.take_error())
    }

    pub(crate) fn set_prefetch(&self, on: bool) {
        self.inner.set_prefetch(on)
    }

    pub(crate) fn stats(&self) -> (u64, usize) {
        self.inner.stats()
    }
}
