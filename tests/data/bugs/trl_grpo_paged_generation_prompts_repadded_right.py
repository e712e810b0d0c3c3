"""TRL GRPOTrainer with use_transformers_paged: prompts re-padded on the right, mask still the left one.

Citation: huggingface/trl#3722 ("Fix CB in GRPO", commit 5a2b04a69), a late review of #3471 (02cce41d0,
"Add support for CB with native transformers"). I read trl/trainer/grpo_trainer.py before and after.

Bug: _generate_and_score_completions tokenizes the prompts with padding_side="left" and keeps
prompt_mask from that. In the continuous-batching branch (use_transformers_paged) it hands the unpadded
prompt_inputs.input_ids to generate_batch, then rebuilds prompt_ids with trl's pad(), whose default
padding_side is "right". prompt_completion_ids = cat([prompt_ids, completion_ids]) then has its pads
between prompt and completion, while attention_mask = cat([prompt_mask, completion_mask]) still marks the
LEFT columns as pad: in shorter prompts the first real prompt tokens are hidden and the pad ids are
attended. The old / reference / policy log-probs, the KL and the loss are taken over that.

Fix: pad(prompt_ids, ..., padding_side="left") (and padding_side="right" spelled out for completions).

This program: a word-level fast tokenizer, a tiny LlamaForCausalLM policy and a reference model, and the
trainer's generation/scoring path. generate_batch (transformers' continuous batching, per-request, no
padding) is stood in for by a per-request sampled generate(), which returns the same generated_tokens
per request; the rest is the trainer's code trimmed to one process.
"""
import sys
from types import SimpleNamespace

import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv


# trl/trainer/utils.py
def pad(tensors, padding_value=0, padding_side="right", pad_to_multiple_of=None):
    output_shape = np.max([t.shape for t in tensors], 0).tolist()
    if pad_to_multiple_of is not None:
        remainder = output_shape[0] % pad_to_multiple_of
        if remainder != 0:
            output_shape[0] += pad_to_multiple_of - remainder
    output = torch.full((len(tensors), *output_shape), padding_value, dtype=tensors[0].dtype, device=tensors[0].device)
    for i, t in enumerate(tensors):
        if padding_side == "left":
            seq_slice = slice(output_shape[0] - t.shape[0], output_shape[0])
        elif padding_side == "right":
            seq_slice = slice(0, t.shape[0])
        else:
            raise ValueError("padding_side must be 'left' or 'right'")
        slices = (seq_slice,) + tuple(slice(0, s) for s in t.shape[1:])
        output[i][slices] = t
    return output


def selective_log_softmax(logits, index):
    logps = torch.gather(logits.log_softmax(-1), dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
    return logps


def build_tokenizer():
    words = ["<pad>", "<eos>", "<bos>"] + [f"w{i}" for i in range(45)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


class GRPOTrainer:
    def __init__(self, model, ref_model, processing_class, args):
        self.model = model
        self.model_wrapped = model
        self.ref_model = ref_model
        self.processing_class = processing_class
        self.args = args
        self.max_prompt_length = args.max_prompt_length
        self.max_completion_length = args.max_completion_length
        self.num_generations = args.num_generations
        self.temperature = args.temperature
        self.beta = args.beta
        self.epsilon_low = self.epsilon_high = args.epsilon
        self.use_transformers_paged = args.use_transformers_paged
        self.mask_truncated_completions = False
        generation_kwargs = {
            "max_new_tokens": self.max_completion_length,
            "do_sample": True,
            "pad_token_id": processing_class.pad_token_id,
            "bos_token_id": processing_class.bos_token_id,
            "eos_token_id": processing_class.eos_token_id,
            "temperature": self.temperature,
            "top_k": 0,
        }
        self.generation_config = GenerationConfig(**generation_kwargs)

    def reward_func(self, completion_ids_list):
        # rule-based reward over token ids: how many "w7" the completion holds, minus a length cost
        return torch.tensor([float(sum(t == 10 for t in ids)) - 0.1 * len(ids) for ids in completion_ids_list])

    def _generate_batch(self, unwrapped_model, input_ids, generation_config):
        # stand-in for transformers' ContinuousMixin.generate_batch: each request runs alone, unpadded
        outputs = {}
        for i, ids in enumerate(input_ids):
            x = torch.tensor([ids])
            out = unwrapped_model.generate(x, attention_mask=torch.ones_like(x), generation_config=generation_config)
            outputs[f"req_{i}"] = SimpleNamespace(generated_tokens=out[0, x.shape[1]:].tolist())
        return outputs

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None):
        batch_size = batch_size or input_ids.size(0)
        all_logps = []
        for start in range(0, input_ids.size(0), batch_size):
            input_ids_batch = input_ids[start : start + batch_size]
            attention_mask_batch = attention_mask[start : start + batch_size]
            logits = model(
                input_ids=input_ids_batch, attention_mask=attention_mask_batch, logits_to_keep=logits_to_keep + 1
            ).logits
            logits = logits[:, :-1, :]
            logits = logits / self.temperature
            completion_ids = input_ids_batch[:, -logits_to_keep:]
            all_logps.append(selective_log_softmax(logits, completion_ids))
        return {"logps": torch.cat(all_logps, dim=0), "entropies": None}

    def _generate_and_score_completions(self, inputs):
        device = torch.device("cpu")
        prompts_text = [x["prompt"] for x in inputs]
        prompt_inputs = self.processing_class(
            text=prompts_text, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False
        )
        prompt_ids, prompt_mask = prompt_inputs["input_ids"], prompt_inputs["attention_mask"]
        if self.max_prompt_length is not None:
            prompt_ids = prompt_ids[:, -self.max_prompt_length :]
            prompt_mask = prompt_mask[:, -self.max_prompt_length :]

        if self.use_transformers_paged:
            prompt_inputs = self.processing_class(text=prompts_text)
            with torch.no_grad(), torch.inference_mode():
                all_outputs = self._generate_batch(
                    self.model_wrapped, prompt_inputs.input_ids, generation_config=self.generation_config
                )
            completion_ids = [output.generated_tokens for output in all_outputs.values()]
            completion_ids = [torch.tensor(ids, device=device) for ids in completion_ids]
            prompt_ids = [torch.tensor(ids, device=device) for ids in prompt_inputs.input_ids]
            if FIXED:
                completion_ids = pad(
                    completion_ids, padding_value=self.processing_class.pad_token_id, padding_side="right"
                )
                prompt_ids = pad(prompt_ids, padding_value=self.processing_class.pad_token_id, padding_side="left")
            else:
                completion_ids = pad(completion_ids, padding_value=self.processing_class.pad_token_id)
                prompt_ids = pad(prompt_ids, padding_value=self.processing_class.pad_token_id)
            prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)

        # Mask everything after the first EOS token
        is_eos = completion_ids == self.processing_class.eos_token_id
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        completion_ids_list = [
            [id.item() for id, m in zip(row, mask_row) if m] for row, mask_row in zip(completion_ids, completion_mask)
        ]

        # Concatenate prompt_mask with completion_mask for logit computation
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+C)
        logits_to_keep = completion_ids.size(1)

        with torch.no_grad():
            old_per_token_logps = self._get_per_token_logps_and_entropies(
                self.model, prompt_completion_ids, attention_mask, logits_to_keep
            )["logps"]
            ref_per_token_logps = self._get_per_token_logps_and_entropies(
                self.ref_model, prompt_completion_ids, attention_mask, logits_to_keep
            )["logps"]

        rewards = self.reward_func(completion_ids_list)
        mean_grouped_rewards = rewards.view(-1, self.num_generations).mean(dim=1)
        std_grouped_rewards = rewards.view(-1, self.num_generations).std(dim=1)
        mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        std_grouped_rewards = std_grouped_rewards.repeat_interleave(self.num_generations, dim=0)
        advantages = (rewards - mean_grouped_rewards) / (std_grouped_rewards + 1e-4)

        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "advantages": advantages,
            "old_per_token_logps": old_per_token_logps,
            "ref_per_token_logps": ref_per_token_logps,
        }

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        logits_to_keep = completion_ids.size(1)
        per_token_logps = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)[
            "logps"
        ]
        ref_per_token_logps = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        advantages = inputs["advantages"]
        old_per_token_logps = inputs["old_per_token_logps"]
        coef_1 = torch.exp(per_token_logps - old_per_token_logps)
        coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token_loss1 = coef_1 * advantages.unsqueeze(1)
        per_token_loss2 = coef_2 * advantages.unsqueeze(1)
        per_token_loss = -torch.min(per_token_loss1, per_token_loss2)
        per_token_loss = per_token_loss + self.beta * per_token_kl
        loss = (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
        mean_kl = (per_token_kl * completion_mask).sum() / completion_mask.sum()
        return loss, mean_kl, per_token_logps


def main():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    ref_model = LlamaForCausalLM(config).eval()
    model = LlamaForCausalLM(config)
    model.load_state_dict(ref_model.state_dict())
    with torch.no_grad():  # the policy has taken a few steps away from the reference
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.eval()

    args = SimpleNamespace(
        max_prompt_length=None, max_completion_length=6, num_generations=2, temperature=1.0, beta=0.04,
        epsilon=0.2, use_transformers_paged=True,
    )
    trainer = GRPOTrainer(model, ref_model, tokenizer, args)
    prompts = ["w3 w9 w12 w4 w30 w5 w8", "w3 w9 w12 w4 w30 w5 w8", "w17 w22", "w17 w22", "w40 w1 w6 w11", "w40 w1 w6 w11"]
    inputs = [{"prompt": p} for p in prompts]

    torch.manual_seed(1)
    batch = trainer._generate_and_score_completions(inputs)
    loss, mean_kl, per_token_logps = trainer._compute_loss(model, batch)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters() if p.grad is not None))

    print("prompt_completion_ids:\n", torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1))
    seq_logps = (per_token_logps * batch["completion_mask"]).sum(1)
    print("completion log-probs per row:", [round(v, 4) for v in seq_logps.tolist()])
    print(f"loss {loss.item():.6f}  mean_kl {mean_kl.item():.6f}  grad_norm {grad_norm.item():.6f}")


if __name__ == "__main__":
    main()
