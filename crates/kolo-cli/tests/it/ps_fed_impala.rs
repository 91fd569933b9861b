//! The other jobs: parameter servers (`kolo ps run`, a killed server), federated averaging
//! (`kolo fed`) and IMPALA actors (`kolo impala`), as real processes.

use super::*;

/// `kolo ps run`: coordinator, server processes and worker processes on localhost. Each
/// worker writes its own trace; `kolo ps run` merges them when the workers are done.
#[test]
fn ps_run_trains_mnist_through_server_processes() {
    let dir = std::env::temp_dir().join(format!("kolo-ps-run-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("ps.toml");
    write_mnist_mlp(&cfg, 64, 32, &format!("[optim]\nkind = \"adagrad\"\nlr = 0.02\n[train]\nsteps = 150\nlog_every = 50\nstrategy = \"ps\"\ntimeline_dir = \"{}\"\n[ps]\nconsistency = \"bounded\"\nstaleness = 2\nchunk = 10000\nreplication = 1\n", dir.join("tl").display()));
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

/// A worker process of a `kolo ps run` job fails at step 4 of 700 (`--kill-at 2:4`): the
/// launcher lets the other workers run on (for longer than its 5 s grace after a failure),
/// the coordinator declares the dead one lost after 1.5 s of silence, a survivor trains its
/// data shard from its last step, and `kolo ps run` succeeds, naming the failure and who took the shard over. Under BSP the servers' final
/// state (worker 0's checkpoint: the parameters and Adam's moments) is bitwise the
/// uninterrupted job's. Before, the launcher stopped every worker when one failed, so no
/// shard was ever taken over in a real job.
#[test]
fn a_ps_job_whose_worker_dies_trains_its_shard_on_a_survivor_to_the_same_bits() {
    let dir = fresh_dir("ps-dead-worker");
    let job = |name: &str, extra: &[&str]| {
        let cfg = dir.join(format!("{name}.toml"));
        write_mnist_mlp(&cfg, 64, 16, &format!("[optim]\nkind = \"adam\"\nlr = 0.01\n[train]\nsteps = 700\nlog_every = 100\nstrategy = \"ps\"\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 700\n[ps]\nconsistency = \"bsp\"\nchunk = 3000\nservers = 2\nreplication = 1\n", dir.join(name).display()));
        let args = [&["ps", "run", "-n", "3", "--servers", "2", "--dead-after", "1.5", "--config", cfg.to_str().unwrap()], extra].concat();
        let o = run(&args, &[("RAYON_NUM_THREADS", "1")]);
        let t = text(&o);
        assert!(o.status.success(), "{name}: {t}");
        (t, model_and_state(&dir.join(name).join("step-00000700")))
    };
    let (_, clean) = job("clean", &[]);
    let (t, dead) = job("dead", &["--", "--kill-at", "2:4"]);
    assert!(t.contains("worker 2 died at step 4"), "{t}");
    assert!(t.contains("kolo ps run: worker 2 exited with status 1; worker "), "{t}");
    assert!(t.contains("trained its data shard to the end") && t.contains("every data shard was trained"), "{t}");
    assert_eq!(clean.len(), dead.len());
    for (k, v) in &clean {
        assert!(v == &dead[k], "`{k}` differs from the uninterrupted job's by up to {}", kolo_testkit::max_abs_diff(v, &dead[k]));
    }
}

/// Under async consistency nobody's pull waits for another worker, so the survivors of a
/// worker that dies early (`--kill-at 1:3` of 200 steps) finish long before the coordinator
/// declares it dead (2 s of silence); under bounded delay (τ = 4) the survivors' last pull
/// waits only for step 196, so a worker that dies at step 197 is left behind too. The
/// survivors wait at the end for every worker's last push, one trains the dead worker's shard,
/// and the job succeeds: worker 0's final checkpoint holds 200 pushes of every worker
/// (`kolo.ps_clocks`). Before, the survivors ended without waiting and the shard was left
/// untrained.
#[test]
fn async_and_bounded_ps_jobs_take_over_a_worker_that_dies_while_the_others_finish() {
    for (consistency, kill) in [("async", "1:3"), ("bounded", "1:197")] {
        let dir = fresh_dir(&format!("ps-dead-{consistency}"));
        let (cfg, ck) = (dir.join("job.toml"), dir.join("ck"));
        let tables = format!(
            "[train]\nsteps = 200\nlog_every = 100\nstrategy = \"ps\"\ncheckpoint_dir = \"{}\"\ncheckpoint_every = 200\n[ps]\nconsistency = \"{consistency}\"\nstaleness = 4\n",
            ck.display()
        );
        write_mnist_mlp(&cfg, 16, 8, &tables);
        let args = ["ps", "run", "-n", "3", "--dead-after", "2", "--config", cfg.to_str().unwrap(), "--", "--kill-at", kill];
        let o = run(&args, &[("RAYON_NUM_THREADS", "1")]);
        let t = text(&o);
        assert!(o.status.success() && t.contains("every data shard was trained"), "{consistency}: {t}");
        let meta = kolo_checkpoint::sharded::load_any(&ck.join("step-00000200")).unwrap().meta;
        assert_eq!(meta.get("kolo.ps_clocks").map(String::as_str), Some("200,200,200"), "{consistency}: {t}");
    }
}

/// When the coordinator would declare a dead worker dead only after the survivors' deadline
/// (`ps.timeout_secs` = 3 s, `--dead-after` 60 s), the survivors stop waiting for its last push
/// with an error that names it, and `kolo ps run` fails saying nobody took its shard over and why.
#[test]
fn a_ps_job_whose_dead_workers_shard_nobody_took_over_fails_saying_so() {
    let dir = fresh_dir("ps-dead-async-late");
    let cfg = dir.join("async.toml");
    write_mnist_mlp(
        &cfg,
        16,
        8,
        "[train]\nsteps = 200\nlog_every = 100\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\ntimeout_secs = 3\n",
    );
    let args = ["ps", "run", "-n", "3", "--dead-after", "60", "--config", cfg.to_str().unwrap(), "--", "--kill-at", "1:3"];
    let o = run(&args, &[("RAYON_NUM_THREADS", "1")]);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("the slowest worker stayed at 3 of its 200 pushes") && t.contains("behind: worker 1."), "{t}");
    assert!(t.contains("job failed: rank 1") && t.contains("no worker took over worker 1's data shard"), "{t}");
}

/// Writes a `kolo train` config of an MLP (`hidden` wide) on the repository's MNIST subset,
/// `batch` examples per rank, then `rest` (more tables).
fn write_mnist_mlp(cfg: &std::path::Path, hidden: usize, batch: usize, rest: &str) {
    let data = kolo_testkit::files::mnist_dir();
    let head = format!(
        "[model]\nkind = \"mlp\"\nhidden = [{hidden}]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = {batch}\n",
        data.display()
    );
    std::fs::write(cfg, head + rest).unwrap();
}

/// Every tensor of a checkpoint (the model and the optimizer's state), by name.
fn model_and_state(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let ck = kolo_checkpoint::sharded::load_any(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    ck.tensors.into_iter().map(|e| (e.name, e.data)).collect()
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
    write_mnist_mlp(&cfg, 64, 32, "[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nsteps = 1500\nlog_every = 100\nstrategy = \"ps\"\n[ps]\nconsistency = \"bsp\"\nchunk = 5000\nreplication = 1\nservers = 3\ntimeout_secs = 30\n");
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
