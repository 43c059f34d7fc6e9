"""The manual is true to the code: README.md (the front page, at most 300 lines) and docs/*.md.

Every relative link resolves to a file (and its anchor to a heading of that file); every repository
path a page cites in backticks or in a code block exists; every dotted module name `screener.x.y`
imports (and what follows it is an attribute of it); every `screener ...` command line a page shows
names a real subcommand and only options that command takes (the click command tree of
screener.cli); the safe ones (`--help` of every command, `platform`, `golden verify`, `golden list`,
`kat list`, `plan`) really run; the README's test command is the one .ci/run runs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from screener import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("screener", "tests", "benchmarks", "manifests", "examples", "jobs", "golden", "docs",
            "charts")
SUBPACKAGES = sorted(p.name for p in (ROOT / "screener").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


# --- reading markdown -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _split(page: Path) -> tuple[list[str], list[tuple[int, str]]]:
    """(prose lines with code blocks blanked out, code lines as (line number, text)).

    Code is a fenced block or, outside one, a line indented by four spaces or more after a blank
    line or another such line (an indented block, also inside a list item)."""
    prose: list[str] = []
    code: list[tuple[int, str]] = []
    fenced = False
    indented = False
    prev_blank = True
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            prose.append("")
            prev_blank = False
            continue
        if fenced:
            code.append((n, line))
            prose.append("")
            continue
        blank = not line.strip()
        if not blank and line.startswith("    ") and (prev_blank or indented):
            indented = True
            code.append((n, line))
            prose.append("")
        else:
            if not blank:
                indented = False
            prose.append(line)
        prev_blank = blank
    return prose, code


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(page: Path) -> frozenset[str]:
    prose, _ = _split(page)
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"#{1,6}\s+(.*?)\s*#*$", line)
        if m:
            s = _slug(m.group(1))
            k = seen.get(s, 0)
            out.add(s if k == 0 else f"{s}-{k}")
            seen[s] = k + 1
    return frozenset(out)


def _spans(page: Path) -> list[tuple[int, str]]:
    """Inline code spans of the prose, with their line numbers (a span may wrap a line)."""
    prose, _ = _split(page)
    text = "\n".join(prose)
    out = []
    for m in re.finditer(r"(`+)(.+?)\1", text, flags=re.S):
        out.append((text.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())))
    return out


# --- 1. links ------------------------------------------------------------------------------------

def _links() -> list[tuple[str, int, str]]:
    out = []
    for page in PAGES:
        prose, _ = _split(page)
        text = "\n".join(prose)
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            out.append((_rel(page), text.count("\n", 0, m.start()) + 1, target))
    return out


def test_the_pages_link_to_each_other():
    """The README links every page of the manual, and every page links somewhere."""
    targets = {t.split("#")[0] for p, _, t in _links() if p == "README.md"}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in targets, f"README.md does not link docs/{page.name}"
    assert len(_links()) > 40


@pytest.mark.parametrize("page,line,target", _links(), ids=lambda v: str(v))
def test_every_relative_link_resolves(page, line, target):
    path, _, anchor = target.partition("#")
    base = (ROOT / page).parent
    dest = (base / path).resolve() if path else ROOT / page
    assert dest.exists(), f"{page}:{line}: link to {target}: no file {dest}"
    assert ROOT in dest.parents or dest == ROOT, f"{page}:{line}: {target} leaves the repository"
    if anchor:
        assert dest.suffix == ".md", f"{page}:{line}: anchor into a non-markdown file: {target}"
        assert anchor in _anchors(dest), (
            f"{page}:{line}: {target}: no heading #{anchor} in {dest.relative_to(ROOT)} "
            f"(headings: {sorted(_anchors(dest))})")


# --- 2. paths and module names -------------------------------------------------------------------

PATH_RE = re.compile(r"(?<![\w./$-])((?:%s)/[\w./*<>-]*)" % "|".join(TOP_DIRS))
SHORT_RE = re.compile(r"(?<![\w./$-])((?:%s)/[\w/]*\w\.(?:py|c))\b" % "|".join(SUBPACKAGES))
MODULE_RE = re.compile(r"(?<![\w./-])(screener(?:\.[A-Za-z_]\w*)+)(?![\w/-])")


def _cited() -> list[tuple[str, int, str]]:
    """(page, line, text) of every backtick span and every code line."""
    out = []
    for page in PAGES:
        out += [(_rel(page), n, s) for n, s in _spans(page)]
        out += [(_rel(page), n, s) for n, s in _split(page)[1]]
    return out


def _paths() -> list[tuple[str, int, str]]:
    out = set()
    for page, n, text in _cited():
        for m in PATH_RE.finditer(text):
            p = m.group(1).rstrip(".,:;)")
            if p.endswith("..."):
                continue
            out.add((page, n, p))
        for m in SHORT_RE.finditer(text):
            out.add((page, n, "screener/" + m.group(1)))
    return sorted(out)


def _resolves(path: str) -> bool:
    if "<" in path:  # golden/<job>.<platform-hash>.json: a pattern, its folder must exist
        return (ROOT / path.split("<")[0]).parent.is_dir()
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _tree_paths() -> list[tuple[str, int, str]]:
    """The paths of a map of the tree (a fenced block that starts `screener/`): each entry under
    the folder above it, and the files its description names under that folder (a file's: its
    folder). An entry is a line indented by at most 4; deeper lines continue a description."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        starts = [i for i, ln in enumerate(lines)
                  if ln.startswith("```") and i + 1 < len(lines) and lines[i + 1].split(" ")[0] == "screener/"]
        for s in starts:
            stack: list[tuple[int, str]] = []  # (indent, folder)
            here = ""
            for n in range(s + 1, len(lines)):
                line = lines[n]
                if line.startswith("```"):
                    break
                indent = len(line) - len(line.lstrip())
                desc = line
                m = re.match(r"( *)((?:[\w.-]+/?)(?:, [\w.-]+/?)*)(?=\s|$)", line)
                if indent <= 4 and m:
                    while stack and stack[-1][0] >= indent:
                        stack.pop()
                    parent = stack[-1][1] if stack else ""
                    names = m.group(2).split(", ")
                    for name in names:
                        out.append((_rel(page), n + 1, parent + name))
                    here = parent + names[-1] if names[-1].endswith("/") else parent
                    if names[-1].endswith("/"):
                        stack.append((indent, parent + names[-1]))
                    desc = line[m.end():]
                for f in re.findall(r"(?<![\w./`])([\w-]+(?:\.(?:py|c|yaml|json|sh|toml|txt)|/))(?=[\s:;,)]|$)",
                                    desc):
                    out.append((_rel(page), n + 1, here + f))
    return sorted(set(out))


def test_every_path_of_a_tree_map_exists():
    paths = _tree_paths()
    assert ("docs/architecture.md" in {p for p, _, _ in paths}) and len(paths) > 40
    cited = {p for _, _, p in paths}
    for p in ("screener/stores/spool.py", "screener/stores/slots.py", "screener/lifecycle/table.py",
              "screener/audit/layout.py", "manifests/runtimeclass.yaml", "tests/fakes/"):
        assert p in cited, p
    bad = [f"{page}:{n}: {p}" for page, n, p in paths if not (ROOT / p).exists()]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page,line,path", _paths(), ids=lambda v: str(v))
def test_every_cited_path_exists(page, line, path):
    assert _resolves(path), f"{page}:{line}: `{path}` does not exist in the repository"


def test_the_pages_cite_paths():
    """The scan finds what it is meant to (a guard against a regex that matches nothing)."""
    paths = {p for _, _, p in _paths()}
    for p in ("screener/kernels/fingerprint.c", "tests/test_budget_race.py",
              "benchmarks/bench_fleet.py", "manifests/networkpolicy.yaml",
              "examples/training-job.yaml", "screener/audit/layout.py",
              "screener/commands/context.py"):
        assert p in paths, p


def _modules() -> list[tuple[str, int, str]]:
    out = set()
    for page, n, text in _cited():
        for m in MODULE_RE.finditer(text):
            name = m.group(1).rstrip(".")
            if name.startswith("screener.io"):
                continue  # the label prefix screener.io/...
            out.add((page, n, name))
    return sorted(out)


def _resolve_dotted(name: str) -> str | None:
    """None when `name` is a module, or a module followed by attributes of it; else why not."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        mod = ".".join(parts[:k])
        try:
            spec = importlib.util.find_spec(mod)
        except ModuleNotFoundError:
            spec = None
        if spec is None:
            continue
        obj = importlib.import_module(mod)
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return f"{mod} has no attribute {'.'.join(parts[k:])}"
            obj = getattr(obj, attr)
        return None
    return "no such module"


@pytest.mark.parametrize("page,line,name", _modules(), ids=lambda v: str(v))
def test_every_cited_module_name_resolves(page, line, name):
    why = _resolve_dotted(name)
    assert why is None, f"{page}:{line}: `{name}`: {why}"


def test_the_pages_cite_modules():
    names = {n for _, _, n in _modules()}
    for n in ("screener.audit", "screener.determinism.make_deterministic",
              "screener.lifecycle.table", "screener.known_answer.engine.faults",
              "screener._golden"):
        assert n in names, n


# --- 3. command lines ----------------------------------------------------------------------------

def _command_lines() -> list[tuple[str, int, str]]:
    """Every `screener ...` command a code block shows, its continuation lines joined, with its
    comment dropped; `&&` and `;` separate commands."""
    out = []
    for page in PAGES:
        code = _split(page)[1]
        i = 0
        while i < len(code):
            n, line = code[i]
            text = line.strip()
            while i + 1 < len(code) and (text.endswith("\\") or (
                    code[i + 1][1].strip().startswith("[") and "screener " in text)):
                text = text.rstrip("\\") + " " + code[i + 1][1].strip()
                i += 1
            i += 1
            text = re.sub(r"(^|\s)#.*$", "", text).strip()
            if text.startswith("$ "):
                text = text[2:]
            for seg in re.split(r"\s*(?:&&|;|\|\|)\s*", text):
                seg = re.sub(r"^(?:\S*/)?\.?venv/bin/screener ", "screener ", seg.strip())
                if re.match(r"screener [a-z][\w-]*(\s|$)", seg):  # not output: "screener x: ..."
                    out.append((_rel(page), n, seg))
    return out


def _option_names(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def _check_command(line: str) -> list[str]:
    """What is wrong with a command line: a subcommand that does not exist, an option that the
    command does not take. Placeholders (NODE, FILE) and alternatives (`a|b`) are allowed."""
    tokens = shlex.split(line)
    assert tokens[0] == "screener"
    problems = []
    ctx = click.Context(cli.main)
    cmds: list[click.Command] = [cli.main]
    rest = tokens[1:]
    while rest and isinstance(cmds[0], click.Group) and not rest[0].startswith("-"):
        names = rest.pop(0).split("|")
        found = [cmds[0].get_command(ctx, n) for n in names]
        missing = [n for n, c in zip(names, found) if c is None]
        if missing:
            return [f"no subcommand {'|'.join(missing)}"]
        cmds = [c for c in found if c is not None]
    depth = 0
    for tok in rest:
        if tok == "--" and depth == 0:
            break  # what follows is the wrapped command's (screener launch -- torchrun ...)
        if tok == "|" and depth == 0:
            break  # a pipe into another program
        bare = tok.lstrip("[").rstrip("],.")
        depth += tok.count("[") - tok.count("]")
        if bare.endswith("..."):
            bare = bare[:-3].rstrip("]")
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", bare):
            opt = bare.split("=", 1)[0]
            for c in cmds:
                if opt not in _option_names(c):
                    problems.append(f"{c.name} takes no option {opt}")
    return problems


COMMANDS = _command_lines()


def test_the_pages_show_commands():
    shown = {line.split()[1] for _, _, line in COMMANDS}
    assert {"burnin", "kat", "golden", "node", "lemons", "probe", "preflight", "report",
            "launch"} <= shown, shown


@pytest.mark.parametrize("page,line,command", COMMANDS, ids=lambda v: str(v))
def test_every_command_line_names_real_subcommands_and_options(page, line, command):
    problems = _check_command(command)
    assert not problems, f"{page}:{line}: {command}: {'; '.join(problems)}"


def test_inline_commands_name_real_subcommands_and_options():
    """The same for `screener ...` in backticks in the prose (e.g. `screener node set NODE
    burnin --reason ...`)."""
    bad = []
    for page in PAGES:
        for n, span in _spans(page):
            if re.match(r"screener [a-z]", span) and "--help" not in span.split()[1:2]:
                problems = _check_command(span)
                if problems:
                    bad.append(f"{_rel(page)}:{n}: `{span}`: {'; '.join(problems)}")
    assert not bad, "\n".join(bad)


def test_the_checker_refuses_what_does_not_exist():
    assert _check_command("screener golden verify") == []
    assert _check_command("screener burnin --quick --report x.json") == []
    assert _check_command("screener nosuch --x") == ["no subcommand nosuch"]
    assert _check_command("screener burnin --no-such-option") == [
        "burnin takes no option --no-such-option"]
    assert _check_command("screener launch -- torchrun --nproc-per-node 6 x.py") == []


def _all_commands() -> list[list[str]]:
    out: list[list[str]] = []

    def walk(group: click.Group, path: list[str]) -> None:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            assert cmd is not None, name
            out.append(path + [name])
            if isinstance(cmd, click.Group):
                walk(cmd, path + [name])

    walk(cli.main, [])
    return out


@pytest.mark.parametrize("path", [[]] + _all_commands(), ids=lambda p: " ".join(p) or "screener")
def test_every_command_has_help(path):
    r = CliRunner().invoke(cli.main, [*path, "--help"], prog_name="screener")
    assert r.exit_code == 0, r.output
    assert "Usage: screener" in r.output, r.output


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No cluster, no GPU store, a HOME and state folder of the test's own."""
    home = tmp_path / "home"
    home.mkdir()
    drop = {"KUBECONFIG", "KUBERNETES_SERVICE_HOST", "SCREENER_STORE", "SCREENER_GOLDEN_DIR",
            "SCREENER_JOBS_DIR"}
    e = {k: v for k, v in os.environ.items() if k not in drop}
    e.update(HOME=str(home), XDG_STATE_HOME=str(tmp_path / "state"),
             PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    return e


def _shown(command: str) -> str:
    """The command exactly as a page shows it (one of them)."""
    for _, _, line in COMMANDS:
        if line == command:
            return line
    raise AssertionError(f"no page shows `{command}` in a code block")


def _run(cmd: str, env: dict[str, str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd)


def test_golden_verify_and_list_run_as_shown(env):
    """`screener golden verify && screener golden list` as docs/known-answer.md shows it, in the
    checkout (its golden/ and jobs/): every committed record verifies and is listed."""
    shown = [ln.strip() for ln in (ROOT / "docs" / "known-answer.md").read_text().splitlines()
             if ln.strip() == "screener golden verify && screener golden list"]
    assert shown, "docs/known-answer.md no longer shows the verify && list line"
    r = _run(shown[0], env)
    assert r.returncode == 0, r.stdout + r.stderr
    for path in (ROOT / "golden").glob("*.json"):
        assert f"{path}" in r.stdout, path.name  # verify names every file it checked
    assert "platform hash" in r.stdout  # and list's table follows


@pytest.mark.slow
def test_kat_list_and_platform_run(env):
    """`screener kat list` (docs/known-answer.md) lists every job of jobs/; `screener platform
    --json` prints the platform hash the goldens are keyed by (two imports of torch: seconds)."""
    r = _run(_shown("screener kat list"), env)
    assert r.returncode == 0, r.stdout + r.stderr
    for spec in (ROOT / "jobs").glob("*.toml"):
        assert spec.stem in r.stdout, spec.stem
    r = _run("screener platform --json", env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert '"numeric_hash"' in r.stdout, r.stdout


def test_plan_prints_the_figures_the_page_gives(env):
    """docs/remediation.md: `screener plan --checkpoint-minutes 2 --mttf-hours 6
    --restart-minutes 25` gives the interval (38 min) and the goodput (~83%) it says."""
    text = " ".join((ROOT / "docs" / "remediation.md").read_text().split())
    m = re.search(r"`(screener plan --checkpoint-minutes 2 --mttf-hours 6 --restart-minutes 25)`"
                  r" gives Young's checkpoint interval sqrt\(2·C·M\) \((\d+) min\) and the goodput"
                  r" \(~(\d+)%\)", text)
    assert m, "docs/remediation.md no longer gives the plan example's figures"
    assert _check_command(m.group(1)) == []
    r = _run(m.group(1), env)
    assert r.returncode == 0, r.stdout + r.stderr
    interval = float(re.search(r"checkpoint every ([\d.]+) min", r.stdout).group(1))
    goodput = float(re.search(r"goodput ([\d.]+)%", r.stdout).group(1))
    assert abs(interval - int(m.group(2))) <= 0.5, r.stdout  # 37.9 min: "38 min"
    assert abs(goodput - int(m.group(3))) <= 0.5, r.stdout  # 82.5%: "~83%"


# --- 4. the front page ---------------------------------------------------------------------------

def test_the_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    for heading in ("## Quick start", "## Run the tests", "## Exit codes", "## The manual"):
        assert heading in lines, heading


def test_the_readme_exit_codes_are_the_contract():
    """The README's exit-code table is screener.types.ExitCode, every code once."""
    from screener.types import ExitCode

    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = [int(c) for c in re.findall(r"^\| (\d+) \|", section, flags=re.M)]
    assert codes == sorted(int(c) for c in ExitCode), codes


def test_the_readme_test_command_is_what_ci_runs():
    """The README's test command is .ci/run's install lines followed by its pytest line."""
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip().startswith((".venv/bin/", "python3 -m venv"))]
    install = next(ln for ln in ci if ln.startswith("python3 -m venv"))
    pytest_line = next(ln for ln in ci if " -m pytest " in ln)
    assert pytest_line == ".venv/bin/python -m pytest -q -p no:cacheprovider", pytest_line
    section = README.read_text().split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert blocks[0].strip() == f"{install} && {pytest_line}", blocks[0]
    assert f"{pytest_line} -m \"not slow\"" in section  # the fast loop
    assert "python -m mypy screener" in section and ".venv/bin/python -m mypy screener" in ci
