//! The planner from the command line: plans measured on this machine, Hugging Face models
//! described, planned jobs emitted and run.

use super::*;

/// `kolo train --plan auto` plans on this machine as its ranks measure it at start (the CPU's
/// matrix products and memory-bound rate, averaged over the ranks so that all plan alike) and
/// trains the plan on 2 processes; `kolo plan --cluster measured` costs the same model on it.
#[test]
fn auto_plans_measure_this_machine_at_start() {
    let dir = fresh_dir("plan-auto");
    let cfg = dir.join("gpt.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nkind = \"gpt\"\nseq = 32\nd_model = 64\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = {:?}\nbatch_size = 4\n[train]\nsteps = 2\nsample_chars = 0\n",
            kolo_testkit::files::shakespeare().display().to_string()
        ),
    )
    .unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap(), "--plan", "auto"], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("plan auto: dp") && t.contains("GFLOP/s per rank at its best"), "{t}");
    let args = ["plan", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--vocab", "65", "--devices", "2"];
    let o = run(&[&args[..], &["--cluster", "measured", "--global-batch", "8", "--precision", "f32"]].concat(), &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("CPU (measured at start, candle f32)") && t.contains("  1  dp"), "{t}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kolo plan --hf DIR` describes a Hugging Face model from its config.json (grouped-query
/// attention, head widths, gated MLPs, tied embeddings, experts): its parameter count equals
/// the tensors the checkpoint holds within 1 % for every shipped architecture it describes
/// (Qwen2's q/k/v biases, Qwen3's and Gemma 3's head norms and Gemma 2's and 3's extra norms are
/// not counted: a few hundred of ~10^5, at most 0.6 %); it plans them, and `--emit` writes the
/// model's fine-tuning job, which runs (a plan it cannot run is named).
#[test]
fn plans_describe_hugging_face_models() {
    for arch in ["gpt2", "neox", "llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "qwen2", "qwen3", "phi3"] {
        let dir = kolo_testkit::files::hf_tiny(arch);
        let held: usize = candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
            .values()
            .map(|t| t.elem_count())
            .sum();
        let o = run(&["plan", "--hf", dir.to_str().unwrap(), "--devices", "2", "--cluster", "this-machine", "--top", "1"], &[]);
        let t = text(&o);
        assert!(o.status.success() && t.contains("  1  dp"), "{arch}: {t}");
        let counted: f64 = t.split(" = ").nth(1).and_then(|r| r.split(" parameters").next()).and_then(|n| n.parse().ok()).unwrap_or(0.0);
        let off = (counted / held as f64 - 1.0).abs();
        eprintln!("{arch}: planner {counted}, checkpoint {held} ({:.3} %)", 100.0 * off);
        assert!(off < 1e-2, "{arch}: the planner counts {counted} parameters, the checkpoint holds {held}: {t}");
    }
    let mixtral = kolo_testkit::files::hf_tiny("mixtral");
    let o = run(&["plan", "--hf", mixtral.to_str().unwrap(), "--devices", "2", "--cluster", "this-machine"], &[]);
    assert!(text(&o).contains("MLP 80 gated x 4 experts (top 2)"), "{}", text(&o));
    // The fine-tuning job a plan for the tiny Llama emits runs: tp 2 given, and the searched one.
    let dir = fresh_dir("plan-hf-emit");
    let llama = kolo_testkit::files::hf_llama_tiny();
    let data = kolo_testkit::files::shakespeare().display().to_string();
    let base = ["plan", "--hf", llama.to_str().unwrap(), "--seq", "16", "--devices", "2", "--cluster", "this-machine"];
    let job = ["--global-batch", "4", "--precision", "f32", "--steps", "2", "--data", &data];
    let cases = [
        ("tp", vec!["--evaluate", "tp=2,micro=4"]),
        ("cp", vec!["--evaluate", "cp=2,micro=4"]),
        ("ckpt", vec!["--evaluate", "tp=2,micro=4,ckpt"]),
        ("searched", vec![]),
    ];
    for (tag, extra) in cases {
        let out = dir.join(tag);
        let o = run(&[&base[..], &job[..], &extra[..], &["--emit", out.to_str().unwrap()]].concat(), &[]);
        assert!(o.status.success(), "{tag}: {}", text(&o));
        let toml = std::fs::read_to_string(out.join("train.toml")).unwrap();
        assert!(toml.contains("[model]\nhf = ") && toml.contains("seq = 16"), "{tag}: {toml}");
        if tag == "tp" {
            assert!(toml.contains("[mesh]\ndp = 1\ntp = 2\npp = 1\n"), "{toml}");
        }
        if tag == "cp" {
            assert!(toml.contains("[mesh]\ndp = 1\ntp = 1\npp = 1\nsp = 2\n"), "{toml}");
        }
        // Activation checkpointing: every layer of the model's.
        assert_eq!(toml.contains("checkpoint_blocks = [0, 1]\n"), tag == "ckpt", "{tag}: {toml}");
        let o = Command::new("bash").arg(out.join("launch.sh")).env("KOLO", KOLO).output().unwrap();
        let t = text(&o);
        assert!(o.status.success() && t.contains("step 2/2"), "{tag}: {t}");
    }
    // ZeRO-3 beside tensor parallelism on 4 ranks (the job shards each rank's pieces of the
    // layers over its data-parallel group), and it runs.
    let out = dir.join("zero3-tp");
    let four =
        ["plan", "--hf", llama.to_str().unwrap(), "--seq", "16", "--devices", "4", "--devices-per-node", "4", "--cluster", "this-machine"];
    let o = run(&[&four[..], &job[..], &["--evaluate", "dp=2,tp=2,zero=3,micro=2", "--emit", out.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success(), "{}", text(&o));
    let toml = std::fs::read_to_string(out.join("train.toml")).unwrap();
    assert!(
        toml.contains(
            "zero_stage = 3
"
        ) && toml.contains(
            "[mesh]
dp = 2
tp = 2
pp = 1
"
        ),
        "{toml}"
    );
    let o = Command::new("bash").arg(out.join("launch.sh")).env("KOLO", KOLO).output().unwrap();
    assert!(o.status.success() && text(&o).contains("step 2/2"), "{}", text(&o));
    // Mixtral with its experts dealt out over the 2 replicas: [mesh] ep, and it runs.
    let mixtral = kolo_testkit::files::hf_tiny("mixtral");
    let out = dir.join("ep");
    let args = ["plan", "--hf", mixtral.to_str().unwrap(), "--seq", "16", "--devices", "2", "--cluster", "this-machine"];
    let o = run(&[&args[..], &job[..], &["--evaluate", "dp=2,ep=2,micro=2", "--emit", out.to_str().unwrap()]].concat(), &[]);
    assert!(o.status.success() && text(&o).contains(" ep 2"), "{}", text(&o));
    let toml = std::fs::read_to_string(out.join("train.toml")).unwrap();
    assert!(toml.contains("[mesh]\ndp = 1\ntp = 1\npp = 1\nep = 2\n"), "{toml}");
    let o = Command::new("bash").arg(out.join("launch.sh")).env("KOLO", KOLO).output().unwrap();
    assert!(o.status.success() && text(&o).contains("step 2/2"), "{}", text(&o));
    let o =
        run(&[&args[..], &job[..], &["--evaluate", "dp=2,ep=2,micro=2,zero=2", "--emit", dir.join("ep2").to_str().unwrap()]].concat(), &[]);
    assert!(!o.status.success() && text(&o).contains("ZeRO-2 with the experts dealt out"), "{}", text(&o));
    // Plans the job cannot run are named: selective recomputation, micro-batches accumulated
    // outside a pipeline.
    let o = run(
        &[&base[..], &job[..], &["--evaluate", "tp=2,micro=4,recompute=selective", "--emit", dir.join("sel").to_str().unwrap()]].concat(),
        &[],
    );
    assert!(!o.status.success() && text(&o).contains("selective recomputation"), "{}", text(&o));
    let o = run(&[&base[..], &job[..], &["--evaluate", "dp=2,micro=1", "--emit", dir.join("acc").to_str().unwrap()]].concat(), &[]);
    assert!(!o.status.success() && text(&o).contains("it accumulates micro-batches of 1 outside a pipeline"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kolo plan --emit` writes the chosen plan as a job that runs (issue #37 item 3): the
/// searched plan for Kolo's GPT on this machine's 2 ranks, and a pipeline plan given with
/// --evaluate, each run for 2 steps by the emitted launch.sh; the config carries the plan's
/// mesh, pipeline, batch and ZeRO stage, and a 64-GPU plan's scripts span 8 nodes with one token.
#[test]
fn planned_jobs_are_emitted_and_run() {
    let dir = fresh_dir("emit");
    let data = kolo_testkit::files::shakespeare().display().to_string();
    let plan = |out: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["plan", "--layers", "2", "--d-model", "64", "--heads", "2", "--seq", "32", "--devices", "2"];
        args.extend(["--cluster", "this-machine", "--global-batch", "8", "--precision", "f32", "--steps", "2", "--data", &data]);
        args.extend(["--emit", out.to_str().unwrap()]);
        args.extend(extra);
        let o = run(&args, &[]);
        assert!(o.status.success(), "{}", text(&o));
        std::fs::read_to_string(out.join("train.toml")).unwrap()
    };
    let launch = |out: &std::path::Path| {
        let o = Command::new("bash")
            .arg(out.join("launch.sh"))
            .env("KOLO", KOLO)
            .env("RAYON_NUM_THREADS", "1")
            .env_remove("MASTER_PORT")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let searched = plan(&dir.join("searched"), &[]);
    assert!(searched.contains("kind = \"gpt\"") && searched.contains("[ddp]\nzero_stage = "), "{searched}");
    assert!(launch(&dir.join("searched")).contains("done: 2 steps"));
    let piped = plan(&dir.join("piped"), &["--evaluate", "dp=1,tp=1,pp=2,micro=2"]);
    assert!(piped.contains("[mesh]\ndp = 1\ntp = 1\npp = 2\n") && piped.contains("[pipeline]\nmicro_batches = 4\n"), "{piped}");
    let log = launch(&dir.join("piped"));
    assert!(log.contains("done: 2 steps") && log.contains("bubble"), "{log}");
    // PipeDream-2BW, asked for, is emitted as such and runs; an interleaved schedule is refused.
    let bw = plan(&dir.join("2bw"), &["--evaluate", "pp=2,micro=2,schedule=2bw"]);
    assert!(bw.contains("[pipeline]\nmicro_batches = 4\nschedule = \"2bw\"\n"), "{bw}");
    assert!(launch(&dir.join("2bw")).contains("done: 2 steps"));
    let refused = |layers: &str, evaluate: &str| {
        let no = dir.join("no");
        let args =
            ["plan", "--layers", layers, "--d-model", "64", "--heads", "2", "--seq", "32", "--devices", "2", "--cluster", "this-machine"];
        run(&[&args[..], &["--global-batch", "8", "--emit", no.to_str().unwrap(), "--evaluate", evaluate]].concat(), &[])
    };
    let o = refused("4", "pp=2,micro=2,schedule=interleaved:2");
    assert!(!o.status.success() && text(&o).contains("the interleaved schedule (2 chunks a rank)"), "{}", text(&o));
    // Not a plan Kolo runs (selective recomputation: Kolo's GPT recomputes whole blocks):
    // refused by name. Activation checkpointing with tensor parallelism, which Kolo runs, is
    // emitted when asked for.
    let o = refused("2", "dp=1,tp=2,pp=1,micro=8,recompute=selective");
    let t = text(&o);
    assert!(!o.status.success() && t.contains("this plan is not one Kolo's GPT runs") && t.contains("selective recomputation"), "{t}");
    let ckpt = plan(&dir.join("ckpt"), &["--evaluate", "dp=1,tp=2,pp=1,micro=8,ckpt"]);
    assert!(ckpt.contains("checkpoint_blocks = [0, 1]") && ckpt.contains("tp = 2"), "{ckpt}");
    let big = dir.join("big");
    let o = run(&["plan", "--params", "1.3B", "--devices", "64", "--cluster", "dgx-a100", "--emit", big.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let (sh, sbatch) = (std::fs::read_to_string(big.join("launch.sh")).unwrap(), std::fs::read_to_string(big.join("job.sbatch")).unwrap());
    assert!(sh.contains("--nnodes 8 ") && sh.contains("--nproc-per-node 8 ") && sh.contains("--token-file"), "{sh}");
    assert!(sbatch.contains("#SBATCH --nodes=8\n") && sbatch.contains("#SBATCH --gpus-per-node=8\n"), "{sbatch}");
    assert!(std::fs::read_to_string(big.join("train.toml")).unwrap().contains("device = \"cuda\""));
    for f in ["launch.sh", "job.sbatch"] {
        assert!(Command::new("bash").arg("-n").arg(big.join(f)).status().unwrap().success(), "{f} is not valid bash");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
