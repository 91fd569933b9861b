use super::*;
use crate::secure::{decode, encode, mask, unmask_sum, KeyPair};
use crate::wire::{Req, Resp, Update};
use kolo_rendezvous::JobToken;
use std::sync::{Arc, Mutex};

#[test]
fn masked_updates_hide_each_value_and_sum_exactly() {
    let keys: Vec<KeyPair> = (0..4u8).map(|i| KeyPair::from_bytes([i + 1; 32])).collect();
    let cohort: Vec<(u32, [u8; 32])> = keys.iter().enumerate().map(|(i, k)| (i as u32, k.public)).collect();
    let values: Vec<Vec<f64>> = (0..4).map(|i| (0..50).map(|j| (i * 50 + j) as f64 * 0.37 - 20.0).collect()).collect();
    let masked: Vec<Vec<u64>> = keys.iter().zip(&values).enumerate().map(|(i, (k, v))| mask(v, k, i as u32, &cohort, 3, 0)).collect();
    // A masked update says nothing about its values: far from their encoding.
    for (m, v) in masked.iter().zip(&values) {
        let close = m.iter().zip(v).filter(|(a, b)| (decode(**a) - **b).abs() < 1e3).count();
        assert!(close < 3, "{close} of 50 masked values are readable");
    }
    // The sum is exact: the masks cancel modulo 2^64; it equals the sum of the encodings.
    let sum = unmask_sum(&masked.iter().map(|v| &v[..]).collect::<Vec<_>>());
    for j in 0..50 {
        let plain: u64 = values.iter().map(|v| encode(v[j])).fold(0u64, u64::wrapping_add);
        assert_eq!(sum[j], decode(plain));
        let float: f64 = values.iter().map(|v| v[j]).sum();
        assert!((sum[j] - float).abs() < 4.0 / secure::SCALE, "{} vs {float}", sum[j]);
    }
    // Another round (or attempt) uses other masks.
    assert_ne!(mask(&values[0], &keys[0], 0, &cohort, 3, 1), masked[0]);
    assert_eq!(
        keys[0].pair_key(0, 1, &keys[1].public, 7, 0),
        keys[1].pair_key(1, 0, &keys[0].public, 7, 0),
        "both ends derive the same key"
    );
    assert_ne!(keys[0].pair_key(0, 1, &keys[1].public, 7, 0), keys[0].pair_key(0, 2, &keys[1].public, 7, 0), "the ids are part of the key");
}

/// A two-member cohort's mask is the ChaCha20 keystream of the pair's key (SplitMix64, used
/// before, is invertible: one known mask word gave away the rest of the stream).
#[test]
fn masks_are_chacha20_keystreams() {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let (a, b) = (KeyPair::from_bytes([7; 32]), KeyPair::from_bytes([9; 32]));
    let cohort = [(0u32, a.public), (5u32, b.public)];
    let masked = mask(&[0.0; 6], &a, 0, &cohort, 2, 1);
    let mut stream = rand_chacha::ChaCha20Rng::from_seed(a.pair_key(0, 5, &b.public, 2, 1));
    let want: Vec<u64> = (0..6).map(|_| stream.next_u64()).collect();
    assert_eq!(masked, want, "client 0 < 5 adds the stream to zeros");
    let other = mask(&[0.0; 6], &b, 5, &cohort, 2, 1);
    assert!(masked.iter().zip(&other).all(|(x, y)| x.wrapping_add(*y) == 0), "client 5 subtracts the same stream");
}

/// A client masks only for a cohort of at least MIN_COHORT distinct members that lists it
/// under its own key; FedSpec refuses fewer clients per round.
#[test]
fn clients_check_the_cohort_before_masking() {
    use crate::secure::{check_cohort, MIN_COHORT};
    let k = |i: u8| KeyPair::from_bytes([i; 32]).public;
    let good = [(0, k(1)), (1, k(2)), (2, k(3))];
    assert_eq!(check_cohort(&good, 1, &k(2), MIN_COHORT), Ok(()));
    let err = |c: &[(u32, [u8; 32])], me: u32, mine: [u8; 32]| check_cohort(c, me, &mine, MIN_COHORT).unwrap_err();
    assert!(err(&good[..2], 1, k(2)).contains("2 member(s)"), "two members learn each other's update");
    assert!(err(&good, 7, k(2)).contains("does not list this client (7)"));
    assert!(err(&good, 1, k(9)).contains("not its own"), "the server substituted this client's key");
    assert!(err(&[(0, k(1)), (1, k(2)), (2, k(1))], 1, k(2)).contains("client 2 twice or shares its public key with client 0"));
    assert!(err(&[(0, k(1)), (1, k(2)), (0, k(3))], 1, k(2)).contains("client 0 twice"));
    assert!(spec(4, true, 2).check().unwrap_err().to_string().contains("at least 3 clients per round"));
    assert!(spec(4, false, 2).check().is_ok());
}

/// Over real TCP: a connection acts only for the client it joined as. Another client's id in
/// an update, a poll or a second join on it is refused, and the round still completes.
#[test]
fn a_connection_cannot_act_for_another_client() {
    use kolo_ps::net::Channel;
    let token = JobToken::generate();
    let mut s = spec(2, true, 3);
    s.rounds = 1;
    let server = FedServer::start("127.0.0.1:0", token.clone(), s, vec![0.0; 2], Box::new(|_, _| {})).unwrap();
    let addr = server.addr.to_string();
    let timeout = std::time::Duration::from_secs(10);
    let clients: Vec<FedClient> = (0..3).map(|_| FedClient::join(&addr, &token, 10, None, timeout).unwrap()).collect();
    // The round opens for the three before the rogue connection joins (it is not sampled).
    let mut tasks: Vec<(FedClient, TrainTask)> = clients
        .into_iter()
        .map(|mut fc| match fc.next_task().unwrap() {
            Task::Train(t) => (fc, t),
            other => panic!("{other:?}"),
        })
        .collect();
    let mut rogue = Channel::<wire::Fed>::connect(&addr, &token, timeout).unwrap();
    let error = |r: Resp| match r {
        Resp::Error(m) => m,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let m = error(rogue.call(&Req::Update { id: 0, round: 0, attempt: 0, examples: 10, update: Update::Masked(vec![0; 2]) }).unwrap());
    assert!(m.contains("client 0: join on this connection first"), "{m}");
    let Resp::Joined { id, .. } = rogue.call(&Req::Join { examples: 10, public: Some([4; 32]), id: None, sig: None }).unwrap() else {
        panic!()
    };
    let m = error(rogue.call(&Req::Update { id: 0, round: 0, attempt: 0, examples: 10, update: Update::Masked(vec![0; 2]) }).unwrap());
    assert_eq!(m, format!("client 0: this connection joined as client {id}"));
    assert!(error(rogue.call(&Req::Poll { id: 1 }).unwrap()).contains("joined as client"));
    assert!(error(rogue.call(&Req::Join { examples: 1, public: Some([5; 32]), id: None, sig: None }).unwrap())
        .contains("already joined as client"));
    drop(rogue);
    let workers: Vec<_> = tasks
        .drain(..)
        .map(|(mut fc, first)| {
            std::thread::spawn(move || {
                assert!(fc.submit(&first, 10, &[1.0, 2.0]).unwrap());
                assert!(matches!(fc.next_task().unwrap(), Task::Done { .. }));
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let (rounds, global) = server.wait().unwrap();
    assert_eq!(rounds[0].used.len(), 3);
    assert!((global[0] - 1.0).abs() < 1e-5 && (global[1] - 2.0).abs() < 1e-5, "{global:?}");
}

#[test]
fn messages_round_trip_and_garbage_is_an_error() {
    let reqs = [
        Req::Join { examples: 60, public: Some([9; 32]), id: Some(4), sig: Some([7; 64]) },
        Req::Join { examples: 1, public: None, id: None, sig: None },
        Req::Poll { id: 4 },
        Req::Bye { id: 2 },
        Req::Update { id: 1, round: 2, attempt: 1, examples: 5, update: Update::Plain(vec![1.0, -2.5]) },
        Req::Update { id: 1, round: 2, attempt: 0, examples: 5, update: Update::Masked(vec![u64::MAX, 3]) },
    ];
    for r in &reqs {
        assert_eq!(&Req::decode(&r.encode()).unwrap(), r);
        let b = r.encode();
        for cut in 0..b.len() {
            assert!(Req::decode(&b[..cut]).is_err());
        }
    }
    let resps = [
        Resp::Joined { id: 3, numel: 10, secure: true },
        Resp::Wait,
        Resp::Train { round: 1, attempt: 0, params: vec![0.5; 3], cohort: vec![(0, [1; 32]), (2, [2; 32])], sigs: vec![[3; 64], [4; 64]] },
        Resp::Done { rounds: 4, params: vec![1.0] },
        Resp::Ack { taken: false, why: "late".into() },
        Resp::Error("no".into()),
    ];
    for r in &resps {
        assert_eq!(&Resp::decode(&r.encode()).unwrap(), r);
    }
    // A cohort that claims more members than the message holds.
    let mut b = Resp::Train { round: 0, attempt: 0, params: vec![], cohort: vec![], sigs: vec![] }.encode();
    let n = b.len();
    b[n - 8..].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(Resp::decode(&b).is_err());
}

fn spec(numel: usize, secure: bool, per_round: usize) -> FedSpec {
    FedSpec {
        rounds: 3,
        clients_per_round: per_round,
        min_clients: 3,
        deadline: std::time::Duration::from_secs(5),
        join_timeout: std::time::Duration::from_secs(10),
        max_attempts: 3,
        secure,
        seed: 1,
        numel,
        roster: None,
    }
}

/// Identities for clients 0..n in a fresh directory (through the files `kolo fed keygen` writes).
fn identities(n: u32, tag: &str) -> (std::path::PathBuf, identity::Roster) {
    let dir = std::env::temp_dir().join(format!("kolo-fed-ids-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    identity::generate(&dir, n).unwrap();
    let roster = identity::Roster::load(&dir.join("roster.txt")).unwrap();
    (dir, roster)
}

/// Three clients over real TCP, each "training" by adding its id+1 to every parameter: the
/// server moves the model by the example-weighted mean (plain, secure, and secure with signed
/// keys give the same model).
#[test]
fn rounds_average_updates_weighted_by_examples() {
    for (secure, signed) in [(false, false), (true, false), (true, true)] {
        let token = JobToken::generate();
        let reports = Arc::new(Mutex::new(Vec::new()));
        let r2 = reports.clone();
        let (dir, roster) = identities(3, "rounds");
        let server = FedServer::start(
            "127.0.0.1:0",
            token.clone(),
            FedSpec { roster: signed.then(|| roster.clone()), ..spec(4, secure, 3) },
            vec![0.0; 4],
            Box::new(move |r, g| r2.lock().unwrap().push((r.clone(), g.to_vec()))),
        )
        .unwrap();
        let addr = server.addr.to_string();
        let clients: Vec<_> = (0..3u64)
            .map(|c| {
                let (addr, token) = (addr.clone(), token.clone());
                let me = signed.then(|| (identity::Identity::load(&dir, c as u32).unwrap(), roster.clone()));
                std::thread::spawn(move || {
                    let examples = 10 * (c + 1);
                    let mut fc = FedClient::join_as(&addr, &token, examples, None, me, std::time::Duration::from_secs(10)).unwrap();
                    loop {
                        match fc.next_task().unwrap() {
                            Task::Train(t) => {
                                assert!(fc.submit(&t, examples, &[(c + 1) as f32; 4]).unwrap());
                            }
                            Task::Done { params, .. } => return params,
                        }
                    }
                })
            })
            .collect();
        let finals: Vec<Vec<f32>> = clients.into_iter().map(|h| h.join().unwrap()).collect();
        let (rounds, global) = server.wait().unwrap();
        // Weighted mean of 1, 2, 3 with weights 10, 20, 30 = 140 / 60 per round.
        let want = 3.0 * 140.0 / 60.0;
        for g in &global {
            assert!((g - want).abs() < 1e-5, "secure {secure}: {g} vs {want}");
        }
        assert!(finals.iter().all(|f| f == &global), "every client receives the final model");
        assert_eq!(rounds.len(), 3);
        assert!(rounds.iter().all(|r| r.used.len() == 3 && r.examples == 60 && r.late.is_empty()));
        assert_eq!(reports.lock().unwrap().len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// With a roster of client identities (#19 item 8): nobody joins as a client whose identity it
/// lacks, and a server that hands a client a cohort with a key of its own making (to strip that
/// client's masks) gets no update: the client refuses, unsent, naming the member whose key is
/// not signed by its identity.
#[test]
fn identities_stop_impersonation_and_key_substitution() {
    let token = JobToken::generate();
    let (dir, roster) = identities(3, "subst");
    let server = FedServer::start(
        "127.0.0.1:0",
        token.clone(),
        FedSpec { roster: Some(roster.clone()), ..spec(2, true, 3) },
        vec![0.0; 2],
        Box::new(|_, _| {}),
    )
    .unwrap();
    let addr = server.addr.to_string();
    let t = std::time::Duration::from_secs(10);
    let impostor = (identity::Identity::generate(0), roster.clone());
    let e = FedClient::join_as(&addr, &token, 10, None, Some(impostor), t).err().unwrap().to_string();
    assert!(e.contains("join refused: client 0's key is not signed by client 0's identity"), "{e}");
    let e = FedClient::join(&addr, &token, 10, Some(1), t).err().unwrap().to_string();
    assert!(e.contains("join with an id, a public key and its signature"), "{e}");
    drop(server);

    use kolo_ps::net::{ConnState, HandlerOf, Listener};
    let updates = Arc::new(Mutex::new(0usize));
    // The key and signature the client joined with.
    type Joined = Option<([u8; 32], [u8; 64])>;
    let joined: Arc<Mutex<Joined>> = Arc::default();
    let handler: HandlerOf<wire::Fed> = {
        let (updates, joined) = (updates.clone(), joined.clone());
        let fake = KeyPair::generate();
        Arc::new(move |_: &mut ConnState, req: Req, _: usize| match req {
            Req::Join { public, sig, .. } => {
                *joined.lock().unwrap() = Some((public.unwrap(), sig.unwrap()));
                Resp::Joined { id: 0, numel: 2, secure: true }
            }
            Req::Poll { .. } => {
                // The client's own key and signature, and members 1 and 2 under keys the server
                // made (it has their real keys' signatures only for their real keys).
                let (mine, my_sig) = joined.lock().unwrap().unwrap();
                let cohort = vec![(0, mine), (1, fake.public), (2, [9; 32])];
                Resp::Train { round: 0, attempt: 0, params: vec![0.0; 2], cohort, sigs: vec![my_sig, my_sig, [0; 64]] }
            }
            _ => {
                *updates.lock().unwrap() += 1;
                Resp::Ack { taken: true, why: String::new() }
            }
        })
    };
    let listener = Listener::start_with::<wire::Fed>("127.0.0.1:0", token.clone(), "hostile", handler).unwrap();
    let me = (identity::Identity::load(&dir, 0).unwrap(), roster);
    let mut fc = FedClient::join_as(&listener.addr.to_string(), &token, 10, None, Some(me), t).unwrap();
    let Task::Train(task) = fc.next_task().unwrap() else { panic!() };
    let e = fc.submit(&task, 10, &[1.0, 2.0]).unwrap_err().to_string();
    assert!(e.contains("client 0, round 0: client 1's key is not signed by client 1's identity (a server substituting keys?)"), "{e}");
    assert_eq!(*updates.lock().unwrap(), 0, "nothing was sent");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client that never answers: a plain round goes on without it at the deadline; a secure
/// round is run again with the members that answered (their masks then cancel).
#[test]
fn a_silent_client_is_left_out_at_the_deadline() {
    for secure in [false, true] {
        let token = JobToken::generate();
        let mut s = spec(2, secure, 4);
        (s.rounds, s.min_clients) = (1, 4);
        s.deadline = std::time::Duration::from_millis(600);
        let server = FedServer::start("127.0.0.1:0", token.clone(), s, vec![0.0; 2], Box::new(|_, _| {})).unwrap();
        let addr = server.addr.to_string();
        // Client 0 joins first and then never trains.
        let mut silent = FedClient::join(&addr, &token, 5, None, std::time::Duration::from_secs(10)).unwrap();
        let workers: Vec<_> = (1..4u64)
            .map(|c| {
                let (addr, token) = (addr.clone(), token.clone());
                std::thread::spawn(move || {
                    let mut fc = FedClient::join(&addr, &token, 10, None, std::time::Duration::from_secs(10)).unwrap();
                    while let Task::Train(t) = fc.next_task().unwrap() {
                        fc.submit(&t, 10, &[c as f32, c as f32]).unwrap();
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert!(matches!(silent.next_task().unwrap(), Task::Done { .. }), "even a silent client gets the final model");
        let (rounds, global) = server.wait().unwrap();
        assert_eq!(rounds[0].late, vec![0], "secure {secure}");
        assert_eq!(rounds[0].used, vec![1, 2, 3]);
        assert_eq!(rounds[0].attempts, if secure { 2 } else { 1 });
        assert!((global[0] - 2.0).abs() < 1e-5, "mean of 1, 2 and 3: {}", global[0]);
    }
}

/// Client sampling: 5 clients, 2 per round: every round's cohort has 2 distinct members, rounds
/// differ, the model moves by the mean of exactly the sampled clients' updates, and clients
/// that join with their own ids (in whatever order) see the same sample in every run.
#[test]
fn each_round_samples_its_clients() {
    let job = || {
        let token = JobToken::generate();
        let mut s = spec(1, false, 2);
        s.rounds = 6;
        s.min_clients = 5;
        let server = FedServer::start("127.0.0.1:0", token.clone(), s, vec![0.0], Box::new(|_, _| {})).unwrap();
        let addr = server.addr.to_string();
        let clients: Vec<_> = (0..5u32)
            .rev()
            .map(|c| {
                let (addr, token) = (addr.clone(), token.clone());
                std::thread::spawn(move || {
                    let mut fc = FedClient::join(&addr, &token, 1, Some(c), std::time::Duration::from_secs(10)).unwrap();
                    assert_eq!(fc.id, c);
                    while let Task::Train(t) = fc.next_task().unwrap() {
                        fc.submit(&t, 1, &[c as f32]).unwrap();
                    }
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
        server.wait().unwrap()
    };
    let (rounds, global) = job();
    let mut want = 0.0;
    for r in &rounds {
        assert_eq!(r.used.len(), 2);
        assert_ne!(r.used[0], r.used[1]);
        want += (r.used[0] + r.used[1]) as f32 / 2.0;
    }
    assert!(rounds.iter().any(|r| r.used != rounds[0].used), "the sample changes between rounds");
    assert!((global[0] - want).abs() < 1e-5);
    let (again, _) = job();
    assert_eq!(
        rounds.iter().map(|r| r.used.clone()).collect::<Vec<_>>(),
        again.iter().map(|r| r.used.clone()).collect::<Vec<_>>(),
        "the same seed samples the same clients"
    );
}

/// A client id can be taken once.
#[test]
fn a_taken_client_id_is_refused() {
    let token = JobToken::generate();
    let server = FedServer::start("127.0.0.1:0", token.clone(), spec(1, false, 1), vec![0.0], Box::new(|_, _| {})).unwrap();
    let addr = server.addr.to_string();
    let _a = FedClient::join(&addr, &token, 1, Some(3), std::time::Duration::from_secs(10)).unwrap();
    let e = FedClient::join(&addr, &token, 1, Some(3), std::time::Duration::from_secs(10)).err().expect("refused");
    assert!(e.to_string().contains("already joined"), "{e}");
}

/// A client's example count is bounded at the door (issue #19: two clients claiming u64::MAX / 2
/// + 1 examples each overflowed the server's weighted-average sum).
#[test]
fn absurd_example_counts_are_refused() {
    let token = JobToken::generate();
    let server = FedServer::start("127.0.0.1:0", token.clone(), spec(1, false, 1), vec![0.0], Box::new(|_, _| {})).unwrap();
    let addr = server.addr.to_string();
    for examples in [0, server::MAX_CLIENT_EXAMPLES + 1, u64::MAX / 2 + 1] {
        let e = FedClient::join(&addr, &token, examples, None, std::time::Duration::from_secs(10)).err().expect("refused");
        assert!(e.to_string().contains("training examples"), "{examples}: {e}");
    }
    assert!(FedClient::join(&addr, &token, server::MAX_CLIENT_EXAMPLES, None, std::time::Duration::from_secs(10)).is_ok());
}

proptest::proptest! {
    /// Valid FedAvg messages mutated (a byte changed, cut short, or grown) decode or fail, never
    /// panic (issue #19).
    #[test]
    fn mutated_valid_messages_never_panic(which in 0usize..5, pos in proptest::prelude::any::<usize>(), byte in proptest::prelude::any::<u8>(), cut in proptest::prelude::any::<usize>(), mode in 0u8..3) {
        let msgs: [Vec<u8>; 5] = [
            Req::Join { examples: 60, public: Some([9; 32]), id: Some(4), sig: Some([7; 64]) }.encode(),
            Req::Update { id: 1, round: 2, attempt: 1, examples: 5, update: Update::Plain(vec![1.0, -2.5]) }.encode(),
            Req::Update { id: 1, round: 2, attempt: 0, examples: 5, update: Update::Masked(vec![u64::MAX, 3]) }.encode(),
            Resp::Joined { id: 3, numel: 10, secure: true }.encode(),
            Resp::Wait.encode(),
        ];
        let mut b = msgs[which].clone();
        match mode {
            0 => { let i = pos % b.len(); b[i] = byte; }
            1 => b.truncate(cut % (b.len() + 1)),
            _ => b.extend(std::iter::repeat_n(byte, cut % 16)),
        }
        let _ = Req::decode(&b);
        let _ = Resp::decode(&b);
    }
}

/// A hostile server (a listener answering with a two-member cohort) gets no update: the client
/// refuses before sending anything.
#[test]
fn a_client_refuses_a_small_cohort_from_a_hostile_server() {
    use kolo_ps::net::{ConnState, HandlerOf, Listener};
    let token = JobToken::generate();
    let updates = Arc::new(Mutex::new(0usize));
    let handler: HandlerOf<wire::Fed> = {
        let updates = updates.clone();
        Arc::new(move |_: &mut ConnState, req: Req, _: usize| match req {
            Req::Join { .. } => Resp::Joined { id: 0, numel: 2, secure: true },
            Req::Poll { .. } => {
                Resp::Train { round: 0, attempt: 0, params: vec![0.0; 2], cohort: vec![(0, [1; 32]), (1, [2; 32])], sigs: vec![] }
            }
            _ => {
                *updates.lock().unwrap() += 1;
                Resp::Ack { taken: true, why: String::new() }
            }
        })
    };
    let listener = Listener::start_with::<wire::Fed>("127.0.0.1:0", token.clone(), "hostile", handler).unwrap();
    let mut fc = FedClient::join(&listener.addr.to_string(), &token, 10, None, std::time::Duration::from_secs(10)).unwrap();
    let Task::Train(t) = fc.next_task().unwrap() else { panic!() };
    let e = fc.submit(&t, 10, &[1.0, 2.0]).unwrap_err().to_string();
    assert!(e.contains("client 0, round 0: a secure cohort of 2 member(s)"), "{e}");
    assert_eq!(*updates.lock().unwrap(), 0, "nothing was sent");
}
