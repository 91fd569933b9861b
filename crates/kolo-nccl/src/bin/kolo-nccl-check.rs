//! The NCCL backend on a real GPU: `kolo-nccl-check [check|bench|hang]`, alone (world size 1)
//! or under `kolo launch -n N` (one rank per GPU; N ranks on one GPU is refused by NCCL).
//!
//! - `check`: the collective matrix every backend passes (every collective, every dtype, odd
//!   lengths), on the host API and again on a sub-group; then the GPU-buffer collectives
//!   against values computed on the host.
//! - `bench [MAX_BYTES]`: all-reduce on GPU buffers and through the host API, 8 B to MAX_BYTES
//!   (default 1 GiB), time per call, algbw and busbw as nccl-tests computes them.
//! - `hang`: rank 0 calls an all-reduce that the other ranks never call: it must end with a
//!   timeout error naming the rank and the operation (`KOLO_TIMEOUT_MS`).
//! - `absent`: ranks other than 0 take part in the bootstrap but never initialise NCCL: rank 0's
//!   setup must end at its deadline with an error (runs with one GPU, unlike `hang`).
//!
//! Exit status 0 only when every check passed; output ends with `nccl check ok` per rank.

use kolo_base::Rank;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use kolo_nccl::NcclComm;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("kolo-nccl-check: {e}");
    std::process::exit(2)
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "check".into());
    let timeout = Duration::from_millis(std::env::var("KOLO_TIMEOUT_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(120_000));
    let env = kolo_rendezvous::discover(std::env::vars()).unwrap_or_else(|e| fail(e));
    let cfg = kolo_collectives::HostCommConfig { timeout: Duration::from_secs(120), ..Default::default() };
    let boot = kolo_collectives::bootstrap(env.as_ref(), cfg).unwrap_or_else(|e| fail(e));
    let t0 = Instant::now();
    if mode == "absent" {
        absent(&*boot.comm, timeout);
        return;
    }
    let comm = NcclComm::connect(&*boot.comm, kolo_nccl::default_device(), timeout).unwrap_or_else(|e| fail(e));
    let (r, n) = (comm.rank().get(), comm.world_size().get());
    let v = kolo_nccl::nccl_version().unwrap_or_else(|e| fail(e));
    println!("rank {r} of {n}: NCCL {}.{}.{} on {comm:?}, set up in {:.2} s", v.0, v.1, v.2, t0.elapsed().as_secs_f64());
    match mode.as_str() {
        "check" => check(&comm),
        "bench" => bench(&comm, std::env::args().nth(2).and_then(|v| v.parse().ok()).unwrap_or(1 << 30)),
        "hang" => hang(&comm),
        m => fail(format!("unknown mode {m} (check, bench, hang)")),
    }
    println!("rank {r} of {n}: nccl check ok");
}

fn check(comm: &Arc<NcclComm>) {
    let (r, n) = (comm.rank().get(), comm.world_size().get());
    let t = Instant::now();
    kolo_testkit::conformance(&**comm, kolo_testkit::ODD_LENS);
    println!("rank {r}: host-API collective matrix passed in {:.2} s", t.elapsed().as_secs_f64());
    let evens: Vec<Rank> = (0..n).step_by(2).map(Rank).collect();
    if let Some(g) = comm.new_group(&evens).unwrap_or_else(|e| fail(e)) {
        kolo_testkit::conformance(&*g, &[0, 1, 13, 1009]);
        println!("rank {r}: sub-group of {} ranks passed", g.world_size().get());
    }
    // GPU buffers: sum and average of rank-dependent values, gather and scatter, broadcast.
    let s = comm.stream().clone();
    for len in [1usize, 7, 1009, 65_537, 1 << 20] {
        let host: Vec<f32> = (0..len).map(|i| (i % 251) as f32 * 0.5 + r as f32).collect();
        let mut d = s.clone_htod(&host).unwrap_or_else(|e| fail(format!("{e:?}")));
        comm.all_reduce_device(&mut d, ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        let got = s.clone_dtoh(&d).unwrap_or_else(|e| fail(format!("{e:?}")));
        let ranks_sum = (n * (n - 1) / 2) as f32;
        for (i, g) in got.iter().enumerate() {
            let want = (i % 251) as f32 * 0.5 * n as f32 + ranks_sum;
            assert_eq!(*g, want, "all_reduce_device sum, len {len}, element {i}");
        }
        let mut d = s.clone_htod(&host).unwrap_or_else(|e| fail(format!("{e:?}")));
        comm.all_reduce_device(&mut d, ReduceOp::Avg).unwrap_or_else(|e| fail(e));
        let got = s.clone_dtoh(&d).unwrap_or_else(|e| fail(format!("{e:?}")));
        for (i, g) in got.iter().enumerate() {
            let want = (i % 251) as f32 * 0.5 + ranks_sum / n as f32;
            assert!((g - want).abs() <= 1e-5 * want.abs().max(1.0), "all_reduce_device avg, len {len}, element {i}: {g} vs {want}");
        }
        let shard: Vec<i64> = (0..len).map(|i| (r * len + i) as i64).collect();
        let ds = s.clone_htod(&shard).unwrap_or_else(|e| fail(format!("{e:?}")));
        let mut all = s.alloc_zeros::<i64>(len * n).unwrap_or_else(|e| fail(format!("{e:?}")));
        comm.all_gather_device(&ds, &mut all).unwrap_or_else(|e| fail(e));
        let got = s.clone_dtoh(&all).unwrap_or_else(|e| fail(format!("{e:?}")));
        assert!(got.iter().enumerate().all(|(i, v)| *v == i as i64), "all_gather_device, len {len}");
        let whole: Vec<i64> = (0..len * n).map(|i| i as i64).collect();
        let dw = s.clone_htod(&whole).unwrap_or_else(|e| fail(format!("{e:?}")));
        let mut mine = s.alloc_zeros::<i64>(len).unwrap_or_else(|e| fail(format!("{e:?}")));
        comm.reduce_scatter_device(&dw, &mut mine, ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        let got = s.clone_dtoh(&mine).unwrap_or_else(|e| fail(format!("{e:?}")));
        assert!(got.iter().enumerate().all(|(i, v)| *v == ((r * len + i) * n) as i64), "reduce_scatter_device, len {len}");
        let mut b = s.clone_htod(&vec![r as u8 + 1; len]).unwrap_or_else(|e| fail(format!("{e:?}")));
        comm.broadcast_device(&mut b, Rank(n - 1)).unwrap_or_else(|e| fail(e));
        let got = s.clone_dtoh(&b).unwrap_or_else(|e| fail(format!("{e:?}")));
        assert!(got.iter().all(|v| *v == n as u8), "broadcast_device, len {len}");
    }
    println!("rank {r}: GPU-buffer collectives passed");
    // A wrong root is refused before NCCL sees it.
    let e = comm.broadcast(BufMut::from(&mut [0f32; 3][..]), Rank(n)).expect_err("root out of range");
    println!("rank {r}: bad root refused: {e}");
}

fn bench(comm: &Arc<NcclComm>, max: usize) {
    let (r, n) = (comm.rank().get(), comm.world_size().get());
    let s = comm.stream().clone();
    let factor = 2.0 * (n as f64 - 1.0) / n as f64;
    if r == 0 {
        println!("all_reduce f32 sum, {n} rank(s); busbw = algbw x 2(n-1)/n (0 for one rank, as in nccl-tests)");
        println!("{:>12} {:>12} {:>10} {:>10} {:>12} {:>10}", "bytes", "gpu us", "algbw GB/s", "busbw GB/s", "host-API us", "algbw GB/s");
    }
    let mut bytes = 8usize;
    while bytes <= max {
        let len = bytes / 4;
        let mut d = s.alloc_zeros::<f32>(len).unwrap_or_else(|e| fail(format!("{e:?}")));
        s.memcpy_htod(&vec![1.0f32; len], &mut d).unwrap_or_else(|e| fail(format!("{e:?}")));
        let iters = (200usize).min((1usize << 33) / bytes).max(5);
        for _ in 0..3 {
            comm.all_reduce_device(&mut d, ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        }
        let t = Instant::now();
        for _ in 0..iters {
            comm.all_reduce_device(&mut d, ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        }
        let gpu = t.elapsed().as_secs_f64() / iters as f64;
        let mut h = vec![1.0f32; len];
        let hiters = iters.min(20);
        comm.all_reduce(BufMut::from(&mut h[..]), ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        let t = Instant::now();
        for _ in 0..hiters {
            comm.all_reduce(BufMut::from(&mut h[..]), ReduceOp::Sum).unwrap_or_else(|e| fail(e));
        }
        let host = t.elapsed().as_secs_f64() / hiters as f64;
        if r == 0 {
            let alg = bytes as f64 / gpu / 1e9;
            println!(
                "{bytes:>12} {:>12.1} {alg:>10.2} {:>10.2} {:>12.1} {:>10.2}",
                gpu * 1e6,
                alg * factor,
                host * 1e6,
                bytes as f64 / host / 1e9
            );
        }
        bytes *= 4;
    }
}

/// Rank 0 calls an all-reduce nobody else calls. Passes only when it ends in a timeout near the
/// deadline that names rank 0, the operation and the absent ranks, and the aborted
/// communicator refuses the next call; any other outcome (completion, another error, an early
/// or late end) exits non-zero.
fn hang(comm: &Arc<NcclComm>) {
    let (r, n) = (comm.rank().get(), comm.world_size().get());
    if n < 2 {
        fail("hang needs at least 2 ranks (kolo launch -n 2 ... on two GPUs): alone nothing can be absent");
    }
    if r == 0 {
        let mut v = vec![1.0f32; 1 << 16];
        let t = Instant::now();
        let e = match comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum) {
            Ok(()) => fail("all_reduce with absent peers completed"),
            Err(e) => e,
        };
        let waited = t.elapsed();
        println!("rank 0: error after {:.2} s: {e}", waited.as_secs_f64());
        match &e {
            kolo_comm::CommError::Timeout { op, rank, missing, .. } => {
                let want: Vec<Rank> = (1..n).map(Rank).collect();
                if op.to_string() != "all_reduce" || *rank != Rank(0) || *missing != want {
                    fail(format!("the timeout must name all_reduce, rank 0 and the absent ranks {want:?}: {e}"));
                }
            }
            other => fail(format!("expected a timeout, got: {other}")),
        }
        if waited < comm.timeout() || waited > comm.timeout() * 2 {
            fail(format!("the timeout came after {waited:?}, the deadline was {:?}", comm.timeout()));
        }
        match comm.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum) {
            Err(again @ kolo_comm::CommError::Aborted { .. }) => println!("rank 0: next call: {again}"),
            other => fail(format!("an aborted communicator must refuse the next call as Aborted, got {other:?}")),
        }
    } else {
        // Never calls the collective; stays alive past rank 0's deadline.
        std::thread::sleep(comm.timeout() + Duration::from_secs(2));
    }
}

/// The other ranks never initialise NCCL. Passes only when rank 0's setup ends at its
/// deadline with the init-timeout error; a setup error of another kind (no GPU, no NCCL) or
/// one that comes early exits non-zero.
fn absent(boot: &dyn Communicator, timeout: Duration) {
    let r = boot.rank().get();
    if boot.world_size().get() < 2 {
        fail("absent needs at least 2 ranks (kolo launch -n 2 ...)");
    }
    if r == 0 {
        let t = Instant::now();
        match NcclComm::connect(boot, kolo_nccl::default_device(), timeout) {
            Ok(_) => fail("NCCL set up without the other ranks"),
            Err(e) => {
                let waited = t.elapsed();
                println!("rank 0: error after {:.2} s: {e}", waited.as_secs_f64());
                if !e.to_string().contains("did not complete within") {
                    fail(format!("expected the init deadline's error, got: {e}"));
                }
                if waited < timeout || waited > timeout * 2 {
                    fail(format!("setup ended after {waited:?}, the deadline was {timeout:?}"));
                }
            }
        }
    } else {
        let mut id = [0u8; 129];
        boot.broadcast(BufMut::from(&mut id[..]), Rank(0)).unwrap_or_else(|e| fail(e));
        std::thread::sleep(timeout + Duration::from_secs(2));
    }
    println!("rank {r}: nccl check ok");
}
