"""Docs and code point at each other: every docs/<file>.md#anchor cited in code exists, and every equation anchor
(eq-...) in the docs names, in its section, a function that the code defines."""
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
    cited = {(d, a) for text in sources().values() for d, a in re.findall(r"(docs/[\w\-]+\.md)#([\w\-.]+)", text)}
    assert cited, "the code cites no docs anchors"
    for doc, anchor in sorted(cited):
        path = os.path.join(REPO, doc)
        assert os.path.exists(path), f"{doc} is cited but missing"
        assert anchor in anchors(open(path).read()), f"{doc}#{anchor} is cited but not defined"


def test_every_equation_names_a_function_the_code_defines():
    defined = {name for text in sources().values() for name in re.findall(r"^\s*(?:def|class) (\w+)", text, re.M)}
    for doc in glob.glob(os.path.join(REPO, "docs", "*.md")):
        text = open(doc).read()
        parts = re.split(r'<a id="(eq-[\w\-]+)"></a>', text)
        for anchor, body in zip(parts[1::2], parts[2::2]):
            section = body.split('<a id="')[0]
            named = set(re.findall(r"`(\w+)(?:\(|`)", section)) | set(re.findall(r"\((\w+)[,)]", section))
            assert named & defined, f"{os.path.basename(doc)}#{anchor} names no function of the code"


def test_relative_links_resolve():
    """README.md and docs/*.md link both ways (map <-> method pages <-> results): no link may point at nothing."""
    pages = [os.path.join(REPO, "README.md")] + glob.glob(os.path.join(REPO, "docs", "*.md"))
    for page in pages:
        text = open(page).read()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(full), f"{os.path.relpath(page, REPO)} links to missing {target}"
            if anchor and full.endswith(".md"):
                assert anchor in anchors(open(full).read()), f"{os.path.relpath(page, REPO)} links to missing {target}"
    for doc in ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]:
        text = open(os.path.join(REPO, "docs", f"{doc}.md")).read()
        assert "](README.md)" in text and "](results.md)" in text, f"docs/{doc}.md does not link back to the map"
