"""The NVIDIA command-line tools the repair ladder drives: `nvidia-smi` (the compute processes on
each GPU, and `nvidia-smi -r`, the GPU reset) and `dcgmi diag` (DCGM's active diagnostics, the
corroboration on entry to quarantine).

Each tool is run as a child process with a time limit, found on the PATH it is given, and its
text output is parsed here. What a tool says about the hardware is a result; a tool that is
missing, times out, exits non-zero without its result table, or prints what we cannot read is
OUR failure (`ToolResult.error`), never a hardware verdict in either direction.

Formats (NVIDIA's documentation):
  nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name --format=csv,noheader
      one line per process: "GPU-<uuid>, 12345, python"; nothing when no process runs.
  nvidia-smi -r -i <index>
      "GPU 00000000:07:00.0 was successfully reset." then "All done.", exit 0; a refusal (a
      process on the GPU, the primary GPU, not supported) is a sentence and a non-zero exit.
  dcgmi diag -r <level>
      "Successfully ran diagnostic for group." and a table of "| <test> | <Pass|Fail|Skip|Warn>
      [- GPU: n | - All] |" rows under Deployment / Integration / Hardware / Stress sections.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

TOOL_TIMEOUT_S = 60.0
DIAG_TIMEOUT_S = 1800.0  # level 2 takes about two minutes, level 3 about fifteen
_OUTPUT_KEEP = 2000  # characters of a tool's output kept as evidence (the history is bounded)


@dataclass(frozen=True)
class ToolResult:
    """One run of a tool: its command, exit code, output, and our error (if we failed)."""

    argv: tuple[str, ...]
    returncode: Optional[int]
    output: str
    error: str = ""  # set when the tool could not run or be read: our failure, not a verdict

    def to_dict(self) -> dict[str, Any]:
        return {"argv": list(self.argv), "returncode": self.returncode,
                "output": self.output[-_OUTPUT_KEEP:], "error": self.error}


def run_tool(argv: Sequence[str], *, env: Optional[Mapping[str, str]] = None,
             timeout_s: float = TOOL_TIMEOUT_S) -> ToolResult:
    """Run `argv` (its first word looked up on env's PATH), stdout and stderr together."""
    path = (env or {}).get("PATH") if env is not None else None
    exe = shutil.which(argv[0], path=path)
    if exe is None:
        return ToolResult(tuple(argv), None, "", f"{argv[0]} not found on PATH")
    try:
        done = subprocess.run([exe, *argv[1:]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False,
                              env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired:
        return ToolResult(tuple(argv), None, "", f"{argv[0]} did not finish in {timeout_s:g} s")
    except OSError as e:
        return ToolResult(tuple(argv), None, "", f"cannot run {argv[0]}: {e.strerror or e}")
    return ToolResult(tuple(argv), done.returncode, done.stdout.decode("utf-8", "replace"))


def available(tool: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether `tool` is on env's PATH (dcgmi is optional: no DCGM, no corroboration)."""
    return shutil.which(tool, path=(env or {}).get("PATH") if env is not None else None) is not None


# --- nvidia-smi -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComputeApp:
    """One process on a GPU, as nvidia-smi --query-compute-apps reports it."""

    gpu_uuid: str
    pid: int
    name: str


def compute_apps(nvidia_smi: str = "nvidia-smi", *, env: Optional[Mapping[str, str]] = None
                 ) -> tuple[list[ComputeApp], ToolResult]:
    """The compute processes on every GPU; the list is empty when the query failed (check
    result.error: a failed query must never read as "no process")."""
    res = run_tool([nvidia_smi, "--query-compute-apps=gpu_uuid,pid,process_name",
                    "--format=csv,noheader"], env=env)
    if res.error or res.returncode != 0:
        return [], _failed(res, "the compute-process query failed")
    apps = []
    for line in res.output.splitlines():
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or not parts[1].isdigit():
            return [], _failed(res, f"unreadable compute-process line {line.strip()[:120]!r}")
        apps.append(ComputeApp(parts[0], int(parts[1]), parts[2]))
    return apps, res


_RESET_OK = re.compile(r"^GPU [0-9A-Fa-f:.]+ was successfully reset\.", re.M)


def reset_gpu(index: int, nvidia_smi: str = "nvidia-smi", *,
              env: Optional[Mapping[str, str]] = None) -> ToolResult:
    """`nvidia-smi -r -i INDEX`; error set unless it exits 0 and says the GPU was reset."""
    res = run_tool([nvidia_smi, "-r", "-i", str(index)], env=env)
    if res.error:
        return res
    if res.returncode != 0 or not _RESET_OK.search(res.output):
        first = res.output.strip().splitlines()[0] if res.output.strip() else "no output"
        return _failed(res, f"GPU {index} was not reset (exit {res.returncode}): {first[:200]}")
    return res


def _failed(res: ToolResult, why: str) -> ToolResult:
    return ToolResult(res.argv, res.returncode, res.output, res.error or why)


# --- dcgmi diag ------------------------------------------------------------------------------------

_ROW = re.compile(r"^\|\s*([A-Za-z][^|]*?)\s*\|\s*(Pass|Fail|Skip|Warn)\b([^|]*)\|", re.M)


@dataclass(frozen=True)
class DiagResult:
    """What `dcgmi diag -r LEVEL` said: passed (no test failed), the failed tests, every row."""

    level: int
    passed: Optional[bool]  # None: no result (our failure, see tool.error)
    failed: tuple[str, ...] = ()
    rows: Mapping[str, str] = field(default_factory=dict)
    tool: Optional[ToolResult] = None

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "passed": self.passed, "failed": list(self.failed),
                "rows": dict(self.rows), "tool": self.tool.to_dict() if self.tool else None}


def dcgm_diag(level: int = 2, dcgmi: str = "dcgmi", *, env: Optional[Mapping[str, str]] = None,
              timeout_s: float = DIAG_TIMEOUT_S) -> DiagResult:
    """Run DCGM's diagnostic suite at `level` and read its table. A run that printed no result
    table (DCGM not running, a bad level) has passed=None: no verdict."""
    res = run_tool([dcgmi, "diag", "-r", str(level)], env=env, timeout_s=timeout_s)
    rows = {m.group(1).strip(): (m.group(2) + m.group(3)).strip()
            for m in _ROW.finditer(res.output)}
    if res.error or not rows:
        return DiagResult(level, None, tool=_failed(res, "dcgmi diag printed no result table"))
    failed = tuple(name for name, r in rows.items() if r.startswith("Fail"))
    return DiagResult(level, not failed, failed, rows, res)
