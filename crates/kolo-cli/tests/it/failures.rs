//! Failures between real processes: a killed, hung or stopped rank (rank 0 too) is named by
//! the survivors and the launcher within the deadline; mismatched configs; the flight recorder;
//! an elastic job going on with the survivors.

use super::*;

/// 3 launched ranks of `kolo selftest` whose rank 1 fails after 3 collectives in `mode` (kill,
/// exit, hang), with the launcher's `grace` and the collectives' `timeout` (seconds).
fn failing_selftest(grace: &str, mode: &str, timeout: &str) -> Output {
    let selftest = ["selftest", "--fail-rank", "1", "--fail-after", "3", "--fail-mode", mode, "--iters", "100000", "--timeout", timeout];
    let args: Vec<&str> = ["launch", "-n", "3", "--grace", grace, "--", KOLO].into_iter().chain(selftest).collect();
    run(&args, &[])
}

#[test]
fn killed_rank_fails_the_job_with_a_summary_and_survivors_report_it() {
    for mode in ["kill", "exit"] {
        let t0 = Instant::now();
        let o = failing_selftest("20", mode, "120");
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
    let o = failing_selftest("1", "hang", "2");
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
