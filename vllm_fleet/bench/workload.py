"""Workload profiles: request classes with shares, token sizes and API shape; arrival; bounds (YAML)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
Api = Literal["openai-chat", "openai-completions", "anthropic"]


class ProfileError(ValueError):
    """A profile that cannot be used; the message names the field path."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SharedPrefix(_Strict):
    """Requests that share prompt prefixes (what prefix caching and cache-aware routing are for): ``groups``
    tenants, each with a system prompt of ``tokens`` tokens, the same for every request of the tenant (and in
    every run with the same seed); the class's ``input_tokens`` is then the question after it. ``turns`` > 1:
    each request of a tenant continues the tenant's conversation (system prompt, the earlier questions and
    answers of ``output_tokens`` words, a new question); after ``turns`` turns a new conversation starts."""

    groups: int = Field(ge=1)
    tokens: int = Field(ge=1)
    turns: int = Field(default=1, ge=1)

    def max_prompt_tokens(self, question: int, answer: int) -> int:
        return self.tokens + self.turns * question + (self.turns - 1) * answer


class RequestClass(_Strict):
    name: str = ""
    share: float = Field(gt=0, description="relative weight; shares are normalised to sum 1")
    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=1)
    api: Api = "openai-chat"
    stream: bool = True
    thinking: bool | None = None  # None: leave the model's default; True/False: chat_template_kwargs
    json_output: bool = False  # response_format json_object (OpenAI shapes only)
    ignore_eos: bool = True  # generate exactly output_tokens (vLLM extension)
    temperature: float | None = None
    extra_body: dict[str, Any] = Field(default_factory=dict)
    shared_prefix: SharedPrefix | None = None

    @property
    def max_input_tokens(self) -> int:
        if self.shared_prefix is None:
            return self.input_tokens
        return self.shared_prefix.max_prompt_tokens(self.input_tokens, self.output_tokens)

    @model_validator(mode="after")
    def _check(self) -> RequestClass:
        if self.json_output and self.api == "anthropic":
            raise ValueError("json_output is only available with the OpenAI request shapes")
        return self


class Arrival(_Strict):
    """Closed loop (``concurrency`` users back to back) or open loop (``rate`` requests/s)."""

    concurrency: int | None = Field(default=None, ge=1)
    rate: float | None = Field(default=None, gt=0)
    poisson: bool = True  # open loop: exponential gaps (else constant gaps)
    max_concurrency: int | None = Field(default=None, ge=1)  # open loop cap on requests in flight

    @model_validator(mode="after")
    def _one(self) -> Arrival:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("set exactly one of concurrency or rate")
        return self


class Profile(_Strict):
    name: str = "profile"
    description: str = ""
    model: str | None = None  # None: the first model the target lists on /v1/models
    arrival: Arrival
    duration: float = Field(default=60.0, gt=0, description="measured seconds (after warm-up)")
    max_requests: int | None = Field(default=None, ge=1, description="measured requests to send")
    warmup: float = Field(default=0.0, ge=0, description="seconds of load excluded from the statistics")
    warmup_requests: int = Field(default=0, ge=0, description="first N requests excluded from the statistics")
    timeout: float = Field(default=300.0, gt=0, description="per-request timeout, seconds")
    seed: int = 0
    max_model_len: int | None = Field(default=None, ge=1, description="refuse classes larger than this")
    classes: dict[str, RequestClass]

    @model_validator(mode="after")
    def _check(self) -> Profile:
        if not self.classes:
            raise ValueError("classes: at least one class is needed")
        for name, c in self.classes.items():
            c.name = name
            if self.max_model_len and c.max_input_tokens + c.output_tokens > self.max_model_len:
                raise ValueError(
                    f"classes.{name}: input_tokens + output_tokens = {c.max_input_tokens + c.output_tokens}"
                    f"{' (with the shared prefix and every turn)' if c.shared_prefix else ''}"
                    f" exceeds max_model_len {self.max_model_len}"
                )
        return self

    def shares(self) -> dict[str, float]:
        total = sum(c.share for c in self.classes.values())
        return {n: c.share / total for n, c in self.classes.items()}

    def chooser(self, seed: int | None = None) -> ClassChooser:
        return ClassChooser(self, self.seed if seed is None else seed)


class ClassChooser:
    """Draws request classes by share, reproducibly (seeded)."""

    def __init__(self, profile: Profile, seed: int) -> None:
        self._rng = random.Random(seed)
        self._classes = list(profile.classes.values())
        self._weights = [c.share for c in self._classes]

    def next(self) -> RequestClass:
        return self._rng.choices(self._classes, weights=self._weights, k=1)[0]


def _error_text(exc: ValidationError) -> str:
    lines = []
    for e in exc.errors():
        path = ".".join(str(p) for p in e["loc"]) or "(profile)"
        lines.append(f"{path}: {e['msg']}")
    return "; ".join(lines)


def parse_profile(data: Any, source: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise ProfileError(f"{source}: a profile is a mapping")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{source}: {_error_text(exc)}") from None


def load_profile(name_or_path: str) -> Profile:
    """A profile by file path, or by name from the bundled ``profiles/`` folder (``seed``, ``tiny``)."""
    path = Path(name_or_path)
    if not path.exists():
        bundled = PROFILES_DIR / f"{name_or_path}.yml"
        if not bundled.exists():
            known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yml")))
            raise ProfileError(f"{name_or_path}: no such file and no bundled profile of that name ({known})")
        path = bundled
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return parse_profile(data, str(path))


def override(profile: Profile, **changes: Any) -> Profile:
    """A copy with top-level/arrival fields changed (None values are ignored), validated again."""
    data = profile.model_dump()
    arrival = data["arrival"]
    for key in ("concurrency", "rate"):
        if changes.get(key) is not None:
            arrival["concurrency"] = None
            arrival["rate"] = None
    for key, value in changes.items():
        if value is None:
            continue
        if key in Arrival.model_fields:
            arrival[key] = value
        else:
            data[key] = value
    return parse_profile(data, f"{profile.name} (with command-line overrides)")
