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

Check 1 (every step): one all_gather of (loss, local gradient norm, reduced gradient norm) per rank.
A rank whose loss or local gradient is NaN/Inf is flagged; its micro-batch is then replayed on another
node: a finite replay names the rank (settled, "nonfinite_local"), a non-finite one means the model or
data produced it (NumericFailure, exit 76). A non-finite reduced gradient while every local one was
finite means the reduction is suspect: "nonfinite_reduced", nobody named.

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

Both checks raise SDCAlarm (after the alarm files are written and one JSON line is logged per rank);
nothing is applied to the model by the auditor, so raising before optimizer.step() keeps the step from
running. Every verdict comes from gathered data, so all ranks raise the same alarm at the same step.
A replay that fails with an exception on any rank raises AuditError on every rank: our own failure,
never a hardware verdict.

Limits: one backward per step (gradient accumulation with no_sync is not audited per micro-batch);
parameters DDP ignores are not checked; replay needs a forward that is a deterministic function of
weights and batch (see ring.py).
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from screener.audit import ring
from screener.audit.alarms import NumericFailure, SDCAlarm, alarm_dir, log_json, node_records, \
    write_alarm_file
from screener.audit.checkpoints import write_marker
from screener.audit.collective import comm_device, gather
from screener.audit.hooks import GradientRecorder
from screener.audit.topology import Topology, gather_topology
from screener.audit.vote import vote
from screener.fingerprint import digest, fingerprints

__all__ = ["Auditor", "AuditConfig", "AuditError"]

log = logging.getLogger("screener.audit")

_UNKNOWN = -1  # fingerprints recorded for a backward whose step was not known in advance
_GROUP = object()  # reduce_state default: the auditor's process group
_MAX_NAMES = 8  # parameter names listed in evidence per disagreement
_OK, _FAILED, _NOT_RECORDED = 0, 1, 2  # a rank's status on an audit step


class AuditError(RuntimeError):
    """The auditor itself failed on some rank (e.g. a replay raised): never a hardware verdict."""


@dataclass(frozen=True)
class AuditConfig:
    """How often the periodic checks run; 0 turns the periodic form of a check off."""

    audit_every: int = 50
    weights_every: int = 100
    check_reduced: bool = True  # check 1's second half: the reduced gradient
    confirm_nonfinite: bool = True  # replay a non-finite rank's micro-batch before naming it
    job: str = ""
    alarm_dir: Optional[str] = None  # None: $SCREENER_ALARM_DIR, else the default

    def __post_init__(self) -> None:
        for name in ("audit_every", "weights_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {v!r}")


def _default_job() -> str:
    for var in ("SCREENER_JOB", "JOB_NAME", "TORCHELASTIC_RUN_ID"):
        v = os.environ.get(var, "").strip()
        if v and v.lower() != "none":
            return v
    return ""


def _num(x: float) -> Any:
    """A float for JSON evidence: non-finite values as strings ("nan", "inf")."""
    return x if math.isfinite(x) else str(x)


def _hex64(bits: int) -> str:
    return f"0x{bits & 0xFFFFFFFFFFFFFFFF:016x}"


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
    """

    def __init__(self, model: torch.nn.Module, *,
                 loss_fn: Optional[Callable[[torch.nn.Module, Any], torch.Tensor]] = None,
                 batch_fn: Optional[Callable[[int, int], Any]] = None,
                 audit_every: int = 50, weights_every: int = 100,
                 process_group: Optional[dist.ProcessGroup] = None,
                 reduce_hook: Optional[Callable[[Any, Any], Any]] = None,
                 reduce_state: Any = _GROUP, start_step: Optional[int] = None,
                 job: Optional[str] = None, alarm_dir: Optional[str | os.PathLike[str]] = None,
                 check_reduced: bool = True, confirm_nonfinite: bool = True,
                 topology: Optional[Topology] = None) -> None:
        module = getattr(model, "module", None)
        if not isinstance(module, torch.nn.Module) or not hasattr(model, "register_comm_hook"):
            raise TypeError(f"Auditor needs a DistributedDataParallel model, not "
                            f"{type(model).__name__}")
        self.config = AuditConfig(audit_every=audit_every, weights_every=weights_every,
                                  check_reduced=check_reduced, confirm_nonfinite=confirm_nonfinite,
                                  job=_default_job() if job is None else job,
                                  alarm_dir=None if alarm_dir is None else os.fspath(alarm_dir))
        self.model = model
        self.module: torch.nn.Module = module
        self.loss_fn = loss_fn
        self.batch_fn = batch_fn
        self.group = process_group if process_group is not None \
            else getattr(model, "process_group", None)

        ignore = set(getattr(model, "parameters_to_ignore", None) or ())
        named = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        if not named:
            raise ValueError("the model has no parameters to audit")
        self.weight_names = [n for n, _ in named]
        self._weights = [p for _, p in named]
        self.grad_names = [n for n, p in named if p.requires_grad]
        self._grad_params = [p for _, p in named if p.requires_grad]
        self.device = self._weights[0].device
        self._comm = comm_device(self.group, self.device)

        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.group)
        self.topology = topology if topology is not None \
            else gather_topology(self.group, device=self.device)
        if self.topology.world_size != self.world_size:
            raise ValueError(f"topology has {self.topology.world_size} ranks, the process group "
                             f"{self.world_size}")
        me = self.topology.info(self.rank)
        self.hostname, self.node = me.hostname, me.node
        threads = sorted({i.threads for i in self.topology.infos})
        if self.device.type == "cpu" and len(threads) > 1:
            log.warning("screener.audit: ranks run %s torch threads; CPU kernels may split sums "
                        "differently, so replays can differ bit for bit (torch.set_num_threads "
                        "the same everywhere)", threads)

        self._plan = ring.replay_plan(self.topology)
        by_replayer: dict[int, list[int]] = {}
        for owner, replayer in sorted(self._plan.items()):
            if replayer is not None:
                by_replayer.setdefault(replayer, []).append(owner)
        self._slot = {o: i for owners in by_replayer.values() for i, o in enumerate(owners)}
        self._my_replays = by_replayer.get(self.rank, [])
        self._max_replays = max((len(v) for v in by_replayer.values()), default=0)
        self.can_replay = loss_fn is not None and batch_fn is not None and self._max_replays > 0
        if self.config.audit_every and not self.can_replay:
            log.warning("screener.audit: ring replay is off (%s)",
                        "needs loss_fn and batch_fn" if loss_fn is None or batch_fn is None
                        else "a single rank has nobody to replay")

        self._recorder = GradientRecorder(
            self._grad_params, reduce_hook=reduce_hook,
            reduce_state=self.group if reduce_state is _GROUP else reduce_state,
            check_reduced=check_reduced)
        if start_step is None:
            self._recorder.record_step = _UNKNOWN if self._audits_on() else None
        else:
            self._recorder.record_step = start_step if self.is_audit_step(start_step) else None
        try:
            model.register_comm_hook(None, self._recorder.hook)
        except RuntimeError as e:
            raise ValueError("could not register the auditor's comm hook (DDP takes one hook, "
                             "registered before the first backward); pass your own hook as "
                             f"Auditor(reduce_hook=...): {e}") from e

        self._first_step: Optional[int] = None
        self._last_clean_audit: Optional[int] = None
        self._last_clean_weights: Optional[int] = None
        self._verified: Optional[tuple[int, str]] = None  # (step, weights digest) of the last pass
        self.counters: Counter[str] = Counter()

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

    def check_gradients(self, step: int, loss: torch.Tensor | float,
                        grad_norm: torch.Tensor | float | None = None) -> None:
        """After backward, before optimizer.step(): check 1, and check 2 on audit steps.

        grad_norm: the total norm of the reduced gradient when the loop already computes it
        (the return value of clip_grad_norm_). Given it, construct the Auditor with
        check_reduced=False: the hook then skips its own pass over the reduced buckets, so a
        step without an audit reads the gradients once.

        Collective: every rank of the group calls it at every step. Raises SDCAlarm (or
        NumericFailure for a non-finite loss no hardware explains) on every rank alike.
        One all_gather per step; on an audit step the replays run first and their digests travel
        in that same all_gather.
        """
        step = int(step)
        self._note(step)
        stats = self._recorder.take(self.device)
        self._recorder.record_step = step + 1 if self.is_audit_step(step + 1) else None
        self.counters["steps"] += 1
        reduced = stats.reduced_norm if grad_norm is None else self._scalar(grad_norm, "grad_norm")
        head = torch.stack([self._loss_value(loss),
                            stats.local_norm.to(self._comm, torch.float64),
                            reduced.to(self._comm, torch.float64)])
        if not self.is_audit_step(step):
            self._judge_nonfinite(step, gather(head, self.group, self._comm))  # (world, 3)
            return
        # Every rank sends the same shape on an audit step, whatever happened here: a rank whose
        # fingerprints were not recorded says so, and all ranks skip the comparison alike (a
        # rank-local decision to send less would leave the others waiting in a different gather).
        recorded = stats.grad_fingerprints is not None and stats.step in (step, _UNKNOWN)
        error: Optional[BaseException] = None
        if recorded:
            assert stats.grad_fingerprints is not None
            mine, error = self._replay_mine(step, loss, stats.grad_fingerprints)
        else:
            mine = torch.zeros(1 + self._max_replays, 1 + len(self._grad_params), 2,
                               dtype=torch.int64)
        status = _NOT_RECORDED if not recorded else _FAILED if error is not None else _OK
        first = torch.cat([head.cpu().view(torch.int64), torch.tensor([status])])
        payload = torch.cat([first.unsqueeze(0), ring.record_digest(mine)])  # (2 + M, 4)
        got = gather(payload, self.group, self._comm)  # (world, 2 + M, 4)
        self._judge_nonfinite(step, got[:, 0, :3].contiguous().view(torch.float64))
        self._check_errors(got[:, 0, 3] == _FAILED, error, step, "the ring replay")
        if bool((got[:, 0, 3] == _NOT_RECORDED).any()):
            self.counters["audits_skipped"] += 1
            log.info("screener.audit: step %d not audited (gradient fingerprints were not "
                     "recorded for it on some rank: steps not consecutive?)", step)
            return
        index = self.topology.index_of
        digests = got[:, 1:]
        mismatched = [o for o, r in sorted(self._plan.items()) if r is not None
                      and not torch.equal(digests[index(o), 0], digests[index(r), 1 + self._slot[o]])]
        if mismatched:
            self._settle(step, mismatched, mine)
        self._last_clean_audit = step
        self.counters["audits"] += 1

    def _loss_value(self, loss: torch.Tensor | float) -> torch.Tensor:
        return self._scalar(loss, "loss")

    def _scalar(self, value: torch.Tensor | float, what: str) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"check_gradients needs the scalar {what}, got shape "
                                 f"{tuple(value.shape)}")
            return value.detach().reshape(()).to(self._comm, torch.float64)
        return torch.tensor(float(value), dtype=torch.float64, device=self._comm)

    def _per_rank(self, column: torch.Tensor, ranks: Sequence[int]) -> dict[str, Any]:
        index = self.topology.index_of
        return {str(r): _num(float(column[index(r)])) for r in ranks}

    def _judge_nonfinite(self, step: int, g: torch.Tensor) -> None:
        """Check 1 on the gathered (loss, local norm, reduced norm) of every rank."""
        finite = torch.isfinite(g)
        if bool(finite.all()):
            return
        ranks = self.topology.ranks
        local_ok = (finite[:, 0] & finite[:, 1]).tolist()
        flagged = sorted(ranks[k] for k, ok in enumerate(local_ok) if not ok)
        if flagged:
            self._nonfinite_local(step, flagged, g)
        seeing = sorted(ranks[k] for k, ok in enumerate(finite[:, 2].tolist()) if not ok)
        if seeing:
            evidence = {"ranks_seeing_nonfinite": seeing,
                        "reduced_norm": self._per_rank(g[:, 2], seeing),
                        "local_norm_max": _num(float(g[:, 1].max())),
                        "why": "every local gradient was finite; the all-reduce produced NaN/Inf"}
            self._raise(SDCAlarm("nonfinite_reduced", step, (), (), False, evidence,
                                 candidate_ranks=sorted(ranks), first_suspect_step=step,
                                 key=self._key("nonfinite_reduced", step)))

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

    def _replay(self, owner: int, step: int) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        assert self.batch_fn is not None and self.loss_fn is not None
        batch = self.batch_fn(owner, step)
        return ring.replay(self.module, self._grad_params, self.loss_fn, batch, device=self.device)

    def _check_errors(self, flags: torch.Tensor, local: Optional[BaseException], step: int,
                      what: str) -> None:
        failed = [self.topology.ranks[k] for k in range(flags.numel()) if bool(flags[k] != 0)]
        if failed:
            msg = (f"screener.audit: {what} at step {step} failed on rank(s) "
                   f"{', '.join(map(str, failed))}: the auditor failed, not the hardware")
            if local is not None:
                msg += f" (here: {type(local).__name__}: {local})"
            raise AuditError(msg) from local

    def _nonfinite_local(self, step: int, flagged: list[int], g: torch.Tensor) -> None:
        evidence: dict[str, Any] = {"flagged_ranks": flagged,
                                    "loss": self._per_rank(g[:, 0], flagged),
                                    "local_norm": self._per_rank(g[:, 1], flagged)}
        window = self._window_start(self._last_clean_audit, step) if self._audits_on() else step
        key = self._key("nonfinite_local", step)
        if not (self.can_replay and self.config.confirm_nonfinite):
            if len(flagged) == self.world_size:
                self._numeric(step, flagged, evidence)
            evidence["why"] = "no replay to confirm: loss_fn/batch_fn not given or turned off"
            self._raise(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                 candidate_ranks=flagged, first_suspect_step=window, key=key))
        plan = {o: self._confirmer(o, set(flagged)) for o in flagged}
        results = torch.full((len(flagged) + 1,), -1.0, dtype=torch.float64)
        error: Optional[BaseException] = None
        for i, owner in enumerate(flagged):
            if plan[owner] != self.rank:
                continue
            try:
                loss, grads = self._replay(owner, step)
                norms = [torch.linalg.vector_norm(x.detach().float()) for x in grads
                         if x is not None]
                ok = bool(torch.isfinite(loss).all()) and bool(
                    torch.isfinite(torch.stack(norms)).all() if norms else True)
                results[i] = 1.0 if ok else 0.0
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
        results[-1] = 1.0 if error is not None else 0.0
        got = gather(results, self.group, self._comm)  # (world, len(flagged) + 1)
        self._check_errors(got[:, -1], error, step, "the non-finite confirmation replay")
        confirmed, reproduced, unconfirmed = [], [], []
        replays: dict[str, Any] = {}
        for i, owner in enumerate(flagged):
            who = plan[owner]
            if who is None:
                unconfirmed.append(owner)
                continue
            finite = float(got[self.topology.index_of(who), i]) == 1.0
            replays[str(owner)] = {"replayer": who, "replay_finite": finite}
            (confirmed if finite else reproduced).append(owner)
        evidence["replays"] = replays
        evidence["reproduced_ranks"] = reproduced
        if confirmed:
            evidence["why"] = "non-finite here, finite when replayed on another node"
            self._raise(SDCAlarm("nonfinite_local", step, confirmed,
                                 self.topology.suspect_nodes(confirmed), True, evidence,
                                 candidate_ranks=confirmed, first_suspect_step=window, key=key))
        if unconfirmed:
            evidence["why"] = "no other rank could replay the micro-batch"
            self._raise(SDCAlarm("nonfinite_local", step, (), (), False, evidence,
                                 candidate_ranks=unconfirmed, first_suspect_step=window, key=key))
        self._numeric(step, flagged, evidence)

    def _replay_mine(self, step: int, loss: torch.Tensor | float, grad_fp: torch.Tensor
                     ) -> tuple[torch.Tensor, Optional[BaseException]]:
        """This rank's own record and its replays of its owners: (1 + M, 1 + P, 2), padded."""
        own = ring.make_record(loss, grad_fingerprints=grad_fp)
        records = [own]
        error: Optional[BaseException] = None
        for owner in self._my_replays:
            try:
                rl, rg = self._replay(owner, step)
                records.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively by the caller
                error = e
                records.append(torch.zeros_like(own))
        while len(records) < 1 + self._max_replays:
            records.append(torch.zeros_like(own))
        return torch.stack(records), error

    def _row_names(self, rows: Sequence[int]) -> list[str]:
        return ["loss" if r == 0 else self.grad_names[r - 1] for r in rows][:_MAX_NAMES]

    def _settle(self, step: int, mismatched: list[int], mine: torch.Tensor) -> None:
        """Second round after a ring mismatch: referees on a third node replay; full records."""
        topo = self.topology
        referee = {o: ring.referee_of(topo, o, self._plan[o]) for o in mismatched}
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
                rl, rg = self._replay(owner, step)
                extra.append(ring.make_record(rl, rg))
            except Exception as e:  # noqa: BLE001 - reported collectively below
                error = e
                extra.append(torch.zeros_like(mine[0]))
        while len(extra) < m2:
            extra.append(torch.zeros_like(mine[0]))
        status = torch.zeros_like(mine[0])
        status[0, 0] = 1 if error is not None else 0
        full = torch.cat([mine, torch.stack(extra + [status])])  # (1 + M + m2 + 1, 1 + P, 2)
        got = gather(full, self.group, self._comm)
        self._check_errors(got[:, -1, 0, 0], error, step, "the ring replay referee")
        index = topo.index_of
        m = self._max_replays
        suspects: set[int] = set()
        unsettled: set[int] = set()
        cases = []
        for o in mismatched:
            r, ref = self._plan[o], referee[o]
            assert r is not None
            a, b = got[index(o), 0], got[index(r), 1 + self._slot[o]]
            c = got[index(ref), 1 + m + ref_slot[o]] if ref is not None else None
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
            if c is None:
                case["verdict"] = "unsettled: fewer than three nodes"
                unsettled.update((o, r))
            elif torch.equal(c, a):
                case["verdict"] = "replayer"
                suspects.add(r)
            elif torch.equal(c, b):
                case["verdict"] = "owner"
                suspects.add(o)
            else:
                case["verdict"] = "unsettled: three different results"
                unsettled.update((o, r, ref))
            cases.append(case)
        named = sorted(suspects)
        evidence = {"mismatches": cases, "audit_every": self.config.audit_every,
                    "last_clean_audit": self._last_clean_audit}
        self._raise(SDCAlarm("ring_replay", step, named, topo.suspect_nodes(named),
                             bool(named) and not unsettled, evidence,
                             candidate_ranks=sorted(suspects | unsettled),
                             first_suspect_step=self._window_start(self._last_clean_audit, step),
                             key=self._key("ring_replay", step)))

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
        self.counters["verified_saves"] += 1
        return result

    # ---- alarms ----------------------------------------------------------------------------------

    def _key(self, check: str, step: int) -> str:
        return f"{self.config.job}-{check}-s{step}" if self.config.job else f"{check}-s{step}"

    def _numeric(self, step: int, ranks: list[int], evidence: dict[str, Any]) -> None:
        log_json(logging.ERROR, "numeric_failure", rank=self.rank, hostname=self.hostname,
                 node=self.node, step=step, ranks=ranks, evidence=evidence)
        raise NumericFailure(step, ranks, evidence)

    def _raise(self, alarm: SDCAlarm) -> None:
        """Drop this node's alarm file (if this rank writes for it), log one line, raise."""
        topo = self.topology
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
