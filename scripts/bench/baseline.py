"""``--baseline CHECKOUT``: the same benchmark run again on another
checkout's package, in a child process, for the figures side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def baseline_figures(script: str, argv: list[str], checkout: str) -> dict:
    """``script`` run with ``argv`` and ``--json`` where ``checkout``'s
    package shadows this one (first on ``PYTHONPATH``); what it printed."""
    path = [os.path.abspath(checkout), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    out = subprocess.run([sys.executable, script, "--json", *argv], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)
