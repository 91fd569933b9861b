//! All-reduce crossovers measured on the machine a job runs on (`kolo bench collectives --tune`,
//! in the spirit of NCCL's tuner plugins and Open MPI's `coll_tuned` dynamic rules): for a world
//! size and a kind of link, which algorithm to use up to each buffer size. `AlgorithmChoice::Auto`
//! follows a table that matches the communicator; anything it does not cover (another world
//! size or link kind, several hosts, no table) keeps the built-in thresholds.
//!
//! The file is TOML, one `[[all_reduce]]` table per world size and link kind:
//!
//! ```toml
//! [[all_reduce]]
//! world = 2
//! links = "shm"
//! # buffers up to `bytes` use `algo`; larger than the last row, the last row's
//! rows = [[65536, "doubling"], [1048576, "halving"], [16777216, "ring"]]
//! ```
//!
//! Every rank must read the same table (ranks that picked different algorithms would not meet
//! in the same collective): the group's setup compares each member's [`Tuning::digest`] and
//! fails naming the rank that differs.

use crate::algo::Algorithm;
use serde::Deserialize;

/// How the members of a group reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// Every peer over shared memory (one host).
    Shm,
    /// Every peer over TCP.
    Tcp,
}

impl LinkKind {
    pub fn name(self) -> &'static str {
        match self {
            LinkKind::Shm => "shm",
            LinkKind::Tcp => "tcp",
        }
    }
}

/// The algorithms a table may name: those `Auto` chooses among on one host.
const TUNABLE: [Algorithm; 4] = [Algorithm::RecursiveDoubling, Algorithm::HalvingDoubling, Algorithm::Ring, Algorithm::Tree];

fn algorithm(name: &str) -> Option<Algorithm> {
    TUNABLE.into_iter().find(|a| a.name() == name)
}

/// One world size and link kind's crossovers: `rows[i]` covers buffers above `rows[i - 1].0`
/// bytes up to `rows[i].0`; the last row also covers everything larger.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneTable {
    pub world: usize,
    pub links: LinkKind,
    pub rows: Vec<(u64, Algorithm)>,
}

impl TuneTable {
    /// The algorithm for a buffer of `bytes`.
    pub fn pick(&self, bytes: u64) -> Algorithm {
        self.rows.iter().find(|(up_to, _)| bytes <= *up_to).or(self.rows.last()).map(|r| r.1).expect("a table has rows")
    }

    /// The table measurements give: per size (ascending), each algorithm's seconds. A size's
    /// row is the fastest algorithm, unless `fallback`'s choice for it is within `margin`
    /// (0.05: 5 %) of the fastest, when the fallback stays (noise does not move a crossover);
    /// neighbouring rows of the same algorithm merge.
    pub fn from_measurements(
        world: usize,
        links: LinkKind,
        sizes: &[(u64, Vec<(Algorithm, f64)>)],
        fallback: impl Fn(u64) -> Algorithm,
        margin: f64,
    ) -> Result<TuneTable, String> {
        let mut rows: Vec<(u64, Algorithm)> = Vec::new();
        for (bytes, times) in sizes {
            let best = times.iter().filter(|t| t.1.is_finite() && t.1 > 0.0).min_by(|a, b| a.1.total_cmp(&b.1));
            let Some(&(fastest, t_best)) = best else {
                return Err(format!("no algorithm was timed at {bytes} bytes"));
            };
            let keep = fallback(*bytes);
            let kept = times.iter().find(|t| t.0 == keep).is_some_and(|t| t.1 <= t_best * (1.0 + margin));
            let choice = if kept { keep } else { fastest };
            match rows.last_mut() {
                Some(last) if last.1 == choice => last.0 = *bytes,
                _ => rows.push((*bytes, choice)),
            }
        }
        let t = TuneTable { world, links, rows };
        t.check()?;
        Ok(t)
    }

    fn check(&self) -> Result<(), String> {
        let what = format!("all_reduce table for world {} over {}", self.world, self.links.name());
        if self.world < 2 {
            return Err(format!("{what}: a world of at least 2 ranks"));
        }
        if self.rows.is_empty() {
            return Err(format!("{what}: no rows"));
        }
        if self.rows.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(format!("{what}: the rows' sizes must ascend"));
        }
        Ok(())
    }
}

/// Every table a tuning file holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tuning {
    pub tables: Vec<TuneTable>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    all_reduce: Vec<TableFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    world: usize,
    links: String,
    rows: Vec<(u64, String)>,
}

impl Tuning {
    /// Reads a tuning file's text; `source` names it in errors.
    pub fn parse(text: &str, source: &str) -> Result<Tuning, String> {
        let f: File = toml::from_str(text).map_err(|e| format!("{source}: {e}"))?;
        let mut tuning = Tuning::default();
        for t in f.all_reduce {
            let links = match t.links.as_str() {
                "shm" => LinkKind::Shm,
                "tcp" => LinkKind::Tcp,
                l => return Err(format!("{source}: links `{l}` (shm or tcp)")),
            };
            let rows = t
                .rows
                .iter()
                .map(|(b, a)| {
                    algorithm(a)
                        .map(|alg| (*b, alg))
                        .ok_or_else(|| format!("{source}: algorithm `{a}` (one of {})", TUNABLE.map(Algorithm::name).join(", ")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            tuning.insert(TuneTable { world: t.world, links, rows }).map_err(|e| format!("{source}: {e}"))?;
        }
        Ok(tuning)
    }

    /// Adds `table`, replacing one for the same world size and link kind.
    pub fn insert(&mut self, table: TuneTable) -> Result<(), String> {
        table.check()?;
        self.tables.retain(|t| (t.world, t.links) != (table.world, table.links));
        self.tables.push(table);
        self.tables.sort_by_key(|t| (t.world, t.links.name()));
        Ok(())
    }

    /// The algorithm for `bytes` on a `world`-rank group over `links`, if a table covers it.
    pub fn pick(&self, world: usize, links: LinkKind, bytes: u64) -> Option<Algorithm> {
        self.tables.iter().find(|t| t.world == world && t.links == links).map(|t| t.pick(bytes))
    }

    /// The file's text, headed by `comment` lines.
    pub fn to_toml(&self, comment: &str) -> String {
        let mut s: String = comment.lines().map(|l| format!("# {l}\n")).collect();
        for t in &self.tables {
            let rows: Vec<String> = t.rows.iter().map(|(b, a)| format!("[{b}, \"{}\"]", a.name())).collect();
            s += &format!("\n[[all_reduce]]\nworld = {}\nlinks = \"{}\"\nrows = [{}]\n", t.world, t.links.name(), rows.join(", "));
        }
        s
    }

    /// A short fingerprint of the tables (FNV-1a over their text), compared between ranks.
    pub fn digest(&self) -> String {
        let text = self.to_toml("");
        let h = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
        format!("{h:016x}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Algorithm::{HalvingDoubling as Halving, RecursiveDoubling as Doubling, Ring, Tree};

    #[test]
    fn tables_pick_by_size_and_read_back() {
        let mut t = Tuning::default();
        t.insert(TuneTable { world: 2, links: LinkKind::Shm, rows: vec![(65536, Doubling), (1 << 20, Halving), (1 << 24, Ring)] }).unwrap();
        t.insert(TuneTable { world: 4, links: LinkKind::Tcp, rows: vec![(4096, Tree), (1 << 22, Ring)] }).unwrap();
        assert_eq!(t.pick(2, LinkKind::Shm, 1), Some(Doubling));
        assert_eq!(t.pick(2, LinkKind::Shm, 65536), Some(Doubling));
        assert_eq!(t.pick(2, LinkKind::Shm, 65537), Some(Halving));
        assert_eq!(t.pick(2, LinkKind::Shm, 1 << 30), Some(Ring), "beyond the last row: its algorithm");
        assert_eq!(t.pick(4, LinkKind::Tcp, 100), Some(Tree));
        assert_eq!(t.pick(2, LinkKind::Tcp, 100), None, "no table for 2 ranks over TCP");
        assert_eq!(t.pick(3, LinkKind::Shm, 100), None);
        let text = t.to_toml("measured here\non purpose");
        assert!(text.starts_with("# measured here\n# on purpose\n"), "{text}");
        let back = Tuning::parse(&text, "t.toml").unwrap();
        assert_eq!(back, t);
        assert_eq!(back.digest(), t.digest());
        // A second table for the same world and links replaces the first.
        t.insert(TuneTable { world: 2, links: LinkKind::Shm, rows: vec![(1 << 24, Ring)] }).unwrap();
        assert_eq!((t.tables.len(), t.pick(2, LinkKind::Shm, 1)), (2, Some(Ring)));
        assert_ne!(t.digest(), back.digest());
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        let bad = |text: &str, want: &str| {
            let e = Tuning::parse(text, "tune.toml").unwrap_err();
            assert!(e.starts_with("tune.toml: ") && e.contains(want), "{e}");
        };
        bad(
            "[[all_reduce]]\nworld = 2\nlinks = \"shm\"\nrows = [[10, \"bogus\"]]\n",
            "algorithm `bogus` (one of doubling, halving, ring, tree)",
        );
        bad("[[all_reduce]]\nworld = 2\nlinks = \"nvlink\"\nrows = [[10, \"ring\"]]\n", "links `nvlink` (shm or tcp)");
        bad("[[all_reduce]]\nworld = 2\nlinks = \"shm\"\nrows = [[10, \"ring\"], [10, \"tree\"]]\n", "the rows' sizes must ascend");
        bad("[[all_reduce]]\nworld = 1\nlinks = \"shm\"\nrows = [[10, \"ring\"]]\n", "a world of at least 2 ranks");
        bad("[[all_reduce]]\nworld = 2\nlinks = \"shm\"\nrows = []\n", "no rows");
        bad("[[all_reduce]]\nworld = 2\nlinks = \"shm\"\nrows = [[10, \"ring\"]]\nspeed = 1\n", "unknown field `speed`");
        bad("[[all_reduce]]\nworld = 2\nlinks = \"shm\"\nrows = [[-1, \"ring\"]]\n", "");
    }

    /// The fastest algorithm per size, the fallback kept where it is within the margin, rows of
    /// the same algorithm merged.
    #[test]
    fn measurements_make_a_table() {
        let fallback = |b: u64| if b <= 65536 { Doubling } else { Ring };
        let sizes = vec![
            (4096, vec![(Doubling, 3.0e-6), (Halving, 3.1e-6), (Ring, 4.0e-6)]),
            (16384, vec![(Doubling, 5.1e-6), (Halving, 5.0e-6), (Ring, 6.0e-6)]), // within 5 %: doubling stays
            (65536, vec![(Doubling, 44e-6), (Halving, 8.7e-6), (Ring, 9.0e-6)]),  // the cliff: halving
            (262144, vec![(Doubling, 30e-6), (Halving, 19e-6), (Ring, 21e-6)]),   // halving by 10 %
            (1 << 20, vec![(Doubling, 90e-6), (Halving, 70e-6), (Ring, 69e-6)]),  // ring, the fallback, within 5 %
            (1 << 22, vec![(Doubling, 400e-6), (Halving, 300e-6), (Ring, 250e-6)]),
        ];
        let t = TuneTable::from_measurements(2, LinkKind::Shm, &sizes, fallback, 0.05).unwrap();
        assert_eq!(t.rows, vec![(16384, Doubling), (262144, Halving), (1 << 22, Ring)]);
        assert_eq!(t.pick(65536), Halving);
        let none = vec![(4096, vec![(Doubling, f64::NAN)])];
        assert!(TuneTable::from_measurements(2, LinkKind::Shm, &none, fallback, 0.05).unwrap_err().contains("at 4096 bytes"));
    }
}
