//! Training tests: DDP equals one process, resume equals no interruption, convergence on real
//! data, and clear errors for bad input. Ranks are threads over the reference communicator.

use kolo_base::WorldSize;
use kolo_comm::{Communicator, LocalComm};
use kolo_testkit::run_ranks;
use kolo_train::{run, Config, RunOptions, Summary, TrainError};
use std::sync::Arc;
use std::time::Duration;

fn mnist_cfg(extra: &str, batch: usize) -> Config {
    let text = format!(
        "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = {batch}\nprefetch = 2\n{extra}",
        kolo_testkit::files::mnist_dir().display()
    );
    Config::parse(&text, "test").unwrap()
}

/// A path under the temporary directory for this test process (`kolo-{tag}-{pid}`), with
/// whatever an earlier run left there removed.
fn scratch_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn quiet() -> RunOptions {
    RunOptions { quiet: true, ..Default::default() }
}

fn train_on(n: usize, cfg: &Config, opts: &RunOptions) -> Vec<Summary> {
    run_ranks(LocalComm::create(WorldSize::new(n).unwrap()), |_, c| run(cfg, Arc::new(c) as Arc<dyn Communicator>, opts).unwrap())
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// DDP with N ranks of batch B must follow the same trajectory as one process with batch N*B.
/// Not bitwise: each rank's matmul sums over its own B examples and the all-reduce adds the
/// N partial means, while one process sums N*B examples in one pass; with f32 this reorders
/// additions, ~1e-7 relative per step. After 5 SGD steps the parameters agree to 2e-5.
#[test]
fn ddp_matches_one_process_mlp() {
    let opt = "[optim]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n[train]\nsteps = 5\nlog_every = 1\n";
    let one = &train_on(1, &mnist_cfg(opt, 48), &quiet())[0];
    for n in [2, 4] {
        let ranks = train_on(n, &mnist_cfg(opt, 48 / n), &quiet());
        for s in &ranks {
            // Every rank holds identical parameters (the all-reduce is bit-identical on all ranks).
            assert_eq!(s.params, ranks[0].params);
        }
        let d = max_diff(&ranks[0].params, &one.params);
        assert!(d < 2e-5, "{n} ranks vs 1 process: max parameter difference {d}");
        assert!((ranks[0].last_loss - one.last_loss).abs() < 1e-4, "{} vs {}", ranks[0].last_loss, one.last_loss);
    }
}

#[test]
fn ddp_matches_one_process_gpt_with_accumulation() {
    let mk = |batch: usize, accum: usize| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 1e-3\nclip_grad_norm = 1.0\n[train]\nsteps = 3\ngrad_accum = {accum}\nsample_chars = 0\n",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    // One process, batch 8, no accumulation == 2 ranks x batch 2 x 2 micro-steps? No: the
    // micro-steps draw consecutive batches, so compare like with like: 2 ranks x batch 4 vs 1 x 8.
    let one = &train_on(1, &mk(8, 1), &quiet())[0];
    let two = &train_on(2, &mk(4, 1), &quiet())[0];
    let d = max_diff(&two.params, &one.params);
    assert!(d < 1e-4, "max parameter difference {d}");
    // Activation checkpointing of both blocks changes memory, not the training.
    let mut ck = mk(4, 1);
    ck.model.checkpoint_blocks = vec![0, 1];
    let two_ck = &train_on(2, &ck, &quiet())[0];
    let d = max_diff(&two_ck.params, &two.params);
    assert!(d < 1e-6, "checkpointed vs plain: max parameter difference {d}");
    // Accumulation: 2 micro-steps of 4 on 1 rank equals... the same data as 2 steps' worth, so
    // check the mechanism against a hand-made equivalent: 1 rank, accum 2, batch 4 == 1 rank,
    // accum 1, batch 8 when batches are consecutive slices of one permutation (no shuffle).
    let mut a = mk(4, 2);
    a.data.shuffle = false;
    let mut b = mk(8, 1);
    b.data.shuffle = false;
    let sa = &train_on(1, &a, &quiet())[0];
    let sb = &train_on(1, &b, &quiet())[0];
    let d = max_diff(&sa.params, &sb.params);
    assert!(d < 1e-4, "accumulation vs big batch: {d}");
}

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

/// On the shipped subset (10,000 training images; 97 % on the full 60,000): 93.3 % of the 2,000
/// test images after 1,400 steps.
#[test]
fn mnist_mlp_reaches_92_percent_on_the_shipped_subset() {
    let extra = "[optim]\nkind = \"adamw\"\nlr = 2e-3\nschedule = \"cosine\"\nmin_lr = 1e-4\n[train]\nsteps = 1400\nlog_every = 100\n";
    let text = format!(
        "[model]\nkind = \"mlp\"\nhidden = [128]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 64\n{extra}",
        kolo_testkit::files::mnist_dir().display()
    );
    let s = train_on(2, &Config::parse(&text, "test").unwrap(), &quiet());
    let e = s[0].eval.clone().unwrap();
    assert_eq!(e.examples, 2_000);
    eprintln!("MNIST MLP test accuracy {:?}", e.accuracy);
    assert!(e.accuracy.unwrap() >= 0.92, "test accuracy {:?}", e.accuracy);
}

#[test]
fn shakespeare_gpt_validation_loss_falls() {
    let text = format!(
        "[model]\nkind = \"gpt\"\nseq = 32\nd_model = 64\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 16\n\
         [optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 1.0\n[train]\nsteps = 300\neval_batches = 8\nsample_chars = 50\n",
        kolo_testkit::files::shakespeare().display()
    );
    let s = train_on(2, &Config::parse(&text, "test").unwrap(), &quiet());
    let e = s[0].eval.clone().unwrap();
    // Uniform guessing over 65 characters is ln 65 = 4.17; a unigram model about 3.3.
    eprintln!("Shakespeare GPT validation loss {}", e.loss);
    assert!(e.loss < 2.5, "validation loss {}", e.loss);
    assert_eq!(s[0].sample.as_ref().unwrap().len(), 50);
}

/// Ranks started with different settings stop at start-up naming the field (issue #19: a
/// different lr or n_head trained to the end with rc 0 while the replicas diverged); settings
/// that may differ per rank (the data path) do not.
#[test]
fn ranks_with_different_settings_refuse_to_start() {
    let cfgs = [mnist_cfg("", 8), mnist_cfg("[optim]\nlr = 0.01\n", 8)];
    let errs = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| run(&cfgs[r], Arc::new(c), &quiet()).err().unwrap());
    assert!(errs[0].to_string().contains("rank 1 differs from rank 0 first at `optim.lr`"), "{}", errs[0]);
    assert!(errs[1].to_string().contains("this rank (1) has optim.lr = 0.01"), "{}", errs[1]);
    let mut same = mnist_cfg("[train]\nsteps = 1\n", 8);
    let mut other_path = same.clone();
    other_path.data.path = Some(format!("{}/", kolo_testkit::files::mnist_dir().display()));
    same.train.progress = false;
    let cfgs = [same, other_path];
    let ok = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| run(&cfgs[r], Arc::new(c), &quiet()).is_ok());
    assert_eq!(ok, vec![true, true]);
}

#[test]
fn bad_inputs_give_clear_errors() {
    let err = |text: &str| Config::parse(text, "cfg.toml").unwrap_err().to_string();
    let base = "[model]\nkind = \"mlp\"\n[data]\nkind = \"mnist\"\npath = \"x\"\nbatch_size = 8\n";
    assert!(err(&format!("{base}[train]\nstepz = 3\n")).contains("unknown field `stepz`"));
    assert!(err("[model]\nkind = \"transformer\"\n").contains("unknown variant `transformer`"));
    assert!(err("[model]\nkind = \"gpt\"\nhidden = [3]\n[data]\nkind = \"text\"\npath = \"x\"\nbatch_size = 1\n")
        .contains("model.hidden applies to kind = \"mlp\" only"));
    assert!(err("[model]\nkind = \"mlp\"\n[data]\nkind = \"mnist\"\nbatch_size = 8\n").contains("data.path is required"));
    assert!(err(&format!("{base}[ddp]\nbucket_cap = \"lots\"\n")).contains("ddp.bucket_cap"));
    assert!(err(&format!("{base}[ddp]\nzero_stage = 4\n")).contains("ddp.zero_stage must be 0, 1, 2 or 3, not 4"));
    assert!(err(&format!("{base}[ddp]\nzero_stage = 3\n")).contains("shards the GPT's blocks"));
    assert!(err(&format!("{base}[ddp]\nzero_stage = 1\ncompression = {{ method = \"powersgd\" }}\n"))
        .contains("ddp.compression needs ddp.zero_stage = 0"));
    assert!(err(&format!("{base}[ddp]\ncompression = {{ method = \"gzip\" }}\n")).contains("unknown variant `gzip`"));
    assert!(err(&format!("{base}[ddp]\ncompression = {{ method = \"topk\", fraction = 1.5 }}\n")).contains("fraction must be in (0, 1]"));
    assert!(err(&format!("{base}[ddp]\nzero_stage = 1\nskip_sync = true\n")).contains("needs ddp.zero_stage = 0"));
    // Numbers that would train wrongly or never time out are refused, naming the field (#19).
    for (field, section) in [
        ("optim.clip_grad_norm", "[optim]\nclip_grad_norm = -1.0\n"),
        ("optim.beta2", "[optim]\nbeta2 = 1.0\n"),
        ("optim.eps", "[optim]\neps = -1e-8\n"),
        ("optim.momentum", "[optim]\nkind = \"sgd\"\nmomentum = -0.5\n"),
        ("optim.min_lr", "[optim]\nmin_lr = -0.1\n"),
        ("optim.weight_decay", "[optim]\nweight_decay = nan\n"),
        ("ddp.timeout_secs", "[ddp]\ntimeout_secs = inf\n"),
        ("ddp.timeout_secs", "[ddp]\ntimeout_secs = 0.0\n"),
    ] {
        let e = err(&format!("{base}{section}"));
        assert!(e.contains(&format!("{field} is out of range")), "{field}: {e}");
    }
    // What a strategy cannot do is refused, not ignored (#16). Parameter-server workers run on
    // the driver, with its reports; their optimizer state lives on the servers.
    let gpt = "[model]\nkind = \"gpt\"\n[data]\nkind = \"text\"\npath = \"x\"\nbatch_size = 8\n";
    let two_bw = format!("{gpt}[pipeline]\nmicro_batches = 2\nschedule = \"2bw\"\n");
    let ps = format!("{base}[train]\nstrategy = \"ps\"\n");
    let reports = "json_log = \"x\"\nmetrics_port = 9400\ntensorboard_dir = \"y\"\ntimeline_dir = \"z\"\neval_every = 5\n";
    assert!(Config::parse(&format!("{ps}{reports}[optim]\nreference_batch = 32\n"), "t").is_ok());
    let e = err(&format!("{ps}[optim]\noffload_dir = \"x\"\n"));
    assert!(e.contains("optim.offload_dir") && e.contains("train.strategy = \"ps\""), "{e}");
    // PipeDream-2BW runs on the driver too: it takes every report, timelines and checkpoints.
    assert!(Config::parse(&format!("{two_bw}[train]\n{reports}checkpoint_dir = \"c\"\n"), "t").is_ok());
    // Scheduled DDP runs on the driver: it has them all.
    let sched = format!("{gpt}[ddp]\nschedule = {{ chunk = \"64KiB\" }}\n");
    let all = "[train]\njson_log = \"x\"\ntensorboard_dir = \"y\"\nmetrics_port = 9400\ntimeline_dir = \"z\"\ncheckpoint_dir = \"c\"\n\
               [optim]\noffload_dir = \"o\"\nreference_batch = 32\n";
    assert!(Config::parse(&format!("{sched}{all}"), "t").is_ok());
    // PipeDream-2BW keeps its optimizer state where offload_dir says and scales the learning rate.
    assert!(Config::parse(&format!("{two_bw}[optim]\noffload_dir = \"x\"\nreference_batch = 32\n"), "t").is_ok());
    // Deterministic mode: pieces must divide the per-rank batch; what it cannot make bitwise is refused.
    assert!(err(&format!("{base}[ddp]\ndeterministic = true\ndeterministic_chunk = 3\n"))
        .contains("ddp.deterministic_chunk = 3 must divide data.batch_size = 8"));
    assert!(err(&format!("{base}[ddp]\ndeterministic = true\ndeterministic_chunk = 0\n")).contains("must divide"));
    assert!(err(&format!("{base}[ddp]\ndeterministic = true\ncompression = {{ method = \"fp16\" }}\n"))
        .contains("ddp.deterministic runs DDP or ZeRO-1/2"));
    assert!(err(&format!("{base}[train]\nprecision = \"f16\"\n[ddp]\ndeterministic = true\n"))
        .contains("ddp.deterministic runs DDP or ZeRO-1/2"));

    // A missing dataset.
    let cfg =
        Config::parse("[model]\nkind = \"mlp\"\n[data]\nkind = \"mnist\"\npath = \"/nonexistent/mnist\"\nbatch_size = 8\n", "t").unwrap();
    let e = run_ranks(LocalComm::create(WorldSize::new(1).unwrap()), |_, c| run(&cfg, Arc::new(c), &quiet()).err().unwrap());
    assert!(matches!(e[0], TrainError::Data(_)) && e[0].to_string().contains("/nonexistent/mnist"), "{}", e[0]);

    // A corrupt checkpoint, and one from another model.
    let dir = scratch_dir("badckpt");
    let cfg = mnist_cfg(&format!("[train]\nsteps = 1\ncheckpoint_dir = \"{}\"\n", dir.display()), 8);
    let s = train_on(1, &cfg, &quiet());
    let ck = s[0].checkpoint.clone().unwrap();
    let mut other = mnist_cfg("[train]\nsteps = 1\n", 8);
    other.model.hidden = Some(vec![16]);
    let opts = RunOptions { resume: Some(ck.clone()), quiet: true, ..Default::default() };
    let e = run_ranks(LocalComm::create(WorldSize::new(1).unwrap()), |_, c| run(&other, Arc::new(c), &opts).err().unwrap());
    assert!(e[0].to_string().contains("kolo.model"), "{}", e[0]);
    let shard = ck.join("shard-00000-of-00001.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let last = bytes.len() - 5;
    bytes[last] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let e = run_ranks(LocalComm::create(WorldSize::new(1).unwrap()), |_, c| run(&cfg, Arc::new(c), &opts).err().unwrap());
    assert!(e[0].to_string().contains("corrupt"), "{}", e[0]);
    std::fs::remove_dir_all(&dir).unwrap();
}

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

fn gpt_cfg(extra: &str, batch: usize) -> Config {
    let text = format!(
        "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 3\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n{extra}",
        kolo_testkit::files::shakespeare().display()
    );
    Config::parse(&text, "test").unwrap()
}

/// ZeRO-3 (blocks gathered on use, recomputed in backward) against DDP and one process on the
/// GPT, then the issue's resharding path: saved by 4 ranks at ZeRO-3, resumed by 2 ranks at
/// ZeRO-1 and by one process, continuing as the uninterrupted ZeRO-3 run does (2e-5: the
/// summation order of the gradient average changes with the world size).
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

/// Mixed precision. bf16 and f16 compute track f32 training closely; under f16 an overflow
/// (injected on rank 0 only) is detected by every rank, the step is skipped everywhere (the
/// parameters are exactly those of the step before) and the loss scale halves.
#[test]
fn mixed_precision_trains_and_f16_overflow_skips_the_step() {
    let opt = "[optim]\nkind = \"adamw\"\nlr = 1e-3\nclip_grad_norm = 1.0\n";
    let f32_run = &train_on(2, &mnist_cfg(&format!("{opt}[train]\nsteps = 20\nlog_every = 20\n"), 16), &quiet())[0];
    for (p, tol) in [("bf16", 0.02), ("f16", 0.01)] {
        let cfg = mnist_cfg(&format!("{opt}[train]\nsteps = 20\nlog_every = 20\nprecision = \"{p}\"\n"), 16);
        let s = &train_on(2, &cfg, &quiet())[0];
        assert!(
            (s.last_loss - f32_run.last_loss).abs() < tol * f32_run.last_loss,
            "{p}: loss {} vs f32 {}",
            s.last_loss,
            f32_run.last_loss
        );
        assert!(max_diff(&s.params, &f32_run.params) < 0.01, "{p}: parameters drift from f32");
        assert_eq!(s.skipped_steps, 0);
    }
    // GPT with checkpointed blocks and ZeRO-3 under bf16 runs too (blocks recompute in f32).
    let g = train_on(
        2,
        &gpt_cfg(&format!("{opt}[train]\nsteps = 2\nsample_chars = 0\nprecision = \"bf16\"\n[ddp]\nzero_stage = 3\n"), 2),
        &quiet(),
    );
    assert!(g[0].last_loss.is_finite());
    for stage in [0, 2] {
        let cfg = |extra: &str| {
            mnist_cfg(&format!("{opt}[train]\nsteps = 3\nlog_every = 1\nprecision = \"f16\"\n{extra}[ddp]\nzero_stage = {stage}\n"), 16)
        };
        let skipped = &train_on(2, &cfg(""), &RunOptions { inject_inf_at: Some(1), quiet: true, ..Default::default() })[0];
        assert_eq!(skipped.skipped_steps, 1);
        assert_eq!(skipped.loss_scale, Some(32768.0), "65536 halved once");
        // Steps 0 and 2 applied, step 1 skipped: the same as two clean steps on batches 0 and 2
        // is not observable directly, so check the skipped step changed nothing: a run that
        // stops after step 1 with the injection equals one that stops after step 0.
        let a = &train_on(2, &cfg(""), &RunOptions { inject_inf_at: Some(1), stop_after: Some(2), quiet: true, ..Default::default() })[0];
        let b = &train_on(2, &cfg(""), &RunOptions { stop_after: Some(1), quiet: true, ..Default::default() })[0];
        assert_eq!(a.params, b.params, "ZeRO-{stage}: the skipped step left the parameters alone");
    }
}

/// PowerSGD (rank 4, after 10 uncompressed steps) and every other codec train the MNIST MLP (and
/// PowerSGD the Shakespeare GPT)
/// to within a stated margin of uncompressed DDP in the same number of steps, sending a
/// fraction of the bytes.
#[test]
fn compressed_training_converges_near_uncompressed_with_fewer_bytes() {
    let mlp = |extra: &str| {
        let text = format!(
            "[model]\nkind = \"mlp\"\nhidden = [128]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[optim]\nkind = \"adamw\"\nlr = 2e-3\n[train]\nsteps = 300\nlog_every = 100\neval_batches = 20\n{extra}",
            kolo_testkit::files::mnist_dir().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let psgd = "[ddp]\ncompression = { method = \"powersgd\", rank = 4, warmup_steps = 10 }\n";
    let plain = &train_on(2, &mlp(""), &quiet())[0];
    let comp = &train_on(2, &mlp(psgd), &quiet())[0];
    let (a, b) = (plain.eval.as_ref().unwrap(), comp.eval.as_ref().unwrap());
    eprintln!("MNIST MLP 300 steps: accuracy {:?} uncompressed, {:?} PowerSGD r4", a.accuracy, b.accuracy);
    assert!(b.accuracy.unwrap() > a.accuracy.unwrap() - 0.02, "PowerSGD accuracy {:?} vs {:?}", b.accuracy, a.accuracy);
    let ratio = plain.comm_bytes.last().unwrap() / comp.comm_bytes.last().unwrap();
    assert!(ratio >= 10, "MLP compression ratio {ratio}");
    assert_eq!(comp.comm_bytes[0], plain.comm_bytes[0], "warm-up steps are uncompressed");
    // The other codecs on the same run (fraction 10% for the sparse ones), each within its
    // stated accuracy margin of uncompressed training after the same 300 steps.
    for (method, min_ratio, margin) in
        [("fp16", 2, 0.01), ("bf16", 2, 0.01), ("topk", 5, 0.03), ("randk", 10, 0.08), ("qsgd", 3, 0.03), ("sign", 30, 0.05)]
    {
        let cfg = mlp(&format!("[ddp]\ncompression = {{ method = \"{method}\", fraction = 0.1, levels = 16, warmup_steps = 10 }}\n"));
        let s = &train_on(2, &cfg, &quiet())[0];
        let acc = s.eval.as_ref().unwrap().accuracy.unwrap();
        let ratio = plain.comm_bytes.last().unwrap() / s.comm_bytes.last().unwrap();
        eprintln!("MNIST MLP 300 steps, {method}: accuracy {acc:.4}, {ratio}x fewer bytes");
        assert!(acc > a.accuracy.unwrap() - margin, "{method}: accuracy {acc} vs {:?}", a.accuracy);
        assert!(ratio >= min_ratio, "{method}: compression ratio {ratio}");
    }
    // Top-k with a sampled threshold, summed by the sparse all-reduce.
    let cfg = mlp(
        "[ddp]\ncompression = { method = \"topk\", fraction = 0.1, threshold = \"sampled\", exchange = \"sparse\", warmup_steps = 10 }\n",
    );
    let s = &train_on(2, &cfg, &quiet())[0];
    let acc = s.eval.as_ref().unwrap().accuracy.unwrap();
    assert!(acc > a.accuracy.unwrap() - 0.03, "sampled top-k over the sparse all-reduce: accuracy {acc} vs {:?}", a.accuracy);
    assert!(plain.comm_bytes.last().unwrap() / s.comm_bytes.last().unwrap() >= 3);

    let gpt = |extra: &str| {
        gpt_cfg(&format!("[optim]\nkind = \"adamw\"\nlr = 3e-3\n[train]\nsteps = 120\neval_batches = 8\nsample_chars = 0\n{extra}"), 8)
    };
    let plain = &train_on(2, &gpt(""), &quiet())[0];
    let comp = &train_on(2, &gpt(psgd), &quiet())[0];
    let (a, b) = (plain.eval.as_ref().unwrap().loss, comp.eval.as_ref().unwrap().loss);
    eprintln!("Shakespeare GPT 120 steps: validation loss {a:.4} uncompressed, {b:.4} PowerSGD r4");
    assert!(b < a * 1.10, "PowerSGD validation loss {b} vs {a}");
}

/// Local SGD: averaging the models after every plain-SGD step is DDP (the average of one step
/// from the same point is the step with the averaged gradient); averaging every 4 steps after a
/// synchronous warm-up trains the MNIST MLP within 3% of DDP's accuracy while communicating a
/// quarter as often.
#[test]
fn local_sgd_averages_models_and_trains_close_to_ddp() {
    let sgd = "[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 5\nlog_every = 1\n";
    let ddp = &train_on(2, &mnist_cfg(sgd, 16), &quiet())[0];
    let local = &train_on(2, &mnist_cfg(&format!("{sgd}[ddp]\nlocal_sgd = {{ every = 1 }}\n"), 16), &quiet())[0];
    let d = max_diff(&local.params, &ddp.params);
    assert!(d < 1e-5, "local SGD every step vs DDP: {d}");
    let text = |extra: &str| {
        let t = format!(
            "[model]\nkind = \"mlp\"\nhidden = [128]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[optim]\nkind = \"adamw\"\nlr = 2e-3\n[train]\nsteps = 300\nlog_every = 100\neval_batches = 20\n{extra}",
            kolo_testkit::files::mnist_dir().display()
        );
        Config::parse(&t, "test").unwrap()
    };
    let a = &train_on(2, &text(""), &quiet())[0];
    let b = train_on(2, &text("[ddp]\nlocal_sgd = { every = 4, warmup_steps = 20 }\n"), &quiet());
    assert_eq!(b[0].params, b[1].params, "the last step averaged the models");
    let (acc_a, acc_b) = (a.eval.as_ref().unwrap().accuracy.unwrap(), b[0].eval.as_ref().unwrap().accuracy.unwrap());
    eprintln!("MNIST MLP 300 steps: DDP accuracy {acc_a:.4}, local SGD (H = 4) {acc_b:.4}");
    assert!(acc_b > acc_a - 0.03, "local SGD {acc_b} vs DDP {acc_a}");
    let rounds = b[0].comm_bytes.iter().filter(|x| **x > 0).count();
    assert_eq!(rounds, 20 + (300 - 20) / 4, "20 synchronous steps, then an average every 4");
}

/// A rank that is slow at its own work (a sleep injected in every step) is named as the
/// straggler; with equal ranks nobody is. Parameter-server workers too, from the servers' view.
#[test]
fn the_slow_rank_is_named_as_the_straggler() {
    let cfg = mnist_cfg("[train]\nsteps = 6\nlog_every = 3\n", 16);
    let slow = train_on(3, &cfg, &RunOptions { slow_rank: Some((1, 40)), quiet: true, ..Default::default() });
    for s in &slow {
        let (r, lag) = s.straggler.expect("a straggler is named");
        assert_eq!(r, 1, "every rank names rank 1");
        assert!(lag > 20.0, "lag {lag} ms");
    }
    // Two ranks: the slow one is compared with the other (the lower median).
    let pair = train_on(2, &cfg, &RunOptions { slow_rank: Some((1, 40)), quiet: true, ..Default::default() });
    assert_eq!(pair[0].straggler.map(|s| s.0), Some(1), "with 2 ranks too");
    let even = train_on(3, &cfg, &quiet());
    if let Some((r, lag)) = even[0].straggler {
        // Threads on 2 cores are not perfectly even: allow noise, never a 40 ms lag.
        assert!(lag < 20.0, "rank {r} named with {lag} ms");
    }
    // Parameter-server workers share no communicator: the servers see when each worker's
    // pushes arrive, and every worker names the slow one (BSP; BSP with a backup worker, whose
    // late pushes are dropped; async), whichever it is.
    for (consistency, backup, slow) in [("bsp", 0, 1), ("bsp", 0, 2), ("bsp", 1, 2), ("async", 0, 1)] {
        let ps = mnist_cfg(
            &format!(
                "[train]\nsteps = 9\nlog_every = 3\nstrategy = \"ps\"\n[ps]\nconsistency = \"{consistency}\"\nbackup_workers = {backup}\nchunk = 4000\nservers = 2\n"
            ),
            16,
        );
        let opts = RunOptions { slow_rank: Some((slow, 40)), ..quiet() };
        for (w, s) in train_ps(&ps_cluster(2), 3, &ps, &opts).iter().enumerate() {
            let (r, lag) = s.straggler.unwrap_or_else(|| panic!("{consistency}, {backup} backup: worker {w} names no straggler"));
            assert_eq!(r, slow, "{consistency}, {backup} backup: worker {w} names worker {r} ({lag:.1} ms)");
            // BSP: the slow worker's pushes come its 40 ms late. With a backup worker, and async,
            // the others run on without it; it is behind by as long as they have run since the
            // first step it has not pushed (its late pushes are dropped, still timed).
            assert!(lag > if consistency == "bsp" && backup == 0 { 20.0 } else { 1.0 }, "{consistency}, {backup} backup: lag {lag} ms");
        }
    }
}

/// The parameter servers' straggler arithmetic: the window's mean lag per push, or how long a
/// worker is behind now when that is more; workers with neither are left out.
#[test]
fn ps_window_straggler_takes_the_window_and_the_workers_behind() {
    use kolo_train::ps_worker::window_straggler;
    // Worker 2 pushed 4 times in the window, 30 ms late each; the others on time.
    let named = window_straggler(&[10.0, 12.0, 150.0], &[8, 8, 8], &[10.0, 10.0, 30.0], &[4, 4, 4], &[0.0; 3]);
    assert_eq!(named, Some((2, 30.0 - 0.5)));
    // Worker 1 pushed nothing in the window but has been behind for 80 ms.
    assert_eq!(window_straggler(&[5.0, 0.0, 5.0], &[8, 4, 8], &[0.0; 3], &[4, 4, 4], &[0.0, 80.0, 0.0]).map(|s| s.0), Some(1));
    // Worker 2 is done (no pushes, not behind): left out; one worker left names nobody.
    assert_eq!(window_straggler(&[0.0, 0.0, 0.0], &[8, 4, 8], &[0.0; 3], &[4, 4, 8], &[0.0; 3]), None);
}

/// TensorBoard event files: every rank writes its own run; the records parse back with valid
/// CRCs and hold the training loss at each log step and the final evaluation.
#[test]
fn tensorboard_event_files_hold_the_training_curves() {
    let dir = scratch_dir("tb-it");
    let cfg = mnist_cfg(&format!("[train]\nsteps = 6\nlog_every = 2\neval_batches = 2\ntensorboard_dir = \"{}\"\n", dir.display()), 16);
    let s = train_on(2, &cfg, &quiet());
    for (r, summary) in s.iter().enumerate() {
        let run = dir.join(format!("rank{r}"));
        let file = std::fs::read_dir(&run).unwrap().next().unwrap().unwrap().path();
        assert!(file.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."));
        let scalars = kolo_train::tensorboard::read_scalars(&file).unwrap();
        let loss: Vec<(i64, f32)> = scalars.iter().filter(|x| x.0 == "train/loss").map(|x| (x.1, x.2)).collect();
        assert_eq!(loss.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 4, 6]);
        assert!((f64::from(loss[2].1) - summary.last_loss).abs() < 1e-4);
        let acc = scalars.iter().find(|x| x.0 == "eval/accuracy").expect("final accuracy");
        assert_eq!(acc.1, 6);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Observability is the driver's Reporter (#16): the sequence-parallel strategy and the
/// PipeDream-2BW loop, which had none, write the same TensorBoard curves and JSON lines as DDP,
/// the loss being the average over all ranks (2BW: the loss every stage agrees on after each
/// update) at each log step.
#[test]
fn sequence_parallel_and_2bw_runs_write_tensorboard_and_json_logs() {
    for (tag, section) in [("sp", "[mesh]\nsp = 2\n"), ("2bw", "[pipeline]\nmicro_batches = 2\nschedule = \"2bw\"\n")] {
        let dir = scratch_dir(&format!("{tag}-obs"));
        let cfg = gpt_cfg(
        &format!(
            "[train]\nsteps = 6\nlog_every = 2\neval_batches = 2\nsample_chars = 0\ntensorboard_dir = \"{}\"\njson_log = \"{}/log-{{rank}}.jsonl\"\n{section}",
            dir.join("tb").display(),
            dir.display()
        ),
        4,
    );
        let s = train_on(2, &cfg, &quiet());
        for (r, summary) in s.iter().enumerate() {
            let run = dir.join("tb").join(format!("rank{r}"));
            let file = std::fs::read_dir(&run).unwrap().next().unwrap().unwrap().path();
            let scalars = kolo_train::tensorboard::read_scalars(&file).unwrap();
            let loss: Vec<(i64, f32)> = scalars.iter().filter(|x| x.0 == "train/loss").map(|x| (x.1, x.2)).collect();
            assert_eq!(loss.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 4, 6], "rank {r}");
            assert!((f64::from(loss[2].1) - summary.last_loss).abs() < 1e-4, "rank {r}");
            let lines = std::fs::read_to_string(dir.join(format!("log-{r}.jsonl"))).unwrap();
            let recs: Vec<serde_json::Value> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            assert_eq!(recs.iter().map(|v| v["step"].as_u64().unwrap()).collect::<Vec<_>>(), vec![2, 4, 6]);
            assert!(recs
                .iter()
                .all(|v| v["rank"] == r && v["loss"].as_f64().is_some_and(f64::is_finite) && v["step_ms"].as_f64().is_some()));
        }
        assert_eq!(s[0].last_loss, s[1].last_loss, "{tag}: the loss is averaged over the ranks");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

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
        assert_eq!(count(&ev, pid, "forward + backward"), 4, "rank {pid}");
        assert_eq!(count(&ev, pid, "all_reduce gradients"), 4, "rank {pid}");
    }

    let tl = dir.join("tl-ep");
    let cfg = moe_cfg(4, &format!("eval_every = 2\ntimeline_dir = \"{}\"\n[mesh]\nep = 2\n", tl.display()));
    let s = train_on(2, &cfg, &quiet());
    assert!(s[0].eval.is_some() && s[1].eval.is_none(), "rank 0 evaluates the assembled model");
    let ev = trace(&tl);
    for pid in 0..2 {
        assert_eq!(count(&ev, pid, "all_reduce gradients"), 3, "rank {pid}");
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

/// The timeline: every rank's compute spans and bucket collectives, merged by rank 0 into one
/// Chrome trace-event file with a process per rank.
#[test]
fn timeline_merges_every_ranks_compute_and_collectives() {
    let dir = scratch_dir("timeline");
    let cfg = mnist_cfg(
        &format!(
            "[train]\nsteps = 3\ntimeline_dir = \"{}\"\n[ddp]\nbucket_cap = \"256KiB\"\nfirst_bucket_cap = \"64KiB\"\n",
            dir.display()
        ),
        16,
    );
    train_on(2, &cfg, &quiet());
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("trace.json")).unwrap()).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    for pid in 0..2 {
        let spans: Vec<&serde_json::Value> = ev.iter().filter(|e| e["pid"] == pid && e["ph"] == "X").collect();
        assert_eq!(spans.iter().filter(|e| e["name"] == "forward + backward").count(), 3, "rank {pid}");
        let buckets = spans.iter().filter(|e| e["cat"] == "comm").count();
        assert!(buckets >= 3 * 2, "rank {pid}: {buckets} bucket spans");
        assert!(spans.iter().all(|e| e["ts"].as_f64().unwrap() > 1e15 && e["dur"].as_f64().unwrap() >= 0.0), "wall-clock microseconds");
    }
    assert!(ev.iter().any(|e| e["ph"] == "M" && e["args"]["name"] == "rank 1"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A coordinator and `servers` parameter servers on real sockets in this process.
struct PsCluster {
    coord: kolo_ps::Coordinator,
    _servers: Vec<kolo_ps::Server>,
    token: kolo_rendezvous::JobToken,
}

fn ps_cluster(servers: usize) -> PsCluster {
    ps_cluster_with(servers, Duration::from_secs(5))
}

fn ps_cluster_with(servers: usize, dead_after: Duration) -> PsCluster {
    let token = kolo_rendezvous::JobToken::generate();
    let coord = kolo_ps::Coordinator::start("127.0.0.1:0", token.clone(), dead_after).unwrap();
    let _servers = (0..servers)
        .map(|_| {
            kolo_ps::Server::start(kolo_ps::server::ServerOptions {
                listen: "127.0.0.1:0".into(),
                coordinator: coord.addr().to_string(),
                token: token.clone(),
                timeout: std::time::Duration::from_secs(30),
                heartbeat: std::time::Duration::from_millis(100),
                refuse_transfers: 0,
            })
            .unwrap()
        })
        .collect();
    PsCluster { coord, _servers, token }
}

fn train_ps(c: &PsCluster, workers: usize, cfg: &Config, opts: &RunOptions) -> Vec<Summary> {
    try_train_ps(c, workers, cfg, opts).into_iter().map(|r| r.unwrap()).collect()
}

fn try_train_ps(c: &PsCluster, workers: usize, cfg: &Config, opts: &RunOptions) -> Vec<Result<Summary, TrainError>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..workers)
            .map(|w| {
                let me =
                    kolo_train::ps_worker::PsWorker { worker: w, workers, coordinator: c.coord.addr().to_string(), token: c.token.clone() };
                s.spawn(move || kolo_train::ps_worker::run_ps(cfg, &me, opts))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Asynchronous parameter servers checkpoint too (#16): the workers never stop together, so
/// worker 0 reads each range as it is (a fuzzy snapshot) with every worker's clock. Worker 1
/// is slow, so at the checkpoint it trails; resumed on fresh servers, each worker continues
/// from its own clock (the slow one redoes the steps the checkpoint does not hold), and the run
/// ends about as well trained as the uninterrupted one. "About": asynchronous training is not
/// repeatable. The uninterrupted run alone ended at 0.587-0.712 accuracy as the slow worker's
/// delay went from 0 to 30 ms per step, so the first version's 0.05 tolerance failed on an idle
/// machine (0.6575 against 0.7120) and on a loaded one (0.6105 against 0.6975); 0.15 covers that
/// spread. The clocks and step counts are exact.
#[test]
fn ps_async_checkpoints_resume_each_worker_from_its_clock() {
    let dir = scratch_dir("ps-async-ck");
    let cfg = |extra: &str| {
        mnist_cfg(
            &format!(
                "[optim]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n[train]\nsteps = 40\nlog_every = 10\nstrategy = \"ps\"\n{extra}\
                 [ps]\nconsistency = \"async\"\nfetch_every = 2\npush_every = 2\nchunk = 4000\nservers = 2\n"
            ),
            16,
        )
    };
    let slow = RunOptions { slow_rank: Some((1, 15)), ..quiet() };
    let clean = train_ps(&ps_cluster(2), 2, &cfg(""), &slow);
    let ck = format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 20\n", dir.display());
    train_ps(&ps_cluster(2), 2, &cfg(&ck), &RunOptions { stop_after: Some(20), ..slow.clone() });
    let meta = kolo_checkpoint::load_any(&dir.join("step-00000020")).unwrap().meta;
    let clocks: Vec<u64> = meta["kolo.ps_clocks"].split(',').map(|c| c.parse().unwrap()).collect();
    assert_eq!(clocks[0], 10, "worker 0 pushed every 2 of its 20 steps");
    assert!(clocks[1] < clocks[0], "the slow worker trails at the checkpoint: {clocks:?}");
    let resumed = train_ps(&ps_cluster(2), 2, &cfg(""), &RunOptions { resume: Some(dir.clone()), ..slow.clone() });
    assert_eq!(resumed[0].step_ms.len(), 20, "worker 0 continues from its step 20");
    assert_eq!(resumed[1].step_ms.len() as u64, 40 - 2 * clocks[1], "worker 1 from its own clock {}", clocks[1]);
    // The slow worker finishes last: its final pull holds every push of the run.
    let acc = |s: &Summary| kolo_train::trainer::evaluate_params(&cfg(""), &s.params).unwrap().accuracy.unwrap();
    let (a, b) = (acc(&clean[1]), acc(&resumed[1]));
    eprintln!("async PS, 40 steps: uninterrupted accuracy {a:.4}, stopped at 20 and resumed {b:.4}, clocks at the checkpoint {clocks:?}");
    assert!(b > a - 0.15, "resumed {b} vs uninterrupted {a}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Parameter-server checkpoints (issue #16): worker 0 writes the servers' state (SGD with
/// momentum: parameters and momentum, 2 servers, each range replicated once) after step 3 of
/// 6 as a data-parallel checkpoint. Resumed on fresh servers it ends bitwise where the
/// uninterrupted run ends; resumed under DDP too (BSP parameter servers train bitwise as DDP).
#[test]
fn ps_bsp_checkpoints_resume_on_fresh_servers_and_under_ddp_bitwise() {
    let dir = scratch_dir("ps-ck");
    let opt = "[optim]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n[train]\nsteps = 6\n";
    let ps = |extra: &str| {
        mnist_cfg(&format!("{opt}{extra}strategy = \"ps\"\n[ps]\nconsistency = \"bsp\"\nchunk = 4000\nservers = 2\nreplication = 1\n"), 24)
    };
    let clean = train_ps(&ps_cluster(2), 2, &ps(""), &quiet());
    let ck = format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 3\n", dir.display());
    let first = train_ps(&ps_cluster(2), 2, &ps(&ck), &RunOptions { stop_after: Some(3), ..quiet() });
    assert_eq!(first[0].steps_done, 3);
    assert!(max_diff(&first[0].params, &clean[0].params) > 1e-3, "the stopped run is not yet where the whole run ends");
    let resumed = train_ps(&ps_cluster(2), 2, &ps(""), &RunOptions { resume: Some(dir.clone()), ..quiet() });
    assert_eq!(resumed[0].steps_done, 6);
    assert_eq!(max_diff(&resumed[0].params, &clean[0].params), 0.0, "resumed on fresh servers");
    let ddp = train_on(2, &mnist_cfg(opt, 24), &RunOptions { resume: Some(dir.clone()), ..quiet() });
    assert_eq!(max_diff(&ddp[0].params, &clean[0].params), 0.0, "the parameter servers' checkpoint resumed under DDP");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A worker dies in the middle of a BSP run; a survivor takes over its data shard from its
/// last step, and the result is bit-identical to the run in which nobody died.
#[test]
fn ps_dead_workers_shard_is_taken_over_and_bsp_ends_bitwise_equal() {
    let cfg = mnist_cfg("[optim]\nkind = \"adam\"\nlr = 0.01\n[train]\nsteps = 10\nstrategy = \"ps\"\n[ps]\nconsistency = \"bsp\"\nchunk = 3000\nservers = 2\nreplication = 1\n", 16);
    let clean = train_ps(&ps_cluster(2), 3, &cfg, &quiet());
    let c = ps_cluster_with(2, Duration::from_millis(800));
    let opts = RunOptions { die_at: Some((2, 4)), ..quiet() };
    let r = try_train_ps(&c, 3, &cfg, &opts);
    let e = r[2].as_ref().expect_err("worker 2 was told to die").to_string();
    assert!(e.contains("died at step 4"), "{e}");
    let survivor = r[0].as_ref().unwrap();
    assert_eq!(survivor.steps_done, 10);
    assert_eq!(max_diff(&survivor.params, &clean[0].params), 0.0, "a run with a dead, replaced worker must end where the clean run ends");
    assert_eq!(r[1].as_ref().unwrap().params, survivor.params);
}

/// BSP through two servers equals synchronous DDP bit for bit: the servers average the two
/// workers' gradients in worker order (a + b, then / 2, as the all-reduce does) and apply the
/// same optimizer code to each range.
///
/// The workers run on the driver (#16), with its reports on: each worker writes its own JSON
/// lines, TensorBoard scalars and trace (pull and push spans); worker 0 evaluates every 2 steps
/// (the parameters it last pulled) and at the end (the final ones).
#[test]
fn ps_bsp_matches_ddp_bitwise() {
    let dir = scratch_dir("ps-driver");
    let opt = "[optim]\nkind = \"sgd\"\nlr = 0.1\nmomentum = 0.9\n[train]\nsteps = 5\nlog_every = 1\n";
    let ddp = train_on(2, &mnist_cfg(opt, 24), &quiet());
    let c = ps_cluster(2);
    let reports = format!(
        "eval_every = 2\njson_log = \"{0}/log-{{rank}}.jsonl\"\ntensorboard_dir = \"{0}/tb\"\ntimeline_dir = \"{0}/tl\"\n",
        dir.display()
    );
    let ps_cfg = mnist_cfg(&format!("{opt}{reports}strategy = \"ps\"\n[ps]\nconsistency = \"bsp\"\nchunk = 4000\nservers = 2\n"), 24);
    let ps = train_ps(&c, 2, &ps_cfg, &quiet());
    assert_eq!(ps[0].params, ps[1].params);
    assert_eq!(max_diff(&ps[0].params, &ddp[0].params), 0.0, "BSP parameter server vs DDP");
    assert!(ps[0].ps.as_ref().unwrap().bytes_out > 0);
    assert!(ps[0].eval.is_some() && ps[1].eval.is_none(), "worker 0 evaluates");
    // The final evaluation reads the final parameters (worker 0 alone, DDP sharded over 2 ranks).
    let (a, b) = (ps[0].eval.as_ref().unwrap().loss, ddp[0].eval.as_ref().unwrap().loss);
    assert!((a - b).abs() < 1e-6, "final eval: parameter server {a} vs DDP {b}");
    for w in 0..2usize {
        let log = std::fs::read_to_string(dir.join(format!("log-{w}.jsonl"))).unwrap();
        let lines: Vec<serde_json::Value> = log.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 5, "worker {w}: {log}");
        assert!(lines.iter().all(|l| l["rank"] == w && l["comm_bytes"].as_u64().unwrap() > 0), "worker {w}: {log}");
        let doc: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("tl").join(format!("trace-rank{w}.json"))).unwrap()).unwrap();
        let ev = doc["traceEvents"].as_array().unwrap();
        for span in ["pull", "push", "forward + backward"] {
            assert_eq!(ev.iter().filter(|e| e["pid"] == w && e["name"] == span).count(), 5, "worker {w}: {span}");
        }
    }
    let tb = dir.join("tb").join("rank0");
    let file = std::fs::read_dir(&tb).unwrap().next().unwrap().unwrap().path();
    let evals: Vec<i64> =
        kolo_train::tensorboard::read_scalars(&file).unwrap().iter().filter(|x| x.0 == "eval/loss").map(|x| x.1).collect();
    assert_eq!(evals, vec![2, 4, 5]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ps_async_downpour_converges_on_mnist() {
    let c = ps_cluster(2);
    let cfg = mnist_cfg(
        "[optim]\nkind = \"adagrad\"\nlr = 0.05\n[train]\nsteps = 300\nlog_every = 50\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\nfetch_every = 2\npush_every = 2\nchunk = 5000\nservers = 2\nreplication = 1\n",
        32,
    );
    let s = train_ps(&c, 2, &cfg, &quiet());
    let acc = s[0].eval.as_ref().unwrap().accuracy.unwrap();
    assert!(acc > 0.85, "async Downpour SGD reached only {:.1}% test accuracy", acc * 100.0);
    // 300 steps, a push every 2: 150 pushes per worker.
    assert_eq!(s[0].comm_bytes.iter().filter(|b| **b > 0).count(), 150);
}

#[test]
fn ps_bounded_delay_holds_a_slowed_worker_within_tau() {
    let c = ps_cluster(1);
    let cfg = mnist_cfg(
        "[optim]\nkind = \"sgd\"\nlr = 0.05\n[train]\nsteps = 20\nstrategy = \"ps\"\n[ps]\nconsistency = \"bounded\"\nstaleness = 2\n",
        16,
    );
    let opts = RunOptions { slow_rank: Some((1, 40)), ..quiet() };
    let s = train_ps(&c, 2, &cfg, &opts);
    let lead = s[0].ps.as_ref().unwrap().max_lead;
    assert_eq!(lead, 2, "the fast worker should run exactly tau = 2 steps ahead of the slowed one, not {lead}");
    assert!(s[1].ps.as_ref().unwrap().max_lead <= 2);
}

#[test]
fn ps_filter_sends_fewer_values_and_still_learns() {
    let c = ps_cluster(1);
    let cfg = mnist_cfg("[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 60\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\nfilter_threshold = 0.01\n", 32);
    let s = train_ps(&c, 1, &cfg, &quiet());
    let st = s[0].ps.as_ref().unwrap();
    assert!(st.values_sent * 2 < st.values_total, "the filter sent {} of {} values", st.values_sent, st.values_total);
    let acc = s[0].eval.as_ref().unwrap().accuracy.unwrap();
    eprintln!("filter: sent {} of {} values, accuracy {acc}", st.values_sent, st.values_total);
    assert!(acc > 0.7, "accuracy {acc}");
}

/// Hogwild on a sparse problem from a real dataset: lock-free threads reach the same quality
/// as SGD under a lock (and as one thread).
#[test]
fn hogwild_converges_like_locked_sgd_on_sparse_wine() {
    use kolo_ps::hogwild::{evaluate, train_logistic, HogwildConfig, Mode};
    let data = kolo_train::data::wine_sparse(&kolo_testkit::files::wine_csv(), 8).unwrap();
    assert_eq!(data.examples.len(), 1599);
    assert_eq!(data.dim, 11 * 8 + 55 * 64);
    assert!(data.examples.iter().all(|e| e.idx.len() == 66 && e.idx.iter().all(|i| (*i as usize) < data.dim)));
    // Every fifth wine is held out.
    let split = |keep: usize| kolo_ps::hogwild::SparseSet {
        dim: data.dim,
        examples: data.examples.iter().enumerate().filter(|(i, _)| (i % 5 == 0) == (keep == 1)).map(|(_, e)| e.clone()).collect(),
    };
    let (train, test) = (split(0), split(1));
    let cfg = |threads, mode| HogwildConfig { threads, epochs: 10, lr: 0.02, l2: 1e-3, seed: 3, mode };
    let one = train_logistic(&train, &cfg(1, Mode::Locked));
    let locked = train_logistic(&train, &cfg(4, Mode::Locked));
    let hog = train_logistic(&train, &cfg(4, Mode::Hogwild));
    assert_eq!(hog.updates, 10 * train.examples.len() as u64);
    let (l1, a1) = evaluate(&test, &one.weights);
    let (ll, al) = evaluate(&test, &locked.weights);
    let (lh, ah) = evaluate(&test, &hog.weights);
    eprintln!("held-out log loss / accuracy: 1 thread {l1:.4}/{a1:.3}, 4 locked {ll:.4}/{al:.3}, 4 hogwild {lh:.4}/{ah:.3}");
    // Well above the majority class (53%), and the loss falls epoch over epoch.
    assert!(ah > 0.7 && al > 0.7 && a1 > 0.7, "{ah} {al} {a1}");
    assert!((lh - ll).abs() < 0.03 && (lh - l1).abs() < 0.03, "hogwild {lh} vs locked {ll} vs one thread {l1}");
    assert!(hog.epoch_loss.last().unwrap() < &hog.epoch_loss[0]);
}

/// Sandblaster L-BFGS: vectors on two parameter servers, gradient portions on three worker
/// threads, one of them slowed. Reaches the single-process L-BFGS optimum, and the slowed
/// worker's portions are taken over by backup copies.
#[test]
fn sandblaster_lbfgs_matches_local_lbfgs_and_routes_around_a_slow_worker() {
    use kolo_ps::lbfgs::{minimize, minimize_local, LbfgsConfig, Logistic};
    let data = kolo_train::data::wine_sparse(&kolo_testkit::files::wine_csv(), 4).unwrap();
    let obj = std::sync::Arc::new(Logistic { data, l2: 1e-2, portions: 16 });
    let dim = kolo_ps::lbfgs::Objective::dim(&*obj);
    let cfg =
        LbfgsConfig { history: 5, iterations: 25, tolerance: 1e-7, backup_tasks: true, worker_delay: vec![Duration::from_millis(25)] };
    let (x_ref, loss_ref) = minimize_local(&*obj, &vec![0.0; dim], &cfg);
    let c = ps_cluster(2);
    let job = kolo_ps::JobSpec {
        len: dim as u64,
        chunk: 500,
        workers: 4,
        replication: 0,
        backup: 0,
        consistency: kolo_ps::Consistency::Async,
        optimizer: kolo_optim::OptimizerSpec::Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 },
    };
    let connect = |w: u32| {
        kolo_ps::PsClient::connect(kolo_ps::client::ClientOptions {
            coordinator: c.coord.addr().to_string(),
            token: c.token.clone(),
            job: job.clone(),
            worker: w,
            min_servers: 2,
            timeout: Duration::from_secs(30),
            heartbeat: None,
        })
        .unwrap()
    };
    let mut coord = connect(3);
    coord.init(&vec![0.0; dim]).unwrap();
    let r = minimize(obj.clone(), coord, (0..3).map(connect).collect(), &cfg).unwrap();
    let (f, f_ref) = (*r.loss.last().unwrap(), *loss_ref.last().unwrap());
    eprintln!("sandblaster: loss {:.6} -> {f:.6} in {} evaluations (local: {f_ref:.6}); accepted per worker {:?}, {} backup results discarded, {} evaluations finished while a copy was still running", r.loss[0], r.evaluations, r.accepted_by_worker, r.discarded, r.finished_with_stragglers);
    assert!(f < r.loss[0] * 0.8, "no progress: {:?}", r.loss);
    assert!((f - f_ref).abs() < 1e-4 * f_ref.abs().max(1.0), "sandblaster {f} vs local {f_ref}");
    assert!(max_diff(&r.x, &x_ref) < 5e-3, "weights differ by {}", max_diff(&r.x, &x_ref));
    // The slow worker (25 ms per portion) computed far fewer portions; backups covered for it.
    assert!(r.accepted_by_worker[0] * 2 < r.accepted_by_worker[1].min(r.accepted_by_worker[2]), "{:?}", r.accepted_by_worker);
    assert!(r.discarded > 0 && r.finished_with_stragglers > 0);
}

/// A second worker group (evaluation) reads the same servers while training runs.
#[test]
fn ps_evaluation_group_reads_the_servers_while_training_runs() {
    let c = ps_cluster(1);
    let cfg =
        mnist_cfg("[optim]\nkind = \"adagrad\"\nlr = 0.05\n[train]\nsteps = 200\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\n", 32);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (train, evals) = std::thread::scope(|s| {
        let ev = s.spawn(|| {
            kolo_train::ps_worker::run_ps_eval(
                &cfg,
                &c.coord.addr().to_string(),
                &c.token,
                2,
                Duration::from_millis(200),
                &|| done.load(std::sync::atomic::Ordering::SeqCst),
                true,
            )
            .unwrap()
        });
        let t = train_ps(&c, 2, &cfg, &quiet());
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (t, ev.join().unwrap())
    });
    assert!(evals.len() >= 2, "{} evaluations", evals.len());
    let last = &evals.last().unwrap().1;
    // The last evaluation ran after both workers finished: it saw the trained parameters
    // (untrained: about 0.1). Worker 0's own final evaluation may precede worker 1's last
    // pushes, and async interleavings differ from run to run (accuracy 0.86..0.89 and
    // differences up to 0.016 seen on a loaded 2-core machine), so not compared bitwise.
    let (seen, own) = (last.accuracy.unwrap(), train[0].eval.as_ref().unwrap().accuracy.unwrap());
    assert!(seen > 0.8 && (seen - own).abs() < 0.04, "evaluation group {seen}, worker 0 {own}");
    assert!(evals[0].1.loss > last.loss);
}

/// The optimizer sections the split-model equivalence tests run under: AdamW (their original
/// setting, with clipping where the test uses it) and plain SGD without clipping. AdamW divides
/// out a constant gradient scale and clipping caps the norm, so only the SGD run catches a
/// gradient off by a constant factor (a missing 1/M over micro-batches, a sum instead of an
/// average over replicas; issue #18). SGD's lr is large enough that such a factor moves the
/// parameters by far more than the 1e-4 tolerance.
const SPLIT_OPTIMIZERS: [&str; 2] = ["[optim]\nkind = \"adamw\"\nlr = 0.003\n", "[optim]\nkind = \"sgd\"\nlr = 0.5\n"];

/// Pipeline parallelism: the GPT cut into 2 and 4 stages (ranks), batches of 8 sequences as 4
/// micro-batches, GPipe and 1F1B (with and without re-materialization), follows the one-process
/// run. Not bitwise: each micro-batch's
/// mean loss is scaled by 1/4 and the gradients are summed over micro-batches, while one
/// process averages over 8 sequences at once (f32 reassociation).
#[test]
fn pipeline_matches_one_process_gpt() {
    for optim in SPLIT_OPTIMIZERS {
        let mk = |extra: &str| {
            let text = format!(
                "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 8\n\
                 {optim}[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n{extra}",
                kolo_testkit::files::shakespeare().display()
            );
            Config::parse(&text, "test").unwrap()
        };
        let one = &train_on(1, &mk(""), &quiet())[0];
        for k in [2, 4] {
            for schedule in ["gpipe", "1f1b"] {
                let ranks = train_on(k, &mk(&format!("[pipeline]\nmicro_batches = 4\nschedule = \"{schedule}\"\n")), &quiet());
                for s in &ranks {
                    assert_eq!(s.params, ranks[0].params, "every stage assembles the same model");
                }
                let d = max_diff(&ranks[0].params, &one.params);
                assert!(d < 1e-4, "{k} stages, {schedule}, {optim}: max parameter difference {d}");
                assert!(
                    (ranks[0].last_loss - one.last_loss).abs() < 1e-4,
                    "{k} stages {schedule}: loss {} vs {}",
                    ranks[0].last_loss,
                    one.last_loss
                );
                let bubble = ranks[0].pipeline_bubble.unwrap();
                assert!((0.0..1.0).contains(&bubble));
                // Re-materialization recomputes the same forward in backward: bitwise the same run.
                let remat = train_on(
                    k,
                    &mk(&format!("[pipeline]\nmicro_batches = 4\nschedule = \"{schedule}\"\nrematerialize = true\n")),
                    &quiet(),
                );
                assert_eq!(remat[0].params, ranks[0].params, "{k} stages {schedule}: re-materialized run");
            }
        }
    }
}

/// Flushed pipelines run on the driver (#16): a 1F1B run over 2 stages, and over dp 2 x pp 2,
/// stopped at step 2 and resumed from its checkpoint (each stage wrote its own layers and their
/// optimizer state) ends bitwise where the uninterrupted run does; the checkpoint continues
/// under DDP on the same replicas within 1e-4 (the tolerance of pipeline against one process);
/// the runs evaluate every 2 steps and write a timeline.
#[test]
fn flushed_pipelines_checkpoint_resume_and_evaluate() {
    let dir = scratch_dir("pipe-resume");
    let mk = |extra: &str, batch: usize| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 0.5\n[train]\nsteps = 4\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    let pipe = "[pipeline]\nmicro_batches = 2\nschedule = \"1f1b\"\n";
    for (world, mesh) in [(2, ""), (4, "[mesh]\ndp = 2\n")] {
        let ck = dir.join(format!("w{world}"));
        let tl = dir.join(format!("tl{world}"));
        let extra = |more: &str| format!("eval_every = 2\n{more}{pipe}{mesh}");
        let full = train_on(world, &mk(&extra(&format!("timeline_dir = \"{}\"\n", tl.display())), 4), &quiet());
        let cfg = mk(&extra(&format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n", ck.display())), 4);
        train_on(world, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
        let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
        let resumed = train_on(world, &cfg, &resume);
        for (r, s) in resumed.iter().enumerate() {
            let d = max_diff(&s.params, &full[0].params);
            assert!(s.params == full[0].params, "world {world}, rank {r}: resumed pipeline vs uninterrupted, max difference {d}");
        }
        assert!(full[0].eval.is_some() && full[0].pipeline_bubble.is_some());
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(tl.join("trace.json")).unwrap()).unwrap();
        let fb = doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "forward + backward").count();
        assert_eq!(fb, 4 * world, "every rank's 4 steps on the timeline");
        let replicas = world / 2;
        let ddp = train_on(replicas, &mk("", 4), &resume);
        let d = max_diff(&ddp[0].params, &full[0].params);
        assert!(d < 1e-4, "world {world}: the pipeline's checkpoint continued under DDP: {d}");
    }
    // pp 2 x tp 2: each tensor-parallel group puts its stage's layers and optimizer state
    // together into whole tensors; resumed, the run ends bitwise where the uninterrupted one
    // does, and one process continues the same checkpoint within 1e-4.
    let ck = dir.join("pp-tp");
    let tp = "[mesh]\ntp = 2\n";
    let full = train_on(4, &mk(&format!("{pipe}{tp}"), 4), &quiet());
    let cfg = mk(&format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n{pipe}{tp}", ck.display()), 4);
    train_on(4, &cfg, &RunOptions { stop_after: Some(2), ..quiet() });
    let resume = RunOptions { resume: Some(ck.join("step-00000002")), quiet: true, ..Default::default() };
    for (r, s) in train_on(4, &cfg, &resume).iter().enumerate() {
        let d = max_diff(&s.params, &full[0].params);
        assert!(s.params == full[0].params, "pp 2 x tp 2, rank {r}: resumed vs uninterrupted, max difference {d}");
    }
    let one = train_on(1, &mk("", 4), &resume);
    let d = max_diff(&one[0].params, &full[0].params);
    assert!(d < 1e-4, "the pp x tp checkpoint continued in one process: {d}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// PipeDream-2BW on the driver (#16): its stream is drained at every evaluation and checkpoint
/// and restarted from the two weight versions alive, which changes when work happens but not
/// what is computed: a run that drains after every step ends bitwise where the undrained one
/// does. Stopped at step 4 and resumed from its checkpoint (the latest version, the previous
/// one, the optimizer state, the data position), it ends bitwise where the uninterrupted run
/// does, over 2 stages, dp 2 x pp 2 and pp 2 x tp 2. Every rank's steps are on the timeline.
#[test]
fn pipedream_2bw_drains_checkpoints_and_resumes_bitwise() {
    let dir = scratch_dir("2bw-resume");
    let mk = |extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n\
             [optim]\nkind = \"adamw\"\nlr = 3e-3\nclip_grad_norm = 0.5\n[train]\nsteps = 6\nlog_every = 1\nsample_chars = 0\neval_batches = 2\n\
             {extra}[pipeline]\nmicro_batches = 2\nschedule = \"2bw\"\n",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    for (world, mesh) in [(2, ""), (4, "[mesh]\ndp = 2\n"), (4, "[mesh]\ntp = 2\n")] {
        let tag = format!("{world}{}", mesh.replace(['[', ']', '\n', ' ', '='], ""));
        let tl = dir.join(format!("tl{tag}"));
        let full = train_on(world, &mk(&format!("timeline_dir = \"{}\"\n{mesh}", tl.display())), &quiet());
        if mesh.is_empty() {
            let drained = train_on(world, &mk("eval_every = 1\n"), &quiet());
            let d = max_diff(&drained[0].params, &full[0].params);
            assert!(drained[0].params == full[0].params, "drained after every step vs one stream: max difference {d}");
            assert!(drained[0].eval.is_some());
        }
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(tl.join("trace.json")).unwrap()).unwrap();
        let fb = doc["traceEvents"].as_array().unwrap().iter().filter(|e| e["name"] == "forward + backward").count();
        assert_eq!(fb, 6 * world, "{mesh}: every rank's 6 steps on the timeline");
        let ck = dir.join(format!("ck{tag}"));
        let cfg = mk(&format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 2\n{mesh}", ck.display()));
        train_on(world, &cfg, &RunOptions { stop_after: Some(4), ..quiet() });
        let resume = RunOptions { resume: Some(ck.join("step-00000004")), quiet: true, ..Default::default() };
        for (r, s) in train_on(world, &cfg, &resume).iter().enumerate() {
            let d = max_diff(&s.params, &full[0].params);
            assert!(s.params == full[0].params, "{mesh} rank {r}: resumed 2BW vs uninterrupted, max difference {d}");
            assert_eq!(s.last_loss, full[0].last_loss);
        }
    }
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

/// `kolo plot`: a run's TensorBoard files and JSON-lines logs become loss and throughput PNGs
/// with one line per rank.
#[test]
fn plot_renders_a_runs_curves_to_png() {
    let dir = scratch_dir("plot");
    let cfg = mnist_cfg(
        &format!(
            "[train]\nsteps = 20\nlog_every = 4\ntensorboard_dir = \"{}\"\njson_log = \"{}\"\n",
            dir.join("tb").display(),
            dir.join("log-{rank}.jsonl").display()
        ),
        16,
    );
    train_on(2, &cfg, &quiet());
    let written = kolo_train::plot::plot_run(&dir, &dir).unwrap();
    assert_eq!(written.len(), 2, "{written:?}");
    for (path, lines) in &written {
        assert!(lines.contains("rank0 (5 points)") && lines.contains("tb/rank1 (5 points)"), "{lines}");
        let dec = png::Decoder::new(std::fs::File::open(path).unwrap());
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (800, 480));
        // The first line's colour is drawn.
        assert!(buf.chunks(3).any(|p| p == [31, 119, 180]), "{}: no curve drawn", path.display());
    }
    assert!(kolo_train::plot::plot_run(&dir.join("tb/rank0/none"), &dir).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

fn moe_cfg(batch: usize, extra: &str) -> Config {
    let text = format!(
        "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\nexperts = 4\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = {batch}\n\
         [optim]\nkind = \"adamw\"\nlr = 0.003\nclip_grad_norm = 0.05\n[train]\nsteps = 3\nsample_chars = 0\neval_batches = 2\n{extra}",
        kolo_testkit::files::shakespeare().display()
    );
    Config::parse(&text, "test").unwrap()
}

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
            moe: Some(MoeConfig { experts: 4, top_k: k, capacity_factor: cf, aux_weight: 0.01 }),
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
            let gpt =
                Gpt::new_expert_parallel(cfg.clone(), &mut Rng::new(5), Arc::new(kolo_train::expert_parallel::CommExchange(comm.clone())))
                    .unwrap();
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
    assert!(try_parse("experts = 4\ntop_k = 3", "").contains("top_k"));
    assert!(try_parse("experts = 0", "").contains("experts"));
    assert!(try_parse("experts = 4\ncapacity_factor = 0.0", "").contains("capacity_factor"));
    assert!(try_parse("experts = 3", "[mesh]\nep = 2\n").contains("multiple of mesh.ep"));
    assert!(try_parse("", "[mesh]\nep = 2\n").contains("set model.experts"));
    assert!(try_parse("experts = 4", "[mesh]\ntp = 2\n").contains("without tp"));
}

/// PipeDream-2BW against its definition, computed in one process: batch t's gradient is taken
/// at weight version max(t - 1, 0) and applied to version t (W(t+1) = W(t) - step(grad
/// f(W(t-1)))), with AdamW and clipping by the global norm. Pipelines of 2 and 4 stages (and
/// 2 stages x 2 tensor-parallel ranks) without flushes follow it; a flushed 1F1B run does not
/// (the delay is real).
#[test]
fn pipedream_2bw_follows_its_weight_version_semantics() {
    use kolo_base::Rng;
    use kolo_optim::{clip_factor, lr_at, sum_of_squares, Optimizer};
    use kolo_tensor::models::Gpt;
    use kolo_tensor::{Model, ModelSpec, PlainView};
    let mk = |extra: &str| {
        let text = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 4\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 8\n\
             [optim]\nkind = \"adamw\"\nlr = 0.003\nclip_grad_norm = 0.05\n[train]\nsteps = 5\nsample_chars = 0\neval_batches = 2\n{extra}",
            kolo_testkit::files::shakespeare().display()
        );
        Config::parse(&text, "test").unwrap()
    };
    // The definition, in one process.
    let cfg = mk("");
    let data = kolo_train::trainer::load_data(&cfg, 0).unwrap();
    let batches = kolo_train::trainer::replica_batches(&cfg, data.train.clone(), 0, 1, 0).unwrap();
    let ModelSpec::Gpt(g) = cfg.model_spec(data.vocab_size) else { unreachable!() };
    let gpt = Gpt::new(g, &mut Rng::new(cfg.train.seed)).unwrap();
    let n = gpt.params().numel();
    let mut opt = Optimizer::new(cfg.optimizer(), n);
    let mut previous = gpt.params().to_flat().unwrap();
    for t in 0..cfg.train.steps {
        let current = gpt.params().to_flat().unwrap();
        gpt.params().load(&previous).unwrap();
        let (_, batch) = batches.recv().unwrap();
        let grads = gpt.loss(&batch, &PlainView).unwrap().backward().unwrap();
        let mut g = vec![0f32; n];
        gpt.params().grads_into(&grads, &mut g).unwrap();
        gpt.params().load(&current).unwrap();
        let f = clip_factor(sum_of_squares(&g).sqrt(), 0.05);
        g.iter_mut().for_each(|x| *x *= f);
        let lr = lr_at(cfg.optim.lr, &cfg.schedule(), cfg.optim.warmup_steps, cfg.train.steps, t);
        opt.begin_step();
        for i in 0..gpt.params().len() {
            let r = gpt.params().get(i).range.clone();
            gpt.params().update_one(i, &mut |p| opt.update(r.start, p, &g[r.clone()], lr)).unwrap();
        }
        previous = current;
    }
    let want = gpt.params().to_flat().unwrap();
    for (world, extra) in [(2, ""), (4, ""), (4, "[mesh]\ntp = 2\npp = 2\n")] {
        let cfg = mk(&format!("[pipeline]\nmicro_batches = 4\nschedule = \"2bw\"\n{extra}"));
        let ranks = train_on(world, &cfg, &quiet());
        for s in &ranks {
            assert_eq!(s.params, ranks[0].params, "world {world} {extra}: every rank assembles the same model");
        }
        let d = max_diff(&ranks[0].params, &want);
        assert!(d < 1e-4, "world {world} {extra}: 2BW differs from its definition by {d}");
        assert_eq!(ranks[0].step_ms.len(), 5);
    }
    let flushed = &train_on(2, &mk("[pipeline]\nmicro_batches = 4\n"), &quiet())[0];
    assert!(max_diff(&flushed.params, &want) > 1e-4, "1F1B (flushed) applies each gradient to the weights it was computed on");
    // Too few micro-batches for the version to exist in time: refused.
    let few = mk("[pipeline]\nmicro_batches = 2\nschedule = \"2bw\"\n");
    let errs = run_ranks(LocalComm::create(WorldSize::new(4).unwrap()), |_, c| {
        run(&few, Arc::new(c) as Arc<dyn Communicator>, &quiet()).err().map(|e| e.to_string())
    });
    assert!(errs[0].as_deref().unwrap_or("").contains("micro-batches"), "{errs:?}");
}

/// Dynamic batch sizing: rank 1 of 2 takes 0.4 ms more per example; every 5 steps the ranks
/// re-split the global batch of 64 by their measured time per example, so rank 1 ends with
/// clearly fewer examples; each rank's loss weighs by its share, so training stays exactly one
/// process's with batch 64 (f32 reassociation only).
#[test]
fn dynamic_batch_sizing_moves_work_off_the_slow_rank_and_keeps_the_gradient() {
    let cfg = |extra: &str, batch: usize| {
        mnist_cfg(&format!("[optim]\nkind = \"sgd\"\nlr = 0.05\n[train]\nsteps = 30\nlog_every = 10\n{extra}"), batch)
    };
    let one = &train_on(1, &cfg("", 64), &quiet())[0];
    let opts = RunOptions { slow_per_example: Some((1, 0.4)), ..quiet() };
    let ranks = train_on(2, &cfg("[ddp]\ndynamic_batch_every = 5\n", 32), &opts);
    let split = ranks[0].batch_split.clone().unwrap();
    assert_eq!(split.iter().sum::<usize>(), 64);
    assert!(split[1] < 24, "the slow rank should end with fewer examples, got {split:?}");
    assert_eq!(ranks[1].batch_split.as_ref(), Some(&split), "every rank agrees on the split");
    let d = max_diff(&ranks[0].params, &one.params);
    assert!(d < 2e-5, "max parameter difference to one process with batch 64: {d}");
    assert!(Config::parse("[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[ddp]\ndynamic_batch_every = 5\n", "t")
        .is_err());
}

fn fed_job(cfg: &Config, clients: usize) -> (kolo_train::fed::FedSummary, Vec<kolo_train::fed::ClientReport>) {
    let token = kolo_rendezvous::JobToken::generate();
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, t2) = (cfg.clone(), token.clone());
    let server = std::thread::spawn(move || {
        kolo_train::fed::serve(&c2, "127.0.0.1:0", t2, clients, |a| tx.send(a.to_string()).unwrap(), &|_| {}).unwrap()
    });
    let addr = rx.recv().unwrap();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (cfg, addr, token) = (cfg.clone(), addr.clone(), token.clone());
            std::thread::spawn(move || kolo_train::fed::client(&cfg, &addr, &token, i, true).unwrap())
        })
        .collect();
    let reports = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (server.join().unwrap(), reports)
}

/// FedAvg on non-IID MNIST: each of 6 clients holds 2 label-sorted shards (1500 examples, at
/// most 4 digits), trains one local epoch per round; after 25 rounds the global model passes 78%
/// (MLP 784-32-10); what a client sent is model-sized updates only (none of its images' bytes);
/// secure aggregation (pairwise masks) ends with the same model as plain averaging.
#[test]
fn fedavg_learns_non_iid_mnist_and_raw_data_never_leaves_a_client() {
    let text = |secure: bool| {
        format!(
            "[optim]\nkind = \"sgd\"\nlr = 0.02\n[train]\neval_batches = 40\n[fed]\nrounds = 25\nclients = 6\nclients_per_round = 6\nexamples_per_client = 1500\nsplit = \"labels\"\nsecure = {secure}\n"
        )
    };
    let plain_cfg = mnist_cfg(&text(false), 20);
    let (plain, reports) = fed_job(&plain_cfg, 6);
    let acc = plain.evals.last().unwrap().accuracy.unwrap();
    let first = plain.evals[0].accuracy.unwrap();
    eprintln!("FedAvg accuracy by round: {:?}", plain.evals.iter().map(|e| e.accuracy.unwrap()).collect::<Vec<_>>());
    assert!(acc > 0.78 && acc > first + 0.2, "accuracy after 25 rounds {acc} (after round 1: {first})");
    assert_eq!(plain.rounds.len(), 25);
    assert!(plain.rounds.iter().all(|r| r.used.len() == 6 && r.late.is_empty()));
    // What left each client: its example count, polls and its updates; never an image.
    let data = kolo_train::data::Mnist::load(&kolo_testkit::files::mnist_dir(), "train").unwrap();
    let numel = plain.params.len() as u64;
    for (i, r) in reports.iter().enumerate() {
        assert_eq!(r.params, plain.params, "client {i} received the final model");
        assert!(r.rounds_trained >= 1);
        // Each update is 4 bytes per parameter plus a 30-byte header; joins and polls are tiny.
        let updates = u64::from(r.rounds_trained) * (numel * 4 + 30);
        assert!(
            r.bytes_out >= updates && r.bytes_out < updates + 20_000,
            "client {i} sent {} bytes for {} updates",
            r.bytes_out,
            r.rounds_trained
        );
        assert_eq!(r.shard.len(), 1500);
        let digits: std::collections::BTreeSet<u8> = r.shard.iter().map(|&e| data.labels()[e]).collect();
        assert!(digits.len() <= 4, "client {i} holds digits {digits:?}: not the non-IID split (2 shards, each within at most 2 digits)");
        for &ex in r.shard.iter().step_by(15) {
            assert!(!kolo_train::fed::contains_example(&r.sent, data.image(ex)), "client {i} sent the bytes of example {ex}");
        }
    }
    let (secure, _) = fed_job(&mnist_cfg(&text(true), 20), 6);
    let d = max_diff(&secure.params, &plain.params);
    assert!(d < 1e-4, "secure aggregation ends {d} away from plain averaging");
}

/// IMPALA: 2 actor threads run CartPole-v0 on whatever policy they last saw (the learner is
/// several updates ahead: off-policy data) and never wait; V-trace corrects the lag; the mean
/// return of 100 episodes reaches 195 within 1.5 M learned-from environment steps (6 seeds
/// measured: 0.23-0.60 M). The 5 x 5 grid world is solved too.
#[test]
fn impala_solves_cartpole_and_the_grid_world() {
    use kolo_train::impala::{run as impala, EnvKind, ImpalaConfig};
    let r = impala(&ImpalaConfig { max_env_steps: 1_500_000, ..ImpalaConfig::cartpole(2) }, &mut |_, _| {}).unwrap();
    assert!(r.solved_at.is_some() && r.mean_return >= 195.0, "CartPole not solved: {r:?}");
    assert!(r.max_lag >= 1 && r.mean_lag > 0.0, "the actors' policies lagged the learner's: {r:?}");
    assert!(r.env_steps >= r.learned_steps);
    let g = impala(
        &ImpalaConfig { env: EnvKind::Grid, target: Some(EnvKind::Grid.solved()), max_env_steps: 500_000, ..ImpalaConfig::cartpole(2) },
        &mut |_, _| {},
    )
    .unwrap();
    assert!(g.solved_at.is_some(), "grid world not solved: {g:?}");
}

/// Scheduled communication (ByteScheduler) changes when gradients travel and when each
/// parameter is updated, not the arithmetic: the same mean gradient (sum over ranks / n, as
/// plain DDP's average) and the same AdamW update per parameter. With chunks smaller than most
/// parameters and a credit of a few chunks, many rounds and out-of-order completions happen;
/// the result equals plain DDP's bitwise on 2 ranks and within 1e-6 on 3 (the ring all-reduce
/// adds a chunk's values in an order that depends on where the chunk starts).
///
/// On the driver (#16), with evaluation every 3 steps and the timeline on: the GPT run stopped
/// at step 3 and resumed from its checkpoint ends bitwise where the uninterrupted one does, and
/// plain DDP resumed from the same checkpoint ends there too.
#[test]
fn scheduled_ddp_matches_plain_ddp() {
    let dir = scratch_dir("sched");
    let opt = "[optim]\nkind = \"adamw\"\nlr = 0.01\nweight_decay = 0.01\n[train]\nsteps = 6\nlog_every = 1\n";
    let sched_cfg = "[ddp]\nschedule = { chunk = \"1KiB\", credit = \"3KiB\" }\n";
    for (n, model) in [(2, "gpt"), (3, "mlp")] {
        let mk = |extra: &str| if model == "gpt" { gpt_cfg(&format!("{opt}{extra}"), 4) } else { mnist_cfg(&format!("{opt}{extra}"), 16) };
        let plain = train_on(n, &mk(""), &quiet());
        let observe = format!("eval_every = 3\neval_batches = 2\ntimeline_dir = \"{}\"\n", dir.join("tl").display());
        let sched = train_on(n, &mk(&format!("{}{sched_cfg}", if model == "gpt" { &observe } else { "" })), &quiet());
        for s in &sched {
            assert_eq!(s.params, sched[0].params, "every rank holds the same parameters");
            assert_eq!(s.steps_done, 6);
        }
        let d = max_diff(&sched[0].params, &plain[0].params);
        if n == 2 {
            assert_eq!(d, 0.0, "{model} on 2 ranks: scheduled vs plain DDP");
        } else {
            assert!(d < 1e-6, "{model} on {n} ranks: max parameter difference {d}");
            continue;
        }
        // Every step of every rank on the trace, with the scheduler's collectives.
        let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("tl").join("trace.json")).unwrap()).unwrap();
        let ev = doc["traceEvents"].as_array().unwrap();
        for pid in 0..2 {
            let named = |p: &dyn Fn(&str) -> bool| ev.iter().filter(|e| e["pid"] == pid && p(e["name"].as_str().unwrap_or(""))).count();
            assert_eq!(named(&|x| x == "forward + backward"), 6, "rank {pid}");
            assert!(named(&|x| x.starts_with("all_reduce")) >= 6, "rank {pid}: the scheduler's rounds");
        }
        let ck = format!("checkpoint_dir = \"{}\"\ncheckpoint_every = 3\n", dir.join("ck").display());
        train_on(n, &mk(&format!("{ck}{sched_cfg}")), &RunOptions { stop_after: Some(3), ..quiet() });
        let resume = RunOptions { resume: Some(dir.join("ck").join("step-00000003")), quiet: true, ..Default::default() };
        for (how, extra) in [("scheduled", sched_cfg), ("plain", "")] {
            let resumed = train_on(n, &mk(extra), &resume);
            let d = max_diff(&resumed[0].params, &sched[0].params);
            assert!(resumed[0].params == sched[0].params, "{how} DDP resumed from step 3 vs uninterrupted: max difference {d}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // What cannot wait for every gradient is refused up front.
    let bad = Config::parse(
        "[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optim]\nclip_grad_norm = 1.0\n[ddp]\nschedule = {}\n",
        "test",
    )
    .unwrap_err();
    assert!(bad.to_string().contains("ddp.schedule"), "{bad}");
}

/// After `retain_freed_memory`, a freed 48 MiB block is reused without page faults. Before
/// it, glibc maps every block over 32 MiB on its own (and trims freed heap tops), so each
/// allocation faults in all of its 12,288 pages again, as every training step did.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn freed_memory_stays_in_the_process_during_training() {
    fn faults() -> i64 {
        // SAFETY: getrusage fills the struct it is given.
        unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut u);
            u.ru_minflt
        }
    }
    let cycle = || {
        let before = faults();
        let mut block = vec![0u8; 48 << 20];
        for b in block.iter_mut().step_by(4096) {
            *b = 1;
        }
        std::hint::black_box(&block);
        drop(block);
        faults() - before
    };
    kolo_train::trainer::retain_freed_memory();
    cycle();
    let again = cycle();
    assert!(again < 1000, "a reused 48 MiB block page-faulted {again} times");
}
