"""tools/gpu-validate/lora_fleet.py's pure parts and its spec: the device spec moved to another root and scaled,
the spec change of the sync step (only the adapters file changes, not the instance config: no restart), and the
outcome of a request through the gateway (a plain or streamed answer, an error carried by a 200, a refusal with or
without a JSON body and Retry-After) with the burst's verdict over them."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.testing import load_tool
from vllm_fleet.devtools.testing import strings_in as strings
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import parse_spec

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lf() -> ModuleType:
    return load_tool(REPO / "tools" / "gpu-validate" / "lora_fleet.py", "gpu_lora_fleet")


def test_the_spec_moves_to_the_local_root_and_the_sync_step_changes_only_the_adapters_file(
    lf: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "vf"
    lay = lf.Layout(root, local=True, engine_port=18002, gw_port=18000, stub_port=18081,
                    admission_metrics_port=19402)  # fmt: skip
    base = yaml.safe_load(lf.SPEC.read_text())
    sums = {f"a{i:02d}": {"adapter_config.json": f"{i:064x}"} for i in range(9)}
    d1 = lf.spec_data(base, lay, 8, {k: v for k, v in sums.items() if k != "a08"})
    assert not [s for s in strings(d1) if s.startswith("/root/vf")]
    assert (
        d1["paths"]["state_dir"] == f"{root}/run"
        and d1["adapters"][0]["source"]["path"] == f"{root}/adapters/a00"
    )
    assert (d1["models"][0]["port"], d1["gateway"]["port"], d1["gateway"]["limits"]["metrics_port"]) == (
        18002, 18000, 19402,
    )  # fmt: skip
    # the lab key: 1.5 x max_num_seqs in flight, 2 x queued
    lim = d1["gateway"]["limits"]
    assert (lim["default_key"], lim["max_queued_per_key"], d1["models"][0]["max_num_seqs"]) == (
        {"max_in_flight": 12}, 16, 8,
    )  # fmt: skip
    assert d1["adapters"][3]["source"]["checksums"] == sums["a03"]
    assert (lf.carried(d1), lf.listed(d1)) == (["a00", "a01", "a02", "a03"], [f"a{i:02d}" for i in range(8)])
    # the base is untouched (a copy is changed)
    assert base["models"][0]["port"] == 8002 and "checksums" not in base["adapters"][0]["source"]

    d2 = lf.edit_adapters(d1, "a08", "a03", root / "adapters", sums["a08"])
    assert lf.carried(d2) == ["a00", "a01", "a02", "a08"] and "a03" not in lf.listed(d2)
    assert lf.carried(d1) == ["a00", "a01", "a02", "a03"]  # d1 as it was
    inst = root / "etc" / "instances"
    out = {}
    for tag, d in (("initial", d1), ("edited", d2)):
        render_fleet(parse_spec(d, tag), tmp_path / tag)
        folder = tmp_path / tag / "h200" / str(inst).lstrip("/")
        out[tag] = (json.loads((folder / "qwen3-8b.json").read_text()),
                    json.loads((folder / "qwen3-8b.adapters.json").read_text()))  # fmt: skip
    assert out["initial"][0] == out["edited"][0], "an adapter change must not change the instance config"
    cfg = out["initial"][0]
    assert (
        "--enable-lora" in cfg["command"] and cfg["command"][cfg["command"].index("--max-loras") + 1] == "8"
    )
    rows = {tag: {a["name"]: a["carry"] for a in doc["adapters"]} for tag, (_, doc) in out.items()}
    assert rows["initial"]["a03"] is True and "a08" not in rows["initial"]
    assert rows["edited"]["a08"] is True and "a03" not in rows["edited"]
    assert {k: v for k, v in rows["initial"].items() if k != "a03"} == {
        k: v for k, v in rows["edited"].items() if k != "a08"
    }


def sse(*events: Any) -> str:
    return "".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events)


def rec(lf: ModuleType, *a: Any, group: str = "adapter", ttft: float | None = None) -> dict[str, Any]:
    r = lf.outcome(*a)
    model, stream = a[-1], a[-2]
    out = {**r, "model": model, "stream": stream, "group": group, "seconds": 1.0}
    if ttft is not None:
        out["ttft"] = ttft
    return dict(out)


def test_a_plain_chat_answer_is_complete_and_one_without_content_is_not(lf: ModuleType) -> None:
    chat = {"model": "m00", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}
    r = rec(lf, 200, json.dumps(chat), "application/json", None, None, False, "m00")
    assert (r["kind"], r["model_ok"]) == ("complete", True)
    empty = {"model": "m00", "choices": [{"index": 0, "message": {"role": "assistant"}}]}
    for doc in (empty, {"model": "m00"}):
        assert (
            rec(lf, 200, json.dumps(doc), "application/json", None, None, False, "m00")["kind"]
            == "other_status"
        )
    delta = sse({"model": "m00", "choices": [{"delta": {"content": "x"}}]}, "[DONE]")
    assert rec(lf, 200, delta, "text/event-stream", None, None, True, "m00")["kind"] == "complete"


def test_outcomes_and_the_burst_verdict(lf: ModuleType) -> None:
    plain = json.dumps({"model": "a01", "choices": [{"text": "hi", "index": 0}]})
    stream = sse(
        {"model": "a02", "choices": [{"text": "x"}]}, {"model": "a02", "choices": [{"text": "y"}]}, "[DONE]"
    )
    err_stream = sse(
        {"model": "a02", "choices": [{"text": "x"}]}, {"error": {"message": "boom", "code": 500}}, "[DONE]"
    )
    refusal = json.dumps({"error": {"message": "too many (queue_full)", "type": "rate_limit_exceeded",
                                    "code": "rate_limit_exceeded"}})  # fmt: skip
    ok_plain = rec(lf, 200, plain, "application/json", None, None, False, "a01")
    assert (ok_plain["kind"], ok_plain["model_ok"]) == ("complete", True)
    wrong_model = rec(lf, 200, plain, "application/json", None, None, False, "a05")
    assert (wrong_model["kind"], wrong_model["model_ok"]) == ("complete", False)
    ok_stream = rec(lf, 200, stream, "text/event-stream", None, None, True, "a02", ttft=0.2)
    assert (ok_stream["kind"], ok_stream["model_ok"]) == ("complete", True)
    assert rec(lf, 200, err_stream, "text/event-stream", None, None, True, "a02")["kind"] == "error_200"
    r429 = rec(lf, 429, refusal, "application/json", "2", None, True, "a03")
    assert (r429["kind"], r429["json_error"], r429["retry_after"], r429["reason"]) == (
        "refused",
        True,
        "2",
        "queue_full",
    )
    html503 = rec(lf, 503, "<html>busy</html>", "text/html", None, None, False, "qwen3-8b", group="base")
    assert (html503["kind"], html503["json_error"]) == ("refused", False)
    r502 = rec(lf, 502, refusal, "application/json", None, None, False, "a03")
    assert r502["kind"] == "other_status"
    base_ok = rec(lf, 200, sse({"model": "qwen3-8b", "choices": [{"text": "z"}]}, "[DONE]"), "text/event-stream",
                  None, None, True, "qwen3-8b", group="base", ttft=0.1)  # fmt: skip

    good = lf.tally([ok_plain, ok_stream, r429, base_ok])
    assert good["by_kind"] == {"complete": 3, "refused": 1} and good["by_status"] == {"200": 3, "429": 1}
    assert good["groups"]["adapter"]["ttft_p50_s"] == 0.2 and good["groups"]["adapter"]["ttft_n"] == 1
    assert good["groups"]["base"]["ttft_p50_s"] == 0.1 and good["groups"]["adapter"]["plain_e2e_p50_s"] == 1.0
    assert all(lf.burst_verdict(good).values()), lf.burst_verdict(good)

    assert not lf.burst_verdict(lf.tally([ok_plain, base_ok, wrong_model]))["answers_name_their_model"]
    assert not lf.burst_verdict(lf.tally([ok_plain, base_ok, html503]))[
        "refusals_429_503_json_with_retry_after"
    ]
    no_ra = dict(r429, retry_after=None)
    assert not lf.burst_verdict(lf.tally([ok_plain, base_ok, no_ra]))[
        "refusals_429_503_json_with_retry_after"
    ]
    v = lf.burst_verdict(lf.tally([ok_plain, base_ok, r502], cut=2))
    assert not v["only_complete_or_refused"] and not v["none_cut"]
    assert not lf.burst_verdict(lf.tally([ok_plain, ok_stream]))["base_and_adapters_served"]


def test_lora_requests_info_labels(lf: ModuleType) -> None:
    text = (
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="8",running_lora_adapters="a00,a05",waiting_lora_adapters=""} 1.7e9\n'
        'vllm:num_requests_running{engine="0",model_name="qwen3-8b"} 3.0\n'
    )
    lines = lf.lora_info_lines(text)
    assert len(lines) == 1
    assert lf.lora_info_labels(lines[0]) == {
        "max_lora": "8", "running_lora_adapters": "a00,a05", "waiting_lora_adapters": "",
    }  # fmt: skip
