"""Rendering check of the HTML plan report: write one for a small network, screenshot it in headless Chromium.

Not a CI test: it measures for real (on the CPU unless --device says otherwise, a minute or two)
and needs Chromium (`apt-get install -y chromium`). Look at the screenshot afterwards.

    python bench/check_report.py                      # resnet18's first 8 layers, batch 2, 128 KiB shared
    python bench/check_report.py --network vgg16 --layers 6 --workspace-budget 16MiB --budget-mode divided

Writes bench/results/report_example.html (+ its PNGs beside it), with a line that names the revision that wrote
it, and bench/results/report_screenshot.png (--no-screenshot: none, where no Chromium is installed).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, revision
from convtune.cli import main as convtune

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def screenshot(html: Path, png: Path, window: str = "1400,2400") -> None:
    """Render ``html`` in headless Chromium (a fresh profile, no network) and save the viewport as ``png``."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        sys.exit("no Chromium found: apt-get install -y chromium")
    with tempfile.TemporaryDirectory(prefix="convtune-chromium-") as profile:
        subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                        f"--window-size={window}", html.resolve().as_uri()],
                       check=True, capture_output=True, timeout=120)
    if not png.exists():
        sys.exit(f"Chromium wrote no screenshot at {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--network", default="resnet18")
    parser.add_argument("--batch", default="2")
    parser.add_argument("--layers", default="8", help="the first N layers (default 8)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workspace-budget", default="128KiB")
    parser.add_argument("--budget-mode", default="shared", choices=("shared", "divided"))
    parser.add_argument("--db", default=None, help="tuning database (default: a fresh temporary one)")
    parser.add_argument("--out", default=str(RESULTS / "report_example.html"))
    parser.add_argument("--screenshot", default=str(RESULTS / "report_screenshot.png"))
    parser.add_argument("--no-screenshot", action="store_true", help="write the report only")
    args = parser.parse_args()
    out = Path(args.out)
    measured_at = revision()  # before the report is written over the committed one
    with tempfile.TemporaryDirectory(prefix="convtune-report-") as scratch:
        db = args.db or str(Path(scratch) / "tuning.sqlite")
        code = convtune(["report", args.network, "--batch", args.batch, "--layers", args.layers, "--device",
                         args.device, "--workspace-budget", args.workspace_budget, "--budget-mode", args.budget_mode,
                         "--db", db, "--out", str(out)])
    if code != 0:
        sys.exit(f"convtune report failed with exit status {code}")
    text = out.read_text()
    marker = '<div class="cards">'
    if marker not in text:
        sys.exit(f"{out} has no {marker!r} to put the revision line before: update bench/check_report.py")
    out.write_text(text.replace(marker, f'<div class="meta">example written by <code>bench/check_report.py</code> '
                                        f"({args.network}, batch {args.batch}, first {args.layers} layers) at "
                                        f"revision {measured_at}</div>\n{marker}", 1))
    print(f"report {out}")
    if not args.no_screenshot:
        screenshot(out, Path(args.screenshot))
        print(f"screenshot {args.screenshot}")


if __name__ == "__main__":
    main()
