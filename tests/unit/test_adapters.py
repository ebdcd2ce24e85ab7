"""LoRA adapters on the host: the adapter state file (its contract and writer), the engine's error messages as
``vllm-fleet adapters`` reads them, and the engine's LoRA resolver (its light import, its answers). The adapters
file's contract: tests/unit/test_lora.py; the engine calls themselves: tests/integration/test_adapters_sim.py and
test_engine_contract.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fleet.contracts import (
    ADAPTERS_FILE_ENV,
    AdaptersFile,
    ContractError,
    adapter_state_path,
    parse_adapter_state,
    read_adapter_state,
)
from vllm_fleet.host import adapters, lora_resolver

DOC = {
    "schema": 1, "instance": "tiny-a", "model": "tiny-qwen3",
    "adapters": [{"name": "tiny-sql", "path": "/var/lib/vllm-fleet/models/adapters/tiny-sql", "rank": 8, "carry": True},
                 {"name": "tiny-chat", "path": "/srv/adapters/tiny-chat", "rank": 16, "carry": False}],
}  # fmt: skip


def test_the_adapter_state_file_written_and_read(tmp_path: Path) -> None:
    path = adapters.write_state(tmp_path / "run", "tiny-a", "tiny-qwen3", ["b", "a"])
    assert (
        path
        == adapter_state_path(tmp_path / "run", "tiny-a")
        == tmp_path / "run" / "adapters" / "tiny-a.json"
    )
    st = read_adapter_state(path)
    assert (st["instance"], st["model"], st["loaded"]) == ("tiny-a", "tiny-qwen3", ["a", "b"])
    assert path.stat().st_mode & 0o777 == 0o644 and path.parent.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in path.parent.iterdir()] == ["tiny-a.json"]  # no temp file left
    with pytest.raises(ContractError, match="loaded: expected a list of strings"):
        parse_adapter_state({"loaded": [1]}, "s.json")
    with pytest.raises(ContractError, match="updated_at: expected int/float"):
        parse_adapter_state({"updated_at": "now"}, "s.json")


def test_the_engines_messages() -> None:
    err = {
        "error": {"message": "The lora adapter 'x' cannot be found.", "type": "NotFoundError", "code": 404}
    }
    assert adapters.engine_message(json.dumps(err).encode()) == "The lora adapter 'x' cannot be found."
    assert adapters.engine_message(b'{"detail":"Not Found"}') == "Not Found"
    assert adapters.engine_message(b"Internal Server Error") == "Internal Server Error"


def test_sync_of_an_engine_that_is_not_there_is_skipped(tmp_path: Path) -> None:
    from vllm_fleet.contracts import InstanceConfig

    file = tmp_path / "a.adapters.json"
    file.write_text(json.dumps(DOC))
    cfg = InstanceConfig(name="tiny-a", served_model_name="tiny-qwen3", model_path="/m", port=1, command=["x"],
                         environment={ADAPTERS_FILE_ENV: str(file)}, state_dir=str(tmp_path))  # fmt: skip
    res = adapters.sync(cfg, timeout=2)
    assert res.skipped is not None and res.skipped.startswith("not running: the engine does not answer"), res
    assert not res.changed and res.error is None
    (tmp_path / "tiny-a.json").write_text(json.dumps({"instance": "tiny-a", "state": "failed"}))
    assert adapters.sync(cfg).skipped == "not running: its launcher reports failed"
    off = adapters.sync(
        InstanceConfig(name="b", served_model_name="m", model_path="/m", port=1, command=["x"])
    )
    assert (off.skipped or "").startswith("LoRA is off"), off


def test_the_resolver_module_imports_nothing_heavy_and_does_nothing_without_an_adapters_file() -> None:
    code = (
        "import sys, os; os.environ.pop('VLLM_FLEET_ADAPTERS_FILE', None)\n"
        "import vllm_fleet.host.lora_resolver as r; r.register()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'transformers', 'numpy'))\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_resolver_answers_from_the_adapters_file(tmp_path: Path) -> None:
    file = tmp_path / "a.adapters.json"
    file.write_text(json.dumps(DOC))
    assert lora_resolver.lookup(str(file), "tiny-chat") == AdaptersFile.from_dict(DOC).adapter("tiny-chat")
    assert lora_resolver.lookup(str(file), "nope") is None
    assert lora_resolver.lookup(str(tmp_path / "missing.json"), "tiny-chat") is None
    # a name added to the file later is found (the file is read on every call); vLLM's side of the resolver: a
    # real engine in test_engine_contract.py and test_launcher_lora.py
    file.write_text(
        json.dumps({**DOC, "adapters": [*DOC["adapters"], {**DOC["adapters"][0], "name": "new"}]})
    )
    assert lora_resolver.lookup(str(file), "new") is not None


def test_the_entry_point_is_declared() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"vllm_fleet_adapters": "vllm_fleet.host.lora_resolver:register"}
