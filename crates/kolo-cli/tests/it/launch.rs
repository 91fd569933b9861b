//! The launcher and the binary's surface: rank spawning and core binding, Open MPI and Slurm
//! variables, the job token, signals, the collectives' benchmark and tuning, help texts.

use super::*;

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

#[test]
fn open_mpi_and_slurm_variables_are_understood() {
    let token = "00112233445566778899aabbccddeeff".to_string();
    let ompi = |r: usize| -> Vec<(&str, String)> {
        vec![
            ("OMPI_COMM_WORLD_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "2".into()),
            ("OMPI_COMM_WORLD_LOCAL_RANK", r.to_string()),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2".into()),
        ]
    };
    let slurm = |r: usize| -> Vec<(&str, String)> {
        vec![
            ("SLURM_PROCID", r.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_LOCALID", r.to_string()),
            ("SLURM_NNODES", "1".into()),
            ("MASTER_ADDR", "127.0.0.1".into()),
        ]
    };
    for launcher in [&ompi as &dyn Fn(usize) -> Vec<(&'static str, String)>, &slurm] {
        let port = free_port();
        let rank_env = |r: usize| {
            let mut vars = launcher(r);
            vars.extend([("MASTER_PORT", port.clone()), ("KOLO_JOB_TOKEN", token.clone())]);
            env(&vars)
        };
        let outs = spawn_ranks((0..2).map(rank_env).collect(), &["selftest", "--iters", "5", "--timeout", "30"]);
        for o in &outs {
            assert!(o.status.success(), "{}", text(o));
        }
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

/// `--bind-cores`: each rank runs on its own cores (the kernel's affinity list of the rank is
/// what KOLO_CPUS says, and the two ranks' lists do not overlap); without it nobody is bound.
/// The launcher binds the store's port itself and hands the listening socket to rank 0
/// (`KOLO_STORE_FD`), so that nothing can take the port between its choice and rank 0's store
/// (a test run once failed with "rank 0 cannot host the store: Address already in use"): rank
/// 0 starts with a descriptor that is a socket listening on MASTER_PORT (the kernel's
/// `/proc/net/tcp` says so), rank 1 with none.
#[test]
fn launcher_hands_rank_0_the_stores_socket_already_listening() {
    let script = r#"if [ -n "$KOLO_STORE_FD" ]; then ino=$(readlink /proc/self/fd/$KOLO_STORE_FD | tr -dc 0-9); port=$(printf %04X $MASTER_PORT); n=$(cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v i="$ino" '$10 == i {print $2, $4}' | grep -c ":$port 0A"); echo "store fd listening on MASTER_PORT: $n"; else echo "store fd: none"; fi"#;
    let o = run(&["launch", "-n", "2", "--", "sh", "-c", script], &[]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("[rank 0] store fd listening on MASTER_PORT: 1"), "{t}");
    assert!(t.contains("[rank 1] store fd: none"), "{t}");
}

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
