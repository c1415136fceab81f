"""mmr_grpo.py: the MMR reweighting against hand-computed and brute-force values (docs/mmr_grpo.md),
real embeddings from tiny sentence-transformers encoders built here (nothing downloaded), and the
command line."""
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch

from common import group_advantages
from mmr_grpo import embed, group_similarity, load_encoder, mmr_reweight, mmr_rewards

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sigmoid = lambda x: 1 / (1 + math.exp(-x))


def notes_similarity():
    """The constructed group of docs/mmr_grpo.md#worked-examples: completions 0, 1, 2, 4, 5 are
    paraphrases (cosine 0.9), completion 3 is different (cosine 0.5 to every other)."""
    s = torch.full((6, 6), 0.9, dtype=torch.float64)
    s[3, :] = s[:, 3] = 0.5
    return s.fill_diagonal_(1.0)


def brute_force_mmr(r, s, floor):
    """Alg. 1 written independently: plain lists, the selected set kept explicitly, b_i recomputed
    from scratch."""
    g = len(r)
    mean = sum(r) / g
    lam = sigmoid(math.sqrt(sum((x - mean) ** 2 for x in r) / g))
    seed = max(range(g), key=lambda i: (r[i], -i))  # highest reward, lowest index among ties
    chosen, new = [seed], {seed: r[seed]}
    while len(chosen) < g:
        def score(i):
            b = max(s[i][j] for j in chosen)
            return lam * r[i] - (1 - lam) * (max(0.0, b) if floor else b)
        nxt = max((i for i in range(g) if i not in new), key=lambda i: (score(i), -i))
        new[nxt] = score(nxt)
        chosen.append(nxt)
    return [new[i] for i in range(g)], lam


def test_worked_examples_of_the_notes():
    """The three rows of the notes' table (§5): lambda, r~ exactly, advantages to the printed two
    decimals."""
    s, lam = notes_similarity(), sigmoid(0.5)
    cases = [  # rewards, r~ by hand, advantages printed in the notes
        ([1.0] * 6, [1, 0.5 - 0.45, 0.05, 0.5 - 0.25, 0.05, 0.05],
         [1.99, -0.50, -0.50, 0.02, -0.50, -0.50]),
        ([0.0] * 6, [0, -0.45, -0.45, -0.25, -0.45, -0.45],
         [1.84, -0.58, -0.58, 0.49, -0.58, -0.58]),
        ([1, 1, 1, 0, 0, 0], [1, lam - 0.9 * (1 - lam), lam - 0.9 * (1 - lam), -0.5 * (1 - lam),
                              -0.9 * (1 - lam), -0.9 * (1 - lam)],
         [1.70, 0.32, 0.32, -0.59, -0.88, -0.88]),
    ]
    for rewards, want, adv_printed in cases:
        new, got_lam = mmr_rewards(torch.tensor(rewards, dtype=torch.float32), s)
        assert got_lam.item() == pytest.approx(0.5 if len(set(rewards)) == 1 else lam, abs=1e-12)
        torch.testing.assert_close(new, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
        # (x - mean) / (unbiased std + 1e-4), the official GRPO host
        adv = group_advantages(new[None])[0]
        assert [round(a, 2) for a in adv.tolist()] == pytest.approx(adv_printed, abs=1e-9)
    assert lam == pytest.approx(0.6225, abs=1e-4)
    assert ([round(x, 3) for x in mmr_rewards(torch.tensor([1.0, 1, 1, 0, 0, 0]), s)[0].tolist()]
            == [1.0, 0.283, 0.283, -0.189, -0.34, -0.34])  # as printed in the notes
    # plain GRPO on the same groups: all 0, all 0, +-0.91
    assert (group_advantages([[1.0] * 6, [0.0] * 6]) == 0).all()
    assert (group_advantages([[1.0, 1, 1, 0, 0, 0]])[0, 0].item()
            == pytest.approx(0.5 / math.sqrt(0.3), rel=1e-3))


def test_batched_wrapper_on_embeddings_with_the_notes_similarities():
    """Embeddings whose Gram matrix is the notes' S (its Cholesky rows, scaled: cosine ignores the
    norm), two prompts in one batch: each group is reweighted on its own, with its own lambda,
    exactly as one group alone."""
    s = notes_similarity()
    rows = torch.linalg.cholesky(s) * torch.tensor([[3.0], [0.5], [1.0], [2.0], [7.0], [1.0]],
                                                   dtype=torch.float64)
    # [12, 6]: the second prompt lists the same completions reversed
    emb = torch.cat([rows, rows.flip(0)]).float()
    rewards = torch.tensor([[1.0, 1, 1, 0, 0, 0], [1.0] * 6])
    sim = group_similarity(emb, 6)
    torch.testing.assert_close(sim[0], s, rtol=0, atol=1e-6)
    torch.testing.assert_close(sim[1], s.flip(0).flip(1), rtol=0, atol=1e-6)
    new, lam, _ = mmr_reweight(rewards, emb)
    torch.testing.assert_close(new[0], mmr_rewards(rewards[0], s)[0], rtol=0, atol=1e-6)
    # reversed order: completion 3 is now index 2, the tied seed is index 0
    # (the notes' completion 5)
    torch.testing.assert_close(new[1], torch.tensor([1, 0.05, 0.25, 0.05, 0.05, 0.05],
                                                    dtype=torch.float64),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(lam, torch.tensor([sigmoid(0.5), 0.5], dtype=torch.float64))


def test_group_of_one_is_a_no_op():
    new, lam = mmr_rewards(torch.tensor([0.7]), torch.tensor([[1.0]]))
    assert new.tolist() == [pytest.approx(0.7)] and lam.item() == 0.5
    rewards = torch.tensor([[1.0], [0.0], [0.25]])
    new, lam, sim = mmr_reweight(rewards, torch.randn(3, 8))
    torch.testing.assert_close(new, rewards.double())
    torch.testing.assert_close(lam, torch.full((3,), 0.5, dtype=torch.float64))
    assert sim.shape == (3, 1, 1)


def test_floor_on_and_off_with_negative_similarities():
    """Two correct near-duplicates (cosine 1) and one wrong answer pointing away from both
    (cosine -0.8)."""
    r = torch.tensor([1.0, 1.0, 0.0])
    s = torch.tensor([[1.0, 1.0, -0.8], [1.0, 1.0, -0.8], [-0.8, -0.8, 1.0]], dtype=torch.float64)
    lam = sigmoid(math.sqrt(2) / 3)  # population std of {1, 1, 0}
    # with the floor (official code) b_2 = max(0, -0.8) = 0: the duplicate (score 2 lam - 1) goes
    # before the wrong one
    on, _ = mmr_rewards(r, s, floor=True)
    torch.testing.assert_close(on, torch.tensor([1.0, 2 * lam - 1, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # without it (the paper's Alg. 1) the wrong answer scores
    # 0.8 (1 - lam) = 0.307 > 2 lam - 1 = 0.231 and ranks above
    # a correct answer: the case the floor rules out for similarities in [-1, 1]
    off, _ = mmr_rewards(r, s, floor=False)
    torch.testing.assert_close(off, torch.tensor([1.0, 2 * lam - 1, 0.8 * (1 - lam)],
                                                 dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert off[2] > off[1] and on[2] < on[1]
    # the floor also changes the pick order: with it, candidates 1 and 2 tie at 0 and 1 goes first
    r, s = torch.zeros(3), torch.tensor([[1.0, -0.1, -0.5], [-0.1, 1.0, 0.9], [-0.5, 0.9, 1.0]],
                                        dtype=torch.float64)
    torch.testing.assert_close(mmr_rewards(r, s, True)[0],
                               torch.tensor([0.0, 0.0, -0.45], dtype=torch.float64))
    torch.testing.assert_close(mmr_rewards(r, s, False)[0],
                               torch.tensor([0.0, -0.45, 0.25], dtype=torch.float64))


def test_ties_go_to_the_lowest_index():
    lam = sigmoid(0.5)
    # seed: rewards tie at indices 1 and 2 -> 1 is the seed and keeps 1.0; 2 is scored against it
    r = torch.tensor([0.0, 1.0, 1.0, 0.0])
    s = torch.tensor([[1.0, 0.2, 0.2, 0.2], [0.2, 1.0, 0.5, 0.9], [0.2, 0.5, 1.0, 0.1],
                      [0.2, 0.9, 0.1, 1.0]],
                     dtype=torch.float64)
    new, _ = mmr_rewards(r, s)
    assert (new[1].item() == 1.0
            and new[2].item() == pytest.approx(lam - 0.5 * (1 - lam), abs=1e-12))
    # a later pick: 1 and 2 tie at -0.1 after seed 0 -> 1 goes first and keeps -0.1;
    # 2 then sees b = 0.8
    new, _ = mmr_rewards(torch.zeros(3), torch.tensor([[1.0, 0.2, 0.2], [0.2, 1.0, 0.8],
                                                       [0.2, 0.8, 1.0]],
                                                      dtype=torch.float64))
    torch.testing.assert_close(new, torch.tensor([0.0, -0.1, -0.4], dtype=torch.float64),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("floor", [True, False])
def test_matches_a_brute_force_alg1_on_random_groups(floor):
    rng = random.Random(0)
    for trial in range(200):
        g = rng.randint(2, 9)
        r = [float(rng.random() < 0.5) if trial % 2 else rng.uniform(-1, 2) for _ in range(g)]
        e = torch.nn.functional.normalize(
            torch.randn(g, 5, generator=torch.Generator().manual_seed(trial)), dim=-1)
        s = (e @ e.T).double()  # cosines of both signs
        want, want_lam = brute_force_mmr(r, s.tolist(), floor)
        got, lam = mmr_rewards(torch.tensor(r, dtype=torch.float64), s, floor)
        assert lam.item() == pytest.approx(want_lam, abs=1e-12)
        assert got.tolist() == pytest.approx(want, abs=1e-9), (r, s)


def tiny_bert_sentence_transformer(folder):
    """A saved sentence-transformers folder (modules.json: tiny BERT + mean pooling) with the
    conftest tokenizer."""
    from conftest import CORPUS
    from sentence_transformers import SentenceTransformer
    from toy.build import make_tokenizer
    from transformers import BertConfig, BertModel
    tokenizer = make_tokenizer(CORPUS, vocab_size=290)
    # as real encoders (MiniLM, jina): sentence-transformers >= 6 would apply one
    tokenizer.chat_template = None
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                        pad_token_id=tokenizer.pad_token_id)
    BertModel(config).save_pretrained(folder + "/hf")
    tokenizer.save_pretrained(folder + "/hf")
    # no modules.json there: mean pooling added
    SentenceTransformer(folder + "/hf", device="cpu").save(folder + "/st")
    return folder + "/st"


def mean_pooled_cosines(hf_folder, texts):
    """Brute force: each text alone through the plain transformers model, no special tokens added by
    us, mean over its tokens, cosines in float64."""
    from transformers import AutoModel, AutoTokenizer
    model, tok = (AutoModel.from_pretrained(hf_folder).eval(),
                  AutoTokenizer.from_pretrained(hf_folder))
    vecs = []
    for t in texts:
        ids = tok(t, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            vecs.append(model(input_ids=ids).last_hidden_state[0].mean(0).double())
    e = torch.nn.functional.normalize(torch.stack(vecs), dim=-1)
    return e @ e.T


TEXTS = ["<answer>85</answer>", "The sum is 85. <answer>85</answer>", "<answer>85</answer>",
         "<answer>75</answer>",
         "47 + 38 = 75", "<answer>85</answer>", "I do not know", "<answer>13</answer>"]


@pytest.mark.parametrize("kind", ["saved_sentence_transformer", "plain_model_folder"])
def test_real_embeddings_feed_the_similarity(tmp_path, tiny_dir, kind):
    """load_encoder -> embed -> group_similarity on a real (tiny, random) encoder equals mean
    pooling + cosine done by hand; a plain model folder (the conftest Qwen2, as `toy` is) is
    embedded as plain text, not chat-templated."""
    if kind == "saved_sentence_transformer":
        path = tiny_bert_sentence_transformer(str(tmp_path))
        hf = str(tmp_path / "hf")
    else:
        path = hf = tiny_dir
    encoder = load_encoder(path, torch.device("cpu"))
    emb = embed(encoder, TEXTS)
    assert emb.shape[0] == 8 and not emb.requires_grad
    sim = group_similarity(emb, 4)  # [2, 4, 4]: two prompts of 4 completions
    want = mean_pooled_cosines(hf, TEXTS)
    torch.testing.assert_close(sim[0], want[:4, :4], rtol=0, atol=1e-5)
    torch.testing.assert_close(sim[1], want[4:, 4:], rtol=0, atol=1e-5)
    # equal texts, cosine 1
    assert sim[0, 0, 2].item() == pytest.approx(1.0, abs=1e-6) and sim[0, 0, 1] < 0.9999
    new, lam, _ = mmr_reweight(torch.tensor([[1.0, 1, 1, 0], [1.0, 0, 0, 0]]), emb)
    # the exact duplicate of the seed earns less than the paraphrase
    assert new[0, 0] == 1 and new[0, 2] < new[0, 1]
    # an empty completion (the plain model's tokenizer gives it no token) embeds as zeros, alone
    # too: a step whose completions are all empty does not crash the encoder
    alone = embed(encoder, ["", ""])
    assert alone.shape == emb[:2].shape and not alone.any()
    if kind == "plain_model_folder":
        assert not embed(encoder, [TEXTS[0], ""])[1].any()


def test_toy_encoder_is_the_toy_policy_mean_pooled():
    encoder = load_encoder("toy", torch.device("cpu"))
    sim = group_similarity(embed(encoder, TEXTS[:4]), 4)[0]
    torch.testing.assert_close(sim,
                               mean_pooled_cosines(os.path.join(REPO, "toy", "model"), TEXTS[:4]),
                               rtol=0, atol=1e-5)


# ---------------------------------------------------------------- command line

def run(args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, "mmr_grpo.py"), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def test_toy_cli_run_logs_mmr(tmp_path):
    out = str(tmp_path / "run")
    result = run(["--rollout", "hf", "--prompts_per_step", "4", "--group_size", "4",
                  "--eval_n", "8", "--steps", "2", "--eval_every", "0", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert ([r["step"] for r in rows] == [0, 1, 2] and "eval_accuracy" in rows[0]
            and "eval_accuracy" in rows[2])
    phases = {"rollout_s", "reward_s", "mmr_s", "logp_s", "update_s", "push_s"}
    needed = {"reward_mean", "loss", "kl", "grad_norm", "zero_std_groups", "step_s", "tokens_per_s",
              "rollouts", "trained_rollouts", "mmr_lambda", "mmr_share", "mmr_similarity",
              "silent_groups", *phases}
    for r in rows[1:]:
        assert needed <= set(r) and "train_s" not in r
        assert r["rollouts"] == r["trained_rollouts"] == 16  # every completion is trained on
        assert 0.5 <= r["mmr_lambda"] < sigmoid(0.5) + 1e-6  # binary rewards: population std <= 0.5
        assert (0 < r["mmr_share"] < 1
                and r["mmr_s"] == pytest.approx(r["mmr_share"] * r["step_s"], rel=1e-3))
        # "mmr" is its own phase between two "reward" spans (phases do not nest):
        # they add up to the step
        assert sum(r[k] for k in phases) == pytest.approx(r["step_s"], rel=0.05)
        # the advantages come from r~: no group is left without a signal...
        assert r["silent_groups"] == 0
    # ...although plain GRPO would have left some silent
    assert sum(r["zero_std_groups"] for r in rows[1:]) > 0
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["method"] == "mmr_grpo" and config["args"]["embed_model"] == "toy"
            and config["args"]["sim_floor"])
    assert config["ideal_trained_fraction"] == 1.0
    assert os.path.exists(os.path.join(out, "checkpoint-2", "model", "model.safetensors"))


@pytest.fixture
def inputs(tmp_path):
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(10)]
    (tmp_path / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "not_a_model").mkdir()
    return tmp_path


@pytest.mark.parametrize("args,message", [
    (["--embed_model", "/no/such/encoder"], "--embed_model '/no/such/encoder' could not be loaded"),
    (["--embed_model", "{tmp}/not_a_model"], "not_a_model' could not be loaded"),
    # a model that is no built-in task's: the paper's encoder, not in the offline cache
    (["--dataset", "{tmp}/small.jsonl", "--model", "{tmp}/not_a_model"],
     "--embed_model 'sentence-transformers/all-MiniLM-L6-v2' could not be loaded"),
    (["--sim_floor", "maybe"], "Truthy value expected: got maybe"),
    (["--no_sim_floor", "yes"], "unrecognized arguments: yes"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(inputs, main_of, args, message):
    out = inputs / "out"
    result = main_of("mmr_grpo", [a.replace("{tmp}", str(inputs)) for a in args]
                     + ["--out", str(out)])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    if "embed_model" in message:  # says what to pass instead
        assert "pass a local sentence-transformers folder, or --embed_model toy" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("flags,floor", [
    ([], True), (["--no_sim_floor"], False), (["--no-sim-floor"], False),
    (["--sim_floor", "false"], False),
    (["--sim_floor"], True), (["--sim-floor", "true"], True),
])
def test_sim_floor_flag_spellings(tmp_path, flags, floor):
    from mmr_grpo import Args, encoder_recipe
    from common import parse_args
    args = parse_args(Args, "mmr_grpo", "", encoder_recipe,
                      argv=[*flags, "--rollout", "hf", "--out", str(tmp_path / "run")])
    assert args.sim_floor is floor


def test_help_explains_the_mmr_flags():
    result = run(["--help"])
    assert (result.returncode == 0 and "--embed_model" in result.stdout
            and "--no_sim_floor" in result.stdout)
    assert "all-MiniLM-L6-v2" in result.stdout and "official code" in result.stdout


def test_a_group_with_an_unread_answer_is_left_out_whole():
    """A NaN reward (an answer score left unread): that group's reweighted rewards are all NaN, so
    group_advantages gives each of its completions 0; the other groups are reweighted as alone."""
    rewards = torch.tensor([[1.0, math.nan, 0.0], [1.0, 0.0, 0.0]])
    embeddings = torch.eye(6)[:, :4]  # [6, 4]
    new, lam, _ = mmr_reweight(rewards, embeddings)
    assert torch.isnan(new[0]).all() and torch.isnan(lam[0])
    alone, lam_alone, _ = mmr_reweight(rewards[1:], embeddings[3:])
    torch.testing.assert_close(new[1], alone[0])
    assert (group_advantages(new)[0] == 0).all()
