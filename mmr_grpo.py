"""MMR-GRPO: GRPO with diversity-aware reward reweighting (Wei & Huang 2026, arXiv 2601.09085).

GRPO (grpo.py) with one change, between the reward and the advantage: each prompt's G rewards are
re-ranked by Maximal Marginal Relevance over sentence embeddings of the completions. The best
completion keeps its reward; each next pick gets lambda * r - (1 - lambda) * (its highest cosine
similarity to those already picked), lambda = sigmoid(std of the group's rewards). Redundant answers
earn less than distinct ones, and no group is left without a learning signal. The usual group
normalisation then runs on the reweighted rewards. The maths, the worked numbers and every
deviation from the paper and its code are in docs/mmr_grpo.md.

Run:
    python mmr_grpo.py                                 # the toy, CPU, the toy policy as encoder
    python mmr_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset gsm8k  # encoder: MiniLM
    python mmr_grpo.py --embed_model jinaai/jina-embeddings-v2-small-en --trust_remote_code
    python mmr_grpo.py --resume runs/mmr_grpo-gsm8k-20261122-101500  # continue an interrupted run
The third line is the paper's encoder.
"""
import math
import os
from dataclasses import dataclass

import torch
from tqdm import tqdm

from common import (DATASETS, TEMPLATES, PhaseTimer, Sample, arg, batch_metrics, die, finish_step,
                    gold_answer, group_advantages, math_reward, parse_args, policy_update,
                    recipe_arg, rollout_seed, score, sequence_logprobs, setup, take_prompts,
                    template_messages, token_coefficients)
from common import recipe_of  # the encoder follows the policy model (encoder_recipe)

METHOD = "mmr_grpo"  # names the run, its bar and config.json
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the paper's jina needs remote code


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
    # MMR reweighting: docs/mmr_grpo.md
    embed_model: str = arg(None, "sentence-transformers encoder of the completions: a local "
                                 "folder, a hub id, or toy / chains (that task's base model)",
                           shown=f"the built-in task's own base model, mean-pooled (toy, chains), "
                                 f"else {MINILM}")
    sim_floor: bool = arg(True, "count negative similarities as 0 as the official code does "
                                "(--no_sim_floor: the paper's Alg. 1)")


def load_encoder(spec, device, trust_remote_code=False):
    """The completion encoder, in eval mode on the trainer's device (docs/mmr_grpo.md#encoder). A
    sentence-transformers folder or hub id loads as it is. Any other model folder, and a built-in
    task's name (`toy`, `chains`: that task's initial policy, an offline stand-in), becomes
    transformer + mean pooling over the plain text."""
    from sentence_transformers import SentenceTransformer
    path = DATASETS[spec]["model"] if "model" in DATASETS.get(spec, {}) else spec
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "modules.json")):
        return SentenceTransformer(path, device=str(device),
                                   trust_remote_code=trust_remote_code).eval()
    try:  # sentence-transformers >= 6 moved the modules; 5.x keeps them here
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    body = Transformer(path)
    getattr(body, "modality_config", {}).pop("message", None)  # >= 6: no chat template, plain text
    pooling = Pooling(body.auto_model.config.hidden_size, "mean")
    return SentenceTransformer(modules=[body, pooling], device=str(device)).eval()


def embed(encoder, texts):
    """[N, d] embeddings of the decoded completions (no grad); the prompt is not embedded, as in the
    official code."""
    if not any(texts):  # all empty: zeros, as an empty one among others (the toy's has no token)
        return torch.zeros(len(texts), encoder.get_sentence_embedding_dimension())  # [N, d]
    return encoder.encode(texts, convert_to_tensor=True, show_progress_bar=False).float()


def group_similarity(embeddings, group_size):
    """S[q, i, j] = cosine similarity of completions i and j of prompt q.
    docs/mmr_grpo.md#eq-similarity"""
    e = torch.nn.functional.normalize(embeddings.double(), dim=-1)  # [B*G, d]; a zero row stays 0
    e = e.view(-1, group_size, e.shape[-1])  # [B, G, d]
    return (e @ e.transpose(1, 2)).cpu()  # [B, G, G]


def mmr_rewards(rewards, sim, floor=True):
    """MMR-reweighted rewards of one group [G] and its lambda, from rewards [G] and similarities
    [G, G]. lambda = sigmoid(population std of the rewards) (docs/mmr_grpo.md#eq-lambda); greedy
    selection: the highest reward goes first and keeps it, each next pick is the unpicked i with the
    highest lambda * r_i - (1 - lambda) * b_i, b_i = max over picked j of S_ij, and that score
    becomes its reward (docs/mmr_grpo.md#eq-mmr). Ties go to the lowest index (torch.argmax, as in
    the official code); floor=True makes b_i >= 0 (the official code's running max starts at 0)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [G]
    sim = torch.as_tensor(sim, dtype=torch.float64)  # [G, G]
    lam = torch.sigmoid(r.std(unbiased=False))  # population std: 0 (never NaN) if tied or G = 1
    new = r.clone()  # [G]
    picked = torch.zeros(len(r), dtype=torch.bool)  # [G]
    best = torch.full_like(r, 0.0 if floor else -math.inf)  # [G], b_i over the picks so far
    pick = int(r.argmax())
    for _ in range(len(r) - 1):
        picked[pick] = True
        best = torch.maximum(best, sim[:, pick])
        score = lam * r - (1 - lam) * best  # [G]
        pick = int(score.masked_fill(picked, -math.inf).argmax())
        new[pick] = score[pick]
    return new, lam


def mmr_reweight(rewards, embeddings, floor=True):
    """Every group of rewards [B, G] reweighted: (r~ [B, G], lambda [B], S [B, G, G]). Embeddings
    [B*G, d] come in the rewards' order. The advantage then normalises r~ as GRPO normalises r:
    docs/mmr_grpo.md#eq-advantage"""
    sim = group_similarity(embeddings, rewards.shape[1])  # [B, G, G]
    out = []
    for r, s in zip(rewards, sim):
        if r.isnan().any():  # an answer left unread: the group is left out whole, A = 0 for all
            unread = torch.full(r.shape, math.nan, dtype=torch.float64)  # [G]
            out.append((unread, torch.tensor(math.nan)))
        else:
            out.append(mmr_rewards(r, s, floor))
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out]), sim


def encoder_recipe(flags):
    """The default encoder: a built-in task's own base model (toy, chains) when it is the policy,
    else MiniLM."""
    name, _ = recipe_of(flags)  # the recipe follows the policy model
    return {"embed_model": name if name in DATASETS else MINILM}


def main():
    args = parse_args(Args, METHOD, __doc__, recipe=encoder_recipe)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:  # ~100 MB next to a policy of GBs: loaded once, kept on the trainer's device for the run
        encoder = load_encoder(args.embed_model, device, args.trust_remote_code)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else ""
        die(f"--embed_model {args.embed_model!r} could not be loaded ({type(e).__name__}: "
            f"{reason}): pass a local sentence-transformers folder, or --embed_model toy (the toy "
            "policy's weights, mean-pooled)")
    run = setup(args, METHOD, reward, prompt, METRIC, about=f", encoder {args.embed_model}")
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
        # 1. rollout: G completions for each of B prompts
        with timer("rollout"):
            batch = [train_rows[i] for i in take_prompts(len(train_rows), cursor, B, args.seed)]
            cursor += B
            outputs = engine.generate([r["prompt_ids"] for r in batch], n=G,
                                      temperature=args.temperature,
                                      max_tokens=args.max_tokens,
                                      seed=rollout_seed(args.seed, step))
            # outputs: per prompt, G (token ids, log-probs)

        # 2. reward, 3. MMR-reweighted rewards, group advantages  (docs/mmr_grpo.md#eq-advantage)
        with timer("reward"):
            texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group],
                                           skip_special_tokens=True)
            rows = [row for row in batch for _ in range(G)]  # each completion's dataset row
            # NaN: an answer left unread (its reward() past --reward_timeout or the step's 120 s)
            rewards, reward_counts = score(texts, rows, reward, args.reward_timeout)
            rewards = torch.tensor(rewards).view(B, G)  # [B, G]
        with timer("mmr"):  # [B, G], [B], [B, G, G]
            mmr, lam, sim = mmr_reweight(rewards, embed(encoder, texts), args.sim_floor)
        with timer("reward"):
            advantages = group_advantages(mmr, args.std_mode, args.adv_eps)  # [B, G]
            samples = []  # every completion, with what the trainer needs of it
            for q, group in enumerate(outputs):
                for i, (ids, logps) in enumerate(group):
                    sample = Sample(prompt_ids=batch[q]["prompt_ids"], completion_ids=ids,
                                    reward=float(rewards[q, i]),
                                    advantage=float(advantages[q, i]), sample_logps=logps)
                    samples.append(sample)
            trained = [s for s in samples if not math.isnan(s.reward)]  # the unread left out
            # c_i, each sample's weight in the loss: 1 / (|o_i| N) with seq_mean, the paper's
            # (docs/grpo.md#eq-aggregation)
            lengths = [len(s.completion_ids) for s in trained]
            coefs = token_coefficients(lengths, args.loss_agg, max_len=args.max_tokens)
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
        done = step + 1
        off_diagonal = ~torch.eye(G, dtype=torch.bool)  # the pairs i != j of a group
        row = {
            "step": done,
            **batch_metrics(rewards, samples, run.stop_ids, reward_counts),
            **stats,
            "rollouts": len(samples),
            "trained_rollouts": len(trained),
            "lr": run.scheduler.get_last_lr()[0],
            **timer.seconds(),
            "mmr_lambda": lam.nanmean().item(),
            "mmr_similarity": sim[:, off_diagonal].sum().item() / max(1, B * G * (G - 1)),
            "silent_groups": (advantages == 0).all(dim=1).float().mean().item(),  # GRPO: zero_std
        }
        row["mmr_share"] = row["mmr_s"] / row["step_s"]  # evaluation excluded; the paper: 0.6-5.5%
        if finish_step(run, bar, row, cursor):  # evaluate, log, checkpoint; True at the end
            break


if __name__ == "__main__":
    main()
