use super::*;
use crate::models::GptConfig;
use kolo_base::Rng;
use std::sync::Mutex;

fn image_batch(n: usize, seed: u64) -> Batch {
    Batch::random_images(n, seed)
}

fn token_batch(cfg: &GptConfig, b: usize, seed: u64) -> Batch {
    Batch::random_tokens(b, cfg.seq, cfg.vocab, seed)
}

fn small_specs() -> Vec<(ModelSpec, Batch)> {
    let gcfg = GptConfig { vocab: 11, seq: 8, d_model: 16, n_head: 2, n_layer: 2, moe: None };
    vec![
        (ModelSpec::Mlp { input: 784, hidden: vec![32, 16], classes: 10 }, image_batch(4, 1)),
        (ModelSpec::Cnn { channels: (4, 8), classes: 10 }, image_batch(3, 2)),
        (ModelSpec::Gpt(gcfg.clone()), token_batch(&gcfg, 2, 3)),
    ]
}

#[test]
fn every_trainable_variable_receives_a_gradient() {
    for (spec, batch) in small_specs() {
        let m = build_model(&spec, 0).unwrap();
        let loss = m.loss(&batch, &PlainView).unwrap();
        let grads = loss.backward().unwrap();
        let mut flat = vec![0f32; m.params().numel()];
        m.params().grads_into(&grads, &mut flat).unwrap_or_else(|e| panic!("{spec:?}: {e}"));
        for p in m.params().iter() {
            let g = &flat[p.range.clone()];
            assert!(g.iter().all(|x| x.is_finite()), "{}: non-finite gradient", p.name);
            assert!(g.iter().any(|x| *x != 0.0), "{spec:?}: {} has an all-zero gradient", p.name);
        }
    }
}

#[test]
fn benchmark_shapes_match_the_peers() {
    let mlp = build_model(&ModelSpec::Mlp { input: 784, hidden: vec![512, 512], classes: 10 }, 0).unwrap();
    assert_eq!(mlp.params().numel(), 669_706);
    let gpt = build_model(&ModelSpec::Gpt(GptConfig::bench()), 0).unwrap();
    assert_eq!(gpt.params().numel(), 3_225_665);
}

struct Collect(Mutex<Vec<(usize, Vec<f32>)>>);
impl GradSink for Collect {
    fn grad_ready(&self, idx: usize, grad: &[f32]) {
        self.0.lock().unwrap().push((idx, grad.to_vec()));
    }
}

#[test]
fn hooks_see_exactly_the_gradients_backward_computes() {
    for (spec, batch) in small_specs() {
        let m = build_model(&spec, 0).unwrap();
        let sink = std::sync::Arc::new(Collect(Mutex::new(Vec::new())));
        let view = HookedView::new(sink.clone());
        let hooked = m.loss(&batch, &view).unwrap().backward().unwrap();
        // The hook is the only receiver: candle keeps no parameter gradient of its own.
        assert!(m.params().iter().all(|p| hooked.get(p.var.as_tensor()).is_none()), "{spec:?}");
        let grads = m.loss(&batch, &PlainView).unwrap().backward().unwrap();
        let mut flat = vec![0f32; m.params().numel()];
        m.params().grads_into(&grads, &mut flat).unwrap();
        let got = sink.0.lock().unwrap();
        assert_eq!(got.len(), m.params().len(), "{spec:?}: one hook call per parameter");
        for (idx, g) in got.iter() {
            assert_eq!(&flat[m.params().get(*idx).range.clone()], &g[..], "{}", m.params().get(*idx).name);
        }
        // Backward completes the last layers first: the head's gradient arrives before the first layer's.
        assert!(got.first().unwrap().0 > got.last().unwrap().0, "{spec:?}: order {:?}", got.iter().map(|g| g.0).collect::<Vec<_>>());
    }
}

#[test]
fn flat_round_trip_and_in_place_load() {
    let m = build_model(&ModelSpec::Mlp { input: 784, hidden: vec![8], classes: 10 }, 5).unwrap();
    let mut v = m.params().to_flat().unwrap();
    v.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 * 0.001);
    m.params().load(&v).unwrap();
    assert_eq!(m.params().to_flat().unwrap(), v);
    assert!(m.params().load(&v[1..]).is_err());
}

#[test]
fn loss_at_init_is_near_log_classes() {
    let gcfg = GptConfig { vocab: 65, seq: 16, d_model: 32, n_head: 4, n_layer: 1, moe: None };
    let m = build_model(&ModelSpec::Gpt(gcfg.clone()), 0).unwrap();
    let l = m.loss(&token_batch(&gcfg, 2, 9), &PlainView).unwrap().to_scalar::<f32>().unwrap();
    assert!((l - (65f32).ln()).abs() < 0.2, "{l}");
}

/// Each fused op against its composite candle formulation: same values, same gradients.
#[test]
fn fused_ops_match_composite_ones() {
    use crate::ops::{causal_mask, layer_norm_composite, softmax_last};
    use candle_core::{Device, Var};
    let mut r = Rng::new(42);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| r.normal() as f32).collect() };
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "{what}: max difference {d}");
    };
    // Layer norm + bias add, with a weighted loss so every gradient is non-trivial.
    let x = Var::from_vec(rand(6 * 8), (2, 3, 8), &Device::Cpu).unwrap();
    let g = Var::from_vec(rand(8), 8, &Device::Cpu).unwrap();
    let b = Var::from_vec(rand(8), 8, &Device::Cpu).unwrap();
    let w = Tensor::from_vec(rand(6 * 8), (2, 3, 8), &Device::Cpu).unwrap();
    let f = crate::fused::bias_add(&crate::fused::layer_norm(&x, &g, &b, 1e-5).unwrap(), &b).unwrap();
    let c = layer_norm_composite(&x, &g, &b, 1e-5).unwrap().broadcast_add(&b).unwrap();
    close(&f, &c, "layer norm forward");
    let gf = (f * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (v, n) in [(&x, "dx"), (&g, "dgamma"), (&b, "dbeta")] {
        close(gf.get(v).unwrap(), gc.get(v).unwrap(), n);
    }
    // Causal softmax with scale.
    let t = 5;
    let s = Var::from_vec(rand(2 * t * t), (2, t, t), &Device::Cpu).unwrap();
    let w = Tensor::from_vec(rand(2 * t * t), (2, t, t), &Device::Cpu).unwrap();
    let f = crate::fused::causal_softmax(&s, 0.5).unwrap();
    let c = softmax_last(&(s.as_tensor() * 0.5).unwrap().broadcast_add(&causal_mask(t).unwrap()).unwrap()).unwrap();
    close(&f, &c, "causal softmax forward");
    let gf = (f * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &w).unwrap().sum_all().unwrap().backward().unwrap();
    close(gf.get(&s).unwrap(), gc.get(&s).unwrap(), "causal softmax backward");
    // GELU (erf).
    let x = Var::from_vec(rand(50), 50, &Device::Cpu).unwrap();
    let w = Tensor::from_vec(rand(50), 50, &Device::Cpu).unwrap();
    let f = crate::fused::gelu_erf(&x).unwrap();
    let c = x.as_tensor().gelu_erf().unwrap();
    close(&f, &c, "gelu forward");
    let gf = (f * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &w).unwrap().sum_all().unwrap().backward().unwrap();
    close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), "gelu backward");
}

/// Llama's fused ops (RMS norm, SwiGLU's product, rotary embedding) against candle's composite
/// formulations on odd sizes: same values and gradients within 1e-5.
#[test]
fn llama_fused_ops_match_composite_ones() {
    use candle_core::{DType, Device, Var, D};
    let mut r = Rng::new(7);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| r.normal() as f32).collect() };
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len(), "{what}");
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "{what}: max difference {d}");
    };
    let dev = &Device::Cpu;
    // RMS norm: 3 x 7 rows of 13 (no multiple of the 8 lanes), scaled by a weight.
    let x = Var::from_vec(rand(3 * 7 * 13), (3, 7, 13), dev).unwrap();
    let w = Var::from_vec(rand(13), 13, dev).unwrap();
    let m = Tensor::from_vec(rand(3 * 7 * 13), (3, 7, 13), dev).unwrap();
    let f = crate::fused::rms_norm(&x, &w, 1e-6).unwrap();
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let c = x.broadcast_div(&(ms + 1e-6).unwrap().sqrt().unwrap()).unwrap().broadcast_mul(&w).unwrap();
    close(&f, &c, "rms norm forward");
    let gf = (f * &m).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &m).unwrap().sum_all().unwrap().backward().unwrap();
    close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), "rms norm dx");
    close(gf.get(&w).unwrap(), gc.get(&w).unwrap(), "rms norm dw");
    // In bf16: normalised in f32, rounded, then scaled in bf16 (transformers' order).
    let (xb, wb) = (x.to_dtype(DType::BF16).unwrap(), w.to_dtype(DType::BF16).unwrap());
    let fb = crate::fused::rms_norm(&xb, &wb, 1e-6).unwrap();
    assert_eq!(fb.dtype(), DType::BF16);
    let x32 = xb.to_dtype(DType::F32).unwrap();
    let ms = x32.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let cb = x32.broadcast_div(&(ms + 1e-6).unwrap().sqrt().unwrap()).unwrap().to_dtype(DType::BF16).unwrap().broadcast_mul(&wb).unwrap();
    let (fb, cb) = (fb.to_dtype(DType::F32).unwrap(), cb.to_dtype(DType::F32).unwrap());
    let d = (fb - cb).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(d <= 0.0625, "bf16 rms norm: max difference {d} (one bf16 rounding of values below 8)");
    // silu(gate) * up on 37 elements.
    let g = Var::from_vec(rand(37), 37, dev).unwrap();
    let u = Var::from_vec(rand(37), 37, dev).unwrap();
    let m = Tensor::from_vec(rand(37), 37, dev).unwrap();
    let f = crate::fused::silu_mul(&g, &u).unwrap();
    let c = (g.silu().unwrap() * u.as_tensor()).unwrap();
    close(&f, &c, "silu_mul forward");
    let gf = (f * &m).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &m).unwrap().sum_all().unwrap().backward().unwrap();
    close(gf.get(&g).unwrap(), gc.get(&g).unwrap(), "silu_mul dgate");
    close(gf.get(&u).unwrap(), gc.get(&u).unwrap(), "silu_mul dup");
    // Rotary embedding: (2, 3, 7, 10) with tables of (7, 5).
    let (t, h) = (7, 5);
    let x = Var::from_vec(rand(2 * 3 * t * 2 * h), (2, 3, t, 2 * h), dev).unwrap();
    let cos = Tensor::from_vec(rand(t * h), (t, h), dev).unwrap();
    let sin = Tensor::from_vec(rand(t * h), (t, h), dev).unwrap();
    let m = Tensor::from_vec(rand(2 * 3 * t * 2 * h), (2, 3, t, 2 * h), dev).unwrap();
    let f = crate::fused::rope(&x, &cos, &sin).unwrap().unwrap();
    let (a, b) = (x.narrow(3, 0, h).unwrap(), x.narrow(3, h, h).unwrap());
    let half = Tensor::cat(&[&b.neg().unwrap(), &a], 3).unwrap();
    let (cc, ss) = (Tensor::cat(&[&cos, &cos], 1).unwrap(), Tensor::cat(&[&sin, &sin], 1).unwrap());
    let c = (x.broadcast_mul(&cc).unwrap() + half.broadcast_mul(&ss).unwrap()).unwrap();
    close(&f, &c, "rope forward");
    let gf = (f * &m).unwrap().sum_all().unwrap().backward().unwrap();
    let gc = (c * &m).unwrap().sum_all().unwrap().backward().unwrap();
    close(gf.get(&x).unwrap(), gc.get(&x).unwrap(), "rope dx");
    // Where it does not apply the caller is told so.
    assert!(crate::fused::rope(&x.to_dtype(DType::BF16).unwrap(), &cos, &sin).is_none());
}

/// The gemm-based linear and causal attention against candle's composite formulation, on odd
/// shapes (prime sizes, one row, one position), forward and every gradient.
#[test]
fn dense_ops_match_composite_ones() {
    use crate::ops::{causal_mask, linear_composite, softmax_last};
    use candle_core::{Device, Var};
    let mut r = Rng::new(7);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| r.normal() as f32).collect() };
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        assert_eq!(a.dims(), b.dims(), "{what}: shapes");
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        // Relative above 1: a weight gradient sums hundreds of rows (in blocks, another order).
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0f32, f32::max);
        assert!(d < 1e-4, "{what}: max difference {d}");
    };
    // (300, 5): the weight gradient's rows in more than one block.
    for dims in [vec![7, 5], vec![2, 3, 5], vec![1, 5], vec![5], vec![300, 5], vec![0, 5]] {
        let n: usize = dims.iter().product();
        let x = Var::from_vec(rand(n), dims.as_slice(), &Device::Cpu).unwrap();
        let w = Var::from_vec(rand(3 * 5), (3, 5), &Device::Cpu).unwrap();
        let b = Var::from_vec(rand(3), 3, &Device::Cpu).unwrap();
        let f = crate::dense::linear(&x, &w, &b).unwrap();
        let c = linear_composite(&x, &w, &b).unwrap();
        close(&f, &c, &format!("linear {dims:?} forward"));
        let m = Tensor::from_vec(rand(f.elem_count()), f.shape(), &Device::Cpu).unwrap();
        let gf = (f * &m).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = (c * &m).unwrap().sum_all().unwrap().backward().unwrap();
        for (v, what) in [(&x, "dx"), (&w, "dw"), (&b, "db")] {
            close(gf.get(v).unwrap(), gc.get(v).unwrap(), &format!("linear {dims:?} {what}"));
        }
    }
    // No inputs: every row is the bias.
    let b = Tensor::from_vec(vec![1f32, 2., 3.], 3, &Device::Cpu).unwrap();
    let empty = |r: usize, c: usize| Tensor::zeros((r, c), candle_core::DType::F32, &Device::Cpu).unwrap();
    close(
        &crate::dense::linear(&empty(4, 0), &empty(3, 0), &b).unwrap(),
        &b.unsqueeze(0).unwrap().repeat((4, 1)).unwrap(),
        "linear without inputs",
    );
    assert!(crate::dense::linear(
        &Tensor::zeros((2, 5), candle_core::DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros((3, 4), candle_core::DType::F32, &Device::Cpu).unwrap(),
        &Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap()
    )
    .is_err());
    // Attention: (batch, time, heads, head width) with a prime time, and a single position.
    for (b, t, h, d) in [(2, 7, 3, 4), (1, 1, 2, 3), (3, 13, 1, 5)] {
        let c = h * d;
        let qkv = Var::from_vec(rand(b * t * 3 * c), (b, t, 3 * c), &Device::Cpu).unwrap();
        let f = crate::dense::causal_attention(&qkv, h).unwrap();
        let head =
            |i: usize| qkv.narrow(2, i * c, c).unwrap().reshape((b, t, h, d)).unwrap().transpose(1, 2).unwrap().contiguous().unwrap();
        let (q, k, v) = (head(0), head(1), head(2));
        let s = (q.matmul(&k.t().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
        let p = softmax_last(&s.broadcast_add(&causal_mask(t).unwrap()).unwrap()).unwrap();
        let reference = p.matmul(&v).unwrap().transpose(1, 2).unwrap().contiguous().unwrap().reshape((b, t, c)).unwrap();
        close(&f, &reference, &format!("attention {b}x{t}x{h}x{d} forward"));
        let m = Tensor::from_vec(rand(b * t * c), (b, t, c), &Device::Cpu).unwrap();
        let gf = (f * &m).unwrap().sum_all().unwrap().backward().unwrap();
        let gc = (reference * &m).unwrap().sum_all().unwrap().backward().unwrap();
        close(gf.get(&qkv).unwrap(), gc.get(&qkv).unwrap(), &format!("attention {b}x{t}x{h}x{d} backward"));
    }
    let bad = Tensor::zeros((1, 2, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(crate::dense::causal_attention(&bad, 2).is_err(), "10 columns are not q, k, v of 2 heads");
}

#[test]
fn fast_exp_and_gelu_are_accurate() {
    let mut worst_exp = 0f64;
    let mut x = -80.0f32;
    while x < 80.0 {
        let want = (x as f64).exp();
        let got = crate::fused::exp_f32(x) as f64;
        worst_exp = worst_exp.max(((got - want) / want).abs());
        x += 0.01237;
    }
    assert!(worst_exp < 3e-7, "exp relative error {worst_exp}");
    // GELU against erf from libm in f64.
    let xs: Vec<f32> = (-1000..1000).map(|i| i as f32 * 0.01).collect();
    let t = Tensor::from_vec(xs.clone(), xs.len(), &candle_core::Device::Cpu).unwrap();
    let got: Vec<f32> = crate::fused::gelu_erf(&t).unwrap().to_vec1().unwrap();
    for (x, g) in xs.iter().zip(got) {
        let x = *x as f64;
        let want = 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2));
        assert!((g as f64 - want).abs() < 2e-6 * (1.0 + x.abs()), "gelu({x}) = {g}, want {want}");
    }
}

/// Activation checkpointing recomputes exactly what the plain graph computes: same loss, same
/// gradient for every parameter, through the GradStore and through gradient hooks.
#[test]
fn checkpointed_blocks_give_the_plain_gradients() {
    let gcfg = GptConfig { vocab: 13, seq: 8, d_model: 16, n_head: 2, n_layer: 3, moe: None };
    let batch = token_batch(&gcfg, 3, 7);
    let plain = build_model(&ModelSpec::Gpt(gcfg.clone()), 4).unwrap();
    let mut ck = build_model(&ModelSpec::Gpt(gcfg.clone()), 4).unwrap();
    ck.set_checkpointing(&[0, 2]).unwrap();
    let grads = |m: &dyn Model| {
        let l = m.loss(&batch, &PlainView).unwrap();
        let g = l.backward().unwrap();
        let mut flat = vec![0f32; m.params().numel()];
        m.params().grads_into(&g, &mut flat).unwrap();
        (l.to_scalar::<f32>().unwrap(), flat)
    };
    let (l1, g1) = grads(&*plain);
    let (l2, g2) = grads(&*ck);
    assert_eq!(l1, l2, "the forward is the same computation");
    let worst = g1.iter().zip(&g2).map(|(a, b)| (a - b).abs() / (a.abs() + 1e-3)).fold(0f32, f32::max);
    assert!(worst < 1e-5, "relative gradient difference {worst}");
    // Through hooks (what DDP uses): every parameter reported once, same values.
    let sink = std::sync::Arc::new(Collect(Mutex::new(Vec::new())));
    ck.loss(&batch, &HookedView::new(sink.clone())).unwrap().backward().unwrap();
    let got = sink.0.lock().unwrap();
    assert_eq!(got.len(), ck.params().len());
    for (idx, g) in got.iter() {
        assert_eq!(&g2[ck.params().get(*idx).range.clone()], &g[..], "{}", ck.params().get(*idx).name);
    }
    assert!(ck.set_checkpointing(&[3]).unwrap_err().to_string().contains("block 3 does not exist"));
    let mut mlp = build_model(&ModelSpec::Mlp { input: 784, hidden: vec![8], classes: 10 }, 0).unwrap();
    assert!(mlp.set_checkpointing(&[0]).is_err());
}

/// Mixed precision: computing in bf16 or f16 (f32 parameters, half-precision copies from the
/// hook, f32 loss) gives the f32 loss and gradients to half precision, for every model.
#[test]
fn half_precision_compute_tracks_f32() {
    for (spec, batch) in small_specs() {
        let m = build_model(&spec, 0).unwrap();
        let run = |dtype: candle_core::DType| {
            let sink = std::sync::Arc::new(Collect(Mutex::new(Vec::new())));
            let l = m.loss(&batch, &HookedView { sink: sink.clone(), dtype }).unwrap();
            assert_eq!(l.dtype(), candle_core::DType::F32, "the loss is computed in f32");
            l.backward().unwrap();
            let mut flat = vec![0f32; m.params().numel()];
            for (i, g) in sink.0.lock().unwrap().iter() {
                flat[m.params().get(*i).range.clone()].copy_from_slice(g);
            }
            (l.to_scalar::<f32>().unwrap(), flat)
        };
        let (l32, g32) = run(candle_core::DType::F32);
        let scale = g32.iter().map(|x| x.abs()).fold(0f32, f32::max);
        for dt in [candle_core::DType::BF16, candle_core::DType::F16] {
            let (l, g) = run(dt);
            assert!((l - l32).abs() < 0.02 * l32.abs().max(1.0), "{spec:?} {dt:?}: loss {l} vs {l32}");
            let worst = g.iter().zip(&g32).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 0.05 * scale, "{spec:?} {dt:?}: gradient error {worst} (largest gradient {scale})");
        }
        let _ = CastView(candle_core::DType::BF16).get(m.params(), 0).unwrap();
    }
}

mod moe {
    use super::*;
    use crate::models::moe::{aux_loss_value, capacity, load_cv, route, MoeConfig};

    fn moe_cfg(experts: usize, top_k: usize, capacity_factor: f64) -> GptConfig {
        GptConfig {
            vocab: 11,
            seq: 8,
            d_model: 16,
            n_head: 2,
            n_layer: 2,
            moe: Some(MoeConfig {
                experts,
                top_k,
                renormalize: top_k > 1,
                capacity_factor,
                aux_weight: 0.01,
                scoring: Default::default(),
                groups: None,
            }),
        }
    }

    #[test]
    fn routing_takes_the_top_k_and_first_choices_win_the_capacity() {
        // 4 tokens, 3 experts.
        let probs = [
            0.7, 0.2, 0.1, //
            0.6, 0.3, 0.1, //
            0.1, 0.3, 0.6, //
            0.5, 0.5, 0.0, // a tie: the lower index first
        ];
        let r = route(&probs, 4, 3, 1, 10);
        assert_eq!(r.choices, vec![0, 0, 2, 0]);
        assert_eq!(r.counts, vec![3, 0, 1]);
        assert_eq!(r.kept, vec![(0, 0), (1, 0), (3, 0), (2, 2)], "ordered by expert, then arrival");
        assert_eq!(r.dropped, 0);
        // Capacity 2: token 3's first choice (expert 0) is the third and is dropped.
        let r = route(&probs, 4, 3, 1, 2);
        assert_eq!((r.counts.clone(), r.dropped), (vec![2, 0, 1], 1));
        // Top-2 with capacity 2: every first choice is placed before any second choice, so
        // token 3's first choice (expert 0, third in line) is dropped, its second (1) is kept.
        let r = route(&probs, 4, 3, 2, 2);
        assert_eq!(r.choices, vec![0, 1, 0, 1, 2, 1, 0, 1]);
        assert_eq!(r.kept, vec![(0, 0), (1, 0), (0, 1), (1, 1), (2, 2)]);
        assert_eq!(r.dropped, 3, "token 3 at expert 0, tokens 2 and 3 at expert 1");
        assert_eq!(capacity(128, 4, 1, 1.25), 40);
        assert_eq!(capacity(10, 4, 2, 1.0), 5);
        assert_eq!(capacity(1, 64, 1, 1.0), 1, "at least one slot");
        assert_eq!(capacity(0, 4, 1, 1.0), 0);
    }

    /// DeepSeek's group-limited routing: 6 experts in 3 groups of 2, one token, top 2 within
    /// the best 2 groups; V2's rule scores a group by its best expert, V3's by the sum of its
    /// two best (after the selection bias), and the bias changes the choice, not the scores.
    #[test]
    fn group_limited_routing_chooses_within_the_best_groups() {
        use crate::models::moe::{route_within, ExpertGroups, MoeConfig, Scoring};
        let g = |top_groups| ExpertGroups { groups: 3, top_groups };
        // Groups {0, 1}, {2, 3}, {4, 5}: best experts 0.9, 0.5, 0.6; sums of two 0.9, 1.0, 1.05.
        let scores = [0.9, 0.0, 0.5, 0.5, 0.6, 0.45];
        let r = route_within(&scores, None, None, 1, 6, 2, 10);
        assert_eq!(r.choices, vec![0, 4], "without groups: the two best");
        let r = route_within(&scores, None, Some((g(1), false)), 1, 6, 2, 10);
        assert_eq!(r.choices, vec![0, 1], "by best expert, the best group: group 0");
        let r = route_within(&scores, None, Some((g(2), true)), 1, 6, 2, 10);
        assert_eq!(r.choices, vec![4, 2], "by the sum of two, the best 2 groups: 2 and 1");
        // A bias of +0.3 on expert 1 lifts group 0 (sum 1.2) above group 1: experts 0 and 4.
        let bias = [0.0, 0.3, 0.0, 0.0, 0.0, 0.0];
        let r = route_within(&scores, Some(&bias), Some((g(2), true)), 1, 6, 2, 10);
        assert_eq!(r.choices, vec![0, 4]);
        let cfg = |groups, top_groups, scoring| MoeConfig {
            experts: 6,
            top_k: 2,
            renormalize: true,
            capacity_factor: 1.0,
            aux_weight: 0.0,
            scoring,
            groups: Some(ExpertGroups { groups, top_groups }),
        };
        assert!(cfg(3, 2, Scoring::Sigmoid).check().is_ok());
        for (groups, top, scoring) in
            [(4, 2, Scoring::Softmax), (6, 1, Scoring::Sigmoid), (3, 0, Scoring::Softmax), (6, 1, Scoring::Softmax)]
        {
            let e = cfg(groups, top, scoring).check().unwrap_err();
            assert!(e.contains("the groups must split the experts evenly"), "{groups} groups, best {top}: {e}");
        }
    }

    #[test]
    fn aux_loss_is_its_weight_when_perfectly_balanced_and_larger_otherwise() {
        let e = 4;
        let even = vec![0.25; e];
        assert!((aux_loss_value(&even, &even, 0.01) - 0.01).abs() < 1e-12);
        let skewed = [1.0, 0.0, 0.0, 0.0];
        assert!((aux_loss_value(&skewed, &skewed, 0.01) - 0.04).abs() < 1e-12);
        assert_eq!(load_cv(&[5, 5, 5, 5]), 0.0);
        assert!((load_cv(&[2, 0, 2, 0]) - 1.0).abs() < 1e-12);
    }

    /// Every parameter gets a finite gradient (experts that receive no token: zeros), so DDP's
    /// gradient hooks fire for all of them; the loss adds the auxiliary term.
    #[test]
    fn every_expert_gets_a_gradient_even_without_tokens() {
        for (k, cf) in [(1, 0.3), (2, 1.0), (1, 8.0)] {
            let cfg = moe_cfg(8, k, cf);
            let m = build_model(&ModelSpec::Gpt(cfg.clone()), 0).unwrap();
            let batch = token_batch(&cfg, 1, 4);
            let loss = m.loss(&batch, &PlainView).unwrap();
            let ce = crate::models::targets_loss(&m.forward(&batch.input, &PlainView).unwrap(), &batch.targets).unwrap();
            let aux = loss.to_scalar::<f32>().unwrap() - ce.to_scalar::<f32>().unwrap();
            // Two layers, each weight x E x sum f P in [weight, weight x E].
            assert!((0.019..=0.161).contains(&aux), "top-{k}: auxiliary loss {aux}");
            let grads = loss.backward().unwrap();
            let mut flat = vec![0f32; m.params().numel()];
            m.params().grads_into(&grads, &mut flat).unwrap();
            assert!(flat.iter().all(|x| x.is_finite()));
            let load = m.take_moe_load().unwrap();
            assert_eq!(load.load.len(), 8);
            assert_eq!(load.assigned, 2 * 8 * k as u64, "2 layers x 8 tokens x k");
            assert_eq!(load.load.iter().sum::<u64>() + load.dropped, load.assigned);
            if cf < 1.0 {
                assert!(load.dropped > 0, "capacity factor {cf} drops tokens");
            }
            assert_eq!(m.take_moe_load().unwrap().assigned, 0, "taking resets the counts");
        }
    }

    /// Central differences of the loss against backward's gradient for the gate and an
    /// expert's weights (routing does not change under the small perturbation).
    #[test]
    fn moe_gradients_match_finite_differences() {
        for k in [1, 2] {
            let cfg = moe_cfg(4, k, 2.0);
            let m = build_model(&ModelSpec::Gpt(cfg.clone()), 7).unwrap();
            let batch = token_batch(&cfg, 2, 9);
            let loss = m.loss(&batch, &PlainView).unwrap();
            let grads = loss.backward().unwrap();
            let mut g = vec![0f32; m.params().numel()];
            m.params().grads_into(&grads, &mut g).unwrap();
            let base = m.params().to_flat().unwrap();
            let names = ["blocks.0.moe.gate.weight", "blocks.1.moe.experts.2.fc.weight", "blocks.0.moe.experts.0.fc_out.bias"];
            for name in names {
                let p = m.params().iter().find(|p| p.name == name).unwrap();
                // The entry with the largest gradient: best signal over f32 rounding.
                let i = p.range.clone().max_by(|&a, &b| g[a].abs().total_cmp(&g[b].abs())).unwrap();
                let eps = 1e-2f32;
                let at = |d: f32| -> f64 {
                    let mut v = base.clone();
                    v[i] += d;
                    m.params().load(&v).unwrap();
                    f64::from(m.loss(&batch, &PlainView).unwrap().to_scalar::<f32>().unwrap())
                };
                let fd = (at(eps) - at(-eps)) / (2.0 * f64::from(eps));
                m.params().load(&base).unwrap();
                let rel = (fd - f64::from(g[i])).abs() / f64::from(g[i]).abs().max(1e-3);
                assert!(rel < 0.05, "top-{k} {name}[{i}]: backward {} vs finite difference {fd}", g[i]);
            }
        }
    }
}

/// The tensor-parallel block's fused operations equal the f and g they replace, bit for bit:
/// the norms with f folded in (`layer_norm_copied`, `rms_norm_copied`) against the norm
/// followed by `CopyToGroup`,
/// and the residual with the replicated bias (`residual_bias_add`) against `x + (y + b)`. The
/// group stands for a second member whose gradient differs from this one's (its sum adds a
/// fixed vector), so a backward that skips the sum, or sums twice, fails.
#[test]
fn tensor_parallel_fused_ops_equal_f_and_g() {
    use candle_core::{Device, Var};
    use std::sync::Arc;
    struct OtherMember(Vec<f32>);
    impl kolo_base::GroupSum for OtherMember {
        fn rank(&self) -> usize {
            0
        }
        fn size(&self) -> usize {
            2
        }
        fn sum(&self, buf: &mut [f32]) -> std::result::Result<(), String> {
            buf.iter_mut().zip(self.0.iter().cycle()).for_each(|(b, o)| *b += o);
            Ok(())
        }
    }
    let mut r = Rng::new(7);
    let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| r.normal() as f32).collect() };
    let (rows, c) = (3 * 5, 11);
    let group: Arc<dyn kolo_base::GroupSum> = Arc::new(OtherMember(rand(rows * c)));
    let same = |a: &Tensor, b: &Tensor, what: &str| {
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            panic!("{what}: element {i} is {} against {}", a[i], b[i]);
        }
    };
    let x = Var::from_vec(rand(rows * c), (3, 5, c), &Device::Cpu).unwrap();
    let g = Var::from_vec(rand(c), c, &Device::Cpu).unwrap();
    let b = Var::from_vec(rand(c), c, &Device::Cpu).unwrap();
    let w = Tensor::from_vec(rand(rows * c), (3, 5, c), &Device::Cpu).unwrap();
    let fused = crate::fused::layer_norm_copied(&x, &g, &b, 1e-5, &group).unwrap();
    let plain = crate::fused::layer_norm(&x, &g, &b, 1e-5).unwrap().apply_op1(crate::models::tp::CopyToGroup(group.clone())).unwrap();
    same(&fused, &plain, "norm and f forward");
    let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gp = (plain * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (v, n) in [(&x, "dx"), (&g, "dgamma"), (&b, "dbeta")] {
        same(gf.get(v).unwrap(), gp.get(v).unwrap(), n);
    }
    let fused = crate::fused::rms_norm_copied(&x, &g, 1e-5, &group).unwrap();
    let plain = crate::fused::rms_norm(&x, &g, 1e-5).unwrap().apply_op1(crate::models::tp::CopyToGroup(group.clone())).unwrap();
    same(&fused, &plain, "RMS norm and f forward");
    let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gp = (plain * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (v, n) in [(&x, "RMS dx"), (&g, "RMS dweight")] {
        same(gf.get(v).unwrap(), gp.get(v).unwrap(), n);
    }
    let y = Var::from_vec(rand(rows * c), (3, 5, c), &Device::Cpu).unwrap();
    let fused = crate::fused::residual_bias_add(&x, &y, &b).unwrap();
    let plain = (x.as_tensor() + y.broadcast_add(&b).unwrap()).unwrap();
    same(&fused, &plain, "residual bias add forward");
    let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
    let gp = (plain * &w).unwrap().sum_all().unwrap().backward().unwrap();
    for (v, n) in [(&x, "dx"), (&y, "dy")] {
        same(gf.get(v).unwrap(), gp.get(v).unwrap(), n);
    }
    // The bias's gradient: candle sums the broadcast rows in its own order.
    let (db, dp): (Vec<f32>, Vec<f32>) = (gf.get(&b).unwrap().to_vec1().unwrap(), gp.get(&b).unwrap().to_vec1().unwrap());
    assert!(db.iter().zip(&dp).all(|(a, b)| (a - b).abs() < 1e-5), "dbias: {db:?} against {dp:?}");
}

/// A tensor-parallel member's index map, kept as runs, gathers and scatters exactly as the
/// element-by-element map it replaces, for every cut of odd shapes and over partial ranges.
#[test]
fn index_runs_equal_the_element_map() {
    use crate::models::tp::{piece, Cut};
    use crate::models::IndexRuns;
    let shapes: [(&[usize], Cut); 5] =
        [(&[7, 6], Cut::Cols), (&[12, 5], Cut::Rows { blocks: 3 }), (&[13], Cut::Vocab), (&[9, 4], Cut::Vocab), (&[5, 3], Cut::Whole)];
    let whole: Vec<f32> = (0..(42 + 60 + 13 + 36 + 15)).map(|i| i as f32 * 0.5 - 3.0).collect();
    for r in 0..2 {
        let (mut runs, mut map, mut at) = (IndexRuns::default(), Vec::new(), 0);
        for (shape, cut) in shapes {
            let idx: Vec<usize> = piece(shape, cut, r, 2).unwrap().into_iter().map(|k| k + at).collect();
            runs.extend(idx.iter().copied());
            map.extend(idx);
            at += shape.iter().product::<usize>();
        }
        let local: Vec<f32> = map.iter().map(|&k| whole[k]).collect();
        assert_eq!(runs.gather(&whole), local, "member {r}: gather");
        for range in [0..local.len(), 0..0, 3..17, 20..local.len(), 5..6] {
            let (mut got, mut want) = (vec![0f32; whole.len()], vec![0f32; whole.len()]);
            runs.scatter(&local, range.clone(), &mut got);
            range.clone().for_each(|k| want[map[k]] = local[k]);
            assert_eq!(got, want, "member {r}: scatter {range:?}");
        }
    }
}

/// A tensor-parallel GPT's [`Model::tensor_parallel_splits`] (what the library's trainer is
/// told of each piece) name the elements the member holds: for every cut of odd shapes and
/// every member of 1 to 3, the split's indices in the whole tensor are the piece's; and each
/// parameter of a GPT split over 3 members has its split's piece shape, with the whole
/// model's shape, and is whole where it is not cut.
#[test]
fn tensor_parallel_splits_name_the_pieces_elements() {
    use crate::models::tp::{piece, split_of_cut, Cut};
    let shapes: [(&[usize], Cut); 5] = [
        (&[7, 6], Cut::Cols),
        (&[18, 5], Cut::Rows { blocks: 3 }),
        (&[13], Cut::Vocab),
        (&[9, 4], Cut::Vocab),
        (&[6], Cut::Rows { blocks: 1 }),
    ];
    for p in 1..=3 {
        for r in 0..p {
            for (shape, cut) in shapes {
                let split = split_of_cut(shape, cut, r, p).expect("a cut tensor");
                let want = piece(shape, cut, r, p).unwrap();
                assert_eq!(split.whole_indices().collect::<Vec<_>>(), want, "{shape:?} {cut:?}, member {r} of {p}");
                assert_eq!(split.piece_shape().iter().product::<usize>(), want.len(), "{shape:?} {cut:?}: piece shape");
            }
            assert_eq!(split_of_cut(&[5, 3], Cut::Whole, r, p), None);
        }
    }
    struct Member(usize);
    impl kolo_base::GroupSum for Member {
        fn rank(&self) -> usize {
            self.0
        }
        fn size(&self) -> usize {
            3
        }
        fn sum(&self, _: &mut [f32]) -> std::result::Result<(), String> {
            Ok(())
        }
    }
    let cfg = GptConfig { vocab: 65, seq: 8, d_model: 12, n_head: 3, n_layer: 2, moe: None };
    let whole = crate::models::Gpt::new(cfg.clone(), &mut Rng::new(3)).unwrap();
    for r in 0..3 {
        let gpt = crate::models::Gpt::new_tensor_parallel(cfg.clone(), &mut Rng::new(3), std::sync::Arc::new(Member(r))).unwrap();
        let splits = gpt.tensor_parallel_splits().expect("a split model");
        let values = whole.params().to_flat().unwrap();
        let mut cut = 0;
        for ((p, w), s) in gpt.params().iter().zip(whole.params().iter()).zip(&splits) {
            let mine: Vec<f32> = p.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let from_whole: Vec<f32> = match s {
                Some(s) => {
                    cut += 1;
                    assert_eq!((&s.whole, s.piece_shape()), (&w.shape, p.shape.clone()), "`{}`: shapes", p.name);
                    s.whole_indices().map(|k| values[w.range.start + k]).collect()
                }
                None => values[w.range.clone()].to_vec(),
            };
            assert_eq!(mine, from_whole, "`{}`, member {r}: the split names other elements", p.name);
        }
        // Per block: q|k|v (weight, bias), the projection's weight, the MLP's two weights and
        // first bias; the embedding and the head (weight, bias).
        assert_eq!(cut, 2 * 6 + 3, "member {r}: the cut parameters");
    }
}

/// The vocabulary splits into contiguous ranges covering it once, the first v % p one longer.
#[test]
fn vocabulary_ranges_cover_the_vocabulary_once() {
    use crate::models::tp::vocab_range;
    for v in [1usize, 2, 13, 65, 64] {
        for p in 1..=4usize.min(v) {
            let rs: Vec<_> = (0..p).map(|r| vocab_range(v, p, r)).collect();
            assert_eq!(rs[0].start, 0);
            assert_eq!(rs[p - 1].end, v);
            for w in rs.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() >= w[1].len() && w[0].len() <= w[1].len() + 1);
            }
        }
    }
    assert_eq!(vocab_range(65, 4, 0), 0..17);
    assert_eq!(vocab_range(65, 4, 3), 49..65);
}

/// A residual MLP block over `(w1, b1, w2)`, as a user's model would write one.
fn residual_block(x: &Tensor, w1: &Tensor, b1: &Tensor, w2: &Tensor) -> candle_core::Result<Tensor> {
    let h = x.broadcast_matmul(w1)?.broadcast_add(b1)?.gelu()?;
    let z = (x + h.broadcast_matmul(w2)?)?;
    // RMS norm, as Llama's blocks end.
    z.broadcast_div(&(z.sqr()?.mean_keepdim(candle_core::D::Minus1)? + 1e-5)?.sqrt()?)
}

/// An embedding-like input (tracked, so the blocks pass a gradient back to it), three residual
/// blocks, some of them checkpointed, and a loss: the loss and every variable's gradient.
fn stack(dtype: CandleDType, checkpointed: [bool; 3]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (d, f) = (7, 13);
    let var = |shape: &[usize], seed: u64| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.37 + seed as f64 * 1.7).sin() * 0.4) as f32).collect();
        candle_core::Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
    };
    let emb = var(&[3, 5, d], 0);
    let blocks: Vec<[candle_core::Var; 3]> = (0..3).map(|b| [var(&[d, f], 10 + b), var(&[f], 20 + b), var(&[f, d], 30 + b)]).collect();
    let mut x = (emb.as_tensor() * 1.5).unwrap();
    for (b, on) in blocks.iter().zip(checkpointed) {
        let [w1, b1, w2] = [b[0].as_tensor().clone(), b[1].as_tensor().clone(), b[2].as_tensor().clone()];
        x = match on {
            true => crate::checkpoint::checkpoint(&x, move |x| residual_block(x, &w1, &b1, &w2)).unwrap(),
            false => residual_block(&x, &w1, &b1, &w2).unwrap(),
        };
    }
    // A loss that moves with every element (a mean square would not: the blocks end normed).
    let c: Vec<f32> = (0..3 * 5 * d).map(|i| (i as f32 * 0.61).cos()).collect();
    let c = Tensor::from_vec(c, (3, 5, d), &Device::Cpu).unwrap();
    let loss = x.to_dtype(CandleDType::F32).unwrap().mul(&c).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let all = std::iter::once(&emb).chain(blocks.iter().flatten());
    let g = all
        .map(|v| grads.get(v.as_tensor()).unwrap().to_dtype(CandleDType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap())
        .collect();
    (vec![loss.to_scalar::<f32>().unwrap()], g)
}

/// `kolo_tensor::checkpoint` on a user-style block found its variables itself, and gives the
/// loss and every gradient (the blocks' variables, and the input's through the blocks)
/// bitwise as the same blocks without it, in f32 and bf16, whichever blocks are checkpointed.
#[test]
fn checkpointed_blocks_give_the_plain_gradients_bitwise() {
    for dtype in [CandleDType::F32, CandleDType::BF16] {
        let plain = stack(dtype, [false; 3]);
        for on in [[true, false, true], [true; 3], [false, true, false]] {
            let ck = stack(dtype, on);
            assert_eq!(ck.0, plain.0, "{dtype:?} {on:?}: loss");
            for (i, (a, b)) in ck.1.iter().zip(&plain.1).enumerate() {
                assert!(
                    a == b,
                    "{dtype:?} {on:?}: gradient {i} differs by {}",
                    a.iter().zip(b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max)
                );
            }
        }
        assert!(plain.1.iter().all(|g| g.iter().any(|v| v.abs() > 1e-2)), "every gradient is far from 0");
    }
}

/// After the forward a checkpointed block's graph holds its input, the packed variables and
/// the variables themselves, none of the block's intermediate activations; the plain block's
/// holds every one of them.
#[test]
fn a_checkpointed_block_keeps_no_intermediate_activation() {
    let w1 = candle_core::Var::randn(0f32, 0.3, (8, 32), &Device::Cpu).unwrap();
    let w2 = candle_core::Var::randn(0f32, 0.3, (32, 8), &Device::Cpu).unwrap();
    let x = candle_core::Var::randn(0f32, 1.0, (4, 8), &Device::Cpu).unwrap();
    let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
    let block = move |x: &Tensor| x + x.matmul(&a)?.gelu()?.matmul(&b)?.tanh()?;
    let plain = block(x.as_tensor()).unwrap();
    let ck = crate::checkpoint::checkpoint(x.as_tensor(), block).unwrap();
    assert_eq!(ck.to_vec2::<f32>().unwrap(), plain.to_vec2::<f32>().unwrap());
    let kept = |y: &Tensor| y.sorted_nodes().iter().filter(|n| !n.is_variable() && n.dims() != [4, 8]).count();
    // Plain: the products (4, 32) twice (before and after gelu); checkpointed: the packed
    // variables, their flattened views and casts, nothing of shape (4, 32).
    let shaped = |y: &Tensor, d: &[usize]| y.sorted_nodes().iter().filter(|n| n.dims() == d).count();
    assert_eq!((shaped(&plain, &[4, 32]), shaped(&ck, &[4, 32])), (2, 0));
    assert!(kept(&ck) <= 6, "{} nodes kept besides the variables and (4, 8) tensors", kept(&ck));
}

/// A block that reads another variable when run again (it does not compute the same thing
/// twice) fails backward with that reason instead of losing the variable's gradient.
#[test]
fn a_block_that_changes_between_forward_and_backward_fails_backward() {
    let (w1, w2) = (
        candle_core::Var::ones((4, 4), CandleDType::F32, &Device::Cpu).unwrap(),
        candle_core::Var::ones((4, 4), CandleDType::F32, &Device::Cpu).unwrap(),
    );
    let x = candle_core::Var::ones((2, 4), CandleDType::F32, &Device::Cpu).unwrap();
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let (a, b) = (w1.as_tensor().clone(), w2.as_tensor().clone());
    let y = crate::checkpoint::checkpoint(x.as_tensor(), move |x| {
        let w = if runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 { &a } else { &b };
        x.matmul(w)
    })
    .unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("read a variable") && e.contains("its forward did not"), "{e}");
}

/// `checkpoint_many`: a block with three outputs of two dtypes (the hidden states in the
/// model's dtype, an f32 auxiliary loss and f32 per-feature sums, as a mixture-of-experts layer
/// returns its output, auxiliary loss and gate probabilities), each feeding the loss, gives
/// every gradient bitwise as the plain block, in f32 and bf16.
#[test]
fn a_checkpointed_block_of_several_outputs_gives_the_plain_gradients_bitwise() {
    let run = |dtype: CandleDType, ckpt: bool| -> Vec<Vec<f32>> {
        let var = |shape: &[usize], seed: u64| {
            let n: usize = shape.iter().product();
            let v: Vec<f32> = (0..n).map(|i| ((i as f64 * 0.53 + seed as f64).cos() * 0.5) as f32).collect();
            candle_core::Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap()
        };
        let (x, w, v) = (var(&[5, 6], 1), var(&[6, 11], 2), var(&[11, 6], 3));
        let (wt, vt) = (w.as_tensor().clone(), v.as_tensor().clone());
        let block = move |x: &Tensor| -> candle_core::Result<Vec<Tensor>> {
            let h = x.matmul(&wt)?;
            let y = (x + h.relu()?.matmul(&vt)?)?;
            let aux = h.to_dtype(CandleDType::F32)?.sqr()?.mean_all()?;
            let p = h.to_dtype(CandleDType::F32)?.tanh()?.sum(0)?;
            Ok(vec![y, aux, p])
        };
        let outs = match ckpt {
            true => crate::checkpoint::checkpoint_many(x.as_tensor(), block).unwrap(),
            false => block(x.as_tensor()).unwrap(),
        };
        let c = Tensor::from_vec((0..30).map(|i| (i as f32 * 0.7).sin()).collect::<Vec<_>>(), (5, 6), &Device::Cpu).unwrap();
        let c2 = Tensor::from_vec((0..11).map(|i| (i as f32 * 0.3).cos()).collect::<Vec<_>>(), 11, &Device::Cpu).unwrap();
        let loss = (outs[0].to_dtype(CandleDType::F32).unwrap().mul(&c).unwrap().sum_all().unwrap() + (&outs[1] * 0.3).unwrap())
            .unwrap()
            .add(&outs[2].mul(&c2).unwrap().sum_all().unwrap())
            .unwrap();
        let g = loss.backward().unwrap();
        let mut out: Vec<Vec<f32>> =
            outs.iter().map(|o| o.to_dtype(CandleDType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()).collect();
        for t in [&x, &w, &v] {
            out.push(g.get(t.as_tensor()).unwrap().to_dtype(CandleDType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap());
        }
        out
    };
    for dtype in [CandleDType::F32, CandleDType::BF16] {
        let (plain, ck) = (run(dtype, false), run(dtype, true));
        for (i, (a, b)) in ck.iter().zip(&plain).enumerate() {
            assert!(a == b, "{dtype:?}: output or gradient {i} differs: {a:?} vs {b:?}");
        }
        assert!(plain[3..].iter().all(|g| g.iter().any(|v| v.abs() > 1e-2)), "every gradient is far from 0");
    }
}
