"""``vllm-fleet drain NAME`` / ``undrain NAME``: take an engine instance out of / into the gateway's rotation.

Runs on the gateway host, by instance name. The drained set lives in a small runtime state file,
``/etc/vllm-fleet/gateway/drained.json`` (``{"drained": [...], "updated": T}``, gateway.state_file of the
spec; its format: vllm_fleet.host.gateway_state, which keeps the other keys, e.g. ``vllm-fleet canary``'s
leases), replaced atomically (temp file + rename). Nothing else changes: the rendered gateway files —
``/etc/nginx/vllm-fleet/routes.json`` (the routing table as data), upstreams.conf, router.js — stay exactly
what ``vllm-fleet render`` wrote, and nginx is not reloaded. The njs router reads the state file on every
request and overlays it on routes.json: while instances of an upstream are drained it sends the request to
that upstream's other servers, one at a time through their one-server upstreams (docs/gateway.md). New
requests stop reaching the instance at once, in-flight ones finish, and no client connection is closed (a
reload would close the clients' idle keep-alive connections). Instance names, addresses and models come from
routes.json; nothing parses nginx config. ``--wait S`` then waits until the instance reports no running
request (``vllm:num_requests_running`` on its /metrics).

With two or more gateways (``gateway.hosts``) every gateway has its own drained-set file, and the gateway
role renders on each a peers file (``vllm_fleet.contracts.GATEWAY_PEERS_FILE``,
/etc/nginx/vllm-fleet/peers.json): the other gateways and where their nginx takes a drain from this one
(``POST http://ADDR:gateway.peer_port/vf/drained`` with ``{"drain": NAME}`` or ``{"undrain": NAME}``, allowed from
the other gateways' fleet addresses only). After the local change, drain and undrain tell every peer the same
operation (``--peers FILE``; ``--local``: this gateway only), from this host's fleet address, 3 s each, and print
a line per peer: ``peer h2: drained: a, b`` (its drained set now) or ``peer h2: NOT reached (why)`` /
``peer h2: REFUSED (HTTP 400: why)``. ``--wait`` waits after the peers were told (a gateway that is down sends
the instance nothing either). A peer that was not reached keeps its old drained set until the next drain or
undrain reaches it: rerun the command (it is idempotent) or run it on that host.

Exit codes: 0 done, 1 error (or ``--wait`` timed out), 3 refused (the model would be left without any server;
``--force`` overrides; nothing changed), 4 done here but a peer gateway was not reached or refused it (or the
peers file could not be read): the local change stays (4 also when ``--wait`` then timed out).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_fleet.contracts import GATEWAY_PEERS_FILE, ContractError, GatewayPeer, GatewayPeers
from vllm_fleet.host import gateway_state
from vllm_fleet.host.gateway_state import StateFileError, update_state

ROUTES_FILE = "/etc/nginx/vllm-fleet/routes.json"
STATE_FILE = "/etc/vllm-fleet/gateway/drained.json"
# how long each peer gateway may take to answer (connect and answer together, per peer)
PEER_TIMEOUT = 3.0
# a peer gateway was not reached, or refused the operation; the local change stays
EXIT_PEERS = 4


class DrainError(Exception):
    """Drain could not be done; ``code`` is the exit status."""

    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


def load_routes(path: Path) -> list[dict[str, object]]:
    """The ``routes`` of the rendered routes.json."""
    try:
        doc = json.loads(path.read_text())
    except ValueError as exc:
        raise DrainError(f"{path}: not valid JSON ({exc})") from None
    routes = doc.get("routes") if isinstance(doc, dict) else None
    if not isinstance(routes, list):
        raise DrainError(f"{path}: no routing table (not a routes.json rendered by vllm-fleet?)")
    return routes


def _servers(rt: dict[str, object]) -> list[dict[str, object]]:
    ups = rt["upstreams"]
    assert isinstance(ups, list)
    return [s for u in ups for s in u["servers"]]


def instances(routes: list[dict[str, object]]) -> dict[str, str]:
    """instance name → address: every instance with a one-server upstream (a canary too, which serves no
    upstream of its model)."""
    out = {str(s["instance"]): str(s["address"]) for rt in routes for s in _servers(rt)}
    for rt in routes:
        solo = rt.get("solo")
        for name, one in solo.items() if isinstance(solo, dict) else ():
            out.setdefault(str(name), str(one["address"]))
    return out


def spec_drained(routes: list[dict[str, object]]) -> set[str]:
    """Instances the spec takes out (gateway.drained: rendered ``down``)."""
    return {str(s["instance"]) for rt in routes for s in _servers(rt) if s.get("drained")}


def stranded_models(
    routes: list[dict[str, object]], drained: set[str] | frozenset[str] = frozenset()
) -> list[str]:
    """Served models with no server left that is neither drained by the spec nor in ``drained`` (a canary is
    no server: it is in no upstream of the routing table)."""
    return sorted(
        str(rt["model"])
        for rt in routes
        if not any(not s.get("drained") and s["instance"] not in drained for s in _servers(rt))
    )


def read_state(path: Path) -> set[str]:
    """The drained set of the state file (empty without one)."""
    try:
        return set(gateway_state.read_state(path).drained)
    except StateFileError as exc:
        raise DrainError(str(exc)) from None


def set_drained(
    name: str,
    drain: bool,
    routes_file: Path = Path(ROUTES_FILE),
    state: Path = Path(STATE_FILE),
    force: bool = False,
) -> set[str]:
    """Add (drain) or remove (undrain) instance ``name`` in the state file; returns the drained set (the
    state file's; instances of ``gateway.drained`` in the spec stay out whatever it says)."""
    routes = load_routes(routes_file)
    known = instances(routes)
    if name not in known:
        raise DrainError(
            f"unknown instance {name!r} in {routes_file} (instances: {', '.join(sorted(known))})"
        )

    def change(st: gateway_state.GatewayState) -> set[str]:
        drained = set(st.drained) & set(known)  # names of instances no longer in the fleet are dropped
        drained = drained | {name} if drain else drained - {name}
        stranded = stranded_models(routes, drained)
        if stranded and drain and not force:
            raise DrainError(
                f"refused: draining {name} leaves model(s) {', '.join(stranded)} with no server in rotation "
                "(--force to do it anyway)",
                code=3,
            )
        st.drained = sorted(drained)  # the file's other keys (canary leases) stay as they are
        return drained

    try:
        drained = update_state(state, change)
    except StateFileError as exc:
        raise DrainError(str(exc)) from None
    return drained


@dataclass(frozen=True)
class PeerOutcome:
    """What one peer gateway answered: its drained set (``drained``), else why not (``why``; ``reached``: it
    answered, with an error)."""

    name: str
    drained: list[str] | None
    why: str = ""
    reached: bool = False

    @property
    def ok(self) -> bool:
        return self.drained is not None

    def line(self) -> str:
        if self.drained is not None:
            return f"peer {self.name}: drained: {', '.join(self.drained) or '(none)'}"
        return f"peer {self.name}: {'REFUSED' if self.reached else 'NOT reached'} ({self.why})"


def tell_peer(
    peer: GatewayPeer, name: str, drain: bool, source: str = "", timeout: float = PEER_TIMEOUT
) -> PeerOutcome:
    """POST ``{"drain": name}`` (or ``undrain``) to ``peer``'s peer location, from ``source`` (this host's fleet
    address, the one the peer allows; "" = the system's choice)."""
    url = urllib.parse.urlsplit(peer.url)
    body = json.dumps({"drain" if drain else "undrain": name}).encode()
    conn = http.client.HTTPConnection(
        url.hostname or "", url.port or 80, timeout=timeout, source_address=(source, 0) if source else None
    )
    deadline = time.monotonic() + timeout
    try:
        conn.request(
            "POST",
            url.path or "/",
            body=body,
            headers={"Content-Type": "application/json", "Connection": "close"},
        )
        if conn.sock is not None:  # the connect took part of the time: the answer gets what is left
            conn.sock.settimeout(max(deadline - time.monotonic(), 0.1))
        resp = conn.getresponse()
        raw = resp.read(65536)
        status, reason = resp.status, resp.reason
    except (OSError, http.client.HTTPException) as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (getattr(exc, "strerror", None) or str(exc))
        return PeerOutcome(peer.name, None, f"{peer.url}: {why}")
    finally:
        conn.close()
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if status == 200 and isinstance(doc, dict) and isinstance(doc.get("drained"), list):
        return PeerOutcome(peer.name, [str(x) for x in doc["drained"]], reached=True)
    # the peer location's JSON error, else the status's reason (nginx's own 403 page is HTML)
    error = doc.get("error") if isinstance(doc, dict) else None
    return PeerOutcome(peer.name, None, f"HTTP {status}: {error or reason}", reached=True)


def tell_peers(peers_file: Path, name: str, drain: bool, timeout: float = PEER_TIMEOUT) -> list[PeerOutcome]:
    """Tell every gateway of ``peers_file`` (``GatewayPeers``), one after the other. ``OSError`` /
    ``ContractError`` when the file cannot be read."""
    peers = GatewayPeers.load(peers_file)
    return [tell_peer(p, name, drain, peers.source, timeout) for p in peers.peers]


def running_requests(address: str, timeout: float = 3) -> float:
    """Sum of ``vllm:num_requests_running`` on the engine at ``address`` (host:port)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(address: str, timeout: float, interval: float = 0.5) -> bool:
    """Wait until the engine has no running request (or is unreachable). False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if running_requests(address) == 0:
                return True
        except OSError:
            return True  # not answering: nothing running that we could wait for
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="instance name (models[].name in the spec)")
    p.add_argument("--routes", help=f"rendered routing table (default {ROUTES_FILE})")
    p.add_argument(
        "--upstreams",
        help="rendered upstreams.conf: the routes.json next to it (older scripts; --routes wins)",
    )
    p.add_argument("--state", default=STATE_FILE, help=f"drained-set file (default {STATE_FILE})")
    p.add_argument(
        "--peers",
        help=f"the other gateways to tell (default {GATEWAY_PEERS_FILE} where it exists: gateway.hosts)",
    )
    p.add_argument("--local", action="store_true", help="change this gateway's drained set only")
    p.add_argument("--nginx", help=argparse.SUPPRESS)  # accepted and ignored: drain runs no nginx command
    p.add_argument("--no-reload", action="store_true", help=argparse.SUPPRESS)  # ditto: it never reloads


def _routes_path(a: argparse.Namespace) -> Path:
    if a.routes:
        return Path(a.routes)
    if a.upstreams:
        return Path(a.upstreams).with_name("routes.json")
    return Path(ROUTES_FILE)


def _tell_peers(a: argparse.Namespace, drain: bool) -> bool:
    """Tell the other gateways (``--peers``, else the default file where it exists); print a line each. False
    when one was not told (or the file could not be read)."""
    cmd = "drain" if drain else "undrain"
    if a.local or (a.peers is None and not Path(GATEWAY_PEERS_FILE).exists()):
        return True
    peers_file = Path(a.peers or GATEWAY_PEERS_FILE)
    try:
        outcomes = tell_peers(peers_file, a.name, drain)
    except (OSError, ContractError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"{cmd}: peers file {peers_file}: {why}: the other gateways were NOT told", file=sys.stderr)
        return False
    for o in outcomes:
        print(o.line(), file=sys.stdout if o.ok else sys.stderr)
    failed = [o.name for o in outcomes if not o.ok]
    if failed:
        print(
            f"{cmd}: {', '.join(failed)} did not take it: {'they' if len(failed) > 1 else 'it'} keep the drained "
            f"set {'they' if len(failed) > 1 else 'it'} had. This gateway's change stays; rerun `vllm-fleet {cmd} "
            f"{a.name}` once they answer, or run it there",
            file=sys.stderr,
        )
    return not failed


def _handler(drain: bool) -> object:
    def run(a: argparse.Namespace) -> int:
        routes = _routes_path(a)
        try:
            drained = set_drained(a.name, drain, routes, Path(a.state), getattr(a, "force", False))
            addr = instances(load_routes(routes))[a.name]
        except (DrainError, OSError) as exc:
            print(f"{'drain' if drain else 'undrain'}: {exc}", file=sys.stderr)
            return getattr(exc, "code", 1)
        print(f"drained: {', '.join(sorted(drained)) or '(none)'}")
        sys.stdout.flush()
        told = _tell_peers(a, drain)
        code = 0 if told else EXIT_PEERS
        if drain and a.wait > 0:
            if not wait_idle(addr, a.wait):
                print(f"drain: {a.name} still has running requests after {a.wait:g}s", file=sys.stderr)
                return code or 1
            print(f"{a.name}: no running request")
        return code

    return run


EPILOG = (
    "With two or more gateways (gateway.hosts) the other gateways are told too (their nginx's peer location, "
    "listed in the peers file), one line each. Exit codes: 0 done; 1 error (or --wait timed out); 3 refused, "
    "nothing changed (drain: the model would keep no server in rotation; --force); 4 done on this gateway, but "
    "a peer gateway was not reached or refused it (or the peers file could not be read): the local change "
    "stays, rerun once the peer answers."
)


def add_drain_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--force", action="store_true", help="drain even if the model keeps no server in rotation")
    p.add_argument(
        "--wait",
        type=float,
        default=0,
        metavar="S",
        help="then (after the other gateways were told) wait up to S s for its in-flight requests",
    )
    p.epilog = EPILOG
    p.set_defaults(handler=_handler(True))


def add_undrain_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.epilog = EPILOG
    p.set_defaults(handler=_handler(False))
