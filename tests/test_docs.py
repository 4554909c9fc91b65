"""Every document the code and the docs cite is in the repository: `docs/<file>` citations name
files that exist, `docs/design.md §N` names one of its sections, markdown links resolve, and no
file cites the design card by its old name outside the repository (`DESIGN.md`)."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THIS = os.path.abspath(__file__)
SCANNED = ("megatron_mtraining", "scripts", "benchmarks", "examples", "tests", "docs", "patches")
TOP_LEVEL = ("README.md", "Makefile", "setup.py", "pyproject.toml")
SUFFIXES = (".py", ".sh", ".md", ".toml", ".cfg", ".txt", ".patch")

DOCS_CITATION = re.compile(r"docs/([\w.-]+\.md)")
SECTION_CITATION = re.compile(r"docs/design\.md §(\d+)")
OLD_CARD = re.compile(r"(?<![\w/])DESIGN\.md")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def scanned_files():
    paths = [os.path.join(REPO, name) for name in TOP_LEVEL]
    for top in SCANNED:
        for root, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [d for d in dirs if d not in ("results", "__pycache__")]
            paths += [os.path.join(root, f) for f in files if f.endswith(SUFFIXES)]
    return [p for p in paths if os.path.isfile(p) and os.path.abspath(p) != THIS]


def read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def where(path, text, pos):
    return f"{os.path.relpath(path, REPO)}:{text.count(chr(10), 0, pos) + 1}"


def design_sections():
    return {int(m) for m in re.findall(r"^## (\d+)\. ", read(os.path.join(REPO, "docs", "design.md")), re.M)}


def test_the_scan_sees_the_citations():
    """The scan reaches the package's docstrings (so an empty result below means something)."""
    cited = [m for p in scanned_files() for m in DOCS_CITATION.findall(read(p))]
    assert "design.md" in cited and "performance.md" in cited


def test_docs_citations_name_files_in_the_repository():
    missing = [f"{where(p, t, m.start())}: docs/{m.group(1)}" for p in scanned_files()
               for t in [read(p)] for m in DOCS_CITATION.finditer(t)
               if not os.path.isfile(os.path.join(REPO, "docs", m.group(1)))]
    assert not missing, "cited documents that are not in docs/:\n" + "\n".join(missing)


OTHER_MD_CITATION = re.compile(r"(?<![\w./-])((?:benchmarks|examples|patches|scripts|tests)/[\w.-]+\.md)\b")


def test_markdown_citations_outside_docs_name_files_in_the_repository():
    """A page cited by its path in another folder (``benchmarks/README.md``) exists."""
    found = [(p, t, m) for p in scanned_files() for t in [read(p)] for m in OTHER_MD_CITATION.finditer(t)]
    assert any(m.group(1) == "patches/README.md" for _, _, m in found)  # the scan sees them
    assert [m.group(1) for m in OTHER_MD_CITATION.finditer("see benchmarks/NOTES.md")] == ["benchmarks/NOTES.md"]
    missing = [f"{where(p, t, m.start())}: {m.group(1)}" for p, t, m in found
               if not os.path.isfile(os.path.join(REPO, m.group(1)))]
    assert not missing, "cited pages that are not in the repository:\n" + "\n".join(missing)


def test_design_section_citations_exist():
    sections = design_sections()
    assert sections >= set(range(1, 9)), "docs/design.md keeps its sections 1-8 (docstrings cite them)"
    bad = [f"{where(p, t, m.start())}: §{m.group(1)}" for p in scanned_files()
           for t in [read(p)] for m in SECTION_CITATION.finditer(t) if int(m.group(1)) not in sections]
    assert not bad, "citations of sections docs/design.md does not have:\n" + "\n".join(bad)


def test_no_citation_of_the_design_card_outside_the_repository():
    old = [where(p, t, m.start()) for p in scanned_files() for t in [read(p)] for m in OLD_CARD.finditer(t)]
    assert not old, "cite docs/design.md instead of DESIGN.md:\n" + "\n".join(old)


@pytest.mark.parametrize("name", ["README.md", "docs", "benchmarks/README.md", "patches/README.md",
                                  "examples/README.md"])
def test_markdown_links_resolve(name):
    path = os.path.join(REPO, name)
    pages = ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".md")]
             if os.path.isdir(path) else [path])
    broken = []
    for page in pages:
        text = read(page)
        for m in MARKDOWN_LINK.finditer(text):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"[a-z]+:", target):
                continue  # an anchor on the same page, or a URL
            if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                broken.append(f"{where(page, text, m.start())}: {m.group(1)}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


def test_the_check_fails_on_a_missing_document(tmp_path):
    """The pattern finds a citation of a missing file (guards against a regex that matches nothing)."""
    text = "see docs/no-such-page.md and DESIGN.md section 3"
    assert [m.group(1) for m in DOCS_CITATION.finditer(text)] == ["no-such-page.md"]
    assert not os.path.isfile(os.path.join(REPO, "docs", "no-such-page.md"))
    assert OLD_CARD.search(text) and not OLD_CARD.search("docs/design.md")


def _expand_braces(name):
    """``a_{x,y}_b.json`` -> [a_x_b.json, a_y_b.json] (one level, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [n for alt in m.group(1).split(",") for n in _expand_braces(name[:m.start()] + alt + name[m.end():])]


def test_performance_record_cites_results_in_the_tree():
    """docs/performance.md names result files without their folder; those not marked † (removed,
    read from git) must be in benchmarks/results/, so a reader can open the evidence."""
    import glob
    text = read(os.path.join(REPO, "docs", "performance.md"))
    cited = re.findall(r"`([\w.*{},-]+\.(?:json|png))`(†?)", text)
    assert len(cited) > 10
    results = os.path.join(REPO, "benchmarks", "results")
    missing = [name for name, removed in cited if not removed
               for pattern in _expand_braces(name) if not glob.glob(os.path.join(results, pattern))]
    assert not missing, "cited in docs/performance.md but not in benchmarks/results/ (mark removed ones †):\n" \
        + "\n".join(missing)
