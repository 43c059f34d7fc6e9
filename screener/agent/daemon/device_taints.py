"""Per-GPU out of service where the cluster uses DRA: which GPU the daemon taints, and when.

Where GPUs are allocated through Dynamic Resource Allocation, one bad GPU need not take its node's
other GPUs out of service: a DeviceTaintRule with effect NoSchedule keeps new claims off exactly
that device (screener.stores.kube.devices makes and removes them). This module is the daemon's
rule for it, behind the [dra] setting (screener.settings.dra; off by default):

- A GPU found bad gets its rule, once: a known-answer screen's suspect verdict for device cuda:N
  (N mapped to the GPU the probes report, see `cuda_gpus`), or a settled in-job alarm that names
  the GPU by serial (evidence gpu_serial/gpu_serials, kept only when this node's NVML reports the
  serial). The in-job audits' alarms name ranks and nodes, not devices: they carry no serial
  today, so only a writer that adds one (the alarm format has the keys) can taint a device. An
  unsettled alarm names candidates, not a culprit, and taints nothing.
- It is removed only by a passing known-answer retest of that device (a verdict `pass` for it in
  a screen that ran to its end); clean telemetry, a node turning healthy, or time do not.
- The node's own state is the lifecycle's, decided before and unchanged by any of this: the
  device taint is in addition to the node's state taint, never instead of it.

Nothing happens with the local store (no cluster: logged once) or on a node whose driver publishes
no ResourceSlice (no DRA: logged once). In observe mode no rule is made (said in the pass
report); a retest that passes still removes one an enforcing run left, as the store removes its
state taint. A write that fails because the API is out of reach is retried on the next passes;
one refused (RBAC, the admission policy) is logged and not repeated.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Sequence

from screener.agent.daemon.passreport import PassReport
from screener.alarmfile import CHECKS, AlarmRecord
from screener.errors import ScreenerError
from screener.health.verdict.snapshot import GpuSnapshot
from screener.lifecycle import machine
from screener.settings.dra import DraConfig
from screener.types import Outcome, Reason, Verdict

log = logging.getLogger("screener.daemon")

CUDA_PREFIX = "cuda:"


class DeviceTaintApi(Protocol):
    """What the rule needs of the API (screener.stores.kube.devices.KubeDeviceTaints)."""

    def devices(self, node: str) -> list[Any]: ...

    def create(self, body: dict[str, Any], device: Any) -> bool: ...

    def rules(self, node: str) -> list[dict[str, Any]]: ...

    def delete(self, rule: Mapping[str, Any]) -> bool: ...

    def body(self, node: str, device: Any, *, reason: str, gpu_uuid: str, gpu_serial: str,
             evidence: str) -> dict[str, Any]: ...

    def gpu_of(self, rule: Mapping[str, Any]) -> str: ...

    def transient(self, error: BaseException) -> bool: ...


@dataclass(frozen=True)
class BadGpu:
    """A GPU to take out of service, and why (the taint's value and the rule's evidence)."""

    uuid: str
    serial: str
    reason: str
    evidence: str


def cuda_gpus(gpus: Sequence[GpuSnapshot],
              environ: Mapping[str, str]) -> tuple[dict[int, GpuSnapshot], str]:
    """The probed GPU each cuda:N of the screen worker is, and "" ; or {} and why it cannot be
    told.

    The worker sees every GPU (no CUDA_VISIBLE_DEVICES), and CUDA numbers them fastest first,
    ties broken by PCI bus id, while NVML numbers them by PCI bus id: the two agree when every GPU
    is the same model, or when CUDA_DEVICE_ORDER=PCI_BUS_ID. Otherwise cuda:N may be another GPU
    than NVML's index N, and tainting it would take a good GPU out and leave the bad one in."""
    if environ.get("CUDA_VISIBLE_DEVICES") not in (None, "", "all"):
        return {}, ("CUDA_VISIBLE_DEVICES is set in the daemon, so cuda:N is not NVML's GPU N")
    models = {g.name for g in gpus}
    if len(models) > 1 and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return {}, (f"the node's GPUs are of {len(models)} models, so CUDA's fastest-first order "
                    "may differ from NVML's: set CUDA_DEVICE_ORDER=PCI_BUS_ID in the DaemonSet")
    return {g.index: g for g in gpus if g.uuid}, ""


class DeviceTaints:
    """The daemon's per-GPU taints (see the module docstring). `api` is None without a cluster."""

    def __init__(self, config: DraConfig, node: str, api: Optional[DeviceTaintApi], *,
                 observe: bool = False, environ: Optional[Mapping[str, str]] = None) -> None:
        self.config, self.node, self.api, self.observe = config, node, api, observe
        self.environ = os.environ if environ is None else environ
        self.on = config.enabled and api is not None
        self._said: set[str] = set()
        # Writes that failed (the API out of reach), retried on the next passes: by GPU uuid.
        self.to_taint: dict[str, BadGpu] = {}
        self.to_clear: set[str] = set()
        if config.enabled and api is None:
            self._once("local", "[dra] is enabled but the store is not the Kubernetes one: no "
                       "device is tainted (a DeviceTaintRule needs a cluster)")

    @property
    def pending(self) -> bool:
        return bool(self.to_taint or self.to_clear)

    def _once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(message, *args, extra={"event": "device_taint"})

    # --- what found a GPU bad, or passed it ---------------------------------------------------

    def after_screen(self, verdicts: Iterable[Verdict], gpus: Sequence[GpuSnapshot],
                     report: PassReport) -> None:
        """A screen that ran to its end: its suspect devices tainted, its passing ones cleared."""
        if self.on:
            self._guarded("screen", lambda: self._after_screen(verdicts, gpus, report), report)

    def after_alarm(self, record: AlarmRecord, gpus: Sequence[GpuSnapshot],
                    report: PassReport) -> None:
        """A settled alarm naming GPUs of this node by serial (only those this node's NVML
        reports are still in its evidence: Daemon._apply_alarm) taints them."""
        if self.on and record.settled:
            self._guarded("alarm", lambda: self._after_alarm(record, gpus, report), report)

    def _guarded(self, where: str, fn: Callable[[], None], report: PassReport) -> None:
        # Called after the node's transition is recorded: a bug here must not undo what is
        # durable (the alarm file taken in, the screen's verdict annotation written after it).
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - counted in the pass report, never fatal
            log.exception("device taints after the %s failed", where)
            report.errors.append(f"device taints: {type(e).__name__}: {e}")

    def _after_screen(self, verdicts: Iterable[Verdict], gpus: Sequence[GpuSnapshot],
                      report: PassReport) -> None:
        named = [v for v in verdicts if v.device.startswith(CUDA_PREFIX)
                 and v.outcome in (Outcome.SUSPECT, Outcome.PASS)]
        if not named:
            return
        by_index, why = cuda_gpus(gpus, self.environ)
        if why:
            self._once("order", "device taints: cannot tell which GPU a verdict's cuda:N is: %s",
                       why)
            return
        for v in named:
            try:
                gpu = by_index.get(int(v.device[len(CUDA_PREFIX):]))
            except ValueError:
                gpu = None
            if gpu is None or not gpu.uuid:
                self._once(f"gpu:{v.device}", "device taints: no probed GPU is %s", v.device)
                continue
            platform = v.evidence.get("platform")
            if isinstance(platform, str) and gpu.name and platform != gpu.name:
                # The worker's cuda:N is a model other than NVML's GPU N: not this GPU.
                self._once(f"model:{v.device}", "device taints: %s is a %s, NVML's GPU %d a %s: "
                           "not tainting a GPU that may be another", v.device, platform,
                           gpu.index, gpu.name)
                continue
            if v.outcome == Outcome.SUSPECT:
                self.to_clear.discard(gpu.uuid)
                self.to_taint[gpu.uuid] = BadGpu(
                    uuid=gpu.uuid, serial=gpu.serial or "", reason=str(Reason.KNOWN_ANSWER_MISMATCH),
                    evidence=f"known-answer screen: {v.device} {v.reason or 'suspect'}"
                             f"{f' in {v.job}' if v.job else ''}")
            else:  # passed: a taint not yet written is moot, one written goes
                self.to_taint.pop(gpu.uuid, None)
                self.to_clear.add(gpu.uuid)
        self.retry(report)

    def _after_alarm(self, record: AlarmRecord, gpus: Sequence[GpuSnapshot],
                     report: PassReport) -> None:
        many = record.evidence.get(machine.EVIDENCE_GPU_SERIALS)
        serials = [str(s) for s in many if s] if isinstance(many, (list, tuple)) else []
        by_serial = {g.serial: g for g in gpus if g.serial and g.uuid}
        for s in serials:
            gpu = by_serial.get(s)
            if gpu is None or gpu.uuid is None:
                continue
            reason = CHECKS.get(record.check, Reason.HARDWARE_ERROR_IN_JOB)
            self.to_clear.discard(gpu.uuid)
            self.to_taint[gpu.uuid] = BadGpu(uuid=gpu.uuid, serial=s, reason=str(reason),
                                             evidence=f"alarm {record.alarm_id}: {record.check}")
        if self.to_taint:
            self.retry(report)

    # --- the writes ---------------------------------------------------------------------------

    def retry(self, report: PassReport) -> None:
        """Make the rules still to make and remove those still to remove; what fails waits for
        the next pass."""
        if not self.on or not self.pending:
            return
        if self.to_taint:
            self._taint(report)
        if self.to_clear:
            self._clear(report)

    def _taint(self, report: PassReport) -> None:
        assert self.api is not None
        if self.observe:
            for bad in self.to_taint.values():
                report.actions.append({"action": "device_taint", "gpu": bad.uuid,
                                       "result": "not created: observe mode"})
            self.to_taint.clear()
            return
        try:
            devices = self.api.devices(self.node)
        except ScreenerError as e:
            if self.api.transient(e):
                log.warning("device taints: cannot list the ResourceSlices of %s yet: %s",
                            self.node, e)
                return
            log.error("device taints: cannot list the ResourceSlices of %s: %s", self.node, e)
            self.to_taint.clear()
            return
        if not devices:
            self._once("no-dra", "device taints: no ResourceSlice of driver %s on node %s (its "
                       "GPUs are not allocated through DRA): no device tainted",
                       self.config.driver, self.node)
            report.actions.append({"action": "device_taint", "result": "no ResourceSlice"})
            self.to_taint.clear()
            return
        for uuid, bad in list(self.to_taint.items()):
            mine = [d for d in devices if d.uuid == uuid] or \
                [d for d in devices if d.parent_uuid == uuid]
            if not mine:
                self._once(f"unpublished:{uuid}", "device taints: GPU %s is in no ResourceSlice "
                           "of %s on %s: not tainted", uuid, self.config.driver, self.node)
                del self.to_taint[uuid]
                continue
            try:
                for device in mine:
                    body = self.api.body(self.node, device, reason=bad.reason, gpu_uuid=uuid,
                                         gpu_serial=bad.serial, evidence=bad.evidence)
                    created = self.api.create(body, device)
                    name = body["metadata"]["name"]
                    report.actions.append({"action": "device_taint", "gpu": uuid,
                                           "device": device.name, "rule": name,
                                           "result": "created" if created else "present"})
                    if created:
                        log.warning("GPU %s (%s) of %s out of service: DeviceTaintRule %s (%s)",
                                    uuid, device.name, self.node, name, bad.evidence,
                                    extra={"event": "device_taint", "gpu": uuid, "rule": name})
            except ScreenerError as e:
                report.actions.append({"action": "device_taint", "gpu": uuid,
                                       "result": f"failed: {e}"[:300]})
                if self.api.transient(e):  # the API out of reach: the next pass tries again
                    log.warning("device taints: GPU %s of %s not tainted yet: %s", uuid,
                                self.node, e)
                    continue
                # Refused (RBAC, the admission policy, a name another object holds): trying
                # again on every pass would only repeat the refusal.
                log.error("device taints: GPU %s of %s not tainted: %s", uuid, self.node, e,
                          extra={"event": "device_taint", "gpu": uuid})
            del self.to_taint[uuid]

    def _clear(self, report: PassReport) -> None:
        assert self.api is not None
        try:
            rules = self.api.rules(self.node)
        except ScreenerError as e:
            if self.api.transient(e):
                log.warning("device taints: cannot list the DeviceTaintRules of %s yet: %s",
                            self.node, e)
                return
            log.error("device taints: cannot list the DeviceTaintRules of %s: %s", self.node, e)
            self.to_clear.clear()
            return
        for uuid in sorted(self.to_clear):
            ours = [r for r in rules if self.api.gpu_of(r) == uuid]
            try:
                for rule in ours:
                    name = rule["metadata"]["name"]
                    gone = self.api.delete(rule)
                    report.actions.append({"action": "device_untaint", "gpu": uuid, "rule": name,
                                           "result": "cleared" if gone else "already gone"})
                    log.info("GPU %s of %s back in service: a known-answer retest passed; "
                             "DeviceTaintRule %s removed", uuid, self.node, name,
                             extra={"event": "device_untaint", "gpu": uuid, "rule": name})
            except ScreenerError as e:
                if self.api.transient(e):
                    log.warning("device taints: GPU %s of %s not cleared yet: %s", uuid,
                                self.node, e)
                    continue
                log.error("device taints: GPU %s of %s not cleared: %s", uuid, self.node, e,
                          extra={"event": "device_untaint", "gpu": uuid})
            self.to_clear.discard(uuid)
