//! [`Mesh`]: the job's ranks as a grid of named axes (torch's `init_device_mesh`), one
//! communicator per axis: `pp` (pipeline parallelism: [`crate::pp`], each coordinate a stage
//! holding its own layers), `dp` (data parallelism: each coordinate its own batches), `sp`
//! (sequence parallelism: [`crate::sp`], each coordinate a chunk of every sequence), `tp`
//! (tensor parallelism: [`crate::tp`]'s layers split over it) and `ep` (expert parallelism:
//! [`crate::ep`]'s experts dealt out over it, each coordinate also its own batches). Gradients
//! are averaged over the ranks holding the same parameters (`dp x sp`; the parameters outside
//! the experts over `dp x ep x sp`).

use crate::tp::TensorParallel;
use crate::{Dist, Error, Result};
use kolo_comm::{Communicator, DeviceMesh};
use std::sync::Arc;

/// The axes a user's model can be split along, slowest first.
const AXES: [&str; 5] = ["pp", "dp", "ep", "sp", "tp"];

/// The ranks as a `pp x dp x ep x sp x tp` grid, laid out as Megatron does: `tp` varies fastest, so the
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
    sizes: [usize; 5],
    coords: [usize; 5],
    pp: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    ep: Arc<dyn Communicator>,
    sp: crate::sp::SequenceParallel,
    tp: TensorParallel,
    /// The ranks holding the same parameters: `dp x sp` (the same stage, experts and piece).
    replicas: Arc<dyn Communicator>,
    /// With pipeline stages: every stage's replicas (`pp x dp x sp`, the same experts and
    /// piece), where ZeRO's shards of a tied embedding are summed when the stages cut it apart
    /// differently.
    stage_replicas: Option<Arc<dyn Communicator>>,
    model: Arc<dyn Communicator>,
    world: Arc<dyn Communicator>,
    /// The job's communicator's deadlines, which the trainer checks its options against.
    pub(crate) deadlines: Option<crate::dist::Deadlines>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [pp, dp, ep, sp, tp] = self.sizes;
        write!(f, "Mesh {{ rank: {}, pp: {pp}, dp: {dp}, ep: {ep}, sp: {sp}, tp: {tp} }}", self.global_rank)
    }
}

impl Mesh {
    /// Collective over `dist`: the grid of `axes` (name and size: `pp`, `dp`, `ep`, `sp` and
    /// `tp`, in that order; one left out has size 1). Their product must be the world size.
    pub fn new(dist: &Dist, axes: &[(&str, usize)]) -> Result<Mesh> {
        let mut sizes = [1usize; 5];
        let mut seen = Vec::new();
        for (name, size) in axes {
            let Some(i) = AXES.iter().position(|a| a == name) else {
                return Err(Error::setting(
                    "mesh",
                    format!("axis `{name}`: a user's model is split along `pp`, `dp`, `ep`, `sp` and `tp`"),
                ));
            };
            if seen.last().is_some_and(|&j| j >= i) {
                return Err(Error::setting(
                    "mesh",
                    format!("axes {axes:?}: name each once, in the order pp, dp, ep, sp, tp (tp varies fastest)"),
                ));
            }
            seen.push(i);
            sizes[i] = *size;
        }
        let world = dist.world_size();
        let [pp, dp, ep, sp, tp] = sizes;
        if sizes.contains(&0) || pp * dp * ep * sp * tp != world {
            return Err(Error::setting(
                "mesh",
                format!("pp {pp} x dp {dp} x ep {ep} x sp {sp} x tp {tp} = {} ranks, but the job has {world}", pp * dp * ep * sp * tp),
            ));
        }
        let m = DeviceMesh::new(&**dist.comm(), &[("pp", pp), ("dp", dp), ("ep", ep), ("sp", sp), ("tp", tp)])?;
        let group = |a: &str| m.group(a).cloned().expect("every axis exists");
        let coords = AXES.map(|a| m.coord(a).unwrap_or(0));
        let split = |color: usize| -> Result<Arc<dyn Communicator>> {
            Ok(kolo_comm::split(&**dist.comm(), Some(color as u32), dist.rank() as u32)?.expect("every rank has a color"))
        };
        Ok(Mesh {
            global_rank: dist.rank(),
            sizes,
            coords,
            pp: group("pp"),
            dp: group("dp"),
            ep: group("ep"),
            sp: crate::sp::SequenceParallel::new(group("sp")),
            tp: TensorParallel::new(group("tp")),
            // The same stage, experts and piece: dp x sp (the dp group itself without sp).
            replicas: if sp > 1 { split((coords[0] * ep + coords[2]) * tp + coords[4])? } else { group("dp") },
            // The ranks of one replica (the same dp and sp coordinates: every stage, run of
            // experts and piece), ordered by rank.
            model: split(coords[1] * sp + coords[3])?,
            stage_replicas: if pp > 1 { Some(split(coords[2] * tp + coords[4])?) } else { None },
            world: dist.comm().clone(),
            deadlines: dist.deadlines,
        })
    }

    /// This process's rank in the job.
    pub fn rank(&self) -> usize {
        self.global_rank
    }

    /// The size of `axis` (`pp`, `dp`, `sp` or `tp`; 1 for any other name).
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

    /// The expert-parallel group, for [`crate::ep`]'s layers: its members hold different
    /// experts and read their own batches.
    pub fn ep(&self) -> crate::ep::ExpertParallel {
        crate::ep::ExpertParallel::new(self.ep.clone())
    }

    /// The expert-parallel group's communicator.
    pub(crate) fn ep_comm(&self) -> &Arc<dyn Communicator> {
        &self.ep
    }

    /// The sequence-parallel group, for [`crate::sp`]'s ring attention.
    pub fn sp(&self) -> &crate::sp::SequenceParallel {
        &self.sp
    }

    /// The ranks holding the same parameters (the same stage and tensor-parallel piece): the
    /// `dp x sp` group over which the trainer averages gradients.
    pub fn replicas(&self) -> &Arc<dyn Communicator> {
        &self.replicas
    }

    /// With pipeline stages, every stage's replicas (`pp x dp x sp`: the same experts and
    /// tensor-parallel piece); `None` without.
    pub(crate) fn stage_replicas(&self) -> Option<&Arc<dyn Communicator>> {
        self.stage_replicas.as_ref()
    }

    /// The model-parallel group (Megatron's): the ranks that together hold one replica of the
    /// model, every stage and tensor-parallel piece of it (the same `dp` and `sp` coordinates).
    pub fn model_parallel(&self) -> &Arc<dyn Communicator> {
        &self.model
    }

    /// Collective over the model-parallel group: on its first rank (the first stage's member 0
    /// of its tensor-parallel group and of its expert-parallel group), a VarMap of the whole
    /// model's tensors under their names: each split variable put together from its
    /// tensor-parallel pieces, every pipeline stage's variables and every expert-parallel
    /// member's experts sent to it; `None` on the others. For an export such as
    /// `kolo::hf::CausalLm::save_pretrained` from that rank.
    pub fn whole_varmap(&self, varmap: &candle_nn::VarMap) -> Result<Option<candle_nn::VarMap>> {
        let Some(stage) = crate::tp::whole_varmap(varmap, &self.tp)? else { return Ok(None) };
        let Some(model) = self.gather_to_first(&self.pp, stage)? else { return Ok(None) };
        self.gather_to_first(&self.ep, model)
    }

    /// Collective over `group` (whose members hold different variables, and the same values of
    /// any they share): its first member gets every member's variables in `mine`; `None` on the
    /// others.
    fn gather_to_first(&self, group: &Arc<dyn Communicator>, mine: candle_nn::VarMap) -> Result<Option<candle_nn::VarMap>> {
        let (me, k) = (group.rank().get(), group.world_size().get());
        if me > 0 {
            // This member's tensors, as safetensors bytes, to the first.
            let tensors: Vec<(String, candle_core::Tensor)> =
                mine.data().lock().unwrap_or_else(|p| p.into_inner()).iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
            let bytes = safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None)
                .map_err(|e| Error::usage(self.global_rank, "Mesh::whole_varmap", e.to_string()))?;
            group.send(kolo_comm::BufRef::from(&[bytes.len() as i64][..]), kolo_base::Rank(0), 1)?;
            group.send(kolo_comm::BufRef::from(&bytes[..]), kolo_base::Rank(0), 2)?;
            return Ok(None);
        }
        for from in 1..k {
            let mut len = [0i64];
            group.recv(kolo_comm::BufMut::from(&mut len[..]), kolo_base::Rank(from), 1)?;
            let mut bytes = vec![0u8; len[0] as usize];
            group.recv(kolo_comm::BufMut::from(&mut bytes[..]), kolo_base::Rank(from), 2)?;
            let mut data = mine.data().lock().unwrap_or_else(|p| p.into_inner());
            for (name, t) in candle_core::safetensors::load_buffer(&bytes, &candle_core::Device::Cpu)? {
                // A parameter held by several (an output layer tied to the embedding on two
                // stages, the attention beside the experts) is the same on each: the first's stays.
                if let std::collections::hash_map::Entry::Vacant(e) = data.entry(name) {
                    e.insert(candle_core::Var::from_tensor(&t)?);
                }
            }
        }
        Ok(Some(mine))
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
