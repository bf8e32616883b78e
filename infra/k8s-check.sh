#!/usr/bin/env bash
# Checks the Kubernetes manifests in k8s/ offline (no cluster needed):
#   1. renders the base, both overlays and both overlays with the ServiceMonitor component
#      (`kubectl kustomize`);
#   2. validates every rendered object against the Kubernetes OpenAPI schemas of
#      K8S_VERSION (kubernetes-validate, strict) and the custom resources against the CRD
#      schemas kept in k8s/crds/ (jsonschema);
#   3. holds the manifests to the code (infra/k8s_check.py: variables the services read, the
#      ports they listen on, probes, PDBs, headless Services, NetworkPolicies, autoscaling),
#      after a self-test showing it catches deliberately broken manifests.
#
# Usage: infra/k8s-check.sh            (from anywhere; exit status 0 when everything passes)
#
# Needs kubectl (for its built-in kustomize) and python3 with venv. The one thing it installs
# is the pinned PyPI package kubernetes-validate (with jsonschema and PyYAML), into a
# virtualenv under ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}, once.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

K8S_VERSION=1.32.0
KUBERNETES_VALIDATE_VERSION=1.37.0
TOOLS_DIR="${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}"
VENV="$TOOLS_DIR/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION"

say() { echo "k8s-check: $*"; }
die() { echo "k8s-check: $*" >&2; exit 1; }

if ! command -v kubectl >/dev/null; then
    die "kubectl is not installed. Install it (apt-get install kubectl from the Kubernetes apt
repository, or the binary: https://kubernetes.io/docs/tasks/tools/) and run again; this
script downloads nothing but the PyPI package kubernetes-validate."
fi

if ! "$VENV/bin/python" -c 'import kubernetes_validate, jsonschema, yaml' 2>/dev/null; then
    command -v python3 >/dev/null || die "python3 is not installed"
    say "installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION into $VENV"
    rm -rf "$VENV"
    mkdir -p "$TOOLS_DIR"
    python3 -m venv "$VENV" ||
        die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check \
        "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" ||
        { rm -rf "$VENV"; die "could not install kubernetes-validate from PyPI"; }
fi
PYTHON="$VENV/bin/python"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

render() { # name kustomization-dir
    kubectl kustomize "$2" >"$out/$1.yaml" 2>"$out/$1.err" ||
        { cat "$out/$1.err" >&2; die "kubectl kustomize $2 failed"; }
}

# An overlay with the optional ServiceMonitor component, from a kustomization outside the
# tree (kustomize takes only relative paths).
render_with_servicemonitor() { # overlay
    local dir="$out/$1+servicemonitor"
    mkdir -p "$dir"
    local k8s
    k8s=$("$PYTHON" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' \
        "$PWD/k8s" "$dir")
    cat >"$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $k8s/overlays/$1
components:
  - $k8s/components/servicemonitor
EOF
    render "$1+servicemonitor" "$dir"
}

# The dev overlay's gateway secret is made by whoever deploys and never committed: a fresh one
# to render with when there is none.
for secret in token-secret identity-key; do
    [[ -f "k8s/overlays/dev/$secret" ]] ||
        head -c 32 /dev/urandom | base64 | tr -d '\n' >"k8s/overlays/dev/$secret"
done
render base k8s/base
render dev k8s/overlays/dev
render prod k8s/overlays/prod
render_with_servicemonitor dev
render_with_servicemonitor prod
say "rendered base, dev, prod, dev+servicemonitor, prod+servicemonitor ($(kubectl version --client 2>/dev/null | grep -i kustomize || echo 'kubectl kustomize'))"

renders=()
for name in base dev prod dev+servicemonitor prod+servicemonitor; do
    renders+=("$name=$out/$name.yaml")
done

"$PYTHON" infra/k8s_check.py --kubernetes-version "$K8S_VERSION" --self-test "${renders[@]}" ||
    die "self-test failed: infra/k8s_check.py misses a broken manifest (see above)"
"$PYTHON" infra/k8s_check.py --kubernetes-version "$K8S_VERSION" "${renders[@]}" ||
    die "FAILED (see the problems above)"
say "passed"
