"""The canary gate of a rollout (``rollouts:`` in the spec, issue 29; docs/rollouts.md, "How the canary is
judged"): what the canary and the stable instances did since the canary entered rotation, read from Prometheus
(``read_figures``), the decision (``judge``: wait, roll back or promote), the lines an operator reads
(``report``), and every rollout step posted to the fleet's Alertmanager (``post_event``), whose Slack route
carries it (monitoring/alertmanager.yml.j2).

Pure apart from ``post_event`` and the asker ``prometheus_asker`` builds: ``read_figures`` takes the function
that answers a PromQL expression, so tests give canned answers and ``vllm-fleet rollout`` the real Prometheus.

The figures, per track (the gateways' ``track`` of a request: ``canary`` or ``stable``), over the ``N`` seconds
since the canary entered rotation:

- requests and errors: the gateways' ``vllm_fleet_gateway_track_requests_total{model, track, outcome}``
  summed over the gateways (job ``vllm-fleet-exporter``); errors are the outcomes ``error`` and ``shed`` (the
  canary answered 503 full);
- TTFT and end-to-end p95: the engines' own histograms (job ``vllm``) of that track; on the stable side only
  ``role="primary"`` (the stable track also holds the backups and fallbacks).
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

from vllm_fleet.fleet.observability.alerts import OVERVIEW_UID
from vllm_fleet.fleet.spec import FleetSpec, Monitoring, Rollout
from vllm_fleet.fleet.status import ENGINE_JOB, EXPORTER_JOB, Sample, ask, basic_auth_header

# --------------------------------------------------------------------------------------------- the queries

TRACK_COUNTER = "vllm_fleet_gateway_track_requests_total"  # the gateways' exporter: {model, track, outcome}
TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
E2E_BUCKET = "vllm:e2e_request_latency_seconds_bucket"
ERROR_OUTCOMES = ("error", "shed")  # outcome "ok" is the rest
QUANTILE = 0.95
# the shortest range a query reads, in scrape intervals: increase() needs two samples in its range, and a range
# of one interval holds one or none
MIN_RANGE_SCRAPES = 2
CANARY, STABLE = "canary", "stable"

Action = Literal["wait", "rollback", "promote"]
AskFn = Callable[[str], list[Sample]]


def duration_seconds(text: str) -> float:
    """A Prometheus duration (``15s``, ``1m30s``, ``500ms``, ``1h``) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(int(n) * units[u] for n, u in parts)


def scrape_interval_seconds(spec: FleetSpec) -> float:
    """The scrape interval Prometheus runs with: ``monitoring.scrape_interval``, the global
    ``scrape_interval`` of the rendered prometheus.yml (monitoring/prometheus.yml.j2; no job overrides it)."""
    return duration_seconds(spec.monitoring.scrape_interval)


DEFAULT_SCRAPE_SECONDS = duration_seconds(Monitoring().scrape_interval)


def range_seconds(elapsed: float, scrape_interval: float = DEFAULT_SCRAPE_SECONDS) -> int:
    """The queries' range: the whole seconds since the canary entered rotation, at least
    ``MIN_RANGE_SCRAPES`` scrape intervals."""
    return max(math.ceil(elapsed), math.ceil(MIN_RANGE_SCRAPES * scrape_interval), 1)


def _q(value: str) -> str:
    """A PromQL string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def queries(model: str, track: str, seconds: int) -> dict[str, str]:
    """The four expressions of one track: requests, errors, ttft_p95, e2e_p95."""
    gw = f"job={_q(EXPORTER_JOB)}, model={_q(model)}, track={_q(track)}"
    engine = f"job={_q(ENGINE_JOB)}, model={_q(model)}, track={_q(track)}"
    if track == STABLE:
        engine += ', role="primary"'
    errors = _q("|".join(ERROR_OUTCOMES))

    def p95(bucket: str) -> str:
        return f"histogram_quantile({QUANTILE}, sum by (le) (increase({bucket}{{{engine}}}[{seconds}s])))"

    return {
        "requests": f"sum(increase({TRACK_COUNTER}{{{gw}}}[{seconds}s]))",
        "errors": f"sum(increase({TRACK_COUNTER}{{{gw}, outcome=~{errors}}}[{seconds}s]))",
        "ttft_p95": p95(TTFT_BUCKET),
        "e2e_p95": p95(E2E_BUCKET),
    }


# --------------------------------------------------------------------------------------------- the figures


@dataclass(frozen=True)
class Figures:
    """One track's figures since the canary entered rotation (``seconds``: the queries' range)."""

    track: str
    requests: float
    errors: float  # outcomes error and shed
    ttft_p95: float | None  # seconds; None: no samples
    e2e_p95: float | None
    seconds: int
    queries: dict[str, str] = field(default_factory=dict)

    @property
    def error_ratio(self) -> float | None:
        return self.errors / self.requests if self.requests > 0 else None


def _scalar(samples: list[Sample]) -> float | None:
    """The one value of an aggregated answer; None when empty or not a number (a quantile of no samples)."""
    values = [v for _, v in samples if math.isfinite(v)]
    return values[0] if values else None


def read_figures(
    ask_fn: AskFn, rollout: Rollout, elapsed: float, scrape_interval: float = DEFAULT_SCRAPE_SECONDS
) -> tuple[Figures, Figures]:
    """(canary, stable) over the ``elapsed`` seconds since the canary entered rotation; ``ask_fn`` answers
    one instant query (``prometheus_asker``). ``scrape_interval``: ``scrape_interval_seconds(spec)``."""
    seconds = range_seconds(elapsed, scrape_interval)
    out: list[Figures] = []
    for track in (CANARY, STABLE):
        qs = queries(rollout.model, track, seconds)
        got = {k: _scalar(ask_fn(expr)) for k, expr in qs.items()}
        out.append(
            Figures(
                track=track,
                requests=max(got["requests"] or 0.0, 0.0),
                errors=max(got["errors"] or 0.0, 0.0),
                ttft_p95=got["ttft_p95"],
                e2e_p95=got["e2e_p95"],
                seconds=seconds,
                queries=qs,
            )
        )
    return out[0], out[1]


def prometheus_asker(spec: FleetSpec, urls: list[str], auth: tuple[str, str] | None = None) -> AskFn:
    """``read_figures``' asker on the real Prometheus servers ``urls`` (``status.prometheus_urls``; the first
    that answers, as ``vllm-fleet status`` asks), ``auth`` as ``status._auth`` gives it."""
    return lambda expr: ask(spec, urls, auth, expr)[1]


# --------------------------------------------------------------------------------------------- the verdict

# rules (Verdict.rule, Check.rule)
SLO_TTFT, SLO_E2E, SLO_ERRORS = "slo_ttft_p95", "slo_e2e_p95", "slo_error_ratio"
STABLE_TTFT, STABLE_E2E, STABLE_ERRORS = "vs_stable_ttft_p95", "vs_stable_e2e_p95", "vs_stable_error_ratio"
TOO_FEW = "too_few_canary_requests"  # wait
INCONCLUSIVE = "inconclusive"  # rollback: too few canary requests when the extra wait ended
WATCHING = "within_slo_so_far"  # wait: enough on both sides, no breach, the window not over
STABLE_TOO_FEW = "too_few_stable_requests"  # wait: until the extra wait ends
PASSED = "window_passed"  # promote: the SLOs held and the canary within margin of stable over the window
ABSOLUTE_ONLY = "absolute_slo_only"  # promote: stable had too few, the SLOs held until the extra wait ended


@dataclass(frozen=True)
class Check:
    """One rule on the canary's figures: ``value`` against ``limit`` (seconds or a ratio)."""

    rule: str
    what: str  # "TTFT p95", "e2e p95", "error ratio"
    value: float
    limit: float
    source: str  # where the limit comes from: "slo.ttft_p95_seconds", "stable x (1 + margin 0.25)", ...
    unit: Literal["s", "ratio"]

    @property
    def breached(self) -> bool:
        return self.value > self.limit


@dataclass(frozen=True)
class Verdict:
    action: Action
    rule: str  # the rule that decided (the first breach on a rollback)
    reason: str  # one line
    model: str
    canary: str  # the canary instance's name
    elapsed: float
    window_seconds: int
    deadline_seconds: int  # window + extra wait
    min_requests: int
    checks: tuple[Check, ...] = ()  # the rules judged (none while the canary has too few requests)

    @property
    def breaches(self) -> tuple[Check, ...]:
        return tuple(c for c in self.checks if c.breached)


def _missing(f: Figures, n: int) -> list[str]:
    """Why ``f`` is not enough to judge on: too few requests, no latency samples."""
    out = [f"{f.requests:.0f} of {n} requests"] if f.requests < n else []
    out += ["no TTFT samples"] if f.ttft_p95 is None else []
    out += ["no e2e latency samples"] if f.e2e_p95 is None else []
    return out


def _checks(rollout: Rollout, canary: Figures, stable: Figures, compare: bool) -> list[Check]:
    slo, out = rollout.slo, []
    if slo.ttft_p95_seconds is not None and canary.ttft_p95 is not None:
        out.append(
            Check(SLO_TTFT, "TTFT p95", canary.ttft_p95, slo.ttft_p95_seconds, "slo.ttft_p95_seconds", "s")
        )
    if slo.e2e_p95_seconds is not None and canary.e2e_p95 is not None:
        out.append(Check(SLO_E2E, "e2e p95", canary.e2e_p95, slo.e2e_p95_seconds, "slo.e2e_p95_seconds", "s"))
    if canary.error_ratio is not None:
        out.append(
            Check(SLO_ERRORS, "error ratio", canary.error_ratio, slo.error_ratio, "slo.error_ratio", "ratio")
        )
    if compare:
        factor = f"stable x (1 + margin {rollout.margin:g})"
        for rule, what, c, s in (
            (STABLE_TTFT, "TTFT p95", canary.ttft_p95, stable.ttft_p95),
            (STABLE_E2E, "e2e p95", canary.e2e_p95, stable.e2e_p95),
        ):
            if c is not None and s is not None:
                out.append(Check(rule, what, c, s * (1 + rollout.margin), factor, "s"))
        if canary.error_ratio is not None:
            base = stable.error_ratio or 0.0
            out.append(
                Check(STABLE_ERRORS, "error ratio", canary.error_ratio, base + slo.error_ratio,
                      "stable + slo.error_ratio", "ratio")
            )  # fmt: skip
    return out


def _dur(seconds: float) -> str:
    s = max(0, int(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _val(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if unit == "s" else f"{v * 100:.2f}%"


def _breach_text(c: Check) -> str:
    return f"canary {c.what} {_val(c.value, c.unit)} > {_val(c.limit, c.unit)} ({c.source})"


def judge(rollout: Rollout, canary: Figures, stable: Figures, elapsed: float) -> Verdict:
    """Wait, roll back or promote, ``elapsed`` seconds after the canary entered rotation (docs/rollouts.md,
    "How the canary is judged")."""
    n = rollout.min_requests
    window, deadline = rollout.window_seconds, rollout.window_seconds + rollout.extra_wait_seconds

    def verdict(action: Action, rule: str, reason: str, checks: Sequence[Check] = ()) -> Verdict:
        return Verdict(action, rule, reason, rollout.model, rollout.canary.name, elapsed, window, deadline, n,
                       tuple(checks))  # fmt: skip

    lacking = _missing(canary, n)
    if lacking:
        got = ", ".join(lacking)
        if elapsed >= deadline:
            return verdict("rollback", INCONCLUSIVE,
                           f"inconclusive: the canary got {got} in {_dur(elapsed)} (window {_dur(window)} + extra "
                           f"wait {_dur(rollout.extra_wait_seconds)})")  # fmt: skip
        return verdict("wait", TOO_FEW,
                       f"not judged yet: the canary has {got}; rolled back as inconclusive at {_dur(deadline)} "
                       "unless it gets them")  # fmt: skip
    stable_lacking = _missing(stable, n)
    checks = _checks(rollout, canary, stable, compare=not stable_lacking)
    breaches = [c for c in checks if c.breached]
    if breaches:
        return verdict("rollback", breaches[0].rule, "; ".join(_breach_text(c) for c in breaches), checks)
    if not stable_lacking:
        if elapsed >= window:
            return verdict("promote", PASSED,
                           f"within the SLOs and within margin {rollout.margin:.0%} of stable over the "
                           f"{_dur(window)} window", checks)  # fmt: skip
        return verdict("wait", WATCHING, f"no breach so far; the window ends at {_dur(window)}", checks)
    judged = ", ".join(sorted({c.what for c in checks})) or "nothing"
    if elapsed >= deadline:
        return verdict("promote", ABSOLUTE_ONLY,
                       f"judged on the absolute SLOs only ({judged}): stable has {', '.join(stable_lacking)}, "
                       "so no comparison with it", checks)  # fmt: skip
    return verdict("wait", STABLE_TOO_FEW,
                   f"within the SLOs so far; stable has {', '.join(stable_lacking)}: waiting for it until "
                   f"{_dur(deadline)}, then judged on the absolute SLOs only ({judged})", checks)  # fmt: skip


# --------------------------------------------------------------------------------------------- the report


def progress_line(canary: Figures, stable: Figures) -> str:
    """One line per judgement: each side's requests, error ratio and p95s."""

    def side(f: Figures) -> str:
        return (
            f"{f.track} {f.requests:.0f} req, err {_val(f.error_ratio, 'ratio')}, "
            f"TTFT p95 {_val(f.ttft_p95, 's')}, e2e p95 {_val(f.e2e_p95, 's')}"
        )

    return f"{side(canary)} | {side(stable)}"


def report(verdict: Verdict, canary: Figures, stable: Figures) -> str:
    """A few lines for a terminal and Slack: the verdict, the figures side by side, every rule judged."""

    def errors(f: Figures) -> str:
        return f"{f.errors:.0f}" + (f" ({_val(f.error_ratio, 'ratio')})" if f.error_ratio is not None else "")

    rows = [
        ("", "canary", "stable (primary)"),
        ("requests", f"{canary.requests:.0f}", f"{stable.requests:.0f}"),
        ("errors", errors(canary), errors(stable)),
        ("TTFT p95", _val(canary.ttft_p95, "s"), _val(stable.ttft_p95, "s")),
        ("e2e p95", _val(canary.e2e_p95, "s"), _val(stable.e2e_p95, "s")),
    ]
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    out = [
        f"{verdict.action.upper()} {verdict.model} canary {verdict.canary}: {verdict.reason}",
        f"rule {verdict.rule}; {_dur(verdict.elapsed)} in rotation (window {_dur(verdict.window_seconds)}, "
        f"inconclusive at {_dur(verdict.deadline_seconds)}); min {verdict.min_requests} requests per side",
    ]
    out += ["  " + "  ".join(c.ljust(widths[k]) for k, c in enumerate(r)).rstrip() for r in rows]
    for c in verdict.checks:
        mark = "BREACH" if c.breached else "ok"
        op = ">" if c.breached else "<="
        out.append(f"  {mark:<6} {c.what} {_val(c.value, c.unit)} {op} {_val(c.limit, c.unit)} ({c.source})")
    if not verdict.checks:
        out.append("  no rule judged yet (too few canary requests)")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------- the events

ALERTNAME = "VllmFleetRollout"
Step = Literal[
    "started", "in_rotation", "verdict", "promoting", "promoted", "promotion_failed", "rolled_back",
    "failed_to_start", "reverted_by_lease", "stopped",
]  # fmt: skip
WARNING_STEPS = frozenset(
    {"rolled_back", "failed_to_start", "reverted_by_lease", "promotion_failed", "stopped"}
)  # the rest is progress: info
# an event is an alert that ends by itself this long after it was posted (Alertmanager sends no "resolved" for
# it: the rollouts' Slack receiver has send_resolved off)
EVENT_SECONDS = 300
POST_TIMEOUT = 10.0


@dataclass(frozen=True)
class RolloutEvent:
    """One step of a rollout, as the alert ``VllmFleetRollout`` (labels fleet, model, canary, rollout, step,
    severity; annotations summary, description, runbook_url, dashboard_url)."""

    fleet: str
    model: str
    canary: str
    rollout: str  # this rollout's id (its start, UTC): two rollouts' events are two alerts
    step: Step
    summary: str  # one line
    description: str = ""  # the report
    severity: Literal["info", "warning"] | None = None  # None: warning for WARNING_STEPS, else info
    runbook_url: str = ""
    dashboard_url: str = ""
    at: float = field(default_factory=time.time)

    def alert(self) -> dict[str, object]:
        """The event as one alert of Alertmanager's API v2 (``POST /api/v2/alerts`` takes a list of them)."""
        severity = self.severity or ("warning" if self.step in WARNING_STEPS else "info")

        def iso(t: float) -> str:
            return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

        return {
            "labels": {
                "alertname": ALERTNAME, "fleet": self.fleet, "model": self.model, "canary": self.canary,
                "rollout": self.rollout, "step": self.step, "severity": severity,
            },
            "annotations": {
                "summary": self.summary,
                # in Slack a code block, so the columns line up
                "description": f"```\n{self.description}\n```" if self.description else "",
                "runbook_url": self.runbook_url,
                "dashboard_url": self.dashboard_url,
            },
            "startsAt": iso(self.at),
            "endsAt": iso(self.at + EVENT_SECONDS),
        }  # fmt: skip


def rollout_id(started_at: float) -> str:
    """A rollout's id from its start: ``20250102T030405Z``."""
    return datetime.fromtimestamp(started_at, UTC).strftime("%Y%m%dT%H%M%SZ")


def rollout_event(
    spec: FleetSpec,
    rollout: Rollout,
    started_at: float,
    step: Step,
    summary: str,
    description: str = "",
    severity: Literal["info", "warning"] | None = None,
) -> RolloutEvent:
    """A step of ``rollout`` (started at ``started_at``), its links from the spec: the runbook
    (``alerts.runbook_base_url``) and the overview dashboard on the model."""
    grafana = spec.monitoring.grafana.url.rstrip("/")
    return RolloutEvent(
        fleet=spec.name,
        model=rollout.model,
        canary=rollout.canary.name,
        rollout=rollout_id(started_at),
        step=step,
        summary=summary,
        description=description,
        severity=severity,
        runbook_url=spec.alerts.runbook_base_url.rstrip("/") + f"/{ALERTNAME}.md",
        dashboard_url=f"{grafana}/d/{OVERVIEW_UID}/{OVERVIEW_UID}?"
        + urllib.parse.urlencode({"var-model": rollout.model}),
    )


def verdict_event(
    spec: FleetSpec, rollout: Rollout, started_at: float, verdict: Verdict, canary: Figures, stable: Figures
) -> RolloutEvent:
    """The verdict step: the report as its description, warning when it rolls back."""
    return rollout_event(
        spec, rollout, started_at, "verdict",
        f"{verdict.action.upper()} {verdict.model} canary {verdict.canary}: {verdict.reason}",
        report(verdict, canary, stable),
        "warning" if verdict.action == "rollback" else "info",
    )  # fmt: skip


def alertmanager_urls(spec: FleetSpec) -> list[str]:
    """Each monitoring host's Alertmanager (``monitoring.hosts``, in order; as ``status.prometheus_urls``)."""
    return [
        f"http://{spec.host(h).address}:{spec.monitoring.alertmanager_port}" for h in spec.monitoring_hosts
    ]


def post_event(
    alertmanager_urls: list[str],
    auth: tuple[str, str] | None,
    event: RolloutEvent,
    timeout: float = POST_TIMEOUT,
) -> tuple[list[str], list[str]]:
    """Post ``event`` to every Alertmanager of ``alertmanager_urls`` (a cluster notifies once; every one is told
    so that one down loses nothing). ``auth``: the monitoring basic auth (``status._auth``: Prometheus and
    Alertmanager share ``monitoring.web_config_file``). Returns (the URLs that took it, why each other did
    not)."""
    body = json.dumps([event.alert()]).encode()
    reached: list[str] = []
    errors: list[str] = []
    for url in alertmanager_urls:
        req = urllib.request.Request(
            f"{url.rstrip('/')}/api/v2/alerts", data=body, method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        if auth is not None:
            req.add_header("Authorization", basic_auth_header(auth))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                r.read()
            reached.append(url)
        except urllib.error.HTTPError as exc:
            errors.append(f"Alertmanager at {url}: HTTP {exc.code} {exc.reason}")
        except (OSError, ValueError) as exc:
            errors.append(f"Alertmanager at {url}: {type(exc).__name__}: {exc}")
    return reached, errors
