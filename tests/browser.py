"""Drive a real headless Chromium for the HTML tests: find it, render a page, read what it shows.

CI installs Chromium from the system packages (``.ci/run``): the browser builds that Playwright
and friends download at install time cannot be fetched there. Chromium's own command line does
what the tests need:

- ``render_text(page)`` opens a small harness page that loads `page` in an iframe and, once it
  has loaded, copies the iframe's ``innerText`` (what a reader sees: no markup, no collapsed
  ``<details>`` body, no ``display:none``) and every link's *resolved* ``href`` into the harness's
  DOM, which ``--dump-dom`` then prints; ``render_page(page)`` adds its images (decoded sizes)
  and its height. The harness is the test's own file, next to the page
  it reads; the page itself is never modified.
- ``screenshot(page, png)`` renders the page to a PNG.

``find_chromium()`` returns None where no browser is installed; the tests then skip, saying so.

Example:
    >>> text, links = render_text(Path("autopsy.html"))  # doctest: +SKIP
    >>> render_page(Path("autopsy.html"))["images"][0]["width"]  # doctest: +SKIP
    900
"""
from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["find_chromium", "render_page", "render_text", "screenshot", "SKIP_REASON"]

_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
SKIP_REASON = ("no Chromium found (looked for $CHROMIUM, then " + ", ".join(_NAMES) + " on PATH): "
               "install it with `apt-get install chromium` (.ci/run does) to run the headless-browser test")
_TIMEOUT = 60  # seconds for one browser run; a cold start takes 1-3 s


def find_chromium() -> str | None:
    """The Chromium (or Chrome) executable: ``$CHROMIUM`` if set, else the first one on PATH."""
    env = os.environ.get("CHROMIUM")
    if env:
        return env if Path(env).is_file() else shutil.which(env)
    return next((p for p in map(shutil.which, _NAMES) if p), None)


def _run(args: list[str]) -> subprocess.CompletedProcess:
    exe = find_chromium()
    if exe is None:
        raise RuntimeError(SKIP_REASON)
    # A fresh profile per run: parallel runs never share one, and nothing of the user's is read.
    with tempfile.TemporaryDirectory(prefix="amp-autopsy-chromium-") as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
               "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}", *args]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"chromium exited {res.returncode}: {res.stderr[-2000:]}")
    return res


_HARNESS = """<!doctype html><html><head><meta charset="utf-8"></head><body>
<iframe id="page" src="{src}" style="width:1200px;height:800px"></iframe>
<script>
document.getElementById("page").addEventListener("load", function () {{
  var d = this.contentDocument;
  var out = document.createElement("pre");
  out.id = "rendered";
  out.textContent = JSON.stringify({{
    text: d.body.innerText,
    links: Array.from(d.querySelectorAll("a[href]")).map(function (a) {{ return a.href; }}),
    images: Array.from(d.images).map(function (i) {{
      return {{alt: i.alt, cls: i.className, width: i.naturalWidth, height: i.naturalHeight,
               complete: i.complete}};
    }}),
    height: d.documentElement.scrollHeight
  }});
  document.body.appendChild(out);
}});
</script></body></html>"""


def render_text(page: Path) -> tuple[str, list[str]]:
    """What Chromium shows of `page` (a local HTML file): its rendered text and resolved link URLs."""
    data = render_page(page)
    return data["text"], data["links"]


def render_page(page: Path) -> dict:
    """What Chromium shows of `page`: ``text``, ``links`` (resolved URLs), ``images`` (``alt``,
    ``cls``, the decoded ``width``/``height``, 0 for an image it could not decode, ``complete``)
    and ``height`` (the document's height in CSS pixels, in the harness's 1200 px wide frame).

    NB: ``--allow-file-access-from-files`` lets the harness (a ``file://`` page) read the
    iframe's document, which Chromium otherwise treats as another origin.
    """
    page = Path(page).resolve()
    harness = page.parent / f".harness-{page.stem}.html"
    harness.write_text(_HARNESS.format(src=html.escape(page.name, quote=True)))
    try:
        res = _run(["--allow-file-access-from-files", "--dump-dom", harness.as_uri()])
    finally:
        harness.unlink()
    start = res.stdout.find('<pre id="rendered">')
    if start < 0:
        raise RuntimeError(f"the harness did not render the page (DOM: {res.stdout[:500]!r}; stderr: "
                           f"{res.stderr[-1000:]!r})")
    body = res.stdout[start + len('<pre id="rendered">'):res.stdout.index("</pre>", start)]
    return json.loads(html.unescape(body))


def screenshot(page: Path, png: Path, size: tuple[int, int] = (1200, 2400)) -> Path:
    """Render `page` to `png` at `size` (width, height) pixels and return the PNG's path."""
    _run([f"--screenshot={Path(png).resolve()}", f"--window-size={size[0]},{size[1]}", "--hide-scrollbars",
          Path(page).resolve().as_uri()])
    return Path(png)
