"""run_guarded on a real gloo group: a peer that vanishes mid-collective gives exit code 77."""

from __future__ import annotations

import pytest

import audit_workers
from ddp_util import run_ranks


@pytest.mark.timeout(120)
def test_vanished_peer_maps_to_77():
    codes = run_ranks(audit_workers.peer_vanishes, ["n0", "n1"], timeout=100)
    assert codes == [77, 0]
