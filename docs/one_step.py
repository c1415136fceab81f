"""One GRPO step of the toy on CPU, on real numbers: writes docs/one_step.md.

    python docs/one_step.py          # rewrites docs/one_step.md (seconds on CPU)
    python docs/one_step.py --check  # exit 1 if the page is no longer what the code computes

It runs grpo.py's numbered step with common.py's own functions and prints what each computes.
Nothing is sampled (a draw can change with a CPU's last bit): the group's completions are fixed
texts. Every number is rounded to 3 significant digits, far coarser than the float32 differences
between CPUs and torch versions, so the page is the same on any of them. tests/test_one_step.py
regenerates it and compares, and checks that nudging every weight by 1e-6 changes nothing.
"""
import argparse
import os
import sys

import torch

DOCS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(DOCS)
sys.path.insert(0, REPO)
from common import (Passes, Sample, group_advantages, load_model, load_tokenizer,  # noqa: E402
                    make_optimizer, math_reward, policy_update, prompt_token_ids,
                    sequence_logprobs, template_messages, token_coefficients, token_loss)

PAGE = os.path.join(DOCS, "one_step.md")
SEED = 0
MODEL = os.path.join(REPO, "toy", "model")
QUESTION = "What is 47 + 38?"
GOLD = "85"
# the group's G completions, fixed rather than sampled: one right, three wrong. The toy's greedy
# answer is "75", the carry dropped (toy/build.py's sloppy teacher)
COMPLETIONS = ["<answer>85</answer>", "<answer>75</answer>", "<answer>65</answer>",
               "<answer>95</answer>"]
SHOWN = 0  # the completion whose tokens the page shows one by one
DIGITS = [2, 3]  # the answer's digits in each completion: tokens 3 and 4, after "<answer", ">"
# grpo.py's defaults, the toy's learning rate, and mu = 2 (grpo.py's default is 1: the ratio is
# then 1 and the clip inert, docs/grpo.md#eq-zero-loss)
STD_MODE, ADV_EPS, EPS_LOW, EPS_HIGH, BETA = "unbiased", 1e-4, 0.2, 0.2, 0.04
LOSS_AGG, MAX_TOKENS, LR, GRAD_CLIP = "seq_mean", 24, 3e-4, 1.0
EQ = "grpo.md#eq-"  # the page links each number to the equation that made it


def num(x, places=4, digits=3):
    """x to `digits` significant digits and at most `places` decimals: 1.88, 0.0902, 1.00, and
    0.0037 (float32 differences are absolute where a value nears 0); a zero as 0.0000."""
    x = float(x)
    text = f"{x:#.{digits}g}".rstrip(".")  # '#': the zeros kept, 1.00
    if "e" in text or len(text.partition(".")[2]) > places:
        text = f"{x:.{places}f}"
    return f"{0:.{places}f}" if float(text) == 0 else text  # 0.0000, never -0.0000 or 0.00


def prompt(row, template):
    """grpo.py's prompt(): the row's question in the template's chat messages."""
    return template_messages(template, row["question"])


def step():
    """One GRPO step with mu = 2: what the page shows, as a dict of plain values."""
    torch.manual_seed(SEED)
    tokenizer = load_tokenizer(MODEL)
    # 1. the group: one prompt (the plain template: grpo.py's prompt()), G fixed completions
    rows = [{"row": {"question": QUESTION}, "where": "docs/one_step.py"}]
    prompt_ids = prompt_token_ids(tokenizer, rows, prompt, "plain", 512)[0]["prompt_ids"]
    completions = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                   for text in COMPLETIONS]  # each ends at the stop token, as an engine's does
    # 2. reward, 3. advantages (docs/grpo.md#eq-advantage), a Sample each, its weight c_i
    rewards = torch.tensor([[math_reward(text, GOLD) for text in COMPLETIONS]])  # [1, G]
    advantages = group_advantages(rewards, STD_MODE, ADV_EPS)  # [1, G]
    samples = [Sample(prompt_ids, ids, reward=float(r), advantage=float(a))
               for ids, r, a in zip(completions, rewards[0], advantages[0])]
    coefs = token_coefficients([len(ids) for ids in completions], LOSS_AGG, max_len=MAX_TOKENS)
    for sample, coef in zip(samples, coefs.tolist()):
        sample.coef = coef
    # 4. the policy, the frozen reference, the optimiser, how the passes run (as setup makes them)
    model = load_model(MODEL, "cpu")
    reference = load_model(MODEL, "cpu", frozen=True)
    optimizer, _ = make_optimizer(model, LR, 0.0, 0, 1, "constant")
    passes = Passes(temperature=1.0, vocab_size=len(tokenizer), token_budget=4096, shared=True)
    # old log-probs before the first update (mu > 1), reference log-probs (beta > 0)
    for sample, logps in zip(samples, sequence_logprobs(model, samples, passes)):
        sample.old_logps = logps
    for sample, logps in zip(samples, sequence_logprobs(reference, samples, passes)):
        sample.ref_logps = logps
    update = dict(clip=(EPS_LOW, EPS_HIGH), beta=BETA, tis_cap=0.0, grad_clip=GRAD_CLIP)
    first = policy_update(model, optimizer, samples, passes, **update)  # update 1 of mu = 2
    # what update 2 computes, token by token: the same log-probs, without the gradient
    now = sequence_logprobs(model, samples, passes)
    per_token = []
    for sample, logps in zip(samples, now):
        advantage = torch.full_like(logps, sample.advantage)  # [|o|]: every token gets A_i
        loss, kl, clipped = token_loss(logps, sample.old_logps, sample.ref_logps, advantage,
                                       EPS_LOW, EPS_HIGH, BETA)  # [|o|] each
        per_token.append(dict(logps=logps, loss=loss, kl=kl, clipped=clipped))
    second = policy_update(model, optimizer, samples, passes, **update)  # update 2 of mu = 2
    summed = sum(s.coef * t["loss"].sum().item() for s, t in zip(samples, per_token))
    assert abs(summed - second["loss"]) < 1e-6, (summed, second["loss"])  # the page adds up
    parameters = sum(p.numel() for p in model.parameters())
    return dict(tokenizer=tokenizer, prompt_ids=prompt_ids, rewards=rewards[0].tolist(),
                parameters=parameters,
                samples=samples, per_token=per_token, first=first, second=second, summed=summed)


def page(s):
    """The markdown of docs/one_step.md from step()'s values."""
    check_prose(s)
    tok = s["tokenizer"]
    samples = s["samples"]
    G = len(samples)
    rewards = torch.tensor(s["rewards"])
    first, second = s["first"], s["second"]
    others = [i for i in range(G) if i != SHOWN]
    first_digit = [x.old_logps[DIGITS[0]].exp() for x in samples]  # p(8), p(7), p(6), p(9)
    size = f"{s['parameters'] / 1e6:.1f}M"
    out = [f"""# One GRPO step of the toy, on real numbers

[Map of the docs](README.md) · the maths: [grpo.md](grpo.md) · the code: [grpo.py](../grpo.py),
[common.py](../common.py)

What one step of `grpo.py` computes, in the order of its numbered loop: each number beside the
function of common.py's Part I that made it and the equation of [grpo.md](grpo.md) it implements.
Written by [`python docs/one_step.py`](one_step.py), which calls common.py's own functions, on
CPU in seconds (torch seed {SEED}; nothing is sampled). The numbers are rounded to 3 significant
digits (at most 4 decimals), far coarser than the float32 differences between CPUs and torch
versions: any of them writes this same page (checked with torch's AVX-512, AVX2 and default CPU
kernels, and with every weight nudged by 1e-6). `tests/test_one_step.py` regenerates the page and
fails when a number here is no longer what the code computes.

The setup: the toy model (`toy/model`, {size} parameters, two-digit addition), one group of
G = {G} completions (grpo.py's default is 8), grpo.py's defaults (`--std_mode {STD_MODE}`,
`--adv_eps {ADV_EPS:g}`, `--eps_low {EPS_LOW}`, `--eps_high {EPS_HIGH}`, `--beta {BETA}`,
`--loss_agg {LOSS_AGG}`, `--grad_clip {GRAD_CLIP}`) and the toy's `--lr {LR:g}`. One change:
**μ = 2** updates on the batch (`--mu 2`). With grpo.py's default μ = 1 the ratio is 1 and the
clip never acts ([grpo.md §5]({EQ}zero-loss)); here the second update is the one to watch.

## 1. The group: a prompt, its G completions, their rewards

grpo.py's steps 1 and 2. The toy's question in the `plain` template (`template_messages`, then the
tokenizer's chat template: `prompt_token_ids`), {len(s["prompt_ids"])} tokens:

```
{tok.decode(s["prompt_ids"])}```

The completions are fixed texts, not sampled (a draw could differ on another CPU), each ending with
the stop token `{tok.eos_token}` as the engine's do. The toy often drops the carry: after
`<answer>` it gives `7` a probability of {num(first_digit[1])} and `8` {num(first_digit[0])}
(section 5's log π_old).
`math_reward(text, "{GOLD}")` scores each ([grpo.md §11](grpo.md#reward)):

| i | completion | \\|o_i\\| tokens | reward r_i |
|---|---|---|---|
"""]
    for i, sample in enumerate(samples):
        out.append(f"| {i + 1} | `{COMPLETIONS[i]}` | {len(sample.completion_ids)} "
                   f"| {num(sample.reward, 0)} |\n")
    out.append(f"""
## 2. Advantages

`group_advantages(rewards, "{STD_MODE}", {ADV_EPS:g})`: A_i = (r_i − mean) / (std + eps)
([grpo.md §2]({EQ}advantage)), here with mean = {num(rewards.mean())} and std = {num(rewards.std())}
(ddof 1). The right answer is pushed up, the wrong ones down; the A_i sum to 0.

| i | r_i | A_i |
|---|---|---|
""")
    for i, sample in enumerate(samples):
        out.append(f"| {i + 1} | {num(sample.reward, 0)} | {num(sample.advantage)} |\n")
    n = len(samples[0].completion_ids)  # every completion's length (check_prose)
    out.append(f"""
## 3. A Sample per completion, and its weight c_i

Each completion becomes a `Sample` (prompt and completion ids, reward, advantage), and
`token_coefficients(lengths, "{LOSS_AGG}")` gives its tokens' weight in the loss:
c_i = 1 / (|o_i| · N), N = {G} completions in the batch ([grpo.md §7]({EQ}aggregation)). Each
completion weighs the same in all, so a longer one's tokens weigh less. Here all are {n} tokens
long: c_i = 1/({n}·{G}) = {num(samples[0].coef, 5, 4)} each.

## 4. Old and reference log-probs, then update 1

grpo.py's step 4. Before the first update, `sequence_logprobs` (no gradient) records each
completion token's log π_old under the policy, and its log π_ref under the frozen reference
(`load_model(..., frozen=True)`): log softmax(LM head(h) / T) at the token
([grpo.md §3]({EQ}logprob); `packed_logprobs`, `chunked_logprobs`). At this first step both are
the initial weights, so log π_ref = log π_old.

Update 1 of μ = 2, `policy_update`, runs the same forward pass with the gradient. The policy is
still π_old: every ratio is 1, nothing is clipped, the KL is 0, and the loss is
Σ_i c_i Σ_t (−A_i) = −Σ_i A_i / N = 0 ([grpo.md §5]({EQ}zero-loss)). Its gradient is not 0 (it is
REINFORCE's). policy_update returned:

| loss | kl (mean per token) | clip_frac | grad_norm (before clipping to {GRAD_CLIP}) |
|---|---|---|---|
{stats_row(first)}

and AdamW took its step (lr {LR:g}): the policy π_θ is no longer π_old.

## 5. Update 2, token by token

Update 2 runs on the same batch, with the policy π_θ that update 1 made. Per token, `token_loss`
computes the ratio ρ = exp(log π_θ − log π_old) and its clip to [{1 - EPS_LOW:g}, {1 + EPS_HIGH:g}]
([grpo.md §4]({EQ}clip)), the k3 KL = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1
([grpo.md §6]({EQ}kl)), and the token's loss ℓ = −min(ρ·A, clip(ρ)·A) + β·KL with β = {BETA};
"clipped": the clipped term was the smaller, so the token's surrogate gradient is 0. (log π_θ is
`sequence_logprobs` of the policy now: what update 2's own pass computes, with the gradient.)
Completion {SHOWN + 1}, `{COMPLETIONS[SHOWN]}`, A = {num(samples[SHOWN].advantage)},
c = {num(samples[SHOWN].coef, 5, 4)}:

{token_table(s, [SHOWN], range(len(samples[SHOWN].completion_ids)))}
Its format tokens, which the model was already sure of (p ≈ 1), barely moved: ρ ≈ 1, KL ≈ 0,
ℓ ≈ −A. The step acted on the answer's first digit: `8` rose past 1 + ε_high and is clipped (with
A > 0 only the upper bound binds), so it earns no more credit; only β·KL pulls it back. The digits
of the other completions, all A < 0:

{token_table(s, others, DIGITS)}
The four first digits are one softmax (each follows `<answer>`): what `7` lost went to `8`, and
some of it to `9`. With A < 0 only the lower bound binds: `7` and `6` fell under 1 − ε_low and are
clipped. `9` was pushed down too, yet rose past 1 + ε_high, and is not clipped: ρ·A is the smaller
term, so the loss keeps pushing it down, hard (ℓ = {num(s["per_token"][3]["loss"][DIGITS[0]])}).

## 6. The loss

L = Σ_i c_i Σ_t ℓ_(i,t) ([grpo.md §1]({EQ}objective), [§7]({EQ}aggregation)): `token_loss` per
token, weighted by `token_coefficients`' c_i and summed in `policy_update`. Each completion's part:

| i | A_i | clipped tokens | Σ_t KL | Σ_t ℓ_(i,t) | c_i | c_i Σ_t ℓ_(i,t) |
|---|---|---|---|---|---|---|
""")
    for i, (sample, t) in enumerate(zip(samples, s["per_token"])):
        part = t["loss"].sum().item()
        out.append(f"| {i + 1} | {num(sample.advantage)} | {int(t['clipped'].sum())} of "
                   f"{len(sample.completion_ids)} | {num(t['kl'].sum())} | {num(part)} "
                   f"| {num(sample.coef, 5, 4)} | {num(sample.coef * part, 5)} |\n")
    tokens = sum(len(sample.completion_ids) for sample in samples)
    clipped = sum(int(t["clipped"].sum()) for t in s["per_token"])
    kl = sum(t["kl"].sum().item() for t in s["per_token"])
    out.append(f"""
The rows sum to L = {num(s["summed"])}; `policy_update` returned loss = {num(second["loss"])}.

## 7. The gradient norm, and update 2's statistics

`policy_update` backpropagates L, clips the gradient's norm to `--grad_clip {GRAD_CLIP}` and takes
the AdamW step. It returned:

| loss | kl (mean per token) | clip_frac | grad_norm (before clipping) |
|---|---|---|---|
{stats_row(second)}

as the tables above have it: kl = Σ KL / tokens = {num(kl)} / {tokens}, clip_frac = clipped tokens
/ tokens = {clipped} / {tokens}. The loss itself says little of progress
([grpo.md §5]({EQ}zero-loss)); the gradient is what moved the weights.
""")
    return "".join(out)


def check_prose(s):
    """What the page's sentences say of the numbers, still true of them."""
    samples = s["samples"]
    assert len({len(x.completion_ids) for x in samples}) == 1, "all are as long (section 3)"
    assert all(torch.allclose(x.old_logps, x.ref_logps, atol=1e-6) for x in samples), "ref = old"
    ratio = [torch.exp(t["logps"] - x.old_logps) for x, t in zip(samples, s["per_token"])]
    clipped = [t["clipped"] for t in s["per_token"]]
    digit = DIGITS[0]  # the answer's first digit
    rest = [k for k in range(len(ratio[SHOWN])) if k != digit]
    assert all(abs(ratio[SHOWN][k] - 1) < 0.01 for k in rest), "format tokens barely move"
    assert ratio[SHOWN][digit] > 1 + EPS_HIGH and clipped[SHOWN][digit], "8 rose, clipped"
    for i in (1, 2):
        assert ratio[i][digit] < 1 - EPS_LOW and clipped[i][digit], "7 and 6 fell, clipped"
    assert ratio[3][digit] > 1 + EPS_HIGH and not clipped[3][digit], "9 rose, not clipped"


def stats_row(stats):
    """policy_update's loss, kl, clip_frac and grad_norm as a table row."""
    return (f"| {num(stats['loss'])} | {num(stats['kl'])} | {num(stats['clip_frac'])} "
            f"| {num(stats['grad_norm'])} |")


def token_table(s, completions, positions):
    """The markdown table of update 2's per-token values at `positions` of `completions`."""
    out = ["| i | t | token | log π_θ | log π_old | ρ | clip(ρ) | clipped | KL | ℓ_t |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for i in completions:
        sample, t = s["samples"][i], s["per_token"][i]
        ratio = torch.exp(t["logps"] - sample.old_logps)  # [|o|]
        for k in positions:
            token = s["tokenizer"].decode([sample.completion_ids[k]]).replace("|", "\\|")
            out.append(f"| {i + 1} | {k + 1} | `{token}` | {num(t['logps'][k])} "
                       f"| {num(sample.old_logps[k])} | {num(ratio[k])} "
                       f"| {num(ratio[k].clamp(1 - EPS_LOW, 1 + EPS_HIGH))} "
                       f"| {'yes' if t['clipped'][k] else 'no'} | {num(t['kl'][k])} "
                       f"| {num(t['loss'][k])} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the page, write nothing")
    parser.add_argument("--out", default=PAGE, help="where to write the page")
    args = parser.parse_args(argv)
    text = page(step())
    if args.check:
        with open(args.out, encoding="utf-8") as f:
            same = f.read() == text
        print(f"{args.out}: {'the same' if same else 'differs from what the code computes now'}")
        sys.exit(0 if same else 1)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
