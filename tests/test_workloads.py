"""Job specs (jobs/*.toml) and the workloads they describe: validation, hashing, determinism."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from screener.known_answer.verdict import results
from screener.known_answer.engine import workloads as w
from screener.determinism import preserved
from screener.errors import BadInputError, ConfigError
from screener.fingerprint import fingerprints
from screener.known_answer.engine.synthetic import batch_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_process_settings():
    with preserved():
        yield


def test_repository_jobs_are_valid_and_cover_the_issue():
    specs = w.load_jobs(ROOT / "jobs")
    names = {s.name for s in specs}
    assert {"gemm-fp32", "gemm-tf32", "gemm-fp16", "gemm-bf16", "train-fp32", "train-bf16",
            "replay-fp32"} <= names
    hashes = [s.spec_hash for s in specs]
    assert len(set(hashes)) == len(hashes) and all(len(h) == 16 for h in hashes)
    by = {s.name: s for s in specs}
    assert by["gemm-tf32"].params_for("cpu")["tf32"] is True
    assert by["gemm-fp32"].params_for("cpu")["tf32"] is False
    assert by["train-bf16"].params_for("cuda")["autocast"] == "bfloat16"
    assert by["train-fp32"].params_for("cuda")["d_model"] > by["train-fp32"].params_for("cpu")["d_model"]
    quick = w.select_jobs(None, jobs_dir=ROOT / "jobs", quick_only=True)
    assert quick and all(s.quick for s in quick)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text)
    return p


GOOD = 'name = "{name}"\nversion = 1\nkind = "gemm"\ndescription = "d"\n[params]\nchain = 2\n' \
       '[cpu]\nshapes = [[8, 16]]\n'


def test_spec_hash_changes_with_numbers_not_with_words(tmp_path):
    a = w.load_job(_write(tmp_path, "j", GOOD.format(name="j")))
    b = w.load_job(_write(tmp_path, "j", GOOD.format(name="j").replace('"d"', '"other words"')))
    c = w.load_job(_write(tmp_path, "j", GOOD.format(name="j").replace("chain = 2", "chain = 3")))
    d = w.load_job(_write(tmp_path, "j", GOOD.format(name="j").replace("version = 1", "version = 2")))
    assert a.spec_hash == b.spec_hash
    assert len({a.spec_hash, c.spec_hash, d.spec_hash}) == 3
    assert w.JobSpec.from_dict(a.to_dict()).spec_hash == a.spec_hash


@pytest.mark.parametrize("edit,needle", [
    (lambda t: "colour = 1\n" + t, "unknown key"),
    (lambda t: t.replace("chain = 2", "chain = 2\nchainz = 1"), "unknown parameter"),
    (lambda t: t.replace("chain = 2", 'chain = "two"'), "must be int"),
    (lambda t: t.replace("chain = 2", "chain = true"), "must be int"),
    (lambda t: t.replace("chain = 2", 'dtype = "float8"'), "dtype"),
    (lambda t: t.replace("chain = 2", 'dtype = "float16"\ntf32 = true'), "tf32"),
    (lambda t: t.replace('kind = "gemm"', 'kind = "magic"'), "kind"),
    (lambda t: t.replace("version = 1", "version = 0"), "version"),
    # issue 23.6: a version has an upper bound too
    (lambda t: t.replace("version = 1", "version = 9223372036854775807"), "1..1000000"),
    (lambda t: t.replace("version = 1", "version = 1.5"), "version"),
    (lambda t: t.replace("[[8, 16]]", "[[8]]"), "shape"),
    (lambda t: t.replace('name = "j"', 'name = "k"'), "differs from the file name"),
    (lambda t: t.replace("version = 1\n", ""), "missing required key"),
    (lambda t: t + "[params", "not valid TOML"),
])
def test_bad_specs_name_the_file_and_the_problem(tmp_path, edit, needle):
    p = _write(tmp_path, "j", edit(GOOD.format(name="j")))
    with pytest.raises(ConfigError) as e:
        w.load_job(p)
    assert str(p) in str(e.value) and needle in str(e.value)
    assert e.value.exit_code == 2


def test_select_jobs(tmp_path):
    _write(tmp_path, "j", GOOD.format(name="j"))
    _write(tmp_path, "s", 'name = "s"\nversion = 1\nkind = "selftest"\nquick = true\n')
    assert [s.name for s in w.select_jobs(None, jobs_dir=tmp_path)] == ["j"]  # no selftests
    assert [s.name for s in w.select_jobs(["s"], jobs_dir=tmp_path)] == ["s"]
    assert w.select_jobs(None, jobs_dir=tmp_path, quick_only=True) == []
    with pytest.raises(BadInputError, match="unknown job"):
        w.select_jobs(["nope"], jobs_dir=tmp_path)


def test_every_repository_job_is_bit_reproducible_in_process():
    for spec in w.load_jobs(ROOT / "jobs"):
        a, b = w.run_job(spec, "cpu"), w.run_job(spec, "cpu")
        assert a.steps and a.digest == b.digest, spec.name
        assert results.first_difference(a.steps, b.steps) is None
        assert a.settings["threads"] == 1 and torch.get_num_threads() == 1


def test_gemm_fingerprints_every_product(tmp_path):
    spec = w.load_job(_write(tmp_path, "j", GOOD.format(name="j").replace("[[8, 16]]",
                                                                            "[[8, 16], [5, 4]]")))
    r = w.run_job(spec, "cpu", keep_values=True)
    assert len(r.steps) == 2 and [n for n, _ in r.steps[0].tensors] == ["product[8x16x16]",
                                                                        "product[5x4x4]"]
    for step in r.steps:
        for name, fp in step.tensors:
            value = r.values[f"{step.step}/{name}"]
            assert tuple(fingerprints([value])[0].tolist()) == fp


def test_train_records_loss_grads_and_weights():
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "train-fp32")
    r = w.run_job(spec, "cpu", keep_values=True)
    p = spec.params_for("cpu")
    assert len(r.steps) == p["steps"]
    names = [n for n, _ in r.steps[0].tensors]
    assert names[0] == "grad/tok.weight" and "weight/head.bias" in names
    assert len([n for n in names if n.startswith("grad/")]) == len(
        [n for n in names if n.startswith("weight/")])
    losses = [w.loss_value(s.loss) for s in r.steps]
    assert all(math.isfinite(x) for x in losses)
    assert losses == [r.values[f"{i}/loss"] for i in range(len(losses))]
    # the weights move every step
    weights = [dict(s.tensors)["weight/head.weight"] for s in r.steps]
    assert len(set(weights)) == len(weights)


def test_replay_rebuilds_the_audit_batches():
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "replay-fp32")
    p = spec.params_for("cpu")
    r = w.run_job(spec, "cpu")
    assert len(r.steps) == p["ranks"] * p["steps"]
    last = r.steps[-1]
    rank, step = p["ranks"] - 1, p["steps"] - 1
    assert last.label == f"rank {rank} step {step}"
    tok, tgt = batch_for(p["seed"], rank, step, batch=p["batch"], seq=p["seq"], vocab=p["vocab"])
    rows = fingerprints([tok, tgt]).tolist()
    assert dict(last.tensors)["tokens"] == tuple(rows[0])
    assert dict(last.tensors)["targets"] == tuple(rows[1])


def test_first_difference_locates():
    s = [w.Step(0, "a", "0x1", (("x", (1, 2)), ("y", (3, 4)))),
         w.Step(1, "b", "0x2", (("x", (5, 6)), ("y", (7, 8))))]
    o = [s[0], dataclasses.replace(s[1], tensors=(("x", (5, 6)), ("y", (7, 9))))]
    d = results.first_difference(s, o)
    assert (d.step, d.label, d.tensor) == (1, "b", "y")
    assert d.expected.endswith(":0000000000000008") and d.observed.endswith(":0000000000000009")
    d = results.first_difference(s, [s[0], dataclasses.replace(s[1], loss="0x3")])
    assert (d.step, d.tensor, d.expected, d.observed) == (1, "loss", "0x2", "0x3")
    assert results.first_difference(s, s[:1]).tensor == "steps"
    assert len(results.all_differences(s, o)) == 1


def test_loss_bits_roundtrip():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = torch.tensor(2.718281828, dtype=dtype)
        bits = w.loss_bits(t)
        assert w.loss_value(bits, bfloat16=dtype == torch.bfloat16) == t.item()


@pytest.mark.gpu
def test_gemm_is_sized_from_the_sms():
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-bf16")
    p = spec.params_for("cuda:0")
    shapes = w.gemm_shapes(p, "cuda:0")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = shapes[0][0]
    assert (n // p["tile"]) ** 2 >= p["tiles_per_sm"] * sms
    a, b = w.run_job(spec, "cuda:0"), w.run_job(spec, "cuda:0")
    assert a.digest == b.digest


@pytest.mark.parametrize("sms", [1, 56, 108, 114, 132, 144, 148])  # A100: 108, H100 SXM: 132
def test_the_sm_sizing_gives_every_sm_its_tiles_and_a_ragged_edge(sms):
    """The CPU twin of test_gemm_is_sized_from_the_sms: the GEMM jobs' CUDA shapes (issue
    33.1) give at least tiles_per_sm output tiles to every SM, no more than one row of tiles
    beyond that, and a second problem whose last tile row is partial."""
    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-bf16")
    p = spec.params_for("cuda")
    tile, per = int(p["tile"]), int(p["tiles_per_sm"])
    (n, k), (m2, k2) = w.sm_sized_shapes(sms, tile, per)
    assert n == k == k2 and n % tile == 0
    tiles = (n // tile) ** 2
    assert tiles >= per * sms
    assert ((n // tile) - 1) ** 2 < per * sms  # the smallest square that does
    assert m2 % tile not in (0,) and m2 > n


def test_the_fp8_gemm_job_reproduces_its_bits_and_sees_a_fault_in_scaled_mm():
    """gemm-fp8 (issue 33.1): FP8 e4m3 products through torch._scaled_mm, the CPU's kernel
    here (the FP8 tensor cores on a GPU of compute capability 8.9+)."""
    from screener.known_answer.engine.faults import FaultSpec, inject

    spec = next(s for s in w.load_jobs(ROOT / "jobs") if s.name == "gemm-fp8")
    assert w.fp8_gemm_available("cpu")
    a, b = w.run_job(spec, "cpu"), w.run_job(spec, "cpu")
    assert a.digest == b.digest and len(a.steps) == 4
    assert a.steps[0].tensors[0][0] == "fp8_product[64x128x128]"
    inj = inject(FaultSpec("_scaled_mm", call=3, element=7, bit=5))
    assert w.run_job(spec, "cpu", injector=inj).digest != a.digest and inj.fired


def test_fp8_shapes_must_be_multiples_of_16(tmp_path):
    text = (ROOT / "jobs" / "gemm-fp8.toml").read_text().replace("[48, 96]", "[47, 96]")
    p = tmp_path / "gemm-fp8.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="multiples of 16 for float8_e4m3fn"):
        w.load_job(p)


@pytest.mark.parametrize("sms", [108, 114, 132])
def test_the_fp8_sizing_keeps_rows_a_multiple_of_16_and_a_partial_tile(sms):
    (n, _), (m2, _) = w.sm_sized_shapes(sms, 128, 8, multiple=16)
    assert n % 128 == 0 and m2 % 16 == 0 and m2 % 128 != 0 and m2 > n
