"""GRPO (grpo.py) as a plug-in for TRL's GRPOTrainer, and the machinery the four method plug-ins
share: each of them subclasses GRPOPlugin and overrides `select`, the method's own piece.

Tested with TRL 1.16.0, accelerate 1.15.0, transformers 5.24.0, torch 2.13.0 (CPU), on one process
and on two (accelerate launch, DDP over gloo): tests/test_scale_out.py. The hooks were read in TRL
1.16.0's trl/trainer/grpo_trainer.py; a later TRL may move them.

What the plug-in changes in GRPOTrainer, in the order of a step:
  1. `_generate_and_score_completions`: TRL generates and scores as it does, but the old-policy and
     reference passes it runs before the rewards are known are held back (passes_held_back);
  2. `select`, on the rewards of every process (TRL gathers them) and every process's completions
     (gathered here): grpo.py's advantages (common.group_advantages), which completions to train
     (here all), and their coefficients c_i (common.token_coefficients, normalised over the whole
     generation batch of all processes); every process computes the same selection;
  3. each process trains the kept rows it generated (they do not move between processes), padded
     with copies of coefficient 0 to a multiple of steps_per_generation micro-steps (DDP needs
     every process to run as many backward passes, each on a non-empty batch), and only then runs
     the old-policy (mu > 1) and reference (beta > 0) passes, on those rows;
  4. `_compute_loss`: common.token_loss per token, sum_i c_i sum_t loss_(i,t): grpo.py's loss. It
     returns that sum times num_processes x steps_per_generation / gradient_accumulation_steps,
     because DDP averages the processes' gradients and each optimiser step sees
     gradient_accumulation_steps of the steps_per_generation micro-batches.

What differs from grpo.py:
  * generation is TRL's (transformers generate, or its vLLM modes), with its own seeds;
  * TRL pads, it has no packing for GRPO: the log-probs are the packed ones to float error
    (~1e-6), at more compute; its softmax runs over the model's whole LM head, padded rows
    included, the scripts' over the tokenizer's vocabulary: nearly the same for a trained model,
    whose padded rows get almost no probability (the tests pin the difference on a random one);
  * TRL's default bf16=True runs under bf16 autocast, on CPU too; the scripts use bf16 on GPU
    only (bf16=False matches them on CPU);
  * the aggregation: TRL's own loss averages per micro-batch ("grpo": each micro-batch's mean
    over its sequences, divided by the accumulation steps). Here, as in grpo.py, the coefficients
    are normalised once over the generation batch; loss_type picks which: grpo -> seq_mean,
    dapo -> token_mean, dr_grpo -> constant (--loss_agg). tests/test_scale_out.py pins both;
  * scale_rewards: "group" is --std_mode unbiased, "none" is --std_mode none, both with TRL's eps
    1e-4 (--adv_eps); TRL's reward functions are summed with reward_weights, an unscorable (None)
    reward counts as 0;
  * --tis_cap has no counterpart: with vLLM, set vllm_importance_sampling_correction=False;
  * with a PEFT (LoRA) policy the reference is the policy with its adapters off, as --lora_r's in
    the scripts (TRL would use an adapter named "ref" if there is one); not run here;
  * the GRPOConfig fields whose effect lives in TRL's loss (LOSS_FIELDS) must keep their defaults;
    tools, environments and images are not supported; evaluation (eval_dataset) runs TRL's own
    batch and loss.
"""
import contextlib
import os
import sys

import torch
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the scripts
from common import Sample, group_advantages, token_coefficients, token_loss  # noqa: E402

LOSS_AGG = {"grpo": "seq_mean", "dapo": "token_mean", "dr_grpo": "constant"}  # loss_type: loss_agg
STD_MODE = {"group": "unbiased", "none": "none"}  # scale_rewards: --std_mode (eps 1e-4 in both)
# GRPOConfig fields that act in TRL's loss, which the plug-ins replace: each must keep its default
LOSS_FIELDS = ["importance_sampling_level", "top_entropy_quantile", "off_policy_mask_threshold",
               "delta", "use_bias_correction_kl", "entropy_coef", "use_adaptive_entropy",
               "mask_truncated_completions", "multi_objective_aggregation"]
# what TRL's batch may hold for the plug-ins (tool masks and images are not supported)
BATCH_KEYS = {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
              "num_items_in_batch", "sampling_per_token_logps"}


def check_config(args):
    """The GRPOConfig settings a plug-in cannot honour, refused by name."""
    if args.loss_type not in LOSS_AGG:
        raise ValueError(f"loss_type={args.loss_type!r}: the plug-ins take {sorted(LOSS_AGG)} "
                         "(grpo = seq_mean, dapo = token_mean, dr_grpo = constant)")
    if args.scale_rewards not in STD_MODE:
        raise ValueError(f"scale_rewards={args.scale_rewards!r}: the plug-ins take 'group' or "
                         "'none'")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        raise ValueError("use_vllm with vllm_importance_sampling_correction=True: the plug-ins "
                         "replace TRL's loss, which applies that correction; set it to False")
    for name in LOSS_FIELDS:
        default = GRPOConfig.__dataclass_fields__[name].default
        if getattr(args, name) != default:
            raise ValueError(f"{name}={getattr(args, name)!r}: it acts in TRL's loss, which the "
                             f"plug-ins replace; leave it at {default!r}")


def held_back(*args, **kwargs):
    """Stands in for TRL's log-prob pass while it builds the batch: no log-probs."""
    return None, None, None


@contextlib.contextmanager
def passes_held_back(trainer):
    """TRL runs the old-policy and reference passes over every completion before the rewards are
    known; inside this block they return nothing, and the plug-in runs them after `select`."""
    trainer._get_per_token_logps_and_entropies = held_back  # an instance attribute: the class's
    try:  # method is untouched, and is found again once the attribute is gone
        yield
    finally:
        del trainer._get_per_token_logps_and_entropies


class GRPOPlugin(GRPOTrainer):
    """GRPOTrainer with grpo.py's advantages and batch-normalised loss. After a training step,
    `last_selection` holds what `select` returned for its generation batch, with the rewards and
    the samples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_config(self.args)
        self.loss_agg = LOSS_AGG[self.loss_type]
        self.std_mode = STD_MODE[self.scale_rewards]
        self.adv_eps = 1e-4  # TRL's, fixed
        self.last_selection = None

    def select(self, rewards, samples):
        """grpo.py's step 3 on the whole generation batch, rewards [Q, G] and its Q G samples (in
        the rewards' order): the advantages [Q, G], the kept flat indices (here all), their c_i."""
        advantages = group_advantages(rewards, self.std_mode, self.adv_eps)  # [Q, G]
        lengths = [len(s.completion_ids) for s in samples]
        coefs = token_coefficients(lengths, self.loss_agg, max_len=self.max_completion_length)
        return {"advantages": advantages, "kept": list(range(len(samples))), "coefs": coefs}

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards [N, reward functions] of every process's completions, kept for `select`."""
        self.gathered_rewards = super()._calculate_rewards(inputs, prompts, completions,
                                                           completion_ids_list)
        return self.gathered_rewards

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:  # evaluation: TRL's own batch, scored by TRL's own loss
            return super()._generate_and_score_completions(inputs)
        with passes_held_back(self):
            batch = super()._generate_and_score_completions(inputs)
        unsupported = set(batch) - BATCH_KEYS
        if unsupported:
            raise NotImplementedError(f"the plug-ins do not handle {sorted(unsupported)} (tools, "
                                      "environments, images)")
        weights = self.reward_weights.to(self.gathered_rewards.device)
        rewards = (self.gathered_rewards * weights).nansum(dim=1).cpu()  # [N], as TRL sums them
        samples = self.gather_samples(batch)
        chosen = self.select(rewards.view(-1, self.num_generations), samples)
        self.last_selection = {"rewards": rewards.view(-1, self.num_generations),
                               "samples": samples, **chosen}
        rows, advantages, coefs = self.local_rows(chosen, len(batch["completion_ids"]))
        device = batch["completion_ids"].device
        index = torch.tensor(rows, device=device)
        out = {key: batch[key][index]
               for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        out["advantages"] = torch.tensor(advantages, device=device)
        out["coef"] = torch.tensor(coefs, device=device)
        out["num_items_in_batch"] = batch["num_items_in_batch"]  # (TRL's count; unused here)
        self.kept_passes(out)
        self._metrics["train"]["kept_frac"].append(len(chosen["kept"]) / len(samples))
        return out

    def gather_samples(self, batch):
        """Every process's (prompt, completion) pairs as Samples, in the order of TRL's gathered
        rewards."""
        pad = self._tokenizer.pad_token_id
        columns = []
        for ids, mask, left in [("prompt_ids", "prompt_mask", True),
                                ("completion_ids", "completion_mask", False)]:
            ids = self.accelerator.pad_across_processes(batch[ids], dim=1, pad_index=pad,
                                                        pad_first=left)
            mask = self.accelerator.pad_across_processes(batch[mask], dim=1, pad_first=left)
            ids = self.accelerator.gather(ids).cpu()  # [N, width]
            mask = self.accelerator.gather(mask).cpu().bool()  # [N, width]
            columns.append([row[keep].tolist() for row, keep in zip(ids, mask)])
        return [Sample(prompt_ids=p, completion_ids=c) for p, c in zip(*columns)]

    def local_rows(self, chosen, n_local):
        """This process's kept rows: (local indices, advantages, c_i), padded with copies of c = 0
        to a multiple of steps_per_generation, at least one row per micro-step."""
        start = self.accelerator.process_index * n_local  # its rows in the gathered order
        advantages = chosen["advantages"].flatten().tolist()
        rows = []
        adv = []
        coefs = []
        for i, c in zip(chosen["kept"], chosen["coefs"].tolist()):
            if start <= i < start + n_local:
                rows.append(i - start)
                adv.append(advantages[i])
                coefs.append(c)
        micro_steps = self.args.steps_per_generation
        filled = max(micro_steps, -(-len(rows) // micro_steps) * micro_steps)
        padding = filled - len(rows)
        rows += [rows[0] if rows else 0] * padding  # zero coefficient: no loss, no gradient
        adv += [0.0] * padding
        coefs += [0.0] * padding
        return rows, adv, coefs

    @torch.no_grad()
    def kept_passes(self, out):
        """The old-policy pass (when TRL would run it: mu > 1, or a generation batch that spans
        optimiser steps) and the reference pass (beta > 0), on the kept rows only."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        width = out["completion_ids"].size(1)
        chunk = self.args.per_device_train_batch_size
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.args.gradient_accumulation_steps % generate_every != 0:  # TRL's own condition
            out["old_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, width, batch_size=chunk)[0]
        if not self.beta:
            return
        if self.ref_model is not None:
            out["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.ref_model, ids, mask, width, batch_size=chunk)[0]
            return
        policy = self.accelerator.unwrap_model(self.model)  # a PEFT policy: its adapter off
        with policy.disable_adapter():
            out["ref_per_token_logps"] = self._get_per_token_logps_and_entropies(
                self.model, ids, mask, width, batch_size=chunk)[0]

    def _compute_loss(self, model, inputs):
        if "coef" not in inputs:  # evaluation: TRL's own loss
            return super()._compute_loss(model, inputs)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps = self._get_per_token_logps_and_entropies(model, ids, mask,
                                                        inputs["completion_ids"].size(1))[0]
        tokens = inputs["completion_mask"].bool()  # [n, C]
        logp = logps[tokens]  # [T]: the completion tokens, row after row
        old = logp.detach()  # on-policy: ratio 1 in value
        if "old_per_token_logps" in inputs:
            old = inputs["old_per_token_logps"][tokens]
        ref = inputs["ref_per_token_logps"][tokens] if self.beta else None
        adv = inputs["advantages"][:, None].expand_as(logps)[tokens]  # [T]
        coef = inputs["coef"][:, None].expand_as(logps)[tokens]  # [T]
        loss, kl, clipped = token_loss(logp, old, ref, adv, self.epsilon_low, self.epsilon_high,
                                       self.beta)  # [T] each
        self.log_token_stats(kl, clipped, coef != 0)
        scale = (self.accelerator.num_processes * self.args.steps_per_generation
                 / self.current_gradient_accumulation_steps)
        return (loss * coef).sum() * scale

    def log_token_stats(self, kl, clipped, real):
        """The mean KL and clip fraction over the kept tokens of every process (padding copies
        excluded)."""
        sums = torch.stack([kl[real].sum(), clipped[real].sum(), real.sum()]).float()
        kl_sum, clipped_sum, count = self.accelerator.reduce(sums, reduction="sum").tolist()
        self._metrics["train"]["kl"].append(kl_sum / max(count, 1))
        self._metrics["train"]["clip_ratio"].append(clipped_sum / max(count, 1))
