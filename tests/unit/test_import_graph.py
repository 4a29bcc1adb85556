"""The product's imports flow one way, and no module or package imports itself back.

The packages are those pyproject.toml maps into `layerbus` (`[tool.setuptools.package-dir]`), so a new
package is checked as soon as it is installed, and fails here until `ALLOWED` gives it a place. Files are
parsed with `ast`, never imported: every import statement counts, at module level, inside functions and
under `if TYPE_CHECKING:`, relative ones resolved against the file's package.

The intended layering, `ALLOWED` below, in the order wire, models -> stages, storage -> broker -> jobs
-> evals -> cli (lower never imports higher; the broker and the stages meet only in `wire`, and both read model
directories through `models`):

  package  may import                     what it is, and why it sits there
  -------  -----------------------------  ---------------------------------------------------------------
  wire     -                              the vocabulary both sides speak: frames, codecs, message kinds,
                                          step rows, sampling parameters, identities, layer spans; no
                                          transformers either, so importing it changes no global state
  models   -                              reading model directories: config, safetensors headers, weight
                                          sizes, attention shape, tokenizer, default model, GGUF import,
                                          and the home folder: plain file reading that both sides use
  stages   wire, models                   the stage process: shards, KV cache, forward step, sampling
  storage  wire, models                   job store and Parquet results (models for the home folder, wire
                                          for the chain's text form in the run info)
  broker   wire, models, storage          drives the stages over the wire and never imports them
  jobs     wire, models, storage, broker  job logic: inputs, task and corpus prompts; the job runner
                                          drives the broker, so jobs sit above it
  evals    wire, models, storage, broker, jobs
                                          eval tasks, encodings, metrics and comparisons; evals run as
                                          jobs, so they sit above them
  serve    wire, models, storage, jobs, evals
                                          `layerbus serve`: OpenAI's Files and Batch API and the dashboard over
                                          the store; batches are jobs, so it sits above jobs and evals
  cli      all of them                    the `layerbus` command wires everything together

Optional extras (`OPTIONAL_THIRD_PARTY`): `lm_eval` (the `lm-eval` extra) is imported only by
evals.lm_eval_adapter and evals.lm_eval_cli, and no other product module imports those two, so the core
install never needs it.

An import of `layerbus.a.b` counts as an edge to module `layerbus.a.b` only (not to the
package `layerbus.a` that Python also runs first): a package's `__init__` that lazily imports its own
modules would otherwise make every module of that package a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "layerbus"
# package -> the layerbus packages it may import (the table above).
ALLOWED: dict[str, tuple[str, ...]] = {
    "wire": (),
    "models": (),
    "planner": ("wire", "models"),
    "stages": ("wire", "models"),
    "storage": ("wire", "models", "planner"),
    "broker": ("wire", "models", "planner", "storage"),
    "jobs": ("wire", "models", "planner", "storage", "broker"),
    "launch": ("wire", "models", "planner", "stages", "storage", "broker", "jobs"),
    "evals": ("wire", "models", "planner", "storage", "broker", "jobs", "launch"),
    "serve": ("wire", "models", "planner", "storage", "jobs", "evals"),
    "cli": ("wire", "models", "planner", "stages", "storage", "broker", "jobs", "launch", "evals", "serve"),
}
# Third-party imports a package must not make anywhere (module-level or not).
BANNED_THIRD_PARTY = {"wire": ("transformers",)}
# Optional extras (pyproject.toml [project.optional-dependencies]) -> the only modules that may import them. Any
# other module importing one of those modules would make the extra required where it is imported.
OPTIONAL_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "lm_eval": ("layerbus.evals.lm_eval_adapter", "layerbus.evals.lm_eval_cli"),
}


@dataclass(frozen=True)
class Import:
    """One imported layerbus module, as one import statement names it."""

    source: str  # importing module, e.g. layerbus.broker.broker
    target: str  # imported module, e.g. layerbus.wire.protocol
    file: Path  # the importing file, relative to the repository root
    line: int
    statement: str  # the statement as written (unparsed), for the failure message

    def where(self) -> str:
        return f"{self.file}:{self.line}: `{self.statement}`"


def package_dirs(root: Path) -> dict[str, Path]:
    """Top-level product package (e.g. "broker") -> its folder, from pyproject.toml's package-dir."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    return {name.split(".")[1]: root / folder for name, folder in mapping.items()
            if name.startswith(f"{NAMESPACE}.") and name.count(".") == 1}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of every product package."""
    modules = {}
    for package, folder in package_dirs(root).items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = [NAMESPACE, package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def read_imports(root: Path, modules: dict[str, Path]) -> tuple[list[Import], list[Import]]:
    """(imports of layerbus modules, imports of anything else); the second keep the top-level name as target."""
    ours, others = [], []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            for target in dict.fromkeys(_targets(node, package, modules)):  # once per statement
                found = Import(module, target, path.relative_to(root), node.lineno, ast.unparse(node))
                is_ours = target == NAMESPACE or target.startswith(f"{NAMESPACE}.")
                (ours if is_ours else others).append(found)
    return ours, others


def _targets(node: ast.AST, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: `from . import x` is the file's package, each extra dot one level up
        base = package.split(".")[:len(package.split(".")) - node.level + 1]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    # `from pkg import name` imports module pkg.name when there is one, otherwise a name of pkg.
    return [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def direction_problems(imports: list[Import], others: list[Import], modules: dict[str, Path],
                       allowed: dict[str, tuple[str, ...]], packages: set[str]) -> list[str]:
    problems = [f"pyproject.toml maps package {NAMESPACE}.{package} but the layering does not place it: add it "
                f"to ALLOWED in {Path(__file__).name}" for package in sorted(packages - set(allowed))]
    for found in imports:
        source, target = top_package(found.source), top_package(found.target)
        if found.target not in modules:
            problems.append(f"{found.where()}: imports {found.target}, which is no module of the product packages "
                            f"{sorted(packages)}")
        elif source != target and source in allowed and target not in allowed[source]:
            may = ", ".join(allowed[source]) or "no other layerbus package"
            problems.append(f"{found.where()}: {source} must not import {target} ({source} may import {may})")
    for found in others:
        banned = BANNED_THIRD_PARTY.get(top_package(found.source), ())
        if found.target.split(".")[0] in banned:
            problems.append(f"{found.where()}: {top_package(found.source)} must not import {found.target}")
    return problems


def optional_problems(imports: list[Import], others: list[Import],
                      optional: dict[str, tuple[str, ...]] = OPTIONAL_THIRD_PARTY) -> list[str]:
    """Imports of an optional extra outside its modules, and imports of those modules from anywhere else."""
    problems = []
    for found in others:
        owners = optional.get(found.target.split(".")[0])
        if owners is not None and found.source not in owners:
            problems.append(f"{found.where()}: {found.target} is an optional extra; only {', '.join(owners)} "
                            "may import it")
    for owners in optional.values():
        for found in imports:
            if found.target in owners and found.source not in owners:
                problems.append(f"{found.where()}: {found.target} needs an optional extra; import it only from "
                                f"{', '.join(owners)} (or from tests)")
    return problems


def cycle_problems(imports: list[Import], node_of) -> list[str]:
    """One message per import cycle among the nodes (`node_of` maps a module to its node: the
    module itself, or its package), listing the import that makes each hop."""
    edges: dict[str, dict[str, Import]] = {}
    for found in imports:
        source, target = node_of(found.source), node_of(found.target)
        if source != target:
            edges.setdefault(source, {}).setdefault(target, found)
    problems = []
    for component in strongly_connected(edges):
        if len(component) > 1:
            path = _cycle_through(min(component), component, edges)
            hops = [edges[a][b] for a, b in zip(path, path[1:])]
            problems.append(f"import cycle {' -> '.join(path)}:\n" + "\n".join(f"    {hop.where()}" for hop in hops))
    return problems


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the module graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, {})))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
    return components


def _cycle_through(start: str, component: set[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """The shortest path start -> ... -> start inside the component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(edges.get(node, {})):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt in component and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{start} is on no cycle of {sorted(component)}")


def check_import_graph(root: Path, allowed: dict[str, tuple[str, ...]] = ALLOWED) -> list[str]:
    """Every import against the layering and every cycle, between packages and between modules."""
    modules = module_files(root)
    imports, others = read_imports(root, modules)
    problems = direction_problems(imports, others, modules, allowed, set(package_dirs(root)))
    problems += optional_problems(imports, others)
    problems += cycle_problems(imports, lambda module: top_package(module))
    problems += cycle_problems(imports, lambda module: module)
    return problems


def test_product_imports_flow_one_way():
    problems = check_import_graph(REPO)
    assert not problems, "\n".join(problems)


def test_the_layering_itself_flows_one_way():
    edges = {package: {target: None for target in targets} for package, targets in ALLOWED.items()}
    assert all(len(component) == 1 for component in strongly_connected(edges))
    assert all(target in ALLOWED for targets in ALLOWED.values() for target in targets)


def test_every_mapped_package_is_read():
    """The check sees the packages pyproject.toml installs, each with its files."""
    packages = package_dirs(REPO)
    assert {"wire", "models", "stages", "storage", "broker", "jobs", "cli"} <= set(packages)
    modules = module_files(REPO)
    for package in packages:
        assert f"{NAMESPACE}.{package}" in modules, f"{package}: no __init__.py found under {packages[package]}"
    assert f"{NAMESPACE}.stages.__main__" in modules


def test_wire_format_leaves_transformers_alone():
    """Importing the wire format must not load transformers (which would also register the stages'
    attention function in transformers' global table)."""
    code = ("import sys, layerbus.wire.protocol, layerbus.wire.sampling, layerbus.wire.spans; "
            "assert 'transformers' not in sys.modules, 'transformers imported'; "
            "assert not [m for m in sys.modules if m.startswith('layerbus.') and not m.startswith('layerbus.wire')]")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr


# The checker itself, on small synthetic trees: each rule must be able to fail, naming file:line.

SYNTHETIC = {"low": (), "high": ("low",)}


def synthetic_tree(root: Path, files: dict[str, str], packages: tuple[str, ...] = ("low", "high")) -> Path:
    mapping = "\n".join(f'"{NAMESPACE}.{name}" = "{name}"' for name in packages)
    (root / "pyproject.toml").write_text(f"[tool.setuptools.package-dir]\n{mapping}\n")
    for package in packages:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_checker_passes_a_clean_tree(tmp_path):
    root = synthetic_tree(tmp_path, {"low/a.py": "import os\n", "high/b.py": "from layerbus.low import a\n"})
    assert check_import_graph(root, SYNTHETIC) == []


def test_checker_names_a_back_import_inside_a_function(tmp_path):
    root = synthetic_tree(tmp_path, {"low/a.py": "import os\n\n\ndef f():\n    from layerbus.high.b import g\n",
                                     "high/b.py": "def g():\n    pass\n"})
    problems = check_import_graph(root, SYNTHETIC)
    assert len(problems) == 1, problems
    assert problems[0].startswith("low/a.py:5: `from layerbus.high.b import g`: low must not import high (low may import no other layerbus package)")


def test_checker_names_each_hop_of_a_module_cycle(tmp_path):
    root = synthetic_tree(tmp_path, {
        "low/x.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from layerbus.low.y import Y\n",
        "low/y.py": "class Y:\n    def f(self):\n        from . import x\n"})
    problems = check_import_graph(root, SYNTHETIC)
    assert len(problems) == 1, problems
    assert "import cycle layerbus.low.x -> layerbus.low.y -> layerbus.low.x" in problems[0]
    assert "low/x.py:3: `from layerbus.low.y import Y`" in problems[0]
    assert "low/y.py:3: `from . import x`" in problems[0]


def test_checker_names_a_package_cycle(tmp_path):
    root = synthetic_tree(tmp_path, {"low/a.py": "import layerbus.side.b\n", "side/b.py": "from ..low import a\n"},
                          packages=("low", "side"))
    problems = check_import_graph(root, {"low": ("side",), "side": ("low",)})
    assert not any("must not import" in p for p in problems), "the layering allows both; only the cycles fail"
    assert any(p.startswith("import cycle layerbus.low.a -> layerbus.side.b") for p in problems), problems
    assert any(p.startswith("import cycle low -> side -> low") for p in problems), problems


def test_checker_fails_on_a_package_the_layering_does_not_place(tmp_path):
    root = synthetic_tree(tmp_path, {"new/c.py": "from layerbus.low import a\n", "low/a.py": ""},
                          packages=("low", "high", "new"))
    problems = check_import_graph(root, SYNTHETIC)
    assert any("package layerbus.new but the layering does not place it" in p for p in problems), problems


@pytest.mark.parametrize("statement", ["import layerbus.elsewhere", "from layerbus.low.missing import name"])
def test_checker_fails_on_an_unknown_module(tmp_path, statement):
    root = synthetic_tree(tmp_path, {"high/b.py": f"def f():\n    {statement}\n"})
    problems = check_import_graph(root, SYNTHETIC)
    assert len(problems) == 1 and problems[0].startswith(f"high/b.py:2: `{statement}`: imports"), problems


def test_checker_fails_on_a_banned_third_party_import(tmp_path):
    root = synthetic_tree(tmp_path, {"wire/w.py": "def f():\n    import transformers.models\n"},
                          packages=("wire",))
    problems = check_import_graph(root, {"wire": ()})
    assert problems == ["wire/w.py:2: `import transformers.models`: wire must not import transformers.models"]


def test_checker_confines_an_optional_extra_to_its_modules(tmp_path):
    root = synthetic_tree(tmp_path, {"low/a.py": "def f():\n    import lm_eval.api\n",
                                     "high/b.py": "from layerbus.low import a\n"})
    modules = module_files(root)
    imports, others = read_imports(root, modules)
    problems = optional_problems(imports, others, {"lm_eval": ("layerbus.low.a",)})
    assert problems == ["high/b.py:1: `from layerbus.low import a`: layerbus.low.a needs an optional extra; import it "
                        "only from layerbus.low.a (or from tests)"]
    problems = optional_problems(imports, others, {"lm_eval": ("layerbus.high.b",)})
    assert problems[0].startswith("low/a.py:2: `import lm_eval.api`: lm_eval.api is an optional extra")
