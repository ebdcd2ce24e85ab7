"""``vllm-fleet canary set|clear|show``: a canary's lease in this gateway's state file (docs/gateway.md, "Canary
split").

Runs on a gateway host. A canary (an instance with ``role: canary``, derived from the spec's ``rollouts``) is in
no upstream of its model: the njs router sends it ``share`` of the model's requests only while the state file
(gateway.state_file, /etc/vllm-fleet/gateway/drained.json, format: vllm_fleet.host.gateway_state) holds a live
lease for it: ``until`` not passed, ``0 < share <= 0.5``, the canary not drained.

- ``set NAME --share S --lease SECONDS [--phase TEXT]``: write or renew the lease, ``until`` = now + SECONDS
  (``since`` stays what it was while the lease is renewed). Refused (exit 2) for a NAME that is not a canary in
  routes.json, a share outside (0, 0.5] or a lease that is not positive.
- ``clear NAME``: remove it (idempotent: exit 0 when there was none).
- ``show``: the leases as JSON (``live`` added per entry).

Per gateway only: the rollout controller calls every gateway itself (no peer push as drain does). The drained
set and any other key of the file stay as they were; the file is replaced atomically under the same lock as
drain's. nginx is never reloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_fleet.host.drain import ROUTES_FILE, STATE_FILE, DrainError, load_routes
from vllm_fleet.host.gateway_state import (
    MAX_CANARY_SHARE,
    CanaryLease,
    GatewayState,
    StateFileError,
    read_state,
    update_state,
)

EXIT_REFUSED = 2


class CanaryError(Exception):
    def __init__(self, msg: str, code: int = 1) -> None:
        super().__init__(msg)
        self.code = code


def canaries(routes: list[dict[str, object]]) -> dict[str, str]:
    """canary instance → its served model, from routes.json's ``canary`` per route."""
    out: dict[str, str] = {}
    for rt in routes:
        c = rt.get("canary")
        if isinstance(c, dict) and isinstance(c.get("instance"), str):
            out[c["instance"]] = str(rt["model"])
    return out


def set_lease(
    name: str,
    share: float,
    lease: float,
    phase: str = "observing",
    routes_file: Path = Path(ROUTES_FILE),
    state: Path = Path(STATE_FILE),
    now: float | None = None,
) -> CanaryLease:
    """Write or renew canary ``name``'s lease: ``share`` of its model's requests until now + ``lease``."""
    if not (math.isfinite(share) and 0 < share <= MAX_CANARY_SHARE):
        raise CanaryError(f"refused: --share {share:g} is not in (0, {MAX_CANARY_SHARE:g}]", EXIT_REFUSED)
    if not (math.isfinite(lease) and lease > 0):
        raise CanaryError(f"refused: --lease {lease:g} is not a positive number of seconds", EXIT_REFUSED)
    try:
        known = canaries(load_routes(routes_file))
    except DrainError as exc:
        raise CanaryError(str(exc)) from None
    if name not in known:
        raise CanaryError(
            f"refused: {name!r} is not a canary in {routes_file} "
            f"(canaries: {', '.join(sorted(known)) or 'none: the spec has no rollouts'})",
            EXIT_REFUSED,
        )
    now = time.time() if now is None else now

    def change(st: GatewayState) -> CanaryLease:
        old = st.canary.get(name)
        since = old.since if old is not None and old.live(now) and old.since else now
        st.canary[name] = CanaryLease(known[name], float(share), now + lease, phase, since)
        return st.canary[name]

    entry = update_state(state, change)
    return entry


def clear_lease(name: str, state: Path = Path(STATE_FILE)) -> bool:
    """Remove canary ``name``'s lease; False when there was none (nothing is written then)."""
    if name not in read_state(state).canary:
        return False
    return update_state(state, lambda st: st.canary.pop(name, None) is not None)


def show(state: Path = Path(STATE_FILE), now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    st = read_state(state)
    return {
        "canary": {
            n: dict(c.to_json(), live=c.live(now) and n not in st.drained) for n, c in st.canary.items()
        },
        "drained": sorted(st.drained),
        "now": now,
    }


def _run(a: argparse.Namespace) -> int:
    state = Path(a.state)
    try:
        if a.op == "set":
            e = set_lease(a.name, a.share, a.lease, a.phase, Path(a.routes), state)
            print(
                f"canary {a.name} ({e.model}): share {e.share:g} until "
                f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(e.until))} ({a.lease:g} s), phase {e.phase}"
            )
        elif a.op == "clear":
            print(
                f"canary {a.name}: {'cleared' if clear_lease(a.name, state) else 'no lease (nothing to clear)'}"
            )
        else:
            print(json.dumps(show(state), indent=2))
    except (CanaryError, StateFileError, OSError) as exc:
        print(f"canary {a.op}: {exc}", file=sys.stderr)
        return getattr(exc, "code", 1)
    return 0


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="op", required=True, metavar="{set,clear,show}")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--state", default=STATE_FILE, help=f"the gateway's state file (default {STATE_FILE})"
        )
        sp.add_argument(
            "--routes", default=ROUTES_FILE, help=f"rendered routing table (default {ROUTES_FILE})"
        )

    sp = sub.add_parser(
        "set", help="write or renew a canary's lease (share of its model's requests until now+lease)"
    )
    sp.add_argument("name", help="the canary instance (rollouts[].canary.name)")
    sp.add_argument(
        "--share", type=float, required=True, help=f"share of the model's requests, (0, {MAX_CANARY_SHARE:g}]"
    )
    sp.add_argument(
        "--lease", type=float, required=True, metavar="SECONDS", help="the lease: until now + SECONDS"
    )
    sp.add_argument("--phase", default="observing", help="free text kept with the lease (default observing)")
    common(sp)
    sp = sub.add_parser("clear", help="remove a canary's lease (idempotent)")
    sp.add_argument("name", help="the canary instance")
    common(sp)
    sp = sub.add_parser("show", help="the leases and the drained set, as JSON")
    common(sp)
    p.epilog = (
        "Per gateway: run it on every gateway host (the rollout controller does). Exit codes: 0 done; 1 error; "
        "2 refused (not a canary of routes.json, share outside (0, 0.5], lease not positive), nothing changed."
    )
    p.set_defaults(handler=_run)
