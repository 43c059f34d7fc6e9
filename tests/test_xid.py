"""The Xid catalog: every code the issue names is known, classified, and unknown codes are kept."""

from __future__ import annotations

import pytest

from screener.health.verdict.xid import CATALOG, XidClass, lookup
from screener.types import Severity

REQUIRED = [13, 31, 32, 43, 45, 48, 61, 62, 63, 64, 68, 69, 74, 79, 92, 94, 95, 109, 119, 120,
            121, 140, 143]
LABELS = {"RESTART_APP", "RESET_GPU", "RESTART_BM", "IGNORE", "CONTACT_SUPPORT",
          "CHECK_MECHANICALS", "XID_154"}


@pytest.mark.parametrize("code", REQUIRED)
def test_required_codes_are_in_the_catalog(code):
    info = lookup(code)
    assert info.known and info.code == code
    assert info.name and info.name != "UNKNOWN" and info.description and info.action
    assert info.resolution in LABELS or info.resolution.startswith("WORKFLOW_")


def test_every_entry_uses_an_nvidia_resolution_label():
    for info in CATALOG.values():
        assert info.resolution in LABELS or info.resolution.startswith("WORKFLOW_"), info


@pytest.mark.parametrize("code", [13, 31, 43, 69])
def test_application_faults_are_software_not_hardware(code):
    info = lookup(code)
    assert info.classification is XidClass.SOFTWARE
    assert info.severity < Severity.WARNING  # never sends a good node to repair


@pytest.mark.parametrize("code,resolution,severity", [
    (79, "RESTART_BM", Severity.CRITICAL),  # fallen off the bus
    (64, "RESET_GPU", Severity.CRITICAL),  # remap failure: repair in practice
    (95, "RESET_GPU", Severity.CRITICAL),  # uncontained memory error
    (48, "WORKFLOW_XID_48", Severity.SUSPECT),
    (74, "WORKFLOW_NVLINK_ERR", Severity.SUSPECT),
    (94, "RESTART_APP", Severity.SUSPECT),
    (119, "RESET_GPU", Severity.SUSPECT),
    (120, "RESET_GPU", Severity.SUSPECT),
    (140, "RESET_GPU", Severity.SUSPECT),
    (143, "RESET_GPU", Severity.SUSPECT),
])
def test_hardware_codes_keep_nvidias_label_and_get_our_severity(code, resolution, severity):
    info = lookup(code)
    assert info.classification is XidClass.HARDWARE
    assert info.resolution == resolution
    assert info.severity is severity


@pytest.mark.parametrize("code", [45, 121, 154])
def test_informational_codes(code):
    info = lookup(code)
    assert info.classification is XidClass.INFORMATIONAL
    assert info.severity is Severity.INFO


def test_names_match_nvidias_mnemonics():
    assert lookup(79).name == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert lookup(63).name == "INFOROM_DRAM_RETIREMENT_EVENT"
    assert lookup(64).name == "INFOROM_DRAM_RETIREMENT_FAILURE"
    assert lookup(13).investigatory == "WORKFLOW_XID_13"


@pytest.mark.parametrize("code", [999, 0, 4242])
def test_unknown_codes_are_reported_as_unknown_not_dropped(code):
    info = lookup(code)
    assert not info.known
    assert info.classification is XidClass.UNKNOWN
    assert info.code == code
    assert info.severity is Severity.WARNING
    d = info.to_dict()
    assert d["classification"] == "unknown" and d["code"] == code
