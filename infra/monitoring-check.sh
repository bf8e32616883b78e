#!/usr/bin/env bash
# Dashboards and alerts: the Prometheus config and alert rules are valid (`promtool check`),
# every alert fires in its unit test (`promtool test rules`), every dashboard is valid JSON with
# queries, and every alert has a runbook: a heading of its own in docs/operations.md (under
# "Alerts") that its `runbook:` annotation, in the rules and in their tests, links to
# (docs/operations.md#<alert name in lowercase>). That every metric named
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

rules = [r for g in yaml.safe_load(open("prometheus/alerts.yml"))["groups"] for r in g["rules"]]
alerts = [r["alert"] for r in rules]
tested = set(re.findall(r"alertname: (\w+)", open("prometheus/alerts.test.yml").read()))
test_runbooks = dict(re.findall(r"alertname: (\w+)(?:(?!alertname:)[\s\S])*?runbook: (\S+)",
                                open("prometheus/alerts.test.yml").read()))
operations = open("../docs/operations.md").read()
section = operations.split("\n## Alerts", 1)[1].split("\n## ", 1)[0] if "\n## Alerts" in operations else ""
headings = set(re.findall(r"^### (\w+)\s*$", section, re.M))
for rule in rules:
    alert = rule["alert"]
    runbook = f"docs/operations.md#{alert.lower()}"
    if alert not in tested:
        errors.append(f"alert {alert} has no unit test in prometheus/alerts.test.yml")
    if alert not in headings:
        errors.append(f"alert {alert} has no heading `### {alert}` under \"## Alerts\" in docs/operations.md")
    if rule.get("annotations", {}).get("runbook") != runbook:
        errors.append(f"alert {alert}: its runbook annotation in prometheus/alerts.yml is not {runbook}")
    if alert in test_runbooks and test_runbooks[alert] != runbook:
        errors.append(f"alert {alert}: its runbook in prometheus/alerts.test.yml is not {runbook}")
if errors:
    sys.exit("\n".join(errors))
print(f"dashboards and {len(alerts)} alerts: ok")
PY
