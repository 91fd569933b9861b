//! Activation checkpointing lowers the peak memory of a training step: measured with Kolo's
//! counting allocator (this test binary installs it), not estimated.

use kolo_base::alloc::{reset_peak, stats, CountingAlloc};
use kolo_base::Rng;
use kolo_tensor::models::GptConfig;
use kolo_tensor::{build_model, Batch, Input, ModelSpec, PlainView};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// The allocator's counts are the process's: the tests here measure one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the measurement to this test alone; a GPT of 6 blocks of width 64 and a batch of `b`
/// random sequences of `seq` tokens.
fn alone_with(seq: usize, b: usize, seed: u64) -> (std::sync::MutexGuard<'static, ()>, GptConfig, Batch) {
    let alone = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    CountingAlloc::mark_installed();
    let cfg = GptConfig { vocab: 65, seq, d_model: 64, n_head: 4, n_layer: 6, moe: None };
    let mut r = Rng::new(seed);
    let batch = Batch {
        input: Input::Tokens { ids: (0..b * seq).map(|_| r.below(65) as u32).collect(), b, t: seq },
        targets: (0..b * seq).map(|_| r.below(65) as u32).collect(),
    };
    (alone, cfg, batch)
}

#[test]
fn checkpointing_every_block_cuts_peak_activation_memory() {
    let (_alone, cfg, batch) = alone_with(64, 8, 1);
    let step_peak = |blocks: &[usize]| {
        let mut m = build_model(&ModelSpec::Gpt(cfg.clone()), 0).unwrap();
        m.set_checkpointing(blocks).unwrap();
        let before = stats().unwrap().live;
        reset_peak();
        let g = m.loss(&batch, &PlainView).unwrap().backward().unwrap();
        let peak = stats().unwrap().peak - before;
        drop(g);
        peak
    };
    let plain = step_peak(&[]);
    let all = step_peak(&[0, 1, 2, 3, 4, 5]);
    let half = step_peak(&[0, 2, 4]);
    eprintln!("peak above the model: plain {plain} B, half the blocks checkpointed {half} B, all {all} B");
    assert!(all * 2 < plain, "checkpointing all 6 blocks: {all} B vs {plain} B without");
    assert!(all < half && half < plain, "{all} < {half} < {plain}");
}

/// A checkpointed block keeps its input until backward and no copy of its parameters:
/// backward reads the variables again (under ZeRO-3 that read gathers them). What a forward of
/// 6 checkpointed blocks leaves held is below half the blocks' parameters (it kept a copy of
/// them until session 39, one per micro-batch in flight in a pipeline), and the gradients are
/// bitwise those without checkpointing.
#[test]
fn checkpointed_blocks_hold_no_parameter_copy() {
    let (_alone, cfg, batch) = alone_with(32, 4, 2);
    let run = |blocks: &[usize]| {
        let mut m = build_model(&ModelSpec::Gpt(cfg.clone()), 0).unwrap();
        m.set_checkpointing(blocks).unwrap();
        let before = stats().unwrap().live;
        let loss = m.loss(&batch, &PlainView).unwrap();
        let held = stats().unwrap().live - before;
        let g = loss.backward().unwrap();
        let grads: Vec<Vec<f32>> =
            m.params().iter().map(|p| g.get(p.var.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap()).collect();
        (held, grads)
    };
    // (A first run allocates the kernels' caches, which stay.)
    run(&[0, 1, 2, 3, 4, 5]);
    let (held, grads) = run(&[0, 1, 2, 3, 4, 5]);
    let (_, plain) = run(&[]);
    let block_bytes: usize = {
        let m = build_model(&ModelSpec::Gpt(cfg.clone()), 0).unwrap();
        m.param_groups().iter().flatten().map(|&i| m.params().get(i).range.len() * 4).sum()
    };
    eprintln!("held after the forward: {held} B; the blocks' parameters are {block_bytes} B");
    assert!(held < block_bytes / 2, "{held} B held after the forward: a copy of the blocks' parameters ({block_bytes} B)?");
    assert!(grads == plain, "the gradients differ from the blocks' without checkpointing");
}

/// Nor does a checkpointed block's backward copy its parameters: the recomputation's graph has
/// the variables themselves as its leaves. On short sequences, where the activations are small
/// beside the parameters, backward's peak with every block checkpointed stays within the
/// gradients backward returns (every parameter's, in the GradStore) plus two blocks'
/// parameters (1.6 measured: a block's recomputed gradients beside their packed concatenation;
/// 3.6 in session 39, when the parameters were packed, copied to a `Vec` and made variables).
#[test]
fn checkpointed_blocks_backward_copies_no_parameters() {
    let (_alone, cfg, batch) = alone_with(8, 1, 3);
    let mut m = build_model(&ModelSpec::Gpt(cfg.clone()), 0).unwrap();
    m.set_checkpointing(&[0, 1, 2, 3, 4, 5]).unwrap();
    let peak = || {
        let before = stats().unwrap().live;
        let loss = m.loss(&batch, &PlainView).unwrap();
        reset_peak();
        let g = loss.backward().unwrap();
        let peak = stats().unwrap().peak - before;
        drop(g);
        peak
    };
    // (A first run allocates the kernels' caches, which stay.)
    peak();
    let peak = peak();
    let all: usize = m.params().iter().map(|p| p.range.len() * 4).sum();
    let block: usize = m.param_groups()[0].iter().map(|&i| m.params().get(i).range.len() * 4).sum();
    eprintln!("backward's peak above the model {peak} B; every gradient {all} B, a block's parameters {block} B");
    assert!(peak < all + 2 * block, "backward's peak {peak} B: beyond the gradients ({all} B) by more than two blocks ({block} B each)");
}
