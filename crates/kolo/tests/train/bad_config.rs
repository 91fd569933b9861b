//! Settings that cannot run are refused before training, naming the setting and the rank.

use super::*;

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

/// Ranks reading different corpora stop at start-up (issue #34: `data.path` may differ per
/// rank, and a corpus with shifted ids of the same vocabulary trained silently): rank 1 reads
/// the same characters rotated by one position, and every rank fails naming rank 1.
#[test]
fn ranks_reading_different_data_refuse_to_start() {
    let dir = scratch_dir("other-data");
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read(kolo_testkit::files::shakespeare()).unwrap();
    let text = &text[..20_000];
    let mut rotated = text[1..].to_vec();
    rotated.push(text[0]);
    let (a, b) = (dir.join("a.txt"), dir.join("b.txt"));
    std::fs::write(&a, text).unwrap();
    std::fs::write(&b, &rotated).unwrap();
    let cfg = |path: &std::path::Path| {
        let t = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 16\nn_head = 2\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n[train]\nsteps = 2\n",
            path.display()
        );
        Config::parse(&t, "test").unwrap()
    };
    let same = [cfg(&a), cfg(&a)];
    let ok = run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| run(&same[r], Arc::new(c), &quiet()).is_ok());
    assert_eq!(ok, vec![true, true], "the same corpus was refused");
    let cfgs = [cfg(&a), cfg(&b)];
    let errs =
        run_ranks(LocalComm::create(WorldSize::new(2).unwrap()), |r, c| run(&cfgs[r], Arc::new(c), &quiet()).err().map(|e| e.to_string()));
    for (r, e) in errs.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} trained on other data"));
        assert!(e.contains("rank 1 read other data than rank 0"), "rank {r}: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
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
    // Sizes and shapes of zero (issue #34: accepted, then failing or dividing by zero later).
    assert!(err(&format!("{base}[ddp]\nbucket_cap = \"0B\"\n")).contains("ddp.bucket_cap: \"0B\" is empty"));
    assert!(err(&format!("{base}[ddp]\nfirst_bucket_cap = \"0\"\n")).contains("ddp.first_bucket_cap: \"0\" is empty"));
    let text = "[data]\nkind = \"text\"\npath = \"x\"\nbatch_size = 8\n";
    for field in ["seq", "d_model", "n_head", "n_layer"] {
        let e = err(&format!("[model]\nkind = \"gpt\"\n{field} = 0\n{text}"));
        assert!(e.contains(&format!("model.{field} must be at least 1")), "{field}: {e}");
    }
    assert!(err(&format!("{base}[ddp]\nzero_stage = 4\n")).contains("ddp.zero_stage must be 0, 1, 2 or 3, not 4"));
    assert!(err(&format!("{base}[ddp]\nzero_stage = 3\n")).contains("shards the GPT's blocks"));
    // ZeRO-1 all-reduces as DDP does: every codec; ZeRO-2/3 reduce-scatter: the casts only.
    assert!(Config::parse(&format!("{base}[ddp]\nzero_stage = 1\ncompression = {{ method = \"powersgd\" }}\n"), "t").is_ok());
    assert!(Config::parse(&format!("{base}[ddp]\nzero_stage = 2\ncompression = {{ method = \"bf16\" }}\n"), "t").is_ok());
    assert!(err(&format!("{base}[ddp]\nzero_stage = 2\ncompression = {{ method = \"powersgd\" }}\n"))
        .contains("ddp.zero_stage = 2 reduce-scatters the gradients: ddp.compression with fp16 or bf16 there (torch FSDP's reduce_dtype), not Powersgd"));
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
    // Pipelines take ZeRO and parameter groups (the library's trainer per stage);
    // PipeDream-2BW, whose stages keep two weight versions, refuses ZeRO-3.
    let one_f_one_b = two_bw.replace("2bw", "1f1b");
    assert!(Config::parse(&format!("{one_f_one_b}[ddp]\nzero_stage = 3\n[optim]\nweight_decay = 0.1\n"), "t").is_ok());
    assert!(err(&format!("{two_bw}[ddp]\nzero_stage = 3\n")).contains("PipeDream-2BW keeps two versions"));
    assert!(Config::parse(&format!("{two_bw}[ddp]\nzero_stage = 2\n"), "t").is_ok());
    assert!(err(&format!("{two_bw}[ddp]\nlocal_sgd = {{ every = 2 }}\n")).contains("PipeDream-2BW averages every step"));
    assert!(Config::parse(&format!("{one_f_one_b}[ddp]\nlocal_sgd = {{ every = 2 }}\n"), "t").is_ok());
    assert!(Config::parse(&format!("{two_bw}[optim]\nweight_decay = 0.1\n"), "t").is_ok());
    // Mixed precision: GPipe and 1F1B take bf16 and f16; PipeDream-2BW, which cannot skip an
    // overflowing step, bf16 only. The micro-batches are the accumulation.
    for p in ["bf16", "f16"] {
        assert!(Config::parse(&format!("{one_f_one_b}[train]\nprecision = \"{p}\"\n"), "t").is_ok(), "1F1B in {p}");
    }
    assert!(Config::parse(&format!("{two_bw}[train]\nprecision = \"bf16\"\n"), "t").is_ok());
    assert!(err(&format!("{two_bw}[train]\nprecision = \"f16\"\n")).contains("cannot skip an f16 step"));
    assert!(Config::parse(&format!("{one_f_one_b}[train]\ngrad_accum = 2\n"), "t").is_ok());
    assert!(err(&format!("{two_bw}[train]\ngrad_accum = 2\n")).contains("PipeDream-2BW streams one batch per step"));
    // Pipelines (PipeDream-2BW too) compress each stage's gradients with the cast codecs and
    // PowerSGD; tensor parallelism with the casts.
    assert!(Config::parse(&format!("{one_f_one_b}[ddp]\ncompression = {{ method = \"bf16\" }}\n"), "t").is_ok());
    assert!(Config::parse(&format!("{one_f_one_b}[ddp]\ncompression = {{ method = \"powersgd\", rank = 2 }}\n"), "t").is_ok());
    assert!(err(&format!("{one_f_one_b}[ddp]\ncompression = {{ method = \"qsgd\", levels = 16 }}\n"))
        .contains("[pipeline] compresses each stage's gradients with fp16 or bf16 or PowerSGD only (yet), not Qsgd"));
    assert!(Config::parse(&format!("{two_bw}[ddp]\ncompression = {{ method = \"bf16\" }}\n"), "t").is_ok());
    assert!(err(&format!("{two_bw}[ddp]\ncompression = {{ method = \"topk\", fraction = 0.1 }}\n"))
        .contains("[pipeline] compresses each stage's gradients with fp16 or bf16 or PowerSGD only (yet), not Topk"));
    assert!(Config::parse(&format!("{gpt}[mesh]\ntp = 2\n[ddp]\ncompression = {{ method = \"fp16\" }}\n"), "t").is_ok());
    assert!(err(&format!("{gpt}[mesh]\ntp = 2\n[ddp]\ncompression = {{ method = \"topk\", fraction = 0.1 }}\n"))
        .contains("mesh.tp compresses each piece's gradients with fp16 or bf16 only (yet), not Topk"));
    assert!(err(&format!("{gpt}[mesh]\ntp = 2\n[ddp]\ncompression = {{ method = \"powersgd\", rank = 2 }}\n"))
        .contains("mesh.tp compresses each piece's gradients with fp16 or bf16 only (yet), not Powersgd"));
    // Blocks checkpointed inside a pipeline's stages.
    let blocks = one_f_one_b.replace("[data]", "checkpoint_blocks = [0]\n[data]");
    assert!(blocks.contains("checkpoint_blocks") && Config::parse(&blocks, "t").is_ok());
    assert!(Config::parse(&format!("{blocks}[mesh]\ntp = 2\n"), "t").is_ok(), "checkpointed blocks beside pp x tp");
    // Tensor, sequence and expert parallelism take mixed precision, beside a pipeline too.
    assert!(Config::parse(&format!("{gpt}[mesh]\nsp = 2\n[train]\nprecision = \"bf16\"\n"), "t").is_ok());
    assert!(Config::parse(&format!("{gpt}[mesh]\ntp = 2\n[train]\nprecision = \"bf16\"\n"), "t").is_ok());
    assert!(Config::parse(&format!("{one_f_one_b}[mesh]\ntp = 2\n[train]\nprecision = \"f16\"\n"), "t").is_ok());
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

/// The memory a micro-batch certainly needs is estimated from the model and the batch, and a
/// batch that exceeds what the machine has available is refused naming both (issue #34).
#[test]
fn a_batch_is_checked_against_the_memory_available() {
    let mlp =
        Config::parse("[model]\nkind = \"mlp\"\nhidden = [512, 512]\n[data]\nkind = \"synthetic\"\nbatch_size = 1000\n", "m.toml").unwrap();
    // 1000 x (784 + 512 + 512 + 10) floats.
    assert_eq!(mlp.batch_memory_floor(10), 1000 * 1818 * 4);
    assert!(mlp.check_batch_memory(10, Some(8 << 30)).is_ok());
    assert!(mlp.check_batch_memory(10, None).is_ok(), "unknown memory: not refused");
    let e = mlp.check_batch_memory(10, Some(1 << 20)).unwrap_err();
    assert!(e.starts_with("data.batch_size = 1000: one micro-batch needs at least 0.0 GB") && e.contains("0.0 GB available"), "{e}");
    let gpt = Config::parse(
        "[model]\nkind = \"gpt\"\nseq = 128\nd_model = 64\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"x\"\nbatch_size = 100000\n",
        "g.toml",
    )
    .unwrap();
    // 100000 x 128 positions x (64 x 3 + 65) floats: 13.2 GB.
    assert_eq!(gpt.batch_memory_floor(65), 100_000 * 128 * (64 * 3 + 65) * 4);
    assert!(gpt.check_batch_memory(65, Some(8 << 30)).unwrap_err().contains("needs at least 13.2 GB"));
}
