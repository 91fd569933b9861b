//! Local SGD and post-local SGD (Lin et al., 2020; torch's `PostLocalSGDOptimizer`): after
//! `warmup_steps` synchronous DDP steps, every rank steps on its own gradients and the models
//! are averaged every `every` steps. Plain DDP only (config validation refuses the rest).

use crate::config::LocalSgdConfig;
use crate::TrainError;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_tensor::ParamSet;

/// Whether `step` (0-based) is a local step: no gradient exchange.
pub fn is_local(cfg: Option<&LocalSgdConfig>, step: u64) -> bool {
    cfg.is_some_and(|l| step >= l.warmup_steps)
}

/// Whether the models are averaged after local step `step` (0-based): every `every`-th local
/// step, counted from the end of the warm-up.
pub fn averages_after(l: &LocalSgdConfig, step: u64) -> bool {
    step >= l.warmup_steps && (step + 1 - l.warmup_steps).is_multiple_of(l.every.max(1))
}

/// After local step `step`'s update: averages the models across `comm` when it is time.
/// Returns the bytes this rank sent (0 when the models were not averaged).
pub fn after_update(l: &LocalSgdConfig, step: u64, params: &ParamSet, comm: &dyn Communicator) -> Result<usize, TrainError> {
    if !averages_after(l, step) {
        return Ok(0);
    }
    let mut flat = params.to_flat()?;
    comm.all_reduce(BufMut::from(&mut flat), ReduceOp::Avg)?;
    params.load(&flat)?;
    Ok(flat.len() * 4)
}

/// Local SGD: between averagings each replica has its own model and optimizer state, so each
/// rank writes its own (`state.rank{r}.params`, `state.rank{r}.optim.{name}`) beside the
/// checkpoint's model (rank 0's).
pub fn local_model_pieces(
    params: &kolo_tensor::ParamSet,
    opt: &kolo_optim::Optimizer,
    rank: usize,
) -> Result<Vec<kolo_checkpoint::Piece>, TrainError> {
    let piece = |name: String, data: Vec<f32>| kolo_checkpoint::Piece { name, shape: vec![data.len()], offset: 0, data };
    let mut pieces = vec![piece(format!("state.rank{rank}.params"), params.to_flat()?)];
    pieces.extend(opt.state().into_iter().map(|(name, v)| piece(format!("state.rank{rank}.optim.{name}"), v.to_vec())));
    Ok(pieces)
}

/// Restores [`local_model_pieces`] of this rank into `flat` and `opt` when the checkpoint has
/// them for as many replicas; with another number of replicas every replica starts from replica 0's model,
/// and the returned note says so.
pub fn restore_local_model(
    r: &crate::checkpointing::Resumed,
    flat: &mut [f32],
    opt: &mut kolo_optim::Optimizer,
    rank: usize,
    world: usize,
) -> Result<Option<String>, TrainError> {
    let Some(own) = r.strategy_state.get(&format!("state.rank{rank}.params")) else { return Ok(None) };
    // The replicas that wrote their own models (the data-parallel group's ranks; on a mesh
    // with expert parallelism fewer than the ranks that read their own data).
    let written = (0..).take_while(|i| r.strategy_state.contains_key(&format!("state.rank{i}.params"))).count();
    if written != world {
        return Ok(Some(format!(
            "local SGD: the checkpoint holds the own models of {written} replicas; on {world} every replica starts from replica 0's"
        )));
    }
    if own.len() != flat.len() {
        return Err(TrainError::Data(format!(
            "rank {rank}'s own model in the checkpoint has {} values, the model {}",
            own.len(),
            flat.len()
        )));
    }
    flat.copy_from_slice(own);
    let states =
        opt.spec()
            .state_names()
            .iter()
            .map(|name| {
                let v = r.strategy_state.get(&format!("state.rank{rank}.optim.{name}")).ok_or_else(|| {
                    TrainError::Data(format!("rank {rank}'s own optimizer state `{name}` is missing from the checkpoint"))
                })?;
                Ok((*name, v.clone()))
            })
            .collect::<Result<Vec<_>, TrainError>>()?;
    opt.load_state(opt.steps(), &states).map_err(TrainError::Data)?;
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_steps_and_averaging_follow_the_warm_up_and_period() {
        let l = LocalSgdConfig { every: 3, warmup_steps: 2 };
        let local: Vec<bool> = (0..8).map(|s| is_local(Some(&l), s)).collect();
        assert_eq!(local, [false, false, true, true, true, true, true, true]);
        let avg: Vec<u64> = (0..12).filter(|&s| averages_after(&l, s)).collect();
        assert_eq!(avg, [4, 7, 10], "every 3rd local step after 2 warm-up steps");
        assert!(!is_local(None, 100));
        let every_step = LocalSgdConfig { every: 1, warmup_steps: 0 };
        assert!((0..5).all(|s| averages_after(&every_step, s)));
    }
}
