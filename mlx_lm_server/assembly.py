"""The one place the server's pieces are built and handed to each other:
model and tokenizer, a vision-language model's vision tower, the speculative
engine, the running batch, the KV budget, the grammar tokenizer, the scheduler (with whoever hears of a
finished request and of a tensor-parallel breakdown), the metrics and the
service the routes use."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Optional

import mlx.core as mx

from .config import ServerConfig
from .decoding.structured import GrammarTokenizer, logits_width
from .http.prometheus import ServerMetrics
from .http.service import Service
from .models.source import CHATML_TEMPLATE, chat_template_text, context_length
from .parallel.distributed import SOLO
from .runtime import mlx_lm_adapter
from .serving.batch import RunningBatch
from .serving.memory import make_kv_budget
from .serving.scheduler import Scheduler
from .serving.traffic import TrafficRecorder

log = logging.getLogger("mlx_lm_server")


def make_scheduler(
    model,
    tokenizer,
    *,
    max_batch_size: int = 32,
    prefill_batch_size: int = 8,
    prefill_step_size: int = 2048,
    max_queued_requests: int = 256,
    engine=None,
    prompt_cache=None,
    grammar_tokenizer: Optional[GrammarTokenizer] = None,
    link=SOLO,
    max_kv_memory: Optional[int] = 0,
    on_finish: Optional[Callable] = None,
    recorder=None,
    on_fatal: Optional[Callable[[str], None]] = None,
    log_interval_s: float = 10.0,
    vision=None,
) -> Scheduler:
    """A scheduler over a running batch of ``model``, with its collaborators:
    the grammar tokenizer (given, or built for this vocabulary), the KV
    budget (``max_kv_memory`` bytes, None: a share of the device, 0: none)."""
    grammar_tokenizer = grammar_tokenizer or GrammarTokenizer(
        tokenizer, logits_width(model, tokenizer))
    batch = RunningBatch(
        model, tokenizer, max_batch_size=max_batch_size,
        prefill_batch_size=prefill_batch_size, prefill_step_size=prefill_step_size,
        engine=engine, prompt_cache=prompt_cache, grammar_tokenizer=grammar_tokenizer,
        vision=vision)
    budget = None if max_kv_memory == 0 else make_kv_budget(
        model, max_kv_memory, prefill_step_size, engine, announce=link.leader)
    return Scheduler(batch, max_queued_requests=max_queued_requests, budget=budget,
                     on_finish=on_finish, recorder=recorder, link=link, on_fatal=on_fatal,
                     log_interval_s=log_interval_s)


# Bytes of weights read per step of a staged load (``load_service_in_steps``).
LOAD_CHUNK_BYTES = 64 << 20


def load_service_in_steps(config: ServerConfig):
    """``load_service`` for a model of a set, as a generator that yields
    between stages (the model built lazily, its weights read LOAD_CHUNK_BYTES
    at a time, the rest), so that the one inference thread steps the other
    models in between; returns the service. A model loaded this way prices
    its steps online rather than by a start-up calibration, which would
    pause the others for its seconds. The tokenizer (a second of a big
    vocabulary's files, no MLX) loads on a thread of its own meanwhile."""
    from concurrent.futures import ThreadPoolExecutor, wait

    from mlx.utils import tree_flatten

    template = chat_template_text(config.chat_template) if config.chat_template else None
    model, model_config = mlx_lm_adapter.load_model_lazily(
        config.model, config.adapter_path, config.trust_remote_code)
    pool = ThreadPoolExecutor(1, thread_name_prefix="load-tokenizer")
    tokenizer = pool.submit(mlx_lm_adapter.load_tokenizer, config.model,
                            {"chat_template": template} if template is not None else None,
                            model_config)
    pool.shutdown(wait=False)
    yield
    chunk, size = [], 0
    for _, weight in tree_flatten(model.parameters()):
        chunk.append(weight)
        size += weight.nbytes
        if size >= LOAD_CHUNK_BYTES:
            mx.eval(chunk)
            chunk, size = [], 0
            yield
    mx.eval(chunk)
    yield
    while not tokenizer.done():
        wait([tokenizer], timeout=0.02)
        yield
    tokenizer = tokenizer.result()
    spec = replace(config.spec, calibration_seconds=0)
    return load_service(replace(config, spec=spec), preloaded=(model, tokenizer))


def load_service(config: ServerConfig, link=None, preloaded=None,
                 on_fatal: Optional[Callable[[str], None]] = None) -> Service:
    """Model, engine and scheduler for ``config``; in tensor parallel
    (``link`` over more than one rank) this rank's shard of the model, and
    ``on_fatal`` called with the reason if the ranks break down;
    ``preloaded``: (model, tokenizer) already loaded for it."""
    from mlx_lm import load

    from .kv.quantized import quantize_kv_caches
    from .parallel.distributed import load_pipelined, load_sharded
    from .serving.prompt_cache import PromptCache
    from .spec_decode import make_engine
    from .vision.tower import ImageSupport, VisionTower

    link = link or SOLO
    template = chat_template_text(config.chat_template) if config.chat_template else None
    if preloaded is not None:
        model, tokenizer = preloaded
    elif link.size > 1:
        if config.adapter_path:
            raise ValueError("--adapter-path cannot be used under tensor parallel "
                             "(nor can it in mlx_lm.server)")
        split = load_pipelined if config.pipeline else load_sharded
        model, tokenizer = split(config.model, link.group)
        if template is not None:
            tokenizer.chat_template = template
    else:
        # As mlx_lm.server loads it: adapters, template and remote code by load's arguments.
        model, tokenizer = load(
            config.model, adapter_path=config.adapter_path,
            tokenizer_config={"chat_template": template} if template is not None else None,
            trust_remote_code=config.trust_remote_code)
    if config.use_default_chat_template and tokenizer.chat_template is None:
        default = getattr(tokenizer, "default_chat_template", None)
        tokenizer.chat_template = default or CHATML_TEMPLATE
    if config.kv_bits is not None:  # before anything makes the model's caches
        quantize_kv_caches(model, config.kv_bits, config.kv_group_size, check=link.size == 1)
        log.info("KV caches quantized to %d bits in groups of %d, batched, from the first token "
                 "(mlx_lm.server switches a sequence over at --quantized-kv-start, here %d)",
                 config.kv_bits, config.kv_group_size, config.quantized_kv_start)
    if link.size > 1:
        vision, images = None, ImageSupport(False, f"model {config.model_id!r} takes no images "
                                                   "under tensor or pipeline parallel")
    else:
        vision, images = VisionTower.load(config.model, config.model_id, model)
    grammar_tokenizer = GrammarTokenizer(tokenizer, logits_width(model, tokenizer))
    metrics = ServerMetrics()
    scheduler = make_scheduler(
        model, tokenizer, max_batch_size=config.max_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        prefill_step_size=config.prefill_step_size,
        max_queued_requests=config.max_queued_requests,
        engine=make_engine(model, config.spec, tokenizer, config.model, link=link),
        prompt_cache=PromptCache.for_server(config, model, link),
        grammar_tokenizer=grammar_tokenizer,
        link=link,
        max_kv_memory=config.max_kv_memory,
        on_finish=metrics.observe_finished,
        recorder=TrafficRecorder(config.record_traffic, config.record_traffic_bytes)
        if config.record_traffic and link.leader else None,
        on_fatal=on_fatal,
        vision=vision,
    )
    if config.record_traffic and link.leader:
        log.warning("recording every finished request's prompt and output token ids in %s "
                    "(--record-traffic): they decode to what users sent", config.record_traffic)
    return Service(config, tokenizer, scheduler, context_length(config.model),
                   grammar_tokenizer=grammar_tokenizer, budget=scheduler.budget,
                   metrics=metrics.watch(scheduler), vision=vision, images=images)
