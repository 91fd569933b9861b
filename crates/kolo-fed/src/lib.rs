//! Federated averaging (McMahan et al.): clients keep their data, train the shared model
//! locally for a few epochs and send only the change of the parameters; the server averages the
//! changes weighted by the clients' example counts.
//!
//! - [`server`]: rounds (client sampling, a deadline per round, stragglers left out),
//!   example-weighted averaging, secure aggregation.
//! - [`client`]: a client's connection: join, wait for a round, send an update.
//! - [`secure`]: pairwise masking with X25519 key agreement and fixed-point sums.
//! - [`identity`]: clients' signing keys and the roster, against a server substituting keys.
//! - [`wire`]: the messages, decoded totally (hostile bytes are errors, never panics).

pub mod client;
pub mod identity;
pub mod job;
pub mod secure;
pub mod server;
pub mod wire;

pub use client::{FedClient, Task, TrainTask};
pub use kolo_ps::PsError as FedError;
pub use server::{FedServer, RoundReport};
use std::time::Duration;

/// A federated job's rules.
#[derive(Clone, Debug, PartialEq)]
pub struct FedSpec {
    pub rounds: u32,
    /// Clients sampled per round (all joined ones when larger).
    pub clients_per_round: usize,
    /// Clients that must have joined before the first round.
    pub min_clients: usize,
    /// How long a round waits for its clients' updates.
    pub deadline: Duration,
    /// How long the server waits for `min_clients`.
    pub join_timeout: Duration,
    /// Attempts per round before the job fails (secure rounds repeat without late members).
    pub max_attempts: u32,
    /// Secure aggregation: the server sees only masked updates.
    pub secure: bool,
    /// Seeds the client sampling.
    pub seed: u64,
    /// Values in the model.
    pub numel: usize,
    /// The clients' identities (secure aggregation against a server that substitutes keys):
    /// a client joins only with its key signed by the identity listed for its id.
    pub roster: Option<identity::Roster>,
}

impl FedSpec {
    pub fn check(&self) -> Result<(), FedError> {
        if self.rounds == 0 || self.clients_per_round == 0 || self.min_clients == 0 || self.deadline.is_zero() {
            return Err(FedError::Config("rounds, clients_per_round, min_clients and the round deadline must be positive".into()));
        }
        if self.secure && self.clients_per_round < secure::MIN_COHORT {
            return Err(FedError::Config(format!(
                "secure aggregation needs at least {} clients per round (with two, each learns the other's update from the sum)",
                secure::MIN_COHORT
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
