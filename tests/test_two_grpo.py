"""2-GRPO: +-1 / 0 pair advantages (group_advantages with the population std and eps 0), the
paper's contrastive pair loss (v2 Eq. 14) equals the GRPO loss with G = 2 and the population std,
skipping tied pairs leaves the update unchanged, the 2-GRPO+RS draw sizes, and the script end to
end (defaults scaled from the GRPO recipe, resume, bad input, the logged phases)."""
import dataclasses
import json
import os

import pytest
import torch

from common import (Passes, Sample, group_advantages, packed_logprobs, policy_update,
                    token_coefficients)
# keeps the accumulated gradient instead of stepping
from conftest import RecordingOptimizer as Capture
from conftest import assert_grads_close
from test_cli import REPO, rows, run
from two_grpo import Args, prompts_to_draw, rows_to_train

SMALL = ["--prompts_per_step", "8", "--eval_n", "16"]
PHASES = ["rollout_s", "reward_s", "logp_s", "update_s", "push_s"]  # not nested: together, the step


def test_group_advantages_of_pairs_are_exactly_plus_minus_one_or_zero():
    """group_advantages as two_grpo.py calls it, with the script's defaults: population std,
    eps 0."""
    assert (Args.std_mode, Args.adv_eps) == ("population", 0.0)
    r = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    got = group_advantages(r, Args.std_mode, Args.adv_eps)
    assert got.tolist() == [[1.0, -1.0], [-1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
    # the unbiased std of {0, 1} is 1/sqrt(2): +-0.7071, the pitfall the paper's convention avoids
    unbiased = group_advantages(r[:1], "unbiased", Args.adv_eps)
    assert torch.allclose(unbiased, torch.tensor([[0.5 ** 0.5, -(0.5 ** 0.5)]]))
    # any reward gap becomes +-1 over two samples (sign amplification for non-binary rewards)
    gap = group_advantages(torch.tensor([[0.3, 0.7]]), Args.std_mode, Args.adv_eps)
    assert gap.tolist() == [[-1.0, 1.0]]


def eq14_loss(model, samples, old, eps_low, eps_high, vocab):
    """-J of the paper's Eq. 14, written from the paper, one unpacked forward per completion: per
    pair, 1(r1 != r2) * 1/2 * (mean_t min(rho, 1 + eps_high) over the correct one -
    mean_t max(rho, 1 - eps_low) over the wrong one), averaged over pairs."""
    pairs, total = len(samples) // 2, 0.0
    for p in range(pairs):
        a, b = samples[2 * p], samples[2 * p + 1]
        if a.reward == b.reward:
            continue
        pos, neg = (2 * p, 2 * p + 1) if a.reward > b.reward else (2 * p + 1, 2 * p)
        rho = lambda i: torch.exp(packed_logprobs(model, [samples[i]], 1.0, vocab, 1024) - old[i])
        total = total + 0.5 * (torch.minimum(rho(pos), torch.tensor(1 + eps_high)).mean()
                               - torch.maximum(rho(neg), torch.tensor(1 - eps_low)).mean())
    return -total / pairs


def with_coefs(samples, coefs):
    """Copies of `samples` carrying their loss coefficients c_i, as the script sets them before the
    update."""
    return [dataclasses.replace(s, coef=c) for s, c in zip(samples, coefs.tolist())]


def pair_batch(tiny):
    model, tokenizer = tiny
    enc = lambda text: tokenizer(text)["input_ids"]
    prompts = [enc("What is 12 + 34?"), enc("What is 50 + 27?"), enc("What is 88 + 11?")]
    completions = [enc("<answer>46</answer>"), enc("<answer>4</answer> no"),
                   enc("<answer>77</answer>"), enc("<answer>77</answer>"),
                   enc("so <answer>99"), enc("<answer>98</answer>")]
    # mixed, tied, mixed (worse one first)
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    adv = group_advantages(rewards, Args.std_mode, Args.adv_eps)
    return [Sample(prompts[i // 2], c, rewards.view(-1)[i].item(), adv.view(-1)[i].item())
            for i, c in enumerate(completions)]


def test_eq14_pair_loss_equals_the_grpo_loss_with_g2_and_population_std(tiny):
    model, tokenizer = tiny
    vocab, samples = len(tokenizer), pair_batch(tiny)
    torch.manual_seed(0)
    # an old policy away from the current one, so both clips bind on some tokens
    with torch.no_grad():
        old = [packed_logprobs(model, [s], 1.0, vocab, 1024)
               + 0.4 * torch.randn(len(s.completion_ids))
               for s in samples]
    samples = with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples],
                                                     "seq_mean"))
    for s, lp in zip(samples, old):
        s.old_logps = lp
    opt = Capture(model)
    stats = policy_update(model, opt, samples, Passes(1.0, vocab, token_budget=64),
                          clip=(0.2, 0.28), beta=0.0, grad_clip=1e9)
    assert 0 < stats["clip_frac"] < 1
    model.zero_grad()
    want = eq14_loss(model, samples, old, 0.2, 0.28, vocab)
    want.backward()
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert_grads_close(opt.grads, {n: p.grad for n, p in model.named_parameters()})
    model.zero_grad()


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean"])
def test_training_on_mixed_pairs_only_gives_the_same_update(tiny, loss_agg):
    model, tokenizer = tiny
    vocab, samples = len(tokenizer), pair_batch(tiny)
    kw = dict(clip=(0.2, 0.28), beta=0.0)
    passes = Passes(1.0, vocab, token_budget=64)
    full, part = Capture(model), Capture(model)
    policy_update(model, full,
                  with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples],
                                                         loss_agg)), passes, **kw)
    keep, coefs = rows_to_train(samples, loss_agg, None, len(samples), skip_tied=True)
    assert keep == [0, 1, 4, 5]  # the tied pair (rows 2, 3) never reaches the trainer
    stats = policy_update(model, part, with_coefs([samples[i] for i in keep], coefs), passes, **kw)
    assert stats["train_tokens"] == sum(len(samples[i].completion_ids) for i in keep)
    assert_grads_close(part.grads, full.grads, rel=1e-5)
    # a 2-GRPO+RS batch cut short at the cap: 3 pairs in 4 slots are still normalised by all 8 slots
    keep, coefs = rows_to_train(samples, "seq_mean", None, 8, skip_tied=True)
    assert torch.allclose(coefs, torch.tensor([1 / (8 * len(samples[i].completion_ids))
                                               for i in keep]))
    tied = [Sample([1], [2], 1.0, 0.0), Sample([1], [3], 1.0, 0.0)]
    # one zero-gradient row keeps Adam going
    assert rows_to_train(tied, loss_agg, None, 2, skip_tied=True)[0] == [0]
    assert rows_to_train(samples, loss_agg, None, 6, skip_tied=False)[0] == list(range(6))


def test_scaled_recipe_is_the_papers_linear_rule_except_on_the_built_in_tasks():
    from two_grpo import scaled_recipe
    # the paper: 16-GRPO's 1e-6 at 32 prompts -> 256 pairs at 8e-6
    assert scaled_recipe(32, 1e-6, "math") == (256, pytest.approx(8e-6))
    # a B given: its rate
    assert scaled_recipe(32, 1e-6, "data.jsonl", 64) == (64, pytest.approx(2e-6))
    # built-in tasks: grpo.py's rollouts in pairs at grpo.py's rate
    # (linear scaling is unstable there)
    assert (scaled_recipe(32, 3e-4, "toy") == (128, 3e-4)
            and scaled_recipe(16, 3e-4, "chains") == (64, 3e-4))
    assert scaled_recipe(16, 3e-4, "chains", 10) == (10, 3e-4)


@pytest.mark.parametrize("missing,mixed,drawn,cap,factor,want", [
    (8, 0, 0, 64, 8, 8),     # first round: the batch itself
    (6, 2, 8, 64, 8, 24),    # 2 of 8 mixed: 6 more need 24 prompts at that rate
    (7, 1, 8, 64, 8, 56),    # 1 of 8 mixed: 1/8 rate -> 56
    (8, 0, 8, 64, 8, 56),    # none mixed: the rate floor 1/8 (64 would pass the cap: 56 left)
    (3, 5, 60, 64, 8, 4),    # near the cap
])
def test_resample_draw_sizes(missing, mixed, drawn, cap, factor, want):
    assert prompts_to_draw(missing, mixed, drawn, cap, factor) == want


def test_two_grpo_toy_run_defaults_and_resume(tmp_path):
    out = str(tmp_path / "run")
    result = run(SMALL + ["--steps", "2", "--eval_every", "0", "--out", out], script="two_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.load(open(os.path.join(out, "config.json")))["args"]
    # the toy's GRPO rate, unscaled (docs/two_grpo.md#toy); G = 2, population std, no eps,
    # clip-higher, no KL
    assert config["lr"] == pytest.approx(3e-4) and config["group_size"] == 2
    assert (config["std_mode"], config["adv_eps"], config["eps_high"],
            config["beta"]) == ("population", 0.0, 0.28, 0.0)
    assert json.load(open(os.path.join(out, "config.json")))["ideal_trained_fraction"] == 1.0
    logged = rows(out)
    for r in logged[1:]:
        assert r["rollouts"] == 16 and r["prompts_drawn"] == 8
        tied = round(r["tied_pairs"] * 8)  # tied pairs never reach the trainer (beta = 0)
        assert r["trained_rollouts"] == max(2 * (8 - tied), 1)
        assert "train_s" not in r and r["zero_std_groups"] == r["tied_pairs"]
        assert sum(r[p] for p in PHASES) == pytest.approx(r["step_s"], rel=0.05, abs=0.05)
    result = run(["--resume", out, "--steps", "3"], script="two_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]
    # not scaled twice
    assert json.load(open(os.path.join(out, "config.json")))["args"]["lr"] == config["lr"]


def test_two_grpo_resample_trains_mixed_pairs_only(tmp_path):
    out = str(tmp_path / "rs")
    result = run(SMALL + ["--steps", "2", "--eval_every", "0", "--resample", "--resample_cap", "3",
                          "--out", out],
                 script="two_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    for r in rows(out)[1:]:
        drawn, tied = r["prompts_drawn"], round(r["tied_pairs"] * r["prompts_drawn"])
        assert 8 <= drawn <= 24 and r["rollouts"] == 2 * drawn
        assert r["trained_rollouts"] == max(2 * min(8, drawn - tied), 1)
        assert drawn == 24 or drawn - tied >= 8  # stops when B pairs are mixed, or at the cap
        # reward is timed inside the resampling rollout, and counted once
        assert sum(r[p] for p in PHASES) == pytest.approx(r["step_s"], rel=0.05, abs=0.05)
    assert json.load(open(os.path.join(out, "config.json")))["args"]["lr"] == pytest.approx(3e-4)
    given = run(SMALL + ["--steps", "1", "--eval_every", "0", "--lr", "1e-4",
                         "--out", str(tmp_path / "lr")],
                script="two_grpo.py")
    assert (given.returncode == 0
            and json.load(open(tmp_path / "lr" / "config.json"))["args"]["lr"] == 1e-4)


def test_two_grpo_resample_with_no_mixed_pair_goes_on(tmp_path):
    """A dataset whose reference no completion ever matches: every pair is tied, resampling finds
    none mixed. The step must say so and train on tied pairs (before the fix: IndexError in
    rows_to_train), and the run resumes."""
    data = tmp_path / "never.jsonl"
    toy = [json.loads(line) for line in open(os.path.join(REPO, "toy", "data", "train.jsonl"))][:64]
    data.write_text("".join(json.dumps({"question": r["question"], "answer": "-987654"}) + "\n"
                            for r in toy))
    out = str(tmp_path / "tied")
    flags = SMALL + ["--dataset", str(data), "--eval_every", "0", "--resample",
                     "--resample_cap", "2", "--out", out]
    result = run(flags + ["--steps", "2"], script="two_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no mixed pair among 16 prompts" in result.stdout + result.stderr
    logged = rows(out)
    assert [r["step"] for r in logged if "tied_pairs" in r] == [1, 2]
    assert all(r["tied_pairs"] == 1.0 and r["prompts_drawn"] == 16 and r["trained_rollouts"] == 1
               for r in logged if "tied_pairs" in r)
    result = run(["--resume", out, "--steps", "3"], script="two_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in rows(out) if "tied_pairs" in r] == [1, 2, 3]


@pytest.mark.parametrize("args,message", [
    (["--resample", "--resample_cap", "0"], "--resample_cap must be in [1, 2^10] (got 0)"),
    (["--resample_cap", "2000"], "--resample_cap must be in [1, 2^10] (got 2000)"),
    # G = 2 is the method (a G = 1 run trained nothing, and exited 0)
    (["--group_size", "1", "--std_mode", "population"],
     "--group_size must be 2 in 2-GRPO (got 1): grpo.py takes other sizes"),
    (["--group_size", "8"], "--group_size must be 2 in 2-GRPO (got 8)"),
])
def test_two_grpo_bad_input_is_one_line(tmp_path, main_of, args, message):
    result = main_of("two_grpo", [*args, "--out", str(tmp_path / "x")])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "x").exists()


def test_two_grpo_help(main_of):
    result = main_of("two_grpo", ["--help"])
    import two_grpo
    from dataclasses import fields
    for f in fields(two_grpo.Args):
        assert f"--{f.name}" in result.stdout and f.metadata["help"].split()[0] in result.stdout


def test_an_unread_answer_is_never_trained_on():
    """rows_to_train keeps a row only if its reward was read (not NaN) and, skipping tied pairs,
    its advantage is not 0."""
    rewards = [1.0, 0.0, float("nan"), 1.0]
    advantages = [1.0, -1.0, 0.0, 0.0]
    samples = [Sample(prompt_ids=[1], completion_ids=[2, 3], reward=r, advantage=a)
               for r, a in zip(rewards, advantages)]
    assert rows_to_train(samples, "seq_mean", 4, 4, skip_tied=True)[0] == [0, 1]
    assert rows_to_train(samples, "seq_mean", 4, 4, skip_tied=False)[0] == [0, 1, 3]
