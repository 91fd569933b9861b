//! A parameter server that stops (SIGSTOP) long enough to be declared dead, and comes back
//! (SIGCONT) while the job goes on without it (#34 item 4). Its copies of the ranges are stale
//! by then: it must not hand them to anyone. The servers are `kolo ps serve` processes; the
//! coordinator and the two BSP workers run in this process so that the steps are in lockstep
//! and nothing is in flight to the stopped server when it stops.

use super::KOLO;
use kolo_optim::{Optimizer, OptimizerSpec};
use kolo_ps::client::ClientOptions;
use kolo_ps::{Consistency, Coordinator, JobSpec, PsClient, Ring};
use kolo_rendezvous::JobToken;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const N: usize = 1000;
const LR: f32 = 0.05;

fn grad(w: u32, t: u64) -> Vec<f32> {
    (0..N).map(|i| ((i as f32 * 0.37 + w as f32 * 1.3 + t as f32 * 0.11).sin()) * 0.1).collect()
}

fn client(coord: &Coordinator, token: &JobToken, job: &JobSpec, worker: u32) -> PsClient {
    PsClient::connect(ClientOptions {
        coordinator: coord.addr().to_string(),
        token: token.clone(),
        job: job.clone(),
        worker,
        min_servers: 2,
        timeout: Duration::from_secs(15),
        heartbeat: None,
    })
    .unwrap()
}

/// Both workers run steps `steps` in lockstep (pull, push); the first error is returned.
fn steps(clients: &mut [PsClient], steps: std::ops::Range<u64>) -> Result<(), String> {
    std::thread::scope(|s| {
        let hs: Vec<_> = clients
            .iter_mut()
            .enumerate()
            .map(|(w, p)| {
                let steps = steps.clone();
                s.spawn(move || -> Result<(), String> {
                    let mut x = vec![0f32; N];
                    for t in steps {
                        p.pull(t, &mut x).map_err(|e| format!("worker {w} pull {t}: {e}"))?;
                        p.push(t, LR, &grad(w as u32, t), None).map_err(|e| format!("worker {w} push {t}: {e}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter().try_for_each(|h| h.join().unwrap())
    })
}

fn signal(child: &Child, sig: i32) {
    assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0, "kill -{sig} {}", child.id());
}

fn wait_until(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "{what}: not within {secs} s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_paused_server_declared_dead_hands_no_stale_copy_on_when_it_resumes() {
    let token = JobToken::generate();
    let coord = Coordinator::start("127.0.0.1:0", token.clone(), Duration::from_millis(1000)).unwrap();
    // Started one at a time, so that the servers' ids are 0, 1, 2 in this order.
    let mut servers: Vec<Child> = Vec::new();
    for i in 0..3 {
        let child = Command::new(KOLO)
            .args(["ps", "serve", "--coordinator", &coord.addr().to_string(), "--heartbeat-ms", "100", "--timeout", "15"])
            .env("KOLO_JOB_TOKEN", token.to_hex())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        servers.push(child);
        wait_until("a server registers", 20, || coord.membership().servers.len() == i + 1);
    }
    let job = JobSpec {
        len: N as u64,
        chunk: 97,
        workers: 2,
        replication: 1,
        backup: 0,
        consistency: Consistency::Bsp,
        optimizer: OptimizerSpec::Sgd { momentum: 0.9, nesterov: false, weight_decay: 0.0 },
    };
    // The paused server heads some ranges: the surviving replica hands those on to the third
    // server, and so would the paused one when it comes back (its copy older by 4 steps).
    let ring = Ring::new(&[0, 1, 2]);
    assert!((0..job.ranges()).any(|r| ring.chain(r, 1)[0] == 1), "server 1 heads no range");
    let init: Vec<f32> = (0..N).map(|i| i as f32 * 1e-3).collect();
    let mut clients: Vec<PsClient> = (0..2).map(|w| client(&coord, &token, &job, w)).collect();
    clients[0].init(&init).unwrap();
    steps(&mut clients, 0..3).unwrap();

    signal(&servers[1], libc::SIGSTOP);
    wait_until("the coordinator declares the stopped server dead", 20, || !coord.membership().servers.iter().any(|(id, _)| *id == 1));
    // New clients learn the membership without server 1: nothing is ever sent to it again.
    let mut clients: Vec<PsClient> = (0..2).map(|w| client(&coord, &token, &job, w)).collect();
    steps(&mut clients, 3..7).unwrap();

    signal(&servers[1], libc::SIGCONT);
    let mut paused = servers.remove(1);
    wait_until("the resumed server exits", 20, || paused.try_wait().unwrap().is_some());
    let out = paused.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);

    let went_on = steps(&mut clients, 7..10);
    let mut x = vec![0f32; N];
    let pulled = went_on.clone().and_then(|_| clients[0].pull(10, &mut x).map(|_| ()).map_err(|e| e.to_string()));
    drop(clients);
    coord.shutdown();
    for mut s in servers {
        let _ = s.kill();
        let _ = s.wait();
    }
    pulled.unwrap_or_else(|e| panic!("the job did not go on after the paused server came back: {e}\nit said: {said}"));
    assert!(said.contains("stale now, were not handed on"), "the resumed server said: {said}");

    // One process: the mean of the two gradients (summed in worker order), SGD with momentum.
    let mut want = init;
    let mut opt = Optimizer::new(job.optimizer.clone(), N);
    for t in 0..10 {
        let mut g = grad(0, t);
        g.iter_mut().zip(grad(1, t)).for_each(|(a, b)| *a += b);
        g.iter_mut().for_each(|a| *a /= 2.0);
        opt.step(&mut want, &g, LR);
    }
    assert_eq!(x, want, "BSP across a paused server must equal one process bit for bit");
}
