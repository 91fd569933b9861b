use kolo_base::Rank;
use std::fmt;
use std::time::Duration;

/// The collective (or setup step) an error happened in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    AllToAll,
    Send,
    Recv,
    Barrier,
    NewGroup,
    Setup,
}

impl OpKind {
    pub fn code(self) -> u8 {
        match self {
            OpKind::AllReduce => 1,
            OpKind::Reduce => 2,
            OpKind::Broadcast => 3,
            OpKind::AllGather => 4,
            OpKind::ReduceScatter => 5,
            OpKind::AllToAll => 6,
            OpKind::Send => 7,
            OpKind::Recv => 8,
            OpKind::Barrier => 9,
            OpKind::NewGroup => 10,
            OpKind::Setup => 11,
        }
    }

    pub fn from_code(c: u8) -> Option<OpKind> {
        use OpKind::*;
        [AllReduce, Reduce, Broadcast, AllGather, ReduceScatter, AllToAll, Send, Recv, Barrier, NewGroup, Setup]
            .into_iter()
            .find(|o| o.code() == c)
    }

    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
            OpKind::NewGroup => "new_group",
            OpKind::Setup => "setup",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

fn ranks(rs: &[Rank]) -> String {
    let v: Vec<String> = rs.iter().map(|r| r.to_string()).collect();
    format!("[{}]", v.join(", "))
}

/// Errors of the communication layer. Each names the rank that saw it, the operation and its
/// sequence number, and the peer(s) involved.
#[non_exhaustive]
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    #[error("rank {rank}: {op} #{seq} timed out after {waited:?}; still waiting for rank(s) {}", ranks(missing))]
    Timeout { op: OpKind, rank: Rank, seq: u64, waited: Duration, missing: Vec<Rank> },

    #[error("rank {rank}: {op} #{seq}: lost rank {peer}: {reason}")]
    PeerLost { op: OpKind, rank: Rank, seq: u64, peer: Rank, reason: String },

    #[error("rank {rank}: {op} #{seq}: collective mismatch: this rank called {ours}, rank {peer} called {theirs}")]
    Mismatch { op: OpKind, rank: Rank, seq: u64, peer: Rank, ours: String, theirs: String },

    #[error("rank {rank}: {op} #{seq}: malformed data from rank {peer}: {what}")]
    Protocol { op: OpKind, rank: Rank, seq: u64, peer: Rank, what: String },

    #[error("rank {rank}: {op}: invalid argument: {what}")]
    InvalidArgument { op: OpKind, rank: Rank, what: String },

    #[error("{op} is not supported by the {backend} backend")]
    Unsupported { op: OpKind, backend: &'static str },

    #[error("rank {rank}: communicator is unusable after an earlier failure: {cause}")]
    Aborted { rank: Rank, cause: Box<CommError> },

    #[error("rank {rank}: {op}: {what}")]
    Setup { op: OpKind, rank: Rank, what: String },
}

impl CommError {
    /// The error later calls get once this one has broken a communicator.
    pub fn into_aborted(self, rank: Rank) -> CommError {
        match self {
            e @ CommError::Aborted { .. } => e,
            e => CommError::Aborted { rank, cause: Box::new(e) },
        }
    }

    /// The error as the parent group reports it, for a failure inside a sub-group that carries
    /// out part of the parent's collective `op` #`seq`: this rank is `rank`, and every peer is
    /// renumbered by `parent_of` (the sub-group's ranks to the parent's).
    pub fn in_parent(self, op: OpKind, rank: Rank, seq: u64, parent_of: &dyn Fn(Rank) -> Rank) -> CommError {
        match self {
            CommError::Timeout { waited, missing, .. } => {
                CommError::Timeout { op, rank, seq, waited, missing: missing.into_iter().map(parent_of).collect() }
            }
            CommError::PeerLost { peer, reason, .. } => CommError::PeerLost { op, rank, seq, peer: parent_of(peer), reason },
            CommError::Mismatch { peer, ours, theirs, .. } => CommError::Mismatch { op, rank, seq, peer: parent_of(peer), ours, theirs },
            CommError::Protocol { peer, what, .. } => CommError::Protocol { op, rank, seq, peer: parent_of(peer), what },
            CommError::InvalidArgument { what, .. } => CommError::InvalidArgument { op, rank, what },
            CommError::Aborted { cause, .. } => CommError::Aborted { rank, cause: Box::new(cause.in_parent(op, rank, seq, parent_of)) },
            CommError::Setup { what, .. } => CommError::Setup { op, rank, what },
            e @ CommError::Unsupported { .. } => e,
        }
    }

    /// The peer whose loss caused this error (or, for a timeout, the one rank that never
    /// arrived), looking through `Aborted`.
    pub fn lost_peer(&self) -> Option<Rank> {
        match self {
            CommError::PeerLost { peer, .. } => Some(*peer),
            CommError::Timeout { missing, .. } if missing.len() == 1 => Some(missing[0]),
            CommError::Aborted { cause, .. } => cause.lost_peer(),
            _ => None,
        }
    }

    /// Whether this error leaves the communicator unusable (argument errors do not).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, CommError::InvalidArgument { .. } | CommError::Unsupported { .. })
    }
}
