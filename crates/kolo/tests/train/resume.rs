//! Resumption: an interrupted run resumed ends bitwise equal to one that never stopped, with its loss scale, batch split, codec and local-SGD state; a checkpoint that does not fit is refused.

use super::*;

#[test]
fn interrupted_and_resumed_run_ends_bitwise_equal() {
    let dir = scratch_dir("resume");
    let extra = format!(
        "[optim]\nkind = \"adamw\"\nlr = 1e-3\nschedule = \"cosine\"\nwarmup_steps = 2\n[train]\nsteps = 6\ncheckpoint_every = 3\ncheckpoint_dir = \"{}\"\n",
        dir.display()
    );
    let mut cfg = mnist_cfg(&extra, 16);
    let full = train_on(2, &cfg, &quiet());
    for background in [false, true] {
        // Written on a background thread while training goes on: the same checkpoint.
        cfg.train.checkpoint_background = background;
        std::fs::remove_dir_all(&dir).unwrap();
        let first = train_on(2, &cfg, &RunOptions { stop_after: Some(3), quiet: true, ..Default::default() });
        assert_eq!(first[0].steps_done, 3);
        assert!(first[0].checkpoint.as_ref().unwrap().join("manifest.json").is_file());
        let resumed = train_on(2, &cfg, &RunOptions { resume: Some(dir.clone()), quiet: true, ..Default::default() });
        assert_eq!(resumed[0].params, full[0].params, "resumed run diverged (background writes: {background})");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Ranks told to start from different points fail at once, every rank naming each rank's
/// start (issue #34: `--resume` on one rank only failed later as a collective mismatch).
#[test]
fn ranks_resuming_from_different_points_are_named() {
    let dir = scratch_dir("resume-one");
    let cfg = mnist_cfg(&format!("[train]\nsteps = 2\ncheckpoint_every = 2\ncheckpoint_dir = \"{}\"\n", dir.display()), 8);
    train_on(2, &cfg, &quiet());
    let opts = [quiet(), RunOptions { resume: Some(dir.clone()), quiet: true, ..Default::default() }];
    let errs = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| {
        run(&cfg, Arc::new(c) as Arc<dyn Communicator>, &opts[r]).err().map(|e| e.to_string())
    });
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} trained"));
        assert!(e.contains("rank 0 starts fresh, rank 1 resumes from step 2"), "rank {r}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A checkpoint whose optimizer state has another shape than its parameter is refused on
/// resume with the tensor named (issue #19: the lengths went unchecked into a copy, a panic).
#[test]
fn optimizer_state_of_the_wrong_shape_is_refused_on_resume() {
    use kolo_checkpoint::sharded::{begin, commit, load_any, write_shard, Piece};
    let dir = scratch_dir("bad-optim");
    let cfg = mnist_cfg(
        &format!("[optim]\nkind = \"adam\"\n[train]\nsteps = 2\ncheckpoint_every = 2\ncheckpoint_dir = \"{}\"\n", dir.join("ok").display()),
        8,
    );
    train_on(1, &cfg, &quiet());
    let good = load_any(&dir.join("ok").join("step-00000002")).unwrap();
    let bad = dir.join("bad").join("step-00000002");
    std::fs::create_dir_all(bad.parent().unwrap()).unwrap();
    begin(&bad).unwrap();
    let pieces: Vec<Piece> = good
        .tensors
        .iter()
        .map(|e| {
            let mut data = e.data.clone();
            let mut shape = e.shape.clone();
            if e.name.starts_with("optim.") && e.name.ends_with("fc1.bias") {
                data.pop();
                shape = vec![data.len()];
            }
            Piece { name: e.name.clone(), shape, offset: 0, data }
        })
        .collect();
    write_shard(&bad, 0, 1, &pieces).unwrap();
    commit(&bad, &good.meta).unwrap();
    let opts = RunOptions { resume: Some(bad.clone()), quiet: true, ..Default::default() };
    let e = run_ranks(LocalComm::create(WorldSize::new(1).unwrap()), |_, c| run(&cfg, Arc::new(c), &opts).err().unwrap());
    assert!(e[0].to_string().contains("fc1.bias` has shape [31], the model has [32]"), "{}", e[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A resumed run carries on with the loop's own state (#16): the f16 loss scaler (halved by an
/// overflow at step 1, with its count of skipped steps) and the dynamic-batch split chosen
/// before the checkpoint. Before, a resumed run restarted the scale at 2^16 and the split from
/// equal shares.
#[test]
fn resumed_runs_keep_the_loss_scale_and_the_batch_split() {
    let dir = scratch_dir("resume-state");
    let ck = |tag: &str| format!("checkpoint_dir = \"{}\"\n", dir.join(tag).display());
    let cfg = mnist_cfg(&format!("[train]\nsteps = 6\nlog_every = 1\nprecision = \"f16\"\ncheckpoint_every = 3\n{}", ck("f16")), 16);
    let inject = RunOptions { inject_inf_at: Some(1), quiet: true, ..Default::default() };
    let full = &train_on(2, &cfg, &inject)[0];
    assert_eq!((full.loss_scale, full.skipped_steps), (Some(32768.0), 1));
    train_on(2, &cfg, &RunOptions { stop_after: Some(3), ..inject.clone() });
    // From step 3 (the directory's newest, step 6, would leave nothing to run).
    let step3 = dir.join("f16").join("step-00000003");
    let resumed = &train_on(2, &cfg, &RunOptions { resume: Some(step3), quiet: true, ..Default::default() })[0];
    assert_eq!((resumed.loss_scale, resumed.skipped_steps), (full.loss_scale, full.skipped_steps), "the scaler's state");
    assert!(resumed.params == full.params, "resumed f16 run: max difference {}", max_diff(&resumed.params, &full.params));

    // Rank 1 is slow: the split moves at step 2 and is checkpointed there; the resumed step 3
    // (no re-split before step 4) runs with it.
    let cfg =
        mnist_cfg(&format!("[train]\nsteps = 3\nlog_every = 1\ncheckpoint_every = 2\n{}[ddp]\ndynamic_batch_every = 2\n", ck("split")), 16);
    let slow = RunOptions { slow_per_example: Some((1, 0.5)), quiet: true, ..Default::default() };
    let first = &train_on(2, &cfg, &RunOptions { stop_after: Some(2), ..slow.clone() })[0];
    let split = first.batch_split.clone().unwrap();
    assert_ne!(split, vec![16, 16], "the slow rank should have been given less");
    let resumed = &train_on(2, &cfg, &RunOptions { resume: Some(dir.join("split")), ..slow })[0];
    assert_eq!(resumed.batch_split.as_ref(), Some(&split), "the split written at step 2");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Compressed DDP resumes where it stopped (#16): each codec's state (PowerSGD's warm-started
/// factors and residuals, top-k's and random-k's step and residual, sign's residual, QSGD's
/// random state) and the warm-up counter go into the checkpoint, every rank its own, so a run
/// stopped at step 3 and resumed ends bitwise where the uninterrupted one does. At another
/// world size the state cannot be assigned: the run continues with fresh state.
#[test]
fn compressed_runs_resume_with_their_codec_state() {
    let dir = scratch_dir("codec-resume");
    let codecs = [
        "method = \"powersgd\", rank = 2",
        "method = \"topk\", fraction = 0.1, threshold = \"sampled\"",
        "method = \"randk\", fraction = 0.1",
        "method = \"qsgd\", levels = 16",
        "method = \"sign\"",
    ];
    for codec in codecs {
        let ck = dir.join(codec.split('"').nth(1).unwrap());
        let cfg = mnist_cfg(
            &format!(
                "[optim]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n[train]\nsteps = 6\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 3\n\
                 [ddp]\nbucket_cap = \"64KiB\"\nfirst_bucket_cap = \"16KiB\"\ncompression = {{ {codec}, warmup_steps = 2 }}\n",
                ck.display()
            ),
            16,
        );
        let full = train_on(2, &cfg, &quiet());
        let resume = RunOptions { resume: Some(ck.join("step-00000003")), quiet: true, ..Default::default() };
        let resumed = train_on(2, &cfg, &resume);
        for r in 0..2 {
            let d = max_diff(&resumed[r].params, &full[r].params);
            assert!(resumed[r].params == full[r].params, "{codec}, rank {r}: resumed vs uninterrupted, max difference {d}");
        }
        // One process cannot take two ranks' residuals: it trains on with fresh state.
        let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n";
        let one = train_on(1, &mnist_cfg(&format!("{sgd}[train]\nsteps = 4\n[ddp]\ncompression = {{ {codec} }}\n"), 32), &resume);
        assert!(one[0].last_loss.is_finite(), "{codec}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Local SGD resumes where it stopped (#16): between averagings the replicas' models and
/// momentum differ, so every rank writes its own beside the checkpoint's model (rank 0's) and
/// takes it back on resume. Stopped at step 4, which is not an averaging step, and resumed, the
/// run ends bitwise where the uninterrupted one does on every rank (before: 0.028 on rank 0,
/// every replica having restarted from rank 0's model and momentum).
#[test]
fn local_sgd_resumes_bitwise_between_averagings() {
    let dir = scratch_dir("localsgd-resume");
    let cfg = mnist_cfg(
        &format!(
            "[optim]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n[train]\nsteps = 8\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 4\n[ddp]\nlocal_sgd = {{ every = 2, warmup_steps = 1 }}\n",
            dir.display()
        ),
        16,
    );
    let full = train_on(2, &cfg, &quiet());
    let resume = RunOptions { resume: Some(dir.join("step-00000004")), quiet: true, ..Default::default() };
    let resumed = train_on(2, &cfg, &resume);
    for r in 0..2 {
        let d = max_diff(&resumed[r].params, &full[r].params);
        assert!(resumed[r].params == full[r].params, "rank {r}: resumed local SGD vs uninterrupted, max difference {d}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A local-SGD checkpoint written between averagings and resumed without local SGD: every
/// replica starts from the checkpoint's model, so plain DDP's replicas are equal and stay
/// equal (before: `kolo train` gave each rank back its own model, and the replicas trained on
/// apart unnoticed; the library's `Trainer` already started them alike).
#[test]
fn a_local_sgd_checkpoint_resumed_as_plain_ddp_starts_every_replica_alike() {
    let dir = scratch_dir("localsgd-to-ddp");
    let tables = |ddp: &str| {
        format!(
            "[optim]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n[train]\nsteps = 8\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 4\n{ddp}",
            dir.display()
        )
    };
    let local = train_on(2, &mnist_cfg(&tables("[ddp]\nlocal_sgd = { every = 2, warmup_steps = 1 }\n"), 16), &quiet());
    assert!(local[0].params != local[1].params, "the replicas' models did not differ: the test would prove nothing");
    let resume = RunOptions { resume: Some(dir.join("step-00000004")), quiet: true, ..Default::default() };
    let ddp = train_on(2, &mnist_cfg(&tables(""), 16), &resume);
    let d = max_diff(&ddp[0].params, &ddp[1].params);
    assert!(ddp[0].params == ddp[1].params, "plain DDP resumed from a local-SGD checkpoint: the replicas differ by up to {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A diverging run stops (issue #34: `lr = 1e6` trained to NaN with rc 0, and a GPT's
/// checkpoints were committed nearly all NaN): with logging every step, every rank fails at the
/// first step whose averaged loss is not finite, naming it; with rarer logs, the first
/// checkpoint holding a NaN or infinite value is refused on every rank and not committed, so
/// every committed checkpoint, the newest included, is finite.
#[test]
fn a_diverging_run_stops_and_commits_no_non_finite_checkpoint() {
    let dir = scratch_dir("diverge");
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 1e6\n";
    let cfg = mnist_cfg(&format!("{sgd}[train]\nsteps = 12\nlog_every = 1\n"), 16);
    let errs = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |_, c| {
        run(&cfg, Arc::new(c) as Arc<dyn Communicator>, &quiet()).err().map(|e| e.to_string())
    });
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} trained to the end"));
        assert!(e.contains("the loss averaged over the ranks is") && e.contains("the run diverged"), "rank {r}: {e}");
    }
    assert_eq!(errs[0], errs[1], "the ranks stopped at different steps");
    let ck = dir.join("ck");
    let cfg =
        mnist_cfg(&format!("{sgd}[train]\nsteps = 12\nlog_every = 100\ncheckpoint_every = 1\ncheckpoint_dir = \"{}\"\n", ck.display()), 16);
    let errs = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |_, c| {
        run(&cfg, Arc::new(c) as Arc<dyn Communicator>, &quiet()).err().map(|e| e.to_string())
    });
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} trained to the end"));
        assert!(e.contains("values to checkpoint are NaN or infinite"), "rank {r}: {e}");
    }
    let mut committed = 0;
    for entry in std::fs::read_dir(&ck).unwrap() {
        let path = entry.unwrap().path();
        let loaded = kolo_checkpoint::sharded::load_any(&path).unwrap_or_else(|e| panic!("{} is left behind: {e}", path.display()));
        assert!(loaded.tensors.iter().all(|t| t.data.iter().all(|v| v.is_finite())), "{} holds non-finite values", path.display());
        committed += 1;
    }
    assert!(committed >= 1, "no checkpoint before the divergence: the test would prove nothing");
    std::fs::remove_dir_all(&dir).unwrap();
}
