"""The DDP communication hook that records each rank's local gradient before the all-reduce.

DDP hands the hook one bucket (a flat buffer holding a group of parameters' gradients) at a time. The
hook reads the bucket before anything changes it, because the stock all-reduce hook divides the
buffer in place and then overwrites it with the reduced sum:

- every step: the bucket's L2 norm (one read pass), so check 1 can tell whose local gradient is
  NaN/Inf; the squared norms of the buckets sum to the squared norm of the local gradient;
- on audit steps: each parameter's gradient fingerprint, for the ring replay audit (check 2).

Then it calls the reduce hook (default torch's allreduce_hook; fault injection passes its own) and,
when the reduction completes, takes the norm of the reduced bucket (check 1's second half: a NaN/Inf
born inside the reduction). That callback runs while later buckets are still in flight.

Gradients are mapped to parameters by identity (`id(param)`), never by bucket order: DDP builds its
first-iteration buckets in reverse parameter order and rebuilds them after the first iteration in the
order gradients became ready, so bucket indices and contents change between iterations.

Imports only torch, the standard library and screener.fingerprint.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from screener.fingerprint import fingerprints

__all__ = ["GradientRecorder", "StepStats"]

ReduceHook = Callable[[Any, Any], "torch.futures.Future[Any]"]


class StepStats:
    """What the hook recorded during one backward pass, handed to the checks after it."""

    def __init__(self, local_norm: torch.Tensor, reduced_norm: torch.Tensor, buckets: int,
                 grad_fingerprints: Optional[torch.Tensor], step: Optional[int]) -> None:
        self.local_norm = local_norm  # 0-d float32 on the gradients' device
        self.reduced_norm = reduced_norm
        self.buckets = buckets  # how many buckets the hook saw (0: no backward since last take)
        self.grad_fingerprints = grad_fingerprints  # (P, 2) int64 CPU, complete, or None
        self.step = step  # the step the fingerprints were recorded for


def _norm(t: torch.Tensor) -> torch.Tensor:
    # float32 accumulation everywhere; on CPU torch accumulates float32 norms in double, so only a
    # truly non-finite element gives inf. On CUDA a squared sum past ~3e38 overflows to inf, which
    # check 1 reports as non-finite: a gradient element past 1e19 is an overflow in all but name.
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float32)


class GradientRecorder:
    """State and body of the comm hook. Register `recorder.hook` with `ddp.register_comm_hook`.

    params: the parameters DDP reduces, in the order of the fingerprint rows. The owner of the
    recorder sets `record_step` to the step the *next* backward belongs to when that step is an
    audit step (None otherwise): the hook runs before the training loop says which step it is in.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], *,
                 reduce_hook: Optional[ReduceHook] = None, reduce_state: Any = None,
                 check_reduced: bool = True) -> None:
        self.params = list(params)
        self._row = {id(p): k for k, p in enumerate(self.params)}
        self.reduce_hook: ReduceHook = reduce_hook if reduce_hook is not None else allreduce_hook
        self.reduce_state = reduce_state
        self.check_reduced = check_reduced
        self.record_step: Optional[int] = None
        self._lock = threading.Lock()  # reduction callbacks may run on the backend's threads
        self._reset()

    def _reset(self) -> None:
        self._local: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self._fp: Optional[torch.Tensor] = None
        self._seen: Optional[torch.Tensor] = None
        self._fp_step: Optional[int] = None
        self._unknown = 0

    def hook(self, state, bucket):  # no annotations: DDP checks them against GradBucket/Future
        """The DDP comm hook: record, then reduce with the reduce hook, then note the result."""
        index = bucket.index()
        buf = bucket.buffer()
        with self._lock:
            if index == 0:  # DDP launches buckets in index order: bucket 0 opens a new backward
                self._reset()
            self._local[index] = _norm(buf)
            if self.record_step is not None:
                self._record_fingerprints(bucket)
        fut = self.reduce_hook(self.reduce_state, bucket)
        if not self.check_reduced:
            return fut

        def note_reduced(f: "torch.futures.Future[Any]") -> Any:
            value = f.value()
            reduced = value[0] if isinstance(value, (list, tuple)) else value
            n = _norm(reduced)
            with self._lock:
                self._reduced[index] = n
            return value

        return fut.then(note_reduced)

    def _record_fingerprints(self, bucket: Any) -> None:
        if self._fp is None:
            self._fp = torch.zeros(len(self.params), 2, dtype=torch.int64)
            self._seen = torch.zeros(len(self.params), dtype=torch.bool)
            self._fp_step = self.record_step
        rows = [self._row.get(id(p), -1) for p in bucket.parameters()]
        fps = fingerprints(bucket.gradients())  # before the reduce hook divides the buffer
        known = [k for k, r in enumerate(rows) if r >= 0]
        self._unknown += len(rows) - len(known)
        if known:
            idx = torch.tensor([rows[k] for k in known], dtype=torch.int64)
            self._fp.index_copy_(0, idx, fps[known])
            self._seen[idx] = True  # type: ignore[index]

    def take(self, device: torch.device) -> StepStats:
        """The stats of the last backward, then a clean slate for the next one."""
        with self._lock:
            local = list(self._local.values())
            reduced = list(self._reduced.values())
            fp, seen, fp_step, unknown = self._fp, self._seen, self._fp_step, self._unknown
            self._reset()

        def total(norms: list[torch.Tensor]) -> torch.Tensor:
            if not norms:
                return torch.zeros((), dtype=torch.float32, device=device)
            return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))

        complete = (fp is not None and seen is not None and bool(seen.all()) and unknown == 0)
        return StepStats(total(local), total(reduced), len(local), fp if complete else None,
                         fp_step if complete else None)
