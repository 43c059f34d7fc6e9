"""`screener report`: the HTML of a burn-in and of the fleet, read without a browser. Every plot
must carry its data (marks sized by the values), a plot without data must say so, and the page
must be self-contained. tests/test_report_browser.py renders the same pages in Chromium."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from cli_util import screener
from fakes.fleet import BURNIN, DAY, NOW, fleet_store
from screener.output.report import burnin_html, fleet_data, fleet_html, load_burnin_report
from screener.lifecycle.records import Transition
from screener.stores.local import LocalStore
from screener.types import NodeState


class Plots(HTMLParser):
    """figure.plot -> its data-marks and the marks actually drawn (rect/circle/line.mark)."""

    def __init__(self) -> None:
        super().__init__()
        self.plots: dict[str, dict] = {}
        self._cur = None
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append((tag, a))
        if tag == "figure" and "plot" in (a.get("class") or ""):
            self._cur = a["data-plot"]
            self.plots[self._cur] = {"declared": int(a["data-marks"]), "marks": [], "text": ""}
        elif self._cur and a.get("class") == "mark":
            self.plots[self._cur]["marks"].append((tag, a))

    def handle_endtag(self, tag):
        if tag == "figure":
            self._cur = None

    def handle_data(self, data):
        if self._cur:
            self.plots[self._cur]["text"] += data


def parse(page: str) -> Plots:
    p = Plots()
    p.feed(page)
    return p


def assert_self_contained(page: str) -> None:
    p = parse(page)
    assert not [t for t, _ in p.tags if t in ("script", "link", "img", "iframe", "object")]
    assert not [a for _, a in p.tags if "src" in a or "href" in a]
    urls = set(re.findall(r"https?://[^\s\"')]+", page)) - {"http://www.w3.org/2000/svg"}
    assert not urls, urls


def test_burnin_report_plots_its_data():
    report = load_burnin_report(BURNIN)
    page = burnin_html(report)
    assert_self_contained(page)
    plots = parse(page).plots
    assert set(plots) == {"stages", "job-seconds", "hbm-bandwidth"}
    for name, p in plots.items():
        assert p["declared"] == len(p["marks"]) > 0, name
    # One bar per stage and per job, each as wide as its value on the shared axis.
    assert len(plots["stages"]["marks"]) == len(report["stages"])
    timings = report["screen"]["timings"]["cpu"]
    bars = {m[1]["title"] if "title" in m[1] else None: m for m in plots["job-seconds"]["marks"]}
    assert len(plots["job-seconds"]["marks"]) == len(timings)
    widths = [float(a["width"]) for _, a in plots["job-seconds"]["marks"]]
    ordered = [timings[j] for j in sorted(timings)]
    assert widths.index(max(widths)) == ordered.index(max(ordered))
    ratio = [w / v for w, v in zip(widths, ordered)]
    assert max(ratio) / min(ratio) < 1.01  # proportional (the 1 px minimum aside)
    bw = report["stages"][[s["name"] for s in report["stages"]].index("hbm")]["data"]["devices"]
    assert "0.083" in plots["hbm-bandwidth"]["text"] or f"{bw[0]['bandwidth_gbps']}" in page
    assert bars  # titles are inside the rect, not attributes: the marks still exist
    assert "no_golden" in page and "Not a full burn-in" in page


def test_burnin_report_without_hbm_says_so():
    report = load_burnin_report(BURNIN)
    report["stages"] = [s for s in report["stages"] if s["name"] != "hbm"]
    plots = parse(burnin_html(report)).plots
    assert plots["hbm-bandwidth"]["declared"] == 0 and not plots["hbm-bandwidth"]["marks"]
    assert "no data" in plots["hbm-bandwidth"]["text"]


def test_fleet_report_reads_the_store(tmp_path):
    store = fleet_store(tmp_path / "s.db")
    data = fleet_data(store, now=NOW, days=30, min_failures=3,
                      burnin_reports=[load_burnin_report(BURNIN)])
    assert data["states"] == {"gpu-a": "healthy", "gpu-b": "healthy", "gpu-c": "repair",
                              "gpu-d": "suspect", "gpu-e": "healthy"}
    assert [x["node"] for x in data["lemons"]] == ["gpu-c"]
    assert [g["serial"] for g in data["lemon_gpus"]] == ["S1"]
    assert len(data["job_seconds"]) == 4 * 2 * 2
    assert {(h["node"], h["source"]) for h in data["hbm"]} == {
        ("gpu-a", "store"), ("gpu-b", "store"), ("gpu-d", "store"), ("gpu-e", "store"),
        ("vm", "burn-in report")}
    json.dumps(data)  # plain data (the --json output)

    page = fleet_html(data)
    assert_self_contained(page)
    plots = parse(page).plots
    assert set(plots) == {"states", "timeline", "job-seconds", "hbm-bandwidth"}
    for name, p in plots.items():
        assert p["declared"] == len(p["marks"]) > 0, name
    # States: one bar per state, widths by count (3 healthy, 1 suspect, 1 repair, 0 others).
    from screener.output.report import STATE_COLORS
    widths = dict(zip(STATE_COLORS, (float(a["width"]) for _, a in plots["states"]["marks"])))
    assert widths["burnin"] == widths["quarantined"] == 0
    assert widths["healthy"] == 3 * widths["suspect"] == 3 * widths["repair"] > 0
    # Timeline: burnin and healthy on every node, five more states on gpu-c, one on gpu-d; a tick
    # per confirmed failure (three on gpu-c, one on gpu-d).
    segs = [a for t, a in plots["timeline"]["marks"] if t == "rect"]
    ticks = [a for t, a in plots["timeline"]["marks"] if t == "line"]
    assert len(ticks) == 4 and len(segs) == 5 * 2 + 5 + 1
    assert len([a for t, a in plots["job-seconds"]["marks"] if t == "circle"]) == 16
    assert len(plots["hbm-bandwidth"]["marks"]) == 5


def test_fleet_seconds_are_per_run_in_the_json_and_the_plot(tmp_path):
    # A verdict's evidence holds the seconds of all runs together: 6.872 s for 10 runs of
    # gemm-bf16 is 0.687 s a run, and a node that ran one run of 0.7 s is the slower (issue 25.3).
    s = LocalStore(tmp_path / "s.db")
    for node, jobs in (("many", {"gemm-bf16": {"seconds": 6.872, "runs": 10}}),
                       ("one", {"gemm-bf16": {"seconds": 0.7, "runs": 1}}),
                       ("new", {"gemm-bf16": {"seconds": 9.0, "seconds_per_run": 0.9,
                                              "runs": 10}}),
                       ("old", {"gemm-bf16": {"seconds": 5.0}})):  # runs unknown: not plotted
        s.record(Transition(node, NOW - DAY, None, NodeState.HEALTHY, "t"))
        s.set_verdict(node, {"time": NOW - DAY, "outcome": "pass", "verdicts": [
            {"device": "cuda:0", "outcome": "pass", "job": "", "evidence": {"jobs": jobs}}]})
    data = fleet_data(s, now=NOW, days=30)
    per_run = {r["node"]: r["seconds_per_run"] for r in data["job_seconds"]}
    assert per_run == pytest.approx({"many": 0.6872, "one": 0.7, "new": 0.9})
    assert all("seconds" not in r for r in data["job_seconds"])  # no total under another name
    r = screener("report", "fleet", "--json", "--db", str(tmp_path / "s.db"), "--days", "30")
    assert r.returncode == 0, r.stderr
    assert {x["node"]: x["seconds_per_run"] for x in json.loads(r.stdout)["job_seconds"]} \
        == pytest.approx({"many": 0.6872, "one": 0.7, "new": 0.9})
    dots = parse(fleet_html(data)).plots["job-seconds"]
    assert "0.687 seconds" in dots["text"] and "6.87" not in dots["text"], dots["text"]


def test_fleet_report_of_an_empty_store_says_no_data(tmp_path):
    store = LocalStore(tmp_path / "empty.db")
    plots = parse(fleet_html(fleet_data(store, now=NOW))).plots
    for name, p in plots.items():
        assert p["declared"] == 0 and not p["marks"] and "no data" in p["text"], name


def test_report_commands_write_files_and_refuse_bad_input(tmp_path):
    out = tmp_path / "b.html"
    r = screener("report", "burnin", str(BURNIN), "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "<svg" in out.read_text()
    (tmp_path / "x.json").write_text('{"kind": "screen"}')
    (tmp_path / "y.json").write_text("{not json")
    for bad in ("x.json", "y.json", "missing.json"):
        r = screener("report", "burnin", str(tmp_path / bad), "-o", str(tmp_path / "z.html"))
        assert r.returncode == 2, (bad, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and bad in r.stderr and "Traceback" not in r.stderr
    # the same through the real process: its stderr holds that one line and no traceback
    r = subprocess.run([sys.executable, "-m", "screener.cli", "report", "burnin",
                        str(tmp_path / "y.json"), "-o", str(tmp_path / "z.html")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "y.json" in r.stderr, r.stderr
    assert not (tmp_path / "z.html").exists()
    fleet_store(tmp_path / "f.db").close()
    r = screener("report", "fleet", "--db", str(tmp_path / "f.db"), "--store", "local", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["states"]["gpu-c"] == "repair"
    r = screener("report", "fleet", "--db", str(tmp_path / "f.db"), "--store", "local",
                 "-o", str(tmp_path / "f.html"), "--burnin-report", str(BURNIN))
    assert r.returncode == 0, r.stderr
    assert 'data-plot="timeline"' in (tmp_path / "f.html").read_text()


def test_burnin_report_of_several_gpus_has_a_bar_per_job_and_device():
    report = load_burnin_report(BURNIN)
    cpu = report["screen"]["timings"]["cpu"]
    report["screen"]["timings"] = {f"cuda:{g}": {j: s * (1 + g) for j, s in cpu.items()}
                                   for g in range(4)}
    page = burnin_html(report)
    p = parse(page).plots["job-seconds"]
    assert p["declared"] == len(p["marks"]) == 4 * len(cpu)
    assert all(f"cuda:{g}" in page for g in range(4)) and 'class="legend"' in page
    widths = [float(a["width"]) for _, a in p["marks"]]
    # Bars are ordered job by job, device by device: cuda:3 took four times as long as cuda:0.
    assert widths[3] == pytest.approx(4 * widths[0], rel=0.01)


class _Rows(HTMLParser):
    """Every table row's cells, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_fleet_report_has_each_nodes_incidents_and_mtbi(tmp_path):
    """The MTBI column (issue 24.4) over the report's window, through the command: gpu-c failed
    10, 5 and 4.5 days ago (a mean gap of 2.75 days), gpu-d once (no gap), the others never."""
    from screener.commands.context import AppContext

    fleet_store(tmp_path / "f.db").close()
    ctx = AppContext(clock=lambda: NOW)
    r = screener("report", "fleet", "--db", str(tmp_path / "f.db"), "--store", "local", "--json",
                 obj=ctx)
    assert r.returncode == 0, r.stderr
    mtbi = json.loads(r.stdout)["mtbi"]
    assert mtbi == {"gpu-c": {"incidents": 3, "mtbi_s": 2.75 * DAY},
                    "gpu-d": {"incidents": 1, "mtbi_s": None}}
    r = screener("report", "fleet", "--db", str(tmp_path / "f.db"), "--store", "local",
                 "-o", str(tmp_path / "f.html"), obj=ctx)
    assert r.returncode == 0, r.stderr
    rows = _Rows()
    rows.feed((tmp_path / "f.html").read_text())
    head = next(row for row in rows.rows if row[:2] == ["node", "state"] and "MTBI" in row)
    nodes = {row[0]: dict(zip(head, row)) for row in rows.rows if row and row[0].startswith("gpu-")
             and len(row) == len(head)}
    assert (nodes["gpu-c"]["incidents"], nodes["gpu-c"]["MTBI"]) == ("3", "2.8 d")
    assert (nodes["gpu-d"]["incidents"], nodes["gpu-d"]["MTBI"]) == ("1", "-")
    assert (nodes["gpu-a"]["incidents"], nodes["gpu-a"]["MTBI"]) == ("0", "-")
    # Out of the window, no incident counts: 40 days on, gpu-c's failures are all older than 30.
    later = json.loads(screener("report", "fleet", "--db", str(tmp_path / "f.db"), "--store",
                                "local", "--json", obj=AppContext(clock=lambda: NOW + 40 * DAY)
                                ).stdout)
    assert later["mtbi"] == {}
