"""Attention over a packed row without a [T, T] mask: attn_implementation "varlen" for transformers.

Registered with transformers' AttentionInterface and AttentionMaskInterface, so the model code is
untouched: the mask function returns PACKED instead of the block-diagonal mask, and the attention
function runs each sequence on its own from the SeqLayout that common.packed_logprobs passes through
the model's kwargs. A padded batch (HF generate) or a single sequence gets transformers' own sdpa,
mask included. Kernels: torch's varlen_attn or flash-attn on CUDA; on CPU one batched causal sdpa
call per bucket of similar lengths. docs/grpo.md#packing
"""
import dataclasses
import functools
import sys

import numpy as np
import torch

BUCKET_RATIO = 0.8  # CPU: a sequence joins a bucket whose longest is at most 1.25x its length
PACKED = "PACKED"  # what the "varlen" mask function hands every layer for a packed row


@dataclasses.dataclass
class SeqLayout:
    """Where the sequences of a packed row lie, computed once per micro-batch, read by every layer.
    cu_seqlens [n+1] and max_len drive the CUDA kernels. The CPU kernel runs one causal sdpa call per
    bucket of similar lengths over a right-padded view: `gather` [R] picks the view's rows from the
    packed row (padding repeats a sequence's last token), `scatter` [T] the view row of each packed
    token. Right padding is exact under a causal mask: a real query never sees a pad key."""
    kernel: str
    cu_seqlens: torch.Tensor
    max_len: int
    buckets: list = None  # [(sequences, padded length)] in gather order
    gather: torch.Tensor = None
    scatter: torch.Tensor = None


def seq_layout(lengths, device):
    """The SeqLayout of sequences of these lengths packed back to back, for this device's kernel."""
    kernel = varlen_kernel(device.type)
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)  # [n+1]
    if kernel != "sdpa-buckets":
        return SeqLayout(kernel, cu_seqlens, max(lengths))
    groups = []  # longest first; a sequence joins the open bucket if >= BUCKET_RATIO of its longest
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= BUCKET_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    gather = []
    scatter = [0] * starts[-1]
    for group in groups:
        for i in group:
            pad = lengths[group[0]] - lengths[i]
            scatter[starts[i]:starts[i + 1]] = range(len(gather), len(gather) + lengths[i])
            gather += [*range(starts[i], starts[i + 1]), *[starts[i + 1] - 1] * pad]
    buckets = [(len(g), lengths[g[0]]) for g in groups]
    gather = torch.tensor(gather, dtype=torch.long, device=device)  # [R]
    scatter = torch.tensor(scatter, dtype=torch.long, device=device)  # [T]
    return SeqLayout(kernel, cu_seqlens, max(lengths), buckets, gather, scatter)


@functools.lru_cache(maxsize=None)
def varlen_kernel(device_type):
    """Picked once per process: on CUDA torch's varlen_attn, else flash-attn's, each only if it
    agrees with per-sequence sdpa forward and backward (kernel_agrees); otherwise (and on CPU)
    sdpa-buckets."""
    if device_type != "cuda":
        return "sdpa-buckets"
    for name in ("torch-varlen", "flash-attn-varlen"):
        try:
            if kernel_agrees(functools.partial(_cuda_varlen, name), "cuda", torch.bfloat16):
                return name
            print(f"varlen attention: {name} disagrees with causal sdpa (output or gradients), not "
                  "used", file=sys.stderr)
        except Exception as e:  # not installed, or a torch whose varlen_attn lacks enable_gqa
            print(f"varlen attention: {name} unavailable ({type(e).__name__}: {str(e)[:120]})",
                  file=sys.stderr)
    return "sdpa-buckets"


def kernel_agrees(attend, device, dtype, tolerance=3e-2):
    """Whether attend(q, k, v, cu_seqlens, max_len, scale) (q [T, Hq, d], k and v [T, Hkv, d] ->
    [T, Hq, d]) runs causal attention within each sequence: on two sequences of a tiny GQA case its
    output and the gradients of q, k and v match fp32 per-sequence sdpa on the same inputs, each to
    `tolerance` x the largest value of the reference (bf16 rounds to ~0.4%). The trainer needs the
    backward as much as the forward; a kernel's backward can be wrong while its forward is right."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, h, 64, generator=g) for h in (4, 2, 2))
    grad = torch.randn(24, 4, 64, generator=g)
    inputs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=device)
    with torch.enable_grad():  # the first caller may be under no_grad (sequence_logprobs)
        out = attend(*inputs, cu, 15, 0.125)  # [24, 4, 64]
        out.backward(grad.to(device, out.dtype))
    exact = [x.detach().float().cpu().requires_grad_() for x in inputs]  # the same rounded inputs
    with torch.enable_grad():
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in exact), is_causal=True, scale=0.125,
            enable_gqa=True).transpose(0, 1) for a, b in ((0, 9), (9, 24))])  # [24, 4, 64]
        ref.backward(grad)
    pairs = [(out, ref)] + [(x.grad, y.grad) for x, y in zip(inputs, exact)]
    return all(got is not None and got.shape == want.shape
               and (got.float().cpu() - want).abs().max() <= tolerance * want.abs().max()
               for got, want in pairs)


def _cuda_varlen(name, q, k, v, cu_seqlens, max_len, scale):
    """Causal attention per sequence on CUDA: q [T, Hq, d], k and v [T, Hkv, d] -> [T, Hq, d]."""
    if name == "torch-varlen":
        from torch.nn.attention.varlen import varlen_attn  # window_size, enable_gqa: torch >= 2.13
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                           window_size=(-1, 0), enable_gqa=k.shape[1] != q.shape[1])
    from flash_attn import flash_attn_varlen_func  # GQA natively
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
                                  softmax_scale=scale, causal=True)


def varlen_mask(*, attention_mask=None, allow_is_causal_skip=True, **kwargs):
    """The mask function of "varlen": PACKED for a packed row (where transformers would build the
    block-diagonal [T, T] mask), sdpa's own mask otherwise (None for a plain causal row)."""
    from transformers.masking_utils import sdpa_mask
    if attention_mask is None and not allow_is_causal_skip:
        return PACKED
    return sdpa_mask(attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     seq_layout=None, **kwargs):
    """The attention function of "varlen": query [1, Hq, T, d], key and value [1, Hkv, T, d] ->
    ([1, T, Hq, d], None), attending within each sequence of seq_layout only."""
    if attention_mask is not PACKED:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if seq_layout is None:
        raise RuntimeError("a packed row reached the varlen attention without its seq_layout: run "
                           "packed rows through common.packed_logprobs")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("varlen attention has no sliding window: use --attn sdpa")
    if dropout:  # torch's varlen_attn takes none: no kernel applies it, the same model on every device
        raise NotImplementedError(f"varlen attention has no dropout (the model asks for "
                                  f"{dropout:g} in training): use --attn sdpa, or a model without it")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, d]
    lay = seq_layout
    if lay.kernel != "sdpa-buckets":  # flash kernels take 16-bit inputs; RoPE leaves q, k in fp32
        if q.dtype == torch.float32 and not torch.is_autocast_enabled("cuda"):
            raise RuntimeError(f"{lay.kernel} needs bf16/fp16 inputs: run under torch.autocast")
        dtype = torch.get_autocast_dtype("cuda") if q.dtype == torch.float32 else q.dtype
        q, k, v = (x.to(dtype) for x in (q, k, v))
        return _cuda_varlen(lay.kernel, q, k, v, lay.cu_seqlens, lay.max_len, scaling)[None], None
    rows = [x.index_select(0, lay.gather) for x in (q, k, v)]  # [R, H, d], bucket after bucket
    out = []
    start = 0
    for b, width in lay.buckets:
        view = [x[start:start + b * width].unflatten(0, (b, width)).transpose(1, 2)
                for x in rows]  # [b, H, w, d]
        o = torch.nn.functional.scaled_dot_product_attention(
            *view, is_causal=True, scale=scaling,
            enable_gqa=key.shape[1] != query.shape[1])  # [b, Hq, w, d]
        out.append(o.transpose(1, 2).flatten(0, 1))  # [b w, Hq, d]
        start += b * width
    return torch.cat(out).index_select(0, lay.scatter)[None], None  # [1, T, Hq, d]


def register_varlen():
    """Make attn_implementation="varlen" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("varlen", varlen_attention)
    AttentionMaskInterface.register("varlen", varlen_mask)


DROPOUT_NAMES = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")


def attention_dropout(config):
    """The attention dropout a model config sets, under the names transformers' models use (0.0
    for none)."""
    values = [getattr(config, name, None) for name in DROPOUT_NAMES]
    return max([float(x) for x in values if isinstance(x, (int, float))] + [0.0])


def attention_kernel(attn, device):
    """What runs the attention of a packed row: for the run's first line and config.json."""
    if attn != "varlen":
        return f"{attn} under a dense block-diagonal [T, T] mask"
    return f"varlen ({varlen_kernel(device.type)})"
