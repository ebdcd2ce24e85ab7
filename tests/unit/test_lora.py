"""LoRA adapters on the controller (docs/lora.md, issue 32): the spec's ``adapters`` and ``models[].lora``, the
engine's flags and environment, the plan's refusals and the slots' memory, the host's contract and its fetch,
the per-instance adapters file and what the play does when it changes (a sync, never a restart), and the tiny
adapter of the tests."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from vllm_fleet import cli
from vllm_fleet.contracts import (
    ADAPTERS_FILE_SCHEMA,
    AdaptersFile,
    ContractError,
    HostContract,
    is_adapters_file,
)
from vllm_fleet.fleet import engine_flags
from vllm_fleet.fleet.context import build_context
from vllm_fleet.fleet.engine import engine_args, engine_env
from vllm_fleet.fleet.host_contract import fleet_adapters, host_contract
from vllm_fleet.fleet.modelinfo import ModelFacts, facts_from_config
from vllm_fleet.fleet.plan import format_plan, make_plan
from vllm_fleet.fleet.playfacts import adapter_syncs, artifact_items, fetched, held, restarts
from vllm_fleet.fleet.render import Renderer
from vllm_fleet.fleet.spec import FleetSpec, SpecError, load_spec, parse_spec, spec_hash
from vllm_fleet.host.fetch import FetchError, fetch_adapters

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples/tiny-cpu-lora.yml"
SMALL_CFG = json.loads((REPO / "tests/fixtures/plan/models/small-cfg/config.json").read_text())


def _base() -> dict[str, Any]:
    """Two instances of tiny on h1 and one of other on h2, and two adapters of tiny."""
    inst = {"max_model_len": 1024, "kv_cache_memory_bytes": 1 << 26, "max_num_seqs": 4}
    return {
        "name": "t",
        "stack": {"profile": "cpu"},
        "hosts": [{"name": "h1", "address": "10.0.0.1"}, {"name": "h2", "address": "10.0.0.2"}],
        "models": [
            {"name": "a", "served_model_name": "tiny", "host": "h1", "port": 8101,
             "source": {"path": "/m/tiny"}, **inst},
            {"name": "b", "served_model_name": "tiny", "host": "h1", "port": 8102,
             "source": {"path": "/m/tiny"}, **inst},
            {"name": "o", "served_model_name": "other", "host": "h2", "port": 8101,
             "source": {"path": "/m/other"}, **inst},
        ],
        "adapters": [
            {"name": "sql", "base": "tiny", "source": {"path": "/srv/ad/sql"}, "rank": 8},
            {"name": "chat", "base": "tiny", "source": {"hf": {"repo": "org/chat", "revision": "v1"}},
             "rank": 16, "instances": ["b"]},
        ],
        "gateway": {"host": "h1"},
        "monitoring": {"enabled": False},
    }  # fmt: skip


def _problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    return e.value.problems


# --------------------------------------------------------------------------- the spec


def test_lora_is_on_for_the_instances_of_a_model_with_adapters_and_carry_follows_instances() -> None:
    spec = parse_spec(_base())
    a, b, o = spec.models
    assert (spec.lora_on(a), spec.lora_on(b), spec.lora_on(o)) == (True, True, False)
    # the smallest of vLLM's ranks at or above the largest adapter rank of the model (16 here)
    assert spec.max_lora_rank(a) == spec.max_lora_rank(b) == 16
    assert [(x.name, carry) for x, carry in spec.instance_adapters(a)] == [("sql", True), ("chat", False)]
    assert [(x.name, carry) for x, carry in spec.instance_adapters(b)] == [("sql", True), ("chat", True)]
    assert spec.instance_adapters(o) == []
    assert [spec.adapter_carriers(x) for x in spec.adapters] == [["a", "b"], ["b"]]
    # a path source is its own folder; a hub source goes under models_dir/adapters/NAME
    assert spec.adapter_path(spec.adapters[0]) == "/srv/ad/sql"
    assert spec.adapter_path(spec.adapters[1]) == "/var/lib/vllm-fleet/models/adapters/chat"
    assert spec.adapters_file(a) == "/etc/vllm-fleet/instances/a.adapters.json"


@pytest.mark.parametrize(
    ("ranks", "explicit", "want"),
    [([8], None, 8), ([9], None, 16), ([1], None, 1), ([300], None, 320), ([], None, 16), ([8], 64, 64)],
)
def test_the_effective_max_lora_rank(ranks: list[int], explicit: int | None, want: int) -> None:
    d = _base()
    d["adapters"] = [
        {"name": f"x{k}", "base": "tiny", "source": {"path": f"/x/{k}"}, "rank": r}
        for k, r in enumerate(ranks)
    ]
    d["models"][0]["lora"] = {"max_lora_rank": explicit} if explicit else {}
    spec = parse_spec(d)
    assert spec.lora_on(spec.models[0]) and spec.max_lora_rank(spec.models[0]) == want
    settings = spec.lora_settings(spec.models[0])
    assert settings is not None and settings.max_lora_rank == want and settings.max_loras == 4


def test_lora_set_without_adapters_turns_it_on_for_that_instance_only() -> None:
    d = _base()
    d["adapters"] = []
    d["models"][2]["lora"] = {"max_loras": 2}
    spec = parse_spec(d)
    assert [spec.lora_on(m) for m in spec.models] == [False, False, True]


@pytest.mark.parametrize(
    ("change", "path", "reason"),
    [
        (lambda d: d["adapters"][0].update(base="nope"), "adapters[0].base", "unknown served model 'nope'"),
        (lambda d: d["adapters"][1].update(name="sql"), "adapters[1].name", "already adapters[0]"),
        (lambda d: d["adapters"][0].update(name="other"), "adapters[0].name", "a served model's name"),
        (lambda d: d["adapters"][1].update(instances=["o"]), "adapters[1].instances[0]",
         "'o' is not an instance of 'tiny'"),
        (lambda d: d["adapters"][1].update(instances=["b", "b"]), "adapters[1].instances[1]",
         "already instances[0]"),
        (lambda d: d["adapters"][0].update(rank=1024), "adapters[0].rank", "less than or equal to 512"),
        (lambda d: d["adapters"][0].update(name="../x"), "adapters[0].name", "should match pattern"),
        (lambda d: d["models"][0].update(lora={"max_loras": 4, "max_cpu_loras": 2}), "models[0].lora",
         "max_cpu_loras 2 is below max_loras 4"),
        (lambda d: d["gateway"].update(clients={"c": {"models": ["tiny", "nope"]}}),
         "gateway.clients.c.models[1]", "unknown served model or adapter 'nope'"),
    ],
)  # fmt: skip
def test_adapters_refused_with_their_field_path(change: Any, path: str, reason: str) -> None:
    d = _base()
    change(d)
    problems = _problems(d)
    assert any(p == path and reason in r for p, r in problems), problems


def test_a_client_may_name_an_adapter() -> None:
    d = _base()
    d["gateway"]["clients"] = {"c": {"models": ["sql", "tiny"]}}
    assert parse_spec(d).gateway.clients["c"].models == ["sql", "tiny"]


def test_a_derived_canary_gets_lora_and_carries_what_its_source_carries() -> None:
    d = _base()
    d["adapters"][1]["instances"] = ["a"]  # a is the first primary of tiny: the canary's source
    d["rollouts"] = [{"model": "tiny", "canary": {"name": "cn", "host": "h2", "port": 8109}}]
    spec = parse_spec(d)
    canary = spec.model("cn")
    assert spec.lora_on(canary) and spec.max_lora_rank(canary) == 16
    assert [(x.name, c) for x, c in spec.instance_adapters(canary)] == [("sql", True), ("chat", True)]
    assert spec.adapter_carriers(spec.adapters[1]) == ["a", "cn"]
    assert "--enable-lora" in engine_args(spec, canary)


def test_the_spec_hash_of_a_spec_without_adapters_is_unchanged_and_adapters_change_it() -> None:
    d = _base()
    d["adapters"] = []
    before = spec_hash(parse_spec(d))
    assert spec_hash(parse_spec({**d, "adapters": []})) == before
    d2 = copy.deepcopy(d)
    d2["models"][0]["lora"] = {}
    assert spec_hash(parse_spec(d2)) != before
    assert spec_hash(parse_spec(_base())) != before
    # the dump of a spec without them carries no `adapters` / `lora` keys into the hash
    dumped = parse_spec(d).model_dump(mode="json")
    assert dumped["adapters"] == [] and dumped["models"][0]["lora"] is None


# --------------------------------------------------------------------------- the engine


def test_the_engine_flags_and_env_only_with_lora_and_never_lora_modules() -> None:
    d = _base()
    d["models"][1]["lora"] = {"max_loras": 2, "max_cpu_loras": 6}
    spec = parse_spec(d)
    a, b, o = spec.models
    args = engine_args(spec, a)
    i = args.index("--enable-lora")
    assert args[i : i + 5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
    assert "--max-cpu-loras" not in args
    b_args = engine_args(spec, b)
    assert b_args[b_args.index("--max-loras") + 1] == "2"
    assert b_args[b_args.index("--max-cpu-loras") + 1] == "6"
    for m in (a, b, o):
        assert "--lora-modules" not in engine_args(spec, m)
    assert not any("lora" in x for x in engine_args(spec, o))
    env = engine_env(spec, a)
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert env["VLLM_FLEET_ADAPTERS_FILE"] == "/etc/vllm-fleet/instances/a.adapters.json"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in engine_env(spec, o)
    assert "VLLM_FLEET_ADAPTERS_FILE" not in engine_env(spec, o)


@pytest.mark.parametrize("flag", ["--lora-modules", "--enable-lora", "--max-lora-rank", "--max-loras"])
def test_extra_args_may_not_set_the_lora_flags(flag: str) -> None:
    d = _base()
    d["models"][0]["extra_args"] = [flag, "x"]
    plan = make_plan(parse_spec(d))
    assert any(p.path == "models[0].extra_args[0]" and "set by vllm-fleet" in p.reason for p in plan.problems)


# --------------------------------------------------------------------------- the plan


def _gpu(lora: dict[str, Any] | None, adapters: list[dict[str, Any]] | None = None) -> FleetSpec:
    return parse_spec(
        {
            "stack": {"profile": "gpu"},
            "hosts": [{"name": "g", "address": "10.0.0.1", "gpus": {
                "count": 1, "model": "H100", "memory_gib": 80, "compute_capability": "9.0"}}],
            "models": [{"name": "small-cfg", "host": "g", "port": 8001, "gpus": [0], "max_model_len": 8192,
                        "max_num_seqs": 64, "source": {"hf": {"repo": "o/s", "revision": "a" * 40}},
                        **({"lora": lora} if lora is not None else {})}],
            "adapters": adapters or [],
            "gateway": {"auth": "none"},
        }
    )  # fmt: skip


def test_the_lora_slots_are_taken_from_the_kv_cache_on_the_gpu_profile() -> None:
    models = REPO / "tests/fixtures/plan/models"
    off = make_plan(_gpu(None), [models]).instances[0]
    on = make_plan(_gpu({"max_loras": 3, "max_lora_rank": 32}), [models]).instances[0]
    # per layer, rank × (in + out) of q, k, v, o, gate, up, down; the embedding and the LM head, rank × (vocab
    # + hidden) each; 2 bytes (bf16)
    h, inter, q, kv = 1024, 3072, 16 * 128, 8 * 128
    widths = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + inter)
    vocab = 2 * (SMALL_CFG["vocab_size"] + h)
    want = 3 * 32 * (SMALL_CFG["num_hidden_layers"] * widths + vocab) * 2
    assert on.lora_bytes == want and off.lora_bytes is None
    assert on.kv_cache_bytes is not None and off.kv_cache_bytes is not None
    assert off.kv_cache_bytes - on.kv_cache_bytes == want
    assert on.lora == {"max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": None}
    plan = make_plan(_gpu({"max_loras": 3, "max_lora_rank": 32}), [models])
    assert f"lora: max_loras 3 × max_lora_rank 32: lora_bytes {want} " in format_plan(plan)
    d = plan.to_dict()["instances"][0]
    assert d["lora_bytes"] == want
    # a plan without LoRA has neither key (its JSON is what it was before LoRA)
    assert "lora" not in make_plan(_gpu(None), [models]).to_dict()["instances"][0]


def test_the_lora_slots_count_in_the_cpu_hosts_memory() -> None:
    def spec(lora: dict[str, Any] | None) -> FleetSpec:
        d = _base()
        d["adapters"] = []
        d["hosts"][0]["memory_gib"] = 5  # 2 × (0.3 GiB weights + 64 MiB KV + 2 GiB overhead) fit
        for m in d["models"][:2]:
            m["source"] = {"path": "/nonexistent"}
            m["max_model_len"] = 512
        if lora is not None:
            d["models"][1]["lora"] = lora
        return parse_spec(d)

    facts = facts_from_config(SMALL_CFG, int(0.3 * 2**30), "cfg")
    assert facts.hidden_size == 1024 and facts.intermediate_size == 3072 and facts.num_attention_heads == 16
    detected = {"h1": {"models": {n: {"config": SMALL_CFG, "weight_bytes": int(0.3 * 2**30)} for n in "ab"}}}
    ok = make_plan(spec(None), detected=detected)
    assert ok.ok, ok.problems
    big = make_plan(spec({"max_loras": 64, "max_lora_rank": 256}), detected=detected)
    assert big.instances[0].lora_bytes is None and big.instances[1].lora_bytes
    assert big.instances[1].lora_bytes > 2**30
    assert [p.path for p in big.problems] == ["models[1].kv_cache_memory_bytes"], big.problems


def test_a_rank_above_an_instances_slots_and_a_rank_vllm_does_not_accept_are_refused() -> None:
    d = _base()
    d["models"][0]["lora"] = {"max_lora_rank": 8}
    plan = make_plan(parse_spec(d))
    got = [(p.path, p.reason) for p in plan.problems]
    assert any(
        p == "adapters[1].rank" and "rank 16 of 'chat' is above max_lora_rank 8 of instance 'a'" in r
        for p, r in got
    ), got
    assert not any(p == "adapters[0].rank" for p, _ in got)  # sql (8) fits
    d["models"][0]["lora"] = {"max_lora_rank": 24}
    got = [(p.path, p.reason) for p in make_plan(parse_spec(d)).problems]
    assert any(p == "models[0].lora.max_lora_rank" and "24 is not a rank vLLM accepts" in r for p, r in got)


def test_a_release_without_the_lora_flags_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    known = engine_flags.load("cpu", "0.32.0")
    assert (
        known is not None and {"--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"} <= known
    )
    assert make_plan(parse_spec(_base())).ok
    monkeypatch.setattr(engine_flags, "load", lambda profile, version: known - {"--max-lora-rank"})
    got = [(p.path, p.reason) for p in make_plan(parse_spec(_base())).problems]
    assert [p for p, _ in got] == ["models[0].lora", "models[1].lora"], got
    assert "--max-lora-rank" in got[0][1] and "stack.vllm_version" in got[0][1]


def test_the_example_plans() -> None:
    assert cli.main(["plan", str(EXAMPLE)]) == 0


# --------------------------------------------------------------------------- contract, render, adapters file


def test_a_hosts_contract_lists_the_adapters_of_its_lora_instances_only() -> None:
    spec = parse_spec(_base())
    c1, c2 = host_contract(spec, "h1"), host_contract(spec, "h2")
    assert [(a.name, a.base, a.rank, a.model_path) for a in c1.adapters] == [
        ("sql", "tiny", 8, "/srv/ad/sql"),
        ("chat", "tiny", 16, "/var/lib/vllm-fleet/models/adapters/chat"),
    ]
    assert c1.adapters[1].source.kind == "hf" and c1.adapters[1].source.revision == "v1"
    assert c2.adapters == [] and "adapters" not in c2.to_dict()  # h2's contract reads as before adapters
    assert HostContract.from_dict(json.loads(c1.dumps())) == c1
    assert [a.name for a in fleet_adapters(spec)] == ["sql", "chat"]
    # never an instance's model: adapters are their own list
    assert [m.name for m in c1.models] == ["a", "b"]
    bad = c1.to_dict()
    bad["adapters"].append(dict(bad["adapters"][0]))
    with pytest.raises(ContractError, match=r"adapters\[2\]\.name: 'sql' is listed twice"):
        HostContract.from_dict(bad, "host.json")


def test_the_rendered_adapters_file_per_lora_instance() -> None:
    spec = load_spec(EXAMPLE)
    r = Renderer(spec)
    files = {x.dest: x for h in ("h1", "h2") for x in r.render_host(h) if is_adapters_file(x.dest)}
    assert set(files) == {
        "/etc/vllm-fleet/instances/tiny-a.adapters.json",
        "/etc/vllm-fleet/instances/tiny-b.adapters.json",
    }
    got = AdaptersFile.from_dict(json.loads(files["/etc/vllm-fleet/instances/tiny-a.adapters.json"].content))
    assert (got.schema, got.instance, got.model) == (ADAPTERS_FILE_SCHEMA, "tiny-a", "tiny-qwen3")
    assert [(a.name, a.path, a.rank, a.carry) for a in got.adapters] == [
        ("tiny-sql", "/var/lib/vllm-fleet/models/adapters/tiny-sql", 8, True),
        ("tiny-chat", "/var/lib/vllm-fleet/models/adapters/tiny-chat", 8, False),
    ]
    assert [a.name for a in got.carried] == ["tiny-sql"]
    b = AdaptersFile.from_dict(json.loads(files["/etc/vllm-fleet/instances/tiny-b.adapters.json"].content))
    assert [a.name for a in b.carried] == ["tiny-sql", "tiny-chat"]
    assert got.dumps() == files["/etc/vllm-fleet/instances/tiny-a.adapters.json"].content
    # the role's item says what a change of it does; the instance config and the other files restart
    items = r.artifact_list("h1")
    mine = [i for i in items if is_adapters_file(i["dest"])]
    assert [(i["instance_name"], i["on_change"], i["component"]) for i in mine] == [
        ("tiny-a", "adapters_sync", "engine")
    ]
    assert all("on_change" not in i for i in items if not is_adapters_file(i["dest"]))
    # no adapters file where LoRA is off
    plain = Renderer(load_spec(REPO / "examples/tiny-cpu-2hosts.yml"))
    assert not [x for x in plain.render_host("h1") if is_adapters_file(x.dest)]


def test_the_gateways_view_and_the_hosts_adapter_folders() -> None:
    spec = load_spec(EXAMPLE)
    vf = build_context(spec, "h2")["vf"]
    assert vf["adapters"] == [
        {"name": "tiny-sql", "base": "tiny-qwen3", "carriers": ["tiny-a", "tiny-b"], "rank": 8},
        {"name": "tiny-chat", "base": "tiny-qwen3", "carriers": ["tiny-b"], "rank": 8},
    ]
    assert vf["adapter_paths"] == [
        "/var/lib/vllm-fleet/models/adapters/tiny-sql",
        "/var/lib/vllm-fleet/models/adapters/tiny-chat",
    ]
    assert [a["name"] for a in vf["host_contract"]["adapters"]] == ["tiny-sql", "tiny-chat"]
    (inst,) = vf["instances"]
    assert inst["lora_on"] and [a["carry"] for a in inst["adapters"]] == [True, True]
    assert inst["spec_entry"]["lora"] == {"max_loras": 2, "max_lora_rank": None, "max_cpu_loras": None}
    plain = build_context(load_spec(REPO / "examples/tiny-cpu-2hosts.yml"), "h1")["vf"]
    assert all("lora" not in i["spec_entry"] for i in plain["instances"])  # its configs are unchanged


def test_a_modelscope_adapter_is_named_among_the_hosts_modelscope_sources() -> None:
    d = _base()
    d["adapters"][1]["source"] = {"modelscope": {"repo": "org/chat", "revision": "v1"}}
    vf = build_context(parse_spec(d), "h1")["vf"]
    assert vf["modelscope_sources"] == ["adapters[chat].source.modelscope"]


# --------------------------------------------------------------------------- what the play does


INSTANCES = [
    {"name": "a", "unit": "vllm@a.service", "model_path": "/m", "lora_on": True,
     "adapters": [{"name": "sql"}, {"name": "chat"}]},
    {"name": "b", "unit": "vllm@b.service", "model_path": "/m", "lora_on": True, "adapters": [{"name": "sql"}]},
    {"name": "c", "unit": "vllm@c.service", "model_path": "/m", "lora_on": False, "adapters": []},
]  # fmt: skip
ADAPTERS_FILE = {"dest": "/etc/vllm-fleet/instances/a.adapters.json", "instance_name": "a",
                 "on_change": "adapters_sync"}  # fmt: skip


def test_a_changed_adapters_file_restarts_nothing_and_is_synced() -> None:
    assert restarts(INSTANCES, [ADAPTERS_FILE], [], False) == []
    config = {"dest": "/etc/vllm-fleet/instances/b.json", "instance_name": "b"}
    assert restarts(INSTANCES, [ADAPTERS_FILE, config], [], False) == ["b"]
    running = ["vllm@a.service", "vllm@b.service", "vllm@c.service"]
    assert adapter_syncs(INSTANCES, [ADAPTERS_FILE], [], running) == [{"instance": "a", "reload": []}]
    # changed adapter files: every running LoRA instance that has the adapter reloads it
    assert adapter_syncs(INSTANCES, [], ["chat", "sql"], running) == [
        {"instance": "a", "reload": ["sql", "chat"]},
        {"instance": "b", "reload": ["sql"]},
    ]
    # not one that was not running (it starts with them), nor one that restarts now
    assert adapter_syncs(INSTANCES, [ADAPTERS_FILE], ["sql"], ["vllm@b.service"]) == [
        {"instance": "b", "reload": ["sql"]}
    ]
    assert adapter_syncs(INSTANCES, [ADAPTERS_FILE], ["sql"], running, restart=["a"]) == [
        {"instance": "b", "reload": ["sql"]}
    ]
    assert adapter_syncs(INSTANCES, [config], [], running) == []


def test_a_held_instance_keeps_its_files_but_gets_its_adapters_file() -> None:
    items = [
        {"component": "engine", "dest": "/etc/vllm-fleet/instances/a.json", "instance_name": "a"},
        {**ADAPTERS_FILE, "component": "engine"},
    ]
    assert [i["dest"] for i in artifact_items(items, "engine", hold=["a"])] == [ADAPTERS_FILE["dest"]]
    configs = ["/etc/vllm-fleet/instances/a.json", "/etc/vllm-fleet/instances/a.adapters.json"]
    assert held({"a": "tiny", "a.adapters": "tiny"}, configs) == ["a"]


def test_what_the_fetch_changed_of_the_adapters() -> None:
    report = {
        "changed": True,
        "models": [{"instance": "a", "path": "/m/a", "changed": False}],
        "adapters": [
            {"adapter": "sql", "base": "tiny", "path": "/ad/sql", "changed": True},
            {"adapter": "chat", "base": "tiny", "path": "/ad/chat", "changed": False},
        ],
    }
    pushed = [{"changed": True, "item": {"model_path": "/ad/chat"}}]
    got = fetched({"stdout": json.dumps(report)}, pushed, ["/ad/sql", "/ad/chat"])
    # an adapter folder is never a model folder whose instances restart
    assert got["changed"] == [] and got["adapters_changed"] == ["sql", "chat"]
    assert set(got["adapters"]) == {"sql", "chat"} and set(got["models"]) == {"a"}


# --------------------------------------------------------------------------- the fetch


def _adapter_dir(d: Path, rank: int = 8) -> Path:
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank}))
    (d / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    return d


def _fetch_spec(tmp_path: Path, rank: int = 8) -> tuple[FleetSpec, Path]:
    model = tmp_path / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    d = _base()
    d["models"] = [{**d["models"][0], "source": {"path": str(model)}}]
    d["adapters"] = [
        {"name": "sql", "base": "tiny", "source": {"path": str(tmp_path / "ad" / "sql")}, "rank": rank}
    ]
    spec_file = tmp_path / "fleet.yml"
    spec_file.write_text(json.dumps(d))
    return parse_spec(d), spec_file


def test_fetch_verifies_adapters_apart_from_the_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec, spec_file = _fetch_spec(tmp_path)
    _adapter_dir(tmp_path / "ad" / "sql")
    contract = tmp_path / "host.json"
    contract.write_text(host_contract(spec, "h1").dumps())
    assert cli.main(["fetch", "--contract", str(contract), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [m["instance"] for m in got["models"]] == ["a"]
    (ad,) = got["adapters"]
    assert (ad["adapter"], ad["base"], ad["path"], ad["changed"]) == (
        "sql",
        "tiny",
        str(tmp_path / "ad/sql"),
        True,
    )
    assert set(ad["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert cli.main(["fetch", "--contract", str(contract), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert not again["changed"] and not again["adapters"][0]["changed"]
    # a changed adapter file: the adapter changed, the model did not
    (tmp_path / "ad/sql/adapter_model.safetensors").write_bytes(b"\x01" * 64)
    assert cli.main(["fetch", "--contract", str(contract), "--json"]) == 0
    third = json.loads(capsys.readouterr().out)
    assert third["adapters"][0]["changed"] and not third["models"][0]["changed"]
    # --instance: its model only; --adapter: that adapter only
    assert cli.main(["fetch", "--contract", str(contract), "--json", "--instance", "a"]) == 0
    assert json.loads(capsys.readouterr().out)["adapters"] == []
    assert cli.main(["fetch", "--contract", str(contract), "--json", "--adapter", "sql"]) == 0
    only = json.loads(capsys.readouterr().out)
    assert only["models"] == [] and [a["adapter"] for a in only["adapters"]] == ["sql"]
    # the text form names them apart
    assert cli.main(["fetch", str(spec_file), "--host", "h1"]) == 0
    assert "adapter sql: " in capsys.readouterr().out


def test_fetch_from_a_folder_copies_a_path_adapter_by_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _spec, spec_file = _fetch_spec(tmp_path)
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "config.json").write_text("{}")
    _adapter_dir(src / "sql")
    dest = tmp_path / "dest"
    rc = cli.main(["fetch", str(spec_file), "--dest", str(dest), "--from", str(src), "--json"])
    assert rc == 0, capsys.readouterr().err
    got = json.loads(capsys.readouterr().out)
    assert got["adapters"][0]["path"] == str(dest / "adapters" / "sql")
    assert json.loads((dest / "adapters/sql/adapter_config.json").read_text())["r"] == 8
    # the host's way: --from into the adapter's own folder (what the play's push does)
    rc = cli.main(["fetch", str(spec_file), "--host", "h1", "--from", str(src), "--adapter", "sql"])
    assert rc == 0 and (tmp_path / "ad/sql/adapter_model.safetensors").is_file()


def test_fetch_refuses_an_adapter_of_another_rank_or_without_its_config(tmp_path: Path) -> None:
    spec, _ = _fetch_spec(tmp_path, rank=16)
    _adapter_dir(tmp_path / "ad" / "sql", rank=8)
    adapters = host_contract(spec, "h1").adapters
    with pytest.raises(FetchError, match=r"adapters\[sql\]\.rank 16: .* says r = 8"):
        fetch_adapters(adapters)
    (tmp_path / "ad/sql/adapter_config.json").unlink()
    with pytest.raises(FetchError, match=r"adapters\[sql\] at .*: no adapter_config.json"):
        fetch_adapters(adapters)
    missing, _ = _fetch_spec(tmp_path / "other")
    with pytest.raises(FetchError, match=r"adapters\[sql\]\.source\.path .* does not exist"):
        fetch_adapters(host_contract(missing, "h1").adapters)


# --------------------------------------------------------------------------- the tiny adapter


def test_the_tiny_adapter(tmp_path: Path) -> None:
    from safetensors import safe_open

    from vllm_fleet.devtools.tinymodel import build_tiny_adapter

    base = tmp_path / "tiny"
    base.mkdir()
    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    (base / "config.json").write_text(json.dumps(cfg))
    out = build_tiny_adapter(base, tmp_path / "ad", rank=4, seed=3)
    conf = json.loads((out / "adapter_config.json").read_text())
    assert (conf["r"], conf["peft_type"], conf["base_model_name_or_path"]) == (4, "LORA", "tiny-qwen3")
    assert conf["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])  # fmt: skip
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert len(keys) == 2 * 7 * 2
        q_a = f.get_tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight")
        k_b = f.get_tensor("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight")
        down_a = f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight")
    assert tuple(q_a.shape) == (4, 64) and tuple(k_b.shape) == (2 * 32, 4) and tuple(down_a.shape) == (4, 128)
    assert str(q_a.dtype) == "torch.bfloat16"
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir())
    # an identical build is skipped; another rank is built again
    stamp = (out / "adapter_model.safetensors").stat().st_mtime_ns
    os.utime(out / "adapter_model.safetensors", ns=(stamp - 10**9, stamp - 10**9))
    build_tiny_adapter(base, out, rank=4, seed=3)
    assert (out / "adapter_model.safetensors").stat().st_mtime_ns == stamp - 10**9
    build_tiny_adapter(base, out, rank=8, seed=3)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 8


# tools/gpu-validate/lora.py writes its adapters with tinymodel.write_lora_adapter on a GPU box whose Python has
# only the engine's packages and the repo: importing tinymodel and sizing an adapter may not need torch (imported
# by the write itself), pydantic or yaml (the spec)
WIDTHS_WITHOUT_HEAVY_IMPORTS = """
import json, sys


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "safetensors", "transformers", "pydantic", "yaml", "jinja2"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Block())
from vllm_fleet.devtools.tinymodel import adapter_widths, qwen3_8b_config

print(json.dumps(adapter_widths(qwen3_8b_config())))
"""


def test_an_adapter_s_widths_are_the_planner_s_and_need_no_heavy_import() -> None:
    import subprocess
    import sys

    from vllm_fleet.fleet.modelinfo import lora_widths

    r = subprocess.run(
        [sys.executable, "-c", WIDTHS_WITHOUT_HEAVY_IMPORTS], capture_output=True, text=True, cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    widths = {k: tuple(v) for k, v in json.loads(r.stdout).items()}
    assert widths["self_attn.q_proj"] == (4096, 4096) and widths["self_attn.k_proj"] == (4096, 1024)
    assert widths["mlp.down_proj"] == (12288, 4096)
    from vllm_fleet.devtools.tinymodel import qwen3_8b_config

    assert list(widths.values()) == lora_widths(facts_from_config(qwen3_8b_config(), None, "x"))


def test_facts_of_a_shape_only_model_have_no_projection_widths() -> None:
    assert ModelFacts(params=1, num_layers=2, num_kv_heads=2, head_dim=32).hidden_size is None


def test_the_doctor_does_not_take_an_adapters_file_for_an_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_fleet.host import doctor

    (tmp_path / "a.json").write_text(json.dumps({"gpus": [0]}))
    (tmp_path / "a.adapters.json").write_text(json.dumps({"schema": 1, "instance": "a", "adapters": []}))
    asked: list[str] = []

    def run(cmd: list[str], timeout: float) -> tuple[int, str, str]:
        units = [c for c in cmd if c.startswith("vllm@")]
        asked.extend(units)
        return 0, "active\n" * len(units), ""

    monkeypatch.setattr(doctor, "run", run)
    assert doctor.running_instance_gpus(str(tmp_path)) == {0: "a"}
    assert asked == ["vllm@a.service"]
