"""screener.output.progress: the bar on a terminal, the timed lines elsewhere (text and JSON), the
known-answer events it is fed, and the HBM stage's per-pattern steps."""

from __future__ import annotations

import io
import json
import threading

from fakes.clock import FakeClock
from screener.health.sources.hbm import hbm_test
from screener.output.progress import BAR_WIDTH, JobEvents, Progress


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_not_a_terminal_one_line_per_stage_and_item_with_elapsed_time():
    out, clock = io.StringIO(), FakeClock(100.0)
    p = Progress(out, tty=False, clock=clock, prefix="burn-in")
    p.begin("known-answer", 2, unit="job runs")
    clock.t += 1.5
    p.step("cpu gemm-fp32 #0")
    clock.t += 2.0
    p.step("cpu gemm-fp32 #1")
    p.begin("hbm")  # ends the stage under way
    clock.t += 0.25
    p.note("cpu: 0.06 GiB")
    p.close()
    assert _lines(out) == [
        "burn-in: known-answer: started, 2 job runs (0.0 s)",
        "burn-in: known-answer: 1/2 job runs done, cpu gemm-fp32 #0 (1.5 s)",
        "burn-in: known-answer: 2/2 job runs done, cpu gemm-fp32 #1 (3.5 s)",
        "burn-in: known-answer: finished, 2/2 job runs done (3.5 s, 3.5 s in all)",
        "burn-in: hbm: started (0.0 s)",
        "burn-in: hbm: cpu: 0.06 GiB (0.2 s)",
        "burn-in: hbm: finished (0.2 s, 3.8 s in all)",
    ]
    assert "\r" not in out.getvalue()


def test_json_lines_are_machine_readable():
    out, clock = io.StringIO(), FakeClock(100.0)
    p = Progress(out, tty=False, json_lines=True, clock=clock)
    p.begin("drill stage")
    clock.t += 4.0
    p.end("done")
    a, b = (json.loads(x) for x in _lines(out))
    assert a == {"event": "progress", "kind": "begin", "stage": "drill stage", "done": 0,
                 "total": None, "unit": "", "item": "", "elapsed_s": 0.0}
    assert (b["kind"], b["elapsed_s"], b["total_elapsed_s"], b["item"]) == ("end", 4.0, 4.0, "done")


def test_a_terminal_gets_one_bar_redrawn_in_place():
    out, clock = io.StringIO(), FakeClock(100.0)
    p = Progress(out, tty=True, clock=clock)
    p.begin("known-answer", 4, unit="job runs")
    p.step("cpu a #0")
    clock.t += 2
    p.step("cpu b #0")
    text = out.getvalue()
    assert "\n" not in text and text.count("\r") == 3
    last = text.rsplit("\r", 1)[1]
    half = BAR_WIDTH // 2
    bar = "[" + "#" * half + "-" * (BAR_WIDTH - half) + "]"
    assert last.startswith(bar + " known-answer 2/4 job runs")
    assert "2.0 s  cpu b #0" in last
    p.close()
    assert out.getvalue().endswith("\n") and out.getvalue().count("\n") == 1


def test_disabled_writes_nothing():
    out = io.StringIO()
    with Progress(out, tty=False, enabled=False) as p:
        p.begin("x", 1)
        p.step("y")
    assert out.getvalue() == ""


def test_job_events_count_results_and_note_timeouts():
    # the events screener.known_answer.engine.screen.execute hands its progress callback (a child's, with "device")
    out, clock = io.StringIO(), FakeClock(100.0)
    p = Progress(out, tty=False, clock=clock)
    feed = JobEvents(p, "known-answer", total=2)
    feed({"event": "platform", "device": "cpu", "platform_hash": "x"})
    feed({"event": "start", "device": "cpu", "job": "gemm-fp32", "iteration": 0})
    clock.t += 1
    feed({"event": "result", "device": "cpu", "iteration": 0, "result": {"job": "gemm-fp32"}})
    feed({"event": "timeout", "device": "cuda:1"})
    feed.close()
    assert _lines(out) == [
        "screener: known-answer: started, 2 job runs (0.0 s)",
        "screener: known-answer: 1/2 job runs done, cpu gemm-fp32 #0 (1.0 s)",
        "screener: known-answer: cuda:1: timeout (1.0 s)",
        "screener: known-answer: finished, 1/2 job runs done (1.0 s, 1.0 s in all)",
    ]
    # inside a burn-in the known-answer stage is already open: the feed only counts in it
    out2 = io.StringIO()
    p2 = Progress(out2, tty=False, clock=clock)
    p2.begin("known-answer burn-in")
    JobEvents(p2, None, total=8)({"event": "result", "device": "cpu", "iteration": 3,
                                  "result": {"job": "conv-fp32"}})
    assert _lines(out2)[-1].startswith("screener: known-answer burn-in: 1/8 job runs done, "
                                       "cpu conv-fp32 #3")


def test_the_hbm_test_reports_each_pattern():
    seen: list[str] = []
    r = hbm_test("cpu", max_bytes=1 << 16, progress=seen.append)
    assert r.ok and len(seen) == len(r.patterns)
    assert seen[0] == f"cpu pattern {r.patterns[0]}: 0 mismatches so far"


class _Watched(io.StringIO):
    """A stream that says when a line containing `marker` has been written."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.seen = threading.Event()

    def write(self, s: str) -> int:
        n = super().write(s)
        if self.marker in s:
            self.seen.set()
        return n


def test_a_silent_stage_gets_heartbeat_lines():
    out = _Watched("running")
    p = Progress(out, tty=False, heartbeat_s=0.05, prefix="drill")
    p.begin("training")
    assert out.seen.wait(10), "no heartbeat line"
    p.close()
    lines = _lines(out)
    assert lines[0] == "drill: training: started (0.0 s)"
    assert any(x.startswith("drill: training: running (") for x in lines[1:-1])
    assert lines[-1].startswith("drill: training: finished (")
    # Closed: the heartbeat thread is gone (joined), so no line can follow.
    assert not [t for t in threading.enumerate() if t.name == "progress-heartbeat"]
