//! Reinforcement learning for IMPALA (Espeholt et al., 2018), without tensors: the
//! environments actors run, the V-trace targets the learner computes, and the actors' policy
//! evaluation on the learner's flat parameters (an MLP, laid out as `kolo_tensor`'s).

pub mod env;
pub mod impala;
pub mod policy;
pub mod vtrace;

pub use env::{CartPole, Env, GridWorld};
pub use vtrace::{vtrace, VTrace};

#[cfg(test)]
mod tests;
