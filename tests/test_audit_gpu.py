"""screener.audit on a CUDA device (NCCL group of one rank): the comm hook records the same bits a
replay recomputes with deterministic kernels, and a NaN inside the NCCL all-reduce stops the step.
CPU twins: tests/test_audit_local.py."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.known_answer.engine import faults
from screener.known_answer.engine import synthetic
from screener.audit import Auditor, SDCAlarm
from screener.audit.hooks import GradientRecorder, magnitude
from screener.audit.ring import replay
from screener.determinism import make_deterministic
from screener.fingerprint import fingerprints

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180)]
SHAPE = dict(vocab=64, d_model=64, n_heads=4, d_ff=128, seq=16, n_layers=2)


def batch_fn(rank: int, step: int):
    return synthetic.batch_for(5, rank, step, batch=4, seq=16, vocab=64, device="cuda:0")


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    was = torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()
    make_deterministic("cuda:0", threads=None)
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60),
                            device_id=torch.device("cuda:0"))
    yield
    dist.destroy_process_group()
    torch.use_deterministic_algorithms(was[0])  # leave the process as we found it
    torch.set_num_threads(was[1])


def test_cuda_hook_fingerprints_equal_a_deterministic_replay(nccl):
    model = synthetic.make_model(5, **SHAPE).cuda()
    params = list(model.parameters())
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.05)
    rec = GradientRecorder(params)
    ddp.register_comm_hook(None, rec.hook)
    for step in range(3):
        rec.record_step = step
        ddp.zero_grad(set_to_none=True)
        loss = synthetic.compute_loss(ddp, batch_fn(0, step))
        loss.backward()
        stats = rec.take(torch.device("cuda:0"))
        cuda_rng = torch.cuda.get_rng_state()
        rloss, grads = replay(model, params, synthetic.compute_loss, batch_fn(0, step),
                              device=torch.device("cuda:0"))
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        assert torch.equal(rloss, loss.detach())
        assert torch.equal(stats.grad_fingerprints, fingerprints(grads))


def test_nan_inside_the_nccl_allreduce_stops_the_step(nccl, tmp_path):
    model = synthetic.make_model(5, **SHAPE).cuda()
    ddp = DDP(model, device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn, audit_every=1,
                      weights_every=1, alarm_dir=tmp_path,
                      reduce_hook=faults.corrupt_allreduce(rank=0, calls={1}))
    with pytest.raises(SDCAlarm) as info:
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            loss = synthetic.compute_loss(ddp, batch_fn(0, step))
            loss.backward()
            before = fingerprints(list(model.parameters()))
            auditor.check_gradients(step, loss)
            opt.step()
            auditor.check_weights(step)
    assert (info.value.check, info.value.step) == ("nonfinite_reduced", 1)
    assert torch.equal(fingerprints(list(model.parameters())), before)
    assert len(list(tmp_path.iterdir())) == 1


LIMITS = [(torch.float32, 1e19), (torch.float32, 1e30), (torch.float32, 3e38),
          (torch.bfloat16, torch.finfo(torch.bfloat16).max),
          (torch.float16, torch.finfo(torch.float16).max)]


@pytest.mark.parametrize("dtype,value", LIMITS, ids=[f"{d}-{v:.3g}" for d, v in LIMITS])
def test_cuda_magnitude_is_exact_and_finite_however_large(dtype, value):
    """The CUDA reduction of hooks.magnitude, across blocks: the element's exact magnitude, finite;
    NaN and inf in its place are non-finite (an L2 norm of 1e19 and past overflowed here)."""
    t = torch.zeros(1_000_003, dtype=dtype, device="cuda:0")
    exact = float(torch.tensor(value, dtype=dtype))
    for at in (0, 500_001, 1_000_002):
        t.zero_()
        t[at] = -value
        m = magnitude(t)
        assert m.device.type == "cuda" and float(m) == exact
        t[at] = float("nan")
        assert torch.isnan(magnitude(t))
        t[at] = float("inf")
        assert torch.isinf(magnitude(t))


def test_a_huge_finite_cuda_gradient_is_trained_through_not_alarmed(nccl, tmp_path):
    """+1e20 in one weight's gradient at step 1 on the CUDA (generic) hook path, and a bucket view:
    finite, no alarm, no numeric failure."""
    model = synthetic.make_model(5, **SHAPE).cuda()
    ddp = DDP(model, device_ids=[0], gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    auditor = Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn, audit_every=0,
                      weights_every=1, alarm_dir=tmp_path)
    for step in range(3):
        opt.zero_grad(set_to_none=True)
        loss = synthetic.compute_loss(ddp, batch_fn(0, step))
        w = next(model.parameters())
        (loss + (w - w.detach()).sum() * (1e20 if step == 1 else 0.0)).backward()
        auditor.check_gradients(step, loss)
        opt.step()
        auditor.check_weights(step)
    assert auditor.counters["steps"] == 3 and not list(tmp_path.iterdir())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
