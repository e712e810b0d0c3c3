"""Unsloth GRPO: the policy forward over left-padded prompt+completion batches gets no attention_mask.

Citation: unslothai/unsloth PR #3176 "Pass attention mask when doing GRPO" (open when read; `--fixed`
applies its change).

Bug (from the PR description): GRPO generates from left-padded prompts, then re-runs the policy over
`prompt_ids + completion_ids` to get per-token log-probs for the loss. Unsloth's
`grpo_accumulated_loss` called the model with `input_ids` only, no `attention_mask`, so every real
token attended to the leading padding tokens of the shorter prompts (and with FlashAttention, which has
no left padding, the gradients blew up to NaN).

Fix: pass the batch's `attention_mask` (prompt mask concatenated with the completion mask) to the
model call.

This program: a two-sample group, the first prompt left-padded by 3 tokens; a tiny causal LM whose
attention runs `F.scaled_dot_product_attention` with `is_causal=True` when no mask is given and with a
causal & padding boolean mask otherwise (the Hugging Face convention). The trainer-side names
(`prompt_mask`, `completion_mask`, `logits_to_keep`, `grpo_accumulated_loss`) follow TRL / Unsloth;
the function bodies are reconstructions from the PR description, not the upstream diff.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size)

    def forward(self, input_ids, attention_mask=None, logits_to_keep=0):
        h = self.embed_tokens(input_ids)
        b, n, d = h.shape
        q, k, v = self.qkv(h).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            mask = causal[None, None] & attention_mask.bool()[:, None, None, :]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + out.transpose(1, 2).reshape(b, n, d)
        logits = self.lm_head(h)
        return logits[:, -logits_to_keep:, :] if logits_to_keep else logits


def grpo_accumulated_loss(trainer, input_ids, attention_mask, logits_to_keep, completion_mask, advantages):
    model = trainer["model"]
    if FIXED:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1)
    else:
        logits = model(input_ids=input_ids, logits_to_keep=logits_to_keep + 1)
    logits = logits[:, :-1, :]  # the last logit predicts past the sequence
    completion_ids = input_ids[:, -logits_to_keep:]
    per_token_logps = torch.gather(logits.log_softmax(-1), 2, completion_ids.unsqueeze(-1)).squeeze(-1)
    per_token_loss = -(per_token_logps - per_token_logps.detach()).exp() * advantages.unsqueeze(1)
    return ((per_token_loss * completion_mask).sum(1) / completion_mask.sum(1)).mean(), per_token_logps


def main():
    torch.manual_seed(0)
    pad_token_id = 0
    trainer = {"model": TinyCausalLM().eval()}
    # left-padded prompts (processing_class.padding_side == "left"), then the sampled completions
    prompt_ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
    prompt_mask = (prompt_ids != pad_token_id).long()
    completion_ids = torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]])
    completion_mask = torch.ones_like(completion_ids)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    advantages = torch.tensor([1.0, -1.0])
    with torch.no_grad():
        loss, logps = grpo_accumulated_loss(trainer, input_ids, attention_mask, logits_to_keep, completion_mask, advantages)
    print("fixed" if FIXED else "buggy", "completion logps row0", [round(v, 4) for v in logps[0].tolist()])


if __name__ == "__main__":
    main()
