"""Every module imports on a CPU-only machine, every stage answers --help, and the package keeps its shape:
imports run one way (no cycle, counting imports inside functions), the measuring harness sits on top, and
modules and functions stay small enough to read in one sitting."""

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import lowmem_dpo
from lowmem_dpo.__main__ import STAGES as COMMAND_STAGES

PACKAGE = Path(lowmem_dpo.__file__).parent
MODULES = sorted(m.name for m in pkgutil.walk_packages(lowmem_dpo.__path__, "lowmem_dpo."))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
MAX_PARAMETERS = 7


def module_file(name: str) -> Path:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imported_modules(name: str, source: str | None = None) -> set[str]:
    """The package's modules `name` imports (its file, or `source` in its place), at module level or inside
    functions alike. Importing a module runs its packages' __init__ first: a submodule that imports its own
    package closes a cycle, and counts."""
    tree = ast.parse(source if source is not None else module_file(name).read_text(encoding="utf-8"))
    is_package = module_file(name).name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            candidates = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for c in candidates:
            while c and c not in MODULES and c != "lowmem_dpo":
                c = c.rpartition(".")[0]
            if c in MODULES and c != name:
                found.add(c)
    return found


GRAPH = {name: imported_modules(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each as the path that closes it (depth-first search)."""
    found, state, stack = [], {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == "open":
                found.append(stack[stack.index(w):] + [w])
            elif w not in state:
                visit(w)
        stack.pop()
        state[v] = "done"

    for v in sorted(graph):
        if v not in state:
            visit(v)
    return found


@pytest.mark.parametrize("name", MODULES)
def test_imports(name):
    importlib.import_module(name)


def test_cycle_finder_finds_a_cycle():
    """The check below can fail: an import inside a function is an edge, and a graph with a cycle has one."""
    lazy = "def f():\n    from lowmem_dpo import train\n    from lowmem_dpo.data.rows import load_rows\n"
    assert imported_modules("lowmem_dpo.training.guards", lazy) == {"lowmem_dpo.train", "lowmem_dpo.data.rows"}
    assert imported_modules("lowmem_dpo.data.rows", "from lowmem_dpo import data\n") == {"lowmem_dpo.data"}
    graph = dict(GRAPH, **{"lowmem_dpo.training.guards": imported_modules("lowmem_dpo.training.guards", lazy)})
    assert any({"lowmem_dpo.training.guards", "lowmem_dpo.train"} <= set(c) for c in cycles(graph))  # train imports it
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_run_one_way():
    assert GRAPH["lowmem_dpo.train"] >= {"lowmem_dpo.training.loop", "lowmem_dpo.training.policy"}  # real imports
    assert cycles(GRAPH) == []


# The parts, from the ground up: a part's modules import only modules of their own part or of a part below it.
PARTS = ["runtime", "objectives", "config", "data", "model", "memory", "training"]
# the stages lowmem-dpo runs (lowmem_dpo/__main__.py, the one command), plan's measuring harness, and the command
STAGES = {*COMMAND_STAGES, "measure", "__main__"}


def part_of(name: str) -> str | None:
    """The part a module belongs to (its folder), or None for a top-level module."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in PARTS) else None


def test_the_top_level_holds_the_stages_and_the_parts_their_folders():
    top = {n.split(".")[1] for n in MODULES if part_of(n) is None}
    assert top == STAGES
    assert {part_of(n) for n in MODULES} - {None} == set(PARTS)


def test_no_part_reaches_up():
    """No part imports a stage, nor a part above its own (the floors of PARTS)."""
    for name, deps in GRAPH.items():
        part = part_of(name)
        if part is None:
            continue
        for dep in deps:
            assert part_of(dep) is not None, (name, "imports the stage", dep)
            assert PARTS.index(part_of(dep)) <= PARTS.index(part), (name, "reaches up to", dep)


def test_the_ground_and_the_pure_modules():
    for name in MODULES:
        if part_of(name) == "runtime":
            assert {part_of(d) for d in GRAPH[name]} <= {"runtime"}, name
    # pure: numbers in, numbers out; they import at most the objectives' registry and the metric rows (pure
    # themselves)
    pure = {"lowmem_dpo.model.logps", "lowmem_dpo.model.head", "lowmem_dpo.training.guards",
            "lowmem_dpo.training.answers", "lowmem_dpo.objectives.registry", "lowmem_dpo.objectives.dpo",
            "lowmem_dpo.objectives.metrics"}
    for name in pure:  # logps runs the LM head of head.py; answers words its warnings as guards does
        assert GRAPH[name] <= pure, name


def test_the_shape_test_can_fail():
    """The checks above see a part that reaches up, and a part that imports a stage."""
    up = imported_modules("lowmem_dpo.runtime.units", "from lowmem_dpo.training import guards\n")
    assert "lowmem_dpo.training.guards" in up and PARTS.index("training") > PARTS.index("runtime")
    stage = imported_modules("lowmem_dpo.model.logps", "def f():\n    from lowmem_dpo import train\n")
    assert stage == {"lowmem_dpo.train"} and part_of("lowmem_dpo.train") is None


def test_only_the_plan_cli_imports_the_measuring_harness():
    """measure.py runs the stages; nothing below the CLI may depend on it."""
    assert GRAPH["lowmem_dpo.measure"] >= {"lowmem_dpo.precompute", "lowmem_dpo.train"}
    assert [n for n, deps in GRAPH.items() if "lowmem_dpo.measure" in deps] == ["lowmem_dpo.plan"]


def test_nothing_imports_a_stage_but_the_harness_and_the_clis():
    stages = {"lowmem_dpo.precompute", "lowmem_dpo.preflight", "lowmem_dpo.train", "lowmem_dpo.sft", "lowmem_dpo.export"}
    top = {"lowmem_dpo.measure", "lowmem_dpo.plan", "lowmem_dpo.precompute"}  # precompute prints preflight's report
    for name, deps in GRAPH.items():
        if name not in top:
            assert not deps & stages, (name, deps & stages)


def test_modules_and_functions_stay_small():
    long_modules = {n: len(module_file(n).read_text().splitlines()) for n in MODULES}
    assert {n: k for n, k in long_modules.items() if k > MAX_MODULE_LINES} == {}
    long_functions = {}
    for name in MODULES:
        for node in ast.walk(ast.parse(module_file(name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions[f"{name}.{node.name}"] = lines
    assert long_functions == {}


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters as the house counts them: each named one, *args and **kwargs one each; a method's
    self or cls not (an autograd Function's ctx is one)."""
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (a.vararg is not None) + (a.kwarg is not None)


def continued_lines(source: str) -> list[int]:
    """The lines of `source` that end in a backslash continuation (a string token's own lines left out)."""
    import io
    import tokenize
    in_strings = {n for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.STRING
                  for n in range(tok.start[0], tok.end[0])}
    return [n for n, line in enumerate(source.splitlines(), 1) if line.rstrip().endswith("\\") and n not in in_strings]


def test_no_line_continues_with_a_backslash():
    """Parentheses continue a line: readers that follow the code by its tokens (farm-studio walk) lose every function
    after a backslash continuation."""
    assert {n: lines for n in MODULES if (lines := continued_lines(module_file(n).read_text()))} == {}
    assert continued_lines('x = 1 + \\\n    2\ns = """a \\\nb"""\n') == [1]  # the check can fail


def test_no_function_takes_more_than_7_parameters():
    """Related parameters travel together, in a small dataclass named for what it holds; a signature an outside
    interface dictates takes what it passes in **kwargs."""
    many = {}
    for name in MODULES:
        for node in ast.walk(ast.parse(module_file(name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and parameter_count(node) > MAX_PARAMETERS:
                many[f"{name}.{node.name}"] = parameter_count(node)
    assert many == {}


def test_the_parameter_count_can_fail():
    """The count above sees every kind of parameter, and leaves out only a method's self or cls."""
    tree = ast.parse("def f(a, b=1, /, c=2, *d, e, f=3, **g): pass\n"
                     "class C:\n    def m(self, a): pass\n    @classmethod\n    def k(cls, *, a, b): pass\n"
                     "    @staticmethod\n    def forward(ctx, a, b, c, d, e, f, g): pass\n")
    counts = {n.name: parameter_count(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 7, "m": 1, "k": 2, "forward": 8}
    assert counts["forward"] > MAX_PARAMETERS


@pytest.mark.parametrize("stage", ["precompute", "train", "preflight", "sft", "export"])
def test_stage_help_shows_command(stage, capsys):
    """Each stage's --help (its entry point, in this process) opens with the command that runs it."""
    import importlib

    from lowmem_dpo.config.cli import run_cli

    module = importlib.import_module(f"lowmem_dpo.{stage}")
    assert run_cli(module.main, ["--help"], stage, module.__doc__, getattr(module, "USAGE", None)) == 0
    assert f"lowmem-dpo {stage}" in capsys.readouterr().out  # the one command form (python -m lowmem_dpo.STAGE too)


def test_no_arguments_is_a_usage_error():
    p = subprocess.run([sys.executable, "-m", "lowmem_dpo.train"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "usage:" in p.stdout
