"""Pytest plugin that runs the suite with OpenBLAS, as the server runs.

Enabled with ``-p mlx_lm_server.pytest_plugin`` in pyproject's ``addopts``:
plugins named there are imported before pytest captures output, so the
re-executed run still prints to the terminal.
"""

from .runtime.blas import ensure_fast_blas

ensure_fast_blas()

_exit_status = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def pytest_unconfigure(config):
    """Leave without interpreter teardown once pytest is done.

    Tests run inference threads; MLX worker threads still alive at teardown
    can abort the process after every test passed, turning a green run red.
    """
    import os
    import sys

    if _exit_status is not None and not os.environ.get("MLX_LM_SERVER_PYTEST_TEARDOWN"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)
