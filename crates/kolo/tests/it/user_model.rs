//! The library path (issue #17): a user's own candle-nn model, trained through `kolo::Trainer`
//! by real processes under `kolo launch`. The code that runs is the `user_mlp` example itself.

use super::{fresh_dir, model_tensors, run, text};

#[path = "../../examples/user_mlp.rs"]
#[allow(dead_code)]
mod user_mlp;

#[path = "../../examples/hf_finetune.rs"]
#[allow(dead_code)]
mod hf_finetune;

/// Not a test on its own: the process the tests below start through `kolo launch` (it runs
/// the example named by `KOLO_EXAMPLE` with the arguments in `KOLO_EXAMPLE_ARGS`).
#[test]
#[ignore = "started by the user_model tests as a launched rank"]
fn launched_rank() {
    let args: Vec<String> = std::env::var("KOLO_EXAMPLE_ARGS").expect("KOLO_EXAMPLE_ARGS").split(' ').map(String::from).collect();
    match std::env::var("KOLO_EXAMPLE").as_deref() {
        Ok("hf_finetune") => drop(hf_finetune::run(&args).unwrap()),
        _ => drop(user_mlp::train(&args).unwrap()),
    }
}

/// Runs the example on `n` launched processes; returns the checkpoint's model tensors.
fn example(n: usize, args: &str, out: &std::path::Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    let me = std::env::current_exe().unwrap();
    let me = me.to_str().unwrap();
    let args = format!("{args} --data {} --out {}", kolo_testkit::files::mnist_dir().display(), out.display());
    let o = run(
        &["launch", "-n", &n.to_string(), "--", me, "user_model::launched_rank", "--exact", "--ignored", "--nocapture", "--test-threads=1"],
        &[("KOLO_EXAMPLE_ARGS", &args), ("KOLO_EXAMPLE", "user_mlp")],
    );
    assert!(o.status.success(), "{n} ranks, {args}: {}", text(&o));
    let dir = std::fs::read_dir(out).unwrap().next().unwrap().unwrap().path();
    model_tensors(&dir)
}

/// A user's candle-nn MLP under DDP and ZeRO-1/2 on 2 and 3 processes equals one process with
/// the same global batch (24 examples) after 6 SGD steps without clipping, so a wrong gradient
/// scale or a parameter left out of the all-reduce shows. Not bitwise (the all-reduce adds
/// per-rank means: f32 reassociation); tolerance 2e-6 where the parameters moved by more than
/// 1e-2 (checked against the initial weights, the same in every run by `set_seed`).
#[test]
fn a_users_candle_model_under_ddp_and_zero_matches_one_process() {
    let dir = fresh_dir("user-mlp");
    let sgd = "--optim sgd --lr 0.1 --steps 6";
    let start = example(1, "--optim sgd --lr 0.1 --steps 0 --batch 24", &dir.join("start"));
    let one = example(1, &format!("{sgd} --batch 24"), &dir.join("one"));
    assert_eq!(one.len(), 6, "fc1..fc3 weight and bias: {:?}", one.keys());
    let moved = one.iter().map(|(k, v)| v.iter().zip(&start[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max)).fold(0f32, f32::max);
    assert!(moved > 1e-2, "the parameters barely moved ({moved}): the comparison would prove nothing");
    for (n, zero) in [(2, 0), (2, 1), (2, 2), (3, 0), (3, 2)] {
        let got = example(n, &format!("{sgd} --batch {} --zero {zero}", 24 / n), &dir.join(format!("n{n}-z{zero}")));
        assert_eq!(got.keys().collect::<Vec<_>>(), one.keys().collect::<Vec<_>>());
        for (k, v) in &one {
            let d = v.iter().zip(&got[k]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 2e-6, "{n} ranks, ZeRO-{zero}: `{k}` differs from one process by {d}");
        }
    }
}

/// Hugging Face models (the GPT-2 and the Llama-style model `transformers` saved in
/// test-data) fine-tuned by 2 processes under ZeRO-1 and ZeRO-2 and exported: each export loads
/// back into Kolo with bitwise the logits the run computed at its end (written next to it), and
/// they differ from the starting model's, which equal transformers' reference within 1e-4. (That
/// transformers computes the same logits from the export is checked by `bench/hf_interop.sh`,
/// which needs torch.)
#[test]
fn hugging_face_models_fine_tuned_under_zero_export_what_they_trained() {
    let dev = candle_core::Device::Cpu;
    let diff = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    };
    for (model, zero) in [(kolo_testkit::files::hf_gpt2_tiny(), 1), (kolo_testkit::files::hf_llama_tiny(), 2)] {
        let dir = fresh_dir(&format!("hf-{zero}"));
        let me = std::env::current_exe().unwrap();
        let args = format!(
            "--model {} --out {} --text {} --steps 6 --batch 2 --seq 16 --zero {zero} --lr 3e-3",
            model.display(),
            dir.display(),
            kolo_testkit::files::shakespeare().display()
        );
        let o = run(
            &[
                "launch",
                "-n",
                "2",
                "--",
                me.to_str().unwrap(),
                "user_model::launched_rank",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ],
            &[("KOLO_EXAMPLE_ARGS", &args), ("KOLO_EXAMPLE", "hf_finetune")],
        );
        let t = text(&o);
        assert!(o.status.success(), "{t}");
        assert!(t.contains("logits differ from transformers' reference by"), "{t}");
        let kolo = candle_core::safetensors::load(dir.join("kolo_logits.safetensors"), &dev).unwrap();
        let reference = candle_core::safetensors::load(model.join("reference.safetensors"), &dev).unwrap();
        let ids = kolo["ids"].to_dtype(candle_core::DType::U32).unwrap();
        let (_, exported) = kolo::hf::load_causal_lm(&dir, &dev).unwrap();
        assert_eq!(
            diff(&exported.forward(&ids).unwrap(), &kolo["logits"]),
            0.0,
            "{}: the export is not the trained model",
            model.display()
        );
        let (_, start) = kolo::hf::load_causal_lm(&model, &dev).unwrap();
        let start = start.forward(&ids).unwrap();
        assert!(diff(&start, &reference["logits"]) < 1e-4);
        assert!(diff(&start, &kolo["logits"]) > 1e-2, "{}: fine-tuning did not change the model", model.display());
    }
}
