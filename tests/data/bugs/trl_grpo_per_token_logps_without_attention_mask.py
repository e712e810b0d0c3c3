"""TRL GRPOTrainer: per-token log-probs computed over left-padded prompts without an attention mask.

Citation: huggingface/trl#2708 ("Fix attention masking in GRPO", merged as bbdd6db17). I read the diff of
trl/trainer/grpo_trainer.py in that commit.

Bug: compute_loss tokenized the prompts with padding_side="left", concatenated the (vLLM) completions padded
on the right with pad_token_id, and called get_per_token_logps(model, prompt_completion_ids,
logits_to_keep), i.e. model(input_ids, logits_to_keep=...) with no attention_mask. The model then took its
causal-only path: completion tokens of short prompts attended the left padding of the prompt, for the
policy and for the reference model alike.

Fix: build completion_mask (up to the first EOS), attention_mask = cat([prompt_mask.repeat_interleave(G),
completion_mask]), and pass it to model(input_ids=..., attention_mask=..., logits_to_keep=...).

This program: the trainer's batch assembly (num_generations completions per prompt) and a Llama-style
policy whose attention takes HF's SDPA route: is_causal=True without a mask, else an explicit 4-D mask.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv


@dataclass
class GRPOConfig:
    num_generations: int = 2
    max_prompt_length: int = 8
    beta: float = 0.04


class ProcessingClass:
    pad_token_id = 0
    eos_token_id = 2
    padding_side = "left"

    def __call__(self, prompt_ids):
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompt_ids])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class LlamaSdpaAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, causal_mask):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim).permute(
            2, 0, 3, 1, 4)
        is_causal = causal_mask is None and q_len > 1
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2, max_positions=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_positions, hidden_size)
        self.layers = nn.ModuleList(LlamaSdpaAttention(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        seq_len = input_ids.shape[1]
        if attention_mask is None:
            causal_mask = None
            position_ids = torch.arange(seq_len)[None]
        else:
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            tril = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
            causal_mask = tril[None, None] & attention_mask[:, None, None, :].bool()
            # as HF _unmask_unattended: fully masked rows (left-padding queries) attend all keys, not NaN
            causal_mask = causal_mask | ~causal_mask.any(-1, keepdim=True)
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            h = h + layer(h, causal_mask)
        return self.lm_head(h[:, -logits_to_keep:, :])


class GRPOTrainer:
    def __init__(self, model, ref_model, args, processing_class):
        self.model, self.ref_model = model, ref_model
        self.args = args
        self.num_generations = args.num_generations
        self.processing_class = processing_class

    def get_per_token_logps(self, model, input_ids, attention_mask, logits_to_keep):
        if FIXED:
            logits = model(input_ids=input_ids, attention_mask=attention_mask,
                           logits_to_keep=logits_to_keep + 1)
        else:
            logits = model(input_ids, logits_to_keep=logits_to_keep + 1)
        logits = logits[:, :-1, :]
        input_ids = input_ids[:, -logits_to_keep:]
        return logits.log_softmax(-1).gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)

    def compute_loss(self, prompts, completion_ids):
        prompt_inputs = self.processing_class(prompts)
        completion_ids = pad_sequence([torch.tensor(c) for c in completion_ids], batch_first=True,
                                      padding_value=self.processing_class.pad_token_id)
        prompt_inputs_repeated = torch.repeat_interleave(prompt_inputs["input_ids"], self.num_generations, dim=0)
        prompt_completion_ids = torch.cat([prompt_inputs_repeated, completion_ids], dim=1)

        is_eos = completion_ids == self.processing_class.eos_token_id
        eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
        eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
        sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
        completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
        prompt_mask_repeated = prompt_inputs["attention_mask"].repeat_interleave(self.num_generations, dim=0)
        attention_mask = torch.cat([prompt_mask_repeated, completion_mask], dim=1)

        logits_to_keep = completion_ids.size(1)
        per_token_logps = self.get_per_token_logps(self.model, prompt_completion_ids, attention_mask,
                                                   logits_to_keep)
        with torch.inference_mode():
            ref_per_token_logps = self.get_per_token_logps(self.ref_model, prompt_completion_ids, attention_mask,
                                                           logits_to_keep)
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (
            ref_per_token_logps - per_token_logps) - 1
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
        per_token_loss = torch.exp(per_token_logps - per_token_logps.detach()) * advantages.unsqueeze(1)
        per_token_loss = -(per_token_loss - self.args.beta * per_token_kl)
        return ((per_token_loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1)).mean()


def main():
    torch.manual_seed(0)
    model, ref_model = LlamaForCausalLM(), LlamaForCausalLM()
    trainer = GRPOTrainer(model, ref_model, GRPOConfig(), ProcessingClass())
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    completions = [[20, 21, 2], [22, 2], [23, 24, 25, 2], [26, 2]]
    loss = trainer.compute_loss(prompts, completions)
    print("loss %.5f" % loss.item())


if __name__ == "__main__":
    main()
