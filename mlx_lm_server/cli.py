"""``mlx-lm-server``'s command line: every flag, its help, and the typed config it builds."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from typing import Optional

from .config import LOG_LEVELS, SamplingDefaults, ServerConfig, read_models_file
from .spec_decode.config import MODES, VERIFY_MODES, SpecDecodeConfig
from .spec_decode.proposer import PROPOSERS, TEXT

# Where the API key comes from when --api-key is not given.
API_KEY_ENV = "MLX_LM_SERVER_API_KEY"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults appended, except where the help says its own or there is none."""

    def _get_help_string(self, action):
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d = ServerConfig(model="")
    parser = argparse.ArgumentParser(
        prog="mlx-lm-server",
        description=(
            "OpenAI-compatible server for MLX language models with continuous batching. "
            "Point any OpenAI client at http://HOST:PORT/v1."
        ),
        epilog=(
            "Tensor parallel: started under `mlx.launch` (or with MLX_RANK and MLX_HOSTFILE "
            "set), every rank loads its shard of --model and rank 0 alone listens; e.g. "
            "`mlx.launch -n 2 --backend ring -- .venv/bin/mlx-lm-server --model M`. "
            "Speculation stays on: rank 0 drafts and shares its drafts with the others."
        ),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--model", action="append", default=None,
                        help="MLX model folder (e.g. from `mlx-lm-server-models fetch NAME`) "
                             "or Hugging Face repo id; repeat it to serve several models, "
                             "chosen by each request's `model` (the first is the default)")
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as `model` for the first --model (default: "
                             "the folder's name)")
    parser.add_argument("--models-file", default=None, metavar="FILE",
                        help="more models to serve, each with its own settings: a TOML file "
                             "of [[model]] tables (path, name, aliases, adapter_path, "
                             "chat_template, spec_decode, draft_model, kv_bits, "
                             "prompt_cache_size, temperature, ...; see docs/serving.md), or "
                             "the same as JSON; the command line's flags are every model's "
                             "defaults")
    parser.add_argument("--max-loaded-models", type=int, default=d.max_loaded_models,
                        help="with several models: most of them loaded at once; a request "
                             "for another loads it and unloads the least recently used idle "
                             "one")
    parser.add_argument("--models-memory", type=_size, default=None, metavar="BYTES",
                        help="with several models: most memory the loaded models' weights "
                             "(their files' size) and KV budgets may take together, with a "
                             "K, M or G suffix (default: 75%% of the device's memory, or of "
                             "available RAM on a CPU); a model without its own "
                             "max_kv_memory gets its share (this / --max-loaded-models) less "
                             "its weights; a model that never fits is refused with a 503 "
                             "naming its size, one that does not fit now unloads idle ones "
                             "first")
    parser.add_argument("--allow-any-model", action="store_true",
                        help="a request may name a model outside the served ones by its "
                             "Hugging Face repo id (ORG/NAME): it loads from the hub cache, "
                             "or is downloaded unless HF_HUB_OFFLINE is set, with the command "
                             "line's settings (mlx_lm.server's behaviour); never a path")
    parser.add_argument("--keep-alive", type=float, default=None, metavar="SECONDS",
                        help="with several models: unload a model idle this long (default: "
                             "keep it until another needs the room)")
    parser.add_argument("--host", default=d.host, help="address to listen on")
    parser.add_argument("--port", type=int, default=d.port, help="port to listen on")
    parser.add_argument("--max-batch-size", "--decode-concurrency", type=int,
                        default=d.max_batch_size, dest="max_batch_size",
                        help="most sequences decoded together in one step")
    parser.add_argument("--prefill-batch-size", "--prompt-concurrency", type=int,
                        default=d.prefill_batch_size, dest="prefill_batch_size",
                        help="most prompts prefilled together")
    parser.add_argument("--prefill-step-size", type=int, default=d.prefill_step_size,
                        help="prompt tokens processed per prefill step; long prompts are "
                             "chunked so decoding of other requests keeps going")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="completion length when a request gives no max_tokens")
    parser.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                        help="requests waiting for their first token beyond which new "
                             "ones get HTTP 429")
    parser.add_argument("--prompt-cache-size", type=int, default=d.prompt_cache_size,
                        help="finished requests whose caches are kept, so that a later "
                             "prompt sharing a prefix with one (the next turn of a chat, an "
                             "agent's next call) prefills only the rest (0: off)")
    parser.add_argument("--prompt-cache-bytes", type=_size, default=d.prompt_cache_bytes,
                        help="most memory those caches may hold, in bytes or with a K, M "
                             "or G suffix; the least recently used go first")
    parser.add_argument("--prompt-cache-dir", default=None, metavar="DIR",
                        help="also write those caches to files in DIR (made if missing), so "
                             "that a prompt whose prefix is there but not in memory (after a "
                             "restart, or an eviction) reads it back instead of prefilling "
                             "it; each model and configuration has its own entries; several "
                             "servers may share DIR. Off by default")
    parser.add_argument("--prompt-cache-disk-bytes", type=_size,
                        default=d.prompt_cache_disk_bytes, metavar="BYTES",
                        help="--prompt-cache-dir: most its files may hold together, with a "
                             "K, M or G suffix; the least recently used go first")
    parser.add_argument("--max-kv-memory", type=_budget, default=None, metavar="BYTES",
                        help="most memory the KV caches may take, in bytes or with a K, M or G "
                             "suffix: each request reserves what its prompt + max_tokens can "
                             "grow to; one that does not fit now waits, one that never can is "
                             "refused (HTTP 400); the prompt cache counts too and goes first "
                             "(default: 75%% of the GPU memory left after the weights, 50%% of "
                             "available RAM on the CPU; 0 or none: no budget)")
    parser.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, type=str.lower,
                        help="either case (mlx_lm.server spells them in capitals)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="require this key on every route but /health: clients send "
                             "`Authorization: Bearer KEY` (OpenAI clients: api_key=KEY) or "
                             "`x-api-key: KEY` (Anthropic clients); anything else gets HTTP 401. "
                             f"When the flag is absent, the {API_KEY_ENV} environment variable "
                             "gives the key (it keeps the key out of the process list); "
                             "without either, no key is asked for")
    parser.add_argument("--distributed-timeout", type=float, default=d.distributed_timeout,
                        help="tensor parallel (started with mlx.launch): seconds without a "
                             "heartbeat from another rank before it is taken for gone and every "
                             "rank exits with status 1 (where rank 0's address is not in "
                             "MLX_HOSTFILE: seconds one step may take)")
    parser.add_argument("--pipeline", action="store_true",
                        help="under mlx.launch, split the model by layers over the ranks "
                             "(pipeline parallel: each rank holds consecutive layers, a "
                             "forward passes from rank to rank) instead of sharding every "
                             "layer (tensor parallel); for links too slow for tensor parallel "
                             "or head counts that do not divide. Needs a model class with a "
                             "pipeline split in mlx-lm (qwen2 has one, llama not); nothing to "
                             "split on one process")
    parser.add_argument("--record-traffic", default=None, metavar="DIR",
                        help="keep every finished request's prompt and output token ids in "
                             "DIR (JSON lines, rotated), to train a drafter on with "
                             "mlx-lm-server-drafter train --data DIR/*.jsonl. The ids decode "
                             "to what users sent: treat DIR as their prompts. Off by default")
    parser.add_argument("--record-traffic-max-mb", type=float,
                        default=d.record_traffic_bytes / (1 << 20), metavar="MB",
                        help="--record-traffic: the most the recorded files may hold; the "
                             "oldest files go first")

    parser.add_argument("--allowed-origins", type=_origins, default=",".join(d.allowed_origins),
                        help="comma-separated origins whose browser pages may call the API "
                             "(CORS headers and preflight answers); * for any, '' for none")
    _add_model_arguments(parser)
    _add_spec_arguments(parser, d.spec)
    _add_kv_cache_arguments(parser, d)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group(
        "Model, chat template and sampling defaults",
        "As mlx_lm.server's flags of the same names.",
    )
    model.add_argument("--adapter-path", default=None,
                       help="folder of LoRA (or DoRA) adapters trained with mlx_lm.lora "
                            "(adapter_config.json, adapters.safetensors), applied to --model "
                            "as it loads")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="let a model folder's own Python file (config.json's model_file) "
                            "build the model")
    model.add_argument("--chat-template", default="",
                       help="a Jinja chat template, or a file holding one, used instead of "
                            "the model's")
    model.add_argument("--use-default-chat-template", action="store_true",
                       help="give a model without a chat template the ChatML one")
    model.add_argument("--chat-template-args", type=_json_object, default={},
                       metavar="JSON",
                       help="arguments for the chat template of every request, e.g. "
                            "'{\"enable_thinking\": false}'; a request's own "
                            "chat_template_kwargs override them key by key")
    for flag, kind, field, upstream in (("--temp", float, "temperature", 0.0),
                                        ("--top-p", float, "top_p", 1.0),
                                        ("--top-k", int, "top_k", 0),
                                        ("--min-p", float, "min_p", 0.0)):
        model.add_argument(flag, type=kind, default=None, dest=f"default_{field}",
                           metavar=flag[2:].upper().replace("-", "_"),
                           help=f"{field} for requests that give none (default: the API's "
                                f"default; mlx_lm.server's is {upstream})")


def _add_kv_cache_arguments(parser: argparse.ArgumentParser, d: ServerConfig) -> None:
    group = parser.add_argument_group(
        "Quantized KV cache",
        "mlx_lm.server's flags for quantized KV caches. Here batching stays on and "
        "speculation rolls quantized rows back exactly; entries are quantized from the "
        "first token.",
    )
    group.add_argument("--kv-bits", type=int, default=None,
                       help="bits per KV cache entry (4 or 8; also 2, 3, 5, 6); "
                            "default: full precision")
    group.add_argument("--kv-group-size", type=int, default=d.kv_group_size,
                       help="group size for --kv-bits")
    group.add_argument("--quantized-kv-start", type=int, default=d.quantized_kv_start,
                       help="mlx_lm.server's token position from which --kv-bits "
                            "quantizes; accepted, here every entry is quantized")


def _spec_decode_help() -> str:
    """--spec-decode's help, from the drafter kinds (spec_decode/proposer/__init__.py)."""
    kinds = ", ".join(f"{k.name} ({k.help})" for k in PROPOSERS.values())
    mixes = ", ".join(m for m in MODES if "," in m)
    lookups = " or ".join(k.name for k in PROPOSERS.values() if k.drafts_with == TEXT)
    return (f"proposer: auto (the default: ngram mixed per row with the drafter the model "
            "comes with: its MTP layer, a split MTP drafter beside it as NAME-mtp, or what "
            "--draft-model holds, told apart by its config; ngram alone without one; the "
            "start-up log says what it chose and why); none (plain decoding, no engine); "
            f"{kinds}; the mixes {mixes} ({lookups} for every row, the model for the rows "
            "where it keeps more tokens)")


def _add_spec_arguments(parser: argparse.ArgumentParser, s: SpecDecodeConfig) -> None:
    spec = parser.add_argument_group(
        "Speculative Decoding",
        "Draft several tokens per step and verify them in one forward pass, for every "
        "sequence of the batch. Lossless at temperature 0 (identical tokens) and at any "
        "temperature (same distribution) unless --spec-verify threshold is asked for.",
    )
    spec.add_argument("--spec-decode", choices=MODES, default="auto", metavar="MODE",
                      help=_spec_decode_help())
    spec.add_argument("--num-speculative-tokens", "--num-draft-tokens", type=int,
                      default=s.num_speculative_tokens, dest="num_speculative_tokens",
                      help="most draft tokens per sequence per step (k)")
    spec.add_argument("--spec-tree-width", type=int, default=s.tree_width,
                      help="trees of drafts: how many continuations a row's draft may branch "
                           "into, all verified in the same pass of k nodes (1: one chain; "
                           "n-gram and suffix drafts branch, and model drafters for greedy "
                           "requests; DFlash drafts chains); the server measures whether "
                           "trees or chains emit more and drafts those (every step trees "
                           "with --no-spec-decode-dynamic); output is unchanged either way")
    spec.add_argument("--spec-tree-budget", type=_auto_or_int, default=s.tree_budget,
                      metavar="N|auto",
                      help="draft nodes per row in a tree (with --spec-tree-width above 1): "
                           "auto (default) takes the controller's k, a chain's pass size; "
                           "N verifies trees of N nodes, larger than k where a pass over "
                           "more tokens costs little more (a GPU); chains keep k")
    spec.add_argument("--spec-decode-disable-batch-size", type=int, default=None,
                      help="decode without speculation when the batch has at least this "
                           "many sequences")
    spec.add_argument("--ngram-max", type=int, default=s.ngram_max,
                      help="longest suffix n-gram looked up")
    spec.add_argument("--ngram-min", type=int, default=s.ngram_min,
                      help="shortest suffix n-gram looked up")
    spec.add_argument("--no-ngram-prompt-lookup", action="store_true",
                      help="only match n-grams in generated text, not in the prompt")
    spec.add_argument("--suffix-cache-tokens", type=int, default=s.suffix_cache_tokens,
                      help="--spec-decode suffix: tokens of earlier requests' outputs kept "
                           "to draft from, oldest dropped first (0: each request drafts from "
                           "its own text only). Drafts never change outputs, but one "
                           "request's speed can depend on what others asked before")
    spec.add_argument("--suffix-index-prompts", action="store_true",
                      help="--spec-decode suffix: index earlier requests' prompts too")
    spec.add_argument("--draft-model", "--draft-model-path", default=None, dest="draft_model_path",
                      help="MLX folder the drafter reads: " + "; ".join(
                          f"with {k.name} modes, {k.folder}" for k in PROPOSERS.values()
                          if k.folder))
    spec.add_argument("--draft-model-quantize", type=_quantize_bits, default=None,
                      metavar="{4,8,4bit,8bit}", help="quantize the draft model after loading")
    spec.add_argument("--no-spec-decode-dynamic", action="store_true",
                      help="never switch speculation off by itself")
    spec.add_argument("--spec-decode-acceptance-threshold", type=float,
                      default=s.acceptance_threshold,
                      help="acceptance rate below which speculation is switched off")
    spec.add_argument("--no-adaptive-k", action="store_true",
                      help="always draft --num-speculative-tokens tokens")
    spec.add_argument("--spec-verify", choices=VERIFY_MODES,
                      default=s.verify_mode,
                      help="auto: exact match at temperature 0, rejection sampling above "
                           "(lossless); greedy: exact match only; threshold: also accept "
                           "drafts the target finds likely (LOSSY, changes outputs)")
    spec.add_argument("--spec-verify-threshold", type=float, default=s.verify_threshold,
                      help="target probability at which --spec-verify threshold accepts")
    spec.add_argument("--spec-calibration-seconds", type=float, default=s.calibration_seconds,
                      help="at start-up, compile and time the verification pass shapes per "
                           "batch size for at most this long (0: skip; the controller then "
                           "learns costs from served steps only)")


def _origins(text: str) -> tuple[str, ...]:
    """``*``, or comma-separated origins (``https://a.example,http://localhost:3000``)."""
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {text!r}")
    return value


def _quantize_bits(text: str) -> int:
    """``4``, ``8``, ``4bit`` or ``8bit`` (as mlx-lm's own flags spell them)."""
    value = text.lower().removesuffix("bit")
    if value not in ("4", "8"):
        raise argparse.ArgumentTypeError(f"must be 4, 8, 4bit or 8bit, not {text!r}")
    return int(value)


def _size(text: str) -> int:
    """Bytes: ``1073741824``, ``512M``, ``4G``."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M, 1000000)")


def _auto_or_int(text: str) -> Optional[int]:
    """``auto`` (None) or a whole number."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or a whole number, not {text!r}")


def _budget(text: str) -> int:
    """A size, or ``none`` (0: no budget)."""
    return 0 if text.strip().lower() == "none" else _size(text)


def config_from_args(args: argparse.Namespace, environ=os.environ) -> ServerConfig:
    """The server's settings; with several models (``--model`` repeated,
    ``--models-file``) the first model's, the others in ``models``."""
    paths = list(args.model or [])
    base = _base_config(args, environ, paths[0] if paths else "")
    others = [replace(base, model=p, served_model_name=None) for p in paths[1:]]
    if args.models_file:
        others += read_models_file(args.models_file, base)
    if not paths:
        if not others:
            raise ValueError("give --model (or --models-file)")
        base, others = others[0], others[1:]
    return replace(base, models=tuple(others), max_loaded_models=args.max_loaded_models,
                   keep_alive=args.keep_alive, models_memory=args.models_memory,
                   allow_any_model=args.allow_any_model)


def _base_config(args: argparse.Namespace, environ, model: str) -> ServerConfig:
    return ServerConfig(
        model=model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, max_batch_size=args.max_batch_size,
        prefill_batch_size=args.prefill_batch_size, prefill_step_size=args.prefill_step_size,
        max_tokens=args.max_tokens, max_queued_requests=args.max_queued_requests,
        log_level=args.log_level, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
        max_kv_memory=args.max_kv_memory,
        distributed_timeout=args.distributed_timeout,
        api_key=args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None,
        allowed_origins=args.allowed_origins, adapter_path=args.adapter_path,
        trust_remote_code=args.trust_remote_code, chat_template=args.chat_template or None,
        use_default_chat_template=args.use_default_chat_template,
        chat_template_args=args.chat_template_args,
        sampling_defaults=SamplingDefaults(
            temperature=args.default_temperature, top_p=args.default_top_p,
            top_k=args.default_top_k, min_p=args.default_min_p),
        kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start, pipeline=args.pipeline,
        record_traffic=args.record_traffic,
        record_traffic_bytes=int(args.record_traffic_max_mb * (1 << 20)),
        spec=SpecDecodeConfig(
            mode=args.spec_decode,
            num_speculative_tokens=args.num_speculative_tokens,
            ngram_min=args.ngram_min,
            ngram_max=args.ngram_max,
            tree_width=args.spec_tree_width,
            tree_budget=args.spec_tree_budget,
            prompt_lookup=not args.no_ngram_prompt_lookup,
            suffix_cache_tokens=args.suffix_cache_tokens,
            suffix_index_prompts=args.suffix_index_prompts,
            draft_model_path=args.draft_model_path,
            draft_model_quantize=args.draft_model_quantize,
            disable_by_batch_size=args.spec_decode_disable_batch_size,
            acceptance_threshold=args.spec_decode_acceptance_threshold,
            dynamic=not args.no_spec_decode_dynamic,
            adaptive_k=not args.no_adaptive_k,
            verify_mode=args.spec_verify,
            verify_threshold=args.spec_verify_threshold,
            calibration_seconds=args.spec_calibration_seconds,
        ),
    )
