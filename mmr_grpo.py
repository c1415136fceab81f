"""MMR-GRPO: GRPO with diversity-aware reward reweighting (Wei & Huang 2026, arXiv 2601.09085).

GRPO (grpo.py) with one change, between the reward and the advantage: each prompt's G rewards are re-ranked by Maximal
Marginal Relevance over sentence embeddings of the completions. The best completion keeps its reward; each next pick
gets lambda * r - (1 - lambda) * (its highest cosine similarity to those already picked), lambda = sigmoid(std of the
group's rewards). Redundant answers earn less than distinct ones, and no group is left without a learning signal.
The usual group normalisation then runs on the reweighted rewards. The maths, the worked numbers and every deviation
from the paper and its code are in docs/mmr_grpo.md.

Run:
    python mmr_grpo.py                                   # the built-in toy, CPU, the toy policy as a stand-in encoder
    python mmr_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset gsm8k                 # encoder all-MiniLM-L6-v2
    python mmr_grpo.py --embed_model jinaai/jina-embeddings-v2-small-en --trust_remote_code ...  # the paper's encoder
    python mmr_grpo.py --resume runs/mmr_grpo-gsm8k-20261122-101500      # continue an interrupted run
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

MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # the paper's jina-embeddings-v2 needs trust_remote_code


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
    # MMR reweighting: docs/mmr_grpo.md
    embed_model: str = arg(None, "sentence-transformers encoder of the completions: a local folder, a hub id, or toy",
                           type=str, default_help=f"toy for --dataset toy (toy/model, mean-pooled), otherwise {MINILM}")
    sim_floor: bool = arg(True, "count negative similarities as 0 as the official code does (no: the paper's Alg. 1)")


def load_encoder(spec, device, trust_remote_code=False):
    """The completion encoder, in eval mode on the trainer's device (docs/mmr_grpo.md#encoder). A sentence-transformers
    folder or hub id loads as it is. Any other model folder, and `toy` (toy/model: the toy policy's initial weights, an
    offline stand-in), becomes transformer + mean pooling over the plain text."""
    from sentence_transformers import SentenceTransformer
    path = TOY_MODEL if spec == "toy" else spec
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "modules.json")):
        return SentenceTransformer(path, device=str(device), trust_remote_code=trust_remote_code).eval()
    try:  # sentence-transformers >= 6 moved the modules; 5.x keeps them here
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    body = Transformer(path)
    getattr(body, "modality_config", {}).pop("message", None)  # >= 6 would wrap each text in a chat model's template
    pooling = Pooling(body.auto_model.config.hidden_size, "mean")
    return SentenceTransformer(modules=[body, pooling], device=str(device)).eval()


def embed(encoder, texts):
    """[N, d] embeddings of the decoded completions (no grad); the prompt is not embedded, as in the official code."""
    return encoder.encode(texts, convert_to_tensor=True, show_progress_bar=False).float()


def group_similarity(embeddings, group_size):
    """S[q, i, j] = cosine similarity of completions i and j of prompt q. docs/mmr_grpo.md#eq-similarity"""
    e = torch.nn.functional.normalize(embeddings.double(), dim=-1)  # [B*G, d]; an all-zero row stays 0
    e = e.view(-1, group_size, e.shape[-1])  # [B, G, d]
    return (e @ e.transpose(1, 2)).cpu()  # [B, G, G]


def mmr_rewards(rewards, sim, floor=True):
    """MMR-reweighted rewards of one group [G] and its lambda, from rewards [G] and similarities [G, G].
    lambda = sigmoid(population std of the rewards) (docs/mmr_grpo.md#eq-lambda); greedy selection: the highest reward
    goes first and keeps it, each next pick is the unpicked i with the highest lambda * r_i - (1 - lambda) * b_i,
    b_i = max over picked j of S_ij, and that score becomes its reward (docs/mmr_grpo.md#eq-mmr). Ties go to the lowest
    index (torch.argmax, as in the official code); floor=True makes b_i >= 0 (the official code's running max starts
    at 0)."""
    r, sim = torch.as_tensor(rewards, dtype=torch.float64), torch.as_tensor(sim, dtype=torch.float64)  # [G], [G, G]
    lam = torch.sigmoid(r.std(unbiased=False))  # population std: 0 (never NaN) for a tied group or G = 1
    new, picked = r.clone(), torch.zeros(len(r), dtype=torch.bool)  # [G], [G]
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
    """Every group of rewards [B, G] reweighted: (r~ [B, G], lambda [B], S [B, G, G]). Embeddings [B*G, d] come in
    the rewards' order. The advantage then normalises r~ as GRPO normalises r: docs/mmr_grpo.md#eq-advantage"""
    sim = group_similarity(embeddings, rewards.shape[1])  # [B, G, G]
    out = [mmr_rewards(r, s, floor) for r, s in zip(rewards, sim)]
    return torch.stack([o[0] for o in out]), torch.stack([o[1] for o in out]), sim


def main():
    # ---------------------------------------------------------------- setup: every check before anything slow
    args, given = parse_args(Args, description=__doc__)
    args = setup_run(args, given, "mmr_grpo")
    args.embed_model = args.embed_model or ("toy" if args.dataset == "toy" else MINILM)
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
    try:  # ~100 MB next to a policy of GBs: loaded once, kept on the trainer's device for the whole run
        encoder = load_encoder(args.embed_model, device, args.trust_remote_code)
    except Exception as e:
        die(f"--embed_model {args.embed_model!r} could not be loaded ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}): pass a local sentence-transformers folder, or --embed_model "
            "toy (the toy policy's weights, mean-pooled)")
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
    write_config(args, {"method": "mmr_grpo", "steps": steps, "engine": type(engine).__name__, "device": str(device),
                        "attention": attention})
    metrics = open_metrics(args.out, start if args.resume else None)
    print(f"mmr_grpo: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
          f"rollout {type(engine).__name__}, attention {attention}, {len(train_rows)} train / "
          f"{len(eval_rows)} eval prompts, "
          f"{steps} steps of {B} x {G}, encoder {args.embed_model}, output {args.out}")
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
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="mmr_grpo", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        # 1. rollout: G completions for each of B prompts
        batch = [train_rows[i] for i in take_prompts(len(train_rows), cursor, B, args.seed)]
        cursor += B
        outputs = engine.generate([r["prompt_ids"] for r in batch], G, args.temperature, args.max_tokens,
                                  seed=rollout_seed(args.seed, step))  # list of B lists of G (ids, logps)
        engine.sleep()
        t_rollout = time.time() - t0

        # 2. reward, 3. MMR-reweighted rewards, then group advantages on them  (docs/mmr_grpo.md#eq-advantage)
        REWARD_STATS.clear()
        texts = tokenizer.batch_decode([ids for group in outputs for ids, _ in group], skip_special_tokens=True)
        rewards = torch.tensor([math_reward(t, batch[k // G]["gold"]) for k, t in enumerate(texts)]).view(B, G)
        t_mmr = time.time()
        mmr, lam, sim = mmr_reweight(rewards, embed(encoder, texts), args.sim_floor)  # [B, G], [B], [B, G, G]
        t_mmr = time.time() - t_mmr
        advantages = group_advantages(mmr, args.std_mode, args.adv_eps)  # [B, G]
        samples = [Sample(batch[q]["prompt_ids"], ids, rewards[q, i].item(), advantages[q, i].item(), logps)
                   for q, group in enumerate(outputs) for i, (ids, logps) in enumerate(group)]
        coefs = token_coefficients([len(s.completion_ids) for s in samples], args.loss_agg, max_len=args.max_tokens)
        t_reward = time.time() - t0 - t_rollout - t_mmr

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
        t_train = time.time() - t0 - t_rollout - t_mmr - t_reward

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
               "tokens_per_s": n_tokens / (time.time() - t0),
               "mmr_lambda": lam.mean().item(), "mmr_s": t_mmr,  # mean within-group similarity i != j:
               "mmr_similarity": sim[:, ~torch.eye(G, dtype=torch.bool)].sum().item() / max(1, B * G * (G - 1)),
               "silent_groups": (advantages == 0).all(dim=1).float().mean().item()}  # in GRPO = zero_std_groups
        row["mmr_share"] = t_mmr / row["step_s"]  # of the training step (evaluation excluded); the paper: 0.6-5.5%
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
