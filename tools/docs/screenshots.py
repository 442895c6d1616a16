#!/usr/bin/env python3
"""Screenshots of the built site at desktop and phone widths, with headless Chromium.

Serves ``site/`` (``make docs`` first) on 127.0.0.1, then for each page and width writes
``out/screenshots/<page>-<width>.png`` and prints the page's scroll width: a page wider than
the window scrolls sideways (the exit status is then 1). Needs Debian's ``chromium``
(``apt-get install chromium``).

Usage::

    python tools/docs/screenshots.py [--site site] [--out out/screenshots] [--height 2400]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import io
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PAGES = {
    "home": "",
    "quickstart": "quickstart/",
    "api": "api/solvers/",
    "performance": "performance/",
}
WIDTHS = (1280, 400)
# Headless Chromium lays a window out at least 500 px wide, so each page is shown in an iframe
# of the width under test; once it has loaded, the frame's scroll width is written into the
# outer DOM, which --dump-dom prints.
FRAME = """<!doctype html><html><head><style>body{{margin:0}}iframe{{border:0;display:block}}
</style></head><body><iframe id="f" src="/{path}" width="{width}" height="{height}"></iframe>
<script>document.getElementById('f').addEventListener('load',e=>{{
const d=e.target.contentDocument.documentElement;
document.documentElement.setAttribute('data-scroll-width',d.scrollWidth);
document.documentElement.setAttribute('data-client-width',d.clientWidth);}});</script>
</body></html>"""


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def send_head(self):
        m = re.fullmatch(r"/__frame__/(\d+)/(\d+)/(.*)", self.path)
        if m is None:
            return super().send_head()
        width, height, path = m.groups()
        body = FRAME.format(path=path, width=width, height=height).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return io.BytesIO(body)


def chromium(args: list[str], profile: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("needs Chromium: apt-get update && apt-get install -y chromium")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
    ]
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--out", type=Path, default=Path("out/screenshots"))
    parser.add_argument("--height", type=int, default=2400)
    parser.add_argument(
        "--page",
        action="append",
        metavar="NAME=PATH",
        help="another page to shoot, e.g. hvp=hvp/ (repeatable)",
    )
    args = parser.parse_args()
    pages = dict(PAGES)
    pages.update(dict(p.split("=", 1) for p in args.page or []))
    if not (args.site / "index.html").is_file():
        sys.exit(f"no built site in {args.site}: run `make docs` first")
    args.out.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(Handler, directory=str(args.site.resolve()))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    wide = 0
    try:
        for name, path in pages.items():
            for width in WIDTHS:
                png = args.out / f"{name}-{width}.png"
                url = f"{base}__frame__/{width}/{args.height}/{path}"
                size = f"--window-size={width},{args.height}"
                with tempfile.TemporaryDirectory() as profile:
                    chromium([size, f"--screenshot={png.resolve()}", url], profile)
                with tempfile.TemporaryDirectory() as profile:
                    dump = [size, "--virtual-time-budget=5000", "--dump-dom", url]
                    dom = chromium(dump, profile).stdout
                m = re.search(r'data-scroll-width="(\d+)" data-client-width="(\d+)"', dom)
                scroll, client = (int(m.group(1)), int(m.group(2))) if m else (-1, -1)
                sideways = scroll > client
                wide += sideways
                flag = "  SCROLLS SIDEWAYS" if sideways else ""
                print(f"{png}  scroll width {scroll} / window {client}{flag}")
    finally:
        server.shutdown()
    return 1 if wide else 0


if __name__ == "__main__":
    sys.exit(main())
