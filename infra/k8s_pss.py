"""The Kubernetes Pod Security Standards, "restricted" profile (which includes "baseline"), as
Pod Security Admission enforces them (policy version v1.32), over a rendered pod template.

Written from the standard (https://kubernetes.io/docs/concepts/security/pod-security-standards/)
because no offline tool for it installs from PyPI; infra/k8s_check.py runs it over every pod of
every render, and its self-test breaks one rule at a time to show each is caught.
"""

from __future__ import annotations

# Baseline: capabilities a container may add (restricted allows NET_BIND_SERVICE only).
RESTRICTED_ADD_CAPS = {"NET_BIND_SERVICE"}
# Restricted: the only volume types allowed.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}
# Baseline: the "safe" sysctls.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range",
                "net.ipv4.ip_unprivileged_port_start", "net.ipv4.tcp_syncookies",
                "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout",
                "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t",
                 "container_engine_t"}


def _containers(spec: dict):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield kind, c


def restricted_violations(spec: dict) -> list[str]:
    """What in pod spec `spec` breaks the restricted profile; empty when it complies."""
    out: list[str] = []
    psc = spec.get("securityContext") or {}

    # -- baseline --
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(f"{host} is true")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            out.append(f"volume {v.get('name')} is a hostPath")
        kinds = [k for k in v if k != "name"]
        if kinds and kinds[0] not in RESTRICTED_VOLUMES:
            out.append(f"volume {v.get('name')} is of type {kinds[0]}, not one restricted allows")
    for s in psc.get("sysctls") or []:
        if s.get("name") not in SAFE_SYSCTLS:
            out.append(f"sysctl {s.get('name')} is not a safe sysctl")
    if (psc.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
        out.append("pod seLinuxOptions.type is not an allowed type")
    if (psc.get("appArmorProfile") or {}).get("type") == "Unconfined":
        out.append("pod appArmorProfile is Unconfined")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile is {pod_seccomp}")
    if psc.get("runAsNonRoot") is False:
        out.append("pod runAsNonRoot is false")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser is 0")

    for kind, c in _containers(spec):
        name = f"{kind[:-1]} {c.get('name')}"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        caps = sc.get("capabilities") or {}
        added = set(caps.get("add") or []) - RESTRICTED_ADD_CAPS
        if added:
            out.append(f"{name}: adds capabilities {sorted(added)}")
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities do not drop ALL")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"{name}: hostPort {p['hostPort']}")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount {sc['procMount']}")
        if (sc.get("seLinuxOptions") or {}).get("type", "") not in SELINUX_TYPES:
            out.append(f"{name}: seLinuxOptions.type is not an allowed type")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"{name}: appArmorProfile is Unconfined")
        # -- restricted --
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{name}: runAsNonRoot is not true (container or pod)")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile is neither RuntimeDefault nor Localhost "
                       "(container or pod)")
    return out
