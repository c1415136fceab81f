"""The packed training step: packed == padded == one sequence at a time (logits and gradients; the varlen attention
and the dense-mask sdpa and eager references), no [T, T] mask for a packed row, the memory-lean log-prob equals
log_softmax + gather, and the micro-batch split never changes the gradient."""
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingOptimizer, assert_grads_close, make_samples

from common import (Sample, chunked_logprobs, load_model, pack_microbatches, packed_inputs, packed_logprobs,
                    policy_update, sequence_logprobs, token_coefficients)
from common import seq_layout

def one_at_a_time(model, samples):
    """Reference: each sequence alone, plain forward, full logits. Returns per-sequence [L, V] logits."""
    return [model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0] for s in samples]


def padded(model, samples):
    """Right-padded batch with a 2-D attention mask."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])  # [B, L]
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])  # [B, L]
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
    return [logits[i, :len(x)] for i, x in enumerate(seqs)]


def packed(model, samples, attention_mask=None):
    """All sequences in one row, restarting position ids, no mask: what the trainer does."""
    ids, pos, _ = packed_inputs(samples, "cpu")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    varlen = {"seq_layout": seq_layout(lengths, ids.device)} if model.config._attn_implementation == "varlen" else {}
    logits = model(input_ids=ids, position_ids=pos, attention_mask=attention_mask, use_cache=False, **varlen).logits[0]
    return list(logits.split(lengths))


def completion_logprob_sum(logits_list, samples):
    total = 0
    for logits, s in zip(logits_list, samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        lp = logits[p - 1:p + c - 1].log_softmax(-1).gather(1, torch.tensor(s.completion_ids)[:, None])
        total = total + lp.sum()
    return total


def grads_of(model, fn, samples):
    model.zero_grad()
    completion_logprob_sum(fn(model, samples), samples).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return grads


@pytest.mark.parametrize("attn", ["varlen", "sdpa", "eager"])
def test_packed_equals_padded_equals_single(tiny_dir, tiny, attn):
    model = load_model(tiny_dir, torch.device("cpu"), attn=attn)
    samples = make_samples(len(tiny[1]))
    ref = one_at_a_time(model, samples)
    for other in (padded(model, samples), packed(model, samples)):
        for a, b in zip(ref, other):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-5)  # logits are ~20x scaled: absolute error ~1e-5
    g_ref, g_pad, g_pack = (grads_of(model, fn, samples) for fn in (one_at_a_time, padded, packed))
    assert_grads_close(g_pack, g_ref)
    assert_grads_close(g_pad, g_ref)


def test_packing_trap_all_ones_mask_leaks_across_sequences(tiny_dir, tiny):
    """The silent failure the trainer avoids: an all-ones mask disables packed-sequence detection."""
    model, tokenizer = load_model(tiny_dir, torch.device("cpu"), attn="sdpa"), tiny[1]
    samples = make_samples(len(tokenizer))
    ref = one_at_a_time(model, samples)
    ids, _, _ = packed_inputs(samples, "cpu")
    leaky = packed(model, samples, attention_mask=torch.ones_like(ids))
    assert (leaky[1] - ref[1]).abs().max() > 1e-2  # the second sequence attended to the first


# ---------------------------------------------------------------- the varlen attention (GQA: the tiny model has 4
# query heads and 2 key/value heads)

# (prompt, completion): a length-1 completion, a 70-token sequence longer than the smaller budgets, and 24 short
# sequences of 5-9 tokens that share micro-batches
VARLEN_LENGTHS = [(6, 1), (30, 40), (3, 9), (5, 5)] + [(2 + k % 3, 3 + k % 5) for k in range(24)]


def test_varlen_logprobs_and_gradients_equal_one_sequence_at_a_time_across_budgets(tiny):
    model, tokenizer = tiny
    assert model.config._attn_implementation == "varlen" and model.config.num_key_value_heads < 4
    vocab = len(tokenizer)
    samples = make_samples(vocab, seed=3, lengths=VARLEN_LENGTHS)
    coefs = token_coefficients([c for _, c in VARLEN_LENGTHS], "seq_mean")
    # reference: each sequence alone (no packing, no mask), the policy-gradient loss written out:
    # on-policy the clipped surrogate's gradient is -sum_i c_i A_i sum_t grad log p_it
    want_lp, loss = [], 0
    for s, c in zip(samples, coefs):
        logits = model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, :, :vocab]
        p, n = len(s.prompt_ids), len(s.completion_ids)
        lp = logits[p - 1:p + n - 1].log_softmax(-1).gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        want_lp.append(lp.detach())
        loss = loss - float(c) * s.advantage * lp.sum()
    model.zero_grad()
    loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for budget in (100_000, 64, 16):  # one micro-batch; several; every sequence alone (70 > 64 goes alone too)
        got_lp = sequence_logprobs(model, samples, 1.0, vocab, token_budget=budget, chunk=7)
        for g, w in zip(got_lp, want_lp):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, coefs, temperature=1.0, vocab_size=vocab, token_budget=budget,
                              eps_low=0.2, eps_high=0.2, beta=0.0, grad_clip=1e9, chunk=7)
        assert stats["micro_batches"] == len(pack_microbatches([p + c for p, c in VARLEN_LENGTHS], budget))
        assert_grads_close(opt.grads, want_grads)


def test_seq_layout_buckets_by_hand():
    """Lengths 3, 5, 4, 1 at offsets 0, 3, 8, 12. Longest first: 5 opens a bucket, 4 >= 0.8 * 5 joins it (padded
    to 5), 3 < 0.8 * 5 opens the next, 1 the last. Padding repeats the sequence's last position."""
    lay = seq_layout([3, 5, 4, 1], torch.device("cpu"))
    assert lay.kernel == "sdpa-buckets" and lay.max_len == 5 and lay.cu_seqlens.tolist() == [0, 3, 8, 12, 13]
    assert lay.buckets == [(2, 5), (1, 3), (1, 1)]
    assert lay.gather.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 0, 1, 2, 12]
    assert lay.scatter.tolist() == [10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 13]
    assert lay.gather[lay.scatter].tolist() == list(range(13))  # every token comes back from its own row


def tensor_shapes_during(fn):
    """Every shape an aten op produces while fn() runs, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    shapes.append(tuple(t.shape))
            return out
    shapes = []
    with Record():
        fn()
    return shapes


@pytest.mark.parametrize("attn", ["varlen", "sdpa"])
def test_a_packed_micro_batch_never_builds_a_dense_t_by_t_tensor(tiny_dir, tiny, attn):
    """No mask and no score matrix of the whole row: T appears at most once in any tensor made in forward or
    backward. The dense-mask sdpa reference is probed the same way and does build one, so the probe can fail."""
    model, vocab = load_model(tiny_dir, torch.device("cpu"), attn=attn), len(tiny[1])
    samples = make_samples(vocab, seed=4, lengths=[(5, 9), (7, 4), (3, 11), (6, 6), (4, 6)])
    T = 61  # prime, and no dimension of the model
    assert sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) == T
    shapes = tensor_shapes_during(lambda: packed_logprobs(model, samples, 1.0, vocab, chunk=16).sum().backward())
    dense = [s for s in shapes if s.count(T) >= 2]
    if attn == "varlen":
        assert not dense, dense[:5]
    else:
        assert dense  # the block-diagonal mask (and the scores) of the dense path


def test_a_packed_row_without_its_layout_fails_loudly(tiny):
    """Restarting position ids with no seq_layout would silently attend across sequences: it raises instead."""
    model, tokenizer = tiny
    ids, pos, _ = packed_inputs(make_samples(len(tokenizer)), "cpu")
    with pytest.raises(RuntimeError, match="without its seq_layout"):
        model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False)


def test_hf_generate_is_unchanged_by_the_varlen_attention(tiny_dir, tiny):
    """The policy model also generates (HF fallback): left-padded batches with a KV cache take sdpa's path."""
    from common import HFEngine
    tokenizer = tiny[1]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    outs = []
    for attn in ("varlen", "sdpa"):
        engine = HFEngine(load_model(tiny_dir, torch.device("cpu"), attn=attn), tokenizer, len(tokenizer),
                          [tokenizer.eos_token_id])
        outs.append([engine.generate(prompts, n=1, temperature=0.0, max_tokens=10, seed=0),
                     engine.generate(prompts, n=3, temperature=1.0, max_tokens=10, seed=0)])
    assert outs[0] == outs[1]


def test_packed_inputs_layout():
    ids, pos, predict = packed_inputs([Sample([5, 6], [7]), Sample([8], [9, 2])], "cpu")
    assert ids.tolist() == [[5, 6, 7, 8, 9, 2]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert predict.tolist() == [1, 3, 4]  # 6->7, 8->9, 9->2; never 7->8 across the boundary


def test_packed_logprobs_equal_plain_log_softmax(tiny):
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab)
    for temperature in (1.0, 0.7):
        got = packed_logprobs(model, samples, temperature, vocab, chunk=3)
        want = []
        for logits, s in zip(one_at_a_time(model, samples), samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            lp = (logits[p - 1:p + c - 1, :vocab] / temperature).log_softmax(-1)  # padded ids excluded
            want.append(lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
        torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_value_and_grad_match_full():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 40, (37,))
    full = F.log_softmax((hidden @ weight[:40].T) / 0.8, -1).gather(1, targets[:, None])[:, 0]
    gh_full, gw_full = torch.autograd.grad(full.sum() * 2, (hidden, weight))
    lean = chunked_logprobs(hidden, weight, targets, temperature=0.8, vocab_size=40, chunk=8)  # 8 does not divide 37
    torch.testing.assert_close(lean, full)
    gh, gw = torch.autograd.grad(lean.sum() * 2, (hidden, weight))
    torch.testing.assert_close(gh, gh_full)
    torch.testing.assert_close(gw, gw_full)


def test_chunked_logprobs_never_keeps_a_tokens_by_vocab_tensor():
    """Autograd must save no logits-shaped [*, V] tensor for backward: each chunk is recomputed (checkpointed).
    The same probe on a plain log_softmax + gather does see the [N, V] logits, so the check can fail."""
    from common import _logprob_chunk
    n, vocab, d = 64, 1000, 16

    def saved_shapes(fn):
        hidden = torch.randn(n, d, requires_grad=True)
        weight = torch.randn(vocab, d, requires_grad=True)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = fn(hidden, weight, torch.randint(0, vocab, (n,)))
        out.sum().backward()
        assert hidden.grad is not None and weight.grad is not None
        return shapes
    lean = saved_shapes(lambda h, w, t: chunked_logprobs(h, w, t, chunk=8))
    plain = saved_shapes(lambda h, w, t: _logprob_chunk(h, w, t, 1.0))
    assert (n, vocab) in plain
    assert not [s for s in lean if s[-1] == vocab], lean


def test_pack_microbatches_respects_budget_and_covers_everything():
    lengths = [5, 9, 3, 7, 12, 1, 8, 20]
    bins = pack_microbatches(lengths, 16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins if len(b) > 1)
    assert [7] in bins  # the 20-token sequence is longer than the budget: alone
    # first-fit decreasing by hand: 20 | 12 3 1 | 9 7 | 8 5  (the other 45 tokens in the minimum 3 bins of 16)
    assert sorted(map(sorted, bins)) == sorted([[7], [2, 4, 5], [1, 3], [0, 6]])


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean", "constant"])
def test_microbatch_split_never_changes_the_gradient(tiny, loss_agg):
    model, tokenizer = tiny
    vocab = len(tokenizer)
    lengths = [(5, 3), (4, 8), (9, 2), (3, 6), (6, 6), (2, 11)]
    samples = make_samples(vocab, seed=1, lengths=lengths)
    coefs = token_coefficients([c for _, c in lengths], loss_agg, max_len=12)
    ref = sequence_logprobs(model, samples, 1.0, vocab, token_budget=10_000)
    results = []
    for budget in (10_000, 14, 1):  # one micro-batch, a few, one sequence each
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, coefs, temperature=1.0, vocab_size=vocab, token_budget=budget,
                              eps_low=0.2, eps_high=0.2, beta=0.1, ref_logps=ref, grad_clip=1e9, chunk=4)
        results.append((stats, opt.grads))
    assert [r[0]["micro_batches"] for r in results][0] == 1 and results[2][0]["micro_batches"] == len(lengths)
    for stats, grads in results[1:]:
        assert stats["loss"] == pytest.approx(results[0][0]["loss"], abs=1e-6)
        assert_grads_close(grads, results[0][1])


def test_a_model_whose_attention_crosses_packed_sequences_is_refused_at_load(tiny_dir, monkeypatch, capsys):
    """A model whose attention ignores the packed layout (here: "varlen" made plain causal attention over the whole
    row, as a --trust_remote_code model that bypasses transformers' attention interface would run) attends across the
    sequences of a packed row with no error. load_model checks once: exit 2, one line naming --attn."""
    import common
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def across_the_row(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                      is_causal=True)
    monkeypatch.setattr(common, "varlen_attention", across_the_row)
    try:
        with pytest.raises(SystemExit) as stop:
            load_model(tiny_dir, torch.device("cpu"), attn="varlen")
    finally:
        monkeypatch.undo()
        common.register_varlen()  # the real one again, for the models of the tests that follow
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: --attn varlen: packed"), errors
    assert load_model(tiny_dir, torch.device("cpu"), attn="varlen") is not None  # the real attention passes


def test_a_model_that_ignores_the_position_ids_is_refused(tiny):
    """Attention can stay within each sequence while the positions do not: a model with absolute position
    embeddings that ignores the position ids counts the second sequence of a packed row from the row's start
    (rotary embeddings would not care: they see only position differences). A changed partner of the same length
    does not move it; packed against alone does, and check_packing stops the run with one line naming --attn."""
    from common import check_packing, packing_leak
    model, _ = tiny
    assert packing_leak(model) < 1e-4
    embed = model.get_input_embeddings()
    forward = embed.forward
    table = torch.randn(512, embed.embedding_dim, generator=torch.Generator().manual_seed(0))

    def row_positions(ids):  # an absolute position embedding of positions 0..T-1 over the whole row
        return forward(ids) + table[:ids.shape[-1]]
    embed.forward = row_positions
    try:
        assert packing_leak(model) > 1e-2
        with pytest.raises(SystemExit) as stop:
            check_packing(model, "varlen")
    finally:
        embed.forward = forward
    assert stop.value.code == 2


def test_attention_dropout_is_refused_with_varlen_on_every_device(tiny_dir, tmp_path, capsys):
    """torch's CUDA varlen kernel takes no dropout (varlen_attn has no dropout_p), the CPU path used to apply it:
    the same model trained differently on the two. Now refused on both: at load (one line naming --attn, exit 2)
    and, for a config that names it otherwise, in the attention itself. sdpa applies it, and a frozen model has none."""
    import json
    import shutil
    folder = tmp_path / "dropout"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    with pytest.raises(SystemExit) as stop:
        load_model(str(folder), torch.device("cpu"), attn="varlen")
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 2 and len(errors) == 1 and errors[0].startswith("error: --attn varlen: the model trains "
                                                                              "with attention dropout 0.1"), errors
    assert load_model(str(folder), torch.device("cpu"), attn="varlen", frozen=True) is not None
    model = load_model(str(folder), torch.device("cpu"), attn="sdpa")
    model.config._attn_implementation = "varlen"  # as a model whose config calls its dropout by another name
    samples = make_samples(model.config.vocab_size)
    with pytest.raises(NotImplementedError, match="varlen attention has no dropout"):
        packed_logprobs(model, samples, 1.0, None, 1024)


def reference_attention(q, k, v, cu_seqlens, max_len, scale, causal=True):
    """Per-sequence attention written out (softmax of masked scores), q [T, Hq, d], k and v [T, Hkv, d]."""
    out = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H, n, d]
        ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], dim=0) for x in (ks, vs))
        scores = qs @ ks.transpose(1, 2) * scale  # [Hq, n, n]
        if causal:
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        out.append((scores.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


class RightForwardWrongBackward(torch.autograd.Function):
    """The forward of causal attention with the backward of attention without the causal mask: the kind of kernel
    the old probe passed (it compared the forward only)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_len, scale):
        ctx.save_for_backward(q, k, v, cu_seqlens)
        ctx.scale = scale
        return reference_attention(q, k, v, cu_seqlens, max_len, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_seqlens = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q, k, v)]
            out = reference_attention(*inputs, cu_seqlens, 0, ctx.scale, causal=False)
            grads = torch.autograd.grad(out, inputs, grad)
        return (*grads, None, None, None)


def test_the_cuda_kernel_probe_checks_the_backward_too():
    """varlen_kernel picks a CUDA kernel only if kernel_agrees: its output and the gradients of q, k and v against
    per-sequence sdpa. Checked here with CPU stand-ins for a kernel: right (fp32 and bf16), attending across the
    two sequences, and right forward with a wrong backward."""
    from common import kernel_agrees
    assert kernel_agrees(reference_attention, "cpu", torch.float32)
    assert kernel_agrees(reference_attention, "cpu", torch.bfloat16)  # bf16 rounding stays within the tolerance
    whole_row = lambda q, k, v, cu, n, scale: reference_attention(q, k, v, cu[[0, -1]], n, scale)
    assert not kernel_agrees(whole_row, "cpu", torch.float32)
    assert not kernel_agrees(RightForwardWrongBackward.apply, "cpu", torch.float32)
