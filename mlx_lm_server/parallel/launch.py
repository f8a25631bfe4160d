"""``mlx-lm-server-launch``: ``mlx.launch`` without its spinning relays.

mlx 0.32.4's launcher relays each rank's stdin, stdout and stderr in one
thread per rank, which ``select``s the rank's stdin pipe for writing every
round. A pipe is always writable, so every relay thread spins: about a core
and a quarter on loopback while the ranks themselves sleep. The server's
ranks read nothing from stdin, so this runs mlx's own launcher with that
``select`` asked about reading only: the relays block on the ranks' output
(up to a second at a time), and the launcher is quiet. Its own stdin is
replaced by an empty pipe that never ends (at end of file, as under
``nohup`` or a service manager, mlx's main loop would spin reading nothing).
Arguments, hostfiles, backends and output are ``mlx.launch``'s own; stdin is
not passed on.
"""

from __future__ import annotations

import os
import select
import sys

_EMPTY_STDIN: list = []  # the write end, held open: stdin never reaches its end


def _reading_only(rlist, wlist, xlist, timeout=None):
    return select.select(rlist, [], xlist, timeout)


def main() -> int:
    from mlx._distributed_utils import launch

    launch.select = _reading_only
    read, write = os.pipe()
    os.dup2(read, 0)
    _EMPTY_STDIN.append(write)
    sys.argv[0] = "mlx-lm-server-launch"
    return launch.main()


if __name__ == "__main__":
    sys.exit(main())
