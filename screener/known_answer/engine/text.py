"""The text output of a screen: the verdict table `screener kat run` and the burn-in print."""

from __future__ import annotations

from screener.known_answer.verdict.judgment import ScreenResult
from screener.types import KnownAnswerReason, Outcome, Verdict


def _verdict_lines(v: Verdict) -> list[str]:
    """A verdict's row, then what differs, the detail, the record command, sibling goldens."""
    where = ""
    if v.job:
        where = v.job
        if v.step is not None:
            where += f" step {v.step} {v.tensor}"
    lines = [f"{v.device:10s} {v.outcome.value:13s} {v.reason or '-':28s} {where}"]
    if v.expected is not None or v.observed is not None:
        lines.append(f"{'':10s}   expected {v.expected}  observed {v.observed}")
    detail = v.evidence.get("detail")
    if detail and v.outcome != Outcome.PASS and v.reason != KnownAnswerReason.NO_GOLDEN:
        lines.append(f"{'':10s}   {detail}")
    if v.evidence.get("command"):
        lines.append(f"{'':10s}   record a golden: {v.evidence['command']}")
    kin = sorted({j["golden"] for j in v.evidence.get("jobs", {}).values() if j.get("sibling")})
    if kin:
        lines.append(f"{'':10s}   matched sibling platform golden(s): {', '.join(kin)}")
    return lines


def format_verdicts(result: ScreenResult) -> str:
    """A human-readable table of verdicts and a summary line."""
    lines = [f"{'device':10s} {'outcome':13s} {'reason':28s} where"]
    for v in result.verdicts:
        lines += _verdict_lines(v)
    lines.append(f"{result.outcome.value} (exit {int(result.exit_code)}): {len(result.jobs)} job(s) "
                 f"on {len(result.verdicts)} device(s) in {result.seconds:.1f} s")
    return "\n".join(lines)
