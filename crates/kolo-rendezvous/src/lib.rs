//! Rendezvous: how ranks find each other and prove they belong to the same job.
//!
//! * [`Store`]: a small key-value store with blocking, deadline-bounded `get`. [`TcpStore`] is
//!   hosted by rank 0 (like c10d's TCPStore); [`MemoryStore`] serves threads in one process;
//!   [`PrefixStore`] namespaces keys for sub-groups.
//! * [`auth`]: the job token and the challenge-response handshake that the store and every peer
//!   connection run before any other byte is trusted. The token itself never crosses the wire.
//! * [`env`](mod@env): turns torchrun, Slurm and Open MPI environment variables into a [`LaunchEnv`].
//!   It takes the variables as an argument; only the launcher and the trainer read the process
//!   environment.

pub mod auth;
pub mod env;
mod error;
pub mod handshakes;
mod memory;
mod tcp;
pub mod wire;

pub use auth::JobToken;
pub use env::{discover, EnvSource, LaunchEnv, STORE_FD};
pub use error::StoreError;
pub use memory::MemoryStore;
pub use tcp::{TcpStore, TcpStoreServer};

use kolo_base::Deadline;
use std::sync::Arc;

/// A key-value store shared by all ranks of a job.
pub trait Store: Send + Sync {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;
    /// Waits until `key` exists, then returns its value.
    fn get(&self, key: &str, deadline: Deadline) -> Result<Vec<u8>, StoreError>;
    /// Atomically adds `delta` to the integer stored at `key` (0 if absent); returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError>;
    /// Whether `key` exists, without waiting.
    fn check(&self, key: &str) -> Result<bool, StoreError>;
    /// Removes `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool, StoreError>;

    /// Waits until every key exists.
    fn wait(&self, keys: &[&str], deadline: Deadline) -> Result<(), StoreError> {
        for k in keys {
            self.get(k, deadline)?;
        }
        Ok(())
    }

    /// The same store over a connection of its own, for a thread that must not queue behind
    /// this one's long waits (heartbeats). `None` where requests never queue (in memory) or a
    /// second connection cannot be made: then use this one.
    fn second_connection(&self) -> Option<Arc<dyn Store>> {
        None
    }
}

/// Puts every key of `inner` under `prefix/`, so that sub-groups can rendezvous independently.
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore { prefix: prefix.into(), inner }
    }
    fn key(&self, k: &str) -> String {
        format!("{}/{}", self.prefix, k)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, deadline: Deadline) -> Result<Vec<u8>, StoreError> {
        self.inner.get(&self.key(key), deadline)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64, StoreError> {
        self.inner.add(&self.key(key), delta)
    }
    fn check(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.check(&self.key(key))
    }
    fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.inner.delete(&self.key(key))
    }
    fn second_connection(&self) -> Option<Arc<dyn Store>> {
        let inner = self.inner.second_connection()?;
        Some(Arc::new(PrefixStore { prefix: self.prefix.clone(), inner }))
    }
}

/// The barrier every rank passes to join a job (the bootstrap's).
pub const JOIN_BARRIER: &str = "kolo/join";

/// The key where a reason to abandon the join is left: by a rank that found a mismatch
/// (world size, a duplicate rank) before failing, or by the store server when a Kolo process
/// of another job was refused. Every rank waiting in the join barrier fails with it.
pub fn join_error_key() -> String {
    format!("{JOIN_BARRIER}/error")
}

/// Leaves `why` for the other ranks waiting in the join barrier (best effort: this rank is
/// failing anyway).
pub fn abandon_join(store: &dyn Store, why: &str) {
    let _ = store.set(&join_error_key(), why.as_bytes());
}

/// An O(n) barrier over the store: every rank bumps one counter, the last one to arrive sets
/// `done`. Used to join a job and to check that every rank agrees on the world size. Waits in
/// slices of at most 200 ms and fails as soon as `{name}/error` appears, with its reason.
pub fn store_barrier(store: &dyn Store, name: &str, world_size: usize, deadline: Deadline) -> Result<(), StoreError> {
    let n = store.add(&format!("{name}/count"), 1)?;
    if n == world_size as i64 {
        store.set(&format!("{name}/done"), b"1")?;
    } else if n > world_size as i64 {
        let why = format!(
            "barrier `{name}`: {n} ranks arrived but the world size is {world_size} (a rank was started twice or with a wrong WORLD_SIZE)"
        );
        let _ = store.set(&format!("{name}/error"), why.as_bytes());
        return Err(StoreError::Protocol(why));
    }
    let (done, error) = (format!("{name}/done"), format!("{name}/error"));
    loop {
        let slice = Deadline::after(deadline.remaining().min(std::time::Duration::from_millis(200)));
        match store.get(&done, slice) {
            Ok(_) => return Ok(()),
            Err(StoreError::Timeout { .. }) => {}
            Err(e) => return Err(e),
        }
        if store.check(&error)? {
            let why = store.get(&error, deadline).map(|v| String::from_utf8_lossy(&v).into_owned()).unwrap_or_default();
            return Err(StoreError::Protocol(format!("barrier `{name}` abandoned: {why}")));
        }
        if deadline.remaining().is_zero() {
            return Err(StoreError::Timeout {
                key: format!(
                    "{done} (barrier `{name}`: {} of {world_size} ranks arrived)",
                    store.add(&format!("{name}/count"), 0).unwrap_or(-1)
                ),
                waited: deadline.budget(),
            });
        }
    }
}

#[cfg(test)]
mod tests;
