"""GPU metrics through NVML (nvidia-ml-py): utilisation, memory, temperature, power, ECC, and the XID critical
errors a thread collects from NVML's events. Nothing on hosts without a driver or GPU."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_fleet.host.exporter.common import PREFIX, log


class Nvml(Collector):
    """GPU metrics through nvidia-ml-py. ``available`` is False on hosts without a driver or GPU."""

    def __init__(self) -> None:
        self.available = False
        self.xids: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.count = int(pynvml.nvmlDeviceGetCount())
            self.driver = _s(pynvml.nvmlSystemGetDriverVersion())
            self.available = self.count > 0
        except Exception as exc:  # no library, no driver, no GPU: all mean "no GPU metrics"
            log.info("NVML not available: %s", exc)
            return
        threading.Thread(target=self._xid_events, name="nvml-xid", daemon=True).start()

    def _xid_events(self) -> None:
        nv = self.nv
        try:
            es = nv.nvmlEventSetCreate()
            handles = {}
            for i in range(self.count):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, es)
                    handles[i] = nv.nvmlDeviceGetUUID(h)
                except nv.NVMLError as exc:
                    log.info("XID events not supported on GPU %d: %s", i, exc)
            if not handles:
                return
            uuid_to_index = {_s(u): i for i, u in handles.items()}
            while True:
                try:
                    data = nv.nvmlEventSetWait_v2(es, 5000)
                except nv.NVMLError_Timeout:
                    continue
                idx = uuid_to_index.get(_s(nv.nvmlDeviceGetUUID(data.device)), -1)
                with self._lock:
                    key = (idx, int(data.eventData))
                    self.xids[key] = self.xids.get(key, 0) + 1
        except Exception as exc:  # the thread must not die silently
            log.warning("XID event thread stopped: %s", exc)

    def metrics(self) -> Iterator[Metric]:
        nv = self.nv
        labels = ["gpu", "uuid"]
        info = GaugeMetricFamily(
            PREFIX + "gpu_info", "GPU model and driver", labels=[*labels, "name", "driver"]
        )
        util = GaugeMetricFamily(
            PREFIX + "gpu_utilization_ratio", "GPU busy time ratio (NVML)", labels=labels
        )
        mem_util = GaugeMetricFamily(
            PREFIX + "gpu_memory_bandwidth_utilization_ratio", "GPU memory busy ratio (NVML)", labels=labels
        )
        used = GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory used", labels=labels)
        total = GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory total", labels=labels)
        temp = GaugeMetricFamily(PREFIX + "gpu_temperature_celsius", "GPU temperature", labels=labels)
        power = GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw", labels=labels)
        limit = GaugeMetricFamily(PREFIX + "gpu_power_limit_watts", "GPU enforced power limit", labels=labels)
        ecc = CounterMetricFamily(
            PREFIX + "gpu_ecc_errors",
            "ECC errors since the driver loaded (volatile)",
            labels=[*labels, "type"],
        )
        xid = CounterMetricFamily(
            PREFIX + "gpu_xid_errors", "XID critical errors seen", labels=[*labels, "xid"]
        )
        uuids: dict[int, str] = {}
        for i in range(self.count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                uuid = _s(nv.nvmlDeviceGetUUID(h))
            except nv.NVMLError:
                continue
            uuids[i] = uuid
            lv = [str(i), uuid]
            info.add_metric([*lv, _s(nv.nvmlDeviceGetName(h)), self.driver], 1)
            rates = _q(nv.nvmlDeviceGetUtilizationRates, h)
            if rates is not None:
                util.add_metric(lv, rates.gpu / 100.0)
                mem_util.add_metric(lv, rates.memory / 100.0)
            # v2 excludes driver-reserved memory, like nvidia-smi (v1 "used" counts it: ~0.6 GiB more on an H200)
            mem = (
                _q(nv.nvmlDeviceGetMemoryInfo, h, nv.nvmlMemory_v2) if hasattr(nv, "nvmlMemory_v2") else None
            )
            mem = mem or _q(nv.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                used.add_metric(lv, float(mem.used))
                total.add_metric(lv, float(mem.total))
            for fam, value, scale in (
                (temp, _q(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU), 1.0),
                (power, _q(nv.nvmlDeviceGetPowerUsage, h), 1000.0),
                (limit, _q(nv.nvmlDeviceGetEnforcedPowerLimit, h), 1000.0),
            ):
                if value is not None:
                    fam.add_metric(lv, float(value) / scale)
            for kind, etype in (
                ("corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                ("uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            ):
                n = _q(nv.nvmlDeviceGetTotalEccErrors, h, etype, nv.NVML_VOLATILE_ECC)
                if n is not None:
                    ecc.add_metric([*lv, kind], float(n))
        with self._lock:
            for (idx, code), n in sorted(self.xids.items()):
                xid.add_metric([str(idx), uuids.get(idx, ""), str(code)], n)
        yield from (info, util, mem_util, used, total, temp, power, limit, ecc, xid)

    def collect(self) -> Iterator[Metric]:
        if self.available:
            yield from self.metrics()


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _q(fn: Any, *args: Any) -> Any:
    """One NVML query; None when the GPU does not support it (NotSupported, NoPermission ...)."""
    try:
        return fn(*args)
    except Exception as exc:  # any NVMLError subclass
        log.debug("NVML query %s skipped: %s", getattr(fn, "__name__", fn), exc)
        return None
