"""gpu_tools' parsers fed the real output of nvidia-smi and dcgmi (tests/data/gpu_tools/, each
file's source in SOURCES.md there), then the same parsers through the fake executables of
tests/fakes/nvidia_tools.py. What a tool says about the hardware is a result; anything we cannot
read, a refusal included, is our failure (ToolResult.error / DiagResult.passed None)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes.nvidia_tools import install_tools, tool_calls
from screener.remediation import gpu_tools
from screener.remediation.gpu_tools import ToolResult

DATA = Path(__file__).parent / "data" / "gpu_tools"


def _text(name: str) -> str:
    return (DATA / name).read_text()


def _ran(argv: list[str], returncode: int, output: str) -> ToolResult:
    return ToolResult(tuple(argv), returncode, output)


# --- nvidia-smi --query-compute-apps -----------------------------------------------------------

QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name", "--format=csv,noheader"]


def test_compute_apps_reads_the_real_csv_lines():
    apps, res = gpu_tools.read_compute_apps(_ran(QUERY, 0, _text("smi_compute_apps.txt")))
    assert not res.error
    assert [(a.gpu_uuid, a.pid, a.name) for a in apps] == [
        ("GPU-a008e90f-259e-df57-7988-63b6831fff68", 5627,
         "/usr/libexec/gnome-remote-desktop-daemon"),
        ("GPU-a008e90f-259e-df57-7988-63b6831fff68", 6374, "/usr/NX/bin/nxnode.bin")]


@pytest.mark.parametrize("output", ["", "\n", "No running processes found\n"])
def test_no_process_is_an_empty_list_not_an_error(output):
    apps, res = gpu_tools.read_compute_apps(_ran(QUERY, 0, output))
    assert apps == [] and not res.error


@pytest.mark.parametrize("code,output", [
    (9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"),
    (0, "Field \"gpu_uuid\" is not a valid field to query.\n"),
])
def test_a_failed_or_unreadable_query_never_reads_as_no_process(code, output):
    apps, res = gpu_tools.read_compute_apps(_ran(QUERY, code, output))
    assert apps == [] and res.error


# --- nvidia-smi -r -i N ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smi_reset_ok.txt", "smi_reset_all_ok.txt"])
def test_a_reset_that_says_so_and_exits_zero_is_a_reset(name):
    assert gpu_tools.reset_refusal(0, _text(name), 0) == ""


@pytest.mark.parametrize("name,code,reason", [
    ("smi_reset_in_use.txt", 255, "In use by another client"),  # 255: seen on real nodes
    ("smi_reset_not_supported.txt", 3, "Not Supported"),  # 3 and 4: the man page's codes
    ("smi_reset_permissions.txt", 4, "Insufficient Permissions"),
    ("smi_reset_in_use_old.txt", 255, "it's being used by some other process"),
])
def test_each_real_refusal_is_our_failure_with_its_reason(name, code, reason):
    why = gpu_tools.reset_refusal(code, _text(name), 0)
    assert why.startswith(f"GPU 0 was not reset (exit {code}): {reason}")
    assert f"[nvidia-smi: {gpu_tools.SMI_EXIT[code]}]" in why


@pytest.mark.parametrize("code,output", [
    (0, "Resetting GPU 00000000:07:00.0 is not supported.\n"),  # a sentence we do not know
    (0, ""),  # silence
    (255, "GPU 00000000:07:00.0 was successfully reset.\n"),  # the sentence, but a failing exit
    (0, "GPU 00000000:07:00.0 was successfully reset.\nSome GPUs could not be reset.\n"),
])
def test_anything_but_a_clean_success_is_no_reset(code, output):
    assert gpu_tools.reset_refusal(code, output, 3).startswith(f"GPU 3 was not reset (exit {code})")


# --- dcgmi diag -r N ---------------------------------------------------------------------------

def _diag(name: str, code: int, level: int = 2) -> gpu_tools.DiagResult:
    return gpu_tools.read_diag(level, _ran(["dcgmi", "diag", "-r", str(level)], code, _text(name)))


def test_dcgm4_passing_table():
    d = _diag("dcgm4_r2_pass_4.4.2.txt", 0)
    assert d.passed is True and d.failed == () and d.version == "4.4.2"
    assert d.rows == {"software": "Pass; GPU0: Pass", "memory": "Pass; GPU0: Pass",
                      "pcie": "Pass; GPU0: Pass"}


@pytest.mark.parametrize("name,version", [("dcgm4_r2_fail_4.2.3.txt", "4.2.3"),
                                          ("dcgm4_r2_fail_4.4.1.txt", "4.4.1")])
def test_dcgm4_failing_table_the_tests_own_row_decides(name, version):
    # pcie's own row says Fail while every GPU row says Pass (an internal error of the test):
    # DCGM counts it failed and exits 226, and so do we. The Warning rows are messages, not tests.
    d = _diag(name, gpu_tools.EXIT_NVVS_ERROR)
    assert d.passed is False and d.failed == ("pcie",) and d.version == version
    assert set(d.rows) == {"software", "memory", "pcie"}
    assert d.rows["pcie"].startswith("Fail; GPU0: Pass")


def test_dcgm3_failing_table_reads_the_nameless_fail_row():
    # "| Targeted Power | Pass - GPUs: 0, 2, 3 |" then "|  | Fail - GPU: 1 |": the test failed on
    # GPU 1 though its named row says Pass (the old parser read only the named row: a pass).
    d = _diag("dcgm3_fail_3.3.9.txt", gpu_tools.EXIT_NVVS_ERROR, level=3)
    assert d.passed is False and d.failed == ("Targeted Power",) and d.version == "3.3.9"
    assert d.rows["Targeted Power"] == "Pass - GPUs: 0, 2, 3; Fail - GPU: 1"
    assert d.rows["EUD Test"] == "Skip - All" and d.rows["Denylist"] == "Pass"
    assert not {"Warning", "Info", "DCGM Version", "Driver Version Detected",
                "GPU Device IDs Detected"} & set(d.rows)  # messages and metadata are no tests
    assert d.rows["Diagnostic"] == "Pass - All"  # the test named Diagnostic, not the heading


def test_dcgm3_level1_passing_table():
    d = _diag("dcgm3_r1_pass_3.3.9.txt", 0, level=1)
    assert d.passed is True and len(d.rows) == 9 and set(d.rows.values()) == {"Pass"}


def test_dcgm4_warning_is_not_a_failure():
    # DCGM 4's layout (dcgmi/Diag.cpp v4.6.0): a warned test's own row says Warn, its GPU's row
    # says Fail. Built from the source; no captured run with a Warn was found.
    table = _text("dcgm4_r2_pass_4.4.2.txt").replace(
        "| memory                    | Pass                                           |\n"
        "|                           | GPU0: Pass                                     |",
        "| memory                    | Warn                                           |\n"
        "|                           | GPU0: Fail                                     |")
    d = gpu_tools.read_diag(2, _ran(["dcgmi", "diag", "-r", "2"], gpu_tools.EXIT_NVVS_ERROR, table))
    assert "Warn; GPU0: Fail" == d.rows["memory"]
    # No test failed, yet dcgmi exited 226: a contradiction we cannot read, so no verdict.
    assert d.passed is None and d.tool is not None and "no failed test" in d.tool.error


def test_no_table_is_no_verdict():
    d = _diag("dcgmi_no_hostengine.txt", 235)  # DCGM_ST_CONNECTION_NOT_VALID (-21)
    assert d.passed is None and d.rows == {}
    assert d.tool is not None and d.tool.error.startswith("dcgmi diag printed no result table "
                                                          "(exit 235): Error: unable to establish")


# --- through the fake executables ---------------------------------------------------------------

@pytest.mark.parametrize("dcgm,failed", [("4", ("memory",)), ("3", ("GPU Memory",))])
def test_the_fake_dcgmi_prints_what_the_parser_reads(tmp_path, dcgm, failed):
    env, state = install_tools(tmp_path)
    (state / "dcgm_version").write_text(dcgm)
    ok = gpu_tools.dcgm_diag(2, env=env)
    assert ok.passed is True and ok.tool is not None and ok.tool.returncode == 0
    (state / "diag_fails").write_text("0")
    bad = gpu_tools.dcgm_diag(2, env=env)
    assert bad.passed is False and bad.failed == failed
    assert bad.tool is not None and bad.tool.returncode == gpu_tools.EXIT_NVVS_ERROR
    assert tool_calls(state) == ["dcgmi diag -r 2", "dcgmi diag -r 2"]


@pytest.mark.parametrize("kind,code,reason", [
    ("", 255, "In use by another client"),
    ("not_supported", 3, "Not Supported"),
    ("permissions", 4, "Insufficient Permissions"),
    ("Resetting GPU 00000000:07:00.0 is not supported.", 255, "Resetting GPU 00000000:07:00.0"),
])
def test_the_fake_nvidia_smi_refusals_are_our_failure(tmp_path, kind, code, reason):
    env, state = install_tools(tmp_path)
    assert not gpu_tools.reset_gpu(1, env=env).error
    (state / "reset_fails").write_text(kind)
    res = gpu_tools.reset_gpu(0, env=env)
    assert res.returncode == code
    assert res.error.startswith(f"GPU 0 was not reset (exit {code}): {reason}")
    assert tool_calls(state) == ["nvidia-smi -r -i 1", "nvidia-smi -r -i 0"]


def test_the_fake_query_lists_the_apps_file(tmp_path):
    env, state = install_tools(tmp_path)
    assert gpu_tools.compute_apps(env=env)[0] == []
    (state / "apps").write_text(_text("smi_compute_apps.txt"))
    apps, res = gpu_tools.compute_apps(env=env)
    assert [a.pid for a in apps] == [5627, 6374] and not res.error
