"""Progress of a command that takes time, on stderr: a bar on a terminal, lines elsewhere.

Every command that can run longer than a few seconds (kat run, golden record, burnin and its
stages, drill) reports through one `Progress`:
- on a terminal, one bar redrawn in place:
  `[#####-----] known-answer 12/80 job runs 14.2 s  cpu gemm-fp32 #1`;
- on anything else (a log file, a pod's log, a pipe), one line per finished item or stage, each
  with the elapsed time, so a log shows where a long run is: `screener: known-answer: 12/80
  done, cpu gemm-fp32 #1 (14.2 s)`; with `json=True` the same as one JSON object a line
  (`{"event": "progress", "stage": ..., "done": ..., "total": ..., "item": ..., "elapsed_s": ...}`)
  for commands whose output is JSON.
A stage whose work reports nothing for a while (a peer burn-in's DDP training, the drill's) gets
a heartbeat: with `heartbeat_s`, a "running" line (or a redrawn bar) whenever that many seconds
pass without one, so a log never goes silent for long. Results never go here: they are stdout's.
The clock and the stream are passed in (tests).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional, TextIO

BAR_WIDTH = 30
LINE_WIDTH = 120
HEARTBEAT_S = 10.0  # the CLI's: no stage goes silent for longer


class Progress:
    """Progress of one command: stages, each with items done out of an optional total.

    begin(stage, total) starts a stage, step(item) finishes one item of it, note(text) says
    something about it without counting, end(detail) finishes it. On a terminal the bar is
    redrawn at each call; elsewhere begin, step and end each write one line with the elapsed time
    (since the stage began, and since the command began at the end).
    """

    def __init__(self, stream: Optional[TextIO] = None, *, tty: Optional[bool] = None,
                 json_lines: bool = False, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "screener",
                 heartbeat_s: Optional[float] = None, t0: Optional[float] = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = (bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None
                    else tty)
        self.json = json_lines
        self.enabled = enabled
        self.clock = clock
        self.prefix = prefix
        # t0: when the command began on `clock` (the CLI passes screener.output.wall.started(),
        # so "in all" is the wall time since the command started); default now.
        self.t0 = clock() if t0 is None else t0
        self.stage: Optional[str] = None
        self.stage_t0 = self.t0
        self.done = 0
        self.total: Optional[int] = None
        self.unit = ""
        self.item = ""
        self._drawn = False
        self._lock = threading.RLock()  # the heartbeat thread writes too
        self._last_emit = self.t0
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        if heartbeat_s is not None and enabled:
            self._beat = threading.Thread(target=self._heartbeat, args=(heartbeat_s,),
                                          name="progress-heartbeat", daemon=True)
            self._beat.start()

    # --- what callers say ---------------------------------------------------------------------

    def begin(self, stage: str, total: Optional[int] = None, unit: str = "") -> None:
        """A stage starts (ending the one under way, if any); `unit` names what it counts."""
        with self._lock:
            if self.stage is not None:
                self.end()
            self.stage, self.total, self.done, self.item, self.unit = stage, total, 0, "", unit
            self.stage_t0 = self.clock()
            self._emit("begin")

    def announce(self, text: str) -> None:
        """A line before any stage: a command prints one at once, before its heavy imports
        (torch takes seconds to load on a cold machine), so its log never starts silent."""
        if not self.enabled:
            return
        with self._lock:
            self._last_emit = self.clock()
            since = self.clock() - self.t0
            if self.json:
                self.stream.write(json.dumps({"event": "progress", "kind": "start",
                                              "stage": None, "item": text,
                                              "elapsed_s": round(since, 1)}) + "\n")
            elif self.tty:
                self.stream.write("\r" + f"{text} {since:.1f} s"[:LINE_WIDTH].ljust(LINE_WIDTH))
                self._drawn = True
            else:
                self.stream.write(f"{self.prefix}: {text} ({since:.1f} s)\n")
            self.stream.flush()

    def step(self, item: str = "", n: int = 1) -> None:
        """`n` more items of the stage are done; `item` names the last one."""
        with self._lock:
            self.done += n
            self.item = item
            self._emit("step")

    def note(self, text: str) -> None:
        """Something worth a line (a device timed out, a stage measured a figure)."""
        with self._lock:
            self.item = text
            self._emit("note")

    def end(self, detail: str = "") -> None:
        """The stage under way is finished."""
        with self._lock:
            if self.stage is None:
                return
            self.item = detail
            self._emit("end")
            self.stage = None

    def close(self) -> None:
        """End the stage under way and leave the terminal's cursor on a fresh line."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
        self.end()
        if self.tty and self._drawn and self.enabled:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- how it shows -------------------------------------------------------------------------

    def elapsed(self) -> float:
        """Seconds since the stage under way began."""
        return self.clock() - self.stage_t0

    def bar(self) -> str:
        """The terminal's one line for the current state."""
        frac = min(self.done / self.total, 1.0) if self.total else 0.0
        fill = int(frac * BAR_WIDTH)
        count = (f"{self.done}/{self.total}" if self.total else f"{self.done}") + (
            f" {self.unit}" if self.unit else "")
        return (f"[{'#' * fill}{'-' * (BAR_WIDTH - fill)}] {self.stage or ''} {count} "
                f"{self.elapsed():6.1f} s  {self.item}")[:LINE_WIDTH]

    def line(self, kind: str) -> str:
        """The non-terminal line for one call (text or JSON)."""
        elapsed = round(self.elapsed(), 1)
        if self.json:
            d: dict[str, Any] = {"event": "progress", "kind": kind, "stage": self.stage,
                                 "done": self.done, "total": self.total, "unit": self.unit,
                                 "item": self.item, "elapsed_s": elapsed}
            if kind == "end":
                d["total_elapsed_s"] = round(self.clock() - self.t0, 1)
            return json.dumps(d)
        count = (f"{self.done}/{self.total}" if self.total else f"{self.done}") + (
            f" {self.unit}" if self.unit else "")
        item = f", {self.item}" if self.item else ""
        if kind == "begin":
            text = "started" + (f", {self.total} {self.unit or 'to do'}" if self.total else "")
        elif kind == "step":
            text = f"{count} done{item}"
        elif kind == "note":
            text = self.item
        elif kind == "beat":
            text = f"running, {count} done" if self.done else "running"
        else:
            text = (f"finished, {count} done{item}" if self.done else f"finished{item}")
        tail = (f" ({elapsed:.1f} s, {self.clock() - self.t0:.1f} s in all)" if kind == "end"
                else f" ({elapsed:.1f} s)")
        return f"{self.prefix}: {self.stage}: {text}{tail}"

    def _heartbeat(self, interval: float) -> None:
        while not self._stop.wait(min(interval, 1.0)):
            with self._lock:
                if self.stage is not None and self.clock() - self._last_emit >= interval:
                    self._emit("beat")

    def _emit(self, kind: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._last_emit = self.clock()
            self._write(kind)

    def _write(self, kind: str) -> None:
        if self.tty:
            self.stream.write("\r" + self.bar().ljust(LINE_WIDTH))
            self._drawn = True
            if kind == "end":
                self.stream.write("\n")
                self._drawn = False
        else:
            self.stream.write(self.line(kind) + "\n")
        self.stream.flush()


class JobEvents:
    """Feeds a Progress from the child events of screener.known_answer.engine.screen.execute (its `progress=` callback):
    a step per finished job run, a note per timeout or error. `stage` names the stage it opens
    at once; None counts within the stage under way (a burn-in's known-answer stage), giving it
    `total`."""

    def __init__(self, progress: Progress, stage: Optional[str],
                 total: Optional[int] = None) -> None:
        self.progress, self.stage_name = progress, stage
        # The stage starts now, not at the first event: starting the children takes seconds.
        if stage is not None or progress.stage is None:
            progress.begin(stage or "known-answer", total, unit="job runs")
        else:
            progress.total, progress.unit = total, "job runs"

    def __call__(self, event: Mapping[str, Any]) -> None:
        kind = event.get("event")
        if kind == "result":
            result = event.get("result") or {}
            job = event.get("job") or (result.get("job") if isinstance(result, Mapping) else "")
            self.progress.step(f"{event.get('device')} {job or ''} #{event.get('iteration', '')}")
        elif kind in ("timeout", "error"):
            self.progress.note(f"{event.get('device')}: {kind}")

    def close(self) -> None:
        """End the stage (the known-answer runs are over)."""
        self.progress.end()
