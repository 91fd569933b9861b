//! A collective loop with fault injection: one rank leaves abruptly after some iterations, and
//! every survivor must fail with a clear error (not hang). Used by Kolo's process tests.

use crate::comm_args::CommArgs;
use kolo_comm::{BufMut, Communicator, ReduceOp};
use std::time::Instant;

#[derive(clap::Args)]
pub struct SelftestArgs {
    #[command(flatten)]
    comm: CommArgs,
    /// Iterations of all_reduce to run.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Elements per all_reduce.
    #[arg(long, default_value_t = 100_000)]
    count: usize,
    /// The rank that leaves early.
    #[arg(long)]
    fail_rank: Option<usize>,
    /// After this many iterations.
    #[arg(long, default_value_t = 3)]
    fail_after: usize,
    /// How it leaves: exit (status 3), abort (SIGABRT), kill (SIGKILL), or hang (stops
    /// calling collectives and sleeps, as a rank stuck outside the communicator would).
    #[arg(long, default_value = "exit")]
    fail_mode: String,
}

pub fn run(a: SelftestArgs) -> anyhow::Result<i32> {
    let b = a.comm.join()?;
    let comm = b.comm;
    let me = comm.rank().get();
    let n = comm.world_size().get();
    let mut buf = vec![0f32; a.count];
    let t0 = Instant::now();
    for it in 0..a.iters {
        if Some(me) == a.fail_rank && it == a.fail_after {
            kolo_base::eline!("selftest: rank {me} leaving now ({})", a.fail_mode);
            match a.fail_mode.as_str() {
                // SAFETY: raising a signal at ourselves.
                "kill" => unsafe {
                    libc::raise(libc::SIGKILL);
                },
                "abort" => std::process::abort(),
                "hang" => loop {
                    std::thread::sleep(std::time::Duration::from_secs(3600));
                },
                _ => std::process::exit(3),
            }
        }
        buf.iter_mut().enumerate().for_each(|(i, x)| *x = (i % 5 + me) as f32);
        if let Err(e) = comm.all_reduce(BufMut::from(&mut buf), ReduceOp::Sum) {
            let after = t0.elapsed().as_secs_f64();
            eprint!("{}", comm.flight_record());
            return Err(anyhow::Error::new(e).context(format!("selftest: rank {me} failed after {after:.2}s")));
        }
        let want = |i: usize| (n * (i % 5) + n * (n - 1) / 2) as f32;
        if let Some(i) = (0..a.count).find(|i| buf[*i] != want(*i)) {
            anyhow::bail!("rank {me}: iteration {it}: element {i} is {} instead of {}", buf[i], want(i));
        }
    }
    println!("selftest: rank {me} of {n}: {} all_reduce iterations ok", a.iters);
    Ok(0)
}
