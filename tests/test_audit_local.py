"""screener.audit on one rank (a real gloo group of size 1, in this process): the comm hook across
DDP's bucket rebuild, finite means finite (huge gradients on every path and dtype), replay hygiene
(.grad, RNG, buffers), the reduced-gradient alarm and its file, an unwritable alarm directory,
verified_save and rollback, torch.compile around DDP refused."""

from __future__ import annotations

import gc

import datetime
import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from screener.known_answer.engine import faults
from screener.known_answer.engine import synthetic
from screener.audit import AuditUsageError, Auditor, SDCAlarm, classify, rollback_target
from screener.audit.hooks import GradientRecorder, magnitude
from screener.audit.ring import replay
from screener.fingerprint import fingerprints
from screener.alarmfile import AlarmRecord

SHAPE = dict(vocab=32, d_model=16, n_heads=2, d_ff=32, seq=8, n_layers=1)
pytestmark = pytest.mark.timeout(120)


def batch_fn(rank: int, step: int):
    return synthetic.batch_for(3, rank, step, batch=2, seq=8, vocab=32)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    assert not dist.is_initialized(), "another test left a process group behind"
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    yield dist.group.WORLD
    # DDP models and auditors of this module sit in reference cycles (hooks, closures): free them
    # while their process group is alive, not in some later test's garbage collection, where a
    # Reducer's destructor would tear down a gloo group that is already destroyed.
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("reduce_hook", [None, allreduce_hook], ids=["default", "generic"])
def test_hook_records_each_local_gradient_by_parameter_across_bucket_rebuilds(group, reduce_hook):
    model = synthetic.make_model(3, **SHAPE)
    params = list(model.parameters())
    ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets; rebuilt after the first iteration
    rec = GradientRecorder(params, reduce_hook=reduce_hook)
    ddp.register_comm_hook(None, rec.hook)
    plain = synthetic.make_model(3, **SHAPE)
    plain_ddp = DDP(plain, bucket_cap_mb=0.002)  # no hook: DDP's own reduction
    buckets = []
    for step in range(4):
        rec.record_step = step if step != 2 else None
        ddp.zero_grad(set_to_none=True)
        loss = synthetic.compute_loss(ddp, batch_fn(0, step))
        loss.backward()
        stats = rec.take(torch.device("cpu"))
        buckets.append(stats.buckets)
        grads = [p.grad for p in params]  # world size 1: the reduced gradient is the local one
        if reduce_hook is None:  # finite: known from the fused scale pass, no norm taken
            assert float(stats.local_norm) == 0.0 and float(stats.reduced_norm) == 0.0
        else:
            want = max(float(g.abs().max()) for g in grads)  # the largest magnitude, exactly
            assert float(stats.local_norm) == want and float(stats.reduced_norm) == want
        if step == 2:
            assert stats.grad_fingerprints is None and stats.step is None
        else:
            assert stats.step == step
            assert torch.equal(stats.grad_fingerprints, fingerprints(grads))
        plain_ddp.zero_grad(set_to_none=True)
        synthetic.compute_loss(plain_ddp, batch_fn(0, step)).backward()
        # the hook leaves the reduced gradient as DDP's own reduction does (world 1: bit for bit)
        assert torch.equal(fingerprints(grads), fingerprints([p.grad for p in plain.parameters()]))
    assert buckets[0] == 1 and buckets[1] > 1  # DDP's first-iteration bucket, then the rebuild


@pytest.mark.parametrize("as_view", [False, True], ids=["grad-copies", "grad-bucket-views"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_hook_finds_a_non_finite_local_gradient_without_a_norm_on_clean_steps(group, as_view,
                                                                             bad):
    """The default path reads no norm on a finite step; a NaN/Inf in one gradient element shows
    in the local norm (measured from .grad, or before the reduction when .grad is the bucket) and
    in the reduced one, and the next clean step is clean again."""
    model = synthetic.make_model(3, **SHAPE)
    params = list(model.parameters())
    ddp = DDP(model, bucket_cap_mb=0.002, gradient_as_bucket_view=as_view)
    rec = GradientRecorder(params, reduce_state=group, grads_are_bucket_views=as_view)
    ddp.register_comm_hook(None, rec.hook)
    poison = {"step": 2}
    target = params[len(params) // 2]

    def inject(g: torch.Tensor) -> torch.Tensor:
        if poison["step"] == poison.get("now"):
            g = g.clone()
            g.view(-1)[0] = bad
        return g

    target.register_hook(inject)
    for step in range(4):
        poison["now"] = step
        ddp.zero_grad(set_to_none=True)
        synthetic.compute_loss(ddp, batch_fn(0, step)).backward()
        stats = rec.take(torch.device("cpu"))
        if step == 2:
            for norm in (stats.local_norm, stats.reduced_norm):
                assert torch.isnan(norm) if bad != bad else torch.isinf(norm)
        elif as_view:  # measured before the reduction: the real norms
            assert torch.isfinite(stats.local_norm) and float(stats.local_norm) > 0
        else:
            assert float(stats.local_norm) == 0.0 and float(stats.reduced_norm) == 0.0


class _Stateful(torch.nn.Module):
    """A model whose forward mutates a buffer and draws random numbers, as dropout/BatchNorm do."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = synthetic.make_model(3, **SHAPE)
        self.register_buffer("counter", torch.zeros(3))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.counter.add_(1)
        torch.rand(4)
        return self.lm(tokens)


def test_replay_matches_the_real_backward_and_leaves_grad_rng_and_buffers_alone(group):
    model = _Stateful()
    params = list(model.parameters())
    batch = batch_fn(0, 5)
    torch.manual_seed(0)
    synthetic.compute_loss(model, batch).backward()
    real = [p.grad.clone() for p in params]
    sentinel = [torch.full_like(g, 7.0) for g in real]
    for p, s in zip(params, sentinel):
        p.grad = s.clone()
    counter = model.counter.clone()
    rng = torch.get_rng_state()
    loss, grads = replay(model, params, synthetic.compute_loss, batch, device=torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.counter, counter)
    assert all(torch.equal(p.grad, s) for p, s in zip(params, sentinel))
    assert torch.equal(fingerprints(grads), fingerprints(real))  # bit for bit
    assert torch.equal(loss, synthetic.compute_loss(model, batch).detach())


def _auditor(tmp_path, **kw):
    model = synthetic.make_model(3, **SHAPE)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw.setdefault("alarm_dir", tmp_path / "alarms")
    return model, ddp, opt, Auditor(ddp, loss_fn=synthetic.compute_loss, batch_fn=batch_fn,
                                    audit_every=1, weights_every=1, job="local", **kw)


def test_nan_inside_the_allreduce_stops_the_step_and_drops_an_unsettled_alarm(group, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("NODE_NAME", "hyperpod-i-0123456789abcdef0")
    model, ddp, opt, auditor = _auditor(
        tmp_path, reduce_hook=faults.corrupt_allreduce(rank=0, calls={2}, element=3))
    assert not auditor.can_replay  # a single rank has nobody to replay
    with pytest.raises(SDCAlarm) as info:
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            synthetic.compute_loss(ddp, batch_fn(0, step)).backward()
            before = fingerprints(list(model.parameters()))
            auditor.check_gradients(step, synthetic.compute_loss(model, batch_fn(0, step)))
            opt.step()
            auditor.check_weights(step)
    alarm = info.value
    assert (alarm.check, alarm.step, alarm.settled, alarm.suspect_ranks) == (
        "nonfinite_reduced", 2, False, ())
    assert torch.equal(fingerprints(list(model.parameters())), before)  # step 2 never applied
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    files = list((tmp_path / "alarms").iterdir())
    assert len(files) == 1
    rec = AlarmRecord.from_dict(json.loads(files[0].read_text()))
    assert rec.node == "hyperpod-i-0123456789abcdef0" and not rec.settled and rec.job == "local"
    assert rec.suspect_nodes[0].instance_id == "i-0123456789abcdef0"
    assert rec.evidence["candidate_ranks"] == [0]


def test_the_clip_norm_can_stand_in_for_the_hooks_reduced_check(group, tmp_path):
    """check_reduced=False plus grad_norm from clip_grad_norm_: one gradient pass per step, and a
    NaN made inside the all-reduce is still caught before the optimizer step."""
    model, ddp, opt, auditor = _auditor(
        tmp_path, check_reduced=False,
        reduce_hook=faults.corrupt_allreduce(rank=0, calls={2}, element=3))
    with pytest.raises(SDCAlarm) as info:
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            loss = synthetic.compute_loss(ddp, batch_fn(0, step))
            loss.backward()
            before = fingerprints(list(model.parameters()))
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
            auditor.check_gradients(step, loss, grad_norm=norm)
            opt.step()
    alarm = info.value
    assert (alarm.check, alarm.step, alarm.settled) == ("nonfinite_reduced", 2, False)
    assert torch.equal(fingerprints(list(model.parameters())), before)  # step 2 never applied
    # Without the clip norm and with the hook's check off, nothing looks at the reduced gradient:
    # the option really does remove the hook's pass (the clip norm is what caught it above).
    model, ddp, opt, auditor = _auditor(
        tmp_path, check_reduced=False, alarm_dir=tmp_path / "alarms2",
        reduce_hook=faults.corrupt_allreduce(rank=0, calls={0}, element=3))
    synthetic.compute_loss(ddp, batch_fn(0, 0)).backward()
    auditor.check_gradients(0, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar grad_norm"):
        auditor.check_gradients(1, torch.tensor(1.0), grad_norm=torch.ones(2))


def test_an_unwritable_alarm_directory_is_logged_and_the_alarm_still_raised(group, tmp_path,
                                                                          caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    model, ddp, opt, auditor = _auditor(
        tmp_path, alarm_dir=blocker, reduce_hook=faults.corrupt_allreduce(rank=0, calls={0}))
    caplog.set_level(logging.ERROR, logger="screener.audit")
    synthetic.compute_loss(ddp, batch_fn(0, 0)).backward()
    with pytest.raises(SDCAlarm):
        auditor.check_gradients(0, torch.tensor(1.0))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.levelno >= logging.ERROR]
    failed = [x for x in lines if x["event"] == "alarm_file_failed"]
    assert failed and failed[0]["directory"] == str(blocker) and failed[0]["rank"] == 0
    assert [x["event"] for x in lines][-1] == "sdc_alarm"


def test_verified_save_marks_checkpoints_that_rollback_trusts(group, tmp_path):
    model, ddp, opt, auditor = _auditor(tmp_path)
    saved = []

    def save(step):
        path = tmp_path / f"step{step}.pt"
        torch.save(model.state_dict(), path)
        saved.append(path)
        return path

    for step in range(6):
        opt.zero_grad(set_to_none=True)
        loss = synthetic.compute_loss(ddp, batch_fn(0, step))
        loss.backward()
        auditor.check_gradients(step, loss)
        opt.step()
        auditor.check_weights(step)
        if step % 2 == 0:
            assert auditor.verified_save(lambda: save(step), step) == saved[-1]
    unverified = tmp_path / "step5.pt"
    torch.save(model.state_dict(), unverified)
    assert auditor.counters["weight_checks"] == 6  # verified_save reused each step's passing vote
    assert rollback_target(saved + [unverified], 5) == saved[2]
    assert rollback_target(saved + [unverified], 4) == saved[1]


def test_auditor_refuses_what_it_cannot_audit(group, tmp_path):
    """In one line each, and with exit code 2 (guard.classify)."""
    refusals = []
    with pytest.raises(AuditUsageError) as e:
        Auditor(synthetic.make_model(3, **SHAPE))
    refusals.append(e.value)
    ddp = DDP(synthetic.make_model(3, **SHAPE))
    with pytest.raises(AuditUsageError) as e:
        Auditor(ddp, audit_every=-1)
    refusals.append(e.value)
    with pytest.raises(AuditUsageError) as e:
        Auditor(ddp, scaler=object())
    refusals.append(e.value)
    Auditor(ddp, alarm_dir=tmp_path)
    with pytest.raises(AuditUsageError, match="reduce_hook") as e:
        Auditor(ddp, alarm_dir=tmp_path)  # DDP takes one comm hook
    refusals.append(e.value)
    assert all(classify(r) == 2 and "\n" not in str(r) for r in refusals)


@pytest.mark.slow
def test_torch_compile_around_ddp_is_refused_and_inside_ddp_audited(group, tmp_path):
    """torch.compile(DDP(m)) runs compiled code that replays of DDP's module cannot reproduce:
    refused in one line (exit 2) when the Auditor is given it, and at the first check_gradients,
    before any collective of it, when the Auditor is given the DDP model the compiled wrapper
    runs. DDP(torch.compile(m)) is audited: its module is the compiled callable."""
    try:
        ddp = DDP(_mlp())
        with pytest.raises(AuditUsageError, match=r"DDP\(torch\.compile\(model\)\)") as e:
            Auditor(torch.compile(ddp, backend="aot_eager"), alarm_dir=tmp_path)
        assert "\n" not in str(e.value) and classify(e.value) == 2
        auditor = Auditor(ddp, loss_fn=_mlp_loss, batch_fn=_mlp_batch, alarm_dir=tmp_path)
        compiled = torch.compile(ddp, backend="aot_eager")
        _mlp_loss(compiled, _mlp_batch(0, 0)).backward()
        with pytest.raises(AuditUsageError, match=r"torch\.compile\(DDP\(model\)\)"):
            auditor.check_gradients(0, torch.tensor(1.0))
        assert auditor.counters["steps"] == 0  # refused before the step's gather

        inner = torch.compile(_mlp(), backend="aot_eager")
        ddp = DDP(inner)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        auditor = Auditor(ddp, loss_fn=_mlp_loss, batch_fn=_mlp_batch, weights_every=1,
                          alarm_dir=tmp_path / "inner")
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            loss = _mlp_loss(ddp, _mlp_batch(0, step))
            loss.backward()
            auditor.check_gradients(step, loss)
            opt.step()
            auditor.check_weights(step)
        assert auditor.counters["steps"] == 3 and auditor.counters["weight_checks"] == 3
    finally:
        torch._dynamo.reset()  # compiled code holds the DDP models: free them with the group


# ---- finite means finite (issue 28) --------------------------------------------------------------

LIMITS = [(torch.float32, 1e19), (torch.float32, 1e30), (torch.float32, 3e38),
          (torch.float32, torch.finfo(torch.float32).max),
          (torch.bfloat16, 1e30), (torch.bfloat16, torch.finfo(torch.bfloat16).max),
          (torch.float16, 6e4), (torch.float16, torch.finfo(torch.float16).max)]


@pytest.mark.parametrize("dtype,value", LIMITS, ids=[f"{d}-{v:.3g}" for d, v in LIMITS])
def test_magnitude_is_the_exact_largest_value_however_large_and_non_finite_only_for_nan_inf(
        dtype, value):
    """Wherever the element sits (the vectorised body or the tail of a reduction), with either
    sign: its exact magnitude, finite; NaN or inf in its place make the result NaN or inf."""
    t = torch.zeros(100_003, dtype=dtype)
    exact = float(torch.tensor(value, dtype=dtype))
    for at in (0, 50_001, 100_002):
        for sign in (1, -1):
            t.zero_()
            t[7] = 3
            t[at] = sign * value
            m = magnitude(t)
            assert m.dtype == torch.float32 and float(m) == exact and torch.isfinite(m)
        for bad, check in ((float("nan"), torch.isnan), (float("inf"), torch.isinf),
                           (float("-inf"), torch.isinf)):
            t[at] = bad
            assert check(magnitude(t))
    assert float(magnitude(torch.zeros(0, dtype=dtype))) == 0.0


def _mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 4)).to(dtype)


def _mlp_batch(rank: int, step: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g).to(dtype)


def _mlp_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y.float())


PATHS = {"default": {}, "generic": {"reduce_hook": allreduce_hook},
         "grad-bucket-views": {"as_view": True}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,value", LIMITS, ids=[f"{d}-{v:.3g}" for d, v in LIMITS])
def test_the_hook_reads_a_huge_finite_gradient_as_finite_on_every_path(group, path, dtype, value):
    """One gradient element at the value (float32: 1e19, 1e30, 3e38 and the largest; bf16 and
    fp16 up to theirs): finite local and reduced gradients, and the measured magnitude is the
    element itself (the default path measures nothing on a finite step: 0); inf in its place is
    non-finite on the same path."""
    model = _mlp(dtype)
    params = list(model.parameters())
    opts = dict(PATHS[path])
    as_view = opts.pop("as_view", False)
    ddp = DDP(model, gradient_as_bucket_view=as_view)
    rec = GradientRecorder(params, reduce_state=group, grads_are_bucket_views=as_view, **opts)
    ddp.register_comm_hook(None, rec.hook)
    spike = {"value": value}

    def inject(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[3] = spike["value"]
        return g

    params[0].register_hook(inject)
    exact = float(torch.tensor(value, dtype=dtype))
    measured = path != "default" or dtype != torch.float32  # the fused pass is float32 only
    for step, bad in enumerate((None, float("inf"), None)):
        spike["value"] = value if bad is None else bad
        ddp.zero_grad(set_to_none=True)
        _mlp_loss(ddp, _mlp_batch(0, step, dtype)).backward()
        stats = rec.take(torch.device("cpu"))
        for m in (stats.local_norm, stats.reduced_norm):
            if bad is not None:
                assert torch.isinf(m)
            elif measured:
                assert float(m) == exact
            else:
                assert float(m) == 0.0
        assert float(params[0].grad.view(-1)[3]) == (exact if bad is None else bad)


@pytest.mark.parametrize("path", ["default", "generic", "grad-bucket-views", "clip-norm"])
def test_a_huge_finite_gradient_spike_is_trained_through_not_alarmed(group, tmp_path, path):
    """+1e20 in every element of one weight's gradient at step 1, which AdamW survives: no alarm,
    no numeric failure, finite weights, on the hook's paths and with clip_grad_norm_'s norm (inf:
    it squares in float32) given as grad_norm."""
    model = _mlp()
    ddp = DDP(model, gradient_as_bucket_view=path == "grad-bucket-views")
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    auditor = Auditor(ddp, audit_every=0, weights_every=1, alarm_dir=tmp_path, job="huge",
                      reduce_hook=allreduce_hook if path == "generic" else None,
                      check_reduced=path != "clip-norm")
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        loss = _mlp_loss(ddp, _mlp_batch(0, step))
        if step == 1:
            w = model[0].weight
            (loss + (w - w.detach()).sum() * 1e20).backward()
            assert float(w.grad.abs().min()) >= 1e20  # the spike is there, finite
        else:
            loss.backward()
        norm = None
        if path == "clip-norm":
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert torch.isinf(norm) == (step == 1)
        auditor.check_gradients(step, loss, grad_norm=norm)
        opt.step()
        auditor.check_weights(step)
    assert auditor.counters["steps"] == 4 and not list(tmp_path.iterdir())
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
