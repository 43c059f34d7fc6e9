"""A node's memory of its own earlier known-answer results (pure): what to keep, never to replace.

The daemon keeps, in known-digests.json under its state folder (screener.agent.screening), the
digest each job gave on each platform in its earlier screens, so that a later screen with no
golden can tell a device that disagrees with itself from a job that does (the judgment reads it
as `known`: screener.known_answer.reference). A memory that a faulty unit can rewrite is worse
than none: a persistently bad lane that overwrote the good digest made the next screen blame
the healthy run (expected = the faulty value). So:

- only a result the device reproduced (two or more runs, one result) with nothing found against
  the job (no issue but a missing golden) on a device that is not suspect is kept;
- a kept digest is never replaced by a different one for the same platform and spec: that is a
  conflict (one of the two results is wrong, and nothing here says which), reported and left
  as it was; the screen's verdict says it too (reason earlier_screens_differ, inconclusive);
- the memory never overrides a golden: the judgment consults it only where the platform has no
  golden (screener.known_answer.reference), and a result kept here is one that did not differ
  from any golden it was compared with.

A changed spec (another spec hash) changes the bits, so its entry is replaced.
"""

from __future__ import annotations

from typing import Any, Mapping

from screener.known_answer.reference import known_digest
from screener.types import KatReason, Outcome

# Issues that say nothing against the job's result: only the golden is missing.
_HARMLESS = frozenset({KatReason.NO_GOLDEN.value})


def remember(known: Mapping[str, Any], screen: Mapping[str, Any]
             ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The memory after a screen (the screen's JSON form, ScreenResult.to_dict() or a burn-in's),
    and one line per conflict: a reproduced result that differs from the one kept."""
    out: dict[str, dict[str, Any]] = {p: dict(jobs) for p, jobs in known.items()
                                      if isinstance(p, str) and isinstance(jobs, Mapping)}
    conflicts: list[str] = []
    for v in screen.get("verdicts") or ():
        phash = v.get("platform_hash")
        if v.get("outcome") == Outcome.SUSPECT.value or not phash:
            continue
        evidence = v.get("evidence") or {}
        against = {i.get("job") for i in evidence.get("issues") or ()
                   if i.get("reason") not in _HARMLESS}
        for job, info in (evidence.get("jobs") or {}).items():
            digest, spec_hash = info.get("digest"), info.get("spec_hash")
            if job in against or not isinstance(digest, str) \
                    or int(info.get("runs") or 0) < 2 or info.get("results") != 1:
                continue
            kept = known_digest(out, phash, job, spec_hash)
            if kept is not None and kept != digest:
                conflicts.append(
                    f"{v.get('device')} reproduced digest {digest} for {job} on platform "
                    f"{phash}, but this node's earlier screens kept {kept}: kept the earlier "
                    f"one (one of the two is wrong; a golden of the platform settles it)")
                continue
            out.setdefault(phash, {})[job] = {"digest": digest, "spec_hash": spec_hash}
    return out, conflicts
