"""Health rules: pure functions from probe snapshots (previous and current) to Findings.

Nothing here reads a device or a file, so the daemon can feed successive probes and see counters
rise, and every rule is tested with plain data. Severities mean:

- info: worth recording, no action (no driver, a power-capped GPU, an application's Xid 13);
- warning: a health signal to watch; the lifecycle may mark the node suspect and re-screen
  (corrected errors rising, thermal throttling while busy, low headroom);
- suspect: stop new work, drain, reset at the next safe point and re-screen (pending row remap,
  degraded PCIe link, NVLink down, uncorrectable error, a missing mount);
- critical: the GPU is unusable now or must leave service (fallen off the bus, stopped answering,
  remap failure, uncorrectable errors back after a reset).

Codes (stable; the lifecycle and dashboards key on them):

    nvml_unavailable  gpu_missing  gpu_lost  row_remap_pending  row_remap_failure
    retired_pages_pending  retired_pages_over_threshold  ecc_uncorrectable  ecc_uncorrectable_recurring
    ecc_uncorrectable_history  ecc_corrected_rising  ecc_disabled  clocks_throttled
    clocks_power_capped  pcie_degraded  nvlink_down  xid  mount_missing  memory_low  disk_low
    kmsg_unavailable
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Optional, Sequence

from screener.settings.health import ProbeConfig
from screener.health.verdict.snapshot import GpuSnapshot, HostSnapshot, ProbeSnapshot, XidEvent
from screener.health.verdict.xid import lookup
from screener.types import Finding, Severity

NO_DRIVER_MESSAGE = "no NVIDIA driver: GPU probes skipped"

# NVIDIA's page-retirement guidance: a GPU that has retired this many pages (single- plus
# double-bit) is due for replacement; the driver can retire at most 64.
RETIRED_PAGES_REPAIR = 60

# Codes that describe a state of the hardware rather than an event: present in every probe for as
# long as the cause lasts. The daemon re-applies them on every probe (level-triggered) and no
# passing screen clears a node while one is present. (A critical Xid is an event in the log; the
# daemon keeps it as a condition until the node reboots or a person or a remediation releases it.)
CONDITION_CODES = frozenset({"row_remap_pending", "row_remap_failure", "retired_pages_pending",
                             "retired_pages_over_threshold", "gpu_missing", "gpu_lost"})


def is_condition(f: Finding) -> bool:
    """Whether a finding is a persisting condition (see CONDITION_CODES), or a critical Xid."""
    return f.code in CONDITION_CODES or (f.code == "xid" and f.severity >= Severity.CRITICAL)

ACTION_DRAIN_RESET = "drain the node and reset the GPU at the next safe point, then re-screen"
ACTION_REPAIR = "remove the GPU from service (repair)"
ACTION_REBOOT = "drain the node and reboot it; repair if the GPU stays missing"
ACTION_WATCH = "watch the counter; re-screen the GPU if it keeps rising"
ACTION_COOLING = "check cooling, power and fans; the GPU slows every synchronous job it is in"

_THERMAL = ("sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown", "hw_power_brake_slowdown")
_POWER = ("sw_power_cap",)


def _f(severity: Severity, code: str, message: str, gpu: Optional[GpuSnapshot] = None,
       action: str = "", **evidence: object) -> Finding:
    ev = dict(gpu.identity()) if gpu is not None else {}
    ev.update(evidence)
    return Finding(severity=severity, code=code, message=message,
                   gpu=gpu.label if gpu is not None else None, evidence=ev, action=action)


def _busy(g: GpuSnapshot, config: ProbeConfig) -> bool:
    if g.processes:
        return True
    return g.utilization_gpu is not None and g.utilization_gpu >= max(1, config.busy_utilization)


# --- NVML-level rules ------------------------------------------------------------------------


def nvml_rules(current: ProbeSnapshot, previous: Optional[ProbeSnapshot],
               config: ProbeConfig) -> list[Finding]:
    """No driver, missing GPUs (expected count, or gone since the last probe), lost GPUs."""
    out: list[Finding] = []
    nv = current.nvml
    if nv.failed:
        return out  # NVML could not be read: the report's errors say why; no verdict from it
    if not nv.available:
        out.append(_f(Severity.INFO, "nvml_unavailable", NO_DRIVER_MESSAGE, reason=nv.reason))
        if config.expected_gpus:
            out.append(_f(Severity.CRITICAL, "gpu_missing",
                          f"expected {config.expected_gpus} GPUs but there is no NVIDIA driver",
                          action=ACTION_REBOOT, expected=config.expected_gpus, found=0,
                          reason=nv.reason))
        return out
    gone: list[Finding] = []
    if previous is not None and previous.nvml.available:
        now = {g.uuid for g in nv.gpus if g.uuid}
        lost = {g.index for g in nv.gpus if g.lost}  # reported below as lost, not twice
        for g in previous.nvml.gpus:
            if g.uuid and g.uuid not in now and g.index not in lost:
                gone.append(_f(Severity.CRITICAL, "gpu_missing",
                               f"GPU {g.index} ({g.uuid}) was seen in the last probe and is "
                               "gone: fallen off the bus",
                               gpu=g, action=ACTION_REBOOT))
    out += gone
    # The count check names no GPU; it adds something only beyond the GPUs named above.
    if (config.expected_gpus is not None
            and config.expected_gpus - nv.device_count > len(gone)):
        out.append(_f(Severity.CRITICAL, "gpu_missing",
                      f"expected {config.expected_gpus} GPUs, NVML sees {nv.device_count}: "
                      "a GPU has fallen off the bus", action=ACTION_REBOOT,
                      expected=config.expected_gpus, found=nv.device_count))
    for g in nv.gpus:
        if g.lost:
            out.append(_f(Severity.CRITICAL, "gpu_lost",
                          f"GPU {g.index} stopped answering NVML", gpu=g, action=ACTION_REBOOT,
                          error=g.lost_reason))
    return out


# --- per-GPU rules ----------------------------------------------------------------------------


def memory_rules(g: GpuSnapshot, prev: Optional[GpuSnapshot]) -> list[Finding]:
    """Row remapper, retired pages and ECC counters of one GPU."""
    return _spare_memory_rules(g) + _ecc_rules(g, prev)


def _spare_memory_rules(g: GpuSnapshot) -> list[Finding]:
    """The row remapper's and page retirement's state: spare memory used up, or a reset due."""
    out: list[Finding] = []
    rr = g.row_remap
    if rr is not None and rr.failure:
        out.append(_f(Severity.CRITICAL, "row_remap_failure",
                      f"GPU {g.index}: a row remap failed (no spare rows left in a bank)", gpu=g,
                      action=ACTION_REPAIR, correctable_rows=rr.correctable,
                      uncorrectable_rows=rr.uncorrectable))
    if rr is not None and rr.pending:
        out.append(_f(Severity.SUSPECT, "row_remap_pending",
                      f"GPU {g.index}: a row remap is pending; it takes effect at the next reset",
                      gpu=g, action=ACTION_DRAIN_RESET, correctable_rows=rr.correctable,
                      uncorrectable_rows=rr.uncorrectable))
    rp = g.retired_pages
    if rp is not None and rp.single_bit + rp.double_bit >= RETIRED_PAGES_REPAIR:
        out.append(_f(Severity.CRITICAL, "retired_pages_over_threshold",
                      f"GPU {g.index}: {rp.single_bit + rp.double_bit} retired pages, at or over "
                      f"the replacement threshold of {RETIRED_PAGES_REPAIR}", gpu=g,
                      action=ACTION_REPAIR, single_bit_pages=rp.single_bit,
                      double_bit_pages=rp.double_bit, threshold=RETIRED_PAGES_REPAIR))
    if rp is not None and rp.pending:
        out.append(_f(Severity.SUSPECT, "retired_pages_pending",
                      f"GPU {g.index}: retired pages are pending until the next driver reload",
                      gpu=g, action=ACTION_DRAIN_RESET, single_bit_pages=rp.single_bit,
                      double_bit_pages=rp.double_bit))
    return out


def _ecc_rules(g: GpuSnapshot, prev: Optional[GpuSnapshot]) -> list[Finding]:
    """ECC counters: uncorrectable errors (recurring after a reset or not), corrected ones rising
    since the previous probe, and ECC switched off."""
    out: list[Finding] = []
    e, pe = g.ecc, (prev.ecc if prev is not None else None)
    vu, au = e.volatile_uncorrected, e.aggregate_uncorrected
    # Volatile counts restart at a GPU reset; aggregate counts are lifetime totals. Uncorrectable
    # errors now, with more in the lifetime total (or after the volatile count went down, i.e. a
    # reset between probes), came back after a reset.
    reset_between = (pe is not None and pe.volatile_uncorrected is not None and vu is not None
                     and vu < pe.volatile_uncorrected)
    if vu and ((au is not None and au > vu) or reset_between):
        out.append(_f(Severity.CRITICAL, "ecc_uncorrectable_recurring",
                      f"GPU {g.index}: uncorrectable ECC errors came back after a reset "
                      f"({vu} now, {au} in its lifetime)", gpu=g, action=ACTION_REPAIR,
                      volatile_uncorrected=vu, aggregate_uncorrected=au))
    elif vu:
        out.append(_f(Severity.SUSPECT, "ecc_uncorrectable",
                      f"GPU {g.index}: {vu} uncorrectable ECC error(s) since the last reset",
                      gpu=g, action=ACTION_DRAIN_RESET + "; repair if they come back",
                      volatile_uncorrected=vu, aggregate_uncorrected=au))
    elif au:
        out.append(_f(Severity.INFO, "ecc_uncorrectable_history",
                      f"GPU {g.index}: {au} uncorrectable ECC error(s) in its lifetime, none "
                      "since the last reset", gpu=g, aggregate_uncorrected=au))

    if pe is not None:
        rising = {}
        for key in ("volatile_corrected", "aggregate_corrected"):
            before, now = getattr(pe, key), getattr(e, key)
            if before is not None and now is not None and now > before:
                rising[key] = {"before": before, "now": now, "delta": now - before}
        if rising:
            delta = max(v["delta"] for v in rising.values())
            out.append(_f(Severity.WARNING, "ecc_corrected_rising",
                          f"GPU {g.index}: corrected ECC errors rose by {delta} since the last "
                          "probe", gpu=g, action=ACTION_WATCH, counters=rising))
    if g.ecc_enabled is False:
        out.append(_f(Severity.INFO, "ecc_disabled",
                      f"GPU {g.index}: ECC is disabled; memory errors go unreported and rows "
                      "cannot be remapped", gpu=g, pending_enabled=g.ecc_pending_enabled))
    return out


def clock_rules(g: GpuSnapshot, config: ProbeConfig) -> list[Finding]:
    """Thermal or power throttling while busy: a straggler risk."""
    reasons = set(g.clock_event_reasons or ())
    if not reasons or not _busy(g, config):
        return []
    out = []
    thermal = sorted(reasons.intersection(_THERMAL))
    power = sorted(reasons.intersection(_POWER))
    if thermal:
        out.append(_f(Severity.WARNING, "clocks_throttled",
                      f"GPU {g.index} is slowed while busy ({', '.join(thermal)}): straggler "
                      "risk", gpu=g, action=ACTION_COOLING, reasons=thermal,
                      temperature_c=g.temperature_c, power_w=g.power_w,
                      utilization_gpu=g.utilization_gpu))
    if power:
        sev = Severity.WARNING if config.power_cap_is_warning else Severity.INFO
        out.append(_f(sev, "clocks_power_capped",
                      f"GPU {g.index} is held at its software power cap while busy", gpu=g,
                      action=ACTION_COOLING if config.power_cap_is_warning else "",
                      reasons=power, power_w=g.power_w, utilization_gpu=g.utilization_gpu))
    return out


def link_rules(g: GpuSnapshot, prev: Optional[GpuSnapshot], config: ProbeConfig) -> list[Finding]:
    """PCIe below its maximum width (or generation, while busy); NVLinks down."""
    out = []
    problems = []
    if g.pcie_width is not None and g.pcie_width_max and g.pcie_width < g.pcie_width_max:
        problems.append(f"width x{g.pcie_width} of x{g.pcie_width_max}")
    # An idle GPU lowers its link generation to save power; only a busy one must run at full gen.
    if (g.pcie_gen is not None and g.pcie_gen_max and g.pcie_gen < g.pcie_gen_max
            and _busy(g, config)):
        problems.append(f"gen {g.pcie_gen} of {g.pcie_gen_max}")
    if problems:
        out.append(_f(Severity.SUSPECT, "pcie_degraded",
                      f"GPU {g.index}: PCIe link below its maximum ({', '.join(problems)})", gpu=g,
                      action=ACTION_DRAIN_RESET + "; reseat or repair the link if it persists",
                      pcie_gen=g.pcie_gen, pcie_gen_max=g.pcie_gen_max, pcie_width=g.pcie_width,
                      pcie_width_max=g.pcie_width_max))

    active = [link for link, up in g.nvlinks if up]
    down = sorted(link for link, up in g.nvlinks if not up)
    was_up = {link for link, up in (prev.nvlinks if prev is not None else ()) if up}
    went_down = [link for link in down if link in was_up]
    short = config.expected_nvlinks is not None and len(active) < config.expected_nvlinks
    # Links down while others of the same GPU are up is a partial fabric; all links down on a
    # GPU that never had one up is a GPU without NVLink (unless the config expects links).
    if (down and active) or went_down or short:
        what = (f"{len(active)} active, expected {config.expected_nvlinks}" if short
                else f"link(s) {', '.join(map(str, down))} down")
        out.append(_f(Severity.SUSPECT, "nvlink_down", f"GPU {g.index}: NVLink {what}", gpu=g,
                      action=ACTION_DRAIN_RESET + "; repair the link if it persists",
                      down=down, active=len(active), went_down=went_down,
                      expected=config.expected_nvlinks))
    return out


# --- Xids and host ----------------------------------------------------------------------------


def xid_rules(events: Sequence[XidEvent]) -> list[Finding]:
    """One finding per (GPU, Xid code), severity and action from the catalog."""
    groups: dict[tuple[str, int], list[XidEvent]] = defaultdict(list)
    for ev in events:
        gpu = ev.gpu_uuid or ev.pci_bus_id or (str(ev.gpu_index) if ev.gpu_index is not None
                                               else "unknown")
        groups[(gpu, ev.code)].append(ev)
    out = []
    for (gpu, code), evs in groups.items():
        info = lookup(code)
        first = evs[0]
        where = f"GPU {first.gpu_index}" if first.gpu_index is not None else f"GPU {gpu}"
        count = f" x{len(evs)}" if len(evs) > 1 else ""
        message = (f"{where}: Xid {code} ({info.name}): {info.description}{count}"
                   f" [{info.classification.value}]")
        evidence = {"index": first.gpu_index, "uuid": first.gpu_uuid,
                    "pci_bus_id": first.pci_bus_id, "xid": code, "name": info.name,
                    "description": info.description, "resolution": info.resolution,
                    "investigatory": info.investigatory,
                    "classification": info.classification.value, "count": len(evs),
                    "pids": sorted({e.pid for e in evs if e.pid is not None}),
                    "processes": sorted({e.process for e in evs if e.process}),
                    "sources": sorted({e.source for e in evs}), "text": first.text,
                    "line": first.raw}
        out.append(Finding(severity=info.severity, code="xid", message=message, gpu=gpu,
                           evidence=evidence, action=info.action))
    return out


def host_rules(host: HostSnapshot, config: ProbeConfig) -> list[Finding]:
    """Required mounts present; memory and disk headroom."""
    out = []
    for m in host.mounts:
        if not m.present:
            out.append(_f(Severity.SUSPECT, "mount_missing", f"required mount {m.path} is missing",
                          action="drain the node and restore the mount", path=m.path))
    if host.memory_total and (host.memory_available / host.memory_total
                              < config.min_free_memory_fraction):
        out.append(_f(Severity.WARNING, "memory_low",
                      f"host memory low: {host.memory_available / 2**30:.1f} GiB of "
                      f"{host.memory_total / 2**30:.1f} GiB available",
                      action="find what holds host memory before the next job",
                      available=host.memory_available, total=host.memory_total,
                      min_fraction=config.min_free_memory_fraction))
    for d in host.disks:
        if d.total and d.free / d.total < config.min_free_disk_fraction:
            out.append(_f(Severity.WARNING, "disk_low",
                          f"disk {d.path} low: {d.free / 2**30:.1f} GiB of "
                          f"{d.total / 2**30:.1f} GiB free", action="free disk space",
                          path=d.path, free=d.free, total=d.total,
                          min_fraction=config.min_free_disk_fraction))
    return out


def evaluate(current: ProbeSnapshot, previous: Optional[ProbeSnapshot],
             config: ProbeConfig) -> list[Finding]:
    """Every rule over one probe (and the one before it); worst findings first."""
    out = nvml_rules(current, previous, config)
    prev_gpus = previous.gpu_by_label() if previous is not None else {}
    for g in current.nvml.gpus:
        if g.lost:
            continue  # whatever it said before it went is not worth more than "lost"
        prev = prev_gpus.get(g.label)
        out += memory_rules(g, prev)
        out += clock_rules(g, config)
        out += link_rules(g, prev, config)
    out += xid_rules(current.xids)
    if current.host is not None:
        out += host_rules(current.host, config)
    if current.kmsg_status == "unavailable":
        out.append(_f(Severity.INFO, "kmsg_unavailable",
                      f"kernel log not read: {current.kmsg_reason}", reason=current.kmsg_reason))
    return sort_findings(out)


def sort_findings(findings: Iterable[Finding]) -> list[Finding]:
    return sorted(findings, key=lambda f: (-int(f.severity), f.gpu or "", f.code))


def worst_severity(findings: Iterable[Finding]) -> Severity:
    return max((f.severity for f in findings), default=Severity.OK)
