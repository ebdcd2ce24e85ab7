"""Prompts of exactly N tokens, built from words.

Each request gets a fresh random sequence of words (no two prompts share a prefix, so prefix caching does not
flatter the figures). Words are first checked with the target's ``/tokenize``: only words that are one token
with a leading space are kept, so N words make N tokens. Without ``/tokenize`` the prompt is approximated
(``APPROX_TOKENS_PER_WORD``) and reports rely on the prompt tokens the server counts in ``usage``.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp

APPROX_TOKENS_PER_WORD = 1.3

_TEXT = (
    "the of and to in is that for it as with be on not this by are or from at an but which all can if you"
    " will"
    " any other such may no one use has have more time work new only also these its into than been some when"
    " was there so we out up what about would their them then they do how each make like him her two way"
    " first could over most see now find long down day did get come made part number name data file line"
    " list value return self none true false class def import print error set key type object string test"
    " case result path read write open close call code text user run start end state size item node base"
    " copy license software terms under free source form right notice without permission provided granted"
    " including limited warranty distribution public version program general modify conditions following"
)
WORDS = tuple(_TEXT.split())


@dataclass
class PromptBuilder:
    """Makes prompts of a given token length from single-token words."""

    words: list[str]
    exact: bool
    seed: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def build(self, n_tokens: int) -> str:
        n_words = n_tokens if self.exact else max(1, round(n_tokens / APPROX_TOKENS_PER_WORD))
        return " " + " ".join(self._rng.choice(self.words) for _ in range(n_words))


async def count_tokens(session: aiohttp.ClientSession, tokenize_url: str, model: str, text: str) -> int:
    async with session.post(
        tokenize_url, json={"model": model, "prompt": text, "add_special_tokens": False}
    ) as r:
        r.raise_for_status()
        data = await r.json()
    return int(data["count"])


async def make_builder(
    session: aiohttp.ClientSession, tokenize_url: str | None, model: str, seed: int = 0
) -> PromptBuilder:
    """Keep the words that are exactly one token after a space; check a 64-word sample adds up exactly."""
    if not tokenize_url:
        return PromptBuilder(list(WORDS), exact=False, seed=seed)
    try:
        single = []
        for w in dict.fromkeys(WORDS):
            if await count_tokens(session, tokenize_url, model, " " + w) == 1:
                single.append(w)
        if len(single) < 20:
            return PromptBuilder(list(WORDS), exact=False, seed=seed)
        builder = PromptBuilder(single, exact=True, seed=seed)
        probe = PromptBuilder(single, exact=True, seed=seed + 1).build(64)
        if await count_tokens(session, tokenize_url, model, probe) != 64:
            return PromptBuilder(single, exact=False, seed=seed)
        return builder
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return PromptBuilder(list(WORDS), exact=False, seed=seed)


Messages = list[dict[str, str]]


@dataclass
class SharedPrefixes:
    """The prompts of shared-prefix classes (``RequestClass.shared_prefix``): per class and tenant a system
    prompt that depends only on the seed, the class name and the tenant (so every run and both endpoints of
    a compare run send the same prefixes), and per tenant the conversation so far."""

    seed: int = 0
    _systems: dict[tuple[str, int], str] = field(default_factory=dict)
    _history: dict[tuple[str, int], Messages] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._rng = random.Random(zlib.crc32(f"{self.seed}:tenants".encode()))

    def system(self, builder: PromptBuilder, cls: str, group: int, tokens: int) -> str:
        key = (cls, group)
        if key not in self._systems:
            b = PromptBuilder(
                builder.words, builder.exact, seed=zlib.crc32(f"{self.seed}:{cls}:{group}".encode())
            )
            self._systems[key] = f"Tenant {group}." + b.build(tokens)
        return self._systems[key]

    def messages(self, builder: PromptBuilder, c: Any) -> Messages:
        """The next request of class ``c``: a random tenant's system prompt, its conversation so far (turns >
        1), a new question of ``c.input_tokens`` tokens."""
        sp = c.shared_prefix
        g = self._rng.randrange(sp.groups)
        history = self._history.setdefault((c.name, g), [])
        if len(history) >= 2 * (sp.turns - 1) + 1:  # the conversation had its turns: a new one
            history.clear()
        if history:  # the answer to the previous question (any text: the prompt is what the cache holds)
            history.append({"role": "assistant", "content": builder.build(c.output_tokens)})
        history.append({"role": "user", "content": builder.build(c.input_tokens)})
        return [{"role": "system", "content": self.system(builder, c.name, g, sp.tokens)}, *history]
