"""Turn a Docker/podman seccomp profile (containers-common's seccomp.json,
the same rules as Docker's default) into the OCI config's linux.seccomp for
an x86-64 container with Docker's default capabilities, as Docker and podman
do before they call runc. Usage: PROFILE CONFIG (CONFIG is edited)."""
import json
import sys

DEFAULT_CAPS = {
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
    "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
}
ARCH = "amd64"


def applies(rule):
    inc, exc = rule.get("includes") or {}, rule.get("excludes") or {}
    if inc.get("arches") and ARCH not in inc["arches"]:
        return False
    if inc.get("caps") and not set(inc["caps"]) <= DEFAULT_CAPS:
        return False
    if exc.get("arches") and ARCH in exc["arches"]:
        return False
    if exc.get("caps") and set(exc["caps"]) & DEFAULT_CAPS:
        return False
    if inc.get("minKernel") or exc.get("minKernel"):
        pass  # every rule's minimum kernel is older than this one's
    return True


profile = json.load(open(sys.argv[1]))
seccomp = {
    "defaultAction": profile["defaultAction"],
    "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
    "syscalls": [],
}
if "defaultErrnoRet" in profile:
    seccomp["defaultErrnoRet"] = profile["defaultErrnoRet"]
for rule in profile["syscalls"]:
    if not applies(rule):
        continue
    names = rule.get("names") or ([rule["name"]] if rule.get("name") else [])
    out = {"names": names, "action": rule["action"]}
    if rule.get("args"):
        out["args"] = rule["args"]
    if "errnoRet" in rule:
        out["errnoRet"] = rule["errnoRet"]
    seccomp["syscalls"].append(out)
config = json.load(open(sys.argv[2]))
config["linux"]["seccomp"] = seccomp
json.dump(config, open(sys.argv[2], "w"), indent=1)
