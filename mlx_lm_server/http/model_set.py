"""The models a server answers for, chosen by each request's ``model``.

One model (the usual case) is loaded at start and runs on an inference
thread of its own, as it always has. Several (``--model`` repeated,
``--models-file``) share one inference thread (``serving/device_loop.py``):
the default (the first) loads at start, any other on the first request that
names it, and at most ``--max-loaded-models`` stay loaded; making room
unloads the least recently used idle one, and ``--keep-alive`` unloads one
idle that long. Loading and unloading run on the inference thread, between
steps, so all MLX work stays there.

A busy model (a request of its queued, waiting for memory or running) is
never unloaded, neither to make room nor by ``--keep-alive``; nor is one a
request has just asked for (``RECENT_S``: its request may be about to
submit), and a model being loaded holds its room from the start. A request
for a model that finds no room beside these is a 503 (``models_busy``) to
retry.

Memory is one budget (``--models-memory``, by default the device share a
single model's weights and KV would reach): every model's weights and KV budget count
against it, and a model without its own ``max_kv_memory`` gets its share of
it (the budget / ``--max-loaded-models``) less its weights, so that the
loaded models' reservations never add up past it.

A name outside the set is a 404 listing the served names: requests choose
among the models the operator named, never a path. With
``--allow-any-model`` a request may also name a Hugging Face repo id, loaded
from the hub cache (or downloaded) with the default model's settings, as
upstream ``mlx_lm.server`` does.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from ..config import ServerConfig
from ..models.source import hub_folder, is_repo_id
from ..serving.device_loop import DeviceLoop
from ..serving.kv_budget import mib
from ..serving.memory import default_models_memory, release_idle_memory
from ..spec_decode.proposer import PROPOSERS, TEXT
from ..vision.tower import image_support
from .api_error import APIError
from .service import Service

log = logging.getLogger("mlx_lm_server")

# A model asked for this recently is not unloaded to make room (its request
# may be about to submit).
RECENT_S = 1.0
# Least KV budget a model of a set is given by default (less is a start-up error).
MIN_KV_BYTES = 64 << 20
# The proposers that fit any model, those drafting from text (a model named by
# a request gets these of the default model's --spec-decode, not its drafter).
ANY_MODEL_PROPOSERS = tuple(name for name, kind in PROPOSERS.items() if kind.drafts_with == TEXT)


def footprint(config: ServerConfig) -> int:
    """Bytes a model takes loaded, as known before loading it: its weights'
    files (and its draft model's) and its KV budget when one is given."""
    folders = [config.model] + ([config.spec.draft_model_path]
                                if config.spec.draft_model_path else [])
    weights = sum(p.stat().st_size for f in folders for p in Path(f).glob("*.safetensors"))
    return weights + (config.max_kv_memory or 0)


def with_kv_budget(config: ServerConfig, share: int) -> ServerConfig:
    """``config`` with a definite KV budget: its own, or ``share`` less its
    weights. Raises ``ValueError`` where the weights leave too little."""
    if config.max_kv_memory is not None:
        return config
    weights = footprint(config)
    room = share - weights
    if room < MIN_KV_BYTES:
        raise ValueError(
            f"model {config.model_id!r}: its weights ({mib(weights)}) leave "
            f"{mib(max(room, 0))} of its share of the models' memory ({mib(share)}) for KV "
            "caches; raise --models-memory, lower --max-loaded-models, or give it "
            "max_kv_memory in the models file")
    return replace(config, max_kv_memory=room)


def any_model_config(default: ServerConfig, repo_id: str, folder: Path) -> ServerConfig:
    """Settings for a model a request named (``--allow-any-model``): the
    default model's, less what belongs to that model (its name, aliases,
    adapter, template, drafter, KV budget)."""
    modes = [m for m in default.spec.mode.split(",") if m in ANY_MODEL_PROPOSERS]
    return replace(default, model=str(folder), served_model_name=repo_id, aliases=(),
                   adapter_path=None, chat_template=None, max_kv_memory=None, models=(),
                   spec=replace(default.spec, mode=",".join(modes) or "none",
                                draft_model_path=None))


class ModelSet:
    def __init__(self, config: ServerConfig, loader: Optional[Callable] = None,
                 first: Optional[Service] = None):
        """``config``: the server's (its ``all_models``); ``loader(config)``
        a generator that builds a model's service in steps and returns it
        (``assembly.load_service_in_steps``; None: the set is ``first``
        alone, on its own thread). Raises ``ValueError`` where the default
        model's weights leave no KV room in its share of the memory (another
        such model is refused to the requests that name it)."""
        self.config = config
        self.configs = {c.model_id: c for c in config.all_models}
        self.limit: Optional[int] = None  # None: one model, never unloaded
        self.unfit: dict[str, str] = {}  # models whose weights fill their share: why
        if loader is not None:
            self.limit, source = ((config.models_memory, "--models-memory")
                                  if config.models_memory else default_models_memory())
            share = self.limit // config.max_loaded_models
            for name, c in self.configs.items():
                try:
                    self.configs[name] = with_kv_budget(c, share)
                except ValueError as e:
                    if name == config.model_id:
                        raise  # the default loads now: a start-up error
                    self.unfit[name] = str(e)  # the error of the requests that name it
                    log.warning("%s", e)
            log.info("models' memory %s (%s), %s for each of at most %d loaded; KV budgets: %s",
                     mib(self.limit), source, mib(share), config.max_loaded_models,
                     ", ".join(f"{n} {mib(c.max_kv_memory)}" for n, c in self.configs.items()
                               if n not in self.unfit))
        self.names = {n: c.model_id for c in config.all_models for n in (c.model_id, c.model,
                                                                          *c.aliases)}
        self.default = config.model_id
        self.loader = loader
        self.services: dict[str, Service] = {}
        self.last_used: dict[str, float] = {}
        self._loading: dict[str, Future] = {}
        self._arriving: set[str] = set()  # being loaded (on the inference thread)
        self._lock = threading.Lock()
        self.loop: Optional[DeviceLoop] = None
        if loader is None:
            self.services[self.default] = first
        else:
            self.loop = DeviceLoop(on_round=self._sweep)

    @classmethod
    def single(cls, service: Service) -> "ModelSet":
        return cls(service.config, None, service)

    @property
    def several(self) -> bool:
        return self.loop is not None

    def start(self) -> Service:
        """Start the inference thread and load the default model (raises
        what its loading raises)."""
        if self.loop is None:
            return self.services[self.default]
        self.loop.start()
        return self.loop.call(lambda: self._load(self.default)).result()

    # ---- the HTTP side ------------------------------------------------------

    def resolve(self, name: Optional[str]) -> str:
        """The served name for a request's ``model`` (None: the default)."""
        if name is None:
            return self.default
        served = self.names.get(name)
        if served is None:
            if self.config.allow_any_model and is_repo_id(name):
                return name  # loaded by ``service``
            listed = ", ".join(repr(n) for n in self.configs)
            hint = (" (or a Hugging Face repo id, ORG/NAME)" if self.config.allow_any_model
                    else "")
            raise APIError(404, f"model {name!r} does not exist; this server serves "
                           f"{listed}{hint}", code="model_not_found", param="model")
        return served

    async def service(self, name: Optional[str]) -> Service:
        """The loaded service for a request's ``model``, loading it if needed."""
        served = self.resolve(name)
        self.last_used[served] = time.monotonic()
        loaded = self.services.get(served)
        if loaded is not None:
            return loaded
        if served in self.unfit:
            raise APIError(503, self.unfit[served], type="server_error",
                           code="model_does_not_fit")
        if served not in self.configs:
            await asyncio.to_thread(self._admit, served)
        with self._lock:
            future = self._loading.get(served)
            if future is None:
                future = self._loading[served] = self.loop.call(lambda: self._load(served))
        try:
            return await asyncio.wrap_future(future)
        except APIError:
            raise
        except Exception as e:  # a model that does not load: its requests' error, not ours
            log.exception("loading %s failed", served)
            raise APIError(503, f"model {served!r} could not be loaded: {type(e).__name__}: "
                           f"{e}", type="server_error", code="model_load_failed") from None
        finally:
            with self._lock:
                if self._loading.get(served) is future and future.done():
                    del self._loading[served]

    def _admit(self, repo_id: str) -> None:
        """A repo id a request named joins the set (``--allow-any-model``):
        its folder from the hub cache, or downloaded."""
        try:
            folder = hub_folder(repo_id)
        except ValueError as e:
            raise APIError(404, f"model {repo_id!r} is not served here and could not be "
                           f"found: {e}", code="model_not_found", param="model") from None
        config = any_model_config(self.config, repo_id, folder)
        try:
            config = with_kv_budget(config, self.limit // self.config.max_loaded_models)
        except ValueError as e:
            raise APIError(503, str(e), type="server_error", code="model_does_not_fit") from None
        with self._lock:
            self.configs.setdefault(repo_id, config)
            self.names.setdefault(repo_id, repo_id)

    def loaded(self, name: Optional[str] = None) -> Optional[Service]:
        return self.services.get(self.resolve(name))

    def listing(self) -> list[dict]:
        """Every served model, with whether it is loaded now and whether it
        takes images (a model not loaded: as its folder's config says)."""
        return [{"id": name, "loaded": name in self.services,
                 "aliases": list(config.aliases), "images": self._takes_images(name, config)}
                for name, config in self.configs.items()]

    def _takes_images(self, name: str, config: ServerConfig) -> bool:
        service = self.services.get(name)
        if service is not None:
            return service.vision is not None
        return image_support(config.model, name).takes_images

    def shutdown(self) -> None:
        """End every open stream now (signal-safe); ``join`` stops the thread."""
        for service in list(self.services.values()):
            service.scheduler.shutdown()

    def join(self, timeout: float) -> bool:
        """Stop inference; False if it did not stop within ``timeout``."""
        if self.loop is None:
            scheduler = self.services[self.default].scheduler
            scheduler.join(timeout=timeout)
            return not scheduler.alive
        self.loop.stop(timeout)
        return not self.loop.alive

    # ---- on the inference thread ---------------------------------------------

    def _load(self, name: str):
        """A job in steps (a generator): the model's loader yields between
        its stages, and the other models step in between."""
        if name in self.services:
            return self.services[name]
        self._make_room(name)
        config = self.configs[name]
        log.info("loading %s (%s)", name, config.model)
        tic = time.monotonic()
        self._arriving.add(name)
        try:
            service = yield from self.loader(config)
        finally:
            self._arriving.discard(name)
        self.loop.add(name, service.scheduler)
        self.services[name] = service
        self.last_used[name] = time.monotonic()
        log.info("loaded %s in %.1f s (%d of at most %d loaded)", name, time.monotonic() - tic,
                 len(self.services), self.config.max_loaded_models)
        return service

    def _make_room(self, name: str) -> None:
        """Unload idle models, least recently used first, until ``name`` fits
        the count and the memory bound beside the loaded and loading ones."""
        need, limit = footprint(self.configs[name]), self.limit
        if need > limit:
            raise APIError(503, f"model {name!r} needs about {mib(need)} (its weights and KV "
                           f"budget), more than the models' memory {mib(limit)} "
                           "(--models-memory)",
                           type="server_error", code="model_does_not_fit")

        def full() -> bool:
            held = [*self.services, *self._arriving]
            used = sum(footprint(self.configs[n]) for n in held)
            return len(held) >= self.config.max_loaded_models or used + need > limit

        while full():
            now = time.monotonic()
            idle = [n for n in self.services
                    if not self._busy(n) and now - self.last_used.get(n, 0) > RECENT_S]
            if not idle:
                held = len(self.services) + len(self._arriving)
                raise APIError(503, f"no room to load {name!r}: the {held} loaded or loading "
                               "models are busy; retry later", type="server_error",
                               code="models_busy")
            self._unload(min(idle, key=self._recency), f"to make room for {name}")

    def _busy(self, name: str) -> bool:
        """A request of the model's is queued, waiting for memory or running:
        it is never unloaded. (No step of it is under way: this runs on the
        inference thread, between steps.)"""
        return not self.services[name].scheduler.idle

    def _recency(self, name: str) -> float:
        """When a model was last asked for or stepped."""
        return max(self.last_used.get(name, 0), self.services[name].scheduler.last_active)

    def _unload(self, name: str, why: str) -> None:
        service = self.services.pop(name)
        service.scheduler.shutdown()  # a request that raced in ends with a clear error
        self.loop.remove(name)
        del service
        gc.collect()
        release_idle_memory()
        log.info("unloaded %s (%s)", name, why)

    def _sweep(self) -> None:
        """Unload models idle for ``--keep-alive`` seconds."""
        keep = self.config.keep_alive
        if keep is None:
            return
        now = time.monotonic()
        for name in list(self.services):
            since = self._recency(name)
            if not self._busy(name) and now - since > keep:
                self._unload(name, f"idle {now - since:.0f} s, --keep-alive {keep:g}")
