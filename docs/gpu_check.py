"""The GPU check (docs/README.md#gpu): the numbers README and docs/results.md wait for, in one
command that fits a GPU machine lent for about 15 minutes.

    python docs/gpu_check.py                 # on a GPU: docs/results/gpu.json and markdown tables
    python docs/gpu_check.py --out DIR       # elsewhere: DIR/results/gpu.json

It runs bench.py's step part (the training update padded, packed and with each group's prompt once)
at the Qwen2.5-0.5B and 1.5B shapes on the gsm8k and chains length mixes, then one real update at
the 0.5B, 1.5B, 3B and 7B shapes, full fine-tuning and LoRA, its peak GPU memory beside the start-up
estimate (common.trainer_gib, what check_memory prints). A row that fails (7B full fine-tuning out
of memory, say) is recorded on one line and the rest still run. Without CUDA the same code runs as
a dry run on the toy shape, small, and writes under runs/ (tests/test_gpu.py runs it, so that CI
keeps the command working). Models are built from configs written here, random weights: nothing is
downloaded.
"""
import argparse
import gc
import itertools
import json
import os
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402  (the repository's root, above)
from common import DATASETS, REPO, Passes, add_lora, policy_update, trainer_gib  # noqa: E402

CUDA = torch.cuda.is_available()
# Qwen2.5's configs as the hub has them (config.json): 2 key/value heads, a 151,936-token
# vocabulary and the embedding tied to the LM head, but 7B's (4, 152,064, untied)
QWEN = dict(num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
            max_position_embeddings=32768)
SHAPES = {
    "qwen2.5-0.5b": dict(QWEN, **bench.SHAPES["qwen2.5-0.5b"]),
    "qwen2.5-1.5b": dict(QWEN, **bench.SHAPES["qwen2.5-1.5b"]),
    "qwen2.5-3b": dict(QWEN, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                       intermediate_size=11008),
    "qwen2.5-7b": dict(QWEN, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       intermediate_size=18944, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
}
LORA_R = 16  # the LoRA rows' rank, alpha 2 r, as --lora_r 16 runs it


def random_model(shape, device, lora_r=0):
    """A model of `shape` (SHAPES, or toy: the toy task's model) with random fp32 weights, built on
    `device` ("meta": its size alone, nothing allocated), with a LoRA adapter of rank lora_r."""
    if shape in SHAPES:
        config = Qwen2Config(**SHAPES[shape])
    else:
        config = AutoConfig.from_pretrained(DATASETS["toy"]["model"])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="varlen",
                                                 dtype=torch.float32)
    if lora_r:
        model = add_lora(model, lora_r, 2 * lora_r)
    return model


def estimate_gib(shape, lora_r):
    """What the start-up would print for `shape` at beta 0 (no reference): trainer_gib of its
    parameters and of those trained, counted on the meta device."""
    model = random_model(shape, "meta", lora_r)
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return n_params, trainer_gib(n_params, n_trained, beta=0.0, lora=lora_r)


def attempt(call):
    """call()'s result, or its error on one line: a row that fails (out of memory, say) is
    recorded, and the next one runs."""
    try:
        return call()
    except Exception as e:
        return " ".join(f"{type(e).__name__}: {e}".split())[:300]


def table_rows(text):
    """The rows of the markdown table in `text`, each as {column: cell}."""
    lines = [line.strip("| ").split(" | ") for line in text.splitlines() if line.startswith("| ")]
    return [dict(zip(lines[0], row)) for row in lines[1:]]


def peak_step(shape, lora_r, sequences, mix):
    """GiB at the peak of one real update of a random `shape`, its build included: `sequences`
    completions of the `mix` length mix through policy_update as the scripts run it on a GPU
    (packed at their 16,384-token budget, gradient checkpointing, bf16 autocast, AdamW; beta 0: no
    reference). On the CPU "-": nothing is measured."""
    gc.collect()  # what an earlier row left (a failed one's tensors)
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = random_model(shape, bench.DEVICE, lora_r)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    vocab = model.config.vocab_size
    samples = bench.synthetic_samples(sequences, mix, vocab, 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    policy_update(model=model, optimizer=optimizer, samples=samples,
                  passes=Passes(1.0, vocab, 16384), clip=(0.2, 0.2), beta=0.0)
    if not CUDA:
        return "-"
    return torch.cuda.max_memory_allocated() / 2**30


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where results/gpu.json goes (default: docs/ on a GPU, else "
                   "runs/gpu-check-<time>/)")
    out = p.parse_args().out
    if out is None and CUDA:
        out = os.path.join(REPO, "docs")
    if out is None:
        out = os.path.join("runs", f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    # the update's settings: bench.py's step part, as its flags would give them
    step = argparse.Namespace(lengths=["gsm8k", "chains"], budgets=[4096, 16384], sequences=256,
                              step_group=8, repeats=2, attn="varlen", no_padded=False)
    shapes = list(SHAPES)
    memory_mix, memory_sequences = "gsm8k", 64
    if not CUDA:  # the dry run: the same code, the toy shape, small
        vars(step).update(lengths=["toy"], budgets=[128], sequences=16, repeats=1)
        shapes, memory_mix, memory_sequences = ["toy"], "toy", 8
    report = dict(command=" ".join(["python docs/gpu_check.py", *sys.argv[1:]]),
                  date=time.strftime("%Y-%m-%d %H:%M"), machine=bench.machine(),
                  software=bench.software(), step={}, memory=[])
    print(bench.fill("gpu", **report))
    for shape in shapes[:2]:  # the update: the two shapes the H100 of 2026-11-26 measured
        step.shape = shape
        report["step"][shape] = attempt(lambda: table_rows(bench.step_section(step)[0]))
    print(bench.fill("gpu_memory"))
    os.makedirs(os.path.join(out, "results"), exist_ok=True)
    for shape, lora_r in itertools.product(shapes, (0, LORA_R)):
        n_params, estimate = estimate_gib(shape, lora_r)
        peak = attempt(lambda: peak_step(shape, lora_r, memory_sequences, memory_mix))
        report["memory"].append(dict(shape=shape, parameters=n_params, lora_r=lora_r,
                                     estimate_gib=estimate, peak_gib=peak))
        training = f"LoRA r = {lora_r}" if lora_r else "full"
        ratio = "-"
        if isinstance(peak, float):
            ratio = f"{peak / estimate:.2f}"
            peak = f"{peak:.1f}"
        print(f"| {shape} | {n_params / 1e6:,.0f}M | {training} | {estimate:.1f} | {peak} | "
              f"{ratio} |")
        with open(os.path.join(out, "results", "gpu.json"), "w") as f:  # a cut run keeps its rows
            json.dump(report, f, indent=1)
    print(f"wrote {os.path.join(out, 'results', 'gpu.json')}")


if __name__ == "__main__":
    main()
