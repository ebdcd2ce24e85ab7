"""The controller→host files (vllm_fleet/contracts.py): what render writes and the launcher writes is what
their readers accept, and a wrong file is refused naming the field."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from vllm_fleet.contracts import (
    INSTANCE_CONFIG_EXTRA_KEYS,
    SERVICE_DEFAULTS,
    STATE_KEYS,
    ContractError,
    InstanceConfig,
    is_adapters_file,
    parse_state,
    read_adapter_state,
    read_state,
    read_vrrp_state,
    read_worker_state,
    stack_of,
)
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import ServiceSettings, load_spec
from vllm_fleet.host.launcher import Launcher, launch

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_instance_configs_match_the_contract(example: Path, tmp_path: Path) -> None:
    written = [
        p
        for p in render_fleet(load_spec(example), tmp_path)
        if p.parent.name == "instances" and not is_adapters_file(p)
    ]
    assert written
    fields = {f.name for f in dataclasses.fields(InstanceConfig)}
    for p in written:
        data = json.loads(p.read_text())
        assert set(data) == fields | INSTANCE_CONFIG_EXTRA_KEYS, p  # the template writes every field
        cfg = InstanceConfig.from_dict(data, str(p))
        assert (
            cfg.name == p.stem
            and cfg.command
            and cfg.service.watchdog_seconds == data["service"]["watchdog_seconds"]
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"port": "8001"}, "port: expected an integer"),
        ({"command": "vllm serve"}, "command: expected a list of strings"),
        ({"service": {"watchdog_seconds": "60"}}, "service.watchdog_seconds: expected a number"),
        ({"environment": {"A": 1}}, "environment.A: expected a string"),
    ],
)
def test_a_wrong_instance_config_names_the_field(change: dict, message: str) -> None:
    good = {"name": "a", "model_path": "/m", "port": 8001, "command": ["x"]}
    assert InstanceConfig.from_dict(good).port == 8001
    with pytest.raises(ContractError, match=re.escape(f"cfg.json: {message}")):
        InstanceConfig.from_dict({**good, **change}, "cfg.json")
    bad = dict(good)
    del bad["model_path"]
    with pytest.raises(ContractError, match="model_path: missing"):
        InstanceConfig.from_dict(bad)


def test_launch_refuses_a_wrong_config_as_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "instances").mkdir()
    (tmp_path / "instances" / "a.json").write_text(
        json.dumps({"name": "a", "model_path": "/m", "port": "x", "command": []})
    )
    assert launch("a", str(tmp_path)) == 78


def test_the_launchers_state_is_a_state_file() -> None:
    cfg = InstanceConfig(name="a", served_model_name="m", model_path="/m", port=9, command=["x"])
    state = Launcher(cfg).state_dict()
    assert set(state) == set(STATE_KEYS)
    assert parse_state(json.loads(json.dumps(state))) == state
    with pytest.raises(ContractError, match=r"st\.json: probes_total: expected int"):
        parse_state({**state, "probes_total": "3"}, "st.json")
    with pytest.raises(ContractError, match="last_probe_ok: expected bool or null"):
        parse_state({**state, "last_probe_ok": 1})
    assert parse_state({"instance": "a", "new_key": 1}) == {
        "instance": "a",
        "new_key": 1,
    }  # older/newer launchers


@pytest.mark.parametrize("read", [read_state, read_worker_state, read_adapter_state, read_vrrp_state])
def test_every_state_file_reader_refuses_alike(read: Callable[[Path], object], tmp_path: Path) -> None:
    """Each state file's reader: OSError for a missing file, a ContractError naming the file for one that is not
    JSON or has a key of the wrong type, its content for a good one."""
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ContractError, match=rf"^{re.escape(str(bad))}: not JSON \("):
        read(bad)
    bad.write_text(json.dumps({"updated_at": "soon", "since": "soon"}))
    with pytest.raises(ContractError, match=rf"^{re.escape(str(bad))}: (updated_at|since): expected"):
        read(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"new_key": 1}))
    assert read(good) == {"new_key": 1}


def test_the_state_file_names_the_stack_the_engine_runs_from() -> None:
    venv = "/opt/vllm-fleet/stacks/cpu-0.32.0-0123456789ab"
    cfg = InstanceConfig(name="a", served_model_name="m", model_path="/m", port=9,
                         command=[f"{venv}/bin/python", "-m", "vllm_fleet.host.vllm_cpu_entry", "serve"])  # fmt: skip
    assert Launcher(cfg).state_dict()["stack"] == "cpu-0.32.0-0123456789ab"
    assert stack_of([f"{venv}/bin/vllm", "serve"]) == "cpu-0.32.0-0123456789ab"
    assert stack_of(["/usr/bin/env", "x"]) == "usr" and stack_of(["python"]) == "" and stack_of([]) == ""
    with pytest.raises(ContractError, match="stack: expected str"):
        parse_state({"instance": "a", "stack": None})


def test_service_defaults_are_one_place() -> None:
    assert ServiceSettings().model_dump() == dataclasses.asdict(SERVICE_DEFAULTS)
