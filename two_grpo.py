"""2-GRPO: "It Takes Two: Your GRPO Is Secretly DPO" (Wu et al. 2025, arXiv 2510.00977).

What changes relative to grpo.py (a configuration of the same loop, plus one optional step):
  * G = 2 and 8x the prompts per step, as many rollouts as 16-GRPO (256 x 2 vs 32 x 16), at 8x the
    learning rate (built-in tasks: grpo.py's rollouts in pairs, at grpo.py's rate);
  * advantages with the population std and no epsilon: a mixed pair gets exactly +1 / -1, a tied
    pair 0 / 0, and the loss is the paper's contrastive pair loss (docs/two_grpo.md#eq-pair-loss);
  * DAPO's clip-higher (eps_high 0.28), no KL term, 10-step warm-up (the paper's verl settings);
  * tied pairs carry no gradient, so they skip the trainer's passes (same update, less work);
  * --resample: 2-GRPO+RS (paper v3), tied pairs replaced by fresh ones (docs/two_grpo.md#resample).
Why two rollouts keep GRPO's gradient unbiased, and more prompts cut variance: docs/two_grpo.md.

Run:
    python two_grpo.py                                  # the built-in toy, CPU
    python two_grpo.py --dataset chains --resample      # the second built-in task, 2-GRPO+RS
    python two_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset math  # one 80 GB GPU with vLLM
    python two_grpo.py --resume runs/two_grpo-math-20261122-101500  # continue a run
"""
import collections
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (DATASETS, TEMPLATES, PhaseTimer, Sample, arg, batch_metrics, die, finish_step,
                    gold_answer, group_advantages, math_reward, parse_args, policy_update,
                    recipe_arg, rollout_seed, score, sequence_logprobs, setup, take_prompts,
                    template_messages, tied_groups, token_coefficients)
from common import recipe_of  # B and lr follow grpo.py's recipe (pair_recipe)

METHOD = "two_grpo"  # names the run, its bar and config.json


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
# (2-GRPO: --prompts_per_step and --lr are pair_recipe's, from these: see their flags)
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
    prompts_per_step: int = arg(None, "B: prompts per step",
                                shown="256 (16-GRPO's 32 x 16 rollouts); "
                                      "toy, chains models: grpo.py's B x 8 rollouts in pairs")
    group_size: int = arg(2, "G: completions sampled per prompt (the method is G = 2)")
    temperature: float = arg(1.0, "sampling temperature (the trainer divides its logits by it too)")
    max_tokens: int = recipe_arg("max_tokens", "maximum completion length in tokens")
    max_prompt_len: int = arg(512, "prompts longer than this many tokens are dropped")
    template: str = recipe_arg("template", "prompt template (system prompt and answer format)",
                               choices=list(TEMPLATES))
    vllm_gpu_memory: float = arg(0.3, "GPU memory fraction vLLM holds (weights + KV cache)")
    # objective: docs/grpo.md, docs/two_grpo.md
    std_mode: str = arg("population", "advantage std: population (ddof 0: +-1 per pair), unbiased "
                                      "(+-0.707), none", choices=["unbiased", "population", "none"])
    adv_eps: float = arg(0.0, "epsilon added to the group std (0: a mixed pair gets exactly +-1)")
    eps_low: float = arg(0.2, "clip the ratio below at 1 - eps_low")
    eps_high: float = arg(0.28, "clip the ratio above at 1 + eps_high (DAPO's clip-higher, paper)")
    beta: float = arg(0.0, "k3 KL coefficient (0, verl's default: no reference model)")
    mu: int = arg(1, "policy updates per rollout batch (> 1 adds an old-log-prob pass)")
    loss_agg: str = arg("seq_mean", "loss aggregation: seq_mean (paper Eq. 14), token_mean (verl), "
                                    "constant", choices=["seq_mean", "token_mean", "constant"])
    skip_tied: bool = arg(True, "train only on mixed pairs when beta = 0 (the same update)")
    resample: bool = arg(False, "2-GRPO+RS: tied pairs replaced by pairs of fresh prompts")
    resample_cap: int = arg(8, "--resample draws at most this many times B prompts (16-GRPO's)")
    tis_cap: float = arg(0.0, "truncated IS cap on pi_trainer/pi_engine per token (0 = off)")
    # optimisation
    steps: int = recipe_arg("steps", "training steps (0 = one pass over the training prompts)")
    lr: float = arg(None, "AdamW learning rate",
                    shown="the recipe's GRPO rate x B / its GRPO B (linear scaling): 8e-6 real; "
                          "toy, chains models keep GRPO's 3e-4 (docs/two_grpo.md#toy)")
    lr_schedule: str = arg("constant", "after the warm-up: constant, or cosine decay to 10%",
                           choices=["constant", "cosine"])
    warmup_steps: int = arg(10, "linear learning-rate warm-up, in optimiser steps")
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


def prompts_to_draw(missing, mixed, drawn, cap, cap_factor):
    """2-GRPO+RS: fresh prompts for the next round, enough to find `missing` mixed pairs at the
    mixed rate seen so far this step (at least 1/cap_factor), never past the step's cap.
    docs/two_grpo.md#resample"""
    rate = mixed / drawn if drawn else 1.0
    return min(math.ceil(missing / max(rate, 1 / cap_factor)), cap - drawn)


def rows_to_train(samples, loss_agg, max_len, num_seqs, skip_tied):
    """(indices, coefficients) of the rollouts the trainer must see. With beta = 0 a zero-advantage
    rollout has zero loss and gradient: skipping it keeps the update if the normaliser still counts
    it. An all-tied batch keeps one row, whose zero gradient moves Adam.
    docs/two_grpo.md#skip-tied"""
    lengths = [len(s.completion_ids) for s in samples]
    coefs = token_coefficients(lengths, loss_agg, max_len=max_len,
                               whole=(num_seqs, sum(lengths), 1.0))
    # an answer left unread (NaN reward) is never trained on
    keep = [i for i, s in enumerate(samples)
            if not math.isnan(s.reward) and (s.advantage != 0 or not skip_tied)] or [0]
    return keep, coefs[keep]


def scaled_recipe(grpo_prompts, grpo_lr, recipe, prompts=None):
    """(B, lr) from the run's GRPO recipe (its name: common.recipe_of) and a B given (`prompts`).
    Real models: 256 pairs at the GRPO rate x B / its B (the paper's linear rule). The built-in
    tasks' models, where the rule is unstable: grpo.py's rollouts (B x its G = 8) in pairs at
    grpo.py's rate. docs/two_grpo.md#batch"""
    if recipe in ("toy", "chains"):
        return prompts or grpo_prompts * 8 // 2, grpo_lr
    prompts = prompts or 256
    return prompts, grpo_lr * prompts / grpo_prompts


def pair_recipe(flags):
    """The defaults of B and lr: scaled_recipe of the run's GRPO recipe and the B given."""
    name, grpo = recipe_of(flags)
    B, lr = scaled_recipe(grpo["prompts_per_step"], grpo["lr"], name, flags["prompts_per_step"])
    return {"prompts_per_step": B, "lr": lr}


def main():
    args = parse_args(Args, METHOD, __doc__, recipe=pair_recipe)  # a resumed run keeps its B, lr
    if args.group_size != 2:  # G = 2 is the method: grpo.py samples larger groups
        die(f"--group_size must be 2 in 2-GRPO (got {args.group_size}): grpo.py takes other sizes")
    if not 1 <= args.resample_cap <= 2 ** 10:
        die(f"--resample_cap must be in [1, 2^10] (got {args.resample_cap})")
    rounds = args.resample_cap if args.resample else 1  # prompts drawn: at most B x rounds
    # every check first; models, engine, optimiser; evaluation at step 0
    run = setup(args, METHOD, reward, prompt, METRIC)
    model = run.model
    engine = run.engine
    tokenizer = run.tokenizer
    passes = run.passes  # temperature, vocabulary, token budget: how the trainer's passes run
    train_rows = run.train_rows
    cursor = run.cursor
    B = args.prompts_per_step
    G = args.group_size

    # ---------------------------------------------------------------- training loop
    bar = tqdm(range(run.start, run.steps), initial=run.start, total=run.steps, desc=METHOD,
               dynamic_ncols=True)
    for step in bar:
        timer = PhaseTimer()
        # 1. rollout of G = 2 completions for B prompts, 2. reward, per round: with --resample, tied
        # pairs give way to pairs of new prompts until B are mixed (docs/two_grpo.md#resample)
        batch = []
        outputs = []
        rewards = []
        reward_counts = collections.Counter()
        cap = B * rounds  # prompts this step may draw
        while len(batch) < cap:
            mixed = 0  # mixed pairs drawn so far this step
            if rewards:
                mixed = int((~tied_groups(rewards)).sum())
            missing = B - mixed if args.resample else B - len(batch)
            if missing <= 0:
                break
            n = prompts_to_draw(missing, mixed, len(batch), cap, args.resample_cap)
            new = [train_rows[i] for i in take_prompts(len(train_rows), cursor, n, args.seed)]
            cursor += n
            with timer("rollout"):  # new seed slots each round
                out = engine.generate([r["prompt_ids"] for r in new], n=G,
                                      temperature=args.temperature,
                                      max_tokens=args.max_tokens,
                                      seed=rollout_seed(args.seed, step, len(batch) * G))
            with timer("reward"):
                texts = tokenizer.batch_decode([ids for group in out for ids, _ in group],
                                               skip_special_tokens=True)
                rows = [row for row in new for _ in range(G)]  # each completion's dataset row
                # NaN: an answer left unread (reward() past --reward_timeout or the step's 120 s)
                scores, counts = score(texts, rows, reward, args.reward_timeout)
                reward_counts.update(counts)
            batch += new
            outputs += out  # one list of G (token ids, log-probs) per prompt
            rewards += [scores[q * G:(q + 1) * G] for q in range(n)]
        drawn = len(batch)
        r_drawn = torch.tensor(rewards)  # [drawn, G]: what the step sampled, logged below
        tied = tied_groups(r_drawn)  # [drawn]: a pair with an answer left unread is not mixed
        if args.resample:  # train on the first B mixed pairs; drop tied ones and the surplus
            keep = [q for q in range(drawn) if not tied[q]][:B]
            if not keep:  # nothing to learn: B tied pairs (zero advantage), as 2-GRPO would
                tqdm.write(f"step {step + 1}: no mixed pair among {drawn} prompts "
                           f"(--resample_cap {args.resample_cap}): training on {B} tied pairs, "
                           "whose policy gradient is zero")
                keep = list(range(B))
            batch = [batch[q] for q in keep]
            outputs = [outputs[q] for q in keep]
            rewards = [rewards[q] for q in keep]

        # 3. advantages +1 / -1 (mixed pair), 0 / 0 (tied): docs/two_grpo.md#eq-pair-advantage
        with timer("reward"):
            rewards = torch.tensor(rewards).view(-1, G)  # [B, G]
            advantages = group_advantages(rewards, args.std_mode, args.adv_eps)  # [B, G]
            samples = []  # every completion, with what the trainer needs of it
            for q, group in enumerate(outputs):
                for i, (ids, logps) in enumerate(group):
                    sample = Sample(prompt_ids=batch[q]["prompt_ids"], completion_ids=ids,
                                    reward=float(rewards[q, i]),
                                    advantage=float(advantages[q, i]), sample_logps=logps)
                    samples.append(sample)
            train, coefs = rows_to_train(samples, args.loss_agg, args.max_tokens, B * G,
                                         args.skip_tied and args.beta == 0)
            trained = [samples[i] for i in train]
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
        row = {
            "step": step + 1,
            **batch_metrics(r_drawn, samples, run.stop_ids, reward_counts),
            **stats,
            "tied_pairs": tied.float().mean().item(),
            "prompts_drawn": drawn,
            "rollouts": drawn * G,
            "trained_rollouts": len(trained),
            "lr": run.scheduler.get_last_lr()[0],
            **timer.seconds(),
        }
        if finish_step(run, bar, row, cursor):  # evaluate, log, checkpoint; True at the end
            break


if __name__ == "__main__":
    main()
