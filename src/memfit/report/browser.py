"""Open a report page in headless Chromium: what a reader's browser would see, and a screenshot.

No browser-automation package is needed: the page is copied to a private directory with a
small probe script added at the top of <head> (the written report itself carries no script),
Chromium loads it from disk with networking off (`--dump-dom`), and the probe writes what it
found into the DOM as JSON: console errors and uncaught exceptions, every image's
`naturalWidth`, every resource fetched from anything but a data: URL, the document's
scroll width and the page text. Chromium's own console log (`--enable-logging=stderr`) is
read too, so an error raised before the probe ran is not missed.

Flags: https://peter.sh/experiments/chromium-command-line-switches/ and
https://developer.chrome.com/docs/chromium/headless (`--dump-dom`, `--screenshot`,
`--window-size`, `--virtual-time-budget`).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# No sandbox (CI runs as root in a container), no GPU, and nothing that phones home: the page
# must render from the file alone.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--mute-audio",
    # every host name resolves nowhere: an external URL on the page fails instead of loading
    "--host-resolver-rules=MAP * ~NOTFOUND",
)

_PROBE_ID = "memfit-browser-probe"
_PROBE = r"""<script>
(function () {
  var errors = [];
  var origError = console.error;
  console.error = function () {
    errors.push(Array.prototype.map.call(arguments, String).join(" "));
    return origError.apply(console, arguments);
  };
  window.addEventListener("error", function (e) {
    var t = e.target;
    if (t && t !== window && (t.src || t.href)) {
      errors.push("failed to load " + (t.src || t.href).slice(0, 120));
    } else {
      errors.push("uncaught: " + (e.message || String(e)));
    }
  }, true);
  window.addEventListener("unhandledrejection", function (e) { errors.push("unhandled rejection: " + e.reason); });
  // the text a reader sees without scrolling: every visible text node whose box ends within the top
  // __SCREEN__ px (the height asked for: headless Chromium's window keeps some of it for itself)
  function firstScreen() {
    var walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT), out = [], range = document.createRange();
    while (walker.nextNode()) {
      var node = walker.currentNode;
      if (!node.textContent.trim()) continue;
      range.selectNodeContents(node);
      var r = range.getBoundingClientRect();
      if (r.height > 0 && r.width > 0 && r.bottom <= __SCREEN__ && r.right <= window.innerWidth) {
        out.push(node.textContent.replace(/\s+/g, " ").trim());
      }
    }
    return out.join(" ");
  }
  function headings() {
    return Array.prototype.map.call(document.querySelectorAll("h1, h2, h3, h4"), function (h) {
      return {tag: h.tagName.toLowerCase(), text: h.innerText, top: Math.round(h.getBoundingClientRect().top + window.scrollY)};
    });
  }
  window.addEventListener("load", function () {
    var imgs = Array.prototype.map.call(document.images, function (im) {
      return {src: (im.getAttribute("src") || "").slice(0, 60), alt: im.alt || "",
              complete: im.complete, naturalWidth: im.naturalWidth, naturalHeight: im.naturalHeight,
              width: im.getBoundingClientRect().width};
    });
    var res = performance.getEntriesByType("resource").map(function (r) { return r.name; })
      .filter(function (n) { return n.indexOf("data:") !== 0; });
    var out = {errors: errors, images: imgs, resources: res,
               scrollWidth: document.documentElement.scrollWidth,
               bodyScrollWidth: document.body.scrollWidth,
               innerWidth: window.innerWidth,
               scrollHeight: document.documentElement.scrollHeight,
               innerHeight: window.innerHeight,
               text: document.body.innerText,
               firstScreen: firstScreen(), headings: headings()};
    var pre = document.createElement("pre");
    pre.id = "__PROBE_ID__";
    pre.style.display = "none";
    pre.textContent = JSON.stringify(out);
    document.documentElement.appendChild(pre);
  });
})();
</script>""".replace("__PROBE_ID__", _PROBE_ID)


class BrowserError(RuntimeError):
    """Chromium is missing, failed, or the page never finished loading."""


@dataclass(frozen=True)
class PageCheck:
    """What headless Chromium saw when it opened the page at `width` CSS pixels."""

    errors: list[str]  # console.error calls, uncaught exceptions, failed loads, Chromium's console errors
    images: list[dict]  # src prefix, alt, complete, naturalWidth/Height, rendered width
    resources: list[str]  # every non-data: URL the page fetched (the report must fetch none)
    scroll_width: int  # document.documentElement.scrollWidth, CSS px
    inner_width: int
    scroll_height: int
    text: str  # document.body.innerText: what a reader can read
    inner_height: int = 0  # the window's height, CSS px
    first_screen: str = ""  # the text on the first `height` px of the page (text nodes ending there), spaces joined
    headings: tuple = ()  # every h1-h4: {"tag", "text", "top"} (px from the top of the page)


def find_chromium() -> str | None:
    """The Chromium binary: $MEMFIT_CHROMIUM, else the first of CHROMIUM_NAMES on PATH; None if absent."""
    env = os.environ.get("MEMFIT_CHROMIUM")
    if env:
        return env if Path(env).exists() or shutil.which(env) else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def _chromium(chromium: str | None) -> str:
    exe = chromium or find_chromium()
    if exe is None:
        raise BrowserError(
            f"no Chromium binary found (looked for $MEMFIT_CHROMIUM and {', '.join(CHROMIUM_NAMES)} on PATH); "
            "install one, e.g. `apt-get install -y chromium`"
        )
    return exe


def _run(exe: str, args: list[str], profile: Path, timeout: float) -> subprocess.CompletedProcess:
    cmd = [exe, *FLAGS, f"--user-data-dir={profile}", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise BrowserError(f"Chromium did not finish within {timeout:.0f} s: {' '.join(cmd)}") from e


# Chromium's console lines on stderr: `[...:INFO:CONSOLE(12)] "message", source: file:///x.html (12)`;
# errors are `console.error`/uncaught ones, logged at level ERROR or prefixed "Uncaught".
_CONSOLE = re.compile(r":(INFO|WARNING|ERROR|VERBOSE\d*):CONSOLE\(\d+\)\] \"(.*)\", source:")


def inspect_page(
    page: str | os.PathLike,
    *,
    width: int = 1280,
    height: int = 900,
    chromium: str | None = None,
    timeout: float = 90.0,
) -> PageCheck:
    """Load `page` (an HTML file) in headless Chromium at `width` x `height` and return what it saw
    (`first_screen`: the text on the page's first `height` px)."""
    exe = _chromium(chromium)
    src = Path(page)
    if not src.is_file():
        raise BrowserError(f"{src}: no such report page")
    text = src.read_text(encoding="utf-8")
    m = re.search(r"<head[^>]*>", text, flags=re.I)
    if m is None:
        raise BrowserError(f"{src}: no <head> element to add the probe to")
    probed = text[: m.end()] + _PROBE.replace("__SCREEN__", str(int(height))) + text[m.end() :]
    with tempfile.TemporaryDirectory(prefix="memfit-browser-") as tmp:
        tmp_path = Path(tmp)
        copy = tmp_path / "page.html"
        copy.write_text(probed, encoding="utf-8")
        proc = _run(
            exe,
            [
                f"--window-size={width},{height}",
                "--enable-logging=stderr",
                "--v=0",
                "--virtual-time-budget=5000",
                "--dump-dom",
                copy.as_uri(),
            ],
            tmp_path / "profile",
            timeout,
        )
    found = re.search(rf'<pre id="{_PROBE_ID}"[^>]*>(.*?)</pre>', proc.stdout, flags=re.S)
    if found is None:
        raise BrowserError(
            f"{src}: the page never reported back from Chromium (exit {proc.returncode}); stderr tail:\n"
            + proc.stderr[-2000:]
        )
    seen = json.loads(html.unescape(found.group(1)))
    errors = list(seen["errors"])
    for level, message in _CONSOLE.findall(proc.stderr):
        if level == "ERROR" or message.startswith("Uncaught"):
            errors.append(f"console {level}: {message}")
    return PageCheck(
        errors=errors,
        images=seen["images"],
        resources=seen["resources"],
        scroll_width=int(seen["scrollWidth"]),
        inner_width=int(seen["innerWidth"]),
        scroll_height=int(seen["scrollHeight"]),
        text=seen["text"],
        inner_height=int(seen["innerHeight"]),
        first_screen=seen["firstScreen"],
        headings=tuple(seen["headings"]),
    )


def screenshot(
    page: str | os.PathLike,
    png: str | os.PathLike,
    *,
    width: int = 1280,
    max_height: int = 2400,
    chromium: str | None = None,
    timeout: float = 90.0,
) -> Path:
    """Write a PNG of `page` at `width` CSS px, as tall as the page up to `max_height` px."""
    exe = _chromium(chromium)
    height = min(
        max(inspect_page(page, width=width, chromium=exe, timeout=timeout).scroll_height, 600),
        max_height,
    )
    out = Path(png).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memfit-shot-") as tmp:
        shot = Path(tmp) / "shot.png"
        proc = _run(
            exe,
            [
                f"--window-size={width},{height}",
                f"--screenshot={shot}",
                "--virtual-time-budget=5000",
                Path(page).resolve().as_uri(),
            ],
            Path(tmp) / "profile",
            timeout,
        )
        if not shot.is_file() or shot.stat().st_size == 0:
            raise BrowserError(
                f"Chromium wrote no screenshot of {page} (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        shutil.move(str(shot), out)
    return out
