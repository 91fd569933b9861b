//! Kolo checkpoints are plain safetensors: Python's `safetensors` package reads them. `.ci/run`
//! installs it and sets KOLO_TEST_STRICT=1, so there a missing package fails the test; elsewhere
//! the test says it did not run.

use kolo_checkpoint::{save, Checkpoint, Entry};
use std::collections::BTreeMap;
use std::process::Command;

#[test]
fn python_safetensors_reads_kolo_checkpoints() {
    let probe = Command::new("python3").args(["-c", "import safetensors.numpy"]).output();
    if !matches!(&probe, Ok(o) if o.status.success()) {
        kolo_testkit::files::tool_missing("python3 with the safetensors package");
        return;
    }
    let path = std::env::temp_dir().join(format!("kolo-py-{}.safetensors", std::process::id()));
    let mut meta = BTreeMap::new();
    meta.insert("kolo.step".to_string(), "42".to_string());
    let ck = Checkpoint {
        tensors: vec![Entry { name: "model.fc1.weight".into(), shape: vec![2, 3], data: vec![0.5, -1.0, 2.0, 3.25, 0.0, -7.5] }],
        meta,
    };
    save(&path, &ck).unwrap();
    let script = format!(
        "from safetensors.numpy import load_file\nfrom safetensors import safe_open\n\
         t = load_file({p:?})['model.fc1.weight']\nprint(t.shape, t.dtype, t.flatten().tolist())\n\
         f = safe_open({p:?}, 'np')\nprint(f.metadata()['kolo.step'])\n",
        p = path.to_str().unwrap()
    );
    let out = Command::new("python3").args(["-c", &script]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("(2, 3) float32 [0.5, -1.0, 2.0, 3.25, 0.0, -7.5]"), "{text}");
    assert!(text.contains("42"), "{text}");
    std::fs::remove_file(&path).unwrap();
}
