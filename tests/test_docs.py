"""Every Python block of the README, the docs and CONTRIBUTING runs as written on the CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(BLOCK.findall(page.read_text(encoding="utf-8")))]


def test_the_pages_have_python_blocks():
    assert {page.name for page, _, _ in BLOCKS} >= {"README.md", "api.md"}


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p.relative_to(ROOT)}#{i}" for p, i, _ in BLOCKS])
def test_a_python_block_runs(page, index, code, quick_timing, capsys):
    exec(compile(code, f"{page.name}#{index}", "exec"), {"__name__": f"docs_{page.stem}_{index}"})


def test_every_setting_is_documented():
    from convtune.settings import settings

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name, env, _, _ in settings.describe():
        assert f"`{name}`" in text and f"`{env}`" in text, name


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_leads_to_a_file(page):
    missing = [link for link in LINK.findall(page.read_text(encoding="utf-8"))
               if "://" not in link and not (page.parent / link).exists()]
    assert not missing, missing


def test_the_benchmarks_page_and_readmes_table_are_what_their_script_writes_from_the_result_files():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "docs_benchmarks.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_readme_table_check_fails_on_a_typed_figure(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import docs_benchmarks
    finally:
        sys.path.remove(str(ROOT / "bench"))
    readme = tmp_path / "README.md"
    written = docs_benchmarks.readme()
    first = written.index("| ResNet-50, batch 32 |")
    readme.write_text(written[:first] + written[first:].replace("[", "[9.99 / 9.99] [", 1), encoding="utf-8")
    monkeypatch.setattr(docs_benchmarks, "README", readme)
    assert docs_benchmarks.readme() != readme.read_text(encoding="utf-8")  # the check would report it
    readme.write_text("no markers here\n", encoding="utf-8")
    with pytest.raises(SystemExit, match="lacks the markers"):
        docs_benchmarks.readme()
