"""The project's size budgets in code tokens (docs/README.md#sizes) and its lint rules:
`ruff check .` (no line over 100 characters, pyflakes) and, in common.py, one statement per
line."""
import ast
import io
import os
import shutil
import subprocess
import sys
import tokenize

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "docs"))
from code_tokens import sections, size  # noqa: E402

BUDGETS = {  # file -> most code tokens
    # common.py's aim is 13,750 (issue 64). It was 13,250 after the simplifying pass of issue 57;
    # this round's hardening added about 1,100 (issue 62: the run folder that is never a user's,
    # state.pt checked field by field, a non-finite step refused, dropout off, prompt() checked
    # and timed, the probe's advice and Llama 4's logits; issue 63: rows as the file has them with
    # where they are, the recipe that follows the model), the reward's rounding rule 49; a second
    # pass found 28 more (6 of them put back as a plain if/else). This bound stops it growing;
    # docs/README.md#sizes says what is left.
    "common.py": 14_392,
    "grpo.py": 1_300,
    "two_grpo.py": 2_600,
    "cppo.py": 2_600,
    "dppo.py": 2_600,
    "mmr_grpo.py": 2_600,
    "bench.py": 7_000,
}


def source(name):
    with open(os.path.join(REPO, name)) as f:
        return f.read()


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_each_file_is_within_its_token_budget(name):
    tokens, _ = size(source(name))
    assert tokens <= BUDGETS[name], f"{name}: {tokens} code tokens, budget {BUDGETS[name]}"


def test_common_part_one_is_within_its_budget_at_ten_tokens_a_line():
    found = sections(source("common.py"))
    headings = [heading for heading, _, _ in found]
    first = next(i for i, h in enumerate(headings) if h.startswith("Part I."))
    second = next(i for i, h in enumerate(headings) if h.startswith("Part II."))
    tokens = sum(t for _, t, _ in found[first:second])
    lines = sum(n for _, _, n in found[first:second])
    assert second - first >= 6, "Part I's sections (1. advantages .. 5. log-probs) were not found"
    assert tokens <= 2_500, f"Part I: {tokens} code tokens, budget 2,500"
    assert tokens / lines <= 10, f"Part I: {tokens / lines:.1f} code tokens a line, at most 10"


def test_common_part_one_is_the_maths_with_the_loss_early():
    """Part I is the GRPO step's maths a newcomer reads first (issue 64): at most 250 non-blank
    lines from its heading to Part II's, token_loss defined within the first 80 of them, and
    neither the rollout engines nor the math reward defined in it."""
    lines = source("common.py").splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("# Part I."))
    second = next(i for i, line in enumerate(lines) if line.startswith("# Part II."))
    part = [line for line in lines[first:second] if line.strip()]
    loss = next(k for k, line in enumerate(part) if line.startswith("def token_loss("))
    assert len(part) <= 250, f"Part I: {len(part)} non-blank lines, at most 250"
    assert loss < 80, f"token_loss at Part I's non-blank line {loss + 1}, within 80"
    defined = {line.split()[1].split("(")[0] for line in part
               if line.startswith(("def ", "class "))}
    assert not defined & {"VLLMEngine", "HFEngine", "math_reward", "score"}, defined


def test_code_tokens_ignore_comments_docstrings_and_layout():
    dense = "x = f(a, b)  # a comment\n"
    spread = '"""A docstring."""\n# a comment line\nx = f(\n    a,\n    b\n)\n'
    assert size(dense) == (8, 1)
    assert size(spread)[0] == 8 + 1  # the docstring is one token
    assert size("s = 'one' 'two'\n")[0] == 4  # two string literals
    # an f-string is one token, whichever Python splits it (3.12 and newer do)
    assert size('x = f"{a} b {c!r:>{w}} {f\'{d}\'}"\n')[0] == 3


def test_common_has_one_statement_per_line():
    """No walrus, no lambda bound to a name, no backslash continuation, no `;`, no body on its
    header's line (`if x: return`) in common.py."""
    text = source("common.py")
    tree = ast.parse(text)
    walrus = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.NamedExpr)]
    assert not walrus, f"walrus at lines {walrus}"
    named_lambdas = [node.lineno for node in ast.walk(tree)
                     if isinstance(node, (ast.Assign, ast.AnnAssign))
                     and isinstance(node.value, ast.Lambda)]
    assert not named_lambdas, f"a lambda bound to a name at lines {named_lambdas}"
    lines = text.splitlines()
    continued = [n for n, line in enumerate(lines, 1) if line.rstrip().endswith("\\")
                 and not line.lstrip().startswith("#")]
    assert not continued, f"backslash continuations at lines {continued}"
    starts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.stmt)]
    shared = sorted({n for n in starts if starts.count(n) > 1})
    assert not shared, f"two statements on lines {shared}"
    # a clause's body on its header's line (`else: x = 1` is no second statement to the AST)
    assert not bodies_on_header_lines(text), bodies_on_header_lines(text)


HEADERS = {"if", "elif", "else", "for", "while", "try", "except", "finally", "with", "def", "class"}


def bodies_on_header_lines(text):
    """Line numbers of compound-statement headers whose logical line goes on after their colon."""
    found = []
    line = []  # the code tokens of the current logical line
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.NEWLINE:
            if line and line[0].string in HEADERS and line[-1].string != ":":
                found.append(line[0].start[0])
            line = []
        elif token.type not in (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            line.append(token)
    return found


def test_the_header_check_can_fail():
    assert bodies_on_header_lines("if x:\n    y = 1\nelse: y = 2\n") == [3]
    assert bodies_on_header_lines("try:\n    pass\nfinally:\n    z = {1: 2}\n") == []
    assert bodies_on_header_lines("for k in d[1:]:\n    pass\n") == []


def test_ruff_check_passes():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    if not os.path.exists(ruff):
        pytest.fail("ruff is not installed (it is in requirements.txt): pip install ruff")
    result = subprocess.run([ruff, "check", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
