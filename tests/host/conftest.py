"""Host verification suite (pytest-testinfra) — run it against a deployed fleet:

    pytest tests/host --hosts=ansible://all --ansible-inventory=INVENTORY --fleet-spec=SPEC

(or ``VLLM_FLEET_SPEC=SPEC``). Inventory host names are the spec's ``hosts[].name``. The expectations come from
the same spec the playbook deployed (``vllm-fleet context``), never from this suite.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.spec import FleetSpec, load_spec


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fleet-spec", default=os.environ.get("VLLM_FLEET_SPEC", ""), help="the deployed fleet spec"
    )


@pytest.fixture(scope="session")
def fleet_spec(pytestconfig: pytest.Config) -> FleetSpec:
    path = pytestconfig.getoption("--fleet-spec")
    if not path:
        pytest.fail("give the deployed fleet spec: --fleet-spec=SPEC (or VLLM_FLEET_SPEC)")
    return load_spec(path)


@pytest.fixture
def vf(host: Any, fleet_spec: FleetSpec) -> dict[str, Any]:
    """The template variables of the host under test (the same the playbook deployed)."""
    name = host.backend.get_hostname()
    names = [h.name for h in fleet_spec.hosts]
    if name not in names:
        pytest.fail(f"inventory host {name} is not in the spec's hosts ({', '.join(names)})")
    return build_context(fleet_spec, name)["vf"]  # type: ignore[no-any-return]
