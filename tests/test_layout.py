"""The package's shape (docs/architecture.md): no import cycle, modules of at most 500 lines, rooms rather than a flat
top, imports at module tops, and an import-linter contract that really catches an upward import."""
import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minigpt"
MAX_LINES = 500

# Third-party packages a module may import inside a function: optional, or heavy and needed by one feature only.
LAZY_OK = {"transformers", "peft", "trl", "lm_eval", "matplotlib", "datasets", "pyarrow", "gguf", "sentencepiece",
           "tokenizers", "uvicorn", "fastapi", "jinja2", "yaml", "tqdm", "openai", "psutil", "xgrammar", "llguidance"}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """Our modules that ``name`` imports at its top level or anywhere (``from a.b import c`` counts ``a.b.c`` when
    that is a module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + [node.module])
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in known else base)
    return {m for m in found if m in known and m != name}


def test_no_import_cycle():
    mods = modules()
    graph = {m: imported_modules(m, p, set(mods)) for m, p in mods.items()}
    # A package's __init__ importing its own submodules is how re-exports work, not a cycle between rooms.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                cycles.append(sorted(comp))

    # The recursive walk may go as deep as the longest import chain. The limit goes back afterwards: it leaked into
    # every later test in this process (PyYAML then recursed 10,000 levels into a deep document: 28 s, not 2.5).
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    assert cycles == []


def test_modules_fit_on_a_few_screens():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_rooms_not_a_flat_folder():
    top = [p for p in PACKAGE.glob("*.py")]
    rooms = [d for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()]
    assert len(top) <= 8, sorted(p.name for p in top)
    assert len(rooms) >= 6, sorted(d.name for d in rooms)


def test_imports_inside_functions_only_in_cli_or_for_optional_packages():
    bad = []
    for name, path in modules().items():
        if name.startswith("minigpt.cli"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, ast.Import):
                    roots = [a.name.split(".")[0] for a in inner.names]
                elif isinstance(inner, ast.ImportFrom) and not inner.level:
                    roots = [inner.module.split(".")[0]]
                else:
                    continue
                bad += [f"{path.relative_to(ROOT)}:{inner.lineno} {r}" for r in roots if r not in LAZY_OK]
    assert sorted(set(bad)) == []


@pytest.mark.skipif(shutil.which("lint-imports") is None and not (Path(sys.executable).parent / "lint-imports").exists(),
                    reason="import-linter is not installed (pip install -e '.[dev]')")
def test_import_contract_catches_an_upward_import(tmp_path):
    """The contract holds on the real tree, and a copy whose model imports the inference layer breaks it."""
    exe = str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        exe = shutil.which("lint-imports")
    env = {"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)}
    shutil.copytree(PACKAGE, tmp_path / "minigpt", ignore=shutil.ignore_patterns("__pycache__", "*.txt", "*.html"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    ok = subprocess.run([exe, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    norm = tmp_path / "minigpt" / "model" / "norm.py"
    norm.write_text(norm.read_text() + "\nfrom minigpt.infer import generate  # noqa: E402,F401\n")
    broken = subprocess.run([exe, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert broken.returncode != 0
    assert "minigpt.model is not allowed to import minigpt.infer" in broken.stdout
