"""The in-job audit for FSDP2 and HSDP models (torch.distributed.fsdp.fully_shard).

    auditor = Auditor(fsdp_model, loss_fn=compute_loss, audit_every=50, weights_every=100)
    for step, batch in enumerate(loader):
        loss = compute_loss(fsdp_model, batch); loss.backward()
        auditor.check_gradients(step, loss, batch=batch)   # check 1 every step, 2 on audit steps
        optimizer.step()
        auditor.check_weights(step)                          # check 3 every weights_every steps

`Auditor(...)` hands a model sharded with `fully_shard` to this class (screener.audit.auditor
dispatches); the loop's calls are the same as for DDP. What each check sees:

Check 1 (every step). Every FSDP module's reduce-scatter goes through a recorder of ours
(`FSDPModule.set_custom_reduce_scatter`): before the reduction it learns whether this rank's local
gradient is finite (one min/max pass over the reduce-scatter input: non-finite means NaN or Inf,
never a norm that overflowed) and, on audit steps, the input's fingerprint. One all_gather of (loss, local finite, reduced
finite) per step; the reduced gradient's finiteness comes from FSDP's all-reduce hook (the
reduce-scatter output, or HSDP's replicate all-reduce output; a hook of the caller's still runs).
A rank whose loss or local gradient is not finite is replayed on another node
(a lockstep round, below): finite there names the rank (settled); not finite there is the data
or the model (NumericFailure, exit 76). Every local gradient finite but a reduced shard not: the
reduction went bad, and the alarm names no one.

Check 2 (audit steps). The reduce-scatter input is the rank's whole local gradient (every shard's
chunk, before any rank's contribution is added), so it can be compared bit for bit with a
recomputation elsewhere. The owner's micro-batch travels to its replayer (point to point: the
`batch=` of check_gradients, or `batch_fn(rank, step)` when given), with the RNG states and loss
scale its step started from (capture.py). Replays run in lockstep: every rank runs exactly one
forward and backward per round, through the same model (its all-gathers and, for HSDP, the
replicate all-reduce line up across ranks), with our recorder taking the reduce-scatter input's
fingerprint and skipping the reduction; the sharded gradients are put back afterwards, bit for
bit. A replay whose record differs from the owner's is settled by a referee on a third node (a
second lockstep round); the odd one out is named ("ring_replay"). Self-check: on the first audit
and every self_check_every after, a round in which every rank replays its own step; a step that
does not reproduce on its own rank is not a hardware verdict (NumericFailure).

Check 3 (every weights_every steps). HSDP: the ranks that hold the same shard (one per replica)
vote on its fingerprint; a strict majority names the odd replica. Pure FSDP has no replicas, so
no vote can say whether a shard's bits are right. What it can prove, it does: every rank
all-gathers every parameter (`DTensor.full_tensor`) and the fingerprints must agree on all
ranks, which catches a rank whose all-gather or whose copy of the full weights went bad; a bit
flipped in a rank's own stored shard reaches every rank alike and is not seen (the ring replay
sees what it does to the next step's gradients only if the flip changes them differently on
owner and replayer, which it does not). Use HSDP to have the weight vote.

Lockstep has a price: a replay that raises on one rank leaves the others waiting in a collective
until the process group's timeout (a peer failure, exit 77, on the others); loss_fn and the
batch were already run by the training step, so this is rare.
"""

from __future__ import annotations

import io
import logging
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit import ring
from screener.audit.alarms import AuditUsageError, NumericFailure, SDCAlarm, alarm_dir, log_json, node_records, \
    write_alarm_file
from screener.audit.blast import LIKELY_CAUSES, too_wide
from screener.audit.sentinel import Rerun, Sentinel, SentinelConfig, Spike, rerun_verdict
from screener.audit.capture import StateCodec, StepState, capture, restored, scaler_scale
from screener.audit.collective import comm_device, gather
from screener.audit.topology import Topology, gather_topology, job_name
from screener.audit.vote import vote
from screener.audit.checkpoints import write_marker
from screener.fingerprint import digest, fingerprints

__all__ = ["ShardedAuditor", "fsdp_root", "is_sharded"]

log = logging.getLogger("screener.audit")

_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_MAX_NAMES = 8


def _fsdp_module_class() -> Optional[type]:
    """FSDPModule when torch.distributed.fsdp is loaded (it is, if the model was sharded):
    importing it costs seconds and pulls in sympy, which `import screener.audit` must not."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return getattr(fsdp, "FSDPModule", None)


def fsdp_root(model: Any) -> Optional[Any]:
    """The FSDP2 module under a model (itself, or what torch.compile wrapped), else None."""
    cls = _fsdp_module_class()
    if cls is None:
        return None
    for m in (model, getattr(model, "_orig_mod", None)):
        if isinstance(m, cls):
            return m
    return None


def is_sharded(model: Any) -> bool:
    """Whether a model is an FSDP2 (fully_shard) model this module audits."""
    return fsdp_root(model) is not None


def _scan(t: torch.Tensor) -> tuple[bool, float]:
    """Whether every element is finite, and the largest magnitude: NaN and Inf propagate through
    min and max, and one pass over the values cannot overflow the way a norm does."""
    if t.numel() == 0:
        return True, 0.0
    lo, hi = torch.aminmax(t.detach().reshape(-1))
    lo_f, hi_f = float(lo), float(hi)
    finite = math.isfinite(lo_f) and math.isfinite(hi_f)
    return finite, max(abs(lo_f), abs(hi_f)) if finite else float("inf")


def _finite(t: torch.Tensor) -> bool:
    """Whether every element is finite (see _scan)."""
    return _scan(t)[0]


def _bits(x: float) -> int:
    return int(torch.tensor(float(x), dtype=torch.float64).view(torch.int64).item())


def _float(bits: Any) -> float:
    return float(torch.tensor(int(bits), dtype=torch.int64).view(torch.float64).item())


@dataclass
class _Tap:
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

    def reset(self) -> None:
        self.local_finite = True
        self.reduced_finite = True
        self.local_mag = self.reduced_mag = 0.0
        self.recorded = False
        self.fps = torch.zeros(self.n, 2, dtype=torch.int64)


class _Recorder:
    """One FSDP module's reduce-scatter: learns the input's finiteness (and fingerprint), then
    reduces as FSDP would; while replaying, records and skips the reduction. (Made a subclass
    of FSDP's ReduceScatter interface by _recorder, once FSDP is loaded.)"""

    def __init__(self, index: int, tap: _Tap) -> None:
        self.index = index
        self.tap = tap

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        tap = self.tap
        if tap.replaying:
            tap.replay_fps[self.index] = fingerprints([input_tensor])[0]
            finite, mag = _scan(input_tensor)
            tap.replay_finite &= finite
            tap.replay_mag = max(tap.replay_mag, mag)
            output_tensor.zero_()
            return None
        finite, mag = _scan(input_tensor)
        tap.reduce_dtype = input_tensor.dtype
        tap.local_finite &= finite
        tap.local_mag = max(tap.local_mag, mag)
        if tap.record:
            tap.fps[self.index] = fingerprints([input_tensor])[0]
            tap.recorded = True
        return _REDUCE_SCATTER(output_tensor, input_tensor, group=group, op=op,
                               async_op=async_op)


def _recorder(index: int, tap: _Tap) -> Any:
    """A _Recorder that is also FSDP's ReduceScatter (set_custom_reduce_scatter takes one)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    cls = type("ScreenerReduceScatter", (_Recorder, ReduceScatter), {})
    return cls(index, tap)


def _encode_batch(batch: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(batch, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _decode_batch(data: torch.Tensor, device: torch.device) -> Any:
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location=device,
                      weights_only=False)


_H_LOSS, _H_LOCAL, _H_REDUCED, _H_STATUS, _H_BYTES, _H_LOCAL_MAG, _H_REDUCED_MAG = range(7)
_HEAD = 7
_OK, _NO_BATCH, _NOT_RECORDED = 0, 1, 2


class ShardedAuditor:
    """The three checks for an FSDP2 or HSDP model; see the module docstring.

    model: the root module sharded with `fully_shard` (or torch.compile of it). loss_fn(model,
    batch) -> loss, the same call the loop makes; batch_fn(global_rank, step) is optional (without
    it, pass batch= to check_gradients). Refuses (ValueError, one line) what it cannot audit.
    """

    def __init__(self, model: torch.nn.Module, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], Any]] = None,
                 batch_fn: Optional[Callable[[int, int], Any]] = None,
                 audit_every: int = 50, weights_every: int = 100,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 topology: Optional[Topology] = None, scaler: Any = None,
                 accumulation_steps: int = 1, self_check_every: int = 20,
                 confirm_nonfinite: bool = True, start_step: Optional[int] = None,
                 process_group: Any = None, reduce_hook: Any = None, reduce_state: Any = None,
                 check_reduced: bool = True, sentinel: Optional[SentinelConfig] = None) -> None:
        if reduce_hook is not None or reduce_state is not None:
            raise AuditUsageError("screener.audit: reduce_hook is DDP's; an FSDP2 model reduces "
                                  "through fully_shard's reduce-scatter, which the audit records")
        if process_group is not None and process_group is not dist.group.WORLD:
            raise AuditUsageError("screener.audit: the FSDP2/HSDP audit runs on the default "
                                  "process group (its device mesh says how the model is sharded)")
        root = fsdp_root(model)
        if root is None:
            raise TypeError(f"ShardedAuditor needs a model sharded with fully_shard, not "
                            f"{type(model).__name__}")
        for name in ("audit_every", "weights_every", "self_check_every", "accumulation_steps"):
            v = locals()[name]
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name ==
                                                                     "accumulation_steps" else 0):
                raise AuditUsageError(f"{name} must be an integer >= "
                                 f"{1 if name == 'accumulation_steps' else 0}, not {v!r}")
        self.model, self.root = model, root
        self.loss_fn, self.batch_fn, self.scaler = loss_fn, batch_fn, scaler
        self.audit_every, self.weights_every = audit_every, weights_every
        self.self_check_every, self.accumulation_steps = self_check_every, accumulation_steps
        self.confirm_nonfinite = confirm_nonfinite
        self.job = job_name() if job is None else job
        self.alarm_dir = None if alarm_dir is None else os.fspath(alarm_dir)
        self._select(model)
        self._join(topology)
        self._install()
        self._tap.record = start_step is None or self.is_audit_step(start_step)
        self._state: Optional[StepState] = None
        self._pre_hook = model.register_forward_pre_hook(self._on_forward)
        self._self_check_due = bool(self_check_every)
        self._audits_since_self_check = 0
        self._last_clean_audit: Optional[int] = None
        self._last_clean_weights: Optional[int] = None
        self._first_step: Optional[int] = None
        self._closed = False
        self.sentinel = Sentinel(sentinel)
        if self.sentinel.config.on_data == "skip" and scaler is not None:
            raise AuditUsageError("screener.audit: SentinelConfig(on_data='skip') drops a step's "
                                  "gradients, which a GradScaler's step refuses; use "
                                  "on_data='proceed' with a scaler")
        self._verified: Optional[tuple[int, Optional[str]]] = None  # last verified save
        self._weights_digest: Optional[tuple[int, str]] = None  # (step, digest) of the last pass
        self.counters: Counter[str] = Counter()

    # ---- set-up -------------------------------------------------------------------------------

    def _select(self, model: torch.nn.Module) -> None:
        """The sharded parameters, the mesh they live on, and the refusals a module decides."""
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.SyncBatchNorm):
                raise AuditUsageError(f"screener.audit: {name or 'the model'} is a SyncBatchNorm, whose "
                                 f"forward is a collective: a replay cannot reproduce it")
        named = [(n, p) for n, p in model.named_parameters()]
        if not named:
            raise AuditUsageError("the model has no parameters to audit")
        self.weight_names = [n for n, _ in named]
        # FSDP2's parameters are DTensors (to_local, full_tensor); Any spares importing DTensor
        self._params: list[Any] = [p for _, p in named]
        hooked = [n for n, p in named if getattr(p, "_post_accumulate_grad_hooks", None)]
        if hooked:  # FSDP runs them after every backward, a replay's too (an extra step)
            raise AuditUsageError(f"screener.audit: parameter {hooked[0]} has a post-accumulate-"
                                  f"grad hook (an optimizer in backward?); a replay's backward "
                                  f"would run it too: step the optimizer after check_gradients")
        first = self._params[0]
        mesh = getattr(first, "device_mesh", None)
        if mesh is None:
            raise AuditUsageError("screener.audit: the model's parameters are not DTensors; shard it "
                             "with torch.distributed.fsdp.fully_shard before the Auditor")
        self.mesh = mesh
        self.hsdp = mesh.ndim == 2
        if mesh.size(mesh.ndim - 1) < 2:
            raise AuditUsageError("screener.audit: the mesh shards over a single rank, so FSDP "
                                  "never reduce-scatters and the audit would see nothing; shard "
                                  "over two or more ranks (or use DDP for pure replication)")
        if mesh.ndim not in (1, 2):
            raise AuditUsageError(f"screener.audit: a {mesh.ndim}-D device mesh is not supported "
                             f"(FSDP2 on a 1-D mesh, or HSDP on a 2-D replicate x shard mesh)")
        local = first.to_local() if hasattr(first, "to_local") else first
        self.device = local.device
        self._comm = comm_device(None, self.device)

    def _join(self, topology: Optional[Topology]) -> None:
        """Where every rank runs, and the refusals that need to know it."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.topology = topology if topology is not None else gather_topology(None,
                                                                             device=self.device)
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        threads = sorted({i.threads for i in self.topology.infos})
        if self.device.type == "cpu" and len(threads) > 1:
            raise AuditUsageError(f"screener.audit: the ranks run {threads} torch threads; replays "
                             f"cannot match bit for bit (one torch.set_num_threads everywhere)")
        if self.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            raise AuditUsageError("screener.audit: on CUDA the audit replays bit for bit only with "
                             "deterministic kernels: torch.use_deterministic_algorithms(True) "
                             "and CUBLAS_WORKSPACE_CONFIG=:4096:8 before the Auditor")
        self._codec = StateCodec(self.device)
        plan = ring.replay_plan(self.topology)
        self._plan = plan
        self._owners_of: dict[int, list[int]] = {}
        for owner, replayer in sorted(plan.items()):
            if replayer is not None:
                self._owners_of.setdefault(replayer, []).append(owner)
        self._rounds = max((len(v) for v in self._owners_of.values()), default=0)
        self.can_replay = self.loss_fn is not None and self._rounds > 0
        if self.audit_every and not self.can_replay:
            log.warning("screener.audit: ring replay is off (%s)", "needs loss_fn"
                        if self.loss_fn is None else "a single rank has nobody to replay")

    def _install(self) -> None:
        """Our recorder as every FSDP module's reduce-scatter, one index per module."""
        cls = _fsdp_module_class()
        # FSDPModule's methods are torch internals the audit reaches into: typed Any
        modules: list[tuple[str, Any]] = [
            (n, m) for n, m in self.model.named_modules() if isinstance(m, cls)]  # type: ignore[arg-type]
        self.module_names: list[str] = []
        self._tap = _Tap(0)
        for name, m in modules:
            state = m._get_fsdp_state()  # noqa: SLF001 - only to skip modules without parameters
            groups = getattr(state, "_fsdp_param_groups", None) or []
            if not groups:
                continue
            if len(groups) > 1:
                raise AuditUsageError(f"screener.audit: FSDP module {name or 'root'} has several "
                                 f"parameter groups (a shard_placement_fn with per-parameter "
                                 f"meshes); the audit needs one reduce-scatter per module")
            m.set_custom_reduce_scatter(_recorder(len(self.module_names), self._tap))
            m.set_all_reduce_hook(self._reduced_hook(getattr(groups[0], "_all_reduce_hook", None)))
            self.module_names.append(name or "root")
        self._tap.n = len(self.module_names)
        self._tap.reset()
        self._tap.replay_fps = torch.zeros(self._tap.n, 2, dtype=torch.int64)

    def _reduced_hook(self, theirs: Optional[Callable[[torch.Tensor], None]]
                      ) -> Callable[[torch.Tensor], None]:
        """FSDP's hook on the reduced gradient (the reduce-scatter output, or for HSDP the
        replicate all-reduce's): learns whether it is finite; a hook of the caller's still runs."""
        tap = self._tap

        def hook(reduced: torch.Tensor) -> None:
            if not tap.replaying:
                finite, mag = _scan(reduced)
                tap.reduced_finite &= finite
                tap.reduced_mag = max(tap.reduced_mag, mag)
            if theirs is not None:
                theirs(reduced)

        return hook

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self._state is None and not self._tap.replaying:
            self._state = capture(self.device, self.scaler)

    def begin_step(self) -> None:
        """Capture the RNG states the step starting now draws from (see the DDP Auditor)."""
        self._state = capture(self.device, self.scaler)

    def close(self) -> None:
        """Remove the forward pre-hook; the reduce-scatter recorders stay (they reduce as FSDP
        would) but stop recording."""
        if not self._closed:
            self._closed = True
            self._pre_hook.remove()
            self._tap.record = False

    def __enter__(self) -> "ShardedAuditor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- cadence ----------------------------------------------------------------------------

    def is_audit_step(self, step: int) -> bool:
        """Whether check 2 runs at this step."""
        return bool(self.audit_every) and self.can_replay and step % self.audit_every == 0

    def is_weights_step(self, step: int) -> bool:
        """Whether check_weights(step) votes at this step."""
        return bool(self.weights_every) and step % self.weights_every == 0

    # ---- check 1 and check 2 -------------------------------------------------------------------

    def check_gradients(self, step: int, loss: Any, *, batch: Any = None,
                        grad_norm: Any = None) -> None:
        """After backward, before optimizer.step(). Collective: every rank, every step.

        batch: this rank's micro-batch of the step (the list of micro-batches with
        accumulation_steps > 1), needed on audit steps unless batch_fn was given; it is sent to
        the replayer only on audit steps. grad_norm is accepted for the DDP signature's sake.
        """
        step = int(step)
        if self._first_step is None:
            self._first_step = step
        loss_t = ring.loss_of(loss) if not isinstance(loss, (int, float)) else torch.tensor(
            float(loss), dtype=torch.float64)
        tap = self._tap
        reduced_ok = tap.reduced_finite
        state = self._state if self._state is not None else StepState(None, None,
                                                                       scaler_scale(self.scaler))
        self._state = None
        local_ok, recorded, own_fps = tap.local_finite, tap.recorded, tap.fps.clone()
        mags = (tap.local_mag, tap.reduced_mag)
        tap.reset()
        tap.record = self.is_audit_step(step + 1)
        self.counters["steps"] += 1
        audit = self.is_audit_step(step)
        if audit and batch is None and self.batch_fn is not None:
            batch = self.batch_fn(self.rank, step)
        data = _encode_batch(batch) if (audit and batch is not None) else None
        status = _OK if data is not None and recorded else (
            _NO_BATCH if data is None else _NOT_RECORDED)
        head = torch.tensor([ring.loss_bits(loss_t), int(local_ok and bool(torch.isfinite(
            loss_t.detach().double()).all())), int(reduced_ok), status,
            0 if data is None else data.numel(), _bits(mags[0]), _bits(mags[1])],
            dtype=torch.int64)
        if audit:
            head = torch.cat([head, self._codec.encode(state)])
        got = gather(head, None, self._comm)
        states = (self._decode_states(got[:, _HEAD:]) if audit else None)
        skipped = self._judge_nonfinite(step, got, state, batch, data)
        if not skipped:
            skipped = self._sentinel_step(step, got, state, batch, data)
        if audit and not skipped:
            self._audit(step, got, states, loss_t, own_fps, batch, data)  # type: ignore[arg-type]

    def _decode_states(self, rows: torch.Tensor) -> dict[int, StepState]:
        return {r: self._codec.decode(rows[k]) for k, r in enumerate(self.topology.ranks)}

    def _audit(self, step: int, got: torch.Tensor, states: dict[int, StepState],
               loss: torch.Tensor, own_fps: torch.Tensor, batch: Any,
               data: Optional[torch.Tensor]) -> None:
        """Check 2: the lockstep replay rounds, the digests, and a referee round on a mismatch."""
        if bool((got[:, _H_STATUS] != _OK).any()):
            self.counters["audits_skipped"] += 1
            missing = [self.topology.ranks[k] for k in range(self.world_size)
                       if int(got[k, _H_STATUS]) == _NO_BATCH]
            log.info("screener.audit: step %d not audited (%s)", step,
                     f"no batch= from rank(s) {missing}" if missing else
                     "gradients were not recorded for it on some rank: steps not consecutive?")
            return
        sizes = {r: int(got[k, _H_BYTES]) for k, r in enumerate(self.topology.ranks)}
        mine = self._owners_of.get(self.rank, [])
        received = self._ship({o: self._plan[o] for o in self.topology.ranks
                               if self._plan[o] is not None}, data, sizes)
        own = torch.cat([torch.tensor([[ring.loss_bits(loss), 1],
                                       [int(got[self.topology.index_of(self.rank), _H_LOCAL_MAG]),
                                        1]]), own_fps])
        records = [own]
        for i in range(self._rounds):
            owner = mine[i] if i < len(mine) else None
            b = received[owner] if owner is not None else batch
            rec = self._lockstep(b, states[owner if owner is not None else self.rank])
            records.append(rec if owner is not None else torch.zeros_like(own))
        self_check = self._self_check_due
        records.append(self._lockstep(batch, states[self.rank]) if self_check
                       else torch.zeros_like(own))
        stacked = torch.stack(records)
        digests = gather(ring.record_digest(stacked), None, self._comm)
        if self_check:
            self._judge_self_check(step, digests)
        index = self.topology.index_of
        slot = {o: self._owners_of[r].index(o) for o, r in self._plan.items() if r is not None}
        mismatched = [o for o, r in sorted(self._plan.items()) if r is not None and not
                      torch.equal(digests[index(o), 0], digests[index(r), 1 + slot[o]])]
        if mismatched:
            self._settle(step, mismatched, stacked, states, slot, batch, data, sizes)
        self._last_clean_audit = step
        self.counters["audits"] += 1
        self._audits_since_self_check += 1
        if self.self_check_every and self._audits_since_self_check >= self.self_check_every:
            self._self_check_due = True

    def _ship(self, send_to: Any, data: Optional[torch.Tensor],
              sizes: dict[int, int]) -> dict[int, Any]:
        """Point to point: each owner's batch to the rank(s) send_to names ({owner: rank} or a
        list of (owner, rank) pairs). Returns the batches this rank received, by owner."""
        ops: list[dist.P2POp] = []
        inbox: dict[int, torch.Tensor] = {}
        pairs = sorted(send_to.items()) if isinstance(send_to, dict) else sorted(set(send_to))
        for owner, dst in pairs:
            if dst is None or dst == owner or (dst == self.rank and owner in inbox):
                continue
            if owner == self.rank and data is not None:
                ops.append(dist.P2POp(dist.isend, data.to(self._comm), dst))
            if dst == self.rank:
                inbox[owner] = torch.empty(sizes[owner], dtype=torch.uint8, device=self._comm)
                ops.append(dist.P2POp(dist.irecv, inbox[owner], owner))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.counters["batch_bytes_received"] += sum(t.numel() for t in inbox.values())
        return {o: _decode_batch(t, self.device) for o, t in inbox.items()}

    def _lockstep(self, batch: Any, state: StepState) -> torch.Tensor:
        """One replay: forward and backward of `batch` through the model from `state`, on every
        rank at once; the reduce-scatter inputs are recorded and not reduced, and the sharded
        gradients and buffers are put back. Returns the record (1 + modules, 2)."""
        assert self.loss_fn is not None
        grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in self._params]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        micro = list(batch) if self.accumulation_steps > 1 else [batch]
        tap = self._tap
        tap.replaying = True
        tap.replay_finite = True
        tap.replay_mag = 0.0
        tap.replay_fps.zero_()
        total: Optional[torch.Tensor] = None
        try:
            with restored(state, self.device), torch.enable_grad():
                for i, mb in enumerate(micro):
                    if self.accumulation_steps > 1:
                        self.root.set_requires_gradient_sync(i == len(micro) - 1)
                    loss = ring.loss_of(self.loss_fn(self.model, mb))
                    total = loss.detach() if total is None else total + loss.detach()
                    out = loss if state.scale is None else loss * torch.full(
                        (1,), state.scale, dtype=torch.float32, device=loss.device)
                    out.reshape(()).backward()
        finally:
            tap.replaying = False
            self.root.set_requires_gradient_sync(True)
            with torch.no_grad():
                for p, saved in grads:
                    p.grad = saved
                for b, saved_b in buffers:
                    b.copy_(saved_b)
        assert total is not None
        return torch.cat([torch.tensor([[ring.loss_bits(total), 1], [_bits(tap.replay_mag), 1]]),
                          tap.replay_fps.clone()])

    def _judge_self_check(self, step: int, digests: torch.Tensor) -> None:
        """Every rank's record of its own step against its own replay of it."""
        self._self_check_due = False
        self._audits_since_self_check = 0
        self.counters["self_checks"] += 1
        ranks = self.topology.ranks
        odd = [ranks[k] for k in range(len(ranks)) if not torch.equal(digests[k, 0],
                                                                       digests[k, -1])]
        if odd:
            self._numeric(step, odd, {"check": "self_replay", "ranks": odd}, reason=(
                f"step {step} does not reproduce on the rank that ran it (rank(s) "
                f"{', '.join(map(str, odd))}): no replay can judge the hardware; "
                f"{LIKELY_CAUSES}"))

    def _settle(self, step: int, mismatched: list[int], stacked: torch.Tensor,
                states: dict[int, StepState], slot: dict[int, int], batch: Any,
                data: Optional[torch.Tensor], sizes: dict[int, int]) -> None:
        """Referees on a third node replay the mismatched owners in lockstep; full records."""
        topo = self.topology
        referee = {o: ring.referee_of(topo, o, self._plan[o]) for o in mismatched}
        received = self._ship(referee, data, sizes)
        by_referee: dict[int, list[int]] = {}
        for o, r in referee.items():
            if r is not None:
                by_referee.setdefault(r, []).append(o)
        rounds = max((len(v) for v in by_referee.values()), default=0)
        extra = []
        for i in range(rounds):
            mine = by_referee.get(self.rank, [])
            owner = mine[i] if i < len(mine) else None
            rec = self._lockstep(received[owner] if owner is not None else batch,
                                 states[owner if owner is not None else self.rank])
            extra.append(rec if owner is not None else torch.zeros_like(rec))
        full = gather(torch.cat([stacked] + ([torch.stack(extra)] if extra else [])), None,
                      self._comm)
        index = topo.index_of
        suspects: set[int] = set()
        unsettled: set[int] = set()
        cases = []
        for o in mismatched:
            r, ref = self._plan[o], referee[o]
            a, b = full[index(o), 0], full[index(r), 1 + slot[o]]  # type: ignore[arg-type]
            c = None if ref is None else full[index(ref), stacked.shape[0]
                                              + by_referee[ref].index(o)]
            cases.append(self._case(o, r, ref, a, b, c, suspects, unsettled))  # type: ignore[arg-type]
        named = sorted(suspects)
        evidence = {"mismatches": cases, "audit_every": self.audit_every,
                    "last_clean_audit": self._last_clean_audit, "sharding":
                    "hsdp" if self.hsdp else "fsdp"}
        one_gpu = len(topo.nodes) >= 3 and bool(set.intersection(
            *({o, self._plan[o]} for o in mismatched)))
        if 2 * len(mismatched) > self.world_size and not one_gpu:
            self._numeric(step, sorted(mismatched), evidence, reason=(
                f"{len(mismatched)} of {self.world_size} ranks disagree with their replays at "
                f"step {step}: the replays do not reproduce the training step; {LIKELY_CAUSES}"))
        self._raise(SDCAlarm("ring_replay", step, named, topo.suspect_nodes(named),
                             bool(named) and not unsettled, evidence,
                             candidate_ranks=sorted(suspects | unsettled),
                             first_suspect_step=self._window(self._last_clean_audit, step),
                             key=self._key("ring_replay", step)))

    def _case(self, o: int, r: int, ref: Optional[int], a: torch.Tensor, b: torch.Tensor,
              c: Optional[torch.Tensor], suspects: set[int], unsettled: set[int]
              ) -> dict[str, Any]:
        differ = ring.differing_rows(a, b)
        case: dict[str, Any] = {
            "owner": o, "replayer": r, "referee": ref,
            "differs": [("loss" if k == 0 else "largest gradient magnitude" if k == 1 else
                         self.module_names[k - 2]) for k in differ][
                :_MAX_NAMES], "n_differ": len(differ)}
        case["verdict"] = ring.settle(o, r, ref, a, b, c, suspects, unsettled)
        return case

    # ---- between audits: the sentinel ------------------------------------------------------------

    def _sentinel_step(self, step: int, got: torch.Tensor, state: StepState, batch: Any,
                       data: Optional[torch.Tensor]) -> bool:
        """The spike test on every step (sentinel.py); when it fires, attribute the step before
        the update. Returns True when the step's gradients were dropped (a data spike with
        on_data="skip"); raises SDCAlarm when a rank's hardware did it."""
        losses = [abs(_float(x)) for x in got[:, _H_LOSS]]
        reduced = max(_float(x) for x in got[:, _H_REDUCED_MAG])
        spike = self.sentinel.check(max(losses), reduced)
        if spike is None:
            return False
        self.counters["sentinel_fired"] += 1
        ranks = self.topology.ranks
        column = losses if spike.what == "loss" else [_float(x) for x in got[:, _H_LOCAL_MAG]]
        suspect = ranks[max(range(len(ranks)), key=lambda k: column[k])]
        outcome = self._attribute(step, spike, suspect, got, state, batch, data)
        log_json(logging.WARNING, "sentinel", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, spike=spike.to_dict(), suspect=suspect,
                 outcome=outcome)
        self.counters[f"sentinel_{outcome}"] += 1
        self.sentinel.accept("loss", max(losses))
        self.sentinel.accept("grad", reduced)
        if outcome == "data" and self.sentinel.config.on_data == "skip":
            for p in self._params:
                p.grad = None
            return True
        return False

    def _attribute(self, step: int, spike: Spike, suspect: int, got: torch.Tensor,
                   state: StepState, batch: Any, data: Optional[torch.Tensor]) -> str:
        """One lockstep round: the suspect reruns its step, a rank on another node and a
        referee on a third replay it. Returns "data" or "unattributed"; raises on a fault."""
        if data is None and (batch is not None or self.batch_fn is not None):
            batch = batch if batch is not None else self.batch_fn(self.rank, step)  # type: ignore[misc]
            data = _encode_batch(batch)
        head = torch.cat([torch.tensor([int(data is not None),
                                        0 if data is None else data.numel()]),
                          self._codec.encode(state)])
        hg = gather(head, None, self._comm)
        if not (self.can_replay and bool(hg[:, 0].all())):
            return "unattributed"  # nothing to rerun with: a spike alone is no verdict
        states = self._decode_states(hg[:, 2:])
        sizes = {r: int(hg[k, 1]) for k, r in enumerate(self.topology.ranks)}
        confirmer = self._confirmer(suspect, {suspect})
        referee = ring.referee_of(self.topology, suspect, confirmer)
        helpers = [r for r in (confirmer, referee) if r is not None]
        received = self._ship([(suspect, r) for r in helpers], data, sizes)
        mine = received.get(suspect) if self.rank in helpers else batch
        rec = self._lockstep(mine, states[suspect if self.rank in helpers else self.rank])
        full = gather(rec, None, self._comm)
        index = self.topology.index_of
        original = (int(got[index(suspect), _H_LOSS]), int(got[index(suspect), _H_LOCAL_MAG]))
        rerun = full[index(suspect)]
        # The other ranks reran their own steps in the same round: they must reproduce them, or
        # no rerun can judge anything.
        others = [r for r in self.topology.ranks if r not in [suspect] + helpers]
        odd = [r for r in others if int(full[index(r), 1, 0]) != int(got[index(r), _H_LOCAL_MAG])]
        if odd:
            self._numeric(step, odd, {"check": "spike_rerun", "ranks": odd}, reason=(
                f"step {step} does not reproduce on rank(s) {', '.join(map(str, odd))} that "
                f"reran it, so no rerun can judge the spike on rank {suspect}; {LIKELY_CAUSES}"))
        verdict = rerun_verdict(original, _rerun_key(rerun),
                                [None if r is None else _rerun_key(full[index(r)])
                                 for r in (confirmer, referee)])
        if verdict == "data":
            return "data"
        evidence = {"spike": spike.to_dict(), "suspect": suspect, "confirmer": confirmer,
                    "referee": referee, "verdict": verdict,
                    "loss": {"original": _float(original[0]), "rerun": _float(rerun[0, 0])},
                    "largest_gradient": {"original": _float(original[1]),
                                         "rerun": _float(rerun[1, 0])},
                    "rollback_target": self._verified[1] if self._verified else None,
                    "last_verified_step": self._verified[0] if self._verified else None}
        named = [suspect] if verdict in ("transient", "persistent") else []
        proven = bool(others) or self.counters["self_checks"] > 0  # steps reproduce here
        evidence["reproduced_by"] = others
        settled = bool(named) and referee is not None and proven
        self._raise(SDCAlarm("spike_rerun", step, named if settled else (),
                             self.topology.suspect_nodes(named) if settled else (), settled,
                             evidence, candidate_ranks=named if settled else [suspect] + helpers,
                             first_suspect_step=step, key=self._key("spike_rerun", step)))
        return verdict  # not reached

    def verified_save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """Run the weight check for `step` (forced), then save_fn(); a failing check raises
        SDCAlarm and nothing is saved. The path save_fn returns is the rollback target a later
        spike alarm carries."""
        step = int(step)
        self.check_weights(step, force=True)
        assert self._weights_digest is not None and self._weights_digest[0] == step
        result = save_fn()
        path = os.fspath(result) if isinstance(result, (str, os.PathLike)) else None
        if path is not None:  # a marker next to it, so rollback_target trusts it (as for DDP)
            write_marker(path, step=step, weights_digest=self._weights_digest[1], job=self.job)
        self._verified = (step, path)
        self.counters["verified_saves"] += 1
        return result

    # ---- non-finite -----------------------------------------------------------------------------

    def _judge_nonfinite(self, step: int, got: torch.Tensor, state: StepState, batch: Any,
                         data: Optional[torch.Tensor]) -> bool:
        """Check 1 on the gathered flags; raises on a verdict. Returns True when the loss scaler
        owns the step (it skips it; so does the audit), False when all is finite."""
        ranks = self.topology.ranks
        bad_local = [ranks[k] for k in range(self.world_size) if int(got[k, _H_LOCAL]) == 0]
        bad_reduced = [ranks[k] for k in range(self.world_size) if int(got[k, _H_REDUCED]) == 0]
        if not bad_local and not bad_reduced:
            return False
        scaling = self.scaler is not None and bool(self.scaler.is_enabled())
        if bad_local and scaling and len(bad_local) == self.world_size:
            self.counters["scaler_skipped"] += 1
            return True
        if not bad_local:
            return self._nonfinite_reduced(step, got, bad_reduced, scaling)
        self._nonfinite_local(step, bad_local, state, batch, data, scaling)
        return True

    def _nonfinite_reduced(self, step: int, got: torch.Tensor, seeing: list[int],
                           scaling: bool) -> bool:
        """Every local gradient finite, a reduced one NaN/Inf. No element of a sum exceeds the
        sum of the addends' largest magnitudes (taken after FSDP's pre-division): past the
        reduce dtype's largest value the sum overflowed, which is the loss scaler's business (it
        skips the step: True) or a numeric failure; below it the reduction made the NaN/Inf."""
        ranks = sorted(self.topology.ranks)
        bound = sum(_float(x) for x in got[:, _H_LOCAL_MAG])
        top = float(torch.finfo(self._tap.reduce_dtype).max)
        evidence: dict[str, Any] = {"ranks_seeing_nonfinite": seeing, "local_magnitude_sum": bound,
                                    "reduce_dtype": str(self._tap.reduce_dtype)}
        if bound >= top:
            evidence["why"] = (f"every local gradient was finite, but their largest magnitudes "
                               f"add up to {bound:.3g}, past the largest "
                               f"{self._tap.reduce_dtype}: the sum overflowed")
            if scaling:
                self.counters["scaler_skipped"] += 1
                return True
            self._numeric(step, ranks, evidence, reason=(
                f"the gradients' sum overflowed {self._tap.reduce_dtype} at step {step}: the "
                f"gradients are too large for the reduce dtype, not corrupted"))
        evidence["why"] = ("every local gradient was finite and their sum cannot overflow; the "
                           "reduce-scatter produced NaN/Inf, which does not say on which link or "
                           "GPU, so no rank is named")
        self._raise(SDCAlarm("nonfinite_reduced", step, (), (), False, evidence,
                             candidate_ranks=ranks, key=self._key("nonfinite_reduced", step)))
        return False  # not reached

    def _nonfinite_local(self, step: int, flagged: list[int], state: StepState, batch: Any,
                         data: Optional[torch.Tensor], scaling: bool) -> None:
        """Replay each flagged owner on another node (one lockstep round): finite there names it."""
        key = self._key("nonfinite_local", step)
        evidence: dict[str, Any] = {"flagged_ranks": flagged}
        have = batch is not None or self.batch_fn is not None
        if data is None and have:
            batch = batch if batch is not None else self.batch_fn(self.rank, step)  # type: ignore[misc]
            data = _encode_batch(batch)
        head = torch.cat([torch.tensor([int(data is not None),
                                        0 if data is None else data.numel()]),
                          self._codec.encode(state)])
        got = gather(head, None, self._comm)
        if not (self.can_replay and self.confirm_nonfinite and bool(got[:, 0].all())):
            if scaling:
                self.counters["scaler_skipped"] += 1
                return
            if len(flagged) == self.world_size:
                self._numeric(step, flagged, evidence)
            evidence["why"] = "no replay to confirm (no loss_fn, or a rank gave no batch)"
            self._raise(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                 candidate_ranks=flagged, key=key))
        states = self._decode_states(got[:, 2:])
        sizes = {r: int(got[k, 1]) for k, r in enumerate(self.topology.ranks)}
        plan = {o: self._confirmer(o, set(flagged)) for o in flagged}
        received = self._ship(plan, data, sizes)
        owners_here = [o for o in flagged if plan[o] == self.rank]
        rounds = max(Counter(r for r in plan.values() if r is not None).values(), default=0)
        results = torch.full((len(flagged),), -1, dtype=torch.int64)
        for i in range(rounds):
            owner = owners_here[i] if i < len(owners_here) else None
            rec, finite = self._confirm_one(received.get(owner) if owner is not None else batch,
                                            states[owner if owner is not None else self.rank])
            if owner is not None:
                results[flagged.index(owner)] = int(finite)
        got = gather(results, None, self._comm).max(dim=0).values
        confirmed = [o for i, o in enumerate(flagged) if int(got[i]) == 1]
        reproduced = [o for i, o in enumerate(flagged) if int(got[i]) == 0]
        evidence.update(confirmed_by_replay=confirmed, reproduced_ranks=reproduced,
                        confirmers={str(o): plan[o] for o in flagged})
        if confirmed:
            evidence["why"] = "non-finite here, finite when replayed on another node"
            self._raise(SDCAlarm("nonfinite_local", step, confirmed,
                                 self.topology.suspect_nodes(confirmed), True, evidence,
                                 candidate_ranks=confirmed, key=key))
        if scaling:
            self.counters["scaler_skipped"] += 1
            return
        evidence["why"] = "the replay on another node is non-finite too: the data or the model"
        self._numeric(step, reproduced or flagged, evidence)

    def _confirm_one(self, batch: Any, state: StepState) -> tuple[torch.Tensor, bool]:
        """A lockstep replay whose result is whether loss and gradients came out finite."""
        rec = self._lockstep(batch, state)
        loss = ring.bits_to_float(int(rec[0, 0]))
        return rec, loss == loss and abs(loss) != float("inf") and self._tap.replay_finite

    def _confirmer(self, owner: int, flagged: set[int]) -> Optional[int]:
        """Who replays a non-finite owner: its ring replayer, else a clean rank on another node."""
        first = self._plan.get(owner)
        topo = self.topology
        if first is not None and first not in flagged and topo.node_of(first) != \
                topo.node_of(owner):
            return first
        for node in topo.nodes:
            if node == topo.node_of(owner):
                continue
            for r in topo.ranks_on(node):
                if r not in flagged:
                    return r
        return first

    # ---- check 3 -------------------------------------------------------------------------------

    def check_weights(self, step: int, *, force: bool = False) -> None:
        """After optimizer.step(): HSDP votes each shard across its replicas; pure FSDP checks
        that every rank all-gathers the same full weights (see the module docstring)."""
        step = int(step)
        if not force and not self.is_weights_step(step):
            return
        self.counters["weight_checks"] += 1
        if self.hsdp:
            rows = fingerprints([p.to_local() for p in self._params])
            groups = self._shard_groups()
        else:
            with torch.no_grad():  # one full parameter at a time: never the whole model at once
                rows = torch.cat([fingerprints([p.full_tensor()]) for p in self._params])
            groups = [list(self.topology.ranks)]
        full = gather(rows, None, self._comm)  # (world, P, 2)
        index, ranks = self.topology.index_of, self.topology.ranks
        outliers: list[int] = []
        unsettled: list[list[int]] = []
        differing: dict[str, Any] = {}
        for members in groups:
            result = vote([full[index(r)] for r in members])
            if result.agree:
                continue
            if not result.settled:
                unsettled.append(members)
                continue
            ref = full[index(members[result.majority[0]])]
            for i in result.outliers:
                r = members[i]
                rows_differ = (full[index(r)] != ref).any(dim=1).nonzero().flatten().tolist()
                differing[str(r)] = {"parameters": [self.weight_names[k] for k in rows_differ][
                    :_MAX_NAMES], "count": len(rows_differ)}
                outliers.append(r)
        if not outliers and not unsettled:
            self._last_clean_weights = step
            # the same on every rank: the gathered fingerprints of the weights just checked
            flat = full.reshape(-1, 2).tolist()
            self._weights_digest = (step, digest({f"{k // len(self._params)}/"
                                                  f"{self.weight_names[k % len(self._params)]}":
                                                  (a, b) for k, (a, b) in enumerate(flat)}))
            return
        evidence = {"differing": differing, "unsettled_groups": unsettled,
                    "compared": "shard replicas (HSDP)" if self.hsdp else
                    "full weights all-gathered on every rank (FSDP)",
                    "last_clean_weights": self._last_clean_weights}
        first = self._window(self._last_clean_weights, step)
        if outliers and not unsettled:
            named = sorted(outliers)
            self._raise(SDCAlarm("weights", step, named, self.topology.suspect_nodes(named), True,
                                 evidence, candidate_ranks=named, first_suspect_step=first,
                                 key=self._key("weights", step)))
        self._raise(SDCAlarm("weights", step, (), (), False, evidence,
                             candidate_ranks=sorted(set(outliers) | {r for g in unsettled
                                                                     for r in g}),
                             first_suspect_step=first, key=self._key("weights", step)))

    def _shard_groups(self) -> list[list[int]]:
        """HSDP: the global ranks that hold the same shard (one per replica), for every shard."""
        mesh = self.mesh.mesh  # (replicate, shard) tensor of global ranks
        return [sorted(int(x) for x in mesh[:, j].tolist()) for j in range(mesh.shape[1])]

    # ---- alarms ---------------------------------------------------------------------------------

    def _window(self, last_clean: Optional[int], step: int) -> int:
        if last_clean is not None:
            return last_clean + 1
        return self._first_step if self._first_step is not None else step

    def _key(self, check: str, step: int) -> str:
        return f"{self.job}-{check}-s{step}" if self.job else f"{check}-s{step}"

    def _numeric(self, step: int, ranks: list[int], evidence: dict[str, Any],
                 reason: Optional[str] = None) -> None:
        log_json(logging.ERROR, "numeric_failure", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, ranks=ranks, reason=reason, evidence=evidence)
        raise NumericFailure(step, ranks, evidence, reason)

    def _raise(self, alarm: SDCAlarm) -> None:
        """As the DDP Auditor: the blast-radius rule, this node's alarm file, one log line."""
        topo = self.topology
        node_of = {r: topo.node_of(r) for r in topo.ranks}
        if alarm.settled:
            wide = too_wide(alarm.suspect_ranks, node_of, self.world_size)
            if wide is not None:
                self._numeric(alarm.step, list(alarm.suspect_ranks),
                              {"alarm": alarm.to_dict(), "why": wide}, reason=(
                                  f"{alarm.check} would name rank(s) "
                                  f"{', '.join(map(str, alarm.suspect_ranks))}, but {wide}; "
                                  f"{LIKELY_CAUSES}"))
        files: list[str] = []
        records = node_records(alarm, node_of, {n: topo.suspect_node(topo.ranks_on(n)[0])
                                                for n in topo.nodes}, job=self.job)
        record = records.get(self.node)
        if record is not None and topo.writer_of(self.node) == self.rank:
            try:
                files.append(str(write_alarm_file(record, alarm_dir(self.alarm_dir))))
            except OSError as e:
                log_json(logging.ERROR, "alarm_file_failed", rank=self.rank,
                         hostname=self.hostname, node=self.node, error=f"{e}")
        log_json(logging.ERROR, "sdc_alarm", rank=self.rank, hostname=self.hostname,
                 node=self.node, files=files, alarm=alarm.to_dict())
        raise alarm


def _rerun_key(record: torch.Tensor) -> Rerun:
    """A replay record (loss row, magnitude row, module fingerprints) as a Rerun."""
    d = fingerprints([record[2:]])[0]
    return int(record[0, 0]), int(record[1, 0]), int(d[0]), int(d[1])
