//! Environments: CartPole (OpenAI Gym's CartPole-v0 dynamics, 200-step episodes) and a small
//! grid world.

use kolo_base::Rng;

pub trait Env: Send {
    /// Values in an observation.
    fn obs_len(&self) -> usize;
    fn actions(&self) -> usize;
    /// Starts an episode; returns the first observation.
    fn reset(&mut self, rng: &mut Rng) -> Vec<f32>;
    /// Applies `action`; returns the next observation, the reward and whether the episode ended.
    fn step(&mut self, action: usize) -> (Vec<f32>, f32, bool);
}

/// Cart-pole balancing, Barto, Sutton and Anderson (1983), with Gym's constants: a reward of 1
/// per step until the pole leans past 12 degrees, the cart leaves +-2.4, or 200 steps pass.
/// Solved (v0) when the mean return over 100 consecutive episodes reaches 195.
#[derive(Clone, Debug, Default)]
pub struct CartPole {
    state: [f64; 4],
    steps: u32,
}

impl CartPole {
    pub const MAX_STEPS: u32 = 200;
    pub const SOLVED: f64 = 195.0;

    fn obs(&self) -> Vec<f32> {
        self.state.iter().map(|&v| v as f32).collect()
    }
}

impl Env for CartPole {
    fn obs_len(&self) -> usize {
        4
    }
    fn actions(&self) -> usize {
        2
    }
    fn reset(&mut self, rng: &mut Rng) -> Vec<f32> {
        for s in self.state.iter_mut() {
            *s = rng.next_f64() * 0.1 - 0.05;
        }
        self.steps = 0;
        self.obs()
    }
    fn step(&mut self, action: usize) -> (Vec<f32>, f32, bool) {
        const GRAVITY: f64 = 9.8;
        const MASS_CART: f64 = 1.0;
        const MASS_POLE: f64 = 0.1;
        const TOTAL_MASS: f64 = MASS_CART + MASS_POLE;
        const LENGTH: f64 = 0.5; // half the pole's length
        const POLE_MASS_LENGTH: f64 = MASS_POLE * LENGTH;
        const FORCE: f64 = 10.0;
        const TAU: f64 = 0.02;
        let [x, x_dot, theta, theta_dot] = self.state;
        let force = if action == 1 { FORCE } else { -FORCE };
        let (cos, sin) = (theta.cos(), theta.sin());
        let temp = (force + POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / TOTAL_MASS;
        let theta_acc = (GRAVITY * sin - cos * temp) / (LENGTH * (4.0 / 3.0 - MASS_POLE * cos * cos / TOTAL_MASS));
        let x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS;
        self.state = [x + TAU * x_dot, x_dot + TAU * x_acc, theta + TAU * theta_dot, theta_dot + TAU * theta_acc];
        self.steps += 1;
        let fallen = self.state[0].abs() > 2.4 || self.state[2].abs() > 12.0 * std::f64::consts::PI / 180.0;
        (self.obs(), 1.0, fallen || self.steps >= Self::MAX_STEPS)
    }
}

/// An n x n grid: start in one corner, +1 for reaching the opposite one, -0.01 per step, at
/// most 4n steps. Observation: the position one-hot.
#[derive(Clone, Debug)]
pub struct GridWorld {
    pub n: usize,
    pos: (usize, usize),
    steps: usize,
}

impl GridWorld {
    pub fn new(n: usize) -> GridWorld {
        GridWorld { n: n.max(2), pos: (0, 0), steps: 0 }
    }
    fn obs(&self) -> Vec<f32> {
        let mut o = vec![0f32; self.n * self.n];
        o[self.pos.0 * self.n + self.pos.1] = 1.0;
        o
    }
}

impl Env for GridWorld {
    fn obs_len(&self) -> usize {
        self.n * self.n
    }
    fn actions(&self) -> usize {
        4
    }
    fn reset(&mut self, _rng: &mut Rng) -> Vec<f32> {
        self.pos = (0, 0);
        self.steps = 0;
        self.obs()
    }
    fn step(&mut self, action: usize) -> (Vec<f32>, f32, bool) {
        let (r, c) = self.pos;
        self.pos = match action {
            0 => (r.saturating_sub(1), c),
            1 => ((r + 1).min(self.n - 1), c),
            2 => (r, c.saturating_sub(1)),
            _ => (r, (c + 1).min(self.n - 1)),
        };
        self.steps += 1;
        let goal = self.pos == (self.n - 1, self.n - 1);
        (self.obs(), if goal { 1.0 } else { -0.01 }, goal || self.steps >= 4 * self.n)
    }
}
