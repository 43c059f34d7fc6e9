"""The results of a known-answer job: its steps, their digest, and where two results differ.

Plain data and comparisons (no torch, no files), shared by the jobs that produce results
(screener.known_answer.engine.workloads), the goldens that store them (screener.known_answer.engine.golden)
and the judgment that compares them (screener.known_answer.verdict.judgment, in the pure layer).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence


def canonical_json(obj: Any) -> str:
    """The one JSON text of a value that content hashes are taken of: spec hashes, result
    digests, golden checksums (screener.known_answer.engine.golden) and platform hashes
    (screener.known_answer.engine.platform). Sorted keys, no spaces, ASCII only, so equal values hash
    equal on every machine."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass(frozen=True)
class Step:
    """What one step of a job produced: loss bits (hex, or None) and fingerprints in order."""

    step: int
    label: str
    loss: Optional[str]
    tensors: tuple[tuple[str, tuple[int, int]], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "label": self.label, "loss": self.loss,
                "tensors": [[n, a, b] for n, (a, b) in self.tensors]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Step":
        return cls(step=int(d["step"]), label=str(d.get("label", "")), loss=d.get("loss"),
                   tensors=tuple((str(n), (int(a), int(b))) for n, a, b in d["tensors"]))


def steps_digest(steps: Sequence[Step]) -> str:
    """16 hex digits over every loss bit pattern and fingerprint, in order."""
    blob = canonical_json([s.to_dict() for s in steps])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class JobResult:
    """The outcome of one run of one job on one device. `values` (in-process runs with
    keep_values) holds CPU copies of the checked tensors for tolerance comparisons."""

    job: str
    spec_hash: str
    device: str
    steps: tuple[Step, ...]
    seconds: float = 0.0
    settings: Mapping[str, Any] = field(default_factory=dict)
    values: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def digest(self) -> str:
        return steps_digest(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"job": self.job, "spec_hash": self.spec_hash, "device": self.device,
                "seconds": self.seconds, "digest": self.digest, "settings": dict(self.settings),
                "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "JobResult":
        return cls(job=str(d["job"]), spec_hash=str(d["spec_hash"]), device=str(d["device"]),
                   steps=tuple(Step.from_dict(s) for s in d["steps"]),
                   seconds=float(d.get("seconds", 0.0)), settings=dict(d.get("settings") or {}))


@dataclass(frozen=True)
class Difference:
    """Where two results first differ: step, its label, the tensor ("loss" for the loss)."""

    step: int
    label: str
    tensor: str
    expected: Any
    observed: Any

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "label": self.label, "tensor": self.tensor,
                "expected": self.expected, "observed": self.observed}


def _fp_hex(fp: Optional[tuple[int, int]]) -> Optional[str]:
    if fp is None:
        return None
    return f"{fp[0] & 0xFFFFFFFFFFFFFFFF:016x}:{fp[1] & 0xFFFFFFFFFFFFFFFF:016x}"


def first_difference(expected: Sequence[Step], observed: Sequence[Step]) -> Optional[Difference]:
    """The first place (in execution order: loss, then tensors) where two step lists differ."""
    for e, o in zip(expected, observed):
        if e.loss != o.loss:
            return Difference(e.step, e.label, "loss", e.loss, o.loss)
        if e.tensors != o.tensors:
            o_map = dict(o.tensors)
            for name, fp in e.tensors:
                if o_map.get(name) != fp:
                    return Difference(e.step, e.label, name, _fp_hex(fp), _fp_hex(o_map.get(name)))
            e_names = {n for n, _ in e.tensors}
            extra = next(n for n, _ in o.tensors if n not in e_names)
            return Difference(e.step, e.label, extra, None, _fp_hex(o_map[extra]))
    if len(expected) != len(observed):
        n = min(len(expected), len(observed))
        label = (expected[n] if len(expected) > n else observed[n]).label
        return Difference(n, label, "steps", len(expected), len(observed))
    return None


def all_differences(expected: Sequence[Step], observed: Sequence[Step]) -> list[Difference]:
    """Every differing loss or tensor (for evidence and for the detection benchmark)."""
    out = []
    for e, o in zip(expected, observed):
        if e.loss != o.loss:
            out.append(Difference(e.step, e.label, "loss", e.loss, o.loss))
        o_map = dict(o.tensors)
        for name, fp in e.tensors:
            if o_map.get(name) != fp:
                out.append(Difference(e.step, e.label, name, _fp_hex(fp), _fp_hex(o_map.get(name))))
    return out


def where(diff: Optional[Difference]) -> str:
    """Where two results differ, for a message: step, label, tensor, expected and observed."""
    if diff is None:
        return "an unknown place"
    return (f"step {diff.step} ({diff.label}) {diff.tensor}: expected {diff.expected}, "
            f"observed {diff.observed}")
