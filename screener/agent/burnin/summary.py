"""The last lines of `screener burnin`: what passed, in words, and what a full burn-in would add.

A burn-in's table ends in one `overall:` line (the JSON's `summary` and the exit code). When every
stage passed, the lines just above it say what was checked ("passed: health probes before and
after; 8 known-answer jobs x 10 runs on cpu, bit for bit equal to their golden records; memory
pattern test (0.06 GiB)") and, for a run short of a full burn-in, what a full one adds and the
command that runs it, so that a short run whose every check passed reads as the success it is,
whatever its exit code says about the node (4: it stays in burnin; 0 for `--quick`, which keeps
no node state). When a stage did not pass these lines are left out: the tables above say what
went wrong and the `overall:` line says what it means.

Pure text from a FullBurninReport (screener.agent.burnin.full); no I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from screener.types import Outcome

if TYPE_CHECKING:
    from screener.agent.burnin.full import FullBurninReport

# missing_for_full's words for a run shorter than the required time (screener.agent.burnin.full).
SHORT_RUN = "the known-answer jobs ran "

QUICK_SUMMARY = "pass: quick screen, every check passed; no node state kept"


def passed_lines(report: "FullBurninReport") -> list[str]:
    """`passed: ...` and, when the run was not a full burn-in, `a full burn-in adds ...`; no
    lines unless every stage passed."""
    if report.outcome != Outcome.PASS or not report.stages:
        return []
    lines = ["passed: " + "; ".join(passed_parts(report))]
    if report.missing:
        lines.append(full_adds(report))
    return lines


def node_line(report: "FullBurninReport") -> Optional[str]:
    """The node line of a run that kept no node state (a quick screen, --store none), None for
    one that did (the caller prints the states before and after)."""
    if report.state_before is not None or report.state_after is not None or report.transitions:
        return None
    why = "a quick screen" if report.quick else "--store none"
    return f"node {report.node}: no node state kept ({why})"


def passed_parts(report: "FullBurninReport") -> list[str]:
    """What each stage that ran checked, in the order they ran."""
    by = {s.name: s for s in report.stages}
    parts = []
    probes = [when for when, name in (("before", "probes-before"), ("after", "probes-after"))
              if name in by]
    if probes:
        parts.append(f"health probes {' and '.join(probes)}")
    if report.known_answer is not None:
        parts.append(known_answer_words(report.known_answer.screen))
    if "hbm" in by:
        tested = sum(int(d.get("bytes_tested") or 0) for d in by["hbm"].data.get("devices") or ()
                     if isinstance(d, Mapping))
        parts.append(f"memory pattern test ({tested / 2**30:.2f} GiB)")
    for name, words in (("collective", "all-reduce across the devices"),
                        ("crosscheck", "cross-check with same-platform nodes"),
                        ("peers", "peer burn-in")):
        if name in by:
            parts.append(f"{words} ({by[name].detail})" if by[name].detail else words)
    return parts


def known_answer_words(screen: Any) -> str:
    """'8 known-answer jobs x 10 runs on cpu, bit for bit equal to their golden records'."""
    devices = [v.device for v in screen.verdicts]
    counts = sorted({int(n) for n in screen.iterations.values()})
    runs = (f" x {_plural(counts[0], 'run')}" if len(counts) == 1
            else f" x {counts[0]}-{counts[-1]} runs" if counts else "")
    jobs: Sequence[Mapping[str, Any]] = [
        j for v in screen.verdicts for j in (v.evidence.get("jobs") or {}).values()
        if isinstance(j, Mapping)]
    golden = [j for j in jobs if j.get("golden")]
    if jobs and len(golden) == len(jobs):
        reference = "bit for bit equal to their golden records"
        sibling = sum(1 for j in golden if j.get("sibling"))
        if sibling:
            reference += f" ({sibling} of them a sibling platform's)"
    elif golden:
        reference = (f"bit for bit equal to their golden records ({len(golden)} of {len(jobs)}) "
                     f"or else to the agreeing runs of their peers")
    else:
        reference = "bit for bit equal across their runs and devices (no golden record)"
    return (f"{_plural(len(screen.jobs), 'known-answer job')}{runs} on {', '.join(devices)}, "
            f"{reference}")


def full_adds(report: "FullBurninReport") -> str:
    """'a full burn-in adds 1 h of these jobs under sustained load (here: 3 s) and, when it
    passes, moves this node to healthy: screener burnin --duration 1h'."""
    known_answer = next((s for s in report.stages if s.name == "known-answer"), None)
    ran = float((known_answer.data.get("seconds") if known_answer is not None else 0.0) or 0.0)
    adds = []
    if any(m.startswith(SHORT_RUN) for m in report.missing):
        adds.append(f"{duration_words(report.required_seconds)} of these jobs under sustained "
                    f"load (here: {ran:.0f} s)")
    rest = [m for m in report.missing if not m.startswith(SHORT_RUN)]
    if rest:
        adds.append(f"what else this run lacked ({'; '.join(rest)})")
    where = "this node" if report.state_after is None else f"node {report.node}"
    return (f"a full burn-in adds {', '.join(adds)} and, when it passes, moves {where} to "
            f"healthy: screener burnin --duration {duration_flag(report.required_seconds)}")


def duration_words(seconds: float) -> str:
    """3600 -> '1 h', 600 -> '10 min', 90 -> '90 s'."""
    if seconds >= 3600 and seconds % 360 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def duration_flag(seconds: float) -> str:
    """A --duration that screener.settings.durations reads back as `seconds`: 1h, 10m, 90s."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g}h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
