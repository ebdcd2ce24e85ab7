"""A host's contract (CONFIG_DIR/host.json, vllm_fleet.contracts.HostContract): built from the spec on the
controller, rendered byte for byte as the host reads it, refused naming the field when malformed; fetch,
manifest and the doctor read it on a host, and run the same code from a spec on the controller."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet import cli
from vllm_fleet.contracts import HOST_CONTRACT_SCHEMA, ContractError, HostContract
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.host_contract import host_contract
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import FleetSpec, load_spec, parse_spec, spec_hash
from vllm_fleet.host import manifest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_writes_each_engine_hosts_contract_and_it_reads_back_the_same(
    example: Path, tmp_path: Path
) -> None:
    spec = load_spec(example)
    written = {p.parts[len(tmp_path.parts)]: p for p in render_fleet(spec, tmp_path) if p.name == "host.json"}
    engine_hosts = {m.host for m in spec.models} | {n.host for m in spec.models for n in m.placement}
    assert set(written) == engine_hosts  # scope engine_host: every host that runs an instance or a rank
    for host, path in written.items():
        assert path == tmp_path / host / spec.paths.config_dir.lstrip("/") / "host.json"
        text = path.read_text()
        loaded = HostContract.load(path)
        assert loaded == host_contract(spec, host)
        assert loaded.dumps() == text  # the round trip is byte for byte
        assert (loaded.host, loaded.fleet, loaded.schema) == (host, spec.name, HOST_CONTRACT_SCHEMA)
        # the hash the manifest records is the one the controller's templates and status compare with
        assert loaded.spec_hash == spec_hash(spec) == build_context(spec, host)["vf"]["spec_hash"]


def test_the_contract_holds_the_hosts_models_instances_and_stacks() -> None:
    spec = load_spec(REPO / "examples/seed-001-cpu-fallback.yml")
    host = spec.models[0].host
    c = host_contract(spec, host)
    mine = spec.models_on(host)
    assert [i.name for i in c.instances] == [m.name for m in mine]
    assert [s.name for s in c.stacks] == spec.stacks_on(host)
    for m in mine:
        got = c.model(m.name)
        assert got.source.kind == m.source.kind and got.source.revision == m.source.revision
        assert got.source.checksums == m.source.checksums and got.source.repo == m.source.repo
        inst = next(i for i in c.instances if i.name == m.name)
        assert (inst.stack, inst.dtype, inst.env, inst.gpus) == (spec.stack_name(m), m.dtype, m.env, m.gpus)
        assert inst.args[0] == got.model_path  # the engine's argv starts with the folder fetch fills
    assert c.gpus.field == f"hosts[{[h.name for h in spec.hosts].index(host)}].gpus"


def test_a_rank_only_host_fetches_its_share_but_runs_no_instance() -> None:
    spec = load_spec(REPO / "examples/tiny-cpu-multinode.yml")
    group = next(m for m in spec.models if m.multi_node)
    rank1 = group.placement[1].host
    c = host_contract(spec, rank1)
    assert group.name in [m.name for m in c.models]
    assert group.name not in [i.name for i in c.instances]


def _good() -> dict[str, Any]:
    spec = load_spec(REPO / "examples/tiny-cpu-2hosts.yml")
    return host_contract(spec, spec.models[0].host).to_dict()


def _set(d: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = re.findall(r"\w+", path)
    for k in parents:
        d = d[int(k)] if k.isdigit() else d[k]  # type: ignore[assignment]
    if value is _DELETE:
        del d[last]
    else:
        d[last] = value


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("models[0].source.revision", 3, "models[0].source.revision: expected a string, got 3"),
        ("models[0].model_path", _DELETE, "models[0].model_path: missing"),
        ("instances[0].port", "8101", "instances[0].port: expected an integer, got '8101'"),
        ("instances[0].gpus", "0", "instances[0].gpus: expected a list, got '0'"),
        ("instances[0].env", {"A": 1}, "instances[0].env.A: expected a string, got 1"),
        ("instances[0].quantization", 8, "instances[0].quantization: expected a string, got 8"),
        ("gpus.detect", "yes", "gpus.detect: expected true or false, got 'yes'"),
        ("stacks", [], "stacks: at least one stack is required"),
        ("instances[0].name", "nope", "instances[0].name: 'nope' has no entry in models"),
        ("instances[0].stack", "other", "instances[0].stack: 'other' is not one of stacks"),
        ("paths.extra", "/x", "paths.extra: unknown field"),
        ("schema", 99, "schema: 99 is not a host contract schema this vllm-fleet reads (1)"),
        ("spec_hash", _DELETE, "spec_hash: missing"),
    ],
)
def test_a_malformed_contract_is_refused_naming_the_field(path: str, value: Any, message: str) -> None:
    good = _good()
    assert HostContract.from_dict(good).to_dict() == good
    bad = copy.deepcopy(good)
    _set(bad, path, value)
    with pytest.raises(ContractError, match=re.escape(f"host.json: {message}")):
        HostContract.from_dict(bad, "host.json")


def test_optional_fields_take_null() -> None:
    d = _good()
    d["instances"][0]["quantization"] = None
    d["instances"][0]["max_model_len"] = None
    c = HostContract.from_dict(d)
    assert c.instances[0].quantization is None and c.instances[0].max_model_len is None


# --------------------------------------------------------------------------- the commands, through the CLI


def _fleet(tmp_path: Path) -> tuple[FleetSpec, Path, Path]:
    """A two-host cpu fleet on a local model folder; its spec file and the contract of h1 as rendered."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    data = {
        "name": "t",
        "stack": {"profile": "cpu"},
        "hosts": [{"name": "h1", "address": "127.0.0.1"}, {"name": "h2", "address": "127.0.0.2"}],
        "models": [
            {"name": "a", "host": "h1", "port": 8101, "source": {"path": str(model)}},
            {"name": "b", "host": "h2", "port": 8102, "source": {"path": str(tmp_path / "elsewhere")}},
        ],
    }
    spec_file = tmp_path / "fleet.yml"
    spec_file.write_text(json.dumps(data))
    spec = parse_spec(data)
    (path,) = [p for p in render_fleet(spec, tmp_path / "out") if p.name == "host.json" and "h1" in p.parts]
    return spec, spec_file, path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_fetch_reads_the_contract_and_a_spec_gives_the_same(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _spec, spec_file, contract = _fleet(tmp_path)
    rc, out, err = _run(["fetch", "--contract", str(contract), "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    # h1's contract: its model only (h2's folder does not exist here, and is not asked for)
    assert [m["instance"] for m in got["models"]] == ["a"] and got["changed"]
    assert got["models"][0]["files"] == {"config.json": got["models"][0]["files"]["config.json"]}
    # the controller's way: the spec and --host build the same contract, the same code runs
    rc, out2, err = _run(["fetch", str(spec_file), "--host", "h1", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out2) == {**got, "changed": False, "models": [{**got["models"][0], "changed": False}]}


def test_fetch_on_the_controller_into_a_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm-fleet fetch SPEC --dest DIR --from SRC``: every model of the spec (no --host), on the controller."""
    _spec, spec_file, _contract = _fleet(tmp_path)
    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "config.json").write_text(json.dumps({"name": name}))
    dest = tmp_path / "dest"
    rc, out, err = _run(["fetch", str(spec_file), "--dest", str(dest), "--from", str(src)], capsys)
    assert rc == 0, err
    assert json.loads((dest / "b" / "config.json").read_text()) == {"name": "b"}
    assert "a: " in out and "b: " in out


def test_manifest_reads_the_contract(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest, "stack_facts", lambda profile: {"profile": profile})  # no torch import
    spec, spec_file, contract = _fleet(tmp_path)
    out_file = tmp_path / "manifest.json"
    rc, out, err = _run(["manifest", "--contract", str(contract), "--out", str(out_file)], capsys)
    assert rc == 0, err
    assert json.loads(out) == {"changed": True, "path": str(out_file)}
    data = json.loads(out_file.read_text())
    assert (data["host"], data["fleet"], data["spec_hash"]) == ("h1", "t", spec_hash(spec))
    assert [i["name"] for i in data["instances"]] == ["a"] and data["instances"][0][
        "unit"
    ] == "vllm@a.service"
    # from the spec on the controller: the same manifest (its time aside)
    rc, out, err = _run(["manifest", str(spec_file), "--host", "h1", "--out", "-"], capsys)
    assert rc == 0, err
    from_spec = json.loads(out)
    data.pop("generated_at")
    assert from_spec == data


@pytest.mark.parametrize("command", ["fetch", "manifest", "doctor"])
def test_a_malformed_contract_file_stops_the_command_naming_the_field(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _spec, _spec_file, contract = _fleet(tmp_path)
    data = json.loads(contract.read_text())
    data["models"][0]["source"]["kind"] = None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    rc, _out, err = _run([command, "--contract", str(bad)], capsys)
    assert rc == 2
    assert err.strip() == f"{command}: --contract: {bad}: models[0].source.kind: expected a string, got None"
    rc, _out, err = _run([command, "--contract", str(tmp_path / "missing.json")], capsys)
    assert rc == 2 and f"--contract {tmp_path / 'missing.json'}: cannot read it" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fetch"], "fetch: give this host's --contract CONFIG_DIR/host.json (on a host) or SPEC"),
        (
            ["manifest", "--contract", "c.json", "SPEC.yml"],
            "manifest: give SPEC (on the controller) or --contract",
        ),
        (["fetch", "--contract", "c.json", "--host", "h1"], "fetch: --host goes with SPEC"),
        (["manifest", "SPEC", "--out", "-"], "manifest: SPEC needs --host"),
        (["fetch", "SPEC", "--host", "h9"], "fetch: --host h9: not a host of"),
        (
            ["doctor", "--contract", "CONTRACT", "--stack", "gpu-b"],
            "doctor: --stack gpu-b: host h1 runs the stacks default",
        ),
    ],
)
def test_the_command_lines_name_what_is_wrong(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _spec, spec_file, contract = _fleet(tmp_path)
    argv = [str(spec_file) if a == "SPEC" else str(contract) if a == "CONTRACT" else a for a in argv]
    rc, _out, err = _run(argv, capsys)
    assert rc == 2 and message in err, err
