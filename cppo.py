"""CPPO: Completion Pruning Policy Optimization (Lin et al. 2025, arXiv 2503.22342;
official code github.com/lzhxmu/CPPO).

GRPO (grpo.py) with two changes. A completion's policy gradient is proportional to its advantage
A_i, which is known before any forward pass (docs/cppo.md#eq-gradient), so:
  1. pruning: advantages are computed on the full group of G exactly as in GRPO, then only the
     completions with the largest |A| are kept, k = G(1 - P) per question on average: either the
     int(N P) smallest |A| of the whole batch are dropped (--prune_scope batch, the official code)
     or each group keeps its top k (question, the paper). The old-policy and reference passes and
     the mu updates see the kept completions only: that is the saving;
  2. dynamic allocation: each step samples B/(1 - P) questions instead of B, so the kept
     completions fill the same B x G training slots as a GRPO step.
The maths, the defaults and every deviation from the paper and the official code: docs/cppo.md.

Run:
    python cppo.py                                      # the built-in toy, CPU, ~2 minutes
    python cppo.py --dataset chains                     # the second built-in task, CPU
    python cppo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset gsm8k  # one 80 GB GPU with vLLM
    python cppo.py --pruning 0.5 --prune_scope question  # the paper's top-k, k = 8
    python cppo.py --resume runs/cppo-gsm8k-20261122-101500  # continue an interrupted run
"""
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (DATASETS, TEMPLATES, PhaseTimer, Sample, arg, batch_metrics, die, finish_step,
                    gold_answer, group_advantages, math_reward, parse_args, policy_update,
                    recipe_arg, rollout_seed, score, sequence_logprobs, setup, take_prompts,
                    template_messages, token_coefficients)

METHOD = "cppo"  # names the run, its bar and config.json


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
# (CPPO: --prompts_per_step is its own, 8: see the flag)
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
    prompts_per_step: int = arg(8, "B: the GRPO step whose B x G training slots the kept "
                                   "completions fill")
    group_size: int = arg(16, "G: completions sampled per prompt")
    temperature: float = arg(1.0, "sampling temperature (the trainer divides its logits by it too)")
    max_tokens: int = recipe_arg("max_tokens", "maximum completion length in tokens")
    max_prompt_len: int = arg(512, "prompts longer than this many tokens are dropped")
    template: str = recipe_arg("template", "prompt template (system prompt and answer format)",
                               choices=list(TEMPLATES))
    vllm_gpu_memory: float = arg(0.3, "GPU memory fraction vLLM holds (weights + KV cache)")
    # pruning and allocation: docs/cppo.md
    pruning: float = arg(0.875, "P: fraction of the sampled completions pruned; B/(1-P) questions "
                                "are sampled")
    prune_scope: str = arg("batch", "batch: drop the smallest |A| of the whole batch (official "
                                    "code); question: keep the top k = G(1-P) |A| of each group "
                                    "(paper)", choices=["batch", "question"])
    # objective: docs/grpo.md, docs/cppo.md#defaults
    std_mode: str = arg("unbiased", "advantage std: unbiased (ddof 1), population (ddof 0), none "
                                    "(Dr. GRPO)", choices=["unbiased", "population", "none"])
    adv_eps: float = arg(1e-4, "epsilon added to the group std")
    eps_low: float = arg(0.2, "clip the ratio below at 1 - eps_low")
    eps_high: float = arg(0.2, "clip the ratio above at 1 + eps_high (0.28 = DAPO's clip-higher)")
    beta: float = arg(0.04, "k3 KL coefficient to the frozen initial model (0 loads no reference)")
    mu: int = arg(2, "policy updates per rollout batch (> 1 adds an old-log-prob pass)")
    loss_agg: str = arg("token_mean", "loss aggregation: seq_mean (GRPO), token_mean (DAPO), "
                                    "constant (Dr. GRPO)",
                        choices=["seq_mean", "token_mean", "constant"])
    tis_cap: float = arg(0.0, "truncated IS cap on pi_trainer/pi_engine per token (0 = off)")
    # optimisation
    steps: int = recipe_arg("steps", "training steps (0 = one pass over the training prompts)")
    lr: float = recipe_arg("lr", "AdamW learning rate")
    lr_schedule: str = arg("cosine", "after the warm-up: constant, or cosine decay to 10%",
                           choices=["constant", "cosine"])
    warmup_steps: int = arg(None, "linear learning-rate warm-up, in optimiser steps",
                            shown="10% of the optimiser steps")
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


def kept_per_question(G, P):
    """k = G(1 - P): completions kept per question (on average with the batch scope).
    docs/cppo.md#eq-allocation"""
    if not 0 <= P < 1:
        raise ValueError(f"--pruning must be in [0, 1) (got {P}): it is the fraction of "
                         "completions pruned")
    k = G * (1 - P)
    if abs(k - round(k)) > 1e-6 or round(k) < 1:
        raise ValueError(f"--pruning {P} with --group_size {G} keeps k = G(1-P) = {k:.4g} "
                         "completions per question: k must be a whole number >= 1 (e.g. 0.875 for "
                         "G 16 keeps 2)")
    return round(k)


def questions_to_sample(B, G, k):
    """B/(1-P) = B G / k questions, rounded up, so the kept completions fill B x G slots.
    docs/cppo.md#eq-allocation"""
    return -(-B * G // k)


def prune_per_question(adv, k):
    """The paper's rule: flat indices (ascending) of the k largest-|A| completions of each group
    [Q, G]; among equal |A| the lower index (the earlier sample) is kept.
    docs/cppo.md#eq-prune-question"""
    Q, G = adv.shape
    top = torch.sort(adv.abs(), dim=1, descending=True, stable=True).indices[:, :k]  # [Q, k]
    return sorted((top + G * torch.arange(Q)[:, None]).flatten().tolist())


def prune_batch(adv, P):
    """The official code's rule: drop the int(N P) smallest |A| of all N = Q G completions of the
    step and return the flat indices (ascending) of the rest; among equal |A| the lower flat index
    is kept. docs/cppo.md#eq-prune-batch"""
    flat = adv.abs().flatten()  # [N]
    n_keep = len(flat) - int(len(flat) * P + 1e-6)  # + 1e-6: 0.29 * 100 is 28.999999999999996
    return sorted(torch.sort(flat, descending=True, stable=True).indices[:n_keep].tolist())


def main():
    args = parse_args(Args, METHOD, __doc__)  # recipe defaults filled in, every flag checked
    try:
        k = kept_per_question(args.group_size, args.pruning)
    except ValueError as e:
        die(str(e))
    B = args.prompts_per_step
    G = args.group_size
    Q = questions_to_sample(B, G, k)  # dynamic allocation: B/(1-P) questions, B x G kept rows
    run = setup(args, METHOD, reward, prompt, METRIC, questions=Q,
                about=f" sampled, {Q * k} kept ({args.prune_scope} scope)",
                config={"questions_per_step": Q, "kept_per_question": k,
                        "ideal_trained_fraction": k / G})  # = 1 - P of the rollouts
    model = run.model
    engine = run.engine
    tokenizer = run.tokenizer
    passes = run.passes  # temperature, vocabulary, token budget: how the trainer's passes run
    train_rows = run.train_rows
    cursor = run.cursor

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(run.start, run.steps), initial=run.start, total=run.steps, desc=METHOD,
               dynamic_ncols=True)
    for step in bar:
        timer = PhaseTimer()
        # 1. rollout: G completions for each of Q = B/(1-P) prompts  (docs/cppo.md#eq-allocation)
        with timer("rollout"):
            batch = [train_rows[i] for i in take_prompts(len(train_rows), cursor, Q, args.seed)]
            cursor += Q
            outputs = engine.generate([r["prompt_ids"] for r in batch], n=G,
                                      temperature=args.temperature,
                                      max_tokens=args.max_tokens,
                                      seed=rollout_seed(args.seed, step))
            # outputs: per prompt, G (token ids, log-probs)

        # 2. reward, 3. advantages on the full group of G, not renormalised after pruning
        #    (docs/grpo.md#eq-advantage)
        with timer("reward"):
            texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group],
                                           skip_special_tokens=True)
            rows = [row for row in batch for _ in range(G)]  # each completion's dataset row
            # NaN: an answer left unread (its reward() past --reward_timeout or the step's 120 s)
            rewards, reward_counts = score(texts, rows, reward, args.reward_timeout)
            rewards = torch.tensor(rewards).view(Q, G)  # [Q, G]
            advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [Q, G]
            samples = []  # every completion, with what the trainer needs of it
            for q, group in enumerate(outputs):
                for i, (ids, logps) in enumerate(group):
                    sample = Sample(prompt_ids=batch[q]["prompt_ids"], completion_ids=ids,
                                    reward=float(rewards[q, i]),
                                    advantage=float(advantages[q, i]), sample_logps=logps)
                    samples.append(sample)

        # 3b. pruning: keep the largest |A|
        with timer("prune"):
            if args.prune_scope == "batch":
                kept = prune_batch(advantages, args.pruning)  # docs/cppo.md#eq-prune-batch
            else:
                kept = prune_per_question(advantages, k)  # docs/cppo.md#eq-prune-question
            # [Q * k]; nothing below sees a pruned row, nor an answer left unread
            trained = [samples[i] for i in kept if not math.isnan(samples[i].reward)]
            # c_i, each sample's weight in the loss: 1 / (|o_i| N) with seq_mean, the paper's
            # (docs/grpo.md#eq-aggregation)
            lengths = [len(s.completion_ids) for s in trained]  # docs/cppo.md#eq-loss
            coefs = token_coefficients(lengths, args.loss_agg, max_len=args.max_tokens)
            for sample, coef in zip(trained, coefs.tolist()):
                sample.coef = coef

        # 4. old / reference log-probs, then mu clipped updates, on the kept rows only
        #    (docs/grpo.md#eq-objective)
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
        with timer("update"):
            for _ in range(args.mu):
                stats = policy_update(model=model, optimizer=run.optimizer, samples=trained,
                                      passes=passes, clip=(args.eps_low, args.eps_high),
                                      beta=args.beta, tis_cap=args.tis_cap,
                                      grad_clip=args.grad_clip)
                run.scheduler.step()

        # 5. the engine samples the next step with the new weights
        with timer("push"):
            engine.push(model)

        # ---------------------------------------------------------------- log, evaluate, save
        done = step + 1
        kept_tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in trained)
        row = {
            "step": done,
            **batch_metrics(rewards, samples, run.stop_ids, reward_counts),
            **stats,
            "rollouts": len(samples),
            "trained_rollouts": len(trained),
            "lr": run.scheduler.get_last_lr()[0],
            "questions": Q,
            "kept_frac": len(trained) / len(samples),
            "questions_emptied": Q - len({i // G for i in kept}),
            "kept_zero_adv": sum(s.advantage == 0 for s in trained) / max(1, len(trained)),
            **timer.seconds(),
        }
        row["kept_token_frac"] = kept_tokens / row["tokens"]  # docs/cppo.md#eq-time-saved
        if finish_step(run, bar, row, cursor):  # evaluate, log, checkpoint; True at the end
            break


if __name__ == "__main__":
    main()
