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
