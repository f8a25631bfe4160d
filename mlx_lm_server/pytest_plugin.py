"""Pytest plugin that runs the suite with OpenBLAS, as the server runs.

Enabled with ``-p mlx_lm_server.pytest_plugin`` in pyproject's ``addopts``:
plugins named there are imported before pytest captures output, so the
re-executed run still prints to the terminal.
"""

from .blas import ensure_fast_blas

ensure_fast_blas()
