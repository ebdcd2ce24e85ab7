"""`ansible-playbook site.yml` against two real systemd hosts (nspawn sandbox), end to end.

h1: two tiny-model instances + gateway + monitoring, h2: a backup instance (examples/tiny-cpu-2hosts.yml).
Installs are offline from the wheelhouse (`vllm-fleet lock wheelhouse`, bound read-only into the hosts, which
have no route out); apt goes through the sandbox's apt proxy. The tests run in file order on one deployment:
refused spec (nothing changed) → --check --diff on the fresh hosts (reports changes, fails nothing, changes
nothing) → deploy + chat through the gateway → rerun changed=0 → testinfra suite (the README's command) →
--check reports no change → a flag change restarts only that instance (drained first), under steady client
traffic that loses no request → kill -9 of a primary under traffic: no plain request fails, systemd serves
it again.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vllm_fleet.devtools.gateway_testing import SteadyLoad
from vllm_fleet.devtools.testing import http_json

pytestmark = [pytest.mark.sandbox, pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
WHEELHOUSE_MOUNT = "/mnt/vf-wheelhouse"
TIMINGS = Path(os.environ.get("VLLM_FLEET_ANSIBLE_TIMINGS", "/tmp/vllm-fleet-ansible-timings.json"))
RECAP_RE = re.compile(
    r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)\s+skipped=\d+\s+rescued=\d+\s+ignored=(\d+)",
    re.M,
)
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


def retarget(spec: dict[str, Any], names: dict[str, str], addresses: dict[str, str]) -> dict[str, Any]:
    """The example spec with its host names and addresses replaced by the sandbox hosts'."""
    spec = json.loads(json.dumps(spec))
    for h in spec["hosts"]:
        h["address"] = addresses[h["name"]]
        h["name"] = names[h["name"]]
    for m in spec["models"]:
        m["host"] = names[m["host"]]
    for key in ("gateway", "monitoring"):
        if spec.get(key, {}).get("host"):
            spec[key]["host"] = names[spec[key]["host"]]
    return spec


def wheelhouse() -> Path:
    """The offline wheelhouse for the cpu lock, reusing the sandbox's wheels (built once, then cached)."""
    from vllm_fleet.devtools.sandbox_image import cache_dir, ensure_wheelhouse, file_lock
    from vllm_fleet.fleet.lock import build_wheelhouse, check_wheelhouse

    dest = cache_dir() / "ansible-wheelhouse"
    lock = REPO / "locks" / "cpu-0.32.0.txt"
    with file_lock(cache_dir() / ".ansible-wheelhouse.lock"):
        stale = (
            not (dest / "lock.txt").is_file() or (dest / "lock.txt").stat().st_mtime < lock.stat().st_mtime
        )
        if stale or check_wheelhouse(dest / "lock.txt", dest):
            build_wheelhouse(lock, dest, reuse=[ensure_wheelhouse()])
    return dest


@dataclass
class Fleet:
    spec_path: Path
    inventory: Path
    extra: list[str]
    hosts: dict[str, Any]
    spec: dict[str, Any]
    gateway_url: str
    templates: Path

    def playbook(self, *args: str, spec: Path | None = None, timeout: float = 1500) -> tuple[int, str, float]:
        env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg"),
                   ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0",
                   VLLM_FLEET_TEMPLATES=str(self.templates))  # fmt: skip
        cmd = [str(BIN / "ansible-playbook"), "-i", str(self.inventory), "site.yml",
               "-e", f"vllm_fleet_spec={spec or self.spec_path}", *self.extra, *args]  # fmt: skip
        t = time.monotonic()
        res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        return res.returncode, res.stdout + res.stderr, time.monotonic() - t

    def unit_pids(self) -> dict[str, str]:
        out = {}
        for m in self.spec["models"]:
            h = self.hosts[m["host"]]
            out[m["name"]] = h.run(
                f"systemctl show -p MainPID --value vllm@{m['name']}.service"
            ).stdout.strip()
        return out

    @property
    def api_key(self) -> str:
        """The gateway key the role generated on the controller (no vaulted list given)."""
        return (self.inventory.parent / "vllm-fleet-secrets" / "gateway-api-key").read_text().split()[0]

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def chat(self, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        body = {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        return http_json("POST", f"{self.gateway_url}/v1/chat/completions", body, timeout=60,
                         headers=self.auth if headers is None else headers)  # fmt: skip


def recap(output: str) -> dict[str, dict[str, int]]:
    keys = ("ok", "changed", "unreachable", "failed", "ignored")
    return {
        m.group(1): dict(zip(keys, map(int, m.groups()[1:]), strict=True)) for m in RECAP_RE.finditer(output)
    }


def record(key: str, seconds: float) -> None:
    data = json.loads(TIMINGS.read_text()) if TIMINGS.is_file() else {}
    data[key] = round(seconds, 1)
    TIMINGS.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def fleet(
    sandbox_factory: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    from vllm_fleet.devtools.sandbox import write_inventory

    wh = wheelhouse()
    work = tmp_path_factory.mktemp("ansible")
    names = {"h1": "ansible-h1", "h2": "ansible-h2"}
    hosts = {
        names[n]: sandbox_factory(
            names[n], engine=True, apt_proxy=True, binds_ro=[(str(wh), WHEELHOUSE_MOUNT)]
        )
        for n in ("h1", "h2")
    }
    example = yaml.safe_load((REPO / "examples" / "tiny-cpu-2hosts.yml").read_text())
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
    yield Fleet(spec_path, inventory, extra, hosts, spec, f"http://{gw}:{spec['gateway']['port']}", tree)


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
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", ANSIBLE_CONFIG=str(REPO / "ansible.cfg"))
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
ts = [threading.Thread(target=probe, args=tuple(t)) for t in json.loads(sys.argv[1])]
[t.start() for t in ts]; [t.join() for t in ts]
print(json.dumps(out))
"""


def listening_tcp_ports(h: Any) -> set[int]:
    """Every TCP port something listens on inside host ``h`` (any address, loopback included)."""
    out = h.run("ss -ltnH", check=True).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if line.strip()}


def probe_ports(targets: list[tuple[str, int]], via: Any = None) -> dict[str, str]:
    """PORT_PROBE from the test machine (``via`` None) or from the sandbox host ``via``."""
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
    """A port scan of every deployed host — every TCP port `ss -ltn` lists there, tried on the host's fleet
    address — from the test machine (neither gateway nor monitoring host) and, for the gateway/monitoring
    host, from the other sandbox host (an engine host, not the gateway or monitoring host): only SSH and the
    gateway answer; every other port refuses, drops, or answers 401/403."""
    gw_host = fleet.spec["gateway"]["host"]
    mon_host = fleet.spec["monitoring"]["host"]
    allowed = {22}
    findings: dict[str, dict[str, str]] = {}
    for name, h in fleet.hosts.items():
        ports = listening_tcp_ports(h)
        assert 22 in ports, (name, ports)
        open_here = allowed | ({fleet.spec["gateway"]["port"]} if name == gw_host else set())
        targets = [(h.address, p) for p in sorted(ports - open_here)]
        sources: list[tuple[str, Any]] = [("test machine", None)]
        sources += [
            (other, oh)
            for other, oh in fleet.hosts.items()
            if other != name and other not in (gw_host, mon_host)
        ]
        for label, via in sources:
            got = probe_ports(targets, via)
            findings[f"{name} from {label}"] = got
            bad = {k: v for k, v in got.items() if v not in ("refused", "dropped", "http 401", "http 403")}
            assert not bad, (name, label, got)
        # the gateway answers (its auth is another test's business) and SSH is reachable
        assert probe_ports([(h.address, 22)])[f"{h.address}:22"] == "open"
    print(json.dumps(findings, indent=1))
    gw = fleet.hosts[gw_host]
    assert probe_ports([(gw.address, fleet.spec["gateway"]["port"])]) != {
        f"{gw.address}:{fleet.spec['gateway']['port']}": "dropped"
    }
    # Debian's default site is gone: nothing listens on :80
    assert 80 not in listening_tcp_ports(gw)


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
    # no series of up is 0 (series of targets from before the deploy's restart may linger up to 5 min, at 1)
    status, body = call("/api/v1/query?query=up%20%3D%3D%200")
    assert status == 200 and json.loads(body)["data"]["result"] == [], body
    # Prometheus reaches Alertmanager with the credentials: it knows one active Alertmanager
    status, body = call("/api/v1/alertmanagers")
    assert len(json.loads(body)["data"]["activeAlertmanagers"]) == 1, body


def test_check_mode_reports_no_change(fleet: Fleet) -> None:
    rc, out, seconds = fleet.playbook("--check", "--diff")
    assert rc == 0, out[-4000:]
    record("check_run_seconds", seconds)
    changed = {h: r["changed"] for h, r in recap(out).items()}
    assert not any(changed.values()), (changed, out[-4000:])


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
    assert traffic.failures == [], traffic.failures[:5]
    assert min(traffic.ok.values()) > 5, traffic.ok
    record("flag_change_requests_during", traffic.total)
    after = fleet.unit_pids()
    restarted = sorted(n for n in before if before[n] != after[n])
    assert restarted == [target["name"]], (before, after)
    # it was drained on the gateway first and put back afterwards
    assert re.search(
        rf"TASK \[engine : Drain on the gateway - {target['name']}\].*?\n(changed|ok): ", out, re.S
    )
    gw = fleet.hosts[fleet.spec["gateway"]["host"]]
    state = gw.run("cat /etc/vllm-fleet/gateway/drained.json").stdout
    assert json.loads(state or '{"drained": []}')["drained"] == []
    h = fleet.hosts[target["host"]]
    cfg = json.loads(h.run(f"cat /etc/vllm-fleet/instances/{target['name']}.json").stdout)
    assert cfg["command"][cfg["command"].index("--max-num-seqs") + 1] == "8"
    status, body = fleet.chat()
    assert status == 200, body


def test_kill_9_of_a_primary_under_traffic(fleet: Fleet) -> None:
    """SIGKILL to every process of tiny-a: plain requests in flight are re-sent by nginx to tiny-b (none
    fails); only streams tiny-a was sending can break; systemd restarts the unit and it serves again."""
    name = fleet.spec["models"][0]["name"]  # tiny-a on h1
    h1 = fleet.hosts[fleet.spec["models"][0]["host"]]
    port = fleet.spec["models"][0]["port"]
    before = fleet.unit_pids()[name]
    with SteadyLoad(fleet.gateway_url, workers=2, think=0.5, headers=fleet.auth) as traffic:
        time.sleep(5)
        t_kill = time.monotonic()
        assert h1.run(f"systemctl kill --signal=SIGKILL vllm@{name}.service").returncode == 0
        deadline = t_kill + 900
        while time.monotonic() < deadline:
            pid = fleet.unit_pids()[name]
            probe = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/health', timeout=3)"
            up = h1.run(f'python3 -c "{probe}"').returncode == 0
            if up and pid not in ("", "0", before):
                break
            time.sleep(2)
        serving_again = time.monotonic() - t_kill
        time.sleep(3)
    assert serving_again < 900, "tiny-a did not serve again within 900 s"
    record("kill9_serving_again_seconds", serving_again)
    record("kill9_requests_during", traffic.total)
    plain = [f for f in traffic.failures if not f["stream"]]
    assert plain == [], plain
    assert len(traffic.failures) <= traffic.workers, traffic.failures  # at most the streams in flight
    assert traffic.ok["plain"] > 0 and traffic.ok["stream"] > 0
    assert h1.run(f"systemctl is-active vllm@{name}.service").stdout.strip() == "active"


def _status(fleet: Fleet) -> tuple[int, dict[str, Any]]:
    """``vllm-fleet status --json`` as an operator on the monitoring host runs it: Prometheus at the spec's
    monitoring address, the password from the spec's web_password_file (basic auth, docs/security.md)."""
    mon = fleet.hosts[fleet.spec["monitoring"]["host"]]
    mon.copy_to(fleet.spec_path, "/tmp/fleet.yml", mode=0o644)
    cp = mon.run("/opt/vllm-fleet/venv/bin/vllm-fleet status /tmp/fleet.yml --json", timeout=120)
    return cp.returncode, json.loads(cp.stdout)


def _wait_status(fleet: Fleet, ok: Any, what: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    code, doc = _status(fleet)
    while not ok(code, doc) and time.monotonic() < deadline:
        time.sleep(3)
        code, doc = _status(fleet)
    assert ok(code, doc), f"status never showed {what}: exit {code}\n{json.dumps(doc, indent=1)[-3000:]}"
    return doc


def test_fleet_status_healthy_drained_and_a_host_powered_off(fleet: Fleet) -> None:
    """`vllm-fleet status` on the deployed fleet: every instance serving (exit 0), the spec drift of the
    flag-change test named per host; tiny-b drained at the gateway → degraded, exit 1; h2 powered off → its
    instance down as unreachable and the host named, exit 1 (tiny-qwen3 still serves on h1). Last in the file:
    h2 stays off."""
    doc = _wait_status(fleet, lambda c, d: c == 0, "every instance serving")
    rows = {r["instance"]: r for r in doc["rows"]}
    assert set(rows) == {m["name"] for m in fleet.spec["models"]}
    for r in rows.values():
        assert (r["verdict"], r["state"], r["rotation"], r["probe_ok"]) == ("serving", "ready", "in", True), r
        assert r["ready_since"] and r["running"] is not None and r["kv_cache"] is not None, r
    # the fleet runs the spec of the flag-change test above (tiny-b's max_num_seqs 8): given the original spec,
    # status shows the drift on every host, each naming the same deployed spec
    deployed = {h["deployed_spec"] for h in doc["hosts"]}
    assert all(h["reachable"] and h["drift"] for h in doc["hosts"]), doc["hosts"]
    assert len(deployed) == 1 and doc["spec_hash"] not in deployed and "" not in deployed, doc["hosts"]

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
