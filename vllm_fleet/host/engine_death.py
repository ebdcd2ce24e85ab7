"""Why an engine died, from what vLLM printed: which process, by which signal, and what to do.

vLLM's API server does not die with its worker: when a worker process is killed (SIGILL from an instruction
the CPU lacks, SIGKILL from the OOM killer, SIGSEGV in a kernel), the engine core logs
``Worker proc VllmWorker-0 died unexpectedly (exit code: -4)`` and the API server shuts down with exit status
0. The launcher and ``doctor`` read those lines (and the ``Fatal Python error: ...`` header that Python's
fault handler prints in the dying process) so the journal, ``STATUS=`` and the state file name the process
and the signal instead of "exited with 0".
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

# vllm/v1/executor/multiproc_executor.py (0.2x–0.3x): logger.error("Worker proc %s died unexpectedly (exit code: %s), ...")
_WORKER_DIED_RE = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+|None)\)")
# Python's faulthandler (PYTHONFAULTHANDLER=1) in the process that received the signal
_FAULT_RE = re.compile(
    r"Fatal Python error: (Illegal instruction|Segmentation fault|Bus error|Floating-point exception|Aborted)"
)
_FAULT_SIGNALS = {
    "Illegal instruction": signal.SIGILL,
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
    "Aborted": signal.SIGABRT,
}

_MEANING = {
    signal.SIGILL: (
        "illegal instruction: this CPU lacks an instruction the engine's kernels use; "
        "run `vllm-fleet doctor --profile cpu --load MODEL` (cpu-isa layer), or try --dtype float32"
    ),
    signal.SIGKILL: "killed (SIGKILL): usually the kernel's OOM killer (see `journalctl -k | grep -i oom`)",
    signal.SIGSEGV: "segmentation fault in native code (a kernel or driver bug, or a broken install)",
    signal.SIGBUS: "bus error (memory mapping failed: /dev/shm full, or a truncated model file)",
    signal.SIGFPE: "arithmetic fault in native code",
    signal.SIGABRT: "aborted by native code (see the lines before it)",
}

# a process killed by these will die the same way again: restarting cannot help (no restart storm)
CONFIG_ERROR_SIGNALS = frozenset({signal.SIGILL})


@dataclass
class Death:
    """One engine process that died on its own."""

    process: str  # e.g. "engine worker VllmWorker-0"
    exit_code: int | None = None  # negative: killed by that signal (multiprocessing's convention)
    fault: signal.Signals | None = None  # from a "Fatal Python error: ..." header

    @property
    def signal(self) -> signal.Signals | None:
        if self.exit_code is not None and self.exit_code < 0:
            try:
                return signal.Signals(-self.exit_code)
            except ValueError:
                return None
        return self.fault

    @property
    def is_config_error(self) -> bool:
        return self.signal in CONFIG_ERROR_SIGNALS

    def describe(self) -> str:
        sig = self.signal
        if sig is not None:
            return f"{self.process} killed by {sig.name} ({_MEANING.get(sig, signal.strsignal(sig) or sig.name)})"
        if self.exit_code is None:
            # vLLM's monitor saw the worker's pipe close before the kernel had its exit status. SIGILL,
            # SIGSEGV, SIGBUS and SIGFPE would have printed a fault header (PYTHONFAULTHANDLER): not those.
            return (
                f"{self.process} died without a fault report (vLLM did not get its exit status): most likely "
                f"{_MEANING[signal.SIGKILL]}"
            )
        return f"{self.process} exited with status {self.exit_code}"


class DeathWatch:
    """Fed the engine's log lines one by one; keeps the first death it sees."""

    def __init__(self) -> None:
        self.death: Death | None = None
        self._fault: signal.Signals | None = None

    def feed(self, line: str) -> Death | None:
        """The death this line announces (worker exit lines only), else None."""
        if m := _FAULT_RE.search(line):
            self._fault = _FAULT_SIGNALS[m.group(1)]
            if self.death is not None and self.death.signal is None:
                self.death.fault = self._fault
            return None
        if (m := _WORKER_DIED_RE.search(line)) and self.death is None:
            code = None if m.group(2) == "None" else int(m.group(2))
            self.death = Death(f"engine worker {m.group(1)}", code, self._fault)
            return self.death
        return None

    def cause(self) -> Death | None:
        if self.death is not None:
            return self.death
        if self._fault is not None:
            return Death("an engine process", None, self._fault)
        return None


def cause_in(text: str) -> Death | None:
    """The first engine process death described in a whole log text."""
    watch = DeathWatch()
    for line in text.splitlines():
        watch.feed(line)
    return watch.cause()
