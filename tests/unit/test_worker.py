"""The headless rank's watch of rank 0 (vllm_fleet/host/worker.py): real sockets, a stand-in engine."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm_fleet.contracts import (
    WORKER_STATE_KEYS,
    WORKER_STATES,
    ContractError,
    parse_worker_state,
    read_state,
    read_worker_state,
)
from vllm_fleet.host.worker import Watch, WorkerConfig, established_to, read_tables, run


def test_established_to_sees_a_real_connection_and_its_end() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port))
    peer, _ = srv.accept()
    assert established_to(read_tables(), "127.0.0.1", port) >= 1
    c.close()
    peer.close()
    srv.close()
    deadline = time.monotonic() + 5
    while established_to(read_tables(), "127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert established_to(read_tables(), "127.0.0.1", port) == 0


def test_ipv4_mapped_ipv6_rows_count() -> None:
    table = (
        "  sl  local_address                         remote_address                        st\n"
        "   0: 0000000000000000FFFF00000B004D0A:D0AC 0000000000000000FFFF00000A004D0A:6DA5 01 0\n"
    )
    assert established_to([table], "10.77.0.10", 28069) == 1
    assert established_to([table.replace(" 01 ", " 06 ")], "10.77.0.10", 28069) == 0


def test_watch_rule() -> None:
    w = Watch(grace=10)
    assert w.observe(0, connected=False, answers=False) == "waiting"
    assert w.observe(100, connected=False, answers=False) == "waiting"  # rank 0 may take long to come up
    assert w.observe(101, connected=True, answers=True) == "ok"
    assert w.observe(103, connected=True, answers=False) == "suspect"  # a cut: the port stops answering
    assert w.observe(105, connected=True, answers=True) == "ok"  # back within grace
    assert w.observe(107, connected=False, answers=True) == "suspect"
    assert w.observe(117, connected=False, answers=True) == "gone"


# the stand-in engine connects to rank 0 like a headless rank does: retrying until the port answers
ENGINE_RETRY = """
import socket, time
def connect(addr):
    while True:
        try:
            return socket.create_connection(addr)
        except OSError:
            time.sleep(0.1)
"""

ENGINE = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
while s.recv(1):
    pass
time.sleep(600)  # like vLLM's headless rank: alive after rank 0 went away
"""


def _wait_for(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.05)


def test_worker_ends_its_engine_when_rank0_goes(tmp_path: Path) -> None:
    """Through the phases with its state file: waiting (no rank 0 yet), joined, rank 0 gone (exit 1)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    srv.close()  # rank 0 is not up yet: the worker waits
    script = tmp_path / "engine.py"
    script.write_text(ENGINE.replace("s = socket.create_connection", "s = connect"))
    script.write_text(ENGINE_RETRY + script.read_text())
    state_dir = tmp_path / "run"
    cfg = WorkerConfig(name="t", rank=1, command=[sys.executable, str(script), str(port)], master_addr="127.0.0.1",
                       master_port=port, grace_seconds=1, check_interval_seconds=0.2, served_model_name="tm",
                       nnodes=2, state_dir=str(state_dir))  # fmt: skip
    path = state_dir / "workers" / "t.json"
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(run(cfg)), daemon=True)
    t.start()
    _wait_for(path.exists)
    st = read_worker_state(path)
    assert set(st) == set(WORKER_STATE_KEYS) and st["state"] == "waiting" and st["state"] in WORKER_STATES
    assert (st["instance"], st["served_model_name"], st["rank"], st["nnodes"]) == ("t", "tm", 1, 2)
    assert (
        st["master"] == f"127.0.0.1:{port}" and isinstance(st["engine_pid"], int) and st["exit_code"] is None
    )
    waiting_since = st["since"]
    # the folder is the exporter's to list (the unit's UMask=0077), and not an instance state file to it
    assert (state_dir / "workers").stat().st_mode & 0o777 == 0o755 and path.stat().st_mode & 0o777 == 0o644
    assert list(state_dir.glob("*.json")) == []
    time.sleep(0.5)
    assert read_worker_state(path)["state"] == "waiting"
    # rank 0 comes up: the engine connects, the worker sees the connection and joins
    srv = socket.create_server(("127.0.0.1", port))
    peers: list[socket.socket] = []
    threading.Thread(target=lambda: peers.append(srv.accept()[0]), daemon=True).start()
    _wait_for(lambda: read_worker_state(path)["state"] == "joined")
    st = read_worker_state(path)
    assert st["state"] == "joined" and st["since"] > waiting_since and peers
    assert t.is_alive()
    # rank 0 killed: its TCPStore and the connection go away
    peers[0].close()
    srv.close()
    t.join(timeout=15)
    assert result == [1]
    assert established_to(read_tables(), "127.0.0.1", port) == 0
    st = read_worker_state(path)
    assert (st["state"], st["exit_code"]) == ("rank0_gone", 1) and "connection closed" in (st["reason"] or "")
    assert not [p for p in (state_dir / "workers").iterdir() if p.name != "t.json"]  # no tmp file left


def test_an_engine_that_exits_is_recorded_as_exited(tmp_path: Path) -> None:
    cfg = WorkerConfig(name="e", rank=2, command=[sys.executable, "-c", "import sys; sys.exit(3)"],
                       master_addr="127.0.0.1", master_port=9, check_interval_seconds=0.1,
                       state_dir=str(tmp_path))  # fmt: skip
    assert run(cfg) == 3
    st = read_worker_state(tmp_path / "workers" / "e.json")
    assert (st["state"], st["exit_code"], st["reason"], st["rank"]) == ("exited", 3, "engine exited (3)", 2)
    assert st["served_model_name"] == "e"


def test_a_worker_state_file_is_no_instance_state_file(tmp_path: Path) -> None:
    """The contract check names a wrong field; the instances' reader would take one for its own."""
    with pytest.raises(ContractError, match=r"w\.json: rank: expected int"):
        parse_worker_state({"rank": "1"}, "w.json")
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"state": "joined", "since": 1.0}))
    assert read_state(p)["state"] == "joined"  # why it must live in a folder of its own


def test_config_from_json(tmp_path: Path) -> None:
    p = tmp_path / "w.json"
    p.write_text(json.dumps({"name": "x", "rank": 1, "command": ["a"], "master_addr": "10.0.0.1",
                             "master_port": 28001}))  # fmt: skip
    assert WorkerConfig.load(p).grace_seconds == 10.0
    p.write_text("{}")
    r = subprocess.run([sys.executable, "-m", "vllm_fleet.host.worker", "w", "--config-dir", str(tmp_path)],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 78 and "workers/w.json" in r.stderr
