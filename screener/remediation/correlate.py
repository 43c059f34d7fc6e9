"""DCGM correlation: what a node's GPU telemetry did around an alarm, read from Prometheus.

dcgm-exporter publishes each GPU's hardware counters (Xid, ECC, row remapping, clock event reasons,
temperature, power, clocks) and a Prometheus server keeps them. correlate asks the Prometheus HTTP
API for the raw samples of one node's DCGM series in a window around the alarm and says what changed:
counters that rose, flags that were set, Xids that appeared, throttling, and a GPU whose clock or
temperature stands out from the node's other GPUs.

It confirms, never clears. A hardware counter that moved in the window corroborates the alarm (a
finding of severity suspect or worse); clean telemetry means nothing, because silent data corruption
by definition raises no counter. Only a passing known-answer screen clears a node.

The HTTP client uses urllib only: no dependency beyond the standard library.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional

from screener import boundedjson
from screener.errors import BadInputError, ExternalServiceError
from screener.health.verdict.xid import XidClass, lookup as xid_lookup
from screener.types import Finding, Severity


# --- what we read ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetricSpec:
    """How to read one dcgm-exporter metric: its kind, a name for people, and what a change means."""

    name: str
    kind: str  # "counter" (report increase), "flag" (report set), "xid", "bitmask", "gauge"
    title: str
    severity: Severity = Severity.INFO  # of a change (counter rose, flag set)
    action: str = ""


_DRAIN_RESET = "drain the node at the next safe point and reset the GPU"
_REMOVE_GPU = "take the GPU out of service through the provider's replacement process"

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("DCGM_FI_DEV_XID_ERRORS", "xid", "Xid"),
    MetricSpec("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "single-bit ECC errors (volatile)",
               Severity.WARNING, "watch the rate: rising correctable errors often precede uncorrectable ones"),
    MetricSpec("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "double-bit ECC errors (volatile)",
               Severity.CRITICAL, _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "counter", "single-bit ECC errors (aggregate)",
               Severity.WARNING, "watch the rate: rising correctable errors often precede uncorrectable ones"),
    MetricSpec("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "counter", "double-bit ECC errors (aggregate)",
               Severity.CRITICAL, _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
               "rows remapped for uncorrectable errors", Severity.SUSPECT, _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter",
               "rows remapped for correctable errors", Severity.WARNING, _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_ROW_REMAP_PENDING", "flag", "row remap pending", Severity.SUSPECT,
               _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_ROW_REMAP_FAILURE", "flag", "row remap failure", Severity.CRITICAL,
               _REMOVE_GPU),
    MetricSpec("DCGM_FI_DEV_RETIRED_SBE", "counter", "pages retired for single-bit errors",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_RETIRED_DBE", "counter", "pages retired for double-bit errors",
               Severity.SUSPECT, _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_RETIRED_PENDING", "flag", "page retirement pending", Severity.WARNING,
               _DRAIN_RESET),
    MetricSpec("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "counter", "NVLink flit CRC errors",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "counter", "NVLink data CRC errors",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "counter", "NVLink replays",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "counter", "NVLink recoveries",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "PCIe replays", Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_THERMAL_VIOLATION", "counter", "thermal throttling time (us)",
               Severity.WARNING),
    MetricSpec("DCGM_FI_DEV_POWER_VIOLATION", "counter", "power throttling time (us)", Severity.INFO),
    # The clock event (formerly throttle) reasons bitmask: the older and the newer field name.
    MetricSpec("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "bitmask", "clock throttle reasons"),
    MetricSpec("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "bitmask", "clock event reasons"),
    MetricSpec("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (C)"),
    MetricSpec("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "memory temperature (C)"),
    MetricSpec("DCGM_FI_DEV_POWER_USAGE", "gauge", "power (W)"),
    MetricSpec("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock (MHz)"),
)
_SPECS = {m.name: m for m in METRICS}

# NVML clock event reason bits that mean the GPU was slowed by heat or power; the others (idle,
# application clock setting, sync boost, display clock) are normal operation.
_CLOCK_EVENT_BITS: Mapping[int, tuple[str, Severity]] = {
    0x4: ("software power cap", Severity.INFO),
    0x8: ("hardware slowdown", Severity.WARNING),
    0x20: ("software thermal slowdown", Severity.WARNING),
    0x40: ("hardware thermal slowdown", Severity.WARNING),
    0x80: ("hardware power brake slowdown", Severity.WARNING),
}

# Peer comparison within a node: how far one GPU may stand out before it is reported.
SM_CLOCK_BELOW_MEDIAN = 0.10  # mean SM clock more than 10% below the node's median GPU
TEMP_ABOVE_MEDIAN_C = 15.0  # peak temperature more than 15 C above the node's median GPU

# Labels that may carry the node's name, in the order tried (dcgm-exporter's own Hostname first).
NODE_LABELS = ("Hostname", "node", "kubernetes_node", "instance")


# --- Prometheus HTTP API --------------------------------------------------------------------------

class PrometheusClient:
    """A small client for the Prometheus HTTP API (/api/v1/query, /api/v1/query_range)."""

    def __init__(self, url: str, *, timeout: float = 30.0,
                 headers: Optional[Mapping[str, str]] = None) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise BadInputError(f"Prometheus URL {url!r} is not an http(s) URL")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = dict(headers or {})

    def query(self, promql: str, time: Optional[float] = None) -> Mapping[str, Any]:
        """An instant query; returns the response's `data` ({resultType, result})."""
        params = {"query": promql}
        if time is not None:
            params["time"] = _fmt_time(time)
        return self._post("/api/v1/query", params)

    def query_range(self, promql: str, start: float, end: float, step: float) -> Mapping[str, Any]:
        """A range query evaluated every `step` seconds; returns the response's `data`."""
        return self._post("/api/v1/query_range", {"query": promql, "start": _fmt_time(start),
                                                  "end": _fmt_time(end), "step": f"{step:g}"})

    def _post(self, path: str, params: Mapping[str, str]) -> Mapping[str, Any]:
        # POST with a form body is part of the documented API and keeps long selectors out of URLs.
        body = urllib.parse.urlencode(params).encode()
        req = urllib.request.Request(self.url + path, data=body, method="POST", headers={
            "Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json",
            **self.headers})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read()
            detail = _error_detail(raw) or f"HTTP {e.code} {e.reason}"
            raise ExternalServiceError(f"Prometheus at {self.url} refused the query: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ExternalServiceError(f"Prometheus at {self.url} is unreachable: {reason}") from e
        try:
            doc = boundedjson.strict(raw)
        except ValueError as e:
            raise ExternalServiceError(f"Prometheus at {self.url} answered something that is not "
                                       "JSON (is this the Prometheus API?)") from e
        if not isinstance(doc, dict) or doc.get("status") != "success" or "data" not in doc:
            detail = _error_detail(raw) or "no data"
            raise ExternalServiceError(f"Prometheus at {self.url} failed the query: {detail}")
        return doc["data"]


def _error_detail(raw: bytes) -> str:
    try:
        doc = boundedjson.strict(raw)
    except ValueError:
        return ""
    if isinstance(doc, dict) and doc.get("error"):
        return f"{doc.get('errorType', 'error')}: {doc['error']}"
    return ""


def _fmt_time(t: float) -> str:
    return f"{t:.3f}"


# --- times and selectors --------------------------------------------------------------------------

def parse_time(text: str, now: float) -> float:
    """Unix seconds from 'now', a unix timestamp, or an ISO 8601 time (UTC if it has no zone)."""
    s = text.strip()
    if s.lower() == "now":
        return now
    try:
        return float(s)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00") if s.endswith("Z") else s)
    except ValueError:
        raise BadInputError(f"time {text!r} is not 'now', unix seconds or ISO 8601 "
                            "(e.g. 2025-01-31T12:00:00Z)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _regex_escape(text: str) -> str:
    # RE2 accepts a backslash before any punctuation; escape every metacharacter.
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", text)


def _promql_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def node_selector(label: str, value: str, metrics: Iterable[str] = _SPECS) -> str:
    """A PromQL selector for the DCGM metrics of one node; `instance` may carry a :port."""
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", label):
        raise BadInputError(f"label name {label!r} is not a Prometheus label name")
    names = "|".join(sorted(metrics))
    port = "(:[0-9]+)?" if label == "instance" else ""
    return ("{__name__=~" + _promql_string(f"({names})") + ","
            + label + "=~" + _promql_string(_regex_escape(value) + port) + "}")


# --- the analysis ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Series:
    """Samples of one metric of one GPU, merged across series that differ only in other labels."""

    metric: str
    gpu: str
    uuid: str
    model: str
    samples: tuple[tuple[float, float], ...]  # (unix time, value), sorted, finite values only


@dataclass(frozen=True)
class Correlation:
    """What a node's DCGM telemetry did in a window, and the findings it supports."""

    node: str
    start: float
    end: float
    matched_by: str  # the label=value that selected the node's series, "" if none matched
    gpus: tuple[Mapping[str, Any], ...]  # per GPU: gpu, uuid, model, metrics {name: summary}
    findings: tuple[Finding, ...]

    @property
    def confirms(self) -> bool:
        """Whether the telemetry corroborates a hardware fault (never whether it clears one)."""
        return any(f.severity >= Severity.SUSPECT for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "start": self.start, "end": self.end,
                "start_iso": _iso(self.start), "end_iso": _iso(self.end),
                "matched_by": self.matched_by, "confirms": self.confirms,
                "clears": False,  # by design: telemetry never clears a node
                "gpus": [dict(g) for g in self.gpus],
                "findings": [f.to_dict() for f in self.findings]}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def series_from_matrix(result: Iterable[Mapping[str, Any]]) -> list[Series]:
    """Merge a Prometheus matrix into one Series per (metric, GPU).

    dcgm-exporter adds pod/namespace/container labels while a pod uses a GPU, so one GPU's metric
    is split across several series over time; merging by GPU keeps its history whole.
    """
    merged: dict[tuple[str, str, str], dict[float, float]] = {}
    models: dict[tuple[str, str, str], str] = {}
    for s in result:
        labels = s.get("metric") or {}
        name = str(labels.get("__name__", ""))
        if name not in _SPECS:
            continue
        key = (name, str(labels.get("gpu", "")), str(labels.get("UUID", "")))
        models.setdefault(key, str(labels.get("modelName", "")))
        bucket = merged.setdefault(key, {})
        for t, v in s.get("values") or ():
            try:
                value = float(v)
            except (TypeError, ValueError):
                continue
            if math.isfinite(value):
                bucket[float(t)] = value
    return [Series(metric=k[0], gpu=k[1], uuid=k[2], model=models[k],
                   samples=tuple(sorted(v.items()))) for k, v in sorted(merged.items()) if v]


def _increase(values: Sequence[float]) -> float:
    # Like Prometheus' increase(): a drop is a counter reset (driver reload), counted from zero.
    total = 0.0
    for prev, cur in zip(values, values[1:]):
        total += cur - prev if cur >= prev else cur
    return total


def _gpu_name(s: Series) -> str:
    return f"GPU {s.gpu}" if s.gpu else (s.uuid or "GPU ?")


def _summary(s: Series) -> dict[str, Any]:
    values = [v for _, v in s.samples]
    out: dict[str, Any] = {"samples": len(values), "first": values[0], "last": values[-1],
                           "min": min(values), "max": max(values)}
    spec = _SPECS[s.metric]
    if spec.kind == "counter":
        out["increase"] = _increase(values)
    elif spec.kind == "gauge":
        out["mean"] = statistics.fmean(values)
    elif spec.kind == "bitmask":
        mask = 0
        for v in values:
            mask |= int(v)
        out["any"] = mask
    return out


def _findings_for(s: Series, summary: Mapping[str, Any]) -> list[Finding]:
    spec = _SPECS[s.metric]
    gpu = s.uuid or s.gpu or None
    where = _gpu_name(s)
    ev = {"metric": s.metric, "gpu_index": s.gpu, "uuid": s.uuid, **summary}
    out: list[Finding] = []
    if spec.kind == "counter" and summary["increase"] > 0:
        out.append(Finding(spec.severity, f"dcgm_{s.metric[len('DCGM_FI_DEV_'):].lower()}",
                           f"{where}: {spec.title} rose by {summary['increase']:g} "
                           f"({summary['first']:g} -> {summary['last']:g})", gpu, ev, spec.action))
    elif spec.kind == "flag" and summary["max"] > 0:
        already = summary["first"] > 0
        out.append(Finding(spec.severity, f"dcgm_{s.metric[len('DCGM_FI_DEV_'):].lower()}",
                           f"{where}: {spec.title} "
                           + ("was already set when the window began" if already
                              else "was set in the window"), gpu, ev, spec.action))
    elif spec.kind == "xid":
        out.extend(_xid_findings(s, where, gpu, ev))
    elif spec.kind == "bitmask":
        for bit, (title, sev) in _CLOCK_EVENT_BITS.items():
            share = sum(1 for _, v in s.samples if int(v) & bit) / len(s.samples)
            if share > 0:
                out.append(Finding(sev, "dcgm_clock_event", f"{where}: {title} in {share:.0%} of "
                                   "samples", gpu, {**ev, "bit": bit, "share": share}))
    return out


def _xid_findings(s: Series, where: str, gpu: Optional[str], ev: Mapping[str, Any]) -> list[Finding]:
    out: list[Finding] = []
    first_t, first_v = s.samples[0]
    if first_v > 0:
        out.append(Finding(Severity.INFO, "dcgm_xid_before",
                           f"{where}: the last Xid before the window was {int(first_v)}", gpu,
                           {**ev, "xid": int(first_v)}))
    prev = first_v
    for t, v in s.samples[1:]:
        if v != prev and v > 0:
            # The gauge holds the last Xid, so a change to a non-zero value is a new Xid; the
            # catalog says what it implies (13 and 31 are usually the application, not the GPU).
            info = xid_lookup(int(v))
            note = {XidClass.SOFTWARE: " (usually an application fault, not the GPU)",
                    XidClass.INFORMATIONAL: " (informational)"}.get(info.classification, "")
            out.append(Finding(info.severity, "dcgm_xid",
                               f"{where}: Xid {info.code} {info.name} at {_iso(t)}{note}", gpu,
                               {**ev, "xid": info.code, "time": t,
                                "xid_class": info.classification.value,
                                "resolution": info.resolution}, info.action))
        prev = v
    return out


def _peer_findings(per_gpu: Mapping[tuple[str, str], Mapping[str, Mapping[str, Any]]]) -> list[Finding]:
    """A GPU whose SM clock or temperature stands out from the node's other GPUs."""
    out: list[Finding] = []
    clocks = {k: m["DCGM_FI_DEV_SM_CLOCK"]["mean"] for k, m in per_gpu.items()
              if "DCGM_FI_DEV_SM_CLOCK" in m}
    if len(clocks) >= 3:
        med = statistics.median(clocks.values())
        for (idx, uuid), mean in sorted(clocks.items()):
            if med > 0 and mean < (1.0 - SM_CLOCK_BELOW_MEDIAN) * med:
                out.append(Finding(Severity.WARNING, "dcgm_slow_clock",
                                   f"GPU {idx}: mean SM clock {mean:.0f} MHz is "
                                   f"{1 - mean / med:.0%} below the node's median {med:.0f} MHz",
                                   uuid or idx or None, {"mean": mean, "median": med}))
    temps = {k: m["DCGM_FI_DEV_GPU_TEMP"]["max"] for k, m in per_gpu.items()
             if "DCGM_FI_DEV_GPU_TEMP" in m}
    if len(temps) >= 3:
        med = statistics.median(temps.values())
        for (idx, uuid), peak in sorted(temps.items()):
            if peak > med + TEMP_ABOVE_MEDIAN_C:
                out.append(Finding(Severity.INFO, "dcgm_hot_gpu",
                                   f"GPU {idx}: peak temperature {peak:.0f} C, the node's median "
                                   f"GPU peaks at {med:.0f} C", uuid or idx or None,
                                   {"max": peak, "median": med}))
    return out


def analyze(node: str, series: Sequence[Series], start: float, end: float,
            matched_by: str = "") -> Correlation:
    """Turn a node's merged DCGM series into per-GPU summaries and findings (pure)."""
    per_gpu: dict[tuple[str, str], dict[str, Any]] = {}
    models: dict[tuple[str, str], str] = {}
    findings: list[Finding] = []
    for s in series:
        key = (s.gpu, s.uuid)
        summary = _summary(s)
        per_gpu.setdefault(key, {})[s.metric] = summary
        if s.model:
            models.setdefault(key, s.model)
        findings.extend(_findings_for(s, summary))
    findings.extend(_peer_findings(per_gpu))
    findings.sort(key=lambda f: (-int(f.severity), str(f.gpu), f.code))
    gpus = tuple({"gpu": idx, "uuid": uuid, "model": models.get((idx, uuid), ""), "metrics": m}
                 for (idx, uuid), m in sorted(per_gpu.items(), key=lambda kv: _gpu_sort(kv[0])))
    return Correlation(node=node, start=start, end=end, matched_by=matched_by, gpus=gpus,
                       findings=tuple(findings))


def _gpu_sort(key: tuple[str, str]) -> tuple[int, str, str]:
    idx, uuid = key
    return (int(idx) if idx.isdigit() else 1 << 30, idx, uuid)


def correlate(client: PrometheusClient, node: str, start: float, end: float, *,
              match: Optional[tuple[str, str]] = None,
              labels: Sequence[str] = NODE_LABELS) -> Correlation:
    """Fetch the raw DCGM samples of `node` between start and end and analyse them.

    One instant query of a range selector returns every raw sample, so nothing is lost to a
    query_range step. The node's series are found by `match` (label, value) if given, else by the
    first of `labels` under which any series carries the node name.
    """
    if end <= start:
        raise BadInputError("the correlation window is empty (is --around in the future?)")
    span = max(1, math.ceil(end - start))
    tries = [match] if match else [(label, node) for label in labels]
    for label, value in tries:
        data = client.query(node_selector(label, value) + f"[{span}s]", time=end)
        result = data.get("result") or []
        if data.get("resultType") != "matrix":
            raise ExternalServiceError(f"Prometheus answered a {data.get('resultType')!r} result to a "
                                       "range selector; expected a matrix")
        series = series_from_matrix(result)
        if series:
            return analyze(node, series, start, end, matched_by=f"{label}={value}")
    return analyze(node, [], start, end)


def describe(c: Correlation) -> list[str]:
    """Lines for people: the window, each GPU's ranges, the findings, and what they do not mean."""
    lines = [f"node {c.node}: DCGM telemetry {_iso(c.start)} .. {_iso(c.end)}"
             + (f" ({c.matched_by})" if c.matched_by else "")]
    if not c.gpus:
        lines.append("  no DCGM series found for this node (try --match LABEL=VALUE)")
    for g in c.gpus:
        m = g["metrics"]
        parts = []
        for name, fmt in (("DCGM_FI_DEV_GPU_TEMP", "temp {min:.0f}-{max:.0f} C"),
                          ("DCGM_FI_DEV_POWER_USAGE", "power {min:.0f}-{max:.0f} W"),
                          ("DCGM_FI_DEV_SM_CLOCK", "SM clock {min:.0f}-{max:.0f} MHz")):
            if name in m:
                parts.append(fmt.format(**m[name]))
        head = f"GPU {g['gpu']}" + (f" {g['uuid']}" if g["uuid"] else "")
        lines.append(f"  {head}: " + (", ".join(parts) if parts else f"{len(m)} metrics"))
    for f in c.findings:
        lines.append(f"  [{f.severity.label}] {f.message}" + (f" -> {f.action}" if f.action else ""))
    if c.confirms:
        lines.append("telemetry corroborates a hardware fault on this node")
    else:
        lines.append("no hardware counter confirms a fault; this does not clear the node "
                     "(silent corruption raises none): only a passing known-answer screen does")
    return lines
