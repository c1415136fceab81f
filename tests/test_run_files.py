"""common.py's run files: the phase timer, flag parsing (recipe defaults, a script's recipe, bool
spellings, the resume merge) and the per-batch metrics."""
import collections
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from conftest import snapshot

import common
from common import DATASETS, RECIPE, PhaseTimer, Sample, arg, batch_metrics, parse_args


def test_phase_timer_adds_up_each_phase_and_the_whole_step(monkeypatch):
    """Phases do not nest: each `with timer(name)` adds its seconds to name_s; step_s is everything
    since the timer was made, so the phases sum to at most step_s (the rest is outside every
    phase)."""
    now = [0.0]
    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    timer = PhaseTimer()
    with timer("rollout"):
        now[0] += 3.0
    with timer("reward"):
        now[0] += 0.5
    with timer("update"):
        now[0] += 3.0
    with timer("reward"):  # a phase entered twice adds up
        now[0] += 0.5
    now[0] += 0.75  # outside every phase: only in step_s
    seconds = timer.seconds()
    assert seconds == {"rollout_s": 3.0, "reward_s": 1.0, "update_s": 3.0, "step_s": 7.75}
    assert sum(v for k, v in seconds.items() if k != "step_s") <= seconds["step_s"]
    assert PhaseTimer().seconds() == {"step_s": 0.0}  # no phase yet: step_s only


@dataclass
class Flags:  # the shared flags parse_args and check_flags read; the recipe's own default None,
    # as recipe_arg gives
    dataset: str = arg("toy", "dataset")
    out: str = arg("", "output")
    resume: str = arg("", "resume")
    seed: int = arg(0, "seed")
    rollout: str = arg("hf", "engine", choices=["auto", "vllm", "hf"])
    model: str = arg(None, "model")
    prompts_per_step: int = arg(None, "B")
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
    grad_ckpt: bool = arg(None, "checkpointing")
    attn: str = arg("varlen", "attention", choices=["varlen", "flash_attention_2", "sdpa", "eager"])
    shared_prompt: bool = arg(True, "one prompt per group")
    eval_every: int = arg(None, "eval")
    eval_n: int = arg(None, "eval n")
    save_every: int = arg(50, "save")
    lora_r: int = arg(0, "LoRA rank")
    lora_alpha: float = arg(None, "LoRA scale")
    report_to: str = arg("none", "tracker")
    floor: bool = arg(True, "a default-on switch")
    ckpt: bool = arg(None, "a switch whose default is decided later")


RECIPE_KEYS = ("model", "template", "prompts_per_step", "lr", "max_tokens", "steps", "eval_every",
               "eval_n")


def test_the_recipe_follows_the_model_and_says_which_it_took(tmp_path, capsys):
    """The recipe of the flags not given follows the model: the toy's model takes the toy's recipe
    whatever the data (a file of one's own, GSM8K), the chains model the chains', any other model
    RECIPE (sized for 1.5B); the dataset gives its template. The first line says which, and why,
    with the values it filled; a flag given wins."""
    out = ["--out", str(tmp_path / "o")]
    toy = tuple(DATASETS["toy"][k] for k in RECIPE_KEYS)
    args = parse_args(Flags, "m", "", argv=["--seed", "3", "--no_floor", *out])
    assert (isinstance(args, Flags)
            and (args.seed, args.floor, args.out) == (3, False, str(tmp_path / "o")))
    assert tuple(getattr(args, k) for k in RECIPE_KEYS) == toy
    assert (args.lr, args.max_tokens, args.steps) == (3e-4, 24, 40)
    said = capsys.readouterr().out.splitlines()
    assert said[0] == ("recipe: the toy task's, for its model (toy/model): --template plain "
                       "--prompts_per_step 32 --lr 0.0003 --max_tokens 24 --steps 40 "
                       "--eval_every 10 --eval_n 200 (each a flag)"), said
    # a local folder with the default model, the toy's: the toy's recipe
    args = parse_args(Flags, "m", "", argv=["--dataset", str(tmp_path), *out])
    assert tuple(getattr(args, k) for k in RECIPE_KEYS) == toy
    # GSM8K with the toy's model: the toy's recipe, GSM8K's template
    args = parse_args(Flags, "m", "", argv=["--dataset", "gsm8k", *out])
    assert (args.lr, args.max_tokens, args.template) == (3e-4, 24, "cppo_gsm8k")
    # the chains model on a file of one's own: the chains recipe
    chains = DATASETS["chains"]["model"]
    args = parse_args(Flags, "m", "", argv=["--dataset", str(tmp_path), "--model", chains, *out])
    assert (args.lr, args.max_tokens, args.steps) == (3e-4, 200, 80)
    # any other model: RECIPE
    capsys.readouterr()
    args = parse_args(Flags, "m", "", argv=["--dataset", str(tmp_path), "--model", "Qwen/Q", *out])
    assert tuple(getattr(args, k) for k in RECIPE_KEYS) == ("Qwen/Q",) + tuple(
        RECIPE[k] for k in RECIPE_KEYS[1:])
    assert (args.lr, args.max_tokens, args.template) == (1e-6, 1024, "plain")
    assert capsys.readouterr().out.startswith("recipe: sized for a 1.5B model on one GPU, for a "
                                              "model that is no built-in task's (Qwen/Q): ")
    # an explicit flag wins
    args = parse_args(Flags, "m", "", argv=["--lr", "0.5", "--max_tokens", "7", *out])
    assert (args.lr, args.max_tokens, args.steps) == (0.5, 7, 40)
    assert "--lr" not in capsys.readouterr().out


def test_parse_args_resolves_the_defaults_decided_later(tmp_path, monkeypatch):
    args = parse_args(Flags, "m", "", argv=["--out", str(tmp_path / "o")])
    cuda = torch.cuda.is_available()
    assert args.grad_ckpt is cuda and args.token_budget == (16384 if cuda else 4096)
    assert parse_args(Flags, "m", "",
                      argv=["--attn", "sdpa", "--out", str(tmp_path / "o")]).token_budget == 512
    assert parse_args(Flags, "m", "",
                      argv=["--grad_ckpt", "true", "--out", str(tmp_path / "o")]).grad_ckpt is True
    monkeypatch.chdir(tmp_path)  # the default --out is made in the working folder
    args = parse_args(Flags, "m", "", argv=["--dataset", str(tmp_path / "mine") + "/"])
    assert args.out.startswith("runs/m-mine-")  # runs/<method>-<dataset>-<time>
    assert os.path.isdir(tmp_path / args.out)  # made before anything loads


@dataclass
class OwnDefault(Flags):
    prompts_per_step: int = arg(4, "B: this script's own default, as cppo.py's 8")


def test_the_recipe_leaves_a_scripts_own_default_alone(tmp_path):
    """The recipe fills the flags whose default is None (recipe_arg); a flag with a default of its
    own keeps it, as --help says (cppo.py: --prompts_per_step 8)."""
    args = parse_args(OwnDefault, "m", "", argv=["--out", str(tmp_path / "o")])
    assert args.prompts_per_step == 4 and args.lr == DATASETS["toy"]["lr"]


def test_a_scripts_recipe_reads_the_first_parse_and_loses_to_an_explicit_flag(tmp_path):
    seen = []

    def recipe(first):  # as two_grpo.pair_recipe: lr from the B given (None when not given)
        seen.append(dict(first))
        return {"lr": 1e-3 * (first["prompts_per_step"] or 32), "steps": 3}
    out = ["--out", str(tmp_path / "o")]
    args = parse_args(Flags, "m", "", recipe=recipe, argv=["--prompts_per_step", "8", *out])
    # the command line alone
    assert seen[-1]["prompts_per_step"] == 8 and seen[-1]["lr"] is None
    # the script's recipe over the dataset's
    assert (args.prompts_per_step, args.lr, args.steps) == (8, 8e-3, 3)
    args = parse_args(Flags, "m", "", recipe=recipe, argv=out)
    assert (args.prompts_per_step, args.lr) == (DATASETS["toy"]["prompts_per_step"], 32e-3)
    args = parse_args(Flags, "m", "", recipe=recipe,
                      argv=["--prompts_per_step", "8", "--lr", "0.5", "--steps=9", *out])
    assert (args.prompts_per_step, args.lr, args.steps) == (8, 0.5, 9)


def test_bool_flags_take_every_spelling(tmp_path):
    out = ["--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        parse_args(Flags, "m", "", argv=["--floor", "maybe", *out])
    spellings = {"": (True, None), "--no-floor --ckpt": (False, True),
                 "--floor false --ckpt no": (False, False),
                 "--no_floor --ckpt=false": (False, False), "--floor=yes --ckpt true": (True, True)}
    for argv, want in spellings.items():
        args = parse_args(Flags, "m", "", argv=argv.split() + out)
        assert (args.floor, args.ckpt) == want, argv


def test_abbreviations_are_refused(tmp_path, capsys):
    """allow_abbrev=False: '--prompts' would otherwise be taken for --prompts_per_step."""
    with pytest.raises(SystemExit) as e:
        parse_args(Flags, "m", "", argv=["--prompts", "3", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == ["error: unrecognized arguments: --prompts 3"]


def test_resume_takes_the_saved_flags_and_a_flag_given_again_wins(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "checkpoint-3" / "state.pt").write_bytes(b"")  # parse_args only looks for it
    saved = {"seed": 7, "lr": 1e-3, "steps": 9, "out": "elsewhere", "floor": False,
             "prompts_per_step": 5, "token_budget": 777, "grad_ckpt": True, "not_a_flag_here": 1}
    (run / "config.json").write_text(json.dumps({"args": saved, "method": "m"}))
    args = parse_args(Flags, "m", "", argv=["--resume", str(run), "--steps", "12"])
    assert (args.seed, args.lr, args.steps, args.out, args.resume) == (
        7, 1e-3, 12, str(run), str(run))
    assert (args.floor, args.prompts_per_step, args.token_budget, args.grad_ckpt) == (
        False, 5, 777, True)


@pytest.mark.parametrize("config", ["{not json", '{"no_args": 1}', None])
def test_resume_with_an_unreadable_config_is_one_line(tmp_path, capsys, config):
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "checkpoint-3" / "state.pt").write_bytes(b"")
    if config is not None:
        (run / "config.json").write_text(config)
    with pytest.raises(SystemExit) as e:
        parse_args(Flags, "m", "", argv=["--resume", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --resume {str(run)!r}: its config.json cannot be read"), err


def test_batch_metrics_by_hand():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])  # [Q, G]: the second group is tied
    samples = [Sample([1, 2], [5, 9]), Sample([1, 2], [5]), Sample([3], [6, 6, 6]), Sample([3], [])]
    counts = collections.Counter(timeout=1, error=0, no_answer=2, capped=3, math_scored=4)
    m = batch_metrics(rewards, samples, stop_ids=[9], counts=counts)
    assert m["reward_mean"] == 0.75 and m["zero_std_groups"] == 0.5
    assert m["reward_std"] == pytest.approx(0.1875 ** 0.5)  # population std of 1, 0, 1, 1
    assert m["completion_len"] == 6 / 4 and m["tokens"] == 4 + 3 + 4 + 1
    # [5] and [6, 6, 6] end without a stop token; [] is not truncated
    assert m["truncated"] == 2 / 4
    outcomes = (m["verify_timeouts"], m["verify_errors"], m["no_answer"], m["reward_capped"])
    assert outcomes == (1, 0, 2, 3)
    # a reward of one's own (math_reward never scored): the math reward's outcomes are not logged
    mine = batch_metrics(rewards, samples, [9], collections.Counter(capped=3))
    assert mine.keys() == m.keys() - {"verify_timeouts", "verify_errors", "no_answer"}
    math = common.score(["<answer>47</answer>"], [EX], lambda text, row: common.math_reward(
        text, row["answer"]))
    assert math == ([1.0], {"math_scored": 1})


# ---------------------------------------------------------------- reward() and prompt(), safely

ROW = {"question": "What is 12 + 35?" + " and more" * 20, "answer": "47"}
WHERE = "data.jsonl line 3 (train split)"
# a row as the run holds it: the file's row, where it is, its prompt's token ids
EX = {"row": ROW, "where": WHERE, "prompt_ids": [5, 6, 7]}


def refused_reward(capsys, returns):
    """The one stderr line of score() over a reward() that `returns` (a callable: it is called)."""
    def reward(text, row):
        return returns()
    with pytest.raises(SystemExit) as stop:
        common.score(["right", "wrong"], [EX, EX], reward)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    return err[0], reward.__code__.co_firstlineno


def test_a_partial_or_a_callable_object_as_reward_is_named_too(capsys):
    """A reward made with functools.partial, or an object with a __call__, that returns no number:
    the same one line, naming the file and line of the function behind it."""
    import functools

    def scaled(text, row, factor):
        return None

    class Reward:
        def __call__(self, text, row):
            return None
    for fn, first in ((functools.partial(scaled, factor=2), scaled.__code__.co_firstlineno),
                      (Reward(), Reward.__call__.__code__.co_firstlineno)):
        with pytest.raises(SystemExit):
            common.score(["a"], [EX], fn)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"(test_run_files.py:{first}), on {WHERE}" in err[0], err


@pytest.mark.parametrize("returns,shown", [
    (lambda: None, "None"), (lambda: math.nan, "nan"), (lambda: math.inf, "inf"),
    (lambda: "1", "'1'"), (lambda: True, "True"), (lambda: torch.tensor([1.0, 0.0]),
                                                   "tensor([1., 0.])"),
    (lambda: torch.tensor(True), "True"), (lambda: np.array([0.5]), "array([0.5])"),
])
def test_a_reward_that_returns_no_finite_number_is_one_line(capsys, returns, shown):
    """Not a finite real number: one line naming reward(), what it returned, its def line and the
    row (its index, its first 80 characters, not our prompt_ids); NaN is no longer 'unread'."""
    line, first = refused_reward(capsys, returns)
    assert line.startswith(f"error: reward() returned {shown}, not a finite number "
                           f"(test_run_files.py:{first}), on {WHERE}: "), line
    assert line.endswith(f"on {WHERE}: {str(ROW)[:80].strip()}"), line


def test_a_reward_that_raises_is_one_line_naming_its_line(capsys):
    """An exception: one line naming it and the user's line it left from, here through a library
    (json's own frames are not the user's)."""
    def reward(text, row):
        return json.loads(row["question"])
    with pytest.raises(SystemExit) as stop:
        common.score(["a"], [EX], reward)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("error: reward() raised JSONDecodeError('Expecting value: line 1 "
                             "column 1 (char 0)') (test_run_files.py:"
                             f"{reward.__code__.co_firstlineno + 1}), on {WHERE}: "), err


@pytest.mark.parametrize("value", [1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.5),
                                   torch.tensor([0.75], dtype=torch.float64)])
def test_a_reward_may_return_any_finite_real_number(value):
    rewards, counts = common.score(["a"], [EX], lambda text, row: value)
    assert rewards == [float(value)] and isinstance(rewards[0], float) and not counts


def test_a_slow_reward_call_is_capped_and_the_steps_budget_holds():
    """A call past its limit is stopped and counted as capped (NaN); the step's budget caps each
    call at what is left of it, so one slow call cannot stall the step; past it, no call runs."""
    calls = []

    def slow(text, row):
        calls.append(text)
        time.sleep(30 if text == "slow" else 0)
        return 1.0
    t0 = time.monotonic()
    rewards, counts = common.score(["slow", "fast"], [EX, EX], slow, timeout=0.2)
    assert math.isnan(rewards[0]) and rewards[1] == 1.0 and counts["capped"] == 1
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    rewards, counts = common.score(["slow"] * 3, [EX] * 3, slow, timeout=10.0, budget=0.3)
    assert all(math.isnan(r) for r in rewards) and counts["capped"] == 3
    assert time.monotonic() - t0 < 1.0 and calls[2:] == ["slow"]  # the other two: never called
    # a call that swallows each alarm and returns late is capped all the same
    rewards, counts = common.score(["a"], [EX], lambda text, row: swallowing(0.3, BaseException)
                                   or 1.0, timeout=0.1)
    assert math.isnan(rewards[0]) and counts["capped"] == 1


def test_in_another_thread_a_call_runs_unstopped_but_the_budget_holds():
    """No signal reaches another thread: there a call runs to its end, and the step's budget is
    checked between calls (score's tally is per thread)."""
    def slow(text, row):
        time.sleep(0.2)
        return 1.0
    out = []
    worker = threading.Thread(target=lambda: out.append(common.score(["a"] * 5, [EX] * 5, slow,
                                                                     timeout=0.1, budget=0.3)))
    worker.start()
    worker.join()
    rewards, counts = out[0]
    assert rewards[:2] == [1.0, 1.0] and all(math.isnan(r) for r in rewards[2:])
    assert counts["capped"] == 3


def busy(seconds):
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        pass


def swallowing(seconds, error=common.VerifyTimeout):
    """Busy for `seconds`, swallowing every `error` (as code that catches BaseException)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            busy(seconds)
        except error:
            pass


def test_time_limits_nest():
    """An inner time_limit (math_reward's, inside a reward() under --reward_timeout) neither
    cancels the outer one when it ends, nor swallows it when it expires inside: the outer's error
    is raised through the inner's own handler, after an inner that caught its own, and through an
    inner whose code swallows every one of its own."""
    for inner in ("ends early", "expires outside", "caught", "swallowed"):
        t0 = time.monotonic()
        with pytest.raises(common.CallTimeout):
            with common.time_limit(0.3, common.CallTimeout):
                try:
                    with common.time_limit(5.0 if inner == "expires outside" else 0.1):
                        if inner == "swallowed":
                            swallowing(3)
                        busy(0 if inner == "ends early" else 3)
                except common.VerifyTimeout:  # as math_reward catches its own
                    assert inner == "caught"
                busy(3)
        assert time.monotonic() - t0 < 1.0, inner
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)  # and no timer left running
    with common.time_limit(0.05):  # a block that ends in time raises nothing
        pass


def test_a_prompt_that_fails_is_one_line(capsys):
    """prompt() that raises, or returns no list of {"role", "content"}: one line, exit 2."""
    def prompt(row, template):
        return row["missing"] if template == "raise" else template
    first = prompt.__code__.co_firstlineno
    for template, what in [("raise", f"raised KeyError('missing') (test_run_files.py:{first + 1})"),
                           ("a string", "returned 'a string', not a list of {'role', 'content'} "
                                        "messages whose values are strings "
                                        f"(test_run_files.py:{first})"),
                           ([], "returned [], not a list of")]:
        with pytest.raises(SystemExit) as stop:
            common.prompt_token_ids(None, [EX], prompt, template, 100)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: prompt() {what}"), err
        assert f", on {WHERE}: {{'question': 'What is 12 + 35?" in err[0], err


def test_out_is_made_before_loading_and_taken_back_by_a_refusal(tmp_path, monkeypatch, capsys):
    """--out is made and a file written in it at parse time (os.access says yes to root under
    /proc); a run stopped by a check before its first evaluation has passed takes back the folder
    it made, and leaves a folder that was there as it was (the run writes nothing in it before)."""
    out = tmp_path / "a" / "b"
    args = parse_args(Flags, "m", "", argv=["--out", str(out)])
    assert os.path.isdir(out) and os.listdir(out) == [] and args.out == str(out)
    with pytest.raises(SystemExit):
        common.die("a check after the folder was made")
    assert not (tmp_path / "a").exists()  # every folder the run made
    parse_args(Flags, "m", "", argv=["--out", str(out)])
    with pytest.raises(SystemExit):  # a later run in this process (a resume) has its own --out
        parse_args(Flags, "m", "", argv=["--resume", str(tmp_path / "no_run")])
    assert os.path.isdir(out)
    shutil.rmtree(tmp_path / "a")
    mine = tmp_path / "mine"  # an empty folder of the user's: used, and left there
    mine.mkdir()
    parse_args(Flags, "m", "", argv=["--out", str(mine)])
    with pytest.raises(SystemExit):
        common.die("a check")
    assert os.path.isdir(mine) and os.listdir(mine) == []
    # a folder that takes no file (as /sys may, to root) is one line, and is taken back
    monkeypatch.setattr(common.tempfile, "TemporaryFile", lambda dir: open(dir))
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_args(Flags, "m", "", argv=["--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {str(out)!r} cannot be written (Is a directory)"], err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("holds", ["a model", "a dataset", "a home folder", "another config.json"])
def test_an_out_that_holds_anything_but_a_run_is_refused_and_left_byte_identical(
        tmp_path, tiny_dir, capsys, holds):
    """--out is a new or empty folder, or a run of this code (refused with --resume's advice,
    tests/test_cli.py): a folder holding a model, a dataset, dot files or another program's
    config.json is refused with one line, exit 2, before anything loads, and stays as it was."""
    folder = tmp_path / "theirs"
    if holds == "a model":
        shutil.copytree(tiny_dir, folder)
    else:
        folder.mkdir()
        name, text = {"a dataset": ("train.jsonl", '{"question": "q", "answer": "1"}\n'),
                      "a home folder": (".bashrc", "alias ll='ls -l'\n"),
                      "another config.json": ("config.json", '{"method": "sgd", "lr": 1}')}[holds]
        (folder / name).write_text(text)
    before = snapshot(folder)
    with pytest.raises(SystemExit) as stop:
        parse_args(Flags, "m", "", argv=["--out", str(folder)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --out {str(folder)!r} holds files that are not a run of "
                             "this code"), err
    assert snapshot(folder) == before


@pytest.mark.parametrize("value", [1e39, -3.5e38, float(np.float64(1e300))])
def test_a_reward_outside_float32s_range_is_one_line_naming_the_row(capsys, value):
    """A finite reward too big for float32 would be inf in the trainer's rewards tensor, and NaN in
    every weight: refused where it is returned, naming the row. float32's largest is paid."""
    line, first = refused_reward(capsys, lambda: value)
    assert line.startswith(f"error: reward() returned {value!r}, outside float32's range "
                           f"(|r| <= 3.4e+38) (test_run_files.py:{first}), on {WHERE}: "), line
    largest = float(torch.finfo(torch.float32).max)
    assert common.score(["a"], [EX], lambda text, row: -largest)[0] == [-largest]


def test_a_prompt_must_give_string_messages_the_template_takes_in_time(capsys, tiny_dir):
    """prompt()'s messages are checked as reward()'s value is: a content that is None or a number,
    a role the chat template leaves out (Qwen2.5's drops an unknown one silently, as this one
    does), or a call past --reward_timeout: one line naming prompt(), its line and the row, exit
    2."""
    tokenizer = common.load_tokenizer(tiny_dir)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant'] %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def prompt(row, template):
        if template == "sleep":
            time.sleep(5)
        content = {"none": None, "number": 12, "role": "q"}.get(template, row["question"])
        return [{"role": "narrator" if template == "role" else "user", "content": content}]
    first = prompt.__code__.co_firstlineno
    for template, what in [("none", "returned [{'role': 'user', 'content': None}], not a list of "
                                    "{'role', 'content'} messages whose values are strings"),
                           ("number", "returned [{'role': 'user', 'content': 12}], not a list"),
                           ("role", "returned a 'narrator' message that the tokenizer's chat "
                                    "template leaves out"),
                           ("sleep", "took over --reward_timeout 0.2 s")]:
        start = time.perf_counter()
        with pytest.raises(SystemExit) as stop:
            common.prompt_token_ids(tokenizer, [EX], prompt, template, 100, timeout=0.2)
        assert time.perf_counter() - start < 2
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1, err
        assert err[0].startswith(f"error: prompt() {what}"), err
        assert f"(test_run_files.py:{first})" in err[0], err
        assert f", on {WHERE}: {{'question'" in err[0], err
    rows = common.prompt_token_ids(tokenizer, [EX], prompt, "plain", 10**6, timeout=0.2)
    assert tokenizer.decode(rows[0]["prompt_ids"]).count(ROW["question"]) == 1


@pytest.mark.parametrize("script", ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"])
def test_each_scripts_recipe_table_is_commons(script):
    """Each script shows the recipes above its flags, so that a reader of the flags needs no
    look-up: every value of that table is common's (DATASETS' toy and chains, RECIPE), every
    recipe flag is in it."""
    import re
    text = open(os.path.join(os.path.dirname(common.__file__), f"{script}.py")).read()
    rows = re.findall(r"^#   --(\w+) +(\S+) +(\S+) +(\S+)", text, re.M)
    recipes = (DATASETS["toy"], DATASETS["chains"], RECIPE)
    assert {flag for flag, *_ in rows} == set(RECIPE) - {"model", "template"}
    for flag, *values in rows:
        assert [float(v) for v in values] == [recipe[flag] for recipe in recipes], flag
