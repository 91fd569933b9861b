//! The `kolo fed` job: federated averaging of Kolo's MNIST models as a `kolo train` config's
//! `[fed]` table describes it: the split of the training set into client shards (IID or by
//! label), a client's local training, and the server with per-round evaluation. The protocol,
//! sampling, deadlines and secure aggregation are this crate's other modules.

/// Client identities (`kolo fed keygen`), for programs that depend on this crate alone.
use crate::{FedClient, FedServer, FedSpec, RoundReport, Task};
use kolo_base::Rng;
use kolo_optim::Optimizer;
use kolo_rendezvous::JobToken;
use kolo_tensor::{build_model, Model, PlainView};
use kolo_train::config::{Config, FedSplit};
use kolo_train::data::{Dataset, Mnist};
use kolo_train::eval::evaluate;
use kolo_train::summary::Eval;
use kolo_train::TrainError;
use std::path::Path;
use std::time::Duration;

/// Splits examples with `labels` into `clients` shards. IID: a random equal share each. By
/// label (McMahan et al.'s pathological non-IID split): sorted by label, cut into
/// `clients x per_client` equal shards, each client gets `per_client` of them at random, so
/// most clients see only `per_client` digits. Pure and seeded: every process computes the same.
pub fn client_shards(labels: &[u8], clients: usize, split: FedSplit, per_client: usize, seed: u64) -> Vec<Vec<usize>> {
    let mut rng = Rng::new(seed ^ 0xFED);
    let n = labels.len();
    match split {
        FedSplit::Iid => {
            let mut idx: Vec<usize> = (0..n).collect();
            rng.shuffle(&mut idx);
            let per = n / clients.max(1);
            (0..clients).map(|c| idx[c * per..(c + 1) * per].to_vec()).collect()
        }
        FedSplit::Labels => {
            let mut idx: Vec<usize> = (0..n).collect();
            idx.sort_by_key(|&i| (labels[i], i));
            let shards = clients * per_client;
            let size = n / shards.max(1);
            let mut order: Vec<usize> = (0..shards).collect();
            rng.shuffle(&mut order);
            (0..clients)
                .map(|c| {
                    order[c * per_client..(c + 1) * per_client]
                        .iter()
                        .flat_map(|&s| idx[s * size..(s + 1) * size].iter().copied())
                        .collect()
                })
                .collect()
        }
    }
}

/// The model's flat parameters at the start (the seed's initialisation).
fn initial_model(cfg: &Config) -> Result<Box<dyn Model>, TrainError> {
    Ok(build_model(&cfg.model_spec(10), cfg.train.seed)?)
}

fn spec(cfg: &Config, numel: usize, expect: usize) -> Result<FedSpec, TrainError> {
    let f = cfg.fed.as_ref().ok_or_else(|| TrainError::Config("no [fed] section in the config".into()))?;
    Ok(FedSpec {
        rounds: f.rounds,
        clients_per_round: f.clients_per_round.unwrap_or(f.clients),
        // Every expected client joins before the first round: one that came after the last
        // round would find no server.
        min_clients: expect.max(1),
        deadline: Duration::from_secs_f64(f.round_deadline_secs),
        join_timeout: Duration::from_secs_f64(f.round_deadline_secs.max(30.0)),
        max_attempts: 3,
        secure: f.secure,
        seed: cfg.train.seed,
        numel,
        roster: f.identities.as_deref().map(|d| roster(Path::new(d))).transpose()?,
    })
}

/// The roster of client identities in `dir` (`kolo fed keygen`).
fn roster(dir: &Path) -> Result<crate::identity::Roster, TrainError> {
    crate::identity::Roster::load(&dir.join("roster.txt")).map_err(|e| TrainError::Config(format!("fed.identities: {e}")))
}

/// What the server reports at the end.
pub struct FedSummary {
    pub rounds: Vec<RoundReport>,
    /// Evaluation of the global model after each round.
    pub evals: Vec<Eval>,
    pub params: Vec<f32>,
}

/// Runs the server on `listen` until the last round, once `expect` clients have joined (a
/// deadline: the round deadline, at least 30 s); evaluates the global model on the test set
/// after each round (`train.eval_batches` batches; 0 = all of it).
pub fn serve(
    cfg: &Config,
    listen: &str,
    token: JobToken,
    expect: usize,
    on_ready: impl FnOnce(&str),
    say: &(dyn Fn(&str) + Sync),
) -> Result<FedSummary, TrainError> {
    let dir = cfg.data.path.as_ref().ok_or_else(|| TrainError::Config("data.path (the MNIST directory) is required".into()))?;
    let test = Mnist::load(Path::new(dir), "t10k")?;
    let model = initial_model(cfg)?;
    let initial = model.params().to_flat()?;
    let s = spec(cfg, initial.len(), expect)?;
    say(&format!(
        "kolo fed: {} params, {} rounds, {} of {} clients per round, deadline {:.0} s{}{}",
        initial.len(),
        s.rounds,
        s.clients_per_round,
        cfg.fed.as_ref().map_or(0, |f| f.clients),
        s.deadline.as_secs_f64(),
        if s.secure { ", secure aggregation" } else { "" },
        s.roster.as_ref().map_or(String::new(), |r| format!(", keys signed by a roster of {} client identities", r.len()))
    ));
    let (tx, rx) = std::sync::mpsc::channel::<(RoundReport, Vec<f32>)>();
    let server = FedServer::start(
        listen,
        token,
        s,
        initial,
        Box::new(move |r, g| {
            let _ = tx.send((r.clone(), g.to_vec()));
        }),
    )
    .map_err(|e| TrainError::Other(e.to_string()))?;
    on_ready(&server.addr.to_string());
    // Evaluate each round's model here (the driver thread only hands it over).
    let local = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(1).expect("1 > 0")).remove(0);
    let mut evals = Vec::new();
    for (r, global) in rx {
        model.params().load(&global)?;
        let e = evaluate(&*model, &PlainView, &test, &local, cfg.data.batch_size.max(1), cfg.train.eval_batches, false, &|| Ok(()))?;
        say(&format!(
            "round {}: {} client(s) {:?}{} trained on {} examples in {:.2} s; test loss {:.4}, accuracy {:.2}%",
            r.round + 1,
            r.used.len(),
            r.used,
            if r.late.is_empty() { String::new() } else { format!(" (late: {:?}, attempts {})", r.late, r.attempts) },
            r.examples,
            r.secs,
            e.loss,
            e.accuracy.unwrap_or(0.0) * 100.0
        ));
        evals.push(e);
    }
    let (rounds, params) = server.wait().map_err(|e| TrainError::Other(e.to_string()))?;
    Ok(FedSummary { rounds, evals, params })
}

/// What a client did.
pub struct ClientReport {
    pub rounds_trained: u32,
    /// The training examples it holds (indices into the MNIST training set).
    pub shard: Vec<usize>,
    /// Bytes this client sent and received (frames included).
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// With `record`: every message body the client sent.
    pub sent: Vec<u8>,
    pub params: Vec<f32>,
}

/// Client `index` of `[fed] clients`: joins the server at `addr`, and for each round it is
/// sampled for, trains `local_epochs` epochs of minibatch SGD (the `[optim]` optimizer, fresh
/// each round) on its own shard from the global model, and sends the change.
pub fn client(cfg: &Config, addr: &str, token: &JobToken, index: usize, record: bool) -> Result<ClientReport, TrainError> {
    let f = cfg.fed.as_ref().ok_or_else(|| TrainError::Config("no [fed] section in the config".into()))?;
    if index >= f.clients {
        return Err(TrainError::Config(format!("client {index} of a job with {} clients", f.clients)));
    }
    let dir = cfg.data.path.as_ref().ok_or_else(|| TrainError::Config("data.path (the MNIST directory) is required".into()))?;
    let train = Mnist::load(Path::new(dir), "train")?;
    let mut shard = client_shards(train.labels(), f.clients, f.split, f.labels_per_client, cfg.train.seed).swap_remove(index);
    if let Some(cap) = f.examples_per_client {
        let mut rng = Rng::new(cfg.train.seed ^ index as u64);
        rng.shuffle(&mut shard);
        shard.truncate(cap);
    }
    let model = initial_model(cfg)?;
    let me = match f.identities.as_deref().map(Path::new) {
        Some(d) => Some((
            crate::identity::Identity::load(d, index as u32).map_err(|e| TrainError::Config(format!("fed.identities: {e}")))?,
            roster(d)?,
        )),
        None => None,
    };
    let timeout = Duration::from_secs_f64(f.round_deadline_secs.max(30.0));
    let mut fc = FedClient::join_as(addr, token, shard.len() as u64, Some(index as u32), me, timeout)
        .map_err(|e| TrainError::Other(format!("client {index}: {e}")))?;
    if record {
        fc.record();
    }
    let te = kolo_tensor::TensorError::from;
    let mut rng = Rng::new(cfg.train.seed.wrapping_add(1 + index as u64));
    let mut rounds_trained = 0;
    let batch = cfg.data.batch_size.max(1);
    loop {
        match fc.next_task().map_err(|e| TrainError::Other(format!("client {index}: {e}")))? {
            Task::Done { params, .. } => {
                let (bytes_out, bytes_in) = fc.bytes();
                return Ok(ClientReport { rounds_trained, shard, bytes_out, bytes_in, sent: fc.recorded().to_vec(), params });
            }
            Task::Train(t) => {
                model.params().load(&t.params)?;
                let mut opt = Optimizer::new(cfg.optimizer(), t.params.len());
                let mut grads = vec![0f32; t.params.len()];
                for _ in 0..f.local_epochs {
                    rng.shuffle(&mut shard);
                    for chunk in shard.chunks(batch) {
                        let b = train.batch(chunk);
                        let g = model.loss(&b, &PlainView)?.backward().map_err(te)?;
                        model.params().grads_into(&g, &mut grads)?;
                        kolo_train::setup::optimizer_step(model.params(), &mut opt, &grads, cfg.optim.lr)?;
                    }
                }
                let delta: Vec<f32> = model.params().to_flat()?.iter().zip(&t.params).map(|(a, b)| a - b).collect();
                if fc.submit(&t, shard.len() as u64, &delta).map_err(|e| TrainError::Other(format!("client {index}: {e}")))? {
                    rounds_trained += 1;
                }
            }
        }
    }
}

/// Does `haystack` contain the little-endian bytes of `needle` (a client's example) anywhere?
pub fn contains_example(haystack: &[u8], needle: &[f32]) -> bool {
    let bytes: Vec<u8> = needle.iter().flat_map(|x| x.to_le_bytes()).collect();
    // Search for the first 64 bytes (16 pixels) of the image, then confirm.
    let probe = &bytes[..bytes.len().min(64)];
    haystack.windows(probe.len()).enumerate().any(|(i, w)| w == probe && haystack.get(i..i + bytes.len()).is_some_and(|s| s == &bytes[..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_disjoint_and_the_label_split_is_non_iid() {
        let labels: Vec<u8> = (0..6000).map(|i| (i * 7 % 10) as u8).collect();
        for split in [FedSplit::Iid, FedSplit::Labels] {
            let shards = client_shards(&labels, 10, split, 2, 3);
            let mut all: Vec<usize> = shards.iter().flatten().copied().collect();
            all.sort_unstable();
            all.dedup();
            assert_eq!(all.len(), shards.iter().map(Vec::len).sum::<usize>(), "{split:?}: disjoint");
            assert!(shards.iter().all(|s| s.len() == 600));
            let digits: Vec<usize> = shards
                .iter()
                .map(|s| {
                    let mut d: Vec<u8> = s.iter().map(|&i| labels[i]).collect();
                    d.sort_unstable();
                    d.dedup();
                    d.len()
                })
                .collect();
            match split {
                FedSplit::Iid => assert!(digits.iter().all(|&d| d == 10)),
                FedSplit::Labels => assert!(digits.iter().all(|&d| d <= 2), "{digits:?}"),
            }
        }
        assert_eq!(client_shards(&labels, 10, FedSplit::Labels, 2, 3), client_shards(&labels, 10, FedSplit::Labels, 2, 3));
    }

    #[test]
    fn example_search_finds_exact_bytes_only() {
        let ex: Vec<f32> = (0..784).map(|i| i as f32 * 0.01 - 1.0).collect();
        let mut hay: Vec<u8> = vec![7; 100];
        hay.extend(ex.iter().flat_map(|x| x.to_le_bytes()));
        hay.extend([1, 2, 3]);
        assert!(contains_example(&hay, &ex));
        let mut other = ex.clone();
        other[700] += 1.0;
        assert!(!contains_example(&hay, &other));
    }
}
