"""tools/check_shape.py: the module/function size limits and the import-cycle ban of issue #26."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "check_shape.py"


def _run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(root)], capture_output=True, text=True, check=False)


def _write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small clean tree laid out like the repository: a package, a script and tests."""
    _write(tmp_path, "src/memfit/__init__.py", '"""memfit."""\n')
    _write(tmp_path, "src/memfit/a.py", "from memfit import b\n\n\ndef f():\n    return b.g()\n")
    _write(tmp_path, "src/memfit/b.py", "def g():\n    return 1\n")
    _write(tmp_path, "scripts/run.py", "from memfit.a import f\n\nf()\n")
    return tmp_path


def _function(name: str, n_lines: int) -> str:
    """A function of exactly n_lines lines (its def line included), decorated by one line."""
    body = "".join(f"    x{i} = {i}\n" for i in range(n_lines - 2))
    return f"@staticmethod\ndef {name}():\n{body}    return 0\n"


def test_clean_tree_passes(tree):
    result = _run(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_module_of_501_lines_fails_and_500_passes(tree):
    _write(tree, "src/memfit/big.py", "x = 1\n" * 500)
    assert _run(tree).returncode == 0
    _write(tree, "src/memfit/big.py", "x = 1\n" * 501)
    result = _run(tree)
    assert result.returncode == 1
    assert "src/memfit/big.py:1: module has 501 lines (limit 500)" in result.stdout


def test_function_of_81_lines_fails_and_80_passes(tree):
    # The decorator line is not counted: 80 lines from `def` pass although 81 with it.
    _write(tree, "scripts/long.py", "\n\n" + _function("long_one", 80))
    assert _run(tree).returncode == 0
    _write(tree, "scripts/long.py", "\n\n" + _function("long_one", 81))
    result = _run(tree)
    assert result.returncode == 1
    assert "scripts/long.py:4: function long_one has 81 lines (limit 80)" in result.stdout


def test_method_in_workflow_dir_is_checked(tree):
    method = "class C:\n" + "".join("    " + line + "\n" for line in _function("m", 81).splitlines())
    _write(tree, "workflow/helper.py", method)
    result = _run(tree)
    assert result.returncode == 1
    assert "workflow/helper.py:3: function m has 81 lines" in result.stdout


def test_tests_and_benchmarks_are_not_checked(tree):
    _write(tree, "tests/test_big.py", "x = 1\n" * 900)
    _write(tree, "benchmarks/bench.py", _function("sweep", 200))
    assert _run(tree).returncode == 0


def test_two_module_cycle_fails(tree):
    # b imports a back inside a function: deferred, still a cycle.
    _write(tree, "src/memfit/b.py", "def g():\n    from memfit.a import f\n\n    return 1\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "import cycle: memfit.a -> memfit.b -> memfit.a" in result.stdout


def test_cycle_through_subpackages_and_relative_imports(tree):
    _write(tree, "src/memfit/plan/__init__.py", '"""plan."""\n')
    _write(tree, "src/memfit/plan/loop.py", "from .settings import RunConfig\n")
    _write(
        tree,
        "src/memfit/plan/settings.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from memfit.plan import loop\n",
    )
    result = _run(tree)
    assert result.returncode == 1
    assert "memfit.plan.loop -> memfit.plan.settings -> memfit.plan.loop" in result.stdout


def test_three_module_cycle_names_each_module(tree):
    _write(tree, "src/memfit/b.py", "import memfit.c\n")
    _write(tree, "src/memfit/c.py", "from memfit import a\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "import cycle: memfit.a -> memfit.b -> memfit.c -> memfit.a" in result.stdout


def test_the_repository_passes():
    result = _run(REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_an_import_pointing_up_the_layers_fails(tree):
    # train/ sits below workflow/: a training module reaching for a stage is refused ...
    _write(tree, "src/memfit/train/__init__.py", '"""train."""\n')
    _write(tree, "src/memfit/workflow/__init__.py", '"""workflow."""\n')
    _write(tree, "src/memfit/workflow/rows.py", "ROWS = 1\n")
    _write(tree, "src/memfit/train/losses.py", "def f():\n    from memfit.workflow import rows\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "layer: memfit.train.losses imports memfit.workflow.rows" in result.stdout
    # ... while the stage importing the training code is the direction the DAG allows
    _write(tree, "src/memfit/train/losses.py", "X = 1\n")
    _write(tree, "src/memfit/workflow/rows.py", "from memfit.train.losses import X\n")
    assert _run(tree).returncode == 0


def test_the_vocabulary_imports_only_the_vocabulary(tree):
    _write(tree, "src/memfit/estimate/__init__.py", '"""estimate."""\n')
    _write(tree, "src/memfit/estimate/core.py", "from memfit.units import GIB\n")
    _write(tree, "src/memfit/units.py", "from memfit.estimate import core\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "layer: memfit.units imports memfit.estimate.core" in result.stdout


def _estimate_rooms(tree: Path) -> None:
    """The estimator's rooms as in the repository: models/ at the bottom, memory/ above it."""
    _write(tree, "src/memfit/estimate/__init__.py", '"""estimate."""\n')
    _write(tree, "src/memfit/estimate/core.py", "from memfit.estimate.memory import states\n")
    _write(tree, "src/memfit/estimate/settings.py", "X = 1\n")
    _write(tree, "src/memfit/estimate/models/__init__.py", '"""models."""\n')
    _write(tree, "src/memfit/estimate/models/arch.py", "from memfit.estimate.settings import X\n")
    _write(tree, "src/memfit/estimate/memory/__init__.py", '"""memory."""\n')
    _write(tree, "src/memfit/estimate/memory/states.py", "from memfit.estimate.models.arch import X\n")


def test_an_estimator_room_importing_a_higher_room_fails(tree):
    _estimate_rooms(tree)
    assert _run(tree).returncode == 0  # memory/ on models/, core on memory/: downwards
    # models/ is below memory/: a card reaching for a memory term is refused
    _write(tree, "src/memfit/estimate/models/arch.py", "def f():\n    from memfit.estimate.memory import states\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "layer: memfit.estimate.models.arch imports memfit.estimate.memory.states" in result.stdout


def test_an_estimator_room_importing_the_top_of_the_estimator_fails(tree):
    _estimate_rooms(tree)
    # a room never imports core (nor the package's public API, which imports core)
    _write(tree, "src/memfit/estimate/memory/states.py", "from memfit.estimate import core\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "layer: memfit.estimate.memory.states imports memfit.estimate.core" in result.stdout
    _write(tree, "src/memfit/estimate/memory/states.py", "from memfit.estimate import settings\n")
    assert _run(tree).returncode == 0  # the estimator's vocabulary is open to every room
    _write(tree, "src/memfit/estimate/settings.py", "from memfit.estimate.models import arch\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "layer: memfit.estimate.settings imports memfit.estimate.models.arch" in result.stdout


def test_the_library_importing_the_validation_package_fails(tree):
    _write(tree, "src/memfit/b.py", "def g():\n    import memfit_validation.memory\n\n    return 1\n")
    result = _run(tree)
    assert result.returncode == 1
    assert "src/memfit/b.py:2: imports memfit_validation.memory (memfit_validation is outside the library" in (
        result.stdout
    )


def test_every_room_of_the_estimator_has_its_layer():
    """A new sub-package of estimate/ is not free of the layering: each is in MAY_IMPORT."""
    sys.path.insert(0, str(TOOL.parent))
    try:
        import check_shape
    finally:
        sys.path.remove(str(TOOL.parent))
    rooms = sorted(p.name for p in (REPO / "src/memfit/estimate").iterdir() if (p / "__init__.py").is_file())
    assert rooms == ["memory", "models", "time", "trace"]
    assert all(f"memfit.estimate.{room}" in check_shape.MAY_IMPORT for room in rooms)


def test_an_estimator_module_of_401_lines_fails_and_400_passes(tree):
    """The estimator's modules are held to 400 lines (issue #46), the rest of the library to 500."""
    _write(tree, "src/memfit/estimate/__init__.py", '"""estimate."""\n')
    _write(tree, "src/memfit/estimate/memory/__init__.py", '"""memory."""\n')
    _write(tree, "src/memfit/estimate/memory/states.py", "x = 1\n" * 400)
    _write(tree, "src/memfit/big.py", "x = 1\n" * 450)
    assert _run(tree).returncode == 0
    _write(tree, "src/memfit/estimate/memory/states.py", "x = 1\n" * 401)
    result = _run(tree)
    assert result.returncode == 1
    assert "src/memfit/estimate/memory/states.py:1: module has 401 lines (limit 400)" in result.stdout
