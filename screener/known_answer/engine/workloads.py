"""Known-answer workloads: the deterministic work that a job spec (known_answer.specs) describes.

`run_job` runs a job on one device, returning a JobResult: per step, the loss bits (if the kind
has a loss) and the fingerprints of every tensor the step produced. Kinds:

- gemm: a chained GEMM sweep, X_{j+1} = (X_j @ W_j) * 2**-s, in one dtype (float32 with TF32 off
  or on, float16, bfloat16), fingerprinting every product. On CUDA the size is derived from the
  SM count so every SM gets several output tiles; on CPU the shapes are fixed in the spec.
- conv: a chain of 3x3 convolutions (cuDNN on CUDA), fingerprinting every output.
- train: several AdamW steps of the tiny transformer of screener.known_answer.engine.synthetic, in
  float32 or under bf16/fp16 autocast; per step the loss bits, each parameter's gradient
  fingerprint and each weight fingerprint after the update.
- replay: forward and backward of the micro-batch of (seed, rank, step) on a fresh model, the same
  batch construction the in-job ring replay audit uses, so any node can replay a peer's batch.
- selftest: exercises the runner itself (sleeps, exits or aborts in the child process); for tests
  of timeout and crash handling, never part of a screen unless named.

All data are generated on the device from integer seeds (screener.known_answer.engine.synthetic),
nothing is downloaded. torch, and the modules that import it at their top (screener.fingerprint,
synthetic, screener.determinism), are imported inside the functions that run jobs, so importing
this module stays cheap.

The spec names (JobSpec, load_jobs, select_jobs, check_fits, ...) live in
screener.known_answer.engine.specs and are re-exported here for the importers that take them from here.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence

from screener.errors import ConfigError
from screener.known_answer.verdict.results import JobResult, Step
from screener.known_answer.engine.specs import (JobSpec, check_fits, default_jobs_dir, describe,
                                         expected_steps, load_job, load_jobs, select_jobs)

# What this module runs, and the spec names its importers (the CLI, the tests) take from here.
__all__ = ["JobResult", "JobSpec", "Step", "check_fits", "default_jobs_dir", "describe",
           "expected_steps", "gemm_shapes", "load_job", "load_jobs", "loss_bits", "loss_value",
           "run_job", "select_jobs"]


def loss_bits(t: Any) -> str:
    """The raw bits of a scalar float tensor as hex (width of its dtype)."""
    import torch

    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
            torch.float64: torch.int64}[t.dtype]
    width = torch.iinfo(view).bits
    v = int(t.detach().reshape(()).view(view).item()) & ((1 << width) - 1)
    return f"0x{v:0{width // 4}x}"


def loss_value(bits: str, *, bfloat16: bool = False) -> float:
    """The float a loss bit pattern (as written by loss_bits) stands for; its width gives the
    type (16-bit patterns are float16 unless `bfloat16`)."""
    v = int(bits, 16)
    if len(bits) == 10:
        return struct.unpack("<f", struct.pack("<I", v))[0]
    if len(bits) == 18:
        return struct.unpack("<d", struct.pack("<Q", v))[0]
    if bfloat16:
        return struct.unpack("<f", struct.pack("<I", v << 16))[0]
    return struct.unpack("<e", struct.pack("<H", v))[0]


# --- running ------------------------------------------------------------------------------------

def _fault_ctx(injector: Optional[ContextManager[Any]]) -> ContextManager[Any]:
    # The injector is entered around computation only, never around fingerprinting, so a fault
    # in an op the fingerprint also uses (sum, copy) cannot corrupt the check instead of the work.
    return injector if injector is not None else contextlib.nullcontext()


def _dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
            "float8_e4m3fn": torch.float8_e4m3fn}[name]


FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


def fp8_gemm_available(device: str) -> bool:
    """Whether torch._scaled_mm runs FP8 GEMMs on the device: the CPU kernel (torch 2.13 has
    one), or a GPU of compute capability 8.9 or later."""
    import torch

    if not device.startswith("cuda"):
        return hasattr(torch, "_scaled_mm")
    return tuple(torch.cuda.get_device_capability(torch.device(device))) >= FP8_MIN_CAPABILITY


def _pow2_scale(fan_in: int) -> float:
    """A power of two near 1/sqrt(fan_in/3): keeps chained products of U(-1,1) data near unit
    size, and multiplying by it is exact, so it hides no bit of the product."""
    return 2.0 ** -round(math.log2(math.sqrt(max(fan_in, 1) / 3.0)))


def gemm_shapes(p: Mapping[str, Any], device: str) -> list[tuple[int, int]]:
    """The (rows, inner) shapes of a GEMM job on this device.

    Fixed in the spec on CPU. On CUDA (when the spec gives none): square n x n with
    n = tile * ceil(sqrt(tiles_per_sm * SMs)), so every SM gets about tiles_per_sm output tiles,
    plus a ragged (n + tile/2 + 1) x n problem that exercises partial edge tiles.
    """
    if p["shapes"]:
        return [(int(m), int(k)) for m, k in p["shapes"]]
    import torch

    if not device.startswith("cuda"):
        return [(256, 256)]
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return sm_sized_shapes(sms, int(p["tile"]), int(p["tiles_per_sm"]),
                           multiple=16 if p["dtype"] == "float8_e4m3fn" else 1)


def sm_sized_shapes(sms: int, tile: int, tiles_per_sm: int,
                    multiple: int = 1) -> list[tuple[int, int]]:
    """The CUDA GEMM shapes for a GPU of `sms` SMs (pure, so the CPU tests it): a square n x n
    product with n = tile * ceil(sqrt(tiles_per_sm * sms)), so its (n / tile)^2 output tiles are
    at least tiles_per_sm per SM and every SM runs (a GEMM too small to occupy every SM leaves a
    faulty SM unexercised), plus a ragged (n + tile/2 + 1) x n one whose edge tiles are partial.
    multiple: the row count the kernel needs a multiple of (16 for FP8's _scaled_mm): the ragged
    one then has n + tile/2 rows, still a partial last tile."""
    n = tile * math.ceil(math.sqrt(tiles_per_sm * sms))
    ragged = n + tile // 2 + (1 if multiple == 1 else 0)
    ragged += (-ragged) % multiple
    return [(n, n), (ragged, n)]


def _run_gemm(spec: JobSpec, p: Mapping[str, Any], device: str, injector: Any,
              keep_values: bool) -> tuple[list[Step], dict[str, Any]]:
    import torch

    from screener.fingerprint import fingerprints
    from screener.known_answer.engine.synthetic import mix_key, uniform

    dtype = _dtype(p["dtype"])
    shapes = gemm_shapes(p, device)
    chain = int(p["chain"])
    if p["dtype"] == "float8_e4m3fn":
        return _run_gemm_fp8(p, device, shapes, chain, injector, keep_values)
    xs, ws = [], []
    for i, (m, k) in enumerate(shapes):
        xs.append(uniform(mix_key(p["seed"], 1, i), (m, k), device=device).to(dtype))
        ws.append([uniform(mix_key(p["seed"], 2, i, j), (k, k), device=device).to(dtype)
                   for j in range(chain)])
    names = [f"product[{m}x{k}x{k}]" for m, k in shapes]
    steps, values = [], {}
    for j in range(chain):
        products = []
        with torch.no_grad(), _fault_ctx(injector):
            for i, (m, k) in enumerate(shapes):
                products.append(torch.mm(xs[i], ws[i][j]))
        rows = fingerprints(products).tolist()
        for i, (m, k) in enumerate(shapes):
            if keep_values:
                values[f"{j}/{names[i]}"] = products[i].detach().float().cpu()
            xs[i] = products[i] * _pow2_scale(k)  # outside the injector: not a product
        steps.append(Step(j, f"link {j}", None,
                          tuple((names[i], (r[0], r[1])) for i, r in enumerate(rows))))
    return steps, values


def _run_gemm_fp8(p: Mapping[str, Any], device: str, shapes: list[tuple[int, int]], chain: int,
                  injector: Any, keep_values: bool) -> tuple[list[Step], dict[str, Any]]:
    """Chained FP8 (e4m3) GEMMs through torch._scaled_mm, bfloat16 out, unit scales: the FP8
    tensor cores on CUDA (compute capability 8.9+), the CPU's FP8 kernel on the CPU. Each link's
    input is the previous product scaled by a power of two and cast back to FP8 (outside the
    injector: not a product). On a GPU without FP8 GEMMs the job says so in every step's label
    and checks the FP8 casts alone (what the GPU does have), never a quiet substitute GEMM."""
    import torch

    from screener.fingerprint import fingerprints
    from screener.known_answer.engine.synthetic import mix_key, uniform

    fp8 = torch.float8_e4m3fn
    available = fp8_gemm_available(device)
    one = torch.ones((), dtype=torch.float32, device=device)
    xs, ws = [], []
    for i, (m, k) in enumerate(shapes):
        xs.append(uniform(mix_key(p["seed"], 1, i), (m, k), device=device).to(fp8))
        # _scaled_mm takes its second operand column-major: the transpose of a row-major one
        ws.append([uniform(mix_key(p["seed"], 2, i, j), (k, k), device=device).to(fp8)
                   .t().contiguous().t() for j in range(chain)])
    names = [f"fp8_product[{m}x{k}x{k}]" if available else f"fp8_cast[{m}x{k}]"
             for m, k in shapes]
    label = "link {}" if available else "link {} (no FP8 GEMM on this GPU: casts only)"
    steps, values = [], {}
    for j in range(chain):
        products = []
        with torch.no_grad(), _fault_ctx(injector):
            for i in range(len(shapes)):
                if available:
                    products.append(torch._scaled_mm(xs[i], ws[i][j], scale_a=one, scale_b=one,
                                                     out_dtype=torch.bfloat16))
                else:
                    products.append((xs[i].to(torch.bfloat16) * 1.5).to(fp8).to(torch.bfloat16))
        rows = fingerprints(products).tolist()
        for i, (m, k) in enumerate(shapes):
            if keep_values:
                values[f"{j}/{names[i]}"] = products[i].detach().float().cpu()
            xs[i] = (products[i].float() * _pow2_scale(k)).to(fp8)
        steps.append(Step(j, label.format(j),
                          None, tuple((names[i], (r[0], r[1])) for i, r in enumerate(rows))))
    return steps, values


def _run_conv(spec: JobSpec, p: Mapping[str, Any], device: str, injector: Any,
              keep_values: bool) -> tuple[list[Step], dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from screener.fingerprint import fingerprints
    from screener.known_answer.engine.synthetic import mix_key, uniform

    dtype = _dtype(p["dtype"])
    b, c, s, layers = int(p["batch"]), int(p["channels"]), int(p["size"]), int(p["layers"])
    x = uniform(mix_key(p["seed"], 3), (b, c, s, s), device=device).to(dtype)
    weights = [uniform(mix_key(p["seed"], 4, j), (c, c, 3, 3), device=device).to(dtype)
               for j in range(layers)]
    scale = _pow2_scale(c * 9)
    steps, values = [], {}
    name = f"conv[{b}x{c}x{s}x{s}]"
    for j in range(layers):
        with torch.no_grad(), _fault_ctx(injector):
            y = F.conv2d(x, weights[j], padding=1)
        a, bb = fingerprints([y]).tolist()[0]
        if keep_values:
            values[f"{j}/{name}"] = y.detach().float().cpu()
        steps.append(Step(j, f"layer {j}", None, ((name, (a, bb)),)))
        x = y * scale
    return steps, values


def _model_kwargs(p: Mapping[str, Any]) -> dict[str, int]:
    return {k: int(p[k]) for k in ("vocab", "d_model", "n_heads", "d_ff", "seq", "n_layers")}


class _AdamW:
    """AdamW (decoupled weight decay, bias-corrected moments), written out per parameter.

    Written here rather than taken from torch.optim so the arithmetic of the known answer is
    fixed by this file (torch.optim picks foreach/fused kernels by device and version), and
    because constructing a torch.optim optimizer imports the compiler stack, seconds per child.
    """

    def __init__(self, params: Sequence[Any], *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        import torch

        self.params = list(params)
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    def step(self) -> None:
        import torch

        self.t += 1
        b1, b2 = self.betas
        c1 = 1.0 - b1 ** self.t
        c2 = 1.0 - b2 ** self.t
        with torch.no_grad():
            for p, m, v in zip(self.params, self.m, self.v):
                if p.grad is None:
                    continue
                g = p.grad
                p.mul_(1.0 - self.lr * self.wd)
                m.mul_(b1).add_(g, alpha=1.0 - b1)
                v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
                denom = (v / c2).sqrt_().add_(self.eps)
                p.addcdiv_(m, denom, value=-self.lr / c1)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _run_train(spec: JobSpec, p: Mapping[str, Any], device: str, injector: Any, keep_values: bool,
               after_step: Optional[Callable[[int, Any], None]]) -> tuple[list[Step], dict[str, Any]]:
    import torch

    from screener.fingerprint import fingerprints
    from screener.known_answer.engine.synthetic import batch_for, compute_loss, make_model

    model = make_model(int(p["seed"]), **_model_kwargs(p)).to(device)
    opt = _AdamW(list(model.parameters()), lr=float(p["lr"]),
                 weight_decay=float(p["weight_decay"]))
    names = [n for n, _ in model.named_parameters()]
    params = [q for _, q in model.named_parameters()]
    autocast = p["autocast"]
    steps, values = [], {}
    for step in range(int(p["steps"])):
        batch = batch_for(int(p["seed"]), 0, step, batch=int(p["batch"]), seq=int(p["seq"]),
                          vocab=int(p["vocab"]), device=device)
        with _fault_ctx(injector):
            if autocast != "none":
                with torch.autocast(device_type=torch.device(device).type, dtype=_dtype(autocast)):
                    loss = compute_loss(model, batch)
            else:
                loss = compute_loss(model, batch)
            loss.backward()
        grads = fingerprints([q.grad for q in params]).tolist()
        with _fault_ctx(injector):
            opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step, model)
        weights = fingerprints(params).tolist()
        bits = loss_bits(loss)
        if keep_values:
            values[f"{step}/loss"] = float(loss.detach().float().cpu())
        tensors = tuple((f"grad/{n}", (g[0], g[1])) for n, g in zip(names, grads)) + tuple(
            (f"weight/{n}", (w[0], w[1])) for n, w in zip(names, weights))
        steps.append(Step(step, f"step {step}", bits, tensors))
    return steps, values


def _run_replay(spec: JobSpec, p: Mapping[str, Any], device: str, injector: Any,
                keep_values: bool) -> tuple[list[Step], dict[str, Any]]:
    from screener.fingerprint import fingerprints
    from screener.known_answer.engine.synthetic import batch_for, compute_loss, make_model

    model = make_model(int(p["seed"]), **_model_kwargs(p)).to(device)
    names = [n for n, _ in model.named_parameters()]
    params = [q for _, q in model.named_parameters()]
    steps, values = [], {}
    i = 0
    for rank in range(int(p["ranks"])):
        for step in range(int(p["steps"])):
            batch = batch_for(int(p["seed"]), rank, step, batch=int(p["batch"]), seq=int(p["seq"]),
                              vocab=int(p["vocab"]), device=device)
            with _fault_ctx(injector):
                loss = compute_loss(model, batch)
                loss.backward()
            rows = fingerprints([batch[0], batch[1]] + [q.grad for q in params]).tolist()
            model.zero_grad(set_to_none=True)
            if keep_values:
                values[f"{i}/loss"] = float(loss.detach().float().cpu())
            tensors = (("tokens", tuple(rows[0])), ("targets", tuple(rows[1]))) + tuple(
                (f"grad/{n}", (r[0], r[1])) for n, r in zip(names, rows[2:]))
            steps.append(Step(i, f"rank {rank} step {step}", loss_bits(loss), tensors))
            i += 1
    return steps, values


def _run_selftest(p: Mapping[str, Any]) -> tuple[list[Step], dict[str, Any]]:
    if p["sleep"] > 0:
        time.sleep(float(p["sleep"]))
    if p["raise"]:
        raise RuntimeError(str(p["raise"]))
    if p["abort"]:
        os.abort()
    if p["signal"]:
        os.kill(os.getpid(), int(p["signal"]))
    if p["exit"] >= 0:
        os._exit(int(p["exit"]))
    return [Step(0, "selftest", None, ())], {}


def run_job(spec: JobSpec, device: str = "cpu", *, injector: Optional[ContextManager[Any]] = None,
            after_step: Optional[Callable[[int, Any], None]] = None, keep_values: bool = False,
            threads: int = 1) -> JobResult:
    """Run one job on one device in this process and return its result.

    Calls make_deterministic first (the job's TF32 setting, `threads` CPU threads). `injector`
    (e.g. a screener.known_answer.engine.faults.FaultInjector) is entered around the computation only;
    `after_step(step, model)` runs after each optimizer step of a train job (to corrupt a
    parameter, say). Process-wide settings are left changed: the runner's child processes exist
    for this job; wrap the call in screener.determinism.preserved() in a shared process.
    """
    from screener.determinism import make_deterministic

    p = spec.params_for(device)
    settings = make_deterministic(device, tf32=bool(p.get("tf32", False)), threads=threads)
    t0 = time.perf_counter()
    if spec.kind == "gemm":
        steps, values = _run_gemm(spec, p, device, injector, keep_values)
    elif spec.kind == "conv":
        steps, values = _run_conv(spec, p, device, injector, keep_values)
    elif spec.kind == "train":
        steps, values = _run_train(spec, p, device, injector, keep_values, after_step)
    elif spec.kind == "replay":
        steps, values = _run_replay(spec, p, device, injector, keep_values)
    elif spec.kind == "llm":
        from screener.known_answer.engine import llm

        steps, values = llm.run(p, device, lambda: _fault_ctx(injector),
                                None if p["autocast"] == "none" else _dtype(p["autocast"]),
                                loss_bits, keep_values)
    elif spec.kind == "selftest":
        steps, values = _run_selftest(p)
    else:  # pragma: no cover - JobSpec validation rejects unknown kinds
        raise ConfigError(f"{spec.path}: unknown kind {spec.kind!r}")
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    return JobResult(job=spec.name, spec_hash=spec.spec_hash, device=device, steps=tuple(steps),
                     seconds=time.perf_counter() - t0, settings=settings, values=values)
