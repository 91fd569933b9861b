//! What a run reports: the straggler, TensorBoard event files, JSON logs, the merged timeline, plots.

use super::*;

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
    #[cfg(feature = "ps")]
    ps_workers_name_the_straggler();
}

/// Parameter-server workers share no communicator: the servers see when each worker's pushes
/// arrive, and every worker names the slow one.
#[cfg(feature = "ps")]
fn ps_workers_name_the_straggler() {
    // Parameter-server workers share no communicator: the servers see when each worker's
    // pushes arrive, and every worker names the slow one (BSP; BSP with a backup worker, whose
    // late pushes are dropped; async), whichever it is.
    // Async runs 2 workers: nothing makes async workers start together, and a fast worker that
    // ends its 9 steps (a few ms) before the other fast one has pushed once sees two workers
    // equally behind; naming neither is then the right answer (it failed CI that way).
    for (consistency, backup, slow, workers) in [("bsp", 0, 1, 3), ("bsp", 0, 2, 3), ("bsp", 1, 2, 3), ("async", 0, 1, 2)] {
        let ps = mnist_cfg(
            &format!(
                "[train]\nsteps = 9\nlog_every = 3\nstrategy = \"ps\"\n[ps]\nconsistency = \"{consistency}\"\nbackup_workers = {backup}\nchunk = 4000\nservers = 2\n"
            ),
            16,
        );
        // 120 ms a step: in async, a fast worker's thread starved by the scheduler for longer
        // than the slow worker's lead (40 ms a step was not enough in a loaded full-suite run)
        // sees nobody behind it and names no straggler.
        let opts = RunOptions { slow_rank: Some((slow, 120)), ..quiet() };
        for (w, s) in train_ps(&ps_cluster(2), workers, &ps, &opts).iter().enumerate() {
            let (r, lag) = s.straggler.unwrap_or_else(|| panic!("{consistency}, {backup} backup: worker {w} names no straggler"));
            assert_eq!(r, slow, "{consistency}, {backup} backup: worker {w} names worker {r} ({lag:.1} ms)");
            // BSP: the slow worker's pushes come its 40 ms late. With a backup worker, and async,
            // the others run on without it; it is behind by as long as they have run since the
            // first step it has not pushed (its late pushes are dropped, still timed).
            assert!(lag > if consistency == "bsp" && backup == 0 { 20.0 } else { 1.0 }, "{consistency}, {backup} backup: lag {lag} ms");
        }
    }
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
