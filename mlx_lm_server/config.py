"""Server configuration: one typed, validated place for every setting."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from .spec_decode.config import SpecDecodeConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


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
    # Tensor parallel: a step (or an idle wait for rank 0's plan) longer than
    # this is taken as a rank that stopped answering; every rank then exits.
    distributed_timeout: float = 30.0
    # Clients must send it (Authorization: Bearer KEY, or x-api-key: KEY) on
    # every route but /health; None: no key asked for.
    api_key: Optional[str] = field(default=None, repr=False)
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
                           ("prompt_cache_bytes", "--prompt-cache-bytes")):
            if getattr(self, name) < 0:
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

    @property
    def model_id(self) -> str:
        """The name clients pass as ``model``: ``--served-model-name`` or the folder name."""
        return self.served_model_name or Path(self.model.rstrip("/")).name


def _is_header_text(key: str) -> bool:
    return bool(key) and all("!" <= c <= "~" for c in key)
