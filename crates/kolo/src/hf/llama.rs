//! Llama-style models (`LlamaForCausalLM`) with Hugging Face's parameter names.

use super::files::{LoadReport, Weights};
use crate::{Error, Result};
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, Embedding, VarBuilder, VarMap};
use std::path::Path;

/// The `model_type`s built by [`Llama`].
pub const FAMILY: &[&str] = &[
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "deepseek_v2",
    "deepseek_v3",
];

/// `config.json` of a Llama-style model (`LlamaForCausalLM`): RMSNorm, rotary position
/// embeddings, a SwiGLU MLP and grouped-query attention.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Transformer blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention; default: as many as query heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_key_value_heads: Option<usize>,
    /// Width of a head (default hidden_size / num_attention_heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Epsilon of the RMS norms.
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    /// Longest sequence the rotary tables cover.
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    /// The MLP's gate activation (`silu` when the file names none: neither this nor Gemma's
    /// `hidden_activation`; [`LlamaConfig::activation`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden_act: Option<String>,
    /// Whether the output projection is the token embedding.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Every other field of the file (rotary parameters among them), written back unchanged.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_max_positions() -> usize {
    2048
}

impl LlamaConfig {
    /// Reads `dir/config.json` and refuses options this implementation does not have. A Gemma 3
    /// with a vision tower (`gemma3`, `Gemma3ForConditionalGeneration`) gives its text model's
    /// `text_config` (`gemma3_text`).
    pub fn load(dir: &Path) -> Result<LlamaConfig> {
        Ok(Self::load_text_model(dir)?.0)
    }

    /// [`LlamaConfig::load`], and what the checkpoint's tensor names put before the text
    /// model's (`language_model.` for a Gemma 3 with a vision tower, else nothing).
    pub(super) fn load_text_model(dir: &Path) -> Result<(LlamaConfig, &'static str)> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::file(&path, format!("not JSON: {e}")))?;
        let (v, prefix) = match v.get("model_type").and_then(|t| t.as_str()) {
            Some("gemma3") => match v.get("text_config") {
                Some(t) if t.get("model_type").and_then(|m| m.as_str()) == Some("gemma3_text") => (t.clone(), "language_model."),
                _ => return Err(Error::file(&path, "a gemma3 config without a text_config of model_type gemma3_text")),
            },
            _ => (v, ""),
        };
        let c: LlamaConfig = serde_json::from_value(v).map_err(|e| Error::file(&path, format!("not a Llama config: {e}")))?;
        c.check().map_err(|e| Error::file(&path, e))?;
        Ok((c, prefix))
    }

    fn check(&self) -> std::result::Result<(), String> {
        let t = self.model_type();
        if !FAMILY.contains(&t) {
            return Err(format!("model_type \"{t}\" is not a Llama-style model ({})", FAMILY.join(", ")));
        }
        if self.other.get("use_bidirectional_attention").and_then(serde_json::Value::as_bool).unwrap_or(false) {
            return Err("use_bidirectional_attention = true is not supported (causal attention only)".into());
        }
        if t != "llama" && t != "gemma" {
            for k in ["attention_bias", "mlp_bias"] {
                if self.other.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false) {
                    return Err(format!("{k} = true is not an option of {t}"));
                }
            }
        }
        self.inv_freq()?;
        if t == "gemma3_text" {
            self.rope_of("full_attention")?;
            self.rope_of("sliding_attention")?;
        }
        self.layer_windows()?;
        self.check_experts()?;
        for k in ["query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"] {
            self.positive(k)?;
        }
        if !["silu", "gelu_pytorch_tanh", "gelu_new", "gelu"].contains(&self.activation()) {
            return Err(format!("unsupported hidden_act \"{}\" (silu, gelu_pytorch_tanh, gelu)", self.activation()));
        }
        if !self.rotary_dim().is_multiple_of(2) || self.rotary_dim() == 0 {
            return Err(format!("rotary dimension {} (head_dim x partial_rotary_factor) is not a positive even number", self.rotary_dim()));
        }
        let (h, kv) = (self.num_attention_heads, self.kv_heads());
        if h == 0 || kv == 0 || !h.is_multiple_of(kv) {
            return Err(format!("num_attention_heads {h} is not a multiple of num_key_value_heads {kv}"));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!("head_dim {} is odd (rotary embeddings rotate pairs)", self.head_dim()));
        }
        Ok(())
    }

    /// `llama`, `mistral`, `qwen2`, `gemma` or `phi3` (`config.json`'s `model_type`; `llama`
    /// when absent).
    pub fn model_type(&self) -> &str {
        self.other.get("model_type").and_then(|v| v.as_str()).unwrap_or("llama")
    }

    /// Which projections carry a bias: (q, k and v; o; the MLP's). Llama: `attention_bias` (all
    /// four attention projections) and `mlp_bias`; Qwen2: q, k and v; Mistral: none.
    pub fn biases(&self) -> (bool, bool, bool) {
        let flag = |k: &str| self.other.get(k).and_then(serde_json::Value::as_bool).unwrap_or(false);
        match self.model_type() {
            "qwen2" => (true, false, false),
            "qwen2_moe" => (self.other.get("qkv_bias").and_then(serde_json::Value::as_bool).unwrap_or(true), false, false),
            // DeepSeek: attention_bias on q_a_proj, kv_a_proj_with_mqa and o_proj.
            "deepseek_v2" | "deepseek_v3" => (flag("attention_bias"), flag("attention_bias"), flag("mlp_bias")),
            "mistral" | "mixtral" | "phi3" => (false, false, false),
            "gemma" | "gemma2" | "gemma3_text" => (flag("attention_bias"), flag("attention_bias"), false),
            _ => (flag("attention_bias"), flag("attention_bias"), flag("mlp_bias")),
        }
    }

    /// The MLP's activation: `hidden_act` (Gemma's older configs: `hidden_activation`).
    pub fn activation(&self) -> &str {
        self.other.get("hidden_activation").and_then(|v| v.as_str()).or(self.hidden_act.as_deref()).unwrap_or("silu")
    }

    /// Phi-3 keeps q, k and v in one projection (`qkv_proj`) and gate and up in another
    /// (`gate_up_proj`).
    pub fn fused(&self) -> bool {
        self.model_type() == "phi3"
    }

    /// Gemma (and Gemma 2) scales its RMS norms by `1 + weight` and its embeddings by
    /// sqrt(hidden_size).
    fn gemma(&self) -> bool {
        matches!(self.model_type(), "gemma" | "gemma2" | "gemma3_text")
    }

    /// Qwen3 normalises every query and key head (`q_norm`, `k_norm`) before the rotary
    /// embedding.
    fn head_norms(&self) -> bool {
        matches!(self.model_type(), "qwen3" | "qwen3_moe" | "gemma3_text")
    }

    /// Gemma 2 normalises the attention's and the MLP's outputs too (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`; the MLP's input by `pre_feedforward_layernorm`).
    fn sandwich(&self) -> bool {
        matches!(self.model_type(), "gemma2" | "gemma3_text")
    }

    /// A positive number in `key`, or `None` when the file has none (or null).
    fn positive(&self, key: &str) -> std::result::Result<Option<f64>, String> {
        match self.other.get(key).filter(|v| !v.is_null()) {
            None => Ok(None),
            Some(v) => v.as_f64().filter(|x| x.is_finite() && *x > 0.0).map(Some).ok_or(format!("{key} {v} is not a positive number")),
        }
    }

    /// What attention scores are multiplied by: 1 / sqrt(`query_pre_attn_scalar`) (Gemma 2),
    /// else 1 / sqrt(head_dim).
    pub fn attention_scale(&self) -> f64 {
        if let Some(m) = self.mla() {
            // DeepSeek: 1 / sqrt(the query/key head), times YaRN's mscale(factor, mscale_all_dim)^2.
            let params = ["rope_parameters", "rope_scaling"].iter().find_map(|k| self.other.get(*k).filter(|v| v.is_object()));
            let field = |k: &str| params.and_then(|p| p.get(k)).and_then(serde_json::Value::as_f64);
            let kind = params.and_then(|p| p.get("rope_type").or(p.get("type"))).and_then(|t| t.as_str()).unwrap_or("default");
            let m_all = match (kind, field("mscale_all_dim"), field("factor")) {
                ("default", _, _) => 1.0,
                (_, Some(all), Some(f)) if all != 0.0 && f > 1.0 => 0.1 * all * f.ln() + 1.0,
                _ => 1.0,
            };
            return m_all * m_all / ((m.nope + m.rope) as f64).sqrt();
        }
        let s = self.positive("query_pre_attn_scalar").ok().flatten().unwrap_or(self.head_dim() as f64);
        1.0 / s.sqrt()
    }

    /// DeepSeek's multi-head latent attention (`deepseek_v2`, `deepseek_v3`): its ranks and
    /// head widths.
    pub fn mla(&self) -> Option<MlaDims> {
        if !self.deepseek() {
            return None;
        }
        let count = |k: &str, default: usize| self.other.get(k).and_then(serde_json::Value::as_u64).map_or(default, |v| v as usize);
        Some(MlaDims {
            q_rank: self.other.get("q_lora_rank").and_then(serde_json::Value::as_u64).map(|v| v as usize),
            kv_rank: count("kv_lora_rank", 512),
            nope: count("qk_nope_head_dim", 128),
            rope: count("qk_rope_head_dim", 64),
            v: count("v_head_dim", 128),
            // V2 rotates interleaved pairs; V3 as `rope_interleave` says (its default).
            interleaved: self.model_type() == "deepseek_v2" || self.other.get("rope_interleave").and_then(|v| v.as_bool()).unwrap_or(true),
        })
    }

    /// DeepSeek-V2 or V3.
    fn deepseek(&self) -> bool {
        matches!(self.model_type(), "deepseek_v2" | "deepseek_v3")
    }

    /// Gemma 2's soft caps: attention scores and logits become `cap x tanh(x / cap)`.
    pub fn softcaps(&self) -> (Option<f64>, Option<f64>) {
        (self.positive("attn_logit_softcapping").ok().flatten(), self.positive("final_logit_softcapping").ok().flatten())
    }

    /// Dimensions of a head that rotate: `head_dim x partial_rotary_factor` (Phi-3's
    /// `rope_parameters` may set it; the rest pass through unrotated).
    pub fn rotary_dim(&self) -> usize {
        let params = ["rope_parameters", "rope_scaling"].iter().find_map(|k| self.other.get(*k).filter(|v| v.is_object()));
        let factor = params
            .and_then(|p| p.get("partial_rotary_factor"))
            .or(self.other.get("partial_rotary_factor"))
            .and_then(serde_json::Value::as_f64)
            .unwrap_or(1.0);
        (self.head_dim() as f64 * factor) as usize
    }

    /// Each layer's attention window (`None`: every earlier token): query i sees keys
    /// `i - window + 1 ..= i`, as `transformers`' sliding-window mask. From `layer_types` when the
    /// file has it (`full_attention` / `sliding_attention`), else Mistral's `sliding_window` on
    /// every layer, Qwen2's on the layers from `max_window_layers` when `use_sliding_window`.
    pub fn layer_windows(&self) -> std::result::Result<Vec<Option<usize>>, String> {
        let get = |k: &str| self.other.get(k).filter(|v| !v.is_null());
        let window = match get("sliding_window") {
            None => None,
            Some(w) => Some(w.as_u64().filter(|w| *w > 0).ok_or(format!("sliding_window {w} is not a positive integer"))? as usize),
        };
        let n = self.num_hidden_layers;
        if let Some(types) = get("layer_types") {
            let types = types.as_array().filter(|t| t.len() == n).ok_or(format!("layer_types is not a list of {n} layer types"))?;
            return types
                .iter()
                .map(|t| match (t.as_str(), window) {
                    (Some("full_attention"), _) => Ok(None),
                    (Some("sliding_attention"), Some(w)) => Ok(Some(w)),
                    (Some("sliding_attention"), None) => Err("layer_types has sliding_attention without a sliding_window".to_string()),
                    _ => Err(format!("unsupported layer type {t} (full_attention, sliding_attention)")),
                })
                .collect();
        }
        Ok(match self.model_type() {
            "mistral" | "mixtral" | "phi3" => vec![window; n],
            // Gemma 3's older files: every `sliding_window_pattern`-th layer full, the others windowed.
            "gemma3_text" => {
                let every = get("sliding_window_pattern").and_then(|v| v.as_u64()).unwrap_or(6).max(1) as usize;
                (0..n).map(|i| if (i + 1) % every == 0 { None } else { window }).collect()
            }
            // transformers 5 writes Qwen2-MoE's layer_types (its own rule: the even layers below
            // max_window_layers); a file without them is refused rather than guessed.
            "qwen2_moe" if get("use_sliding_window").and_then(|v| v.as_bool()).unwrap_or(false) => {
                return Err(
                    "use_sliding_window without layer_types: say which layers are windowed (layer_types, as transformers 5 writes it)"
                        .into(),
                )
            }
            "qwen2" | "qwen3" | "qwen3_moe" if get("use_sliding_window").and_then(|v| v.as_bool()).unwrap_or(false) => {
                let from = get("max_window_layers").and_then(|v| v.as_u64()).unwrap_or(n as u64) as usize;
                (0..n).map(|i| if i >= from { window } else { None }).collect()
            }
            _ => vec![None; n],
        })
    }

    /// The rotary embedding's inverse frequencies for sequences within the original context
    /// ([`LlamaConfig::rope`]'s `inv_freq`).
    pub fn inv_freq(&self) -> std::result::Result<Vec<f64>, String> {
        Ok(self.rope()?.inv_freq)
    }

    /// The rotary embedding as `rope_type` says (read from `rope_parameters`, transformers 5, or
    /// `rope_scaling`, 4): `default` (`theta^(-2i/d)`), `linear` (divided by `factor`), `llama3`
    /// (Llama 3.1's wavelength-dependent scaling), `yarn` (YaRN: between the interpolated and
    /// the extrapolated frequencies by a ramp over the dimensions, cos and sin times an
    /// attention factor), `longrope` (LongRoPE, Phi-3 128k: a factor per frequency, the long set
    /// for sequences beyond `original_max_position_embeddings`, and an attention factor) and
    /// `dynamic` (NTK scaling that changes only beyond the original context: refused there).
    /// Other rope types are refused by name.
    pub fn rope(&self) -> std::result::Result<Rope, String> {
        let params = ["rope_parameters", "rope_scaling"].iter().find_map(|k| self.other.get(*k).filter(|v| v.is_object()));
        self.rope_with(params.and_then(|p| p.as_object()), self.rope_theta())
    }

    /// The rotary embedding of the layers of `layer_type` (`full_attention`,
    /// `sliding_attention`): Gemma 3 gives each its own (`rope_parameters` keyed by layer type;
    /// older files: `rope_local_base_freq` on the sliding layers, `rope_theta` and `rope_scaling`
    /// on the full ones); the others one for all ([`LlamaConfig::rope`]).
    pub fn rope_of(&self, layer_type: &str) -> std::result::Result<Rope, String> {
        if self.model_type() != "gemma3_text" {
            return self.rope();
        }
        let nested = self.other.get("rope_parameters").and_then(|p| p.get(layer_type)).and_then(|p| p.as_object());
        let theta_of = |p: Option<&serde_json::Map<String, serde_json::Value>>, default: f64| {
            p.and_then(|p| p.get("rope_theta")).and_then(serde_json::Value::as_f64).unwrap_or(default)
        };
        match (nested, layer_type) {
            (Some(p), "sliding_attention") => self.rope_with(Some(p), theta_of(Some(p), 10_000.0)),
            (Some(p), _) => self.rope_with(Some(p), theta_of(Some(p), 1_000_000.0)),
            (None, "sliding_attention") => {
                let local = self.other.get("rope_local_base_freq").and_then(serde_json::Value::as_f64).unwrap_or(10_000.0);
                self.rope_with(None, local)
            }
            (None, _) => {
                let scaling = self.other.get("rope_scaling").and_then(|p| p.as_object());
                let theta = self.other.get("rope_theta").and_then(serde_json::Value::as_f64).unwrap_or(1_000_000.0);
                self.rope_with(scaling, theta)
            }
        }
    }

    /// [`LlamaConfig::rope`] for the rope parameters `params` and the base `theta`.
    fn rope_with(&self, params: Option<&serde_json::Map<String, serde_json::Value>>, theta: f64) -> std::result::Result<Rope, String> {
        let field = |k: &str| params.and_then(|p| p.get(k)).and_then(serde_json::Value::as_f64);
        let need = |k: &str| field(k).ok_or(format!("rope parameter {k} missing"));
        let kind = params.and_then(|p| p.get("rope_type").or(p.get("type"))).and_then(|t| t.as_str()).unwrap_or("default");
        let dim = self.rotary_dim() as f64;
        let pos: Vec<f64> = (0..self.rotary_dim() / 2).map(|i| theta.powf(2.0 * i as f64 / dim)).collect();
        let base: Vec<f64> = pos.iter().map(|p| 1.0 / p).collect();
        let plain = |inv_freq| Ok(Rope { inv_freq, attention: 1.0, long: None, within: None });
        // The original context: the rope parameters', else the config's top-level field (Phi-3).
        let original = || {
            field("original_max_position_embeddings")
                .or(self.other.get("original_max_position_embeddings").and_then(serde_json::Value::as_f64))
                .ok_or("rope parameter original_max_position_embeddings missing".to_string())
        };
        match kind {
            "default" => plain(base),
            "linear" => {
                let f = need("factor")?;
                plain(base.iter().map(|x| x / f).collect())
            }
            "dynamic" => Ok(Rope { inv_freq: base, attention: 1.0, long: None, within: Some(original()? as usize) }),
            "llama3" => {
                let (f, lo, hi) = (need("factor")?, need("low_freq_factor")?, need("high_freq_factor")?);
                let old = need("original_max_position_embeddings")?;
                let (lo_wave, hi_wave) = (old / lo, old / hi);
                plain(
                    base.iter()
                        .map(|&x| {
                            let wave = 2.0 * std::f64::consts::PI / x;
                            if wave < hi_wave {
                                x
                            } else if wave > lo_wave {
                                x / f
                            } else {
                                let smooth = (old / wave - lo) / (hi - lo);
                                (1.0 - smooth) * x / f + smooth * x
                            }
                        })
                        .collect(),
                )
            }
            "yarn" => {
                let old = original()?;
                let f = field("factor").unwrap_or(self.max_position_embeddings as f64 / old);
                let mscale = |s: f64, m: f64| if s <= 1.0 { 1.0 } else { 0.1 * m * s.ln() + 1.0 };
                let attention = match (field("attention_factor"), field("mscale"), field("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(f, m) / mscale(f, all),
                    _ => mscale(f, 1.0),
                };
                let (fast, slow) = (field("beta_fast").unwrap_or(32.0), field("beta_slow").unwrap_or(1.0));
                let truncate = params.and_then(|p| p.get("truncate")).and_then(serde_json::Value::as_bool).unwrap_or(true);
                let at = |rotations: f64| dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
                let (mut low, mut high) = (at(fast), at(slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001;
                }
                let inv_freq = pos
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let extrapolate = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        (1.0 / (f * p)) * (1.0 - extrapolate) + (1.0 / p) * extrapolate
                    })
                    .collect();
                Ok(Rope { inv_freq, attention, long: None, within: None })
            }
            "longrope" => {
                let old = original()?;
                let factors = |k: &str| -> std::result::Result<Vec<f64>, String> {
                    let v: Vec<f64> = params
                        .and_then(|p| p.get(k))
                        .and_then(|v| v.as_array())
                        .ok_or(format!("rope parameter {k} missing"))?
                        .iter()
                        .filter_map(serde_json::Value::as_f64)
                        .collect();
                    if v.len() != pos.len() {
                        return Err(format!("rope parameter {k} has {} factors, the rotary embedding {} frequencies", v.len(), pos.len()));
                    }
                    Ok(pos.iter().zip(v).map(|(p, f)| 1.0 / (f * p)).collect())
                };
                let f = field("factor").unwrap_or(self.max_position_embeddings as f64 / old);
                let attention = field("attention_factor").unwrap_or(if f <= 1.0 { 1.0 } else { (1.0 + f.ln() / old.ln()).sqrt() });
                Ok(Rope {
                    inv_freq: factors("short_factor")?,
                    attention,
                    long: Some((old as usize, factors("long_factor")?)),
                    within: None,
                })
            }
            t => Err(format!("unsupported rope_type \"{t}\" (default, linear, llama3, yarn, longrope, dynamic)")),
        }
    }

    /// `config.json` keys this implementation neither reads nor knows to leave the arithmetic
    /// unchanged (dropout among the latter: Kolo trains without it), for the load report.
    pub fn unknown_keys(&self) -> Vec<String> {
        const READ: &[&str] = &[
            "model_type",
            "rope_parameters",
            "rope_scaling",
            "rope_theta",
            "attention_bias",
            "mlp_bias",
            "sliding_window",
            "layer_types",
            "use_sliding_window",
            "max_window_layers",
            "hidden_activation",
            "partial_rotary_factor",
            "use_bidirectional_attention",
            "embd_pdrop",
            "resid_pdrop",
            "original_max_position_embeddings",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "rope_local_base_freq",
            "sliding_window_pattern",
            "_sliding_window_pattern",
            "num_local_experts",
            "num_experts",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "qkv_bias",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "qk_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "n_shared_experts",
            "routed_scaling_factor",
            "topk_method",
            "n_group",
            "topk_group",
            "first_k_dense_replace",
            "rope_interleave",
            "num_mtp_layers",
            "num_nextn_predict_layers",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "num_experts_per_tok",
            "router_aux_loss_coef",
            "output_router_logits",
            "router_jitter_noise",
        ];
        self.other.keys().filter(|k| !READ.contains(&k.as_str()) && !super::HARMLESS_KEYS.contains(&k.as_str())).cloned().collect()
    }

    /// The mixture of experts of Mixtral (every block), Qwen2-MoE and Qwen3-MoE (the blocks of
    /// [`LlamaConfig::sparse_layer`]); `None` for the other types: its routing
    /// ([`crate::ep::MoeConfig`]: `num_local_experts` (or `num_experts`), `num_experts_per_tok`,
    /// renormalised top-k weights for Mixtral and by `norm_topk_prob` for the Qwens, dropless)
    /// and the weight of its load-balancing loss (`router_aux_loss_coef` when
    /// `output_router_logits`, as `transformers` adds it to the loss, else 0).
    pub fn experts(&self) -> Option<(crate::ep::MoeConfig, f64)> {
        let get = |k: &str| self.other.get(k).filter(|v| !v.is_null());
        let count = |k: &str| get(k).and_then(serde_json::Value::as_u64).map(|v| v as usize);
        let (experts, top_k, renormalize) = match self.model_type() {
            "mixtral" => (count("num_local_experts").unwrap_or(8), count("num_experts_per_tok").unwrap_or(2), true),
            "qwen2_moe" | "qwen3_moe" => (
                count("num_local_experts").or(count("num_experts")).unwrap_or(if self.model_type() == "qwen2_moe" { 60 } else { 128 }),
                count("num_experts_per_tok").unwrap_or(if self.model_type() == "qwen2_moe" { 4 } else { 8 }),
                get("norm_topk_prob").and_then(serde_json::Value::as_bool).unwrap_or(false),
            ),
            "deepseek_v2" => (
                count("n_routed_experts").unwrap_or(64),
                count("num_experts_per_tok").unwrap_or(6),
                get("norm_topk_prob").and_then(serde_json::Value::as_bool).unwrap_or(false),
            ),
            "deepseek_v3" => (
                count("n_routed_experts").unwrap_or(256),
                count("num_experts_per_tok").unwrap_or(8),
                get("norm_topk_prob").and_then(serde_json::Value::as_bool).unwrap_or(true),
            ),
            _ => return None,
        };
        // DeepSeek-V3: sigmoid scores chosen with a selection bias within the best topk_group of
        // n_group groups.
        // DeepSeek-V2's group_limited_greedy: softmax scores within the best groups.
        let grouped = |groups, top| crate::ep::ExpertGroups {
            groups: count("n_group").unwrap_or(groups),
            top_groups: count("topk_group").unwrap_or(top),
        };
        let (scoring, groups) = match (self.model_type(), get("topk_method").and_then(|m| m.as_str())) {
            ("deepseek_v3", _) => (crate::ep::Scoring::Sigmoid, Some(grouped(8, 4))),
            ("deepseek_v2", Some("group_limited_greedy")) => (crate::ep::Scoring::Softmax, Some(grouped(8, 3))),
            _ => (crate::ep::Scoring::Softmax, None),
        };
        let coef = get("router_aux_loss_coef").and_then(serde_json::Value::as_f64).unwrap_or(0.001);
        // transformers adds no load-balancing loss to DeepSeek-V2's.
        let on = get("output_router_logits").and_then(serde_json::Value::as_bool).unwrap_or(false) && !self.deepseek();
        // A capacity of experts / top_k times the fair share is every token: nothing dropped.
        let capacity_factor = experts as f64 / top_k.max(1) as f64;
        let routing = crate::ep::MoeConfig { experts, top_k, renormalize, capacity_factor, aux_weight: 0.0, scoring, groups };
        Some((routing, if on { coef } else { 0.0 }))
    }

    /// Whether block `i` is a mixture of experts: every block of Mixtral; the Qwens' every
    /// `decoder_sparse_step`-th block but those `mlp_only_layers` lists.
    pub fn sparse_layer(&self, i: usize) -> bool {
        let get = |k: &str| self.other.get(k).filter(|v| !v.is_null());
        match self.model_type() {
            "mixtral" => true,
            "deepseek_v2" | "deepseek_v3" => {
                let dense = get("first_k_dense_replace").and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
                self.experts().is_some_and(|(m, _)| m.experts > 0) && i >= dense
            }
            "qwen2_moe" | "qwen3_moe" => {
                let step = get("decoder_sparse_step").and_then(serde_json::Value::as_u64).unwrap_or(1).max(1) as usize;
                let dense =
                    get("mlp_only_layers").and_then(|v| v.as_array()).is_some_and(|l| l.iter().any(|x| x.as_u64() == Some(i as u64)));
                self.experts().is_some_and(|(m, _)| m.experts > 0) && (i + 1).is_multiple_of(step) && !dense
            }
            _ => false,
        }
    }

    /// The width of an expert's MLP (the Qwens' `moe_intermediate_size`; Mixtral's experts are
    /// `intermediate_size` wide).
    fn expert_width(&self) -> usize {
        match self.model_type() {
            "qwen2_moe" | "qwen3_moe" | "deepseek_v2" | "deepseek_v3" => {
                self.other.get("moe_intermediate_size").and_then(serde_json::Value::as_u64).map_or(self.intermediate_size, |w| w as usize)
            }
            _ => self.intermediate_size,
        }
    }

    /// The shared expert beside the routed ones, every token through it: its width (Qwen2-MoE's
    /// `shared_expert_intermediate_size`; DeepSeek's `n_shared_experts` experts as one MLP of
    /// that many times `moe_intermediate_size`), `None` for none.
    pub fn shared_expert_width(&self) -> Option<usize> {
        let get = |k: &str| self.other.get(k).and_then(serde_json::Value::as_u64).map(|w| w as usize);
        match self.model_type() {
            "qwen2_moe" => Some(get("shared_expert_intermediate_size").unwrap_or(5632)),
            "deepseek_v2" => Some(get("n_shared_experts").unwrap_or(2) * self.expert_width()),
            "deepseek_v3" => Some(get("n_shared_experts").unwrap_or(1) * self.expert_width()),
            _ => None,
        }
        .filter(|w| *w > 0)
    }

    /// Where the shared expert's MLP is (`mlp.shared_expert`, DeepSeek's `mlp.shared_experts`),
    /// and whether a per-token gate weighs it (Qwen2-MoE's `mlp.shared_expert_gate`).
    fn shared_expert_names(&self) -> (&'static str, bool) {
        match self.model_type() {
            "deepseek_v2" | "deepseek_v3" => ("shared_experts", false),
            _ => ("shared_expert", true),
        }
    }

    /// What the routed experts' weighted sum is multiplied by (DeepSeek's
    /// `routed_scaling_factor`; 1 for the others).
    fn routed_scale(&self) -> f64 {
        match self.model_type() {
            "deepseek_v2" => self.other.get("routed_scaling_factor").and_then(serde_json::Value::as_f64).unwrap_or(1.0),
            "deepseek_v3" => self.other.get("routed_scaling_factor").and_then(serde_json::Value::as_f64).unwrap_or(2.5),
            _ => 1.0,
        }
    }

    /// Where a sparse block keeps its mixture of experts, and its experts' projections' names
    /// (gate, up, down): Mixtral's `block_sparse_moe.experts.{j}.w1/w3/w2`, Qwen3-MoE's
    /// `mlp.experts.{j}.gate_proj/up_proj/down_proj`.
    fn expert_names(&self) -> (&'static str, [&'static str; 3]) {
        match self.model_type() {
            "mixtral" => ("block_sparse_moe", ["w1", "w3", "w2"]),
            _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        }
    }

    fn check_experts(&self) -> std::result::Result<(), String> {
        let Some((m, coef)) = self.experts() else { return Ok(()) };
        if m.top_k == 0 || m.top_k > m.experts {
            return Err(format!("num_experts_per_tok {} of {} experts: it must be from 1 to the experts", m.top_k, m.experts));
        }
        if let Some(g) = m.groups {
            m.check().map_err(|e| format!("n_group {} and topk_group {}: {e}", g.groups, g.top_groups))?;
        }
        if !(coef.is_finite() && coef >= 0.0) {
            return Err(format!("router_aux_loss_coef {coef} is not a number >= 0"));
        }
        let methods: &[&str] = if self.model_type() == "deepseek_v3" { &["noaux_tc"] } else { &["greedy", "group_limited_greedy"] };
        if let Some(method) = self.other.get("topk_method").and_then(|v| v.as_str()).filter(|m| !methods.contains(m)) {
            return Err(format!("topk_method \"{method}\" is not {}'s ({})", self.model_type(), methods.join(", ")));
        }
        let jitter = self.other.get("router_jitter_noise").and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        if jitter != 0.0 {
            return Err(format!("router_jitter_noise = {jitter} (random noise on the router's input in training) is not supported"));
        }
        if let Some(l) = self.other.get("mlp_only_layers").filter(|v| !v.is_null()) {
            let ok = l.as_array().is_some_and(|a| a.iter().all(|x| x.as_u64().is_some_and(|i| (i as usize) < self.num_hidden_layers)));
            if !ok {
                return Err(format!("mlp_only_layers {l} is not a list of layers below {}", self.num_hidden_layers));
            }
        }
        Ok(())
    }

    /// Each block's share of a forward pass, for cutting pipeline stages: its multiply-adds per
    /// token (projections and MLP: a mixture of experts' gate and the `top_k` experts a token
    /// runs through), the last block also the output layer's (hidden x vocabulary, as much as
    /// several blocks at a large vocabulary). The embedding's lookup costs next to nothing.
    pub fn block_costs(&self) -> Vec<f64> {
        let (e, hd, inter) = (self.hidden_size as f64, self.head_dim() as f64, self.intermediate_size as f64);
        let (h, kv) = (self.num_attention_heads as f64, self.kv_heads() as f64);
        let sparse = match self.experts() {
            Some((m, _)) => {
                let shared = self.shared_expert_width().map_or(0.0, |w| e + 3.0 * e * w as f64);
                e * m.experts as f64 + m.top_k as f64 * 3.0 * e * self.expert_width() as f64 + shared
            }
            None => 0.0,
        };
        let attention = match self.mla() {
            Some(m) => {
                let (qk, rank) = ((m.nope + m.rope) as f64, m.kv_rank as f64);
                let q = m.q_rank.map_or(e * h * qk, |r| e * r as f64 + r as f64 * h * qk);
                q + e * (rank + m.rope as f64) + rank * h * (m.nope + m.v) as f64 + h * m.v as f64 * e
            }
            None => e * hd * (2.0 * h + 2.0 * kv),
        };
        let mut costs: Vec<f64> =
            (0..self.num_hidden_layers).map(|i| attention + if self.sparse_layer(i) { sparse } else { 3.0 * e * inter }).collect();
        if let Some(last) = costs.last_mut() {
            *last += e * self.vocab_size as f64;
        }
        costs
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Width of a head.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The rotary base: `rope_parameters.rope_theta` (transformers 5), else `rope_theta`, else 10000.
    pub fn rope_theta(&self) -> f64 {
        let get = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_f64);
        get(self.other.get("rope_parameters").and_then(|p| p.get("rope_theta"))).or(get(self.other.get("rope_theta"))).unwrap_or(10_000.0)
    }
}

/// A linear layer of a block: candle-nn's, or one split over a tensor-parallel group.
type Layer = Box<dyn Module + Send + Sync>;

/// DeepSeek's multi-head latent attention's shape ([`LlamaConfig::mla`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    /// The queries' low-rank projection (`q_lora_rank`; `None`: one `q_proj`).
    pub q_rank: Option<usize>,
    /// The keys' and values' shared latent (`kv_lora_rank`).
    pub kv_rank: usize,
    /// Per head: query/key dimensions without the rotary embedding (`qk_nope_head_dim`).
    pub nope: usize,
    /// Per head: query/key dimensions with it (`qk_rope_head_dim`; the key's shared by every head).
    pub rope: usize,
    /// Per head: value dimensions (`v_head_dim`).
    pub v: usize,
    /// Whether the rotated dimensions turn as interleaved pairs (DeepSeek's complex layout), or
    /// as the first half with the second (`rotate_half`).
    pub interleaved: bool,
}

/// A rotary embedding's frequencies ([`LlamaConfig::rope`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// Inverse frequencies, rotary_dim / 2 of them, for sequences within the original context.
    pub inv_freq: Vec<f64>,
    /// What cos and sin are multiplied by (YaRN's and LongRoPE's attention factor; else 1).
    pub attention: f64,
    /// LongRoPE: the original context, and the inverse frequencies for sequences longer than it.
    pub long: Option<(usize, Vec<f64>)>,
    /// Dynamic NTK scaling: the original context, beyond which the frequencies would change
    /// with the sequence's length (refused).
    pub within: Option<usize>,
}

/// A rotary embedding's cos and sin tables (times its attention factor) for every position:
/// LongRoPE's long ones too, and dynamic scaling's limit.
struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    /// LongRoPE: the original context, and the tables for sequences longer than it.
    long: Option<(usize, (Tensor, Tensor))>,
    /// Dynamic NTK scaling: the original context, beyond which it is refused.
    within: Option<usize>,
}

impl RopeTables {
    /// The tables in `dtype` (computed in f64, rounded once, as `transformers` casts its f32
    /// ones to the hidden states' dtype).
    fn new(rope: &Rope, positions: usize, device: &candle_core::Device, dtype: DType) -> candle_core::Result<RopeTables> {
        let half = rope.inv_freq.len();
        let tables = |inv_freq: &[f64]| -> candle_core::Result<(Tensor, Tensor)> {
            let angles: Vec<f64> = (0..positions).flat_map(|p| inv_freq.iter().map(move |f| p as f64 * f)).collect();
            let table = |f: fn(f64) -> f64| {
                let v: Vec<f32> = angles.iter().map(|a| (f(*a) * rope.attention) as f32).collect();
                Tensor::from_vec(v, (positions, half), device)?.to_dtype(dtype)
            };
            Ok((table(f64::cos)?, table(f64::sin)?))
        };
        let (cos, sin) = tables(&rope.inv_freq)?;
        let long = match &rope.long {
            Some((original, inv_freq)) => Some((*original, tables(inv_freq)?)),
            None => None,
        };
        Ok(RopeTables { cos, sin, long, within: rope.within })
    }

    /// cos and sin of positions `from..from + t` of a sequence of `seq` tokens.
    fn cut(&self, seq: usize, from: usize, t: usize) -> candle_core::Result<(Tensor, Tensor)> {
        if let Some(original) = self.within.filter(|o| seq > *o) {
            candle_core::bail!(
                "sequence of {seq} tokens beyond the original context of {original}: dynamic NTK rotary scaling changes its frequencies with the length there (not supported)"
            );
        }
        let (cos, sin) = match &self.long {
            Some((original, long)) if seq > *original => (&long.0, &long.1),
            _ => (&self.cos, &self.sin),
        };
        Ok((cos.narrow(0, from, t)?.contiguous()?, sin.narrow(0, from, t)?.contiguous()?))
    }
}

/// Rotary embeddings (`rotate_half`'s layout) on the first `2 x cos.dim(1)` dimensions of each
/// head of `x` (batch, heads, seq, head_dim); the others pass unchanged.
pub(super) fn rotate(x: Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (hd, r) = (x.dim(3)?, 2 * cos.dim(1)?);
    if r == hd {
        // One pass each way in f32 on the CPU; candle's ops otherwise.
        return kolo_tensor::fused::rope(&x, cos, sin).unwrap_or_else(|| candle_nn::rotary_emb::rope(&x, cos, sin));
    }
    let turned = candle_nn::rotary_emb::rope(&x.narrow(3, 0, r)?.contiguous()?, cos, sin)?;
    Tensor::cat(&[&turned, &x.narrow(3, r, hd - r)?], 3)
}

/// [`crate::sp::ring_attention`] (which scales the scores by 1 / sqrt(head_dim)) with the scores
/// scaled by `scale` instead: the queries multiplied by `scale x sqrt(head_dim)` first (Gemma's
/// `query_pre_attn_scalar`, DeepSeek's mscale).
pub(super) fn ring_attention_scaled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    sp: &crate::sp::SequenceParallel,
) -> candle_core::Result<Tensor> {
    let by = scale * (q.dim(3)? as f64).sqrt();
    let q = if (by - 1.0).abs() > 1e-12 { (q * by)? } else { q.clone() };
    crate::sp::ring_attention(&q, k, v, sp)
}

/// An attention mask: the additive (seq, seq) tensor, and whether it is the plain causal one
/// (`causal_mask(t, None)`), which the fused softmax applies by itself.
#[derive(Clone, Copy)]
pub(super) struct Mask<'a> {
    pub add: &'a Tensor,
    pub causal: bool,
}

/// Scaled dot-product attention of `q` over `k` and `v` (batch, heads, seq, head_dim) with the
/// plain causal `mask` (`causal_mask(t, None)`).
pub(super) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
    attend_scaled(q, k, v, Mask { add: mask, causal: true }, 1.0 / (q.dim(3)? as f64).sqrt(), None)
}

/// [`attend`] with the scores multiplied by `scale` and, with `softcap`, capped as Gemma 2 caps
/// them (`cap x tanh(score / cap)`) before the mask. `k` and `v` may have fewer heads than `q`
/// (grouped-query attention: query head j reads key/value head j / (heads / kv heads)): each
/// key/value head's queries are multiplied as one matrix, with no copies of the keys and values.
pub(super) fn attend_scaled(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Mask<'_>,
    scale: f64,
    softcap: Option<f64>,
) -> candle_core::Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let (kv, tk) = (k.dim(1)?, k.dim(2)?);
    if kv == 0 || !h.is_multiple_of(kv) {
        candle_core::bail!("attention: {h} query heads do not share {kv} key/value heads evenly");
    }
    let g = h / kv;
    let att = q.contiguous()?.reshape((b, kv, g * t, d))?.matmul(&k.t()?)?.reshape((b, h, t, tk))?;
    let probs = if mask.causal && softcap.is_none() && t == tk && att.dtype() == DType::F32 && att.device().is_cpu() {
        // Scale, causal mask and softmax in one pass each way.
        kolo_tensor::fused::causal_softmax(&att, scale)?
    } else {
        let mut att = (att * scale)?;
        if let Some(cap) = softcap {
            att = ((att / cap)?.tanh()? * cap)?;
        }
        super::softmax_f32(&att.broadcast_add(mask.add)?)?
    };
    probs.reshape((b, kv, g * t, tk))?.matmul(v)?.reshape((b, h, t, v.dim(3)?))
}

/// An RMS norm scaling by `weight` (Llama) or `1 + weight` (Gemma).
struct Norm {
    weight: Tensor,
    plus_one: bool,
    eps: f32,
}

impl Norm {
    fn new(n: usize, cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Norm> {
        let plus_one = cfg.gemma();
        let init = candle_nn::Init::Const(if plus_one { 0.0 } else { 1.0 });
        Ok(Norm { weight: vb.get_with_hints(n, "weight", init)?, plus_one, eps: cfg.rms_norm_eps as f32 })
    }
}

impl Norm {
    fn scale(&self) -> candle_core::Result<Tensor> {
        if self.plus_one {
            &self.weight + 1.0
        } else {
            Ok(self.weight.clone())
        }
    }

    /// The norm's output through Megatron's `f` ([`crate::tp::copy_to_group`]) for split layers
    /// that read nothing else: in f32 on the CPU one operation, without `f`'s copy.
    fn forward_copied(&self, x: &Tensor, tp: Option<&crate::tp::TensorParallel>) -> candle_core::Result<Tensor> {
        crate::tp::rms_norm_copied(x, &self.scale()?, self.eps as f64, tp)
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        kolo_tensor::fused::rms_norm(x, &self.scale()?, self.eps as f64)
    }
}

/// The attention's input projections: q, k and v apart, or in one (Phi-3's `qkv_proj`), or
/// DeepSeek's latent attention.
enum Qkv {
    Apart(Layer, Layer, Layer),
    Fused(Layer),
    Mla(Mla),
}

/// DeepSeek's multi-head latent attention's projections: the queries (one `q_proj`, or
/// `q_b_proj(norm(q_a_proj x))`), the keys' and values' latent with the shared rotated key
/// (`kv_a_proj_with_mqa`), its norm, and the latent to every head's key and value (`kv_b_proj`).
/// Over tp the heads split (`q_proj`/`q_b_proj` and `kv_b_proj` column-parallel), the
/// latent's projections and norms whole on every member.
struct Mla {
    dims: MlaDims,
    /// The tensor-parallel group: the shared rotated key feeds this member's heads only, so
    /// its gradient is summed over the group (Megatron's `f`).
    tp: Option<crate::tp::TensorParallel>,
    q: Layer,
    q_a: Option<(Layer, Norm)>,
    kv_a: Layer,
    kv_norm: Norm,
    kv_b: Layer,
}

impl Mla {
    /// Queries, keys (batch, heads, seq, nope + rope) and values (batch, heads, seq, v) of the
    /// normed input `a` (batch, seq, hidden), `h` heads on this rank; the rotated dimensions
    /// turned as interleaved pairs (DeepSeek's complex layout) by `cos`, `sin`.
    fn qkv(&self, a: &Tensor, h: usize, cos: &Tensor, sin: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let (b, t, _) = a.dims3()?;
        let MlaDims { kv_rank, nope, rope, v, .. } = self.dims;
        let q = match &self.q_a {
            Some((q_a, norm)) => self.q.forward(&norm.forward(&q_a.forward(a)?)?)?,
            None => self.q.forward(a)?,
        };
        let q = q.reshape((b, t, h, nope + rope))?.transpose(1, 2)?;
        let turn = |x: &Tensor| match self.dims.interleaved {
            true => candle_nn::rotary_emb::rope_i(x, cos, sin),
            false => candle_nn::rotary_emb::rope(x, cos, sin),
        };
        let q_pe = turn(&q.narrow(3, nope, rope)?.contiguous()?)?;
        let q = Tensor::cat(&[&q.narrow(3, 0, nope)?, &q_pe], 3)?.contiguous()?;
        let latent = self.kv_a.forward(a)?;
        let k_pe = crate::tp::copy_to_group(&latent.narrow(2, kv_rank, rope)?, self.tp.as_ref())?;
        let k_pe = k_pe.reshape((b, 1, t, rope))?.contiguous()?;
        let k_pe = turn(&k_pe)?.expand((b, h, t, rope))?;
        let kv = self.kv_b.forward(&self.kv_norm.forward(&latent.narrow(2, 0, kv_rank)?)?)?;
        let kv = kv.reshape((b, t, h, nope + v))?.transpose(1, 2)?;
        let k = Tensor::cat(&[&kv.narrow(3, 0, nope)?, &k_pe], 3)?.contiguous()?;
        Ok((q, k, kv.narrow(3, nope, v)?.contiguous()?))
    }
}

/// The gated MLP's input projections: gate and up apart, or in one (Phi-3's `gate_up_proj`).
enum GateUp {
    Apart(Layer, Layer),
    Fused(Layer),
}

/// A block's feed-forward part: the gated MLP, or (Mixtral, the Qwens' MoE, DeepSeek) a
/// mixture of gated-MLP experts (their weighted sum times `scale`: DeepSeek's
/// `routed_scaling_factor`), with (Qwen2-MoE, DeepSeek) a shared expert every token runs
/// through, weighted by `sigmoid(gate x)` when it has a gate (Qwen2-MoE).
enum Ffn {
    Dense { gate_up: GateUp, down: Layer },
    Experts { moe: crate::ep::MoeLayer<Expert>, shared: Option<Box<(Expert, Option<Layer>)>>, scale: f64 },
}

/// One expert: `down(act(gate x) * up x)` (Mixtral names them w2, w1, w3); over a
/// tensor-parallel group, gate and up column-parallel and down row-parallel (Megatron's expert
/// tensor parallelism: every member routes the same tokens and computes its share of each
/// expert's width).
struct Expert {
    w1: Layer,
    w3: Layer,
    w2: Layer,
    act: String,
}

impl Module for Expert {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.w2.forward(&gated(self.w1.forward(x)?, self.w3.forward(x)?, &self.act)?)
    }
}

/// The gated MLP's `act(gate) * up` (SwiGLU's product fused on the CPU in f32).
fn gated(gate: Tensor, up: Tensor, act: &str) -> candle_core::Result<Tensor> {
    match act {
        "silu" => kolo_tensor::fused::silu_mul(&gate, &up),
        _ => activate(gate, act)? * up,
    }
}

/// The gated MLP's activation by `hidden_act`'s name.
fn activate(gate: Tensor, act: &str) -> candle_core::Result<Tensor> {
    match act {
        "silu" => gate.silu(),
        "gelu" => gate.gelu_erf(),
        _ => gate.gelu(), // gelu_pytorch_tanh, gelu_new: the tanh approximation
    }
}

/// The load-balancing loss of Mixtral and Qwen3-MoE (`transformers`' `load_balancing_loss_func`), gathered block by
/// block: over every layer's tokens at once, `experts x sum_e (share of the top-k choices that
/// went to e) x (mean gate probability of e)`.
#[derive(Default)]
struct Router {
    /// Per expert: the gate's probabilities summed over every layer's tokens.
    probs: Option<Tensor>,
    /// Per expert: the top-k choices that named it.
    chosen: Vec<f32>,
    /// Tokens routed, over every layer.
    rows: usize,
    /// The layers' own auxiliary terms (zero, carrying the experts no token reached).
    carry: Option<Tensor>,
}

/// A count in a pipeline's router tail: base-256 digits, each exact in bf16 and f16 (activations
/// travel between stages in the model's dtype).
const TAIL_DIGITS: usize = 3;

impl Router {
    /// Floats of a router tail for `e` experts ([`Router::tail`]).
    fn tail_len(e: usize) -> usize {
        e + (e + 1) * TAIL_DIGITS
    }

    /// What the stages after this one need to finish the loss over every layer's tokens, as a
    /// vector that rides after the hidden states a stage hands the next: the probabilities
    /// summed so far (per expert, carrying their gradient back), then the choices per expert
    /// and the tokens routed (constants, as base-256 digits). The carry stays with the stage.
    fn tail(&self, e: usize, dtype: DType, device: &candle_core::Device) -> candle_core::Result<Tensor> {
        let probs = match &self.probs {
            Some(p) => p.to_dtype(dtype)?,
            None => Tensor::zeros(e, dtype, device)?,
        };
        let mut counts = Vec::with_capacity((e + 1) * TAIL_DIGITS);
        let chosen = (0..e).map(|i| self.chosen.get(i).copied().unwrap_or(0.0) as u64);
        for c in chosen.chain([self.rows as u64]) {
            if c >= 1 << (8 * TAIL_DIGITS) {
                candle_core::bail!(
                    "a pipeline stage's router tail holds counts below 2^{}, not {c}: use smaller micro-batches",
                    8 * TAIL_DIGITS
                );
            }
            counts.extend((0..TAIL_DIGITS).map(|d| ((c >> (8 * d)) & 255) as f32));
        }
        let counts = Tensor::from_vec(counts, (e + 1) * TAIL_DIGITS, device)?.to_dtype(dtype)?;
        Tensor::cat(&[&probs, &counts], 0)
    }

    /// The router the stage before this one handed on ([`Router::tail`]).
    fn from_tail(tail: &Tensor, e: usize) -> candle_core::Result<Router> {
        if tail.dims() != [Self::tail_len(e)] {
            candle_core::bail!("a router tail of {:?} floats; {e} experts take {}", tail.dims(), Self::tail_len(e));
        }
        let digits = tail.narrow(0, e, (e + 1) * TAIL_DIGITS)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        let mut counts = digits.chunks(TAIL_DIGITS).map(|d| d.iter().rev().fold(0u64, |n, &x| n * 256 + x as u64));
        let chosen: Vec<f32> = counts.by_ref().take(e).map(|c| c as f32).collect();
        let rows = counts.next().unwrap_or(0) as usize;
        Ok(Router { probs: Some(tail.narrow(0, 0, e)?), chosen, rows, carry: None })
    }

    fn add(&mut self, r: crate::ep::MoeForward) -> candle_core::Result<()> {
        let (n, e) = r.probs.dims2()?;
        let mut chosen = vec![0.0; e];
        for &c in &r.choices {
            chosen[c] += 1.0;
        }
        self.merge(Router { probs: Some(r.probs.sum(0)?), chosen, rows: n, carry: Some(r.aux) })
    }

    /// Adds what another router saw (a checkpointed layer's).
    fn merge(&mut self, other: Router) -> candle_core::Result<()> {
        if let Some(sum) = other.probs {
            self.probs = Some(match self.probs.take() {
                Some(p) => (p.to_dtype(sum.dtype())? + sum)?,
                None => sum,
            });
        }
        if self.chosen.len() < other.chosen.len() {
            self.chosen.resize(other.chosen.len(), 0.0);
        }
        for (c, o) in self.chosen.iter_mut().zip(&other.chosen) {
            *c += o;
        }
        self.rows += other.rows;
        if let Some(aux) = other.carry {
            self.carry = Some(match self.carry.take() {
                Some(c) => (c + aux)?,
                None => aux,
            });
        }
        Ok(())
    }

    /// The weighted loss (`None` without experts). Over a sequence-parallel group `sp` the
    /// tokens are every member's chunks: the choices and token counts are summed over the
    /// group (constants), and each member's term is its own probabilities against those,
    /// times the group's size, so that the members' mean (their gradients are averaged) is the
    /// whole sequence's loss and its gradient.
    fn loss(mut self, coef: f64, sp: Option<&crate::sp::SequenceParallel>) -> candle_core::Result<Option<Tensor>> {
        let (Some(probs), Some(carry)) = (self.probs, self.carry) else { return Ok(None) };
        if coef == 0.0 {
            return Ok(Some(carry));
        }
        let mut rows = self.rows as f64;
        let e = self.chosen.len();
        let mut members = 1.0;
        if let Some(sp) = sp {
            self.chosen.push(self.rows as f32);
            sp.sum(&mut self.chosen)?;
            rows = f64::from(self.chosen.pop().unwrap_or(0.0));
            members = sp.size() as f64;
        }
        if rows == 0.0 {
            return Ok(Some(carry));
        }
        let share = Tensor::from_vec(self.chosen, e, probs.device())?;
        let balance = (probs.mul(&share)?.sum_all()? * (members * coef * e as f64 / (rows * rows)))?;
        Ok(Some((carry + balance)?))
    }
}

/// What a checkpointed layer's closure owns: the layer, the masks, configuration and
/// sequence-parallel group of the model, and its rotary table cut to the sequence.
type CheckpointedLayer = (
    std::sync::Arc<LlamaBlock>,
    std::sync::Arc<(Vec<(Option<usize>, Tensor)>, LlamaConfig, Option<crate::sp::SequenceParallel>)>,
    Tensor,
    Tensor,
);

struct LlamaBlock {
    /// The tensor-parallel group its split layers are split over (`None`: whole).
    tp: Option<crate::tp::TensorParallel>,
    input_norm: Norm,
    qkv: Qkv,
    o: Layer,
    /// The MLP's input norm (Llama's `post_attention_layernorm`, Gemma 2's
    /// `pre_feedforward_layernorm`).
    post_norm: Norm,
    /// Gemma 2: the norms of the attention's and the MLP's outputs.
    out_norms: Option<(Norm, Norm)>,
    /// Qwen3: the norms of every query and key head.
    head_norms: Option<(Norm, Norm)>,
    ffn: Ffn,
    /// Query and key/value heads on this rank (all of them, or this member's share).
    heads: (usize, usize),
    /// The attention window (`None`: every earlier token).
    window: Option<usize>,
    /// Which of the model's rotary tables it uses (Gemma 3: 1 on a sliding layer).
    rope: usize,
}

impl LlamaBlock {
    /// This block's attention mask among the model's (one per window).
    fn mask<'a>(&self, masks: &'a [(Option<usize>, Tensor)]) -> Mask<'a> {
        let add = &masks.iter().find(|(w, _)| *w == self.window).expect("a mask for every window").1;
        Mask { add, causal: self.window.is_none() }
    }

    /// `x` (batch, seq, hidden) through grouped-query attention with rotary embeddings (`cos`,
    /// `sin` cut to the sequence) and the SwiGLU MLP (or its experts, whose routing goes to
    /// `router`), each with its residual.
    fn forward(
        &self,
        x: &Tensor,
        (cos, sin, masks): (&Tensor, &Tensor, &[(Option<usize>, Tensor)]),
        cfg: &LlamaConfig,
        sp: Option<&crate::sp::SequenceParallel>,
        router: &mut Router,
    ) -> candle_core::Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let ((h, kv), hd) = (self.heads, cfg.head_dim());
        let heads = |y: Tensor, n: usize| y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous();
        if let Qkv::Mla(mla) = &self.qkv {
            let a = self.input_norm.forward(x)?;
            let (q, k, v) = mla.qkv(&a, h, cos, sin)?;
            let y = match sp {
                // Ring attention takes one head width: the values padded with zeros to the
                // queries' (their weighted sums padded alike), the padding cut off after.
                Some(sp) => {
                    let (qk, vd) = (q.dim(3)?, v.dim(3)?);
                    let padded = match qk.checked_sub(vd) {
                        Some(0) => v.clone(),
                        Some(more) => Tensor::cat(&[&v, &Tensor::zeros((b, h, t, more), v.dtype(), v.device())?], 3)?,
                        None => {
                            candle_core::bail!("latent attention over sequence-parallel ranks: values of {vd} wider than the queries' {qk}")
                        }
                    };
                    ring_attention_scaled(&q, &k, &padded, cfg.attention_scale(), sp)?.narrow(3, 0, vd)?
                }
                None => attend_scaled(&q, &k, &v, self.mask(masks), cfg.attention_scale(), None)?,
            };
            let y = self.o.forward(&y.transpose(1, 2)?.reshape((b, t, h * mla.dims.v))?)?;
            return self.feed_forward((x + y)?, cfg, router);
        }
        // One `f`, folded into the norm, for the split projections that read the normed input
        // (they are built `input_copied`).
        let a = self.input_norm.forward_copied(x, self.tp.as_ref())?;
        let (q, k, v) = match &self.qkv {
            Qkv::Apart(q, k, v) => (q.forward(&a)?, k.forward(&a)?, v.forward(&a)?),
            Qkv::Fused(l) => {
                let y = l.forward(&a)?;
                (y.narrow(2, 0, h * hd)?, y.narrow(2, h * hd, kv * hd)?, y.narrow(2, (h + kv) * hd, kv * hd)?)
            }
            Qkv::Mla(_) => candle_core::bail!("latent attention runs apart"),
        };
        let (q, k) = (heads(q, h)?, heads(k, kv)?);
        let (q, k) = match &self.head_norms {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let q = rotate(q, cos, sin)?;
        let k = rotate(k, cos, sin)?;
        let v = heads(v, kv)?;
        // Grouped-query attention: query head j reads key/value head j / (h / kv) (the ring
        // takes one key/value head per query head; `attend_scaled` groups the queries).
        let repeat = |x: Tensor| -> candle_core::Result<Tensor> {
            if kv == h {
                return Ok(x);
            }
            x.unsqueeze(2)?.expand((b, kv, h / kv, t, hd))?.reshape((b, h, t, hd))
        };
        let y = match sp {
            // Sequence parallelism: this chunk's queries over every earlier chunk's keys.
            Some(sp) => ring_attention_scaled(&q, &repeat(k)?, &repeat(v)?, cfg.attention_scale(), sp)?,
            None => attend_scaled(&q, &k, &v, self.mask(masks), cfg.attention_scale(), cfg.softcaps().0)?,
        };
        let y = y.transpose(1, 2)?.reshape((b, t, h * hd))?;
        let y = self.o.forward(&y)?;
        let x = match &self.out_norms {
            Some((attn, _)) => (x + attn.forward(&y)?)?,
            None => (x + y)?,
        };
        self.feed_forward(x, cfg, router)
    }

    /// `x` after attention through the MLP (or its experts, whose routing goes to `router`),
    /// with its residual.
    fn feed_forward(&self, x: Tensor, cfg: &LlamaConfig, router: &mut Router) -> candle_core::Result<Tensor> {
        let y = match &self.ffn {
            Ffn::Dense { gate_up, down } => {
                // The split gate and up read only `f`'s output: one `f`, folded into the norm.
                let f = self.post_norm.forward_copied(&x, self.tp.as_ref())?;
                let (gate, up) = match gate_up {
                    GateUp::Apart(g, u) => (g.forward(&f)?, u.forward(&f)?),
                    GateUp::Fused(l) => {
                        let y = l.forward(&f)?;
                        let n = y.dim(2)? / 2;
                        (y.narrow(2, 0, n)?, y.narrow(2, n, n)?)
                    }
                };
                down.forward(&gated(gate, up, cfg.activation())?)?
            }
            Ffn::Experts { moe, shared, scale } => {
                let f = self.post_norm.forward(&x)?;
                let mut r = moe.forward_routed(&f)?;
                let y = std::mem::replace(&mut r.output, Tensor::zeros((), f.dtype(), f.device())?);
                router.add(r)?;
                let y = if *scale != 1.0 { (y * *scale)? } else { y };
                match shared.as_deref() {
                    // Over tp the shared expert is split as a dense MLP (whole output on every
                    // member) and its gate is whole.
                    Some((mlp, Some(gate))) => (y + candle_nn::ops::sigmoid(&gate.forward(&f)?)?.broadcast_mul(&mlp.forward(&f)?)?)?,
                    Some((mlp, None)) => (y + mlp.forward(&f)?)?,
                    None => y,
                }
            }
        };
        match &self.out_norms {
            Some((_, mlp)) => x + mlp.forward(&y)?,
            None => x + y,
        }
    }
}

/// A Llama-style causal language model with Hugging Face's parameter names
/// (`model.layers.0.self_attn.q_proj.weight`, ...).
pub struct Llama {
    cfg: LlamaConfig,
    /// The blocks this rank holds (all of them, or a pipeline stage's).
    layers: std::ops::Range<usize>,
    /// On the first stage.
    embed: Option<LlamaEmbedding>,
    /// (Shared with the closures of checkpointed blocks, which backward runs again.)
    blocks: Vec<std::sync::Arc<LlamaBlock>>,
    /// Whether each block this rank holds is checkpointed ([`Llama::checkpoint_blocks`]).
    checkpointed: Vec<bool>,
    /// On the last stage.
    norm: Option<Norm>,
    lm_head: Option<Layer>,
    /// The tensor-parallel group the model is split over (`None`: whole).
    tp: Option<crate::tp::TensorParallel>,
    /// The sequence-parallel group whose chunks of every sequence this model runs on.
    sp: Option<crate::sp::SequenceParallel>,
    /// Rotary tables: one, or (Gemma 3) one per layer type, full then sliding; each block
    /// names its own.
    ropes: Vec<RopeTables>,
    /// Mixtral, Qwen3-MoE: the experts of every layer this rank holds (all of them without an
    /// expert-parallel group).
    experts_held: Option<std::ops::Range<usize>>,
    /// What loading left unused (empty for a model not loaded from files).
    report: LoadReport,
}

/// How a rank builds its blocks' layers: whole, or split over its tensor-parallel group
/// (column-parallel in, row-parallel out, Megatron's pairs), experts dealt out over `ep`.
struct Parts<'a> {
    cfg: &'a LlamaConfig,
    tp: Option<&'a crate::tp::TensorParallel>,
    ep: Option<&'a crate::ep::ExpertParallel>,
}

impl Parts<'_> {
    /// A whole linear layer (candle-nn's), with or without a bias.
    fn linear(&self, i: usize, o: usize, bias: bool, vb: VarBuilder) -> candle_core::Result<Layer> {
        Ok(match bias {
            true => Box::new(candle_nn::linear(i, o, vb)?),
            false => Box::new(candle_nn::linear_no_bias(i, o, vb)?),
        })
    }

    /// Column-parallel over `tp` (each member a share of the outputs).
    fn col(&self, i: usize, o: usize, bias: bool, vb: VarBuilder) -> candle_core::Result<Layer> {
        self.column(i, o, bias, vb, false)
    }

    /// [`Parts::col`] reading `f`'s output, which the block applies once for the layers that
    /// share an input (q, k and v; gate and up: `LlamaBlock::forward` and `feed_forward`).
    fn col_copied(&self, i: usize, o: usize, bias: bool, vb: VarBuilder) -> candle_core::Result<Layer> {
        self.column(i, o, bias, vb, true)
    }

    fn column(&self, i: usize, o: usize, bias: bool, vb: VarBuilder, copied: bool) -> candle_core::Result<Layer> {
        Ok(match self.tp {
            Some(t) => {
                let l = crate::tp::ColumnParallelLinear::new(i, o, bias, vb, t)?;
                Box::new(if copied { l.input_copied() } else { l })
            }
            None => self.linear(i, o, bias, vb)?,
        })
    }

    /// Row-parallel over `tp` (each member a share of the inputs, the products summed).
    fn row(&self, i: usize, o: usize, bias: bool, vb: VarBuilder) -> candle_core::Result<Layer> {
        Ok(match self.tp {
            Some(t) => Box::new(crate::tp::RowParallelLinear::new(i, o, bias, vb, t)?),
            None => self.linear(i, o, bias, vb)?,
        })
    }

    /// Fused sections (Phi-3's qkv and gate/up): over tp, each member's share of every section,
    /// reading `f`'s output as [`Parts::col_copied`].
    fn fused(&self, sections: &[usize], bias: bool, vb: VarBuilder) -> candle_core::Result<Layer> {
        let e = self.cfg.hidden_size;
        Ok(match self.tp {
            Some(t) => Box::new(crate::tp::ColumnParallelLinear::sections(e, sections, bias, vb, t)?.input_copied()),
            None => self.linear(e, sections.iter().sum(), bias, vb)?,
        })
    }

    /// The attention's input projections under `a` (`self_attn`).
    fn qkv(&self, a: &VarBuilder) -> candle_core::Result<Qkv> {
        let cfg = self.cfg;
        let (e, hd, h, kv) = (cfg.hidden_size, cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let qkv_bias = cfg.biases().0;
        Ok(match (cfg.mla(), cfg.fused()) {
            (Some(m), _) => Qkv::Mla(Mla {
                dims: m,
                tp: self.tp.cloned(),
                q: match m.q_rank {
                    Some(r) => self.col(r, h * (m.nope + m.rope), false, a.pp("q_b_proj"))?,
                    None => self.col(e, h * (m.nope + m.rope), false, a.pp("q_proj"))?,
                },
                q_a: match m.q_rank {
                    Some(r) => Some((self.linear(e, r, qkv_bias, a.pp("q_a_proj"))?, Norm::new(r, cfg, a.pp("q_a_layernorm"))?)),
                    None => None,
                },
                kv_a: self.linear(e, m.kv_rank + m.rope, qkv_bias, a.pp("kv_a_proj_with_mqa"))?,
                kv_norm: Norm::new(m.kv_rank, cfg, a.pp("kv_a_layernorm"))?,
                kv_b: self.col(m.kv_rank, h * (m.nope + m.v), false, a.pp("kv_b_proj"))?,
            }),
            (None, true) => Qkv::Fused(self.fused(&[h * hd, kv * hd, kv * hd], qkv_bias, a.pp("qkv_proj"))?),
            (None, false) => Qkv::Apart(
                self.col_copied(e, h * hd, qkv_bias, a.pp("q_proj"))?,
                self.col_copied(e, kv * hd, qkv_bias, a.pp("k_proj"))?,
                self.col_copied(e, kv * hd, qkv_bias, a.pp("v_proj"))?,
            ),
        })
    }

    /// One gated-MLP expert of `width` under `vb`, by the model's names for its projections.
    fn expert(&self, width: usize, [gate, up, down]: [&str; 3], vb: VarBuilder) -> candle_core::Result<Expert> {
        let e = self.cfg.hidden_size;
        Ok(Expert {
            w1: self.col(e, width, false, vb.pp(gate))?,
            w3: self.col(e, width, false, vb.pp(up))?,
            w2: self.row(width, e, false, vb.pp(down))?,
            act: self.cfg.activation().to_string(),
        })
    }

    /// Block `i`'s feed-forward part under `b` (the block) and `f` (its `mlp`): its experts
    /// (and shared expert) on a sparse layer, else the gated MLP.
    fn ffn(&self, i: usize, b: &VarBuilder, f: &VarBuilder) -> candle_core::Result<Ffn> {
        let cfg = self.cfg;
        let (e, inter, mlp_bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.biases().2);
        Ok(match cfg.experts() {
            Some((routing, _)) if cfg.sparse_layer(i) => {
                let ((block, names), width) = (cfg.expert_names(), cfg.expert_width());
                let (name, gated) = cfg.shared_expert_names();
                let shared = match cfg.shared_expert_width() {
                    Some(w) => Some(Box::new((
                        self.expert(w, names, f.pp(name))?,
                        if gated { Some(self.linear(e, 1, false, f.pp(format!("{name}_gate")))?) } else { None },
                    ))),
                    None => None,
                };
                let moe = crate::ep::MoeLayer::new(e, routing, b.pp(block), self.ep, |vb| self.expert(width, names, vb))?;
                Ffn::Experts { moe, shared, scale: cfg.routed_scale() }
            }
            _ => Ffn::Dense {
                gate_up: match cfg.fused() {
                    true => GateUp::Fused(self.fused(&[inter, inter], mlp_bias, f.pp("gate_up_proj"))?),
                    false => GateUp::Apart(
                        self.col_copied(e, inter, mlp_bias, f.pp("gate_proj"))?,
                        self.col_copied(e, inter, mlp_bias, f.pp("up_proj"))?,
                    ),
                },
                down: self.row(inter, e, mlp_bias, f.pp("down_proj"))?,
            },
        })
    }

    /// Block `i` under `b` (`model.layers.{i}`), attending within `window`.
    fn block(&self, i: usize, b: VarBuilder, window: Option<usize>) -> candle_core::Result<LlamaBlock> {
        let cfg = self.cfg;
        let (e, hd, h, kv) = (cfg.hidden_size, cfg.head_dim(), cfg.num_attention_heads, cfg.kv_heads());
        let p = self.tp.map_or(1, |t| t.size());
        let (a, f) = (b.pp("self_attn"), b.pp("mlp"));
        Ok(LlamaBlock {
            tp: self.tp.cloned(),
            input_norm: Norm::new(e, cfg, b.pp("input_layernorm"))?,
            qkv: self.qkv(&a)?,
            o: self.row(cfg.mla().map_or(h * hd, |m| h * m.v), e, cfg.biases().1, a.pp("o_proj"))?,
            post_norm: Norm::new(e, cfg, b.pp(if cfg.sandwich() { "pre_feedforward_layernorm" } else { "post_attention_layernorm" }))?,
            head_norms: match cfg.head_norms() {
                true => Some((Norm::new(hd, cfg, a.pp("q_norm"))?, Norm::new(hd, cfg, a.pp("k_norm"))?)),
                false => None,
            },
            out_norms: match cfg.sandwich() {
                true => {
                    Some((Norm::new(e, cfg, b.pp("post_attention_layernorm"))?, Norm::new(e, cfg, b.pp("post_feedforward_layernorm"))?))
                }
                false => None,
            },
            ffn: self.ffn(i, &b, &f)?,
            heads: (h / p, kv / p),
            window,
            rope: usize::from(cfg.model_type() == "gemma3_text" && window.is_some()),
        })
    }
}

/// The token embedding: candle-nn's, or split by vocabulary over a tensor-parallel group.
enum LlamaEmbedding {
    Whole(Embedding),
    Split(crate::tp::VocabParallelEmbedding),
}

impl Llama {
    /// Builds the model's variables through `vb`.
    pub fn new(cfg: &LlamaConfig, vb: VarBuilder) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, None, 0..cfg.num_hidden_layers, None)
    }

    /// Builds this rank's part of the model for `mesh`: the blocks of its pipeline stage (cut by
    /// [`LlamaConfig::block_costs`] with `kolo::pp::stage_layers_by`; [`Llama::new_stage`]), split over its `tp` group, running on
    /// its `sp` chunk of every sequence (attention by `kolo::sp::ring_attention`, rotary
    /// positions from the chunk's offset; DeepSeek's values padded to the queries' width), its experts
    /// (Mixtral, the Qwens' MoE, DeepSeek) dealt out over its `ep` group.
    /// Train it with `Trainer::with_mesh`: [`Llama::loss`], or [`Llama::pipeline_stage`] in a
    /// pipeline.
    pub fn new_parallel(cfg: &LlamaConfig, vb: VarBuilder, mesh: &crate::Mesh) -> candle_core::Result<Llama> {
        let layers = crate::pp::stage_layers_by(&cfg.block_costs(), mesh).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if mesh.sp().size() > 1 && cfg.softcaps().0.is_some() {
            candle_core::bail!(
                "soft-capped attention scores over {} sequence-parallel ranks are not supported (ring attention does not cap them)",
                mesh.sp().size()
            );
        }
        if mesh.sp().size() > 1 && cfg.layer_windows().map_err(candle_core::Error::Msg)?.iter().any(Option::is_some) {
            candle_core::bail!(
                "sliding-window attention over {} sequence-parallel ranks is not supported (ring attention sees every earlier chunk)",
                mesh.sp().size()
            );
        }
        let ep = (mesh.size("ep") > 1).then(|| mesh.ep());
        let mut m = Self::build(cfg, vb, Some(mesh.tp()), layers, ep.as_ref())?;
        m.sp = (mesh.sp().size() > 1).then(|| mesh.sp().clone());
        Ok(m)
    }

    /// Builds the model split over the tensor-parallel group `tp` (Megatron-LM's layout): each
    /// member holds its share of the query and key/value heads (q, k and v column-parallel,
    /// the output projection row-parallel), of the MLP (gate and up column-, down
    /// row-parallel) and of the vocabulary (embedding and output layer); the norms are whole.
    /// The heads, key/value heads and MLP width must be multiples of the group's size. Its
    /// variables keep Hugging Face's names; [`load_weights`](super::load_weights) fills each member's pieces from a
    /// checkpoint, and `Mesh::whole_varmap` puts them together for [`save_pretrained`](super::save_pretrained).
    /// Train it with `Trainer::with_mesh`.
    pub fn new_split(cfg: &LlamaConfig, vb: VarBuilder, tp: &crate::tp::TensorParallel) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, Some(tp), 0..cfg.num_hidden_layers, None)
    }

    /// Builds the model with its experts (Mixtral, Qwen3-MoE) dealt out over the expert-parallel group `ep`
    /// (each member holds an equal run of every layer's experts, `experts.{j}` for j in its run;
    /// the rest whole on every member): each member routes its own tokens, which travel to
    /// their experts' member and back ([`crate::ep::MoeLayer`]). [`Llama::new_parallel`] does
    /// the same for a mesh's `ep` axis; train it with `Trainer::with_mesh`.
    pub fn new_experts(cfg: &LlamaConfig, vb: VarBuilder, ep: &crate::ep::ExpertParallel) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, None, 0..cfg.num_hidden_layers, Some(ep))
    }

    /// Builds one pipeline stage of the model (`kolo::pp`): the blocks `layers` (their Hugging
    /// Face names unchanged), the embedding on the first stage and the final norm and output
    /// layer on the last, split over `tp` when given (as [`Llama::new_split`]). Run it with
    /// [`Llama::pipeline_stage`]. An output layer tied to the embedding is a copy of it on the last
    /// stage, kept equal to the first stage's by the trainer (their gradients summed).
    pub fn new_stage(
        cfg: &LlamaConfig,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
    ) -> candle_core::Result<Llama> {
        Self::build(cfg, vb, tp, layers, None)
    }

    fn build(
        cfg: &LlamaConfig,
        vb: VarBuilder,
        tp: Option<&crate::tp::TensorParallel>,
        layers: std::ops::Range<usize>,
        ep: Option<&crate::ep::ExpertParallel>,
    ) -> candle_core::Result<Llama> {
        use crate::tp::ColumnParallelLinear as Col;
        use candle_nn::linear_no_bias as lin;
        let (e, h, kv) = (cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads());
        let tp = tp.filter(|t| t.size() > 1);
        let p = tp.map_or(1, |t| t.size());
        let (inter, n) = (cfg.intermediate_size, cfg.num_hidden_layers);
        if !h.is_multiple_of(p) || !kv.is_multiple_of(p) || !inter.is_multiple_of(p) {
            candle_core::bail!(
                "Llama over {p} tensor-parallel ranks: num_attention_heads {h}, num_key_value_heads {kv} and intermediate_size {inter} must each be a multiple of {p}"
            );
        }
        if layers.start >= layers.end || layers.end > n {
            candle_core::bail!("pipeline stage of layers {layers:?}: the model has {n}");
        }
        let windows = cfg.layer_windows().map_err(candle_core::Error::Msg)?;
        let experts = cfg.experts();
        let mut widths = experts.as_ref().map(|_| cfg.expert_width()).into_iter().chain(cfg.shared_expert_width());
        if let Some(w) = widths.find(|w| !w.is_multiple_of(p)) {
            candle_core::bail!("experts of width {w} over {p} tensor-parallel ranks: the width must be a multiple of {p}");
        }
        let m = vb.pp("model");
        let (first, last) = (layers.start == 0, layers.end == cfg.num_hidden_layers);
        let parts = Parts { cfg, tp, ep };
        let blocks = layers
            .clone()
            .map(|i| Ok(std::sync::Arc::new(parts.block(i, m.pp(format!("layers.{i}")), windows[i])?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let lm_head: Option<Layer> = match (cfg.tie_word_embeddings || !last, tp) {
            (true, _) => None,
            (false, Some(t)) => Some(Box::new(Col::lm_head(e, cfg.vocab_size, vb.pp("lm_head"), t)?)),
            (false, None) => Some(Box::new(lin(e, cfg.vocab_size, vb.pp("lm_head"))?)),
        };
        // A tied output layer is the embedding: the last stage holds a copy of it, which the
        // trainer keeps equal to the first stage's (their gradients summed, Megatron's way).
        let embed = match tp {
            _ if !(first || last && cfg.tie_word_embeddings) => None,
            Some(t) => Some(LlamaEmbedding::Split(crate::tp::VocabParallelEmbedding::new(cfg.vocab_size, e, m.pp("embed_tokens"), t)?)),
            None => Some(LlamaEmbedding::Whole(embedding(cfg.vocab_size, e, m.pp("embed_tokens"))?)),
        };
        let ropes = match cfg.model_type() {
            "gemma3_text" => vec![cfg.rope_of("full_attention"), cfg.rope_of("sliding_attention")],
            _ => vec![cfg.rope()],
        };
        let ropes = ropes
            .into_iter()
            .map(|r| RopeTables::new(&r.map_err(candle_core::Error::Msg)?, cfg.max_position_embeddings, vb.device(), vb.dtype()))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Llama {
            cfg: cfg.clone(),
            layers,
            embed,
            checkpointed: vec![false; blocks.len()],
            blocks,
            norm: if last { Some(Norm::new(e, cfg, m.pp("norm"))?) } else { None },
            lm_head,
            tp: tp.cloned(),
            sp: None,
            ropes,
            experts_held: match (&experts, ep) {
                (None, _) => None,
                (Some((r, _)), Some(g)) => Some(g.experts_of(r.experts, g.rank())?),
                (Some((r, _)), None) => Some(0..r.experts),
            },
            report: LoadReport::default(),
        })
    }

    /// The name prefix of each block this rank holds (`model.layers.{i}.`), in forward order:
    /// the ZeRO-3 groups.
    pub fn block_prefixes(&self) -> Vec<String> {
        self.layers.clone().map(|i| format!("model.layers.{i}.")).collect()
    }

    /// Activation checkpointing (`transformers`' `gradient_checkpointing_enable`, for the
    /// chosen layers): the decoder layers `layers` (0-based over the whole model; a pipeline
    /// stage takes those it holds) keep only their input from forward to backward and run
    /// again there ([`crate::checkpoint`]). Training is unchanged, bitwise; memory falls by a
    /// layer's activations for one more forward of it. Every rank of a tensor- or
    /// sequence- or expert-parallel group must choose the same layers. A layer with experts
    /// hands its gate's probabilities and auxiliary term out of the checkpoint to the
    /// load-balancing loss; its routing is counted once.
    pub fn checkpoint_blocks(&mut self, layers: &[usize]) -> std::result::Result<(), String> {
        self.checkpointed = super::checkpointed(layers, self.layers.clone(), self.cfg.num_hidden_layers)?;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Whether the experts are chosen with a selection bias (DeepSeek-V3's
    /// `e_score_correction_bias`), which [`Llama::update_expert_bias`] moves.
    pub fn has_selection_bias(&self) -> bool {
        self.cfg.experts().is_some_and(|(r, _)| r.scoring == crate::ep::Scoring::Sigmoid)
    }

    /// DeepSeek-V3's balancing without an auxiliary loss ([`crate::ep::ExpertBias::update`]):
    /// collective over the job, every rank calling it after the step's backward passes and
    /// before the update; each MoE layer's selection bias moves by the rate towards the experts
    /// its routing kept fewer than the mean of, over the job's tokens since the last call.
    /// Nothing without a selection bias.
    pub fn update_expert_bias(&self, balance: &crate::ep::ExpertBias, trainer: &mut crate::Trainer) -> Result<()> {
        if !self.has_selection_bias() {
            return Ok(());
        }
        let sparse: Vec<usize> = (0..self.cfg.num_hidden_layers).filter(|&i| self.cfg.sparse_layer(i)).collect();
        let mine: Vec<(usize, &crate::ep::MoeLayer<Expert>)> = self
            .blocks
            .iter()
            .zip(self.layers.clone())
            .filter_map(|(b, i)| match &b.ffn {
                Ffn::Experts { moe, .. } => Some((sparse.iter().position(|&s| s == i)?, moe)),
                Ffn::Dense { .. } => None,
            })
            .collect();
        balance.update(&mine, sparse.len(), trainer)
    }

    /// Forgets the routing counts of the forward passes so far (an evaluation's), so that
    /// [`Llama::update_expert_bias`] counts only the training step's.
    pub fn forget_expert_load(&self) {
        self.take_expert_loads();
    }

    /// Each layer with experts' routing counts (assignments kept per expert) since the last
    /// call, in layer order.
    pub(crate) fn take_expert_loads(&self) -> Vec<Vec<u64>> {
        let moes = self.blocks.iter().filter_map(|b| match &b.ffn {
            Ffn::Experts { moe, .. } => Some(moe),
            Ffn::Dense { .. } => None,
        });
        moes.map(|moe| moe.take_load().load).collect()
    }

    /// What loading the checkpoint left unused (tensors, `config.json` keys).
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Whether the checkpoint tensor `name` belongs to a part of the model another pipeline
    /// stage holds, or is the output layer a tied model leaves out.
    fn elsewhere(&self, name: &str) -> bool {
        let last = self.layers.end == self.cfg.num_hidden_layers;
        if let Some((i, rest)) = name.strip_prefix("model.layers.").and_then(|r| r.split_once('.')) {
            let Ok(i) = i.parse::<usize>() else { return false };
            // Under expert parallelism another rank holds the other experts.
            let experts = format!("{}.experts.", self.cfg.expert_names().0);
            let expert = rest.strip_prefix(experts.as_str()).and_then(|r| r.split('.').next()).and_then(|j| j.parse().ok());
            let other_expert = matches!((expert, &self.experts_held), (Some(j), Some(held)) if !held.contains(&j));
            return !self.layers.contains(&i) || other_expert;
        }
        match name {
            "model.embed_tokens.weight" => self.embed.is_none(),
            "model.norm.weight" => !last,
            "lm_head.weight" => !last || self.cfg.tie_word_embeddings,
            _ => false,
        }
    }

    /// Logits (batch, seq, vocab) for token ids (batch, seq). Split over a tensor-parallel
    /// group, every member gets the whole logits (a collective; not differentiable: train
    /// with [`Llama::loss`], or [`Llama::local_logits`] and `kolo::tp::vocab_parallel_cross_entropy`).
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.local_logits(ids)?;
        match &self.tp {
            Some(t) => crate::tp::gather_vocab(&logits, self.cfg.vocab_size, t),
            None => Ok(logits),
        }
    }

    /// Logits (batch, seq, this rank's vocabulary range: all of it when the model is whole).
    pub fn local_logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        if self.layers != (0..self.cfg.num_hidden_layers) {
            candle_core::bail!("this rank holds the pipeline stage of layers {:?}: run it with Llama::pipeline_stage", self.layers);
        }
        if self.sp.is_some() {
            candle_core::bail!("a sequence-parallel model runs on its chunk of each sequence: train and evaluate with Llama::loss");
        }
        self.head(&self.blocks(&self.embed(ids)?)?)
    }

    /// The first stage's token embedding of `ids` (batch, seq).
    fn embed(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let x = match &self.embed {
            _ if self.layers.start != 0 => candle_core::bail!("the embedding is on the first pipeline stage, not layers {:?}", self.layers),
            Some(LlamaEmbedding::Whole(e)) => e.forward(ids)?,
            Some(LlamaEmbedding::Split(e)) => e.forward(ids)?,
            None => candle_core::bail!("no embedding on the first stage"),
        };
        // Gemma: embeddings times sqrt(hidden_size), rounded to the embedding's dtype first.
        match self.cfg.gemma() {
            true => x * f64::from((self.cfg.hidden_size as f64).sqrt() as f32),
            false => Ok(x),
        }
    }

    /// This rank's blocks on the hidden states `x` (batch, seq or this rank's chunk of it,
    /// hidden).
    fn blocks(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(self.blocks_routed(x)?.0)
    }

    /// [`Llama::blocks`], and the weighted load-balancing loss over them (`None` without
    /// experts): add it to the loss.
    fn blocks_routed(&self, x: &Tensor) -> candle_core::Result<(Tensor, Option<Tensor>)> {
        let mut router = Router::default();
        let y = self.blocks_with(x, &mut router)?;
        Ok((y, router.loss(self.balance_weight(), self.sp.as_ref())?))
    }

    /// The weight of the load-balancing loss (0 without it or without experts).
    fn balance_weight(&self) -> f64 {
        self.cfg.experts().map_or(0.0, |(_, coef)| coef)
    }

    /// Whether the load-balancing loss spans pipeline stages: its counts and probabilities ride
    /// between them after the hidden states ([`Router::tail`]).
    fn balance_across_stages(&self) -> bool {
        self.balance_weight() > 0.0 && self.layers != (0..self.cfg.num_hidden_layers)
    }

    /// The activation this rank's pipeline stage hands the next for a micro-batch of `rows`
    /// sequences (or their sequence-parallel chunks) of `t` tokens: the hidden states (rows, t,
    /// hidden); with a load-balancing loss over stages, flattened and followed by the router's
    /// tail.
    pub fn stage_activation(&self, rows: usize, t: usize) -> Vec<usize> {
        let h = self.cfg.hidden_size;
        match (self.balance_across_stages(), self.cfg.experts()) {
            (true, Some((r, _))) => vec![rows * t * h + Router::tail_len(r.experts)],
            _ => vec![rows, t, h],
        }
    }

    /// [`Llama::blocks`], their routing added to `router`.
    fn blocks_with(&self, x: &Tensor, router: &mut Router) -> candle_core::Result<Tensor> {
        let t = x.dim(1)?;
        // A sequence-parallel chunk's positions start at its offset.
        let from = self.sp.as_ref().map_or(0, |sp| sp.rank() * t);
        if from + t > self.cfg.max_position_embeddings {
            candle_core::bail!(
                "sequence of {} tokens is longer than max_position_embeddings {}",
                from + t,
                self.cfg.max_position_embeddings
            );
        }
        // The whole sequence's length (every chunk's, under sequence parallelism).
        let seq = self.sp.as_ref().map_or(t, |sp| sp.size() * t);
        let tables = self.ropes.iter().map(|r| r.cut(seq, from, t)).collect::<candle_core::Result<Vec<_>>>()?;
        // Causal masks, one per attention window the blocks use: query i sees key j <= i, and
        // with a window w only j > i - w.
        let mut masks: Vec<(Option<usize>, Tensor)> = Vec::new();
        for w in self.blocks.iter().map(|b| b.window) {
            if masks.iter().all(|(have, _)| *have != w) {
                masks.push((w, super::causal_mask(t, w, x.device(), x.dtype())?));
            }
        }
        let mut x = x.clone();
        // What a checkpointed block's closure owns (it runs again in backward).
        let shared = self.checkpointed.contains(&true).then(|| std::sync::Arc::new((masks.clone(), self.cfg.clone(), self.sp.clone())));
        for (blk, ckpt) in self.blocks.iter().zip(&self.checkpointed) {
            let (cos, sin) = &tables[blk.rope];
            x = match (ckpt, &shared) {
                (true, Some(shared)) => {
                    let (blk, shared, cos, sin) = (blk.clone(), shared.clone(), cos.clone(), sin.clone());
                    if !matches!(blk.ffn, Ffn::Experts { .. }) {
                        crate::checkpoint(&x, move |x| {
                            let (masks, cfg, sp) = &*shared;
                            // (A dense layer: nothing reaches the router.)
                            blk.forward(x, (&cos, &sin, masks), cfg, sp.as_ref(), &mut Router::default())
                        })?
                    } else {
                        self.checkpointed_experts(&x, (blk, shared, cos, sin), router)?
                    }
                }
                _ => blk.forward(&x, (cos, sin, &masks), &self.cfg, self.sp.as_ref(), router)?,
            };
        }
        Ok(x)
    }

    /// A checkpointed layer with experts on `x`: its output, the gate's probabilities summed
    /// over its tokens and its auxiliary term come out of the checkpoint ([`crate::checkpoint_many`])
    /// into `router` with the routing's counts, which the first run records (backward's run
    /// must choose the same experts, and counts nothing in the layer's load).
    fn checkpointed_experts(
        &self,
        x: &Tensor,
        (blk, shared, cos, sin): CheckpointedLayer,
        router: &mut Router,
    ) -> candle_core::Result<Tensor> {
        // The first run's choices per expert and tokens routed.
        type Counts = Option<(Vec<f32>, usize)>;
        let counts: std::sync::Arc<std::sync::Mutex<Counts>> = Default::default();
        let seen = counts.clone();
        let outs = crate::checkpoint_many(x, move |x| {
            let (masks, cfg, sp) = &*shared;
            let mut r = Router::default();
            let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
            let y = match (&*seen, &blk.ffn) {
                (Some(_), Ffn::Experts { moe, .. }) => moe.unrecorded(|| blk.forward(x, (&cos, &sin, masks), cfg, sp.as_ref(), &mut r))?,
                _ => blk.forward(x, (&cos, &sin, masks), cfg, sp.as_ref(), &mut r)?,
            };
            match &*seen {
                Some(first) if *first != (r.chosen.clone(), r.rows) => {
                    candle_core::bail!("a checkpointed layer with experts routed its tokens differently when run again in backward")
                }
                Some(_) => {}
                None => *seen = Some((r.chosen.clone(), r.rows)),
            }
            let (Some(probs), Some(carry)) = (r.probs, r.carry) else { candle_core::bail!("a layer with experts routed nothing") };
            Ok(vec![y, probs, carry])
        })?;
        let (chosen, rows) = counts.lock().unwrap_or_else(|p| p.into_inner()).clone().unwrap_or_default();
        let [y, probs, carry]: [Tensor; 3] =
            outs.try_into().map_err(|_| candle_core::Error::Msg("a checkpointed layer of 3 outputs".into()))?;
        router.merge(Router { probs: Some(probs), chosen, rows, carry: Some(carry) })?;
        Ok(y)
    }

    /// The last stage's final norm and output layer: logits of this rank's vocabulary range.
    fn head(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let Some(norm) = &self.norm else {
            candle_core::bail!("the output layer is on the last pipeline stage, not layers {:?}", self.layers);
        };
        let x = norm.forward(x)?;
        let logits = match (&self.lm_head, &self.embed) {
            (Some(l), _) => l.forward(&x)?,
            (None, Some(LlamaEmbedding::Whole(e))) => x.broadcast_matmul(&e.embeddings().t()?)?,
            (None, Some(LlamaEmbedding::Split(e))) => e.tied_logits(&x)?,
            (None, None) => candle_core::bail!("a tied output layer without its embedding"),
        };
        // Gemma 2 caps the logits (element by element: a vocabulary-parallel piece alike).
        match self.cfg.softcaps().1 {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }

    /// This rank's pipeline stage (`kolo::pp::Pipeline::step`'s closure) on the micro-batch
    /// `windows` (batch, seq + 1) of token ids: the first stage embeds `windows[:, ..seq]`, the
    /// others take the previous stage's hidden states `input` (batch, seq, hidden); the last
    /// stage returns the mean next-token cross-entropy against `windows[:, 1..]`
    /// (vocabulary-parallel when split), the others their hidden states. With a load-balancing
    /// loss the stages pass [`Llama::stage_activation`]'s flat vector instead: the hidden
    /// states, then the routing so far, so that the last stage's loss is one process's.
    pub fn pipeline_stage(&self, input: Option<&Tensor>, windows: &Tensor) -> candle_core::Result<Tensor> {
        // Sequence parallelism: this rank's chunk of the inputs and of the targets.
        let chunk = |x: Tensor| match &self.sp {
            Some(sp) => sp.chunk(&x, 1),
            None => Ok(x),
        };
        let head = |x: &Tensor| self.head(x);
        // The load-balancing loss joins the loss. It counts every layer's tokens at once, so
        // over pipeline stages each stage hands the next its router's tail after the hidden
        // states (the probabilities summed so far, whose gradient the later stages send back,
        // and the counts) and the last stage adds the loss over every layer. A stage's carry
        // (the zero that gives the experts no token reached their zero gradients) joins its
        // output.
        let across = self.balance_across_stages();
        let experts = self.cfg.experts().map_or(0, |(r, _)| r.experts);
        let (input, router) = match input {
            Some(x) if across => {
                let hidden = x.elem_count() - Router::tail_len(experts);
                let h = self.cfg.hidden_size;
                let rows = windows.dim(0)?;
                let hx = x.narrow(0, 0, hidden)?.reshape((rows, hidden / (rows * h), h))?;
                (Some(hx), Router::from_tail(&x.narrow(0, hidden, Router::tail_len(experts))?, experts)?)
            }
            x => (x.cloned(), Router::default()),
        };
        let last = self.norm.is_some();
        let (router, aux) = (std::cell::RefCell::new(router), std::cell::RefCell::new(None));
        let blocks = |x: &Tensor| {
            let mut r = router.borrow_mut();
            let y = self.blocks_with(x, &mut r)?;
            if last || !across {
                *aux.borrow_mut() = std::mem::take(&mut *r).loss(self.balance_weight(), self.sp.as_ref())?;
            } else {
                *aux.borrow_mut() = r.carry.take();
            }
            Ok(y)
        };
        let parts = super::StageParts {
            embed: &|ids| self.embed(ids),
            blocks: &blocks,
            head: self.norm.as_ref().map(|_| &head as super::Part<'_>),
            chunk: &chunk,
            vocab: self.cfg.vocab_size,
            tp: self.tp.as_ref(),
        };
        let out = super::run_stage(parts, input.as_ref(), windows)?;
        let out = match across && !last {
            true => Tensor::cat(&[&out.flatten_all()?, &router.into_inner().tail(experts, out.dtype(), out.device())?], 0)?,
            false => out,
        };
        match aux.into_inner() {
            // In the hidden states' dtype on a mixed-precision stage before the last.
            Some(a) => out.broadcast_add(&a.to_dtype(out.dtype())?),
            None => Ok(out),
        }
    }

    /// Mean next-token cross-entropy of `ids` (batch, seq); split over a tensor-parallel group,
    /// Megatron's vocabulary-parallel cross-entropy (the logits are never gathered); over a
    /// sequence-parallel group, the mean over this rank's chunk.
    pub fn loss(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.pipeline_stage(None, ids)
    }
}

/// Builds a Llama-style model from `dir` (`config.json`, and `model.safetensors` or the shards of
/// `model.safetensors.index.json`) into a new VarMap.
pub fn load_llama(dir: &Path, device: &Device) -> Result<(VarMap, Llama)> {
    load_llama_stage(dir, device, None, None, DType::F32)
}

/// Builds this rank's part of the model in `dir`: split over `tp` when given
/// ([`Llama::new_split`]), or its part for `mesh` ([`Llama::new_parallel`]); each rank reads only
/// its pieces of the checkpoint's tensors.
pub(super) fn load_llama_stage(
    dir: &Path,
    device: &Device,
    tp: Option<&crate::tp::TensorParallel>,
    mesh: Option<&crate::Mesh>,
    dtype: DType,
) -> Result<(VarMap, Llama)> {
    let (cfg, prefix) = LlamaConfig::load_text_model(dir)?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, device);
    let model = match mesh {
        Some(m) => Llama::new_parallel(&cfg, vb, m),
        None => Llama::new_stage(&cfg, vb, tp, 0..cfg.num_hidden_layers),
    }
    .map_err(|e| Error::file(dir.join("config.json"), e))?;
    let mut model = model;
    // A Gemma 3 with a vision tower: its text model is trained and exported alone (as
    // `gemma3_text`); the vision tower and the projector stay in the checkpoint.
    let text_model = |n: &str| n.strip_prefix(prefix).is_none_or(|n| model.elsewhere(n));
    let unused_tensors = Weights::open(dir)?.under(prefix).fill(&varmap, &text_model)?;
    if !prefix.is_empty() {
        let aside = Weights::open(dir)?.names().filter(|n| !n.starts_with(prefix)).count();
        eprintln!("kolo::hf: {}: the text model of a Gemma 3 with a vision tower ({aside} tensors left aside)", dir.display());
    }
    model.report = LoadReport { unused_tensors, unknown_keys: cfg.unknown_keys() };
    Ok((varmap, model))
}
