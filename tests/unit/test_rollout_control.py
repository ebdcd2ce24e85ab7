"""The rollout's controller-side plumbing: the inventory's connections, the SSH command lines, the canary's
guard on its host (its lease runs out: the canary is stopped; cleared: it ends), the command's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_fleet.fleet.remote import HostConn, Remote, parse_inventory
from vllm_fleet.fleet.rollout import EXIT_USAGE, Controller, RolloutError
from vllm_fleet.fleet.spec import load_spec
from vllm_fleet.host.canary_guard import guard, lease_file

REPO = Path(__file__).resolve().parents[2]


def test_inventory_connections_as_ansible_lists_them() -> None:
    doc = {
        "_meta": {
            "hostvars": {
                "h1": {
                    "ansible_host": "10.0.0.1",
                    "ansible_user": "root",
                    "ansible_ssh_private_key_file": "/k/id",
                    "ansible_ssh_common_args": "-F /tmp/ssh_config -o StrictHostKeyChecking=no",
                },
                "h2": {"ansible_port": 2222},
            }
        }
    }
    hosts = parse_inventory(doc)
    assert hosts["h1"] == HostConn(
        "h1", "10.0.0.1", "root", None, "/k/id", ("-F", "/tmp/ssh_config", "-o", "StrictHostKeyChecking=no")
    )
    assert hosts["h2"].address == "h2" and hosts["h2"].port == 2222
    argv = Remote(hosts, control_dir="/c").argv("h1", "systemctl start 'vllm@x.service'")
    assert argv[-3:] == ["10.0.0.1", "--", "systemctl start 'vllm@x.service'"]
    assert "ControlPath=/c/%C" in argv and argv[argv.index("-i") : argv.index("-i") + 2] == ["-i", "/k/id"]
    assert argv.index("-F") < argv.index("10.0.0.1")


def test_the_guard_stops_the_canary_when_its_lease_runs_out(tmp_path: Path) -> None:
    lease = lease_file("tiny-canary", str(tmp_path))
    stopped = tmp_path / "stopped"
    stop = [sys.executable, "-c", f"open({str(stopped)!r}, 'w').write('stop')"]
    lease.write_text(json.dumps({"until": time.time() + 60}))
    assert guard("tiny-canary", lease, stop, now=time.time()) == -1  # still leased: nothing done
    assert not stopped.exists()
    assert guard("tiny-canary", lease, stop, now=time.time() + 61) == 0
    assert stopped.read_text() == "stop" and not lease.exists()
    stopped.unlink()
    assert guard("tiny-canary", lease, stop, now=time.time()) == 0  # cleared: ends without stopping
    assert not stopped.exists()
    lease.write_text("{not json")  # unreadable: expired (never a canary left running on a broken lease)
    assert guard("tiny-canary", lease, stop, now=time.time()) == 0 and stopped.exists()


def test_the_guard_process_waits_for_the_lease(tmp_path: Path) -> None:
    lease = lease_file("c", str(tmp_path))
    lease.write_text(json.dumps({"until": time.time() + 1.5}))
    marker = tmp_path / "stopped"
    code = (
        "import sys; from pathlib import Path; from vllm_fleet.host.canary_guard import guard;"
        f"sys.exit(guard('c', Path({str(lease)!r}), ['touch', {str(marker)!r}], poll=0.2))"
    )
    t0 = time.monotonic()
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert cp.returncode == 0, cp.stderr
    assert marker.exists() and time.monotonic() - t0 >= 1.0
    assert "lease ran out" in cp.stdout


def test_rollout_refuses_a_model_without_a_rollouts_entry(tmp_path: Path) -> None:
    spec = load_spec(REPO / "examples/tiny-cpu-2hosts.yml")
    with pytest.raises(RolloutError) as e:
        Controller(spec, "tiny-qwen3", Remote({}, control_dir=str(tmp_path)), "site.yml", "inv", [])
    assert e.value.code == EXIT_USAGE and "no rollouts entry for served model 'tiny-qwen3'" in str(e.value)
