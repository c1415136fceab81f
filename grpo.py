"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024, arXiv 2402.03300).

The baseline that every other script here changes one piece of. One step:
  1. sample G completions for each of B prompts (vLLM in this process; transformers generate as a fallback);
  2. score each completion with math-verify (1 if its final answer equals the reference, else 0);
  3. advantages normalised within each prompt's group: A = (r - mean) / (std + eps);
  4. mu clipped policy-gradient updates on packed micro-batches, with a k3 KL to the frozen initial model;
  5. push the new weights into the rollout engine.
The maths, with every convention this file picks, is in docs/grpo.md; the machinery is in common.py.

Run:
    python grpo.py                                                     # the built-in toy, CPU, ~2 minutes
    python grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset gsm8k  # one 80 GB GPU with vLLM installed
    python grpo.py --resume runs/grpo-gsm8k-20261122-101500             # continue an interrupted run
"""
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


@dataclass
class Args:
    # what to train, where to write
    model: str = arg(TOY_MODEL, "policy: a local Hugging Face model folder or a hub id", default_help="toy/model here")
    dataset: str = arg("toy", f"{' | '.join(DATASETS)} | a .jsonl file | a folder with train.jsonl [+ test.jsonl]")
    out: str = arg("", "output folder", default_help="runs/grpo-<dataset>-<time>")
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


def main():
    # ---------------------------------------------------------------- setup: every check before anything slow
    args, given = parse_args(Args, description=__doc__)
    args = setup_run(args, given, "grpo")
    check_args(args)
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
    start, cursor = 0, 0
    if args.resume:
        state = load_checkpoint(args.out, optimizer, scheduler)
        start, cursor = state["step"], state["cursor"]
    attention = attention_kernel(args.attn, device)
    write_config(args, {"method": "grpo", "steps": steps, "engine": type(engine).__name__, "device": str(device),
                        "attention": attention})
    metrics = open_metrics(args.out, start if args.resume else None)
    print(f"grpo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
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
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="grpo", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # 1. rollout: G completions for each of B prompts
        batch = [train_rows[i] for i in take_prompts(len(train_rows), cursor, B, args.seed)]
        cursor += B
        outputs = engine.generate([r["prompt_ids"] for r in batch], G, args.temperature, args.max_tokens,
                                  seed=rollout_seed(args.seed, step))  # list of B lists of G (ids, logps)
        engine.sleep()
        t_rollout = time.time() - t0

        # 2. reward, 3. group advantages  (docs/grpo.md#eq-advantage)
        REWARD_STATS.clear()
        texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group], skip_special_tokens=True)
        rewards = torch.tensor([math_reward(t, batch[k // G]["gold"]) for k, t in enumerate(texts)]).view(B, G)
        advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [B, G]
        samples = [Sample(batch[q]["prompt_ids"], ids, rewards[q, i].item(), advantages[q, i].item(), logps)
                   for q, group in enumerate(outputs) for i, (ids, logps) in enumerate(group)]
        coefs = token_coefficients([len(s.completion_ids) for s in samples], args.loss_agg, max_len=args.max_tokens)
        t_reward = time.time() - t0 - t_rollout

        # 4. old / reference log-probs, then mu clipped updates  (docs/grpo.md#eq-objective)
        t1 = time.time()
        old = sequence_logprobs(model, samples, **train_kw) if args.mu > 1 else None  # on-policy: old = logp.detach()
        ref = sequence_logprobs(ref_model, samples, **train_kw) if ref_model is not None else None
        t_logp = time.time() - t1  # inside t_train
        for _ in range(args.mu):
            stats = policy_update(model, optimizer, samples, coefs, old_logps=old, ref_logps=ref, beta=args.beta,
                                  eps_low=args.eps_low, eps_high=args.eps_high, tis_cap=args.tis_cap,
                                  grad_clip=args.grad_clip, **train_kw)
            scheduler.step()
        t_train = time.time() - t0 - t_rollout - t_reward

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
               "lr": scheduler.get_last_lr()[0],
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
    bar.close()
    print(f"done: eval accuracy {eval_acc:.3f} after {steps} steps; metrics and checkpoint in {args.out}")


if __name__ == "__main__":
    main()
