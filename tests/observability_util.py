"""The PrometheusRule under manifests/observability/ as the tests read it, and the promtool
inputs they build from it (test_observability, test_not_screening)."""

from __future__ import annotations

from pathlib import Path

import yaml

from screener.types import NodeState

OBS = Path(__file__).resolve().parents[1] / "manifests" / "observability"


def load_rule_groups() -> list[dict]:
    """The rule groups of manifests/observability/prometheusrule.yaml."""
    doc = yaml.safe_load((OBS / "prometheusrule.yaml").read_text())
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["kind"] == "PrometheusRule"
    return doc["spec"]["groups"]


def rules_file(tmp_path: Path, annotations: bool = True) -> Path:
    """The PrometheusRule's groups as a promtool rules file in tmp_path (without the annotations
    when `annotations` is false)."""
    groups = load_rule_groups()
    if not annotations:  # promtool test compares rendered annotations too; `check` covers them
        for g in groups:
            for r in g["rules"]:
                r.pop("annotations", None)
    f = tmp_path / "rules.yaml"
    f.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    return f


def state_series(node: str, current: str, samples: str) -> list[dict]:
    """promtool input series of screener_node_state for `node`: `samples` with V as 1 for
    the `current` state and 0 for the others."""
    return [{"series": f'screener_node_state{{node="{node}",state="{s.value}"}}',
             "values": samples.replace("V", "1" if s.value == current else "0")}
            for s in NodeState]
