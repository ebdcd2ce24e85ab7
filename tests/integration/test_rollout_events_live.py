"""Rollout events through the real Alertmanager to "Slack": the configuration rendered from an example spec with
Slack on (only the notification timing shortened), basic auth on as deployed, post_event() of a rollback and of
an info step, and what the Slack-compatible receiver got (vllm_fleet.devtools.slack.SlackReceiver)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.slack import SlackReceiver
from vllm_fleet.devtools.testing import free_port
from vllm_fleet.fleet import rollout_gate as rg
from vllm_fleet.fleet.render import render_monitoring
from vllm_fleet.fleet.spec import FleetSpec, parse_spec
from vllm_fleet.fleet.status import basic_auth_header

REPO = Path(__file__).resolve().parents[2]
AUTH = ("vllm-fleet", "rollout-test-password")

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus-alertmanager") is None, reason="Debian prometheus-alertmanager missing"
)

INFO = "tiny-canary in rotation: 10% of tiny-qwen3"


def _get_ok(url: str) -> bool:
    req = urllib.request.Request(url, headers={"Authorization": basic_auth_header(AUTH)})
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def _wait(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.3)
    return False


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FleetSpec, str, SlackReceiver]]:
    work = tmp_path_factory.mktemp("rollout-events")
    slack = SlackReceiver()
    (work / "slack_url").write_text(slack.url + "\n")
    data = yaml.safe_load((REPO / "examples" / "tiny-cpu-2hosts.yml").read_text())
    data["rollouts"] = [
        {
            "model": "tiny-qwen3",
            "canary": {"name": "tiny-canary", "host": "h2", "port": 8103},
            "slo": {"ttft_p95_seconds": 1.0, "error_ratio": 0.02},
        }
    ]
    data["slack"] = {
        "enabled": True,
        "channel": "#rollouts-test",
        "webhook_url_file": str(work / "slack_url"),
    }
    data["alerts"] = {"group_wait": "1s", "group_interval": "2s"}
    data["monitoring"] = {**data["monitoring"], "alertmanager_port": free_port()}
    spec = parse_spec(data)
    render_monitoring(spec, work / "out", folders=("monitoring",))
    with (
        warnings.catch_warnings()
    ):  # crypt: deprecated, as the web-config module uses it (libxcrypt's bcrypt)
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt

        hashed = crypt.crypt(AUTH[1], crypt.mksalt(crypt.METHOD_BLOWFISH))
    # what the vllm_fleet_web_config module writes on a host (monitoring.web_config_file)
    (work / "web.yml").write_text(yaml.safe_dump({"basic_auth_users": {AUTH[0]: hashed}}))
    port = spec.monitoring.alertmanager_port
    log = (work / "alertmanager.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus-alertmanager",
            f"--config.file={work / 'out' / 'h1' / 'etc' / 'prometheus' / 'alertmanager.yml'}",
            f"--storage.path={work / 'am'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            f"--web.config.file={work / 'web.yml'}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait(lambda: _get_ok(url + "/-/ready"), 60), (work / "alertmanager.log").read_text()
        yield spec, url, slack
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        slack.close()


def test_rollback_event_reaches_slack_with_the_numbers(
    alertmanager: tuple[FleetSpec, str, SlackReceiver],
) -> None:
    spec, url, slack = alertmanager
    r = spec.rollouts[0]
    started = time.time() - 250
    dead = f"http://127.0.0.1:{free_port()}"
    # the canary's instance is down at the same moment: its alert must not silence the rollback
    down = [{"labels": {"alertname": "VllmInstanceDown", "instance": "tiny-canary", "host": "h2",
                        "model": "tiny-qwen3", "severity": "critical"}, "annotations": {"summary": "down"}}]  # fmt: skip
    req = urllib.request.Request(
        url + "/api/v2/alerts", data=json.dumps(down).encode(),
        method="POST", headers={"Content-Type": "application/json", "Authorization": basic_auth_header(AUTH)},
    )  # fmt: skip
    urllib.request.urlopen(req, timeout=5).read()

    canary = rg.Figures("canary", 150, 2, 0.812, 2.13, seconds=250)
    stable = rg.Figures("stable", 1412, 3, 0.4, 2.012, seconds=250)
    verdict = rg.judge(r, canary, stable, 250)
    assert verdict.action == "rollback"
    event = rg.verdict_event(spec, r, started, verdict, canary, stable)

    # without the monitoring credentials Alertmanager refuses it
    reached, errors = rg.post_event([url], None, event)
    assert reached == [] and "HTTP 401" in errors[0]
    # every monitoring host is tried: one down, the other takes it
    reached, errors = rg.post_event([dead, url], AUTH, event)
    assert reached == [url] and len(errors) == 1 and dead in errors[0]
    info = rg.rollout_event(spec, r, started, "in_rotation", INFO)
    assert rg.post_event([url], AUTH, info)[0] == [url]

    def arrived() -> bool:
        texts = [a.get("text", "") for _, p in list(slack.posts) for a in p.get("attachments", [])]
        return any("ROLLBACK" in t for t in texts) and any(INFO in t for t in texts)

    assert _wait(arrived, 30), slack.posts
    posts = [(p, a) for _, p in list(slack.posts) for a in p.get("attachments", [])]
    rollback = [(p, a) for p, a in posts if "ROLLBACK" in a.get("text", "")]
    assert len(rollback) == 1
    payload, att = rollback[0]
    assert payload["channel"] == "#rollouts-test"
    assert att["title"].startswith("[FIRING:1] VllmFleetRollout model=tiny-qwen3")
    assert att["color"] == "warning"
    text = att["text"]
    assert text.startswith(
        "*WARNING* ROLLBACK tiny-qwen3 canary tiny-canary: canary TTFT p95 812 ms > 500 ms"
    )
    for needle in ("150", "1412", "(1.33%)", "(0.21%)", "812 ms", "400 ms", "2130 ms", rg.STABLE_TTFT, "```"):
        assert needle in text, needle
    assert att["title_link"].endswith("/VllmFleetRollout.md")
    # (the rollback's report says "in rotation" too: its time in rotation)
    info_att = next(a for _, a in posts if INFO in a.get("text", ""))
    assert info_att["text"].startswith("*INFO* tiny-canary in rotation") and info_att["color"] == "good"
    # the instance-down alert went its own way (the team channel, its own group)
    assert any("VllmInstanceDown" in a["title"] for _, a in posts)
