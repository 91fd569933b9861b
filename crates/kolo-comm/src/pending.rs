//! Asynchronous collectives: a worker thread runs submitted operations in submission order, and
//! each submission returns a [`Pending`] handle. This is how communication overlaps compute (DDP's
//! bucket all-reduces run here while backward goes on).

use crate::{BufMut, CommError, Communicator, Element, OpKind, ReduceOp};
use kolo_base::{Deadline, Rank};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a timed-out [`Pending::wait`] still waits for the operation's own error (which
/// carries the sequence number and the ranks that never arrived).
const DIAGNOSIS_GRACE: Duration = Duration::from_secs(5);

/// The result of an operation that may still be running. Dropping it does not cancel the
/// operation (other ranks are taking part in it); it only discards the result.
#[must_use = "a Pending result must be waited on, or the error it carries is lost"]
pub struct Pending<T> {
    rx: Receiver<Result<T, CommError>>,
    op: OpKind,
    rank: Rank,
}

impl<T> Pending<T> {
    /// An already finished operation.
    pub fn ready(op: OpKind, rank: Rank, result: Result<T, CommError>) -> Pending<T> {
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(result);
        Pending { rx, op, rank }
    }

    /// Blocks until the operation finishes or `deadline` passes.
    pub fn wait(self, deadline: Deadline) -> Result<T, CommError> {
        match self.rx.recv_timeout(deadline.remaining()) {
            Ok(r) => r,
            Err(RecvTimeoutError::Timeout) => {
                // The operation has its own deadline (the communicator's), after which a hang
                // diagnosis names the ranks that never arrived (issue #19: this wait used to
                // expire first and report `#0 ... waiting for rank(s) []`). Its error says more
                // than ours can: give it a little longer.
                match self.rx.recv_timeout(DIAGNOSIS_GRACE) {
                    Ok(r) => r,
                    Err(_) => {
                        Err(CommError::Timeout { op: self.op, rank: self.rank, seq: 0, waited: deadline.budget(), missing: Vec::new() })
                    }
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                Err(CommError::Setup { op: self.op, rank: self.rank, what: "the communication worker thread is gone".into() })
            }
        }
    }
}

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// Wraps a communicator with a FIFO worker thread for asynchronous operations. All operations on
/// the wrapped communicator must go through this wrapper while it exists, so that every rank
/// issues them in the same order.
pub struct AsyncComm {
    comm: Arc<dyn Communicator>,
    tx: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl AsyncComm {
    pub fn new(comm: Arc<dyn Communicator>) -> AsyncComm {
        let (tx, rx) = mpsc::channel::<Job>();
        let c = comm.clone();
        let worker = std::thread::Builder::new()
            .name(format!("kolo-comm-r{}", comm.rank()))
            .spawn(move || {
                for job in rx {
                    job(&*c);
                }
            })
            .expect("spawning the communication thread");
        AsyncComm { comm, tx: Some(tx), worker: Some(worker) }
    }

    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Queues `f` behind every earlier submission.
    pub fn submit<R, F>(&self, op: OpKind, f: F) -> Pending<R>
    where
        R: Send + 'static,
        F: FnOnce(&dyn Communicator) -> Result<R, CommError> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let job: Job = Box::new(move |c| {
            let _ = tx.send(f(c));
        });
        let rank = self.comm.rank();
        if self.tx.as_ref().map(|t| t.send(job)).is_none_or(|r| r.is_err()) {
            return Pending::ready(op, rank, Err(CommError::Setup { op, rank, what: "the communication worker thread is gone".into() }));
        }
        Pending { rx, op, rank }
    }

    /// All-reduces an owned buffer in the background and hands it back.
    pub fn all_reduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Pending<Vec<T>> {
        self.submit(OpKind::AllReduce, move |c| {
            c.all_reduce(BufMut::from(&mut buf), op)?;
            Ok(buf)
        })
    }

    /// Broadcasts an owned buffer in the background.
    pub fn broadcast<T: Element>(&self, mut buf: Vec<T>, root: Rank) -> Pending<Vec<T>> {
        self.submit(OpKind::Broadcast, move |c| {
            c.broadcast(BufMut::from(&mut buf), root)?;
            Ok(buf)
        })
    }

    /// Waits until every operation submitted so far has finished.
    pub fn flush(&self, deadline: Deadline) -> Result<(), CommError> {
        self.submit(OpKind::Barrier, |_| Ok(())).wait(deadline)
    }
}

impl Drop for AsyncComm {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
