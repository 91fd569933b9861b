//! ZeRO-1/2/3 against DDP and one process, checkpoints resumed at other world sizes and stages, offloaded optimizer state.

use super::*;

/// ZeRO-1 and ZeRO-2 against DDP and one process. ZeRO-1 all-reduces gradients exactly as DDP
/// does and the optimizer is element-wise, so without clipping it is bitwise DDP. ZeRO-2
/// reduce-scatters instead (another summation order for 4 ranks) and clipping sums the norm
/// per shard: both agree with DDP to 1e-6 and with one process to 2e-5 after 5 steps.
#[test]
fn zero_stages_match_ddp_and_one_process() {
    for clip in ["", "clip_grad_norm = 0.5\n"] {
        let opt = format!("[optim]\nkind = \"adamw\"\nlr = 1e-3\n{clip}[train]\nsteps = 5\nlog_every = 1\n");
        let one = &train_on(1, &mnist_cfg(&opt, 24), &quiet())[0];
        for n in [2, 4] {
            let ddp = &train_on(n, &mnist_cfg(&opt, 24 / n), &quiet())[0];
            for stage in [1, 2] {
                let ranks = train_on(n, &mnist_cfg(&format!("{opt}[ddp]\nzero_stage = {stage}\n"), 24 / n), &quiet());
                for s in &ranks {
                    assert_eq!(s.params, ranks[0].params, "every rank gathers the same parameters");
                }
                let d = max_diff(&ranks[0].params, &ddp.params);
                if stage == 1 && clip.is_empty() {
                    assert_eq!(d, 0.0, "ZeRO-1 vs DDP, {n} ranks");
                }
                assert!(d < 1e-6, "ZeRO-{stage} vs DDP, {n} ranks, clip {clip:?}: {d}");
                let d1 = max_diff(&ranks[0].params, &one.params);
                assert!(d1 < 2e-5, "ZeRO-{stage} {n} ranks vs 1 process: {d1}");
                assert!((ranks[0].last_loss - ddp.last_loss).abs() < 1e-5);
            }
        }
    }
}

/// A checkpoint saved by 4 ranks at ZeRO-2 resumes on 2 ranks at ZeRO-1 and in one process
/// (same global batch), and training continues as if never interrupted (to 2e-5: the
/// summation order of the gradient average changes with the world size).
#[test]
fn zero_checkpoint_resumes_at_other_world_sizes_and_stages() {
    let dir = scratch_dir("reshard");
    let cfg = |stage: u8, batch: usize| {
        let extra = format!(
            "[optim]\nkind = \"adamw\"\nlr = 1e-3\nclip_grad_norm = 1.0\n[train]\nsteps = 6\ncheckpoint_every = 3\ncheckpoint_dir = \"{}\"\n[ddp]\nzero_stage = {stage}\nbucket_cap = \"64KiB\"\nfirst_bucket_cap = \"8KiB\"\n",
            dir.display()
        );
        mnist_cfg(&extra, batch)
    };
    let full = train_on(4, &cfg(2, 4), &quiet());
    std::fs::remove_dir_all(&dir).unwrap();
    let first = train_on(4, &cfg(2, 4), &RunOptions { stop_after: Some(3), quiet: true, ..Default::default() });
    let ck = first[0].checkpoint.clone().unwrap();
    let manifest = kolo_checkpoint::sharded::read_manifest(&ck).unwrap();
    assert_eq!(manifest.files.len(), 4, "one shard file per rank");
    assert!(manifest.tensors.iter().any(|t| t.shards.len() > 1), "some tensor is split across ranks");
    assert_eq!(manifest.meta["kolo.zero_stage"], "2");
    // A save that was killed before its commit (a staging directory, a step directory without
    // a manifest) is never picked: the step-3 checkpoint is.
    std::fs::create_dir_all(dir.join(".step-00000006.partial")).unwrap();
    std::fs::copy(ck.join("shard-00000-of-00004.safetensors"), dir.join(".step-00000006.partial/shard-00000-of-00004.safetensors"))
        .unwrap();
    std::fs::create_dir_all(dir.join("step-00000009")).unwrap();
    resume_everywhere(&dir, &[(2, 1), (1, 0), (2, 2)], |n, stage| cfg(stage, 16 / n), &first[0], &full[0]);
}

/// Resumes the step-3 checkpoint in `dir` on each `(ranks, ZeRO stage)`: the loaded parameters
/// are `first`'s, and training on to step 6 ends within 2e-5 of the uninterrupted `full` run.
fn resume_everywhere(dir: &std::path::Path, cases: &[(usize, u8)], cfg: impl Fn(usize, u8) -> Config, first: &Summary, full: &Summary) {
    let resume = RunOptions { resume: Some(dir.to_path_buf()), quiet: true, ..Default::default() };
    for &(n, stage) in cases {
        let r = train_on(n, &cfg(n, stage), &RunOptions { stop_after: Some(3), ..resume.clone() });
        assert_eq!(r[0].params, first.params, "{n} ranks, ZeRO-{stage}: loaded parameters");
        let r = train_on(n, &cfg(n, stage), &resume);
        let d = max_diff(&r[0].params, &full.params);
        assert!(d < 2e-5, "resumed on {n} ranks at ZeRO-{stage}: {d}");
        // The resumed run wrote step 6 itself; put the tree back for the next case.
        std::fs::remove_dir_all(dir.join("step-00000006")).unwrap();
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Optimizer state offloaded to memory-mapped files trains exactly as in memory (plain DDP and
/// ZeRO-2 with its master shard offloaded too) and leaves no file behind.
#[test]
fn offloaded_optimizer_state_trains_bitwise_like_in_memory() {
    let dir = scratch_dir("offload-it");
    for stage in [0, 2] {
        let base = format!("[optim]\nkind = \"adamw\"\nlr = 1e-3\nclip_grad_norm = 1.0\n[train]\nsteps = 4\n[ddp]\nzero_stage = {stage}\n");
        let mem = train_on(2, &mnist_cfg(&base, 16), &quiet());
        let off = base.replace("[train]", &format!("offload_dir = \"{}\"\n[train]", dir.display()));
        let disk = train_on(2, &mnist_cfg(&off, 16), &quiet());
        assert!(disk[0].states.offloaded && !mem[0].states.offloaded);
        assert_eq!(disk[0].params, mem[0].params, "ZeRO-{stage}: offloaded vs in memory");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "offload files are unlinked");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// ZeRO-3 (blocks gathered on use, recomputed in backward) against DDP and one process on the
/// GPT, then the resharding path: saved by 4 ranks at ZeRO-3, resumed by 2 ranks at
/// ZeRO-1 and by one process, continuing as the uninterrupted ZeRO-3 run does (2e-5: the
/// summation order of the gradient average changes with the world size).
/// With gradient accumulation (3 micro-steps) ZeRO-3 ends bitwise where ZeRO-2 does (the
/// blocks' gradients, which reach the DDP engine a group at a time, were neither kept on the
/// no-sync micro-steps nor added to the last one's).
#[test]
fn zero3_matches_ddp_and_its_checkpoint_resumes_at_other_sizes_and_stages() {
    let dir = scratch_dir("zero3");
    let opt = "[optim]\nkind = \"adamw\"\nlr = 1e-3\nclip_grad_norm = 1.0\n";
    let train = |steps: u64, ck: bool| {
        let ck = if ck { format!("checkpoint_every = 3\ncheckpoint_dir = \"{}\"\n", dir.display()) } else { String::new() };
        format!("{opt}[train]\nsteps = {steps}\neval_batches = 2\nsample_chars = 5\n{ck}")
    };
    let one = &train_on(1, &gpt_cfg(&train(3, false), 8), &quiet())[0];
    for n in [2, 4] {
        let ddp = &train_on(n, &gpt_cfg(&train(3, false), 8 / n), &quiet())[0];
        let z3 = train_on(n, &gpt_cfg(&format!("{}[ddp]\nzero_stage = 3\nbucket_cap = \"4KiB\"\n", train(3, false)), 8 / n), &quiet());
        for s in &z3 {
            assert_eq!(s.params, z3[0].params, "every rank ends with the same parameters");
            assert_eq!(s.sample, z3[0].sample, "every rank samples the same text");
        }
        let d = max_diff(&z3[0].params, &ddp.params);
        assert!(d < 1e-6, "ZeRO-3 vs DDP, {n} ranks: {d}");
        assert!(max_diff(&z3[0].params, &one.params) < 2e-5);
        assert!((z3[0].eval.as_ref().unwrap().loss - ddp.eval.as_ref().unwrap().loss).abs() < 1e-5);
        // Only the embeddings, final norm and head stay resident; the blocks are sharded.
        assert!(z3[0].states.params < ddp.states.params / 4, "{:?} vs {:?}", z3[0].states, ddp.states);
    }
    // Gradient accumulation (FSDP's no_sync: whole gradients kept on each rank until the last
    // micro-step, whose reduce-scatter carries them): ZeRO-3 equals ZeRO-2.
    let accum = |stage: u8| gpt_cfg(&format!("{}grad_accum = 3\n[ddp]\nzero_stage = {stage}\n", train(3, false)), 4);
    let (z2, z3a) = (&train_on(2, &accum(2), &quiet())[0], &train_on(2, &accum(3), &quiet())[0]);
    assert_eq!(z3a.params, z2.params, "grad_accum 3, 2 ranks: ZeRO-3 vs ZeRO-2");
    let z3 = |steps| gpt_cfg(&format!("{}[ddp]\nzero_stage = 3\n", train(steps, true)), 2);
    let full = train_on(4, &z3(6), &quiet());
    std::fs::remove_dir_all(&dir).unwrap();
    let first = train_on(4, &z3(6), &RunOptions { stop_after: Some(3), quiet: true, ..Default::default() });
    assert_eq!(kolo_checkpoint::sharded::read_manifest(first[0].checkpoint.as_ref().unwrap()).unwrap().files.len(), 4);
    resume_everywhere(
        &dir,
        &[(2, 1), (1, 0)],
        |n, stage| gpt_cfg(&format!("{}[ddp]\nzero_stage = {stage}\n", train(6, true)), 8 / n),
        &first[0],
        &full[0],
    );
}

/// ZeRO-3 with every block checkpointed: a checkpointed block keeps no copy of its parameters
/// under ZeRO-3 (its backward reads the variables again, which gathers them, cast to the
/// compute dtype as the forward did), and trains as ZeRO-2's checkpointed blocks, in f32 and
/// in bf16.
#[test]
fn zero3_checkpointed_blocks_reread_their_parameters_and_train_as_zero2() {
    for precision in ["f32", "bf16"] {
        let cfg = |stage: u8| {
            let mut c = gpt_cfg(
                &format!(
                    "[optim]\nkind = \"adamw\"\nlr = 1e-2\n[train]\nsteps = 4\ngrad_accum = 2\nsample_chars = 0\nprecision = \"{precision}\"\n[ddp]\nzero_stage = {stage}\n"
                ),
                2,
            );
            c.model.checkpoint_blocks = vec![0, 1, 2];
            c
        };
        let (z2, z3) = (&train_on(2, &cfg(2), &quiet())[0], &train_on(2, &cfg(3), &quiet())[0]);
        let d = max_diff(&z3.params, &z2.params);
        assert!(d < 1e-6, "{precision}: checkpointed ZeRO-3 vs checkpointed ZeRO-2: {d}");
        assert!(z3.states.params < z2.states.params / 2, "{precision}: the blocks are sharded: {:?} vs {:?}", z3.states, z2.states);
    }
}

/// Gradient compression beside ZeRO (torch FSDP's `reduce_dtype`): ZeRO-2 and ZeRO-3
/// reduce-scatter each bucket in bf16 or fp16, ZeRO-1 all-reduces it as DDP does (any codec:
/// PowerSGD here). On 2 ranks, without clipping, each equals DDP with the same codec bitwise
/// after 4 AdamW steps (an element's two halves summed and rounded once, then halved,
/// whichever collective), sends fewer bytes than without, and moved away from the
/// uncompressed run (the codec's effect). ZeRO-2/3 refuse the codecs that need the whole
/// bucket (bad_config). A ZeRO-1 checkpoint carries PowerSGD's state: resumed, bitwise.
#[test]
fn compressed_gradients_beside_zero_equal_ddp_with_the_same_codec() {
    let opt = "[optim]\nkind = \"adamw\"\nlr = 1e-2\n[train]\nsteps = 4\neval_batches = 2\nsample_chars = 0\n";
    let bytes = |s: &Summary| s.comm_bytes.iter().sum::<usize>();
    let run = |ddp: &str| train_on(2, &gpt_cfg(&format!("{opt}[ddp]\nbucket_cap = \"4KiB\"\n{ddp}"), 4), &quiet());
    for (codec, stages) in [("method = \"bf16\"", &[2u8, 3][..]), ("method = \"fp16\"", &[2, 3]), ("method = \"powersgd\", rank = 1", &[1])]
    {
        let compression = format!("compression = {{ {codec}, warmup_steps = 0 }}\n");
        let ddp = &run(&compression)[0];
        for &stage in stages {
            let plain = &run(&format!("zero_stage = {stage}\n"))[0];
            let ranks = run(&format!("zero_stage = {stage}\n{compression}"));
            for s in &ranks {
                assert_eq!(s.params, ranks[0].params, "{codec}, ZeRO-{stage}: every rank ends with the same parameters");
            }
            let d = max_diff(&ranks[0].params, &ddp.params);
            assert!(ranks[0].params == ddp.params, "{codec}, ZeRO-{stage}: {d} from DDP with the same codec");
            let effect = max_diff(&ranks[0].params, &plain.params);
            assert!(effect > 1e-6, "{codec}, ZeRO-{stage}: the codec changed nothing ({effect})");
            assert!(
                bytes(&ranks[0]) < bytes(plain),
                "{codec}, ZeRO-{stage}: {} bytes sent, uncompressed {}",
                bytes(&ranks[0]),
                bytes(plain)
            );
        }
    }
    // PowerSGD's factors and residuals travel with a ZeRO-1 checkpoint: stopped at step 3 of 6
    // and resumed, the run ends bitwise where the uninterrupted one does.
    let dir = scratch_dir("zero1-powersgd");
    let cfg = gpt_cfg(
        &format!(
            "[optim]\nkind = \"adamw\"\nlr = 1e-2\n[train]\nsteps = 6\neval_batches = 2\nsample_chars = 0\ncheckpoint_every = 3\ncheckpoint_dir = \"{}\"\n\
             [ddp]\nzero_stage = 1\nbucket_cap = \"4KiB\"\ncompression = {{ method = \"powersgd\", rank = 1, warmup_steps = 0 }}\n",
            dir.display()
        ),
        4,
    );
    let full = train_on(2, &cfg, &quiet());
    let resume = RunOptions { resume: Some(dir.join("step-00000003")), quiet: true, ..Default::default() };
    let resumed = train_on(2, &cfg, &resume);
    for r in 0..2 {
        assert!(
            resumed[r].params == full[r].params,
            "rank {r}: resumed vs uninterrupted, {}",
            max_diff(&resumed[r].params, &full[r].params)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
