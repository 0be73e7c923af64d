"""Walk a pip --report resolution from a root distribution and print what a bundle must pack.

usage: graph.py REPORT HAVE_LIST ROOT [--exclude name,...]

HAVE_LIST names the distributions already present on the target (the GPU image's packages plus those the vllm bundle
packs), one `name` or `name==version` a line. The walk stops at them and at the excluded (optional) names; every
other distribution reached is printed as `NEED name==version  <- parents`, and each edge into a present package as
`HAVE name  specifier  <- parent  (resolved version)` so its pin can be checked against the target's version; what a
present package needs only for an extra asked of it is walked too (the target may lack it).
Markers are evaluated for CPython 3.12 on Linux x86_64 whatever interpreter runs this.
"""

import json
import re
import sys

from pip._vendor.packaging.requirements import Requirement

ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_machine": "x86_64",
    "platform_system": "Linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def norm(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(meta: dict, extras: frozenset) -> list:
    """The requirements of one resolved distribution that apply with the given extras on the target."""
    out = []
    for spec in meta.get("requires_dist") or []:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate({**ENV, "extra": e}) for e in ("", *sorted(extras))):
            out.append(req)
    return out


def extra_only(meta: dict | None, extras: set) -> list:
    """Requirements a present package gains only through the extras asked of it (imageio[ffmpeg] -> imageio-ffmpeg):
    the target has the package but not necessarily those."""
    if meta is None or not extras:
        return []
    plain = {str(r) for r in requirements(meta, frozenset())}
    return [r for r in requirements(meta, frozenset(extras)) if str(r) not in plain]


def main() -> None:
    report, have_list, root = sys.argv[1:4]
    exclude = set()
    if len(sys.argv) > 5 and sys.argv[4] == "--exclude":
        exclude = {norm(x) for x in sys.argv[5].split(",") if x}
    have = {norm(line.split("==")[0].strip()) for line in open(have_list) if line.strip() and not line.startswith("#")}
    items = {norm(i["metadata"]["name"]): i["metadata"] for i in json.load(open(report))["install"]}
    seen: dict = {}
    parents: dict = {}
    edges = set()
    stack = [(norm(root), frozenset())]
    while stack:
        name, extras = stack.pop()
        if name in seen and extras <= seen[name]:
            continue
        seen[name] = seen.get(name, frozenset()) | extras
        for req in requirements(items[name], seen[name]):
            dep = norm(req.name)
            if dep in exclude:
                continue
            parents.setdefault(dep, set()).add(name)
            if dep in have:
                edges.add((dep, str(req.specifier) or "-", name))
                for extra_req in extra_only(items.get(dep), req.extras):
                    sub = norm(extra_req.name)
                    if sub not in have and sub not in exclude:
                        parents.setdefault(sub, set()).add(f"{dep}[{','.join(sorted(req.extras))}]")
                        stack.append((sub, frozenset(extra_req.extras)))
            else:
                stack.append((dep, frozenset(req.extras)))
    for name in sorted(seen):
        print(f"NEED {items[name]['name']}=={items[name]['version']}  <- {','.join(sorted(parents.get(name, [])))}")
    for dep, spec, parent in sorted(edges):
        resolved = items[dep]["version"] if dep in items else "?"
        print(f"HAVE {dep:28s} {spec:24s} <- {parent}  (resolved {resolved})")


if __name__ == "__main__":
    main()
