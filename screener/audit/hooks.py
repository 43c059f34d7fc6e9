"""The DDP communication hook: check 1's finiteness of each rank's local and reduced gradient, and
on audit steps the local gradient's fingerprints, at the least cost to the training step.

DDP hands the hook one bucket (a flat buffer holding a group of parameters' gradients) at a time.

The default path (no reduce_hook of the caller's, float32 buckets on the CPU, gradients that are
not views of the buckets) adds one pass over the gradients to what DDP does without any hook:

- the hook starts the sum all-reduce of the bucket as it is (nothing reads it first, except the
  fingerprints on audit steps);
- when the sum arrives, one fused pass (the GradScaler's unscale kernel) multiplies it by
  1/world, the same factor DDP's own reduction applies, and notes whether any element is NaN/Inf.
  DDP's hook-less path folds that multiplication into its copy of the gradients into the bucket;
  a hook has to do it itself, so the finiteness check rides on a pass that is needed anyway.
- a finite sum proves every rank's local gradient finite (a NaN or Inf in any addend makes the sum
  NaN or Inf: +inf + -inf is NaN), so on the usual step nothing else is read or measured.
  Only when the sum is not finite does the callback measure the local gradient, from the
  parameters' own .grad, which DDP overwrites with the reduced bucket only at the end of backward:
  that names the rank whose gradient was NaN/Inf, or says every local gradient was finite and the
  reduction produced it.

Summing before dividing can overflow where dividing first would not only for float32 elements
past ~3.4e38 / world, an overflow in all but name: the local magnitudes measured then add up past
float32's range, and the auditor calls it an overflow (the loss scaler's, or a numeric
failure), not a faulty reduction. float16/bfloat16 buckets, whose range is small, take the generic
path, which divides first.

The generic path (the caller's reduce_hook, e.g. fault injection, compression; other dtypes or
devices; gradient_as_bucket_view=True, where .grad is the bucket and the local values are gone
after the reduction) measures the bucket's largest magnitude before calling the reduce hook and the
reduced bucket's when it completes, as a reduce hook may do anything to the values.

What is measured is the largest magnitude (the inf-norm, `magnitude`), never an L2 norm: the
squares of an L2 norm overflow float32 from about 1.8e19 on CPU and GPU alike, so a finite
gradient of 2e19 would read as infinite and a healthy job would die (issue 28). The largest
magnitude is exact in the bucket's own dtype, NaN exactly when an element is NaN, inf exactly
when one is infinite; and it still bounds what a sum of the ranks' gradients can reach (see
auditor._judge_nonfinite).

StepStats carries those magnitudes where they were measured and 0 for a bucket known finite and
not measured, so a non-finite value is exactly a non-finite gradient on either path.

A bucket whose reduced result is NaN/Inf also leaves its layout (the rows of its parameters, in
bucket order; `last_bad_buckets()`, read only then, so a healthy step pays nothing more), and
`reduce_again` runs a buffer through the reduction the hook gives that bucket (the fused sum and
division, or the reduce hook with a stand-in for DDP's GradBucket): check 1 redoes a reduction that
went bad on the same path (nonfinite.py).

Gradients are mapped to parameters by identity (`id(param)`), never by bucket order: DDP builds its
first-iteration buckets in reverse parameter order and rebuilds them after the first iteration in the
order gradients became ready, so bucket indices and contents change between iterations.

Gradient accumulation that reduces on every micro-step (a loop without `ddp.no_sync()`): from
the second backward of a step on, DDP's bucket holds .grad, the reduced sum so far plus this
micro-batch's local gradient, a value no replay on another rank can compute alone. So with
accumulation_steps > 1 the recorder also keeps, on audit steps only, each parameter's local
gradients as they arrive (a tensor hook, before autograd adds them to .grad) added up in order,
which is what a replay computes; when more than one backward of the step reduced, those sums
are the step's fingerprints. The cost: one copy of the gradients on audit steps (under no_sync
too, as the first backward cannot know the second will reduce).

Imports only torch, the standard library and screener.fingerprint.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (allreduce_hook,
                                                                      bf16_compress_hook,
                                                                      fp16_compress_hook)

from screener.fingerprint import fingerprints

__all__ = ["GradientRecorder", "RedoBucket", "StepStats", "magnitude", "largest",
           "largest_magnitude", "stateless_hook"]

ReduceHook = Callable[[Any, Any], "torch.futures.Future[Any]"]

# torch's own hooks that keep no state between calls, and what the compressing ones send.
_STATELESS_HOOKS = (allreduce_hook, fp16_compress_hook, bf16_compress_hook)
_WIRE_DTYPES = {fp16_compress_hook: torch.float16, bf16_compress_hook: torch.bfloat16}
_WRAPPER_DTYPES = {"fp16_compress_wrapper_hook": torch.float16,
                   "bf16_compress_wrapper_hook": torch.bfloat16}
_ZERO = torch.zeros((), dtype=torch.float32)


def stateless_hook(hook: Any) -> bool:
    """Whether a DDP comm hook keeps no state between calls, so running it twice on the same
    inputs gives the same result: one of torch's stateless hooks, or one that says so
    (`hook.stateless = True`)."""
    return hook in _STATELESS_HOOKS or getattr(hook, "stateless", False) is True  # the stand-in magnitude of a bucket known finite


class StepStats:
    """What the hook recorded during one backward pass, handed to the checks after it."""

    def __init__(self, local_norm: torch.Tensor, reduced_norm: torch.Tensor, buckets: int,
                 grad_fingerprints: Optional[torch.Tensor], step: Optional[int]) -> None:
        # 0-d float64 on the gradients' device: the largest magnitude over the measured buckets (a
        # bucket known finite without a measurement counts 0), so it is NaN/Inf exactly when a
        # gradient is. The names say norm: the largest magnitude is the inf-norm.
        self.local_norm = local_norm
        self.reduced_norm = reduced_norm
        self.buckets = buckets  # how many buckets the hook saw (0: no backward since last take)
        self.grad_fingerprints = grad_fingerprints  # (P, 2) int64 CPU, complete, or None
        self.step = step  # the step the fingerprints were recorded for


def magnitude(t: torch.Tensor) -> torch.Tensor:
    """The largest magnitude in t (its inf-norm) as a 0-d tensor on t's device (float32; float64
    for a float64 t): NaN when an element is NaN, inf when one is infinite, finite otherwise
    however large the values.

    This is how the audit tells finite from non-finite, on every path and device. Nothing in it
    can overflow (an L2 norm's squares overflow float32 past ~1.8e19), NaN propagates into the
    result, and it costs what an L2 norm costs: on the CPU one vectorised aminmax (torch.linalg's
    inf-norm is several times slower there), elsewhere the inf-norm, one reduction kernel whose
    max propagates NaN. The result is exact (a largest value is one of the values). No device
    synchronisation: it stays a tensor.
    """
    t = t.detach()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    if t.device.type == "cpu":
        lo, hi = torch.aminmax(t)
        m = torch.maximum(hi, -lo)
    else:
        m = torch.linalg.vector_norm(t, ord=float("inf"))
    return m if m.dtype in (torch.float32, torch.float64) else m.float()


def largest(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest of several magnitudes (0-d tensors), as one float64 on device: one stack and
    one max however many there are (per bucket conversions would be a kernel launch each)."""
    if not values:
        return torch.zeros((), dtype=torch.float64, device=device)
    dtype = torch.float64 if any(v.dtype == torch.float64 for v in values) else torch.float32
    return torch.stack([v.to(device=device, dtype=dtype) for v in values]).amax().to(
        torch.float64)  # amax propagates NaN


def largest_magnitude(tensors: Sequence[Optional[torch.Tensor]],
                      device: torch.device) -> torch.Tensor:
    """The largest magnitude over several tensors (None counts as zeros), float64 on device."""
    return largest([magnitude(t) for t in tensors if t is not None], device)


def _local_magnitude(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """The largest magnitude of the parameters' .grad (a missing .grad is the zeros DDP puts in
    the bucket): finite exactly when every element is, however large, so that the auditor can
    tell a sum that overflowed from a reduction that produced NaN/Inf (auditor._judge_nonfinite)."""
    return largest_magnitude([p.grad for p in params], device)


class RedoBucket:
    """A stand-in for DDP's GradBucket (which Python cannot construct) when a reduction is redone
    through the caller's reduce hook: one flat buffer of the parameters' gradients in bucket
    order, with the methods a Python comm hook calls. Never the last bucket of a backward (a hook
    that counts iterations on the last one does not count a redo)."""

    def __init__(self, index: int, buffer: torch.Tensor,
                 params: Sequence[torch.nn.Parameter]) -> None:
        self._index, self._buffer, self._params = index, buffer, list(params)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        out, at = [], 0
        for p in self._params:
            out.append(self._buffer[at:at + p.numel()].view(p.shape))
            at += p.numel()
        return out

    def is_last(self) -> bool:
        return False


class GradientRecorder:
    """State and body of the comm hook. Register `recorder.hook` with `ddp.register_comm_hook`.

    params: the parameters DDP reduces, in the order of the fingerprint rows. The owner of the
    recorder sets `record_step` to the step the *next* backward belongs to when that step is an
    audit step (None otherwise): the hook runs before the training loop says which step it is in.
    reduce_hook/reduce_state: the reduction (default: the sum all-reduce over the process group
    reduce_state, divided by its size, as DDP does). grads_are_bucket_views: the DDP model's
    gradient_as_bucket_view (then the local gradient cannot be read after the reduction, and the
    hook measures it before; see the module docstring).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], *,
                 reduce_hook: Optional[ReduceHook] = None, reduce_state: Any = None,
                 check_reduced: bool = True, grads_are_bucket_views: bool = False,
                 measure_local: bool = False, accumulating: bool = False) -> None:
        self.params = list(params)
        # The spike sentinel (sentinel.py) reads every rank's largest local gradient on every
        # step: one aminmax pass over each bucket before its all-reduce, on the fused path too.
        self.measure_local = measure_local
        self._row = {id(p): k for k, p in enumerate(self.params)}
        self._fused = reduce_hook is None and not grads_are_bucket_views
        self.reduce_hook: ReduceHook = reduce_hook if reduce_hook is not None else allreduce_hook
        self.reduce_state = reduce_state
        self.check_reduced = check_reduced
        self.record_step: Optional[int] = None
        self._lock = threading.Lock()  # reduction callbacks may run on the backend's threads
        self._inv_world: Optional[torch.Tensor] = None
        self._last: tuple[dict[int, list[int]], dict[int, Any], dict[int, torch.Tensor]] = \
            ({}, {}, {})
        self._reset()
        # accumulation (see the module docstring): the local gradients' running sums on audit
        # steps, and how many backwards of the step reduced
        self._sums: dict[int, torch.Tensor] = {}
        self._backwards = 0
        # the tensor hooks fire for every gradient of the parameters, the auditor's own replays'
        # too: they count only between the step's first forward (the auditor arms them) and take()
        self.armed = False
        self._handles = [p.register_hook(self._local_hook(k))
                         for k, p in enumerate(self.params)] if accumulating else []

    def _local_hook(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.record_step is None or not self.armed:
                return
            with torch.no_grad():
                seen = self._sums.get(k)
                if seen is None:  # a copy: autograd may adopt this tensor as .grad
                    self._sums[k] = grad.detach().clone()
                else:  # as .grad accumulation adds them, and a replay
                    seen.add_(grad)
        return hook

    def remove(self) -> None:
        """Remove the tensor hooks (the comm hook stays with DDP)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _reset(self) -> None:
        self._local: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self._fp: Optional[torch.Tensor] = None
        self._seen: Optional[torch.Tensor] = None
        self._fp_step: Optional[int] = None
        self._unknown = 0
        self._bad: dict[int, list[int]] = {}
        self._buckets: dict[int, Any] = {}

    @property
    def redo_safe(self) -> bool:
        """Whether the reduction gives the same result when run a second time on the same
        inputs: the fused path, one of torch's stateless hooks, or a hook of the caller's that
        says so (`hook.stateless = True`). A hook that keeps state across calls (PowerSGD's
        error feedback and warm start) is not run twice."""
        return self._fused or stateless_hook(self.reduce_hook)

    @property
    def wire_dtype(self) -> Optional[torch.dtype]:
        """The dtype the reduction sends, when it is narrower than the gradients' (torch's fp16
        and bf16 compression hooks and wrappers): its largest value bounds the sum. None: the
        gradients' own dtype."""
        hook = self.reduce_hook
        if hook in _WIRE_DTYPES:
            return _WIRE_DTYPES[hook]
        return _WRAPPER_DTYPES.get(getattr(hook, "__name__", ""))

    @property
    def measures_every_bucket(self) -> bool:
        """Whether the local magnitude taken covers every bucket (the generic path, or the
        sentinel's pass on the fused one): then it equals a replay's largest magnitude."""
        return not self._fused or self.measure_local

    def last_bad_buckets(self) -> dict[int, list[int]]:
        """The buckets of the last backward taken whose reduced result was NaN/Inf: index -> its
        parameters' rows in bucket order (-1: not one of self.params). Read only when check 1
        needs it: the generic path's magnitudes are looked at here, not on every step."""
        bad, buckets, measured = self._last
        out = dict(bad)
        for index, b in buckets.items():
            if index not in out and not bool(torch.isfinite(measured[index])):
                out[index] = [self._row.get(id(p), -1) for p in b.parameters()]
        return out

    def _note_bad(self, index: int, params: Sequence[torch.nn.Parameter]) -> None:
        """Called under the lock: the layout of a bucket whose reduced result is NaN/Inf."""
        self._bad[index] = [self._row.get(id(p), -1) for p in params]

    # no annotations: DDP checks them against GradBucket/Future (hence the ignore in strict mode)
    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        """The DDP comm hook: record, reduce, then note what the reduction gave."""
        index = bucket.index()
        buf = bucket.buffer()
        fused = self._fused and buf.dtype == torch.float32 and buf.device.type == "cpu"
        with self._lock:
            if index == 0:  # DDP launches buckets in index order: bucket 0 opens a new backward
                self._reset()
                self._backwards += 1
            if self.record_step is not None:
                self._record_fingerprints(bucket)  # before anything changes the buffer
            if not fused or self.measure_local:
                self._local[index] = magnitude(buf)
        if fused:
            return self._sum_then_scale(index, buf, bucket.parameters())
        fut = self.reduce_hook(self.reduce_state, bucket)
        if not self.check_reduced:
            return fut

        def note_reduced(f: "torch.futures.Future[Any]") -> Any:
            value = f.value()
            reduced = value[0] if isinstance(value, (list, tuple)) else value
            n = magnitude(reduced)
            with self._lock:
                self._reduced[index] = n
                self._buckets[index] = bucket  # a reference: its layout is read only if bad
            return value

        return fut.then(note_reduced)

    def _inv(self) -> torch.Tensor:
        if self._inv_world is None:
            world = dist.get_world_size(self.reduce_state)
            self._inv_world = torch.full((1,), 1.0 / world, dtype=torch.float32)
        return self._inv_world

    def reduce_again(self, index: int, buf: torch.Tensor,
                     params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """Collective: `buf` (the parameters' gradients, flat, in bucket order) through the
        reduction this hook gives such a bucket, waited for; returns the reduced values. The
        fused path's sum all-reduce and division by the world size, or the reduce hook (the
        caller's, else torch's allreduce_hook) with a RedoBucket and the same state. Records
        nothing."""
        if self._fused and buf.dtype == torch.float32 and buf.device.type == "cpu":
            dist.all_reduce(buf, group=self.reduce_state)
            found = torch.zeros(1, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_([buf], found, self._inv())
            return buf
        value = self.reduce_hook(self.reduce_state, RedoBucket(index, buf, params)).wait()
        reduced = value[0] if isinstance(value, (list, tuple)) else value
        assert isinstance(reduced, torch.Tensor)
        return reduced

    def _sum_then_scale(self, index: int, buf: torch.Tensor,
                        params: Sequence[torch.nn.Parameter]) -> "torch.futures.Future[Any]":
        """The default path: sum all-reduce, then one fused pass that divides and checks."""
        inv = self._inv()
        work = dist.all_reduce(buf, group=self.reduce_state, async_op=True)

        def scale(f: "torch.futures.Future[Any]") -> torch.Tensor:
            reduced: torch.Tensor = f.value()[0]
            found = torch.zeros(1, dtype=torch.float32)
            # One pass: reduced *= 1/world, found = 1 if any element is NaN/Inf.
            torch._amp_foreach_non_finite_check_and_unscale_([reduced], found, inv)
            local: Optional[torch.Tensor] = None  # keep what was measured before (sentinel)
            if found.item() == 0.0:
                reduced_norm = _ZERO
            else:  # rare: whose was it? .grad still holds this rank's own gradient
                local, reduced_norm = _local_magnitude(params, reduced.device), magnitude(reduced)
            with self._lock:
                if local is not None or index not in self._local:
                    self._local[index] = _ZERO if local is None else local
                if self.check_reduced:
                    self._reduced[index] = reduced_norm
                if local is not None:
                    self._note_bad(index, params)
            return reduced

        fut: "torch.futures.Future[Any]" = work.get_future().then(scale)
        return fut

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
            bad, buckets, measured = self._bad, self._buckets, dict(self._reduced)
            sums, backwards = self._sums, self._backwards
            self._reset()
            self._sums, self._backwards, self.armed = {}, 0, False
        if backwards > 1 and fp is not None and self._handles:  # reduced on every micro-step
            fp = fingerprints([sums.get(k) for k in range(len(self.params))])
        self._last = (bad, buckets, measured)

        def total(values: list[torch.Tensor]) -> torch.Tensor:  # float64: the head's type
            return largest(values, device)

        complete = (fp is not None and seen is not None and bool(seen.all()) and unknown == 0)
        return StepStats(total(local), total(reduced), len(local), fp if complete else None,
                         fp_step if complete else None)
