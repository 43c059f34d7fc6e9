"""The `llm` known-answer job: training steps of a small Llama-style model, with the kernels real
training spends its time in.

The `train` job's model is written out op by op (matmul + softmax attention, GELU, LayerNorm, a
per-parameter AdamW) so that its bits are fixed by our code. Real training runs other kernels,
and a fault there was never seen (issue 33.1): scaled_dot_product_attention's backends, RMSNorm
(pow, mean, rsqrt), rotary position embeddings (exp, sin, cos, cat, index_select of positions
from a cumsum), a SwiGLU MLP (silu), a z-loss (logsumexp) and a token-frequency weighted
cross-entropy (scatter_add, gather), gradient clipping (the foreach norm), and the foreach and
fused AdamW kernels. This job runs them, with the same rules as every job: weights and data from
the counter-based hash (screener.known_answer.engine.synthetic), deterministic algorithms, one CPU
thread, and per step the loss bits, every gradient, the clipped norm and every weight
fingerprinted.

Attention: each layer takes the next entry of `attention` ("backend:mask", mask causal or full),
run under torch.nn.attention.sdpa_kernel with that one backend, so every backend listed is in
the forward and the backward of every step. On the CPU that is math and flash (the CPU flash
kernel's backward reproduces its bits with one thread). On CUDA the training layers use math:
the flash and memory-efficient backward kernels accumulate with atomics where torch does not
promise otherwise, and a job compared bit for bit must give the same bits on healthy hardware.
Those backends, and cuDNN's, run instead in `probe_attention` ("backend:mask"): each step, the
forward kernel alone on inputs from the hash, in the job's dtype (flash and cuDNN take float16
or bfloat16 only), its output fingerprinted. A probe backend the device has no kernel for (cuDNN
attention on an older GPU) is recorded as such in the tensor's name (a property of the platform,
so every device of it says the same), never replaced by another backend's result; a training
layer's backend the device cannot run raises, and the job fails: its spec is wrong for the device.

The optimizer: step s runs `optimizers[s % len]`, "foreach" (AdamW written with torch._foreach_*
ops, the arithmetic of torch.optim.AdamW(foreach=True)) or "fused" (torch._fused_adamw_, the
kernel of torch.optim.AdamW(fused=True)), on one shared state. Called directly: constructing a
torch.optim optimizer imports the compiler stack, seconds per child.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from screener.fingerprint import fingerprints
from screener.known_answer.verdict.results import Step
from screener.known_answer.engine.synthetic import batch_for, mix_key, uniform

BACKENDS = ("math", "flash", "efficient", "cudnn")
MASKS = ("causal", "full")
OPTIMIZERS = ("foreach", "fused")
_TAG = 0x11A3  # the hash stream of this job's weights


def parse_attention(entry: str) -> tuple[str, bool]:
    """("flash", True) from "flash:causal"; ValueError naming the entry when it is neither."""
    backend, _, mask = entry.partition(":")
    if backend not in BACKENDS or mask not in MASKS:
        raise ValueError(f"attention entry {entry!r} is not <backend>:<mask> with backend one of "
                         f"{', '.join(BACKENDS)} and mask causal or full")
    return backend, mask == "causal"


def _sdpa_backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}[name]


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Block(nn.Module):
    """Pre-norm block: RMSNorm, rotary self-attention through SDPA, RMSNorm, SwiGLU."""

    def __init__(self, d: int, heads: int, d_ff: int, backend: str, causal: bool) -> None:
        super().__init__()
        self.heads, self.backend, self.causal = heads, backend, causal
        self.norm1, self.norm2 = _RMSNorm(d), _RMSNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Parameter(torch.empty(d, d)) for _ in range(4))
        self.w1, self.w3 = nn.Parameter(torch.empty(d_ff, d)), nn.Parameter(torch.empty(d_ff, d))
        self.w2 = nn.Parameter(torch.empty(d, d_ff))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        from torch.nn.attention import sdpa_kernel

        b, t, d = x.shape
        hd = d // self.heads
        h = self.norm1(x)
        q, k, v = (F.linear(h, w).view(b, t, self.heads, hd).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        with sdpa_kernel([_sdpa_backend(self.backend)]):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + F.linear(y.transpose(1, 2).reshape(b, t, d), self.wo)
        h = self.norm2(x)
        return x + F.linear(F.silu(F.linear(h, self.w1)) * F.linear(h, self.w3), self.w2)


class _LlamaLM(nn.Module):
    def __init__(self, p: Mapping[str, Any]) -> None:
        super().__init__()
        d, self.heads = int(p["d_model"]), int(p["n_heads"])
        self.theta = float(p["rope_theta"])
        self.tok = nn.Parameter(torch.empty(int(p["vocab"]), d))
        layout = [parse_attention(str(a)) for a in p["attention"]]
        self.blocks = nn.ModuleList(
            _Block(d, self.heads, int(p["d_ff"]), *layout[i % len(layout)])
            for i in range(int(p["n_layers"])))
        self.norm = _RMSNorm(d)
        self.head = nn.Parameter(torch.empty(int(p["vocab"]), d))

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        hd = self.tok.shape[1] // self.heads
        # Positions from a cumsum over the (all-ones) mask, as packed-sequence loaders make them,
        # then the rotary tables gathered by index_select.
        pos = torch.cumsum(torch.ones_like(tokens), dim=1) - 1
        inv_freq = torch.exp(torch.arange(0, hd, 2, device=tokens.device, dtype=torch.float32)
                             * (-math.log(self.theta) / hd))
        angles = torch.outer(torch.arange(t, device=tokens.device, dtype=torch.float32), inv_freq)
        table = torch.cat((angles, angles), dim=-1)
        flat = pos.reshape(-1)
        cos = table.cos().index_select(0, flat).view(b, 1, t, hd)
        sin = table.sin().index_select(0, flat).view(b, 1, t, hd)
        x = F.embedding(tokens, self.tok)
        for block in self.blocks:
            x = block(x, cos, sin)
        return F.linear(self.norm(x), self.head)


def make_model(p: Mapping[str, Any], device: str) -> nn.Module:
    """The model of a spec's parameters, every weight from the hash (no RNG touched)."""
    model = _LlamaLM(p)
    d = int(p["d_model"])
    with torch.no_grad():
        for i, (name, q) in enumerate(model.named_parameters()):
            if name.endswith("weight"):  # the RMSNorm gains
                q.fill_(1.0)
                continue
            scale = 0.05 if name in ("tok",) else 1.0 / math.sqrt(q.shape[-1] if q.dim() > 1 else d)
            q.copy_(uniform(mix_key(int(p["seed"]), _TAG, i), tuple(q.shape)) * scale)
    return model.to(device)


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor, vocab: int, z_loss: float) -> Tensor:
    """Cross-entropy weighted by inverse token frequency in the batch (scatter_add, gather),
    plus a z-loss on the log-partition (logsumexp), in float32."""
    logits = model(tokens).float().reshape(-1, vocab)
    flat = targets.reshape(-1)
    counts = torch.zeros(vocab, device=flat.device, dtype=torch.float32).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.float32))
    weight = 1.0 / counts.gather(0, flat)
    ce = F.cross_entropy(logits, flat, reduction="none")
    lse = torch.logsumexp(logits, dim=-1)
    return (ce * weight).sum() / weight.sum() + z_loss * lse.pow(2).mean()


class _AdamState:
    """One AdamW state, stepped by the foreach ops or the fused kernel (see the docstring)."""

    def __init__(self, params: Sequence[Tensor], *, lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        self.params = list(params)
        self.lr, self.wd, self.betas, self.eps = lr, weight_decay, betas, eps
        self.m = [torch.zeros_like(q) for q in params]
        self.v = [torch.zeros_like(q) for q in params]
        self.steps = [torch.zeros((), dtype=torch.float32, device=q.device) for q in params]
        self.t = 0

    def step(self, kind: str) -> None:
        grads: list[Tensor] = []
        for q in self.params:
            assert q.grad is not None  # every parameter takes part in the loss
            grads.append(q.grad)
        self.t += 1
        b1, b2 = self.betas
        with torch.no_grad():
            if kind == "fused":
                torch._foreach_add_(self.steps, 1.0)
                torch._fused_adamw_(self.params, grads, self.m, self.v, [], self.steps,
                                    lr=self.lr, beta1=b1, beta2=b2, weight_decay=self.wd,
                                    eps=self.eps, amsgrad=False, maximize=False)
                return
            torch._foreach_add_(self.steps, 1.0)
            torch._foreach_mul_(self.params, 1.0 - self.lr * self.wd)
            torch._foreach_lerp_(self.m, grads, 1.0 - b1)
            torch._foreach_mul_(self.v, b2)
            torch._foreach_addcmul_(self.v, grads, grads, 1.0 - b2)
            c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
            denom = torch._foreach_sqrt(self.v)
            torch._foreach_div_(denom, math.sqrt(c2))
            torch._foreach_add_(denom, self.eps)
            torch._foreach_addcdiv_(self.params, self.m, denom, -self.lr / c1)


def _probe(p: Mapping[str, Any], device: str, step: int, dtype: Any) -> list[tuple[str, Tensor]]:
    """The forward-only attention probes of one step: (name, output) per `probe_attention`."""
    from torch.nn.attention import sdpa_kernel

    out = []
    b, t, d, h = (int(p[k]) for k in ("batch", "seq", "d_model", "n_heads"))
    for i, entry in enumerate(p["probe_attention"]):
        backend, causal = parse_attention(str(entry))
        q, k, v = (uniform(mix_key(int(p["seed"]), _TAG, 1000 + step, i, j), (b, h, t, d // h),
                           device=device).to(dtype) for j in range(3))
        try:
            with torch.no_grad(), sdpa_kernel([_sdpa_backend(backend)]):
                out.append((f"sdpa/{entry}", F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal)))
        except RuntimeError as e:
            # torch's words for "no kernel of this backend takes these inputs" (CUDA, CPU)
            if not any(w in str(e) for w in ("No available kernel", "No viable backend")):
                raise
            # The backend does not run these inputs on this GPU (cuDNN attention on a GPU or
            # cuDNN too old for it): a property of the platform, decided on the host before any
            # arithmetic, so every device of the platform says the same. Said in the tensor's
            # name, never replaced by another backend's result.
            out.append((f"sdpa/{entry}:unavailable", torch.zeros(1, device=device)))
    return out


def run(p: Mapping[str, Any], device: str, fault: Callable[[], ContextManager[Any]],
        autocast_dtype: Optional[Any], loss_bits: Callable[[Tensor], str],
        keep_values: bool) -> tuple[list[Step], dict[str, Any]]:
    """The job's steps on `device` (see the module docstring). fault(): the fault injector's
    context around the computation (a null context without one)."""
    model = make_model(p, device)
    names = [n for n, _ in model.named_parameters()]
    params = [q for _, q in model.named_parameters()]
    opt = _AdamState(params, lr=float(p["lr"]), weight_decay=float(p["weight_decay"]))
    kinds = [str(o) for o in p["optimizers"]]
    vocab = int(p["vocab"])
    steps: list[Step] = []
    values: dict[str, Any] = {}
    for step in range(int(p["steps"])):
        tokens, targets = batch_for(int(p["seed"]), 0, step, batch=int(p["batch"]),
                                    seq=int(p["seq"]), vocab=vocab, device=device)
        amp = (torch.autocast(device_type=torch.device(device).type, dtype=autocast_dtype)
               if autocast_dtype is not None else nullcontext())
        with fault():
            with amp:
                loss = _loss(model, tokens, targets, vocab, float(p["z_loss"]))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, float(p["max_norm"]), foreach=True)
            probes = _probe(p, device, step, autocast_dtype or torch.float32)
        grads = fingerprints([q.grad for q in params] + [norm.reshape(1)]).tolist()
        probed = fingerprints([y for _, y in probes]).tolist() if probes else []
        with fault():
            opt.step(kinds[step % len(kinds)])
        for q in params:
            q.grad = None
        weights = fingerprints(params).tolist()
        if keep_values:
            values[f"{step}/loss"] = float(loss.detach().float().cpu())
        tensors = tuple((f"grad/{n}", (g[0], g[1])) for n, g in zip(names, grads)) + (
            ("grad_norm", (grads[-1][0], grads[-1][1])),) + tuple(
            (name, (f[0], f[1])) for (name, _), f in zip(probes, probed)) + tuple(
            (f"weight/{n}", (w[0], w[1])) for n, w in zip(names, weights))
        steps.append(Step(step, f"step {step} ({kinds[step % len(kinds)]})", loss_bits(loss),
                          tensors))
    return steps, values
