"""TCP ports on this machine: a free one for a test or a benchmark, and
whether the server can listen where it was told to, checked before a model
takes seconds to load."""

from __future__ import annotations

import socket
from typing import Optional


def free_ports(n: int = 1, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports nobody listens on now (held open together, so
    they differ)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def cannot_listen(host: str, port: int) -> Optional[str]:
    """Why a server could not listen on ``host:port`` (None: it can), with
    the same ``SO_REUSEADDR`` uvicorn sets."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None
