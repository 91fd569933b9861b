//! IMPALA: distributed reinforcement learning solves CartPole and the grid world.

/// IMPALA: 2 actor threads run CartPole-v0 on whatever policy they last saw (the learner is
/// several updates ahead: off-policy data) and never wait; V-trace corrects the lag; the mean
/// return of 100 episodes reaches 195 within 1.5 M learned-from environment steps (6 seeds
/// measured: 0.23-0.60 M). The 5 x 5 grid world is solved too.
#[test]
fn impala_solves_cartpole_and_the_grid_world() {
    use kolo_rl::impala::{run as impala, EnvKind, ImpalaConfig};
    let r = impala(&ImpalaConfig { max_env_steps: 1_500_000, ..ImpalaConfig::cartpole(2) }, &mut |_, _| {}).unwrap();
    assert!(r.solved_at.is_some() && r.mean_return >= 195.0, "CartPole not solved: {r:?}");
    assert!(r.max_lag >= 1 && r.mean_lag > 0.0, "the actors' policies lagged the learner's: {r:?}");
    assert!(r.env_steps >= r.learned_steps);
    let g = impala(
        &ImpalaConfig { env: EnvKind::Grid, target: Some(EnvKind::Grid.solved()), max_env_steps: 500_000, ..ImpalaConfig::cartpole(2) },
        &mut |_, _| {},
    )
    .unwrap();
    assert!(g.solved_at.is_some(), "grid world not solved: {g:?}");
}
