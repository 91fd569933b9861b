//! Secure aggregation by pairwise masking (Bonawitz et al., without the dropout recovery): each
//! client holds an X25519 key pair; for every other client j of the round's cohort, client i
//! derives a seed from their shared secret (and the round), expands it into a mask vector, adds
//! it when i < j and subtracts it when i > j. Values travel as fixed-point integers modulo 2^64,
//! so the masks cancel exactly in the server's sum and each single update looks random.

use kolo_base::Rng;
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

    /// The seed this client shares with the holder of `their` public key for `(round, attempt)`.
    pub fn pair_seed(&self, their: &[u8; 32], round: u32, attempt: u32) -> u64 {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*their));
        let mut h = Sha256::new();
        h.update(b"kolo-fed-mask");
        h.update(shared.as_bytes());
        h.update(round.to_le_bytes());
        h.update(attempt.to_le_bytes());
        u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
    }
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
        let mut rng = Rng::new(keys.pair_seed(public, round, attempt));
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
