"""The TRL plug-ins of scale_out/ (scale_out/README.md): on the tiny model and a fixed batch, each
one's advantages, kept completions, coefficients, old and reference log-probs, loss and gradient
equal the script's own step (common.policy_update); the differences that exist by design are
pinned (TRL's own aggregation, the LM head's padded rows, DPPO without refill); each selection
(CPPO's two scopes, MMR-GRPO's reweighting with each process embedding its own slice, DPPO's draw
and how it shares the kept prompts out over the processes) is checked against one written out
here by hand from the method's definition; a step after the first, with the policy away from the
reference, the ratio away from 1 and both clips acting, equals the script's step from the same
weights and a loss written out here token by token, padding copies and 2-GRPO's tied pairs under
beta > 0 included, and MMR-GRPO's similarity floor is checked on embeddings built by hand; and
every plug-in runs for real under `accelerate launch` on two CPU processes (gloo), where both
processes must select the same rows, that selection must equal the one recomputed by hand from
the gathered rewards, and the first step must equal the script's step on the gathered batch.

Needs trl and accelerate (pip line: scale_out/README.md); without them every test here skips.
Run as a script (`accelerate launch ... tests/test_scale_out.py OUT DATA`), this file is the
worker of the two-process test."""
import collections
import copy
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
pytest.importorskip("trl", reason="the scale_out/ plug-ins need trl: pip install trl==1.16.0 "
                    "accelerate==1.15.0")
pytest.importorskip("accelerate", reason="the scale_out/ plug-ins need accelerate")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

from common import (Passes, Sample, group_advantages, load_model, load_tokenizer,  # noqa: E402
                    policy_update, sequence_logprobs, token_coefficients)
from conftest import RecordingOptimizer, assert_grads_close  # noqa: E402
from cppo import prune_batch  # noqa: E402
from dppo import (candidate_window, completion_keep_probs, importance_coefficients,  # noqa: E402
                  systematic_sample)
from mmr_grpo import embed, load_encoder, mmr_reweight  # noqa: E402
import scale_out.trl_dppo as trl_dppo  # noqa: E402
import scale_out.trl_mmr_grpo as trl_mmr_grpo  # noqa: E402
from scale_out.trl_cppo import CPPOTrainer  # noqa: E402
from scale_out.trl_dppo import DPPOTrainer  # noqa: E402
from scale_out.trl_grpo import GRPOPlugin  # noqa: E402
from scale_out.trl_mmr_grpo import MMRGRPOTrainer  # noqa: E402
from scale_out.trl_two_grpo import TwoGRPOTrainer  # noqa: E402

PROMPTS = ["What is 12 + 30?", "What is 45 + 21?", "What is 17 + 60?", "What is 24 + 33?"]


class Canned:
    """A fixed batch: G completions (random ids, ragged lengths) and their rewards per prompt, as
    TRL's rollout_func and a reward function; `asked` logs the prompts of each rollout."""

    def __init__(self, tokenizer, rewards, seed=0):
        g = torch.Generator().manual_seed(seed)
        vocab = len(tokenizer)
        self.tokenizer = tokenizer
        self.completions = {}
        self.rewards = {}
        for prompt, row in zip(PROMPTS, rewards):
            lengths = torch.randint(2, 8, (len(row),), generator=g).tolist()
            self.completions[prompt] = [torch.randint(3, vocab, (n,), generator=g).tolist()
                                        for n in lengths]
            self.rewards[prompt] = row
        self.asked = []

    def rollout(self, prompts, trainer):
        """The i-th copy of a prompt in the batch gets its i-th completion."""
        self.asked.append(list(prompts))
        seen = {}
        completions = []
        for p in prompts:
            completions.append(self.completions[p][seen.get(p, 0)])
            seen[p] = seen.get(p, 0) + 1
        prompt_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    def reward(self, prompts, completion_ids, **kwargs):
        return [float(self.rewards[p][self.completions[p].index(c)])
                for p, c in zip(prompts, completion_ids)]

    def sample(self, q, i, **fields):
        """Completion i of prompt q as the script's Sample."""
        p = PROMPTS[q]
        return Sample(prompt_ids=self.tokenizer(p, add_special_tokens=False)["input_ids"],
                      completion_ids=self.completions[p][i], **fields)


def trainer_for(cls, tiny_dir, tmp_path, canned, G, prompts=2, steps=1, settings=None,
                **config):
    """`cls` on the tiny model (sdpa, fp32), the canned batch as its rollout and reward, one
    generation batch of `prompts` x G rows over `steps` micro-steps, in training mode."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], seed=0,
                      num_generations=G, per_device_train_batch_size=prompts * G // steps,
                      gradient_accumulation_steps=steps, max_completion_length=8,
                      save_strategy="no", bf16=False, **config)  # fp32, as the scripts on CPU
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = cls(model=model, reward_funcs=canned.reward, args=args, train_dataset=data,
                  processing_class=load_tokenizer(tiny_dir), rollout_func=canned.rollout,
                  **(settings or {}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = steps  # (set by Trainer's loop in a real run)
    return trainer


def generation_batch(trainer, prompts):
    """TRL's input for one generation: each dataset row G times, as its RepeatSampler gives it."""
    G = trainer.num_generations
    return [trainer.train_dataset[q] for q in prompts for _ in range(G)]


def trl_step(trainer, batch, loss=None):
    """The micro-steps of one optimiser step on `batch`, as TRL runs them: (summed loss, grads)."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    total = 0.0
    for chunk in split_tensor_dict(batch, trainer.args.steps_per_generation):
        value = (loss or trainer.compute_loss)(model, chunk)
        value.backward()
        total += value.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def script_step(tiny_dir, samples, beta=0.0, mu=1, clip=(0.2, 0.2), weights=None):
    """The script's step 4 on `samples` (advantage and coef set): its old and reference log-probs,
    the policy's (no grad), the loss, the gradient. `weights`, for a step after the first: the
    state dicts (old policy, policy) the plug-in's run had at that step's generation and at the
    step (later_step); None: tiny_dir's, as at the first step. The reference is tiny_dir's. The
    LM head's padded rows are in the softmax, as in TRL: test_padded_head pins that."""
    model = load_model(tiny_dir, torch.device("cpu"))  # varlen attention, packed
    passes = Passes(1.0, model.get_output_embeddings().weight.shape[0], 4096)
    old = ref = None
    if weights:
        model.load_state_dict(weights[0])
    if mu > 1:
        old = sequence_logprobs(model, samples, passes)
    if beta:
        ref = sequence_logprobs(load_model(tiny_dir, torch.device("cpu"), frozen=True), samples,
                                passes)
    if weights:
        model.load_state_dict(weights[1])
    for s, o, r in zip(samples, old or [None] * len(samples), ref or [None] * len(samples)):
        s.old_logps = o
        s.ref_logps = r
    logps = sequence_logprobs(model, samples, passes)
    optimizer = RecordingOptimizer(model)
    stats = policy_update(model, optimizer, samples, passes, clip=clip, beta=beta, grad_clip=0.0)
    return types.SimpleNamespace(old=old, ref=ref, logps=logps, loss=stats["loss"],
                                 grads=optimizer.grads)


def loss_by_hand(samples, logps, beta, clip):
    """docs/grpo.md#eq-objective written out token by token, apart from common.token_loss: (sum_i
    c_i sum_t [-min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i) + beta (e^d - d - 1)], how
    many tokens fall where the clip acts, each sample's sum_t (e^d - d - 1)), rho = e^(logp - old),
    d = ref - logp; `logps` the policy's per token, old = logp where the sample has none
    (on-policy: rho = 1)."""
    low, high = 1 - clip[0], 1 + clip[1]
    total = 0.0
    where = collections.Counter()
    kl = []  # each sample's sum_t (e^d - d - 1)
    for s, lp in zip(samples, logps):
        old = lp if s.old_logps is None else s.old_logps
        ref = s.ref_logps if beta else lp  # (beta 0: d = 0)
        kl.append(0.0)
        for t in range(len(lp)):
            rho = math.exp(lp[t] - old[t])
            a = s.advantage
            surrogate = min(rho * a, min(max(rho, low), high) * a)
            d = float(ref[t] - lp[t])
            kl[-1] += math.exp(d) - d - 1
            total += s.coef * (-surrogate + beta * (math.exp(d) - d - 1))
            where["above 1 + eps_high, A > 0"] += a > 0 and rho > high
            where["between the eps, A > 0"] += a > 0 and 1 + clip[0] < rho <= high
            where["below 1 - eps_low, A < 0"] += a < 0 and rho < low
    return total, where, kl


def later_step(trainer, prompts, lr=1e-5):
    """The plug-in run as a run goes, up to a step after the first, on TRL's batch of `prompts`:
    generation 1 and its mu (num_iterations) updates, which move the policy away from the
    reference; generation 2, whose old-policy pass runs on the moved policy and whose reference
    pass on the reference, and its first mu - 1 updates, which move the ratio away from 1 when mu >
    1. Each update is the plug-in's loss and gradient (trl_step) and one Adam step at `lr` (1e-5
    moves the tiny model's ratios to ~0.75-1.45 and its per-token KL to ~0-0.5 in 3 updates).
    Returns generation 2's batch and the weights (at generation 2, now), for script_step."""
    optimizer = torch.optim.Adam(trainer.model.parameters(), lr=lr)
    mu = trainer.num_iterations
    for updates in (mu, mu - 1):
        batch = trainer._generate_and_score_completions(generation_batch(trainer, prompts))
        at_generation = copy.deepcopy(trainer.model.state_dict())
        for _ in range(updates):
            trl_step(trainer, batch)
            optimizer.step()
    return batch, (at_generation, copy.deepcopy(trainer.model.state_dict()))


def assert_rows(trainer, batch, canned, kept, G):
    """The batch holds exactly the kept completions (flat index q G + i), in order."""
    got = [ids[m.bool()].tolist() for ids, m in zip(batch["completion_ids"],
                                                    batch["completion_mask"])]
    assert got == [canned.completions[PROMPTS[k // G]][k % G] for k in kept]


def assert_agrees(trainer, batch, tiny_dir, samples, beta=0.0, mu=1, clip=(0.2, 0.2),
                  weights=None):
    """Old and reference log-probs, loss and gradient of the plug-in's step against the script's,
    on the same rows: to 1e-5 (float summation order; padded sdpa against packed varlen); and the
    loss against loss_by_hand's, on the script's log-probs. `weights`: as script_step's. Returns
    the plug-in's gradient and what loss_by_hand found (loss, where, kl)."""
    script = script_step(tiny_dir, samples, beta, mu, clip, weights)
    mask = batch["completion_mask"].bool()
    for key, want in (("old_per_token_logps", script.old), ("ref_per_token_logps", script.ref)):
        assert (want is None) == (key not in batch)
        if want is not None:
            got = [row[m] for row, m in zip(batch[key], mask)]
            assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-5, key
    trl_loss, trl_grads = trl_step(trainer, batch)
    assert trl_loss == pytest.approx(script.loss, rel=1e-5, abs=1e-7)
    hand, where, kl = loss_by_hand(samples, [lp.tolist() for lp in script.logps], beta, clip)
    assert trl_loss == pytest.approx(hand, rel=1e-5, abs=1e-7)
    assert_grads_close(trl_grads, script.grads, rel=1e-5)
    return trl_grads, types.SimpleNamespace(loss=hand, where=where, kl=kl)


# ------------------------------------------------------------------ the methods, by hand
# Each method's selection written out here from its definition (docs/), apart from the script
# functions the plug-ins import, so that a plug-in that wires them wrong cannot agree with itself.

def advantages_by_hand(rewards, ddof, eps):
    """(r - mean) / (std + eps) per group [Q][G], a tied group all 0: docs/grpo.md#eq-advantage"""
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - ddof))
        tied = max(group) == min(group)
        out.append([0.0 if tied else (r - mean) / (std + eps) for r in group])
    return out


def largest_abs(values, n):
    """The indices (ascending) of the n largest |values|, a tie to the lower index: CPPO's rule
    (docs/cppo.md#eq-prune-batch over a batch, #eq-prune-question over a group)."""
    order = sorted(range(len(values)), key=lambda i: (-abs(values[i]), i))
    return sorted(order[:n])


def mmr_by_hand(rewards, embeddings):
    """One group's rewards [G] reweighted by MMR over its completions' embeddings [G, d]
    (docs/mmr_grpo.md#eq-mmr, the similarity floored at 0): lambda = sigmoid(the population std of
    the rewards); the best reward (the lowest index among equals) is picked first and keeps it;
    then, again and again, the unpicked i with the highest lambda r_i - (1 - lambda) b_i, b_i its
    largest cosine similarity to a picked one, is picked and gets that score as its reward."""
    G = len(rewards)
    mean = sum(rewards) / G
    lam = 1 / (1 + math.exp(-math.sqrt(sum((r - mean) ** 2 for r in rewards) / G)))
    unit = torch.nn.functional.normalize(embeddings.double(), dim=-1)
    sim = (unit @ unit.T).tolist()  # [G][G] cosine similarities
    new = list(rewards)
    picked = [max(range(G), key=lambda i: (rewards[i], -i))]
    while len(picked) < G:
        score = {i: lam * rewards[i] - (1 - lam) * max(0.0, *(sim[i][j] for j in picked))
                 for i in range(G) if i not in picked}
        best = max(score, key=lambda i: (score[i], -i))
        new[best] = score[best]
        picked.append(best)
    return new


def systematic_by_hand(pi, u):
    """Systematic sampling (docs/dppo.md#eq-draw): item k is kept when one of the points u, u + 1,
    u + 2, ... falls in [pi_1 + ... + pi_(k-1), pi_1 + ... + pi_k)."""
    points = [u + m for m in range(math.ceil(sum(pi)) + 1)]
    kept = []
    low = 0.0
    for k, p in enumerate(pi):
        if any(low <= x < low + p for x in points):
            kept.append(k)
        low += p
    return kept


def completion_pi_by_hand(advantages, r_o, floor):
    """DPPO's completion keep probabilities (docs/dppo.md#eq-completion-keep): pi_i = clip(c |A_i|,
    low, 1) with c such that they sum to (1 - r_o) n; low is the floor, raised when the A != 0 rows
    cannot reach that sum alone. c by bisection: the sum grows with c."""
    a = [abs(x) for x in advantages]
    target = (1 - r_o) * len(a)
    nonzero = sum(x > 0 for x in a)
    low = max(floor, min(1.0, (target - nonzero) / max(1, len(a) - nonzero)))
    lo = 0.0
    hi = 1 / min(x for x in a if x > 0) if nonzero else 1.0  # every A != 0 at pi 1
    for _ in range(100):
        c = (lo + hi) / 2
        if sum(min(1.0, max(low, c * x)) for x in a) < target - 1e-9:
            lo = c
        else:
            hi = c
    return [min(1.0, max(low, hi * x)) for x in a]


def test_the_methods_by_hand():
    """The helpers above agree with the scripts' own functions on a few batches, so a failure
    against a plug-in is the plug-in's (a helper that drifted from its definition shows here)."""
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(3, 4, generator=g).round(decimals=1)
    rewards[1] = 0.5  # a tied group
    by_hand = advantages_by_hand(rewards.tolist(), 1, 1e-4)
    want = group_advantages(rewards).tolist()
    assert by_hand == [pytest.approx(a, abs=1e-6) for a in want]
    flat = [a for group in by_hand for a in group]
    assert largest_abs(flat, 7) == prune_batch(torch.tensor(by_hand).float(), 5 / 12)
    embeddings = torch.randn(12, 5, generator=g)
    reweighted = mmr_reweight(rewards, embeddings)[0]
    for q in range(3):
        got = mmr_by_hand(rewards[q].tolist(), embeddings[4 * q:4 * q + 4])
        assert got == pytest.approx(reweighted[q].tolist(), abs=1e-12)
    pi = completion_pi_by_hand(flat, 0.5, 0.1)
    assert pi == pytest.approx(completion_keep_probs(flat, 0.5, 0.1).tolist(), abs=1e-9)
    for u in np.linspace(0, 0.99, 12):
        assert systematic_by_hand(pi, u) == systematic_sample(pi, u)


def test_two_grpo_gives_plus_minus_one_and_drops_tied_pairs(tiny_dir, tmp_path):
    """docs/two_grpo.md#eq-pair-advantage, #skip-tied: pairs (1, 0), (1, 1), (0, 1), (0, 0) give
    exactly +-1 and 0 / 0; the tied pairs never reach a pass; c_i = 1 / (|o_i| 8), the
    normaliser counting all 8 rollouts; the step is two_grpo.py's. TRL's own "grpo" loss on the
    same kept rows trains 8 / 4 = 2x that step: it averages over the 4 rows it is given."""
    tokenizer = load_tokenizer(tiny_dir)
    canned = Canned(tokenizer, [[1, 0], [1, 1], [0, 1], [0, 0]])
    trainer = trainer_for(TwoGRPOTrainer, tiny_dir, tmp_path, canned, G=2, prompts=4, steps=2,
                          loss_type="grpo", epsilon_high=0.28)
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(4)))
    chosen = trainer.last_selection
    assert chosen["advantages"].tolist() == [[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0], [0.0, 0.0]]
    assert chosen["kept"] == [0, 1, 4, 5]
    assert_rows(trainer, batch, canned, [0, 1, 4, 5], 2)
    lengths = [len(canned.completions[PROMPTS[k // 2]][k % 2]) for k in [0, 1, 4, 5]]
    assert batch["coef"].tolist() == pytest.approx([1 / (n * 8) for n in lengths], rel=1e-6)
    samples = [canned.sample(k // 2, k % 2, advantage=a, coef=c)
               for k, a, c in zip([0, 1, 4, 5], [1.0, -1.0, -1.0, 1.0], batch["coef"].tolist())]
    ours = assert_agrees(trainer, batch, tiny_dir, samples, clip=(0.2, 0.28))[0]
    stock = trl_step(trainer, batch, loss=lambda m, x: GRPOTrainer._compute_loss(trainer, m, x))
    assert_grads_close(stock[1], {n: 2 * g for n, g in ours.items()}, rel=1e-5)


def test_cppo_prunes_before_the_old_and_reference_passes(tiny_dir, tmp_path, monkeypatch):
    """docs/cppo.md#eq-prune-batch: groups (1, 0, 0, 0), (1, 1, 0, 0) have |A| 1.4997 and 0.4999
    x 3, 0.8659 x 4; P = 0.5 drops the int(8 x 0.5) = 4 smallest, keeping rows 0, 4, 5, 6 (the
    tie at 0.8659 to the lower index). The old-policy (mu = 2) and reference (beta = 0.04) passes
    see those 4 rows only, and TRL's own passes over all 8 never run; c_i is the token mean over
    the kept rows; the step is cppo.py's."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 0, 0, 0], [1, 1, 0, 0]])
    trainer = trainer_for(CPPOTrainer, tiny_dir, tmp_path, canned, G=4, settings={"pruning": 0.5},
                          beta=0.04, num_iterations=2, loss_type="dapo")
    rows_seen = []
    logps = GRPOTrainer._get_per_token_logps_and_entropies

    def spy(self, model, input_ids, *args, **kwargs):  # the rows each log-prob pass runs on
        rows_seen.append(input_ids.size(0))
        return logps(self, model, input_ids, *args, **kwargs)

    monkeypatch.setattr(CPPOTrainer, "_get_per_token_logps_and_entropies", spy)
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(2)))
    monkeypatch.undo()
    assert rows_seen == [4, 4]  # old-policy pass, reference pass: never the 8 rolled out
    chosen = trainer.last_selection
    assert chosen["advantages"].flatten().tolist() == pytest.approx(
        [0.75 / 0.5001] + [-0.25 / 0.5001] * 3 + [0.5 / (3 ** -0.5 + 1e-4)] * 2
        + [-0.5 / (3 ** -0.5 + 1e-4)] * 2, rel=1e-6)
    assert chosen["kept"] == [0, 4, 5, 6] == prune_batch(chosen["advantages"], 0.5)
    assert_rows(trainer, batch, canned, [0, 4, 5, 6], 4)
    lengths = [len(canned.completions[PROMPTS[k // 4]][k % 4]) for k in [0, 4, 5, 6]]
    assert batch["coef"].tolist() == pytest.approx([1 / sum(lengths)] * 4, rel=1e-6)
    adv = chosen["advantages"].flatten()
    samples = [canned.sample(k // 4, k % 4, advantage=adv[k].item(), coef=1 / sum(lengths))
               for k in [0, 4, 5, 6]]
    assert_agrees(trainer, batch, tiny_dir, samples, beta=0.04, mu=2)


def test_dppo_draws_weights_and_examined_window(tiny_dir, tmp_path):
    """docs/dppo.md#eq-estimator: prompts 1 and 3 tied last time, so pi_q = (1, 0.5, 1, 0.5)
    (r_q 0.5, floor 0.1); the draw with u from default_rng([seed 0, step 0]) keeps the prompts
    systematic_sample keeps, and only they are rolled out; the completion draw, w = 1/(pi_q pi_i)
    and c_i over N = 4 examined prompts are dppo.py's, and the step is its step. Pinned: no refill,
    so the examined set is TRL's whole window of 4 (dppo.py with B = 2 would stop at 3 prompts,
    whose pi_q sum to 2.5)."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 1, 1, 1], [1, 0, 0, 0], [0, 1, 1, 0],
                                               [0, 0, 0, 0]])
    trainer = trainer_for(DPPOTrainer, tiny_dir, tmp_path, canned, G=4, prompts=4, steps=2,
                          beta=0.04, loss_type="grpo")
    trainer.history = {0: False, 1: True, 2: False, 3: True}
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(4)))
    chosen = trainer.last_selection
    pi = [1.0, 0.5, 1.0, 0.5]
    assert candidate_window([0, 1, 2, 3], trainer.history, 2, 0.5, 0.1, 8)[0] == [0, 1, 2]
    assert chosen["examined"] == 4
    rng = np.random.default_rng([0, 0])
    prompts = systematic_sample(pi, rng.random())
    assert chosen["prompt_pi"] == [pi[q] for q in prompts]
    assert canned.asked == [[PROMPTS[q] for q in prompts for _ in range(4)]]
    rewards = torch.tensor([canned.rewards[PROMPTS[q]] for q in prompts], dtype=torch.float32)
    advantages = group_advantages(rewards, "unbiased", 1e-4)
    assert torch.equal(chosen["advantages"], advantages)
    completion_pi = completion_keep_probs(advantages, 0.5, 0.1).tolist()
    kept = systematic_sample(completion_pi, rng.random())
    assert chosen["kept"] == kept and chosen["completion_pi"] == completion_pi
    lengths = [len(c) for q in prompts for c in canned.completions[PROMPTS[q]]]
    coefs, weights = importance_coefficients(lengths, chosen["prompt_pi"], completion_pi, kept, 4,
                                             "seq_mean", 8)
    assert chosen["weights"] == weights and torch.equal(chosen["coefs"], coefs)
    tied = {q: len(set(canned.rewards[PROMPTS[q]])) == 1 for q in prompts}  # 0, 3 tied; 1, 2 not
    assert trainer.history == {0: False, 1: True, 2: False, 3: True, **tied}
    real = batch["coef"] != 0  # one padding copy when the kept count is odd
    assert batch["coef"][real].tolist() == coefs.tolist()
    samples = [canned.sample(prompts[k // 4], k % 4, advantage=advantages.flatten()[k].item(),
                             coef=c) for k, c in zip(kept, coefs.tolist())]
    samples += [canned.sample(prompts[kept[0] // 4], kept[0] % 4, coef=0.0)] * int((~real).sum())
    assert_agrees(trainer, batch, tiny_dir, samples, beta=0.04)


def test_mmr_grpo_reweights_whole_groups(tiny_dir, tmp_path):
    """docs/mmr_grpo.md#eq-advantage: the rewards of each whole group are mmr_reweight-ed over the
    embeddings of its decoded completions (the tiny model mean-pooled as the encoder), the
    advantages are group_advantages of them, every row is trained; the step is mmr_grpo.py's.
    The best completion of a group keeps its reward; the others get less."""
    tokenizer = load_tokenizer(tiny_dir)
    canned = Canned(tokenizer, [[1, 0, 1, 0], [0, 0, 0, 1]])
    trainer = trainer_for(MMRGRPOTrainer, tiny_dir, tmp_path, canned, G=4,
                          settings={"embed_model": tiny_dir}, beta=0.04, loss_type="grpo")
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(2)))
    chosen = trainer.last_selection
    texts = tokenizer.batch_decode([c for p in PROMPTS[:2] for c in canned.completions[p]],
                                   skip_special_tokens=True)
    encoder = load_encoder(tiny_dir, torch.device("cpu"))
    rewards = torch.tensor([canned.rewards[p] for p in PROMPTS[:2]], dtype=torch.float32)
    reweighted = mmr_reweight(rewards, embed(encoder, texts))[0]
    assert torch.allclose(chosen["reweighted"].double(), reweighted, atol=1e-6)
    assert reweighted[0, 0] == 1 and reweighted[1, 3] == 1 and (reweighted[0, 1:] < 1).all()
    advantages = group_advantages(reweighted, "unbiased", 1e-4)
    assert torch.allclose(chosen["advantages"], advantages, atol=1e-6)
    assert chosen["kept"] == list(range(8))
    lengths = [len(c) for p in PROMPTS[:2] for c in canned.completions[p]]
    coefs = token_coefficients(lengths, "seq_mean")
    samples = [canned.sample(k // 4, k % 4, advantage=advantages.flatten()[k].item(), coef=c)
               for k, c in enumerate(coefs.tolist())]
    assert_agrees(trainer, batch, tiny_dir, samples, beta=0.04)


def test_cppo_question_scope_keeps_each_groups_top_k(tiny_dir, tmp_path):
    """docs/cppo.md#eq-prune-question: prune_scope="question" keeps the k = G(1 - P) = 3 largest
    |A| of each group, recomputed here by hand from the rewards; on these the batch scope (the 6
    largest of all 8) and k = 1 per group would keep other rows, so no other rule passes. c_i is
    the token mean over the kept rows."""
    rewards = [[1, 0, 0.05, 0.1], [1, 0.9, 0, 0.2]]  # |A| 1.49 .60 .50 .39 and .95 .75 1.05 .65
    canned = Canned(load_tokenizer(tiny_dir), rewards)
    trainer = trainer_for(CPPOTrainer, tiny_dir, tmp_path, canned, G=4, loss_type="dapo",
                          settings={"pruning": 0.25, "prune_scope": "question"})
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(2)))
    chosen = trainer.last_selection
    advantages = advantages_by_hand(rewards, 1, 1e-4)
    assert chosen["advantages"].tolist() == [pytest.approx(a, rel=1e-6) for a in advantages]
    kept = [4 * q + i for q, group in enumerate(advantages) for i in largest_abs(group, 3)]
    assert chosen["kept"] == kept == [0, 1, 2, 4, 5, 6]
    flat = [a for group in advantages for a in group]
    assert largest_abs(flat, 6) != kept  # the batch scope
    assert [4 * q + largest_abs(group, 1)[0] for q, group in enumerate(advantages)] != kept
    assert_rows(trainer, batch, canned, kept, 4)
    lengths = [len(canned.completions[PROMPTS[k // 4]][k % 4]) for k in kept]
    assert batch["coef"].tolist() == pytest.approx([1 / sum(lengths)] * 6, rel=1e-6)


def test_mmr_grpo_each_process_embeds_its_own_completions(tiny_dir, tmp_path, monkeypatch):
    """Over two processes each one embeds the completions it generated, its slice of the gathered
    batch, and the gathered embeddings follow the rewards' order: `select` run as process 0 and as
    process 1 of 2 (the gather played here: the other process's slice embedded by hand beside
    this one's) gives the rewards reweighted by MMR (written out here) over the embeddings of all
    8 decoded completions, and their advantages."""
    tokenizer = load_tokenizer(tiny_dir)
    rewards = [[1, 0, 1, 0], [0, 0.5, 0, 1]]
    canned = Canned(tokenizer, rewards)
    trainer = trainer_for(MMRGRPOTrainer, tiny_dir, tmp_path, canned, G=4, loss_type="grpo",
                          settings={"embed_model": tiny_dir})
    samples = [canned.sample(q, i) for q in range(2) for i in range(4)]
    texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    encoder = load_encoder(tiny_dir, torch.device("cpu"))
    slices = [encoder.encode(texts[:4], convert_to_tensor=True).float(),
              encoder.encode(texts[4:], convert_to_tensor=True).float()]  # [4, d] per process
    embeddings = torch.cat(slices)  # [8, d]
    reweighted = [mmr_by_hand(rewards[q], embeddings[4 * q:4 * q + 4]) for q in range(2)]
    assert reweighted[1] != mmr_by_hand(rewards[1], embeddings[:4])  # the slices tell apart
    for rank in (0, 1):
        def gather(mine):  # accelerate's gather as `rank` sees it: the other slice from by hand
            assert torch.allclose(mine, slices[rank], atol=1e-6)  # this process's completions
            return torch.cat([mine if r == rank else slices[r] for r in (0, 1)])

        monkeypatch.setattr(trainer, "accelerator", types.SimpleNamespace(
            num_processes=2, process_index=rank, device=torch.device("cpu"), gather=gather))
        chosen = trainer.select(torch.tensor(rewards), samples)
        monkeypatch.undo()
        assert chosen["reweighted"].tolist() == [pytest.approx(r, abs=1e-6) for r in reweighted]
        want = advantages_by_hand(reweighted, 1, 1e-4)
        assert chosen["advantages"].tolist() == [pytest.approx(a, abs=1e-5) for a in want]


def test_dppo_shares_the_kept_prompts_out_over_the_processes(tiny_dir, tmp_path, monkeypatch):
    """docs/dppo.md#eq-draw, as process 0 and as process 1 of 2 (the gather played here): over a
    window of 4 prompts, 2 from each process, whose pi_q are (1, 0.5, 1, 0.5) (prompts 1 and 3
    tied last time; r_q 0.5, floor 0.1), the draw with u from default_rng([seed 0, step 0]),
    systematic sampling written out here, keeps 3 prompts; process 0 rolls out the first two kept,
    process 1 the third and a copy of the first (the copy is never trained): every kept prompt
    once, none twice, none dropped."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 0]] * 4)
    trainer = trainer_for(DPPOTrainer, tiny_dir, tmp_path, canned, G=2, prompts=2)
    trainer.history = {0: False, 1: True, 2: False, 3: True}
    pi = [1.0, 0.5, 1.0, 0.5]
    kept = systematic_by_hand(pi, np.random.default_rng([0, 0]).random())
    assert len(kept) == 3
    window = generation_batch(trainer, range(4))  # the two processes' generation batches
    rolled = []
    monkeypatch.setattr(GRPOPlugin, "_generate_and_score_completions",
                        lambda self, batch: rolled.append([x[trl_dppo.ROW] for x in batch]))
    monkeypatch.setattr(trl_dppo, "gather_object", lambda inputs: window)
    for rank in (0, 1):
        mine = window[4 * rank:4 * rank + 4]
        monkeypatch.setattr(trainer, "accelerator", types.SimpleNamespace(num_processes=2,
                                                                          process_index=rank))
        trainer._generate_and_score_completions(mine)
        assert trainer.draw["rows"] == kept
        assert trainer.draw["prompt_pi"] == [pi[q] for q in kept]
    assert rolled == [[q for q in share for _ in range(2)] for share in
                      (kept[:2], kept[2:] + kept[:1])]


def test_grpo_plugin_and_trls_own_seq_mean(tiny_dir, tmp_path):
    """grpo.py's step through the base plug-in, and the aggregation pinned: TRL's own "grpo" loss
    averages per micro-batch and divides by the 2 accumulation steps, so with micro-batches of 3
    and 5 rows it weighs a sequence 1/6 or 1/10 where grpo.py's seq_mean weighs each 1/8; with
    micro-batches of 4 and 4 the two agree."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 0, 0, 1], [1, 1, 0, 1]])
    trainer = trainer_for(GRPOPlugin, tiny_dir, tmp_path, canned, G=4, steps=2, loss_type="grpo")
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(2)))
    adv = trainer.last_selection["advantages"].flatten()
    lengths = [len(c) for p in PROMPTS[:2] for c in canned.completions[p]]
    coefs = token_coefficients(lengths, "seq_mean")
    samples = [canned.sample(k // 4, k % 4, advantage=adv[k].item(), coef=c)
               for k, c in enumerate(coefs.tolist())]
    ours = assert_agrees(trainer, batch, tiny_dir, samples)[0]

    def stock(model, chunk):
        return GRPOTrainer._compute_loss(trainer, model, chunk)

    assert_grads_close(trl_step(trainer, batch, stock)[1], ours, rel=1e-5)  # 4 + 4 rows
    ragged = [{k: v[:3] if v.ndim else v for k, v in batch.items()},
              {k: v[3:] if v.ndim else v for k, v in batch.items()}]
    trainer.model.zero_grad(set_to_none=True)
    for chunk in ragged:
        stock(trainer.model, chunk).backward()
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    for k, s in enumerate(samples):
        s.coef = 1 / (len(s.completion_ids) * 2 * (3 if k < 3 else 5))
    assert_grads_close(got, script_step(tiny_dir, samples).grads, rel=1e-5)


# ------------------------------------------------------------------ steps after the first
# At the first step the policy is the reference and the ratio is 1: the KL's value and gradient
# are 0 and neither clip acts, so a dropped KL coefficient, a reference pass run on the policy, a
# swapped eps_high or a padding copy with c != 0 all agree with the script there. These come later.

def test_a_later_step_is_the_scripts(tiny_dir, tmp_path):
    """A step after the first (later_step: 3 updates in), through the machinery every plug-in
    shares: CPPO's question scope keeps 6 of 8 rows (as in test_cppo_question_scope_...), trained
    over 4 micro-steps, so the batch ends in 2 copies of the first kept row at c = 0; beta = 0.04,
    mu = 2, eps = (0.2, 0.28). The old-policy log-probs (generation 2's policy), the reference's
    (the initial weights), the loss and the gradient equal cppo.py's step from the same weights on
    the 6 kept rows, and the loss the one written out by hand. Pinned so that none of it holds
    vacuously: tokens with A > 0 lie above 1 + eps_high and between the two eps, tokens with A < 0
    below 1 - eps_low; the reference is away from the old policy; the KL term and the KL of the
    row the padding copies are far above the tolerance."""
    rewards = [[1, 0, 0.05, 0.1], [1, 0.9, 0, 0.2]]
    canned = Canned(load_tokenizer(tiny_dir), rewards)
    trainer = trainer_for(CPPOTrainer, tiny_dir, tmp_path, canned, G=4, steps=4, beta=0.04,
                          num_iterations=2, epsilon_high=0.28, loss_type="dapo",
                          settings={"pruning": 0.25, "prune_scope": "question"})
    batch, weights = later_step(trainer, range(2))
    kept = [0, 1, 2, 4, 5, 6]
    assert trainer.last_selection["kept"] == kept
    assert_rows(trainer, batch, canned, kept + [0, 0], 4)  # the padding: copies of row 0
    lengths = [len(canned.completions[PROMPTS[k // 4]][k % 4]) for k in kept]
    c = 1 / sum(lengths)  # token_mean over the kept rows
    assert batch["coef"].tolist() == pytest.approx([c] * 6 + [0, 0], rel=1e-6)
    adv = [a for group in advantages_by_hand(rewards, 1, 1e-4) for a in group]
    samples = [canned.sample(k // 4, k % 4, advantage=adv[k], coef=c) for k in kept]
    _, hand = assert_agrees(trainer, batch, tiny_dir, samples, beta=0.04, mu=2, clip=(0.2, 0.28),
                            weights=weights)
    assert min(hand.where.values()) >= 2, hand.where  # tokens in each of the three places
    tokens = batch["completion_mask"].bool()
    gap = (batch["ref_per_token_logps"] - batch["old_per_token_logps"])[tokens].abs()
    assert gap.max() > 0.1  # the reference pass did not run on the (old) policy
    kl_term = 0.04 * c * sum(hand.kl)  # the KL's share of the loss
    copy_kl = 0.04 * c * hand.kl[0]  # what a padding copy would add at row 0's c instead of 0
    assert min(kl_term, copy_kl) > 1e-3 * abs(hand.loss), (kl_term, copy_kl, hand.loss)


def test_two_grpo_trains_tied_pairs_when_beta_is_not_0(tiny_dir, tmp_path):
    """docs/two_grpo.md#skip-tied: with beta > 0 nothing is skipped, as two_grpo.py passes
    skip_tied and beta == 0: pairs (1, 0), (1, 1), (0, 1), (0, 0) with beta = 0.04 train all 8 rows,
    c_i = 1 / (|o_i| 8). At a step after the first (later_step, mu = 1: the policy away from the
    reference) the tied rows carry the KL gradient: the step equals two_grpo.py's on all 8 rows,
    and the step on the 4 mixed rows alone differs from it by over 0.1% of the gradient's scale
    (1.5% here, 1500x the tolerance)."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 0], [1, 1], [0, 1], [0, 0]])
    trainer = trainer_for(TwoGRPOTrainer, tiny_dir, tmp_path, canned, G=2, prompts=4, steps=2,
                          loss_type="grpo", epsilon_high=0.28, beta=0.04)
    batch, weights = later_step(trainer, range(4))
    assert trainer.last_selection["kept"] == list(range(8))
    assert_rows(trainer, batch, canned, range(8), 2)
    lengths = [len(canned.completions[PROMPTS[k // 2]][k % 2]) for k in range(8)]
    coefs = [1 / (n * 8) for n in lengths]
    assert batch["coef"].tolist() == pytest.approx(coefs, rel=1e-6)
    samples = [canned.sample(k // 2, k % 2, advantage=a, coef=c)
               for k, a, c in zip(range(8), [1, -1, 0, 0, -1, 1, 0, 0], coefs)]
    grads, _ = assert_agrees(trainer, batch, tiny_dir, samples, beta=0.04, clip=(0.2, 0.28),
                             weights=weights)
    mixed = script_step(tiny_dir, [samples[k] for k in (0, 1, 4, 5)], 0.04, 1, (0.2, 0.28),
                        weights).grads
    assert max(((grads[n] - g).abs().max() / g.abs().max()).item()
               for n, g in mixed.items()) > 1e-3


def test_mmr_grpo_floors_the_similarity(tiny_dir, tmp_path, monkeypatch):
    """docs/mmr_grpo.md#eq-mmr: a completion's redundancy is max(0, its largest cosine similarity
    to a picked one), by hand: rewards (1, 0, 0, 0) over embeddings (1, 0), (-1, 0), (0, 1), (1, 1)
    (embed stubbed to give them), lambda = sigmoid(population std sqrt(3) / 4). The first keeps 1;
    the second, opposite to it, scores lambda 0 - (1 - lambda) max(0, -1) = 0, and the third,
    orthogonal to both, 0 (the tie to the lower index); the fourth, at 45 degrees to the first,
    -(1 - lambda) / sqrt(2). Without the floor (sim_floor=False) the second would score
    1 - lambda."""
    tokenizer = load_tokenizer(tiny_dir)
    canned = Canned(tokenizer, [[1, 0, 0, 0]])
    trainer = trainer_for(MMRGRPOTrainer, tiny_dir, tmp_path, canned, G=4, prompts=1,
                          loss_type="grpo", settings={"embed_model": tiny_dir})
    samples = [canned.sample(0, i) for i in range(4)]
    texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)

    def embed(encoder, got):  # the four completions, in order, to these four vectors
        assert got == texts
        return torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])

    monkeypatch.setattr(trl_mmr_grpo, "embed", embed)
    lam = 1 / (1 + math.exp(-math.sqrt(3) / 4))
    for floor, second in ((True, 0.0), (False, 1 - lam)):
        trainer.sim_floor = floor
        chosen = trainer.select(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), samples)
        want = [1.0, second, 0.0, -(1 - lam) / math.sqrt(2)]
        assert chosen["reweighted"].tolist() == [pytest.approx(want, abs=1e-6)]
        advantages = advantages_by_hand([want], 1, 1e-4)[0]
        assert chosen["advantages"].tolist() == [pytest.approx(advantages, abs=1e-6)]


def test_padded_head(tiny_dir, tmp_path):
    """Pinned: TRL's log-probs take the softmax over the model's whole LM head, the scripts' over
    the tokenizer's vocabulary (common.Passes.vocab_size): on the tiny model, whose 30 padded rows
    are random like the rest, they differ per token by exactly logsumexp(all rows) -
    logsumexp(real rows), here 7e-4 to 8e-3."""
    tokenizer = load_tokenizer(tiny_dir)
    vocab = len(tokenizer)
    canned = Canned(tokenizer, [[1, 0], [0, 1]])
    trainer = trainer_for(GRPOPlugin, tiny_dir, tmp_path, canned, G=2)
    head = trainer.model.get_output_embeddings().weight.shape[0]
    assert head == vocab + 30
    batch = trainer._generate_and_score_completions(generation_batch(trainer, range(2)))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    width = batch["completion_ids"].size(1)
    with torch.no_grad():
        trl = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)[0]
        logits = trainer.model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1]
    gap = logits.logsumexp(-1) - logits[..., :vocab].logsumexp(-1)  # [n, width]
    model = load_model(tiny_dir, torch.device("cpu"))
    tokens = batch["completion_mask"].bool()
    for row in range(4):
        s = canned.sample(row // 2, row % 2)
        ours = sequence_logprobs(model, [s], Passes(1.0, vocab, 4096))[0]
        whole = sequence_logprobs(model, [s], Passes(1.0, head, 4096))[0]
        got = trl[row][tokens[row]]
        assert (got - whole).abs().max() < 1e-5
        assert (ours - got - gap[row][tokens[row]]).abs().max() < 1e-5
        assert gap[row][tokens[row]].min() > 1e-4  # 10x the tolerance: not rounding


def test_refused_settings(tiny_dir, tmp_path):
    """What the plug-ins cannot honour stops at construction, naming the setting."""
    canned = Canned(load_tokenizer(tiny_dir), [[1, 0], [0, 1]])
    for config, message in [({"loss_type": "bnpo"}, "loss_type='bnpo'"),
                            ({"scale_rewards": "batch"}, "scale_rewards='batch'"),
                            ({"top_entropy_quantile": 0.5}, "top_entropy_quantile=0.5")]:
        with pytest.raises(ValueError, match=message):
            trainer_for(GRPOPlugin, tiny_dir, tmp_path, canned, G=2, **config)
    with pytest.raises(ValueError, match="k = G"):
        trainer_for(CPPOTrainer, tiny_dir, tmp_path, canned, G=2, settings={"pruning": 0.75})


def test_the_maps_flags_are_trls():
    """docs/README.md#scaling-out: every flag its table and its method notes give to
    scale_out/train.py is a GRPOConfig field of the installed TRL or one of train.py's own, and both
    of its commands parse (with --use_cpu added, as this machine has no GPU)."""
    from transformers import HfArgumentParser

    from scale_out.train import MethodArgs
    text = open(os.path.join(REPO, "docs", "README.md")).read()
    section = text.split('<a id="scaling-out"></a>')[1].split('<a id="real-run"></a>')[0]
    fields = set(GRPOConfig.__dataclass_fields__) | set(MethodArgs.__dataclass_fields__)
    table = section.split("### The shared loop")[1].split("\n\n| ")[1].split("\n\n")[0]
    named = [re.findall(r"--(\w+)", row.split(" | ")[1]) for row in table.splitlines()[2:]]
    others = section.split("**The other methods**")[1].split("\n* ")[0]
    names = {n for row in named for n in row} | set(re.findall(r"--(\w+)", others))
    assert len(names) > 30 and not names - fields, sorted(names - fields)
    commands = re.findall(r"scale_out/train\.py ((?:\\\n|[^\n])+)", section)
    assert len(commands) == 2
    parser = HfArgumentParser((MethodArgs, GRPOConfig))
    for command in commands:
        argv = shlex.split(command.replace("\\\n", " "), comments=True) + ["--use_cpu"]
        method, config = parser.parse_args_into_dataclasses(args=argv)
        assert method.method == "cppo" and config.num_generations in (4, 16)


# ------------------------------------------------------------------ two processes, for real

# the toy model always fails the first, nearly always solves the second, and solves each of the
# others about 3 times in 8 at temperature 1.2: tied groups come back (DPPO prunes them), and a
# step's groups are almost never all tied (the first step's gradient is not zero)
QUESTIONS = ["5 + 6 + 7", "11 + 14", "48 + 97", "59 + 86", "67 + 78", "39 + 94", "76 + 58",
             "89 + 47", "38 + 85", "57 + 69"]
METHODS = {  # method -> its flags beyond SMALL: every plug-in, mu > 1 and beta > 0 somewhere
    "two_grpo": ["--num_generations", "2", "--loss_type", "grpo", "--epsilon_high", "0.28"],
    "cppo": ["--pruning", "0.5", "--beta", "0.04", "--num_iterations", "2"],
    "dppo": ["--beta", "0.04", "--loss_type", "grpo"],
    "mmr_grpo": ["--beta", "0.04", "--loss_type", "grpo", "--embed_model", "toy"],
}
SMALL = ["--use_cpu", "--max_steps", "4", "--per_device_train_batch_size", "8",
         "--num_generations", "4", "--max_completion_length", "24", "--learning_rate", "3e-4",
         "--temperature", "1.2", "--seed", "0", "--report_to", "none", "--save_strategy", "no",
         "--logging_steps", "1", "--disable_tqdm", "true", "--bf16", "false"]


def worker(out, data):
    """Each method for 4 steps on this process: per step what it selected, the kept rows of the
    generation batch, and TRL's log, to out/<method>-<rank>.json."""
    from transformers import TrainerCallback

    import scale_out.train as train

    class Record(TrainerCallback):
        def __init__(self, trainer):
            self.trainer = trainer
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            chosen = dict(self.trainer.last_selection)
            samples = chosen.pop("samples")
            row = {k: v.tolist() if torch.is_tensor(v) else v for k, v in chosen.items()}
            row["rows"] = [[samples[i].prompt_ids, samples[i].completion_ids]
                           for i in chosen["kept"]]
            G = self.trainer.num_generations
            row["prompts"] = [s.prompt_ids for s in samples[::G]]  # each group's, as gathered
            self.steps.append(row)

    for method, flags in METHODS.items():
        trainer = train.build(["--method", method, "--dataset", data, "--output_dir",
                               os.path.join(out, method), *SMALL, *flags])
        record = Record(trainer)
        trainer.add_callback(record)
        trainer.train()
        rank = trainer.accelerator.process_index
        with open(os.path.join(out, f"{method}-{rank}.json"), "w") as f:
            json.dump({"steps": record.steps, "log": trainer.state.log_history,
                       "processes": trainer.accelerator.num_processes}, f)


def flag(method, name, default=None):
    """The value of --name in the worker's flags for `method` (the last one given wins)."""
    flags = SMALL + METHODS[method]
    if name not in flags:
        return default
    return flags[len(flags) - flags[::-1].index(name)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The worker under `accelerate launch --multi_gpu --num_processes 2` (on a machine without
    GPUs: two CPU processes over gloo): its output folder."""
    out = tmp_path_factory.mktemp("two")
    data = out / "small.jsonl"  # load_dataset holds one out: 9 to train on
    data.write_text("".join(json.dumps({"question": f"Compute {q}.", "answer": str(eval(q))}) + "\n"
                            for q in QUESTIONS))
    accelerate = shutil.which("accelerate") or os.path.join(os.path.dirname(sys.executable),
                                                            "accelerate")
    command = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               free_port(), os.path.abspath(__file__), str(out), str(data)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return out


@pytest.mark.parametrize("method", sorted(METHODS))
def test_two_processes_select_the_same_rows(two_processes, method):
    """Both processes computed the same advantages, kept set and coefficients at every step, from
    the rewards of the whole generation batch (both processes'); TRL's rewards and loss are finite;
    and DPPO pruned prompts (the data set brings tied prompts back)."""
    runs = [json.load(open(two_processes / f"{method}-{rank}.json")) for rank in (0, 1)]
    assert runs[0]["processes"] == 2
    assert len(runs[0]["steps"]) == 4
    assert runs[0]["steps"] == runs[1]["steps"]
    if method != "dppo":  # (dppo rolls out the kept prompts only)
        rows = 2 * int(flag(method, "--per_device_train_batch_size"))
        assert all(sum(map(len, step["rewards"])) == rows for step in runs[0]["steps"])
    logged = [row for row in runs[0]["log"] if "loss" in row]
    assert len(logged) == 4
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in logged)
    assert all(math.isfinite(row["reward"]) for row in logged if "reward" in row)
    if method == "dppo":
        assert any(p < 1 for step in runs[0]["steps"] for p in step["prompt_pi"])


@pytest.mark.parametrize("method", sorted(METHODS))
def test_two_processes_select_what_the_method_selects(two_processes, method):
    """Every step's selection, recomputed by hand (not through the plug-in) from the rewards TRL
    gathered from both processes and the recorded rows: the advantages, the kept rows and their
    c_i; MMR-GRPO's rewards reweighted over the toy encoder's embeddings of the completions, each
    process's slice embedded apart as there; DPPO's pi_q from the groups that came before, its
    completion draw (u from default_rng([seed 0, step])) and weights, and its rollouts: the two
    processes roll out different prompts, every kept one once, then copies of the first."""
    run = json.load(open(two_processes / f"{method}-0.json"))
    G = int(flag(method, "--num_generations"))
    ties = {}  # DPPO: prompt -> did its last group tie?
    if method == "mmr_grpo":  # the worker's --embed_model toy, and the toy model's tokenizer
        tokenizer = load_tokenizer(os.path.join(REPO, "toy", "model"))
        encoder = load_encoder("toy", torch.device("cpu"))
    for number, step in enumerate(run["steps"]):
        rewards = step["rewards"]
        N = G * len(rewards)
        lengths = [max(1, len(c)) for _, c in step["rows"]]  # the kept rows'
        weights = [1.0] * len(lengths)
        if method == "two_grpo":  # +-1 per mixed pair, the tied pairs dropped, seq_mean over all
            advantages = advantages_by_hand(rewards, 0, 0.0)
            kept = [i for i, a in enumerate(sum(advantages, [])) if a != 0]
            normaliser = [n * N for n in lengths]
        elif method == "cppo":  # the int(N P) smallest |A| of the batch dropped, token_mean
            advantages = advantages_by_hand(rewards, 1, 1e-4)
            kept = largest_abs(sum(advantages, []), N - int(N * float(flag(method, "--pruning"))))
            normaliser = [sum(lengths)] * len(lengths)
        elif method == "mmr_grpo":  # every row kept, seq_mean
            texts = tokenizer.batch_decode([c for _, c in step["rows"]], skip_special_tokens=True)
            half = len(texts) // 2
            embeddings = torch.cat([encoder.encode(part, convert_to_tensor=True,
                                                   show_progress_bar=False).float()
                                    for part in (texts[:half], texts[half:])])  # as each process
            reweighted = [mmr_by_hand(r, embeddings[q * G:q * G + G])
                          for q, r in enumerate(rewards)]
            assert step["reweighted"] == [pytest.approx(r, abs=1e-5) for r in reweighted]
            advantages = advantages_by_hand(reweighted, 1, 1e-4)
            kept = list(range(N))
            normaliser = [n * N for n in lengths]
        else:  # dppo: the kept prompts' groups first, then the copies; c_i = w_i / (|o_i| S G)
            prompts = [tuple(p) for p in step["prompts"]]
            n = len(step["prompt_pi"])
            assert len(set(prompts[:n])) == n  # no kept prompt rolled out twice
            assert prompts[n:] == prompts[:1] * (2 * max(1, -(-n // 2)) - n)  # copies: the rest
            assert step["prompt_pi"] == [0.5 if ties.get(p) else 1.0 for p in prompts[:n]]
            ties.update((p, max(r) == min(r)) for p, r in zip(prompts, rewards[:n]))
            advantages = advantages_by_hand(rewards[:n], 1, 1e-4)
            pi = completion_pi_by_hand(sum(advantages, []), 0.5, 0.1)
            assert step["completion_pi"] == pytest.approx(pi, rel=1e-6)  # A in float32 there
            rng = np.random.default_rng([0, number])
            rng.random()  # the prompt draw's u
            kept = systematic_by_hand(pi, rng.random())
            weights = [1 / (step["prompt_pi"][i // G] * pi[i]) for i in kept]
            assert step["weights"] == pytest.approx(weights, rel=1e-6)
            assert step["examined"] == 2 * int(flag(method, "--per_device_train_batch_size")) // G
            normaliser = [n * step["examined"] * G for n in lengths]
        assert step["advantages"] == [pytest.approx(a, abs=1e-5) for a in advantages]
        assert step["kept"] == kept
        assert step["coefs"] == pytest.approx([w / d for w, d in zip(weights, normaliser)],
                                              rel=1e-5)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_two_processes_first_step_is_the_scripts(two_processes, method):
    """The first optimiser step over two processes equals the script's step on the gathered kept
    rows (the toy model's initial weights): the loss TRL logs (each process's share, summed) and
    the norm of the gradient DDP averaged, to 1e-4. A wrong factor of num_processes, a row
    trained twice or a missing one would show here."""
    first = json.load(open(two_processes / f"{method}-0.json"))
    step = first["steps"][0]
    log = next(row for row in first["log"] if "loss" in row)
    beta = float(flag(method, "--beta", "0"))
    samples = [Sample(prompt_ids=p, completion_ids=c, advantage=a, coef=w)
               for (p, c), a, w in zip(step["rows"], advantages_of(step), step["coefs"])]
    model_dir = os.path.join(REPO, "toy", "model")
    model = load_model(model_dir, torch.device("cpu"))
    passes = Passes(1.2, model.get_output_embeddings().weight.shape[0], 4096)
    if beta:
        ref = sequence_logprobs(model, samples, passes)  # the initial policy is the reference
        for s, r in zip(samples, ref):
            s.ref_logps = r
    clip = (0.2, float(flag(method, "--epsilon_high", "0.2")))
    stats = policy_update(model, RecordingOptimizer(model), samples, passes, clip=clip, beta=beta)
    assert log["loss"] == pytest.approx(stats["loss"], rel=1e-4, abs=1e-6)
    assert log["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    assert stats["grad_norm"] > 0


def advantages_of(step):
    """The kept rows' advantages, from the [Q, G] table and the flat kept indices."""
    flat = [a for group in step["advantages"] for a in group]
    return [flat[i] for i in step["kept"]]


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
