"""A vision-language model's prompt side: whether a model folder takes
images (and why not), its processor, and the prefill of a prompt whose
embeddings hold images.

Decoding is text whatever the prompt held: once a row's prompt is in its
layer caches, the batch, every drafter and the exact verifier go on as for a
text prompt. So a prompt with images is prefilled here, into the same
one-sequence caches a prompt cache hit hands the batch generator, with the
model's own merge of image features into the embeddings
(``runtime/mlx_vlm_adapter.py``); the batch generator then takes the row with
its last token to feed, as after any cache hit.

Qwen's M-RoPE families give a token three positions (time, height, width):
an image's tokens sit at their place in its grid, and the text after it is
numbered from the grid's largest position + 1, so below its index by a
delta (the model's ``rope_deltas``). RoPE sees only differences of
positions, so the server moves every position of such a prompt up by that
delta: the text after the last image is then at its index, as in any text
row, and the batch, rollback, trees and the drafters need no offset per row;
only this prefill places tokens at their three positions (the adapter's
``grid_positions``). The served families are those where that is checked
(``MROPE_SERVED``); the others still serve text, their images refused.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..runtime import mlx_lm_adapter, mlx_vlm_adapter
from .images import LoadedImage
from .prompt import PromptImages, cache_key, placeholders_end, shifted_key

log = logging.getLogger("mlx_lm_server.vision")

# Families whose text positions after an image are not the token's index.
MROPE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                  "qwen3_5_moe", "qwen3_omni_moe", "glm4v", "glm4v_moe", "ernie4_5_moe_vl",
                  "paddleocr_vl", "hunyuan_vl", "dots_ocr", "keye_vl", "kimi_vl")
# Those whose images are served: their prefill at M-RoPE positions checked
# against mlx-vlm's own generate (tests/server/test_vision_mrope.py).
MROPE_SERVED = ("qwen3_5",)


@dataclass(frozen=True)
class ImageSupport:
    """Whether a model folder's model takes images, and if not, why (the
    400's words for a request that sends one)."""

    takes_images: bool
    why_not: str = ""


def _config(folder: str) -> dict:
    try:
        return json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _uses_mrope(config: dict) -> bool:
    text = config.get("text_config") or {}
    for rope in (config.get("rope_scaling"), config.get("rope_parameters"),
                 text.get("rope_scaling"), text.get("rope_parameters")):
        if isinstance(rope, dict) and "mrope_section" in rope:
            return True
    return config.get("model_type") in MROPE_FAMILIES


def image_support(folder: str, name: str) -> ImageSupport:
    """Read from the folder's config.json (mlx-vlm is looked for, not imported
    unless the folder has a vision tower)."""
    config = _config(folder)
    if not config.get("vision_config"):
        return ImageSupport(False, f"model {name!r} is a text-only model: it takes no images; "
                                   "send text, or serve a vision-language model")
    if not mlx_vlm_adapter.installed():
        return ImageSupport(False, f"model {name!r} has a vision tower, but this server was "
                                   "installed without images: pip install 'mlx-lm-server[vision]'")
    model_type = mlx_vlm_adapter.known_model_type(config)
    if model_type is None:
        return ImageSupport(False, f"model {name!r}: mlx-vlm has no model class for its "
                                   f"family {config.get('model_type')!r}; it serves text only")
    if _uses_mrope(config) and model_type not in MROPE_SERVED:
        return ImageSupport(False, f"model {name!r} ({model_type}) places an image's tokens by "
                                   "their grid (M-RoPE), which this server serves only for "
                                   f"{', '.join(MROPE_SERVED)}; it serves text only here")
    return ImageSupport(True)


class VisionTower:
    """A served model's vision tower and processor (mlx-vlm's), beside the
    served text model, whose token embedding it shares."""

    def __init__(self, parts: mlx_vlm_adapter.VisionParts):
        self.parts = parts
        self.image_token = parts.image_token_id

    @classmethod
    def load(cls, folder: str, name: str, model) -> tuple[Optional["VisionTower"], ImageSupport]:
        """The tower for ``folder`` (None, with why, when its images are refused)."""
        support = image_support(folder, name)
        if support.takes_images and not mlx_vlm_adapter.takes_input_embeddings(model):
            support = ImageSupport(False, f"model {name!r}: mlx-lm's class for it takes no "
                                          "input embeddings; it serves text only")
        if not support.takes_images:
            if _config(folder).get("vision_config"):
                log.info("images refused: %s", support.why_not)
            return None, support
        parts = mlx_vlm_adapter.load_vision(folder, model)
        why = _mrope_refused(parts, model) if _uses_mrope(_config(folder)) else ""
        if why:
            support = ImageSupport(False, f"model {name!r}: {why}; it serves text only here")
            log.info("images refused: %s", support.why_not)
            return None, support
        tower = cls(parts)
        log.info("images: %s's vision tower and processor (mlx-vlm %s)", name,
                 _version("mlx-vlm"))
        return tower, support

    def prompt(self, text: str, images: list[LoadedImage]) -> tuple[list[int], PromptImages]:
        """The prompt's token ids (each image's placeholders expanded by the
        processor) and its images as the batch takes them. ``ValueError``
        when the processor refuses them (the template wrote fewer image
        markers than images, say). Off the inference thread: no model runs."""
        tokens, inputs = mlx_vlm_adapter.processed_prompt(
            self.parts, text, [im.image for im in images])
        return tokens, self.prompt_images(tokens, inputs, tuple(im.digest for im in images))

    def prompt_images(self, tokens: list[int], inputs: dict, digests: tuple) -> PromptImages:
        """The images of a prompt the processor wrote (``tokens``, ``inputs``)
        as the batch takes them: their cache key, and an M-RoPE family's
        positions."""
        end = placeholders_end(tokens, self.image_token)
        if end == 0:
            raise ValueError("the chat template wrote no image marker for the images")
        if end >= len(tokens):
            raise ValueError("the prompt ends inside an image; a text token must follow it")
        key, positions = cache_key(tokens, self.image_token, digests), None
        if self.parts.mrope_axes is not None:
            positions = mlx_vlm_adapter.grid_positions(self.parts, tokens, inputs)
            # Moved up by the delta: the last token (text) at its index.
            shift = len(tokens) - 1 - int(positions[:, -1].max())
            positions = positions + shift
            key = shifted_key(key, shift)
        return PromptImages(inputs, digests, key, end, positions)

    def prefill(self, model, cache: list, tokens: list[int], images: PromptImages,
                start: int, step: int) -> None:
        """Run ``tokens[start:-1]`` into ``cache`` (one sequence's layer caches
        holding ``tokens[:start]``), their embeddings the model's merge of text
        and images, ``step`` tokens at a time; the last token is left for the
        batch generator to feed."""
        import mlx.core as mx

        embeddings = mlx_vlm_adapter.input_embeddings(self.parts, tokens, images.inputs)
        ids = mx.array([tokens])
        for s in range(start, len(tokens) - 1, step):
            e = min(s + step, len(tokens) - 1)
            with self.positions(model, images, s, e):
                model(ids[:, s:e], cache=cache, input_embeddings=embeddings[:, s:e])
            mx.eval([c.state for c in cache])

    def positions(self, model, images: PromptImages, start: int, end: int):
        """A block in which ``model``'s passes place tokens ``start:end`` of
        the prompt at their M-RoPE positions (at their index: no M-RoPE)."""
        if images.positions is None:
            return contextlib.nullcontext()
        import mlx.core as mx

        positions = mx.array(images.positions[:, None, start:end])  # [3, 1, end - start]
        return mlx_lm_adapter.grid_positions(model, positions, self.parts.mrope_axes)


def _mrope_refused(parts: mlx_vlm_adapter.VisionParts, model) -> str:
    """Why a prompt's M-RoPE positions cannot be placed in ``model`` ("" when they can)."""
    if parts.mrope_axes is None:
        return parts.mrope_refused or "mlx-vlm's class for it has no M-RoPE to read"
    why = mlx_lm_adapter.grid_refused(model, len(parts.mrope_axes))
    return f"its image positions (M-RoPE) cannot be placed: {why}" if why else ""


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"
