"""DPPO: Dynamic Pruning Policy Optimization ("Unbiased Dynamic Pruning for Efficient Group-Based Policy Optimization",
Zhu et al. 2026, arXiv 2603.04135). Only the abstract is public, no code: this is a reconstruction (docs/dppo.md
marks what the paper states and what is ours). What changes relative to grpo.py:
  * prompts whose last group had all-equal rewards are skipped before rollout with probability r_q; their slots are
    refilled from the next prompts of the stream (Dense Prompt Packing, rollout side: docs/dppo.md#eq-refill);
  * after scoring, on the full groups' advantages, completions are pruned: keep probability ~ |A| with a floor,
    an expected fraction r_o pruned (docs/dppo.md#eq-completion-keep);
  * a kept completion weighs 1/(pi_q pi_i) over the counts of the unpruned batch (Horvitz-Thompson), so the expected
    gradient is full-batch GRPO's (docs/dppo.md#eq-unbiased; slightly biased with token_mean: #eq-token-mean);
  * a window-based greedy packer of the training sequences; its valid-token density is logged (docs/dppo.md#eq-density).

Run:
    python dppo.py                                                     # the built-in toy, CPU, ~2 minutes
    python dppo.py --prune_prompts 0.7 --prune_completions 0.7         # prune harder (larger weights, more variance)
    python dppo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset math   # one 80 GB GPU with vLLM installed
    python dppo.py --resume runs/dppo-math-20261122-101500              # continue an interrupted run
"""
import json
import math
import os
import random
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from common import (DATASETS, REWARD_STATS, TEMPLATES, TOY_MODEL, Sample, arg, attention_kernel,
                    check_args, check_model, default_token_budget, die, evaluate, group_advantages,
                    load_checkpoint, load_dataset, load_model, load_tokenizer, log_row, make_engine,
                    make_optimizer, math_reward, open_metrics, parse_args, policy_update,
                    prompt_token_ids, rollout_seed, save_checkpoint, sequence_logprobs, setup_run,
                    stop_token_ids, take_prompts, token_coefficients, write_config)
from common import pack_microbatches  # to log first-fit density beside the window packer's


@dataclass
class Args:
    # what to train, where to write
    model: str = arg(TOY_MODEL, "policy: a local Hugging Face model folder or a hub id", default_help="toy/model here")
    dataset: str = arg("toy", f"{' | '.join(DATASETS)} | a .jsonl file | a folder with train.jsonl [+ test.jsonl]")
    out: str = arg("", "output folder", default_help="runs/dppo-<dataset>-<time>")
    resume: str = arg("", "continue the run in this output folder from its last checkpoint")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    # rollout
    rollout: str = arg("auto", "rollout engine: vllm, hf (transformers generate), auto = vllm if installed",
                       choices=["auto", "vllm", "hf"])
    prompts_per_step: int = arg(32, "B: prompts per step")
    group_size: int = arg(8, "G: completions sampled per prompt")
    temperature: float = arg(1.0, "sampling temperature (the trainer divides its logits by it too)")
    max_tokens: int = arg(None, "maximum completion length in tokens", type=int)
    max_prompt_len: int = arg(512, "prompts longer than this many tokens are dropped")
    template: str = arg(None, "prompt template (system prompt and answer format)", type=str, choices=list(TEMPLATES))
    vllm_gpu_memory: float = arg(0.3, "fraction of GPU memory vLLM may hold while generating (weights + KV cache)")
    # objective: docs/grpo.md
    std_mode: str = arg("unbiased", "advantage std: unbiased (ddof 1), population (ddof 0), none (Dr. GRPO)",
                        choices=["unbiased", "population", "none"])
    adv_eps: float = arg(1e-4, "epsilon added to the group std")
    eps_low: float = arg(0.2, "clip the ratio below at 1 - eps_low")
    eps_high: float = arg(0.2, "clip the ratio above at 1 + eps_high (0.28 = DAPO's clip-higher)")
    beta: float = arg(0.04, "k3 KL coefficient to the frozen initial model (0 loads no reference model)")
    mu: int = arg(1, "policy updates per rollout batch (> 1 adds an old-log-prob pass)")
    loss_agg: str = arg("seq_mean", "loss aggregation: seq_mean (GRPO), token_mean (DAPO), constant (Dr. GRPO)",
                        choices=["seq_mean", "token_mean", "constant"])
    tis_cap: float = arg(0.0, "truncated importance-sampling cap on pi_trainer/pi_engine per token (0 = off)")
    # pruning and packing: docs/dppo.md
    prune_prompts: float = arg(0.5, "r_q: probability of skipping a prompt whose last group had all-equal rewards")
    prune_completions: float = arg(0.5, "r_o: expected fraction of scored completions pruned (keep prob. ~ |A|)")
    keep_floor: float = arg(0.1, "smallest keep probability of a prompt or completion (so 1/pi <= 1/floor)")
    lookahead: float = arg(2.0, "refill pruned prompts from at most lookahead x B prompts of the stream per step")
    window: int = arg(64, "sequences the greedy packer looks ahead over to fill a micro-batch")
    # optimisation
    steps: int = arg(None, "training steps (0 = one pass over the training prompts)", type=int)
    lr: float = arg(None, "AdamW learning rate", type=float)
    lr_schedule: str = arg("constant", "after the warm-up: constant, or cosine decay to 10%",
                           choices=["constant", "cosine"])
    warmup_steps: int = arg(0, "linear learning-rate warm-up, in optimiser steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    grad_clip: float = arg(1.0, "clip the gradient norm to this")
    token_budget: int = arg(None, "tokens per packed micro-batch (a longer sequence gets one to itself)", type=int,
                            default_help="16384 on GPU, 4096 on CPU: the fastest measured here with --attn varlen "
                                         "(512 on CPU with sdpa/eager, whose packed mask is dense [T, T])")
    logprob_chunk: int = arg(1024, "tokens per chunk of the memory-lean log-prob")
    grad_ckpt: bool = arg(None, "gradient checkpointing of the decoder layers", type=bool, default_help="on for GPU")
    attn: str = arg("varlen", "attention: varlen runs each packed sequence on its own; sdpa and eager build a "
                     "dense [T, T] block-diagonal mask (the reference paths)", choices=["varlen", "sdpa", "eager"])
    # evaluation and checkpoints
    eval_every: int = arg(None, "greedy held-out accuracy every N steps, plus start and end (0 = start and end)", type=int)
    eval_n: int = arg(None, "held-out problems per evaluation", type=int)
    save_every: int = arg(50, "checkpoint every N steps (and at the end)")
    trust_remote_code: bool = arg(False, "allow model code from the hub (only if you trust it)")


def candidate_window(stream, history, B, r_q, floor, cap):
    """The examined prompts of a step: the next ones of the stream, taken until their keep probabilities sum to B, or
    `cap` of them (and then on until the sum reaches 1, so a step never keeps none). Depends on the history only,
    never on a draw. docs/dppo.md#eq-refill  Returns (row indices, keep probabilities pi_q)."""
    pi = []
    for i in stream:
        pi.append(max(floor, 1.0 - r_q) if history.get(i) else 1.0)  # docs/dppo.md#eq-prompt-keep
        if sum(pi) >= B - 1e-9 or (len(pi) >= cap and sum(pi) >= 1 - 1e-9):
            break
    return stream[:len(pi)], pi


def update_history(history, rows, rewards):
    """Per prompt (row index), whether its last group's rewards were all equal: zero advantage, nothing to learn.
    docs/dppo.md#eq-prompt-keep"""
    for i, r in zip(rows, rewards.tolist()):  # rewards [B', G]
        history[i] = len(set(r)) == 1
    return history


def systematic_sample(pi, u):
    """Kept indices of a fixed-size draw with inclusion probabilities pi (systematic sampling): item k is kept when one
    of the points u, u + 1, u + 2, ... (u uniform in [0, 1)) lies in its slice [S_(k-1), S_k) of the running sum of pi.
    A slice of length pi_k <= 1 holds a point with probability exactly pi_k, and floor or ceil of sum(pi) items are
    kept. docs/dppo.md#eq-draw"""
    edges = np.concatenate([[0.0], np.cumsum(pi)])  # [n + 1]
    return [k for k in range(len(pi)) if math.ceil(edges[k + 1] - u) > math.ceil(edges[k] - u)]


def completion_keep_probs(advantages, r_o, floor):
    """pi_i = clip(c |A_i|, low, 1) with c the smallest scale whose expected kept count sum(pi) reaches (1 - r_o) n.
    low = floor, raised uniformly when even keeping every A != 0 surely falls short (r_o = 0 keeps everything).
    docs/dppo.md#eq-completion-keep"""
    a = torch.as_tensor(advantages, dtype=torch.float64).abs().flatten()  # [n]
    target, nonzero = (1 - r_o) * len(a), int((a > 0).sum())
    low = max(floor, min(1.0, (target - nonzero) / max(1, len(a) - nonzero)))
    hi, lo = (1 / a[a > 0].min().item() if nonzero else 1.0), 0.0  # at c = hi every A != 0 has pi = 1
    for _ in range(60):  # bisection: sum(pi) grows with c
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if (mid * a).clamp(low, 1).sum() < target - 1e-9 else (lo, mid)
    return (hi * a).clamp(low, 1)  # [n]


def importance_coefficients(lengths, prompt_pi, completion_pi, kept, n_examined, loss_agg, max_len):
    """c_i of the kept completions: weight 1/(pi_q pi_i), normalised by the unpruned examined batch (n_examined x G
    sequences). lengths, completion_pi: [n] over the rolled-out completions, prompt-major; prompt_pi: per rolled-out
    prompt. docs/dppo.md#eq-estimator  token_mean's token count is itself estimated (docs/dppo.md#eq-token-mean).
    Returns (coefficients, weights)."""
    G = len(lengths) // max(1, len(prompt_pi))
    weights = [1.0 / (prompt_pi[i // G] * completion_pi[i]) for i in kept]
    tokens = sum(sum(lengths[q * G:(q + 1) * G]) / p for q, p in enumerate(prompt_pi))  # exact when every pi_q = 1
    return token_coefficients([lengths[i] for i in kept], loss_agg, max_len=max_len, num_seqs=n_examined * G,
                              num_tokens=tokens, weights=weights), weights


def window_pack(lengths, budget, window):
    """Micro-batches filled greedily in stream order: each takes, while one fits, the longest of the next `window`
    unpacked sequences that fits the token budget; one longer than the budget goes alone. docs/dppo.md#eq-density"""
    pending, bins = list(range(len(lengths))), []
    while pending:
        if lengths[pending[0]] > budget:
            bins.append([pending.pop(0)])
            continue
        mb, load = [], 0
        while fits := [i for i in pending[:window] if load + lengths[i] <= budget]:
            i = max(fits, key=lambda i: lengths[i])  # the longest that fits; ties go to the older
            mb, load = mb + [i], load + lengths[i]
            pending.remove(i)
        bins.append(mb)
    return bins


def packing_density(lengths, bins, budget):
    """Valid tokens over the capacity of the micro-batches: sum(lengths) / sum_b max(budget, load_b).
    docs/dppo.md#eq-density"""
    return sum(lengths) / max(1, sum(max(budget, sum(lengths[i] for i in b)) for b in bins))


def main():
    # ---------------------------------------------------------------- setup: every check before anything slow
    args, given = parse_args(Args, description=__doc__)
    args = setup_run(args, given, "dppo")
    check_args(args)
    if not (0 <= args.prune_prompts < 1 and 0 <= args.prune_completions < 1 and 0 < args.keep_floor <= 1):  # pi > 0
        die(f"--prune_prompts and --prune_completions must be in [0, 1), --keep_floor in (0, 1] (got "
            f"{args.prune_prompts}, {args.prune_completions}, {args.keep_floor})")
    if not (args.window >= 1 and args.lookahead >= 1):
        die(f"--window and --lookahead must be at least 1 (got {args.window}, {args.lookahead})")
    check_model(args.model, args.trust_remote_code)
    try:
        train_rows, eval_rows = load_dataset(args.dataset, args.eval_n)
    except (ValueError, OSError) as e:
        die(str(e))
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.grad_ckpt = device.type == "cuda" if args.grad_ckpt is None else args.grad_ckpt
    args.token_budget = args.token_budget or default_token_budget(device, args.attn)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    if tokenizer.chat_template is None:
        die(f"--model {args.model!r} has no chat template: use an instruct model or add one to its tokenizer")
    train_rows = prompt_token_ids(tokenizer, train_rows, args.template, args.max_prompt_len)
    eval_rows = prompt_token_ids(tokenizer, eval_rows, args.template, args.max_prompt_len)
    if not train_rows or not eval_rows:
        die(f"every {'training' if not train_rows else 'held-out'} prompt is longer than --max_prompt_len "
            f"{args.max_prompt_len} tokens")
    steps = args.steps or math.ceil(len(train_rows) / args.prompts_per_step)
    B, G, vocab_size = args.prompts_per_step, args.group_size, len(tokenizer)
    stop_ids = stop_token_ids(tokenizer, args.model)

    # ---------------------------------------------------------------- models, rollout engine, optimiser
    policy_path = os.path.join(args.out, "checkpoint", "model") if args.resume else args.model
    model = load_model(policy_path, device, args.trust_remote_code, args.attn, args.grad_ckpt)
    ref_model = load_model(args.model, device, args.trust_remote_code, args.attn, frozen=True) if args.beta > 0 else None
    engine = make_engine(args.rollout, model, tokenizer, policy_path, args, vocab_size, stop_ids)
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, args.warmup_steps, steps * args.mu,
                                          args.lr_schedule)
    start, cursor, history = 0, 0, {}  # history: row index -> did its last group tie (docs/dppo.md#eq-prompt-keep)
    history_path = os.path.join(args.out, "checkpoint", "history.json")
    if args.resume:
        state = load_checkpoint(args.out, optimizer, scheduler)
        start, cursor = state["step"], state["cursor"]
        # a missing or older table (a kill right after a checkpoint) only means fewer prunings, never a bias
        history = {int(k): v for k, v in json.load(open(history_path)).items()} if os.path.exists(history_path) else {}
    attention = attention_kernel(args.attn, device)
    write_config(args, {"method": "dppo", "steps": steps, "engine": type(engine).__name__, "device": str(device),
                        "attention": attention})
    metrics = open_metrics(args.out, start if args.resume else None)
    print(f"dppo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
          f"rollout {type(engine).__name__}, attention {attention}, {len(train_rows)} train / "
          f"{len(eval_rows)} eval prompts, "
          f"{steps} steps of {B} x {G}, output {args.out}")
    train_kw = dict(temperature=args.temperature, vocab_size=vocab_size, token_budget=args.token_budget,
                    chunk=args.logprob_chunk)
    if start >= steps:
        print(f"nothing to do: {args.out} already finished {start} of {steps} steps (raise --steps to go on)")
        return
    eval_acc = None
    if start == 0:
        eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
        log_row(metrics, {"step": 0, "eval_accuracy": eval_acc})
        print(f"step 0: eval accuracy {eval_acc:.3f}")

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="dppo", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # 1. prompt pruning with refill (docs/dppo.md#eq-refill), then rollout: G completions for each kept prompt
        rng = np.random.default_rng([args.seed, step])  # the masks: reproducible on resume, apart from the samplers
        cap = math.ceil(args.lookahead * B)  # + 1/floor more prompts: enough for keep probabilities summing to 1
        stream = take_prompts(len(train_rows), cursor, cap + math.ceil(1 / args.keep_floor), args.seed)
        examined, prompt_pi = candidate_window(stream, history, B, args.prune_prompts, args.keep_floor, cap)
        cursor += len(examined)  # pruned prompts are skipped for this epoch
        kept_q = systematic_sample(prompt_pi, rng.random())  # docs/dppo.md#eq-draw
        rows, prompt_pi = [examined[k] for k in kept_q], [prompt_pi[k] for k in kept_q]
        batch = [train_rows[i] for i in rows]
        outputs = engine.generate([r["prompt_ids"] for r in batch], G, args.temperature, args.max_tokens,
                                  seed=rollout_seed(args.seed, step))  # list of B lists of G (ids, logps)
        engine.sleep()
        t_rollout = time.time() - t0

        # 2. reward, 3. group advantages  (docs/grpo.md#eq-advantage)
        REWARD_STATS.clear()
        texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group], skip_special_tokens=True)
        rewards = torch.tensor([math_reward(t, batch[k // G]["gold"]) for k, t in enumerate(texts)]).view(-1, G)
        advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [B', G]
        samples = [Sample(batch[q]["prompt_ids"], ids, rewards[q, i].item(), advantages[q, i].item(), logps)
                   for q, group in enumerate(outputs) for i, (ids, logps) in enumerate(group)]
        update_history(history, rows, rewards)
        # completion pruning on the full groups' advantages, importance weights  (docs/dppo.md#eq-estimator)
        completion_pi = completion_keep_probs(advantages, args.prune_completions, args.keep_floor).tolist()  # [B' G]
        kept_o = systematic_sample(completion_pi, rng.random())
        coefs, weights = importance_coefficients([len(s.completion_ids) for s in samples], prompt_pi, completion_pi,
                                                 kept_o, len(examined), args.loss_agg, args.max_tokens)
        kept = [samples[i] for i in kept_o]
        t_reward = time.time() - t0 - t_rollout

        # 4. old / reference log-probs, then mu clipped updates  (docs/grpo.md#eq-objective)
        t1 = time.time()
        old = sequence_logprobs(model, kept, **train_kw) if args.mu > 1 else None  # on-policy: old = logp.detach()
        ref = sequence_logprobs(ref_model, kept, **train_kw) if ref_model is not None else None
        t_logp = time.time() - t1  # inside t_train
        for _ in range(args.mu):
            stats = policy_update(model, optimizer, kept, coefs, old_logps=old, ref_logps=ref, beta=args.beta,
                                  eps_low=args.eps_low, eps_high=args.eps_high, tis_cap=args.tis_cap,
                                  grad_clip=args.grad_clip, **train_kw,
                                  pack=lambda lengths, budget: window_pack(lengths, budget, args.window))
            scheduler.step()
        t_train = time.time() - t0 - t_rollout - t_reward
        # the window packer's density (it ran), next to that of first-fit-decreasing (docs/dppo.md#eq-density)
        seq_lens, budget = [len(s.prompt_ids) + len(s.completion_ids) for s in kept], args.token_budget
        t1 = time.time()
        bins = window_pack(seq_lens, budget, args.window)
        t_pack = (time.time() - t1) * args.mu  # the planning cost of the packer, once per update

        # 5. the engine samples the next step with the new weights
        engine.push(model)

        # ---------------------------------------------------------------- log, evaluate, checkpoint
        done = step + 1
        n_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
        row = {"step": done, "reward_mean": rewards.mean().item(), "reward_std": rewards.std(unbiased=False).item(),
               **stats, "completion_len": sum(len(s.completion_ids) for s in samples) / len(samples),
               "truncated": sum(s.completion_ids[-1:] != [] and s.completion_ids[-1] not in stop_ids
                                for s in samples) / len(samples),
               "zero_std_groups": (rewards == rewards[:, :1]).all(dim=1).float().mean().item(),
               "lr": scheduler.get_last_lr()[0], "prompts_examined": len(examined),
               "prompt_keep_frac": len(batch) / len(examined), "completion_keep_frac": len(kept) / len(samples),
               "weight_mean": sum(weights) / max(1, len(weights)), "weight_max": max(weights, default=0.0),
               "pack_density": packing_density(seq_lens, bins, budget), "pack_micro_batches": len(bins),
               "pack_s": t_pack, "pack_density_ffd": packing_density(seq_lens, pack_microbatches(seq_lens, budget), budget),
               "verify_timeouts": REWARD_STATS["timeout"], "verify_errors": REWARD_STATS["error"],
               "no_answer": REWARD_STATS["no_answer"], "rollouts": len(samples), "rollout_s": t_rollout,
               "reward_s": t_reward, "train_s": t_train, "logp_s": t_logp, "step_s": time.time() - t0,
               "tokens_per_s": n_tokens / (time.time() - t0)}
        if (args.eval_every and done % args.eval_every == 0) or done == steps:
            eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
            row["eval_accuracy"] = eval_acc
        log_row(metrics, row)
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc="-" if eval_acc is None else f"{eval_acc:.3f}",
                        tok_s=f"{row['tokens_per_s']:.0f}")
        if done % args.save_every == 0 or done == steps:
            save_checkpoint(args.out, model, tokenizer, optimizer, scheduler, done, cursor)
            with open(history_path + ".tmp", "w") as f:
                json.dump(history, f)
            os.replace(history_path + ".tmp", history_path)
    bar.close()
    print(f"done: eval accuracy {eval_acc:.3f} after {steps} steps; metrics and checkpoint in {args.out}")


if __name__ == "__main__":
    main()
