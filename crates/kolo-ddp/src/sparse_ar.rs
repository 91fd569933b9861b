//! Sparse all-reduce (SparCML, Renggli et al. 2019): every rank holds a sparse vector (sorted
//! indices and values); recursive doubling exchanges the current partial sums with a partner
//! at distance 1, 2, 4, ... and merges them, so indices that several ranks chose travel once per
//! step. With k pairs per rank a rank sends at most k + 2k + ... < p k pairs, and fewer where the
//! index sets overlap (an all-gather always moves (p - 1) k pairs to every rank). A world that is
//! not a power of two first folds its extra ranks into the lower ones, and hands them the result
//! at the end (as Rabenseifner's all-reduce does).

use kolo_base::Rank;
use kolo_comm::{BufMut, BufRef, CommError, Communicator, OpKind};
use kolo_compress::sparse::Sparse;

const LEN_TAG: u32 = 0x5A_0000;
const DATA_TAG: u32 = 0x5A_0001;

fn encode(s: &Sparse) -> Vec<u8> {
    let mut b = Vec::with_capacity(s.indices.len() * 8);
    for (i, v) in s.indices.iter().zip(&s.values) {
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
    }
    b
}

fn decode(b: &[u8], len: usize, c: &dyn Communicator, peer: Rank) -> Result<Sparse, CommError> {
    let mut s = Sparse { len, indices: Vec::with_capacity(b.len() / 8), values: Vec::with_capacity(b.len() / 8) };
    for ch in b.chunks_exact(8) {
        let i = u32::from_le_bytes(ch[..4].try_into().expect("4 bytes"));
        if i as usize >= len || s.indices.last().is_some_and(|l| *l >= i) {
            return Err(CommError::Protocol {
                op: OpKind::AllReduce,
                rank: c.rank(),
                seq: 0,
                peer,
                what: format!("sparse all-reduce: index {i} out of order or outside {len}"),
            });
        }
        s.indices.push(i);
        s.values.push(f32::from_le_bytes(ch[4..].try_into().expect("4 bytes")));
    }
    Ok(s)
}

/// The element-wise sum of two sparse vectors with sorted indices (`a` first where both hold one,
/// so every rank adds in the same order).
pub fn merge(a: &Sparse, b: &Sparse) -> Sparse {
    let mut out = Sparse {
        len: a.len,
        indices: Vec::with_capacity(a.indices.len() + b.indices.len()),
        values: Vec::with_capacity(a.indices.len() + b.indices.len()),
    };
    let (mut i, mut j) = (0, 0);
    while i < a.indices.len() || j < b.indices.len() {
        let take_a = j == b.indices.len() || (i < a.indices.len() && a.indices[i] < b.indices[j]);
        let take_b = i == a.indices.len() || (j < b.indices.len() && b.indices[j] < a.indices[i]);
        if take_a {
            out.indices.push(a.indices[i]);
            out.values.push(a.values[i]);
            i += 1;
        } else if take_b {
            out.indices.push(b.indices[j]);
            out.values.push(b.values[j]);
            j += 1;
        } else {
            out.indices.push(a.indices[i]);
            out.values.push(a.values[i] + b.values[j]);
            i += 1;
            j += 1;
        }
    }
    out
}

/// Sends `s` to `peer` while receiving `peer`'s (lengths first: the sizes differ).
fn exchange(c: &dyn Communicator, s: &Sparse, peer: Rank, sent: &mut usize) -> Result<Sparse, CommError> {
    let mine = encode(s);
    let mut theirs_len = [0i64];
    c.send_recv(BufRef::from(&[mine.len() as i64][..]), peer, LEN_TAG, BufMut::from(&mut theirs_len[..]), peer, LEN_TAG)?;
    let n = usize::try_from(theirs_len[0]).unwrap_or(usize::MAX);
    if n % 8 != 0 || n / 8 > s.len {
        return Err(CommError::Protocol {
            op: OpKind::AllReduce,
            rank: c.rank(),
            seq: 0,
            peer,
            what: format!("sparse all-reduce: {n} bytes announced for a vector of {}", s.len),
        });
    }
    let mut buf = vec![0u8; n];
    c.send_recv(BufRef::from(&mine[..]), peer, DATA_TAG, BufMut::from(&mut buf[..]), peer, DATA_TAG)?;
    *sent += mine.len() + 8;
    decode(&buf, s.len, c, peer)
}

fn send_one(c: &dyn Communicator, s: &Sparse, peer: Rank, sent: &mut usize) -> Result<(), CommError> {
    let mine = encode(s);
    c.send(BufRef::from(&[mine.len() as i64][..]), peer, LEN_TAG)?;
    c.send(BufRef::from(&mine[..]), peer, DATA_TAG)?;
    *sent += mine.len() + 8;
    Ok(())
}

fn recv_one(c: &dyn Communicator, len: usize, peer: Rank) -> Result<Sparse, CommError> {
    let mut n = [0i64];
    c.recv(BufMut::from(&mut n[..]), peer, LEN_TAG)?;
    let n = usize::try_from(n[0]).unwrap_or(usize::MAX);
    if n % 8 != 0 || n / 8 > len {
        return Err(CommError::Protocol {
            op: OpKind::AllReduce,
            rank: c.rank(),
            seq: 0,
            peer,
            what: format!("sparse all-reduce: {n} bytes announced for a vector of {len}"),
        });
    }
    let mut buf = vec![0u8; n];
    c.recv(BufMut::from(&mut buf[..]), peer, DATA_TAG)?;
    decode(&buf, len, c, peer)
}

/// The sum over every rank of their sparse vectors (all of the same `len`, indices sorted),
/// on every rank; also returns the bytes this rank sent.
pub fn sparse_all_reduce(c: &dyn Communicator, mine: &Sparse) -> Result<(Sparse, usize), CommError> {
    let (r, p) = (c.rank().get(), c.world_size().get());
    let mut sent = 0;
    if p == 1 {
        return Ok((mine.clone(), 0));
    }
    let q = 1usize << (usize::BITS - 1 - p.leading_zeros()); // largest power of two <= p
    let mut acc = mine.clone();
    if r >= q {
        // Fold into rank r - q, then receive the result from it.
        send_one(c, &acc, Rank(r - q), &mut sent)?;
        return Ok((recv_one(c, mine.len, Rank(r - q))?, sent));
    }
    if r + q < p {
        let extra = recv_one(c, mine.len, Rank(r + q))?;
        acc = merge(&acc, &extra);
    }
    let mut d = 1;
    while d < q {
        let peer = r ^ d;
        let theirs = exchange(c, &acc, Rank(peer), &mut sent)?;
        // The lower rank's sum first, so both ends add in the same order.
        acc = if r < peer { merge(&acc, &theirs) } else { merge(&theirs, &acc) };
        d <<= 1;
    }
    if r + q < p {
        send_one(c, &acc, Rank(r + q), &mut sent)?;
    }
    Ok((acc, sent))
}
