"""A device whose repeats of a job disagree (pure): suspect, or inconclusive, never our bug.

Different bits from one device across runs of a deterministic job are the commonest silent
data corruption, so the verdict never depends on the device's own majority (a unit that is
wrong in four runs of five is as bad as one wrong in one of five). What decides is whether the
job is shown deterministic on the device's platform by something other than the device itself:

- a reference (screener.known_answer.verdict.reference): the platform's golden, a quorum of other nodes
  of the platform (screener.known_answer.verdict.quorum), a sibling golden a run reproduces, a majority of the platform's devices that each reproduced themselves, or this
  node's earlier screens reproduced today;
- another device of the platform in this screen that reproduced itself (two or more runs, one
  result), or another node of the platform that did (its published candidates, even fewer than a
  quorum);
- this node's earlier screens of the platform (known-digests.json): a device that reproduced
  itself there, even when no run of today reproduces its digest.

With any of these the device is suspect (`self_mismatch`, with counts). With none at all a
faulty device cannot be told from a nondeterministic job: the verdict is inconclusive (exit 3)
and says what would settle it (a golden recorded on a trusted node, or another device of the
platform screened). It is never "a screener bug" (exit 1): exit 1 is kept for failures of our
own code, which a child reports as such (screener.known_answer.engine.child).

In every verdict `expected` is the value of what settles it (the reference, or the peer that
reproduced itself when a run reproduces it), else the result most of the device's runs gave;
`observed` is the first run that differs from it, whichever repeat that is.
"""

from __future__ import annotations

from typing import Optional

from screener.known_answer.verdict.reference import JobGroup
from screener.known_answer.verdict.results import JobResult, first_difference
from screener.known_answer.verdict.runs import JobRuns
from screener.known_answer.verdict.screen_result import Issue, record_command
from screener.types import KnownAnswerReason, Outcome


def self_mismatch_issue(g: JobGroup, device: str, golden_dir: Optional[str]) -> Issue:
    """The issue of a device whose runs of the job gave more than one result."""
    runs = g.results[device]
    ref = g.reference
    if ref is not None and ref.steps is not None:
        return _against_reference(g, runs)
    expected, settled_by = _settling_result(g, device)
    evidence = _evidence(g, device)
    it, bad = _first_other(runs, expected)
    counts = _counts(runs, expected)
    diff = first_difference(expected.steps, bad.steps)
    if evidence is None:
        return Issue(Outcome.INCONCLUSIVE, KnownAnswerReason.SELF_MISMATCH, g.job, diff, detail=(
            f"{counts}; nothing shows the job is deterministic on platform {g.phash} (no golden, "
            f"no other device or earlier screen of the platform that reproduced itself), so a "
            f"faulty device cannot be told from a nondeterministic job; expected is {settled_by}. "
            f"To settle it, record a golden for the platform on a node you trust "
            f"({record_command([g.job], g.members, golden_dir)}), or screen another device "
            f"of it"))
    return Issue(Outcome.SUSPECT, KnownAnswerReason.SELF_MISMATCH, g.job, diff, detail=(
        f"{counts}; the job is deterministic on platform {g.phash}: {evidence}; expected is "
        f"{settled_by}"))


def _against_reference(g: JobGroup, runs: JobRuns) -> Issue:
    """Against a reference (golden, sibling golden, majority, earlier screens reproduced)."""
    ref = g.reference
    assert ref is not None and ref.steps is not None
    results = runs.results()
    wrong = [(it, r) for it, r in results if not ref.matches(r)] or [runs.first_mismatch()]
    right = sum(c for dg, c in runs.counts.items()
                if any(r.digest == dg and ref.matches(r) for _, r in results))
    it, bad = wrong[0]
    # Wrong in every run is a golden (quorum, majority) mismatch, told by its own name.
    reason = (KnownAnswerReason.SELF_MISMATCH if right else
              KnownAnswerReason.GOLDEN_MISMATCH if ref.record is not None else
              KnownAnswerReason.QUORUM_MISMATCH if ref.source == "quorum" else
              KnownAnswerReason.PEER_MISMATCH)
    return Issue(Outcome.SUSPECT, reason, g.job, first_difference(ref.steps, bad.steps),
                 detail=f"{runs.runs - right} of {runs.runs} runs differ from the "
                        f"{ref.source} (first: iteration {it}; {len(runs.counts)} "
                        f"different results); "
                        + (f"{right} run(s) reproduce it" if right else "no run reproduces it"))


def _steady_peers(g: JobGroup, device: str) -> list[str]:
    """The platform's other devices in this screen that reproduced themselves."""
    return [p for p, r in g.results.items() if p != device and r.runs >= 2 and r.consistent]


def _evidence(g: JobGroup, device: str) -> Optional[str]:
    """What, other than the device itself, shows the job deterministic on its platform."""
    peers = _steady_peers(g, device)
    if peers:
        r = g.results[peers[0]]
        return (f"{len(peers)} other device(s) reproduced themselves (e.g. {peers[0]}, "
                f"{r.runs} runs, digest {r.reference.digest})")
    if g.quorum is not None and g.quorum.digest is not None:
        return g.quorum.describe()
    if g.quorum is not None and g.quorum.nodes:
        # Fewer than a quorum, but another node's device reproduced the job on the platform
        # (only reproduced results are published): the job is deterministic there.
        return (f"{len(g.quorum.nodes)} other node(s) of the platform reproduced it (e.g. "
                f"{g.quorum.nodes[0]}, digest {g.quorum.leader})")
    if g.known is not None:
        return (f"this node's earlier screens reproduced digest {g.known} on it"
                + ("" if _reproduces(g.results[device], g.known) else ", which no run reproduces"))
    return None


def _settling_result(g: JobGroup, device: str) -> tuple[JobResult, str]:
    """What `expected` is: a steady peer's result that a run reproduces, else the result most
    of the device's runs gave (iteration 0's on a tie), and how to say so."""
    runs = g.results[device]
    for p in _steady_peers(g, device):
        digest = g.results[p].reference.digest
        same = next((r for _, r in runs.results() if r.digest == digest), None)
        if same is not None:
            return same, f"the value of {p}, which reproduced itself"
    top = max(runs.counts.values())
    it, most = next((it, r) for it, r in runs.results() if runs.counts[r.digest] == top)
    if top * 2 > runs.runs:
        return most, f"the value most runs gave ({top} of {runs.runs})"
    return most, f"iteration {it}'s value (no result was given by most runs)"


def _first_other(runs: JobRuns, expected: JobResult) -> tuple[int, JobResult]:
    """The first run whose result differs from `expected`."""
    return next((it, r) for it, r in runs.results() if r.digest != expected.digest)


def _reproduces(runs: JobRuns, digest: str) -> bool:
    return runs.iterations_of(digest) > 0


def _counts(runs: JobRuns, expected: JobResult) -> str:
    """'4 of 5 runs agree; 1 run(s) differ (first: iteration 2; 2 different results)'."""
    same = runs.iterations_of(expected.digest)
    it, _ = _first_other(runs, expected)
    return (f"{same} of {runs.runs} runs agree; {runs.runs - same} run(s) differ (first: "
            f"iteration {it}; {len(runs.counts)} different results)")
