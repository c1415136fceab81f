"""bench.py compares equal work (its padded update has the packed update's gradient) and runs end to
end."""
import argparse
import json
import os
import re
import string
import subprocess
import sys

import numpy as np
import pytest

from bench import METHODS, padded_update, synthetic_samples
from common import Passes, policy_update
from conftest import RecordingOptimizer, assert_grads_close

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_padded_update_has_the_packed_gradient(tiny):
    model, tokenizer = tiny
    samples = synthetic_samples(12, "toy", len(tokenizer), 4, seed=1)  # seq-mean coefficients set
    assert abs(sum(s.coef * len(s.completion_ids) for s in samples) - 1) < 1e-6
    grads = []
    for update, budget in ((policy_update, 128), (padded_update, 100)):
        opt = RecordingOptimizer(model)
        extra = dict(clip=(0.2, 0.2), beta=0.0) if update is policy_update else {}
        # 7 rows per chunk: several log-prob chunks per micro-batch
        passes = Passes(1.0, len(tokenizer), budget, 7)
        update(model, opt, samples, passes, grad_clip=1e9, **extra)
        grads.append(opt.grads)
    assert_grads_close(grads[1], grads[0])


def test_bench_step_part_runs_on_the_toy_shape(tmp_path):
    command = [sys.executable, os.path.join(REPO, "bench.py"), "--parts", "step", "--shape", "toy",
               "--lengths", "toy", "--sequences", "16", "--budgets", "128", "--repeats", "1",
               "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    table = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| toy (")]
    assert [row[1] for row in table] == ["padded", "packed", "shared prompt"]
    assert table[0][6] == "-"
    assert table[1][6].endswith("x padded") and table[2][6].endswith("x packed")
    assert table[0][7] == "-" and table[1][7] != "-"  # the bound of packing
    # 16 completions, 8 per prompt (two groups of ~91 tokens, each within the budget): each prompt
    # once, not 8 times
    samples = synthetic_samples(16, "toy", 100, 8)  # the same lengths (the vocabulary: the ids)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    saved = 7 * (len(samples[0].prompt_ids) + len(samples[8].prompt_ids))
    done = tokens - sum(len(s.prompt_ids) for s in samples)
    assert table[0][0] == f"| toy ({done:,} of {tokens:,} tokens)"
    assert table[2][7] == f"{tokens / (tokens - saved):.2f}x tokens"
    report = (tmp_path / "results.md").read_text()
    assert "## 1. The training update" in report and "## 2." not in report


def test_chains_length_mix_is_what_its_model_samples():
    """The chains mix is not a formula: the lengths are those of its own model's completions at
    temperature 1 on its training prompts, so they vary as the task's do (the toy mix is one
    length)."""
    from bench import model_lengths
    from common import DATASETS, load_dataset, load_tokenizer, prompt_token_ids
    from grpo import prompt as question_prompt
    lengths = model_lengths("chains", 16, 4, 0)  # the same call as synthetic_samples makes
    samples = synthetic_samples(16, "chains", 448, 4)
    assert [(len(s.prompt_ids), len(s.completion_ids)) for s in samples] == lengths
    # 4 per prompt
    assert all(samples[i].prompt_ids == samples[i // 4 * 4].prompt_ids for i in range(16))
    assert len({tuple(s.prompt_ids) for s in samples}) == 4
    completions = [c for _, c in lengths]
    assert min(completions) >= 1 and max(completions) <= DATASETS["chains"]["max_tokens"]
    assert max(completions) - min(completions) >= 40  # varied, unlike the toy's ~9 tokens
    train, _, _ = load_dataset("chains", 1)
    tokenizer = load_tokenizer(DATASETS["chains"]["model"])
    rows = prompt_token_ids(tokenizer, train, question_prompt, "plain", 512)
    prompts = {len(r["prompt_ids"]) for r in rows}
    assert {p for p, _ in lengths} <= prompts


def test_padding_bound_by_hand():
    from bench import padded_groups, padding_bound
    lens = [10, 4, 6, 2]
    # 20 // 10 = 2 sequences per padded micro-batch
    assert padded_groups(lens, 20) == [[10, 4], [6, 2]]
    tokens, scores = padding_bound(lens, 20)
    assert abs(tokens - (2 * 10 + 2 * 6) / 22) < 1e-12  # 32 / 22 = 1.4545
    assert abs(scores - (2 * 100 + 2 * 36) / (100 + 16 + 36 + 4)) < 1e-12  # 272 / 156 = 1.7436
    assert padding_bound([5, 5, 5], 100) == (1.0, 1.0)  # equal lengths: nothing to save


# ----------------------------------------------- the side-by-side parts: every formula by hand

def test_step_phases_read_the_logged_phases():
    from bench import PHASES, step_phases
    rows = [{"step": 0, "eval_accuracy": 0.5},
            {"step": 1, "rollout_s": 99, "reward_s": 99, "logp_s": 9, "update_s": 99, "push_s": 9,
             "step_s": 999, "rollouts": 99, "trained_rollouts": 99},
            {"step": 2, "rollout_s": 1.0, "reward_s": 0.5, "logp_s": 1.0, "update_s": 1.8,
             "pack_s": 0.2, "push_s": 0.4, "step_s": 5.0, "tokens_per_s": 900.0, "rollouts": 8,
             "trained_rollouts": 4},  # DPPO-like: its packer timed as its own phase
            {"step": 3, "rollout_s": 2.0, "reward_s": 0.5, "logp_s": 0.5, "update_s": 1.5,
             "mmr_s": 0.4, "push_s": 0.5, "step_s": 5.4, "tokens_per_s": 800.0, "rollouts": 8,
             "trained_rollouts": 8, "eval_accuracy": 0.7}]  # MMR-like: embeddings
    got = step_phases(rows)  # the first timed step is the warm-up, left out
    want = {"rollout_s": 1.5, "reward_s": 0.5, "logp_s": 0.75, "update_s": 1.65,
            "overhead_s": 0.3, "other_s": 0.5, "step_s": 5.2, "rollouts": 8,
            "trained": 6}  # tokens_per_s is no phase
    assert got.keys() == want.keys()
    for k in want:
        assert abs(got[k] - want[k]) < 1e-9, k
    assert abs(sum(got[p] for p in PHASES) - got["step_s"]) < 1e-9
    untimed = {**rows[2], "step_s": 5.3}  # 0.4 s outside every phase: counted with the push (0.4 s)
    assert abs(step_phases([rows[1], untimed])["other_s"] - 0.8) < 1e-9
    # one stalled step: the median ignores it (of 1, 50, 2; the mean would be 17.7)
    stalled = {**rows[2], "rollout_s": 50.0, "step_s": 54.0}
    assert step_phases([rows[1], rows[2], stalled, rows[3]])["rollout_s"] == 2.0
    assert step_phases([rows[1], rows[2], stalled, rows[3]])["step_s"] == 5.4


def test_mfu_by_hand():
    from bench import mfu
    # 1.5e9 parameters, 20,000 tokens in 2 s: 6 * 1.5e9 * 2e4 / 2 = 9e13 FLOP/s = 90 TFLOP/s, of a
    # 900 TFLOP/s peak
    assert abs(mfu(1.5e9, 20_000, 2.0, 900.0) - 0.1) < 1e-12


def test_timed_lets_the_calls_take_turns(monkeypatch):
    """The layouts of one budget take turns (a warm-up round, then `repeats` timed rounds), so that
    a drift of the machine's speed falls on each alike; each gets the median of its own timed runs,
    not of the warm-up."""
    import bench
    # perf_counter readings
    clock = iter([0, 9, 9, 18, 18, 19, 19, 21, 21, 22, 22, 25, 25, 26, 26, 27])
    order = []
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    calls = [lambda: order.append("a") or "A", lambda: order.append("b") or "B"]
    (a_s, a_mem, a_out), (b_s, b_mem, b_out) = bench.timed(calls, 3)
    assert order == ["a", "b"] * 4
    assert (a_out, b_out, a_mem, b_mem) == ("A", "B", None, None)
    assert (a_s, b_s) == (1.0, 2.0)  # a: 9 (warm-up), then 1, 1, 1; b: 9, then 2, 3, 1


def test_ideal_ratios_and_the_ideal_step():
    from bench import ideal_ratios, ideal_step
    grpo = {"rollout_s": 1.0, "reward_s": 1.0, "logp_s": 2.0, "update_s": 4.0, "overhead_s": 0.0,
            "other_s": 2.0}
    cppo = ideal_ratios(0.125)  # config.json's ideal_trained_fraction: 1 - P
    assert cppo["logp_s"] == cppo["update_s"] == 0.125 and cppo["rollout_s"] == 1.0
    assert abs(ideal_step(cppo, grpo) - (1 + 1 + 0.25 + 0.5 + 2) / 10) < 1e-12  # 0.475
    assert abs(ideal_step(ideal_ratios(0.5), grpo) - 0.7) < 1e-12  # DPPO's 1 - r_o
    assert ideal_step(ideal_ratios(1.0), grpo) == 1.0  # GRPO, 2-GRPO, MMR-GRPO


def test_breakdown_flags_sample_the_same_rollouts():
    from bench import script_flags
    from cppo import kept_per_question, questions_to_sample
    Q, G, P = 16, 16, 0.875
    args = argparse.Namespace(questions=Q, group=G, pruning=P, rollout="hf", model=None,
                              breakdown_steps=3)
    for method in ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]:
        flags = script_flags(args, "breakdown", "toy", method, 0)
        B = int(flags[flags.index("--prompts_per_step") + 1])
        g = int(flags[flags.index("--group_size") + 1])
        questions = questions_to_sample(B, g, kept_per_question(g, P)) if method == "cppo" else B
        assert questions * g == Q * G, method
        assert flags[flags.index("--lr") + 1] == "0.0003"
        assert ("--pruning" in flags) == (method == "cppo")
    assert script_flags(args, "breakdown", "toy", "two_grpo", 0)[5:8:2] == ["128", "2"]
    learning = argparse.Namespace(rollout="hf", model="m", eval_every=5, learn_steps=None,
                                  eval_n=7)
    assert script_flags(learning, "learning", "chains", "cppo", 2) == [
        "--dataset", "chains", "--rollout", "hf", "--model", "m", "--seed", "2", "--eval_every",
        "5", "--eval_n", "7"]


def test_curve_and_first_reaching():
    """Each evaluation's point: step, accuracy, then training s, rollouts and generated tokens
    (completion_len x rollouts of each step) summed up to it."""
    from bench import curve, first_reaching
    rows = [{"step": 0, "eval_accuracy": 0.6},
            {"step": 1, "step_s": 2.0, "rollouts": 10, "completion_len": 4.5},
            {"step": 2, "step_s": 3.0, "rollouts": 10, "completion_len": 2.0, "eval_accuracy": 0.9},
            {"step": 3, "step_s": 1.0, "rollouts": 30, "completion_len": 1.0,
             "eval_accuracy": 0.85}]
    points = curve(rows)
    # tokens: 45, then 45 + 20, then 65 + 30
    assert points == [(0, 0.6, 0.0, 0.0, 0.0), (2, 0.9, 5.0, 20.0, 65.0),
                      (3, 0.85, 6.0, 50.0, 95.0)]
    assert first_reaching(points, 0.9) == (2, 0.9, 5.0, 20.0, 65.0)
    assert first_reaching(points, 0.6) == (0, 0.6, 0.0, 0.0, 0.0)
    assert first_reaching(points, 0.95) is None


def test_an_estimate_by_hand():
    """estimate(): the mean of the per-seed differences, the 5th-95th percentiles of its bootstrap
    means over every resample (each the least mean with that share of the resamples at or below
    it) and the t-interval; no verdict word, whatever the intervals say."""
    from bench import estimate
    nan = float("nan")
    # values seed by seed; the third seed has no partner (NaN: not reached, or not known). Two
    # differences, +0.05 and -0.10: of the 4 resamples one has mean +0.05, two -0.025, one -0.10,
    # so the 5th percentile is -0.10 and the 95th +0.05; t: -0.025 +- t(0.95, 1) sd / sqrt(2) =
    # -0.025 +- 6.3138 x 0.075
    assert estimate([0.9, 0.8, 0.5], [0.85, 0.9, nan], ".4f") == (
        "-0.0250 [-0.1000, +0.0500], t [-0.4985, +0.4485]")
    # differences 0.3, 0, 0, 0.05 x 3: a resample's mean is (0.3 a + 0.05 c) / 6, a draws of 0.3
    # (chance 1/6 each) and c of 0.05 (1/2 each). With a = 0, c <= 1 has chance (1/3)^6 + 6 (1/2)
    # (1/3)^5 = 0.0137 < 5 %, c <= 2 adds 15 (1/2)^2 (1/3)^4 = 0.0463: the 5th percentile is
    # 0.1 / 6 = 0.017 > 0. sd 0.112916 gives t [0.075 - 2.015048 x 0.112916 / sqrt(6)] = -0.018
    zero = [0.0] * 6
    second = estimate([0.3, 0.0, 0.0, 0.05, 0.05, 0.05], zero, ".3f")
    assert second == "+0.075 [+0.017, +0.158], t [-0.018, +0.168]"
    assert estimate([3.0] * 6, zero, ".1f") == "+3.0 [+3.0, +3.0], t [+3.0, +3.0]"
    assert estimate([1.0, nan], [nan, 1.0], ".2f") == "-"  # no pair
    # one pair: no spread, no t-interval
    assert estimate([1.0], [0.5], ".1f") == "+0.5 [+0.5, +0.5], t [+nan, +nan]"
    # 6 seeds, t(0.95, 5) = 2.015048: differences 1, 2, 3, 4, 5, -3, mean 2, sd sqrt(40 / 5)
    d = [1.0, 2.0, 3.0, 4.0, 5.0, -3.0]
    t_low = 2 - 2.015048 * 8 ** 0.5 / 6 ** 0.5
    assert estimate(d, zero, ".2f") == f"+2.00 [+0.17, +3.67], t [{t_low:+.2f}, {4 - t_low:+.2f}]"


def test_the_bootstrap_takes_every_resample():
    """resampled_means: with n pairs, every one of the n^n ordered resamples once while n^n <=
    10^6 (6 pairs: 46,656), so an interval or a p does not depend on a random seed; with more
    pairs, 10,000 drawn with numpy seed 0."""
    import itertools
    from docs.rule import resampled_means
    d = np.array([0.3, -0.1, 0.0, 0.05, 0.2, -0.4])
    every = sorted(sum(d[i] for i in draw) / 6 for draw in itertools.product(range(6), repeat=6))
    means = resampled_means(d)
    assert len(means) == 6 ** 6 == 46_656
    assert np.allclose(np.sort(means), every, atol=1e-15)
    np.random.seed(123)  # no global state counts
    assert np.array_equal(resampled_means(d), means)
    assert len(resampled_means(np.arange(8.0))) == 10_000  # 8^8 = 16.8M: drawn


def test_power_by_hand():
    """power(d, shift, alpha): the one-sided t-test's chance to pass at level alpha over len(d)
    pairs with d's sd, when the true mean lies `shift` past the bound. At shift 0 it is alpha
    itself; against 200,000 simulated experiments of normal differences it agrees to 0.005."""
    import scipy.stats
    from docs.rule import power
    d = np.array([-0.14, 0.047, 0.003, 0.047, 0.047, 0.007])  # DPPO's accuracy pairs, rounded
    assert power(d, 0.0, 0.05) == pytest.approx(0.05, abs=1e-12)
    sd, n = d.std(ddof=1), len(d)
    rng = np.random.default_rng(0)
    for shift, alpha in [(0.02, 0.05), (0.02, 0.0125), (0.08, 0.05)]:
        # a true mean `shift` above the bound 0: the test passes when t > t(1 - alpha, n - 1)
        x = rng.normal(shift, sd, (200_000, n))
        t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / np.sqrt(n))
        simulated = np.mean(t > scipy.stats.t.ppf(1 - alpha, n - 1))
        assert power(d, shift, alpha) == pytest.approx(simulated, abs=0.005), (shift, alpha)
    assert power(np.array([0.05] * 6), 0.02, 0.05) == 1.0  # no spread: the test always passes


def test_p_below_by_hand():
    """p_below(d, b): the larger of the one-sided t-test's p (that the mean is >= b) and the
    bootstrap's (the share of resampled means >= b). Differences -1, -2, -6: mean -3, sd sqrt(7),
    standard error sqrt(7 / 3); with 2 degrees of freedom the t distribution's CDF is 1/2 + t /
    (2 sqrt(2 + t^2)). Against 0, t = -1.9640 and p = 0.0943; no resampled mean reaches 0. Against
    -1.5, t = -0.98198 and p = 0.2148; of the 27 equally likely resamples 4 have a mean >= -1.5
    ((-1, -1, -1) and the three orders of (-1, -1, -2)): 0.148, so the t-test's p is the larger."""
    from docs.rule import p_below

    def t_p(t):
        return 0.5 + t / (2 * (2 + t * t) ** 0.5)
    d = np.array([-1.0, -2.0, -6.0])
    se = (7 / 3) ** 0.5
    assert p_below(d, 0.0) == pytest.approx(t_p(-3 / se), abs=1e-9)
    assert t_p(-3 / se) == pytest.approx(0.0943, abs=1e-4)
    assert p_below(d, -1.5) == pytest.approx(t_p(-1.5 / se), abs=1e-9)
    assert t_p(-1.5 / se) == pytest.approx(0.2148, abs=1e-4)
    # every seed alike: the t-test has no spread; below the bound its p is 0, else 1
    assert p_below(np.array([-2.0] * 6), 0.0) == 0.0
    assert p_below(np.array([2.0] * 6), 0.0) == 1.0
    assert p_below(np.array([-1.0]), 0.0) == 1.0  # one pair: no test
    # the bootstrap decides when its share is the larger. Differences -1 x 5 and +2: mean -0.5,
    # sd sqrt(1.5), t = -0.5 / 0.5 = -1, p = 0.1816 (t table, 5 degrees of freedom), while a
    # resampled mean is >= 0 when at least 2 of the 6 draws are the +2: 1 - (5/6)^6 - 6 (1/6)
    # (5/6)^5 = 0.2632
    # (of the 46,656 resamples, 12,281)
    skewed = np.array([-1.0] * 5 + [2.0])
    assert p_below(skewed, 0.0) == pytest.approx(12_281 / 46_656, abs=1e-15)


def test_holm_by_hand():
    """Holm at 0.05 over four: sorted p 0.01 (against 0.05 / 4 = 0.0125: passes), 0.02 (against
    0.05 / 3 = 0.0167: fails), and after a failure none passes."""
    from docs.rule import holm
    assert holm({"a": 0.02, "b": 0.01, "c": 0.5, "d": 0.03}, 0.05) == {
        "b": True, "a": False, "d": False, "c": False}
    passes = holm({"a": 0.012, "b": 0.016, "c": 0.024, "d": 0.049}, 0.05)
    assert passes == dict.fromkeys("abcd", True)
    assert holm({"a": 0.013, "b": 0.001, "c": 0.001, "d": 0.001}, 0.05) == {
        "b": True, "c": True, "d": True, "a": True}  # the last against 0.05 / 1
    # 0.0126 fails against 0.05 / 4 as the smallest, but passes second, against 0.05 / 3
    assert holm({"a": 0.0126, "b": 0.0, "c": 1.0, "d": 1.0}, 0.05) == {
        "b": True, "a": True, "c": False, "d": False}
    assert holm({"a": 0.0126, "b": 0.5, "c": 1.0, "d": 1.0}, 0.05)["a"] is False


def test_a_kept_summary_with_the_same_flags_is_not_run_again(tmp_path):
    from bench import run_script, script_flags
    args = argparse.Namespace(rollout="auto", model=None, eval_every=None, learn_steps=None,
                              eval_n=None)
    flags = script_flags(args, "ablation", "chains", "dppo", 1)
    learning = ["--dataset", "chains", "--rollout", "auto", "--seed", "1"]
    assert flags == learning + ["--prune_prompts", "0", "--prune_completions", "0"]
    assert script_flags(args, "learning", "chains", "dppo", 1) == learning
    kept = {"ablation dppo 1": {"flags": flags, "test": 0.5}}
    got = run_script(args, str(tmp_path), ("ablation", "chains", "dppo", 1), flags, kept)
    assert got == {**kept["ablation dppo 1"], "kept": True}
    assert not os.listdir(tmp_path)  # nothing ran


def learning_args(**given):
    """bench's flags as parse() leaves them for `--parts learning --datasets chains`."""
    flags = dict(parts=["learning"], datasets=["chains"], methods=list(METHODS), seeds=[0, 1],
                 quick=False, rollout="auto", model=None, eval_every=None,
                 learn_steps=None, eval_n=None, target=None)
    return argparse.Namespace(**{**flags, **given})


def test_cppo_beside_its_ablation_validates_every_2_steps_unless_eval_every_is_given():
    """The paired run (the default command made again beside the ablation) is the learning run's
    flags, but CPPO's on chains validates every 2 steps and MMR-GRPO's (and its ablation) every 5;
    their learning runs (against GRPO) keep the task's own, so their kept summaries stay valid."""
    from bench import script_flags
    learning = ["--dataset", "chains", "--rollout", "auto", "--seed", "0"]
    assert script_flags(learning_args(), "paired", "chains", "cppo", 0) == learning + [
        "--eval_every", "2"]
    assert script_flags(learning_args(), "learning", "chains", "cppo", 0) == learning
    for part in ["paired", "ablation"]:
        assert script_flags(learning_args(), part, "chains", "mmr_grpo", 0) == learning + [
            "--eval_every", "5"]
    for method in ["grpo", "two_grpo", "dppo", "mmr_grpo"]:  # theirs as it was
        assert script_flags(learning_args(), "learning", "chains", method, 0) == learning
    for method in ["grpo", "two_grpo", "dppo"]:
        assert script_flags(learning_args(), "paired", "chains", method, 0) == learning
    assert script_flags(learning_args(), "paired", "toy", "cppo", 0)[-2:] == ["--seed", "0"]
    given = script_flags(learning_args(eval_every=7), "paired", "chains", "cppo", 0)
    assert given == learning + ["--eval_every", "7"]


def test_the_ablation_runs_flags_and_folders(tmp_path, monkeypatch):
    """Each ablation: the learning flags, then its table's; grpo.py runs 2-GRPO's; the folder
    <task>-ablation-<method>-<seed>, the kept key `ablation <method> <seed>`. The tokens to the
    target come from the run's metrics.jsonl."""
    import bench
    want = {"cppo": ("cppo", ["--pruning", "0", "--steps", "640", "--warmup_steps", "16",
                              "--eval_every", "9"]),
            "dppo": ("dppo", ["--prune_prompts", "0", "--prune_completions", "0"]),
            "two_grpo": ("grpo", ["--group_size", "16", "--prompts_per_step", "8", "--steps",
                                  "640", "--lr", "3.75e-5", "--beta", "0", "--eps_high", "0.28",
                                  "--warmup_steps", "10", "--eval_every", "12"]),
            "mmr_grpo": ("grpo", ["--eval_every", "5"])}  # grpo.py, every 5 steps as its pair
    assert set(bench.ABLATIONS) == set(want) == set(bench.PRIMARY)
    rows = [{"step": 0, "eval_accuracy": 0.5},
            {"step": 1, "step_s": 2.0, "rollouts": 128, "completion_len": 10.0,
             "eval_accuracy": 0.8},
            {"step": 2, "step_s": 2.0, "rollouts": 128, "completion_len": 20.0,
             "eval_accuracy": 0.9, "test_accuracy": 0.88, "trained_rollouts": 128}]
    rows[1]["trained_rollouts"] = 128
    ran = []

    def fake_run(command, **kw):  # a finished run: its metrics and config
        out = command[command.index("--out") + 1]
        os.makedirs(out)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
        config = {"engine": "HFEngine", "args": {"group_size": 16},
                  "ideal_trained_fraction": 1.0}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
        ran.append(command)
        return subprocess.CompletedProcess(command, 0)
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    kept = {}
    for method, (script, overrides) in want.items():
        for seed in [0, 3]:
            learning = ["--dataset", "chains", "--rollout", "auto", "--seed", str(seed)]
            flags = bench.script_flags(learning_args(), "ablation", "chains", method, seed)
            assert flags == learning + overrides, (method, seed)
            # 16-GRPO's rate is 1/8 of 2-GRPO's, the paper's ratio (1e-6 against 8e-6)
            if method == "two_grpo":
                assert float(overrides[overrides.index("--lr") + 1]) == 3e-4 / 8
            got = bench.run_script(learning_args(), str(tmp_path), ("ablation", "chains", method,
                                                                    seed), flags, kept)
            command = ran[-1]
            assert command[1] == os.path.join(bench.REPO, f"{script}.py")
            assert command[2:-2] == flags
            assert command[-1] == str(tmp_path / f"chains-ablation-{method}-{seed}")
            assert kept[f"ablation {method} {seed}"] is got and got["flags"] == flags
    # 10 x 128 + 20 x 128 generated tokens by step 2, where 0.85 is first reached
    assert got["curve"][-1] == (2, 0.9, 4.0, 256.0, 3840.0)
    metrics = bench.run_metrics([got], 0.85)
    assert metrics["generated tokens to 0.85"] == [3840.0]
    assert metrics["rollouts to 0.85"] == [256.0] and metrics["steps to 0.85"] == [2]
    assert metrics["questions to 0.85"] == [16.0]  # 256 rollouts of G = 16
    assert metrics["steps to peak"] == [2]
    assert json.loads((tmp_path / "chains-ablation-two_grpo-3" / "bench_flags.json")
                      .read_text()) == bench.script_flags(learning_args(), "ablation", "chains",
                                                          "two_grpo", 3)
    # the pair: the method's own script, its own folder and key beside the learning run's
    flags = bench.script_flags(learning_args(), "paired", "chains", "two_grpo", 3)
    got = bench.run_script(learning_args(), str(tmp_path), ("paired", "chains", "two_grpo", 3),
                           flags, kept)
    assert ran[-1][1] == os.path.join(bench.REPO, "two_grpo.py")
    assert ran[-1][-1] == str(tmp_path / "chains-paired-two_grpo-3")
    assert kept["paired two_grpo 3"] is got and "learning two_grpo 3" not in kept


def test_ablations_run_after_the_learning_runs_on_chains_only(monkeypatch):
    """The jobs bench runs: learning, then seed by seed each method given that has an ablation:
    its default command again (paired), then the ablation; none on the toy, none with
    --quick."""
    import bench
    jobs = []

    def fake(args, runs, job, flags, kept):
        jobs.append((job[0], job[2], job[3], flags))
        return {"curve": [(0, 0.5, 100.0, 0.0)]}
    monkeypatch.setattr(bench, "run_script", fake)
    bench.run_scripts(learning_args(), "unused")
    parts = [part for part, _, _, _ in jobs]
    assert parts == ["learning"] * 10 + ["paired", "ablation"] * 8
    pairs = [(m, s) for part, m, s, _ in jobs if part in ("paired", "ablation")]
    assert pairs[::2] == pairs[1::2] == [
        ("two_grpo", 0), ("cppo", 0), ("dppo", 0), ("mmr_grpo", 0),
        ("two_grpo", 1), ("cppo", 1), ("dppo", 1), ("mmr_grpo", 1)]
    for given, ablations in [({"methods": ["grpo", "dppo"]}, [("dppo", 0), ("dppo", 1)]),
                             ({"quick": True}, []), ({"datasets": ["toy"]}, []),
                             ({"methods": ["mmr_grpo"], "seeds": [4]}, [("mmr_grpo", 4)])]:
        jobs.clear()
        bench.run_scripts(learning_args(**given), "unused")
        assert [(m, s) for part, m, s, _ in jobs if part == "ablation"] == ablations, given
        assert [(m, s) for part, m, s, _ in jobs if part == "paired"] == ablations, given


def ablation_results(old_curves=False):
    """Made-up chains summaries of GRPO, 2-GRPO and CPPO at 6 seeds, with 16-GRPO's and CPPO's
    ablations and their pairs, 2-GRPO's and CPPO's default commands made again, which end 0.02
    and 0.01 more accurate than their learning runs (a run kept before tokens were counted has
    4-number points)."""
    results = {}
    for s in range(6):
        grpo = [(0, 0.5, 0.0, 0.0, 0.0), (10, 0.86, 20.0 + s, 1280.0, 60000.0),
                (80, 0.9, 200.0, 10240.0, 500000.0)]
        two = [(0, 0.5, 0.0, 0.0, 0.0), (10, 0.8, 10.0, 1280.0, 50000.0),
               (20, 0.87, 20.0, 2560.0, 100000.0 + 1000 * s), (80, 0.9, 40.0, 10240.0, 4e5)]
        sixteen = [(0, 0.5, 0.0, 0.0, 0.0), (15, 0.85, 30.0, 1920.0, 80000.0),
                   (30, 0.88, 60.0, 3840.0, 160000.0), (640, 0.92, 200.0, 81920.0, 3e6)]
        cppo = [(0, 0.5, 0.0, 0.0, 0.0), (3, 0.9, 36.0, 768.0, 30000.0),
                (6, 0.95, 72.0 + s, 1536.0, 60000.0)]
        cppo_off = [(0, 0.5, 0.0, 0.0, 0.0), (10, 0.8, 50.0, 2560.0, 9e4),
                    (20, 0.9, 100.0, 5120.0, 18e4)]
        if old_curves:  # the learning and paired runs' both
            two = [p[:4] for p in two]
        for part, m, points, test, group in [("learning", "grpo", grpo, 0.88, 8),
                                             ("learning", "two_grpo", two, 0.9 - 0.01 * (s % 2), 2),
                                             ("paired", "two_grpo", two, 0.92 - 0.01 * (s % 2), 2),
                                             ("ablation", "two_grpo", sixteen, 0.92, 16),
                                             ("learning", "cppo", cppo, 0.97, 16),
                                             ("paired", "cppo", cppo, 0.98, 16),
                                             ("ablation", "cppo", cppo_off, 0.93, 16)]:
            flags = ["--dataset", "chains", "--seed", str(s)]
            results[part, "chains", m, s] = {"curve": points, "test": test, "flags": flags,
                                             "group": group}
    return results


def test_the_ablation_table_from_made_up_runs():
    """Each method against its ablation, as estimates: its paired run - ablation, paired by seed,
    in questions seen (rollouts / G) and seconds to the target, at equal time (each run's last
    evaluation by the sooner end of the two), at the end, at the peak; 2-GRPO's shares of
    16-GRPO's. No verdict word on any of them."""
    import bench
    args = learning_args(methods=["grpo", "two_grpo", "cppo"], seeds=list(range(6)))
    text = "\n".join(bench.learning_section(args, "chains", 5, ablation_results(), {}))
    lines = text.splitlines()
    ablation = lines.index(next(line for line in lines if "against its ablation" in line))
    header = lines[ablation + 2]
    assert header == ("| method | questions to 0.85 | training s to 0.85 | rollouts to 0.85 | "
                      "generated tokens to 0.85 | validation accuracy at equal time | final test "
                      "accuracy | best validation accuracy | steps to peak | training s, whole "
                      "run |")
    cppo = lines[ablation + 5].split(" | ")
    assert cppo[0] == "| cppo paired"
    # CPPO 0.85 at step 3, 36 s, 768 rollouts (48 questions of G = 16), 30,000 tokens; its
    # ablation at step 20, 100 s, 5,120 (320 questions), 180,000: every seed the same, so both
    # intervals are the difference itself, and no word says what it means
    assert cppo[1] == "-272 [-272, -272], t [-272, -272]"
    assert cppo[2] == "-64 [-64, -64], t [-64, -64]"
    assert cppo[3] == "-4,352 [-4,352, -4,352], t [-4,352, -4,352]"
    assert cppo[4].startswith("-150,000 [")
    # CPPO ends at 72 + s s, before its ablation (100 s): 0.95 against 0.8 (the ablation at 50 s)
    assert cppo[5] == "+0.150 [+0.150, +0.150], t [+0.150, +0.150]"
    # the paired run's 0.98 against 0.93 (the learning run's 0.97 pairs with GRPO's only)
    assert cppo[6] == "+0.050 [+0.050, +0.050], t [+0.050, +0.050]"
    assert cppo[8] == "-14 [-14, -14], t [-14, -14]"  # its peak at step 6, the ablation's at 20
    two = lines[ablation + 4].split(" | ")
    assert two[0] == "| two_grpo paired"
    # 2-GRPO ends at 40 s: its 0.9 against 16-GRPO's 0.85 (its evaluation at 30 s)
    assert two[5].startswith("+0.050 [")
    words = ("faster", "slower", "fewer", "more accurate", "less accurate", "distinguishable")
    assert not [w for w in words if w in "\n".join(lines[ablation + 2:])], "an estimate got a word"
    assert "| two_grpo ablation | validation accuracy at equal time | 0.850 | 0.850 |" in text
    assert "| cppo paired | validation accuracy at equal time | 0.950 | 0.950 |" in text
    assert "| cppo | validation accuracy at equal time |" not in text  # against GRPO: none
    assert "| cppo | final test accuracy | 0.970 | 0.970 |" in text
    assert "| cppo paired | questions to 0.85 | 48 | 48 |" in text
    shares = lines.index("| 2-GRPO / 16-GRPO | seed 0 | seed 1 | seed 2 | seed 3 | seed 4 | seed 5 "
                         "| mean |")
    # the paired runs' 0.92 and 0.91 against 16-GRPO's 0.92
    assert lines[shares + 2] == ("| final test accuracy | 100.0% | 98.9% | 100.0% | 98.9% | "
                                 "100.0% | 98.9% | 99.5% (6 seeds) |")
    assert lines[shares + 3].startswith("| rollouts, whole run | 12.5% | 12.5% |")
    assert lines[shares + 4].startswith("| training s, whole run | 20.0% |")
    assert "| mmr_grpo |" not in text.split("Recipes against GRPO's")[1]  # not run: no row
    assert "| mmr_grpo | steps to peak: not run yet |" in text  # its claim: no verdict yet
    assert "**Recipes against GRPO's** (estimates" in text
    bench.plt.close("all")


def test_the_primary_claims_from_made_up_runs():
    """Each paper's primary claim by the rule: CPPO's whole run (72 + s against 100 s) and 2-GRPO's
    (40 against 200 s) fall in every seed, and their final test accuracy is kept within 0.02
    (CPPO +0.05 each seed; 2-GRPO 0 or -0.01): both hold by Holm over four, DPPO and MMR-GRPO
    counting as p = 1. At 5 pairs: no verdict. A 2-GRPO that loses 0.03 of accuracy in every seed
    fails (p3 = 0 passes Holm's second family); one that loses 0.01 and 0.03 in turn, 0.02 on
    average, is not shown either way."""
    import bench
    args = learning_args(methods=["grpo", "two_grpo", "cppo"], seeds=list(range(6)))
    results = ablation_results()
    text = "\n".join(bench.learning_section(args, "chains", 5, results, {}))
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines()
            if line.startswith(("| cppo | training s, whole run:",
                                "| two_grpo | training s, whole run:"))}
    assert rows["two_grpo"].startswith(
        "| two_grpo | training s, whole run: -160 [-160, -160], t [-160, -160]; 0.20x | final "
        "test accuracy: -0.005 [")
    # p2 by hand: -(accuracy kept) is 0, 0.01, 0, ...: mean 0.005, sd 0.005477, t = (0.005 - 0.02)
    # / (0.005477 / sqrt(6)) = -6.708, p = 0.00056 (5 degrees of freedom); no resample reaches 0.02.
    # p3 = 1 - 0.00056 prints as 1. The verdict rests on p2 (p1 = 0), from the t-test; the power
    # at a true 0: noncentrality 0.02 / (0.005477 / sqrt(6)) = 8.9, beyond the t quantile 2.015
    assert rows["two_grpo"].endswith("| 0 | 0.00056 | 1 | p₂, t-test | 100% | holds on this toy |")
    assert "final test accuracy: +0.050 [+0.050, +0.050], t [+0.050, +0.050]" in rows["cppo"]
    # CPPO's accuracy: +0.05 every seed, so p2 = 0 and p3 = 1; it rests on p1, the time's
    assert rows["cppo"].endswith("| 0 | 1 | p₁, t-test | 100% | holds on this toy |")
    tables = {f"{m} {part}": bench.run_metrics([results[part, "chains", m, s] for s in range(6)],
                                               0.85)
              for m in ("cppo", "two_grpo") for part in ("paired", "ablation")}
    claims = bench.primary_claims(tables)
    for m in ("dppo", "mmr_grpo"):  # not run: in the family at p = 1, no verdict
        assert (claims[m]["n"], claims[m]["holds"], claims[m]["fails"]) == (0, False, False)
        assert claims[m]["rests"] == "-"
    assert claims["cppo"]["holds"] and claims["two_grpo"]["holds"]
    five = learning_args(methods=["grpo", "two_grpo", "cppo"], seeds=list(range(5)))
    text = "\n".join(bench.learning_section(five, "chains", 5, results, {}))
    assert text.count("| no verdict: 5 of 6 pairs |") == 2
    for s in range(6):
        results["paired", "chains", "two_grpo", s]["test"] = 0.89
    text = "\n".join(bench.learning_section(args, "chains", 5, results, {}))
    row = next(line for line in text.splitlines()
               if line.startswith("| two_grpo | training s, whole run:"))
    # -0.03 every seed: p2 = 1; p3 = 0 (no spread, every resample below -0.02), at most 0.05 / 4
    assert row.endswith("| 0 | 1 | 0 | p₃, t-test | 100% | fails on this toy |")
    for s in range(6):
        results["paired", "chains", "two_grpo", s]["test"] = 0.91 - 0.02 * (s % 2)
    text = "\n".join(bench.learning_section(args, "chains", 5, results, {}))
    row = next(line for line in text.splitlines()
               if line.startswith("| two_grpo | training s, whole run:"))
    # -0.01 and -0.03 in turn: mean -0.02, t = 0, so p3 = 0.5; p2, the bootstrap's share of
    # resamples whose fall is 0.02 or more (three or more of the six draws at -0.03), is larger
    assert row.endswith("| 0 | 0.66 | 0.5 | p₂, bootstrap | 98% | not shown at 6 seeds on this "
                        "toy |")
    bench.plt.close("all")


def test_runs_kept_before_tokens_were_counted_still_report():
    """Summaries kept before this change have 4-number points: their generated tokens are unknown,
    shown as –, and pair with nothing; the rest of the section is as before."""
    import bench
    args = learning_args(methods=["grpo", "two_grpo"], seeds=list(range(6)))
    figures = {}
    text = "\n".join(bench.learning_section(args, "chains", 5, ablation_results(True), figures))
    assert "| two_grpo | generated tokens to 0.85 | – | – | – | – | – | – | - |" in text
    assert "| two_grpo | steps to 0.85 | 20 | 20 | 20 | 20 | 20 | 20 | 20 (6 seeds) |" in text
    # 2-GRPO at 0.85 after 2,560 rollouts of G = 2: 1,280 questions; 16-GRPO after 1,920 of 16
    row = next(line for line in text.splitlines()
               if line.startswith("| two_grpo paired | +1,160 ["))
    assert row.split(" | ")[4] == "-"  # generated tokens: no pair
    assert list(figures) == ["learning-chains.png"]
    bench.plt.close("all")


# ------------------------------------------------------ the report: bench_report.md filled in

def test_every_block_of_the_report_template_is_used_and_filled():
    """bench_report.md holds the blocks bench.py fills, no more; each fills with its own
    placeholders, and without any one of them fails rather than leaving '{name}' in the report."""
    import bench
    source = open(os.path.join(REPO, "bench.py")).read()
    source += open(os.path.join(REPO, "docs", "gpu_check.py")).read()  # the GPU check's blocks
    assert set(re.findall(r'fill\("(\w+)"', source)) <= set(bench.REPORT)
    # the rest are named where bench.py picks among blocks
    assert [name for name in bench.REPORT if f'"{name}"' not in source] == []
    for name, text in bench.REPORT.items():
        assert text and "<!--" not in text and not text.endswith("\n"), name
        fields = {field for _, field, _, _ in string.Formatter().parse(text) if field}
        roots = {re.match(r"\w+", field).group() for field in fields}  # args.shape: args
        values = {root: argparse.Namespace(shape="toy", sequences=1, step_group=2, attn="sdpa",
                                           repeats=3, questions=4, group=5, pruning=0.5,
                                           breakdown_steps=6) if root == "args" else 1.0
                  for root in roots}
        filled = bench.fill(name, **values)
        assert "{" not in filled and "}" not in filled, name
        for root in roots:
            with pytest.raises(KeyError):
                bench.fill(name, **{k: v for k, v in values.items() if k != root})


def test_the_report_sections_from_made_up_runs():
    """The breakdown and learning sections around made-up summaries: headings numbered as given,
    CPPO's allocation only where it applies, one row per method (and metric), the recipes table
    only against GRPO."""
    import bench
    methods = ["grpo", "cppo"]
    args = argparse.Namespace(methods=methods, seeds=[0, 1], questions=16, group=16, pruning=0.875,
                              breakdown_steps=11, target=None)
    phases = {p: 1.0 for p in bench.PHASES}
    phases.update(step_s=6.0, rollouts=256.0, trained=32.0)
    results = {}
    for m in methods:
        results["breakdown", "toy", m, 0] = {"phases": phases, "ideal": 0.125, "questions": 18}
        for s in args.seeds:
            curve = [(0, 0.5, 0.0, 0.0), (10, 0.96, 30.0 + s, 80.0)]
            results["learning", "toy", m, s] = {"curve": curve, "test": 0.9 + 0.01 * s,
                                                "flags": ["--dataset", "toy", "--seed", str(s)]}
    breakdown = bench.breakdown_section(args, "toy", 2, results)
    assert breakdown[0].startswith("## 2. `toy`: one step of each method at matched settings\n")
    assert "× 2; CPPO: `--prompts_per_step 2 --pruning 0.875`, whose allocation sampled 18" \
        in breakdown[0]
    assert [line[:8] for line in breakdown if line.startswith("| ")] == ["| grpo |", "| cppo |"] * 2
    assert breakdown[-1] == ""
    figures = {}
    learning = bench.learning_section(args, "toy", 3, results, figures)
    text = "\n".join(learning)
    assert text.startswith("## 3. `toy`: learning, side by side\n")
    assert "|---|---|---|---|---|" in text.splitlines()  # method, metric, 2 seeds, mean
    assert "| cppo | steps to 0.95 | 10 | 10 | 10 (2 seeds) |" in text
    assert "**Recipes against GRPO's** (estimates" in text  # against GRPO
    assert "primary claim" not in text  # no ablations on the toy: no claim judged
    assert "{" not in text and list(figures) == ["learning-toy.png"]
    alone = argparse.Namespace(**{**vars(args), "methods": ["cppo"]})
    assert "Recipes" not in "\n".join(bench.learning_section(alone, "toy", 3, results, {}))
    bench.plt.close("all")


# ------------------------------------------------------------------- the command line and runs

def test_bench_refuses_impossible_flags_before_any_work(tmp_path, main_of):
    out = tmp_path / "out"
    for flags, word in [(["--questions", "10"], "whole number"),
                        (["--breakdown_steps", "1"], "warm-up"),
                        (["--target", "1.5"], "--target"),
                        (["--model", str(tmp_path / "nope")], "--model"),
                        (["--datasets", str(tmp_path / "nope.jsonl")], "--dataset"),
                        (["--step_group", "0"], "--step_group: must be at least 1"),
                        (["--eval_n", "0"], "--eval_n: must be at least 1")]:
        result = main_of("bench", [*flags, "--out", str(out)])
        assert result.returncode == 2, (flags, result.stderr[-500:])
        assert len(result.stderr.strip().splitlines()) == 1, (flags, result.stderr)
        assert word in result.stderr, (flags, result.stderr)
    assert not out.exists()


def test_bench_quick_writes_the_report(tiny_dir, tmp_path):
    """--quick end to end on a tiny shape, all five scripts (transformers rollout: the vLLM engine
    has its own tests, and five engine start-ups would double this test's time)."""
    out = tmp_path / "out"
    command = [sys.executable, os.path.join(REPO, "bench.py"), "--quick", "--shape", tiny_dir,
               "--sequences", "16", "--budgets", "256", "--breakdown_steps", "2", "--learn_steps",
               "2", "--eval_every", "1", "--eval_n", "8", "--rollout", "hf", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    text = (out / "results.md").read_text()
    assert (out / "results" / "learning-toy.png").read_bytes()[:4] == b"\x89PNG"
    assert "(results/learning-toy.png)" in text
    assert "HFEngine" in text and "python bench.py --quick" in text
    # --quick: the toy only (the report's prose may still name chains' settings)
    assert "`chains`: learning" not in text and "learning-chains.png" not in text
    assert "`toy`: learning, side by side" in text
    tables = [line for line in text.splitlines() if line.startswith("| ")]
    for method in ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]:
        rows = [line for line in tables if line.startswith(f"| {method} | final test accuracy | ")]
        assert len(rows) == 1, method
    assert "| grpo | 1.00 (1) | 1.00 (1) | 1.00 (1) | 1.00 (1) | 0.0% | 1.00 (1.00) |" in tables
    cppo = next(line for line in tables if line.startswith("| cppo | 256 → "))
    assert cppo.startswith("| cppo | 256 → 32 |")  # 16 questions x 16 sampled, 1 - P = 1/8 trained
    estimates = [line for line in tables  # against GRPO, one seed: no t-interval, no verdict
                 if line.startswith("| dppo | ") and "t [+nan, +nan]" in line]
    assert len(estimates) == 1 and "distinguishable" not in text
    kept = json.loads((out / "results" / "runs-toy.json").read_text())
    assert [k for k in kept if k.startswith(("paired", "ablation"))] == []  # --quick: none
    assert {"breakdown grpo 0", "learning grpo 0", "learning mmr_grpo 0"} <= set(kept)
    assert kept["learning grpo 0"]["flags"][-2:] == ["--eval_n", "8"]
    assert not [p for p in os.listdir(out) if p.startswith(".bench-")]  # no staging left behind


def test_bench_learning_on_chains_runs_the_pairs_and_reuses_finished_ones(tmp_path):
    """Learning on chains: each default run, then each method's pair (its default command again,
    then its ablation); a second bench over the kept run folders reads the finished runs instead of
    running them again; a run without the finished mark is deleted and run again."""
    out = tmp_path / "out"
    runs = tmp_path / "runs"
    command = [sys.executable, os.path.join(REPO, "bench.py"), "--parts", "learning", "--datasets",
               "chains", "--methods", "grpo", "dppo", "--seeds", "0", "--learn_steps", "1",
               "--eval_n", "6", "--rollout", "hf", "--out", str(out), "--runs", str(runs)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    text = (out / "results.md").read_text()
    kept = json.loads((out / "results" / "runs-chains.json").read_text())
    assert not (runs / "chains-budget-dppo-0").exists()  # no equal-budget runs any more
    # DPPO's ablation, after the learning flags: nothing pruned
    assert json.loads((runs / "chains-ablation-dppo-0" / "bench_flags.json").read_text()) == [
        "--dataset", "chains", "--rollout", "hf", "--seed", "0", "--steps", "1", "--eval_n", "6",
        "--prune_prompts", "0", "--prune_completions", "0"]
    assert "ablation dppo 0" in kept and not (runs / "chains-ablation-grpo-0").exists()
    # made just before it: DPPO's default command again, beside its learning run
    paired = json.loads((runs / "chains-paired-dppo-0" / "bench_flags.json").read_text())
    assert paired == kept["learning dppo 0"]["flags"] == kept["paired dppo 0"]["flags"]
    assert not (runs / "chains-paired-grpo-0").exists()
    lines = (runs / "chains-learning-grpo-0" / "metrics.jsonl").read_text().splitlines()
    grpo = [json.loads(line) for line in lines]
    assert f"| grpo | final test accuracy | {grpo[-1]['test_accuracy']:.3f} | " in text
    assert "| dppo | training s, whole run: " in text  # its primary claim, one pair: no verdict
    assert "6 validation / 6 test prompts" in (runs / "chains-learning-grpo-0.log").read_text()
    log = runs / "chains-learning-grpo-0.log"
    stamp = log.stat().st_mtime_ns
    (out / "results.md").unlink()
    again = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert log.stat().st_mtime_ns == stamp

    def rows(report):
        return [line for line in report.splitlines() if line.startswith(("| grpo |", "| dppo |"))]
    assert rows((out / "results.md").read_text()) == rows(text)
    (runs / "chains-learning-grpo-0" / "bench_flags.json").unlink()
    again = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert log.stat().st_mtime_ns != stamp
    assert (runs / "chains-learning-grpo-0" / "bench_flags.json").exists()


def test_only_the_full_run_writes_into_docs(monkeypatch):
    import bench
    for argv, into_docs in [([], True), (["--quick"], False), (["--parts", "step"], False)]:
        monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
        out = bench.parse().out
        assert (os.path.abspath(out) == os.path.join(REPO, "docs")) == into_docs, (argv, out)
