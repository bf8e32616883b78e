#!/usr/bin/env python3
"""Offline checks of the Kubernetes manifests in k8s/, holding them to the code.

Run by infra/k8s-check.sh, which renders the kustomizations and installs the one dependency
(the PyPI package kubernetes-validate, which brings jsonschema and PyYAML). By hand:

    python3 infra/k8s_check.py NAME=rendered.yaml ...     # check rendered manifests
    python3 infra/k8s_check.py --self-test NAME=...        # prove the checks catch breakage

NAME says what was rendered: `base`, `dev`, `prod`, or `<overlay>+servicemonitor`; names
containing `dev` or `prod` get that overlay's extra checks.

What is checked, per rendered set:

1. Schemas. Every built-in object against the Kubernetes OpenAPI schema of the pinned version
   (kubernetes-validate, strict: unknown fields are errors). Every custom resource (KEDA
   ScaledObject/TriggerAuthentication, ServiceMonitor) against the CRD schema kept in k8s/crds/,
   with unknown fields rejected as `kubectl apply` (strict field validation) does, and its
   metadata against ObjectMeta. Objects of a kind with no schema fail.
2. The code. The environment variables each service reads are collected from the Rust sources
   (string literals and constants passed to env_opt/env_or/env_duration/env_addr/std::env::var,
   clap `env = "…"`, RUST_LOG where tracing's EnvFilter reads its default variable), per crate,
   and a service may be given only what its crate, the crates it depends on and the `ecoscan`
   binary read, plus the OpenTelemetry SDK's variables. Listen addresses come from `addr_var`
   and `Ports::DEFAULT` in services/suite/src/lib.rs.
3. Each ecoscan workload (a container whose image is `ecoscan`, run as `serve <service>` or
   `migrate`): its variables (as above; configMapKeyRef/secretKeyRef keys exist when the
   ConfigMap/Secret is part of the render), its listen address (set, not loopback), container
   port, probes (liveness and readiness, plus startup and native gRPC probes on gRPC services)
   on the port it listens on, requests and limits, a PodDisruptionBudget, the hardening
   (non-root, read-only root, no privilege escalation, capabilities dropped, writable /tmp,
   no service-account token), its Service (headless for gRPC services, ports that reach the
   listen port).
4. Who talks to whom. Each `<SERVICE>_URL` a workload sets must name a Service of the render on
   the target's port, and the NetworkPolicies must let exactly the services that set it reach
   the target (and nothing outside the namespace, except the gateway); each store, collector
   and model endpoint a workload is configured with must be reachable through its egress policy.
5. Autoscaling and overlays: HPAs (autoscaling/v2, CPU) for the stateless services, a KEDA
   redis-streams ScaledObject for ingest on the stream and consumer group the code uses, and
   one for the gateway on CPU and on its open event streams (a Prometheus query of a gauge the
   gateway exports); in
   prod, at least two replicas, a pinned image, spreading over zones and hosts and an Ingress;
   in dev, no KEDA objects (no KEDA on a local cluster); with ServiceMonitors, one per Service
   on the metrics port.

Exit status 0 when everything passes, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import base64
import copy
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from k8s_pss import restricted_violations  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_K8S_VERSION = "1.32.0"

# Read by the OpenTelemetry SDK and OTLP exporter (opentelemetry_sdk / opentelemetry-otlp 0.33,
# traces only), not by ecoscan's own code.
OTEL_SDK_VARS = {
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_SCHEDULE_DELAY",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_QUEUE_SIZE",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_BSP_MAX_CONCURRENT_EXPORTS",
    "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
    "OTEL_SPAN_EVENT_COUNT_LIMIT",
    "OTEL_SPAN_LINK_COUNT_LIMIT",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SERVICE_NAME",
}

# Services scaled on CPU by an HPA, the one KEDA scales on its queue, and the one KEDA scales on
# its open event streams (and CPU).
HPA_SERVICES = {"vision", "rule", "answer", "reward", "analytics"}
KEDA_SERVICE = "ingest"
KEDA_STREAMS_SERVICE = "gateway"
# The gauge of open SSE streams the gateway exports, which its ScaledObject's query must name.
SSE_GAUGE = "gateway_sse_connections"

# Ports a store setting needs when its value is not in the render (prod: the Secret the
# operator creates).
STORE_PORTS = {
    "REDIS_URL": [6379],
    "DATABASE_URL": [5432],
    "S3_ENDPOINT": [443, 9000],
    "OTEL_EXPORTER_OTLP_ENDPOINT": [4317],
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": [4317],
    "LLM_BASE_URL": [443],
}
DEFAULT_SCHEME_PORTS = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379,
                        "postgres": 5432, "postgresql": 5432}


def store_var(name: str) -> str | None:
    if name in STORE_PORTS:
        return name
    if name.endswith("_DATABASE_URL"):
        return "DATABASE_URL"
    return None


# ----------------------------------------------------------------------------------------------
# What the code reads
# ----------------------------------------------------------------------------------------------

# Every variable the code reads, one per line: the services refuse an unknown variable of their
# own prefixes at start (ecoscan_common::config::check_unknown_variables), so it must stay exact.
ENV_REGISTRY = REPO / "services/common/src/known_env.txt"

ENV_CALL = re.compile(
    r"\b(?:env_opt|env_or|env_duration|env_addr|env::var_os|env::var)\s*\(\s*"
    r"(?:\"([A-Za-z_][A-Za-z0-9_]*)\"|([A-Z][A-Z0-9_]*)\s*[,)])"
)
CLAP_ENV = re.compile(r"\benv\s*=\s*\"([A-Za-z_][A-Za-z0-9_]*)\"")
# ecoscan_common::binary::bind(service, VAR, default): a listen address read from VAR.
BIND_CALL = re.compile(r"\bbind\(\s*\"[^\"]*\",\s*\"([A-Z][A-Z0-9_]*)\"")
CONST_STR = re.compile(r"\bconst\s+([A-Z][A-Z0-9_]*)\s*:\s*&(?:'static\s+)?str\s*=\s*\"([^\"]*)\"\s*;")
DEFAULT_ENV_FILTER = re.compile(r"\b(?:try_)?from_default_env\s*\(")
TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{")


@dataclass
class CodeFacts:
    services: list[str]                    # gateway, ingest, …
    addr_var: dict[str, str]               # service -> INGEST_ADDR
    default_port: dict[str, int]
    default_host: str
    reads: dict[str, set[str]]             # service -> variables it reads
    reads_anywhere: set[str]               # services/**/*.rs and gateway/src/**/*.rs
    where_read: dict[str, set[str]]        # variable -> crates reading it
    dispatch_stream: str
    dispatch_group: str
    has_migrate: bool
    # Whether the gateway registers the SSE gauge its ScaledObject scales on.
    exports_sse_gauge: bool = False
    # Services with PostgreSQL migrations (services/<svc>/migrations): each Deployment of one
    # runs `ecoscan migrate <svc>` as an init container.
    db_services: list[str] = field(default_factory=list)
    # The gateway's admin listener (/readyz, /metrics): its variable and default port.
    admin_var: str = "GATEWAY_ADMIN_ADDR"
    # Problems found in the code itself (a readiness handler that calls a backend).
    code_problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def grpc_services(self) -> list[str]:
        return [s for s in self.services if s != "gateway"]


def _source_files(crate_dir: Path) -> list[Path]:
    """A crate's non-test sources: src/**/*.rs without `testing.rs` modules."""
    return sorted(p for p in (crate_dir / "src").rglob("*.rs")
                  if p.name != "testing.rs" and "tests" not in p.relative_to(crate_dir).parts)


def _strip_tests(text: str) -> str:
    m = TEST_MODULE.search(text)
    return text[: m.start()] if m else text


def _vars_in(files: list[Path]) -> set[str]:
    texts = [_strip_tests(p.read_text()) for p in files]
    return _vars_in_texts(texts, texts)


def _vars_in_texts(texts: list[str], const_texts: list[str]) -> set[str]:
    consts = {}
    for t in const_texts:
        consts.update(dict(CONST_STR.findall(t)))
    names: set[str] = set()
    for t in texts:
        for lit, ident in ENV_CALL.findall(t):
            if lit:
                names.add(lit)
            elif ident in consts:
                names.add(consts[ident])
        names.update(CLAP_ENV.findall(t))
        names.update(BIND_CALL.findall(t))
        if DEFAULT_ENV_FILTER.search(t):
            names.add("RUST_LOG")  # tracing_subscriber::EnvFilter::DEFAULT_ENV
    # TEST_* variables steer test harnesses (e.g. TEST_LOG in init_for_tests), not services.
    return {n for n in names if not n.startswith("TEST_")}


def _fn_body(text: str, name: str) -> str:
    m = re.search(r"fn\s+" + name + r"\s*\([^)]*\)[^{]*\{", text)
    if not m:
        raise SystemExit(f"k8s_check: cannot find `fn {name}` in services/suite/src; the code "
                         "changed shape, update read_code() in infra/k8s_check.py")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end(): i - 1]


def read_code(repo: Path = REPO) -> CodeFacts:
    root = (repo / "Cargo.toml").read_text()
    crate_dirs = {n: repo / p for n, p in
                  re.findall(r"^(ecoscan[-\w]*)\s*=\s*\{\s*path\s*=\s*\"([^\"]+)\"", root, re.M)}

    def deps(crate: str) -> set[str]:
        text = (crate_dirs[crate] / "Cargo.toml").read_text()
        m = re.search(r"^\[dependencies\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        return set(re.findall(r"^(ecoscan[-\w]*)(?:\.workspace)?\s*=", m.group(1), re.M)) if m else set()

    def closure(crate: str) -> set[str]:
        seen, todo = set(), [crate]
        while todo:
            c = todo.pop()
            if c not in seen and c in crate_dirs:
                seen.add(c)
                todo.extend(deps(c))
        return seen

    # Build-script helpers (ecoscan-sql-build) run in cargo, not in a service: what they read
    # (OUT_DIR, CARGO_MANIFEST_DIR) is cargo's, not a setting.
    crate_reads = {c: _vars_in(_source_files(d)) for c, d in crate_dirs.items()
                   if (d / "src").is_dir() and not c.endswith("-build")}
    where_read: dict[str, set[str]] = {}
    for c, names in crate_reads.items():
        for n in names:
            where_read.setdefault(n, set()).add(c)

    # The suite's crate root (ports) and its `serve` module (each service alone).
    suite = "\n".join((repo / "services/suite/src" / f).read_text() for f in ("lib.rs", "serve.rs"))
    names = dict(re.findall(r"Self::(\w+)\s*=>\s*\"([a-z]+)\"", _fn_body(suite, "name")))
    addr = dict(re.findall(r"Self::(\w+)\s*=>\s*\"([A-Z0-9_]+)\"", _fn_body(suite, "addr_var")))
    fields = dict(re.findall(r"Self::(\w+)\s*=>\s*p\.(\w+)", _fn_body(suite, "default_port")))
    m = re.search(r"const DEFAULT: Self = Self \{(.*?)\};", suite, re.S)
    ports = {k: int(v) for k, v in re.findall(r"(\w+):\s*(\d+)", m.group(1))} if m else {}
    serve_one = _fn_body(suite, "serve_one")
    crate_of = {v: c.replace("_", "-") for v, c in re.findall(
        r"Service::(\w+)\s*=>\s*\{?\s*(?:let\s+\w+\s*=\s*)?(ecoscan_\w+)::", serve_one)}
    host = re.search(r"format!\(\"([^:\"]+):\{\}\",\s*service\.default_port\(\)\)", serve_one)
    if not (names and ports) or any(v not in addr or v not in fields or v not in crate_of
                                    or fields[v] not in ports for v in names):
        raise SystemExit("k8s_check: cannot read the services, their address variables, default "
                         "ports and crates from services/suite/src/{lib,serve}.rs (Service::name, "
                         "addr_var, default_port, Ports::DEFAULT, serve_one); the code changed "
                         "shape, update read_code() in infra/k8s_check.py")

    facts_services, addr_var, default_port, reads = [], {}, {}, {}
    # What the `ecoscan` binary itself reads on the `serve` path (serve_one and the command
    # line's `serve`, in command.rs: main.rs only calls it); the rest of the crate (clap's
    # ECOSCAN_* flags, SuiteConfig) is `ecoscan up`.
    main_rs = (repo / "services/suite/src/command.rs").read_text()
    binary = _vars_in_texts([serve_one, _fn_body(main_rs, "serve")], [suite, main_rs])
    for variant, svc in names.items():
        facts_services.append(svc)
        addr_var[svc] = addr[variant]
        default_port[svc] = ports[fields[variant]]
        crates = closure(crate_of[variant]) - {"ecoscan"}
        reads[svc] = set().union(*(crate_reads.get(c, set()) for c in crates)) | binary \
            | OTEL_SDK_VARS | {addr[variant]}

    redis_rs = (repo / "services/ingest/src/store/redis/queue.rs").read_text()
    group = re.search(r"const GROUP: &str = \"([^\"]+)\";", redis_rs)
    stream = re.search(r"format!\(\"\{prefix\}([^\"]+dispatch)\"\)", redis_rs)
    if not (group and stream):
        raise SystemExit("k8s_check: cannot find the dispatch stream and consumer group in "
                         "services/ingest/src/store/redis/queue.rs; update k8s_check.py")
    has_migrate = re.search(r"^\s*Migrate\b", main_rs, re.M) is not None
    anywhere = set().union(*(v for c, v in crate_reads.items() if c != "ecoscan-bench"))
    facts = CodeFacts(
        services=sorted(facts_services, key=lambda s: (s == "gateway", default_port[s])),
        addr_var=addr_var, default_port=default_port,
        default_host=host.group(1) if host else "127.0.0.1",
        reads=reads, reads_anywhere=anywhere | OTEL_SDK_VARS | set(addr_var.values()),
        where_read=where_read,
        dispatch_stream=stream.group(1), dispatch_group=group.group(1), has_migrate=has_migrate,
        exports_sse_gauge=f'"{SSE_GAUGE}"' in (repo / "gateway/src/metrics.rs").read_text())
    if not has_migrate:
        facts.notes.append("`ecoscan migrate` is not in services/suite/src/command.rs yet; the "
                           "migration init container's command is accepted as announced")
    facts.db_services = sorted(s for s in facts_services
                               if (repo / "services" / s / "migrations").is_dir())
    # Readiness is a process's own state: the gateway's /readyz handler must not call a
    # backend (a backend's outage would take every gateway replica out of the Service).
    health = (repo / "gateway/src/routes/health.rs").read_text()
    readyz = _fn_body(health, "readyz")
    for sign in ("Client", ".check(", "channel", "join_all", ".await"):
        if sign in readyz:
            facts.code_problems.append(
                f"gateway/src/routes/health.rs: readyz contains `{sign}`: readiness must not "
                "wait on a backend (backend health belongs in gateway_backend_up)")
    return facts


# ----------------------------------------------------------------------------------------------
# Schemas
# ----------------------------------------------------------------------------------------------

class Schemas:
    def __init__(self, k8s_version: str, crd_dir: Path):
        import jsonschema
        import kubernetes_validate
        import kubernetes_validate.utils as kv_utils
        from referencing import Registry, Resource

        self.jsonschema = jsonschema
        self.kv = kubernetes_validate
        self.kv_utils = kv_utils
        # kubernetes-validate reads and parses a schema file per object; parse each once.
        kv_utils.schema_contents = functools.lru_cache(maxsize=None)(kv_utils.schema_contents)
        self.version = k8s_version
        mm = kv_utils.major_minor(k8s_version)
        versions = [v for v in kv_utils.all_versions()
                    if kv_utils.Version(v) <= kv_utils.Version(mm + ".999")]
        if not versions:
            raise SystemExit(f"k8s_check: kubernetes-validate has no schemas for {k8s_version}")
        self.schema_version = versions[-1]
        defs = kv_utils.schema_contents(
            f"kubernetes-json-schema/v{self.schema_version}-local-strict/_definitions.json",
            k8s_version)
        registry = Resource.from_contents(defs) @ Registry()
        self.object_meta = jsonschema.Draft202012Validator(
            {"$ref": defs["$id"] + "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
            registry=registry)
        self.crds: dict[tuple[str, str], object] = {}
        self.crd_files: list[tuple[Path, dict]] = []
        for path in sorted(crd_dir.glob("*.yaml")):
            for crd in yaml.safe_load_all(path.read_text()):
                if not crd:
                    continue
                self.crd_files.append((path, crd))
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for v in crd["spec"]["versions"]:
                    schema = _strict_crd_schema(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
                    self.crds[(f"{group}/{v['name']}", kind)] = \
                        jsonschema.Draft7Validator(schema)
        self._cache: dict[str, list[str]] = {}

    def validate(self, obj: dict) -> list[str]:
        key = hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        if key not in self._cache:
            self._cache[key] = self._validate(obj)
        return self._cache[key]

    def _validate(self, obj: dict) -> list[str]:
        api, kind = obj.get("apiVersion", ""), obj.get("kind", "")
        if (api, kind) in self.crds:
            errs = [f"{_path(e)}: {e.message} (CRD schema in k8s/crds)"
                    for e in self.crds[(api, kind)].iter_errors(obj)]
            errs += [f"metadata.{_path(e)}: {e.message}"
                     for e in self.object_meta.iter_errors(obj.get("metadata", {}))]
            errs += _crd_cel_rules(obj)
            return errs
        try:
            self.kv.validate(obj, self.version, strict=True)
            return []
        except self.kv.ValidationError as e:
            return [f"{_path(e)}: {e.message} (Kubernetes {self.schema_version} schema, strict)"]
        except self.kv_utils.SchemaNotFoundError:
            return [f"no schema for {api} {kind}: not a Kubernetes {self.version} kind and no "
                    f"CRD for it in k8s/crds"]


def _path(e) -> str:
    return ".".join(str(p) for p in e.absolute_path) or "(object)"


def _strict_crd_schema(s):
    """Unknown fields are errors, as with kubectl's default strict field validation (the API
    server prunes or rejects fields a structural schema does not list)."""
    if isinstance(s, dict):
        if "properties" in s and "additionalProperties" not in s \
                and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
        for k in ("properties", "patternProperties"):
            for v in s.get(k, {}).values():
                _strict_crd_schema(v)
        for k in ("items", "additionalProperties", "not"):
            if isinstance(s.get(k), dict):
                _strict_crd_schema(s[k])
        for k in ("anyOf", "allOf", "oneOf"):
            for v in s.get(k, []):
                _strict_crd_schema(v)
    return s


def _crd_cel_rules(obj: dict) -> list[str]:
    """The x-kubernetes-validations (CEL) rules of the kept CRDs, which jsonschema cannot run."""
    errs = []
    if obj.get("kind") == "ScaledObject":
        spec = obj.get("spec", {})
        if "minReplicaCount" in spec and spec["minReplicaCount"] > spec.get("maxReplicaCount", 100):
            errs.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    return errs


# ----------------------------------------------------------------------------------------------
# Rendered manifests
# ----------------------------------------------------------------------------------------------

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}


def obj_id(o: dict) -> str:
    return f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"


def image_repo(image: str) -> str:
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return last.split(":", 1)[0]


def image_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    last = image.rsplit("/", 1)[-1]
    return ":" in last and last.split(":", 1)[1] not in ("", "latest")


def parse_quantity(q) -> float:
    """A Kubernetes quantity (`256Mi`, `1G`, `500m`, `2`) as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12, "m": 1e-3}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    if not m or m.group(2) not in units and m.group(2):
        raise ValueError(f"bad quantity {q!r}")
    return float(m.group(1)) * units.get(m.group(2), 1)


def selector_matches(sel: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels/matchExpressions); an empty one matches everything."""
    if sel is None:
        return False
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and k in labels and labels[k] in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


@dataclass
class Pod:
    """The pod template of a workload."""
    owner: dict
    ns: str
    labels: dict
    spec: dict

    @property
    def id(self) -> str:
        return obj_id(self.owner)

    def containers(self):
        return self.spec.get("containers", [])

    def init_containers(self):
        return self.spec.get("initContainers", []) or []

    def port_by_name(self, name: str) -> int | None:
        for c in self.containers():
            for p in c.get("ports", []):
                if p.get("name") == name:
                    return p["containerPort"]
        return None


@dataclass
class Workload:
    pod: Pod
    container: dict
    command: str          # "serve" or "migrate"
    service: str | None   # for serve
    env: dict             # name -> source tuple
    listen_port: int | None = None
    admin_port: int | None = None      # the gateway's admin listener
    migrates: list[str] = field(default_factory=list)  # for migrate: the services named
    init: bool = False    # an init container


class Render:
    def __init__(self, name: str, docs: list[dict]):
        self.name = name
        self.docs = [d for d in docs if d]
        self.ns_default = ""
        for d in self.docs:
            if d.get("kind") == "Namespace":
                self.ns_default = d["metadata"]["name"]

    def ns(self, o: dict) -> str:
        return o.get("metadata", {}).get("namespace", self.ns_default)

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str, ns: str | None = None) -> dict | None:
        for d in self.of(kind):
            if d["metadata"]["name"] == name and (ns is None or self.ns(d) == ns):
                return d
        return None

    def pods(self) -> list[Pod]:
        out = []
        for d in self.docs:
            if d.get("kind") in WORKLOAD_KINDS:
                t = d.get("spec", {}).get("template", {})
                out.append(Pod(d, self.ns(d), t.get("metadata", {}).get("labels", {}) or {},
                               t.get("spec", {})))
        return out

    def secret_data(self, name: str, ns: str) -> dict | None:
        s = self.get("Secret", name, ns)
        if s is None:
            return None
        data = {k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()}
        data.update(s.get("stringData") or {})
        return data

    def configmap_data(self, name: str, ns: str) -> dict | None:
        c = self.get("ConfigMap", name, ns)
        return None if c is None else dict(c.get("data") or {})


# ----------------------------------------------------------------------------------------------
# NetworkPolicy evaluation (one namespace; enough for the policies this project writes)
# ----------------------------------------------------------------------------------------------

class Net:
    def __init__(self, r: Render):
        self.r = r
        self.policies = r.of("NetworkPolicy")

    @staticmethod
    def types(p: dict) -> list[str]:
        spec = p.get("spec", {})
        return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))

    def selecting(self, pod: Pod, ptype: str) -> list[dict]:
        return [p for p in self.policies if self.r.ns(p) == pod.ns
                and ptype in self.types(p)
                and selector_matches(p["spec"].get("podSelector", {}), pod.labels)]

    @staticmethod
    def _port_ok(rule: dict, port: int, dst: Pod | None) -> bool:
        ports = rule.get("ports")
        if not ports:
            return True
        for p in ports:
            if p.get("protocol", "TCP") != "TCP":
                continue
            want = p.get("port")
            if want is None:
                return True
            if isinstance(want, str):
                want = dst.port_by_name(want) if dst else None
            if want is not None and (want == port or want <= port <= p.get("endPort", want)):
                return True
        return False

    def _peer_is_pod(self, peer: dict, ns: str, pod: Pod) -> bool:
        if "ipBlock" in peer:
            return False
        nss = peer.get("namespaceSelector")
        if nss is not None and not selector_matches(
                nss, {"kubernetes.io/metadata.name": pod.ns} if pod.ns else {}):
            return False
        if nss is None and pod.ns != ns:
            return False
        return selector_matches(peer.get("podSelector", {}), pod.labels)

    def ingress_allows(self, dst: Pod, src: Pod, port: int) -> bool:
        pols = self.selecting(dst, "Ingress")
        if not pols:
            return True
        for p in pols:
            for rule in p["spec"].get("ingress") or []:
                peers = rule.get("from")
                if (not peers or any(self._peer_is_pod(x, dst.ns, src) for x in peers)) \
                        and self._port_ok(rule, port, dst):
                    return True
        return False

    def egress_allows(self, src: Pod, dst: Pod | None, port: int) -> bool:
        """dst None: a destination outside the namespace or the cluster."""
        pols = self.selecting(src, "Egress")
        if not pols:
            return True
        for p in pols:
            for rule in p["spec"].get("egress") or []:
                peers = rule.get("to")
                if peers:
                    if dst is None:
                        ok = any("ipBlock" in x or "namespaceSelector" in x for x in peers)
                    else:
                        ok = any(self._peer_is_pod(x, src.ns, dst) for x in peers)
                    if not ok:
                        continue
                if self._port_ok(rule, port, dst):
                    return True
        return False

    def open_outside(self, dst: Pod, port: int, pinned_too: bool = False) -> list[str]:
        """Policies admitting traffic from outside the namespace to dst:port; unless
        pinned_too, not counting peers that name one workload of one namespace (Prometheus)."""
        out = []
        for p in self.selecting(dst, "Ingress"):
            for rule in p["spec"].get("ingress") or []:
                if not self._port_ok(rule, port, dst):
                    continue
                peers = rule.get("from")
                if not peers:
                    out.append(obj_id(p))
                    continue
                for x in peers:
                    nss = x.get("namespaceSelector")
                    pinned = nss is not None and (nss.get("matchLabels") or nss.get(
                        "matchExpressions")) and (x.get("podSelector") or {}) != {}
                    if "ipBlock" in x or (nss is not None and (pinned_too or not pinned)):
                        out.append(obj_id(p))
        return out


# ----------------------------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------------------------

class Checker:
    def __init__(self, r: Render, code: CodeFacts, schemas: Schemas | None):
        self.r, self.code, self.schemas = r, code, schemas
        self.errors: list[str] = []
        self.stats: dict[str, int] = {}
        self.expected_secrets: dict[str, dict[str, bool]] = {}  # name -> key -> optional
        self.net = Net(r)

    def err(self, obj: dict | str, msg: str):
        self.errors.append(f"{self.r.name}: {obj if isinstance(obj, str) else obj_id(obj)}: {msg}")

    def count(self, what: str, n: int = 1):
        self.stats[what] = self.stats.get(what, 0) + n

    # -- 1. schemas --------------------------------------------------------------------------
    def check_schemas(self):
        if self.schemas is None:
            return
        for o in self.r.docs:
            for e in self.schemas.validate(o):
                self.err(o, e)
            self.count("objects validated")
            if (o.get("apiVersion"), o.get("kind")) in self.schemas.crds:
                self.count("custom resources validated against k8s/crds")

    # -- 3. workloads -------------------------------------------------------------------------
    def workloads(self) -> list[Workload]:
        out = []
        for pod in self.r.pods():
            for init, c in [(False, c) for c in pod.containers()] + \
                    [(True, c) for c in pod.init_containers()]:
                if image_repo(c.get("image", "")) != "ecoscan":
                    continue
                argv = (c.get("command") or []) + (c.get("args") or [])
                if c.get("command"):
                    self.err(pod.owner, "sets `command`; the image's entrypoint is `ecoscan`, "
                             "give `args` only")
                env = self.env_of(pod, c)
                if not init and len(argv) == 2 and argv[0] == "serve" \
                        and argv[1] in self.code.services:
                    out.append(Workload(pod, c, "serve", argv[1], env))
                elif argv[:1] == ["migrate"] and all(a in self.code.db_services
                                                    for a in argv[1:]):
                    out.append(Workload(pod, c, "migrate", None, env,
                                        migrates=argv[1:] or list(self.code.db_services),
                                        init=init))
                else:
                    self.err(pod.owner, f"container {c['name']}: args {argv} are neither "
                             f"`serve <{'|'.join(self.code.services)}>` nor `migrate`")
        return out

    def env_of(self, pod: Pod, c: dict) -> dict:
        env: dict = {}
        for e in c.get("env", []):
            if e["name"] in env:
                self.err(pod.owner, f"sets {e['name']} twice")
            vf = e.get("valueFrom")
            if vf is None:
                env[e["name"]] = ("value", e.get("value", ""))
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                env[e["name"]] = ("configmap", ref["name"], ref["key"], ref.get("optional", False))
            elif "secretKeyRef" in vf:
                ref = vf["secretKeyRef"]
                env[e["name"]] = ("secret", ref["name"], ref["key"], ref.get("optional", False))
            else:
                env[e["name"]] = ("field", json.dumps(vf))
        for ef in c.get("envFrom", []):
            prefix = ef.get("prefix", "")
            if "configMapRef" in ef:
                name = ef["configMapRef"]["name"]
                data = self.r.configmap_data(name, pod.ns)
                if data is None:
                    self.err(pod.owner, f"envFrom ConfigMap {name} is not in the render, so the "
                             "variables it sets cannot be checked; use configMapKeyRef")
                    continue
                for k in data:
                    env[prefix + k] = ("configmap", name, k, True)
            if "secretRef" in ef:
                name = ef["secretRef"]["name"]
                data = self.r.secret_data(name, pod.ns)
                if data is None:
                    self.err(pod.owner, f"envFrom Secret {name} hides which variables are set; "
                             "use secretKeyRef per variable")
                    continue
                for k in data:
                    env[prefix + k] = ("secret", name, k, True)
        return env

    def resolve(self, pod: Pod, src: tuple) -> str | None:
        if src[0] == "value":
            return src[1]
        if src[0] == "configmap":
            data = self.r.configmap_data(src[1], pod.ns)
            return None if data is None else data.get(src[2])
        if src[0] == "secret":
            data = self.r.secret_data(src[1], pod.ns)
            return None if data is None else data.get(src[2])
        return None

    def check_env(self, w: Workload):
        who = w.service or "`ecoscan migrate`"
        allowed = self.code.reads[w.service] if w.service else \
            set().union(*(self.code.reads[s] for s in w.migrates))
        for name, src in w.env.items():
            self.count("environment variables checked")
            if name not in self.code.reads_anywhere:
                self.err(w.pod.owner, f"sets {name}, which no service reads (not found in "
                         "services/**/*.rs or gateway/src/**/*.rs, nor an OpenTelemetry SDK "
                         "variable)")
            elif name not in allowed:
                crates = ", ".join(sorted(self.code.where_read.get(name, {"the OpenTelemetry SDK"})))
                self.err(w.pod.owner, f"sets {name}, which {who} does not read (read by {crates})")
            if src[0] == "configmap":
                data = self.r.configmap_data(src[1], w.pod.ns)
                if data is None:
                    self.err(w.pod.owner, f"{name}: ConfigMap {src[1]} is not in the render")
                elif src[2] not in data and not src[3]:
                    self.err(w.pod.owner, f"{name}: ConfigMap {src[1]} has no key {src[2]}")
            elif src[0] == "secret":
                self.secret_key(w.pod.owner, w.pod.ns, src[1], src[2], src[3], name)

    def secret_key(self, owner: dict, ns: str, secret: str, key: str, optional: bool, what: str):
        data = self.r.secret_data(secret, ns)
        if data is None:
            keys = self.expected_secrets.setdefault(secret, {})
            keys[key] = keys.get(key, True) and optional
        elif key not in data and not optional:
            self.err(owner, f"{what}: Secret {secret} (in this render) has no key {key}")

    def listen(self, w: Workload):
        svc = w.service
        var = self.code.addr_var[svc]
        src = w.env.get(var)
        if src is None:
            self.err(w.pod.owner, f"does not set {var}: {svc} would listen on "
                     f"{self.code.default_host}:{self.code.default_port[svc]}, unreachable from "
                     "other pods and the kubelet's probes")
            w.listen_port = self.code.default_port[svc]
            return
        value = self.resolve(w.pod, src)
        m = re.fullmatch(r"\[?([^\]]*)\]?:(\d+)", value or "")
        if not m:
            self.err(w.pod.owner, f"{var}={value!r} is not a resolvable host:port")
            w.listen_port = self.code.default_port[svc]
            return
        host, port = m.group(1), int(m.group(2))
        if host.startswith("127.") or host in ("localhost", "::1"):
            self.err(w.pod.owner, f"{var}={value} listens on loopback only")
        w.listen_port = port

    def check_pod_basics(self, w: Workload):
        pod, c = w.pod, w.container
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in (res.get(kind) or {}):
                    self.err(pod.owner, f"container {c['name']}: no resources.{kind}.{r}")
        psc, csc = pod.spec.get("securityContext") or {}, c.get("securityContext") or {}
        if not (csc.get("runAsNonRoot", psc.get("runAsNonRoot"))):
            self.err(pod.owner, "runAsNonRoot is not true")
        if csc.get("runAsUser", psc.get("runAsUser")) != 10001:
            self.err(pod.owner, "runAsUser is not 10001 (the image's ecoscan user)")
        if not csc.get("readOnlyRootFilesystem"):
            self.err(pod.owner, "readOnlyRootFilesystem is not true")
        if csc.get("allowPrivilegeEscalation") is not False:
            self.err(pod.owner, "allowPrivilegeEscalation is not false")
        if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
            self.err(pod.owner, "capabilities do not drop ALL")
        if (csc.get("seccompProfile") or psc.get("seccompProfile") or {}).get("type") \
                != "RuntimeDefault":
            self.err(pod.owner, "seccompProfile is not RuntimeDefault")
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        if "emptyDir" not in volumes.get(mounts.get("/tmp", ""), {}):
            self.err(pod.owner, "no emptyDir at /tmp (the root filesystem is read-only)")
        sa_name = pod.spec.get("serviceAccountName", "default")
        if sa_name == "default":
            self.err(pod.owner, "runs as the default ServiceAccount; give it its own")
        sa = self.r.get("ServiceAccount", sa_name, pod.ns)
        if sa is None:
            self.err(pod.owner, f"ServiceAccount {sa_name} is not in the render")
        mount = pod.spec.get("automountServiceAccountToken",
                             (sa or {}).get("automountServiceAccountToken", True))
        if mount is not False:
            self.err(pod.owner, "mounts a service-account token (automountServiceAccountToken)")
        if pod.spec.get("enableServiceLinks", True):
            self.err(pod.owner, "enableServiceLinks is not false: Kubernetes would add "
                     "<SERVICE>_PORT/_SERVICE_HOST variables that no service reads")

    def check_serving(self, w: Workload):
        pod, c, svc, port = w.pod, w.container, w.service, w.listen_port
        owner = pod.owner
        self.count("services checked")
        if owner["kind"] != "Deployment":
            self.err(owner, f"{svc} should run as a Deployment")
        if owner["spec"].get("template", {}).get("spec", {}).get(
                "terminationGracePeriodSeconds", 30) < 45:
            self.err(owner, "terminationGracePeriodSeconds below 45: streams need time to drain")
        cports = [p["containerPort"] for p in c.get("ports", [])]
        if port not in cports:
            self.err(owner, f"no containerPort {port} ({svc} listens on {port})")
        grpc = svc != "gateway"
        if not grpc:
            self.admin_listener(w)
        targets = {port} | ({w.admin_port} if w.admin_port else set())
        probes = ["livenessProbe", "readinessProbe"] + (["startupProbe"] if grpc else [])
        for name in probes:
            probe = c.get(name)
            if not probe:
                self.err(owner, f"no {name}")
                continue
            self.count("probes checked")
            if grpc and "grpc" not in probe and name != "startupProbe":
                self.err(owner, f"{name} is not a native gRPC probe")
            # The gateway's readiness is on its admin listener; everything else on the port
            # the service listens on.
            want = w.admin_port if (not grpc and name == "readinessProbe") else port
            for h in ("grpc", "httpGet", "tcpSocket"):
                if h in probe:
                    p = probe[h].get("port")
                    p = pod.port_by_name(p) if isinstance(p, str) else p
                    if want is not None and p != want:
                        self.err(owner, f"{name} probes port {probe[h].get('port')}, but {svc} "
                                 f"answers it on {want}")
            if "grpc" in probe and probe["grpc"].get("service", "") != "":
                self.err(owner, f"{name} asks gRPC health for service "
                         f"{probe['grpc']['service']!r}; the overall status is \"\"")
        if not grpc:
            for name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                got = (c.get(name) or {}).get("httpGet", {}).get("path")
                if c.get(name) and got != path:
                    self.err(owner, f"{name} path {got!r}, want {path}")
        # PodDisruptionBudget
        pdbs = [p for p in self.r.of("PodDisruptionBudget") if self.r.ns(p) == pod.ns
                and selector_matches(p["spec"].get("selector"), pod.labels)]
        if not pdbs:
            self.err(owner, f"no PodDisruptionBudget selects the {svc} pods")
        for p in pdbs:
            spec = p["spec"]
            if "minAvailable" not in spec and "maxUnavailable" not in spec:
                self.err(p, "sets neither minAvailable nor maxUnavailable")
        # Services
        services = [s for s in self.r.of("Service") if self.r.ns(s) == pod.ns
                    and s["spec"].get("selector")
                    and all(pod.labels.get(k) == v for k, v in s["spec"]["selector"].items())]
        if not services:
            self.err(owner, f"no Service selects the {svc} pods")
        if grpc and not any(s["metadata"]["name"] == svc for s in services):
            self.err(owner, f"no Service named {svc} (callers use http://{svc}:{port})")
        for s in services:
            self.count("Service ports checked", len(s["spec"].get("ports", [])))
            headless = s["spec"].get("clusterIP") == "None"
            if grpc and not headless:
                self.err(s, f"is not headless (clusterIP: None): {svc}'s callers must resolve "
                         "every replica to balance over them")
            for sp in s["spec"].get("ports", []):
                tp = sp.get("targetPort", sp["port"])
                tp = pod.port_by_name(tp) if isinstance(tp, str) else tp
                if tp not in targets:
                    self.err(s, f"port {sp.get('name', sp['port'])} targets {sp.get('targetPort')}"
                             f", but {svc} listens on {port}")
                if headless and sp["port"] != port:
                    self.err(s, f"headless Service port {sp['port']} differs from the pod port "
                             f"{port}; callers connect to the pods at the Service port")

    def admin_listener(self, w: Workload):
        """The gateway's admin listener: set, reachable (not loopback), a container port."""
        var = self.code.admin_var
        src = w.env.get(var)
        if src is None:
            self.err(w.pod.owner, f"does not set {var}: /readyz and /metrics would listen on "
                     "loopback only, out of reach of the kubelet's probes and Prometheus")
            return
        value = self.resolve(w.pod, src)
        m = re.fullmatch(r"\[?([^\]]*)\]?:(\d+)", value or "")
        if not m:
            self.err(w.pod.owner, f"{var}={value!r} is not a resolvable host:port")
            return
        if m.group(1).startswith("127.") or m.group(1) in ("localhost", "::1"):
            self.err(w.pod.owner, f"{var}={value} listens on loopback only")
        w.admin_port = int(m.group(2))
        if w.admin_port == w.listen_port:
            self.err(w.pod.owner, f"{var} is the API port: readiness and metrics would be public")
        if w.admin_port not in [p["containerPort"] for p in w.container.get("ports", [])]:
            self.err(w.pod.owner, f"no containerPort {w.admin_port} (the admin listener)")

    # -- release gates: readiness, model, migrations, sizing, Pod Security, secrets, egress -----
    def check_readiness(self, ws: list[Workload]):
        """Readiness is each process's own state: never a path that waits on a peer."""
        for p in self.code.code_problems:
            self.err("(code)", p)
        for w in ws:
            if not w.service:
                continue
            probe = w.container.get("readinessProbe") or {}
            if w.service == "gateway":
                got = probe.get("httpGet", {})
                if got.get("path") != "/readyz":
                    self.err(w.pod.owner, "readinessProbe is not GET /readyz on the admin "
                             "listener (the gateway's own state, no backend call)")
            elif probe and ("grpc" not in probe or probe["grpc"].get("service", "") != ""):
                self.err(w.pod.owner, "readinessProbe is not the overall gRPC health status "
                         "(SERVING until the process drains; never a peer's state)")

    def check_model(self, ws: list[Workload]):
        """The model provider comes from the Secret, never a ConfigMap or a literal."""
        for cm in self.r.of("ConfigMap"):
            if cm["metadata"]["name"].startswith("ecoscan-config") and \
                    "LLM_PROVIDER" in (cm.get("data") or {}):
                self.err(cm, "sets LLM_PROVIDER: the provider comes from the Secret, so that "
                         "no shared setting can put the mock model in front of users")
        for w in ws:
            src = w.env.get("LLM_PROVIDER")
            if w.service in ("vision", "answer"):
                if src is None or src[0] != "secret" or src[3]:
                    self.err(w.pod.owner, "LLM_PROVIDER must come from a required key of the "
                             "Secret (secretKeyRef, not optional)")
            if src is not None and "prod" in self.r.name and \
                    (self.resolve(w.pod, src) or "").strip().lower() == "mock":
                self.err(w.pod.owner, "LLM_PROVIDER=mock in prod: the mock model must never "
                         "answer users")
            # The services' own refusal of the mock: the production profile must reach the
            # ones that call the model, whatever a Secret says.
            if w.service in ("vision", "answer") and "prod" in self.r.name:
                stores = w.env.get("ECOSCAN_STORES")
                if stores is None or (self.resolve(w.pod, stores) or "") != "production":
                    self.err(w.pod.owner, "ECOSCAN_STORES=production does not reach it: the "
                             "service would start on the mock model if a Secret said so")

    def check_migrations(self, ws: list[Workload]):
        """Each Deployment with a database migrates in an init container before it serves; no
        fixed-name Job (a Job's pod template is immutable, so the next release's apply fails)."""
        for job in self.r.of("Job"):
            self.err(job, "a Job in the manifests: its pod template is immutable, so the next "
                     "release's `kubectl apply` fails (\"field is immutable\"); migrations run "
                     "in each Deployment's init container")
        for w in ws:
            if w.command == "migrate" and not w.init:
                self.err(w.pod.owner, "runs `ecoscan migrate` outside an init container")
        for w in ws:
            if w.service not in self.code.db_services:
                continue
            inits = [x for x in ws if x.pod is w.pod and x.init and x.command == "migrate"]
            if not any(w.service in x.migrates for x in inits):
                self.err(w.pod.owner, f"no init container runs `ecoscan migrate {w.service}`: "
                         f"{w.service} could start against a schema older than it needs")

    def check_sizing(self, ws: list[Workload]):
        """Memory request = limit (a pod is never killed for memory it was promised), and a
        CPU request to scale on."""
        for w in ws:
            res = w.container.get("resources") or {}
            req, lim = res.get("requests") or {}, res.get("limits") or {}
            if "memory" in req and "memory" in lim and \
                    parse_quantity(req["memory"]) != parse_quantity(lim["memory"]):
                self.err(w.pod.owner, f"container {w.container['name']}: memory request "
                         f"{req['memory']} differs from its limit {lim['memory']} "
                         "(request = limit: measured, see k8s/README.md \"Sizing\")")
            self.count("containers sized")

    def check_pod_security(self):
        for pod in self.r.pods():
            for v in restricted_violations(pod.spec):
                self.err(pod.owner, f"Pod Security restricted: {v}")
            self.count("pods held to Pod Security restricted")
        for ns in self.r.of("Namespace"):
            labels = ns["metadata"].get("labels") or {}
            if labels.get("pod-security.kubernetes.io/enforce") != "restricted":
                self.err(ns, "no label pod-security.kubernetes.io/enforce=restricted")
            if not labels.get("pod-security.kubernetes.io/enforce-version"):
                self.err(ns, "the Pod Security level is not pinned to a version "
                         "(pod-security.kubernetes.io/enforce-version)")

    def check_generated_secret(self, ws: list[Workload]):
        """prod: the Secret is generated from secrets.env (its name carries a hash of its values,
        so a changed value rolls the pods), and k8s/README.md names every key the pods read."""
        secrets = [s for s in self.r.of("Secret")
                   if s["metadata"]["name"].startswith("ecoscan-secrets")]
        if not secrets or any(s["metadata"]["name"] == "ecoscan-secrets" for s in secrets):
            self.err("(render)", "the Secret is not generated with a content hash in its name "
                     "(secretGenerator): a changed value would not roll the pods")
        readme = (REPO / "k8s/README.md").read_text()
        example = (REPO / "k8s/overlays/prod/secrets.env.example").read_text()
        example_keys = set(re.findall(r"^([A-Z][A-Z0-9_]*)=", example, re.M))
        keys: dict[str, bool] = {}
        for w in ws:
            for src in w.env.values():
                if src[0] == "secret":
                    keys[src[2]] = keys.get(src[2], True) and src[3]
        for ta in self.r.of("TriggerAuthentication"):
            for ref in ta["spec"].get("secretTargetRef", []):
                keys[ref["key"]] = False
                if not ref["name"].startswith("ecoscan-secrets-"):
                    self.err(ta, f"names Secret {ref['name']}, not the generated one")
        for key, optional in sorted(keys.items()):
            if f"`{key}`" not in readme:
                self.err("k8s/README.md", f"the Secret key {key} is not in its Secret table")
            if not optional and key not in example_keys:
                self.err("k8s/overlays/prod/secrets.env.example", f"lacks the required key {key}")

    def check_fetch_egress(self, ws: list[Workload]):
        """ingest fetches images by URL: its web egress (80/443) must exclude link-local and
        loopback (and the cluster's private ranges), as defence in depth behind its own check."""
        ingest = next((w for w in ws if w.service == "ingest"), None)
        if ingest is None or not self.net.policies:
            return
        for p in self.net.selecting(ingest.pod, "Egress"):
            for rule in p["spec"].get("egress") or []:
                if not any(self.net._port_ok(rule, port, None) for port in (80, 443)):
                    continue
                peers = rule.get("to")
                if not peers:
                    self.err(p, "lets ingest reach ports 80/443 on any address, link-local "
                             "(cloud metadata) and loopback included; use an ipBlock with except")
                    continue
                for peer in peers:
                    block = peer.get("ipBlock")
                    if block is None:
                        continue
                    need = {"169.254.0.0/16", "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12",
                            "192.168.0.0/16"} if ":" not in block["cidr"] else \
                        {"fe80::/10", "::1/128", "fc00::/7"}
                    missing = need - set(block.get("except") or [])
                    if missing:
                        self.err(p, f"ipBlock {block['cidr']} does not except "
                                 f"{', '.join(sorted(missing))}")
                    self.count("egress ipBlocks checked")

    # -- 4. who talks to whom -----------------------------------------------------------------
    def service_target(self, pod: Pod, url: str) -> tuple[Pod | None, int, str | None]:
        """(target pod, port at the pod, Service name) for a URL; no pod when outside the
        render or namespace; port -1 when the Service has no such port."""
        first = url.split(",")[0].strip()
        u = urlsplit(first if "://" in first else "tcp://" + first)
        host = u.hostname or ""
        try:
            port = u.port or DEFAULT_SCHEME_PORTS.get(u.scheme, 0)
        except ValueError:
            return None, 0, None
        name, _, rest = host.partition(".")
        ns_in_host = rest.split(".")[0] if rest else None
        # name.namespace[.svc…]: another namespace (or, without a namespace in the render, any
        # qualified name) is outside the render.
        if ns_in_host is not None and (not pod.ns or ns_in_host != pod.ns):
            return None, port, None
        s = self.r.get("Service", name, pod.ns)
        if s is None:
            return None, port, None
        for target in self.r.pods():
            if target.ns == pod.ns and s["spec"].get("selector") and all(
                    target.labels.get(k) == v for k, v in s["spec"]["selector"].items()):
                for sp in s["spec"].get("ports", []):
                    if sp["port"] == port:
                        tp = sp.get("targetPort", port)
                        tp = target.port_by_name(tp) if isinstance(tp, str) else tp
                        if s["spec"].get("clusterIP") == "None":
                            tp = port
                        return target, tp, name
                return target, -1, name
        return None, port, name

    def check_calls(self, ws: list[Workload]):
        by_service = {w.service: w for w in ws if w.service}
        callers: dict[str, set[str]] = {s: set() for s in self.code.grpc_services}
        for w in ws:
            for name, src in w.env.items():
                target_svc = name[:-4].lower() if name.endswith("_URL") else None
                if target_svc not in self.code.grpc_services:
                    continue
                if target_svc == w.service:
                    continue
                callers[target_svc].add(w.pod.id)
                url = self.resolve(w.pod, src)
                if not url:
                    if not (src[0] in ("configmap", "secret") and src[3]):
                        self.err(w.pod.owner, f"{name}: value not resolvable in the render")
                    continue
                target = by_service.get(target_svc)
                pod, pport, sname = self.service_target(w.pod, url)
                self.count("service calls checked")
                if target is None:
                    self.err(w.pod.owner, f"{name}={url}: there is no {target_svc} workload")
                    continue
                if pod is None or pod.owner is not target.pod.owner:
                    self.err(w.pod.owner, f"{name}={url}: the host is not the {target_svc} "
                             "Service of this render")
                    continue
                if pport == -1:
                    self.err(w.pod.owner, f"{name}={url}: Service {sname} has no port "
                             f"{urlsplit(url).port}")
                    continue
                if pport != target.listen_port:
                    self.err(w.pod.owner, f"{name}={url}: reaches port {pport}, but {target_svc} "
                             f"listens on {target.listen_port}")
                    continue
                if not self.net.egress_allows(w.pod, target.pod, pport):
                    self.err(w.pod.owner, f"calls {target_svc} ({name}) but its egress "
                             f"NetworkPolicy does not allow port {pport} to the {target_svc} pods")
                if not self.net.ingress_allows(target.pod, w.pod, pport):
                    self.err(target.pod.owner, f"{w.service or 'migrate'} calls it ({name}) but "
                             "no NetworkPolicy admits that traffic")
        if not self.net.policies:
            self.err("(render)", "no NetworkPolicies")
            return
        all_pods = self.r.pods()
        for p in all_pods:
            if not self.net.selecting(p, "Ingress"):
                self.err(p.owner, "no NetworkPolicy isolates its ingress (default deny missing)")
            if not self.net.selecting(p, "Egress"):
                self.err(p.owner, "no NetworkPolicy isolates its egress (default deny missing)")
        for svc in self.code.grpc_services:
            target = by_service.get(svc)
            if target is None:
                continue
            for p in all_pods:
                if p.owner is target.pod.owner or p.id in callers[svc]:
                    continue
                if self.net.ingress_allows(target.pod, p, target.listen_port):
                    self.err(target.pod.owner, f"admits traffic from {p.id}, which does not "
                             f"call {svc} (it sets no {svc.upper()}_URL)")
            for p in sorted(set(self.net.open_outside(target.pod, target.listen_port))):
                self.err(p, f"admits traffic to {svc}:{target.listen_port} from outside the "
                         "namespace; only the gateway may take it")
            self.count("ingress rules checked")
        gw = by_service.get("gateway")
        if gw and not self.net.open_outside(gw.pod, gw.listen_port):
            self.err(gw.pod.owner, f"no NetworkPolicy admits traffic from outside the namespace "
                     f"to the gateway on {gw.listen_port}")

    def check_store_egress(self, ws: list[Workload]):
        for w in ws:
            for name, src in w.env.items():
                kind = store_var(name)
                if kind is None:
                    continue
                value = self.resolve(w.pod, src)
                if value is None:
                    dests = [(None, p) for p in STORE_PORTS[kind]]
                else:
                    dests = []
                    for part in value.split(","):
                        pod, port, sname = self.service_target(w.pod, part)
                        if sname and pod is None:
                            self.err(w.pod.owner, f"{name}: Service {sname} selects no pod")
                        dests.append((pod, port))
                for pod, port in dests:
                    self.count("store/collector/provider egress checked")
                    if not self.net.egress_allows(w.pod, pod, port):
                        where = pod.id if pod else "outside the namespace"
                        self.err(w.pod.owner, f"{name}: egress to {where} port {port} is not "
                                 "allowed by its NetworkPolicies")
                    if pod is not None and not self.net.ingress_allows(pod, w.pod, port):
                        self.err(pod.owner, f"does not admit {w.pod.id} on port {port} "
                                 f"({name} of {w.service or 'migrate'})")

    # -- 5. autoscaling, overlays, ServiceMonitors ----------------------------------------------
    def check_autoscaling(self, ws: list[Workload]):
        deployments = {w.service: w.pod.owner for w in ws if w.service}
        hpas = self.r.of("HorizontalPodAutoscaler")
        sos = self.r.of("ScaledObject")
        scaled: dict[str, list[str]] = {}
        for h in hpas:
            ref = h["spec"]["scaleTargetRef"]
            scaled.setdefault(ref["name"], []).append(obj_id(h))
            if h["apiVersion"] != "autoscaling/v2":
                self.err(h, "is not autoscaling/v2")
            if not any(m.get("type") == "Resource" and m["resource"]["name"] == "cpu"
                       for m in h["spec"].get("metrics", [])):
                self.err(h, "has no CPU metric")
            if self.r.get(ref["kind"], ref["name"], self.r.ns(h)) is None:
                self.err(h, f"targets {ref['kind']}/{ref['name']}, which is not in the render")
        for so in sos:
            ref = so["spec"]["scaleTargetRef"]
            scaled.setdefault(ref["name"], []).append(obj_id(so))
            if self.r.get(ref.get("kind", "Deployment"), ref["name"], self.r.ns(so)) is None:
                self.err(so, f"targets {ref['name']}, which is not in the render")
            if ref["name"] == KEDA_STREAMS_SERVICE:
                self.check_streams_scaler(so)
                continue
            for t in so["spec"]["triggers"]:
                md = t.get("metadata", {})
                if t["type"] not in ("redis-streams", "redis-cluster-streams"):
                    self.err(so, f"trigger {t['type']} is not redis-streams")
                    continue
                if md.get("stream") != self.code.dispatch_stream:
                    self.err(so, f"stream {md.get('stream')!r}, but ingest dispatches on "
                             f"{self.code.dispatch_stream!r}")
                if md.get("consumerGroup") != self.code.dispatch_group:
                    self.err(so, f"consumerGroup {md.get('consumerGroup')!r}, but ingest's group "
                             f"is {self.code.dispatch_group!r}")
                counts = [k for k in ("pendingEntriesCount", "lagCount", "streamLength") if k in md]
                if len(counts) != 1:
                    self.err(so, f"needs exactly one of pendingEntriesCount, lagCount, "
                             f"streamLength (has {counts})")
                has_addr = any(k in md for k in ("address", "addressFromEnv", "host", "hostFromEnv"))
                auth = t.get("authenticationRef")
                if auth:
                    ta = self.r.get(auth.get("kind", "TriggerAuthentication"), auth["name"],
                                    self.r.ns(so))
                    if ta is None:
                        self.err(so, f"authenticationRef {auth['name']} is not in the render")
                    else:
                        for ref2 in ta["spec"].get("secretTargetRef", []):
                            has_addr |= ref2["parameter"] in ("address", "host", "addresses")
                            self.secret_key(ta, self.r.ns(ta), ref2["name"], ref2["key"], False,
                                            f"parameter {ref2['parameter']}")
                if not has_addr:
                    self.err(so, "the trigger has no Redis address")
        for name, by in scaled.items():
            if len(by) > 1:
                self.err(f"Deployment/{name}", f"scaled by more than one autoscaler: {by}")
        for name, d in deployments.items():
            if name in scaled and "replicas" in d["spec"]:
                self.err(d, f"sets spec.replicas while {scaled[name][0]} scales it: every "
                         "apply would reset the count")
        if hpas or sos:
            for svc in sorted(HPA_SERVICES):
                if svc in deployments and not any(
                        h["spec"]["scaleTargetRef"]["name"] == deployments[svc]["metadata"]["name"]
                        for h in hpas):
                    self.err(deployments[svc], "no HorizontalPodAutoscaler")
            for svc in (KEDA_SERVICE, KEDA_STREAMS_SERVICE):
                if svc in deployments and not any(
                        so["spec"]["scaleTargetRef"]["name"] == deployments[svc]["metadata"]["name"]
                        for so in sos):
                    self.err(deployments[svc], "no KEDA ScaledObject")
        self.count("autoscalers checked", len(hpas) + len(sos))
        return scaled

    def check_streams_scaler(self, so: dict):
        """The gateway's ScaledObject: a Prometheus trigger on the SSE gauge the gateway exports
        (per replica, AverageValue, a positive whole threshold) and a CPU trigger."""
        kinds = {t["type"]: t for t in so["spec"]["triggers"]}
        prom, cpu = kinds.get("prometheus"), kinds.get("cpu")
        if prom is None:
            self.err(so, "the gateway is not scaled on its event streams (no prometheus trigger)")
        else:
            md = prom.get("metadata", {})
            if SSE_GAUGE not in md.get("query", ""):
                self.err(so, f"the prometheus query {md.get('query')!r} does not read {SSE_GAUGE}")
            if not self.code.exports_sse_gauge:
                self.err(so, f"scales on {SSE_GAUGE}, which gateway/src/metrics.rs no longer "
                         "registers")
            if prom.get("metricType", "AverageValue") != "AverageValue":
                self.err(so, "the stream trigger must be AverageValue: streams per replica")
            if not str(md.get("threshold", "")).isdigit() or int(md["threshold"]) < 1:
                self.err(so, f"threshold {md.get('threshold')!r} is not a positive number")
            if not re.match(r"^https?://[^/\s]+", md.get("serverAddress", "")):
                self.err(so, f"serverAddress {md.get('serverAddress')!r} is not an http(s) URL")
        if cpu is None:
            self.err(so, "the gateway has no CPU trigger beside its streams")
        elif not str(cpu.get("metadata", {}).get("value", "")).isdigit():
            self.err(so, "the CPU trigger's value is not a whole percentage")
        for t in so["spec"]["triggers"]:
            if t["type"] not in ("prometheus", "cpu"):
                self.err(so, f"trigger {t['type']} is not prometheus or cpu")

    def check_prod(self, ws: list[Workload]):
        hpa_min = {}
        for h in self.r.of("HorizontalPodAutoscaler"):
            hpa_min[h["spec"]["scaleTargetRef"]["name"]] = h["spec"].get("minReplicas", 1)
        for so in self.r.of("ScaledObject"):
            hpa_min[so["spec"]["scaleTargetRef"]["name"]] = so["spec"].get("minReplicaCount", 0)
        for w in ws:
            o = w.pod.owner
            if w.service:
                n = hpa_min.get(o["metadata"]["name"], o["spec"].get("replicas", 1))
                if n < 2:
                    self.err(o, f"runs {n} replica(s) at the least; prod wants 2 or more")
                keys = {t.get("topologyKey") for t in
                        w.pod.spec.get("topologySpreadConstraints", [])}
                for k in ("topology.kubernetes.io/zone", "kubernetes.io/hostname"):
                    if k not in keys:
                        self.err(o, f"no topologySpreadConstraint over {k}")
            if not image_pinned(w.container.get("image", "")):
                self.err(o, f"image {w.container.get('image')} is not pinned by tag or digest")
        self.check_generated_secret(ws)
        gw = next((w for w in ws if w.service == "gateway"), None)
        ok = False
        for ing in self.r.of("Ingress"):
            for rule in ing["spec"].get("rules", []):
                for p in rule.get("http", {}).get("paths", []):
                    svc = p["backend"].get("service", {})
                    if svc.get("name") == "gateway":
                        ok = True
                        if not ing["spec"].get("tls"):
                            self.err(ing, "routes to the gateway without TLS")
        if gw and not ok:
            self.err("(render)", "no Ingress routes to the gateway Service")

    def check_dev(self):
        for kind in ("ScaledObject", "TriggerAuthentication"):
            for o in self.r.of(kind):
                self.err(o, "a local cluster has no KEDA; the dev overlay must remove it")
        if self.r.get("Secret", "ecoscan-secrets") is None and not any(
                s["metadata"]["name"].startswith("ecoscan-secrets-") for s in self.r.of("Secret")):
            self.err("(render)", "the dev overlay must generate the Secret ecoscan-secrets")

    def check_servicemonitors(self, ws: list[Workload]):
        sms = self.r.of("ServiceMonitor")
        if not sms:
            return
        for w in ws:
            if not w.service:
                continue
            svc = self.r.get("Service", w.service, w.pod.ns)
            if svc is None:
                continue
            mine = [m for m in sms if self.r.ns(m) == w.pod.ns
                    and selector_matches(m["spec"].get("selector"), svc["metadata"].get("labels", {}))]
            if not mine:
                self.err(svc, "no ServiceMonitor selects it")
            for m in mine:
                self.count("ServiceMonitors checked")
                for ep in m["spec"].get("endpoints", []):
                    sp = next((p for p in svc["spec"]["ports"] if p.get("name") == ep.get("port")),
                              None)
                    if sp is None:
                        self.err(m, f"endpoint port {ep.get('port')!r} is not a port name of "
                                 f"Service {w.service}")
                    elif w.admin_port is not None:
                        tp = sp.get("targetPort", sp["port"])
                        tp = w.pod.port_by_name(tp) if isinstance(tp, str) else tp
                        if tp != w.admin_port:
                            self.err(m, f"scrapes port {ep.get('port')!r}, not the gateway's "
                                     f"admin listener ({w.admin_port}), where /metrics is")
                    if ep.get("path", "/metrics") != "/metrics":
                        self.err(m, f"path {ep.get('path')}: metrics are served at /metrics")
                scrape = w.admin_port or w.listen_port
                if self.net.policies and not self.net.open_outside(w.pod, scrape, True):
                    self.err(m, f"no NetworkPolicy lets Prometheus reach {w.service}:{scrape}")

    def run(self) -> "Checker":
        self.check_schemas()
        ws = self.workloads()
        for w in ws:
            if w.service:
                self.listen(w)
        for w in ws:
            self.check_env(w)
            self.check_pod_basics(w)
            if w.service:
                self.check_serving(w)
        seen = {w.service for w in ws if w.service}
        for svc in self.code.services:
            if svc not in seen:
                self.err("(render)", f"no workload runs `ecoscan serve {svc}`")
        self.check_readiness(ws)
        self.check_model(ws)
        self.check_migrations(ws)
        self.check_sizing(ws)
        self.check_pod_security()
        self.check_fetch_egress(ws)
        self.check_calls(ws)
        self.check_store_egress(ws)
        self.check_autoscaling(ws)
        if "prod" in self.r.name:
            self.check_prod(ws)
        if "dev" in self.r.name:
            self.check_dev()
        self.check_servicemonitors(ws)
        self.count("workloads", len(ws))
        return self


# ----------------------------------------------------------------------------------------------
# Self-test: broken manifests must be caught
# ----------------------------------------------------------------------------------------------

def _find(docs, kind, name):
    for d in docs:
        if d and d.get("kind") == kind and (d["metadata"]["name"] == name
                                            or d["metadata"]["name"].startswith(name + "-")):
            return d
    raise KeyError(f"{kind}/{name}")


def _container(docs, name):
    return _find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


def _set_cm(docs, key, value):
    _find(docs, "ConfigMap", "ecoscan-config")["data"][key] = value


def _env(container, name):
    return next(e for e in container["env"] if e["name"] == name)


def _drop_secret_key(docs, key):
    del _find(docs, "Secret", "ecoscan-secrets")["data"][key]


MUTATIONS = [
    # (render, what, mutate(docs), substrings one error must contain)
    ("prod", "an env var no service reads",
     lambda d: _container(d, "ingest")["env"].append({"name": "INGEST_MAX_INFLIGHT", "value": "9"}),
     ["Deployment/ingest", "INGEST_MAX_INFLIGHT", "no service reads"]),
    ("prod", "an env var another service reads",
     lambda d: _container(d, "rule")["env"].append({"name": "LLM_PROVIDER", "value": "mock"}),
     ["Deployment/rule", "LLM_PROVIDER", "rule does not read"]),
    ("prod", "a wrong readiness probe port",
     lambda d: _container(d, "vision")["readinessProbe"]["grpc"].update(port=50051),
     ["Deployment/vision", "readinessProbe", "50052"]),
    ("prod", "a missing PodDisruptionBudget",
     lambda d: d.remove(_find(d, "PodDisruptionBudget", "reward")),
     ["Deployment/reward", "PodDisruptionBudget"]),
    ("prod", "a gRPC Service that is not headless",
     lambda d: _find(d, "Service", "rule")["spec"].pop("clusterIP"),
     ["Service/rule", "headless"]),
    ("prod", "no listen address",
     lambda d: _container(d, "answer").__setitem__(
         "env", [e for e in _container(d, "answer")["env"] if e["name"] != "ANSWER_ADDR"]),
     ["Deployment/answer", "ANSWER_ADDR", "unreachable"]),
    ("prod", "a missing liveness probe",
     lambda d: _container(d, "gateway").pop("livenessProbe"),
     ["Deployment/gateway", "livenessProbe"]),
    ("prod", "no resource limits",
     lambda d: _container(d, "notification")["resources"].pop("limits"),
     ["Deployment/notification", "limits"]),
    ("prod", "a caller blocked by NetworkPolicy",
     lambda d: _find(d, "NetworkPolicy", "rule-ingress")["spec"]["ingress"][0]["from"].pop(1),
     ["Deployment/rule", "vision calls it"]),
    ("prod", "a service open to a non-caller",
     lambda d: _find(d, "NetworkPolicy", "vision-ingress")["spec"]["ingress"][0]["from"].append(
         {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}}}),
     ["Deployment/vision", "Deployment/gateway", "does not call"]),
    ("prod", "a URL on the wrong port",
     lambda d: _set_cm(d, "REWARD_URL", "http://reward:50099"),
     ["REWARD_URL", "50099"]),
    ("prod", "an unknown field (Kubernetes schema)",
     lambda d: _container(d, "ingest").update(readinessprobe={}),
     ["Deployment/ingest", "readinessprobe"]),
    ("prod", "a KEDA trigger value that is not a string (CRD schema)",
     lambda d: _find(d, "ScaledObject", "ingest")["spec"]["triggers"][0]["metadata"].update(
         pendingEntriesCount=500),
     ["ScaledObject/ingest", "pendingEntriesCount"]),
    ("prod", "a KEDA trigger on the wrong consumer group",
     lambda d: _find(d, "ScaledObject", "ingest")["spec"]["triggers"][0]["metadata"].update(
         consumerGroup="workers"),
     ["ScaledObject/ingest", "consumerGroup"]),
    ("prod", "the gateway scaled on a metric it does not export",
     lambda d: _find(d, "ScaledObject", "gateway")["spec"]["triggers"][0]["metadata"].update(
         query="sum(sse_gateway_connections_active)"),
     ["ScaledObject/gateway", "does not read gateway_sse_connections"]),
    ("prod", "the gateway's stream trigger gone",
     lambda d: _find(d, "ScaledObject", "gateway")["spec"]["triggers"].pop(0),
     ["ScaledObject/gateway", "not scaled on its event streams"]),
    ("prod", "an unpinned image",
     lambda d: _container(d, "reward").update(image="registry.example.com/ecoscan/ecoscan:latest"),
     ["Deployment/reward", "not pinned"]),
    ("dev", "a Secret key the containers need is missing",
     lambda d: _drop_secret_key(d, "DATABASE_URL"),
     ["DATABASE_URL", "has no key"]),
    ("dev", "a store the NetworkPolicies do not let through",
     lambda d: d.remove(_find(d, "NetworkPolicy", "postgres-ingress")),
     ["Deployment/postgres", "does not admit"]),
    ("prod", "the gateway's readiness on the API port",
     lambda d: _container(d, "gateway")["readinessProbe"]["httpGet"].update(port="http"),
     ["Deployment/gateway", "readinessProbe", "8081"]),
    ("prod", "the gateway's admin listener on loopback",
     lambda d: _env(_container(d, "gateway"), "GATEWAY_ADMIN_ADDR").update(value="127.0.0.1:8081"),
     ["Deployment/gateway", "GATEWAY_ADMIN_ADDR", "loopback"]),
    ("prod", "the mock model in prod",
     lambda d: _find(d, "Secret", "ecoscan-secrets")["data"].update(
         LLM_PROVIDER=base64.b64encode(b"mock").decode()),
     ["Deployment/vision", "LLM_PROVIDER=mock"]),
    ("prod", "the production profile kept from the model's services",
     lambda d: _container(d, "answer")["env"].remove(
         next(e for e in _container(d, "answer")["env"] if e["name"] == "ECOSCAN_STORES")),
     ["Deployment/answer", "ECOSCAN_STORES=production"]),
    ("prod", "the model provider from the ConfigMap",
     lambda d: _set_cm(d, "LLM_PROVIDER", "openai"),
     ["ConfigMap/ecoscan-config", "LLM_PROVIDER"]),
    ("prod", "a namespace without the Pod Security label",
     lambda d: _find(d, "Namespace", "ecoscan")["metadata"]["labels"].pop(
         "pod-security.kubernetes.io/enforce"),
     ["Namespace/ecoscan", "restricted"]),
    ("prod", "a memory request below its limit",
     lambda d: _container(d, "ingest")["resources"]["requests"].update(memory="64Mi"),
     ["Deployment/ingest", "memory request"]),
    ("prod", "a privileged container (Pod Security)",
     lambda d: _container(d, "rule")["securityContext"].update(privileged=True),
     ["Deployment/rule", "restricted", "privileged"]),
    ("dev", "a hostPath volume (Pod Security)",
     lambda d: _find(d, "Deployment", "redis")["spec"]["template"]["spec"]["volumes"].append(
         {"name": "host", "hostPath": {"path": "/"}}),
     ["Deployment/redis", "restricted", "hostPath"]),
    ("prod", "an init container that may escalate privileges (Pod Security)",
     lambda d: _find(d, "Deployment", "reward")["spec"]["template"]["spec"]["initContainers"][0][
         "securityContext"].pop("allowPrivilegeEscalation"),
     ["Deployment/reward", "initContainer migrate", "allowPrivilegeEscalation"]),
    ("prod", "a Deployment with a database and no migration init container",
     lambda d: _find(d, "Deployment", "analytics")["spec"]["template"]["spec"].pop(
         "initContainers"),
     ["Deployment/analytics", "ecoscan migrate analytics"]),
    ("prod", "a fixed-name migration Job",
     lambda d: d.append({"apiVersion": "batch/v1", "kind": "Job",
                         "metadata": {"name": "ecoscan-migrate", "namespace": "ecoscan"},
                         "spec": {"template": copy.deepcopy(
                             _find(d, "Deployment", "reward")["spec"]["template"])}}),
     ["Job/ecoscan-migrate", "immutable"]),
    ("prod", "ingest's web egress open to link-local addresses",
     lambda d: _find(d, "NetworkPolicy", "ingest-egress")["spec"]["egress"][7]["to"][0][
         "ipBlock"]["except"].remove("169.254.0.0/16"),
     ["NetworkPolicy/ingest-egress", "169.254.0.0/16"]),
    ("prod", "a Secret that does not roll the pods",
     lambda d: [_find(d, "Secret", "ecoscan-secrets")["metadata"].update(name="ecoscan-secrets")],
     ["the Secret is not generated"]),
    ("servicemonitor", "the gateway scraped on its API port",
     lambda d: _find(d, "ServiceMonitor", "gateway")["spec"]["endpoints"][0].update(port="http"),
     ["ServiceMonitor/gateway", "admin listener"]),
    ("servicemonitor", "a ServiceMonitor on a port the Service does not have",
     lambda d: _find(d, "ServiceMonitor", "analytics")["spec"]["endpoints"][0].update(
         port="metrics"),
     ["ServiceMonitor/analytics", "'metrics'"]),
    ("servicemonitor", "scrapes the NetworkPolicies do not let through",
     lambda d: d.remove(_find(d, "NetworkPolicy", "allow-prometheus-scrape")),
     ["ServiceMonitor/ingest", "Prometheus"]),
]


def self_test(renders: list[Render], code: CodeFacts, schemas: Schemas) -> int:
    failures = 0
    for r in renders:
        c = Checker(r, code, schemas).run()
        if c.errors:
            print(f"self-test: the unbroken render {r.name} does not pass, fix it first:")
            print("\n".join("  " + e for e in c.errors))
            return 1
    done = 0
    for target, what, mutate, expect in MUTATIONS:
        base = next((r for r in renders if target in r.name), None)
        if base is None:
            print(f"self-test: skipped ({what}): no render named *{target}*")
            continue
        docs = copy.deepcopy(base.docs)
        mutate(docs)
        c = Checker(Render(f"{base.name} [{what}]", docs), code, schemas).run()
        hit = [e for e in c.errors if all(s in e for s in expect)]
        done += 1
        if hit:
            print(f"self-test: caught {what}")
        else:
            failures += 1
            print(f"self-test: NOT CAUGHT: {what} (wanted an error containing {expect}); got:")
            print("\n".join("  " + e for e in c.errors) or "  (no errors)")
    print(f"self-test: {done - failures} of {done} broken manifests caught")
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------------

def load_render(spec: str) -> Render:
    name, _, path = spec.partition("=")
    if not path:
        raise SystemExit(f"k8s_check: want NAME=FILE, got {spec!r}")
    return Render(name, list(yaml.safe_load_all(Path(path).read_text())))


def render_here() -> list[Render]:
    """Without files: render base, dev and prod with kubectl kustomize, from a copy of k8s/ with
    secrets.env.example as prod's secrets.env when there is none, and fresh dev gateway secrets
    (whoever deploys makes them; git-ignored) when there are none."""
    import shutil
    import tempfile
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        k8s = Path(tmp) / "k8s"
        shutil.copytree(REPO / "k8s", k8s)
        env = k8s / "overlays/prod/secrets.env"
        if not env.exists():
            shutil.copy(k8s / "overlays/prod/secrets.env.example", env)
        for name in ("token-secret", "identity-key"):
            secret = k8s / "overlays/dev" / name
            if not secret.exists():
                secret.write_text(base64.b64encode(os.urandom(32)).decode())
        for name, d in (("base", "base"), ("dev", "overlays/dev"), ("prod", "overlays/prod")):
            text = subprocess.run(["kubectl", "kustomize", str(k8s / d)], check=True,
                                  capture_output=True, text=True).stdout
            out.append(Render(name, list(yaml.safe_load_all(text))))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("renders", nargs="*", metavar="NAME=FILE",
                    help="rendered manifests (default: render base, dev and prod here)")
    ap.add_argument("--kubernetes-version", default=DEFAULT_K8S_VERSION)
    ap.add_argument("--self-test", action="store_true",
                    help="check that deliberately broken manifests are caught")
    ap.add_argument("--write-env-registry", action="store_true",
                    help=f"rewrite {ENV_REGISTRY.relative_to(REPO)} from the code and exit")
    args = ap.parse_args()

    code = read_code()
    registry = "".join(f"{n}\n" for n in sorted(code.reads_anywhere))
    if args.write_env_registry:
        ENV_REGISTRY.write_text(registry)
        print(f"k8s_check: wrote {len(code.reads_anywhere)} names to "
              f"{ENV_REGISTRY.relative_to(REPO)}")
        return 0
    if not ENV_REGISTRY.exists() or ENV_REGISTRY.read_text() != registry:
        print(f"k8s_check: FAILED: {ENV_REGISTRY.relative_to(REPO)} (the variables the services "
              "accept at start) differs from what the code reads; run "
              "`python3 infra/k8s_check.py --write-env-registry` and commit it", file=sys.stderr)
        return 1
    schemas = Schemas(args.kubernetes_version, REPO / "k8s/crds")
    renders = [load_render(s) for s in args.renders] or render_here()
    if args.self_test:
        return self_test(renders, code, schemas)

    errors: list[str] = []
    for path, crd in schemas.crd_files:
        for e in schemas.validate(crd):
            errors.append(f"{path.relative_to(REPO)}: {obj_id(crd)}: {e}")
    print(f"k8s_check: code: {len(code.services)} services, "
          f"{len(code.reads_anywhere - OTEL_SDK_VARS)} variables read in the Rust code "
          f"(+{len(OTEL_SDK_VARS)} of the OpenTelemetry SDK); dispatch stream "
          f"{code.dispatch_stream!r}, group {code.dispatch_group!r}")
    for n in code.notes:
        print(f"k8s_check: note: {n}")
    print(f"k8s_check: schemas: Kubernetes {args.kubernetes_version} (kubernetes-validate, "
          f"strict) and {len(schemas.crds)} CRD versions from k8s/crds "
          f"({len(schemas.crd_files)} CRDs themselves valid)")
    expected: dict[str, dict[str, bool]] = {}
    for r in renders:
        c = Checker(r, code, schemas).run()
        errors += c.errors
        stats = ", ".join(f"{v} {k}" for k, v in c.stats.items())
        print(f"k8s_check: {r.name}: {len(r.docs)} objects; {stats}"
              + (f"; {len(c.errors)} PROBLEMS" if c.errors else "; ok"))
        for s, keys in c.expected_secrets.items():
            e = expected.setdefault(s, {})
            for k, opt in keys.items():
                e[k] = e.get(k, True) and opt
    for s, keys in sorted(expected.items()):
        req = sorted(k for k, o in keys.items() if not o)
        opt = sorted(k for k, o in keys.items() if o)
        print(f"k8s_check: Secret {s} (not rendered; the operator creates it) is read for: "
              f"{', '.join(req)}; optional: {', '.join(opt) or '-'}")
    if errors:
        print(f"\nk8s_check: FAILED, {len(errors)} problem(s):", file=sys.stderr)
        for e in errors:
            print("  " + e, file=sys.stderr)
        return 1
    print("k8s_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
