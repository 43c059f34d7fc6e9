"""Fingerprint throughput: the plain definition, the pure-torch path, the current backend, and a read pass.

Run:  python benchmarks/bench_fingerprint.py [--threads 1] [--device cpu|cuda] [--rounds 5]
      python benchmarks/bench_fingerprint.py --load-test        # 2 threads, quiet vs a busy machine

Everything is measured side by side in one process, in interleaved rounds (round r times every
implementation once), and the median of the rounds is printed as GB/s with the ratios the targets are
stated in (issue 16):
  - plain: the definition written the obvious way (int64 copy and an index tensor per chunk);
  - torch: screener's pure-torch reference path (what ran before the compiled kernel);
  - ours:  fingerprints() with the backend it picks here (printed in the header);
  - read:  one read pass over the same bytes, torch.sum of the int64 view of each tensor.
All implementations must agree bit for bit on every workload (checked; the run fails otherwise).

--load-test: with 2 threads, times single calls on a 256 MiB tensor on a quiet machine, then while
busy processes (one per core, spinning) compete for the CPUs, and prints the worst call under load
as a multiple of the quiet median (target <= 3x: one parallel region per call, so a descheduled
thread can stall a call at most once). With more than one thread, set OMP_WAIT_POLICY=PASSIVE to
measure the kernel alone: torch's OpenMP workers (libgomp) spin for some milliseconds after every
parallel region (300,000 pause instructions: ~15 ms on a Xeon with 140-cycle PAUSE) and take a core
from the kernel's helper thread, while the read pass runs on those very workers. The header prints
the policy in force. --device cuda adds the HBM copy bandwidth as the yardstick
(target: ours >= 0.7 of copy).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Callable, Sequence

import torch

from screener.fingerprint import _torch_fingerprints, backend, fingerprints
from screener.kernels import cpu as native_cpu

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def plain_fingerprints(tensors: Sequence[torch.Tensor], chunk: int = 1 << 24) -> torch.Tensor:
    """The definition written the obvious way: widen to int64, multiply by an index tensor."""
    dev = tensors[0].device
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=dev)
    for k, t in enumerate(tensors):
        bits = t.detach().contiguous().view(-1).view(_INT_VIEW[t.element_size()])
        for i in range(0, bits.numel(), chunk):
            b = bits[i:i + chunk].to(torch.int64)
            pos = torch.arange(i + 1, i + 1 + b.numel(), dtype=torch.int64, device=dev)
            out[k, 0] += b.sum()
            out[k, 1] += (b * pos).sum()
    return out.cpu()


@torch.no_grad()
def read_pass(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One read of every byte: torch.sum of each tensor's int64 view (int32/uint8 view for sizes
    that are not a multiple of 8 bytes). The value means nothing; only its speed matters."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1).view(torch.uint8)
        n = flat.numel()
        out.append(flat.view(torch.int64).sum() if n % 8 == 0 else
                   flat.view(torch.int32).sum() if n % 4 == 0 else flat.sum())
    return out


def gpt2_small_params(device: str) -> list[torch.Tensor]:
    """Parameters with the shapes of GPT-2 small (124M), filled with small normal values."""
    g = torch.Generator(device="cpu").manual_seed(0)
    d, ff, vocab, ctx, layers = 768, 3072, 50257, 1024, 12
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, ff), (ff,),
                   (ff, d), (d,)]
    shapes += [(d,), (d,)]
    return [(torch.randn(s, generator=g) * 0.02).to(device) for s in shapes]


def small_tensors(device: str, count: int = 10_000) -> list[torch.Tensor]:
    """`count` fp32 tensors of 1-4 KiB (256-1024 elements), as a model's biases and norms."""
    g = torch.Generator(device="cpu").manual_seed(1)
    sizes = torch.randint(256, 1025, (count,), generator=g).tolist()
    return [torch.randn(n, generator=g).to(device) for n in sizes]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def one_call(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def compare(tensors: list[torch.Tensor], rounds: int, device: str, skip_plain: bool) -> dict:
    """Median seconds per implementation over interleaved rounds, after one warm-up each."""
    impls: dict[str, Callable[[], object]] = {
        "torch": lambda: _torch_fingerprints(tensors),
        "ours": lambda: fingerprints(tensors),
        "read": lambda: read_pass(tensors),
    }
    if not skip_plain:
        impls["plain"] = lambda: plain_fingerprints(tensors)
    results = {name: fn() for name, fn in impls.items() if name != "read"}
    ref = results["ours"]
    for name, got in results.items():
        assert torch.equal(got, ref), f"{name} differs from fingerprints()"
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(rounds):
        for name, fn in impls.items():
            if name == "plain" and r > 0:
                continue  # the slow baseline once: it is 100x off, a median of one is plenty
            times[name].append(one_call(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _spin(stop) -> None:  # a busy process: the load of the load test
    while not stop.is_set():
        pass


def load_test(threads: int, calls: int) -> None:
    torch.set_num_threads(threads)
    x = torch.randn(64 << 20)  # fp32, 256 MiB
    impls = {"ours": lambda: fingerprints([x]), "torch": lambda: _torch_fingerprints([x])}
    print(f"load test: fp32 256 MiB, threads={torch.get_num_threads()}, backend={backend('cpu')}, "
          f"{calls} calls each (torch path: {max(3, calls // 10)})")
    quiet = {}
    for name, fn in impls.items():
        fn()
        n = calls if name == "ours" else max(3, calls // 10)
        quiet[name] = [one_call(fn, "cpu") for _ in range(n)]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(mp.cpu_count())]
    for p in procs:
        p.start()
    time.sleep(1.0)
    try:
        busy = {}
        for name, fn in impls.items():
            n = calls if name == "ours" else max(3, calls // 10)
            busy[name] = [one_call(fn, "cpu") for _ in range(n)]
    finally:
        stop.set()
        for p in procs:
            p.join(5)
    print(f"{'impl':6s} {'quiet median ms':>16s} {'busy median ms':>15s} {'busy max ms':>12s} "
          f"{'max/quiet median':>17s}")
    for name in impls:
        qm = statistics.median(quiet[name])
        print(f"{name:6s} {qm * 1e3:16.1f} {statistics.median(busy[name]) * 1e3:15.1f} "
              f"{max(busy[name]) * 1e3:12.1f} {max(busy[name]) / qm:16.2f}x")


def copy_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """HBM copy bandwidth in GB/s (bytes read + bytes written per second), median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = [one_call(lambda: dst.copy_(src), device) for _ in range(5)]
    return 2 * nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-plain", action="store_true", help="skip the slow baseline")
    ap.add_argument("--load-test", action="store_true", help="2 threads, quiet vs busy machine")
    ap.add_argument("--calls", type=int, default=40, help="calls per phase of the load test")
    args = ap.parse_args()
    if args.load_test:
        load_test(2, args.calls)
        return
    torch.set_num_threads(args.threads)
    dev = args.device
    g = torch.Generator(device="cpu").manual_seed(2)
    workloads = {
        "fp32 256 MiB": [torch.randn(64 << 20, generator=g).to(dev)],
        "bf16 256 MiB": [torch.randn(128 << 20, generator=g).to(torch.bfloat16).to(dev)],
        "fp8 e4m3 256 MiB": [torch.randn(256 << 20, generator=g).to(torch.float8_e4m3fn).to(dev)],
        "GPT-2-small params fp32": gpt2_small_params(dev),
        "10,000 tensors of 1-4 KiB": small_tensors(dev),
    }
    kernel = native_cpu.load()[0]
    isa = f" ({kernel.isa})" if kernel is not None and backend(dev) == "native" else ""
    print(f"device={dev} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"backend={backend(dev)}{isa} OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} "
          f"rounds={args.rounds} (median GB/s)")
    if dev.startswith("cuda"):
        copy = copy_bandwidth(dev)
        print(f"HBM copy bandwidth: {copy:.0f} GB/s (read + write)")
    print(f"{'workload':27s} {'plain':>7s} {'torch':>7s} {'ours':>7s} {'read':>7s} "
          f"{'ours/plain':>10s} {'ours/torch':>10s} {'ours/read':>9s}"
          + (f" {'ours/copy':>9s}" if dev.startswith("cuda") else ""))
    for name, tensors in workloads.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        med = compare(tensors, args.rounds, dev, args.skip_plain)
        gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
        plain = gbs.get("plain", float("nan"))
        line = (f"{name:27s} {plain:7.3f} {gbs['torch']:7.2f} {gbs['ours']:7.2f} {gbs['read']:7.2f} "
                f"{gbs['ours'] / plain:9.1f}x {gbs['ours'] / gbs['torch']:9.1f}x "
                f"{gbs['ours'] / gbs['read']:8.2f}x")
        if dev.startswith("cuda"):
            line += f" {gbs['ours'] / copy:8.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
