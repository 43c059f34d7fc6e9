"""What the FSDP2/HSDP audit learns inside FSDP's own backward: the reduce-scatter recorders.

Every FSDP module's reduce-scatter goes through a recorder of ours
(`FSDPModule.set_custom_reduce_scatter`): before the reduction it learns whether this rank's local
gradient is finite (one min/max pass over the reduce-scatter input: non-finite means NaN or Inf,
never a norm that overflowed), its largest magnitude and, on audit steps, the input's fingerprint;
then it reduces as FSDP would. While a lockstep replay runs, it records and skips the reduction.
FSDP's all-reduce hook (the reduce-scatter output, or HSDP's replicate all-reduce output) tells
whether the reduced gradient is finite (and, when it is not, where: up to MAX_PLACES elements); a
hook of the caller's still runs. All of it lands in one `Tap`, which the auditor reads and resets
once per step.

Redoing a reduction (issue 21.5): nothing is kept on a healthy step. When some rank's reduced
gradient came out NaN/Inf from finite inputs, the auditor replays every rank's own step in
lockstep with `Tap.redo` naming the bad modules and places; there the recorder, which sees the
recomputed input, reduce-scatters it once more for real (into a scratch buffer, through the same
collective, and for HSDP the replicate all-reduce after it) and notes what this rank sent to each
place, what the redone reduce-scatter and all-reduce gave there, and whether the recomputed input
is the original one (its largest magnitude, bit for bit).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit.alarms import AuditUsageError
from screener.fingerprint import fingerprints

__all__ = ["Tap", "Redone", "fsdp_module_class", "install_recorders", "scan", "finite",
           "MAX_PLACES"]

MAX_PLACES = 8  # the NaN/Inf elements of a reduced gradient one rank reports

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def fsdp_module_class() -> Optional[type]:
    """FSDPModule when torch.distributed.fsdp is loaded (it is, if the model was sharded):
    importing it costs seconds and pulls in sympy, which `import screener.audit` must not."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def scan(t: torch.Tensor) -> tuple[bool, float]:
    """Whether every element is finite, and the largest magnitude: NaN and Inf propagate through
    min and max, and one pass over the values cannot overflow the way a norm does."""
    if t.numel() == 0:
        return True, 0.0
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    lo_f, hi_f = float(lo), float(hi)
    ok = math.isfinite(lo_f) and math.isfinite(hi_f)
    return ok, max(abs(lo_f), abs(hi_f)) if ok else float("inf")


def finite(t: torch.Tensor) -> bool:
    """Whether every element is finite (see scan)."""
    return scan(t)[0]


@dataclass
class Tap:
    """What the reduce-scatter recorders learn during one backward (or one replay)."""

    n: int
    replaying: bool = False
    record: bool = True
    local_finite: bool = True
    fps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))
    replay_fps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 2, dtype=torch.int64))
    recorded: bool = False
    replay_finite: bool = True
    reduced_finite: bool = True
    local_mag: float = 0.0  # the largest magnitude of this rank's local gradient
    reduced_mag: float = 0.0  # ... of its reduced shard
    replay_mag: float = 0.0
    reduce_dtype: torch.dtype = torch.float32  # what the reduce-scatter sums in
    # where the reduction went bad, and what redoing it needs and finds (see the docstring)
    shard_pos: int = 0  # this rank's index in its reduce-scatter group
    replicate_group: Optional[dist.ProcessGroup] = None  # HSDP's all-reduce group, else None
    module_mag: dict[int, float] = field(default_factory=dict)  # each module's input magnitude
    bad_places: list[tuple[int, int]] = field(default_factory=list)  # (module, element)
    redo: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # module: (pos, elem)
    redone: dict[int, "Redone"] = field(default_factory=dict)

    # Gradient accumulation as the step ran it: `micro` counts the root's forwards since the
    # last reset (the micro-step a reduce-scatter belongs to), `synced` the micro-steps that
    # reduce-scattered (every one when the loop reduces on every micro-step, the last under
    # set_requires_gradient_sync(False)), `calls` the reduce-scatters recorded per module (their
    # fingerprints are folded in call order, so the replay, which syncs on the same micro-steps,
    # folds the same inputs in the same order).
    micro: int = -1
    synced: set[int] = field(default_factory=set)
    calls: dict[int, int] = field(default_factory=dict)
    replay_calls: dict[int, int] = field(default_factory=dict)

    # the step just finished (reset() keeps them for check 1's redo and for every replay)
    last_module_mag: dict[int, float] = field(default_factory=dict)
    last_bad_places: list[tuple[int, int]] = field(default_factory=list)
    last_synced: set[int] = field(default_factory=set)

    def reset(self) -> None:
        self.last_module_mag, self.last_bad_places = self.module_mag, self.bad_places
        self.last_synced = self.synced
        self.micro, self.synced, self.calls = -1, set(), {}
        self.local_finite = True
        self.reduced_finite = True
        self.local_mag = self.reduced_mag = 0.0
        self.recorded = False
        self.fps = torch.zeros(self.n, 2, dtype=torch.int64)
        self.module_mag = {}
        self.bad_places = []

    def start_replay(self) -> None:
        self.replaying = True
        self.replay_finite = True
        self.replay_mag = 0.0
        self.replay_fps.zero_()
        self.replay_calls = {}
        self.redone = {}

    def sync_at(self, micro: int, count: int) -> bool:
        """Whether a replay's micro-step `micro` (of `count`) reduce-scatters, as the step's did
        (the last one only, when the step's were not seen)."""
        return micro in self.last_synced if self.last_synced else micro == count - 1


@dataclass
class Redone:
    """One module's reduction done again in a redo replay, at the places of Tap.redo[module]:
    this rank's recomputed input there (what it sent), the redone reduce-scatter's output and the
    final output (after HSDP's all-reduce) where this rank holds the place (else NaN, with
    holder False), and whether the recomputed input is the original one."""

    sent: list[float]
    reduce_scatter: list[float]
    final: list[float]
    holder: list[bool]
    reproduced: bool


class _Recorder:
    """One FSDP module's reduce-scatter: learns the input's finiteness (and fingerprint), then
    reduces as FSDP would; while replaying, records and skips the reduction. (Made a subclass
    of FSDP's ReduceScatter interface by _recorder, once FSDP is loaded.)"""

    def __init__(self, index: int, tap: Tap) -> None:
        self.index = index
        self.tap = tap

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        tap = self.tap
        if tap.replaying:
            tap.replay_fps[self.index] = _folded(tap.replay_fps[self.index], input_tensor,
                                                 tap.replay_calls, self.index)
            ok, mag = scan(input_tensor)
            tap.replay_finite &= ok
            tap.replay_mag = max(tap.replay_mag, mag)
            if self.index in tap.redo:
                self._redo(output_tensor, input_tensor, group, op, mag)
            output_tensor.zero_()
            return None
        ok, mag = scan(input_tensor)
        tap.reduce_dtype = input_tensor.dtype
        tap.local_finite &= ok
        tap.local_mag = max(tap.local_mag, mag)
        tap.module_mag[self.index] = mag
        tap.shard_pos = dist.get_rank(group)
        tap.synced.add(tap.micro)
        if tap.record:
            tap.fps[self.index] = _folded(tap.fps[self.index], input_tensor, tap.calls,
                                          self.index)
            tap.recorded = True
        return _REDUCE_SCATTER(output_tensor, input_tensor, group=group, op=op,
                               async_op=async_op)

    def _redo(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
              group: dist.ProcessGroup, op: Any, mag: float) -> None:
        """The reduction of this module done again, for real, on the recomputed input: every
        rank is here (a lockstep replay, the same Tap.redo everywhere)."""
        tap = self.tap
        places = tap.redo[self.index]
        rows = input_tensor.detach().reshape(dist.get_world_size(group), -1)
        sent = [float(rows[pos, element]) for pos, element in places]
        scratch = torch.empty_like(output_tensor)
        _REDUCE_SCATTER(scratch, input_tensor, group=group, op=op)  # the module's global, at call
        me = dist.get_rank(group)
        holder = [pos == me for pos, _ in places]
        flat = scratch.reshape(-1)

        def read() -> list[float]:
            return [float(flat[e]) if h else math.nan for (_, e), h in zip(places, holder)]

        rs = read()
        if tap.replicate_group is not None:
            dist.all_reduce(scratch, group=tap.replicate_group, op=_all_reduce_op(op))
        tap.redone[self.index] = Redone(sent, rs, read(), holder,
                                        mag == tap.last_module_mag.get(self.index))


def _folded(previous: torch.Tensor, input_tensor: torch.Tensor, calls: dict[int, int],
            index: int) -> torch.Tensor:
    """The module's fingerprint after one more reduce-scatter input: the input's own on the first
    call, else the fingerprint of (the fingerprint so far, the input's), so k micro-steps that
    each reduce-scatter are all compared, in order."""
    fp = fingerprints([input_tensor])[0]
    n = calls.get(index, 0)
    calls[index] = n + 1
    return fp if n == 0 else fingerprints([torch.stack([previous, fp])])[0]


def _all_reduce_op(op: Any) -> Any:
    """HSDP's all-reduce op after a reduce-scatter with `op`: averaging when it averaged, else a
    sum (a pre-multiplied sum already divided). Only finiteness is compared, not the scale."""
    try:
        return dist.ReduceOp.AVG if op == dist.ReduceOp.AVG else dist.ReduceOp.SUM
    except (TypeError, RuntimeError):
        return dist.ReduceOp.SUM


def _recorder(index: int, tap: Tap) -> Any:
    """A _Recorder that is also FSDP's ReduceScatter (set_custom_reduce_scatter takes one)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    cls = type("ScreenerReduceScatter", (_Recorder, ReduceScatter), {})
    return cls(index, tap)


def _reduced_hook(tap: Tap, index: int, theirs: Optional[Callable[[torch.Tensor], None]]
                  ) -> Callable[[torch.Tensor], None]:
    """FSDP's hook on the reduced gradient (the reduce-scatter output, or for HSDP the
    replicate all-reduce's): learns whether it is finite, and where not (the first MAX_PLACES
    elements of this rank's); a hook of the caller's still runs."""

    def hook(reduced: torch.Tensor) -> None:
        if not tap.replaying:
            ok, mag = scan(reduced)
            tap.reduced_finite &= ok
            tap.reduced_mag = max(tap.reduced_mag, mag)
            room = MAX_PLACES - len(tap.bad_places)
            if not ok and room > 0:
                bad = (~torch.isfinite(reduced.detach().reshape(-1))).nonzero().flatten()[:room]
                tap.bad_places.extend((index, int(e)) for e in bad.tolist())
        if theirs is not None:
            theirs(reduced)

    return hook


def install_recorders(model: torch.nn.Module) -> tuple[Tap, list[str]]:
    """Our recorder as every FSDP module's reduce-scatter, one index per module. Returns the tap
    they share and the names of the modules, in index order."""
    cls = fsdp_module_class()
    # FSDPModule's methods are torch internals the audit reaches into: typed Any
    modules: list[tuple[str, Any]] = [
        (n, m) for n, m in model.named_modules() if isinstance(m, cls)]  # type: ignore[arg-type]
    names: list[str] = []
    tap = Tap(0)
    for name, m in modules:
        state = m._get_fsdp_state()  # noqa: SLF001 - only to skip modules without parameters
        groups = getattr(state, "_fsdp_param_groups", None) or []
        if not groups:
            continue
        if len(groups) > 1:
            raise AuditUsageError(f"screener.audit: FSDP module {name or 'root'} has several "
                                  f"parameter groups (a shard_placement_fn with per-parameter "
                                  f"meshes); the audit needs one reduce-scatter per module")
        m.set_custom_reduce_scatter(_recorder(len(names), tap))
        m.set_all_reduce_hook(_reduced_hook(tap, len(names),
                                            getattr(groups[0], "_all_reduce_hook", None)))
        if tap.replicate_group is None:
            tap.replicate_group = getattr(groups[0].mesh_info, "replicate_process_group", None)
        names.append(name or "root")
    tap.n = len(names)
    tap.reset()
    tap.replay_fps = torch.zeros(tap.n, 2, dtype=torch.int64)
    return tap, names
