"""The package's layering is a DAG: no module imports a module of a higher layer, and no group of modules
imports itself in a circle, counting imports inside functions too (only ``if TYPE_CHECKING:`` blocks, which
never run, are left out). A lazy import may still keep start-up light or an optional dependency (Triton)
optional, but it never hides a cycle."""

from __future__ import annotations

import ast
import pathlib

import specserve

ROOT = pathlib.Path(specserve.__file__).parent

# Lower layers never import higher ones; units of one layer do not import each other.
LAYERS = [
    {"errors"},
    {"hub"},
    {"config", "sampling_params", "datasets", "cpu_isa"},
    {"platform", "request", "outputs"},
    {"model", "kv", "sample", "engine_args"},
    {"tokenizer", "spec_decode"},
    {"worker"},
    {"engine"},
    {"llm"},
    {"server", "bench", "distill"},
    {"cli"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}

# The rooms of model/, the same way: the kernels (C++ CPU, Triton) under the layers that call them; checkpoint/
# (reading HF dirs and GGUF files) beside the decoder, which never reads a checkpoint (it is handed weights);
# the EAGLE head on the decoder's layer.
MODEL_ROOMS = [
    {"attention_metadata", "layers"},
    {"kernels"},
    {"quant", "attention", "sparse_moe"},
    {"families", "sharding", "ops"},
    {"checkpoint", "decoder"},
    {"eagle_head"},
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the specserve modules it imports (``from pkg import sub`` counts as importing pkg.sub)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_lines(tree)
        deps: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("specserve"))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specserve"):
                mod = node.module or ""
                subs = {f"{mod}.{a.name}" for a in node.names} & modules.keys()
                deps.update(subs or {mod})
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_module_imports_a_higher_layer():
    modules = _modules()
    units = {_unit(m) for m in modules} - {""}
    assert units <= RANK.keys(), f"place these in LAYERS: {sorted(units - RANK.keys())}"
    bad = []
    for mod, deps in _imports(modules).items():
        if mod == "specserve":  # the package root re-exports the public API
            continue
        for dep in deps:
            a, b = _unit(mod), _unit(dep)
            if a != b and b and RANK[b] >= RANK[a]:
                bad.append(f"{mod} imports {dep} (layer {RANK[a]} -> {RANK[b]})")
    assert not bad, "\n".join(sorted(bad))


def test_model_rooms_are_layered():
    modules = _modules()
    rank = {room: i for i, layer in enumerate(MODEL_ROOMS) for room in layer}

    def room(module: str) -> str:
        return module.split(".")[2]

    inside = [m for m in modules if m.startswith("specserve.model.")]
    assert {room(m) for m in inside} <= rank.keys(), \
        f"place these in MODEL_ROOMS: {sorted({room(m) for m in inside} - rank.keys())}"
    bad = [f"{mod} imports {dep}" for mod, deps in _imports(modules).items() if mod in inside for dep in deps
           if dep.startswith("specserve.model.") and room(dep) != room(mod) and rank[room(dep)] >= rank[room(mod)]]
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _imports(_modules())
    graph["specserve"] = set()  # the root's lazy re-export is not a dependency of anything
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_checker_sees_a_lazy_import():
    """The checks read imports inside functions (the lazy ones a cycle would hide behind)."""
    graph = _imports(_modules())
    assert "specserve.model.kernels.triton_attention" in graph["specserve.model.attention"]


MAX_FUNCTION_LINES = 80


def long_functions(root: pathlib.Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (methods, nested functions and Triton kernels included) longer than ``limit`` lines, counted
    from the ``def`` line to the last line of the body."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_over_80_lines():
    assert not long_functions(), "split these:\n" + "\n".join(long_functions())


def test_the_length_check_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n", encoding="utf-8")
    assert [s.split()[1] for s in long_functions(tmp_path)] == ["long"]
