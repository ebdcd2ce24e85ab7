"""``vllm-fleet rollout SPEC MODEL -i INVENTORY``: a canary rollout of one served model (docs/rollouts.md).

The spec writes the new version of a served model (a model revision, engine flags, a stack) in ``models``;
with a ``rollouts`` entry for it, site.yml deploys the change to a canary instance only (its files; it does not
start it) and the running instances keep the config they run (``vf.held``). This command then:

1. starts the canary (``systemctl start vllm@CANARY``: returns when it serves) and asks it for a real
   completion from a gateway host. A canary that fails either never enters rotation: it is stopped, and the
   cause is reported (exit ``EXIT_FAILED_START``).
2. arms the dead-man rule: a guard on the canary's host (``vllm-fleet canary-guard``, a transient unit) stops
   the canary when its lease runs out, and every gateway's canary entry carries the same lease
   (``vllm-fleet canary set``): the controller renews both every ``tick`` seconds; when it dies, the gateways
   send the canary nothing within ``lease_seconds`` and the guard stops it.
3. puts the canary into rotation on every gateway (``share`` of the model's requests; under ``cache_aware``
   a share of the prefix keys) and every ``tick`` asks the monitoring host's Prometheus for the canary's and
   the stable instances' figures since then (``rollout_gate``), judging them: wait, roll back, or promote.
4. rolls back: out of rotation on every gateway, the canary stopped (its launcher drains what it still runs),
   the report with the numbers (exit ``EXIT_ROLLED_BACK``); or promotes: ``ansible-playbook site.yml -e
   vllm_fleet_rollout_promote=MODEL`` (the stable instances restart one by one on the new version through the
   drain path, a failed one rolls back), the canary serving its share meanwhile, then stopped (exit 0; a
   failed promotion: ``EXIT_PROMOTION_FAILED``).

Every step is printed, posted to the fleet's Alertmanager (its Slack route carries it) and visible in
`vllm-fleet status` (the gateways' canary entries, exported by each gateway's exporter). SIGINT / SIGTERM
revert the canary like a rollback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from vllm_fleet.fleet import rollout_gate as gate
from vllm_fleet.fleet.engine import listen_address
from vllm_fleet.fleet.ha import drained_set_file
from vllm_fleet.fleet.network import monitoring_listen_address
from vllm_fleet.fleet.remote import Remote, RemoteError, ansible_bin, load_inventory
from vllm_fleet.fleet.spec import FleetSpec, ModelInstance, load_spec

EXIT_PROMOTED, EXIT_ROLLED_BACK, EXIT_USAGE, EXIT_FAILED_START, EXIT_PROMOTION_FAILED, EXIT_ERROR = (
    0,
    1,
    2,
    3,
    4,
    5,
)
# the guard's lease folder on the canary's host (vllm_fleet.host.canary_guard.LEASE_DIR: the host side's
# constant, which controller code does not import)
LEASE_DIR = "/run/vllm-fleet-rollout"
# renewals that may fail in a row on one gateway before the rollout gives up (its lease ends soon after)
RENEW_FAILURES = 3


class RolloutError(Exception):
    def __init__(self, msg: str, code: int = EXIT_ERROR) -> None:
        super().__init__(msg)
        self.code = code


@dataclass
class Record:
    """What happened, for the report file and the closing lines."""

    model: str
    canary: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    verdict: dict[str, Any] | None = None
    outcome: str = ""

    def add(self, step: str, text: str, **extra: Any) -> None:
        self.steps.append({"at": time.time(), "step": step, "text": text, **extra})
        print(f"{time.strftime('%H:%M:%S')} rollout {self.model} [{step}] {text}", flush=True)


class Controller:
    def __init__(
        self, spec: FleetSpec, model: str, remote: Remote, playbook: str, inventory: str, extra: list[str]
    ) -> None:
        r = spec.rollout_of(model)
        canary = spec.canary_of(model)
        if r is None or canary is None:
            known = ", ".join(x.model for x in spec.rollouts) or "none"
            raise RolloutError(
                f"no rollouts entry for served model {model!r} (rollouts: {known})", EXIT_USAGE
            )
        self.spec, self.r, self.canary = spec, r, canary
        self.stables: list[ModelInstance] = [
            m for m in spec.models if m.served_model_name == model and m.role == "primary"
        ]
        self.remote, self.playbook, self.inventory, self.extra = remote, playbook, inventory, extra
        self.gateways = spec.gateway_hosts if spec.gateway.enabled else []
        self.vf = f"{spec.paths.venv}/bin/vllm-fleet"
        self.state_file = drained_set_file(spec)
        self.unit = f"vllm@{canary.name}.service"
        self.guard_unit = f"vllm-fleet-canary-guard-{canary.name}"
        self.lease_path = f"{LEASE_DIR}/{canary.name}.json"
        self.tick = max(1.0, min(5.0, r.lease_seconds / 4))
        self.rec = Record(model, canary.name)
        self.in_rotation = False
        self.started = False
        self._renew_failures: dict[str, int] = {}
        self._lock = threading.Lock()
        self.phase = "starting"
        self.t_start = time.time()
        self.scrape = gate.scrape_interval_seconds(spec)
        self.last: tuple[gate.Figures, gate.Figures] | None = None

    # ------------------------------------------------------------------ hosts
    def _check(self, host: str, argv: list[str], what: str, timeout: float = 60) -> str:
        cp = self.remote.run(host, argv, timeout=timeout)
        if cp.returncode != 0:
            raise RolloutError(
                f"{what} on {host} failed (exit {cp.returncode}): {(cp.stderr or cp.stdout).strip()[-500:]}"
            )
        return cp.stdout

    def renew(self) -> None:
        """The canary's lease, on its host's guard and on every gateway (``set`` also puts it in rotation)."""
        with self._lock:
            until = time.time() + self.r.lease_seconds
            body = json.dumps({"until": until, "model": self.r.model})
            tmp = f"{self.lease_path}.tmp"
            cp = self.remote.run(
                self.canary.host,
                [
                    "sh",
                    "-c",
                    f"printf '%s' {shlex.quote(body)} > {tmp} && mv {tmp} {self.lease_path}",
                ],
            )
            failed = (
                [f"{self.canary.host} (guard lease): {cp.stderr.strip()[-200:]}"] if cp.returncode else []
            )
            for g in self.gateways:
                cp = self.remote.run(
                    g,
                    [
                        self.vf, "canary", "set", self.canary.name,
                        "--share", str(self.r.share), "--lease", str(self.r.lease_seconds),
                        "--phase", self.phase, "--state", self.state_file,
                    ],
                )  # fmt: skip
                if cp.returncode:
                    self._renew_failures[g] = self._renew_failures.get(g, 0) + 1
                    failed.append(f"{g}: {(cp.stderr or cp.stdout).strip()[-200:]}")
                else:
                    self._renew_failures[g] = 0
            if failed:
                self.rec.add("lease", "renewal failed: " + "; ".join(failed))
            lost = [g for g, n in self._renew_failures.items() if n >= RENEW_FAILURES]
            if lost:
                raise RolloutError(
                    f"the canary's lease could not be renewed on gateway {', '.join(lost)} "
                    f"{RENEW_FAILURES} times in a row"
                )

    def out_of_rotation(self) -> list[str]:
        """The canary out of every gateway's rotation; the gateways that could not be told (their lease ends)."""
        missed = []
        for g in self.gateways:
            cp = self.remote.run(
                g, [self.vf, "canary", "clear", self.canary.name, "--state", self.state_file]
            )
            if cp.returncode:
                missed.append(f"{g} ({(cp.stderr or cp.stdout).strip()[-200:]}; its lease ends by itself)")
        self.in_rotation = False
        return missed

    def stop_canary(self) -> None:
        """Stop the canary (its launcher drains what it still runs) and its guard; remove the lease."""
        h = self.canary.host
        timeout = self.canary.shutdown_timeout + 120
        self.remote.run(h, ["systemctl", "stop", self.unit], timeout=timeout)
        self.remote.run(
            h,
            [
                "sh",
                "-c",
                f"systemctl stop {self.guard_unit}.service 2>/dev/null; "
                f"rm -f {self.lease_path}; systemctl reset-failed {self.unit} 2>/dev/null; true",
            ],
        )

    def failure_cause(self) -> str:
        """The canary's failure in one line (``vllm-fleet why`` on its host: vllm_fleet/host/failure_cause.py)."""
        cp = self.remote.run(
            self.canary.host,
            [self.vf, "why", self.canary.name, "--state-dir", self.spec.paths.state_dir, "--since", "30min"],
        )
        return " ".join(cp.stdout.split())[-600:] or "no cause logged (journalctl -u " + self.unit + ")"

    # ------------------------------------------------------------------ monitoring
    def _prometheus(self, exprs: list[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
        mon = self.spec.monitoring
        errors = []
        for h in self.spec.monitoring_hosts:
            base = (
                f"http://{monitoring_listen_address(self.spec, h)}:{mon.prometheus_port}/api/v1/query?query="
            )
            reqs = [
                {
                    "url": base + urllib.parse.quote(e),
                    "auth_user": mon.web_user if mon.web_auth else "",
                    "auth_file": mon.web_password_file,
                    "timeout": 10,
                }
                for e in exprs
            ]
            try:
                answers = self.remote.http(h, reqs)
            except RemoteError as exc:
                errors.append(str(exc))
                continue
            out: dict[str, list[tuple[dict[str, str], float]]] = {}
            bad = [a for a in answers if a.get("status") != 200]
            if bad:
                errors.append(f"{h}: {bad[0].get('error') or bad[0].get('body', '')[:200]}")
                continue
            for e, a in zip(exprs, answers, strict=True):
                doc = json.loads(a["body"])
                out[e] = [(dict(s["metric"]), float(s["value"][1])) for s in doc["data"]["result"]]
            return out
        raise RolloutError("no monitoring host's Prometheus answered: " + "; ".join(errors))

    def figures(self, elapsed: float) -> tuple[gate.Figures, gate.Figures]:
        """(canary, stable) since the canary entered rotation: every query in one round trip."""
        seconds = gate.range_seconds(elapsed, self.scrape)
        exprs = [
            e for t in (gate.CANARY, gate.STABLE) for e in gate.queries(self.r.model, t, seconds).values()
        ]
        answers = self._prometheus(exprs)
        return gate.read_figures(lambda e: answers[e], self.r, elapsed, self.scrape)

    def event(self, step: gate.Step, summary: str, description: str = "") -> None:
        """Post a step to the fleet's Alertmanager from each monitoring host (best effort: printed either way;
        its Slack route carries it)."""
        mon = self.spec.monitoring
        ev = gate.rollout_event(self.spec, self.r, self.t_start, step, summary, description)
        body = json.dumps([ev.alert()])
        for h in self.spec.monitoring_hosts:
            url = f"http://{monitoring_listen_address(self.spec, h)}:{mon.alertmanager_port}/api/v2/alerts"
            try:
                [a] = self.remote.http(
                    h,
                    [{"method": "POST", "url": url, "body": body, "auth_user": mon.web_user if mon.web_auth else "",
                      "auth_file": mon.web_password_file, "timeout": 10}],
                )  # fmt: skip
            except (RemoteError, ValueError) as exc:
                self.rec.add("event", f"not posted to {h}'s Alertmanager: {exc}")
                continue
            if a.get("status") != 200:
                self.rec.add(
                    "event", f"not posted to {h}'s Alertmanager: {a.get('error') or a.get('status')}"
                )

    # ------------------------------------------------------------------ the rollout
    def start(self) -> None:
        """Start the canary and check it answers, else stop it and raise (it never entered rotation)."""
        h = self.canary.host
        cp = self.remote.run(
            h, ["test", "-e", f"{self.spec.paths.config_dir}/instances/{self.canary.name}.json"]
        )
        if cp.returncode:
            raise RolloutError(
                f"the canary {self.canary.name} is not deployed on {h} (no instance config): run site.yml with "
                "this spec first (it deploys the canary's files, and starts nothing)",
                EXIT_USAGE,
            )
        self.rec.add("start", f"starting {self.unit} on {h} (returns when it serves)")
        self.event("started", f"canary {self.canary.name} of {self.r.model} starting on {h}")
        svc = self.canary.service
        self.started = True
        timeout = svc.load_timeout_seconds + svc.start_timeout_seconds + 60
        # (vllm-fleet restart: a start systemd failed to spawn is tried again; its stdout the cause otherwise)
        start = [self.vf, "restart", self.canary.name, "--state-dir", self.spec.paths.state_dir]
        cp = self.remote.run(h, start, timeout=timeout)
        if cp.returncode:
            cause = " ".join(cp.stdout.split())[-600:] or self.failure_cause()
            self.stop_canary()
            raise RolloutError(
                f"the canary {self.canary.name} did not start on {h}: {cause}. It never entered rotation; the "
                "stable instances are untouched.",
                EXIT_FAILED_START,
            )
        addr = f"http://{listen_address(self.spec, self.canary)}:{self.canary.port}/v1/completions"
        first = self.gateways[0] if self.gateways else h
        body = json.dumps({"model": self.r.model, "prompt": "vllm-fleet canary check", "max_tokens": 4})
        try:
            [a] = self.remote.http(
                first, [{"method": "POST", "url": addr, "body": body, "timeout": 120}], 180
            )
            ok = a.get("status") == 200 and json.loads(a.get("body") or "{}").get("choices")
            why = a.get("error") or f"HTTP {a.get('status')}: {str(a.get('body'))[:300]}"
        except (RemoteError, ValueError) as exc:
            ok, why = False, str(exc)
        if not ok:
            self.stop_canary()
            raise RolloutError(
                f"the canary {self.canary.name} started but gave no completion from {first}: {why}. It never "
                "entered rotation; the stable instances are untouched.",
                EXIT_FAILED_START,
            )
        self.rec.add("start", f"{self.canary.name} serves (a completion from {first})")

    def arm(self) -> None:
        """The guard on the canary's host, then the canary into every gateway's rotation (both leased)."""
        h = self.canary.host
        until = time.time() + self.r.lease_seconds
        self._check(
            h,
            ["sh", "-c",
             f"mkdir -p {LEASE_DIR} && printf '%s' {shlex.quote(json.dumps({'until': until}))} > {self.lease_path} && "
             f"(systemctl stop {self.guard_unit}.service 2>/dev/null; systemctl reset-failed {self.guard_unit}.service "
             f"2>/dev/null; systemd-run --quiet --collect --unit {self.guard_unit} {self.vf} canary-guard "
             f"{self.canary.name} --lease-dir {LEASE_DIR})"],
            "starting the canary's guard",
        )  # fmt: skip
        self.phase = "observing"
        self.renew()
        self.in_rotation = True
        self.rec.add(
            "rotation",
            f"{self.canary.name} takes {self.r.share:.0%} of {self.r.model}'s requests on "
            f"{', '.join(self.gateways) or 'no gateway'} (lease {self.r.lease_seconds} s, renewed every {self.tick:g} s)",
        )
        self.event(
            "in_rotation", f"canary {self.canary.name} in rotation: {self.r.share:.0%} of {self.r.model}"
        )

    def observe(self) -> gate.Verdict:
        """Judge the canary every ``tick`` seconds (renewing its lease first) until the gate decides."""
        t0 = time.time()
        next_at = t0
        while True:
            next_at += self.tick
            time.sleep(max(0.0, next_at - time.time()))
            self.renew()
            elapsed = time.time() - t0
            canary, stable = self.figures(elapsed)
            v = gate.judge(self.r, canary, stable, elapsed)
            line = f"{elapsed:4.0f}s {gate.progress_line(canary, stable)} -> {v.action}: {v.reason}"
            self.rec.add("observe", line)
            if v.action != "wait":
                self.last = (canary, stable)
                self.rec.verdict = {
                    "action": v.action, "rule": v.rule, "reason": v.reason, "report": gate.report(v, canary, stable),
                    "canary": canary.__dict__, "stable": stable.__dict__,
                }  # fmt: skip
                ev = gate.verdict_event(self.spec, self.r, self.t_start, v, canary, stable)
                self.event(ev.step, ev.summary, ev.description)
                return v

    def rollback(self, why: str) -> None:
        missed = self.out_of_rotation() if self.gateways else []
        if missed:
            self.rec.add("rollback", "not told: " + "; ".join(missed))
        self.stop_canary()
        self.rec.add("rollback", f"{self.canary.name} out of rotation and stopped: {why}")

    def promote(self) -> bool:
        """site.yml with the model's change promoted, the canary's lease renewed meanwhile."""
        self.phase = "promoting"
        cmd = [
            ansible_bin("ansible-playbook"), "-i", self.inventory, self.playbook,
            "-e", f"vllm_fleet_spec={self.spec_path}", "-e", f"vllm_fleet_rollout_promote={self.r.model}",
            *self.extra,
        ]  # fmt: skip
        shown = " ".join(shlex.quote(c) for c in cmd)
        self.rec.add("promote", f"rolling the stable instances onto the new version: {shown}")
        self.event("promoting", f"canary {self.canary.name} passed: promoting {self.r.model}", shown)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stop = threading.Event()

        def hold_on(signum: int, frame: FrameType | None) -> None:  # a half-done rolling restart is worse
            self.rec.add("promote", f"signal {signal.Signals(signum).name}: the play finishes first (it rolls back "
                                    "an instance that fails on its own)")  # fmt: skip

        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, hold_on)

        def keep() -> None:
            while not stop.wait(self.tick):
                try:
                    self.renew()
                except RolloutError as exc:
                    self.rec.add("lease", str(exc))

        t = threading.Thread(target=keep, daemon=True)
        t.start()
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = [*tail, line.rstrip()][-40:]
            if (
                line.startswith(("PLAY ", "TASK [engine : Restart", "fatal:", "PLAY RECAP"))
                or "rollout stopped" in line
            ):
                print("    " + line.rstrip(), flush=True)
        rc = proc.wait()
        stop.set()
        t.join(timeout=30)
        if rc:
            self.rec.add("promote", f"site.yml failed (exit {rc}):\n    " + "\n    ".join(tail[-12:]))
        return rc == 0

    spec_path: str = ""

    def run(self) -> int:
        try:
            self.start()
            self.arm()
            v = self.observe()
        except RolloutError as exc:
            if exc.code == EXIT_FAILED_START:
                self.rec.outcome = "failed_to_start"
                self.rec.add("failed", str(exc))
                self.event(
                    "failed_to_start",
                    f"canary {self.canary.name} of {self.r.model} failed to start",
                    str(exc),
                )
                return exc.code
            if self.started:
                self.rollback(str(exc))
            self.rec.outcome = "error"
            self.rec.add("error", str(exc))
            self.event("stopped", f"rollout of {self.r.model} stopped: canary reverted", str(exc))
            return exc.code
        text = str((self.rec.verdict or {}).get("report", v.reason))
        print(text, flush=True)
        if v.action == "rollback":
            self.rollback(v.reason)
            self.rec.outcome = "rolled_back"
            self.event(
                "rolled_back", f"canary {self.canary.name} of {self.r.model} rolled back: {v.reason}", text
            )
            return EXIT_ROLLED_BACK
        ok = self.promote()
        missed = self.out_of_rotation() if self.gateways else []
        if missed:
            self.rec.add("promote", "not told: " + "; ".join(missed))
        self.stop_canary()
        if not ok:
            self.rec.outcome = "promotion_failed"
            self.event("promotion_failed", f"promotion of {self.r.model} failed: see the play's output")
            return EXIT_PROMOTION_FAILED
        self.rec.outcome = "promoted"
        self.rec.add(
            "promoted", f"{self.r.model}'s instances run the new version; {self.canary.name} stopped"
        )
        self.event("promoted", f"{self.r.model} promoted: its instances run the new version")
        return EXIT_PROMOTED

    def interrupt(self, signum: int, frame: FrameType | None) -> None:
        raise RolloutError(f"interrupted by signal {signal.Signals(signum).name}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="the fleet spec (the new version of MODEL in models, and its rollouts entry)")
    p.add_argument("model", help="the served model to roll out (rollouts[].model)")
    p.add_argument("-i", "--inventory", required=True, help="the Ansible inventory site.yml uses")
    p.add_argument("--playbook", default="site.yml", help="the playbook that promotes (default: site.yml)")
    p.add_argument("--report", default="", help="write the rollout's record (JSON) here")
    p.add_argument(
        "--ansible-arg",
        action="append",
        default=[],
        help="one more argument for the promoting ansible-playbook",
    )
    p.set_defaults(handler=_run)


def _run(a: argparse.Namespace) -> int:
    spec = load_spec(a.spec)
    try:
        remote = Remote(load_inventory(a.inventory))
        c = Controller(spec, a.model, remote, a.playbook, a.inventory, a.ansible_arg)
    except (RolloutError, RemoteError) as exc:
        print(f"vllm-fleet rollout: {exc}", file=sys.stderr)
        return getattr(exc, "code", EXIT_ERROR)
    c.spec_path = str(Path(a.spec).resolve())
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, c.interrupt)
    try:
        code = c.run()
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        if a.report:
            Path(a.report).write_text(json.dumps(c.rec.__dict__, indent=2, default=str) + "\n")
        remote.close()
    print(f"rollout of {a.model}: {c.rec.outcome} (exit {code})", flush=True)
    return code
