//! A model Kolo does not ship, unchanged: candle-transformers' Qwen2 (a small random config,
//! initialised as `transformers` initialises it), trained on token shards under DDP, ZeRO-1/2
//! or ZeRO-3 (its decoder layers sharded, gathered into the model's own variables when used).
//!
//!   target/release/kolo data prepare data/tinyshakespeare.txt --train-bpe 512 --out target/shards
//!   cargo build --release -p kolo --features hf --example qwen2
//!   target/release/kolo launch -n 2 -- target/release/examples/qwen2 --shards target/shards --zero 3
//!
//! Without --shards the text (--text, default data/tinyshakespeare.txt) is read as bytes.
//! Flags: --steps N (40), --batch B per rank (4), --seq T (64), --lr (3e-3), --optim adamw|sgd,
//! --zero 0|1|2|3, --layers L (4), --hidden H (64), --ffn F (the MLP's width, 2 H), --params FILE (each rank writes the trained
//! parameters, flat f32 in the trainer's order, to FILE.rank{r}), --memory (each rank's heap
//! when the trainer is built and after every step, the peaks of building it and of the steps,
//! counted by Kolo's allocator, which this example installs as the `kolo` binary does; and its
//! peak resident memory, which also holds what the allocator freed but did not give back).
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::qwen2;
use kolo::options::OptimKind;
use kolo_base::alloc::{reset_peak, stats};

/// Kolo's counting allocator (`--memory`), in the example's own binary (not in a test binary
/// that loads this file as a module).
#[cfg(not(test))]
#[global_allocator]
static ALLOC: kolo_base::alloc::CountingAlloc = kolo_base::alloc::CountingAlloc;

/// A small Qwen2 (grouped-query attention: 4 query heads share 2 key/value heads; tied
/// embeddings, as Qwen2.5-0.5B).
fn config(vocab: usize, hidden: usize, ffn: usize, layers: usize, seq: usize) -> qwen2::Config {
    qwen2::Config {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: seq.max(64),
        sliding_window: seq.max(64),
        max_window_layers: layers,
        tie_word_embeddings: true,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        use_sliding_window: false,
        hidden_act: candle_nn::Activation::Silu,
    }
}

/// `transformers`' initialisation (`_init_weights` with `initializer_range` 0.02): weights of
/// linear layers and embeddings normal(0, 0.02), biases 0, norms 1. candle-nn's builders use
/// other defaults (Kaiming-uniform linear layers, unit-variance embeddings).
fn hf_init(varmap: &VarMap) -> Result<()> {
    let vars = varmap.data().lock().unwrap_or_else(|p| p.into_inner());
    let mut names: Vec<&String> = vars.keys().collect();
    names.sort(); // the same draws in the same order on every run
    for name in names {
        let v = &vars[name];
        let init = if name.ends_with("norm.weight") {
            v.ones_like()?
        } else if name.ends_with(".bias") {
            v.zeros_like()?
        } else {
            Tensor::randn(0f32, 0.02, v.shape(), v.device())?
        };
        v.set(&init)?;
    }
    Ok(())
}

/// Runs the example; returns the mean loss of the last step over the ranks.
pub fn run(args: &[String]) -> Result<f64> {
    let arg = |k: &str, d: &str| args.iter().skip_while(|a| *a != k).nth(1).cloned().unwrap_or(d.into());
    let (steps, batch, seq): (u64, usize, usize) =
        (arg("--steps", "40").parse()?, arg("--batch", "4").parse()?, arg("--seq", "64").parse()?);
    let memory = args.iter().any(|a| a == "--memory");
    if memory && stats().is_none() {
        anyhow::bail!("--memory: Kolo's counting allocator is not installed (the example's own binary installs it)");
    }
    let dist = kolo::init()?;
    dist.device().set_seed(0)?;
    // Token shards from `kolo data prepare`, or the text's bytes.
    let shards = args.iter().any(|a| a == "--shards").then(|| kolo::tokens::TokenShards::open(arg("--shards", "").as_ref())).transpose()?;
    let vocab = shards.as_ref().map_or(256, |s| s.header().vocab_size as usize);
    let text: Vec<u32> = match &shards {
        Some(_) => Vec::new(),
        None => std::fs::read(arg("--text", "data/tinyshakespeare.txt"))?.iter().map(|b| u32::from(*b)).collect(),
    };
    let hidden: usize = arg("--hidden", "64").parse()?;
    let cfg = config(vocab, hidden, arg("--ffn", &(2 * hidden).to_string()).parse()?, arg("--layers", "4").parse()?, seq);
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dist.device());
    let mut model = qwen2::Model::new(&cfg, vb.clone())?;
    // Tied output projection: the embedding matrix (the same variable), at every position.
    let embed = vb.get((cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")?;
    hf_init(&varmap)?;
    let kind = match arg("--optim", "adamw").as_str() {
        "sgd" => OptimKind::Sgd,
        "adamw" => OptimKind::Adamw,
        o => anyhow::bail!("--optim {o}: sgd or adamw"),
    };
    let opts = kolo::TrainOptions::new()
        .optimizer(kind, arg("--lr", "3e-3").parse()?)
        .zero_stage(arg("--zero", "0").parse()?)
        .steps(steps)
        .log_every(10)
        .batch(batch, seq);
    let mut trainer = if opts.ddp.zero_stage == 3 {
        let layers: Vec<String> = (0..cfg.num_hidden_layers).map(|i| format!("model.layers.{i}.")).collect();
        kolo::Trainer::with_zero3_groups(&varmap, &dist, opts, &layers.iter().map(String::as_str).collect::<Vec<_>>())?
    } else {
        kolo::Trainer::new(&varmap, &dist, opts)?
    };
    let heap_mb = |s: Option<kolo_base::alloc::HeapStats>| s.map_or((0.0, 0.0), |s| (s.live as f64 / 1e6, s.peak as f64 / 1e6));
    if memory {
        let (live, peak) = heap_mb(stats());
        println!("rank {}: heap {live:.1} MB with the trainer built (peak {peak:.1} MB)", dist.rank());
        reset_peak();
    }
    let windows = shards.as_ref().map_or(text.len() / (seq + 1), |s| s.windows(seq + 1));
    let window = |w: usize| shards.as_ref().map_or_else(|| text[w * (seq + 1)..(w + 1) * (seq + 1)].to_vec(), |s| s.window(w, seq + 1));
    // Each rank its `batch` windows per step, from where a resumed checkpoint left off.
    let mut sampler = trainer.sampler(windows)?;
    let mut last = 0.0;
    while trainer.steps_done() < steps {
        let rows: Vec<u32> = sampler.next_batch().iter().flat_map(|&w| window(w)).collect();
        trainer.set_data_position(sampler.position()); // before the step, whose checkpoint carries it
        let ids = Tensor::from_vec(rows, (batch, seq + 1), &dist.device())?;
        let (x, y) = (ids.narrow(1, 0, seq)?, ids.narrow(1, 1, seq)?);
        let out = trainer.step(|| {
            model.clear_kv_cache(); // training: no cache of earlier calls' keys and values
            let h = model.forward(&x, 0, None)?;
            // And none of this call's: the cached keys and values are nodes of this forward's
            // graph, which they would keep whole (every activation) until the next step.
            model.clear_kv_cache();
            let logits = h.broadcast_matmul(&embed.t()?)?;
            candle_nn::loss::cross_entropy(&logits.flatten_to(1)?, &y.flatten_all()?)
        })?;
        last = dist.mean(f64::from(out.loss))?;
        if memory {
            println!("rank {} step {}: heap {:.1} MB", dist.rank(), trainer.steps_done(), heap_mb(stats()).0);
        }
    }
    if memory {
        let peak = heap_mb(stats()).1;
        println!("rank {}: heap peak over the steps {peak:.1} MB, peak resident {:.1} MB", dist.rank(), status_mb("VmHWM:")?);
    }
    if args.iter().any(|a| a == "--params") {
        let flat: Vec<u8> = trainer.flat_params()?.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(format!("{}.rank{}", arg("--params", ""), dist.rank()), flat)?;
    }
    if dist.is_main() {
        let v = cfg.vocab_size;
        println!(
            "trained Qwen2 ({} layers, vocab {v}) for {steps} steps on {} ranks: loss {last:.4}",
            cfg.num_hidden_layers,
            dist.world_size()
        );
    }
    Ok(last)
}

/// A memory line of /proc/self/status (`VmHWM:`, the peak resident set), in MB.
fn status_mb(key: &str) -> Result<f64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("/proc/self/status has no {key}"))?;
    Ok(kb * 1024.0 / 1e6)
}

#[allow(dead_code)]
fn main() -> Result<()> {
    #[cfg(not(test))]
    kolo_base::alloc::CountingAlloc::mark_installed();
    run(&std::env::args().collect::<Vec<_>>()).map(|_| ())
}
