"""Tiny random-weight folders of model families we have no trained weights for.

Built with mlx-lm's own model classes and saved in the mlx-community layout
(``config.json``, ``model.safetensors``, tokenizer files), so that they load
through ``mlx_lm.load`` exactly as a downloaded model would. They borrow
SmolLM2's tokenizer (vocabulary 49,152) so that text round-trips.

Each family is the smallest that keeps its layer kinds: ``gemma3_text`` with
a 16-token sliding window on every other layer (``RotatingKVCache``),
``qwen3_5`` with gated-delta linear attention on every other layer,
``lfm2`` with short-convolution layers and ``granitemoehybrid`` with Mamba-2
layers and experts (all three ``ArraysCache``). ``olmo_hybrid`` is one that
cannot speculate: its gated delta net's convolution ignores right padding.
"""

import json
from pathlib import Path
from typing import Optional

_COMMON = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 49152, "max_position_embeddings": 4096,
           "tie_word_embeddings": True}

CONFIGS = {
    "gemma3_text": dict(_COMMON, model_type="gemma3_text", intermediate_size=128, head_dim=16,
                        query_pre_attn_scalar=16, sliding_window=16, sliding_window_pattern=2,
                        rope_local_base_freq=10000.0, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3_5": {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(
        _COMMON, model_type="qwen3_5_text", intermediate_size=128, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        rms_norm_eps=1e-6)},
    # qwen3_5 with an MTP layer (mtp.*, zero-centred norms as Hugging Face stores
    # them) and the rope_parameters a Qwen3.5 checkpoint writes.
    "qwen3_5_mtp": {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(
        _COMMON, model_type="qwen3_5_text", intermediate_size=128, head_dim=32,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        rms_norm_eps=1e-6, mtp_num_hidden_layers=1, rope_parameters=dict(
            type="default", mrope_section=[2, 1, 1], rope_theta=10000.0,
            partial_rotary_factor=0.25))},
    # One full-attention layer and an MTP layer that copies it (``build_mtp_copy``).
    "qwen3_5_mtp_copy": {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": dict(
        _COMMON, model_type="qwen3_5_text", num_hidden_layers=1, intermediate_size=128,
        head_dim=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=1,
        rms_norm_eps=1e-6, mtp_num_hidden_layers=1, rope_parameters=dict(
            type="default", mrope_section=[2, 1, 1], rope_theta=10000.0,
            partial_rotary_factor=0.25))},
    # GLM-4.5's layout: MoE decoder layers and one nextn layer (``build_nextn``).
    "glm4_moe_nextn": dict(
        _COMMON, model_type="glm4_moe", num_hidden_layers=1, intermediate_size=128,
        moe_intermediate_size=32, norm_topk_prob=True, n_group=1, topk_group=1, head_dim=16,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
        num_experts_per_tok=2, first_k_dense_replace=0, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling=None, use_qk_norm=True, tie_word_embeddings=False, attention_bias=True,
        partial_rotary_factor=0.5, num_nextn_predict_layers=1),
    # DeepSeek-V3's layout (MLA attention, dense layers, then one MoE nextn
    # layer): 61 layers, as upstream's sanitize drops ``model.layers.61`` by name.
    "deepseek_v3_nextn": dict(
        _COMMON, model_type="deepseek_v3", num_hidden_layers=61, intermediate_size=128,
        moe_intermediate_size=32, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
        num_experts_per_tok=2, first_k_dense_replace=61, rms_norm_eps=1e-6,
        tie_word_embeddings=False, num_nextn_predict_layers=1),
    "lfm2": dict(_COMMON, model_type="lfm2", norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
                 block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, block_ff_dim=128,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "granitemoehybrid": dict(
        _COMMON, model_type="granitemoehybrid", intermediate_size=128, attention_bias=False,
        embedding_multiplier=12.0, attention_multiplier=0.0625, logits_scaling=8.0,
        residual_multiplier=0.22, layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16, mamba_proj_bias=False,
        mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1, mamba_conv_bias=True,
        position_embedding_type="rope"),
    "olmo_hybrid": dict(
        _COMMON, model_type="olmo_hybrid", intermediate_size=128, rms_norm_eps=1e-6,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        attention_bias=False, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    # Families the README lists as speculating (mlx-lm 0.32.2).
    "gemma4_text": dict(
        _COMMON, model_type="gemma4_text", intermediate_size=128, head_dim=16,
        global_head_dim=32, sliding_window=16, sliding_window_pattern=2,
        num_kv_shared_layers=2, hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=49152, rms_norm_eps=1e-6),
    "gpt_oss": dict(
        _COMMON, model_type="gpt_oss", tie_word_embeddings=False, intermediate_size=64,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
        rope_theta=150000, rms_norm_eps=1e-5,
        layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3_next": dict(
        _COMMON, model_type="qwen3_next", intermediate_size=128, head_dim=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.25, full_attention_interval=2),
    "mamba2": dict(
        model_type="mamba2", hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
        intermediate_size=128, state_size=16, n_groups=1, conv_kernel=4, use_bias=False,
        use_conv_bias=True, layer_norm_epsilon=1e-5, time_step_limit=[0.0, 1e4],
        time_step_rank="auto", vocab_size=49152, tie_word_embeddings=True),
    "kimi_linear": dict(
        _COMMON, model_type="kimi_linear", intermediate_size=128, head_dim=16,
        rope_theta=10000.0, rms_norm_eps=1e-6, model_max_length=4096,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                            "head_dim": 16, "short_conv_kernel_size": 4},
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, mla_use_nope=True),
    "recurrent_gemma": dict(
        _COMMON, model_type="recurrent_gemma", num_hidden_layers=3, num_key_value_heads=1,
        intermediate_size=128, attention_bias=False, conv1d_width=4, logits_soft_cap=30.0,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_window_size=16,
        block_types=["recurrent", "recurrent", "attention"]),
    # Families the README lists as served plainly: the start-up check refuses them.
    "nemotron_h": dict(
        _COMMON, model_type="nemotron_h", tie_word_embeddings=False, intermediate_size=128,
        attention_bias=False, mamba_num_heads=8, mamba_head_dim=16, mamba_proj_bias=False,
        ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False,
        layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, head_dim=16,
        hybrid_override_pattern=["M", "-", "*", "-"]),
    "jamba": dict(
        _COMMON, model_type="jamba", intermediate_size=128, attn_layer_offset=1,
        attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4,
        mamba_d_state=16, mamba_expand=2, num_experts=4, num_experts_per_tok=2,
        rms_norm_eps=1e-6),
    "rwkv7": dict(
        model_type="rwkv7", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        head_dim=16, norm_eps=1e-5, a_low_rank_dim=16, v_low_rank_dim=16,
        gate_low_rank_dim=16, decay_low_rank_dim=16, vocab_size=49152,
        tie_word_embeddings=True),
    "falcon_h1": dict(
        _COMMON, model_type="falcon_h1", intermediate_size=128, head_dim=16,
        mamba_d_ssm=128, mamba_d_head=16, mamba_n_heads=8, mamba_d_state=16,
        mamba_d_conv=4, mamba_n_groups=1, mamba_chunk_size=16, num_hidden_layers=2,
        rms_norm_eps=1e-5),
}


def save_model(folder: Path, tokenizer_folder: Path, config: dict, weights: dict) -> Path:
    """A model folder: ``weights``, ``config`` and the tokenizer of ``tokenizer_folder``."""
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_folder / name).read_bytes())
    return folder


def with_vocab(config: dict, vocab: Optional[int]) -> dict:
    """``config`` with the first ``vocab`` tokens of the tokenizer only (None:
    all of them). Distribution tests run on 2,048: on a CPU their cost is the
    vocabulary-wide sampling of every row and draft, and their prompts'
    tokens (common words) are among the first."""
    if vocab is None:
        return config
    if "text_config" in config:
        return {**config, "text_config": {**config["text_config"], "vocab_size": vocab}}
    return {**config, "vocab_size": vocab}


def build(family: str, folder: Path, tokenizer_folder: Path, scale: float = 1.0,
          seed: int = 0, vocab: Optional[int] = None) -> Path:
    """Write a random-weight ``family`` model to ``folder``, every weight but
    the embedding times ``scale``: small layers leave the residual stream near
    the input's embedding, so (tied embeddings) the model repeats itself; at
    a scale in between its output wanders, then loops, and n-gram drafts are
    partly kept, partly refused."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = with_vocab(CONFIGS[family], vocab)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Tied: gemma3_text builds an lm_head and ties it only when the weights lack one.
    params = dict(tree_flatten(model.parameters()))
    weights = {k: v if "embed" in k else scale * v
               for k, v in params.items() if k != "lm_head.weight"}
    if "lm_head.weight" in params and config.get("tie_word_embeddings") is False:
        # A family that always has a head (gpt_oss, nemotron_h): it copies the
        # embedding, so that the model behaves as a tied one would.
        weights["lm_head.weight"] = next(v for k, v in params.items() if "embed" in k
                                         and v.shape == params["lm_head.weight"].shape)
    if family == "qwen3_5_mtp":
        weights.update(_mtp_weights(model, scale))
    return save_model(folder, tokenizer_folder, config, weights)


def _mtp_weights(model, scale: float) -> dict:
    """Random ``mtp.*`` weights in the Hugging Face layout: one full-attention
    decoder layer of the model's own class, norms zero-centred (stored as
    weight - 1, small random values here)."""
    import dataclasses

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    args = model.language_model.args
    layer = type(model.language_model.model.layers[1])(
        dataclasses.replace(args, full_attention_interval=1), 0)
    H = args.hidden_size
    out = {"mtp.fc.weight": scale * nn.Linear(2 * H, H, bias=False).weight}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = 0.1 * mx.random.normal((H,))
    for key, value in tree_flatten(layer.parameters()):
        out[f"mtp.layers.0.{key}"] = (0.1 * mx.random.normal(value.shape) if key.endswith("norm.weight")
                                      else scale * value)
    return out


def build_mtp_copy(folder: Path, tokenizer_folder: Path, seed: int = 0,
                   scale: float = 4.0, vocab: Optional[int] = None) -> Path:
    """A one-layer qwen3_5 whose MTP layer is a copy of the target: embedding
    rows of unit RMS (so the head's input norm leaves them as they are),
    ``fc`` passing the token's embedding through and ignoring the hidden
    state, the target's own decoder layer and final norm. Given (h_t, x_{t+1})
    it computes what the target computes at x_{t+1}, attending over the
    tokens in its own cache (the generated ones, not the prompt), so its
    drafts are mostly right: a drafter with real acceptance, with no
    trained weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = with_vocab(CONFIGS["qwen3_5_mtp_copy"], vocab)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Layers louder than the embedding: the output wanders instead of repeating.
    weights = {k: v if "embed" in k or k.endswith("norm.weight") else scale * v
               for k, v in tree_flatten(model.parameters())}
    key = "language_model.model.embed_tokens.weight"
    embed = weights[key]
    weights[key] = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True))
    H = embed.shape[1]
    # HF layout: the loader adds 1 to the MTP layer's norms (zero-centred).
    mtp = {"mtp.fc.weight": mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1),
           "mtp.pre_fc_norm_embedding.weight": mx.zeros((H,)),
           "mtp.pre_fc_norm_hidden.weight": mx.zeros((H,)),
           "mtp.norm.weight": weights["language_model.model.norm.weight"] - 1.0}
    prefix = "language_model.model.layers.0."
    for k, v in weights.items():
        if k.startswith(prefix):
            name = k[len(prefix):]
            mtp["mtp.layers.0." + name] = v - 1.0 if name.endswith("norm.weight") else v
    weights.update(mtp)
    return save_model(folder, tokenizer_folder, config, weights)


def _loud(params: dict, scale: float) -> dict:
    """Random weights as ``build``'s, times ``scale`` but the embedding and
    norms; MoE routers (zeros in a fresh model) random."""
    import mlx.core as mx

    out = {}
    for k, v in params.items():
        if k.endswith("gate.weight"):
            v = mx.random.normal(v.shape)
        elif k.endswith("e_score_correction_bias"):
            v = 0.1 * mx.random.normal(v.shape)
        out[k] = v if "embed_tokens" in k or k.endswith("norm.weight") else scale * v
    return out


def _write_with_nextn(folder: Path, tokenizer_folder: Path, config: dict, weights: dict,
                      nextn: dict, layer: dict) -> Path:
    """The target's ``weights`` and its nextn layer (``nextn``: the MTP parts;
    ``layer``: its decoder layer, experts written one tensor each as Hugging
    Face does) as ``model.layers.{num_hidden_layers}``."""

    nextn = dict(nextn)
    for name, v in layer.items():
        if ".switch_mlp." in name:
            for e in range(v.shape[0]):
                nextn[name.replace("switch_mlp", f"experts.{e}")] = v[e]
        else:
            nextn[name] = v
    L = config["num_hidden_layers"]
    weights = {**weights, **{f"model.layers.{L}." + k: v for k, v in nextn.items()}}
    return save_model(folder, tokenizer_folder, config, weights)


def build_nextn(folder: Path, tokenizer_folder: Path, copy: bool = True, seed: int = 0,
                scale: float = 4.0) -> Path:
    """A one-layer glm4_moe in the Hugging Face layout of GLM-4.5 /
    DeepSeek-V3, with its nextn layer (``model.layers.1.*``: ``eh_proj``,
    ``enorm``, ``hnorm``, ``shared_head``, the experts one tensor each).
    ``copy``: the nextn layer copies the target, as ``build_mtp_copy``'s
    (drafts mostly right); else it is random, and the target's layer 0 a
    dense one (``first_k_dense_replace`` 1), so that only a layer built at
    index 1 is an MoE layer that fits the nextn weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import glm4_moe

    config = dict(CONFIGS["glm4_moe_nextn"], first_k_dense_replace=0 if copy else 1)
    args = glm4_moe.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    weights = _loud(dict(tree_flatten(glm4_moe.Model(args).parameters())), scale)
    embed = weights["model.embed_tokens.weight"]
    embed = embed / mx.sqrt(mx.mean(embed * embed, axis=-1, keepdims=True))
    weights["model.embed_tokens.weight"] = weights["lm_head.weight"] = embed
    H = embed.shape[1]
    if copy:
        layer = {k[len("model.layers.0."):]: v for k, v in weights.items()
                 if k.startswith("model.layers.0.")}
        nextn = {"eh_proj.weight": mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1),
                 "enorm.weight": mx.ones((H,)), "hnorm.weight": mx.ones((H,)),
                 "shared_head.norm.weight": weights["model.norm.weight"]}
    else:
        layer = _loud(dict(tree_flatten(glm4_moe.DecoderLayer(args, 1).parameters())), scale)
        nextn = {"eh_proj.weight": 0.2 * mx.random.normal((H, 2 * H)),
                 **{f"{n}.weight": 1.0 + 0.2 * mx.random.normal((H,))
                    for n in ("enorm", "hnorm", "shared_head.norm")}}
    nextn.update({"shared_head.head.weight": embed, "embed_tokens.weight": embed})
    return _write_with_nextn(folder, tokenizer_folder, config, weights, nextn, layer)


def build_deepseek_nextn(folder: Path, tokenizer_folder: Path, seed: int = 0,
                         scale: float = 2.0) -> Path:
    """A deepseek_v3 of 61 tiny dense layers with a random nextn layer
    (``model.layers.61``) in the Hugging Face layout: MLA attention with
    ``kv_b_proj`` unsplit (the family's ``sanitize`` splits it), the
    experts one tensor each."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import deepseek_v3

    config = CONFIGS["deepseek_v3_nextn"]
    args = deepseek_v3.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    weights = _loud(dict(tree_flatten(deepseek_v3.Model(args).parameters())), scale)
    # Upstream's own layers hold kv_b_proj split: write it as Hugging Face does.
    heads, nope, v_dim = args.num_attention_heads, args.qk_nope_head_dim, args.v_head_dim
    H = args.hidden_size

    def unsplit(prefix: str, params: dict) -> dict:
        out = {k: v for k, v in params.items()
               if not k.startswith((prefix + "embed_q", prefix + "unembed_out"))}
        out[prefix + "kv_b_proj.weight"] = 0.2 * mx.random.normal(
            (heads * (nope + v_dim), args.kv_lora_rank))
        return out

    L = args.num_hidden_layers
    for i in range(L):
        weights = unsplit(f"model.layers.{i}.self_attn.", weights)
    layer = unsplit("self_attn.", _loud(dict(tree_flatten(
        deepseek_v3.DeepseekV3DecoderLayer(args, L).parameters())), scale))
    nextn = {"eh_proj.weight": 0.2 * mx.random.normal((H, 2 * H)),
             **{f"{n}.weight": 1.0 + 0.2 * mx.random.normal((H,))
                for n in ("enorm", "hnorm", "shared_head.norm")},
             "shared_head.head.weight": weights["lm_head.weight"],
             "embed_tokens.weight": weights["model.embed_tokens.weight"]}
    return _write_with_nextn(folder, tokenizer_folder, config, weights, nextn, layer)


def build_eagle3(folder: Path, target_config: dict, draft_vocab: int = 2048, seed: int = 0,
                 aux_ids=None, layout: str = "speculators") -> Path:
    """A random-weight EAGLE-3 head for a target with ``target_config`` (its
    config.json), in the ``speculators`` layout (``layout="specforge"``: the
    layer named ``midlayer``): one Llama-style layer over 2H-wide attention
    inputs, a draft vocabulary of ``draft_vocab`` target ids (``d2t``
    offsets, ``t2d`` mask), norms near 1."""
    import mlx.core as mx

    mx.random.seed(seed)
    H = target_config["hidden_size"]
    V = target_config["vocab_size"]
    heads, kv, head_dim, inner = 4, 2, 32, 128
    layer = "midlayer" if layout == "specforge" else "layers.0"

    def w(*shape):
        return 0.05 * mx.random.normal(shape)

    ids = mx.sort(mx.random.permutation(V)[:draft_vocab])
    weights = {
        "fc.weight": w(H, 3 * H),
        f"{layer}.self_attn.q_proj.weight": w(heads * head_dim, 2 * H),
        f"{layer}.self_attn.k_proj.weight": w(kv * head_dim, 2 * H),
        f"{layer}.self_attn.v_proj.weight": w(kv * head_dim, 2 * H),
        f"{layer}.self_attn.o_proj.weight": w(H, heads * head_dim),
        f"{layer}.mlp.gate_proj.weight": w(inner, H),
        f"{layer}.mlp.up_proj.weight": w(inner, H),
        f"{layer}.mlp.down_proj.weight": w(H, inner),
        "lm_head.weight": w(draft_vocab, H),
        "d2t": (ids - mx.arange(draft_vocab)).astype(mx.int64),
    }
    t2d = mx.zeros((V,), mx.bool_)
    t2d[ids] = True
    weights["t2d"] = t2d
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[f"{layer}.{name}.weight"] = 1.0 + 0.1 * mx.random.normal((H,))
    weights["norm.weight"] = 1.0 + 0.1 * mx.random.normal((H,))
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": draft_vocab, "norm_before_residual": False,
        "target_hidden_size": H,
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": H, "intermediate_size": inner,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "rms_norm_eps": 1e-5, "vocab_size": V,
            "max_position_embeddings": 8192, "rope_theta": 10000.0},
    }
    if aux_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def build_dflash(folder: Path, target_config: dict, layer_ids=(1, 14, 26), num_layers: int = 2,
                 block_size: int = 8, mask_token_id: int = 0, seed: int = 0,
                 silent: bool = False, norm_scale=None) -> Path:
    """A random-weight DFlash block drafter for a target with ``target_config``
    in z-lab's layout: ``fc`` over the listed target layers' outputs,
    ``hidden_norm``, ``num_layers`` Qwen3-style layers (q/k norms), ``norm``;
    the target's embedding and output projection. ``silent``: the layers add
    nothing (zero ``o_proj`` and ``down_proj``), so every mask position
    drafts from the mask token's own embedding; ``norm_scale``: the final
    norm's weights, all this value (small: soft drafting distributions)."""
    import mlx.core as mx

    mx.random.seed(seed)
    H, V = target_config["hidden_size"], target_config["vocab_size"]
    heads, kv, head_dim, inner = 4, 2, 32, 128

    def w(*shape):
        return 0.05 * mx.random.normal(shape)

    weights = {"fc.weight": w(H, len(layer_ids) * H),
               "hidden_norm.weight": 1.0 + 0.1 * mx.random.normal((H,)),
               "norm.weight": 1.0 + 0.1 * mx.random.normal((H,))}
    if norm_scale is not None:
        weights["norm.weight"] = mx.full((H,), norm_scale)
    for i in range(num_layers):
        p = f"layers.{i}"
        weights.update({
            f"{p}.self_attn.q_proj.weight": w(heads * head_dim, H),
            f"{p}.self_attn.k_proj.weight": w(kv * head_dim, H),
            f"{p}.self_attn.v_proj.weight": w(kv * head_dim, H),
            f"{p}.self_attn.o_proj.weight": w(H, heads * head_dim) * (0 if silent else 1),
            f"{p}.self_attn.q_norm.weight": 1.0 + 0.1 * mx.random.normal((head_dim,)),
            f"{p}.self_attn.k_norm.weight": 1.0 + 0.1 * mx.random.normal((head_dim,)),
            f"{p}.mlp.gate_proj.weight": w(inner, H),
            f"{p}.mlp.up_proj.weight": w(inner, H),
            f"{p}.mlp.down_proj.weight": w(H, inner) * (0 if silent else 1),
            f"{p}.input_layernorm.weight": 1.0 + 0.1 * mx.random.normal((H,)),
            f"{p}.post_attention_layernorm.weight": 1.0 + 0.1 * mx.random.normal((H,)),
        })
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": inner, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
        "rms_norm_eps": 1e-6, "vocab_size": V, "max_position_embeddings": 8192,
        "rope_theta": 10000.0, "tie_word_embeddings": True, "block_size": block_size,
        "num_target_layers": target_config.get("num_hidden_layers"),
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def shard_drafter_apart(folder: Path) -> Path:
    """``folder``'s ``model.safetensors`` as two shards in the Hugging Face
    layout: the drafter layer (``mtp.*``, or the nextn layer
    ``model.layers.{num_hidden_layers}``) alone in the second, and the
    ``model.safetensors.index.json`` that says which shard holds what."""
    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", config)
    drafter = ("mtp.",) + ((f"model.layers.{text['num_hidden_layers']}.",)
                           if text.get("num_nextn_predict_layers") else ())
    weights = mx.load(str(folder / "model.safetensors"))
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    shards = ({k: v for k, v in weights.items() if not k.startswith(drafter)},
              {k: v for k, v in weights.items() if k.startswith(drafter)})
    for name, shard in zip(names, shards):
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# ---- vision-language folders (mlx-vlm's own classes) --------------------------------

# Gemma 3's chat template as its checkpoints ship it: an image part is its
# ``<start_of_image>`` marker, which the processor expands.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is "
    "string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}{{ raise_exception("
    "\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\\n' + "
    "(first_user_prefix if loop.first else \"\") }}{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}{%- elif message['content'] is iterable -%}{%- for item in "
    "message['content'] -%}{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ raise_exception(\"Invalid content type\") }}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{'<start_of_turn>model\\n'}}{%- endif -%}")

GEMMA3_SPECIALS = ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>",
                   "<end_of_image>")


def build_gemma3_vlm(folder: Path, tokenizer_folder: Path, seed: int = 0,
                     image_tokens: int = 4, sliding_window: int = 16) -> Path:
    """A random-weight Gemma 3 vision-language folder, built with mlx-vlm's
    own ``gemma3`` classes and saved as mlx-vlm (and mlx-lm) load it: a
    SigLIP tower over 32 x 32 pixels in 8-pixel patches, pooled to
    ``image_tokens`` tokens per image; the language model is the tiny
    ``gemma3_text`` above (``sliding_window``-token windows: a prompt cache
    entry longer than a prompt is cut back only while it fits one). SmolLM2's tokenizer
    with Gemma 3's five special tokens added (ids 49152..49156), its chat
    template, and a processor config for mlx-vlm's Gemma3Processor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in GEMMA3_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in GEMMA3_SPECIALS}
    vocab = tok.get_vocab_size()
    tok_config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text())
    tok_config.update(eos_token="<end_of_turn>", chat_template=GEMMA3_TEMPLATE,
                      processor_class="Gemma3Processor", extra_special_tokens={
                          "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                          "eoi_token": "<end_of_image>"})
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    text = dict(CONFIGS["gemma3_text"], vocab_size=vocab, rope_global_base_freq=1000000.0,
                mm_tokens_per_image=image_tokens, sliding_window=sliding_window)
    config = {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "vocab_size": vocab, "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"], "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": image_tokens, "pad_token_id": 0,
        "eos_token_id": [ids["<end_of_turn>"]], "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                          "num_hidden_layers": 2, "intermediate_size": 64,
                          "num_attention_heads": 2, "patch_size": 8, "image_size": 32,
                          "layer_norm_eps": 1e-6}}
    arch, _ = get_model_and_args(config)
    scratch = json.loads(json.dumps(config))
    model_config = update_module_configs(arch.ModelConfig.from_dict(scratch), arch, scratch,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    weights = {k: v for k, v in tree_flatten(model.parameters())
               if k != "language_model.lm_head.weight"}  # tied, as gemma3 checkpoints are
    # The projector starts as ones: random, so that the image moves the output.
    name = "multi_modal_projector.mm_input_projection_weight"
    weights[name] = 0.2 * mx.random.normal(weights[name].shape)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
        "size": {"height": 32, "width": 32}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "resample": 2, "do_convert_rgb": True, "do_pan_and_scan": False}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Gemma3Processor", "image_seq_length": image_tokens}))
    return folder


def with_vision_config(folder: Path, vision_config: dict) -> Path:
    """``folder``'s config.json with a ``vision_config``: the layout of a
    vision-language checkpoint of the same family (Qwen3.5's: its text model
    under ``text_config``), weights of the text model only."""
    config = json.loads((folder / "config.json").read_text())
    config["vision_config"] = vision_config
    (folder / "config.json").write_text(json.dumps(config))
    return folder


QWEN_VL_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}"
    "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] }}{%- endif -%}{%- endfor -%}{%- endif -%}{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_qwen35_vlm(folder: Path, tokenizer_folder: Path, seed: int = 0) -> Path:
    """A random-weight Qwen3.5 vision-language folder, built with mlx-vlm's
    own ``qwen3_5`` classes: a Qwen3-VL tower over 16-pixel patches merged
    2 x 2 (an image of 64 x 96 pixels is a 2 x 3 grid of 6 tokens), the tiny
    ``qwen3_5`` text model above with M-RoPE (``mrope_section`` [3, 3, 2]
    over 16 rotated dimensions: time, height and width all used). SmolLM2's
    tokenizer with Qwen's four vision tokens added, a Qwen chat template, and
    the processor configs mlx-vlm's Qwen3VLProcessor reads."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False)
                            for s in QWEN_VL_SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in QWEN_VL_SPECIALS}
    vocab = tok.get_vocab_size()
    tok_config = json.loads((tokenizer_folder / "tokenizer_config.json").read_text())
    tok_config.update(eos_token="<|im_end|>", chat_template=QWEN_VL_TEMPLATE,
                      processor_class="Qwen3VLProcessor")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (folder / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    text = dict(CONFIGS["qwen3_5"]["text_config"], vocab_size=vocab, head_dim=32,
                rope_parameters=dict(type="default", mrope_section=[3, 3, 2],
                                     rope_theta=10000.0, partial_rotary_factor=0.5))
    config = {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": True, "vocab_size": vocab,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": [tok.token_to_id("<|im_end|>")], "text_config": text,
        "vision_config": {"model_type": "qwen3_5", "depth": 2, "hidden_size": 32,
                          "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                          "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "in_channels": 3, "num_position_embeddings": 64,
                          "deepstack_visual_indexes": []}}
    arch, _ = get_model_and_args(config)
    scratch = json.loads(json.dumps(config))
    model_config = update_module_configs(arch.ModelConfig.from_dict(scratch), arch, scratch,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    mx.random.seed(seed)
    model = arch.Model(model_config)
    weights = {k: v for k, v in tree_flatten(model.parameters())
               if k != "language_model.lm_head.weight"}  # tied
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 32 * 32, "max_pixels": 32 * 32 * 16,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Qwen3VLProcessor"}))
    return folder


def as_qwen35_vlm_original(folder: Path, language: str = "model.language_model.") -> Path:
    """``folder`` (``build_mtp_copy``'s) in the layout of a Hugging Face
    Qwen3.5 checkpoint, which is a vision-language one: the language model
    under ``language`` (``model.language_model.``), a vision tower (mlx-vlm's
    ``qwen3_5`` classes, random) under ``model.visual.``, the MTP layer's
    ``mtp.*`` at the top, and a ``vision_config``. Its norms are stored as
    mlx-lm holds them (a one-layer model with no conv1d, so mlx-lm does
    not shift them); mlx-vlm shifts those of a ``model.language_model.``
    layout, not of ``language_model.model.``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen3_5ForConditionalGeneration"], image_token_id=49150,
                  video_token_id=49151, vision_start_token_id=49148, vision_end_token_id=49149,
                  vision_config={"model_type": "qwen3_5", "depth": 1, "hidden_size": 32,
                                 "num_heads": 2, "intermediate_size": 64,
                                 "out_hidden_size": config["text_config"]["hidden_size"],
                                 "patch_size": 16, "spatial_merge_size": 2,
                                 "temporal_patch_size": 2, "in_channels": 3,
                                 "num_position_embeddings": 64, "deepstack_visual_indexes": []})
    arch, _ = get_model_and_args(config)
    scratch = json.loads(json.dumps(config))
    model_config = update_module_configs(arch.ModelConfig.from_dict(scratch), arch, scratch,
                                         ["text", "vision", "perceiver", "projector", "audio"])
    tower = arch.Model(model_config).vision_tower
    weights = {(language + k[len("language_model.model."):]
                if k.startswith("language_model.model.") else k): v
               for k, v in mx.load(str(folder / "model.safetensors")).items()}
    weights.update({"model.visual." + k: v for k, v in tree_flatten(tower.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder
