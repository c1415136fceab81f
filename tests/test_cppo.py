"""cppo.py: the kept set on hand-made groups (ties, all-equal groups, both scopes), the allocation
arithmetic, pruned rows never reaching the old-policy / reference / update passes, a short CLI run
with resume, and bad input (docs/cppo.md)."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import common
import cppo
from common import group_advantages

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Four groups of G = 4 (rewards), chosen so that every tie rule and both scopes show
# (docs/cppo.md#eq-prune-question):
#   q0 one right: A = [+1.5, -.5, -.5, -.5]   q1 two right: |A| = .866 for all four
#   q2 all right: A = 0
#   q3 the last right: A = [-.5, -.5, -.5, +1.5] (the same |A| values as q0, in another order)
REWARDS = [[1, 0, 0, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
# k = 2 per question: q0 keeps its 1.5 and, of three tied .5, the lowest index; q1 and q2 are all
# ties -> 0, 1
KEPT_QUESTION = [0, 1, 4, 5, 8, 9, 12, 15]
# P = 0.5 over the batch: drop int(16 * .5) = 8 smallest |A|. Keep the two 1.5s (0, 15), the four
# .866s (4-7) and two of the six tied .5s (1, 2, 3, 12, 13, 14): the lowest flat indices 1 and 2.
# q2 loses everything, q1 keeps all four.
KEPT_BATCH = [0, 1, 2, 4, 5, 6, 7, 15]


def adv_by_hand():
    s = math.sqrt(0.25)  # unbiased std of [1, 0, 0, 0]: sqrt((.75^2 + 3 * .25^2) / 3) = .5
    s2 = math.sqrt(1 / 3)  # of [0, 0, 1, 1]: sqrt(4 * .25 / 3)
    e = 1e-4
    return torch.tensor([[.75 / (s + e), -.25 / (s + e), -.25 / (s + e), -.25 / (s + e)],
                         [-.5 / (s2 + e), -.5 / (s2 + e), .5 / (s2 + e), .5 / (s2 + e)],
                         [0.0] * 4,
                         [-.25 / (s + e), -.25 / (s + e), -.25 / (s + e), .75 / (s + e)]])


def brute_force_kept(adv, n_keep):
    """Independent reference: sort (|A| descending, flat index ascending) in plain Python, take the
    first n_keep."""
    flat = [abs(a) for a in adv.flatten().tolist()]
    return sorted(sorted(range(len(flat)), key=lambda i: (-flat[i], i))[:n_keep])


# ---------------------------------------------------------------- the kept set


def test_hand_made_groups_both_scopes():
    adv = group_advantages(REWARDS)
    torch.testing.assert_close(adv, adv_by_hand())
    assert cppo.prune_per_question(adv, 2) == KEPT_QUESTION
    assert cppo.prune_batch(adv, 0.5) == KEPT_BATCH
    # k = 1: q0 and q3 keep their single right answer; the tied groups keep their first sample
    assert cppo.prune_per_question(adv, 1) == [0, 4, 8, 15]
    # P = 0 keeps everything, in order; P = 0.75 over the batch keeps the two 1.5s and the first
    # two .866s
    assert cppo.prune_per_question(adv, 4) == cppo.prune_batch(adv, 0.0) == list(range(16))
    assert cppo.prune_batch(adv, 0.75) == [0, 4, 5, 15]


def test_sign_does_not_matter_and_ties_go_to_the_lower_index():
    adv = torch.tensor([[0.5, -1.0, 1.0, 0.2, -1.0]])
    assert cppo.prune_per_question(adv, 2) == [1, 2]  # -1 and +1 are equally informative
    assert cppo.prune_per_question(adv, 1) == [1]  # three tied |A| = 1: the first sample wins
    assert cppo.prune_per_question(adv, 4) == [0, 1, 2, 4]
    assert cppo.prune_batch(adv, 0.6) == [1, 2]  # drop int(5 * .6) = 3


def test_all_equal_groups_keep_their_first_k_and_batch_scope_drops_them_first():
    adv = group_advantages([[1, 1, 1, 1], [0, 0, 0, 0]])
    assert (adv == 0).all()
    assert cppo.prune_per_question(adv, 2) == [0, 1, 4, 5]
    assert cppo.prune_batch(adv, 0.75) == [0, 1]  # all tied at 0: the lowest flat indices
    mixed = group_advantages([[1, 1, 1, 1], [0, 1, 0, 0]])
    assert cppo.prune_batch(mixed, 0.5) == [4, 5, 6, 7]  # the zero-|A| group goes entirely
    assert cppo.prune_per_question(mixed, 2) == [0, 1, 4, 5]  # per question it keeps two A = 0 rows


@pytest.mark.parametrize("seed", range(20))
def test_random_ties_match_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    Q, G = int(torch.randint(1, 7, (), generator=g)), int(torch.randint(2, 9, (), generator=g))
    # few distinct values: many ties, both signs
    adv = (torch.randint(-3, 4, (Q, G), generator=g) / 2).float()
    for k in range(1, G + 1):
        want = sorted(i + q * G for q in range(Q) for i in brute_force_kept(adv[q:q + 1], k))
        assert cppo.prune_per_question(adv, k) == want
    for P in (0.0, 0.25, 0.5, 0.75, 0.9):
        assert cppo.prune_batch(adv, P) == brute_force_kept(adv, Q * G - int(round(Q * G * P, 9)))
    if Q == 1:  # one question per step (the official code without allocation): both scopes agree
        for k in range(1, G + 1):
            assert cppo.prune_batch(adv, 1 - k / G) == cppo.prune_per_question(adv, k)


def test_batch_pruning_count_survives_float_rounding():
    adv = torch.arange(100.0).view(1, 100)
    assert 100 * 0.29 < 29  # 28.999999999999996: a bare int() would drop 28
    assert len(cppo.prune_batch(adv, 0.29)) == 71
    assert len(cppo.prune_batch(torch.ones(64, 16), 0.875)) == 128


# ---------------------------------------------------------------- allocation arithmetic


@pytest.mark.parametrize("G,P,k", [(16, 0.875, 2), (16, 0.5, 8), (16, 0.75, 4), (16, 0.9375, 1),
                                   (16, 0.0, 16), (8, 0.75, 2), (4, 0.5, 2), (3, 2 / 3, 1)])
def test_kept_per_question(G, P, k):
    assert cppo.kept_per_question(G, P) == k


@pytest.mark.parametrize("G,P,message", [
    (16, 1.0, "must be in [0, 1)"), (16, -0.1, "must be in [0, 1)"),
    (16, 0.3, "k = G(1-P) = 11.2"), (8, 0.9375, "k = G(1-P) = 0.5"),
    (16, 0.99, "k = G(1-P) = 0.16"), (16, 1 - 1e-8, "k = G(1-P) = 1.6e-07")])
def test_kept_per_question_rejects_impossible_values(G, P, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cppo.kept_per_question(G, P)


@pytest.mark.parametrize("B,G,P,Q", [(8, 16, 0.875, 64), (1, 16, 0.875, 8), (4, 16, 0.75, 16),
                                     (32, 8, 0.0, 32), (3, 16, 0.9375, 48), (2, 8, 0.625, 6)])
def test_questions_to_sample(B, G, P, Q):
    k = cppo.kept_per_question(G, P)
    assert cppo.questions_to_sample(B, G, k) == Q == math.ceil(B / (1 - P) - 1e-9)
    # the kept rows fill B x G slots, with the fewest questions
    assert Q * k >= B * G and (Q - 1) * k < B * G
    # (2, 8, .625): k = 3, 16 / 3 questions is not whole: 6 questions, 18 kept rows


# ---------------------------------------------------------------- pruned rows never reach a
# forward pass

ROW = re.compile(r"row (\d+)\.(\d+)\.(\d+)")


class FakeEngine:
    """Each step returns, for prompt q, G = 4 completions right or wrong by REWARDS[q], each tagged
    'row step.q.i' so the token ids seen by a forward pass name the rows they came from."""

    def __init__(self, tokenizer):
        self.tokenizer, self.step = tokenizer, 0

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompts, n, temperature, max_tokens, seed, progress=False):
        if n == 1:  # evaluation
            return [[(self.encode("<answer>4</answer>"), None)] for _ in prompts]
        assert len(prompts) == len(REWARDS) and n == 4
        out = [[(self.encode(f"<answer>{4 if REWARDS[q][i] else 5}</answer> "
                             f"row {self.step}.{q}.{i}"), None)
                for i in range(n)] for q in range(len(prompts))]
        self.step += 1
        return out

    def sleep(self):
        pass

    def push(self, model):
        pass


@pytest.fixture
def one_thread():
    """The tiny model's matrices are too small for a second thread to pay, and on a busy 2-core
    machine its synchronisation makes each forward pass ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scope,kept", [("batch", KEPT_BATCH), ("question", KEPT_QUESTION)])
def test_pruned_rows_never_reach_the_old_reference_or_update_passes(tiny_dir, tmp_path, monkeypatch,
                                                                    one_thread, scope, kept):
    """Runs cppo.main() in-process with a scripted engine and a hook on each model's decoder that
    records the token ids of every forward pass: the reference pass, the old-policy pass (no grad)
    and the mu = 2 update passes (with grad: the only graphs backward runs through) see exactly the
    kept rows, each once per pass, and no pruned row."""
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"Compute 2 + 2 ({split} {i}).", "answer": "4"} for i in range(10)]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = []  # (model, grad enabled, step.q.i of every row in the pass)
    tokenizer = common.load_tokenizer(tiny_dir)

    def spying_load_model(path, device, *args, frozen=False, **kw):
        model = cppo_load_model(path, device, *args, frozen=frozen, **kw)
        tag = "ref" if frozen else "policy"

        def hook(module, args, kwargs):
            text = tokenizer.decode(kwargs["input_ids"][0].tolist())
            seen.append((tag, torch.is_grad_enabled(), ROW.findall(text)))
        model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
        return model
    cppo_load_model = common.load_model  # setup() loads the models and the engine
    updates = []
    real_update = cppo.policy_update

    def spying_update(model, optimizer, samples, passes, **kw):
        updates.append(([s.advantage for s in samples], torch.tensor([s.coef for s in samples]),
                        [len(s.completion_ids) for s in samples],
                        sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)))
        return real_update(model, optimizer, samples, passes, **kw)
    monkeypatch.setattr(common, "load_model", spying_load_model)
    monkeypatch.setattr(cppo, "policy_update", spying_update)
    # --rollout hf below
    monkeypatch.setattr(common, "HFEngine", lambda model, tok, *a, **kw: FakeEngine(tok))
    out = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["cppo.py", "--model", tiny_dir, "--dataset", str(data),
                                      "--out", str(out),
                                      "--rollout", "hf",
                                      "--prompts_per_step", "2", "--group_size", "4",
                                      "--pruning", "0.5",
                                      "--prune_scope", scope, "--steps", "3", "--eval_n", "4",
                                      "--max_tokens", "16"])
    cppo.main()

    kept_rows = {divmod(j, 4) for j in kept}  # (question, sample)
    assert (len(kept_rows) == 8
            and len({(q, i) for q in range(4) for i in range(4)} - kept_rows) == 8)
    for step in (0, 1, 2):
        rows_in = lambda tag, grad: [(int(q), int(i)) for t, g, found in seen
                                     if t == tag and g == grad
                                     for s, q, i in found if int(s) == step]
        # one reference pass over the kept rows
        assert sorted(rows_in("ref", False)) == sorted(kept_rows)
        # one old-policy pass (mu = 2)
        assert sorted(rows_in("policy", False)) == sorted(kept_rows)
        # mu = 2 updates, nothing else
        assert sorted(rows_in("policy", True)) == sorted(list(kept_rows) * 2)
        assert not rows_in("ref", True)
    # what the updates received: the full-group advantages (not renormalised) and the token mean
    # over kept tokens
    adv = adv_by_hand().flatten()
    assert len(updates) == 6
    for advantages, coefs, lengths, _ in updates:
        torch.testing.assert_close(torch.tensor(advantages), adv[kept])
        torch.testing.assert_close(coefs, torch.full((8,), 1 / sum(lengths)))
    logged = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [0, 1, 2, 3]
    # resolved: round(0.1 * 3 steps * mu 2)
    assert json.load(open(out / "config.json"))["warmup_steps"] == 1
    assert logged[1]["questions"] == 4 and logged[1]["kept_frac"] == 0.5
    assert logged[1]["rollouts"] == 16 and logged[1]["trained_rollouts"] == 8
    # kept_token_frac: the kept rows' prompt + completion tokens over every sampled row's (`tokens`)
    assert logged[1]["kept_token_frac"] * logged[1]["tokens"] == pytest.approx(updates[0][3])
    assert logged[1]["kept_token_frac"] < 1
    # q2 (all A = 0) loses all its rows
    assert logged[1]["questions_emptied"] == (1 if scope == "batch" else 0)
    assert logged[1]["kept_zero_adv"] == (0 if scope == "batch" else 0.25)
    assert (logged[1]["reward_mean"] == pytest.approx(8 / 16)
            and logged[1]["zero_std_groups"] == 0.25)


# ---------------------------------------------------------------- the command line


def run(args, timeout=600):
    # one thread: the toy's matrices are small, and two threads on a busy 2-core machine make
    # training ~3x slower
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, "cppo.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.parametrize("args,message", [
    (["--pruning", "1"], "--pruning must be in [0, 1) (got 1.0)"),
    (["--pruning", "-0.5"], "--pruning must be in [0, 1) (got -0.5)"),
    (["--pruning", "0.3"],
     "keeps k = G(1-P) = 11.2 completions per question: k must be a whole number >= 1"),
    (["--group_size", "8", "--pruning", "0.9375"],
     "keeps k = G(1-P) = 0.5 completions per question"),
    (["--prune_scope", "device"], "invalid choice: 'device'"),
    (["--group_size", "1", "--pruning", "0"], "--group_size 1 has no unbiased std"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, args,
                                                         message):
    """In-process (a subprocess per case would cost seconds of imports each): what the command line
    would print."""
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["cppo.py", *args, "--out", str(out)])
    with pytest.raises(SystemExit) as exit_:
        cppo.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not out.exists()


def test_toy_cli_run_logs_the_pruning(tmp_path):
    """2 steps on the toy (vLLM when installed): B = 2, G = 8, P = 0.75 -> k = 2, 8 questions, 16
    kept of 64. (--resume is common machinery, tested with grpo.py in test_cli.py; here the data
    cursor advances by Q = 8.)"""
    out = str(tmp_path / "run")
    result = run(["--prompts_per_step", "2", "--group_size", "8", "--pruning", "0.75", "--eval_n",
                  "16", "--steps", "2", "--eval_every", "0", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 prompts x 8 completions sampled, 16 kept (batch scope)" in result.stdout
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["questions_per_step"] == 8 and config["kept_per_question"] == 2
            and config["method"] == "cppo")
    assert config["ideal_trained_fraction"] == 0.25  # k / G = 1 - P
    # round(0.1 * 2 steps * mu 2) = 0
    assert config["warmup_steps"] == 0 and config["args"]["mu"] == 2
    logged = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert ([r["step"] for r in logged] == [0, 1, 2] and "eval_accuracy" in logged[0]
            and "eval_accuracy" in logged[2])
    grpo_keys = {"reward_mean", "reward_std", "loss", "kl", "clip_frac", "grad_norm",
                 "micro_batches", "train_tokens", "completion_len", "truncated", "zero_std_groups",
                 "lr", "verify_timeouts", "verify_errors", "no_answer", "tokens", "rollouts",
                 "trained_rollouts", "rollout_s", "reward_s", "logp_s", "update_s", "push_s",
                 "step_s", "tokens_per_s"}
    cppo_keys = {"questions", "kept_frac", "kept_token_frac", "questions_emptied", "kept_zero_adv",
                 "prune_s"}
    phases = ["rollout_s", "reward_s", "prune_s", "logp_s", "update_s", "push_s"]
    for r in logged[1:]:
        assert grpo_keys | cppo_keys <= set(r), (grpo_keys | cppo_keys) - set(r)
        # no estimates in the loop
        assert not {"train_s", "train_s_full_est", "train_s_saved_est"} & set(r)
        assert r["rollouts"] == 64 and r["trained_rollouts"] == 16
        assert r["questions"] == 8 and r["kept_frac"] == 0.25 and 0 < r["kept_token_frac"] < 1
        # phases do not nest: together they are the step, up to the logging between them
        assert sum(r[p] for p in phases) == pytest.approx(r["step_s"], rel=0.05, abs=0.05)
        # the update trained exactly the kept tokens: 16 completions, their completion tokens only
        assert r["train_tokens"] <= 16 * 24
    state = torch.load(os.path.join(out, "checkpoint-2", "state.pt"), weights_only=True)
    assert state["step"] == 2 and state["cursor"] == 2 * 8


def test_help_lists_the_new_flags(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["cppo.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        cppo.main()
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    from dataclasses import fields
    for f in fields(cppo.Args):
        assert f"--{f.name}" in text
    assert "(default: 0.875)" in text and "10% of the optimiser steps" in text
