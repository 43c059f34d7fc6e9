"""The one function that makes a run bit-reproducible: call it first in every known-answer process.

Bit-for-bit comparison is only fair when the same inputs always take the same arithmetic path.
`make_deterministic` pins every knob we know of that changes the bits of a result:

- deterministic algorithms only (torch raises on an op that has no deterministic implementation,
  which is a screener bug, not a hardware verdict);
- CUBLAS_WORKSPACE_CONFIG, which cuBLAS needs for deterministic split-K reductions; it must be set
  before the first cuBLAS handle is created, hence one child process per device;
- TF32 for matmul and cuDNN, per job (the TF32 GEMM job turns it on, every other job off);
- reduced-precision reductions inside fp16/bf16 GEMMs off, so split-K sums are not rounded early;
- cuDNN benchmark off (autotuning may pick a different kernel each run) and deterministic on;
- the CPU thread count (a different thread count splits CPU reductions differently).

Only torch and the standard library are imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional

import torch

CUBLAS_WORKSPACE = ":4096:8"


def _set_tf32(tf32: bool) -> dict[str, Any]:
    """Set TF32 for matmul and cuDNN.

    Through the allow_tf32 flags on purpose: torch 2.9+ keeps them in sync with the newer
    fp32_precision settings, whereas setting fp32_precision makes any later read of allow_tf32
    (by other code in the process) raise a RuntimeError about mixing the two APIs.
    """
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return {"matmul_allow_tf32": tf32, "cudnn_allow_tf32": tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def _set_deterministic_algorithms(mode: bool, warn_only: bool = False) -> None:
    """torch.use_deterministic_algorithms without its import of torch._inductor.config.

    That import pulls in dynamo and costs several seconds per child process, for a compiler we
    never use. If inductor is already loaded we set its flag too, as the public function does.
    """
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # a torch without the private setter: take the slow public path
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        return
    inductor_config: Any = sys.modules.get("torch._inductor.config")  # a module: its flags are Any
    if inductor_config is not None:
        inductor_config.deterministic = mode
    setter(mode, warn_only=warn_only)


def make_deterministic(device: torch.device | str, *, tf32: bool = False,
                       threads: Optional[int] = 1) -> dict[str, Any]:
    """Pin every setting that changes result bits, for work on `device`; returns what it set.

    `threads`: the CPU intra-op thread count (None leaves it alone). Safe to call more than once
    in a process (each job sets its own TF32 flag); the CUBLAS workspace setting only takes effect
    if it is set before CUDA is first used in the process.
    """
    dev = torch.device(device)
    applied: dict[str, Any] = {"device": str(dev)}
    previous = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if previous not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    applied["CUBLAS_WORKSPACE_CONFIG"] = os.environ["CUBLAS_WORKSPACE_CONFIG"]
    _set_deterministic_algorithms(True)
    applied["deterministic_algorithms"] = True
    applied.update(_set_tf32(tf32))
    applied["tf32"] = tf32
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    applied["reduced_precision_reduction"] = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    applied["cudnn_benchmark"] = False
    applied["cudnn_deterministic"] = True
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        torch.set_num_threads(threads)
    applied["threads"] = torch.get_num_threads()
    if dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(dev)
    return applied


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Restore, on exit, every process-wide setting make_deterministic changes.

    For running a known-answer job inside a process that has other work to do (tests, a
    benchmark, an in-job check): the job pins what it needs and leaves the process as it was.
    """
    env = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    det = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    reduced = (torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
               torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    cudnn = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = env
        _set_deterministic_algorithms(det, warn_only=warn_only)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        (torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
         torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction) = reduced
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = cudnn
        torch.set_num_threads(threads)
