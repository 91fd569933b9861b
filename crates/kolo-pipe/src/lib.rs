//! Pipeline parallelism, tensor-free: [`schedule`] holds the plans (stage partitioning, GPipe
//! and 1F1B op orders, a dependency simulator for the bubble), [`exec`] runs one stage's plan
//! over a communicator whose ranks are the stages. The model side (what a stage computes)
//! implements [`exec::StageWork`]; kolo-train does that for the GPT on candle.

pub mod exec;
pub mod schedule;

pub use exec::{run_stage, PipeError, StageRun, StageWork, StepReport};
pub use schedule::{max_in_flight, ops, partition, simulate, theoretical_bubble, weight_version, Op, Schedule};

#[cfg(test)]
mod tests;
