//! The store's request/response frames: `u32 length (LE) | body`. Decoding is total: any byte
//! string yields a value or an error, never a panic, and no frame may claim more than
//! [`MAX_FRAME`] bytes.

use crate::StoreError;
use std::io::{Read, Write};

pub const MAX_FRAME: usize = 64 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String, timeout_ms: u64 },
    Add { key: String, delta: i64 },
    Check { key: String },
    Delete { key: String },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Ok,
    Value(Vec<u8>),
    Int(i64),
    Bool(bool),
    Timeout,
    Error(String),
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.buf.len() < n {
            return Err(StoreError::Protocol(format!("frame truncated: wanted {n} more bytes, {} left", self.buf.len())));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Result<u64, StoreError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("took 8")))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, StoreError> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().expect("took 4")) as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn string(&mut self) -> Result<String, StoreError> {
        String::from_utf8(self.bytes()?).map_err(|_| StoreError::Protocol("key is not UTF-8".into()))
    }
    fn end(&self) -> Result<(), StoreError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(StoreError::Protocol(format!("{} trailing bytes in frame", self.buf.len())))
        }
    }
}

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::new();
        match self {
            Request::Set { key, value } => {
                o.push(1);
                put_bytes(&mut o, key.as_bytes());
                put_bytes(&mut o, value);
            }
            Request::Get { key, timeout_ms } => {
                o.push(2);
                put_bytes(&mut o, key.as_bytes());
                o.extend_from_slice(&timeout_ms.to_le_bytes());
            }
            Request::Add { key, delta } => {
                o.push(3);
                put_bytes(&mut o, key.as_bytes());
                o.extend_from_slice(&delta.to_le_bytes());
            }
            Request::Check { key } => {
                o.push(4);
                put_bytes(&mut o, key.as_bytes());
            }
            Request::Delete { key } => {
                o.push(5);
                put_bytes(&mut o, key.as_bytes());
            }
        }
        o
    }

    pub fn decode(body: &[u8]) -> Result<Request, StoreError> {
        let mut r = Reader { buf: body };
        let req = match r.u8()? {
            1 => Request::Set { key: r.string()?, value: r.bytes()? },
            2 => Request::Get { key: r.string()?, timeout_ms: r.u64()? },
            3 => Request::Add { key: r.string()?, delta: r.u64()? as i64 },
            4 => Request::Check { key: r.string()? },
            5 => Request::Delete { key: r.string()? },
            c => return Err(StoreError::Protocol(format!("unknown request code {c}"))),
        };
        r.end()?;
        Ok(req)
    }
}

impl Response {
    pub fn encode(&self) -> Vec<u8> {
        let mut o = Vec::new();
        match self {
            Response::Ok => o.push(1),
            Response::Value(v) => {
                o.push(2);
                put_bytes(&mut o, v);
            }
            Response::Int(i) => {
                o.push(3);
                o.extend_from_slice(&i.to_le_bytes());
            }
            Response::Bool(b) => {
                o.push(4);
                o.push(u8::from(*b));
            }
            Response::Timeout => o.push(5),
            Response::Error(m) => {
                o.push(6);
                put_bytes(&mut o, m.as_bytes());
            }
        }
        o
    }

    pub fn decode(body: &[u8]) -> Result<Response, StoreError> {
        let mut r = Reader { buf: body };
        let resp = match r.u8()? {
            1 => Response::Ok,
            2 => Response::Value(r.bytes()?),
            3 => Response::Int(r.u64()? as i64),
            4 => Response::Bool(r.u8()? != 0),
            5 => Response::Timeout,
            6 => Response::Error(String::from_utf8_lossy(&r.bytes()?).into_owned()),
            c => return Err(StoreError::Protocol(format!("unknown response code {c}"))),
        };
        r.end()?;
        Ok(resp)
    }
}

pub fn write_frame<W: Write>(w: &mut W, body: &[u8]) -> Result<(), StoreError> {
    if body.len() > MAX_FRAME {
        return Err(StoreError::Protocol(format!("frame of {} bytes exceeds the {MAX_FRAME}-byte limit", body.len())));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    Ok(())
}

/// Reads one frame; `Ok(None)` on a clean end of stream before the first byte.
pub fn read_frame<R: Read>(r: &mut R) -> Result<Option<Vec<u8>>, StoreError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(StoreError::Io("connection closed inside a frame header".into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(StoreError::Protocol(format!("peer announced a {n}-byte frame; the limit is {MAX_FRAME}")));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body)?;
    Ok(Some(body))
}
