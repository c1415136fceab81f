"""A method is two files: `<method>.py` and `common.py`, copied into an empty folder, run on the toy
(with `toy/` beside them) and on a model and dataset of one's own (without it); nothing else of the
repository is imported."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
SMALL = {"grpo": [], "two_grpo": [], "cppo": ["--pruning", "0.5"], "dppo": [], "mmr_grpo": []}


def start_copy(folder, method, flags):
    """The copied script, one step, in its own process with one thread (the two copies of a test run
    side by side)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, f"{method}.py", "--steps", "1", "--prompts_per_step",
                             "2", "--group_size", "2", "--eval_n", "4", "--rollout", "hf",
                             *SMALL[method], *flags, "--out", "run"],
                            cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def stderr_of(proc):
    """Waits for it; its stderr, which must come with exit code 0."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    return err


@pytest.mark.parametrize("method", METHODS)
def test_a_method_runs_from_two_copied_files(method, tmp_path, tiny_dir):
    toy, own = tmp_path / "with_toy", tmp_path / "own"
    for folder in (toy, own):
        folder.mkdir()
        for name in (f"{method}.py", "common.py"):
            shutil.copy(os.path.join(REPO, name), folder)
    shutil.copytree(os.path.join(REPO, "toy"), toy / "toy", ignore=shutil.ignore_patterns("chains"))
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)}
            for a in range(10, 16) for b in (20, 30)]
    (own / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = ["--embed_model", tiny_dir] if method == "mmr_grpo" else []
    runs = [start_copy(toy, method, []),  # the toy, with toy/ beside the two files
            start_copy(own, method, ["--model", tiny_dir, "--dataset", "data.jsonl",
                                     *extra])]  # one's own
    for proc in runs:
        stderr_of(proc)
    assert json.load(open(toy / "run" / "config.json"))["args"]["model"] == str(
        toy / "toy" / "model")
    assert set(os.listdir(own)) - {"__pycache__"} == {"common.py", "data.jsonl", f"{method}.py",
                                                      "run"}
    metrics = [json.loads(line) for line in open(own / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1]


# One's own task: the marked reward() replaced, nothing else of the copied script touched
OWN_REWARD = '''import json  # one's own imports, in the marked block
import os


def reward(completion, row):
    """Reads a column of one's own: the row's bonus, times the completion's length mod 3, / 2."""
    value = row["bonus"] * (len(completion) % 3) / 2
    with open(os.environ["REWARD_LOG"], "a") as f:  # each call, for the test to read back
        f.write(json.dumps({"split": row["split"], "value": value}) + "\\n")
    return value


'''


def replace_reward(source):
    """The script with its marked reward() (from its def to the next def) replaced by OWN_REWARD."""
    marker = source.index("# YOUR TASK")
    start = source.index("def reward(completion, row):", marker)
    end = source.index("def prompt(", start)
    return source[:start] + OWN_REWARD + source[end:]


@pytest.mark.parametrize("method", METHODS)
def test_ones_own_reward_reads_ones_own_column(method, tmp_path, tiny_dir):
    """Two copied files, only the marked reward() replaced by one that reads a column of one's own
    .jsonl: every reward a step logs is that function's, its mean over each step's rollouts, and the
    held-out score is its mean over the test rows. Each method uses the rewards its own way (CPPO
    prunes, DPPO samples, MMR-GRPO reweights), so each is run."""
    for name in (f"{method}.py", "common.py"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    script = tmp_path / f"{method}.py"
    script.write_text(replace_reward(script.read_text()))
    for split, n in (("train", 24), ("test", 4)):
        rows = [{"question": f"What is {a} + 20?", "answer": str(a + 20), "split": split,
                 "bonus": 0.1 * (1 + a % 7)} for a in range(10, 10 + n)]
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows))
    flags = {"cppo": ["--group_size", "4", "--pruning", "0.5"],
             "mmr_grpo": ["--embed_model", tiny_dir], "two_grpo": []}.get(method,
                                                                         ["--group_size", "4"])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", REWARD_LOG=str(tmp_path / "calls.jsonl"))
    result = subprocess.run([sys.executable, f"{method}.py", "--model", tiny_dir, "--dataset",
                             "data", "--steps", "2", "--prompts_per_step", "2", "--rollout", "hf",
                             *flags, "--out", "run"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    # first the load-time check: reward() once a row (24 train, 4 test), an empty completion
    assert [c["split"] for c in calls[:28]] == ["train"] * 24 + ["test"] * 4
    calls = calls[28:]
    train = [c["value"] for c in calls if c["split"] == "train"]
    test = [c["value"] for c in calls if c["split"] == "test"]
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [m for m in metrics if m["step"] > 0]
    assert len(steps) == 2 and sum(m["rollouts"] for m in steps) == len(train)
    assert len(set(train)) > 1  # the rewards vary, so the methods have something to learn from
    for m in steps:
        mine = [train.pop(0) for _ in range(m["rollouts"])]  # this step's calls, in order
        assert m["reward_mean"] == pytest.approx(sum(mine) / len(mine), abs=1e-5)
    # evaluated at step 0 and at the end, on the 4 test rows (no validation split)
    assert len(test) == 8
    assert metrics[-1]["test_accuracy"] == pytest.approx(sum(test[4:]) / 4, abs=1e-5)


# One's own task without a 'question' or an 'answer' column: the whole marked block replaced
OWN_TASK = '''import statistics  # an import of one's own, where the block says

METRIC = "closeness"


def reward(completion, row):
    """1 - |the last number of the completion - the target| / 100, at least 0."""
    numbers = [float(t) for t in completion.split() if t.isdigit()]
    guess = numbers[-1] if numbers else statistics.mean(row["numbers"])
    return max(0.0, 1 - abs(guess - row["target"]) / 100)


def prompt(row, template):
    return [{"role": "user", "content": f"Make {row['target']} from {row['numbers']}"}]
'''


def replace_task(source):
    """The script with its whole marked block (after its heading, up to its end) replaced."""
    heading = source.index("\n", source.index("# =====", source.index("# YOUR TASK")))
    end = source.index("# ==========", source.index("return template_messages"))
    return source[:heading + 1] + OWN_TASK + source[end:]


def test_a_task_of_ones_own_columns_and_a_missing_column(tmp_path, tiny_dir):
    """A copied grpo.py whose marked block holds an import, a METRIC and a reward and prompt of its
    own, on rows with neither a 'question' nor an 'answer' (the defaults' columns): it trains, and
    its progress bar and last line name its METRIC. The default block on rows without an 'answer'
    stops with one line naming reward(), the column, the file and the row, before the model
    loads."""
    for name in ("grpo.py", "common.py"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    default = (tmp_path / "grpo.py").read_text()
    (tmp_path / "grpo.py").write_text(replace_task(default))
    rows = [{"numbers": [a, 20], "target": a + 20} for a in range(10, 30)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "grpo.py", "--model", tiny_dir, "--dataset", "data.jsonl",
               "--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--eval_n", "4",
               "--rollout", "hf"]
    result = subprocess.run(command + ["--out", "run"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "closeness=" in result.stderr and "acc=" not in result.stderr
    assert "done: test closeness" in result.stdout
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert "eval_closeness" in metrics[0] and "test_closeness" in metrics[-1]
    (tmp_path / "grpo.py").write_text(default)
    for line in (13, 3):  # a row without an answer on line 13 (of the test split), then line 3
        rows = [{"question": f"What is {a} + 20?", "answer": a + 20} for a in range(10, 30)]
        del rows[line - 1]["answer"]
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        result = subprocess.run(command + ["--out", "run2"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
        assert errors[0].startswith("error: reward() raised ValueError(\"the row has no 'answer' "
                                    "that is a string or a finite number"), errors
        assert "(grpo.py:" in errors[0] and f" on data.jsonl line {line} (" in errors[0], errors
        assert "loading" not in result.stdout and not (tmp_path / "run2").exists()


# A task of one's own whose columns the default reward would misread: an integer 'answer' and a
# 'solution' without a \boxed{}; the reward logs each row it is handed
ROWS_AS_WRITTEN = '''import json
import os

METRIC = "accuracy"


def reward(completion, row):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return float(str(row["answer"]) in completion)


def prompt(row, template):
    return [{"role": "user", "content": f"{row['letters']} sorted is"}]
'''


def test_rows_reach_the_task_as_written_and_the_toy_model_takes_the_toys_recipe(tmp_path):
    """A copied grpo.py with its marked block replaced, on a file of one's own with the toy's model
    (the default, toy/ beside the two files): every row reaches reward() as the file has it (an
    integer answer stays an integer, a 'solution' without a \\boxed{} loads), and the run takes
    the toy's recipe, saying so on its first line."""
    for name in ("grpo.py", "common.py"):
        shutil.copy(os.path.join(REPO, name), tmp_path)
    shutil.copytree(os.path.join(REPO, "toy", "model"), tmp_path / "toy" / "model")
    source = (tmp_path / "grpo.py").read_text()
    heading = source.index("\n", source.index("# =====", source.index("# YOUR TASK")))
    end = source.index("# ==========", source.index("return template_messages"))
    (tmp_path / "grpo.py").write_text(source[:heading + 1] + ROWS_AS_WRITTEN + source[end:])
    rows = [{"letters": "".join(reversed(w)), "answer": i, "solution": "def f(): return 1",
             "sorted": sorted(w)} for i, w in enumerate(["cab", "dcba", "fed", "hg", "ji"] * 4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", REWARD_LOG=str(tmp_path / "calls.jsonl"))
    result = subprocess.run([sys.executable, "grpo.py", "--dataset", "data.jsonl", "--steps", "1",
                             "--prompts_per_step", "2", "--group_size", "2", "--rollout", "hf",
                             "--out", "run"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("recipe: the toy task's, for its model (toy/model): "
                                    "--template plain --lr 0.0003 --max_tokens 24 "), result.stdout
    handed = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert {json.dumps(r) for r in handed} == {json.dumps(r) for r in rows}
    assert all(type(r["answer"]) is int for r in handed)
    args = json.load(open(tmp_path / "run" / "config.json"))["args"]
    assert (args["lr"], args["max_tokens"], args["eval_every"]) == (3e-4, 24, 10)
