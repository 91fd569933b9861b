//! [`Mesh`]: the job's ranks as a grid of named axes (torch's `init_device_mesh`), one
//! communicator per axis: `pp` (pipeline parallelism: [`crate::pp`], each coordinate a stage
//! holding its own layers), `dp` (data parallelism: DDP over the ranks that hold the same
//! parameters) and `tp` (tensor parallelism: [`crate::tp`]'s layers split over it).

use crate::tp::TensorParallel;
use crate::{Dist, Error, Result};
use kolo_comm::{Communicator, DeviceMesh};
use std::sync::Arc;

/// The axes a user's model can be split along so far.
const AXES: [&str; 3] = ["pp", "dp", "tp"];

/// The ranks as a `pp x dp x tp` grid, laid out as Megatron does: `tp` varies fastest, so the
/// members of a tensor-parallel group are consecutive ranks (one host, where the per-layer
/// all-reduces are cheapest), and `pp` slowest.
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
    sizes: [usize; 3],
    coords: [usize; 3],
    pp: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    tp: TensorParallel,
    model: Arc<dyn Communicator>,
    world: Arc<dyn Communicator>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [pp, dp, tp] = self.sizes;
        write!(f, "Mesh {{ rank: {}, pp: {pp}, dp: {dp}, tp: {tp} }}", self.global_rank)
    }
}

impl Mesh {
    /// Collective over `dist`: the grid of `axes` (name and size: `pp`, `dp` and `tp`, in that
    /// order; one left out has size 1). Their product must be the world size.
    pub fn new(dist: &Dist, axes: &[(&str, usize)]) -> Result<Mesh> {
        let mut sizes = [1usize; 3];
        let mut seen = Vec::new();
        for (name, size) in axes {
            let Some(i) = AXES.iter().position(|a| a == name) else {
                return Err(Error::setting(
                    "mesh",
                    format!(
                        "axis `{name}`: a user's model is split along `pp`, `dp` and `tp` so far (sequence and expert parallelism: kolo train's built-in GPT)"
                    ),
                ));
            };
            if seen.last().is_some_and(|&j| j >= i) {
                return Err(Error::setting("mesh", format!("axes {axes:?}: name each once, in the order pp, dp, tp (tp varies fastest)")));
            }
            seen.push(i);
            sizes[i] = *size;
        }
        let world = dist.world_size();
        let [pp, dp, tp] = sizes;
        if sizes.contains(&0) || pp * dp * tp != world {
            return Err(Error::setting("mesh", format!("pp {pp} x dp {dp} x tp {tp} = {} ranks, but the job has {world}", pp * dp * tp)));
        }
        let m = DeviceMesh::new(&**dist.comm(), &[("pp", pp), ("dp", dp), ("tp", tp)])?;
        let group = |a: &str| m.group(a).cloned().expect("every axis exists");
        let coords = AXES.map(|a| m.coord(a).unwrap_or(0));
        Ok(Mesh {
            global_rank: dist.rank(),
            sizes,
            coords,
            pp: group("pp"),
            dp: group("dp"),
            tp: TensorParallel::new(group("tp")),
            // The ranks of one replica (the same dp coordinate), ordered by rank.
            model: kolo_comm::split(&**dist.comm(), Some(coords[1] as u32), dist.rank() as u32)?.expect("every rank has a color"),
            world: dist.comm().clone(),
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.global_rank
    }

    /// The size of `axis` (`pp`, `dp` or `tp`; 1 for any other name).
    pub fn size(&self, axis: &str) -> usize {
        AXES.iter().position(|a| *a == axis).map_or(1, |i| self.sizes[i])
    }

    /// This rank's coordinate along `axis` (0 for any other name).
    pub fn coord(&self, axis: &str) -> usize {
        AXES.iter().position(|a| *a == axis).map_or(0, |i| self.coords[i])
    }

    /// The pipeline group: one rank per stage, in stage order ([`crate::pp`]).
    pub fn pp(&self) -> &Arc<dyn Communicator> {
        &self.pp
    }

    /// The model-parallel group (Megatron's): the ranks that together hold one replica of the
    /// model, every stage and tensor-parallel piece of it (the same `dp` coordinate).
    pub fn model_parallel(&self) -> &Arc<dyn Communicator> {
        &self.model
    }

    /// The whole job's communicator.
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }

    /// The data-parallel group: the ranks holding the same parameters (the same stage and
    /// tensor-parallel piece). Each feeds its own batches; the members of a tensor-parallel
    /// group feed the same ones.
    pub fn dp(&self) -> &Arc<dyn Communicator> {
        &self.dp
    }

    /// The tensor-parallel group (of one rank when `tp` is 1), for [`crate::tp`]'s layers.
    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }
}
