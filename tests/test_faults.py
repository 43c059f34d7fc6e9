"""Fault injection: every op kind, every bit class, every mode, parameters and all-reduce buckets."""

from __future__ import annotations

import gc
import socket

import pytest
import torch
import torch.nn.functional as F

from screener.known_answer.engine import faults
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.fingerprint import fingerprint

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _data(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) * 2 - 1 + 0.05).to(dtype)


# op alias -> a function computing that op's output from fixed data (the op is what we corrupt)
def _cases(dtype):
    a, b = _data(6, 8, dtype=dtype), _data(8, 5, dtype=dtype, seed=1)
    a3, b3 = _data(3, 6, 8, dtype=dtype, seed=2), _data(3, 8, 5, dtype=dtype, seed=3)
    bias = _data(5, dtype=dtype, seed=4)
    x4 = _data(2, 3, 7, 7, dtype=dtype, seed=5)
    w4 = _data(4, 3, 3, 3, dtype=dtype, seed=6)
    return {
        "mm": lambda: torch.mm(a, b),
        "addmm": lambda: torch.addmm(bias, a, b),
        "bmm": lambda: torch.bmm(a3, b3),
        "matmul": lambda: torch.matmul(a3, b3),
        "linear": lambda: F.linear(a, b.t().contiguous(), bias),
        "softmax": lambda: torch.softmax(a, dim=-1),
        "log_softmax": lambda: torch.log_softmax(a, dim=-1),
        "layer_norm": lambda: F.layer_norm(a, (8,)),
        "conv2d": lambda: F.conv2d(x4, w4, padding=1),
        "gelu": lambda: F.gelu(a),
        "embedding": lambda: F.embedding(torch.tensor([[1, 4], [0, 2]]), a),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_op_kind_and_bit_class_is_applied_exactly_and_fingerprinted(dtype):
    for op, fn in _cases(dtype).items():
        clean = fn()
        for cls, bit in faults.bit_classes(dtype).items():
            element = 5
            with inject(FaultSpec(op, call=0, element=element, bit=bit)) as inj:
                out = fn()
            assert len(inj.fired) == 1, (op, cls)
            rec = inj.fired[0]
            assert rec["bit"] == bit and rec["element"] == element % clean.numel()
            diff = (clean.reshape(-1).view(_BITS[dtype]) ^ out.reshape(-1).view(_BITS[dtype]))
            changed = diff.nonzero().flatten().tolist()
            assert changed == [element], (op, cls, changed)
            mask = 1 << bit
            if bit == torch.iinfo(_BITS[dtype]).bits - 1:
                mask = -mask
            assert diff[element].item() == mask, (op, cls)
            assert int(rec["before"], 16) ^ int(rec["after"], 16) == 1 << bit
            assert fingerprint(out) != fingerprint(clean), (op, cls)


def test_call_counting_predicate_and_device_filter():
    a = torch.ones(4, 4)
    small = torch.ones(2, 4)
    spec = FaultSpec("mm", call=1, mode="set", value=7.0,
                     predicate=lambda args, kwargs: args[0].shape[0] == 2)
    with inject(spec) as inj:
        r0 = torch.mm(a, a)  # does not satisfy the predicate: not counted
        r1 = torch.mm(small, a)  # matching call 0
        r2 = torch.mm(small, a)  # matching call 1: corrupted
    assert r0.max() == 4 and r1.max() == 4 and r2[0, 0] == 7 and r2.reshape(-1)[1:].eq(4).all()
    assert inj.fired[0]["call"] == 1 and inj.counts == [2]
    with inject(FaultSpec("mm", device="cuda", mode="nan")) as inj:
        r = torch.mm(a, a)
    assert not inj.fired and torch.isfinite(r).all()
    with inject(FaultSpec("mm", device="cpu", mode="nan")) as inj:
        r = torch.mm(a, a)
    assert inj.fired and torch.isnan(r[0, 0])


@pytest.mark.parametrize("mode,check", [
    ("scale", lambda v, before: v == (torch.tensor(before) * 1e4).item()),
    ("nan", lambda v, before: v != v),
    ("inf", lambda v, before: v == float("inf")),
    ("set", lambda v, before: v == -3.5),
])
def test_modes(mode, check):
    x = _data(3, 3)
    clean = torch.mm(x, x)
    with inject(FaultSpec("mm", element=4, mode=mode, value=-3.5)):
        out = torch.mm(x, x)
    assert check(out.reshape(-1)[4].item(), clean.reshape(-1)[4].item())
    assert torch.equal(torch.cat([out.reshape(-1)[:4], out.reshape(-1)[5:]]),
                       torch.cat([clean.reshape(-1)[:4], clean.reshape(-1)[5:]]))


def test_element_wraps_and_multi_output_and_noncontiguous():
    x = _data(4, 8)
    with inject(FaultSpec("native_layer_norm", output=1, element=3 + 4 * 10, mode="set",
                          value=0.0)) as inj:
        F.layer_norm(x, (8,))
    assert inj.fired[0]["element"] == 3 and inj.fired[0]["output"] == 1
    # a non-contiguous output: the element is the logical row-major index
    t = torch.zeros(3, 4).t()
    rec = faults.apply_to_tensor(t, 5, mode="set", value=1.0)
    assert t[1, 2] == 1 and t.reshape(-1)[5] == 1 and t.sum() == 1 and rec["index"] == [1, 2]


def test_backward_ops_are_seen():
    w = _data(8, 8, seed=9).requires_grad_()
    x = _data(4, 8, seed=10)
    torch.mm(x, w).sum().backward()
    clean = w.grad.clone()
    w.grad = None
    with inject(FaultSpec("mm", call=1, element=0, bit=30)) as inj:  # call 0 is the forward mm
        loss = torch.mm(x, w).sum()
        loss.backward()
    assert inj.fired and not torch.equal(w.grad, clean)


def test_spec_validation():
    with pytest.raises(ValueError):
        FaultSpec("mm", mode="melt")
    with pytest.raises(ValueError):
        FaultSpec("mm", call=-1)
    with pytest.raises(RuntimeError):
        FaultSpec("mm", device="gpu0")
    assert faults.op_names("matmul") == {"mm", "bmm"}
    assert faults.op_names("native_layer_norm") == {"native_layer_norm"}
    with pytest.raises(ValueError, match="no aten op named matmull"):
        FaultSpec("matmull")  # a misspelt op would never fire: refuse it
    for alias in faults.OP_ALIASES:
        FaultSpec(alias)  # every documented alias names real aten ops


def test_corrupt_parameter():
    m = torch.nn.Linear(4, 3)
    before = m.weight.detach().clone()
    rec = faults.corrupt_parameter(m, "weight", 5, bit=31)
    assert m.weight.reshape(-1)[5].item() == -before.reshape(-1)[5].item()
    assert rec["parameter"] == "weight" and rec["bit"] == 31
    faults.corrupt_parameter(m, "module.bias", 1, value=float("inf"))  # DDP-style name
    assert m.bias[1].item() == float("inf")
    with pytest.raises(KeyError):
        faults.corrupt_parameter(m, "nope", 0, bit=1)
    with pytest.raises(ValueError):
        faults.corrupt_parameter(m, "weight", 0)


def test_random_flips_are_seedable():
    a = faults.random_flips(20, seed=3, ops=["mm", "bmm"], max_call=5, max_element=100)
    b = faults.random_flips(20, seed=3, ops=["mm", "bmm"], max_call=5, max_element=100)
    c = faults.random_flips(20, seed=4, ops=["mm", "bmm"], max_call=5, max_element=100)
    assert a == b and a != c and len(a) == 20
    assert all(s.op in ("mm", "bmm") and 0 <= s.call < 5 and 0 <= s.element < 100
               and 0 <= s.bit < 32 for s in a)
    with pytest.raises(ValueError):
        faults.random_flips(1, seed=0, ops=[], max_call=1, max_element=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_corrupt_allreduce_hook_in_ddp():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        results = {}
        for target, calls in ((0, {1}), (1, None)):
            model = DDP(torch.nn.Linear(4, 2))
            hook = faults.corrupt_allreduce(rank=target, calls=calls, element=1)
            model.register_comm_hook(None, hook)
            grads = []
            for step in range(2):
                model.zero_grad()
                model(torch.ones(3, 4)).sum().backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            results[target] = (grads, hook.fired)
        grads, fired = results[0]
        assert torch.isfinite(grads[0]).all(), "call 0 was not selected"
        assert torch.isnan(grads[1]).sum() == 1 and fired[0]["call"] == 1
        grads, fired = results[1]  # another rank is targeted: nothing happens here
        assert not fired and all(torch.isfinite(g).all() for g in grads)
    finally:
        model = hook = None
        gc.collect()  # free the DDP reducers while their process group is still alive
        dist.destroy_process_group()
