//! The crate's shape: its modules import one another without a circle (ARCHITECTURE.md).

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
