"""Where ``--model`` comes from (a local folder, or a Hugging Face repo id),
what its folder says about it (the context length), and the chat template
``--chat-template`` gives it.

A repo id (``mlx-community/Qwen3-4B-4bit``) is resolved as upstream
``mlx_lm`` resolves it (the same file patterns): from the local hub cache
first, then by downloading where the network and ``HF_HUB_OFFLINE`` allow.
The repo id becomes the served model name unless ``--served-model-name``
says otherwise, as upstream ``mlx_lm.server`` names it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(spec: str) -> bool:
    """ORG/NAME as the hub spells them: never a path that climbs (``..``),
    starts at a root or a home, or is one dot."""
    return (bool(_REPO_ID.match(spec)) and not spec.startswith((".", "/", "~"))
            and ".." not in spec and not spec.endswith("/."))


def resolve_model(spec: str, cache_dir: Optional[str] = None) -> tuple[Path, Optional[str]]:
    """``(folder, repo id or None)`` for a ``--model`` value; raises
    ``ValueError`` saying where it looked."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path, None
    if not is_repo_id(spec):
        raise ValueError(f"{spec!r} is neither a model folder nor a Hugging Face repo id "
                         "(ORG/NAME). Fetch a folder with `mlx-lm-server-models fetch "
                         "smollm2-135m-instruct`.")
    return hub_folder(spec, cache_dir), spec


def hub_folder(repo_id: str, cache_dir: Optional[str] = None) -> Path:
    """A repo id's snapshot: from the hub cache, else downloaded (unless
    ``HF_HUB_OFFLINE``); raises ``ValueError`` saying where it looked."""
    from huggingface_hub import constants, snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                      cache_dir=cache, local_files_only=True))
    except Exception as cached_error:  # not in the cache (or incomplete there)
        if constants.HF_HUB_OFFLINE:
            raise ValueError(f"{repo_id!r} is not a folder and not in the Hugging Face hub "
                             f"cache {cache} (HF_HUB_OFFLINE is set, so nothing was "
                             f"downloaded): {cached_error}") from None
    try:
        folder = snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                   cache_dir=cache)
    except Exception as e:
        raise ValueError(f"{repo_id!r} is not a folder, not in the Hugging Face hub cache "
                         f"{cache}, and could not be downloaded: {type(e).__name__}: "
                         f"{e}") from None
    return Path(folder)


def context_length(folder) -> Optional[int]:
    """The model's context length from its ``config.json`` (None when unknown)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    value = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    return int(value) if value else None


# What --use-default-chat-template gives a model without a template where the
# tokenizer has no default of its own: the ChatML template transformers used
# as its default until it dropped defaults (mlx_lm.server reads that default).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_template_text(spec: str) -> str:
    """``--chat-template``: the text of the file it names, else the template
    itself. Raises ``ValueError`` for neither (a mistyped file name)."""
    path = Path(spec).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template too long to be a file name
        pass
    if "{{" not in spec and "{%" not in spec:
        raise ValueError(f"--chat-template {spec!r} is neither a file nor a Jinja template")
    return spec


def check_adapter_path(path: str) -> None:
    """``--adapter-path`` must be a folder of mlx-lm adapters; raises ``ValueError``."""
    if not (Path(path).expanduser() / "adapter_config.json").is_file():
        raise ValueError(f"--adapter-path {path!r} is not a folder holding adapter_config.json "
                         "(and adapters.safetensors), as mlx_lm.lora writes them")
