"""Convert a GGUF checkpoint into an MLX model folder that ``mlx_lm.load`` opens.

GGUF tensors are dequantized with the ``gguf`` package (it handles every quant
type, K-quants included, which ``mx.load`` does not), renamed to the Hugging
Face names mlx-lm's model classes expect, and written as ``model.safetensors``
next to a ``config.json`` and a tokenizer built from the GGUF metadata.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from .gguf_tokenizer import eos_token_ids, write_tokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# GGUF tensor name inside a block -> Hugging Face name inside ``model.layers.N``.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

Progress = Callable[[int, int, str], None]


def read_metadata(reader) -> dict:
    """GGUF key/value metadata as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, kind = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_BLOCK_NAMES[base]}.{kind}"
    base, kind = parts[0], parts[1]
    return f"{_TOP_NAMES[base]}.{kind}"


def unpermute_rope(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows for interleaved RoPE.

    llama.cpp stores each head's rows as (pairs, 2) instead of Hugging Face's
    (2, halves) so that its kernels can rotate adjacent elements.
    """
    head_dim = w.shape[0] // num_heads
    return (
        w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def model_config(meta: dict, has_lm_head: bool) -> dict:
    arch = meta["general.architecture"]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})."
        )

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    config = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_lm_head,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_token_ids(meta),
    }
    if arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    return config


def iter_weights(reader, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor of the GGUF file."""
    from gguf.quants import dequantize

    for tensor in reader.tensors:
        w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(tensor.shape)])
        if config["model_type"] == "llama":
            if tensor.name.endswith("attn_q.weight"):
                w = unpermute_rope(w, config["num_attention_heads"])
            elif tensor.name.endswith("attn_k.weight"):
                w = unpermute_rope(w, config["num_key_value_heads"])
        yield hf_name(tensor.name), w


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: str = "float32",
    quantize_bits: Optional[int] = None,
    progress: Optional[Progress] = None,
) -> None:
    """Write an MLX model folder for ``gguf_path`` into ``out_dir`` (which must exist)."""
    import gguf
    import mlx.core as mx

    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    names = [t.name for t in reader.tensors]
    config = model_config(meta, has_lm_head="output.weight" in names)

    weights = {}
    total = len(reader.tensors)
    for i, (name, w) in enumerate(iter_weights(reader, config), 1):
        weights[name] = mx.array(w).astype(getattr(mx, dtype))
        mx.eval(weights[name])
        if progress:
            progress(i, total, name)
    config["torch_dtype"] = dtype

    if quantize_bits is None:
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    else:
        _save_quantized(weights, config, out_dir, quantize_bits)
    write_tokenizer(meta, config["max_position_embeddings"], out_dir)


def _save_quantized(weights: dict, config: dict, out_dir: Path, bits: int) -> None:
    """Quantize with mlx-lm's own routine so the folder loads like any mlx-community model."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    staging = out_dir / "_float"
    staging.mkdir()
    import mlx.core as mx

    mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    (staging / "config.json").write_text(json.dumps(config))
    weights.clear()
    model, loaded_config = load_model(staging, lazy=True)
    model, loaded_config = quantize_model(model, loaded_config, group_size=64, bits=bits)
    save_model(out_dir, model)
    save_config(loaded_config, out_dir / "config.json")
    for f in staging.iterdir():
        f.unlink()
    staging.rmdir()


def print_progress(i: int, total: int, name: str) -> None:
    """One overwriting status line on a terminal, every 10% otherwise."""
    if sys.stderr.isatty():
        end = "\n" if i == total else ""
        print(f"\r  converting tensors {i}/{total} {name:<48}", end=end, file=sys.stderr, flush=True)
    elif i == total or i % max(1, total // 10) == 0:
        print(f"  converting tensors {i}/{total}", file=sys.stderr, flush=True)
