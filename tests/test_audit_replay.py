"""What a replay reproduces, without a process group: the RNG states and loss scale a step started
from (capture.py), micro-batch accumulation as .grad accumulates, loss_fn outputs with extras,
reentrant activation checkpointing; the blast-radius rule; the setups refused at construction;
run_guarded's records for screener launch."""

from __future__ import annotations

import json

import pytest
import torch

from screener.audit import AuditUsageError, run_guarded
from screener.audit.refusals import refuse_unreplayable
from screener.audit.blast import too_wide
from screener.audit.capture import StateCodec, StepState, capture, restored
from screener.audit.ring import ReplayMode, has_reentrant_checkpoint, loss_of, replay
from screener.fingerprint import fingerprints
from screener.alarmfile import AlarmRecord

CPU = torch.device("cpu")


def _net(dropout: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 8), torch.nn.GELU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.5))
    return torch.nn.Sequential(*layers, torch.nn.Linear(8, 2))


def _batch(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def test_state_survives_the_codec_and_restores_the_same_dropout_masks():
    codec = StateCodec(CPU)
    torch.manual_seed(1234)
    state = capture(CPU)
    first = torch.rand(8)
    torch.rand(100)  # the stream moves on
    back = codec.decode(codec.encode(state))
    assert back.scale is None and torch.equal(back.cpu_rng, state.cpu_rng)
    mine = torch.get_rng_state()
    with restored(back, CPU):
        assert torch.equal(torch.rand(8), first)
    assert torch.equal(torch.get_rng_state(), mine)  # this rank's own stream is untouched
    assert codec.decode(codec.encode(None)).cpu_rng is None
    assert codec.decode(codec.encode(StepState(None, None, 2.0 ** 13))).scale == 2.0 ** 13


def test_a_dropout_step_replays_bit_for_bit_from_the_owner_state_only():
    model = _net()
    torch.manual_seed(99)  # the owner's stream, whatever it is
    state = capture(CPU)
    loss = _loss(model, _batch(0))
    loss.backward()
    owner = fingerprints([p.grad for p in model.parameters()])
    torch.manual_seed(7)  # the replayer's stream is elsewhere
    params = list(model.parameters())
    rl, rg = replay(model, params, _loss, _batch(0), device=CPU, state=state)
    assert torch.equal(rl, loss.detach()) and torch.equal(fingerprints(rg), owner)
    rl2, rg2 = replay(model, params, _loss, _batch(0), device=CPU, state=None)
    assert not torch.equal(fingerprints(rg2), owner)  # without the state, other masks


def test_scaled_replay_and_accumulation_match_the_training_step_bits():
    model = _net(dropout=False)
    params = list(model.parameters())
    scale = 2.0 ** 10
    micro = [_batch(i) for i in range(3)]
    model.zero_grad(set_to_none=True)
    total = 0
    for mb in micro:  # what a loop does under no_sync: .grad accumulates
        loss = _loss(model, mb) / 3
        (loss * torch.full((1,), scale)).backward()
        total = total + loss.detach()
    owner = fingerprints([p.grad for p in params])
    rl, rg = replay(model, params, lambda m, b: _loss(m, b) / 3, micro, device=CPU,
                    state=StepState(None, None, scale), accumulation_steps=3)
    assert torch.equal(fingerprints(rg), owner) and torch.equal(rl, total)
    with pytest.raises(AuditUsageError, match="accumulation_steps=3"):
        replay(model, params, _loss, micro[0], device=CPU, accumulation_steps=3)


def test_loss_fn_may_return_extras():
    t = torch.tensor(1.5)
    assert loss_of(t) is t and loss_of((t, "logits")) is t and loss_of({"loss": t, "x": 1}) is t

    class Out:
        loss = t
    assert loss_of(Out()) is t
    with pytest.raises(AuditUsageError, match="one-element loss tensor"):
        loss_of(torch.ones(3))


class _Checkpointed(torch.nn.Module):
    """A block with dropout under activation checkpointing, and a weight used both inside the
    checkpoint and outside it (tied), as Hugging Face models with gradient checkpointing do."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(6, 8)
        self.mix = torch.nn.Linear(8, 8)
        self.block = torch.nn.Sequential(torch.nn.GELU(), torch.nn.Dropout(0.5), self.mix)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.block, self.inp(x),
                                              use_reentrant=self.reentrant)
        return self.head(self.mix(h))  # self.mix again, outside the checkpoint


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_steps_replay_bit_for_bit_and_leave_grad_and_hooks_alone(reentrant):
    """Reentrant checkpointing refuses torch.autograd.grad; the replay takes a backward pass into
    parameter aliases instead (and remembers it): the training step's bits, while the real
    .grad, the hooks on the real parameters (where DDP's reducer sits) and this rank's RNG stream
    are untouched. Non-reentrant checkpointing keeps autograd.grad."""
    model = _Checkpointed(reentrant)
    params = list(model.parameters())
    micro = [_batch(i) for i in range(2)]
    torch.manual_seed(5)
    state = capture(CPU)
    total = 0
    for mb in micro:  # two micro-batches, .grad accumulating, from one RNG start
        loss = _loss(model, mb)
        loss.backward()
        total = total + loss.detach()
    owner = fingerprints([p.grad for p in params])
    sentinel = [p.grad.clone() for p in params]
    fired: list[int] = []
    for p in params:
        p.register_post_accumulate_grad_hook(lambda q: fired.append(1))
    torch.manual_seed(9)
    rng = torch.get_rng_state()
    mode = ReplayMode()
    for _ in range(2):  # the first replay discovers the mode, the second starts in it
        rl, rg = replay(model, params, _loss, micro, device=CPU, state=state,
                        accumulation_steps=2, mode=mode)
        assert torch.equal(fingerprints(rg), owner) and torch.equal(rl, total)
        assert mode.backward is reentrant
    assert fired == [] and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p.grad, s) for p, s in zip(params, sentinel))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # swapped back
    assert model.block[2] is model.mix and model.mix.weight is params[2]


def test_a_reentrant_checkpoint_is_found_in_the_graph():
    x = torch.randn(3, 6)
    assert has_reentrant_checkpoint(_loss(_Checkpointed(True), (x, torch.zeros(3, 2))))
    assert not has_reentrant_checkpoint(_loss(_Checkpointed(False), (x, torch.zeros(3, 2))))
    assert not has_reentrant_checkpoint(_loss(_net(), (x, torch.zeros(3, 2))))
    model = _Checkpointed(True)
    with pytest.raises(RuntimeError, match="use_reentrant=True"):  # why the backward form exists
        torch.autograd.grad(_loss(model, (x, torch.zeros(3, 2))), list(model.parameters()))


def test_blast_radius_rule():
    node_of = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    assert too_wide([3], node_of, 6) is None
    assert too_wide([2, 3], node_of, 6) is None
    assert "span 2 nodes (a, c)" in too_wide([1, 4], node_of, 6)
    assert "3 of 4 ranks" in too_wide([0, 1, 2], {0: "a", 1: "a", 2: "a", 3: "a"}, 4)


def test_syncbatchnorm_is_refused_in_one_line():
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    with pytest.raises(AuditUsageError) as e:
        refuse_unreplayable(model)
    assert "SyncBatchNorm" in str(e.value) and "\n" not in str(e.value)
    refuse_unreplayable(_net())  # plain layers pass


def test_run_guarded_records_its_code_and_alarms_its_node_on_a_hardware_error(tmp_path,
                                                                             monkeypatch):
    exits, alarms = tmp_path / "exits", tmp_path / "alarms"
    exits.mkdir()
    monkeypatch.setenv("SCREENER_EXIT_DIR", str(exits))
    monkeypatch.setenv("SCREENER_ALARM_DIR", str(alarms))
    monkeypatch.setenv("NODE_NAME", "hyperpod-i-0123456789abcdef0")
    monkeypatch.setenv("RANK", "5")

    def ecc():
        raise RuntimeError("CUDA error: uncorrectable ECC error encountered")
    assert run_guarded(ecc) == 75
    (code,) = exits.glob("*.code")
    assert code.read_text() == "75\n" and code.name.startswith("rank5-")
    (f,) = alarms.glob("*.json")
    rec = AlarmRecord.from_dict(json.loads(f.read_text()))
    assert (rec.check, rec.settled, rec.node, rec.suspect_ranks) == (
        "hardware_error", False, "hyperpod-i-0123456789abcdef0", ())
    assert rec.suspect_nodes[0].instance_id == "i-0123456789abcdef0"
    from screener.alarmfile import validate
    assert validate(json.loads(f.read_text())).check == "hardware_error"
    assert run_guarded(lambda: 0) == 0 and len(list(exits.glob("*.code"))) == 1  # same pid: rewritten
    assert len(list(alarms.glob("*.json"))) == 1  # a clean exit alarms nobody
