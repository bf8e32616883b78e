#!/usr/bin/env bash
# Dashboards and alerts: the Prometheus config and alert rules are valid (`promtool check`),
# every alert fires in its unit test (`promtool test rules`), every dashboard is valid JSON with
# queries, and every alert has a runbook line in README "Operating". That every metric named
# here is one the services export is checked against a running suite by
# services/suite/tests/metrics.rs (cargo test).
set -euo pipefail
cd "$(dirname "$0")"

if ! command -v promtool >/dev/null 2>&1; then
  # Debian's prometheus package ships promtool.
  if [ "$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq >/dev/null 2>&1 \
      && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq prometheus >/dev/null 2>&1; }
  hash -r
fi

promtool check config prometheus/prometheus.yml
promtool test rules prometheus/alerts.test.yml

python3 - <<'PY'
import json, pathlib, re, sys

import yaml  # PyYAML

errors = []
for path in sorted(pathlib.Path("grafana/dashboards").glob("*.json")):
    dashboard = json.loads(path.read_text())
    exprs = [t.get("expr", "") for p in dashboard.get("panels", []) for t in p.get("targets", [])]
    if not exprs or not all(exprs):
        errors.append(f"{path}: every panel target needs an expr")
    if dashboard.get("uid") != path.stem:
        errors.append(f"{path}: uid {dashboard.get('uid')!r} is not the file name")

alerts = [r["alert"] for g in yaml.safe_load(open("prometheus/alerts.yml"))["groups"] for r in g["rules"]]
tested = set(re.findall(r"alertname: (\w+)", open("prometheus/alerts.test.yml").read()))
readme = open("../README.md").read()
operating = readme.split("\n## Operating", 1)[1].split("\n## ", 1)[0] if "\n## Operating" in readme else ""
for alert in alerts:
    if alert not in tested:
        errors.append(f"alert {alert} has no unit test in prometheus/alerts.test.yml")
    if f"`{alert}`" not in operating:
        errors.append(f"alert {alert} has no runbook line in README \"Operating\"")
if errors:
    sys.exit("\n".join(errors))
print(f"dashboards and {len(alerts)} alerts: ok")
PY
