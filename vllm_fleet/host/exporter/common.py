"""What every collector of the host exporter shares: the metric name prefix, the logger (one name for all the
exporter's modules: its journal lines read ``vllm_fleet.host.exporter: ...`` whichever collector wrote them) and
whether the process a state file names still runs."""

from __future__ import annotations

import logging
import os

PREFIX = "vllm_fleet_"
log = logging.getLogger("vllm_fleet.host.exporter")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (any user's: EPERM means it does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
