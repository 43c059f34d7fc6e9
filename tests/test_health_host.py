"""screener.health.sources.host, psutil's one importer, against real processes: a process is named by its
PID and start time, so a PID the kernel reused for someone else's process is never signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from screener.health.sources import host

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_host_facts_are_plain_numbers():
    assert 0 < host.boot_time() < time.time()
    assert host.available_memory() > 0
    assert os.getpid() in host.own_pids()


def test_a_process_with_another_start_time_is_not_the_named_one_and_is_left_alone():
    child = subprocess.Popen(SLEEPER)
    try:
        proc = host.find_process(child.pid)
        assert proc is not None and proc.pid == child.pid
        assert host.find_process(child.pid, proc.create_time) == proc
        reused = host.Proc(child.pid, proc.create_time + 1.0)  # the same PID, started later
        assert host.find_process(child.pid, reused.create_time) is None
        host.kill([reused])
        assert child.poll() is None  # not the process named: still running
        host.kill([proc])
        assert child.wait(10) == -9
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


@pytest.mark.slow
def test_descendants_and_environment_tags_find_a_family_in_sessions_of_its_own():
    tag = f"screener-test-{os.getpid()}"
    # A child in a session of its own starts a grandchild (its own session too) and prints its
    # PID; both inherit the tag.
    code = ("import subprocess, sys, time; "
            f"p = subprocess.Popen({SLEEPER!r}, start_new_session=True); "
            "print(p.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "SCREENER_TEST_TAG": tag})
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        family = host.descendants(child.pid)
        assert [p.pid for p in family] == [grandchild]
        tagged = {p.pid for p in host.tagged_processes("SCREENER_TEST_TAG", {tag})}
        assert tagged == {child.pid, grandchild}
        assert host.tagged_processes("SCREENER_TEST_TAG", {"someone-else"}) == []
        host.kill([p for p in [host.find_process(child.pid)] if p is not None])
        assert child.wait(10) == -9
        # Orphaned now (as a screen's children are when its worker dies): killed all the same,
        # and kill waits until it is gone, since it is not ours to reap.
        host.kill(family, wait_s=10)
        assert host.find_process(grandchild, family[0].create_time) is None
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
