"""grpo.py's default run on a built-in task, done by TRL's GRPOTrainer: the peer comparison in
docs/results.md.

Not part of the project (nothing imports it, the tests do not run it): TRL pads every batch, this
project packs, and this script measures what that is worth end to end. It needs its own
environment, because TRL pins its own versions:

    python -m venv trl-venv
    trl-venv/bin/pip install torch==2.13.0 trl==1.16.0 math-verify==0.9.0
    # prints the median step time:
    trl-venv/bin/python docs/trl_peer.py --dataset chains --out /tmp/trl-chains
    python docs/trl_peer.py --plot runs/grpo-chains/metrics.jsonl \
        /tmp/trl-chains/step_times.json out.png

Matched to `python grpo.py --dataset <task>` (the task's recipe in common.DATASETS: model, data,
B prompts x G = 8 completions in one padded batch, one optimiser step per rollout, max new tokens,
temperature 1, the learning rate, constant schedule, beta 0.04 (k3 to the initial model), clip 0.2,
AdamW (0.9, 0.999) without weight decay, grad clip 1, fp32, no gradient checkpointing) with the same
reward, common.math_reward. Not matched: TRL generates with transformers generate (its vLLM mode
needs a GPU), grpo.py with the vLLM engine; TRL's "grpo" loss averages each sequence's tokens and
then the sequences of the batch, grpo.py's seq_mean the same, normalised once over the batch.
"""
import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def plot(ours, trl, out):
    """Reward per step of both runs, side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in open(ours)]
    mine = [(r["step"], r["reward_mean"]) for r in rows if "reward_mean" in r]
    theirs = json.load(open(trl))["reward"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(*zip(*mine), label="grpo.py (vLLM, packed)")
    ax.plot(range(1, len(theirs) + 1), theirs, label="TRL 1.16 GRPOTrainer (generate, padded)")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's rollouts")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="toy", choices=["toy", "chains"],
                   help="built-in task (default toy)")
    p.add_argument("--out", help="output folder (TRL's, and step_times.json)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: the task's recipe)")
    p.add_argument("--seed", type=int, default=0, help="seed")
    p.add_argument("--plot", nargs=3, metavar=("OURS", "TRL", "PNG"),
                   help="draw grpo.py's metrics.jsonl and this "
                   "script's step_times.json into PNG, then stop (needs matplotlib)")
    args = p.parse_args()
    if args.plot:
        return plot(*args.plot)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from common import DATASETS, math_reward

    recipe = DATASETS[args.dataset]
    B, G = recipe["prompts_per_step"], 8

    class StepTimer(TrainerCallback):
        """Wall time of every optimiser step: rollout, reward and update, as grpo.py's step_s."""

        def __init__(self):
            self.times = []

        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            self.times.append(time.perf_counter() - self.t0)

    def reward(completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [math_reward(t, gold) for t, gold in zip(texts, answer)]

    rows = [json.loads(line) for line in open(os.path.join(recipe["path"], "train.jsonl"))]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                               "answer": r["answer"]}
                              for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(recipe["model"])
    model = AutoModelForCausalLM.from_pretrained(recipe["model"], dtype="float32",
                                                 attn_implementation="sdpa")
    config = GRPOConfig(output_dir=args.out, max_steps=args.steps or recipe["steps"],
                        per_device_train_batch_size=B * G, gradient_accumulation_steps=1,
                        num_generations=G, max_completion_length=recipe["max_tokens"],
                        temperature=1.0, learning_rate=recipe["lr"], lr_scheduler_type="constant",
                        warmup_steps=0, weight_decay=0.0, adam_beta2=0.999, max_grad_norm=1.0,
                        beta=0.04, epsilon=0.2, num_iterations=1, loss_type="grpo",
                        scale_rewards="group", use_vllm=False, bf16=False, fp16=False,
                        gradient_checkpointing=False, logging_steps=1, save_strategy="no",
                        report_to=[], seed=args.seed, use_cpu=True, dataloader_num_workers=0)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    # the first step carries one-off start-up work, as in bench.py's step split
    steady = timer.times[1:]
    result = {"median_step_s": statistics.median(steady), "step_s": timer.times, "reward": rewards}
    with open(os.path.join(args.out, "step_times.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"TRL {__import__('trl').__version__} on {args.dataset}: median step "
          f"{result['median_step_s']:.3f} s over {len(steady)} steps (first step "
          f"{timer.times[0]:.2f} s left out); reward {rewards[0]:.3f} -> {rewards[-1]:.3f}")


if __name__ == "__main__":
    main()
