//! Datasets and the distributed sampler, for user training loops.

pub use kolo_train::data::{Dataset, Mnist};
pub use kolo_train::sampler::{Position, Sampler, SamplerConfig};
