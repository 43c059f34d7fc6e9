"""Fingerprint throughput: the plain implementation, ours, and a single-pass read of the same bytes.

Run:  python benchmarks/bench_fingerprint.py [--threads 1] [--device cpu] [--repeat 3]

Workloads (as in the foundation issue): the parameters of a 125M-parameter fp32 model (GPT-2 small
shapes) and one 256 MiB bf16 tensor. Prints GB/s for each implementation and the ratios, side by side
in one process. The plain implementation is the definition written the obvious way: an int64 copy and
an index tensor per chunk.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Sequence

import torch

from screener.fingerprint import fingerprints

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def plain_fingerprints(tensors: Sequence[torch.Tensor], chunk: int = 1 << 24) -> torch.Tensor:
    """The baseline: widen to int64 and multiply by an index tensor, chunk by chunk."""
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
def single_pass_read(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fastest single read of every byte we know: a float32 sum over the raw bytes.

    16-bit tensors are read as float32 words (torch's bf16/fp16 sums are not vectorised on the
    CPU, which would flatter us); the sum's value is meaningless, only its speed matters.
    """
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.element_size() == 2 and flat.numel() % 2 == 0:
            flat = flat.view(torch.float32)
        out.append(flat.sum(dtype=torch.float32))
    return torch.stack(out).cpu()


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


def timed(fn: Callable[[], object], repeat: int, device: str) -> float:
    fn()  # warm-up: workspace allocation, caches
    best = float("inf")
    for _ in range(repeat):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-plain", action="store_true", help="skip the slow baseline")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    workloads = {
        "gpt2-small params fp32 (124M)": gpt2_small_params(args.device),
        "one 256 MiB bf16 tensor": [torch.randn(128 << 20, device=args.device).to(torch.bfloat16)],
    }
    print(f"device={args.device} threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"{'workload':34s} {'plain GB/s':>11s} {'ours GB/s':>10s} {'read GB/s':>10s} "
          f"{'ours/plain':>11s} {'ours/read':>10s}")
    for name, tensors in workloads.items():
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        ours = nbytes / timed(lambda: fingerprints(tensors), args.repeat, args.device) / 1e9
        read = nbytes / timed(lambda: single_pass_read(tensors), args.repeat, args.device) / 1e9
        if args.skip_plain:
            plain = float("nan")
        else:
            plain = nbytes / timed(lambda: plain_fingerprints(tensors), 1, args.device) / 1e9
            assert torch.equal(plain_fingerprints(tensors), fingerprints(tensors)), "results differ"
        print(f"{name:34s} {plain:11.3f} {ours:10.2f} {read:10.2f} {ours / plain:10.1f}x "
              f"{ours / read:9.2f}x")


if __name__ == "__main__":
    main()
