"""The fleet's reference where a platform has no golden (pure): a quorum of other nodes.

Every driver, CUDA or torch upgrade changes the platform hash, and with it no node of the new
platform has a golden. A golden recorded by a person on "a node you trust" is no answer at fleet
scale: nobody can know which node that is. The reference is instead what other nodes of the same
platform gave, bit for bit, each of which reproduced itself:

- after a screen, a node publishes its candidates: per platform and job, the digest of every
  device that reproduced itself (two or more runs, one result) with nothing found against the
  job but the missing reference (`candidates_of`: the rule screener.known_answer.verdict.node_memory
  keeps for the node's own memory, applied to what the node tells the fleet);
- a later screen of the platform reads the other nodes' candidates (`FleetView`) and finds the
  quorum (`quorum_for`): a digest that at least `need` other nodes (default 3) published for the
  same job and spec, and that a strict majority of the nodes that published any digest for it
  agree on. Each node counts once, whatever its device count: a node's devices share its
  software and can share its fault, and a quorum is about independent nodes. A device that
  reproduces the quorum passes; one that does not is suspect (judgment: `quorum_mismatch`);
- with too few nodes, or no strict majority, the platform is waiting (`awaiting_quorum`,
  inconclusive with what is missing), never silently stuck;
- a node whose device matched a quorum promotes its own result (the steps, not only the digest)
  to the platform's golden, with its provenance: the quorum's nodes, the time, the screener
  version (`provenance`). Stored goldens are read back as goldens by every later screen
  (screener.known_answer.engine.screen), so the quorum is looked up once per platform, not per screen.

A node's own earlier results (screener.known_answer.verdict.node_memory) never override a golden or a
quorum: the judgment consults them only where neither exists (screener.known_answer.verdict.reference).

Pure: the candidates arrive as plain JSON from the store (the Node annotation
`screener.io/kat-candidates` on Kubernetes, a table of the shared SQLite store locally).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

from screener.types import KnownAnswerReason, Outcome

DEFAULT_NEED = 3  # other nodes that must agree before their answer is the platform's reference
# Issues that say nothing against a job's result: only its reference is missing.
_HARMLESS = frozenset({KnownAnswerReason.NO_GOLDEN.value, KnownAnswerReason.AWAITING_QUORUM.value,
                       KnownAnswerReason.SIBLING_GOLDEN_DIFFERS.value})
MAX_NODES_SHOWN = 16  # nodes named in a quorum's provenance (the count is always exact)

# node -> platform hash -> job -> {"digest": ..., "spec_hash": ...}
Candidates = Mapping[str, Mapping[str, Mapping[str, Mapping[str, Any]]]]


@dataclass(frozen=True)
class Quorum:
    """What the other nodes of a platform say about one job.

    digest: the quorum's answer, None while the platform waits for one. nodes: the nodes that
    gave it (or, while waiting, the nodes that agree on the leading digest). reporting: how many
    other nodes published any digest for the job and spec. need: the quorum's size."""

    phash: str
    job: str
    need: int
    digest: Optional[str]
    nodes: tuple[str, ...] = ()
    reporting: int = 0
    leader: Optional[str] = None  # the digest the most other nodes gave (settled or not)

    @property
    def waiting(self) -> bool:
        return self.digest is None

    def describe(self) -> str:
        """One clause for a verdict's detail."""
        if self.digest is not None:
            return (f"{len(self.nodes)} of {self.reporting} other node(s) of platform "
                    f"{self.phash} agree on {self.digest} (quorum {self.need})")
        if self.reporting and self.nodes and len(self.nodes) * 2 <= self.reporting:
            return (f"the {self.reporting} other node(s) of platform {self.phash} that published "
                    f"a result disagree (the largest group is {len(self.nodes)}), so no quorum "
                    f"of {self.need} says which result is right")
        return (f"{len(self.nodes)} of the {self.need} other node(s) of platform {self.phash} a "
                f"quorum needs have published the same result ({self.reporting} published any)")

    def to_dict(self) -> dict[str, Any]:
        return {"platform_hash": self.phash, "job": self.job, "need": self.need,
                "digest": self.digest, "nodes": list(self.nodes[:MAX_NODES_SHOWN]),
                "agreeing": len(self.nodes), "reporting": self.reporting}


@dataclass(frozen=True)
class FleetView:
    """What a screen knows of the fleet: the other nodes' candidates and the quorum size.

    node: this node (its own candidates never count). promoted: the platforms' promoted goldens
    as stored (platform hash -> job -> record text), for screener.known_answer.engine.screen to load."""

    node: str
    need: int = DEFAULT_NEED
    candidates: Candidates = field(default_factory=dict)
    promoted: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FleetView":
        """From the JSON the daemon hands its screen worker (to_dict); malformed parts are
        dropped, never guessed at: an entry that is not a digest is no vote."""
        need = d.get("need", DEFAULT_NEED)
        if isinstance(need, bool) or not isinstance(need, int) or need < 1:
            need = DEFAULT_NEED
        cands: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
        for node, platforms in (d.get("candidates") or {}).items():
            if not isinstance(node, str) or not isinstance(platforms, Mapping):
                continue
            for phash, jobs in platforms.items():
                if not isinstance(phash, str) or not isinstance(jobs, Mapping):
                    continue
                for job, entry in jobs.items():
                    if isinstance(entry, Mapping) and isinstance(entry.get("digest"), str):
                        sh = entry.get("spec_hash")
                        cands.setdefault(node, {}).setdefault(phash, {})[str(job)] = {
                            "digest": entry["digest"],
                            "spec_hash": sh if isinstance(sh, str) else None}
        promoted = {str(p): {str(j): t for j, t in jobs.items() if isinstance(t, str)}
                    for p, jobs in (d.get("promoted") or {}).items() if isinstance(jobs, Mapping)}
        return cls(node=str(d.get("node") or ""), need=need, candidates=cands, promoted=promoted)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "need": self.need,
                "candidates": {n: {p: {j: dict(e) for j, e in jobs.items()}
                                   for p, jobs in ps.items()}
                               for n, ps in self.candidates.items()},
                "promoted": {p: dict(jobs) for p, jobs in self.promoted.items()}}

    def quorum_for(self, phash: str, job: str, spec_hash: Optional[str]) -> Quorum:
        """The quorum of the other nodes for a job on a platform (see the module docstring).

        A candidate recorded under another spec hash is another job's result and no vote."""
        votes: dict[str, str] = {}
        for node, platforms in self.candidates.items():
            if node == self.node:
                continue
            entry = (platforms.get(phash) or {}).get(job)
            if entry is None:
                continue
            recorded = entry.get("spec_hash")
            if spec_hash is not None and recorded is not None and recorded != spec_hash:
                continue
            votes[node] = str(entry["digest"])
        counts = Counter(votes.values())
        if not counts:
            return Quorum(phash, job, self.need, None, (), 0)
        leader, agreeing = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        nodes = tuple(sorted(n for n, dg in votes.items() if dg == leader))
        settled = agreeing >= self.need and agreeing * 2 > len(votes)
        return Quorum(phash, job, self.need, leader if settled else None, nodes, len(votes),
                      leader)


def reproduced(screen: Mapping[str, Any]) -> Iterator[tuple[str, str, str, str, Optional[str]]]:
    """(device, platform hash, job, digest, spec hash) of every result a screen (its JSON form,
    ScreenResult.to_dict() or a burn-in's) shows reproduced: two or more runs, one result, on a
    device that is not suspect, with nothing found against the job but its missing reference.
    The one rule for what a node may keep of its own results (screener.known_answer.verdict.node_memory)
    and tell the fleet (candidates_of)."""
    for v in screen.get("verdicts") or ():
        phash = v.get("platform_hash")
        if v.get("outcome") == Outcome.SUSPECT.value or not isinstance(phash, str) or not phash:
            continue
        evidence = v.get("evidence") or {}
        against = {i.get("job") for i in evidence.get("issues") or ()
                   if i.get("reason") not in _HARMLESS}
        for job, info in (evidence.get("jobs") or {}).items():
            digest = info.get("digest")
            if job in against or not isinstance(digest, str) \
                    or int(info.get("runs") or 0) < 2 or info.get("results") != 1:
                continue
            sh = info.get("spec_hash")
            yield str(v.get("device")), phash, str(job), digest, sh if isinstance(sh, str) else None


def candidates_of(screen: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """What a node publishes after a screen: platform hash -> job -> {"digest", "spec_hash"} of
    the results its devices reproduced (`reproduced`). Two devices of the node that reproduced
    different results for one job publish neither: the node cannot vote for both."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    split: set[tuple[str, str]] = set()
    for _, phash, job, digest, spec_hash in reproduced(screen):
        have = out.setdefault(phash, {}).get(job)
        if have is not None and have["digest"] != digest:
            split.add((phash, job))
        out[phash][job] = {"digest": digest, "spec_hash": spec_hash}
    for phash, job in split:
        out[phash].pop(job, None)
    return {p: jobs for p, jobs in out.items() if jobs}


def provenance(q: Quorum, *, node: str, time_text: str, version: str) -> dict[str, Any]:
    """What a golden promoted from a quorum records of where it came from (its `recorded`
    field's extra keys): the source, the quorum, the promoting node, when, which screener."""
    return {"source": "quorum", "quorum": q.to_dict(), "promoted_by": node,
            "promoted_at": time_text, "promoted_with": version}


def awaiting(screen: Mapping[str, Any]) -> dict[str, int]:
    """Platform hash -> how many of its jobs a screen found waiting for a quorum (the metric
    and the node condition's reason read it)."""
    out: dict[str, int] = {}
    for v in screen.get("verdicts") or ():
        for i in (v.get("evidence") or {}).get("issues") or ():
            if i.get("reason") == KnownAnswerReason.AWAITING_QUORUM.value and v.get("platform_hash"):
                out[str(v["platform_hash"])] = out.get(str(v["platform_hash"]), 0) + 1
    return out
