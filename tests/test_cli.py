"""grpo.py from the command line: bad input fails fast with one line and exit code 2, the toy trains end to end,
and an interrupted run resumed with --resume continues at the right step with the same data order."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts_per_step", "8", "--group_size", "4", "--eval_n", "16"]


def run(args, script="grpo.py", timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture
def bad_jsonl(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    return tmp_path


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "--model '/no/such/model': no model folder there"),
    (["--dataset", "no_such_set"], "--dataset 'no_such_set' is neither a known name"),
    (["--dataset", "{tmp}/bad.jsonl"], "bad.jsonl: line 2 is not valid JSON"),
    (["--dataset", "{tmp}/empty.jsonl"], "empty.jsonl: no rows"),
    (["--group_size", "1"], "--group_size 1 has no unbiased std"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--prompts_per_step", "0"], "--prompts_per_step must be at least 1"),
    (["--save_every", "0"], "--save_every must be at least 1"),
    (["--loss_agg", "sum"], "invalid choice: 'sum'"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--resume", "{tmp}/nothing"], "no checkpoint there"),
    (["--grad_clip=-1"], "--grad_clip must be >= 0"),
    (["--grad_clip", "nan"], "--grad_clip must be >= 0"),
    (["--steps", "2000000"], "--steps must be below 1048576"),
    (["--weight_decay=-0.1"], "--weight_decay must be >= 0"),
    (["--adv_eps=-1e-4"], "--adv_eps must be >= 0"),
    (["--warmup_steps=-5"], "--warmup_steps must be >= 0"),
    (["--eps_low", "1"], "--eps_low must be < 1"),
    (["--tis_cap", "0.5"], "--tis_cap caps pi_trainer / pi_engine"),
    (["--vllm_gpu_memory", "1.5"], "--vllm_gpu_memory is a fraction"),
    (["--seed=-1"], "--seed must be in [0, 524288)"),
    (["--prompts_per_step", "100000", "--group_size", "200"], "at most 16777215 rollouts per step"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad_jsonl, args, message):
    out = bad_jsonl / "out"
    result = run([a.replace("{tmp}", str(bad_jsonl)) for a in args] + ["--out", str(out)])
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert not out.exists()


def test_help_explains_every_flag():
    result = run(["--help"])
    assert result.returncode == 0
    import grpo
    from dataclasses import fields
    for f in fields(grpo.Args):
        assert f"--{f.name}" in result.stdout and f.metadata["help"].split()[0] in result.stdout


def test_toy_end_to_end_then_resume_after_a_kill(tmp_path):
    """A run killed mid-way resumes at its last checkpoint: every step logged once, same prompts as uninterrupted."""
    out = str(tmp_path / "run")
    args = SMALL + ["--steps", "5", "--save_every", "2", "--eval_every", "2", "--out", out]
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "grpo.py"), *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # kill once step 3 is logged: the checkpoint is at step 2
        if os.path.exists(os.path.join(out, "metrics.jsonl")) and any(r["step"] >= 3 for r in rows(out)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.2)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read()[-3000:]
    assert json.load(open(os.path.join(out, "config.json")))["args"]["steps"] == 5
    result = run(["--resume", out])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(out)
    train = [r["step"] for r in logged if "reward_mean" in r]
    evals = [r["step"] for r in logged if "eval_accuracy" in r]
    assert train == [1, 2, 3, 4, 5] and evals == [0, 2, 4, 5]
    needed = {"step", "reward_mean", "loss", "rollout_s", "update_s", "kl", "grad_norm", "tokens_per_s", "truncated",
              "zero_std_groups", "verify_timeouts"}
    assert needed <= set(logged[1]) and all(0 <= r["reward_mean"] <= 1 for r in logged if "reward_mean" in r)
    if json.load(open(os.path.join(out, "config.json")))["engine"] == "VLLMEngine":  # only vLLM reports its log-probs
        assert logged[1]["mismatch_logp"] < 1e-3  # vLLM and the trainer agree in fp32
    else:
        assert "mismatch_logp" not in logged[1]
    import torch
    state = torch.load(os.path.join(out, "checkpoint", "state.pt"), weights_only=True)
    assert state["step"] == 5 and state["cursor"] == 5 * 8
    assert os.path.exists(os.path.join(out, "checkpoint", "model", "model.safetensors"))
    assert "nothing to do" in run(["--resume", out]).stdout


def test_hf_rollout_fallback_runs(tmp_path):
    out = str(tmp_path / "hf")
    result = run(SMALL + ["--rollout", "hf", "--steps", "2", "--eval_every", "0", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1, 2] and "mismatch_logp" not in logged[1]
    assert json.load(open(os.path.join(out, "config.json")))["engine"] == "HFEngine"


def test_hub_ids_fail_fast_without_network(tmp_path):
    """Offline (as here, and as HF_HUB_OFFLINE=1 says), a hub model or dataset is one line naming the way out,
    without the half minute of huggingface_hub's retries (the message is only written when hub_offline() said so)."""
    cache = tmp_path / "empty-hf-cache"  # nothing cached, whatever this machine's own cache holds
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(cache), "HF_DATASETS_CACHE": str(cache / "datasets")}
    for args, what in [(["--model", "Qwen/Qwen2.5-0.5B-Instruct"], "--model 'Qwen/Qwen2.5-0.5B-Instruct'"),
                       (["--dataset", "math500"], "could not load HuggingFaceH4/MATH-500")]:
        result = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), *args, "--out", str(tmp_path / "o")],
                                capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **env})
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
        assert what in lines[0] and "cannot be reached" in lines[0] and "local" in lines[0], lines[0]
        assert not (tmp_path / "o").exists()


def test_resume_refuses_a_tampered_state_file(tmp_path):
    """state.pt is read with torch.load(weights_only=True): a pickle that would run code is refused, one line."""
    out = tmp_path / "run"
    result = run(SMALL + ["--rollout", "hf", "--steps", "1", "--eval_every", "0", "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    import torch
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)  # what the code wrote loads safely
    assert state["step"] == 1 and set(state["rng"]) == {"python", "numpy", "torch"}

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    torch.save({**state, "extra": Payload()}, out / "checkpoint" / "state.pt")
    result = run(["--resume", str(out), "--steps", "2"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "is not a checkpoint this code wrote" in lines[-1], result.stderr[-2000:]
    assert not (tmp_path / "pwned").exists()
