"""Per-GPU out of service where the cluster uses DRA (issue 38.4): a real Daemon with the kube store
against the API test server speaking resource.k8s.io/v1 (ResourceSlices, DeviceTaintRules), each
body it sends checked there against the published Kubernetes 1.37 schema (strict)."""

from __future__ import annotations

import logging

import pytest

from fakes.daemon import NODE, DaemonRig, ScriptedRunner, outcome
from fakes.fake_nvml import FakeNvml, h100
from fakes.kubeapi import KubeAPI, validate_published
from screener.agent.daemon.device_taints import cuda_gpus
from screener.health.verdict.snapshot import GpuSnapshot
from screener.stores.kube import KubeStore
from screener.stores.kube.devices import (KubeDeviceTaints, SliceDevice, rule_body, rule_name,
                                         slice_devices)
from screener.alarmfile import AlarmRecord
from screener.types import NodeState, Outcome, SuspectNode, Verdict

DRIVER = "gpu.nvidia.com"
KEY = "screener.io/gpu-suspect"


def uuid_of(index: int) -> str:
    return h100(index).uuid  # the fake NVML's GPU at that index


def serial_of(index: int) -> str:
    return h100(index).serial


def gpu_device(index: int, *, minor: int | None = None) -> dict:
    """A full GPU as the NVIDIA DRA driver publishes it (gpu-<minor>, its uuid attribute)."""
    return {"name": f"gpu-{index if minor is None else minor}",
            "attributes": {"type": {"string": "gpu"}, "uuid": {"string": uuid_of(index)},
                           "productName": {"string": "NVIDIA H100 80GB HBM3"},
                           "pcieBusID": {"string": f"0000:{0x18 + 0x10 * index:02x}:00.0"}},
            "capacity": {"memory": {"value": "80Gi"}}}


def screen(cuda1: Outcome, cuda0: Outcome = Outcome.PASS):
    kind = Outcome.SUSPECT if Outcome.SUSPECT in (cuda0, cuda1) else Outcome.PASS
    vs = (Verdict(device="cuda:0", outcome=cuda0, job="gemm-fp32", platform_hash="p1",
                  reason="golden_mismatch" if cuda0 == Outcome.SUSPECT else ""),
          Verdict(device="cuda:1", outcome=cuda1, job="gemm-fp32", platform_hash="p1",
                  reason="golden_mismatch" if cuda1 == Outcome.SUSPECT else ""))
    return outcome(kind, verdicts=vs)


def rig_for(api: KubeAPI, tmp_path, *screens, enabled: bool = True, mode: str = "enforce"):
    store = KubeStore(api.api_client(), sleep=lambda s: None, rng=lambda: 0.0, instance="dra")
    taints = KubeDeviceTaints(store.calls, driver=DRIVER, taint_key=KEY)
    rig = DaemonRig(tmp_path, ScriptedRunner(*screens), store=store, taint=store,
                    idle_window_s=0.0, screen_interval_s=3600.0, mode=mode,
                    dra={"enabled": enabled, "driver": DRIVER, "taint_key": KEY},
                    daemon_kw={"device_taints": taints})
    return rig


def dra_calls(api: KubeAPI) -> list:
    return [c for c in api.calls if c.group == "resource.k8s.io"]


@pytest.fixture
def api():
    with KubeAPI() as server:
        server.add_node(NODE)
        server.add_node("gpu-node-2")
        server.add_resource_slice(NODE, [gpu_device(0), gpu_device(1)])
        # Another node's slice, with the same device names: never selected from here.
        server.add_resource_slice("gpu-node-2", [gpu_device(0), gpu_device(1)])
        yield server


def test_a_screen_naming_cuda_1_bad_taints_only_that_device_and_a_passing_retest_clears_it(
        api, tmp_path):
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT),
                  screen(Outcome.PASS))
    try:
        rig.tick()  # full burn-in passes: healthy; nothing tainted
        assert rig.daemon.state == NodeState.HEALTHY and api.device_taint_rules == {}
        report = rig.tick(advance=3600.0)  # the quick screen: cuda:1 suspect
        # The node's state is the lifecycle's, as without DRA: suspect, tainted, confirming.
        assert rig.daemon.state == NodeState.SUSPECT
        taints = api.node(NODE)["spec"]["taints"]
        assert {"key": "screener.io/state", "value": "suspect", "effect": "NoSchedule"} in taints
        assert list(api.device_taint_rules) == [f"screener.{NODE}.gpu-1"]
        rule = api.device_taint_rule(f"screener.{NODE}.gpu-1")
        assert rule["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": NODE,
                                                  "device": "gpu-1"}
        assert rule["spec"]["taint"]["key"] == KEY and rule["spec"]["taint"]["effect"] == "NoSchedule"
        assert rule["spec"]["taint"]["value"] == "KnownAnswerMismatch"
        assert rule["metadata"]["annotations"]["screener.io/gpu-uuid"] == uuid_of(1)
        assert rule["metadata"]["annotations"]["screener.io/gpu-serial"] == serial_of(1)
        assert {a["result"] for a in report.actions if a["action"] == "device_taint"} == {"created"}
        # The slices were found by field selector, this node's and the driver's only.
        lists = [c for c in dra_calls(api) if c.resource == "resourceslices"]
        assert lists and all(c.verb == "list" for c in lists)
        report = rig.tick(advance=60.0)  # the confirming screen passes on both devices
        assert rig.daemon.state == NodeState.HEALTHY
        assert api.device_taint_rules == {}
        assert [a["result"] for a in report.actions if a["action"] == "device_untaint"] == ["cleared"]
        deletes = [c for c in dra_calls(api) if c.verb == "delete"]
        assert [(c.name, c.status) for c in deletes] == [(f"screener.{NODE}.gpu-1", 200)]
    finally:
        rig.close()


def test_a_replayed_taint_is_not_doubled(api, tmp_path):
    # Suspect, then the confirming screen suspect again: quarantined, the same one rule.
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT),
                  screen(Outcome.SUSPECT))
    try:
        rig.tick()
        rig.tick(advance=3600.0)
        report = rig.tick(advance=60.0)
        assert rig.daemon.state == NodeState.QUARANTINED
        assert list(api.device_taint_rules) == [f"screener.{NODE}.gpu-1"]
        assert [a["result"] for a in report.actions if a["action"] == "device_taint"] == ["present"]
        creates = [c.status for c in dra_calls(api) if c.verb == "create"]
        assert creates == [201, 409]  # the second found the first, read it, and left it
    finally:
        rig.close()
    # A restarted daemon's replay of the same finding: the rule is there, taken as its own.
    store = KubeStore(api.api_client(), sleep=lambda s: None, instance="dra")
    taints = KubeDeviceTaints(store.calls, driver=DRIVER, taint_key=KEY)
    device = next(d for d in taints.devices(NODE) if d.name == "gpu-1")
    body = taints.body(NODE, device, reason="KnownAnswerMismatch", gpu_uuid=uuid_of(1))
    assert taints.create(body, device) is False and len(api.device_taint_rules) == 1
    store.close()


def test_a_rule_under_our_name_for_another_device_is_left_alone(api, tmp_path):
    store = KubeStore(api.api_client(), sleep=lambda s: None, instance="dra")
    taints = KubeDeviceTaints(store.calls, driver=DRIVER, taint_key=KEY)
    device = SliceDevice(driver=DRIVER, pool=NODE, name="gpu-1", uuid=uuid_of(1))
    foreign = rule_body(NODE, SliceDevice(driver=DRIVER, pool=NODE, name="gpu-0"), key=KEY,
                        reason="x", gpu_uuid="GPU-other")
    foreign["metadata"]["name"] = rule_name(NODE, "gpu-1")
    api.device_taint_rules[foreign["metadata"]["name"]] = {
        **foreign, "metadata": {**foreign["metadata"], "uid": "u-x", "resourceVersion": "1"}}
    from screener.stores.kube.calls import KubeApiError

    with pytest.raises(KubeApiError, match="left alone"):
        taints.create(taints.body(NODE, device, reason="x", gpu_uuid=uuid_of(1)), device)
    store.close()


def test_the_delete_carries_the_uid_so_a_rule_made_again_is_not_removed(api, tmp_path):
    store = KubeStore(api.api_client(), sleep=lambda s: None, instance="dra")
    taints = KubeDeviceTaints(store.calls, driver=DRIVER, taint_key=KEY)
    device = next(d for d in taints.devices(NODE) if d.name == "gpu-0")
    assert taints.create(taints.body(NODE, device, reason="x", gpu_uuid=uuid_of(0)), device)
    [stale] = taints.rules(NODE)
    name = stale["metadata"]["name"]
    api.device_taint_rules[name]["metadata"]["uid"] = "made-again"  # deleted and made again
    assert taints.delete(stale) is False and name in api.device_taint_rules
    [fresh] = taints.rules(NODE)
    assert taints.delete(fresh) is True and api.device_taint_rules == {}
    assert taints.delete(fresh) is False  # gone: 404 is no error
    store.close()


def test_a_node_without_resource_slices_taints_nothing_and_says_so_once(tmp_path, caplog):
    with KubeAPI() as api:
        api.add_node(NODE)
        api.add_resource_slice("gpu-node-2", [gpu_device(0)])  # DRA elsewhere, not here
        rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT),
                      screen(Outcome.SUSPECT))
        try:
            with caplog.at_level(logging.WARNING, logger="screener.daemon"):
                rig.tick()
                rig.tick(advance=3600.0)
                rig.tick(advance=60.0)
            assert rig.daemon.state == NodeState.QUARANTINED  # the node's own state as ever
            assert api.device_taint_rules == {}
            assert not [c for c in dra_calls(api) if c.verb == "create"]
            said = [r for r in caplog.records if "no ResourceSlice" in r.getMessage()]
            assert len(said) == 1 and NODE in said[0].getMessage()
        finally:
            rig.close()


def test_the_setting_off_does_nothing(api, tmp_path):
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT), enabled=False)
    try:
        rig.tick()
        rig.tick(advance=3600.0)
        assert rig.daemon.state == NodeState.SUSPECT
        assert dra_calls(api) == [] and api.device_taint_rules == {}
    finally:
        rig.close()


def test_the_local_store_does_nothing_and_says_so_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="screener.daemon"):
        rig = DaemonRig(tmp_path, ScriptedRunner(outcome(Outcome.PASS), screen(Outcome.SUSPECT)),
                        idle_window_s=0.0, screen_interval_s=3600.0, dra={"enabled": True})
        try:
            rig.tick()
            rig.tick(advance=3600.0)
            assert rig.daemon.state == NodeState.SUSPECT
        finally:
            rig.close()
    said = [r for r in caplog.records if "[dra] is enabled" in r.getMessage()]
    assert len(said) == 1


def test_observe_mode_makes_no_rule(api, tmp_path):
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT), mode="observe")
    try:
        rig.tick()
        report = rig.tick(advance=3600.0)
        assert api.device_taint_rules == {}
        assert [a["result"] for a in report.actions if a["action"] == "device_taint"] == \
            ["not created: observe mode"]
    finally:
        rig.close()


def test_a_settled_alarm_naming_a_local_gpu_by_serial_taints_it(api, tmp_path):
    from screener.audit.alarms import write_alarm_file

    rig = rig_for(api, tmp_path, outcome(Outcome.PASS))
    try:
        rig.tick()
        for alarm_id, settled, serials in (("unsettled-1", False, [serial_of(0)]),
                                           ("foreign-1", True, ["SN-OF-ANOTHER-NODE"]),
                                           ("settled-1", True, [serial_of(1)])):
            write_alarm_file(AlarmRecord(
                alarm_id=alarm_id, check="weights", step=3, settled=settled,
                suspect_ranks=(1,) if settled else (), suspect_nodes=(SuspectNode(NODE, NODE),),
                node=NODE, job="llm", created=rig.clock() - 1.0,
                evidence={"gpu_serials": serials}), rig.config.alarm_dir)
            rig.tick(advance=5.0)
        assert list(api.device_taint_rules) == [f"screener.{NODE}.gpu-1"]
        rule = api.device_taint_rule(f"screener.{NODE}.gpu-1")
        assert rule["spec"]["taint"]["value"] == "WeightFingerprintMismatch"
        assert "alarm settled-1" in rule["metadata"]["annotations"]["screener.io/evidence"]
    finally:
        rig.close()


def test_a_failed_write_is_retried_on_the_next_pass(api, tmp_path):
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT))
    try:
        rig.tick()
        # Every attempt of the rule's create within its call (RetryPolicy().attempts): the API
        # out of reach for it, answering again by the next pass.
        from screener.settings.stores import RetryPolicy

        api.fail_next(RetryPolicy().attempts, status=503, verb="create",
                      resource="devicetaintrules")
        rig.tick(advance=3600.0)
        assert api.device_taint_rules == {} and rig.daemon.devices.pending
        rig.tick(advance=5.0)
        assert list(api.device_taint_rules) == [f"screener.{NODE}.gpu-1"]
        assert not rig.daemon.devices.pending
    finally:
        rig.close()


def test_a_gpu_in_mig_mode_has_each_of_its_mig_devices_tainted(tmp_path):
    with KubeAPI() as api:
        api.add_node(NODE)
        migs = [{"name": f"gpu-1-mig-9-{k}-4", "attributes": {
            "type": {"string": "mig"}, "uuid": {"string": f"MIG-{k}"},
            "parentUUID": {"string": uuid_of(1)}}} for k in (0, 4)]
        api.add_resource_slice(NODE, [gpu_device(0), *migs])
        rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT))
        try:
            rig.tick()
            rig.tick(advance=3600.0)
            assert sorted(api.device_taint_rules) == [f"screener.{NODE}.gpu-1-mig-9-0-4",
                                                      f"screener.{NODE}.gpu-1-mig-9-4-4"]
        finally:
            rig.close()


def test_slices_of_an_older_pool_generation_are_ignored():
    def sl(gen, devices):
        return {"spec": {"nodeName": NODE, "driver": DRIVER,
                         "pool": {"name": NODE, "generation": gen}, "devices": devices}}

    got = slice_devices([sl(1, [gpu_device(0)]), sl(2, [gpu_device(1, minor=7)])], NODE, DRIVER)
    assert got == [SliceDevice(DRIVER, NODE, "gpu-7", uuid=uuid_of(1))]


def test_cuda_n_maps_to_nvml_only_where_the_orders_agree():
    same = (GpuSnapshot(index=0, uuid="GPU-a", name="H100"), GpuSnapshot(index=1, uuid="GPU-b", name="H100"))
    mixed = (GpuSnapshot(index=0, uuid="GPU-a", name="H100"), GpuSnapshot(index=1, uuid="GPU-b", name="L4"))
    assert cuda_gpus(same, {})[0][1].uuid == "GPU-b"
    assert cuda_gpus(mixed, {}) [0] == {} and "CUDA_DEVICE_ORDER" in cuda_gpus(mixed, {})[1]
    assert cuda_gpus(mixed, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})[0][1].uuid == "GPU-b"
    assert cuda_gpus(same, {"CUDA_VISIBLE_DEVICES": "1"})[0] == {}


def test_every_body_meets_the_published_1_37_schema():
    device = SliceDevice(DRIVER, NODE, "gpu-1", uuid=uuid_of(1))
    body = rule_body(NODE, device, key=KEY, reason="KnownAnswerMismatch", gpu_uuid=uuid_of(1),
                     gpu_serial=serial_of(1), evidence="known-answer screen: cuda:1")
    validate_published(body)  # what the test server checks on every create, too
    validate_published({"apiVersion": "v1", "kind": "DeleteOptions",
                        "preconditions": {"uid": "u-1"}}, "deleteoptions", "meta-v1")
    long_pool = "n" * 250
    assert len(rule_name(long_pool, "gpu-1")) <= 253
    validate_published(rule_body(long_pool, SliceDevice(DRIVER, long_pool, "gpu-1"), key=KEY,
                                 reason="x", gpu_uuid="GPU-1"))
    # The check is live: a body the schema refuses is 422 at the test server.
    with KubeAPI() as api:
        store = KubeStore(api.api_client(), sleep=lambda s: None, instance="dra")
        bad = {**body, "spec": {**body["spec"], "taint": {**body["spec"]["taint"], "bogus": 1}}}
        from screener.stores.kube.calls import KubeApiError

        with pytest.raises(KubeApiError) as e:
            KubeDeviceTaints(store.calls, driver=DRIVER, taint_key=KEY).create(bad, device)
        assert e.value.status == 422
        store.close()


def test_a_refused_write_is_logged_and_not_repeated_on_every_pass(api, tmp_path, caplog):
    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT))
    try:
        rig.tick()
        api.fail_next(1, status=403, verb="create", resource="devicetaintrules")
        with caplog.at_level(logging.ERROR, logger="screener.daemon"):
            rig.tick(advance=3600.0)
            assert not rig.daemon.devices.pending  # a refusal is not retried
            rig.tick(advance=5.0)
        assert api.device_taint_rules == {}
        assert [c.status for c in dra_calls(api) if c.verb == "create"] == [403]
        assert len([r for r in caplog.records if "not tainted:" in r.getMessage()]) == 1
    finally:
        rig.close()


def test_a_pass_before_a_pending_taint_was_written_cancels_it(api, tmp_path):
    # The rule's create fails (the API out of reach), then the confirming screen passes the
    # device: no rule is written afterwards, and the pending taint is gone.
    from screener.settings.stores import RetryPolicy

    rig = rig_for(api, tmp_path, outcome(Outcome.PASS), screen(Outcome.SUSPECT),
                  screen(Outcome.PASS))
    try:
        rig.tick()
        api.fail_next(RetryPolicy().attempts, status=503, verb="create",
                      resource="devicetaintrules")
        rig.tick(advance=3600.0)
        assert rig.daemon.devices.to_taint
        rig.tick(advance=60.0)
        assert rig.daemon.state == NodeState.HEALTHY
        assert not rig.daemon.devices.pending and api.device_taint_rules == {}
    finally:
        rig.close()
