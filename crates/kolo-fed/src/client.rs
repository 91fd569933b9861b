//! A client's side of federated averaging: join, wait for a round, send an update. Only the
//! example count and model updates leave the client (its connection records what it sent when
//! asked to, for tests).

use crate::identity::{Identity, Roster};
use crate::secure::{check_cohort, mask, KeyPair, MIN_COHORT};
use crate::wire::{Fed, Req, Resp, Update};
use kolo_ps::net::Channel;
use kolo_ps::PsError;
use kolo_rendezvous::JobToken;
use std::time::Duration;

/// A round's assignment.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainTask {
    pub round: u32,
    pub attempt: u32,
    pub params: Vec<f32>,
    pub cohort: Vec<(u32, [u8; 32])>,
    /// Each member's identity signature of its key (jobs with a roster).
    pub sigs: Vec<[u8; 64]>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Task {
    Train(TrainTask),
    /// The job is over after `rounds` rounds: the final model.
    Done {
        rounds: u32,
        params: Vec<f32>,
    },
}

pub struct FedClient {
    conn: Channel<Fed>,
    pub id: u32,
    pub numel: usize,
    pub secure: bool,
    /// The smallest secure cohort this client masks for ([`MIN_COHORT`] unless raised).
    pub min_cohort: usize,
    keys: KeyPair,
    /// The job's client identities: every cohort member's key must be signed by its identity.
    roster: Option<Roster>,
}

fn unexpected(what: &str, r: Resp) -> PsError {
    match r {
        Resp::Error(m) => PsError::Server(m),
        other => PsError::Protocol(format!("{what}: unexpected answer {other:?}")),
    }
}

impl FedClient {
    /// Joins the job at `addr` with `examples` local training examples, as client `id` when
    /// given (e.g. its shard number), else as the next free id.
    pub fn join(addr: &str, token: &JobToken, examples: u64, id: Option<u32>, timeout: Duration) -> Result<FedClient, PsError> {
        Self::join_as(addr, token, examples, id, None, timeout)
    }

    /// As [`FedClient::join`]; with `identity` (this client's signing key and the job's
    /// roster) the key it masks with is signed, and it masks only for cohorts whose every key
    /// is signed by its member's identity ([`crate::identity`]).
    pub fn join_as(
        addr: &str,
        token: &JobToken,
        examples: u64,
        id: Option<u32>,
        identity: Option<(Identity, Roster)>,
        timeout: Duration,
    ) -> Result<FedClient, PsError> {
        let mut conn = Channel::<Fed>::connect(addr, token, timeout)?;
        let keys = KeyPair::generate();
        let (id, sig, roster) = match identity {
            Some((me, roster)) => (Some(me.id), Some(me.sign_key(&keys.public)), Some(roster)),
            None => (id, None, None),
        };
        match conn.call(&Req::Join { examples, public: Some(keys.public), id, sig })? {
            Resp::Joined { id, numel, secure } => {
                Ok(FedClient { conn, id, numel: numel as usize, secure, min_cohort: MIN_COHORT, keys, roster })
            }
            r => Err(unexpected("join", r)),
        }
    }

    /// From now on keep a copy of every message body this client sends.
    pub fn record(&mut self) {
        self.conn.sent = Some(Vec::new());
    }

    /// Every message body sent since [`FedClient::record`].
    pub fn recorded(&self) -> &[u8] {
        self.conn.sent.as_deref().unwrap_or(&[])
    }

    /// Bytes sent and received on the connection (frames included).
    pub fn bytes(&self) -> (u64, u64) {
        (self.conn.bytes_out, self.conn.bytes_in)
    }

    /// Waits for the next round this client is part of, or the end of the job.
    pub fn next_task(&mut self) -> Result<Task, PsError> {
        loop {
            match self.conn.call(&Req::Poll { id: self.id })? {
                Resp::Wait => continue,
                Resp::Train { round, attempt, params, cohort, sigs } => {
                    if params.len() != self.numel {
                        return Err(PsError::Protocol(format!(
                            "round {round}: a model of {} values, expected {}",
                            params.len(),
                            self.numel
                        )));
                    }
                    return Ok(Task::Train(TrainTask { round, attempt, params, cohort, sigs }));
                }
                Resp::Done { rounds, params } => {
                    // Tell the server it may close (its answer does not matter any more).
                    let _ = self.conn.call(&Req::Bye { id: self.id });
                    return Ok(Task::Done { rounds, params });
                }
                r => return Err(unexpected("poll", r)),
            }
        }
    }

    /// Sends the update `delta` (new local parameters minus `task.params`) from `examples`
    /// examples. Returns whether the server took it (false: the round closed first). A secure
    /// update is refused, unsent, for a cohort [`check_cohort`] rejects, or (with a roster) one
    /// whose keys are not all signed by their members' identities.
    pub fn submit(&mut self, task: &TrainTask, examples: u64, delta: &[f32]) -> Result<bool, PsError> {
        let update = if self.secure {
            let refuse = |e: String| PsError::Protocol(format!("client {}, round {}: {e}", self.id, task.round));
            check_cohort(&task.cohort, self.id, &self.keys.public, self.min_cohort.max(MIN_COHORT)).map_err(refuse)?;
            if let Some(roster) = &self.roster {
                roster.verify_cohort(&task.cohort, &task.sigs).map_err(|e| refuse(format!("{e} (a server substituting keys?)")))?;
            }
            let weighted: Vec<f64> = delta.iter().map(|&d| f64::from(d) * examples as f64).collect();
            Update::Masked(mask(&weighted, &self.keys, self.id, &task.cohort, task.round, task.attempt))
        } else {
            Update::Plain(delta.to_vec())
        };
        match self.conn.call(&Req::Update { id: self.id, round: task.round, attempt: task.attempt, examples, update })? {
            Resp::Ack { taken, .. } => Ok(taken),
            r => Err(unexpected("update", r)),
        }
    }
}
