"""dppo.py: keep probabilities, the fixed-size draw, Horvitz-Thompson weights and the window packer
against values computed by hand; the key property, that the pruned and reweighted gradient averages
to the full-batch GRPO gradient over random prunings (while dropping without reweighting does not);
and the script from the command line."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import RecordingOptimizer, assert_grads_close, make_samples

import dppo
from common import (Passes, checkpoints, group_advantages, policy_update, sequence_logprobs,
                    token_coefficients)
from dppo import packing_density

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are tiny: a second intra-op thread only waits, and on a shared 2-core
    machine a busy neighbour made the per-completion backward passes 35x slower with 2 threads than
    with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------
# keep probabilities and the draw, by hand


def test_prompt_keep_probabilities_and_refill_by_hand():
    """docs/dppo.md#eq-prompt-keep, docs/dppo.md#eq-refill"""
    history = {3: True, 5: True, 7: False}  # 3 and 5 tied last time, 7 did not, the rest are unseen
    stream = [3, 5, 7, 9, 11, 13]
    # 0.5 + 0.5 + 1 + 1 = 3 = B: the two pruned slots are refilled by prompts 7 and 9
    assert (dppo.candidate_window(stream, history, 3, 0.5, 0.1, cap=6)
            == ([3, 5, 7, 9], [0.5, 0.5, 1.0, 1.0]))
    assert (dppo.candidate_window(stream, history, 3, 0.95, 0.2, cap=6)[1]
            == [0.2, 0.2, 1.0, 1.0, 1.0])  # the floor
    assert (dppo.candidate_window(stream, history, 3, 0.0, 0.1, cap=6)
            == ([3, 5, 7], [1.0, 1.0, 1.0]))  # r_q 0 = GRPO
    tied = {i: True for i in range(100)}
    # the look-ahead cap
    assert len(dppo.candidate_window(list(range(100)), tied, 4, 0.5, 0.1, cap=4)[0]) == 4
    # past the cap, on until the probabilities sum to 1, so the draw keeps at least one prompt
    assert len(dppo.candidate_window(list(range(100)), tied, 1, 0.9, 0.1, cap=2)[0]) == 10


def test_history_remembers_whether_each_group_tied():
    history = {4: False, 99: True}
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert (dppo.update_history(history, [4, 8, 15], rewards)
            == {4: True, 8: False, 15: True, 99: True})
    # an answer left unread (NaN) ties nothing: [1, NaN, 1] tied, [0, NaN, 1] not
    nan = math.nan
    assert dppo.update_history({}, [1, 2], torch.tensor([[1.0, nan, 1.0], [0.0, nan, 1.0]])) == {
        1: True, 2: False}


def test_systematic_sample_by_hand_and_inclusion_probabilities_exact():
    """docs/dppo.md#eq-draw: slices [0, .5) [.5, 1) [1, 2) [2, 2.3) [2.3, 3); points u, u + 1,
    u + 2."""
    pi = [0.5, 0.5, 1.0, 0.3, 0.7]
    assert dppo.systematic_sample(pi, 0.2) == [0, 2, 3]
    assert dppo.systematic_sample(pi, 0.6) == [1, 2, 4]
    assert dppo.systematic_sample([1.0, 1.0], 0.99) == [0, 1]
    # every item is kept with probability exactly pi (u on a fine grid), and floor or ceil of
    # sum(pi) items are kept
    pi = [0.3, 0.9, 0.15, 1.0, 0.45, 0.6, 0.05]  # sum 3.45
    draws = [dppo.systematic_sample(pi, (k + 0.5) / 20000) for k in range(20000)]
    freq = np.bincount([i for d in draws for i in d], minlength=len(pi)) / len(draws)
    np.testing.assert_allclose(freq, pi, atol=1e-4)
    assert {len(d) for d in draws} == {3, 4}


def test_completion_keep_probabilities_by_hand():
    """docs/dppo.md#eq-completion-keep"""
    keep = lambda a, r, f: dppo.completion_keep_probs(torch.tensor(a), r, f).tolist()
    # target 2 of 4: clip(2c) + clip(c) + 0.1 + 0.1 = 2 -> 2c is capped at 1, c = 0.8
    assert keep([2.0, -1.0, 0.0, 0.0], 0.5, 0.1) == pytest.approx([1.0, 0.8, 0.1, 0.1])
    # target 3: both A != 0 kept surely and still short by 1:
    # the two zero-advantage ones get 0.5 each
    assert keep([2.0, -1.0, 0.0, 0.0], 0.25, 0.1) == pytest.approx([1.0, 1.0, 0.5, 0.5])
    assert keep([2.0, -1.0, 0.0, 0.0], 0.0, 0.1) == [1.0] * 4  # r_o = 0 prunes nothing
    # the floor binds: fewer pruned than r_o
    assert keep([2.0, -1.0, 0.0, 0.0], 0.9, 0.5) == pytest.approx([0.5] * 4)
    assert keep([0.0, 0.0, 0.0, 0.0], 0.75, 0.1) == pytest.approx([0.25] * 4)  # all tied: uniform
    # random advantages: sum(pi) = (1 - r_o) n, pi grows with |A|, floor <= pi <= 1,
    # proportional in between
    a = group_advantages(
        torch.randint(0, 2, (16, 8), generator=torch.Generator().manual_seed(0)).float()).flatten()
    pi = dppo.completion_keep_probs(a, 0.6, 0.05)
    assert pi.sum().item() == pytest.approx(0.4 * len(a), abs=1e-6)
    order = a.abs().argsort()
    assert (pi[order].diff() >= -1e-12).all() and pi.min() >= 0.05 and pi.max() <= 1
    inner = (pi > 0.05 + 1e-9) & (pi < 1 - 1e-9)
    ratio = pi[inner] / a[inner].abs()  # pi / |A| = c for every pi strictly between the floor and 1
    assert inner.any() and torch.allclose(ratio, ratio[:1].expand_as(ratio))


def test_importance_coefficients_by_hand():
    """docs/dppo.md#eq-estimator, docs/dppo.md#eq-token-mean: 2 rolled-out prompts of G = 2 out of
    3 examined."""
    lengths, prompt_pi, completion_pi, kept = ([2, 4, 3, 1], [0.5, 1.0], [1.0, 0.25, 0.5, 1.0],
                                               [0, 1, 3])
    coefs, weights = dppo.importance_coefficients(lengths, prompt_pi, completion_pi, kept, 3,
                                                  "seq_mean", 5)
    assert weights == [2.0, 8.0, 1.0]  # 1/(0.5 * 1), 1/(0.5 * 0.25), 1/(1 * 1)
    # N = 3 x 2, not 3 kept
    torch.testing.assert_close(coefs, torch.tensor([2 / (2 * 6), 8 / (4 * 6), 1 / (1 * 6)]))
    tokens = (2 + 4) / 0.5 + (3 + 1) / 1.0  # the examined batch's token count, estimated: 16
    coefs = lambda agg: dppo.importance_coefficients(lengths, prompt_pi, completion_pi, kept, 3,
                                                     agg, 5)[0]
    torch.testing.assert_close(coefs("token_mean"), torch.tensor([2.0, 8.0, 1.0]) / tokens)
    torch.testing.assert_close(coefs("constant"), torch.tensor([2.0, 8.0, 1.0]) / (6 * 5))
    # nothing pruned: exactly grpo.py's coefficients, for every aggregation
    for agg in ("seq_mean", "token_mean", "constant"):
        coefs, weights = dppo.importance_coefficients(lengths, [1.0, 1.0], [1.0] * 4, [0, 1, 2, 3],
                                                      2, agg, 5)
        assert weights == [1.0] * 4
        torch.testing.assert_close(coefs, token_coefficients(lengths, agg, max_len=5))


def test_window_pack_and_density_by_hand():
    """docs/dppo.md#eq-density"""
    # window 2, budget 10: 5 then 3 (5 + 3), then 2 (window {8, 2}); then 9 + 1;
    # 8 waited in the window
    lengths = [5, 3, 8, 2, 9, 1]
    bins = dppo.window_pack(lengths, 10, 2)
    assert bins == [[0, 1, 3], [4, 5], [2]]
    assert packing_density(lengths, bins, 10) == pytest.approx(28 / 30)
    # a longer window finds the complement: 6 + 4 | 6 + 4 (density 1);
    # window 1 is next-fit: 6 | 6 + 4 | 4
    assert dppo.window_pack([6, 6, 4, 4], 10, 4) == [[0, 2], [1, 3]]
    assert dppo.window_pack([6, 6, 4, 4], 10, 1) == [[0], [1, 2], [3]]
    assert packing_density([6, 6, 4, 4], [[0], [1, 2], [3]], 10) == pytest.approx(20 / 30)
    # longer than the budget: alone, and its capacity is its own length
    assert dppo.window_pack([12, 3], 10, 4) == [[0], [1]]
    assert packing_density([12, 3], [[0], [1]], 10) == pytest.approx(15 / 22)


# ---------------------------------------------------------------- the key property: unbiasedness


REWARDS = [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 0, 1]]
HISTORY = {1: True, 2: True, 4: True, 5: False}  # candidates 1, 2, 4 tied when last seen
# ragged (prompt, completion)
LENGTHS = [(3 + q % 3, 2 + (5 * q + 3 * i) % 7) for q in range(6) for i in range(4)]
# policy_update's; the passes: temperature 1, budget 64
KW = dict(clip=(0.2, 0.2), beta=0.1, grad_clip=1e9)


def with_coefs(samples, coefs, refs=None):
    """Copies of `samples` carrying their coefficients c_i (and reference log-probs), as dppo.py
    sets them."""
    refs = refs or [s.ref_logps for s in samples]
    return [dataclasses.replace(s, coef=float(c), ref_logps=r)
            for s, c, r in zip(samples, coefs, refs)]


@pytest.fixture(scope="module")
def batch(tiny):
    """6 examined prompts x G = 4 completions, and the gradient h_i = grad sum_t l_(i,t) of each
    completion alone, through the real policy_update (coefficient 1). The loss is linear in the
    coefficients, so any pruning's gradient is sum_i c_i h_i. The KL term is on (beta = 0.1), so
    zero-advantage completions have gradients too."""
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab, seed=11, lengths=LENGTHS)
    for s, a in zip(samples, group_advantages(
            torch.tensor(REWARDS, dtype=torch.float32)).flatten().tolist()):
        s.advantage = a
    passes = Passes(1.0, vocab, token_budget=64)
    ref = [lp - 0.1 * torch.arange(len(lp)) for lp in sequence_logprobs(model, samples, passes)]
    samples = with_coefs(samples, [1.0] * len(samples), ref)
    per_sample = []
    for s in samples:
        opt = RecordingOptimizer(model)
        policy_update(model, opt, [s], passes, **KW)
        per_sample.append(torch.cat([g.flatten() for g in opt.grads.values()]).double())
    return model, passes, samples, torch.stack(per_sample)  # H [24, P]


def draw(samples, r_q, r_o, floor, loss_agg, rng, cache):
    """One random pruning of the batch through dppo.py's functions, in the script's order:
    candidates and pi_q from the history, the prompt draw, completion pi on the rolled-out groups'
    advantages, the completion draw, coefficients.
    Returns (indices of the kept completions, their coefficients, the same kept set dropped without
    reweighting)."""
    G, lengths = 4, [len(s.completion_ids) for s in samples]
    # all 6 examined
    examined, prompt_pi = dppo.candidate_window(list(range(6)), HISTORY, 6, r_q, floor, cap=12)
    kept_q = dppo.systematic_sample(prompt_pi, rng.random())
    rolled = [q * G + i for q in kept_q for i in range(G)]
    # a function of the kept prompts only: computed once per kept set
    if tuple(kept_q) not in cache:
        cache[tuple(kept_q)] = dppo.completion_keep_probs([samples[j].advantage for j in rolled],
                                                          r_o, floor).tolist()
    completion_pi = cache[tuple(kept_q)]
    kept_o = dppo.systematic_sample(completion_pi, rng.random())
    coefs, _ = dppo.importance_coefficients([lengths[j] for j in rolled],
                                            [prompt_pi[q] for q in kept_q],
                                            completion_pi, kept_o, len(examined), loss_agg, 12)
    # kept counts, weight 1
    naive = token_coefficients([lengths[rolled[k]] for k in kept_o], loss_agg, max_len=12)
    return [rolled[k] for k in kept_o], coefs.double(), naive.double()


@pytest.mark.parametrize("loss_agg,r_q", [("seq_mean", 0.5), ("constant", 0.5),
                                          ("token_mean", 0.0)])
def test_pruned_gradient_is_unbiased_and_dropping_without_weights_is_not(batch, loss_agg, r_q):
    """docs/dppo.md#eq-unbiased: over many random prunings (r_q, r_o = 0.5 or 0, floor 0.1), the
    mean of the pruned, reweighted gradient equals the full-batch GRPO gradient within 3 standard
    errors; the same prunings with weight 1 and kept-count normalisers miss it by far more.
    token_mean is exact without prompt pruning only (#eq-token-mean)."""
    model, passes, samples, H = batch
    n, M, rng, cache = len(samples), 3000, np.random.default_rng(0), {}
    full = token_coefficients([len(s.completion_ids) for s in samples], loss_agg,
                              max_len=12).double()
    # coefficients per draw
    a, b = torch.zeros(M, n, dtype=torch.float64), torch.zeros(M, n, dtype=torch.float64)
    for m in range(M):
        kept, coefs, naive = draw(samples, r_q, 0.5, 0.1, loss_agg, rng, cache)
        a[m, kept], b[m, kept] = coefs, naive
    assert 0.3 < (a != 0).double().mean() < 0.7  # about half of the completions are pruned
    K, g_full = H @ H.T, full @ H  # gradients live in the span of the per-completion gradients
    for coef, unbiased in ((a, True), (b, False)):
        err = coef.mean(0) - full  # [n]: the mean gradient minus the full-batch gradient is err @ H
        err2 = (err @ K @ err).item()  # || mean gradient - full gradient ||^2
        # its expectation if unbiased: tr Cov(gradient) / M
        se2 = torch.trace(torch.cov(coef.T) @ K).item() / M
        g2 = (g_full @ g_full).item()
        print(f"{loss_agg} {'weighted' if unbiased else 'naive'}: "
              f"|bias| / |g| = {math.sqrt(err2 / g2):.4f}, "
              f"standard error / |g| = {math.sqrt(se2 / g2):.4f}, "
              f"squared error / se^2 = {err2 / se2:.1f}")
        assert (err2 < 9 * se2) == unbiased
        if not unbiased:
            assert err2 > 100 * se2  # visibly, not marginally, biased
    # a few of those prunings end to end:
    # policy_update on the kept completions with dppo's coefficients
    for _ in range(3):
        kept, coefs, _ = draw(samples, r_q, 0.5, 0.1, loss_agg, rng, cache)
        opt = RecordingOptimizer(model)
        policy_update(model, opt, with_coefs([samples[i] for i in kept], coefs.float().tolist()),
                      passes, **KW)
        # sum_i c_i h_i
        want = (coefs @ H[kept]).float().split([g.numel() for g in opt.grads.values()])
        assert_grads_close(opt.grads, {k: w.view_as(g)
                                       for (k, g), w in zip(opt.grads.items(), want)})


def test_nothing_pruned_is_exactly_the_grpo_gradient(batch):
    """r_q = r_o = 0: every draw keeps everything with weight 1 and grpo.py's coefficients."""
    _, _, samples, _ = batch
    full = token_coefficients([len(s.completion_ids) for s in samples], "seq_mean").double()
    rng = np.random.default_rng(1)
    for _ in range(5):
        kept, coefs, _ = draw(samples, 0.0, 0.0, 0.1, "seq_mean", rng, {})
        assert kept == list(range(len(samples)))
        torch.testing.assert_close(coefs, full)


def test_window_packer_drives_the_update_and_leaves_the_gradient_unchanged(tiny):
    """policy_update runs the micro-batches it is given, as dppo.py hands it window_pack's: they
    run, with first-fit-decreasing's gradient (the normalisers are global, so packing changes
    speed only)."""
    model, tokenizer = tiny
    # 10 18 10 2 tokens
    samples = make_samples(len(tokenizer), lengths=[(4, 6), (8, 10), (5, 5), (1, 1)])
    samples = with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples],
                                                     "seq_mean").tolist())
    kw = dict(KW, beta=0.0)
    passes = Passes(1.0, len(tokenizer), token_budget=20)
    ffd, win = RecordingOptimizer(model), RecordingOptimizer(model)
    stats_ffd = policy_update(model, ffd, samples, passes, **kw)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    bins = dppo.window_pack(lengths, 20, 1)
    stats_win = policy_update(model, win, samples, passes, micro_batches=bins, **kw)
    assert stats_win["micro_batches"] == len(bins) != stats_ffd["micro_batches"]
    assert_grads_close(win.grads, ffd.grads, rel=1e-5)


# ---------------------------------------------------------------- the command line


def run(args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, "dppo.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("args,message", [
    (["--prune_prompts", "1"], "--prune_prompts and --prune_completions must be in [0, 1)"),
    (["--prune_prompts", "-0.1"], "--prune_prompts and --prune_completions must be in [0, 1)"),
    (["--prune_completions", "1.0"], "--prune_prompts and --prune_completions must be in [0, 1)"),
    (["--prune_completions", "nan"], "--prune_completions must be a finite number (got nan)"),
    (["--keep_floor", "0"], "--keep_floor in [2^-10, 1]"),
    (["--keep_floor", "1e-300"], "--keep_floor in [2^-10, 1]"),  # 1e300 prompts to examine
    (["--keep_floor", "1.5"], "--keep_floor in [2^-10, 1]"),
    (["--window", "0"], "--window must be in [1, 2^20], --lookahead in [1, 2^10] (got 0, 2.0)"),
    (["--window", "2000000"], "--window must be in [1, 2^20], --lookahead in [1, 2^10]"),
    (["--lookahead", "0.5"], "--window must be in [1, 2^20], --lookahead in [1, 2^10] (got 64, "
                             "0.5)"),
    (["--lookahead", "1e12"], "--lookahead in [1, 2^10] (got 64, 1000000000000.0)"),  # it hung
    (["--window", "2.5"], "argument --window: invalid int value"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, args,
                                                         message):
    # a missing model behind: a check that let the flag through fails fast, not by training
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["dppo.py", *args, "--out", str(out),
                                      "--model", str(tmp_path / "no_model")])
    with pytest.raises(SystemExit) as exit_:
        dppo.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert (exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
            and message in lines[0]), lines
    assert not out.exists()


def test_help_explains_every_flag(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["dppo.py", "--help"])
    with pytest.raises(SystemExit):
        dppo.main()
    text = capsys.readouterr().out
    from dataclasses import fields
    for f in fields(dppo.Args):
        assert f"--{f.name}" in text and f.metadata["help"].split()[0] in text


def test_toy_prunes_both_levels_and_resumes(tmp_path):
    """A 12-prompt data set of carry-free sums (mostly all-correct groups) comes round again at
    step 3: prompts that tied are then pruned and refilled. Every step logs the pruning and packing
    metrics, the rollouts sampled and trained, and the packer's time as its own phase; --resume
    goes on, with the history table."""
    rows = [json.loads(line) for line in open(os.path.join(REPO, "toy", "data", "train.jsonl"))]
    easy = [r for r in rows
            if sum(int(x) % 10 for x in re.findall(r"\d+", r["question"])) < 10][:15]  # no carry
    data = tmp_path / "easy.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in easy))  # 12 train, 3 held out
    out = str(tmp_path / "run")
    common = ["--dataset", str(data), "--model", os.path.join(REPO, "toy", "model"),
              "--rollout", "hf", "--prompts_per_step", "6", "--group_size", "4",
              "--max_tokens", "24", "--lr", "1e-4", "--eval_every", "0",
              "--out", out]
    result = run(common + ["--steps", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    result = run(["--resume", out, "--steps", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in logged if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert 0 < r["completion_keep_frac"] < 1 and r["weight_max"] >= r["weight_mean"] >= 1
        assert r["trained_rollouts"] == pytest.approx(r["completion_keep_frac"] * r["rollouts"],
                                                      rel=1e-5)
        assert r["rollouts"] == pytest.approx(4 * r["prompt_keep_frac"] * r["prompts_examined"],
                                              rel=1e-5)  # G = 4
        assert 0 < r["pack_density"] <= 1 and "pack_density_ffd" not in r
        # the window packer is the one that ran
        assert r["pack_micro_batches"] == r["micro_batches"]
        phases = [k for k in r if k.endswith("_s") and k not in ("step_s", "tokens_per_s")]
        assert ({"rollout_s", "reward_s", "update_s", "pack_s", "push_s"} <= set(phases)
                and r["pack_s"] > 0)
        # not nested: pack_s is not also in update_s
        assert sum(r[k] for k in phases) <= r["step_s"] * 1.0001
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["method"] == "dppo" and config["ideal_trained_fraction"] == 0.5  # 1 - r_o
    # first epoch: no history, nothing to prune
    assert [r["prompts_examined"] for r in train[:2]] == [6, 6]
    # second epoch
    assert any(r["prompts_examined"] > 6 and r["prompt_keep_frac"] < 1 for r in train[2:])
    # the two newest
    assert [os.path.basename(c) for c in checkpoints(out)] == ["checkpoint-3", "checkpoint-4"]
    history = torch.load(os.path.join(checkpoints(out)[-1], "state.pt"),
                         weights_only=True)["history"]
    assert len(history) == 12 and any(history.values())
