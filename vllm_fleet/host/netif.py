"""The network interface of a multi-node rank's fleet address (docs/multi-node.md).

Gloo (and NCCL's socket transport) pick the address they advertise to the other ranks from the host name
unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. On Debian and Ubuntu the host name
resolves to ``127.0.1.1`` (``/etc/hosts``), so rank 0 advertised a loopback address and the other host's rank
failed with ``Gloo connectFullMesh failed ... Connection refused, remote=[127.0.1.1]:PORT`` (seen on the
sandbox fleet). When the spec names no interface (``distributed.socket_ifname``), the launchers set both to
the interface that holds the rank's ``VLLM_HOST_IP``, found here.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's (primary) IPv4 address
IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None  # no IPv4 address on it
    return socket.inet_ntoa(raw[20:24])


def interface_of(address: str) -> str | None:
    """The interface whose IPv4 address is ``address`` (None when no interface has it, or it is IPv6)."""
    try:
        if ipaddress.ip_address(address).version != 4:
            return None
    except ValueError:
        return None
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == address:
            return name
    return None


def with_rank_interface(env: dict[str, str]) -> dict[str, str]:
    """``env`` with GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME set to the interface of ``VLLM_HOST_IP`` where the
    environment names none (a multi-node rank only: no VLLM_HOST_IP, nothing changes)."""
    host_ip = env.get("VLLM_HOST_IP")
    if not host_ip or all(env.get(k) for k in IFNAMES):
        return env
    ifname = interface_of(host_ip)
    if ifname is None:
        return env
    out = dict(env)
    for k in IFNAMES:
        if not out.get(k):
            out[k] = ifname
    return out
