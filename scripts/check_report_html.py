"""Render an fxquant HTML report in a real headless browser and check that the charts show.

Unit tests check the HTML's structure; only a browser shows that the inlined PNG charts decode and display. This
script builds a report (the digits CNN, or ``--report FILE.json``), writes ``report.html``, screenshots it with
headless Chromium and checks the screenshot holds the charts' colours (the tables and text use none of them).

    python scripts/check_report_html.py --out /tmp/fxquant-html      # then look at /tmp/fxquant-html/report.png

Exit status: 0 rendered with charts, 1 rendered without them, 2 no browser (install Debian's: apt-get install -y
chromium) or bad input.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fxquant.report.schema import Report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars")
WINDOW = (1100, 2600)


def build_report(path: Path | None) -> Report:
    """The report to render: read from ``path``, or measured on the digits CNN (a few seconds)."""
    import fxquant
    from fxquant.report.schema import Report

    if path is not None:
        return Report.from_json(path)
    from fxquant.models.digits import digits_loader, train_digits_cnn

    model = train_digits_cnn(epochs=2)
    calib = digits_loader("calib", batch_size=64)
    config = fxquant.QuantConfig(exclude=("fc2",))
    qmodel = fxquant.quantize(model, (next(iter(calib))[0][:1],), calib, config, progress=False)
    return fxquant.report(model, qmodel, digits_loader("test", batch_size=64), threads=1, batch_sizes=[1, 64],
                          latency_budget_s=1.0, progress=False)


def screenshot(browser: str, html: Path, png: Path) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="fxquant-chromium-") as profile:
        command = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
                   f"--screenshot={png}", html.resolve().as_uri()]
        return subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)


def colour_fraction(png: Path, hex_colour: str, tolerance: int = 24) -> float:
    """Fraction of the screenshot's pixels within ``tolerance`` (0-255 per channel) of ``hex_colour``."""
    import numpy as np
    from matplotlib.image import imread

    pixels = (imread(png)[..., :3] * 255).astype(np.int16)
    target = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    close = (np.abs(pixels - target) <= tolerance).all(axis=-1)
    return float(close.mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", type=Path, help="report JSON to render (default: measure the digits CNN)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fxquant-report-html")
    parser.add_argument("--browser", help=f"browser executable (default: the first of {', '.join(BROWSERS)} on PATH)")
    args = parser.parse_args(argv)
    browser = args.browser or next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        print("no headless browser found; install Debian's Chromium: apt-get install -y chromium", file=sys.stderr)
        return 2
    from fxquant.report.charts import ALONE_COLOR, INT8_COLOR

    args.out.mkdir(parents=True, exist_ok=True)
    html, png = args.out / "report.html", args.out / "report.png"
    build_report(args.report).to_html(html)
    result = screenshot(browser, html, png)
    if result.returncode != 0 or not png.is_file():
        print(f"{browser} failed (exit {result.returncode}): {result.stderr.strip()[-2000:]}", file=sys.stderr)
        return 2
    fractions = {"int8 bars (blue)": colour_fraction(png, INT8_COLOR),
                 "isolated SQNR bars (orange)": colour_fraction(png, ALONE_COLOR)}
    for what, fraction in fractions.items():
        print(f"{what}: {fraction:.2%} of the screenshot")
    ok = all(fraction > 0.001 for fraction in fractions.values())
    print(f"{'OK' if ok else 'FAILED'}: {html} rendered to {png} ({png.stat().st_size} bytes) by {browser}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
