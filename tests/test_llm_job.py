"""The llm known-answer jobs (issue 33.1): a Llama-style training step with the kernels real training
runs and the other jobs do not, bit for bit on healthy hardware, and a fault in any of those
kernels changes the result.

In process (a fraction of a second a run) with the real fault injector; one case through the child
processes and the committed golden. The coverage of a Llama step is tests/test_kat_coverage.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from screener.determinism import preserved
from screener.errors import ConfigError
from screener.known_answer.engine import golden
from screener.known_answer.engine.screen import local_platform, resolve_jobs
from screener.known_answer.engine import workloads as w
from screener.known_answer.engine.faults import FaultSpec, inject
from screener.known_answer.engine.synthetic import batch_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _restore_process_settings():
    with preserved():
        yield


def _spec(name: str) -> w.JobSpec:
    return next(s for s in w.load_jobs(ROOT / "jobs") if s.name == name)


@pytest.fixture(scope="module")
def clean() -> dict[str, w.JobResult]:
    with preserved():
        return {n: w.run_job(_spec(n), "cpu") for n in ("llm-fp32", "llm-bf16")}


def test_the_llm_jobs_reproduce_their_bits_and_record_what_training_computes(clean):
    for name, first in clean.items():
        again = w.run_job(_spec(name), "cpu")
        assert again.digest == first.digest, name
        step = first.steps[0]
        names = [t for t, _ in step.tensors]
        assert step.loss is not None and len(step.loss) == 10  # float32 bits
        assert "grad_norm" in names and any(n.startswith("sdpa/") for n in names)
        assert any(n.startswith("grad/blocks.3.") for n in names)  # all four layers
        assert first.steps[0].label.endswith("(foreach)" if name == "llm-fp32" else "(fused)")
        assert first.steps[1].label.endswith("(fused)" if name == "llm-fp32" else "(foreach)")
    assert clean["llm-fp32"].digest != clean["llm-bf16"].digest


def _element_of_a_seen_token(spec: w.JobSpec) -> tuple[int, int]:
    """(an element of the embedding row of the first token, the first target token): faults
    there reach the loss (a row of a token the batch never holds has no gradient)."""
    p = spec.params_for("cpu")
    tokens, targets = batch_for(int(p["seed"]), 0, 0, batch=int(p["batch"]), seq=int(p["seq"]),
                                vocab=int(p["vocab"]))
    return int(tokens[0, 0]) * int(p["d_model"]) + 3, int(targets[0, 0])


@pytest.mark.parametrize("op", [
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "silu", "silu_backward", "rsqrt",
    "pow", "exp", "cos", "index_select", "gather", "scatter_add_", "logsumexp", "_log_softmax",
    "_foreach_norm", "embedding", "_fused_adamw_", "_foreach_lerp_", "_foreach_addcdiv_",
    "_foreach_mul_"])
def test_a_fault_in_any_kernel_of_the_step_changes_the_result(clean, op):
    spec = _spec("llm-fp32")
    row, target = _element_of_a_seen_token(spec)
    element = {"_foreach_lerp_": row, "_foreach_mul_": row, "scatter_add_": target}.get(op, 3)
    inj = inject(FaultSpec(op, call=0, element=element, bit=20))
    bad = w.run_job(spec, "cpu", injector=inj)
    assert inj.fired, op
    assert bad.digest != clean["llm-fp32"].digest, op


def test_a_corrupted_position_from_cumsum_makes_the_job_raise_not_pass(clean):
    """The positions are a cumsum: a high bit flipped in one is an index out of range, which the
    screen re-runs and judges (screener.known_answer.verdict.endings), never a pass."""
    inj = inject(FaultSpec("cumsum", call=0, element=3, bit=40))
    with pytest.raises(IndexError):
        w.run_job(_spec("llm-fp32"), "cpu", injector=inj)


@pytest.mark.parametrize("field,value,message", [
    ("attention", '["flash:sideways"]', "is not <backend>:<mask>"),
    ("attention", '["turbo:causal"]', "is not <backend>:<mask>"),
    ("attention", "[]", "attention must list 1 to 64 entries"),
    ("optimizers", '["sgd"]', "optimizers must list foreach and/or fused"),
    ("n_heads", "3", "d_model must be divisible by n_heads"),
    ("rope_theta", "0.5", "rope_theta > 1"),
])
def test_a_bad_llm_spec_is_one_line_at_load(tmp_path, field, value, message):
    text = (ROOT / "jobs" / "llm-fp32.toml").read_text()
    head, cpu = text.split("[cpu]", 1)
    cpu = "\n".join(ln for ln in cpu.splitlines() if not ln.startswith(f"{field} ="))
    p = tmp_path / "llm-fp32.toml"
    p.write_text(f"{head}[cpu]\n{field} = {value}\n{cpu}")
    with pytest.raises(ConfigError) as e:
        w.load_job(p)
    assert message in str(e.value) and str(p) in str(e.value)
    assert "\n" not in str(e.value)


def test_the_llm_jobs_are_in_the_full_burn_in_not_the_quick_screen():
    quick = {s.name for s in resolve_jobs(None, str(ROOT / "jobs"))}
    every = {s.name for s in resolve_jobs(None, str(ROOT / "jobs"), quick_only=False)}
    assert {"llm-fp32", "llm-bf16"} <= every and not quick & {"llm-fp32", "llm-bf16"}


def test_the_cuda_layout_trains_on_deterministic_backward_and_probes_the_other_backends():
    """On CUDA only math runs backward (the others' backward does not promise the same bits);
    flash, memory-efficient and cuDNN run forward in the probes, on inputs they take."""
    for name in ("llm-fp32", "llm-bf16"):
        p = _spec(name).params_for("cuda")
        assert {a.split(":")[0] for a in p["attention"]} == {"math"}, name
    probes = {a.split(":")[0] for a in _spec("llm-bf16").params_for("cuda")["probe_attention"]}
    assert probes == {"flash", "efficient", "cudnn"}
    # float32 inputs: no flash or cuDNN, which take half precision only
    fp32 = {a.split(":")[0] for a in _spec("llm-fp32").params_for("cuda")["probe_attention"]}
    assert fp32 == {"efficient"}


@pytest.mark.slow
def test_kat_run_of_the_llm_jobs_through_the_children(tmp_path):
    """`screener kat run --job llm-fp32 --job llm-bf16 --repeat 2` in the child processes:
    a pass against the committed golden where it covers this CPU, otherwise inconclusive
    (no golden), never suspect or our failure."""
    phash = local_platform("cpu").numeric_hash
    covered = all(golden.find(ROOT / "golden", _spec(n), phash) is not None
                  for n in ("llm-fp32", "llm-bf16"))
    r = subprocess.run([sys.executable, "-m", "screener.cli", "kat", "run", "--job", "llm-fp32",
                        "--job", "llm-bf16", "--repeat", "2", "--device", "cpu", "--json"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    d = json.loads(r.stdout)
    assert r.returncode == (0 if covered else 3), r.stderr[-2000:]
    assert {v["outcome"] for v in d["verdicts"]} == {"pass" if covered else "inconclusive"}


def test_a_probe_backend_the_device_has_no_kernel_for_is_said_not_replaced():
    """cuDNN attention has no CPU kernel: the probe records it as unavailable under its own
    name (a property of the platform), the same on every run; the training layers' backends
    must run (a spec listing one the device lacks fails)."""
    from screener.known_answer.engine import llm

    p = {"seed": 1, "batch": 1, "seq": 8, "d_model": 16, "n_heads": 2,
         "probe_attention": ["cudnn:causal", "flash:full"]}
    names = [n for n, _ in llm._probe(p, "cpu", 0, torch.float32)]
    assert names == ["sdpa/cudnn:causal:unavailable", "sdpa/flash:full"]
