//! Kolo's communication API. It knows no tensor library: it moves typed buffers.
//!
//! * [`Communicator`]: the fixed verb set (`all_reduce`, `reduce`, `broadcast`, `all_gather`,
//!   `reduce_scatter`, `all_to_all`, `send`, `recv`, `barrier`) plus `new_group`.
//! * [`AsyncComm`] and [`Pending`]: background execution so communication overlaps compute.
//! * [`split`] and [`DeviceMesh`]: sub-groups and named-axis meshes (dp × tp × pp).
//! * [`LocalComm`]: threads in one process; the reference all backends are tested against.
//! * [`Checked`]: cross-rank fingerprints of every call, to report mismatched collectives.

mod buffer;
mod checked;
pub mod communicator;
mod error;
mod local;
pub mod mesh;
mod pending;
pub mod reduce;

pub use buffer::{BufMut, BufRef, Element, Scratch};
pub use checked::Checked;
pub use communicator::{split, Communicator, Fingerprint, DEFAULT_TIMEOUT};
pub use error::{CommError, OpKind};
pub use half::{bf16, f16};
pub use local::LocalComm;
pub use mesh::{DeviceMesh, Ring, SumGroup};
pub use pending::{AsyncComm, Pending};
pub use reduce::ReduceOp;

#[cfg(test)]
mod tests;
