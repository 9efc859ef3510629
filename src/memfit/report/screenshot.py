"""`python -m memfit.report.screenshot REPORT.html OUT.png [--width 1280] [--max-height 2400]`.

Regenerates the README's picture of the report (docs/report.png) with headless Chromium
(`memfit.report.browser.screenshot`).
"""

from __future__ import annotations

import argparse

from .browser import screenshot


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m memfit.report.screenshot", description=__doc__.splitlines()[0])
    ap.add_argument("report", help="the report page, e.g. results/report.html")
    ap.add_argument("png", help="where to write the PNG, e.g. docs/report.png")
    ap.add_argument("--width", type=int, default=1280, help="viewport width in CSS px (default 1280)")
    ap.add_argument("--max-height", type=int, default=2400, help="crop the page at this many px (default 2400)")
    args = ap.parse_args(argv)
    print(screenshot(args.report, args.png, width=args.width, max_height=args.max_height))


if __name__ == "__main__":
    main()
