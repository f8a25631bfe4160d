"""Build a Hugging Face ``tokenizer.json`` from a GGUF file's metadata.

Speculation by prompt lookup only pays if the prompt is tokenized exactly as the
model would emit the same text, so the pre-tokenizer must be the model's own
(a GPT-2 regex in place of Qwen2's halves n-gram acceptance). GGUF stores only
the pre-tokenizer's *name*; the table below maps each supported name to the
pre-tokenizer and normalizer of the original ``tokenizer.json``. Unknown names
are refused rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 1, 2, 3
TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 4, 5, 6

_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool, trim_offsets: bool = True) -> dict:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": trim_offsets,
        "use_regex": use_regex,
    }


def _digits_then_gpt2() -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            _byte_level(use_regex=True),
        ],
    }


# name in ``tokenizer.ggml.pre`` -> (normalizer, pre_tokenizer)
PRE_TOKENIZERS: dict[str, tuple[Any, dict]] = {
    "gpt-2": (None, _byte_level(use_regex=True)),
    "smollm": (None, _digits_then_gpt2()),
    "starcoder": (None, _digits_then_gpt2()),
    "qwen2": (
        {"type": "NFC"},
        {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": _QWEN2_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                _byte_level(use_regex=False, trim_offsets=False),
            ],
        },
    ),
}


def _field(meta: dict, key: str, default: Any = None) -> Any:
    return meta.get(key, default)


def eos_token_ids(meta: dict) -> list[int]:
    """The GGUF eos id, plus ``<|endoftext|>`` when it is a separate control token.

    Chat models end turns with ``<|im_end|>`` (the GGUF eos) but end documents
    with ``<|endoftext|>``; both must stop generation.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"]
    ids = [int(meta["tokenizer.ggml.eos_token_id"])]
    if (eot := meta.get("tokenizer.ggml.eot_token_id")) is not None:
        ids.append(int(eot))
    if "<|endoftext|>" in tokens:
        i = tokens.index("<|endoftext|>")
        if types[i] == TOKEN_CONTROL:
            ids.append(i)
    return list(dict.fromkeys(ids))


def build_tokenizer_json(meta: dict) -> dict:
    """A ``tokenizers`` byte-level BPE description equivalent to the GGUF's."""
    model = _field(meta, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; only byte-level "
            "BPE ('gpt2') tokenizers can be converted."
        )
    pre = _field(meta, "tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (known: "
            f"{', '.join(sorted(PRE_TOKENIZERS))}); guessing it would tokenize "
            "prompts differently from the model's own output."
        )
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    merges: list[str] = meta["tokenizer.ggml.merges"]

    # Unused ids are llama.cpp's padding of the vocabulary up to the embedding
    # size ("[PAD151935]"); they are not part of the real tokenizer.
    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != TOKEN_UNUSED}
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": ty != TOKEN_CONTROL,
            "special": ty == TOKEN_CONTROL,
        }
        for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _byte_level(use_regex=False, trim_offsets=False),
        "decoder": _byte_level(use_regex=True),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[int(unk_id)] if unk_id is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges],
        },
    }


def build_tokenizer_config(meta: dict, context_length: int) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str):
        i = meta.get(key)
        return tokens[int(i)] if i is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context_length),
    }
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def write_tokenizer(meta: dict, context_length: int, folder: Path) -> None:
    (folder / "tokenizer.json").write_text(
        json.dumps(build_tokenizer_json(meta), ensure_ascii=False)
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps(build_tokenizer_config(meta, context_length), indent=2, ensure_ascii=False)
    )
