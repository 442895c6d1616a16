"""MkDocs hook: math typeset at build time with KaTeX, every asset served by the site itself.

``pymdownx.arithmatex`` (generic mode) leaves ``\\(...\\)`` and ``\\[...\\]`` in elements of
class ``arithmatex``, in the pages and in the docstrings rendered by mkdocstrings. After the
build, every such element of every HTML file is replaced by KaTeX's HTML, rendered by Node.js
in one process for the whole site; KaTeX's stylesheet and fonts are copied under
``site/assets/katex/``. The reader's browser runs no script for math and fetches nothing from
another host.

KaTeX comes from the npm registry, pinned to ``KATEX_VERSION``, and is kept under
``build/katex/`` (fetched once, then reused). ``KATEX_DIST`` may point to an unpacked
``dist/`` folder of the same version instead (a machine without npm).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

KATEX_VERSION = "0.16.47"
ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "build" / "katex"
RENDERER = Path(__file__).with_name("katex_render.mjs")

# arithmatex's generic output: inline <span class="arithmatex">\(x\)</span>, display
# <div class="arithmatex">\[x\]</div>.
MATH = re.compile(
    r'<(span|div) class="arithmatex">\s*(\\\(|\\\[)(.*?)(\\\)|\\\])\s*</\1>', re.DOTALL
)


def katex_dist() -> Path:
    """The ``dist/`` folder of KaTeX ``KATEX_VERSION``, fetched from npm on first use."""
    if os.environ.get("KATEX_DIST"):
        dist = Path(os.environ["KATEX_DIST"])
        if not (dist / "katex.min.css").is_file():
            raise RuntimeError(f"KATEX_DIST={dist} has no katex.min.css")
        return dist
    dist = CACHE / f"katex-{KATEX_VERSION}" / "package" / "dist"
    if (dist / "katex.js").is_file():
        return dist
    if shutil.which("npm") is None:
        raise RuntimeError("the docs need npm (Node.js) to fetch KaTeX, or KATEX_DIST set")
    CACHE.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["npm", "pack", f"katex@{KATEX_VERSION}", "--silent", "--pack-destination", str(CACHE)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    tgz = CACHE / f"katex-{KATEX_VERSION}.tgz"
    with tarfile.open(tgz) as tar:
        tar.extractall(CACHE / f"katex-{KATEX_VERSION}", filter="data")
    tgz.unlink()
    return dist


def render(formulas: list[tuple[str, bool]], dist: Path) -> list[str]:
    """KaTeX HTML of each (tex, display) pair, from one Node.js process."""
    if not formulas:
        return []
    if shutil.which("node") is None:
        raise RuntimeError("the docs need Node.js (`node`) to typeset the math")
    proc = subprocess.run(
        ["node", str(RENDERER), str(dist / "katex.js")],
        input=json.dumps(formulas),
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip())
    return json.loads(proc.stdout)


def on_post_build(config, **kwargs) -> None:
    site = Path(config["site_dir"])
    dist = katex_dist()
    pages = {}
    formulas: dict[tuple[str, bool], int] = {}
    for path in site.rglob("*.html"):
        text = path.read_text(encoding="utf-8")
        if 'class="arithmatex"' not in text:
            continue
        pages[path] = text
        for m in MATH.finditer(text):
            formulas.setdefault((html.unescape(m.group(3)).strip(), m.group(1) == "div"), 0)
    keys = list(formulas)
    rendered = dict(zip(keys, render(keys, dist), strict=True))

    def replace(m: re.Match) -> str:
        display = m.group(1) == "div"
        out = rendered[(html.unescape(m.group(3)).strip(), display)]
        # A wide display formula scrolls inside its own box, never the page.
        return f'<div class="math-display">{out}</div>' if display else out

    for path, text in pages.items():
        path.write_text(MATH.sub(replace, text), encoding="utf-8")

    assets = site / "assets" / "katex"
    assets.mkdir(parents=True, exist_ok=True)
    shutil.copy2(dist / "katex.min.css", assets / "katex.min.css")
    fonts = assets / "fonts"
    fonts.mkdir(exist_ok=True)
    # The stylesheet lists woff2 first, which every current browser reads.
    for font in (dist / "fonts").glob("*.woff2"):
        shutil.copy2(font, fonts / font.name)
