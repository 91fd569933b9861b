//! Scheduled communication (ByteScheduler, Peng et al., SOSP 2019), the plans: pure functions.
//!
//! The flat gradient (parameters in registration order, which is forward order) is cut into
//! chunks; a chunk's index is its priority — the first layers' gradients, which the next
//! forward pass needs first, go first, although backward produces them last. Every round the
//! ranks agree on the chunks all of them have ready (one small all-reduce of flags) and reduce
//! the highest-priority ones, up to a credit of elements, in one collective. A parameter whose
//! chunks are all reduced is updated at once, and the next forward uses it while the later
//! chunks are still on the wire.

use std::ops::Range;

/// Contiguous pieces of at most `chunk` elements covering `0..total`, in order.
pub fn chunk_plan(total: usize, chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    (0..total.div_ceil(chunk)).map(|c| c * chunk..((c + 1) * chunk).min(total)).collect()
}

/// For each parameter (its flat range), the chunks that hold a part of it.
pub fn param_chunks(ranges: &[Range<usize>], chunk: usize) -> Vec<Range<usize>> {
    let chunk = chunk.max(1);
    ranges.iter().map(|r| if r.is_empty() { r.start / chunk..r.start / chunk } else { r.start / chunk..(r.end - 1) / chunk + 1 }).collect()
}

/// For each chunk, the parameters it holds a part of (inverse of [`param_chunks`]).
pub fn chunk_params(param_chunks: &[Range<usize>], chunks: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new(); chunks];
    for (p, cs) in param_chunks.iter().enumerate() {
        for c in cs.clone() {
            out[c].push(p);
        }
    }
    out
}

/// The chunks to reduce in one round: those every rank has ready (`common`) and that are not
/// reduced yet, highest priority (lowest index) first, as many as fit in `credit` elements —
/// always at least one when any is eligible, so a chunk larger than the credit still goes.
pub fn pick_round(common: &[bool], done: &[bool], plan: &[Range<usize>], credit: usize) -> Vec<usize> {
    let mut picked = Vec::new();
    let mut used = 0;
    for c in 0..plan.len() {
        if !common[c] || done[c] {
            continue;
        }
        let n = plan[c].len();
        if !picked.is_empty() && used + n > credit {
            break;
        }
        picked.push(c);
        used += n;
    }
    picked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_gradient_once_and_map_to_parameters() {
        for (total, chunk) in [(0, 4), (1, 4), (10, 4), (12, 4), (13, 1), (7, 100)] {
            let plan = chunk_plan(total, chunk);
            let mut next = 0;
            for r in &plan {
                assert_eq!(r.start, next);
                assert!(!r.is_empty() && r.len() <= chunk);
                next = r.end;
            }
            assert_eq!(next, total);
        }
        // Parameters of 3, 5, 1, 4 elements; chunks of 4: [0,4) [4,8) [8,12) [12,13).
        let ranges = [0..3, 3..8, 8..9, 9..13];
        let pc = param_chunks(&ranges, 4);
        assert_eq!(pc, vec![0..1, 0..2, 2..3, 2..4]);
        assert_eq!(chunk_params(&pc, 4), vec![vec![0, 1], vec![1], vec![2, 3], vec![3]]);
    }

    #[test]
    fn rounds_take_the_first_layers_first_within_the_credit() {
        let plan = chunk_plan(40, 10); // four chunks of 10
        let done = [false; 4];
        // Backward made the last chunks first: all ranks have 2 and 3; 3 goes with 2 under a
        // credit of 20, but only 2 under 10.
        assert_eq!(pick_round(&[false, false, true, true], &done, &plan, 20), vec![2, 3]);
        assert_eq!(pick_round(&[false, false, true, true], &done, &plan, 10), vec![2]);
        // Once chunk 0 is ready everywhere it preempts the rest.
        assert_eq!(pick_round(&[true, false, true, true], &[false, false, true, false], &plan, 10), vec![0]);
        // A chunk larger than the credit still goes, alone.
        assert_eq!(pick_round(&[true; 4], &done, &plan, 5), vec![0]);
        // Nothing common and not done: an empty round (wait for backward).
        assert!(pick_round(&[false, true, false, false], &[false, true, false, false], &plan, 100).is_empty());
    }
}
