"""Docs and code point at each other: every docs/<file>.md#anchor cited in code exists, and every
equation anchor (eq-...) in the docs names, in its section, a function that the code defines."""
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sources():
    files = glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "tests", "*.py"))
    return {f: open(f).read() for f in files}


def anchors(doc_text):
    ids = set(re.findall(r'id="([\w\-.]+)"', doc_text))
    slug = lambda h: re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
    return ids | {slug(h) for h in re.findall(r"^#+\s+(.*)$", doc_text, re.M)}


def test_every_cited_anchor_exists():
    cited = {(d, a) for text in sources().values()
             for d, a in re.findall(r"(docs/[\w\-]+\.md)#([\w\-.]+)", text)}
    assert cited, "the code cites no docs anchors"
    for doc, anchor in sorted(cited):
        path = os.path.join(REPO, doc)
        assert os.path.exists(path), f"{doc} is cited but missing"
        assert anchor in anchors(open(path).read()), f"{doc}#{anchor} is cited but not defined"


def test_every_equation_names_a_function_the_code_defines():
    defined = {name for text in sources().values()
               for name in re.findall(r"^\s*(?:def|class) (\w+)", text, re.M)}
    for doc in glob.glob(os.path.join(REPO, "docs", "*.md")):
        text = open(doc).read()
        parts = re.split(r'<a id="(eq-[\w\-]+)"></a>', text)
        for anchor, body in zip(parts[1::2], parts[2::2]):
            section = body.split('<a id="')[0]
            named = (set(re.findall(r"`(\w+)(?:\(|`)", section))
                     | set(re.findall(r"\((\w+)[,)]", section)))
            assert named & defined, (
                f"{os.path.basename(doc)}#{anchor} names no function of the code")


def test_relative_links_resolve():
    """README.md and docs/*.md link both ways (map <-> method pages <-> results): no link may point
    at nothing. docs/bench_report.md's links are read as results.md's, the page it fills in."""
    pages = [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "*.md"))
    for page in pages:
        text = open(page).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://|mailto:", target) or "{" in target:
                continue  # a web page, or bench_report.md's placeholder ({dataset})
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if full.endswith("bench_report.md"):  # its prose becomes results.md, anchors and all
                full = os.path.join(REPO, "docs", "results.md")
            assert os.path.exists(full), f"{os.path.relpath(page, REPO)} links to missing {target}"
            if anchor and full.endswith(".md"):
                assert anchor in anchors(open(full).read()), (
                    f"{os.path.relpath(page, REPO)} links to missing {target}")
    for doc in ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]:
        text = open(os.path.join(REPO, "docs", f"{doc}.md")).read()
        assert "](README.md)" in text and "](results.md)" in text, (
            f"docs/{doc}.md does not link back to the map")


def test_the_maps_equation_table_names_what_each_file_holds():
    """docs/README.md's equation map says which file implements each equation
    ('`token_loss` in [common.py]'): every name it gives must be a function, class or constant of
    that file (or, for an argument or a logged key such as `is_weight`, a word in it), so a moved or
    renamed function cannot leave the map behind."""
    text = open(os.path.join(REPO, "docs", "README.md")).read()
    table = text.split("## Equation map")[1].split("\n## ")[0]
    checked = 0
    for row in re.findall(r"^\| \[.*$", table, re.M):
        for part in row.rsplit("|", 2)[1].split(";"):
            found = re.search(r"\[(\w+\.py)\]", part)
            if not found:
                continue
            source = open(os.path.join(REPO, found.group(1))).read()
            defined = set(re.findall(r"^(?:def|class) (\w+)|^(\w+) =", source, re.M))
            defined = {name for pair in defined for name in pair if name}
            for name in re.findall(r"`(\w+)`", part.split(" in [")[0] if " in [" in part else part):
                assert name in defined or re.search(rf"\b{name}\b", source), (
                    f"{name} is not in {found.group(1)}")
                checked += 1
    assert checked > 40
