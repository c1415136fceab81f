"""DPPO: Dynamic Pruning Policy Optimization (Zhu et al. 2026, arXiv 2603.04135), reconstructed from
the abstract alone: docs/dppo.md marks what the paper states and what is ours. It is not Divergence
PPO (arXiv 2602.04879, verl's dppo_tv/dppo_kl losses) nor Diffusion Policy Policy Optimization
(arXiv 2409.00588). Relative to grpo.py:
  * prompts whose last group tied are skipped with probability r_q, their slots refilled;
  * after scoring, completions are pruned with keep probability ~ |A| (an expected fraction r_o);
  * what is kept weighs 1/pi over the unpruned batch's counts: GRPO's expected gradient;
  * the update packs with a window-based greedy packer.

Run:
    python dppo.py                                    # the built-in toy, CPU, about a minute
    python dppo.py --dataset chains                   # the second built-in task (2+ passes)
    python dppo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset math  # one 80 GB GPU with vLLM
"""
import math
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from common import (DATASETS, TEMPLATES, PhaseTimer, Sample, arg, batch_metrics, die, finish_step,
                    gold_answer, group_advantages, math_reward, parse_args, policy_update,
                    recipe_arg, rollout_seed, score, sequence_logprobs, setup, take_prompts,
                    template_messages, tied_groups, token_coefficients)

METHOD = "dppo"  # names the run, its bar and config.json


# ==================================================================================================
# YOUR TASK: what a completion earns, and how a question is asked. The one place to change for your
# own data (README.md#your-own-task); a row is one line of your .jsonl as you wrote it, every
# column and value unchanged. Your own imports go here, under this line.
# ==================================================================================================
METRIC = "accuracy"  # the held-out mean of reward(): "accuracy" while it pays 1 right, 0 wrong


def reward(completion, row):
    """A float for one completion's decoded text: 1.0 when math-verify finds its final answer
    equal to the row's reference, else 0.0. The reference: the 'answer' column (GSM8K's, the
    number after '####'), else the last \\boxed{} of a 'solution' column (MATH's)."""
    return math_reward(completion, gold_answer(row))


def prompt(row, template):
    """The chat messages that ask the row's 'question' (MATH's rows call it 'problem'):
    --template's system prompt and user message (common.TEMPLATES), or a list of {"role",
    "content"} of your own."""
    question = row["question"] if "question" in row else row["problem"]
    return template_messages(template, question)
# ==================================================================================================
# END OF YOUR TASK. Below: the method's flags, then its loop
# ==================================================================================================


# The flags whose default is recipe_arg's take it from the run's recipe, which follows the model
# (common.recipe_of, RECIPE; a run's first line says which it took, and every value is a flag):
#   flag                toy/model    toy/chains/model    any other model (1.5B on one GPU)
#   --prompts_per_step  32           16                  32
#   --lr                3e-4         3e-4                1e-6
#   --max_tokens        24           200                 1024
#   --steps             40           80                  0 (one pass over the training prompts)
#   --eval_every        10           10                  50
#   --eval_n            200          300                 500
# --model and --template are the dataset's (the toy's model otherwise; GSM8K's and MATH's prompt)
@dataclass
class Args:
    # what to train, where to write
    model: str = recipe_arg("model", "policy: a Hugging Face model folder or hub id")
    dataset: str = arg("toy", f"{' | '.join(DATASETS)} | a .jsonl file | a folder with train.jsonl "
                              "[+ val.jsonl] [+ test.jsonl]")
    out: str = arg("", "output folder", shown=f"runs/{METHOD}-<dataset>-<time>")
    resume: str = arg("", "continue the run in this output folder from its last checkpoint")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    # rollout
    rollout: str = arg("auto", "engine: vllm, hf (transformers), auto (vllm if installed)",
                       choices=["auto", "vllm", "hf"])
    prompts_per_step: int = recipe_arg("prompts_per_step", "B: prompts per step")
    group_size: int = arg(8, "G: completions sampled per prompt")
    temperature: float = arg(1.0, "sampling temperature (the trainer divides its logits by it too)")
    max_tokens: int = recipe_arg("max_tokens", "maximum completion length in tokens")
    max_prompt_len: int = arg(512, "prompts longer than this many tokens are dropped")
    template: str = recipe_arg("template", "prompt template (system prompt and answer format)",
                               choices=list(TEMPLATES))
    vllm_gpu_memory: float = arg(0.3, "GPU memory fraction vLLM holds (weights + KV cache)")
    # objective: docs/grpo.md
    std_mode: str = arg("unbiased", "advantage std: unbiased (ddof 1), population (ddof 0), none "
                                    "(Dr. GRPO)", choices=["unbiased", "population", "none"])
    adv_eps: float = arg(1e-4, "epsilon added to the group std")
    eps_low: float = arg(0.2, "clip the ratio below at 1 - eps_low")
    eps_high: float = arg(0.2, "clip the ratio above at 1 + eps_high (0.28 = DAPO's clip-higher)")
    beta: float = arg(0.04, "k3 KL coefficient to the frozen initial model (0 loads no reference)")
    mu: int = arg(1, "policy updates per rollout batch (> 1 adds an old-log-prob pass)")
    loss_agg: str = arg("seq_mean", "loss aggregation: seq_mean (GRPO), token_mean (DAPO), "
                                    "constant (Dr. GRPO)",
                        choices=["seq_mean", "token_mean", "constant"])
    tis_cap: float = arg(0.0, "truncated IS cap on pi_trainer/pi_engine per token (0 = off)")
    prune_prompts: float = arg(0.5, "r_q: probability of skipping a prompt whose last group had "
                                    "all-equal rewards")
    prune_completions: float = arg(0.5, "r_o: expected fraction of completions pruned (keep ~ |A|)")
    keep_floor: float = arg(0.1,
                            "smallest keep probability of a prompt or completion (1/pi <= 1/floor)")
    lookahead: float = arg(2.0, "refill pruned prompts from at most lookahead x B prompts per step")
    window: int = arg(64, "sequences the greedy packer looks ahead over to fill a micro-batch")
    # optimisation
    steps: int = recipe_arg("steps", "training steps (0 = one pass over the training prompts)")
    lr: float = recipe_arg("lr", "AdamW learning rate")
    lr_schedule: str = arg("constant", "after the warm-up: constant, or cosine decay to 10%",
                           choices=["constant", "cosine"])
    warmup_steps: int = arg(0, "linear learning-rate warm-up, in optimiser steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    grad_clip: float = arg(1.0, "clip the gradient norm to this (0 = no clipping)")
    token_budget: int = arg(None, "tokens per packed micro-batch (a longer sequence gets its own)",
                            shown="16384 on GPU, 4096 on CPU (512 with --attn sdpa or eager, whose "
                                  "mask is a dense [T, T])")
    logprob_chunk: int = arg(1024, "tokens per chunk of the memory-lean log-prob")
    grad_ckpt: bool = arg(None, "gradient checkpointing (true/false)", shown="on for GPU")
    lora_r: int = arg(0, "LoRA rank: train a low-rank adapter (peft) on frozen weights, the "
                         "reference is the policy with it off (0: every weight trains)")
    lora_alpha: float = arg(None, "LoRA scale: the adapter adds alpha / r B A", shown="2 x rank")
    attn: str = arg("varlen", "attention of a packed row: varlen (each sequence on its own: "
                              "bucketed sdpa on CPU, flash on GPU), flash_attention_2 (needs "
                              "flash-attn), sdpa or eager (a dense [T, T] mask)",
                    choices=["varlen", "flash_attention_2", "sdpa", "eager"])
    shared_prompt: bool = arg(True,
                              "each prompt once before its completions in a packed row (varlen "
                              "only: sdpa, eager, flash_attention_2 repeat it per completion)")
    # evaluation, checkpoints, logging
    eval_every: int = recipe_arg("eval_every", "greedy validation accuracy every N steps (0: start "
                                               "and end only); test accuracy once, at the end")
    eval_n: int = recipe_arg("eval_n", "validation problems per evaluation, test problems at "
                                       "the end (a folder's val.jsonl, else test.jsonl serves both;"
                                       " gsm8k, math: 500 from train, the whole test split)")
    save_every: int = arg(50, "checkpoint every N steps (and at the end); one holds the weights "
                              "and AdamW's state, 3x the fp32 model (LoRA: the adapter's)")
    report_to: str = arg("none", "also log each metrics.jsonl row to wandb or trackio",
                         choices=["none", "wandb", "trackio"])
    time_budget: float = arg(0.0, "end the run once its summed step times reach this many "
                                  "seconds (0: off)")
    reward_timeout: float = arg(10.0, "seconds one reward() call may take (a slower answer is "
                                      "left unread: reward_capped; 0 in evaluation), or one "
                                      "prompt() call (a slower one stops the run)")
    trust_remote_code: bool = arg(False, "allow model code from the hub (only if you trust it; "
                                         "packing needs it to honour position ids)")


def candidate_window(stream, history, B, r_q, floor, cap):
    """The examined prompts and their pi_q, fixed before any draw. docs/dppo.md#eq-refill"""
    pi = []
    for i in stream:  # until the pi_q sum to B, or `cap` prompts and then until they sum to 1
        pi.append(max(floor, 1.0 - r_q) if history.get(i) else 1.0)  # docs/dppo.md#eq-prompt-keep
        if sum(pi) >= B - 1e-9 or (len(pi) >= cap and sum(pi) >= 1 - 1e-9):
            break
    return stream[:len(pi)], pi


def update_history(history, rows, rewards):
    """Per row index: did its last group tie (rewards [B', G]; an answer left unread, NaN, ties
    nothing)? docs/dppo.md#eq-prompt-keep"""
    for i, tied in zip(rows, tied_groups(rewards).tolist()):
        history[int(i)] = tied  # plain ints and bools: the table goes into state.pt
    return history


def systematic_sample(pi, u):
    """Kept indices, item k with probability exactly pi_k: k is kept when one of u, u + 1, ... lies
    in [S_(k-1), S_k), S the running sum of pi, u uniform in [0, 1). docs/dppo.md#eq-draw"""
    edges = np.concatenate([[0.0], np.cumsum(pi)])  # [n + 1]
    return [k for k in range(len(pi)) if math.ceil(edges[k + 1] - u) > math.ceil(edges[k] - u)]


def completion_keep_probs(advantages, r_o, floor):
    """pi_i = clip(c |A_i|, low, 1) with sum(pi) = (1 - r_o) n. docs/dppo.md#eq-completion-keep"""
    a = torch.as_tensor(advantages, dtype=torch.float64).abs().flatten()  # [n]
    target = (1 - r_o) * len(a)
    nonzero = int((a > 0).sum())
    # raised if A != 0 are too few
    low = max(floor, min(1.0, (target - nonzero) / max(1, len(a) - nonzero)))
    lo = 0.0
    hi = 1.0  # at c = hi every A != 0 has pi 1
    if nonzero:
        hi = 1 / a[a > 0].min().item()
    for _ in range(60):  # bisection on c: sum(pi) grows with c
        mid = (lo + hi) / 2
        if (mid * a).clamp(low, 1).sum() < target - 1e-9:
            lo = mid  # too few kept: c is larger
        else:
            hi = mid
    return (hi * a).clamp(low, 1)  # [n]


def importance_coefficients(lengths, prompt_pi, completion_pi, kept, n_examined, loss_agg,
                            max_len):
    """(c_i, w_i) of the kept completions: w = 1/(pi_q pi_i) over the counts of the unpruned
    examined batch; lengths and completion_pi run over the rolled-out completions.
    docs/dppo.md#eq-estimator"""
    G = len(lengths) // max(1, len(prompt_pi))
    weights = [1.0 / (prompt_pi[i // G] * completion_pi[i]) for i in kept]
    # the examined batch's token count, estimated: exact when every pi_q = 1
    # (docs/dppo.md#eq-token-mean)
    tokens = sum(sum(lengths[q * G:(q + 1) * G]) / p for q, p in enumerate(prompt_pi))
    return token_coefficients([lengths[i] for i in kept], loss_agg, max_len=max_len,
                              whole=(n_examined * G, tokens, weights)), weights


def packing_density(lengths, bins, budget):
    """Valid tokens over micro-batch capacity: sum(lengths) / sum_b max(budget, load_b).
    docs/dppo.md#eq-density"""
    return sum(lengths) / max(1, sum(max(budget, sum(lengths[i] for i in b)) for b in bins))


def window_pack(lengths, budget, window):
    """Micro-batches in stream order, each filled with the longest of the next `window` sequences
    that fits, again and again; one over the budget goes alone. docs/dppo.md#eq-density"""
    pending = list(range(len(lengths)))
    bins = []
    while pending:
        if lengths[pending[0]] > budget:
            bins.append([pending.pop(0)])
            continue
        bins.append([])
        load = 0
        while True:
            fits = [i for i in pending[:window] if load + lengths[i] <= budget]
            if not fits:
                break
            i = max(fits, key=lengths.__getitem__)  # the longest that fits; ties go to the older
            bins[-1].append(i)
            load += lengths[i]
            pending.remove(i)
    return bins


def main():
    args = parse_args(Args, METHOD, __doc__)  # recipe defaults filled in, every flag checked
    # every pi > 0; a step examines at most lookahead B + 1/keep_floor prompts
    if not (0 <= args.prune_prompts < 1 and 0 <= args.prune_completions < 1
            and 2 ** -10 <= args.keep_floor <= 1):
        die("--prune_prompts and --prune_completions must be in [0, 1), "
            "--keep_floor in [2^-10, 1] (got "
            f"{args.prune_prompts}, {args.prune_completions}, {args.keep_floor})")
    if not (1 <= args.window <= 2 ** 20 and 1 <= args.lookahead <= 2 ** 10):
        die(f"--window must be in [1, 2^20], --lookahead in [1, 2^10] (got {args.window}, "
            f"{args.lookahead})")
    run = setup(args, METHOD, reward, prompt, METRIC,
                config={"ideal_trained_fraction": 1 - args.prune_completions})
    model = run.model
    engine = run.engine
    tokenizer = run.tokenizer
    passes = run.passes  # temperature, vocabulary, token budget: how the trainer's passes run
    train_rows = run.train_rows
    cursor = run.cursor
    B = args.prompts_per_step
    G = args.group_size
    # row -> did its last group tie? docs/dppo.md#eq-prompt-keep
    history = run.state.get("history", {})

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(run.start, run.steps), initial=run.start, total=run.steps, desc=METHOD,
               dynamic_ncols=True)
    for step in bar:
        timer = PhaseTimer()
        # 1. prompt pruning with refill (docs/dppo.md#eq-refill),
        # then G completions for each kept prompt
        with timer("rollout"):
            rng = np.random.default_rng([args.seed, step])  # the masks: reproducible on resume
            # + 1/floor more prompts: enough for pi summing to 1
            cap = math.ceil(args.lookahead * B)
            stream = take_prompts(len(train_rows), cursor, cap + math.ceil(1 / args.keep_floor),
                                  args.seed)
            examined, prompt_pi = candidate_window(stream, history, B, args.prune_prompts,
                                                   args.keep_floor, cap)
            cursor += len(examined)  # pruned prompts are skipped for this epoch
            kept_q = systematic_sample(prompt_pi, rng.random())  # docs/dppo.md#eq-draw
            prompt_rows = [examined[k] for k in kept_q]  # indices into train_rows
            prompt_pi = [prompt_pi[k] for k in kept_q]
            batch = [train_rows[i] for i in prompt_rows]
            outputs = engine.generate([r["prompt_ids"] for r in batch], n=G,
                                      temperature=args.temperature,
                                      max_tokens=args.max_tokens,
                                      seed=rollout_seed(args.seed, step))
            # outputs: per prompt, G (token ids, log-probs)

        # 2. reward, 3. group advantages  (docs/grpo.md#eq-advantage)
        with timer("reward"):
            texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group],
                                           skip_special_tokens=True)
            rows = [row for row in batch for _ in range(G)]  # each completion's dataset row
            # NaN: an answer left unread (its reward() past --reward_timeout or the step's 120 s)
            rewards, reward_counts = score(texts, rows, reward, args.reward_timeout)
            rewards = torch.tensor(rewards).view(-1, G)  # [B', G]
            advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [B', G]
            samples = []  # every completion, with what the trainer needs of it
            for q, group in enumerate(outputs):
                for i, (ids, logps) in enumerate(group):
                    sample = Sample(prompt_ids=batch[q]["prompt_ids"], completion_ids=ids,
                                    reward=float(rewards[q, i]),
                                    advantage=float(advantages[q, i]), sample_logps=logps)
                    samples.append(sample)
            update_history(history, prompt_rows, rewards)
            # completion pruning on the full groups' advantages, importance weights
            # (docs/dppo.md#eq-estimator)
            completion_pi = completion_keep_probs(advantages, args.prune_completions,
                                                  args.keep_floor).tolist()
            kept_o = systematic_sample(completion_pi, rng.random())
            kept_o = [i for i in kept_o if not math.isnan(samples[i].reward)]  # unread: none
            coefs, weights = importance_coefficients([len(s.completion_ids) for s in samples],
                                                     prompt_pi, completion_pi, kept_o,
                                                     len(examined), args.loss_agg, args.max_tokens)
            trained = [samples[i] for i in kept_o]  # the trainer sees the kept ones only
            for sample, coef in zip(trained, coefs.tolist()):
                sample.coef = coef

        # 4. old / reference log-probs, then mu clipped updates  (docs/grpo.md#eq-objective)
        with timer("logp"):
            # mu > 1: the policy moves between the updates, so the ratio's pi_old is its
            # log-probs before the first (mu = 1: policy_update takes logps.detach(), ratio 1)
            if args.mu > 1:
                for sample, logps in zip(trained, sequence_logprobs(model, trained, passes)):
                    sample.old_logps = logps
            if run.ref_model is not None:  # beta = 0 loads no reference model
                for sample, logps in zip(trained,
                                         sequence_logprobs(run.ref_model, trained, passes)):
                    sample.ref_logps = logps
        with timer("pack"):  # the update's micro-batches (docs/dppo.md#eq-density)
            lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in trained]
            bins = window_pack(lengths, args.token_budget, args.window)
            bins = [sorted(b) for b in bins]  # each bin in stream order: a group side by side
        with timer("update"):
            for _ in range(args.mu):
                stats = policy_update(model=model, optimizer=run.optimizer, samples=trained,
                                      passes=passes, clip=(args.eps_low, args.eps_high),
                                      beta=args.beta, tis_cap=args.tis_cap,
                                      grad_clip=args.grad_clip, micro_batches=bins)
                run.scheduler.step()

        # 5. the engine samples the next step with the new weights
        with timer("push"):
            engine.push(model)

        # ---------------------------------------------------------------- log, evaluate, save
        row = {
            "step": step + 1,
            **batch_metrics(rewards, samples, run.stop_ids, reward_counts),
            **stats,
            "rollouts": len(samples),
            "trained_rollouts": len(trained),
            "lr": run.scheduler.get_last_lr()[0],
            "prompts_examined": len(examined),
            "prompt_keep_frac": len(batch) / len(examined),
            "completion_keep_frac": len(trained) / len(samples),
            "weight_mean": sum(weights) / max(1, len(weights)),
            "weight_max": max(weights, default=0.0),
            "pack_density": packing_density(lengths, bins, args.token_budget),
            "pack_micro_batches": len(bins),
            **timer.seconds(),
        }
        # evaluate, log, checkpoint; True at the end
        if finish_step(run, bar, row, cursor, {"history": history}):
            break


if __name__ == "__main__":
    main()
