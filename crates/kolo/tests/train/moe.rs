//! Expert parallelism (mixture of experts) against one process and DDP, and its refused settings.

use super::*;

/// Expert parallelism, one step by hand: W ranks each hold 4 / W experts and route their own
/// shard's tokens through two all-to-alls; the assembled gradient (shared parameters averaged,
/// each expert's divided by W) equals one process computing the mean of the W shards' losses
/// with every expert local (top-1 and top-2, with tokens dropped by the capacity).
#[test]
fn expert_parallel_gradients_match_one_process() {
    use kolo_base::Rng;
    use kolo_comm::{BufMut, ReduceOp};
    use kolo_tensor::models::{Gpt, GptConfig, MoeConfig};
    use kolo_tensor::{Batch, Input, Model, PlainView};
    for (world, k, cf) in [(2, 1, 1.0), (4, 2, 1.25), (2, 2, 0.5)] {
        let cfg = GptConfig {
            vocab: 13,
            seq: 8,
            d_model: 16,
            n_head: 2,
            n_layer: 2,
            moe: Some(MoeConfig {
                experts: 4,
                top_k: k,
                renormalize: k > 1,
                capacity_factor: cf,
                aux_weight: 0.01,
                scoring: Default::default(),
                groups: None,
            }),
        };
        let shard = |r: usize| -> Batch {
            let mut g = Rng::new(100 + r as u64);
            let n = 2 * cfg.seq;
            Batch {
                input: Input::Tokens { ids: (0..n).map(|_| g.below(13) as u32).collect(), b: 2, t: cfg.seq },
                targets: (0..n).map(|_| g.below(13) as u32).collect(),
            }
        };
        // One process: the mean of the shards' losses.
        let one = Gpt::new(cfg.clone(), &mut Rng::new(5)).unwrap();
        let losses: Vec<kolo_tensor::Tensor> =
            (0..world).map(|r| (one.loss(&shard(r), &PlainView).unwrap() / world as f64).unwrap()).collect();
        let total = losses.iter().skip(1).fold(losses[0].clone(), |t, l| t.add(l).unwrap());
        let grads = total.backward().unwrap();
        let mut want = vec![0f32; one.params().numel()];
        one.params().grads_into(&grads, &mut want).unwrap();
        let want_load = one.take_moe_load().unwrap();
        let got = run_ranks(LocalComm::create(WorldSize::new(world).unwrap()), |r, c| {
            let comm: Arc<dyn Communicator> = Arc::new(c);
            let ep = kolo::ep::ExpertParallel::new(comm.clone());
            let gpt = Gpt::new_expert_parallel(cfg.clone(), &mut Rng::new(5), ep.exchange()).unwrap();
            let loss = gpt.loss(&shard(r), &PlainView).unwrap();
            let g = loss.backward().unwrap();
            let mut local = vec![0f32; gpt.params().numel()];
            gpt.params().grads_into(&g, &mut local).unwrap();
            let expert = gpt.expert_params().unwrap();
            for (i, p) in gpt.params().iter().enumerate() {
                if expert[i] {
                    local[p.range.clone()].iter_mut().for_each(|x| *x /= world as f32);
                }
            }
            let mut shared = vec![0f32; gpt.full_numel()];
            gpt.ep_pieces_into(&local, &mut shared, false, true).unwrap();
            comm.all_reduce(BufMut::from(&mut shared[..]), ReduceOp::Avg).unwrap();
            let mut experts = vec![0f32; gpt.full_numel()];
            gpt.ep_pieces_into(&local, &mut experts, true, false).unwrap();
            comm.all_reduce(BufMut::from(&mut experts[..]), ReduceOp::Sum).unwrap();
            (shared.iter().zip(&experts).map(|(a, b)| a + b).collect::<Vec<f32>>(), gpt.take_moe_load().unwrap())
        });
        let (g0, l0) = &got[0];
        let d = max_diff(g0, &want);
        assert!(d < 1e-5, "world {world}, top-{k}: max gradient difference {d}");
        // Every rank routed its own tokens: the loads add up to the one process's.
        let mut load = vec![0u64; 4];
        let mut dropped = 0;
        for (_, l) in &got {
            load.iter_mut().zip(&l.load).for_each(|(a, b)| *a += b);
            dropped += l.dropped;
        }
        assert_eq!((load, dropped), (want_load.load.clone(), want_load.dropped), "world {world}, top-{k}");
        assert_eq!(l0.load.len(), 4);
        if cf < 1.0 {
            assert!(want_load.dropped > 0);
        }
    }
}

/// Expert-parallel training (ep 2 and 4 on as many ranks, and dp 4 x ep 2) follows DDP with
/// every expert on every rank over the same ranks, and reports the per-expert load.
#[test]
fn expert_parallel_training_matches_ddp_with_replicated_experts() {
    for (world, ep) in [(2, 2), (4, 4), (4, 2)] {
        let ddp = train_on(world, &moe_cfg(8 / world, ""), &quiet());
        let ranks = train_on(world, &moe_cfg(8 / world, &format!("[mesh]\nep = {ep}\n")), &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "ep {ep}: every rank assembles the same model");
        }
        assert_eq!(ranks[0].params.len(), ddp[0].params.len());
        assert!(ranks[0].states.params < ddp[0].states.params, "ep {ep}: each rank holds a share of the experts");
        let d = max_diff(&ranks[0].params, &ddp[0].params);
        assert!(d < 1e-4, "world {world}, ep {ep}: max parameter difference {d}");
        assert!(
            (ranks[0].last_loss - ddp[0].last_loss).abs() < 1e-4,
            "world {world} ep {ep}: loss {} vs {}",
            ranks[0].last_loss,
            ddp[0].last_loss
        );
        let (a, b) = (ranks[0].moe.as_ref().unwrap(), ddp[0].moe.as_ref().unwrap());
        assert_eq!(a, b, "ep {ep}: the same routing");
        // 3 steps x 8 sequences x 16 tokens x 2 layers, top-1.
        assert_eq!(a.assigned, 3 * 8 * 16 * 2);
        assert!(ranks[0].eval.is_some());
    }
}

/// ZeRO-1/2 and gradient accumulation beside expert parallelism: dp 2 x ep 2 accumulating 2
/// micro-batches under ZeRO-1 and ZeRO-2 follows DDP with every expert on every rank (the same
/// accumulation) within 1e-4, the routing the same, and keeps less optimizer state than
/// plain dp 2 x ep 2.
#[test]
fn zero_and_accumulation_beside_expert_parallelism_match_ddp() {
    let accum = "grad_accum = 2\n";
    let ddp = &train_on(4, &moe_cfg(2, accum), &quiet())[0];
    let mesh = "[mesh]\nep = 2\n";
    let plain = &train_on(4, &moe_cfg(2, &format!("{accum}{mesh}")), &quiet())[0];
    for stage in 0..=2 {
        let ranks = train_on(4, &moe_cfg(2, &format!("{accum}[ddp]\nzero_stage = {stage}\n{mesh}")), &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "ZeRO-{stage} x ep 2: every rank assembles the same model");
        }
        let d = max_diff(&ranks[0].params, &ddp.params);
        assert!(d < 1e-4, "ZeRO-{stage} x ep 2, accumulating 2: max parameter difference {d} from DDP");
        assert!((ranks[0].last_loss - ddp.last_loss).abs() < 1e-4, "ZeRO-{stage} x ep 2: loss {} vs {}", ranks[0].last_loss, ddp.last_loss);
        assert_eq!(ranks[0].moe, ddp.moe, "ZeRO-{stage} x ep 2: the same routing");
        if stage > 0 {
            let (z, p) = (&ranks[0].states, &plain.states);
            assert!(z.optimizer < p.optimizer, "ZeRO-{stage} x ep 2 keeps {} optimizer bytes, plain ep {}", z.optimizer, p.optimizer);
        }
    }
}

/// Activation checkpointing of mixture-of-experts blocks (each block's output and auxiliary
/// loss come out of one recomputing op): DDP on 2 ranks and dp 2 x ep 2 (the recomputation's
/// all-to-alls run again in backward), in f32 and bf16, with every block checkpointed end
/// bitwise where the same runs without it end, evaluate alike, and count each token's routing
/// once.
#[test]
fn checkpointed_expert_blocks_change_memory_not_training() {
    for (world, mesh) in [(2, ""), (4, "[mesh]\nep = 2\n"), (4, "precision = \"bf16\"\n[mesh]\nep = 2\n")] {
        let with = |blocks: &[usize]| {
            let mut cfg = moe_cfg(2, mesh);
            cfg.model.checkpoint_blocks = blocks.to_vec();
            train_on(world, &cfg, &quiet())
        };
        let (plain, ck) = (with(&[]), with(&[0, 1]));
        for (a, b) in ck.iter().zip(&plain) {
            assert!(a.params == b.params, "{mesh:?}: parameters differ by {}", max_diff(&a.params, &b.params));
            assert_eq!(a.last_loss, b.last_loss, "{mesh:?}");
            assert_eq!(a.eval, b.eval, "{mesh:?}");
            assert_eq!(a.moe, b.moe, "{mesh:?}: the routing counted");
        }
        assert_eq!(
            ck[0].moe.as_ref().unwrap().assigned,
            3 * 2 * world as u64 * 16 * 2,
            "{mesh:?}: 3 steps of every rank's tokens, 2 layers"
        );
    }
}

/// Local SGD beside expert parallelism: each data-parallel replica is an expert-parallel group
/// that steps alone between averagings (its members' shared parameters' gradients summed every
/// step, as DDP's are; every expert's replicas averaged over dp). On dp 2 x ep 2:
/// - averaging after every step with plain SGD is DDP (the mean of the replicas' updates is the
///   update of the mean gradient): within 1e-6 of dp 2 x ep 2 without local SGD;
/// - averaging every 3 steps, after step 4 the two members of a replica assemble the same
///   model and the replicas differ;
/// - stopped at step 2 (its checkpoint holds each replica's own model) and resumed, the run
///   ends bitwise where the uninterrupted one does on every rank.
#[test]
fn local_sgd_beside_expert_parallelism_steps_each_replica_alone() {
    let dir = scratch_dir("ep-local-sgd");
    let ck = dir.join("ck");
    let cfg = |steps: u64, local: &str| {
        let mut c = moe_cfg(2, &format!("[ddp]\n{local}\n[mesh]\nep = 2\n"));
        c.optim.kind = kolo_train::config::OptimKind::Sgd;
        c.optim.lr = 0.3;
        c.optim.clip_grad_norm = None;
        c.train.steps = steps;
        c.train.checkpoint_dir = Some(ck.display().to_string());
        c.train.checkpoint_every = 2;
        c
    };
    let ddp = train_on(4, &cfg(3, ""), &quiet());
    let every_step = train_on(4, &cfg(3, "local_sgd = { every = 1 }"), &quiet());
    let moved = max_diff(&ddp[0].params, &train_on(4, &cfg(1, ""), &quiet())[0].params);
    for (r, (a, b)) in every_step.iter().zip(&ddp).enumerate() {
        let d = max_diff(&a.params, &b.params);
        assert!(d < 1e-6, "rank {r}: local SGD averaging every step is {d} from DDP (steps 2-3 moved {moved})");
    }
    assert!(moved > 1e-3, "the parameters moved by {moved} only");

    let run = cfg(4, "local_sgd = { every = 3 }");
    let full = train_on(4, &run, &quiet());
    assert!(full[0].params == full[1].params && full[2].params == full[3].params, "the members of a replica part");
    let apart = max_diff(&full[0].params, &full[2].params);
    assert!(apart > 1e-4, "the replicas are {apart} apart after a local step");
    train_on(4, &run, &RunOptions { stop_after: Some(2), ..quiet() });
    let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
    for (r, (a, b)) in train_on(4, &run, &resume).iter().zip(&full).enumerate() {
        assert!(a.params == b.params, "rank {r}: resumed vs uninterrupted: {}", max_diff(&a.params, &b.params));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Mixture-of-experts settings that cannot work are refused with the field's name.
#[test]
fn bad_moe_settings_are_refused() {
    let try_parse = |extra_model: &str, rest: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n{extra_model}\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n{rest}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(try_parse("experts = 4\ntop_k = 5", "").contains("top_k from 1 to experts"));
    assert!(try_parse("experts = 4\ntop_k = 0", "").contains("top_k"));
    assert!(try_parse("experts = 0", "").contains("experts"));
    assert!(try_parse("experts = 4\ncapacity_factor = 0.0", "").contains("capacity_factor"));
    assert!(try_parse("experts = 3", "[mesh]\nep = 2\n").contains("multiple of mesh.ep"));
    assert!(try_parse("", "[mesh]\nep = 2\n").contains("set model.experts"));
    assert!(try_parse("experts = 4", "[mesh]\ntp = 2\n").contains("without tp"));
    assert!(try_parse("experts = 4", "[train]\nprecision = \"bf16\"\n[mesh]\nep = 2\n").is_empty());
    assert!(try_parse("experts = 4\ncheckpoint_blocks = [0, 1]", "[mesh]\nep = 2\n").is_empty());
    assert!(try_parse("experts = 4", "[train]\ngrad_accum = 2\n[ddp]\nzero_stage = 2\n[mesh]\nep = 2\n").is_empty());
    assert!(try_parse("experts = 4", "[ddp]\nlocal_sgd = { every = 2 }\n[mesh]\nep = 2\n").is_empty());
    assert!(try_parse("experts = 4", "[ddp]\ncompression = { method = \"fp16\" }\n[mesh]\nep = 2\n")
        .contains("mesh.ep > 1 runs without compression"));
    assert!(try_parse("", "[ddp]\nzero_stage = 3\n[mesh]\nsp = 2\n").is_empty());
    assert!(try_parse("", "[ddp]\nlocal_sgd = { every = 2 }\n[mesh]\nsp = 2\n").is_empty());
    assert!(try_parse("checkpoint_blocks = [0]", "[mesh]\nsp = 2\n").is_empty());
    assert!(try_parse("", "[ddp]\ncompression = { method = \"fp16\" }\n[mesh]\nsp = 2\n").contains("mesh.sp > 1 runs without compression"));
}

/// Mixed precision beside expert parallelism: dp 2 x ep 2 in bf16 and f16 (the experts' f32
/// parameters cast where used, tokens moved by the all-to-all in the compute dtype) follows
/// DDP with every expert on every rank in the same dtype, 6 SGD steps on the same batches. Not
/// bitwise: the experts multiply their tokens in other batches, and in bf16 a token near a
/// tie may pick another expert. Off by 0.25 (bf16) and 0.43 (f16) times the dtype's own noise
/// (DDP in bf16 against f32: 1.6 % of the update's norm, f16 0.05 %); bound: that noise. The
/// precision is real: ep is at least half the noise away from f32.
#[test]
fn mixed_precision_beside_expert_parallelism_follows_ddp() {
    let mk = |extra: &str| {
        let mut c = moe_cfg(2, extra);
        (c.optim.kind, c.optim.lr, c.optim.clip_grad_norm, c.train.steps) = (kolo_train::config::OptimKind::Sgd, 0.5, None, 6);
        c
    };
    let cfg = mk("");
    let start = initial_params(&cfg);
    let f32_ddp = &train_on(4, &cfg, &quiet())[0];
    for precision in ["bf16", "f16"] {
        let p = format!("precision = \"{precision}\"\n");
        let ddp = &train_on(4, &mk(&p), &quiet())[0];
        let ranks = train_on(4, &mk(&format!("{p}[mesh]\nep = 2\n")), &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "{precision} x ep 2: every rank assembles the same model");
        }
        let update = distance(&ddp.params, &start);
        let noise = distance(&ddp.params, &f32_ddp.params) / update;
        let off = distance(&ranks[0].params, &ddp.params) / update;
        assert!(off < noise.min(0.3), "{precision} x ep 2: off by {off:.5} of the update from DDP, the dtype's own noise {noise:.5}");
        let from_f32 = distance(&ranks[0].params, &f32_ddp.params) / update;
        assert!(from_f32 > noise / 2.0, "{precision} x ep 2: {from_f32:.6} of the update from f32: it computed in f32");
        assert_eq!(ranks[0].loss_scale.is_some(), precision == "f16");
    }
}

/// Parameter groups beside expert parallelism: AdamW with weight decay 0.1 on matrices only
/// (nanoGPT's default groups: biases, norms and embeddings undecayed), dp 2 x ep 2 follows DDP
/// with every expert on every rank and the same groups within 1e-4 (the tolerance of expert
/// parallelism against DDP), and the decay is real (the run without it ends elsewhere).
#[test]
fn parameter_groups_beside_expert_parallelism_match_ddp() {
    let mk = |decay: f32, extra: &str| {
        let mut c = moe_cfg(2, extra);
        c.optim.weight_decay = decay;
        c.optim.lr = 0.03;
        c.check().unwrap();
        c
    };
    let ddp = &train_on(4, &mk(0.1, ""), &quiet())[0];
    let ranks = train_on(4, &mk(0.1, "[mesh]\nep = 2\n"), &quiet());
    for s in &ranks {
        assert_eq!(s.params, ranks[0].params, "every rank assembles the same model");
    }
    let d = max_diff(&ranks[0].params, &ddp.params);
    assert!(d < 1e-4, "weight-decay groups x ep 2: {d} from DDP");
    let undecayed = &train_on(4, &mk(0.0, "[mesh]\nep = 2\n"), &quiet())[0];
    let effect = max_diff(&ranks[0].params, &undecayed.params);
    assert!(effect > 1e-3, "weight decay moved the model by only {effect}");
}
