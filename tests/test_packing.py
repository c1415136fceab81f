"""The packed training step: packed == padded == one sequence at a time (logits and gradients; the
varlen attention and the dense-mask sdpa and eager references), across the test models (Qwen2,
Llama, Mistral, Gemma2, Cohere, Granite: their attention code and their touch after the LM head);
the varlen attention's sequence bounds read from the position ids, by hand; no [T, T] mask for a
packed row; attention dropout and sliding windows; the memory-lean log-prob equals
log_softmax + gather (and the post-head transforms, by hand); the micro-batch split never changes
the gradient."""
import json
import math
import shutil
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import (_BASE, ARCH_CONFIGS, DROPOUT_ARCHS, POST_HEAD, TINY_VOCAB, WINDOW,
                      WINDOWED, RecordingOptimizer, assert_grads_close, build_arch, make_samples)

import common
from common import (Packed, Passes, Sample, check_packing, chunked_logprobs, first_slots,
                    flash_attention, flash_layout, load_model, make_optimizer, pack_microbatches,
                    packed_inputs, packed_logprobs, packed_row, policy_update, seq_layout,
                    sequence_logprobs, shared_mask, sink_attention, token_coefficients,
                    varlen_attention)


def one_at_a_time(model, samples):
    """Reference: each sequence alone, plain forward, full logits. Returns per-sequence [L, V]
    logits."""
    return [model(input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0]
            for s in samples]


def padded(model, samples):
    """Right-padded batch with a 2-D attention mask."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(map(len, seqs))
    ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])  # [B, L]
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])  # [B, L]
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
    return [logits[i, :len(x)] for i, x in enumerate(seqs)]


def packed(model, samples, attention_mask=None):
    """All sequences in one row, restarting position ids, no mask: what the trainer does (the varlen
    attention finds the sequences from the position ids)."""
    ids, pos, _, _ = packed_inputs(samples, "cpu")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    logits = model(input_ids=ids, position_ids=pos, attention_mask=attention_mask,
                   use_cache=False).logits[0]
    return list(logits.split(lengths))


def completion_logprob_sum(logits_list, samples):
    total = 0
    for logits, s in zip(logits_list, samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        lp = logits[p - 1:p + c - 1].log_softmax(-1).gather(
            1, torch.tensor(s.completion_ids)[:, None])
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
            # logits are ~20x scaled: absolute error ~1e-5
            torch.testing.assert_close(a, b, atol=2e-4, rtol=1e-5)
    g_ref, g_pad, g_pack = (grads_of(model, fn, samples) for fn in (one_at_a_time, padded, packed))
    assert_grads_close(g_pack, g_ref)
    assert_grads_close(g_pad, g_ref)


def test_packing_trap_all_ones_mask_leaks_across_sequences(tiny_dir, tiny):
    """The silent failure the trainer avoids: an all-ones mask disables packed-sequence
    detection."""
    model, tokenizer = load_model(tiny_dir, torch.device("cpu"), attn="sdpa"), tiny[1]
    samples = make_samples(len(tokenizer))
    ref = one_at_a_time(model, samples)
    ids, _, _, _ = packed_inputs(samples, "cpu")
    leaky = packed(model, samples, attention_mask=torch.ones_like(ids))
    assert (leaky[1] - ref[1]).abs().max() > 1e-2  # the second sequence attended to the first


# ---------------------------------------------------------------- the varlen attention (GQA: the
# tiny model has 4 query heads and 2 key/value heads)

# (prompt, completion): a length-1 completion, a 70-token sequence longer than the smaller budgets,
# and 24 short sequences of 5-9 tokens that share micro-batches
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
    for s, c in zip(samples, coefs.tolist()):
        s.coef = c  # policy_update reads each sample's coefficient
        logits = model(
            input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, :, :vocab]
        p, n = len(s.prompt_ids), len(s.completion_ids)
        lp = logits[p - 1:p + n - 1].log_softmax(-1).gather(
            1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        want_lp.append(lp.detach())
        loss = loss - c * s.advantage * lp.sum()
    model.zero_grad()
    loss.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # one micro-batch; several; every sequence alone (70 > 64 goes alone too)
    for budget in (100_000, 64, 16):
        passes = Passes(temperature=1.0, vocab_size=vocab, token_budget=budget, chunk=7)
        got_lp = sequence_logprobs(model, samples, passes)
        for g, w in zip(got_lp, want_lp):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, passes, clip=(0.2, 0.2), beta=0.0, grad_clip=1e9)
        assert stats["micro_batches"] == len(pack_microbatches(samples, budget))
        assert_grads_close(opt.grads, want_grads)


# ---------------------------------------------------------------- across the test models

# (prompt, completion): a length-1 completion, sequences of 3 to 32 tokens in several buckets
# (with padding)
ARCH_LENGTHS = [(6, 1), (3, 9), (12, 20), (5, 5), (2, 3), (4, 4), (1, 2)]


def alone_logprobs(model, samples, vocab, temperature=1.0):
    """Reference: each sequence alone through the model's own full forward, log_softmax of its
    logits (the model's touch after the LM head included) over the real vocabulary, at the sampled
    tokens: [N]."""
    out = []
    for s in samples:
        p = len(s.prompt_ids)
        logits = model(
            input_ids=torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, p - 1:-1, :vocab]
        out.append((logits / temperature).log_softmax(-1)
                   .gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
    return torch.cat(out)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("arch", ["qwen2", *ARCH_CONFIGS])
def test_packed_logprobs_and_gradients_equal_alone_across_the_zoo(tiny_dir, arch_dir, arch, shared):
    """With --attn varlen every architecture's packed log-probs and their gradients equal each
    sequence alone through the model's own eager attention (fp32, 1e-5), a group's prompt laid out
    once or not: its attention code hands the varlen attention the position ids, its scale, GQA /
    MQA, its layers' sliding windows (8 tokens, shorter than most sequences here), gpt-oss's sinks;
    packed_logprobs applies its touch after the LM head. The start-up check passes it packed. That
    touch matters: without it (config=None, no bias) Gemma2's, Cohere's and Granite's log-probs
    and Phi's (its LM head's bias) miss the reference by far more than the tolerance."""
    folder = tiny_dir if arch == "qwen2" else arch_dir(arch)
    model = load_model(folder, torch.device("cpu"), attn="varlen")
    eager = load_model(folder, torch.device("cpu"), attn="eager")  # the same weights
    assert model.config._attn_implementation == "varlen" and model.training
    vocab = model.config.vocab_size - 30  # the padded rows past the tokenizer are never targets
    samples = make_samples(vocab, seed=2, lengths=ARCH_LENGTHS)
    if shared:  # groups of 4, 1 and 3 completions behind one prompt each, side by side
        samples = sorted(grouped_samples(vocab, [4, 1, 3], seed=1), key=lambda s: s.prompt_ids)
    want = alone_logprobs(eager, samples, vocab)
    want.sum().backward()
    want_grads = {n: p.grad.clone() for n, p in eager.named_parameters()}
    got = packed_logprobs(model, samples, 1.0, vocab, chunk=7, shared=shared)
    torch.testing.assert_close(got.detach(), want.detach(), atol=1e-5, rtol=1e-6)
    got.sum().backward()
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, want_grads)
    model.zero_grad()
    passes, _ = check_packing(model, Passes(1.0, vocab, 4096, shared=shared), "varlen", 64)
    assert passes.packed and passes.shared is shared
    if shared:
        return
    with torch.no_grad():  # the temperature divides the transformed logits
        torch.testing.assert_close(packed_logprobs(model, samples, 0.7, vocab, chunk=7),
                                   alone_logprobs(eager, samples, vocab, 0.7), atol=1e-5,
                                   rtol=1e-6)
        ids, pos, predict, targets = packed_inputs(samples, "cpu")
        with packed_row(pos):
            hidden = model.get_decoder()(input_ids=ids, position_ids=pos, attention_mask=None,
                                         use_cache=False).last_hidden_state[0, predict]
        bare = chunked_logprobs(hidden, model.get_output_embeddings().weight[:vocab], targets,
                                config=None)
    gap = (bare - want.detach()).abs().max().item()
    if arch in POST_HEAD:
        # a thousand times the tolerance: the check above would fail without the touch
        assert gap > 1e-2, gap
    else:
        assert gap < 1e-5 + 1e-6 * want.detach().abs().max().item(), gap


@pytest.mark.parametrize("arch", sorted(WINDOWED))
def test_the_zoos_sliding_windows_bind(tmp_path, arch):
    """The zoo's windows change the log-probs of its test sequences: the same weights with a window
    wider than every sequence give others, so packed == alone above checks the window. A varlen
    attention that ignored the window fails that test."""
    samples = make_samples(TINY_VOCAB, seed=2, lengths=ARCH_LENGTHS)
    narrow = load_model(build_arch(str(tmp_path / "narrow"), arch), torch.device("cpu"),
                        attn="eager")
    wide = load_model(build_arch(str(tmp_path / "wide"), arch, sliding_window=128),
                      torch.device("cpu"), attn="eager")
    assert narrow.config.sliding_window == WINDOW < max(p + c for p, c in ARCH_LENGTHS)
    with torch.no_grad():
        gap = (alone_logprobs(narrow, samples, TINY_VOCAB)
               - alone_logprobs(wide, samples, TINY_VOCAB)).abs().max().item()
    assert gap > 1e-3, gap


def test_a_packed_row_without_the_packed_layout_raises_naming_the_layer(arch_dir):
    """gpt-oss makes its masks without the position ids, so transformers cannot see that a row is
    packed: outside packed_row its sequences would attend to each other. varlen_attention's guard
    raises instead, naming the layer's class; inside packed_row the same row is exact."""
    model = load_model(arch_dir("gpt_oss"), torch.device("cpu"), attn="varlen").eval()
    samples = make_samples(TINY_VOCAB, seed=2, lengths=ARCH_LENGTHS)
    ids, pos, _, _ = packed_inputs(samples, "cpu")
    with torch.no_grad(), pytest.raises(RuntimeError, match="GptOssAttention's attention"):
        model(input_ids=ids, position_ids=pos, attention_mask=None)
    with torch.no_grad(), packed_row(pos):
        logits = model(input_ids=ids, position_ids=pos, attention_mask=None).logits[0]
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    eager = load_model(arch_dir("gpt_oss"), torch.device("cpu"), attn="eager").eval()
    for got, want in zip(logits.split(lengths), one_at_a_time(eager, samples)):
        torch.testing.assert_close(got, want.detach(), atol=1e-4, rtol=1e-5)


def test_eager_runs_gpt_oss_one_sequence_a_forward(arch_dir):
    """--attn eager: gpt-oss's own masks do not see a packed row (its sequences would attend to
    each other), so the start-up check has each sequence run in a forward of its own, which
    equals the model's own forward of each alone, gradients too."""
    model = load_model(arch_dir("gpt_oss"), torch.device("cpu"), attn="eager")
    samples = make_samples(TINY_VOCAB, seed=2, lengths=ARCH_LENGTHS)
    with torch.no_grad():
        leaky = packed_logprobs(model, samples, 1.0, TINY_VOCAB)
        want = alone_logprobs(model, samples, TINY_VOCAB)
    assert (leaky - want).abs().max() > 1e-3  # packed, eager attends across the row
    passes, _ = check_packing(model, Passes(1.0, TINY_VOCAB, 4096, shared=False), "eager", 64)
    assert not passes.packed and model.training
    stats = policy_update(model, RecordingOptimizer(model), samples, passes, clip=(0.2, 0.2),
                          beta=0.0, grad_clip=1e9)
    assert stats["micro_batches"] == 1
    got = packed_logprobs(model, samples, 1.0, TINY_VOCAB, packed=passes.packed)
    torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-6)


def test_grpo_trains_a_gpt_oss_with_attn_eager_and_says_how(arch_dir, tiny, tmp_path, main_of):
    """`python grpo.py --attn eager` on a tiny gpt-oss (sinks, a sliding window, experts): the
    start-up check finds its masks blind to a packed row, says that each sequence runs in a
    forward of its own, and the run trains a step. With the default --attn varlen it trains
    packed, and says so."""
    folder = tmp_path / "gpt_oss"
    shutil.copytree(arch_dir("gpt_oss"), folder)
    tiny[1].save_pretrained(folder)  # the test tokenizer: the model's rows past it are padding
    command = ["--model", str(folder), "--rollout", "hf", "--steps", "1", "--prompts_per_step",
               "2", "--group_size", "2", "--eval_n", "2", "--max_tokens", "12"]
    for attn, said in (("eager", "(one sequence a forward pass, slower: its masks do not see a "
                                 "packed row) are the model's own"),
                       ("varlen", "start-up check passed: the trainer's log-probs (packed) are the "
                                  "model's own")):
        result = main_of("grpo", command + ["--attn", attn, "--out", str(tmp_path / attn)])
        assert result.returncode == 0, result.stderr[-3000:]
        assert said in result.stdout, result.stdout[-2000:]
        assert "done: test accuracy" in result.stdout


@pytest.mark.parametrize("attn", ["varlen", "eager"])
def test_a_model_with_other_token_mixers_is_refused_by_varlen_and_run_alone_by_eager(tmp_path,
                                                                                    attn):
    """LFM2's short convolutions mix each token with the ones before it, across a packed row's
    sequences: --attn varlen refuses it before any work (one line, exit 2, naming the layers and
    --attn eager); --attn eager runs each sequence in a forward of its own, exactly."""
    import transformers
    config = transformers.Lfm2Config(**{**_BASE, "num_key_value_heads": 1,
                                         "layer_types": ["conv", "full_attention"]})
    torch.manual_seed(0)
    folder = str(tmp_path / "lfm2")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    model = load_model(folder, torch.device("cpu"), attn=attn)
    passes = Passes(1.0, TINY_VOCAB, 4096, shared=attn == "varlen")
    if attn == "varlen":
        with pytest.raises(SystemExit) as stop:
            check_packing(model, passes, attn, 64)
        assert stop.value.code == 2
        return
    assert not check_packing(model, passes, attn, 64)[0].packed


def test_the_start_up_check_stops_a_varlen_run_whose_packed_step_is_wrong(arch_dir, monkeypatch,
                                                                          capsys):
    """The probe reaches past the model's window: with the window dropped from the packed
    attention's masks (a mutation of shared_mask), Mistral's packed log-probs leave the model's own
    and the check stops with one line naming the architecture and --attn eager, exit 2."""
    model = load_model(arch_dir("mistral"), torch.device("cpu"), attn="varlen")
    passes = Passes(1.0, TINY_VOCAB, 4096, shared=True)
    assert check_packing(model, passes, "varlen", 64)[0].packed
    unwindowed = common.shared_mask
    monkeypatch.setattr(common, "shared_mask",
                        lambda kb, own, q, k, window=None: unwindowed(kb, own, q, k))
    common.seq_layout.cache_clear()
    with pytest.raises(SystemExit) as stop:
        check_packing(model, passes, "varlen", 64)
    common.seq_layout.cache_clear()
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and err.count("\n") == 0
    assert "MistralForCausalLM" in err and "--attn eager" in err
    # a run whose sequences never pass the window probes short, and passes
    assert check_packing(model, passes, "varlen", WINDOW)[0].packed


@pytest.mark.parametrize("attn", ["varlen", "eager", "sdpa"])
@pytest.mark.parametrize("arch", DROPOUT_ARCHS)
def test_no_dropout_in_the_trainers_passes(arch_dir, arch, attn):
    """GPT-2, OPT (layerdrop too) and Starcoder2 configs with dropout 0.1: the trainer's log-probs,
    in train mode with gradients (gradient checkpointing on or off), packed as the start-up check
    allows, equal the model's own in eval mode (1e-4); and step 1 on tied groups (every advantage
    0, the policy still the reference) has kl 0 and gradient norm 0, not what dropout would give
    (kl 0.17-0.23, a gradient norm of 0.3-0.6)."""
    from transformers import AutoModelForCausalLM
    folder = arch_dir(arch)
    samples = make_samples(TINY_VOCAB, seed=1)
    own = AutoModelForCausalLM.from_pretrained(folder).eval()  # dropout as configured, eval mode
    with torch.no_grad():
        want = alone_logprobs(own, samples, TINY_VOCAB)
    for grad_ckpt in (False, True):
        model = load_model(folder, torch.device("cpu"), attn=attn, grad_ckpt=grad_ckpt)
        assert model.training and model.is_gradient_checkpointing == grad_ckpt
        passes, _ = check_packing(model, Passes(1.0, TINY_VOCAB, 4096, shared=attn == "varlen"),
                                  attn, 64)
        got = packed_logprobs(model, samples, 1.0, TINY_VOCAB, shared=passes.shared,
                              packed=passes.packed)
        assert got.requires_grad
        torch.testing.assert_close(got.detach(), want, atol=1e-4, rtol=0)
    ref = load_model(folder, torch.device("cpu"), attn=attn, frozen=True)
    for sample, ref_logps in zip(samples, sequence_logprobs(ref, samples, passes)):
        sample.advantage = 0.0  # every group tied
        sample.ref_logps = ref_logps
    stats = policy_update(model, RecordingOptimizer(model), samples, passes, clip=(0.2, 0.2),
                          beta=0.04)
    assert stats["kl"] < 1e-7 and stats["grad_norm"] < 1e-6, stats


def test_llama_4_and_bloom_are_run_alone_by_eager_and_their_advice_is_never_circular(
        arch_dir, tiny_dir, monkeypatch, capsys):
    """Llama 4 (chunked attention layers) and BLOOM (ALiBi, whose mask varlen cannot hand it) are
    refused by --attn varlen with --attn eager as the way out, and --attn eager runs each sequence
    alone, exactly (Llama 4's CausalLM has no decoder get_decoder() finds: its own logits are
    read). Where eager itself fails, or the probe differs only in train mode, the line says that
    and never advises the mode it is in."""
    from transformers import AutoModelForCausalLM
    samples = make_samples(TINY_VOCAB, seed=2)
    for arch, name in (("llama4", "Llama4ForCausalLM"), ("bloom", "BloomForCausalLM")):
        with pytest.raises(SystemExit) as stop:
            check_packing(load_model(arch_dir(arch), torch.device("cpu"), attn="varlen"),
                          Passes(1.0, TINY_VOCAB, 4096, shared=True), "varlen", 64)
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and name in err and "--attn eager" in err, err
        model = load_model(arch_dir(arch), torch.device("cpu"), attn="eager")
        passes, found = check_packing(model, Passes(1.0, TINY_VOCAB, 4096), "eager", 64)
        assert not passes.packed and found["max_error_nats"] < 1e-5
        own = AutoModelForCausalLM.from_pretrained(arch_dir(arch)).eval()
        with torch.no_grad():
            want = alone_logprobs(own, samples, TINY_VOCAB)
        got = packed_logprobs(model, samples, 1.0, TINY_VOCAB, packed=False)
        torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=0)
    # eager's own forward fails as the trainer calls it: said so, no advice to use eager
    model = load_model(tiny_dir, torch.device("cpu"), attn="eager")

    def failing(*args, **kwargs):
        raise TypeError("no position ids here")
    monkeypatch.setattr(common, "packed_logprobs", failing)
    with pytest.raises(SystemExit):
        check_packing(model, Passes(1.0, TINY_VOCAB, 4096), "eager", 64)
    err = capsys.readouterr().err.strip()
    assert "no position ids here" in err and "--attn eager runs" not in err, err
    monkeypatch.undo()
    # noise in train mode only (as a dropout no_dropout does not know): said so, for every mode
    noisy = model.get_decoder().norm.register_forward_hook(
        lambda module, args, out: out + torch.randn_like(out) if module.training else out)
    for attn in ("eager", "varlen"):
        model.set_attn_implementation(attn)
        with pytest.raises(SystemExit):
            check_packing(model, Passes(1.0, TINY_VOCAB, 4096), attn, 64)
        err = capsys.readouterr().err.strip()
        assert "in train mode its log-probs change" in err and "--attn eager" not in err, err
    noisy.remove()
    # each sequence alone still differs under eager: no mode left to advise
    want = common.eager_logprobs

    def shifted(*args):
        logps, noise = want(*args)
        return logps + 0.5, noise
    monkeypatch.setattr(common, "eager_logprobs", shifted)
    with pytest.raises(SystemExit):
        check_packing(model, Passes(1.0, TINY_VOCAB, 4096), "eager", 64)
    err = capsys.readouterr().err.strip()
    assert "no --attn mode here" in err and "--attn eager runs" not in err, err


def test_a_model_that_soft_caps_attention_is_refused_by_varlen(tmp_path):
    """Gemma2 soft-caps its attention scores (attn_logit_softcapping), which neither the bucketed
    sdpa nor the flash kernel does: --attn varlen refuses such a model (setup turns the ValueError
    into one line), and eager, which applies the cap, loads it."""
    folder = build_arch(str(tmp_path / "gemma2"), "gemma2", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="soft-capped .* use --attn eager"):
        load_model(folder, torch.device("cpu"), attn="varlen")
    model = load_model(folder, torch.device("cpu"), attn="eager")
    assert model.config.attn_logit_softcapping == 50.0


def test_shared_mask_and_first_slots_docstring_examples():
    """The two helpers of seq_layout, by their docstrings' examples."""
    mask = shared_mask([2, 1], [2, 1], query_len=2, key_len=4)  # [2, 1, 2, 4]
    assert mask.astype(int).tolist() == [[[[1, 1, 1, 0], [1, 1, 1, 1]]],
                                         [[[1, 1, 0, 0], [1, 1, 0, 0]]]]
    window = shared_mask([2, 1], [2, 1], query_len=2, key_len=4, window=2)
    assert window.astype(int).tolist() == [[[[0, 1, 1, 0], [0, 0, 1, 1]]],
                                           [[[1, 1, 0, 0], [1, 1, 0, 0]]]]
    assert list(first_slots([0, 1, 2, 2, 3])) == [0, 1, 2, 4]
    assert list(first_slots([3, 0, 1, 0, 2])) == [1, 2, 4, 0]  # padding repeats a placed row


def test_sink_attention_by_hand():
    """Attention with sinks, as gpt-oss's eager code computes it: a softmax over each query's
    scores and its head's sink logit, the sink's column then dropped. By hand for a masked bucket
    with GQA (4 query heads, 2 key/value heads), and for no mask: causal from the bottom right
    (3 queries, 5 keys: query j sees keys 0 .. 2 + j)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=g)
    k = torch.randn(2, 2, 5, 8, generator=g)
    v = torch.randn(2, 2, 5, 8, generator=g)
    sinks = torch.randn(4, generator=g)
    mask = torch.rand(2, 1, 3, 5, generator=g) > 0.4
    mask[..., 0] = True
    causal = torch.ones(3, 5, dtype=torch.bool).tril(2)
    for m in (mask, None):
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.5  # [2, 4, 3, 5]
        scores = scores.masked_fill(~(causal if m is None else m), -math.inf)
        sink = sinks[None, :, None, None].expand(2, 4, 3, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]  # [2, 4, 3, 5]
        want = (weights @ v.repeat_interleave(2, dim=1)).transpose(1, 2)  # [2, 3, 4, 8]
        got = sink_attention(q, k, v, m, sinks, 0.0, 0.5)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_seq_layout_docstring_example():
    """seq_layout's docstring example, as printed there."""
    buckets, keys, queries, scatter = seq_layout(torch.tensor([[0, 1, 2, 3, 4, 3]]))
    assert [b[:3] for b in buckets] == [(1, 5, 5), (1, 4, 1)]
    assert buckets[0].mask is None and buckets[1].mask.tolist() == [[[[True] * 4]]]
    assert keys.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5]
    assert queries.tolist() == [0, 1, 2, 3, 4, 5] and scatter.tolist() == [0, 1, 2, 3, 4, 5]


def test_seq_layout_buckets_by_hand():
    """The varlen attention reads a packed row's sequences from its position ids (each sequence
    starts at 0): lengths 3, 5, 4, 1 at offsets 0, 3, 8, 12. Longest first: 5 opens a bucket,
    4 >= 0.8 * 5 joins it (padded to 5), 3 < 0.8 * 5 opens the next, 1 the last. Padding repeats
    the sequence's last position. Unshared, every sequence is square: its queries are its keys, and
    sdpa's own causal mask serves (mask None)."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    buckets, keys, queries, scatter = seq_layout(pos)
    assert buckets == [(2, 5, 5, None), (1, 3, 3, None), (1, 1, 1, None)]
    assert keys.tolist() == queries.tolist() == [3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 0, 1, 2, 12]
    assert scatter.tolist() == [10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 13]
    assert queries[scatter].tolist() == list(range(13))  # every token comes back from its own row
    assert keys.dtype == scatter.dtype == torch.long and keys.device == pos.device
    # computed once per forward: every layer hands in the same position_ids tensor and gets the
    # cached layout
    assert seq_layout(pos)[1] is keys
    # a new row is laid out anew, not taken from the cache: lengths 2, 2, 3 (2 < 0.8 * 3: the 2s
    # share a second bucket)
    buckets, keys, queries, scatter = seq_layout(torch.tensor([[0, 1, 0, 1, 0, 1, 2]]))
    assert ([b[:3] for b in buckets] == [(1, 3, 3), (2, 2, 2)]
            and keys.tolist() == [4, 5, 6, 0, 1, 2, 3])
    assert scatter.tolist() == [3, 4, 5, 6, 0, 1, 2]
    # one sequence: one bucket, the identity
    buckets, keys, queries, scatter = seq_layout(torch.arange(6)[None])
    assert buckets == [(1, 6, 6, None)] and keys.tolist() == scatter.tolist() == list(range(6))


def test_seq_layout_shared_bucket_by_hand():
    """Two groups, shared: prompt P (rows 0-3) with completions a (row 4) and b (rows 5-7, positions
    4-6); prompt Q (rows 8-12) with c (row 13) and d (rows 14-15, positions 5-6). Square sequences
    P a (5) and Q c (6) share a causal bucket (5 >= 0.8 * 6). b and d run only their own queries,
    3 and 2 (d padded by its last row), against 7 keys each: P's rows and b's, Q's rows and d's.
    Query j of a sequence with k keys before its first query sees keys 0 .. k + j: b's first query
    sees P and itself (k = 4), d's sees Q and itself (k = 5)."""
    pos = torch.tensor([[0, 1, 2, 3, 4, 4, 5, 6, 0, 1, 2, 3, 4, 5, 5, 6]])
    buckets, keys, queries, scatter = seq_layout(pos)
    assert [b[:4] for b in buckets[:1]] == [(2, 6, 6, None)] and buckets[1][:3] == (2, 7, 3)
    assert keys.tolist() == [8, 9, 10, 11, 12, 13, 0, 1, 2, 3, 4, 4,  # Q c, P a (padded)
                             0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 14, 15]  # P b, Q d
    assert queries.tolist() == [8, 9, 10, 11, 12, 13, 0, 1, 2, 3, 4, 4, 5, 6, 7, 14, 15, 15]
    assert scatter.tolist() == [6, 7, 8, 9, 10, 12, 13, 14, 0, 1, 2, 3, 4, 5, 15, 16]
    assert queries[scatter].tolist() == list(range(16))
    mask = buckets[1][3].int().tolist()  # [2, 1, 3, 7]
    assert mask == [[[[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]],
                    # d's last: padding
                    [[[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]]]]


def test_flash_layout_by_hand():
    """The GPU path's index for docs/grpo.md#shared-prompt's picture, prompt p (3 tokens),
    completions a (2), b (3): row p0 p1 p2 a0 a1 b0 b1 b2 at positions 0 1 2 3 4 3 4 5. The first
    completion goes on from its prompt, so the queries are two runs, p a (5 rows) and b (3); the
    keys: p a itself, then p's rows and b's (6 keys for 3 queries). Unshared, every run is its own
    keys."""
    cu_q, cu_k, keys, max_q, max_k = flash_layout(torch.tensor([[0, 1, 2, 3, 4, 3, 4, 5]]))
    assert cu_q.tolist() == [0, 5, 8] and cu_k.tolist() == [0, 5, 11] and (max_q, max_k) == (5, 6)
    assert keys.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7]
    assert cu_q.dtype == cu_k.dtype == keys.dtype == torch.int32  # what the flash kernel takes
    cu_q, cu_k, keys, max_q, max_k = flash_layout(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert (cu_q.tolist() == cu_k.tolist() == [0, 3, 5, 9] and keys.tolist() == list(range(9))
            and max_q == max_k == 4)


def flash_by_definition(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False):
    """What torch's varlen_attn computes, in fp32: sequence i's queries q[cu_q[i]:cu_q[i+1]] against
    its keys k[cu_k[i]:cu_k[i+1]], causal from the bottom right (query j of Lq sees keys
    0 .. Lk - Lq + j), and with window_size (left, 0) only the `left` keys before that one. The
    real kernel takes this convention (an H100 check against an fp32 reference:
    docs/grpo.md#flash)."""
    left, right = window_size
    # causal (a window or none), 16 bits
    assert right == 0 and q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert int((cu_q[1:] - cu_q[:-1]).max()) == max_q and int((cu_k[1:] - cu_k[:-1]).max()) == max_k
    out = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))
        if left >= 0:
            mask &= ~torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a) - left - 1)
        x = [t.float().transpose(0, 1) for t in (q[a:b], k[c:d], v[c:d])]  # [H, L, d]
        out.append(F.scaled_dot_product_attention(*x, attn_mask=mask, scale=scale,
                                                  enable_gqa=True).transpose(0, 1))
    return torch.cat(out)  # [Tq, Hq, d]


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("shared", [True, False])
def test_flash_attention_equals_the_bucketed_sdpa(monkeypatch, shared, window):
    """The GPU path (one varlen flash call per packed row) against the CPU one (a causal sdpa per
    bucket) on the same row: groups of 3, 1 and 2 completions after prompts of 5, 3 and 4 tokens,
    GQA (4 query heads, 2 KV heads), no sliding window or one of 3 (the flash kernel's window_size
    (2, 0)), the kernel replaced by its definition above, inputs rounded to bf16 so that its cast
    is exact. Outputs within 1e-5; the inputs' gradients within bf16's rounding (the kernel's
    gradient is a bf16 one)."""
    monkeypatch.setattr(common, "varlen_attn", flash_by_definition)
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(3, 50, (n,), generator=gen).tolist()
    samples = [Sample(p, tokens(c))
               for p, cs in ((tokens(5), (3, 1, 4)), (tokens(3), (2,)), (tokens(4), (2, 5)))
               for c in cs]
    _, pos, _, _ = packed_inputs(samples, "cpu", shared)
    T = pos.shape[1]
    q, k, v = (torch.randn(1, h, T, 32, generator=gen).bfloat16().float().requires_grad_()
               for h in (4, 2, 2))
    w = torch.randn(1, T, 4, 32, generator=gen)
    got = flash_attention(q, k, v, pos, 0.3, window)  # [1, T, Hq, d]
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want = varlen_attention(None, q, k, v, Packed(window=window), scaling=0.3,
                            position_ids=pos)[0]
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    assert got.shape == want.shape == (1, T, 4, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, h in zip(got_grads, want_grads):
        torch.testing.assert_close(g, h, atol=2e-2, rtol=2e-2)


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
    """No mask and no score matrix of the whole row: T appears at most once in any tensor made in
    forward or backward. The dense-mask sdpa reference is probed the same way and does build one, so
    the probe can fail."""
    model, vocab = load_model(tiny_dir, torch.device("cpu"), attn=attn), len(tiny[1])
    samples = make_samples(vocab, seed=4, lengths=[(5, 9), (7, 4), (3, 11), (6, 6), (4, 6)])
    T = 61  # prime, and no dimension of the model
    assert sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples) == T
    shapes = tensor_shapes_during(lambda: packed_logprobs(model, samples, 1.0, vocab,
                                                          chunk=16).sum().backward())
    dense = [s for s in shapes if s.count(T) >= 2]
    if attn == "varlen":
        assert not dense, dense[:5]
    else:
        assert dense  # the block-diagonal mask (and the scores) of the dense path


def test_attention_dropout_trains_with_varlen_and_packs_exactly_in_eval_mode(tiny_dir, tiny,
                                                                             tmp_path):
    """Attention dropout handed to the varlen attention is applied by sdpa inside each bucket (the
    scripts' load_model sets every rate to 0: test_no_dropout_in_the_trainers_passes; a model
    loaded otherwise keeps its own). A model whose config asks for 0.1, loaded with --attn varlen
    in train mode: its train-mode packed passes are stochastic (the dropout acts), an AdamW step
    through policy_update changes its weights; in eval mode its packed log-probs equal the alone
    ones and those of the same weights without dropout."""
    from transformers import AutoModelForCausalLM
    folder = tmp_path / "dropout"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    assert load_model(str(folder), torch.device("cpu")).config.attention_dropout == 0.0
    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="varlen").train()
    assert (model.training and model.config.attention_dropout == 0.1
            and model.config._attn_implementation == "varlen")
    vocab = len(tiny[1])
    samples = make_samples(vocab, seed=6, lengths=[(5, 4), (3, 7), (6, 1), (4, 5)])
    with torch.no_grad():
        torch.manual_seed(0)
        first = packed_logprobs(model, samples, 1.0, vocab)
        torch.manual_seed(1)
        second = packed_logprobs(model, samples, 1.0, vocab)
    assert (first - second).abs().max() > 1e-3  # two dropout masks
    model.eval()
    with torch.no_grad():
        got = packed_logprobs(model, samples, 1.0, vocab)
        torch.testing.assert_close(got, alone_logprobs(model, samples, vocab), atol=1e-5,
                                   rtol=1e-6)
        plain = load_model(tiny_dir, torch.device("cpu"), attn="varlen").eval()
        torch.testing.assert_close(got, packed_logprobs(plain, samples, 1.0, vocab), atol=1e-5,
                                   rtol=1e-6)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer, _ = make_optimizer(model, 1e-3, 0.0, 0, 10, "constant")
    for s, c in zip(samples, token_coefficients([len(s.completion_ids) for s in samples],
                                                "seq_mean").tolist()):
        s.coef = c
    stats = policy_update(model, optimizer, samples, Passes(1.0, vocab, 64), clip=(0.2, 0.2),
                          beta=0.0)
    assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before), set(before) - set(moved)


@pytest.mark.parametrize("arch", ["qwen2", "gpt_oss"])
def test_hf_generate_is_unchanged_by_the_varlen_attention(tiny_dir, tiny, arch_dir, arch):
    """The policy model also generates (HF fallback): left-padded batches with a KV cache take
    sdpa's path, which gives what the model's own attention gives: sdpa's for Qwen2, eager's for
    gpt-oss (its sinks, through sink_attention, and its sliding window of 8, which the prompts
    and 12 new tokens pass)."""
    from common import HFEngine
    tokenizer = tiny[1]
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
    folder = tiny_dir if arch == "qwen2" else arch_dir(arch)
    outs = []
    for attn in ("varlen", "sdpa" if arch == "qwen2" else "eager"):
        engine = HFEngine(load_model(folder, torch.device("cpu"), attn=attn), tokenizer,
                          len(tokenizer), [tokenizer.eos_token_id])
        outs.append([engine.generate(prompts, n=1, temperature=0.0, max_tokens=12, seed=0),
                     engine.generate(prompts, n=3, temperature=1.0, max_tokens=12, seed=0)])
    assert outs[0] == outs[1]


def test_hf_generate_sets_every_sampling_field_and_warns_of_none(tiny, capfd):
    """HF generate fills unset sampling fields from the model's own generation config (Qwen's
    top-k 20), so every one is set; top-k and min-p only when sampling, since greedy decoding
    ignores them and transformers warns that it does, once a run."""
    import transformers
    from common import HFEngine
    model, tokenizer = tiny
    engine = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    transformers.logging.set_verbosity_warning()
    capfd.readouterr()
    engine.generate([[5, 6, 7]], n=1, temperature=0.0, max_tokens=4, seed=0)
    engine.generate([[5, 6, 7]], n=2, temperature=1.0, max_tokens=4, seed=0)
    assert "not valid and may be ignored" not in capfd.readouterr().err
    config = common.neutral_generation_config(model, tokenizer, len(tokenizer), [1], 1.0, 4, 2)
    assert (config.top_k, config.min_p, config.top_p, config.repetition_penalty) == (0, 0.0, 1.0,
                                                                                   1.0)
    greedy = common.neutral_generation_config(model, tokenizer, len(tokenizer), [1], 0.0, 4, 1)
    assert not greedy.do_sample and greedy.top_k is None and greedy.min_p is None


def test_packed_inputs_layout():
    ids, pos, predict, targets = packed_inputs([Sample([5, 6], [7]), Sample([8], [9, 2])], "cpu")
    assert ids.tolist() == [[5, 6, 7, 8, 9, 2]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2]]
    assert predict.tolist() == [1, 3, 4]  # 6->7, 8->9, 9->2; never 7->8 across the boundary
    assert targets.tolist() == [7, 9, 2]


def test_shared_prompt_layout_by_hand():
    """Prompt [5, 6] with completions [7] and [8, 9] (A1, A2), then prompt [4] with [3] (B): A's
    prompt is laid out once; A2's positions go on from its prompt (2, 3); its first token is
    predicted from the prompt's last row (1, shared with A1), the next from its own. The attention
    reads the same tree back from the positions alone. Only neighbours share (pack_microbatches puts
    a group together): in the order A1, B, A2 nothing is shared."""
    samples = [Sample([5, 6], [7]), Sample([5, 6], [8, 9]), Sample([4], [3])]
    ids, pos, predict, targets = packed_inputs(samples, "cpu", shared=True)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 4, 3]]
    assert pos.tolist() == [[0, 1, 2, 2, 3, 0, 1]]
    assert predict.tolist() == [1, 1, 3, 5]  # A1: 6->7 | A2: 6->8, 8->9 | B: 4->3
    assert targets.tolist() == [7, 8, 9, 3]
    assert packed_inputs(samples, "cpu")[0].tolist() == [[5, 6, 7, 5, 6, 8, 9, 4, 3]]  # unshared
    assert packed_inputs(samples[::2] + samples[1:2], "cpu",
                         shared=True)[0].tolist() == [[5, 6, 7, 4, 3, 5, 6, 8, 9]]
    # sequences: rows [0 1 2] (A1), [0 1 | 3 4] (A2's keys: a copy of its prompt's rows, then its
    # own), [5 6] (B)
    buckets, keys, queries, scatter = seq_layout(pos)
    # square ones first: A1, B; then A2
    assert [b[:3] for b in buckets] == [(1, 3, 3), (1, 2, 2), (1, 4, 2)]
    # A2's keys: its prompt's rows in front of its own
    assert keys.tolist() == [0, 1, 2, 5, 6, 0, 1, 3, 4]
    assert queries.tolist() == [0, 1, 2, 5, 6, 3, 4]  # A2 runs only its own queries
    # every token's output from its own row, never from the copy
    assert scatter.tolist() == [0, 1, 2, 5, 6, 3, 4]
    # 2 prompt keys first
    assert buckets[2][3].tolist() == [[[[True, True, True, False], [True, True, True, True]]]]


def test_packed_logprobs_equal_plain_log_softmax(tiny):
    model, tokenizer = tiny
    vocab = len(tokenizer)
    samples = make_samples(vocab)
    for temperature in (1.0, 0.7):
        got = packed_logprobs(model, samples, temperature, vocab, chunk=3)
        want = []
        for logits, s in zip(one_at_a_time(model, samples), samples):
            p, c = len(s.prompt_ids), len(s.completion_ids)
            # padded ids excluded
            lp = (logits[p - 1:p + c - 1, :vocab] / temperature).log_softmax(-1)
            want.append(lp.gather(1, torch.tensor(s.completion_ids)[:, None])[:, 0])
        torch.testing.assert_close(got, torch.cat(want), atol=1e-5, rtol=1e-5)


def test_chunked_logprobs_value_and_grad_match_full():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 40, (37,))
    full = F.log_softmax((hidden @ weight[:40].T) / 0.8, -1).gather(1, targets[:, None])[:, 0]
    gh_full, gw_full = torch.autograd.grad(full.sum() * 2, (hidden, weight))
    # 8 does not divide 37
    lean = chunked_logprobs(hidden, weight[:40], targets, temperature=0.8, chunk=8)
    torch.testing.assert_close(lean, full)
    gh, gw = torch.autograd.grad(lean.sum() * 2, (hidden, weight))
    torch.testing.assert_close(gh, gh_full)
    torch.testing.assert_close(gw, gw_full)


def test_post_head_transforms_by_hand():
    """chunked_logprobs(config=...) applies a model's touch after the LM head: Cohere's logit_scale
    multiplies, Granite's logits_scaling divides, Gemma's final_logit_softcapping is c tanh(z / c);
    the temperature divides afterwards (as the engine samples). Values and gradients against the
    formulas written out; a config without them (or None) is the bare head."""
    torch.manual_seed(0)
    hidden = torch.randn(23, 16, requires_grad=True)
    weight = (3 * torch.randn(40, 16)).requires_grad_()
    targets = torch.randint(0, 40, (23,))
    z = hidden @ weight.T  # [23, 40], spread over tens of units
    cases = [(None, z), (types.SimpleNamespace(), z),
             (types.SimpleNamespace(logit_scale=None, logits_scaling=None,
                                    final_logit_softcapping=None), z),
             (types.SimpleNamespace(logit_scale=0.25), 0.25 * z),  # Cohere
             (types.SimpleNamespace(logits_scaling=4.0), z / 4.0),  # Granite
             (types.SimpleNamespace(final_logit_softcapping=3.0),
              3.0 * torch.tanh(z / 3.0)),  # Gemma 2
             (types.SimpleNamespace(logit_scale=2.0, logits_scaling=8.0,
                                    final_logit_softcapping=5.0),
              5.0 * torch.tanh(z * 2.0 / 8.0 / 5.0))]
    bare = None
    for config, logits in cases:
        want = F.log_softmax(logits / 0.7, -1).gather(1, targets[:, None])[:, 0]
        got = chunked_logprobs(hidden, weight, targets, temperature=0.7, chunk=5, config=config)
        torch.testing.assert_close(got, want)
        # z serves every case
        want_grads = torch.autograd.grad(want.sum(), (hidden, weight), retain_graph=True)
        for g, w in zip(torch.autograd.grad(got.sum(), (hidden, weight)), want_grads):
            torch.testing.assert_close(g, w)
        if bare is None:
            bare = want.detach()
        elif logits is not z:
            assert (want.detach() - bare).abs().max() > 0.1  # each transform moves the log-probs


def test_chunked_logprobs_never_keeps_a_tokens_by_vocab_tensor():
    """Autograd must save no logits-shaped [*, V] tensor for backward: each chunk is recomputed
    (checkpointed). The same probe on a plain log_softmax + gather does see the [N, V] logits, so
    the check can fail."""
    from common import _logprob_chunk
    n, vocab, d = 64, 1000, 16

    def saved_shapes(fn):
        hidden = torch.randn(n, d, requires_grad=True)
        weight = torch.randn(vocab, d, requires_grad=True)
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            out = fn(hidden, weight, torch.randint(0, vocab, (n,)))
        out.sum().backward()
        assert hidden.grad is not None and weight.grad is not None
        return shapes
    lean = saved_shapes(lambda h, w, t: chunked_logprobs(h, w, t, chunk=8))
    plain = saved_shapes(lambda h, w, t: _logprob_chunk(h, w, t, 1.0, None))
    assert (n, vocab) in plain
    assert not [s for s in lean if s[-1] == vocab], lean


def test_pack_microbatches_respects_budget_and_covers_everything():
    lengths = [5, 9, 3, 7, 12, 1, 8, 20]
    bins = pack_microbatches([Sample([1], [2] * (n - 1)) for n in lengths], 16)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 16 for b in bins if len(b) > 1)
    assert [7] in bins  # the 20-token sequence is longer than the budget: alone
    # first-fit decreasing by hand: 20 | 12 3 1 | 9 7 | 8 5  (the other 45 tokens in the minimum 3
    # bins of 16)
    assert sorted(map(sorted, bins)) == sorted([[7], [2, 4, 5], [1, 3], [0, 6]])


@pytest.mark.parametrize("loss_agg", ["seq_mean", "token_mean", "constant"])
def test_microbatch_split_never_changes_the_gradient(tiny, loss_agg):
    model, tokenizer = tiny
    vocab = len(tokenizer)
    lengths = [(5, 3), (4, 8), (9, 2), (3, 6), (6, 6), (2, 11)]
    samples = make_samples(vocab, seed=1, lengths=lengths)
    coefs = token_coefficients([c for _, c in lengths], loss_agg, max_len=12)
    ref = sequence_logprobs(model, samples, Passes(1.0, vocab, token_budget=10_000))
    for s, c, r in zip(samples, coefs.tolist(), ref):
        s.coef, s.ref_logps = c, r
    results = []
    for budget in (10_000, 14, 1):  # one micro-batch, a few, one sequence each
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, Passes(1.0, vocab, token_budget=budget, chunk=4),
                              clip=(0.2, 0.2), beta=0.1, grad_clip=1e9)
        results.append((stats, opt.grads))
    assert ([r[0]["micro_batches"] for r in results][0] == 1
            and results[2][0]["micro_batches"] == len(lengths))
    for stats, grads in results[1:]:
        assert stats["loss"] == pytest.approx(results[0][0]["loss"], abs=1e-6)
        assert_grads_close(grads, results[0][1])


# ---------------------------------------------------------------- the shared prompt
# (docs/grpo.md#shared-prompt)

GROUPS = [8, 5, 3, 2, 1]  # GRPO's G = 8, groups CPPO and DPPO pruned, 2-GRPO's pair, a group of one


def grouped_samples(vocab, group_sizes=GROUPS, seed=0):
    """Groups of completions (1-40 tokens) behind one random prompt each (3-30 tokens), shuffled as
    pruning and packing may leave them, with N(0, 1) advantages."""
    g = torch.Generator().manual_seed(seed)
    tokens = lambda low, high: torch.randint(3, vocab,
                                             (int(torch.randint(low, high + 1, (), generator=g)),),
                                             generator=g).tolist()
    samples = []
    for n in group_sizes:
        prompt = tokens(3, 30)
        samples += [Sample(prompt, tokens(1, 40), advantage=float(torch.randn((), generator=g)))
                    for _ in range(n)]
    return [samples[i] for i in torch.randperm(len(samples), generator=g).tolist()]


def test_shared_prompt_equals_the_unshared_step(tiny):
    """On the GQA tiny Qwen2, with partial groups in a shuffled order: per-token log-probs equal the
    unshared packed step's to 5e-5 nats (fp32; only the order of sums changes) and the update's
    gradient to 1e-5 relative, in one micro-batch, in several, and under a budget smaller than the
    8-group (cut in pieces, the prompt in each); the memory-lean log-prob in chunks of 7 rows. Fewer
    tokens are laid out, so fewer micro-batches at the same budget."""
    model, tokenizer = tiny
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    vocab = len(tokenizer)
    samples = grouped_samples(vocab)
    coefs = token_coefficients([len(s.completion_ids) for s in samples], "seq_mean").tolist()
    for s, c in zip(samples, coefs):
        s.coef = c
    unshared = Passes(1.0, vocab, token_budget=100_000, chunk=7)
    want_lp = sequence_logprobs(model, samples, unshared)
    want = RecordingOptimizer(model)
    policy_update(model, want, samples, unshared, clip=(0.2, 0.2), beta=0.0, grad_clip=1e9)
    group_tokens = max(len(s.prompt_ids)
                       + sum(len(t.completion_ids) for t in samples if t.prompt_ids == s.prompt_ids)
                       for s in samples)
    for budget in (100_000, 150, group_tokens - 1):
        passes = unshared._replace(token_budget=budget, shared=True)
        for got, w in zip(sequence_logprobs(model, samples, passes), want_lp):
            torch.testing.assert_close(got, w, atol=5e-5, rtol=0)
        opt = RecordingOptimizer(model)
        stats = policy_update(model, opt, samples, passes, clip=(0.2, 0.2), beta=0.0, grad_clip=1e9)
        assert_grads_close(opt.grads, want.grads, rel=1e-5)
        assert stats["train_tokens"] == sum(len(s.completion_ids) for s in samples)
        bins = pack_microbatches(samples, budget, shared=True)
        assert sorted(i for b in bins for i in b) == list(range(len(samples)))
        if budget < 100_000:
            assert len(bins) < len(pack_microbatches(samples, budget))
    prompts = {tuple(s.prompt_ids): 0 for s in samples}
    for s in samples:
        prompts[tuple(s.prompt_ids)] += 1
    # each group's prompt laid out once, not n times
    saved = sum((n - 1) * len(p) for p, n in prompts.items())
    total = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    # one micro-batch, by group
    grouped = [samples[i] for i in pack_microbatches(samples, 100_000, shared=True)[0]]
    assert [packed_inputs(grouped, "cpu", shared)[0].shape[1]
            for shared in (False, True)] == [total, total - saved]


def test_pack_microbatches_shares_a_prompt_by_hand():
    """A prompt of 4 with completions of 5, 6, 7 costs 4 + 18 = 22 together; under a budget of 16 it
    is cut where the next completion would not fit: [5, 6] (4 + 11 = 15) and [7] (4 + 7 = 11), each
    with the prompt. The group of one (3 + 2 = 5) first-fits beside the 11."""
    samples = [Sample([1] * 4, [2] * n) for n in (5, 6, 7)] + [Sample([3] * 3, [2] * 2)]
    assert pack_microbatches(samples, 100, shared=True) == [[0, 1, 2, 3]]
    assert pack_microbatches(samples, 16, shared=True) == [[0, 1], [2, 3]]
    assert pack_microbatches(samples, 16) == [[2, 3], [1], [0]]  # unshared: 11, 10, 9, 5 tokens


def test_only_varlen_can_share_a_prompt(tiny_dir, tiny):
    """sdpa (like eager and flash_attention_2) reads each run of positions as a sequence of its own:
    under it the shared layout's completions lose their prompt, so the run falls back to one prompt
    per completion."""
    vocab = len(tiny[1])
    samples = sorted(grouped_samples(vocab, [3, 2], seed=2), key=lambda s: s.prompt_ids)
    model = load_model(tiny_dir, torch.device("cpu"), attn="sdpa", frozen=True)
    with torch.no_grad():
        right = packed_logprobs(model, samples, 1.0, vocab)
        wrong = packed_logprobs(model, samples, 1.0, vocab, shared=True)
    assert (right - wrong).abs().max() > 1e-2
    import grpo
    from common import parse_args, setup
    for flags, shared in ([], True), (["--attn", "sdpa"], False), (["--no_shared_prompt"], False):
        out = tiny_dir + f"-setup-{len(flags)}-{shared}"
        run = setup(parse_args(grpo.Args, "grpo", "", argv=["--rollout", "hf", "--eval_n", "2",
                                                           "--out", out, *flags]), "grpo",
                    grpo.reward, grpo.prompt)
        assert run.passes.shared is shared
        run.metrics.close()
        shutil.rmtree(out)
