"""The structure docs/architecture.md describes, checked on the source (no imports run).

- every module of the package has one row in the layers table, and every import points down
  that table (or stays in its row);
- a solve is assembled in one place: ``limits.admit`` is called, and a ``SinkhornResult``
  built, in engine.py only; the loop is entered from the engine and from the multiscale
  strategy's stages only;
- nothing above the backend registry tests a backend's ``name`` or ``path`` string.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "flashsinkhorn"
DOC = ROOT / "docs" / "architecture.md"


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module(p): p for p in sorted(PKG.rglob("*.py"))}


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The package modules ``name`` imports (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "flashsinkhorn":
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if _is_module(sub) else mod)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "flashsinkhorn"}
    out.discard(name)
    return out


def _layers() -> list[tuple[str, list[str]]]:
    """(layer, module paths) of each row of the layers table, top row first: the backticked
    paths of its modules cell outside parentheses (which hold notes)."""
    text = DOC.read_text()
    table = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-"}:
            continue
        # the modules of a row, without the parenthesised notes about them
        listed = re.sub(r"\([^()]*\)", "", cells[1])
        rows.append((cells[0], re.findall(r"`([\w/.]+(?:\.py|/))`", listed)))
    return rows


def _assign() -> dict[str, int]:
    """Row index of every module: its own file's token, else its nearest folder's."""
    files, folders = {}, {}
    for k, (_, tokens) in enumerate(_layers()):
        for tok in tokens:
            (folders if tok.endswith("/") else files)[tok] = k
    out = {}
    for name, path in _modules().items():
        rel = path.relative_to(PKG).as_posix()
        if rel in files:
            out[name] = files[rel]
            continue
        parents = [p.as_posix() + "/" for p in pathlib.PurePosixPath(rel).parents][:-1]
        hit = next((folders[p] for p in parents if p in folders), None)
        if hit is not None:
            out[name] = hit
    return out


def test_every_module_has_a_row():
    rows = _layers()
    assert len(rows) >= 8, rows
    assigned = _assign()
    missing = sorted(set(_modules()) - set(assigned))
    assert not missing, f"modules without a row in docs/architecture.md: {missing}"
    # every token names something that exists
    for _, tokens in rows:
        for tok in tokens:
            assert (PKG / tok).exists(), f"docs/architecture.md names {tok}, which does not exist"


def test_imports_point_down_the_table():
    layer = _assign()
    names = [r[0] for r in _layers()]
    up = []
    for name, path in _modules().items():
        for dep in _imports(name, path):
            if dep in layer and layer[dep] < layer[name]:
                up.append(f"{name} ({names[layer[name]]}) -> {dep} ({names[layer[dep]]})")
    assert not up, "imports that point up docs/architecture.md's table:\n" + "\n".join(up)


def _calls(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            yield f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None), f


def test_one_assembly_site():
    admits, results, loops = [], [], []
    for name, path in _modules().items():
        imports_loop = any(
            isinstance(n, ast.ImportFrom)
            and (n.module or "").split(".")[-1] in ("solvers", "loop")
            and any(a.name == "solve" for a in n.names)
            for n in ast.walk(ast.parse(path.read_text()))
        )
        for called, f in _calls(path):
            base = getattr(f, "value", None)
            if called == "admit" and isinstance(base, ast.Name) and base.id == "limits":
                admits.append(name)
            if called == "SinkhornResult":
                results.append(name)
            if called == "solve" and imports_loop and not isinstance(f, ast.Attribute):
                loops.append(name)
    assert admits == ["flashsinkhorn.engine"], admits
    assert results == ["flashsinkhorn.engine"], results
    assert set(loops) == {"flashsinkhorn.engine", "flashsinkhorn.multiscale.solver"}, loops


#: The user's own option objects may compare their ``path`` option to a string.
_OPTION_OBJECTS = {"opts", "options", "spec"}
_LABELS = {"torch", "triton", "multiscale", "dense", "streaming", "matrix"}
#: Variables that would hold a backend's name handed down from above.
_NAME_VARIABLES = {"backend", "backend_name", "impl_name"}


def test_no_backend_name_or_path_tests_above_the_registry():
    found = []
    registry = PKG / "backends" / "__init__.py"
    for path in PKG.rglob("*.py"):
        if path == registry or "mhc" in path.relative_to(PKG).parts:
            continue  # the mHC projection has its own backend argument, not a Backend
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                args = node.args
                if len(args) > 1 and isinstance(args[1], ast.Constant):
                    if args[1].value in ("name", "path", "graph_safe"):
                        found.append(f"{path.name}:{node.lineno} getattr {args[1].value}")
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            labels = [s for s in sides if isinstance(s, ast.Constant) and s.value in _LABELS]
            attrs = [
                s for s in sides if isinstance(s, ast.Attribute) and s.attr in ("name", "path")
            ]
            attrs = [
                a for a in attrs
                if not (isinstance(a.value, ast.Name) and a.value.id in _OPTION_OBJECTS)
            ]  # fmt: skip
            # a name passed down and tested there (``backend == "triton"``)
            names = [s for s in sides if isinstance(s, ast.Name) and s.id in _NAME_VARIABLES]
            if labels and (attrs or names):
                found.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not found, f"backend name/path tests outside backends/__init__.py: {found}"


#: Calls that solve (or prepare a solve); an autograd.Function's forward receives the solve.
_SOLVING = {
    "solve", "solve_points", "solve_divergence", "solve_matrix", "solve_geomloss", "bind",
    "run", "prepare", "admit", "Sharded", "_run", "solve_multiscale",
}  # fmt: skip


def test_autograd_functions_receive_a_finished_solve():
    found = []
    for path in PKG.rglob("*.py"):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            if not any(ast.unparse(b).endswith("autograd.Function") for b in cls.bases):
                continue
            for fn in cls.body:
                if not (isinstance(fn, ast.FunctionDef) and fn.name == "forward"):
                    continue
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call):
                        f = node.func
                        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                        if name in _SOLVING:
                            found.append(f"{path.relative_to(PKG)}:{node.lineno} {name}")
    assert not found, f"autograd.Function forwards that solve: {found}"
