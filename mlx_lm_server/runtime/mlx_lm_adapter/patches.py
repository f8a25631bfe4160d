"""What changes how upstream's classes behave, in place: a generation
batch's one-token step replaced by the engine's (``install_generation_step``),
a layer cache's say in its attention (``attend_through_caches``),
the prompt cache trie's search (``linear_search``), and the target's hidden
states captured from its passes and its prompts' prefill (``capture_hidden``:
its decoder modules' classes swapped, ``PromptProcessingBatch.prompt`` and
``GenerationBatch.__init__`` wrapped once per process)."""

from __future__ import annotations

import sys
import threading
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import LRUPromptCache, PromptTrie, PromptTrieResult

from .accessors import attention, text_model


def install_generation_step(gen: BatchGenerator, step) -> None:
    """Make ``gen.next()`` decode with ``step(batch)`` instead of ``batch.next()``."""
    batch = gen._generation_batch
    batch.next = lambda: step(batch)


# ---- a layer cache's say in its attention ---------------------------------------


def attend_through_caches(model) -> None:
    """Every module of ``model`` that calls upstream's
    ``scaled_dot_product_attention`` by name (its families import it from
    ``mlx_lm.models.base``) calls ``attention`` instead: the layer cache's
    own attention where it answers (ours do for short passes on CUDA, see
    ``kv/unfused.py``), upstream's otherwise, unchanged. Once per module,
    for every model of the process."""
    from mlx_lm.models import base

    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = attention


# ---- the prompt cache's trie ---------------------------------------------------


class LinearSearchTrie(PromptTrie):
    """Upstream's token trie, its ``search`` linear in the nodes it visits.

    Upstream looks for the nearest longer entry depth first, copying the
    path walked so far at every node: a prompt that leaves a long stored
    entry after a few tokens (a new conversation, which shares only
    ``<|im_start|>system``) costs the square of the entry's length, on
    the inference thread, every stream waiting (on this 2-core CPU 0.8 s
    for a 21.5k-token entry, 3.1 s for 40k; 0.02 and 0.06 s here). Here
    the walk is upstream's, and the nearest longer entry is found depth
    first along one shared path, each node visited once: the same answers
    (on a tie, possibly another entry of the same length)."""

    def search(self, model, tokens) -> PromptTrieResult:
        node = self._trie.get(model)
        if node is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and "__value__" in node:
            return PromptTrieResult(model, [], None, None, 0)
        index, last = 0, -1  # tokens matched; the last one ending an entry
        while index < len(tokens) and tokens[index] in node:
            node = node[tokens[index]]
            if "__value__" in node:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = tokens[:index] + _to_nearest_entry(node) if index > 0 else None
        return PromptTrieResult(model, None, shorter, longer, index)


def _to_nearest_entry(node: dict) -> list:
    """The tokens from ``node`` down to the nearest node that ends an entry:
    depth first along one shared path, each node visited once, none at or
    below the depth of the nearest found so far."""
    nearest, path = None, []
    stack = [(node, 0, None)]  # (a node, its depth, the token that leads to it)
    while stack:
        n, depth, token = stack.pop()
        if depth:
            del path[depth - 1:]
            path.append(token)
        if nearest is not None and depth >= len(nearest):
            continue
        if "__value__" in n:
            nearest = list(path)
            continue
        stack.extend((child, depth + 1, t) for t, child in n.items())
    return nearest or []


def linear_search(lru: LRUPromptCache) -> LRUPromptCache:
    """``lru`` (empty) looking its entries up through ``LinearSearchTrie``."""
    if not isinstance(getattr(lru, "_trie", None), PromptTrie) or len(lru):
        raise TypeError("LRUPromptCache no longer keeps an empty PromptTrie in _trie: "
                        "see LinearSearchTrie")
    lru._trie = LinearSearchTrie()
    return lru


class HiddenCapture:
    """The target's features from its last pass: the final hidden states
    (after the final norm) or the outputs of some decoder layers,
    concatenated: what learned drafters draft from.

    ``on_prefill(uids, features [B, T, F], lengths)``, when set, also
    receives the features of the prompts mlx-lm's batch generator prefills
    (its ``PromptProcessingBatch.prompt``) and of the prompt's last token,
    which its ``GenerationBatch`` feeds as a row joins: row i's first
    ``lengths[i]`` positions, in order.

    What a pass leaves is kept per thread: each generator runs its passes on
    its own thread, and two generators on one model (a benchmark's plain and
    speculative servers side by side) must not read each other's."""

    def __init__(self, slots: int):
        self.layers: Optional[list] = None  # None: the final hidden state
        self.slots = slots
        self.on_prefill: Optional[Callable] = None
        self._local = threading.local()

    @property
    def outputs(self) -> list:
        if not hasattr(self._local, "outputs"):
            self._local.outputs = [None] * self.slots
        return self._local.outputs

    @property
    def log(self) -> Optional[list]:
        """Every call's outputs, per slot, while this thread prefills (else None)."""
        return getattr(self._local, "log", None)

    @log.setter
    def log(self, value: Optional[list]) -> None:
        self._local.log = value

    def record(self, slot: int, out: mx.array) -> None:
        self.outputs[slot] = out
        if self.log is not None:
            self.log[slot].append(out)

    def take(self) -> Optional[mx.array]:
        """[B, T, F] of this thread's last pass (lazy: computed with its
        logits), once; None if the pass left none (a capture of other layers
        replaced it)."""
        out = self.outputs
        self._local.outputs = [None] * self.slots
        if any(o is None for o in out):
            return None
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)


def capture_hidden(model, layers: Optional[Sequence[int]] = None) -> HiddenCapture:
    """Make every pass of ``model`` leave its features in the returned
    capture, at the cost of one reference per module and pass: the final
    hidden states (``layers`` None: the inner text model's output) or the
    outputs of the decoder layers ``layers`` (0-based), in that order. Each
    such module's instance gets a subclass whose call keeps its output
    (weights, parameter names and outputs unchanged). Installed only for
    proposers that read hidden states, so others keep today's cost."""
    inner = text_model(model).model
    layers = None if layers is None else list(layers)
    existing = getattr(model, "_hidden_capture", None)
    if existing is not None and existing.layers == layers:
        return existing  # another engine on the same model: one capture serves both
    modules = [inner] if layers is None else [inner.layers[i] for i in layers]
    _restore_classes(inner)  # a capture of other layers goes
    capture = HiddenCapture(len(modules))
    capture.layers = layers
    for slot, module in enumerate(modules):
        cls = type(module)

        def __call__(self, *args, _cls=cls, _slot=slot, **kwargs):
            out = _cls.__call__(self, *args, **kwargs)
            capture.record(_slot, out)
            return out

        module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__,
                                                       "_captures_output": True})
    # A plain attribute (not a parameter): the capture lives as long as the model.
    object.__setattr__(model, "_hidden_capture", capture)
    _install_prefill_hooks()
    return capture


def release_capture(model) -> None:
    """Undo ``capture_hidden``: the modules' own classes, no capture."""
    _restore_classes(text_model(model).model)
    model.__dict__.pop("_hidden_capture", None)


def _restore_classes(inner) -> None:
    for module in [inner, *inner.layers]:
        if getattr(type(module), "_captures_output", False):
            module.__class__ = type(module).__bases__[0]


_PREFILL_HOOKS: list = []


def _install_prefill_hooks() -> None:
    """Route the features of mlx-lm's prompt processing to the model's
    capture (see ``HiddenCapture.on_prefill``); a model without one pays an
    attribute lookup per prefill call."""
    if _PREFILL_HOOKS:
        return
    from mlx_lm.generate import PromptProcessingBatch

    prompt, init = PromptProcessingBatch.prompt, GenerationBatch.__init__

    def prompt_with_features(self, tokens):
        capture = getattr(self.model, "_hidden_capture", None)
        if capture is None or capture.on_prefill is None or not tokens:
            return prompt(self, tokens)
        uids, lengths = list(self.uids), [len(t) for t in tokens]
        capture.log = [[] for _ in range(capture.slots)]
        try:
            prompt(self, tokens)
            calls = capture.log
        finally:
            capture.log = None
        per_slot = [mx.concatenate(c, axis=1) if len(c) > 1 else c[0] for c in calls if c]
        if len(per_slot) == capture.slots:
            features = per_slot[0] if len(per_slot) == 1 else mx.concatenate(per_slot, axis=-1)
            capture.on_prefill(uids, features, lengths)

    def init_with_features(self, model, uids, *args, **kwargs):
        init(self, model, uids, *args, **kwargs)
        capture = getattr(model, "_hidden_capture", None)
        if capture is not None and capture.on_prefill is not None and self.uids:
            features = capture.take()  # the prompt's last token, fed as the rows joined
            if features is not None:
                capture.on_prefill(list(self.uids), features, [1] * len(self.uids))

    PromptProcessingBatch.prompt = prompt_with_features
    GenerationBatch.__init__ = init_with_features
    _PREFILL_HOOKS.append((prompt, init))
