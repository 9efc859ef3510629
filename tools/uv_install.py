"""Install a lock file into a venv with uv, where pip would take minutes (make install).

uv installs the same exact, hash-free pins as `pip install --no-deps -r LOCK` (measured on a
2-core machine: pip 371 s, uv 18-27 s for requirements-cpu.lock), but reads neither pip's
config files nor its PIP_* variables. This passes pip's index, extra indexes and find-links
(`pip config list`, which merges the files and the environment) to uv, so a machine whose pip
is pointed at a local mirror or wheel folder (a CI image, an air-gapped cluster) installs from
the same places. Exit status: uv's (make falls back to pip when it is not 0).

    python tools/uv_install.py VENV_PYTHON LOCK
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

# pip config keys -> uv flags (uv's `pip install` takes the same names)
FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}


def pip_sources(python: str) -> list[str]:
    """uv flags for every index and find-links pip would use (`pip config list`, last value wins)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    values: dict[str, str] = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in FLAGS and value:
            values[name] = value.strip().strip("'\"")
    flags = []
    for name, flag in FLAGS.items():
        for item in values.get(name, "").split():
            flags += [flag, item]
    return flags


def main(argv: list[str]) -> int:
    python, lock = argv
    uv = Path(python).parent / "uv"
    # pip takes a version from whichever index has it; uv, by default, only from the first index
    # that knows the package (`--index-strategy unsafe-best-match` is pip's behaviour)
    sources = [*pip_sources(python), "--index-strategy", "unsafe-best-match"]
    # --compile-bytecode: the .pyc files pip writes at install and uv by default does not. Without
    # them a process compiles what it imports from source, and never caches it where
    # PYTHONDONTWRITEBYTECODE is set (as on memfit's CI machines): every rank and Snakemake job
    # compiled transformers and torch again, 9 of a data preparation's 17 CPU s (2026-11-28)
    cmd = [str(uv), "pip", "install", "--quiet", "--python", python, "--no-deps", "--compile-bytecode"]
    cmd += [*sources, "-r", lock]
    print("memfit install: " + shlex.join(cmd), flush=True)
    # copy, not hard-link, from uv's cache: the cache and the venv may sit on different filesystems
    env = {**os.environ, "UV_LINK_MODE": os.environ.get("UV_LINK_MODE", "copy")}
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
