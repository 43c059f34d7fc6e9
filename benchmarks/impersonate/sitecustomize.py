"""For benchmarks/realserver.py's children only (on their PYTHONPATH when they run against a real
kube-apiserver): every kubernetes ApiClient the child makes (with the admin token of its
kubeconfig) impersonates the DaemonSet's service account with the node claim of $SCREENER_BENCH_NODE, and each request
is appended to $SCREENER_BENCH_COUNTS as one JSON line (method, path, status). The kubernetes
client reads no impersonation from a kubeconfig, which is why this sits at its boundary."""

import json
import os
import time

if os.environ.get("SCREENER_BENCH_NODE"):
    import kubernetes.client

    _node = os.environ["SCREENER_BENCH_NODE"]
    _counts = os.environ.get("SCREENER_BENCH_COUNTS", "")
    _init, _request = kubernetes.client.ApiClient.__init__, kubernetes.client.ApiClient.request

    def __init__(self, configuration=None, *args, **kwargs):  # noqa: N807
        _init(self, configuration, *args, **kwargs)
        self.set_default_header("Impersonate-User",
                                "system:serviceaccount:screener-system:screener")
        self.set_default_header("Impersonate-Extra-authentication.kubernetes.io%2fnode-name",
                                _node)

    def request(self, method, url, *args, **kwargs):
        status, t0 = 0, time.perf_counter()
        try:
            out = _request(self, method, url, *args, **kwargs)
            status = getattr(out, "status", 200)
            return out
        except kubernetes.client.ApiException as e:
            status = int(e.status or 0)
            raise
        finally:
            if _counts:
                path = "/" + url.split("://", 1)[-1].split("/", 1)[-1].split("?", 1)[0]
                with open(_counts, "a") as f:
                    f.write(json.dumps([method, path, status,
                                        round(time.perf_counter() - t0, 4)]) + "\n")

    kubernetes.client.ApiClient.__init__ = __init__
    kubernetes.client.ApiClient.request = request
