"""A tiny deterministic transformer language model and its data, for known-answer work and replay.

Used by the known-answer training-step and replay jobs, by the in-job ring replay audit (a rank
rebuilds a peer's micro-batch from (seed, rank, step) and recomputes it), by the peer burn-in and by
the examples. Everything here must give the same bits on every healthy device of one platform, so:

- weights and tokens come from a counter-based integer hash computed with tensor integer ops, not
  from torch's random generators. The result is independent of the global RNG, of torch's RNG
  implementation and version, and of the device (CUDA's Philox kernels lay out their counters by the
  number of SMs, so torch.randint on two GPU models differs; this hash does not). Uniform weights are
  built from 24-bit integers, so the float conversion is exact everywhere.
- attention is written out as matmul + masked softmax rather than scaled_dot_product_attention, whose
  fused kernels differ between devices and have nondeterministic backward passes; it also lets the
  fault injector see every matmul and softmax.

Only torch and the standard library are imported.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_M32 = 0xFFFFFFFF

# Tags keep the hash streams of different tensors apart.
_TAG_WEIGHTS = 0x57E16
_TAG_TOKENS = 0x70C3


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without signed overflow.

    c is split into 16-bit halves so no intermediate product exceeds 2**49: signed int64 overflow
    is undefined behaviour in C++, and we want the same bits from every kernel on every device.
    """
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply), applied elementwise to int64 in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """The same finaliser on a Python int (for keys)."""
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def mix_key(*parts: int) -> int:
    """Fold integers (seed, tag, rank, step, ...) into one 32-bit key."""
    k = 0x9E3779B9
    for p in parts:
        k = _mix32_int(k ^ _mix32_int(int(p) & _M32) ^ ((int(p) >> 32) & _M32))
    return k


def hash_ints(key: int, n: int, *, device: torch.device | str = "cpu") -> Tensor:
    """n pseudo-random 32-bit values (int64 in [0, 2**32)) from a 32-bit key, computed on device."""
    idx = torch.arange(n, dtype=torch.int64, device=device)
    x = _mix32((idx + key) & _M32)
    return _mix32(x ^ _mix32_int(key ^ 0xA5A5A5A5))


def uniform(key: int, shape: tuple[int, ...], *, device: torch.device | str = "cpu") -> Tensor:
    """float32 uniform in [-1, 1) on a 2**-23 grid, exact and identical on every device."""
    n = math.prod(shape)
    bits = hash_ints(key, n, device=device) >> 8  # 24 bits: exactly representable in float32
    return (bits.to(torch.float32) * (2.0 ** -23) - 1.0).reshape(shape)


def _param(*shape: int) -> nn.Parameter:
    # Uninitialised: make_model fills every parameter from the hash. Plain empty tensors (not the
    # nn layers' own init) so that building a model neither touches the global RNG nor pulls in
    # torch's meta-device machinery, which imports the compiler stack and costs seconds.
    return nn.Parameter(torch.empty(*shape))


class _Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = _param(d_out, d_in)
        self.bias = _param(d_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class _LayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = _param(d)
        self.bias = _param(d)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)


class _Embedding(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = _param(n, d)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight)


class _Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.ln1 = _LayerNorm(d_model)
        self.qkv = _Linear(d_model, 3 * d_model)
        self.proj = _Linear(d_model, d_model)
        self.ln2 = _LayerNorm(d_model)
        self.fc1 = _Linear(d_model, d_ff)
        self.fc2 = _Linear(d_ff, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q = q.reshape(b, t, h, d // h).transpose(1, 2)
        k = k.reshape(b, t, h, d // h).transpose(1, 2)
        v = v.reshape(b, t, h, d // h).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d // h))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Token + position embedding, n pre-norm blocks, final LayerNorm and an untied LM head."""

    def __init__(self, *, vocab: int, d_model: int, n_heads: int, d_ff: int, seq: int,
                 n_layers: int) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.tok = _Embedding(vocab, d_model)
        self.pos = _Embedding(seq, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln_f = _LayerNorm(d_model)
        self.head = _Linear(d_model, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[-1]
        if t > self.seq:
            raise ValueError(f"sequence length {t} exceeds the model's {self.seq}")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init_value(seed: int, index: int, name: str, shape: tuple[int, ...]) -> Tensor:
    """The initial value of one parameter: a function of (seed, its position, its name) only."""
    leaf = name.rsplit(".", 1)[-1]
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    if leaf == "bias":
        return torch.zeros(shape)
    if parent.split(".")[-1].startswith("ln"):  # LayerNorm weight
        return torch.ones(shape)
    key = mix_key(seed, _TAG_WEIGHTS, index)
    if parent in ("tok", "pos"):
        scale = 0.05  # small embeddings, as in common LM initialisations
    else:
        scale = 1.0 / math.sqrt(shape[-1])  # Linear: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    return uniform(key, shape) * scale


def make_model(seed: int = 0, *, vocab: int = 64, d_model: int = 32, n_heads: int = 4,
               d_ff: int = 64, seq: int = 16, n_layers: int = 1) -> nn.Module:
    """A tiny transformer LM on the CPU whose weights depend only on seed and the shape arguments.

    Every parameter is filled from the integer hash, so construction neither reads nor advances
    the global RNG. Move it with `.to(device)`.
    """
    model = TinyLM(vocab=vocab, d_model=d_model, n_heads=n_heads, d_ff=d_ff, seq=seq,
                   n_layers=n_layers)
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            p.copy_(_init_value(seed, i, name, tuple(p.shape)))
    return model


def batch_for(seed: int, rank: int, step: int, *, batch: int = 4, seq: int = 16, vocab: int = 64,
              device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """The micro-batch (tokens, targets) of (seed, rank, step), generated on `device`.

    Rebuilt bit for bit from the three integers on any device, so a peer can replay it. Targets are
    the next tokens of one sequence of seq + 1 tokens (int64, shape (batch, seq)).
    """
    key = mix_key(seed, _TAG_TOKENS, rank, step)
    raw = hash_ints(key, batch * (seq + 1), device=device) % vocab
    stream = raw.reshape(batch, seq + 1)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def compute_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Mean next-token cross-entropy of the model on one (tokens, targets) batch, as a scalar."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
