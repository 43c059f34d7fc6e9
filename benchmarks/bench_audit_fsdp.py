"""The in-job audit on FSDP2 and HSDP: a fault matrix, and the overhead against plain FSDP2.

    python benchmarks/bench_audit_fsdp.py matrix [--steps 150] [--json]
    python benchmarks/bench_audit_fsdp.py overhead [--world 3] [--rounds 20] [--hsdp]
    python benchmarks/bench_audit_fsdp.py bytes

matrix: six gloo ranks on three simulated nodes (n1 = {0, 1}, n2 = {2, 3}, n3 = {4, 5}), the
TinyLM of tests/fsdp_workers.py sharded per block and at the root, audit and weight check on
every step, no batch_fn (the loop's batch travels). For every setup (FSDP and HSDP; fp32, bf16
parameters with fp32 reduction, nn.Dropout, non-reentrant activation checkpointing,
reshard_after_forward=False, gradient accumulation without sync, a GradScaler, a batch_fn):
--steps healthy steps (alarms and numeric failures must be 0). Then single-bit faults at audit
steps, every rank in turn, one-off and persistent, in a forward matmul output and in a backward
one, on FSDP and HSDP: caught = an alarm, settled = settled, localised = it names exactly that
rank and its node (and the alarm file is on that node only).

overhead: one process group, the same model shape and mesh three times: plain FSDP2, the Auditor
with no audit due (check 1 only), and the Auditor auditing every step. Each round times --steps
steps of each, interleaved; the figures are medians over rounds of the ratio to plain FSDP2 in
the same round.

bytes: what an audit step sends per rank for an LLM micro-batch (8 x 4096 int64 token ids, and
the targets), as torch.save writes it: the owner's batch goes to its replayer only.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

NODES = ["n1", "n1", "n2", "n2", "n3", "n3"]

SETUPS: dict[str, dict[str, Any]] = {
    "fsdp_fp32": {},
    "fsdp_bf16_mp": {"bf16": True},
    "fsdp_dropout": {"loss_fn": "dropout"},
    "fsdp_checkpoint": {"checkpointing": True},
    "fsdp_no_reshard": {"reshard_after_forward": False},
    "fsdp_accumulation": {"accumulation": 2},
    "fsdp_scaler": {"scaler": True},
    "hsdp_fp32": {"hsdp": True},
    "hsdp_bf16_mp_dropout": {"hsdp": True, "bf16": True, "loss_fn": "dropout"},
    "hsdp_accumulation_batch_fn": {"hsdp": True, "accumulation": 2, "with_batch_fn": True},
}


def _kwargs(setup: dict[str, Any]) -> dict[str, Any]:
    import fsdp_workers as fw

    kw = dict(setup)
    if kw.get("loss_fn") == "dropout":
        kw["loss_fn"] = fw.dropout_loss
    return kw


def _faults() -> list[tuple[str, dict[str, Any], Any, int, int]]:
    """(name, setup, fault, rank, step): every rank in turn, one-off and persistent, forward and
    backward matmul outputs, on FSDP and HSDP."""
    import fsdp_workers as fw

    out = []
    for sharding in ("fsdp", "hsdp"):
        for rank in range(6):
            for where, call, bit in (("fwd", 3, 30), ("bwd", 14, 22)):
                for persistent in (False, True):
                    kind = "persistent" if persistent else "one-off"
                    out.append((f"{sharding}/{where}/{kind}/r{rank}", {"hsdp": sharding == "hsdp"},
                                fw.flip(rank, 2, op="mm", call=call, bit=bit, persistent=persistent),
                                rank, 2))
    return out


def _matrix_rank(rank: int, world: int, *, root: str, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import fsdp_workers as fw

    out: dict[str, Any] = {"healthy": {}, "faults": {}}
    for name, setup in SETUPS.items():
        d = os.path.join(root, "healthy", name)
        os.makedirs(d, exist_ok=True)
        t0 = time.monotonic()
        r = fw.train(rank, world, steps=steps, alarm_dir=d, **_kwargs(setup))
        r["seconds"] = time.monotonic() - t0
        out["healthy"][name] = r
    for name, setup, fault, _, _ in _faults():
        d = os.path.join(root, "faults", name.replace("/", "_"))
        os.makedirs(d, exist_ok=True)
        r = fw.train(rank, world, steps=4, alarm_dir=d, fault=fault, **setup)
        dist.barrier()
        r["files"] = [json.loads(p.read_text()) for p in sorted(Path(d).glob("*.json"))]
        out["faults"][name] = r
    return out


def matrix(steps: int, as_json: bool) -> int:
    from ddp_util import run_ranks

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        per_rank = run_ranks(_matrix_rank, NODES, timeout=3600, root=root, steps=steps)
    rows, bad = [], 0
    for name in SETUPS:
        outs = [r["healthy"][name] for r in per_rank]
        alarms = sum(o["alarm"] is not None for o in outs)
        numeric = sum(o["numeric"] is not None for o in outs)
        c = outs[0]["counters"]
        rows.append({"setup": name, "steps": outs[0]["steps_done"], "audits": c.get("audits", 0),
                     "alarms": alarms, "numeric": numeric, "seconds": round(outs[0]["seconds"], 1)})
        bad += alarms + numeric + (outs[0]["steps_done"] != steps)
    caught = settled = localised = 0
    faults = _faults()
    for name, _, _, rank, _ in faults:
        o = per_rank[0]["faults"][name]
        a = o["alarm"]
        node = NODES[rank]
        caught += a is not None
        settled += bool(a and a["settled"])
        ok = bool(a and a["suspect_ranks"] == [rank]
                  and [n["node"] for n in a["suspect_nodes"]] == [node]
                  and [f["node"] for f in o["files"]] == [node])
        localised += ok
    result = {"healthy": rows, "faults": {"n": len(faults), "caught": caught, "settled": settled,
                                          "localised": localised},
              "seconds": round(time.monotonic() - t0, 1)}
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print("| setup | healthy steps | audits | alarms | numeric failures | s |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['setup']} | {r['steps']} | {r['audits']} | {r['alarms']} | "
                  f"{r['numeric']} | {r['seconds']} |")
        total = sum(r["audits"] for r in rows)
        f = result["faults"]
        print(f"\nhealthy audited steps: {total}; alarms {sum(r['alarms'] for r in rows)}, "
              f"numeric failures {sum(r['numeric'] for r in rows)}")
        print(f"faults at audit steps: {f['n']}; caught {f['caught']}, settled {f['settled']}, "
              f"localised (rank, node, file) {f['localised']}; {result['seconds']} s")
    bad += (result["faults"]["localised"] != len(faults))
    return 1 if bad else 0


LARGE = dict(vocab=512, d_model=128, n_heads=4, d_ff=512, seq=64, n_layers=4)


def _overhead_rank(rank: int, world: int, *, rounds: int, steps: int, hsdp: bool
                   ) -> dict[str, Any]:
    import torch

    import fsdp_workers as fw
    from screener.audit import Auditor
    from screener.known_answer.engine import synthetic

    def batch(step: int) -> Any:
        return synthetic.batch_for(fw.SEED, rank, step, batch=4, seq=LARGE["seq"],
                                   vocab=LARGE["vocab"])

    models = {k: fw.build(world, hsdp=hsdp, shape=LARGE) for k in ("plain", "check1", "audit")}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    auditors = {"check1": Auditor(models["check1"], loss_fn=fw.compute_loss, audit_every=10 ** 6,
                                  weights_every=0, self_check_every=0),
                "audit": Auditor(models["audit"], loss_fn=fw.compute_loss, audit_every=1,
                                 weights_every=0, self_check_every=0)}
    times: dict[str, list[float]] = {k: [] for k in models}
    step = {k: 1 for k in models}

    def run(kind: str) -> float:
        m, opt = models[kind], opts[kind]
        t0 = time.perf_counter()
        for _ in range(steps):
            s = step[kind]
            opt.zero_grad(set_to_none=True)
            b = batch(s)
            loss = fw.compute_loss(m, b)
            loss.backward()
            if kind != "plain":
                auditors[kind].check_gradients(s, loss, batch=b)
            opt.step()
            step[kind] += 1
        return (time.perf_counter() - t0) / steps

    for kind in models:  # warm-up
        run(kind)
    # the first steps of a start are all audit steps (the sentinel's warm-up, cadence.py): past
    # them before the "no audit due" auditor is timed
    while step["check1"] < auditors["check1"].cadence.guard:
        run("check1")
    for r in range(rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for kind in order:
            times[kind].append(run(kind))
    return times


def overhead(world: int, rounds: int, steps: int, hsdp: bool) -> int:
    from ddp_util import run_ranks

    nodes = [f"n{i}" for i in range(world)] if not hsdp else \
        [f"n{i // 2}" for i in range(world)]
    per_rank = run_ranks(_overhead_rank, nodes, timeout=3600, rounds=rounds, steps=steps,
                         hsdp=hsdp)
    t = per_rank[0]
    ratio = {k: [a / p for a, p in zip(t[k], t["plain"])] for k in ("check1", "audit")}

    def q(xs: list[float], f: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]

    print(f"{'hsdp' if hsdp else 'fsdp'}, {world} ranks, {rounds} rounds x {steps} steps, "
          f"model {LARGE}")
    print(f"plain FSDP2 step: median {statistics.median(t['plain']) * 1e3:.1f} ms")
    for k, label in (("check1", "Auditor, no audit due"), ("audit", "Auditor, audit step")):
        xs = ratio[k]
        print(f"{label:24} x{statistics.median(xs):.3f} [{q(xs, .25):.3f}-{q(xs, .75):.3f}] "
              f"(median {statistics.median(t[k]) * 1e3:.1f} ms)")
    return 0


def batch_bytes() -> int:
    import torch

    tokens = torch.randint(0, 50_000, (8, 4096), dtype=torch.int64)
    targets = torch.roll(tokens, -1, dims=1)
    for what, batch in (("token ids only", tokens), ("(token ids, targets)", (tokens, targets))):
        buf = io.BytesIO()
        torch.save(batch, buf)
        raw = sum(t.numel() * t.element_size() for t in (batch if isinstance(batch, tuple)
                                                         else (batch,)))
        print(f"8 x 4096 int64, {what}: {len(buf.getvalue()):,} bytes sent per rank per audit "
              f"step ({raw:,} of tensor data); a referee round on a mismatch sends it once more")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matrix")
    m.add_argument("--steps", type=int, default=150)
    m.add_argument("--json", action="store_true")
    o = sub.add_parser("overhead")
    o.add_argument("--world", type=int, default=3)
    o.add_argument("--rounds", type=int, default=20)
    o.add_argument("--steps", type=int, default=3)
    o.add_argument("--hsdp", action="store_true")
    sub.add_parser("bytes")
    a = p.parse_args(argv)
    if a.cmd == "matrix":
        return matrix(a.steps, a.json)
    if a.cmd == "overhead":
        if a.hsdp and a.world % 2:
            p.error("--hsdp needs an even --world (2 shards per replica)")
        return overhead(a.world, a.rounds, a.steps, a.hsdp)
    return batch_bytes()


if __name__ == "__main__":
    sys.exit(main())
