//! Secure aggregation by pairwise masking (Bonawitz et al., without the dropout recovery): each
//! client holds an X25519 key pair; for every other client j of the round's cohort, client i
//! derives a 256-bit key from their shared secret (with the round, the attempt and both ids),
//! expands it with ChaCha20 into a mask vector, adds it when i < j and subtracts it when i > j.
//! Values travel as fixed-point integers modulo 2^64, so the masks cancel exactly in the
//! server's sum and each single update looks random.
//!
//! Threat model: an honest-but-curious server and eavesdroppers learn only the sum of a cohort
//! of at least [`MIN_COHORT`] clients (each client checks its cohort: [`check_cohort`]); a
//! client can submit only under the id its connection joined with. A server that hands a client
//! public keys of its own making (to remove that client's masks) is caught when the job has
//! client identities ([`crate::identity`]): every key is then signed by its member.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;
use sha2::{Digest, Sha256};
use x25519_dalek::{PublicKey, StaticSecret};

/// Fixed-point scale: 2^24 units per 1.0 (values up to ~5e11 sum without overflow).
pub const SCALE: f64 = (1u64 << 24) as f64;

pub struct KeyPair {
    secret: StaticSecret,
    pub public: [u8; 32],
}

impl KeyPair {
    /// A fresh key pair from the OS random source.
    pub fn generate() -> KeyPair {
        let mut b = [0u8; 32];
        getrandom::getrandom(&mut b).expect("the OS random source failed");
        KeyPair::from_bytes(b)
    }

    pub fn from_bytes(b: [u8; 32]) -> KeyPair {
        let secret = StaticSecret::from(b);
        let public = PublicKey::from(&secret).to_bytes();
        KeyPair { secret, public }
    }

    /// The mask key client `me` shares with client `them` (holder of `their` public key) for
    /// `(round, attempt)`: SHA-256 over their X25519 shared secret, the round, the attempt and
    /// both ids (smaller first), so both ends derive the same key and no two pairs or rounds do.
    pub fn pair_key(&self, me: u32, them: u32, their: &[u8; 32], round: u32, attempt: u32) -> [u8; 32] {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*their));
        let mut h = Sha256::new();
        h.update(b"kolo-fed-mask-v2");
        h.update(shared.as_bytes());
        h.update(round.to_le_bytes());
        h.update(attempt.to_le_bytes());
        h.update(me.min(them).to_le_bytes());
        h.update(me.max(them).to_le_bytes());
        h.finalize().into()
    }
}

/// The smallest cohort a client masks for: with two, each member learns the other's update
/// from the sum; with one, the update is sent in the clear.
pub const MIN_COHORT: usize = 3;

/// A client's check of the cohort the server sent before it masks for it: at least `min`
/// members, distinct ids and distinct keys, and the client itself (`me`) under its own key.
pub fn check_cohort(cohort: &[(u32, [u8; 32])], me: u32, mine: &[u8; 32], min: usize) -> Result<(), String> {
    if cohort.len() < min {
        return Err(format!("a secure cohort of {} member(s); this client masks only for {min} or more", cohort.len()));
    }
    match cohort.iter().find(|(id, _)| *id == me) {
        None => return Err(format!("the cohort does not list this client ({me})")),
        Some((_, key)) if key != mine => return Err(format!("the cohort lists client {me} under a public key that is not its own")),
        Some(_) => {}
    }
    for (i, (id, key)) in cohort.iter().enumerate() {
        if let Some((other, _)) = cohort[..i].iter().find(|(o, k)| o == id || k == key) {
            return Err(format!("the cohort lists client {id} twice or shares its public key with client {other}"));
        }
    }
    Ok(())
}

/// One value as a fixed-point integer modulo 2^64.
pub fn encode(v: f64) -> u64 {
    (v * SCALE).round() as i64 as u64
}

/// A sum of encoded values back to a float.
pub fn decode(v: u64) -> f64 {
    v as i64 as f64 / SCALE
}

/// Encodes `values` and adds this client's masks for the cohort (`me` is its id; `cohort`
/// lists every member's id and public key, itself included).
pub fn mask(values: &[f64], keys: &KeyPair, me: u32, cohort: &[(u32, [u8; 32])], round: u32, attempt: u32) -> Vec<u64> {
    let mut out: Vec<u64> = values.iter().map(|&v| encode(v)).collect();
    for (id, public) in cohort {
        if *id == me {
            continue;
        }
        let mut rng = ChaCha20Rng::from_seed(keys.pair_key(me, *id, public, round, attempt));
        for o in out.iter_mut() {
            let m = rng.next_u64();
            *o = if me < *id { o.wrapping_add(m) } else { o.wrapping_sub(m) };
        }
    }
    out
}

/// The server's side: the element-wise sum of masked vectors modulo 2^64, decoded.
pub fn unmask_sum(updates: &[&[u64]]) -> Vec<f64> {
    let n = updates.first().map_or(0, |u| u.len());
    let mut sum = vec![0u64; n];
    for u in updates {
        for (s, v) in sum.iter_mut().zip(u.iter()) {
            *s = s.wrapping_add(*v);
        }
    }
    sum.into_iter().map(decode).collect()
}
