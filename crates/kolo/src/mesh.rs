//! [`Mesh`]: the job's ranks as a grid of named axes (torch's `init_device_mesh`), one
//! communicator per axis: `dp` (data parallelism: DDP over the ranks that hold the same
//! tensor-parallel piece) and `tp` (tensor parallelism: [`crate::tp`]'s layers split over it).

use crate::tp::TensorParallel;
use crate::{Dist, Error, Result};
use kolo_comm::{Communicator, DeviceMesh};
use std::sync::Arc;

/// The axes a user's model can be split along so far.
const AXES: [&str; 2] = ["dp", "tp"];

/// The ranks as a `dp x tp` grid, laid out as Megatron does: `tp` varies fastest, so the
/// members of a tensor-parallel group are consecutive ranks (one host, where the per-layer
/// all-reduces are cheapest).
///
/// ```no_run
/// # fn main() -> kolo::Result<()> {
/// let dist = kolo::init()?;
/// let mesh = kolo::Mesh::new(&dist, &[("dp", 2), ("tp", 2)])?; // 4 processes
/// let tp = mesh.tp(); // give it to kolo::tp's layers
/// # let _ = tp; Ok(()) }
/// ```
pub struct Mesh {
    global_rank: usize,
    sizes: [usize; 2],
    coords: [usize; 2],
    dp: Arc<dyn Communicator>,
    tp: TensorParallel,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mesh {{ rank: {}, dp: {}, tp: {} }}", self.global_rank, self.sizes[0], self.sizes[1])
    }
}

impl Mesh {
    /// Collective over `dist`: the grid of `axes` (name and size; `dp` and `tp`, in that order
    /// when both are given; one left out has size 1). Their product must be the world size.
    pub fn new(dist: &Dist, axes: &[(&str, usize)]) -> Result<Mesh> {
        let mut sizes = [1usize; 2];
        let mut seen = Vec::new();
        for (name, size) in axes {
            let Some(i) = AXES.iter().position(|a| a == name) else {
                return Err(Error::setting(
                    "mesh",
                    format!(
                        "axis `{name}`: a user's model is split along `dp` and `tp` so far (pipeline, sequence and expert parallelism: kolo train's built-in GPT)"
                    ),
                ));
            };
            if seen.last().is_some_and(|&j| j >= i) {
                return Err(Error::setting("mesh", format!("axes {axes:?}: name each once, `dp` before `tp` (tp varies fastest)")));
            }
            seen.push(i);
            sizes[i] = *size;
        }
        let world = dist.world_size();
        if sizes.contains(&0) || sizes[0] * sizes[1] != world {
            return Err(Error::setting(
                "mesh",
                format!("dp {} x tp {} = {} ranks, but the job has {world}", sizes[0], sizes[1], sizes[0] * sizes[1]),
            ));
        }
        let m = DeviceMesh::new(&**dist.comm(), &[("dp", sizes[0]), ("tp", sizes[1])])?;
        let group = |a: &str| m.group(a).cloned().expect("both axes exist");
        let coords = [m.coord("dp").unwrap_or(0), m.coord("tp").unwrap_or(0)];
        Ok(Mesh { global_rank: dist.rank(), sizes, coords, dp: group("dp"), tp: TensorParallel::new(group("tp")) })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.global_rank
    }

    /// The size of `axis` (`dp` or `tp`; 1 for any other name).
    pub fn size(&self, axis: &str) -> usize {
        AXES.iter().position(|a| *a == axis).map_or(1, |i| self.sizes[i])
    }

    /// This rank's coordinate along `axis` (0 for any other name).
    pub fn coord(&self, axis: &str) -> usize {
        AXES.iter().position(|a| *a == axis).map_or(0, |i| self.coords[i])
    }

    /// The data-parallel group: the ranks holding the same tensor-parallel piece. Each feeds
    /// its own batches; the members of a tensor-parallel group feed the same ones.
    pub fn dp(&self) -> &Arc<dyn Communicator> {
        &self.dp
    }

    /// The tensor-parallel group (of one rank when `tp` is 1), for [`crate::tp`]'s layers.
    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }
}
