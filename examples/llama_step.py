"""One training step of a tiny Llama-style model, for `screener kat coverage examples/llama_step.py`.

The ops a Llama-family model spends its time in, at sizes that run in about a second on a CPU:
token embedding, RMSNorm (x * rsqrt(mean(x^2) + eps)), rotary position embeddings (sin, cos, cat),
causal scaled_dot_product_attention, a SwiGLU MLP (silu), an untied LM head, cross-entropy,
backward, gradient clipping (clip_grad_norm_) and an AdamW step. Only torch.

The coverage census runs this file as `__main__` (as `python examples/llama_step.py` would) and
counts the ops run inside `record_function("screener:step")`: the step, not the model's set-up
(without such a mark it counts everything the file runs). The step runs on $SCREENER_DEVICE (the
device the coverage command measures on: cpu or cuda:N), else the CPU.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, D_MODEL, N_HEADS, D_FF, N_LAYERS = 256, 64, 4, 172, 2
BATCH, SEQ = 4, 64
ROPE_THETA = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (seq, head_dim)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wk = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wv = nn.Linear(D_MODEL, D_MODEL, bias=False)
        self.wo = nn.Linear(D_MODEL, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // N_HEADS
        q, k, v = (w(x).view(b, t, N_HEADS, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D_MODEL, D_FF, bias=False)
        self.w3 = nn.Linear(D_MODEL, D_FF, bias=False)
        self.w2 = nn.Linear(D_FF, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(D_MODEL), Attention()
        self.mlp_norm, self.mlp = RMSNorm(D_MODEL), SwiGLU()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(N_LAYERS))
        self.norm = RMSNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(tokens.shape[1], D_MODEL // N_HEADS, tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def main() -> float:
    """Build the model and run one training step; returns the loss."""
    device = torch.device(os.environ.get("SCREENER_DEVICE", "cpu"))
    torch.manual_seed(0)
    model = TinyLlama().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # The step itself: only what runs inside this mark is counted by `kat coverage` (not the
    # model's initialisation above). Outside a profiler the mark costs nothing.
    with torch.profiler.record_function("screener:step"):
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(loss.detach())


if __name__ == "__main__":
    print(f"loss {main():.4f}")
