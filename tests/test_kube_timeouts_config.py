"""The daemon's `[kube_timeouts]` table reaches every request of the kube store it opens: with
the API server black-holed behind a real TCP proxy, a call fails within the configured time."""

from __future__ import annotations

import json
import time

import pytest

from fakes.kubeapi import KubeAPI
from fakes.tcpproxy import TcpProxy
from screener.commands.context import AppContext
from screener.errors import ConfigError
from screener.settings.daemon import DaemonConfig
from screener.settings.stores import KubeTimeouts, StoreChoice
from screener.stores.kube import TransientKubeError
from screener.types import LABEL_STATE


def test_the_table_is_read_and_validated():
    config = DaemonConfig.from_mapping({"node": "n1", "kube_timeouts": {"read_s": 2.5}})
    assert config.kube_timeouts == KubeTimeouts(read_s=2.5)
    assert DaemonConfig.from_mapping({"node": "n1"}).kube_timeouts == KubeTimeouts()
    for bad, key in (({"read_s": -1}, "read_s"), ({"read_s": float("nan")}, "read_s"),
                     ({"reed_s": 1}, "reed_s"), (7, "kube_timeouts")):
        with pytest.raises(ConfigError, match=key):
            DaemonConfig.from_mapping({"node": "n1", "kube_timeouts": bad})


@pytest.mark.slow
def test_a_black_holed_api_fails_within_the_configured_time(tmp_path):
    config = DaemonConfig.from_mapping({"node": "gpu-1", "kube_timeouts": {
        "connect_s": 0.5, "read_s": 0.5, "call_s": 1.5, "unreachable_s": 5.0}})
    with KubeAPI() as api:
        api.add_node("gpu-1", labels={LABEL_STATE: "healthy"})
        proxy = TcpProxy(api.port)
        try:
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                **json.loads(api.write_kubeconfig(tmp_path / "k0").read_text()),
                "clusters": [{"name": "test", "cluster": {"server": proxy.url}}]}))
            app = AppContext()
            try:  # as `screener daemon` builds its store choice (commands/daemon.build_daemon)
                store = app.store(StoreChoice(kind="kube", kubeconfig=str(kubeconfig),
                                              spool=str(tmp_path / "spool.db"),
                                              timeouts=config.kube_timeouts))
                assert store.get_state("gpu-1").value == "healthy"
                proxy.add("blackhole")
                t0 = time.monotonic()
                with pytest.raises(TransientKubeError):
                    store.get_state("gpu-1")
                assert time.monotonic() - t0 < config.kube_timeouts.call_s + 1.5
            finally:
                app.close()
        finally:
            proxy.close()


def test_the_table_round_trips_through_the_configs_json_form():
    config = DaemonConfig.from_mapping({"node": "n1", "kube_timeouts": {"call_s": 9.0}})
    d = json.loads(json.dumps(config.to_dict()))
    assert d["kube_timeouts"]["call_s"] == 9.0
    assert DaemonConfig.from_mapping(d).kube_timeouts == config.kube_timeouts
