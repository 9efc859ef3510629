"""Hold the shape limits of issue #26: files and functions a reader can hold in their head,
and a package whose imports point one way.

    python tools/check_shape.py            # checks this repository, exit 1 on any finding
    python tools/check_shape.py ROOT       # checks another tree laid out the same way

Limits: a module of at most 500 lines (400 in src/memfit/estimate: `MODULE_LINES_IN`), a
function or method of at most 80 lines (its `def` line
to its last line, decorators excluded: ast's end_lineno - lineno + 1), in src/memfit, scripts/
and workflow/ (tests/ and benchmarks/ aside); no import cycle among memfit's modules; and each
subpackage imports only what its `__init__` docstring allows (`MAY_IMPORT`: imports point down
the DAG, ARCHITECTURE.md), the estimator's rooms (estimate/models, memory, trace, time) included;
and the library never imports a package kept beside it (`OUTSIDE_PACKAGES`: the public-measurement
checks in benchmarks/memfit_validation).

Imports counted for cycles: every `import memfit.x` / `from memfit.x import y` / relative import
anywhere in a module, at module level or inside a function. A function-level import still
makes the importing module depend on the imported one (it only defers the failure), so a cycle
through it is still two modules that cannot be understood apart. Imports under
`if TYPE_CHECKING:` count too: a reader following an annotation needs the other module just the
same (issue #26 lists `train <-> dsconfig`, which was such an import).
`from memfit.pkg import name` counts as an import of `memfit.pkg.name` when that is a module,
else of `memfit.pkg`. A package's `__init__` is its own node: importing `memfit.a.b` runs
`memfit.a/__init__` first, but that is Python's machinery, not a dependency the code states, so
the graph links only to the module named.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_MODULE_LINES = 500
# Folders held to a tighter module limit (issue #46: the estimator's modules split along seams a
# reader can name, none trimmed to the 500-line limit), relative to the repository root.
MODULE_LINES_IN = {"src/memfit/estimate": 400}
MAX_FUNCTION_LINES = 80
# Where the limits hold, relative to the repository root.
CHECKED_DIRS = ("src/memfit", "scripts", "workflow")
PACKAGE = "memfit"
PACKAGE_ROOT = "src"

# The layers, bottom up: what each subpackage (or top-level module) may import besides itself and
# the shared vocabulary. A name allows the package or module and everything under it. Modules not
# listed (memfit.cli, the `memfit` command) may import anything.
VOCABULARY = ("memfit", "memfit.space", "memfit.methods", "memfit.units", "memfit.atomic", "memfit.digest")
# The estimator's own vocabulary: what every room of estimate/ may import besides its lower rooms.
ESTIMATE_VOCABULARY = ("memfit.estimate.settings", "memfit.estimate.errors")
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "memfit.data": (),
    "memfit.train": ("memfit.data",),
    # the estimator traces the real loss code (memfit.estimate.trace.trace_step, memory.logits) and
    # measures tiny models' steps with the trainer's tracker (memfit.estimate.coverage)
    # and adapts models with the trainer's LoRA configuration (memfit.train.lora)
    "memfit.estimate": (
        "memfit.data",
        "memfit.train.losses",
        "memfit.train.vocab_loss",
        "memfit.train.memory",
        "memfit.train.lora",
    ),
    # the estimator's rooms, bottom up (each `__init__` says what it owns); core, fit, selection
    # and the CLI sit on top of them in memfit.estimate itself
    "memfit.estimate.settings": (),
    "memfit.estimate.errors": (),
    "memfit.estimate.models": (*ESTIMATE_VOCABULARY, "memfit.train.lora"),
    "memfit.estimate.memory": (*ESTIMATE_VOCABULARY, "memfit.estimate.models", "memfit.train.vocab_loss"),
    "memfit.estimate.trace": (
        *ESTIMATE_VOCABULARY,
        "memfit.estimate.models",
        "memfit.estimate.memory",
        "memfit.train.losses",
        "memfit.train.lora",
    ),
    "memfit.estimate.time": (
        *ESTIMATE_VOCABULARY,
        "memfit.estimate.models",
        "memfit.estimate.memory",
        "memfit.estimate.trace",
    ),
    "memfit.exports": ("memfit.train.run_config",),
    "memfit.workflow": ("memfit.data", "memfit.train", "memfit.estimate", "memfit.exports"),
    "memfit.results": ("memfit.data", "memfit.train", "memfit.estimate", "memfit.exports", "memfit.workflow"),
    "memfit.report": (
        "memfit.data",
        "memfit.train",
        "memfit.estimate",
        "memfit.exports",
        "memfit.workflow",
        "memfit.results",
    ),
}
# Packages beside the library that it never imports: the checks against public measurements
# (benchmarks/memfit_validation) use the library, not the other way round.
OUTSIDE_PACKAGES = ("memfit_validation",)


def _python_files(root: Path) -> list[Path]:
    files: list[Path] = []
    for rel in CHECKED_DIRS:
        base = root / rel
        if base.is_dir():
            files.extend(sorted(p for p in base.rglob("*.py") if "__pycache__" not in p.parts))
    return files


def size_findings(root: Path) -> list[str]:
    """`file:line: ...` for every module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES."""
    findings = []
    for path in _python_files(root):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(root)
        n_lines = len(text.splitlines())
        limit = min([MAX_MODULE_LINES] + [n for d, n in MODULE_LINES_IN.items() if rel.is_relative_to(d)])
        if n_lines > limit:
            findings.append(f"{rel}:1: module has {n_lines} lines (limit {limit})")
        tree = ast.parse(text, filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    findings.append(
                        f"{rel}:{node.lineno}: function {node.name} has {size} lines (limit {MAX_FUNCTION_LINES})"
                    )
    return findings


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """memfit module -> the memfit modules it imports (anywhere in its body)."""
    src = root / PACKAGE_ROOT
    paths = sorted(p for p in (src / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    modules = {_module_name(p, src): p for p in paths}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    targets.append(sub if sub in modules else mod)
            for target in targets:
                # `import memfit.a.b` names memfit.a.b; keep the longest known prefix.
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                dep = ".".join(parts)
                if dep and dep != name and dep.split(".")[0] == PACKAGE:
                    graph[name].add(dep)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """One cycle per strongly connected component of more than one module (Tarjan's algorithm):
    the shortest closed path `a -> b -> ... -> a` through its first module, and all its modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    cycles = []
    for comp in components:
        members = set(comp)
        start = min(comp)
        # Shortest way back to start through the component (breadth first).
        prev: dict[str, str] = {}
        frontier = [start]
        seen = {start}
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in seen:
                        seen.add(w)
                        prev[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        path = [found]
        while path[-1] != start:
            path.append(prev[path[-1]])
        path.reverse()
        cycles.append((path + [start], sorted(comp)))
    return sorted(cycles)


def cycle_findings(root: Path) -> list[str]:
    findings = []
    for cycle, members in find_cycles(import_graph(root)):
        line = "import cycle: " + " -> ".join(cycle)
        if len(members) > len(cycle) - 1:
            line += f" (the modules importing each other: {', '.join(members)})"
        findings.append(line)
    return findings


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_findings(root: Path) -> list[str]:
    """Imports that point up: a module of a listed layer importing what MAY_IMPORT does not allow
    it (the vocabulary may import only the vocabulary). A layer that does not exist is skipped."""
    graph = import_graph(root)
    findings = []
    for mod in sorted(graph):
        if mod in VOCABULARY[1:]:
            allowed: tuple[str, ...] = ()
            owner = mod
        else:
            owners = [p for p in MAY_IMPORT if _within(mod, p)]
            if not owners:
                continue
            owner = max(owners, key=len)
            allowed = (owner, *MAY_IMPORT[owner])
        for dep in sorted(graph[mod]):
            if dep in VOCABULARY or any(_within(dep, a) for a in allowed):
                continue
            findings.append(
                f"layer: {mod} imports {dep} ({owner} may import "
                f"{', '.join(MAY_IMPORT.get(owner, ())) or 'only the vocabulary'}; "
                f"{', '.join(VOCABULARY[1:])} for all)"
            )
    return findings


def outside_findings(root: Path) -> list[str]:
    """`file:line: ...` for every import of an OUTSIDE_PACKAGES package from the library."""
    src = root / PACKAGE_ROOT / PACKAGE
    findings = []
    for path in sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in OUTSIDE_PACKAGES:
                    findings.append(
                        f"{path.relative_to(root)}:{node.lineno}: imports {name} "
                        f"({name.split('.')[0]} is outside the library: the library never imports it)"
                    )
    return findings


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0]) if args else Path(__file__).resolve().parent.parent
    findings = size_findings(root) + cycle_findings(root) + layer_findings(root) + outside_findings(root)
    for line in findings:
        print(line)
    if findings:
        print(f"check_shape: {len(findings)} finding(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
