"""Griffe extension for the API pages: the docstrings as written read well in ``help()``; this
turns their plain-text references into links on the site, without touching the source.

- Sphinx roles (``:func:`sinkhorn```, ``:class:`~flashsinkhorn.costs.CostSpec```) become
  cross-references to the documented object (plain code when it is not documented, e.g. a
  private helper or a torch class).
- ``docs/<page>.md`` mentions become links to that page of the site, titled by the page, and
  "the paper" a link to its entry on the references page.
- A "Returns:" paragraph that opens with prose keeps its first colon out of the type column.
- Names a package imports lazily (through a module ``__getattr__``) are made visible.
- A parameter default that names a module constant (``tau=DEFAULT_TAU``) shows the constant's
  value (``tau=1e-05``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import griffe

DOCS = Path(__file__).resolve().parents[2] / "docs"
ROLE = re.compile(
    r":(?:py:)?(func|class|meth|attr|mod|data|obj|exc):`(~?)([^`<]+?)(?:\s*<([^>]+)>)?`"
)
# "the paper" means FlashSinkhorn's (the mHC paper on the mHC pages): linked to the references.
PAPER = re.compile(r"(?<![\[\w`])((?:the )?(?:mHC |FlashSinkhorn )?[Pp]aper)(?![\w\]`])")
DOC_PAGE = re.compile(r"(?<![\w/])docs/([\w/-]+)\.md(#[\w-]+)?")


def _title(page: str) -> str:
    """The first heading of docs/<page>.md, for a link's text."""
    path = DOCS / f"{page}.md"
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page


def _resolve(obj: griffe.Object, name: str) -> str:
    """The full path of ``name`` as seen from ``obj``'s scope, or ``name`` itself."""
    name = name.strip().lstrip(".")
    if name.startswith("flashsinkhorn"):
        return name
    first, _, rest = name.partition(".")
    scope = obj
    while scope is not None:
        try:
            if first in scope.members:
                path = scope.members[first].path
            else:
                path = scope.resolve(first)
        except (griffe.NameResolutionError, KeyError, AttributeError):
            scope = scope.parent
            continue
        return f"{path}.{rest}" if rest else path
    return name


def _link_roles(obj: griffe.Object, text: str) -> str:
    def role(m: re.Match) -> str:
        kind, short, target, explicit = m.groups()
        if explicit:
            label, target = target.strip(), explicit
        else:
            label = target.rsplit(".", 1)[-1] if short else target
        path = _resolve(obj, target)
        if kind in ("func", "meth") and not label.endswith(")"):
            label += "()"
        return f'<autoref identifier="{path}" optional><code>{label}</code></autoref>'

    return ROLE.sub(role, text)


def _link_pages(text: str) -> str:
    # Relative to the API pages (docs/api/<name>.md); MkDocs turns the .md links into URLs.

    def page(m: re.Match) -> str:
        name, anchor = m.group(1), m.group(2) or ""
        if not (DOCS / f"{name}.md").is_file():
            return m.group(0)
        return f"[{_title(name)}](../{name}.md{anchor})"

    def paper(m: re.Match) -> str:
        anchor = "mhc2025" if "mHC" in m.group(1) else "flashsinkhorn"
        return f"[{m.group(1)}](../references.md#{anchor})"

    return PAPER.sub(paper, DOC_PAGE.sub(page, text))


RETURNS = re.compile(r"^(\s*)Returns:\n(\s+)(.+)$", re.M)


def _returns_as_prose(text: str) -> str:
    """A "Returns:" paragraph that starts with prose ("An HVPResult: ``.hvp``, ...") would be
    split at its first colon into a type and a description; the colon becomes a dash. A
    leading plain type ("Tensor: the value") is left to the parser."""

    def fix(m: re.Match) -> str:
        head, sep, tail = m.group(3).partition(": ")
        if sep and " " in head.strip():
            return f"{m.group(1)}Returns:\n{m.group(2)}{head} — {tail}"
        return m.group(0)

    return RETURNS.sub(fix, text)


LITERAL = re.compile(r"[-+]?[\d.eE_+-]+|True|False|None|'[^']*'|\"[^\"]*\"")


def _constant_value(scope: griffe.Object | None, expr: object) -> str | None:
    """The literal value of a module constant that ``expr`` names, seen from ``scope``."""
    if not isinstance(expr, griffe.ExprName):
        return None
    while scope is not None:
        try:
            target = scope.get_member(expr.name) if expr.name in scope.members else None
            while isinstance(target, griffe.Alias):
                target = target.final_target
        except (griffe.AliasResolutionError, KeyError):
            return None
        if isinstance(target, griffe.Attribute) and target.value is not None:
            value = str(target.value)
            return value if LITERAL.fullmatch(value) else None
        scope = scope.parent
    return None


def _constant_defaults(obj: griffe.Object) -> None:
    if isinstance(obj, griffe.Function):
        for param in obj.parameters:
            value = _constant_value(obj.parent, param.default)
            if value is not None:
                param.default = value
    elif isinstance(obj, griffe.Attribute) and isinstance(obj.parent, griffe.Class):
        # a dataclass field (``tau: float = DEFAULT_TAU``): its value is the default shown
        value = _constant_value(obj.parent.parent, obj.value)
        if value is not None:
            obj.value = value


def _modules(module: griffe.Module):
    yield module
    for member in module.members.values():
        if isinstance(member, griffe.Module):
            yield from _modules(member)


def _lazy_names(module: griffe.Module) -> None:
    """Names a package imports on first access (a module ``__getattr__`` reading a dict such as
    ``_PUBLIC = {"hvp": ".operator"}``) become aliases, as static analysis cannot see them."""
    if "__getattr__" not in module.members:
        return
    for attr in list(module.members.values()):
        if not isinstance(attr, griffe.Attribute) or attr.value is None:
            continue
        try:
            table = ast.literal_eval(str(attr.value))
        except (ValueError, SyntaxError):
            continue
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v.startswith(".")
            for k, v in table.items()
        ):
            continue
        for name, relative in table.items():
            if name not in module.members:
                target = f"{module.path}{relative}.{name}"
                module.set_member(name, griffe.Alias(name, target, parent=module))


def _generated(obj: griffe.Object) -> str:
    """The docstring as the package builds it at import: a ``{options}`` line is replaced by
    the option table's Args entries (flashsinkhorn/option_table.py, ``document_options``)."""
    module = importlib.import_module(obj.module.path)
    target = module
    for part in obj.path[len(obj.module.path) + 1 :].split("."):
        target = getattr(target, part)
    return inspect.cleandoc(target.__doc__)


class SiteLinks(griffe.Extension):
    """Rewrites docstrings and defaults of the whole package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for module in _modules(pkg):
            _lazy_names(module)
        seen: set[int] = set()
        self._visit(pkg, seen)

    def _visit(self, obj: griffe.Object, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            if "{options}" in obj.docstring.value:
                obj.docstring.value = _generated(obj)
            text = _link_roles(obj, obj.docstring.value)
            obj.docstring.value = _returns_as_prose(_link_pages(text))
        _constant_defaults(obj)
        for member in obj.members.values():
            if not isinstance(member, griffe.Alias):
                self._visit(member, seen)
