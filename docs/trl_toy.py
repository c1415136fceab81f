"""The toy run of grpo.py, done by TRL's GRPOTrainer: the peer comparison in docs/results.md.

Not part of the project (nothing imports it, the tests do not run it): TRL pads every batch, this project packs, and
this script measures what that is worth end to end. It needs its own environment, because TRL pins its own versions:

    python -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 trl==1.16.0 math-verify==0.9.0
    trl-venv/bin/python docs/trl_toy.py --out /tmp/trl-toy       # prints the median step time

Matched to `python grpo.py` (toy defaults): the toy model and data, 40 steps of 32 prompts x 8 completions
(256 completions in one padded batch, one optimiser step per rollout), 24 new tokens, temperature 1, lr 3e-4 constant,
beta 0.04, clip 0.2, AdamW without weight decay, grad clip 1, fp32, no gradient checkpointing, transformers generate
(TRL's vLLM mode needs a GPU). The reward is math-verify on the text of the last <answer>...</answer> (the toy model
writes one), 0 without it, like common.math_reward on the toy.
"""
import argparse
import json
import os
import statistics
import time

from datasets import Dataset
from math_verify import parse, verify
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def answer_reward(completions, answer, **kwargs):
    """1 if the last <answer> tag's content equals the reference (math-verify), else 0."""
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        if "<answer>" not in text:
            rewards.append(0.0)
            continue
        inner = text.rsplit("<answer>", 1)[1].split("</answer>", 1)[0].strip()
        rewards.append(float(verify(parse("$" + gold + "$"), parse("$" + inner + "$"))))
    return rewards


class StepTimer(TrainerCallback):
    """Wall time of every optimiser step: rollout, reward and update, as grpo.py's step_s."""

    def __init__(self):
        self.times = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder (TRL's, and step_times.json)")
    p.add_argument("--steps", type=int, default=40, help="optimiser steps (grpo.py's toy default: 40)")
    p.add_argument("--seed", type=int, default=0, help="seed")
    args = p.parse_args()
    rows = [json.loads(line) for line in open(os.path.join(REPO, "toy", "data", "train.jsonl"))]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}], "answer": r["answer"]}
                              for r in rows])
    model_path = os.path.join(REPO, "toy", "model")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32", attn_implementation="sdpa")
    config = GRPOConfig(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=256,
                        gradient_accumulation_steps=1, num_generations=8, max_completion_length=24,
                        temperature=1.0, learning_rate=3e-4, lr_scheduler_type="constant", warmup_steps=0,
                        weight_decay=0.0, adam_beta2=0.999, max_grad_norm=1.0, beta=0.04, epsilon=0.2,
                        num_iterations=1, loss_type="grpo", scale_rewards="group", use_vllm=False, bf16=False,
                        fp16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                        report_to=[], seed=args.seed, use_cpu=True, dataloader_num_workers=0)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=answer_reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    steady = timer.times[1:]  # the first step carries one-off start-up work, as in bench.py's step split
    result = {"median_step_s": statistics.median(steady), "step_s": timer.times, "reward": rewards}
    with open(os.path.join(args.out, "step_times.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"TRL {__import__('trl').__version__}: median step {result['median_step_s']:.3f} s over {len(steady)} steps "
          f"(first step {timer.times[0]:.2f} s left out); reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")


if __name__ == "__main__":
    main()
