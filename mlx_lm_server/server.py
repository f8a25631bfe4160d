"""The server process: parse the command line, load, serve with uvicorn, and
stop cleanly on SIGINT/SIGTERM (every open stream ends, exit status 0).

The HTTP app is in ``app.py``, the command line in ``cli.py``, the wiring of
model, engine and scheduler in ``service.py``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import replace
from typing import Optional

from .app import create_app
from .blas import ensure_fast_blas
from .cli import build_parser, config_from_args
from .config import ServerConfig
from .model_source import resolve_model
from .service import load_service

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
    repo id unless named otherwise. Raises ``ValueError``."""
    folder, repo = resolve_model(config.model)
    spec = config.spec
    if spec.draft_model_path:
        draft, _ = resolve_model(spec.draft_model_path)
        spec = replace(spec, draft_model_path=str(draft))
    return replace(config, model=str(folder), spec=spec,
                   served_model_name=config.served_model_name or repo)


def main(argv: Optional[list[str]] = None) -> int:
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
        config = resolve_sources(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("loading %s", config.model)
    try:
        service = load_service(config)
    except ValueError as e:  # e.g. a draft model that cannot draft for this model
        print(f"error: {e}", file=sys.stderr)
        return 2
    service.scheduler.start()
    server = make_uvicorn_server(create_app(service), config, service.scheduler.shutdown)
    log.info("serving %s on http://%s:%d/v1", config.model_id, config.host, config.port)
    server.run()
    service.scheduler.shutdown()
    service.scheduler.join(timeout=5)
    if service.scheduler.alive:
        log.warning("inference thread still inside a long step; exiting without it")
    # Every client has had its last event. Leave without interpreter teardown,
    # which can abort the process while MLX's worker threads still run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
