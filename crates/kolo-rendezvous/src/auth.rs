//! The job token and the mutual challenge-response handshake.
//!
//! Both sides prove they know the token without sending it: the client sends a fresh nonce, the
//! server answers with its own nonce and `HMAC(token, "kolo-server" | purpose | client_nonce |
//! server_nonce)`, the client checks it and answers with `HMAC(token, "kolo-client" | …)`. A
//! recorded exchange cannot be replayed because each side picks a fresh nonce. `purpose` binds the
//! handshake to what the connection is for (the store, or a peer link of a given group and rank
//! pair), so a connection meant for one thing cannot be redirected to another.

use crate::StoreError;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;
use std::io::{Read, Write};

const MAGIC: &[u8; 4] = b"KOLO";
const VERSION: u8 = 1;
const NONCE: usize = 32;
const MAC: usize = 32;
/// Longest `purpose` string accepted; bounds what a stranger can make us allocate.
const MAX_PURPOSE: usize = 256;

/// The secret shared by all ranks of one job.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl JobToken {
    /// 32 random bytes from the operating system.
    pub fn generate() -> JobToken {
        let mut b = vec![0u8; 32];
        getrandom::getrandom(&mut b).expect("the OS random source failed");
        JobToken(b)
    }

    pub fn from_hex(s: &str) -> Result<JobToken, String> {
        let s = s.trim();
        // Checked before slicing: a byte index inside a multi-byte character would panic.
        if !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("a job token must be hex digits only".into());
        }
        if s.len() < 16 || !s.len().is_multiple_of(2) {
            return Err("a job token is an even number of hex digits, at least 16".into());
        }
        let bytes = (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| "a job token must be hex digits only".to_string())?;
        Ok(JobToken(bytes))
    }

    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn mac(&self, parts: &[&[u8]]) -> [u8; MAC] {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes any key length");
        for p in parts {
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m.finalize().into_bytes().into()
    }
}

impl fmt::Debug for JobToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    getrandom::getrandom(&mut n).expect("the OS random source failed");
    n
}

/// Constant-time comparison so the check does not leak how many MAC bytes matched.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// How a handshake that the server hung up on before its challenge begins: a server at its
/// limit of connections in authentication turns new ones away like that, so the client tries
/// again until its deadline (a wrong token fails later, at the proofs, and is not retried).
/// How a handshake fails when the listener turned the connection away before its challenge
/// (at its limit of connections in authentication, under a flood): worth another try.
pub const NO_CHALLENGE: &str = "no challenge from server";

fn auth_err(peer: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Auth { peer: peer.to_string(), reason: reason.into() }
}

/// Client side. `stream` must already have read/write timeouts set (the handshake's deadline).
pub fn client_handshake<S: Read + Write>(stream: &mut S, token: &JobToken, purpose: &str, peer: &str) -> Result<(), StoreError> {
    if purpose.len() > MAX_PURPOSE {
        return Err(auth_err(peer, "purpose string too long"));
    }
    let cn = nonce();
    let mut hello = Vec::with_capacity(4 + 1 + 2 + purpose.len() + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.push(VERSION);
    hello.extend_from_slice(&(purpose.len() as u16).to_le_bytes());
    hello.extend_from_slice(purpose.as_bytes());
    hello.extend_from_slice(&cn);
    stream.write_all(&hello).map_err(|e| auth_err(peer, format!("sending hello: {e}")))?;

    let mut reply = [0u8; 1 + NONCE + MAC];
    stream.read_exact(&mut reply).map_err(|e| auth_err(peer, format!("{NO_CHALLENGE} ({e}); is it a Kolo endpoint of this job?")))?;
    if reply[0] != 1 {
        return Err(auth_err(peer, "the server refused the hello (version or purpose mismatch)"));
    }
    let sn = &reply[1..1 + NONCE];
    let smac = &reply[1 + NONCE..];
    let cmac = token.mac(&[b"kolo-client", purpose.as_bytes(), sn, &cn]);
    if !same(smac, &token.mac(&[b"kolo-server", purpose.as_bytes(), &cn, sn])) {
        // Still send our proof: the server then sees a Kolo process with another token (and can
        // tell the job why a rank is missing) rather than a dropped connection. A MAC over the
        // server's nonce reveals nothing about our token.
        let _ = stream.write_all(&cmac);
        return Err(auth_err(peer, "the server does not know this job's token"));
    }
    stream.write_all(&cmac).map_err(|e| auth_err(peer, format!("sending proof: {e}")))?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).map_err(|e| auth_err(peer, format!("waiting for verdict: {e}")))?;
    if verdict[0] != 1 {
        return Err(auth_err(peer, "the server rejected our token"));
    }
    Ok(())
}

/// Server side. Returns the purpose string the client asked for (after proving the token).
/// `expected_purpose`, when given, must match exactly.
pub fn server_handshake<S: Read + Write>(
    stream: &mut S,
    token: &JobToken,
    expected_purpose: Option<&str>,
    peer: &str,
) -> Result<String, StoreError> {
    let mut head = [0u8; 7];
    stream.read_exact(&mut head).map_err(|e| auth_err(peer, format!("reading hello: {e}")))?;
    if &head[..4] != MAGIC {
        return Err(auth_err(peer, "not a Kolo hello (bad magic)"));
    }
    let refuse = |stream: &mut S, why: String| {
        let _ = stream.write_all(&[0u8; 1 + NONCE + MAC]);
        Err(auth_err(peer, why))
    };
    if head[4] != VERSION {
        return refuse(stream, format!("protocol version {} (expected {VERSION})", head[4]));
    }
    let plen = u16::from_le_bytes([head[5], head[6]]) as usize;
    if plen > MAX_PURPOSE {
        return Err(auth_err(peer, format!("purpose of {plen} bytes exceeds {MAX_PURPOSE}")));
    }
    let mut rest = vec![0u8; plen + NONCE];
    stream.read_exact(&mut rest).map_err(|e| auth_err(peer, format!("reading hello: {e}")))?;
    let purpose = String::from_utf8(rest[..plen].to_vec()).map_err(|_| auth_err(peer, "purpose is not UTF-8"))?;
    if let Some(want) = expected_purpose {
        if purpose != want {
            return refuse(stream, format!("asked for `{purpose}`, this endpoint serves `{want}`"));
        }
    }
    let cn = &rest[plen..];
    let sn = nonce();
    let mut reply = Vec::with_capacity(1 + NONCE + MAC);
    reply.push(1);
    reply.extend_from_slice(&sn);
    reply.extend_from_slice(&token.mac(&[b"kolo-server", purpose.as_bytes(), cn, &sn]));
    stream.write_all(&reply).map_err(|e| auth_err(peer, format!("sending challenge: {e}")))?;
    let mut cmac = [0u8; MAC];
    stream.read_exact(&mut cmac).map_err(|e| auth_err(peer, format!("reading proof: {e}")))?;
    if !same(&cmac, &token.mac(&[b"kolo-client", purpose.as_bytes(), &sn, cn])) {
        let _ = stream.write_all(&[0]);
        return Err(auth_err(peer, "wrong job token"));
    }
    stream.write_all(&[1]).map_err(|e| auth_err(peer, format!("sending verdict: {e}")))?;
    Ok(purpose)
}
