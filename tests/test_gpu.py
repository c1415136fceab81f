"""The GPU check (docs/README.md#gpu). On the CPU: the flash path's branch for torch 2.11, whose
varlen_attn has no enable_gqa (the key/value heads repeated for their groups), and torch >= 2.12's,
each against a per-sequence fp32 reference with a stand-in kernel of that version's signature;
`python docs/gpu_check.py` as its dry run; the shapes it builds and the estimates README's "Will
it fit?" table prints. On a CUDA GPU (skipped without one): the committed flash path with the real
kernel against the bucketed sdpa and an fp32 reference, and each script's start, steps, save and
resume on the toy, in full and with LoRA."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCH_CONFIGS, TINY_VOCAB, RecordingOptimizer, build_tiny

import common
from common import (Passes, Sample, check_packing, eager_logprobs, flash_attention, load_model,
                    load_tokenizer, packed_inputs, policy_update, sequence_logprobs,
                    token_coefficients, trainer_gib)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "docs"))
import gpu_check  # noqa: E402
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (docs/README.md#gpu)")

# (prompt length, completion lengths): groups of 4, 1 and 3 completions
GROUPS = [(9, [7, 3, 12, 5]), (4, [6]), (15, [2, 9, 4])]


def group_samples(vocab, seed=0):
    """The GROUPS as samples of random token ids, each group's completions after one prompt, N(0, 1)
    advantages and seq-mean coefficients."""
    gen = torch.Generator().manual_seed(seed)
    tokens = lambda n: torch.randint(3, vocab, (n,), generator=gen).tolist()
    samples = []
    for p, cs in GROUPS:
        prompt = tokens(p)
        for c in cs:
            advantage = float(torch.randn((), generator=gen))
            samples.append(Sample(prompt_ids=prompt, completion_ids=tokens(c), advantage=advantage))
    coefs = token_coefficients([len(s.completion_ids) for s in samples], "seq_mean")
    for s, c in zip(samples, coefs.tolist()):
        s.coef = c
    return samples


def rows_of(samples, shared):
    """Each sample's (query rows, key rows) in packed_inputs' row, worked out from the samples
    alone: one sequence after another; with `shared` a later completion of a prompt has its own
    rows as queries, and the prompt's rows then its own as keys."""
    out = []
    t = 0
    last = None  # the prompt laid out last
    prompt_rows = []
    for s in samples:
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if shared and s.prompt_ids == last:
            own = list(range(t, t + c))
            out.append((own, prompt_rows + own))
            t += c
        else:
            own = list(range(t, t + p + c))
            out.append((own, own))
            prompt_rows = own[:p]
            last = s.prompt_ids
            t += p + c
    return out


def alone(q, k, v, samples, shared, scale):
    """The reference: each sequence's attention on its own, fp32, [1, H, T, d] in, [1, T, Hq, d]
    out; query j of Lq sees keys up to Lk - Lq + j (its whole prompt, then causal)."""
    out = torch.zeros(q.shape[2], q.shape[1], q.shape[3])  # [T, Hq, d]
    for queries, keys in rows_of(samples, shared):
        mask = torch.ones(len(queries), len(keys), dtype=torch.bool).tril(len(keys) - len(queries))
        o = F.scaled_dot_product_attention(  # [1, Hq, Lq, d]
            q[:, :, queries].float(), k[:, :, keys].float(), v[:, :, keys].float(),
            attn_mask=mask, scale=scale, enable_gqa=True)
        out[queries] = o[0].transpose(0, 1)
    return out[None]


def by_definition(q, k, v, cu_q, cu_k, scale):
    """varlen_attn's result, fp32: sequence i's queries q[cu_q[i]:cu_q[i+1]] against its keys
    k[cu_k[i]:cu_k[i+1]], causal from the bottom right."""
    out = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        mask = torch.ones(b - a, d - c, dtype=torch.bool).tril(d - c - (b - a))
        x = [t.float().transpose(0, 1) for t in (q[a:b], k[c:d], v[c:d])]  # [H, L, d]
        out.append(F.scaled_dot_product_attention(*x, attn_mask=mask, scale=scale,
                                                  enable_gqa=True).transpose(0, 1))
    return torch.cat(out)  # [Tq, Hq, d]


def kernel_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1)):
    """A stand-in with torch 2.11.0's signature of varlen_attn (read in its wheel's
    torch/nn/attention/varlen.py): no enable_gqa, and key and value of shape (T_k, H, D), as many
    heads as the query's."""
    assert window_size == (-1, 0) and query.dtype == key.dtype == torch.bfloat16
    assert key.shape[1] == value.shape[1] == query.shape[1], (query.shape, key.shape)
    CALLS.append(("2.11", key.shape[1]))
    return by_definition(query, key, value, cu_seq_q, cu_seq_k, scale)


def kernel_2_12(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
                scale=None, window_size=(-1, -1), enable_gqa=False, seqused_k=None,
                block_table=None, num_splits=None):
    """A stand-in with torch 2.12's signature (and 2.13's): enable_gqa maps each group of query
    heads to its key/value head."""
    assert window_size == (-1, 0) and query.dtype == key.dtype == torch.bfloat16
    assert enable_gqa and key.shape[1] < query.shape[1], (query.shape, key.shape)
    CALLS.append(("2.12", key.shape[1]))
    return by_definition(query, key, value, cu_seq_q, cu_seq_k, scale)


CALLS = []  # (the stand-in's version, the key/value heads it was handed), per call


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kernel", [kernel_2_11, kernel_2_12])
def test_flash_attention_on_either_kernel_signature_equals_each_sequence_alone(monkeypatch, kernel,
                                                                            shared):
    """flash_attention against each sequence's fp32 attention on its own (GQA: 8 query heads, 2
    key/value heads), the kernel a stand-in of torch 2.11's signature (no enable_gqa: the
    key/value heads come repeated, 8 of them) or 2.12's (enable_gqa, 2 of them). Inputs rounded to
    bf16, so that the kernel's cast is exact: outputs within 1e-5; the inputs' gradients within
    bf16's rounding (the kernel's inputs are bf16)."""
    monkeypatch.setattr(common, "varlen_attn", kernel)
    CALLS.clear()
    samples = group_samples(50)
    _, pos, _, _ = packed_inputs(samples, "cpu", shared)
    T = pos.shape[1]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, T, 32, generator=gen).bfloat16().float().requires_grad_()
               for h in (8, 2, 2))
    w = torch.randn(1, T, 8, 32, generator=gen)
    got = flash_attention(q, k, v, pos, 0.3)  # [1, T, Hq, d]
    got_grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    want = alone(q, k, v, samples, shared, 0.3)
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    assert CALLS == [("2.11", 8)] if kernel is kernel_2_11 else [("2.12", 2)]
    assert got.shape == want.shape == (1, T, 8, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, h in zip(got_grads, want_grads):
        torch.testing.assert_close(g, h, atol=2e-2, rtol=2e-2)


def test_the_repeat_is_each_key_value_head_for_its_group():
    """Query head h reads key/value head h // (Hq / Hkv), as sdpa's enable_gqa (and transformers'
    repeat_kv) has it: with 2 key/value heads and 6 query heads, heads 0-2 read 0, heads 3-5 read
    1."""
    kv = torch.tensor([10.0, 20.0])[None, :, None]  # [1 row, 2 heads, 1]
    assert kv.repeat_interleave(6 // 2, 1).flatten().tolist() == [10, 10, 10, 20, 20, 20]


# ---------------------------------------------------------------- docs/gpu_check.py


def test_attempt_records_a_failing_row_on_one_line_and_table_rows_reads_a_table():
    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB.\nGPU 0 ...")
    assert gpu_check.attempt(out_of_memory) == ("OutOfMemoryError: CUDA out of memory. Tried to "
                                                "allocate 9.00 GiB. GPU 0 ...")
    assert gpu_check.attempt(lambda: 1.5) == 1.5
    text = "prose\n\n| a | b c |\n|---|---|\n| 1 | x, y |\n| 2 | - |\n\nmore prose"
    assert gpu_check.table_rows(text) == [{"a": "1", "b c": "x, y"}, {"a": "2", "b c": "-"}]


@pytest.mark.skipif(CUDA, reason="on a GPU the command is the real check (minutes): "
                    "docs/README.md#gpu runs it")
def test_the_gpu_check_dry_run_writes_its_tables_and_json(tmp_path):
    """`python docs/gpu_check.py` without CUDA: the same code on the toy shape, small. It prints
    the header (command, machine, software), the update's table (three layouts) and the memory
    table (full and LoRA beside the estimate), and writes results/gpu.json under --out, not
    docs/."""
    command = [sys.executable, os.path.join(REPO, "docs", "gpu_check.py"), "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "python docs/gpu_check.py --out" in out and "no GPU" in out and "torch " in out
    layouts = [line.split(" | ")[1] for line in out.splitlines() if line.startswith("| toy (")]
    assert layouts == ["padded", "packed", "shared prompt"]
    memory = [line for line in out.splitlines() if line.startswith("| toy | ")]
    assert [line.split(" | ")[2] for line in memory] == ["full", "LoRA r = 16"]
    report = json.loads((tmp_path / "results" / "gpu.json").read_text())
    assert {"command", "date", "machine", "software", "step", "memory"} <= set(report)
    assert [row["layout"] for row in report["step"]["toy"]] == layouts
    assert report["step"]["toy"][1]["vs padded, packed (same budget)"].endswith("x padded")
    full = gpu_check.random_model("toy", "meta")
    params = full.num_parameters()
    rows = [(m["shape"], m["lora_r"], m["peak_gib"]) for m in report["memory"]]
    assert rows == [("toy", 0, "-"), ("toy", 16, "-")]  # the CPU measures no peak
    assert report["memory"][0]["parameters"] == params
    assert report["memory"][0]["estimate_gib"] == trainer_gib(params, params, 0.0, 0)
    lora = gpu_check.random_model("toy", "meta", 16)
    trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert report["memory"][1]["estimate_gib"] == trainer_gib(params + trained, trained, 0.0, 16)


def test_the_shapes_are_qwen25s_and_readmes_will_it_fit_table_is_their_estimate():
    """SHAPES built on the meta device have Qwen2.5's parameter counts (the hub's configs: 0.49B,
    1.54B, 3.09B, 7.62B, 7B's embedding untied), and README's "Will it fit?" table is trainer_gib
    of each: full fine-tuning with a reference and without, and --lora_r 16 (every linear layer
    but the LM head, the adapter trained, no reference)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    table = readme.split('<a id="will-it-fit"></a>')[1].split("\n\n")[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| Qwen2.5-")]
    assert len(rows) == 4
    for row, shape in zip(rows, gpu_check.SHAPES):
        n = gpu_check.random_model(shape, "meta").num_parameters()
        lora = gpu_check.random_model(shape, "meta", 16)
        trained = sum(p.numel() for p in lora.parameters() if p.requires_grad)
        assert row[0] == f"| Qwen2.5-{shape.split('-')[1].upper()}"
        assert row[1] == f"{n / 1e9:.2f}B"
        estimates = [trainer_gib(n, n, 0.04, 0), trainer_gib(n, n, 0.0, 0),
                     trainer_gib(n + trained, trained, 0.04, 16)]
        assert row[2:5] == [f"{e:.1f}" for e in estimates], (shape, row)
        assert row[5] == "estimate, not measured |"  # until the GPU check has run
    assert "none was measured on a GPU yet" in readme.split('<a id="will-it-fit"></a>')[1][:1200]
    config = gpu_check.random_model("qwen2.5-7b", "meta").config
    assert (config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (
        4, 152064, False)


# ---------------------------------------------------------------- on a GPU


def real_kernel_without_enable_gqa(real):
    """The real kernel behind torch 2.11's signature, so that the repeat branch runs on it
    whatever torch this is: the key/value heads must come repeated."""
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None,
               scale=None, window_size=(-1, -1)):
        assert key.shape[1] == query.shape[1]
        CALLS.append(("2.11", key.shape[1]))
        return real(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                    window_size=window_size)
    return kernel


def counted(real):
    """The real kernel, its signature kept (inspect follows __wrapped__), each call recorded."""
    @functools.wraps(real)
    def kernel(*args, **kwargs):
        CALLS.append(("real", args[1].shape[1]))
        return real(*args, **kwargs)
    return kernel


def logprobs_and_grads(model, samples, passes):
    """The trainer's log-probs [|o_i|] per sample (sequence_logprobs) and the gradient of one
    on-policy update (policy_update: -sum_i c_i A_i sum_t grad log p_it)."""
    logps = [lp.float().cpu() for lp in sequence_logprobs(model, samples, passes)]
    opt = RecordingOptimizer(model)
    policy_update(model=model, optimizer=opt, samples=samples, passes=passes, clip=(0.2, 0.2),
                  beta=0.0, grad_clip=1e9)
    return logps, {n: g.float().cpu() for n, g in opt.grads.items()}


def fp32_reference(model, samples, vocab):
    """The reference: fp32, no autocast, each sequence alone through the model's forward. (Log-probs
    [|o_i|] per sample on the CPU, and the gradient of -sum_i c_i A_i sum_t log p_it.)"""
    want_logps, loss = [], 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids], device="cuda")
        p, n = len(s.prompt_ids), len(s.completion_ids)
        logits = model(input_ids=ids).logits[0, p - 1:p + n - 1, :vocab].float()
        lp = logits.log_softmax(-1).gather(1, ids[0, p:, None])[:, 0]  # [n]
        want_logps.append(lp.detach().cpu())
        loss = loss - s.coef * s.advantage * lp.sum()
    model.zero_grad()
    loss.backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    model.zero_grad()
    return want_logps, grads


def errors(got, want):
    """(max |log-prob error| in nats, |grad error| / |grad| over all the parameters: 2-norms)."""
    logp = max((g - w).abs().max().item() for g, w in zip(got[0], want[0]))
    diff = sum(((got[1][n] - w) ** 2).sum() for n, w in want[1].items())
    norm = sum((w ** 2).sum() for w in want[1].values())
    return logp, (diff / norm).sqrt().item()


@gpu
@pytest.mark.parametrize("budget", [4096, 24])  # 24 tokens: every group of GROUPS split
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kernel", ["enable_gqa", "repeat"])
def test_the_flash_path_on_the_real_kernel(tmp_path, monkeypatch, kernel, shared, budget):
    """A 2-layer GQA Qwen2 (8 query heads, 2 key/value heads, head size 32, random weights) on the
    GPU under bf16 autocast: the committed flash path (one varlen_attn call a layer, the real
    kernel; with `repeat` behind torch 2.11's signature) against the bucketed sdpa (the flash path
    switched off), both against fp32 with each sequence alone. Log-probs and the update's
    gradient, shared prompt or not, a budget that holds all or splits every group: the flash
    path's error at most twice the buckets' (+2e-3), and under 0.05 (nats; relative)."""
    real = common.varlen_attn
    if kernel == "enable_gqa" and "enable_gqa" not in common.inspect.signature(real).parameters:
        pytest.skip("this torch's varlen_attn has no enable_gqa (torch 2.11)")
    folder = build_tiny(str(tmp_path / "model"), hidden=256, lm_head_scale=1.0)
    model = load_model(folder, torch.device("cuda"))
    vocab = len(load_tokenizer(folder))  # the embedding is padded past it
    samples = group_samples(vocab, seed=2)
    passes = Passes(1.0, vocab, budget, 7, shared=shared)
    want = fp32_reference(model, samples, vocab)  # sdpa, causal
    monkeypatch.setattr(common, "varlen_attn", counted(real) if kernel == "enable_gqa"
                        else real_kernel_without_enable_gqa(real))
    CALLS.clear()
    flash = errors(logprobs_and_grads(model, samples, passes), want)
    heads = {h for _, h in CALLS}
    assert CALLS and heads == ({2} if kernel == "enable_gqa" else {8}), CALLS
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (7, 5))
    CALLS.clear()
    buckets = errors(logprobs_and_grads(model, samples, passes), want)
    assert not CALLS  # the buckets ran
    for f, b in zip(flash, buckets):
        assert f <= 2 * b + 2e-3 and f < 0.05, (flash, buckets)


@gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
def test_the_zoo_on_the_gpu(arch_dir, arch, shared):
    """tests/test_packing.py's architectures (sliding windows of 8 tokens, shorter than the GROUPS'
    sequences; gpt-oss's sinks; mixtures of experts) on the GPU under bf16 autocast: the flash
    path (gpt-oss: the bucketed sdpa, for its sinks), shared prompt or not, against each sequence
    alone through the model's own eager attention in fp32. Log-probs within four times what the
    model's own bf16 forward is from its fp32 one (+1e-3: the start-up check's tolerance), the
    update's gradient within 0.05 (relative); and the start-up check passes it packed."""
    model = load_model(arch_dir(arch), torch.device("cuda"))
    samples = group_samples(TINY_VOCAB, seed=3)
    passes = Passes(1.0, TINY_VOCAB, 4096, 7, shared=shared)
    model.set_attn_implementation("eager")  # the reference: the model's own attention
    want = fp32_reference(model, samples, TINY_VOCAB)
    with torch.no_grad():
        _, noise = eager_logprobs(model.eval(), samples, TINY_VOCAB)
    model.set_attn_implementation("varlen")
    model.train()
    logp, grad = errors(logprobs_and_grads(model, samples, passes), want)
    assert logp <= 1e-3 + 4 * noise and grad < 0.05, (logp, noise, grad)
    assert check_packing(model, passes, "varlen", 64)[0].packed


SCRIPTS = ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]


def launch(args, script, log):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, os.path.join(REPO, f"{script}.py"), *args], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """Each script on the toy, in full and with --lora_r 16, all at once (the GPU holds them): two
    steps saved at step 2 (--rollout hf, bf16 autocast, --grad_ckpt true), then --resume to a
    third. {(script, lora_r): [out folder, first run, resumed run]}, each run (exit code, the end
    of its output)."""
    base = tmp_path_factory.mktemp("scripts")
    flags = ["--rollout", "hf", "--grad_ckpt", "true", "--eval_every", "0", "--eval_n", "16"]
    jobs = {(script, r): base / f"{script}-{r}" for script in SCRIPTS for r in (0, 16)}
    runs = {job: [str(out)] for job, out in jobs.items()}
    for phase in ("first", "resumed"):
        procs = {}
        for (script, r), out in jobs.items():
            args = [*flags, "--lora_r", str(r), "--steps", "2", "--save_every", "2", "--out",
                    str(out)]
            if phase == "resumed":
                args = ["--resume", str(out), "--steps", "3"]
            with open(f"{out}-{phase}.log", "w") as log:  # the child keeps its own copy
                procs[script, r] = launch(args, script, log)
        for job, proc in procs.items():
            code = proc.wait(timeout=900)
            runs[job].append((code, open(f"{jobs[job]}-{phase}.log").read()[-3000:]))
    return runs


@gpu
@pytest.mark.parametrize("lora_r", [0, 16])
@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_starts_steps_saves_and_resumes_on_the_gpu(script_runs, script, lora_r):
    """Exit 0 both times; steps 1, 2 logged, then 3 after --resume, each with its GPU peak; the
    checkpoints at 2 and 3; the run's flags as asked (hf rollout, gradient checkpointing, LoRA)."""
    out, first, resumed = script_runs[script, lora_r]
    assert first[0] == 0, first[1]
    assert resumed[0] == 0, resumed[1]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    trained = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["gpu_peak_gib"] > 0 for r in trained)
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["engine"] == "HFEngine"
    assert (config["args"]["grad_ckpt"], config["args"]["lora_r"]) == (True, lora_r)
    assert common.checkpoints(out) == [os.path.join(out, f"checkpoint-{s}") for s in (2, 3)]
