"""The Auditor: the three in-job SDC checks wired into a PyTorch DDP training loop.

    auditor = Auditor(ddp_model, loss_fn=compute_loss, batch_fn=batch_for,
                      audit_every=50, weights_every=100)
    for step in range(start, total):
        optimizer.zero_grad(set_to_none=True)
        loss = compute_loss(ddp_model, batch_for(rank, step))
        loss.backward()
        auditor.check_gradients(step, loss)   # check 1 every step, check 2 on audit steps
        optimizer.step()
        auditor.check_weights(step)           # check 3 every weights_every steps

Check 1 (every step): one all_gather of (loss, local gradient's largest magnitude, reduced
gradient's) per rank. The comm hook (hooks.py) learns both gradients' finiteness from the one pass
that divides the summed buckets by the world size, and measures magnitudes only when something is
not finite (0 stands for a gradient known finite). Finiteness is always a property of the values,
never of a norm that could overflow (a finite gradient of 1e20 is finite). A rank whose loss or
local gradient is NaN/Inf is flagged; its micro-batch is then replayed on another node: a finite
replay names the rank (settled, "nonfinite_local"), a non-finite one means the model or data
produced it (NumericFailure, exit 76).
A non-finite reduced gradient while every local one was finite means the reduction is suspect:
"nonfinite_reduced", nobody named; the candidates are every rank when every rank sees it, else
the ranks that do (an all-reduce gives every rank the same result).

Check 2 (steps where step % audit_every == 0): ring replay (see ring.py). Each rank replays its
assigned owners' micro-batches; small digests of the records (loss bits plus a digest of the
gradient fingerprints) ride in check 1's all_gather, so an audit step costs no extra collective
unless something differs. Only on a mismatch does a second round run: referees on a third node
replay, full records are gathered, and the result that differs from the other two names the
suspect ("ring_replay"). With fewer than three nodes the mismatch is reported unsettled.

Check 3 (steps where step % weights_every == 0, and in verified_save): each rank fingerprints its
weights; one all_gather of a digest of those fingerprints; on disagreement the full fingerprints are
gathered and a strict majority names the odd replicas ("weights").

Which step a backward belongs to: the hook runs before the loop says which step it is in, so the
auditor expects consecutive steps (the step after the last checked one; the first backward always
records fingerprints unless start_step is given). An audit step whose fingerprints were not recorded
is skipped (counted in `counters["audits_skipped"]`), the same way on every rank.

What a replay reproduces (capture.py): the RNG states the owner's step started from (CPU and the
current CUDA device; captured by a forward pre-hook on the DDP model, or by begin_step()) and the
GradScaler's loss scale, both sent to the replayers in a first all_gather of the audit step, so
plain nn.Dropout and fp16 with a GradScaler replay bit for bit. With gradient accumulation
(accumulation_steps=k) batch_fn returns the k micro-batches and the replay adds their gradients in
order, as .grad does.

Loss scaling (scaler=GradScaler): a step on which every rank's gradient overflowed is the scaler's
business (it skips the optimizer step): no alarm, counted in counters["scaler_skipped"]. Some ranks
only: each is replayed at its own scale on another node; an overflow there too means the data did
it (no alarm, counted), a finite replay is evidence against the owner.

Self-check (self_check_every): on the first audit step and every self_check_every audits after,
each rank also replays its own step; a step that does not reproduce on its own rank is
nondeterministic, which is no hardware verdict: NumericFailure (exit 76). The same for a settled
verdict wider than one node or half the ranks (blast.py): silent data corruption is local.

Setups that cannot be replayed bit for bit are refused at construction with one line
(AuditUsageError, exit 2; refusals.py): torch.compile around the DDP model (found on the first
forward when the Auditor was given the DDP model itself), SyncBatchNorm, CUDA without
deterministic algorithms, ranks with different torch thread counts. Reentrant checkpointing is
replayed with a backward pass (ring.py).

Both checks raise SDCAlarm (after the alarm files are written and one JSON line is logged per rank);
nothing is applied to the model by the auditor, so raising before optimizer.step() keeps the step from
running. Every verdict comes from gathered data, so all ranks raise the same alarm at the same step.
A replay that fails with an exception on any rank raises AuditError on every rank: our own failure,
never a hardware verdict (exit 1, guard.py).

Limits: parameters DDP ignores are not checked; buffers are restored after a replay but not sent
to the replayer, so a forward that reads buffers which differ between ranks (an eval-mode BatchNorm
with broadcast_buffers=False) is not reproducible (the self-check says so); optimizer.zero_grad
must set gradients to None (the default since torch 2.0).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit import ring
from screener.audit.blast import LIKELY_CAUSES, too_wide
from screener.audit.capture import StateCodec, StepState, capture, scaler_scale
from screener.audit.alarms import AuditError, AuditUsageError, NumericFailure, SDCAlarm, \
    alarm_dir, log_json, node_records, write_alarm_file
from screener.audit.checkpoints import write_marker
from screener.audit.collective import comm_device, gather
from screener.audit.hooks import GradientRecorder, StepStats, largest_magnitude
from screener.audit.refusals import COMPILED_AROUND_DDP, refuse_compiled_wrapper, \
    refuse_placement, refuse_unreplayable
from screener.audit.sentinel import SentinelConfig, Sentinel, Spike, rerun_verdict
from screener.audit.sharded import ShardedAuditor, is_sharded
from screener.audit.topology import Topology, gather_topology, job_name
from screener.audit.vote import vote
from screener.fingerprint import digest, fingerprints

__all__ = ["Auditor", "AuditConfig", "AuditError", "AuditUsageError"]

log = logging.getLogger("screener.audit")

_UNKNOWN = -1  # fingerprints recorded for a backward whose step was not known in advance
_GROUP = object()  # reduce_state default: the auditor's process group
_MAX_NAMES = 8  # parameter names listed in evidence per disagreement
_OK, _FAILED, _NOT_RECORDED = 0, 1, 2  # a rank's status on an audit step
_USAGE = 2  # a replay failed with an AuditUsageError (beside _OK and _FAILED in error flags)


@dataclass(frozen=True)
class AuditConfig:
    """How often the periodic checks run; 0 turns the periodic form of a check off."""

    audit_every: int = 50
    weights_every: int = 100
    check_reduced: bool = True  # check 1's second half: the reduced gradient
    confirm_nonfinite: bool = True  # replay a non-finite rank's micro-batch before naming it
    accumulation_steps: int = 1  # micro-batches per step (no_sync gradient accumulation)
    self_check_every: int = 20  # audits between self-checks (the first audit always); 0: never
    job: str = ""
    alarm_dir: Optional[str] = None  # None: $SCREENER_ALARM_DIR, else the default

    def __post_init__(self) -> None:
        if not isinstance(self.accumulation_steps, int) or self.accumulation_steps < 1:
            raise AuditUsageError(f"screener.audit: accumulation_steps must be an integer >= 1, "
                                  f"not {self.accumulation_steps!r}")
        for name in ("audit_every", "weights_every", "self_check_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise AuditUsageError(f"screener.audit: {name} must be an integer >= 0, not "
                                      f"{v!r}")


def _num(x: float) -> Any:
    """A float for JSON evidence: non-finite values as strings ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)


def _error_flag(error: Optional[BaseException]) -> int:
    """What a rank tells the others about its replays: _OK, _USAGE or _FAILED."""
    if error is None:
        return _OK
    return _USAGE if isinstance(error, AuditUsageError) else _FAILED


def _hex64(bits: int) -> str:
    return f"0x{bits & 0xFFFFFFFFFFFFFFFF:016x}"


def _ddp_forward_context(model: torch.nn.Module) -> Any:
    """The context DDP's own forward runs its module in (DDP._inside_ddp_forward: it names the
    active DDP model to torch.compile). A replay that compiles a new graph of a compiled module
    (a shape the step has not run here) then compiles it as the training step did, split at
    DDP's buckets by dynamo's DDPOptimizer; outside it, one unsplit graph, whose fused kernels
    may round differently. No effect on an eager module."""
    inside = getattr(model, "_inside_ddp_forward", None)
    if inside is None or getattr(model, "_use_python_reducer", False):
        return contextlib.nullcontext()
    return inside()


class Auditor:
    """In-job SDC checks for a DistributedDataParallel model; see the module docstring.

    model: the DDP-wrapped model (the auditor registers a comm hook on it: construct the auditor
    before the first backward, and pass any reduction hook of your own as reduce_hook).
    loss_fn(module, batch) -> scalar loss; batch_fn(global_rank, step) -> that rank's micro-batch.
    Without both, ring replay is off and non-finite ranks are reported unsettled.
    process_group: the DDP's group unless given (WORLD by default). reduce_hook(state, bucket):
    the reduction the comm hook hands each bucket to after recording (default torch's
    allreduce_hook), called with reduce_state (default: the process group). topology: a Topology
    already gathered for this group (skips the start-up all_gather_object).
    scaler: the torch.amp.GradScaler the loop scales its loss with (its scale is used by every
    replay; overflow steps are the scaler's business). accumulation_steps: micro-batches per step
    when the loop accumulates gradients under ddp.no_sync(); batch_fn then returns the list of
    them, loss_fn returns one micro-batch's loss as it is backpropagated (divided by k if the loop
    divides), and check_gradients gets the sum of those losses. self_check_every: see the module
    docstring. Refuses (AuditUsageError, one line, exit 2) a setup it cannot replay bit for bit.
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> Any:
        # One entry point: a model sharded with fully_shard (FSDP2, HSDP) gets the sharded audit.
        if cls is Auditor and model is not None and is_sharded(model):
            return ShardedAuditor(model, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
                 batch_fn: Optional[Callable[[int, int], Any]] = None,
                 audit_every: int = 50, weights_every: int = 100,
                 process_group: Optional[dist.ProcessGroup] = None,
                 reduce_hook: Optional[Callable[[Any, Any], Any]] = None,
                 reduce_state: Any = _GROUP, start_step: Optional[int] = None,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 check_reduced: bool = True, confirm_nonfinite: bool = True,
                 topology: Optional[Topology] = None, scaler: Any = None,
                 accumulation_steps: int = 1, self_check_every: int = 20,
                 sentinel: Optional[SentinelConfig] = None) -> None:
        refuse_compiled_wrapper(model)
        module = getattr(model, "module", None)
        if not isinstance(module, torch.nn.Module) or not hasattr(model, "register_comm_hook"):
            raise AuditUsageError(f"screener.audit: the Auditor audits a DistributedDataParallel "
                                  f"model, or one sharded with fully_shard (FSDP2 on a 1-D "
                                  f"mesh, HSDP on a 2-D one), not {type(model).__name__}")
        self.config = AuditConfig(audit_every=audit_every, weights_every=weights_every,
                                  check_reduced=check_reduced, confirm_nonfinite=confirm_nonfinite,
                                  accumulation_steps=accumulation_steps,
                                  self_check_every=self_check_every,
                                  job=job_name() if job is None else job,
                                  alarm_dir=None if alarm_dir is None else os.fspath(alarm_dir))
        self.model = model
        self.module: torch.nn.Module = module
        self.loss_fn = loss_fn
        self.batch_fn = batch_fn
        if scaler is not None and not all(hasattr(scaler, a) for a in ("get_scale", "is_enabled",
                                                                       "scale")):
            raise AuditUsageError(f"screener.audit: scaler must be a torch.amp.GradScaler, not "
                                  f"{type(scaler).__name__}")
        self.scaler = scaler
        self.sentinel = Sentinel(sentinel)
        if self.sentinel.config.on_data == "skip" and scaler is not None:
            raise AuditUsageError("screener.audit: SentinelConfig(on_data='skip') drops a step's "
                                  "gradients, which a GradScaler's step refuses (no inf checks "
                                  "recorded); use on_data='proceed' with a scaler")
        self._audit_head: Optional[torch.Tensor] = None
        refuse_unreplayable(module)
        self.group = process_group if process_group is not None \
            else getattr(model, "process_group", None)
        self._select_parameters(model, module)
        self._join(topology)  # a collective: every rank reaches it, in this order
        self._plan_replays()
        self._install_hook(model, reduce_hook, reduce_state, check_reduced, start_step)

        # The RNG states and loss scale the current step started from (capture.py): taken by the
        # first forward after the last check_gradients, or by begin_step().
        self._state: Optional[StepState] = None
        self._compiled_around = False  # the DDP model ran inside torch.compile (refusals.py)
        self._replay_mode = ring.ReplayMode()  # learns once that replays need a backward pass
        self._pre_hook = model.register_forward_pre_hook(self._on_forward)
        self._self_check_due = bool(self.config.self_check_every)
        self._audits_since_self_check = 0
        self._closed = False

        self._first_step: Optional[int] = None
        self._last_clean_audit: Optional[int] = None
        self._last_clean_weights: Optional[int] = None
        self._verified: Optional[tuple[int, str]] = None  # (step, weights digest) of the last pass
        self._verified_path: Optional[str] = None  # what the last verified save wrote
        self.counters: Counter[str] = Counter()

    # ---- set-up, in the order __init__ runs it ---------------------------------------------------

    def _select_parameters(self, model: torch.nn.Module, module: torch.nn.Module) -> None:
        """The weights the vote checks and the gradients the replay compares (DDP's ignored
        parameters excluded), and the dtype whose range bounds a gradient sum."""
        ignore = set(getattr(model, "parameters_to_ignore", None) or ())
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        if not named:
            raise AuditUsageError("screener.audit: the model has no parameters to audit")
        self.weight_names = [n for n, _ in named]
        self._weights = [p for _, p in named]
        self.grad_names = [n for n, p in named if p.requires_grad]
        self._grad_params = [p for _, p in named if p.requires_grad]
        self.device = self._weights[0].device
        # the narrowest gradient dtype: past its largest value a gradient sum may overflow
        self._grad_dtype = min((p.dtype for p in self._grad_params or self._weights),
                               key=lambda d: torch.finfo(d).max)
        self._grad_max = float(torch.finfo(self._grad_dtype).max)
        self._comm = comm_device(self.group, self.device)

    def _join(self, topology: Optional[Topology]) -> None:
        """Where every rank runs (one all_gather_object unless given), and the refusals that need
        to know it: a setup whose replays cannot match bit for bit is refused here, on every rank
        alike, never alarmed on later."""
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.group)
        self.topology = topology if topology is not None \
            else gather_topology(self.group, device=self.device)
        if self.topology.world_size != self.world_size:
            raise AuditUsageError(f"screener.audit: topology has {self.topology.world_size} ranks, "
                                  f"the process group {self.world_size}")
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        refuse_placement(self.device, [i.threads for i in self.topology.infos])
        self._codec = StateCodec(self.device)

    def _plan_replays(self) -> None:
        """Who replays whose micro-batch (ring.replay_plan), and this rank's share of it."""
        self._plan = ring.replay_plan(self.topology)
        by_replayer: dict[int, list[int]] = {}
        for owner, replayer in sorted(self._plan.items()):
            if replayer is not None:
                by_replayer.setdefault(replayer, []).append(owner)
        self._slot = {o: i for owners in by_replayer.values() for i, o in enumerate(owners)}
        self._my_replays = by_replayer.get(self.rank, [])
        self._max_replays = max((len(v) for v in by_replayer.values()), default=0)
        self.can_replay = (self.loss_fn is not None and self.batch_fn is not None
                           and self._max_replays > 0)
        if self.config.audit_every and not self.can_replay:
            log.warning("screener.audit: ring replay is off (%s)",
                        "needs loss_fn and batch_fn" if self.loss_fn is None or self.batch_fn is None
                        else "a single rank has nobody to replay")

    def _install_hook(self, model: Any, reduce_hook: Optional[Callable[[Any, Any], Any]],
                      reduce_state: Any, check_reduced: bool, start_step: Optional[int]) -> None:
        """Register the gradient recorder as DDP's comm hook (DDP takes exactly one)."""
        self._recorder = GradientRecorder(
            self._grad_params, reduce_hook=reduce_hook,
            reduce_state=self.group if reduce_state is _GROUP else reduce_state,
            check_reduced=check_reduced,
            grads_are_bucket_views=bool(getattr(model, "gradient_as_bucket_view", False)),
            measure_local=self.sentinel.config.enabled)
        if start_step is None:
            self._recorder.record_step = _UNKNOWN if self._audits_on() else None
        else:
            self._recorder.record_step = start_step if self.is_audit_step(start_step) else None
        try:
            model.register_comm_hook(None, self._recorder.hook)
        except RuntimeError as e:
            raise AuditUsageError("screener.audit: could not register the auditor's comm hook (DDP "
                                  "takes one hook, registered before the first backward); pass "
                                  f"your own hook as Auditor(reduce_hook=...): {e}") from e

    # ---- step start and teardown ---------------------------------------------------------------

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        # Traced by dynamo only when the DDP model itself runs inside torch.compile: dynamo
        # replays this store on every call of the compiled code, and check_gradients refuses.
        if torch.compiler.is_compiling():
            self._compiled_around = True
            return
        if self._state is None:
            self._state = capture(self.device, self.scaler)

    def begin_step(self) -> None:
        """Capture the RNG states (and loss scale) the step starting now draws from.

        Only needed when loss_fn draws random numbers before it calls the model (the forward
        pre-hook captures otherwise); call it before anything of the step uses randomness.
        """
        self._state = capture(self.device, self.scaler)

    def close(self) -> None:
        """Remove the forward pre-hook and drop the auditor's references to the model.

        Call it (or use the Auditor as a context manager) before dist.destroy_process_group(),
        and drop the DDP model too: see examples/train_ddp.py for the teardown order.
        """
        if self._closed:
            return
        self._closed = True
        self._pre_hook.remove()
        self._recorder.record_step = None
        self._state = None

    def __enter__(self) -> "Auditor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- cadence -----------------------------------------------------------------------------

    def _audits_on(self) -> bool:
        return bool(self.config.audit_every) and self.can_replay

    def is_audit_step(self, step: int) -> bool:
        """Whether check 2 runs at this step."""
        return self._audits_on() and step % self.config.audit_every == 0

    def is_weights_step(self, step: int) -> bool:
        """Whether check_weights(step) runs the periodic weight vote at this step."""
        return bool(self.config.weights_every) and step % self.config.weights_every == 0

    def _note(self, step: int) -> None:
        if self._first_step is None:
            self._first_step = step

    def _window_start(self, last_clean: Optional[int], step: int) -> int:
        if last_clean is not None:
            return last_clean + 1
        return self._first_step if self._first_step is not None else step

    # ---- check 1 and check 2 -----------------------------------------------------------------

    def check_gradients(self, step: int, loss: Any,
                        grad_norm: torch.Tensor | float | None = None) -> None:
        """After backward, before optimizer.step() (and scaler.step()): check 1, and check 2 on
        audit steps.

        loss: the step's loss, unscaled (or what loss_fn returned: a tuple's first element, a
        mapping's "loss"); with accumulation_steps > 1, the sum of the micro-batch losses.
        grad_norm: the total norm of the reduced gradient when the loop already computes it
        (the return value of clip_grad_norm_). Given it, the Auditor may be constructed with
        check_reduced=False: with a reduce_hook of the caller's, the hook then skips its own
        norm of the reduced buckets (the default reduction checks them for free).

        Collective: every rank of the group calls it at every step. Raises SDCAlarm (or
        NumericFailure for numbers no hardware explains) on every rank alike. One all_gather on a
        step without an audit; an audit step has two: the owners' RNG states and loss scales go
        out before the replays, the digests of the replays' records come back after them.
        """
        step = int(step)
        if self._compiled_around:  # every rank runs the same compiled code: all refuse here
            raise AuditUsageError(COMPILED_AROUND_DDP)
        self._note(step)
        loss = self._loss_tensor(loss)
        stats = self._recorder.take(self.device)
        self._recorder.record_step = step + 1 if self.is_audit_step(step + 1) else None
        state = self._state if self._state is not None \
            else StepState(None, None, scaler_scale(self.scaler))
        self._state = None
        self.counters["steps"] += 1
        reduced = stats.reduced_norm if grad_norm is None else self._given_norm(grad_norm)
        head = torch.stack([self._loss_value(loss),
                            stats.local_norm.to(self._comm, torch.float64),
                            reduced.to(self._comm, torch.float64)])
        if not self.is_audit_step(step):
            g = gather(head, self.group, self._comm)  # (world, 3)
            if not self._judge_nonfinite(step, g, lambda: self._gather_states(state)):
                self._sentinel_step(step, g, lambda: self._gather_states(state))
            return
        self._audit(step, loss, stats, state, head)
        # an audit step that passed: its gathered values join the sentinel's baseline (a spike
        # the ring replay reproduced is the data's); gathered, so every rank's baseline is the
        # same and every rank decides alike
        audited = self._audit_head
        if audited is not None:
            self.sentinel.accept("loss", max(abs(float(x)) for x in audited[:, 0]))
            self.sentinel.accept("grad", max(float(x) for x in audited[:, 1]))

    def _audit(self, step: int, loss: Any, stats: StepStats, state: StepState,
               head: torch.Tensor) -> None:
        """An audit step: check 1 with the states gathered for the replays, then check 2."""
        # Every rank sends the same shape on an audit step, whatever happened here: a rank whose
        # fingerprints were not recorded says so, and all ranks skip the comparison alike (a
        # rank-local decision to send less would leave the others waiting in a different gather).
        recorded = stats.grad_fingerprints is not None and stats.step in (step, _UNKNOWN)
        status = _OK if recorded else _NOT_RECORDED
        first = torch.cat([head.cpu().view(torch.int64), torch.tensor([status]),
                           self._codec.encode(state)])
        got1 = gather(first, self.group, self._comm)  # (world, 4 + state)
        self._audit_head = got1[:, :3].contiguous().view(torch.float64)
        states = self._decode_states(got1[:, 4:])
        if self._judge_nonfinite(step, got1[:, :3].contiguous().view(torch.float64),
                                 lambda: states):
            return  # the scaler skips this step; so does the audit
        if bool((got1[:, 3] == _NOT_RECORDED).any()):
            self.counters["audits_skipped"] += 1
            log.info("screener.audit: step %d not audited (gradient fingerprints were not "
                     "recorded for it on some rank: steps not consecutive?)", step)
            return
        assert stats.grad_fingerprints is not None
        self_check = self._self_check_due
        mine, error = self._replay_mine(step, loss, stats.grad_fingerprints, states, self_check)
        flag = torch.zeros(1, 4, dtype=torch.int64)
        flag[0, 0] = _error_flag(error)
        got = gather(torch.cat([flag, ring.record_digest(mine)]), self.group, self._comm)
        self._check_errors(got[:, 0, 0], error, step, "the ring replay")
        digests = got[:, 1:]  # (world, 1 + M + 1, 4): own, replays, self-replay
        m = self._max_replays
        if self_check:
            self._judge_self_check(step, digests, m)
        index = self.topology.index_of
        mismatched = [o for o, r in sorted(self._plan.items()) if r is not None
                      and not torch.equal(digests[index(o), 0], digests[index(r), 1 + self._slot[o]])]
        if mismatched:
            self._settle(step, mismatched, mine[:1 + m], states)
        self._last_clean_audit = step
        self.counters["audits"] += 1
        self._audits_since_self_check += 1
        every = self.config.self_check_every
        if every and self._audits_since_self_check >= every:
            self._self_check_due = True

    def _loss_tensor(self, loss: Any) -> Any:
        return loss if isinstance(loss, (int, float)) else ring.loss_of(loss)

    def _loss_value(self, loss: torch.Tensor | float) -> torch.Tensor:
        return self._scalar(loss, "loss")

    def _scalar(self, value: torch.Tensor | float, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise AuditUsageError(f"screener.audit: check_gradients needs the scalar {what}, "
                                      f"got shape {tuple(value.shape)}")
            return value.detach().reshape(()).to(self._comm, torch.float64)
        return torch.tensor(float(value), dtype=torch.float64, device=self._comm)

    def _given_norm(self, grad_norm: torch.Tensor | float) -> torch.Tensor:
        """The caller's norm of the reduced gradient; when it is not finite, the largest magnitude
        of the reduced gradient itself: clip_grad_norm_ squares in float32, so its norm is inf
        for a finite gradient element past ~1.8e19, and non-finite must mean non-finite values
        (issue 28). The reduced gradient is in .grad now (clipped: a finite one times 0 stays
        finite, NaN or inf times anything stays non-finite)."""
        norm = self._scalar(grad_norm, "grad_norm")
        if bool(torch.isfinite(norm)):
            return norm
        return largest_magnitude([p.grad for p in self._grad_params], self._comm)

    def _per_rank(self, column: torch.Tensor, ranks: Sequence[int]) -> dict[str, Any]:
        index = self.topology.index_of
        return {str(r): _num(float(column[index(r)])) for r in ranks}

    def _decode_states(self, rows: torch.Tensor) -> dict[int, StepState]:
        return {r: self._codec.decode(rows[k]) for k, r in enumerate(self.topology.ranks)}

    def _gather_states(self, state: StepState) -> dict[int, StepState]:
        """Collective: every rank's step state (only when a replay needs them off an audit step)."""
        return self._decode_states(gather(self._codec.encode(state), self.group, self._comm))

    def _scaling(self) -> bool:
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def _scaler_skip(self, step: int, ranks: list[int], why: str) -> None:
        self.counters["scaler_skipped"] += 1
        log_json(logging.INFO, "scaler_skipped_step", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, ranks=ranks, why=why,
                 scale=scaler_scale(self.scaler))

    def _judge_nonfinite(self, step: int, g: torch.Tensor,
                         states: Callable[[], dict[int, StepState]]) -> bool:
        """Check 1 on the gathered (loss, local norm, reduced norm) of every rank.

        Returns True when the step is the loss scaler's to skip (no alarm); raises on a verdict.
        """
        finite = torch.isfinite(g)
        if bool(finite.all()):
            return False
        ranks = self.topology.ranks
        local_ok = (finite[:, 0] & finite[:, 1]).tolist()
        flagged = sorted(ranks[k] for k, ok in enumerate(local_ok) if not ok)
        if flagged:
            if self._scaling() and len(flagged) == self.world_size:
                self._scaler_skip(step, flagged, "every rank's gradient is non-finite at this "
                                                  "scale: an overflow, the scaler skips the step")
                return True
            self._nonfinite_local(step, flagged, g, states)
            return True  # reached only when the scaler explains it
        seeing = sorted(ranks[k] for k, ok in enumerate(finite[:, 2].tolist()) if not ok)
        return bool(seeing) and self._nonfinite_reduced(step, g, seeing, states)

    def _nonfinite_reduced(self, step: int, g: torch.Tensor, seeing: list[int],
                           states: Optional[Callable[[], dict[int, StepState]]] = None) -> bool:
        """Every local gradient finite, the reduced one NaN/Inf on the ranks `seeing`: the sum
        overflowed (the loss scaler's business or a numeric failure), else the reduction is
        suspect. Returns True when the scaler owns it; raises otherwise."""
        ranks = sorted(self.topology.ranks)
        everywhere = len(seeing) == self.world_size
        evidence: dict[str, Any] = {
            "ranks_seeing_nonfinite": seeing,
            "reduced_norm": self._per_rank(g[:, 2], seeing),
            "local_norm_max": _num(float(g[:, 1].max())),
            "why": "every local gradient was finite; the all-reduce produced NaN/Inf"}
        # No element of a sum exceeds the sum of the addends' largest magnitudes: below the
        # gradient dtype's largest value the sum cannot have overflowed, so the reduction made
        # the NaN/Inf. At or past it, an overflow explains it (the default hook sums before it
        # divides; hooks.py), but only when every rank sees it: the sum is the same everywhere.
        bound = float(g[:, 1].sum())
        if everywhere and bound >= self._grad_max:
            evidence["why"] = (f"every local gradient was finite, but their largest magnitudes "
                               f"add up to {bound:.3g}, past the largest {self._grad_dtype}: the "
                               f"sum overflowed")
            evidence["local_norm_sum"] = bound
            if self._scaling():
                self._scaler_skip(step, ranks, evidence["why"])
                return True
            self._numeric(step, ranks, evidence, reason=(
                f"the gradients' sum overflowed {self._grad_dtype} at step {step} (local "
                f"magnitudes add up to {bound:.3g}): the gradients are too large, not corrupted"))
        if not everywhere:
            # An all-reduce leaves the same result on every rank: a NaN/Inf only some ranks hold
            # was made where it is seen (after the sum arrived). The candidates narrow to those
            # ranks; which GPU did it stays unsettled.
            evidence["why"] = (f"every local gradient was finite; only rank(s) "
                               f"{', '.join(map(str, seeing))} of {self.world_size} hold a "
                               f"non-finite reduced gradient, and an all-reduce gives every rank "
                               f"the same result")
        if states is not None:
            evidence["redo"] = self._redo_reduction(step, states)
        self._raise(SDCAlarm("nonfinite_reduced", step, (), (), False, evidence,
                             candidate_ranks=ranks if everywhere else seeing,
                             first_suspect_step=step, key=self._key("nonfinite_reduced", step)))

    def _bad_positions(self, limit: int = 8) -> torch.Tensor:
        """Up to `limit` (parameter, element) places where this rank's reduced gradient is NaN/Inf,
        as int64 codes parameter * 2**40 + element, padded with -1."""
        out = torch.full((limit,), -1, dtype=torch.int64)
        n = 0
        for k, p in enumerate(self._grad_params):
            if p.grad is None or n >= limit:
                continue
            bad = (~torch.isfinite(p.grad.detach().reshape(-1))).nonzero().flatten()[:limit - n]
            out[n:n + bad.numel()] = bad.cpu() + k * 2 ** 40
            n += bad.numel()
        return out

    def _redo_reduction(self, step: int, states: Callable[[], dict[int, StepState]]
                        ) -> dict[str, Any]:
        """What each rank sent where the reduction gave NaN/Inf, and that sum done again.

        Every rank replays its own step (the gradient it sent, bit for bit), reads it at the
        places some rank received NaN/Inf, and the values are gathered: finite senders and a
        finite sum say the reduction itself went bad. The all-reduce does not say on which link
        or GPU, so this names no rank; it says what happened instead of suspecting everyone."""
        owner_states = states()  # a collective: every rank is here
        codes = gather(self._bad_positions(), self.group, self._comm)
        places = sorted({int(c) for c in codes.flatten().tolist() if c >= 0})[:16]
        values = torch.full((max(len(places), 1),), float("nan"), dtype=torch.float64)
        error: Optional[BaseException] = None
        if self.can_replay and places:
            try:
                _, grads = self._replay(self.rank, step, owner_states[self.rank])
                for i, code in enumerate(places):
                    g = grads[code >> 40]
                    values[i] = 0.0 if g is None else float(g.reshape(-1)[code & (2 ** 40 - 1)])
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
        flags = gather(torch.tensor([_error_flag(error)]), self.group, self._comm)
        self._check_errors(flags[:, 0], error, step, "the replay that redoes the reduction")
        sent = gather(values, self.group, self._comm)  # (world, places)
        if not (self.can_replay and places):
            return {"done": False, "why": "no replay (loss_fn/batch_fn) to recompute what each "
                                          "rank sent" if places else "no place found"}
        ranks = self.topology.ranks
        rows, clean = [], True
        for i, code in enumerate(places):
            col = [float(sent[k, i]) for k in range(len(ranks))]
            total = sum(col) / len(col)
            clean = clean and all(math.isfinite(v) for v in col + [total])
            rows.append({"parameter": self.grad_names[code >> 40], "element": code & (2 ** 40 - 1),
                         "sent": {str(r): _num(v) for r, v in zip(ranks, col)},
                         "redone": _num(total)})
        return {"done": True, "places": rows, "senders_finite_and_sum_finite": clean,
                "why": ("every rank's gradient, recomputed, is finite where the reduction gave "
                        "NaN/Inf, and their sum there is finite: the reduction itself went bad "
                        "(a link, a NIC, a rank's reduction arithmetic); the all-reduce does not "
                        "say which, so no rank is named") if clean else
                       "a recomputed gradient is not finite there: the data or the model"}

    def _confirmer(self, owner: int, flagged: set[int]) -> Optional[int]:
        """Who replays a non-finite owner: its ring replayer, else a clean rank on another node."""
        first = self._plan.get(owner)
        if first is None:
            return None
        topo = self.topology
        home = topo.node_of(owner)
        if first not in flagged and topo.node_of(first) != home:
            return first
        nodes = topo.nodes
        start = nodes.index(home)
        for k in range(1, len(nodes)):
            for r in topo.ranks_on(nodes[(start - k) % len(nodes)]):
                if r not in flagged:
                    return r
        return first

    def _replay(self, owner: int, step: int, state: Optional[StepState]
                ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        assert self.batch_fn is not None and self.loss_fn is not None
        batch = self.batch_fn(owner, step)
        with _ddp_forward_context(self.model):
            return ring.replay(self.module, self._grad_params, self.loss_fn, batch,
                               device=self.device, state=state,
                               accumulation_steps=self.config.accumulation_steps,
                               mode=self._replay_mode)

    def _check_errors(self, flags: torch.Tensor, local: Optional[BaseException], step: int,
                      what: str) -> None:
        """Raise on every rank alike when a replay failed on any (flags: each rank's
        _error_flag): AuditUsageError when every failure was one, else AuditError."""
        codes = [int(flags[k]) for k in range(flags.numel())]
        failed = [self.topology.ranks[k] for k, c in enumerate(codes) if c != _OK]
        if not failed:
            return
        msg = (f"screener.audit: {what} at step {step} failed on rank(s) "
               f"{', '.join(map(str, failed))}")
        here = "" if local is None else \
            f" (here: {type(local).__name__}: {' '.join(str(local).split())})"
        if all(c == _USAGE for c in codes if c != _OK):
            raise AuditUsageError(msg + here) from local
        raise AuditError(msg + ": the auditor failed, not the hardware (a replay runs "
                         "loss_fn(ddp_model.module, batch_fn(rank, step)) outside the training "
                         "loop)" + here) from local

    def _nonfinite_local(self, step: int, flagged: list[int], g: torch.Tensor,
                         states: Callable[[], dict[int, StepState]]) -> None:
        """Settle a NaN/Inf in some ranks' local gradients; returns only when the scaler owns it."""
        evidence: dict[str, Any] = {"flagged_ranks": flagged,
                                    "loss": self._per_rank(g[:, 0], flagged),
                                    "local_norm": self._per_rank(g[:, 1], flagged)}
        window = self._window_start(self._last_clean_audit, step) if self._audits_on() else step
        key = self._key("nonfinite_local", step)
        scaling = self._scaling()
        if not (self.can_replay and self.config.confirm_nonfinite):
            if scaling:
                self._scaler_skip(step, flagged, "non-finite on some ranks, no replay to confirm")
                return
            if len(flagged) == self.world_size:
                self._numeric(step, flagged, evidence)
            evidence["why"] = "no replay to confirm: loss_fn/batch_fn not given or turned off"
            self._raise(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                 candidate_ranks=flagged, first_suspect_step=window, key=key))
        owner_states = states()
        plan = {o: self._confirmer(o, set(flagged)) for o in flagged}
        got = self._confirm_round(step, flagged, plan, owner_states)
        confirmed: list[int] = []
        reproduced: list[int] = []
        unconfirmed: list[int] = []
        replays: dict[str, Any] = {}
        for i, owner in enumerate(flagged):
            who = plan[owner]
            if who is None:
                unconfirmed.append(owner)
                continue
            finite = float(got[self.topology.index_of(who), i]) == 1.0
            replays[str(owner)] = {"replayer": who, "replay_finite": finite,
                                   "scale": owner_states[owner].scale}
            (confirmed if finite else reproduced).append(owner)
        evidence["replays"] = replays
        evidence["reproduced_ranks"] = reproduced
        if confirmed:
            evidence["why"] = ("non-finite here, finite when replayed on another node"
                               + (" at the same loss scale" if scaling else ""))
            self._raise(SDCAlarm("nonfinite_local", step, confirmed,
                                 self.topology.suspect_nodes(confirmed), True, evidence,
                                 candidate_ranks=confirmed, first_suspect_step=window, key=key))
        if scaling:
            self._scaler_skip(step, flagged, "the replay at the same scale overflows too: the "
                                             "data did it")
            return
        if unconfirmed:
            evidence["why"] = "no other rank could replay the micro-batch"
            self._raise(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                 candidate_ranks=unconfirmed, first_suspect_step=window, key=key))
        self._numeric(step, flagged, evidence)

    def _confirm_round(self, step: int, flagged: list[int], plan: dict[int, Optional[int]],
                       owner_states: dict[int, StepState]) -> torch.Tensor:
        """Each confirmer replays the flagged owners given to it; one gather of whether each
        replay came out finite (1.0), not finite (0.0) or was not this rank's (-1.0)."""
        results = torch.full((len(flagged) + 1,), -1.0, dtype=torch.float64)
        error: Optional[BaseException] = None
        for i, owner in enumerate(flagged):
            if plan[owner] != self.rank:
                continue
            try:
                loss, grads = self._replay(owner, step, owner_states[owner])
                # the values themselves, not a norm whose squares could overflow (issue 28)
                ok = bool(torch.isfinite(loss).all()) and bool(
                    torch.isfinite(largest_magnitude(grads, self.device)))
                results[i] = 1.0 if ok else 0.0
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
        results[-1] = _error_flag(error)
        got = gather(results, self.group, self._comm)  # (world, len(flagged) + 1)
        self._check_errors(got[:, -1], error, step, "the non-finite confirmation replay")
        return got

    def _replay_mine(self, step: int, loss: torch.Tensor | float, grad_fp: torch.Tensor,
                     states: dict[int, StepState], self_check: bool
                     ) -> tuple[torch.Tensor, Optional[BaseException]]:
        """This rank's own record, its replays of its owners, and (on a self-check step) its
        replay of its own step: (1 + M + 1, 1 + P, 2), padded with zeros."""
        own = ring.make_record(loss, grad_fingerprints=grad_fp)
        records = [own]
        error: Optional[BaseException] = None
        owners = list(self._my_replays) + [None] * (self._max_replays - len(self._my_replays))
        if self_check:
            owners.append(self.rank)
        for owner in owners:
            if owner is None or error is not None:
                records.append(torch.zeros_like(own))
                continue
            try:
                rl, rg = self._replay(owner, step, states[owner])
                records.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively by the caller
                error = e
                records.append(torch.zeros_like(own))
        if not self_check:
            records.append(torch.zeros_like(own))
        return torch.stack(records), error

    def _judge_self_check(self, step: int, digests: torch.Tensor, m: int) -> None:
        """Every rank's record of its own step against its own replay of it."""
        self._self_check_due = False
        self._audits_since_self_check = 0
        self.counters["self_checks"] += 1
        ranks = self.topology.ranks
        odd = [ranks[k] for k in range(len(ranks))
               if not torch.equal(digests[k, 0], digests[k, 1 + m])]
        if not odd:
            return
        loss_differs = [ranks[k] for k in range(len(ranks))
                        if int(digests[k, 0, 0]) != int(digests[k, 1 + m, 0])]
        evidence = {"check": "self_replay", "ranks": odd, "loss_differs_on": loss_differs,
                    "why": "the step does not reproduce on its own rank"}
        self._numeric(step, odd, evidence, reason=(
            f"step {step} does not reproduce on the rank that ran it (rank(s) "
            f"{', '.join(map(str, odd))}): the training step is not a deterministic function of "
            f"weights, batch, RNG state and loss scale, so no replay can judge the hardware; "
            f"{LIKELY_CAUSES}"))

    def _row_names(self, rows: Sequence[int]) -> list[str]:
        return ["loss" if r == 0 else self.grad_names[r - 1] for r in rows][:_MAX_NAMES]

    def _settle(self, step: int, mismatched: list[int], mine: torch.Tensor,
                states: dict[int, StepState]) -> None:
        """Second round after a ring mismatch: referees on a third node replay; full records."""
        topo = self.topology
        referee = {o: ring.referee_of(topo, o, self._plan[o]) for o in mismatched}
        got, ref_slot = self._referee_round(step, mismatched, referee, mine, states)
        suspects: set[int] = set()
        unsettled: set[int] = set()
        cases = [self._judge_case(o, referee[o], ref_slot, got, suspects, unsettled)
                 for o in mismatched]
        named = sorted(suspects)
        evidence = {"mismatches": cases, "audit_every": self.config.audit_every,
                    "last_clean_audit": self._last_clean_audit}
        # One faulty GPU spoils its own record and the replays it computes (2 of 3 owners in a
        # world of three one-rank nodes): when one rank is in every mismatched pair, the referees
        # on the third nodes settle it.
        one_gpu = len(topo.nodes) >= 3 and bool(set.intersection(
            *({o, self._plan[o]} for o in mismatched)))
        if 2 * len(mismatched) > self.world_size and not one_gpu:
            # Most owners disagreeing with their replayers is the setup, not a GPU.
            evidence["why"] = "most ranks disagree with their replayers"
            self._numeric(step, sorted(set(mismatched)), evidence, reason=(
                f"{len(mismatched)} of {self.world_size} ranks disagree with their replays at "
                f"step {step}; silent data corruption is local to one GPU, so the replays are "
                f"not reproducing the training step; {LIKELY_CAUSES}"))
        self._raise(SDCAlarm("ring_replay", step, named, topo.suspect_nodes(named),
                             bool(named) and not unsettled, evidence,
                             candidate_ranks=sorted(suspects | unsettled),
                             first_suspect_step=self._window_start(self._last_clean_audit, step),
                             key=self._key("ring_replay", step)))

    def _referee_round(self, step: int, mismatched: list[int], referee: dict[int, Optional[int]],
                       mine: torch.Tensor, states: dict[int, StepState]
                       ) -> tuple[torch.Tensor, dict[int, int]]:
        """Each referee replays the owners it referees; every rank sends its full records (own,
        replays, referee replays, status) in one gather. Returns the gathered records and each
        owner's slot among its referee's replays."""
        by_referee: dict[int, list[int]] = {}
        for o in mismatched:
            if referee[o] is not None:
                by_referee.setdefault(referee[o], []).append(o)  # type: ignore[arg-type]
        ref_slot = {o: i for owners in by_referee.values() for i, o in enumerate(owners)}
        m2 = max((len(v) for v in by_referee.values()), default=0)
        extra: list[torch.Tensor] = []
        error: Optional[BaseException] = None
        for owner in by_referee.get(self.rank, []):
            try:
                rl, rg = self._replay(owner, step, states[owner])
                extra.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
                extra.append(torch.zeros_like(mine[0]))
        while len(extra) < m2:
            extra.append(torch.zeros_like(mine[0]))
        status = torch.zeros_like(mine[0])
        status[0, 0] = _error_flag(error)
        full = torch.cat([mine, torch.stack(extra + [status])])  # (1 + M + m2 + 1, 1 + P, 2)
        got = gather(full, self.group, self._comm)
        self._check_errors(got[:, -1, 0, 0], error, step, "the ring replay referee")
        return got, ref_slot

    def _judge_case(self, o: int, ref: Optional[int], ref_slot: dict[int, int], got: torch.Tensor,
                    suspects: set[int], unsettled: set[int]) -> dict[str, Any]:
        """One mismatched owner: who the referee's result agrees with. Adds to suspects or
        unsettled, and returns the case for the alarm's evidence."""
        index = self.topology.index_of
        r = self._plan[o]
        assert r is not None
        a, b = got[index(o), 0], got[index(r), 1 + self._slot[o]]
        c = got[index(ref), 1 + self._max_replays + ref_slot[o]] if ref is not None else None
        differ = ring.differing_rows(a, b)
        case: dict[str, Any] = {
            "owner": o, "replayer": r, "referee": ref,
            "loss": {"owner": ring.bits_to_float(int(a[0, 0])),
                     "replayer": ring.bits_to_float(int(b[0, 0]))},
            "loss_bits": {"owner": _hex64(int(a[0, 0])), "replayer": _hex64(int(b[0, 0]))},
            "differs": self._row_names(differ),
            "n_differ": len(differ),
        }
        if c is not None:
            case["loss"]["referee"] = ring.bits_to_float(int(c[0, 0]))
            case["loss_bits"]["referee"] = _hex64(int(c[0, 0]))
        case["verdict"] = ring.settle(o, r, ref, a, b, c, suspects, unsettled)
        return case

    # ---- between audits: the sentinel (sentinel.py) ------------------------------------------------

    def _sentinel_step(self, step: int, g: torch.Tensor,
                       states: Callable[[], dict[int, StepState]]) -> None:
        """The spike test on a step without an audit; when it fires, attribution before the
        update: the data (no alarm), or SDCAlarm("spike_rerun") for a rank's fault."""
        losses = [abs(float(x)) for x in g[:, 0]]
        local = [float(x) for x in g[:, 1]]
        spike = self.sentinel.check(max(losses), max(local))
        if spike is None:
            return
        self.counters["sentinel_fired"] += 1
        column = losses if spike.what == "loss" else local
        ranks = self.topology.ranks
        suspect = ranks[max(range(len(ranks)), key=lambda k: column[k])]
        index = self.topology.index_of(suspect)
        original = (ring.loss_bits(float(g[index, 0])), ring.loss_bits(float(g[index, 1])))
        outcome = self._attribute(step, spike, suspect, original, states, g)
        log_json(logging.WARNING, "sentinel", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, spike=spike.to_dict(), suspect=suspect,
                 outcome=outcome)
        self.counters[f"sentinel_{outcome}"] += 1
        self.sentinel.accept("loss", max(losses))  # "data" or "unattributed": a fault raised
        self.sentinel.accept("grad", max(local))
        if outcome == "data" and self.sentinel.config.on_data == "skip":
            for p in self._grad_params:
                p.grad = None

    def _attribute(self, step: int, spike: Spike, suspect: int, original: tuple[int, int],
                   states: Callable[[], dict[int, StepState]], g: torch.Tensor) -> str:
        """The suspect reruns its step, a rank on another node and a referee on a third replay
        it, and every other rank reruns its own step (replays are local to each rank here); one
        gather of what each got. The other ranks' reruns must reproduce their own steps, or no
        rerun can judge anything (NumericFailure). Returns "data" or "unattributed"; raises
        SDCAlarm for a fault."""
        if not self.can_replay:
            return "unattributed"  # nothing to rerun with: a spike alone is no verdict
        owner_states = states()
        confirmer = self._confirmer(suspect, {suspect})
        referee = ring.referee_of(self.topology, suspect, confirmer)
        helpers = [r for r in (confirmer, referee) if r is not None]
        owner = suspect if self.rank in [suspect] + helpers else self.rank
        row = torch.zeros(5, dtype=torch.int64)
        error: Optional[BaseException] = None
        try:
            rl, rg = self._replay(owner, step, owner_states[owner])
            d = fingerprints([fingerprints(rg)])[0]
            mag = float(largest_magnitude(rg, torch.device("cpu")))
            row = torch.tensor([_OK, ring.loss_bits(rl), ring.loss_bits(mag), int(d[0]),
                                int(d[1])], dtype=torch.int64)
        except Exception as e:  # noqa: BLE001 - reported collectively below
            error = e
            row[0] = _error_flag(e)
        got = gather(row, self.group, self._comm)
        self._check_errors(got[:, 0], error, step, "the spike rerun")
        index = self.topology.index_of
        others = [r for r in self.topology.ranks if r not in [suspect] + helpers]
        odd = [r for r in others
               if int(got[index(r), 2]) != ring.loss_bits(float(g[index(r), 1]))]
        if odd:
            self._numeric(step, odd, {"check": "spike_rerun", "ranks": odd}, reason=(
                f"step {step} does not reproduce on rank(s) {', '.join(map(str, odd))} that "
                f"reran it, so no rerun can judge the spike on rank {suspect}; {LIKELY_CAUSES}"))

        def rerun(r: Optional[int]) -> Any:
            return None if r is None else tuple(int(x) for x in got[index(r), 1:])

        verdict = rerun_verdict(original, rerun(suspect), [rerun(confirmer), rerun(referee)])
        if verdict == "data":
            return "data"
        # A settled verdict needs evidence that steps reproduce here: the other ranks' reruns
        # just did, or a self-check passed earlier.
        proven = bool(others) or self.counters["self_checks"] > 0
        evidence = {"spike": spike.to_dict(), "suspect": suspect, "confirmer": confirmer,
                    "referee": referee, "verdict": verdict, "reproduced_by": others,
                    "loss": {"original": ring.bits_to_float(original[0]),
                             "rerun": ring.bits_to_float(int(got[index(suspect), 1]))},
                    "largest_gradient": {"original": ring.bits_to_float(original[1]),
                                         "rerun": ring.bits_to_float(int(got[index(suspect), 2]))},
                    "rollback_target": self._verified_path,
                    "last_verified_step": self._verified[0] if self._verified else None}
        named = [suspect] if verdict in ("transient", "persistent") else []
        settled = bool(named) and referee is not None and proven
        self._raise(SDCAlarm("spike_rerun", step, named if settled else (),
                             self.topology.suspect_nodes(named) if settled else (), settled,
                             evidence, candidate_ranks=named if settled else [suspect] + helpers,
                             first_suspect_step=step, key=self._key("spike_rerun", step)))

    # ---- check 3 -------------------------------------------------------------------------------

    def check_weights(self, step: int, *, force: bool = False) -> None:
        """After optimizer.step(): the weight vote every weights_every steps (always if force).

        Collective: every rank of the group calls it. Raises SDCAlarm("weights") on every rank.
        """
        step = int(step)
        if not force and not self.is_weights_step(step):
            return
        self._note(step)
        rows = fingerprints(self._weights)  # (P, 2) int64
        got = gather(fingerprints([rows])[0], self.group, self._comm)  # (world, 2)
        self.counters["weight_checks"] += 1
        result = vote(list(got))
        if result.agree:
            self._last_clean_weights = step
            self._verified = (step, digest(dict(zip(self.weight_names, rows.tolist()))))
            return
        full = gather(rows, self.group, self._comm)  # (world, P, 2): only on disagreement
        result = vote(list(full))
        ranks = self.topology.ranks
        reference = full[result.groups[0][0]]
        differing = {}
        for g in result.groups[1:]:
            rows_differ = (full[g[0]] != reference).any(dim=1).nonzero().flatten().tolist()
            for i in g:
                differing[str(ranks[i])] = {
                    "parameters": [self.weight_names[k] for k in rows_differ][:_MAX_NAMES],
                    "count": len(rows_differ)}
        evidence = {"groups": [[ranks[i] for i in g] for g in result.groups],
                    "compared_with": [ranks[i] for i in result.groups[0]],
                    "differing": differing, "last_clean_weights": self._last_clean_weights}
        first = self._window_start(self._last_clean_weights, step)
        if result.settled:
            named = sorted(ranks[i] for i in result.outliers)
            self._raise(SDCAlarm("weights", step, named, self.topology.suspect_nodes(named), True,
                                 evidence, candidate_ranks=named, first_suspect_step=first,
                                 key=self._key("weights", step)))
        evidence["why"] = "no strict majority of identical replicas"
        self._raise(SDCAlarm("weights", step, (), (), False, evidence,
                             candidate_ranks=sorted(ranks), first_suspect_step=first,
                             key=self._key("weights", step)))

    def verified_save(self, save_fn: Callable[[], Any], step: int) -> Any:
        """Run the weight vote for `step` (unless it already passed at this step), then save_fn().

        Collective. A failing vote raises SDCAlarm and nothing is saved. When save_fn returns the
        path it wrote (str or PathLike), a marker is written next to it so rollback_target can
        trust it; returns what save_fn returned.
        """
        step = int(step)
        if self._verified is None or self._verified[0] != step:
            self.check_weights(step, force=True)
        assert self._verified is not None and self._verified[0] == step
        result = save_fn()
        if isinstance(result, (str, os.PathLike)):
            write_marker(result, step=step, weights_digest=self._verified[1], job=self.config.job)
            self._verified_path = os.fspath(result)
        self.counters["verified_saves"] += 1
        return result

    # ---- alarms ----------------------------------------------------------------------------------

    def _key(self, check: str, step: int) -> str:
        return f"{self.config.job}-{check}-s{step}" if self.config.job else f"{check}-s{step}"

    def _numeric(self, step: int, ranks: list[int], evidence: dict[str, Any],
                 reason: Optional[str] = None) -> NoReturn:
        log_json(logging.ERROR, "numeric_failure", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, ranks=ranks, reason=reason, evidence=evidence)
        raise NumericFailure(step, ranks, evidence, reason)

    def _raise(self, alarm: SDCAlarm) -> NoReturn:
        """Drop this node's alarm file (if this rank writes for it), log one line, raise.

        A settled verdict wider than one node or half the ranks is no hardware verdict (blast.py):
        NumericFailure instead, and no file anywhere.
        """
        topo = self.topology
        if alarm.settled:
            wide = too_wide(alarm.suspect_ranks, {r: topo.node_of(r) for r in topo.ranks},
                            self.world_size)
            if wide is not None:
                evidence = {"alarm": alarm.to_dict(), "why": wide}
                self._numeric(alarm.step, list(alarm.suspect_ranks), evidence, reason=(
                    f"{alarm.check} would name rank(s) {', '.join(map(str, alarm.suspect_ranks))}"
                    f", but {wide}: this is the training setup or the software, not a GPU; "
                    f"{LIKELY_CAUSES}"))
        files: list[str] = []
        records = node_records(alarm, {r: topo.node_of(r) for r in topo.ranks},
                               {n: topo.suspect_node(topo.ranks_on(n)[0]) for n in topo.nodes},
                               job=self.config.job)
        record = records.get(self.node)
        if record is not None and topo.writer_of(self.node) == self.rank:
            directory = alarm_dir(self.config.alarm_dir)
            try:
                files.append(str(write_alarm_file(record, directory)))
            except OSError as e:
                log_json(logging.ERROR, "alarm_file_failed", rank=self.rank,
                         hostname=self.hostname, node=self.node, directory=str(directory),
                         error=f"{type(e).__name__}: {e}")
        log_json(logging.ERROR, "sdc_alarm", rank=self.rank, hostname=self.hostname,
                 node=self.node, files=files, alarm=alarm.to_dict())
        raise alarm
