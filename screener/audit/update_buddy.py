"""The optimizer update, recomputed by a buddy on another node (issue 34.3, second half).

Under pure FSDP2 each rank owns a shard of every parameter and the optimizer state for it, and is
the only rank that computes that shard's update. An update computed wrong (a flipped bit in the
new value, in the new Adam moments, a wrong step size) reaches every rank through the next
all-gather alike: the ring replay sees the same wrong weights on owner and replayer, and the weight
check compares all-gathers that all agree. The shard record (weight_check.ShardedWeightCheck.
drifted) catches a shard that changes after check_weights; nothing there sees the update itself.

So on audit steps the update is done twice. A step pre-hook on the optimizer snapshots, on every
rank, a sample of each owned shard as `step()` is about to use it: the parameter, the reduced
gradient, every optimizer state tensor and the step count, with the param group's
hyper-parameters as they are at that moment (a scheduler's lr included). check_weights reads the
same elements after the step. Owner and buddy then walk three rounds of FSDP_UPDATE (sharded.py), in check_weights:

- "update_offer" (every rank): whether it holds a snapshot of this step, its size, and the
  digest (blake2b) of its post-step sample;
- "update_ship" (point to point): each owner's snapshot to its buddy, the ring's pairing
  (ring.replayer_of: the same local rank on the previous node);
- "update_verdicts" (every rank): the buddy's recomputation, a fresh optimizer of the same class
  over the sampled elements, with the same group hyper-parameters and flags (foreach or the
  single-tensor loop, resolved as torch resolves them for tensors of that device), the same
  dtypes and device type, and the owner's state, stepped once; its digest against the
  owner's, bit for bit.

A mismatch is evidence against the owner's update, or the buddy's recomputation. With a third node
a referee (ring.referee_of) recomputes once more ("update_referee_ship", "update_referee"): the
result that differs from the other two names its rank, settled ("optimizer_update", that rank's
node gets the file). With two nodes it stays unsettled (owner and buddy the candidates).
Mismatches on ranks of more than one node are no single GPU: the recomputation is not exact in
this setup (NumericFailure, exit 76).

The update is elementwise in every supported optimizer (torch.optim.Adam, AdamW, SGD with or
without momentum, foreach or not), so a slice of it is the update of the slice, bit for bit
(tests/test_audit_update_buddy.py holds it against the real step). What it cannot see: a wrong
update of an element outside the sample (a sample of k of a shard's n elements sees a fault
confined to one element with probability 1 - (1 - 1/n)^k per audit: `coverage`); the update of a
step that is not audited; a corruption of the inputs before the snapshot (a state element flipped
at rest: the buddy recomputes from the same wrong state; the shard record covers the state between
check_weights and the next step); parameters the optimizer does not hold.

Pure parts: `refusal`, `sample_plan`, `coverage`, `update_verdict` (plain data in, plain data
out). `UpdateBuddy` takes the snapshots and walks the rounds.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import logging
import pickle
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from screener.audit import ring
from screener.audit.alarms import SDCAlarm
from screener.audit.collective import exchange
from screener.audit.protocol import Walk, error_flag, raise_if_failed
from screener.audit.reporting import History, Reporter

__all__ = ["SUPPORTED", "DEFAULT_SAMPLE", "FIELDS", "refusal", "sample_plan", "coverage",
           "UpdateVerdict", "update_verdict", "recompute", "UpdateBuddy"]

log = logging.getLogger("screener.audit")

# The optimizers whose update the buddy recomputes bit for bit (exact classes: a subclass may
# change the step), and the state tensors each keeps per parameter.
SUPPORTED: dict[type, tuple[str, ...]] = {
    torch.optim.Adam: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.AdamW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    torch.optim.SGD: ("momentum_buffer",),
}
DEFAULT_SAMPLE = 4096  # elements per rank per audit step, over all its shards
MIN_PER_PARAM = 4  # elements of every shard, however small, per audit step
# what a difference is found in (the evidence's "field")
FIELDS = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "step",
          "fields")
SLOT = 7  # a verdict row's entries per owner: status, digest (2), n_differ, param, field, index
NONE, DONE, FAILED = 0, 1, 2  # a slot's status

_WHY = {"fused": "a fused kernel's update is not recomputed here",
        "capturable": "the step count lives on the device, under CUDA graphs",
        "differentiable": "the update is part of an autograd graph"}


# ---- pure ----------------------------------------------------------------------------------------

def refusal(optimizer: Any, params: Sequence[Any]) -> Optional[str]:
    """Why this optimizer's update cannot be recomputed bit for bit (one line), or None.
    params: the model's parameters (the optimizer must hold some of them)."""
    cls = type(optimizer)
    if cls not in SUPPORTED:
        return (f"screener.audit: optimizer={cls.__module__}.{cls.__qualname__}: the update "
                f"buddy recomputes torch.optim.Adam, AdamW and SGD (those classes exactly) bit "
                f"for bit; leave optimizer= out to audit without it")
    ids = {id(p) for p in params}
    held = 0
    for k, group in enumerate(getattr(optimizer, "param_groups", ())):
        for flag, why in _WHY.items():
            if group.get(flag):
                return (f"screener.audit: optimizer= param group {k} has {flag}=True ({why}); "
                        f"use {flag}=False (foreach on or off is fine), or leave optimizer= out")
        for p in group["params"]:
            if torch.is_complex(p):
                return (f"screener.audit: optimizer= param group {k} holds a complex parameter, "
                        f"whose update is not recomputed here; leave optimizer= out")
            held += id(p) in ids
    if not held:
        return ("screener.audit: optimizer= holds none of the model's parameters (build the "
                "optimizer after fully_shard, over model.parameters())")
    return None


def sample_plan(step: int, sizes: Sequence[int], budget: int = DEFAULT_SAMPLE, *,
                seed: int = 0x5EED) -> list[torch.Tensor]:
    """The flat indices sampled at `step` from each shard of sizes[k] elements: about budget in
    all, each shard's share in proportion to its size, at least MIN_PER_PARAM (all of a shard
    smaller than its share); sorted, distinct (draws with replacement from a large shard: a repeat
    leaves it one short), int64. A function of the step and the sizes only,
    so every rank derives its own the same way, and a test can aim at it."""
    total = sum(max(0, int(n)) for n in sizes)
    out: list[torch.Tensor] = []
    for k, n in enumerate(int(x) for x in sizes):
        if n <= 0 or budget <= 0:
            out.append(torch.empty(0, dtype=torch.int64))
            continue
        want = min(n, max(MIN_PER_PARAM, budget * n // total))
        if want >= n:
            out.append(torch.arange(n, dtype=torch.int64))
            continue
        g = torch.Generator().manual_seed(((seed * 1_000_003 + int(step)) * 65_537 + k)
                                          % (2 ** 63))
        if 4 * want >= n:  # a small shard: distinct draws
            out.append(torch.randperm(n, generator=g)[:want].sort().values)
        else:  # draws with replacement, repeats dropped (rare: k is far below n)
            out.append(torch.randint(n, (want,), generator=g, dtype=torch.int64).unique())
    return out


def coverage(k: int, n: int, audits: int = 1) -> float:
    """The chance that k draws per audit (sample_plan's, with replacement) from a shard of n
    elements see one given element in at least one of `audits` audits: 1 - (1 - 1/n)^(k audits).
    A fault confined to one element is seen with this probability; one that spreads over m
    elements with about 1 - (1 - k/n)^m per audit."""
    if n <= 0 or k <= 0:
        return 0.0
    if k >= n:
        return 1.0
    return 1.0 - (1.0 - 1.0 / n) ** (k * audits)


@dataclass(frozen=True)
class UpdateVerdict:
    """verdict: "agree" | "owner" | "buddy" | "unsettled"; named: the rank a settled verdict
    names; candidates: the ranks under suspicion; why: one sentence."""

    verdict: str
    named: tuple[int, ...]
    candidates: tuple[int, ...]
    why: str


def update_verdict(owner: int, buddy: int, referee: Optional[int], owner_digest: Sequence[int],
                   buddy_digest: Sequence[int],
                   referee_digest: Optional[Sequence[int]] = None) -> UpdateVerdict:
    """What three digests of one sampled update support: the owner's own post-step values,
    the buddy's recomputation and, when there is one, the referee's."""
    o, b = tuple(owner_digest), tuple(buddy_digest)
    if o == b:
        return UpdateVerdict("agree", (), (), "the buddy's recomputation equals the owner's update")
    if referee is None or referee_digest is None:
        return UpdateVerdict("unsettled", (), (owner, buddy), (
            f"rank {buddy}'s recomputation of rank {owner}'s update differs from it, and no "
            f"third node can say which of the two computed wrong"))
    r = tuple(referee_digest)
    if r == b:
        return UpdateVerdict("owner", (owner,), (owner,), (
            f"ranks {buddy} and {referee} (two other nodes) recompute rank {owner}'s update from "
            f"its own gradient, state and hyper-parameters alike, and rank {owner} holds "
            f"something else: rank {owner}'s update went wrong"))
    if r == o:
        return UpdateVerdict("buddy", (buddy,), (buddy,), (
            f"rank {referee} recomputes rank {owner}'s update as rank {owner} holds it; rank "
            f"{buddy}'s recomputation differs: rank {buddy} computed wrong"))
    return UpdateVerdict("unsettled", (), (owner, buddy, referee), (
        "owner, buddy and referee hold three different updates; nobody can be named"))


# ---- a sampled update, and its recomputation ---------------------------------------------------

def _local(t: Any) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), or the tensor itself."""
    inner = getattr(t, "_local_tensor", None)  # a DTensor's, without to_local's autograd call
    if isinstance(inner, torch.Tensor):
        return inner
    local: torch.Tensor = t.to_local() if hasattr(t, "to_local") else t
    return local


def _flat(t: Any) -> torch.Tensor:
    return _local(t).detach().reshape(-1)


def _state_of(state: Mapping[str, Any], numel: int, where: torch.Tensor) -> dict[str, Any]:
    """The sampled elements of a parameter's optimizer state (the step count whole)."""
    out: dict[str, Any] = {}
    for key, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        if key == "step":
            out[key] = v.detach().clone().cpu()
        elif _local(v).numel() == numel:
            out[key] = _flat(v).index_select(0, where).cpu()
    return out


def _hyper(cls: type, group: Mapping[str, Any]) -> dict[str, Any]:
    """The group's hyper-parameters the class's constructor takes, as they are now."""
    names = set(inspect.signature(cls).parameters) - {"params"}
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in group.items() if k in names}


def recompute(cls: type, hyper: Mapping[int, Mapping[str, Any]],
              slices: Sequence[Mapping[str, Any]], device: torch.device
              ) -> list[dict[str, torch.Tensor]]:
    """The update of each sampled slice, done again: per param group, a fresh optimizer of the
    same class over the slices as leaf tensors on `device`, with the owner's gradient, state and
    hyper-parameters, stepped once. Returns each slice's new values (on the CPU), in order.
    slices[i]: {"group": g, "pre": {"param", "grad", state...}}."""
    out: list[Optional[dict[str, torch.Tensor]]] = [None] * len(slices)
    by_group: dict[int, list[int]] = {}
    for i, s in enumerate(slices):
        by_group.setdefault(int(s["group"]), []).append(i)
    for g, members in sorted(by_group.items()):
        leaves: list[torch.Tensor] = []
        for i in members:
            pre = slices[i]["pre"]
            p = pre["param"].to(device).clone()
            p.grad = pre["grad"].to(device).clone()
            leaves.append(p)
        opt = cls(leaves, **dict(hyper[g]))
        for p, i in zip(leaves, members):
            state = {k: (v.clone() if k == "step" else v.to(device).clone())
                     for k, v in slices[i]["pre"].items() if k not in ("param", "grad")}
            if state:
                opt.state[p] = state
        opt.step()
        for p, i in zip(leaves, members):
            got = {"param": p.detach().cpu()}
            got.update({k: v.detach().cpu() for k, v in opt.state[p].items()
                        if isinstance(v, torch.Tensor)})
            out[i] = got
    return [o for o in out if o is not None]


def _digest(values: Sequence[Mapping[str, torch.Tensor]]) -> tuple[int, int]:
    """One 128-bit digest (blake2b) of sampled values on the CPU: each slice's field names in
    order, then each field's dtype, shape and bits."""
    h = hashlib.blake2b(digest_size=16)
    for v in values:
        for k in sorted(v):
            t = v[k].detach().contiguous()
            h.update(f"{k}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    d = h.digest()
    return (int.from_bytes(d[:8], "little", signed=True),
            int.from_bytes(d[8:], "little", signed=True))


def _bits(t: torch.Tensor) -> torch.Tensor:
    ity = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.reshape(-1).contiguous().view(ity)


def _first_difference(got: Sequence[Mapping[str, torch.Tensor]],
                      want: Sequence[Mapping[str, torch.Tensor]],
                      buckets: Sequence[Mapping[str, Any]]) -> tuple[int, int, int, int]:
    """(differing elements, parameter index, FIELDS index, flat index in the shard) of the first
    difference between the recomputed and the owner's post-step values of each bucket (its
    "params", their "lengths" and the concatenated "where"); (0, -1, -1, -1) if none."""
    n, first = 0, (-1, -1, -1)
    for g, w, b in zip(got, want, buckets):
        params, where = list(b["params"]), b["where"]
        ends = torch.tensor(list(b["lengths"]), dtype=torch.int64).cumsum(0)
        if sorted(g) != sorted(w):
            n += 1
            first = first if first[0] >= 0 else (params[0], FIELDS.index("fields"), -1)
            continue
        for f in sorted(g):
            x, y = g[f], w[f]
            if x.dtype != y.dtype or x.shape != y.shape:
                diff = torch.ones(max(1, x.numel()), dtype=torch.bool)
            else:
                diff = _bits(x) != _bits(y)
            count = int(diff.sum())
            if count and first[0] < 0:
                j = int(diff.nonzero()[0, 0])
                field = FIELDS.index(f) if f in FIELDS else len(FIELDS) - 1
                if f == "step":  # one per parameter of the bucket
                    first = (params[min(j, len(params) - 1)], field, -1)
                else:
                    m = min(int(torch.searchsorted(ends, j, right=True)), len(params) - 1)
                    first = (params[m], field, int(where[j]) if j < where.numel() else -1)
            n += count
    return (n, *first)


def _joined(buckets: Sequence[Mapping[str, Any]],
            read: Callable[[int, torch.Tensor], dict[str, torch.Tensor]]
            ) -> list[dict[str, torch.Tensor]]:
    """Each bucket's post-step values as its members' read(param, where) joined, "step" one
    per parameter."""
    out = []
    for b in buckets:
        parts: dict[str, list[torch.Tensor]] = {}
        for m in b["members"]:
            for f, t in read(m["param"], m["where"]).items():
                parts.setdefault(f, []).append(t.reshape(1) if f == "step" else t)
        out.append({f: torch.cat(ts) for f, ts in parts.items()})
    return out


def _bucket(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-parameter slices joined into one per (param group, dtypes, state fields, step
    count): the update is elementwise, with scalars from the group and the step count only, so
    a bucket's concatenation steps as its slices would, in one optimizer call instead of one per
    parameter (and travels as a few tensors instead of hundreds). "step" stays one 0-d tensor."""
    by: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for s in slices:
        pre = s["pre"]
        step = pre.get("step")
        key = (s["group"], tuple((f, str(t.dtype)) for f, t in sorted(pre.items())),
               None if step is None else float(step))
        by.setdefault(key, []).append(s)
    out = []
    for members in by.values():
        pre = {f: (t if f == "step" else torch.cat([m["pre"][f] for m in members]))
               for f, t in members[0]["pre"].items()}
        out.append({"group": members[0]["group"], "params": [m["param"] for m in members],
                    "lengths": [int(m["where"].numel()) for m in members],
                    "where": torch.cat([m["where"] for m in members]), "pre": pre,
                    "members": members})
    return out


class _Packer(pickle.Pickler):
    """Pickles a snapshot with its tensors set aside: each tensor's raw bytes go to one buffer,
    the pickle keeps (dtype, shape, offset). torch.save spends most of its time per tensor, and a
    snapshot holds hundreds of small ones."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.parts: list[torch.Tensor] = []
        self.offset = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        at = self.offset
        self.parts.append(raw)
        self.offset += raw.numel()
        return (str(t.dtype).replace("torch.", ""), tuple(t.shape), at, raw.numel())


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, raw: torch.Tensor) -> None:
        super().__init__(file)
        self.raw = raw

    def persistent_load(self, pid: Any) -> Any:
        dtype, shape, at, n = pid
        return self.raw[at:at + n].clone().view(getattr(torch, dtype)).reshape(shape)

    def find_class(self, module: str, name: str) -> Any:  # plain data only: no code travels
        if module == "builtins" and name in ("tuple", "list", "dict", "set", "frozenset"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a snapshot holds no {module}.{name}")


def _encode(obj: Any) -> torch.Tensor:
    """One uint8 tensor: 8 bytes of the pickle's length, the pickle, every tensor's bytes."""
    buf = io.BytesIO()
    packer = _Packer(buf)
    packer.dump(obj)
    head = buf.getvalue()
    size = torch.tensor([len(head)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([size, torch.frombuffer(bytearray(head), dtype=torch.uint8), *packer.parts])


def _decode(data: torch.Tensor) -> Any:
    data = data.cpu()
    n = int(data[:8].clone().view(torch.int64)[0])
    head = bytes(data[8:8 + n].numpy().tobytes())
    return _Unpacker(io.BytesIO(head), data[8 + n:]).load()


# ---- the check -----------------------------------------------------------------------------------

class UpdateBuddy:
    """The optimizer's update on audit steps, recomputed on another node (module docstring).

    optimizer: a torch.optim.Adam, AdamW or SGD over the model's parameters (refusal() said
    yes); params/names: the auditor's parameters, in its order; sample: elements per rank per
    audit step. arm(step) in check_gradients, check(walk, step) in check_weights.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[Any],
                 names: Sequence[str], reporter: Reporter, history: History,
                 counters: Counter[str], *, device: torch.device,
                 sample: int = DEFAULT_SAMPLE) -> None:
        self.optimizer, self.cls = optimizer, type(optimizer)
        self.params, self.names = list(params), list(names)
        self.reporter, self.history, self.counters = reporter, history, counters
        self.device, self.sample = device, int(sample)
        index = {id(p): k for k, p in enumerate(self.params)}
        # parameter index -> its param group, for the parameters the optimizer holds
        self.group_of: dict[int, int] = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) in index:
                    self.group_of[index[id(p)]] = g
        self.sizes = [_local(p).numel() if k in self.group_of else 0
                      for k, p in enumerate(self.params)]
        topo = reporter.topology
        self.rank = reporter.rank
        self.buddy_of = ring.replay_plan(topo)  # owner -> buddy (the ring's replayer)
        self.referee_of = {o: (ring.referee_of(topo, o, b) if b is not None else None)
                           for o, b in self.buddy_of.items()}
        self.owners_of = _invert(self.buddy_of)
        self.refereed = _invert(self.referee_of)
        self.width = max((len(v) for v in self.owners_of.values()), default=0)
        self.ref_width = max((len(v) for v in self.refereed.values()), default=0)
        self.armed: Optional[int] = None  # the step whose update the next step() makes
        # (step, buckets) taken by the pre-hook (_bucket: the sampled slices of the parameters
        # of one param group, dtypes, state fields and step count, joined)
        self.taken: Optional[tuple[int, list[dict[str, Any]]]] = None
        self._hyper: dict[int, dict[str, Any]] = {}  # the groups' hyper-parameters, with taken
        self.last_clean: Optional[int] = None
        self._hook = optimizer.register_step_pre_hook(self._before_step)

    def close(self) -> None:
        self._hook.remove()

    def state_shards(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's optimizer state of its shards, named "<parameter> (<key>)": what the shard
        record (weight_check.ShardedWeightCheck.extra) keeps from check_weights to the next
        step, where the buddy, which recomputes from the state as it finds it, cannot see a
        flip."""
        out: list[tuple[str, torch.Tensor]] = []
        for k in sorted(self.group_of):
            state = self.optimizer.state.get(self.params[k], {})
            for key in sorted(state):
                v = state[key]
                if isinstance(v, torch.Tensor):
                    out.append((f"{self.names[k]} ({key})", _local(v)))
        return out

    def arm(self, step: int) -> None:
        """The next optimizer.step() makes the update of this audit step: snapshot it."""
        self.armed = int(step)
        self.taken = None

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.armed is None:
            return
        step, self.armed = self.armed, None
        plan = sample_plan(step, self.sizes, self.sample)
        slices: list[dict[str, Any]] = []
        groups = optimizer.param_groups
        for k, g in sorted(self.group_of.items()):
            p, where = self.params[k], plan[k]
            if p.grad is None or where.numel() == 0:
                continue  # the step leaves it alone
            at = where.to(_local(p).device)
            pre = {"param": _flat(p).index_select(0, at).cpu(),
                   "grad": _flat(p.grad).index_select(0, at).cpu()}
            pre.update(_state_of(optimizer.state.get(p, {}), self.sizes[k], at))
            slices.append({"param": k, "group": g, "where": where, "pre": pre})
        hyper = {g: _hyper(self.cls, groups[g]) for g in {s["group"] for s in slices}}
        self.taken = (step, _bucket(slices))
        self._hyper = hyper

    def _post(self, buckets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """The sampled elements as the step left them (read in check_weights)."""
        def read(k: int, where: torch.Tensor) -> dict[str, torch.Tensor]:
            p = self.params[k]
            at = where.to(_local(p).device)
            got = {"param": _flat(p).index_select(0, at).cpu()}
            got.update(_state_of(self.optimizer.state.get(p, {}), self.sizes[k], at))
            return got

        return _joined(buckets, read)

    # ---- the rounds ------------------------------------------------------------------------

    def check(self, walk: Walk, step: int) -> None:
        """The buddy's rounds at `step` (every rank, in check_weights, after optimizer.step());
        raises SDCAlarm("optimizer_update") or NumericFailure on every rank alike."""
        topo = self.reporter.topology
        ranks = topo.ranks
        taken = self.taken if self.taken is not None and self.taken[0] == step else None
        self.taken, self.armed = None, None  # a step() that did not run (a scaler's skip) too
        data: Optional[torch.Tensor] = None
        mine = (0, 0)
        if taken is not None:
            post = self._post(taken[1])
            mine = _digest(post)
            data = _encode({"cls": self.cls.__name__, "hyper": self._hyper,
                            "slices": [{k: v for k, v in b.items() if k != "members"}
                                       for b in taken[1]],
                            "post": post})
            self.counters["update_elements"] += sum(int(s["where"].numel()) for s in taken[1])
        offer = walk.gather("update_offer", torch.tensor(
            [int(data is not None), 0 if data is None else data.numel(), *mine],
            dtype=torch.int64))
        armed = {r: bool(offer[k, 0]) for k, r in enumerate(ranks)}
        if not any(armed.values()):
            return
        sizes = {r: int(offer[k, 1]) for k, r in enumerate(ranks)}
        digests = {r: (int(offer[k, 2]), int(offer[k, 3])) for k, r in enumerate(ranks)}
        pairs = [(o, b) for o, b in self.buddy_of.items() if armed[o] and b is not None]
        inbox = self._ship(walk, "update_ship", pairs, data, sizes)
        got, local = self._judge(walk, "update_verdicts", inbox, self.owners_of, self.width)
        raise_if_failed(got[:, 0], ranks, local, step, "the optimizer update's recomputation")
        cases: dict[int, dict[str, Any]] = {}
        for owner, buddy in pairs:
            slot = self.owners_of[buddy].index(owner)
            row = got[topo.index_of(buddy), 1 + slot * SLOT:1 + (slot + 1) * SLOT].tolist()
            if (row[1], row[2]) != digests[owner]:
                cases[owner] = {"buddy": buddy, "row": row}
        self.counters["update_checks"] += 1
        if not cases:
            self.last_clean = step
            return
        self._judge_cases(walk, step, cases, armed, digests, data, sizes)

    def _judge_cases(self, walk: Walk, step: int, cases: dict[int, dict[str, Any]],
                     armed: dict[int, bool], digests: dict[int, tuple[int, int]],
                     data: Optional[torch.Tensor], sizes: dict[int, int]) -> None:
        topo = self.reporter.topology
        ranks = topo.ranks
        owners = sorted(cases)
        evidence: dict[str, Any] = {"sample_per_rank": self.sample,
                                    "optimizer": self.cls.__name__, "mismatches": []}
        if len({topo.node_of(o) for o in owners}) > 1 or 2 * len(owners) > topo.world_size:
            evidence["mismatched_owners"] = owners
            self.reporter.numeric(step, owners, evidence, reason=(
                f"the optimizer update recomputed by a buddy differs for {len(owners)} ranks on "
                f"several nodes: the recomputation is not exact in this setup (the optimizer's "
                f"code path, or the loop changing the optimizer between step() and "
                f"check_weights), not a GPU"))
        referees = {o: self.referee_of[o] for o in owners}
        ref_digests: dict[int, Optional[tuple[int, int]]] = {o: None for o in owners}
        if all(r is not None for r in referees.values()):
            pairs = [(o, r) for o, r in referees.items() if r is not None]
            inbox = self._ship(walk, "update_referee_ship", pairs, data, sizes)
            asked = {r: [o for o in self.refereed[r] if o in cases] for r in self.refereed}
            got, local = self._judge(walk, "update_referee", inbox, self.refereed,
                                     self.ref_width, only=asked.get(self.rank, []))
            raise_if_failed(got[:, 0], ranks, local, step, "the optimizer update's referee")
            for o, r in pairs:
                slot = self.refereed[r].index(o)
                row = got[topo.index_of(r), 1 + slot * SLOT:1 + (slot + 1) * SLOT].tolist()
                ref_digests[o] = (row[1], row[2])
        named: set[int] = set()
        candidates: set[int] = set()
        for o in owners:
            buddy, row = cases[o]["buddy"], cases[o]["row"]
            v = update_verdict(o, buddy, referees[o], digests[o], (row[1], row[2]),
                               ref_digests[o])
            named |= set(v.named)
            candidates |= set(v.candidates)
            k, field = int(row[4]), int(row[5])
            rd = ref_digests[o]
            evidence["mismatches"].append({
                "owner": o, "buddy": buddy, "referee": referees[o], "verdict": v.verdict,
                "why": v.why, "n_differ": int(row[3]),
                "first_difference": {"parameter": self.names[k] if 0 <= k < len(self.names)
                                     else None,
                                     "field": FIELDS[field] if 0 <= field < len(FIELDS) else None,
                                     "index": int(row[6])},
                "digests": {"owner": _hex(digests[o]), "buddy": _hex((row[1], row[2])),
                            "referee": None if rd is None else _hex(rd)}})
        last = self.last_clean
        evidence["last_clean_update"] = last
        first = self.history.window_start(last, step)
        key = self.reporter.key("optimizer_update", step)
        if named:
            who = sorted(named)
            self.reporter.alarm(SDCAlarm("optimizer_update", step, who, topo.suspect_nodes(who),
                                         True, evidence, candidate_ranks=who,
                                         first_suspect_step=first, key=key))
        self.reporter.alarm(SDCAlarm("optimizer_update", step, (), (), False, evidence,
                                     candidate_ranks=sorted(candidates),
                                     first_suspect_step=first, key=key))

    def _ship(self, walk: Walk, round_: str, pairs: Sequence[tuple[int, int]],
              data: Optional[torch.Tensor], sizes: dict[int, int]) -> dict[int, torch.Tensor]:
        """Point to point: each owner's snapshot to the rank it is paired with. Returns the
        snapshots this rank received, by owner."""
        walk.enter(round_)
        inbox = exchange(pairs, self.rank, data, sizes, walk.comm)
        self.counters["update_bytes_received"] += sum(t.numel() for t in inbox.values())
        return inbox

    def _judge(self, walk: Walk, round_: str, inbox: dict[int, torch.Tensor],
               slots: dict[int, list[int]], width: int, only: Optional[list[int]] = None
               ) -> tuple[torch.Tensor, Optional[BaseException]]:
        """Recompute every snapshot received and gather, per rank, its error flag and a row of
        SLOT entries per owner it recomputes for (in `slots` order)."""
        row = torch.zeros(max(1, width) * SLOT, dtype=torch.int64)
        error: Optional[BaseException] = None
        for slot, owner in enumerate(slots.get(self.rank, [])):
            if owner not in inbox or (only is not None and owner not in only):
                continue
            try:
                got = _decode(inbox[owner])
                cls = next(c for c in SUPPORTED if c.__name__ == got["cls"])
                slices = got["slices"]
                redone = recompute(cls, got["hyper"], slices, self.device)
                for r, b in zip(redone, slices):  # the step count: one per parameter
                    if "step" in r:
                        r["step"] = r["step"].reshape(1).repeat(len(b["params"]))
                d = _digest(redone)
                n, k, field, index = _first_difference(redone, got["post"], slices)
                row[slot * SLOT:(slot + 1) * SLOT] = torch.tensor(
                    [DONE, d[0], d[1], n, k, field, index], dtype=torch.int64)
            except Exception as e:  # noqa: BLE001 - every rank raises alike below
                error = e
                row[slot * SLOT] = FAILED
        flag = torch.tensor([error_flag(error)], dtype=torch.int64)
        return walk.gather(round_, torch.cat([flag, row])), error


def _invert(plan: Mapping[int, Optional[int]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for owner, other in sorted(plan.items()):
        if other is not None:
            out.setdefault(other, []).append(owner)
    return out


def _hex(d: Sequence[int]) -> str:
    return "".join(f"{int(x) & (2 ** 64 - 1):016x}" for x in d)
