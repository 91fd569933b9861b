//! Process-level tests: real `kolo` processes, real sockets and shared memory, the real launcher.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const KOLO: &str = env!("CARGO_BIN_EXE_kolo");

mod hf_job;
mod model_parallel;
mod ps_pause;
mod user_model;

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(KOLO);
    c.args(args).env("RAYON_NUM_THREADS", "1").stdin(Stdio::null());
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "KOLO_JOB_TOKEN",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run kolo")
}

fn text(o: &Output) -> String {
    format!("status {:?}\n--- stdout\n{}\n--- stderr\n{}", o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn launched_bench_checks_every_op_over_tcp_and_shm() {
    for transport in ["tcp", "shm"] {
        for (op, dtype) in [
            ("all_reduce", "f32"),
            ("all_reduce", "bf16"),
            ("all_gather", "i64"),
            ("reduce_scatter", "f64"),
            ("broadcast", "u8"),
            ("all_to_all", "i32"),
        ] {
            let o = run(
                &[
                    "launch",
                    "-n",
                    "3",
                    "--",
                    KOLO,
                    "bench",
                    "collectives",
                    "--op",
                    op,
                    "--dtype",
                    dtype,
                    "--transport",
                    transport,
                    "--min",
                    "4KiB",
                    "--max",
                    "1MiB",
                    "--factor",
                    "16",
                    "--trials",
                    "1",
                    "--trial-secs",
                    "0.005",
                    "--timeout",
                    "60",
                ],
                &[],
            );
            let t = text(&o);
            assert!(o.status.success(), "{op} {dtype} {transport}: {t}");
            assert!(!t.contains("WRONG"), "{t}");
            assert_eq!(t.matches(" ok").count(), 3, "{op} {dtype} {transport}: {t}");
            assert!(t.contains("[rank 0]"), "{t}");
        }
    }
}

/// `--tune` measures the algorithms on 3 launched ranks and writes their crossovers (a table for
/// 3 ranks over shared memory, other tables in the file kept); a job given the file with
/// `--tuning` follows it (every size checked), and a broken file fails before joining, named.
#[test]
fn collectives_are_tuned_on_this_machine_and_followed() {
    let dir = fresh_dir("tune");
    let file = dir.join("tuning.toml");
    let other = "[[all_reduce]]\nworld = 7\nlinks = \"tcp\"\nrows = [[1024, \"tree\"]]\n";
    std::fs::write(&file, other).unwrap();
    let small = ["--min", "4KiB", "--max", "64KiB", "--factor", "4", "--trials", "1", "--trial-secs", "0.005", "--timeout", "60"];
    let f = file.to_str().unwrap();
    let o = run(&[&["launch", "-n", "3", "--", KOLO, "bench", "collectives", "--tune", f][..], &small[..]].concat(), &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("wrote the 3-rank shm table"), "{t}");
    let tuning = kolo_collectives::Tuning::parse(&std::fs::read_to_string(&file).unwrap(), f).unwrap();
    assert!(tuning.pick(3, kolo_collectives::LinkKind::Shm, 4096).is_some(), "{tuning:?}");
    assert_eq!(tuning.pick(7, kolo_collectives::LinkKind::Tcp, 1), Some(kolo_collectives::Algorithm::Tree), "kept");
    let o = run(&[&["launch", "-n", "3", "--", KOLO, "bench", "collectives", "--tuning", f][..], &small[..]].concat(), &[]);
    let t = text(&o);
    assert!(o.status.success() && t.matches(" ok").count() == 3 && !t.contains("WRONG"), "{t}");
    assert!(t.contains("algorithm Auto following the tuning table for this world and links"), "{t}");
    std::fs::write(&file, "[[all_reduce]]\nworld = 3\nlinks = \"shm\"\nrows = [[1024, \"fastest\"]]\n").unwrap();
    let o = run(&["bench", "collectives", "--tuning", f], &[]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains(&format!("{f}: algorithm `fastest`")), "{t}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn killed_rank_fails_the_job_with_a_summary_and_survivors_report_it() {
    for mode in ["kill", "exit"] {
        let t0 = Instant::now();
        let o = run(
            &[
                "launch",
                "-n",
                "3",
                "--grace",
                "20",
                "--",
                KOLO,
                "selftest",
                "--fail-rank",
                "1",
                "--fail-after",
                "3",
                "--fail-mode",
                mode,
                "--iters",
                "100000",
                "--timeout",
                "120",
            ],
            &[],
        );
        let t = text(&o);
        assert!(!o.status.success(), "{t}");
        assert!(t0.elapsed() < Duration::from_secs(30), "took {:?}: {t}", t0.elapsed());
        let how = if mode == "kill" { "killed by signal 9 (SIGKILL)" } else { "exited with status 3" };
        // The root cause is named even when a survivor happens to be reaped before rank 1.
        assert!(t.contains("job failed: rank 1 ") && t.contains(how), "{t}");
        // Both survivors failed on their own, naming the lost rank, before the launcher stepped in,
        // and the summary shows their errors.
        for r in [0, 2] {
            assert!(t.contains(&format!("[rank {r}] error: selftest: rank {r} failed after")), "{t}");
            assert!(t.contains(&format!("rank {r}: all_reduce #")), "{t}");
        }
        assert!(t.contains("lost rank 1"), "{t}");
        assert!(!t.contains("stopped by the launcher"), "{t}");
        // Each survivor shows its flight recorder: the collectives before, the failed one last.
        for r in [0, 2] {
            assert!(t.contains(&format!("[rank {r}] rank {r} flight recorder")), "{t}");
        }
        assert!(t.contains("FAILED: rank 0: all_reduce #4"), "{t}");
    }
}

/// Hang diagnosis: one rank stops calling collectives. Within the deadline every other rank
/// fails naming it (not just the neighbour it waits on), prints its flight recorder, and the
/// launcher names the hung rank as the cause.
#[test]
fn a_hung_rank_is_named_by_every_other_rank_within_the_deadline() {
    let t0 = Instant::now();
    let o = run(
        &[
            "launch",
            "-n",
            "3",
            "--grace",
            "1",
            "--",
            KOLO,
            "selftest",
            "--fail-rank",
            "1",
            "--fail-after",
            "3",
            "--fail-mode",
            "hang",
            "--iters",
            "100000",
            "--timeout",
            "2",
        ],
        &[],
    );
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t0.elapsed() < Duration::from_secs(20), "took {:?}: {t}", t0.elapsed());
    for r in [0, 2] {
        assert!(t.contains(&format!("[rank {r}] error: selftest: rank {r} failed after")), "{t}");
        assert!(t.contains(&format!("rank {r}: all_reduce #4 timed out after 2s; still waiting for rank(s) [1]")), "{t}");
        assert!(t.contains(&format!("[rank {r}] rank {r} flight recorder")), "{t}");
    }
    assert!(t.contains("job failed: rank 1 ") && t.contains("hung?"), "{t}");
}

#[test]
fn launcher_rejects_bad_configurations() {
    let o = run(&["launch", "-n", "2", "--nnodes", "2", "--", "true"], &[]);
    assert!(!o.status.success());
    assert!(text(&o).contains("--master-port"), "{}", text(&o));
    let o = run(&["launch", "-n", "2", "--", "/nonexistent/program"], &[]);
    assert!(!o.status.success());
    assert!(text(&o).contains("cannot start rank 0"), "{}", text(&o));
    let o = run(&["launch", "-n", "2", "--", "false"], &[]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// Starts ranks by hand (as an external launcher would) with per-rank environments.
fn spawn_ranks(envs: Vec<Vec<(String, String)>>, args: &[&str]) -> Vec<Output> {
    let children: Vec<_> = envs
        .into_iter()
        .map(|env| {
            let mut c = Command::new(KOLO);
            c.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            for k in ["RANK", "WORLD_SIZE", "MASTER_PORT", "KOLO_JOB_TOKEN"] {
                c.env_remove(k);
            }
            c.envs(env);
            c.spawn().unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn env(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

#[test]
fn open_mpi_and_slurm_variables_are_understood() {
    let token = "00112233445566778899aabbccddeeff".to_string();
    let port = free_port();
    let outs = spawn_ranks(
        (0..2)
            .map(|r| {
                env(&[
                    ("OMPI_COMM_WORLD_RANK", r.to_string()),
                    ("OMPI_COMM_WORLD_SIZE", "2".into()),
                    ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
                    ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
                    ("MASTER_PORT", port.clone()),
                    ("KOLO_JOB_TOKEN", token.clone()),
                ])
            })
            .collect(),
        &["selftest", "--iters", "5", "--timeout", "30"],
    );
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
    let port = free_port();
    let outs = spawn_ranks(
        (0..2)
            .map(|r| {
                env(&[
                    ("SLURM_PROCID", r.to_string()),
                    ("SLURM_NTASKS", "2".into()),
                    ("SLURM_LOCALID", r.to_string()),
                    ("SLURM_NNODES", "1".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.clone()),
                    ("KOLO_JOB_TOKEN", token.clone()),
                ])
            })
            .collect(),
        &["selftest", "--iters", "5", "--timeout", "30"],
    );
    for o in &outs {
        assert!(o.status.success(), "{}", text(o));
    }
}

#[test]
fn uninvited_and_misconfigured_ranks_are_refused() {
    // Rank 1 holds a different token: it cannot join, and rank 0 learns why at once (issue
    // #19: it used to wait out its deadline and report only "1 of 2 ranks arrived"). Both runs
    // below have a 3 s deadline; each side must fail well before it.
    let port = free_port();
    let t = Instant::now();
    let outs = spawn_ranks(
        vec![
            env(&[("RANK", "0".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", "aa".repeat(16))]),
            env(&[("RANK", "1".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", "bb".repeat(16))]),
        ],
        &["selftest", "--iters", "2", "--timeout", "3"],
    );
    assert!(t.elapsed() < Duration::from_millis(2500), "took {:?}", t.elapsed());
    assert!(!outs[1].status.success());
    assert!(text(&outs[1]).contains("token"), "{}", text(&outs[1]));
    assert!(!outs[0].status.success());
    let t0 = text(&outs[0]);
    assert!(t0.contains("barrier `kolo/join` abandoned: a process at 127.0.0.1:") && t0.contains("different job token"), "{t0}");

    // Ranks that disagree on the world size get a clear error instead of a hang.
    let port = free_port();
    let tok = "cc".repeat(16);
    let t = Instant::now();
    let outs = spawn_ranks(
        vec![
            env(&[("RANK", "0".into()), ("WORLD_SIZE", "2".into()), ("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", tok.clone())]),
            env(&[("RANK", "1".into()), ("WORLD_SIZE", "3".into()), ("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", tok.clone())]),
        ],
        &["selftest", "--iters", "2", "--timeout", "3"],
    );
    assert!(text(&outs[1]).contains("world size 3 but rank 0 says 2"), "{}", text(&outs[1]));
    assert!(
        !outs[0].status.success() && text(&outs[0]).contains("rank 1 was started with world size 3 but rank 0 says 2"),
        "{}",
        text(&outs[0])
    );
    assert!(t.elapsed() < Duration::from_millis(2500), "took {:?}", t.elapsed());

    // Two processes claiming the same rank: every process fails, naming the duplicate (issue
    // #34: only the duplicate failed while the others waited out their deadline).
    let port = free_port();
    let tok = "dd".repeat(16);
    let t = Instant::now();
    let outs = spawn_ranks(
        ["0", "1", "1"]
            .iter()
            .map(|r| {
                env(&[("RANK", r.to_string()), ("WORLD_SIZE", "3".into()), ("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", tok.clone())])
            })
            .collect(),
        &["selftest", "--iters", "2", "--timeout", "3"],
    );
    for (i, o) in outs.iter().enumerate() {
        assert!(!o.status.success() && text(o).contains("rank 1"), "process {i}: {}", text(o));
    }
    assert!(t.elapsed() < Duration::from_millis(2500), "took {:?}: {}", t.elapsed(), text(&outs[0]));

    // Without a token a multi-rank job does not start.
    let o = run(&["selftest"], &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]);
    assert!(text(&o).contains("no job token"), "{}", text(&o));
}

#[test]
fn help_texts_render() {
    for args in [
        &["--help"][..],
        &["launch", "--help"],
        &["bench", "collectives", "--help"],
        &["bench", "loopback", "--help"],
        &["inspect", "--help"],
        &["train", "--help"],
        &["ps", "--help"],
        &["ps", "run", "--help"],
        &["ps", "serve", "--help"],
        &["ps", "eval", "--help"],
        &["bench", "ps", "--help"],
        &["plot", "--help"],
    ] {
        let o = run(args, &[]);
        assert!(o.status.success(), "{}", text(&o));
    }
}

/// Two launched ranks train the GPT on the shipped Tiny Shakespeare over TCP and sample from it;
/// a missing corpus is an error naming the file on every rank (issue #18: it used to fall back
/// to a two-sonnet built-in corpus and overfit); a broken config is a clear error too.
#[test]
fn launched_training_runs_end_to_end_and_missing_data_is_an_error() {
    let dir = std::env::temp_dir().join(format!("kolo-train-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("gpt.toml");
    let job = |path: &str| {
        format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{path}\"\n\
             batch_size = 4\n[train]\nsteps = 6\nlog_every = 2\nsample_chars = 20\n"
        )
    };
    std::fs::write(&cfg, job(&shakespeare())).unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap(), "--transport", "tcp"], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("tinyshakespeare.txt train"), "{t}");
    assert!(t.contains("[rank 0] final eval"), "{t}");
    assert!(t.contains("--- sample (20 chars"), "{t}");
    std::fs::write(&cfg, job("/nonexistent/corpus.txt")).unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    for r in 0..2 {
        assert!(t.contains(&format!("[rank {r}] error: data error: text corpus /nonexistent/corpus.txt")), "{t}");
    }
    // A broken config is a clear error on every rank, and the job fails.
    std::fs::write(&cfg, "[model]\nkind = \"gpt\"\nlayers = 3\n").unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
    assert!(!o.status.success());
    assert!(text(&o).contains("unknown field `layers`"), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A batch too large for this machine is a config error on every rank, estimated before
/// anything that size is allocated (issue #34 item 10: a failed allocation aborted the process
/// with SIGABRT and a backtrace): synthetic MLP batches of 10^12 examples, and a GPT batch whose
/// logits alone would not fit.
#[test]
fn a_batch_too_large_for_memory_is_a_config_error() {
    let dir = fresh_dir("huge-batch");
    let cfg = dir.join("huge.toml");
    for (job, batch) in [
        ("[model]\nkind = \"mlp\"\n[data]\nkind = \"synthetic\"\n".to_string(), "1000000000000"),
        (
            format!(
                "[model]\nkind = \"gpt\"\nseq = 64\nd_model = 32\nn_head = 2\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{}\"\n",
                shakespeare()
            ),
            "100000000000",
        ),
    ] {
        std::fs::write(&cfg, format!("{job}batch_size = {batch}\n[train]\nsteps = 2\n")).unwrap();
        let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
        let t = text(&o);
        assert!(!o.status.success() && !t.contains("memory allocation") && !t.contains("signal"), "{t}");
        for r in 0..2 {
            assert!(
                t.contains(&format!("[rank {r}] error: config error: data.batch_size = {batch}: one micro-batch needs at least")),
                "{t}"
            );
        }
    }
}

/// An empty directory of this test process's, named by `tag`.
fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The shipped corpus, as a string for configs.
fn shakespeare() -> String {
    kolo_testkit::files::shakespeare().display().to_string()
}

/// A fresh directory with a tiny GPT config on the shipped corpus that checkpoints every 2
/// steps into `ck/`: `(dir, config, ck)`.
fn tiny_gpt_job(tag: &str, train: &str, ddp: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kolo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cfg, ck) = (dir.join("gpt.toml"), dir.join("ck"));
    let text = format!(
        "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{}\"\n\
         batch_size = 4\n[train]\n{train}sample_chars = 0\ncheckpoint_every = 2\ncheckpoint_dir = \"{}\"\n[ddp]\n{ddp}",
        shakespeare(),
        ck.display()
    );
    std::fs::write(&cfg, text).unwrap();
    (dir, cfg, ck)
}

/// ZeRO-2 across real processes: sharded checkpoints (one file per rank), `kolo inspect`, and
/// the same checkpoint resumed by a single process at stage 0.
#[test]
fn zero_training_checkpoints_inspects_and_resumes_at_another_world_size() {
    let (dir, cfg, ckdir) = tiny_gpt_job("zero-cli", "steps = 4\nlog_every = 2\n", "bucket_cap = \"16KiB\"\n");
    let c = cfg.to_str().unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", c, "--zero-stage", "2", "--transport", "shm"], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("ZeRO-2 (optimizer state for"), "{t}");
    let ck = ckdir.join("step-00000004");
    let o = run(&["inspect", ck.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("2 files") && t.contains("verified") && t.contains("shard-00001-of-00002.safetensors"), "{t}");
    assert!(t.contains("model.tok_emb") || t.contains("model."), "{t}");
    assert!(t.contains("meta kolo.zero_stage = 2"), "{t}");
    // One process, plain DDP, continues from the newest checkpoint in the directory.
    let o = run(&["train", "--config", c, "--resume", ckdir.to_str().unwrap(), "--steps", "6"], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("resumed from") && t.contains("at step 4") && t.contains("done: 6 steps"), "{t}");
    // A damaged checkpoint is named by inspect and refused by resume.
    let shard = ck.join("shard-00000-of-00002.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let n = bytes.len();
    bytes[n - 3] ^= 0x10;
    std::fs::write(&shard, bytes).unwrap();
    let o = run(&["inspect", ck.to_str().unwrap()], &[]);
    assert!(!o.status.success() && text(&o).contains("DOES NOT LOAD") && text(&o).contains("checksum mismatch"), "{}", text(&o));
    let o = run(&["train", "--config", c, "--resume", ck.to_str().unwrap()], &[]);
    assert!(!o.status.success() && text(&o).contains("corrupt"), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--bind-cores`: each rank runs on its own cores (the kernel's affinity list of the rank is
/// what KOLO_CPUS says, and the two ranks' lists do not overlap); without it nobody is bound.
#[test]
fn launcher_binds_ranks_to_their_own_cores_when_asked() {
    let script = "echo cpus=$KOLO_CPUS allowed=$(grep Cpus_allowed_list /proc/self/status | cut -f2)";
    let o = run(&["launch", "-n", "2", "--bind-cores", "--", "sh", "-c", script], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    let mut lists = Vec::new();
    for r in 0..2 {
        let line = t.lines().find(|l| l.starts_with(&format!("[rank {r}] cpus="))).unwrap_or_else(|| panic!("{t}"));
        let (cpus, allowed) = line.split_once(" allowed=").unwrap();
        let cpus = cpus.rsplit('=').next().unwrap().to_string();
        // The kernel writes ranges ("0-1"); KOLO_CPUS lists each CPU.
        let expand = |s: &str| -> Vec<usize> {
            s.split(',')
                .flat_map(|p| match p.split_once('-') {
                    Some((a, b)) => (a.parse().unwrap()..=b.parse().unwrap()).collect::<Vec<usize>>(),
                    None => vec![p.parse().unwrap()],
                })
                .collect()
        };
        assert_eq!(expand(&cpus), expand(allowed.trim()), "rank {r}: {line}");
        lists.push(expand(&cpus));
    }
    assert!(lists[0].iter().all(|c| !lists[1].contains(c)), "{lists:?}");
    let o = run(&["launch", "-n", "2", "--", "sh", "-c", script], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("[rank 0] cpus= ") && t.contains("[rank 1] cpus= "), "{t}");
}

/// Without RAYON_NUM_THREADS the launcher shares the host's cores between its ranks (and says
/// so); a value the user set reaches every rank unchanged.
#[test]
fn launcher_shares_the_cores_between_ranks_unless_told() {
    let launch = |threads: Option<&str>| {
        let mut c = Command::new(KOLO);
        c.args(["launch", "-n", "2", "--", "sh", "-c", "echo threads=$RAYON_NUM_THREADS"]).stdin(Stdio::null());
        for k in
            ["RAYON_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "KOLO_JOB_TOKEN"]
        {
            c.env_remove(k);
        }
        if let Some(t) = threads {
            c.env("RAYON_NUM_THREADS", t);
        }
        c.output().expect("run kolo launch")
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let o = launch(None);
    let t = text(&o);
    let want = format!("threads={}", (cores / 2).max(1));
    assert!(o.status.success() && t.contains(&format!("[rank 0] {want}")) && t.contains(&format!("[rank 1] {want}")), "{t}");
    assert!(t.contains("RAYON_NUM_THREADS is not set"), "{t}");
    let o = launch(Some("3"));
    let t = text(&o);
    assert!(o.status.success() && t.matches("threads=3").count() == 2 && !t.contains("is not set"), "{t}");
    // A rank started by another launcher (LOCAL_WORLD_SIZE set, RAYON_NUM_THREADS not) takes
    // its share itself; `kolo train` says how many threads it computes with.
    let (dir, cfg, _) = tiny_gpt_job("threads", "steps = 1\n", "");
    let train = |env: &[(&str, &str)]| {
        let mut c = Command::new(KOLO);
        c.args(["train", "--config", cfg.to_str().unwrap()])
            .stdin(Stdio::null())
            .env_remove("RAYON_NUM_THREADS")
            .env_remove("LOCAL_WORLD_SIZE");
        for (k, v) in env {
            c.env(k, v);
        }
        text(&c.output().expect("run kolo train"))
    };
    assert!(train(&[("LOCAL_WORLD_SIZE", "2")]).contains(&format!("{} thread(s)", (cores / 2).max(1))));
    assert!(train(&[]).contains(" thread(s)"));
    assert!(train(&[("LOCAL_WORLD_SIZE", "2"), ("RAYON_NUM_THREADS", "3")]).contains("3 thread(s)"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The CPU kernel tiers (baseline x86-64, AVX2, AVX-512; `KOLO_CPU_CAPABILITY`) train to
/// bitwise the same parameters and optimizer state (the checkpoint manifests' checksums agree),
/// and an unknown tier is refused at start-up.
#[test]
fn cpu_kernel_tiers_train_bitwise_alike() {
    let (dir, cfg, ck) = tiny_gpt_job("tiers", "steps = 2\n", "");
    let c = cfg.to_str().unwrap();
    // The tier that ran is named on the first line; it is the one asked for, never above what
    // this CPU has (what a run without the variable reports).
    const TIERS: [&str; 3] = ["baseline", "avx2", "avx512"];
    let tier_of = |t: &str| -> usize {
        let name = t.split("CPU kernels: ").nth(1).and_then(|r| r.split(',').next()).unwrap_or_else(|| panic!("no tier named: {t}"));
        TIERS.iter().position(|x| *x == name).unwrap_or_else(|| panic!("unknown tier {name}: {t}"))
    };
    let o = run(&["train", "--config", c, "--steps", "1"], &[]);
    let have = tier_of(&text(&o));
    let mut manifests = Vec::new();
    for (want, tier) in TIERS.iter().enumerate() {
        let _ = std::fs::remove_dir_all(&ck);
        let o = run(&["train", "--config", c], &[("KOLO_CPU_CAPABILITY", tier)]);
        let t = text(&o);
        assert!(o.status.success(), "{tier}: {t}");
        assert_eq!(tier_of(&t), want.min(have), "KOLO_CPU_CAPABILITY={tier} on a CPU with {}: {t}", TIERS[have]);
        manifests.push((tier, std::fs::read_to_string(ck.join("step-00000002/manifest.json")).unwrap()));
    }
    for (tier, m) in &manifests[1..] {
        assert_eq!(m, &manifests[0].1, "{tier} differs from the baseline tier");
    }
    let o = run(&["train", "--config", c], &[("KOLO_CPU_CAPABILITY", "sse9")]);
    assert!(!o.status.success() && text(&o).contains("KOLO_CPU_CAPABILITY") && text(&o).contains("avx512"), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A job that crashes in the middle of a save (every rank wrote its shard, nobody committed)
/// leaves no visible checkpoint for that step: resuming picks the previous one.
#[test]
fn a_crash_during_a_save_leaves_the_previous_checkpoint_as_the_latest() {
    let (dir, cfg, ck) = tiny_gpt_job("crash-save", "steps = 6\n", "zero_stage = 2\n");
    let c = cfg.to_str().unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", c, "--crash-during-save", "4"], &[]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("crashing in the middle of saving") && t.contains("SIGABRT"), "{t}");
    assert!(ck.join("step-00000002/manifest.json").is_file(), "{t}");
    assert!(!ck.join("step-00000004").exists(), "the interrupted save is not visible");
    assert!(ck.join(".step-00000004.partial").is_dir(), "its shards stayed in the staging directory");
    let o = run(&["train", "--config", c, "--resume", ck.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("at step 2") && t.contains("done: 6 steps"), "{t}");
    assert!(!ck.join(".step-00000004.partial").exists(), "the next save of step 4 replaced the leftovers");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A training run serves Prometheus metrics while it runs: scraped over HTTP mid-run, the step
/// counter moves and every sample parses.
#[test]
fn training_serves_prometheus_metrics_while_it_runs() {
    use std::io::{BufRead, Read, Write};
    let (dir, cfg, _) = tiny_gpt_job("metrics", "steps = 100000\nlog_every = 5\nmetrics_port = 0\n", "");
    let mut child = Command::new(KOLO)
        .args(["train", "--config", cfg.to_str().unwrap()])
        .env("RAYON_NUM_THREADS", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("the run ended before announcing its metrics").unwrap();
        if let Some(rest) = line.split("metrics on http://").nth(1) {
            break rest.trim_end_matches("/metrics").to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {}); // keep draining stderr
    let scrape = || {
        let mut c = std::net::TcpStream::connect(&addr).unwrap();
        write!(c, "GET /metrics HTTP/1.1\r\nHost: kolo\r\n\r\n").unwrap();
        let mut s = String::new();
        c.read_to_string(&mut s).unwrap();
        s
    };
    let step_of = |body: &str| -> f64 {
        let line = body.lines().find(|l| l.starts_with("kolo_step{")).expect("kolo_step sample");
        line.rsplit_once(' ').unwrap().1.parse().unwrap()
    };
    let t0 = Instant::now();
    let first = step_of(&scrape());
    let mut later = first;
    while later <= first + 2.0 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
        later = step_of(&scrape());
    }
    let body = scrape();
    let _ = child.kill();
    let _ = child.wait();
    assert!(later > first, "the step counter did not move: {first} -> {later}");
    assert!(
        body.starts_with("HTTP/1.1 200 OK")
            && body.contains("# TYPE kolo_comm_bytes counter")
            && body.contains("\nkolo_comm_bytes_total{rank=\"0\"} "),
        "{body}"
    );
    for l in body.split("\r\n\r\n").nth(1).unwrap().lines().filter(|l| !l.starts_with('#')) {
        l.rsplit_once(' ').unwrap().1.parse::<f64>().unwrap_or_else(|_| panic!("bad sample {l}"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `SIGUSR1` makes a running rank print its flight recorder (the last collectives, numbered,
/// with sizes and times) without disturbing the job.
#[test]
fn sigusr1_prints_the_flight_recorder() {
    use std::io::BufRead;
    let port = free_port();
    let token = "ab".repeat(32);
    let mut ranks: Vec<std::process::Child> = (0..2)
        .map(|r| {
            Command::new(KOLO)
                .args(["selftest", "--iters", "100000000", "--count", "1000", "--timeout", "60"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("KOLO_JOB_TOKEN", &token)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let stderr = ranks[1].stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(ranks[1].id() as i32, libc::SIGUSR1);
    }
    let mut dump = Vec::new();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(20) {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(l) => {
                let started = !dump.is_empty() || l.contains("rank 1 flight recorder");
                if started {
                    dump.push(l);
                }
                if dump.len() > 10 {
                    break;
                }
            }
            Err(_) if !dump.is_empty() => break,
            Err(_) => {}
        }
    }
    for r in &mut ranks {
        let _ = r.kill();
        let _ = r.wait();
    }
    let text = dump.join("\n");
    assert!(text.contains("rank 1 flight recorder (2 ranks") && text.contains("last 64 collectives"), "{text}");
    assert!(text.contains("all_reduce") && text.contains("4000 B") && text.contains("ok in"), "{text}");
}

#[test]
fn launcher_forwards_sigterm_and_reports_it() {
    let child = Command::new(KOLO)
        .args(["launch", "-n", "2", "--grace", "2", "--", "sleep", "30"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    // SAFETY: signalling our own child process.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let out = child.wait_with_output().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let t = text(&out);
    assert_eq!(out.status.code(), Some(128 + libc::SIGTERM), "{t}");
    assert!(t.contains("interrupted by signal 15 (SIGTERM)"), "{t}");
    assert!(t.contains("stopped by the launcher"), "{t}");
}

/// `kolo ps run`: coordinator, server processes and worker processes on localhost. Each
/// worker writes its own trace; `kolo ps run` merges them when the workers are done.
#[test]
fn ps_run_trains_mnist_through_server_processes() {
    let dir = std::env::temp_dir().join(format!("kolo-ps-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("ps.toml");
    let data = kolo_testkit::files::mnist_dir();
    std::fs::write(&cfg, format!("[model]\nkind = \"mlp\"\nhidden = [64]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[optim]\nkind = \"adagrad\"\nlr = 0.02\n[train]\nsteps = 150\nlog_every = 50\nstrategy = \"ps\"\ntimeline_dir = \"{}\"\n[ps]\nconsistency = \"bounded\"\nstaleness = 2\nchunk = 10000\nreplication = 1\n", data.display(), dir.join("tl").display())).unwrap();
    let o = run(&["ps", "run", "-n", "2", "--servers", "2", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("server 1 joined"), "{t}");
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("tl").join("trace.json")).unwrap()).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    for w in 0..2 {
        assert_eq!(ev.iter().filter(|e| e["pid"] == w && e["name"] == "push").count(), 150, "worker {w}");
    }
    let acc: f64 = t
        .split("accuracy ")
        .nth(1)
        .and_then(|s| s.split('%').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {t}"));
    assert!(acc > 85.0, "{t}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `kolo ps serve` process killed with SIGKILL in the middle of a BSP run: its ranges fail
/// over to their replicas, the workers route by the new membership and finish, and no
/// acknowledged update is lost: the model is bit-identical to an uninterrupted run's (the same
/// final evaluation to the last digit). The coordinator declares the server dead after 6 s,
/// longer than a client's wait for a new membership (5 s), so workers must not redial the dead
/// address meanwhile (#19: they did, for the whole deadline, and every run failed).
#[test]
fn ps_job_survives_a_killed_server_process() {
    let dir = fresh_dir("ps-kill");
    let cfg = dir.join("ps.toml");
    let data = kolo_testkit::files::mnist_dir();
    std::fs::write(&cfg, format!("[model]\nkind = \"mlp\"\nhidden = [64]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 1500\nlog_every = 100\nstrategy = \"ps\"\n[ps]\nconsistency = \"bsp\"\nchunk = 5000\nreplication = 1\nservers = 3\ntimeout_secs = 30\n", data.display())).unwrap();
    let uninterrupted = ps_cluster_run(&cfg, None);
    let t0 = Instant::now();
    let killed = ps_cluster_run(&cfg, Some(200));
    let took = t0.elapsed();
    let final_line =
        |w0: &str| w0.lines().find(|l| l.contains("final eval")).unwrap_or_else(|| panic!("no final eval in {w0}")).to_string();
    assert!(killed.contains("missed its heartbeats"), "the coordinator never noticed the killed server:\n{killed}");
    assert_eq!(final_line(&killed), final_line(&uninterrupted), "BSP after a server was killed vs uninterrupted");
    // The kill hit the running job: some requests were retried at the new membership.
    let retried: u64 = killed
        .split(" retried requests")
        .next()
        .and_then(|s| s.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{killed}"));
    assert!(retried > 0, "the server died after training ended? {killed}");
    eprintln!("killed-server run: {took:?}, {retried} retried requests");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A coordinator (servers dead after 6 s of silence), 3 `kolo ps serve` processes and 2
/// workers training `cfg`; with `kill_at`, server 1 is SIGKILLed once worker 0 logs that step.
/// Returns worker 0's stderr followed by the coordinator's; panics if a worker failed.
fn ps_cluster_run(cfg: &std::path::Path, kill_at: Option<u64>) -> String {
    let token = "00112233445566778899aabbccddeeff";
    let port = free_port();
    let coord_addr = format!("127.0.0.1:{port}");
    let spawn = |args: &[&str], env: &[(&str, &str)]| {
        let mut c = Command::new(KOLO);
        c.args(args)
            .env("RAYON_NUM_THREADS", "1")
            .env("KOLO_JOB_TOKEN", token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            c.env(k, v);
        }
        c.spawn().unwrap()
    };
    let coord = spawn(&["ps", "coordinator", "--listen", &coord_addr, "--dead-after", "6"], &[]);
    let mut servers: Vec<_> = (0..3).map(|_| spawn(&["ps", "serve", "--coordinator", &coord_addr, "--heartbeat-ms", "100"], &[])).collect();
    let mut workers: Vec<_> = (0..2)
        .map(|r| {
            spawn(
                &["train", "--config", cfg.to_str().unwrap()],
                &[("RANK", &r.to_string()), ("WORLD_SIZE", "2"), ("KOLO_PS_COORDINATOR", &coord_addr)],
            )
        })
        .collect();
    let err = workers[0].stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        let mut all = String::new();
        for line in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(line.clone());
            all += &line;
            all.push('\n');
        }
        all
    });
    let mut victim = None;
    if let Some(step) = kill_at {
        let deadline = Instant::now() + Duration::from_secs(60);
        let want = format!("step {step}/");
        while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            if line.contains(&want) {
                break;
            }
        }
        let v = servers.remove(1);
        // SIGKILL: no goodbye, sockets closed by the kernel.
        unsafe { libc_kill(v.id() as i32, 9) };
        victim = Some(v);
    }
    let outs: Vec<Output> = workers.into_iter().map(|w| w.wait_with_output().unwrap()).collect();
    let w0 = reader.join().unwrap();
    run(&["ps", "shutdown", "--coordinator", &coord_addr], &[("KOLO_JOB_TOKEN", token)]);
    let c = coord.wait_with_output().unwrap();
    let mut st = String::new();
    for (i, s) in servers.into_iter().chain(victim).enumerate() {
        if let Ok(o) = s.wait_with_output() {
            st += &format!("--- server process {i}\n{}\n", text(&o));
        }
    }
    let ct = text(&c);
    for o in &outs {
        assert!(o.status.success(), "{}\n--- worker 0\n{w0}\n--- coordinator\n{ct}\n{st}", text(o));
    }
    format!("{w0}\n--- coordinator\n{ct}")
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// 3D parallelism across real processes: 4 ranks as 2 pipeline stages of 2 tensor-parallel
/// ranks (shared memory links, fused send/recv between stages); then PipeDream-2BW on 2 stages.
#[test]
fn launched_gpt_trains_with_tensor_and_pipeline_parallelism() {
    let dir = std::env::temp_dir().join(format!("kolo-mesh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("gpt.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"text\"\npath = \"{}\"\n\
         batch_size = 8\n[optim]\nclip_grad_norm = 1.0\n[train]\nsteps = 4\nlog_every = 2\nsample_chars = 10\n[mesh]\ntp = 2\npp = 2\n[pipeline]\nmicro_batches = 4\nschedule = \"1f1b\"\n",
            shakespeare()
        ),
    )
    .unwrap();
    let o = run(&["launch", "-n", "4", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("2 stages") && t.contains("2 tensor-parallel ranks"), "{t}");
    assert!(t.contains("pipeline bubble") && t.contains("[rank 0] final eval"), "{t}");
    // PipeDream-2BW between processes: the p2p stream never stops while the stages agree on
    // the gradient norm at each update (on a group of their own).
    let two_bw = std::fs::read_to_string(&cfg).unwrap().replace("tp = 2\n", "").replace("\"1f1b\"", "\"2bw\"");
    std::fs::write(&cfg, two_bw).unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("TwoBw") && t.contains("no flush") && t.contains("step 4/4"), "{t}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Elastic training: rank 2 of 4 SIGKILLs itself at step 35 under `--min-nodes 3`; the launcher
/// restarts the job on the 3 survivors, which resume from the step-30 checkpoint (resharded to
/// 3 ranks) and finish; the final model is within a stated margin of an uninterrupted run. With
/// elasticity off the same death stops the job within seconds, naming rank 2.
#[test]
fn elastic_job_goes_on_with_the_survivors_after_a_rank_is_killed() {
    let dir = std::env::temp_dir().join(format!("kolo-elastic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = kolo_testkit::files::mnist_dir();
    let cfg = |name: &str| {
        let p = dir.join(format!("{name}.toml"));
        std::fs::write(
            &p,
            format!(
                "[model]\nkind = \"mlp\"\nhidden = [64]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 32\n[optim]\nkind = \"adamw\"\nlr = 0.002\n[train]\nsteps = 80\nlog_every = 20\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 10\n",
                data.display(),
                dir.join(name).display()
            ),
        )
        .unwrap();
        p
    };
    let accuracy = |t: &str| -> f64 {
        let i = t.rfind("accuracy ").unwrap_or_else(|| panic!("no accuracy in {t}"));
        t[i + 9..].split('%').next().unwrap().parse().unwrap()
    };
    let (elastic, plain, whole) = (cfg("elastic"), cfg("plain"), cfg("whole"));
    let o = run(
        &[
            "launch",
            "-n",
            "4",
            "--min-nodes",
            "3",
            "--restart-backoff",
            "0.2",
            "--",
            KOLO,
            "train",
            "--config",
            elastic.to_str().unwrap(),
            "--kill-at",
            "2:35",
        ],
        &[],
    );
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("rank(s) [2] lost; restarting on 3 ranks (round 1)"), "{t}");
    assert!(
        t.contains("resumed from") && t.contains("step-00000030 at step 30"),
        "at most the 5 steps since the last checkpoint are lost: {t}"
    );
    assert!(t.contains("on 3 rank(s)") && t.contains("done: 80 steps"), "{t}");
    let uninterrupted = run(&["launch", "-n", "4", "--", KOLO, "train", "--config", whole.to_str().unwrap()], &[]);
    let u = text(&uninterrupted);
    assert!(uninterrupted.status.success(), "{u}");
    let (a, b) = (accuracy(&t), accuracy(&u));
    assert!((a - b).abs() < 3.0, "accuracy after losing a rank {a}% vs uninterrupted {b}% (margin 3 points)");
    // Not elastic: the job stops and names the dead rank.
    let start = std::time::Instant::now();
    let o = run(&["launch", "-n", "4", "--", KOLO, "train", "--config", plain.to_str().unwrap(), "--kill-at", "2:35"], &[]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("job failed: rank 2") && t.contains("SIGKILL"), "{t}");
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "stopped after {:?}", start.elapsed());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kolo fed run`: the server in this process and 4 client processes (non-IID shards, secure
/// aggregation with a fresh set of signed client identities) finish their rounds; with
/// identities from `kolo fed keygen` in `[fed] identities` too, and a client holding another
/// client's key file is refused at join. `kolo plan` prints fitting plans and costs a given one.
#[test]
fn fed_run_and_plan_work_from_the_command_line() {
    let dir = std::env::temp_dir().join(format!("kolo-fed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = kolo_testkit::files::mnist_dir();
    let cfg = dir.join("fed.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 20\n[optim]\nkind = \"sgd\"\nlr = 0.05\n[train]\neval_batches = 10\n[fed]\nrounds = 3\nclients = 4\nclients_per_round = 3\nexamples_per_client = 300\nsecure = true\n",
            data.display()
        ),
    )
    .unwrap();
    let o = run(&["fed", "run", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("secure aggregation") && t.contains("round 3: 3 client(s)") && t.contains("done: 3 rounds"), "{t}");
    assert!(t.contains("keys signed by a roster of 4 client identities"), "{t}");
    assert_eq!(t.matches("trained in").count(), 4, "every client reports: {t}");
    let ids = dir.join("ids");
    let o = run(&["fed", "keygen", "--clients", "4", "--out", ids.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(ids.join("client-2.key")).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "a client's key is its own");
    let text_cfg = std::fs::read_to_string(&cfg).unwrap() + &format!("identities = \"{}\"\n", ids.display());
    std::fs::write(&cfg, &text_cfg).unwrap();
    let o = run(&["fed", "run", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("done: 3 rounds") && t.contains("roster of 4"), "{t}");
    // Client 1 holding client 0's key file cannot join as client 1.
    std::fs::copy(ids.join("client-0.key"), ids.join("client-1.key")).unwrap();
    let o = run(&["fed", "run", "--config", cfg.to_str().unwrap()], &[]);
    let t = text(&o);
    assert!(!o.status.success() && t.contains("client 1's key is not signed by client 1's identity"), "{t}");
    std::fs::remove_dir_all(&dir).unwrap();
    let o = run(&["plan", "--params", "1.3B", "--devices", "64", "--device-memory", "80GiB", "--top", "3"], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("plans fit") && t.contains("  1  dp"), "{t}");
    let eval = ["plan", "--params", "1.3B", "--devices", "8", "--evaluate", "dp=2,tp=2,pp=2,micro=4"];
    let o = run(&eval, &[]);
    let preset = text(&o);
    assert!(o.status.success() && preset.contains("dp    2 tp  2 pp  2") && preset.contains("MFU"), "{preset}");
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--evaluate", "dp=3,tp=2,pp=2"], &[]);
    assert!(!o.status.success() && text(&o).contains("not a plan"), "{}", text(&o));
    let o = run(&["plan", "--devices", "12"], &[]);
    assert!(!o.status.success() && text(&o).contains("not whole nodes of 8"), "{}", text(&o));
    // A preset written out as a cluster file plans the same; a broken file is named.
    let o = run(&["plan", "--devices", "8", "--show-cluster"], &[]);
    assert!(o.status.success());
    let file = std::env::temp_dir().join(format!("kolo-cluster-{}.toml", std::process::id()));
    std::fs::write(&file, &o.stdout).unwrap();
    let o = run(&[&eval[..], &["--cluster", file.to_str().unwrap()]].concat(), &[]);
    assert_eq!(text(&o), preset);
    let broken = String::from_utf8(std::fs::read(&file).unwrap()).unwrap().replace("[256, ", "[600, ");
    std::fs::write(&file, broken).unwrap();
    let o = run(&[&eval[..], &["--cluster", file.to_str().unwrap()]].concat(), &[]);
    assert!(!o.status.success() && text(&o).contains("n ascending"), "{}", text(&o));
    std::fs::remove_file(&file).unwrap();
    // The search's choices can be pinned: recomputation, ZeRO stages, micro-batches.
    let pinned =
        ["plan", "--params", "1.3B", "--devices", "64", "--top", "50", "--recompute", "selective", "--zero", "0,1", "--micro", "2"];
    let o = run(&pinned, &[]);
    let t = text(&o);
    let rows: Vec<&str> = t.lines().filter(|l| l.contains("  dp ")).collect();
    assert!(o.status.success() && !rows.is_empty(), "{t}");
    assert!(rows.iter().all(|r| r.contains(" sel ") && (r.contains("ZeRO-0") || r.contains("ZeRO-1")) && r.contains("micro   2 x")), "{t}");
    // On an H200 cluster, where attention is fused, there is no selective recomputation to pin.
    let o = run(&[&pinned[..], &["--cluster", "dgx-h200"]].concat(), &[]);
    assert!(!o.status.success() && text(&o).contains("--recompute selective: this cluster's attention is fused"), "{}", text(&o));
    let o = run(&[&pinned[..], &["--cluster", "dgx-h200", "--fused-attention", "false"]].concat(), &[]);
    assert!(o.status.success() && text(&o).contains(" sel "), "{}", text(&o));
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--recompute", "some"], &[]);
    assert!(!o.status.success() && text(&o).contains("--recompute: recomputation `some`: none, selective or full"), "{}", text(&o));
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--evaluate", "dp=8,micro=4,recompute=selective"], &[]);
    assert!(o.status.success() && text(&o).contains(" sel "), "{}", text(&o));
    // Schedules and sequence parallelism: pinned, evaluated; the batch given in tokens.
    let o = run(&["plan", "--params", "1.3B", "--devices", "64", "--top", "20", "--schedule", "2bw", "--seq-parallel", "true"], &[]);
    let t = text(&o);
    let rows: Vec<&str> = t.lines().filter(|l| l.contains("  dp ")).collect();
    // (A pin applies where it means something: sequence parallelism with tp, a schedule with pp.)
    assert!(o.status.success() && rows.iter().any(|r| r.contains(" 2bw")) && rows.iter().any(|r| r.contains(" sp")), "{t}");
    assert!(rows.iter().all(|r| (r.contains("tp  1") || r.contains(" sp")) && (r.contains("pp  1") || r.contains(" 2bw"))), "{t}");
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--evaluate", "tp=2,pp=4,micro=1,schedule=interleaved:2,sp"], &[]);
    assert!(o.status.success() && text(&o).contains(" interleaved:2 sp"), "{}", text(&o));
    // A pick above the best MFU published for the device says so, and where that figure is from.
    let o = run(&["plan", "--params", "175B", "--devices", "1024", "--global-batch", "1536", "--top", "1"], &[]);
    let t = text(&o);
    let mfu: f64 = t.split("MFU").nth(1).and_then(|r| r.split('%').next()).and_then(|v| v.trim().parse().ok()).unwrap_or(0.0);
    assert_eq!(mfu > 56.3, t.contains("is above the best published on this device, 56.3 % (Korthikanti et al. 2022"), "{t}");
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--global-batch-tokens", "1048576", "--top", "1"], &[]);
    assert!(o.status.success() && text(&o).contains("; 512 sequences per step"), "{}", text(&o));
    // Nodes instead of devices; FP8 where the device has it, named where it does not.
    let o = run(&["plan", "--params", "7B", "--nodes", "2", "--cluster", "dgx-h100", "--precision", "fp8", "--top", "1"], &[]);
    assert!(o.status.success() && text(&o).contains("2 nodes x 8 H100"), "{}", text(&o));
    let o = run(&["plan", "--params", "7B", "--nodes", "2", "--precision", "fp8"], &[]);
    assert!(!o.status.success() && text(&o).contains("--precision fp8: the A100-SXM4-80GB has no FP8 rate"), "{}", text(&o));
    let o = run(&["plan", "--params", "1.3B", "--devices", "8", "--global-batch-tokens", "1000000"], &[]);
    assert!(!o.status.success() && text(&o).contains("are not whole sequences of 2048"), "{}", text(&o));
}

/// IMPALA with actor processes: 2 `kolo impala` actor processes talk to the learner over
/// authenticated TCP, never wait for it, and CartPole-v0 is solved.
#[test]
fn impala_actor_processes_solve_cartpole_over_tcp() {
    let o = run(&["impala", "--actors", "2", "--processes", "--max-steps", "2000000"], &[]);
    let t = text(&o);
    assert!(o.status.success() && t.contains("solved at"), "{t}");
    assert!(t.matches("environment steps").count() >= 2, "both actor processes report: {t}");
}

/// Scheduled communication between real processes (TCP and shared memory, the scheduler on a
/// group of its own beside the training thread's collectives) ends where plain DDP ends; and
/// on a build without GPU support, `--device cuda` and `--backend nccl` say what to rebuild
/// with instead of failing later.
#[test]
fn scheduled_ddp_between_processes_and_gpu_flags_without_gpu_support() {
    let dir = fresh_dir("sched");
    let base = "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 2\n[data]\nkind = \"synthetic\"\nbatch_size = 4\n[optim]\nkind = \"adamw\"\nlr = 0.01\n[train]\nsteps = 6\nlog_every = 1\nsample_chars = 0\n";
    let mut last = Vec::new();
    for (name, ddp) in [("plain", ""), ("sched", "[ddp]\nschedule = { chunk = \"4KiB\", credit = \"8KiB\" }\n")] {
        let cfg = dir.join(format!("{name}.toml"));
        std::fs::write(&cfg, format!("{base}{ddp}")).unwrap();
        let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
        let t = text(&o);
        assert!(o.status.success(), "{name}: {t}");
        // The final evaluation runs on the same parameters on every rank.
        let eval: Vec<String> = t.lines().filter(|l| l.contains("final eval")).map(str::to_string).collect();
        assert_eq!(eval.len(), 1, "{name}: {t}");
        last.push(eval[0].split("final eval").nth(1).unwrap().to_string());
        if name == "sched" {
            assert!(t.contains("scheduled DDP") && t.contains("hidden behind compute"), "{t}");
        }
    }
    assert_eq!(last[0], last[1], "scheduled and plain DDP evaluate the same model");
    let cfg = dir.join("plain.toml");
    if !cfg!(feature = "cuda") {
        let o = run(&["train", "--config", cfg.to_str().unwrap(), "--device", "cuda"], &[]);
        assert!(!o.status.success() && text(&o).contains("--features cuda"), "{}", text(&o));
    }
    if !cfg!(feature = "nccl") {
        let o = run(&["train", "--config", cfg.to_str().unwrap(), "--backend", "nccl"], &[]);
        assert!(!o.status.success() && text(&o).contains("--features nccl"), "{}", text(&o));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The model's tensors (`model.*`) of a checkpoint directory, by name.
fn model_tensors(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let ck = kolo_checkpoint::sharded::load_any(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    ck.tensors.into_iter().filter(|e| e.name.starts_with("model.")).map(|e| (e.name, e.data)).collect()
}

/// DDP and ZeRO between real processes equal one process with the same global batch (issue
/// #18: the N-ranks tests ran threads over the in-process communicator): `kolo launch -n 2` and
/// `-n 4`, over TCP and over shared memory, each train the MLP on the shipped MNIST subset with
/// plain SGD and no clipping (so a wrong gradient scale shows), and the parameters in their
/// last checkpoint are compared with a single process's. Not bitwise: the all-reduce adds N
/// partial means where one process sums the whole batch at once (f32 reassociation); after 6
/// steps the largest difference is ~1e-7, the tolerance 2e-6, and the parameters moved by
/// orders of magnitude more than that (checked, so the comparison cannot pass on an idle run).
#[test]
fn launched_ddp_and_zero_match_one_process_numerically() {
    let dir = fresh_dir("ddp-eq");
    let steps = 6;
    let global = 24;
    let job = |tag: &str, n: usize, zero: u8, lr: f32| -> std::path::PathBuf {
        let (cfg, ck) = (dir.join(format!("{tag}.toml")), dir.join(tag));
        std::fs::write(
            &cfg,
            format!(
                "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = {}\n[optim]\nkind = \"sgd\"\nlr = {lr}\n\
                 [train]\nsteps = {steps}\nlog_every = {steps}\ncheckpoint_every = {steps}\ncheckpoint_dir = \"{}\"\n[ddp]\nzero_stage = {zero}\nbucket_cap = \"16KiB\"\nfirst_bucket_cap = \"4KiB\"\n",
                kolo_testkit::files::mnist_dir().display(),
                global / n,
                ck.display()
            ),
        )
        .unwrap();
        cfg
    };
    let last = |tag: &str| dir.join(tag).join(format!("step-{steps:08}"));
    let one_process = |tag: &str, lr: f32| {
        let o = run(&["train", "--config", job(tag, 1, 0, lr).to_str().unwrap()], &[]);
        assert!(o.status.success(), "{}", text(&o));
        model_tensors(&last(tag))
    };
    let one = one_process("one", 0.2);
    // With lr 1e-30 (0 is refused) the checkpoint holds the initial parameters: the trained ones moved far more
    // than the tolerance, so a run that did not train cannot pass.
    let init = one_process("init", 1e-30);
    let moved = one.iter().map(|(k, a)| a.iter().zip(&init[k]).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)).fold(0f32, f32::max);
    assert!(moved > 1e-2, "one process moved its parameters by only {moved}");
    for (n, transport, zero) in [(2, "tcp", 0), (2, "shm", 0), (4, "tcp", 0), (4, "shm", 0), (2, "shm", 2), (4, "tcp", 1)] {
        let tag = format!("n{n}-{transport}-z{zero}");
        let cfg = job(&tag, n, zero, 0.2);
        let n_s = n.to_string();
        let o = run(&["launch", "-n", &n_s, "--", KOLO, "train", "--config", cfg.to_str().unwrap(), "--transport", transport], &[]);
        assert!(o.status.success(), "{tag}: {}", text(&o));
        let got = model_tensors(&last(&tag));
        assert_eq!(got.keys().collect::<Vec<_>>(), one.keys().collect::<Vec<_>>(), "{tag}: tensor names");
        let mut worst = (0f32, String::new());
        for (name, a) in &got {
            let b = &one[name];
            assert_eq!(a.len(), b.len(), "{tag}: {name}");
            let d = a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            if d > worst.0 {
                worst = (d, name.clone());
            }
        }
        eprintln!("{tag}: largest parameter difference from one process {:e} ({})", worst.0, worst.1);
        assert!(worst.0 < 2e-6, "{tag}: {} differs from one process by {}", worst.1, worst.0);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `[ddp] deterministic = true` (issue #18): DDP, ZeRO-1 and ZeRO-2 at world sizes 1, 2, 3 and
/// 4 with the same global batch (24 examples, pieces of 2) write bitwise the same checkpoint —
/// parameters and optimizer state — over TCP and shared memory, with AdamW and clipping, and a
/// single process with 2 threads too. The default mode differs between 1 and 3 ranks (f32
/// reassociation), so the bitwise comparison has something to catch.
#[test]
fn deterministic_mode_is_bitwise_equal_at_every_world_size() {
    let dir = fresh_dir("determ");
    let steps = 4;
    let global = 24;
    let all_tensors = |tag: &str| -> std::collections::BTreeMap<String, Vec<u32>> {
        let ck =
            kolo_checkpoint::sharded::load_any(&dir.join(tag).join(format!("step-{steps:08}"))).unwrap_or_else(|e| panic!("{tag}: {e}"));
        ck.tensors.into_iter().map(|e| (e.name, e.data.iter().map(|v| v.to_bits()).collect())).collect()
    };
    let train = |tag: &str, n: usize, zero: u8, transport: &str, deterministic: bool, threads: &str| {
        let (cfg, ck) = (dir.join(format!("{tag}.toml")), dir.join(tag));
        std::fs::write(
            &cfg,
            format!(
                "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = {}\n[optim]\nkind = \"adamw\"\nlr = 0.01\nclip_grad_norm = 0.5\n\
                 [train]\nsteps = {steps}\nlog_every = {steps}\ncheckpoint_every = {steps}\ncheckpoint_dir = \"{}\"\n[ddp]\nzero_stage = {zero}\ndeterministic = {deterministic}\ndeterministic_chunk = 2\n",
                kolo_testkit::files::mnist_dir().display(),
                global / n,
                ck.display()
            ),
        )
        .unwrap();
        let c = cfg.to_str().unwrap();
        let n_s = n.to_string();
        let o = if n == 1 {
            run(&["train", "--config", c, "--transport", transport], &[("RAYON_NUM_THREADS", threads)])
        } else {
            run(&["launch", "-n", &n_s, "--", KOLO, "train", "--config", c, "--transport", transport], &[("RAYON_NUM_THREADS", threads)])
        };
        assert!(o.status.success(), "{tag}: {}", text(&o));
        all_tensors(tag)
    };
    let one = train("one", 1, 0, "tcp", true, "1");
    assert!(one.keys().any(|k| k.starts_with("model.")) && one.len() > 4, "{:?}", one.keys());
    for (n, zero, transport, threads) in [
        (1, 0, "tcp", "2"),
        (2, 0, "shm", "1"),
        (3, 0, "tcp", "1"),
        (4, 0, "shm", "1"),
        (2, 1, "tcp", "1"),
        (3, 1, "shm", "1"),
        (2, 2, "shm", "1"),
        (4, 2, "tcp", "1"),
    ] {
        let tag = format!("n{n}-z{zero}-{transport}-t{threads}");
        let got = train(&tag, n, zero, transport, true, threads);
        assert_eq!(got.keys().collect::<Vec<_>>(), one.keys().collect::<Vec<_>>(), "{tag}: tensor names");
        for (name, bits) in &got {
            let differ = bits.iter().zip(&one[name]).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{tag}: {differ} of {} values of {name} differ from one process", bits.len());
        }
    }
    // The default mode is not bitwise across world sizes: the check above can fail.
    let (a, b) = (train("plain-1", 1, 0, "tcp", false, "1"), train("plain-3", 3, 0, "tcp", false, "1"));
    assert!(a.iter().any(|(k, v)| *v != b[k]), "the default mode came out bitwise equal at 1 and 3 ranks");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Launched ranks given different configs (here n_head) stop at start-up, each naming the
/// differing field, and the job fails (issue #19: they used to train to the end with rc 0).
#[test]
fn launched_ranks_with_different_configs_stop_naming_the_field() {
    let dir = fresh_dir("agree");
    for (r, heads) in [(0, 2), (1, 4)] {
        let cfg = format!(
            "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = {heads}\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{}\"\nbatch_size = 4\n[train]\nsteps = 4\nsample_chars = 0\n",
            shakespeare()
        );
        std::fs::write(dir.join(format!("cfg-{r}.toml")), cfg).unwrap();
    }
    let script = format!("exec {KOLO} train --config {}/cfg-$RANK.toml", dir.display());
    let o = run(&["launch", "-n", "2", "--", "sh", "-c", &script], &[]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("rank 1 differs from rank 0 first at `model.n_head` (rank 0 has model.n_head = 2)"), "{t}");
    assert!(t.contains("this rank (1) has model.n_head = 4, rank 0 has model.n_head = 2"), "{t}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `dir/mlp.toml`: a 784-32-10 MLP on the shipped MNIST subset, 8 examples per rank, `steps`
/// steps logged only at the end, `extra` appended.
fn small_mlp(dir: &std::path::Path, steps: u64, extra: &str) -> std::path::PathBuf {
    let cfg = dir.join("mlp.toml");
    let text = format!(
        "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 8\n[train]\nsteps = {steps}\nlog_every = {steps}\nprogress = false\n{extra}",
        kolo_testkit::files::mnist_dir().display()
    );
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// Three ranks of `kolo train --config cfg` started directly (no launcher), stderr piped.
fn three_ranks(cfg: &std::path::Path) -> Vec<std::process::Child> {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    (0..3)
        .map(|r| {
            Command::new(KOLO)
                .args(["train", "--config", cfg.to_str().unwrap()])
                .envs([("RANK", r.to_string().as_str()), ("WORLD_SIZE", "3"), ("MASTER_PORT", &port), ("KOLO_JOB_TOKEN", &"5e".repeat(16))])
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect()
}

/// A stopped rank (SIGSTOP: no FIN, no RST, as a cut network or a dead host) is named by
/// every survivor long before the collective deadline: its heartbeats through the store stop
/// (issue #19). Deadline 120 s, liveness 2 s. A rank that is only slow keeps beating and is left
/// to the deadline (the test below).
#[test]
fn a_stopped_rank_is_named_from_its_missing_heartbeats_before_the_deadline() {
    let dir = fresh_dir("stopped");
    let cfg = small_mlp(&dir, 1_000_000, "[ddp]\ntimeout_secs = 120\nliveness_secs = 2\n");
    let mut ranks = three_ranks(&cfg);
    // Training is under way well before this (the ranks join in about a second).
    std::thread::sleep(Duration::from_secs(4));
    let stopped = ranks.remove(2);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(stopped.id() as libc::pid_t, libc::SIGSTOP) }, 0);
    let t = Instant::now();
    let errors: Vec<String> = ranks
        .into_iter()
        .map(|c| {
            let o = c.wait_with_output().unwrap();
            assert!(!o.status.success());
            String::from_utf8_lossy(&o.stderr).into_owned()
        })
        .collect();
    let took = t.elapsed();
    let mut stopped = stopped;
    let _ = stopped.kill();
    let _ = stopped.wait();
    // The first survivor to see the silence names it; the other one does too, unless rank 0
    // (the store's host) failed first and took the store with it: then it says so.
    let mut from_heartbeats = 0;
    for (r, e) in errors.iter().enumerate() {
        let line = e.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("rank {r}: {e}"));
        assert!(line.contains(&format!("rank {r}: all_reduce #")) && line.contains("lost rank 2: "), "{line}");
        if line.contains("lost rank 2: it sent no heartbeat for 2s") {
            from_heartbeats += 1;
        } else {
            assert!(r == 1 && line.contains("the job's store closed its connection"), "{line}");
        }
    }
    assert!(from_heartbeats >= 1);
    // Liveness 2 s plus a beat or two of sampling; the deadline is 120 s.
    assert!(took < Duration::from_secs(20), "{took:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

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
    for (tag, extra) in [("tp", vec!["--evaluate", "tp=2,micro=4"]), ("cp", vec!["--evaluate", "cp=2,micro=4"]), ("searched", vec![])] {
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
        let o = Command::new("bash").arg(out.join("launch.sh")).env("KOLO", KOLO).output().unwrap();
        let t = text(&o);
        assert!(o.status.success() && t.contains("step 2/2"), "{tag}: {t}");
    }
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
    // A plan the job cannot run is named: micro-batches accumulated outside a pipeline.
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
    // Not a plan Kolo runs (activation checkpointing with tensor parallelism): refused by name.
    let o = refused("2", "dp=1,tp=2,pp=1,micro=8,ckpt");
    let t = text(&o);
    assert!(!o.status.success() && t.contains("this plan is not one Kolo's GPT runs") && t.contains("activation checkpointing"), "{t}");
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

/// A SIGSTOPped or SIGKILLed rank 0, whose process also hosts the job's store, is named by
/// every survivor within the liveness window (issue #34 item 6): stopped, the store's silence
/// was blamed on whichever peer a collective waited on (the launcher named rank 1 in one run and
/// rank 2 in another); killed, a rank whose neighbour left because of it named the neighbour,
/// since the reason the neighbour left went with rank 0's store.
#[test]
fn a_stopped_or_killed_rank_0_is_named_by_every_survivor() {
    for (signal, tag) in [(libc::SIGSTOP, "stopped0"), (libc::SIGKILL, "killed0")] {
        let dir = fresh_dir(tag);
        let cfg = small_mlp(&dir, 1_000_000, "[ddp]\ntimeout_secs = 120\nliveness_secs = 2\n");
        let mut ranks = three_ranks(&cfg);
        std::thread::sleep(Duration::from_secs(4));
        let mut victim = ranks.remove(0);
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(victim.id() as libc::pid_t, signal) }, 0);
        let t = Instant::now();
        let errors: Vec<String> =
            ranks.into_iter().map(|c| String::from_utf8_lossy(&c.wait_with_output().unwrap().stderr).into_owned()).collect();
        let took = t.elapsed();
        let _ = victim.kill();
        let _ = victim.wait();
        for (i, e) in errors.iter().enumerate() {
            let r = i + 1;
            let line = e.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{tag}: rank {r}: {e}"));
            // Its own peer, or (killed) a neighbour that left because of it, whose reason went
            // with the store.
            let named = line.contains("lost rank 0: ") || (signal == libc::SIGKILL && line.contains("rank 0 most likely failed first"));
            assert!(line.contains(&format!("rank {r}: ")) && named, "{tag}: rank {r}: {line}");
        }
        assert!(took < Duration::from_secs(20), "{tag}: {took:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A hung rank (here one that sleeps a minute in a step) is named, with the operation and its
/// sequence number, by every survivor's error and by the launcher (issue #19: they said
/// `all_reduce #0 ... still waiting for rank(s) []` and the launcher blamed rank 3). Ranks one
/// collective behind, stuck waiting for the same rank, are not blamed.
#[test]
fn a_hung_rank_is_named_by_every_survivor_and_the_launcher() {
    let dir = fresh_dir("hung");
    let cfg = small_mlp(&dir, 1000, "");
    let t = Instant::now();
    let o = run(
        &["launch", "-n", "4", "--", KOLO, "train", "--config", cfg.to_str().unwrap(), "--timeout", "3", "--slow-rank", "2:60000"],
        &[],
    );
    let text = text(&o);
    assert!(!o.status.success(), "{text}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    for r in [0, 1, 3] {
        let line = text.lines().find(|l| l.starts_with(&format!("[rank {r}] error:"))).unwrap_or_else(|| panic!("rank {r}: {text}"));
        assert!(line.contains(&format!("rank {r}: all_reduce #")) && line.contains("still waiting for rank(s) [2]"), "{line}");
        assert!(!line.contains("all_reduce #0 "), "{line}");
    }
    assert!(text.contains("job failed: rank 2"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `kolo plot`: the TensorBoard files and JSON-lines logs of a 2-rank `kolo train` run become
/// loss and throughput PNGs with one line per rank; a directory without a run is an error.
#[test]
fn plot_renders_a_runs_curves_to_png() {
    let dir = fresh_dir("plot");
    let cfg = dir.join("mlp.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = 16\n\
             [train]\nsteps = 20\nlog_every = 4\ntensorboard_dir = \"{}\"\njson_log = \"{}\"\n",
            kolo_testkit::files::mnist_dir().display(),
            dir.join("tb").display(),
            dir.join("log-{rank}.jsonl").display()
        ),
    )
    .unwrap();
    let o = run(&["launch", "-n", "2", "--", KOLO, "train", "--config", cfg.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&["plot", dir.to_str().unwrap(), "--out", dir.to_str().unwrap()], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let pngs: Vec<&str> = out.lines().filter(|l| l.contains(".png: ")).collect();
    assert_eq!(pngs.len(), 2, "{out}");
    for line in pngs {
        assert!(line.contains("rank0 (5 points)") && line.contains("tb/rank1 (5 points)"), "{line}");
        let path = line.split(".png: ").next().unwrap().to_string() + ".png";
        let dec = png::Decoder::new(std::fs::File::open(&path).unwrap());
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (800, 480));
        // The first line's colour is drawn.
        assert!(buf.chunks(3).any(|p| p == [31, 119, 180]), "{path}: no curve drawn");
    }
    let o = run(&["plot", dir.join("tb/rank0/none").to_str().unwrap()], &[]);
    assert!(!o.status.success(), "a directory without a run plotted: {}", text(&o));
    // A damaged event file is named (issue #34: the error omitted the file).
    let bad = dir.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("events.out.tfevents.1.x"), b"not an event file at all").unwrap();
    let o = run(&["plot", bad.to_str().unwrap()], &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("events.out.tfevents.1.x:"), "{}", text(&o));
    std::fs::remove_dir_all(&dir).unwrap();
}
