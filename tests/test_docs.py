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


# the GPU machine (docs/README.md#gpu): what it has, and what its packages bring with them
GPU_MACHINE = {"torch", "transformers", "peft", "sentence_transformers", "numpy", "tqdm"}
BROUGHT = {"sympy": "torch", "huggingface_hub": "transformers", "safetensors": "transformers",
           "tokenizers": "transformers", "packaging": "transformers", "filelock": "torch"}
# a wheel's name -> the name it is imported by, where they differ
IMPORTED_AS = {"math-verify": "math_verify", "antlr4-python3-runtime": "antlr4"}
# what the GPU check runs: its command, the files that imports at module level, and its tests
GPU_FILES = ["docs/gpu_check.py", "bench.py", "common.py", "grpo.py", "docs/rule.py",
             "tests/test_gpu.py", "tests/conftest.py"]
LOCAL = {"bench", "common", "grpo", "gpu_check", "conftest", "docs", "toy"}


def gpu_kit():
    """{wheel name: version}: the one `pip download` line of docs/README.md#gpu, the GPU check."""
    text = open(os.path.join(REPO, "docs", "README.md")).read()
    section = text.split('<a id="gpu"></a>')[1].split("\n## ")[1]  # its heading, then its text
    lines = re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ")
    download = [line for line in lines.splitlines() if "pip download" in line]
    assert len(download) == 1, "one line fetches the kit"
    assert "--no-deps" in download[0] and "--python-version 3.12" in download[0]
    return dict(re.findall(r"([\w.-]+)==([\w.]+)", download[0]))


def test_the_gpu_kit_holds_every_import_the_gpu_check_needs():
    """Every module-level import of the GPU check and its tests (import statements at the top of
    each file, not inside a function or an optional `with`/`try`) is the standard library's, the
    GPU machine's, one its packages bring, the repository's, or in the kit; and every dependency of
    a kit wheel (on Python 3.12, Linux) is in the kit or on the machine. So `import scipy` at the
    top of docs/rule.py, or pytest left out of the kit, fails here."""
    import ast
    import importlib.metadata
    import sys
    from packaging.requirements import Requirement
    kit = gpu_kit()
    has = ({IMPORTED_AS.get(name, name.replace("-", "_")) for name in kit} | GPU_MACHINE
           | set(BROUGHT) | LOCAL | set(sys.stdlib_module_names))
    assert {"pytest", "math-verify"} <= set(kit)
    for path in GPU_FILES:
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        for node in tree.body:  # the module's own statements: what runs on import
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] in has, f"{path} imports {name}, which the GPU lacks"
    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "extra": ""}
    checked = 0
    for name, version in kit.items():
        try:  # the dependencies of the version installed here, where it is the kit's
            if importlib.metadata.version(name) != version:
                continue
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            need = Requirement(line)
            if need.marker and not need.marker.evaluate(env):
                continue
            dist = need.name.lower().replace("_", "-")
            assert (dist in {k.lower().replace("_", "-") for k in kit}
                    or dist.replace("-", "_") in GPU_MACHINE | set(BROUGHT)), (name, line)
        checked += 1
    assert checked >= 1
