"""vllm-fleet: systemd-native deployment and observability for vLLM on bare-metal hosts."""

__version__ = "0.1.0"
