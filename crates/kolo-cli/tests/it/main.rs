//! Process-level tests: real `kolo` processes, real sockets and shared memory, the real launcher.
//! One file per topic (the modules below); this file holds what they share: running `kolo`,
//! its output, fresh directories, checkpoint readers.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const KOLO: &str = env!("CARGO_BIN_EXE_kolo");

mod failures;
mod hf_job;
mod launch;
mod model_parallel;
mod plan;
mod ps_fed_impala;
mod ps_pause;
mod training;
mod user_model;

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(KOLO);
    c.args(args).env("RAYON_NUM_THREADS", "1").stdin(Stdio::null());
    for k in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "KOLO_JOB_TOKEN",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
    ] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run kolo")
}

fn text(o: &Output) -> String {
    format!("status {:?}\n--- stdout\n{}\n--- stderr\n{}", o.status, String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

fn env(pairs: &[(&str, String)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// An empty directory of this test process's, named by `tag`.
fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The shipped corpus, as a string for configs.
fn shakespeare() -> String {
    kolo_testkit::files::shakespeare().display().to_string()
}

/// A fresh directory with a tiny GPT config on the shipped corpus that checkpoints every 2
/// steps into `ck/`: `(dir, config, ck)`.
fn tiny_gpt_job(tag: &str, train: &str, ddp: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kolo-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cfg, ck) = (dir.join("gpt.toml"), dir.join("ck"));
    let text = format!(
        "[model]\nkind = \"gpt\"\nseq = 16\nd_model = 32\nn_head = 2\nn_layer = 1\n[data]\nkind = \"text\"\npath = \"{}\"\n\
         batch_size = 4\n[train]\n{train}sample_chars = 0\ncheckpoint_every = 2\ncheckpoint_dir = \"{}\"\n[ddp]\n{ddp}",
        shakespeare(),
        ck.display()
    );
    std::fs::write(&cfg, text).unwrap();
    (dir, cfg, ck)
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, sig: i32) -> i32;
}

/// The model's tensors (`model.*`) of a checkpoint directory, by name.
/// Rank 0's transient heap in MB of a `kolo train` log (its "peak 46.2 MB (+27.6 MB
/// transient)").
fn transient_heap_mb(t: &str) -> f64 {
    let line = t.lines().find(|l| l.starts_with("[rank 0] heap per rank:")).unwrap_or_else(|| panic!("no heap line: {t}"));
    let at = line.rfind("(+").unwrap() + 2;
    line[at..].split(' ').next().unwrap().parse().unwrap()
}

fn model_tensors(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let ck = kolo_checkpoint::sharded::load_any(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    ck.tensors.into_iter().filter(|e| e.name.starts_with("model.")).map(|e| (e.name, e.data)).collect()
}
