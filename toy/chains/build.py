"""Build the second built-in task, `--dataset chains`: toy/chains/model/ and toy/chains/data/.

The task: add 2 to 7 two-digit numbers, asked plainly ("What is 23 + 45 + 17?") or as a short
word problem ("Mia has 23 shells. She finds 45 more. ..."), and answer with written reasoning
followed by <answer>N</answer>. The model is warm-started by supervised training on a *tired
teacher*, who writes the same running sum in several surface forms (terse or verbose lines, the
numbers in the question's order or from the last one back, a rewriting chain, an optional check
line) and forgets the carry out of the units more often the further it is into the chain
(DROP_CARRY: 20% at the first addition, 80% from the sixth). So the warm-started model's
completions vary in length (about 15 to 170 tokens) and in form, short chains are mostly right,
long ones mostly wrong, and sampling at temperature 1 carries often enough for the reward to
teach the rest. docs/grpo.md#chains has the numbers.

The data (all_splits): train.jsonl, 512 problems; val.jsonl and test.jsonl, 150 and 300 problems,
25 and 50 of each chain length, none sharing its numbers as a multiset with another problem of
either split, with a training problem or with a warm-start problem. The scripts evaluate on
val.jsonl during a run and on test.jsonl once, at the end.

    python toy/chains/build.py              # ~45 minutes on 2 CPU cores: data, tokenizer, model
    python toy/chains/build.py --data_only  # the data files only (the tests compare them)
    python toy/chains/build.py --report     # the committed model's test accuracy and lengths

The data and the tokenizer are byte-for-byte reproducible; the warm start is seeded, but float
reductions differ between CPUs, so a rebuilt model can differ from the committed one in its last
bits.
"""
import argparse
import collections
import json
import os
import random
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
from toy.build import make_model, make_tokenizer  # noqa: E402  (the same recipe as the toy)

LENGTHS = [2, 3, 4, 5, 6, 7]  # numbers per problem
LENGTH_WEIGHTS = [5, 3, 2, 2, 2, 2]  # more two-number sums: the short end of the lengths
DROP_CARRY = [0.2, 0.6, 0.65, 0.7, 0.75, 0.8]  # P(teacher forgets the carry) at addition 1, 2, ...
REVERSED = 0.3  # P(the teacher adds from the last number back)
N_TRAIN = 512
# the first held-out draw: no longer evaluated on, but the warm start excluded it
N_FIRST_HELDOUT = 300
PER_LENGTH = {"val": 25, "test": 50}  # held-out problems per chain length: 150 and 300
NAMES = [("Mia", "she", "her"), ("Tom", "he", "his"), ("Ava", "she", "her"), ("Leo", "he", "his"),
         ("Zoe", "she", "her"), ("Sam", "he", "his"), ("Ella", "she", "her"), ("Ben", "he", "his")]
ITEMS = ["shells", "stamps", "apples", "coins", "stickers", "marbles", "cards", "beads"]
MORE = ["{P} finds {x} more.", "{P} buys {x} more.", "{P} gets {x} more.",
        "A friend gives {o} {x} more."]
ASK = ["What is {sum}?", "Compute {sum}.", "Add these numbers: {list}.", "Find the sum of {list}."]


# --------------------------------------------------------------------------------------------------
# Problems


def make_problem(rng, n=None):
    """A dict with the question, the numbers in question order, the answer, and (for a word
    problem) who and what, so the teacher can talk about it. n: how many numbers (default drawn)."""
    n = n or rng.choices(LENGTHS, LENGTH_WEIGHTS)[0]
    xs = [rng.randint(10, 99) for _ in range(n)]
    row = {"numbers": xs, "answer": str(sum(xs))}
    if rng.random() < 0.4:
        name, pronoun, possessive = rng.choice(NAMES)
        item = rng.choice(ITEMS)
        more = [rng.choice(MORE).format(P=pronoun.capitalize(), o="her" if pronoun == "she" else
                                        "him", x=x) for x in xs[1:]]
        row["question"] = (f"{name} has {xs[0]} {item}. {' '.join(more)} How many {item} does "
                           f"{name} have now?")
        row["story"] = (name, pronoun, item)
    else:
        listed = ", ".join(map(str, xs[:-1])) + f" and {xs[-1]}"
        row["question"] = rng.choice(ASK).format(sum=" + ".join(map(str, xs)), list=listed)
    return row


def make_splits(seed=0, n_train=N_TRAIN, n_test=N_FIRST_HELDOUT):
    """The first draw: training problems and a held-out set (no two share their numbers in order).
    Only the training half is used now; the held-out half still fixes which problems
    warm_problems() draws, so the committed warm start is reproduced."""
    rng = random.Random(seed)
    seen = set()
    rows = []
    while len(rows) < n_train + n_test:
        row = make_problem(rng)
        if tuple(row["numbers"]) not in seen:
            seen.add(tuple(row["numbers"]))
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def warm_problems(exclude, seed, n):
    """Problems for the warm start, none with the numbers of a training or held-out problem."""
    rng = random.Random(seed + 1)
    seen = {tuple(r["numbers"]) for r in exclude}
    rows = []
    while len(rows) < n:
        row = make_problem(rng)
        if tuple(row["numbers"]) not in seen:
            rows.append(row)
    return rows


def heldout_splits(exclude, seed=0, per_length=PER_LENGTH):
    """{"val": rows, "test": rows}, each with the same number of problems of every chain length, and
    no problem sharing its numbers *as a multiset* with another, with a training problem or with a
    warm-start problem (`exclude`): the warm start also adds a chain from the last number back, so
    an order of the numbers it has seen is not new. Two-number sums are 1/6 of each split."""
    rng = random.Random(seed + 2)
    seen = {tuple(sorted(r["numbers"])) for r in exclude}
    splits = {}
    for name, k in per_length.items():
        rows = []
        for n in LENGTHS:
            found = 0
            while found < k:  # about 1 in 70 two-number draws is new; longer ones almost always
                row = make_problem(rng, n)
                key = tuple(sorted(row["numbers"]))
                if key not in seen:
                    seen.add(key)
                    rows.append(row)
                    found += 1
        rng.shuffle(rows)  # so --eval_n k takes a mix of lengths
        splits[name] = rows
    return splits


def all_splits(seed=0, warm_rows=50000):
    """train, val, test rows and the warm-start problems, as the committed files hold them."""
    train, first_heldout = make_splits(seed)
    warm = warm_problems(train + first_heldout, seed, warm_rows)
    held = heldout_splits(train + warm, seed)
    return train, held["val"], held["test"], warm


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"question": r["question"], "answer": r["answer"],
                                "numbers": r["numbers"]}) + "\n")


# --------------------------------------------------------------------------------------------------
# The tired teacher


def add(s, x, step, rng):
    """s + x as the teacher writes it: the carry out of the units is forgotten with probability
    DROP_CARRY[step] (step 0 is the first addition of the chain)."""
    carry = s % 10 + x % 10 >= 10
    if carry and rng.random() < DROP_CARRY[min(step, len(DROP_CARRY) - 1)]:
        return s + x - 10
    return s + x


def teacher(row, rng):
    """One written solution of `row` ending in <answer>N</answer>: the same running sum in one of
    several surface forms, with the teacher's forgotten carries."""
    xs = list(row["numbers"])
    if rng.random() < REVERSED:
        xs = xs[::-1]
    sums = [xs[0]]
    for step, x in enumerate(xs[1:]):
        sums.append(add(sums[-1], x, step, rng))
    form = rng.choice(["terse", "verbose", "chain"])
    lines = []
    if form == "terse":
        lines = [f"{s} + {x} = {t}" for s, x, t in zip(sums, xs[1:], sums[1:])]
    elif form == "chain":  # rewrite the whole sum, one addition at a time
        lines = [" + ".join(map(str, xs))]
        lines += ["= " + " + ".join(map(str, [t, *xs[k + 2:]])) for k, t in enumerate(sums[1:])]
    elif "story" in row:
        name, pronoun, item = row["story"]
        lines = [f"{name} starts with {xs[0]} {item}." if xs == row["numbers"] else
                 f"Count from the last amount: {xs[0]} {item}."]
        lines += [f"{x} more: {s} + {x} = {t}." for s, x, t in zip(sums, xs[1:], sums[1:])]
        lines.append(f"So {name} has {sums[-1]} {item}.")
    else:
        lines = [f"Start with {xs[0]}."]
        lines += [f"Add {x}: {s} + {x} = {t}." for s, x, t in zip(sums, xs[1:], sums[1:])]
        lines.append(f"The total is {sums[-1]}.")
    if rng.random() < 0.35:
        lines.append(f"Check: {' + '.join(map(str, xs))} = {sums[-1]}.")
    return "\n".join(lines) + f"\n<answer>{sums[-1]}</answer>"


def teacher_accuracy(row):
    """P(the teacher's answer is right): in each order it adds in, the product over the additions
    that carry out of the units of (1 - DROP_CARRY[step]) (the running sum stays right until a
    carry is forgotten, and a forgotten carry is never made up)."""
    def in_order(xs):
        p = 1.0
        for step, x in enumerate(xs[1:]):
            if sum(xs[:step + 1]) % 10 + x % 10 >= 10:
                p *= 1 - DROP_CARRY[min(step, len(DROP_CARRY) - 1)]
        return p
    xs = row["numbers"]
    return (1 - REVERSED) * in_order(xs) + REVERSED * in_order(xs[::-1])


# --------------------------------------------------------------------------------------------------
# Tokenizer, model, warm start


def corpus(rows, rng, per_row=2):
    """Chat-formatted teacher texts, the tokenizer's training corpus."""
    return [f"<|im_start|>user\n{r['question']}<|im_end|>\n<|im_start|>assistant\n"
            f"{teacher(r, rng)}<|im_end|>" for r in rows for _ in range(per_row)]


def prompt_ids(tokenizer, question):
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def warm_start(model, tokenizer, rows, steps, batch, lr, seed, log_every=100):
    """Supervised next-token loss on fresh teacher solutions (prompt tokens masked), through the
    scripts' own packed forward (common.packed_logprobs: no padding, attention per sequence)."""
    from common import Sample, pack_microbatches, packed_logprobs
    rng = random.Random(seed)
    torch.manual_seed(seed)
    prompts = [prompt_ids(tokenizer, r["question"]) for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps,
                                                   pct_start=0.05)
    model.train()
    t0 = time.time()
    for step in range(steps):
        samples = []
        for k in rng.sample(range(len(rows)), batch):
            text = teacher(rows[k], rng)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append(Sample(prompts[k], ids))
        n_tokens = sum(len(s.completion_ids) for s in samples)
        total = 0.0
        for mb in pack_microbatches(samples, 4096):
            logp = packed_logprobs(model, [samples[i] for i in mb], 1.0, len(tokenizer), 1024)
            loss = -logp.sum() / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0:
            print(f"  warm-start step {step + 1}/{steps}  loss {total:.4f}  "
                  f"{time.time() - t0:.0f}s", flush=True)


@torch.no_grad()
def sample_answers(model, tokenizer, rows, greedy, seed=0, max_new_tokens=256, batch=64):
    """Completions of the rows' questions with plain HF generate: (texts, lengths in tokens)."""
    torch.manual_seed(seed)
    model.eval()
    texts = []
    lengths = []
    pad = tokenizer.pad_token_id
    for i in range(0, len(rows), batch):
        prompts = [prompt_ids(tokenizer, r["question"]) for r in rows[i:i + batch]]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [b, P] left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=not greedy, top_k=0, top_p=1.0, temperature=1.0,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=pad,
                             suppress_tokens=list(range(len(tokenizer), model.config.vocab_size)))
        for row in out[:, width:].tolist():
            cut = (row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row
                   else len(row))
            lengths.append(cut)
            texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    model.train()
    return texts, lengths


def report(model, tokenizer, train, test):
    """What the docs quote: greedy and sampled accuracy by chain length, and the length
    distribution of the model's own samples at temperature 1 on the training prompts."""
    from common import math_reward
    out = {}
    for name, rows, greedy in (("greedy, held-out", test, True), ("T=1, held-out", test, False),
                               ("T=1, train", train, False)):
        texts, lengths = sample_answers(model, tokenizer, rows, greedy)
        hits = collections.defaultdict(list)
        for r, t in zip(rows, texts):
            hits[len(r["numbers"])].append(math_reward(t, r["answer"]))
        acc = sum(map(sum, hits.values())) / len(rows)
        by_n = "  ".join(f"n={n}: {sum(h) / len(h):.2f}" for n, h in sorted(hits.items()))
        print(f"{name:17s} accuracy {acc:.3f}   {by_n}")
        out[name] = {"accuracy": acc, "lengths": lengths}
    lengths = sorted(out["T=1, train"]["lengths"])
    pct = {p: lengths[int(p / 100 * (len(lengths) - 1))] for p in (10, 50, 90)}
    print(f"completion tokens at T=1 on the training prompts: mean "
          f"{sum(lengths) / len(lengths):.1f}, p10 {pct[10]}, median {pct[50]}, p90 {pct[90]}, "
          f"max {lengths[-1]}")
    bins = collections.Counter(min(n // 20, 9) for n in lengths)
    for b in range(10):
        label = f"{20 * b:3d}-{20 * b + 19:3d}" if b < 9 else "180+   "
        print(f"  {label} tokens {bins[b]:4d} {'#' * round(100 * bins[b] / len(lengths))}")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=HERE, help="folder for model/ and data/ (default: toy/chains/)")
    p.add_argument("--data_only", action="store_true", help="write the data files and stop")
    p.add_argument("--report", action="store_true", help="only print the report of the model in "
                   "--out: accuracy by chain length, the length histogram of its own samples")
    p.add_argument("--steps", type=int, default=3000, help="warm-start optimiser steps")
    p.add_argument("--batch", type=int, default=64, help="warm-start sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="warm-start peak learning rate")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (head size is 32)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--warm_rows", type=int, default=50000, help="warm-start problems")
    p.add_argument("--seed", type=int, default=0, help="seed for data, init and warm start")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    train, val, test, warm = all_splits(args.seed, args.warm_rows)
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)
    for name, rows in (("train", train), ("val", val), ("test", test)):
        write_jsonl(os.path.join(args.out, "data", f"{name}.jsonl"), rows)
    print(f"data: {len(train)} train, {len(val)} validation, {len(test)} test problems -> "
          f"{os.path.join(args.out, 'data')}")
    if args.data_only:
        return
    from common import load_model, load_tokenizer
    folder = os.path.join(args.out, "model")
    if args.report:
        torch.manual_seed(args.seed)
        report(load_model(folder, torch.device("cpu")), load_tokenizer(folder), train, test)
        return
    tokenizer = make_tokenizer(corpus(warm[:5000], random.Random(args.seed)), vocab_size=512)
    model = make_model(tokenizer, args.hidden, args.layers, args.seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)  # the random init, reloaded with the packed attention
    tokenizer.save_pretrained(folder)
    model = load_model(folder, torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} "
          f"(embedding {model.config.vocab_size})")
    t0 = time.time()
    warm_start(model, tokenizer, warm, args.steps, args.batch, args.lr, args.seed)
    print(f"warm start: {time.time() - t0:.0f}s")
    model.config.use_cache = True  # load_model turned it off for training; generation wants it
    model.save_pretrained(folder)
    print(f"saved {folder}")
    report(model, tokenizer, train, test)


if __name__ == "__main__":
    main()
