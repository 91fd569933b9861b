"""Regenerates Kolo's references for the Llama-style architectures beside Llama itself:
test-data/hf/{qwen2,mistral,llama3}-tiny.

    python test-data/hf/make_family_reference.py ARCH [OUT_DIR] [0.5b]
    (ARCH: qwen2, qwen3, mistral, llama3, gemma, gemma2, gemma3, gemma3_mm, phi3, gpt_neox, llama_yarn,
    phi3_longrope, mixtral, qwen3_moe, qwen2_moe, deepseek_v2, deepseek_v2_groups, deepseek_v3)

Each is a tiny model of the architecture, built offline by `transformers` from a fixed seed with
noise (std 0.3) added to every parameter so that every layer matters to the logits, saved with
`save_pretrained`, and its logits on fixed token ids (2 x 16) in reference.safetensors ("ids"
int64, "logits" f32). What each exercises:
  qwen2   Qwen2ForCausalLM: q/k/v biases, tied embeddings, rope_theta 1e6, and a sliding window
          of 6 on the layers from max_window_layers = 1 (layer 0 full, layer 1 windowed);
  mistral MistralForCausalLM: sliding_window 5 on every layer, shorter than the 16 tokens;
  llama3  LlamaForCausalLM with rope_type "llama3" (factor 8, original context 16, so the
          scaling changes every rotary frequency but the highest);
  gemma   GemmaForCausalLM: norms scaled by 1 + weight, embeddings by sqrt(hidden), GeGLU
          (gelu_pytorch_tanh), heads of 16 wider than hidden / heads, tied embeddings;
  qwen3   Qwen3ForCausalLM: an RMS norm on each query and key head before the rotary embedding;
  gemma2  Gemma2ForCausalLM: gemma's features, norms around the attention and the MLP, soft-capped
          attention scores (2) and logits (5), query_pre_attn_scalar 24, a window on layer 0;
  gemma3  Gemma3ForCausalLM (text): head norms, a rotary embedding per layer type (3 layers);
  gemma3_mm Gemma3ForConditionalGeneration: gemma3's text model beside a tiny vision tower
          (the multimodal checkpoints' layout); text-only reference ids;
  phi3    Phi3ForCausalLM: fused qkv_proj and gate_up_proj, a partial rotary embedding (0.5 of
          each head), sliding_window 6;
  mixtral MixtralForCausalLM: 4 SwiGLU experts per layer, top 2, and the load-balancing loss
          (reference.safetensors also holds "loss" and "aux_loss" on ids[:, :-1] -> ids[:, 1:]);
  qwen3_moe Qwen3MoeForCausalLM: 8 experts of width 24 on layers 0 and 2, top 3 not
          renormalised, a dense layer 1 (mlp_only_layers), with "loss" and "aux_loss" as mixtral;
  qwen2_moe Qwen2MoeForCausalLM: q/k/v biases, 8 experts of width 24 (top 3) beside a shared
          expert of 32 gated by a sigmoid per token on layers 0 and 2, a dense layer 1, a
          window of 6 on layers 0 and 2, with "loss" and "aux_loss" as mixtral;
  gpt_neox GPTNeoXForCausalLM: layer norms with biases, query_key_value laid out head by head,
          a quarter of each head of 16 rotated, parallel residual, GELU, an untied embed_out.
With `qwen2 OUT 0.5b` the model has Qwen2.5-0.5B's shape (vocabulary 151936, 24 layers of 896,
14 query heads sharing 2 key/value heads, MLP 4864, tied embeddings, no sliding window: 494M
parameters, 2 GB, not shipped: bench/hf_interop.sh makes it in /tmp), with noise of std 0.02.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import transformers
from reference_common import save_reference

arch = sys.argv[1]
out = sys.argv[2] if len(sys.argv) > 2 else f"test-data/hf/{arch}-tiny"
torch.manual_seed(0)
common = dict(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    pad_token_id=None,
)
noise = 0.3


def moe_loss(model, ids):
    """A mixture of experts' training loss on ids[:, :-1] predicting ids[:, 1:]: cross-entropy
    plus the weighted load-balancing loss ("loss"), and that auxiliary loss alone ("aux_loss")."""
    out = model(ids[:, :-1], output_router_logits=True)
    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
    loss = ce + cfg.router_aux_loss_coef * out.aux_loss
    return {"loss": loss.float().reshape(1), "aux_loss": out.aux_loss.float().reshape(1)}


if arch == "qwen2" and sys.argv[3:] == ["0.5b"]:
    cfg, noise = transformers.Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643, pad_token_id=None), 0.02
    model = transformers.Qwen2ForCausalLM
elif arch == "qwen2":
    cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   use_sliding_window=True, sliding_window=6, max_window_layers=1)
    model = transformers.Qwen2ForCausalLM
elif arch == "mistral":
    cfg = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=5)
    model = transformers.MistralForCausalLM
elif arch == "llama3":
    cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM
elif arch == "gemma":
    cfg = transformers.GemmaConfig(**common | {"head_dim": 16}, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh")
    model = transformers.GemmaForCausalLM
elif arch == "qwen3":
    # Qwen3: an RMS norm on every query and key head (q_norm, k_norm) before the rotary
    # embedding, heads of 16 wider than hidden / heads, no biases, tied embeddings.
    cfg = transformers.Qwen3Config(**common | {"head_dim": 16}, tie_word_embeddings=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    model = transformers.Qwen3ForCausalLM
elif arch == "gemma2":
    # Gemma 2: Gemma's norms and embedding scale, a norm before and after both the attention and
    # the MLP, attention scores soft-capped (2: small, so that it matters here) and scaled by
    # query_pre_attn_scalar 24 (not the head size 16), logits soft-capped at 5, and a window of
    # 6 on the sliding layers (layer 0; layer 1 full).
    cfg = transformers.Gemma2Config(**common | {"head_dim": 16}, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                                    query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                                    sliding_window=6)
    model = transformers.Gemma2ForCausalLM
elif arch == "gemma3":
    # Gemma 3 (text): Gemma 2's norms and scalar, an RMS norm (1 + weight) on each query and key
    # head, no soft caps, and a rotary embedding per layer type: base 10000 on the sliding layers
    # (layers 0 and 2, window 6), base 1e6 with linear scaling by 8 on the full one (layer 1).
    cfg = transformers.Gemma3TextConfig(**common | {"head_dim": 16, "num_hidden_layers": 3}, tie_word_embeddings=True,
                                        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=6,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
    model = transformers.Gemma3ForCausalLM
elif arch == "gemma3_mm":
    # Gemma 3 with a vision tower (Gemma3ForConditionalGeneration, model_type gemma3, as the 4B,
    # 12B and 27B checkpoints are): gemma3's text model under language_model.*, a one-layer
    # SigLIP vision tower and the projector beside it. The reference is text only (ids below the
    # image tokens 93-95).
    text = common | {"head_dim": 16, "num_hidden_layers": 3, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
                     "query_pre_attn_scalar": 24, "sliding_window": 6,
                     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
                                    boi_token_index=93, eoi_token_index=94)
    model = transformers.Gemma3ForConditionalGeneration
    ids_below = 93
elif arch == "phi3":
    cfg = transformers.Phi3Config(**common, tie_word_embeddings=False, sliding_window=6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    model = transformers.Phi3ForCausalLM
elif arch == "llama_yarn":
    # YaRN (Qwen2.5's and DeepSeek's long-context rotary scaling): frequencies between the
    # extrapolated and the interpolated ones by a ramp over the dimensions, cos and sin scaled
    # by the attention factor (0.1 ln 4 + 1).
    cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})
    model = transformers.LlamaForCausalLM
elif arch == "phi3_longrope":
    # LongRoPE (Phi-3 128k): a factor per rotary frequency, the long set for sequences beyond
    # original_max_position_embeddings (8 here, the reference's 16 tokens beyond it), and cos and
    # sin scaled by sqrt(1 + ln(64 / 8) / ln 8).
    half = 48 // 4 // 2 // 2
    cfg = transformers.Phi3Config(**common, tie_word_embeddings=False, original_max_position_embeddings=8, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [1.5 + 2.0 * i for i in range(half)],
        "original_max_position_embeddings": 8})
    model = transformers.Phi3ForCausalLM
elif arch == "mixtral":
    # Mixtral: every MLP a mixture of 4 SwiGLU experts (block_sparse_moe.experts.{j}.w1/w2/w3),
    # each token through its top 2 by the router's softmax, the two weights renormalised; the
    # router's load-balancing loss (over every layer's tokens at once) weighs 0.05 in the loss.
    cfg = transformers.MixtralConfig(**common, tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                     output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0)
    model = transformers.MixtralForCausalLM
    extra = moe_loss
elif arch == "qwen3_moe":
    # Qwen3-MoE: Qwen3's head norms, and on layers 0 and 2 a mixture of 8 SwiGLU experts of width
    # 24 (mlp.experts.{j}.gate_proj/up_proj/down_proj), each token through its top 3 weighted by
    # the router's probabilities as they are (norm_topk_prob false); layer 1 a dense MLP of 80
    # (mlp_only_layers); the load-balancing loss weighs 0.05.
    cfg = transformers.Qwen3MoeConfig(**common | {"head_dim": 16, "num_hidden_layers": 3}, tie_word_embeddings=False,
                                      moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                                      mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.05)
    model = transformers.Qwen3MoeForCausalLM
    extra = moe_loss
elif arch == "qwen2_moe":
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): q/k/v biases, on layers 0 and 2 a mixture of 8
    # SwiGLU experts of width 24 (top 3 not renormalised) beside a shared expert of width 32
    # (mlp.shared_expert.*) weighted per token by sigmoid(mlp.shared_expert_gate x); layer 1 a
    # dense MLP of 80 (mlp_only_layers); a window of 6 on layers 0 and 2 (layer_types, as
    # transformers 5 derives them from max_window_layers); the load-balancing loss weighs 0.05.
    cfg = transformers.Qwen2MoeConfig(**common | {"num_hidden_layers": 3}, tie_word_embeddings=False,
                                      moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
                                      use_sliding_window=True, sliding_window=6, max_window_layers=3,
                                      output_router_logits=True, router_aux_loss_coef=0.05)
    model = transformers.Qwen2MoeForCausalLM
    extra = moe_loss
elif arch in ("deepseek_v2", "deepseek_v2_groups"):
    # DeepSeek-V2 (V2-Lite's layout): multi-head latent attention (queries through a rank-24
    # LoRA q_a_proj / q_a_layernorm / q_b_proj, keys and values through the rank-16 latent of
    # kv_a_proj_with_mqa, its norm and kv_b_proj; heads of 8 unrotated + 4 rotated query/key
    # dimensions and 6 value dimensions; the 4 rotated ones as interleaved pairs, one rotated key
    # shared by every head), YaRN (factor 4 over an original 16, mscale = mscale_all_dim =
    # 0.707: the scores scaled by mscale^2); layer 0 a dense MLP of 80 (first_k_dense_replace),
    # layers 1 and 2 a mixture of 8 experts of width 12 (softmax, top 3 greedy, not
    # renormalised, times routed_scaling_factor 2.5) beside 2 shared experts (one MLP of 24).
    cfg = transformers.DeepseekV2Config(**common | {"num_hidden_layers": 3, "num_key_value_heads": 4}, tie_word_embeddings=False,
                                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                        n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=12,
                                        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False,
                                        # deepseek_v2_groups: the 236B model's routing, each token's
                                        # top 3 within the 2 of 4 groups holding its best experts.
                                        **({"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}
                                           if arch == "deepseek_v2_groups" else {"topk_method": "greedy"}),
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "original_max_position_embeddings": 16, "mscale": 0.707,
                                                         "mscale_all_dim": 0.707})
    model = transformers.DeepseekV2ForCausalLM

    def extra(model, ids):
        """The training loss on ids[:, :-1] -> ids[:, 1:] (transformers adds no balance term)."""
        out = model(ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        return {"loss": ce.float().reshape(1)}
elif arch == "deepseek_v3":
    # DeepSeek-V3 (and Kimi K2's layout): V2's latent attention with queries through one q_proj
    # (no q_lora_rank) and the plain rotary embedding; layer 0 a dense MLP of 80, layers 1 and
    # 2 8 routed experts of width 12 in 4 groups: each token's experts scored by a sigmoid,
    # chosen (top 3) by sigmoid + e_score_correction_bias (set here to N(0, 0.2): a buffer, which
    # the noise does not reach) among its best 2 groups (each scored by its top two), weighted
    # by the sigmoids renormalised (norm_topk_prob) times 2.5, beside one shared expert.
    cfg = transformers.DeepseekV3Config(**common | {"num_hidden_layers": 3, "num_key_value_heads": 4}, tie_word_embeddings=False,
                                        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                                        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
                                        moe_intermediate_size=12, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                        norm_topk_prob=True, rope_interleave=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = transformers.DeepseekV3ForCausalLM

    def post(model):
        g = torch.Generator().manual_seed(3)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(8, generator=g))

    def extra(model, ids):
        """The training loss on ids[:, :-1] -> ids[:, 1:] (transformers adds no balance term)."""
        out = model(ids[:, :-1])
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        return {"loss": ce.float().reshape(1)}
elif arch == "gpt_neox":
    # Heads of 16, so that a quarter of each (4 dimensions) turns whole pairs.
    cfg = transformers.GPTNeoXConfig(**{k: v for k, v in common.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
                                     | {"hidden_size": 64}, tie_word_embeddings=False, use_parallel_residual=True)
    model = transformers.GPTNeoXForCausalLM
else:
    sys.exit(f"unknown architecture {arch} (qwen2, qwen3, mistral, llama3, gemma, gemma2, gemma3, phi3, gpt_neox, llama_yarn, phi3_longrope, mixtral, qwen3_moe, qwen2_moe, deepseek_v2, deepseek_v2_groups, deepseek_v3, gemma3_mm)")
cfg._attn_implementation = "eager"
model = model(cfg).eval()
if "post" in globals():
    with torch.no_grad():
        post(model)
save_reference(model, cfg, out, noise, extra=globals().get("extra"), ids_below=globals().get("ids_below"))
