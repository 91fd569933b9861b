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

/// `(file, line)` of every read of the environment in the libraries' sources.
fn env_reads(crates: &std::path::Path) -> Vec<(String, String)> {
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
    let mut reads = Vec::new();
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
            for line in std::fs::read_to_string(&f).unwrap().lines().filter(|l| !l.trim_start().starts_with("//")) {
                if ["env::var(", "env::var_os(", "env::vars("].iter().any(|p| line.contains(p)) {
                    reads.push((rel.clone(), line.trim().to_string()));
                }
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
