"""Observability helpers shared by the alert rules, the dashboards and their tests.

``VLLM_METRICS`` is the list of metric names vLLM 0.32 exports (read from a live engine's /metrics, see
docs/observability.md; the catalogue is ``vllm_fleet.vllm_metrics``). Queries must use only these (and the
exporters' names); the live test proves it. The alert-threshold checks of the planner are in ``thresholds``
(re-exported here); rendering only the monitoring folders is ``vllm_fleet.fleet.render.render_monitoring``. Nothing here
imports the renderer: the planner imports ``thresholds``, and so this package.
"""

from __future__ import annotations

from vllm_fleet.fleet.observability.thresholds import REQUEST_LATENCY_BUCKETS as REQUEST_LATENCY_BUCKETS
from vllm_fleet.fleet.observability.thresholds import TTFT_BUCKETS as TTFT_BUCKETS
from vllm_fleet.fleet.observability.thresholds import check_alert_thresholds as check_alert_thresholds
from vllm_fleet.vllm_metrics import VLLM_COUNTERS as VLLM_COUNTERS
from vllm_fleet.vllm_metrics import VLLM_GAUGES as VLLM_GAUGES
from vllm_fleet.vllm_metrics import VLLM_HISTOGRAMS as VLLM_HISTOGRAMS
from vllm_fleet.vllm_metrics import VLLM_METRICS as VLLM_METRICS
