//! The library's error: one enum whose variants carry what a caller matches on (the setting, the
//! rank, the operation, the file), instead of text.

use std::path::PathBuf;

/// What went wrong in a call to the Kolo library.
///
/// Kolo's own checks carry their facts as fields ([`Error::Setting`], [`Error::Usage`],
/// [`Error::File`]); failures of the engine underneath (a collective, DDP, a checkpoint, candle)
/// are wrapped as they are: their messages already name the rank and the operation.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting is invalid, or this path does not support it.
    #[error("{setting}: {reason}")]
    Setting {
        /// The setting as the options file names it (`ddp.zero_stage`, `optim.lr`, ...).
        setting: String,
        /// Why it is refused, and what to do instead.
        reason: String,
    },
    /// A call that does not fit the model or the trainer's state: a parameter of the wrong dtype,
    /// an empty VarMap, a non-scalar loss, an update before the accumulation is complete.
    #[error("rank {rank}: {op}: {reason}")]
    Usage {
        /// The rank that found it.
        rank: usize,
        /// The call (`Trainer::new`, `Trainer::update`, `Dist::all_gather`, ...).
        op: &'static str,
        /// What was expected, and what was found.
        reason: String,
    },
    /// A file whose contents do not fit: an options file, a Hugging Face checkpoint, a token
    /// shard, a tokenizer.
    #[error("{}: {reason}", path.display())]
    File {
        /// The file (or directory).
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file (or directory).
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Joining the job: the environment names no consistent job, or the rendezvous failed.
    #[error("join: {0}")]
    Join(String),
    /// Writing the optimizer's state to its offload directory failed.
    #[error("optimizer state on disk: {0}")]
    Offload(#[source] std::io::Error),
    /// A collective failed (a peer died or was late, a mismatched call, a bad frame).
    #[error(transparent)]
    Comm(#[from] kolo_comm::CommError),
    /// The DDP/ZeRO engine refused or failed (models that differ between ranks, missing
    /// gradients).
    #[error(transparent)]
    Ddp(#[from] kolo_ddp::DdpError),
    /// Kolo's training engine: options, data, checkpoints.
    #[error(transparent)]
    Train(#[from] kolo_train::TrainError),
    /// Kolo's flat parameters and gradients over candle.
    #[error(transparent)]
    Tensor(#[from] kolo_tensor::TensorError),
    /// A candle operation failed (in the model, the loss or the trainer's tensors).
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The parameter servers failed or did not answer in time ([`crate::PsWorker`]).
    #[cfg(feature = "ps")]
    #[error(transparent)]
    Ps(#[from] kolo_ps::PsError),
}

/// The library's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<kolo_train::update::EngineError> for Error {
    fn from(e: kolo_train::update::EngineError) -> Error {
        use kolo_train::update::EngineError as E;
        match e {
            E::Setting(setting, reason) => Error::setting(setting, reason),
            E::Offload(_, e) => Error::Offload(e),
            E::Ddp(e) => Error::Ddp(e),
        }
    }
}

impl Error {
    /// An [`Error::Setting`] (a reason that starts with the setting's name loses it).
    pub(crate) fn setting(setting: impl Into<String>, reason: impl Into<String>) -> Error {
        let (setting, reason) = (setting.into(), reason.into());
        let reason = reason.strip_prefix(&format!("{setting}: ")).map(str::to_string).unwrap_or(reason);
        Error::Setting { setting, reason }
    }

    /// An [`Error::Usage`].
    pub(crate) fn usage(rank: usize, op: &'static str, reason: impl Into<String>) -> Error {
        Error::Usage { rank, op, reason: reason.into() }
    }

    /// An [`Error::File`].
    pub(crate) fn file(path: impl Into<PathBuf>, reason: impl std::fmt::Display) -> Error {
        Error::File { path: path.into(), reason: reason.to_string() }
    }

    /// An [`Error::Io`].
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source }
    }
}
