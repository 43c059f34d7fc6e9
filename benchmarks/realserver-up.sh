#!/usr/bin/env bash
# A standing etcd + kube-apiserver (1.28.7, built by ../shared/REAL-APISERVER.md) on 127.0.0.1:6443 for the
# benchmarks' --apiserver modes (benchmarks/realserver.py): token auth, admin token "screener-admin";
# manifests/ applied (policies as v1beta1), the budget record counted for $FLEET nodes. Fresh data each start. APISERVER, ETCD, KUBECTL: the binaries.
set -euo pipefail
W=${REALSERVER_DIR:-/tmp/screener-realserver}
APISERVER=${APISERVER:-/work/k8s/bin/kube-apiserver}
ETCD=${ETCD:-/work/k8s/etcdpkg/x/usr/bin/etcd}
pkill -f "$APISERVER" || true; pkill -f "$ETCD --data-dir" || true; sleep 1
rm -rf $W; mkdir -p $W
openssl genrsa -out $W/sa.key 2048 2>/dev/null
echo 'screener-admin,admin,admin-uid,"system:masters"' > $W/tokens.csv
"$ETCD" --data-dir $W/etcd --listen-client-urls http://127.0.0.1:2379 \
  --advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
  --quota-backend-bytes=8589934592 > $W/etcd.log 2>&1 &
sleep 1
"$APISERVER" --etcd-servers=http://127.0.0.1:2379 --secure-port=6443 \
  --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --cert-dir=$W/certs \
  --authorization-mode=Node,RBAC --token-auth-file=$W/tokens.csv \
  --service-account-issuer=https://kubernetes.default.svc --service-account-key-file=$W/sa.key \
  --service-account-signing-key-file=$W/sa.key --service-cluster-ip-range=10.96.0.0/12 \
  --endpoint-reconciler-type=none --max-requests-inflight=${INFLIGHT:-400} \
  --feature-gates=ValidatingAdmissionPolicy=true \
  --runtime-config=admissionregistration.k8s.io/v1beta1=true > $W/apiserver.log 2>&1 &
cat > $W/admin.kubeconfig <<K
apiVersion: v1
kind: Config
current-context: admin
clusters: [{name: t, cluster: {server: "https://127.0.0.1:6443", insecure-skip-tls-verify: true}}]
users: [{name: admin, user: {token: screener-admin}}]
contexts: [{name: admin, context: {cluster: t, user: admin}}]
K
K="${KUBECTL:-$(cd "$(dirname "$0")/.." && pwd)/.ci/bin/kubectl} --kubeconfig $W/admin.kubeconfig"
for i in $(seq 120); do $K get --raw /readyz >/dev/null 2>&1 && break; sleep 0.5; done
$K get --raw /readyz; echo
cd "$(dirname "$0")/.."
# The budget record counted for $FLEET nodes (a fleet as a running one leaves it), made by the
# admin before the lease policy's binding (whose parameter it is) is in place.
.venv/bin/python - > $W/manifests.json <<'P'
import sys, json, time; sys.path.insert(0, "tests")
import os; os.environ.setdefault("KUBEBUILDER_ASSETS", "")
import yaml
from test_admission_apiserver import _manifests
from screener.stores.kube import formats as kf
docs = [d for d in yaml.safe_load_all(_manifests(28)) if d]
lease = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding" and d["metadata"]["name"] == "screener-budget-lease"]
rest = [d for d in docs if d not in lease]
rec = kf.BudgetRecord(fleet=int(os.environ.get("FLEET", "600")), counted=time.time()).configmap("screener-system")
json.dump({"rest": {"apiVersion": "v1", "kind": "List", "items": rest}, "record": rec, "lease": {"apiVersion": "v1", "kind": "List", "items": lease}}, sys.stdout)
P
for part in rest record lease; do
  .venv/bin/python -c "import json,sys; print(json.dumps(json.load(open('$W/manifests.json'))['$part']))" | $K apply -f - >/dev/null
done
$K get validatingadmissionpolicies -o name | wc -l
echo up
