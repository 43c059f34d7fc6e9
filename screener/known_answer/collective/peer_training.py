"""Peer burn-in: the node under test trains a small model together with healthy peers, audited.

Before a node takes work it can be cross-checked against nodes already known good: the node under
test and at least two healthy nodes run a short DDP training of screener.known_answer.engine.synthetic's tiny language
model (deterministic weights and data) with the in-job Auditor checking every step: the non-finite
check, the ring replay audit (each rank's micro-batch recomputed on another node, a third node
settling a mismatch) and the weight fingerprint vote. Then an all-reduce of a known pattern across
all ranks checks the inter-node path and measures its bandwidth (screener.known_answer.collective.allreduce).

With three or more nodes the audit names a faulty rank, so the outcome says whom it blames:

  exit 0   nothing found
  exit 75  the node under test was named (its alarm file also reaches its DaemonSet)
  exit 77  a peer was named, not the node under test
  exit 76  a non-finite number every replay reproduced (the model, not the hardware)
  exit 3   a disagreement nobody could be named for

Two ways to run it:
  * in a cluster, one pod per node (manifests/peer-burnin-job.yaml: an Indexed Job of three pods),
    each `torchrun ... -m screener.known_answer.collective.peer_training --under-test NODE` with NCCL between the GPUs;
  * on one machine, `run_local`: one process per simulated node with gloo on the CPU (the node
    names are set per process through NODE_NAME, which is how the audit tells nodes apart).

A fault can be injected on the node under test (`PeerFault`), to see it caught and named.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

from screener.errors import BadInputError
from screener.known_answer.collective.allreduce import known_sum_rank, run_group
from screener.lifecycle.events import EVIDENCE_CONFIRMED
from screener.types import ExitCode, KnownAnswerReason, Outcome, Verdict

# torch, and the modules that import it at their top (faults, synthetic, screener.audit,
# screener.determinism), are imported inside the functions that train: the burn-in and the drill
# import this module for its options and run_local, and the CLI must start without torch.

SHAPE = dict(vocab=32, d_model=16, n_heads=2, d_ff=32, n_layers=1)
SEQ = 8
DEFAULT_PEERS = ("peer-a", "peer-b")


@dataclass(frozen=True)
class PeerFault:
    """An operator fault on the node under test's first rank at one step (screener.known_answer.engine.faults)."""

    step: int = 2
    op: str = "gelu"
    call: int = 0
    element: int = 11
    mode: str = "scale"
    factor: float = 1e4
    bit: Optional[int] = None
    node: Optional[str] = None  # default: the node under test

    def spec(self) -> Any:
        from screener.known_answer.engine.faults import FaultSpec

        return FaultSpec(op=self.op, call=self.call, element=self.element, mode=self.mode,
                         factor=self.factor, bit=self.bit)


@dataclass(frozen=True)
class PeerOptions:
    """How long and how closely to train, and where alarm files go."""

    under_test: str
    steps: int = 8
    audit_every: int = 1
    weights_every: int = 1
    seed: int = 7
    batch: int = 2
    lr: float = 0.05
    collective_numel: Optional[int] = None  # default: screener.known_answer.collective.allreduce's per device type
    collective_iterations: int = 3
    alarm_dir: Optional[str] = None  # None: $SCREENER_ALARM_DIR (the DaemonSet's drop)
    job: str = "peer-burnin"
    fault: Optional[PeerFault] = None


def _batch_fn(seed: int, batch: int, device: str) -> Any:
    from screener.known_answer.engine import synthetic

    def batch_for(rank: int, step: int) -> Any:
        tokens, targets = synthetic.batch_for(seed, rank, step, batch=batch, seq=SEQ,
                                              vocab=SHAPE["vocab"])
        return tokens.to(device), targets.to(device)

    return batch_for


def peer_rank(rank: int, world: int, device: str, *, options: PeerOptions) -> dict[str, Any]:
    """One rank of the peer burn-in, inside an initialised process group."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from screener.known_answer.engine import faults
    from screener.known_answer.engine import synthetic
    from screener.audit import Auditor, NumericFailure, SDCAlarm
    from screener.audit.topology import node_name
    from screener.determinism import make_deterministic

    node = node_name()
    dev = torch.device(device)
    # Like every known-answer job: the ring replay and the weight vote compare bits, so every
    # knob that changes them is pinned before the model is built.
    pinned = make_deterministic(dev)
    model = synthetic.make_model(options.seed, **SHAPE).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=options.lr)
    batch_for = _batch_fn(options.seed, options.batch, device)
    auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_for,
                      audit_every=options.audit_every, weights_every=options.weights_every,
                      alarm_dir=options.alarm_dir, job=options.job)
    fault = options.fault
    fault_node = (fault.node or options.under_test) if fault else None
    i_inject = fault is not None and node == fault_node and \
        rank == auditor.topology.ranks_on(node)[0]
    out: dict[str, Any] = {"rank": rank, "node": node, "device": device, "alarm": None,
                           "numeric": None, "steps_done": 0, "fault": None, "collective": None,
                           "determinism": pinned}
    # The path first: an all-reduce of a known pattern across every rank, with its bandwidth.
    if world > 1:
        numel = options.collective_numel or (1 << 14 if dev.type == "cpu" else 32 * 1024 * 1024)
        out["collective"] = known_sum_rank(rank, world, device, numel=numel,
                                           iterations=options.collective_iterations)
    step = 0
    try:
        for step in range(options.steps):
            opt.zero_grad(set_to_none=True)
            inject = i_inject and fault is not None and step == fault.step
            ctx = faults.inject(fault.spec()) if inject and fault else contextlib.nullcontext()
            with ctx as fi:
                loss = synthetic.compute_loss(ddp, batch_for(rank, step))
                loss.backward()
            if inject:
                out["fault"] = {"step": step, "time": time.time(), **asdict(fault),  # type: ignore[arg-type]
                                "fired": list(getattr(fi, "fired", []))}
            auditor.check_gradients(step, loss)
            opt.step()
            auditor.check_weights(step)
            out["steps_done"] += 1
    except SDCAlarm as a:
        out["alarm"] = {**a.to_dict(), "message": str(a), "time": time.time()}
    except NumericFailure as e:
        out["numeric"] = {"step": e.step, "ranks": list(e.ranks)}
    out["stopped_at"] = step
    dist.barrier()
    auditor.close()  # the teardown order of docs/audit.md: the Auditor, then the model, then
    del auditor, ddp, opt, model  # the group (run_group collects the cycles before its destroy)
    return out


@dataclass(frozen=True)
class PeerResult:
    """The judged outcome of a peer burn-in (see the module docstring for the exit codes)."""

    under_test: str
    nodes: tuple[str, ...]
    outcome: Outcome
    exit_code: ExitCode
    named_nodes: tuple[str, ...] = ()
    alarm: Optional[Mapping[str, Any]] = None
    collective: Optional[Mapping[str, Any]] = None
    detail: str = ""
    ranks: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    def verdict(self) -> Verdict:
        """The burn-in's view: one verdict about the node under test."""
        reason: str = ""
        if self.alarm:
            reason = f"peer_{self.alarm['check']}"  # the alarm's check: ring_replay, weights, ...
        elif self.collective and self.collective.get("mismatched_nodes"):
            reason = KnownAnswerReason.PEER_COLLECTIVE_MISMATCH
        outcome = self.outcome if self.exit_code != ExitCode.PEER_FAILED else Outcome.INCONCLUSIVE
        return Verdict(device=f"node:{self.under_test}", outcome=outcome, reason=reason,
                       job="peer-burnin", step=(self.alarm or {}).get("step"),
                       evidence={"named_nodes": list(self.named_nodes), "detail": self.detail,
                                 EVIDENCE_CONFIRMED: bool(self.alarm
                                                          and self.alarm.get("settled"))})

    def to_dict(self) -> dict[str, Any]:
        return {"under_test": self.under_test, "nodes": list(self.nodes),
                "outcome": self.outcome.value, "exit_code": int(self.exit_code),
                "named_nodes": list(self.named_nodes), "alarm": self.alarm,
                "collective": self.collective, "detail": self.detail}


def judge(results: Sequence[Mapping[str, Any]], under_test: str) -> PeerResult:
    """The outcome from every rank's result (every rank raises the same alarm, so rank 0's is it)."""
    nodes = tuple(dict.fromkeys(r["node"] for r in results))
    if under_test not in nodes:
        raise BadInputError(f"node under test {under_test!r} took no part (nodes: {', '.join(nodes)})")
    alarm = next((r["alarm"] for r in results if r.get("alarm")), None)
    numeric = next((r["numeric"] for r in results if r.get("numeric")), None)
    coll = [r["collective"] for r in results if r.get("collective")]
    summary: Optional[dict[str, Any]] = None
    bad: list[str] = []
    if coll:
        seconds = max(c["seconds"] for c in coll)
        nbytes, iters, n = coll[0]["bytes"], coll[0]["iterations"], len(coll)
        algbw = nbytes * iters / seconds / 1e9 if seconds > 0 else 0.0
        bad = sorted({r["node"] for r in results if r.get("collective")
                      and r["collective"]["mismatches"]})
        summary = {"bytes": nbytes, "iterations": iters, "seconds": seconds,
                   "algbw_gbps": round(algbw, 3),
                   "busbw_gbps": round(algbw * 2 * (n - 1) / n, 3) if n > 1 else 0.0,
                   "mismatched_nodes": bad}
    base: dict[str, Any] = dict(under_test=under_test, nodes=nodes, ranks=tuple(results), collective=summary)
    if alarm is not None:
        named = tuple(n["node"] for n in alarm.get("suspect_nodes") or ())
        if alarm.get("settled") and under_test in named:
            return PeerResult(outcome=Outcome.SUSPECT, exit_code=ExitCode.HARDWARE_SUSPECT,
                              named_nodes=named, alarm=alarm, detail=alarm.get("message", ""),
                              **base)
        if alarm.get("settled"):
            return PeerResult(outcome=Outcome.SUSPECT, exit_code=ExitCode.PEER_FAILED,
                              named_nodes=named, alarm=alarm,
                              detail=f"a peer was named, not {under_test}: "
                                     f"{alarm.get('message', '')}", **base)
        return PeerResult(outcome=Outcome.INCONCLUSIVE, exit_code=ExitCode.INCONCLUSIVE,
                          alarm=alarm, detail=alarm.get("message", ""), **base)
    if numeric is not None:
        return PeerResult(outcome=Outcome.INCONCLUSIVE, exit_code=ExitCode.NUMERIC,
                          detail=f"non-finite numbers reproduced by replay at step "
                                 f"{numeric['step']}: the model, not the hardware", **base)
    if bad:
        if bad == [under_test]:
            return PeerResult(outcome=Outcome.SUSPECT, exit_code=ExitCode.HARDWARE_SUSPECT,
                              named_nodes=(under_test,),
                              detail="the all-reduce result was wrong on the node under test",
                              **base)
        if under_test not in bad:
            return PeerResult(outcome=Outcome.SUSPECT, exit_code=ExitCode.PEER_FAILED,
                              named_nodes=tuple(bad),
                              detail="the all-reduce result was wrong on a peer", **base)
        return PeerResult(outcome=Outcome.INCONCLUSIVE, exit_code=ExitCode.INCONCLUSIVE,
                          detail=f"the all-reduce result was wrong on {', '.join(bad)}", **base)
    return PeerResult(outcome=Outcome.PASS, exit_code=ExitCode.PASS,
                      detail=f"{len(results)} ranks on {len(nodes)} nodes agreed at every step",
                      **base)


def _peer_fn(rank: int, world: int, device: str, *, options: PeerOptions) -> dict[str, Any]:
    return peer_rank(rank, world, device, options=options)


def run_local(options: PeerOptions, *, peers: Sequence[str] = DEFAULT_PEERS, ranks_per_node: int = 1,
              timeout: float = 300.0) -> PeerResult:
    """The peer burn-in on this machine: one process per rank, gloo on the CPU, the node under
    test and the peers as simulated nodes. Alarm files go to options.alarm_dir (default: a
    temporary folder, so a laptop run drops nothing into the real alarm folder)."""
    if len(peers) < 2:
        raise BadInputError("a peer burn-in needs at least two peers (a third node settles a "
                            "disagreement)")
    nodes = [n for n in (options.under_test, *peers) for _ in range(ranks_per_node)]
    with tempfile.TemporaryDirectory(prefix="screener-peer-") as tmp:
        if options.alarm_dir is None:
            options = replace(options, alarm_dir=tmp)
        results = run_group(_peer_fn, ["cpu"] * len(nodes), nodes=nodes, backend="gloo",
                            timeout=timeout, options=options)
    return judge(results, options.under_test)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point under torchrun (one process per GPU on each node): `-m screener.known_answer.collective.peer_training`."""
    import torch
    import torch.distributed as dist

    from screener.determinism import make_deterministic

    p = argparse.ArgumentParser(prog="python -m screener.known_answer.collective.peer_training",
                                description="Peer burn-in rank; run under torchrun on every node.")
    p.add_argument("--under-test", required=True, help="the node being burned in")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--audit-every", type=int, default=1)
    p.add_argument("--weights-every", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    options = PeerOptions(under_test=args.under_test, steps=args.steps,
                          audit_every=args.audit_every, weights_every=args.weights_every)
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device, backend = f"cuda:{local}", "nccl"
    else:
        device, backend = "cpu", "gloo"
    # Before CUDA is first used: the cuBLAS workspace setting takes effect only then (the Job's
    # manifest also sets CUBLAS_WORKSPACE_CONFIG, for anything that initialises CUDA earlier).
    make_deterministic(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = peer_rank(rank, world, device, options=options)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        result = judge(everyone, options.under_test)
        if rank == 0:
            print(json.dumps(result.to_dict(), default=str), flush=True)
    finally:
        dist.destroy_process_group()
    return int(result.exit_code)


if __name__ == "__main__":  # pragma: no cover - run by torchrun in the peer burn-in Job
    sys.exit(main())
