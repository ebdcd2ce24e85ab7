"""Prompts of exactly N tokens, built from words.

Each request gets a fresh random sequence of words (no two prompts share a prefix, so prefix caching does not
flatter the figures). Words are first checked with the target's ``/tokenize``: only words that are one token
with a leading space are kept, so N words make N tokens. Without ``/tokenize`` the prompt is approximated
(``APPROX_TOKENS_PER_WORD``) and reports rely on the prompt tokens the server counts in ``usage``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
