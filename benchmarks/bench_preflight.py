"""The preflight's figures (issue 24.5): its wall time, and the faults its job subset still catches.

    python benchmarks/bench_preflight.py timing [--runs 10]        # cold, warm and fast path
    python benchmarks/bench_preflight.py coverage [--per-cell 2]    # subset vs full quick screen

timing: `screener preflight --device cpu` end to end as a subprocess (probes, the known-answer
child, the judgment) against goldens recorded here for this CPU, `--runs` times each:
- cold: every run with an empty bytecode cache (PYTHONPYCACHEPREFIX to a new folder), as the
  first start in a container whose image ships no .pyc files;
- warm: the same with the cache kept between runs;
- fast path: a recent passing verdict in $SCREENER_NODE_VERDICT (only the probes run).
Prints the median and the range of each.

coverage: a fault class is (op, dtype, bit class, pattern): a unit that computes that op in that
dtype wrongly. It fires in every quick-screen job that runs the op in that dtype (at a random call
and element of each, as one bad unit would show in different jobs). Each job is judged against a
golden recorded from a clean run (screener.known_answer.verdict.judgment, as `kat run` judges): the
full quick screen with 2 runs of every quick job, the preflight with 1 run of its subset (the first
of the same runs). A class is caught when any of its cases comes out suspect.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from screener.agent.preflight import DEFAULT_JOBS  # noqa: E402

PATTERNS = ("one-shot", "persistent")


# --- timing ---------------------------------------------------------------------------------------

def _once(env: dict[str, str], golden: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "screener.cli", "preflight", "--device", "cpu",
                        "--golden-dir", golden, "--alarm-dir", tempfile.mkdtemp()],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    seconds = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"preflight exited {r.returncode}: {r.stderr.strip()[-400:]}")
    return seconds


def timing(runs: int) -> dict[str, Any]:
    from screener.known_answer.engine.screen import record_goldens, resolve_jobs

    golden = tempfile.mkdtemp(prefix="bench-preflight-golden-")
    rec = record_goldens(resolve_jobs(list(DEFAULT_JOBS)), ["cpu"], out_dir=golden,
                             repeat=2)
    if int(rec.exit_code) != 0:
        raise SystemExit("could not record goldens: " + "; ".join(rec.lines()))
    base = {k: v for k, v in os.environ.items() if not k.startswith("SCREENER_")}
    base["NODE_NAME"] = "bench"
    out: dict[str, list[float]] = defaultdict(list)
    warm_cache = tempfile.mkdtemp(prefix="bench-preflight-pyc-")
    for _ in range(runs):
        out["cold"].append(_once({**base, "PYTHONPYCACHEPREFIX": tempfile.mkdtemp()}, golden))
        out["warm"].append(_once({**base, "PYTHONPYCACHEPREFIX": warm_cache}, golden))
        verdict = json.dumps({"time": time.time() - 60, "outcome": "pass"})
        out["fast"].append(_once({**base, "PYTHONPYCACHEPREFIX": warm_cache,
                                  "SCREENER_NODE_VERDICT": verdict}, golden))
    return {k: {"median_s": round(statistics.median(v), 2), "min_s": round(min(v), 2),
                "max_s": round(max(v), 2), "runs": len(v)} for k, v in out.items()}


# --- coverage -------------------------------------------------------------------------------------

def _op_dtypes(spec: Any, ops: list[str]) -> dict[str, tuple[Any, int, int]]:
    """op -> (dtype of its outputs, calls per run, elements of its smallest output)."""
    import torch

    from screener.known_answer.engine import workloads as w

    seen: dict[str, list[Any]] = defaultdict(list)

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ops:
                t = out[0] if isinstance(out, (tuple, list)) else out
                seen[name].append((t.dtype, t.numel()))
            return out

    w.run_job(spec, "cpu", injector=Record())
    return {op: (v[0][0], len(v), min(n for _, n in v)) for op, v in seen.items()
            if len({d for d, _ in v}) == 1}


def coverage(per_cell: int, seed: int) -> dict[str, Any]:
    import bench_kat_verdicts as bkv

    from screener.determinism import preserved
    from screener.known_answer.engine import faults, golden
    from screener.known_answer.engine.screen import golden_lookup
    from screener.known_answer.engine import workloads as w

    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-preflight-"))
    jobs = [s for s in w.load_jobs(ROOT / "jobs") if s.quick]
    setup: dict[str, Any] = {}
    exercisers: dict[tuple[str, str], list[str]] = defaultdict(list)
    with preserved():
        for spec in jobs:
            clean = w.run_job(spec, "cpu")
            golden.write(golden.record_from_results(spec, {"name": "bench"}, "bench",
                                                    [("x", clean)], repeats=1), tmp)
            ops = bkv.OPS["gemm" if spec.kind == "gemm" else spec.kind]
            found = _op_dtypes(spec, ops)
            setup[spec.name] = (spec, clean, found)
            for op, (dtype, _, _) in found.items():
                exercisers[(op, str(dtype).replace("torch.", ""))].append(spec.name)
        lookup = golden_lookup(str(tmp))
        classes: dict[str, dict[str, int]] = {}
        for (op, dname), names in sorted(exercisers.items()):
            dtype = setup[names[0]][2][op][0]
            for cls, bit in faults.bit_classes(dtype).items():
                for pattern in PATTERNS:
                    key = f"{op}/{dname}/{cls}/{pattern}"
                    classes[key] = _cases(setup, names, op, bit, pattern, per_cell, rng, lookup,
                                          bkv)
    return _summary(classes, exercisers)


def _cases(setup: dict[str, Any], names: list[str], op: str, bit: int, pattern: str,
           per_cell: int, rng: random.Random, lookup: Any, bkv: Any) -> dict[str, int]:
    """per_cell faults of one class: how many the full quick screen and the preflight catch."""
    full = pre = 0
    for _ in range(per_cell):
        hit_full = hit_pre = False
        for name in names:
            spec, clean, found = setup[name]
            _, calls, numel = found[op]
            plan = bkv._faults_for(pattern, op, calls, numel, bit, 2, rng)
            results = [bkv._run(spec, f)[0] for f in plan]
            hit_full |= bkv._judge(spec, lookup, results, clean) == "suspect"
            if name in DEFAULT_JOBS:
                hit_pre |= bkv._judge(spec, lookup, results[:1], clean) == "suspect"
        full += hit_full
        pre += hit_pre
    return {"cases": per_cell, "full": full, "preflight": pre}


def _summary(classes: dict[str, dict[str, int]],
             exercisers: dict[tuple[str, str], list[str]]) -> dict[str, Any]:
    caught_full = [k for k, v in classes.items() if v["full"]]
    caught_pre = [k for k, v in classes.items() if v["preflight"]]
    return {"preflight_jobs": list(DEFAULT_JOBS), "classes": len(classes),
            "caught_by_full_quick_screen": len(caught_full),
            "caught_by_preflight": len(caught_pre),
            "cases": sum(v["cases"] for v in classes.values()),
            "cases_full": sum(v["full"] for v in classes.values()),
            "cases_preflight": sum(v["preflight"] for v in classes.values()),
            "missed_by_preflight": sorted(set(caught_full) - set(caught_pre)),
            "exercised_by": {f"{op}/{d}": names for (op, d), names in sorted(exercisers.items())},
            "by_class": classes}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["timing", "coverage"])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    result = timing(a.runs) if a.what == "timing" else coverage(a.per_cell, a.seed)
    result["bench_seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
