//! Parameter servers: BSP equals DDP bitwise, asynchronous and bounded-delay training, failover, checkpoints, filters, Hogwild, Sandblaster L-BFGS, the evaluation group.

use super::*;
use std::time::Duration;

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
    let acc = |s: &Summary| kolo_train::eval::evaluate_params(&cfg(""), &s.params).unwrap().accuracy.unwrap();
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
    // Dead in the last step: the others are already waiting for the final parameters, and
    // still take its shard over.
    let c = ps_cluster_with(2, Duration::from_millis(800));
    let r = try_train_ps(&c, 3, &cfg, &RunOptions { die_at: Some((2, 9)), ..quiet() });
    assert!(r[2].is_err(), "worker 2 was told to die");
    for (w, r) in r.iter().take(2).enumerate() {
        let p = &r.as_ref().unwrap_or_else(|e| panic!("worker {w}: {e}")).params;
        assert_eq!(max_diff(p, &clean[0].params), 0.0, "worker {w}, after a death in the last step");
    }
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
        "[optim]\nkind = \"adagrad\"\nlr = 0.05\n[train]\nsteps = 500\nlog_every = 50\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\nfetch_every = 2\npush_every = 2\nchunk = 5000\nservers = 2\nreplication = 1\n",
        32,
    );
    let s = train_ps(&c, 2, &cfg, &quiet());
    let acc = s[0].eval.as_ref().unwrap().accuracy.unwrap();
    // The interleaving of the two workers' pushes varies the result: at 300 steps it ended at
    // 86.8-89.1 % (too near the bar, a CI flake); at 500, 88.0-90.1 % with 3 busy loops beside.
    assert!(acc > 0.85, "async Downpour SGD reached only {:.1}% test accuracy", acc * 100.0);
    // 500 steps, a push every 2: 250 pushes per worker.
    assert_eq!(s[0].comm_bytes.iter().filter(|b| **b > 0).count(), 250);
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

/// At the end of an asynchronous run a worker waits for every worker's last push
/// (`Adoption::final_pull`); when the take-over of a dead worker's shard fails, those pushes
/// will never come, and the wait stops at once with the take-over's error instead of waiting
/// out `ps.timeout_secs` (60 s here) and then blaming the dead worker. Real servers and
/// coordinator: worker 1 connects and goes silent, the coordinator declares it dead and grants
/// its shard to worker 0, whose take-over fails.
#[test]
fn an_async_workers_end_wait_stops_when_the_take_over_fails() {
    let c = ps_cluster_with(1, Duration::from_millis(500));
    let cfg =
        mnist_cfg("[optim]\nkind = \"sgd\"\nlr = 0.1\n[train]\nstrategy = \"ps\"\n[ps]\nconsistency = \"async\"\ntimeout_secs = 60\n", 8);
    let (coord, numel, steps) = (c.coord.addr().to_string(), 1000, 3);
    let connect = |w| kolo_train::ps_worker::connect(&cfg.ps, cfg.optimizer(), &coord, &c.token, numel, (w, 2)).unwrap();
    let mut x = kolo_train::ps_worker::Exchange::new(connect(0), &cfg.ps, numel);
    x.client.init(&vec![0.5; numel]).unwrap();
    // Worker 1 beats for a while (every 250 ms), then its heartbeats stop: it never pushes.
    let one = connect(1);
    std::thread::sleep(Duration::from_millis(700));
    drop(one);
    for step in 0..steps {
        x.pull_if_due(step).unwrap();
        x.grads.fill(0.01);
        x.push_step(step, 0.1, None).unwrap();
    }
    let take_over: kolo_train::ps_worker::TakeOver =
        std::sync::Arc::new(|dead| Err(TrainError::Other(format!("worker {dead}'s shard could not be trained"))));
    let mut adoption = kolo_train::ps_worker::Adoption::start(&coord, &c.token, (0, 2), take_over).unwrap();
    let t = std::time::Instant::now();
    let e = adoption.final_pull(&mut x, steps, 0).expect_err("the take-over failed").to_string();
    assert!(e.contains("worker 1's shard could not be trained"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(30), "the end wait took {:?}: it waited for pushes no one would make", t.elapsed());
}
