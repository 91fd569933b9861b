//! The models on candle's CUDA backend (a `--features cuda` build, run on a machine with a GPU):
//! the same initial parameters give the same loss and gradients as on the CPU, where the fused
//! CPU kernels are replaced by candle's composite ops; the gradient hooks DDP uses and the
//! in-place parameter writes of the optimizers work on GPU parameters.
#![cfg(feature = "cuda")]

use kolo_tensor::models::GptConfig;
use kolo_tensor::{build_model, Batch, GradSink, HookedView, ModelSpec, PlainView};
use std::sync::{Arc, Mutex};

fn batch(cfg: &GptConfig, b: usize, seed: u64) -> Batch {
    Batch::random_tokens(b, cfg.seq, cfg.vocab, seed)
}

fn images(n: usize, seed: u64) -> Batch {
    Batch::random_images(n, seed)
}

struct Collect(Mutex<Vec<(usize, Vec<f32>)>>);
impl GradSink for Collect {
    fn grad_ready(&self, idx: usize, grad: &[f32]) {
        self.0.lock().unwrap().push((idx, grad.to_vec()));
    }
}

/// Loss and flat gradients of `spec` (seed 0) on the current device.
fn loss_and_grads(spec: &ModelSpec, b: &Batch) -> (f32, Vec<f32>, Vec<f32>) {
    let m = build_model(spec, 0).unwrap();
    let loss = m.loss(b, &PlainView).unwrap();
    let l = loss.to_scalar::<f32>().unwrap();
    let grads = loss.backward().unwrap();
    let mut flat = vec![0f32; m.params().numel()];
    m.params().grads_into(&grads, &mut flat).unwrap();
    // The DDP hooks hand out the same gradients, one call per parameter.
    let sink = Arc::new(Collect(Mutex::new(Vec::new())));
    m.loss(b, &HookedView::new(sink.clone())).unwrap().backward().unwrap();
    let mut hooked = vec![0f32; flat.len()];
    let got = sink.0.lock().unwrap();
    assert_eq!(got.len(), m.params().len());
    for (i, g) in got.iter() {
        hooked[m.params().get(*i).range.clone()].copy_from_slice(g);
    }
    (l, flat, hooked)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum::<f64>().sqrt();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum::<f64>().sqrt();
    num / den.max(1e-30)
}

#[test]
fn models_on_cuda_match_the_cpu() {
    let g = GptConfig { vocab: 65, seq: 32, d_model: 64, n_head: 4, n_layer: 2, moe: None };
    let cases = [
        (ModelSpec::Gpt(g.clone()), batch(&g, 4, 1)),
        (ModelSpec::Mlp { input: 784, hidden: vec![64, 32], classes: 10 }, images(8, 2)),
        (ModelSpec::Cnn { channels: (4, 8), classes: 10 }, images(4, 3)),
    ];
    let cpu: Vec<_> = cases.iter().map(|(s, b)| loss_and_grads(s, b)).collect();
    kolo_tensor::set_device(kolo_tensor::parse_device("cuda:0").expect("a CUDA device"));
    for ((spec, b), (l0, g0, _)) in cases.iter().zip(&cpu) {
        let (l1, g1, h1) = loss_and_grads(spec, b);
        // f32 on both sides, different summation orders (cuBLAS, candle's reductions): the
        // loss agrees to ~1e-6 relative, the gradient vector to ~1e-5; bounds leave 10x room.
        assert!(((l1 - l0) / l0).abs() < 1e-5, "{spec:?}: loss {l1} on cuda vs {l0} on cpu");
        let e = rel(&g1, g0);
        assert!(e < 1e-4, "{spec:?}: gradient differs by {e:.2e} (relative L2)");
        assert_eq!(g1, h1, "{spec:?}: hooks on cuda see backward's gradients");
        println!("{spec:?}: loss {l0} (cpu) {l1} (cuda), gradient relative L2 difference {e:.2e}");
    }
    // Optimizers write parameters through the host copy; a view hands out the device's values
    // only after they reached it.
    let m = build_model(&ModelSpec::Gpt(g), 7).unwrap();
    let mut v = m.params().to_flat().unwrap();
    v.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 97) as f32 * 0.01);
    m.params().load(&v).unwrap();
    m.params().update_one(0, &mut |p| p.iter_mut().for_each(|x| *x += 1.0)).unwrap();
    let r0 = m.params().get(0).range.clone();
    v[r0].iter_mut().for_each(|x| *x += 1.0);
    assert_eq!(m.params().to_flat().unwrap(), v);
    let mut on_device = vec![0f32; v.len()];
    for (i, p) in m.params().iter().enumerate() {
        kolo_tensor::copy_f32(&kolo_tensor::ParamView::get(&PlainView, m.params(), i).unwrap(), &mut on_device[p.range.clone()]).unwrap();
    }
    assert_eq!(on_device, v, "the device holds what the host copy says");
    assert!(m.params().iter().all(|p| p.var.device().is_cuda()));
}
