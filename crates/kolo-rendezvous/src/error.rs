use std::time::Duration;

/// Errors of the rendezvous layer.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("store: timed out after {waited:?} waiting for key `{key}`")]
    Timeout { key: String, waited: Duration },
    #[error("store: cannot reach {addr}: {reason}")]
    Connect { addr: String, reason: String },
    #[error("store: connection lost: {0}")]
    Io(String),
    #[error("store: protocol error: {0}")]
    Protocol(String),
    #[error("authentication failed with {peer}: {reason}")]
    Auth { peer: String, reason: String },
    #[error("store: value of `{key}` is not an integer")]
    NotAnInteger { key: String },
    #[error("store: server error: {0}")]
    Server(String),
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(e.to_string())
    }
}
