"""Advantages, aggregation coefficients, the clipped surrogate, the k3 KL and the whole update,
against values computed by hand (docs/grpo.md)."""
import math

import pytest
import torch

from common import (Passes, group_advantages, packed_logprobs, policy_update, tied_groups,
                    token_coefficients,
                    token_loss)
from conftest import RecordingOptimizer, assert_grads_close, make_samples


def test_advantages_unbiased_population_none():
    r = [[1.0, 0.0, 0.0, 1.0]]
    s_unb, s_pop = math.sqrt(1 / 3), 0.5  # sqrt(sum (r - 0.5)^2 / 3), sqrt(... / 4)
    torch.testing.assert_close(group_advantages(r),
                               torch.tensor([[1, -1, -1, 1]]) * 0.5 / (s_unb + 1e-4))
    torch.testing.assert_close(group_advantages(r, "population"),
                               torch.tensor([[1, -1, -1, 1]]) * 0.5 / (s_pop + 1e-4))
    torch.testing.assert_close(group_advantages(r, "none"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # 2 samples, one right: +-0.707 with the unbiased std, +-1 with the population std
    # (the 2-GRPO convention)
    torch.testing.assert_close(group_advantages([[1.0, 0.0]], eps=0.0),
                               torch.tensor([[0.70710678, -0.70710678]]))
    torch.testing.assert_close(group_advantages([[1.0, 0.0]], "population", eps=0.0),
                               torch.tensor([[1.0, -1.0]]))
    # 16 samples, 1 right, population std: A+ = sqrt((1-p)/p) = sqrt(15),
    # A- = -sqrt(p/(1-p)) = -1/sqrt(15)
    a = group_advantages([[1.0] + [0.0] * 15], "population", eps=0.0)
    assert (a[0, 0].item() == pytest.approx(math.sqrt(15), rel=1e-6)
            and a[0, 1].item() == pytest.approx(-1 / math.sqrt(15)))


def test_advantages_all_equal_groups_are_zero_never_nan():
    r = [[1.0, 1.0, 1.0], [0.3, 0.3, 0.3], [0.0, 0.0, 0.0], [2.0, 0.0, 1.0]]
    for mode in ("unbiased", "population", "none"):
        a = group_advantages(r, mode)
        assert torch.isfinite(a).all()
        assert (a[:3] == 0).all()
        assert a[3].sum().abs() < 1e-6 and a[3, 0] > 0 > a[3, 1]
    # G = 1: no baseline, no signal
    assert (group_advantages([[1.0], [0.0]], "population") == 0).all()


def test_an_unread_answer_counts_in_no_mean_or_std():
    """NaN (an answer score() left unread): advantage 0, and the group's mean and std are those of
    the rewards read. [1, 0, NaN]: mean 0.5, unbiased std sqrt(0.5), A = +-0.5 / sqrt(0.5); the
    population std 0.5, A = +-1. [1, NaN, NaN] and [NaN, NaN, NaN] are tied: all 0."""
    nan = math.nan
    r = [[1.0, 0.0, nan], [1.0, nan, nan], [nan, nan, nan], [0.0, 1.0, 1.0]]
    a = group_advantages(r, "unbiased", eps=0.0)
    half = 0.5 / math.sqrt(0.5)
    torch.testing.assert_close(a[0], torch.tensor([half, -half, 0.0]))
    assert (a[1:3] == 0).all() and torch.isfinite(a).all()
    torch.testing.assert_close(a[3], group_advantages([[0.0, 1.0, 1.0]], "unbiased", eps=0.0)[0])
    torch.testing.assert_close(group_advantages(r, "population", eps=0.0)[0],
                               torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(group_advantages(r, "none")[0], torch.tensor([0.5, -0.5, 0.0]))
    assert tied_groups(r).tolist() == [False, True, True, False]
    assert tied_groups([[0.3, 0.3], [nan, 0.3], [0.3, 0.2]]).tolist() == [True, True, False]


def test_token_coefficients_by_hand():
    lengths = [2, 4]
    torch.testing.assert_close(token_coefficients(lengths, "seq_mean"),
                               torch.tensor([1 / (2 * 2), 1 / (4 * 2)]))
    torch.testing.assert_close(token_coefficients(lengths, "token_mean"),
                               torch.tensor([1 / 6, 1 / 6]))
    torch.testing.assert_close(token_coefficients(lengths, "constant", max_len=5),
                               torch.tensor([1 / 10, 1 / 10]))
    # rows kept from a larger batch (N 4, 12 tokens) with importance weights: what 2-GRPO and
    # DPPO pass
    torch.testing.assert_close(token_coefficients(lengths, "seq_mean", whole=(4, 12, [2.0, 1.0])),
                               torch.tensor([2 / (2 * 4), 1 / (4 * 4)]))
    torch.testing.assert_close(token_coefficients(lengths, "token_mean", whole=(4, 12, [2.0, 1.0])),
                               torch.tensor([2 / 12, 1 / 12]))
    torch.testing.assert_close(token_coefficients(lengths, "constant", max_len=5,
                                                  whole=(4, 12, 1.0)),
                               torch.tensor([1 / 20, 1 / 20]))
    with pytest.raises(ValueError):
        token_coefficients(lengths, "sum")


def test_clipped_surrogate_and_k3_by_hand():
    logp = torch.tensor([-1.0, -0.5, -1.0, -0.7], requires_grad=True)
    old = torch.tensor([-1.2, -0.5, -1.2, -0.4])
    adv = torch.tensor([1.0, 1.0, -1.0, -2.0])
    ref = torch.tensor([-1.1, -0.4, -1.0, -0.7])
    loss, kl, clipped = token_loss(logp, old, ref, adv, eps_low=0.2, eps_high=0.3, beta=0.5)
    r0 = math.exp(0.2)  # ratio of token 0 (= 1.2214); token 3's is exp(-0.3) = 0.7408
    k = lambda d: math.exp(d) - d - 1
    # token 0: A > 0, ratio inside [0.8, 1.3] -> -r0 ; token 1: ratio 1 -> -1
    # token 2: A < 0, ratio 1.2214 -> min(-1.2214, -1.2214) = -1.2214 -> loss +1.2214
    # (upper clip never binds for A<0)
    # token 3: A = -2, ratio 0.7408 < 0.8 -> min(-2 * 0.7408, -2 * 0.8) = -1.6 -> loss 1.6, clipped
    want_pg = [-r0, -1.0, r0, 1.6]
    want_kl = [k(-0.1), k(0.1), k(0.0), k(0.0)]
    torch.testing.assert_close(kl, torch.tensor(want_kl))
    torch.testing.assert_close(loss, torch.tensor(want_pg) + 0.5 * torch.tensor(want_kl))
    assert clipped.tolist() == [False, False, False, True]
    loss.sum().backward()
    # d/dlogp: token 3 is clipped -> only the KL part, 0.5 * (1 - exp(ref - logp)) = 0 at ref = logp
    assert logp.grad[3].item() == pytest.approx(0.0, abs=1e-7)
    # token 0: -A * ratio + 0.5 * (1 - exp(-0.1))
    assert logp.grad[0].item() == pytest.approx(-r0 + 0.5 * (1 - math.exp(-0.1)), rel=1e-6)
    # upper clip binds for A > 0: ratio 1.5 > 1.3 -> zero policy gradient
    lp = torch.tensor([0.0], requires_grad=True)
    out, _, c = token_loss(lp, torch.tensor([math.log(1 / 1.5)]), None, torch.tensor([1.0]),
                           0.2, 0.3, beta=0.0)
    out.sum().backward()
    assert c.item() and out.item() == pytest.approx(-1.3) and lp.grad.item() == 0.0


def test_truncated_importance_weight_scales_the_policy_term_only():
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.2, -0.9])
    out, kl, _ = token_loss(logp, logp, ref, torch.tensor([1.0, 1.0]), 0.2, 0.2, 0.5,
                            is_weights=torch.tensor([0.5, 2.0]))
    k = lambda d: math.exp(d) - d - 1
    torch.testing.assert_close(kl, torch.tensor([k(-0.2), k(0.1)]))
    torch.testing.assert_close(out, torch.tensor([-0.5 + 0.5 * k(-0.2),
                                                  -2.0 + 0.5 * k(0.1)]))  # w * pg + beta * kl


def with_coefs(samples, coefs):
    """Each sample's loss coefficient c_i, as the scripts set it before the update."""
    for s, c in zip(samples, coefs.tolist()):
        s.coef = c
    return samples


def plain_token_logps(model, samples, vocab):
    """Independent reference: each sequence alone through the full model, log_softmax + gather."""
    out = []
    for s in samples:
        p = len(s.prompt_ids)
        logits = model(
            input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, p - 1:-1, :vocab]
        out.append(logits.log_softmax(-1).gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
    return out


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean", "constant"])
def test_update_equals_hand_written_objective(tiny, loss_agg):
    """policy_update's loss value and gradient equal the objective written out directly
    (docs/grpo.md#eq-objective)."""
    model, tokenizer = tiny
    vocab, beta, max_len = len(tokenizer), 0.3, 10
    samples = make_samples(vocab, seed=3)
    ref_model_logps = [lp.detach() - 0.05 * torch.arange(len(lp))
                       for lp in plain_token_logps(model, samples, vocab)]
    lengths = [len(s.completion_ids) for s in samples]
    # by hand: on-policy ratio = 1 in value, loss per token = -A + beta * k3
    total = 0
    for s, lp, ref, n in zip(samples, plain_token_logps(model, samples, vocab), ref_model_logps,
                             lengths):
        ratio = torch.exp(lp - lp.detach())
        d = ref - lp
        per_token = -ratio * s.advantage + beta * (torch.exp(d) - d - 1)
        norm = {"seq_mean": n * len(samples), "token_mean": sum(lengths),
                "constant": len(samples) * max_len}[loss_agg]
        total = total + per_token.sum() / norm
    model.zero_grad()
    total.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    opt = RecordingOptimizer(model)
    with_coefs(samples, token_coefficients(lengths, loss_agg, max_len=max_len))
    for s, ref in zip(samples, ref_model_logps):
        s.ref_logps = ref
    stats = policy_update(model, opt, samples, Passes(1.0, vocab, token_budget=64), clip=(0.2, 0.2),
                          beta=beta, grad_clip=1e9)
    assert stats["loss"] == pytest.approx(total.item(), abs=1e-6)
    assert_grads_close(opt.grads, want)


def test_on_policy_loss_is_zero_but_gradient_is_reinforce(tiny):
    """docs/grpo.md#eq-zero-loss: with mu = 1, beta = 0 and per-sequence mean, the loss is exactly
    -(1/N) sum_i A_i = 0 (advantages sum to zero in each group) while the gradient is the REINFORCE
    gradient with a group baseline, -(1/N) sum_i A_i (1/|o_i|) sum_t grad log pi (no factor 2)."""
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab, seed=5, lengths=[(4, 3), (4, 6), (5, 2), (5, 5)])
    adv = group_advantages([[1.0, 0.0], [0.0, 1.0]])  # two groups of two
    for s, a in zip(samples, adv.flatten().tolist()):
        s.advantage = a
    lengths = [len(s.completion_ids) for s in samples]
    reinforce = -sum(s.advantage * lp.sum() / n / len(samples)
                     for s, lp, n in zip(samples, plain_token_logps(model, samples, vocab),
                                         lengths))
    model.zero_grad()
    reinforce.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    opt = RecordingOptimizer(model)
    stats = policy_update(model, opt, with_coefs(samples, token_coefficients(lengths, "seq_mean")),
                          Passes(1.0, vocab, token_budget=64), clip=(0.2, 0.2), beta=0.0,
                          grad_clip=1e9)
    assert abs(stats["loss"]) < 1e-6
    assert max(g.abs().max().item() for g in want.values()) > 1e-3  # the gradient is far from zero
    assert_grads_close(opt.grads, want)


def test_old_logps_from_a_separate_pass_make_clipping_act(tiny):
    """mu > 1: with old log-probs from before an update, tokens whose ratio left [1-eps, 1+eps] lose
    their gradient."""
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab, seed=7)
    for s, lp in zip(samples, plain_token_logps(model, samples, vocab)):
        s.advantage = 1.0
        s.old_logps = lp.detach() - 1.0  # every ratio is e > 1.2: all clipped for A > 0
    opt = RecordingOptimizer(model)
    with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples], "seq_mean"))
    stats = policy_update(model, opt, samples, Passes(1.0, vocab, token_budget=64), clip=(0.2, 0.2),
                          beta=0.0, grad_clip=1e9)
    assert stats["clip_frac"] == 1.0
    assert stats["loss"] == pytest.approx(-1.2, rel=1e-6)  # -min(e, 1.2) * 1, averaged
    assert all(g.abs().max().item() == 0 for g in opt.grads.values())


def test_mismatch_and_tis_use_engine_logps(tiny):
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab, seed=9)
    logps = packed_logprobs(model, samples, 1.0, vocab, 1024).detach()
    for s, lp in zip(samples, logps.split([len(s.completion_ids) for s in samples])):
        s.sample_logps = (lp + 0.25).tolist()  # the engine thinks every token is a bit likelier
    opt = RecordingOptimizer(model)
    kw = dict(clip=(0.2, 0.2), beta=0.0, grad_clip=1e9)
    passes = Passes(1.0, vocab, token_budget=64)
    with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples], "token_mean"))
    stats = policy_update(model, opt, samples, passes, **kw)
    assert stats["mismatch_logp"] == pytest.approx(0.25, abs=1e-5)
    plain = opt.grads
    stats = policy_update(model, opt, samples, passes, tis_cap=2.0, **kw)
    # weight exp(-0.25) on every token scales the whole policy gradient by it
    assert_grads_close(opt.grads, {name: g * math.exp(-0.25) for name, g in plain.items()})
    for s, lp in zip(samples, logps.split([len(s.completion_ids) for s in samples])):
        s.sample_logps = (lp - 1.0).tolist()  # weight e = 2.72: the cap of 2 binds on every token
    policy_update(model, opt, samples, passes, tis_cap=2.0, **kw)
    assert_grads_close(opt.grads, {name: g * 2.0 for name, g in plain.items()})


def test_grad_clip_zero_means_no_clipping(tiny):
    """--grad_clip 0 is 'no clipping' (the Hugging Face habit), not 'scale every gradient by 0';
    a small cap clips."""
    model, tokenizer = tiny
    samples = make_samples(len(tokenizer), seed=3)
    with_coefs(samples, token_coefficients([len(s.completion_ids) for s in samples], "seq_mean"))
    passes = Passes(1.0, len(tokenizer), token_budget=10_000)
    got = {}
    for clip in (0.0, 1e9, 1e-3):
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, passes, clip=(0.2, 0.2), beta=0.0,
                              grad_clip=clip)
        got[clip] = (opt.grads, stats["grad_norm"])
    norm = got[1e9][1]
    # the logged norm is the unclipped one either way
    assert norm > 1e-3 and got[0.0][1] == pytest.approx(norm)
    assert_grads_close(got[0.0][0], got[1e9][0])
    clipped = torch.cat([g.flatten() for g in got[1e-3][0].values()]).norm().item()
    assert clipped == pytest.approx(1e-3, rel=1e-3)


def test_adamw_uses_the_papers_betas(tiny):
    from common import make_optimizer
    optimizer, _ = make_optimizer(tiny[0], 1e-6, 0.0, 0, 10, "constant")
    # torch / TRL / verl default; docs/grpo.md#defaults
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.999)


def test_rollout_seeds_never_collide():
    """Every rollout's sampling stream, as the engines derive it (prompt k of a generate() call:
    seed + k G; vLLM's completion j of a request: + j), is distinct over runs, steps, prompts,
    resample rounds and completions."""
    from common import rollout_seed
    seen = set()
    G = 4
    for run_seed in (0, 1, 2):
        for step in (0, 1, 2, 3):
            drawn = 0
            # three generate() calls in one step, as two_grpo.py's resampling makes
            for n_prompts in (8, 5, 3):
                base = rollout_seed(run_seed, step, drawn * G)
                seen.update(base + k * G + j for k in range(n_prompts) for j in range(G))
                drawn += n_prompts
    assert len(seen) == 3 * 4 * 16 * G
    # the old arithmetic (seed * 1_000_003 + step * 65_536 + round, + k G + j)
    # collided within one step
    old = [r + k * G + j for r in (0, 1) for k in range(8) for j in range(G)]
    assert len(set(old)) < len(old)
    assert len({rollout_seed(1, 0), rollout_seed(0, 1), rollout_seed(0, 0, 1),
                rollout_seed(0, 0)}) == 4
