"""The one place that touches mlx-vlm (the optional ``vision`` extra:
``pip install mlx-lm-server[vision]``).

The served model stays mlx-lm's: its language model is what the batch
generator, the engine and every drafter see. From mlx-vlm come only the
prompt's side of an image: the checkpoint's vision tower and projector, built
by mlx-vlm's own model class from the same folder, the processor that turns
a prompt's text and images into token ids and pixels, and the model's own
merge of image features into the prompt's embeddings
(``get_input_embeddings``). Its language model is never evaluated: its
token embedding is the served model's own module, and its layers are
dropped unread (weights load lazily), so nothing is held twice.

mlx-vlm is imported only here and only when a folder with a vision tower is
loaded: a text-only model starts as it did without the extra.
``tests/server/test_vision.py`` fails loudly when mlx-vlm moves under these names.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def installed() -> bool:
    """Whether mlx-vlm can be imported (without importing it)."""
    return importlib.util.find_spec("mlx_vlm") is not None


def known_model_type(config: dict) -> Optional[str]:
    """The checkpoint's family when mlx-vlm has a model module of that name
    (None: it has not), found by looking at its files: importing mlx-vlm
    costs seconds (it imports transformers), and a model list asks this of
    models not loaded."""
    spec = importlib.util.find_spec("mlx_vlm")
    model_type = str(config.get("model_type") or "").lower()
    if spec is None or not model_type.isidentifier():
        return None
    for root in spec.submodule_search_locations or ():
        if (Path(root) / "models" / model_type / "__init__.py").is_file():
            return model_type
    return None


def takes_input_embeddings(model: nn.Module) -> bool:
    """Whether mlx-lm's class for the model takes ``input_embeddings`` (a
    prompt's merged text and image embeddings) in place of token ids."""
    return "input_embeddings" in inspect.signature(model.__call__).parameters


class VisionParts:
    """mlx-vlm's model of a checkpoint, less its language model, and its processor."""

    def __init__(self, model: nn.Module, processor, image_token_id: int,
                 mrope_axes: Optional[tuple] = None, mrope_refused: str = ""):
        self.model = model
        self.processor = processor
        self.image_token_id = image_token_id
        # M-RoPE (Qwen): the axis (0 time, 1 height, 2 width) each rotated
        # frequency turns by; None where the family has no M-RoPE, or one
        # whose layout this server does not take (``mrope_refused`` says why).
        self.mrope_axes = mrope_axes
        self.mrope_refused = mrope_refused


def load_vision(folder: str, text_model: nn.Module) -> VisionParts:
    """The vision tower, projector and processor of ``folder``, built with
    mlx-vlm's classes; its language model's token embedding replaced by
    ``text_model``'s (the served model) and its layers dropped unread."""
    from mlx_vlm.utils import load_model, load_processor

    vlm = load_model(Path(folder), lazy=True)
    language = vlm.language_model
    axes, refused = _mrope_axes(language)
    inner = getattr(language, "model", language)
    inner.embed_tokens = _embedding_of(text_model)
    if hasattr(inner, "layers"):
        inner.layers = []
    if hasattr(language, "lm_head"):
        language.lm_head = None
    mx.eval([v for k, v in _flat(vlm.parameters()) if not k.startswith("language_model.")])
    processor = load_processor(Path(folder), add_detokenizer=False)
    config = vlm.config
    image_token_id = getattr(config, "image_token_index", None)
    if image_token_id is None:
        image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        raise ValueError(f"{folder}: its config names no image token (image_token_index)")
    return VisionParts(vlm, processor, int(image_token_id), axes, refused)


def _mrope_axes(language: nn.Module) -> tuple[Optional[tuple], str]:
    """The axis of each rotated frequency of the language model's M-RoPE
    (mlx-vlm's ``position_selector``), read before its layers are dropped,
    and why it is not taken ("" when it is, or there is none). Taken: the
    layouts that pick a whole frequency's position from one axis and turn
    the two halves of the dimensions (Qwen's ``interleaved``, Qwen2.5-VL's
    ``chunked``)."""
    from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

    for _, module in language.named_modules():
        if isinstance(module, MRoPERotaryEmbedding):
            if module.style not in ("interleaved", "chunked") or module.position_selector is None \
                    or module.attention_scaling != 1.0:
                return None, (f"its M-RoPE layout ({module.style!r}, scaling "
                              f"{module.attention_scaling}) is not one this server places")
            return tuple(int(a) for a in np.asarray(module.position_selector).tolist()), ""
    return None, ""


def grid_positions(parts: VisionParts, tokens: list[int], inputs: dict) -> np.ndarray:
    """The prompt's M-RoPE positions, [3, len(tokens)] (time, height, width),
    as the model's own ``get_rope_index`` numbers them: an image's tokens by
    their place in its grid, the text after it from the largest position + 1.
    Index arithmetic on the CPU stream: it runs on a request's thread."""
    with mx.stream(mx.cpu):
        ids = mx.array([tokens])
        grid = inputs.get("image_grid_thw")
        positions, _ = parts.model.language_model.get_rope_index(
            ids, None if grid is None else mx.array(grid), None,
            mx.ones(ids.shape, dtype=mx.int32))
        return np.asarray(positions).reshape(3, len(tokens))


def _flat(params) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def _embedding_of(text_model: nn.Module) -> nn.Module:
    """The served model's token embedding module (``embed_tokens``)."""
    for name, module in text_model.named_modules():
        if name.split(".")[-1] == "embed_tokens":
            return module
    raise ValueError(f"{type(text_model).__module__}: no embed_tokens module to share")


def processed_prompt(parts: VisionParts, text: str, images: list) -> tuple[list[int], dict]:
    """The processor's token ids for a prompt's ``text`` (its images' markers
    written by the chat template, expanded here to each image's placeholder
    tokens) and the model's image inputs as numpy arrays (pixel values and
    whatever else the family's merge reads, such as grids)."""
    from mlx_vlm.utils import prepare_inputs

    inputs = prepare_inputs(parts.processor, images=images, prompts=[text],
                            image_token_index=parts.image_token_id, add_special_tokens=False)
    ids = np.asarray(inputs["input_ids"]).reshape(-1).tolist()
    extra = {k: np.asarray(v) for k, v in inputs.items()
             if k not in ("input_ids", "attention_mask") and v is not None
             and isinstance(v, (mx.array, np.ndarray))}
    if "pixel_values" not in extra:
        raise ValueError("the processor gave no pixel values for the images")
    return [int(t) for t in ids], extra


def input_embeddings(parts: VisionParts, tokens: list[int], inputs: dict) -> mx.array:
    """The prompt's embeddings, image features merged in by the model's own
    ``get_input_embeddings``: [1, len(tokens), hidden]."""
    ids = mx.array([tokens])
    kwargs: dict[str, Any] = {k: mx.array(v) for k, v in inputs.items() if k != "pixel_values"}
    out = parts.model.get_input_embeddings(ids, mx.array(inputs["pixel_values"]),
                                           mask=mx.ones(ids.shape, dtype=mx.int32), **kwargs)
    return getattr(out, "inputs_embeds", out)
