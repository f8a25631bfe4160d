"""The server process: parse the command line, load, serve with uvicorn, and
stop cleanly on SIGINT/SIGTERM (every open stream ends, exit status 0).

The HTTP routes are in ``http/routes.py``, the command line in ``cli.py``,
the building of model, engine and scheduler in ``assembly.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Optional

from .assembly import load_service, load_service_in_steps
from .cli import build_parser, config_from_args
from .config import ServerConfig
from .http.routes import create_app
from .models.source import chat_template_text, check_adapter_path, resolve_model
from .parallel.liveness import Heartbeat, Watchdog, exit_now, watch_parent
from .runtime.blas import ensure_fast_blas
from .runtime.ports import cannot_listen
from .spec_decode.auto import auto_choice

log = logging.getLogger("mlx_lm_server")


def make_uvicorn_server(app, config: ServerConfig, on_exit):
    """A uvicorn server whose first signal ends every stream, then exits with 0."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # Unlike uvicorn's, do not re-raise the signal after a graceful
            # shutdown: a clean stop on SIGINT/SIGTERM exits with status 0.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            old = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    uv_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        timeout_graceful_shutdown=5, access_log=config.log_level == "debug",
    )
    return _Server(uv_config)


def resolve_sources(config: ServerConfig) -> ServerConfig:
    """The config with ``--model`` and ``--draft-model`` as local folders
    (Hugging Face repo ids resolved; see ``model_source``), served under the
    repo id unless named otherwise, ``--chat-template`` as the template's
    text and ``--spec-decode auto`` as the mode it stands for with these
    folders. Raises ``ValueError``."""
    folder, repo = resolve_model(config.model)
    if config.adapter_path:
        check_adapter_path(config.adapter_path)
    if config.chat_template:
        config = replace(config, chat_template=chat_template_text(config.chat_template))
    spec = config.spec
    if spec.draft_model_path:
        draft, _ = resolve_model(spec.draft_model_path)
        spec = replace(spec, draft_model_path=str(draft))
    if spec.mode == "auto":
        mode, draft, why = auto_choice(str(folder), spec.draft_model_path)
        spec = replace(spec, mode=mode, draft_model_path=draft)
        log.info("--spec-decode auto for %s: %s (%s; --spec-decode none turns it off)",
                 repo or folder, mode, why)
    return replace(config, model=str(folder), spec=spec,
                   served_model_name=config.served_model_name or repo)


def main(argv: Optional[list[str]] = None) -> int:
    parent = os.getppid()  # mlx.launch, for a rank; read before loading takes seconds
    ensure_fast_blas()
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = replace(resolve_sources(config),
                         models=tuple(resolve_sources(m) for m in config.models))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    link = _link(config.pipeline)
    if config.models or config.allow_any_model:
        if link.size > 1:
            print(f"error: {link.split} parallel serves one model: drop the other --model "
                  "flags, --models-file and --allow-any-model", file=sys.stderr)
            return 2
        return _serve_several(config)
    if link.size > 1:
        # Tag every log line with the rank: mlx.launch interleaves them.
        logging.getLogger().handlers[0].setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s [rank {link.rank}] %(name)s: %(message)s"))
        log.info("%s parallel: rank %d of %d", link.split, link.rank, link.size)
        if parent != 1:  # 1: started by init, or orphaned already
            watch_parent(parent, _launcher_gone(parent))
    problem = cannot_listen(config.host, config.port) if link.leader else None
    if problem is not None:  # before the model takes seconds to load
        print(f"error: {problem}", file=sys.stderr)
        return 1
    status = {"code": 0}

    def fatal(reason: str) -> None:
        # Tensor parallel broke down (the scheduler has ended every stream).
        # Only the inference thread and the liveness watch call it, and they
        # start once ``server`` exists.
        status["code"] = 1
        server.should_exit = True

    log.info("loading %s", config.model)
    try:
        service = load_service(config, link, on_fatal=fatal if link.size > 1 else None)
    except ValueError as e:  # e.g. a draft model that cannot draft for this model
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not link.leader:
        return _follow(service, config)
    server = make_uvicorn_server(create_app(service), config, service.scheduler.shutdown)
    if link.size > 1:
        def hung(reason: str) -> None:
            service.scheduler.fail(reason)
            time.sleep(2)  # the streams' error events go out
            exit_now(1)

        if not Heartbeat(link, config.distributed_timeout, hung).start():
            Watchdog(link, config.distributed_timeout, lambda: service.scheduler.busy,
                     hung).start()
    service.scheduler.start()
    log.info("serving %s on http://%s:%d/v1", config.model_id, config.host, config.port)
    try:
        server.run()
    except SystemExit:  # uvicorn could not bind after all (the port was taken meanwhile)
        status["code"] = 1
    service.scheduler.shutdown()
    service.scheduler.join(timeout=5 if link.size == 1 else config.distributed_timeout)
    if service.scheduler.alive:
        log.warning("inference thread still inside a long step; exiting without it")
        status["code"] = status["code"] or int(link.size > 1)
    if service.scheduler.failed:
        log.error("exiting: %s", service.scheduler.failed)
        status["code"] = 1
    elif link.size > 1:
        log.info("rank 0 stopped the other ranks after plan %d: checksum %08x",
                 link.plans, link.checksum)
    # Every client has had its last event. Leave without interpreter teardown,
    # which can abort the process while MLX's worker threads still run.
    exit_now(status["code"])


def _serve_several(config: ServerConfig) -> int:
    """Several models, one inference thread (``http/model_set.py``)."""
    from .http.model_set import ModelSet

    problem = cannot_listen(config.host, config.port)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        models = ModelSet(config, load_service_in_steps)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("serving %d models: %s (default %s, at most %d loaded%s)", len(config.all_models),
             ", ".join(models.configs), config.model_id, config.max_loaded_models,
             f", unloaded after {config.keep_alive:g} s idle" if config.keep_alive else "")
    try:
        models.start()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        models.join(timeout=5)
        return 2
    server = make_uvicorn_server(create_app(models), config, models.shutdown)
    code = 0
    try:
        server.run()
    except SystemExit:
        code = 1
    models.shutdown()
    if not models.join(timeout=5):
        log.warning("inference thread still inside a long step; exiting without it")
    exit_now(code)


def _launcher_gone(parent: int):
    def gone() -> None:
        # As on SIGTERM: rank 0 ends every stream and stops the other ranks,
        # which wait for it (``_follow``).
        log.warning("the launcher (pid %d) has gone: stopping as on SIGTERM", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    return gone


def _link(pipeline: bool = False):
    from .parallel.distributed import SOLO, Link, world

    group = world()
    if group.size() > 1:
        return Link(group, split="pipeline" if pipeline else "tensor")
    if pipeline:
        log.warning("--pipeline: one process, nothing to split (start the ranks with "
                    "mlx.launch)")
    return SOLO


def _follow(service, config: ServerConfig) -> int:
    """A follower rank: no HTTP; execute rank 0's plans until it stops.

    A signal does not end a follower by itself (Ctrl-C reaches every rank
    that a terminal started, and a launcher that has gone counts as a
    SIGTERM): it waits for rank 0's stop plan, and leaves with status 1 if
    that has not come within the timeout. Rank 0 gone (its heartbeat
    connection closed) ends it at once.
    """
    link = service.scheduler.link

    def on_signal(sig, frame):
        log.info("signal %d: waiting for rank 0 to stop", sig)
        timer = threading.Timer(config.distributed_timeout, exit_now, (1,))
        timer.daemon = True
        timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)

    def hung(reason: str) -> None:
        log.error("exiting: %s", reason)
        exit_now(1)

    if not Heartbeat(link, config.distributed_timeout, hung).start():
        Watchdog(link, config.distributed_timeout, lambda: True, hung).start()
    try:
        service.scheduler.follow()
    except Exception as e:
        log.error("rank %d exiting after plan %d: %s: %s", link.rank, link.plans,
                  type(e).__name__, e)
        exit_now(1)
    log.info("rank %d stopped with rank 0 after plan %d: checksum %08x", link.rank,
             link.plans, link.checksum)
    exit_now(0)


if __name__ == "__main__":
    sys.exit(main())
