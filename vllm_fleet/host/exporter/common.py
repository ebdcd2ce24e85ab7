"""What every collector of the host exporter shares: the metric name prefix and the logger (one name for all the
exporter's modules: its journal lines read ``vllm_fleet.host.exporter: ...`` whichever collector wrote them)."""

from __future__ import annotations

import logging

PREFIX = "vllm_fleet_"
log = logging.getLogger("vllm_fleet.host.exporter")
