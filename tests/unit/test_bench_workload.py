"""Workload profiles: parsing, validation with field paths, bundled profiles, request bodies, prompts."""

from __future__ import annotations

import pytest

from vllm_fleet.bench.client import build_payload
from vllm_fleet.bench.prompts import PromptBuilder, SharedPrefixes
from vllm_fleet.bench.scenarios import Instance, failures_between
from vllm_fleet.bench.workload import ProfileError, load_profile, override, parse_profile

BASE = {"arrival": {"concurrency": 4}, "classes": {"x": {"share": 1, "input_tokens": 8, "output_tokens": 4}}}


def test_seed_profile_is_the_documented_mix() -> None:
    p = load_profile("seed")
    assert p.shares() == pytest.approx({"heavy": 0.2, "light": 0.7, "api": 0.1})
    h, li, api = p.classes["heavy"], p.classes["light"], p.classes["api"]
    assert (h.input_tokens, h.output_tokens, h.thinking) == (512, 1024, True)
    assert (li.input_tokens, li.output_tokens) == (64, 256)
    assert api.input_tokens == 128 and api.json_output


def test_tiny_profile_fits_the_test_engine() -> None:
    p = load_profile("tiny")
    assert p.max_model_len == 1024
    assert set(p.classes) == {"heavy", "light", "api"}
    for c in p.classes.values():
        assert c.input_tokens + c.output_tokens + 64 < 1024  # + chat template overhead


def test_chooser_follows_shares() -> None:
    p = load_profile("seed")
    ch = p.chooser(seed=3)
    names = [ch.next().name for _ in range(5000)]
    assert names.count("light") / 5000 == pytest.approx(0.7, abs=0.03)
    assert names.count("heavy") / 5000 == pytest.approx(0.2, abs=0.03)


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"arrival": {}}, "arrival"),
        ({"arrival": {"concurrency": 2, "rate": 1.0}}, "arrival"),
        ({"classes": {"x": {"share": 0, "input_tokens": 8, "output_tokens": 4}}}, "classes.x.share"),
        ({"classes": {"x": {"share": 1, "input_tokens": 8}}}, "classes.x.output_tokens"),
        (
            {"classes": {"x": {"share": 1, "input_tokens": 8, "output_tokens": 4, "colour": 1}}},
            "classes.x.colour",
        ),
        ({"duration": -1}, "duration"),
        ({"classes": {}}, "classes"),
    ],
)
def test_bad_profiles_name_the_field(change: dict[str, object], path: str) -> None:
    with pytest.raises(ProfileError, match=path.replace(".", r"\.")):
        parse_profile({**BASE, **change}, "p.yml")


def test_max_model_len_refuses_oversized_class() -> None:
    data = {**BASE, "max_model_len": 10}
    with pytest.raises(ProfileError, match=r"classes\.x.*exceeds max_model_len 10"):
        parse_profile(data)


def test_anthropic_json_output_refused() -> None:
    bad = {"share": 1, "input_tokens": 8, "output_tokens": 4, "api": "anthropic", "json_output": True}
    with pytest.raises(ProfileError, match="json_output"):
        parse_profile({**BASE, "classes": {"x": bad}})


def test_unknown_profile_lists_bundled() -> None:
    with pytest.raises(ProfileError, match="seed"):
        load_profile("no-such-profile")


def test_override_switches_arrival_mode() -> None:
    p = override(load_profile("tiny"), rate=5.0, duration=3.0, max_requests=7)
    assert p.arrival.rate == 5.0 and p.arrival.concurrency is None
    assert (p.duration, p.max_requests) == (3.0, 7)
    assert override(p, concurrency=2).arrival.rate is None


def test_payload_shapes() -> None:
    p = load_profile("seed")
    chat = build_payload(p.classes["heavy"], "m", "hi")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["max_tokens"] == 1024
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"]
    assert chat["chat_template_kwargs"] == {"enable_thinking": True}
    api = build_payload(p.classes["api"], "m", "hi", stream=False)
    assert (
        api["response_format"] == {"type": "json_object"}
        and not api["stream"]
        and "stream_options" not in api
    )
    data = {**BASE, "classes": {"a": {"share": 1, "input_tokens": 8, "output_tokens": 4, "api": "anthropic"}}}
    anth = build_payload(parse_profile(data).classes["a"], "m", "hi")
    assert anth["messages"][0]["content"] == "hi" and "stream_options" not in anth and anth["max_tokens"] == 4
    data = {
        **BASE,
        "classes": {"c": {"share": 1, "input_tokens": 8, "output_tokens": 4, "api": "openai-completions"}},
    }
    comp = build_payload(parse_profile(data).classes["c"], "m", "hi")
    assert comp["prompt"] == "hi" and "messages" not in comp


def test_prompt_builder_word_counts() -> None:
    exact = PromptBuilder(["a", "b"], exact=True, seed=1)
    assert len(exact.build(50).split()) == 50
    assert exact.build(5) != exact.build(5)  # fresh words per request: no shared prefixes
    approx = PromptBuilder(["a"], exact=False)
    assert len(approx.build(130).split()) == 100


def test_instances_and_failure_windows() -> None:
    i = Instance.parse("tiny-0@10.0.0.2")
    assert i.fill("ssh {host} systemctl restart vllm@{name}") == "ssh 10.0.0.2 systemctl restart vllm@tiny-0"
    rep = {"failures": [{"start": 1.0, "stream": True}, {"start": 5.0, "stream": False}]}
    assert failures_between(rep, 0.0, None) == {"total": 2, "streaming": 1, "non_streaming": 1}
    assert failures_between(rep, 2.0, 6.0)["non_streaming"] == 1


def test_shared_prefix_tenants_and_conversations() -> None:
    """Tenants share their system prompt (the same in every run with the seed); conversations grow turn by
    turn and start again after `turns`; the size check counts the prefix and every turn."""
    sp = {"groups": 3, "tokens": 40, "turns": 3}
    data = {
        **BASE,
        "classes": {"t": {"share": 1, "input_tokens": 5, "output_tokens": 4, "shared_prefix": sp}},
    }
    c = parse_profile(data).classes["t"]
    assert c.max_input_tokens == 40 + 3 * 5 + 2 * 4
    words = ["w" + str(i) for i in range(50)]
    a, b = SharedPrefixes(seed=7), SharedPrefixes(seed=7)
    ba, bb = PromptBuilder(words, exact=True, seed=1), PromptBuilder(words, exact=True, seed=2)
    seq_a = [a.messages(ba, c) for _ in range(30)]
    seq_b = [b.messages(bb, c) for _ in range(30)]
    systems = {m[0]["content"] for m in seq_a}
    assert len(systems) == 3 and {m[0]["content"] for m in seq_b} == systems  # same prefixes, any builder
    assert all(len(s.split()) == 40 + 2 for s in systems)  # "Tenant N." + 40 words
    assert {len(m) for m in seq_a} == {2, 4, 6}  # 1, 2, 3 turns, then a new conversation
    for m in seq_a:
        assert [x["role"] for x in m] == ["system"] + ["user", "assistant"] * ((len(m) - 2) // 2) + ["user"]
    chat = build_payload(c, "m", seq_a[0])
    assert chat["messages"] == seq_a[0]
    anth = build_payload(c.model_copy(update={"api": "anthropic"}), "m", seq_a[0])
    assert anth["system"] == seq_a[0][0]["content"] and anth["messages"][0]["role"] == "user"
    with pytest.raises(ProfileError, match="with the shared prefix"):
        parse_profile({**data, "max_model_len": 60})
