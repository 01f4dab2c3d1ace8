"""The dependency rules of docs/architecture.md ("Packages and the dependency rule"), read from the source's import
statements: which package may import which (the optional CPU backend, cpu/, depends one way: no package of the core
imports it, it registers itself into theirs), the scheduling core never importing a policy, a paper's module never
importing another paper's, and no import cycle. Each rule is also run on a small tree that breaks it."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("config", "model", "kernels", "engine", "rl", "trainer", "sched", "sim", "runtime", "cpu")
ALLOWED = {                     # package -> the packages of ours it may import
    "config": set(),
    "model": set(),
    "kernels": set(),
    "engine": {"model", "kernels"},
    "rl": {"model"},
    "trainer": {"model", "kernels", "rl", "config"},
    "sched": {"config", "rl"},
    "sim": {"sched", "rl", "config"},
    "runtime": {"config", "model", "kernels", "engine", "rl", "trainer", "sched"},
    "cpu": {"config", "model", "kernels", "engine", "trainer", "runtime"},   # optional: nothing above imports it
}
REGISTRY_LOADERS = {"sched", "sched.__main__"}   # import sched.policies to fill the registry
# The recorder of real runs (`python -m sim.validate --record`) rebuilds a recorded run's dataset to read its prompts'
# lengths: the one module of sim/ that may import runtime/ (nothing of ours imports it).
RECORDERS = {"sim.validate": {"runtime"}}
Modules = dict[str, tuple[set[str], set[str]]]   # module -> (every module of ours it imports, the top-level ones)


def scan(root: Path) -> Modules:
    raw: dict[str, tuple[list[tuple[str, ...]], list[tuple[str, ...]]]] = {}
    for pkg in PACKAGES:
        files = [root / f"{pkg}.py"] if (root / f"{pkg}.py").is_file() else sorted((root / pkg).rglob("*.py"))
        for path in files:
            parts = list(path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text())
            raw[name] = (_imports(list(ast.walk(tree))), _imports(tree.body))
    return {name: (_resolve(every, raw), _resolve(top, raw)) for name, (every, top) in raw.items()}


def _imports(nodes: list[ast.AST]) -> list[tuple[str, ...]]:
    """(module,) for `import module`, (module, name, ...) for `from module import name, ...`."""
    found: list[tuple[str, ...]] = []
    for n in nodes:
        if isinstance(n, ast.Import):
            found += [(a.name,) for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            found.append((n.module, *(a.name for a in n.names)))
    return [f for f in found if f[0].split(".")[0] in PACKAGES]


def _resolve(found: list[tuple[str, ...]], modules: dict) -> set[str]:
    """The modules of ours imported: `from a import b` is module a.b where that is a module (a's __init__ is only
    run, as Python runs it for any a.x), else a."""
    out: set[str] = set()
    for module, *names in found:
        subs = {f"{module}.{n}" for n in names} & set(modules)
        out |= subs if subs and len(subs) == len(names) else {module} | subs
    return out


def layering_violations(mods: Modules) -> list[str]:
    return [f"{name} imports {dep}" for name, (deps, _) in mods.items() for dep in sorted(deps)
            if dep.split(".")[0] != name.split(".")[0] and dep.split(".")[0] not in ALLOWED[name.split(".")[0]]
            and dep.split(".")[0] not in RECORDERS.get(name, set())]


def core_imports_of_the_cpu_backend(mods: Modules) -> list[str]:
    """The one-way rule of the optional CPU backend, by itself: no package but cpu/ imports it, at any depth."""
    return [f"{name} imports {dep}" for name, (deps, _) in mods.items() if name.split(".")[0] != "cpu"
            for dep in sorted(deps) if dep.split(".")[0] == "cpu"]


def core_imports_of_policies(mods: Modules) -> list[str]:
    return [f"{name} imports {dep}" for name, (deps, _) in mods.items()
            if name.startswith("sched") and not name.startswith("sched.policies") and name not in REGISTRY_LOADERS
            for dep in sorted(deps) if dep.startswith("sched.policies")]


def cross_paper_imports(mods: Modules) -> list[str]:
    def paper(name: str) -> str:
        return name.split(".")[2] if name.count(".") >= 2 else ""
    return [f"{name} imports {dep}" for name, (deps, _) in mods.items() if name.startswith("sched.policies.")
            for dep in sorted(deps) if dep.startswith("sched.policies.") and paper(dep) != paper(name)]


def import_cycle(mods: Modules) -> list[str] | None:
    graph = {name: sorted(d for d in top if d in mods and d != name) for name, (_, top) in mods.items()}
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in graph[m]:
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (cycle := visit(d)) is not None:
                return cycle
        path.pop()
        state[m] = 2
        return None
    for m in sorted(graph):
        if m not in state and (cycle := visit(m)) is not None:
            return cycle
    return None


def test_the_repository_keeps_every_rule():
    mods = scan(ROOT)
    assert len(mods) > 100 and "sched.lifecycle" in mods and "sched.policies.staleflow.algorithm1" in mods
    assert "cpu.engine" in mods and "engine.engine" in mods
    assert layering_violations(mods) == []
    assert core_imports_of_the_cpu_backend(mods) == []
    assert core_imports_of_policies(mods) == []
    assert cross_paper_imports(mods) == []
    assert import_cycle(mods) is None


def test_each_rule_names_a_tree_that_breaks_it(tmp_path):
    files = {
        "sched/__init__.py": "",
        "sched/controller.py": "from sched.policies.a import x\nimport runtime.backend\n",
        "sched/views.py": "from sched.tables import T\n",
        "sched/tables.py": "import sched.views\n",
        "sched/policies/__init__.py": "from sched.policies import a, b\n",   # registration: submodules, no cycle
        "sched/policies/a/__init__.py": "",
        "sched/policies/a/dispatch.py": "from sched.policies.a.state import S\n",   # its own paper: fine
        "sched/policies/a/state.py": "",
        "sched/policies/b.py": "def f():\n    from sched.policies.a.state import S\n",
        "engine/engine.py": "from rl.types import Trajectory\n",
        "kernels/rmsnorm.py": "def f():\n    from cpu import ops\n",   # the core reaching into the CPU backend
        "cpu/__init__.py": "",
        "cpu/ops.py": "from kernels.dispatch import register_impl\n",    # the backend registering: fine
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    mods = scan(tmp_path)
    assert layering_violations(mods) == ["kernels.rmsnorm imports cpu.ops", "engine.engine imports rl.types",
                                         "sched.controller imports runtime.backend"]
    assert core_imports_of_the_cpu_backend(mods) == ["kernels.rmsnorm imports cpu.ops"]
    assert core_imports_of_policies(mods) == ["sched.controller imports sched.policies.a"]
    assert cross_paper_imports(mods) == ["sched.policies.b imports sched.policies.a.state"]
    assert import_cycle(mods) == ["sched.tables", "sched.views", "sched.tables"]


def test_python_m_sched_lists_every_mechanism_with_its_file_and_paper(capsys):
    """The lookup rule a reader applies: the code behind configs/sched/<paper>.toml is in sched/policies/<paper>."""
    import sched
    from sched.__main__ import main, rows
    table = rows()
    assert {(k, n) for k, n, *_ in table} == {(k, n) for k, names in sched.REGISTRY.items() for n in names}
    for kind, name, path, paper, presets in table:
        assert (ROOT / path).is_file() and paper, (kind, name)
        for preset in filter(None, presets.split(", ")):
            assert sched.preset_tables(preset)[kind].get("name") == name or \
                sched.preset_tables(preset)[kind].get("admit") == name
    papers = {"rolloutpipe", "rollpacker", "streamrl", "laminar", "staleflow"}
    for kind, name, path, _, presets in table:     # a paper's own mechanisms live in its module or folder
        for paper in papers & set(presets.split(", ")):
            if name.startswith(paper):
                assert path.startswith(f"sched/policies/{paper}"), (name, path)
    assert main() == 0 and "sched/policies/staleflow/algorithm1.py" in capsys.readouterr().out


def test_python_m_sched_says_where_to_run_it(tmp_path):
    """Outside the repository `python -m sched` is the standard library's module: --help (from the root) and the
    README say to run it from the repository root; a stray argument is a one-line error."""
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sched", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
    help_ = run("--help")
    assert help_.returncode == 0 and "from the repository root" in help_.stdout and "standard" in help_.stdout
    bad = run("staleflow")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "takes no arguments" in bad.stderr
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "from the repository root (elsewhere `python -m sched` is the standard library's module)" in readme


NEW_MECHANISM = '''from dataclasses import dataclass

from sched.base import Dispatch, register


@register
class Dropped(Dispatch):
    """A file dropped into sched/policies/, imported nowhere."""
    name = "dropped_in"
    paper = "none: the discovery test"

    @dataclass
    class Params:
        pass

    def admit(self, v):
        return []
'''


def test_a_policy_file_dropped_into_sched_policies_is_found_without_editing_another_file(tmp_path):
    """sched/policies/__init__.py imports every module and subpackage of its folder: a copy of the sched tree with
    one more file in it lists that file's mechanism in `python -m sched`, nothing else edited."""
    shutil.copytree(ROOT / "sched", tmp_path / "sched", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "configs" / "sched", tmp_path / "configs" / "sched")
    (tmp_path / "sched" / "policies" / "zz_dropped.py").write_text(NEW_MECHANISM)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "sched"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert ["dispatch", "dropped_in", "sched/policies/zz_dropped.py", "none:", "the", "discovery", "test"] in rows
    assert any(r[:3] == ["dispatch", "fifo", "sched/policies/sync.py"] for r in rows)   # the built-in ones still
