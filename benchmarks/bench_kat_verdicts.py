"""Known-answer verdicts under one-shot, repeated and persistent faults: what the judgment says.

    python benchmarks/bench_kat_verdicts.py [--per-cell 4] [--repeat 3] [--seed 0] [--json]

For every job of the campaign, every op it runs (screener.known_answer.engine.faults' names), every
bit class of the op's dtype (sign, top and low exponent, high and low mantissa) and every fault
pattern, it runs the real job in this process `--repeat` times with the real fault injector,
builds the device's runs as the screening child would report them, and judges them against a
golden recorded from a clean run (screener.known_answer.verdict.judgment.judge, as `screener kat
run`):

- one-shot:   one flip in iteration 0 only (the other runs clean);
- twice:      one flip in iteration 0 and another in iteration 1 (different calls);
- persistent: the same flip from a random call on, in every run (a unit that stays bad);
- drifting:   from a random call on in every run, each run at another element (wrong in every
              run, differently each time);
- index:      (jobs that build position ids) a high bit of the `arange` output flipped, so the
              job raises IndexError in the child (a crash).

Counts per pattern and bit class: suspect (the verdict says 75), masked (the fault changed no
bit of any output: all runs equal the golden, a pass is right), and wrong (anything else:
a pass although a bit changed, inconclusive, or the screener failing, exit 1). Before issue 27
"twice", "persistent" (from iteration 0) and "drifting" exited 1 whenever no run reproduced the
golden, and "index" always exited 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from screener.determinism import preserved  # noqa: E402
from screener.errors import ScreenerError  # noqa: E402
from screener.known_answer.engine import faults, golden
from screener.known_answer.verdict import judgment  # noqa: E402
from screener.known_answer.engine.screen import golden_lookup  # noqa: E402
from screener.known_answer.engine import workloads as w  # noqa: E402
from screener.known_answer.engine.faults import FaultSpec, inject  # noqa: E402
from screener.known_answer.verdict.runs import DeviceRun  # noqa: E402
from screener.types import Outcome, RunStatus  # noqa: E402

OPS = {"gemm": ["mm"], "conv": ["convolution"],
       "train": ["mm", "addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "embedding",
                 "_log_softmax"],
       "replay": ["mm", "addmm", "bmm", "_softmax", "native_layer_norm", "gelu", "embedding",
                  "_log_softmax"]}
JOBS = ["gemm-fp32", "gemm-bf16", "conv-fp32", "train-fp32", "replay-fp32"]
PATTERNS = ["one-shot", "twice", "persistent", "drifting"]


def _counts(spec: w.JobSpec, op: str) -> tuple[int, int]:
    """(calls of the op in one run, elements of its smallest output)."""
    seen: list[int] = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ == op:
                t = out[0] if isinstance(out, (tuple, list)) else out
                seen.append(t.numel())
            return out

    w.run_job(spec, "cpu", injector=Count())
    return len(seen), min(seen)


def _run(spec: w.JobSpec, specs: list[FaultSpec]) -> Any:
    inj = inject(*specs) if specs else None
    r = w.run_job(spec, "cpu", injector=inj)
    return r, bool(inj and inj.fired)


def _device(results: list[Any]) -> DeviceRun:
    run = DeviceRun("cpu", platform={"name": "bench"}, platform_hash="bench")
    for i, r in enumerate(results):
        run.add(i, r)
    run.iterations = len(results)
    return run


def _faults_for(pattern: str, op: str, calls: int, numel: int, bit: int, repeat: int,
                rng: random.Random) -> list[list[FaultSpec]]:
    """The op faults of each iteration for one pattern."""
    call, element = rng.randrange(calls), rng.randrange(numel)
    clean: list[FaultSpec] = []
    if pattern == "one-shot":
        return [[FaultSpec(op, call=call, element=element, bit=bit)]] + [clean] * (repeat - 1)
    if pattern == "twice":
        other = (call + 1 + rng.randrange(max(calls - 1, 1))) % calls
        return ([[FaultSpec(op, call=call, element=element, bit=bit)],
                 [FaultSpec(op, call=other, element=rng.randrange(numel), bit=bit)]]
                + [clean] * (repeat - 2))
    if pattern == "persistent":
        return [[FaultSpec(op, call=call, element=element, bit=bit, persistent=True)]] * repeat
    return [[FaultSpec(op, call=call, element=(element + 7919 * i) % numel, bit=bit,
                       persistent=True)] for i in range(repeat)]


def _judge(spec: w.JobSpec, lookup: Any, results: list[Any], clean: Any) -> str:
    """suspect | masked | wrong:<what>."""
    try:
        v = judgment.judge({"cpu": _device(results)}, [spec], lookup).verdict("cpu")
    except ScreenerError as e:
        return f"wrong:exit {int(e.exit_code)}"
    if v.outcome == Outcome.SUSPECT:
        return "suspect"
    if all(r.digest == clean.digest for r in results):
        return "masked" if v.outcome == Outcome.PASS else f"wrong:{v.outcome.value}"
    return f"wrong:{v.outcome.value}"


def _index_case(spec: w.JobSpec, lookup: Any, clean: Any) -> str:
    """A corrupted position id: the child would report the IndexError as a job error."""
    try:
        _run(spec, [FaultSpec("arange", call=0, element=1, bit=40)])
    except Exception as e:  # noqa: BLE001 - the job's own failure is what is being measured
        run = DeviceRun("cpu", status=RunStatus.JOB_ERROR, platform_hash="bench",
                        current=(spec.name, 0), detail=f"{type(e).__name__}: {e}")
        try:
            v = judgment.judge({"cpu": run}, [spec], lookup).verdict("cpu")
        except ScreenerError as err:
            return f"wrong:exit {int(err.exit_code)}"
        return "suspect" if v.outcome == Outcome.SUSPECT else f"wrong:{v.outcome.value}"
    return "masked"


def campaign(per_cell: int, repeat: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    table: dict[str, Counter] = defaultdict(Counter)  # "pattern/bitclass" -> outcome counts
    by_op: dict[str, Counter] = defaultdict(Counter)
    tmp = Path(tempfile.mkdtemp(prefix="bench-kat-verdicts-"))
    for name in JOBS:
        spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == name)
        with preserved():
            clean = w.run_job(spec, "cpu")
            rec = golden.record_from_results(spec, {"name": "bench"}, "bench", [("x", clean)],
                                             repeats=1)
            golden.write(rec, tmp)
            lookup = golden_lookup(str(tmp))
            dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
                str(spec.params_for("cpu").get("dtype")), torch.float32)
            for op in OPS[spec.kind]:
                calls, numel = _counts(spec, op)
                for cls, bit in faults.bit_classes(dtype).items():
                    for pattern in PATTERNS:
                        for _ in range(per_cell):
                            plan = _faults_for(pattern, op, calls, numel, bit, repeat, rng)
                            results = [_run(spec, f)[0] for f in plan]
                            out = _judge(spec, lookup, results, clean)
                            table[f"{pattern}/{cls}"][out] += 1
                            by_op[f"{spec.name}/{op}"][out] += 1
            if spec.kind in ("train", "replay"):
                out = _index_case(spec, lookup, clean)
                table["index/-"][out] += 1
                by_op[f"{spec.name}/arange"][out] += 1
    return {"by_pattern": {k: dict(v) for k, v in sorted(table.items())},
            "by_op": {k: dict(v) for k, v in sorted(by_op.items())}}


def _print(result: dict[str, Any], seconds: float) -> None:
    keys = ["suspect", "masked"]
    print(f"{'pattern/bit class':28} {'cases':>6} {'suspect':>8} {'masked':>7} {'wrong':>6}")
    total: Counter = Counter()
    for k, counts in result["by_pattern"].items():
        n = sum(counts.values())
        wrong = n - sum(counts.get(x, 0) for x in keys)
        total.update(counts)
        print(f"{k:28} {n:6d} {counts.get('suspect', 0):8d} {counts.get('masked', 0):7d} "
              f"{wrong:6d}")
    n = sum(total.values())
    print(f"{'all':28} {n:6d} {total.get('suspect', 0):8d} {total.get('masked', 0):7d} "
          f"{n - total.get('suspect', 0) - total.get('masked', 0):6d}")
    bad = {k: v for k, v in total.items() if k.startswith("wrong")}
    print(f"wrong verdicts by kind: {bad or 'none'}; {seconds:.0f} s")
    print("\nby job/op:")
    for k, counts in result["by_op"].items():
        print(f"  {k:28} {dict(counts)}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-cell", type=int, default=4, help="faults per op, bit class, pattern")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each job (>= 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.repeat < 2 or a.per_cell < 1:
        ap.error("--repeat must be >= 2 and --per-cell >= 1")
    t0 = time.monotonic()
    result = campaign(a.per_cell, a.repeat, a.seed)
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result, time.monotonic() - t0)
    wrong = sum(c for v in result["by_pattern"].values() for k, c in v.items()
                if k.startswith("wrong"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
