"""host.churn: a flooded API server with a working engine core, from /proc/net/tcp and the CPU figures."""

from __future__ import annotations

import threading
from pathlib import Path

from vllm_fleet.host.churn import Conns, flooded, parse_tcp, read_port, sample_or_flooded
from vllm_fleet.host.cpu_wait import CpuReading

HEAD = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
# port 8080 = 1F90: its LISTEN row (backlog 4096 = 1000, 42 = 2A waiting to be accepted), two connections to it,
# one from it (the gateway's upstream: its local port is not 8080), one closing, another port's LISTEN row
TCP = HEAD + (
    "   0: 00000000:1F90 00000000:0000 0A 00001000:0000002A 00:00000000 00000000  1000 0 101 1\n"
    "   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000 0 102 1\n"
    "   2: 0100007F:1F90 0100007F:D432 01 00000000:00000010 00:00000000 00000000  1000 0 103 1\n"
    "   3: 0100007F:D433 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000 0 104 1\n"
    "   4: 0100007F:1F90 0100007F:D434 06 00000000:00000000 03:00000000 00000000     0 0 0 3\n"
    "   5: 00000000:0016 00000000:0000 0A 00000080:00000007 00:00000000 00000000     0 0 105 1\n"
    "garbage line\n"
)
TCP6 = HEAD + (
    "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A "
    "00001000:00000003 00:00000000 00000000  1000 0 201 1\n"
    "   1: 0000000000000000FFFF00000100007F:1F90 0000000000000000FFFF00000100007F:D435 01 "
    "00000000:00000000 00:00000000 00000000  1000 0 202 1\n"
)


def test_parse_tcp_reads_the_accept_queue_and_the_established_connections_of_the_port() -> None:
    assert parse_tcp(TCP, 8080) == Conns(pending=42, established=2)
    assert parse_tcp(TCP, 22) == Conns(pending=7, established=0)
    assert parse_tcp(TCP6, 8080) == Conns(pending=3, established=1)
    assert parse_tcp(HEAD, 8080) == Conns(0, 0)


def test_read_port_adds_ipv4_and_ipv6_and_is_none_without_either(tmp_path: Path) -> None:
    (tmp_path / "net").mkdir()
    assert read_port(8080, tmp_path) is None
    (tmp_path / "net" / "tcp").write_text(TCP)
    assert read_port(8080, tmp_path) == Conns(42, 2)
    (tmp_path / "net" / "tcp6").write_text(TCP6)
    assert read_port(8080, tmp_path) == Conns(45, 3)


def cpu(at: float, api: float, core: float, pids: tuple[int, ...] = (5, 6), **kw: object) -> CpuReading:
    stopped: tuple[int, ...] = kw.get("stopped", ())  # type: ignore[assignment]
    counted = bool(kw.get("counted", True))
    return CpuReading(at, 0.0, api + core, pids, stopped, counted, api_ran=api)


FLOOD = (Conns(120, 1900), Conns(0, 2000))


def test_a_flooded_api_server_with_a_working_engine_core_is_busy() -> None:
    v = flooded(cpu(10, 100, 200), cpu(15, 104.5, 204.9), FLOOD)
    assert v.flooded
    assert v.why == (
        "flooded with connections, engine core working: API server ran 4.5s, engine core 4.9s in 5.0s; "
        "120 connection(s) waiting to be accepted, 2000 established"
    )
    # an empty accept queue but thousands of connections, or a queue and few connections: flooded either way
    assert flooded(cpu(10, 100, 200), cpu(15, 104.5, 204.9), (Conns(0, 300), None)).flooded
    assert flooded(cpu(10, 100, 200), cpu(15, 104.5, 204.9), (None, Conns(1, 2))).flooded


def test_what_is_not_a_flood_says_why() -> None:
    b = cpu(10, 100, 200)
    cases = {
        "API server not busy": (cpu(15, 100.1, 205), FLOOD),  # a deadlocked loop
        "engine core idle": (cpu(15, 105, 200.2), FLOOD),  # hung, or waiting for nothing
        "no connection flood": (cpu(15, 105, 205), (Conns(0, 255), None)),
    }
    for why, (after, conns) in cases.items():
        v = flooded(b, after, conns)
        assert not v.flooded and v.why.startswith(f"{why}: "), (why, v)
    assert not flooded(b, cpu(15, 105, 205), (None, None)).flooded  # the port unread: no evidence
    # what ``starvation`` already names, or nothing to tell it by: no, and no words of its own
    silent = [
        flooded(b, cpu(15, 105, 205, stopped=(6,)), FLOOD),  # the engine core stopped
        flooded(b, cpu(15, 105, 205, pids=(5, 7)), FLOOD),  # a process died and another came
        flooded(b, cpu(15, 105, 205, counted=False), FLOOD),
        flooded(b, cpu(10, 105, 205), FLOOD),  # no window
    ]
    assert all(not v.flooded and v.why == "" for v in silent)


def test_read_port_sees_a_real_accept_queue_and_real_connections() -> None:
    """The kernel's own figures: a listening socket that accepts nothing holds the clients' connections in its
    accept queue; accepted ones are established."""
    import socket

    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    clients: list[socket.socket] = []
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        port = srv.getsockname()[1]
        assert read_port(port) == Conns(0, 0)
        for _ in range(3):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        got = read_port(port)
        assert got is not None and got.pending == 3
        accepted = [srv.accept()[0] for _ in range(2)]
        try:
            got = read_port(port)
            # the kernel lists a queued connection as established too: 3 server-side ends in all
            assert got is not None and (got.pending, got.established) == (1, 3)
        finally:
            for a in accepted:
                a.close()
    finally:
        for cl in clients:
            cl.close()
        srv.close()


# ------------------------------------------------------------------ sample_or_flooded: a check ends early when flooded
def test_a_check_the_api_server_does_not_answer_ends_at_the_flood_judgement_when_the_kernel_shows_a_flood() -> (
    None
):
    release, asked = threading.Event(), []

    def sample() -> str:
        release.wait(30)  # the API server answers only after the test is over
        return "late answer"

    def kernel() -> tuple[CpuReading, Conns | None]:
        asked.append(1)
        return cpu(11, 100.9, 200.8), Conns(0, 2000)

    try:
        got, after, conns = sample_or_flooded(sample, kernel, (cpu(10, 100, 200), Conns(50, 1900)), 0.05)
    finally:
        release.set()
    assert got is None  # judged by the kernel's readings, the late answer dropped
    assert (after.at, conns, len(asked)) == (11, Conns(0, 2000), 1)


def test_without_a_flood_the_check_waits_for_the_answer_and_reads_the_kernel_after_it() -> None:
    release, asked = threading.Event(), []

    def sample() -> str:
        assert release.wait(30)  # answers only once the kernel was asked (the check kept waiting)
        return "answer"

    def kernel() -> tuple[CpuReading, Conns | None]:
        asked.append(1)
        release.set()
        return cpu(11 + len(asked), 100.9, 200.8), Conns(0, 3)  # 3 connections: no flood

    got, after, conns = sample_or_flooded(sample, kernel, (cpu(10, 100, 200), Conns(0, 3)), 0.05)
    assert (got, after.at, conns, len(asked)) == ("answer", 13, Conns(0, 3), 2)


def test_a_quick_answer_is_taken_without_a_flood_judgement() -> None:
    got, after, _ = sample_or_flooded(
        lambda: 7, lambda: (cpu(12, 100, 200), None), (cpu(10, 100, 200), None), 30
    )
    assert (got, after.at) == (7, 12)
