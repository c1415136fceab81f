"""2-GRPO: "It Takes Two: Your GRPO Is Secretly DPO" (Wu et al. 2025, arXiv 2510.00977).

What changes relative to grpo.py (a configuration of the same loop, plus one optional step):
  * G = 2 completions per prompt and 8x the prompts per step: a step trains on as many rollouts as
    16-GRPO (paper: 256 prompts x 2 vs 32 x 16), the learning rate scaled by the same factor;
  * advantages with the population std and no epsilon: a mixed pair gets exactly +1 / -1, a tied
    pair 0 / 0, and the loss is the paper's contrastive pair loss (docs/two_grpo.md#eq-pair-loss);
  * DAPO's clip-higher (eps_high 0.28), no KL term, 10-step warm-up (the paper's verl settings);
  * tied pairs carry no gradient, so they skip the trainer's passes (same update, less work);
  * --resample: 2-GRPO+RS (paper v3), tied pairs replaced by fresh ones (docs/two_grpo.md#resample).
The derivation (why two rollouts keep GRPO's gradient unbiased, and why variance falls with more
prompts) is in docs/two_grpo.md; the machinery is in common.py and plumbing.py.

Run:
    python two_grpo.py                                                    # the built-in toy, CPU
    python two_grpo.py --resample                                         # 2-GRPO+RS
    python two_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset math  # one 80 GB GPU with vLLM
    python two_grpo.py --resume runs/two_grpo-math-20261122-101500         # continue a run
"""
import collections
import math
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (Sample, default_token_budget, evaluate, group_advantages, load_model,
                    load_tokenizer, make_engine, make_optimizer, policy_update, rollout_seed, score,
                    sequence_logprobs, stop_token_ids, token_coefficients)
from plumbing import (DATASETS, TEMPLATES, PhaseTimer, arg, batch_metrics, check_flags, check_model,
                      die, load_checkpoint, load_dataset, log_row, open_metrics, parse_args,
                      plot_metrics, prompt_token_ids, save_checkpoint, set_seed, take_prompts,
                      write_config)
from varlen import attention_kernel

METHOD = os.path.splitext(os.path.basename(__file__))[0]  # names the run, its bar and config.json


@dataclass
class Args:
    # what to train, where to write
    model: str = arg(None, "policy: a Hugging Face model folder or hub id")
    dataset: str = arg("toy", f"{' | '.join(DATASETS)} | a .jsonl file | a folder with train.jsonl "
                              "[+ test.jsonl]")
    out: str = arg("", "output folder", shown=f"runs/{METHOD}-<dataset>-<time>")
    resume: str = arg("", "continue the run in this output folder from its last checkpoint")
    seed: int = arg(0, "seed for data order, sampling and initialisation")
    # rollout
    rollout: str = arg("auto", "engine: vllm, hf (transformers), auto (vllm if installed)",
                       choices=["auto", "vllm", "hf"])
    prompts_per_step: int = arg(None, "B: prompts per step",
                                shown="256 (paper: 256 x 2 = 16-GRPO's 32 x 16); built-in tasks: "
                                      "grpo.py's rollouts in pairs, toy 128 (32 x 8), chains 64")
    group_size: int = arg(2, "G: completions sampled per prompt (the method is G = 2)")
    temperature: float = arg(1.0, "sampling temperature (the trainer divides its logits by it too)")
    max_tokens: int = arg(None, "maximum completion length in tokens")
    max_prompt_len: int = arg(512, "prompts longer than this many tokens are dropped")
    template: str = arg(None, "prompt template (system prompt and answer format)",
                        choices=list(TEMPLATES))
    vllm_gpu_memory: float = arg(0.3, "GPU memory fraction vLLM holds (weights + KV cache)")
    # objective: docs/grpo.md, docs/two_grpo.md
    std_mode: str = arg("population", "advantage std: population (ddof 0: +-1 per pair), unbiased "
                                      "(+-0.707), none", choices=["unbiased", "population", "none"])
    adv_eps: float = arg(0.0, "epsilon added to the group std (0: a mixed pair gets exactly +-1)")
    eps_low: float = arg(0.2, "clip the ratio below at 1 - eps_low")
    eps_high: float = arg(0.28, "clip the ratio above at 1 + eps_high (0.28 = DAPO's clip-higher, "
                                "as the paper)")
    beta: float = arg(0.0, "k3 KL coefficient to the frozen initial model (0 = verl's default: no "
                           "reference model)")
    mu: int = arg(1, "policy updates per rollout batch (> 1 adds an old-log-prob pass)")
    loss_agg: str = arg("seq_mean", "loss aggregation: seq_mean (paper Eq. 14), token_mean (verl), "
                                    "constant", choices=["seq_mean", "token_mean", "constant"])
    skip_tied: bool = arg(True, "train only on mixed pairs when beta = 0 (tied pairs have zero "
                                "gradient; same update)")
    resample: bool = arg(False, "2-GRPO+RS: replace tied pairs with pairs of fresh prompts, up to "
                                "--resample_cap")
    resample_cap: int = arg(8, "with --resample, at most this many times B x G rollouts per step "
                               "(8: 16-GRPO's)")
    tis_cap: float = arg(0.0, "truncated IS cap on pi_trainer/pi_engine per token (0 = off)")
    # optimisation
    steps: int = arg(None, "training steps (0 = one pass over the training prompts)")
    lr: float = arg(None, "AdamW learning rate",
                    shown="the dataset's GRPO rate x B / its GRPO B (linear scaling): 8e-6 real; "
                          "toy and chains keep GRPO's 3e-4 (docs/two_grpo.md#toy)")
    lr_schedule: str = arg("constant", "after the warm-up: constant, or cosine decay to 10%",
                           choices=["constant", "cosine"])
    warmup_steps: int = arg(10, "linear learning-rate warm-up, in optimiser steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    grad_clip: float = arg(1.0, "clip the gradient norm to this (0 = no clipping)")
    token_budget: int = arg(None, "tokens per packed micro-batch (a longer sequence gets its own)",
                            shown="16384 on GPU, 4096 on CPU: the fastest measured here with --attn "
                                  "varlen (512 on CPU with sdpa/eager, whose mask is dense [T, T])")
    logprob_chunk: int = arg(1024, "tokens per chunk of the memory-lean log-prob")
    grad_ckpt: bool = arg(None, "gradient checkpointing (true/false)", shown="on for GPU")
    attn: str = arg("varlen", "attention: varlen runs each packed sequence on its own; sdpa and "
                              "eager build a dense [T, T] block-diagonal mask (reference paths)",
                    choices=["varlen", "sdpa", "eager"])
    # evaluation and checkpoints
    eval_every: int = arg(None, "greedy held-out accuracy every N steps (0: start and end only)")
    eval_n: int = arg(None, "held-out problems per evaluation")
    save_every: int = arg(50, "checkpoint every N steps (and at the end)")
    trust_remote_code: bool = arg(False, "allow model code from the hub (only if you trust it)")


def prompts_to_draw(missing, mixed, drawn, cap, cap_factor):
    """2-GRPO+RS: fresh prompts for the next round, enough to find `missing` mixed pairs at the
    mixed rate seen so far this step (at least 1/cap_factor), never past the step's cap.
    docs/two_grpo.md#resample"""
    rate = mixed / drawn if drawn else 1.0
    return min(math.ceil(missing / max(rate, 1 / cap_factor)), cap - drawn)


def rows_to_train(samples, loss_agg, max_len, num_seqs, skip_tied):
    """(indices, coefficients) of the rollouts the trainer must see. With beta = 0 a zero-advantage
    rollout has an exactly zero loss and gradient: skipping it leaves the update unchanged as long
    as the normaliser still counts it, so coefficients come from all rollouts first. An all-tied
    batch keeps one row: its zero gradient moves Adam, as unskipped. docs/two_grpo.md#skip-tied"""
    lengths = [len(s.completion_ids) for s in samples]
    coefs = token_coefficients(lengths, loss_agg, max_len=max_len, num_seqs=num_seqs)
    keep = [i for i, s in enumerate(samples) if s.advantage != 0 or not skip_tied] or [0]
    return keep, coefs[keep]


def default_prompts(grpo_prompts, dataset):
    """B: on the built-in tasks grpo.py's rollouts per step (its B x G = 8) in pairs, as many
    rollouts as the GRPO run they are compared with; on real data the paper's 256 pairs, 16-GRPO's
    32 x 16 rollouts. docs/two_grpo.md#batch"""
    return grpo_prompts * 8 // 2 if dataset in ("toy", "chains") else 256


def default_lr(grpo_lr, prompts_per_step, grpo_prompts, dataset):
    """The paper's linear scaling rule: the dataset's GRPO rate x B / the dataset's GRPO B. Not on
    the built-in tasks, where it is unstable (toy: 1.2e-3 peaks, then falls back; chains: 1.2e-3
    collapses to 0: docs/two_grpo.md#toy, #chains); there the GRPO rate itself."""
    return grpo_lr if dataset in ("toy", "chains") else grpo_lr * prompts_per_step / grpo_prompts


def main():
    # ---------------------------------------------------------------- setup: every check first
    args, given = parse_args(Args, METHOD, __doc__)
    # more prompts at a proportionally higher rate than the dataset's GRPO recipe, whose B and lr
    # parse_args filled in (docs/two_grpo.md#batch); a resumed run keeps what it started with
    grpo_prompts = args.prompts_per_step
    if "prompts_per_step" not in given and not args.resume:
        args.prompts_per_step = default_prompts(grpo_prompts, args.dataset)
    if "lr" not in given and not args.resume:
        args.lr = default_lr(args.lr, args.prompts_per_step, grpo_prompts, args.dataset)
    if args.resample and args.resample_cap < 1:
        die(f"--resample_cap must be at least 1 (got {args.resample_cap})")
    check_flags(vars(args))  # again, with B known: it bounds the rollouts per step
    check_model(args.model, args.trust_remote_code)
    try:
        train_rows, eval_rows = load_dataset(args.dataset, args.eval_n)
    except (ValueError, OSError) as e:
        die(str(e))
    set_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.grad_ckpt = device.type == "cuda" if args.grad_ckpt is None else args.grad_ckpt
    args.token_budget = args.token_budget or default_token_budget(device, args.attn)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    if tokenizer.chat_template is None:
        die(f"--model {args.model!r} has no chat template: use an instruct model or add one")
    train_rows = prompt_token_ids(tokenizer, train_rows, args.template, args.max_prompt_len)
    eval_rows = prompt_token_ids(tokenizer, eval_rows, args.template, args.max_prompt_len)
    if not train_rows or not eval_rows:
        split = "training" if not train_rows else "held-out"
        die(f"every {split} prompt is longer than --max_prompt_len {args.max_prompt_len} tokens")
    steps = args.steps or math.ceil(len(train_rows) / args.prompts_per_step)
    B = args.prompts_per_step
    G = args.group_size
    vocab_size = len(tokenizer)
    stop_ids = stop_token_ids(tokenizer, args.model)

    # ---------------------------------------------------------------- models, engine, optimiser
    policy_path = os.path.join(args.out, "checkpoint", "model") if args.resume else args.model
    model = load_model(policy_path, device, args.trust_remote_code, args.attn, args.grad_ckpt)
    ref_model = None
    if args.beta > 0:
        ref_model = load_model(args.model, device, args.trust_remote_code, args.attn, frozen=True)
    engine = make_engine(args.rollout, model, tokenizer, policy_path, seed=args.seed,
                         max_model_len=args.max_prompt_len + args.max_tokens, max_num_seqs=B * G,
                         vocab_size=vocab_size, stop_ids=stop_ids, gpu_memory=args.vllm_gpu_memory,
                         trust_remote_code=args.trust_remote_code)
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, args.warmup_steps,
                                          steps * args.mu, args.lr_schedule)
    state = {"step": 0, "cursor": 0}
    if args.resume:
        state = load_checkpoint(args.out, optimizer, scheduler)
    start = state["step"]
    cursor = state["cursor"]
    attention = attention_kernel(args.attn, device)
    write_config(args.out, args, {"method": METHOD, "steps": steps, "engine": type(engine).__name__,
                                  "device": str(device), "attention": attention,
                                  "ideal_trained_fraction": 1.0})  # the share of rollouts trained on
    metrics = open_metrics(args.out, start if args.resume else None)
    n_params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{METHOD}: {n_params:.1f}M parameters on {device}, rollout {type(engine).__name__}, "
          f"attention {attention}, {len(train_rows)} train / {len(eval_rows)} eval prompts, "
          f"{steps} steps of {B} x {G}, output {args.out}")
    train_kw = dict(temperature=args.temperature, vocab_size=vocab_size,
                    token_budget=args.token_budget, chunk=args.logprob_chunk)
    if start >= steps:
        print(f"nothing to do: {args.out} already finished {start} of {steps} steps (see --steps)")
        return
    eval_acc = None
    if start == 0:
        eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
        log_row(metrics, {"step": 0, "eval_accuracy": eval_acc})
        print(f"step 0: eval accuracy {eval_acc:.3f}")

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=METHOD, dynamic_ncols=True)
    for step in bar:
        timer = PhaseTimer()
        # 1. rollout of G = 2 completions for B prompts, 2. reward, per round: with --resample, tied
        # pairs give way to pairs of new prompts until B are mixed (docs/two_grpo.md#resample)
        with timer("rollout"):
            batch = []
            outputs = []
            rewards = []
            reward_counts = collections.Counter()
            cap = B * (args.resample_cap if args.resample else 1)  # prompts this step may draw
            while len(batch) < cap:
                mixed = sum(len(set(r)) > 1 for r in rewards)
                missing = B - mixed if args.resample else B - len(batch)
                if missing <= 0:
                    break
                n = prompts_to_draw(missing, mixed, len(batch), cap, args.resample_cap)
                new = [train_rows[i] for i in take_prompts(len(train_rows), cursor, n, args.seed)]
                cursor += n
                round_seed = rollout_seed(args.seed, step, len(batch) * G)  # new slots each round
                out = engine.generate([r["prompt_ids"] for r in new], G, args.temperature,
                                      args.max_tokens, seed=round_seed)
                with timer("reward"):
                    texts = tokenizer.batch_decode([ids for group in out for ids, _ in group],
                                                   skip_special_tokens=True)
                    scores, counts = score(texts, [new[k // G]["gold"] for k in range(n * G)])
                    reward_counts.update(counts)
                batch += new
                outputs += out  # one list of G (token ids, log-probs) per prompt
                rewards += [scores[q * G:(q + 1) * G] for q in range(n)]
            engine.sleep()
            drawn = len(batch)
            tied = sum(len(set(r)) == 1 for r in rewards) / drawn
            r_drawn = torch.tensor(rewards)  # [drawn, G]: what the step sampled, logged below
            if args.resample:  # train on the first B mixed pairs; drop tied ones and the surplus
                keep = [q for q, r in enumerate(rewards) if len(set(r)) > 1][:B]
                if not keep:  # nothing to learn: B tied pairs (zero advantage), as 2-GRPO would
                    tqdm.write(f"step {step + 1}: no mixed pair among {drawn} prompts "
                               f"(--resample_cap {args.resample_cap}): training on {B} tied pairs, "
                               "whose policy gradient is zero")
                    keep = list(range(B))
                batch = [batch[q] for q in keep]
                outputs = [outputs[q] for q in keep]
                rewards = [rewards[q] for q in keep]

        # 3. advantages +1 / -1 for a mixed pair, 0 / 0 for a tied one (population std, eps 0:
        # docs/two_grpo.md#eq-pair-advantage); tied pairs skip the trainer (rows_to_train)
        with timer("reward"):
            rewards = torch.tensor(rewards).view(-1, G)  # [B, G]
            advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [B, G]
            samples = [Sample(batch[q]["prompt_ids"], ids, rewards[q, i].item(),
                              advantages[q, i].item(), logps)
                       for q, group in enumerate(outputs) for i, (ids, logps) in enumerate(group)]
            train, coefs = rows_to_train(samples, args.loss_agg, args.max_tokens, B * G,
                                         args.skip_tied and args.beta == 0)
            trained = [samples[i] for i in train]

        # 4. old / reference log-probs, then mu clipped updates  (docs/grpo.md#eq-objective)
        with timer("logp"):
            old = None  # on-policy (mu = 1): old = logp.detach()
            if args.mu > 1:
                old = sequence_logprobs(model, trained, **train_kw)
            ref = sequence_logprobs(ref_model, trained, **train_kw) if ref_model else None
        with timer("update"):
            for _ in range(args.mu):
                stats = policy_update(model, optimizer, trained, coefs, old_logps=old,
                                      ref_logps=ref, beta=args.beta, eps_low=args.eps_low,
                                      eps_high=args.eps_high, tis_cap=args.tis_cap,
                                      grad_clip=args.grad_clip, **train_kw)
                scheduler.step()

        # 5. the engine samples the next step with the new weights
        with timer("push"):
            engine.push(model)

        # ---------------------------------------------------------------- log, evaluate, save
        done = step + 1
        row = {
            "step": done,
            **batch_metrics(r_drawn, samples, stop_ids, reward_counts),
            **stats,
            "tied_pairs": tied,
            "prompts_drawn": drawn,
            "rollouts": drawn * G,
            "trained_rollouts": len(trained),
            "lr": scheduler.get_last_lr()[0],
            **timer.seconds(),
        }
        row["tokens_per_s"] = row["tokens"] / row["step_s"]
        if (args.eval_every and done % args.eval_every == 0) or done == steps:
            eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
            row["eval_accuracy"] = eval_acc
        log_row(metrics, row)
        acc = "-" if eval_acc is None else f"{eval_acc:.3f}"
        bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=acc,
                        tok_s=f"{row['tokens_per_s']:.0f}")
        if done % args.save_every == 0 or done == steps:
            save_checkpoint(args.out, model, tokenizer, optimizer, scheduler, done, cursor)
            plot_metrics(args.out)
    bar.close()
    print(f"done: eval accuracy {eval_acc:.3f} after {steps} steps; metrics, plot and checkpoint "
          f"in {args.out}")


if __name__ == "__main__":
    main()
