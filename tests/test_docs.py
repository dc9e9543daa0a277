"""The documentation: README.md is a short front page whose links all resolve, and the docs/ site
builds with MkDocs in strict mode (a broken link or anchor, a page left out of the nav, an API
reference that does not resolve: any warning fails)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200
# Markdown links and images: [text](target) / ![alt](target); the target up to a space or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    # NO_MKDOCS_2_WARNING: mkdocs-material's end-of-life banner, printed on every build
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading (what a README link's #fragment must match)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(github_slug(line.lstrip("#")))
    return out


def test_the_docs_build_strictly_without_a_warning(tmp_path):
    t0 = time.perf_counter()
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    took = time.perf_counter() - t0
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "WARNING" not in log, log
    # every page of the nav was built, the API reference among them
    for page in ("index.html", "api/index.html", "defaults/index.html", "trackers/index.html",
                 "benchmarks/index.html", "conformance/index.html", "analyze/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    # rendered from the docstrings: a config's attribute docstring, watch's own signature
    assert "outlier_skips" in api and "max_lost_steps" in api and "earlywarn.guard.watch" in api
    assert took < 120, f"the docs took {took:.0f} s to build"


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The same configuration on a copy of docs/ with one link to a page that does not exist."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    with open(docs / "limitations.md", "a") as fh:
        fh.write("\nSee [the missing page](no_such_page.md) and [a missing anchor](cuda.md#no-such-anchor).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["plugins"] = [p for p in config["plugins"] if p == "search"]  # links only: no API pages needed
    text = (docs / "api.md").read_text()
    (docs / "api.md").write_text("\n".join(l for l in text.splitlines() if not l.startswith(":::")) + "\n")
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "no_such_page.md" in log and "no-such-anchor" in log, log


def test_every_public_name_has_an_api_entry():
    import earlywarn

    api = (ROOT / "docs" / "api.md").read_text()
    entries = {line.split()[1].rsplit(".", 1)[-1] for line in api.splitlines() if line.startswith("::: ")}
    missing = sorted(set(earlywarn.__all__) - entries)
    assert not missing, f"docs/api.md has no '::: module.Name' entry for {missing}"


def test_the_readme_is_a_short_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    text = "\n".join(lines)
    # the two commands a newcomer runs, as scripts/ has them
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    assert "earlywarn.watch(model, optimizer)" in text
    assert "## Natural instabilities" in text


def test_every_relative_link_in_the_readme_resolves():
    targets = [m.group(1) for m in LINK.finditer(README.read_text())]
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    assert relative, "README.md links into docs/"
    broken = []
    for target in relative:
        path, _, anchor = target.partition("#")
        file = (ROOT / path).resolve()
        if not file.exists():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in headings(file):
            broken.append(f"{target}: {path} has no heading with anchor #{anchor}")
    own = {github_slug(line.lstrip("#")) for line in README.read_text().splitlines() if line.startswith("#")}
    broken += [f"{t}: no such heading in README.md" for t in targets if t.startswith("#") and t[1:] not in own]
    assert not broken, broken



def test_the_nanogpt_lines_the_docs_give_are_the_ones_the_conformance_test_runs():
    """tests/conformance/test_nanogpt_train_py.py adds to nanoGPT's train.py what docs/loops.md
    tells a user to add; read as text (importing it would pull in the conformance suite)."""
    import ast

    tree = ast.parse((ROOT / "tests" / "conformance" / "test_nanogpt_train_py.py").read_text())
    node = next(n.value for n in tree.body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "EARLYWARN_LINES" for t in n.targets))
    added = [line.strip() for code in ast.literal_eval(node).values() for line in code.splitlines()]
    given = {line.strip() for line in (ROOT / "docs" / "loops.md").read_text().splitlines()} | {"import earlywarn"}
    assert len(added) == 3 and set(added) <= given, [line for line in added if line not in given]
