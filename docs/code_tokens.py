"""Size of a Python file in code tokens: what the project's size budgets count
(docs/README.md#sizes).

A code token is a token of Python's own tokenizer, except comments, newlines and indentation; a
string literal (a docstring among them) is one token. So comments and docstrings cost nothing, and
merging two lines does not make a file smaller.

    python docs/code_tokens.py common.py bench.py grpo.py   # tokens, non-blank lines, per line
    python docs/code_tokens.py --parts common.py             # and per section of common.py
"""
import io
import re
import sys
import tokenize

NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
HEADING = re.compile(r"^# (Part [IV]+|\d+[a-z]?)\. ")  # headings: '# Part IV. ', '# 4a. '


# Python 3.12 and newer split an f-string into pieces (its text, each {field}): counted as one
# token, as Python 3.11 has it, so that a budget does not depend on the Python that measures it
STRING_START = {getattr(tokenize, name) for name in ("FSTRING_START", "TSTRING_START")
                if hasattr(tokenize, name)}
STRING_END = {getattr(tokenize, name) for name in ("FSTRING_END", "TSTRING_END")
              if hasattr(tokenize, name)}


def code_tokens(source):
    """{line number: code tokens starting on it} of `source`."""
    per_line = {}
    depth = 0  # how many f-strings the current token is inside
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        inside = depth > 0
        if token.type in STRING_START:
            depth += 1
        elif token.type in STRING_END:
            depth -= 1
        if inside or token.type in NOT_CODE or token.type in STRING_END:
            continue
        per_line[token.start[0]] = per_line.get(token.start[0], 0) + 1
    return per_line


def size(source):
    """(code tokens, non-blank lines) of `source`; a comment line is a non-blank line."""
    lines = sum(1 for line in source.splitlines() if line.strip())
    return sum(code_tokens(source).values()), lines


def sections(source):
    """[(heading, code tokens, non-blank lines)] from each heading HEADING matches to the next, the
    imports and preamble first."""
    per_line = code_tokens(source)
    found = [["(imports and preamble)", 0, 0]]
    for number, line in enumerate(source.splitlines(), 1):
        if HEADING.match(line):
            found.append([line[2:60], 0, 0])
        found[-1][1] += per_line.get(number, 0)
        found[-1][2] += bool(line.strip())
    return [tuple(section) for section in found]


def main(argv):
    parts = "--parts" in argv
    for path in argv:
        if path == "--parts":
            continue
        with open(path) as f:
            source = f.read()
        tokens, lines = size(source)
        print(f"{path}: {tokens} code tokens, {lines} non-blank lines, "
              f"{tokens / max(lines, 1):.1f} per line")
        if not parts:
            continue
        totals = {}  # "Part I" -> [tokens, lines] of its sections
        part = None
        for heading, tokens, lines in sections(source):
            if heading.startswith("Part"):
                part = heading.split(".")[0]
                totals[part] = [0, 0]
            if part:
                totals[part][0] += tokens
                totals[part][1] += lines
            per_line = tokens / max(lines, 1)
            print(f"  {tokens:6d} tokens {lines:5d} lines {per_line:5.1f}/line  {heading}")
        for part, (tokens, lines) in totals.items():
            print(f"  {part}: {tokens} code tokens, {lines} non-blank lines, "
                  f"{tokens / max(lines, 1):.1f} per line")

if __name__ == "__main__":
    main(sys.argv[1:])
