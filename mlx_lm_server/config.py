"""Server configuration: one typed, validated place for every setting."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional

from .spec_decode.config import SpecDecodeConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Keys of a chat template's arguments the server sets itself.
RESERVED_TEMPLATE_KEYS = frozenset(
    {"messages", "conversation", "tokenize", "add_generation_prompt", "tools"})

# mlx_lm.server's --kv-group-size and --quantized-kv-start defaults.
KV_BITS = (2, 3, 4, 5, 6, 8)  # what mx.quantize packs
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANTIZED_KV_START = 5000


@dataclass(frozen=True)
class SamplingDefaults:
    """Server-wide sampling values (``--temp``, ``--top-p``, ``--top-k``,
    ``--min-p``) for requests that omit the field; None: the API's default."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None

    def __post_init__(self):
        # The ranges a request may send.
        checks = {"temperature": ("--temp", 0.0, 2.0), "top_p": ("--top-p", 0.0, 1.0),
                  "min_p": ("--min-p", 0.0, 1.0)}
        for name, (flag, low, high) in checks.items():
            value = getattr(self, name)
            if value is not None and not low <= value <= high:
                raise ValueError(f"{flag} must be between {low:g} and {high:g}, got {value}")
        if self.top_p is not None and self.top_p == 0:
            raise ValueError("--top-p must be above 0 (1 keeps every token)")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"--top-k must be 0 (off) or more, got {self.top_k}")

    def given(self) -> dict[str, Any]:
        """The fields set on the command line."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ServerConfig:
    model: str
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 8080
    max_batch_size: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    max_tokens: int = 512
    max_queued_requests: int = 256
    log_level: str = "info"
    # Caches of finished requests kept for later prompts sharing a prefix.
    prompt_cache_size: int = 10
    prompt_cache_bytes: int = 4 << 30
    # A folder where those caches are also written, to serve after a restart
    # or an eviction from memory (None: off), its files at most
    # prompt_cache_disk_bytes together (every model's and server's using it).
    prompt_cache_dir: Optional[str] = None
    prompt_cache_disk_bytes: int = 16 << 30
    # Bytes the KV caches of admitted requests (worst case) and the prompt
    # cache may hold together; None: a share of the device's memory; 0: no budget.
    max_kv_memory: Optional[int] = None
    # Tensor parallel: a step (or an idle wait for rank 0's plan) longer than
    # this is taken as a rank that stopped answering; every rank then exits.
    distributed_timeout: float = 30.0
    # Clients must send it (Authorization: Bearer KEY, or x-api-key: KEY) on
    # every route but /health; None: no key asked for.
    api_key: Optional[str] = field(default=None, repr=False)
    # LoRA adapters applied to --model as it loads (mlx-lm's adapter folder).
    adapter_path: Optional[str] = None
    # Origins whose browsers may call the API (CORS); "*": any; empty: no CORS headers.
    allowed_origins: tuple[str, ...] = ("*",)
    # Let a model folder's own Python (config.json's model_file) build the model.
    trust_remote_code: bool = False
    # A Jinja chat template, or a file holding one, replacing the model's.
    chat_template: Optional[str] = None
    # A model without a chat template gets the ChatML one.
    use_default_chat_template: bool = False
    # Chat template arguments for every request; a request's own override them.
    chat_template_args: dict[str, Any] = field(default_factory=dict)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # Quantized KV caches, batched (kv/quantized.py): kv_bits bits
    # per entry in groups of kv_group_size, from the first token on (mlx-lm
    # starts at quantized_kv_start; accepted for its command line).
    kv_bits: Optional[int] = None
    kv_group_size: int = 64
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    # Under mlx.launch: split the model by layers (pipeline) instead of
    # sharding every layer (tensor parallel); nothing to split on one process.
    pipeline: bool = False
    # A folder where finished requests' prompt and output token ids are kept
    # (to train a drafter on), at most record_traffic_bytes of them; None: off.
    record_traffic: Optional[str] = None
    record_traffic_bytes: int = 1 << 30
    # Other names clients may pass as ``model`` for this one (a models file's aliases).
    aliases: tuple[str, ...] = ()
    # Several models in one server (``http/model_set.py``): the others
    # (this config is the first, the default), each with its own settings;
    # at most max_loaded_models loaded at once (least recently used
    # unloaded first), an idle one unloaded after keep_alive seconds (None: never).
    models: tuple["ServerConfig", ...] = ()
    max_loaded_models: int = 2
    keep_alive: Optional[float] = None
    # Bytes the loaded models' weights and KV budgets may take together (None:
    # only max_loaded_models bounds them).
    models_memory: Optional[int] = None
    # A request may name a model outside the set by its Hugging Face repo id
    # (loaded from the hub cache, or downloaded), as upstream mlx_lm.server
    # allows; never a path.
    allow_any_model: bool = False
    spec: SpecDecodeConfig = field(default_factory=SpecDecodeConfig)

    def __post_init__(self):
        positive = {
            "max_batch_size": "--max-batch-size",
            "prefill_batch_size": "--prefill-batch-size",
            "prefill_step_size": "--prefill-step-size",
            "max_tokens": "--max-tokens",
        }
        for name, flag in positive.items():
            if getattr(self, name) < 1:
                raise ValueError(f"{flag} must be at least 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(
                f"--max-queued-requests must be 0 or more, got {self.max_queued_requests}"
            )
        for name, flag in (("prompt_cache_size", "--prompt-cache-size"),
                           ("prompt_cache_bytes", "--prompt-cache-bytes"),
                           ("max_kv_memory", "--max-kv-memory")):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"{flag} must be 0 or more, got {getattr(self, name)}")
        if not self.distributed_timeout > 0:
            raise ValueError(f"--distributed-timeout must be above 0, got "
                             f"{self.distributed_timeout}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.api_key is not None and not _is_header_text(self.api_key):
            raise ValueError("--api-key must be printable ASCII without spaces, and not empty "
                             "(clients send it in an HTTP header)")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
        reserved = sorted(set(self.chat_template_args) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise ValueError(f"--chat-template-args cannot set {', '.join(reserved)}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise ValueError(f"--kv-group-size must be one of "
                             f"{', '.join(map(str, KV_GROUP_SIZES))}, got {self.kv_group_size}")
        if self.quantized_kv_start < 0:
            raise ValueError(f"--quantized-kv-start must be 0 or more, "
                             f"got {self.quantized_kv_start}")
        if self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, got "
                             f"{self.max_loaded_models}")
        if self.keep_alive is not None and not self.keep_alive > 0:
            raise ValueError(f"--keep-alive must be above 0 seconds, got {self.keep_alive}")
        names = [n for c in (self, *self.models) for n in (c.model_id, *c.aliases)]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"two models are served as {', '.join(map(repr, repeated))}: "
                             "give them different names (--served-model-name, or name in "
                             "the models file)")
        if self.record_traffic_bytes < 1 << 20:
            raise ValueError("--record-traffic-max-mb must be at least 1, got "
                             f"{self.record_traffic_bytes / (1 << 20):g}")
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            raise ValueError(f"--kv-bits must be one of {', '.join(map(str, KV_BITS))}, "
                             f"got {self.kv_bits}")
        if self.prompt_cache_disk_bytes < 1 << 20:
            raise ValueError("--prompt-cache-disk-bytes must be at least 1M, got "
                             f"{self.prompt_cache_disk_bytes}")
        if self.prompt_cache_dir is not None:
            if self.prompt_cache_size < 1:
                raise ValueError("--prompt-cache-dir needs the prompt cache in memory "
                                 "(--prompt-cache-size above 0)")
            problem = unwritable_folder(self.prompt_cache_dir)
            if problem:
                raise ValueError(f"--prompt-cache-dir {self.prompt_cache_dir}: {problem}")

    @property
    def all_models(self) -> tuple["ServerConfig", ...]:
        """Every served model's config, the default first."""
        return (replace(self, models=()), *self.models)

    @property
    def model_id(self) -> str:
        """The name clients pass as ``model``: ``--served-model-name`` or the folder name."""
        return self.served_model_name or Path(self.model.rstrip("/")).name


# What a models file's entry may set: its key, and the ServerConfig field (or
# SpecDecodeConfig field, "spec." + name) it sets for that model.
MODEL_KEYS = {
    "name": "served_model_name", "path": "model", "aliases": "aliases",
    "adapter_path": "adapter_path", "chat_template": "chat_template",
    "chat_template_args": "chat_template_args", "trust_remote_code": "trust_remote_code",
    "max_batch_size": "max_batch_size", "max_tokens": "max_tokens",
    "prompt_cache_size": "prompt_cache_size", "prompt_cache_bytes": "prompt_cache_bytes",
    "max_kv_memory": "max_kv_memory",
    "kv_bits": "kv_bits", "kv_group_size": "kv_group_size",
    "spec_decode": "spec.mode", "draft_model": "spec.draft_model_path",
    "num_speculative_tokens": "spec.num_speculative_tokens",
    "temperature": "sampling.temperature", "top_p": "sampling.top_p",
    "top_k": "sampling.top_k", "min_p": "sampling.min_p",
}


def read_models_file(path: str, base: ServerConfig) -> list[ServerConfig]:
    """The models a file names (TOML: ``[[model]]`` tables; or JSON: a list,
    or ``{"model": [...]}``), each the command line's settings (``base``)
    with the entry's own on top. Raises ``ValueError`` naming what is wrong."""
    text = Path(path).read_text()
    try:
        if path.endswith(".json"):
            import json

            data = json.loads(text)
        else:
            try:
                import tomllib
            except ImportError:  # Python 3.10
                raise ValueError(f"{path}: TOML needs Python 3.11; write the models file "
                                 "as JSON")
            data = tomllib.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    entries = data.get("model") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: no models (TOML: [[model]] tables with a path)")
    return [_model_entry(entry, base, f"{path}: model {i + 1}")
            for i, entry in enumerate(entries)]


def _model_entry(entry: Any, base: ServerConfig, where: str) -> ServerConfig:
    if not isinstance(entry, dict) or "path" not in entry:
        raise ValueError(f"{where}: needs a path")
    unknown = sorted(set(entry) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {', '.join(unknown)} (known: "
                         f"{', '.join(MODEL_KEYS)})")
    fields: dict[str, Any] = {"served_model_name": None, "aliases": ()}
    spec: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    for key, value in entry.items():
        target = MODEL_KEYS[key]
        if target.startswith("spec."):
            spec[target[5:]] = value
        elif target.startswith("sampling."):
            sampling[target[9:]] = value
        else:
            fields[target] = tuple(value) if key == "aliases" else value
    if "spec.mode" not in {MODEL_KEYS[k] for k in entry} and "draft_model" in entry:
        spec["mode"] = "auto"  # the drafter told apart by its folder
    try:
        if spec:
            fields["spec"] = replace(base.spec, **spec)
        if sampling:
            fields["sampling_defaults"] = replace(base.sampling_defaults, **sampling)
        return replace(base, models=(), **fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def unwritable_folder(folder: str) -> str:
    """Why ``folder`` cannot be made or written (its nearest existing part
    is looked at, nothing is created); "" when it can."""
    path = Path(folder).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return ""


def _is_header_text(key: str) -> bool:
    return bool(key) and all("!" <= c <= "~" for c in key)
