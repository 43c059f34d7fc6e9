"""No JSON reader of ours takes a duplicated key (json keeps the last one silently, so a file can
carry a second, hidden value that a person, a diff or another parser reads differently)."""

from __future__ import annotations

import json

import pytest

from screener import boundedjson
from screener.audit.checkpoints import marker_path, read_marker, write_marker
from screener.errors import BadInputError
from screener.known_answer.verdict.crosscheck import peer_digests
from screener.output.report import load_burnin_report
from screener.stores.kube.formats import history_entries, parse_node_history


def test_strict_refuses_a_duplicate_key_at_any_depth():
    assert boundedjson.strict('{"a": {"b": 1}}') == {"a": {"b": 1}}
    for text in ('{"a": 1, "a": 2}', '{"x": [{"k": 1, "k": 1}]}'):
        with pytest.raises(ValueError, match="duplicate key"):
            boundedjson.strict(text)


def test_a_history_with_a_hidden_second_value_is_unparsable():
    good = json.dumps({"last": [{"id": "1", "to": "healthy"}]})
    assert parse_node_history(good, "n1")[0]
    bad = '{"last": [{"id": "1", "to": "healthy"}], "last": []}'
    assert parse_node_history(bad, "n1") == ([], False)
    cm = {"data": {"history": '[{"id": "1", "to": "healthy", "to": "quarantined"}]'}}
    assert history_entries(cm) == []


def test_a_burnin_report_with_a_duplicate_key_is_bad_input(tmp_path):
    p = tmp_path / "r.json"
    p.write_text('{"kind": "burnin", "outcome": "pass", "outcome": "suspect", "stages": []}')
    with pytest.raises(BadInputError, match="duplicate key 'outcome'"):
        load_burnin_report(p)


def test_a_peers_digest_annotation_with_a_duplicate_key_is_skipped():
    class Store:  # the one method peer_digests reads: the kube store's annotation lister
        def annotations_by_node(self, key: str, selector: str = "") -> dict[str, str]:
            return {"a": '{"p1": {"gemm": "x"}}', "b": '{"p1": {"gemm": "x", "gemm": "y"}}'}

    assert peer_digests(Store(), "me") == {"a": {"p1": {"gemm": "x"}}}


def test_a_checkpoint_marker_with_a_duplicate_key_is_not_trusted(tmp_path):
    ckpt = tmp_path / "step1.pt"
    ckpt.write_bytes(b"x")
    write_marker(ckpt, step=1, weights_digest="d")
    assert read_marker(ckpt) is not None
    m = marker_path(ckpt)
    text = m.read_text()
    m.write_text(text.rstrip().rstrip("}") + ', "step": 99}')
    assert read_marker(ckpt) is None
