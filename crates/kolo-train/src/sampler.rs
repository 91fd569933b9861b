//! The distributed sampler (as torch's `DistributedSampler`): every epoch a permutation of the
//! dataset seeded by `(seed, epoch)`, rank `r` takes every `world`-th index starting at `r`, so
//! shards are disjoint and balanced. With `drop_last` the tail that does not fill a global batch
//! is dropped; otherwise the permutation is padded by wrapping around.
//!
//! The position (epoch, batch) is all the state there is: save it in a checkpoint and the
//! sequence of batches continues exactly. Rank r's k-th batch of an epoch is
//! `perm[(k*B + j) * world + r]` for `j < B`, so the union over ranks of the k-th batches is the
//! contiguous slice `perm[k*B*world .. (k+1)*B*world]`: exactly the k-th batch a single process
//! with batch `B * world` sees. That is what makes DDP comparable with one process.

use kolo_base::Rng;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplerConfig {
    pub len: usize,
    pub world: usize,
    pub rank: usize,
    /// Examples per rank per batch.
    pub batch: usize,
    pub seed: u64,
    pub shuffle: bool,
    pub drop_last: bool,
}

/// Where the sampler is: resumable from these two numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    pub epoch: u64,
    pub batch: u64,
}

#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    pos: Position,
    perm: Vec<usize>,
    /// Rank r takes the contiguous slice `r*B..(r+1)*B` of each global batch.
    contiguous: bool,
    /// Dynamic batch sizing: the global batches are cut by these shares (changed by whoever
    /// re-plans them), and this is replica `.1`'s.
    shares: Option<(Shares, usize)>,
}

/// The per-replica shares of each global batch under dynamic batch sizing, shared by the
/// replica's sampler and the loop that re-plans them ([`plan_split`]).
pub type Shares = std::sync::Arc<std::sync::Mutex<Vec<usize>>>;

/// Dynamic batch sizing, on resume: the per-replica split a checkpoint was `written` with, when
/// it fits `replicas` replicas of `batch` examples each (the same world size and global
/// batch); `None` otherwise (the run starts again from equal shares).
pub fn resumed_split(written: Option<&[usize]>, batch: usize, replicas: usize) -> Option<Vec<usize>> {
    written.filter(|s| s.len() == replicas && s.iter().sum::<usize>() == batch * replicas).map(<[usize]>::to_vec)
}

impl SamplerConfig {
    /// The position after `batches_done` batches from the start.
    pub fn position_after(&self, batches_done: u64) -> Position {
        let bpe = self.batches_per_epoch().max(1);
        Position { epoch: batches_done / bpe, batch: batches_done % bpe }
    }

    /// Batches per epoch per rank.
    pub fn batches_per_epoch(&self) -> u64 {
        let global = self.batch * self.world;
        if global == 0 {
            return 0;
        }
        if self.drop_last {
            (self.len / global) as u64
        } else {
            self.len.div_ceil(global) as u64
        }
    }
}

/// The permutation of `0..len` for `epoch` (identity without shuffling).
pub fn epoch_permutation(len: usize, seed: u64, epoch: u64, shuffle: bool) -> Vec<usize> {
    let mut p: Vec<usize> = (0..len).collect();
    if shuffle {
        Rng::new(seed.wrapping_mul(0x100_0000_01B3) ^ epoch.wrapping_add(1)).shuffle(&mut p);
    }
    p
}

/// Rank `rank`'s indices for batch `k` of an epoch with permutation `perm`: every `world`-th
/// index of the global batch, or (`contiguous`) its `rank`-th slice of `batch` indices.
pub fn batch_indices(cfg: &SamplerConfig, perm: &[usize], k: u64, contiguous: bool) -> Vec<usize> {
    let (k, (b, w, r)) = (k as usize, (cfg.batch, cfg.world, cfg.rank));
    match contiguous {
        false => (0..b).map(|j| perm[((k * b + j) * w + r) % perm.len()]).collect(),
        true => (0..b).map(|j| perm[(k * b * w + r * b + j) % perm.len()]).collect(),
    }
}

impl Sampler {
    pub fn new(cfg: SamplerConfig, pos: Position) -> Result<Sampler, String> {
        if cfg.batch == 0 || cfg.world == 0 || cfg.rank >= cfg.world {
            return Err(format!("sampler: batch {} world {} rank {} is not valid", cfg.batch, cfg.world, cfg.rank));
        }
        if cfg.batches_per_epoch() == 0 {
            return Err(format!(
                "the dataset has {} examples, fewer than one global batch of {} (batch {} x {} ranks); lower the batch size or turn off drop_last",
                cfg.len, cfg.batch * cfg.world, cfg.batch, cfg.world
            ));
        }
        let perm = epoch_permutation(cfg.len, cfg.seed, pos.epoch, cfg.shuffle);
        Ok(Sampler { cfg, pos, perm, contiguous: false, shares: None })
    }

    /// Dynamic batch sizing: replica `rank`'s share of each global batch of `global` (a
    /// world-1 config whose batch is the global batch), the shares read at every batch.
    pub fn new_shares(global: SamplerConfig, pos: Position, shares: Shares, rank: usize) -> Result<Sampler, String> {
        let n = shares.lock().unwrap_or_else(|p| p.into_inner()).len();
        if global.world != 1 || rank >= n {
            return Err(format!("sampler: replica {rank} of {n} shares of a global batch (world {})", global.world));
        }
        Ok(Sampler { shares: Some((shares, rank)), ..Sampler::new(global, pos)? })
    }

    /// As [`Sampler::new`], but rank r takes the contiguous slice `r*B..(r+1)*B` of each
    /// global batch (the same global batches and positions): deterministic mode
    /// (`ddp.deterministic`) deals so, so that a piece of consecutive examples of a rank's
    /// batch holds the same examples at every world size.
    pub fn new_contiguous(cfg: SamplerConfig, pos: Position) -> Result<Sampler, String> {
        Ok(Sampler { contiguous: true, ..Sampler::new(cfg, pos)? })
    }

    /// How `kolo train` and the library's `Trainer::sampler` deal replica `cfg.rank` of
    /// `cfg.world` its batches from `pos`: with `shares` (dynamic batch sizing) its share of each
    /// global batch, read at every batch; in deterministic mode the contiguous slices of the
    /// global batches (a piece of the global batch then holds the same examples at every world
    /// size); otherwise strided.
    pub fn for_replica(cfg: SamplerConfig, pos: Position, deterministic: bool, shares: Option<&Shares>) -> Result<Sampler, String> {
        match (shares, deterministic) {
            (Some(s), _) => {
                let global = SamplerConfig { world: 1, rank: 0, batch: cfg.batch * cfg.world, ..cfg };
                Sampler::new_shares(global, pos, s.clone(), cfg.rank)
            }
            (None, true) => Sampler::new_contiguous(cfg, pos),
            (None, false) => Sampler::new(cfg, pos),
        }
    }

    pub fn position(&self) -> Position {
        self.pos
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The next batch's indices; moves to the next epoch (reshuffling) when one ends.
    pub fn next_batch(&mut self) -> Vec<usize> {
        if self.pos.batch >= self.cfg.batches_per_epoch() {
            self.pos = Position { epoch: self.pos.epoch + 1, batch: 0 };
            self.perm = epoch_permutation(self.cfg.len, self.cfg.seed, self.pos.epoch, self.cfg.shuffle);
        }
        let idx = batch_indices(&self.cfg, &self.perm, self.pos.batch, self.contiguous);
        self.pos.batch += 1;
        match &self.shares {
            None => idx,
            Some((shares, r)) => {
                let split = shares.lock().unwrap_or_else(|p| p.into_inner());
                let from: usize = split[..*r].iter().sum();
                idx[from..from + split[*r]].to_vec()
            }
        }
    }
}

/// Dynamic batch sizing at the end of a window of `window` steps after `done` steps, on every
/// rank of `comm` (replica `rank` is this one): each rank's compute time per example over the
/// window (`report`'s), gathered, and the shares re-planned from them ([`plan_split`]); a
/// change is logged. `kolo train`'s driver and the library's `Trainer` call it.
pub fn replan(
    shares: &Shares,
    rank: usize,
    window: usize,
    report: &crate::report::Reporter,
    comm: &dyn kolo_comm::Communicator,
    done: u64,
) -> Result<(), crate::TrainError> {
    let split = shares.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let own = &report.compute_ms[report.compute_ms.len().saturating_sub(window)..];
    let mine = [own.iter().sum::<f64>() / own.len().max(1) as f64 / split[rank].max(1) as f64];
    let mut all = vec![0f64; split.len()];
    comm.all_gather(kolo_comm::BufRef::from(&mine[..]), kolo_comm::BufMut::from(&mut all))?;
    let next = plan_split(split.iter().sum(), &all, 1);
    if next != split {
        report.log(&format!(
            "step {done}: dynamic batch: per-rank batches {split:?} -> {next:?} (ms per example {:?})",
            all.iter().map(|t| (t * 1000.0).round() / 1000.0).collect::<Vec<_>>()
        ));
        *shares.lock().unwrap_or_else(|p| p.into_inner()) = next;
    }
    Ok(())
}

/// Dynamic batch sizing: splits a global batch of `total` examples over ranks in proportion to
/// their speed (1 / `per_example_ms`), each at least `min`, by largest remainders (ties to the
/// lower rank), so that every rank's share takes about the same time. Pure: every rank computes
/// the same split from the same gathered timings. Non-positive or non-finite timings count as
/// the fastest measured.
pub fn plan_split(total: usize, per_example_ms: &[f64], min: usize) -> Vec<usize> {
    let n = per_example_ms.len();
    assert!(n > 0 && total >= n * min, "{total} examples cannot give {n} ranks {min} each");
    let fastest = per_example_ms.iter().copied().filter(|t| t.is_finite() && *t > 0.0).fold(f64::INFINITY, f64::min);
    let speed: Vec<f64> = per_example_ms
        .iter()
        .map(|&t| {
            if t.is_finite() && t > 0.0 {
                1.0 / t
            } else if fastest.is_finite() {
                1.0 / fastest
            } else {
                1.0
            }
        })
        .collect();
    let sum: f64 = speed.iter().sum();
    let free = total - n * min;
    let ideal: Vec<f64> = speed.iter().map(|s| free as f64 * s / sum).collect();
    let mut split: Vec<usize> = ideal.iter().map(|x| min + x.floor() as usize).collect();
    let mut left = total - split.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| (ideal[b] - ideal[b].floor()).total_cmp(&(ideal[a] - ideal[a].floor())).then(a.cmp(&b)));
    for &r in order.iter().cycle() {
        if left == 0 {
            break;
        }
        split[r] += 1;
        left -= 1;
    }
    split
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint's split is taken on only where it fits the run: the same replicas and the
    /// same global batch.
    #[test]
    fn a_resumed_split_is_taken_only_where_it_fits() {
        assert_eq!(resumed_split(Some(&[5, 11]), 8, 2), Some(vec![5, 11]));
        assert_eq!(resumed_split(Some(&[12, 12]), 8, 3), None, "another world size, the same global batch");
        assert_eq!(resumed_split(Some(&[5, 10]), 8, 2), None, "another global batch");
        assert_eq!(resumed_split(None, 8, 2), None);
    }

    /// `for_replica` deals as its settings say: strided, contiguous slices (deterministic
    /// mode), or a share of each global batch (dynamic batch sizing); every mode covers each
    /// global batch once over the replicas.
    #[test]
    fn replicas_are_dealt_strided_contiguous_or_by_share() {
        let cfg = |rank| SamplerConfig { len: 40, world: 2, rank, batch: 4, seed: 3, shuffle: true, drop_last: true };
        let next = |det: bool, shares: Option<&Shares>, rank| {
            Sampler::for_replica(cfg(rank), Position::default(), det, shares).unwrap().next_batch()
        };
        let global = Sampler::new(SamplerConfig { world: 1, rank: 0, batch: 8, ..cfg(0) }, Position::default()).unwrap().next_batch();
        let strided: Vec<usize> = (0..4).flat_map(|j| [next(false, None, 0)[j], next(false, None, 1)[j]]).collect();
        assert_eq!(strided, global);
        assert_eq!([next(true, None, 0), next(true, None, 1)].concat(), global);
        let shares: Shares = std::sync::Arc::new(std::sync::Mutex::new(vec![3, 5]));
        let (a, b) = (next(false, Some(&shares), 0), next(false, Some(&shares), 1));
        assert_eq!((a.len(), b.len()), (3, 5));
        assert_eq!([a, b].concat(), global);
    }

    #[test]
    fn dynamic_split_follows_speed_and_keeps_the_total() {
        assert_eq!(plan_split(64, &[1.0, 1.0], 1), vec![32, 32]);
        assert_eq!(plan_split(64, &[1.0, 3.0], 1), vec![48, 16], "a 3x slower rank gets a quarter");
        assert_eq!(plan_split(10, &[1.0, 1.0, 1.0], 1), vec![4, 3, 3], "remainder to the lower rank");
        assert_eq!(plan_split(8, &[1.0, 1000.0], 2), vec![6, 2], "at least min each");
        assert_eq!(plan_split(6, &[0.0, f64::NAN, 2.0], 1), vec![2, 2, 2], "unmeasured ranks count as the fastest");
        for (total, t) in [(97, vec![1.3, 0.7, 2.9, 1.0]), (5, vec![1.0; 5]), (33, vec![0.1, 10.0])] {
            let s = plan_split(total, &t, 1);
            assert_eq!(s.iter().sum::<usize>(), total);
            assert!(s.iter().all(|&x| x >= 1));
        }
    }

    fn cfg(len: usize, world: usize, rank: usize, batch: usize, drop_last: bool) -> SamplerConfig {
        SamplerConfig { len, world, rank, batch, seed: 3, shuffle: true, drop_last }
    }

    /// Dynamic batch sizing's dealing: the replicas' shares cut one process's global batches
    /// in order, and a re-planned split holds from the next batch on.
    #[test]
    fn shares_cut_the_global_batches_and_follow_a_new_split() {
        let shares: Shares = std::sync::Arc::new(std::sync::Mutex::new(vec![6, 6]));
        let mut one = Sampler::new(cfg(50, 1, 0, 12, true), Position::default()).unwrap();
        let mut ranks: Vec<Sampler> =
            (0..2).map(|r| Sampler::new_shares(cfg(50, 1, 0, 12, true), Position::default(), shares.clone(), r).unwrap()).collect();
        for k in 0..8 {
            if k == 3 {
                *shares.lock().unwrap() = vec![9, 3];
            }
            let global = one.next_batch();
            let got: Vec<Vec<usize>> = ranks.iter_mut().map(|s| s.next_batch()).collect();
            assert_eq!(got[0].len(), if k < 3 { 6 } else { 9 }, "batch {k}");
            assert_eq!(got.concat(), global, "batch {k}");
        }
        assert!(Sampler::new_shares(cfg(50, 2, 0, 6, true), Position::default(), shares.clone(), 0).is_err(), "a per-rank config");
        assert!(Sampler::new_shares(cfg(50, 1, 0, 12, true), Position::default(), shares, 2).is_err(), "a replica without a share");
    }

    /// Deterministic mode's dealing: rank r's k-th batch is the r-th slice of one process's
    /// k-th global batch (through an epoch's end, padded or not), at the same positions.
    #[test]
    fn contiguous_slices_are_one_processs_global_batches_cut_in_order() {
        for drop_last in [true, false] {
            let mut one = Sampler::new(cfg(50, 1, 0, 12, drop_last), Position::default()).unwrap();
            let mut ranks: Vec<Sampler> =
                (0..3).map(|r| Sampler::new_contiguous(cfg(50, 3, r, 4, drop_last), Position::default()).unwrap()).collect();
            for k in 0..10 {
                let global = one.next_batch();
                let cut: Vec<usize> = ranks.iter_mut().flat_map(|s| s.next_batch()).collect();
                assert_eq!(cut, global, "batch {k}, drop_last {drop_last}");
                assert!(ranks.iter().all(|s| s.position() == one.position()));
            }
        }
    }

    #[test]
    fn shards_are_disjoint_balanced_and_match_one_process() {
        for world in 1..=4 {
            let len = 103;
            let mut seen = vec![0; len];
            let mut per_rank: Vec<Vec<Vec<usize>>> = Vec::new();
            for r in 0..world {
                let mut s = Sampler::new(cfg(len, world, r, 5, true), Position::default()).unwrap();
                let n = s.config().batches_per_epoch();
                let batches: Vec<Vec<usize>> = (0..n).map(|_| s.next_batch()).collect();
                batches.iter().flatten().for_each(|i| seen[*i] += 1);
                per_rank.push(batches);
            }
            assert!(seen.iter().all(|c| *c <= 1), "an example was drawn twice in one epoch");
            assert_eq!(seen.iter().sum::<usize>(), (len / (5 * world)) * 5 * world);
            // The union of the ranks' k-th batches is the k-th batch of one process with batch 5*world.
            let mut one = Sampler::new(cfg(len, 1, 0, 5 * world, true), Position::default()).unwrap();
            for k in 0..per_rank[0].len() {
                let mut union: Vec<usize> = per_rank.iter().flat_map(|b| b[k].clone()).collect();
                let mut single = one.next_batch();
                union.sort();
                single.sort();
                assert_eq!(union, single, "world {world} batch {k}");
            }
        }
    }

    #[test]
    fn epochs_reshuffle_and_positions_resume() {
        let mut a = Sampler::new(cfg(20, 2, 1, 3, true), Position::default()).unwrap();
        let first: Vec<Vec<usize>> = (0..3).map(|_| a.next_batch()).collect();
        let second: Vec<Vec<usize>> = (0..3).map(|_| a.next_batch()).collect();
        assert_eq!(a.position(), Position { epoch: 1, batch: 3 });
        assert_ne!(first, second, "epochs must reshuffle");
        let pos = Position { epoch: 0, batch: 2 };
        let mut b = Sampler::new(cfg(20, 2, 1, 3, true), pos).unwrap();
        assert_eq!(b.next_batch(), first[2]);
        assert_eq!(b.next_batch(), second[0]);
    }

    #[test]
    fn padding_and_errors() {
        // Without drop_last the last global batch wraps around.
        let c = cfg(7, 2, 0, 2, false);
        assert_eq!(c.batches_per_epoch(), 2);
        let mut s = Sampler::new(c, Position::default()).unwrap();
        assert_eq!(s.next_batch().len(), 2);
        assert_eq!(s.next_batch().len(), 2);
        assert!(Sampler::new(cfg(3, 2, 0, 2, true), Position::default()).unwrap_err().contains("fewer than one global batch"));
        assert!(Sampler::new(cfg(3, 2, 2, 1, true), Position::default()).is_err());
    }
}
