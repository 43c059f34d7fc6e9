"""The HBM pattern test: write known patterns over a share of a device's free memory, read back.

A memory test in the spirit of memtest86 on GPU memory, done with tensor operations: the memory is
taken in chunks (int32 tensors) up to `fraction` of what is free, every pattern is written to every
chunk and only then read back and compared, so each cell holds its value while the rest is
written. Patterns: all zeros, all ones, the two checkerboards (0xAAAAAAAA and 0x55555555), a
walking one (bit i % 31 of element i) and the address pattern (each element holds its own index,
so a fault in addressing shows up as well as a stuck bit). A mismatch is checked again by rewriting
and re-reading that chunk: a fault that repeats is confirmed (lifecycle evidence "confirmed"); one
that does not is still reported, unconfirmed.

On the CPU the same code tests host memory (capped small: it is for tests and for laptops).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from screener.errors import BadInputError
from screener.health.sources import host
from screener.lifecycle.events import EVIDENCE_CONFIRMED
from screener.types import Outcome, Verdict

PATTERNS = ("zeros", "ones", "checker_a", "checker_5", "walking_one", "address")
CHUNK_BYTES = 256 * 1024 * 1024
CPU_MAX_BYTES = 64 * 1024 * 1024

# (chunks, pattern name) -> None: fault injection between writing and reading (tests, drills).
Inject = Callable[[Sequence[torch.Tensor], str], None]


def _const(value: int) -> Callable[[torch.Tensor, int], None]:
    signed = value - (1 << 32) if value >= 1 << 31 else value

    def fill(t: torch.Tensor, base: int) -> None:
        t.fill_(signed)

    return fill


def _walking(t: torch.Tensor, base: int) -> None:
    idx = torch.arange(base, base + t.numel(), device=t.device, dtype=torch.int64)
    t.copy_(torch.bitwise_left_shift(torch.ones_like(idx), idx % 31).to(torch.int32))


def _address(t: torch.Tensor, base: int) -> None:
    idx = torch.arange(base, base + t.numel(), device=t.device, dtype=torch.int64)
    t.copy_((idx & 0x7FFFFFFF).to(torch.int32))


FILLERS: dict[str, Callable[[torch.Tensor, int], None]] = {
    "zeros": _const(0), "ones": _const(0xFFFFFFFF), "checker_a": _const(0xAAAAAAAA),
    "checker_5": _const(0x55555555), "walking_one": _walking, "address": _address,
}


@dataclass(frozen=True)
class HbmResult:
    """What the pattern test found on one device."""

    device: str
    bytes_tested: int
    patterns: tuple[str, ...]
    mismatches: int
    errors: tuple[dict[str, Any], ...] = ()  # the first few, with address, expected, observed
    confirmed: bool = False
    seconds: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    @property
    def bandwidth_gbps(self) -> float:
        """Bytes written plus bytes read per second, over all patterns."""
        moved = 2 * self.bytes_tested * len(self.patterns)
        return moved / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def verdict(self) -> Verdict:
        if self.ok and self.bytes_tested == 0:
            # Nothing could be allocated (memory held by others): we tested nothing, so we know
            # nothing; that is not a pass, and not the hardware's fault either.
            return Verdict(device=self.device, outcome=Outcome.INCONCLUSIVE, reason="hbm_untested",
                           job="hbm", evidence={"bytes_tested": 0})
        if self.ok:
            return Verdict(device=self.device, outcome=Outcome.PASS, job="hbm")
        first = self.errors[0] if self.errors else {}
        return Verdict(device=self.device, outcome=Outcome.SUSPECT, reason="hbm_mismatch",
                       job="hbm", tensor=first.get("pattern"), expected=first.get("expected"),
                       observed=first.get("observed"),
                       evidence={"mismatches": self.mismatches, "errors": list(self.errors),
                                 EVIDENCE_CONFIRMED: self.confirmed,
                                 "bytes_tested": self.bytes_tested})

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "ok": self.ok, "bytes_tested": self.bytes_tested,
                "patterns": list(self.patterns), "mismatches": self.mismatches,
                "errors": list(self.errors), "confirmed": self.confirmed,
                "seconds": round(self.seconds, 4),
                "bandwidth_gbps": round(self.bandwidth_gbps, 3), "detail": self.detail}


def budget(device: str, fraction: float, max_bytes: Optional[int]) -> int:
    """Bytes to test: `fraction` of the device's free memory (host: available RAM, capped)."""
    if not 0 < fraction <= 0.95:
        raise BadInputError(f"HBM test fraction {fraction} must be in (0, 0.95]")
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        n = int(free * fraction)
    else:
        n = min(int(host.available_memory() * fraction), CPU_MAX_BYTES)
    if max_bytes is not None:
        n = min(n, int(max_bytes))
    return max(0, n - n % 4)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def hbm_test(device: str, *, fraction: float = 0.5, max_bytes: Optional[int] = None,
             chunk_bytes: int = CHUNK_BYTES, patterns: Sequence[str] = PATTERNS,
             inject: Optional[Inject] = None, max_errors: int = 8,
             progress: Optional[Callable[[str], None]] = None) -> HbmResult:
    """Run every pattern over `fraction` of the device's free memory; see the module docstring.
    progress(item), when given, after each pattern (a large GPU takes a while)."""
    unknown = [p for p in patterns if p not in FILLERS]
    if unknown:
        raise BadInputError(f"unknown HBM pattern(s) {', '.join(unknown)}; known: {', '.join(PATTERNS)}")
    if chunk_bytes < 4:
        raise BadInputError("chunk_bytes must be at least 4")
    dev = torch.device(device)
    chunks, got, detail = _allocate(dev, budget(device, fraction, max_bytes), chunk_bytes)
    tally = _Tally()
    try:
        bases = list(itertools.accumulate((c.numel() for c in chunks[:-1]), initial=0))
        t0 = time.perf_counter()
        for name in patterns:
            fill = FILLERS[name]
            for c, base in zip(chunks, bases):
                fill(c, base)
            _sync(dev)
            if inject is not None:
                inject(chunks, name)
            _verify(chunks, bases, name, dev, inject, tally, max_errors)
            if progress is not None:
                progress(f"{device} pattern {name}: {tally.mismatches} mismatches so far")
        _sync(dev)
        seconds = time.perf_counter() - t0
    finally:
        del chunks
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return HbmResult(device=device, bytes_tested=got, patterns=tuple(patterns),
                     mismatches=tally.mismatches, errors=tuple(tally.errors),
                     confirmed=tally.confirmed, seconds=seconds, detail=detail)


def _allocate(dev: torch.device, total: int, chunk_bytes: int
              ) -> tuple[list[torch.Tensor], int, str]:
    """int32 chunks adding up to `total` bytes, or as many as fit: (chunks, bytes, why short)."""
    chunks: list[torch.Tensor] = []
    got = 0
    while got < total:
        n = min(chunk_bytes, total - got) // 4
        if n == 0:
            break
        try:
            chunks.append(torch.empty(n, dtype=torch.int32, device=dev))
        except torch.OutOfMemoryError:
            return chunks, got, f"allocated {got} of {total} bytes before running out of memory"
        got += n * 4
    return chunks, got, ""


@dataclass
class _Tally:
    """What the patterns found so far."""

    mismatches: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)  # the first max_errors, in detail
    confirmed: bool = False  # a mismatch came back after its chunk was written again


def _verify(chunks: Sequence[torch.Tensor], bases: Sequence[int], name: str, dev: torch.device,
            inject: Optional[Inject], tally: _Tally, max_errors: int) -> None:
    """Compare every chunk with what pattern `name` wrote; a chunk that differs is written and
    read again, to tell a fault that repeats (confirmed) from one that does not."""
    fill = FILLERS[name]
    for k, (c, base) in enumerate(zip(chunks, bases)):
        expected = torch.empty_like(c)
        fill(expected, base)
        bad = torch.ne(c, expected)
        n_bad = int(bad.sum())
        if n_bad:
            tally.mismatches += n_bad
            where = bad.nonzero()[: max(0, max_errors - len(tally.errors))].flatten().tolist()
            for i in where:
                tally.errors.append({"pattern": name, "chunk": k, "offset_bytes": (base + i) * 4,
                                     "expected": f"0x{int(expected[i]) & 0xFFFFFFFF:08x}",
                                     "observed": f"0x{int(c[i]) & 0xFFFFFFFF:08x}"})
            fill(c, base)
            _sync(dev)
            if inject is not None:
                inject(chunks, name)
            if bool(torch.ne(c, expected).any()):
                tally.confirmed = True
        del expected, bad


def stuck_bit(chunk: int, element: int, bit: int, *, value: int = 1,
              only: Optional[Sequence[str]] = None) -> Inject:
    """An injector that forces one bit of one element to `value` (a stuck-at fault), after every
    write of the patterns in `only` (default: all)."""
    mask = 1 << bit

    def inject(chunks: Sequence[torch.Tensor], pattern: str) -> None:
        if only is not None and pattern not in only:
            return
        t = chunks[chunk % len(chunks)]
        i = element % t.numel()
        v = int(t[i]) & 0xFFFFFFFF
        v = (v | mask) if value else (v & ~mask)
        t[i] = v - (1 << 32) if v >= 1 << 31 else v

    return inject
