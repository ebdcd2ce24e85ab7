"""The gateway's per-key admission core (vllm_fleet.host.admission): budgets with a fake clock, the bounded
wait queue, Retry-After from the refill time, fair sharing of a saturated route, classes."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_fleet.host.admission import Admission, Budget, Request, Settings


def req(rid: str, key: str = "k", route: str = "m", cost: int = 0, **kw: Any) -> Request:
    return Request(rid, key, route, cost, **kw)


def verdicts(adm: Admission, reqs: list[Request], now: float = 0.0) -> list[str]:
    return [adm.submit(r, now).verdict for r in reqs]


def test_in_flight_budget_queues_the_excess_and_a_release_admits_it():
    adm = Admission(Settings(default_key=Budget(max_in_flight=2)))
    assert verdicts(adm, [req("a"), req("b"), req("c")]) == ["admit", "admit", "queue"]
    assert adm.in_flight("k") == 2 and adm.queued("k") == 1
    out = adm.release("a", now=1.5)
    assert [(d.request_id, d.verdict, d.waited) for d in out] == [("c", "admit", 1.5)]
    assert adm.in_flight("k") == 2 and adm.queued("k") == 0


def test_one_key_100_at_once_on_an_idle_fleet_waits_instead_of_429():
    adm = Admission(Settings(default_key=Budget(max_in_flight=64)))
    first = verdicts(adm, [req(str(i)) for i in range(100)])
    assert first.count("admit") == 64 and first.count("queue") == 36 and "refuse" not in first
    admitted = []
    for i in range(36):
        admitted += adm.release(str(i), now=0.1 * (i + 1))
    assert sorted(d.request_id for d in admitted) == sorted(str(i) for i in range(64, 100))
    assert adm.stats["k"].admitted == 100 and not adm.stats["k"].refused


def test_rpm_refusal_carries_the_refill_time_as_retry_after():
    adm = Admission(Settings(queue_wait_seconds=20, default_key=Budget(requests_per_minute=2)))
    assert verdicts(adm, [req("a"), req("b")]) == ["admit", "admit"]
    d = adm.submit(req("c"), now=0.0)
    assert (d.verdict, d.reason, d.retry_after) == ("refuse", "rpm", 60)
    d = adm.submit(req("d"), now=30.0)
    assert (d.verdict, d.reason, d.retry_after) == ("refuse", "rpm", 30)
    # within queue_wait of the refill: it waits, and the window's refill admits it
    assert adm.submit(req("e"), now=45.0).verdict == "queue"
    assert adm.tick(59.0) == []
    out = adm.tick(60.0)
    assert [(x.request_id, x.verdict, x.waited) for x in out] == [("e", "admit", 15.0)]


def test_tokens_reserved_at_admission_and_settled_from_usage():
    adm = Admission(Settings(default_key=Budget(tokens_per_minute=1000)))
    assert adm.submit(req("a", cost=800), 0.0).verdict == "admit"
    assert adm.submit(req("b", cost=300), 0.0).verdict == "refuse"  # 800 + 300 > 1000 until t=60
    assert adm.submit(req("c", cost=300), 45.0).verdict == "queue"
    # the answer used only 200 tokens: the 600 not used return to the window at once
    out = adm.release("a", now=46.0, used_tokens=200)
    assert [x.request_id for x in out] == ["c"]
    assert adm.stats["k"].tokens_reserved == 1100 and adm.stats["k"].tokens_settled == 200


def test_usage_above_the_reservation_is_what_the_key_and_client_windows_hold():
    """The reservation's prompt is an estimate: an answer can use more. The settled amount replaces it in
    every scope the request counted in (key and client), up or down."""
    budget = Budget(tokens_per_minute=1000)
    adm = Admission(Settings(default_key=budget, default_client=budget))
    assert adm.submit(req("a", cost=100, client="c"), 0.0).verdict == "admit"
    adm.release("a", now=1.0, used_tokens=700)
    assert adm.budget_used("k", 1.0)["tpm"] == 0.7
    assert adm.stats["k"].tokens_reserved == 100 and adm.stats["k"].tokens_settled == 700
    # 700 + 400 > 1000 for the key and for the client, until the 700 age out at t=60
    assert adm.submit(req("b", cost=400, client="c"), 2.0).verdict == "refuse"
    assert adm.retry_after(req("b", cost=400, client="c"), 2.0) == 58
    # another key of the client: its own minute is empty, the client's is not
    assert adm.submit(req("b", cost=400, key="k2", client="c"), 2.0).verdict == "refuse"


def test_release_without_usage_keeps_the_reservation():
    adm = Admission(Settings(default_key=Budget(tokens_per_minute=1000)))
    adm.submit(req("a", cost=800), 0.0)
    adm.submit(req("c", cost=300), 45.0)
    assert adm.release("a", now=46.0) == []
    assert [x.request_id for x in adm.tick(60.0)] == ["c"]


def test_a_request_larger_than_the_budget_is_refused_without_a_retry_after():
    adm = Admission(Settings(default_key=Budget(tokens_per_minute=1000)))
    d = adm.submit(req("a", cost=1001), 0.0)
    assert (d.verdict, d.reason, d.retry_after) == ("refuse", "too_large", None)


def test_the_queue_is_bounded_per_key_and_waits_until_its_deadline():
    adm = Admission(Settings(queue_wait_seconds=5, max_queued_per_key=2, default_key=Budget(max_in_flight=1)))
    assert verdicts(adm, [req("a"), req("b"), req("c"), req("d")]) == ["admit", "queue", "queue", "refuse"]
    assert adm.stats["k"].refused == {"queue_full": 1}
    assert adm.tick(4.9) == []
    out = adm.tick(5.0)
    assert [(x.request_id, x.verdict, x.reason, x.retry_after, x.waited) for x in out] == [
        ("b", "refuse", "wait_timeout", 1, 5.0),
        ("c", "refuse", "wait_timeout", 1, 5.0),
    ]
    assert adm.queued("k") == 0


def test_a_saturated_route_goes_to_the_key_below_its_share_first():
    adm = Admission(Settings(capacity={"m": 8}, default_key=Budget(max_in_flight=0), max_queued_per_key=500))
    greedy = verdicts(adm, [req(f"g{i}", key="greedy") for i in range(200)])
    assert greedy.count("admit") == 8
    assert verdicts(adm, [req(f"p{i}", key="polite") for i in range(4)], now=1.0) == ["queue"] * 4
    # each freed slot goes to the polite key (in flight 0..3, below the greedy key's 7) although the greedy key's
    # 192 requests have waited longer
    admitted = [d.request_id for i in range(4) for d in adm.release(f"g{i}", now=2.0 + i)]
    assert admitted == ["p0", "p1", "p2", "p3"]
    assert adm.in_flight("polite") == 4 and adm.in_flight("greedy") == 4
    # the polite key has nothing waiting: the next slot is the greedy key's
    assert [d.request_id for d in adm.release("p0", now=7.0)] == ["g8"]


def test_weights_divide_a_saturated_route():
    adm = Admission(
        Settings(
            capacity={"m": 4},
            keys={"big": Budget(weight=3), "small": Budget(weight=1)},
            max_queued_per_key=50,
        )
    )
    verdicts(adm, [req(f"x{i}", key="filler") for i in range(4)])
    verdicts(
        adm, [req(f"b{i}", key="big") for i in range(10)] + [req(f"s{i}", key="small") for i in range(10)]
    )
    order = [d.request_id[0] for i in range(4) for d in adm.release(f"x{i}", now=1.0 + i)]
    # in flight / weight: big 0 = small 0 → the earlier arrival (big); small 0 < big 1/3; big 1/3 < small 1;
    # big 2/3 < small 1
    assert order == ["b", "s", "b", "b"]


def test_classes_order_a_keys_waiting_requests_and_break_share_ties():
    adm = Admission(Settings(default_key=Budget(max_in_flight=1)))
    adm.submit(req("running"), 0.0)
    adm.submit(req("batch", priority=10), 0.1)
    adm.submit(req("chat", priority=0), 0.2)
    assert [d.request_id for d in adm.release("running", 1.0)] == ["chat"]

    adm = Admission(Settings(capacity={"m": 1}))
    adm.submit(req("running", key="a"), 0.0)
    adm.submit(req("batch", key="b", priority=10), 0.1)
    adm.submit(req("chat", key="c", priority=0), 0.2)
    assert [d.request_id for d in adm.release("running", 1.0)] == ["chat"]


def test_a_client_budget_binds_its_keys_together():
    adm = Admission(Settings(clients={"team": Budget(max_in_flight=3)}))
    got = verdicts(adm, [req("a1", key="a", client="team"), req("a2", key="a", client="team")])
    got += verdicts(adm, [req("b1", key="b", client="team"), req("b2", key="b", client="team")])
    assert got == ["admit", "admit", "admit", "queue"]
    assert [d.request_id for d in adm.release("a1", 1.0)] == ["b2"]


def test_submit_is_idempotent_by_request_id():
    adm = Admission(Settings(default_key=Budget(max_in_flight=1)))
    assert adm.submit(req("a"), 0.0).verdict == "admit"
    assert adm.submit(req("a"), 0.5).verdict == "admit"  # the spill-over's internal redirect asks again
    assert adm.in_flight("k") == 1 and adm.stats["k"].admitted == 1
    assert adm.submit(req("b"), 0.5).verdict == "queue"
    assert adm.submit(req("b"), 0.6).verdict == "queue"
    assert adm.queued("k") == 1


def test_a_lost_release_frees_the_slot_when_the_lease_expires():
    adm = Admission(Settings(lease_seconds=100, default_key=Budget(max_in_flight=1), queue_wait_seconds=200))
    adm.submit(req("a"), 0.0)
    adm.submit(req("b"), 1.0)
    assert adm.tick(99.0) == []
    assert [d.request_id for d in adm.tick(100.0)] == ["b"]
    assert adm.leases_expired == 1
    assert adm.release("a", 101.0) == []  # a late release of an expired lease changes nothing


@pytest.mark.parametrize("bad", [{"max_in_flight": -1}, {"tokens_per_minute": -5}, {"weight": 0}])
def test_budget_validation(bad: dict[str, Any]):
    with pytest.raises(ValueError):
        Budget(**bad)


def test_a_clients_per_key_budget_applies_to_each_of_its_keys_unless_the_key_has_its_own():
    adm = Admission(
        Settings(
            default_key=Budget(max_in_flight=5),
            per_key={"chat": Budget(max_in_flight=1)},
            keys={"chat/00000002": Budget(max_in_flight=2)},
        )
    )
    assert adm.budget_of("chat/00000001") == Budget(max_in_flight=1)
    assert adm.budget_of("chat/00000002") == Budget(max_in_flight=2)
    assert adm.budget_of("batch/00000001") == Budget(max_in_flight=5)
    assert adm.budget_of("chat") == Budget(max_in_flight=5)  # no '/': no client
    # each key of the client has the budget alone: two keys, one request each
    got = verdicts(adm, [req("a1", key="chat/00000001"), req("a2", key="chat/00000001")])
    got += verdicts(adm, [req("b1", key="chat/00000003"), req("b2", key="chat/00000003")])
    got += verdicts(adm, [req("c1", key="chat/00000002"), req("c2", key="chat/00000002")])
    assert got == ["admit", "queue", "admit", "queue", "admit", "admit"]


def test_a_withdrawn_request_leaves_the_queue_and_lets_the_next_one_in():
    adm = Admission(Settings(capacity={"m": 1}, default_key=Budget(max_in_flight=0)))
    assert verdicts(adm, [req("a", key="x"), req("b", key="y"), req("c", key="z")]) == [
        "admit",
        "queue",
        "queue",
    ]
    assert adm.withdraw("b", 1.0) == []  # the route is still full
    assert adm.is_waiting("b") is False and adm.queued("y") == 0
    assert adm.stats["y"].withdrawn == 1 and adm.stats["y"].refused == {} and adm.stats["y"].queued == 0
    assert adm.withdraw("b", 1.0) == [] and adm.withdraw("nobody", 1.0) == []
    assert [d.request_id for d in adm.release("a", 2.0)] == ["c"]
    assert adm.tick(100.0) == []  # the withdrawn request is not refused at its deadline


def test_withdrawing_the_head_of_a_key_queue_admits_a_cheaper_request_behind_it():
    adm = Admission(Settings(default_key=Budget(tokens_per_minute=1000), queue_wait_seconds=60))
    assert adm.submit(req("a", cost=600), 0.0).verdict == "admit"
    assert adm.submit(req("big", cost=500), 1.0).verdict == "queue"
    assert (
        adm.submit(req("small", cost=300), 2.0).verdict == "queue"
    )  # behind "big" (same key, arrival order)
    assert [(d.request_id, d.verdict, d.waited) for d in adm.withdraw("big", 3.0)] == [
        ("small", "admit", 1.0)
    ]


def test_a_repeated_request_id_is_marked_again_and_counted_once():
    adm = Admission(Settings(default_key=Budget(max_in_flight=1)))
    first = adm.submit(req("a", cost=5), 0.0)
    assert (first.verdict, first.again) == ("admit", False)
    assert adm.submit(req("a", cost=5), 0.1).again is True
    first = adm.submit(req("b"), 0.2)
    assert (first.verdict, first.reason, first.again) == ("queue", "in_flight", False)
    again = adm.submit(req("b"), 0.4)
    assert (again.verdict, again.reason, again.again) == ("queue", "in_flight", True)
    assert adm.stats["k"].admitted == 1 and adm.stats["k"].tokens_reserved == 5 and adm.queued("k") == 1


def test_accessors_for_the_metrics():
    adm = Admission(
        Settings(
            capacity={"m": 10},
            default_key=Budget(max_in_flight=4, requests_per_minute=10, tokens_per_minute=1000),
            keys={"free": Budget()},
        )
    )
    adm.submit(req("a", cost=300), 0.0)
    adm.submit(req("b", cost=200, route="n"), 1.0)
    assert adm.route_in_flight() == {"m": 1, "n": 1}
    assert adm.reservation("a") == 300 and adm.reservation("zz") is None
    assert adm.key_of("a") == "k" and adm.key_of("zz") == ""
    assert adm.budget_used("k", 1.0) == {"in_flight": 0.5, "rpm": 0.2, "tpm": 0.5}
    assert adm.budget_used("free", 1.0) == {}  # nothing set, nothing to report
    adm.release("a", 2.0, used_tokens=100)
    assert adm.budget_used("k", 2.0) == {"in_flight": 0.25, "rpm": 0.2, "tpm": 0.3}
    assert adm.route_in_flight() == {"m": 0, "n": 1}
    # the minute passed: the windows are empty again
    assert adm.budget_used("k", 61.0) == {"in_flight": 0.25, "rpm": 0.0, "tpm": 0.0}


def test_settling_a_reservation_that_already_left_its_window_changes_nothing():
    adm = Admission(Settings(default_key=Budget(tokens_per_minute=1000), lease_seconds=1000))
    adm.submit(req("old", cost=800), 0.0)
    assert adm.budget_used("k", 61.0)["tpm"] == 0.0  # aged out while running
    adm.submit(req("new", cost=400), 61.0)
    adm.release("old", 62.0, used_tokens=50)  # would subtract 750 from the window if it still held it
    assert adm.budget_used("k", 62.0)["tpm"] == 0.4
    assert adm.stats["k"].tokens_settled == 50


def test_tick_expires_leases_and_deadlines_in_time_order():
    adm = Admission(Settings(lease_seconds=10, queue_wait_seconds=5, default_key=Budget(max_in_flight=2)))
    adm.submit(req("a"), 0.0)
    adm.submit(req("b"), 3.0)
    adm.submit(req("w1"), 3.5)
    adm.submit(req("w2"), 4.0)
    out = adm.tick(8.6)  # w1's deadline (8.5) passed, w2's (9.0) not
    assert [(d.request_id, d.reason) for d in out] == [("w1", "wait_timeout")]
    # at 10: a's lease (until 10) expires, b's (until 13) not; w2 passed its deadline (9) first
    out = adm.tick(10.0)
    assert adm.leases_expired == 1
    assert [(d.request_id, d.verdict, d.reason) for d in out] == [("w2", "refuse", "wait_timeout")]
    assert adm.in_flight("k") == 1
    adm.tick(13.0)
    assert adm.leases_expired == 2 and adm.in_flight("k") == 0


def test_no_waiting_at_all_when_queue_wait_seconds_is_0():
    adm = Admission(Settings(queue_wait_seconds=0, capacity={"m": 1}, default_key=Budget(max_in_flight=1)))
    assert adm.submit(req("a"), 0.0).verdict == "admit"
    d = adm.submit(req("b"), 0.0)
    assert (d.verdict, d.reason, d.retry_after) == ("refuse", "in_flight", 1)
    d = adm.submit(req("c", key="other"), 0.0)  # its key has room, the route has not
    assert (d.verdict, d.reason, d.retry_after) == ("refuse", "capacity", 1)
    assert adm.queued("k") == 0 and adm.queued("other") == 0


def test_refusal_reasons_are_every_reason() -> None:
    import typing

    from vllm_fleet.host.admission import REFUSAL_REASONS, Reason

    assert set(REFUSAL_REASONS) == set(typing.get_args(Reason)) - {""}
