"""Run every health probe once (NVML, kernel log, host) and turn the observations into Findings.

`run_probes` is what `screener probe` and the daemon call. The daemon keeps one open `NvmlAdapter`
(its event set catches Xids between probes) and one `KernelLogReader` (it keeps its position), and
passes the previous report so the rules can see counters rise::

    with NvmlAdapter() as nvml, KernelLogReader(state_file=...) as kmsg:
        report = None
        while True:
            report = run_probes(config, nvml=nvml, kmsg=kmsg, previous=report)
            act_on(report.findings); idle = all(not g.busy for g in report.gpus)

Our own failures (NVML erroring, an unreadable config path) go to ``report.errors``, never into a
hardware finding; the exit code is 75 when a finding is suspect or worse, else 1 when a probe
failed, else 0.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from screener.errors import BadInputError, ScreenerError
from screener.settings.health import ProbeConfig
from screener.health.sources.host import read_host
from screener.health.sources.kmsg import KernelLogReader, KmsgUnavailable
from screener.health.sources.nvml import NvmlAdapter, NvmlError
from screener.health.verdict.rules import evaluate, worst_severity
from screener.health.verdict.snapshot import (GpuSnapshot, HostSnapshot, NvmlSnapshot, ProbeSnapshot,
                                              XidEvent)
from screener.health.verdict.xid import lookup
from screener.types import ExitCode, Finding, Severity

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeReport:
    """The findings of one probe run, with the snapshot they came from."""

    snapshot: ProbeSnapshot
    findings: tuple[Finding, ...]
    errors: tuple[str, ...] = ()

    @property
    def gpus(self) -> tuple[GpuSnapshot, ...]:
        """Per-GPU snapshots: identity, counters, utilisation and running compute processes."""
        return self.snapshot.nvml.gpus

    @property
    def worst(self) -> Severity:
        return worst_severity(self.findings)

    @property
    def exit_code(self) -> ExitCode:
        if self.worst >= Severity.SUSPECT:
            return ExitCode.HARDWARE_SUSPECT
        if self.errors:
            return ExitCode.SCREENER_ERROR
        return ExitCode.PASS

    def to_dict(self) -> dict[str, Any]:
        snap = self.snapshot
        return {
            "taken_at": snap.taken_at,
            "worst": self.worst.label,
            "exit_code": int(self.exit_code),
            "findings": [finding_dict(f) for f in self.findings],
            "driver_version": snap.nvml.driver_version,
            "nvml": snap.nvml.to_dict(),
            "xids": [x.to_dict() for x in snap.xids],
            "host": snap.host.to_dict() if snap.host is not None else None,
            "kmsg": {"status": snap.kmsg_status, "reason": snap.kmsg_reason},
            "errors": list(self.errors),
        }


class DeferredKernelLogReader(KernelLogReader):
    """A KernelLogReader that saves its position only when told to (`commit`).

    The daemon reads Xids, hands them to the lifecycle, and commits only once the transition they
    cause is recorded or spooled: a daemon killed (or a state disk full) in between reads the same
    lines again after a restart instead of losing them. In memory the position advances as usual,
    so one run never reports a line twice.
    """

    def __init__(self, path: str, *, state_file: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(path, state_file=state_file, **kwargs)
        self.commit_file = state_file
        self.state_file = None  # read_new() saves nowhere; commit() does

    def commit(self) -> None:
        """Save the position reached so far (raises ScreenerError when it cannot be written)."""
        state = getattr(self, "_state", None)
        if state is not None and self.commit_file:
            state.save(self.commit_file)


class NodeProbes:
    """The node's probes as the daemon runs them (its Probes port): `run` probes once with the
    NVML adapter and kernel-log reader the caller keeps open; `commit` saves the kernel-log
    position a DeferredKernelLogReader has reached (a plain reader, or none, saves its own)."""

    def __init__(self, config: Optional[ProbeConfig] = None, *,
                 nvml: Union[NvmlAdapter, Any, None] = None,
                 kmsg: Optional[KernelLogReader] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config, self.nvml, self.kmsg, self.clock = config, nvml, kmsg, clock

    def run(self, previous: Optional[ProbeReport]) -> ProbeReport:
        return run_probes(self.config, nvml=self.nvml, kmsg=self.kmsg, previous=previous,
                          clock=self.clock)

    def commit(self) -> None:
        if isinstance(self.kmsg, DeferredKernelLogReader):
            self.kmsg.commit()


def finding_dict(f: Finding) -> dict[str, Any]:
    """A finding as JSON; an Xid finding also carries its catalog entry at the top level."""
    d = f.to_dict()
    if f.code == "xid" and "xid" in f.evidence:
        info = lookup(int(f.evidence["xid"]))
        d["xid"] = {"code": info.code, "name": info.name, "resolution": info.resolution,
                    "classification": info.classification.value}
    return d


def _match_gpus(events: tuple[XidEvent, ...], gpus: tuple[GpuSnapshot, ...]) -> list[XidEvent]:
    """Fill in GPU index and UUID of kernel-log Xids from their PCI address."""
    by_pci = {g.pci_bus_id: g for g in gpus if g.pci_bus_id}
    out = []
    for ev in events:
        g = by_pci.get(ev.pci_bus_id) if ev.pci_bus_id else None
        if g is not None and ev.gpu_uuid is None:
            ev = replace(ev, gpu_index=g.index, gpu_uuid=g.uuid)
        out.append(ev)
    return out


def run_probes(config: Optional[ProbeConfig] = None, *,
               nvml: Union[NvmlAdapter, Any, None] = None,
               kmsg: Optional[KernelLogReader] = None,
               previous: Union[ProbeReport, ProbeSnapshot, None] = None,
               psutil_module: Optional[Any] = None,
               clock: Callable[[], float] = time.time) -> ProbeReport:
    """Run NVML, kernel-log and host probes once and evaluate every rule.

    nvml: an open `NvmlAdapter` the caller keeps (the daemon), an NVML module to wrap for this
        one run (tests), or None for pynvml for this one run. An adapter made here is closed
        here, and registers no events (there would be no time for any to arrive).
    kmsg: a `KernelLogReader` the caller keeps, or None to read ``config.kmsg_path`` (if set).
    previous: the last report (or snapshot), for rules that compare (rising counters, a GPU gone).
    """
    config = config or ProbeConfig()
    errors: list[str] = []
    nv = _read_nvml(nvml, errors)
    xids = list(nv.xid_events)
    kmsg_status, kmsg_reason = _read_kmsg(config, kmsg, xids, errors)
    host: Optional[HostSnapshot] = None
    try:
        host = read_host(config, psutil_module)
        errors += [f"host {k}: {v}" for k, v in host.errors.items()]
    except OSError as e:
        errors.append(f"host: {e}")

    snapshot = ProbeSnapshot(taken_at=clock(), nvml=nv,
                             xids=tuple(_match_gpus(tuple(xids), nv.gpus)), host=host,
                             kmsg_status=kmsg_status, kmsg_reason=kmsg_reason)
    prev = previous.snapshot if isinstance(previous, ProbeReport) else previous
    findings = evaluate(snapshot, prev, config)
    for err in errors:
        log.warning("%s", err)
    return ProbeReport(snapshot=snapshot, findings=tuple(findings), errors=tuple(errors))


def _read_nvml(nvml: Union[NvmlAdapter, Any, None], errors: list[str]) -> NvmlSnapshot:
    """One NVML snapshot (a failed one when NVML cannot be read); its errors go to `errors`."""
    adapter = nvml if isinstance(nvml, NvmlAdapter) else NvmlAdapter(nvml, events=False)
    own_nvml = adapter is not nvml
    try:
        nv = adapter.snapshot()
    except NvmlError as e:
        errors.append(f"NVML: {e}")
        nv = NvmlSnapshot(available=False, failed=True, reason=str(e))
    finally:
        if own_nvml:
            adapter.close()
    errors += [f"NVML: {e}" for e in nv.errors]
    return nv


def _read_kmsg(config: ProbeConfig, kmsg: Optional[KernelLogReader], xids: list[Any],
               errors: list[str]) -> tuple[str, str]:
    """New kernel-log Xids into `xids`, read errors into `errors`; returns the kernel log's
    status ("read", "disabled" or "unavailable") and why it is unavailable."""
    own_kmsg = kmsg is None and config.kmsg_path is not None
    if own_kmsg:
        kmsg = KernelLogReader(config.kmsg_path or "", state_file=config.kmsg_state_file,
                               first_read=config.kmsg_first_read,
                               boot_id_path=config.boot_id_path)
    if kmsg is None:
        return "disabled", ""
    try:
        read = kmsg.read_new()
        xids += read.events
        errors += [f"kernel log: {e}" for e in read.errors]
    except KmsgUnavailable as e:
        return "unavailable", str(e)
    except BadInputError:
        raise
    except ScreenerError as e:
        errors.append(f"kernel log: {e}")
    finally:
        if own_kmsg:
            kmsg.close()
    return "read", ""
