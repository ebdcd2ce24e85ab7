"""``vllm-fleet bench``: mixed-workload load generator for OpenAI/Anthropic-compatible LLM endpoints.

Modules: ``workload`` (YAML profiles), ``prompts`` (N-token prompts), ``client`` (one streamed request),
``runner`` (arrival, bounds, warm-up), ``stats`` (percentiles, throughput, errors), ``metrics`` (engine
/metrics over the run), ``report`` (JSON, table), ``plot`` (PNG), ``compare`` (A/B interleaved rounds),
``scenarios`` (failover, rolling restart), ``cli`` (the sub-command).
"""
