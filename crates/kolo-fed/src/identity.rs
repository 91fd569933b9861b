//! Client identities for secure aggregation against a server that lies about keys.
//!
//! Each client of a job holds a long-term Ed25519 signing key; every member (and the server)
//! holds the roster of the clients' verifying keys, distributed out of band (`kolo fed keygen`
//! writes both). A client signs the X25519 key it joins with, together with its id; the server
//! checks the signature at join (so nobody joins as another client) and hands the signatures
//! out with the cohort; each client checks every member's key against the roster before it
//! masks. A server that substitutes a member's key (to strip a client's masks) cannot sign the
//! substitute, so the client refuses, unsent.

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use std::collections::BTreeMap;
use std::path::Path;

/// What a client signs: its id and the X25519 key it masks with in this job.
fn signed_bytes(id: u32, public: &[u8; 32]) -> Vec<u8> {
    let mut m = b"kolo-fed-key-v1".to_vec();
    m.extend(id.to_le_bytes());
    m.extend(public);
    m
}

/// A client's long-term signing key.
pub struct Identity {
    pub id: u32,
    key: SigningKey,
}

impl Identity {
    /// A fresh identity from the OS random source.
    pub fn generate(id: u32) -> Identity {
        let mut seed = [0u8; 32];
        getrandom::getrandom(&mut seed).expect("the OS random source failed");
        Identity { id, key: SigningKey::from_bytes(&seed) }
    }

    /// The key others verify this client's signatures with.
    pub fn verifying(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    /// The signature of `public` (the X25519 key this client joins with) under this identity.
    pub fn sign_key(&self, public: &[u8; 32]) -> [u8; 64] {
        self.key.sign(&signed_bytes(self.id, public)).to_bytes()
    }

    /// Reads `client-{id}.key` of `dir` (the secret seed, hex).
    pub fn load(dir: &Path, id: u32) -> Result<Identity, String> {
        let path = dir.join(format!("client-{id}.key"));
        let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let seed = unhex::<32>(text.trim()).ok_or_else(|| format!("{}: not 64 hexadecimal digits", path.display()))?;
        Ok(Identity { id, key: SigningKey::from_bytes(&seed) })
    }
}

/// The clients' verifying keys by id.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Roster(BTreeMap<u32, VerifyingKey>);

impl Roster {
    pub fn new(keys: impl IntoIterator<Item = (u32, [u8; 32])>) -> Result<Roster, String> {
        keys.into_iter()
            .map(|(id, k)| Ok((id, VerifyingKey::from_bytes(&k).map_err(|e| format!("client {id}: not a verifying key ({e})"))?)))
            .collect::<Result<_, String>>()
            .map(Roster)
    }

    /// Clients listed.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks that `sig` is client `id`'s signature of `public`.
    pub fn verify(&self, id: u32, public: &[u8; 32], sig: &[u8; 64]) -> Result<(), String> {
        let key = self.0.get(&id).ok_or_else(|| format!("client {id} is not in the roster"))?;
        key.verify(&signed_bytes(id, public), &Signature::from_bytes(sig))
            .map_err(|_| format!("client {id}'s key is not signed by client {id}'s identity"))
    }

    /// Checks every member of a cohort (ids, X25519 keys) against its signature (`sigs`, in
    /// the same order): a key a server made up fails here.
    pub fn verify_cohort(&self, cohort: &[(u32, [u8; 32])], sigs: &[[u8; 64]]) -> Result<(), String> {
        if sigs.len() != cohort.len() {
            return Err(format!("{} signature(s) for a cohort of {}", sigs.len(), cohort.len()));
        }
        cohort.iter().zip(sigs).try_for_each(|((id, k), s)| self.verify(*id, k, s))
    }

    /// Reads a roster file: one `ID HEX` line per client.
    pub fn load(path: &Path) -> Result<Roster, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let bad = || format!("{} line {}: expected `ID HEX` (a client id and 64 hexadecimal digits)", path.display(), n + 1);
            let (id, hex) = line.trim().split_once(' ').ok_or_else(bad)?;
            keys.push((id.parse::<u32>().map_err(|_| bad())?, unhex::<32>(hex.trim()).ok_or_else(bad)?));
        }
        Roster::new(keys).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// Writes identities for clients `0..clients` into `dir`: `client-{i}.key` (mode 0600, for
/// client i alone) and `roster.txt` (for everyone, the server included).
pub fn generate(dir: &Path, clients: u32) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |p: &Path, e: std::io::Error| format!("{}: {e}", p.display());
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let mut roster = String::new();
    for id in 0..clients {
        let me = Identity::generate(id);
        let path = dir.join(format!("client-{id}.key"));
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(|e| io(&path, e))?;
        writeln!(f, "{}", hex(&me.key.to_bytes())).map_err(|e| io(&path, e))?;
        roster += &format!("{id} {}\n", hex(&me.verifying()));
    }
    let path = dir.join("roster.txt");
    std::fs::write(&path, roster).map_err(|e| io(&path, e))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}
