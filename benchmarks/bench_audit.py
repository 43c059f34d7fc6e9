"""What the in-job audit costs: step time with and without the Auditor, side by side in one run.

Runs a real gloo process group on the CPU (default two ranks on two simulated nodes, one intra-op
thread each) and trains the synthetic tiny LM at two sizes. For each size, four DDP copies of the
same model are trained in turn, one step each per round (the order rotating every round), so
machine noise hits all of them alike:

    plain        DDP, no comm hook (torch's built-in all-reduce; it folds the division by the
                 world size into its copy of the gradients into the buckets)
    hook         DDP with a Python comm hook that only calls torch's allreduce_hook (a division
                 pass of its own, then the all-reduce)
    auditor      DDP + Auditor on steps without an audit (check 1 only: the hook's sum all-reduce,
                 then one fused pass that divides and checks finiteness; one small all_gather)
    no-sentinel  the same with the spike sentinel off (Auditor(sentinel=SentinelConfig(
                 enabled=False))): `auditor` minus the sentinel's largest-magnitude pass over
                 each bucket before its all-reduce (issue 21)
    auditor-norms the same with Auditor(reduce_hook=allreduce_hook): the generic path a reduce
                 hook of the caller's takes (and the default one took before issue 16): a norm
                 of each bucket before, allreduce_hook's division, a norm after
    norms-no-sentinel the same with the sentinel off. This is the path every CUDA run takes (the
                 fused pass is the CPU's), where check 1 measures each bucket before its
                 all-reduce anyway: `auditor-norms` over this is the sentinel's cost on a GPU
    audit        DDP + Auditor auditing every step (check 1 + ring replay: one extra forward and
                 backward per replayed micro-batch, gradient fingerprints in the hook and of the
                 replay)

    plain+clip   plain, with clip_grad_norm_ after backward (what most training loops do)
    auditor+clip DDP + Auditor(check_reduced=False) given clip_grad_norm_'s norm as grad_norm (on
                 the default path the same one pass as `auditor`; with a reduce hook of the
                 caller's it saves the hook's norm of the reduced buckets)

Steps with the Auditor include the RNG capture a replay needs (capture.py: the CPU generator's 5 KB
state copied by a forward pre-hook every step; an audit step sends the states to the replayers in
one more small all_gather before the replays, and runs a self-check replay on its first audit).

Then, in CPU time: one RNG capture, one weight check (fingerprints of every weight + a tiny
all_gather), a plain local forward+backward and the fingerprint speed on the gradients (what an
audit step is made of), and the passes a step without an audit is made of: allreduce_hook's
division, the auditor's fused divide-and-check, and the two norm passes of the generic path (a
reduce hook of the caller's).

Reports median step times (wall clock from a common start until every rank is done with the
step, as a synchronous job sees it, and the CPU time of rank 0's process, which other load on a
shared machine disturbs less) and their ratios to `plain`, paired per round, with the spread of
those ratios (interquartile range) so the noise is on the page. Also rank 0's wall time to its own
finish: the auditor's all_gather makes a rank wait for the slowest one inside the step, where a
plain step leaves that wait to the next collective, so on an oversubscribed machine that figure
charges the auditor with other ranks' lateness. Targets (issue 16): at most 5 %
on steps without an audit on the large model (3 ranks), at most x2 a plain step on audit steps.

    python benchmarks/bench_audit.py --world 3 --sizes large --rounds 60 \
        --configs plain,hook,auditor,audit   # issue 16's figures
    python benchmarks/bench_audit.py                 # both sizes, table on stdout
    python benchmarks/bench_audit.py --json          # results as JSON on stdout
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = {
    # ~0.9 M parameters
    "small": dict(vocab=2048, d_model=128, n_heads=4, d_ff=512, seq=64, n_layers=2, batch=4),
    # ~9 M parameters, a step of a few hundred ms on one core
    "large": dict(vocab=8192, d_model=256, n_heads=8, d_ff=1024, seq=64, n_layers=6, batch=2),
}
CONFIGS = ("plain", "hook", "auditor", "no-sentinel", "auditor-norms", "norms-no-sentinel", "audit",
           "plain+clip", "auditor+clip")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paired(xs: list[float], base: list[float]) -> float:
    return statistics.median(x / b for x, b in zip(xs, base))


def paired_iqr(xs: list[float], base: list[float]) -> tuple[float, float]:
    """The interquartile range of the per-round ratios: how much one round's ratio wanders."""
    ratios = sorted(x / b for x, b in zip(xs, base))
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    q = statistics.quantiles(ratios, n=4)
    return q[0], q[2]


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "NODE_NAME": f"bench-node-{rank}", "OMP_NUM_THREADS": str(args.threads),
                       "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from screener.known_answer.engine import synthetic
    from screener.audit import Auditor
    from screener.audit.sentinel import SentinelConfig
    from screener.audit.capture import capture
    from screener.fingerprint import fingerprints

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    results: dict[str, Any] = {}
    for size in args.sizes:
        shape = dict(SIZES[size])
        batch = shape.pop("batch")

        def batch_fn(r: int, step: int, shape=shape, batch=batch):
            return synthetic.batch_for(1, r, step, batch=batch, seq=shape["seq"],
                                       vocab=shape["vocab"])

        runs: dict[str, Any] = {}
        for name in args.configs:
            model = synthetic.make_model(1, **shape)
            ddp = DDP(model)
            auditor = None
            if name == "hook":
                ddp.register_comm_hook(None, allreduce_hook)
            elif name in ("auditor", "no-sentinel", "auditor-norms", "norms-no-sentinel", "audit",
                          "auditor+clip"):
                auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn,
                                  audit_every=1 if name == "audit" else 0, weights_every=0,
                                  check_reduced=name != "auditor+clip",
                                  sentinel=SentinelConfig(enabled="no-sentinel" not in name),
                                  reduce_hook=allreduce_hook if "norms" in name else None)
            runs[name] = {"model": model, "ddp": ddp, "auditor": auditor,
                          "opt": torch.optim.SGD(model.parameters(), lr=1e-3), "times": [], "own": [],
                          "cpu": [], "step": 0, "clip": name.endswith("+clip")}
        params = sum(p.numel() for p in runs["plain"]["model"].parameters())

        def one_step(run: dict[str, Any]) -> None:
            ddp, opt, auditor, step = run["ddp"], run["opt"], run["auditor"], run["step"]
            c0, t0 = time.process_time(), time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = synthetic.compute_loss(ddp, batch_fn(rank, step))
            loss.backward()
            norm = (torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1e9)
                    if run["clip"] else None)
            if auditor is not None:
                g0, w0 = time.process_time(), time.perf_counter()
                auditor.check_gradients(step, loss, grad_norm=norm)
                run.setdefault("check_cpu", []).append(time.process_time() - g0)
                run.setdefault("check_wall", []).append(time.perf_counter() - w0)
            opt.step()
            if auditor is not None:
                auditor.check_weights(step)
            run["own"].append(time.perf_counter() - t0)
            run["cpu"].append(time.process_time() - c0)
            dist.barrier()  # the step is over when every rank is done with it
            run["times"].append(time.perf_counter() - t0)
            run["step"] += 1

        for run in runs.values():  # warm-up: first iteration, bucket rebuild, allocator
            for _ in range(2):
                one_step(run)
            run["times"].clear()
            run["own"].clear()
            run["cpu"].clear()
            run.pop("check_cpu", None)
            run.pop("check_wall", None)
        for k in range(args.rounds):
            for j in range(len(args.configs)):
                dist.barrier()
                one_step(runs[args.configs[(j + k) % len(args.configs)]])

        # The pieces the auditor's cost is made of, in CPU time of this rank's process.
        local = runs["plain"]["model"]
        fwd_bwd, fp_grads, norms, weight_checks, divs, fused = [], [], [], [], [], []
        inv = torch.full((1,), 1.0 / world, dtype=torch.float32)
        for i in range(args.pieces):
            c0 = time.process_time()
            local.zero_grad(set_to_none=True)
            synthetic.compute_loss(local, batch_fn(rank, i)).backward()
            fwd_bwd.append(time.process_time() - c0)
            grads = [p.grad for p in local.parameters()]
            c0 = time.process_time()
            fingerprints(grads)
            fp_grads.append(time.process_time() - c0)
            c0 = time.process_time()
            for _ in range(2):  # the hook's two read passes: before and after the reduction
                for g in grads:
                    torch.linalg.vector_norm(g, dtype=torch.float32)
            norms.append(time.process_time() - c0)
            c0 = time.process_time()
            for g in grads:  # allreduce_hook's division before its all-reduce
                g.div_(world)
            divs.append(time.process_time() - c0)
            c0 = time.process_time()  # the auditor's one pass: divide the sum and check it
            torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), inv)
            fused.append(time.process_time() - c0)
        captures = []
        for i in range(args.pieces):
            c0 = time.perf_counter()
            for _ in range(100):
                capture(torch.device("cpu"))
            captures.append((time.perf_counter() - c0) / 100)
        checker = runs["auditor"]["auditor"]
        for i in range(args.pieces):
            dist.barrier()
            c0 = time.process_time()
            checker.check_weights(10_000 + i, force=True)
            weight_checks.append(time.process_time() - c0)
        # check 1's all_gather on its own (3 float64 per rank), after a barrier: what
        # check_gradients costs beyond its own bookkeeping
        bare_cpu, bare_wall = [], []
        head = torch.zeros(3, dtype=torch.float64)
        gathered = torch.empty(world * 3, dtype=torch.float64)
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        for i in range(10 * args.pieces):
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            gather_into(gathered, head)
            bare_cpu.append(time.process_time() - c0)
            bare_wall.append(time.perf_counter() - w0)

        med = {n: statistics.median(r["times"]) for n, r in runs.items()}
        cpu = {n: statistics.median(r["cpu"]) for n, r in runs.items()}
        fp_s = statistics.median(fp_grads)
        base = runs.get("plain")
        check = statistics.median(runs["auditor"]["check_cpu"]) if "auditor" in runs else 0.0
        own = statistics.median(fused) + check
        results[size] = {
            "parameters": params,
            "configs": list(runs),
            "step_ms": {n: 1e3 * v for n, v in med.items()},
            # paired: the median over rounds of (this configuration / plain in the same round)
            "ratio_to_plain": {n: paired(r["times"], base["times"]) for n, r in runs.items()},
            "ratio_iqr": {n: paired_iqr(r["times"], base["times"]) for n, r in runs.items()},
            # rank 0's own finish (without waiting for the other ranks at the end of the step)
            "own_ratio_to_plain": {n: paired(r["own"], base["own"]) for n, r in runs.items()},
            "own_ratio_iqr": {n: paired_iqr(r["own"], base["own"]) for n, r in runs.items()},
            "cpu_ms": {n: 1e3 * v for n, v in cpu.items()},
            "cpu_ratio_to_plain": {n: paired(r["cpu"], base["cpu"]) for n, r in runs.items()},
            "cpu_ratio_iqr": {n: paired_iqr(r["cpu"], base["cpu"]) for n, r in runs.items()},
            "weight_check_cpu_ms": 1e3 * statistics.median(weight_checks),
            "rng_capture_us": 1e6 * statistics.median(captures),
            "rng_capture_ratio": statistics.median(captures) / med["plain"],
            "weight_check_ratio": statistics.median(weight_checks) / cpu["plain"],
            "norm_passes_cpu_ms": 1e3 * statistics.median(norms),
            "division_pass_cpu_ms": 1e3 * statistics.median(divs),
            "fused_pass_cpu_ms": 1e3 * statistics.median(fused),
            "check_gradients_cpu_ms": 1e3 * check,
            "check_gradients_wall_ms": 1e3 * statistics.median(runs["auditor"]["check_wall"]),
            "bare_gather_cpu_ms": 1e3 * statistics.median(bare_cpu),
            "bare_gather_wall_ms": 1e3 * statistics.median(bare_wall),
            "auditor_own_work_ratio": own / cpu["plain"],
            "local_fwd_bwd_ms": 1e3 * statistics.median(fwd_bwd),
            "fingerprint_grads_ms": 1e3 * fp_s,
            "fingerprint_gb_per_s": params * 4 / fp_s / 1e9,
            # what an audit step should cost: one more forward+backward and the fingerprints of
            # the gradients twice (in the hook and of the replay)
            "audit_expected_cpu_ms": 1e3 * (cpu.get("auditor", cpu["plain"])
                                            + statistics.median(fwd_bwd) + 2 * fp_s),
            "samples_per_config": len(base["times"]),
        }
        if "auditor+clip" in runs and "plain+clip" in runs:
            # auditor+clip against its own baseline (plain+clip), paired per round
            clipped, plain_clip = runs["auditor+clip"], runs["plain+clip"]
            results[size]["clip_ratio"] = paired(clipped["times"], plain_clip["times"])
            results[size]["clip_cpu_ratio"] = paired(clipped["cpu"], plain_clip["cpu"])
        del runs
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _table(results: dict[str, Any], world: int, threads: int) -> str:
    lines = [f"screener.audit overhead: gloo on CPU, {world} ranks x {threads} thread(s); "
             f"median step times, ratios paired per round (their interquartile range in [])"]
    for size, r in results.items():
        ms, ratio, iqr = r["step_ms"], r["ratio_to_plain"], r["ratio_iqr"]
        cms, cratio, ciqr = r["cpu_ms"], r["cpu_ratio_to_plain"], r["cpu_ratio_iqr"]
        lines.append(f"\n{size}: {r['parameters'] / 1e6:.2f} M parameters, "
                     f"{r['samples_per_config']} steps per configuration")
        lines.append(f"  {'':<13} {'wall':>9}    {'ratio':<21} {'cpu':>9}    ratio")
        for name in r["configs"]:
            lines.append(f"  {name:<13} {ms[name]:9.1f} ms x{ratio[name]:.3f} "
                         f"[{iqr[name][0]:.3f}-{iqr[name][1]:.3f}] "
                         f"{cms[name]:9.1f} ms x{cratio[name]:.3f} "
                         f"[{ciqr[name][0]:.3f}-{ciqr[name][1]:.3f}]")
        own, oiqr = r["own_ratio_to_plain"], r["own_ratio_iqr"]
        lines.append("  wall until rank 0 alone is done (a plain step leaves its wait for the "
                     "slowest rank to the next collective): " + ", ".join(
                         f"{n} x{own[n]:.3f} [{oiqr[n][0]:.3f}-{oiqr[n][1]:.3f}]"
                         for n in r["configs"] if n != "plain"))
        lines.append(f"  steps without an audit add {100 * (ratio['auditor'] - 1):+.1f} % wall, "
                     f"{100 * (cratio['auditor'] - 1):+.1f} % cpu (target <= 5 % on the large "
                     f"model, 3 ranks)")
        if "audit" in ratio:
            lines.append(f"  an audit step: x{ratio['audit']:.2f} wall, x{cratio['audit']:.2f} "
                         f"cpu (target <= x2); it adds {cms['audit'] - cms['plain']:.1f} ms cpu; "
                         f"expected about {r['audit_expected_cpu_ms'] - cms['plain']:.1f} ms = "
                         f"one forward+backward ({r['local_fwd_bwd_ms']:.1f} ms) + 2 x gradient "
                         f"fingerprints ({r['fingerprint_grads_ms']:.1f} ms, "
                         f"{r['fingerprint_gb_per_s']:.2f} GB/s) + the every-step cost")
        lines.append(f"  the auditor's own work on a step without an audit: the fused divide-and-"
                     f"check pass {r['fused_pass_cpu_ms']:.1f} ms (allreduce_hook's division "
                     f"alone: {r['division_pass_cpu_ms']:.1f} ms; DDP without a hook folds it "
                     f"into its bucket copy) + check_gradients {r['check_gradients_cpu_ms']:.1f} "
                     f"ms cpu = {100 * r['auditor_own_work_ratio']:.1f} % of a plain step")
        lines.append(f"  check_gradients: {r['check_gradients_cpu_ms']:.2f} ms cpu, "
                     f"{r['check_gradients_wall_ms']:.2f} ms wall (waiting for the slowest rank); "
                     f"a bare all_gather of its 3 numbers after a barrier: "
                     f"{r['bare_gather_cpu_ms']:.2f} ms cpu, {r['bare_gather_wall_ms']:.2f} ms wall")
        lines.append(f"  the generic path (a reduce hook of the caller's) would add 2 norm passes: "
                     f"{r['norm_passes_cpu_ms']:.1f} ms cpu")
        if "clip_ratio" in r:
            clip, ccl = r["clip_ratio"], r["clip_cpu_ratio"]
            lines.append(f"  with clip_grad_norm_'s norm passed in: {100 * (clip - 1):+.1f} % "
                         f"wall, {100 * (ccl - 1):+.1f} % cpu vs plain+clip")
        lines.append(f"  the RNG capture on every step: {r['rng_capture_us']:.1f} us "
                     f"({100 * r['rng_capture_ratio']:.3f} % of a plain step)")
        lines.append(f"  a weight check: {r['weight_check_cpu_ms']:.1f} ms cpu "
                     f"(x{r['weight_check_ratio']:.3f} of a plain step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,large",
                   help=f"comma-separated, from {', '.join(SIZES)}")
    p.add_argument("--world", type=int, default=2, help="ranks (one per simulated node)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--rounds", type=int, default=30,
                   help="rounds; each trains one step of every configuration")
    p.add_argument("--pieces", type=int, default=5,
                   help="repetitions of the local forward+backward, fingerprint, weight check")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, from {', '.join(CONFIGS)} (plain and auditor always "
                        f"run)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    args = p.parse_args(argv)
    args.sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in args.sizes if s not in SIZES]
    wanted = {c for c in args.configs.split(",") if c} | {"plain", "auditor"}
    unknown += sorted(wanted - set(CONFIGS))
    args.configs = [c for c in CONFIGS if c in wanted]
    if unknown or args.world < 2 or args.pieces < 1 or args.rounds < 1:
        print(f"bad arguments: unknown {unknown or 'none'}, world >= 2, rounds/pieces >= 1",
              file=sys.stderr)
        return 2
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "results.json")
        mp.start_processes(_rank_main, args=(args.world, _free_port(), args, out),
                           nprocs=args.world, start_method="spawn")
        results = json.loads(Path(out).read_text())
    print(json.dumps(results, indent=2) if args.json else _table(results, args.world,
                                                                  args.threads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
