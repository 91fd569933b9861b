//! ZeRO shard plans (pure): which elements of the model each rank owns.
//!
//! Ownership follows the gradient buckets: each bucket's buffer (its parameters back to back in
//! bucket order) is cut with [`even_split`], exactly as `reduce_scatter` and `all_gather` cut it,
//! so rank r owns piece r of every bucket. A rank's *shard vector* is its pieces of all buckets
//! concatenated in bucket order; its optimizer state lives in that layout. Pieces may start or
//! end inside a parameter; [`ShardPlan::segments`] maps the shard vector back to
//! `(parameter, element range)` pairs for copying and for checkpoints.

use crate::Bucket;
use kolo_base::{even_split, shard_range, Rank, WorldSize};
use std::ops::Range;

/// A contiguous run of one parameter's elements inside a rank's shard vector.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Index into the model's parameter list.
    pub param: usize,
    /// Elements of that parameter (row-major, flattened).
    pub within: Range<usize>,
    /// Where they sit in the rank's shard vector.
    pub shard_offset: usize,
}

/// One rank's share of one bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub bucket: usize,
    /// Range inside the bucket's buffer.
    pub in_bucket: Range<usize>,
    /// Where it sits in the rank's shard vector.
    pub shard_offset: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    pub world: WorldSize,
    pub rank: Rank,
    pub pieces: Vec<Piece>,
    pub segments: Vec<Segment>,
    /// Length of this rank's shard vector.
    pub len: usize,
}

impl ShardPlan {
    /// The plan of `rank` for parameters of sizes `numels` grouped into `buckets`.
    pub fn new(numels: &[usize], buckets: &[Bucket], world: WorldSize, rank: Rank) -> ShardPlan {
        let mut pieces = Vec::with_capacity(buckets.len());
        let mut segments = Vec::new();
        let mut shard_offset = 0;
        for (b, bucket) in buckets.iter().enumerate() {
            let mine = shard_range(bucket.numel, world, rank);
            pieces.push(Piece { bucket: b, in_bucket: mine.clone(), shard_offset });
            let mut at = 0; // the parameter's start inside the bucket buffer
            for &p in &bucket.params {
                let (lo, hi) = (mine.start.max(at), mine.end.min(at + numels[p]));
                if lo < hi {
                    segments.push(Segment { param: p, within: lo - at..hi - at, shard_offset: shard_offset + lo - mine.start });
                }
                at += numels[p];
            }
            shard_offset += mine.len();
        }
        ShardPlan { world, rank, pieces, segments, len: shard_offset }
    }

    /// Plans of every rank.
    pub fn all(numels: &[usize], buckets: &[Bucket], world: WorldSize) -> Vec<ShardPlan> {
        (0..world.get()).map(|r| ShardPlan::new(numels, buckets, world, Rank(r))).collect()
    }

    /// Copies this rank's elements out of a full flat vector (parameter `i` at `ranges[i]`).
    pub fn gather(&self, ranges: &[Range<usize>], flat: &[f32], shard: &mut [f32]) {
        for s in &self.segments {
            let src = ranges[s.param].start + s.within.start..ranges[s.param].start + s.within.end;
            shard[s.shard_offset..s.shard_offset + s.within.len()].copy_from_slice(&flat[src]);
        }
    }

    /// Writes this rank's elements back into a full flat vector.
    pub fn scatter(&self, ranges: &[Range<usize>], shard: &[f32], flat: &mut [f32]) {
        for s in &self.segments {
            let dst = ranges[s.param].start + s.within.start..ranges[s.param].start + s.within.end;
            flat[dst].copy_from_slice(&shard[s.shard_offset..s.shard_offset + s.within.len()]);
        }
    }
}

/// The pieces every rank owns of a bucket of `numel` elements (what `all_gather` returns, in order).
pub fn bucket_pieces(numel: usize, world: WorldSize) -> Vec<Range<usize>> {
    even_split(numel, world).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bucket_plan;

    fn ranges(numels: &[usize]) -> Vec<Range<usize>> {
        let mut off = 0;
        numels
            .iter()
            .map(|n| {
                off += n;
                off - n..off
            })
            .collect()
    }

    /// Every element of every parameter is owned by exactly one rank, and gather/scatter
    /// through all ranks' plans reproduces the flat vector.
    #[test]
    fn shards_tile_the_model_exactly_for_odd_sizes() {
        for numels in [vec![], vec![0], vec![1], vec![7, 3, 0, 13, 1, 29], vec![5; 11], vec![101, 2, 97]] {
            let total: usize = numels.iter().sum();
            for world in 1..=5 {
                for (first, cap) in [(1, 1), (4, 10), (1000, 1000), (3, 17)] {
                    let buckets = bucket_plan(&numels, first, cap);
                    let w = WorldSize::new(world).unwrap();
                    let plans = ShardPlan::all(&numels, &buckets, w);
                    let flat: Vec<f32> = (0..total).map(|i| i as f32).collect();
                    let mut back = vec![-1f32; total];
                    let mut owned = vec![0u32; total];
                    let r = ranges(&numels);
                    for p in &plans {
                        assert_eq!(p.len, p.pieces.iter().map(|x| x.in_bucket.len()).sum::<usize>());
                        assert_eq!(p.len, p.segments.iter().map(|s| s.within.len()).sum::<usize>());
                        let mut shard = vec![0f32; p.len];
                        p.gather(&r, &flat, &mut shard);
                        p.scatter(&r, &shard, &mut back);
                        for s in &p.segments {
                            assert!(s.within.end <= numels[s.param]);
                            for i in s.within.clone() {
                                owned[r[s.param].start + i] += 1;
                            }
                        }
                    }
                    assert!(owned.iter().all(|&c| c == 1), "{numels:?} world {world}");
                    assert_eq!(back, flat);
                    // Shards are balanced: sizes differ by at most one element per bucket.
                    let lens: Vec<usize> = plans.iter().map(|p| p.len).collect();
                    let spread = lens.iter().max().unwrap() - lens.iter().min().unwrap();
                    assert!(spread <= buckets.len(), "{lens:?}");
                }
            }
        }
    }

    #[test]
    fn pieces_match_the_collectives_split() {
        let numels = [10, 20, 30, 40];
        let buckets = bucket_plan(&numels, 60, 60);
        let w = WorldSize::new(3).unwrap();
        let plans = ShardPlan::all(&numels, &buckets, w);
        for (b, bucket) in buckets.iter().enumerate() {
            let want = bucket_pieces(bucket.numel, w);
            for (r, p) in plans.iter().enumerate() {
                assert_eq!(p.pieces[b].in_bucket, want[r]);
            }
        }
        // Bucket 0 = [param 3] (40 elements): rank 1 owns 14..27 of it.
        assert_eq!(plans[1].segments[0], Segment { param: 3, within: 14..27, shard_offset: 0 });
        // Bucket 1 = params 2, 1, 0 (60 elements): rank 1 owns 20..40 = param 2's 20..30, param 1's 0..10.
        assert_eq!(
            plans[1].segments[1..],
            [Segment { param: 2, within: 20..30, shard_offset: 13 }, Segment { param: 1, within: 0..10, shard_offset: 23 }]
        );
    }
}
