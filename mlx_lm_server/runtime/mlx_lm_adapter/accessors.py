"""mlx-lm's private state read and written: the batch cache's write
position, layer caches, recurrent mixers, the pipelined decode state, the
tokenizer, a model's pieces for the heads. Plain accessors: nothing here
changes how upstream's classes behave (``patches.py`` does)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.generate import generation_stream as _generation_stream
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache
from mlx_lm.tokenizer_utils import TokenizerWrapper


def load_model_lazily(folder: str, adapter_path: Optional[str] = None,
                      trust_remote_code: bool = False) -> tuple[nn.Module, dict]:
    """``mlx_lm.load``'s model half, weights not read yet (and its config):
    the tokenizer half (``load_tokenizer``) touches no MLX and can load on
    another thread meanwhile."""
    from mlx_lm.utils import load_adapters, load_model

    model, config = load_model(Path(folder), lazy=True, trust_remote_code=trust_remote_code)
    if adapter_path is not None:
        model = load_adapters(model, adapter_path)
        model.eval()
    return model, config


def load_tokenizer(folder: str, tokenizer_config: Optional[dict],
                   model_config: dict) -> TokenizerWrapper:
    """``mlx_lm.load``'s tokenizer half, as it loads it."""
    from mlx_lm.utils import load_tokenizer as load

    return load(Path(folder), tokenizer_config,
                eos_token_ids=model_config.get("eos_token_id", None))


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (or
    ``tokenizer`` itself when it is not wrapped)."""
    return tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer


def sequences_in_generator(gen: BatchGenerator) -> dict[str, int]:
    """How many sequences each stage of ``gen`` holds: waiting, prefilling, decoding."""
    return {
        "waiting": len(gen._unprocessed_sequences),
        "prefilling": len(gen._prompt_batch),
        "decoding": len(gen._generation_batch),
    }


# ---- BatchKVCache's write position ---------------------------------------------
#
# A left-padded ``BatchKVCache`` writes every row at one index ``_idx``; its
# mask and ``trim`` follow it. ``RaggedKVCache`` keeps it at the largest row
# end, so upstream's own code (filter, extend, plain steps) stays right.


def write_index(cache: BatchKVCache) -> int:
    return cache._idx


def set_write_index(cache: BatchKVCache, index: int) -> None:
    cache._idx = index


def has_pending_right_padding(cache: BatchKVCache) -> bool:
    """Right padding set by ``prepare`` that ``finalize`` has not rolled in yet."""
    return getattr(cache, "_right_padding", None) is not None


def batch_cache_as(cls: type, cache: BatchKVCache) -> BatchKVCache:
    """``cache`` as an instance of ``cls``, a subclass of its class: the same
    state (arrays, write index, padding), shared, under the subclass's verbs."""
    if not issubclass(cls, type(cache)):
        raise TypeError(f"{cls.__name__} does not extend {type(cache).__name__}")
    out = cls.__new__(cls)
    out.__dict__.update(cache.__dict__)
    return out


def rotating_state(cache) -> tuple:
    """A ``BatchRotatingKVCache``'s ring: (max_size, keys, values, per-row
    offset, write index, rotated?). The write index and rotation say where
    the oldest entry is."""
    return (cache.max_size, cache.keys, cache.values, cache.offset, cache._idx, cache.rotated)


def rotating_cache(max_size: int, keys, values, offset: int):
    """A one-sequence ``RotatingKVCache`` holding ``keys``/``values`` [1, H, L, D]
    (L <= max_size) in temporal order, as upstream's ``extract`` returns one."""
    cache = RotatingKVCache(max_size)
    if keys is not None:
        cache.keys, cache.values = keys, values
        cache._idx = keys.shape[2]
    cache.offset = offset
    return cache


# ---- layer caches ---------------------------------------------------------------
#
# A recurrent layer's ``ArraysCache`` holds its state arrays (convolution
# window, SSM or delta-rule state) in ``cache`` and, for a right-padded pass,
# each row's number of real tokens in ``lengths``: upstream's recurrent mixers
# stop each row's state there, and ``advance`` lowers the lengths in place.


def recurrent_states(cache) -> list:
    """An ``ArraysCache``'s state arrays (references: MLX arrays are immutable)."""
    return list(cache.cache)


def set_recurrent_states(cache, states: Sequence) -> None:
    cache.cache = list(states)


def set_pass_lengths(cache, lengths: Optional[mx.array]) -> None:
    """Row i of an ``ArraysCache`` takes only the first ``lengths[i]`` tokens of
    the next pass into its state (None: all of them). Give each cache its own
    array: ``advance`` lowers it in place."""
    cache.lengths = lengths


# ---- recurrent mixers -------------------------------------------------------------
#
# Replaying the kept tokens of a pass through a recurrent layer needs its
# mixer's inputs, which the model does not keep. A mixer is recorded by swapping
# its instance's class for a subclass whose ``__call__`` hands each call to a
# hook first; weights, parameter names and outputs stay as they are.

_RECORDING_CLASSES: dict = {}  # (mixer class, hook) -> its recording subclass


def cache_mixers(model) -> list:
    """The modules a layer hands its cache to: every direct child of a layer
    whose call takes ``mask`` and ``cache`` (attention mixers too)."""
    out = []
    for layer in getattr(model, "layers", []):
        if not isinstance(layer, nn.Module):
            continue
        out += [child for child in layer.children().values()
                if isinstance(child, nn.Module) and _takes_cache_and_mask(child)]
    return out


def _takes_cache_and_mask(module) -> bool:
    if getattr(module, "_recorded_signature", None) is not None:
        return True
    try:
        params = inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False
    return "cache" in params and "mask" in params


def record_calls(module: nn.Module, hook: Callable) -> None:
    """Make every call of ``module`` first run ``hook(module, args, kwargs)``;
    a module already recorded is left as it is."""
    if getattr(module, "_recorded_signature", None) is not None:
        return
    cls = type(module)
    sub = _RECORDING_CLASSES.get((cls, hook))
    if sub is None:
        def __call__(self, *args, **kwargs):
            hook(self, args, kwargs)
            return cls.__call__(self, *args, **kwargs)

        sub = type(cls.__name__, (cls,), {"__call__": __call__,
                                          "_recorded_signature": inspect.signature(cls.__call__)})
        _RECORDING_CLASSES[(cls, hook)] = sub
    module.__class__ = sub


def bind_call(module: nn.Module, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """A recorded module's call arguments bound to its own ``__call__``'s
    signature (``self`` included)."""
    return module._recorded_signature.bind(module, *args, **kwargs)


# ---- GenerationBatch's pipelined decode state --------------------------------
#
# ``GenerationBatch._step`` samples the *next* token before the caller sees the
# current one: ``_next_tokens`` holds, per row, a token that was sampled but is
# neither fed to the model nor emitted yet, and ``_next_logprobs`` the
# distribution it came from. A speculative step takes that token as the first
# input of its verification pass and leaves a new pending token behind, so
# upstream's own step can resume at any time.


GenerationResponse = GenerationBatch.Response


def generation_stream():
    """The stream upstream's generator runs its passes on."""
    return _generation_stream


def generation_batch(gen: BatchGenerator) -> GenerationBatch:
    return gen._generation_batch


def prompt_tokens_processed(gen: BatchGenerator) -> int:
    """Prompt tokens ``gen`` has prefilled so far: it grows in any ``next()``
    that prefills after its decode step."""
    return gen._counters.prompt_tokens


def next_within_cap(gen: BatchGenerator, admit: Optional[Callable] = None) -> tuple:
    """``gen.next()`` that never lets more than ``completion_batch_size``
    sequences decode at once, and admits at most ``admit(prefilling,
    waiting)`` waiting prompts (their prompt tokens left) to its prefill.
    Upstream admits waiting prompts up to the cap minus the decoding batch
    alone, not counting prompts already being prefilled; those join the
    decoding batch later and overshoot it (5 rows under a cap of 4, seen
    while saturated). Prompts beyond what the cap leaves are held back
    during the call, in order; a sequence that finishes in this call frees
    its slot at the next one."""
    waiting = gen._unprocessed_sequences
    n = max(gen.completion_batch_size - len(gen._generation_batch) - len(gen._prompt_batch), 0)
    if admit is not None and waiting:
        n = min(n, admit([total - done for _, done, total in gen._currently_processing],
                         [sum(len(s) for s in seq[1]) for seq in waiting]))
    if len(waiting) <= n:
        return gen.next()
    held = [waiting.pop() for _ in range(len(waiting) - n)]
    try:
        return gen.next()
    finally:
        waiting.extend(reversed(held))


def plain_step(batch: GenerationBatch) -> list:
    """Upstream's own one-token step."""
    return GenerationBatch.next(batch)


def pending_tokens(batch: GenerationBatch) -> mx.array:
    return batch._next_tokens


def pending_logprobs(batch: GenerationBatch) -> list:
    return batch._next_logprobs


def set_pending(batch: GenerationBatch, tokens: mx.array, logprobs: list) -> None:
    batch._next_tokens = tokens
    batch._next_logprobs = logprobs


def record_fed_tokens(batch: GenerationBatch, row: int, tokens: list[int]) -> None:
    """Tokens that entered row's KV cache: its history and its processors' context."""
    batch.tokens[row].extend(tokens)
    if batch.logits_processors[row]:
        batch._token_context[row].update_and_fetch(mx.array(tokens, dtype=mx.int32))


def count_and_match(batch: GenerationBatch, row: int, token: int):
    """Advance row's token count and stop matcher; the finish reason or None."""
    batch._num_tokens[row] += 1
    finish = "length" if batch._num_tokens[row] >= batch.max_tokens[row] else None
    if batch._matchers[row].advance(token):
        finish = "stop"
    return finish


def tokens_left(batch: GenerationBatch, row: int) -> int:
    return batch.max_tokens[row] - batch._num_tokens[row]


# ---- tokenizer ----------------------------------------------------------------


def calls_are_json_objects(tokenizer) -> bool:
    """Whether the model writes each tool call as a JSON object with ``name``
    and ``arguments`` (mlx-lm's ``json_tools`` parser), which a grammar can force."""
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "__module__", "") == "mlx_lm.tool_parsers.json_tools"


# ---- a model's pieces, for heads that draft with the target's own layers ----------
#
# Learned drafters (MTP layers, EAGLE-3 heads) share the target's embedding and
# output projection, and MTP layers are the target family's own decoder layer.
# Where those live differs between families (qwen3_5 nests a text model under
# ``language_model``; qwen3_next does not).


def keep_leading_space(detokenizer) -> None:
    """Upstream's SPM and BPE streaming detokenizers drop the first token's
    leading space (right for a chat answer, wrong for a completion that
    continues its prompt: "is" + " Paris"): they trim only while their text
    is empty, so it starts with a mark that ``last_segment`` never returns.
    A detokenizer that decodes whole (its ``text`` a property) trims nothing."""
    if isinstance(getattr(type(detokenizer), "text", None), property):
        return
    detokenizer.text, detokenizer.offset = "\x00", 1


def text_model(model) -> nn.Module:
    """The module holding ``args``, ``model`` (embeddings, layers, final norm)
    and ``lm_head``: the language model of a vision-language wrapper."""
    return getattr(model, "language_model", model)


def text_args(model):
    """The text model's arguments (a dataclass)."""
    return text_model(model).args


def token_embedding(model) -> nn.Module:
    return text_model(model).model.embed_tokens


def output_projection(model) -> Callable[[mx.array], mx.array]:
    """Final hidden states (after the final norm) -> logits, as the model's own call."""
    text = text_model(model)
    if getattr(text.args, "tie_word_embeddings", False):
        return text.model.embed_tokens.as_linear
    return text.lm_head


def model_module(config: dict) -> Optional[str]:
    """The mlx-lm module that builds a checkpoint of this ``config`` (its
    ``model_type``, remapped as upstream remaps it), or None: no family
    this mlx-lm knows."""
    from mlx_lm.utils import _get_classes

    try:
        model_class, _ = _get_classes(config)
    except (ValueError, KeyError):
        return None
    return model_class.__module__


def keeps_dtype(model) -> Callable[[str], bool]:
    """Which parameter paths the family keeps in their own dtype when a
    conversion casts the rest (its ``cast_predicate``: GLM-4.5 and
    DeepSeek-V3 keep ``e_score_correction_bias`` in float32)."""
    cast = getattr(text_model(model), "cast_predicate", None) or getattr(
        model, "cast_predicate", None)
    return (lambda path: False) if cast is None else (lambda path: not cast(path))


def full_attention_layer(model, args, layer_idx: int = 0) -> nn.Module:
    """A new decoder layer of the model's own class, full attention (the
    class of its first full-attention layer, built with ``args``)."""
    layers = text_model(model).model.layers
    cls = next((type(l) for l in layers if not getattr(l, "is_linear", False)), None)
    if cls is None:
        raise ValueError(f"{type(model).__module__} has no full-attention decoder layer")
    return cls(args, layer_idx)


def sanitized_layer(model, weights: dict) -> dict:
    """One decoder layer's checkpoint tensors (names inside the layer) as
    the model's own ``sanitize`` turns its layers' (experts stacked, fp8
    dequantized, DeepSeek's ``kv_b_proj`` split): passed through it as
    layer 0's."""
    prefix = "model.layers.0."
    out = model.sanitize({prefix + k: v for k, v in weights.items()})
    return {k[len(prefix):]: v for k, v in out.items() if k.startswith(prefix)}


def attention(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """The layer cache's own attention where it answers (ours for short
    passes on CUDA: ``kv/unfused.py``), else upstream's (quantized too)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    own = getattr(cache, "own_attention", None)
    if own is not None and sinks is None:
        out = own(queries, keys, values, scale, mask)
        if out is not None:
            return out
    return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                        mask=mask, sinks=sinks)


def rope(dims: int, base: float, traditional: bool, scaling: Optional[dict],
         max_position_embeddings: Optional[int]) -> nn.Module:
    """The RoPE module upstream's models build for a config (scaling included)."""
    from mlx_lm.models.rope_utils import initialize_rope

    return initialize_rope(dims, base, traditional, scaling, max_position_embeddings)


def attention_mask(h: mx.array, cache) -> Optional[mx.array]:
    """The causal mask upstream's models build for ``h`` over ``cache``, as
    an array: DeepSeek-V3's MLA layer applies it itself (``mx.where``), and
    a head's batched caches give arrays anyway (only a plain ``KVCache``, a
    head's probe, would give ``"causal"``)."""
    from mlx_lm.models.base import create_attention_mask

    return create_attention_mask(h, cache, return_array=True)
