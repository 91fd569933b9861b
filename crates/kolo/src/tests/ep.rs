//! `kolo::ep::MoeLayer` over in-process groups of threads (`LocalComm`) against the whole layer
//! in one thread: outputs and every gradient.

use super::values;
use crate::ep::{ExpertParallel, MoeConfig, MoeLayer};
use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use kolo_comm::{Communicator, LocalComm};
use std::collections::BTreeMap;

/// A user's expert: Mixtral's SwiGLU (`w2(silu(w1 x) * w3 x)`).
struct SwiGlu {
    w1: candle_nn::Linear,
    w2: candle_nn::Linear,
    w3: candle_nn::Linear,
}

impl Module for SwiGlu {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.w2.forward(&(candle_nn::ops::silu(&self.w1.forward(x)?)? * self.w3.forward(x)?)?)
    }
}

const HIDDEN: usize = 5;
const INNER: usize = 3;
const TOKENS: usize = 7;

fn swiglu(vb: VarBuilder) -> candle_core::Result<SwiGlu> {
    Ok(SwiGlu {
        w1: candle_nn::linear_no_bias(HIDDEN, INNER, vb.pp("w1"))?,
        w2: candle_nn::linear_no_bias(INNER, HIDDEN, vb.pp("w2"))?,
        w3: candle_nn::linear_no_bias(HIDDEN, INNER, vb.pp("w3"))?,
    })
}

fn cfg() -> MoeConfig {
    // Capacity ceil(1.0 x 7 x 2 / 6) = 3 per expert: some assignments are dropped.
    MoeConfig { experts: 6, top_k: 2, renormalize: true, capacity_factor: 1.0, aux_weight: 0.01, scoring: Default::default(), groups: None }
}

/// Every variable of `varmap` set to deterministic values drawn by its name.
fn fill(varmap: &VarMap) {
    for (name, var) in varmap.data().lock().unwrap().iter() {
        let seed = name.bytes().fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let v: Vec<f32> = values(var.elem_count(), seed).into_iter().map(|x| x as f32).collect();
        var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap()).unwrap();
    }
}

/// Rank `r`'s tokens (1, 7, 5) and the weights of its loss `sum(y * c) + aux`.
fn input(r: usize) -> (Var, Tensor) {
    let x = Tensor::from_vec(
        values(TOKENS * HIDDEN, 100 + r as u64).into_iter().map(|v| v as f32).collect::<Vec<_>>(),
        (1, TOKENS, HIDDEN),
        &Device::Cpu,
    );
    let c = Tensor::from_vec(
        values(TOKENS * HIDDEN, 200 + r as u64).into_iter().map(|v| v as f32).collect::<Vec<_>>(),
        (1, TOKENS, HIDDEN),
        &Device::Cpu,
    );
    (Var::from_tensor(&x.unwrap()).unwrap(), c.unwrap())
}

/// The layer's output on rank `r`'s input and the gradients of its loss: every variable of
/// `varmap` by name, and the input as `input`.
fn run(layer: &MoeLayer<SwiGlu>, varmap: &VarMap, r: usize) -> (Tensor, BTreeMap<String, Tensor>) {
    let (x, c) = input(r);
    let (y, aux) = layer.forward(x.as_tensor()).unwrap();
    let loss = ((&y * &c).unwrap().sum_all().unwrap() + aux).unwrap();
    let g = loss.backward().unwrap();
    let mut grads: BTreeMap<String, Tensor> =
        varmap.data().lock().unwrap().iter().filter_map(|(n, v)| g.get(v.as_tensor()).map(|t| (n.clone(), t.clone()))).collect();
    grads.insert("input".into(), g.get(x.as_tensor()).unwrap().clone());
    (y, grads)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// Six experts over 2 and 3 ranks, each routing its own 7 tokens to the top 2 within a
/// capacity of 3 (some dropped): each rank's output and input gradient equal the whole layer's
/// on its tokens, its gate gradient the whole layer's for its loss alone, and each expert's
/// gradient the sum over every rank's loss (the tokens of all of them reached it) within 1e-5.
#[test]
fn an_expert_parallel_moe_layer_equals_the_whole_layer() {
    for p in [2usize, 3] {
        let whole_vars = VarMap::new();
        let whole = MoeLayer::new(HIDDEN, cfg(), VarBuilder::from_varmap(&whole_vars, DType::F32, &Device::Cpu), None, swiglu).unwrap();
        fill(&whole_vars);
        let reference: Vec<(Tensor, BTreeMap<String, Tensor>)> = (0..p).map(|r| run(&whole, &whole_vars, r)).collect();
        let load = whole.take_load();
        assert!(load.dropped > 0 && load.dropped < load.assigned, "the capacity should drop some assignments: {load:?}");
        let ranks = LocalComm::create(kolo_base::WorldSize::new(p).unwrap());
        std::thread::scope(|s| {
            for c in ranks {
                let reference = &reference;
                s.spawn(move || {
                    let r = c.rank().get();
                    let ep = ExpertParallel::new(std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator>);
                    let vars = VarMap::new();
                    let layer =
                        MoeLayer::new(HIDDEN, cfg(), VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), Some(&ep), swiglu).unwrap();
                    assert_eq!(layer.held(), r * 6 / p..(r + 1) * 6 / p);
                    assert_eq!(vars.data().lock().unwrap().len(), 1 + 3 * 6 / p, "the gate and this rank's experts only");
                    fill(&vars);
                    let (y, grads) = run(&layer, &vars, r);
                    let d = max_diff(&y, &reference[r].0);
                    assert!(d < 1e-5, "{p} ranks, rank {r}: output off by {d}");
                    for (name, g) in &grads {
                        // An expert's gradient: every rank's loss (a rank that routed it nothing
                        // has none).
                        let want = if name.starts_with("experts.") {
                            let mut sum = g.zeros_like().unwrap();
                            for other in reference {
                                if let Some(t) = other.1.get(name) {
                                    sum = (sum + t).unwrap();
                                }
                            }
                            sum
                        } else {
                            reference[r].1[name].clone()
                        };
                        let d = max_diff(g, &want);
                        assert!(d < 1e-5, "{p} ranks, rank {r}: the gradient of `{name}` is off by {d}");
                    }
                });
            }
        });
    }
}

/// Experts that do not split evenly over the group are refused naming the numbers.
#[test]
fn experts_that_do_not_split_are_named() {
    let ranks = LocalComm::create(kolo_base::WorldSize::new(4).unwrap());
    std::thread::scope(|s| {
        for c in ranks {
            s.spawn(move || {
                let ep = ExpertParallel::new(std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator>);
                let vars = VarMap::new();
                let e = MoeLayer::new(HIDDEN, cfg(), VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), Some(&ep), swiglu)
                    .err()
                    .unwrap();
                assert!(e.to_string().contains("6 experts cannot be dealt out evenly over 4 expert-parallel ranks"), "{e}");
            });
        }
    });
}

/// Experts that no token reaches in a call still get a gradient, of zeros (the trainer wants
/// one for every parameter each step; candle would give none): 2 tokens, top-1, 6 experts.
#[test]
fn experts_no_token_reached_get_zero_gradients() {
    let vars = VarMap::new();
    let cfg = MoeConfig {
        experts: 6,
        top_k: 1,
        renormalize: false,
        capacity_factor: 6.0,
        aux_weight: 0.0,
        scoring: Default::default(),
        groups: None,
    };
    let layer = MoeLayer::new(HIDDEN, cfg, VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), None, swiglu).unwrap();
    fill(&vars);
    let x = input(0).0.as_tensor().narrow(1, 0, 2).unwrap();
    let (y, aux) = layer.forward(&x).unwrap();
    let g = (y.sum_all().unwrap() + aux).unwrap().backward().unwrap();
    let load = layer.take_load();
    assert!(load.load.iter().filter(|l| **l == 0).count() >= 4, "{load:?}");
    for (name, var) in vars.data().lock().unwrap().iter() {
        let grad = g.get(var.as_tensor()).unwrap_or_else(|| panic!("`{name}` has no gradient"));
        let expert = name.strip_prefix("experts.").and_then(|r| r.split('.').next()).map(|j| j.parse::<usize>().unwrap());
        let norm = grad.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
        match expert {
            Some(j) if load.load[j] == 0 => assert_eq!(norm, 0.0, "`{name}`: an idle expert's gradient"),
            _ => assert!(norm > 0.0, "`{name}`: no gradient"),
        }
    }
}

/// A user's `MoeLayer` over a sequence-parallel group (`over_sequence`: 2 threads, each routing
/// its chunk of 7 of the 14 tokens of one sequence): the mean of the members' auxiliary losses
/// is the whole sequence's (one layer on the 14 tokens), and so is the mean of their gradients
/// of the gate, within 1e-6. Without it each chunk's loss is its own (the mean parts from the
/// whole by more than 1e-4).
#[test]
fn a_moe_layer_over_sequence_chunks_has_the_whole_sequences_auxiliary_loss() {
    let cfg = MoeConfig { capacity_factor: 3.0, aux_weight: 0.5, ..cfg() };
    let whole_x = Tensor::cat(&[input(0).0.as_tensor(), input(1).0.as_tensor()], 1).unwrap();
    let build = |sp: Option<&crate::sp::SequenceParallel>| {
        let varmap = VarMap::new();
        let layer = MoeLayer::new(HIDDEN, cfg.clone(), VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), None, swiglu).unwrap();
        fill(&varmap);
        (
            varmap,
            match sp {
                Some(sp) => layer.over_sequence(sp),
                None => layer,
            },
        )
    };
    let aux_and_gate_grad = |varmap: &VarMap, layer: &MoeLayer<SwiGlu>, x: &Tensor| {
        let (_, aux) = layer.forward(x).unwrap();
        let g = aux.backward().unwrap();
        let gate = varmap.data().lock().unwrap()["gate.weight"].clone();
        (aux.to_scalar::<f32>().unwrap(), g.get(gate.as_tensor()).unwrap().clone())
    };
    let (varmap, layer) = build(None);
    let (want, want_grad) = aux_and_gate_grad(&varmap, &layer, &whole_x);
    for over in [true, false] {
        let ranks = LocalComm::create(kolo_base::WorldSize::new(2).unwrap());
        let got: Vec<(f32, Tensor)> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|c| {
                    let x = whole_x.narrow(1, c.rank().get() * TOKENS, TOKENS).unwrap();
                    s.spawn(move || {
                        let sp = crate::sp::SequenceParallel::new(std::sync::Arc::new(c));
                        let (varmap, layer) = build(over.then_some(&sp));
                        aux_and_gate_grad(&varmap, &layer, &x)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mean = (got[0].0 + got[1].0) / 2.0;
        let grad = ((&got[0].1 + &got[1].1).unwrap() / 2.0).unwrap();
        let (d, dg) = ((mean - want).abs(), max_diff(&grad, &want_grad));
        if over {
            assert!(d < 1e-6 && dg < 1e-6, "over the sequence: aux {mean} against {want}, gate gradient off by {dg}");
        } else {
            assert!(d > 1e-4, "per chunk the mean aux {mean} equals the whole's {want}: the test would prove nothing");
        }
    }
}
