"""No single gateway (issue 30), end to end: three sandbox hosts deployed with `ansible-playbook site.yml` from
examples/tiny-cpu-ha.yml as written, only retargeted (gateways h1 h2 behind the virtual address, monitoring on
h2 h3, two instances on h3). The instances run the sim stack (tests/ansible_fleet.py): what is tested is the
deployment and the address, not the engine.

Deploy → exactly one gateway holds the address and answers through it, every gateway-only host runs the tools
venv and the exporter → a rerun changes nothing → a drain on either gateway host reaches both (no request to
the drained instance through either) → the holder's link cut under steady plain and streamed traffic
(tests the takeover: failed requests, the gap, the new holder) → an instance down and a monitoring host powered
off at once: the page still arrives, once (a Slack-compatible receiver on the bridge) → the hosts are torn down
with the module.
`extended` (`make test-all`): three more hosts and a deploy are ~5 minutes that CI's 30-minute budget has not
got yet; figures from the same scenario on `make demo DEMO_SPEC=examples/tiny-cpu-ha.yml` are in
docs/perf/ha.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_fleet import (
    REPO,
    SIM_STACK,
    WHEELHOUSE_MOUNT,
    Fleet,
    prometheus,
    recap,
    stack_with,
    what_changed,
    wheelhouse,
)

from vllm_fleet.devtools.failover import FailoverLoad, FailoverReport
from vllm_fleet.devtools.gateway_testing import wait_for
from vllm_fleet.devtools.sandbox_net import parse_address
from vllm_fleet.devtools.slack import SlackReceiver

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.extended]

GATEWAYS = ("h1", "h2")


def holders(fleet: Fleet, vip: str) -> list[str]:
    """The gateway hosts that hold the virtual address now (ip -4 on each)."""
    out = []
    for n in GATEWAYS:
        h = fleet.hosts[fleet.names[n]]  # type: ignore[attr-defined]
        res = h.run("ip -4 -o address show", check=False)
        if re.search(rf"\binet {re.escape(vip)}/", res.stdout):
            out.append(n)
    return out


def status(fleet: Fleet) -> dict[str, Any]:
    """``vllm-fleet status --json`` as an operator on h3 (a monitoring host) runs it: each monitoring host's
    Prometheus asked in turn, the first that answers read."""
    h3 = fleet.hosts[fleet.names["h3"]]  # type: ignore[attr-defined]
    h3.copy_to(fleet.spec_path, "/tmp/fleet.yml", mode=0o644)
    cp = h3.run("/opt/vllm-fleet/venv/bin/vllm-fleet status /tmp/fleet.yml --json", timeout=120, check=False)
    return json.loads(cp.stdout)  # type: ignore[no-any-return]


def status_holders(fleet: Fleet) -> list[str]:
    names = {v: k for k, v in fleet.names.items()}  # type: ignore[attr-defined]
    return sorted(names.get(h, h) for h in status(fleet).get("holders") or [])


@pytest.fixture(scope="module")
def ha(sandbox_factory: Any, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from vllm_fleet.devtools.sandbox import down, write_inventory
    from vllm_fleet.devtools.sandbox_net import retarget_spec
    from vllm_fleet.fleet.lock import self_wheel

    wh = wheelhouse()
    work = tmp_path_factory.mktemp("ha")
    names = {n: f"ha-{n}" for n in ("h1", "h2", "h3")}
    hosts = {
        names[n]: sandbox_factory(
            names[n], engine=n == "h3", apt_proxy=True, binds_ro=[(str(wh), WHEELHOUSE_MOUNT)]
        )
        for n in names
    }
    example = yaml.safe_load((REPO / "examples" / "tiny-cpu-ha.yml").read_text())
    spec = retarget_spec(example, names, {n: hosts[names[n]].address for n in names})
    # the page count: Alertmanager posts to a Slack-compatible receiver here, on the sandbox bridge's address
    slack = SlackReceiver(parse_address(hosts[names["h3"]].address).gateway)
    spec["slack"] = {"enabled": True}
    spec_path = work / "fleet.yml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    models = work / "models"
    models.mkdir()
    shutil.copytree(tiny_model, models / "tiny")
    inventory, _ = write_inventory(work / "inventory", list(hosts.values()))
    extra = ["-e", f"vllm_fleet_models_src={models}", "-e", f"vllm_fleet_wheelhouse={wh}",
             "-e", f"vllm_fleet_wheelhouse_remote={WHEELHOUSE_MOUNT}",
             "-e", f"vllm_fleet_self_wheel={self_wheel(work / 'whl')}",
             "-e", f"vllm_fleet_slack_webhook_url={slack.url}"]  # fmt: skip
    tree = work / "templates"
    for manifest in REPO.glob("*/artifacts.yml"):
        shutil.copytree(manifest.parent, tree / manifest.parent.name)
    vip = spec["gateway"]["virtual_address"].split("/")[0]
    fleet = Fleet(
        spec_path, inventory, extra, hosts, spec, f"http://{vip}:{spec['gateway']['port']}", tree, wh
    )
    fleet.names = names  # type: ignore[attr-defined]
    fleet.vip = vip  # type: ignore[attr-defined]
    fleet.slack = slack  # type: ignore[attr-defined]
    _, fleet.stack = stack_with(fleet, work, "vf-stack-sim", SIM_STACK)
    fleet.stack += ["-e", "vllm_fleet_doctor_load=false"]
    try:
        yield fleet
    finally:
        slack.close()
        for name in hosts:
            subprocess.run(["ip", "link", "set", f"vb-{name}", "up"], capture_output=True, check=False)
            down(name)


def test_deploy_puts_the_address_on_one_gateway_and_serves_through_it(ha: Fleet) -> None:
    rc, out, seconds = ha.playbook()
    assert rc == 0, out[-6000:]
    print(f"HA deploy: {seconds:.0f} s")
    vip = ha.vip  # type: ignore[attr-defined]
    # the checks pass twice (rise 2, every 2-3 s) before a gateway may take the address
    assert wait_for(lambda: len(holders(ha, vip)) == 1, timeout=60), holders(ha, vip)
    code, body = ha.chat()
    assert code == 200 and body["choices"], body
    # `vllm-fleet status` names the holder (keepalived's notify -> the gateway's exporter -> Prometheus)
    assert wait_for(lambda: status_holders(ha) == holders(ha, vip), timeout=120, interval=3), status(ha)
    for n in GATEWAYS:
        h = ha.hosts[ha.names[n]]  # type: ignore[attr-defined]
        active = h.run("systemctl is-active keepalived nginx vllm-fleet-admission vllm-fleet-exporter").stdout
        assert active.split() == ["active"] * 4, (n, active)
        # a gateway-only host runs vllm-fleet's own venv (the checks, the admission service, the exporter)
        assert h.run("test -x /opt/vllm-fleet/venv/bin/vllm-fleet-gateway-check").returncode == 0


def test_rerun_changes_nothing(ha: Fleet) -> None:
    rc, out, _ = ha.playbook()
    assert rc == 0, out[-4000:]
    changed = {h: r["changed"] for h, r in recap(out).items()}
    assert set(changed.values()) == {0}, (changed, what_changed(out))


def test_a_drain_on_either_gateway_host_reaches_both(ha: Fleet) -> None:
    """`vllm-fleet drain tiny-a` on one gateway host tells the other (its nginx's peer location): neither
    gateway sends tiny-a a request, whichever address a client uses; `undrain` on the other puts it back on
    both."""
    from vllm_fleet.devtools.testing import http_json
    from vllm_fleet.fleet.spec import load_spec

    names = ha.names  # type: ignore[attr-defined]
    log = load_spec(ha.spec_path).gateway.access_log
    tiny_a = f"{ha.hosts[names['h3']].address}:{ha.spec['models'][0]['port']}"
    assert ha.spec["models"][0]["name"] == "tiny-a"
    venv = "/opt/vllm-fleet/venv/bin/vllm-fleet"
    for via, other in (("h2", "h1"), ("h1", "h2")):
        gw = ha.hosts[names[via]]
        res = gw.run(f"{venv} drain tiny-a")
        assert res.returncode == 0 and f"peer {names[other]}: drained: tiny-a" in res.stdout, res
        for n in GATEWAYS:
            state = ha.hosts[names[n]].run("cat /etc/vllm-fleet/gateway/drained.json").stdout
            assert json.loads(state)["drained"] == ["tiny-a"], (n, state)
        seen = {n: int(ha.hosts[names[n]].run(f"wc -l < {log}").stdout) for n in GATEWAYS}
        for n in GATEWAYS:  # each gateway's own address: a client that does not use the virtual one
            url = f"http://{ha.hosts[names[n]].address}:{ha.spec['gateway']['port']}/v1/chat/completions"
            for i in range(12):
                body = {"model": "tiny-qwen3", "max_tokens": 4,
                        "messages": [{"role": "user", "content": f"prefix {i} {via}: hello"}]}  # fmt: skip
                code, answer = http_json("POST", url, body, timeout=60, headers=ha.auth)
                assert code == 200, answer
        for n in GATEWAYS:
            lines = ha.hosts[names[n]].run(f"tail -n +{seen[n] + 1} {log}").stdout.splitlines()
            upstreams = [json.loads(x)["upstream_addr"] for x in lines if x.strip()]
            assert len(upstreams) >= 12 and not any(tiny_a in u for u in upstreams), (n, upstreams)
        res = ha.hosts[names[other]].run(f"{venv} undrain tiny-a")
        assert res.returncode == 0 and f"peer {names[via]}: drained: (none)" in res.stdout, res
        for n in GATEWAYS:
            state = ha.hosts[names[n]].run("cat /etc/vllm-fleet/gateway/drained.json").stdout
            assert json.loads(state)["drained"] == [], (n, state)


def test_holder_cut_off_moves_the_address_and_only_in_flight_requests_fail(ha: Fleet) -> None:
    vip = ha.vip  # type: ignore[attr-defined]
    (old,) = holders(ha, vip)
    other = next(n for n in GATEWAYS if n != old)
    # a client's connect waits out the takeover (its SYN is retried until the address answers elsewhere)
    load = FailoverLoad(ha.gateway_url, "tiny-qwen3", api_key=ha.api_key, lanes=6, connect_timeout=15,
                        read_timeout=5, timeout=30, pause=0.2)  # fmt: skip
    with load:
        assert wait_for(lambda: sum(r.outcome == "ok" for r in load.records) >= 20, timeout=60)
        cut = load.mark("cut")
        # power loss as the peers see it: the holder's link goes down (the bridge end of its veth)
        subprocess.run(["ip", "link", "set", f"vb-{ha.names[old]}", "down"], check=True)  # type: ignore[attr-defined]
        assert wait_for(lambda: holders(ha, vip) == [other] or other in holders(ha, vip), timeout=30)
        assert wait_for(
            lambda: sum(r.outcome == "ok" and r.start > cut for r in load.records) >= 20, timeout=60
        )
    report = FailoverReport.compute(load.records, cut, end=load.stopped_at, marks=load.marks)
    print(report.summary())
    d = report.as_dict()
    # what failed was in flight on the old holder (cut with its link); a request started after the cut waits in
    # its connect until the address answers on the other gateway
    assert d["failed_started_after_cut"] == {}, d
    assert d["failed"] <= d["in_flight_at_cut"], d
    assert d["gap_s"] is not None and d["gap_s"] < 15, d
    subprocess.run(["ip", "link", "set", f"vb-{ha.names[old]}", "up"], check=True)  # type: ignore[attr-defined]
    # back on the network with an equal priority: it does not take the address back
    assert wait_for(lambda: holders(ha, vip) == [other], timeout=30), holders(ha, vip)
    assert wait_for(lambda: status_holders(ha) == [other], timeout=120, interval=3), status(ha)


def test_a_monitoring_host_powered_off_during_an_alert_still_pages_once(ha: Fleet) -> None:
    """h2 and h3 run Prometheus and a clustered Alertmanager. An instance goes down (VllmInstanceDown, for
    alerts.instance_down_for) and h2 loses its power at once (every process killed, its link gone): h3's
    Prometheus and Alertmanager page alone. Alertmanager's cluster is at-least-once; the goal is one page."""
    slack = ha.slack  # type: ignore[attr-defined]
    names = ha.names  # type: ignore[attr-defined]
    h3 = ha.hosts[names["h3"]]
    t0 = time.time()
    h3.run("systemctl stop vllm@tiny-b.service")
    # power loss: SIGKILL to the container's init kills everything in it at once (no clean leave of the
    # Alertmanager cluster, no priority-0 advertisement); its link goes with it
    os.kill(ha.hosts[names["h2"]].pid1, signal.SIGKILL)

    def pages() -> list[tuple[float, Any]]:
        return [(t, p) for t, p in slack.find("VllmInstanceDown", "FIRING") if t > t0]

    # for (1m) + group_wait, and the second Alertmanager's wait (peer_timeout × its position) at most
    assert wait_for(lambda: len(pages()) >= 1, timeout=300, interval=1), slack.posts[-3:]
    first = pages()[0][0]
    print(f"page after {first - t0:.1f} s")
    # a duplicate would come within the peers' wait, well inside a group_interval: watch for one that long
    assert not wait_for(lambda: len(pages()) > 1, timeout=90, interval=1), [t - t0 for t, _ in pages()]
    print(f"pages: {len(pages())} (duplicates: {len(pages()) - 1})")

    # the lost peer is an alert of its own on h3's Prometheus (pending until alerts.ha_peer_down_for)
    def peer_alerts() -> set[str]:
        (got,) = prometheus(
            ha, ['ALERTS{alertname=~"VllmFleet(Monitoring|Gateway)PeerDown"}'], names["h3"]
        ).values()
        return {r["metric"]["alertname"] for r in got}

    assert wait_for(
        lambda: peer_alerts() == {"VllmFleetMonitoringPeerDown", "VllmFleetGatewayPeerDown"},
        timeout=120,
        interval=5,
    ), peer_alerts()
    # status, from h3's Prometheus now: h2's Prometheus and Alertmanager down, h3's cluster alone
    mon = {m["host"]: m for m in status(ha)["monitoring"]}
    assert mon[names["h2"]]["prometheus_up"] is False and mon[names["h3"]]["alertmanager_up"] is True, mon
