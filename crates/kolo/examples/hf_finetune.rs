//! Fine-tune a Hugging Face causal language model (GPT-2, GPT-NeoX, or a Llama-style model:
//! Llama, Llama 3, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma, Phi-3) under Kolo's DDP, ZeRO or a model-parallel mesh and export it for `transformers`.
//!
//!   cargo run --release --example hf_finetune -- --model DIR --out DIR
//!   kolo launch -n 2 -- target/release/examples/hf_finetune --model DIR --out DIR --zero 1
//!
//! DIR holds `config.json` and `model.safetensors` (or the shards of
//! `model.safetensors.index.json`) as `save_pretrained` writes them (default:
//! test-data/hf/gpt2-tiny, a small random GPT-2 made by transformers; test-data/hf/llama-tiny,
//! qwen2-tiny, mistral-tiny and llama3-tiny are Llama-style ones). The text (--text,
//! default data/tinyshakespeare.txt) is cut into windows of --seq + 1 tokens, a token being a
//! byte of the text modulo the vocabulary; with --shards SHARDS the windows come from token
//! shards that `kolo data prepare` wrote with the model's tokenizer. When DIR has
//! `reference.safetensors` (token ids and transformers' logits for them), the loaded model's
//! logits are compared with it first, and the exported model's logits on those ids (Kolo's,
//! from the files it wrote) are written to `OUT/kolo_logits.safetensors` for
//! `test-data/hf/check_export.py OUT` to compare with what transformers computes from the
//! export. --precision f32|bf16|f16 (f32) trains the model in that dtype over f32 masters
//! (mixed precision); --checkpoint DIR writes the trainer's checkpoint at the last step (the f32
//! masters, which the export holds too). The export is written in --dtype
//! f32|bf16|f16 (f32), in files of at most
//! --max-shard-size BYTES (one file). --device cpu|cuda|cuda:N (cpu) loads and trains the model
//! on that device (cuda: a `--features cuda` build, each rank on the GPU of its local rank;
//! data parallelism only).
//!
//! Flags: --steps N (20), --batch B per data-parallel rank (4), --seq T (32), --optim adamw|sgd,
//! --lr (1e-3), --clip C (1.0; `none`), --zero 0|1|2|3 (3: the model's blocks are sharded
//! ZeRO-3 groups, the model itself unchanged), --tp T (1: the model split over T ranks, heads,
//! MLP and vocabulary), --pp P (1: the model's blocks cut into P pipeline stages, run over
//! --micro M micro-batches, 2, with --schedule gpipe|1f1b|2bw: PipeDream-2BW, streams draining
//! at each evaluation, --eval-every N), --local-sgd N (the data-parallel replicas' models
//! averaged every N steps); the ranks form a pp x dp x ep x sp x tp
//! mesh, dp = ranks / (P E S T), --sp S (1: a Llama or GPT-2 run on S chunks of every
//! sequence, ring attention), --ep E (1: Mixtral's or Qwen3-MoE's experts dealt out over E ranks, each
//! reading its own batches: test-data/hf/mixtral-tiny, qwen3-moe-tiny), --expert-bias-rate R
//! (0: DeepSeek-V3's selection biases moved by R after each step towards the experts given
//! fewer than the mean of the step's tokens; test-data/hf/deepseek-v3-tiny), --checkpoint-blocks
//! 0,1 (those decoder layers' activations recomputed in backward: activation checkpointing).
use anyhow::Result;
use candle_core::{DType, Tensor};
use kolo::hf::finetune::{HfData, HfModel};
use kolo::hf::{FineTune, FineTuneConfig};
use kolo::options::{MeshConfig, PipeSchedule, PipelineConfig};
use std::path::Path;

/// Runs the example; returns the exported model's logits on the reference ids (when there are some).
pub fn run(args: &[String]) -> Result<Option<Tensor>> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (model_dir, out) = (arg("--model", "test-data/hf/gpt2-tiny"), arg("--out", "checkpoints/gpt2-finetuned"));
    let (steps, batch, seq): (u64, usize, usize) =
        (arg("--steps", "20").parse()?, arg("--batch", "4").parse()?, arg("--seq", "32").parse()?);
    let dist = kolo::init()?;
    let (tp, pp, sp): (usize, usize, usize) = (arg("--tp", "1").parse()?, arg("--pp", "1").parse()?, arg("--sp", "1").parse()?);
    let ep: usize = arg("--ep", "1").parse()?;
    let mut opts = kolo::TrainOptions::new()
        .optimizer(arg("--optim", "adamw").parse().map_err(anyhow::Error::msg)?, arg("--lr", "1e-3").parse()?)
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .precision(arg("--precision", "f32").parse().map_err(anyhow::Error::msg)?)
        .device(arg("--device", "cpu"))
        .log_every(5);
    if let Ok(c) = arg("--clip", "1.0").parse() {
        opts = opts.clip_grad_norm(c);
    }
    if args.iter().any(|a| a == "--local-sgd") {
        // Local SGD: each data-parallel replica steps alone, the models averaged every N steps.
        let c = format!("[ddp]\nlocal_sgd = {{ every = {} }}\n", arg("--local-sgd", "4"));
        opts.ddp.local_sgd = kolo::TrainOptions::from_toml_str(&c)?.ddp.local_sgd;
    }
    // Held-out evaluation every N steps (and at the end; a PipeDream-2BW stream drains there).
    opts.train.eval_every = arg("--eval-every", "0").parse()?;
    if args.iter().any(|a| a == "--checkpoint") {
        // The trainer's checkpoint at the last step: whole tensors, f32 masters under mixed precision.
        opts = opts.checkpoints(arg("--checkpoint", ""), steps);
    }
    // The job `kolo train` runs for a config with `[model] hf = DIR`, here from flags.
    let has = |k: &str| args.iter().any(|a| a == k);
    let schedule = match arg("--schedule", "1f1b").as_str() {
        "gpipe" => PipeSchedule::GPipe,
        "2bw" => PipeSchedule::TwoBw,
        _ => PipeSchedule::OneFOneB,
    };
    let cfg = FineTuneConfig {
        model: HfModel {
            hf: model_dir.clone().into(),
            expert_bias_rate: arg("--expert-bias-rate", "0").parse()?,
            checkpoint_blocks: arg("--checkpoint-blocks", "")
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::parse)
                .collect::<Result<_, _>>()?,
        },
        data: HfData {
            // Token shards from `kolo data prepare` (their tokenizer must fit the model's
            // embedding), or, as a stand-in, the text's bytes modulo the vocabulary.
            shards: has("--shards").then(|| arg("--shards", "").into()),
            text: (!has("--shards")).then(|| arg("--text", "data/tinyshakespeare.txt").into()),
            batch_size: batch,
            seq,
            eval_fraction: arg("--eval-fraction", "0").parse()?,
        },
        mesh: Some(MeshConfig { tp, pp: Some(pp), dp: None, sp, ep }),
        pipeline: Some(PipelineConfig { micro_batches: arg("--micro", "2").parse()?, schedule, rematerialize: false }),
        optim: opts.optim,
        ddp: opts.ddp,
        train: opts.train,
        export: None,
    };
    // Each rank reads its stage's tensors, and its pieces of every split one.
    let mut ft = FineTune::new(&dist, cfg)?;
    let reference = Path::new(&model_dir).join("reference.safetensors");
    let reference = if reference.exists() { Some(candle_core::safetensors::load(&reference, &dist.device())?) } else { None };
    let ids = reference.as_ref().map(|r| r["ids"].to_dtype(DType::U32)).transpose()?;
    if let (Some(r), Some(ids), 1) = (&reference, &ids, pp * sp) {
        // A split model's whole logits are gathered over its group: every rank computes them.
        let d = (ft.model().forward(ids)?.to_dtype(DType::F32)? - &r["logits"])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        if dist.is_main() {
            println!("loaded {model_dir}: logits differ from transformers' reference by {d:.2e}");
        }
    }
    ft.run(None)?;
    let dtype = kolo::hf::finetune::export_dtype(&arg("--dtype", "f32"))?;
    let max_shard_size = has("--max-shard-size").then(|| arg("--max-shard-size", "").parse()).transpose()?;
    // ZeRO-3 shards and model-parallel pieces are gathered into the whole model first.
    ft.export(Path::new(&out), &kolo::hf::SaveOptions { dtype, max_shard_size })?;
    let mut logits = None;
    if dist.is_main() {
        // The logits of what was written (a pipeline's stages, a bf16 export, hold less).
        if let Some(ids) = &ids {
            logits = Some(kolo::hf::load_causal_lm(Path::new(&out), &dist.device())?.1.forward(ids)?);
        }
        if let (Some(ids), Some(l)) = (&ids, &logits) {
            let t = [("ids".to_string(), ids.to_dtype(DType::I64)?), ("logits".to_string(), l.clone())];
            candle_core::safetensors::save(&t.into_iter().collect(), Path::new(&out).join("kolo_logits.safetensors"))?;
        }
        println!("exported {out} ({dtype:?}) after {steps} steps on {} ranks ({:?})", dist.world_size(), ft.mesh());
    }
    dist.barrier()?;
    Ok(logits)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    run(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
