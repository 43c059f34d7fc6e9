"""The synthetic transformer and its data: deterministic, independent of the global RNG."""

from __future__ import annotations

import math

import pytest
import torch

from screener.known_answer.engine import synthetic


def _params(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def test_model_depends_only_on_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(4)
    torch.manual_seed(123)
    a = _params(synthetic.make_model(7))
    after = torch.rand(4)
    assert torch.equal(before, after), "make_model consumed the global RNG"
    torch.manual_seed(999)  # a different global state must not matter
    b = _params(synthetic.make_model(7))
    c = _params(synthetic.make_model(8))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weights = [k for k in a if k.endswith("weight") and ".ln" not in k and not k.startswith("ln")]
    assert weights and all(not torch.equal(a[k], c[k]) for k in weights)


def test_model_structure_and_shapes():
    m = synthetic.make_model(0, vocab=50, d_model=24, n_heads=3, d_ff=40, seq=12, n_layers=2)
    names = [n for n, _ in m.named_parameters()]
    assert names[:2] == ["tok.weight", "pos.weight"]
    assert "blocks.1.qkv.weight" in names and names[-1] == "head.bias"
    shapes = dict((n, tuple(p.shape)) for n, p in m.named_parameters())
    assert shapes["tok.weight"] == (50, 24) and shapes["blocks.0.fc1.weight"] == (40, 24)
    assert shapes["head.weight"] == (50, 24)
    # LayerNorm starts at identity, biases at zero, linear weights within 1/sqrt(fan_in)
    assert torch.equal(m.ln_f.weight, torch.ones(24)) and torch.equal(m.head.bias, torch.zeros(50))
    assert m.blocks[0].fc2.weight.abs().max() <= 1 / math.sqrt(40)
    with pytest.raises(ValueError):
        synthetic.make_model(0, d_model=30, n_heads=4)


def test_uniform_is_exact_on_a_grid():
    u = synthetic.uniform(5, (1000,))
    assert u.dtype == torch.float32 and u.min() >= -1 and u.max() < 1
    scaled = (u + 1) * 2 ** 23
    assert torch.equal(scaled, scaled.round())
    assert 0.2 < u.std() < 0.8  # uniform on [-1, 1) has std 0.577


def test_batch_is_a_function_of_seed_rank_step():
    tok, tgt = synthetic.batch_for(3, 1, 5, batch=4, seq=16, vocab=64)
    assert tok.shape == tgt.shape == (4, 16) and tok.dtype == torch.int64
    assert tok.min() >= 0 and tok.max() < 64
    assert torch.equal(tok[:, 1:], tgt[:, :-1]), "targets are the next tokens"
    again = synthetic.batch_for(3, 1, 5, batch=4, seq=16, vocab=64)
    assert torch.equal(tok, again[0]) and torch.equal(tgt, again[1])
    for other in ((4, 1, 5), (3, 2, 5), (3, 1, 6)):
        assert not torch.equal(tok, synthetic.batch_for(*other, batch=4, seq=16, vocab=64)[0])


def test_loss_and_backward():
    m = synthetic.make_model(1)
    loss = synthetic.compute_loss(m, synthetic.batch_for(1, 0, 0))
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(64)) < 1.0  # near chance at initialisation
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    again = synthetic.compute_loss(synthetic.make_model(1), synthetic.batch_for(1, 0, 0))
    assert torch.equal(loss.detach(), again.detach())


def test_attention_is_causal():
    m = synthetic.make_model(2)
    tok, _ = synthetic.batch_for(2, 0, 0)
    changed = tok.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64
    with torch.no_grad():
        a, b = m(tok), m(changed)
    assert torch.equal(a[:, :-1], b[:, :-1]) and not torch.equal(a[:, -1], b[:, -1])


@pytest.mark.gpu
def test_batch_is_identical_on_cuda():
    cpu = synthetic.batch_for(9, 3, 4, batch=8, seq=32, vocab=4096)
    gpu = synthetic.batch_for(9, 3, 4, batch=8, seq=32, vocab=4096, device="cuda")
    assert gpu[0].is_cuda and torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())
    assert torch.equal(synthetic.uniform(4, (4096,)), synthetic.uniform(4, (4096,), device="cuda").cpu())
