"""The roles' ``vllm_fleet_*`` filters: what the play decides from the hosts' answers, decided in Python
(``vllm_fleet.fleet.playfacts``, unit-tested there); the tasks only print the results."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError


def _playfacts() -> Any:
    try:
        from vllm_fleet.fleet import playfacts
    except ImportError as exc:  # pragma: no cover - the controller's venv has vllm-fleet
        raise AnsibleFilterError(f"the vllm_fleet filters need vllm-fleet on the controller: {exc}") from exc
    return playfacts


def _call(name: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return getattr(_playfacts(), name)(*args, **kwargs)

    run.__name__ = f"vllm_fleet_{name}"
    return run


class FilterModule:
    """``vllm_fleet_NAME`` for each NAME: the function of vllm_fleet.fleet.playfacts of that name."""

    NAMES = (
        "layer_verdict",
        "packages_for",
        "missing_packages",
        "foreign_listeners",
        "unit_actions",
        "restarts",
        "adapter_syncs",
        "rolling_restarts",
        "held",
        "by_name",
        "artifact_items",
        "host_files",
        "artifacts_outcome",
        "fetched",
        "host_detected",
        "model_tree",
        "model_pushes",
        "found_in_stack",
        "running_services",
        "lock_checks",
        "wheel_sources",
        "pip_source_args",
        "vrrp_interface",
        "tools_wheels",
    )

    def filters(self) -> dict[str, Callable[..., Any]]:
        return {f"vllm_fleet_{n}": _call(n) for n in self.NAMES}
