"""The five scripts side by side: one command, on any machine, writes docs/results.md and its plots.

Three parts (--parts picks):
  step       (this file) the training update alone: packed micro-batches (common.policy_update)
             against right-padded ones doing the same work (same gradient, tests/test_bench.py),
             tokens/s and, on a GPU, peak memory and model-FLOPs utilisation (6 N tokens / time / the
             bf16 matmul peak measured in the same run), on a model built from a config with random
             weights (--shape) and a configurable length mix (--lengths);
  breakdown  (compare.py) a few steps of each method at matched settings (the same Q questions x G
             completions sampled per step, the same mu, beta, learning rate and aggregation), split
             into the phases each script logs, as ratios to GRPO next to the ratio its config.json
             promises (ideal_trained_fraction);
  learning   (compare.py) each method's default command on each built-in task (--datasets: toy,
             chains), from the same base model, for each seed: greedy held-out accuracy against
             steps and against training wall-clock, the time, steps and rollouts each method
             needed to reach --target, and (chains) accuracy by chain length before and after.
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
import datetime
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from tqdm import tqdm

import compare
from common import (REPO, TOY_MODEL, Sample, autocast, chunked_logprobs, lm_head_weight,
                    make_optimizer, pack_microbatches, policy_update, token_coefficients, token_loss)
from plumbing import die
from varlen import attention_kernel, register_varlen

SHAPES = {  # Qwen2.5 configs; toy = toy/model
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936),
}
LENGTHS = {  # (prompt mean, prompt std, completion median, completion log-std, completion cap), tokens
    "toy": (19, 1, 9, 0.1, 24),
    "gsm8k": (130, 25, 200, 0.5, 1024),  # CPPO's system prompt + a GSM8K question; Qwen2.5-1.5B-like
}
PARTS = ["step", "breakdown", "learning"]

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


def synthetic_samples(n, lengths, vocab, seed=0):
    """n rollouts of random tokens whose lengths follow the LENGTHS mix, with N(0, 1) advantages."""
    p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
    rng = np.random.default_rng(seed)
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
    mixes = args.lengths or (["toy", "gsm8k"] if args.shape == "toy" else ["gsm8k"])
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
# The command line (the flags of parts 2 and 3 are compare.py's) and the run


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
      "deleted at the end)")
    # 1. the training step
    a("--shape", default="toy", help=f"model shape for the step part: toy | {' | '.join(SHAPES)} | "
      "a model folder (its config only; random weights)")
    a("--lengths", nargs="+", default=None, choices=list(LENGTHS), help="length mixes of the step "
      "part (default: toy and gsm8k for the toy shape, else gsm8k)")
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
    compare.add_flags(p)  # 2. and 3. the scripts
    args = p.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick and args.budgets is None and not torch.cuda.is_available():
        args.budgets = [512, 4096]
    compare.fill_defaults(args)
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
    compare.check(args)
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
        results = compare.run_scripts(args, runs)
        number = 1 + ("step" in args.parts)
        for dataset in args.datasets:
            sections = []
            if "breakdown" in args.parts:
                sections.append(compare.breakdown_section)
            if "learning" in args.parts:
                sections += [compare.learning_section, compare.by_length_section]
            for section in sections:
                got = section(args, dataset, number, results, figures, plt)
                number += bool(got)
                lines += got
        minutes = (time.time() - started) / 60
        header = compare.report_header(command, minutes, device, results, args.rollout)
        compare.write_results(args.out, header + lines, figures)
    finally:
        if not args.runs:
            shutil.rmtree(runs, ignore_errors=True)
    plots = os.path.join(args.out, "results")
    print(f"wrote {os.path.join(args.out, 'results.md')} and {len(figures)} plots in {plots}")


if __name__ == "__main__":
    main()
