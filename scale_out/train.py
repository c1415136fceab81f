"""One method trained by TRL's GRPOTrainer, on one process or many: the path past one GPU
(docs/README.md#scaling-out has the commands, the configs and the flag map).

    accelerate launch --config_file <trl>/accelerate_configs/multi_gpu.yaml --num_processes 8 \\
        scale_out/train.py --method cppo --dataset gsm8k --model Qwen/Qwen2.5-1.5B-Instruct \\
        --output_dir runs/cppo-trl --num_generations 16 --per_device_train_batch_size 64 ...
    accelerate launch --multi_gpu --num_processes 2 scale_out/train.py --method two_grpo \\
        --use_cpu --bf16 false --output_dir /tmp/two-grpo-trl --num_generations 2 ...  # 2 CPUs

Tested with TRL 1.16.0 and accelerate 1.15.0: tests/test_scale_out.py runs it on two CPU
processes. The flags are MethodArgs below (the method, its data, its own settings, named as in
its script) and every GRPOConfig field, by TRL's name (--num_generations, --beta, --loss_type,
...). The prompt is the dataset recipe's template as chat messages; the reward is
common.math_reward of the completion's text against the row's gold answer, as in the scripts.
"""
import dataclasses
import os
import sys

from datasets import Dataset
from transformers import AutoTokenizer, HfArgumentParser
from trl import GRPOConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from common import (DATASETS, TEMPLATES, gold_answer, load_dataset, math_reward,  # noqa: E402
                    recipe_of)
from mmr_grpo import encoder_recipe  # noqa: E402
from scale_out.trl_cppo import CPPOTrainer  # noqa: E402
from scale_out.trl_dppo import DPPOTrainer  # noqa: E402
from scale_out.trl_grpo import GRPOPlugin  # noqa: E402
from scale_out.trl_mmr_grpo import MMRGRPOTrainer  # noqa: E402
from scale_out.trl_two_grpo import TwoGRPOTrainer  # noqa: E402


@dataclasses.dataclass
class MethodArgs:
    method: str = dataclasses.field(metadata={
        "help": "the method", "choices": ["grpo", "two_grpo", "cppo", "dppo", "mmr_grpo"]})
    dataset: str = dataclasses.field(default="toy", metadata={
        "help": f"{' | '.join(DATASETS)} | a .jsonl file | a folder with train.jsonl"})
    model: str = dataclasses.field(default=None, metadata={
        "help": "policy: a model folder or hub id (default: the dataset's recipe)"})
    template: str = dataclasses.field(default=None, metadata={
        "help": "prompt template (default: the dataset's recipe)", "choices": list(TEMPLATES)})
    skip_tied: bool = dataclasses.field(default=True, metadata={"help": "two_grpo: --skip_tied"})
    pruning: float = dataclasses.field(default=0.875, metadata={"help": "cppo: --pruning"})
    prune_scope: str = dataclasses.field(default="batch", metadata={
        "help": "cppo: --prune_scope", "choices": ["batch", "question"]})
    prune_prompts: float = dataclasses.field(default=0.5, metadata={"help": "dppo: r_q"})
    prune_completions: float = dataclasses.field(default=0.5, metadata={"help": "dppo: r_o"})
    keep_floor: float = dataclasses.field(default=0.1, metadata={"help": "dppo: --keep_floor"})
    embed_model: str = dataclasses.field(default=None, metadata={
        "help": "mmr_grpo: --embed_model (default: the dataset's own, as mmr_grpo.py)"})
    sim_floor: bool = dataclasses.field(default=True, metadata={"help": "mmr_grpo: --sim_floor"})


def training_rows(args):
    """The dataset's training rows as TRL wants them: chat messages in `prompt`, and `gold`."""
    _, recipe = recipe_of(vars(args))  # the scripts' recipe (common.recipe_of)
    system, user = TEMPLATES[args.template or recipe["template"]]
    train, _, _ = load_dataset(args.dataset, recipe["eval_n"])
    rows = []
    for r in train:
        row = r["row"]  # as the file has it
        question = row["question"] if "question" in row else row["problem"]
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": user.replace("{question}", question)})
        rows.append({"prompt": messages, "gold": gold_answer(row)})
    return Dataset.from_list(rows)


def reward(completions, gold, **kwargs):
    """common.math_reward of each completion's text (TRL hands chat completions as messages)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [math_reward(text, g) for text, g in zip(texts, gold)]


def build(argv=None):
    """The trainer the flags describe, not yet trained."""
    parser = HfArgumentParser((MethodArgs, GRPOConfig))
    args, config = parser.parse_args_into_dataclasses(args=argv)
    _, recipe = recipe_of(vars(args))
    model = recipe["model"]  # --model, else the dataset's
    tokenizer = AutoTokenizer.from_pretrained(model)
    trainers = {  # the class and its own settings
        "grpo": (GRPOPlugin, {}),
        "two_grpo": (TwoGRPOTrainer, {"skip_tied": args.skip_tied}),
        "cppo": (CPPOTrainer, {"pruning": args.pruning, "prune_scope": args.prune_scope}),
        "dppo": (DPPOTrainer, {"prune_prompts": args.prune_prompts,
                               "prune_completions": args.prune_completions,
                               "keep_floor": args.keep_floor}),
        "mmr_grpo": (MMRGRPOTrainer, {
            "embed_model": args.embed_model or encoder_recipe(vars(args))["embed_model"],
            "sim_floor": args.sim_floor}),
    }
    trainer_class, settings = trainers[args.method]
    return trainer_class(model=model, reward_funcs=reward, args=config,
                         train_dataset=training_rows(args), processing_class=tokenizer, **settings)


def main():
    build().train()


if __name__ == "__main__":
    main()
