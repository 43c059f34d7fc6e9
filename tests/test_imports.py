"""Import contracts: a training job importing screener.fingerprint or screener.audit pays only for
torch and the standard library, and each vendor client has exactly one importer."""

from __future__ import annotations

import ast
import functools
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _top_level_modules_after(statement: str) -> set[str]:
    code = (f"import sys, json\n{statement}\n"
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return set(json.loads(out.stdout))


# screener.audit imports screener.fingerprint: its case covers both in the fast loop.
@pytest.mark.parametrize("module", [pytest.param("screener.fingerprint", marks=pytest.mark.slow),
                                    "screener.audit"])
def test_training_side_modules_load_only_torch_and_stdlib(module):
    # torch itself may pull in optional packages it finds (numpy, pynvml); we may add only the
    # standard library and our own package on top of what `import torch` loads.
    baseline = _top_level_modules_after("import torch")
    loaded = _top_level_modules_after(f"import {module}")
    extra = loaded - baseline - set(sys.stdlib_module_names) - {"screener"}
    assert not extra, f"import {module} loaded {sorted(extra)} beyond torch and the standard library"
    heavy = loaded & {"kubernetes", "boto3", "botocore", "prometheus_client", "click", "psutil"}
    assert not heavy, f"import {module} loaded {sorted(heavy)}"


@functools.lru_cache(maxsize=None)
def _imports_by_file() -> dict[str, frozenset[str]]:
    """Every absolute import of every module of the package, parsed once for all the checks."""
    found = {}
    for path in (ROOT / "screener").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        mods: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module)
        found[str(path.relative_to(ROOT))] = frozenset(mods)
    return found


def _importers(name: str) -> set[str]:
    return {path for path, mods in _imports_by_file().items()
            if any(m == name or m.startswith(name + ".") for m in mods)}


@pytest.mark.parametrize("client,allowed", [
    ("kubernetes", {"screener/stores/kube/store.py"}),
    ("boto3", {"screener/remediation/hyperpod.py"}),
    ("botocore", {"screener/remediation/hyperpod.py"}),
    ("pynvml", {"screener/health/sources/nvml.py"}),
    ("prometheus_client", {"screener/agent/metrics.py"}),
    ("safetensors", {"screener/tensorfile.py"}),
    ("psutil", {"screener/health/sources/host.py"}),
    ("grpc", {"screener/agent/nvrx_health.py"}),
])
def test_each_vendor_client_has_one_importer(client, allowed):
    assert _importers(client) == allowed  # exactly there: a moved importer updates this list


def test_cli_help_imports_nothing_heavy():
    code = ("import sys, json\nfrom click.testing import CliRunner\nfrom screener.cli import main\n"
            "r = CliRunner().invoke(main, ['--help'])\nassert r.exit_code == 0, r.output\n"
            "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT)
    loaded = set(json.loads(out.stdout))
    assert not loaded & {"torch", "kubernetes", "boto3", "pynvml", "prometheus_client"}


def test_the_daemon_loads_no_torch():
    # The daemon runs on every node for months: torch (seconds to import, hundreds of MiB) is
    # loaded only by its screen worker, a process of its own (screener.agent.screening.window).
    loaded = _top_level_modules_after("import screener.agent.daemon.loop")
    assert "torch" not in loaded
