//! The library in one process (a world of one): the trainer's accumulation, mixed precision,
//! ZeRO-3, scheduled DDP, resume and bad input here; the candle changes it relies on in
//! `candle_patches`, Hugging Face models in `hf`, expert parallelism in `ep`. Multi-process
//! equivalence is in `crates/kolo-cli/tests/it/user_model.rs` (under the `kolo` launcher).

use crate::{Dist, TrainOptions, Trainer};
use candle_core::{DType, Device, Module, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};
use std::collections::BTreeMap;

mod candle_patches;
mod ep;
#[cfg(feature = "hf")]
mod hf;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut r = kolo_base::Rng::new(seed);
    (0..n).map(|_| r.below(1 << 24) as f64 / f64::from(1 << 23) - 1.0).collect()
}

fn world_of_one() -> Dist {
    crate::init_with(&crate::InitOptions { backend: crate::dist::Backend::Builtin, ..Default::default() }).unwrap()
}

/// A two-layer model over the VarMap, and a fixed batch of `n` examples from `seed`.
struct Small {
    varmap: VarMap,
    l1: candle_nn::Linear,
    l2: candle_nn::Linear,
    dtype: DType,
}

fn small() -> Small {
    small_in(DType::F32)
}

/// [`small`] built in `dtype` (mixed precision), from the same starting values (rounded to
/// bf16 in every dtype, so that they are exact in each).
fn small_in(dtype: DType) -> Small {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let (l1, l2) = (candle_nn::linear(6, 8, vb.pp("l1")).unwrap(), candle_nn::linear(8, 3, vb.pp("l2")).unwrap());
    // The same starting values in every model of the test.
    for (k, v) in varmap.data().lock().unwrap().iter() {
        let seed = k.bytes().map(u64::from).sum::<u64>();
        let init: Vec<f32> = values(v.elem_count(), seed).iter().map(|x| *x as f32 * 0.5).collect();
        let init = Tensor::from_vec(init, v.shape(), &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        v.set(&init.to_dtype(dtype).unwrap()).unwrap();
    }
    Small { varmap, l1, l2, dtype }
}

impl Small {
    /// The loss in f32 whatever the model's dtype (as torch's autocast computes losses).
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.l2.forward(&self.l1.forward(&x.to_dtype(self.dtype)?)?.tanh()?)?;
        candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32)?, y)
    }

    /// [`Small::loss`] with the first layer and its activation checkpointed ([`crate::checkpoint`]):
    /// run again in backward, reading `l1`'s variables a second time.
    fn loss_checkpointed(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let l1 = self.l1.clone();
        let h = crate::checkpoint(&x.to_dtype(self.dtype)?, move |x| l1.forward(x)?.tanh())?;
        candle_nn::loss::cross_entropy(&self.l2.forward(&h)?.to_dtype(DType::F32)?, y)
    }

    /// The model's own variables, by name, widened to f32.
    fn variables(&self) -> BTreeMap<String, Vec<f32>> {
        let vars = self.varmap.data().lock().unwrap();
        vars.iter().map(|(k, v)| (k.clone(), v.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap())).collect()
    }
}

use kolo_testkit::max_abs_diff;

/// Mixed precision (DeepSpeed's bf16 and fp16 modes): a model built in bf16 or f16 trains f32
/// master weights, and after every step its own variables are the masters rounded to its
/// dtype. SGD steps here (lr 1e-3) move a weight by about 1e-4, below half a bf16 ulp of most
/// weights, so bf16 weights updated in place would barely move; the masters follow the f32
/// run within 3 % of how far it moved.
#[test]
fn mixed_precision_steps_f32_masters_and_hands_the_model_their_rounding() {
    let dist = world_of_one();
    let sgd = |p: &str| opts(&format!("[optim]\nkind = \"sgd\"\nlr = 1e-3\n[train]\nprecision = \"{p}\"\n"));
    let run = |dtype: DType, name: &str| {
        let m = small_in(dtype);
        let mut t = Trainer::new(&m.varmap, &dist, sgd(name)).unwrap();
        let start = t.flat_params().unwrap();
        for s in 0..40 {
            let (x, y) = batch(8, s % 4);
            assert!(!t.step(|| m.loss(&x, &y)).unwrap().skipped);
        }
        (m, t, start)
    };
    let (_, reference, start) = run(DType::F32, "f32");
    let want = reference.flat_params().unwrap();
    let moved = max_abs_diff(&want, &start);
    assert!(moved > 2e-3, "the f32 run barely moved ({moved})");
    for (dtype, name) in [(DType::BF16, "bf16"), (DType::F16, "f16")] {
        let (m, t, begin) = run(dtype, name);
        assert_eq!(begin, start, "{name}: the masters start from the model's values");
        let got = t.flat_params().unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(d < 0.03 * moved, "{name}: masters differ from the f32 run by {d} (it moved {moved})");
        // The model's variables are the masters rounded to its dtype.
        let vars = m.variables();
        let mut at = 0;
        for (pname, shape) in t.signature() {
            let n: usize = shape.iter().product();
            let rounded = Tensor::new(&got[at..at + n], &Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            assert_eq!(vars[&pname], rounded.to_vec1::<f32>().unwrap(), "{name}: `{pname}` is not its master rounded");
            at += n;
        }
    }
    // A model whose dtype is not the precision's is refused by name.
    let m = small_in(DType::BF16);
    let e = Trainer::new(&m.varmap, &dist, sgd("f32")).err().unwrap().to_string();
    assert!(e.contains("parameter `l1.bias` is BF16, but train.precision = F32"), "{e}");
}

/// f16: an overflowing step is skipped (the parameters stay, the scale is lowered) and the
/// next one applies; a run stopped, saved and resumed into a fresh model continues bitwise
/// (the resumed model computes with the restored masters' rounding).
#[test]
fn f16_skips_overflowing_steps_and_resumes_bitwise() {
    let dist = world_of_one();
    let dir = std::env::temp_dir().join(format!("kolo-f16-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = || opts("[optim]\nkind = \"adamw\"\nlr = 1e-2\nclip_grad_norm = 1.0\n[train]\nprecision = \"f16\"\nsteps = 6\n");
    let m = small_in(DType::F16);
    let mut t = Trainer::new(&m.varmap, &dist, o()).unwrap();
    let (x, y) = batch(8, 1);
    let before = t.flat_params().unwrap();
    let out = t.step(|| m.loss(&x, &y)? * 1e30).unwrap();
    assert!(out.stepped && out.skipped, "{out:?}");
    assert_eq!(t.flat_params().unwrap(), before, "a skipped step changed the parameters");
    let run = |t: &mut Trainer, m: &Small, steps: std::ops::Range<u64>| {
        for s in steps {
            let (x, y) = batch(8, s);
            assert!(!t.step(|| m.loss(&x, &y)).unwrap().skipped);
        }
    };
    run(&mut t, &m, 1..6);
    let whole = t.flat_params().unwrap();
    assert_ne!(whole, before);
    let m2 = small_in(DType::F16);
    let mut first = Trainer::new(&m2.varmap, &dist, o()).unwrap();
    assert!(first.step(|| m2.loss(&x, &y)? * 1e30).unwrap().skipped);
    run(&mut first, &m2, 1..3);
    let saved = first.save(&dir).unwrap();
    let m3 = small_in(DType::F16);
    let mut resumed = Trainer::new(&m3.varmap, &dist, o()).unwrap();
    assert_eq!(resumed.resume(&saved).unwrap(), 3);
    run(&mut resumed, &m3, 3..6);
    assert_eq!(resumed.flat_params().unwrap(), whole, "the resumed f16 run differs");
    let _ = std::fs::remove_dir_all(&dir);
}

fn batch(n: usize, seed: u64) -> (Tensor, Tensor) {
    let x = Tensor::from_vec(values(n * 6, seed).iter().map(|v| *v as f32).collect::<Vec<_>>(), (n, 6), &Device::Cpu).unwrap();
    let y = Tensor::from_vec((0..n as u32).map(|i| (i * 7 + seed as u32) % 3).collect::<Vec<_>>(), n, &Device::Cpu).unwrap();
    (x, y)
}

fn opts(toml: &str) -> TrainOptions {
    TrainOptions::from_toml_str(toml).unwrap()
}

/// Two micro-steps of 4 examples with `grad_accum = 2` equal one step of the 8 (the loss is the
/// mean, and each micro-step's loss is halved); only the second call steps.
#[test]
fn accumulation_equals_the_whole_batch() {
    let dist = world_of_one();
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.5\n";
    let (a, b) = (small(), small());
    let mut whole = Trainer::new(&a.varmap, &dist, opts(sgd)).unwrap();
    let mut accum = Trainer::new(&b.varmap, &dist, opts(&format!("{sgd}[train]\ngrad_accum = 2\n"))).unwrap();
    for s in 0..3 {
        let (x, y) = batch(8, s);
        assert!(whole.step(|| a.loss(&x, &y)).unwrap().stepped);
        let first = accum.step(|| b.loss(&x.narrow(0, 0, 4)?, &y.narrow(0, 0, 4)?)).unwrap();
        assert!(!first.stepped);
        assert!(accum.step(|| b.loss(&x.narrow(0, 4, 4)?, &y.narrow(0, 4, 4)?)).unwrap().stepped);
    }
    let (p, q) = (whole.flat_params().unwrap(), accum.flat_params().unwrap());
    let d = p.iter().zip(&q).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(d < 1e-6, "accumulated run differs by {d}");
    assert_eq!(accum.steps_done(), 3);
}

/// A parameter one micro-step's loss reaches and the next one's does not (a mixture-of-experts
/// expert no token chose) accumulates only the gradient it got: the next micro-step hands it
/// zero, not the earlier micro-step's gradient again.
#[test]
fn a_parameter_a_micro_step_does_not_reach_accumulates_nothing_there() {
    let dist = world_of_one();
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (a, b) =
        (vb.get_with_hints(3, "a", candle_nn::Init::Const(1.0)).unwrap(), vb.get_with_hints(3, "b", candle_nn::Init::Const(1.0)).unwrap());
    let mut t = Trainer::new(&varmap, &dist, opts("[optim]\nkind = \"sgd\"\nlr = 1.0\n[train]\ngrad_accum = 3\n")).unwrap();
    let x = Tensor::new(&[1f32, 2.0, 3.0], &Device::Cpu).unwrap();
    // Micro-steps 1 and 3 reach a and b, micro-step 2 only a (the last one communicates: DDP
    // refuses a parameter without a gradient there, as torch's DDP does by default).
    let both = || (&a * &x)?.sum_all()? + (&b * &x)?.sum_all()?;
    t.step(both).unwrap();
    t.step(|| (&a * &x)?.sum_all()).unwrap();
    assert!(t.step(both).unwrap().stepped);
    // Each loss is divided by grad_accum: a got x three times, b twice.
    let after = |v: &Tensor| v.to_vec1::<f32>().unwrap();
    assert_eq!(after(&a), vec![0.0, -1.0, -2.0]);
    let want: Vec<f32> = [1f32, 2.0, 3.0].iter().map(|x| 1.0 - 2.0 * x / 3.0).collect();
    let d = max_abs_diff(&after(&b), &want);
    assert!(d < 1e-6, "b: {:?}, expected {want:?}", after(&b));
}

/// `backward` and `update` as separate calls (torch's `loss.backward()` and
/// `optimizer.step()`) train bitwise as the closure form, with accumulation and clipping; an
/// update before the accumulation is complete, or one backward too many, is refused by name.
#[test]
fn split_backward_and_update_equal_the_closure_form() {
    let dist = world_of_one();
    let o = "[optim]\nkind = \"adamw\"\nlr = 0.01\nclip_grad_norm = 0.5\n[train]\ngrad_accum = 2\n";
    let (a, b) = (small(), small());
    let mut closure = Trainer::new(&a.varmap, &dist, opts(o)).unwrap();
    let mut split = Trainer::new(&b.varmap, &dist, opts(o)).unwrap();
    for s in 0..3 {
        let (x, y) = batch(8, s);
        let (x1, y1, x2, y2) =
            (x.narrow(0, 0, 4).unwrap(), y.narrow(0, 0, 4).unwrap(), x.narrow(0, 4, 4).unwrap(), y.narrow(0, 4, 4).unwrap());
        closure.step(|| a.loss(&x1, &y1)).unwrap();
        let want = closure.step(|| a.loss(&x2, &y2)).unwrap();
        split.backward(&b.loss(&x1, &y1).unwrap()).unwrap();
        if s == 0 {
            let e = split.update().unwrap_err();
            assert!(matches!(e, crate::Error::Usage { rank: 0, op: "Trainer::update", .. }), "{e:?}");
            let e = e.to_string();
            assert!(e.contains("rank 0: Trainer::update: called after 1 of train.grad_accum = 2 backward calls"), "{e}");
        }
        split.backward(&b.loss(&x2, &y2).unwrap()).unwrap();
        if s == 0 {
            let e = split.backward(&b.loss(&x2, &y2).unwrap()).unwrap_err().to_string();
            assert!(e.contains("call Trainer::update first"), "{e}");
        }
        let got = split.update().unwrap();
        assert_eq!((got.loss, got.stepped, got.grad_norm), (want.loss, true, want.grad_norm));
    }
    assert_eq!(closure.flat_params().unwrap(), split.flat_params().unwrap());
}

/// `ddp.schedule` from the library (ByteScheduler: a thread of its own reduces each gradient in
/// chunks and updates each parameter as soon as its chunks are reduced, after the step has
/// returned): a user's candle model trains bitwise as under plain DDP (AdamW with a cosine
/// schedule, chunks of 4 values, many rounds per step), because every read of a parameter (the
/// next forward, the user's own reads of the model's variables right after a step, the trainer's
/// `flat_params`) waits for that parameter's update. The split `backward`/`update` form trains
/// the same, and so does a model whose first layer is checkpointed (`kolo::checkpoint`: its
/// forward and backward's recomputation read the variables, each read waiting). `step_then` (there is no moment between backward and the update) and a parameter
/// the loss does not reach are refused by name.
#[test]
fn scheduled_ddp_trains_a_users_model_as_plain_ddp() {
    let dist = world_of_one();
    let o = "[optim]\nkind = \"adamw\"\nlr = 0.05\nschedule = \"cosine\"\nwarmup_steps = 2\n[train]\nsteps = 6\n";
    let scheduled = format!("{o}[ddp]\nschedule = {{ chunk = \"16B\", credit = \"32B\" }}\n");
    let (a, b, c, k) = (small(), small(), small(), small());
    let mut plain = Trainer::new(&a.varmap, &dist, opts(o)).unwrap();
    let mut sched = Trainer::new(&b.varmap, &dist, opts(&scheduled)).unwrap();
    let mut split = Trainer::new(&c.varmap, &dist, opts(&scheduled)).unwrap();
    let mut ckpt = Trainer::new(&k.varmap, &dist, opts(&scheduled)).unwrap();
    for s in 0..5 {
        let (x, y) = batch(8, s);
        let want = plain.step(|| a.loss(&x, &y)).unwrap();
        let got = sched.step(|| b.loss(&x, &y)).unwrap();
        assert_eq!((got.loss, got.stepped, got.lr), (want.loss, true, want.lr), "step {s}");
        split.backward(&c.loss(&x, &y).unwrap()).unwrap();
        assert_eq!(split.update().unwrap().loss, want.loss, "split form, step {s}");
        assert_eq!(ckpt.step(|| k.loss_checkpointed(&x, &y)).unwrap().loss, want.loss, "checkpointed, step {s}");
        // The model's own variables, read as soon as the step has returned.
        assert_eq!(b.variables(), a.variables(), "after step {s}");
    }
    assert_eq!(sched.flat_params().unwrap(), plain.flat_params().unwrap());
    assert_eq!(c.variables(), a.variables());
    assert_eq!(k.variables(), a.variables(), "checkpointed");
    let (x, y) = batch(8, 9);
    let e = sched.step_then(|| b.loss(&x, &y), |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("Trainer::step_then: under ddp.schedule"), "{e}");
    // A parameter the loss never reaches.
    let d = small();
    let vb = VarBuilder::from_varmap(&d.varmap, DType::F32, &Device::Cpu);
    vb.get_with_hints(3, "spare", candle_nn::Init::Const(1.0)).unwrap();
    let mut t = Trainer::new(&d.varmap, &dist, opts(&scheduled)).unwrap();
    let e = t.step(|| d.loss(&x, &y)).unwrap_err().to_string();
    assert!(e.contains("Trainer::backward") && e.contains("[\"spare\"] received no gradient"), "{e}");
}

/// `Trainer::set_param` and `Trainer::add_to_param` between `backward` and `update` (torch's
/// `p.copy_(v)` and `p.add_(d)` under `no_grad`) reach wherever the trainer keeps the value: on
/// 2 ranks (threads, the same batches on both) under plain DDP, ZeRO-1, ZeRO-2 (each rank's
/// master shard holding a part of `l1.weight`) and ZeRO-3 (groups `l1.`, `l2.`, gathered at the
/// time), the update steps from the new values and the run ends bitwise where one process ends
/// that sets its f32 variables directly; ZeRO-3's copy of a group gathered between steps takes a
/// set value, and is gathered again after an addition. In bf16 the f32 master takes the value
/// exactly and the model its rounding, and ten additions of 1e-4 (below half a bf16 ulp of 0.2)
/// add up in the master. A variable the trainer does not hold, or a value of another shape, is
/// refused by name.
#[test]
fn set_param_and_add_to_param_reach_wherever_the_trainer_keeps_the_value() {
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.5\n[ddp]\nbucket_cap = \"64B\"\n";
    let new_value = |v: &Var, at: f64| {
        Tensor::arange(0f32, v.elem_count() as f32, &Device::Cpu).unwrap().affine(0.01, at).unwrap().reshape(v.shape()).unwrap()
    };
    let chosen = ["l1.weight", "l2.bias"];
    // Three steps; after the second's backward, the chosen parameters are set (or added to).
    let run = |t: &mut Trainer, m: &Small, set: &mut dyn FnMut(&mut Trainer, &Var, &Tensor)| {
        for s in 0..3 {
            let (x, y) = batch(8, s);
            t.backward(&m.loss(&x, &y).unwrap()).unwrap();
            if s == 1 {
                let vars = m.varmap.data().lock().unwrap().clone();
                for (k, name) in chosen.iter().enumerate() {
                    set(t, &vars[*name], &new_value(&vars[*name], k as f64 - 0.5));
                }
            }
            t.update().unwrap();
        }
        t.flat_params().unwrap()
    };
    let untouched = {
        let m = small();
        let mut t = Trainer::new(&m.varmap, &world_of_one(), opts(sgd)).unwrap();
        run(&mut t, &m, &mut |_, _, _| ())
    };
    for add in [false, true] {
        let one = small();
        let mut t = Trainer::new(&one.varmap, &world_of_one(), opts(sgd)).unwrap();
        let want = run(&mut t, &one, &mut |_, v, value| match add {
            true => v.set(&(v.as_tensor() + value).unwrap()).unwrap(),
            false => v.set(value).unwrap(),
        });
        assert!(max_abs_diff(&want, &untouched) > 0.1, "setting the values changed nothing");
        for (what, extra) in [("DDP", ""), ("ZeRO-1", "zero_stage = 1\n"), ("ZeRO-2", "zero_stage = 2\n"), ("ZeRO-3", "zero_stage = 3\n")] {
            let ranks = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(2).unwrap());
            let got: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || {
                            let dist = Dist::of_comm(std::sync::Arc::new(c));
                            let m = small();
                            let o = opts(&format!("{sgd}{extra}"));
                            let mut t = match extra.contains('3') {
                                true => Trainer::with_zero3_groups(&m.varmap, &dist, o, &["l1.", "l2."]).unwrap(),
                                false => Trainer::new(&m.varmap, &dist, o).unwrap(),
                            };
                            let flat = run(&mut t, &m, &mut |t, v, value| match add {
                                true => t.add_to_param(v, value).unwrap(),
                                false => t.set_param(v, value).unwrap(),
                            });
                            if extra.contains('3') {
                                // Between steps, with the groups gathered (kept whole until the
                                // next step).
                                t.unshard().unwrap();
                                let v = m.varmap.data().lock().unwrap()["l2.bias"].clone();
                                let before = v.to_vec1::<f32>().unwrap();
                                let value = Tensor::new(&[0.5f32, 0.25, 0.125], &Device::Cpu).unwrap();
                                let want: Vec<f32> = match add {
                                    true => before.iter().zip([0.5f32, 0.25, 0.125]).map(|(b, d)| b + d).collect(),
                                    false => vec![0.5, 0.25, 0.125],
                                };
                                match add {
                                    true => t.add_to_param(&v, &value).unwrap(),
                                    false => t.set_param(&v, &value).unwrap(),
                                }
                                t.unshard().unwrap();
                                assert_eq!(v.to_vec1::<f32>().unwrap(), want, "ZeRO-3: the gathered copy");
                            }
                            flat
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (r, g) in got.iter().enumerate() {
                assert_eq!(
                    max_abs_diff(g, &want),
                    0.0,
                    "{what}, rank {r}, add {add}: the run differs from one process that set its variables"
                );
            }
        }
    }
    // bf16: the master takes the value, the model its rounding.
    let m = small_in(DType::BF16);
    let mut t = Trainer::new(&m.varmap, &world_of_one(), opts(&format!("{sgd}[train]\nprecision = \"bf16\"\n"))).unwrap();
    let v = m.varmap.data().lock().unwrap()["l2.bias"].clone();
    let master = |t: &Trainer| {
        let masters = t.master_varmap(&m.varmap).unwrap().unwrap();
        let b = masters.data().lock().unwrap()["l2.bias"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        b
    };
    let value = Tensor::new(&[0.1f32, 0.2, 1.0 / 3.0], &Device::Cpu).unwrap();
    t.set_param(&v, &value).unwrap();
    assert_eq!(master(&t), [0.1, 0.2, 1.0 / 3.0]);
    let rounded = value.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(v.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(), rounded);
    for _ in 0..10 {
        t.add_to_param(&v, &Tensor::new(&[0f32, 1e-4, 0.0], &Device::Cpu).unwrap()).unwrap();
    }
    let b = master(&t)[1];
    assert!((b - 0.201).abs() < 1e-6, "ten additions of 1e-4 to 0.2 in the master: {b}");
    assert!(v.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap()[1] > rounded[1], "the model's rounding follows the master");
    let e = t.set_param(&Var::new(&[1f32], &Device::Cpu).unwrap(), &value).unwrap_err().to_string();
    assert!(e.contains("Trainer::set_param: the variable is not one of this trainer's parameters"), "{e}");
    let e = t.add_to_param(&v, &value.narrow(0, 0, 2).unwrap()).unwrap_err().to_string();
    assert!(e.contains("Trainer::add_to_param: `l2.bias` is [3]; the value is [2]"), "{e}");
}

/// Stopping after 3 AdamW steps with clipping, saving, and resuming into a fresh model gives
/// bitwise the run that never stopped (the optimizer state and step count are restored).
#[test]
fn resume_continues_bitwise() {
    let dist = world_of_one();
    let dir = std::env::temp_dir().join(format!("kolo-lib-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let o = "[optim]\nkind = \"adamw\"\nlr = 0.01\nclip_grad_norm = 0.5\nschedule = \"cosine\"\nwarmup_steps = 2\n[train]\nsteps = 6\n";
    let (a, b) = (small(), small());
    let mut straight = Trainer::new(&a.varmap, &dist, opts(o)).unwrap();
    for s in 0..6 {
        let (x, y) = batch(8, s);
        straight.step(|| a.loss(&x, &y)).unwrap();
    }
    let mut first = Trainer::new(&b.varmap, &dist, opts(o)).unwrap();
    for s in 0..3 {
        let (x, y) = batch(8, s);
        first.step(|| b.loss(&x, &y)).unwrap();
    }
    let pos = crate::data::Position { epoch: 1, batch: 3 };
    first.set_data_position(pos);
    first.save(&dir).unwrap();
    let c = small();
    let mut resumed = Trainer::new(&c.varmap, &dist, opts(o)).unwrap();
    assert_eq!(resumed.resume(&dir).unwrap(), 3);
    assert_eq!(resumed.data_position(), pos);
    for s in 3..6 {
        let (x, y) = batch(8, s);
        resumed.step(|| c.loss(&x, &y)).unwrap();
    }
    assert_eq!(straight.flat_params().unwrap(), resumed.flat_params().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A user's optimizer: SGD with momentum written as torch writes it, as an [`crate::UpdateRule`].
struct HeavyBall {
    momentum: f32,
}

impl crate::UpdateRule for HeavyBall {
    fn describe(&self) -> String {
        format!("HeavyBall(momentum={})", self.momentum)
    }
    fn state_names(&self) -> &'static [&'static str] {
        &["velocity"]
    }
    fn update(&self, step: u64, lr: f32, wd: f32, p: &mut [f32], g: &[f32], state: &mut [&mut [f32]]) {
        for ((p, g), b) in p.iter_mut().zip(g).zip(state[0].iter_mut()) {
            let d = g + wd * *p;
            *b = if step == 1 { d } else { self.momentum * *b + d };
            *p -= lr * *b;
        }
    }
}

/// A user's own update rule trains bitwise as Kolo's SGD with the same momentum, under ZeRO-2
/// with weight decay, a parameter group with its own learning rate and a schedule; its state is
/// checkpointed under its own name and resumes bitwise; a checkpoint of another optimizer is
/// refused on resume.
#[test]
fn a_users_update_rule_trains_as_the_built_in_one() {
    let dist = world_of_one();
    let dir = std::env::temp_dir().join(format!("kolo-lib-rule-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = || {
        let mut o = TrainOptions::new()
            .optimizer(crate::options::OptimKind::Sgd, 0.2)
            .weight_decay(0.1)
            .param_group(&["l2."], None, 0.5)
            .schedule(crate::options::ScheduleKind::Cosine, 2)
            .zero_stage(2)
            .steps(6);
        o.optim.momentum = 0.9;
        o
    };
    let (a, b, c) = (small(), small(), small());
    let mut builtin = Trainer::new(&a.varmap, &dist, base()).unwrap();
    let mut mine = Trainer::new(&b.varmap, &dist, base().update_rule(HeavyBall { momentum: 0.9 })).unwrap();
    for s in 0..3 {
        let (x, y) = batch(8, s);
        builtin.step(|| a.loss(&x, &y)).unwrap();
        mine.step(|| b.loss(&x, &y)).unwrap();
    }
    assert_eq!(builtin.flat_params().unwrap(), mine.flat_params().unwrap(), "after 3 steps");
    let saved = mine.save(&dir).unwrap();
    let names: Vec<String> = saved_names(&saved);
    assert!(names.iter().any(|n| n.contains("velocity")), "no `velocity` state in the checkpoint: {names:?}");
    let mut resumed = Trainer::new(&c.varmap, &dist, base().update_rule(HeavyBall { momentum: 0.9 })).unwrap();
    assert_eq!(resumed.resume(&saved).unwrap(), 3);
    for s in 3..6 {
        let (x, y) = batch(8, s);
        builtin.step(|| a.loss(&x, &y)).unwrap();
        resumed.step(|| c.loss(&x, &y)).unwrap();
    }
    let (p, q) = (builtin.flat_params().unwrap(), resumed.flat_params().unwrap());
    assert_eq!(p, q, "after 6 steps, resumed at 3");
    assert!(max_abs_diff(&p, &small_params()) > 1e-2, "nothing moved");
    let d = small();
    let mut other = Trainer::new(&d.varmap, &dist, base().update_rule(HeavyBall { momentum: 0.5 })).unwrap();
    let e = other.resume(&saved).unwrap_err().to_string();
    assert!(e.contains("HeavyBall(momentum=0.9)") && e.contains("HeavyBall(momentum=0.5)"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The tensor names in a checkpoint directory's files.
fn saved_names(dir: &std::path::Path) -> Vec<String> {
    let mut names = Vec::new();
    for f in std::fs::read_dir(dir).unwrap() {
        let path = f.unwrap().path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            let t = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            names.extend(t.names().into_iter().map(str::to_string));
        }
    }
    names
}

/// The starting values of [`small`], flat in the trainer's order.
fn small_params() -> Vec<f32> {
    let s = small();
    Trainer::new(&s.varmap, &world_of_one(), TrainOptions::default()).unwrap().flat_params().unwrap()
}

/// A diverging run stops (issue #34): SGD at lr 1e38 with a log every step fails at the first
/// step whose loss is not finite, naming it; a checkpoint of non-finite values is not written.
#[test]
fn a_diverging_run_stops_with_the_step_named() {
    let dist = world_of_one();
    let dir = std::env::temp_dir().join(format!("kolo-lib-diverge-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let s = small();
    let o = TrainOptions::new().optimizer(crate::options::OptimKind::Sgd, 1e38).log_every(1).steps(50);
    let mut t = Trainer::new(&s.varmap, &dist, o).unwrap();
    let mut stopped = None;
    for step in 0..50 {
        let (x, y) = batch(8, step);
        if let Err(e) = t.step(|| s.loss(&x, &y)) {
            stopped = Some(e.to_string());
            break;
        }
    }
    let e = stopped.expect("trained 50 steps at lr 1e38 without stopping");
    assert!(e.contains("Trainer::update: step") && e.contains("the run diverged"), "{e}");
    // What is saved now is finite, or refused (the loss can overflow before the weights do).
    match t.save(&dir) {
        Ok(_) => assert!(t.flat_params().unwrap().iter().all(|v| v.is_finite())),
        Err(e) => assert!(e.to_string().contains("values to checkpoint are NaN or infinite"), "{e}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad input gives one error naming what is wrong.
#[test]
fn bad_models_and_losses_are_named() {
    let dist = world_of_one();
    let e = Trainer::new(&VarMap::new(), &dist, TrainOptions::default()).err().unwrap().to_string();
    assert!(e.contains("holds no parameters"), "{e}");
    let s = small();
    let mut t = Trainer::new(&s.varmap, &dist, TrainOptions::default()).unwrap();
    let (x, y) = batch(4, 1);
    let e = t.step(|| s.l1.forward(&x)).err().unwrap().to_string();
    assert!(e.contains("shape [4, 8]") && e.contains("scalar"), "{e}");
    let outside = Var::from_vec(vec![0.5f32; 3], 3, &Device::Cpu).unwrap();
    let e = t.step(|| s.loss(&x, &y)? + outside.as_tensor().sum_all()?).err().unwrap().to_string();
    assert!(e.contains("outside the VarMap") && e.contains("[3]"), "{e}");
    let half = VarMap::new();
    candle_nn::linear(2, 2, VarBuilder::from_varmap(&half, DType::BF16, &Device::Cpu).pp("h")).unwrap();
    let e = Trainer::new(&half, &dist, TrainOptions::default()).err().unwrap().to_string();
    assert!(e.contains("h.") && e.contains("BF16"), "{e}");
    // ZeRO-3 without groups is refused by name.
    let z3 = opts("[ddp]\nzero_stage = 3\n");
    let e = Trainer::new(&small().varmap, &dist, z3.clone()).err().unwrap().to_string();
    assert!(e.contains("Trainer::with_zero3_groups"), "{e}");
    let e = Trainer::with_zero3_groups(&small().varmap, &dist, z3, &["l3."]).err().unwrap().to_string();
    assert!(e.contains("ZeRO-3 group \"l3.\" matches no parameter"), "{e}");
    // A model elsewhere than train.device says so (a CPU model, a GPU run asked for), and a
    // GPU run of what trains on the CPU only is refused as kolo train refuses it.
    for device in ["cuda", "cuda:1"] {
        let e = Trainer::new(&small().varmap, &dist, TrainOptions::new().device(device)).err().unwrap();
        let text = e.to_string();
        assert!(matches!(&e, crate::Error::Setting { setting, .. } if setting == "train.device"), "{e:?}");
        assert!(text.contains(&format!("is \"{device}\", but the model's parameter `l1.bias` is on Cpu")), "{text}");
    }
    let e = Trainer::with_zero3_groups(&small().varmap, &dist, opts("[ddp]\nzero_stage = 3\n").device("cuda"), &["l1."]);
    let e = e.err().unwrap().to_string();
    assert!(e.contains("train.device = \"cuda\" supports plain DDP and ZeRO-1/2 only"), "{e}");
}

/// A four-layer candle-nn MLP, unchanged, for ZeRO-3: its layers keep their own weights.
struct Deep {
    varmap: VarMap,
    layers: Vec<candle_nn::Linear>,
}

fn deep() -> Deep {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let dims = [6, 9, 7, 8, 3];
    let layers = (0..4).map(|i| candle_nn::linear(dims[i], dims[i + 1], vb.pp(format!("l{i}"))).unwrap()).collect();
    for (k, v) in varmap.data().lock().unwrap().iter() {
        let seed = k.bytes().map(u64::from).sum::<u64>();
        let init: Vec<f32> = values(v.elem_count(), seed).iter().map(|x| *x as f32 * 0.5).collect();
        v.set(&Tensor::from_vec(init, v.shape(), &Device::Cpu).unwrap()).unwrap();
    }
    Deep { varmap, layers }
}

impl Deep {
    fn loss(&self, x: &Tensor, y: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h)?;
            if i < 3 {
                h = h.tanh()?;
            }
        }
        candle_nn::loss::cross_entropy(&h, y)
    }
}

/// ZeRO-3 on an unchanged model (FSDP-style): the layers keep their own variables, which are
/// emptied and gathered back when read. Three of four layers sharded, AdamW without clipping
/// (elementwise, so one process of ZeRO-3 equals DDP bitwise): the same parameters after 4
/// steps, through the trainer and through the model's own variables (after `unshard`).
/// Between steps no group is whole; a forward outside a step gathers each group once and
/// leaves at most `KEEP` of them whole.
#[test]
fn zero3_trains_an_unchanged_model_as_ddp_does() {
    let dist = world_of_one();
    let o = "[optim]\nkind = \"adamw\"\nlr = 0.05\n[train]\nsteps = 4\n";
    let (a, b) = (deep(), deep());
    let mut ddp = Trainer::new(&a.varmap, &dist, opts(o)).unwrap();
    let groups = ["l0.", "l1.", "l2."];
    let mut z3 = Trainer::with_zero3_groups(&b.varmap, &dist, opts(&format!("{o}[ddp]\nzero_stage = 3\n")), &groups).unwrap();
    assert_eq!(z3.zero3_stats(), (0, 0), "groups are sharded from the start");
    for s in 0..4 {
        let (x, y) = batch(8, s);
        let l = ddp.step(|| a.loss(&x, &y)).unwrap().loss;
        assert_eq!(z3.step(|| b.loss(&x, &y)).unwrap().loss, l, "step {s}: the forward differs");
        assert_eq!(z3.zero3_stats().1, 0, "step {s}: a stale group stayed whole after the update");
    }
    assert_eq!(ddp.flat_params().unwrap(), z3.flat_params().unwrap());
    let (gathers, _) = z3.zero3_stats();
    assert!(gathers >= 4 * 3, "{gathers} gathers in 4 steps of 3 groups");
    let (x, y) = batch(8, 9);
    let eval = b.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap();
    assert_eq!(eval, a.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap());
    let (after, whole) = z3.zero3_stats();
    assert_eq!((after - gathers, whole), (3, crate::zero3::KEEP), "a forward gathers each group once and keeps the last two");
    z3.unshard().unwrap();
    assert_eq!(z3.zero3_stats().1, 3);
    let read = |m: &VarMap| -> BTreeMap<String, Vec<f32>> {
        m.data().lock().unwrap().iter().map(|(k, v)| (k.clone(), v.flatten_all().unwrap().to_vec1().unwrap())).collect()
    };
    assert_eq!(read(&a.varmap), read(&b.varmap), "the model's own variables hold other values than DDP's");
    drop(z3);
    assert_eq!(b.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap(), eval, "the unsharded model outlives its trainer");
    // Dropped without `unshard`: the sharded layers read as NaN (never as an empty storage).
    let c = deep();
    drop(Trainer::with_zero3_groups(&c.varmap, &dist, opts(&format!("{o}[ddp]\nzero_stage = 3\n")), &groups).unwrap());
    assert!(c.loss(&x, &y).unwrap().to_scalar::<f32>().unwrap().is_nan());
}

/// Parameter groups (issue #31): by default biases are not decayed, so one SGD step with weight
/// decay 0.5 and one without (from the same weights, so with the same gradients) give the same
/// biases and other weights; a group that matches `l1.` gives its weight and bias a decay of
/// its own and twice the learning rate. After 3 steps DDP and ZeRO-1/2 (whose optimizer covers
/// the shard vector, laid out bucket by bucket from the last layer: another order than the flat
/// one) end bitwise equal.
#[test]
fn parameter_groups_decay_what_they_match() {
    let dist = world_of_one();
    let run = |extra: &str, zero: u8, steps: u64| {
        let m = small();
        let o = opts(&format!("[optim]\nkind = \"sgd\"\nlr = 0.1\n{extra}\n[ddp]\nzero_stage = {zero}\n"));
        let mut t = Trainer::new(&m.varmap, &dist, o).unwrap();
        for s in 0..steps {
            let (x, y) = batch(8, s);
            t.step(|| m.loss(&x, &y)).unwrap();
        }
        m.variables()
    };
    let plain = run("", 0, 1);
    let decayed = run("weight_decay = 0.5", 0, 1);
    for (k, v) in &plain {
        let same = v == &decayed[k];
        assert_eq!(same, k.ends_with("bias"), "`{k}`: decayed {}", !same);
    }
    let all = run("weight_decay = 0.5\ndecay_1d = true", 0, 1);
    assert_ne!(all["l1.bias"], plain["l1.bias"], "decay_1d = true decays biases");
    let grouped = "weight_decay = 0.5\ngroups = [{ match = [\"l1.\"], weight_decay = 0.2, lr_scale = 2.0 }]";
    let g = run(grouped, 0, 1);
    assert_ne!(g["l1.bias"], plain["l1.bias"]);
    assert_eq!(g["l2.bias"], plain["l2.bias"]);
    assert_eq!(g["l2.weight"], decayed["l2.weight"]);
    let g = run(grouped, 0, 3);
    for zero in [1, 2] {
        assert_eq!(run(grouped, zero, 3), g, "ZeRO-{zero} with parameter groups differs from DDP");
    }
    let o = TrainOptions::from_toml_str("[optim]\ngroups = [{ match = [\"nothing\"] }]\n").unwrap();
    let e = Trainer::new(&small().varmap, &dist, o).err().unwrap().to_string();
    assert!(e.contains("optim.groups[0] (match [\"nothing\"]) matches no parameter"), "{e}");
}

/// The `[train]` table's logging and checkpoints work for a user model: a JSON line per log
/// window carrying its last step's loss (as `kolo train` logs), TensorBoard events, a timeline, and a checkpoint
/// every `checkpoint_every` steps (written in the background) plus the last; the learning
/// rate follows `reference_batch` (8 examples per step against a reference of 4: doubled).
#[test]
fn logs_metrics_and_periodic_checkpoints() {
    let dist = world_of_one();
    let dir = std::env::temp_dir().join(format!("kolo-lib-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let toml = format!(
        "[optim]\nkind = \"sgd\"\nlr = 0.1\nreference_batch = 4\n[train]\nsteps = 5\nlog_every = 2\ncheckpoint_every = 2\ncheckpoint_dir = \"{0}/ck\"\n\
         checkpoint_background = true\njson_log = \"{0}/log-{{rank}}.jsonl\"\ntensorboard_dir = \"{0}/tb\"\ntimeline_dir = \"{0}/tl\"\n[data]\nbatch_size = 8\n",
        dir.display()
    );
    let s = small();
    let mut t = Trainer::new(&s.varmap, &dist, opts(&toml)).unwrap();
    let mut losses = Vec::new();
    for k in 0..5 {
        let (x, y) = batch(8, k);
        losses.push(f64::from(t.step(|| s.loss(&x, &y)).unwrap().loss));
    }
    let log = std::fs::read_to_string(dir.join("log-0.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 4, 5], "{log}");
    for (l, want) in lines.iter().zip([losses[1], losses[3], losses[4]]) {
        assert!((l["loss"].as_f64().unwrap() - want).abs() < 1e-6, "{l} vs {want}");
        assert!(l["samples_per_s"].as_f64().unwrap() > 0.0, "{l}");
        assert!((l["lr"].as_f64().unwrap() - 0.2).abs() < 1e-7, "{l}");
    }
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("tl/trace.json")).unwrap()).unwrap();
    let names: Vec<&str> = doc["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    assert_eq!(names.iter().filter(|n| **n == "forward + backward").count(), 5);
    assert!(names.iter().filter(|n| n.starts_with("bucket ")).count() >= 5, "{names:?}");
    let mut cks: Vec<String> = std::fs::read_dir(dir.join("ck")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    cks.sort();
    assert_eq!(cks, ["step-00000002", "step-00000004", "step-00000005"]);
    // The background write of step 4 is complete and loads.
    let c = small();
    let mut again = Trainer::new(&c.varmap, &dist, opts(&toml)).unwrap();
    assert_eq!(again.resume(dir.join("ck/step-00000004")).unwrap(), 4);
    assert!(std::fs::read_dir(dir.join("tb/rank0")).unwrap().next().is_some(), "no TensorBoard events");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train.on_nonfinite = "skip"` in the library: a step whose loss (so every gradient) is NaN
/// is skipped (`StepOutput::skipped`), the parameters and the optimizer stay as they were, and
/// the steps around it train; without the setting the same NaN stops the run at its log step.
#[test]
fn a_non_finite_step_is_skipped_by_the_library_when_asked() {
    let dist = world_of_one();
    let m = small();
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 3\nlog_every = 1\n";
    let mut t = Trainer::new(&m.varmap, &dist, opts(&format!("{sgd}on_nonfinite = \"skip\"\n"))).unwrap();
    let (x, y) = batch(8, 0);
    assert!(!t.step(|| m.loss(&x, &y)).unwrap().skipped);
    let after_first = t.flat_params().unwrap();
    let out = t.step(|| m.loss(&x, &y)? * f64::NAN).unwrap();
    assert!(out.skipped && out.stepped);
    assert_eq!(t.flat_params().unwrap(), after_first, "the skipped step left the parameters alone");
    assert!(!t.step(|| m.loss(&x, &y)).unwrap().skipped);
    assert!(t.flat_params().unwrap().iter().all(|v| v.is_finite()) && t.flat_params().unwrap() != after_first);
    let m = small();
    let mut t = Trainer::new(&m.varmap, &dist, opts(sgd)).unwrap();
    t.step(|| m.loss(&x, &y)).unwrap();
    let e = t.step(|| m.loss(&x, &y)? * f64::NAN).unwrap_err().to_string();
    assert!(e.contains("the run diverged"), "{e}");
}

/// `ddp.check_collectives` (kolo train's debugging setting) works from the library: on 2
/// thread-ranks it trains bitwise as without it, and when the ranks bucket their gradients
/// differently (rank 1 with buckets of 64 bytes), so that their all-reduces differ in
/// size, the update fails on both (a collective mismatch, or on the rank still reducing its next
/// bucket the other's departure), each naming the other rank, instead of summing misaligned
/// buffers.
#[test]
fn checked_collectives_train_alike_and_name_a_mismatch() {
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.5\n";
    let run = |toml: [String; 2]| -> Vec<Result<Vec<f32>, String>> {
        let ranks = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(2).unwrap());
        std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .zip(toml.clone())
                .map(|(c, t)| {
                    s.spawn(move || -> Result<Vec<f32>, String> {
                        let dist = Dist::of_comm(std::sync::Arc::new(c));
                        let m = small();
                        let mut t = Trainer::new(&m.varmap, &dist, opts(&t)).map_err(|e| e.to_string())?;
                        for s in 0..2 {
                            let (x, y) = batch(8, s);
                            t.step(|| m.loss(&x, &y)).map_err(|e| e.to_string())?;
                        }
                        t.flat_params().map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    let checked = format!("{sgd}[ddp]\ncheck_collectives = true\n");
    let plain = run([sgd.to_string(), sgd.to_string()]);
    let with = run([checked.clone(), checked.clone()]);
    assert_eq!(plain[0].as_ref().unwrap(), with[0].as_ref().unwrap(), "checked collectives changed the training");
    let apart = run([checked.clone(), format!("{checked}bucket_cap = \"64B\"\nfirst_bucket_cap = \"64B\"\n")]);
    let errors: Vec<&String> = apart
        .iter()
        .enumerate()
        .map(|(r, got)| got.as_ref().err().unwrap_or_else(|| panic!("rank {r}: differently bucketed ranks trained on")))
        .collect();
    // The first to compare names the mismatch; its peer may fail on its next bucket, naming the
    // rank that left.
    // Checked's fingerprints name the call's number ("as call #4"); the transport's own check
    // would not.
    assert!(errors.iter().any(|e| e.contains("collective mismatch") && e.contains("as call #")), "{errors:?}");
    for (r, e) in errors.iter().enumerate() {
        assert!(e.contains(&format!("rank {}", 1 - r)), "rank {r} does not name the other rank: {e}");
    }
}

/// `train.eval_every`: the trainer says an evaluation is due after optimizer steps 2 and 4 of
/// 5 and after the last, never in the middle of an accumulation; `log_eval` takes it.
#[test]
fn evaluations_are_due_every_eval_every_steps_and_at_the_end() {
    let dist = world_of_one();
    let m = small();
    let o = TrainOptions::new().optimizer(crate::options::OptimKind::Sgd, 0.1).steps(5).grad_accum(2).eval_every(2);
    let mut t = Trainer::new(&m.varmap, &dist, o).unwrap();
    let mut due = Vec::new();
    for call in 0..10 {
        let (x, y) = batch(4, call);
        t.step(|| m.loss(&x, &y)).unwrap();
        if t.eval_due() {
            due.push((call, t.steps_done()));
            t.log_eval(&crate::Eval { loss: 1.0, accuracy: None, examples: 4 });
        }
    }
    assert_eq!(due, [(3, 2), (7, 4), (9, 5)], "(call, steps done) at which an evaluation was due");
}

/// `Trainer::sampler` deals `[data] batch_size` examples per micro-step over the replicas,
/// shuffled from `train.seed` as kolo train's sampler is (`kolo_train::sampler`), and starts
/// at the data position; without a batch size it is an error naming it.
#[test]
fn the_trainers_sampler_is_kolo_trains() {
    let dist = world_of_one();
    let m = small();
    let build = |o: TrainOptions| Trainer::new(&m.varmap, &dist, o.optimizer(crate::options::OptimKind::Sgd, 0.1)).unwrap();
    let kolo_train = |seed: u64, shuffle: bool| {
        let cfg = crate::data::SamplerConfig { len: 50, world: 1, rank: 0, batch: 4, seed, shuffle, drop_last: true };
        let mut s = crate::data::Sampler::new(cfg, Default::default()).unwrap();
        (0..20).map(|_| s.next_batch()).collect::<Vec<_>>()
    };
    let drawn = |t: &Trainer| {
        let mut s = t.sampler(50).unwrap();
        (0..20).map(|_| s.next_batch()).collect::<Vec<_>>()
    };
    let seeded = build(TrainOptions::new().batch(4, 1).seed(7));
    assert_eq!(drawn(&seeded), kolo_train(7, true));
    assert_ne!(drawn(&seeded), kolo_train(0, true), "the seed changes the order");
    let mut opts = TrainOptions::new().batch(4, 1);
    opts.data.shuffle = false;
    assert_eq!(drawn(&build(opts)), kolo_train(0, false));
    // From the data position set (or resumed): the next batch.
    let mut t = build(TrainOptions::new().batch(4, 1).seed(7));
    let mut s = t.sampler(50).unwrap();
    s.next_batch();
    t.set_data_position(s.position());
    assert_eq!(t.sampler(50).unwrap().next_batch(), kolo_train(7, true)[1]);
    match build(TrainOptions::new()).sampler(50) {
        Err(crate::Error::Setting { setting, .. }) => assert_eq!(setting, "data.batch_size"),
        other => panic!("a sampler without a batch size: {other:?}"),
    }
}

/// `ddp.timeout_secs` and `ddp.liveness_secs` are the communicator's: a communicator started
/// from `TrainOptions::init_options` has them, and one started with other deadlines is an
/// error naming the setting and the way to start it (it was ignored before).
#[test]
fn the_communicators_deadlines_are_the_options() {
    use crate::dist::Backend;
    for (toml, setting) in [("[ddp]\nliveness_secs = 3\n", "ddp.liveness_secs"), ("[ddp]\ntimeout_secs = 7.5\n", "ddp.timeout_secs")] {
        let o = opts(toml);
        let m = small();
        match Trainer::new(&m.varmap, &world_of_one(), o.clone()) {
            Err(crate::Error::Setting { setting: s, reason }) => {
                assert_eq!(s, setting);
                assert!(reason.contains("kolo::init_with(&opts.init_options())"), "{reason}");
            }
            other => panic!("{toml}: a communicator with the default deadlines was taken: {:?}", other.err()),
        }
        let started = crate::init_with(&crate::InitOptions { backend: Backend::Builtin, ..o.init_options() }).unwrap();
        let d = started.deadlines.unwrap();
        assert_eq!((d.timeout.as_secs_f64(), d.liveness.as_secs_f64()), (o.ddp.timeout_secs, o.ddp.liveness_secs));
        Trainer::new(&m.varmap, &started, o).unwrap();
    }
}

/// `ddp.deterministic`: the micro-batch is taken in pieces (`Trainer::step_pieces`), whose
/// exact mean trains as the whole batch does (within f32 rounding); `step` and `backward` name
/// the call to use instead, and without `[data] batch_size` the pieces are unknown.
#[test]
fn deterministic_mode_trains_in_pieces_and_names_the_call() {
    let dist = world_of_one();
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.5\n[data]\nbatch_size = 8\n";
    let (a, b) = (small(), small());
    let mut whole = Trainer::new(&a.varmap, &dist, opts(sgd)).unwrap();
    let mut pieces = Trainer::new(&b.varmap, &dist, opts(&format!("{sgd}[ddp]\ndeterministic = true\ndeterministic_chunk = 2\n"))).unwrap();
    for s in 0..3 {
        let (x, y) = batch(8, s);
        let w = whole.step_pieces(|r| a.loss(&x.narrow(0, r.start, r.len())?, &y.narrow(0, r.start, r.len())?)).unwrap();
        let mut seen = Vec::new();
        let p = pieces
            .step_pieces(|r| {
                seen.push(r.clone());
                b.loss(&x.narrow(0, r.start, r.len())?, &y.narrow(0, r.start, r.len())?)
            })
            .unwrap();
        assert_eq!(seen, [0..2, 2..4, 4..6, 6..8], "the pieces of one micro-batch");
        assert!(w.stepped && p.stepped && (w.loss - p.loss).abs() < 1e-6, "losses {} and {}", w.loss, p.loss);
    }
    let d = max_abs_diff(&whole.flat_params().unwrap(), &pieces.flat_params().unwrap());
    assert!(d < 1e-6, "pieces and the whole batch differ by {d}");
    let (x, y) = batch(8, 9);
    match pieces.step(|| b.loss(&x, &y)) {
        Err(crate::Error::Usage { op, reason, .. }) => {
            assert!(op == "Trainer::backward" && reason.contains("Trainer::step_pieces"), "{reason}")
        }
        other => panic!("step under ddp.deterministic: {:?}", other.err()),
    }
    let mut unsized_ = Trainer::new(&b.varmap, &dist, opts("[ddp]\ndeterministic = true\n")).unwrap();
    match unsized_.step_pieces(|_| b.loss(&x, &y)) {
        Err(crate::Error::Setting { setting, .. }) => assert_eq!(setting, "data.batch_size"),
        other => panic!("step_pieces without a batch size: {:?}", other.err()),
    }
}

/// `strategy = "ps"`: the `Trainer` (DDP) names `kolo::PsWorker`, and the worker refuses what
/// it cannot do yet (before it connects to anything), each naming the setting.
#[test]
fn parameter_server_settings_name_the_worker_and_its_limits() {
    let m = small();
    let ps = || TrainOptions::new().strategy(crate::options::Strategy::Ps);
    match Trainer::new(&m.varmap, &world_of_one(), ps()) {
        Err(crate::Error::Setting { setting, reason }) => {
            assert!(setting == "train.strategy" && reason.contains("kolo::PsWorker"), "{reason}")
        }
        other => panic!("the Trainer under strategy = ps: {:?}", other.err()),
    }
    #[cfg(feature = "ps")]
    {
        let me = crate::PsJoin {
            worker: 0,
            workers: 1,
            coordinator: "127.0.0.1:9".into(),
            token: kolo_rendezvous::JobToken::generate(),
            servers: None,
            taken_over: false,
        };
        for (opts, want) in [
            (TrainOptions::new(), "train.strategy"),
            // kolo train's own rule, with its message.
            (ps().precision(crate::options::Precision::Bf16), "train.strategy"),
            (ps().device("cuda"), "train.device"),
        ] {
            match crate::PsWorker::connect(&m.varmap, opts, me.clone()) {
                Err(crate::Error::Setting { setting, .. }) => assert_eq!(setting, want),
                other => panic!("{want}: {:?}", other.err()),
            }
        }
    }
}
