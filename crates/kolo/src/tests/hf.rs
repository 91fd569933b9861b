//! Hugging Face checkpoints and token shards (the `hf` feature).

use super::*;

/// The reference ids and the logits `transformers` computed for them.
fn hf_reference() -> (Tensor, Tensor) {
    let r = candle_core::safetensors::load(kolo_testkit::files::hf_gpt2_tiny().join("reference.safetensors"), &Device::Cpu).unwrap();
    (r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone())
}

/// `(name, shape)` of every tensor in `dir/model.safetensors`, sorted.
fn saved_tensors(dir: &std::path::Path) -> Vec<(String, Vec<usize>)> {
    let t = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut v: Vec<(String, Vec<usize>)> = t.iter().map(|(k, t)| (k.clone(), t.dims().to_vec())).collect();
    v.sort();
    v
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// A GPT-2 saved by `transformers` loads into Kolo's candle GPT-2 and gives its logits within
/// 1e-4 (they reach 10 in magnitude: the reference's parameters carry noise so that every layer
/// matters); `save_pretrained` writes the same tensor names and shapes back, and they reload to
/// bitwise the same logits.
#[test]
fn hugging_face_gpt2_loads_with_transformers_logits_and_saves_back() {
    let dir = kolo_testkit::files::hf_gpt2_tiny();
    let (varmap, model) = crate::hf::load_gpt2(&dir, &Device::Cpu).unwrap();
    let (ids, want) = hf_reference();
    let got = model.forward(&ids).unwrap();
    assert_eq!(got.dims(), want.dims());
    let d = max_diff(&got, &want);
    assert!(d < 1e-4, "logits differ from transformers' by {d}");
    assert!(max_diff(&want, &want.zeros_like().unwrap()) > 1.0, "reference logits too small to tell");

    let out = std::env::temp_dir().join(format!("kolo-hf-save-{}", std::process::id()));
    crate::hf::save_pretrained(&out, &varmap, model.config()).unwrap();
    assert_eq!(saved_tensors(&out), saved_tensors(&dir));
    let (_, again) = crate::hf::load_gpt2(&out, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&again.forward(&ids).unwrap(), &got), 0.0);
    let _ = std::fs::remove_dir_all(&out);
}

/// Unsupported Hugging Face options, a missing tensor and a wrong shape are one-line errors
/// naming them.
#[test]
fn hugging_face_checkpoints_that_do_not_fit_are_named() {
    let src = kolo_testkit::files::hf_gpt2_tiny();
    let dir = std::env::temp_dir().join(format!("kolo-hf-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let load = |cfg: &str| {
        std::fs::write(dir.join("config.json"), cfg).unwrap();
        crate::hf::load_gpt2(&dir, &Device::Cpu).err().map(|e| format!("{e:#}")).unwrap_or_default()
    };
    let e = load(&cfg.replace("\"scale_attn_by_inverse_layer_idx\": false", "\"scale_attn_by_inverse_layer_idx\": true"));
    assert!(e.contains("scale_attn_by_inverse_layer_idx"), "{e}");
    let e = load(&cfg.replace("\"gelu_new\"", "\"relu\""));
    assert!(e.contains("activation_function \"relu\""), "{e}");
    let e = load(&cfg.replace("\"n_layer\": 2", "\"n_layer\": 3"));
    assert!(e.contains("no tensor `transformer.h.2."), "{e}");
    let e = load(&cfg.replace("\"n_embd\": 48", "\"n_embd\": 40"));
    assert!(e.contains("`transformer.h.0.attn.c_attn.bias` has shape [144], the model's is [120]"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `prepare` with a byte-level BPE trained on the text: text files in a directory and one
/// field of JSON lines become shards whose windows are the documents' tokens in order (each
/// document then `<|endoftext|>`), decoding back to the documents byte for byte; windows never
/// cross a shard's end.
#[test]
fn text_and_json_lines_become_token_shards_that_decode_back() {
    use crate::tokens::{prepare, sources, train_bpe, TokenShards};
    let dir = std::env::temp_dir().join(format!("kolo-tokens-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("corpus/sub")).unwrap();
    let text = std::fs::read_to_string(kolo_testkit::files::shakespeare()).unwrap();
    let (a, b) = (&text[..20_000], &text[20_000..33_000]);
    std::fs::write(dir.join("corpus/a.txt"), a).unwrap();
    std::fs::write(dir.join("corpus/sub/b.txt"), b).unwrap();
    let lines = [("first line, \\u00e9t\\u00e9", "x"), ("second: ROMEO", "y")];
    let jsonl: String = lines.iter().map(|(t, o)| format!("{{\"text\": \"{t}\", \"other\": \"{o}\"}}\n")).collect();
    std::fs::write(dir.join("corpus/c.jsonl"), &jsonl).unwrap();
    let tok = train_bpe(&[dir.join("corpus/a.txt")], 300, &dir.join("tokenizer.json")).unwrap();
    assert_eq!(tok.vocab_size(), 300);
    let src = sources(&[dir.join("corpus")], Some("text")).unwrap();
    assert_eq!(src.len(), 3);
    let p = prepare(&tok, &src, &dir.join("shards"), 1000, &|_| {}).unwrap();
    assert_eq!(p.documents, 4);
    assert!(p.shards.len() > 3, "{} shards", p.shards.len());
    let shards = TokenShards::open(&dir.join("shards")).unwrap();
    assert_eq!(shards.tokens(), p.tokens);
    // Windows of one token are the whole stream, in order.
    let stream: Vec<u32> = (0..shards.windows(1)).map(|i| shards.window(i, 1)[0]).collect();
    assert_eq!(stream.len() as u64, p.tokens);
    let eot = tok.tokenizer.token_to_id("<|endoftext|>").unwrap();
    let docs: Vec<&[u32]> = stream.split(|t| *t == eot).collect();
    let decode = |ids: &[u32]| tok.tokenizer.decode(ids, false).unwrap();
    assert_eq!(docs.len(), 5, "4 documents, each followed by <|endoftext|>");
    assert_eq!(decode(docs[0]), a);
    assert_eq!((decode(docs[1]).as_str(), decode(docs[2]).as_str()), ("first line, \u{e9}t\u{e9}", "second: ROMEO"));
    assert_eq!(decode(docs[3]), b);
    // A window of 7 never crosses a shard's end: every full shard (1000 tokens) gives 142.
    let last = p.tokens as usize - 1000 * (p.shards.len() - 1);
    assert_eq!(shards.windows(7), (p.shards.len() - 1) * 142 + last / 7);
    assert_eq!(shards.window(142, 7), stream[1000..1007].to_vec());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Shards of two tokenizers in one directory, shards checked against another tokenizer or a
/// model with a smaller embedding, a cut shard and a JSON line without the field: each a
/// one-line error naming it.
/// Inputs larger than a piece are tokenized a piece at a time (issue #34: one 50 MB line took
/// 8.4 GB) and decode back exactly: the whole corpus (1.1 MB, cut after newlines) and one
/// 600 KB line of two-byte characters without a newline (cut between characters).
#[test]
fn large_inputs_are_tokenized_in_pieces_that_decode_back() {
    use crate::tokens::{prepare, sources, train_bpe, TokenShards, PIECE};
    let dir = std::env::temp_dir().join(format!("kolo-tokens-large-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("in")).unwrap();
    let corpus = std::fs::read_to_string(kolo_testkit::files::shakespeare()).unwrap();
    let line: String = "\u{e9}t\u{e9} ".repeat(600_000 / 6);
    assert!(corpus.len() > 4 * PIECE && line.len() > 2 * PIECE && !line.contains('\n'));
    std::fs::write(dir.join("in/a.txt"), &corpus).unwrap();
    std::fs::write(dir.join("in/b.txt"), &line).unwrap();
    let tok = train_bpe(&[dir.join("in/a.txt")], 300, &dir.join("tokenizer.json")).unwrap();
    let p = prepare(&tok, &sources(&[dir.join("in")], None).unwrap(), &dir.join("shards"), 1 << 20, &|_| {}).unwrap();
    assert_eq!(p.documents, 2);
    let shards = TokenShards::open(&dir.join("shards")).unwrap();
    let stream: Vec<u32> = (0..shards.windows(1)).map(|i| shards.window(i, 1)[0]).collect();
    let eot = tok.tokenizer.token_to_id("<|endoftext|>").unwrap();
    let docs: Vec<&[u32]> = stream.split(|t| *t == eot).collect();
    assert_eq!(docs.len(), 3, "2 documents, each followed by <|endoftext|>");
    assert!(tok.tokenizer.decode(docs[0], false).unwrap() == corpus, "the corpus does not decode back");
    assert!(tok.tokenizer.decode(docs[1], false).unwrap() == line, "the long line does not decode back");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn token_shards_that_do_not_fit_are_named() {
    use crate::tokens::{prepare, sources, train_bpe, TokenShards};
    let dir = std::env::temp_dir().join(format!("kolo-tokens-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text = std::fs::read_to_string(kolo_testkit::files::shakespeare()).unwrap();
    std::fs::write(dir.join("a.txt"), &text[..8000]).unwrap();
    let t1 = train_bpe(&[dir.join("a.txt")], 300, &dir.join("t1.json")).unwrap();
    let t2 = train_bpe(&[dir.join("a.txt")], 280, &dir.join("t2.json")).unwrap();
    let src = sources(&[dir.join("a.txt")], None).unwrap();
    prepare(&t1, &src, &dir.join("one"), 100_000, &|_| {}).unwrap();
    prepare(&t2, &src, &dir.join("two"), 100_000, &|_| {}).unwrap();
    let shards = TokenShards::open(&dir.join("one")).unwrap();
    assert!(shards.check(Some(&t1), 300).is_ok());
    let e = shards.check(Some(&t2), 300).unwrap_err().to_string();
    assert!(e.contains("another tokenizer"), "{e}");
    let e = shards.check(None, 96).unwrap_err().to_string();
    assert!(e.contains("300 tokens") && e.contains("embeds 96"), "{e}");
    // A shard its manifest does not list is not read (issue #34: stale shards of an earlier,
    // larger prepare were trained on).
    let tokens = shards.tokens();
    std::fs::copy(dir.join("two/shard-00000.bin"), dir.join("one/shard-00001.bin")).unwrap();
    assert_eq!(TokenShards::open(&dir.join("one")).unwrap().tokens(), tokens);
    // A listed shard replaced, cut short or changed in one byte is named.
    let f = dir.join("one/shard-00000.bin");
    let good = std::fs::read(&f).unwrap();
    std::fs::copy(dir.join("two/shard-00000.bin"), &f).unwrap();
    let e = TokenShards::open(&dir.join("one")).err().unwrap().to_string();
    assert!(e.contains("shard-00000.bin: made with another tokenizer or holding other tokens"), "{e}");
    std::fs::write(&f, &good[..good.len() - 3]).unwrap();
    let e = TokenShards::open(&dir.join("one")).err().unwrap().to_string();
    assert!(e.contains("shard-00000.bin: the header says"), "{e}");
    let mut flipped = good.clone();
    *flipped.last_mut().unwrap() ^= 1;
    std::fs::write(&f, &flipped).unwrap();
    let e = TokenShards::open(&dir.join("one")).err().unwrap().to_string();
    assert!(e.contains("shard-00000.bin: its SHA-256 is not the one manifest.json lists"), "{e}");
    std::fs::write(&f, &good).unwrap();
    assert!(TokenShards::open(&dir.join("one")).is_ok());
    // An interrupted prepare (no manifest) is refused; so is preparing over earlier shards, and
    // an input without text.
    std::fs::remove_file(dir.join("one/manifest.json")).unwrap();
    let e = TokenShards::open(&dir.join("one")).err().unwrap().to_string();
    assert!(e.contains("no manifest.json") && e.contains("not a complete `kolo data prepare` output"), "{e}");
    let e = prepare(&t1, &src, &dir.join("two"), 100_000, &|_| {}).unwrap_err().to_string();
    assert!(e.contains("holds the shards of an earlier prepare"), "{e}");
    std::fs::write(dir.join("empty.txt"), "").unwrap();
    let e = prepare(&t1, &sources(&[dir.join("empty.txt")], None).unwrap(), &dir.join("four"), 100, &|_| {}).unwrap_err().to_string();
    assert!(e.contains("the inputs hold no text"), "{e}");
    assert!(!dir.join("four").exists(), "an empty prepare left a directory");
    std::fs::write(dir.join("b.jsonl"), "{\"text\": \"a\"}\n{\"body\": \"b\"}\n").unwrap();
    let e =
        prepare(&t1, &sources(&[dir.join("b.jsonl")], Some("text")).unwrap(), &dir.join("three"), 100, &|_| {}).unwrap_err().to_string();
    assert!(e.contains("b.jsonl: line 2: no string field `text`"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Llama-style model saved by `transformers` (`LlamaForCausalLM`: RMSNorm, rotary
/// embeddings, SwiGLU, 4 query heads over 2 key/value heads, untied output) gives its logits in
/// Kolo within 1e-4; it trains (every parameter receives a gradient through the trainer's hook,
/// and a few SGD steps lower the loss) and saves back under the same names and shapes.
#[test]
fn hugging_face_llama_loads_with_transformers_logits_trains_and_saves_back() {
    let dir = kolo_testkit::files::hf_llama_tiny();
    let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let (ids, want) = (r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone());
    let (varmap, model) = crate::hf::load_llama(&dir, &Device::Cpu).unwrap();
    let d = max_diff(&model.forward(&ids).unwrap(), &want);
    eprintln!("Llama logits: max difference from transformers' {d:.2e}");
    assert!(d < 1e-4, "logits differ from transformers' by {d}");
    assert!(max_diff(&want, &want.zeros_like().unwrap()) > 1.0);

    let dist = world_of_one();
    let mut t = Trainer::new(&varmap, &dist, opts("[optim]\nkind = \"sgd\"\nlr = 0.05\n")).unwrap();
    let first = t.step(|| model.loss(&ids)).unwrap().loss;
    for _ in 0..4 {
        t.step(|| model.loss(&ids)).unwrap();
    }
    let last = t.step(|| model.loss(&ids)).unwrap().loss;
    assert!(last < first - 0.1, "loss {first} -> {last}");

    let out = std::env::temp_dir().join(format!("kolo-llama-save-{}", std::process::id()));
    crate::hf::save_pretrained(&out, &varmap, model.config()).unwrap();
    assert_eq!(saved_tensors(&out), saved_tensors(&dir));
    let (_, again) = crate::hf::load_llama(&out, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&again.forward(&ids).unwrap(), &model.forward(&ids).unwrap()), 0.0);
    let _ = std::fs::remove_dir_all(&out);
}

/// Splitting a Hugging Face model over a tensor-parallel group it does not fit is a one-line
/// error naming the numbers: the tiny Llama's 4 query and 2 key/value heads over 3 ranks, and
/// GPT-2's 4 heads over 3. In-process groups of threads (`LocalComm`); each rank checks.
#[test]
fn hugging_face_models_that_do_not_split_are_named() {
    use kolo_comm::{Communicator, LocalComm};
    for (n, dir, want) in [
        (
            3,
            kolo_testkit::files::hf_llama_tiny(),
            "num_attention_heads 4, num_key_value_heads 2 and intermediate_size 80 must each be a multiple of 3",
        ),
        (
            3,
            kolo_testkit::files::hf_gpt2_tiny(),
            "GPT-2 over 3 tensor-parallel ranks: n_head 4 and the MLP width 192 must each be a multiple of 3",
        ),
        (
            3,
            kolo_testkit::files::hf_tiny("neox"),
            "GPT-NeoX over 3 tensor-parallel ranks: num_attention_heads 4 and intermediate_size 80 must each be a multiple of 3",
        ),
        (3, kolo_testkit::files::hf_tiny("phi3"), "must each be a multiple of 3"),
    ] {
        let ranks = LocalComm::create(kolo_base::WorldSize::new(n).unwrap());
        std::thread::scope(|s| {
            for c in ranks {
                let dir = dir.clone();
                s.spawn(move || {
                    let tp = crate::tp::TensorParallel::new(std::sync::Arc::new(c) as std::sync::Arc<dyn Communicator>);
                    let e = crate::hf::load_causal_lm_split(&dir, &Device::Cpu, Some(&tp)).err().expect("refused").to_string();
                    assert!(e.contains(want) && e.contains("config.json"), "{e}");
                });
            }
        });
    }
}

/// Copies the checkpoint directory `src` to a fresh temporary directory named after `what`.
fn copy_checkpoint(src: &std::path::Path, what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kolo-hf-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    dir
}

/// The reference ids and logits of a checkpoint made by `transformers`.
fn reference(dir: &std::path::Path) -> (Tensor, Tensor) {
    let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    (r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone())
}

/// Five SGD steps (lr 0.05) of `model`'s loss on `ids` through the trainer in a world of one
/// lower it by more than 0.1.
fn sgd_lowers_the_loss(varmap: &candle_nn::VarMap, model: &crate::hf::CausalLm, ids: &Tensor, what: &str) {
    let dist = world_of_one();
    let mut t = Trainer::new(varmap, &dist, opts("[optim]\nkind = \"sgd\"\nlr = 0.05\n")).unwrap();
    let first = t.step(|| model.loss(ids)).unwrap().loss;
    for _ in 0..3 {
        t.step(|| model.loss(ids)).unwrap();
    }
    let last = t.step(|| model.loss(ids)).unwrap().loss;
    assert!(last < first - 0.1, "{what}: loss {first} -> {last}");
}

/// Saves `model` to a fresh directory named after `what`, loads it back and checks the same
/// logits on `ids` bitwise; returns the directory (the caller removes it).
fn saves_back(varmap: &candle_nn::VarMap, model: &crate::hf::CausalLm, ids: &Tensor, what: &str) -> std::path::PathBuf {
    let out = std::env::temp_dir().join(format!("kolo-hf-{what}-save-{}", std::process::id()));
    model.save_pretrained(&out, varmap).unwrap();
    let (_, again) = crate::hf::load_causal_lm(&out, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&again.forward(ids).unwrap(), &model.forward(ids).unwrap()), 0.0, "{what}");
    out
}

/// Qwen2 (q/k/v biases, tied embeddings, a sliding window on its second layer only), Mistral
/// (a sliding window of 5 over 16 tokens), Llama 3's rotary scaling, Gemma (norms of 1 + weight,
/// scaled embeddings, GeGLU, wide heads), Phi-3 (fused projections, half of each head rotated, a
/// sliding window) and GPT-NeoX (parallel residual, a quarter of each head rotated), each saved by
/// `transformers`, give its logits within 1e-4 and leave nothing unused. Each feature matters:
/// the same checkpoint with the feature's config key taken out gives logits off by more than
/// 0.05 (so the reference could not pass without it). Each trains (a few SGD steps lower the
/// loss) and saves back to the same logits bitwise.
#[test]
fn architectures_load_with_transformers_logits_and_train() {
    for (arch, without) in [
        (
            "qwen2",
            vec![
                ("\"use_sliding_window\": true", "\"use_sliding_window\": false"),
                ("\"full_attention\",\n    \"sliding_attention\"", "\"full_attention\",\n    \"full_attention\""),
            ],
        ),
        ("mistral", vec![("\"sliding_window\": 5", "\"sliding_window\": null")]),
        ("llama3", vec![("\"rope_type\": \"llama3\"", "\"rope_type\": \"default\"")]),
        // Without its norms of 1 + weight and its embedding scale, Gemma is a Llama.
        ("gemma", vec![("\"model_type\": \"gemma\"", "\"model_type\": \"llama\"")]),
        ("phi3", vec![("\"partial_rotary_factor\": 0.5", "\"partial_rotary_factor\": 1.0")]),
        ("phi3", vec![("\"sliding_window\": 6", "\"sliding_window\": null")]),
        ("neox", vec![("\"use_parallel_residual\": true", "\"use_parallel_residual\": false")]),
        ("neox", vec![("\"partial_rotary_factor\": 0.25", "\"partial_rotary_factor\": 0.5")]),
        // Without its head norms (as a Qwen2, no biases in the file) Qwen3 reads q_norm and
        // k_norm as unused tensors and computes other logits.
        ("qwen3", vec![("\"model_type\": \"qwen3\"", "\"model_type\": \"llama\"")]),
        // Gemma 3: each layer type's own rotary embedding (the full layer's scaled by 8), and
        // the head norms (as a Gemma 2 they are left unused).
        ("gemma3", vec![("\"rope_type\": \"linear\"", "\"rope_type\": \"default\"")]),
        ("gemma3", vec![("\"rope_theta\": 10000.0", "\"rope_theta\": 1000000.0")]),
        ("gemma3", vec![("\"model_type\": \"gemma3_text\"", "\"model_type\": \"gemma2\"")]),
        ("gemma2", vec![("\"attn_logit_softcapping\": 2.0", "\"attn_logit_softcapping\": null")]),
        ("gemma2", vec![("\"final_logit_softcapping\": 5.0", "\"final_logit_softcapping\": null")]),
        ("gemma2", vec![("\"query_pre_attn_scalar\": 24", "\"query_pre_attn_scalar\": 16")]),
        ("gemma2", vec![("\"sliding_window\": 6", "\"sliding_window\": 16")]),
        ("llama-yarn", vec![("\"rope_type\": \"yarn\"", "\"rope_type\": \"default\"")]),
        // Its 16 tokens are beyond the original context of 8: the long factors and the
        // attention factor; within a context of 32, the short ones and none.
        ("phi3-longrope", vec![("\"original_max_position_embeddings\": 8", "\"original_max_position_embeddings\": 32")]),
        ("phi3-longrope", vec![("\"rope_type\": \"longrope\"", "\"rope_type\": \"default\"")]),
        // Qwen3-MoE's top 3 of 8 experts weighted by their probabilities as they are, not
        // renormalised (Mixtral's way).
        ("qwen3-moe", vec![("\"norm_topk_prob\": false", "\"norm_topk_prob\": true")]),
        // Qwen2-MoE's window of 6 on layers 0 and 2 (layer_types), over 16 tokens.
        ("qwen2-moe", vec![("\"sliding_window\": 6", "\"sliding_window\": 16")]),
        // DeepSeek-V2: the routed experts' sum times 2.5; the scores times YaRN's mscale^2.
        ("deepseek-v2", vec![("\"routed_scaling_factor\": 2.5", "\"routed_scaling_factor\": 1.0")]),
        ("deepseek-v2", vec![("\"mscale_all_dim\": 0.707", "\"mscale_all_dim\": 0.0")]),
        // DeepSeek-V2's group_limited_greedy (the 236B model's): within the best 2 of 4 groups.
        ("deepseek-v2-groups", vec![("\"group_limited_greedy\"", "\"greedy\"")]),
        // DeepSeek-V3: routing within the best 2 of 4 groups (with 1 group, among all 8).
        ("deepseek-v3", vec![("\"n_group\": 4", "\"n_group\": 1"), ("\"topk_group\": 2", "\"topk_group\": 1")]),
    ] {
        let dir = kolo_testkit::files::hf_tiny(arch);
        let (ids, want) = reference(&dir);
        let (varmap, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
        let d = max_diff(&model.forward(&ids).unwrap(), &want);
        eprintln!("{arch}: logits differ from transformers' by {d:.2e}");
        assert!(d < 1e-4, "{arch}: logits differ from transformers' by {d}");
        assert!(model.load_report().is_empty(), "{arch}: {}", model.load_report());

        let plain = copy_checkpoint(&dir, &format!("{arch}-plain"));
        let mut cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
        for (a, b) in &without {
            assert!(cfg.contains(a), "{arch}: {a} not in the config");
            cfg = cfg.replace(a, b);
        }
        std::fs::write(plain.join("config.json"), cfg).unwrap();
        let (_, plain_model) = crate::hf::load_causal_lm(&plain, &Device::Cpu).unwrap();
        let off = max_diff(&plain_model.forward(&ids).unwrap(), &want);
        assert!(off > 0.05, "{arch}: without its feature the logits are only {off} off");
        let _ = std::fs::remove_dir_all(&plain);

        sgd_lowers_the_loss(&varmap, &model, &ids, arch);
        let out = saves_back(&varmap, &model, &ids, arch);
        assert_eq!(saved_tensors(&out), saved_tensors(&dir), "{arch}");
        // The same config.json, key for key (no `"head_dim": null` that transformers would read).
        let json = |d: &std::path::Path| {
            serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap()
        };
        assert_eq!(json(&out), json(&dir), "{arch}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Mixtral saved by `transformers` (4 SwiGLU experts per layer, each token through its top 2, the
/// two gate weights renormalised), Qwen3-MoE (8 experts on layers 0 and 2, top 3 not
/// renormalised, a dense layer 1) and Qwen2-MoE (as Qwen3-MoE, with q/k/v biases and a shared
/// expert beside the routed ones, weighted per token by a sigmoid gate) give their logits within
/// 1e-4, and their training loss, with
/// the load-balancing loss over every sparse layer's tokens at once weighted 0.05
/// (`output_router_logits`), within 1e-5 of `transformers'` (whose `aux_loss` is 2.21 for Mixtral:
/// the weighted term is 0.11). With `output_router_logits` false the loss drops exactly that term,
/// as in `transformers`. Mixtral trains, every expert receiving a gradient, saves back to the
/// same tensors and logits, also computes them over 2 tensor-parallel ranks (each expert's width
/// split; as does Qwen2-MoE, its shared expert split as a dense MLP), runs as two pipeline stages
/// in turn with the whole model's loss and gradients (within 1e-6; the load-balancing loss's
/// routing handed on after the hidden states), and what it cannot do is refused by name: a top-k above the experts, router jitter.
#[test]
fn mixtral_loads_with_transformers_logits_and_loss_and_trains() {
    let scalar = |t: &Tensor| f64::from(t.flatten_all().unwrap().get(0).unwrap().to_scalar::<f32>().unwrap());
    for arch in ["mixtral", "qwen3-moe", "qwen2-moe"] {
        let dir = kolo_testkit::files::hf_tiny(arch);
        let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
        let (ids, want) = (r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone());
        let (want_loss, hf_aux) = (scalar(&r["loss"]), scalar(&r["aux_loss"]));
        let (_, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
        assert!(model.load_report().is_empty(), "{arch}: {}", model.load_report());
        let d = max_diff(&model.forward(&ids).unwrap(), &want);
        eprintln!("{arch}: logits differ from transformers' by {d:.2e}");
        assert!(d < 1e-4, "{arch}: logits differ from transformers' by {d}");
        let loss = f64::from(model.loss(&ids).unwrap().to_scalar::<f32>().unwrap());
        eprintln!("{arch}: loss {loss:.6} (transformers {want_loss:.6}, aux {hf_aux:.4})");
        assert!((loss - want_loss).abs() < 1e-5, "{arch}: loss {loss}, transformers' {want_loss}");

        let plain = copy_checkpoint(&dir, &format!("{arch}-plain"));
        let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
        assert!(cfg.contains("\"output_router_logits\": true"));
        std::fs::write(plain.join("config.json"), cfg.replace("\"output_router_logits\": true", "\"output_router_logits\": false"))
            .unwrap();
        let (_, no_aux) = crate::hf::load_causal_lm(&plain, &Device::Cpu).unwrap();
        let ce = f64::from(no_aux.loss(&ids).unwrap().to_scalar::<f32>().unwrap());
        assert!((loss - ce - 0.05 * hf_aux).abs() < 1e-5, "{arch}: loss {loss} - cross-entropy {ce} is not 0.05 x {hf_aux}");
        let _ = std::fs::remove_dir_all(&plain);
    }
    let dir = kolo_testkit::files::hf_tiny("mixtral");
    let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let ids = r["ids"].to_dtype(DType::U32).unwrap();
    let (varmap, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    let plain = copy_checkpoint(&dir, "mixtral-refused");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    for (from, to, why) in [
        ("\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "num_experts_per_tok 5 of 4 experts"),
        ("\"router_jitter_noise\": 0.0", "\"router_jitter_noise\": 0.01", "router_jitter_noise = 0.01"),
    ] {
        std::fs::write(plain.join("config.json"), cfg.replace(from, to)).unwrap();
        let e = crate::hf::load_causal_lm(&plain, &Device::Cpu).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains(why) && e.contains("config.json"), "{e}");
    }
    // Pipeline stages: the load-balancing loss counts every layer's tokens at once, so the
    // first stage hands the second its routing after its hidden states (a flat vector of
    // `stage_activation`'s length); the two in turn give the whole model's loss and gradients.
    let mut c = crate::hf::LlamaConfig::load(&dir).unwrap();
    let stage = |layers: std::ops::Range<usize>| {
        let vars = candle_nn::VarMap::new();
        let m = crate::hf::Llama::new_stage(&c, candle_nn::VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), None, layers).unwrap();
        crate::hf::load_weights(&vars, &dir).unwrap();
        (vars, m)
    };
    let ((vars0, first), (vars1, second)) = (stage(0..1), stage(1..2));
    let (b, t) = (ids.dim(0).unwrap(), ids.dim(1).unwrap() - 1);
    let handed = first.pipeline_stage(None, &ids).unwrap();
    assert_eq!(handed.dims(), first.stage_activation(b, t), "the first stage's activation");
    assert_eq!(first.stage_activation(b, t), [b * t * 48 + 4 + 5 * 3], "hidden states, 4 probabilities, 4 + 1 counts of 3 digits");
    let staged = second.pipeline_stage(Some(&handed), &ids).unwrap();
    let whole = model.loss(&ids).unwrap();
    let (l0, l1) = (whole.to_scalar::<f32>().unwrap(), staged.to_scalar::<f32>().unwrap());
    assert!((l0 - l1).abs() < 1e-6, "two stages' loss {l1}, the whole model's {l0}");
    let (g0, g1) = (whole.backward().unwrap(), staged.backward().unwrap());
    let whole_vars = varmap.data().lock().unwrap();
    for (name, v) in vars0.data().lock().unwrap().iter().chain(vars1.data().lock().unwrap().iter()) {
        let want = g0.get(whole_vars[name].as_tensor()).unwrap_or_else(|| panic!("`{name}`: no gradient in the whole model"));
        let d = max_diff(g1.get(v.as_tensor()).unwrap_or_else(|| panic!("`{name}` has no gradient over the stages")), want);
        assert!(d < 1e-6, "`{name}`: the stages' gradient differs from the whole model's by {d}");
    }
    drop(whole_vars);
    c.other.insert("output_router_logits".into(), false.into());
    assert_eq!(c.experts().unwrap().1, 0.0);
    // Without it, a first stage whose gate sends every token to experts 0 and 1 (all scores
    // equal: ties go to the lower index) still gives experts 2 and 3 their gradients, zeros,
    // through its hidden states, which keep their values.
    let vars = candle_nn::VarMap::new();
    let first = crate::hf::Llama::new_stage(&c, candle_nn::VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu), None, 0..1).unwrap();
    crate::hf::load_weights(&vars, &dir).unwrap();
    vars.data().lock().unwrap()["model.layers.0.block_sparse_moe.gate.weight"]
        .set(&Tensor::zeros((4, 48), DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    let hidden = first.pipeline_stage(None, &ids).unwrap();
    let grads = (&hidden * 1.5).unwrap().sum_all().unwrap().backward().unwrap();
    for (name, v) in vars.data().lock().unwrap().iter() {
        let g = grads.get(v.as_tensor()).unwrap_or_else(|| panic!("`{name}` has no gradient"));
        let idle = name.contains(".experts.2.") || name.contains(".experts.3.");
        assert_eq!(max_diff(g, &g.zeros_like().unwrap()) == 0.0, idle, "`{name}`");
    }
    let _ = std::fs::remove_dir_all(&plain);
    // Over 2 tensor-parallel ranks (each expert's width split, every rank routing the same
    // tokens; Qwen2-MoE's shared expert split as a dense MLP, its gate whole; DeepSeek's latent
    // attention by heads, the latent's projections whole): the same logits and loss on each.
    for arch in ["mixtral", "qwen2-moe", "deepseek-v2", "deepseek-v3"] {
        let dir = kolo_testkit::files::hf_tiny(arch);
        let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
        let want_loss = scalar(&r["loss"]) as f32;
        let ranks = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(2).unwrap());
        std::thread::scope(|s| {
            for c in ranks {
                let (dir, ids, want) = (dir.clone(), r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone());
                s.spawn(move || {
                    let tp = crate::tp::TensorParallel::new(std::sync::Arc::new(c) as std::sync::Arc<dyn kolo_comm::Communicator>);
                    let (_, split) = crate::hf::load_causal_lm_split(&dir, &Device::Cpu, Some(&tp)).unwrap();
                    let d = max_diff(&split.forward(&ids).unwrap(), &want);
                    assert!(d < 1e-4, "{arch}, tp rank {}: logits differ from transformers' by {d}", tp.rank());
                    let loss = split.loss(&ids).unwrap().to_scalar::<f32>().unwrap();
                    assert!((loss - want_loss).abs() < 1e-5, "{arch}, tp rank {}: loss {loss}, transformers' {want_loss}", tp.rank());
                });
            }
        });
    }
    let before: Vec<Tensor> = varmap.all_vars().iter().map(|v| v.as_tensor().copy().unwrap()).collect();
    sgd_lowers_the_loss(&varmap, &model, &ids, "mixtral");
    let moved = varmap.all_vars().iter().zip(&before).filter(|(v, b)| max_diff(v.as_tensor(), b) > 0.0).count();
    assert_eq!(moved, varmap.all_vars().len(), "every parameter, each expert's among them, moves");
    let out = saves_back(&varmap, &model, &ids, "mixtral");
    assert_eq!(saved_tensors(&out), saved_tensors(&dir));
    let _ = std::fs::remove_dir_all(&out);
}

/// Mixtral with its experts dealt out over 2 in-process ranks (`Llama::new_experts`): each rank
/// holds only its 2 of every layer's 4 experts (the checkpoint's other experts are what it
/// leaves unused), and on the same ids both compute `transformers`' logits within 1e-4 and its
/// loss within 1e-5, the tokens travelling to the other rank's experts and back.
#[test]
fn mixtral_experts_dealt_out_over_two_ranks_compute_the_whole_model() {
    let dir = kolo_testkit::files::hf_tiny("mixtral");
    let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu).unwrap();
    let (ids, want) = (r["ids"].to_dtype(DType::U32).unwrap(), r["logits"].clone());
    let want_loss = r["loss"].flatten_all().unwrap().get(0).unwrap().to_scalar::<f32>().unwrap();
    let cfg = crate::hf::LlamaConfig::load(&dir).unwrap();
    let ranks = kolo_comm::LocalComm::create(kolo_base::WorldSize::new(2).unwrap());
    std::thread::scope(|s| {
        for c in ranks {
            let (dir, cfg, ids, want) = (dir.clone(), cfg.clone(), ids.clone(), want.clone());
            s.spawn(move || {
                let ep = crate::ep::ExpertParallel::new(std::sync::Arc::new(c) as std::sync::Arc<dyn kolo_comm::Communicator>);
                let varmap = candle_nn::VarMap::new();
                let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
                let model = crate::hf::Llama::new_experts(&cfg, vb, &ep).unwrap();
                let report = crate::hf::load_weights(&varmap, &dir).unwrap();
                let (mine, other) = if ep.rank() == 0 { ([0, 1], [2, 3]) } else { ([2, 3], [0, 1]) };
                let mut held: Vec<String> = varmap.data().lock().unwrap().keys().filter(|k| k.contains(".experts.")).cloned().collect();
                held.sort();
                let named = |js: [usize; 2]| {
                    let mut v: Vec<String> = (0..2)
                        .flat_map(|l| {
                            js.iter().flat_map(move |j| {
                                ["w1", "w2", "w3"].map(|w| format!("model.layers.{l}.block_sparse_moe.experts.{j}.{w}.weight"))
                            })
                        })
                        .collect();
                    v.sort();
                    v
                };
                assert_eq!(held, named(mine), "rank {}", ep.rank());
                let mut unused = report.unused_tensors.clone();
                unused.sort();
                assert_eq!(unused, named(other), "rank {}", ep.rank());
                let d = max_diff(&model.forward(&ids).unwrap(), &want);
                assert!(d < 1e-4, "rank {}: logits differ from transformers' by {d}", ep.rank());
                let loss = model.loss(&ids).unwrap().to_scalar::<f32>().unwrap();
                assert!((loss - want_loss).abs() < 1e-5, "rank {}: loss {loss}, transformers' {want_loss}", ep.rank());
            });
        }
    });
}

/// A Gemma 3 with a vision tower (`gemma3`: `Gemma3ForConditionalGeneration`, the layout of the
/// 4B, 12B and 27B checkpoints) loads as its text model (`text_config`, the tensors under
/// `language_model.`; the vision tower and projector left aside, not reported unused) with
/// `transformers`' text-only logits within 1e-4, trains, and exports as `gemma3_text` that loads
/// back to the same logits bitwise. A `gemma3` config without its text model is named.
#[test]
fn a_gemma3_with_a_vision_tower_trains_as_its_text_model() {
    let dir = kolo_testkit::files::hf_tiny("gemma3-mm");
    let (ids, want) = reference(&dir);
    let (varmap, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    assert!(model.load_report().is_empty(), "{}", model.load_report());
    let d = max_diff(&model.forward(&ids).unwrap(), &want);
    eprintln!("gemma3 with a vision tower: logits differ from transformers' by {d:.2e}");
    assert!(d < 1e-4, "logits differ from transformers' by {d}");
    assert!(varmap.all_vars().len() < candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap().len());
    sgd_lowers_the_loss(&varmap, &model, &ids, "gemma3 with a vision tower");
    let out = saves_back(&varmap, &model, &ids, "gemma3-mm");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model_type"].as_str(), Some("gemma3_text"));
    let _ = std::fs::remove_dir_all(&out);
    let bare = copy_checkpoint(&dir, "gemma3-mm-bare");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    c.as_object_mut().unwrap().remove("text_config");
    std::fs::write(bare.join("config.json"), c.to_string()).unwrap();
    let e = crate::hf::load_causal_lm(&bare, &Device::Cpu).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("a gemma3 config without a text_config of model_type gemma3_text") && e.contains("config.json"), "{e}");
    let _ = std::fs::remove_dir_all(&bare);
}

/// A checkpoint saved in shards of at most 40 KB (`model-0000i-of-0000n.safetensors` and the
/// index) and in bf16 loads back: f32 shards bitwise, bf16 within bf16's rounding, with
/// `config.json` stating the dtype written. A shard the index names that is missing, a tensor
/// the index puts in the wrong file, a tensor of the wrong dtype and a tokenizer-sized mistake
/// are one-line errors naming the file and the tensor; an extra tensor and an unknown config
/// key are reported, not ignored; saving again in one file removes the old shards.
#[test]
fn sharded_and_bf16_checkpoints_round_trip_and_name_what_is_wrong() {
    let src = kolo_testkit::files::hf_llama_tiny();
    let (ids, want) = reference(&src);
    let (varmap, model) = crate::hf::load_causal_lm(&src, &Device::Cpu).unwrap();
    let logits = model.forward(&ids).unwrap();
    let dir = std::env::temp_dir().join(format!("kolo-hf-shards-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = crate::hf::SaveOptions { max_shard_size: Some(40_000), ..Default::default() };
    model.save_pretrained_with(&dir, &varmap, &opts).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(&dir).unwrap().flatten().map(|f| f.file_name().to_string_lossy().into_owned()).collect();
    files.sort();
    let n = files.iter().filter(|f| f.starts_with("model-")).count();
    assert!(n >= 4, "{files:?}");
    assert!(
        files.contains(&format!("model-00001-of-{n:05}.safetensors")) && files.contains(&"model.safetensors.index.json".into()),
        "{files:?}"
    );
    assert!(!files.contains(&"model.safetensors".into()), "{files:?}");
    for f in files.iter().filter(|f| f.starts_with("model-")) {
        let len = std::fs::metadata(dir.join(f)).unwrap().len();
        // 40 KB of tensors, or one tensor larger than that (the 96 x 48 embedding is 18 KB).
        assert!(len < 41_000, "{f}: {len} bytes");
    }
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    assert_eq!(index["weight_map"].as_object().unwrap().len(), varmap.all_vars().len());
    let (_, again) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    assert_eq!(max_diff(&again.forward(&ids).unwrap(), &logits), 0.0);
    assert!(again.load_report().is_empty(), "{}", again.load_report());

    // Each shard the index names must be there.
    let moved = dir.join("moved.safetensors");
    std::fs::rename(dir.join(format!("model-00002-of-{n:05}.safetensors")), &moved).unwrap();
    let e = crate::hf::load_causal_lm(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(
        e.contains("model.safetensors.index.json") && e.contains(&format!("model-00002-of-{n:05}.safetensors")) && e.contains("is missing"),
        "{e}"
    );
    std::fs::rename(&moved, dir.join(format!("model-00002-of-{n:05}.safetensors"))).unwrap();
    // An index that puts a tensor in the wrong file.
    let text = std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap();
    let wrong = text.replacen(
        &format!("\"model.norm.weight\": \"model-{n:05}-of-{n:05}.safetensors\""),
        &format!("\"model.norm.weight\": \"model-00001-of-{n:05}.safetensors\""),
        1,
    );
    assert_ne!(wrong, text, "model.norm.weight is not in the last shard: {text}");
    std::fs::write(dir.join("model.safetensors.index.json"), &wrong).unwrap();
    let e = crate::hf::load_causal_lm(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains(&format!("model-00001-of-{n:05}.safetensors")) && e.contains("no tensor `model.norm.weight`"), "{e}");
    std::fs::write(dir.join("model.safetensors.index.json"), &text).unwrap();

    // bf16 in one file: the config says so, and the values are bf16's rounding of the model's.
    model.save_pretrained_with(&dir, &varmap, &crate::hf::SaveOptions { dtype: DType::BF16, max_shard_size: None }).unwrap();
    let left: Vec<String> = std::fs::read_dir(&dir).unwrap().flatten().map(|f| f.file_name().to_string_lossy().into_owned()).collect();
    assert!(left.iter().all(|f| !f.starts_with("model-") && f != "model.safetensors.index.json"), "old shards left: {left:?}");
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["dtype"], "bfloat16");
    let st = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(st.values().all(|t| t.dtype() == DType::BF16));
    let (bf_vars, bf) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    let rounded = varmap.data().lock().unwrap().get("model.layers.0.mlp.up_proj.weight").unwrap().to_dtype(DType::BF16).unwrap();
    let back = bf_vars.data().lock().unwrap().get("model.layers.0.mlp.up_proj.weight").unwrap().to_dtype(DType::BF16).unwrap();
    assert_eq!(max_diff(&rounded.to_dtype(DType::F32).unwrap(), &back.to_dtype(DType::F32).unwrap()), 0.0);
    let d = max_diff(&bf.forward(&ids).unwrap(), &want);
    assert!(d > 1e-4 && d < 0.5, "bf16 weights: logits {d} off");

    // An extra tensor and an unknown config key are reported; a tensor of the wrong dtype is refused.
    let mut tensors = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    tensors.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(src.join("config.json"))
        .unwrap()
        .replace("\"vocab_size\": 96", "\"vocab_size\": 96,\n  \"fancy_new_option\": 3");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let (_, m) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    assert_eq!(m.load_report().unused_tensors, ["model.layers.0.self_attn.rotary_emb.inv_freq"]);
    assert_eq!(m.load_report().unknown_keys, ["fancy_new_option"]);
    tensors.insert("model.norm.weight".into(), Tensor::zeros(48, DType::I64, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let e = crate::hf::load_causal_lm(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("model.safetensors") && e.contains("`model.norm.weight` is I64"), "{e}");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    let e = crate::hf::load_causal_lm(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("no model.safetensors or model.safetensors.index.json"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Options that change the arithmetic and are not implemented are refused by name, never
/// ignored: other rotary scalings (and dynamic NTK scaling beyond the original context), a
/// partial rotary embedding that does not turn whole pairs,
/// unknown layer types, biases where the architecture has none, another architecture.
#[test]
fn llama_family_options_not_implemented_are_refused() {
    let src = kolo_testkit::files::hf_tiny("llama3");
    let dir = copy_checkpoint(&src, "refused");
    let cfg = std::fs::read_to_string(src.join("config.json")).unwrap();
    let load = |cfg: &str| {
        std::fs::write(dir.join("config.json"), cfg).unwrap();
        crate::hf::load_causal_lm(&dir, &Device::Cpu).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let e = load(&cfg.replace("\"llama3\"", "\"proportional\""));
    assert!(e.contains("config.json") && e.contains("unsupported rope_type \"proportional\""), "{e}");
    // Dynamic NTK scaling loads (within the original context it is the plain rotary
    // embedding) and refuses a longer sequence, where its frequencies would change.
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"llama3\"", "\"dynamic\"")
            .replace("\"original_max_position_embeddings\": 16", "\"original_max_position_embeddings\": 8"),
    )
    .unwrap();
    let (_, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    let (ids, _) = reference(&src);
    let e = model.forward(&ids).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("sequence of 16 tokens beyond the original context of 8: dynamic NTK"), "{e}");
    assert!(model.forward(&ids.narrow(1, 0, 8).unwrap()).is_ok());
    // 0.3 of a head of 12 is 3.6 dimensions: rotary embeddings turn pairs.
    let e = load(&cfg.replace("\"factor\": 8.0,", "\"factor\": 8.0, \"partial_rotary_factor\": 0.3,"));
    assert!(e.contains("rotary dimension 3 (head_dim x partial_rotary_factor) is not a positive even number"), "{e}");
    let e = load(&cfg.replace("\"low_freq_factor\": 1.0,", ""));
    assert!(e.contains("rope parameter low_freq_factor missing"), "{e}");
    let e = load(&cfg.replace("\"model_type\": \"llama\"", "\"model_type\": \"mistral\", \"attention_bias\": true"));
    assert!(e.contains("attention_bias = true is not an option of mistral"), "{e}");
    let e = load(&cfg.replace("\"model_type\": \"llama\"", "\"model_type\": \"gemma3n\""));
    assert!(
        e.contains(
            "model_type \"gemma3n\" is not supported (gpt2, gpt_neox, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2, gemma3_text, phi3, deepseek_v2, deepseek_v3, gemma3)"
        ),
        "{e}"
    );
    let q = std::fs::read_to_string(kolo_testkit::files::hf_tiny("qwen2").join("config.json")).unwrap();
    std::fs::copy(kolo_testkit::files::hf_tiny("qwen2").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let e = load(&q.replace("\"sliding_attention\"", "\"chunked_attention\""));
    assert!(e.contains("unsupported layer type \"chunked_attention\""), "{e}");
    // A routing method that is not DeepSeek-V2's (V3's).
    let d = std::fs::read_to_string(kolo_testkit::files::hf_tiny("deepseek-v2").join("config.json")).unwrap();
    std::fs::copy(kolo_testkit::files::hf_tiny("deepseek-v2").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let e = load(&d.replace("\"greedy\"", "\"noaux_tc\""));
    assert!(e.contains("config.json") && e.contains("topk_method \"noaux_tc\" is not deepseek_v2's (greedy, group_limited_greedy)"), "{e}");
    // DeepSeek-V3's groups must split its 8 experts evenly, two or more each.
    let d = std::fs::read_to_string(kolo_testkit::files::hf_tiny("deepseek-v3").join("config.json")).unwrap();
    std::fs::copy(kolo_testkit::files::hf_tiny("deepseek-v3").join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let e = load(&d.replace("\"n_group\": 4", "\"n_group\": 3"));
    assert!(e.contains("config.json") && e.contains("n_group 3 and topk_group 2: mixture of experts: 8 experts in 3 groups"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fine-tuning job's evaluation is the mean loss over its held-out windows, the last
/// `eval_fraction` of the data, in batches in order (the last one shorter): computed here by hand
/// from the same windows and the model, with the job's `evaluate` in a world of one.
#[test]
fn fine_tuning_evaluation_is_the_mean_loss_of_the_held_out_windows() {
    let dir = std::env::temp_dir().join(format!("kolo-hf-eval-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("part.txt");
    let corpus = std::fs::read(kolo_testkit::files::shakespeare()).unwrap();
    std::fs::write(&text, &corpus[..10_000]).unwrap();
    let toml = format!(
        "[model]\nhf = \"{}\"\n[data]\ntext = \"{}\"\nbatch_size = 4\nseq = 24\neval_fraction = 0.1\n[train]\nsteps = 1\neval_batches = 0\n",
        kolo_testkit::files::hf_llama_tiny().display(),
        text.display()
    );
    let cfg = crate::hf::FineTuneConfig::from_toml_str(&toml, &dir.join("job.toml")).unwrap();
    let ft = crate::hf::FineTune::new(&world_of_one(), cfg).unwrap();
    // 10,000 bytes make 400 windows of 25 tokens; the last 40 are held out: 10 batches of 4.
    let tokens: Vec<u32> = corpus[..10_000].iter().map(|b| u32::from(*b) % 96).collect();
    let mut sum = 0.0;
    for b in 0..10 {
        let ids: Vec<u32> = (0..4).flat_map(|r| tokens[(360 + 4 * b + r) * 25..(361 + 4 * b + r) * 25].to_vec()).collect();
        let ids = Tensor::from_vec(ids, (4, 25), &Device::Cpu).unwrap();
        sum += f64::from(ft.model().loss(&ids).unwrap().to_scalar::<f32>().unwrap());
    }
    let got = ft.evaluate().unwrap().unwrap();
    assert!((got - sum / 10.0).abs() < 1e-6, "evaluate {got}, by hand {}", sum / 10.0);
    let e = crate::hf::FineTuneConfig::from_toml_str(&toml.replace("eval_fraction = 0.1", "eval_fraction = 1.5"), &dir.join("job.toml"))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("job.toml") && e.contains("data.eval_fraction 1.5 is not in [0, 1)"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A fine-tuning job hands its trainer the batch per micro-step: under pipeline stages the
/// micro-batch, so the trainer's global batch (throughput, `optim.reference_batch`'s learning
/// rate) is the job's `batch_size x dp`, not `micro_batches` times it (it was: the pipeline's
/// runs reported twice their tokens/s, and a reference batch scaled the rate twice).
#[test]
fn a_pipelined_fine_tuning_job_counts_its_batch_once() {
    let toml = |mesh: &str| {
        format!(
            "[model]\nhf = \"{}\"\n[data]\ntext = \"x.txt\"\nbatch_size = 8\nseq = 16\n[optim]\nlr = 0.01\nreference_batch = 16\n[train]\nsteps = 1\n{mesh}",
            kolo_testkit::files::hf_llama_tiny().display()
        )
    };
    for (mesh, micro) in [("", 1), ("[mesh]\ndp = 2\npp = 2\n[pipeline]\nmicro_batches = 4\n", 4), ("[mesh]\npp = 2\n", 2)] {
        let cfg = crate::hf::FineTuneConfig::from_toml_str(&toml(mesh), std::path::Path::new("job.toml")).unwrap();
        let o = cfg.train_options();
        assert_eq!(o.train.grad_accum, micro, "{mesh}");
        assert_eq!(o.data.batch_size * o.train.grad_accum as usize, 8, "{mesh}: the replica's batch per step");
    }
}

/// DeepSeek-V3's balancing without an auxiliary loss: after a step on the reference ids, each
/// MoE layer's selection bias has moved by +0.001 for the experts `transformers`' routing of
/// those tokens gave fewer than the mean of the layer's choices and -0.001 for those given more
/// (`expert_counts.safetensors`, made by `test-data/hf/make_expert_counts.py`: the counts are
/// transformers', not Kolo's own), exactly, in f32; the pure rule on its own, with an expert at
/// the mean left alone. The counts of a forward pass before the step (an evaluation's) are
/// forgotten, not added.
#[test]
fn deepseek_v3_selection_biases_move_towards_balance_by_transformers_counts() {
    assert_eq!(crate::ep::expert_bias_step(&[3.0, 1.0, 2.0, 2.0], 0.5), [-0.5, 0.5, 0.0, 0.0]);
    let dir = kolo_testkit::files::hf_tiny("deepseek-v3");
    let (ids, _) = reference(&dir);
    let counts =
        candle_core::safetensors::load(dir.join("expert_counts.safetensors"), &Device::Cpu).unwrap()["counts"].to_vec2::<f32>().unwrap();
    let (varmap, model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
    assert!(model.has_selection_bias());
    let biases = |what: &str| -> Vec<Vec<f32>> {
        let vars = varmap.data().lock().unwrap();
        let mut names: Vec<&String> = vars.keys().filter(|k| k.ends_with("e_score_correction_bias")).collect();
        names.sort();
        assert_eq!(names.len(), counts.len(), "{what}: one bias per MoE layer");
        names.iter().map(|k| vars[*k].to_vec1::<f32>().unwrap()).collect()
    };
    let before = biases("before");
    let dist = super::world_of_one();
    let opts = crate::TrainOptions::from_toml_str("[optim]\nkind = \"sgd\"\nlr = 0.01\n").unwrap();
    let mut t = crate::Trainer::new(&varmap, &dist, opts).unwrap();
    // An evaluation's forward pass on other tokens, then forgotten.
    model.loss(&ids.narrow(1, 0, 5).unwrap()).unwrap();
    model.forget_expert_load();
    let balance = crate::ep::ExpertBias::new(&**dist.comm(), 0.001).unwrap();
    t.step_then(|| model.loss(&ids), |t| model.update_expert_bias(&balance, t)).unwrap();
    for (l, ((after, before), counts)) in biases("after").iter().zip(&before).zip(&counts).enumerate() {
        let mean = counts.iter().sum::<f32>() / counts.len() as f32;
        for (e, ((a, b), c)) in after.iter().zip(before).zip(counts).enumerate() {
            let want = if *c < mean {
                b + 0.001f32
            } else if *c > mean {
                b - 0.001f32
            } else {
                *b
            };
            assert_eq!(*a, want, "layer {l}, expert {e}: {c} of the choices (mean {mean}): bias {b} became {a}");
        }
    }
    // A model without a selection bias is refused the setting by name.
    let cfg = crate::hf::FineTuneConfig::from_toml_str(
        &format!(
            "[model]\nhf = \"{}\"\nexpert_bias_rate = 0.001\n[data]\ntext = \"{}\"\nbatch_size = 2\nseq = 8\n",
            kolo_testkit::files::hf_tiny("mixtral").display(),
            kolo_testkit::files::shakespeare().display()
        ),
        std::path::Path::new("job.toml"),
    )
    .unwrap();
    let e = crate::hf::FineTune::new(&dist, cfg).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("model.expert_bias_rate") && e.contains("no selection bias") && e.contains("mixtral"), "{e}");
}

/// Checkpointed layers with experts (`Llama::checkpoint_blocks`): Mixtral, Qwen3-MoE and
/// DeepSeek-V3 (latent attention, a selection bias, a dense first layer) give the loss
/// (cross-entropy plus the load-balancing loss over every layer's tokens, whose gate
/// probabilities come out of the checkpoints) and every parameter's gradient bitwise as
/// without checkpointing, and each layer's routing is counted once (backward's run of a layer
/// counts nothing).
#[test]
fn checkpointed_expert_layers_give_the_plain_gradients_and_count_tokens_once() {
    for arch in ["mixtral", "qwen3-moe", "deepseek-v3"] {
        let dir = kolo_testkit::files::hf_tiny(arch);
        let ids = Tensor::from_vec((0..2 * 17).map(|i| (i * 7 % 61) as u32).collect::<Vec<_>>(), (2, 17), &Device::Cpu).unwrap();
        let run = |layers: &[usize]| {
            let (varmap, mut model) = crate::hf::load_causal_lm(&dir, &Device::Cpu).unwrap();
            model.checkpoint_blocks(layers).unwrap();
            let crate::hf::CausalLm::Llama(m) = &model else { panic!("{arch}: a Llama-family model") };
            let loss = model.loss(&ids).unwrap();
            let grads = loss.backward().unwrap();
            let loads = m.take_expert_loads();
            let data = varmap.data().lock().unwrap();
            let mut names: Vec<&String> = data.keys().collect();
            names.sort();
            let g: Vec<(String, Vec<f32>)> = names
                .into_iter()
                .map(|n| (n.clone(), grads.get(data[n].as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap()))
                .collect();
            (loss.to_scalar::<f32>().unwrap(), g, loads)
        };
        let layers: Vec<usize> = (0..3).collect();
        let plain = run(&[]);
        let ck = run(&layers[..if arch == "mixtral" { 2 } else { 3 }]);
        assert_eq!(ck.0, plain.0, "{arch}: loss");
        for ((name, a), (_, b)) in ck.1.iter().zip(&plain.1) {
            assert!(a == b, "{arch}: the gradient of {name} differs");
        }
        assert!(!plain.2.is_empty() && plain.2.iter().all(|l| l.iter().sum::<u64>() > 0), "{arch}: {:?}", plain.2);
        assert_eq!(ck.2, plain.2, "{arch}: routing counts");
    }
}
