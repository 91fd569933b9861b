//! The code's shape (ARCHITECTURE.md's invariants): this crate's modules import one another
//! without a circle, and the process environment is read only where the architecture says.

use std::collections::BTreeMap;

/// Each module of `src/` and the modules it names as `crate::name` outside comments.
fn imports() -> BTreeMap<String, Vec<String>> {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph = BTreeMap::new();
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path.file_stem().and_then(|s| s.to_str()).filter(|_| path.extension().is_some_and(|e| e == "rs")) else {
            continue;
        };
        let mut uses: Vec<String> = Vec::new();
        for line in std::fs::read_to_string(&path).unwrap().lines().filter(|l| !l.trim_start().starts_with("//")) {
            for (i, _) in line.match_indices("crate::") {
                let rest = &line[i + 7..];
                let m: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if m != name && src.join(format!("{m}.rs")).exists() && !uses.contains(&m) {
                    uses.push(m);
                }
            }
        }
        graph.insert(name.to_string(), uses);
    }
    graph
}

/// A circle in `graph`, if there is one, as the modules along it.
fn circle(graph: &BTreeMap<String, Vec<String>>) -> Option<Vec<String>> {
    fn visit(m: &str, g: &BTreeMap<String, Vec<String>>, path: &mut Vec<String>, done: &mut Vec<String>) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut c = path[at..].to_vec();
            c.push(m.to_string());
            return Some(c);
        }
        if done.iter().any(|d| d == m) {
            return None;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, g, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.push(m.to_string());
        None
    }
    let mut done = Vec::new();
    graph.keys().find_map(|m| visit(m, graph, &mut Vec::new(), &mut done))
}

#[test]
fn modules_import_each_other_without_a_circle() {
    let graph = imports();
    assert!(graph.len() > 20 && graph["driver"].contains(&"setup".to_string()), "the graph was not read: {graph:?}");
    assert_eq!(circle(&graph), None, "an import circle");
    let mut with_one = graph.clone();
    with_one.get_mut("setup").unwrap().push("driver".into());
    assert!(circle(&with_one).is_some(), "the check misses a circle");
}

/// Where a library may read the process environment, and what: joining a job (`kolo::init`,
/// as torch's `env://`, and a parameter-server job's worker, `kolo::PsJoin::from_env`), the
/// kernel override, the host identity, detecting mpirun, the GPU of a rank, the allocator
/// switch. Binaries, the launcher and build scripts read what they like.
const ENV_READERS: [(&str, &str); 8] = [
    ("kolo/src/dist.rs", "std::env::vars()"),
    ("kolo/src/ps_worker.rs", "std::env::var(k)"),
    ("kolo-base/src/simd.rs", "CAPABILITY_ENV"),
    ("kolo-collectives/src/connect.rs", "\"KOLO_HOST_ID\""),
    ("kolo-mpi/src/lib.rs", "\"OMPI_COMM_WORLD_SIZE\""),
    ("kolo-nccl/src/lib.rs", "\"KOLO_CUDA_DEVICE\""),
    ("kolo-train/src/summary.rs", "\"KOLO_HEAP\""),
    ("kolo-train/src/run.rs", "\"LOCAL_RANK\""),
];

/// Every library source file (not binaries, the launcher, the test kit or test files), as
/// its path under `crates/` and its lines outside `//` comments.
fn library_sources(crates: &std::path::Path) -> Vec<(String, Vec<String>)> {
    fn walk(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() && p.file_name().is_some_and(|n| n != "bin" && n != "tests") {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") && p.file_name().is_some_and(|n| n != "main.rs" && n != "tests.rs") {
                out.push(p);
            }
        }
    }
    let mut sources = Vec::new();
    for krate in std::fs::read_dir(crates).unwrap() {
        let krate = krate.unwrap().path();
        let name = krate.file_name().unwrap().to_string_lossy().into_owned();
        if ["kolo-cli", "kolo-launch", "kolo-testkit"].contains(&name.as_str()) || !krate.join("src").is_dir() {
            continue;
        }
        let mut files = Vec::new();
        walk(&krate.join("src"), &mut files);
        for f in files {
            let rel = f.strip_prefix(crates).unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&f).unwrap();
            sources.push((rel, text.lines().filter(|l| !l.trim_start().starts_with("//")).map(str::to_string).collect()));
        }
    }
    sources
}

/// `(file, line)` of every read of the environment in the libraries' sources.
fn env_reads(crates: &std::path::Path) -> Vec<(String, String)> {
    let mut reads = Vec::new();
    for (rel, lines) in library_sources(crates) {
        for line in lines {
            if ["env::var(", "env::var_os(", "env::vars("].iter().any(|p| line.contains(p)) {
                reads.push((rel.clone(), line.trim().to_string()));
            }
        }
    }
    reads
}

#[test]
fn libraries_read_the_environment_only_where_the_architecture_says() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let reads = env_reads(&crates);
    assert!(reads.iter().any(|(f, _)| f == "kolo/src/dist.rs"), "the scan found nothing: {reads:?}");
    let stray: Vec<_> = reads.iter().filter(|(f, line)| !ENV_READERS.iter().any(|(af, what)| f == af && line.contains(what))).collect();
    assert!(stray.is_empty(), "the environment is read outside ARCHITECTURE.md's list: {stray:#?}");
}

/// The functions of the libraries that take the whole `kolo train` config: the entry points of
/// its jobs (a run, a parameter-server worker and its evaluation group, a federated server and
/// client), what resolves it (the data, [`kolo_train::setup::Setup`], the planner's vocabulary)
/// and what compares it between ranks. Every strategy and the driver receive the resolved
/// `Setup` (ARCHITECTURE.md: "configuration resolved once").
const WHOLE_CONFIG_READERS: [(&str, &str); 15] = [
    ("kolo-train/src/run.rs", "run"),
    ("kolo-train/src/setup.rs", "new"),
    ("kolo-train/src/setup.rs", "load_data"),
    ("kolo-train/src/agreement.rs", "settings"),
    ("kolo-train/src/agreement.rs", "check_same_job"),
    ("kolo-train/src/autoplan.rs", "text_vocab"),
    ("kolo-train/src/eval.rs", "evaluate_params"),
    ("kolo-train/src/ps_worker.rs", "run_ps"),
    ("kolo-train/src/ps_worker.rs", "run_ps_eval"),
    ("kolo-fed/src/job.rs", "initial_model"),
    ("kolo-fed/src/job.rs", "spec"),
    ("kolo-fed/src/job.rs", "serve"),
    ("kolo-fed/src/job.rs", "client"),
    ("kolo/src/builtin.rs", "run"),
    ("kolo/src/options.rs", "from_train_config"),
];

/// `(file, function)` of every parameter typed as the whole config, `&Config` in any of its
/// spellings, in the libraries' sources.
fn whole_config_params(crates: &std::path::Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (rel, lines) in library_sources(crates) {
        let text = lines.join("\n");
        for ty in ["&Config", "&kolo_train::Config", "&kolo_train::config::Config"] {
            for (at, _) in text.match_indices(&format!(": {ty}")) {
                let end = at + 2 + ty.len();
                if text[end..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    continue;
                }
                let Some(f) = text[..at].rfind("fn ") else { continue };
                let name: String = text[f + 3..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                found.push((rel.clone(), name));
            }
        }
    }
    found
}

#[test]
fn only_entry_points_and_resolvers_take_the_whole_config() {
    let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let found = whole_config_params(&crates);
    let has = |f: &str, n: &str| found.iter().any(|(ff, nn)| ff == f && nn == n);
    assert!(has("kolo-train/src/run.rs", "run") && has("kolo/src/options.rs", "from_train_config"), "the scan found nothing: {found:?}");
    let stray: Vec<_> = found.iter().filter(|(f, n)| !WHOLE_CONFIG_READERS.iter().any(|(af, an)| f == af && n == an)).collect();
    assert!(
        stray.is_empty(),
        "functions outside the entry points and resolvers take the whole config (give them `Setup` or the tables they read): {stray:#?}"
    );
}
