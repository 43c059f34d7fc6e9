"""A fork server for `screener` child processes: the real CLI entry point, without paying for the
imports (kubernetes alone takes 1-3 s) in every child.

Run as a script (`python tests/fakes/forkserver.py`): it imports the CLI, the daemon and the
Kubernetes store once, then reads one JSON request a line on stdin, {"argv": [...], "env": {...},
"out": path, "err": path}; for each it forks a child that sets the environment, sends its stdout
and stderr to the files and runs `screener.cli.run(argv)` (the console entry point: exit codes as
the installed `screener` gives them), answers {"pid": pid} at once and {"pid": pid, "status": s}
when the child has ended (s: the exit code, or minus the signal that ended it: -9 after kill -9).
One child at a time. `ForkServer` is the test side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]


def _serve() -> None:
    sys.path.insert(0, str(ROOT))
    # What a `daemon --once` pass imports, imported before any fork.
    import screener.cli  # noqa: F401
    import screener.commands.daemon  # noqa: F401
    import screener.commands.context  # noqa: F401
    import screener.agent.daemon.loop  # noqa: F401
    import screener.stores.kube.store  # noqa: F401
    import screener.health.probes  # noqa: F401
    import screener.health.sources.nvml  # noqa: F401
    import screener.agent.screening.window  # noqa: F401

    out = sys.stdout
    print(json.dumps({"ready": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            try:
                os.environ.clear()
                os.environ.update(req["env"])
                os.chdir(req.get("cwd") or str(ROOT))
                for fd, path in ((1, req["out"]), (2, req["err"])):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.dup2(f, fd)
                    os.close(f)
                sys.stdin = open(os.devnull)
                from screener.cli import run

                run(req["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            except BaseException:  # noqa: BLE001 - the child's own traceback, then 1
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        print(json.dumps({"pid": pid}), file=out, flush=True)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps({"pid": pid, "status": code}), file=out, flush=True)


class ForkServer:
    """The test side: start() it, then spawn() a child, kill it or wait() for its status."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen[str]] = None

    def start(self) -> "ForkServer":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        ready = self._read()
        assert "ready" in ready, ready
        return self

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the fork server ended")
        data: dict[str, Any] = json.loads(line)
        return data

    def spawn(self, argv: list[str], env: dict[str, str], out: Path, err: Path) -> int:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "out": str(out),
                                          "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        return int(self._read()["pid"])

    def wait(self) -> int:
        """The status of the child spawned last (its exit code, or -signal)."""
        return int(self._read()["status"])

    def stop(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self.proc = None

    def __enter__(self) -> "ForkServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    _serve()
