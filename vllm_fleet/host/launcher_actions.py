"""The launcher's actions: what ``launcher_state.Supervisor`` (and its sleep controller,
``sleep_control.SleepControl``) return for ``vllm_fleet.host.launcher`` to perform, in order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Notify:
    """Send these ``KEY=VALUE`` fields to systemd as one message."""

    fields: tuple[str, ...]


def status(text: str) -> Notify:
    return Notify((f"STATUS={text}",))


@dataclass(frozen=True)
class Log:
    message: str
    level: int = 6  # syslog priority


@dataclass(frozen=True)
class Save:
    """Write the state file (``Supervisor.state_file``)."""


@dataclass(frozen=True)
class StartProbe:
    """Start a probe: the readiness probe (``first``: /health, then a 1-token decode; answer with
    ``ready_probe_done``) or a liveness check (``probe.sample`` and the CPU figures; answer with ``check_done``)."""

    first: bool


@dataclass(frozen=True)
class PollInflight:
    """Count the requests the engine runs or queues (``probe.inflight``; answer with ``drain_progress``)."""


@dataclass(frozen=True)
class LoadAdapters:
    """Load the adapters the instance carries (``adapters.load_carried``; answer with ``adapters_loaded``)."""


@dataclass(frozen=True)
class RefreshAdapters:
    """Read what the engine has loaded (``adapters.loaded``; answer with ``adapters_refreshed``)."""


@dataclass(frozen=True)
class SaveAdapters:
    """Write the adapter state file from ``Supervisor.adapters`` (``adapters.write_state``)."""


@dataclass(frozen=True)
class Terminate:
    """SIGTERM to the engine's API server (vLLM drains with ``--shutdown-timeout``)."""


@dataclass(frozen=True)
class Kill:
    """SIGKILL to the engine's process group; ``wait``: then reap the API server."""

    wait: bool


@dataclass(frozen=True)
class Exit:
    code: int


# sleep mode (vllm_fleet.host.sleep_control)
@dataclass(frozen=True)
class PollGuard:
    """Read the sleep guard's state (``GET contracts.SLEEP_STATE_PATH``; answer with ``guard_read``)."""


@dataclass(frozen=True)
class SleepEngine:
    """Put the engine to sleep (``POST /sleep?level=N`` with the admin token; answer with ``slept``)."""

    level: int


@dataclass(frozen=True)
class WakeEngine:
    """Wake the engine (``POST /wake_up``; level 2: the weights, ``reload_weights``, the KV cache; answer with
    ``woken``)."""

    level: int


@dataclass(frozen=True)
class ReportWakeFailed:
    """Tell the guard the wake failed (``POST contracts.WAKE_FAILED_PATH``): it answers the requests it holds
    with 503 and ``Retry-After: retry_after`` at once."""

    reason: str
    retry_after: int


@dataclass(frozen=True)
class AskYield:
    """Ask the least recently used awake member of the swap group to yield its slot (SIGUSR2 to its launcher;
    ``swap_group.yield_candidate``)."""


Action = (
    Notify
    | Log
    | Save
    | StartProbe
    | PollInflight
    | LoadAdapters
    | RefreshAdapters
    | SaveAdapters
    | Terminate
    | Kill
    | Exit
    | PollGuard
    | SleepEngine
    | WakeEngine
    | ReportWakeFailed
    | AskYield
)
