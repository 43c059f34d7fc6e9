"""Cross-check of a node's known-answer digests with other nodes of the same platform.

After a passing screen the daemon publishes its digests on its Node as the annotation
`screener.io/kat-digests` = {platform hash: {job: digest}}. A burn-in reads those of every other
node and compares its own, job by job, with the nodes of the same platform (same GPU model,
driver, CUDA, torch: the platform hash). Agreement with a strict majority of at least
`min_agree` other nodes is a pass; disagreement with such a majority is suspect; fewer nodes to
compare with is inconclusive for that job (a golden still decides it). This catches a node whose
GPUs agree with each other but not with the fleet, where no golden exists yet.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from screener import boundedjson
from screener.types import ANNOTATION_DIGESTS, KnownAnswerReason, Outcome, Verdict

# The name the daemon's JSON log lines have always carried (log queries filter on it), not the
# module's path since the move into subpackages.
log = logging.getLogger("screener.crosscheck")

Digests = Mapping[str, Mapping[str, str]]  # platform hash -> job -> digest


def platform_digests(verdicts: Sequence[Verdict],
                     digests: Mapping[str, Mapping[str, str]]) -> dict[str, dict[str, str]]:
    """{platform hash: {job: digest}} of a screen's passing devices (what a node publishes).

    verdicts/digests: a screen's (screener.known_answer.verdict.judgment.ScreenResult or screener.agent.screening.window.ScreenOutcome).
    Only passing devices count: a suspect device's digests are not the platform's answer."""
    out: dict[str, dict[str, str]] = {}
    for v in verdicts:
        if v.outcome != Outcome.PASS or not v.platform_hash:
            continue
        out.setdefault(v.platform_hash, {}).update(digests.get(v.device) or {})
    return out


def peer_digests(store: Any, node: str, label_selector: str = "") -> dict[str, dict[str, dict[str, str]]]:
    """Other nodes' published digests from a kube store (node -> platform -> job -> digest).

    A store without annotations (the local store) has none: {}. Unparsable annotations are
    skipped with a log line (someone else's mistake must not fail our burn-in)."""
    lister = getattr(store, "annotations_by_node", None)
    if lister is None:
        return {}
    out: dict[str, dict[str, dict[str, str]]] = {}
    for other, raw in lister(ANNOTATION_DIGESTS, label_selector).items():
        if other == node:
            continue
        try:
            data = boundedjson.strict(raw)
            if not isinstance(data, dict):
                raise ValueError("not an object")
            out[other] = {str(p): {str(j): str(d) for j, d in jobs.items()}
                          for p, jobs in data.items() if isinstance(jobs, dict)}
        except (ValueError, RecursionError) as e:  # json raises RecursionError when too deep
            log.warning("node %s: ignoring its %s annotation: %s", other, ANNOTATION_DIGESTS, e)
    return out


@dataclass(frozen=True)
class CrossCheck:
    """Per (platform, job): how many other nodes agreed, and the outcome."""

    rows: tuple[Mapping[str, Any], ...]
    outcome: Outcome
    nodes_compared: int = 0
    detail: str = ""

    def verdict(self, node: str) -> Verdict:
        bad = [r for r in self.rows if r["result"] == Outcome.SUSPECT.value]
        if bad:
            first = bad[0]
            return Verdict(device=f"node:{node}", outcome=Outcome.SUSPECT,
                           reason=KnownAnswerReason.FLEET_DIGEST_MISMATCH, job=first["job"],
                           platform_hash=first["platform"], expected=first["majority"],
                           observed=first["own"], evidence={"rows": list(self.rows)})
        return Verdict(device=f"node:{node}", outcome=self.outcome, job="crosscheck",
                       evidence={"rows": list(self.rows), "detail": self.detail})

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome.value, "nodes_compared": self.nodes_compared,
                "detail": self.detail, "rows": [dict(r) for r in self.rows]}


def cross_check(own: Digests, peers: Mapping[str, Digests], *, min_agree: int = 2) -> CrossCheck:
    """Compare our digests with the other nodes' (see the module docstring)."""
    rows = []
    compared: set[str] = set()
    for platform, jobs in sorted(own.items()):
        for job, digest in sorted(jobs.items()):
            theirs = {n: d[platform][job] for n, d in peers.items()
                      if job in (d.get(platform) or {})}
            compared |= set(theirs)
            counts = Counter(theirs.values())
            majority, votes = counts.most_common(1)[0] if counts else (None, 0)
            strict = majority is not None and votes * 2 > len(theirs) and votes >= min_agree
            # a row keeps the outcome's plain value: rows go into JSON evidence as they are
            if not strict:
                result = Outcome.INCONCLUSIVE.value
            elif majority == digest:
                result = Outcome.PASS.value
            else:
                result = Outcome.SUSPECT.value
            rows.append({"platform": platform, "job": job, "own": digest, "majority": majority,
                         "agree": sum(1 for v in theirs.values() if v == digest),
                         "others": len(theirs), "result": result})
    results = {r["result"] for r in rows}
    if Outcome.SUSPECT.value in results:
        outcome = Outcome.SUSPECT
    elif not rows or results == {Outcome.INCONCLUSIVE.value}:
        outcome = Outcome.INCONCLUSIVE
    else:
        outcome = Outcome.PASS
    detail = (f"{len(compared)} other node(s) of the same platform" if compared
              else "no other node of the same platform has published digests")
    return CrossCheck(rows=tuple(rows), outcome=outcome, nodes_compared=len(compared), detail=detail)
