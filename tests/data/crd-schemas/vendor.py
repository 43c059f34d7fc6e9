"""Re-vendor the CRD schemas the placement examples are validated against (tests/test_placement.py).

    python tests/data/crd-schemas/vendor.py JOBSET_GIT_DIR KUEUE_GIT_DIR

Each argument is a clone (or bare mirror) of github.com/kubernetes-sigs/jobset and
github.com/kubernetes-sigs/kueue. For each CRD below it reads the published CRD at the pinned
release tag (config/components/crd/bases/), keeps the openAPIV3Schema of one served version and
drops the `description` texts (three quarters of the bytes, no part of validation), and writes
<kind>.<group>.<version>.json with the tag, the commit and the path it came from. To move to a
newer release, change the tags here, run it, and run the placement tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
# (repository argument index, tag, CRD file, version to keep)
CRDS = [
    (0, "v0.12.0", "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml", "v1alpha2"),
    (1, "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_resourceflavors.yaml", "v1beta2"),
    (1, "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_clusterqueues.yaml", "v1beta2"),
    (1, "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_localqueues.yaml", "v1beta2"),
    (1, "v0.19.2", "config/components/crd/bases/kueue.x-k8s.io_topologies.yaml", "v1beta2"),
]
REPOS = ("kubernetes-sigs/jobset", "kubernetes-sigs/kueue")


def _strip(o: Any) -> Any:
    if isinstance(o, dict):
        return {k: _strip(v) for k, v in o.items() if k != "description"}
    if isinstance(o, list):
        return [_strip(v) for v in o]
    return o


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for idx, tag, path, version in CRDS:
        git = ["git", "-C", argv[idx]]
        commit = subprocess.run([*git, "rev-parse", f"{tag}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
        crd = yaml.safe_load(subprocess.run([*git, "show", f"{commit}:{path}"], check=True,
                                            capture_output=True, text=True).stdout)
        (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
        assert ver["served"], (path, version)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        out = {
            "source": {"repository": f"github.com/{REPOS[idx]}", "tag": tag, "commit": commit,
                       "path": path, "version": version, "scope": crd["spec"]["scope"],
                       "note": "openAPIV3Schema of this version, description texts dropped"},
            "apiVersion": f"{group}/{version}",
            "kind": kind,
            "schema": _strip(ver["schema"]["openAPIV3Schema"]),
        }
        dest = HERE / f"{kind}.{group}.{version}.json"
        dest.write_text(json.dumps(out, sort_keys=True, separators=(",", ":")) + "\n")
        print(f"{dest.name}: {tag} {commit[:12]} ({dest.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
