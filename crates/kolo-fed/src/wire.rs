//! The federated-averaging messages (client requests, server answers), over the parameter
//! servers' authenticated request/response connections (handshake purpose "fed").

use kolo_ps::codec::{Reader, Writer};
use kolo_ps::PsError;

/// What a client sends.
#[derive(Clone, Debug, PartialEq)]
pub enum Req {
    /// Join the job with this many training examples (and, for secure aggregation, a public key),
    /// as client `id` when given (its shard number: sampling is then the same in every run),
    /// else as the next free id. `sig`: the client's identity signature of `public`, when the
    /// job has a roster (`crate::identity`).
    Join { examples: u64, public: Option<[u8; 32]>, id: Option<u32>, sig: Option<[u8; 64]> },
    /// What should client `id` do now? (The server holds the answer up to a second.)
    Poll { id: u32 },
    /// Client `id`'s update for `(round, attempt)`: trained on `examples` examples.
    Update { id: u32, round: u32, attempt: u32, examples: u64, update: Update },
    /// Client `id` has the final model and leaves (the server closes once every client did).
    Bye { id: u32 },
}

/// A model update: the change of the parameters, plain, or (secure aggregation) the change
/// times the example count as masked fixed-point integers.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    Plain(Vec<f32>),
    Masked(Vec<u64>),
}

/// What the server answers.
#[derive(Clone, Debug, PartialEq)]
pub enum Resp {
    Joined {
        id: u32,
        numel: u64,
        secure: bool,
    },
    /// Nothing to do yet: poll again.
    Wait,
    /// Train from `params` and send an update for `(round, attempt)`. `cohort` lists the ids and
    /// public keys of every client of this attempt (secure aggregation; empty otherwise), and
    /// `sigs` each one's identity signature of its key (jobs with a roster; empty otherwise).
    Train {
        round: u32,
        attempt: u32,
        params: Vec<f32>,
        cohort: Vec<(u32, [u8; 32])>,
        sigs: Vec<[u8; 64]>,
    },
    /// The job is over: the final model.
    Done {
        rounds: u32,
        params: Vec<f32>,
    },
    /// An update was taken (`true`) or came too late / for another round (`false`, why).
    Ack {
        taken: bool,
        why: String,
    },
    Error(String),
}

impl Req {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Req::Join { examples, public, id, sig } => {
                w.u8(1).u64(*examples);
                match public {
                    Some(k) => w.u8(1).array(k),
                    None => w.u8(0),
                };
                match id {
                    Some(i) => w.u8(1).u32(*i),
                    None => w.u8(0),
                };
                match sig {
                    Some(s) => w.u8(1).array(s),
                    None => w.u8(0),
                };
            }
            Req::Poll { id } => {
                w.u8(2).u32(*id);
            }
            Req::Update { id, round, attempt, examples, update } => {
                w.u8(3).u32(*id).u32(*round).u32(*attempt).u64(*examples);
                match update {
                    Update::Plain(v) => w.u8(0).f32s(v),
                    Update::Masked(v) => w.u8(1).u64s(v),
                };
            }
            Req::Bye { id } => {
                w.u8(4).u32(*id);
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Req, PsError> {
        let mut r = Reader::new(b);
        let req = match r.u8()? {
            1 => {
                let examples = r.u64()?;
                let public = match r.u8()? {
                    0 => None,
                    1 => Some(r.array::<32>()?),
                    t => return Err(PsError::Protocol(format!("join: key tag {t}"))),
                };
                let id = match r.u8()? {
                    0 => None,
                    1 => Some(r.u32()?),
                    t => return Err(PsError::Protocol(format!("join: id tag {t}"))),
                };
                let sig = match r.u8()? {
                    0 => None,
                    1 => Some(r.array::<64>()?),
                    t => return Err(PsError::Protocol(format!("join: signature tag {t}"))),
                };
                Req::Join { examples, public, id, sig }
            }
            2 => Req::Poll { id: r.u32()? },
            3 => {
                let (id, round, attempt, examples) = (r.u32()?, r.u32()?, r.u32()?, r.u64()?);
                let update = match r.u8()? {
                    0 => Update::Plain(r.f32s()?),
                    1 => Update::Masked(r.u64s()?),
                    t => return Err(PsError::Protocol(format!("update: payload tag {t}"))),
                };
                Req::Update { id, round, attempt, examples, update }
            }
            4 => Req::Bye { id: r.u32()? },
            t => return Err(PsError::Protocol(format!("unknown federated request tag {t}"))),
        };
        r.end()?;
        Ok(req)
    }
}

impl Resp {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        match self {
            Resp::Joined { id, numel, secure } => {
                w.u8(1).u32(*id).u64(*numel).u8(u8::from(*secure));
            }
            Resp::Wait => {
                w.u8(2);
            }
            Resp::Train { round, attempt, params, cohort, sigs } => {
                w.u8(3).u32(*round).u32(*attempt).f32s(params).u64(cohort.len() as u64);
                for (id, k) in cohort {
                    w.u32(*id).array(k);
                }
                w.u64(sigs.len() as u64);
                for s in sigs {
                    w.array(s);
                }
            }
            Resp::Done { rounds, params } => {
                w.u8(4).u32(*rounds).f32s(params);
            }
            Resp::Ack { taken, why } => {
                w.u8(5).u8(u8::from(*taken)).str(why);
            }
            Resp::Error(m) => {
                w.u8(6).str(m);
            }
        }
        w.0
    }

    pub fn decode(b: &[u8]) -> Result<Resp, PsError> {
        let mut r = Reader::new(b);
        let resp = match r.u8()? {
            1 => Resp::Joined { id: r.u32()?, numel: r.u64()?, secure: r.u8()? != 0 },
            2 => Resp::Wait,
            3 => {
                let (round, attempt, params) = (r.u32()?, r.u32()?, r.f32s()?);
                let n = r.u64()?;
                if n > (b.len() / 36) as u64 {
                    return Err(PsError::Protocol(format!("a cohort of {n} does not fit in the message")));
                }
                let cohort = (0..n).map(|_| Ok((r.u32()?, r.array::<32>()?))).collect::<Result<_, PsError>>()?;
                let n = r.u64()?;
                if n > (b.len() / 64) as u64 {
                    return Err(PsError::Protocol(format!("{n} signatures do not fit in the message")));
                }
                let sigs = (0..n).map(|_| r.array::<64>()).collect::<Result<_, PsError>>()?;
                Resp::Train { round, attempt, params, cohort, sigs }
            }
            4 => Resp::Done { rounds: r.u32()?, params: r.f32s()? },
            5 => Resp::Ack { taken: r.u8()? != 0, why: r.str()? },
            6 => Resp::Error(r.str()?),
            t => return Err(PsError::Protocol(format!("unknown federated answer tag {t}"))),
        };
        r.end()?;
        Ok(resp)
    }
}

kolo_ps::protocol!(
    /// The federated-averaging protocol for `kolo_ps::net`.
    Fed, "fed", Req, Resp, Resp::Error
);
