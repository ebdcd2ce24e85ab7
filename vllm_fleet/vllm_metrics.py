"""The catalogue of vLLM 0.32 /metrics names that vllm-fleet reads (labels model_name, engine).

Read from a live engine's /metrics (docs/observability.md). The alert rules' and dashboards' queries must use
only these (and the exporters' names: ``VLLM_METRICS``, re-exported by ``vllm_fleet.fleet.observability``);
``vllm-fleet bench`` watches the ``RUN_*`` part over a run (``vllm_fleet.bench.metrics``). Counters carry
_total, histograms _bucket/_sum/_count.
"""

from __future__ import annotations

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

# what bench watches: the change of these counters over the run ...
RUN_COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
# ... and of these histograms' _sum and _count ...
RUN_HISTOGRAMS = ("vllm:request_queue_time_seconds",)
# ... and these gauges, sampled during the run
RUN_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")

VLLM_GAUGES = (
    *RUN_GAUGES,
    "vllm:num_requests_waiting_by_reason",
    "vllm:engine_sleep_state",
    "vllm:cache_config_info",
)
VLLM_COUNTERS = (
    *RUN_COUNTERS,
    "vllm:prompt_tokens_cached_total",
    "vllm:admission_rejections_total",
)
VLLM_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    *RUN_HISTOGRAMS,
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
)
VLLM_METRICS = frozenset(
    [*VLLM_GAUGES, *VLLM_COUNTERS] + [h + s for h in VLLM_HISTOGRAMS for s in HISTOGRAM_SUFFIXES]
)
