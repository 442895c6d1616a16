"""Checks of the built site (``make docs`` builds it strictly, then runs this file).

What a reader would see go wrong: Sphinx roles or ``docs/x.md`` paths left as text, a public
name without its entry, a signature wider than the column, math left as TeX, an asset fetched
from another host, an example pinned to CUDA on the home page, a date or version in a
heading, a link to a page that is not there.
"""

from __future__ import annotations

import html
import importlib
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site"
# The widest signature line, in characters, that fits the content column at 1280 px (the
# code font is 0.85 em of monospace, about 8.2 px a character, in a 690 px column).
SIGNATURE_WIDTH = 80
# The pages that carry the formulas of the method (objective, plan, soft-min and value;
# divergences; HVP; multiscale bound; schedules) and the docstring pages that do too, with
# the number of typeset formulas each has at least.
MATH_PAGES = {
    "conventions": 6,
    "transport": 3,
    "hvp": 5,
    "multiscale": 3,
    "convergence": 3,
    "api/solvers": 1,
    "api/losses": 1,
    "api/hessian": 1,
}

if not (SITE / "index.html").is_file():
    pytest.fail(f"no built site in {SITE}: run `make docs`", pytrace=False)

PAGES = {
    str(p.relative_to(SITE).parent): p.read_text(encoding="utf-8")
    for p in SITE.rglob("index.html")
    if not p.relative_to(SITE).parts[0].startswith("assets")
}


class _Text(HTMLParser):
    """The visible text of a page's article, without scripts, styles and KaTeX's MathML."""

    SKIP = {"script", "style", "annotation", "math"}

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP and self.skip:
            self.skip -= 1

    def handle_data(self, data):
        if not self.skip:
            self.parts.append(data)


def article(page: str) -> str:
    text = PAGES[page]
    start = text.find("<article")
    end = text.find("</article>")
    return text[start:end] if start >= 0 else text


def visible_text(page: str) -> str:
    parser = _Text()
    parser.feed(article(page))
    return "".join(parser.parts)


def public_names() -> list[tuple[str, str]]:
    """(module, name) for every name of flashsinkhorn.__all__ and of the subpackages it
    exports, and of flashsinkhorn.hessian (whose functions the top level re-exports)."""
    import types

    fs = importlib.import_module("flashsinkhorn")
    out = []
    modules = ["flashsinkhorn", "flashsinkhorn.hessian"]
    for name in fs.__all__:
        if isinstance(getattr(fs, name), types.ModuleType):
            modules.append(f"flashsinkhorn.{name}")
    for modname in modules:
        mod = importlib.import_module(modname)
        for name in mod.__all__:
            if not isinstance(getattr(mod, name), types.ModuleType):
                out.append((modname, name))
    return out


def test_no_sphinx_role_or_source_path_left():
    role = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|data|obj|exc):`")
    path = re.compile(r"\bdocs/[\w/.-]+\.md\b")
    bad = []
    for page in PAGES:
        text = visible_text(page)
        bad += [(page, m.group(0)) for m in role.finditer(text)]
        bad += [(page, m.group(0)) for m in path.finditer(text)]
        # a cross-reference left unrendered (escaped into a type column, say)
        bad += [(page, "<autoref") for _ in re.finditer("<autoref", text)]
    assert not bad, bad


def test_every_public_name_has_an_entry_and_a_row_in_the_summary():
    fs = importlib.import_module("flashsinkhorn")
    ids = set()
    for page, text in PAGES.items():
        if page.startswith("api"):
            ids |= set(re.findall(r'id="(flashsinkhorn[\w.]*)"', text))
    summary = PAGES["api"]
    missing, unlisted = [], []
    for modname, name in public_names():
        if name == "__version__":
            if "__version__" not in visible_text("api"):
                unlisted.append(name)
            continue
        obj = getattr(importlib.import_module(modname), name)
        names = {f"{modname}.{name}"}
        names |= {f"flashsinkhorn.{n}" for n in fs.__all__ if getattr(fs, n) is obj}
        found = names & ids
        if not found:
            missing.append(f"{modname}.{name}")
        elif not any(f'#{n}"' in summary for n in found):
            unlisted.append(f"{modname}.{name}")
    assert not missing, f"no API entry for {missing}"
    assert not unlisted, f"not in the summary table of api/index.md: {unlisted}"


def test_signatures_fit_the_column_and_show_default_values():
    wide = []
    for page, text in PAGES.items():
        if not page.startswith("api"):
            continue
        for block in re.findall(r'<div class="doc-signature[^"]*"[^>]*>(.*?)</div>', text, re.S):
            code = html.unescape(re.sub(r"<[^>]+>", "", block))
            wide += [(page, line) for line in code.splitlines() if len(line) > SIGNATURE_WIDTH]
            # a default shown as a constant's name instead of its value
            wide += [(page, m.group(0)) for m in re.finditer(r"= [A-Z][A-Z0-9_]{3,}\b", code)]
    assert not wide, wide


def test_math_is_typeset():
    for page in PAGES:
        assert 'class="arithmatex"' not in PAGES[page], f"{page}: math left for the browser"
        text = visible_text(page)
        for tex in (r"\(", r"\[", r"\frac", r"\varepsilon", r"\sum"):
            assert tex not in text, f"{page}: TeX {tex!r} shown as text"
    for page, least in MATH_PAGES.items():
        count = PAGES[page].count('class="katex"')
        assert count >= least, f"{page}: {count} typeset formulas, expected {least} or more"
    css = SITE / "assets" / "katex" / "katex.min.css"
    assert css.is_file()
    for font in re.findall(r"url\((fonts/[^)]+\.woff2)\)", css.read_text()):
        assert (css.parent / font).is_file(), font


def test_no_asset_from_another_host():
    external = re.compile(
        r"""<(?:script|img|iframe|source|video|audio)\b[^>]*\bsrc=["']?(?:https?:)?//"""
        r"""|<link\b(?=[^>]*\brel=["']?(?:stylesheet|preload|modulepreload|icon|prefetch))"""
        r"""[^>]*\bhref=["']?(?:https?:)?//""",
        re.I,
    )
    bad = [str(p) for p in SITE.rglob("*.html") if external.search(p.read_text())]
    for css in SITE.rglob("*.css"):
        if re.search(r"""(?:url\(|@import)\s*["']?(?:https?:)?//""", css.read_text()):
            bad.append(str(css.relative_to(SITE)))
    assert not bad, bad


def test_home_page_example_runs_anywhere():
    code = re.findall(r"<pre[^>]*>(.*?)</pre>", article("."), re.S)
    blocks = [html.unescape(re.sub(r"<[^>]+>", "", block)) for block in code]
    assert any("pip install flashsinkhorn" in b for b in blocks), "no install command"
    assert any("import flashsinkhorn" in b for b in blocks), "no example"
    for text in blocks:
        for line in text.splitlines():
            if re.search(r"""["']cuda|\.cuda\(""", line):
                assert "is_available()" in line, f"CUDA hard-coded on the home page: {line}"


def test_headings_carry_no_date_or_version():
    date = re.compile(
        r"\b20\d\d-\d\d\b|\b(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d{4}\b"
        r"|\b\d+\.\d+\.\d+\b|\b(?:torch|triton|cuda|python)\s*\d+\.\d+",
        re.I,
    )
    bad = []
    for page in PAGES:
        for _, body in re.findall(r"<h([1-6])[^>]*>(.*?)</h\1>", article(page), re.S):
            text = html.unescape(re.sub(r"<[^>]+>", "", body))
            if date.search(text):
                bad.append((page, text.strip()))
    assert not bad, bad


def test_internal_links_resolve():
    broken = []
    for page in PAGES:
        base = SITE / page
        for href in re.findall(r'<a\b[^>]*\bhref="([^"]+)"', article(page)):
            parts = urlsplit(html.unescape(href))
            if parts.scheme or parts.netloc or not parts.path:
                continue
            target = (base / parts.path).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append((page, href))
    assert not broken, broken
