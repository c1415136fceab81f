"""A method is two files: `<method>.py` and `common.py`, copied into an empty folder, run on the toy (with `toy/`
beside them) and on a model and dataset of one's own (without it); nothing else of the repository is imported."""
import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
SMALL = {"grpo": [], "two_grpo": [], "cppo": ["--pruning", "0.5"], "dppo": [], "mmr_grpo": []}


def run_copy(folder, method, flags):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, f"{method}.py", "--steps", "1", "--prompts_per_step", "2", "--group_size",
                           "2", "--eval_n", "4", "--rollout", "hf", *SMALL[method], *flags, "--out", "run"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("method", METHODS)
def test_a_method_runs_from_two_copied_files(method, tmp_path, tiny_dir):
    toy = tmp_path / "with_toy"
    toy.mkdir()
    for name in (f"{method}.py", "common.py"):
        shutil.copy(os.path.join(REPO, name), toy)
    shutil.copytree(os.path.join(REPO, "toy"), toy / "toy", ignore=shutil.ignore_patterns("chains"))
    result = run_copy(toy, method, [])
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.load(open(toy / "run" / "config.json"))["args"]["model"] == str(toy / "toy" / "model")

    own = tmp_path / "own"
    own.mkdir()
    for name in (f"{method}.py", "common.py"):
        shutil.copy(os.path.join(REPO, name), own)
    rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 16) for b in (20, 30)]
    (own / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extra = ["--embed_model", tiny_dir] if method == "mmr_grpo" else []
    result = run_copy(own, method, ["--model", tiny_dir, "--dataset", "data.jsonl", *extra])
    assert result.returncode == 0, result.stderr[-2000:]
    assert set(os.listdir(own)) - {"__pycache__"} == {"common.py", "data.jsonl", f"{method}.py", "run"}
    metrics = [json.loads(line) for line in open(own / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1]
