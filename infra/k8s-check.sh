#!/usr/bin/env bash
# Checks the Kubernetes manifests in k8s/ offline (no cluster needed):
#   1. renders the base, both overlays and both overlays with the ServiceMonitor component
#      (`kubectl kustomize`);
#   2. validates every rendered object against the Kubernetes OpenAPI schemas of
#      K8S_VERSION (kubernetes-validate, strict) and the custom resources against the CRD
#      schemas kept in k8s/crds/ (jsonschema);
#   3. holds the manifests to the code (infra/k8s_check.py: variables the services read, the
#      ports they listen on, probes, PDBs, headless Services, NetworkPolicies, autoscaling) and
#      to the release gates (readiness independent of peers, no mock model in prod, migrations
#      in init containers, memory request = limit, Pod Security "restricted" on every pod and
#      namespace, a Secret that rolls the pods, ingest's web egress without link-local),
#      after a self-test showing it catches deliberately broken manifests;
#   4. runs checkov (pinned, from PyPI, offline) over the dev and prod renders, with the
#      short skip list below, each skip with its reason.
#
# Usage: infra/k8s-check.sh            (from anywhere; exit status 0 when everything passes)
#
# Needs kubectl (for its built-in kustomize) and python3 with venv. It installs the pinned PyPI
# packages kubernetes-validate (with jsonschema and PyYAML) and checkov, each into a
# virtualenv under ${ECOSCAN_TOOLS_DIR:-$HOME/.cache/ecoscan-tools}, once.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

K8S_VERSION=1.32.0
KUBERNETES_VALIDATE_VERSION=1.37.0
CHECKOV_VERSION=3.3.30
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

CHECKOV_VENV="$TOOLS_DIR/checkov-$CHECKOV_VERSION"
if ! "$CHECKOV_VENV/bin/checkov" --version >/dev/null 2>&1; then
    say "installing checkov==$CHECKOV_VERSION into $CHECKOV_VENV"
    rm -rf "$CHECKOV_VENV"
    mkdir -p "$TOOLS_DIR"
    python3 -m venv "$CHECKOV_VENV" ||
        die "python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)"
    "$CHECKOV_VENV/bin/pip" install --quiet --disable-pip-version-check \
        "checkov==$CHECKOV_VERSION" ||
        { rm -rf "$CHECKOV_VENV"; die "could not install checkov from PyPI"; }
fi

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
    # Kustomize wants relative paths: from $dir to the rendered copy of k8s/ (with its secrets).
    local k8s
    k8s=$("$PYTHON" -c 'import os, sys; print(os.path.relpath(sys.argv[1], sys.argv[2]))' \
        "$out/k8s" "$dir")
    local overlay="$k8s/overlays/$1"
    cat >"$dir/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $overlay
components:
  - $k8s/components/servicemonitor
EOF
    render "$1+servicemonitor" "$dir"
}

# prod generates its Secret from secrets.env, and dev its gateway secrets from token-secret and
# identity-key, none of them ever committed: render a copy of k8s/ with the example's placeholder
# values in prod (or the operator's own secrets.env when present) and fresh dev secrets.
cp -r k8s "$out/k8s"
[[ -f "$out/k8s/overlays/prod/secrets.env" ]] ||
    cp k8s/overlays/prod/secrets.env.example "$out/k8s/overlays/prod/secrets.env"
for secret in token-secret identity-key; do
    [[ -f "$out/k8s/overlays/dev/$secret" ]] ||
        head -c 32 /dev/urandom | base64 | tr -d '\n' >"$out/k8s/overlays/dev/$secret"
done

render base k8s/base
render dev "$out/k8s/overlays/dev"
render prod "$out/k8s/overlays/prod"
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

# checkov's Kubernetes checks. Skipped, each for a stated reason (k8s/README.md, "Validation"):
#   CKV_K8S_43  image by digest: a release pins the digest with `kustomize edit set image`
#               (k8s/README.md, "Pinning the image"); the committed overlay names a tag.
#   CKV_K8S_15  imagePullPolicy Always: a pinned tag or digest does not move, so IfNotPresent
#               is right and starts faster.
#   CKV_K8S_35  secrets as files rather than environment variables: the services read their
#               settings from the environment only.
#   CKV2_K8S_6  a NetworkPolicy per pod: checkov does not see the namespace-wide default-deny
#               (podSelector {}) that covers every pod.
CHECKOV_SKIP=CKV_K8S_43,CKV_K8S_15,CKV_K8S_35,CKV2_K8S_6
for name in dev prod; do
    "$CHECKOV_VENV/bin/checkov" --framework kubernetes --skip-download --quiet --compact \
        --skip-check "$CHECKOV_SKIP" -f "$out/$name.yaml" >"$out/checkov-$name.txt" 2>&1 ||
        { cat "$out/checkov-$name.txt" >&2; die "checkov found problems in the $name render"; }
    say "checkov $CHECKOV_VERSION: $name: $(grep -m1 -o 'Passed checks: [0-9]*, Failed checks: [0-9]*, Skipped checks: [0-9]*' "$out/checkov-$name.txt" || echo 'no summary')"
done
say "passed"
