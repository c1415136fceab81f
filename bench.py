"""Benchmark the training step: packed micro-batches (common.policy_update) against right-padded ones.

One "update" is what grpo.py does per optimiser step: forward, memory-lean log-probs, clipped loss, backward,
AdamW step, over a whole rollout batch of completions. The model is built from a config with random weights (no
download); the lengths are drawn from a configurable mix. Prints tokens/s, the ratio to the padded step, peak memory
(GPU), and model-FLOPs utilisation on a GPU (6 N tokens / time / the bf16 matmul peak measured in the same run).

    python bench.py --shape toy                       # CPU, toy model, toy-like lengths (~1 minute)
    python bench.py --shape qwen2.5-1.5b --lengths gsm8k --budgets 8192 16384   # one GPU
"""
import argparse
import os
import platform
import time

import numpy as np
import torch

from common import (REPO, Sample, autocast, chunked_logprobs, lm_head_weight, make_optimizer, pack_microbatches,
                    policy_update, token_coefficients, token_loss)

SHAPES = {  # Qwen2.5 configs (hidden, layers, heads, kv heads, intermediate, vocab); toy = toy/model
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960, 151936),
}
LENGTHS = {  # (prompt mean, prompt std, completion median, completion log-std, completion cap) in tokens
    "toy": (19, 1, 9, 0.1, 24),
    "gsm8k": (130, 25, 200, 0.5, 1024),  # CPPO's system prompt + a GSM8K question; Qwen2.5-1.5B-like answers
}


def build_model(shape, device, attn):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config
    if shape == "toy" or os.path.isdir(shape):
        config = AutoConfig.from_pretrained(os.path.join(REPO, "toy", "model") if shape == "toy" else shape)
    else:
        h, layers, heads, kv, inter, vocab = SHAPES[shape]
        config = Qwen2Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                             intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=32768)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).to(device)
    return model.train()


def make_samples(n, lengths, vocab, seed=0):
    p_mean, p_std, c_median, c_sigma, c_cap = LENGTHS[lengths]
    rng = np.random.default_rng(seed)
    prompt = np.clip(rng.normal(p_mean, p_std, n), 4, None).astype(int)
    completion = np.clip(rng.lognormal(np.log(c_median), c_sigma, n), 1, c_cap).astype(int)
    return [Sample(rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist(), advantage=float(rng.normal()))
            for p, c in zip(prompt, completion)]


def padded_update(model, optimizer, samples, coefs, *, temperature, vocab_size, token_budget, eps_low, eps_high,
                  beta, grad_clip=1.0, chunk=1024):
    """The same update on right-padded micro-batches (the usual layout: TRL, nano-aha-moment): as many sequences per
    micro-batch as fit the budget at the batch's longest length, in the rollout's order."""
    device = next(model.parameters()).device
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    per_mb = max(1, token_budget // width)
    for start in range(0, len(samples), per_mb):
        group = samples[start:start + per_mb]
        L = max(len(s.prompt_ids) + len(s.completion_ids) for s in group)
        seqs = [s.prompt_ids + s.completion_ids for s in group]
        ids = torch.tensor([x + [0] * (L - len(x)) for x in seqs], device=device)  # [b, L]
        mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in seqs], device=device)  # [b, L]
        rows = torch.cat([torch.full((len(s.completion_ids),), k) for k, s in enumerate(group)]).to(device)  # [N]
        cols = torch.cat([torch.arange(len(s.prompt_ids) - 1, len(x) - 1) for s, x in zip(group, seqs)]).to(device)
        with autocast(device):
            hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state  # [b, L, d]
            logp = chunked_logprobs(hidden[rows, cols], lm_head_weight(model, vocab_size), ids[rows, cols + 1],
                                    temperature, chunk=chunk)  # [N], the same head path as the packed step
        adv = torch.cat([torch.full((len(s.completion_ids),), s.advantage) for s in group]).to(device)
        c = torch.cat([torch.full((len(s.completion_ids),), float(coefs[start + k])) for k, s in enumerate(group)]).to(device)
        loss_tok, _, _ = token_loss(logp, logp.detach(), None, adv, eps_low, eps_high, beta)
        (loss_tok * c).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bf16_peak_tflops(device):
    """Measured dense bf16 matmul throughput, the denominator of MFU."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.time() - t0) / 1e12


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="toy", help=f"toy | {' | '.join(SHAPES)} | a model folder (config only is used)")
    p.add_argument("--lengths", default=None, choices=list(LENGTHS), help="length mix (default: toy for toy, else gsm8k)")
    p.add_argument("--sequences", type=int, default=256, help="completions per update (a rollout batch)")
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="token budgets per micro-batch to compare "
                   "(default: 256 512 1024 2048 16384 on CPU, 4096 8192 16384 on GPU)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="attention implementation")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per setting (after one warm-up)")
    p.add_argument("--no_padded", action="store_true", help="skip the padded baseline")
    args = p.parse_args()
    if args.shape not in SHAPES and args.shape != "toy" and not os.path.isdir(args.shape):
        p.error(f"--shape {args.shape!r}: not toy, {', '.join(SHAPES)} or a model folder")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = args.lengths or ("toy" if args.shape == "toy" else "gsm8k")
    budgets = args.budgets or ([256, 512, 1024, 2048, 16384] if device.type == "cpu" else [4096, 8192, 16384])
    model = build_model(args.shape, device, args.attn)
    vocab = model.config.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    samples = make_samples(args.sequences, lengths, vocab)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    coefs = token_coefficients([len(s.completion_ids) for s in samples], "seq_mean")
    optimizer, _ = make_optimizer(model, 1e-6, 0.0, 0, 1, "constant")
    kw = dict(temperature=1.0, vocab_size=vocab, eps_low=0.2, eps_high=0.2, beta=0.0)
    peak = bf16_peak_tflops(device) if device.type == "cuda" else None
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else \
        f"{platform.processor() or 'cpu'}, {torch.get_num_threads()} threads"
    print(f"# {args.shape} ({n_params / 1e6:.1f}M params), {args.sequences} sequences, {tokens} tokens "
          f"({lengths} lengths), attn={args.attn}, {hardware}, torch {torch.__version__}")
    print(f"# command: python bench.py {' '.join(os.sys.argv[1:])}")

    def timed(fn, budget):
        fn(model, optimizer, samples, coefs, token_budget=budget, **kw)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        for _ in range(args.repeats):
            fn(model, optimizer, samples, coefs, token_budget=budget, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = (time.time() - t0) / args.repeats
        memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        return seconds, memory

    rows, lengths_all = [], [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    for budget in budgets:
        if not args.no_padded:  # padded_update's micro-batches: budget // longest sequences each
            n_mb = -(-len(samples) // max(1, budget // max(lengths_all)))
            rows.append(("padded", budget, n_mb, *timed(padded_update, budget)))
        rows.append(("packed", budget, len(pack_microbatches(lengths_all, budget)), *timed(policy_update, budget)))
    padded = {b: s for mode, b, _, s, _ in rows if mode == "padded"}
    print("| layout | token budget | micro-batches | s / update | tokens/s | vs padded (same budget) | peak GiB | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, budget, n_mb, seconds, memory in rows:
        ratio = f"{padded[budget] / seconds:.2f}x" if budget in padded else "-"
        mfu = f"{6 * n_params * tokens / seconds / 1e12 / peak:.1%}" if peak else "-"
        mem = f"{memory:.1f}" if memory is not None else "-"
        print(f"| {mode} | {budget} | {n_mb} | {seconds:.3f} | {tokens / seconds:,.0f} | {ratio} | {mem} | {mfu} |")
    if peak:
        print(f"# measured bf16 matmul peak: {peak:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
