//! Tensor and sequence parallelism and their meshes against one process, checkpoints that reshard.

use super::*;

/// The driver's features reach the strategies that used to run loops of their own (#16).
/// Sequence parallelism (dp 2 x sp 2): a run stopped at step 2 and resumed from its checkpoint
/// ends bitwise where the uninterrupted run does; the same checkpoint continues under plain DDP
/// on 2 ranks (same replicas, so the same batches) to within 1e-4 of it; evaluation every 2
/// steps and the timeline are written. Expert parallelism: evaluation, the timeline, and
/// checkpoints of whole tensors that resume bitwise and continue under DDP.
#[test]
fn sequence_and_expert_parallel_resume_evaluate_and_trace_through_the_driver() {
    let dir = scratch_dir("driver-sp");
    let optim = "[optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 0.5\nschedule = \"cosine\"\n";
    let train = |extra: &str| format!("{optim}[train]\nsteps = 4\nlog_every = 1\neval_batches = 2\nsample_chars = 0\n{extra}");
    let tb_tl =
        format!("eval_every = 2\ntensorboard_dir = \"{}\"\ntimeline_dir = \"{}\"\n", dir.join("tb").display(), dir.join("tl").display());
    let sp = "[mesh]\nsp = 2\n";
    let full = train_on(4, &gpt_cfg(&format!("{}{sp}", train(&tb_tl)), 4), &quiet());
    let ck = format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n", dir.join("ck").display());
    let cfg = gpt_cfg(&format!("{}{sp}", train(&ck)), 4);
    train_on(4, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
    let resume = RunOptions { resume: Some(dir.join("ck").join("step-00000002")), quiet: true, ..Default::default() };
    let resumed = train_on(4, &cfg, &resume);
    for (r, s) in resumed.iter().enumerate() {
        let d = max_diff(&s.params, &full[0].params);
        assert!(s.params == full[0].params, "rank {r}: resumed sequence-parallel run vs uninterrupted: max difference {d}");
        assert_eq!(s.last_loss, full[0].last_loss);
    }
    let ddp = train_on(2, &gpt_cfg(&train(""), 4), &resume);
    let d = max_diff(&ddp[0].params, &full[0].params);
    assert!(d < 1e-4, "sequence-parallel checkpoint continued under DDP: {d}");

    // Rank 0 evaluated at step 2 (mid-run) and 4 (the end); every rank's steps are on the trace.
    let tb = dir.join("tb").join("rank0");
    let file = std::fs::read_dir(&tb).unwrap().next().unwrap().unwrap().path();
    let evals: Vec<i64> =
        kolo_train::tensorboard::read_scalars(&file).unwrap().iter().filter(|x| x.0 == "eval/loss").map(|x| x.1).collect();
    assert_eq!(evals, vec![2, 4]);
    let trace = |d: &std::path::Path| -> Vec<serde_json::Value> {
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(d.join("trace.json")).unwrap()).unwrap();
        doc["traceEvents"].as_array().unwrap().clone()
    };
    let count = |ev: &[serde_json::Value], pid: usize, name: &str| ev.iter().filter(|e| e["pid"] == pid && e["name"] == name).count();
    let ev = trace(&dir.join("tl"));
    for pid in 0..4 {
        // Sequence parallelism is DDP over the chunks' ranks: the buckets' all-reduces.
        assert_eq!(count(&ev, pid, "forward + backward"), 4, "rank {pid}");
        assert_eq!(count(&ev, pid, "bucket 0"), 4, "rank {pid}");
    }

    let tl = dir.join("tl-ep");
    let cfg = moe_cfg(4, &format!("eval_every = 2\ntimeline_dir = \"{}\"\n[mesh]\nep = 2\n", tl.display()));
    let s = train_on(2, &cfg, &quiet());
    assert!(s[0].eval.is_some() && s[1].eval.is_none(), "rank 0 evaluates the assembled model");
    let ev = trace(&tl);
    for pid in 0..2 {
        // Expert parallelism is the trainer's DDP too: the buckets' all-reduces.
        assert_eq!(count(&ev, pid, "bucket 0"), 3, "rank {pid}");
    }
    // Expert parallelism checkpoints whole tensors: stopped at step 2 and resumed, it ends
    // bitwise where the uninterrupted run does; under DDP with every expert on every rank the
    // same checkpoint continues within 1e-4 (the tolerance of expert parallelism against DDP).
    let ck = dir.join("ck-ep");
    let cfg = moe_cfg(4, &format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n[mesh]\nep = 2\n", ck.display()));
    train_on(2, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
    let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
    let resumed = train_on(2, &cfg, &resume);
    for (r, x) in resumed.iter().enumerate() {
        let d = max_diff(&x.params, &s[0].params);
        assert!(x.params == s[0].params, "rank {r}: resumed expert-parallel run vs uninterrupted, max difference {d}");
    }
    let ddp = train_on(2, &moe_cfg(4, ""), &resume);
    let d = max_diff(&ddp[0].params, &s[0].params);
    assert!(d < 1e-4, "the expert-parallel checkpoint continued under DDP: {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Tensor-parallel checkpoints (#16): each group assembles whole tensors (parameters and
/// optimizer state) and writes them under the whole model's names. A run stopped at step 2 and
/// resumed ends bitwise where the uninterrupted one does (tp 2, and dp 2 x tp 2); the same
/// checkpoint continues at another tensor-parallel size (one process; tp 4) within 1e-4, the
/// tolerance of tensor parallelism against one process. The timeline has every rank's steps.
#[test]
fn tensor_parallel_checkpoints_resume_and_reshard() {
    let dir = scratch_dir("tp-resume");
    let mk = |batch: usize, extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 0.5\n[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    for (world, mesh, batch, other) in [(2, "[mesh]\ntp = 2\n", 8, (1, "", 8)), (4, "[mesh]\ntp = 2\n", 4, (4, "[mesh]\ntp = 4\n", 8))] {
        let ck = dir.join(format!("w{world}"));
        let tl = dir.join(format!("tl{world}"));
        let full = train_on(world, &mk(batch, &format!("timeline_dir = \"{}\"\n{mesh}", tl.display())), &quiet());
        let cfg = mk(batch, &format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n{mesh}", ck.display()));
        train_on(world, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
        let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
        let resumed = train_on(world, &cfg, &resume);
        for (r, s) in resumed.iter().enumerate() {
            let d = max_diff(&s.params, &full[0].params);
            assert!(
                s.params == full[0].params,
                "world {world}, rank {r}: resumed tensor-parallel run vs uninterrupted, max difference {d}"
            );
        }
        let (n, mesh2, batch2) = other;
        let moved = train_on(n, &mk(batch2, mesh2), &resume);
        let d = max_diff(&moved[0].params, &full[0].params);
        assert!(d < 1e-4, "world {world}: the checkpoint continued on {n} rank(s) {mesh2:?}: {d}");
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(tl.join("trace.json")).unwrap()).unwrap();
        let fb = doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "forward + backward").count();
        assert_eq!(fb, 4 * world, "every rank's 4 steps on the timeline");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO beside tensor parallelism (torchtitan's FSDP + TP, on `kolo train`'s GPT through the
/// library's `Trainer`): dp 2 x tp 2 with ZeRO-1, -2 and -3 (each rank's pieces of the blocks
/// sharded over its data-parallel group, gathered when read) trains like one process with the
/// same global batch, AdamW with clipping and accumulation, within 1e-4 (tensor parallelism's
/// tolerance); the stages shard what they say (less optimizer state from ZeRO-1 on, no
/// resident block parameters between steps under ZeRO-3); a ZeRO-3 run stopped at step 2 and
/// resumed ends bitwise where the uninterrupted one does, and its checkpoint (whole tensors)
/// continues in one process within 1e-4.
#[test]
fn zero_beside_tensor_parallelism_matches_one_process_gpt() {
    let dir = scratch_dir("tp-zero");
    let mk = |batch: usize, extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 3\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nweight_decay = 0.1\nclip_grad_norm = 0.05\n[train]\nsteps = 4\ngrad_accum = 2\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let one = &train_on(1, &mk(8, ""), &quiet())[0];
    let mesh = "[mesh]\ndp = 2\ntp = 2\n";
    let plain = &train_on(4, &mk(4, mesh), &quiet())[0];
    for stage in 1..=3 {
        let ranks = train_on(4, &mk(4, &format!("[ddp]\nzero_stage = {stage}\n{mesh}")), &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "ZeRO-{stage} x tp 2: every rank assembles the same model");
        }
        let d = max_diff(&ranks[0].params, &one.params);
        assert!(d < 1e-4, "ZeRO-{stage} x tp 2 against one process: max parameter difference {d}");
        assert!((ranks[0].last_loss - one.last_loss).abs() < 1e-4, "ZeRO-{stage}: loss {} vs {}", ranks[0].last_loss, one.last_loss);
        let (z, p) = (&ranks[0].states, &plain.states);
        assert!(z.optimizer < p.optimizer, "ZeRO-{stage} x tp 2 keeps {} optimizer bytes, plain tp {}", z.optimizer, p.optimizer);
        if stage == 3 {
            assert!(z.params * 2 < p.params, "ZeRO-3 x tp 2 keeps {} parameter bytes between steps, plain tp {}", z.params, p.params);
        }
    }
    let ck = dir.join("ck");
    let cfg = mk(4, &format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n[ddp]\nzero_stage = 3\n{mesh}", ck.display()));
    let full = train_on(4, &cfg, &quiet());
    train_on(4, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
    let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
    let resumed = train_on(4, &cfg, &resume);
    let d = max_diff(&resumed[0].params, &full[0].params);
    assert!(resumed[0].params == full[0].params, "the resumed ZeRO-3 x tp 2 run vs uninterrupted: max difference {d}");
    let alone = train_on(1, &mk(8, ""), &resume);
    let d = max_diff(&alone[0].params, &full[0].params);
    assert!(d < 1e-4, "the ZeRO-3 x tp 2 checkpoint continued in one process: {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Megatron tensor parallelism: each block's heads and MLP split over 2 and 4 ranks, and
/// dp 2 x tp 2 on 4 ranks, follow the one-process run (one all-reduce per block forward and
/// backward replaces the full matmuls: f32 reassociation only).
#[test]
fn tensor_parallel_matches_one_process_gpt() {
    for optim in SPLIT_OPTIMIZERS {
        let mk = |batch: usize, extra: &str| {
            let text = format!(
                "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
                 {optim}[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n{extra}",
                kolo_testkit::files::shakespeare().display()
            );
            Config::parse(&text, "test").unwrap()
        };
        let one = &train_on(1, &mk(8, ""), &quiet())[0];
        for (world, tp, batch) in [(2, 2, 8), (4, 4, 8), (4, 2, 4)] {
            let ranks = train_on(world, &mk(batch, &format!("[mesh]\ntp = {tp}\n")), &quiet());
            for s in &ranks {
                assert_eq!(s.params.len(), one.params.len(), "every rank assembles the whole model");
                assert_eq!(s.params, ranks[0].params);
            }
            // Each rank holds its pieces only: the blocks' big matrices split tp ways.
            assert!(
                ranks[0].states.params * 10 < one.states.params * 9,
                "tp {tp}: {} vs {} bytes of parameters",
                ranks[0].states.params,
                one.states.params
            );
            let d = max_diff(&ranks[0].params, &one.params);
            assert!(d < 1e-4, "world {world}, tp {tp}, {optim}: max parameter difference {d}");
            assert!(
                (ranks[0].last_loss - one.last_loss).abs() < 1e-4,
                "world {world} tp {tp}: loss {} vs {}",
                ranks[0].last_loss,
                one.last_loss
            );
        }
    }
}

/// 3D parallelism: every mesh (dp x tp x pp) that fits in 2 and 4 ranks trains the GPT like one
/// process with the same global batch (8 sequences), with gradient clipping active (the norm
/// counts split parameters over the tensor-parallel group and replicated ones once).
#[test]
fn every_mesh_in_four_ranks_matches_one_process_gpt() {
    for optim in [format!("{}clip_grad_norm = 0.05\n", SPLIT_OPTIMIZERS[0]), SPLIT_OPTIMIZERS[1].to_string()] {
        let mk = |batch: usize, extra: &str| {
            let text = format!(
                "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
                 {optim}[train]\nsteps = 3\nsample_chars = 0\neval_batches = 2\n{extra}",
                kolo_testkit::files::shakespeare().display()
            );
            Config::parse(&text, "test").unwrap()
        };
        let one = &train_on(1, &mk(8, ""), &quiet())[0];
        for (dp, tp, pp) in [(1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 1, 4), (1, 4, 1), (4, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)] {
            let world = dp * tp * pp;
            let pipe = if pp > 1 { "[pipeline]\nmicro_batches = 2\n" } else { "" };
            let cfg = mk(8 / dp, &format!("[mesh]\ndp = {dp}\ntp = {tp}\npp = {pp}\n{pipe}"));
            let ranks = train_on(world, &cfg, &quiet());
            for s in &ranks {
                assert_eq!(s.params, ranks[0].params, "dp {dp} tp {tp} pp {pp}: every rank assembles the same model");
            }
            let d = max_diff(&ranks[0].params, &one.params);
            assert!(d < 1e-4, "dp {dp} tp {tp} pp {pp}, {optim}: max parameter difference {d}");
            assert!(
                (ranks[0].last_loss - one.last_loss).abs() < 1e-4,
                "dp {dp} tp {tp} pp {pp}: loss {} vs {}",
                ranks[0].last_loss,
                one.last_loss
            );
        }
    }
}

/// Sequence parallelism: every sequence split into 2 or 4 chunks on as many ranks (ring
/// attention; key/value blocks passed around with the running softmax, gradients passed back),
/// and dp 2 x sp 2, train like one process.
#[test]
fn sequence_parallel_ring_attention_matches_one_process_gpt() {
    for optim in [format!("{}clip_grad_norm = 0.05\n", SPLIT_OPTIMIZERS[0]), SPLIT_OPTIMIZERS[1].to_string()] {
        let mk = |batch: usize, extra: &str| {
            let text = format!(
                "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
                 {optim}[train]\nsteps = 3\nsample_chars = 0\neval_batches = 2\n{extra}",
                kolo_testkit::files::shakespeare().display()
            );
            Config::parse(&text, "test").unwrap()
        };
        let one = &train_on(1, &mk(8, ""), &quiet())[0];
        for (world, sp, batch) in [(2, 2, 8), (4, 4, 8), (4, 2, 4)] {
            let ranks = train_on(world, &mk(batch, &format!("[mesh]\nsp = {sp}\n")), &quiet());
            for s in &ranks {
                assert_eq!(s.params, ranks[0].params);
            }
            let d = max_diff(&ranks[0].params, &one.params);
            assert!(d < 1e-4, "world {world}, sp {sp}, {optim}: max parameter difference {d}");
            assert!(
                (ranks[0].last_loss - one.last_loss).abs() < 1e-4,
                "world {world} sp {sp}: loss {} vs {}",
                ranks[0].last_loss,
                one.last_loss
            );
        }
    }
}

/// ZeRO and gradient accumulation beside sequence parallelism (torchtitan's FSDP + context
/// parallel): dp 2 x sp 2 accumulating 2 micro-batches, under ZeRO-1, -2 and -3 (the blocks
/// sharded over all 4 ranks holding them, gathered before the ring attention reads them) with
/// AdamW, weight decay and clipping, ends within 1e-4 of one process accumulating the same
/// global batches (the tolerance of sequence parallelism against one process), keeping less
/// optimizer state than plain dp 2 x sp 2, and under ZeRO-3 fewer parameter bytes.
#[test]
fn zero_and_accumulation_beside_sequence_parallelism_match_one_process_gpt() {
    let mk = |batch: usize, extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nweight_decay = 0.1\nclip_grad_norm = 0.05\n[train]\nsteps = 3\ngrad_accum = 2\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let one = &train_on(1, &mk(8, ""), &quiet())[0];
    let mesh = "[mesh]\ndp = 2\nsp = 2\n";
    let plain = &train_on(4, &mk(4, mesh), &quiet())[0];
    for stage in 0..=3 {
        let ranks = train_on(4, &mk(4, &format!("[ddp]\nzero_stage = {stage}\n{mesh}")), &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "ZeRO-{stage} x sp 2: every rank assembles the same model");
        }
        let d = max_diff(&ranks[0].params, &one.params);
        assert!(d < 1e-4, "ZeRO-{stage} x sp 2, accumulating 2: max parameter difference {d} from one process");
        assert!((ranks[0].last_loss - one.last_loss).abs() < 1e-4, "ZeRO-{stage} x sp 2: loss {} vs {}", ranks[0].last_loss, one.last_loss);
        if stage > 0 {
            let (z, p) = (&ranks[0].states, &plain.states);
            assert!(z.optimizer < p.optimizer, "ZeRO-{stage} x sp 2 keeps {} optimizer bytes, plain sp {}", z.optimizer, p.optimizer);
        }
        if stage == 3 {
            let (z, p) = (&ranks[0].states, &plain.states);
            assert!(z.params < p.params, "ZeRO-3 x sp 2 keeps {} parameter bytes between steps, plain sp {}", z.params, p.params);
        }
    }
}

/// Mixed precision beside tensor and sequence parallelism (Megatron's bf16 + TP): the GPT's
/// f32 parameters cast where used, each block split over tp 2 (dp 2 x tp 2, pp 2 x tp 2) or
/// each sequence over sp 2 (dp 2 x sp 2; ring attention widens its blocks to f32), the same 6
/// SGD steps on the same global batches as one process in the same dtype. Not bitwise: a
/// row-parallel product is rounded to the dtype on each member before the f32 sum, where one
/// process rounds the whole sum once, and ring attention sums in f32 where one process sums
/// in the dtype, so the runs differ by rounding noise about as large as the dtype's own (one
/// process in bf16 against f32: 0.42 % of the update's norm, f16 0.05 %; the meshes measured
/// 0.8-1.7 times that). Bound: three times that noise and at most 30 % (a dropped all-reduce
/// is off by about 100 %). The precision is real: the mesh's run is at least half the noise
/// away from f32 (in f32 the meshes are 6e-6 of the update from one process).
#[test]
fn mixed_precision_beside_tensor_and_sequence_parallelism_follows_one_process() {
    let mk = |batch: usize, extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"sgd\"\nlr = 0.5\n[train]\nsteps = 6\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    // The initial model, as every run draws it from the seed.
    let cfg = mk(8, "");
    let start = initial_params(&cfg);
    let f32_one = &train_on(1, &mk(8, ""), &quiet())[0];
    for precision in ["bf16", "f16"] {
        let p = format!("precision = \"{precision}\"\n");
        let one = &train_on(1, &mk(8, &p), &quiet())[0];
        let update = distance(&one.params, &start);
        let noise = distance(&one.params, &f32_one.params) / update;
        // The same global batches of 8: dp 2 x tp 2 deals 4 to each replica.
        for (n, batch, mesh) in [
            (2, 8, "[mesh]\ntp = 2\n"),
            (4, 4, "[mesh]\ndp = 2\ntp = 2\n"),
            (4, 8, "[mesh]\ntp = 2\npp = 2\n[pipeline]\nmicro_batches = 2\n"),
            (2, 8, "[mesh]\nsp = 2\n"),
            (4, 4, "[mesh]\ndp = 2\nsp = 2\n"),
        ] {
            let ranks = train_on(n, &mk(batch, &format!("{p}{mesh}")), &quiet());
            for s in &ranks {
                assert_eq!(s.params, ranks[0].params, "{precision} {mesh}: every rank assembles the same model");
            }
            let off = distance(&ranks[0].params, &one.params) / update;
            assert!(off < (3.0 * noise).min(0.3), "{precision} {mesh:?}: off by {off:.4} of the update, the dtype's own noise {noise:.4}");
            let from_f32 = distance(&ranks[0].params, &f32_one.params) / update;
            assert!(from_f32 > noise / 2.0, "{precision} {mesh:?}: {from_f32:.6} of the update from f32: it computed in f32");
            assert_eq!(ranks[0].loss_scale.is_some(), precision == "f16");
        }
    }
}

/// Activation checkpointing beside tensor and sequence parallelism (Megatron's full
/// recomputation): each checkpointed block keeps only its input and recomputes its pieces (or
/// its sequence chunk) in backward, running the block's all-reduces (or ring passes) again. It
/// changes memory, not the training: tp 2, dp 2 x tp 2 under ZeRO-3 (the blocks' pieces read
/// again), pp 2 x tp 2, sp 2 and dp 2 x sp 2 under ZeRO-3 end bitwise where the same meshes
/// without it do; so do DDP in bf16 and f16 and tp 2, sp 2 and 2 pipeline stages in bf16 (the
/// recomputed block computes in the model's dtype: before, it computed in f32 and parted from
/// the plain run by 1.8e-2 in 5 steps). The memory it saves is measured between processes
/// (kolo-cli's `checkpointed_blocks_keep_fewer_activations`).
#[test]
fn checkpointed_blocks_beside_tensor_and_sequence_parallelism_change_memory_not_training() {
    let mk = |blocks: &str, batch: usize, extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 3\n{blocks}\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 0.5\n[train]\nsteps = 3\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let checkpointed = "checkpoint_blocks = [0, 1, 2]";
    for (n, batch, extra) in [
        (2, 8, "[mesh]\ntp = 2\n"),
        (4, 4, "[mesh]\ndp = 2\ntp = 2\n[ddp]\nzero_stage = 3\n"),
        (4, 8, "[mesh]\ntp = 2\npp = 2\n[pipeline]\nmicro_batches = 2\n"),
        (2, 8, "[mesh]\nsp = 2\n"),
        (4, 4, "[mesh]\ndp = 2\nsp = 2\n[ddp]\nzero_stage = 3\n"),
        (2, 8, "precision = \"bf16\"\n"),
        (2, 8, "precision = \"f16\"\n"),
        (2, 8, "precision = \"bf16\"\n[mesh]\ntp = 2\n"),
        (2, 8, "precision = \"bf16\"\n[mesh]\nsp = 2\n"),
        (2, 8, "precision = \"bf16\"\n[pipeline]\nmicro_batches = 2\n"),
    ] {
        let (p, c) = (&train_on(n, &mk("", batch, extra), &quiet())[0], &train_on(n, &mk(checkpointed, batch, extra), &quiet())[0]);
        let d = max_diff(&c.params, &p.params);
        assert!(c.params == p.params, "{extra:?}: checkpointed vs plain: {d}");
        assert_eq!(c.last_loss, p.last_loss, "{extra:?}");
    }
}

/// Local SGD beside tensor and sequence parallelism: each replica of dp 2 x tp 2 and dp 2 x
/// sp 2 (its tp pieces, or its sp chunks summing their gradients every step) steps alone and
/// the replicas average every 3 steps. After 4 steps, the replicas apart again (1.2e-2), every
/// rank of replica r holds what replica r of plain local SGD on dp 2 holds: within 1e-6
/// (measured 7.5e-9 under tp, 1.2e-7 under sp: the split computation's reassociation).
#[test]
fn local_sgd_beside_tensor_and_sequence_parallelism_follows_data_parallel_local_sgd() {
    let mk = |extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n\
             [optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n[ddp]\nlocal_sgd = {{ every = 3 }}\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let dp = train_on(2, &mk(""), &quiet());
    let apart = max_diff(&dp[0].params, &dp[1].params);
    assert!(apart > 1e-3, "the replicas part after the average by only {apart}");
    for mesh in ["[mesh]\ndp = 2\ntp = 2\n", "[mesh]\ndp = 2\nsp = 2\n"] {
        let ranks = train_on(4, &mk(mesh), &quiet());
        // dp is the slowest axis: ranks 0-1 are replica 0, ranks 2-3 replica 1.
        for (r, s) in ranks.iter().enumerate() {
            let d = max_diff(&s.params, &dp[r / 2].params);
            assert!(d < 1e-6, "{mesh:?} rank {r}: {d} from replica {} of local SGD on dp 2", r / 2);
        }
    }
}

/// Gradient compression beside pipelines and tensor parallelism (fp16 and bf16, DDP's cast
/// codecs, over the data-parallel group: each stage's or tp member's gradients): dp 2 x pp 2
/// (1F1B) and dp 2 x tp 2 with SGD follow DDP on the same 2 replicas with the same codec
/// (bf16 3.8e-6 / 7.6e-6, fp16 1.5e-5 / 3.8e-6 apart; an element a reassociation ulp from a
/// rounding boundary rounds the other way), against the codec's own effect (the same mesh
/// uncompressed: 7.3e-4, 6.0e-5): bound a third of it; fewer bytes on the wire. PowerSGD at
/// rank 1 beside the pipeline too, within a thousandth of its effect (1.8e-7 from DDP against 0.16:
/// each matrix's first Q is drawn from a seed of its name; drawn in turn from one seed per
/// bucket, as before session 40, a stage's matrices started from other Qs than DDP's: 1.8e-2).
/// (Under sp or ep each member's partial gradient would be rounded, which DDP never does: 1.0e-3
/// and 7.9e-4 from DDP with the same codec, above its own effect; refused there, as PowerSGD is
/// under tp, whose pieces are not the whole matrices, and the other codecs, which select or
/// scale over a whole bucket, under pp and tp: bad_config.)
#[test]
fn compressed_gradients_beside_pipelines_and_tensor_parallelism_follow_ddp() {
    let mk = |extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n\
             [optim]\nkind = \"sgd\"\nlr = 0.5\n[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let bytes = |s: &Summary| s.comm_bytes.iter().sum::<usize>();
    let pipeline = "[pipeline]\nmicro_batches = 2\nschedule = \"1f1b\"\n[mesh]\ndp = 2\n";
    for mesh in [pipeline, "[mesh]\ndp = 2\ntp = 2\n"] {
        let plain = &train_on(4, &mk(mesh), &quiet())[0];
        let methods: &[&str] = if mesh == pipeline { &["bf16", "fp16", "powersgd"] } else { &["bf16", "fp16"] };
        for method in methods {
            let rank = if *method == "powersgd" { ", rank = 1" } else { "" };
            let codec = format!("[ddp]\ncompression = {{ method = \"{method}\"{rank}, warmup_steps = 0 }}\n");
            let ddp = &train_on(2, &mk(&codec), &quiet())[0];
            let ranks = train_on(4, &mk(&format!("{codec}{mesh}")), &quiet());
            for s in &ranks {
                assert_eq!(s.params, ranks[0].params, "{method} {mesh:?}: every rank assembles the same model");
            }
            let (d, effect) = (max_diff(&ranks[0].params, &ddp.params), max_diff(&ranks[0].params, &plain.params));
            eprintln!("{method} {mesh:?}: {d} from DDP with the same codec, the codec's own effect {effect}");
            let within = if *method == "powersgd" { effect / 1000.0 } else { effect / 3.0 };
            assert!(d < within, "{method} {mesh:?}: {d} from DDP with the same codec, the codec's own effect {effect}");
            assert!(bytes(&ranks[0]) < bytes(plain), "{method} {mesh:?}: {} bytes sent, uncompressed {}", bytes(&ranks[0]), bytes(plain));
        }
    }
}
