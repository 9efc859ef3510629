"""Write the conda envs' pip pins from requirements-cpu.lock (or, with --check, say which differ).

`make lock` runs this after uv rewrites the lock, so envs/memfit-cpu.yaml and envs/memfit-gpu.yaml
pin exactly the versions the CPU install (and so CI) tested. Every direct dependency of memfit
(pyproject.toml [project.dependencies]) gets the lock's version; torch is pinned without the
local `+cpu` tag, since the GPU env takes the CUDA build of the same release. Lines that are not
pins of locked packages (index URLs, `-e ..`, the GPU-only flash-attn pin) are
kept as written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PIN = re.compile(r"^(?P<indent>\s*- )(?P<name>[A-Za-z0-9_.\-]+)==(?P<version>[^\s#]+)(?P<rest>.*)$")
NAME = re.compile(r"^[A-Za-z0-9_.\-]+")


def normalize(name: str) -> str:
    """PEP 503 normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path) -> dict[str, str]:
    out = {}
    for line in lock.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            out[normalize(m.group(1))] = m.group(2).split("+")[0]
    return out


def direct_dependencies(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [normalize(NAME.match(d).group(0)) for d in deps]


def synced(env_text: str, locked: dict[str, str], direct: list[str]) -> str:
    """The env file with every locked pin at the lock's version and every missing direct
    dependency pinned just before the `-e ..` line."""
    lines, seen = [], set()
    for line in env_text.splitlines():
        m = PIN.match(line)
        if m and normalize(m.group("name")) in locked:
            name = normalize(m.group("name"))
            seen.add(name)
            line = f"{m.group('indent')}{m.group('name')}=={locked[name]}{m.group('rest')}"
        elif line.strip().startswith("- -e "):
            indent = line[: line.index("-")]
            lines += [f"{indent}- {d}=={locked[d]}" for d in direct if d not in seen and d in locked]
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    locked = locked_versions(REPO / "requirements-cpu.lock")
    direct = direct_dependencies(REPO / "pyproject.toml")
    stale = []
    for env in sorted((REPO / "envs").glob("*.yaml")):
        text = env.read_text()
        new = synced(text, locked, direct)
        if new != text:
            stale.append(env.relative_to(REPO))
            if not check:
                env.write_text(new)
    if check and stale:
        print(f"stale pins (run `make lock`): {', '.join(map(str, stale))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
