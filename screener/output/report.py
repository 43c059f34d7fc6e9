"""Self-contained HTML reports of one burn-in (`screener burnin --report FILE`) or of the fleet.

A report is one HTML file with its CSS and its plots inline (SVG written here, no script, no font or
library fetched from anywhere), so it can be mailed, attached to a ticket or opened on an
air-gapped machine. Every plot is a `<figure class="plot" data-plot=ID data-marks=N>`: N counts
the data marks drawn (bars, dots, segments), and a plot without data says so in words instead of
drawing an empty frame.

What the fleet report shows comes from the store: every node's state, its transitions in the
window (the timeline), the lemon counts, each node's incidents and the time between them (MTBI,
screener.lifecycle.incidents, over the same window), and the last verdict each node recorded
(per-job known-answer seconds per device). HBM bandwidth per GPU comes from burn-in reports passed along
(their HBM stage), and from stored verdicts whose HBM evidence carries `bandwidth_gbps`.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence, TypeGuard

from screener import boundedjson
from screener.errors import BadInputError
from screener.lifecycle.incidents import format_mtbi, mtbi_by_node
from screener.lifecycle.records import lemon_counts

# Okabe-Ito: told apart with the common colour-vision deficiencies.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
STATE_COLORS = {"healthy": "#009E73", "burnin": "#56B4E9", "suspect": "#E69F00",
                "quarantined": "#D55E00", "repair": "#CC79A7"}
OUTCOME_COLORS = {"pass": "#009E73", "inconclusive": "#E69F00", "suspect": "#D55E00",
                  "skipped": "#999999", "partial": "#56B4E9"}
FAILURE_COLOR = "#B00020"
WIDTH = 900
LABEL_W = 190  # left margin for row labels
ROW_H = 22
MAX_REPORT_BYTES = 64 * 1024 * 1024

CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:24px;color:#222;
background:#fff;max-width:960px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#555;margin:0 0 12px}.badge{display:inline-block;padding:1px 8px;border-radius:10px;
color:#fff;font-weight:600}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
figure.plot{margin:8px 0 16px}figcaption{font-weight:600;margin-bottom:4px}
svg text{font:12px system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;fill:#333}
.legend span{display:inline-block;margin-right:14px;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:-1px}
code{font-size:12px}
"""


# --- plots ---------------------------------------------------------------------------------------

def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}".rstrip("0").rstrip(".")
    return f"{v:.3g}"


def _nice_max(v: float) -> float:
    """A round axis end at or above v (1, 2, 2.5, 5 x 10^k)."""
    if v <= 0 or not math.isfinite(v):
        return 1.0
    exp = 10 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def _figure(plot_id: str, title: str, svg_body: str, height: int, marks: int,
            legend: Optional[Mapping[str, str]] = None, note: str = "") -> str:
    if marks == 0:
        svg_body = (f'<text x="{WIDTH / 2}" y="{height / 2}" text-anchor="middle">'
                    f'no data{(": " + _e(note)) if note else ""}</text>')
    leg = ""
    if legend and marks:
        leg = '<div class="legend">' + "".join(
            f'<span><i style="background:{c}"></i>{_e(k)}</span>' for k, c in legend.items())
        leg += "</div>"
    return (f'<figure class="plot" data-plot="{_e(plot_id)}" data-marks="{marks}">'
            f"<figcaption>{_e(title)}</figcaption>{leg}"
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{_e(title)}">'
            f"{svg_body}</svg></figure>")


def _x_axis(x0: float, x1: float, y: float, vmax: float, unit: str) -> str:
    parts = [f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#888"/>']
    for i in range(5):
        v = vmax * i / 4
        x = x0 + (x1 - x0) * i / 4
        parts.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#888"/>'
                     f'<text x="{x:.1f}" y="{y + 16}" text-anchor="middle">{_e(_fmt(v))}</text>')
    parts.append(f'<text x="{x1}" y="{y + 30}" text-anchor="end">{_e(unit)}</text>')
    return "".join(parts)


def bar_chart(plot_id: str, title: str, rows: Sequence[tuple[str, float, str]], unit: str,
              legend: Optional[Mapping[str, str]] = None, note: str = "") -> str:
    """Horizontal bars: (label, value, colour) per row, on a shared axis from 0."""
    rows = [(lab, float(v), c) for lab, v, c in rows if v is not None and math.isfinite(float(v))]
    height = 20 + ROW_H * len(rows) + 40 if rows else 60
    vmax = _nice_max(max((v for _, v, _ in rows), default=0.0))
    x0, x1 = LABEL_W, WIDTH - 70
    body = []
    for i, (label, v, color) in enumerate(rows):
        y = 10 + i * ROW_H
        w = max(1.0, (x1 - x0) * v / vmax) if v > 0 else 0.0
        body.append(f'<text x="{x0 - 6}" y="{y + 15}" text-anchor="end">{_e(label)}</text>'
                    f'<rect class="mark" x="{x0}" y="{y + 3}" width="{w:.1f}" height="{ROW_H - 6}" '
                    f'fill="{color}"><title>{_e(label)}: {_e(_fmt(v))} {_e(unit)}</title></rect>'
                    f'<text x="{x0 + w + 4:.1f}" y="{y + 15}">{_e(_fmt(v))}</text>')
    if rows:
        body.append(_x_axis(x0, x1, 12 + len(rows) * ROW_H, vmax, unit))
    return _figure(plot_id, title, "".join(body), height, len(rows), legend, note)


Dots = Sequence[tuple[float, str, str]]


def dot_chart(plot_id: str, title: str, rows: Sequence[tuple[str, Dots]], unit: str,
              legend: Optional[Mapping[str, str]] = None, note: str = "") -> str:
    """One row per label, one dot per (value, colour, tooltip): spread and outliers across a fleet;
    the row's median is a grey tick."""
    rows = [(lab, [(float(v), c, t) for v, c, t in pts if math.isfinite(float(v))])
            for lab, pts in rows]
    rows = [(lab, pts) for lab, pts in rows if pts]
    marks = sum(len(p) for _, p in rows)
    height = 20 + ROW_H * len(rows) + 40 if rows else 60
    vmax = _nice_max(max((v for _, pts in rows for v, _, _ in pts), default=0.0))
    x0, x1 = LABEL_W, WIDTH - 70
    body = []
    for i, (label, pts) in enumerate(rows):
        y = 10 + i * ROW_H + ROW_H / 2
        body.append(f'<text x="{x0 - 6}" y="{y + 4}" text-anchor="end">{_e(label)}</text>'
                    f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#eee"/>')
        med = statistics.median(v for v, _, _ in pts)
        mx = x0 + (x1 - x0) * med / vmax
        body.append(f'<line x1="{mx:.1f}" y1="{y - 8}" x2="{mx:.1f}" y2="{y + 8}" stroke="#999" '
                    f'stroke-width="2"/>')
        for v, color, tip in pts:
            x = x0 + (x1 - x0) * v / vmax
            body.append(f'<circle class="mark" cx="{x:.1f}" cy="{y}" r="5" fill="{color}" '
                        f'fill-opacity="0.85"><title>{_e(tip)}: {_e(_fmt(v))} {_e(unit)}</title>'
                        f"</circle>")
    if rows:
        body.append(_x_axis(x0, x1, 12 + len(rows) * ROW_H, vmax, unit))
    return _figure(plot_id, title, "".join(body), height, marks, legend, note)


@dataclass(frozen=True)
class Segment:
    """A node in one state from t0 to t1 (unix seconds)."""

    t0: float
    t1: float
    state: str


def _utc(ts: float, fmt: str = "%Y-%m-%d %H:%M:%SZ") -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime(fmt)


def timeline_chart(plot_id: str, title: str, lanes: Mapping[str, Sequence[Segment]],
                   failures: Mapping[str, Sequence[float]], t_min: float, t_max: float,
                   note: str = "") -> str:
    """One lane per node, coloured by state over time; confirmed failures as red ticks."""
    names = [n for n in lanes if lanes[n] or failures.get(n)]
    marks = sum(len(lanes[n]) + len(failures.get(n, ())) for n in names)
    height = 20 + ROW_H * len(names) + 40 if names else 60
    x0, x1 = LABEL_W, WIDTH - 20
    span = max(t_max - t_min, 1.0)

    def x(t: float) -> float:
        return x0 + (x1 - x0) * (min(max(t, t_min), t_max) - t_min) / span

    body = []
    for i, n in enumerate(names):
        y = 10 + i * ROW_H
        body.append(f'<text x="{x0 - 6}" y="{y + 15}" text-anchor="end">{_e(n)}</text>')
        for s in lanes[n]:
            xa, xb = x(s.t0), x(s.t1)
            body.append(f'<rect class="mark" x="{xa:.1f}" y="{y + 3}" '
                        f'width="{max(xb - xa, 2):.1f}" height="{ROW_H - 6}" '
                        f'fill="{STATE_COLORS.get(s.state, "#999")}">'
                        f"<title>{_e(n)}: {_e(s.state)} from {_e(_utc(s.t0))}</title></rect>")
        for t in failures.get(n, ()):
            xf = x(t)
            body.append(f'<line class="mark" x1="{xf:.1f}" y1="{y}" x2="{xf:.1f}" y2="{y + ROW_H}" '
                        f'stroke="{FAILURE_COLOR}" stroke-width="3"><title>{_e(n)}: confirmed '
                        f"failure at {_e(_utc(t))}</title></line>")
    if names:
        y = 12 + len(names) * ROW_H
        body.append(f'<line x1="{x0}" y1="{y}" x2="{x1}" y2="{y}" stroke="#888"/>')
        for i in range(5):
            t = t_min + span * i / 4
            anchor = "start" if i == 0 else "end" if i == 4 else "middle"
            body.append(f'<text x="{x(t):.1f}" y="{y + 16}" text-anchor="{anchor}">'
                        f'{_e(_utc(t, "%m-%d %H:%M"))}</text>')
        body.append(f'<text x="{x1}" y="{y + 30}" text-anchor="end">UTC</text>')
    legend = dict(STATE_COLORS)
    legend["confirmed failure"] = FAILURE_COLOR
    return _figure(plot_id, title, "".join(body), height, marks, legend, note)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Sequence[int] = (),
          empty: str = "none") -> str:
    """An HTML table; columns in `numeric` are right-aligned; `empty` is said when no row."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for r in rows:
        shown = ["" if c is None else c for c in r]
        cells = "".join(f'<td class="num">{_e(c)}</td>' if i in numeric else f"<td>{_e(c)}</td>"
                        for i, c in enumerate(shown))
        body.append(f"<tr>{cells}</tr>")
    if not body:
        return f'<p class="meta">{_e(empty)}</p>'
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _page(title: str, sections: Sequence[str]) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
            + "".join(sections) + "</body></html>\n")


def _badge(outcome: str) -> str:
    return (f'<span class="badge" style="background:{OUTCOME_COLORS.get(outcome, "#666")}">'
            f"{_e(outcome)}</span>")


def _series_colors(names: Iterable[str]) -> dict[str, str]:
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(sorted(set(names)))}


# --- a burn-in ------------------------------------------------------------------------------------

def load_burnin_report(path: str | Path) -> dict[str, Any]:
    """Read a `screener burnin --report` JSON file; BadInputError naming the file otherwise."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_REPORT_BYTES + 1)
    except OSError as e:
        raise BadInputError(f"{p}: cannot read: {e.strerror or e}") from None
    if len(raw) > MAX_REPORT_BYTES:
        raise BadInputError(f"{p}: larger than {MAX_REPORT_BYTES} bytes; not a burn-in report")
    try:
        data = boundedjson.strict(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadInputError(f"{p}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != "burnin":
        raise BadInputError(f"{p}: not a burn-in report (write one with screener burnin --report)")
    for key, kind in (("stages", list), ("outcome", str)):
        if not isinstance(data.get(key), kind):
            raise BadInputError(f"{p}: burn-in report without a valid {key!r}")
    return data


def _job_seconds(report: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """device -> job -> mean seconds of one run, from the known-answer screen."""
    screen = report.get("screen") or {}
    timings = screen.get("timings")
    if isinstance(timings, dict) and timings:
        return {str(d): {str(j): float(s) for j, s in (jobs or {}).items() if _num(s)}
                for d, jobs in timings.items() if isinstance(jobs, dict)}
    out: dict[str, dict[str, float]] = {}
    for r in report.get("rows") or []:
        if isinstance(r, dict) and _num(r.get("mean_seconds")):
            out.setdefault(str(r.get("device")), {})[str(r.get("job"))] = float(r["mean_seconds"])
    return out


def _num(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hbm_devices(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    for st in report.get("stages") or []:
        if isinstance(st, dict) and st.get("name") == "hbm":
            return [d for d in (st.get("data") or {}).get("devices") or [] if isinstance(d, dict)]
    return []


def burnin_html(report: Mapping[str, Any], source: str = "") -> str:
    """The HTML page of one burn-in report (the dict `screener burnin --report` writes)."""
    node = str(report.get("node") or "?")
    outcome = str(report.get("outcome") or "?")
    summary = str(report.get("summary") or "")
    # A partial burn-in is not a pass, whatever its stages did (the report's summary says so).
    badge = "partial" if summary.startswith("partial") else outcome
    stages = [s for s in report.get("stages") or [] if isinstance(s, dict)]
    # The whole run's time: the report's own "seconds" are its known-answer stage's.
    seconds = (sum(float(s.get("seconds") or 0.0) for s in stages) if stages
               else float(report.get("seconds") or 0))
    started, finished = report.get("started"), report.get("finished")
    when = f"{_utc(started)} to {_utc(finished)}" if _num(started) and _num(finished) else ""
    head = (f"<h1>Burn-in of {_e(node)} {_badge(badge)}</h1>"
            f'<p class="meta">exit {_e(report.get("exit_code"))} &middot; '
            f'{_e(report.get("burnin_kind") or "")} burn-in &middot; {_e(when)} &middot; '
            f'{_e(_fmt(seconds))} s'
            + (f" &middot; from <code>{_e(source)}</code>" if source else "") + "</p>")
    if summary:
        head += f"<p><b>{_e(summary)}</b></p>"
    missing = report.get("missing") or []
    if missing and not summary:
        head += ("<p><b>Not a full burn-in:</b> " + "; ".join(_e(m) for m in missing)
                 + ". A partial burn-in never clears a node.</p>")
    return _page(f"screener burn-in: {node}",
                 [head, _stages_section(stages), _jobs_section(report), _hbm_section(report),
                  _verdicts_section(stages), _probes_section(stages), _lifecycle_section(report)])


def _stages_section(stages: Sequence[Mapping[str, Any]]) -> str:
    """A burn-in's time per stage, coloured by outcome, and the stages' table."""
    stage_rows = [(str(s.get("name")), float(s.get("seconds") or 0.0),
                   OUTCOME_COLORS.get(str(s.get("outcome")), "#666")) for s in stages]
    sec_stages = ("<h2>Stages</h2>"
                  + bar_chart("stages", "Time per stage", stage_rows, "seconds",
                              legend={k: v for k, v in OUTCOME_COLORS.items()
                                      if any(s.get("outcome") == k for s in stages)})
                  + table(("stage", "result", "seconds", "detail"),
                          [(s.get("name"), s.get("outcome"), _fmt(float(s.get("seconds") or 0)),
                            s.get("detail", "")) for s in stages], numeric=(2,)))
    return sec_stages


def _jobs_section(report: Mapping[str, Any]) -> str:
    """The known-answer jobs: mean time per run per job and device, and the result rows."""
    per_dev = _job_seconds(report)
    colors = _series_colors(per_dev)
    jobs = sorted({j for d in per_dev.values() for j in d})
    job_rows = [(f"{j} · {d}" if len(per_dev) > 1 else j, per_dev[d][j], colors[d])
                for j in jobs for d in sorted(per_dev) if j in per_dev[d]]
    sec_jobs = ("<h2>Known-answer jobs</h2>"
                + bar_chart("job-seconds", "Mean time of one run per job and device", job_rows,
                            "seconds", legend=colors if len(per_dev) > 1 else None,
                            note="the known-answer stage did not run"))
    result_rows = [(r.get("device"), r.get("job"), r.get("runs"),
                    _fmt(float(r.get("mean_seconds") or 0)), r.get("digest"), r.get("result"),
                    r.get("where", ""))
                   for r in report.get("rows") or [] if isinstance(r, dict)]
    sec_jobs += table(("device", "job", "runs", "mean s", "digest", "result", "where"), result_rows,
                      numeric=(2, 3))
    return sec_jobs


def _hbm_section(report: Mapping[str, Any]) -> str:
    """The HBM pattern test's bandwidth and results per device."""
    hbm = _hbm_devices(report)
    hbm_rows = [(str(d.get("device")), float(d.get("bandwidth_gbps") or 0.0),
                 OUTCOME_COLORS["pass"] if d.get("ok") else OUTCOME_COLORS["suspect"]) for d in hbm]
    sec_hbm = ("<h2>Memory (HBM pattern test)</h2>"
               + bar_chart("hbm-bandwidth", "Pattern test bandwidth per device", hbm_rows, "GB/s",
                           note="the HBM stage did not run")
               + table(("device", "ok", "GiB tested", "mismatches", "GB/s", "seconds"),
                       [(d.get("device"), d.get("ok"),
                         _fmt(float(d.get("bytes_tested") or 0) / 2**30), d.get("mismatches"),
                         _fmt(float(d.get("bandwidth_gbps") or 0)), d.get("seconds"))
                        for d in hbm], numeric=(2, 3, 4, 5)))
    return sec_hbm


def _verdicts_section(stages: Sequence[Mapping[str, Any]]) -> str:
    """Every verdict of every stage that is not a pass."""
    verdicts = [v for s in stages for v in s.get("verdicts") or [] if isinstance(v, dict)]
    bad = [v for v in verdicts if v.get("outcome") != "pass"]
    sec_verdicts = ("<h2>Verdicts that are not a pass</h2>"
                    + table(("device", "outcome", "reason", "job", "step", "tensor", "expected",
                             "observed"),
                            [(v.get("device"), v.get("outcome"), v.get("reason"), v.get("job"),
                              v.get("step"), v.get("tensor"), v.get("expected"), v.get("observed"))
                             for v in bad]))
    return sec_verdicts


def _probes_section(stages: Sequence[Mapping[str, Any]]) -> str:
    """The findings of the probes before and after the load."""
    findings = [(s.get("name"), f.get("severity"), f.get("code"), f.get("gpu"), f.get("message"))
                for s in stages if str(s.get("name", "")).startswith("probes")
                for f in (s.get("data") or {}).get("findings") or [] if isinstance(f, dict)]
    sec_probes = "<h2>Probe findings</h2>" + table(("stage", "severity", "code", "gpu", "message"),
                                                   findings)
    return sec_probes


def _lifecycle_section(report: Mapping[str, Any]) -> str:
    """The node's state before and after, and the transitions the burn-in recorded."""
    trans = report.get("transitions") or []
    sec_state = ("<h2>Lifecycle</h2>"
                 f'<p class="meta">state before: {_e(report.get("state_before") or "unknown")}, '
                 f'after: {_e(report.get("state_after") or "unchanged")}</p>'
                 + table(("from", "to", "code", "reason"),
                         [(t.get("from"), t.get("to"), t.get("code"), t.get("reason"))
                          for t in trans if isinstance(t, dict)]))
    return sec_state


# --- the fleet ------------------------------------------------------------------------------------

def fleet_data(store: Any, *, now: float, days: float = 30.0, min_failures: int = 3,
               burnin_reports: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Everything the fleet report shows, as plain JSON-able data, read from `store`.

    One history read per node (a fleet-wide report, not a hot path).
    """
    since = now - days * 86400
    states = {n: s.value for n, s in store.all_states().items()}
    history: dict[str, list[dict[str, Any]]] = {}
    verdicts: dict[str, Any] = {}
    for n in sorted(states):
        history[n] = [t.to_dict() for t in store.history(n, since=since)]
        verdicts[n] = store.get_verdict(n)
    failures = store.failures(since)
    by_node, by_serial = lemon_counts(failures)
    # Time between incidents over the same window (issue 24.4), from the same failures read.
    mtbi = mtbi_by_node(failures)
    worst_first = sorted(by_node.items(), key=lambda kv: (-kv[1], kv[0]))
    lemons = [{"node": n, "failures": c, "state": states.get(n)}
              for n, c in worst_first if c >= min_failures]
    gpus = [{"serial": s, "failures": c,
             "nodes": sorted({t.node for t in failures if s in t.gpu_serials})}
            for s, c in sorted(by_serial.items(), key=lambda kv: (-kv[1], kv[0]))
            if c >= min_failures]
    job_seconds: list[dict[str, Any]] = []
    hbm: list[dict[str, Any]] = []
    for n, v in verdicts.items():
        for dv in (v or {}).get("verdicts") or []:
            if not isinstance(dv, dict):
                continue
            ev = dv.get("evidence") or {}
            for job, j in (ev.get("jobs") or {}).items():
                per_run = _per_run_seconds(j)
                if per_run is not None:
                    job_seconds.append({"node": n, "device": dv.get("device"), "job": job,
                                        "seconds_per_run": per_run, "runs": int(j["runs"])})
            if dv.get("job") == "hbm" and _num(ev.get("bandwidth_gbps")):
                hbm.append({"node": n, "device": dv.get("device"),
                            "ok": dv.get("outcome") == "pass",
                            "bandwidth_gbps": float(ev["bandwidth_gbps"]), "source": "store"})
    for rep in burnin_reports:
        for d in _hbm_devices(rep):
            if _num(d.get("bandwidth_gbps")):
                hbm.append({"node": rep.get("node"), "device": d.get("device"),
                            "ok": bool(d.get("ok")), "bandwidth_gbps": float(d["bandwidth_gbps"]),
                            "source": "burn-in report"})
    return {"now": now, "since": since, "days": days, "min_failures": min_failures,
            "states": states, "history": history, "verdicts": verdicts,
            "failures": [t.to_dict() for t in failures], "lemons": lemons, "lemon_gpus": gpus,
            "job_seconds": job_seconds, "hbm": hbm,
            "mtbi": {n: {"incidents": m["incidents"], "mtbi_s": m["mtbi_s"]}
                     for n, m in sorted(mtbi.items())}}


def _per_run_seconds(job: Any) -> Optional[float]:
    """The mean seconds of one run of a job in a verdict's evidence, or None when it does not
    say. Its "seconds" are all runs together (gemm-bf16: 6.872 s for 10 runs is 0.687 s a run):
    plotted as they are, a node that ran more repeats would look slower and a slow GPU hide."""
    if not isinstance(job, Mapping):
        return None
    runs = job.get("runs")
    if not (isinstance(runs, int) and not isinstance(runs, bool) and runs >= 1):
        return None
    if _num(job.get("seconds_per_run")):
        return float(job["seconds_per_run"])
    return float(job["seconds"]) / runs if _num(job.get("seconds")) else None


def _lanes(data: Mapping[str, Any]) -> tuple[dict[str, list[Segment]], dict[str, list[float]]]:
    now, since = float(data["now"]), float(data["since"])
    lanes: dict[str, list[Segment]] = {}
    for n in sorted(data["states"]):
        hist = sorted(data["history"].get(n) or [], key=lambda t: t["time"])
        segs: list[Segment] = []
        if not hist:
            # No change in the window: the node was in its current state throughout.
            segs.append(Segment(since, now, data["states"][n]))
        else:
            if hist[0].get("from"):
                segs.append(Segment(since, hist[0]["time"], hist[0]["from"]))
            for a, b in zip(hist, hist[1:] + [None]):
                segs.append(Segment(a["time"], b["time"] if b else now, a["to"]))
        lanes[n] = [s for s in segs if s.t1 >= s.t0]
    fails: dict[str, list[float]] = {}
    for t in data["failures"]:
        fails.setdefault(t["node"], []).append(float(t["time"]))
    return lanes, fails


def fleet_html(data: Mapping[str, Any]) -> str:
    """The HTML page of the fleet, from `fleet_data`."""
    states: dict[str, str] = data["states"]
    counts = {s: sum(1 for v in states.values() if v == s) for s in STATE_COLORS}
    head = (f"<h1>screener fleet: {len(states)} node(s)</h1>"
            f'<p class="meta">{_e(_utc(data["now"]))} &middot; window {data["days"]:g} days</p>')
    out_of_service = counts["quarantined"] + counts["repair"]
    sec_states = ("<h2>States</h2>"
                  + bar_chart("states", "Nodes per state",
                              [(s, counts[s], STATE_COLORS[s]) for s in STATE_COLORS if states],
                              "nodes",
                              note="the store knows no node")
                  + f'<p class="meta">out of service (quarantined or repair): {out_of_service} of '
                    f"{len(states)}</p>")
    lanes, fails = _lanes(data)
    sec_timeline = ("<h2>History</h2>"
                    + timeline_chart("timeline", f"States over the last {data['days']:g} days",
                                     lanes, fails, float(data["since"]), float(data["now"]),
                                     note="the store knows no node"))
    sec_lemons = (f"<h2>Lemons ({data['min_failures']}+ confirmed failures in {data['days']:g} "
                  f"days)</h2>"
                  + table(("node", "failures", "state"),
                          [(x["node"], x["failures"], x["state"] or "unknown")
                           for x in data["lemons"]], numeric=(1,), empty="no lemon node")
                  + table(("GPU serial", "failures", "nodes"),
                          [(g["serial"], g["failures"], ", ".join(g["nodes"]))
                           for g in data["lemon_gpus"]], numeric=(1,), empty="no lemon GPU"))
    by_job: dict[str, list[tuple[float, str, str]]] = {}
    for r in data["job_seconds"]:
        by_job.setdefault(r["job"], []).append(
            (r["seconds_per_run"], STATE_COLORS.get(states.get(r["node"], ""), "#666"),
             f"{r['node']} {r['device']}"))
    sec_jobs = ("<h2>Known-answer time per job</h2>"
                + dot_chart("job-seconds", "Last screen: seconds per run, one dot per device "
                            "(colour: the node's state; grey tick: median)",
                            [(j, by_job[j]) for j in sorted(by_job)], "seconds",
                            legend=STATE_COLORS, note="no node has recorded a screen"))
    hbm_rows = [(f"{h['node']} {h['device']}", h["bandwidth_gbps"],
                 OUTCOME_COLORS["pass"] if h["ok"] else OUTCOME_COLORS["suspect"])
                for h in sorted(data["hbm"], key=lambda h: (str(h["node"]), str(h["device"])))]
    sec_hbm = ("<h2>HBM bandwidth per GPU</h2>"
               + bar_chart("hbm-bandwidth", "HBM pattern test bandwidth", hbm_rows, "GB/s",
                           legend={"passed": OUTCOME_COLORS["pass"],
                                   "mismatch": OUTCOME_COLORS["suspect"]},
                           note="pass burn-in reports with --burnin-report"))
    node_rows = []
    for n in sorted(states):
        hist = data["history"].get(n) or []
        last = hist[-1] if hist else {}
        v = data["verdicts"].get(n) or {}
        m = (data.get("mtbi") or {}).get(n) or {}
        node_rows.append((n, states[n], _utc(last["time"]) if last else "-", last.get("reason", ""),
                          m.get("incidents", 0), format_mtbi(m.get("mtbi_s")),
                          v.get("outcome", "-"),
                          _utc(v["time"]) if _num(v.get("time")) else "-"))
    sec_nodes = "<h2>Nodes</h2>" + table(("node", "state", "since", "why", "incidents", "MTBI",
                                          "last screen", "screened at"), node_rows,
                                         numeric=(4,))
    return _page("screener fleet", [head, sec_states, sec_timeline, sec_lemons, sec_jobs, sec_hbm,
                                    sec_nodes])
