//! The vendored candle's changes (`vendor/PATCHES.md`) where the library depends on them: the
//! gradient-ready hook through candle-nn's layers and in last-layer-first order, the fused and
//! vectorised ops against their compositions and f64 references, the transposed matmul's
//! gradient layout, exact sums over leading dims, storage hooks.

use super::*;

/// Checks every gradient the hooked backward hands out (the trainer's path) against central
/// finite differences, in f64: `loss = sum(f(x) * w)` for fixed random `w`. `x` is a variable
/// too, so the input gradient is checked as well.
fn check_layer(what: &str, varmap: &VarMap, x: &Var, f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>) {
    let out = f(x.as_tensor()).unwrap();
    let w = Tensor::from_vec(values(out.elem_count(), 7), out.shape(), &Device::Cpu).unwrap();
    let loss = |_: ()| (f(x.as_tensor()).unwrap() * &w).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    let mut vars: Vec<(String, Var)> = varmap.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    vars.push(("input".into(), x.clone()));
    let mut got = std::collections::HashMap::new();
    (f(x.as_tensor()).unwrap() * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward_with_hook(&mut |v, g| {
            got.insert(v.id(), g);
            Ok(())
        })
        .unwrap();
    for (name, var) in &vars {
        if name == "input" && x.dtype() != DType::F64 {
            continue; // token ids: no gradient
        }
        let g = got.get(&var.as_tensor().id()).unwrap_or_else(|| panic!("{what}: `{name}` received no gradient"));
        let g = g.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let base = var.as_tensor().flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let h = 1e-5;
        for i in (0..base.len()).step_by((base.len() / 7).max(1)) {
            let at = |d: f64| {
                let mut v = base.clone();
                v[i] += d;
                var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
                loss(())
            };
            let fd = (at(h) - at(-h)) / (2.0 * h);
            var.set(&Tensor::from_vec(base.clone(), var.shape(), &Device::Cpu).unwrap()).unwrap();
            assert!(
                (fd - g[i]).abs() <= 1e-6 * (1.0 + fd.abs()),
                "{what}: d loss / d {name}[{i}]: backward {} finite differences {fd}",
                g[i]
            );
        }
    }
}

/// In f32 (where candle-nn's fused CPU kernels run), every variable and the input receive a
/// non-zero gradient: upstream's fused layer norm, RMS norm, softmax and rope dropped them.
fn check_receives(what: &str, varmap: &VarMap, x: &Var, f: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>) {
    let out = f(x.as_tensor()).unwrap();
    let w = Tensor::from_vec(values(out.elem_count(), 7).iter().map(|v| *v as f32).collect::<Vec<_>>(), out.shape(), &Device::Cpu).unwrap();
    let mut got = std::collections::HashMap::new();
    (out * &w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward_with_hook(&mut |v, g| {
            got.insert(v.id(), g.sqr()?.sum_all()?.to_scalar::<f32>()?);
            Ok(())
        })
        .unwrap();
    let vars = varmap.all_vars();
    for (i, v) in vars.iter().chain(std::iter::once(x)).enumerate() {
        let sq = got.get(&v.as_tensor().id()).copied().unwrap_or(0.0);
        assert!(sq > 0.0, "{what} in f32: variable #{i} of {} received no gradient", vars.len() + 1);
    }
}

/// f32 `values` on a wider range, with the inputs where the kernels switch form.
fn f32_points(n: usize, seed: u64, range: f32) -> Vec<f32> {
    let mut v: Vec<f32> = values(n, seed).iter().map(|x| *x as f32 * range).collect();
    v.extend([0.0, -0.0, 0.624, 0.626, -0.624, -0.626, 1e-4, -1e-4, 9.0, -9.0, 30.0, -30.0]);
    v
}

/// Kolo's vectorised f32 CPU paths in the vendored candle (exp, tanh, both GELUs and their
/// one-pass derivatives): values against candle's f64 path (libm) and gradients, taken by
/// candle's backward in f32, against central finite differences of the f64 values, both
/// within 5e-7 relative; near zero, where an f32 result is the difference of terms near 1,
/// within 2e-7 absolute (exp: relative only).
#[test]
fn vectorised_unary_ops_match_f64_values_and_finite_differences() {
    type Op = fn(&Tensor) -> candle_core::Result<Tensor>;
    let ops: [(&str, Op, f32, f64); 4] = [
        ("gelu", |x| x.gelu(), 8.0, 2e-7),
        ("gelu_erf", |x| x.gelu_erf(), 8.0, 2e-7),
        ("exp", |x| x.exp(), 80.0, 0.0),
        ("tanh", |x| x.tanh(), 8.0, 2e-7),
    ];
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    for (name, op, range, floor) in ops {
        let x = f32_points(1001, 21, range);
        let w = values(x.len(), 5);
        let v = Var::from_vec(x.clone(), x.len(), &Device::Cpu).unwrap();
        let y32 = op(v.as_tensor()).unwrap();
        let w32 = Tensor::new(&w[..], &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        let g = (&y32 * w32).unwrap().sum_all().unwrap().backward().unwrap();
        let (y32, g32) = (f64s(&y32), f64s(g.get(v.as_tensor()).unwrap()));
        let x64: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let at = |d: f64| {
            let shifted: Vec<f64> = x64.iter().map(|x| x + d * x.abs().max(1.0)).collect();
            f64s(&op(&Tensor::new(&shifted[..], &Device::Cpu).unwrap()).unwrap())
        };
        let (y64, up, down) = (at(0.0), at(1e-5), at(-1e-5));
        let close = |a: f64, b: f64| (a - b).abs() <= 5e-7 * b.abs() + floor;
        for i in 0..x.len() {
            let fd = (up[i] - down[i]) / (2e-5 * x64[i].abs().max(1.0)) * w[i];
            assert!(close(y32[i], y64[i]), "{name}({}): f32 {} f64 {}", x[i], y32[i], y64[i]);
            assert!(close(g32[i], fd), "{name}'({}) * w: f32 backward {} finite differences {fd}", x[i], g32[i]);
        }
    }
    let edges = Tensor::new(&[f32::NEG_INFINITY, -200.0, 200.0, f32::INFINITY][..], &Device::Cpu).unwrap();
    assert_eq!(edges.exp().unwrap().to_vec1::<f32>().unwrap(), [0.0, 0.0, f32::INFINITY, f32::INFINITY]);
    assert_eq!(edges.tanh().unwrap().to_vec1::<f32>().unwrap(), [-1.0, -1.0, 1.0, 1.0]);
}

/// The fused f32 cross-entropy against the f64 composite (log-softmax, gather, mean): loss and
/// logits' gradient, on odd sizes, both target dtypes, one row and very large logits.
#[test]
fn fused_cross_entropy_matches_the_composite() {
    for (n, c, scale, seed) in [(7usize, 13usize, 3.0f32, 1u64), (1, 2, 1.0, 2), (5, 1031, 10.0, 3), (3, 17, 1e4, 4)] {
        let x: Vec<f32> = values(n * c, seed).iter().map(|v| *v as f32 * scale).collect();
        let t: Vec<u32> = (0..n).map(|i| ((i * 7919 + seed as usize) % c) as u32).collect();
        let loss_and_grad = |dtype: DType, targets: &Tensor| {
            let v = Var::from_tensor(&Tensor::from_vec(x.clone(), (n, c), &Device::Cpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let l = candle_nn::loss::cross_entropy(v.as_tensor(), targets).unwrap();
            let g = (&l * 0.75).unwrap().backward().unwrap();
            let grad = g.get(v.as_tensor()).unwrap().to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
            (l.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap(), grad)
        };
        let t32 = Tensor::new(&t[..], &Device::Cpu).unwrap();
        let t64 = t32.to_dtype(DType::I64).unwrap();
        let (want, want_g) = loss_and_grad(DType::F64, &t32);
        for targets in [&t32, &t64] {
            let (got, got_g) = loss_and_grad(DType::F32, targets);
            assert!((got - want).abs() <= 1e-6 * (1.0 + want.abs()), "n={n} c={c}: loss {got} vs {want}");
            for (i, (a, b)) in got_g.iter().zip(&want_g).enumerate() {
                assert!((a - b).abs() <= 1e-6, "n={n} c={c}: d loss / d logit[{i}] {a} vs {b}");
            }
        }
    }
    let x = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
    let err = candle_nn::loss::cross_entropy(&x, &Tensor::new(&[1u32, 5], &Device::Cpu).unwrap()).unwrap_err().to_string();
    assert!(err.contains("target 1 is class 5, outside 0..5"), "{err}");
}

/// Sums over a block of leading or middle dims (a bias gradient) take the row-wise fast path:
/// bitwise equal to adding the terms one by one in index order.
#[test]
fn sums_over_leading_dims_are_exact_in_index_order() {
    let (a, b, c) = (3usize, 5usize, 7usize);
    let x: Vec<f32> = values(a * b * c, 8).iter().map(|v| *v as f32 * 1e3).collect();
    let t = Tensor::from_vec(x.clone(), (a, b, c), &Device::Cpu).unwrap();
    let lead = t.sum_keepdim((0, 1)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut want = vec![0f32; c];
    for (i, v) in x.iter().enumerate() {
        want[i % c] += v;
    }
    assert_eq!(lead.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    let mid = t.sum_keepdim(1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut want = vec![0f32; a * c];
    for (i, v) in x.iter().enumerate() {
        want[(i / (b * c)) * c + i % c] += v;
    }
    assert_eq!(mid.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
    let empty = Tensor::zeros((0, 4), DType::F32, &Device::Cpu).unwrap().sum_keepdim(0).unwrap();
    assert_eq!(empty.flatten_all().unwrap().to_vec1::<f32>().unwrap(), [0.0; 4]);
}

/// Kolo's candle patch for a matmul whose right operand is a transposed view (`x.matmul(&w.t())`,
/// `q.matmul(&k.t())`): the gradients equal the f64 products, and every variable, whichever way
/// it entered a product, receives a contiguous gradient (from the store and through the hook).
#[test]
fn transposed_matmul_operands_get_contiguous_gradients_of_the_right_values() {
    let t = |v: Vec<f64>, shape: &[usize]| Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    let f64s = |x: &Tensor| x.to_dtype(DType::F64).unwrap().flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let check = |what: &str, got: &Tensor, want: &[f64]| {
        assert!(got.is_contiguous(), "{what}: a strided gradient");
        let got = f64s(got);
        assert_eq!(got.len(), want.len(), "{what}");
        let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(d < 1e-5, "{what}: max difference {d}");
    };
    // Batches (b) of (m x k) by the transpose of (n x k), a weighted sum as the loss: d loss / d y
    // = m. The reference gradients: dx[i][l] = sum_j m[i][j] w[j][l], dw[j][l] = sum_i m[i][j] x[i][l].
    for (b, (mm, k, n)) in [(1usize, (7usize, 5usize, 3usize)), (6, (7, 4, 6))] {
        let (xv, wv, mv) = (values(b * mm * k, 1), values(b * n * k, 2), values(b * mm * n, 3));
        let shape = |r: usize, c: usize| if b == 1 { vec![r, c] } else { vec![2, 3, r, c] };
        let (x, w) = (Var::from_tensor(&t(xv.clone(), &shape(mm, k))).unwrap(), Var::from_tensor(&t(wv.clone(), &shape(n, k))).unwrap());
        let y = x.matmul(&w.t().unwrap()).unwrap();
        let loss = (y * t(mv.clone(), &shape(mm, n))).unwrap().sum_all().unwrap();
        let (mut dx, mut dw) = (vec![0f64; b * mm * k], vec![0f64; b * n * k]);
        for p in 0..b {
            for (i, j, l) in (0..mm).flat_map(|i| (0..n).flat_map(move |j| (0..k).map(move |l| (i, j, l)))) {
                let m = mv[p * mm * n + i * n + j];
                dx[p * mm * k + i * k + l] += m * wv[p * n * k + j * k + l];
                dw[p * n * k + j * k + l] += m * xv[p * mm * k + i * k + l];
            }
        }
        let grads = loss.backward().unwrap();
        check(&format!("{b} batch(es): dx"), grads.get(&x).unwrap(), &dx);
        check(&format!("{b} batch(es): dw"), grads.get(&w).unwrap(), &dw);
        let mut seen = 0;
        loss.backward_with_hook(&mut |v, g| {
            check(&format!("{b} batch(es): the hook's gradient"), &g, if v.id() == w.id() { &dw } else { &dx });
            seen += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, 2);
    }
    // A variable entering as a transposed left operand gets a contiguous gradient too.
    let (av, bv, mv) = (values(5 * 7, 4), values(5 * 3, 5), values(7 * 3, 6));
    let (a, bm) = (Var::from_tensor(&t(av, &[5, 7])).unwrap(), Var::from_tensor(&t(bv.clone(), &[5, 3])).unwrap());
    let loss = (a.t().unwrap().matmul(&bm).unwrap() * t(mv.clone(), &[7, 3])).unwrap().sum_all().unwrap();
    // da[l][i] = sum_j m[i][j] b[l][j].
    let da: Vec<f64> = (0..5 * 7).map(|e| (0..3).map(|j| mv[(e % 7) * 3 + j] * bv[(e / 7) * 3 + j]).sum()).collect();
    check("transposed left operand", loss.backward().unwrap().get(&a).unwrap(), &da);
}

fn input(shape: &[usize], seed: u64) -> Var {
    Var::from_vec(values(shape.iter().product(), seed), shape, &Device::Cpu).unwrap()
}

/// Each candle-nn layer a user model is built from passes its gradients, checked against
/// finite differences. Before Kolo's candle-nn patch the fused softmax, layer norm, RMS norm
/// and rotary ops dropped them (the parameters received none).
#[test]
fn candle_nn_layers_backpropagate_through_the_hook() {
    let vm = || VarMap::new();
    let vb = |m: &VarMap| VarBuilder::from_varmap(m, DType::F64, &Device::Cpu);
    let m = vm();
    let l = candle_nn::linear(5, 3, vb(&m).pp("lin")).unwrap();
    check_layer("Linear", &m, &input(&[2, 4, 5], 1), &|x| l.forward(x));
    let m = vm();
    let e = candle_nn::embedding(11, 4, vb(&m).pp("emb")).unwrap();
    let ids = Var::from_vec(vec![3u32, 0, 10, 3, 7], 5, &Device::Cpu).unwrap();
    check_layer("Embedding", &m, &ids, &|x| e.forward(x));
    let m = vm();
    let c = candle_nn::conv2d(2, 3, 3, candle_nn::Conv2dConfig { padding: 1, stride: 1, ..Default::default() }, vb(&m).pp("conv")).unwrap();
    check_layer("Conv2d", &m, &input(&[2, 2, 5, 5], 2), &|x| c.forward(x));
    let m = vm();
    let ln = candle_nn::layer_norm(6, candle_nn::LayerNormConfig::default(), vb(&m).pp("ln")).unwrap();
    // Perturb the affine parameters away from 1 and 0 so their gradients matter.
    for v in m.all_vars() {
        v.set(&(v.as_tensor() + Tensor::from_vec(values(6, 9), 6, &Device::Cpu).unwrap()).unwrap()).unwrap();
    }
    check_layer("LayerNorm", &m, &input(&[3, 6], 3), &|x| ln.forward(x));
    let m = vm();
    let rms = candle_nn::rms_norm(6, 1e-5, vb(&m).pp("rms")).unwrap();
    check_layer("RmsNorm", &m, &input(&[3, 6], 4), &|x| rms.forward(x));
    let m = vm();
    check_layer("softmax_last_dim", &m, &input(&[3, 7], 5), &|x| candle_nn::ops::softmax_last_dim(x));
    check_layer("gelu", &m, &input(&[3, 7], 5), &|x| x.affine(3.0, 0.0)?.gelu());
    check_layer("gelu_erf", &m, &input(&[3, 7], 5), &|x| x.affine(3.0, 0.0)?.gelu_erf());
    check_layer("tanh", &m, &input(&[3, 7], 5), &|x| x.affine(2.0, 0.0)?.tanh());
    check_layer("softmax", &m, &input(&[3, 7], 5), &|x| candle_nn::ops::softmax(x, D::Minus1));
    let (cos, sin) =
        (Tensor::from_vec(values(8, 11), (4, 2), &Device::Cpu).unwrap(), Tensor::from_vec(values(8, 12), (4, 2), &Device::Cpu).unwrap());
    check_layer("rope", &m, &input(&[1, 2, 4, 4], 6), &|x| candle_nn::rotary_emb::rope(x, &cos, &sin));
    check_layer("rope_i", &m, &input(&[1, 2, 4, 4], 6), &|x| candle_nn::rotary_emb::rope_i(x, &cos, &sin));

    let f32_input = |shape: &[usize]| {
        Var::from_vec(values(shape.iter().product(), 3).iter().map(|v| *v as f32).collect::<Vec<_>>(), shape, &Device::Cpu).unwrap()
    };
    let vb32 = |m: &VarMap| VarBuilder::from_varmap(m, DType::F32, &Device::Cpu);
    let m = vm();
    let ln = candle_nn::layer_norm(6, candle_nn::LayerNormConfig::default(), vb32(&m).pp("ln")).unwrap();
    check_receives("LayerNorm", &m, &f32_input(&[3, 6]), &|x| ln.forward(x));
    let m = vm();
    let rms = candle_nn::rms_norm(6, 1e-5, vb32(&m).pp("rms")).unwrap();
    check_receives("RmsNorm", &m, &f32_input(&[3, 6]), &|x| rms.forward(x));
    let m = vm();
    check_receives("softmax_last_dim", &m, &f32_input(&[3, 7]), &|x| candle_nn::ops::softmax_last_dim(x));
    let (cos, sin) = (cos.to_dtype(DType::F32).unwrap(), sin.to_dtype(DType::F32).unwrap());
    check_receives("rope", &m, &f32_input(&[1, 2, 4, 4]), &|x| candle_nn::rotary_emb::rope(x, &cos, &sin));
    check_receives("rope_i", &m, &f32_input(&[1, 2, 4, 4]), &|x| candle_nn::rotary_emb::rope_i(x, &cos, &sin));
}

/// The vendored candle-core's storage hooks (ZeRO-3's mechanism): a hook runs before every
/// read of its storage through any view (a transpose, a broadcast, a matmul operand, a copy
/// out), refills a released storage before the operation reads it, and a storage in use is
/// not released.
#[test]
fn storage_hooks_fill_views_and_skip_storage_in_use() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let w = Var::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), &Device::Cpu).unwrap();
    let views = [w.t().unwrap(), w.broadcast_left(2).unwrap(), w.reshape(6).unwrap()];
    let calls = Arc::new(AtomicUsize::new(0));
    let (c, held) = (calls.clone(), w.clone());
    w.set_storage_hook(Some(Arc::new(move || {
        c.fetch_add(1, Ordering::SeqCst);
        // Fill the storage with the whole values, as ZeRO-3's gather does (here on every call).
        if held.try_release_storage().unwrap() {
            let v = vec![1f32, 2., 3., 4., 5., 6.];
            held.replace_storage(candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v))).unwrap();
        }
    })));
    assert!(w.try_release_storage().unwrap());
    let x = Tensor::ones((4, 2), DType::F32, &Device::Cpu).unwrap();
    let y = x.matmul(&w).unwrap();
    assert_eq!(y.to_vec2::<f32>().unwrap()[0], vec![5., 7., 9.]);
    assert!(calls.load(Ordering::SeqCst) >= 1, "the matmul read the storage without the hook");
    for v in &views {
        let before = calls.load(Ordering::SeqCst);
        assert_eq!(v.flatten_all().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 21. * (v.elem_count() / 6) as f32);
        assert!(calls.load(Ordering::SeqCst) > before, "a view of shape {:?} bypassed the hook", v.dims());
    }
    {
        let (_guard, _) = w.storage_and_layout();
        assert!(!w.try_release_storage().unwrap(), "a storage being read was released");
    }
    w.set_storage_hook(None);
    let before = calls.load(Ordering::SeqCst);
    assert_eq!(w.sum_all().unwrap().to_scalar::<f32>().unwrap(), 21.);
    assert_eq!(calls.load(Ordering::SeqCst), before, "a removed hook still ran");
    let e = w.replace_storage(candle_core::Storage::Cpu(candle_core::CpuStorage::F32(vec![0.; 5]))).unwrap_err().to_string();
    assert!(e.contains("5 elements"), "{e}");
}

/// The hook hands out the last layer's gradients before backward reaches the first layer (so
/// their bucket's all-reduce can overlap the rest of backward), and each exactly once.
#[test]
fn gradients_are_handed_out_last_layer_first() {
    let s = small();
    let (x, y) = batch(4, 1);
    let name: std::collections::HashMap<_, _> =
        s.varmap.data().lock().unwrap().iter().map(|(k, v)| (v.as_tensor().id(), k.clone())).collect();
    let mut order = Vec::new();
    s.loss(&x, &y)
        .unwrap()
        .backward_with_hook(&mut |v, _| {
            order.push(name[&v.id()].clone());
            Ok(())
        })
        .unwrap();
    assert_eq!(order.len(), 4, "{order:?}");
    let first_l1 = order.iter().position(|n| n.starts_with("l1.")).unwrap();
    assert!(order[..first_l1].iter().filter(|n| n.starts_with("l2.")).count() == 2, "{order:?}");
}
