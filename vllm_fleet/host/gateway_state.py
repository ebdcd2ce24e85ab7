"""The gateway's runtime state file (``gateway.state_file``, /etc/vllm-fleet/gateway/drained.json): its format in
one place, for every Python reader and writer (``vllm-fleet drain`` / ``undrain``, ``vllm-fleet canary``, the
host exporter). nginx's router (nginx/router.js.j2) reads it on every request and its ``peer()`` handler writes
it too; it keeps the keys it does not own, as ``write_state`` does.

::

    {"drained": ["a", ...],                  # vllm-fleet drain: instances out of rotation (sorted)
     "updated": T,                           # epoch seconds of the last write
     "canary": {"NAME": {"model": M,         # vllm-fleet canary set: a canary's lease (optional key)
                         "share": S,         # 0 < S <= 0.5: the share of M's requests the canary gets
                         "until": EPOCH,     # the lease: no canary traffic from then on
                         "phase": "observing",
                         "since": EPOCH}}}   # when this lease was first set (kept while renewed)

Any other key is kept as it was. The file is replaced atomically (a temp file in the same folder, then a
rename): the router never reads it half-written. The Python writers change it under a ``flock`` of its folder
(``update_state``; no lock file), so a drain and the rollout controller's lease renewal never undo each other,
and write only while the file is still the one they read (else they read it again): nginx's peer handler
cannot take the lock.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# the largest share of a model's requests a canary may get (the router refuses more too)
MAX_CANARY_SHARE = 0.5


class StateFileError(ValueError):
    """The state file exists but is not a state file (not JSON, not an object)."""


@dataclass(frozen=True)
class CanaryLease:
    """One canary's entry under ``"canary"``."""

    model: str
    share: float
    until: float
    phase: str = "observing"
    since: float = 0.0

    def live(self, now: float | None = None) -> bool:
        """Whether the router sends the canary traffic: the lease runs and the share is one it accepts (the
        router also leaves out a canary in the drained set)."""
        now = time.time() if now is None else now
        return self.until > now and 0 < self.share <= MAX_CANARY_SHARE

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "share": self.share,
            "until": self.until,
            "phase": self.phase,
            "since": self.since,
        }

    @classmethod
    def from_json(cls, doc: object) -> CanaryLease | None:
        """The entry, or None when it is not one (an entry the router would not use either)."""
        if not isinstance(doc, dict):
            return None
        try:
            share, until = float(doc["share"]), float(doc["until"])
            since = float(doc.get("since") or 0.0)
        except (KeyError, TypeError, ValueError):
            return None
        if not (math.isfinite(share) and math.isfinite(until) and math.isfinite(since)):
            return None
        return cls(str(doc.get("model") or ""), share, until, str(doc.get("phase") or ""), since)


@dataclass
class GatewayState:
    """The state file's content. ``extra``: keys this version does not know, written back unchanged."""

    drained: list[str] = field(default_factory=list)
    canary: dict[str, CanaryLease] = field(default_factory=dict)
    updated: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = dict(self.extra)
        doc["drained"] = sorted(set(self.drained))
        doc["updated"] = self.updated
        if self.canary:
            doc["canary"] = {n: c.to_json() for n, c in sorted(self.canary.items())}
        else:
            doc.pop("canary", None)
        return doc

    @classmethod
    def from_json(cls, doc: object) -> GatewayState:
        if not isinstance(doc, dict):
            raise StateFileError("not a JSON object")
        drained = doc.get("drained")
        canary: dict[str, CanaryLease] = {}
        raw = doc.get("canary")
        if isinstance(raw, dict):
            for name, entry in raw.items():
                lease = CanaryLease.from_json(entry)
                if lease is not None:
                    canary[str(name)] = lease
        try:
            updated = float(doc.get("updated") or 0.0)
        except (TypeError, ValueError):
            updated = 0.0
        extra = {k: v for k, v in doc.items() if k not in ("drained", "updated", "canary")}
        return cls(
            drained=[str(x) for x in drained] if isinstance(drained, list) else [],
            canary=canary,
            updated=updated,
            extra=extra,
        )


def read_state(path: Path) -> GatewayState:
    """The state file at ``path``; an empty state when there is none. ``StateFileError`` when it is not one."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return GatewayState()
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise StateFileError(f"{path}: not valid JSON ({exc})") from None
    try:
        return GatewayState.from_json(doc)
    except StateFileError as exc:
        raise StateFileError(f"{path}: {exc}") from None


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def write_atomic(path: Path, text: str, unchanged: tuple[int, int, int] | bool | None = False) -> bool:
    """Replace ``path`` by ``text``: a temp file in the same folder, fsynced, then a rename (mode kept).
    ``unchanged``: the file's stamp when it was read (None: there was none); the rename happens only while the
    file still has it (else False, nothing written): nginx's peer handler writes the file without the lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        if unchanged is not False and _stamp(path) != unchanged:
            Path(tmp).unlink()
            return False
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write_state(path: Path, state: GatewayState, now: float | None = None) -> None:
    """Write ``state`` (``updated`` set to ``now``) to ``path`` atomically."""
    state.updated = time.time() if now is None else now
    write_atomic(path, json.dumps(state.to_json(), indent=2) + "\n")


# how often an update reads the file again when nginx's peer handler replaced it meanwhile
UPDATE_TRIES = 20


def update_state(path: Path, change: Callable[[GatewayState], T]) -> T:
    """Read the state file at ``path``, ``change`` it, write it: under an exclusive ``flock`` of its folder (the
    Python writers: drain, canary; the file itself is replaced by each write, so it cannot hold the lock), and
    again from the read when the file was replaced meanwhile (nginx's peer handler, which cannot take the
    lock). ``change``'s result is returned; nothing is written when it raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for _ in range(UPDATE_TRIES):
            before = _stamp(path)
            state = read_state(path)
            result = change(state)
            state.updated = time.time()
            if write_atomic(path, json.dumps(state.to_json(), indent=2) + "\n", before):
                return result
        raise StateFileError(f"{path}: replaced by another writer {UPDATE_TRIES} times while it was updated")
    finally:
        os.close(fd)  # releases the lock
