"""common.py's run files: the phase timer's exclusive phases, the run's plot, flag parsing (what was given, recipe
defaults, resume merge) and the per-batch metrics."""
import json
from dataclasses import dataclass

import pytest
import torch

import common
from common import PhaseTimer, Sample, arg, batch_metrics, flags_given, parse_args, plot_metrics


def test_phase_timer_phases_are_exclusive_and_add_up_to_the_step(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    timer = PhaseTimer()
    with timer("rollout"):
        now[0] += 2.0
        with timer("reward"):  # inside rollout (2-GRPO's resampling): counted once, as reward
            now[0] += 0.5
        now[0] += 1.0
    with timer("update"):
        now[0] += 3.0
        with timer("pack"):
            now[0] += 0.25
    with timer("reward"):  # a phase entered twice adds up
        now[0] += 0.5
    now[0] += 0.75  # outside every phase: only in step_s
    seconds = timer.seconds()
    assert seconds == {"rollout_s": 3.0, "reward_s": 1.0, "update_s": 3.0, "pack_s": 0.25, "step_s": 8.0}


def test_plot_metrics_writes_a_png_and_skips_a_cut_line(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.5}] + [{"step": s, "reward_mean": s / 10, "step_s": 1.0 + s}
                                                  for s in range(1, 5)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "rew'
    (tmp_path / "metrics.jsonl").write_text(text)
    plot_metrics(str(tmp_path))
    png = (tmp_path / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


@dataclass
class Flags:
    dataset: str = arg("toy", "dataset")
    out: str = arg("", "output")
    resume: str = arg("", "resume")
    seed: int = arg(0, "seed")
    rollout: str = arg("hf", "engine", choices=["auto", "vllm", "hf"])
    prompts_per_step: int = arg(4, "B")
    group_size: int = arg(2, "G")
    temperature: float = arg(1.0, "T")
    max_tokens: int = arg(None, "max tokens")
    max_prompt_len: int = arg(64, "prompt cap")
    template: str = arg(None, "template")
    vllm_gpu_memory: float = arg(0.3, "fraction")
    std_mode: str = arg("unbiased", "std")
    adv_eps: float = arg(1e-4, "eps")
    eps_low: float = arg(0.2, "clip")
    eps_high: float = arg(0.2, "clip")
    beta: float = arg(0.0, "kl")
    mu: int = arg(1, "mu")
    tis_cap: float = arg(0.0, "tis")
    steps: int = arg(None, "steps")
    lr: float = arg(None, "lr")
    warmup_steps: int = arg(0, "warm-up")
    weight_decay: float = arg(0.0, "wd")
    grad_clip: float = arg(1.0, "clip")
    token_budget: int = arg(None, "budget")
    logprob_chunk: int = arg(1024, "chunk")
    eval_every: int = arg(None, "eval")
    eval_n: int = arg(None, "eval n")
    save_every: int = arg(50, "save")
    floor: bool = arg(True, "a default-on switch")
    ckpt: bool = arg(None, "a switch whose default is decided later")


def test_parse_args_fills_the_recipe_and_reports_what_was_given(tmp_path):
    args, given = parse_args(Flags, "m", "", ["--seed", "3", "--no_floor", "--out", str(tmp_path / "o")])
    assert given == {"seed", "floor", "out"}
    assert (args.seed, args.floor, args.lr, args.max_tokens, args.steps) == (3, False, 3e-4, 24, 40)
    args, _ = parse_args(Flags, "m", "", ["--dataset", str(tmp_path), "--out", str(tmp_path / "o")])
    assert (args.lr, args.max_tokens, args.template) == (1e-6, 1024, "plain")  # a local folder: RECIPE
    with pytest.raises(SystemExit):
        parse_args(Flags, "m", "", ["--floor", "maybe"])
    out = ["--out", str(tmp_path / "o")]
    spellings = {"": (True, None), "--no-floor --ckpt": (False, True), "--floor false --ckpt no": (False, False),
                 "--no_floor --ckpt=false": (False, False)}
    for argv, want in spellings.items():
        args, given = parse_args(Flags, "m", "", argv.split() + out)
        assert (args.floor, args.ckpt) == want and given == {"out"} | ({"floor", "ckpt"} if argv else set())


def test_flags_given_reads_every_spelling_from_the_command_line():
    names = {"seed", "floor", "max_tokens", "prompts_per_step"}
    argv = ["--seed", "3", "--no-floor", "--max-tokens=24", "--prompts_per_step", "8", "--unknown", "x"]
    assert flags_given(argv, names) == names
    assert flags_given(["--no_floor"], names) == {"floor"} and flags_given(["3", "-h"], names) == set()
    assert flags_given(["--no_such"], names | {"no_such"}) == {"no_such"}  # a flag whose own name starts no_


def test_abbreviations_are_refused(tmp_path, capsys):
    """allow_abbrev=False: '--prompts' would otherwise be taken for --prompts_per_step (and be missed as given)."""
    with pytest.raises(SystemExit):
        parse_args(Flags, "m", "", ["--prompts", "3", "--out", str(tmp_path / "o")])
    assert "unrecognized arguments: --prompts 3" in capsys.readouterr().err


def test_resume_keeps_the_saved_flags_unless_given_again(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "state.pt").write_bytes(b"")
    (run / "config.json").write_text(json.dumps({"args": {"seed": 7, "lr": 1e-3, "steps": 9, "out": "elsewhere"}}))
    args, _ = parse_args(Flags, "m", "", ["--resume", str(run), "--steps", "12"])
    assert (args.seed, args.lr, args.steps, args.out) == (7, 1e-3, 12, str(run))


def test_batch_metrics_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # [Q, G]: the second group is tied
    samples = [Sample([1, 2], [5, 9]), Sample([1, 2], [5]), Sample([3], [6, 6, 6]), Sample([3], [])]
    counts = {"timeout": 1, "error": 0, "no_answer": 2}
    m = batch_metrics(rewards, samples, stop_ids=[9], reward_counts=counts)
    assert m["reward_mean"] == 0.75 and m["zero_std_groups"] == 0.5
    assert m["reward_std"] == pytest.approx(0.1875 ** 0.5)  # population std of 1, 0, 1, 1
    assert m["completion_len"] == 6 / 4 and m["tokens"] == 4 + 3 + 4 + 1
    assert m["truncated"] == 2 / 4  # [5] and [6, 6, 6] end without a stop token; [] is not truncated
    assert (m["verify_timeouts"], m["verify_errors"], m["no_answer"]) == (1, 0, 2)
