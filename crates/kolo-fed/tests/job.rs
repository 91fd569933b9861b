//! The `kolo fed` job: federated averaging on non-IID MNIST, with no raw data leaving a client.

use kolo_train::Config;

fn mnist_cfg(extra: &str, batch: usize) -> Config {
    let text = format!(
        "[model]\nkind = \"mlp\"\nhidden = [32]\n[data]\nkind = \"mnist\"\npath = \"{}\"\nbatch_size = {batch}\nprefetch = 2\n{extra}",
        kolo_testkit::files::mnist_dir().display()
    );
    Config::parse(&text, "test").unwrap()
}

use kolo_testkit::max_abs_diff as max_diff;

fn fed_job(cfg: &Config, clients: usize) -> (kolo_fed::job::FedSummary, Vec<kolo_fed::job::ClientReport>) {
    let token = kolo_rendezvous::JobToken::generate();
    let (tx, rx) = std::sync::mpsc::channel();
    let (c2, t2) = (cfg.clone(), token.clone());
    let server = std::thread::spawn(move || {
        kolo_fed::job::serve(&c2, "127.0.0.1:0", t2, clients, |a| tx.send(a.to_string()).unwrap(), &|_| {}).unwrap()
    });
    let addr = rx.recv().unwrap();
    let handles: Vec<_> = (0..clients)
        .map(|i| {
            let (cfg, addr, token) = (cfg.clone(), addr.clone(), token.clone());
            std::thread::spawn(move || kolo_fed::job::client(&cfg, &addr, &token, i, true).unwrap())
        })
        .collect();
    let reports = handles.into_iter().map(|h| h.join().unwrap()).collect();
    (server.join().unwrap(), reports)
}

/// FedAvg on non-IID MNIST: each of 6 clients holds 2 label-sorted shards (1500 examples, at
/// most 4 digits), trains one local epoch per round; after 25 rounds the global model passes 78%
/// (MLP 784-32-10); what a client sent is model-sized updates only (none of its images' bytes);
/// secure aggregation (pairwise masks) ends with the same model as plain averaging.
#[test]
fn fedavg_learns_non_iid_mnist_and_raw_data_never_leaves_a_client() {
    let text = |secure: bool| {
        format!(
            "[optim]\nkind = \"sgd\"\nlr = 0.02\n[train]\neval_batches = 40\n[fed]\nrounds = 25\nclients = 6\nclients_per_round = 6\nexamples_per_client = 1500\nsplit = \"labels\"\nsecure = {secure}\n"
        )
    };
    let plain_cfg = mnist_cfg(&text(false), 20);
    let (plain, reports) = fed_job(&plain_cfg, 6);
    let acc = plain.evals.last().unwrap().accuracy.unwrap();
    let first = plain.evals[0].accuracy.unwrap();
    eprintln!("FedAvg accuracy by round: {:?}", plain.evals.iter().map(|e| e.accuracy.unwrap()).collect::<Vec<_>>());
    assert!(acc > 0.78 && acc > first + 0.2, "accuracy after 25 rounds {acc} (after round 1: {first})");
    assert_eq!(plain.rounds.len(), 25);
    assert!(plain.rounds.iter().all(|r| r.used.len() == 6 && r.late.is_empty()));
    // What left each client: its example count, polls and its updates; never an image.
    let data = kolo_train::data::Mnist::load(&kolo_testkit::files::mnist_dir(), "train").unwrap();
    let numel = plain.params.len() as u64;
    for (i, r) in reports.iter().enumerate() {
        assert_eq!(r.params, plain.params, "client {i} received the final model");
        assert!(r.rounds_trained >= 1);
        // Each update is 4 bytes per parameter plus a 30-byte header; joins and polls are tiny.
        let updates = u64::from(r.rounds_trained) * (numel * 4 + 30);
        assert!(
            r.bytes_out >= updates && r.bytes_out < updates + 20_000,
            "client {i} sent {} bytes for {} updates",
            r.bytes_out,
            r.rounds_trained
        );
        assert_eq!(r.shard.len(), 1500);
        let digits: std::collections::BTreeSet<u8> = r.shard.iter().map(|&e| data.labels()[e]).collect();
        assert!(digits.len() <= 4, "client {i} holds digits {digits:?}: not the non-IID split (2 shards, each within at most 2 digits)");
        for &ex in r.shard.iter().step_by(15) {
            assert!(!kolo_fed::job::contains_example(&r.sent, data.image(ex)), "client {i} sent the bytes of example {ex}");
        }
    }
    let (secure, _) = fed_job(&mnist_cfg(&text(true), 20), 6);
    let d = max_diff(&secure.params, &plain.params);
    assert!(d < 1e-4, "secure aggregation ends {d} away from plain averaging");
}
