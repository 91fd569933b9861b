//! Fine-tune a Hugging Face causal language model (GPT-2, or a Llama-style model: Llama, Llama 3,
//! Mistral, Qwen2) under Kolo's DDP, ZeRO or a model-parallel mesh and export it for `transformers`.
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
//! export. The export is written in --dtype f32|bf16|f16 (f32), in files of at most
//! --max-shard-size BYTES (one file).
//!
//! Flags: --steps N (20), --batch B per data-parallel rank (4), --seq T (32), --optim adamw|sgd,
//! --lr (1e-3), --clip C (1.0; `none`), --zero 0|1|2|3 (3: the model's blocks are sharded
//! ZeRO-3 groups, the model itself unchanged), --tp T (1: a Llama split over T ranks, heads,
//! MLP and vocabulary), --pp P (1: a Llama's blocks cut into P pipeline stages, run over
//! --micro M micro-batches, 2, with --schedule gpipe|1f1b); the ranks form a pp x dp x tp
//! mesh, dp = ranks / (P S T), --sp S (1: a Llama run on S chunks of every sequence, ring
//! attention).
use anyhow::Result;
use candle_core::{DType, Tensor};
use kolo::data::{Sampler, SamplerConfig};
use std::path::Path;

/// Runs the example; returns the exported model's logits on the reference ids (when there are some).
pub fn run(args: &[String]) -> Result<Option<Tensor>> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (model_dir, out) = (arg("--model", "test-data/hf/gpt2-tiny"), arg("--out", "checkpoints/gpt2-finetuned"));
    let (steps, batch, seq): (u64, usize, usize) =
        (arg("--steps", "20").parse()?, arg("--batch", "4").parse()?, arg("--seq", "32").parse()?);
    let dist = kolo::init()?;
    let (tp, pp, sp): (usize, usize, usize) = (arg("--tp", "1").parse()?, arg("--pp", "1").parse()?, arg("--sp", "1").parse()?);
    let dp = dist.world_size() / (tp * pp * sp).max(1);
    let mesh = kolo::Mesh::new(&dist, &[("pp", pp), ("dp", dp), ("sp", sp), ("tp", tp)])?;
    // Each rank reads its stage's tensors, and its pieces of every split one.
    let (varmap, model) = kolo::hf::load_causal_lm_parallel(Path::new(&model_dir), &dist.device(), &mesh)?;
    let vocab = model.vocab_size() as u32;
    let reference = Path::new(&model_dir).join("reference.safetensors");
    let reference = if reference.exists() { Some(candle_core::safetensors::load(&reference, &dist.device())?) } else { None };
    let ids = reference.as_ref().map(|r| r["ids"].to_dtype(DType::U32)).transpose()?;
    if let (Some(r), Some(ids), 1) = (&reference, &ids, pp * sp) {
        // A split model's whole logits are gathered over its group: every rank computes them.
        let d = (model.forward(ids)? - &r["logits"])?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        if dist.is_main() {
            println!("loaded {model_dir}: logits differ from transformers' reference by {d:.2e}");
        }
    }
    let micro: usize = if pp > 1 { arg("--micro", "2").parse()? } else { 1 };
    let mut opts = kolo::TrainOptions::new()
        .grad_accum(micro as u64)
        .optimizer(arg("--optim", "adamw").parse().map_err(anyhow::Error::msg)?, arg("--lr", "1e-3").parse()?)
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .log_every(5)
        .batch(batch, seq);
    if let Ok(c) = arg("--clip", "1.0").parse() {
        opts = opts.clip_grad_norm(c);
    }
    let mut trainer = if tp > 1 || pp > 1 || sp > 1 {
        kolo::Trainer::with_mesh(&varmap, &mesh, opts)?
    } else if opts.ddp.zero_stage == 3 {
        // The blocks' values live as shards over the ranks, gathered into the model when used.
        let groups = model.block_prefixes();
        kolo::Trainer::with_zero3_groups(&varmap, &dist, opts, &groups.iter().map(String::as_str).collect::<Vec<_>>())?
    } else {
        kolo::Trainer::new(&varmap, &dist, opts)?
    };
    // Token shards from `kolo data prepare` (their tokenizer must fit the model's embedding),
    // or, as a stand-in, the text's bytes modulo the vocabulary.
    let shards = args.iter().any(|a| a == "--shards").then(|| kolo::tokens::TokenShards::open(arg("--shards", "").as_ref())).transpose()?;
    if let Some(s) = &shards {
        s.check(None, vocab as usize)?;
    }
    let text: Vec<u32> = match &shards {
        Some(_) => Vec::new(),
        None => std::fs::read(arg("--text", "data/tinyshakespeare.txt"))?.iter().map(|b| u32::from(*b) % vocab).collect(),
    };
    let windows = shards.as_ref().map_or(text.len() / (seq + 1), |s| s.windows(seq + 1));
    let window = |w: usize| shards.as_ref().map_or_else(|| text[w * (seq + 1)..(w + 1) * (seq + 1)].to_vec(), |s| s.window(w, seq + 1));
    // The members of a tensor-parallel group read the same windows; the replicas their own.
    let (world, rank) = (mesh.size("dp"), mesh.coord("dp"));
    let cfg = SamplerConfig { len: windows, world, rank, batch, seed: 0, shuffle: true, drop_last: true };
    let mut sampler = Sampler::new(cfg, Default::default()).map_err(anyhow::Error::msg)?;
    let schedule = if arg("--schedule", "1f1b") == "gpipe" { kolo::pp::Schedule::GPipe } else { kolo::pp::Schedule::OneFOneB };
    let per_micro = batch / micro;
    let pipe = kolo::pp::Pipeline::new(schedule, &[per_micro, seq / sp, model.hidden_size()])?;
    for _ in 0..steps {
        let rows: Vec<u32> = sampler.next_batch().iter().flat_map(|&w| window(w)).collect();
        let x = Tensor::from_vec(rows, (batch, seq + 1), &dist.device())?;
        if pp > 1 {
            // Each stage runs its blocks on micro-batch `mb`; the last returns its loss.
            pipe.step(&mut trainer, |mb, input| model.pipeline_stage(input, &x.narrow(0, mb * per_micro, per_micro)?))?;
        } else {
            trainer.step(|| model.loss(&x))?;
        }
        trainer.set_data_position(sampler.position()); // saved with checkpoints: resume mid-shard
    }
    if let (Some(b), true) = (pipe.bubble(), pp > 1 && mesh.coord("dp") == 0 && mesh.coord("tp") == 0) {
        let (k, m) = (pp as f64, micro as f64);
        println!(
            "pipeline stage {}: bubble {:.1}% (GPipe/1F1B ideal {:.1}%)",
            mesh.coord("pp"),
            100.0 * b,
            100.0 * (k - 1.0) / (m + k - 1.0)
        );
    }
    let mut logits = None;
    // ZeRO-3: the whole model is gathered into its variables (a collective) for the export.
    trainer.unshard()?;
    // Tensor and pipeline parallelism: the whole tensors put together from every rank's.
    let whole = if tp > 1 || pp > 1 { mesh.whole_varmap(&varmap)? } else { None };
    if dist.is_main() {
        let dtype = match arg("--dtype", "f32").as_str() {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            d => anyhow::bail!("--dtype {d}: f32, bf16 or f16"),
        };
        let max_shard_size = args.iter().any(|a| a == "--max-shard-size").then(|| arg("--max-shard-size", "").parse()).transpose()?;
        let save = kolo::hf::SaveOptions { dtype, max_shard_size };
        model.save_pretrained_with(Path::new(&out), whole.as_ref().unwrap_or(&varmap), &save)?;
        // The logits of what was written (a pipeline's stages, a bf16 export, hold less).
        if let Some(ids) = &ids {
            logits = Some(kolo::hf::load_causal_lm(Path::new(&out), &dist.device())?.1.forward(ids)?);
        }
        if let (Some(ids), Some(l)) = (&ids, &logits) {
            let t = [("ids".to_string(), ids.to_dtype(DType::I64)?), ("logits".to_string(), l.clone())];
            candle_core::safetensors::save(&t.into_iter().collect(), Path::new(&out).join("kolo_logits.safetensors"))?;
        }
        println!("exported {out} ({dtype:?}) after {steps} steps on {} ranks ({mesh:?})", dist.world_size());
    }
    dist.barrier()?;
    Ok(logits)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    run(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
