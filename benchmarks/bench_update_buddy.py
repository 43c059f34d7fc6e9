"""The optimizer update's buddy (screener/audit/update_buddy.py): what it costs, and what it sees.

    python benchmarks/bench_update_buddy.py cost [--world 3] [--rounds 8] [--steps 2] [--no-ring]
    python benchmarks/bench_update_buddy.py detection [--world 3] [--audits 200]

cost: one process group of --world gloo ranks, one per simulated node, and the TinyLM of
tests/fsdp_workers.py (LARGE shape) sharded with fully_shard three times over: plain FSDP2, the
Auditor auditing every step (the ring replay and check 1; no weight check), and the same Auditor
with optimizer= (the buddy on every step too). AdamW, the CPU default (single-tensor). Rounds
interleave the three; the figures are medians over rounds: an audit step with the buddy on and
off, the buddy's own cost (on minus off), and the ratio on/off, in wall time and in the CPU time
of the ranks' processes (which a machine busy with other work disturbs less). --no-ring: without loss_fn, so the
audit step is check 1 and the buddy alone.

detection: in one process, what sample_plan reads of this model's shards at this world size, for
several sample sizes: the chance per audit that a fault confined to one element (anywhere in a
rank's shards, uniformly) is in the sample (the share of the elements it reads) and a Monte-Carlo
count against sample_plan itself (--audits samples, 2,000 random faults each); and, for an element in the sample, which bit classes the comparison sees (all:
it compares bits).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

LARGE = dict(vocab=512, d_model=128, n_heads=4, d_ff=512, seq=64, n_layers=4)


def _cost_rank(rank: int, world: int, *, rounds: int, steps: int, ring: bool) -> dict[str, Any]:
    import torch

    import fsdp_workers as fw
    from screener.audit import Auditor
    from screener.audit.sentinel import SentinelConfig
    from screener.known_answer.engine import synthetic

    def batch(step: int) -> Any:
        return synthetic.batch_for(fw.SEED, rank, step, batch=4, seq=LARGE["seq"],
                                   vocab=LARGE["vocab"])

    kinds = ("plain", "off", "on")
    models = {k: fw.build(world, shape=LARGE) for k in kinds}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    common = dict(loss_fn=fw.compute_loss if ring else None, audit_every=1, weights_every=0,
                  self_check_every=0, sentinel=SentinelConfig(enabled=False))
    auditors = {"off": Auditor(models["off"], **common),
                "on": Auditor(models["on"], optimizer=opts["on"], **common)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}  # this rank's process CPU time
    buddy: list[float] = []  # check_weights alone, buddy on
    step = {k: 1 for k in kinds}

    def run(kind: str) -> float:
        m, opt = models[kind], opts[kind]
        auditor = auditors.get(kind)
        p0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(steps):
            s = step[kind]
            opt.zero_grad(set_to_none=True)
            b = batch(s)
            loss = fw.compute_loss(m, b)
            loss.backward()
            if auditor is not None:
                auditor.check_gradients(s, loss, batch=b)
            opt.step()
            if auditor is not None:
                c0 = time.perf_counter()
                auditor.check_weights(s)
                if kind == "on":
                    buddy.append(time.perf_counter() - c0)
            step[kind] += 1
        cpu[kind].append((time.process_time() - p0) / steps)
        return (time.perf_counter() - t0) / steps

    for kind in kinds:  # warm-up
        run(kind)
    buddy.clear()
    for v in cpu.values():
        v.clear()
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else tuple(reversed(kinds))):
            times[kind].append(run(kind))
    for a in auditors.values():
        a.close()
    assert auditors["on"].counters["update_checks"] >= rounds * steps
    return {"times": times, "cpu": cpu, "buddy": buddy,
            "elements": auditors["on"].counters["update_elements"] / (auditors["on"].counters[
                "update_checks"] or 1),
            "bytes": auditors["on"].counters["update_bytes_received"] / (auditors["on"].counters[
                "update_checks"] or 1)}


def cost(world: int, rounds: int, steps: int, ring: bool) -> int:
    from ddp_util import run_ranks

    t0 = time.perf_counter()
    per_rank = run_ranks(_cost_rank, [f"n{i}" for i in range(world)], timeout=600,
                         rounds=rounds, steps=steps, ring=ring)
    r0 = per_rank[0]
    t = r0["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    ratio = [on / off for on, off in zip(t["on"], t["off"])]
    extra = [on - off for on, off in zip(t["on"], t["off"])]
    print(f"fsdp, {world} ranks on {world} nodes, {rounds} rounds x {steps} steps, model "
          f"{LARGE}, AdamW (single-tensor), ring replay {'on' if ring else 'off'}; "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"plain FSDP2 step:               {med['plain'] * 1e3:8.1f} ms")
    print(f"audit step, buddy off:          {med['off'] * 1e3:8.1f} ms  "
          f"(x{med['off'] / med['plain']:.2f} plain)")
    print(f"audit step, buddy on:           {med['on'] * 1e3:8.1f} ms  "
          f"(x{med['on'] / med['plain']:.2f} plain)")
    print(f"the buddy's extra time:         {statistics.median(extra) * 1e3:8.1f} ms per audit "
          f"step (check_weights alone: {statistics.median(r0['buddy']) * 1e3:.1f} ms)")
    print(f"ratio, audit step on / off:     x{statistics.median(ratio):.3f} "
          f"[{min(ratio):.3f}-{max(ratio):.3f}]")
    c = {k: [sum(r["cpu"][k][i] for r in per_rank) for i in range(len(t[k]))] for k in t}
    cmed = {k: statistics.median(v) for k, v in c.items()}
    cratio = [on / off for on, off in zip(c["on"], c["off"])]
    print(f"CPU time of an audit step, all ranks: plain {cmed['plain'] * 1e3:.1f} ms, buddy off "
          f"{cmed['off'] * 1e3:.1f} ms, on {cmed['on'] * 1e3:.1f} ms; on / off "
          f"x{statistics.median(cratio):.3f} [{min(cratio):.3f}-{max(cratio):.3f}], the buddy "
          f"{statistics.median([a - b for a, b in zip(c['on'], c['off'])]) * 1e3:.1f} ms "
          f"(wall time waits for the machine's other work; CPU time less so)")
    print(f"sampled per rank per audit:     {r0['elements']:.0f} elements; received "
          f"{r0['bytes']:.0f} bytes (one owner's snapshot)")
    return 0


def detection(world: int, steps: int, per_step: int = 2000) -> int:
    import torch

    import fsdp_workers as fw
    from screener.audit.update_buddy import _digest, sample_plan
    from screener.known_answer.engine import faults, synthetic

    model = synthetic.make_model(fw.SEED, **LARGE)
    # this rank's shard of each parameter: dim 0 in world chunks (FSDP2's Shard(0)), rank 0's
    sizes = [int(torch.chunk(torch.empty(p.shape[0]), world)[0].numel()) * (p.numel() //
                                                                            p.shape[0])
             for p in model.parameters()]
    n = sum(sizes)
    print(f"{len(sizes)} shards, {n:,} elements on a rank ({world} ranks); one fault in one "
          f"element, uniform over them")
    print(f"{'sample':>8} {'read':>8} {'read / held':>12} {'Monte-Carlo':>12} "
          f"{'audits to 50 % / 99 %':>22}")
    g = torch.Generator().manual_seed(1)
    for k in (1024, 4096, 16384, 65536):
        plan = sample_plan(0, sizes, k)
        read = sum(int(w.numel()) for w in plan)
        expect = read / n  # the chance a uniformly placed one-element fault is in the sample
        hit = 0
        for t in range(steps):  # each audit's own sample, faults placed at random
            mask = torch.cat([torch.zeros(s, dtype=torch.bool).index_fill_(0, w, True)
                              for s, w in zip(sizes, sample_plan(t, sizes, k))])
            hit += int(mask[torch.randint(n, (per_step,), generator=g)].sum())
        half = math.log(0.5) / math.log(1 - expect)
        most = math.log(0.01) / math.log(1 - expect)
        print(f"{k:>8} {read:>8} {expect:>11.3%} {hit / (steps * per_step):>11.3%} "
              f"{half:>10.0f} / {most:<10.0f}")
    x = torch.randn(4096)
    where = sample_plan(3, [4096], 256)[0]
    ref = _digest([{"param": x[where].clone()}])
    classes = faults.bit_classes(torch.float32)
    seen_by = {}
    for name, bit in classes.items():
        hits = 0
        for j in range(where.numel()):
            y = x.clone()
            faults.apply_to_tensor(y, int(where[j]), bit=bit)
            hits += int(_digest([{"param": y[where].clone()}]) != ref)
        seen_by[name] = hits / where.numel()
    print("an element in the sample, float32, by bit class: " + ", ".join(
        f"{k} (bit {classes[k]}) {v:.0%}" for k, v in seen_by.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--world", type=int, default=3)
    c.add_argument("--rounds", type=int, default=8)
    c.add_argument("--steps", type=int, default=2)
    c.add_argument("--no-ring", action="store_true")
    d = sub.add_parser("detection")
    d.add_argument("--world", type=int, default=3)
    d.add_argument("--audits", type=int, default=200)
    a = p.parse_args(argv)
    if a.cmd == "cost":
        return cost(a.world, a.rounds, a.steps, not a.no_ring)
    return detection(a.world, a.audits)


if __name__ == "__main__":
    sys.exit(main())
