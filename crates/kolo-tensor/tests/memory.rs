//! Activation checkpointing lowers the peak memory of a training step: measured with Kolo's
//! counting allocator (this test binary installs it), not estimated.

use kolo_base::alloc::{reset_peak, stats, CountingAlloc};
use kolo_base::Rng;
use kolo_tensor::models::GptConfig;
use kolo_tensor::{build_model, Batch, Input, ModelSpec, PlainView};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

#[test]
fn checkpointing_every_block_cuts_peak_activation_memory() {
    CountingAlloc::mark_installed();
    let cfg = GptConfig { vocab: 65, seq: 64, d_model: 64, n_head: 4, n_layer: 6, moe: None };
    let mut r = Rng::new(1);
    let (b, t) = (8, cfg.seq);
    let batch = Batch {
        input: Input::Tokens { ids: (0..b * t).map(|_| r.below(65) as u32).collect(), b, t },
        targets: (0..b * t).map(|_| r.below(65) as u32).collect(),
    };
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
