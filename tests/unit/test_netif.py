"""A multi-node rank's gloo/NCCL interface from its fleet address (vllm_fleet/host/netif.py)."""

from __future__ import annotations

from vllm_fleet.host.netif import interface_of, with_rank_interface


def test_the_interface_holding_an_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.77") is None  # TEST-NET-1: on no interface here
    assert interface_of("::1") is None and interface_of("not-an-address") is None


def test_rank_environment_gets_the_interface_unless_the_spec_names_one() -> None:
    got = with_rank_interface({"VLLM_HOST_IP": "127.0.0.1", "X": "1"})
    assert got == {
        "VLLM_HOST_IP": "127.0.0.1",
        "X": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    named = {"VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "eth1"}
    assert with_rank_interface(named) == named
    assert with_rank_interface({"X": "1"}) == {"X": "1"}  # a one-host instance: untouched
    assert with_rank_interface({"VLLM_HOST_IP": "192.0.2.77"}) == {"VLLM_HOST_IP": "192.0.2.77"}
