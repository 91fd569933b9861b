//! Run under `mpirun -n N`: every collective on every dtype over the MPI backend, checked
//! against the reference semantics (the same matrix the TCP and shared-memory backends pass),
//! then the same on a sub-group made with `new_group`, and point-to-point ring exchanges.

use kolo_base::Rank;
use kolo_comm::{BufMut, ReduceOp};
use std::time::Duration;

fn main() {
    let world = kolo_mpi::world(Duration::from_secs(120)).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let (r, n) = (world.rank().get(), world.world_size().get());
    // KOLO_MPI_LENS=1,7 narrows the element counts (debugging).
    let lens: Vec<usize> = std::env::var("KOLO_MPI_LENS")
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|_| kolo_testkit::ODD_LENS.to_vec());
    kolo_testkit::conformance(&*world, &lens);
    // A sub-group of the even ranks runs the matrix too; odd ranks are not members.
    let evens: Vec<Rank> = (0..n).step_by(2).map(Rank).collect();
    if let Some(g) = world.new_group(&evens).expect("new_group") {
        kolo_testkit::conformance(&*g, &[0, 1, 13, 1009]);
    }
    let mut v = [r as f32 + 1.0];
    world.all_reduce(BufMut::from(&mut v[..]), ReduceOp::Sum).expect("all_reduce");
    assert_eq!(v[0], (n * (n + 1) / 2) as f32);
    println!("rank {r} of {n}: mpi conformance ok");
}
