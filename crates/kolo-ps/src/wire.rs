//! The parameter-server protocol: requests to servers and to the coordinator, and their answers.
//! Frames are `kolo_rendezvous::wire`'s (length-prefixed, 64 MiB bound); bodies are decoded
//! totally (see `codec`), so bytes off the network never cause a panic.

use crate::codec::{Reader, Writer};
use crate::{Consistency, JobSpec, PsError};
use kolo_optim::OptimizerSpec;

/// Which keys of a range a push or pull covers.
#[derive(Clone, Debug, PartialEq)]
pub enum Keys {
    /// The whole range.
    All,
    /// These offsets within the range (sorted, distinct), remembered by the server under `id`.
    List { id: u64, keys: Vec<u32> },
    /// A list sent earlier on this connection (key caching: the list is not resent).
    Cached { id: u64 },
}

/// Everything a server keeps about one range, moved whole when a range changes servers.
#[derive(Clone, Debug, PartialEq)]
pub struct RangeState {
    pub values: Vec<f32>,
    pub opt_steps: u64,
    pub opt_state: Vec<Vec<f32>>,
    /// Per worker: pushes applied (the range's vector clock).
    pub clocks: Vec<u64>,
    /// BSP: per worker, the gradient pushed for the current clock, if any.
    pub pending: Vec<Option<Vec<f32>>>,
    /// Sandblaster's named vectors of the range (id, values), which move with it.
    pub vectors: Vec<(u32, Vec<f32>)>,
    /// The number of the last vector operation applied to the range.
    pub vec_seq: u64,
}

/// Most named vectors a range may carry in a hand-over.
pub const MAX_VECTORS: u64 = 64;

#[derive(Clone, Debug, PartialEq)]
pub enum Req {
    /// Creates a range with its first values (the first `Init` wins; later ones are ignored).
    Init {
        job: JobSpec,
        epoch: u64,
        range: u32,
        values: Vec<f32>,
        fwd: bool,
    },
    /// A worker's gradient for `range` at its `clock`; `fwd` when a chain predecessor forwards it.
    Push {
        epoch: u64,
        range: u32,
        worker: u32,
        clock: u64,
        lr: f32,
        keys: Keys,
        values: Vec<f32>,
        fwd: bool,
    },
    /// Values of `range` for a worker about to compute step `clock` (waits per the consistency model).
    Pull {
        epoch: u64,
        range: u32,
        worker: u32,
        clock: u64,
        keys: Keys,
    },
    /// A whole range handed to a new chain member.
    Transfer {
        job: JobSpec,
        epoch: u64,
        range: u32,
        state: RangeState,
    },
    /// Range `range`'s whole state as a pull for step `clock` would see it (BSP: every
    /// worker's step `clock - 1` applied), for a checkpoint.
    Snapshot {
        epoch: u64,
        range: u32,
        clock: u64,
    },
    /// Replaces range `range`'s state with a checkpoint's on this server and, down the chain,
    /// on its replicas.
    Restore {
        job: JobSpec,
        epoch: u64,
        range: u32,
        state: RangeState,
        /// The same for every range and retry of one restore (applied once per range).
        id: u64,
    },
    /// Counters of this server.
    Stats,
    /// Sandblaster's vector operations on the server's ranges: `dst = a * dst + b * src` over
    /// named vectors (vector 0 is the parameters), and dot products.
    Axpby {
        epoch: u64,
        range: u32,
        /// The operation's number from its client, increasing, the same on every range and
        /// retry: a range applies each number once (an operation retried after its answer was
        /// lost is not applied twice).
        seq: u64,
        dst: u32,
        a: f64,
        src: u32,
        b: f64,
    },
    Dot {
        epoch: u64,
        range: u32,
        x: u32,
        y: u32,
    },
    /// Writes (or, with `read`, reads) a named vector of a range.
    Vector {
        epoch: u64,
        range: u32,
        id: u32,
        values: Option<Vec<f32>>,
    },
    // Coordinator requests.
    Register {
        addr: String,
    },
    Heartbeat {
        server: u32,
    },
    Membership {
        min_servers: u32,
        after_epoch: u64,
    },
    WorkerBeat {
        worker: u32,
    },
    Remove {
        server: u32,
    },
    Shutdown,
    /// Worker `by` takes over dead worker `worker`'s data shard (granted to one claimant).
    Adopt {
        worker: u32,
        by: u32,
    },
    /// Worker `worker` finished: its silence from now on is not a death.
    WorkerDone {
        worker: u32,
    },
    /// A server whose coordinator restarted (it answered with an older epoch than the server
    /// has seen) reports itself and the membership it knows, so that the new coordinator
    /// continues from it.
    Rejoin {
        server: u32,
        known: Membership,
    },
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct ServerStats {
    pub pushes: u64,
    pub pulls: u64,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// Largest `clock - min(vector clock)` any pull was answered with.
    pub max_lead: u64,
    pub ranges: u64,
    pub cached_key_lists: u64,
    pub key_bytes_saved: u64,
    pub duplicates: u64,
    /// BSP with backup workers: gradients a step went without (late workers), over all ranges.
    pub skipped: u64,
    /// By worker: milliseconds its pushes reached a range after the first push of the same
    /// step to that range, summed (the straggler measure), and the pushes counted.
    pub worker_lag_ms: Vec<f64>,
    pub worker_pushes: Vec<u64>,
    /// By worker, now: how long ago another worker pushed the step it has yet to push (the
    /// longest over the ranges; 0 when it is not behind).
    pub worker_behind_ms: Vec<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Membership {
    pub epoch: u64,
    /// Live servers: (id, address), by id.
    pub servers: Vec<(u32, String)>,
    pub shutdown: bool,
    /// Workers the coordinator has not heard from within its deadline.
    pub dead_workers: Vec<u32>,
    /// Servers the coordinator declared dead for missed heartbeats (never those removed on
    /// request). Such a server may still be alive (stopped, or cut off): its copies are older
    /// than the survivors', so when it hears this it hands nothing on (#34 item 4).
    pub dead_servers: Vec<u32>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Resp {
    Ok { duplicate: bool },
    Values { min_clock: u64, values: Vec<f32> },
    Scalar(f64),
    UnknownKeys,
    WrongEpoch { current: u64 },
    Error(String),
    Stats(Box<ServerStats>),
    Registered { id: u32, membership: Membership },
    Membership(Membership),
    State(Box<RangeState>),
}

fn put_keys(w: &mut Writer, k: &Keys) {
    match k {
        Keys::All => {
            w.u8(0);
        }
        Keys::List { id, keys } => {
            w.u8(1).u64(*id).u32s(keys);
        }
        Keys::Cached { id } => {
            w.u8(2).u64(*id);
        }
    }
}

fn get_keys(r: &mut Reader) -> Result<Keys, PsError> {
    Ok(match r.u8()? {
        0 => Keys::All,
        1 => Keys::List { id: r.u64()?, keys: r.u32s()? },
        2 => Keys::Cached { id: r.u64()? },
        t => return Err(PsError::Protocol(format!("unknown key-set tag {t}"))),
    })
}

pub(crate) fn put_job(w: &mut Writer, j: &JobSpec) {
    w.u64(j.len).u32(j.chunk).u32(j.workers).u32(j.replication).u32(j.backup);
    match j.consistency {
        Consistency::Bsp => w.u8(0).u64(0),
        Consistency::Bounded(t) => w.u8(1).u64(t),
        Consistency::Async => w.u8(2).u64(0),
    };
    match j.optimizer {
        OptimizerSpec::Sgd { momentum, nesterov, weight_decay } => w.u8(0).f32(momentum).u8(nesterov as u8).f32(weight_decay),
        OptimizerSpec::Adam { beta1, beta2, eps, weight_decay, decoupled } => {
            w.u8(1).f32(beta1).f32(beta2).f32(eps).f32(weight_decay).u8(decoupled as u8)
        }
        OptimizerSpec::Adagrad { eps, weight_decay, lr_decay } => w.u8(2).f32(eps).f32(weight_decay).f32(lr_decay),
        // A user's rule is code, not data: a server cannot run it (`JobSpec::validate` refuses it).
        OptimizerSpec::Custom { .. } => w.u8(255),
    };
}

pub(crate) fn get_job(r: &mut Reader) -> Result<JobSpec, PsError> {
    let (len, chunk, workers, replication, backup) = (r.u64()?, r.u32()?, r.u32()?, r.u32()?, r.u32()?);
    let consistency = match (r.u8()?, r.u64()?) {
        (0, _) => Consistency::Bsp,
        (1, t) => Consistency::Bounded(t),
        (2, _) => Consistency::Async,
        (t, _) => return Err(PsError::Protocol(format!("unknown consistency tag {t}"))),
    };
    let optimizer = match r.u8()? {
        0 => OptimizerSpec::Sgd { momentum: r.f32()?, nesterov: r.u8()? != 0, weight_decay: r.f32()? },
        1 => OptimizerSpec::Adam { beta1: r.f32()?, beta2: r.f32()?, eps: r.f32()?, weight_decay: r.f32()?, decoupled: r.u8()? != 0 },
        2 => OptimizerSpec::Adagrad { eps: r.f32()?, weight_decay: r.f32()?, lr_decay: r.f32()? },
        t => return Err(PsError::Protocol(format!("unknown optimizer tag {t}"))),
    };
    let job = JobSpec { len, chunk, workers, replication, backup, consistency, optimizer };
    job.validate()?;
    Ok(job)
}

fn put_state(w: &mut Writer, s: &RangeState) {
    w.f32s(&s.values).u64(s.opt_steps).u64(s.opt_state.len() as u64);
    for b in &s.opt_state {
        w.f32s(b);
    }
    w.u64s(&s.clocks).u64(s.pending.len() as u64);
    for p in &s.pending {
        match p {
            Some(v) => w.u8(1).f32s(v),
            None => w.u8(0),
        };
    }
    w.u64(s.vectors.len() as u64);
    for (id, v) in &s.vectors {
        w.u32(*id).f32s(v);
    }
    w.u64(s.vec_seq);
}

fn get_state(r: &mut Reader) -> Result<RangeState, PsError> {
    let values = r.f32s()?;
    let opt_steps = r.u64()?;
    let n = r.u64()?;
    if n > 4 {
        return Err(PsError::Protocol(format!("{n} optimizer state buffers (at most 4)")));
    }
    let opt_state = (0..n).map(|_| r.f32s()).collect::<Result<_, _>>()?;
    let clocks = r.u64s()?;
    let np = r.u64()?;
    if np > clocks.len() as u64 {
        return Err(PsError::Protocol("more pending gradients than workers".into()));
    }
    let pending = (0..np).map(|_| Ok(if r.u8()? == 1 { Some(r.f32s()?) } else { None })).collect::<Result<_, PsError>>()?;
    let nv = r.u64()?;
    if nv > MAX_VECTORS {
        return Err(PsError::Protocol(format!("{nv} named vectors in a range (at most {MAX_VECTORS})")));
    }
    let vectors = (0..nv).map(|_| Ok((r.u32()?, r.f32s()?))).collect::<Result<_, PsError>>()?;
    let vec_seq = r.u64()?;
    Ok(RangeState { values, opt_steps, opt_state, clocks, pending, vectors, vec_seq })
}

fn put_membership(w: &mut Writer, m: &Membership) {
    w.u64(m.epoch).u64(m.servers.len() as u64);
    for (id, addr) in &m.servers {
        w.u32(*id).str(addr);
    }
    w.u8(m.shutdown as u8);
    w.u32s(&m.dead_workers);
    w.u32s(&m.dead_servers);
}

fn get_membership(r: &mut Reader) -> Result<Membership, PsError> {
    let epoch = r.u64()?;
    let n = r.u64()?;
    if n > 4096 {
        return Err(PsError::Protocol(format!("{n} servers in a membership (at most 4096)")));
    }
    let servers = (0..n).map(|_| Ok((r.u32()?, r.str()?))).collect::<Result<_, PsError>>()?;
    Ok(Membership { epoch, servers, shutdown: r.u8()? != 0, dead_workers: r.u32s()?, dead_servers: r.u32s()? })
}

impl Req {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Req::Init { job, epoch, range, values, fwd } => {
                w.u8(1);
                put_job(&mut w, job);
                w.u64(*epoch).u32(*range).f32s(values).u8(*fwd as u8);
            }
            Req::Push { epoch, range, worker, clock, lr, keys, values, fwd } => {
                w.u8(2).u64(*epoch).u32(*range).u32(*worker).u64(*clock).f32(*lr);
                put_keys(&mut w, keys);
                w.f32s(values).u8(*fwd as u8);
            }
            Req::Pull { epoch, range, worker, clock, keys } => {
                w.u8(3).u64(*epoch).u32(*range).u32(*worker).u64(*clock);
                put_keys(&mut w, keys);
            }
            Req::Transfer { job, epoch, range, state } => {
                w.u8(4);
                put_job(&mut w, job);
                w.u64(*epoch).u32(*range);
                put_state(&mut w, state);
            }
            Req::Stats => {
                w.u8(5);
            }
            Req::Snapshot { epoch, range, clock } => {
                w.u8(9).u64(*epoch).u32(*range).u64(*clock);
            }
            Req::Restore { job, epoch, range, state, id } => {
                w.u8(10);
                put_job(&mut w, job);
                w.u64(*epoch).u32(*range);
                put_state(&mut w, state);
                w.u64(*id);
            }
            Req::Axpby { epoch, range, seq, dst, a, src, b } => {
                w.u8(6).u64(*epoch).u32(*range).u64(*seq).u32(*dst).f64(*a).u32(*src).f64(*b);
            }
            Req::Dot { epoch, range, x, y } => {
                w.u8(7).u64(*epoch).u32(*range).u32(*x).u32(*y);
            }
            Req::Vector { epoch, range, id, values } => {
                w.u8(8).u64(*epoch).u32(*range).u32(*id);
                match values {
                    Some(v) => w.u8(1).f32s(v),
                    None => w.u8(0),
                };
            }
            Req::Register { addr } => {
                w.u8(20).str(addr);
            }
            Req::Heartbeat { server } => {
                w.u8(21).u32(*server);
            }
            Req::Membership { min_servers, after_epoch } => {
                w.u8(22).u32(*min_servers).u64(*after_epoch);
            }
            Req::WorkerBeat { worker } => {
                w.u8(23).u32(*worker);
            }
            Req::Remove { server } => {
                w.u8(24).u32(*server);
            }
            Req::Shutdown => {
                w.u8(25);
            }
            Req::Adopt { worker, by } => {
                w.u8(26).u32(*worker).u32(*by);
            }
            Req::WorkerDone { worker } => {
                w.u8(27).u32(*worker);
            }
            Req::Rejoin { server, known } => {
                w.u8(28).u32(*server);
                put_membership(&mut w, known);
            }
        }
        w.0
    }

    pub fn decode(body: &[u8]) -> Result<Req, PsError> {
        let mut r = Reader::new(body);
        let req = match r.u8()? {
            1 => Req::Init { job: get_job(&mut r)?, epoch: r.u64()?, range: r.u32()?, values: r.f32s()?, fwd: r.u8()? != 0 },
            2 => Req::Push {
                epoch: r.u64()?,
                range: r.u32()?,
                worker: r.u32()?,
                clock: r.u64()?,
                lr: r.f32()?,
                keys: get_keys(&mut r)?,
                values: r.f32s()?,
                fwd: r.u8()? != 0,
            },
            3 => Req::Pull { epoch: r.u64()?, range: r.u32()?, worker: r.u32()?, clock: r.u64()?, keys: get_keys(&mut r)? },
            4 => Req::Transfer { job: get_job(&mut r)?, epoch: r.u64()?, range: r.u32()?, state: get_state(&mut r)? },
            5 => Req::Stats,
            9 => Req::Snapshot { epoch: r.u64()?, range: r.u32()?, clock: r.u64()? },
            10 => Req::Restore { job: get_job(&mut r)?, epoch: r.u64()?, range: r.u32()?, state: get_state(&mut r)?, id: r.u64()? },
            6 => Req::Axpby { epoch: r.u64()?, range: r.u32()?, seq: r.u64()?, dst: r.u32()?, a: r.f64()?, src: r.u32()?, b: r.f64()? },
            7 => Req::Dot { epoch: r.u64()?, range: r.u32()?, x: r.u32()?, y: r.u32()? },
            8 => Req::Vector { epoch: r.u64()?, range: r.u32()?, id: r.u32()?, values: if r.u8()? == 1 { Some(r.f32s()?) } else { None } },
            20 => Req::Register { addr: r.str()? },
            21 => Req::Heartbeat { server: r.u32()? },
            22 => Req::Membership { min_servers: r.u32()?, after_epoch: r.u64()? },
            23 => Req::WorkerBeat { worker: r.u32()? },
            24 => Req::Remove { server: r.u32()? },
            25 => Req::Shutdown,
            26 => Req::Adopt { worker: r.u32()?, by: r.u32()? },
            27 => Req::WorkerDone { worker: r.u32()? },
            28 => Req::Rejoin { server: r.u32()?, known: get_membership(&mut r)? },
            t => return Err(PsError::Protocol(format!("unknown request code {t}"))),
        };
        r.end()?;
        Ok(req)
    }
}

impl Resp {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Resp::Ok { duplicate } => {
                w.u8(1).u8(*duplicate as u8);
            }
            Resp::Values { min_clock, values } => {
                w.u8(2).u64(*min_clock).f32s(values);
            }
            Resp::Scalar(v) => {
                w.u8(3).f64(*v);
            }
            Resp::UnknownKeys => {
                w.u8(4);
            }
            Resp::WrongEpoch { current } => {
                w.u8(5).u64(*current);
            }
            Resp::Error(e) => {
                w.u8(6).str(e);
            }
            Resp::Stats(s) => {
                w.u8(7)
                    .u64(s.pushes)
                    .u64(s.pulls)
                    .u64(s.bytes_in)
                    .u64(s.bytes_out)
                    .u64(s.max_lead)
                    .u64(s.ranges)
                    .u64(s.cached_key_lists)
                    .u64(s.key_bytes_saved)
                    .u64(s.duplicates)
                    .u64(s.skipped)
                    .u64s(&s.worker_pushes)
                    .u64s(&s.worker_lag_ms.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                    .u64s(&s.worker_behind_ms.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            Resp::Registered { id, membership } => {
                w.u8(8).u32(*id);
                put_membership(&mut w, membership);
            }
            Resp::Membership(m) => {
                w.u8(9);
                put_membership(&mut w, m);
            }
            Resp::State(st) => {
                w.u8(10);
                put_state(&mut w, st);
            }
        }
        w.0
    }

    pub fn decode(body: &[u8]) -> Result<Resp, PsError> {
        let mut r = Reader::new(body);
        let resp = match r.u8()? {
            1 => Resp::Ok { duplicate: r.u8()? != 0 },
            2 => Resp::Values { min_clock: r.u64()?, values: r.f32s()? },
            3 => Resp::Scalar(r.f64()?),
            4 => Resp::UnknownKeys,
            5 => Resp::WrongEpoch { current: r.u64()? },
            6 => Resp::Error(r.str()?),
            7 => Resp::Stats(Box::new(ServerStats {
                pushes: r.u64()?,
                pulls: r.u64()?,
                bytes_in: r.u64()?,
                bytes_out: r.u64()?,
                max_lead: r.u64()?,
                ranges: r.u64()?,
                cached_key_lists: r.u64()?,
                key_bytes_saved: r.u64()?,
                duplicates: r.u64()?,
                skipped: r.u64()?,
                worker_pushes: r.u64s()?,
                worker_lag_ms: r.u64s()?.into_iter().map(f64::from_bits).collect(),
                worker_behind_ms: r.u64s()?.into_iter().map(f64::from_bits).collect(),
            })),
            8 => Resp::Registered { id: r.u32()?, membership: get_membership(&mut r)? },
            9 => Resp::Membership(get_membership(&mut r)?),
            10 => Resp::State(Box::new(get_state(&mut r)?)),
            t => return Err(PsError::Protocol(format!("unknown response code {t}"))),
        };
        r.end()?;
        Ok(resp)
    }
}
