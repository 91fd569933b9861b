//! A named-axis device mesh (e.g. `pp × dp × tp`) laid out row-major over the ranks of a group:
//! the last axis varies fastest, so consecutive ranks share everything but the last coordinate
//! (put `tp` last to keep tensor-parallel peers on one host).

use crate::{CommError, Communicator, OpKind};
use kolo_base::Rank;
use std::sync::Arc;

/// The coordinates of `rank` in a mesh of `shape`.
pub fn coords(shape: &[usize], rank: usize) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    let mut r = rank;
    for (i, s) in shape.iter().enumerate().rev() {
        c[i] = r % s;
        r /= s;
    }
    c
}

/// The groups along `axis`: ranks that differ only in that coordinate, each in axis order.
/// Groups are listed in increasing order of their smallest rank.
pub fn axis_groups(shape: &[usize], axis: usize) -> Vec<Vec<usize>> {
    let total: usize = shape.iter().product();
    let stride: usize = shape[axis + 1..].iter().product();
    (0..total).filter(|r| coords(shape, *r)[axis] == 0).map(|first| (0..shape[axis]).map(|i| first + i * stride).collect()).collect()
}

/// One communicator per axis for this rank.
pub struct DeviceMesh {
    names: Vec<String>,
    shape: Vec<usize>,
    coords: Vec<usize>,
    groups: Vec<Arc<dyn Communicator>>,
}

impl DeviceMesh {
    /// Collective over `comm`. The product of the axis sizes must equal the group size.
    pub fn new(comm: &dyn Communicator, axes: &[(&str, usize)]) -> Result<DeviceMesh, CommError> {
        let n = comm.world_size().get();
        let shape: Vec<usize> = axes.iter().map(|a| a.1).collect();
        let bad = |what: String| CommError::InvalidArgument { op: OpKind::NewGroup, rank: comm.rank(), what };
        if axes.is_empty() || shape.contains(&0) || shape.iter().product::<usize>() != n {
            return Err(bad(format!("mesh {axes:?} does not have exactly {n} ranks")));
        }
        let mut names: Vec<String> = axes.iter().map(|a| a.0.to_string()).collect();
        names.sort();
        names.dedup();
        if names.len() != axes.len() {
            return Err(bad(format!("mesh {axes:?} repeats an axis name")));
        }
        let mut groups = Vec::with_capacity(axes.len());
        for axis in 0..axes.len() {
            let mut mine = None;
            for g in axis_groups(&shape, axis) {
                let ranks: Vec<Rank> = g.into_iter().map(Rank).collect();
                if let Some(c) = comm.new_group(&ranks)? {
                    mine = Some(c);
                }
            }
            groups.push(mine.expect("every rank lies in exactly one group per axis"));
        }
        Ok(DeviceMesh { names: axes.iter().map(|a| a.0.to_string()).collect(), coords: coords(&shape, comm.rank().get()), shape, groups })
    }

    fn axis(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    /// The communicator of this rank's group along `name`.
    pub fn group(&self, name: &str) -> Option<&Arc<dyn Communicator>> {
        self.axis(name).map(|i| &self.groups[i])
    }

    /// This rank's coordinate along `name`.
    pub fn coord(&self, name: &str) -> Option<usize> {
        self.axis(name).map(|i| self.coords[i])
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// A group's communicator as a model sees it ([`kolo_base::GroupSum`]: summing f32 buffers,
/// as Megatron's f and g operators do), counting its all-reduces and their bytes.
pub struct SumGroup {
    comm: Arc<dyn Communicator>,
    calls: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
}

impl SumGroup {
    pub fn new(comm: Arc<dyn Communicator>) -> Arc<SumGroup> {
        Arc::new(SumGroup { comm, calls: Default::default(), bytes: Default::default() })
    }

    /// The communicator it sums over.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// All-reduces so far, and their bytes.
    pub fn traffic(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        (self.calls.load(Relaxed), self.bytes.load(Relaxed))
    }
}

impl kolo_base::GroupSum for SumGroup {
    fn rank(&self) -> usize {
        self.comm.rank().get()
    }
    fn size(&self) -> usize {
        self.comm.world_size().get()
    }
    fn sum(&self, buf: &mut [f32]) -> Result<(), String> {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.bytes.fetch_add(buf.len() as u64 * 4, Relaxed);
        self.comm.all_reduce(crate::BufMut::from(buf), crate::ReduceOp::Sum).map_err(|e| e.to_string())
    }
}

/// A group's communicator as a ring ([`kolo_base::RingShift`]: each member sends to the next
/// and receives from the previous at once), as ring attention passes key/value blocks.
pub struct Ring(pub Arc<dyn Communicator>);

/// The tag of a ring's messages.
const RING_TAG: u32 = 0x5E9;

impl kolo_base::RingShift for Ring {
    fn rank(&self) -> usize {
        self.0.rank().get()
    }
    fn size(&self) -> usize {
        self.0.world_size().get()
    }
    fn shift(&self, send: &[f32], recv: &mut [f32]) -> Result<(), String> {
        let (r, n) = (self.rank(), self.size());
        if n == 1 {
            recv.copy_from_slice(send);
            return Ok(());
        }
        self.0
            .send_recv(crate::BufRef::from(send), Rank((r + 1) % n), RING_TAG, crate::BufMut::from(recv), Rank((r + n - 1) % n), RING_TAG)
            .map_err(|e| e.to_string())
    }
}
